"""Paths and small helpers shared by the tests (fixtures live in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the real files the tests read: sources, licences, sha256 in its README.md
STORIES = DATA / "stories260K"
TEXT = DATA / "text"
TOKENIZERS = DATA / "tokenizers"


def need(path: Path) -> Path:
    """``path``, an input in the repository (its assets or ``tests/data``): a missing one fails the test.

    A missing data file is a bug, never a reason to skip; only absent hardware (CUDA) or an
    optional engine (``llama_cpp``) skips, through ``pytest.importorskip`` or a marker.
    """
    if not path.exists():
        pytest.fail(f"{path} is missing: it is part of the repository's test data "
                    f"(see {DATA / 'README.md'}); restore it rather than skip the test", pytrace=False)
    return path


def story_text(n_chars: int = 2000) -> str:
    return need(TEXT / "tinystories_sample.txt").read_text()[:n_chars]


def make_tiny_llama(out_dir: Path, n_layer: int = 3, hidden_act: str = "relu", n_embd: int = 32,
                    n_ff: int = 48, n_head: int = 4, n_head_kv: int = 2, seed: int = 0, **extra) -> Path:
    """A randomly initialised LlamaForCausalLM (vocab 512, stories260K's tokenizer) saved in HF layout."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer,
                      num_attention_heads=n_head, num_key_value_heads=n_head_kv, hidden_act=hidden_act,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      **extra)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so activations are not all tiny
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / "hf" / name, out_dir / name)
        (out_dir / name).chmod(0o644)
    return out_dir


def teacher_forced(model, ids, n_prefill):
    """Logits ``[len(ids), V]``: a ``n_prefill``-token prompt, then one cached decode step per token."""
    import torch

    with torch.inference_mode():
        out = [model.forward(torch.tensor(ids[:n_prefill]), 0, all_logits=True)]
        for pos in range(n_prefill, len(ids)):
            out.append(model.forward(torch.tensor([ids[pos]]), pos)[None])
    return torch.cat(out)


def all_active_predictors(folder, n_embd, n_ff, n_layer):
    """Predictors with fc1 = 0: every logit is 0 >= threshold 0, so every neuron is predicted active."""
    import torch

    from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir

    layers = [LayerPredictor(torch.zeros(4, n_embd), torch.randn(n_ff, 4)) for _ in range(n_layer)]
    return save_predictor_dir(folder, layers, {"sparse_threshold": 0.0})


def random_predictors(folder, n_layer, n_embd, n_ff, hidden=(8, 12, 16)):
    """Random predictors (layer ``i`` of width ``hidden[i % len(hidden)]``) saved with threshold 0.25."""
    import torch

    from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir

    g = torch.Generator().manual_seed(1)
    layers = [LayerPredictor(torch.randn(hidden[i % len(hidden)], n_embd, generator=g),
                             torch.randn(n_ff, hidden[i % len(hidden)], generator=g)) for i in range(n_layer)]
    save_predictor_dir(folder, layers, {"sparse_threshold": 0.25})
    return layers

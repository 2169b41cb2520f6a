"""Paths and small helpers shared by the tests (fixtures live in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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


# --------------------------------------------------------------------------- batched decoding (runtime/batch.py)
def alone(model, prompt, n, token_by_token=False):
    """(greedy tokens, logits [n, V]) of ``prompt`` decoded by itself through the model's own path
    (the prompt in one pass, or one token at a time)."""
    import torch

    from powerinfer.runtime import batch

    cache = batch.new_cache(model, 128)
    if token_by_token:
        for i, t in enumerate(prompt[:-1]):
            batch.prefill(model, cache, [t], i)
        logits = [batch.prefill(model, cache, prompt[-1:], len(prompt) - 1)]
    else:
        logits = [batch.prefill(model, cache, prompt, 0)]
    toks = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits.append(batch.prefill(model, cache, [toks[-1]], len(prompt) + i))
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


def batched(model, prompts, n, mode, start=None):
    """The same through BatchDecoder; sequence ``b`` joins at step ``start[b]`` (continuous batching:
    the batch grows and shrinks) and stops after ``n`` tokens."""
    import torch

    from powerinfer.runtime import batch

    dec = batch.BatchDecoder(model, mode)
    start = start or [0] * len(prompts)
    caches = [batch.new_cache(model, 128) for _ in prompts]
    toks, logits = [[] for _ in prompts], [[] for _ in prompts]
    step = 0
    while any(len(t) < n for t in toks):
        run = []
        for b, p in enumerate(prompts):
            if step == start[b]:  # joins: its prompt, then its first token comes from the prefill
                logits[b].append(batch.prefill(model, caches[b], p, 0))
                toks[b].append(int(logits[b][-1].argmax()))
            elif start[b] < step and len(toks[b]) < n:
                run.append(b)
        if run:
            out = dec.step([toks[b][-1] for b in run], [caches[b] for b in run],
                           [len(prompts[b]) + len(toks[b]) - 1 for b in run])
            for b, lg in zip(run, out):
                logits[b].append(lg)
                toks[b].append(int(lg.argmax()))
        step += 1
    return toks, [torch.stack(lg) for lg in logits], dec


def entries_batched(model, prompts, n, mode, per_step=3):
    """(greedy tokens, logits [n, V] per sequence, the BatchDecoder) with every prompt evaluated as
    entries of batched steps too: ``per_step`` tokens of a prompt per step beside the other sequences'
    decode tokens (a cache appearing several times in a step), then one token per step. Compare with
    :func:`alone` ``token_by_token=True``."""
    import torch

    from powerinfer.runtime import batch

    dec = batch.BatchDecoder(model, mode)
    caches = [batch.new_cache(model, 128) for _ in prompts]
    done = [0] * len(prompts)
    toks, logits = [[] for _ in prompts], [[] for _ in prompts]
    while any(len(t) < n for t in toks):
        tk, cs, ps, want_i, owner = [], [], [], [], []
        for b, p in enumerate(prompts):
            if done[b] < len(p):  # its next (at most) per_step prompt tokens
                k = min(per_step, len(p) - done[b])
                tk += p[done[b]:done[b] + k]
                cs += [caches[b]] * k
                ps += list(range(done[b], done[b] + k))
                done[b] += k
                if done[b] == len(p):
                    want_i.append(len(tk) - 1)
                    owner.append(b)
            elif len(toks[b]) < n:
                tk.append(toks[b][-1])
                cs.append(caches[b])
                ps.append(len(p) + len(toks[b]) - 1)
                want_i.append(len(tk) - 1)
                owner.append(b)
        out = dec.step(tk, cs, ps, want_i)
        assert out.shape[0] == len(want_i)
        for b, lg in zip(owner, out):
            logits[b].append(lg)
            toks[b].append(int(lg.argmax()))
    return toks, [torch.stack(lg) for lg in logits], dec


def q8_K(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ggml's quantize_row_q8_K_ref rounds it (the K-quant kernels' activation), written
    from its definition in numpy float32: per block of 256, ``max`` the first value of largest
    magnitude, ``iscale = -127 / max``, ``q = min(127, nearest_int(iscale * x))`` (round half to
    even: the 1.5 * 2**23 trick), ``d = 1 / iscale``; an all-zero block stays zero."""
    b = x.float().numpy().reshape(-1, 256)
    out = np.zeros_like(b)
    for i, row in enumerate(b):
        j = int(np.argmax(np.abs(row)))  # the first of the largest
        if row[j] == 0:
            continue
        iscale = np.float32(-127.0) / row[j]
        v = (iscale * row + np.float32(12582912.0)) - np.float32(12582912.0)  # fp32 adds: nearest even
        out[i] = np.minimum(np.float32(127), v) * (np.float32(1.0) / iscale)
    return torch.from_numpy(out.reshape(x.shape))

"""The designed MoE benchmark models (powerinfer/synthetic_moe.py) meet their targets and load as their family.

Tiny versions of the two shapes (n_embd 128, 32 experts): the routing frequencies and the ReGLU
neuron firing shares measured on held-out tokens match the power laws asked for, in the shallow
layers and repeated; transformers' ``Qwen3MoeForCausalLM`` loads the Qwen3-MoE folder with no
missing or unexpected tensor and routes the held-out tokens as the design measured.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import need
from powerinfer.synthetic import power_law_probs
from powerinfer.synthetic_moe import build_moe_hf, calibration_ids, qwen3_30b, smallthinker_21b, tiny
from test_convert_vocab import VOCAB, qwen15_base

TEXT = "powerinfer/assets/calibration.txt"


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    from powerinfer.formats.gguf_file import open_gguf

    d = qwen15_base(tmp_path_factory.mktemp("tok"), open_gguf(need(VOCAB / "ggml-vocab-qwen2.gguf")))
    return {n: d / n for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}


def _text():
    from pathlib import Path

    return need(Path(__file__).resolve().parents[1] / TEXT).read_text()


def _expected_top10(s) -> float:
    p, _ = power_law_probs(s.n_expert, s.n_expert_used / s.n_expert, s.expert_top10)
    return float(p[: s.n_expert // 10].sum() / p.sum())


def test_smallthinker_routing_and_neuron_sparsity_meet_the_design(tmp_path, tokenizer_files):
    s = tiny(smallthinker_21b(2), n_expert=32, calib_tokens=768)
    info = build_moe_hf(tmp_path / "hf", s, tokenizer_files, _text(), repeat=3, log=lambda m: None)
    want = _expected_top10(s)
    assert len(info["layers"]) == 2 and len(info["deep_layers"]) == 6
    for st in info["layers"] + info["deep_layers"]:
        assert abs(st["top10_share"] - want) < 0.06, (st, want)
        assert abs(st["neuron_active"] - s.neuron_active) < 0.02, st
    assert info["residual_growth"] < 1.1  # the layers add little: repeated layers see the designed inputs
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["SmallThinkerForCausalLM"] and cfg["moe_num_primary_experts"] == 32
    assert cfg["rope_layout"] == [0, 1] and cfg["sliding_window_layout"] == [0, 1]
    names = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.primary_router.weight" in names
    assert sum(".experts." in n for n in names) == 2 * 32 * 3


def test_qwen3moe_folder_loads_in_transformers_and_routes_as_designed(tmp_path, tokenizer_files):
    from transformers import Qwen3MoeForCausalLM

    s = tiny(qwen3_30b(2), n_expert=32, calib_tokens=512)
    d = tmp_path / "hf"
    info = build_moe_hf(d, s, tokenizer_files, _text(), log=lambda m: None)
    model, loading = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    ids = calibration_ids(d / "tokenizer.json", _text(), s.calib_tokens)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    for il, logits in enumerate(out.router_logits):
        top = logits.reshape(len(ids), s.n_expert)[1::2].topk(s.n_expert_used, dim=-1).indices
        freq = np.sort(np.bincount(top.reshape(-1).numpy(), minlength=s.n_expert) / top.shape[0])[::-1]
        got = freq[: s.n_expert // 10].sum() / freq.sum()
        assert abs(got - info["layers"][il]["top10_share"]) < 0.01, (il, got, info["layers"][il])
        assert abs(freq[0] - info["layers"][il]["hottest_expert"]) < 0.01
    assert abs(info["layers"][0]["top10_share"] - _expected_top10(s)) < 0.06

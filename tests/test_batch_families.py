"""Batched decoding (runtime/batch.py) for every family, not only the Llama-shaped stories260K of
test_batch.py: a sequence decoded in a batch gets bit for bit the logits it gets alone.

The small models of family_models.py, converted to Q4_0 with Q8_0 random predictors (the union
FFN needs quantized weights on the C kernels, :meth:`BatchDecoder.union_ok`):

* ``relu_llama``: ReluLLaMA-70B's GQA (4 q heads on 2 kv heads), ReGLU;
* ``prosparse``: FATReLU with a threshold that matters (0.3), ReGLU;
* ``bamboo``: dReLU (``dreglu``), GQA 8:2, sliding window of 8 tokens, shorter than the long prompt
  and than the positions decoded;
* ``falcon``: Falcon-40B's layout: parallel attention with two layernorms, GQA 8:2, ReLU without gate;
* ``falcon_7b``: Falcon-7B's layout: parallel attention with one shared layernorm, multi-query;
* ``opt``: learned positions (row ``p + 2``), biases everywhere, ReLU without gate: the union FFN
  adds the up and down biases to each token's own rows.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from family_models import BUILDERS, N_LAYER, PROSPARSE_THRESHOLD, SLIDING_WINDOW, make_falcon
from helpers import alone, batched, entries_batched, random_predictors
from powerinfer.convert.writer import convert
from powerinfer.families import hf_dims
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import resolve_model
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer

FAMILIES = ["relu_llama", "prosparse", "bamboo", "falcon", "falcon_7b", "opt"]
# ids below every test model's vocabulary (384 for the byte-level BPE of Falcon and OPT); the
# first prompt is longer than Bamboo's window, so its prefill and every decode step is windowed
PROMPTS = [[1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [1, 200, 201], [1, 300, 5, 6, 7, 8], [1, 42]]
START = [0, 0, 1, 3]  # steps the sequences join at: the batch grows 2 -> 4 and shrinks to 1
N = 8  # tokens generated per sequence


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    """One family's Q4_0 PowerInfer file (random predictors of width 32, Q8_0, threshold 0.25:
    about half the neurons predicted active) and the model loaded from it."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    d = make_falcon(tmp / "hf", seven_b=True) if name == "falcon_7b" else BUILDERS[name](tmp / "hf")
    dims = hf_dims(resolve_model(d)[1])
    random_predictors(tmp / "pred", N_LAYER, dims["n_embd"], dims["n_ff"], hidden=(32,))
    path = convert(d, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="q4_0", progress=False)
    return SimpleNamespace(name=name, path=path)


def _model(fam) -> Transformer:
    kernels.set_backend("auto")
    return Transformer(open_gguf(fam.path))


# Batch size of each decode step of :func:`helpers.batched` for START and N, by hand: sequence b
# decodes at steps START[b] + 1 .. START[b] + N - 1 (its first token comes from its prefill), so
# steps 1..10 hold {0,1}, {0,1,2} x2, {0,1,2,3} x4, {2,3}, {3} x2
SIZES = [2, 3, 3, 4, 4, 4, 4, 2, 1, 1]


def _recording_steps(monkeypatch) -> list[int]:
    """The batch size of every BatchDecoder.step call from now on (what ran, not what was planned)."""
    from powerinfer.runtime.batch import BatchDecoder

    seen, real = [], BatchDecoder.step

    def step(self, tokens, *a, **k):
        seen.append(len(tokens))
        return real(self, tokens, *a, **k)

    monkeypatch.setattr(BatchDecoder, "step", step)
    return seen


def test_family_models_have_the_structure_the_batch_tests_claim(fam):
    """What each family brings to the batch path is in the loaded file (not vacuous)."""
    m = _model(fam)
    a, f0 = m.args, m.layers[0].ffn
    assert a.sparse and m.quantized and f0.up.btype.name == "Q4_0" and f0.fc1.btype.name == "Q8_0"
    if fam.name in ("relu_llama", "bamboo", "falcon", "falcon_7b"):
        assert a.n_head_kv < a.n_head
    if fam.name == "prosparse":
        assert a.activation.kind == "fatrelu" and a.activation.threshold == pytest.approx(PROSPARSE_THRESHOLD)
    if fam.name == "bamboo":
        assert a.family.ffn == "dreglu" and a.sliding_window == SLIDING_WINDOW
        assert len(PROMPTS[0]) > SLIDING_WINDOW
    else:
        assert a.sliding_window is None
    if fam.name.startswith("falcon"):
        assert a.family.parallel_attn and f0.gate is None
        assert (m.layers[0].ffn_norm is m.layers[0].attn_norm) == (fam.name == "falcon_7b")
    if fam.name == "opt":
        assert m.pos_embd is not None and a.family.learned_pos_offset == 2 and m.rope is None
        assert f0.gate is None and f0.up_b is not None and f0.down_b is not None and m.layers[0].bqkv is not None


@pytest.mark.parametrize("mode", ["union", "per-seq"])
def test_family_batch_logits_equal_each_sequence_alone(fam, mode, monkeypatch):
    """Four sequences of 12, 3, 6 and 2 prompt tokens joining at steps 0, 0, 1, 3 (the batch grows
    to 4 and shrinks to 1): every step's logits equal the ones each sequence gets alone, bit for
    bit, the decoder ran the batch sizes counted by hand (SIZES), and the FFN took the mode asked
    for (union wherever the union applies: B >= 2)."""
    model = _model(fam)
    want = [alone(model, p, N) for p in PROMPTS]
    assert len({tuple(t) for t, _ in want}) >= 3  # the sequences go different ways
    assert 0.2 < model.active_share() < 0.8  # a real sparse mix of rows per token
    sizes = _recording_steps(monkeypatch)
    toks, logits, dec = batched(model, PROMPTS, N, mode, start=START)
    for b in range(len(PROMPTS)):
        assert toks[b] == want[b][0], f"sequence {b}"
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}: max diff {(logits[b] - want[b][1]).abs().max()}"
    assert sizes == SIZES
    if mode == "union":
        if kernels.backend() != "c":
            pytest.skip("union rows need the C kernels")
        assert all(dec.mode_for(layer, 2) == "union" for layer in model.layers)
        assert dec.stats["union"] == N_LAYER * sum(B >= 2 for B in sizes)
        assert dec.stats["per-seq"] == N_LAYER * sum(B == 1 for B in sizes)
    else:
        assert dec.stats["union"] == 0 and dec.stats["per-seq"] == N_LAYER * len(sizes)
        assert all(dec.mode_for(layer, 2) == "per-seq" for layer in model.layers)


def test_family_prompts_as_batch_entries_equal_token_by_token_decoding(fam):
    """Prompts evaluated 5 tokens a step as entries beside the other sequences' decode tokens (a
    cache several times in one step; for Bamboo entries at positions past the window) give each
    sequence the logits of token-by-token decoding alone, bit for bit; union mode where it applies."""
    model = _model(fam)
    want = [alone(model, p, 6, token_by_token=True) for p in PROMPTS]
    toks, logits, dec = entries_batched(model, PROMPTS, 6, "union", per_step=5)
    for b in range(len(PROMPTS)):
        assert toks[b] == want[b][0], f"sequence {b}"
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}: max diff {(logits[b] - want[b][1]).abs().max()}"
    if kernels.backend() == "c":
        assert dec.stats["union"] > 0


@pytest.mark.parametrize("fam", ["bamboo"], indirect=True)
def test_sliding_window_matters_to_the_batched_logits(fam):
    """Bamboo's window is not vacuous in the comparison above: every sequence's batched logits
    (equal to the windowed ones alone) differ from the ones it gets alone without the window."""
    model = _model(fam)
    _, logits, dec = batched(model, PROMPTS, N, "union", start=START)
    model.args = dataclasses.replace(model.args, sliding_window=None)
    for b, p in enumerate(PROMPTS):
        assert not torch.equal(logits[b], alone(model, p, N)[1]), f"sequence {b}"

"""Sparse ReLU experts (``runtime/sparse_experts.py``): only the fired neurons' rows, the dense experts' numbers.

1. The bundled SmallThinker file (llama.cpp's converter's, ``tests/data/llamacpp/smallthinker.gguf``)
   quantized to Q4_0 and Q8_0, and our f16 conversion of the same checkpoint: logits over a prompt and
   cached decode steps with sparse experts equal those with dense experts (``dense=True``) within float
   summation order, while about half of the expert neurons are skipped (random weights fire ~50%).
2. A synthetic layer where most neurons do not fire (8% by design): every down layout (Q4_0 and Q8_0 by
   block column, f16 ``down_t``) against dense experts on the same weights, few rows computed.
3. Which FFN a file gets: sparse for ReLU experts in quantized or 16-bit files; dense with ``dense``, for
   f32 files, with the torch backend, and for SiLU experts.
"""
from __future__ import annotations

import pytest
import torch

from family_models import make_smallthinker
from helpers import DATA, need, teacher_forced
from powerinfer.convert.quantize import quantize_file
from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.quant.ggml import quantize
from powerinfer.quant.qweight import MAPPED_TYPES, QWeight
from powerinfer.runtime import kernels
from powerinfer.runtime.args import ModelArgs
from powerinfer.runtime.moe import ExpertArgs, ExpertsFFN
from powerinfer.runtime.smallthinker import SmallThinkerTransformer
from powerinfer.runtime.sparse_experts import (DOWN_COLS, DOWN_ROWS, SparseExpertsFFN, down_cols, down_t_16)

BUNDLED = DATA / "llamacpp" / "smallthinker.gguf"
IDS = list(range(3, 43))
N_PREFILL = 24

pytestmark = pytest.mark.skipif(kernels.backend() != "c", reason="sparse experts need the C kernels")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse_experts")
    out = {}
    for q in ("q4_0", "q8_0"):
        out[q] = tmp / f"st-{q}.gguf"
        quantize_file(need(BUNDLED), out[q], q)
    out["f16"] = convert(make_smallthinker(tmp / "hf"), tmp / "st-f16.gguf", outtype="f16", progress=False)
    return out


@pytest.mark.parametrize("kind, down_kind", [("q4_0", DOWN_COLS), ("q8_0", DOWN_COLS), ("f16", DOWN_ROWS)])
def test_smallthinker_sparse_experts_equal_dense(files, kind, down_kind):
    g = open_gguf(files[kind])
    dense, sparse = SmallThinkerTransformer(g, dense=True), SmallThinkerTransformer(open_gguf(files[kind]))
    assert all(type(layer.ffn) is ExpertsFFN for layer in dense.layers)
    assert all(isinstance(layer.ffn, SparseExpertsFFN) and layer.ffn.down_kind == down_kind for layer in sparse.layers)
    want, got = teacher_forced(dense, IDS, N_PREFILL), teacher_forced(sparse, IDS, N_PREFILL)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, kind
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for layer in sparse.layers:  # the skipping is real: only the fired neurons' rows were read
        f = layer.ffn
        share = f.n_fired / (f.n_active * f.ea.n_ff_exp)
        assert 0.2 < share < 0.8, share


def _weights(btype: str, E: int, F: int, D: int, fire: float, seed: int = 0):
    """Expert matrices whose neurons fire with probability ``fire`` on inputs near ``v`` (returned)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(D, generator=g)
    v /= v.norm()
    sign = torch.where(torch.rand(E * F, generator=g) < fire, 1.0, -1.0)
    gate = sign[:, None] * v[None] * 3 + 0.1 * torch.randn(E * F, D, generator=g)  # gate . v ~ +-3
    up = torch.randn(E * F, D, generator=g) * 0.3
    down = torch.randn(E * D, F, generator=g) * 0.3
    bt = MAPPED_TYPES[btype]

    def q(w, rows, cols):
        raw = torch.from_numpy(quantize(w.numpy(), btype)) if btype != "F16" else w.half().view(torch.uint8)
        return raw, [QWeight(raw[e * rows:(e + 1) * rows], bt, rows, cols) for e in range(E)]

    return v, q(gate, F, D), q(up, F, D), q(down, D, F)


@pytest.mark.parametrize("btype", ["Q4_0", "Q8_0", "F16"])
def test_mostly_inactive_experts_equal_dense(btype):
    """8% of the neurons fire: sparse experts read those rows only and give the dense experts' output."""
    E, k, F, D, T = 8, 3, 256, 128, 6
    a = ModelArgs.from_gguf(open_gguf(need(BUNDLED)))
    ea = ExpertArgs(E, k, F, gating="sigmoid")
    v, (_, gate), (_, up), (down_raw, down) = _weights(btype, E, F, D, fire=0.08)
    router = torch.randn(E, D, generator=torch.Generator().manual_seed(1))
    gate_x8 = [kernels.for_dense_products(w) for w in gate]
    dense = ExpertsFFN(a.family, a.activation, router, gate_x8, up, down, ea=ea)
    sdown = down_cols(down_raw, btype, D, F) if btype != "F16" else down_t_16(down_raw, MAPPED_TYPES["F16"], D, F)
    sparse = SparseExpertsFFN(a.family, a.activation, router, gate_x8, up, sdown, ea=ea,
                              down_kind=DOWN_COLS if btype != "F16" else DOWN_ROWS)
    x = v[None] * 4 + 0.3 * torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    want = torch.cat([dense(None, x[t:t + 1]) for t in range(T)])  # the dense decode path, token by token
    got = sparse(None, x)  # a prompt: grouped by expert
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    one = torch.cat([sparse(None, x[t:t + 1]) for t in range(T)])  # decode steps: one C call per token
    assert (one - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    share = sparse.n_fired / (2 * T * k * F)
    assert 0.03 < share < 0.15, share  # few rows computed: the test is of the sparse path
    assert torch.equal(sparse.expert_hits, 2 * dense.expert_hits)


def test_which_files_get_sparse_experts(files, tmp_path):
    """Dense experts for f32 files, with dense=True and with the torch backend; sparse otherwise."""
    assert type(SmallThinkerTransformer(open_gguf(need(BUNDLED))).layers[0].ffn) is ExpertsFFN  # f32
    assert type(SmallThinkerTransformer(open_gguf(files["q4_0"]), dense=True).layers[0].ffn) is ExpertsFFN
    kernels.set_backend("torch")
    try:
        assert type(SmallThinkerTransformer(open_gguf(files["q4_0"])).layers[0].ffn) is ExpertsFFN
    finally:
        kernels.set_backend("auto")
    m = SmallThinkerTransformer(open_gguf(files["q4_0"]))
    assert m.layers[0].ffn.mode == "experts 2 of 4, fired rows"


def test_down_cols_is_the_same_matrix():
    """The block-column layout holds the file's values: dequantized, it is the original [D, F] matrix."""
    D, F = 64, 96
    w = torch.randn(D, F, generator=torch.Generator().manual_seed(3))
    for btype in ("Q4_0", "Q8_0"):
        raw = torch.from_numpy(quantize(w.numpy(), btype))
        want = QWeight(raw, MAPPED_TYPES[btype], D, F).dequantize()
        c = down_cols(raw, btype, D, F)[0]
        assert c.nbytes == raw.numel()  # the same bytes
        sc = c.scales.view(torch.float16).float().repeat_interleave(32, 0)  # [F, D]
        if btype == "Q4_0":
            qs = c.quants.reshape(F, D // 32, 16)
            vals = torch.cat([qs & 15, qs >> 4], -1).reshape(F, D).float() - 8
        else:
            vals = c.quants.view(torch.int8).float()
        assert torch.equal((vals * sc).T, want), btype


def test_threads_give_the_same_numbers():
    """Two threads split the gate rows and the down values among them: bit for bit one thread's output."""
    E, k, F, D, T = 4, 2, 512, 1024, 3
    a = ModelArgs.from_gguf(open_gguf(need(BUNDLED)))
    v, (_, gate), (_, up), (down_raw, _) = _weights("Q4_0", E, F, D, fire=0.1, seed=4)
    router = torch.randn(E, D, generator=torch.Generator().manual_seed(5))
    sparse = SparseExpertsFFN(a.family, a.activation, router, [kernels.for_dense_products(w) for w in gate], up,
                              down_cols(down_raw, "Q4_0", D, F), ea=ExpertArgs(E, k, F, gating="sigmoid"),
                              down_kind=DOWN_COLS)
    x = v[None] * 4 + 0.3 * torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [sparse(None, x[t:t + 1]) for t in range(T)]
        torch.set_num_threads(2)
        two = [sparse(None, x[t:t + 1]) for t in range(T)]
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(p, q) for p, q in zip(one, two))


def test_decode_bytes_count_the_fired_rows(files):
    """The bytes a decode step reads (pi-run --bench) shrink with the fired share: gate rows all, up and
    down quants of the fired neurons only."""
    m = SmallThinkerTransformer(open_gguf(files["q4_0"]))
    f = m.layers[0].ffn
    before = f.decode_bytes()  # nothing measured yet: every row
    teacher_forced(m, IDS, N_PREFILL)
    share = f.n_fired / (f.n_active * f.ea.n_ff_exp)
    gate, up = sum(w.nbytes for w in f.gate) / 4, sum(w.nbytes for w in f.up) / 4
    quants, scales = sum(d.quants.numel() for d in f.down) / 4, sum(d.scales.numel() for d in f.down) / 4
    assert f.decode_bytes() == pytest.approx(f.router.numel() * 4 + 2 * (gate + share * (up + quants) + scales))
    assert f.decode_bytes() < before

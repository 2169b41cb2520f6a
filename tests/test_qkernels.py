"""Quantized kernels against plain torch on the dequantized weights (``gguf``'s reference
dequantizers), on the native (AVX2 where present) and the portable scalar build.

Block-quantized products quantize the activation to 8-bit blocks as ggml does, so the reference
does the same in torch (round half to even, scale amax/127 kept in fp32) and then sums
exactly in float64: the kernels must agree to float32 summation error. Conversions
(dequantized rows, embedding lookups, K-quant blocks) must agree bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, quants

from powerinfer.quant.qweight import MAPPED_TYPES, QWeight
from powerinfer.runtime import kernels

from helpers import q8_K

Q8_ACT = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")  # types whose products quantize the activation


def make(name: str, n: int, k: int, seed: int = 0) -> QWeight:
    """An ``[n, k]`` QWeight of type ``name``: quantized from normal values (Q4_0, Q8_0, F16)
    or random bytes with sane scales (the K-quants, which gguf cannot quantize)."""
    bt = MAPPED_TYPES[name]
    rng = np.random.default_rng(seed)
    if name == "F16":
        raw = rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    elif name == "BF16":  # fp32 values cut to their top 16 bits
        raw = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    elif name in ("Q4_0", "Q8_0"):
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), QT[name])
    else:
        raw = rng.integers(0, 256, size=(n, bt.row_bytes(k)), dtype=np.uint8)
        blocks = raw.reshape(n, -1, bt.nbytes)
        for off in ((0, 2) if name == "Q4_K" else (208,)):  # the fp16 super-block scales
            blocks[:, :, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return QWeight(torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1)), bt, n, k)


def poison(w: QWeight, rows: torch.Tensor) -> QWeight:
    """A copy of ``w`` whose ``rows`` read as NaN (every fp16 scale, or every F16/BF16 value, set
    to NaN): a kernel that reads one of them returns NaN, one that skips them cannot tell."""
    raw = w.raw.clone()
    blocks = raw.view(w.n_rows, -1, w.btype.nbytes)
    nan = [0xC0, 0x7F] if w.btype.name == "BF16" else [0x00, 0x7E]  # NaN, little-endian
    for off in QWeight._SCALES.get(w.btype.name, (0,)):
        blocks[rows, :, off:off + 2] = torch.tensor(nan, dtype=torch.uint8)
    return QWeight(raw, w.btype, w.n_rows, w.n_cols)


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., K]`` as the kernels see it: 8-bit blocks of 32, scale amax/127 (written
    here again, independently of ``kernels.q8_round_trip``)."""
    b = x.float().reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    q = torch.round(b * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (q * d).reshape(x.shape)


def reference(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """``x @ dequant(w).T`` in float64, ``x`` rounded as the kernel rounds it (ggml's q8_K for the K-quants)."""
    xr = (q8_K(x) if w.btype.name in ("Q4_K", "Q6_K") else q8_round_trip(x)) if w.btype.name in Q8_ACT else x.float()
    return xr.double() @ w.dequantize().double().T


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> bool:
    scale = max(1.0, want.abs().max().item())
    return (got.double() - want).abs().max().item() <= rel * scale * (want.shape[-1] ** 0.5 if want.dim() else 1)


TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16", "BF16"]


@pytest.mark.parametrize("name", TYPES)
def test_dequantized_rows_equal_gguf_reference_bit_for_bit(lib, name):
    w = make(name, 37, 512)
    assert torch.equal(kernels.dequant_rows(w, 0, 37), w.dequantize())
    ids = torch.tensor([36, 0, 5, 5, 20])
    assert torch.equal(kernels.embed(w, ids), w.dequantize()[ids])
    assert torch.equal(kernels.dequant_rows(w, 3, 9), w.dequantize()[3:9])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_linear_equals_reference(lib, name, T):
    w = make(name, 70, 256, seed=1)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(T))
    y = kernels.linear(x, w)
    assert y.shape == (T, 70) and y.dtype == torch.float32
    assert close(y, reference(w, x))
    kernels.QGEMM_MAX_T, saved = 0, kernels.QGEMM_MAX_T  # long prompts: fp32 tiles + torch, same rounding
    try:
        assert close(kernels.linear(x, w), reference(w, x))
    finally:
        kernels.QGEMM_MAX_T = saved


@pytest.mark.parametrize("name", TYPES)
def test_long_prompt_products_cross_tile_boundaries(lib, name):
    """More rows than one dequantized tile and not a multiple of it (two full tiles of
    TILE_ROWS, then 76 rows), on the long-prompt path (more than QGEMM_MAX_T tokens): ``linear``
    ([N, K] weights) and ``matmul`` ([F, D] down_t) against the float64 reference."""
    n, T = 2 * kernels.TILE_ROWS + 76, kernels.QGEMM_MAX_T + 1
    w = make(name, n, 256, seed=11)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(12))
    y = kernels.linear(x, w)
    assert y.shape == (T, n) and close(y, reference(w, x))
    assert y[:, -76:].abs().min() > 0  # the partial tile was computed (a product of random rows is never 0)
    h = torch.randn(T, n, generator=torch.Generator().manual_seed(13))
    assert close(kernels.matmul(h, w), h.double() @ w.dequantize().double())


@pytest.mark.parametrize("name", TYPES)
def test_sparse_rows_equal_reference_and_skip_up_rows_of_silent_gates(lib, name):
    gate, up = make(name, 300, 256, seed=2), make(name, 300, 256, seed=3)
    x = torch.randn(256, generator=torch.Generator().manual_seed(4))
    idx = torch.tensor([0, 1, 7, 64, 65, 150, 299])
    g, u = kernels.rows_dot(x, idx, gate, up)
    assert close(g, reference(gate, x[None])[0, idx]) and close(u, reference(up, x[None])[0, idx])
    g0, u0 = kernels.rows_dot(x, idx, gate, up, gmin=0.0)
    assert torch.equal(g0, g)
    assert torch.equal(u0, torch.where(g > 0, u, torch.zeros_like(u)))  # ReLU(gate) * up is unchanged
    assert (g <= 0).any() and (g > 0).any()
    _, u_skip = kernels.rows_dot(x, idx, gate, poison(up, idx[g <= 0]), gmin=0.0)
    assert torch.equal(u_skip, u0)  # the up rows of silent gates are not read (NaN would show)
    only, none = kernels.rows_dot(x, idx[:0], gate)
    assert only.shape == (0,) and none is None


@pytest.mark.parametrize("name", TYPES)
def test_sparse_axpy_equals_reference_and_skips_zero_coefficients(lib, name):
    down_t = make(name, 300, 512, seed=5)
    idx = torch.tensor([2, 3, 90, 91, 200, 299])
    coef = torch.tensor([0.5, 0.0, -1.25, 2.0, 0.0, 3.0])
    out = kernels.rows_axpy(idx, down_t, coef)
    want = coef.double() @ down_t.dequantize().double()[idx]
    assert out.shape == (512,) and close(out, want)
    skipped = kernels.rows_axpy(idx, poison(down_t, idx[coef == 0]), coef)
    assert torch.equal(skipped, out)  # rows with coefficient 0 are not read (NaN would show)
    assert torch.equal(kernels.rows_axpy(idx[:0], down_t, coef[:0]), torch.zeros(512))


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "F16", "BF16"])
def test_matmul_and_transposed_weights(lib, name):
    w = make(name, 96, 64, seed=6)  # stored [F=96, D=64] like ffn_down_t
    h = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
    assert close(kernels.matmul(h, w), h.double() @ w.dequantize().double())
    assert close(kernels.matmul(h[:1], w), h[:1].double() @ w.dequantize().double())
    # a dense file's ffn_down [D, F] stands as down_t [F, D] through .T; matmul reads it as stored
    down = make(name, 64, 96, seed=8)
    assert down.T.shape == (96, 64) and not down.T.is_contiguous() and down.T.T.is_contiguous()
    assert close(kernels.matmul(h, down.T), reference(down, h))


def test_torch_backend_computes_on_dequantized_weights():
    kernels.set_backend("torch")
    try:
        w = make("Q4_0", 40, 64)
        x = torch.randn(2, 64)
        assert close(kernels.linear(x, w), reference(w, x))
        up = make("Q4_0", 40, 64, seed=1)  # another weight: up must be computed from its own rows
        idx = torch.tensor([1, 5, 39])
        g, u = kernels.rows_dot(x[0], idx, w, up)
        assert close(g, reference(w, x[:1])[0, idx]) and close(u, reference(up, x[:1])[0, idx])
        assert not torch.equal(u, g)
        assert close(kernels.rows_axpy(idx, w, torch.tensor([1.0, 2.0, -0.5])),
                     torch.tensor([1.0, 2.0, -0.5]).double() @ w.dequantize().double()[idx])
    finally:
        kernels.set_backend("auto")


def test_qweight_checks_its_bytes_and_selects_rows():
    w = make("Q4_0", 8, 64)
    with pytest.raises(ValueError):
        QWeight(w.raw[:, :-1], w.btype, 8, 64)
    sel = w.index_select(0, torch.tensor([6, 1]))
    assert torch.equal(sel.dequantize(), w.dequantize()[[6, 1]])
    assert w.element_size() == 18 / 32 and w.nbytes == 8 * 36


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("T", [1, 2, 5, 9])
def test_8_row_groups_equal_row_layout(lib, name, T):
    w = make(name, 64, 256, seed=9)
    x8 = w.to_x8()
    assert x8.layout == "x8" and x8.nbytes == w.nbytes and not torch.equal(x8.raw, w.raw)
    assert torch.equal(x8.dequantize(), w.dequantize())  # the layout round-trips
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(10 + T))
    assert close(kernels.linear(x, x8), reference(w, x))  # every T quantizes the activation
    with pytest.raises(ValueError):
        x8.index_select(0, torch.tensor([1]))
    assert kernels.for_dense_products(make("F16", 64, 256)).layout == "rows"
    assert kernels.for_dense_products(make("Q4_0", 60, 256)).layout == "rows"  # not whole groups


@pytest.mark.parametrize("T", [1, 3, 8])
def test_8_row_q8_0_takes_every_int8_weight(lib, T):
    """A Q8_0 file may hold -128 (ggml's quantizer never writes it, another writer may): the 8-row
    kernel must multiply it exactly, against negative activations too (a sign trick on the
    weights' side overflows there), for one token and for tiles of several."""
    w = make("Q8_0", 64, 256, seed=11)
    blocks = w.raw.view(64, -1, 34)
    blocks[:, :, 2::5] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)  # every fifth weight
    blocks[:, :, 3::7] = torch.tensor(127, dtype=torch.int8).view(torch.uint8)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(12))
    assert (w.dequantize() < 0).any() and (x < 0).any()
    assert close(kernels.linear(x, w.to_x8()), reference(w, x))


def test_gate_and_up_of_different_types(lib):
    """A mixed file (gate Q4_0, up Q8_0) decodes with one call per matrix."""
    gate, up = make("Q4_0", 40, 64, seed=11), make("Q8_0", 40, 64, seed=12)
    x = torch.randn(64, generator=torch.Generator().manual_seed(13))
    idx = torch.tensor([0, 3, 39])
    g, u = kernels.rows_dot(x, idx, gate, up, gmin=0.0)
    assert close(g, reference(gate, x[None])[0, idx]) and close(u, reference(up, x[None])[0, idx])


@pytest.mark.parametrize("name", ["F16", "BF16"])
@pytest.mark.parametrize("K", [104, 100, 47, 31])
def test_16bit_kernels_take_rows_not_a_multiple_of_32(lib, name, K):
    """F16/BF16 rows of K = 104, 100, 47, 31 values (the SIMD loops take 32, 16 or 8 at a time, then
    a tail; 104 is whole groups of 8, not of 16 or 32): products, sparse rows, axpy, the transposed
    product and conversions against the float64 reference, the tail included (a kernel that drops
    it is off by the tail's share)."""
    n = 70
    w, up = make(name, n, K, seed=21), make(name, n, K, seed=22)
    g = torch.Generator().manual_seed(K)
    for T in (1, 3):
        x = torch.randn(T, K, generator=g)
        assert close(kernels.linear(x, w), reference(w, x))
    x = torch.randn(K, generator=g)
    tail = torch.zeros(K)
    tail[K - K % 8 - 1 if K % 8 else K - 1:] = 1.0  # only the last values (the tail) non-zero
    assert close(kernels.linear(tail[None], w), reference(w, tail[None]))
    assert kernels.linear(tail[None], w).abs().max() > 0
    idx = torch.tensor([0, 3, 40, 69])
    rg, ru = kernels.rows_dot(x, idx, w, up)
    assert close(rg, reference(w, x[None])[0, idx]) and close(ru, reference(up, x[None])[0, idx])
    coef = torch.tensor([1.0, -0.5, 2.0, 0.25])
    assert close(kernels.rows_axpy(idx, w, coef), coef.double() @ w.dequantize().double()[idx])
    h = torch.randn(4, n, generator=g)
    assert close(kernels.matmul(h, w), h.double() @ w.dequantize().double())
    assert torch.equal(kernels.dequant_rows(w, 0, n), w.dequantize())
    assert torch.equal(kernels.embed(w, torch.tensor([5, 69, 0])), w.dequantize()[[5, 69, 0]])

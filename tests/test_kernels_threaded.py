"""The C kernels' multi-threaded branches against plain torch.

Below ``PAR_MIN`` weights (``kernels.c``, 2**18) or ``PAR_MIN_BYTES`` weight bytes
(``qkernels.c``, 2**17; 2**19 for row dequantization) a call runs on the calling thread, and
every other kernel test stays below that. Here each operation is sized above its threshold
and run with ``torch.set_num_threads(2)`` (the kernels share torch's OpenMP runtime), on the
native and the portable scalar build. Row-parallel kernels (each output row computed by one
thread, whole) must also equal the one-thread result bit for bit.
"""
from __future__ import annotations

import re

import pytest
import torch

from powerinfer.runtime import kernels

from test_qkernels import close, make, reference

def _define(source: str, name: str) -> int:
    """A ``#define NAME (1 << k)`` or ``#define NAME n`` of a C source, so the sizes here follow the kernels."""
    m = re.search(rf"#define {name} \(?(\d+)(?: << (\d+))?\)?", source)
    assert m, name
    return int(m[1]) << int(m[2] or 0)


PAR_MIN = _define(kernels.SOURCE.read_text(), "PAR_MIN")
PAR_MIN_BYTES = _define(kernels.QSOURCE.read_text(), "PAR_MIN_BYTES")


@pytest.fixture
def threaded(lib):
    """The C backend (``lib``: native or scalar build) with two OpenMP threads, one-thread runs on demand."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    # the kernels' own view of the team size: the threaded branches need more than one thread
    assert kernels._state["lib"].omp_get_max_threads() == 2

    def one_thread(fn):
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(2)

    yield one_thread
    torch.set_num_threads(saved_threads)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, ref.abs().max().item())
    assert (got.double() - ref.double()).abs().max().item() <= _tol(dtype) * scale


# ---------------------------------------------------------------------------- f32 / bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_gathered_rows_and_axpy_equal_torch(threaded, dtype):
    g = torch.Generator().manual_seed(5)
    n_ff, d = 1300, 520  # d not a multiple of 32: the threads' slices end in a tail
    gate, up, down_t = (torch.randn(n_ff, d, generator=g).to(dtype) for _ in range(3))
    x = torch.randn(d, generator=g).to(dtype)
    idx = (torch.rand(n_ff, generator=g) < 0.5).nonzero().view(-1)
    assert idx.numel() * d >= PAR_MIN
    g_ref, u_ref = gate.double()[idx] @ x.double(), up.double()[idx] @ x.double()
    rg, ru = kernels.rows_dot(x, idx, gate, up)
    _assert_close(rg, g_ref, dtype)
    _assert_close(ru, u_ref, dtype)
    assert all(torch.equal(a, b) for a, b in zip((rg, ru), threaded(lambda: kernels.rows_dot(x, idx, gate, up))))
    # a silent gate leaves its up product 0 (row not read); the others are computed
    rg0, ru0 = kernels.rows_dot(x, idx, gate, up, gmin=0.0)
    assert torch.equal(rg0, rg) and torch.equal(ru0[rg > 0], ru[rg > 0]) and (ru0[rg <= 0] == 0).all()
    coef = torch.relu(rg) * ru  # about half the coefficients are exactly 0
    out = kernels.rows_axpy(idx, down_t, coef)
    ref = coef.double() @ down_t.double()[idx]
    assert out.shape == (d,)
    _assert_close(out, ref, dtype)
    _assert_close(threaded(lambda: kernels.rows_axpy(idx, down_t, coef)), out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_linear_and_predict_equal_torch(threaded, dtype):
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(700, 520, generator=g).to(dtype), torch.randn(700, generator=g).to(dtype)
    x = torch.randn(1, 520, generator=g).to(dtype)
    assert w.numel() >= PAR_MIN
    got = kernels.linear(x, w, b)
    _assert_close(got, x.double() @ w.double().T + b.double(), dtype)
    assert torch.equal(got, threaded(lambda: kernels.linear(x, w, b)))
    fc1, fc2 = torch.randn(64, 520, generator=g).to(dtype), torch.randn(4200, 64, generator=g).to(dtype)
    assert fc2.numel() >= PAR_MIN
    logits = torch.relu(x.double() @ fc1.double().T) @ fc2.double().T
    mask = kernels.predict(x, fc1, fc2, 0.5)
    clear = (logits - 0.5).abs() > _tol(dtype) * logits.abs().max()  # ignore logits rounding can flip
    assert mask.shape == (1, 4200) and torch.equal(mask[clear], (logits >= 0.5)[clear])
    assert torch.equal(mask, threaded(lambda: kernels.predict(x, fc1, fc2, 0.5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,n_pos", [(16, 4, 64, 100), (12, 12, 48, 130)])
def test_threaded_decode_attention_equals_sdpa(threaded, dtype, n_head, n_head_kv, head_dim, n_pos):
    g = torch.Generator().manual_seed(n_pos)
    cache_k, cache_v = (torch.randn(256, n_head_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(n_head, head_dim, generator=g).to(dtype)
    k, v = cache_k[7:7 + n_pos], cache_v[7:7 + n_pos]
    assert n_head * n_pos * head_dim >= PAR_MIN // 4
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, None], k.double().transpose(0, 1), v.double().transpose(0, 1), enable_gqa=True)[:, 0]
    got = kernels.attend_one(q, k, v)
    assert got.shape == (n_head, head_dim) and got.dtype == dtype
    _assert_close(got, ref, dtype)
    assert torch.equal(got, threaded(lambda: kernels.attend_one(q, k, v)))  # heads split whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_attention_equals_one_query_at_a_time(threaded, dtype):
    """attend_many: several queries, each against its own cache span (two caches, spans of
    different lengths and starts, GQA), give each query exactly attend_one's numbers, on one
    thread and several; an empty batch and spans the C kernel cannot read take the per-query path."""
    g = torch.Generator().manual_seed(3)
    caches = [tuple(torch.randn(300, 4, 64, generator=g).to(dtype) for _ in range(2)) for _ in range(2)]
    spans = [(0, 0, 1), (0, 0, 90), (1, 5, 250), (0, 40, 41), (1, 0, 300), (0, 0, 91)]  # (cache, first, end)
    q = torch.randn(len(spans), 16, 64, generator=g).to(dtype)
    ks = [caches[c][0][a:b] for c, a, b in spans]
    vs = [caches[c][1][a:b] for c, a, b in spans]
    want = torch.stack([kernels.attend_one(q[i], k, v) for i, (k, v) in enumerate(zip(ks, vs))])
    got = kernels.attend_many(q, ks, vs)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(threaded(lambda: kernels.attend_many(q, ks, vs)), want)
    assert kernels.attend_many(q[:0], [], []).shape == (0, 16, 64)
    odd = [k.transpose(1, 2).contiguous().transpose(1, 2) for k in ks]  # same values, another layout
    assert torch.allclose(kernels.attend_many(q, odd, vs).float(), want.float(), rtol=1e-2, atol=1e-3)


# ---------------------------------------------------------------------------- quantized
QTYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16"]


@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_threaded_quantized_linear_equals_reference(threaded, name, T):
    w = make(name, 1024, 512, seed=3)
    assert w.raw.numel() >= PAR_MIN_BYTES
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    y = kernels.linear(x, w)
    assert close(y, reference(w, x))
    assert torch.equal(y, threaded(lambda: kernels.linear(x, w)))


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("T", [1, 5])
def test_threaded_8_row_groups_equal_reference(threaded, name, T):
    w = make(name, 1024, 512, seed=4)
    x8 = kernels.for_dense_products(w)
    assert x8.layout == "x8"
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(10 + T))
    y = kernels.linear(x, x8)
    assert close(y, reference(w, x))
    assert torch.equal(y, threaded(lambda: kernels.linear(x, x8)))


@pytest.mark.parametrize("name", QTYPES)
def test_threaded_quantized_sparse_rows_and_axpy_equal_reference(threaded, name):
    gate, up, down_t = make(name, 2400, 512, 0), make(name, 2400, 512, 1), make(name, 2400, 512, 2)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, generator=g)
    idx = (torch.rand(2400, generator=g) < 0.5).nonzero().view(-1)
    assert idx.numel() * gate.raw.shape[1] >= PAR_MIN_BYTES
    rg, ru = kernels.rows_dot(x, idx, gate, up)
    assert close(rg, reference(gate, x[None])[0][idx]) and close(ru, reference(up, x[None])[0][idx])
    assert all(torch.equal(a, b) for a, b in zip((rg, ru), threaded(lambda: kernels.rows_dot(x, idx, gate, up))))
    coef = torch.relu(rg) * ru
    assert int((coef != 0).sum()) * down_t.raw.shape[1] >= PAR_MIN_BYTES
    out = kernels.rows_axpy(idx, down_t, coef)
    assert close(out, coef.double() @ down_t.dequantize().double()[idx])
    assert close(threaded(lambda: kernels.rows_axpy(idx, down_t, coef)), out.double())


@pytest.mark.parametrize("name", QTYPES)
def test_threaded_dequantized_rows_equal_gguf_reference_bit_for_bit(threaded, name):
    w = make(name, 2300, 512, seed=8)
    assert w.raw.numel() >= 4 * PAR_MIN_BYTES
    assert torch.equal(kernels.dequant_rows(w, 0, 2300), w.dequantize())
    ids = torch.randint(0, 2300, (2100,), generator=torch.Generator().manual_seed(9))
    assert torch.equal(kernels.embed(w, ids), w.dequantize()[ids])


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "F16"])
def test_threaded_several_token_row_kernels_equal_one_thread_and_one_token(threaded, name):
    """rows_dot_multi / rows_axpy_multi sized above PAR_MIN_BYTES on two threads (their parallel
    branches, which every other test leaves unrun): bit for bit the one-thread result and each
    token's one-token rows_dot / rows_axpy over its own rows."""
    F_, D, T = 2400, 512, 6
    gate, up, down = make(name, F_, D, 31), make(name, F_, D, 32), make(name, F_, D, 33)
    g = torch.Generator().manual_seed(34)
    x = torch.randn(T, D, generator=g)
    masks = torch.rand(T, F_, generator=g) < 0.4
    idx = masks.any(0).nonzero().view(-1)
    sel = masks[:, idx]
    assert idx.numel() * gate.raw.shape[1] >= PAR_MIN_BYTES
    ga, ua = kernels.rows_dot_multi(x, idx, sel, gate, up, 0.0)
    ga1, ua1 = threaded(lambda: kernels.rows_dot_multi(x, idx, sel, gate, up, 0.0))
    assert torch.equal(ga, ga1) and torch.equal(ua, ua1)
    coef = torch.where(sel, torch.relu(ga) * ua, torch.zeros(()))
    assert int((coef != 0).any(0).sum()) * down.raw.shape[1] >= PAR_MIN_BYTES
    for chunk in (0, 64):
        out = kernels.rows_axpy_multi(idx, down, coef, chunk)
        assert torch.equal(out, threaded(lambda: kernels.rows_axpy_multi(idx, down, coef, chunk)))
        for t in range(T):
            own = masks[t].nonzero().view(-1)
            g1, u1 = kernels.rows_dot(x[t], own, gate, up, 0.0)
            assert torch.equal(ga[t][sel[t]], g1) and torch.equal(ua[t][sel[t]], u1)
            assert torch.equal(out[t], kernels.rows_axpy(own, down, torch.relu(g1) * u1)), (t, chunk)
    assert close(ga[1][sel[1]], reference(gate, x[1:2])[0][idx[sel[1]]])

"""The quant types of llama.cpp's K-quant files (Q4_K_M, Q5_K_M, Q6_K) computed in their own bytes.

Every kernel op (dense product of one and of several tokens, gate/up rows, down rows, rows
dequantized) on Q5_K and on the 32-value types llama.cpp's quantizer writes into those files
for rows that are not a multiple of 256 values (Q5_0 for Q4_K, Q5_1 for Q5_K), and on Q4_K and
Q6_K (whose AVX2 products sum a super-block's sub-blocks as one vector), against ``gguf``'s
numpy dequantizers: products equal ``x @ dequant(w).T`` in float64, ``x`` rounded as the kernels
round it (ggml's q8_K, blocks of 256, for Q4_K/Q5_K/Q6_K, as llama.cpp's vec_dot; 8-bit blocks of
32 for Q5_0/Q5_1), within float32 summation error; conversions bit for bit.
Native (AVX2) and portable scalar builds (the ``lib`` fixture), one and two threads, row counts
and block counts that leave tails for every unrolled loop.

Loading: a tensor type without a kernel is dequantized at load only when the copy fits in
memory (with a warning that gives its size), else refused naming the type and the tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, quants

from powerinfer.errors import PowerInferError
from powerinfer.quant.qweight import MAPPED_TYPES, QWeight
from powerinfer.runtime import kernels

from helpers import q8_K

NEW = ["Q5_0", "Q5_1", "Q5_K"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
ALL = NEW + ["Q4_K", "Q6_K"]
HALF_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 super-block scales


def make(name: str, n: int, k: int, seed: int = 0) -> QWeight:
    """An ``[n, k]`` QWeight of type ``name``: gguf's own quantizer where it has one (Q5_0, Q5_1),
    else random bytes (every quant, scale and min bit pattern) with sane fp16 super-block scales."""
    bt = MAPPED_TYPES[name]
    rng = np.random.default_rng(seed)
    if name in ("Q5_0", "Q5_1"):
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), QT[name])
    else:
        raw = rng.integers(0, 256, size=(n, bt.row_bytes(k)), dtype=np.uint8)
        blocks = raw.reshape(n, -1, bt.nbytes)
        for off in HALF_SCALES[name]:
            blocks[:, :, off:off + 2] = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16).view(
                np.uint8).reshape(n, -1, 2)
    return QWeight(torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1)), bt, n, k)


def q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the Q5_0/Q5_1 kernels see it: 8-bit blocks of 32, scale amax/127 in fp32, round half to even."""
    b = x.float().reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    return (torch.round(b * torch.where(d != 0, 1 / d, torch.zeros_like(d))) * d).reshape(x.shape)


def act(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the products on ``name`` weights round it (ggml's q8_K for the K-quants)."""
    return q8_K(x) if name in K_TYPES else q8(x)


def ref_dense(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    return act(w.btype.name, x).double() @ w.dequantize().double().T


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 3e-6) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= rel * scale * want.shape[-1] ** 0.5, (err, scale)


@pytest.fixture(params=[1, 2])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def shape(name: str, big: bool) -> tuple[int, int]:
    """(rows, values per row): an odd count of blocks, rows not a multiple of 4 or 8; ``big`` is
    over the kernels' threading threshold (128 KiB of weights)."""
    if not big:
        return 37, 3 * 256 if name in K_TYPES else 29 * 32
    return 401, 5 * 256 if name in K_TYPES else 29 * 32


@pytest.mark.parametrize("name", ALL)
def test_type_is_computed_in_its_own_bytes(name):
    assert name in kernels._QT and name in MAPPED_TYPES and name in kernels.Q8_ACT


@pytest.mark.parametrize("name", ALL)
def test_dequantized_rows_equal_gguf_bit_for_bit(lib, name):
    w = make(name, *shape(name, False))
    assert torch.equal(kernels.dequant_rows(w, 0, w.n_rows), w.dequantize())
    assert torch.equal(kernels.dequant_rows(w, 5, 9), w.dequantize()[5:9])
    ids = torch.tensor([36, 0, 5, 5, 20])
    assert torch.equal(kernels.embed(w, ids), w.dequantize()[ids])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("T", [1, 2, 5])
def test_dense_products_equal_reference(lib, threads, name, T):
    w = make(name, *shape(name, True), seed=T)
    x = torch.randn(T, w.n_cols)
    y = kernels.linear(x, w)
    assert y.shape == (T, w.n_rows)
    close(y, ref_dense(w, x))
    for t in range(T):  # a token's numbers do not depend on the others in the call
        assert torch.equal(kernels.linear(x[t:t + 1], w)[0], y[t])


@pytest.mark.parametrize("name", ALL)
def test_long_prompt_products_equal_reference(lib, name):
    w = make(name, 70, shape(name, False)[1])
    x = torch.randn(kernels.QGEMM_MAX_T + 3, w.n_cols)
    close(kernels.linear(x, w), ref_dense(w, x))
    h = torch.randn(5, 70)  # h @ w for w stored as 70 rows (a down_t): dequantized tiles, no rounding of h
    close(kernels.matmul(h, w), h.double() @ w.dequantize().double(), rel=2e-6)


@pytest.mark.parametrize("name", ALL)
def test_rows_dot_equals_reference_and_skips_silent_gates(lib, threads, name):
    n, k = shape(name, True)
    a, b = make(name, n, k, 1), make(name, n, k, 2)
    idx = torch.tensor(sorted(np.random.default_rng(3).choice(n, 211, replace=False).tolist()))
    x = torch.randn(k)
    ra, rb = kernels.rows_dot(x, idx, a, b)
    close(ra, ref_dense(a, x[None])[0][idx])
    close(rb, ref_dense(b, x[None])[0][idx])
    ga, gb = kernels.rows_dot(x, idx, a, b, gmin=0.0)
    assert torch.equal(ga, ra)
    assert torch.equal(gb, torch.where(ra > 0, rb, torch.zeros_like(rb)))
    dense = kernels.linear(x[None], a)[0]
    assert torch.equal(dense[idx], ra)  # the dense product and the rows pass are one dot product


@pytest.mark.parametrize("name", ALL)
def test_rows_axpy_equals_reference_and_skips_zero_coefficients(lib, threads, name):
    n, k = shape(name, True)
    w = make(name, n, k, 4)
    idx = torch.arange(1, n)
    coef = torch.randn(idx.numel())
    coef[::5] = 0
    want = coef.double() @ w.dequantize().double()[idx]
    close(kernels.rows_axpy(idx, w, coef), want[None], rel=2e-6)
    # a zero coefficient's row is not read: rows made NaN there change nothing
    raw = w.raw.clone()
    raw.view(n, -1, w.btype.nbytes)[idx[::5], :, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    bad = QWeight(raw, w.btype, n, k)
    assert torch.equal(kernels.rows_axpy(idx, bad, coef), kernels.rows_axpy(idx, w, coef))


@pytest.mark.parametrize("name", ALL)
def test_several_token_rows_equal_one_token_rows(lib, name):
    n, k = shape(name, False)
    a, b, down = make(name, n, k, 5), make(name, n, k, 6), make(name, n, k, 7)
    T = 3
    x = torch.randn(T, k)
    idx = torch.arange(0, n, 3)
    sel = torch.rand(T, idx.numel()) < 0.6
    ra, rb = kernels.rows_dot_multi(x, idx, sel, a, b)
    for t in range(T):
        one_a, one_b = kernels.rows_dot(x[t], idx[sel[t]], a, b)
        assert torch.equal(ra[t][sel[t]], one_a) and torch.equal(rb[t][sel[t]], one_b)
        assert not ra[t][~sel[t]].any()
    coef = torch.randn(T, idx.numel()) * sel
    out = kernels.rows_axpy_multi(idx, down, coef)
    for t in range(T):
        assert torch.equal(out[t], kernels.rows_axpy(idx[sel[t]], down, coef[t][sel[t]]))


@pytest.mark.parametrize("name", ALL)
def test_nonfinite_scale_is_found(name):
    w = make(name, 9, shape(name, False)[1])
    assert w.first_nonfinite_row() is None
    raw = w.raw.clone()
    off = QWeight._SCALES[name][-1]
    raw.view(9, -1, w.btype.nbytes)[6, 1, off:off + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # +inf
    assert QWeight(raw, w.btype, 9, w.n_cols).first_nonfinite_row() == 6


# ---------------------------------------------------------------------------- loading
def retype(src, dst, types: dict[str, QT], round_trip: bool = False):
    """``src`` (an f32 GGUF) with the tensors named in ``types`` quantized (gguf's quantizers), or
    with ``round_trip`` kept in f32 but holding the quantized values (quantized, then dequantized)."""
    import gguf

    from powerinfer.convert.quantize import _copy_metadata
    from powerinfer.formats.gguf_file import open_gguf

    g = open_gguf(src)
    w = gguf.GGUFWriter(str(dst), g.arch)
    _copy_metadata(w, g, 1)
    for t in g.reader.tensors:
        data = np.asarray(t.data)
        if t.name in types and round_trip:
            w.add_tensor(t.name, quants.dequantize(quants.quantize(data, types[t.name]), types[t.name]))
        elif t.name in types:
            w.add_tensor(t.name, quants.quantize(data, types[t.name]), raw_dtype=types[t.name])
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory, relu_hf):
    """stories260K-relu in f32 with every ffn_up in Q4_1 (a type without a kernel here)."""
    from powerinfer.convert.writer import convert

    tmp = tmp_path_factory.mktemp("kq")
    f32 = convert(relu_hf, tmp / "m.gguf", None, outtype="f32", progress=False)
    from powerinfer.formats.gguf_file import open_gguf

    names = [n for n in open_gguf(f32).tensors if n.endswith("ffn_up.weight")]
    types = {n: QT.Q4_1 for n in names}
    return retype(f32, tmp / "m-q4_1.gguf", types), retype(f32, tmp / "m-rt.gguf", types, round_trip=True), names


def test_type_without_kernel_is_dequantized_with_a_warning_when_it_fits(c_kernels, q4_1_file, caplog):
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.model import Transformer

    path, f32, names = q4_1_file
    g = open_gguf(path)
    n_ff, n_embd = (int(d) for d in reversed(g.tensors[names[0]].shape.tolist()))
    with caplog.at_level(logging.WARNING, logger="powerinfer.runtime.weights"):
        m = Transformer(g)
    want_mib = len(names) * n_ff * n_embd * 4 / 2**20  # f32 copies of every ffn_up
    msgs = [r.getMessage() for r in caplog.records if "Q4_1" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert f"{len(names)} Q4_1 tensors ({names[0]}, ...)" in msgs[0] and f"{want_mib:.1f} MiB" in msgs[0]
    assert all(not isinstance(layer.ffn.up, QWeight) and layer.ffn.up.dtype == torch.float32 for layer in m.layers)
    # it computes with the dequantized Q4_1 values: logits equal those of an f32 file holding them
    from helpers import teacher_forced

    ids = [1, 403, 407, 261, 378, 432, 383, 286]
    ref = teacher_forced(Transformer(open_gguf(f32)), ids, 4)
    assert (teacher_forced(m, ids, 4) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_type_without_kernel_is_refused_before_any_allocation_when_it_does_not_fit(c_kernels, q4_1_file,
                                                                                    monkeypatch):
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime import model as model_mod, weights

    path, _, names = q4_1_file
    loads = []
    monkeypatch.setattr(model_mod, "load_matrix", lambda *a, **k: loads.append(a) or weights.load_matrix(*a, **k))
    monkeypatch.setattr(model_mod, "available_memory", lambda: 1000)  # bytes: less than one copy
    with pytest.raises(PowerInferError) as e:
        model_mod.Transformer(open_gguf(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and f"tensor '{names[0]}' has type Q4_1" in msg
    assert "no kernel" in msg and "1000" not in msg and "memory available" in msg
    assert loads == []  # refused before the first tensor was loaded
    # the same file with room for the copies loads (the limit, not the type, refused it)
    monkeypatch.setattr(model_mod, "available_memory", lambda: 1 << 40)
    model_mod.Transformer(open_gguf(path))
    assert loads


def test_kernel_types_need_no_copy(c_kernels, q4_1_file):
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.weights import check_dequantized

    path, f32, names = q4_1_file
    assert check_dequantized(open_gguf(f32), torch.float32, True, 0) == 0  # f32: nothing to dequantize
    q4_0 = retype(f32, f32.with_name("m-q4_0.gguf"), {x: QT.Q4_0 for x in names})
    assert check_dequantized(open_gguf(q4_0), torch.float32, True, 0) == 0  # a kernel type: no copy
    g = open_gguf(path)
    n = sum(int(np.prod(g.tensors[x].shape)) for x in names)
    assert check_dequantized(g, torch.float32, True, None) == 4 * n
    assert check_dequantized(g, torch.bfloat16, True, None) == 2 * n


# ---------------------------------------------------------------------------- 8-row groups
@pytest.mark.parametrize("name", ALL)
def test_x8_layout_round_trips_the_bytes(name):
    w = make(name, 24, shape(name, False)[1], 8)
    x8 = w.to_x8()
    assert x8.layout == "x8" and x8.nbytes == w.nbytes and not torch.equal(x8.raw, w.raw)
    assert np.array_equal(x8._rows_raw(), w.raw.numpy())
    assert torch.equal(x8.dequantize(), w.dequantize())
    assert kernels.for_dense_products(w).layout == ("x8" if kernels.backend() == "c" else "rows")
    assert not make(name, 12, 256).can_x8()  # not a multiple of 8 rows: stays in rows
    assert torch.equal(kernels.dequant_rows(x8, 3, 20), w.dequantize()[3:20])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 19, 37])  # 19, 37: the tiles of 16 and 32 tokens, then 4, 3, 1
def test_x8_products_equal_reference_and_row_layout(lib, threads, name, T):
    n, k = shape(name, True)
    w = make(name, n - n % 8, k, 10 + T)
    x8 = w.to_x8()
    x = torch.randn(T, k) * torch.linspace(0.1, 3, k)  # blocks of different scales
    y = kernels.linear(x, x8)
    close(y, ref_dense(w, x))
    rows = kernels.linear(x, w)
    assert (y - rows).abs().max().item() <= 1e-5 * rows.abs().max().item()
    for t in range(T):  # a token's numbers do not depend on the others in the call
        assert torch.equal(kernels.linear(x[t:t + 1], x8)[0], y[t])


def test_x8_q6_k_takes_extreme_quants_and_scales(lib):
    """Every 6-bit quant 0 or 63 and scales -128/127 against activations of one sign: the int16
    sums run at their bounds (an overflow would show)."""
    n, k = 16, 512
    w = make("Q6_K", n, k, 11)
    raw = w.raw.numpy().reshape(n, -1, 210)
    raw[:8, :, :192] = 0xFF  # q = 63 everywhere
    raw[8:, :, :192] = 0x00  # q = 0 (value -32)
    raw[:, :, 192:208] = np.array([0x80, 0x7F] * 8, np.uint8)  # scales -128, 127
    x = torch.rand(2, k) + 1.0
    close(kernels.linear(x, w.to_x8()), ref_dense(w, x))
    close(kernels.linear(-x, w.to_x8()), ref_dense(w, -x))


@pytest.mark.parametrize("name", ["Q5_K", "Q5_0", "Q5_1"])
def test_x8_5_bit_types_take_extreme_quants(lib, name):
    n, k = 8, 512
    w = make(name, n, k, 12)
    raw = w.raw.numpy().reshape(n, -1, w.btype.nbytes)
    raw[:, :, {"Q5_K": 16, "Q5_0": 2, "Q5_1": 4}[name]:] = 0xFF  # q = 31 everywhere
    x = torch.rand(1, k) + 1.0
    close(kernels.linear(x, w.to_x8()), ref_dense(w, x))
    close(kernels.linear(-x, w.to_x8()), ref_dense(w, -x))


# ---------------------------------------------------------------------------- llama.cpp's own files
KQ = Path(__file__).parent / "data" / "kquant"


@pytest.mark.parametrize("name,types", [("tiny-q4_k_m.gguf", {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}),
                                        ("tiny-q5_k_m.gguf", {"Q5_K", "Q6_K", "Q5_1", "Q8_0"})])
def test_llamacpp_k_quant_files_run_in_place_and_give_its_perplexity(c_kernels, tmp_path, name, types):
    """llama.cpp's quantizer wrote these from a tiny SiLU Llama with n_embd 160 (not a multiple of 256,
    as Qwen2.5-0.5B's 896): Q4_K_M/Q5_K_M with the fallback types for those rows. Every matrix runs in
    its own bytes, and the perplexity equals llama-perplexity's on the same text within 0.5%.

    Against ``-fa off`` (measured -0.22% and +0.28%; against the default flash attention -0.48% and
    +0.22%). Not within 0.1%: this random model turns any rounding difference into a perplexity
    shift (quantizing moved it 2.7% and 3.0% from the f32 model's), and llama.cpp's own figure for
    these same bytes moves 0.27% and 0.06% between its two attention paths (f16 rounding of the
    query and softmax weights, or an f16 V accumulator), where an f32 tiny Llama moves 0.01%. Our
    K-quant products round the activation as ggml's (q8_K); its Q5_0/Q8_0/Q5_1 products (q8_0/q8_1
    with fp16 scales) and attention round in ways ours do not."""

    from powerinfer.eval.perplexity import chunk_tokens, perplexity
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.model import Transformer
    from powerinfer.runtime.tokenizer import GGUFTokenizer
    from powerinfer.runtime.weights import check_dequantized

    ref = json.loads((KQ / "llamacpp_ppl.json").read_text())
    g = open_gguf(KQ / name)
    assert types == {t.tensor_type.name for t in g.reader.tensors} - {"F32"}
    assert check_dequantized(g, torch.float32, True, 0) == 0  # nothing dequantized at load
    m = Transformer(g)
    mats = [m.output, *(w for layer in m.layers for w in (layer.wqkv, layer.wo, layer.ffn.gate, layer.ffn.up,
                                                          layer.ffn.down_t))]
    flat = [p for w in mats for p in (w if isinstance(w, (list, tuple)) else [w])]
    assert all(isinstance(w, QWeight) for w in flat)
    assert {w.btype.name for w in flat} == types
    text = (Path(__file__).parent / "data" / "text" / "tinystories_sample.txt").read_bytes()[:ref["text_bytes"]].decode()
    tok = GGUFTokenizer(g)  # as pi-perplexity: BOS first, and in place of each chunk's first token
    chunks = chunk_tokens(tok.encode(text), ref["ctx"], None, tok.bos_id if tok.add_bos else None)
    res = perplexity(m, chunks)
    want = ref[f"{name} -fa off"]
    assert len(res.chunk_ppl) == len(want["chunks"])
    assert abs(res.ppl / want["ppl"] - 1) <= 0.005, (res.ppl, want["ppl"])

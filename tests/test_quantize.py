"""Writing Q4_0 / Q8_0: ggml-exact quantizers, pi-convert --outtype q4_0|q8_0, pi-quantize.

The quantizers are checked against a scalar transcription of ggml's C loops
(``quantize_row_q4_0_reference`` / ``quantize_row_q8_0_reference``) on constructed
rounding ties, zeros, signed zeros, all-equal, huge and tiny blocks, and against the
``gguf`` package's quantizer on real and random weights.
"""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from powerinfer import DEMO_MODEL
from powerinfer.convert.cli import main as convert_main
from powerinfer.convert.quantize import quantize_file
from powerinfer.convert.quantize_cli import main as quantize_main
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf, read_magic
from powerinfer.quant import ggml

from helpers import random_predictors

F = np.float32
QT = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- scalar ggml reference
def _c_int8(v) -> int:
    """C ``(int8_t)`` of a float as x86 compiles it: cvttss2si (NaN/out of range -> INT32_MIN), low byte."""
    v = float(v)
    i = int(v) if math.isfinite(v) and abs(v) < 2.0**31 else -2**31
    return ((i & 0xFF) ^ 0x80) - 0x80


def _fp16(d) -> bytes:
    """GGML_FP32_TO_FP16: IEEE half, nearest-even (struct's 'e' rounds half-even; overflow -> inf)."""
    try:
        return struct.pack("<e", float(d))
    except OverflowError:
        return struct.pack("<e", math.copysign(math.inf, float(d)))


def ref_q4_0_block(x) -> bytes:
    amax, mx = F(0.0), F(0.0)
    for v in x:
        if amax < abs(v):
            amax, mx = abs(v), v
    with np.errstate(all="ignore"):
        d = mx / F(-8)
        idv = F(1.0) / d if d else F(0.0)
        qs = []
        for j in range(16):
            x0, x1 = x[j] * idv, x[16 + j] * idv  # fp32 products
            xi0 = min(15, _c_int8(x0 + F(8.5))) & 0xFF  # MIN(15, (int8_t)(x0 + 8.5f)) into a uint8_t
            xi1 = min(15, _c_int8(x1 + F(8.5))) & 0xFF
            qs.append((xi0 | (xi1 << 4)) & 0xFF)
    return _fp16(d) + bytes(qs)


def _roundf(v) -> float:
    v = float(v)
    if not math.isfinite(v):
        return v
    return math.copysign(math.floor(abs(v) + 0.5), v)  # exact in double for an fp32 v


def ref_q8_0_block(x) -> bytes:
    amax = F(0.0)
    for v in x:
        amax = max(amax, abs(v))
    with np.errstate(all="ignore"):
        d = amax / F(127)
        idv = F(1.0) / d if d else F(0.0)
        qs = [_c_int8(_roundf(x[j] * idv)) & 0xFF for j in range(32)]
    return _fp16(d) + bytes(qs)


REF = {"q4_0": ref_q4_0_block, "q8_0": ref_q8_0_block}


def _tie_blocks(rng, kind: str, n: int) -> list[np.ndarray]:
    """Blocks whose values sit on, or one ulp either side of, a rounding boundary of ``x * id``."""
    out = []
    for _ in range(n):
        m = F(rng.uniform(1e-3, 1e3)) * F(rng.choice([-1, 1]))
        b = np.empty(32, F)
        b[0] = m
        if kind == "q4_0":
            d = m / F(-8)
            lv = rng.integers(1, 17, 31).astype(F) - F(8.5)  # x * id + 8.5 lands on an integer
        else:
            d = m / F(127)
            lv = rng.integers(-127, 127, 31).astype(F) + F(0.5)  # x * id lands on a half
        b[1:] = lv * d
        nudge = rng.integers(-1, 2, 31)
        b[1:] = np.where(nudge < 0, np.nextafter(b[1:], F(-np.inf)), np.where(nudge > 0, np.nextafter(b[1:], F(np.inf)), b[1:]))
        b[1:] = np.clip(b[1:], -abs(m), abs(m))
        out.append(b)
    return out


def _special_blocks() -> list[np.ndarray]:
    z = np.zeros(32, F)

    def blk(*head, fill=0.0):
        b = np.full(32, fill, F)
        b[:len(head)] = head
        return b

    blocks = [
        z, -z, blk(-0.0), blk(0.0, -0.0), blk(fill=-0.0), blk(-0.0, 0.0, -0.0, 1.5),
        blk(fill=7.0), blk(fill=-3.0), blk(fill=1e-3), blk(fill=65504.0 * 8),  # all equal
        blk(-5.0, 5.0), blk(5.0, -5.0), blk(2.0, -4.0, 4.0), blk(1.0, fill=-1.0),  # |max| ties: first wins
        blk(fill=3e38), blk(3.4e38, -3.4e38, 1.0), np.linspace(-3e38, 3e38, 32).astype(F),  # huge: d -> inf in f16
        blk(fill=1e-39), blk(fill=-2e-38), blk(1e-45), blk(1e-40, -1e-40, 0.0), blk(2.3e-38, 1e-38),  # tiny
        blk(1e-30, fill=1e-31), np.arange(32, dtype=F) - F(16), np.arange(32, dtype=F) * F(0.1),
        blk(5.24288e5, 1.0, -1.0),  # d near f16's largest finite value
        blk(8.0, -8.0, 4.0, -4.0, 0.5, -0.5, fill=1.0),
    ]
    return blocks


@pytest.fixture(scope="module")
def scalar_blocks():
    rng = np.random.default_rng(7)
    blocks = _special_blocks()
    blocks += [rng.standard_normal(32).astype(F) * F(10.0 ** rng.integers(-6, 6)) for _ in range(60)]
    return blocks, {k: _tie_blocks(np.random.default_rng(11 + i), k, 150) for i, k in enumerate(REF)}


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_quantizer_equals_a_scalar_transcription_of_ggml(scalar_blocks, name):
    """Bit for bit, on several hundred blocks: rounding ties, zeros, -0.0, equal values, huge and tiny."""
    specials, ties = scalar_blocks
    blocks = np.stack(specials + ties[name])
    assert len(blocks) > 200
    got = ggml.quantize(blocks, name)  # one block per row
    for i, b in enumerate(blocks):
        assert got[i].tobytes() == REF[name](b), (name, i, b[:4])
    # several blocks per row: the same bytes, row-major
    four = ggml.quantize(blocks[:len(blocks) // 4 * 4].reshape(-1, 128), name)
    assert four.tobytes() == got[:len(blocks) // 4 * 4].tobytes()


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_constructed_ties_are_real_ties(scalar_blocks, name):
    """The tie blocks discriminate: computing x / d instead of x * (1/d) changes some of their bytes,
    so the scalar comparison above would catch a quantizer that divides."""
    blocks = np.stack(scalar_blocks[1][name])
    with np.errstate(all="ignore"):
        if name == "q4_0":
            a = np.abs(blocks)
            mx = blocks[np.arange(len(blocks)), a.argmax(1)]
            d = mx / F(-8)
            q_mul = np.minimum(np.trunc(blocks * (F(1) / d)[:, None] + F(8.5)), 15)
            q_div = np.minimum(np.trunc(blocks / d[:, None] + F(8.5)), 15)
        else:
            d = np.abs(blocks).max(1) / F(127)
            q_mul = np.vectorize(_roundf)(blocks * (F(1) / d)[:, None])
            q_div = np.vectorize(_roundf)(blocks / d[:, None])
    differ = (q_mul != q_div).any(1).sum()
    assert differ >= 5, differ


def _gguf_quantize(x, name):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return gguf.quants.quantize(x, QT[name.upper()])


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_equals_the_gguf_package_except_signed_zero_blocks(scalar_blocks, name):
    """gguf 0.19's quantizers multiply by 1/d as ggml does, so they agree at rounding ties; the one
    difference is an all-zero block starting with -0.0, where gguf's Q4_0 takes max = -0.0
    (d = +0.0) and ggml's loop keeps max = +0.0 (d = -0.0)."""
    rng = np.random.default_rng(3)
    sd = load_file(DEMO_MODEL / "model.safetensors")
    real = np.concatenate([v.reshape(-1) for v in sd.values() if v.ndim == 2])
    real = real[: real.size // 128 * 128].reshape(-1, 128)
    specials, ties = scalar_blocks
    # blocks with 0 < max|x| < ~1e-38 make 1/d overflow; C's float->int8 is undefined there (covered above)
    finite_id = [b for b in specials + ties[name] if np.abs(b).max() == 0 or np.abs(b).max() > 1e-30]
    x = np.concatenate([real.reshape(-1, 32), rng.standard_normal((256, 4096)).astype(F).reshape(-1, 32),
                        np.stack(finite_id)])
    ours, theirs = ggml.quantize(x, name), _gguf_quantize(x, name)
    nb = {"q4_0": 18, "q8_0": 34}[name]
    blocks = x.reshape(-1, 32)
    differ = (ours.reshape(-1, nb) != theirs.reshape(-1, nb)).any(1)
    zero_neg = (np.abs(blocks).max(1) == 0) & np.signbit(blocks[:, 0])
    expect = zero_neg if name == "q4_0" else np.zeros_like(zero_neg)
    assert blocks.shape[0] > 40_000 and zero_neg.sum() >= 3
    assert np.array_equal(differ, expect)
    if name == "q4_0":  # only d differs there: ggml -0.0, gguf +0.0
        assert (ours.reshape(-1, nb)[zero_neg, :2] == [0x00, 0x80]).all()
        assert (theirs.reshape(-1, nb)[zero_neg, :2] == 0).all()
        assert (ours.reshape(-1, nb)[zero_neg, 2:] == theirs.reshape(-1, nb)[zero_neg, 2:]).all()


def test_dequantize_error_bounds():
    """Per element, with d the fp32 scale and d' its stored f16 value:
    Q8_0: |x*id - q| <= 1/2 exactly, so |x - d'q| <= d/2 + 127|d - d'| (+ fp32 slack 2^-16 d);
    Q4_0: |x - d'(q-8)| <= |d|/2 + 8|d - d'| where x*id <= 7.5, and <= |d| + 8|d - d'| at the clamp
    (x*id in (7.5, 8], values near -max: level 16 does not exist); overall <= |d| + 8|d - d'|."""
    rng = np.random.default_rng(5)
    sd = load_file(DEMO_MODEL / "model.safetensors")
    x = np.concatenate([sd["model.layers.0.mlp.gate_proj.weight"].reshape(-1, 64),
                        rng.standard_normal((2048, 64)).astype(F) * F(0.02),
                        rng.standard_t(2, (2048, 64)).astype(F)])
    b = x.reshape(-1, 32)
    # Q8_0
    raw = ggml.quantize(x, "q8_0").reshape(-1, 34)
    d = np.abs(b).max(1) / F(127)
    d16 = raw[:, :2].copy().view("<f2").astype(F)[:, 0]
    q = raw[:, 2:].view(np.int8).astype(F)
    assert np.abs(b * (F(1) / d)[:, None] - q).max() <= 0.5
    err = np.abs(b - ggml.dequantize(raw, "q8_0", x.shape).reshape(-1, 32))
    bound = d / 2 + 127 * np.abs(d - d16) + d * 2.0**-16
    assert (err <= bound[:, None]).all()
    assert (err / (d / 2)[:, None]).max() > 0.95  # the bound is nearly reached, not vacuous
    # Q4_0
    raw = ggml.quantize(x, "q4_0").reshape(-1, 18)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)]
    d = np.abs(mx / F(-8))
    d16 = np.abs(raw[:, :2].copy().view("<f2").astype(F)[:, 0])
    err = np.abs(b - ggml.dequantize(raw, "q4_0", x.shape).reshape(-1, 32))
    t = b * (F(1) / (mx / F(-8)))[:, None]
    inner = t <= 7.5
    slack = 8 * np.abs(d - d16) + d * 2.0**-16
    assert (err[inner] <= (d / 2 + slack)[:, None].repeat(32, 1)[inner]).all()
    assert (err <= (d + slack)[:, None]).all()
    assert (err[~inner] > (d / 2)[:, None].repeat(32, 1)[~inner]).any()  # the clamp does cost up to d


def test_nan_inf_and_ragged_rows_are_refused_naming_the_tensor():
    x = np.ones((4, 64), F)
    x[2, 5] = np.nan
    with pytest.raises(PowerInferError, match=r"blk\.3\.ffn_up\.weight: row 2 holds NaN"):
        ggml.quantize(x, "q4_0", "blk.3.ffn_up.weight")
    x[2, 5] = -np.inf
    with pytest.raises(PowerInferError, match="row 2"):
        ggml.quantize(x, "q8_0", "w")
    with pytest.raises(PowerInferError, match="w: rows of 48 values are not a multiple of the block size 32"):
        ggml.quantize(np.ones((2, 48), F), "q8_0", "w")
    with pytest.raises(PowerInferError, match="supported: q4_0, q8_0"):
        ggml.quantize(np.ones((2, 64), F), "q3_k")


def test_float64_and_float16_input_is_quantized_as_its_fp32_value():
    x = np.random.default_rng(0).standard_normal((8, 64))
    assert np.array_equal(ggml.quantize(x, "q4_0"), ggml.quantize(x.astype(F), "q4_0"))
    h = x.astype(np.float16)
    assert np.array_equal(ggml.quantize(h, "q8_0"), ggml.quantize(h.astype(F), "q8_0"))


# --------------------------------------------------------------------------- pi-convert --outtype
HIDDEN = (32, 12, 64)  # fc2 rows of 12 values cannot be quantized (-> f16), 32 and 64 can


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qconv")
    random_predictors(tmp / "pred", 5, 64, 172, hidden=HIDDEN)
    out = {}
    for t in ("f32", "f16", "q4_0", "q8_0"):
        out[t] = convert(DEMO_MODEL, tmp / f"m.{t}.powerinfer.gguf", tmp / "pred", outtype=t, progress=False)
        out["dense-" + t] = convert(DEMO_MODEL, tmp / f"m.{t}.gguf", outtype=t, progress=False)
    out["q4_0-pq4"] = convert(DEMO_MODEL, tmp / "m.q4_0-pq4.gguf", tmp / "pred", outtype="q4_0",
                              predictor_type="q4_0", progress=False)
    out["q4_0-pf16"] = convert(DEMO_MODEL, tmp / "m.q4_0-pf16.gguf", tmp / "pred", outtype="q4_0",
                               predictor_type="f16", progress=False)
    out["tmp"] = tmp
    return out


def _shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in t.shape[::-1])


def _want_type(name, shape, outtype, pred="q8_0"):
    """The contract, spelled out: 1-D f32; predictors `pred`; output Q8_0; the rest outtype; rows % 32 -> f16."""
    if len(shape) == 1:
        return "F32"
    want = pred if ".fc" in name else "q8_0" if name == "output.weight" else outtype
    return "F16" if shape[-1] % 32 else want.upper()


@pytest.mark.parametrize("key,outtype,pred", [("q4_0", "q4_0", "q8_0"), ("q8_0", "q8_0", "q8_0"),
                                              ("q4_0-pq4", "q4_0", "q4_0"), ("q4_0-pf16", "q4_0", "f16"),
                                              ("dense-q4_0", "q4_0", None), ("dense-q8_0", "q8_0", None)])
def test_tensor_types_follow_the_rule(files, key, outtype, pred):
    g = open_gguf(files[key])
    types = {t.name: t.tensor_type.name for t in g.reader.tensors}
    for t in g.reader.tensors:
        assert types[t.name] == _want_type(t.name, _shape(t), outtype, pred), t.name
    assert types["token_embd.weight"] == outtype.upper() and types["output.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32"
    if key.startswith("dense"):
        assert types["blk.0.ffn_down.weight"] == "F16"  # [64, 172]: rows of 172
    else:
        assert types["blk.0.ffn_down_t.weight"] == outtype.upper()  # [172, 64]
        assert types["blk.1.fc2.weight"] == "F16"  # [172, 12]
        assert types["blk.2.fc2.weight"] == pred.upper()  # [172, 64]
    assert g.get("general.file_type") == {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]


@pytest.mark.parametrize("key,ref", [("q4_0", "f32"), ("q8_0", "f32"), ("q4_0-pq4", "f32"),
                                     ("dense-q4_0", "dense-f32"), ("dense-q8_0", "dense-f32")])
def test_quantized_bytes_equal_the_quantizer_on_the_f32_conversion(files, key, ref):
    q, f = open_gguf(files[key]).tensors, open_gguf(files[ref]).tensors
    assert list(q) == list(f)  # same names, same order
    for name, t in q.items():
        src = np.asarray(f[name].data)
        assert f[name].tensor_type == QT.F32
        kind = t.tensor_type.name.lower()
        if kind in ("q4_0", "q8_0"):
            want = ggml.quantize(src.reshape(-1, src.shape[-1]), kind, name)
        elif kind == "f16":
            want = src.astype(np.float16)
        else:
            want = src
        assert np.asarray(t.data).tobytes() == want.tobytes(), name


@pytest.mark.parametrize("key,ref", [("q4_0", "f16"), ("q8_0", "f16"), ("dense-q4_0", "dense-f16")])
def test_metadata_equals_the_f16_files_except_file_type(files, key, ref):
    def kv(path):
        g = open_gguf(path)
        return {f.name: ([int(x) for x in f.types], f.contents()) for f in g.reader.fields.values()
                if not f.name.startswith("GGUF.")}
    a, b = kv(files[key]), kv(files[ref])
    assert list(a) == list(b)
    assert a["general.file_type"] != b["general.file_type"]
    del a["general.file_type"], b["general.file_type"]
    assert a == b
    assert read_magic(files[key]) == read_magic(files[ref])
    assert read_magic(files["q4_0"]) == b"PWRI" and read_magic(files["dense-q4_0"]) == b"GGUF"


def test_quantized_file_is_much_smaller(files):
    sizes = {k: Path(files[k]).stat().st_size for k in ("f16", "q8_0", "q4_0")}
    assert sizes["q4_0"] < sizes["q8_0"] < 0.6 * sizes["f16"]


def test_fallback_to_f16_is_one_log_line_naming_the_tensors(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        convert(DEMO_MODEL, tmp_path / "d.gguf", outtype="q4_0", progress=False)
    notes = [r.getMessage() for r in caplog.records if "kept in f16" in r.getMessage()]
    assert len(notes) == 1
    assert all(f"blk.{i}.ffn_down.weight [64, 172]" in notes[0] for i in range(5))


def test_sparse_q8_0_warns_about_upstream_ffn_down_t(tmp_path, files, caplog):
    with caplog.at_level("WARNING"):
        convert(DEMO_MODEL, tmp_path / "s.gguf", files["tmp"] / "pred", outtype="q8_0", progress=False)
    assert any("ffn_down_t only as f16/Q4_0" in r.getMessage() for r in caplog.records)


def test_convert_cli_unsupported_outtype_lists_the_choices(tmp_path):
    r = CliRunner().invoke(convert_main, [str(DEMO_MODEL), "--outfile", str(tmp_path / "o.gguf"), "--outtype", "q3_k"])
    assert r.exit_code == 1  # one line, as every bad value (cli_params.PiCommand)
    assert "--outtype q3_k: not one of 'f16', 'bf16', 'f32', 'q4_0', 'q8_0'" in r.output
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(PowerInferError, match="supported: f16, bf16, f32, q4_0, q8_0"):
        convert(DEMO_MODEL, tmp_path / "o.gguf", outtype="q3_k", progress=False)


def test_convert_cli_q4_0_with_predictor_type(tmp_path, files):
    r = CliRunner().invoke(convert_main, [str(DEMO_MODEL), str(files["tmp"] / "pred"), "--outfile",
                                          str(tmp_path / "o.gguf"), "--outtype", "q4_0", "--predictor-type", "q4_0"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o.gguf").read_bytes() == Path(files["q4_0-pq4"]).read_bytes()


# --------------------------------------------------------------------------- pi-quantize
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("sparse", [True, False])
def test_pi_quantize_of_the_f32_file_equals_pi_convert_outtype(files, tmp_path, qtype, sparse):
    src = files["f32" if sparse else "dense-f32"]
    direct = files[qtype if sparse else "dense-" + qtype]
    r = CliRunner().invoke(quantize_main, [str(src), str(tmp_path / "o.gguf"), qtype, "--no-progress"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"wrote {tmp_path / 'o.gguf'} ({'PWRI' if sparse else 'GGUF'}): ")
    assert " MB -> " in r.output and f" {qtype}" in r.output
    a, b = open_gguf(tmp_path / "o.gguf"), open_gguf(direct)
    assert [(t.name, t.tensor_type) for t in a.reader.tensors] == [(t.name, t.tensor_type) for t in b.reader.tensors]
    for ta, tb in zip(a.reader.tensors, b.reader.tensors):
        assert np.asarray(ta.data).tobytes() == np.asarray(tb.data).tobytes(), ta.name
    # metadata too (file_type included), so the whole file is the same
    assert (tmp_path / "o.gguf").read_bytes() == Path(direct).read_bytes()


def test_pi_quantize_of_the_f16_pwri_file(files, tmp_path):
    res = quantize_file(files["f16"], tmp_path / "o.gguf", "q4_0")
    assert read_magic(res.path) == b"PWRI" and res.sparse
    g, f = open_gguf(res.path), open_gguf(files["f16"])
    assert [t.name for t in g.reader.tensors] == [t.name for t in f.reader.tensors]
    for t, s in zip(g.reader.tensors, f.reader.tensors):
        assert t.tensor_type.name == _want_type(t.name, _shape(t), "q4_0"), t.name
        kind = t.tensor_type.name.lower()
        src = np.asarray(s.data)
        if kind in ("q4_0", "q8_0"):
            assert np.asarray(t.data).tobytes() == ggml.quantize(src, kind).tobytes(), t.name
        else:  # f16 kept as is, f32 as is
            assert np.asarray(t.data).tobytes() == src.tobytes(), t.name
    assert g.get("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0
    assert res.types == {"Q4_0": 36, "F32": 11, "Q8_0": 9, "F16": 2}  # fc2 of layers 1 and 4: rows of 12
    assert res.in_bytes > res.out_bytes


def _synthetic(path, tensors, arch="llama", extra_kv=True):
    w = gguf.GGUFWriter(str(path), arch)
    if extra_kv:
        w.add_string("general.name", "synthetic")
        w.add_array("custom.floats", [1.5, -2.25])
        w.add_bool("custom.flag", True)
    for name, arr, qt in tensors:
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bf16_input_quantized_and_quantized_tensors_copied(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 64)).astype(F)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: exact in fp32
    xb = (bf.astype(np.uint32) << 16).view(F)
    already = ggml.quantize(rng.standard_normal((3, 32)).astype(F), "q4_0")
    ints = np.arange(10, dtype=np.int32)
    src = _synthetic(tmp_path / "in.gguf", [
        ("blk.0.ffn_up.weight", bf.view(np.uint8), QT.BF16),
        ("blk.0.attn_norm.weight", np.ones(64, np.float16), QT.F16),
        ("blk.0.ffn_gate.weight", already, QT.Q4_0),
        ("blk.0.positions", ints, QT.I32)])
    res = quantize_file(src, tmp_path / "out.gguf", "q4_0")
    t = open_gguf(res.path).tensors
    assert t["blk.0.ffn_up.weight"].tensor_type == QT.Q4_0
    assert np.asarray(t["blk.0.ffn_up.weight"].data).tobytes() == ggml.quantize(xb, "q4_0").tobytes()
    assert t["blk.0.attn_norm.weight"].tensor_type == QT.F32 and (np.asarray(t["blk.0.attn_norm.weight"].data) == 1).all()
    assert t["blk.0.ffn_gate.weight"].tensor_type == QT.Q4_0
    assert np.asarray(t["blk.0.ffn_gate.weight"].data).tobytes() == already.tobytes()
    # a tensor already quantized to another type is not requantized: the file is refused
    with pytest.raises(PowerInferError, match=r"already quantized \(1 Q4_0 tensors\), not q8_0"):
        quantize_file(src, tmp_path / "out8.gguf", "q8_0")
    assert not (tmp_path / "out8.gguf").exists()
    assert np.array_equal(t["blk.0.positions"].data, ints)
    g = open_gguf(res.path)
    assert g.get("custom.floats") == [1.5, -2.25] and g.get("custom.flag") is True
    assert list(g.reader.fields) == list(open_gguf(src).reader.fields) + ["general.file_type"]


def _fails(args, *needles):
    r = CliRunner().invoke(quantize_main, [str(a) for a in args] + ["--no-progress"])
    assert r.exit_code == 1, r.output
    assert r.output.count("Error:") == 1 and r.output.strip().count("\n") == 0, r.output
    for n in needles:
        assert str(n) in r.output, r.output
    return r.output


def test_unsupported_type_is_one_line_listing_the_supported_ones(files, tmp_path):
    _fails([files["f16"], tmp_path / "o.gguf", "q3_k"], "'q3_k' is not supported; supported: q4_0, q8_0")
    assert list(tmp_path.iterdir()) == []


def test_corrupted_tensor_size_is_refused_before_writing(files, tmp_path):
    """ne0 of blk.0.attn_q.weight in the Q8_0 file changed from 64 to 48 (not a multiple of 32)."""
    data = bytearray(Path(files["q8_0"]).read_bytes())
    g = open_gguf(files["q8_0"])
    t = g.tensors["blk.0.attn_q.weight"]
    ne0_at = int(t.field.offset) + 8 + len(t.name) + 4  # name length (u64), name, n_dims (u32), then ne0
    assert struct.unpack_from("<Q", data, ne0_at)[0] == 64
    struct.pack_into("<Q", data, ne0_at, 48)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    out = _fails([bad, tmp_path / "o.gguf", "q4_0"], bad)
    assert "blk.0.attn_q.weight" in out or "corrupt" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_nan_in_a_tensor_is_named_and_nothing_is_written(files, tmp_path):
    data = bytearray(Path(files["f32"]).read_bytes())
    t = open_gguf(files["f32"]).tensors["blk.2.ffn_gate.weight"]
    struct.pack_into("<f", data, int(t.data_offset) + 4 * (64 * 3 + 7), float("nan"))
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    _fails([bad, tmp_path / "o.gguf", "q8_0"], "blk.2.ffn_gate.weight: row 3 holds NaN")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]


def test_unwritable_output_and_bad_inputs(files, tmp_path):
    (tmp_path / "afile").write_text("x")
    _fails([files["f16"], tmp_path / "afile" / "sub" / "o.gguf", "q4_0"], "afile")
    _fails([tmp_path / "missing.gguf", tmp_path / "o.gguf", "q4_0"], "missing.gguf", "not found")
    _fails([files["f16"], files["f16"], "q4_0"], "is an input file")
    (tmp_path / "text.gguf").write_text("not a gguf at all")
    _fails([tmp_path / "text.gguf", tmp_path / "o.gguf", "q4_0"], "wrong magic")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        _fails([files["f16"], ro / "o.gguf", "q4_0"], ro)


class Killed(BaseException):
    """Stands for SIGKILL/SIGINT: not an error the code catches."""


def test_failure_half_way_leaves_the_earlier_output_intact(files, tmp_path, monkeypatch):
    out = tmp_path / "o.gguf"
    quantize_file(files["f16"], out, "q8_0")
    before = out.read_bytes()
    calls = {"n": 0}
    real = ggml.quantize

    def dies_on_the_tenth(*a, **k):
        calls["n"] += 1
        if calls["n"] == 10:
            raise Killed
        return real(*a, **k)

    monkeypatch.setattr(ggml, "quantize", dies_on_the_tenth)
    with pytest.raises(Killed):
        quantize_file(files["f16"], out, "q4_0")
    assert calls["n"] == 10
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]  # no temporary file left


# VmHWM, the peak RSS of this process's own memory map (ru_maxrss would start at the forking parent's)
PEAK_SCRIPT = r"""
import sys
from powerinfer.convert.quantize import quantize_file

def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))

base = hwm()
res = quantize_file(sys.argv[1], sys.argv[2], "q4_0")
print(base, hwm(), res.in_bytes, res.out_bytes)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_does_not_grow_with_the_input(tmp_path):
    """A 168 MB f32 input: peak RSS grows by about one tensor, not the input (pages read are handed back;
    without that it grows by 178 MB)."""
    shapes = [(f"blk.{i}.ffn_up.weight", (2048, 4096)) for i in range(5)] + [("output_norm.weight", (4096,))]
    w = gguf.GGUFWriter(str(tmp_path / "in.gguf"), "llama")
    for n, s in shapes:
        w.add_tensor_info(n, s, np.dtype(F), int(np.prod(s)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    row = np.random.default_rng(0).standard_normal(4096).astype(F)
    for n, s in shapes:
        w.write_tensor_data(np.broadcast_to(row, s).copy() if len(s) == 2 else np.ones(s, F))
    w.close()
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "in.gguf"), str(tmp_path / "o.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    base, peak, in_bytes, out_bytes = map(int, r.stdout.split())
    assert in_bytes > 160e6 and out_bytes < in_bytes / 6
    grown = (peak - base) * 1024
    assert grown < 64e6, grown  # one tensor's pages (33.5 MB) + a chunk's temporaries; the input is 168 MB

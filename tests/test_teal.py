"""Input-sparse (TEAL) decoding of SiLU-gated models: the file contract, the products against a masked
dense reference for every kind and weight type, calibration and the writers, the refusals.

Models: the tiny random Llama 3.1 / Qwen2 / Qwen3 of ``family_models.MODERN_BUILDERS`` (n_embd 64,
n_ff 128, 3 layers), converted by ``pi-convert`` and calibrated on TinyStories text through the
runtime itself (``convert/teal.py``)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from family_models import MODERN_BUILDERS, make_tiny_llama
from helpers import story_text

from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.teal import KINDS, MATRICES, read_teal
from powerinfer.quant.qweight import QWeight

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
S = 0.4
TEXT = story_text(6000)
PROMPT = torch.tensor([1, 34, 210, 7, 99, 300, 12, 5, 61, 400, 3, 18])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{(family, type): (dense gguf, teal gguf)}``: llama3 in every type (thresholds calibrated once on
    its f32 file, so every type shares them), qwen2 (q/k/v biases) and qwen3 (q/k norms) in f32."""
    from powerinfer.convert.teal import calibrate, uniform_thresholds, write_teal
    from powerinfer.convert.writer import convert

    tmp = tmp_path_factory.mktemp("teal")
    out = {}
    for fam, types in (("llama3", TYPES), ("qwen2", ("f32",)), ("qwen3", ("f32",)), ("mistral", ("f32",)),
                       ("nemo", ("f32",))):
        d = MODERN_BUILDERS[fam](tmp / fam)
        dense = {t: convert(d, tmp / f"{fam}-{t}.gguf", outtype=t, progress=False) for t in types}
        hist, n = calibrate(dense["f32"], TEXT)
        assert hist.shape == (3, 4, hist.shape[2]) and int(hist[0, 0].sum()) == n * 64  # every entry counted
        assert int(hist[0, 3].sum()) == n * 128  # ffn_down's input: n_ff entries per token
        assert int(hist[0, 1].sum()) == n * {"nemo": 96, "qwen3": 128}.get(fam, 64)  # attn_output's: n_head * head_dim
        thr = uniform_thresholds(hist, S)
        for t in types:
            out[fam, t] = (dense[t], write_teal(dense[t], tmp / f"{fam}-{t}.teal.gguf", thr, S))
    return out


def _wt_f32(w) -> torch.Tensor:
    """A product's ``W^T`` ``[K, N]`` as fp32 (the stored values, dequantized)."""
    ws = w if isinstance(w, list) else [w]
    return torch.cat([p.dequantize().float() if isinstance(p, QWeight) else p.float() for p in ws], dim=1)


def _int_axpy(x: torch.Tensor, thr: float, w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi_q_axpy_sparse``'s rule in torch for a Q4_0/Q8_0 ``W^T`` ``[K, N]`` and ``x`` ``[K]`` fp32: the kept
    rows (``|x| >= thr``, ``x != 0``) ordered by the octave of ``|x|`` (stable), in groups of 32; per group and output block of 32, coefficients
    ``c = x_j * d_j`` rounded half-to-even on the scale ``max |c| / QMAX`` (127 Q4_0, 32767 Q8_0), exact integer
    sums. Returns (the product ``[N]``, its stated error bound against the unrounded product ``[N]``:
    sum over groups of ``scale / 2 * sum_j |q_j|``)."""
    K, N = w.n_rows, w.n_cols
    q4 = w.btype.name == "Q4_0"
    nb = N // 32
    raw = w.raw.view(K, nb, 18 if q4 else 34)
    d = raw[..., :2].contiguous().view(torch.float16).float().view(K, nb)
    if q4:
        qs = raw[..., 2:].to(torch.int64)
        q = torch.cat([qs & 15, qs >> 4], dim=-1) - 8
    else:
        q = raw[..., 2:].contiguous().view(torch.int8).to(torch.int64)
    sel = ((x.abs() >= thr) & (x != 0)).nonzero().view(-1)
    e = (x[sel].view(torch.int32) >> 23) & 0xFF  # the fp32 exponent field; rows ordered by octave below the largest
    sel = sel[torch.sort((e.max() - e).clamp(max=15) if sel.numel() else e, stable=True).indices]
    out, bound = torch.zeros(nb, 32), torch.zeros(nb, 32)
    for g0 in range(0, sel.numel(), 32):
        j = sel[g0:g0 + 32]
        c = x[j, None] * d[j]  # [n, nb] fp32, as the kernel multiplies
        s = c.abs().amax(0) / (127 if q4 else 32767)
        qc = torch.round(c * torch.where(s > 0, 1 / s, torch.zeros_like(s))).to(torch.int64)
        out = out + s[:, None] * (qc[:, :, None] * q[j]).sum(0).float()
        bound = bound + s[:, None] / 2 * q[j].abs().sum(0).float()
    return out.view(N), bound.view(N)


def _int_rounded(p) -> bool:
    """Whether a product's decode rounds its coefficients (Q4_0/Q8_0 ``W^T``, the C kernels)."""
    from powerinfer.runtime import kernels

    return p.input_major and all(kernels.axpy_sparse_ok(w) for w in (p.w if isinstance(p.w, list) else [p.w]))


def _decode_reference(p, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounded decode of product ``p`` on ``x`` ``[T, K]`` (bias added) and its error bound, ``[T, N]`` each."""
    ws = p.w if isinstance(p.w, list) else [p.w]
    outs, bounds = [], []
    for t in range(x.shape[0]):
        r = [_int_axpy(x[t].float(), p.threshold, w) for w in ws]
        outs.append(torch.cat([o for o, _ in r]))
        bounds.append(torch.cat([b for _, b in r]))
    out = torch.stack(outs)
    return (out if p.bias is None else out + p.bias), torch.stack(bounds)


def _record_inputs(model, ids):
    """Every product's inputs ``[T, K]`` on a prompt (the model's own activations)."""
    seen = {}
    for i, kind, p in model.products():
        p.recorder = (lambda key: (lambda x: seen.__setitem__(key, x.clone())))((i, kind))
    model.forward(ids, 0, all_logits=True)
    for _, _, p in model.products():
        p.recorder = None
    return seen


@pytest.mark.parametrize("key", [("llama3", t) for t in TYPES] + [(f, "f32") for f in ("qwen2", "qwen3", "mistral",
                                                                                       "nemo")])
def test_products_equal_masked_dense_reference(files, key):
    """Decode (one token: AXPY over the kept rows) and prompt (masked tiles) products of every kind equal
    ``(x * (|x| >= t)) @ W^T (+ b)`` on the stored values; the mask drops about S of the inputs."""
    from powerinfer.runtime.input_sparse import TealTransformer

    model = TealTransformer(open_gguf(files[key][1]))
    xs = _record_inputs(model, PROMPT)
    dropped = []
    for (i, kind), x in xs.items():
        p = model.teal_layers[i].products[kind]
        assert p.input_major and p.threshold > 0
        xm = x.float() * (x.abs() >= p.threshold)
        ref = xm @ _wt_f32(p.w)
        if p.bias is not None:
            ref = ref + p.bias
        tol = 1e-5 * (1 + ref.abs().max().item())
        p.n_in = p.n_kept = 0
        assert (p(x) - ref).abs().max().item() <= tol, (i, kind, "prompt")
        assert p.n_kept == int((x.abs() >= p.threshold).sum()) and p.n_in == x.numel()
        p.n_in = p.n_kept = 0
        dec = torch.cat([p(x[t:t + 1]) for t in range(x.shape[0])])
        if _int_rounded(p):  # integer decode: the rounding rule, and its bound against the unrounded product
            dref, bound = _decode_reference(p, x)
            assert (dec - dref).abs().max().item() <= tol, (i, kind, "decode")
            assert ((dref - ref).abs() <= bound + tol).all(), (i, kind, "bound")
            if key[1] == "q4_0":
                assert (dref - ref).abs().max().item() > 10 * tol  # the reference rounds: it is not the exact one
        else:
            assert (dec - ref).abs().max().item() <= tol, (i, kind, "decode")
        assert p.n_kept == int((x.abs() >= p.threshold).sum()) and p.n_in == x.numel()
        dense = x.float() @ _wt_f32(p.w) + (0 if p.bias is None else p.bias)
        assert (dense - ref).abs().max().item() > 10 * tol  # the mask changes the product
        dropped.append(1 - p.n_kept / p.n_in)
    assert 0.2 < sum(dropped) / len(dropped) < 0.6


def test_file_contract(files):
    """Keys, thresholds, ``_t`` names (W^T of the dense file's W, bit for bit in f32), output head dense."""
    dense, teal = files["llama3", "f32"]
    gd, g = open_gguf(dense), open_gguf(teal)
    info = read_teal(g, 3)
    assert g.get("powerinfer.teal.sparsity") == pytest.approx(S) and info.method == "uniform"
    assert all(t > 0 and math.isfinite(t) for row in info.thresholds for t in row)
    for i in range(3):
        for kind in KINDS:
            for m in MATRICES[kind]:
                name = f"blk.{i}.{m}"
                assert f"{name}.weight" not in g.tensors
                w = torch.from_numpy(gd.tensors[f"{name}.weight"].data.copy())
                wt = torch.from_numpy(g.tensors[f"{name}_t.weight"].data.copy())
                assert torch.equal(wt, w.T)
    assert "output.weight" in g.tensors and g.tensors["output.weight"].tensor_type == gd.tensors["output.weight"].tensor_type
    assert not g.sparse  # GGUF magic, not PWRI


@pytest.mark.parametrize("key", [("llama3", "q8_0"), ("mistral", "f32")])  # mistral: window 8 < the prompt
def test_decode_equals_prompt_and_dense_run_differs(files, key):
    """Token-by-token logits (AXPY path) equal one prompt's (masked tiles); ``dense=True`` on the same file
    equals the dense GGUF; the sparse model differs from it (by > 0.2). Q8_0's decode rounds its coefficients
    to int16 (1e-5 of a product, :func:`_int_axpy`), which moves inputs across the thresholds of the next
    products of this 64-wide random model: decode and prompt then agree within 0.05 (0.013 measured)."""
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.model import Transformer

    dense_f, teal_f = files[key]
    m = TealTransformer(open_gguf(teal_f))
    tol = 0.05 if any(_int_rounded(p) for _, _, p in m.products()) else 1e-4
    lp = m.forward(PROMPT, 0, all_logits=True)
    for t in range(len(PROMPT)):
        assert (m.forward(PROMPT[t:t + 1], t) - lp[t]).abs().max().item() < tol
    by = m.sparsity_by_kind()
    assert all(0.1 < v < 0.7 for v in by.values()), by
    dense_f, teal_f = files[key[0], "f32"]
    ref = Transformer(open_gguf(dense_f)).forward(PROMPT, 0, all_logits=True)
    md = TealTransformer(open_gguf(teal_f), dense=True)
    assert (md.forward(PROMPT, 0, all_logits=True) - ref).abs().max().item() < 1e-4
    assert (TealTransformer(open_gguf(teal_f)).forward(PROMPT, 0, all_logits=True) - ref).abs().max().item() > 0.2


def test_bench_prints_sparsity_per_kind(files):
    from powerinfer.runtime.cli import main

    r = CliRunner().invoke(main, ["-m", str(files["llama3", "q4_0"][1]), "-n", "6", "--bench", "-p", "Once upon"])
    assert r.exit_code == 0, r.output
    line = next(l for l in r.output.splitlines() if "input sparsity reached" in l)
    for kind in KINDS:
        v = float(line.split(f"{kind} ")[1].split("%")[0])
        assert 5 < v < 80, line

    def kb(out: str) -> float:
        return float(out.split("weights read: ")[1].split(" KB")[0])

    d = CliRunner().invoke(main, ["-m", str(files["llama3", "q4_0"][0]), "-n", "6", "--bench", "-p", "Once upon"])
    assert d.exit_code == 0 and "input sparsity" not in d.output, d.output
    assert 0.5 * kb(d.output) < kb(r.output) < 0.9 * kb(d.output)  # the kept rows only (output head dense)
    assert "FFN neurons computed" not in r.output


def test_pi_sparsify_and_pi_convert(files, tmp_path):
    """``pi-sparsify`` on a GGUF (histograms to an activation folder, then reused) and ``pi-convert
    --sparsity --data`` on the HF folder give the same thresholds as the library calibration."""
    from powerinfer.convert.cli import main as convert_main
    from powerinfer.convert.teal_cli import main

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    dense = files["llama3", "f32"][0]
    act = tmp_path / "act"
    from powerinfer.formats.activation import save_activation_dir

    save_activation_dir(act, [torch.arange(128) for _ in range(3)])  # a pi-profile folder: its counts are kept
    r = CliRunner().invoke(main, [str(dense), str(tmp_path / "a.gguf"), "--sparsity", "0.4", "--data", str(text),
                                  "--activation", str(act)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in act.iterdir()) == sorted(
        ["input_hist.json"] + [f"{k}_hist_{i}.pt" for k in ("input", "wina") for i in range(3)]
        + [f"activation_{i}.pt" for i in range(3)])
    assert torch.equal(torch.load(act / "activation_2.pt", weights_only=True), torch.arange(128))
    h = torch.load(act / "input_hist_0.pt", weights_only=True)
    assert h.dtype == torch.int64 and h.shape[0] == 4
    r = CliRunner().invoke(main, [str(dense), str(tmp_path / "b.gguf"), "--sparsity", "0.4", "--activation", str(act)])
    assert r.exit_code == 0, r.output
    want = read_teal(open_gguf(files["llama3", "f32"][1]), 3).thresholds
    assert read_teal(open_gguf(tmp_path / "a.gguf"), 3).thresholds == want
    assert read_teal(open_gguf(tmp_path / "b.gguf"), 3).thresholds == want
    hf = Path(dense).parent / "llama3"
    r = CliRunner().invoke(convert_main, [str(hf), "--outfile", str(tmp_path / "c.gguf"), "--outtype", "f32",
                                          "--sparsity", "0.4", "--data", str(text)])
    assert r.exit_code == 0, r.output
    assert read_teal(open_gguf(tmp_path / "c.gguf"), 3).thresholds == want
    r = CliRunner().invoke(convert_main, [str(hf), str(act), "--outfile", str(tmp_path / "d.gguf"), "--outtype", "f32",
                                          "--sparsity", "0.4"])  # MODEL ACT_DIR: the folder's histograms
    assert r.exit_code == 0, r.output
    assert read_teal(open_gguf(tmp_path / "d.gguf"), 3).thresholds == want
    r = CliRunner().invoke(convert_main, [str(hf), "--outfile", str(tmp_path / "e.gguf"), "--sparsity", "0.4"])
    assert r.exit_code != 0 and "an activation folder (second argument) or --data" in r.output
    assert not (tmp_path / "e.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("pi-teal-")] == []  # temp dense file gone


@pytest.mark.parametrize("args,msg", [
    (["--sparsity", "0.95"], "expected a number in [0, 0.9]"),
    (["--sparsity", "-0.1"], "expected a number in [0, 0.9]"),
    (["--sparsity", "0.4", "--data", "SHORT"], "too short: "),
])
def test_pi_sparsify_bad_input_is_one_line(files, tmp_path, args, msg):
    from powerinfer.convert.teal_cli import main

    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a cat.")
    args = [str(short) if a == "SHORT" else a for a in args]
    out = tmp_path / "o.gguf"
    r = CliRunner().invoke(main, [str(files["llama3", "f32"][0]), str(out), *args])
    assert r.exit_code != 0 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["short.txt"]
    if "short" in msg:
        assert "at least 256 needed" in r.output


def test_relu_model_is_refused(tmp_path):
    """A ReLU-gated llama (already sparse: PowerInfer's kind) is not a TEAL model: one line, no file."""
    from powerinfer.convert.teal_cli import main
    from powerinfer.convert.writer import convert

    f = convert(make_tiny_llama(tmp_path / "relu"), tmp_path / "relu.gguf", outtype="f32", progress=False)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    r = CliRunner().invoke(main, [str(f), str(tmp_path / "o.gguf"), "--sparsity", "0.4", "--data", str(text)])
    assert r.exit_code != 0 and "SiLU/GELU-gated" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "o.gguf").exists()


def test_bad_thresholds_in_a_file_are_refused(files, tmp_path):
    """A threshold tensor missing, negative or NaN: PowerInferError naming the file and tensor."""
    import numpy as np
    from gguf_edit import parse, serialize

    src = Path(files["llama3", "f32"][1]).read_bytes()
    g = parse(src)
    ti = next(t for t in g.tensors if t.name == "blk.1.teal_thresholds")
    ti.name = "blk.1.teal_thresholdz"
    (tmp_path / "missing.gguf").write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match="blk.1.teal_thresholds is missing"):
        read_teal(open_gguf(tmp_path / "missing.gguf"), 3)
    for bad in (-1.0, float("nan")):
        g = parse(src)
        ti = next(t for t in g.tensors if t.name == "blk.1.teal_thresholds")
        data = bytearray(g.data)
        data[ti.offset:ti.offset + 4] = np.float32(bad).tobytes()
        g.data = bytes(data)
        (tmp_path / "bad.gguf").write_bytes(serialize(g))
        with pytest.raises(PowerInferError, match="blk.1.teal_thresholds = .*finite, >= 0"):
            read_teal(open_gguf(tmp_path / "bad.gguf"), 3)


def test_ram_budget_and_batching_refuse_a_teal_file(files):
    from powerinfer.runtime.batch import check_batchable
    from powerinfer.runtime.loading import load_model

    f = str(files["llama3", "q4_0"][1])
    with pytest.raises(PowerInferError, match="--ram-budget does not run input-sparse"):
        load_model(f, ram_budget=1.0)
    model, tok = load_model(f)
    with pytest.raises(PowerInferError, match=r"-np > 1\) do not run input-sparse"):
        check_batchable(model)
    from powerinfer.server.scheduler import Scheduler

    with pytest.raises(PowerInferError, match=r"-np > 1\) do not run input-sparse"):
        Scheduler(model, tok, 2)  # pi-server -np 2


def test_greedy_allocation_reaches_the_target_per_block(files):
    """TEAL's greedy allocation: each block's parameter-weighted sparsity equals the target, the inputs get
    different levels, and the block error it reaches is at most uniform's on the same tokens."""
    from powerinfer.convert.teal import calibrate, greedy_levels

    dense = files["llama3", "f32"][0]
    hist, _ = calibrate(dense, TEXT)
    lv = greedy_levels(dense, hist, TEXT, S).double()
    D, F_, hd = 64, 128, 16
    params = torch.tensor([(4 + 2 * 2) * hd * D, D * 4 * hd, 2 * F_ * D, F_ * D], dtype=torch.float64)
    w = params / params.sum()
    assert torch.allclose(lv @ w, torch.full((3,), S, dtype=torch.float64), atol=1e-6)
    assert (lv.max(1).values - lv.min(1).values > 0.05).all()  # not uniform
    assert (lv >= 0).all() and (lv <= 0.9 + 1e-6).all()


def test_pi_perplexity_compare_on_stories260k(tmp_path):
    """The real stories260K (SiLU): ``--compare`` on its TEAL file gives the dense file's perplexity for the
    dense run (same weights, input-major layout) and a higher one for the sparse run."""
    from helpers import STORIES, TEXT as TEXTS

    from powerinfer.eval.cli import main as ppl_main

    from powerinfer.convert.teal_cli import main

    src = STORIES / "stories260K.ggml-org.gguf"
    val = (TEXTS / "tinystories_val.txt").read_text()
    (tmp_path / "cal.txt").write_text(val[:20000])
    (tmp_path / "ev.txt").write_text(val[-6000:])
    r = CliRunner().invoke(main, [str(src), str(tmp_path / "s.gguf"), "--sparsity", "0.4", "--method", "greedy",
                                  "--data", str(tmp_path / "cal.txt")])
    assert r.exit_code == 0 and "greedy" in r.output, r.output
    args = ["-f", str(tmp_path / "ev.txt"), "-c", "128", "--chunks", "4", "--dtype", "f32", "-ctk", "f32", "-ctv", "f32"]  # f32 caches: an f16 cache rounds the two layouts' 1e-7 differences apart (1.6e-4 in PPL)
    dense = CliRunner().invoke(ppl_main, ["-m", str(src), *args])
    cmp_ = CliRunner().invoke(ppl_main, ["-m", str(tmp_path / "s.gguf"), *args, "--compare"])
    assert dense.exit_code == 0 and cmp_.exit_code == 0, cmp_.output
    ppl_dense = float(dense.output.split("Final estimate: PPL = ")[1].split()[0])
    rows = {l.split()[0]: l.split() for l in cmp_.output.splitlines() if l.startswith(("dense ", "teal "))}
    assert float(rows["dense"][1]) == pytest.approx(ppl_dense, rel=1e-4)
    assert float(rows["teal"][1]) > 1.02 * ppl_dense


def test_outtype_requantizes_the_input_major_matrices(files, tmp_path):
    """``--outtype q4_0`` on an f32 GGUF: the ``_t`` matrices are Q4_0 (quantized along the outputs), the rest
    copied as they are, and the products still equal the masked reference on the stored values."""
    from powerinfer.convert.teal import load_hist, sparsify
    from powerinfer.runtime.input_sparse import TealTransformer

    dense = files["llama3", "f32"][0]
    out, thr = sparsify(dense, tmp_path / "q.gguf", S, TEXT, act_dir=tmp_path / "act", outtype="q4_0")
    assert load_hist(tmp_path / "act", 3).shape[:2] == (3, 4)
    g = open_gguf(out)
    assert g.tensors["blk.0.attn_q_t.weight"].tensor_type.name == "Q4_0"
    assert g.tensors["blk.2.ffn_down_t.weight"].tensor_type.name == "Q4_0"
    assert g.tensors["output.weight"].tensor_type.name == "F32" and g.tensors["token_embd.weight"].tensor_type.name == "F32"
    model = TealTransformer(g)
    for (i, kind), x in _record_inputs(model, PROMPT).items():
        p = model.teal_layers[i].products[kind]
        ref = (x * (x.abs() >= p.threshold)) @ _wt_f32(p.w)
        if _int_rounded(p):
            ref = _decode_reference(p, x)[0]
        dec = torch.cat([p(x[t:t + 1]) for t in range(x.shape[0])])
        assert (dec - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item())


def test_writer_refuses_a_sparse_input_and_bad_thresholds_without_a_file(files, tmp_path):
    from powerinfer.convert.teal import write_teal

    with pytest.raises(PowerInferError, match="not a dense GGUF"):
        write_teal(files["llama3", "f32"][1], tmp_path / "x.gguf", torch.ones(3, 4), S)
    with pytest.raises(PowerInferError, match="finite and >= 0"):
        write_teal(files["llama3", "f32"][0], tmp_path / "x.gguf", torch.full((3, 4), float("nan")), S)
    assert not (tmp_path / "x.gguf").exists()


def test_dense_gguf_with_compare_is_one_line(files, tmp_path):
    """A GGUF without thresholds (or predictors) run with ``--compare``: one line naming both sparse kinds."""
    from powerinfer.eval.cli import main as ppl_main

    (tmp_path / "ev.txt").write_text(TEXT)
    r = CliRunner().invoke(ppl_main, ["-m", str(files["llama3", "f32"][0]), "-f", str(tmp_path / "ev.txt"),
                                      "--compare"])
    assert r.exit_code != 0 and "no TEAL thresholds" in r.output and "pi-sparsify" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("typ", ["f32", "q4_0"])
def test_mixed_dense_and_sparse_inputs(files, tmp_path, typ):
    """Thresholds 0 on some inputs: those matrices stay row-major under their usual names and run the dense
    kernels; the file runs, its prompt and decode agree, and with every threshold 0 it equals the dense GGUF."""
    from powerinfer.convert.teal import write_teal
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.model import Transformer

    dense, teal = files["llama3", typ]
    thr = torch.tensor(read_teal(open_gguf(teal), 3).thresholds)
    thr[:, 1:3] = 0  # attn_output and gate/up dense
    thr[1] = 0  # layer 1 all dense
    g = open_gguf(write_teal(dense, tmp_path / "m.gguf", thr, S))
    assert "blk.0.attn_q_t.weight" in g.tensors and "blk.0.attn_output.weight" in g.tensors
    assert "blk.1.attn_q.weight" in g.tensors and "blk.0.ffn_up.weight" in g.tensors
    m = TealTransformer(g)
    assert [p.input_major for _, _, p in m.products()] == [True, False, False, True] + [False] * 4 + \
        [True, False, False, True]
    # Q4_0's integer decode rounds its coefficients to 8 bits, as the dense kernels round activations (those
    # move this model's logits by up to 0.3 against unrounded products): decode within 0.5 of the prompt
    tol = 0.5 if any(_int_rounded(p) for _, _, p in m.products()) else 1e-3
    lp = m.forward(PROMPT, 0, all_logits=True)
    for t in range(len(PROMPT)):
        assert (m.forward(PROMPT[t:t + 1], t) - lp[t]).abs().max().item() < tol
    zero = TealTransformer(open_gguf(write_teal(dense, tmp_path / "z.gguf", torch.zeros(3, 4), 0.0)))
    ref = Transformer(open_gguf(dense))
    assert torch.allclose(zero.forward(PROMPT, 0, all_logits=True), ref.forward(PROMPT, 0, all_logits=True),
                          atol=1e-5, rtol=0)
    for t in range(3):  # decode: the same dense kernels, the same numbers
        assert torch.allclose(zero.forward(PROMPT[t:t + 1], t), ref.forward(PROMPT[t:t + 1], t), atol=1e-5, rtol=0)


@pytest.mark.parametrize("btype", ["Q4_0", "Q8_0"])
def test_integer_axpy_kernel_follows_its_rounding_rule(lib, btype):
    """``pi_q_axpy_sparse`` (the SIMD build and the portable scalar one) against :func:`_int_axpy`: shapes with a
    partial last group, an odd number of kept rows, exact zeros (skipped, still counted), outliers (octave
    order), 1 and 2 threads (the same bits: groups do not depend on threads); and within the stated bound of
    the unrounded product."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from powerinfer.quant.types import KERNEL_TYPES
    from powerinfer.runtime import kernels

    gen = torch.Generator().manual_seed(1)
    for K, N in ((7, 32), (75, 96), (300, 4096), (1100, 544)):
        w_t = torch.randn(K, N, generator=gen) * torch.rand(K, 1, generator=gen)
        raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(w_t.numpy(), GGMLQuantizationType[btype])))
        w = QWeight(raw, KERNEL_TYPES[btype], K, N)
        assert kernels.axpy_sparse_ok(w)
        x = torch.randn(K, generator=gen) * torch.rand(K, generator=gen)
        x[::5] = 0
        x[1::17] *= 50  # outliers
        exact_w = w.dequantize().float()
        for thr in (0.0, 0.25):
            ys = []
            for nt in (1, 2):
                torch.set_num_threads(nt)
                y, kept = kernels.rows_axpy_sparse(x, w, thr)
                ys.append(y)
            torch.set_num_threads(1)
            assert torch.equal(ys[0], ys[1])
            assert kept == int((x.abs() >= thr).sum())
            ref, bound = _int_axpy(x, thr, w)
            tol = 1e-6 * (1 + ref.abs().max().item())
            assert (ys[0] - ref).abs().max().item() <= tol, (K, N, thr)
            exact = (x * (x.abs() >= thr)) @ exact_w
            assert ((ref - exact).abs() <= bound + tol).all()
            if btype == "Q4_0" and K > 7:
                assert (ref - exact).abs().max().item() > 100 * tol  # rounded, not the unrounded product

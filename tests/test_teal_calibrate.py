"""Input-sparsity calibration beyond test_teal.py: ``pi-profile`` on a Hugging Face folder and on a GGUF (the
same histograms from two engines), WINA's weighted criterion (file contract, runtime mask, calibration),
K-quant sources re-quantized by ``--outtype``, and bad input through the command lines (one line, exit 1,
no file).

Models: the real stories260K (``tests/data/stories260K``: its HF folder and llama.cpp's f32 GGUF of it),
the tiny random Llama 3.1 / Qwen3 of ``family_models.MODERN_BUILDERS`` (GQA, llama3 RoPE scaling; q/k norms and head_dim
32 > n_embd / n_head) converted by ``pi-convert --outtype f32``, and llama.cpp's Q4_K_M file
``tests/data/kquant/tiny-q4_k_m.gguf``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from family_models import MODERN_BUILDERS, make_falcon, make_tiny_llama
from helpers import DATA, STORIES, story_text
from test_teal import _record_inputs  # every product's inputs on a prompt

from powerinfer.convert.cli import main as convert_main
from powerinfer.convert.teal_cli import main as sparsify_main
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.input_hist import N_BINS, load_hist, log_edges, threshold_for
from powerinfer.formats.teal import KINDS, MATRICES, read_teal
from powerinfer.profile.cli import main as profile_main

S = 0.4
CAL = story_text(6000)
STORIES_GGUF = STORIES / "stories260K.ggml-org.gguf"
KQUANT = DATA / "kquant" / "tiny-q4_k_m.gguf"
PROMPT = torch.tensor([1, 34, 210, 7, 99, 300, 12, 5, 61, 400, 3, 18])


def _ok(cmd, args):
    r = CliRunner().invoke(cmd, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def _fails(cmd, args, *needles):
    """Exit 1, exactly one line of output, every needle in it."""
    r = CliRunner().invoke(cmd, [str(a) for a in args])
    assert r.exit_code == 1, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.count("Error:") == 1, r.output
    for n in needles:
        assert str(n) in r.output, r.output
    return r.output


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{name: (hf folder, f32 GGUF)}``: stories260K (the GGUF is llama.cpp's), Llama 3.1 and Qwen3 (pi-convert)."""
    from powerinfer.convert.writer import convert

    tmp = tmp_path_factory.mktemp("cal")
    out = {"stories260K": (STORIES / "hf", STORIES_GGUF)}
    for fam in ("llama3", "qwen3"):
        d = MODERN_BUILDERS[fam](tmp / fam)
        out[fam] = (d, convert(d, tmp / f"{fam}.gguf", outtype="f32", progress=False))
    (tmp / "cal.txt").write_text(CAL)
    return out, tmp / "cal.txt"


@pytest.fixture(scope="module")
def profiled(models, tmp_path_factory):
    """``{name: (hf act dir, gguf act dir)}``: pi-profile on both sources of each model, same text."""
    ms, text = models
    tmp = tmp_path_factory.mktemp("act")
    out = {}
    for name, (hf, gg) in ms.items():
        out[name] = []
        for src, tag in ((hf, "hf"), (gg, "gguf")):
            d = tmp / f"{name}-{tag}"
            o = _ok(profile_main, [src, "--data", text, "--out", d])
            assert "input histograms (|x| and WINA)" in o and "tokens" in o
            out[name].append(d)
    return out


@pytest.mark.parametrize("name", ["stories260K", "llama3", "qwen3"])
def test_profile_hf_and_gguf_give_the_same_histograms(models, profiled, name):
    """Transformers (HF folder) and this runtime (GGUF) see the same tokens and activations: every input's
    counts total ``n_tokens * K``, at most 0.3% of the values land in another bin (f32 rounding of two
    engines), and the thresholds at 25/40/50% agree to one bin (0.7%), for |x| and for WINA's criterion."""
    hf_dir, gg_dir = profiled[name]
    meta = [json.loads((d / "input_hist.json").read_text()) for d in (hf_dir, gg_dir)]
    n_tok = meta[0]["n_tokens"]
    assert n_tok == meta[1]["n_tokens"] >= 256 and meta[0]["wina"] and meta[0]["kinds"] == list(KINDS)
    g = open_gguf(models[0][name][1])
    n_layer = int(g.get(f"{g.arch}.block_count"))
    d_in = {"qkv": int(g.get(f"{g.arch}.embedding_length")), "gate_up": int(g.get(f"{g.arch}.embedding_length")),
            "down": int(g.get(f"{g.arch}.feed_forward_length"))}
    d_in["o"] = list(reversed(g.tensors["blk.0.attn_output.weight"].shape.tolist()))[1]
    ratio = float(log_edges()[1] / log_edges()[0])
    for crit in ("abs", "wina"):
        a, b = load_hist(hf_dir, n_layer, crit), load_hist(gg_dir, n_layer, crit)
        assert a.shape == (n_layer, 4, N_BINS)
        for k, kind in enumerate(KINDS):
            assert (a[:, k].sum(-1) == n_tok * d_in[kind]).all() and (b[:, k].sum(-1) == n_tok * d_in[kind]).all()
        moved = (a - b).abs().sum(-1).double() / a.sum(-1).double()
        assert moved.max() < 3e-3, (crit, moved)
        for i in range(n_layer):
            for k in range(4):
                for s in (0.25, 0.4, 0.5):
                    ta, tb = threshold_for(a[i, k], s), threshold_for(b[i, k], s)
                    assert ta > 0 and max(ta, tb) / min(ta, tb) <= ratio * (1 + 1e-9), (crit, i, k, s, ta, tb)
    assert not torch.equal(load_hist(hf_dir, n_layer, "abs"), load_hist(hf_dir, n_layer, "wina"))


def test_profile_folder_feeds_pi_convert_and_pi_sparsify(models, profiled, tmp_path):
    """``pi-convert MODEL ACT_DIR --sparsity S`` reads the HF profile; ``pi-sparsify --activation`` reads the
    GGUF profile; the thresholds agree within a bin (same histograms), and a profile folder keeps
    pi-profile's neuron counts when the histograms are rewritten."""
    hf, gg = models[0]["llama3"]
    hf_act, gg_act = profiled["llama3"]
    for method in ("uniform", "wina"):
        _ok(convert_main, [hf, hf_act, "--outfile", tmp_path / f"c-{method}.gguf", "--outtype", "f32",
                           "--sparsity", S, "--method", method])
        _ok(sparsify_main, [gg, tmp_path / f"s-{method}.gguf", "--sparsity", S, "--activation", gg_act,
                            "--method", method])
        a = read_teal(open_gguf(tmp_path / f"c-{method}.gguf"), 3)
        b = read_teal(open_gguf(tmp_path / f"s-{method}.gguf"), 3)
        assert a.method == b.method == method
        ratio = float(log_edges()[1] / log_edges()[0]) * (1 + 1e-6)
        for ra, rb in zip(a.thresholds, b.thresholds):
            assert all(x > 0 and max(x, y) / min(x, y) <= ratio for x, y in zip(ra, rb)), (ra, rb)


def _colnorms_ref(g, i: int, kind: str) -> torch.Tensor:
    """||W[:, j]||_2 of the dense file's matrices of ``kind`` (joined along their outputs), from torch."""
    ws = [torch.from_numpy(g.tensors[f"blk.{i}.{m}.weight"].data.copy()).float() for m in MATRICES[kind]]
    return torch.linalg.vector_norm(torch.cat(ws, dim=0), dim=0)


@pytest.fixture(scope="module")
def wina_file(models, tmp_path_factory):
    """qwen3 (f32) through ``pi-sparsify --method wina`` and through ``--method uniform``, same text."""
    ms, text = models
    tmp = tmp_path_factory.mktemp("wina")
    dense = ms["qwen3"][1]
    _ok(sparsify_main, [dense, tmp / "w.gguf", "--sparsity", S, "--data", text, "--method", "wina",
                        "--activation", tmp / "act"])
    _ok(sparsify_main, [dense, tmp / "u.gguf", "--sparsity", S, "--activation", tmp / "act"])
    return dense, tmp / "w.gguf", tmp / "u.gguf"


def test_wina_file_stores_the_column_norms(wina_file):
    """Method ``wina``; per layer and input, ``teal_colnorm_{kind}`` F32 [K] equal to the norms torch computes
    from the dense file's W; a uniform file has none; the thresholds differ from uniform's."""
    dense, w, u = wina_file
    gd, gw = open_gguf(dense), open_gguf(w)
    info = read_teal(gw, 3)
    assert info.method == "wina" and read_teal(open_gguf(u), 3).colnorms is None
    for i in range(3):
        for kind in KINDS:
            c = info.colnorm(i, kind)
            ref = _colnorms_ref(gd, i, kind)
            assert c.dtype.name == "float32" and c.shape == tuple(ref.shape)
            assert torch.allclose(torch.from_numpy(c), ref, rtol=1e-5, atol=0)
    assert [n for n in open_gguf(u).tensors if "colnorm" in n] == []
    assert info.thresholds != read_teal(open_gguf(u), 3).thresholds


def test_wina_products_use_the_weighted_mask(wina_file):
    """Decode (AXPY) and prompt (masked tiles) products of a WINA file equal ``(x * (|x| c >= t)) @ W^T + b``;
    that mask is not the |x| mask of the same share; on the calibration text each input keeps about 1 - S."""
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    _, w, _ = wina_file
    g = open_gguf(w)
    model = TealTransformer(g)
    differs = 0
    for (i, kind), x in _record_inputs(model, PROMPT).items():
        p = model.teal_layers[i].products[kind]
        c = torch.from_numpy(read_teal(g, 3).colnorm(i, kind))
        keep = x.abs() * c >= p.threshold
        wt = torch.cat([q.float() for q in (p.w if isinstance(p.w, list) else [p.w])], dim=1)
        ref = (x * keep) @ wt + (0 if p.bias is None else p.bias)
        tol = 1e-5 * (1 + ref.abs().max().item())
        assert (p(x) - ref).abs().max().item() <= tol
        assert (torch.cat([p(x[t:t + 1]) for t in range(len(x))]) - ref).abs().max().item() <= tol
        plain = x.abs() >= torch.quantile(x.abs().flatten(), 1 - keep.float().mean().item())
        differs += int((plain != keep).any())
    assert differs >= 6  # most of the 12 products pick other inputs than |x| would
    dense = TealTransformer(g, dense=True)  # the calibration's activations: the dense model's, in its chunks
    ids = GGUFTokenizer(g).encode(CAL)
    kept = {}
    with torch.inference_mode():
        for s in range(0, len(ids), 512):
            for key, x in _record_inputs(dense, torch.tensor(ids[s:s + 512])).items():
                c = torch.from_numpy(read_teal(g, 3).colnorm(*key))
                k = (x.abs() * c >= model.teal_layers[key[0]].products[key[1]].threshold)
                n0, t0 = kept.get(key, (0, 0))
                kept[key] = (n0 + int(k.sum()), t0 + k.numel())
    for key, (n, total) in kept.items():
        assert abs(n / total - (1 - S)) < 0.01, (key, n / total)


def test_wina_greedy_allocation(tmp_path):
    """WINA's criterion under TEAL's greedy allocation, on stories260K (real weights: the column norms vary):
    each block's parameter-weighted level is the target, the levels are not uniform and not those |x| gives;
    ``pi-sparsify --method wina-greedy`` stores them as weighted thresholds with the norms."""
    from powerinfer.convert.teal import calibrate_inputs, column_norms, greedy_levels, level_thresholds

    cal = calibrate_inputs(STORIES_GGUF, CAL)
    norms = column_norms(open_gguf(STORIES_GGUF), 5)
    lv = greedy_levels(STORIES_GGUF, cal.wina, CAL, S, colnorms=norms)
    D, F_, hd = 64, 172, 8  # 8 heads / 4 kv heads of 8
    params = torch.tensor([(8 + 2 * 4) * hd * D, D * 8 * hd, 2 * F_ * D, F_ * D], dtype=torch.float64)
    assert torch.allclose(lv.double() @ (params / params.sum()), torch.full((5,), S, dtype=torch.float64), atol=1e-6)
    assert (lv.max(1).values - lv.min(1).values > 0.05).all()
    assert (lv - greedy_levels(STORIES_GGUF, cal.hist, CAL, S)).abs().max() > 0.05
    (tmp_path / "t.txt").write_text(CAL)
    _ok(sparsify_main, [STORIES_GGUF, tmp_path / "g.gguf", "--sparsity", S, "--data", tmp_path / "t.txt",
                        "--method", "wina-greedy"])
    info = read_teal(open_gguf(tmp_path / "g.gguf"), 5)
    assert info.method == "wina-greedy" and info.colnorm(2, "down").shape == (F_,)
    assert torch.allclose(torch.tensor(info.thresholds), level_thresholds(cal.wina, lv))


def test_wina_contract_refusals(wina_file, tmp_path):
    """A WINA file without a column norm, with a norm of the wrong length or a negative one, and a uniform
    file carrying one: PowerInferError naming the file and the tensor."""
    import numpy as np
    from gguf_edit import parse, serialize

    _, w, u = wina_file
    src = Path(w).read_bytes()
    g = parse(src)
    next(t for t in g.tensors if t.name == "blk.1.teal_colnorm_down").name = "blk.1.teal_colnorm_dowm"
    (tmp_path / "a.gguf").write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match="blk.1.teal_colnorm_down is missing"):
        read_teal(open_gguf(tmp_path / "a.gguf"), 3)
    g = parse(src)
    t = next(t for t in g.tensors if t.name == "blk.0.teal_colnorm_o")
    data = bytearray(g.data)
    data[t.offset:t.offset + 4] = np.float32(-1).tobytes()
    g.data = bytes(data)
    (tmp_path / "b.gguf").write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match="blk.0.teal_colnorm_o: column norms must be finite and >= 0"):
        read_teal(open_gguf(tmp_path / "b.gguf"), 3)
    g = parse(src)
    g.kv("powerinfer.teal.method").value = "uniform"
    (tmp_path / "c.gguf").write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match="blk.0.teal_colnorm_qkv present, but only"):
        read_teal(open_gguf(tmp_path / "c.gguf"), 3)


def test_wina_from_a_folder_without_weighted_histograms(models, tmp_path):
    """An activation folder of |x| histograms only (an older version's): --method wina says so in one line."""
    from powerinfer.convert.teal import calibrate
    from powerinfer.formats.input_hist import save_hist

    dense = models[0]["llama3"][1]
    hist, n = calibrate(dense, CAL)
    save_hist(tmp_path / "act", hist, n, str(dense))
    _fails(sparsify_main, [dense, tmp_path / "o.gguf", "--sparsity", S, "--activation", tmp_path / "act",
                           "--method", "wina"], "no WINA histograms")
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_bytes(b"not a tensor"), "input_hist_1.pt: not a readable torch tensor file"),
    (lambda f: torch.save(torch.cat([torch.zeros(1, N_BINS, dtype=torch.int64), torch.load(f, weights_only=True)[1:]]), f),
     "input_hist_1.pt: an input with no counts (qkv)"),
])
def test_damaged_histogram_file_is_one_line(tmp_path, damage, words):
    """A histogram file that is not a tensor (torch.load's traceback before) or holds an input with no
    counts (every threshold 0, the input silently dense): one line naming the file, no output."""
    from powerinfer.formats.input_hist import save_hist

    hist = torch.randint(1, 9, (3, len(KINDS), N_BINS), generator=torch.Generator().manual_seed(0))
    save_hist(tmp_path / "act", hist, 300, "synthetic")
    assert torch.equal(load_hist(tmp_path / "act", 3), hist)
    damage(tmp_path / "act" / "input_hist_1.pt")
    with pytest.raises(PowerInferError, match="^" + re.escape(f"{tmp_path / 'act'}/{words}")):
        load_hist(tmp_path / "act", 3)


@pytest.mark.parametrize("outtype", ["q4_0", "q8_0", "f16"])
def test_kquant_source_requantized(tmp_path, outtype):
    """llama.cpp's Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0 matrices) with ``--outtype``: every input-major matrix
    in that type holds the transpose of the runtime's own dequantization of the source (within the new
    type's rounding), the tensors that stay (token_embd, output) are the source's bytes, and (f16) the sparse
    file's dense run equals the K-quant file's logits within f16 rounding."""
    import numpy as np

    from powerinfer.quant.qweight import QWeight
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.model import Transformer
    from powerinfer.runtime.weights import load_matrix

    (tmp_path / "cal.txt").write_text(CAL)
    out = tmp_path / "k.gguf"
    _ok(sparsify_main, [KQUANT, out, "--sparsity", S, "--data", tmp_path / "cal.txt", "--outtype", outtype])
    src, g = open_gguf(KQUANT), open_gguf(out)
    assert {src.tensors[f"blk.{i}.ffn_down.weight"].tensor_type.name for i in range(2)} == {"Q4_K", "Q6_K"}
    # the new type's rounding, relative to the matrix's largest |w|: Q4_0 up to one step (amax/8: the top
    # value clamps), Q8_0 half a step (amax/254, the f16 scale adds a little), f16 half an ulp (2^-11)
    tol = {"q4_0": 0.126, "q8_0": 0.0041, "f16": 5e-4}[outtype]
    for i in range(2):
        for kind in KINDS:
            for m in MATRICES[kind]:
                t = g.tensors[f"blk.{i}.{m}_t.weight"]
                assert t.tensor_type.name == outtype.upper()
                w = load_matrix(src, f"blk.{i}.{m}.weight", torch.float32, False)
                w = w.dequantize().float() if isinstance(w, QWeight) else w.float()  # [N, K]
                wt = load_matrix(g, f"blk.{i}.{m}_t.weight", torch.float32, False)
                wt = wt.dequantize().float() if isinstance(wt, QWeight) else wt.float()  # [K, N]
                err = (wt - w.T).abs().max().item() / w.abs().max().item()
                assert err < tol, (i, m, err)
    for name in ("token_embd.weight", "output.weight"):
        assert np.array_equal(np.asarray(g.tensors[name].data), np.asarray(src.tensors[name].data))
    if outtype != "f16":
        return
    from powerinfer.runtime import kernels

    kernels.set_backend("torch")  # fp32 activations on both sides (the C kernels quantize them for K-quants)
    try:
        ref = Transformer(src).forward(PROMPT, 0, all_logits=True)
        dense_run = TealTransformer(g, dense=True).forward(PROMPT, 0, all_logits=True)
    finally:
        kernels.set_backend("auto")
    err = (dense_run - ref).abs().max().item() / ref.abs().max().item()
    assert err < 3e-3, err


def test_kquant_source_without_outtype_is_one_line(tmp_path):
    (tmp_path / "cal.txt").write_text(CAL)
    _fails(sparsify_main, [KQUANT, tmp_path / "o.gguf", "--sparsity", S, "--data", tmp_path / "cal.txt"],
           "Q4_K", "the gguf package writes no K-quants", "give --outtype q4_0, q8_0 or f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt"]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("s", ["0.95", "-0.1", "nan", "1"])
def test_sparsity_out_of_range(models, tmp_path, s):
    hf, gg = models[0]["llama3"]
    (tmp_path / "t.txt").write_text(CAL)
    _fails(sparsify_main, [gg, tmp_path / "o.gguf", "--sparsity", s, "--data", tmp_path / "t.txt"],
           "--sparsity", "expected a number in [0, 0.9]")
    _fails(convert_main, [hf, "--outfile", tmp_path / "o.gguf", "--sparsity", s, "--data", tmp_path / "t.txt"],
           "expected a number in [0, 0.9]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_calibration_text_too_short(models, tmp_path):
    """Every way in (pi-sparsify, pi-convert --data, pi-profile on a folder and on a GGUF) says how many
    tokens it got and that 256 are needed, and writes nothing."""
    hf, gg = models[0]["stories260K"]
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a little cat. " * 10)
    needles = ("calibration text too short", "tokens, at least 256 needed")
    _fails(sparsify_main, [gg, tmp_path / "o.gguf", "--sparsity", S, "--data", short], *needles)
    _fails(convert_main, [hf, "--outfile", tmp_path / "o.gguf", "--sparsity", S, "--data", short], *needles)
    for src in (hf, gg):
        _fails(profile_main, [src, "--data", short, "--out", tmp_path / "act"], *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_ffn_not_silu_gated_is_refused(tmp_path):
    """A ReLU-gated Llama and a GELU Falcon (not gated): pi-convert --sparsity (before converting),
    pi-sparsify on the GGUF and pi-profile on the Falcon folder refuse in one line naming the FFN."""
    from powerinfer.convert.writer import convert

    relu = make_tiny_llama(tmp_path / "relu")
    falcon = make_falcon(tmp_path / "falcon", activation="gelu")
    (tmp_path / "t.txt").write_text(CAL)
    for d, what in ((relu, "gated relu"), (falcon, "not gated, gelu")):
        _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf", "--sparsity", S, "--data", tmp_path / "t.txt"],
               "config.json", "input sparsity needs a SiLU/GELU-gated FFN", what)
        f = convert(d, tmp_path / f"{d.name}.gguf", outtype="f32", progress=False)
        _fails(sparsify_main, [f, tmp_path / "o.gguf", "--sparsity", S, "--data", tmp_path / "t.txt"],
               f, "input sparsity needs a SiLU/GELU-gated FFN", what)
    _fails(profile_main, [falcon, "--data", tmp_path / "t.txt", "--out", tmp_path / "act"],
           "input sparsity needs a SiLU/GELU-gated FFN", "not gated, gelu")
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "act").exists()


@pytest.mark.parametrize("flag", ["--compare", "--oracle"])
def test_gguf_without_thresholds_with_sparse_flags(flag, tmp_path):
    """llama.cpp's dense stories260K GGUF with pi-perplexity's sparse flags: one line pointing at pi-sparsify."""
    from powerinfer.eval.cli import main as ppl_main

    (tmp_path / "ev.txt").write_text(CAL)
    _fails(ppl_main, ["-m", STORIES_GGUF, "-f", tmp_path / "ev.txt", flag], STORIES_GGUF, "no TEAL thresholds",
           flag, "pi-sparsify")


def test_wina_q8_0_decode_uses_the_weighted_mask(wina_file, tmp_path):
    """A Q8_0 WINA file's one-token products (the integer AXPY, whose C selection compares |x| alone) keep
    the inputs ``|x| c >= t`` picks: equal to ``(x * keep) @ dequant(W^T)`` within the kernel's int16
    coefficient rounding (1e-3 relative), far from the plain-|x| selection's result."""
    from powerinfer.quant.qweight import QWeight
    from powerinfer.runtime.input_sparse import TealTransformer

    dense, _, _ = wina_file
    q8 = tmp_path / "w-q8_0.gguf"
    _ok(sparsify_main, [dense, q8, "--sparsity", S, "--activation", wina_file[1].parent / "act", "--method", "wina",
                        "--outtype", "q8_0"])
    g = open_gguf(q8)
    model = TealTransformer(g)
    n_int = 0
    for (i, kind), x in _record_inputs(model, PROMPT).items():
        p = model.teal_layers[i].products[kind]
        parts = p.w if isinstance(p.w, list) else [p.w]
        if not all(isinstance(q, QWeight) for q in parts):
            continue
        n_int += 1
        c = torch.from_numpy(read_teal(g, 3).colnorm(i, kind))
        wt = torch.cat([q.dequantize().float() for q in parts], dim=1)
        x0 = x[-1:].float()
        ref = (x0 * (x0.abs() * c >= p.threshold)) @ wt + (0 if p.bias is None else p.bias)
        plain = (x0 * (x0.abs() >= p.threshold)) @ wt + (0 if p.bias is None else p.bias)
        got = p(x[-1:]).float()
        scale = 1 + ref.abs().max().item()
        assert (got - ref).abs().max().item() <= 1e-3 * scale, (i, kind)
        if not torch.equal(x0.abs() * c >= p.threshold, x0.abs() >= p.threshold):
            assert (got - plain).abs().max().item() > 1e-2 * scale, (i, kind)
    assert n_int >= 6

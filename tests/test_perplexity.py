"""pi-perplexity against transformers and llama.cpp, and its own consistency.

Measured here (f32, 2-core CPU): ours vs transformers on stories260K 1.6e-8 relative;
batched vs token-by-token 2e-7 relative (sparse, predictor masks), per-token NLL within
2.3e-5 nats; the oracle equals dense bit for bit. The tolerances below leave room for other
CPUs' summation orders, not for a wrong method.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from click.testing import CliRunner

import powerinfer
from powerinfer.convert.writer import convert
from powerinfer.eval.cli import main as ppl_main
from powerinfer.eval.perplexity import chunk_tokens, perplexity, ppl_and_stderr
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.tokenizer import GGUFTokenizer

from helpers import STORIES, TEXT, need

N_CTX, N_CHUNKS = 256, 4
FINAL = re.compile(r"^Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})$", re.M)


@pytest.fixture(scope="module")
def text() -> str:
    """~14.5K tokens of real TinyStories validation text (more than 2 x 4 chunks of 256)."""
    return need(TEXT / "tinystories_val.txt").read_text()[:30000]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("text") / "val.txt"
    p.write_text(text + "\n")  # the trailing newline is dropped, as llama.cpp's -f does
    return p


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory, stories_hf):
    return convert(stories_hf, tmp_path_factory.mktemp("s") / "stories260K.gguf", outtype="f32", progress=False)


@pytest.fixture(scope="module")
def chunks(stories_gguf, text):
    tok = GGUFTokenizer(open_gguf(stories_gguf))
    ids = tok.encode(text)
    assert tok.add_bos and ids[0] == tok.bos_id
    return chunk_tokens(ids, N_CTX, N_CHUNKS, tok.bos_id)


@pytest.fixture(scope="module")
def demo_pwri(tmp_path_factory):
    """The demo model as a PWRI file with random predictors (about half the neurons predicted active:
    enough misses to move the perplexity, fast to build)."""
    cfg = json.loads((powerinfer.DEMO_MODEL / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    layers = [LayerPredictor(torch.randn(16, cfg["hidden_size"], generator=g),
                             torch.randn(cfg["intermediate_size"], 16, generator=g))
              for _ in range(cfg["num_hidden_layers"])]
    tmp = tmp_path_factory.mktemp("demo")
    pred = save_predictor_dir(tmp / "pred", layers, {"sparse_threshold": 0.0})
    return convert(powerinfer.DEMO_MODEL, tmp / "demo.powerinfer.gguf", pred, outtype="f32", progress=False)


def reference_ppl(logits_per_chunk: list[torch.Tensor], chunks: list[list[int]]) -> tuple[float, float]:
    """llama.cpp's estimate written out independently: score positions n/2 .. n-2 of each chunk."""
    nll = []
    for logits, ids in zip(logits_per_chunk, chunks):
        n = len(ids)
        lp = torch.log_softmax(logits.double(), dim=-1)
        nll += [-lp[p, ids[p + 1]].item() for p in range(n // 2, n - 1)]
    mean = sum(nll) / len(nll)
    var = sum(v * v for v in nll) / len(nll) - mean * mean
    return math.exp(mean), math.exp(mean) * math.sqrt(var / (len(nll) - 1))


def test_chunks_follow_llama_cpp(chunks, text, stories_gguf):
    ids = GGUFTokenizer(open_gguf(stories_gguf)).encode(text)
    assert len(chunks) == N_CHUNKS and all(len(c) == N_CTX for c in chunks)
    for k, c in enumerate(chunks):  # consecutive, non-overlapping, first token replaced by BOS
        assert c[0] == 1 and c[1:] == ids[k * N_CTX + 1:(k + 1) * N_CTX]
    assert len(chunk_tokens(ids, N_CTX)) == len(ids) // N_CTX  # default: every whole chunk


def test_stories260k_matches_transformers(stories_hf, stories_gguf, chunks):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(stories_hf), dtype=torch.float32)
    with torch.no_grad():
        ref_ppl, ref_err = reference_ppl([hf(torch.tensor([c])).logits[0] for c in chunks], chunks)
    res = perplexity(Transformer(open_gguf(stories_gguf), n_ctx=N_CTX), chunks)
    assert res.n_tokens_scored == N_CHUNKS * (N_CTX // 2 - 1)
    assert res.ppl == pytest.approx(ref_ppl, rel=1e-4)
    assert res.stderr == pytest.approx(ref_err, rel=1e-3)
    assert res.active_share is None  # dense file


def test_oracle_equals_dense_exactly_on_demo_model(demo_pwri, chunks):
    g = open_gguf(demo_pwri)
    dense = perplexity(Transformer(g, dense=True, n_ctx=N_CTX), chunks)
    model = Transformer(g, n_ctx=N_CTX)
    model.oracle_masks()
    oracle = perplexity(model, chunks)
    assert oracle.token_nll == dense.token_nll and oracle.ppl == dense.ppl
    assert oracle.active_share < 0.2  # the oracle skipped the ~86% inactive neurons


@pytest.mark.parametrize("dense", [False, True], ids=["predictor", "dense"])
def test_batched_equals_token_by_token(demo_pwri, chunks, dense):
    model = Transformer(open_gguf(demo_pwri), dense=dense, n_ctx=N_CTX)
    chunk = chunks[1:2]
    batched = perplexity(model, chunk)
    one = perplexity(model, chunk, n_batch=1)  # T = 1 calls: attend_one and the sparse row kernels
    odd = perplexity(model, chunk, n_batch=37)  # batches straddling the scored half
    assert one.ppl == pytest.approx(batched.ppl, rel=1e-6)
    assert max(abs(a - b) for a, b in zip(one.token_nll, batched.token_nll)) <= 1e-4
    assert odd.ppl == pytest.approx(batched.ppl, rel=1e-6)
    if not dense:
        assert 0.3 < one.active_share == batched.active_share < 0.7
        dense_ppl = perplexity(Transformer(open_gguf(demo_pwri), dense=True, n_ctx=N_CTX), chunk).ppl
        assert batched.ppl > 1.5 * dense_ppl  # random predictors do hurt: the sparse path is really taken


def test_stderr_formula_is_llama_cpps():
    v = [0.5, 1.5, 2.0, 1.0]
    ppl, err = ppl_and_stderr(sum(v), sum(x * x for x in v), len(v))
    mean = sum(v) / 4
    assert ppl == pytest.approx(math.exp(mean))
    assert err == pytest.approx(math.exp(mean) * math.sqrt((sum(x * x for x in v) / 4 - mean ** 2) / 3))
    assert math.isnan(ppl_and_stderr(2.0, 2.0, 2)[1])  # v = [1, 1]: zero variance: undefined, as llama.cpp says


def _run(*args):
    return CliRunner().invoke(ppl_main, [str(a) for a in args])


def test_cli_output_format(stories_gguf, text_file, chunks):
    r = _run("-m", stories_gguf, "-f", text_file, "-c", N_CTX, "--chunks", N_CHUNKS, "--dtype", "f32")
    assert r.exit_code == 0, r.output
    assert re.search(r"^\[1\]\d+\.\d{4},\[2\]\d+\.\d{4},\[3\]\d+\.\d{4},\[4\]\d+\.\d{4},$", r.stdout, re.M), r.stdout
    ppl, err = map(float, FINAL.search(r.stdout).groups())
    res = perplexity(Transformer(open_gguf(stories_gguf), n_ctx=N_CTX), chunks)
    assert (ppl, err) == (round(res.ppl, 4), round(res.stderr, 5))
    assert "chunk 4/4" in r.stderr  # one progress line per chunk when stderr is not a terminal


def test_cli_compare(demo_pwri, text_file):
    r = _run("-m", demo_pwri, "-f", text_file, "-c", N_CTX, "--chunks", 2, "--dtype", "f32", "--compare")
    assert r.exit_code == 0, r.output
    assert len(FINAL.findall(r.stdout)) == 3
    table = {line.split()[0]: line.split() for line in r.stdout.splitlines()[-3:]}
    assert table["dense"][3:] == ["-", "100.0%"]
    assert table["oracle"][1] == table["dense"][1] and table["oracle"][3] == "+0.000%"
    assert float(table["predictor"][3].rstrip("%")) > 50  # random predictors: a large, visible loss
    assert 30 < float(table["predictor"][4].rstrip("%")) < 70


@pytest.mark.parametrize("args, needle", [
    (["--chunks", 0], "--chunks 0"),
    (["-c", 2], "at least 4 tokens"),
    (["-b", 0], "-b 0"),
    (["--compare"], "no predictors"),
    (["--oracle"], "no predictors"),
    (["--ram-budget", 3], "--ram-budget needs a PowerInfer GGUF"),
    (["--dense", "--compare"], "exclude each other"),
])
def test_cli_bad_options(stories_gguf, text_file, args, needle):
    r = _run("-m", stories_gguf, "-f", text_file, *args)
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and needle in r.output, r.output


def test_cli_bad_files(stories_gguf, text_file, tmp_path):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("\n")
    short.write_text("Once upon a time there was a cat. " * 40)  # ~400 tokens < 2 x 256
    for model, text, needle in [(tmp_path / "none.gguf", text_file, "file not found"),
                                (stories_gguf, tmp_path / "none.txt", "none.txt: file not found"),
                                (stories_gguf, empty, "empty"),
                                (stories_gguf, short, "at least 512")]:
        r = _run("-m", model, "-f", text, "-c", N_CTX)
        assert r.exit_code == 1 and r.output.count("Error:") == 1 and needle in r.output, r.output


def test_agrees_with_llama_cpp(text):
    """llama.cpp (llama-cpp-python) on the same GGUF and the same token ids, scored the same way."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = need(STORIES / "stories260K.ggml-org.gguf")
    g = open_gguf(path)
    tok = GGUFTokenizer(g)
    chunks = chunk_tokens(tok.encode(text), N_CTX, N_CHUNKS, tok.bos_id)
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, n_threads=1, verbose=False)
    logits = []
    for ids in chunks:
        llm.reset()
        llm.eval(ids)
        logits.append(torch.tensor(llm.scores[:N_CTX]))
    ref_ppl, ref_err = reference_ppl(logits, chunks)
    res = perplexity(Transformer(g, n_ctx=N_CTX), chunks)
    assert res.ppl == pytest.approx(ref_ppl, rel=1e-3)
    assert res.stderr == pytest.approx(ref_err, rel=1e-2)


@pytest.mark.parametrize("family", ["prosparse", "bamboo", "falcon", "opt"])
def test_every_family_oracle_equals_dense(family, tmp_path, text):
    """Each family's small random model as a PWRI file (every neuron predicted active): the
    oracle computes a share of the neurons and still equals dense bit for bit."""
    from family_models import BUILDERS
    from helpers import all_active_predictors

    d = BUILDERS[family](tmp_path / family)
    cfg = json.loads((d / "config.json").read_text())
    n_embd = cfg.get("hidden_size") or cfg["d_model"]
    n_ff = cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * n_embd
    pred = all_active_predictors(tmp_path / "pred", n_embd, n_ff, cfg.get("num_hidden_layers") or cfg["n_layer"])
    g = open_gguf(convert(d, tmp_path / "m.powerinfer.gguf", pred, outtype="f32", progress=False))
    tok = GGUFTokenizer(g)
    chunks = chunk_tokens(tok.encode(text[:4000]), 32, 2, tok.bos_id if tok.add_bos else None)
    dense = perplexity(Transformer(g, dense=True, n_ctx=32), chunks)
    model = Transformer(g, n_ctx=32)
    model.oracle_masks()
    oracle = perplexity(model, chunks)
    assert oracle.token_nll == dense.token_nll and math.isfinite(dense.ppl)
    assert oracle.active_share < 0.8


def test_quantized_batched_equals_token_by_token(demo_pwri, chunks, tmp_path):
    from powerinfer.convert.quantize import quantize_file

    q = tmp_path / "q8_0.powerinfer.gguf"
    quantize_file(demo_pwri, q, "q8_0")
    model = Transformer(open_gguf(q), dense=True, n_ctx=N_CTX)
    # Every Q8_0 product rounds its activation to 8 bits, in prompts and in decoding alike
    # (kernels.q8_round_trip), so the two agree until an fp32 difference of ~1e-7 between
    # batched and one-query attention lands on a rounding boundary and flips one 8-bit
    # value; over a 256-token chunk a few do (measured 6.8e-4 relative on this chunk;
    # 3.8e-6 max logit difference over the first 100 tokens, before any flip).
    batched, one_by_one = perplexity(model, chunks[1:2]).ppl, perplexity(model, chunks[1:2], n_batch=1).ppl
    assert one_by_one == pytest.approx(batched, rel=2e-3)


def test_cli_text_file_must_be_a_bounded_regular_file(stories_gguf, tmp_path, monkeypatch):
    """/dev/zero never ends and a FIFO blocks until a writer comes: both refused before any read."""
    import os

    import powerinfer.eval.perplexity as ppl_mod

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in ("/dev/zero", fifo):
        r = _run("-m", stories_gguf, "-f", p)
        assert r.exit_code == 1 and f"{p}: not a regular file" in r.output, r.output
    big = tmp_path / "big.txt"
    big.write_text("Once upon a time. " * 100)
    monkeypatch.setattr(ppl_mod, "MAX_TEXT_BYTES", 1000)
    r = _run("-m", stories_gguf, "-f", big)
    assert r.exit_code == 1 and "more than the" in r.output and str(big) in r.output, r.output

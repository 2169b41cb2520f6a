"""pi-run behaves as a llama.cpp user expects: spacing of the first token, stopping at the end
of a story, notes when a limit applies, validated sampler flags, -n -1, -f, --version,
--repeat-penalty, and timings and byte counts that mean what they say."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import cli, kernels
from powerinfer.runtime.cli import main as run_main
from powerinfer.runtime.generate import SamplerSettings, apply_repeat_penalty, generate
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.tokenizer import GGUFTokenizer, TextStream



@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory, stories_hf):
    return convert(stories_hf, tmp_path_factory.mktemp("parity") / "s.gguf", outtype="f32", progress=False)


@pytest.fixture(scope="module")
def loaded(stories_gguf):
    g = open_gguf(stories_gguf)
    return Transformer(g, cache_type_k="f16", cache_type_v="f16"), GGUFTokenizer(g)  # as pi-run's -ctk/-ctv


@pytest.fixture(scope="module")
def story_end(loaded):
    """Tokens in the greedy story after "The little dog": the model's first BOS after its first
    token (a new story), found in a run that stops at nothing (217 on stories260K)."""
    model, tok = loaded
    st = generate(model, tok.encode("The little dog"), 300, SamplerSettings(temp=0.0))
    return st.token_ids.index(tok.bos_id, 1)


def _run(path, *args):
    r = CliRunner().invoke(run_main, ["-m", str(path), "-t", "1", "--dtype", "f32", *[str(a) for a in args]])
    assert r.exit_code == 0, r.output
    return r


def _fails(path, *args, needles=()):
    r = CliRunner().invoke(run_main, ["-m", str(path), *[str(a) for a in args]])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and r.output.count("Error:") == 1, r.output
    for n in needles:
        assert n in r.output, r.output
    return r.output


def _n_generated(r) -> int:
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("generation:"))
    return int(line.split()[1])


# ------------------------------------------------------------------ 1. first token's leading space
def test_streamed_text_keeps_the_first_tokens_leading_space(stories_gguf, loaded):
    model, tok = loaded
    ids = tok.encode("The little dog")
    st = generate(model, ids, 12, SamplerSettings(temp=0.0))
    want = tok.decode(ids + st.token_ids)[len(tok.decode(ids)):]
    assert want.startswith(" ")
    stream = TextStream(tok, ids)
    assert "".join(stream.push(t) for t in st.token_ids) == want
    r = _run(stories_gguf, "-p", "The little dog", "-n", 12, "--temp", 0)
    assert r.stdout == "The little dog" + want + "\n"


# ------------------------------------------------------------------ 2. end of text
def test_generation_stops_at_bos_after_the_first_token_and_ignore_eos_goes_on(stories_gguf, loaded, story_end):
    model, tok = loaded
    ids = tok.encode("The little dog")
    st = generate(model, ids, 300, SamplerSettings(temp=0.0), tok.eos_id, stop_after_first=[tok.bos_id])
    assert len(st.token_ids) == story_end and st.stop == "eos"
    assert tok.bos_id not in st.token_ids
    r = _run(stories_gguf, "-p", "The little dog", "-n", 300, "--temp", 0)
    assert _n_generated(r) == story_end and r.stdout.endswith(".\n")
    r = _run(stories_gguf, "-p", "The little dog", "-n", 300, "--temp", 0, "--ignore-eos")
    assert _n_generated(r) == 300


# ------------------------------------------------------------------ 3. limits said, not silent
def test_context_full_is_noted(stories_gguf):
    r = _run(stories_gguf, "-p", "The little dog", "-n", 100, "-c", 32, "--temp", 0)
    assert "context is full" in r.stderr and "-n 100" in r.stderr
    assert _n_generated(r) == 32 - 5 + 1  # BOS + 4 prompt tokens in the cache, the last sampled token not
    r = _run(stories_gguf, "-p", "The little dog", "-n", 4, "--temp", 0)
    assert "context is full" not in r.stderr


def test_ctx_size_past_the_model_is_noted(stories_gguf):
    r = _run(stories_gguf, "-n", 2, "--temp", 0, "-c", 100000)
    assert "-c 100000" in r.stderr and "512" in r.stderr


def test_prompt_too_long_suggests_c_only_when_it_helps(stories_gguf):
    long = "Once upon a time " * 200
    out = _fails(stories_gguf, "-p", long, "-c", 64, needles=["raise -c", "512"])
    out = _fails(stories_gguf, "-p", long, needles=["512"])
    assert "-c" not in out
    out = _fails(stories_gguf, "-p", long, "-c", 512)
    assert "-c" not in out


# ------------------------------------------------------------------ 4. sampler values validated
@pytest.mark.parametrize("args", [
    ["--temp", "-0.5"], ["--temp", "nan"], ["--temp", "inf"],
    ["--top-p", "0"], ["--top-p", "1.5"], ["--top-p", "nan"], ["--top-p", "-0.1"],
    ["--top-k", "-1"],
    ["--seed", str(2**63)], ["--seed", str(2**64 + 5)], ["--seed", "-2"],
    ["--repeat-penalty", "nan"], ["--repeat-penalty", "0"], ["--repeat-penalty", "-1"],
    ["--repeat-last-n", "-2"],
    ["-n", "-2"],
])
def test_bad_sampler_values_are_refused(stories_gguf, args):
    _fails(stories_gguf, *args, needles=[args[0]])


def test_largest_seed_and_greedy_temp_zero_are_fine(stories_gguf):
    _run(stories_gguf, "-n", 2, "--seed", 2**63 - 1)
    _run(stories_gguf, "-n", 2, "--temp", 0, "--top-p", 1)


# ------------------------------------------------------------------ 5. -n -1
def test_n_minus_one_runs_to_the_end_of_text_or_the_context(stories_gguf, story_end):
    r = _run(stories_gguf, "-p", "The little dog", "-n", -1, "--temp", 0)
    assert _n_generated(r) == story_end and "context is full" not in r.stderr
    r = _run(stories_gguf, "-p", "The little dog", "-n", -1, "-c", 40, "--temp", 0, "--ignore-eos")
    assert _n_generated(r) == 40 - 5 + 1 and "context is full" in r.stderr


# ------------------------------------------------------------------ 6. kernel build outside the prompt time
def test_kernel_build_is_not_prompt_time(loaded, monkeypatch):
    """A first compile that takes 100 s on generate's clock (a fake one: no sleep, no wall-clock
    limit) adds nothing to the prompt time."""
    import types

    import powerinfer.runtime.generate as generate_mod

    model, tok = loaded
    real = kernels.set_backend
    clock = {"now": 0.0, "builds": 0}

    def slow_set_backend(name="auto"):
        clock["now"] += 100.0  # a first compile
        clock["builds"] += 1
        return real("torch")

    fake_time = types.SimpleNamespace(perf_counter=lambda: clock["now"], thread_time=time.thread_time,
                                      time_ns=time.time_ns)
    monkeypatch.setattr(generate_mod, "time", fake_time)
    monkeypatch.setattr(kernels, "set_backend", slow_set_backend)
    monkeypatch.setitem(kernels._state, "backend", None)
    try:
        st = generate(model, tok.encode("The little dog"), 2, SamplerSettings(temp=0.0))
    finally:
        kernels._state["backend"] = None
    assert clock["builds"] == 1  # the build did happen during generate
    assert st.t_prompt == 0.0 and len(st.token_ids) == 2


# ------------------------------------------------------------------ 7. --bench bytes per token
def test_bench_bytes_per_token_keep_their_digits(stories_gguf):
    assert cli.format_bytes(3_456_789) == "3.46 MB"
    assert cli.format_bytes(250_000) == "0.25 MB"
    assert cli.format_bytes(5_120) == "5.1 KB"
    r = CliRunner().invoke(run_main, ["-m", str(stories_gguf), "--bench", "-n", 4, "--dtype", "f32"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if "weights read:" in ln)
    assert " 0 MB" not in line and "." in line.split("weights read:")[1].split()[0]


# ------------------------------------------------------------------ 8. -f, --version, --repeat-penalty
def test_prompt_from_file(stories_gguf, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("The little dog\n", encoding="utf-8")
    a = _run(stories_gguf, "-f", f, "-n", 6, "--temp", 0)
    b = _run(stories_gguf, "-p", "The little dog", "-n", 6, "--temp", 0)
    assert a.stdout == b.stdout


def test_prompt_file_errors(stories_gguf, tmp_path, monkeypatch):
    _fails(stories_gguf, "-f", tmp_path / "none.txt", needles=["none.txt", "not found"])
    _fails(stories_gguf, "-f", tmp_path, needles=["not a file"])
    (tmp_path / "bin").write_bytes(b"ELF\0\0\1\2")
    _fails(stories_gguf, "-f", tmp_path / "bin", needles=["binary"])
    (tmp_path / "latin1").write_bytes("caf\xe9".encode("latin-1"))
    _fails(stories_gguf, "-f", tmp_path / "latin1", needles=["UTF-8"])
    (tmp_path / "big").write_text("a" * 100)
    monkeypatch.setattr(cli, "MAX_PROMPT_FILE_BYTES", 50)
    _fails(stories_gguf, "-f", tmp_path / "big", needles=["big"])
    (tmp_path / "ok").write_text("hi")
    _fails(stories_gguf, "-f", tmp_path / "ok", "-p", "x", needles=["-f"])


def test_version():
    r = CliRunner().invoke(run_main, ["--version"])
    from powerinfer import __version__

    assert r.exit_code == 0 and __version__ in r.output


def test_repeat_penalty_matches_llama_cpp():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    got = apply_repeat_penalty(logits, [0, 1, 1, 4], 2.0)
    assert got.tolist() == [1.0, -4.0, 1.0, -1.0, 0.25]
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0, 0.5]  # not changed in place
    assert apply_repeat_penalty(logits, [0, 1], 1.0) is logits


def test_repeat_penalty_flag(stories_gguf, loaded):
    base = _run(stories_gguf, "-p", "The little dog", "-n", 40, "--temp", 0)
    same = _run(stories_gguf, "-p", "The little dog", "-n", 40, "--temp", 0, "--repeat-penalty", 1.0)
    assert base.stdout == same.stdout  # the default is off: output unchanged
    pen = _run(stories_gguf, "-p", "The little dog", "-n", 40, "--temp", 0, "--repeat-penalty", 1.5)
    assert pen.stdout != base.stdout
    off = _run(stories_gguf, "-p", "The little dog", "-n", 40, "--temp", 0, "--repeat-penalty", 1.5,
               "--repeat-last-n", 0)
    assert off.stdout == base.stdout
    # greedy with the penalty equals greedy over penalized logits of the last 64 tokens
    model, tok = loaded
    ids = tok.encode("The little dog")
    st = generate(model, ids, 40, SamplerSettings(temp=0.0, repeat_penalty=1.5, repeat_last_n=3))
    seq = list(ids)
    with torch.inference_mode():
        for t in st.token_ids:
            logits = model.forward(torch.tensor(seq), 0, all_logits=True)[-1]
            assert int(apply_repeat_penalty(logits, seq[-3:], 1.5).argmax()) == t
            seq.append(t)


# ------------------------------------------------------------------ 9. invalid UTF-8 in -p
def test_prompt_with_invalid_utf8_is_a_clean_error(stories_gguf):
    _fails(stories_gguf, "-p", "ab\udcff\udcfe", needles=["-p", "UTF-8"])
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(stories_gguf).encode(),
                        "-p", b"\xff\xfe", "-n", "2"], capture_output=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert b"Traceback" not in r.stderr and b"UTF-8" in r.stderr


# ------------------------------------------------------------------ 8. --help without loading torch
@pytest.mark.parametrize("module", ["powerinfer.runtime.cli", "powerinfer.server.cli"])
def test_cli_modules_do_not_import_torch_until_run(module):
    code = f"import sys, {module}; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_dtype_names_match_the_runtime():
    from powerinfer.runtime.weights import DTYPES

    assert set(cli.DTYPE_NAMES) == set(DTYPES)

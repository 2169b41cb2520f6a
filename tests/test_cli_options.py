"""Command-line rough edges of issue 19 (item 6) and the demo's speed stage (item 4).

Only data inside the repository (powerinfer/assets) or files generated in tmp_path is used.

* wrong option values and missing inputs are refused before torch/transformers are imported,
  with one message naming the option or file, exit code 1 and nothing written;
* no NaN figure (pi-run -n 0), counts in the singular where they are 1;
* pi-perplexity cuts -c to the model's context with a note, as pi-run does;
* pi-server names a bad model file before a busy port;
* --version on every command;
* a gpt2 vocabulary without merges is refused by name;
* python -m powerinfer: chunks of 64 as pi-convert/pi-run, and why a capacity placed nothing;
* pi-convert --for-pi-run, the demo's options (no warnings), the speed stage on a small shape.
"""
from __future__ import annotations

import inspect
import json
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import powerinfer
from powerinfer import DEMO_CALIBRATION, DEMO_MODEL

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"pi-run": "powerinfer.runtime.cli", "pi-perplexity": "powerinfer.eval.cli",
           "pi-convert": "powerinfer.convert.cli", "pi-quantize": "powerinfer.convert.quantize_cli",
           "pi-profile": "powerinfer.profile.cli", "pi-train-predictor": "powerinfer.train_predictor.cli",
           "pi-report": "powerinfer.report.cli", "pi-server": "powerinfer.server.cli",
           "pi-sparsify": "powerinfer.convert.teal_cli",
           "python -m powerinfer": "powerinfer.__main__"}


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory) -> Path:
    """The bundled demo model as a dense f32 GGUF (512-token context)."""
    from powerinfer.convert.writer import convert

    return convert(DEMO_MODEL, tmp_path_factory.mktemp("demo") / "demo.gguf", outtype="f32", progress=False,
                   upstream_warnings=False)


def run_cli(prog: str, args: list, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``prog args`` in a fresh interpreter; its stderr ends with ``HEAVY: <the heavy modules imported>``."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: sys.stderr.write('\\nHEAVY: ' + ' '.join("
            "m for m in ('torch', 'transformers') if m in sys.modules) + '\\n'))\n"
            f"sys.argv = [{prog!r}] + {[str(a) for a in args]!r}\n"
            f"from {MODULES[prog]} import main\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def _refused_early(r: subprocess.CompletedProcess, *needles: str) -> None:
    heavy = r.stderr.rsplit("HEAVY:", 1)[1].split()
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1, r.stderr
    assert len(errors) == 1 and all(n in errors[0] for n in needles), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert heavy == [], f"imported {heavy} before refusing: {errors}"


# ------------------------------------------------------------------ values checked before heavy imports
@pytest.mark.parametrize("args, needles", [
    (["-c", "-5"], ["-c -5", "must be >= 0"]),
    (["-n", "-5"], ["-n -5", "must be >= 0"]),
    (["-t", "1000"], ["-t 1000", "must be between 0"]),
    (["--top-p", "2"], ["--top-p 2.0", "(0, 1]"]),
    (["--min-p", "1.5"], ["--min-p 1.5"]),
    (["--seed", "-2"], ["--seed -2"]),
])
def test_pi_run_refuses_option_values_before_importing_torch(demo_gguf, args, needles):
    _refused_early(run_cli("pi-run", ["-m", demo_gguf, "-n", "4", *args]), *needles)


def test_pi_run_refuses_missing_files_before_importing_torch(tmp_path, demo_gguf):
    _refused_early(run_cli("pi-run", ["-m", tmp_path / "none.gguf"]), f"{tmp_path / 'none.gguf'}: file not found")
    _refused_early(run_cli("pi-run", ["-m", demo_gguf, "-f", tmp_path / "none.txt"]),
                   f"-f {tmp_path / 'none.txt'}: file not found")


@pytest.mark.parametrize("args, needles", [
    (["-c", "-5"], ["-c -5", "must be >= 0"]),
    (["-t", "1000"], ["-t 1000"]),
    (["--chunks", "0"], ["--chunks 0"]),
])
def test_pi_perplexity_refuses_option_values_before_importing_torch(demo_gguf, args, needles):
    _refused_early(run_cli("pi-perplexity", ["-m", demo_gguf, "-f", DEMO_CALIBRATION, *args]), *needles)


def test_pi_perplexity_refuses_missing_files_before_importing_torch(tmp_path, demo_gguf):
    """One wording for a missing file in every command: 'PATH: file not found'."""
    _refused_early(run_cli("pi-perplexity", ["-m", tmp_path / "none.gguf", "-f", DEMO_CALIBRATION]),
                   f"{tmp_path / 'none.gguf'}: file not found")
    _refused_early(run_cli("pi-perplexity", ["-m", demo_gguf, "-f", tmp_path / "none.txt"]),
                   f"{tmp_path / 'none.txt'}: file not found")


def test_offline_stages_refuse_missing_inputs_before_importing_torch(tmp_path):
    out = tmp_path / "out"
    _refused_early(run_cli("pi-convert", [DEMO_MODEL, tmp_path / "nopred", "--outfile", out / "m.gguf"]),
                   f"{tmp_path / 'nopred'}: predictor folder not found")
    _refused_early(run_cli("pi-convert", [tmp_path / "nomodel", "--outfile", out / "m.gguf"]),
                   f"{tmp_path / 'nomodel'}: model folder not found")
    _refused_early(run_cli("pi-profile", [DEMO_MODEL, "--data", tmp_path / "nope.txt", "--out", out]),
                   f"{tmp_path / 'nope.txt'}: data file not found")
    _refused_early(run_cli("pi-profile", [tmp_path / "nomodel", "--data", DEMO_CALIBRATION, "--out", out]),
                   f"{tmp_path / 'nomodel'}: model folder not found")
    _refused_early(run_cli("pi-train-predictor", [DEMO_MODEL, "--data", tmp_path / "nope.txt", "--out", out]),
                   f"{tmp_path / 'nope.txt'}: data file not found")
    _refused_early(run_cli("pi-quantize", [tmp_path / "none.gguf", out / "q.gguf", "q4_0"]),
                   f"{tmp_path / 'none.gguf'}: file not found")
    _refused_early(run_cli("python -m powerinfer", ["--activation", tmp_path / "noact", "--capacity", "8",
                                                    "--vram-capacity", "100", "--output", out / "x.gpuidx"]),
                   f"{tmp_path / 'noact'}: activation folder not found")
    assert not out.exists()


# ------------------------------------------------------------------ one style for every bad value (issue 29)
def _one_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Refused before torch/transformers: exit 1, and stderr is exactly one ``Error: ...`` line (no
    click usage block, no 'Try ... for help')."""
    _refused_early(r, *needles)
    lines = [line for line in r.stderr.rsplit("HEAVY:", 1)[0].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr


@pytest.mark.parametrize("prog, args, line", [
    ("pi-server", ["--vram-budget", "-3"], "--vram-budget -3: must be in [0, "),
    ("pi-server", ["--ram-budget", "-1"], "--ram-budget -1: must be in [0, "),
    ("pi-server", ["--port", "70000"], "--port 70000: must be in [0, 65535]"),
    ("pi-server", ["-np", "0"], "-np 0: must be in [1, 256]"),
    ("pi-server", ["--parallel=0"], "--parallel 0: must be in [1, 256]"),
    ("pi-server", ["-sps", "1.5"], "-sps 1.5: must be in [0, 1]"),
    ("pi-server", ["-c", "-3"], "-c -3: must be >= 0"),
    ("pi-server", ["--dtype", "f8"], "--dtype f8: not one of 'auto', 'bf16', 'f32'"),
    ("pi-run", ["-n", "-5"], "-n -5: must be >= 0"),
    ("pi-run", ["-c", "-3"], "-c -3: must be >= 0"),
    ("pi-run", ["-t", "-2"], "-t -2: must be between 0"),
    ("pi-run", ["-t", "two"], "-t two: not a valid integer"),
    ("pi-run", ["--ram-budget", "-1"], "--ram-budget -1: must be in [0, "),
    ("pi-run", ["--vram-budget", "nan"], "--vram-budget nan: not a finite number"),
    ("pi-run", ["--no-such-flag"], "No such option '--no-such-flag'"),
    ("pi-perplexity", ["--ram-budget", "-1"], "--ram-budget -1: must be in [0, "),
    ("pi-perplexity", ["-c", "-3"], "-c -3: must be >= 0"),
])
def test_bad_values_get_one_line_and_exit_1(demo_gguf, prog, args, line):
    """Click's refusals (a range, a choice, a number) and the commands' own checks read alike:
    ``Error: OPTION VALUE: what is wrong``, exit 1; click's 4-line usage block with exit 2 before."""
    extra = ["-f", DEMO_CALIBRATION] if prog == "pi-perplexity" else []
    _one_line(run_cli(prog, ["-m", demo_gguf, *extra, *args]), line)


@pytest.mark.parametrize("prog, args, line", [
    ("pi-convert", ["--sparse-threshold", "nan"], "--sparse-threshold nan: not a finite number"),
    ("pi-convert", ["--vram-budget=-3"], "--vram-budget -3: must be in [0, "),
    ("pi-convert", ["--outtype", "q3_k"], "--outtype q3_k: not one of 'f16', 'bf16', 'f32', 'q4_0', 'q8_0'"),
    ("pi-train-predictor", ["--lr", "inf"], "--lr inf: not a finite number"),
    ("pi-profile", ["--max-tokens", "x"], "--max-tokens x: not a valid integer"),
    ("pi-sparsify", ["--sparsity", "x"], "--sparsity x: not a valid float"),
    ("pi-sparsify", ["--method", "cats"], "--method cats: not one of 'uniform', 'greedy', 'wina'"),
])
def test_offline_stages_bad_values_get_one_line_and_exit_1(tmp_path, prog, args, line):
    base = {"pi-convert": [DEMO_MODEL, "--outfile", tmp_path / "o.gguf"],
            "pi-train-predictor": [DEMO_MODEL, "--data", DEMO_CALIBRATION, "--out", tmp_path / "p"],
            "pi-profile": [DEMO_MODEL, "--data", DEMO_CALIBRATION, "--out", tmp_path / "a"],
            "pi-sparsify": [tmp_path / "in.gguf", tmp_path / "s.gguf", "--data", DEMO_CALIBRATION]}[prog]
    _one_line(run_cli(prog, [*base, *args]), line)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_config_json_is_refused_before_importing_torch(tmp_path):
    """An empty folder as the model: every stage that reads a Hugging Face folder names the missing
    config.json without importing torch or transformers (pi-convert took 9-10 s of imports first)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    want = f"{empty}: no config.json, so this is not a Hugging Face model folder"
    _one_line(run_cli("pi-convert", [empty, "--outfile", tmp_path / "o.gguf"]), want)
    _one_line(run_cli("pi-profile", [empty, "--data", DEMO_CALIBRATION, "--out", tmp_path / "a"]), want)
    _one_line(run_cli("pi-train-predictor", [empty, "--data", DEMO_CALIBRATION, "--out", tmp_path / "p"]), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_text_file_named_gguf_is_refused_before_importing_torch(tmp_path):
    """A text file named .gguf: pi-run, pi-perplexity, pi-server and pi-quantize name its magic
    without importing torch (pi-run and pi-perplexity imported it first, 2.5-4 s)."""
    fake = tmp_path / "notes.gguf"
    fake.write_text("hello, this is text\n")
    want = f"{fake}: wrong magic b'hell' (expected b'GGUF' or b'PWRI'); not a GGUF file"
    _one_line(run_cli("pi-run", ["-m", fake, "-p", "hi"]), want)
    _one_line(run_cli("pi-perplexity", ["-m", fake, "-f", DEMO_CALIBRATION]), want)
    _one_line(run_cli("pi-server", ["-m", fake]), want)
    _one_line(run_cli("pi-quantize", [fake, tmp_path / "q.gguf", "q4_0"]), want)
    _one_line(run_cli("pi-report", [fake]), f"{fake}: not a folder")


def test_a_file_given_as_model_folder_is_named(tmp_path):
    _refused_early(run_cli("pi-profile", [DEMO_CALIBRATION, "--data", DEMO_CALIBRATION, "--out", tmp_path / "a"]),
                   f"{DEMO_CALIBRATION}: not a folder")


# ------------------------------------------------------------------ Ctrl-C in pi-run
def test_ctrl_c_in_pi_run_prints_the_timings_so_far_and_exits_130(demo_gguf):
    """SIGINT after the first tokens (the process sends it to itself from the sampler once 5 tokens are
    out, so the moment is exact, not raced): generation stops at the next token, the text so far and
    the summary (prompt eval, generation with the token count) are printed, exit code 130 as
    llama.cpp's tools; before, click printed only 'Aborted!' and exited 1."""
    code = ("import os, signal, sys\n"
            "import powerinfer.runtime.generate as g\n"
            "real, n = g.sample, [0]\n"
            "def sample(*a, **k):\n"
            "    n[0] += 1\n"
            "    if n[0] == 5:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(*a, **k)\n"
            "g.sample = sample\n"
            f"sys.argv = ['pi-run', '-m', {str(demo_gguf)!r}, '-p', 'Once upon a time', '-n', '400', '--ignore-eos',"
            " '-t', '1']\n"
            "from powerinfer.runtime.cli import main\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 130, r.stderr
    assert "Aborted!" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    n = int(re.search(r"interrupted \(Ctrl-C\) after (\d+) tokens", r.stderr)[1])
    assert 5 <= n <= 6, r.stderr  # the token sampled when the signal came, perhaps the next
    assert re.search(rf"^generation:  {n} tokens, \d+ evals in [0-9.]+ ms", r.stderr, re.M), r.stderr
    assert re.search(r"^prompt eval: \d+ tokens in [0-9.]+ ms", r.stderr, re.M), r.stderr
    assert r.stdout.startswith("Once upon a time") and len(r.stdout) > len("Once upon a time\n")


# ------------------------------------------------------------------ pi-server: the model before the port
def test_pi_server_names_a_bad_model_before_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("pi-server", ["-m", "README.md", "--port", port])
        _refused_early(r, "README.md", "not a GGUF file")
        assert str(port) not in r.stderr.split("HEAVY:")[0]


def test_pi_server_with_a_good_model_reports_the_busy_port_without_loading_it(demo_gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _refused_early(run_cli("pi-server", ["-m", demo_gguf, "--port", port]), f"127.0.0.1:{port}", "--port")


# ------------------------------------------------------------------ --version
@pytest.mark.parametrize("prog", sorted(MODULES))
def test_every_command_has_version(prog):
    import importlib

    main = importlib.import_module(MODULES[prog]).main
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output == f"{prog} (powerinfer) {powerinfer.__version__}\n", r.output


# ------------------------------------------------------------------ no NaN, counts in the singular
def test_pi_run_n_0_prints_no_nan_and_singular_counts(demo_gguf):
    from powerinfer.runtime.cli import main

    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-p", "", "-n", "0", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "nan" not in r.output.lower() and "inf " not in r.output
    assert "prompt eval: 1 token in" in r.output  # the BOS alone
    assert "generation:  0 tokens, 0 evals in" in r.output
    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-p", "", "-n", "1", "--temp", "0"])
    assert r.exit_code == 0 and "generation:  1 token, 0 evals in" in r.output, r.output
    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-n", "0", "--bench"])
    assert r.exit_code == 0 and "nan" not in r.output.lower(), r.output


def test_rates_are_never_nan():
    from powerinfer.cli_params import plural, rate
    from powerinfer.runtime.generate import GenStats

    st = GenStats()
    assert st.prompt_tps is None and st.gen_tps is None
    assert GenStats(n_prompt=4, t_prompt=0.5).prompt_tps == 8.0
    assert rate(0, 0.0) == rate(3, 0.0) == rate(0, 1.0) == "" and rate(3, 1.5) == " (2.0 tokens/s)"
    assert (plural(1, "turn"), plural(2, "turn"), plural(0, "token")) == ("1 turn", "2 turns", "0 tokens")


def test_server_timings_are_valid_json_without_prompt_tokens():
    from powerinfer.runtime.generate import GenStats
    from powerinfer.server.app import _timings
    from powerinfer.server.engine import Result

    t = _timings(Result("stop", "eos", "", GenStats(n_reused=5)))
    json.dumps(t, allow_nan=False)  # raises on NaN
    assert t["prompt_per_second"] is None


def test_chat_summary_counts_one_turn_in_the_singular(capsys):
    from powerinfer.runtime.cli import _summary
    from powerinfer.runtime.generate import GenStats
    from powerinfer.runtime.interactive import TurnLog

    _summary(TurnLog([GenStats(n_prompt=1, n_gen=1)]), SimpleNamespace(dense=False))
    err = capsys.readouterr().err
    assert "1 turn: 1 prompt token evaluated" in err and "turns" not in err


def test_shortfall_notes_name_the_split_and_its_option():
    from powerinfer.calibrate.plan import shortfall_notes

    plan = SimpleNamespace(n_tokens={"all": 100, "train": 100, "heldout": 10})
    notes = shortfall_notes(plan, {"all": 1000}, "t.txt")
    assert notes == ["t.txt: the calibration text gave only 100 tokens of the 1000 asked for "
                     "(the text ran out; more text gives better statistics)"]
    notes = shortfall_notes(plan, {"train": 150, "heldout": 100}, "t.txt")
    assert len(notes) == 1 and "the held-out split (--heldout-tokens) gave only 10 tokens of the 100" in notes[0]
    assert not any("the all split" in n or "the heldout split" in n for n in notes)


# ------------------------------------------------------------------ pi-perplexity caps -c as pi-run does
def test_pi_perplexity_cuts_ctx_to_the_model_with_a_note(demo_gguf):
    from powerinfer.eval.cli import main

    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-f", str(DEMO_CALIBRATION), "-c", "4096", "--chunks", "1"])
    assert r.exit_code == 0, r.output
    assert r.output.count("note: -c 4096 is more than the model's context length; using 512") == 1
    assert re.search(r"Final estimate: PPL = \d+\.\d{4}", r.output)
    assert "1 chunk of 512" in r.output


def test_pi_perplexity_help_says_what_it_does_with_a_large_ctx():
    from powerinfer.eval.cli import main

    r = CliRunner().invoke(main, ["--help"])
    assert "cut to the model's context length, with a note" in " ".join(r.output.split())


# ------------------------------------------------------------------ gpt2 vocabulary without merges
def test_gpt2_vocabulary_without_merges_is_refused_by_name(tmp_path, demo_gguf):
    sys.path.insert(0, str(Path(__file__).parent))
    import gguf_edit

    from powerinfer.errors import PowerInferError
    from powerinfer.formats.gguf_file import open_gguf

    g = gguf_edit.parse(demo_gguf.read_bytes())
    assert not any(k.key == "tokenizer.ggml.merges" for k in g.kvs)
    g.kv("tokenizer.ggml.model").value = "gpt2"
    bad = tmp_path / "gpt2-no-merges.gguf"
    bad.write_bytes(gguf_edit.serialize(g))
    with pytest.raises(PowerInferError, match=re.escape(f"{bad}: metadata tokenizer.ggml.merges is missing")):
        open_gguf(bad)
    from powerinfer.runtime.cli import main

    r = CliRunner().invoke(main, ["-m", str(bad), "-n", "1"])
    assert r.exit_code == 1 and "tokenizer.ggml.merges is missing" in r.output and str(bad) in r.output
    assert "Once upon" not in r.output  # no partial output


# ------------------------------------------------------------------ python -m powerinfer
def test_solver_default_chunk_is_the_one_pi_convert_uses():
    from powerinfer.__main__ import DEFAULT_CHUNK, main
    from powerinfer.convert.gpu_index import ensure_gpu_index

    assert DEFAULT_CHUNK == 64 == inspect.signature(ensure_gpu_index).parameters["chunk"].default
    assert {p.name: p.default for p in main.params}["batch"] == DEFAULT_CHUNK


def _demo_shaped_activation(folder: Path) -> Path:
    import torch

    from powerinfer.formats.activation import save_activation_dir

    gen = torch.Generator().manual_seed(0)
    return save_activation_dir(folder, [torch.randint(0, 1000, (172,), generator=gen) for _ in range(5)],
                               {"n_tokens": 1000})


def test_solver_says_why_a_capacity_placed_nothing(tmp_path):
    from powerinfer.__main__ import main

    act = _demo_shaped_activation(tmp_path / "act")
    args = ["--activation", str(act), "--capacity", "100", "--vram-capacity", "1000", "--output"]
    r = CliRunner().invoke(main, [*args, str(tmp_path / "a.gpuidx"), "--batch", "256"])
    assert r.exit_code == 0, r.output
    assert "0 of 860 neurons" in r.output
    assert "no neuron placed: --capacity 100 is less than the smallest first chunk of a layer (172 neurons " \
           "with --batch 256)" in r.output
    r = CliRunner().invoke(main, [*args, str(tmp_path / "b.gpuidx")])  # default chunks of 64: one fits
    assert r.exit_code == 0, r.output
    assert "64 of 860 neurons" in r.output and "36 of the --capacity 100 neurons left unused" in r.output
    r = CliRunner().invoke(main, [*args[:3], "1000", *args[4:], str(tmp_path / "c.gpuidx")])  # all fit
    assert r.exit_code == 0 and "860 of 860" in r.output and "note:" not in r.output, r.output


# ------------------------------------------------------------------ the demo's own inputs warn about nothing
def test_convert_for_pi_run_leaves_out_the_upstream_warnings(tmp_path, caplog):
    from powerinfer.convert.cli import main

    with caplog.at_level(logging.WARNING):
        r = CliRunner().invoke(main, [str(DEMO_MODEL), "--outfile", str(tmp_path / "a.gguf")])
    assert r.exit_code == 0, r.output
    assert any("dense relu GGUF" in m for m in caplog.messages)  # real users keep the warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r = CliRunner().invoke(main, [str(DEMO_MODEL), "--outfile", str(tmp_path / "b.gguf"), "--for-pi-run"])
    assert r.exit_code == 0, r.output
    assert caplog.messages == []


def test_demo_script_asks_for_the_tokens_its_text_holds():
    """recipes/demo.sh's --max-tokens/--heldout-tokens on the bundled text: no shortfall note, and
    every token of each split used (the figures the README gives are those of the whole text)."""
    from powerinfer.calibrate.plan import build_plan, shortfall_notes
    from powerinfer.hf import load_hf_tokenizer

    script = (ROOT / "recipes" / "demo.sh").read_text()
    caps = {"train": int(re.search(r"--max-tokens (\d+)", script)[1]),
            "heldout": int(re.search(r"--heldout-tokens (\d+)", script)[1])}
    assert len(re.findall(r"^pi-convert .*--for-pi-run$", script, re.M)) == 2
    tok = load_hf_tokenizer(DEMO_MODEL)
    plan = build_plan(str(DEMO_CALIBRATION), tok, caps, 256, 16)
    assert shortfall_notes(plan, caps, "demo") == []
    whole = build_plan(str(DEMO_CALIBRATION), tok, {"train": None, "heldout": None}, 256, 16)
    assert plan.n_tokens == whole.n_tokens


# ------------------------------------------------------------------ the speed stage, on a small shape
def test_speed_demo_builds_measures_and_reuses(tmp_path, monkeypatch, caplog):
    from powerinfer import speed_demo
    from powerinfer.synthetic import Shape

    monkeypatch.setattr(speed_demo, "demo_shape", lambda: Shape(n_layer=1, n_embd=64, n_ff=256, n_head=4,
                                                                n_vocab=512, n_ctx=512, hidden=32,
                                                                calib_tokens=128))
    out = tmp_path / "speed"
    with caplog.at_level(logging.WARNING):
        r = CliRunner().invoke(speed_demo.main, [str(out), "-n", "8", "--rounds", "2"])
    assert r.exit_code == 0, r.output
    assert caplog.messages == []
    m = re.search(r"sparse: ([\d.]+) tok/s, computing ([\d.]+)% of the FFN neurons", r.output)
    assert m and float(m[1]) > 0 and 0 < float(m[2]) < 100
    assert re.search(r"dense: +[\d.]+ tok/s, computing 100%", r.output)
    assert re.search(r"sparse is \d+\.\dx dense", r.output)
    assert "Why the stories model above gains little" in r.output
    assert (out / "speed.powerinfer.gguf").is_file() and (out / "speed.gguf").is_file()
    assert not (out / "hf").exists() and not (out / "predictor").exists()  # the large intermediates go
    res = json.loads((out / "speed_result.json").read_text())
    assert res["rounds"] == 2 and res["ratio"] == pytest.approx(res["sparse_tps"] / res["dense_tps"])
    r = CliRunner().invoke(speed_demo.main, [str(out), "-n", "8", "--rounds", "1"])
    assert r.exit_code == 0 and "reused" in r.output, r.output


def test_speed_demo_refuses_bad_values_at_once(tmp_path):
    from powerinfer import speed_demo

    r = CliRunner().invoke(speed_demo.main, [str(tmp_path / "s"), "-t", "1000"])
    assert r.exit_code == 1 and "-t 1000" in r.output and not (tmp_path / "s").exists()


def test_pi_perplexity_prints_no_nan_uncertainty_for_one_scored_token(demo_gguf):
    """-c 4 scores one token per chunk: no spread to estimate, so the PPL alone (never '+/- nan')."""
    from powerinfer.eval.cli import main

    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-f", str(DEMO_CALIBRATION), "-c", "4", "--chunks", "1"])
    assert r.exit_code == 0, r.output
    assert re.search(r"^Final estimate: PPL = \d+\.\d{4}$", r.output, re.M) and "nan" not in r.output.lower()
    r = CliRunner().invoke(main, ["-m", str(demo_gguf), "-f", str(DEMO_CALIBRATION), "-c", "4", "--chunks", "1",
                                  "--compare"])
    assert r.exit_code == 1 and "no predictors" in r.output  # a dense file: --compare refused as before

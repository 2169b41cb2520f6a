"""Bad input to pi-convert and pi-run: one clear message naming the path, exit 1, no partial output."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from powerinfer.convert.cli import main as convert_main
from powerinfer.runtime.cli import main as run_main


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory, relu_hf):
    out = tmp_path_factory.mktemp("g") / "m.gguf"
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(out), "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    return out


def _fails(cmd, args, *needles):
    r = CliRunner().invoke(cmd, [str(a) for a in args])
    assert r.exit_code == 1, r.output
    assert r.output.count("Error:") == 1
    for n in needles:
        assert str(n) in r.output, r.output
    return r.output


def test_convert_non_model_directory(tmp_path):
    (tmp_path / "notes").mkdir()
    _fails(convert_main, [tmp_path / "notes", "--outfile", tmp_path / "o.gguf"], tmp_path / "notes", "config.json")
    assert list(tmp_path.iterdir()) == [tmp_path / "notes"]


def test_convert_unsupported_activation_is_named(tmp_path, relu_hf):
    d = tmp_path / "m"
    shutil.copytree(relu_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "swish_glu_9000"
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], "swish_glu_9000", d / "config.json")
    assert not any(p.name.startswith(("o.gguf", ".o.gguf")) for p in tmp_path.iterdir())


def test_run_wrong_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(100))
    _fails(run_main, ["-m", p], p, "magic")


def test_run_truncated_file(tmp_path, dense_gguf):
    p = tmp_path / "cut.gguf"
    data = dense_gguf.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    _fails(run_main, ["-m", p, "-n", "4"], p, "truncated")


def test_run_truncated_header(tmp_path, dense_gguf):
    p = tmp_path / "cut.gguf"
    p.write_bytes(dense_gguf.read_bytes()[:4000])
    _fails(run_main, ["-m", p, "-n", "4"], p)


def test_run_missing_file(tmp_path):
    _fails(run_main, ["-m", tmp_path / "none.gguf"], tmp_path / "none.gguf", "not found")


def test_run_prompt_longer_than_context(dense_gguf):
    out = _fails(run_main, ["-m", dense_gguf, "-p", "Once upon a time " * 60, "-c", "64"], "context")
    assert "64" in out


def test_run_greedy_cli_prints_text_and_speed(dense_gguf):
    r = CliRunner().invoke(run_main, ["-m", str(dense_gguf), "-n", "8", "--temp", "0", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Once upon a time")
    assert "tokens/s" in r.output

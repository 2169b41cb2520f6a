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


def test_convert_refuses_to_overwrite_an_input_file(tmp_path, relu_hf):
    d = tmp_path / "m"
    shutil.copytree(relu_hf, d)
    before = (d / "config.json").read_bytes()
    _fails(convert_main, [d, "--outfile", d / "config.json", "--outtype", "q4_0"], d / "config.json", "input file")
    assert (d / "config.json").read_bytes() == before


def test_run_threads_bounded(dense_gguf):
    import os

    _fails(run_main, ["-m", dense_gguf, "-t", 100000, "-n", 1], "-t 100000", str(4 * (os.cpu_count() or 1)))


def test_run_special_token_id_outside_the_vocabulary(tmp_path, dense_gguf):
    """bos_token_id 4000000000 (a fuzzed header) would index past the embedding table."""
    import struct

    raw = bytearray(dense_gguf.read_bytes())
    key = b"tokenizer.ggml.bos_token_id"
    at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", raw, at)[0] == 4  # GGUF value type uint32
    struct.pack_into("<I", raw, at + 4, 4_000_000_000)
    bad = tmp_path / "bos.gguf"
    bad.write_bytes(bytes(raw))
    _fails(run_main, ["-m", bad, "-n", 1], bad, "bos_token_id 4000000000 is out of range")


def test_quantize_never_replaces_a_file_that_is_not_a_gguf(tmp_path, dense_gguf):
    from powerinfer.convert.quantize_cli import main as quantize_main

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    _fails(quantize_main, [dense_gguf, notes, "q8_0"], notes, "not a GGUF file", "refusing to replace it")
    assert notes.read_text() == "mine"
    _fails(quantize_main, [dense_gguf, dense_gguf, "q8_0"], dense_gguf, "input file")


def test_convert_progress_in_a_log_is_lines_not_tqdm_frames(tmp_path, relu_hf):
    """stderr is not a terminal here: one line per tenth of the tensors, no carriage returns."""
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if l.startswith("writing o.gguf: ")]
    assert "\r" not in r.output and 5 <= len(lines) <= 11 and lines[-1].endswith("(100%)"), r.output

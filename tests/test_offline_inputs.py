"""Hostile and careless input to the offline stages (issue 12): pi-convert, pi-profile, pi-train-predictor.

Each case is one clear error naming the file or option (exit 1, or click's exit 2 for an option
value), nothing written or replaced, or -- for damaged resume data -- the damaged layer redone.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from helpers import ROOT, TEXT, make_tiny_llama, need, random_predictors
from powerinfer.convert.cli import main as convert_main
from powerinfer.convert.vocab import MAX_CHAT_TEMPLATE
from powerinfer.errors import PowerInferError
from powerinfer.formats import _atomic
from powerinfer.formats.activation import load_activation_dir, save_activation_dir
from powerinfer.formats.predictor import LayerPredictor, load_predictor_dir, save_predictor_dir
from powerinfer.profile.cli import main as profile_main
from powerinfer.train_predictor.cli import main as train_main

N_LAYER, N_EMBD, N_FF = 5, 64, 172  # the demo model (stories260K with a ReLU FFN)


def _fails(cmd, args, *needles, code=1):
    r = CliRunner().invoke(cmd, [str(a) for a in args])
    assert r.exit_code == code, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)  # a clean exit, not an uncaught exception
    for n in needles:
        assert str(n) in r.output, r.output
    return r.output


@pytest.fixture(scope="module")
def text():
    return need(TEXT / "tinystories_sample.txt")


@pytest.fixture(scope="module")
def pred(tmp_path_factory):
    d = tmp_path_factory.mktemp("pred") / "pred"
    random_predictors(d, N_LAYER, N_EMBD, N_FF)
    return d


def _copy(src, dst, **config):
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _edit_weights(d, fn):
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------- option values
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "-1", "x"])
def test_convert_vram_budget_must_be_a_finite_size(tmp_path, relu_hf, pred, value):
    out = _fails(convert_main, [relu_hf, pred, "--outfile", tmp_path / "o.gguf", f"--vram-budget={value}"],
                 f"--vram-budget {value}: ", code=1)
    assert "Usage:" not in out and len(out.strip().splitlines()) == 1, out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["nan", "inf", "1e300"])
def test_convert_sparse_threshold_flag_must_be_finite_and_bounded(tmp_path, relu_hf, pred, value):
    _fails(convert_main, [relu_hf, pred, "--outfile", tmp_path / "o.gguf", f"--sparse-threshold={value}"],
           f"--sparse-threshold {value}: ", code=1)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option,value", [("--target-recall", "nan"), ("--budget", "nan"), ("--budget", "inf"),
                                          ("--lr", "nan"), ("--lr", "inf"), ("--heldout-frac", "nan"),
                                          ("--threshold", "nan"), ("--threshold", "1e300")])
def test_train_predictor_float_options_refuse_nan_inf_huge(tmp_path, relu_hf, option, value):
    """Refused while the command line is parsed (one line, exit 1), before the model is opened."""
    _fails(train_main, [relu_hf, "--data", tmp_path / "none.txt", "--out", tmp_path / "p", f"{option}={value}"],
           f"Error: {option} {value}: ", code=1)


def test_vram_budget_error_comes_before_the_gguf_is_replaced(tmp_path, relu_hf, pred):
    """-0.0 GiB is 0 GiB, too small for the dense tensors: the earlier GGUF must survive."""
    out = tmp_path / "m.powerinfer.gguf"
    r = CliRunner().invoke(convert_main, [str(relu_hf), str(pred), "--outfile", str(out), "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    before = out.read_bytes()
    _fails(convert_main, [relu_hf, pred, "--outfile", out, "--vram-budget=-0.0"], "--vram-budget 0.0 GiB",
           "cannot be met", "dense tensors")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


# --------------------------------------------------------------------------- config vs checkpoint
CONFIG_CASES = {  # config.json edit -> what the message must name
    "eps_string": (dict(rms_norm_eps="x"), ["config.json", "rms_norm_eps", "'x'"]),
    "eps_nan": (dict(rms_norm_eps=float("nan")), ["config.json", "rms_norm_eps"]),
    "n_ff_171": (dict(intermediate_size=171), ["gate_proj", "[172, 64]", "[171, 64]"]),
    "six_layers": (dict(num_hidden_layers=6), ["config.json", "num_hidden_layers is 6", "holds 5"]),
    "million_layers": (dict(num_hidden_layers=1_000_000), ["config.json", "num_hidden_layers", "1000000"]),
    "vocab_million": (dict(vocab_size=1_000_000), ["embed_tokens", "[512, 64]", "[1000000, 64]"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_convert_and_profile_refuse_a_config_that_disagrees_with_the_weights(tmp_path, relu_hf, text, case):
    edit, needles = CONFIG_CASES[case]
    d = _copy(relu_hf, tmp_path / "m", **edit)
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], *needles)
    _fails(profile_main, [d, "--data", text, "--out", tmp_path / "act", "--max-tokens", 64], *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_train_predictor_refuses_a_bad_config_value(tmp_path, relu_hf, text):
    d = _copy(relu_hf, tmp_path / "m", rms_norm_eps="x")
    _fails(train_main, [d, "--data", text, "--out", tmp_path / "p", "--max-tokens", 64], "rms_norm_eps", "'x'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_transposed_and_int8_weights_are_refused(tmp_path, relu_hf, text):
    key = "model.layers.2.mlp.up_proj.weight"
    d = _copy(relu_hf, tmp_path / "t")
    _edit_weights(d, lambda sd: sd.__setitem__(key, sd[key].T.contiguous()))
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], key, "[64, 172]", "[172, 64]", "transposed")
    _fails(profile_main, [d, "--data", text, "--out", tmp_path / "act", "--max-tokens", 64], key, "transposed")
    d = _copy(relu_hf, tmp_path / "q")
    _edit_weights(d, lambda sd: sd.__setitem__(key, sd[key].to(torch.int8)))
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], key, "I8")
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "act").exists()


def test_profile_refuses_a_folder_without_its_tokenizer_model(tmp_path, relu_hf, text):
    """tokenizer_config.json alone: transformers would fall back to another vocabulary."""
    d = _copy(relu_hf, tmp_path / "m")
    (d / "tokenizer.model").unlink()
    _fails(profile_main, [d, "--data", text, "--out", tmp_path / "act", "--max-tokens", 64], d, "tokenizer.model")
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], d, "tokenizer.model")


# --------------------------------------------------------------------------- predictor folders
@pytest.mark.parametrize("value,needle", [(1e300, "1e+300"), (True, "True"), ("0.5", "'0.5'"),
                                          (float("nan"), "nan")])
def test_predictor_config_sparse_threshold_is_checked(tmp_path, relu_hf, pred, value, needle):
    p = shutil.copytree(pred, tmp_path / "pred")
    cfg = json.loads((p / "config.json").read_text())
    cfg["sparse_threshold"] = value
    (p / "config.json").write_text(json.dumps(cfg))
    _fails(convert_main, [relu_hf, p, "--outfile", tmp_path / "o.gguf"], p / "config.json", "sparse_threshold", needle)
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("content,needle", [
    ({"fc1.weight": [1, 2], "fc2.weight": [3]}, "fc1.weight must be a tensor"),
    ({"fc1.weight": torch.ones(8), "fc2.weight": torch.ones(172, 8)}, "must be 2-D"),
    ({"fc1.weight": torch.ones(8, 64, dtype=torch.int8), "fc2.weight": torch.ones(172, 8)}, "int8"),
    ({"fc1.weight": torch.full((8, 64), float("nan")), "fc2.weight": torch.ones(172, 8)}, "NaN"),
    ([1, 2], "found a list"),
])
def test_predictor_file_contents_are_checked(tmp_path, relu_hf, pred, content, needle):
    p = shutil.copytree(pred, tmp_path / "pred")
    torch.save(content, p / "model_3.pt")
    _fails(convert_main, [relu_hf, p, "--outfile", tmp_path / "o.gguf"], p / "model_3.pt", needle)


def test_layer_files_are_matched_by_exact_name(tmp_path, pred):
    p = shutil.copytree(pred, tmp_path / "pred")
    shutil.copy(p / "model_1.pt", p / "model_01.pt")
    with pytest.raises(PowerInferError, match="both model_1.pt and model_01.pt"):
        load_predictor_dir(p, N_LAYER, N_EMBD, N_FF)
    (p / "model_1.pt").unlink()
    with pytest.raises(PowerInferError, match="missing layer file.*model_1.pt.*model_01.pt is not read"):
        load_predictor_dir(p, N_LAYER, N_EMBD, N_FF)
    a = tmp_path / "act"
    save_activation_dir(a, [torch.arange(N_FF) for _ in range(3)])
    shutil.copy(a / "activation_2.pt", a / "activation_02.pt")
    with pytest.raises(PowerInferError, match="both activation_2.pt and activation_02.pt"):
        load_activation_dir(a)


# --------------------------------------------------------------------------- outputs
def test_outfile_never_replaces_an_input_or_a_foreign_file(tmp_path, relu_hf, pred):
    m = _copy(relu_hf, tmp_path / "m")
    p = shutil.copytree(pred, tmp_path / "pred")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for target in (m / "model.safetensors", p / "model_0.pt", notes):
        before = target.read_bytes()
        _fails(convert_main, [m, p, "--outfile", target], target, "refusing to replace it")
        assert target.read_bytes() == before


def test_stale_temp_files_of_killed_runs_are_cleaned(tmp_path, relu_hf):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID names a process that no longer runs
    stale = [tmp_path / f".o.gguf.{dead.pid}.abcd1234.tmp", tmp_path / f".o.gguf.{os.getppid()}.live1234.tmp"]
    for s in stale:
        s.write_bytes(b"x" * 100)
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 0, r.output
    assert not stale[0].exists()  # a dead writer's
    assert stale[1].exists()  # a live process's (the test runner's parent): not ours to remove
    assert "\r" not in r.output and "writing o.gguf: " in r.output  # line progress, not tqdm frames, in a log


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_folder_swap_is_finished_or_undone_by_the_next_reader(tmp_path):
    counts_old = [torch.zeros(N_FF, dtype=torch.int64) for _ in range(2)]
    counts_new = [torch.ones(N_FF, dtype=torch.int64) for _ in range(2)]
    act = tmp_path / "act"
    pid = _dead_pid()
    # killed after the old folder moved aside and the complete new one was ready: finished
    save_activation_dir(tmp_path / "x", counts_new)
    os.replace(tmp_path / "x", tmp_path / f".act.{pid}.new")
    save_activation_dir(tmp_path / "y", counts_old)
    os.replace(tmp_path / "y", tmp_path / f".act.{pid}.old")
    assert [int(c.sum()) for c in load_activation_dir(act)] == [N_FF, N_FF]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["act"]
    # killed after the old folder moved aside, the new one not complete: the old one comes back
    os.replace(act, tmp_path / f".act.{pid}.old")
    (tmp_path / f".act.{pid}.abcd1234.tmp").mkdir()
    assert [int(c.sum()) for c in load_activation_dir(act)] == [N_FF, N_FF]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["act"]
    # the next writer also cleans up first
    (tmp_path / f".act.{pid}.old").mkdir()
    save_activation_dir(act, counts_old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["act"]
    assert [int(c.sum()) for c in load_activation_dir(act)] == [0, 0]


def test_disk_full_names_the_output(tmp_path, monkeypatch):
    """torch.save's own error does not say which file; ENOSPC from a write has no file name either."""
    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4416 vs 4308")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(PowerInferError, match=r"layer_0\.pt: could not write it .*disk full"):
        _atomic.save_torch({"a": torch.ones(2)}, tmp_path / "layer_0.pt")
    with pytest.raises(PowerInferError, match=r"pred: could not write it"):
        save_predictor_dir(tmp_path / "pred", [LayerPredictor(torch.ones(2, 4), torch.ones(6, 2))], {})
    monkeypatch.undo()

    def enospc(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", enospc)
    with pytest.raises(PowerInferError, match=r"state\.json: could not write it \(No space left on device\)"):
        _atomic.write_text(tmp_path / "state.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sigterm_removes_the_temporary_file(tmp_path):
    """SIGTERM is handled as Ctrl-C by the CLIs' error wrapper: the temp-file cleanup runs."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        import click
        sys.path.insert(0, {str(ROOT)!r})
        from powerinfer.errors import cli_errors
        from powerinfer.formats._atomic import atomic_path

        @click.command()
        @cli_errors
        def main():
            with atomic_path({str(tmp_path / 'out.bin')!r}) as tmp:
                tmp.write_bytes(b"partial")
                print("writing", flush=True)
                time.sleep(30)
        main()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    assert any(n.name.endswith(".tmp") for n in tmp_path.iterdir())
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1, err
    assert "Aborted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- resume data
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", n_layer=2, n_embd=32, n_ff=48, seed=0)


def test_damaged_training_checkpoints_retrain_that_layer(tiny, text, tmp_path):
    from powerinfer.train_predictor.stage import train_predictor_dir
    from powerinfer.train_predictor.train import TrainSettings

    def run():
        return train_predictor_dir(tiny, text, tmp_path / "pred", work_dir=tmp_path / "work", max_tokens=1024,
                                   heldout_tokens=256, seq_len=64, hidden=16,
                                   settings=TrainSettings(epochs=3, batch_size=256, patience=10))

    ref = run()
    want = [torch.load(tmp_path / "pred" / f"model_{i}.pt", weights_only=True) for i in range(2)]
    ckpt_path = tmp_path / "work" / "train" / "layer_0.pt"
    good = torch.load(ckpt_path, weights_only=True)
    assert ref["layers"][0]["best_epoch"] == good["best_epoch"] + 1  # config.json counts epochs from 1
    assert 1 <= ref["layers"][0]["best_epoch"] <= ref["layers"][0]["epochs"]
    bad_shape = dict(good, best_model={k: v[:, :3] for k, v in good["best_model"].items()})
    unfinished = dict(good, done=False, epoch=2, history=good["history"][:2], best_epoch=0,
                      model={k: v[:4] for k, v in good["model"].items()})
    for damaged in ([1, 2, 3], bad_shape, dict(good, epoch="lots"), unfinished):
        torch.save(damaged, ckpt_path)
        cfg = run()
        assert [l["resumed"] for l in cfg["layers"]] == ["no", "finished"]
        got = [torch.load(tmp_path / "pred" / f"model_{i}.pt", weights_only=True) for i in range(2)]
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w)  # retrained as before
    meta = tmp_path / "work" / "collect" / "meta.json"
    m = json.loads(meta.read_text())
    m["n_tokens"]["train"] = "lots"
    meta.write_text(json.dumps(m))
    cfg = run()  # collected again, then every layer's finished checkpoint is reused
    assert cfg["n_tokens"] == ref["n_tokens"]


# --------------------------------------------------------------------------- chat template
def _with_template(relu_hf, d, template):
    d = _copy(relu_hf, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _gguf_string(path, key):
    from powerinfer.formats.gguf_file import open_gguf

    return open_gguf(path).get(key)


JINJA = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("template", [JINJA, [{"name": "tool_use", "template": "T"},
                                              {"name": "default", "template": JINJA}]])
def test_convert_writes_the_chat_template(tmp_path, relu_hf, template):
    d = _with_template(relu_hf, tmp_path / "m", template)
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 0, r.output
    assert _gguf_string(tmp_path / "o.gguf", "tokenizer.chat_template") == JINJA


def test_convert_without_a_chat_template_writes_none(tmp_path, relu_hf):
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 0, r.output
    assert _gguf_string(tmp_path / "o.gguf", "tokenizer.chat_template") is None


@pytest.mark.parametrize("template,needle", [(42, "must be a string"), ([{"name": "rag", "template": "T"}], "'default'"),
                                             ("x" * (MAX_CHAT_TEMPLATE + 1), "longer than")])
def test_convert_refuses_a_bad_chat_template(tmp_path, relu_hf, template, needle):
    d = _with_template(relu_hf, tmp_path / "m", template)
    _fails(convert_main, [d, "--outfile", tmp_path / "o.gguf"], d / "tokenizer_config.json", "chat_template", needle)
    assert not (tmp_path / "o.gguf").exists()


# --------------------------------------------------------------------------- --help
@pytest.mark.parametrize("module", ["powerinfer.convert.cli", "powerinfer.convert.quantize_cli",
                                    "powerinfer.eval.cli", "powerinfer.profile.cli",
                                    "powerinfer.train_predictor.cli", "powerinfer.report.cli", "powerinfer.__main__"])
def test_offline_cli_modules_do_not_import_torch_until_run(module):
    """--help answers without importing torch, transformers or numpy (seconds on a cold start)."""
    code = f"import sys, {module}; print(*(m in sys.modules for m in ('torch', 'transformers', 'numpy')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "False"]


def test_cli_constants_match_the_modules_they_stand_for():
    from powerinfer.convert import tensor_types, type_names
    from powerinfer.quant.types import WRITE_TYPES

    assert set(type_names.QUANTIZE_TYPES) == set(WRITE_TYPES)
    assert set(type_names.OUTTYPES) == set(tensor_types.FILE_TYPES)


def test_a_threshold_the_stages_accept_is_one_the_loader_accepts():
    """One limit (powerinfer.limits.MAX_THRESHOLD) for training, conversion and loading: a threshold
    between the loader's old 1e3 and the stages' old 1e4 used to train and convert, then fail to load."""
    from click.testing import CliRunner

    from powerinfer.convert.cli import main as convert_main
    from powerinfer.formats.predictor import check_sparse_threshold
    from powerinfer.train_predictor.cli import main as train_main

    with pytest.raises(PowerInferError, match="threshold"):
        check_sparse_threshold(5000.0, "config.json")
    for main, args in ((train_main, ["m", "--data", "d", "--out", "o", "--threshold", "5000"]),
                       (convert_main, ["m", "--outfile", "o.gguf", "--sparse-threshold", "5000"])):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "5000" in r.output, r.output

"""ReLU-Falcon as published: a legacy ``RWForCausalLM`` config with no ``activation`` key,
whose ReLU lives in its own ``modelling_RW.py``.

Two ways through, both recorded in every output: the modelling file read as text (never
imported: the file here would leave a mark and exit if it ran), or ``--ffn-activation relu``
on every stage. Without either the refusal names both.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from powerinfer.convert.cli import main as convert_main
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import load_hf_model, resolve_model
from powerinfer.runtime.cli import main as run_main

from family_models import N_LAYER, make_falcon
from helpers import TEXT, need, random_predictors

# written for this test: the shape of a legacy RW modelling file, with a trap if it is ever run
MODELLING_RW = '''
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "EXECUTED"), "w").write("ran")
raise SystemExit("modelling_RW.py must never be imported")

import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.score_act = nn.GELU()  # not the MLP: must not count


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.act = nn.{act}()
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))
'''


@pytest.fixture(scope="module")
def rw_base(tmp_path_factory):
    """Legacy RW config, no activation key, no modelling file."""
    return make_falcon(tmp_path_factory.mktemp("rw") / "hf", legacy=True, activation=None)


def _copy(src, dst, act=None):
    import shutil

    shutil.copytree(src, dst)
    if act is not None:
        (dst / "modelling_RW.py").write_text(MODELLING_RW.replace("{act}", act))
    return dst


def test_modelling_file_read_as_text_makes_it_relu_and_is_never_run(rw_base, tmp_path):
    d = _copy(rw_base, tmp_path / "hf", "ReLU")
    assert "activation" not in json.loads((d / "config.json").read_text())
    family, cfg, act = resolve_model(d)
    assert family.name == "falcon" and act.kind == "relu" and act.is_sparse
    assert "modelling_RW.py" in act.origin and "not run" in act.origin
    model = load_hf_model(d)  # transformers' Falcon, told the activation the code used
    assert isinstance(model.transformer.h[0].mlp.act, torch.nn.ReLU)
    pred = random_predictors(tmp_path / "pred", N_LAYER, 64, 256)
    out = tmp_path / "m.powerinfer.gguf"
    r = CliRunner().invoke(convert_main, [str(d), str(tmp_path / "pred"), "--outfile", str(out), "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    g = open_gguf(out)
    assert g.get("powerinfer.activation") == "relu" and "modelling_RW.py" in g.get("powerinfer.activation_source")
    assert not (d / "EXECUTED").exists()
    # the GELU of the same weights gives other logits: the activation really changed the model
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    with torch.no_grad():
        assert (model(ids).logits - load_hf_model(rw_base)(ids).logits).abs().max().item() > 1e-3


def test_modelling_file_with_gelu_stays_dense_and_contradicts_the_flag(rw_base, tmp_path):
    from powerinfer.families import ffn_activation_override

    d = _copy(rw_base, tmp_path / "hf", "GELU")
    assert resolve_model(d)[2].kind == "gelu"
    with ffn_activation_override("relu"), pytest.raises(PowerInferError, match="modelling_RW.py") as e:
        resolve_model(d)
    assert "--ffn-activation 'relu'" in str(e.value)
    assert not (d / "EXECUTED").exists()


def test_flag_contradicting_the_config_is_refused(tmp_path):
    from powerinfer.families import ffn_activation_override

    d = make_falcon(tmp_path / "hf", legacy=True, activation="gelu")
    with ffn_activation_override("relu"), pytest.raises(PowerInferError, match="activation is 'gelu'"):
        resolve_model(d)


def test_without_file_or_flag_the_refusal_names_both_ways(rw_base, tmp_path):
    random_predictors(tmp_path / "pred", N_LAYER, 64, 256)
    r = CliRunner().invoke(convert_main, [str(rw_base), str(tmp_path / "pred"), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "'gelu'" in r.output and "--ffn-activation relu" in r.output
    assert "modelling_RW.py" in r.output and "read as text, never run" in r.output
    assert not (tmp_path / "o.gguf").exists()


def test_flag_on_every_stage_is_recorded_in_every_output(rw_base, tmp_path):
    from powerinfer.profile.cli import main as profile_main
    from powerinfer.train_predictor.cli import main as train_main

    data = str(need(TEXT / "tinystories_val.txt"))
    d = str(rw_base)
    act, pred, out = tmp_path / "act", tmp_path / "pred", tmp_path / "m.powerinfer.gguf"
    r = CliRunner().invoke(profile_main, [d, "--data", data, "--out", str(act), "--max-tokens", "128",
                                          "--seq-len", "64", "--ffn-activation", "relu"])
    assert r.exit_code == 0, r.output
    stats = json.loads((act / "powerinfer_stats.json").read_text())
    assert stats["activation"] == "relu" and stats["activation_source"] == "--ffn-activation relu"
    r = CliRunner().invoke(train_main, [d, "--data", data, "--out", str(pred), "--max-tokens", "256",
                                        "--heldout-tokens", "64", "--seq-len", "64", "--hidden", "16", "--epochs", "2",
                                        "--ffn-activation", "relu"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((pred / "config.json").read_text())
    assert cfg["activation"] == "relu" and cfg["activation_source"] == "--ffn-activation relu"
    r = CliRunner().invoke(convert_main, [d, str(pred), "--outfile", str(out), "--ffn-activation", "relu"])
    assert r.exit_code == 0, r.output
    g = open_gguf(out)
    assert g.get("powerinfer.activation") == "relu"
    assert g.get("powerinfer.activation_source") == "--ffn-activation relu"
    r = CliRunner().invoke(run_main, ["-m", str(out), "-n", "6", "--temp", "0"])
    assert r.exit_code == 0, r.output
    # the same stages without the flag refuse the folder (GELU is dense), naming the flag
    r = CliRunner().invoke(profile_main, [d, "--data", data, "--out", str(tmp_path / "act2"), "--max-tokens", "128"])
    assert r.exit_code == 1 and "--ffn-activation relu" in r.output


def test_option_choices_are_the_families_choices():
    from powerinfer.activation_flag import CHOICES
    from powerinfer.families import ACTIVATION_CHOICES

    assert CHOICES == ACTIVATION_CHOICES

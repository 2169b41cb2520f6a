"""Outputs never destroy what is not ours, are checked before writing, and get normal permissions."""
from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch
from click.testing import CliRunner

from powerinfer.convert.cli import main as convert_main
from powerinfer.errors import PowerInferError
from powerinfer.formats.activation import save_activation_dir
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.profile.collect import profile_model_dir

from helpers import story_text


def test_profile_refuses_to_replace_a_model_folder(relu_hf, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(relu_hf, model)
    data = tmp_path / "t.txt"
    data.write_text(story_text())
    before = sorted(p.name for p in model.iterdir())
    with pytest.raises(PowerInferError, match="holds other files"):
        profile_model_dir(model, data, model)
    assert sorted(p.name for p in model.iterdir()) == before


def test_predictor_folder_with_user_files_is_refused_but_our_own_is_replaced(tmp_path):
    layer = [LayerPredictor(torch.zeros(2, 4), torch.zeros(6, 2))]
    user = tmp_path / "notes"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(PowerInferError, match="notes.txt"):
        save_predictor_dir(user, layer, {"sparse_threshold": 0.0})
    assert (user / "notes.txt").read_text() == "mine"
    ours = save_predictor_dir(tmp_path / "pred", layer, {"sparse_threshold": 0.0})
    save_predictor_dir(ours, layer * 2, {"sparse_threshold": 0.0})  # a re-run replaces it
    assert sorted(p.name for p in ours.iterdir()) == ["config.json", "model_0.pt", "model_1.pt"]


def test_outputs_get_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        d = save_activation_dir(tmp_path / "act", [torch.zeros(3, dtype=torch.int64)])
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert stat.S_IMODE((d / "activation_0.pt").stat().st_mode) == 0o644


def test_convert_checks_the_activation_folder_before_writing(relu_hf, tmp_path):
    act = tmp_path / "act"
    save_activation_dir(act, [torch.zeros(172, dtype=torch.int64)] * 3)  # the model has 5 layers
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(out), "--vram-budget", "1",
                                          "--activation", str(act)])
    assert r.exit_code == 1 and "activation_3.pt" in r.output
    assert not out.exists()
    r = CliRunner().invoke(convert_main, [str(relu_hf), "--outfile", str(out), "--vram-budget", "-1"])
    assert r.exit_code == 1 and "--vram-budget -1: must be in [0, " in r.output and not out.exists()

"""pi-train-predictor --target-recall: the narrowest width reaching a held-out recall, within the budget."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sklearn.metrics import recall_score

import powerinfer.train_predictor.search as search_mod
from powerinfer.calibrate.hooks import torch_threads
from powerinfer.formats.collected import CollectedData, mask_file, pack_mask, unpack_mask, write_meta, x_file
from powerinfer.formats.predictor import load_predictor_dir
from powerinfer.train_predictor.cli import main as train_main
from powerinfer.train_predictor.search import CAPPED, REACHED, STALLED, search_width, width_ladder
from powerinfer.train_predictor.train import TrainSettings, hopeless

from helpers import TEXT, make_tiny_llama, need

N_EMBD, N_FF, N_LAYER = 32, 48, 2
TARGET = 0.9


# --------------------------------------------------------------------------- the CLI on a tiny model
@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One run with --target-recall 0.9 on a tiny random ReLU Llama (8192 training, 2048 held-out tokens)."""
    d = tmp_path_factory.mktemp("search")
    model = make_tiny_llama(d / "m", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, seed=0)
    data = need(TEXT / "tinystories_val.txt")
    args = [str(model), "--data", str(data), "--out", str(d / "pred"), "--work-dir", str(d / "work"),
            "--max-tokens", "8192", "--heldout-tokens", "2048", "--seq-len", "64", "--batch-size", "256",
            "--epochs", "10", "--budget", "0.25", "--threads", "1", "--target-recall", str(TARGET)]
    r = CliRunner().invoke(train_main, args)
    assert r.exit_code == 0, r.output
    return d, r.output, json.loads((d / "pred" / "config.json").read_text())


def test_chosen_widths_reach_the_target_on_heldout_tokens(searched):
    d, _, cfg = searched
    data = CollectedData.open(d / "work")
    preds = load_predictor_dir(d / "pred", N_LAYER, N_EMBD, N_FF)
    for i, (lp, layer) in enumerate(zip(preds, cfg["layers"])):
        assert lp.hidden == layer["hidden"] == cfg["hidden"][i]
        assert layer["stop"] == REACHED, layer  # measured: H 16 reaches 0.921 on both layers, H 8 0.884-0.887
        x = torch.from_numpy(np.asarray(data.inputs("heldout", i), dtype=np.float32))
        y = unpack_mask(np.asarray(data.masks("heldout", i)), N_FF).ravel()
        p = (lp.logits(x) >= cfg["sparse_threshold"]).numpy().ravel()
        assert recall_score(y, p) >= TARGET
        assert layer["recall"] == pytest.approx(recall_score(y, p), abs=1e-12)


def test_chosen_width_is_the_narrowest_tried_that_reached(searched):
    _, _, cfg = searched
    for layer in cfg["layers"]:
        tried = {p["hidden"]: p for p in layer["probes"]}
        assert tried[layer["hidden"]]["reached"]
        assert not any(p["reached"] for h, p in tried.items() if h < layer["hidden"])
        below = [h for h in tried if h < layer["hidden"]]
        assert below and layer["hidden"] - max(below) == 8  # bisected to the step (8 for n_embd 32)
        assert layer["hidden"] <= layer["cap"] == 64  # the budget rule's width at --budget 0.25


def test_config_records_width_recall_share_and_why_per_layer(searched):
    _, out, cfg = searched
    assert cfg["sizing"] == "target recall" and cfg["target_recall"] == TARGET
    assert cfg["settings"]["target_recall"] == TARGET and cfg["sparse_threshold"] == 0.0
    assert cfg["predictor_params"] == sum(cfg["hidden"]) * (N_EMBD + N_FF)
    for i, layer in enumerate(cfg["layers"]):
        assert layer["layer"] == i
        for k in ("hidden", "recall", "pred_active", "true_active", "cap", "stop", "probes", "search_seconds"):
            assert k in layer, k
        assert layer["stop"] in (REACHED, CAPPED, STALLED)
        assert all(set(p) == {"hidden", "recall", "pred_active", "score", "epochs", "reached"} for p in layer["probes"])
    assert "widths tried" in out and REACHED in out  # the printed table says why


def test_rerun_reuses_the_search(searched, monkeypatch):
    d, _, cfg = searched
    real, probes = search_mod.train_layer, []

    def counting(*a, give_up_below=None, **k):
        if give_up_below is not None:
            probes.append(a[2])
        return real(*a, give_up_below=give_up_below, **k)

    monkeypatch.setattr(search_mod, "train_layer", counting)
    data = CollectedData.open(d / "work")
    settings = TrainSettings(epochs=10, batch_size=256)
    for i, layer in enumerate(cfg["layers"]):
        rec = search_width(data, i, TARGET, 64, 8, settings, d / "work")
        assert rec["hidden"] == layer["hidden"] and rec["resumed"] == "finished"
        assert rec["probes"] == layer["probes"]
    assert probes == []  # no width trained again


def test_hidden_and_target_recall_together_are_refused(tmp_path):
    r = CliRunner().invoke(train_main, [str(tmp_path), "--data", "x", "--out", str(tmp_path / "p"),
                                        "--hidden", "16", "--target-recall", "0.9"])
    assert r.exit_code == 1 and "give one" in r.output and "Usage:" not in r.output


# --------------------------------------------------------------------------- denser layer, wider predictor
def _write_collected(work, layers_y, x_train, x_held):
    """A work dir with collected rows: inputs ``x_*`` for every layer, masks ``layers_y[i](x)``."""
    root = work / "collect"
    root.mkdir(parents=True)
    n_tokens = {"train": len(x_train), "heldout": len(x_held)}
    share = {"train": [], "heldout": []}
    for i, rule in enumerate(layers_y):
        for split, x in (("train", x_train), ("heldout", x_held)):
            y = rule(x)
            x.astype(np.float16).tofile(root / x_file(split, i))
            pack_mask(torch.from_numpy(y)).numpy().tofile(root / mask_file(split, i))
            share[split].append(float(y.mean()))
    write_meta(root, len(layers_y), x_train.shape[1], layers_y and 64, n_tokens, share, {"synthetic": 1})
    return CollectedData.open(work)


def test_denser_layer_gets_a_wider_predictor_than_a_much_sparser_one(tmp_path):
    """Layer 0: only 3 of 64 neurons ever fire (active share ~2%); layer 1: all 64 fire, each on
    its own half-space (~50%). Three linear rules need far fewer hidden units than 64.
    Measured: layer 0 reaches 0.95 at width 8 (recall 1.0), layer 1 at 32 (0.957; 16: 0.904)."""
    rng = np.random.default_rng(0)
    n_embd, n_ff = 16, 64
    w = rng.standard_normal((n_ff, n_embd)).astype(np.float32)
    x_train = rng.standard_normal((2048, n_embd)).astype(np.float32)
    x_held = rng.standard_normal((512, n_embd)).astype(np.float32)

    def sparse(x):
        y = np.zeros((len(x), n_ff), dtype=bool)
        y[:, :3] = x @ w[:3].T > 1.0
        return y

    def dense(x):
        return x @ w.T > 0.0

    data = _write_collected(tmp_path, [sparse, dense], x_train, x_held)
    assert data.active_share["train"][0] < 0.03 < 0.4 < data.active_share["train"][1]
    settings = TrainSettings(epochs=12, batch_size=128, patience=3, lr=3e-2)
    with torch_threads(1, 0):
        recs = [search_width(data, i, 0.95, 64, 8, settings, tmp_path) for i in range(2)]
    assert [r["stop"] for r in recs] == [REACHED, REACHED]
    assert recs[0]["hidden"] < recs[1]["hidden"], recs


# --------------------------------------------------------------------------- the search's decisions
@pytest.fixture()
def scripted(monkeypatch, tmp_path):
    """search_width over stand-ins for training and scoring: the held-out recall of each width is given."""
    calls = []

    def run(recall_of, cap=64, step=8, target=0.99):
        def fake_train_layer(data, layer, hidden, settings, work_dir, give_up_below=None, **k):
            calls.append((hidden, give_up_below))
            path = work_dir / "train" / f"layer_{layer}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_text(str(hidden))
            return hidden, dict(epochs=1, done=True)

        def fake_metrics(pred, *a, **k):
            return dict(recall=recall_of(pred), pred_active=0.2, true_active=0.2)  # no false alarms

        monkeypatch.setattr(search_mod, "train_layer", fake_train_layer)
        monkeypatch.setattr(search_mod, "heldout_metrics", fake_metrics)
        data = type("D", (), {"key": {"k": 1}, "n_ff": 4, "inputs": lambda *a: None, "masks": lambda *a: None})()
        return search_width(data, 0, target, cap, step, TrainSettings(), tmp_path)

    run.calls = calls
    run.final = tmp_path / "train" / "layer_0.pt"
    return run


def test_ladder_then_bisection_finds_the_narrowest_reaching_width(scripted):
    rec = scripted(lambda h: 0.995 if h >= 40 else 0.95 + h / 1000)
    assert [p["hidden"] for p in rec["probes"]] == [8, 16, 32, 64, 48, 40]
    assert rec["hidden"] == 40 and rec["stop"] == REACHED
    assert scripted.final.read_text() == "40"  # the chosen width's run is the predictor
    assert scripted.calls[-1] == (40, None)  # finished without giving up


def test_cap_ends_the_search(scripted):
    rec = scripted(lambda h: 0.80 + h / 400, cap=48)  # 0.82, 0.84, 0.88, 0.92: never 0.99
    assert [p["hidden"] for p in rec["probes"]] == [8, 16, 32, 48]
    assert rec["hidden"] == 48 and rec["stop"] == CAPPED


def test_recall_that_stops_improving_keeps_the_narrower_width(scripted):
    recall = {8: 0.80, 16: 0.90, 32: 0.950, 64: 0.952}  # 64 removes 4% of 32's misses (< 10%)
    rec = scripted(recall.__getitem__)
    assert rec["hidden"] == 32 and rec["stop"] == STALLED
    assert scripted.final.read_text() == "32"


def test_width_ladder():
    assert width_ladder(64, 8) == [8, 16, 32, 64]
    assert width_ladder(48, 8) == [8, 16, 32, 48]
    assert width_ladder(1536, 256) == [256, 512, 1024, 1536]
    assert width_ladder(8, 8) == [8]


def test_probe_gives_up_only_when_its_pace_cannot_reach_the_target():
    h = [dict(recall=r) for r in (0.90, 0.95, 0.960, 0.961, 0.962, 0.963)]
    assert hopeless(h, 0.99, epochs=20)  # +0.001/epoch for 14 more epochs: 0.977 < 0.99
    assert not hopeless(h, 0.975, epochs=20)  # 0.977 >= 0.975: keep training
    assert not hopeless(h[:3], 0.99, epochs=20)  # too early to tell
    assert not hopeless(h + [dict(recall=0.955)] * 2 + [dict(recall=0.999)], 0.99, epochs=20)  # best so far counts

"""pi-report and pi-profile's report.png: one panel per layer, the power-law slope and the coverage numbers."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from powerinfer.formats.activation import save_activation_dir
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.profile.cli import main as profile_main
from powerinfer.report.cli import main as report_main
from powerinfer.report.plot import (MISSING_MATPLOTLIB, ReportData, coverage_curve, load_report_data, plot_report,
                                    report_axes, report_rows)

from helpers import make_tiny_llama, story_text

import matplotlib  # noqa: E402,F401  (the test extra installs it: missing is a failure, not a skip)

N_TOKENS = 1000
HAND = [500, 300, 100, 50, 50, 0, 0, 0, 0, 0]  # n_ff 10, 1000 activations over 1000 tokens


def _act_dir(path, counts, n_tokens=N_TOKENS):
    save_activation_dir(path, [torch.tensor(c, dtype=torch.int64) for c in counts],
                        None if n_tokens is None else {"n_tokens": n_tokens})
    return path


def _pred_dir(path, n_layer, n_ff, records=True):
    layers = [LayerPredictor(torch.zeros(8 + 8 * i, 4), torch.zeros(n_ff, 8 + 8 * i)) for i in range(n_layer)]
    cfg = {"sparse_threshold": 0.0}
    if records:
        cfg["layers"] = [dict(layer=i, hidden=8 + 8 * i, recall=0.99 - 0.01 * i, pred_active=0.2 + 0.01 * i,
                              true_active=0.15 + 0.01 * i) for i in range(n_layer)]
    save_predictor_dir(path, layers, cfg)
    return path


def _layer_panels(fig):
    return [ax for ax in report_axes(fig) if ax.get_label().startswith("layer ")]


# --------------------------------------------------------------------------- numbers
def test_slope_of_an_exact_power_law_is_recovered(tmp_path):
    rank = np.arange(1, 2049)
    counts = [np.round(1e7 * rank ** -a) for a in (0.5, 1.0, 1.5)]
    rows = report_rows(ReportData([c.astype(np.float64) for c in counts], n_tokens=10 ** 7))
    assert [r["powerlaw_slope"] for r in rows] == pytest.approx([-0.5, -1.0, -1.5], abs=2e-3)
    assert all(r["powerlaw_r2"] > 0.9999 for r in rows)
    shuffled = np.random.default_rng(0).permutation(counts[1])  # neuron order does not matter, only rank
    assert report_rows(ReportData([shuffled], 10 ** 7))[0]["powerlaw_slope"] == pytest.approx(-1.0, abs=2e-3)


def test_coverage_numbers_are_the_hand_computed_ones(tmp_path):
    x, y = coverage_curve(np.array(HAND[::-1], dtype=np.float64))  # order-free
    assert x.tolist() == pytest.approx([k / 10 for k in range(11)])
    assert y.tolist() == pytest.approx([0, 0.5, 0.8, 0.9, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    row = report_rows(load_report_data(_act_dir(tmp_path / "act", [HAND])))[0]
    assert row["top10_coverage"] == pytest.approx(0.5)  # the hottest 1 of 10 neurons: 500 of 1000
    assert row["top20_coverage"] == pytest.approx(0.8)  # the hottest 2: 800 of 1000
    assert row["active_share"] == pytest.approx(1000 / (N_TOKENS * 10))  # mean activation frequency 0.1
    assert row["sparsity"] == pytest.approx(0.9)
    assert row["dead_neurons"] == 5 and row["n_ff"] == 10


def test_coverage_of_a_flat_layer_is_the_diagonal():
    _, y = coverage_curve(np.full(20, 7.0))
    assert y.tolist() == pytest.approx([k / 20 for k in range(21)])


# --------------------------------------------------------------------------- the figure
@pytest.mark.parametrize("n_layer", [5, 32])
def test_one_panel_per_layer_and_the_two_summary_panels(tmp_path, n_layer):
    rng = np.random.default_rng(n_layer)
    counts = [rng.binomial(N_TOKENS, np.clip(0.5 * np.arange(1, 65) ** -0.7, 0, 1)) for _ in range(n_layer)]
    data = load_report_data(_act_dir(tmp_path / "act", counts), _pred_dir(tmp_path / "pred", n_layer, 64))
    fig = plot_report(data)
    panels = _layer_panels(fig)
    assert [ax.get_label() for ax in panels] == [f"layer {i}" for i in range(n_layer)]
    assert all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in panels)
    labels = {ax.get_label() for ax in report_axes(fig)}
    assert {"coverage", "active share"} <= labels


def test_pi_report_writes_the_png_and_prints_the_table(tmp_path):
    act = _act_dir(tmp_path / "act", [HAND, HAND[::-1]])
    pred = _pred_dir(tmp_path / "pred", 2, 10)
    r = CliRunner().invoke(report_main, [str(act), str(pred), "--json", str(tmp_path / "t.json")])
    assert r.exit_code == 0, r.output
    png = act / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = r.output.splitlines()[0].split()
    assert header == ["layer", "n_ff", "active_share", "sparsity", "powerlaw_slope", "top10_coverage",
                      "top20_coverage", "dead_neurons", "hidden", "recall", "pred_active", "true_active"]
    rows = json.loads((tmp_path / "t.json").read_text())["layers"]
    assert set(header) <= set(rows[0])  # the JSON uses the table's names
    assert rows[1]["hidden"] == 16 and rows[1]["recall"] == pytest.approx(0.98)
    assert rows[0]["top20_coverage"] == pytest.approx(0.8)

    r = CliRunner().invoke(report_main, [str(act), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 0 and (tmp_path / "x.png").is_file()
    assert "recall" not in r.output.splitlines()[0]


def test_pi_report_without_stats_or_predictor_records(tmp_path):
    act = _act_dir(tmp_path / "act", [HAND, HAND], n_tokens=None)  # e.g. an upstream activation folder
    pred = _pred_dir(tmp_path / "pred", 2, 10, records=False)
    r = CliRunner().invoke(report_main, [str(act), str(pred), "-o", str(tmp_path / "r.png")])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[1].split()
    assert first[2:4] == ["-", "-"]  # no token count: no active share or sparsity
    assert first[8:] == ["8", "-", "-", "-"]  # width read from model_0.pt, nothing else recorded
    assert (tmp_path / "r.png").is_file()


def test_pi_report_bad_input_is_one_line(tmp_path):
    act = _act_dir(tmp_path / "act", [HAND, HAND])
    r = CliRunner().invoke(report_main, [str(act), str(_pred_dir(tmp_path / "pred", 3, 10))])
    assert r.exit_code == 1 and "model_2.pt" in r.output and "only 2 layers" in r.output
    r = CliRunner().invoke(report_main, [str(tmp_path / "nothing")])
    assert r.exit_code == 1 and "activation folder not found" in r.output
    bad = _act_dir(tmp_path / "bad", [HAND], n_tokens=100)  # fewer tokens than the hottest neuron's count
    r = CliRunner().invoke(report_main, [str(bad)])
    assert r.exit_code == 1 and "n_tokens 100" in r.output


# --------------------------------------------------------------------------- pi-profile
@pytest.fixture(scope="module")
def profile_args(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    model = make_tiny_llama(d / "m", n_layer=2, seed=2)
    text = d / "t.txt"
    text.write_text(story_text(2000))
    return [str(model), "--data", str(text), "--max-tokens", "128", "--seq-len", "32", "--threads", "1"]


def test_pi_profile_draws_report_png(profile_args, tmp_path):
    r = CliRunner().invoke(profile_main, profile_args + ["--out", str(tmp_path / "act")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "act" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "powerlaw_slope" in r.output
    # a rerun replaces the folder: report.png counts as the folder's own file
    r = CliRunner().invoke(profile_main, profile_args + ["--out", str(tmp_path / "act")])
    assert r.exit_code == 0, r.output


def test_pi_profile_without_matplotlib_says_so_and_succeeds(profile_args, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = CliRunner().invoke(profile_main, profile_args + ["--out", str(tmp_path / "act")])
    assert r.exit_code == 0, r.output
    assert [l for l in r.output.splitlines() if "report.png" in l] == [MISSING_MATPLOTLIB]
    assert (tmp_path / "act" / "activation_1.pt").is_file() and not (tmp_path / "act" / "report.png").exists()


@pytest.mark.parametrize("stats,needle", [(b"[1, 2]", "expected a JSON object, found a list"),
                                          (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
                                          (b'{"n_tokens": "lots"}', "n_tokens must be a positive integer")])
def test_pi_report_damaged_stats_json_is_one_line(tmp_path, stats, needle):
    act = _act_dir(tmp_path / "act", [HAND])
    (act / "powerinfer_stats.json").write_bytes(stats)
    r = CliRunner().invoke(report_main, [str(act), "-o", str(tmp_path / "r.png")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "powerinfer_stats.json" in r.output and needle in r.output
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("field,value", [("recall", "x"), ("recall", [1]), ("pred_active", 2.5),
                                         ("true_active", True), ("hidden", "wide"), ("hidden", -8)])
def test_pi_report_predictor_records_of_the_wrong_type_are_one_line(tmp_path, field, value):
    act = _act_dir(tmp_path / "act", [HAND, HAND])
    pred = _pred_dir(tmp_path / "pred", 2, len(HAND))
    cfg = json.loads((pred / "config.json").read_text())
    cfg["layers"][1][field] = value
    (pred / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(report_main, [str(act), str(pred), "-o", str(tmp_path / "r.png")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert str(pred / "config.json") in r.output and f"layer 1: {field}" in r.output
    assert not (tmp_path / "r.png").exists()


def test_pi_report_does_not_write_over_an_input_file(tmp_path):
    act = _act_dir(tmp_path / "act", [HAND])
    before = (act / "activation_0.pt").read_bytes()
    r = CliRunner().invoke(report_main, [str(act), "--json", str(act / "activation_0.pt")])
    assert r.exit_code == 1 and "refusing to replace it" in r.output
    assert (act / "activation_0.pt").read_bytes() == before

"""``pi-report``: redraw the power-law report of an activation folder, with or without predictors.

Prints the per-layer table (:func:`powerinfer.report.plot.report_rows`) and writes the
figure (:func:`powerinfer.report.plot.plot_report`), by default as ``ACT_DIR/report.png``,
the file ``pi-profile`` writes.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..cli_params import PiCommand, require_folder, version_option
from ..errors import PowerInferError, cli_errors
from ..profile.cli import format_table

__all__ = ["main", "report_table"]

COLUMNS = ("layer", "n_ff", "active_share", "sparsity", "powerlaw_slope", "top10_coverage", "top20_coverage",
           "dead_neurons")
PRED_COLUMNS = ("hidden", "recall", "pred_active", "true_active")

HELP = """Redraw the power-law report of ACT_DIR (pi-profile's activation folder), and of
PRED_DIR's predictors (pi-train-predictor's folder) when given.

\b
The figure: per layer, activation frequency against neuron rank on log-log axes
(dashed: the fitted power law; dotted: the hottest 20% of neurons); the coverage
curves of all layers; per layer, the predicted against the truly active share.

\b
The table, one row per layer (the same names as powerinfer_stats.json and --json):
  n_ff            FFN neurons in the layer
  active_share    mean activation frequency: share of the layer's neurons active
                  per token (= mean over neurons of count / tokens)
  sparsity        1 - active_share
  powerlaw_slope  slope of the straight line fitted to log(count) against
                  log(rank) over the active neurons (-1 is Zipf-like; near 0 is flat)
  top10_coverage  share of all activations carried by the hottest 10% of neurons
  top20_coverage  the same for the hottest 20% (0.1 and 0.2 would mean no skew)
  dead_neurons    neurons never active on the calibration text
  (--json adds powerlaw_r2: the R^2 of that straight-line fit)
With PRED_DIR, from its config.json (held-out tokens, at its sparse_threshold):
  hidden          predictor width H
  recall          share of truly active neurons the predictor marks active
  pred_active     share of neurons predicted active per token (what sparse
                  inference computes)
  true_active     share of neurons truly active per token
"-" marks a value the folders do not record (active shares need
powerinfer_stats.json's token count)."""


def report_table(rows: list[dict]) -> str:
    """The table ``pi-report`` prints for :func:`powerinfer.report.plot.report_rows`."""
    cols = COLUMNS + (PRED_COLUMNS if rows and "recall" in rows[0] else ())
    return format_table(cols, [[r.get(k) for k in cols] for r in rows])


@click.command(cls=PiCommand, help=HELP, context_settings=dict(help_option_names=["-h", "--help"]))
@click.argument("act_dir", type=click.Path(path_type=Path))
@click.argument("pred_dir", required=False, type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_png", default=None, type=click.Path(path_type=Path),
              help="PNG to write [default: ACT_DIR/report.png].")
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path),
              help="Also write the table as JSON ({\"layers\": [...]}, the column names above).")
@version_option("pi-report")
@cli_errors
def main(act_dir: Path, pred_dir: Path | None, out_png: Path | None, json_out: Path | None) -> None:
    require_folder(act_dir, "activation")  # before torch is imported (seconds)
    if pred_dir is not None:
        require_folder(pred_dir, "predictor")
    from ..formats._atomic import atomic_path
    from .plot import MISSING_MATPLOTLIB, REPORT_FILE, load_report_data, report_rows, write_report

    for opt, target in (("-o", out_png), ("--json", json_out)):  # never over the folders' own files
        if target is not None and target.exists() and target.name != REPORT_FILE and \
                any(d is not None and target.resolve().parent == d.resolve() for d in (act_dir, pred_dir)):
            raise PowerInferError(f"{opt} {target}: is a file of an input folder; refusing to replace it")
    data = load_report_data(act_dir, pred_dir)
    rows = report_rows(data)
    click.echo(report_table(rows))
    if json_out is not None:
        with atomic_path(json_out) as tmp:
            tmp.write_text(json.dumps(dict(activation=str(act_dir), predictor=None if pred_dir is None else str(pred_dir),
                                           n_tokens=data.n_tokens, layers=rows), indent=2) + "\n")
    out_png = out_png if out_png is not None else act_dir / REPORT_FILE
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PowerInferError(MISSING_MATPLOTLIB.replace("report.png skipped", "no figure drawn")) from None
    write_report(data, out_png)
    click.echo(f"{data.n_layer} layers -> {out_png}")


if __name__ == "__main__":  # pragma: no cover
    main()

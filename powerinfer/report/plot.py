"""Per-layer power-law report from an activation folder, optionally with a predictor folder.

Inputs are what the pipeline writes: ``activation_{i}.pt`` counts (and ``n_tokens`` from
``powerinfer_stats.json``, read with :mod:`powerinfer.formats.activation`) and, optionally,
a predictor folder's ``config.json`` per-layer records (:mod:`powerinfer.formats.predictor`:
width, held-out recall, predicted-active and truly active share, as ``pi-train-predictor``
writes them). Outputs:

* :func:`report_rows`: one dict per layer, the numbers ``pi-report`` prints (the same
  names and definitions as ``powerinfer_stats.json``, via
  :func:`powerinfer.profile.collect.activation_stats`);
* :func:`plot_report`: a matplotlib ``Figure`` with one panel per layer (activation
  frequency against neuron rank, log-log, with the fitted power law) and a bottom row with
  the coverage curves of all layers and the per-layer active shares (predicted against
  truly active when predictors are given);
* :func:`write_report`: the figure as a PNG, written atomically.

matplotlib is optional (``pip install 'powerinfer[report]'``); it is imported only when a
figure is drawn, and :data:`MISSING_MATPLOTLIB` is the line callers print without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PowerInferError

__all__ = ["REPORT_FILE", "MISSING_MATPLOTLIB", "ReportData", "load_report_data", "coverage_curve",
           "report_rows", "plot_report", "report_axes", "write_report", "write_folder_report"]

REPORT_FILE = "report.png"
MISSING_MATPLOTLIB = ("report.png skipped: matplotlib is not installed "
                      "(pip install 'powerinfer[report]', or pip install matplotlib)")
_PRED_KEYS = ("hidden", "recall", "pred_active", "true_active")
_LEGEND_MAX = 10  # more layers than this: a colour bar instead of a legend


@dataclass
class ReportData:
    """What the report is drawn from.

    ``counts[i]``: float64 ``[n_ff]`` activation counts of layer ``i``; ``n_tokens``: the
    tokens they were counted over (None when the folder has no ``powerinfer_stats.json``,
    e.g. one written by upstream: then frequencies and shares are unknown and the panels
    show raw counts); ``predictors``: per layer ``{hidden, recall, pred_active,
    true_active}`` (a value None when ``config.json`` does not record it) or None;
    ``sparse_threshold``: the predictors' threshold; ``title``: the figure's title.
    """

    counts: list[np.ndarray]
    n_tokens: int | None = None
    predictors: list[dict[str, Any]] | None = None
    sparse_threshold: float | None = None
    title: str = ""

    @property
    def n_layer(self) -> int:
        return len(self.counts)


def _check_record(rec: dict[str, Any], src: Path, layer: int) -> None:
    """Per-layer predictor values from config.json: None, or shares in [0, 1] and a positive width."""
    for k, v in rec.items():
        if v is None:
            continue
        if k == "hidden":
            if type(v) is not int or not 0 < v <= 1 << 20:
                raise PowerInferError(f"{src}: layer {layer}: hidden must be a positive integer, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise PowerInferError(f"{src}: layer {layer}: {k} must be a share between 0 and 1, got {v!r}")


def _predictor_records(pred_dir: Path, n_layer: int) -> tuple[list[dict[str, Any]], float]:
    """Per-layer ``{hidden, recall, pred_active, true_active}`` of a predictor folder for ``n_layer`` layers."""
    from ..formats.activation import check_layers, layer_files, torch_load
    from ..formats.predictor import _NAME, read_predictor_config

    found = layer_files(pred_dir, _NAME, "predictor")
    check_layers(found, pred_dir, "model_{i}.pt", n_layer, "predictor")
    cfg = read_predictor_config(pred_dir)
    src = Path(pred_dir) / "config.json"
    layers = cfg.get("layers", [])
    if not isinstance(layers, list):
        raise PowerInferError(f"{src}: layers must be a list of per-layer records, found a {type(layers).__name__}")
    by_layer = {l.get("layer"): l for l in layers if isinstance(l, dict)}
    widths = cfg.get("hidden") if isinstance(cfg.get("hidden"), list) else []
    out = []
    for i in range(n_layer):
        rec = {k: by_layer.get(i, {}).get(k) for k in _PRED_KEYS}
        _check_record(rec, src, i)
        if rec["hidden"] is None:
            rec["hidden"] = widths[i] if i < len(widths) else None
        if rec["hidden"] is None:  # not recorded: read the width from the file
            sd = torch_load(found[i])
            if isinstance(sd, dict) and hasattr(sd.get("fc1.weight"), "shape"):
                rec["hidden"] = int(sd["fc1.weight"].shape[0])
        out.append(rec)
    return out, float(cfg.get("sparse_threshold", 0.0))


def load_report_data(act_dir: str | Path, pred_dir: str | Path | None = None) -> ReportData:
    """Read an activation folder (and a predictor folder with the same layer count).

    Raises PowerInferError naming the file for a bad activation or predictor folder, or
    a ``powerinfer_stats.json`` whose ``n_tokens`` is below a neuron's count (it belongs
    to other counts).
    """
    from ..formats.activation import STATS_FILE, load_activation_dir, load_activation_stats

    act_dir = Path(act_dir)
    counts = [c.numpy() for c in load_activation_dir(act_dir)]
    stats = load_activation_stats(act_dir) or {}
    n_tokens = stats.get("n_tokens")
    if n_tokens is not None:
        if not isinstance(n_tokens, int) or n_tokens < 1:
            raise PowerInferError(f"{act_dir / STATS_FILE}: n_tokens must be a positive integer, got {n_tokens!r}")
        top = max(float(c.max()) for c in counts)
        if top > n_tokens:
            raise PowerInferError(f"{act_dir / STATS_FILE}: n_tokens {n_tokens} is below a neuron's count "
                                  f"{top:.0f}; the stats do not belong to these counts")
    preds, threshold = (None, None)
    if pred_dir is not None:
        preds, threshold = _predictor_records(Path(pred_dir), len(counts))
    title = str(act_dir) + (f" + {pred_dir}" if pred_dir is not None else "")
    return ReportData(counts, n_tokens, preds, threshold, title)


def coverage_curve(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Share of all activations carried by the hottest neurons.

    ``counts``: 1-D ``[n_ff]``. Returns ``(x, y)``, both float64 ``[n_ff + 1]``:
    ``x[k] = k / n_ff`` (the hottest ``k`` neurons as a share of the layer) and ``y[k]``
    their share of all activations (``y[0] = 0``, ``y[n_ff] = 1``; all 0 for a layer that
    never fired). ``y`` at ``x = 0.1`` is ``top10_coverage`` when ``n_ff`` is a multiple of 10.
    """
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    total = c.sum()
    y = np.concatenate([[0.0], np.cumsum(c) / total if total > 0 else np.zeros_like(c)])
    return np.arange(c.size + 1) / c.size, y


def report_rows(data: ReportData) -> list[dict[str, Any]]:
    """The per-layer table (JSON-ready).

    Per layer: ``layer``, ``n_ff``, ``active_share`` (mean activation frequency: the
    share of the layer's neurons active per token, = the mean over neurons of count /
    n_tokens), ``sparsity`` (1 - active_share), ``powerlaw_slope`` and ``powerlaw_r2``
    (line through log count against log rank, active neurons only), ``top10_coverage`` /
    ``top20_coverage`` (share of activations on the hottest 10% / 20% of neurons),
    ``dead_neurons``; with predictors also ``hidden``, ``recall``, ``pred_active``,
    ``true_active`` from ``config.json``. Shares are None without ``n_tokens``.
    """
    import torch

    from ..profile.collect import activation_stats

    stats = activation_stats([torch.from_numpy(c) for c in data.counts], data.n_tokens or 0)
    rows = []
    for i, l in enumerate(stats["layers"]):
        row = dict(layer=i, n_ff=l["n_ff"],
                   active_share=l["active_share"] if data.n_tokens else None,
                   sparsity=l["sparsity"] if data.n_tokens else None,
                   powerlaw_slope=l["powerlaw_slope"], powerlaw_r2=l["powerlaw_r2"],
                   top10_coverage=l["top10_coverage"], top20_coverage=l["top20_coverage"],
                   dead_neurons=l["dead_neurons"])
        if data.predictors is not None:
            row.update({k: data.predictors[i].get(k) for k in _PRED_KEYS})
        rows.append(row)
    return rows


def _grid(n_layer: int) -> tuple[int, int]:
    """(columns, rows) of the per-layer panels: at most 8 columns."""
    ncols = min(n_layer, 8)
    return ncols, math.ceil(n_layer / ncols)


def plot_report(data: ReportData):
    """Draw the report; returns a ``matplotlib.figure.Figure`` (no pyplot state is touched).

    The per-layer panels are the axes labelled ``"layer {i}"`` (in the top sub-figure); the
    bottom sub-figure holds the axes labelled ``"coverage"`` and ``"active share"``;
    :func:`report_axes` lists them all. Raises ImportError without matplotlib.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from ..profile.collect import powerlaw_fit

    rows = report_rows(data)
    L = data.n_layer
    ncols, nrows = _grid(L)
    fig = Figure(figsize=(max(11.0, 2.3 * ncols), 1.9 * nrows + 4.0), layout="constrained")
    # two sub-figures, so the bottom panels' labels do not push the per-layer grid's columns apart
    top_fig, bottom_fig = fig.subfigures(2, 1, height_ratios=[1.9 * nrows, max(3.2, 1.1 * nrows + 1.8)])
    gs = top_fig.add_gridspec(nrows, ncols)
    per_token = data.n_tokens is not None
    scale = float(data.n_tokens) if per_token else 1.0
    n_ff_max = max(c.size for c in data.counts)
    positive = [c[c > 0] for c in data.counts]
    lo = min((float(p.min()) for p in positive if p.size), default=1.0) / scale
    hi = max((float(p.max()) for p in positive if p.size), default=1.0) / scale
    colors = _layer_colors(L)

    first = None
    for i, (c, row) in enumerate(zip(data.counts, rows)):
        r, k = divmod(i, ncols)
        ax = top_fig.add_subplot(gs[r, k], sharex=first, sharey=first, label=f"layer {i}")
        first = first or ax
        desc = np.sort(c[c > 0])[::-1]
        rank = np.arange(1, desc.size + 1)
        if desc.size:
            ax.loglog(rank, desc / scale, color=colors[i], lw=1.4)
        slope, intercept, _ = powerlaw_fit(c)
        if slope is not None and desc.size >= 2:
            ax.loglog(rank, np.exp(intercept) * rank ** slope / scale, "--", color="0.35", lw=0.9)
        hot = max(1, math.ceil(0.2 * c.size))
        ax.axvline(hot, color="0.6", ls=":", lw=0.9)
        text = f"slope {slope:.2f}" if slope is not None else "slope -"
        text += f"\ntop 20% carry {row['top20_coverage']:.0%}"
        if row["dead_neurons"]:
            text += f"\n{row['dead_neurons']} never active"
        ax.text(0.04, 0.05, text, transform=ax.transAxes, fontsize=7.5, va="bottom",
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
        ax.set_title(f"layer {i}" + (f"  (sparsity {row['sparsity']:.1%})" if per_token else ""), fontsize=8.5)
        ax.tick_params(which="both", labelsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", lw=0.3, alpha=0.5)
        if k == 0:
            ax.set_ylabel("activation frequency" if per_token else "activation count", fontsize=8)
        else:
            ax.tick_params(which="both", labelleft=False)
        if i + ncols >= L:  # lowest panel of its column
            ax.set_xlabel("neuron rank", fontsize=8)
        else:
            ax.tick_params(which="both", labelbottom=False)
    first.set_xlim(0.8, n_ff_max * 1.25)
    first.set_ylim(lo / 1.6, min(hi * 1.6, 1.05) if per_token else hi * 1.6)
    # y ticks as plain numbers; 1-2-5 steps when the panels span under two decades
    narrow = hi / lo < 100
    first.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if narrow else (1.0,)))
    first.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    first.yaxis.set_minor_formatter(NullFormatter())

    cov_ax, share_ax = bottom_fig.subplots(1, 2)
    cov_ax.set_label("coverage")
    share_ax.set_label("active share")
    _coverage_panel(cov_ax, data, colors, bottom_fig)
    _share_panel(share_ax, data, rows)
    what = f"{data.n_tokens:,} tokens" if per_token else "token count unknown"
    fig.suptitle(f"FFN activation skew per layer: {data.title} ({what}); dashed: power-law fit, "
                 f"dotted: hottest 20% of neurons", fontsize=9.5)
    return fig


def report_axes(fig: Any) -> list[Any]:
    """Every axes of a :func:`plot_report` figure, sub-figures included, in drawing order, once each."""
    out = list(fig.axes)
    for sub in getattr(fig, "subfigs", []):
        out += report_axes(sub)
    return list(dict.fromkeys(out))  # matplotlib versions differ on whether fig.axes holds sub-figures' axes


def _layer_colors(n_layer: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.85 * i / max(n_layer - 1, 1)) for i in range(n_layer)]


def _coverage_panel(ax, data: ReportData, colors: list[Any], fig: Any) -> None:
    for i, c in enumerate(data.counts):
        x, y = coverage_curve(c)
        ax.plot(100 * x, 100 * y, color=colors[i], lw=1.3, label=f"layer {i}")
    ax.plot([0, 100], [0, 100], "--", color="0.5", lw=0.9, label="no skew")
    for pct in (10, 20):
        ax.axvline(pct, color="0.6", ls=":", lw=0.9)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_xlabel("hottest neurons (% of the layer's n_ff)", fontsize=8.5)
    ax.set_ylabel("share of all activations (%)", fontsize=8.5)
    ax.set_title("coverage: activations carried by the hottest x% of neurons", fontsize=9)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, lw=0.3, alpha=0.5)
    if data.n_layer <= _LEGEND_MAX:
        ax.legend(fontsize=7, loc="lower right", ncols=2 if data.n_layer > 4 else 1)
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import LinearSegmentedColormap, Normalize

        cmap = LinearSegmentedColormap.from_list("layers", colors)
        cax = ax.inset_axes([0.9, 0.08, 0.025, 0.45])  # inside the panel: the grid above keeps its columns
        bar = fig.colorbar(ScalarMappable(Normalize(0, data.n_layer - 1), cmap), cax=cax)
        bar.set_label("layer", fontsize=8)
        bar.ax.tick_params(labelsize=7)


def _share_panel(ax, data: ReportData, rows: list[dict[str, Any]]) -> None:
    layers = np.arange(data.n_layer)
    preds = data.predictors
    have_pred = preds is not None and all(p.get("pred_active") is not None and p.get("true_active") is not None
                                          for p in preds)
    if have_pred:
        w = 0.4
        ax.bar(layers - w / 2, [100 * p["true_active"] for p in preds], w, color="0.55", label="truly active")
        ax.bar(layers + w / 2, [100 * p["pred_active"] for p in preds], w, color="C1", label="predicted active")
        handles, labels = ax.get_legend_handles_labels()
        recall = [p.get("recall") for p in preds]
        if all(r is not None for r in recall):
            # the recall line sits above the bars (55-85% of the height), the legend above it
            lo = min(min(recall), 0.999)
            span = (1.0 - lo) / 0.30
            tw = ax.twinx()
            tw.plot(layers, recall, "o-", color="C3", ms=3.5, lw=1.0, label="held-out recall (right axis)")
            tw.set_ylim(lo - 0.55 * span, min(lo + 0.45 * span, 1.0 + 0.03 * span))  # no room above recall 1
            tw.set_ylabel("held-out recall", fontsize=8.5, color="C3")
            tw.tick_params(labelsize=7.5, colors="C3")
            h2, l2 = tw.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, fontsize=7, loc="upper center", ncols=3, frameon=False)
        thr = f", threshold {data.sparse_threshold:g}" if data.sparse_threshold is not None else ""
        ax.set_title(f"predicted vs truly active neurons per token (held-out{thr})", fontsize=9)
        top = max(max(p["pred_active"], p["true_active"]) for p in preds) * 1.4
    elif data.n_tokens is not None:
        ax.bar(layers, [100 * r["active_share"] for r in rows], 0.6, color="0.55", label="active (calibration)")
        ax.set_title("active neurons per token (calibration text)" +
                     ("; predictor config.json records no shares" if preds is not None else ""), fontsize=9)
        top = max(r["active_share"] for r in rows)
    else:
        ax.text(0.5, 0.5, "no token count (powerinfer_stats.json) and no predictor shares",
                ha="center", va="center", transform=ax.transAxes, fontsize=8.5)
        ax.set_title("active neurons per token", fontsize=9)
        top = 1.0 / 1.35
    ax.set_ylim(0, 100 * top * 1.35)
    ax.set_ylabel("share of FFN neurons (%)", fontsize=8.5)
    step = max(1, math.ceil(data.n_layer / 16))
    ax.set_xticks(layers[::step])
    widths = step == 1 and preds is not None and all(p.get("hidden") for p in preds)
    if widths:  # the predictor widths under the layer numbers
        ax.set_xticklabels([f"{i}\nH {p['hidden']}" for i, p in enumerate(preds)])
    ax.set_xlabel("layer (predictor width H)" if widths else "layer", fontsize=8.5)
    ax.set_xlim(-0.6, data.n_layer - 0.4)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, axis="y", lw=0.3, alpha=0.5)


def write_folder_report(act_dir: str | Path, pred_dir: str | Path | None = None,
                        out: str | Path | None = None) -> Path | None:
    """Draw the report of ``act_dir`` (and ``pred_dir``) to ``out`` (default ``act_dir/report.png``).

    Returns the PNG's path, or None when matplotlib is not installed (nothing written;
    callers print :data:`MISSING_MATPLOTLIB`). Raises PowerInferError for bad folders.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    data = load_report_data(act_dir, pred_dir)
    return write_report(data, Path(out) if out is not None else Path(act_dir) / REPORT_FILE)


def write_report(data: ReportData, path: str | Path, dpi: int = 110) -> Path:
    """Draw :func:`plot_report` and save it as a PNG at ``path`` (replaced atomically).

    Raises ImportError without matplotlib.
    """
    from ..formats._atomic import atomic_path

    fig = plot_report(data)
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return path

"""What does ``pi-train-predictor --target-recall`` buy end to end, and what does ``sparse_threshold``?

The measurement behind the default target recall (README, "Predictor width from a target
recall"). On the bundled demo model:

1. For each target recall R (and the budget widths, ``--target-recall 0``), train
   predictors with ``pi-train-predictor`` (a work folder per run, ``OUT/work-R``; a
   finished run is reused), convert them with ``pi-convert`` (f16, as ``recipes/demo.sh``)
   and run ``pi-perplexity -c 256 --compare`` on held-out TinyStories text: perplexity
   with the predictors against dense, and the share of FFN neurons computed.
2. For the default target's predictors, convert again with ``pi-convert
   --sparse-threshold T`` for each threshold T and measure the same, plus the held-out
   recall and predicted-active share at T on the training pass's held-out rows (the
   function ``config.json``'s numbers come from).

Prints per-layer widths / held-out recall / predicted-active share per target, then the
end-to-end and threshold tables (markdown), and writes ``OUT/bench_target_recall.json``.

    python benchmarks/bench_target_recall.py                         # ~20 min on 2 cores
    python benchmarks/bench_target_recall.py --targets 0.95,0.99 --thresholds 0 --chunks 200
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "powerinfer/assets/stories260K-relu"
CALIB = ROOT / "powerinfer/assets/calibration.txt"
HELDOUT = ROOT / "tests/data/text/tinystories_val.txt"


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def train(out: Path, target: float) -> dict:
    """Predictors for ``target`` (0: the budget widths) in OUT/pred-R, reused when already there."""
    name = f"{target:g}" if target else "budget"
    pred, work = out / f"pred-{name}", out / f"work-{name}"
    cfg_path = pred / "config.json"
    if not cfg_path.is_file() or json.loads(cfg_path.read_text()).get("target_recall") != (target or None):
        run(["pi-train-predictor", str(MODEL), "--data", str(CALIB), "--out", str(pred), "--work-dir", str(work),
             "--target-recall", str(target)])
    return dict(name=name, pred=pred, work=work, config=json.loads(cfg_path.read_text()))


def compare(gguf: Path, chunks: int | None) -> dict:
    """``pi-perplexity --compare``'s table: PPL and neurons computed for dense, predictor and oracle."""
    cmd = ["pi-perplexity", "-m", str(gguf), "-f", str(HELDOUT), "-c", "256", "--compare"]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    text = run(cmd)
    rows = {}
    for m in re.finditer(r"^(dense|predictor|oracle)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)%", text, re.M):
        rows[m[1]] = dict(ppl=float(m[2]), err=float(m[3]), computed=float(m[5]) / 100)
    if set(rows) != {"dense", "predictor", "oracle"}:
        sys.exit(f"could not read the --compare table from:\n{text[-1500:]}")
    return rows


def convert(pred: Path, outfile: Path, threshold: float | None = None) -> Path:
    cmd = ["pi-convert", str(MODEL), str(pred), "--outfile", str(outfile)]
    if threshold is not None:
        cmd += ["--sparse-threshold", str(threshold)]
    run(cmd)
    return outfile


def heldout_at(work: Path, pred: Path, n_layer: int, threshold: float) -> list[dict]:
    from powerinfer.formats.collected import CollectedData
    from powerinfer.formats.predictor import load_predictor_dir
    from powerinfer.train_predictor.train import heldout_metrics

    data = CollectedData.open(work)
    preds = load_predictor_dir(pred, n_layer, data.n_embd, data.n_ff)
    return [heldout_metrics(p, data.inputs("heldout", i), data.masks("heldout", i), data.n_ff, threshold)
            for i, p in enumerate(preds)]


def main() -> None:
    from powerinfer.train_predictor.search import DEFAULT_TARGET_RECALL

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out/recall")
    ap.add_argument("--targets", default="0.95,0.99,0.995", help="comma-separated; 0 = the budget widths")
    ap.add_argument("--thresholds", default="-1,0,1")
    ap.add_argument("--chunks", type=int, default=None, help="pi-perplexity --chunks (default: the whole text)")
    ap.add_argument("--no-budget", action="store_true", help="skip the budget-width baseline")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    targets = [float(t) for t in args.targets.split(",")] + ([] if args.no_budget else [0.0])
    results: dict = dict(targets=[], thresholds=[])

    print("\n## per layer: width / held-out recall / predicted-active share (true share in brackets)")
    for t in targets:
        r = train(args.out, t)
        cfg = r["config"]
        ppl = compare(convert(r["pred"], args.out / f"{r['name']}.powerinfer.gguf"), args.chunks)
        layers = [dict(layer=l["layer"], hidden=l["hidden"], recall=l["recall"], pred_active=l["pred_active"],
                       true_active=l["true_active"], stop=l.get("stop"), cap=l.get("cap")) for l in cfg["layers"]]
        results["targets"].append(dict(target=t or None, layers=layers, predictor_params=cfg["predictor_params"],
                                       train_seconds=cfg["seconds"]["train"], perplexity=ppl))
        print(f"{r['name']:>7}: " + "  ".join(f"{l['hidden']}/{l['recall']:.4f}/{l['pred_active']:.3f}"
                                               f"[{l['true_active']:.3f}]" + (f" ({l['stop']})" if l["stop"] else "")
                                               for l in layers), flush=True)

    print("\n| target recall | widths | predictor params | training s | PPL (dense) | PPL predictor | vs dense "
          "| FFN neurons computed (oracle) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for r in results["targets"]:
        p = r["perplexity"]
        delta = p["predictor"]["ppl"] / p["dense"]["ppl"] - 1
        print(f"| {r['target'] or 'budget (0)'} | {' / '.join(str(l['hidden']) for l in r['layers'])} | "
              f"{r['predictor_params']:,} | {r['train_seconds']:.0f} | {p['dense']['ppl']:.4f} | "
              f"{p['predictor']['ppl']:.4f} | {delta:+.3%} | {p['predictor']['computed']:.1%} "
              f"({p['oracle']['computed']:.1%}) |")

    base = train(args.out, DEFAULT_TARGET_RECALL)
    n_layer = base["config"]["n_layer"]
    print(f"\n## sparse_threshold, predictors of --target-recall {DEFAULT_TARGET_RECALL}")
    print("| threshold | held-out recall per layer | predicted active per layer | PPL predictor | vs dense "
          "| FFN neurons computed |")
    print("|--:|---|---|--:|--:|--:|")
    for thr in (float(t) for t in args.thresholds.split(",")):
        ms = heldout_at(base["work"], base["pred"], n_layer, thr)
        ppl = compare(convert(base["pred"], args.out / f"thr{thr:g}.powerinfer.gguf", thr), args.chunks)
        delta = ppl["predictor"]["ppl"] / ppl["dense"]["ppl"] - 1
        results["thresholds"].append(dict(threshold=thr, layers=ms, perplexity=ppl))
        recalls = " / ".join(f"{m['recall']:.4f}" for m in ms)
        shares = " / ".join(f"{m['pred_active']:.3f}" for m in ms)
        print(f"| {thr:g} | {recalls} | {shares} | {ppl['predictor']['ppl']:.4f} | "
              f"{delta:+.3%} | {ppl['predictor']['computed']:.1%} |", flush=True)
    (args.out / "bench_target_recall.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

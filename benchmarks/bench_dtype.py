"""How much does the calibration dtype change what the stages measure? (bf16 / f16 vs f32)

The figure behind ``pi-profile``'s CPU default dtype (f32; bf16 on a GPU). For the demo
model and every family's small test model it runs the layer-streamed pass over the same
calibration batches in f32 and in each other dtype, then prints per model:

* ``count_dev``: sum over neurons of |count_bf16 - count_f32| / sum of f32 counts (the share
  of (token, neuron) activation decisions that flip), mean and max over layers;
* ``sparsity``: mean sparsity in each dtype;
* ``hot_overlap``: overlap of the hottest 20% of neurons per layer (what placement uses);
* with ``--recall``: held-out recall and predicted-active share of predictors trained on
  the f32 data vs on the other dtype's data, both scored on the f32 held-out rows.

    python benchmarks/bench_dtype.py                 # demo + families, bf16 vs f32
    python benchmarks/bench_dtype.py --recall        # also predictor recall (slower)

The families' models are random (tests/family_models.py), built in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DEMO = ROOT / "powerinfer" / "assets" / "stories260K-relu"
DEMO_TEXT = ROOT / "powerinfer" / "assets" / "calibration.txt"


def run(model_dir: Path, text: Path, work: Path, dtype: torch.dtype, caps: dict, pairs: bool):
    from powerinfer.calibrate.plan import build_plan
    from powerinfer.calibrate.stream import stream_calibration
    from powerinfer.hf import load_hf_tokenizer, resolve_model

    family, _, act = resolve_model(model_dir)
    plan = build_plan(str(text), load_hf_tokenizer(model_dir), caps, 128, 8)
    return stream_calibration(model_dir, family, act, plan, work, {"bench": "dtype"}, dtype=dtype, pairs=pairs)


def recall_of(data, ref, hidden: int) -> tuple[float, float]:
    """Train layer predictors on ``data``'s train rows, score them on ``ref``'s held-out rows."""
    from powerinfer.train_predictor.train import TrainSettings, heldout_metrics, train_layer

    rs, ps = [], []
    with tempfile.TemporaryDirectory() as w:
        for i in range(data.n_layer):
            pred, _ = train_layer(data, i, hidden, TrainSettings(epochs=10, batch_size=512, patience=3), w)
            m = heldout_metrics(pred, ref.inputs("heldout", i), ref.masks("heldout", i), ref.n_ff)
            rs.append(m["recall"])
            ps.append(m["pred_active"])
    return float(np.mean(rs)), float(np.mean(ps))


def compare(name: str, model_dir: Path, text: Path, tmp: Path, other: str, with_recall: bool) -> dict:
    from powerinfer.calibrate.stream import DTYPES

    caps = {"train": 8192, "heldout": 2048} if with_recall else {"all": 8192}
    a = run(model_dir, text, tmp / f"{name}-f32", torch.float32, caps, with_recall)
    b = run(model_dir, text, tmp / f"{name}-{other}", DTYPES[other], caps, with_recall)
    ca, cb = a.all_counts(), b.all_counts()
    dev = [float((x - y).abs().sum() / x.sum()) for x, y in zip(ca, cb)]
    n_tok = sum(a.n_tokens.values())
    sp = lambda cs: float(np.mean([1 - float(c.sum()) / (n_tok * c.numel()) for c in cs]))  # noqa: E731
    k = max(1, int(0.2 * a.n_ff))
    overlap = [len(set(torch.topk(x.float(), k).indices.tolist()) & set(torch.topk(y.float(), k).indices.tolist())) / k
               for x, y in zip(ca, cb)]
    row = dict(model=name, dtype=other, count_dev_mean=float(np.mean(dev)), count_dev_max=float(np.max(dev)),
               sparsity_f32=sp(ca), sparsity_other=sp(cb), hot20_overlap=float(np.mean(overlap)))
    if with_recall:
        hidden = max(16, min(2 * a.n_embd, 128))
        row["recall_f32"], row["pred_active_f32"] = recall_of(a.collected, a.collected, hidden)
        row["recall_other"], row["pred_active_other"] = recall_of(b.collected, a.collected, hidden)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--recall", action="store_true", help="also train predictors on each dtype's rows")
    ap.add_argument("--models", default="demo,relu_llama,prosparse,bamboo,falcon,opt")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from family_models import BUILDERS

    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        text = tmp / "text.txt"
        text.write_text(DEMO_TEXT.read_text())
        for name in args.models.split(","):
            model_dir = DEMO if name == "demo" else BUILDERS[name](tmp / f"{name}-hf")
            rows.append(compare(name, model_dir, text, tmp, args.dtype, args.recall))
            r = rows[-1]
            line = (f"{name:11s} {args.dtype}: counts differ by {r['count_dev_mean']:.2%} (max layer "
                    f"{r['count_dev_max']:.2%}), sparsity {r['sparsity_f32']:.4f} -> {r['sparsity_other']:.4f}, "
                    f"hottest-20% overlap {r['hot20_overlap']:.3f}")
            if args.recall:
                line += (f", recall {r['recall_f32']:.4f} -> {r['recall_other']:.4f}, predicted active "
                         f"{r['pred_active_f32']:.4f} -> {r['pred_active_other']:.4f}")
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What do f16, Q8_0 and Q4_0 predictor weights cost in prediction quality?

The figure behind ``pi-convert --predictor-type``'s default for quantized files. For each
layer it takes the trained predictor (``PRED_DIR/model_{i}.pt``), round-trips ``fc1`` and
``fc2`` through each type exactly as a written file stores them (f16 rounding, or ggml's
Q8_0 / Q4_0 quantizer then dequantization; a matrix whose rows are not a multiple of 32
stays f16, as in the file), and scores it on the held-out rows the training pass kept
(``WORK/collect/heldout_*``) with the same function and threshold ``pi-train-predictor``
reports (:func:`powerinfer.train_predictor.train.heldout_metrics`, ``logits >= threshold``).

Printed per layer and type: held-out recall (share of truly active neurons predicted
active), predicted-active share (neurons the sparse FFN computes), and ``flips``: the
share of (token, neuron) decisions that differ from the f32 predictor's.

    bash recipes/demo.sh                              # once: writes out/demo
    python benchmarks/bench_predictor_quant.py        # out/demo/predictor + out/demo/predictor-work
    python benchmarks/bench_predictor_quant.py --pred P --work W [--threshold T]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("f32", "f16", "q8_0", "q4_0", "q8_0/q4_0", "q4_0/q8_0")  # "A/B": fc1 in A, fc2 in B


def round_trip(w: torch.Tensor, name: str, qtype: str) -> torch.Tensor:
    """``w`` as the file would hold it in ``qtype`` (the writers' own type rule), back in fp32."""
    from powerinfer.convert.tensor_types import tensor_type
    from powerinfer.quant import ggml

    if qtype == "f32":
        return w
    qt = tensor_type(name, tuple(w.shape), "f16", predictor_type=qtype).name.lower()
    if qt == "f16":
        return w.half().float()
    a = w.numpy().astype(np.float32)
    return torch.from_numpy(ggml.dequantize(ggml.quantize(a, qt, name), qt, a.shape))


def decisions(pred, x: np.ndarray, threshold: float, chunk: int = 4096) -> np.ndarray:
    out = []
    for s in range(0, x.shape[0], chunk):
        xb = torch.from_numpy(np.asarray(x[s:s + chunk], dtype=np.float32))
        out.append((pred.logits(xb) >= threshold).numpy())
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pred", type=Path, default=ROOT / "out/demo/predictor")
    ap.add_argument("--work", type=Path, default=ROOT / "out/demo/predictor-work")
    ap.add_argument("--threshold", type=float, default=None, help="default: the predictor folder's config.json")
    args = ap.parse_args()

    from powerinfer.formats.collected import CollectedData
    from powerinfer.formats.predictor import LayerPredictor, load_predictor_dir, read_predictor_config
    from powerinfer.train_predictor.train import heldout_metrics

    torch.set_num_threads(1)
    data = CollectedData.open(args.work)
    if data is None or "heldout" not in data.n_tokens:
        sys.exit(f"{args.work}: no complete collected data with a held-out split (run recipes/demo.sh)")
    thr = args.threshold if args.threshold is not None else float(read_predictor_config(args.pred).get("sparse_threshold", 0.0))
    preds = load_predictor_dir(args.pred, data.n_layer, data.n_embd, data.n_ff)
    print(f"{args.pred}: {data.n_layer} layers, n_embd {data.n_embd}, n_ff {data.n_ff}, hidden "
          f"{[p.hidden for p in preds]}, {data.n_tokens['heldout']} held-out tokens, threshold {thr}")
    head = f"{'layer':>5} {'true':>6} | " + " | ".join(f"{t:>9} recall / pred / flips" for t in TYPES)
    print(head)
    print("-" * len(head))
    worst = {t: 0.0 for t in TYPES}
    extra = {t: 0.0 for t in TYPES}
    for i, lp in enumerate(preds):
        x, m = data.inputs("heldout", i), data.masks("heldout", i)
        ref = decisions(lp, x, thr)
        cells, base = [], None
        for t in TYPES:
            t1, t2 = t.split("/") if "/" in t else (t, t)
            q = LayerPredictor(round_trip(lp.fc1, f"blk.{i}.fc1.weight", t1), round_trip(lp.fc2, f"blk.{i}.fc2.weight", t2))
            h = heldout_metrics(q, x, m, data.n_ff, thr)
            flips = float((decisions(q, x, thr) != ref).mean())
            base = base or h
            worst[t] = max(worst[t], base["recall"] - h["recall"])
            extra[t] = max(extra[t], h["pred_active"] - base["pred_active"])
            cells.append(f"{h['recall']:.4f} / {h['pred_active']:.4f} / {flips:.5f}")
        print(f"{i:>5} {base['true_active']:>6.4f} | " + " | ".join(f"{c:>30}" for c in cells))
    print("worst recall loss vs f32:      " + ", ".join(f"{t} {worst[t]:+.4f}" for t in TYPES[1:]))
    print("largest predicted-active gain: " + ", ".join(f"{t} {extra[t]:+.4f}" for t in TYPES[1:]))


if __name__ == "__main__":
    main()

"""Batched decoding: the sparse FFN over a batch as union rows against per-sequence rows, and
the whole batched step against one sequence alone.

    flock /tmp/pi-bench.lock python benchmarks/bench_batch_ffn.py -m out/bench/bench-q4_0.powerinfer.gguf -t 2

For each batch size ``B`` (1, 2, 4, 8 by default) it prefills ``B`` different prompts (real
text from tests/data, a different slice per sequence), then times ``--steps`` batched decode
steps with the FFNs as per-sequence one-call rows and as union rows, the two modes
alternating ``--rounds`` times (medians). It prints per mode the FFN milliseconds per step
(all layers), the whole step's milliseconds, the aggregate tokens/s (``B`` / step), and the
union's size against the sum of the sequences' predicted-active sets (the rows a union step
reads against the rows the per-sequence steps read), and where each step's time goes: the
dense products (QKV, attention output, output head), the predictors, the FFN rows, attention over
the caches, the rest. Also checks that both modes give the same tokens (they give the same logits
bit for bit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from powerinfer.runtime import batch, kernels  # noqa: E402
from powerinfer.runtime.loading import load_model  # noqa: E402

TEXT = ROOT / "tests" / "data" / "text" / "tinystories_sample.txt"


def run(model, dec: batch.BatchDecoder, prompts, steps: int):
    """(seconds per step, FFN seconds per step, the tokens of every step, {part: seconds per step})
    over ``steps`` steps; the parts: dense products (QKV, attention output, output head), predictors,
    FFN rows (FFN less predictors), attention over the caches."""
    caches = [batch.new_cache(model, 512) for _ in prompts]
    toks = [int(batch.prefill(model, c, p, 0).argmax()) for c, p in zip(caches, prompts)]
    pos = [len(p) for p in prompts]
    out = [list(toks)]
    f0 = dec.stats["t_union"] + dec.stats["t_per-seq"]
    d0, a0, p0 = dec.stats["t_dense"], dec.stats["t_attend"], sum(layer.ffn.t_predict for layer in model.layers)
    t0 = time.perf_counter()
    for _ in range(steps):
        lg = dec.step(toks, caches, pos)
        toks = [int(t) for t in lg.argmax(-1)]
        pos = [p + 1 for p in pos]
        out.append(toks)
    dt = time.perf_counter() - t0
    ffn = dec.stats["t_union"] + dec.stats["t_per-seq"] - f0
    pred = sum(layer.ffn.t_predict for layer in model.layers) - p0
    parts = {"dense": dec.stats["t_dense"] - d0, "predictors": pred, "FFN rows": ffn - pred,
             "attention": dec.stats["t_attend"] - a0}
    parts["rest"] = dt - sum(parts.values())
    return dt / steps, ffn / steps, out, {k: v / steps for k, v in parts.items()}


def union_share(model, prompts) -> tuple[float, float]:
    """Mean over layers of (|union of predicted-active sets| / n_ff, sum of the sets' sizes / n_ff)
    for the last prompt token of each sequence (hidden states from a prefill)."""
    hs = []
    for p in prompts:  # the residual entering each layer's FFN, at the last prompt position
        cache = batch.new_cache(model, 512)
        got = {}

        def hook(i, h, xn, got=got):
            got[i] = h[-1:].clone()
            return None
        saved = model.mask_fn
        model.mask_fn = lambda i, h, xn: (hook(i, h, xn), model.layers[i].ffn.predict(h))[1]
        try:
            batch.prefill(model, cache, p, 0)
        finally:
            model.mask_fn = saved
        hs.append(got)
    u = s = 0.0
    n_ff = model.args.n_ff
    for i, layer in enumerate(model.layers):
        masks = torch.cat([layer.ffn.predict(h[i]) for h in hs])  # [B, F]
        u += masks.any(0).sum().item() / n_ff
        s += masks.sum().item() / n_ff
    return u / len(model.layers), s / len(model.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="out/bench/bench-q4_0.powerinfer.gguf")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-b", "--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels.backend()
    model, tok = load_model(args.model, "auto")
    text = TEXT.read_text()
    print(f"{args.model}: {model.args.n_layer} layers, n_embd {model.args.n_embd}, n_ff {model.args.n_ff}; "
          f"{args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        prompts = [tok.encode(text[400 * i: 400 * i + 300])[:args.prompt_len] for i in range(B)]
        us, ss = union_share(model, prompts)
        res = {"per-seq": [], "union": []}
        toks = {}
        modes = ["per-seq", "union"] if B > 1 else ["per-seq"]
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                step, ffn, out, parts = run(model, batch.BatchDecoder(model, mode), prompts, args.steps)
                res[mode].append((step, ffn, parts))
                toks[mode] = out
        same = len({str(v) for v in toks.values()}) == 1
        for mode in modes:
            step = statistics.median(s for s, _, _ in res[mode])
            ffn = statistics.median(f for _, f, _ in res[mode])
            parts = {k: statistics.median(p[k] for _, _, p in res[mode]) for k in res[mode][0][2]}
            rows.append((B, mode, ffn * 1e3, step * 1e3, B / step, us, ss, same, parts))
            print(f"B={B} {mode:8s}: FFN {ffn * 1e3:7.1f} ms/step, step {step * 1e3:7.1f} ms, {B / step:6.2f} tok/s, "
                  f"union {us:.1%} of n_ff vs summed {ss:.1%}, same tokens: {same}", flush=True)
    print("\n| B | FFN mode | FFN ms/step | step ms | aggregate tok/s | union rows | summed rows |")
    print("|---|---|---|---|---|---|---|")
    for B, mode, f, s, tps, us, ss, _, _ in rows:
        print(f"| {B} | {mode} | {f:.1f} | {s:.1f} | {tps:.2f} | {us:.1%} | {ss:.1%} |")
    names = list(rows[0][8])
    print("\nWhere a step's time goes (ms per step; dense: QKV, attention output and output head for the "
          "whole batch; rest: embedding, norms, residuals, Python):")
    print("| B | FFN mode | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for B, mode, *_, parts in rows:
        print(f"| {B} | {mode} | " + " | ".join(f"{parts[k] * 1e3:.1f}" for k in names) + " |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

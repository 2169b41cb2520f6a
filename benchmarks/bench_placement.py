"""Benchmark the neuron placement solver on a 70B-shaped problem.

ReluLLaMA-70B: 80 layers x 28672 FFN neurons, n_embd 8192, gated, f16 -> 48 KiB per neuron
(105 GiB of FFN weights). Activation counts are synthetic power laws: layer l's neuron of
rank r fires with probability ``p_l * (r + 1) ** -alpha_l`` (alpha in [0.5, 1.1], shuffled
over neurons), counted over 100k calibration tokens. For several VRAM budgets it prints the
solver time, method and status, neurons placed and the expected share of activations served
by the GPU, without and with a per-layer minimum share; with a minimum the same problem is
also forced through HiGHS (``method="milp"``) as a cross-check of time and answer.

    python benchmarks/bench_placement.py [--chunk 64] [--seed 0] [--time-limit 30]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from powerinfer.convert.placement import neuron_bytes, place_neurons

N_LAYER, N_FF, N_EMBD, TOKENS = 80, 28672, 8192, 100_000


def power_law_counts(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(N_LAYER):
        alpha = rng.uniform(0.5, 1.1)
        p = rng.uniform(0.3, 0.9) * (np.arange(N_FF) + 1.0) ** -alpha
        out.append(rng.binomial(TOKENS, rng.permutation(p)).astype(np.int64))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    counts = power_law_counts(args.seed)
    nb = neuron_bytes(N_EMBD, "f16", gated=True)
    print(f"70B-shaped problem: {N_LAYER} x {N_FF} neurons, {nb} bytes/neuron, "
          f"{N_LAYER * N_FF * nb / 2**30:.1f} GiB of FFN, chunk {args.chunk} "
          f"(counts generated in {time.perf_counter() - t0:.1f} s)")
    print(f"{'budget':>8} {'min share':>9} {'time s':>7} {'method':>7} {'status':>10} {'neurons':>9} {'GPU-served':>10}"
          f" {'HiGHS s':>8} {'HiGHS status':>12}")
    worst = {0: 0.0, 1: 0.0}
    worst_milp = 0.0
    for gib in (4, 16, 24, 40, 64, 96):
        for share in (0.0, 0.1, 0.25, 0.5):
            t = time.perf_counter()
            p = place_neurons(counts, gib * 2**30, nb, chunk=args.chunk, min_share=share, time_limit=args.time_limit)
            dt = time.perf_counter() - t
            worst[share > 0] = max(worst[share > 0], dt)
            milp = ""
            if share > 0:  # the same problem forced through HiGHS, as a cross-check
                t = time.perf_counter()
                m = place_neurons(counts, gib * 2**30, nb, chunk=args.chunk, min_share=share,
                                  method="milp", time_limit=args.time_limit)
                dm = time.perf_counter() - t
                worst_milp = max(worst_milp, dm)
                same = "" if abs(m.info.objective - p.info.objective) <= 1e-9 * p.info.objective else " DIFFERS"
                milp = f" {dm:>8.2f} {m.info.status:>12}{same}"
            print(f"{gib:>5}GiB {share:>9.2f} {dt:>7.2f} {p.info.method:>7} {p.info.status:>10} "
                  f"{p.used:>9} {p.served_total:>10.1%}{milp}")
    print(f"slowest solve: {worst[0]:.2f} s without a per-layer minimum, {worst[1]:.2f} s with one "
          f"(HiGHS forced: {worst_milp:.2f} s)")


if __name__ == "__main__":
    main()

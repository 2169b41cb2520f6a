"""This CPU's GEMM throughput on the matmuls of one 7B decoder layer at calibration batch sizes.

Calibration (``pi-profile``, ``pi-train-predictor``) runs every calibration token
through each decoder layer: per layer and token that is ``2 * params_per_layer`` FLOPs
of GEMM (``params_per_layer = 4*4096*4096 + 3*4096*11008`` for Llama-2-7B: q, k, v, o
and gate, up, down), plus attention and elementwise work that is small next to it at
these sequence lengths. So this CPU's GEMM FLOP/s bounds the calibration speed:
``calibration tokens/s per 7B layer <= FLOP/s / (2 * params_per_layer)``, and a full
32-layer pass is 32 times slower again.

Measured: ``torch.nn.functional.linear(x, W)`` with ``x`` ``[M, K]`` and ``W`` ``[N, K]``
(a HF ``nn.Linear``) for the three weight shapes of a layer ([4096x4096] four times,
[11008x4096] twice, [4096x11008] once) at M = 1024, 2048, 4096 tokens, in f32 and
bf16, on 1 and 2 threads (``torch.set_num_threads``). Each case runs once to warm up,
then repeats until ``--min-time`` seconds have passed (at least ``--reps`` times); the
best time counts. The layer figure is the layer's total FLOPs over the summed best
times of its seven matmuls.

bf16 on a CPU without bf16 instructions (AVX2 only: no AVX512-BF16 or AMX) is
emulated and very slow (~10 GFLOP/s a core, a few seconds per call at M = 1024), so
each bf16 shape is timed once per thread count, with a single repetition (after a
warm-up on 16 rows) at ``--bf16-m`` rows (default 256; its rate hardly depends on M),
and that rate stands for every M (marked ``~`` where M differs). That call is skipped,
and the shape's bf16 rate taken as the f32 one divided by 8 (also ``~``), if the f32
figure predicts it would take over ``--bf16-cap`` seconds; the whole bf16 part then
stays under ~10 s per thread count.

Timings need the cores to themselves: close other busy processes first (see
benchmarks/README.md); the load average is printed with the table.

    python benchmarks/bench_gemm.py                       # f32 and bf16, 1 and 2 threads
    python benchmarks/bench_gemm.py --dtypes f32 --json out/gemm.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

N_EMBD, N_FF = 4096, 11008
SHAPES = [  # (label, N, K, uses per layer)
    ("attn 4096x4096", N_EMBD, N_EMBD, 4),
    ("gate/up 11008x4096", N_FF, N_EMBD, 2),
    ("down 4096x11008", N_EMBD, N_FF, 1),
]
PARAMS_PER_LAYER = sum(n * k * uses for _, n, k, uses in SHAPES)  # 4*4096*4096 + 3*4096*11008
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def cpu_info() -> dict:
    """What torch runs its GEMMs with here: ISA level, BLAS/oneDNN, relevant CPU flags."""
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    cfg = torch.__config__.show()
    blas = [m.group(0) for m in re.finditer(r"\b(BLAS_INFO|USE_MKLDNN|USE_OPENMP)=\w+", cfg)]
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "blas": ", ".join(blas) or "?",
        "isa_flags": sorted(f for f in flags if f in {"avx2", "fma", "f16c", "avx512f", "avx512_bf16",
                                                         "avx512_vnni", "amx_bf16", "amx_tile"}),
    }


def time_linear(m: int, n: int, k: int, dtype: torch.dtype, reps: int, min_time: float,
                warm_m: int | None = None) -> float:
    """Best seconds of ``F.linear`` ``[m, k] x [n, k]^T`` over the repetitions, after one warm-up call
    (on the first ``warm_m`` rows when given)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    with torch.inference_mode():
        F.linear(x[:warm_m] if warm_m else x, w)  # warm-up: allocations, kernel selection
        best, spent, done = float("inf"), 0.0, 0
        while done < reps or spent < min_time:
            t0 = time.perf_counter()
            F.linear(x, w)
            dt = time.perf_counter() - t0
            best, spent, done = min(best, dt), spent + dt, done + 1
    return best


BF16_SLOWDOWN_GUESS = 8.0  # f32 / bf16 GFLOP/s on AVX2, used only where the bf16 call would pass the cap


def bf16_rate(n: int, k: int, rows: int, f32_gflops: float | None, cap: float) -> tuple[float, bool]:
    """bf16 GFLOP/s of one shape from a single call on ``rows`` rows, or (guessed from f32, True)
    when that call would take over ``cap`` seconds."""
    flops = 2.0 * rows * n * k
    if f32_gflops is not None and flops / (f32_gflops / BF16_SLOWDOWN_GUESS * 1e9) > cap:
        return f32_gflops / BF16_SLOWDOWN_GUESS, True
    return flops / time_linear(rows, n, k, torch.bfloat16, 1, 0.0, warm_m=16) / 1e9, False


def run(threads: list[int], dtypes: list[str], ms: list[int], reps: int, min_time: float, bf16_m: int,
        bf16_cap: float) -> list[dict]:
    """One row per (threads, dtype, M): GFLOP/s per shape and for the whole layer."""
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        f32: dict[str, float] = {}  # shape -> best f32 GFLOP/s over M at this thread count
        bf16: dict[str, tuple[float, bool]] = {}  # shape -> (GFLOP/s, guessed), measured once
        for dn in dtypes:
            for m in ms:
                row = {"threads": nt, "dtype": dn, "M": m, "gflops": {}, "estimated": []}
                layer_flops = layer_time = 0.0
                for label, n, k, uses in SHAPES:
                    flops = 2.0 * m * n * k
                    if dn == "f32":
                        g = flops / time_linear(m, n, k, torch.float32, reps, min_time) / 1e9
                        f32[label] = max(f32.get(label, 0.0), g)
                    else:
                        if label not in bf16:
                            bf16[label] = bf16_rate(n, k, bf16_m, f32.get(label), bf16_cap)
                        g, guessed = bf16[label]
                        if guessed or m != bf16_m:
                            row["estimated"].append(label)
                    row["gflops"][label] = g
                    layer_flops += uses * flops
                    layer_time += uses * flops / (g * 1e9)
                row["layer_gflops"] = layer_flops / layer_time / 1e9
                row["tokens_per_s_per_layer"] = row["layer_gflops"] * 1e9 / (2.0 * PARAMS_PER_LAYER)
                rows.append(row)
                print_row(row)
    return rows


def print_header() -> None:
    cols = "".join(f"{label:>20}" for label, *_ in SHAPES)
    print(f"{'thr':>3} {'dtype':>5} {'M':>5}{cols}{'layer GF/s':>12}{'tok/s/layer':>13}{'s/64k tok x32':>15}")


def print_row(r: dict) -> None:
    cells = "".join(f"{('~' if lb in r['estimated'] else '') + format(r['gflops'][lb], '.1f'):>20}"
                    for lb, *_ in SHAPES)
    tps = r["tokens_per_s_per_layer"]
    print(f"{r['threads']:>3} {r['dtype']:>5} {r['M']:>5}{cells}{r['layer_gflops']:>12.1f}{tps:>13.0f}"
          f"{65536 * 32 / tps:>15.0f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    ap.add_argument("--dtypes", default="f32,bf16", help="f32 and/or bf16 (default both)")
    ap.add_argument("--m", default="1024,2048,4096", help="tokens per GEMM, comma-separated")
    ap.add_argument("--reps", type=int, default=2, help="minimum timed repetitions (f32)")
    ap.add_argument("--min-time", type=float, default=1.0, help="minimum timed seconds per case (f32)")
    ap.add_argument("--bf16-m", type=int, default=256, help="rows of the single timed bf16 call per shape")
    ap.add_argument("--bf16-cap", type=float, default=10.0,
                    help="skip a bf16 call the f32 rate predicts to take longer than this (s)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)

    info = cpu_info()
    print(f"cpu: {info['cpu']} ({info['cpu_count']} cpus), flags: {' '.join(info['isa_flags'])}")
    print(f"torch {info['torch']}: cpu capability {info['cpu_capability']}, mkldnn {info['mkldnn']}, "
          f"mkl {info['mkl']}; {info['blas']}")
    print(f"params per 7B layer: {PARAMS_PER_LAYER:,} (2x that = FLOPs per calibration token per layer)")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"GFLOP/s per weight shape (f32: best of the repetitions; bf16: one call at M={a.bf16_m}, "
          f"~ = used for another M or guessed), the layer's GFLOP/s, the calibration tokens/s per 7B layer "
          f"it allows, and the seconds 65536 tokens through 32 layers would take at that rate")
    print_header()
    t0 = time.time()
    rows = run([int(t) for t in a.threads.split(",")], a.dtypes.split(","), [int(m) for m in a.m.split(",")],
               a.reps, a.min_time, a.bf16_m, a.bf16_cap)
    load = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load)}; {time.time() - t0:.0f} s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"info": info, "params_per_layer": PARAMS_PER_LAYER,
                                      "shapes": [{"label": lb, "N": n, "K": k, "uses": u} for lb, n, k, u in SHAPES],
                                      "rows": rows, "loadavg_after": load}, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()

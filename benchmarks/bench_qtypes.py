"""Dense one-token (and few-token) products per quant type, per byte: how fast each type's kernel
streams a big matrix, against Q4_0's 8-row-interleaved (``x8``) path.

For each type a random ``[N, K]`` matrix (default 4096 x 14336, an 8B Llama 3's ``ffn_down``:
~33 MB in Q4_K, larger than the caches, so a product reads it from memory) is multiplied by
``T`` tokens with ``kernels.linear`` (Q4_0/Q8_0 in the ``x8`` layout the runtime gives dense
matrices, the other types in the file's row layout, as loaded). Engines are interleaved: each
round runs every (build, type) once, ``--reps`` rounds, and the best of ``--calls`` calls per
round counts; the table gives the median over rounds of ns per row and GB/s (matrix bytes over
time), and the ratio to Q4_0 x8 in the same build and thread count. One thread is timed in this
thread's CPU time (``time.thread_time``: a shared machine's preemptions left out), more threads in
wall time. The matrices fit in a big L3 (480 MB on the Xeon measured), so the figures compare the
kernels' work per byte more than memory bandwidth.

Builds: ``native`` (``-march=native``) and, with ``--avx2`` (default on), ``haswell``
(``POWERINFER_MARCH=haswell``: AVX2 + FMA + F16C, no AVX-512), the code an AVX2-only CPU runs;
both loaded in this one process and interleaved.

    python benchmarks/bench_qtypes.py                          # 1 and 2 threads, T = 1
    python benchmarks/bench_qtypes.py --tokens 1 4 --threads 1 --json out/qtypes.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer.quant.qweight import MAPPED_TYPES, QWeight  # noqa: E402
from powerinfer.runtime import kernels  # noqa: E402

TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]
HALF_SCALES = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def random_weight(name: str, n: int, k: int, seed: int = 0) -> QWeight:
    """Random quant bytes with finite fp16 scales (speed does not depend on the values)."""
    bt = MAPPED_TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, bt.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(n, -1, bt.nbytes)
    for off in HALF_SCALES[name]:
        blocks[:, :, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return QWeight(torch.from_numpy(raw), bt, n, k)


def _haswell_build(qsource: Path | None = None):
    """The AVX2-only build, of ``qsource`` in place of ``qkernels.c`` when given."""
    saved, saved_src = os.environ.get("POWERINFER_MARCH"), kernels.QSOURCE
    os.environ["POWERINFER_MARCH"] = "haswell"
    kernels.QSOURCE = qsource or saved_src
    try:
        return kernels._build()
    finally:
        kernels.QSOURCE = saved_src
        if saved is None:
            os.environ.pop("POWERINFER_MARCH")
        else:
            os.environ["POWERINFER_MARCH"] = saved


def load_builds(avx2: bool, others: list[Path] = ()) -> dict:
    kernels.set_backend("c")
    builds = {"native": kernels._state["lib"]}
    if avx2:
        builds["avx2"] = _haswell_build()
    for i, src in enumerate(others):  # another qkernels.c (e.g. an older commit's), AVX2 build, same ABI
        builds[f"other{i}"] = _haswell_build(src)
    return builds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="rows N")
    ap.add_argument("--k", type=int, default=14336, help="values per row K (a multiple of 256)")
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=5, help="calls per round (best counts)")
    ap.add_argument("--no-avx2", dest="avx2", action="store_false", help="only the -march=native build")
    ap.add_argument("--other", type=Path, nargs="*", default=[],
                    help="other qkernels.c sources (e.g. `git show REV:powerinfer/runtime/qkernels.c > old.c`), "
                         "built AVX2-only and interleaved as builds other0, other1, ...")
    ap.add_argument("--no-native", dest="native", action="store_false", help="leave the -march=native build out")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    builds = load_builds(a.avx2, a.other)
    if not a.native:
        builds.pop("native")
    ws = {}
    for t in a.types:
        w = random_weight(t, a.n, a.k)
        ws[t] = kernels.for_dense_products(w)  # x8 for Q4_0/Q8_0, as dense matrices are loaded
    x = {T: torch.randn(T, a.k) for T in a.tokens}
    times: dict = {}
    for nt in a.threads:
        torch.set_num_threads(nt)
        for _ in range(a.reps):
            for bname, lib in builds.items():
                kernels._state["lib"] = lib
                for T in a.tokens:
                    for t, w in ws.items():
                        kernels.linear(x[T], w)  # warm
                        best = float("inf")
                        clock = time.thread_time if nt == 1 else time.perf_counter
                        for _ in range(a.calls):
                            t0 = clock()
                            kernels.linear(x[T], w)
                            best = min(best, clock() - t0)
                        times.setdefault((nt, bname, T, t), []).append(best)
    kernels._state["lib"] = next(iter(builds.values()))
    rows = []
    print(f"[{a.n} x {a.k}] products, median of {a.reps} interleaved rounds (best of {a.calls} calls each); "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'thr':>3} {'build':>6} {'T':>2} {'type':>10} {'MB':>6} {'ns/row':>8} {'GB/s':>6} {'vs Q4_0 x8':>10}")
    for (nt, bname, T, t), v in times.items():
        s = statistics.median(v)
        mb = ws[t].nbytes / 1e6
        base = statistics.median(times[(nt, bname, T, "Q4_0")]) if (nt, bname, T, "Q4_0") in times else None
        gbs = ws[t].nbytes / s / 1e9
        ratio = (ws["Q4_0"].nbytes / base / 1e9) if base else None
        lay = f"{t}{' x8' if ws[t].layout == 'x8' else ''}"
        rel = f"{gbs / ratio:.2f}" if ratio else "-"
        print(f"{nt:>3} {bname:>6} {T:>2} {lay:>10} {mb:6.1f} {s / a.n * 1e9:8.1f} {gbs:6.2f} {rel:>10}")
        rows.append({"threads": nt, "build": bname, "tokens": T, "type": t, "layout": ws[t].layout, "mb": mb,
                     "ns_per_row": s / a.n * 1e9, "gb_s": gbs, "per_byte_vs_q4_0_x8": gbs / ratio if ratio else None})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"n": a.n, "k": a.k, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Sparse ReLU experts against dense experts and llama.cpp: decode and prompt tok/s on one MoE file.

Three engines on the same GGUF (llama.cpp's own Q4_0 of a SmallThinker-shaped model, e.g.
``make_moe_model.py``'s ``smallthinker-21b/l24/llama-q4_0.gguf``), interleaved in rounds with the order
rotating: llama.cpp's ``llama-bench -p P -n N -r 1``, pi-run with dense experts (``--dense``: every row of
each routed expert) and pi-run with sparse experts (the default: only the fired neurons' rows,
``runtime/sparse_experts.py``), each in ``bench_llama3.py``'s child mode (load, warm up, time a P-token
prompt and N decode steps). ``--avx2``: our kernels built ``-march=haswell`` and torch limited to AVX2
(run llama.cpp's AVX2-only build). Prints each run, then medians and the ratios sparse / dense and
sparse / llama.cpp per thread count. Other processes on the machine slow every engine alike within a
round; compare the ratios. ``--cpu-time`` instead gives decode tokens per CPU-second at 1 thread
(``bench_llama3.cpu_time_table``), which other processes barely change.

    python benchmarks/bench_sparse_experts.py FILE --llama-bin LLAMA_BUILD/bin --avx2 --threads 1,2 \\
        --rounds 2 -p 64 -n 32
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llama3 import LlamaBench, PiRun, Result, cpu_time_table, load_avg1  # noqa: E402


class PiRunExperts(PiRun):
    """:class:`bench_llama3.PiRun` with dense (``--dense``) or sparse experts."""

    def __init__(self, dense: bool, avx2: bool):
        super().__init__(avx2=avx2)
        self.dense = dense

    def run(self, res: Result, n_prompt: int, n_gen: int, timeout: float) -> None:
        import bench_llama3

        orig = bench_llama3.__file__
        try:  # PiRun starts bench_llama3's file as the child: start this one, which sets the loader's dense
            bench_llama3.__file__ = str(Path(__file__).resolve())
            self.env["PI_BENCH_DENSE_EXPERTS"] = "1" if self.dense else "0"
            super().run(res, n_prompt, n_gen, timeout)
        finally:
            bench_llama3.__file__ = orig


def child(argv: list[str]) -> None:
    """(Child process.) ``bench_llama3.child`` with the loader's ``dense`` set from the environment; its JSON
    line gains ``decode_cpu_tps``: decode steps per CPU-second of this process during the timed decode
    (after loading and warm-up), which other processes on the machine barely change."""
    import contextlib
    import io
    import json
    import os
    import time

    import bench_llama3

    from powerinfer.runtime import generate as gen, loading

    dense = os.environ.get("PI_BENCH_DENSE_EXPERTS") == "1"
    loading.open_for_inference = functools.partial(loading.open_for_inference, dense=dense)
    cpu = []
    orig = gen.generate

    def timed(model, ids, n, *args, **kw):
        c0 = time.process_time()
        r = orig(model, ids, n, *args, **kw)
        cpu.append((n, time.process_time() - c0))
        return r

    gen.generate = timed
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--threads", type=int)
    p.add_argument("-p", type=int)
    p.add_argument("-n", type=int)
    p.add_argument("--dtype")
    a = p.parse_args(argv)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench_llama3.child(a.child, a.threads, a.p, a.n, a.dtype)
    m = json.loads(buf.getvalue().strip().splitlines()[-1])
    n, secs = cpu[-1]  # the timed decode: n - 1 steps after a one-token prompt
    m["decode_cpu_tps"] = (n - 1) / secs if secs > 0 else None
    print(json.dumps(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build bin folder (llama-bench)")
    ap.add_argument("--avx2", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--cpu-time", action="store_true",
                    help="instead: decode tokens per CPU-second at 1 thread (bench_llama3.cpu_time_table: runs of 16 "
                         "and 16 + N tokens per engine), robust to other processes on the machine")
    a = ap.parse_args()
    if not a.file.is_file():
        raise SystemExit(f"{a.file}: not found")
    engines = {"llama.cpp": LlamaBench(a.llama_bin / "llama-bench"), "pi dense experts": PiRunExperts(True, a.avx2),
               "pi sparse experts": PiRunExperts(False, a.avx2)}
    names = list(engines)
    if a.cpu_time:
        print(f"bench_sparse_experts --cpu-time: {a.file}, tg{a.n}; load average {load_avg1():.2f}", flush=True)
        print(cpu_time_table([(name, "q4_0", 0, a.file) for name in names], engines, a.n, a.timeout))
        return
    threads = [int(t) for t in a.threads.split(",")]
    got: dict[tuple[str, int], list[Result]] = {}
    print(f"bench_sparse_experts: {a.file}, pp{a.p} / tg{a.n}, {a.rounds} rounds, threads {threads}, "
          f"{'AVX2-only ours' if a.avx2 else 'native'}; load average {load_avg1():.2f}", flush=True)
    for r in range(a.rounds):
        for t in threads:
            order = names[r % 3:] + names[:r % 3]
            for name in order:
                res = Result(name, "q4_0", 0, t, r + 1, str(a.file), a.file.stat().st_size, load_avg=load_avg1())
                engines[name].run(res, a.p, a.n, a.timeout)
                got.setdefault((name, t), []).append(res)
                line = res.error or f"decode {res.decode_tps:7.2f} tok/s  prompt {res.prompt_tps:7.2f} tok/s"
                if res.extra.get("decode_cpu_tps"):
                    line += f"  decode {res.extra['decode_cpu_tps']:6.2f} tok/CPU-s"
                print(f"  r{r + 1} t{t} {name:18s} {line}  peak RSS {res.peak_rss / 1e9:5.2f} GB  "
                      f"load {load_avg1():.2f}", flush=True)
    print("medians (decode tok/s, prompt tok/s):")
    for t in threads:
        med = {}
        for name in names:
            rs = [x for x in got[(name, t)] if not x.error]
            med[name] = (statistics.median(x.decode_tps for x in rs) if rs else float("nan"),
                         statistics.median(x.prompt_tps for x in rs) if rs else float("nan"))
            print(f"  t{t} {name:18s} decode {med[name][0]:7.2f}  prompt {med[name][1]:7.2f}")
        cpu = {n: [x.extra["decode_cpu_tps"] for x in got[(n, t)] if x.extra.get("decode_cpu_tps")]
               for n in ("pi dense experts", "pi sparse experts")}
        if all(cpu.values()):
            c = {n: statistics.median(v) for n, v in cpu.items()}
            print(f"  t{t} decode tok/CPU-s dense {c['pi dense experts']:.2f}, sparse {c['pi sparse experts']:.2f} "
                  f"({c['pi sparse experts'] / c['pi dense experts']:.2f}x)")
        sp, de, ll = med["pi sparse experts"], med["pi dense experts"], med["llama.cpp"]
        print(f"  t{t} decode sparse/dense {sp[0] / de[0]:.2f}x, sparse/llama.cpp {sp[0] / ll[0]:.2f}x; "
              f"prompt sparse/dense {sp[1] / de[1]:.2f}x, sparse/llama.cpp {sp[1] / ll[1]:.2f}x")


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[1:])
    else:
        main()

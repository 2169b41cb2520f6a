"""Dense decode and prompt speed of pi-run against llama.cpp on a Llama-3-8B-shaped model.

The files come from ``make_llama3_model.py`` (run it first): the same random weights quantized by
each engine's own quantizer, at 4 layers (``l4/``) and deepened to 32 (``l32/``). Per type:

* Q4_0, Q8_0: pi-run on ``pi-<type>.gguf`` (our ``pi-quantize``), llama.cpp on
  ``llama-<type>.gguf`` (its ``llama-quantize``; output.weight Q6_K in its Q4_0);
* Q4_K_M: both engines on ``llama-q4_k_m.gguf`` (only llama.cpp writes K-quants; reading the
  GGUFs users already have is the point).

``--cross`` adds pi-run on llama.cpp's Q4_0/Q8_0 files (the same bytes as llama.cpp reads).

Every run is a fresh process of one engine: llama.cpp's ``llama-bench -p P -n N -r 1 -o json``
(its warm-up runs first: one full pp and one generated token), and for pi-run this script's
``--child`` mode, which loads the file with the runtime's own loader, warms up with a 16-token
prompt and one generated token, then times a P-token prompt (BOS then random ids, as llama-bench)
and N decode steps after a 1-token prompt (llama-bench's tg: from an empty cache). Decode tok/s are
N over the N steps' time, prompt tok/s P over the prompt's time. Peak RSS is the child's
``ru_maxrss`` (``os.wait4``): file pages it touched, its KV cache and buffers, and for pi-run the
interpreter and torch (~0.3 GB). Engines interleave in rounds (order rotating), every run records
the 1-minute load average at its start; tables give medians over rounds (min-max) and the ratio
pi-run / llama.cpp. Raw runs go to ``--json`` (default ``DIR/bench-<UTC time>.json``);
``--report FILE.json`` prints the tables of a saved run again.

Our kernels are compiled with ``-march=native`` (here AVX-512, VNNI, BF16, AMX), while the
llama.cpp build compared with may be AVX2-only (``GGML_NATIVE=OFF``). ``--avx2`` adds a
``pi-run avx2`` engine: the kernels compiled with ``-march=haswell`` (a ``CC`` wrapper that
rewrites ``-march=native``; its own kernel cache entry), torch limited to AVX2
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``) and
``--dtype f32`` (what ``auto`` picks on a CPU without bf16 dot products).

The benchmark needs the cores to itself: any other busy process takes cycles from the timed
runs, and with 2 threads on 2 cores every parallel region waits for a descheduled thread.
``--wait-idle SECONDS`` waits before each run for other processes to leave the cores.

    python benchmarks/make_llama3_model.py /work/benchdata/llama3 --llama-quantize LLAMA/bin/llama-quantize
    python benchmarks/bench_llama3.py /work/benchdata/llama3 --llama-bench LLAMA/bin/llama-bench \\
        --depths 4,32 --types q4_0,q4_k_m,q8_0 --threads 1,2 --rounds 3 -p 512 -n 128 --avx2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("q4_0", "q4_k_m", "q8_0")
LABEL = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


# ---------------------------------------------------------------------------- one run
@dataclass
class Result:
    engine: str
    type: str
    depth: int
    threads: int
    round: int
    file: str
    file_bytes: int
    decode_tps: float | None = None
    prompt_tps: float | None = None
    peak_rss: int | None = None  # bytes
    load_avg: float = 0.0  # 1-minute load average at the run's start
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system seconds of the whole process (loading and warm-up included)
    error: str = ""
    extra: dict = field(default_factory=dict)


def load_avg1() -> float:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_child(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str, int, float, float]:
    """Run ``cmd``; returns (exit status, stdout, stderr, peak RSS bytes, wall seconds, CPU seconds
    (user + system, all its threads)). Killed (status -9) after ``timeout`` s. The peak RSS and
    CPU time are the child's own (``wait4``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait again
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read(), ru.ru_maxrss * 1024, wall, ru.ru_utime + ru.ru_stime


class LlamaBench:
    """llama.cpp's ``llama-bench`` on its own file."""

    def __init__(self, binary: Path):
        self.binary = binary
        self.env = {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}

    def run(self, res: Result, n_prompt: int, n_gen: int, timeout: float, warmup: bool = True) -> None:
        cmd = [str(self.binary), "-m", res.file, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(res.threads),
               "-r", "1", "-o", "json"] + ([] if warmup else ["--no-warmup"])
        env = {**self.env, "OMP_NUM_THREADS": str(res.threads)}
        rc, out, err, rss, wall, cpu = run_child(cmd, env, timeout)
        res.peak_rss, res.wall_s, res.cpu_s = rss, wall, cpu
        try:
            rows = json.loads(out)
        except json.JSONDecodeError:
            res.error = f"exit {rc}, no JSON: {err.strip()[-300:]}"
            return
        for row in rows:
            if row.get("n_prompt") and not row.get("n_gen"):
                res.prompt_tps = float(row["avg_ts"])
            elif row.get("n_gen") and not row.get("n_prompt"):
                res.decode_tps = float(row["avg_ts"])
        res.extra = {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "type_k", "type_v",
                                                 "flash_attn", "model_type", "model_size") if rows}


class PiRun:
    """pi-run's runtime in a child process of this script (``--child``); ``avx2``: AVX2-only build."""

    def __init__(self, avx2: bool = False, dtype: str = "auto"):
        self.avx2, self.dtype = avx2, "f32" if avx2 else dtype
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
                    "TOKENIZERS_PARALLELISM": "false"}
        if avx2:
            self._tmp = tempfile.TemporaryDirectory(prefix="pi-avx2-cc-")
            cc = Path(self._tmp.name) / "cc-haswell"
            real = os.environ.get("CC", "cc")
            cc.write_text(f'#!/bin/bash\nexec {real} "${{@/#-march=native/-march=haswell}}"\n')
            cc.chmod(0o755)
            self.env.update(AVX2_ENV, CC=str(cc))

    def run(self, res: Result, n_prompt: int, n_gen: int, timeout: float, warmup: bool = True) -> None:
        # (warmup: the child's warm-up is always the same 16-token step, whatever the prompt)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", res.file, "--threads", str(res.threads),
               "-p", str(n_prompt), "-n", str(n_gen), "--dtype", self.dtype]
        env = {**self.env, "OMP_NUM_THREADS": str(res.threads)}
        rc, out, err, rss, wall, cpu = run_child(cmd, env, timeout)
        res.peak_rss, res.wall_s, res.cpu_s = rss, wall, cpu
        lines = out.strip().splitlines()
        try:
            m = json.loads(lines[-1])
        except (json.JSONDecodeError, IndexError):
            res.error = f"exit {rc}: {err.strip()[-300:]}"
            return
        res.decode_tps, res.prompt_tps = m["decode_tps"], m["prompt_tps"]
        res.extra = {k: v for k, v in m.items() if k not in ("decode_tps", "prompt_tps")}


def child(path: str, threads: int, n_prompt: int, n_gen: int, dtype: str) -> None:
    """(Child process.) Load ``path`` with the runtime, warm up, time the prompt and the decode; one JSON line."""
    import torch

    from powerinfer.runtime import kernels
    from powerinfer.runtime.generate import SamplerSettings, generate
    from powerinfer.runtime.loading import open_for_inference

    t0 = time.perf_counter()
    model, tok = open_for_inference(path, dtype=dtype, ctx_size=max(n_prompt, 16) + n_gen + 8, threads=threads)
    t_load = time.perf_counter() - t0
    greedy = SamplerSettings(temp=0.0)
    bos = tok.bos_id if tok.bos_id is not None else 1
    rng = random.Random(0)
    n_vocab = int(model.tok_embd.shape[0])
    ids = [bos] + [rng.randrange(n_vocab) for _ in range(max(n_prompt, 16) - 1)]
    generate(model, ids[:16], 2, greedy)  # warm-up: every weight paged in, kernels built
    c0 = time.process_time()  # the timed phases' CPU seconds (--cpu-time): loading varies by seconds
    pp = generate(model, ids[:n_prompt], 1, greedy) if n_prompt else None
    tg = generate(model, [bos], n_gen + 1, greedy) if n_gen else None
    phase_cpu = time.process_time() - c0
    if tg is not None and tg.n_eval != n_gen:
        raise SystemExit(f"decode ran {tg.n_eval} steps, not {n_gen}")
    print(json.dumps({"decode_tps": tg.gen_tps if tg else None, "prompt_tps": pp.prompt_tps if pp else None,
                      "load_s": round(t_load, 2), "phase_cpu_s": phase_cpu, "dtype": str(model.dtype).removeprefix("torch."),
                      "kernels": kernels.backend(), "threads": torch.get_num_threads(),
                      "kv_dtype": str(model.cache.k.dtype).removeprefix("torch.")}))


# ---------------------------------------------------------------------------- plan and rounds
def plan(d: Path, depths: list[int], types: list[str], avx2: bool, cross: bool) -> list[tuple[str, str, int, Path]]:
    """(engine, type, depth, file) for every engine to run; missing files raise SystemExit."""
    out = []
    for depth in depths:
        for t in types:
            ours = d / f"l{depth}" / (f"pi-{t}.gguf" if t != "q4_k_m" else "llama-q4_k_m.gguf")
            theirs = d / f"l{depth}" / f"llama-{t}.gguf"
            rows = [("pi-run", ours)] + ([("pi-run avx2", ours)] if avx2 else []) + [("llama.cpp", theirs)]
            if cross and t != "q4_k_m":
                rows.append(("pi-run, llama.cpp's file", theirs))
            for engine, f in rows:
                if not f.is_file():
                    raise SystemExit(f"{f}: not found; make it with python benchmarks/make_llama3_model.py {d} "
                                     f"--llama-quantize PATH (see its docstring)")
                out.append((engine, t, depth, f))
    return out


def fmt(xs: list[float], digits: int = 2) -> str:
    if not xs:  # not measured (-p 0) or every run failed (those rows say so)
        return "-"
    m = statistics.median(xs)
    return f"{m:.{digits}f}" if len(xs) == 1 else f"{m:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def med(rs: list[Result], key: str) -> float | None:
    xs = [getattr(r, key) for r in rs if getattr(r, key) is not None]
    return statistics.median(xs) if xs else None


def tables(results: list[Result]) -> str:
    """Markdown: one table per (depth, threads), then the ratios summary."""
    out = []
    cells = sorted({(r.depth, r.threads) for r in results})
    summary = {}
    for depth, threads in cells:
        rs = [r for r in results if (r.depth, r.threads) == (depth, threads)]
        out.append(f"\n### {depth} layers, {threads} thread{'s' if threads > 1 else ''}\n")
        out.append("| type | engine, file | decode tok/s | vs llama.cpp | prompt tok/s | vs llama.cpp | "
                   "peak RSS GB | file GB | RSS / file | load avg | runs |")
        out.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for t in TYPES:
            group = [r for r in rs if r.type == t]
            if not group:
                continue
            engines = list(dict.fromkeys(r.engine for r in group))
            ref = [r for r in group if r.engine == "llama.cpp" and not r.error]
            ref_dec, ref_pp = med(ref, "decode_tps"), med(ref, "prompt_tps")
            for e in engines:
                er = [r for r in group if r.engine == e]
                ok = [r for r in er if not r.error]
                dec, pp = med(ok, "decode_tps"), med(ok, "prompt_tps")
                rd = f"{dec / ref_dec:.2f}x" if dec and ref_dec else "-"
                rp = f"{pp / ref_pp:.2f}x" if pp and ref_pp else "-"
                rss = med(ok, "peak_rss")
                fb = er[0].file_bytes
                la = [r.load_avg for r in er]
                out.append(f"| {LABEL[t]} | {e}, {Path(er[0].file).name} | "
                           f"{fmt([r.decode_tps for r in ok if r.decode_tps])} | {rd} | "
                           f"{fmt([r.prompt_tps for r in ok if r.prompt_tps])} | {rp} | "
                           f"{rss / 1e9:.2f} | {fb / 1e9:.2f} | {rss / fb:.2f} | "
                           f"{min(la):.1f}-{max(la):.1f} | {len(ok)}/{len(er)} |" if rss else
                           f"| {LABEL[t]} | {e}, {Path(er[0].file).name} | failed: {er[0].error[:120]} |"
                           " | | | | | | | |")
                if e != "llama.cpp" and ref_dec:
                    summary[(t, depth, e, threads)] = (dec / ref_dec if dec else None,
                                                       pp / ref_pp if pp and ref_pp else None)
    if summary:
        thr = sorted({k[3] for k in summary})
        out.append("\n### pi-run / llama.cpp (medians)\n")
        out.append("| type | layers | engine | " + " | ".join(f"decode, {t}t" for t in thr) + " | "
                   + " | ".join(f"prompt, {t}t" for t in thr) + " |")
        out.append("|---|--:|---|" + "--:|" * (2 * len(thr)))
        for t, depth, e in dict.fromkeys((k[0], k[1], k[2]) for k in summary):
            vals = [summary.get((t, depth, e, n), (None, None)) for n in thr]
            f = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
            out.append(f"| {LABEL[t]} | {depth} | {e} | " + " | ".join(f(v[0]) for v in vals) + " | "
                       + " | ".join(f(v[1]) for v in vals) + " |")
    return "\n".join(out) + "\n"


def _cpu_rate(engine, runs_of, n0: int, n1: int, prompt: bool, timeout: float) -> float | None:
    """Tokens per CPU-second of ``engine`` at 1 thread between a process doing ``n0`` and one doing
    ``n1`` tokens (prompt tokens with ``prompt``, else generated ones), or None when a run failed."""
    cpu = []
    for n in (n0, n1):
        res = runs_of()
        engine.run(res, n if prompt else 0, 0 if prompt else n, timeout, warmup=not prompt)
        # pi-run: the CPU seconds of its timed phases (its load re-lays weights out in numpy and varies
        # by seconds between runs); llama.cpp: the whole process (its load maps the file)
        cpu.append(None if res.error else res.extra.get("phase_cpu_s", res.cpu_s))
    return (n1 - n0) / (cpu[1] - cpu[0]) if None not in cpu and cpu[1] > cpu[0] else None


def cpu_time_table(runs, engines, n_gen: int, n_prompt: int, timeout: float) -> str:
    """Tokens per CPU-second at 1 thread, which other processes on the machine barely change (they
    take wall time, not this process's CPU time): for each engine and file, the CPU seconds of a
    process generating ``16 + n_gen`` tokens minus one generating 16 (no prompt; loading and warm-up
    cancel out; pi-run's timed phases only, see _cpu_rate), ``n_gen`` divided by that; with ``n_prompt`` > 16 also a process processing an
    ``n_prompt``-token prompt minus one processing 16 (llama-bench ``--no-warmup``, pi-run's warm-up
    is the same 16-token step in both)."""
    lines = ["| type | layers | engine, file | decode tok per CPU-s | vs llama.cpp | prompt tok per CPU-s | "
             "vs llama.cpp |", "|---|--:|---|--:|--:|--:|--:|"]
    got: dict = {}
    for engine, t, depth, f in runs:
        def runs_of():
            return Result(engine, t, depth, 1, 0, str(f), f.stat().st_size)
        tg = _cpu_rate(engines[engine], runs_of, 16, 16 + n_gen, False, timeout) if n_gen else None
        pp = _cpu_rate(engines[engine], runs_of, 16, n_prompt, True, timeout) if n_prompt > 16 else None
        got[(t, depth, engine)] = (tg, pp)
        def fmt(v, asked):
            return f"{v:.2f} tok/CPU-s" if v else "failed" if asked else "-"
        print(f"  cpu-time {depth}L {LABEL[t]:<6} {engine:<24} decode {fmt(tg, n_gen)}, "
              f"prompt {fmt(pp, n_prompt > 16)}", flush=True)
    for (t, depth, engine), (tg, pp) in got.items():
        ref = got.get((t, depth, "llama.cpp"), (None, None))
        f = next(r[3] for r in runs if r[:3] == (engine, t, depth))
        cells = []
        for v, r in ((tg, ref[0]), (pp, ref[1])):
            cells += [f"{v:.2f}" if v else "-", f"{v / r:.2f}x" if v and r else "-"]
        lines.append(f"| {LABEL[t]} | {depth} | {engine}, {f.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, nargs="?", help="make_llama3_model.py's output folder")
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary")
    ap.add_argument("--depths", default="4,32", help="layer counts to run (folders l4/, l32/)")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated: q4_0, q4_k_m, q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (llama-bench -p; 0: none)")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="decode tokens (llama-bench -n)")
    ap.add_argument("--dtype", default="auto", help="pi-run compute dtype (auto, bf16, f32)")
    ap.add_argument("--avx2", action="store_true", help="also run pi-run with AVX2-only kernels and torch")
    ap.add_argument("--no-native", action="store_true", help="with --avx2: leave the -march=native pi-run out")
    ap.add_argument("--cross", action="store_true", help="also run pi-run on llama.cpp's Q4_0/Q8_0 files")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is killed (then: failed)")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each run, wait up to this long for other processes to leave the cores")
    ap.add_argument("--json", type=Path, default=None, help="raw results (default DIR/bench-<UTC>.json)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="instead: decode tokens per CPU-second at 1 thread (two runs of 16 and 16 + N tokens "
                         "per engine and file; with -p P > 16 also prompt tokens, runs of 16 and P prompt tokens), "
                         "robust to other processes on the machine")
    ap.add_argument("--report", type=Path, default=None, help="print the tables of a saved --json file and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, int(a.threads), a.n_prompt, a.n_gen, a.dtype)
    if a.report:
        data = json.loads(a.report.read_text())
        print(data.get("header", ""))
        print(tables([Result(**r) for r in data["runs"]]))
        return
    if a.dir is None or a.llama_bench is None:
        ap.error("DIR and --llama-bench are required (or --report FILE)")
    if not a.llama_bench.is_file():
        ap.error(f"--llama-bench {a.llama_bench}: not found")
    types = [t.strip().lower() for t in a.types.split(",") if t.strip()]
    if bad := [t for t in types if t not in TYPES]:
        ap.error(f"--types: {', '.join(bad)} not among {', '.join(TYPES)}")
    depths = [int(x) for x in a.depths.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    if a.rounds < 1 or a.n_gen < 1 or a.n_prompt < 0 or any(t < 1 for t in threads):
        ap.error("--rounds, -n and --threads must be at least 1, -p at least 0")
    runs = plan(a.dir, depths, types, a.avx2, a.cross)
    if a.no_native:
        runs = [r for r in runs if r[0] != "pi-run"]
    engines = {"llama.cpp": LlamaBench(a.llama_bench), "pi-run": PiRun(dtype=a.dtype),
               "pi-run, llama.cpp's file": PiRun(dtype=a.dtype), "pi-run avx2": PiRun(avx2=True)}
    if a.cpu_time:
        print(f"tokens per CPU-second, 1 thread, by difference: decode {a.n_gen} tokens, prompt {a.n_prompt} - 16; "
              f"load average {load_avg1():.2f}", flush=True)
        print(cpu_time_table(runs, engines, a.n_gen, a.n_prompt, a.timeout))
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    jpath = a.json or a.dir / f"bench-{stamp}.json"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import wait_idle  # noqa: E402

    header = (f"bench_llama3: {stamp}, {os.cpu_count()} CPUs ({_cpu_name()}); pp{a.n_prompt} / tg{a.n_gen}, "
              f"{a.rounds} rounds, threads {a.threads}; llama-bench {a.llama_bench}; "
              f"load average at start {load_avg1():.2f}")
    print(header)
    print("This benchmark needs the cores to itself: other busy processes slow every engine and make "
          "the figures noisy (each run records the load average).", flush=True)
    results: list[Result] = []
    for depth in depths:
        for th in threads:
            cell = [r for r in runs if r[2] == depth]
            for rnd in range(a.rounds):
                k = rnd % len(cell)
                for engine, t, _, f in cell[k:] + cell[:k]:
                    if a.wait_idle > 0:
                        wait_idle(a.wait_idle)
                    res = Result(engine, t, depth, th, rnd + 1, str(f), f.stat().st_size, load_avg=load_avg1())
                    engines[engine].run(res, a.n_prompt, a.n_gen, a.timeout)
                    results.append(res)
                    if res.error:
                        print(f"  {depth}L t{th} r{rnd + 1} {LABEL[t]:<6} {engine}: FAILED {res.error}", flush=True)
                    else:
                        pp = f"{res.prompt_tps:7.2f}" if res.prompt_tps else "      -"
                        print(f"  {depth}L t{th} r{rnd + 1} {LABEL[t]:<6} {engine:<24} decode "
                              f"{res.decode_tps or 0:7.2f} tok/s  prompt {pp} tok/s  "
                              f"peak RSS {res.peak_rss / 1e9:5.2f} GB  load {res.load_avg:.2f}  "
                              f"({res.wall_s:.0f} s)", flush=True)
                    jpath.write_text(json.dumps({"header": header, "runs": [asdict(r) for r in results]}, indent=1))
            print(tables([r for r in results if (r.depth, r.threads) == (depth, th)]), flush=True)
    print(header)
    print(tables(results))
    print(f"raw runs: {jpath}")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()

"""A model larger than the memory it may use: pi-run --ram-budget against pi-run, upstream
PowerInfer and llama.cpp under the same memory cgroup limit.

Each run under the limit is a child process in its own cgroup v1 ``memory`` group
(``/sys/fs/cgroup/memory``, root needed) limited to ``--share`` (default 0.6) of the PWRI
file's size, every file it reads evicted from the page cache first
(``posix_fadvise(DONTNEED)``). Engines, each on its own bytes of the same weights:

* pi-run ``--ram-budget`` (a greedy text run, compared token for token with the unlimited
  run's text, and a ``--bench`` run for reads and hit rate);
* pi-run without a budget, upstream PowerInfer (``main``) on its own PWRI Q4_0, llama.cpp
  (``llama-bench``) on its dense Q4_0: under the limit (a token cap and a timeout) and unlimited.

Reported: decode tokens/s, whether the kernel's OOM killer ended it, peak RSS (``wait4``) and
the cgroup's peak (page cache included), reads and MB read per token and the resident set's
hit rate, the disk's random and sequential read rates (O_DIRECT probe), and a projection of
the budget run onto an NVMe disk (3 GB/s, 500K IOPS) from the measured reads. Run under
``flock /tmp/pi-bench.lock``; the load average is printed. Example (the 32-layer files of
``bench_deep.py``; the activation counts of the 4-layer model repeated 8 times, as the layers
were, with ``--deep-activation``)::

    flock /tmp/pi-bench.lock python benchmarks/bench_ram_budget.py \\
        --pwri out/deep/bench-q4_0.powerinfer.gguf --activation out/bench/activation --deep-activation 8 \\
        --upstream POWERINFER/build/bin/main --upstream-file out/deep/bench-up-q4_0.powerinfer.gguf \\
        --llama-bench LLAMA/build/bin/llama-bench --llama-file out/deep/bench-llama-q4_0.gguf
"""
from __future__ import annotations

import argparse
import mmap
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CGROUP = Path("/sys/fs/cgroup/memory")
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"
GIB = 1 << 30


@dataclass
class Result:
    name: str
    limited: bool
    tps: float | None = None
    killed: bool = False
    timed_out: bool = False
    rc: int | None = None
    peak_rss: int = 0  # bytes (wait4)
    cg_peak: int = 0  # bytes, the cgroup's peak (page cache included)
    seconds: float = 0.0
    text: str = ""
    extra: dict = field(default_factory=dict)
    err: str = ""


def evict(*paths: Path) -> None:
    """Drop ``paths`` from the page cache."""
    for p in paths:
        if p is not None and p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(name: str, cmd: list[str], limit: int | None, timeout: float, evict_paths=(), env=None) -> Result:
    """``cmd`` as a child (in a fresh memory cgroup of ``limit`` bytes when given)."""
    res = Result(name, limit is not None)
    evict(*evict_paths)
    cg = None
    if limit is not None:
        cg = CGROUP / f"pi-ram-bench-{os.getpid()}-{time.monotonic_ns()}"
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        (cg / "memory.swappiness").write_text("0")
    procs = None if cg is None else str(cg / "cgroup.procs")

    def enter() -> None:  # in the child, before exec
        if procs is not None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    with tempfile.TemporaryDirectory() as cwd, open(Path(cwd) / "out", "w+") as out, \
            open(Path(cwd) / "err", "w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, preexec_fn=enter,
                             env={**os.environ, **(env or {})})
        status = ru = None
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                res.timed_out = True
                os.kill(p.pid, signal.SIGKILL)
                _, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.1)
        p.returncode = os.waitstatus_to_exitcode(status)
        res.seconds = time.perf_counter() - t0
        res.rc = p.returncode
        res.peak_rss = ru.ru_maxrss * 1024
        out.seek(0)
        err.seek(0)
        res.text, res.err = out.read(), err.read()
    if cg is not None:
        res.cg_peak = int((cg / "memory.max_usage_in_bytes").read_text())
        oom = (cg / "memory.oom_control").read_text()
        m = re.search(r"oom_kill (\d+)", oom)
        res.killed = (m is not None and int(m.group(1)) > 0) or (res.rc == -9 and not res.timed_out)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return res


def pi_cmd(model: Path, n: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from powerinfer.runtime.cli import main; main()",
            "-m", str(model), "-n", str(n), "-t", "1", "-c", "64", "-p", PROMPT, *extra]


def parse_pi(res: Result, bench: bool) -> None:
    if bench:
        m = re.search(r"decode: (\d+) tokens in ([\d.]+) ms", res.text)
        if m:
            res.tps = int(m.group(1)) / (float(m.group(2)) / 1e3)
        m = re.search(r"per token (\d+) reads, ([\d.]+) MB read, (\d+) neurons; hit rate ([\d.]+)% \(hot ([\d.]+)%, "
                      r"window ([\d.]+)%\); waiting for reads (\d+) ms", res.text)
        if m:
            res.extra.update(reads=int(m.group(1)), mb=float(m.group(2)), neurons=int(m.group(3)),
                             hit=float(m.group(4)), hot=float(m.group(5)), window=float(m.group(6)),
                             wait_ms=float(m.group(7)))
        m = re.search(r"hot FFN neurons (\d+) \(([\d.]+)% of neurons\), reuse window (\d+)", res.text)
        if m:
            res.extra.update(hot_mb=int(m.group(1)), hot_share=float(m.group(2)), window_mb=int(m.group(3)))
        return
    m = re.search(r"generation:\s+\d+ tokens?, (\d+) evals? in ([\d.]+) ms", res.err)
    if m:
        res.tps = int(m.group(1)) / (float(m.group(2)) / 1e3)


def parse_upstream(res: Result) -> None:
    m = re.search(r"\beval time\s*=\s*([\d.]+) ms /\s*(\d+) runs", res.err)
    if m and int(m.group(2)):
        res.tps = int(m.group(2)) / (float(m.group(1)) / 1e3)


def parse_llama(res: Result) -> None:
    import json

    try:
        rows = json.loads(res.text)
        res.tps = next(float(r["avg_ts"]) for r in rows if not r["n_prompt"])
    except (ValueError, StopIteration, KeyError, TypeError):
        pass


def disk_probe(path: Path, seconds: float = 2.0) -> dict:
    """O_DIRECT read rates of ``path``: random 8 KB at queue depth 1 and 16, sequential 1 MB."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    out = {}
    try:
        def rnd(qd: int) -> float:
            stop = time.perf_counter() + seconds

            def worker(_):
                buf, n, rng = mmap.mmap(-1, 8192), 0, random.Random()
                while time.perf_counter() < stop:
                    os.preadv(fd, [buf], rng.randrange(0, size - 8192) // 4096 * 4096)
                    n += 1
                return n
            with ThreadPoolExecutor(qd) as ex:
                return sum(ex.map(worker, range(qd))) / seconds
        out["iops_qd1"], out["iops_qd16"] = rnd(1), rnd(16)
        buf, n, off, t0 = mmap.mmap(-1, 1 << 20), 0, random.randrange(0, size // 2) // 4096 * 4096, time.perf_counter()
        while time.perf_counter() - t0 < seconds and off + (1 << 20) <= size:
            os.preadv(fd, [buf], off)
            off += 1 << 20
            n += 1
        out["seq_mb_s"] = n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def deep_activation(src: Path, repeat: int, dst: Path) -> Path:
    """Counts of a shallow model's layers repeated ``repeat`` times (layer k is layer k // repeat)."""
    from powerinfer.formats.activation import load_activation_dir, save_activation_dir

    counts = load_activation_dir(src)
    return save_activation_dir(dst, [counts[k // repeat] for k in range(len(counts) * repeat)], {"n_tokens": 0})


def fmt(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pwri", type=Path, required=True, help="our PowerInfer GGUF (Q4_0)")
    ap.add_argument("--activation", type=Path, required=True, help="activation folder (hot neurons)")
    ap.add_argument("--deep-activation", type=int, default=1, help="repeat each layer's counts this many times")
    ap.add_argument("--share", type=float, default=0.6, help="cgroup limit as a share of the PWRI file size")
    ap.add_argument("--budget-margin", type=float, default=0.15,
                    help="GiB between the cgroup limit and --ram-budget: the cgroup also charges page tables, "
                         "kernel memory and the page cache (at 0.05 the kernel reclaims on every allocation)")
    ap.add_argument("-n", type=int, default=8, help="tokens per run")
    ap.add_argument("--cap", type=int, default=4, help="tokens per run of the other engines under the limit")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run under the limit")
    ap.add_argument("--upstream", type=Path, default=None)
    ap.add_argument("--upstream-file", type=Path, default=None)
    ap.add_argument("--llama-bench", type=Path, default=None)
    ap.add_argument("--llama-file", type=Path, default=None)
    ap.add_argument("--skip-unlimited-others", action="store_true", help="no unlimited upstream/llama.cpp runs")
    a = ap.parse_args(argv)
    if os.geteuid() != 0 or not CGROUP.is_dir():
        sys.exit(f"needs root and the cgroup v1 memory controller at {CGROUP}")
    limit = int(a.share * a.pwri.stat().st_size)
    budget = limit / GIB - a.budget_margin
    print(f"load average {os.getloadavg()[0]:.2f}; {a.pwri} {a.pwri.stat().st_size / 1e9:.2f} GB; cgroup limit "
          f"{limit / 1e9:.2f} GB ({a.share}x); --ram-budget {budget:.2f} GiB", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="pi-ram-bench-"))
    act = deep_activation(a.activation, a.deep_activation, tmp / "activation") if a.deep_activation > 1 \
        else a.activation
    from powerinfer.runtime.cold_rows import default_cache_dir

    rows = default_cache_dir()
    row_files = list(rows.glob(f"{a.pwri.name}.*.pirows")) if rows and rows.is_dir() else []
    ours = [a.pwri, *row_files]
    budget_args = ["--ram-budget", f"{budget:.3f}", "--activation", str(act)]
    text_args = ["--temp", "0", "--ignore-eos"]
    results: list[Result] = []

    def go(res: Result, parse) -> Result:
        parse(res)
        results.append(res)
        state = "OOM-killed" if res.killed else "timed out" if res.timed_out else f"rc {res.rc}"
        print(f"  {res.name}{' (limited)' if res.limited else ''}: {fmt(res.tps, 3)} tok/s, {state}, peak RSS "
              f"{res.peak_rss / 1e9:.2f} GB, cgroup peak {res.cg_peak / 1e9:.2f} GB, {res.seconds:.0f} s "
              f"{res.extra or ''}", flush=True)
        if res.rc not in (0, None) and not res.killed:
            print("    " + res.err.strip()[-400:].replace("\n", "\n    "), flush=True)
        return res

    # the row cache first (written once, outside the limit), then the runs
    go(run("pi-run --ram-budget (row cache warm-up)", pi_cmd(a.pwri, 1, budget_args + text_args), None, 3600),
       lambda r: parse_pi(r, False))
    row_files = list(rows.glob(f"{a.pwri.name}.*.pirows")) if rows and rows.is_dir() else []
    ours = [a.pwri, *row_files]
    full = go(run("pi-run", pi_cmd(a.pwri, a.n, text_args), None, 3600, ours), lambda r: parse_pi(r, False))
    go(run("pi-run --bench", pi_cmd(a.pwri, a.n, ["--bench"]), None, 3600, ours),
                lambda r: parse_pi(r, True))
    lim = go(run("pi-run --ram-budget", pi_cmd(a.pwri, a.n, budget_args + text_args), limit, 3600, ours),
             lambda r: parse_pi(r, False))
    lim_b = go(run("pi-run --ram-budget --bench", pi_cmd(a.pwri, a.n, budget_args + ["--bench"]), limit, 3600, ours),
               lambda r: parse_pi(r, True))
    same = lim.rc == 0 and full.rc == 0 and lim.text == full.text
    print(f"  greedy text under the budget == unlimited: {same}", flush=True)
    nob = go(run("pi-run (no budget)", pi_cmd(a.pwri, a.cap, text_args), limit, a.timeout, ours),
             lambda r: parse_pi(r, False))
    up = up_full = ll = ll_full = None
    if a.upstream and a.upstream_file:
        cmd = [str(a.upstream), "-m", str(a.upstream_file), "-t", "1", "--temp", "0", "--ignore-eos", "-p", PROMPT]
        up = go(run("upstream PowerInfer", cmd + ["-n", str(a.cap)], limit, a.timeout, [a.upstream_file]),
                parse_upstream)
        if not a.skip_unlimited_others:
            up_full = go(run("upstream PowerInfer", cmd + ["-n", str(a.n)], None, 3600, [a.upstream_file]),
                         parse_upstream)
    if a.llama_bench and a.llama_file:
        cmd = [str(a.llama_bench), "-m", str(a.llama_file), "-p", "0", "-t", "1", "-r", "1", "-o", "json"]
        ll = go(run("llama.cpp", cmd + ["-n", str(a.cap)], limit, a.timeout, [a.llama_file]), parse_llama)
        if not a.skip_unlimited_others:
            ll_full = go(run("llama.cpp", cmd + ["-n", str(a.n)], None, 3600, [a.llama_file]), parse_llama)
    probe = disk_probe(row_files[0] if row_files else a.pwri)
    print(f"disk (O_DIRECT): random 8 KB reads {probe['iops_qd1']:.0f}/s at queue depth 1, {probe['iops_qd16']:.0f}/s "
          f"at 16; sequential 1 MB reads {probe['seq_mb_s']:.0f} MB/s", flush=True)

    def tps(r: Result | None) -> str:
        if r is None:
            return "not run"
        if r.killed:
            return "OOM-killed (0)"
        if r.timed_out and r.tps is None:
            return "timed out (0)"
        return fmt(r.tps, 3)

    print("\n| engine | unlimited tok/s | under the limit tok/s | peak RSS under the limit |\n|---|--:|--:|--:|")
    print(f"| pi-run --ram-budget {budget:.2f} GiB | {fmt(full.tps, 2)} | {tps(lim)} "
          f"(--bench {tps(lim_b)}) | {lim.peak_rss / 1e9:.2f} GB |")
    print(f"| pi-run, no budget | {fmt(full.tps, 2)} | {tps(nob)} | {nob.peak_rss / 1e9:.2f} GB |")
    if up is not None:
        print(f"| upstream PowerInfer, its PWRI Q4_0 | {tps(up_full)} | {tps(up)} | {up.peak_rss / 1e9:.2f} GB |")
    if ll is not None:
        print(f"| llama.cpp, its Q4_0 | {tps(ll_full)} | {tps(ll)} | {ll.peak_rss / 1e9:.2f} GB |")
    e = lim_b.extra
    if lim.tps and full.tps:
        print(f"\nunder the limit: {lim.tps / full.tps:.2f}x pi-run's unlimited speed; greedy text identical: {same}; "
              f"peak RSS {lim.peak_rss / GIB:.2f} GiB against a budget of {budget:.2f} GiB")
    if e:
        per_s = (lim_b.tps or 0)
        print(f"per token: {e['reads']} reads, {e['mb']} MB read ({e['mb'] * per_s:.0f} MB/s, "
              f"{e['reads'] * per_s:.0f} reads/s), {e['neurons']} neurons read; hit rate {e['hit']}% "
              f"(hot {e['hot']}%, window {e['window']}%); waiting for reads {e['wait_ms']:.0f} ms per token")
        if lim_b.tps:
            compute = max(0.0, 1 / lim_b.tps - e["wait_ms"] / 1e3)
            io = max(e["reads"] / 500e3, e["mb"] / 3000)
            print(f"NVMe projection (3 GB/s, 500K IOPS, the same reads, no overlap): {compute * 1e3:.0f} ms compute + "
                  f"{io * 1e3:.0f} ms reads per token -> {1 / (compute + io):.2f} tok/s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

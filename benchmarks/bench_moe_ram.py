"""Mixture-of-experts files larger than the memory limit: pi-run --ram-budget against llama.cpp under the
same memory cgroup (the expert counterpart of ``bench_ram_budget.py``; part 3 of ``bench_moe.py``, cut to
what the budget is measured by).

For each shape's deepest file of ``make_moe_model.py`` (llama.cpp's own Q4_0, both engines on the same
file):

1. the routing counts, ``pi-profile FILE --data TEXT --out ACT`` (once; ``expert_counts.json``), which
   ``--ram-budget`` pins the most routed experts by;
2. pi-run unlimited: greedy text and decode tok/s (``bench_moe.TEXT_ARGS``, 1 thread, ``-c 64``);
3. under a memory cgroup of ``--share`` (0.4) of the file, the file evicted from the page cache first
   (``bench_ram_budget.run``): pi-run ``--ram-budget`` (the limit less ``--budget-margin`` GiB; its text
   compared with the unlimited run's) and llama.cpp's ``llama-bench -p 0 -n CAP`` as it runs by default
   (Q4_0 repacked into anonymous memory) and with ``--repack 0`` (its mapped file only); a killed or
   timed-out run counts as 0 tok/s.

Reported per run: tok/s, against the unlimited run and against llama.cpp's better run under the limit, the
disk's bytes and requests per token (``/proc/diskstats``, the whole machine's) and the projection onto an
NVMe disk (3 GB/s, 500K IOPS) ``bench_moe.projection`` makes, and pi-run's own ``--bench`` read counters.
Needs root and the cgroup v1 memory controller. Run under ``flock /tmp/pi-bench.lock``::

    python benchmarks/bench_moe_ram.py /work/benchdata/moe --llama-bin LLAMA_BUILD/bin --avx2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_moe as bm  # noqa: E402
import bench_ram_budget as rb  # noqa: E402
from bench_llama3 import AVX2_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "powerinfer" / "assets" / "calibration.txt"


def counts_dir(f: Path, out: Path, tokens: int, timeout: float) -> Path:
    """``out`` holding ``expert_counts.json`` of ``f`` (pi-profile, once)."""
    if (out / "expert_counts.json").is_file():
        return out
    cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
           "from powerinfer.profile.cli import main; main()", str(f), "--data", str(TEXT), "--out", str(out),
           "--max-tokens", str(tokens)]
    r = rb.run("pi-profile", cmd, None, timeout)
    if r.rc != 0:
        raise SystemExit(f"pi-profile {f}: {bm.refusal(r.err + chr(10) + r.text)}")
    print(f"  pi-profile: {r.seconds:.0f} s -> {out}", flush=True)
    return out


def parse_budget(res: rb.Result) -> None:
    """tok/s of a ``--bench`` run and its lines of expert_residency.expert_budget_lines."""
    rb.parse_pi(res, True)
    m = re.search(r"resident experts (\d+) of (\d+) \((\d+) MB\), reuse cache (\d+) experts \((\d+) MB\); process now "
                  r"(\d+) MB, peak (\d+) MB", res.text + res.err)
    if m:
        res.extra.update(hot=int(m.group(1)), experts=int(m.group(2)), hot_mb=int(m.group(3)),
                         cache=int(m.group(4)), cache_mb=int(m.group(5)), peak_mb=int(m.group(7)))
    m = re.search(r"experts read per pass ([\d.]+) \(([\d.]+) MB, (\d+) reads\); hit rate ([\d.]+)% \(resident "
                  r"([\d.]+)%, cache ([\d.]+)%\); waiting for reads (\d+) ms", res.text + res.err)
    d = re.search(r"per decode token: ([\d.]+) experts read \(([\d.]+) MB\), waiting for reads (\d+) ms", res.text)
    if d:
        res.extra.update(dec_experts=float(d.group(1)), dec_mb=float(d.group(2)), dec_wait_ms=float(d.group(3)))
    if m:
        res.extra.update(read_per_pass=float(m.group(1)), mb_per_pass=float(m.group(2)), hit=float(m.group(4)),
                         hit_resident=float(m.group(5)), hit_cache=float(m.group(6)), wait_ms=float(m.group(7)))


def nvme(x: dict, unlimited_tps: float | None) -> str:
    """tok/s on an NVMe disk (3 GB/s) from pi-run's own MB read per decode token and the unlimited time per
    token (bandwidth-bound: its reads are 1 MiB pieces; no overlap assumed)."""
    if not unlimited_tps or x.get("dec_mb") is None:
        return "-"
    return f"{1 / (1 / unlimited_tps + x['dec_mb'] * 1e6 / 3e9):.2f}"


def shape_rows(shape: str, f: Path, a, log: list) -> list[str]:
    limit = int(a.share * f.stat().st_size)
    budget = limit / rb.GIB - a.budget_margin
    act = counts_dir(f, a.act_root / shape, a.profile_tokens, a.timeout)
    print(f"{shape}: {f} {f.stat().st_size / 1e9:.2f} GB; cgroup limit {limit / 1e9:.2f} GB ({a.share}x); "
          f"--ram-budget {budget:.2f} GiB; load average {os.getloadavg()[0]:.2f}", flush=True)
    pi_env = {"POWERINFER_MARCH": "haswell", **AVX2_ENV} if a.avx2 else {}
    ll_env = {"LD_LIBRARY_PATH": f"{a.llama_bin}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    t = ["-t", "1"] + (["--dtype", "f32"] if a.avx2 else [])
    full = bm.measured("pi-run", rb.pi_cmd(f, a.n_text, bm.TEXT_ARGS + t), None, a.timeout, [f],
                       lambda r: rb.parse_pi(r, False), a.n_text, pi_env)
    args = t + ["--ram-budget", f"{budget:.3f}", "--activation", str(act)]
    runs = {"pi-run --ram-budget": bm.measured("pi-run --ram-budget", rb.pi_cmd(f, a.n_text, bm.TEXT_ARGS + args),
                                               limit, a.timeout, [f], lambda r: rb.parse_pi(r, False), a.n_text, pi_env)}
    if a.bench_run:  # the same under --bench: the store's read counters (its own decode tok/s too)
        runs["pi-run --ram-budget --bench"] = bm.measured(
            "pi-run --ram-budget --bench", rb.pi_cmd(f, a.n_text, ["--ignore-eos"] + args + ["--bench"]), limit,
            a.timeout, [f], parse_budget, a.n_text, pi_env)
    for name, extra in (("llama.cpp", []), ("llama.cpp --repack 0", ["--repack", "0"])):
        runs[name] = bm.measured(name, [str(a.llama_bin / "llama-bench"), "-m", str(f), "-p", "0", "-n", str(a.cap),
                                        "-t", "1", "-r", "1", "-o", "json", *extra], limit, a.ll_timeout, [f],
                                 rb.parse_llama, a.cap + 1, ll_env)
    ll_lim = max(bm.tps0(r) for k, r in runs.items() if k.startswith("llama.cpp"))
    rows = []
    for name, r in runs.items():
        mine = not name.startswith("llama.cpp")
        per_tok = r.extra["disk_bytes"] / 1e9 / max(1, r.extra["n_tokens"])
        vs_own = f"{bm.tps0(r) / full.tps:.2f}x" if mine and full.tps else "-"
        vs_ll = "-" if not mine else f"{bm.tps0(r) / ll_lim:.1f}x" if ll_lim else "llama.cpp 0"
        same = "-" if not mine or "--bench" in name else "yes" if r.rc == 0 and r.text == full.text else "no"
        state = " (killed)" if r.killed else " (timed out)" if r.timed_out else ""
        rows.append(f"| {shape} | {name} | {rb.fmt(full.tps) if mine else '-'} | {bm.tps0(r):.3f}{state} | {vs_own} | "
                    f"{vs_ll} | {bm.projection(r, full.tps) if mine else '-'} | {per_tok:.3f} | "
                    f"{r.cg_peak / 1e9:.2f} | {same} |")
        if mine and r.extra.get("hit") is not None:
            x = r.extra
            rows.append(f"| {shape} | (its reads) | resident {x['hot']} of {x['experts']} experts ({x['hot_mb']} MB), "
                        f"cache {x['cache']} ({x['cache_mb']} MB) | per pass {x['read_per_pass']} experts, "
                        f"{x['mb_per_pass']} MB | hit {x['hit']}% (resident {x['hit_resident']}%, cache "
                        f"{x['hit_cache']}%) | waiting {x['wait_ms']:.0f} ms per pass | per decode token "
                        f"{x.get('dec_experts')} experts, {x.get('dec_mb')} MB, waiting {x.get('dec_wait_ms')} ms | "
                        f"NVMe projection from these reads: {nvme(x, full.tps)} tok/s | | | |")
    log.append({"shape": shape, "limit": limit, "budget_gib": budget, "unlimited": asdict(full),
                **{k: asdict(v) for k, v in runs.items()}})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="make_moe_model.py's output folder")
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's bin folder (llama-bench)")
    ap.add_argument("--shapes", default=",".join(bm.SHAPES))
    ap.add_argument("--depth", type=int, default=None, help="layers (folder l<depth>; default the deepest)")
    ap.add_argument("--share", type=float, default=0.4, help="cgroup limit as a share of the file size")
    ap.add_argument("--budget-margin", type=float, default=0.15, help="GiB between the cgroup limit and --ram-budget")
    ap.add_argument("--act-root", type=Path, default=Path("/tmp/pi-moe-activation"),
                    help="folder of the routing counts, one subfolder per shape (written once)")
    ap.add_argument("--profile-tokens", type=int, default=512, help="calibration tokens for the routing counts")
    ap.add_argument("--avx2", action="store_true", help="pi-run with AVX2-only kernels and torch, f32 compute")
    ap.add_argument("--cap", type=int, default=4, help="llama.cpp's decode tokens under the limit")
    ap.add_argument("--n-text", type=int, default=8, help="greedy tokens of the pi-run runs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pi-run run")
    ap.add_argument("--ll-timeout", type=float, default=300.0, help="seconds per llama.cpp run under the limit")
    ap.add_argument("--no-bench-run", dest="bench_run", action="store_false",
                    help="skip the --bench run under the limit (its read counters)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if os.geteuid() != 0 or not rb.CGROUP.is_dir():
        ap.error(f"the limited runs need root and the cgroup v1 memory controller at {rb.CGROUP}")
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    files = {s: bm.deep_file(a.dir, s, a.depth) for s in shapes}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    probe = rb.disk_probe(next(iter(files.values())))
    head = (f"bench_moe_ram: {stamp}, {os.cpu_count()} CPUs, 1 thread, pi-run {'AVX2-only' if a.avx2 else 'native'}; "
            f"disk (O_DIRECT): random 8 KB reads {probe['iops_qd1']:.0f}/s at queue depth 1, {probe['iops_qd16']:.0f}/s "
            f"at 16, sequential 1 MB {probe['seq_mb_s']:.0f} MB/s; load average {os.getloadavg()[0]:.2f}")
    print(head, flush=True)
    out = [head, "", "| shape | engine | pi-run unlimited tok/s | limited tok/s | vs unlimited | vs llama.cpp limited | "
           "NVMe projection tok/s | GB read per token | cgroup peak GB | greedy text == unlimited |",
           "|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    log: list = []
    jpath = a.json or Path(f"/tmp/bench-moe-ram-{stamp}.json")
    for shape, f in files.items():
        out += shape_rows(shape, f, a, log)
        jpath.write_text(json.dumps({"header": head, "runs": log}, indent=1))
    print("\n".join(out))
    print(f"load average {os.getloadavg()[0]:.2f}; raw runs: {jpath}")


if __name__ == "__main__":
    main()

"""Mixture-of-experts decode: pi-run against llama.cpp on the same files, in RAM and under a memory limit.

The files come from ``make_moe_model.py`` (run it first): llama.cpp's own Q4_0 of the designed
SmallThinker-21BA3B- and Qwen3-30B-A3B-shaped models, deepened (``OUT/<shape>/l<depth>/llama-q4_0.gguf``).
Both engines read the same file.

1. In RAM, 1 and 2 threads, engines interleaved in rounds (order rotating): llama.cpp's
   ``llama-bench -p P -n N -r 1`` and pi-run in ``bench_llama3.py``'s ``--child`` mode (load, warm up,
   time a P-token prompt and N decode steps from an empty cache), AVX2-only kernels and torch with
   ``--avx2`` (``bench_llama3.PiRun``). Medians over rounds and the ratio pi-run / llama.cpp.
2. Greedy text, in RAM: ``llama-completion --temp 0`` and ``pi-run --temp 0`` on the same prompt (the
   runtimes compared token for token; the model is random, so its text is noise).
3. Under a memory cgroup limited to ``--share`` (0.4) of the file, the file evicted from the page
   cache before every run (``bench_ram_budget.run``): llama.cpp (``llama-bench -p 0 -n CAP``, as it runs by
   default, Q4_0 repacked for AVX2 into anonymous memory, and with ``--repack 0``), pi-run
   (greedy, its text compared with the unlimited run's) and pi-run ``--ram-budget`` (when the runtime
   takes it for this file), at each thread count; a killed run counts as 0 tok/s, and pi-run is compared
   with the better of the two llama.cpp runs. Every run's bytes
   and requests read from the disk (``/proc/diskstats``, the whole machine's, during the run) give the
   reads per token and a projection onto an NVMe disk (3 GB/s, 500K IOPS) as ``bench_ram_budget.py``
   makes it: 1 / (the unlimited run's time per token + max(requests / 500K, bytes / 3 GB/s)).
   The disk's own rates come from an O_DIRECT probe (``bench_ram_budget.disk_probe``).

A runtime that cannot load a file (the one-line refusal of a family it does not know) is reported as
"not loadable: <its line>", and its later runs on that file are skipped. Raw results go to
``--json`` (default ``DIR/bench-moe-<UTC>.json``). Needs root and the cgroup v1 memory controller
for part 3 (``--no-limit`` skips it). Run under ``flock /tmp/pi-bench.lock``.

    python benchmarks/bench_moe.py /work/benchdata/moe --llama-bin LLAMA_BUILD/bin --avx2 \\
        --threads 1,2 --rounds 2 -p 64 -n 32
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ram_budget as rb  # noqa: E402
from bench_llama3 import AVX2_ENV, LlamaBench, PiRun, Result, load_avg1  # noqa: E402

SHAPES = ("smallthinker-21b", "qwen3-30b-a3b")
TEXT_ARGS = ["--temp", "0", "--ignore-eos"]


# ---------------------------------------------------------------------------- files and refusals
def deep_file(d: Path, shape: str, depth: int | None) -> Path:
    """``d/shape/l<depth>/llama-q4_0.gguf``; without ``depth`` the deepest one there."""
    if depth is not None:
        return d / shape / f"l{depth}" / "llama-q4_0.gguf"
    files = sorted((d / shape).glob("l*/llama-q4_0.gguf"), key=lambda p: int(p.parent.name[1:]))
    if not files:
        raise SystemExit(f"{d / shape}: no l*/llama-q4_0.gguf; make them with python benchmarks/make_moe_model.py {d}")
    return files[-1]


def refusal(text: str) -> str:
    """The runtime's one-line refusal in ``text`` (``Error: ...``, or a child's ``PowerInferError: ...``),
    or its last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("error:", "Error:")):
            return ln
        if "PowerInferError: " in ln:
            return "Error: " + ln.split("PowerInferError: ", 1)[1]
    return lines[-1][:300] if lines else "no output"


# ---------------------------------------------------------------------------- 1. in RAM
def in_ram(files: dict[str, Path], threads: list[int], rounds: int, n_prompt: int, n_gen: int, avx2: bool,
           llama: LlamaBench, timeout: float, log: list) -> list[Result]:
    ours = PiRun(avx2=avx2)
    engine = "pi-run avx2" if avx2 else "pi-run"
    refused: dict[str, str] = {}
    results = []
    for shape, f in files.items():
        depth = int(f.parent.name[1:])
        for th in threads:
            cell = [("llama.cpp", llama), (engine, ours)]
            for rnd in range(rounds):
                for name, eng in cell[rnd % 2:] + cell[: rnd % 2]:
                    if name != "llama.cpp" and shape in refused:
                        continue
                    res = Result(name, shape, depth, th, rnd + 1, str(f), f.stat().st_size, load_avg=load_avg1())
                    eng.run(res, n_prompt, n_gen, timeout)
                    if res.error and name != "llama.cpp":
                        refused[shape] = refusal(res.error)
                        res.error = f"not loadable: {refused[shape]}"
                    results.append(res)
                    line = (f"  {shape} {depth}L t{th} r{rnd + 1} {name:<12} " +
                            (f"FAILED {res.error}" if res.error else
                             f"decode {res.decode_tps or 0:7.2f} tok/s  prompt {res.prompt_tps or 0:7.2f} tok/s  "
                             f"peak RSS {res.peak_rss / 1e9:5.2f} GB  load {res.load_avg:.2f}  ({res.wall_s:.0f} s)"))
                    print(line, flush=True)
                    log.append(asdict(res))
    return results


def med(rs: list[Result], key: str) -> float | None:
    xs = [getattr(r, key) for r in rs if not r.error and getattr(r, key)]
    return statistics.median(xs) if xs else None


def ram_medians(results: list[Result]) -> dict:
    """{(shape, threads, "llama.cpp" or "pi-run"): median decode tok/s} of part 1's runs."""
    out = {}
    for r in results:
        key = (r.type, r.threads, "llama.cpp" if r.engine == "llama.cpp" else "pi-run")
        out.setdefault(key, med([x for x in results if (x.type, x.threads) == key[:2]
                                 and (x.engine == "llama.cpp") == (key[2] == "llama.cpp")], "decode_tps"))
    return out


def ram_table(results: list[Result]) -> str:
    out = ["| shape | layers | threads | llama.cpp decode tok/s | pi-run decode tok/s | decode ratio | "
           "llama.cpp prompt tok/s | pi-run prompt tok/s | prompt ratio | peak RSS GB (llama.cpp / pi-run) | file GB |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for key in dict.fromkeys((r.type, r.depth, r.threads) for r in results):
        rs = [r for r in results if (r.type, r.depth, r.threads) == key]
        ll, pi = [r for r in rs if r.engine == "llama.cpp"], [r for r in rs if r.engine != "llama.cpp"]
        cells = []
        for k in ("decode_tps", "prompt_tps"):
            a, b = med(ll, k), med(pi, k)
            bad = next((r.error for r in pi if r.error), "") if b is None else ""
            cells += [f"{a:.2f}" if a else "-", f"{b:.2f}" if b else (bad[:80] or "-"),
                      f"**{b / a:.2f}x**" if a and b else "-"]
        rss = [med(x, "peak_rss") for x in (ll, pi)]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " | "
                   + " / ".join(f"{x / 1e9:.2f}" if x else "-" for x in rss) + f" | {rs[0].file_bytes / 1e9:.2f} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------- 2 and 3: greedy text, the limit
def disk_counters() -> tuple[int, int]:
    """(read requests completed, bytes read) summed over the machine's whole disks (``/proc/diskstats``)."""
    reqs = sectors = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) > 5 and re.fullmatch(r"(sd[a-z]+|vd[a-z]+|xvd[a-z]+|nvme\d+n\d+)", f[2]):
            reqs, sectors = reqs + int(f[3]), sectors + int(f[5])
    return reqs, sectors * 512


def llama_completion_cmd(binary: Path, f: Path, n: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(f), "-p", rb.PROMPT, "-n", str(n), "-t", str(threads), "--temp", "0",
            "--ignore-eos", "-no-cnv", "-c", "64", "--no-warmup"]


def generated(text: str) -> str:
    """The generated part of an engine's stdout (llama-completion echoes the prompt)."""
    text = text.strip()
    return text[len(rb.PROMPT):].strip() if text.startswith(rb.PROMPT) else text


def measured(name: str, cmd: list[str], limit: int | None, timeout: float, evict: list[Path], parse,
             n_tokens: int, env: dict | None = None) -> rb.Result:
    """One ``bench_ram_budget.run`` with the disk's reads during it in ``extra``."""
    r0 = disk_counters()
    res = rb.run(name, cmd, limit, timeout, evict, env)
    r1 = disk_counters()
    parse(res)
    res.extra.update(disk_reqs=r1[0] - r0[0], disk_bytes=r1[1] - r0[1], n_tokens=n_tokens)
    state = "OOM-killed (0)" if res.killed else "timed out" if res.timed_out else f"rc {res.rc}"
    print(f"  {name}{' (limited)' if limit else ''}: {rb.fmt(res.tps, 3)} tok/s, {state}, peak RSS "
          f"{res.peak_rss / 1e9:.2f} GB, cgroup peak {res.cg_peak / 1e9:.2f} GB, read {res.extra['disk_bytes'] / 1e9:.2f} "
          f"GB in {res.extra['disk_reqs']} requests, {res.seconds:.0f} s", flush=True)
    if res.rc not in (0, None) and not res.killed and not res.timed_out:
        print(f"    {refusal(res.err + chr(10) + res.text)}", flush=True)
    return res


def tps0(r: rb.Result | None) -> float:
    """Tokens/s with a killed or timed-out run counted as 0."""
    return 0.0 if r is None or r.killed or r.tps is None else r.tps


def projection(r: rb.Result, unlimited_tps: float | None) -> str:
    """NVMe (3 GB/s, 500K IOPS) tok/s from the run's reads per token and the unlimited time per token."""
    if not unlimited_tps or not r.extra.get("n_tokens") or r.killed or not r.tps:
        return "-"
    n = r.extra["n_tokens"]
    io = max(r.extra["disk_reqs"] / n / 500e3, r.extra["disk_bytes"] / n / 3e9)
    return f"{1 / (1 / unlimited_tps + io):.2f}"


def limited(f: Path, shape: str, threads: list[int], share: float, cap: int, n_text: int, timeout: float,
            bins: Path, budget_margin: float, ram: dict, log: list, avx2: bool,
            activation: Path | None = None) -> list[str]:
    """Part 2 and 3 for file ``f``: the table rows (markdown); ``avx2``: pi-run's kernels built for
    ``haswell``, torch limited to AVX2, f32 compute (as ``bench_llama3.PiRun``); ``activation``: the
    folder ``--ram-budget`` reads routing counts from (``pi-profile`` of the file)."""
    llama_bench, completion = bins / "llama-bench", bins / "llama-completion"
    env = {"LD_LIBRARY_PATH": f"{bins}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    limit = int(share * f.stat().st_size)
    budget = limit / rb.GIB - budget_margin
    print(f"{shape}: {f} {f.stat().st_size / 1e9:.2f} GB; cgroup limit {limit / 1e9:.2f} GB ({share}x); "
          f"--ram-budget {budget:.2f} GiB; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    pi_env = {"POWERINFER_MARCH": "haswell", **AVX2_ENV} if avx2 else {}
    for th in threads:
        t = ["-t", str(th)] + (["--dtype", "f32"] if avx2 else [])
        ll_text = measured(f"llama-completion t{th}", llama_completion_cmd(completion, f, n_text, th), None, timeout,
                           [], lambda r: None, n_text, env)
        full = measured(f"pi-run t{th}", rb.pi_cmd(f, n_text, TEXT_ARGS + t), None, timeout, [],
                        lambda r: rb.parse_pi(r, False), n_text, pi_env)
        loadable = full.rc == 0
        runs = {}
        if loadable:
            runs["pi-run"] = measured(f"pi-run t{th}", rb.pi_cmd(f, n_text, TEXT_ARGS + t), limit, timeout, [f],
                                      lambda r: rb.parse_pi(r, False), n_text, pi_env)
            budget_args = ["--ram-budget", f"{budget:.3f}"] + (["--activation", str(activation)] if activation else [])
            runs["pi-run --ram-budget"] = measured(
                f"pi-run --ram-budget t{th}", rb.pi_cmd(f, n_text, TEXT_ARGS + t + budget_args), limit, timeout, [f],
                lambda r: rb.parse_pi(r, False), n_text, pi_env)
        else:
            rows.append(f"| {shape} | {th} | pi-run not loadable: {refusal(full.err)[:120]} | | | | | | | |")
        # llama.cpp as it runs by default (Q4_0 repacked for AVX2 into anonymous memory), and on its
        # mapped file alone (--repack 0: every weight page reclaimable)
        for name, extra in (("llama.cpp", []), ("llama.cpp --repack 0", ["--repack", "0"])):
            runs[name] = measured(f"{name} t{th}", [str(llama_bench), "-m", str(f), "-p", "0", "-n", str(cap), "-t",
                                                    str(th), "-r", "1", "-o", "json", *extra], limit, timeout, [f],
                                  rb.parse_llama, cap + 1, env)
        pi_ram, ll_ram = ram.get((shape, th, "pi-run")) or full.tps, ram.get((shape, th, "llama.cpp"))
        ll_lim = max(tps0(r) for k, r in runs.items() if k.startswith("llama.cpp"))  # llama.cpp's best
        for name, r in runs.items():
            mine = not name.startswith("llama.cpp")
            unl = pi_ram if mine else ll_ram
            same = "-" if not mine else ("yes" if r.rc == 0 and r.text == full.text else
                                         f"no ({refusal(r.err).split(': ')[-1][:80]})" if r.rc else "no")
            vs_own = f"{tps0(r) / unl:.2f}x" if unl else "-"
            vs_ll = "-" if not mine else (f"{tps0(r) / ll_lim:.1f}x" if ll_lim else
                                          "llama.cpp 0" if tps0(r) else "-")
            per_tok = r.extra["disk_bytes"] / 1e9 / max(1, r.extra["n_tokens"])
            rows.append(f"| {shape} | {th} | {name} | {rb.fmt(unl)} | {tps0(r):.3f}{' (killed)' if r.killed else ''} | "
                        f"{vs_own} | {vs_ll} | {projection(r, unl)} | {per_tok:.2f} | {same} |")
        if loadable:
            same_ll = generated(ll_text.text) == generated(full.text)
            rows.append(f"| {shape} | {th} | pi-run greedy text == llama-completion's (in RAM) | {same_ll} | | | | | | |")
        log.append({"shape": shape, "threads": th, "unlimited": asdict(full), "llama_text": asdict(ll_text),
                    **{k: asdict(v) for k, v in runs.items()}})
    return rows


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="make_moe_model.py's output folder")
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's bin folder (llama-bench, llama-completion)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--depth", type=int, default=None, help="layers (folder l<depth>; default the deepest)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens (llama-bench -p; 0: none)")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="decode tokens")
    ap.add_argument("--avx2", action="store_true", help="pi-run with AVX2-only kernels and torch (bench_llama3.PiRun)")
    ap.add_argument("--share", type=float, default=0.4, help="cgroup limit as a share of the file size")
    ap.add_argument("--budget-margin", type=float, default=0.15, help="GiB between the cgroup limit and --ram-budget")
    ap.add_argument("--cap", type=int, default=4, help="llama.cpp's decode tokens under the limit")
    ap.add_argument("--n-text", type=int, default=8, help="greedy tokens of the text runs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (a limited run past it: 0 tok/s)")
    ap.add_argument("--no-ram", action="store_true", help="skip part 1")
    ap.add_argument("--no-limit", action="store_true", help="skip parts 2 and 3")
    ap.add_argument("--activation", type=Path, default=None,
                    help="for --ram-budget: a folder with one pi-profile activation folder per shape (ACT/<shape>)")
    ap.add_argument("--ram-from", type=Path, default=None,
                    help="with --no-ram: the in-RAM speeds of part 3's table from an earlier run's --json")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: {', '.join(bad)} not among {', '.join(SHAPES)}")
    for b in ("llama-bench", "llama-completion"):
        if not (a.llama_bin / b).is_file():
            ap.error(f"--llama-bin {a.llama_bin}: no {b} there")
    if not a.no_limit and (os.geteuid() != 0 or not rb.CGROUP.is_dir()):
        ap.error(f"the limited runs need root and the cgroup v1 memory controller at {rb.CGROUP} (or --no-limit)")
    threads = [int(x) for x in a.threads.split(",")]
    files = {s: deep_file(a.dir, s, a.depth) for s in shapes}
    for f in files.values():
        if not f.is_file():
            ap.error(f"{f}: not found; make it with python benchmarks/make_moe_model.py {a.dir}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    jpath = a.json or a.dir / f"bench-moe-{stamp}.json"
    header = (f"bench_moe: {stamp}, {os.cpu_count()} CPUs; pp{a.n_prompt} / tg{a.n_gen}, {a.rounds} rounds, threads "
              f"{a.threads}; pi-run {'AVX2-only' if a.avx2 else 'native'}; llama.cpp {a.llama_bin}; "
              f"load average {load_avg1():.2f}")
    print(header, flush=True)
    log: list = []
    ram: dict = {}
    out = [header]
    if not a.no_ram:
        results = in_ram(files, threads, a.rounds, a.n_prompt, a.n_gen, a.avx2, LlamaBench(a.llama_bin / "llama-bench"),
                         a.timeout, log)
        ram = ram_medians(results)
        out += ["\n## In RAM\n", ram_table(results)]
        jpath.write_text(json.dumps({"header": header, "runs": log}, indent=1))
    elif a.ram_from:
        ram = ram_medians([Result(**r) for r in json.loads(a.ram_from.read_text())["runs"]])
    if not a.no_limit:
        probe = rb.disk_probe(next(iter(files.values())))
        out += [f"\n## Under a memory cgroup of {a.share}x the file (page cache evicted first)\n",
                f"disk (O_DIRECT): random 8 KB reads {probe['iops_qd1']:.0f}/s at queue depth 1, "
                f"{probe['iops_qd16']:.0f}/s at 16; sequential 1 MB reads {probe['seq_mb_s']:.0f} MB/s\n",
                "| shape | threads | engine | in RAM tok/s | limited tok/s | vs own in RAM | vs llama.cpp limited | "
                "NVMe projection tok/s | GB read per token | greedy text == unlimited |",
                "|---|--:|---|--:|--:|--:|--:|--:|--:|---|"]
        for shape, f in files.items():
            out += limited(f, shape, threads, a.share, a.cap, a.n_text, a.timeout, a.llama_bin, a.budget_margin, ram, log,
                           a.avx2, a.activation / shape if a.activation else None)
            jpath.write_text(json.dumps({"header": header, "runs": log}, indent=1))
    print("\n".join(out))
    print(f"load average {os.getloadavg()[0]:.2f}; raw runs: {jpath}")


if __name__ == "__main__":
    main()

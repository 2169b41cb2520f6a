"""pi-server -np 8 against llama-server -np 8 -cb: aggregate tokens/s with 1, 2, 4, 8 concurrent
clients, time to first token, per-client fairness, greedy text in a batch against alone, and the
longest stall of running streams while a 512-token prompt is admitted.

    flock /tmp/pi-bench.lock python benchmarks/bench_batch_server.py \\
        --ours out/bench/bench-q4_0.powerinfer.gguf --llama out/bench/bench-llama-q4_0.gguf \\
        --llama-server /tmp/ext/llama.cpp/build/bin/llama-server -t 2

Both servers are started once (``-np 8``, ``-c 2048``: 256 tokens per slot, ``-t`` threads) and
called the same way, llama.cpp's native ``POST /completion`` with ``stream``, ``n_predict``,
greedy (``temperature 0``), ``ignore_eos``. For each round and each client count ``C`` the two
engines run in turn (the order alternating): ``C`` clients start together, each with its own
prompt (a different ~32-token slice of tests/data text each time, so no prompt cache helps) and
64 tokens. Per run: aggregate tokens/s (all tokens / time from the start to the last token), each
client's tokens/s (its tokens / its time from its request to its last token), time to the first
streamed text. The table gives medians over rounds, TTFT p50/p95 over every client of every
round, and fairness as the slowest client's tokens/s over the fastest one's (1.0: even).

Text: each prompt's greedy text with 8 clients is compared with its text alone (C = 1, same
prompt), over the first 32 tokens' worth of text, for both engines.

Stall: on servers restarted with ``-np 3`` (a 512-token prompt needs a slot longer than the
256 tokens of ``-np 8``), 2 streams of 160 tokens run; once both have streamed, a 512-token
prompt is sent; the largest gap between two streamed chunks of a running stream while that
prompt is admitted is reported (llama.cpp evaluates a whole ubatch of 512 at once; ours ``-ub``
prompt tokens per step).
Needs llama-server built outside the repository (cmake --build build --target llama-server).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "text" / "tinystories_sample.txt"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import load_avg  # noqa: E402
from bench_server import free_port, wait_healthy  # noqa: E402


class ServerProc:
    def __init__(self, name: str, cmd: list[str], port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        wait_healthy(self.proc, self.url, f"{name} ({' '.join(cmd)})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream(url: str, prompt, n: int, t_start: float, out: dict) -> None:
    """One streamed greedy request: fills ``out`` with ttft, t_end (from ``t_start``), tokens, text, chunk times."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": True}
    text, chunks, tokens = [], [], None
    out["chunks"] = chunks  # filled as text arrives (the stall measurement watches it)
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/completion", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            obj = json.loads(line[6:])
            if obj.get("content"):
                text.append(obj["content"])
                chunks.append(time.perf_counter())
            if obj.get("stop"):
                tokens = obj.get("tokens_predicted")
    t1 = time.perf_counter()
    out.update(ttft=(chunks[0] if chunks else t1) - t0, t_end=t1 - t_start, t_req=t1 - t0, tokens=tokens or 0,
               text="".join(text), chunks=chunks)


def run_clients(srv: ServerProc, prompts: list[str], n: int) -> dict:
    outs = [dict() for _ in prompts]
    t_start = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(srv.url, p, n, t_start, o)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(o["t_end"] for o in outs)
    tps = [o["tokens"] / o["t_req"] for o in outs]
    return {"agg": sum(o["tokens"] for o in outs) / wall, "ttft": [o["ttft"] for o in outs],
            "fair": min(tps) / max(tps), "texts": [o["text"] for o in outs], "tokens": [o["tokens"] for o in outs]}


def stall(srv: ServerProc, prompts: list[str], long_prompt: list[int], n: int) -> tuple[float, float]:
    """(largest gap between streamed chunks of the running streams while a long prompt is admitted,
    seconds until that request's first token)."""
    outs = [dict() for _ in prompts]
    t_start = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(srv.url, p, n, t_start, o)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    deadline = time.time() + 300
    while not all(o.get("chunks") for o in outs):  # every stream running
        if time.time() > deadline or not all(t.is_alive() or o.get("chunks") for t, o in zip(threads, outs)):
            raise SystemExit(f"{srv.name}: the streams of the stall test did not start")
        time.sleep(0.01)
    long_out: dict = {}
    t_admit = time.perf_counter()
    stream(srv.url, long_prompt, 4, t_start, long_out)
    t_first = t_admit + long_out["ttft"]
    for t in threads:
        t.join()
    gap = 0.0
    for o in outs:  # gaps between consecutive chunks that overlap [t_admit, t_first]
        c = o["chunks"]
        for a, b in zip(c, c[1:]):
            if b >= t_admit and a <= t_first:
                gap = max(gap, b - a)
    return gap, long_out["ttft"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", default="out/bench/bench-q4_0.powerinfer.gguf")
    ap.add_argument("--llama", default="out/bench/bench-llama-q4_0.gguf")
    ap.add_argument("--llama-server", default="/tmp/ext/llama.cpp/build/bin/llama-server")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("-n", type=int, default=64, help="tokens per client")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prompt-words", type=int, default=24, help="words of text per prompt (~32 tokens)")
    ap.add_argument("--long", type=int, default=512, help="tokens of the prompt admitted in the stall test")
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--extra", default="", help="extra pi-server flags, e.g. '--ffn-batch per-seq'")
    a = ap.parse_args()
    text = TEXT.read_text().split()
    counter = [0]

    def prompts(k: int) -> list[str]:  # k fresh ~32-token prompts
        out = []
        for _ in range(k):
            i = counter[0] = counter[0] + 1
            out.append(" ".join(text[(i * 37) % (len(text) - 40):][:a.prompt_words]))
        return out

    def start(n_par: int) -> list[ServerProc]:
        out = []
        p = free_port()
        out.append(ServerProc("pi-server", [sys.executable, "-m", "powerinfer.server.cli", "-m", a.ours, "--port",
                                            str(p), "-t", str(a.threads), "-np", str(n_par), "-c", str(a.ctx),
                                            "--log-level", "warning", *a.extra.split()], p))
        if not a.no_llama:
            p = free_port()
            out.append(ServerProc("llama-server", [a.llama_server, "-m", a.llama, "--port", str(p), "-t",
                                                   str(a.threads), "-tb", str(a.threads), "-np", str(n_par),
                                                   "-cb", "-c", str(a.ctx), "--log-disable"], p))
        return out

    print(f"load average before: {load_avg()}", flush=True)
    servers = start(a.parallel)
    try:
        for s in servers:  # warm-up: weights paged in, kernels built
            run_clients(s, prompts(2), 8)
        counts = [int(c) for c in a.clients.split(",")]
        res = {(s.name, c): [] for s in servers for c in counts}
        same_prompts = prompts(max(counts))  # the text check: these prompts alone, then 8 at once
        alone = {s.name: [run_clients(s, [q], 32)["texts"][0] for q in same_prompts] for s in servers}
        together = {s.name: run_clients(s, same_prompts, 32)["texts"] for s in servers}
        for r in range(a.rounds):
            for c in counts:
                order = servers if (r + c) % 2 == 0 else servers[::-1]
                for s in order:
                    out = run_clients(s, prompts(c), a.n)
                    res[(s.name, c)].append(out)
                    print(f"  round {r + 1} {s.name} C={c}: {out['agg']:.2f} tok/s, TTFT max "
                          f"{max(out['ttft']):.2f} s, fairness {out['fair']:.2f}, tokens {out['tokens']}", flush=True)
    finally:
        for s in servers:
            s.stop()
    # the stall: a 512-token prompt needs a slot of more than 512 tokens: -np 3 (682 each of 2048)
    stalls = {}
    servers3 = start(3)
    try:
        long_ids = [1] + [500 + (i * 7919) % 31000 for i in range(a.long - 1)]  # no cached prefix
        for s in servers3:
            run_clients(s, prompts(1), 4)
            stalls[s.name] = stall(s, prompts(2), long_ids, min(160, a.ctx // 3 - 40))
            print(f"  {s.name}: stall {stalls[s.name][0]:.2f} s", flush=True)
    finally:
        for s in servers3:
            s.stop()
    print(f"\n{a.threads} threads, -np {a.parallel}, {a.n} tokens per client, load average {load_avg()}")
    print("| engine | clients | aggregate tok/s | x one client | TTFT p50 s | TTFT p95 s | fairness (min/max) |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for s in servers:
        for c in counts:
            runs = res[(s.name, c)]
            agg = statistics.median(x["agg"] for x in runs)
            base.setdefault(s.name, agg)
            tt = sorted(t for x in runs for t in x["ttft"])
            p95 = tt[min(len(tt) - 1, int(round(0.95 * (len(tt) - 1))))]
            print(f"| {s.name} | {c} | {agg:.2f} | {agg / base[s.name]:.2f} | {statistics.median(tt):.2f} | "
                  f"{p95:.2f} | {statistics.median(x['fair'] for x in runs):.2f} |")
    if len(servers) == 2:
        for c in counts:
            ours = statistics.median(x["agg"] for x in res[("pi-server", c)])
            theirs = statistics.median(x["agg"] for x in res[("llama-server", c)])
            print(f"C={c}: pi-server / llama-server aggregate = {ours / theirs:.2f}")
    for s in servers:
        if s.name not in stalls:
            continue
        eq = sum(x == y for x, y in zip(alone[s.name], together[s.name]))
        print(f"{s.name}: greedy text of {len(same_prompts)} clients at once equals alone for {eq} of "
              f"{len(same_prompts)} (32 tokens)")
        gap, ttft = stalls[s.name]
        print(f"{s.name}: {a.long}-token prompt admitted beside 2 streams: longest stream stall {gap:.2f} s, "
              f"its first token after {ttft:.2f} s")


if __name__ == "__main__":
    main()

"""pi-server against pi-run on the same file: streamed decode speed, time to first token, and
throughput with concurrent clients.

    python benchmarks/bench_server.py -m out/demo/stories260K-relu.powerinfer.gguf
    python benchmarks/bench_server.py -m out/bench/bench-q4_0.powerinfer.gguf -n 64 -t 2

Needs the cores to itself. It starts ``pi-server`` once, then alternates, ``--rounds`` times:
``pi-run`` greedy with the text printed (its own tokens/s figure) and one streamed greedy request of the same length
(tokens/s between the first and the last streamed token, as the client sees them). Then it
measures the time to first token of ``--ttft-runs`` requests whose prompts are 32 tokens
(BOS + 31 random ids, a different first id each time so the KV cache cannot reuse a prefix),
and the total tokens/s of ``--clients`` concurrent streamed requests. Prints one table with
medians and the server/pi-run ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, name: str, tries: int = 1200) -> None:
    """Poll ``url``/health until it answers 200 (SystemExit if ``proc`` exits or never answers)."""
    for _ in range(tries):
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not start")


def start_server(model: str, threads: int, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer.server.cli", "-m", model, "--port", str(port),
                             "-t", str(threads), "--log-level", "warning"], stderr=subprocess.DEVNULL)
    wait_healthy(proc, f"http://127.0.0.1:{port}", "pi-server")
    return proc


def pi_run_tps(model: str, n: int, threads: int) -> float:
    """pi-run's own figure for greedy generation with the text printed (its "generation:" line)."""
    r = subprocess.run(["pi-run", "-m", model, "-n", str(n), "-t", str(threads), "--temp", "0", "--ignore-eos",
                        "-p", "Once upon a time"], capture_output=True, text=True, check=True)
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("generation:"))
    return float(line.split("(")[1].split()[0])


def stream(url: str, body: dict) -> tuple[float, list[float], int]:
    """(time to the first text, arrival times of the text chunks, tokens generated), seconds from
    the request. A chunk may carry several tokens when the client reads slower than the model."""
    t0 = time.perf_counter()
    times: list[float] = []
    n_tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                n_tokens = ch["usage"]["completion_tokens"]
            if ch["choices"] and ch["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
    return (times[0] if times else float("nan")), times, n_tokens


def server_stream_tps(url: str, n: int) -> float:
    """Tokens/s between the first and the last streamed text, as the client sees them."""
    body = {"prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "ignore_eos": True}
    _, times, n_tokens = stream(url, body)
    return (n_tokens - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    a = ap.parse_args()

    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(open_gguf(a.model))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(a.model, a.threads, port)
    try:
        stream(url, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})  # warm up (kernels built)
        run_tps, srv_tps = [], []
        for _ in range(a.rounds):
            run_tps.append(pi_run_tps(a.model, a.n, a.threads))
            srv_tps.append(server_stream_tps(url, a.n))
        rng = random.Random(0)
        ttft = []
        for i in range(a.ttft_runs):
            ids = [tok.bos_id] + [(7 + i) % tok.n_vocab] + [rng.randrange(3, tok.n_vocab) for _ in range(30)]
            t, _, _ = stream(url, {"prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
            ttft.append(t)
        results: list[int] = []

        def client(i: int) -> None:
            _, _, n_tokens = stream(url, {"prompt": f"Story {i}: Once upon a time", "max_tokens": a.n,
                                          "temperature": 0, "ignore_eos": True})
            results.append(n_tokens)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(10)
    r_med, s_med = statistics.median(run_tps), statistics.median(srv_tps)
    print(f"model: {a.model}  ({a.threads} thread{'s' if a.threads > 1 else ''}, {a.n} tokens per request, "
          f"{a.rounds} interleaved rounds)")
    print(f"{'pi-run, greedy, text printed':<38}{r_med:8.1f} tokens/s   rounds {', '.join(f'{x:.1f}' for x in run_tps)}")
    print(f"{'pi-server one streamed client':<38}{s_med:8.1f} tokens/s   rounds {', '.join(f'{x:.1f}' for x in srv_tps)}")
    print(f"{'  server / pi-run':<38}{s_med / r_med:8.3f}")
    print(f"{'time to first token, 32-token prompt':<38}{1e3 * statistics.median(ttft):8.1f} ms (median of "
          f"{len(ttft)}; min {1e3 * min(ttft):.1f}, max {1e3 * max(ttft):.1f})")
    print(f"{f'{a.clients} concurrent streamed clients':<38}{sum(results) / wall:8.1f} tokens/s in total "
          f"({sum(results)} tokens in {wall:.2f} s; requests served one at a time)")


if __name__ == "__main__":
    main()

"""Soak test of pi-server: ``-np 4`` under a steady mix of good, cancelled and bad requests for
several minutes, with the server's resident memory and open file descriptors sampled over time.

    python benchmarks/bench_soak.py                       # the demo model: 600 requests over 240 s
    python benchmarks/bench_soak.py --duration 600 --requests 3000 --clients 16 -m some.powerinfer.gguf

The model defaults to the bundled demo (powerinfer/assets/stories260K-relu) converted once to a
Q4_0 GGUF under ``out/soak/`` (``-m`` takes any GGUF instead). The server runs ``-np 4 -c 512``
(128 tokens per slot), ``--metrics``, ``-t`` threads. ``--requests`` requests start evenly over
``--duration`` seconds (request k at k x duration / requests, or as soon as one of the
``--clients`` threads is free), each drawn at random (``--seed``):

* good (60%): a prompt of 1-60 random token ids or a random slice of text, ``max_tokens`` 1-64
  (within the slot), ``ignore_eos``, greedy or seeded sampling, streamed or not, on
  /v1/completions, /v1/chat/completions or /completion: its token count must be ``max_tokens``
  exactly (usage / tokens_predicted) and it must end by length;
* cancelled (20%): a streamed request (100 tokens, or until the slot is full) whose client leaves
  after the first chunk;
* bad (20%): too long for a slot, bad JSON, a wrong type, an unknown model, an empty prompt, an
  id outside the vocabulary: each must get its 4xx.

Every ``--every`` seconds: the server's VmRSS and thread count (/proc/PID/status), its open file
descriptors (/proc/PID/fd), requests served and cancelled (/health). The report is that series,
then the drift from the first sample after ``--warmup`` seconds to the last one, taken once all
slots are idle. Exit 1 when a good request got a wrong count, a bad one a wrong code, any request
a 5xx or a transport error, or a slot stays busy at the end. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import free_port, wait_healthy  # noqa: E402

TEXT = ROOT / "powerinfer" / "assets" / "calibration.txt"
N_VOCAB_SAFE = 500  # ids 3..499 exist in the demo's 512-token vocabulary


def demo_gguf(out: Path) -> Path:
    """The demo model as a Q4_0 GGUF (made once)."""
    path = out / "demo-q4_0.gguf"
    if not path.is_file():
        from powerinfer import DEMO_MODEL
        from powerinfer.convert.writer import convert

        out.mkdir(parents=True, exist_ok=True)
        convert(DEMO_MODEL, path, outtype="q4_0", progress=False, upstream_warnings=False)
    return path


def proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "Threads:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


class Soak:
    def __init__(self, url: str, slot_ctx: int, seed: int):
        self.url, self.slot_ctx, self.seed = url, slot_ctx, seed
        self.words = TEXT.read_text().split()
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def note(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error is not None:
                self.errors.append(error)

    def one(self, rng: random.Random, client: httpx.Client) -> None:
        kind = rng.choices(["good", "cancel", "bad"], [60, 20, 20])[0]
        try:
            getattr(self, kind)(rng, client)
        except httpx.HTTPError as e:
            self.note(f"{kind} transport error", f"{kind}: {type(e).__name__}: {e}")

    def _prompt(self, rng: random.Random):
        if rng.random() < 0.5:
            return [1] + [rng.randrange(3, N_VOCAB_SAFE) for _ in range(rng.randint(0, 59))]
        i = rng.randrange(len(self.words) - 40)
        return " ".join(self.words[i:i + rng.randint(1, 15)])

    def good(self, rng: random.Random, client: httpx.Client) -> None:
        n = rng.randint(1, 64)
        route = rng.choice(["/v1/completions", "/v1/chat/completions", "/completion"])
        prompt = self._prompt(rng)
        body = {"ignore_eos": True, "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30)}
        if route == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else "Tell me a story."}]
            body["max_tokens"] = n
        elif route == "/completion":
            body.update(prompt=prompt, n_predict=n)
        else:
            body.update(prompt=prompt, max_tokens=n)
        if rng.random() < 0.5:
            body["stream"] = True
            if route != "/completion":
                body["stream_options"] = {"include_usage": True}
            got, end = None, None
            with client.stream("POST", self.url + route, json=body, timeout=300) as r:
                if r.status_code == 400 and "context" in r.read().decode():
                    return self.note("good too long (skipped)")  # a text prompt that tokenized past the slot
                if r.status_code != 200:
                    return self.note("good wrong status", f"{route} stream: HTTP {r.status_code}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if route == "/completion":
                        if obj.get("stop"):
                            got, end = obj["tokens_predicted"], obj["stop_type"]
                    else:
                        if obj.get("usage"):
                            got = obj["usage"]["completion_tokens"]
                        if obj.get("choices") and obj["choices"][0].get("finish_reason"):
                            end = obj["choices"][0]["finish_reason"]
        else:
            r = client.post(self.url + route, json=body, timeout=300)
            if r.status_code == 400 and "context" in r.text:
                return self.note("good too long (skipped)")
            if r.status_code != 200:
                return self.note("good wrong status", f"{route}: HTTP {r.status_code} {r.text[:200]}")
            obj = r.json()
            if route == "/completion":
                got, end = obj["tokens_predicted"], obj["stop_type"]
            else:
                got, end = obj["usage"]["completion_tokens"], obj["choices"][0]["finish_reason"]
        if got == n and end in ("length", "limit"):
            self.note("good ok")
        else:
            self.note("good wrong count", f"{route} stream={body.get('stream', False)}: {got} tokens "
                                          f"(want {n}), ended by {end}")

    def cancel(self, rng: random.Random, client: httpx.Client) -> None:
        prompt = [1] + [rng.randrange(3, N_VOCAB_SAFE) for _ in range(rng.randint(0, 19))]
        body = {"prompt": prompt, "max_tokens": 100 if rng.random() < 0.5 else None, "stream": True,
                "ignore_eos": True}  # 100 tokens, or until the slot's context is full
        with client.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return self.note("cancel wrong status", f"cancel: HTTP {r.status_code}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the client leaves mid-stream
        self.note("cancel ok")

    BAD = [({"prompt": [1] + [300] * 200, "max_tokens": 4}, 400),
           ({"prompt": "hi", "max_tokens": 5000}, 400),
           ({"prompt": "hi", "temperature": "hot"}, 400),
           ({"prompt": "hi", "model": "nope"}, 404),
           ({"prompt": [], "max_tokens": 3}, 400),
           ({"prompt": [1, 999999], "max_tokens": 3}, 400),
           ({"messages": [], "max_tokens": 3}, 400)]

    def bad(self, rng: random.Random, client: httpx.Client) -> None:
        if rng.random() < 0.2:
            r = client.post(self.url + "/v1/completions", content=b'{"prompt": "x", ', timeout=60,
                            headers={"content-type": "application/json"})
            want = 400
        else:
            body, want = rng.choice(self.BAD)
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = client.post(self.url + route, json=body, timeout=60)
        if r.status_code == want:
            self.note("bad ok")
        else:
            self.note("bad wrong status", f"bad: HTTP {r.status_code} (want {want}) {r.text[:200]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF to serve (default: the demo model as Q4_0)")
    ap.add_argument("--duration", type=float, default=240, help="seconds of load (default 240)")
    ap.add_argument("--requests", type=int, default=600,
                    help="requests in all, started evenly over the duration (default 600)")
    ap.add_argument("--clients", type=int, default=8, help="client threads sending them (default 8)")
    ap.add_argument("--every", type=float, default=10, help="seconds between samples (default 10)")
    ap.add_argument("--warmup", type=float, default=30, help="seconds before the baseline sample (default 30)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="server CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--json", type=Path, help="also write the samples and counts here")
    a = ap.parse_args()

    model = a.model or demo_gguf(ROOT / "out" / "soak")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "powerinfer.server.cli", "-m", str(model), "--port", str(port), "-np", "4",
           "-c", "512", "-t", str(a.threads), "--metrics", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    wait_healthy(proc, url, "pi-server")
    soak = Soak(url, 128, a.seed)
    samples = []
    t0 = time.time()
    stop = threading.Event()

    def sample(t: float) -> None:
        st = proc_status(proc.pid)
        h = httpx.get(url + "/health", timeout=30).json()
        samples.append({"t": round(t, 1), "rss_mib": st["VmRSS"] / 1024, "fds": st["fds"], "threads": st["Threads"],
                        "served": h["requests_served"], "cancelled": h["requests_cancelled"]})

    next_req = iter(range(a.requests))
    take = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        with httpx.Client() as c:
            while not stop.is_set():
                with take:
                    k = next(next_req, None)
                if k is None:
                    return
                time.sleep(max(0.0, t0 + k * a.duration / a.requests - time.time()))  # request k's start time
                soak.one(rng, c)

    print(f"pi-server -np 4 -c 512 -t {a.threads} on {model}; {a.requests} requests from {a.clients} clients "
          f"over {a.duration:.0f} s", flush=True)
    sample(0.0)
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
    for th in threads:
        th.start()
    next_t = a.every
    while (now := time.time() - t0) < a.duration or any(th.is_alive() for th in threads):
        time.sleep(max(0.0, min(next_t, a.duration) - now))
        sample(time.time() - t0)
        s = samples[-1]
        print(f"  {s['t']:6.0f} s  RSS {s['rss_mib']:7.1f} MiB  fds {s['fds']:3d}  threads {s['threads']:3d}  "
              f"served {s['served']:5d}  cancelled {s['cancelled']:4d}", flush=True)
        next_t += a.every
    stop.set()
    for th in threads:
        th.join(300)
    end = time.time() + 60
    while any(x["is_processing"] for x in httpx.get(url + "/slots", timeout=30).json()):
        if time.time() > end:
            soak.errors.append("a slot still busy 60 s after the last client stopped")
            break
        time.sleep(0.2)
    sample(time.time() - t0)
    final = samples[-1]
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    if proc.returncode not in (0, -15):
        soak.errors.append(f"pi-server exited {proc.returncode}: {proc.stderr.read()[-500:]}")

    base = next((s for s in samples if s["t"] >= a.warmup), samples[0])
    rss = [s["rss_mib"] for s in samples if s["t"] >= base["t"]]
    fds = [s["fds"] for s in samples if s["t"] >= base["t"]]
    c = soak.counts
    n_req = sum(c.values())
    print(f"\n{n_req} requests in {final['t']:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"resident memory after {base['t']:.0f} s: {base['rss_mib']:.1f} MiB -> {final['rss_mib']:.1f} MiB at the end "
          f"({final['rss_mib'] - base['rss_mib']:+.1f} MiB, {100 * (final['rss_mib'] / base['rss_mib'] - 1):+.1f}%), "
          f"range {min(rss):.1f}-{max(rss):.1f} MiB; first sample {samples[0]['rss_mib']:.1f} MiB")
    print(f"open file descriptors after {base['t']:.0f} s: {min(fds)}-{max(fds)} (first {samples[0]['fds']}, "
          f"end {final['fds']}); threads at the end {final['threads']}")
    if a.json:
        a.json.write_text(json.dumps({"samples": samples, "counts": dict(c), "errors": soak.errors}, indent=1))
    if soak.errors:
        print(f"\n{len(soak.errors)} errors, the first ones:\n  " + "\n  ".join(soak.errors[:10]))
        return 1
    print("every good request got its token count; every bad one its 4xx; no 5xx")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV cache types against each other: decode tokens/s at a long context, and pi-run's peak RSS.

1. ``decode``: one process loads MODEL once per cache type (``-ctk``/``-ctv`` alike), evaluates the
   same ``--prompt-tokens`` of tests/data/text/tinystories_val.txt into each cache, then decodes
   ``--steps`` greedy tokens from there with each, interleaved for ``--rounds`` rounds (the order
   alternating), and prints each type's median tokens/s and the ratios to the first type. At a long
   context decode attention reads the whole cache every token: an f16 cache reads half the f32 bytes.
2. ``rss``: runs ``pi-run -c CTX`` with the context filled (a prompt of ``CTX - 108`` tokens, 100
   generated) once per type in turn, and prints each run's peak resident set (``wait4``'s
   ``ru_maxrss``) beside the file size plus the KV cache's bytes (the target: peak <= 1.15 x that).

    python benchmarks/bench_kv_cache.py decode MODEL.gguf --prompt-tokens 1500 --types f16,f32
    python benchmarks/bench_kv_cache.py rss MODEL.gguf --ctx 2048 --types f16,f32
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ROOT / "tests" / "data" / "text" / "tinystories_val.txt"


def _prompt_ids(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT.read_text(encoding="utf-8")[:40 * n])
    if len(ids) < n:
        raise SystemExit(f"{TEXT}: only {len(ids)} tokens, {n} asked for")
    return ids[:n]


def decode(a) -> None:
    import torch

    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.model import Transformer
    from powerinfer.runtime.tokenizer import GGUFTokenizer
    from powerinfer.runtime.weights import compute_dtype

    torch.set_num_threads(a.threads)
    g = open_gguf(a.model)
    ids = _prompt_ids(GGUFTokenizer(g), a.prompt_tokens)
    n_ctx = a.prompt_tokens + a.steps + 1
    models = {t: Transformer(g, compute_dtype(a.dtype), n_ctx=n_ctx, cache_type_k=t, cache_type_v=t) for t in a.types}
    first, tps = {}, {t: [] for t in a.types}
    with torch.inference_mode():
        for t, m in models.items():
            first[t] = int(m.forward(torch.tensor(ids), 0).argmax())
        for r in range(a.rounds):
            for t in (a.types if r % 2 == 0 else a.types[::-1]):
                m, tk = models[t], first[t]
                t0 = time.perf_counter()
                for i in range(a.steps):
                    tk = int(m.forward(torch.tensor([tk]), a.prompt_tokens + i).argmax())
                tps[t].append(a.steps / (time.perf_counter() - t0))
    base = statistics.median(tps[a.types[0]])
    print(f"decode at {a.prompt_tokens} tokens of context, {a.threads} thread(s), {a.rounds} rounds of {a.steps} tokens:")
    for t, v in tps.items():
        med = statistics.median(v)
        print(f"  {t:5s} median {med:.2f} tok/s ({med / base:.3f}x {a.types[0]}); rounds: "
              + " ".join(f"{x:.2f}" for x in v))


def rss(a) -> None:
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.args import ModelArgs
    from powerinfer.runtime.kv_cache import KVCache, cache_dtype
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    g = open_gguf(a.model)
    args = ModelArgs.from_gguf(g)
    ids = _prompt_ids(GGUFTokenizer(g), a.ctx - 108)
    size = os.path.getsize(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        prompt.write_text(GGUFTokenizer(g).decode(ids), encoding="utf-8")
        for t in a.types:
            kv = KVCache.nbytes(args.n_layer, a.ctx, args.n_head_kv, args.head_dim, cache_dtype(t))
            cmd = [sys.executable, "-m", "powerinfer.runtime.cli", "-m", a.model, "-c", str(a.ctx), "-f", str(prompt),
                   "-n", "100", "--temp", "0", "--ignore-eos", "-t", str(a.threads), "-ctk", t, "-ctv", t]
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            err = p.stderr.read()
            _, status, ru = os.wait4(p.pid, 0)
            if status != 0:
                raise SystemExit(f"pi-run -ctk {t} failed:\n{err[-2000:]}")
            peak = ru.ru_maxrss * 1024
            print(f"  {t:5s} peak RSS {peak / 1e9:.3f} GB; file {size / 1e9:.3f} GB + KV cache {kv / 1e9:.3f} GB = "
                  f"{(size + kv) / 1e9:.3f} GB; ratio {peak / (size + kv):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["decode", "rss"])
    ap.add_argument("model")
    ap.add_argument("--types", default="f16,f32", help="comma-separated cache types (the first is the base)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="f32", help="compute dtype (decode)")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="context before decoding (decode)")
    ap.add_argument("--steps", type=int, default=16, help="tokens per round (decode)")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (decode)")
    ap.add_argument("--ctx", type=int, default=2048, help="-c of the pi-run runs (rss)")
    a = ap.parse_args()
    a.types = a.types.split(",")
    (decode if a.what == "decode" else rss)(a)


if __name__ == "__main__":
    main()

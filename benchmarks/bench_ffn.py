"""Micro-benchmarks of one FFN layer and its predictor at batch 1 (decode), per kernel backend.

For a Llama-2-7B-shaped layer (n_embd 4096, n_ff 11008, predictor hidden 1024)
with random weights (``--layers`` copies, used in turn like a model's layers
so no call finds its weights in cache), it times: the dense FFN, the sparse FFN on predicted-active
sets drawn from a power law over neurons (each token ~``--active`` of n_ff, a new
set every call, so rows come from memory, not cache), and the predictor alone,
with the ``c`` and ``torch`` kernel backends, in bf16 and f32, on 1 and 2
threads. Each line gives the median time, the weight bytes the call reads, and
the rate that implies, next to a read-bandwidth probe (a large ``torch.sum``).

    python benchmarks/bench_ffn.py                 # 7B shape, bf16 + f32, 1 and 2 threads
    python benchmarks/bench_ffn.py --n-embd 512 --n-ff 1376 --threads 1 --dtypes bf16
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.synthetic import power_law_probs  # noqa: E402
from powerinfer.families import Activation, family_for_gguf_arch  # noqa: E402
from powerinfer.runtime import kernels  # noqa: E402
from powerinfer.runtime.ffn import FFN  # noqa: E402
from powerinfer.runtime.weights import empty  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 3) -> float:
    """GB/s of a ``torch.sum`` over ``nbytes`` of f32 (best of ``reps``), on the current threads."""
    buf = read_bandwidth.buf if getattr(read_bandwidth, "buf", None) is not None else None
    if buf is None or buf.numel() * 4 != nbytes:
        buf = read_bandwidth.buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def timed(fn, n: int, warm: int = 3) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def rand_weights(shape, dtype, gen):
    w = empty(shape, dtype)
    for chunk in w.split(1024):
        chunk.copy_(torch.randn(chunk.shape, generator=gen) * 0.02)
    return w


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--hidden", type=int, default=1024, help="predictor hidden size")
    ap.add_argument("--active", type=float, default=0.10, help="mean predicted-active share")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--backends", default="c,torch")
    ap.add_argument("-n", "--iters", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4, help="weight copies cycled through (defeats the cache)")
    a = ap.parse_args(argv)
    D, Fn, H = a.n_embd, a.n_ff, a.hidden
    gen = torch.Generator().manual_seed(0)
    p, _ = power_law_probs(Fn, a.active, 0.54)
    p = torch.from_numpy(p[np.random.default_rng(0).permutation(Fn)]).float()
    masks = [(torch.rand(Fn, generator=gen) < p)[None] for _ in range(64)]  # [1, F] each
    share = torch.cat(masks).float().mean().item()
    fam = family_for_gguf_arch("llama")
    print(f"FFN n_embd {D}, n_ff {Fn}, predictor hidden {H}; sparse sets: {100 * share:.1f}% of n_ff on average, "
          f"power law over neurons, a new set per call")
    print(f"{'threads':>7} {'dtype':>5} {'backend':>7} {'op':<16} {'median ms':>9} {'min ms':>7} {'MB read':>8} "
          f"{'GB/s':>6} {'read bw':>8}")
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        dense, sparse = [], []
        for _ in range(a.layers):  # cycled through like a model's layers, so nothing stays in cache
            gate, up, down_t = (rand_weights((Fn, D), dtype, gen) for _ in range(3))
            fc1, fc2 = rand_weights((H, D), dtype, gen), rand_weights((Fn, H), dtype, gen)
            sparse.append(FFN(fam, Activation("relu"), gate, up, down_t, fc1=fc1, fc2=fc2))
            dense.append(FFN(fam, Activation("relu"), gate, up, down_t.T.contiguous().T))  # ffn_down [D, F] layout
        x = (torch.randn(1, D, generator=gen)).to(dtype)
        esz = x.element_size()
        it = iter(range(1 << 30))
        L = a.layers

        def sparse_rows():
            i = next(it)
            return sparse[i % L](x, x, masks[i % 64])

        cases = [
            ("dense FFN", lambda: dense[next(it) % L](x, x), 3 * Fn * D * esz),
            ("sparse FFN rows", sparse_rows, 3 * share * Fn * D * esz),
            ("predictor", lambda: sparse[next(it) % L].predict(x), (H * D + Fn * H) * esz),
        ]
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            for be in a.backends.split(","):
                try:
                    kernels.set_backend(be)
                except RuntimeError as e:
                    print(f"  ({be} backend unavailable: {e})")
                    continue
                with torch.inference_mode():
                    for name, fn, nbytes in cases:
                        bw0 = read_bandwidth()
                        ts = timed(fn, a.iters)
                        bw = (bw0 + read_bandwidth()) / 2
                        med = statistics.median(ts)
                        print(f"{threads:>7} {dname:>5} {be:>7} {name:<16} {med * 1e3:9.3f} {min(ts) * 1e3:7.3f} "
                              f"{nbytes / 1e6:8.1f} {nbytes / med / 1e9:6.1f} {bw:8.1f}", flush=True)
        cases = dense = sparse = []  # free this dtype's weights before the next
    kernels.set_backend("auto")


if __name__ == "__main__":
    main()

"""Where one decode step's time goes: per-kernel time and bytes for pi-run on a GGUF.

Wraps the runtime's kernels (``linear`` for attention/output, ``linear`` inside the
FFN, ``predict``, ``rows_dot``, ``rows_axpy``, ``attend_one``) with timers, runs
``-n`` decode steps after a short prompt, and prints milliseconds per token, calls per
token and the share of the step for each, plus what is left (Python, norms, RoPE,
KV-cache writes, sampling). With ``--torch-profile`` it also prints torch.profiler's
table of the torch ops.

    python benchmarks/profile_decode.py out/bench/bench.powerinfer.gguf -t 1
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import ffn as ffn_mod
from powerinfer.runtime import kernels
from powerinfer.runtime import model as model_mod
from powerinfer.runtime.weights import compute_dtype


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=32, help="decode steps timed")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--kernels", default="auto", choices=["auto", "c", "torch"])
    ap.add_argument("--torch-profile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    kernels.set_backend(a.kernels)
    m = model_mod.Transformer(open_gguf(a.model), compute_dtype(a.dtype), dense=a.dense, n_ctx=512)
    # with one thread, thread CPU time ignores time other processes take from us
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    acc: dict[str, float] = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()

    def wrap(mod, name, label):
        f = getattr(mod, name)

        def timed(*args, **kw):
            t = clock()
            out = f(*args, **kw)
            acc[label] += clock() - t
            cnt[label] += 1
            return out

        setattr(mod, name, timed)

    wrap(model_mod, "linear", "attention qkv/out + output GEMVs")
    wrap(model_mod, "attend_one", "attention over the KV cache")
    wrap(ffn_mod, "linear", "dense FFN GEMVs")
    wrap(kernels, "predict", "predictor")
    wrap(kernels, "rows_dot", "sparse gate/up rows")
    wrap(kernels, "rows_axpy", "sparse down rows")
    call = kernels.SparseFFNCall.__call__  # the one-call sparse FFN: its predictor time comes back from C

    def fused(self, h, x):
        t = clock()
        out = call(self, h, x)
        acc["sparse FFN rows (one C call)"] += clock() - t - out[3]
        acc["predictor"] += out[3]
        cnt["sparse FFN rows (one C call)"] += 1
        cnt["predictor"] += 1
        return out

    kernels.SparseFFNCall.__call__ = fused
    with torch.inference_mode():
        m.forward(torch.arange(100, 132), 0)
        for p in range(32, 40):
            m.forward(torch.tensor([p * 7 % m.args.n_vocab]), p)
        acc.clear()
        cnt.clear()
        for layer in m.layers:
            layer.ffn.reset_stats()
        t0 = clock()
        for p in range(40, 40 + a.n):
            m.forward(torch.tensor([p * 7 % m.args.n_vocab]), p)
        total = clock() - t0
        if a.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for p in range(40 + a.n, 48 + a.n):
                    m.forward(torch.tensor([p * 7 % m.args.n_vocab]), p)
    share = m.active_share()
    print(f"{a.model}: {'dense' if m.dense else 'sparse'}, {str(m.dtype).removeprefix('torch.')}, kernels "
          f"{kernels.backend()}, {a.threads} thread(s); {1e3 * total / a.n:.2f} ms per decode step "
          f"({a.n / total:.1f} tokens/s{', CPU time' if a.threads == 1 else ''})"
          + (f"; {100 * share:.1f}% of FFN neurons computed" if share is not None else ""))
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<34} {1e3 * v / a.n:7.2f} ms  {cnt[k] // a.n:3d} calls  {100 * v / total:5.1f}%")
    rest = total - sum(acc.values())
    print(f"  {'rest (Python, norms, RoPE, cache)':<34} {1e3 * rest / a.n:7.2f} ms            {100 * rest / total:5.1f}%")
    if a.torch_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()

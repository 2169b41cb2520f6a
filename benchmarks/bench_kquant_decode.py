"""Dense decode per quant type against llama.cpp, on the same GGUF files (engines interleaved).

Each FILE is a dense llama GGUF of one type (made with llama.cpp's ``llama-quantize --pure`` from
an f16 GGUF our converter wrote, e.g. a one-layer 8B-Llama-3-shaped model: ``make_hf`` of
``powerinfer.synthetic`` with n_embd 4096, n_ff 14336, then ``pi-convert --outtype f16``). Per
round, per thread count and file: ``llama-bench -p 0 -n N -r 1`` (its decode tok/s), then this
runtime's :class:`~powerinfer.runtime.model.Transformer` decoding N tokens one at a time (median
step time). The table gives the median over rounds of tok/s for each, their ratio, and the
weight bytes each streams per token (the file's tensors minus ``token_embd``, which a token only
looks up) over the time per token, in GB/s.

    python benchmarks/bench_kquant_decode.py out/lc/Q4_K.gguf out/lc/Q6_K.gguf \\
        --llama-bench /work/ext/lcpp-build/bin/llama-bench --threads 1 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerinfer.formats.gguf_file import open_gguf  # noqa: E402
from powerinfer.runtime import kernels  # noqa: E402
from powerinfer.runtime.model import Transformer  # noqa: E402


def streamed_bytes(path: Path) -> int:
    g = open_gguf(path)
    return sum(int(t.n_bytes) for n, t in g.tensors.items() if n != "token_embd.weight")


def llama_bench(binary: str, path: Path, threads: int, n: int) -> float:
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
    r = subprocess.run([binary, "-m", str(path), "-p", "0", "-n", str(n), "-r", "1", "-t", str(threads), "-o", "json"],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {path}: {r.stderr[-400:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def ours(model: Transformer, n: int) -> float:
    ts = []
    with torch.inference_mode():
        model.forward(torch.tensor([1]), 0)
        for p in range(1, n + 1):
            t0 = time.perf_counter()
            model.forward(torch.tensor([3 + p % 100]), p)
            ts.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(ts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=32, help="tokens decoded per measurement")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    kernels.set_backend("c")
    models = {f: Transformer(open_gguf(f), n_ctx=a.n + 8) for f in a.files}
    nbytes = {f: streamed_bytes(f) for f in a.files}
    res: dict = {}
    for _ in range(a.rounds):
        for nt in a.threads:
            torch.set_num_threads(nt)
            for f in a.files:
                res.setdefault((nt, f, "llama.cpp"), []).append(llama_bench(a.llama_bench, f, nt, a.n))
                res.setdefault((nt, f, "ours"), []).append(ours(models[f], a.n))
    print(f"decode tok/s, median of {a.rounds} interleaved rounds, {a.n} tokens each; load {os.getloadavg()[0]:.1f}")
    print(f"{'thr':>3} {'file':>14} {'MB/tok':>7} {'llama.cpp':>10} {'ours':>8} {'ratio':>6} {'GB/s lc':>8} {'GB/s ours':>9}")
    rows = []
    for nt in a.threads:
        for f in a.files:
            lc, us = (statistics.median(res[(nt, f, e)]) for e in ("llama.cpp", "ours"))
            mb = nbytes[f] / 1e6
            print(f"{nt:>3} {f.name:>14} {mb:7.1f} {lc:10.2f} {us:8.2f} {us / lc:6.2f} {mb * lc / 1e3:8.2f} "
                  f"{mb * us / 1e3:9.2f}")
            rows.append({"threads": nt, "file": str(f), "mb_per_token": mb, "llama_cpp_tok_s": lc, "ours_tok_s": us,
                         "ratio": us / lc, "all": {e: res[(nt, f, e)] for e in ("llama.cpp", "ours")}})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

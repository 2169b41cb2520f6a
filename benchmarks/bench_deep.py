"""Full-depth decode speed: a 32-layer 7B-shaped Q4_0 model in pi-run (sparse and dense),
llama.cpp and upstream PowerInfer, each on its own quantizer's bytes of the same weights.

Make the files once (``make_bench_model.py`` for the 4-layer weights and designed
predictors, then each engine's quantizer, then ``make_deep_model.py`` to repeat every
layer 8 times), e.g.::

    python benchmarks/make_bench_model.py out/bench
    pi-quantize out/bench/bench.powerinfer.gguf out/bench/bench-q4_0.powerinfer.gguf q4_0
    LLAMA/build/bin/llama-quantize out/bench/bench.gguf out/bench/bench-llama-q4_0.gguf Q4_0
    POWERINFER/build/bin/quantize out/bench/bench.powerinfer.gguf out/bench/bench-up-q4_0.powerinfer.gguf Q4_0
    for f in bench-q4_0.powerinfer bench-llama-q4_0 bench-up-q4_0.powerinfer; do
        python benchmarks/make_deep_model.py out/bench/$f.gguf out/deep/$f.gguf; done
    python benchmarks/bench_deep.py --sparse out/deep/bench-q4_0.powerinfer.gguf \\
        --dense out/deep/bench-llama-q4_0.gguf --llama-bench LLAMA/build/bin/llama-bench \\
        --upstream POWERINFER/build/bin/main --upstream-file out/deep/bench-up-q4_0.powerinfer.gguf

(llama.cpp and upstream PowerInfer are built outside this repository from their own
sources.) pi-run runs in this process; llama.cpp (``llama-bench``, its own timing of a
``-n`` token generation) and upstream (``main``, its ``llama_print_timings``) run as child
processes. Rounds interleave the engines, the order rotating, with a read-bandwidth probe
around every run. Needs the cores to itself: the table prints the load average.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PROMPT, Engine, PiEngine, Run, UpstreamEngine, interleave, load_avg  # noqa: E402

from powerinfer.formats.gguf_file import open_gguf  # noqa: E402
from powerinfer.runtime.tokenizer import GGUFTokenizer  # noqa: E402


class LlamaBenchEngine(Engine):
    """llama.cpp's ``llama-bench`` (``-p P -n N -r 1 -o json``) on a dense GGUF, one process per run."""

    def __init__(self, name: str, binary: Path, path: Path):
        super().__init__(name)
        self.binary, self.path, self.threads = binary, path, 1
        g = open_gguf(path)
        self.bytes_per_token = sum(int(t.n_bytes) for t in g.reader.tensors if t.name != "token_embd.weight")

    def setup(self, threads):
        self.threads = threads

    def run(self, ids, n):
        r = subprocess.run([str(self.binary), "-m", str(self.path), "-p", str(len(ids)), "-n", str(n), "-t",
                            str(self.threads), "-r", "1", "-o", "json"], capture_output=True, text=True)
        try:
            rows = json.loads(r.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(f"{self.binary}: no JSON in its output: {r.stderr.strip()[-300:]}") from None
        tps = {("prompt" if row["n_prompt"] else "decode"): float(row["avg_ts"]) for row in rows}
        return Run(tps["decode"], tps.get("prompt", float("nan")), 0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sparse", type=Path, required=True, help="our PWRI Q4_0 file (pi-run sparse)")
    ap.add_argument("--dense", type=Path, required=True, help="llama.cpp's dense Q4_0 file (llama.cpp, pi-run --dense)")
    ap.add_argument("--llama-bench", type=Path, default=None, help="llama.cpp's llama-bench binary")
    ap.add_argument("--upstream", type=Path, default=None, help="upstream PowerInfer's main binary")
    ap.add_argument("--upstream-file", type=Path, default=None, help="upstream's own PWRI Q4_0 file")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-decode", type=int, default=64)
    ap.add_argument("--n-prompt", type=int, default=32)
    a = ap.parse_args(argv)
    engines: list[Engine] = [PiEngine("pi-run sparse", a.sparse, "auto", n_ctx=512),
                             PiEngine("pi-run dense", a.dense, "auto", dense=True, n_ctx=512)]
    if a.llama_bench is not None:
        engines.append(LlamaBenchEngine("llama.cpp", a.llama_bench, a.dense))
    if a.upstream is not None:
        engines.append(UpstreamEngine("upstream own file", a.upstream, a.upstream_file or a.sparse))
        if a.upstream_file is not None:
            engines.append(UpstreamEngine("upstream on ours", a.upstream, a.sparse))
    tok = GGUFTokenizer(open_gguf(a.dense))
    ids = tok.encode(PROMPT * 8)[: a.n_prompt]
    print(f"{a.sparse.name}: {a.n_prompt} prompt + {a.n_decode} decode tokens, {a.rounds} rounds; "
          f"load average {load_avg()}", flush=True)
    for threads in (int(t) for t in a.threads.split(",")):
        interleave(engines, ids, a.n_decode, a.rounds, threads)

if __name__ == "__main__":
    main()

"""Batch-1 decode speed of pi-run (sparse and dense), transformers and llama.cpp, side by side.

All engines load once in this process and run in interleaved rounds (the order
rotates every round), so each sees the same machine state; a read-bandwidth
probe (a large ``torch.sum``) is taken around every run, because bandwidth
sets the speed limit at batch 1 and can change under a benchmark (two threads
on some VMs flip between two levels every minute or so). For each engine the
table gives decode and prompt tokens/s (median over rounds, min-max), the weight
bytes one decode step reads, the bandwidth measured around its runs, the speed
limit bytes/bandwidth implies, and the share of that limit reached. With one
thread it also gives decode tokens per CPU-second of the decoding thread, which
other processes on the machine do not distort (they only take wall time).

Engines (on the same weights):

* ``pi-run sparse``: the PowerInfer GGUF through our runtime (predictors, sparse FFN rows);
* ``pi-run dense``: the dense GGUF through our runtime;
* ``transformers``: the HF folder with ``generate`` (greedy), bf16 by default;
* ``llama.cpp``: the dense GGUF through ``llama-cpp-python`` (skipped with a note
  when it is not installed: ``pip install llama-cpp-python``).

``--types`` picks the weight types: ``f16`` (the files above) and/or ``q4_0``, ``q8_0``
(both files quantized once with ``pi-quantize`` next to them, then the same three engines
on the quantized files: llama.cpp runs the very same dense quantized file). ``--rss``
also loads each engine alone in a fresh process and reports its resident memory against
the file size.

    python benchmarks/make_bench_model.py out/bench          # once: ~4.4 GB on disk
    python benchmarks/bench_decode.py out/bench              # 1 and 2 threads, 3 rounds
    python benchmarks/bench_decode.py out/bench --types q4_0,q8_0 --engines sparse,dense,llama.cpp --rss
    python benchmarks/bench_decode.py --demo                 # the bundled demo model
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ffn import read_bandwidth  # noqa: E402

from powerinfer.formats.gguf_file import open_gguf  # noqa: E402
from powerinfer.runtime import kernels  # noqa: E402
from powerinfer.runtime.generate import SamplerSettings, count_fired, decode_bytes_per_token, generate  # noqa: E402
from powerinfer.runtime.model import Transformer  # noqa: E402
from powerinfer.runtime.tokenizer import GGUFTokenizer  # noqa: E402
from powerinfer.runtime.weights import compute_dtype  # noqa: E402

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
          "friends. One day, she saw a big red ball under a tree and she ran to get it. ")


@dataclass
class Run:
    decode_tps: float
    prompt_tps: float
    bw: float  # GB/s around the run
    ffn_share: float | None = None
    active: float | None = None
    cpu_tps: float | None = None  # decode tokens per CPU-second of the calling thread (1 thread only)


@dataclass
class Engine:
    name: str
    bytes_per_token: float = 0.0
    runs: dict[int, list[Run]] = field(default_factory=dict)
    note: str = ""

    def setup(self, threads: int) -> None: ...

    def run(self, ids: list[int], n: int) -> Run: ...

    def close(self) -> None: ...


class PiEngine(Engine):
    """Our runtime on a GGUF (sparse for PWRI files unless ``dense``)."""

    def __init__(self, name: str, path: Path, dtype: str, dense: bool = False, n_ctx: int = 1024):
        super().__init__(name)
        self.model = Transformer(open_gguf(path), compute_dtype(dtype), dense=dense, n_ctx=n_ctx)
        self.bytes_per_token = decode_bytes_per_token(self.model, None if self.model.dense else 0.1)

    def run(self, ids, n):
        count_fired(self.model)
        st = generate(self.model, ids, n + 1, SamplerSettings(temp=0.0), None)
        if not self.model.dense:  # bytes from the rows really read
            self.bytes_per_token = decode_bytes_per_token(self.model, st.decode_active_share, st.decode_fired_share)
        return Run(st.gen_tps, st.prompt_tps, 0.0, st.ffn_share, st.decode_active_share, st.n_eval / st.cpu_gen)

    def close(self):
        del self.model


class HFEngine(Engine):
    """transformers ``generate`` (greedy, fixed length) with a streamer that time-stamps tokens."""

    def __init__(self, name: str, hf_dir: Path, dtype: torch.dtype):
        super().__init__(name)
        from powerinfer.hf import load_hf_model

        self.model = load_hf_model(hf_dir, dtype)
        self.bytes_per_token = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                                   if "embed_tokens" not in n)

    def run(self, ids, n):
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        cpu: list[float] = []

        class Clock(BaseStreamer):
            def put(self, value):
                stamps.append(time.perf_counter())
                cpu.append(time.thread_time())

            def end(self):
                pass

        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n + 1, min_new_tokens=n + 1,
                                do_sample=False, streamer=Clock(), pad_token_id=0)
        # stamps[0]: the prompt went in; stamps[1]: first new token (prefill done); then one per decode step
        n_dec = len(stamps) - 2
        return Run(n_dec / (stamps[-1] - stamps[1]), len(ids) / (stamps[1] - t0), 0.0,
                   cpu_tps=n_dec / (cpu[-1] - cpu[1]))

    def close(self):
        del self.model


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python on the dense GGUF; greedy argmax on its logits."""

    def __init__(self, name: str, path: Path, n_ctx: int = 1024):
        super().__init__(name)
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=1,
                                   n_threads_batch=1, verbose=False)
        g = open_gguf(path)
        self.bytes_per_token = sum(int(t.n_bytes) for t in g.reader.tensors if t.name != "token_embd.weight")

    def setup(self, threads):
        self.lib.llama_set_n_threads(self.llm.ctx, threads, threads)

    def run(self, ids, n):
        import numpy as np

        llm, n_vocab = self.llm, self.llm.n_vocab()

        def last_logits():
            return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t_prompt = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            llm.eval([int(last_logits().argmax())])
        return Run(n / (time.perf_counter() - t0), len(ids) / t_prompt, 0.0, cpu_tps=n / (time.thread_time() - c0))

    def close(self):
        self.llm.close()


class UpstreamEngine(Engine):
    """Upstream PowerInfer's ``main`` (built outside this repo; ``--upstream PATH``) on a PWRI file,
    one process per run; decode and prompt tokens/s from its ``llama_print_timings`` lines."""

    def __init__(self, name: str, binary: Path, path: Path):
        super().__init__(name)
        self.binary, self.path, self.threads = binary, path, 1
        self.bytes_per_token = float("nan")  # its sparse rows read are not reported

    def setup(self, threads):
        self.threads = threads

    def run(self, ids, n):
        import re

        import tempfile

        with tempfile.TemporaryDirectory() as cwd:  # its main writes main.log into the working folder
            r = subprocess.run([str(self.binary.resolve()), "-m", str(self.path.resolve()), "-n", str(n), "-t",
                                str(self.threads), "--temp", "0", "--ignore-eos", "-p", PROMPT[:4 * len(ids)]],
                               capture_output=True, text=True, cwd=cwd)
        tps = dict(re.findall(r"(prompt eval|\beval) time.*?([\d.]+) tokens per second", r.stderr))
        if "eval" not in tps:
            raise RuntimeError(f"{self.binary}: no timings in its output: {r.stderr.strip()[-300:]}")
        return Run(float(tps["eval"]), float(tps.get("prompt eval", "nan")), 0.0)


def busy_cores(seconds: float = 1.0) -> float:
    """Cores other processes kept busy over ``seconds`` while this one slept (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return 0.0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_idle(max_wait: float, limit: float = 0.2) -> None:
    """Sleep until other processes use under ``limit`` cores (at most ``max_wait`` s)."""
    t0 = time.time()
    while time.time() - t0 < max_wait:
        if busy_cores() < limit:
            return
    print(f"  (machine still busy after {max_wait:.0f} s: {busy_cores():.1f} cores used by others)", flush=True)


def load_avg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def fmt_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def table(engines: list[Engine], threads: int) -> str:
    head = (f"{'engine':<22} {'decode tok/s':>20} {'prompt tok/s':>22} {'MB/token':>9} {'bw GB/s':>8} "
            f"{'limit tok/s':>11} {'% limit':>7} {'FFN %':>6} {'active %':>8}"
            + (f" {'tok/CPU-s':>9}" if threads == 1 else ""))
    lines = [head, "-" * len(head)]
    for e in engines:
        rs = e.runs.get(threads, [])
        if not rs:
            lines.append(f"{e.name:<22} {e.note or 'not run'}")
            continue
        bw = statistics.median(r.bw for r in rs)
        if e.bytes_per_token != e.bytes_per_token:  # unknown bytes per token (upstream's sparse rows)
            lines.append(f"{e.name:<22} {fmt_range([r.decode_tps for r in rs]):>20} "
                         f"{fmt_range([r.prompt_tps for r in rs]):>22} {'-':>9} {bw:8.1f}")
            continue
        limit = bw * 1e9 / e.bytes_per_token
        dec = statistics.median(r.decode_tps for r in rs)
        ffn = [r.ffn_share for r in rs if r.ffn_share is not None]
        act = [r.active for r in rs if r.active is not None]
        lines.append(f"{e.name:<22} {fmt_range([r.decode_tps for r in rs]):>20} {fmt_range([r.prompt_tps for r in rs]):>22} "
                     f"{e.bytes_per_token / 1e6:9.{0 if e.bytes_per_token >= 1e8 else 2}f} {bw:8.1f} {limit:11.1f} {100 * dec / limit:6.0f}% "
                     f"{(f'{100 * statistics.median(ffn):5.1f}%') if ffn else '     -':>6} "
                     f"{(f'{100 * statistics.median(act):7.1f}%') if act else '       -':>8}"
                     + (f" {statistics.median(r.cpu_tps for r in rs):9.1f}"
                        if threads == 1 and all(r.cpu_tps for r in rs) else ""))
    return "\n".join(lines)


def interleave(engines: list[Engine], ids: list[int], n: int, rounds: int, threads: int,
               idle_wait: float = 0.0) -> None:
    """Warm every engine up, then ``rounds`` rounds of ``n`` decode tokens each, the order
    rotating every round, a read-bandwidth probe around each run; prints each run and the
    table for ``threads``. Engines with a ``note`` (not available) are left out."""
    torch.set_num_threads(threads)
    live = [e for e in engines if not e.note]
    for e in live:
        e.setup(threads)
        e.run(ids, 4)  # warm-up: page in weights, build kernels
    for r in range(rounds):
        if idle_wait > 0:
            wait_idle(idle_wait)
        for e in live[r % len(live):] + live[: r % len(live)]:
            bw0 = read_bandwidth()
            run = e.run(ids, n)
            run.bw = (bw0 + read_bandwidth()) / 2
            e.runs.setdefault(threads, []).append(run)
            print(f"  round {r + 1} t{threads} {e.name}: decode {run.decode_tps:.2f} tok/s, prompt "
                  f"{run.prompt_tps:.1f} tok/s, bw {run.bw:.1f} GB/s", flush=True)
        if idle_wait > 0:
            print(f"  (after round {r + 1}: {busy_cores(0.5):.2f} cores busy besides this benchmark)")
    print(f"\n{threads} thread{'s' if threads > 1 else ''} (load average {load_avg()}):")
    print(table(engines, threads) + "\n", flush=True)


def prepare_demo(out: Path) -> tuple[Path, Path, Path, str]:
    """The demo model's PWRI + dense GGUF and HF folder: the demo pipeline's output if present,
    else predictors trained here with pi-train-predictor on stories260K switched to ReLU."""
    asset = ROOT / "powerinfer" / "assets" / "stories260K-relu"
    demo = ROOT / "out" / "demo"
    if asset.is_dir():
        sparse, dense = demo / "stories260K-relu.powerinfer.gguf", demo / "stories260K-relu.gguf"
        if not (sparse.is_file() and dense.is_file()):
            subprocess.run(["bash", str(ROOT / "recipes" / "demo.sh"), str(demo)], check=True)
        return sparse, dense, asset, "demo pipeline (recipes/demo.sh)"
    from powerinfer.convert.writer import convert

    out.mkdir(parents=True, exist_ok=True)
    hf = out / "stories260K-relu-raw"
    if not hf.is_dir():
        shutil.copytree(ROOT / "tests" / "data" / "stories260K" / "hf", hf)
        for p in hf.iterdir():
            p.chmod(0o644)
        cfg = json.loads((hf / "config.json").read_text())
        cfg["hidden_act"] = "relu"
        (hf / "config.json").write_text(json.dumps(cfg))
    pred = out / "predictor"
    how = "stories260K with ReLU (not fine-tuned), predictors from pi-train-predictor"
    if not pred.is_dir():
        data = ROOT / "tests" / "data" / "text" / "tinystories_sample.txt"
        r = subprocess.run(["pi-train-predictor", str(hf), "--data", str(data), "--out", str(pred),
                            "--max-tokens", "16384"], capture_output=True, text=True)
        if r.returncode != 0:  # the all-active trick from the tests: sparse path, every neuron computed
            from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir

            cfg = json.loads((hf / "config.json").read_text())
            save_predictor_dir(pred, [LayerPredictor(torch.zeros(4, cfg["hidden_size"]),
                                                     torch.randn(cfg["intermediate_size"], 4))
                                      for _ in range(cfg["num_hidden_layers"])], {"sparse_threshold": 0.0})
            how = "stories260K with ReLU, all-active predictors (pi-train-predictor failed)"
    sparse, dense = out / "demo.powerinfer.gguf", out / "demo.gguf"
    if not sparse.is_file():
        convert(hf, sparse, pred, outtype="f16", progress=False)
    if not dense.is_file():
        convert(hf, dense, outtype="f16", progress=False)
    return sparse, dense, hf, how


def quantized_files(sparse: Path, dense: Path, qtype: str) -> tuple[Path, Path]:
    """``sparse``/``dense`` quantized to ``qtype`` beside them (written once with pi-quantize)."""
    from powerinfer.convert.quantize import quantize_file

    out = []
    for src in (sparse, dense):
        stem = src.name.split(".")[0]
        dst = src.with_name(src.name.replace(stem, f"{stem}-{qtype}", 1))
        if not dst.is_file():
            print(f"writing {dst} ...", flush=True)
            quantize_file(src, dst, qtype)
        out.append(dst)
    return out[0], out[1]


def _rss_kb(key: str = "VmRSS") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def probe(kind: str, path: str, threads: int) -> None:
    """(Child process.) Load one engine (context 256), decode 16 tokens, print its resident
    memory growth as JSON (the KV cache included: 256 positions)."""
    torch.set_num_threads(threads)
    base = _rss_kb()
    if kind == "llama.cpp":
        e: Engine = LlamaCppEngine(kind, Path(path), n_ctx=256)
    else:
        e = PiEngine(kind, Path(path), "auto", dense=kind == "dense", n_ctx=256)
    tok = GGUFTokenizer(open_gguf(path))
    e.run(tok.encode(PROMPT)[:32], 16)
    print(json.dumps({"rss_mb": (_rss_kb() - base) / 1024, "hwm_mb": (_rss_kb("VmHWM") - base) / 1024}))


def resident(engines: list[tuple[str, str, Path]]) -> str:
    """Resident memory of each engine loaded alone (fresh process) against its file size."""
    lines = [f"{'engine':<22} {'file MB':>9} {'RSS MB':>8} {'RSS/file':>8} {'peak MB':>8}"]
    for name, kind, path in engines:
        r = subprocess.run([sys.executable, __file__, "--probe", kind, str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            lines.append(f"{name:<22} probe failed: {r.stderr.strip()[-200:]}")
            continue
        m = json.loads(r.stdout.strip().splitlines()[-1])
        size = path.stat().st_size / 2**20
        lines.append(f"{name:<22} {size:9.0f} {m['rss_mb']:8.0f} {m['rss_mb'] / size:8.2f} {m['hwm_mb']:8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="out/bench", help="make_bench_model.py output folder")
    ap.add_argument("--demo", action="store_true", help="benchmark the bundled demo model instead")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-decode", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--n-prompt", type=int, default=32, help="prompt tokens per run")
    ap.add_argument("--dtype", default="auto", help="pi-run compute dtype (auto, bf16, f32)")
    ap.add_argument("--hf-dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--engines", default="sparse,dense,hf,llama.cpp")
    ap.add_argument("--kernels", default="auto", choices=["auto", "c", "torch"])
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each round, wait up to this long for other processes to leave the cores")
    ap.add_argument("--types", default="f16", help="weight types: f16 and/or q4_0, q8_0 (comma-separated)")
    ap.add_argument("--rss", action="store_true", help="also measure each engine's resident memory alone")
    ap.add_argument("--probe", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--predictor-types", default="", help="also run sparse files with these predictor types "
                    "(e.g. q4_0, upstream's choice), written once with pi-quantize --predictor-type")
    ap.add_argument("--upstream", type=Path, default=None,
                    help="upstream PowerInfer's main binary (built outside this repo): also run it on the "
                         "quantized PWRI files and on --upstream-file")
    ap.add_argument("--upstream-file", type=Path, default=None,
                    help="a PWRI file written by upstream's own quantize (e.g. Q4_0 of bench.powerinfer.gguf)")
    a = ap.parse_args(argv)
    if a.probe:
        return probe(a.probe[0], a.probe[1], 1)
    kernels.set_backend(a.kernels)
    if a.demo:
        sparse_path, dense_path, hf_dir, how = prepare_demo(Path(a.dir if a.dir != "out/bench" else "out/bench-demo"))
        print(f"demo model: {sparse_path.name} ({how})")
    else:
        d = Path(a.dir)
        sparse_path, dense_path, hf_dir = d / "bench.powerinfer.gguf", d / "bench.gguf", d / "hf"
        if not sparse_path.is_file():
            sys.exit(f"{sparse_path} not found: run python benchmarks/make_bench_model.py {d} first")
    tok = GGUFTokenizer(open_gguf(dense_path))
    ids = (tok.encode(PROMPT * 8))[: a.n_prompt]
    wanted = a.engines.split(",")
    engines: list[Engine] = []
    probes: list[tuple[str, str, Path]] = []
    for qt in a.types.split(","):
        sp, dp = (sparse_path, dense_path) if qt == "f16" else quantized_files(sparse_path, dense_path, qt)
        tag = qt.upper() if qt != "f16" else "f16"
        if "sparse" in wanted:
            engines.append(PiEngine(f"pi-run sparse {tag}", sp, a.dtype))
            probes.append((engines[-1].name, "sparse", sp))
            for pt in (x for x in a.predictor_types.split(",") if x and qt != "f16"):
                from powerinfer.convert.quantize import quantize_file

                pp = sp.with_name(sp.name.replace(f"-{qt}", f"-{qt}-pred{pt}", 1))
                if not pp.is_file():
                    quantize_file(sparse_path, pp, qt, predictor_type=pt)
                engines.append(PiEngine(f"pi-run sparse {tag} p{pt}", pp, a.dtype))
        if a.upstream is not None and qt != "f16":
            engines.append(UpstreamEngine(f"upstream on ours {tag}", a.upstream, sp))
        if "dense" in wanted:
            engines.append(PiEngine(f"pi-run dense {tag}", dp, a.dtype, dense=True))
            probes.append((engines[-1].name, "dense", dp))
        if "llama.cpp" in wanted:
            try:
                engines.append(LlamaCppEngine(f"llama.cpp {tag}", dp))
                probes.append((engines[-1].name, "llama.cpp", dp))
            except ImportError:
                e = Engine(f"llama.cpp {tag}")
                e.note = "skipped: llama-cpp-python is not installed (pip install llama-cpp-python)"
                engines.append(e)
                print(f"note: {e.note}")
    if a.upstream is not None and a.upstream_file is not None:
        engines.append(UpstreamEngine("upstream own file", a.upstream, a.upstream_file))
    if "hf" in wanted:
        engines.append(HFEngine(f"transformers {a.hf_dtype}", hf_dir,
                                torch.bfloat16 if a.hf_dtype == "bf16" else torch.float32))
    dt = str(compute_dtype(a.dtype)).removeprefix("torch.")
    print(f"pi-run: {dt}, kernels {kernels.backend()}; {len(ids)} prompt tokens, {a.n_decode} decode tokens, "
          f"{a.rounds} rounds; load average {load_avg()}")
    gc.collect()
    for threads in (int(t) for t in a.threads.split(",")):
        interleave(engines, ids, a.n_decode, a.rounds, threads, a.wait_idle)
    for e in engines:
        e.close()
    if a.rss:
        print("resident memory, each engine alone in a fresh process, context 256 (RSS growth over the "
          "interpreter with torch loaded; KV cache included):")
        print(resident(probes), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

"""Input-sparse (TEAL) decoding: the perplexity curve on stories260K and decode speed at 7B width.

1. ``ppl``: the real stories260K (SiLU, 260K parameters; ``tests/data/stories260K``, f32 GGUF) calibrated
   on the first 200 kB of ``tests/data/text/tinystories_val.txt`` through the runtime, uniform thresholds
   for each sparsity (and, with ``--greedy``, TEAL's greedy allocation from the same histograms; with
   ``--wina``, WINA's |x_j| * ||W[:, j]|| criterion from the same calibration run; with both, WINA's
   criterion under the greedy allocation too), perplexity
   on the last 100 kB (disjoint) with ``-c 256``: 0% is the dense file.
2. ``speed``: a random SiLU Llama of 7B width (n_embd 4096, n_ff 11008, 32 heads; ``--n-layer`` layers,
   512-token vocabulary), Q4_0 by ``pi-convert``, calibrated on TinyStories text; decode tokens/s of the
   dense GGUF, of the TEAL files at 0/40/50%, and of the 40% file run ``dense`` (every input row by
   AXPY: the cost of the input-major layout), in interleaved rounds (the order rotates), median of
   rounds, with the load average (the machine may be shared: compare the ratios).

3. ``llama3``: the Llama-3-8B-shaped Q4_0 benchmark files of ``make_llama3_model.py`` (DIR/l4/pi-q4_0.gguf,
   DIR/l32/pi-q4_0.gguf, DIR/l32/llama-q4_0.gguf). The 4-layer file is calibrated through the runtime on the
   first 3 kB of ``tinystories_val.txt`` and written as TEAL files at 0/40/50% (uniform thresholds; 0%: every
   threshold 0, every matrix row-major), each deepened to 32 layers as the dense file was
   (``make_deep_model.py``: layer k is layer k // 8, thresholds included). Then decode tok/s of pi-run on the
   dense file and on each TEAL file and of llama.cpp's ``llama-bench`` on its own Q4_0, every run a fresh
   process (``bench_llama3.py``'s engines: our kernels AVX2-only, ``-march=haswell``, f32 compute; peak RSS
   by ``wait4``), engines interleaved in rounds (order rotating), per thread count; the table gives medians,
   ratios to dense pi-run and to llama.cpp, and peak RSS / file. ``--cpu-time`` adds decode tokens per
   CPU-second at 1 thread (bench_llama3.py's difference of two runs: noisy where loading varies).
   ``--inproc`` instead loads the dense file and the TEAL files of ``--levels`` in this one process and
   interleaves them one decode step at a time, timing wall and CPU seconds (the steadier figure on a
   shared machine; 32 layers: ~4.8 GB of memory per file).

    python benchmarks/bench_teal.py ppl --greedy --wina
    python benchmarks/bench_teal.py speed --out out/teal7b --threads 1 --rounds 3 [--type f16]
    python benchmarks/bench_teal.py llama3 /work/benchdata/llama3 --llama-bench LLAMA/bin/llama-bench \
        --depth 32 --threads 1,2 --rounds 2 -n 32
    python benchmarks/bench_teal.py llama3 /work/benchdata/llama3 --depth 4 --inproc --threads 1 -n 12 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STORIES = ROOT / "tests/data/stories260K/stories260K.ggml-org.gguf"
VAL = ROOT / "tests/data/text/tinystories_val.txt"
LEVELS_PPL = (0.0, 0.25, 0.40, 0.50)


def _files(dense: Path, out: Path, levels, text: str, n_ctx: int = 256, method: str = "uniform",
           hist=None) -> dict[float, Path]:
    """The dense file and one TEAL file per level > 0 (calibrated once; ``hist``, a Calibration, reused when given)."""
    from powerinfer.convert.teal import calibrate_inputs, plan_thresholds, write_teal

    if hist is None:
        t0 = time.perf_counter()
        hist = calibrate_inputs(dense, text, n_ctx=n_ctx)
        print(f"calibrated on {hist.n_tokens} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    files = {0.0: dense}
    for s in levels:
        if s > 0:
            thr, norms = plan_thresholds(dense, method, hist, s, text)
            files[s] = write_teal(dense, out / f"teal-{method}-{int(100 * s)}.gguf", thr, s, method, colnorms=norms)
    _files.hist = hist
    return files


def ppl(args) -> None:
    from powerinfer.eval.perplexity import chunk_tokens, perplexity
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.model import Transformer
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    raw = VAL.read_text()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_method = {"uniform": _files(STORIES, out, LEVELS_PPL, raw[:200_000])}
    if args.greedy:
        by_method["greedy"] = _files(STORIES, out, LEVELS_PPL, raw[:200_000], method="greedy", hist=_files.hist)
    if args.wina:
        by_method["wina"] = _files(STORIES, out, LEVELS_PPL, raw[:200_000], method="wina", hist=_files.hist)
    if args.wina and args.greedy:
        by_method["wina-greedy"] = _files(STORIES, out, LEVELS_PPL, raw[:200_000], method="wina-greedy",
                                          hist=_files.hist)
    g = open_gguf(STORIES)
    tok = GGUFTokenizer(g)
    ids = tok.encode(raw[-100_000:])
    chunks = chunk_tokens(ids, args.ctx, args.chunks, tok.bos_id if tok.add_bos else None)
    print(f"stories260K, {len(chunks)} chunks of {args.ctx} tokens")
    print(f"{'method':>8}  {'sparsity':>8}  {'PPL':>8}  {'+/-':>7}  {'vs dense':>8}  reached (qkv/o/gate_up/down)")
    base = None
    for method, files in by_method.items():
        for s, f in files.items():
            if s == 0 and base is not None:
                continue
            m = Transformer(open_gguf(f)) if s == 0 else TealTransformer(open_gguf(f))
            with torch.inference_mode():
                r = perplexity(m, chunks)
            base = base or r.ppl
            reached = "-" if s == 0 else "/".join(f"{100 * v:.0f}%" for v in m.sparsity_by_kind().values())
            print(f"{method if s else 'dense':>8}  {100 * s:7.0f}%  {r.ppl:8.4f}  {r.stderr:7.4f}  "
                  f"{100 * (r.ppl / base - 1):+7.2f}%  {reached}", flush=True)


def _make_7b(out: Path, n_layer: int, outtype: str = "q4_0") -> Path:
    """``out/hf``: a random SiLU Llama at 7B width (f16), stories260K's tokenizer; ``out/dense-{outtype}.gguf``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from powerinfer.convert.writer import convert

    gguf_path = out / f"dense-{outtype}.gguf"
    if gguf_path.is_file():
        return gguf_path
    d = out / "hf"
    if (d / "config.json").is_file():
        from powerinfer.convert.writer import convert

        return convert(d, gguf_path, outtype=outtype, progress=False, upstream_warnings=False)
    cfg = LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=11008, num_hidden_layers=n_layer,
                      num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                      max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.float16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                for c in p.split(4096):
                    c.copy_(torch.randn(c.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)
    model.save_pretrained(d)
    del model
    import shutil

    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(ROOT / "tests/data/stories260K/hf" / name, d / name)
    return convert(d, gguf_path, outtype=outtype, progress=False, upstream_warnings=False)


def _decode_tps(model, n: int) -> float:
    model.forward(torch.tensor([1]), 0)  # warm
    t0 = time.perf_counter()
    tok = torch.tensor([5])
    for p in range(1, n + 1):
        model.forward(tok, p)
    return n / (time.perf_counter() - t0)


def speed(args) -> None:
    from powerinfer.formats.gguf_file import open_gguf
    from powerinfer.runtime.input_sparse import TealTransformer
    from powerinfer.runtime.model import Transformer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dense = _make_7b(out, args.n_layer, args.type)
    text = VAL.read_text()[:3_000]  # ~1400 tokens (a random model: any text sets its thresholds)
    sub = out / args.type
    sub.mkdir(exist_ok=True)
    if not (sub / "teal-uniform-50.gguf").is_file():
        files = _files(dense, sub, (0.4, 0.5), text)
    else:
        files = {0.0: dense, 0.4: sub / "teal-uniform-40.gguf", 0.5: sub / "teal-uniform-50.gguf"}
    from powerinfer.convert.teal import write_teal

    zero = sub / "teal-0.gguf"
    if not zero.is_file():
        write_teal(dense, zero, torch.zeros(args.n_layer, 4), 0.0)
    engines = {"dense GGUF": Transformer(open_gguf(dense), n_ctx=args.n + 8),
               "TEAL 0% (row-major)": TealTransformer(open_gguf(zero), n_ctx=args.n + 8),
               "TEAL 40% run dense": TealTransformer(open_gguf(files[0.4]), dense=True, n_ctx=args.n + 8),
               "TEAL 40%": TealTransformer(open_gguf(files[0.4]), n_ctx=args.n + 8),
               "TEAL 50%": TealTransformer(open_gguf(files[0.5]), n_ctx=args.n + 8)}
    res: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    loads = []
    with torch.inference_mode():
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                res[k].append(_decode_tps(engines[k], args.n))
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}: " + ", ".join(f"{k} {res[k][-1]:.2f}" for k in names), flush=True)
    base = statistics.median(res["dense GGUF"])
    print(f"\n7B width, {args.n_layer} layers, {args.type}, {args.threads} thread(s), {args.n} decode tokens x "
          f"{args.rounds} rounds; load average {min(loads):.1f}-{max(loads):.1f} during the runs")
    print(f"{'engine':<22} {'tok/s (median)':>14}  {'min-max':>13}  vs dense")
    for k in names:
        v = res[k]
        print(f"{k:<22} {statistics.median(v):14.2f}  {min(v):6.2f}-{max(v):6.2f}  {statistics.median(v) / base:.2f}x")
    sp = engines["TEAL 40%"].sparsity_by_kind()
    print("TEAL 40% reached: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sp.items()))


LEVELS_8B = (0.0, 0.4, 0.5)


def teal_8b_files(d: Path, depth: int) -> dict[float, Path]:
    """``d/teal/l{depth}/teal-{0,40,50}.gguf`` from ``d/l4/pi-q4_0.gguf`` (made when missing; module docstring)."""
    from make_deep_model import deepen

    from powerinfer.convert.teal import calibrate, uniform_thresholds, write_teal

    src = d / "l4" / "pi-q4_0.gguf"
    if not src.is_file():
        raise SystemExit(f"{src}: not found; make it with python benchmarks/make_llama3_model.py {d} --types q4_0 "
                         "--llama-quantize PATH")
    out4, outd = d / "teal" / "l4", d / "teal" / f"l{depth}"
    out4.mkdir(parents=True, exist_ok=True)
    outd.mkdir(parents=True, exist_ok=True)
    files = {s: outd / f"teal-{int(100 * s)}.gguf" for s in LEVELS_8B}
    if all(f.is_file() for f in files.values()):
        return files
    hist = None
    for s, f in files.items():
        f4 = out4 / f.name
        if not f4.is_file():
            if s == 0:
                write_teal(src, f4, torch.zeros(4, 4), 0.0)
            else:
                if hist is None:
                    t0 = time.perf_counter()
                    hist, n = calibrate(src, VAL.read_text()[:3_000], n_ctx=256)
                    print(f"calibrated {src} on {n} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
                t0 = time.perf_counter()
                write_teal(src, f4, uniform_thresholds(hist, s), s)
                print(f"wrote {f4} in {time.perf_counter() - t0:.1f} s", flush=True)
        if not f.is_file():
            if depth == 4:
                f.symlink_to(f4.resolve())
            else:
                deepen(f4, f, depth // 4)
    return files


def llama3(args) -> None:
    """The ``llama3`` benchmark (module docstring)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_llama3 import LlamaBench, PiRun, Result, load_avg1, run_child  # noqa: F401

    d = Path(args.dir)
    dense, theirs = d / f"l{args.depth}" / "pi-q4_0.gguf", d / f"l{args.depth}" / "llama-q4_0.gguf"
    for f in (dense, theirs):
        if not f.is_file():
            raise SystemExit(f"{f}: not found; make it with python benchmarks/make_llama3_model.py {d} --types q4_0")
    teal = teal_8b_files(d, args.depth)
    pi = PiRun(avx2=True)
    rows = [("pi-run dense", dense, pi)] + [(f"pi-run TEAL {int(100 * s)}%", f, pi) for s, f in teal.items()]
    if args.llama_bench:
        rows.append(("llama.cpp", theirs, LlamaBench(Path(args.llama_bench))))
    threads = [int(t) for t in args.threads.split(",")]
    results: list = []
    for th in threads:
        for r in range(args.rounds):
            k = r % len(rows)
            for name, f, eng in rows[k:] + rows[:k]:
                res = Result(name, "q4_0", args.depth, th, r, str(f), f.stat().st_size, load_avg=load_avg1())
                eng.run(res, 0, args.n, args.timeout)
                results.append(res)
                print(f"  {th}t round {r + 1} {name:<18} " + (f"{res.decode_tps:.2f} tok/s, RSS {res.peak_rss / 1e9:.2f} GB"
                      if not res.error else f"failed: {res.error[:200]}") + f" (load {res.load_avg:.1f})", flush=True)
    print(f"\nLlama-3-8B shape, Q4_0, {args.depth} layers, decode {args.n} tokens, {args.rounds} round(s), medians "
          "(min-max); ours AVX2-only (-march=haswell), f32 compute")
    print("| threads | engine | decode tok/s | vs dense pi-run | vs llama.cpp | peak RSS / file | load avg |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    for th in threads:
        def of(name):
            return [x for x in results if x.threads == th and x.engine == name and not x.error]
        base, ref = med_tps(of("pi-run dense")), med_tps(of("llama.cpp"))
        for name, f, _ in rows:
            rs = of(name)
            v = med_tps(rs)
            if v is None:
                print(f"| {th} | {name} | failed | | | | |")
                continue
            tps = [x.decode_tps for x in rs]
            rss = statistics.median(x.peak_rss / x.file_bytes for x in rs)
            la = [x.load_avg for x in rs]
            print(f"| {th} | {name} | {v:.2f} ({min(tps):.2f}-{max(tps):.2f}) | {v / base:.2f}x | "
                  f"{f'{v / ref:.2f}x' if ref else '-'} | {rss:.2f} | {min(la):.1f}-{max(la):.1f} |")
    if args.cpu_time:
        from bench_llama3 import cpu_time_table

        engines = {name: eng for name, _, eng in rows}
        print(cpu_time_table([(name, "q4_0", args.depth, f) for name, f, _ in rows], engines, args.n, args.timeout))


def llama3_inproc(args) -> None:
    """``llama3 --inproc``: dense and TEAL 0/40/50% loaded in this process, decode steps interleaved one token at
    a time (order rotating), each step timed in wall seconds and in this process's CPU seconds (1 thread: CPU
    time is what preemption by other processes does not inflate); tok/s = steps / summed seconds."""
    from powerinfer.runtime.loading import load_model

    d = Path(args.dir)
    torch.set_num_threads(int(args.threads.split(",")[0]))
    levels = {float(v) / 100 for v in args.levels.split(",")}
    files = {"pi-run dense": d / f"l{args.depth}" / "pi-q4_0.gguf",
             **{f"pi-run TEAL {int(100 * s)}%": f for s, f in teal_8b_files(d, args.depth).items() if s in levels}}
    models = {k: load_model(str(f), n_ctx=args.n * args.rounds + 16)[0] for k, f in files.items()}
    from powerinfer.runtime import kernels

    int_ok = kernels.axpy_sparse_ok
    if args.fp32:  # the same TEAL models again with the integer kernel off (fp32 AXPY): its gain
        models.update({f"{k}, fp32 AXPY": m for k, m in list(models.items())
                       if "TEAL" in k and not k.endswith(" 0%")})
    wall = {k: 0.0 for k in models}
    cpu = {k: 0.0 for k in models}
    names = list(models)
    tok = torch.tensor([5])
    with torch.inference_mode():
        for m in models.values():
            m.forward(torch.tensor([1]), 0)  # warm
        steps = args.n * args.rounds
        for p in range(1, steps + 1):
            for k in names[p % len(names):] + names[:p % len(names)]:
                kernels.axpy_sparse_ok = (lambda w: False) if k.endswith("fp32 AXPY") else int_ok
                t0, c0 = time.perf_counter(), time.process_time()
                models[k].forward(tok, p)  # an fp32 twin rewrites its model's cache at p: the same inputs
                wall[k] += time.perf_counter() - t0
                cpu[k] += time.process_time() - c0
    kernels.axpy_sparse_ok = int_ok
    print(f"\nLlama-3-8B shape, Q4_0, {args.depth} layers, {torch.get_num_threads()} thread(s), one process, {steps} "
          f"decode steps per engine interleaved; load average {os.getloadavg()[0]:.1f}")
    print("| engine | tok/s (wall) | vs dense | tok per CPU-s | vs dense |")
    print("|---|--:|--:|--:|--:|")
    bw, bc = steps / wall["pi-run dense"], steps / cpu["pi-run dense"]
    for k in names:
        print(f"| {k} | {steps / wall[k]:.2f} | {steps / wall[k] / bw:.2f}x | {steps / cpu[k]:.2f} | "
              f"{steps / cpu[k] / bc:.2f}x |")
    for k in names:
        if k.endswith("fp32 AXPY") or not hasattr(models[k], "sparsity_by_kind") or models[k].teal is None or models[k].teal.sparsity == 0:
            continue
        sp = models[k].sparsity_by_kind()
        print(f"{k} reached: " + ", ".join(f"{kind} {100 * v:.0f}%" for kind, v in sp.items()))


def med_tps(rs) -> float | None:
    return statistics.median(x.decode_tps for x in rs) if rs else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ppl")
    p.add_argument("--out", default="out/teal-stories")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=None)
    p.add_argument("--greedy", action="store_true", help="also TEAL's greedy allocation (same histograms)")
    p.add_argument("--wina", action="store_true",
                   help="also WINA's weighted criterion (same calibration run; with --greedy also greedy-allocated)")
    s = sub.add_parser("speed")
    s.add_argument("--out", default="out/teal7b")
    s.add_argument("--n-layer", type=int, default=2)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--type", default="q4_0", help="weight type of the dense file: q4_0, q8_0, f16, bf16")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("-n", type=int, default=16, help="decode tokens per run")
    b = sub.add_parser("llama3")
    b.add_argument("dir", help="make_llama3_model.py's output folder")
    b.add_argument("--depth", type=int, default=32, choices=(4, 32))
    b.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (omit: no llama.cpp row)")
    b.add_argument("--threads", default="1,2")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("-n", type=int, default=32, help="decode tokens per run")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    b.add_argument("--cpu-time", action="store_true", help="also decode tokens per CPU-second at 1 thread")
    b.add_argument("--inproc", action="store_true",
                   help="instead: ours only, every file in this process, steps interleaved, wall and CPU time")
    b.add_argument("--levels", default="0,40,50", help="--inproc: the TEAL files loaded (32 layers: ~4.8 GB each)")
    b.add_argument("--fp32", action="store_true", help="--inproc: also each TEAL file with the fp32 AXPY (no integer kernel)")
    args = ap.parse_args(argv)
    if args.cmd == "llama3" and args.inproc:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        return llama3_inproc(args)
    {"ppl": ppl, "speed": speed, "llama3": llama3}[args.cmd](args)


if __name__ == "__main__":
    main()

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

    python benchmarks/bench_teal.py ppl --greedy --wina
    python benchmarks/bench_teal.py speed --out out/teal7b --threads 1 --rounds 3 [--type f16]
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
    args = ap.parse_args(argv)
    {"ppl": ppl, "speed": speed}[args.cmd](args)


if __name__ == "__main__":
    main()

"""Build the Llama-3-8B-shaped benchmark files: each engine's own quantization of the same weights.

A dense SwiGLU ``LlamaForCausalLM`` of Llama 3 8B's shape (n_embd 4096, n_ff 14336, 32 heads /
8 KV heads, head_dim 128, vocab 128256, rope theta 500000) cut to ``--n-layer`` layers (4), random
f16 weights drawn as the other synthetic benchmark models are (:func:`powerinfer.synthetic.make_hf`:
matrices N(0, 0.02), norms 1). The vocabulary is the Llama-2 SentencePiece tokenizer bundled in
``tests/data/tokenizers/llama2`` padded by our converter with ``[PAD{i}]`` tokens to 128256 entries,
so the embedding and output matrices have Llama 3's size (what decode speed depends on) and every
engine loads the file today. ``--rope-llama3`` adds Llama 3.1's ``rope_scaling`` (type llama3,
factor 8, the file then carries ``rope_freqs.weight``) for when the runtime reads it; off by default.

Writes, under OUT (outside the repository: the files are 1-9 GB each)::

    hf/                      the HF folder (f16 safetensors, ~3.9 GB for 4 layers)
    l4/f16.gguf              our converter's dense f16 GGUF (the source of every quantization)
    l4/pi-q4_0.gguf          pi-quantize Q4_0 (output.weight Q8_0)        -> pi-run
    l4/pi-q8_0.gguf          pi-quantize Q8_0                             -> pi-run
    l4/llama-q4_0.gguf       llama-quantize Q4_0 (output Q6_K)            -> llama.cpp
    l4/llama-q8_0.gguf       llama-quantize Q8_0                          -> llama.cpp
    l4/llama-q4_k_m.gguf     llama-quantize Q4_K_M (Q4_K + Q6_K)          -> llama.cpp and pi-run
    l32/<same names>         each quantized file with every layer repeated 8 times
                             (make_deep_model.py: bytes copied, no requantization)

Q4_K_M is quantized at 4 layers and then deepened: llama-quantize gives ``ffn_down``/``attn_v``
Q6_K to layers 2 and 3 of 4 (its "more bits" rule), so half the 32 layers have them, as in a real
32-layer Q4_K_M (16 of 32). Every step is skipped when its output exists (rerun = no-op).
Peak memory ~5 GB (the f16 HF model while it is written).

    python benchmarks/make_llama3_model.py /work/benchdata/llama3 \\
        --llama-quantize /path/to/llama.cpp/build/bin/llama-quantize
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from powerinfer.errors import PowerInferError  # noqa: E402
from powerinfer.synthetic import Shape, make_hf  # noqa: E402

TOKENIZER = ROOT / "tests" / "data" / "tokenizers" / "llama2"
OURS = ("q4_0", "q8_0")  # pi-quantize's types
LLAMA = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # llama-quantize's names
LLAMA3_ROPE = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
               ("original_max_position_embeddings", 8192))


def llama3_shape(n_layer: int = 4, rope_llama3: bool = False, seed: int = 0) -> Shape:
    """Llama 3 8B's dimensions with ``n_layer`` layers (SwiGLU, GQA 32/8, theta 500000)."""
    return Shape(n_layer=n_layer, n_embd=4096, n_ff=14336, n_head=32, n_vocab=128256,
                 n_ctx=131072 if rope_llama3 else 8192, seed=seed, n_head_kv=8, hidden_act="silu",
                 rope_theta=500000.0, rope_scaling=LLAMA3_ROPE if rope_llama3 else ())


def file_names(types: list[str]) -> list[str]:
    """The quantized file names (one directory level) for ``types``: ours and llama.cpp's."""
    names = [f"pi-{t}.gguf" for t in types if t in OURS]
    return names + [f"llama-{t}.gguf" for t in types if t in LLAMA]


def build(out: Path, types: list[str], n_layer: int, repeat: int, llama_quantize: Path | None,
          rope_llama3: bool = False, seed: int = 0, keep_hf: bool = True) -> dict[str, Path]:
    """Write every file of the module docstring that is missing; returns {``l4/name``: path, ...}."""
    from make_deep_model import deepen

    from powerinfer.convert.quantize import quantize_file
    from powerinfer.convert.writer import convert

    shallow, deep = out / f"l{n_layer}", out / f"l{n_layer * repeat}"
    shallow.mkdir(parents=True, exist_ok=True)
    f16 = shallow / "f16.gguf"
    wanted = file_names(types)
    if not f16.is_file() and not all((shallow / n).is_file() for n in wanted):
        t0 = time.time()
        hf = make_hf(out, llama3_shape(n_layer, rope_llama3, seed), TOKENIZER)
        print(f"hf model: {hf} ({time.time() - t0:.0f} s)", flush=True)
        convert(hf, f16, outtype="f16", progress=False, upstream_warnings=False)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB, {time.time() - t0:.0f} s)", flush=True)
    files: dict[str, Path] = {}
    for name in wanted:
        dst = shallow / name
        if not dst.is_file():
            t0 = time.time()
            kind, qtype = name.removesuffix(".gguf").split("-", 1)
            if kind == "pi":
                quantize_file(f16, dst, qtype)
            else:
                if llama_quantize is None:
                    raise PowerInferError(f"{dst}: llama.cpp's files need --llama-quantize PATH")
                env = {**os.environ, "LD_LIBRARY_PATH": f"{llama_quantize.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
                tmp = dst.with_suffix(".tmp")
                r = subprocess.run([str(llama_quantize), str(f16), str(tmp), LLAMA[qtype]], env=env,
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    raise PowerInferError(f"{llama_quantize} failed on {f16}: {r.stderr.strip()[-400:]}")
                tmp.rename(dst)
            print(f"wrote {dst} ({dst.stat().st_size / 1e9:.2f} GB, {time.time() - t0:.0f} s)", flush=True)
        files[f"{shallow.name}/{name}"] = dst
    if repeat > 1:
        deep.mkdir(parents=True, exist_ok=True)
        for name in wanted:
            dst = deep / name
            if not dst.is_file():
                deepen(shallow / name, dst, repeat)
            files[f"{deep.name}/{name}"] = dst
    if not keep_hf and (out / "hf").is_dir():
        import shutil

        shutil.rmtree(out / "hf")
    return files


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output folder (outside the repository: ~40 GB for all files)")
    ap.add_argument("--llama-quantize", type=Path, default=None, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--types", default="q4_0,q4_k_m,q8_0", help="comma-separated: q4_0, q4_k_m, q8_0")
    ap.add_argument("--n-layer", type=int, default=4, help="layers of the shallow model (default 4)")
    ap.add_argument("--repeat", type=int, default=8, help="deepening factor (default 8: 32 layers; 1: none)")
    ap.add_argument("--rope-llama3", action="store_true",
                    help="Llama 3.1 rope_scaling (llama3, factor 8): the file gets rope_freqs.weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop-hf", action="store_true", help="delete hf/ at the end (saves ~3.9 GB)")
    a = ap.parse_args(argv)
    types = [t.strip().lower() for t in a.types.split(",") if t.strip()]
    bad = [t for t in types if t not in LLAMA]
    if bad:
        ap.error(f"--types: {', '.join(bad)} not among {', '.join(LLAMA)}")
    if not 1 <= a.n_layer <= 64 or not 1 <= a.repeat <= 64:
        ap.error("--n-layer and --repeat must be between 1 and 64")
    try:
        files = build(a.out, types, a.n_layer, a.repeat, a.llama_quantize, a.rope_llama3, a.seed, not a.drop_hf)
    except PowerInferError as e:
        sys.exit(f"error: {e}")
    for k, p in files.items():
        print(f"{k:<28} {p.stat().st_size / 1e9:6.2f} GB")


if __name__ == "__main__":
    main()

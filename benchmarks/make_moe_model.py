"""Build the mixture-of-experts benchmark files: llama.cpp's own Q4_0 of designed random MoE models.

Two shapes, the published configs' dimensions cut to ``--n-layer`` layers (4), random f16 weights with
routing and neuron sparsity designed by :mod:`powerinfer.synthetic_moe` (its docstring: a power law
over experts, the hottest 10% carrying ``--expert-top10`` of the routings; SmallThinker's ReGLU
experts with ~10% of their neurons firing, a power law over neurons as the PowerInfer benchmark
models), Qwen's vocabulary (llama.cpp's Qwen vocab GGUF in ``tests/data/tokenizers/gguf-vocab`` made
into a ``tokenizer.json`` as ``tests/test_convert_vocab.py`` does; 151,646 tokens padded to 151,936):

* ``smallthinker-21b``: SmallThinker-21BA3B (n_embd 2560, 28 / 4 heads of 128, 64 experts, 6 used,
  expert width 768, vocab 151936; published 52 layers), deepened x6 to 24 layers;
* ``qwen3-30b-a3b``: Qwen3-30B-A3B (n_embd 2048, 32 / 4 heads of 128, 128 experts, 8 used, expert
  width 768, vocab 151936; published 48 layers), deepened x4 to 16 layers.

Per shape, under OUT/<name>/ (every step skipped when its output exists)::

    hf/                    the HF folder (f16 safetensors; deleted at the end unless --keep-hf)
    design.json            the design's statistics measured on held-out tokens (shallow and deep layers)
    f16.gguf               llama.cpp's convert_hf_to_gguf.py --outtype f16 (deleted unless --keep-f16)
    l4/llama-q4_0.gguf     llama-quantize Q4_0 (token_embd Q4_0, output Q6_K, routers f32)
    l24/llama-q4_0.gguf    each layer repeated (make_deep_model.py: bytes copied, no requantization)

Disk: ~5-6 GB per HF folder and per f16 GGUF while they exist; the kept files ~15 GB in all.
Peak memory ~4 GB (one layer's experts in f16 and the embeddings).

    python benchmarks/make_moe_model.py /work/benchdata/moe --llama-cpp LLAMA_SRC \\
        --llama-quantize LLAMA_BUILD/bin/llama-quantize
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from powerinfer.errors import PowerInferError  # noqa: E402
from powerinfer.synthetic_moe import build_moe_hf, qwen3_30b, smallthinker_21b, tiny  # noqa: E402

TEXT = ROOT / "powerinfer" / "assets" / "calibration.txt"
SHAPES = {"smallthinker-21b": (smallthinker_21b, 6), "qwen3-30b-a3b": (qwen3_30b, 4)}  # name: (shape, repeat)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def qwen_tokenizer(tmp: Path) -> dict[str, Path]:
    """Qwen's tokenizer files, made from llama.cpp's Qwen vocab GGUF by the vocabulary tests' builder."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_convert_vocab import VOCAB, qwen15_base

    from powerinfer.formats.gguf_file import open_gguf

    d = qwen15_base(tmp / "qwen-tok", open_gguf(VOCAB / "ggml-vocab-qwen2.gguf"))
    return {name: d / name for name in TOKENIZER_FILES}


def run(cmd: list[str], env: dict | None = None, what: str = "") -> None:
    t0 = time.time()
    r = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if r.returncode != 0:
        raise PowerInferError(f"{what or cmd[0]} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-600:]}")
    print(f"  {what}: {time.time() - t0:.0f} s", flush=True)


def build(out: Path, name: str, n_layer: int, repeat: int, llama_cpp: Path, llama_quantize: Path,
          keep_hf: bool, keep_f16: bool, shape_kw: dict, small: bool = False) -> dict[str, Path]:
    """Every file of the module docstring for shape ``name`` that is missing; returns {"l4": path, ...}."""
    from make_deep_model import deepen

    make, _ = SHAPES[name]
    shape = make(n_layer, **shape_kw)
    if small:
        shape = tiny(shape)
    d = out / name
    hf, f16 = d / "hf", d / "f16.gguf"
    shallow, deep = d / f"l{n_layer}" / "llama-q4_0.gguf", d / f"l{n_layer * repeat}" / "llama-q4_0.gguf"
    if not shallow.is_file():
        if not f16.is_file():
            if not (hf / "design.json").is_file():
                with tempfile.TemporaryDirectory(prefix="pi-moe-tok-") as tmp:
                    print(f"{name}: HF folder {hf}", flush=True)
                    info = build_moe_hf(hf, shape, qwen_tokenizer(Path(tmp)), TEXT.read_text(), repeat)
                shutil.copy(hf / "design.json", d / "design.json")
                print(f"  HF folder: {info['seconds']:.0f} s", flush=True)
            tmp = f16.with_suffix(".tmp")
            run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                 "--outfile", str(tmp)], {"PYTHONPATH": str(llama_cpp / "gguf-py")}, "convert_hf_to_gguf.py")
            tmp.rename(f16)
        shallow.parent.mkdir(parents=True, exist_ok=True)
        tmp = shallow.with_suffix(".tmp")
        run([str(llama_quantize), str(f16), str(tmp), "Q4_0"],
            {"LD_LIBRARY_PATH": f"{llama_quantize.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}, "llama-quantize Q4_0")
        tmp.rename(shallow)
    files = {shallow.parent.name: shallow}
    if repeat > 1:
        if not deep.is_file():
            deep.parent.mkdir(parents=True, exist_ok=True)
            deepen(shallow, deep, repeat)
        files[deep.parent.name] = deep
    if not keep_f16 and f16.is_file():
        f16.unlink()
    if not keep_hf and hf.is_dir():
        shutil.rmtree(hf)
    return files


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output folder (outside the repository)")
    ap.add_argument("--llama-cpp", type=Path, required=True,
                    help="llama.cpp's source tree (convert_hf_to_gguf.py and gguf-py/)")
    ap.add_argument("--llama-quantize", type=Path, required=True, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--n-layer", type=int, default=4, help="layers of the shallow model (default 4)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="deepening factor (default: smallthinker-21b 6, qwen3-30b-a3b 4; 1: none)")
    ap.add_argument("--expert-top10", type=float, default=0.30, help="share of routings on the hottest 10%% of experts")
    ap.add_argument("--neuron-active", type=float, default=0.10, help="ReGLU experts: mean neuron firing probability")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--keep-hf", action="store_true", help="keep the HF folders (~5-6 GB each)")
    ap.add_argument("--keep-f16", action="store_true", help="keep llama.cpp's f16 GGUFs (~5-6 GB each)")
    ap.add_argument("--tiny", action="store_true", help="n_embd 128, 16 experts: a smoke run of the pipeline")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.shapes.split(",") if n.strip()]
    if bad := [n for n in names if n not in SHAPES]:
        ap.error(f"--shapes: {', '.join(bad)} not among {', '.join(SHAPES)}")
    if not (a.llama_cpp / "convert_hf_to_gguf.py").is_file():
        ap.error(f"--llama-cpp {a.llama_cpp}: no convert_hf_to_gguf.py there")
    if not a.llama_quantize.is_file():
        ap.error(f"--llama-quantize {a.llama_quantize}: not found")
    if not 1 <= a.n_layer <= 64 or (a.repeat is not None and not 1 <= a.repeat <= 64):
        ap.error("--n-layer and --repeat must be between 1 and 64")
    kw = {"expert_top10": a.expert_top10, "neuron_active": a.neuron_active, "calib_tokens": a.calib_tokens}
    try:
        for name in names:
            repeat = a.repeat if a.repeat is not None else SHAPES[name][1]
            files = build(a.out, name, a.n_layer, repeat, a.llama_cpp, a.llama_quantize, a.keep_hf, a.keep_f16, kw,
                          a.tiny)
            for k, p in files.items():
                print(f"{name}/{k}/{p.name:<18} {p.stat().st_size / 1e9:6.2f} GB", flush=True)
            design = a.out / name / "design.json"
            if design.is_file():
                info = json.loads(design.read_text())
                print(f"  design: {info['layers']}", flush=True)
    except PowerInferError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

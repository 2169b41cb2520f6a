"""Make a full-depth benchmark file from a shallow one: each layer of a GGUF repeated R times.

The 4-layer 7B-shaped benchmark model (``make_bench_model.py``) has the bytes and the
designed sparsity of a Llama-2-7B layer; repeating each of its layers 8 times gives a
32-layer file whose bytes per token, FFN share and predicted-active share scale as in a
real 7B (layer ``k`` of the output is layer ``k // R`` of the input). Works on any GGUF
our runtime or upstream's reads, in any type, dense or PowerInfer (PWRI magic kept):
quantize the shallow file with each engine's own quantizer first (ours: ``pi-quantize``;
llama.cpp's ``llama-quantize``; upstream PowerInfer's ``quantize``), then deepen each, so
every engine runs its own bytes of the same weights at full depth.

Tensor bytes are copied as they are (no requantization); metadata is copied with
``{arch}.block_count`` multiplied by R. Written to a temporary name and renamed.

    python benchmarks/make_deep_model.py out/bench/bench-q4_0.powerinfer.gguf out/deep/sparse-q4_0.powerinfer.gguf
    python benchmarks/make_deep_model.py IN.gguf OUT.gguf --repeat 8
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np

from powerinfer.convert.quantize import _copy_metadata, _copy_raw, _drop_pages, _torch_shape
from powerinfer.formats._atomic import atomic_path
from powerinfer.formats.gguf_file import PWRI_BYTES, open_gguf, read_magic, set_magic

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def deepen(src: Path, dst: Path, repeat: int) -> None:
    g = open_gguf(src)
    key = f"{g.arch}.block_count"
    n_layer = int(g.reader.fields[key].parts[-1][0])
    file_type = g.reader.fields.get("general.file_type")
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(str(tmp), g.arch)
        _copy_metadata(w, g, int(file_type.parts[-1][0]) if file_type else 1)
        kv = w.kv_data[0]
        kv[key] = gguf.GGUFValue(n_layer * repeat, kv[key].type)
        plan = []  # (output name, input tensor) in the input's order, each layer's block R times
        layers: dict[int, list] = {}
        for t in g.reader.tensors:
            m = _BLOCK.fullmatch(t.name)
            if m is None:
                plan.append((t.name, t))
            else:
                layers.setdefault(int(m[1]), []).append((m[2], t))
        head = [p for p in plan if p[0] in ("token_embd.weight",)]
        tail = [p for p in plan if p[0] not in ("token_embd.weight",)]
        plan = head + [(f"blk.{i * repeat + r}.{rest}", t) for i in sorted(layers) for r in range(repeat)
                       for rest, t in layers[i]] + tail
        for name, t in plan:
            w.add_tensor_info(name, _torch_shape(t), np.dtype(np.float32), int(t.n_bytes), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, t) in enumerate(plan):
            w.write_tensor_data(_copy_raw(t))
            _drop_pages(g, t)
            if sys.stderr.isatty():  # a line redrawn on a terminal, one line per 10% in a log
                print(f"\r{dst.name}: {i + 1}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
            elif (i + 1) * 10 // len(plan) != i * 10 // len(plan):
                print(f"{dst.name}: {i + 1}/{len(plan)} tensors", file=sys.stderr, flush=True)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        w.close()
        if g.sparse:
            set_magic(tmp, PWRI_BYTES)
        assert read_magic(tmp) == read_magic(src)
    print(f"wrote {dst}: {n_layer} -> {n_layer * repeat} layers, {dst.stat().st_size / 1e9:.2f} GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--repeat", type=int, default=8, help="times each layer is repeated (default 8: 4 -> 32 layers)")
    a = ap.parse_args()
    if not 1 <= a.repeat <= 64:
        ap.error("--repeat must be between 1 and 64")
    a.dst.parent.mkdir(parents=True, exist_ok=True)
    deepen(a.src, a.dst, a.repeat)


if __name__ == "__main__":
    main()

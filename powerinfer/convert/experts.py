"""Stack a checkpoint's per-expert matrices into llama.cpp's 3-D expert tensors.

The family rules mark ``...experts.{x}.w1.weight``-style tensors with the transform ``expert``
(:mod:`powerinfer.families.experts`); every expert of one layer and kind maps to the same GGUF
name (``blk.N.ffn_gate_exps.weight``...), written as ``torch.stack`` of experts ``0..n_expert-1``:
torch order ``[n_expert, rows, cols]``, so expert ``x``'s rows are the contiguous rows
``x * rows .. (x + 1) * rows`` of the tensor, which the runtime computes on in place. Only shapes
are read while planning; the stack is built when the tensor is written (one layer's experts of
one kind in memory at a time).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from ..errors import PowerInferError

_XID = re.compile(r"\.experts\.(\d+)\.")


def expert_index(hf_name: str) -> int:
    """The expert number in a checkpoint name (``...experts.5.w1.weight`` -> 5)."""
    return int(_XID.search(hf_name).group(1))


def plan_stacks(parts: dict[str, dict[int, str]], shape_of: Callable[[str], tuple[int, ...]],
                get: Callable[[str], torch.Tensor], n_expert: int, src: Path
                ) -> dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]:
    """``{gguf_name: (shape, load)}`` for each stacked expert tensor. ``parts``: GGUF name ->
    {expert number: checkpoint name}. Raises PowerInferError naming ``src`` when an expert is
    missing, out of range, or the experts' shapes differ."""
    out = {}
    for gname, by_x in parts.items():
        if sorted(by_x) != list(range(n_expert)):
            missing = sorted(set(range(n_expert)) - set(by_x))
            extra = sorted(set(by_x) - set(range(n_expert)))
            raise PowerInferError(f"{src}: {gname} needs experts 0..{n_expert - 1} (config.json's expert count); "
                                  f"the checkpoint {f'lacks expert {missing[0]}' if missing else f'has expert {extra[0]}'}")
        names = [by_x[x] for x in range(n_expert)]
        shapes = {shape_of(n) for n in names}
        if len(shapes) != 1:
            raise PowerInferError(f"{src}: the experts of {gname} have different shapes {sorted(shapes)}")
        shape = (n_expert, *next(iter(shapes)))
        out[gname] = (shape, lambda names=names: torch.stack([get(n) for n in names]))
    return out

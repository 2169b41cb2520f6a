"""Build or reuse a model's GPU index (``<model>.generated.gpuidx``) for a VRAM budget.

The budget covers everything the GPU holds. As in upstream PowerInfer, the dense
tensors go first: every tensor except the token embedding (which stays on the CPU)
and the FFN rows, i.e. attention, norms, the output matrix and the predictors, plus
an f16 KV cache for the context. What is left is the FFN budget, filled with the
hottest neurons by :func:`powerinfer.convert.placement.place_neurons` using the
honest per-neuron cost (the bytes of its gate/up/down rows, no fudge factors).

An index is reused only if it was built for this exact model file (identity of
its header), this layer count and ``n_ff``, this budget, and the activation counts
now in the activation folder with the same chunk and per-layer minimum (a digest of
them, :func:`placement_inputs_id`, is stored in the index); otherwise it is rebuilt
(upstream kept a stale index after a budget change, and after a re-profile).
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import PowerInferError
from ..formats.activation import load_activation_dir
from ..formats.gguf_file import GGUFFile, open_gguf
from ..formats.gpuidx import (KEY_ACTIVATION, default_index_path, model_identity, read_gpu_index,
                              write_gpu_index)
from .placement import neuron_bytes, place_neurons

log = logging.getLogger(__name__)

GIB = 1 << 30
from ..limits import MAX_BUDGET_GIB  # noqa: E402
_FFN_ROWS = (".ffn_gate.weight", ".ffn_up.weight", ".ffn_down_t.weight", ".ffn_down.weight")
_TYPE_NAMES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0"}


@dataclass
class GpuPlan:
    """Per layer, the bool mask ``[n_ff]`` of neurons on the GPU, and how it came about."""

    gpu: list[np.ndarray]
    path: Path
    reused: bool
    ffn_budget: int  # bytes for FFN neurons
    summary: str

    @property
    def share(self) -> float:
        return float(sum(int(m.sum()) for m in self.gpu)) / max(1, sum(m.size for m in self.gpu))


def dense_bytes(tensors: Iterable[tuple[str, int]], n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                n_ctx: int) -> int:
    """Bytes the GPU needs before any FFN neuron: the ``(name, bytes)`` tensors that are not FFN
    rows nor token_embd, plus an f16 KV cache of ``n_ctx`` tokens."""
    total = sum(int(n) for name, n in tensors if name != "token_embd.weight" and not name.endswith(_FFN_ROWS))
    return total + 2 * n_layer * n_ctx * n_head_kv * (n_embd // n_head) * 2


def dense_vram_bytes(g: GGUFFile, n_ctx: int) -> int:
    """:func:`dense_bytes` of a GGUF file."""
    arch = g.arch
    n_head = int(g.require(f"{arch}.attention.head_count"))
    return dense_bytes(((t.name, int(t.n_bytes)) for t in g.reader.tensors), int(g.require(f"{arch}.block_count")),
                       int(g.require(f"{arch}.embedding_length")), n_head,
                       int(g.get(f"{arch}.attention.head_count_kv", n_head)), n_ctx)


def check_budget(vram_budget_gib: float, dense: int, n_ctx: int, where: object) -> int:
    """The budget in bytes; PowerInferError when it is negative, not finite, or below ``dense``."""
    if not math.isfinite(vram_budget_gib) or not 0 <= vram_budget_gib <= MAX_BUDGET_GIB:
        raise PowerInferError(f"--vram-budget {vram_budget_gib}: must be >= 0 GiB (a finite number, at most "
                              f"{MAX_BUDGET_GIB})")
    budget = int(vram_budget_gib * GIB)
    if budget < dense:
        raise PowerInferError(
            f"--vram-budget {vram_budget_gib} GiB cannot be met for {where}: its dense tensors and a "
            f"{n_ctx}-token KV cache alone need {dense / GIB:.3f} GiB")
    return budget


def placement_inputs_id(counts: list, chunk: int, min_share: float) -> str:
    """A digest of what a placement is solved from besides the budget: the per-layer
    activation counts (values and lengths, as int64) and the solver's ``chunk`` and
    ``min_share``. Equal inputs give equal strings; any changed count gives another."""
    h = hashlib.sha256(f"chunk={int(chunk)};min_share={float(min_share)!r}".encode())
    for c in counts:
        a = np.ascontiguousarray(np.asarray(c.detach().cpu() if hasattr(c, "detach") else c, dtype=np.int64))
        h.update(f";{a.size}:".encode())
        h.update(a.tobytes())
    return f"sha256={h.hexdigest()[:32]}"


def ffn_row_type(g: GGUFFile) -> str:
    t = g.tensors.get("blk.0.ffn_up.weight")
    if t is None:
        raise PowerInferError(f"{g.path}: no blk.0.ffn_up.weight, cannot size FFN neurons")
    name = _TYPE_NAMES.get(t.tensor_type.name)
    if name is None:
        raise PowerInferError(f"{g.path}: FFN tensors of type {t.tensor_type.name} cannot be placed")
    return name


def ensure_gpu_index(model_path: str | Path, vram_budget_gib: float, activation_dir: str | Path | None = None,
                     n_ctx: int | None = None, reset: bool = False, chunk: int = 64,
                     min_share: float = 0.0, g: GGUFFile | None = None) -> GpuPlan | None:
    """The GPU neuron masks for ``model_path`` under ``vram_budget_gib`` GiB.

    Reuses ``<model>.generated.gpuidx`` when it matches (model, n_layer, n_ff,
    budget, and the digest of the counts in ``activation_dir`` with ``chunk`` and
    ``min_share``) unless ``reset``; otherwise solves from ``activation_dir`` (default:
    ``activation/`` beside the model file) and writes the index atomically. Without
    an activation folder an existing matching index is reused as it is (there is
    nothing newer to compare it with); with none either, returns None with a warning
    (the FFN then runs on the CPU). Raises PowerInferError for a negative budget, one
    too small for the dense tensors and KV cache, or an unreadable activation folder.
    """
    model_path = Path(model_path)
    check_budget(vram_budget_gib, 0, 0, model_path)
    g = g if g is not None else open_gguf(model_path)  # the caller's opened file, when it has one
    arch = g.arch
    n_layer = int(g.require(f"{arch}.block_count"))
    n_ff = int(g.require(f"{arch}.feed_forward_length"))
    n_embd = int(g.require(f"{arch}.embedding_length"))
    n_ctx = int(n_ctx or g.get(f"{arch}.context_length", 2048))
    dense = dense_vram_bytes(g, n_ctx)
    budget = check_budget(vram_budget_gib, dense, n_ctx, model_path)
    ffn_budget = budget - dense
    index_path = default_index_path(model_path)
    mid = model_identity(g)
    act_dir = Path(activation_dir) if activation_dir is not None else model_path.parent / "activation"
    counts = load_activation_dir(act_dir, n_layer=n_layer, n_ff=n_ff) if act_dir.is_dir() else None
    inputs_id = None if counts is None else placement_inputs_id(counts, chunk, min_share)
    if index_path.exists() and not reset:
        try:
            ix = read_gpu_index(index_path, n_layer=n_layer, n_ff=n_ff, model_id=mid, vram_capacity=ffn_budget)
            built_from = ix.meta.get(KEY_ACTIVATION)
            if inputs_id is None or built_from == inputs_id:
                return GpuPlan(ix.gpu, index_path, True, ffn_budget, f"reused {index_path}")
            log.warning("rebuilding the GPU index %s: it was solved from other activation counts or solver "
                        "settings than %s now holds (chunk %d, min share %g)", index_path, act_dir, chunk, min_share)
        except PowerInferError as e:
            log.warning("rebuilding the GPU index: %s", e)
    if counts is None:
        log.warning("%s: no activation folder, so no neuron placement: the FFN runs on the CPU "
                    "(profile the model with pi-profile, or pass --activation)", act_dir)
        return None
    gated = "blk.0.ffn_gate.weight" in g.tensors
    p = place_neurons(counts, ffn_budget, neuron_bytes(n_embd, ffn_row_type(g), gated),
                      chunk=chunk, min_share=min_share)
    write_gpu_index(index_path, p, ffn_budget, model_id=mid, activation_id=inputs_id)
    return GpuPlan(p.gpu, index_path, False, ffn_budget, p.summary())

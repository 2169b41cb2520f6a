"""RoPE scaling of a Hugging Face config, stated the way llama.cpp's GGUF files state it.

A config gives it as ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5),
with its kind in ``rope_type`` (``type`` in older configs). Supported kinds:

* ``default`` / absent: plain RoPE, nothing is written.
* ``linear`` (position interpolation): every position is multiplied by ``1 / factor``;
  written as ``{arch}.rope.scaling.type = "linear"`` and ``{arch}.rope.scaling.factor``
  (llama.cpp's keys; its loader turns the factor into ``freq_scale = 1 / factor``).
* ``llama3`` (Llama 3.1 / 3.2 / 3.3): each rotary frequency ``i`` (``theta^(-2i/d)``, ``d``
  the head dim) is divided by a factor ``f_i``; the factors are the tensor
  ``rope_freqs.weight`` ``[d/2]`` f32, computed as llama.cpp's converter computes them (and
  transformers' ``_compute_llama3_parameters`` applies): with ``L`` =
  ``original_max_position_embeddings``, wavelength ``w_i = 2 pi / freq_i``,
  ``w_hi = L / high_freq_factor``, ``w_lo = L / low_freq_factor``: ``f_i = 1`` for
  ``w_i < w_hi``, ``f_i = factor`` for ``w_i > w_lo``, else with
  ``s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
  ``f_i = 1 / ((1 - s) / factor + s)``. No scaling key is written (llama.cpp writes none).

Any other kind (``yarn``, ``dynamic``, ``longrope``, ...) is refused with one line naming it
and the config, before any tensor is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PowerInferError

SUPPORTED = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """What a config's RoPE scaling adds to a GGUF: metadata (keys without the ``{arch}.``
    prefix) and tensors (name -> f32 tensor)."""

    kind: str
    kv: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config's RoPE scaling dict (``rope_parameters`` or ``rope_scaling``; empty when none)."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        params = cfg.get("rope_scaling")
    if not isinstance(params, dict):
        return {}
    return params.get("full_attention", params) if isinstance(params.get("full_attention"), dict) else params


def _num(params: dict[str, Any], key: str, default: float, source: str) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PowerInferError(f"{source}: rope scaling {key} = {v!r} must be a positive number")
    return float(v)


def llama3_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_ctx: float) -> torch.Tensor:
    """``rope_freqs.weight`` of Llama 3.1+ ``[head_dim/2]`` f32: the divisor of each rotary
    frequency (formula in the module docstring)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    lo_wave, hi_wave = original_ctx / low_freq_factor, original_ctx / high_freq_factor
    out = []
    for f in freqs:  # 0-d float32 tensors: the arithmetic rounds as in llama.cpp's converter (same bits)
        wave = 2 * math.pi / f
        if wave < hi_wave:
            out.append(1.0)
        elif wave > lo_wave:
            out.append(factor)
        else:
            s = (original_ctx / wave - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(float(1 / ((1 - s) / factor + s)))
    return torch.tensor(out, dtype=torch.float32)


def hf_rope_scaling(cfg: dict[str, Any], head_dim: int, base: float, source: str = "config.json") -> RopeScaling:
    """The :class:`RopeScaling` of an HF config whose heads are ``head_dim`` wide with RoPE base
    ``base``. Raises PowerInferError naming ``source`` for an unsupported kind or a bad value."""
    params = rope_params(cfg)
    kind = str(params.get("rope_type") or params.get("type") or "default").lower()
    if kind == "default":
        return RopeScaling("default")
    if kind == "linear":
        return RopeScaling(kind, {"rope.scaling.type": "linear",
                                  "rope.scaling.factor": _num(params, "factor", 1.0, source)})
    if kind == "llama3":
        lo, hi = _num(params, "low_freq_factor", 1.0, source), _num(params, "high_freq_factor", 4.0, source)
        if lo >= hi:
            raise PowerInferError(f"{source}: llama3 rope scaling needs low_freq_factor < high_freq_factor "
                                  f"(got {lo:g}, {hi:g})")
        f = llama3_factors(head_dim, base, _num(params, "factor", 8.0, source), lo, hi,
                           _num(params, "original_max_position_embeddings", 8192, source))
        return RopeScaling(kind, {}, {"rope_freqs.weight": f})
    raise PowerInferError(f"{source}: rope scaling type {kind!r} is not supported (supported: "
                          f"{', '.join(SUPPORTED)})")

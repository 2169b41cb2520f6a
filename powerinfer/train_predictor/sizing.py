"""Per-layer predictor width from sparsity, within a parameter budget.

The PowerInfer paper sizes each layer's predictor (``fc2(relu(fc1 x))``, hidden width
``H_i``) from the layer's sparsity and skew: a denser layer has more neurons to get right
and gets a wider predictor. Its published ReluLLaMA-7B predictors use ``H`` in
{1024, 1280, ..., 2048} (steps of 256) and keep all predictors near 6-9% of the model's
parameters (FORMATS.md section 3). The rule here, written so it holds for any model size:

1. Budget: ``budget * n_params`` predictor parameters in total (default 9%, the top of
   the paper's 6-9%: at 7B the 1024 floor alone costs 7.4%, so a lower budget leaves
   no room to follow sparsity); a layer's predictor costs ``H_i * (n_embd + n_ff)``, so
   the mean width is ``H_mean = budget * n_params / (n_layer * (n_embd + n_ff))``.
2. Share: ``H_i`` proportional to the layer's active share ``a_i = 1 - sparsity``, so
   denser layers get wider predictors. Layers that would fall outside ``[h_min, h_max]``
   are pinned to the bound and the rest of the budget is shared again among the others
   (water-filling), so the total stays on budget unless the bounds forbid it.
3. Round to the nearest multiple of ``step``, with these bounds:

   * ``step`` = the power of two nearest below ``n_embd / 16``, clamped to [8, 256]
     (256 for n_embd 4096 as published; 8 for n_embd 64);
   * ``h_min`` = ``n_embd / 4`` rounded up to ``step`` (1024 for 4096), but at least ``min(n_embd, 64)``;
   * ``h_max`` = ``n_embd / 2`` rounded to ``step`` (2048 for 4096), but at least ``min(2 n_embd, 128)``.

   For 7B-class models the clamp matches the published 1024..2048 range. Tiny models get
   a relatively wider floor: a predictor for a ReGLU FFN must approximate the sign of
   ``W_gate x``, a rank-``n_embd`` map, and ``2 n_embd`` ReLU units represent it exactly
   (``relu(z) - relu(-z) = z``), so for very small ``n_embd`` the floor and ceiling follow
   that instead of the budget (a 64-dim model's 9% budget would allow only ~20 units).
   The realised share of the model is reported, not forced.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["DEFAULT_BUDGET", "size_rule", "predictor_hidden_sizes", "predictor_params"]

DEFAULT_BUDGET = 0.09


def _round_to(v: float, step: int) -> int:
    return int(step * max(1, round(v / step)))


def size_rule(n_embd: int) -> tuple[int, int, int]:
    """``(step, h_min, h_max)`` for a model of width ``n_embd`` (see the module docstring)."""
    if n_embd < 1:
        raise ValueError(f"n_embd must be positive, got {n_embd}")
    step = 2 ** int(math.floor(math.log2(max(n_embd / 16, 1))))
    step = min(256, max(8, step))
    h_min = step * math.ceil(max(n_embd / 4, min(n_embd, 64)) / step)
    h_max = max(h_min, _round_to(max(n_embd / 2, min(2 * n_embd, 128)), step))
    return step, h_min, h_max


def predictor_params(hidden: Sequence[int], n_embd: int, n_ff: int) -> int:
    """Total parameters of predictors with widths ``hidden``: ``sum(H_i) * (n_embd + n_ff)``."""
    return int(sum(hidden)) * (n_embd + n_ff)


def predictor_hidden_sizes(active_share: Sequence[float], n_embd: int, n_ff: int, n_params: int,
                           budget: float = DEFAULT_BUDGET, h_min: int | None = None,
                           h_max: int | None = None, step: int | None = None) -> list[int]:
    """Hidden width ``H_i`` per layer (rule in the module docstring).

    ``active_share[i]``: layer ``i``'s mean share of active neurons per token (``1 -
    sparsity``, from profiling or the collected masks); ``n_params``: the model's
    parameter count; ``budget``: predictor parameters as a fraction of ``n_params``.
    ``h_min``/``h_max``/``step`` override the defaults of :func:`size_rule`.
    Returns ints, multiples of ``step`` (unless a bound is not), within ``[h_min, h_max]``;
    a denser layer never gets a narrower predictor than a sparser one. Raises ValueError on bad arguments.
    """
    if not active_share:
        raise ValueError("need at least one layer")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if any(not (0.0 <= a <= 1.0) for a in active_share):
        raise ValueError(f"active shares must be in [0, 1], got {list(active_share)}")
    d_step, d_min, d_max = size_rule(n_embd)
    step = step or d_step
    h_min = h_min if h_min is not None else d_min
    h_max = h_max if h_max is not None else d_max
    if not 0 < h_min <= h_max:
        raise ValueError(f"need 0 < h_min <= h_max, got {h_min}, {h_max}")
    n_layer = len(active_share)
    total_h = budget * n_params / (n_embd + n_ff)  # sum of H_i the budget allows
    weights = [max(a, 1e-6) for a in active_share]
    fixed: dict[int, float] = {}  # layers pinned at h_min or h_max
    raw: list[float] = []
    for _ in range(n_layer + 1):  # water-filling: pin out-of-range layers, share the rest
        free = [i for i in range(n_layer) if i not in fixed]
        w_free = sum(weights[i] for i in free)
        left = max(total_h - sum(fixed.values()), 0.0)
        raw = [fixed[i] if i in fixed else left * weights[i] / w_free for i in range(n_layer)]
        pin = {i: (h_min if raw[i] < h_min else h_max) for i in free if not h_min <= raw[i] <= h_max}
        if not pin or len(pin) == len(free):
            fixed.update(pin)
            raw = [fixed.get(i, raw[i]) for i in range(n_layer)]
            break
        # pin only the side that is most out of range this round (keeps it monotone in density)
        lows = {i: v for i, v in pin.items() if v == h_min}
        fixed.update(lows if lows else pin)
    return [int(min(max(_round_to(h, step), h_min), h_max)) for h in raw]

"""Neuron placement under a VRAM budget: which FFN neurons live on the GPU.

PowerInfer (paper section 6, upstream ``powerinfer-py/powerinfer/solver.py``) keeps the
*hot* neurons of every FFN layer on the GPU and the cold ones on the CPU. Neurons are
placed in chunks: within a layer the neurons are ordered hottest first (activation count
descending, ties by index) and grouped into chunks of ``chunk`` neurons (the paper uses 64,
upstream's solver 256; the last chunk of a layer may be smaller when ``n_ff`` is not a
multiple of ``chunk``). A layer always takes a *prefix* of its chunks (its hottest ones).
The goal is to maximise the activation counts served by the GPU subject to a neuron
capacity (``floor(VRAM budget / bytes per neuron)``), optionally with a per-layer minimum
(paper: a layer is either wholly on the CPU or holds at least a worthwhile share; upstream:
``--threshold`` neurons).

How it is solved (and why it is exact):

1. Capacity 0 places nothing; a capacity >= all neurons places everything.
2. No minimum and every chunk of the same size (``n_ff % chunk == 0`` for every layer, or
   ``chunk == 1``): taking the ``floor(capacity / chunk)`` globally hottest chunks is optimal
   (all items weigh the same; within a layer chunk values never increase, so the hottest
   set is prefix-closed). Method ``greedy``. Every published model (n_ff 11008, 13824,
   14336, 28672, 32768) is a multiple of both 64 and 256, so this is the usual path.
3. Otherwise (short tail chunks, or a per-layer minimum) a feasible greedy answer is built
   (by value density; a layer's first item is its whole minimum block). If it reaches the
   fractional (LP) upper bound it is optimal (method ``greedy``).
4. Else an exact multiple-choice knapsack DP (method ``dp``): per layer the options are
   "take k chunks" (0, or any k meeting the minimum); a Lagrangian bound drops every option
   that cannot beat the greedy answer, and a DP over neurons solves the rest exactly. It
   is used when the pruned DP is small (``DP_MAX_WORK`` element updates; ~0.1 s).
5. Else the MILP with ``scipy.optimize.milp`` (HiGHS), method ``milp``, in the tight
   (perspective) form: binary ``on[l]`` carries layer l's minimum block, continuous
   ``y[l,c] in [0, on[l]]`` its further full chunks, binary ``t[l]`` its tail (only after
   all full chunks), integer ``m[l] = sum_c y[l,c]`` when chunk sizes differ. HiGHS's answer
   is re-scored exactly, its on/off choice re-filled exactly, and the better of it and the
   greedy answer is returned; on a time-out or failure the greedy answer is returned and
   ``info.status`` says ``time_limit``/``failed``. HiGHS's "optimal" is up to its relative
   gap (``MIP_REL_GAP``) and feasibility tolerances.

``method="milp"`` forces step 5 (used to cross-check); ``method="greedy"`` stops at step 3.
Measured on a 70B shape (80 x 28672, chunk 64, see ``benchmarks/bench_placement.py``):
under 0.4 s without a minimum and under 2 s with one.

Sizes are in neurons; bytes are only used to turn a budget into a capacity (see
:func:`neuron_bytes`, :func:`capacity_for_budget`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import PowerInferError

DP_MAX_WORK = 6e7  # array element updates allowed for the exact DP (~0.2 s)
DP_MAX_STATES = 2e7  # layers x neuron states kept for back-tracking (<= 80 MB)
MIP_REL_GAP = 1e-9  # HiGHS relative gap: "optimal" means within 1e-9 of the bound

__all__ = [
    "DTYPE_BLOCKS",
    "Placement",
    "SolverInfo",
    "capacity_for_budget",
    "neuron_bytes",
    "place_neurons",
    "solve_placement",
]

#: dtype name -> (weights per block, bytes per block), as ggml stores rows.
DTYPE_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
}


def neuron_bytes(n_embd: int, dtype_name: str, gated: bool) -> int:
    """Bytes one FFN neuron occupies on the GPU: its gate, up and down rows.

    ``n_embd``: hidden size (each neuron row holds ``n_embd`` weights). ``dtype_name``: one
    of ``f32``, ``f16``, ``bf16``, ``q8_0`` (34 bytes per 32 weights), ``q4_0`` (18 bytes per
    32 weights); case-insensitive. ``gated``: the family has a gate projection
    (``Family.gated``: 3 rows per neuron, else 2 -- Falcon/OPT). Returns an int (bytes).
    Upstream llama.cpp estimates this with fudge factors (``n_ff`` x type size x 4.5, then
    x 4 neurons); this is the honest row size (FORMATS.md section 6).

    Raises PowerInferError for an unknown dtype, ``n_embd <= 0``, or a quantized type whose
    block does not divide ``n_embd`` (ggml cannot store such rows).
    """
    key = str(dtype_name).lower()
    if key not in DTYPE_BLOCKS:
        raise PowerInferError(f"dtype {dtype_name!r} is not supported for placement (known: {', '.join(DTYPE_BLOCKS)})")
    if not isinstance(n_embd, (int, np.integer)) or n_embd <= 0:
        raise PowerInferError(f"n_embd = {n_embd!r} must be a positive integer")
    block, block_bytes = DTYPE_BLOCKS[key]
    if n_embd % block:
        raise PowerInferError(f"n_embd = {n_embd} is not a multiple of the {key} block size {block}")
    return int(n_embd // block * block_bytes * (3 if gated else 2))


def capacity_for_budget(vram_budget: int | float, bytes_per_neuron: int | float) -> int:
    """Neurons that fit in ``vram_budget`` bytes: ``floor(vram_budget / bytes_per_neuron)``.

    Exact for integer inputs (integer division); a float ``bytes_per_neuron`` is corrected
    for rounding so that ``capacity * bytes_per_neuron <= vram_budget`` always holds.
    Raises PowerInferError for a negative or non-finite budget or a non-positive neuron size.
    """
    if not _finite(vram_budget) or vram_budget < 0:
        raise PowerInferError(f"VRAM budget {vram_budget!r} bytes must be a non-negative number")
    if not _finite(bytes_per_neuron) or bytes_per_neuron <= 0:
        raise PowerInferError(f"bytes per neuron {bytes_per_neuron!r} must be a positive number")
    if float(vram_budget).is_integer() and float(bytes_per_neuron).is_integer():
        return int(vram_budget) // int(bytes_per_neuron)
    n = int(math.floor(vram_budget / bytes_per_neuron))
    while n > 0 and n * bytes_per_neuron > vram_budget:
        n -= 1
    while (n + 1) * bytes_per_neuron <= vram_budget:
        n += 1
    return n


@dataclass
class SolverInfo:
    """How a placement was found.

    ``method``: ``greedy``, ``dp`` or ``milp`` (the method whose answer was returned). ``status``:
    ``optimal`` (proved), ``feasible`` (greedy with no proof, only with ``method='greedy'``),
    or ``time_limit``/``failed`` when HiGHS stopped early (the better feasible answer is
    returned). ``time_s``: wall seconds. ``objective``: activation counts served by the GPU.
    ``bound``: an upper bound on the objective when known. ``message``: free text.
    """

    method: str
    status: str
    time_s: float
    objective: float
    bound: float | None = None
    message: str = ""


@dataclass
class Placement:
    """Which neurons of each layer are on the GPU.

    ``gpu[l]``: bool ``[n_ff_l]``, True = neuron on the GPU. ``n_gpu[l]``: neurons on the GPU.
    ``capacity``: the neuron capacity the solver was given. ``neuron_bytes``: bytes per neuron
    (None when the caller gave a capacity in neurons only). ``chunk``: chunk size in neurons.
    ``min_neurons[l]``: the per-layer minimum (0 = none). ``served[l]``: share of layer
    ``l``'s activation counts on the GPU (0.0 for a layer with no counts). ``served_total``:
    the share over all layers. ``info``: :class:`SolverInfo`.
    """

    gpu: list[np.ndarray]
    n_gpu: list[int]
    capacity: int
    chunk: int
    min_neurons: list[int]
    served: list[float]
    served_total: float
    info: SolverInfo
    neuron_bytes: float | None = None
    n_ff: list[int] = field(default_factory=list)

    @property
    def n_layer(self) -> int:
        return len(self.gpu)

    @property
    def used(self) -> int:
        """Neurons placed on the GPU (all layers)."""
        return int(sum(self.n_gpu))

    @property
    def bytes_used(self) -> int | float | None:
        """``used * neuron_bytes`` (None when bytes per neuron is unknown)."""
        if self.neuron_bytes is None:
            return None
        b = self.used * self.neuron_bytes
        return int(b) if float(b).is_integer() else b

    def buckets(self) -> list[np.ndarray]:
        """Per layer, the sorted indices of the GPU neurons (int32; may be empty)."""
        return [np.flatnonzero(g).astype(np.int32) for g in self.gpu]

    def summary(self) -> str:
        total = sum(self.n_ff)
        b = "" if self.bytes_used is None else f", {self.bytes_used / 2**20:.1f} MiB"
        return (
            f"{self.used} of {total} neurons on the GPU{b}, serving {self.served_total:.1%} of activations "
            f"({self.info.method} {self.info.status}, chunk {self.chunk}, {self.info.time_s:.2f} s)"
        )


# --------------------------------------------------------------------------- public API
def place_neurons(
    counts: Sequence[Any],
    vram_budget: int | float,
    bytes_per_neuron: int | float,
    *,
    chunk: int = 64,
    min_share: float = 0.0,
    min_neurons: int = 0,
    time_limit: float = 30.0,
    method: str = "auto",
) -> Placement:
    """Place neurons under a VRAM budget in bytes.

    ``counts``: per layer a 1-D tensor/array of activation counts (length ``n_ff_l``,
    non-negative, finite; any real dtype). ``vram_budget``: bytes available for FFN neurons
    (0 places nothing; negative -> PowerInferError). ``bytes_per_neuron``: from
    :func:`neuron_bytes`. The capacity is ``floor(vram_budget / bytes_per_neuron)`` neurons;
    the rest is :func:`solve_placement`.
    """
    cap = capacity_for_budget(vram_budget, bytes_per_neuron)
    p = solve_placement(counts, cap, chunk=chunk, min_share=min_share, min_neurons=min_neurons,
                        time_limit=time_limit, method=method)
    p.neuron_bytes = bytes_per_neuron
    return p


def solve_placement(
    counts: Sequence[Any],
    capacity: int,
    *,
    chunk: int = 64,
    min_share: float = 0.0,
    min_neurons: int = 0,
    time_limit: float = 30.0,
    method: str = "auto",
) -> Placement:
    """Place at most ``capacity`` neurons, maximising the activation counts on the GPU.

    ``counts``: per layer a 1-D array of counts (see :func:`place_neurons`). ``capacity``:
    neurons (upstream ``--capacity``). ``chunk``: neurons per chunk (paper 64, upstream 256);
    chunks are cut from each layer's hottest-first order and the last one may be short. The
    per-layer minimum is ``max(ceil(min_share * n_ff_l), min_neurons)`` neurons (capped at
    ``n_ff_l``): such a layer holds 0 or at least that many (upstream ``--threshold``).
    ``time_limit``: seconds for HiGHS. ``method``: ``auto`` (exact: greedy when provably
    optimal, else the pruned DP, else the MILP; see the module docstring), ``milp`` (always
    run HiGHS; never worse than greedy) or ``greedy`` (feasible greedy only; exact without a
    minimum when all chunks have the same size).

    Raises PowerInferError for bad counts, a negative capacity, ``chunk < 1``,
    ``min_share`` outside [0, 1] or a negative ``min_neurons``.
    """
    t0 = time.perf_counter()
    arrays = _check_counts(counts)
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
        if _finite(capacity) and float(capacity).is_integer():
            capacity = int(capacity)
        else:
            raise PowerInferError(f"capacity {capacity!r} must be a whole number of neurons")
    if capacity < 0:
        raise PowerInferError(f"capacity {capacity} neurons is negative")
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise PowerInferError(f"chunk size {chunk!r} must be a positive integer")
    if not _finite(min_share) or not 0.0 <= min_share <= 1.0:
        raise PowerInferError(f"per-layer minimum share {min_share!r} must be between 0 and 1")
    if not isinstance(min_neurons, (int, np.integer)) or min_neurons < 0:
        raise PowerInferError(f"per-layer minimum {min_neurons!r} neurons must be a non-negative integer")
    if method not in ("auto", "milp", "greedy"):
        raise PowerInferError(f"method {method!r} must be auto, milp or greedy")

    prob = _Problem(arrays, int(capacity), int(chunk), min_share, int(min_neurons))
    k, info = _solve(prob, method, time_limit)
    info.time_s = time.perf_counter() - t0
    return prob.placement(k, info)


# --------------------------------------------------------------------------- internals
def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _check_counts(counts: Sequence[Any]) -> list[np.ndarray]:
    if counts is None or len(counts) == 0:
        raise PowerInferError("no layers: activation counts are empty")
    out = []
    for i, c in enumerate(counts):
        if hasattr(c, "detach"):  # torch tensor, without importing torch here
            c = c.detach().cpu().double().numpy()
        a = np.asarray(c)
        if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "biuf" or a.dtype == np.bool_:
            raise PowerInferError(f"layer {i}: activation counts must be a non-empty 1-D real array, got shape {a.shape} {a.dtype}")
        a = a.astype(np.float64)
        if not np.isfinite(a).all() or (a < 0).any():
            raise PowerInferError(f"layer {i}: activation counts must be finite and non-negative")
        out.append(a)
    return out


class _Problem:
    """Chunked view of the counts: per layer the hottest-first order and chunk values."""

    def __init__(self, counts: list[np.ndarray], capacity: int, chunk: int, min_share: float, min_neurons: int):
        self.counts = counts
        self.capacity = capacity
        self.S = chunk
        self.n_ff = [c.size for c in counts]
        self.order: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []  # chunk values, hottest first (last may be a short tail)
        self.min_neurons: list[int] = []
        self.min_chunks: list[int] = []
        for c in counts:
            o = np.argsort(-c, kind="stable")
            self.order.append(o)
            starts = np.arange(0, c.size, chunk)
            self.vals.append(np.add.reduceat(c[o], starts))
            m = max(math.ceil(min_share * c.size - 1e-9), min_neurons) if (min_share > 0 or min_neurons > 0) else 0
            m = min(m, c.size)
            self.min_neurons.append(m)
            self.min_chunks.append(-(-m // chunk))
        self.K = [v.size for v in self.vals]                      # chunks per layer
        self.F = [n // chunk for n in self.n_ff]                  # full chunks per layer
        self.tail = [n - f * chunk for n, f in zip(self.n_ff, self.F)]  # short tail size (0: none)
        self.has_min = any(self.min_neurons)
        self.total = sum(self.n_ff)

    def neurons(self, l: int, k: int) -> int:
        return min(k * self.S, self.n_ff[l])

    def value(self, k: Sequence[int]) -> float:
        return float(sum(v[:kk].sum() for v, kk in zip(self.vals, k)))

    def feasible(self, k: Sequence[int]) -> bool:
        if sum(self.neurons(l, kk) for l, kk in enumerate(k)) > self.capacity:
            return False
        return all(kk == 0 or self.neurons(l, kk) >= self.min_neurons[l] for l, kk in enumerate(k))

    def uniform_chunks(self) -> bool:
        return self.S == 1 or all(t == 0 for t in self.tail)

    def lp_bound(self) -> float:
        """Fractional knapsack bound (ignores the minimum, which only removes answers).

        With equal-size chunks only whole chunks fit, so the capacity is rounded down to a
        multiple of the chunk first (still a valid bound)."""
        vals = np.concatenate(self.vals)
        sizes = np.concatenate([np.minimum(self.S, n - np.arange(0, n, self.S)) for n in self.n_ff]).astype(np.float64)
        o = np.argsort(-(vals / sizes), kind="stable")
        cap = self.capacity // self.S * self.S if self.uniform_chunks() else self.capacity
        cw = np.cumsum(sizes[o])
        n = int(np.searchsorted(cw, cap, side="right"))
        bound = float(vals[o[:n]].sum())
        if n < o.size:
            rest = cap - (cw[n - 1] if n else 0.0)
            bound += float(vals[o[n]] / sizes[o[n]] * rest)
        return bound

    def placement(self, k: Sequence[int], info: SolverInfo) -> Placement:
        gpu, n_gpu, served = [], [], []
        on_total = 0.0
        for l, kk in enumerate(k):
            n = self.neurons(l, int(kk))
            g = np.zeros(self.n_ff[l], dtype=bool)
            g[self.order[l][:n]] = True
            gpu.append(g)
            n_gpu.append(n)
            tot = float(self.counts[l].sum())
            on = float(self.vals[l][: int(kk)].sum())
            on_total += on
            served.append(on / tot if tot > 0 else 0.0)
        grand = float(sum(c.sum() for c in self.counts))
        return Placement(
            gpu=gpu, n_gpu=n_gpu, capacity=self.capacity, chunk=self.S, min_neurons=list(self.min_neurons),
            served=served, served_total=on_total / grand if grand > 0 else 0.0, info=info, n_ff=list(self.n_ff),
        )


def _solve(prob: _Problem, method: str, time_limit: float) -> tuple[list[int], SolverInfo]:
    L = len(prob.n_ff)
    if prob.capacity >= prob.total:  # everything fits (every layer full satisfies any minimum)
        k = list(prob.K)
        v = prob.value(k)
        return k, SolverInfo("greedy", "optimal", 0.0, v, v, "capacity holds every neuron")
    if prob.capacity == 0:
        return [0] * L, SolverInfo("greedy", "optimal", 0.0, 0.0, 0.0, "zero capacity")

    k_g = _greedy(prob)
    v_g = prob.value(k_g)
    if method == "greedy":
        exact = not prob.has_min and prob.uniform_chunks()
        return k_g, SolverInfo("greedy", "optimal" if exact else "feasible", 0.0, v_g, None,
                               "equal-size chunks: greedy is exact" if exact else "greedy heuristic")
    if method == "auto":
        if not prob.has_min and prob.uniform_chunks():
            return k_g, SolverInfo("greedy", "optimal", 0.0, v_g, v_g, "equal-size chunks: greedy is exact")
        bound = prob.lp_bound()
        if v_g >= bound * (1 - 1e-12):
            return k_g, SolverInfo("greedy", "optimal", 0.0, v_g, bound, "greedy reaches the LP bound")
        k_dp = _dp_exact(prob, k_g, v_g)
        if k_dp is not None and prob.feasible(k_dp):
            v_dp = prob.value(k_dp)
            if v_dp >= v_g:
                return k_dp, SolverInfo("dp", "optimal", 0.0, v_dp, v_dp, "Lagrangian-pruned knapsack DP")
            return k_g, SolverInfo("greedy", "optimal", 0.0, v_g, v_g, "greedy proved optimal by the DP")
    return _milp_or_greedy(prob, k_g, v_g, time_limit)


def _dp_exact(prob: _Problem, k_inc: list[int], v_inc: float, max_work: float = DP_MAX_WORK) -> list[int] | None:
    """Exact answer by a pruned multiple-choice knapsack DP, or None when too big.

    Each layer picks one option k (chunks taken; 0 or any k meeting its minimum) with weight
    ``neurons(l, k)`` and value ``P_l(k)``. A Lagrangian bound prunes options first: for a
    price ``lam >= 0``, ``D(lam) = lam * C + sum_l max_k (P_l(k) - lam * w_l(k))`` bounds every
    answer, and any answer that uses option k of layer l is worth at most
    ``D(lam) - (max_k' (P_l(k') - lam * w_l(k')) - (P_l(k) - lam * w_l(k)))``; options whose
    bound is below the incumbent ``v_inc`` cannot beat it and are dropped (the incumbent's own
    options always survive). The DP then runs over the surviving options in neurons, offset
    by each layer's lightest option, so it is exact among everything that could still win.
    Returns None when the DP would take more than ``max_work`` array element updates.
    """
    L, S, C = len(prob.vals), prob.S, prob.capacity
    Kmax = max(prob.K)
    ks = np.arange(Kmax + 1)
    P = np.full((L, Kmax + 1), -np.inf)
    W = np.zeros((L, Kmax + 1))
    for l, vals in enumerate(prob.vals):
        kl = prob.K[l]
        P[l, : kl + 1] = np.concatenate([[0.0], np.cumsum(vals)])
        W[l, : kl + 1] = np.minimum(ks[: kl + 1] * S, prob.n_ff[l])
        if prob.min_chunks[l] > 1:
            P[l, 1: prob.min_chunks[l]] = -np.inf

    def dual(lam: float) -> tuple[float, np.ndarray, float]:
        red = P - lam * W
        g = red.max(axis=1)
        used = W[np.arange(L), red.argmax(axis=1)].sum()
        return lam * C + float(g.sum()), g, C - used

    # D is convex in lam; bisect on the sign of its slope (capacity left over at that price).
    # Any lam gives a valid bound, so precision only affects how much is pruned.
    lo, hi = 0.0, float(max((v / np.minimum(S, n - np.arange(0, n, S))).max() for v, n in zip(prob.vals, prob.n_ff))) + 1.0
    lam_best, best = lo, dual(lo)
    for lam in [hi] + [None] * 60:
        if lam is None:
            lam = 0.5 * (lo + hi)
        d = dual(lam)
        if d[0] < best[0]:
            best, lam_best = d, lam
        if d[2] >= 0:
            hi = lam
        else:
            lo = lam
    D, g, _ = best
    slack = D - v_inc + 1e-9 * max(1.0, abs(D))
    keep = (g[:, None] - (P - lam_best * W)) <= slack
    keep &= np.isfinite(P)
    for l, k in enumerate(k_inc):
        keep[l, k] = True
    opts = [np.flatnonzero(keep[l]) for l in range(L)]
    wmin = [int(W[l, o].min()) for l, o in enumerate(opts)]
    R = C - sum(wmin)
    width = int(min(R, sum(int(W[l, o].max()) - wmin[l] for l, o in enumerate(opts))))
    if width < 0:
        return None
    if sum(o.size for o in opts) * (width + 1) > max_work or L * (width + 1) > DP_MAX_STATES:
        return None
    cur = np.full(width + 1, -np.inf)
    cur[0] = 0.0
    choice = np.zeros((L, width + 1), dtype=np.int16 if Kmax < 2**15 else np.int32)
    for l, o in enumerate(opts):
        new = np.full(width + 1, -np.inf)
        for k in o:
            dw = int(W[l, k]) - wmin[l]
            if dw > width:
                continue
            cand = cur[: width + 1 - dw] + P[l, k]
            seg = new[dw:]
            better = cand > seg
            seg[better] = cand[better]
            choice[l, dw:][better] = k
        cur = new
    s = int(np.argmax(cur))
    if not np.isfinite(cur[s]):
        return None
    k_out = [0] * L
    for l in range(L - 1, -1, -1):
        k = int(choice[l, s])
        k_out[l] = k
        s -= int(W[l, k]) - wmin[l]
    return k_out


def _greedy(prob: _Problem, on: Sequence[bool] | None = None) -> list[int]:
    """Feasible greedy by value density; returns chunks taken per layer.

    Without ``on``: items of layer l are block0 = its first max(min_chunks, 1) chunks, then
    one item per further chunk. With ``on`` (a fixed on/off choice, e.g. from the MILP):
    layers that are off take nothing, layers that are on get their minimum block up front
    and compete with single chunks for the rest (exact for equal-size chunks). Densities are
    made non-increasing within a layer (guards float rounding), so the sorted order is
    prefix-closed; items are taken in that order while they fit, and a layer whose next item
    does not fit takes nothing more.
    """
    S, cap = prob.S, prob.capacity
    L = len(prob.vals)
    base = np.zeros(L, dtype=np.int64)  # chunks forced up front
    if on is not None:
        for l in range(L):
            if on[l]:
                base[l] = prob.min_chunks[l]
                cap -= prob.neurons(l, int(base[l]))
        if cap < 0:
            raise AssertionError("forced minimum blocks exceed the capacity")
    lay, idx, w, dens = [], [], [], []
    firsts = []
    for l, vals in enumerate(prob.vals):
        n = prob.n_ff[l]
        sizes = np.minimum(S, n - np.arange(0, n, S))
        if on is not None:
            if not on[l] and prob.min_chunks[l] > 0:
                firsts.append(0)
                continue
            b = int(base[l])
            iw, iv = sizes[b:].astype(np.float64), vals[b:]
        else:
            b = max(prob.min_chunks[l], 1)
            iw = np.concatenate([[sizes[:b].sum()], sizes[b:]]).astype(np.float64)
            iv = np.concatenate([[vals[:b].sum()], vals[b:]])
        firsts.append(b)
        if iw.size == 0:
            continue
        lay.append(np.full(iw.size, l))
        idx.append(np.arange(iw.size))
        w.append(iw)
        dens.append(np.minimum.accumulate(iv / iw))
    taken = np.zeros(L, dtype=np.int64)
    if lay:
        lay_a, idx_a, w_a, d_a = map(np.concatenate, (lay, idx, w, dens))
        order = np.lexsort((idx_a, lay_a, -d_a))
        cw = np.cumsum(w_a[order])
        n_fit = int(np.searchsorted(cw, cap, side="right"))
        taken = np.bincount(lay_a[order[:n_fit]], minlength=L).astype(np.int64)
        remaining = cap - (int(cw[n_fit - 1]) if n_fit else 0)
        if n_fit < order.size and remaining > 0:
            blocked = np.zeros(L, dtype=bool)
            min_w = float(w_a.min())
            for j in order[n_fit:]:
                if remaining < min_w:
                    break
                l = lay_a[j]
                if blocked[l] or idx_a[j] != taken[l]:
                    continue
                if w_a[j] <= remaining:
                    taken[l] += 1
                    remaining -= int(w_a[j])
                else:
                    blocked[l] = True
    if on is not None:
        return [int(base[l] + taken[l]) for l in range(L)]
    return [0 if t == 0 else firsts[l] + int(t) - 1 for l, t in enumerate(taken)]


def _milp_or_greedy(prob: _Problem, k_g: list[int], v_g: float, time_limit: float) -> tuple[list[int], SolverInfo]:
    """Exact MILP (HiGHS) in the perspective form; returns the better of it and greedy.

    Per layer l with a minimum: binary ``on[l]`` carries the minimum block (its first
    ``q[l]`` chunks: value ``P_l(q)``, weight ``neurons(q)``); each further full chunk c has a
    continuous ``y[l,c] in [0, on[l]]`` (the tight, perspective bound). A short tail chunk is
    a binary ``t[l]`` allowed only once every full chunk is taken. With equal-size chunks the
    capacity is counted in chunks and, for integral ``on``, the remaining LP (one cardinality
    row over ``0 <= y <= 1``) has integral vertices, so only ``on``/``t`` are integer; with
    tails an integer ``m[l] = sum_c y[l,c]`` is added.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    S, L = prob.S, len(prob.vals)
    uniform = prob.uniform_chunks()
    scale = max(float(max(v.max() for v in prob.vals)), 1e-300)
    q = list(prob.min_chunks)
    cols_c: list[float] = []   # objective
    ub: list[float] = []
    integ: list[int] = []

    def var(cost: float, upper: float, is_int: int) -> int:
        cols_c.append(-cost / scale)
        ub.append(upper)
        integ.append(is_int)
        return len(cols_c) - 1

    on_of, y_of, t_of, m_of = {}, {}, {}, {}
    for l in range(L):
        vals = prob.vals[l]
        if q[l] > 0:
            on_of[l] = var(float(vals[: q[l]].sum()), 1.0, 1)
        first = q[l]
        last = prob.F[l]  # full chunks are [0, F)
        if first < last:
            y_of[l] = (var(float(vals[first]), 1.0, 0), last - first)
            for c in range(first + 1, last):
                var(float(vals[c]), 1.0, 0)
        if prob.tail[l] > 0 and q[l] < prob.K[l]:
            t_of[l] = var(float(vals[-1]), 1.0, 1)
        if not uniform and l in y_of:
            m_of[l] = var(0.0, float(y_of[l][1]), 1)
    nv = len(cols_c)

    rows: list[int] = []
    cols: list[int] = []
    data: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            data.append(val)
        lo.append(low)
        hi.append(high)

    cap_row: list[tuple[int, float]] = []
    for l in range(L):
        ys = range(y_of[l][0], y_of[l][0] + y_of[l][1]) if l in y_of else range(0)
        unit = 1.0 if uniform else float(S)
        if l in on_of:
            w0 = prob.neurons(l, q[l])
            cap_row.append((on_of[l], float(q[l]) if uniform else float(w0)))
            for j in ys:
                add([(j, 1.0), (on_of[l], -1.0)], -np.inf, 0.0)  # y <= on
        cap_row.extend((j, unit) for j in ys)
        if l in t_of:
            cap_row.append((t_of[l], float(prob.tail[l])))
            n_y = len(ys)
            if n_y:
                add([(t_of[l], float(n_y))] + [(j, -1.0) for j in ys], -np.inf, 0.0)
            elif l in on_of:
                add([(t_of[l], 1.0), (on_of[l], -1.0)], -np.inf, 0.0)
        if l in m_of:
            add([(j, 1.0) for j in ys] + [(m_of[l], -1.0)], 0.0, 0.0)
    cap = float(prob.capacity // S) if uniform else float(prob.capacity)
    add(cap_row, -np.inf, cap)

    A = coo_matrix((data, (rows, cols)), shape=(len(lo), nv)).tocsr()
    t0 = time.perf_counter()
    try:
        res = milp(np.array(cols_c), constraints=LinearConstraint(A, lo, hi), integrality=np.array(integ),
                   bounds=Bounds(np.zeros(nv), np.array(ub)),
                   options={"time_limit": float(time_limit), "mip_rel_gap": MIP_REL_GAP, "presolve": False})
    except Exception as e:  # noqa: BLE001 - any HiGHS failure falls back to greedy
        return k_g, SolverInfo("greedy", "failed", 0.0, v_g, None, f"MILP failed ({type(e).__name__}: {e}); greedy answer")
    dt = time.perf_counter() - t0
    bound = None
    if getattr(res, "mip_dual_bound", None) is not None and np.isfinite(res.mip_dual_bound):
        bound = -float(res.mip_dual_bound) * scale
    status = {0: "optimal", 1: "time_limit"}.get(res.status, "failed")
    if res.x is None:
        return k_g, SolverInfo("greedy", status, dt, v_g, bound, f"HiGHS: {res.message}; greedy answer")
    x = res.x
    k = []
    for l in range(L):
        on = int(round(x[on_of[l]])) if l in on_of else 1
        extra = 0
        if l in y_of:
            j, n = y_of[l]
            extra = int(math.floor(float(x[j: j + n].sum()) + 1e-6))
        kk = q[l] + extra if on else 0
        if on and l in t_of and round(x[t_of[l]]) == 1 and kk == prob.F[l]:
            kk += 1
        k.append(kk if kk > 0 or q[l] > 0 else 0)
    if not prob.feasible(k):
        return k_g, SolverInfo("greedy", "failed", dt, v_g, bound, "MILP answer infeasible after rounding; greedy answer")
    # Polish: keep HiGHS's on/off choice and refill the rest exactly (removes LP tolerance noise).
    k_p = _greedy(prob, on=[kk > 0 for kk in k])
    if prob.feasible(k_p) and prob.value(k_p) > prob.value(k):
        k = k_p
    v = prob.value(k)
    if bound is not None and status == "optimal":
        bound = max(bound, v, v_g)  # HiGHS's dual bound carries its tolerances
    if v_g > v:
        return k_g, SolverInfo("greedy", status, dt, v_g, bound, f"greedy beat HiGHS ({res.message})")
    return k, SolverInfo("milp", status, dt, v, bound, f"HiGHS: {res.message}")

"""What stays resident under a RAM budget (``--ram-budget``), and what is read from the file.

A sparse (PWRI) model whose file is larger than the memory it may use runs from a memory
hierarchy, as PowerInfer runs hot neurons on the GPU and cold ones on the CPU, one level
down: RAM holds what every token needs and the hottest FFN neurons; the other FFN rows are
read from disk when the predictor marks them active (:mod:`powerinfer.runtime.cold_rows`).

**The plan.** One budget (GiB, everything the process keeps resident counted) is spent in
this order:

1. what every token needs, always resident (the *minimum*): the interpreter as it stands
   when the plan is made (Python, torch, the C kernels: the process's resident set then),
   attention matrices, norms, biases, predictors, the output matrix, the KV cache sized for
   the whole context (``-c``), a fixed margin for activations and scratch
   (:data:`SCRATCH_BYTES`), and a minimal reuse window (:data:`MIN_WINDOW_SLOTS` neurons per
   layer, at least the token embedding's bytes: the embedding is read row by row on demand
   but every row is scanned once at load, so its pages are resident then);
2. of what is left, :data:`WINDOW_SHARE` more goes to the reuse window (rows read for recent
   tokens, kept while they fit, those of the oldest token dropped first: LLM in a Flash's
   sliding window), one pool shared by the layers;
3. the rest holds the hottest FFN neurons (gate, up and down rows, in the file's type),
   chosen by the same placement as ``--vram-budget`` (:func:`powerinfer.convert.placement.
   place_neurons` over the activation counts, chunks of 64 neurons, each layer a prefix of
   its hottest chunks). Without activation counts no neuron is pinned and the reuse window
   takes everything (it then keeps the neurons recent tokens used).

**A model that fits.** When the budget holds the whole model (every weight, the KV cache, the
interpreter and the scratch margin: :attr:`ResidencyPlan.whole_model`), nothing is read from
disk: the plan says so (:attr:`ResidencyPlan.resident`) and the model runs the ordinary, fully
resident way, at its ordinary speed (``$POWERINFER_ROW_READS=always`` plans the disk reads
anyway: tests of the reader on small models).

Sizes are bytes as the runtime holds them (the file's bytes for quantized weights with the
C kernels). A budget below the minimum is refused before any weight is loaded, with the
minimum in the message.

**Both budgets.** ``--ram-budget`` with ``--vram-budget`` is refused for now: the GPU split
copies the CPU side's rows from full matrices, which a RAM budget never holds.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES
from .args import ModelArgs

log = logging.getLogger(__name__)

GIB = 1 << 30
SCRATCH_BYTES = 128 << 20  # activations, logits, read staging (16 MiB), thread arenas, library pages touched after
# the plan is made: measured on the 32-layer Q4_0 file, the process held ~100 MB more than the other items
MIN_WINDOW_SLOTS = 64  # neurons per layer the reuse window holds at least (reads land there)
WINDOW_SHARE = 0.25  # of the FFN room above the minimum, this much is reuse window, the rest hot neurons
CHUNK = 64  # placement chunk (neurons), as --vram-budget's GPU index
FFN_ROWS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight")
ROW_READS_ENV = "POWERINFER_ROW_READS"  # always: plan and read cold rows even when the whole model fits (tests)


def rss_bytes() -> int:
    """This process's resident set now (bytes), from ``/proc/self/statm``; 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set (bytes) so far (``VmHWM``); 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class ResidencyPlan:
    """How a RAM budget is spent (bytes unless said otherwise).

    ``hot[l]``: bool ``[n_ff]``, the neurons of layer ``l`` kept resident; ``order[l]``: int64
    ``[n_ff]``, layer ``l``'s neurons hottest first (the row cache's record order);
    ``window_slots``: neurons per layer the reuse window is sized for (:attr:`window_total`: the
    slots it has, shared by the layers, at most the neurons not pinned); ``parts``: per FFN neuron the
    rows it has (``(tensor suffix, GGML type name, bytes)``: gate, up, down_t).
    """

    budget: int
    interpreter: int
    fixed: dict[str, int]  # always-resident weights by kind: attention, predictor, output, norms+biases
    kv_cache: int
    scratch: int
    embedding: int  # token embedding bytes (read on demand; resident once at load)
    neuron_bytes: int  # one neuron's gate + up + down rows
    parts: list[tuple[str, str, int]]
    n_layer: int
    n_ff: int
    hot: list[np.ndarray] = field(default_factory=list)
    order: list[np.ndarray] = field(default_factory=list)
    window_slots: int = 0
    counts_source: str = "none"
    resident: bool = False  # the whole model fits: it runs the ordinary way, every weight resident

    @property
    def minimum(self) -> int:
        """The smallest budget this model and context run under."""
        return (self.interpreter + sum(self.fixed.values()) + self.kv_cache + self.scratch
                + self.min_window_bytes)

    @property
    def min_window_bytes(self) -> int:
        w = self.n_layer * MIN_WINDOW_SLOTS * self.neuron_bytes
        return max(w, self.embedding)

    @property
    def n_hot(self) -> int:
        return int(sum(int(h.sum()) for h in self.hot))

    @property
    def hot_bytes(self) -> int:
        return self.n_hot * self.neuron_bytes

    @property
    def window_total(self) -> int:
        """Slots of the reuse window (shared by the layers): ``window_slots`` per layer, at most
        the neurons not pinned (a slot more could never be used)."""
        cold = self.n_layer * self.n_ff - self.n_hot
        return min(self.window_slots * self.n_layer, cold)

    @property
    def window_bytes(self) -> int:
        return self.window_total * self.neuron_bytes

    @property
    def whole_model(self) -> int:
        """Bytes the ordinary (unbudgeted) run keeps resident: every weight, the KV cache, the
        interpreter and the scratch margin."""
        return (self.interpreter + sum(self.fixed.values()) + self.embedding + self.ffn_bytes + self.kv_cache
                + self.scratch)

    @property
    def fits(self) -> bool:
        """The whole model fits in the budget: the ordinary fully resident run stays within it."""
        return self.budget >= self.whole_model

    @property
    def ffn_bytes(self) -> int:
        """Bytes of every FFN neuron's rows (what the file holds)."""
        return self.n_layer * self.n_ff * self.neuron_bytes

    def summary(self) -> str:
        mb = 1e6
        if self.resident:
            return (f"RAM budget {self.budget / GIB:.2f} GiB: the whole model fits ({self.whole_model / mb:.0f} MB "
                    f"resident: interpreter {self.interpreter / mb:.0f}, weights "
                    f"{(sum(self.fixed.values()) + self.embedding + self.ffn_bytes) / mb:.0f}, KV cache "
                    f"{self.kv_cache / mb:.0f}, scratch {self.scratch / mb:.0f}): every weight stays resident, "
                    "no FFN row is read from disk")
        fixed = ", ".join(f"{k} {v / mb:.0f}" for k, v in self.fixed.items())
        return (f"RAM budget {self.budget / GIB:.2f} GiB: interpreter {self.interpreter / mb:.0f} MB, {fixed}, "
                f"KV cache {self.kv_cache / mb:.0f}, scratch {self.scratch / mb:.0f}; hot FFN neurons "
                f"{self.n_hot / max(1, self.n_layer * self.n_ff):.1%} ({self.hot_bytes / mb:.0f} MB, counts: "
                f"{self.counts_source}), reuse window {self.window_total} neurons "
                f"({self.window_bytes / mb:.0f} MB); "
                + ("the other FFN rows are read from disk" if self.n_hot < self.n_layer * self.n_ff else
                   "every FFN row pinned (read from disk once, at load)"))


def ffn_parts(g: GGUFFile, a: ModelArgs) -> list[tuple[str, str, int]]:
    """Per FFN neuron its rows ``(tensor suffix, GGML type name, row bytes)``, checked alike in
    every layer (one type per matrix, a kernel type, shape ``[n_ff, n_embd]``). Raises
    PowerInferError naming the file and tensor otherwise."""
    names = FFN_ROWS if a.family.gated else FFN_ROWS[1:]
    parts = []
    for suffix in names:
        kind = None
        for i in range(a.n_layer):
            t = g.tensors.get(f"blk.{i}.{suffix}")
            if t is None:
                raise PowerInferError(f"{g.path}: tensor 'blk.{i}.{suffix}' is missing")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            k = t.tensor_type.name
            if shape != (a.n_ff, a.n_embd):
                raise PowerInferError(f"{g.path}: blk.{i}.{suffix} has shape {shape}, expected "
                                      f"[n_ff={a.n_ff}, n_embd={a.n_embd}]")
            if k not in MAPPED_TYPES:
                raise PowerInferError(f"{g.path}: blk.{i}.{suffix} has type {k}: --ram-budget reads FFN rows "
                                      f"of types {', '.join(MAPPED_TYPES)} only")
            if kind is not None and k != kind:
                raise PowerInferError(f"{g.path}: blk.{i}.{suffix} has type {k}, blk.0's has {kind}: "
                                      "--ram-budget needs one type per FFN matrix")
            kind = k
        rb = MAPPED_TYPES[kind].row_bytes(a.n_embd)
        parts.append((suffix, kind, rb))
    return parts


def _kind(name: str) -> str | None:
    """Which always-resident kind a non-FFN-row tensor is (None: the token embedding)."""
    if name == "token_embd.weight":
        return None
    if ".attn_" in name and name.endswith(".weight") and "norm" not in name:
        return "attention"
    if name.endswith(("fc1.weight", "fc2.weight")):
        return "predictor"
    if name.startswith("output.") or name == "position_embd.weight":
        return "output"
    return "norms+biases"


def plan_residency(g: GGUFFile, n_ctx: int, kv_dtype: torch.dtype | tuple[torch.dtype, torch.dtype], budget_gib: float,
                   counts: list | None = None, counts_source: str = "none",
                   interpreter: int | None = None) -> ResidencyPlan:
    """The plan for running PWRI file ``g`` with a context of ``n_ctx`` tokens (KV cache in
    ``kv_dtype``: one dtype, or ``(keys, values)`` as ``-ctk``/``-ctv`` give them) within
    ``budget_gib`` GiB. ``counts``: per layer activation counts ``[n_ff]``
    (None: no neuron pinned); ``interpreter``: bytes already resident (default: this
    process's resident set now). Reads the tensor table only (no weight is touched). When the
    whole model fits in the budget the plan is ``resident`` (every neuron hot, nothing to read:
    the caller runs the ordinary model), unless ``$POWERINFER_ROW_READS=always``.

    Raises PowerInferError for a dense file, FFN tensors it cannot read by rows, counts of the
    wrong shape, or a budget below the minimum (the message gives the minimum).
    """
    from ..convert.placement import place_neurons
    from .kv_cache import KVCache

    a = ModelArgs.from_gguf(g)
    if not a.sparse:
        raise PowerInferError(f"{g.path}: --ram-budget needs a PowerInfer (PWRI) file: a dense file has no "
                              "predictor to say which FFN rows to read")
    parts = ffn_parts(g, a)
    nb = sum(p[2] for p in parts)
    fixed: dict[str, int] = {"attention": 0, "predictor": 0, "output": 0, "norms+biases": 0}
    embd = 0
    rows = tuple(p[0] for p in parts)
    tied = "output.weight" not in g.tensors
    for t in g.reader.tensors:
        if t.name.startswith("blk.") and t.name.endswith(rows):
            continue
        kind = _kind(t.name)
        if kind is None:
            if tied:  # the output reads the whole embedding every token: resident
                fixed["output"] += int(t.n_bytes)
            else:
                embd = int(t.n_bytes)
            continue
        fixed[kind] += int(t.n_bytes)
    kv_k, kv_v = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    kv = KVCache.nbytes(a.n_layer, n_ctx, a.n_head_kv, a.head_dim, kv_k, kv_v)
    plan = ResidencyPlan(budget=int(budget_gib * GIB), interpreter=rss_bytes() if interpreter is None else interpreter,
                         fixed=fixed, kv_cache=kv, scratch=SCRATCH_BYTES, embedding=embd, neuron_bytes=nb,
                         parts=parts, n_layer=a.n_layer, n_ff=a.n_ff, counts_source=counts_source)
    if plan.fits and os.environ.get(ROW_READS_ENV) != "always":
        plan.resident = True
        plan.hot = [np.ones(a.n_ff, dtype=bool) for _ in range(a.n_layer)]
        plan.order = [np.arange(a.n_ff) for _ in range(a.n_layer)]
        return plan
    if plan.budget < plan.minimum:
        mb = 1e6
        raise PowerInferError(
            f"--ram-budget {budget_gib:g} GiB is below the {plan.minimum / GIB:.2f} GiB {g.path} needs resident with "
            f"a context of {n_ctx} tokens (interpreter {plan.interpreter / mb:.0f} MB, "
            + ", ".join(f"{k} {v / mb:.0f} MB" for k, v in fixed.items())
            + f", KV cache {kv / mb:.0f} MB, scratch {plan.scratch / mb:.0f} MB, reuse window "
            f"{plan.min_window_bytes / mb:.0f} MB): give at least {plan.minimum / GIB:.2f} GiB"
            + (" or a smaller -c" if kv > 64 << 20 else ""))
    room = plan.budget - plan.minimum  # above the minimum window
    if counts is not None:
        if len(counts) != a.n_layer or any(np.asarray(c).shape != (a.n_ff,) for c in counts):
            raise PowerInferError(f"activation counts: {len(counts)} layers, expected {a.n_layer} of n_ff {a.n_ff}")
        hot_room = int(room * (1 - WINDOW_SHARE))
        placed = place_neurons([np.asarray(c, dtype=np.float64) for c in counts], hot_room, nb, chunk=CHUNK)
        plan.hot = [np.asarray(m, dtype=bool) for m in placed.gpu]
        # record order of the row cache: the layer's hot neurons first, then by count, then by index
        plan.order = [np.lexsort((np.arange(a.n_ff), -np.asarray(c, dtype=np.float64), ~h))
                      for c, h in zip(counts, plan.hot)]
    else:
        plan.hot = [np.zeros(a.n_ff, dtype=bool) for _ in range(a.n_layer)]
        plan.order = [np.arange(a.n_ff) for _ in range(a.n_layer)]
    left = plan.budget - plan.minimum - plan.hot_bytes + plan.min_window_bytes
    plan.window_slots = int(min(a.n_ff, max(MIN_WINDOW_SLOTS, left // (a.n_layer * nb))))
    return plan

"""Mixture-of-experts files larger than RAM (``--ram-budget``): the most routed experts resident, the
others read from the file when the router picks them.

**The plan** (:func:`plan_experts`; the dense counterpart is :mod:`.residency`, whose items and order it
follows). One budget (GiB, everything the process keeps resident counted) is spent in this order:

1. the minimum: the interpreter as it stands before loading, the attention matrices, the routers,
   norms, the output matrix, the KV cache for the whole context, :data:`~.residency.SCRATCH_BYTES`
   (activations, the read staging buffers, thread arenas) and a reuse cache of ``k`` experts (the
   experts one token uses; at least the token embedding's bytes, resident once at load). A budget
   below it is refused before any weight is read, with the minimum in the message;
2. of the rest, :data:`CACHE_SHARE` (none) more goes to the reuse cache (slots of one expert's gate,
   up and down matrices, shared by the layers, the least recently used replaced first) when counts pin
   experts; without counts the cache takes it all;
3. the rest holds the most routed experts, resident for the whole run: per layer, by their share of
   the layer's routings in ``expert_counts.json`` (``pi-profile`` on the file:
   :mod:`powerinfer.formats.expert_counts`; ``--activation`` or ``activation/`` beside the model),
   the experts of all layers in one order, most routed first, while they fit. Without counts no expert
   is pinned and the reuse cache takes everything.

When the whole model fits, the plan says so and the ordinary model runs (``$POWERINFER_ROW_READS=always``
plans the reads anyway: tests on small files).

**Reads** (:class:`ExpertStore`). Expert ``e``'s rows are contiguous in each stacked tensor, so an
expert is three reads (gate, up, down), each of at most :data:`CHUNK_BYTES` pieces, from the GGUF
itself, with ``O_DIRECT`` (page-aligned pieces into a staging buffer per reading thread, the expert's
bytes copied out: nothing enters the page cache, which would otherwise count against the cgroup and
defeat the budget) or, where the file system refuses it, buffered with the pages dropped
(``POSIX_FADV_DONTNEED``) after each read. :data:`IO_THREADS` threads read; ``os.preadv`` lets go of
the GIL. Every expert, resident or read, is in the layout the unlimited run computes on
(:func:`~.moe.load_experts`: block-quantized matrices in 8-row groups, f16/bf16 row-major, f32 as torch
tensors with f32 compute), and the products are the same kernels in the same (ascending expert) order,
so tokens and logits equal the unlimited run's.

**Overlap.** A layer's routed cold experts are all submitted before the first expert is computed
(:meth:`~.moe.ExpertsFFN.routed`); for SmallThinker, whose router reads the layer input, they are
submitted before attention (:meth:`BudgetExpertsFFN.route_early`, called by
:class:`~.smallthinker.SmallThinkerTransformer`), so the reads run while attention does. A prompt
whose layer routes to more cold experts than the cache holds reads them in turns as slots free up.

**Errors.** A file truncated, rewritten or replaced while running, a failed or short read: a
PowerInferError naming the file (and the offset), as :mod:`.cold_rows`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES, QWeight
from . import kernels
from .moe import ExpertsFFN
from .residency import GIB, ROW_READS_ENV, SCRATCH_BYTES, _kind, rss_bytes

log = logging.getLogger(__name__)

IO_THREADS = 8  # expert matrices read at once
CHUNK_BYTES = 1 << 20  # bytes per read (each reading thread's staging buffer is this plus two pages)
PAGE = 4096
KINDS = ("gate", "up", "down")
CACHE_SHARE = 0.0  # of the room above the minimum, this much more reuse cache when counts pin experts (the rest
# pins): the layers are visited in a cycle, so an LRU cache of fewer experts than a token's routings over all
# layers keeps almost nothing for the next token (3.8% hits from 435 MB on the 24-layer SmallThinker file of
# benchmarks/bench_moe_ram.py, where pinning as many more experts by their counts serves ~12% more routings)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MatrixSpec:
    """Where one layer's stacked expert matrix is: ``offset`` (bytes, in the GGUF) of expert 0,
    ``rows``/``cols`` of one expert's matrix, GGML ``kind``, ``expert_bytes`` (``rows`` x row bytes)."""

    name: str
    offset: int
    rows: int
    cols: int
    kind: str
    expert_bytes: int


@dataclass
class ExpertPlan:
    """How a RAM budget is spent on a mixture-of-experts file (bytes unless said otherwise).
    ``hot[l]``: bool ``[n_expert]``, layer ``l``'s resident experts; ``cache_slots``: experts the shared
    reuse cache holds; ``specs[l]``: layer ``l``'s three :class:`MatrixSpec` (gate, up, down)."""

    budget: int
    interpreter: int
    fixed: dict[str, int]
    kv_cache: int
    scratch: int
    embedding: int
    specs: list[tuple[MatrixSpec, MatrixSpec, MatrixSpec]]
    n_expert: int
    n_used: int
    hot: list[np.ndarray] = field(default_factory=list)
    cache_slots: int = 0
    counts_source: str = "none"
    resident: bool = False

    @property
    def n_layer(self) -> int:
        return len(self.specs)

    def expert_bytes(self, layer: int) -> int:
        return sum(s.expert_bytes for s in self.specs[layer])

    @property
    def slot_bytes(self) -> int:
        """Bytes of one reuse-cache slot (the largest expert of any layer)."""
        return max(self.expert_bytes(i) for i in range(self.n_layer))

    @property
    def min_cache_bytes(self) -> int:
        return max(self.n_used * self.slot_bytes, self.embedding)

    @property
    def minimum(self) -> int:
        """The smallest budget this model and context run under."""
        return self.interpreter + sum(self.fixed.values()) + self.kv_cache + self.scratch + self.min_cache_bytes

    @property
    def hot_bytes(self) -> int:
        return sum(int(h.sum()) * self.expert_bytes(i) for i, h in enumerate(self.hot))

    @property
    def n_hot(self) -> int:
        return int(sum(int(h.sum()) for h in self.hot))

    @property
    def cache_bytes(self) -> int:
        return self.cache_slots * self.slot_bytes

    @property
    def experts_bytes(self) -> int:
        return sum(self.expert_bytes(i) * self.n_expert for i in range(self.n_layer))

    @property
    def whole_model(self) -> int:
        return (self.interpreter + sum(self.fixed.values()) + self.embedding + self.experts_bytes + self.kv_cache
                + self.scratch)

    @property
    def resident_total(self) -> int:
        """What the plan keeps resident: the minimum without its cache, the pinned experts and the cache."""
        return (self.interpreter + sum(self.fixed.values()) + self.kv_cache + self.scratch + self.hot_bytes
                + max(self.cache_bytes, self.embedding))

    def summary(self) -> str:
        mb = 1e6
        if self.resident:
            return (f"RAM budget {self.budget / GIB:.2f} GiB: the whole model fits ({self.whole_model / mb:.0f} MB "
                    "resident): every expert stays resident, none is read from disk")
        fixed = ", ".join(f"{k} {v / mb:.0f}" for k, v in self.fixed.items())
        total = self.n_layer * self.n_expert
        return (f"RAM budget {self.budget / GIB:.2f} GiB: interpreter {self.interpreter / mb:.0f} MB, {fixed}, "
                f"KV cache {self.kv_cache / mb:.0f}, scratch {self.scratch / mb:.0f}; resident experts "
                f"{self.n_hot} of {total} ({self.hot_bytes / mb:.0f} MB, counts: {self.counts_source}), reuse cache "
                f"{self.cache_slots} experts ({self.cache_bytes / mb:.0f} MB); the other experts are read from disk "
                "when routed")


def _specs(g: GGUFFile, n_layer: int) -> list[tuple[MatrixSpec, ...]]:
    from .weights import tensor_shape

    out = []
    for i in range(n_layer):
        row = []
        for k in KINDS:
            name = f"blk.{i}.ffn_{k}_exps.weight"
            t = g.tensors[name]
            E, R, C = tensor_shape(g, name)
            kind = t.tensor_type.name
            if kind in MAPPED_TYPES:
                rb = MAPPED_TYPES[kind].row_bytes(C)
            elif kind == "F32":
                rb = 4 * C
            else:
                raise PowerInferError(f"{g.path}: {name} has type {kind}: --ram-budget reads experts of types "
                                      f"{', '.join(MAPPED_TYPES)} and F32 only")
            row.append(MatrixSpec(name, int(t.data_offset), R, C, kind, R * rb))
        out.append(tuple(row))
    return out


def plan_experts(g: GGUFFile, n_ctx: int, kv_dtype, budget_gib: float, n_expert: int, n_used: int,
                 counts: torch.Tensor | None = None, counts_source: str = "none",
                 interpreter: int | None = None) -> ExpertPlan:
    """The plan for running the mixture-of-experts file ``g`` (``n_expert`` experts, ``n_used`` per token)
    with a context of ``n_ctx`` tokens (KV cache in ``kv_dtype``, one dtype or ``(keys, values)``) within
    ``budget_gib`` GiB. ``counts``: int ``[n_layer, n_expert]`` routings (None: no expert pinned);
    ``interpreter``: bytes already resident (default: this process's resident set now). Reads the tensor
    table only. Raises PowerInferError for a budget below the minimum (the message gives it) or counts
    of the wrong shape."""
    from .args import ModelArgs
    from .kv_cache import KVCache

    a = ModelArgs.from_gguf(g)
    specs = _specs(g, a.n_layer)
    fixed = {"attention": 0, "router": 0, "output": 0, "norms+biases": 0}
    embd = 0
    tied = "output.weight" not in g.tensors
    for t in g.reader.tensors:
        if t.name.startswith("blk.") and t.name.endswith("_exps.weight"):
            continue
        kind = "router" if t.name.endswith("ffn_gate_inp.weight") else _kind(t.name)
        if kind is None:
            if tied:
                fixed["output"] += int(t.n_bytes)
            else:
                embd = int(t.n_bytes)
            continue
        fixed[kind] = fixed.get(kind, 0) + int(t.n_bytes)
    kv_k, kv_v = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    kv = KVCache.nbytes(a.n_layer, n_ctx, a.n_head_kv, a.head_dim, kv_k, kv_v)
    plan = ExpertPlan(int(budget_gib * GIB), rss_bytes() if interpreter is None else interpreter, fixed, kv,
                      SCRATCH_BYTES, embd, specs, n_expert, n_used, counts_source=counts_source)
    if plan.budget >= plan.whole_model and os.environ.get(ROW_READS_ENV) != "always":
        plan.resident = True
        plan.hot = [np.ones(n_expert, dtype=bool) for _ in specs]
        return plan
    if plan.budget < plan.minimum:
        mb = 1e6
        raise PowerInferError(
            f"--ram-budget {budget_gib:g} GiB is below the {plan.minimum / GIB:.2f} GiB {g.path} needs resident with "
            f"a context of {n_ctx} tokens (interpreter {plan.interpreter / mb:.0f} MB, "
            + ", ".join(f"{k} {v / mb:.0f} MB" for k, v in fixed.items())
            + f", KV cache {kv / mb:.0f} MB, scratch {plan.scratch / mb:.0f} MB, reuse cache of {n_used} experts "
            f"{plan.min_cache_bytes / mb:.0f} MB): give at least {plan.minimum / GIB:.2f} GiB"
            + (" or a smaller -c" if kv > 64 << 20 else ""))
    room = plan.budget - plan.minimum
    plan.hot = [np.zeros(n_expert, dtype=bool) for _ in specs]
    if counts is not None:
        counts = torch.as_tensor(counts)
        if tuple(counts.shape) != (a.n_layer, n_expert):
            raise PowerInferError(f"expert counts: shape {list(counts.shape)}, expected [{a.n_layer}, {n_expert}]")
        share = counts.double() / counts.sum(1, keepdim=True).clamp_min(1)  # each layer's routings sum to 1
        order = sorted(((-float(share[i, e]), i, e) for i in range(a.n_layer) for e in range(n_expert)
                        if counts[i, e] > 0))
        left = int(room * (1 - CACHE_SHARE))
        for _, i, e in order:
            nb = plan.expert_bytes(i)
            if nb <= left:
                plan.hot[i][e] = True
                left -= nb
    cold = a.n_layer * n_expert - plan.n_hot
    free = plan.budget - (plan.minimum - plan.min_cache_bytes) - plan.hot_bytes
    plan.cache_slots = int(max(n_used, min(cold, free // plan.slot_bytes)))
    return plan


# ---------------------------------------------------------------------------- materialising an expert
def _weight(spec: MatrixSpec, buf: torch.Tensor, dtype: torch.dtype):
    """The object the unlimited run computes expert matrix ``spec`` on, over ``buf`` (uint8, at least
    ``spec.expert_bytes``): a :class:`QWeight` (rows, or ``x8`` when the kernels take it) or, for f32
    with f32 compute, a float32 tensor ``[rows, cols]``. ``buf`` holds the bytes in that layout."""
    raw = buf[:spec.expert_bytes]
    if spec.kind == "F32":
        return raw.view(torch.float32).view(spec.rows, spec.cols)
    w = QWeight(raw.view(spec.rows, spec.expert_bytes // spec.rows), MAPPED_TYPES[spec.kind], spec.rows, spec.cols)
    if w.can_x8() and kernels.backend() == "c":
        return QWeight(w.raw, w.btype, w.n_rows, w.n_cols, layout="x8")
    return w


def check_types(plan: ExpertPlan, dtype: torch.dtype, path) -> None:
    """PowerInferError when an expert matrix would not be computed in its own bytes (the unlimited run
    converts it at load): f32 experts need f32 compute, the others the C kernels."""
    from .weights import _NATIVE

    for row in plan.specs:
        for s in row:
            if s.kind == "F32" and dtype != torch.float32:
                raise PowerInferError(f"{path}: {s.name} is F32: --ram-budget reads f32 experts with --dtype f32 only")
            if s.kind != "F32" and _NATIVE.get(s.kind) == dtype:
                raise PowerInferError(f"{path}: {s.name} is {s.kind}, the compute dtype: --ram-budget reads such "
                                      "experts with another --dtype")


# ---------------------------------------------------------------------------- the store
class ExpertStore:
    """The model's experts under a budget: the pinned ones (read once at load) and the reuse cache
    (``plan.cache_slots`` slots shared by the layers, least recently used replaced first), filled by
    :data:`IO_THREADS` reading threads. Main-thread methods only, except the reads themselves."""

    def __init__(self, g: GGUFFile, plan: ExpertPlan, dtype: torch.dtype):
        from .cold_rows import _File
        from .weights import empty

        self.plan, self.dtype = plan, dtype
        self.file = _File(Path(g.path), direct=True)
        self.executor = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="powerinfer-experts")
        self._local = threading.local()
        self.closed = False
        n = plan.cache_slots
        self.slot_bufs = [[empty((max(r[k].expert_bytes for r in plan.specs),), torch.uint8) for k in range(3)]
                          for _ in range(n)]
        self.slot_of: dict[tuple[int, int], int] = {}
        self.owner: list[tuple[int, int] | None] = [None] * n
        self.last = np.zeros(n, dtype=np.int64)  # use clock of each slot (LRU)
        self.busy = np.zeros(n, dtype=bool)  # submitted for this pass, not yet computed (not evictable)
        self.futures: dict[int, object] = {}
        self.clock = 0
        self.resident: dict[tuple[int, int], tuple] = {}
        self.stats = {"reads": 0, "bytes": 0, "experts_read": 0, "hits_resident": 0, "hits_cache": 0,
                      "routed": 0, "t_wait": 0.0, "tokens": 0}
        self.decode = {"tokens": 0, "bytes": 0, "experts_read": 0, "t_wait": 0.0}  # one-token passes only
        self.one_token = False  # the pass now running is one token (set by layer 0's router)

    # ------------------------------------------------------------ reading
    def _stage(self) -> np.ndarray:
        st = getattr(self._local, "stage", None)
        if st is None:
            raw = np.empty(CHUNK_BYTES + 3 * PAGE, dtype=np.uint8)
            off = -raw.ctypes.data % PAGE
            st = self._local.stage = raw[off:off + CHUNK_BYTES + 2 * PAGE]
        return st

    def _read_into(self, spec: MatrixSpec, e: int, buf: torch.Tensor) -> int:
        """Expert ``e``'s rows of ``spec`` into ``buf`` in the compute layout (in a reading thread);
        returns the reads made. PowerInferError for a failed or short read."""
        from .cold_rows import _read_failed

        f = self.file
        rb = spec.expert_bytes // spec.rows
        x8 = isinstance(w := _weight(spec, buf, self.dtype), QWeight) and w.layout == "x8"
        step = max(8, CHUNK_BYTES // rb // 8 * 8)  # whole 8-row groups per read
        base = spec.offset + e * spec.expert_bytes
        dst = buf.numpy()
        stage = self._stage()
        reads = 0
        for r0 in range(0, spec.rows, step):
            r1 = min(spec.rows, r0 + step)
            off, n = base + r0 * rb, (r1 - r0) * rb
            lo = off // PAGE * PAGE if f.dfd >= 0 else off
            hi = -(-(off + n) // PAGE) * PAGE if f.dfd >= 0 else off + n
            view = stage[:hi - lo]
            try:
                got = os.preadv(f.dfd if f.dfd >= 0 else f.fd, [view], lo)
            except OSError as ex:
                if f.dfd >= 0 and ex.errno == 22:  # EINVAL: the file system refuses O_DIRECT reads
                    log.warning("%s: the file system refused an O_DIRECT read: reading it buffered", f.path)
                    f.drop_direct()
                    return reads + self._read_into(spec, e, buf)
                raise _read_failed(f, lo, hi - lo, 0, ex.strerror or str(ex)) from None
            reads += 1
            if got < off + n - lo:
                raise _read_failed(f, off, n, max(0, got - (off - lo)))
            rows = view[off - lo:off - lo + n]
            if x8:
                q = QWeight(torch.from_numpy(rows.reshape(r1 - r0, rb)), w.btype, r1 - r0, spec.cols)
                q.to_x8(torch.from_numpy(dst[r0 * rb:r1 * rb].reshape(r1 - r0, rb)))
            else:
                dst[r0 * rb:r1 * rb] = rows
            if f.dfd < 0:
                f.drop_cache(lo, hi - lo)
        return reads

    def _read_expert(self, layer: int, e: int, bufs: list[torch.Tensor]) -> tuple[int, int]:
        n = 0
        for spec, buf in zip(self.plan.specs[layer], bufs):
            n += self._read_into(spec, e, buf)
        return n, self.plan.expert_bytes(layer)

    def _objects(self, layer: int, bufs) -> tuple:
        return tuple(_weight(s, b, self.dtype) for s, b in zip(self.plan.specs[layer], bufs))

    def load_resident(self, layer: int) -> None:
        """Read layer ``layer``'s pinned experts into their own memory (at load)."""
        from .weights import empty

        hot = np.flatnonzero(self.plan.hot[layer]).tolist()
        jobs = []
        for e in hot:
            bufs = [empty((s.expert_bytes,), torch.uint8) for s in self.plan.specs[layer]]
            jobs.append((e, bufs, self.executor.submit(self._read_expert, layer, e, bufs)))
        for e, bufs, fut in jobs:
            fut.result()
            self.resident[(layer, e)] = self._objects(layer, bufs)

    # ------------------------------------------------------------ the cache
    def _take_slot(self) -> int | None:
        free = np.flatnonzero(~self.busy)
        if len(free) == 0:
            return None
        s = int(free[np.argmin(self.last[free])])
        old = self.owner[s]
        if old is not None:
            del self.slot_of[old]
            self.owner[s] = None
        return s

    def submit(self, layer: int, experts: list[int]) -> None:
        """Start reading those of ``experts`` that are neither pinned nor cached, while slots are free."""
        for e in experts:
            key = (layer, e)
            if key in self.resident:
                continue
            s = self.slot_of.get(key)
            if s is not None:
                self.busy[s] = True  # cached: kept for this pass
                continue
            s = self._take_slot()
            if s is None:
                return
            self.slot_of[key], self.owner[s], self.busy[s] = s, key, True
            self.futures[s] = self.executor.submit(self._read_expert, layer, e, self.slot_bufs[s])

    def get(self, layer: int, e: int) -> tuple:
        """Expert ``e`` of ``layer``'s ``(gate, up, down)``, waiting for its read (or reading it now)."""
        key = (layer, e)
        st = self.stats
        st["routed"] += 1
        w = self.resident.get(key)
        if w is not None:
            st["hits_resident"] += 1
            return w
        s = self.slot_of.get(key)
        if s is None:
            self.submit(layer, [e])
            s = self.slot_of.get(key)
            if s is None:
                raise PowerInferError(f"--ram-budget: layer {layer} needs expert {e}, every reuse-cache slot is in use")
        fut = self.futures.pop(s, None)
        if fut is None:
            st["hits_cache"] += 1
        else:
            t = time.perf_counter()
            try:
                reads, nb = fut.result()
            except BaseException:
                del self.slot_of[key]
                self.owner[s], self.busy[s] = None, False
                raise
            dt = time.perf_counter() - t
            st["t_wait"] += dt
            st["reads"] += reads
            st["bytes"] += nb
            st["experts_read"] += 1
            if self.one_token:
                d = self.decode
                d["t_wait"] += dt
                d["bytes"] += nb
                d["experts_read"] += 1
        self.clock += 1
        self.last[s] = self.clock
        return self._objects(layer, self.slot_bufs[s])

    def release(self, layer: int, e: int) -> None:
        """Expert ``e`` of ``layer`` is computed: its slot may be replaced."""
        s = self.slot_of.get((layer, e))
        if s is not None and s not in self.futures:
            self.busy[s] = False

    def end_pass(self) -> None:
        """Every slot not still being read may be replaced."""
        for s in np.flatnonzero(self.busy).tolist():
            if s not in self.futures:
                self.busy[s] = False

    def check(self) -> None:
        self.file.check()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.executor.shutdown(wait=True)
        self.file.close()

    def resident_bytes(self) -> int:
        return sum(sum(int(getattr(w, "nbytes", 0)) if isinstance(w, QWeight) else w.numel() * w.element_size()
                       for w in ws) for ws in self.resident.values())

    def cache_nbytes(self) -> int:
        return sum(int(b.numel()) for bufs in self.slot_bufs for b in bufs)


# ---------------------------------------------------------------------------- the FFN
class BudgetExpertsFFN(ExpertsFFN):
    """:class:`~.moe.ExpertsFFN` whose experts come from an :class:`ExpertStore` (``gate``/``up``/``down``
    are empty lists: no expert is held by the layer itself)."""

    def __init__(self, *args, layer: int, store: ExpertStore, expert_bytes: int, **kw):
        super().__init__(*args, **kw)
        self.layer, self.store, self.expert_bytes = layer, store, expert_bytes
        self._early = None  # (router input, routing) of a pre-attention router, set before attention
        self._passing: list[int] = []
        self._started = False  # route_early began this pass
        self._n_tokens = 0  # tokens of the pass now running

    @property
    def batch_shared(self) -> bool:
        return False

    def route_early(self, x: torch.Tensor) -> None:
        """SmallThinker: route the layer input ``x`` ``[T, D]`` now, before attention, and start reading
        the routed cold experts, so the reads run while attention does."""
        r = super().route(x)
        self._early = (x, r)
        self._start(r[1].view(-1).unique().tolist(), x.shape[0])
        self._started = True

    def route(self, xn: torch.Tensor):
        self._n_tokens = xn.shape[0]
        if self._early is not None and self._early[0] is xn:
            r, self._early = self._early[1], None
            return r
        self._early = None
        return super().route(xn)

    def routed(self, experts: list[int]) -> None:
        if self._started:  # already started before attention (route_early)
            self._started = False
            return
        self._start(experts, self._n_tokens)

    def _start(self, experts: list[int], n_tokens: int) -> None:
        if self.layer == 0:
            self.store.stats["tokens"] += 1
            self.store.one_token = n_tokens == 1
            self.store.decode["tokens"] += n_tokens == 1
        self.store.end_pass()
        self._passing = list(experts)
        self.store.submit(self.layer, self._passing)

    def weights(self, e: int) -> tuple:
        p = self._passing
        if p and p[0] != e:  # the experts before e are computed: their slots may take the next ones
            while p and p[0] != e:
                self.store.release(self.layer, p.pop(0))
            self.store.submit(self.layer, p)
        return self.store.get(self.layer, e)

    def decode_bytes(self) -> float:
        from .weights import weight_nbytes

        return weight_nbytes(self.router) + self.expert_bytes * self.ea.n_used


def _builder(g: GGUFFile, a, plan: ExpertPlan, store: ExpertStore, pre_attention: bool):
    """A ``build_ffn`` stand-in building :class:`BudgetExpertsFFN` layers (counts and shapes checked now)."""
    from .moe import expert_args, experts_builder
    from .weights import load_tensor

    experts_builder(g, a, pre_attention=pre_attention)  # every key and shape checked, nothing loaded
    ea = expert_args(g, a)

    def build(g: GGUFFile, i: int, a, dtype: torch.dtype, dense: bool, mapped: bool = False):
        router = load_tensor(g, f"blk.{i}.ffn_gate_inp.weight", dtype)
        store.load_resident(i)
        return BudgetExpertsFFN(a.family, a.activation, router, [], [], [], ea=ea, pre_attention=pre_attention,
                                layer=i, store=store, expert_bytes=plan.expert_bytes(i))

    return build


def load_experts_budgeted(g: GGUFFile, dtype: torch.dtype, n_ctx: int | None, budget_gib: float,
                          activation_dir: str | None = None, interpreter: int | None = None,
                          cache_type_k=None, cache_type_v=None):
    """``(model, plan)``: the mixture-of-experts file ``g`` built within ``budget_gib`` GiB (the ordinary
    model when it fits). Raises PowerInferError for a budget below the minimum, expert types it cannot
    read in their own bytes, the torch backend, or unreadable counts."""
    from .args import ModelArgs
    from .kv_cache import kv_dtypes
    from .model import Transformer, context_length
    from .moe import expert_args
    from .weights import _release

    a = ModelArgs.from_gguf(g)
    ea = expert_args(g, a)
    _, ctx = context_length(g, a, n_ctx)
    counts, source = expert_counts(str(g.path), activation_dir, a.n_layer, ea.n_expert)
    kv = kv_dtypes(cache_type_k, cache_type_v, dtype)
    plan = plan_experts(g, ctx, kv, budget_gib, ea.n_expert, ea.n_used, counts, source, interpreter)
    cls = Transformer
    if g.arch == "smallthinker":
        from .smallthinker import SmallThinkerTransformer as cls
    if plan.resident:
        return cls(g, dtype, n_ctx=n_ctx, cache_type_k=kv[0], cache_type_v=kv[1]), plan
    if kernels.backend() != "c":
        raise PowerInferError("--ram-budget needs the C kernels (--kernels c): the torch backend copies every weight")
    check_types(plan, dtype, g.path)
    store = ExpertStore(g, plan, dtype)
    try:
        model = cls(g, dtype, n_ctx=n_ctx, cache_type_k=kv[0], cache_type_v=kv[1],
                    ffn_builder=_builder(g, a, plan, store, g.arch == "smallthinker"))
        embd = g.tensors.get("token_embd.weight")
        tied = model.output is model.tok_embd

        def before_forward() -> None:
            store.check()
            if embd is not None and not tied:  # rows looked up on demand: their pages do not pile up
                _release(g, embd)

        before_forward()
    except BaseException:
        store.close()
        raise
    store.file.drop_cache(0, store.file.stamp.size)  # what loading read through the page cache
    model.resources.append(store)
    weakref.finalize(model, store.close)
    model.before_forward = before_forward
    model.expert_residency = (plan, store)
    return model, plan


def expert_counts(model_path: str, activation_dir: str | None, n_layer: int, n_expert: int):
    """``(counts [n_layer, n_expert] or None, where from)``: ``activation_dir``, else ``activation/`` beside
    the model."""
    from ..formats.expert_counts import COUNTS_FILE, load_expert_counts

    folder = Path(activation_dir) if activation_dir is not None else Path(model_path).parent / "activation"
    if not folder.is_dir():
        if activation_dir is not None:
            raise PowerInferError(f"--activation {activation_dir}: not a folder")
        return None, "none (no activation folder: the reuse cache keeps recently routed experts)"
    counts = load_expert_counts(folder, n_layer, n_expert)
    if counts is None:
        if activation_dir is not None:
            raise PowerInferError(f"--activation {activation_dir}: no {COUNTS_FILE} (pi-profile MODEL --data TEXT "
                                  f"--out {activation_dir} writes it)")
        return None, f"none ({folder} has no {COUNTS_FILE})"
    return counts, str(folder / COUNTS_FILE)


def expert_budget_lines(model) -> list[str]:
    """``--bench`` lines under ``--ram-budget`` for a mixture-of-experts file; empty otherwise."""
    from .residency import peak_rss_bytes

    r = getattr(model, "expert_residency", None)
    if r is None:
        return []
    plan, store = r
    st, mb = store.stats, 1e6
    n = max(1, st["tokens"])
    routed = max(1, st["routed"])
    d = store.decode
    nd = max(1, d["tokens"])
    return [f"  RAM budget {plan.budget / GIB:.2f} GiB: resident experts {plan.n_hot} of "
            f"{plan.n_layer * plan.n_expert} ({store.resident_bytes() / mb:.0f} MB), reuse cache {plan.cache_slots} "
            f"experts ({store.cache_nbytes() / mb:.0f} MB); process now {rss_bytes() / mb:.0f} MB, peak "
            f"{peak_rss_bytes() / mb:.0f} MB",
            f"  experts read per pass {st['experts_read'] / n:.1f} ({st['bytes'] / n / mb:.1f} MB, "
            f"{st['reads'] / n:.0f} reads); hit rate {(st['hits_resident'] + st['hits_cache']) / routed:.1%} "
            f"(resident {st['hits_resident'] / routed:.1%}, cache {st['hits_cache'] / routed:.1%}); waiting for "
            f"reads {st['t_wait'] / n * 1e3:.0f} ms per pass",
            f"  per decode token: {d['experts_read'] / nd:.1f} experts read ({d['bytes'] / nd / mb:.1f} MB), waiting "
            f"for reads {d['t_wait'] / nd * 1e3:.0f} ms"]

"""GPU offload as PowerInfer spends a VRAM budget (paper section 4; upstream ``llama.cpp``).

**Placement.** One budget (``--vram-budget``, GiB) is spent in this order:

1. layer by layer, from layer 0, as many whole layers' *dense parts* as fit: attention
   (QKV, output projection, biases), both norms, the predictor (``fc1``/``fc2``) and the
   layer's KV cache slice (sized in f16, as the GPU index and upstream size it);
2. once every layer fits, the output norm and output matrix (a tied output, OPT's, is the
   token embedding and stays on the CPU with it, as upstream keeps ``token_embd``);
3. once all of that fits, the hot FFN neurons, by the GPU index (``ensure_gpu_index``:
   built from the activation counts, reused when it matches, rebuilt otherwise).

Bytes are the file's (``ggml_nbytes``), except quantized tensors on a CUDA device, which
are dequantized to f16 there and counted as such; the neuron budget handed to the GPU
index is translated so the index places exactly the neurons that fit.

**Execution, per token and layer.** A layer on the device computes its attention (its
KV cache on the device), its predictor and its hot neurons there; its cold neurons run
at the same time on the CPU in a worker thread, with the C (and quantized) kernels. What
crosses is the layer's normed input (``n_embd`` values), the cold part of the predicted
mask, and the cold partial sum coming back: one synchronisation per layer. CUDA kernels
are launched asynchronously, so the worker's CPU work overlaps them. A layer whose
neurons all sit on the device does no CPU work at all.

**The device is a parameter.** ``device="cpu"`` (or ``$POWERINFER_OFFLOAD_DEVICE=cpu`` for
``pi-run``) runs the "device side" on the CPU with the same code path: weights are shared
(not copied), so tokens and logits equal the all-CPU run whatever the budget (tests).
On CUDA the device side computes in f16.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PowerInferError
from ..quant.qweight import QWeight
from .ffn import FFN
from .kernels import dequant_rows
from .weights import FLOAT_TYPES, weight_nbytes

log = logging.getLogger(__name__)

OFFLOAD_DEVICE_ENV = "POWERINFER_OFFLOAD_DEVICE"  # cpu: the device side runs on the CPU (tests, the README printout)
HISTORY_PASSES = 4096  # forward passes whose timings --bench can report
CUDA_DTYPE = torch.float16  # what the device side computes in on CUDA
KV_ELEM_BYTES = 2  # the KV cache is sized in f16, as the GPU index and upstream size it
VRAM_MARGIN = 256 << 20  # kept free on the GPU for activations and cuBLAS workspaces (upstream's margin)


# ---------------------------------------------------------------------------- weights on a device
def _dense(w: QWeight) -> torch.Tensor:
    """A QWeight as fp32 ``w.shape``."""
    d = dequant_rows(w, 0, w.n_rows) if w.layout == "rows" else w.dequantize()
    return d.T if w.transposed else d


def to_device(w, device: torch.device, dtype: torch.dtype):
    """``w`` (tensor, QWeight, list of them stacked along rows, or None) for the device side.

    On a CPU device it is returned as it is (shared, quantized weights stay quantized), so the
    device side computes exactly what the CPU does; elsewhere it becomes one ``dtype`` tensor there.
    """
    if w is None or device.type == "cpu":
        return w
    if isinstance(w, (list, tuple)):
        return torch.cat([to_device(p, device, dtype) for p in w])
    if isinstance(w, QWeight):
        w = _dense(w)
    return w.to(device, dtype).contiguous()


def _rows(t, ids: torch.Tensor, device: torch.device, dtype: torch.dtype | None):
    """Rows ``ids`` of ``t`` on ``device``: a quantized weight stays quantized on the CPU and is
    dequantized for another device; ``dtype`` None keeps the dtype."""
    if t is None:
        return None
    if isinstance(t, QWeight):
        sel = t.index_select(0, ids)
        if device.type == "cpu":
            return sel
        t, ids = dequant_rows(sel, 0, sel.n_rows), torch.arange(sel.n_rows)
    return t.index_select(0, ids).to(device, dtype or t.dtype).contiguous()


# ---------------------------------------------------------------------------- the split FFN
class HybridFFN:
    """An FFN whose neurons ``gpu_mask`` (bool ``[F]``) live on ``device`` and the rest on the CPU.

    ``dtype``: the device side's compute dtype (None: the FFN's). ``predictor_on_device``: the
    predictor runs where the layer input is (its layer's attention is on the device).
    ``placement`` (a :class:`DevicePlacement`) times both sides and lends its worker thread,
    which computes the cold neurons while the device computes the hot ones; without it the
    two parts run one after the other. ``cpu_dtype``: the CPU side's compute dtype.
    """

    def __init__(self, ffn: FFN, gpu_mask: np.ndarray | torch.Tensor, device: torch.device | str,
                 dtype: torch.dtype | None = None, predictor_on_device: bool = False,
                 placement: "DevicePlacement | None" = None, cpu_dtype: torch.dtype | None = None):
        mask = torch.as_tensor(np.asarray(gpu_mask, dtype=bool))
        if mask.shape != (ffn.up.shape[0],):
            raise ValueError(f"GPU mask has {mask.shape[0]} neurons, the FFN has {ffn.up.shape[0]}")
        self.device = torch.device(device)
        self.gpu_ids = mask.nonzero().view(-1)
        self.cpu_ids = (~mask).nonzero().view(-1)
        self.family, self.act, self.threshold = ffn.family, ffn.act, ffn.threshold
        self.n_ff, self.n_embd = ffn.up.shape
        self.placement = placement
        self.cpu_dtype = cpu_dtype
        self.predictor_on_device = predictor_on_device
        pdev = self.device if predictor_on_device else torch.device("cpu")
        pdt = dtype if predictor_on_device else None
        self.fc1, self.fc2 = _to(ffn.fc1, pdev, pdt), _to(ffn.fc2, pdev, pdt)
        empty = torch.empty(0, self.n_embd)
        # a predictor-only FFN so the full rows are not kept alive
        self._pred = dataclasses.replace(ffn, gate=None, up=empty, down_t=empty, gate_b=None, up_b=None,
                                         down_b=None, fc1=self.fc1, fc2=self.fc2)

        def part(ids: torch.Tensor, dev: torch.device, dt, down_b: torch.Tensor | None) -> FFN | None:
            if ids.numel() == 0:
                return None
            return FFN(ffn.family, ffn.act, _rows(ffn.gate, ids, dev, dt), _rows(ffn.up, ids, dev, dt),
                       _rows(ffn.down_t, ids, dev, dt), _rows(ffn.gate_b, ids, dev, dt),
                       _rows(ffn.up_b, ids, dev, dt), None if down_b is None else down_b.to(dev, dt or down_b.dtype),
                       threshold=ffn.threshold)

        self.cpu = part(self.cpu_ids, torch.device("cpu"), None, ffn.down_b)
        self.gpu = part(self.gpu_ids, self.device, dtype, ffn.down_b if self.cpu is None else None)
        self._ids: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._pending = None  # predicted-active count still on the device (read without a sync per layer)
        self.n_active = self.n_calls = 0
        self.t_ffn = self.t_predict = 0.0

    @property
    def sparse(self) -> bool:
        return self.fc1 is not None

    @property
    def n_active(self) -> int:
        """Neurons computed, summed over calls (as :class:`FFN` counts them)."""
        if self._pending is not None:
            self._n_active += int(self._pending)
            self._pending = None
        return self._n_active

    @n_active.setter
    def n_active(self, v: int) -> None:
        self._n_active, self._pending = v, None

    def nbytes(self) -> tuple[float, float]:
        """Weight bytes ``(device side, CPU side)``; the predictor counts where it runs."""
        rows = [0.0 if p is None else sum(weight_nbytes(getattr(p, k)) for k in
                                          ("gate", "up", "down_t", "gate_b", "up_b", "down_b"))
                for p in (self.gpu, self.cpu)]
        pred = weight_nbytes(self.fc1) + weight_nbytes(self.fc2)
        return (rows[0] + pred, rows[1]) if self.predictor_on_device else (rows[0], rows[1] + pred)

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = 0
        self.t_ffn = self.t_predict = 0.0

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted-active mask ``[T, F]`` on the predictor's device."""
        return self._pred.predict(h.to(self.fc1.device, self.fc1.dtype) if isinstance(self.fc1, torch.Tensor)
                                  else h.to("cpu"))

    def _on(self, which: str, device: torch.device) -> torch.Tensor:
        key = (which, device)
        if key not in self._ids:
            self._ids[key] = (self.cpu_ids if which == "cpu" else self.gpu_ids).to(device)
        return self._ids[key]

    def preact(self, xn: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Gate/up pre-activations ``[T, F]`` of every neuron, gathered from both sides (on the CPU)."""
        T, dt = xn.shape[0], self.cpu_dtype or xn.dtype
        gate = torch.empty(T, self.n_ff, dtype=dt) if self.family.gated else None
        up = torch.empty(T, self.n_ff, dtype=dt)
        for part, ids, dev in ((self.cpu, self.cpu_ids, torch.device("cpu")), (self.gpu, self.gpu_ids, self.device)):
            if part is None:
                continue
            g, u = part.preact(xn.to(dev, part.up.dtype if isinstance(part.up, torch.Tensor) else dt))
            up[:, ids] = u.to("cpu", dt)
            if gate is not None:
                gate[:, ids] = g.to("cpu", dt)
        return gate, up

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as :meth:`FFN.__call__`: ``[T, D]`` output on ``xn``'s device and dtype."""
        t0 = time.perf_counter()
        try:
            return self._forward(h, xn, mask, t0)
        finally:
            self.t_ffn += time.perf_counter() - t0

    def _cold(self, xc: torch.Tensor, mc: torch.Tensor | None, inference: bool) -> torch.Tensor:
        """The CPU side's neurons (in the worker thread when the device has hot ones)."""
        t = time.perf_counter()
        with torch.inference_mode(inference):
            y = self.cpu(xc, xc, mc)  # no predictor of its own: ``mc`` says which neurons, None = all
        if self.placement is not None:
            self.placement.add_cpu(time.perf_counter() - t)
        return y

    def _forward(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None, t0: float) -> torch.Tensor:
        if mask is None and self.sparse:
            mask = self.predict(h)
            self.t_predict += time.perf_counter() - t0
        host = None  # the mask on the CPU, when the CPU needs it (one copy of n_ff bools)
        if mask is not None:
            self.n_calls += xn.shape[0]
            host = mask if mask.device.type == "cpu" or self.cpu is None else mask.cpu()
            if host.device.type == "cpu":
                self.n_active += int(host.sum())
            else:  # every neuron on the device: count there, no synchronisation
                self._pending = host.sum() if self._pending is None else self._pending + host.sum()
        job = cold = hot = None
        if self.cpu is not None:  # the normed input and the cold part of the mask cross to the CPU
            xc = xn if xn.device.type == "cpu" else xn.to("cpu", self.cpu_dtype or torch.float32)
            mc = None if host is None else host.index_select(1, self.cpu_ids)
            pool = None if self.placement is None else self.placement.worker
            if self.gpu is not None and pool is not None:
                job = pool.submit(self._cold, xc, mc, torch.is_inference_mode_enabled())
            else:
                cold = self._cold(xc, mc, torch.is_inference_mode_enabled())
        if self.gpu is not None:  # launched while the worker computes the cold neurons
            up_dt = self.gpu.up.dtype if isinstance(self.gpu.up, torch.Tensor) else xn.dtype
            xg = xn.to(self.device, up_dt)
            gate, up = self.gpu.preact(xg)
            hidden = self.family.combine(self.act, gate, up)
            if mask is not None:  # the device computes its hot rows densely, then keeps the predicted ones
                m = mask.index_select(1, self._on("gpu", mask.device)).to(self.device)
                hidden = hidden * m.to(hidden.dtype)
            hot = self.gpu.down(hidden)
        if self.placement is not None:
            self.placement.device_done()
        if job is not None:
            cold = job.result()  # the one synchronisation of the layer
        out = torch.zeros_like(xn)
        for part in (cold, hot):
            if part is not None:
                out = out + part.to(xn.device, xn.dtype)
        return out


def _to(w, device: torch.device, dtype: torch.dtype | None):
    return w if dtype is None else to_device(w, device, dtype)


def place_ffns(model, gpu_masks: list[np.ndarray], device: torch.device | str) -> float:
    """Replace each layer's FFN by a :class:`HybridFFN`; returns the share of neurons on ``device``.

    Only the FFN rows move (attention stays where it is); :func:`place_model` places whole layers."""
    if len(gpu_masks) != len(model.layers):
        raise ValueError(f"{len(gpu_masks)} GPU masks for {len(model.layers)} layers")
    for layer, m in zip(model.layers, gpu_masks):
        layer.ffn = HybridFFN(layer.ffn, m, device)
    return float(sum(int(np.asarray(m).sum()) for m in gpu_masks)) / sum(np.asarray(m).size for m in gpu_masks)


# ---------------------------------------------------------------------------- the budget
@dataclass
class DensePlan:
    """What a budget places before any FFN neuron, in bytes as the device holds them."""

    layer_bytes: list[int]  # per layer: attention, norms, predictor, its KV cache slice (f16)
    head_bytes: int  # output norm and matrix, and the other non-layer tensors the GPU index counts
    n_layers: int  # layers placed, from layer 0
    head: bool  # the output norm and matrix placed
    ffn_budget: int  # bytes left for FFN neurons (0 unless every dense part is placed)
    neuron_bytes: int  # bytes of one neuron's gate/up/down rows on the device
    file_neuron_bytes: int  # the same in the file (the GPU index's unit)

    @property
    def dense_bytes(self) -> int:
        return sum(self.layer_bytes[:self.n_layers]) + (self.head_bytes if self.head else 0)

    @property
    def n_neurons(self) -> int:
        """FFN neurons that fit in what is left."""
        return self.ffn_budget // self.neuron_bytes if self.neuron_bytes else 0


def plan_dense(g, n_ctx: int, budget: int, cuda: bool) -> DensePlan:
    """Spend ``budget`` bytes on GGUF ``g``'s dense parts for a context of ``n_ctx`` tokens
    (order in the module docstring). ``cuda``: quantized tensors count as f16 (dequantized
    there). Raises PowerInferError for FFN tensors of a type the GPU index cannot place."""
    from ..convert.gpu_index import _FFN_ROWS, ffn_row_type
    from ..convert.placement import neuron_bytes

    arch = g.arch
    n_layer = int(g.require(f"{arch}.block_count"))
    n_embd = int(g.require(f"{arch}.embedding_length"))
    n_head = int(g.require(f"{arch}.attention.head_count"))
    n_head_kv = int(g.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(g.get(f"{arch}.attention.key_length", n_embd // n_head))
    kv = 2 * n_ctx * n_head_kv * head_dim * KV_ELEM_BYTES
    layers, head = [kv] * n_layer, 0
    quant = False
    for t in g.reader.tensors:
        name = t.name
        q = t.tensor_type.name not in FLOAT_TYPES
        quant |= q and name.endswith(_FFN_ROWS)
        if name == "token_embd.weight" or name.endswith(_FFN_ROWS):
            continue
        nb = int(t.n_elements) * 2 if (cuda and q) else int(t.n_bytes)
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if not 0 <= i < n_layer:
                raise PowerInferError(f"{g.path}: tensor {name} names layer {i} of {n_layer}")
            layers[i] += nb
        else:
            head += nb
    gated = "blk.0.ffn_gate.weight" in g.tensors
    file_nb = neuron_bytes(n_embd, ffn_row_type(g), gated)
    dev_nb = neuron_bytes(n_embd, "f16", gated) if (cuda and quant) else file_nb
    left, n = budget, 0
    while n < n_layer and layers[n] <= left:
        left -= layers[n]
        n += 1
    on_head = n == n_layer and head <= left
    left -= head if on_head else 0
    return DensePlan(layers, head, n, on_head, left if on_head else 0, dev_nb, file_nb)


# ---------------------------------------------------------------------------- placing and timing
class DevicePlacement:
    """Where a model's parts run, what they hold, and how long each side was busy.

    Timing: per forward pass, the device side is busy from a device layer's start until its
    hot neurons are launched (measured with CUDA events on a GPU, wall time on the CPU); the
    CPU side is busy in its layers, its cold neurons (worker thread) and the output when it
    is on the CPU. The two overlap, so their shares of decode time may add up to over 100%.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.n_layers = 0
        self.head = False
        self.n_neurons = self.n_gpu_neurons = 0
        self.bytes = {"device": 0.0, "cpu": 0.0}  # weights
        self.kv_bytes = {"device": 0.0, "cpu": 0.0}
        # (tokens, wall s, device busy s, CPU busy s) of the last forward passes: bounded, as a server
        # that offloads runs for days
        self.history: deque[tuple[int, float, float, float]] = deque(maxlen=HISTORY_PASSES)
        self.worker: ThreadPoolExecutor | None = None
        self._cuda = device.type == "cuda"
        self._t0 = self._dev_s = self._cpu_s = 0.0
        self._start = None
        self._done = None
        self._events: list = []

    def start_worker(self) -> None:
        """One CPU worker thread for cold neurons, with this thread's torch thread count."""
        if self.worker is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="powerinfer-cold",
                                             initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin_forward(self) -> None:
        self._t0, self._dev_s, self._cpu_s = time.perf_counter(), 0.0, 0.0

    def segment_start(self, on_device: bool) -> None:
        self._start, self._done = (self._mark(), None) if on_device else (time.perf_counter(), None)

    def device_done(self) -> None:
        """The device side of the current segment is launched (hot neurons included)."""
        if self._done is None:
            self._done = self._mark()

    def segment_end(self, on_device: bool) -> None:
        if not on_device:
            self._cpu_s += time.perf_counter() - self._start
            return
        self.device_done()
        if self._cuda:
            self._events.append((self._start, self._done))
        else:
            self._dev_s += self._done - self._start

    def add_cpu(self, seconds: float) -> None:
        self._cpu_s += seconds

    def end_forward(self, n_tokens: int) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self._dev_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        self.history.append((n_tokens, time.perf_counter() - self._t0, self._dev_s, self._cpu_s))


def _move_norm(n, device: torch.device, dtype: torch.dtype):
    if device.type == "cpu":
        return n
    return dataclasses.replace(n, w=n.w.to(device, dtype), b=None if n.b is None else n.b.to(device, dtype))


def place_model(model, n_layers: int, head: bool, gpu_masks: list[np.ndarray] | None,
                device: torch.device | str, dtype: torch.dtype | None = None) -> DevicePlacement:
    """Put layers ``0..n_layers-1``'s attention, norms, predictor and KV cache on ``device``, the
    output there if ``head``, and each layer's neurons ``gpu_masks[i]`` (bool ``[n_ff]``; None: none)
    beside them; everything else stays on the CPU. ``dtype``: the device side's compute dtype
    (default: f16 on CUDA, the model's on the CPU). Returns the placement, also ``model.placement``.
    Raises ValueError for masks of the wrong count or length."""
    device = torch.device(device)
    dtype = dtype or (model.dtype if device.type == "cpu" else CUDA_DTYPE)
    L = len(model.layers)
    if gpu_masks is not None and len(gpu_masks) != L:
        raise ValueError(f"{len(gpu_masks)} GPU masks for {L} layers")
    if not 0 <= n_layers <= L or (head and n_layers < L):
        raise ValueError(f"cannot place {n_layers} of {L} layers{' and the output' if head else ''}")
    pl = DevicePlacement(device, dtype)
    n_ff = model.args.n_ff
    for i, layer in enumerate(model.layers):
        on = i < n_layers
        m = np.zeros(n_ff, bool) if gpu_masks is None else np.asarray(gpu_masks[i], dtype=bool)
        if on:
            same = layer.ffn_norm is layer.attn_norm
            layer.attn_norm = _move_norm(layer.attn_norm, device, dtype)
            layer.ffn_norm = layer.attn_norm if same else _move_norm(layer.ffn_norm, device, dtype)
            if layer.q_norm is not None:  # Qwen3's per-head Q/K norms
                layer.q_norm, layer.k_norm = (_move_norm(n, device, dtype) for n in (layer.q_norm, layer.k_norm))
            for k in ("wqkv", "bqkv", "wo", "bo"):
                setattr(layer, k, to_device(getattr(layer, k), device, dtype))
            layer.on_device = True
        if on or m.any():
            layer.ffn = HybridFFN(layer.ffn, m, device, dtype, predictor_on_device=on, placement=pl,
                                  cpu_dtype=model.dtype)
        side = "device" if on else "cpu"
        pl.bytes[side] += sum(weight_nbytes(getattr(layer, k)) for k in ("wqkv", "bqkv", "wo", "bo"))
        norms = [layer.attn_norm] + ([] if layer.ffn_norm is layer.attn_norm else [layer.ffn_norm])
        pl.bytes[side] += sum(weight_nbytes(n.w) + weight_nbytes(n.b) for n in norms)
        if isinstance(layer.ffn, HybridFFN):
            d, c = layer.ffn.nbytes()
            pl.bytes["device"] += d
            pl.bytes["cpu"] += c
        else:
            f = layer.ffn
            pl.bytes["cpu"] += sum(weight_nbytes(getattr(f, k)) for k in
                                   ("gate", "up", "down_t", "gate_b", "up_b", "down_b", "fc1", "fc2"))
        pl.n_gpu_neurons += int(m.sum())
    pl.n_neurons = L * n_ff
    model.cache.move_layers(list(range(n_layers)), device, dtype)
    tied = model.output is model.tok_embd
    if head and not tied:
        model.output_norm = _move_norm(model.output_norm, device, dtype)
        model.output = to_device(model.output, device, dtype)
        model.head_on_device = True
    pl.n_layers, pl.head = n_layers, model.head_on_device
    on_out = "device" if model.head_on_device else "cpu"
    pl.bytes[on_out] += weight_nbytes(model.output_norm.w) + weight_nbytes(model.output_norm.b) + (0 if tied else weight_nbytes(model.output))
    pl.bytes["cpu"] += weight_nbytes(model.tok_embd) + weight_nbytes(model.pos_embd)
    kd = model.cache.layer(0)[0] if n_layers else None
    per_layer_kv = 0.0 if kd is None else 2 * weight_nbytes(kd)
    pl.kv_bytes["device"] = per_layer_kv * n_layers
    pl.kv_bytes["cpu"] = weight_nbytes(model.cache.k) + weight_nbytes(model.cache.v)
    if any(isinstance(l.ffn, HybridFFN) and l.ffn.cpu is not None and l.ffn.gpu is not None for l in model.layers):
        pl.start_worker()
    model.placement = pl
    return pl


def _device_for(device: str | None) -> torch.device | None:
    """The offload device: ``device``, else ``$POWERINFER_OFFLOAD_DEVICE``, else CUDA when there is one
    (None: no CUDA). Raises PowerInferError for an unknown or unavailable device."""
    name = device or os.environ.get(OFFLOAD_DEVICE_ENV) or None
    if name is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise PowerInferError(f"offload device {name!r}: expected cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise PowerInferError(f"offload device {name!r}: expected cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PowerInferError(f"offload device {name!r}: this torch sees no CUDA device")
    return dev


def offload(model, model_path, vram_budget_gib: float, activation_dir=None, reset: bool = False,
            device: str | None = None, g=None) -> str | None:
    """``pi-run --vram-budget``: place the model's dense parts, then its hot neurons, on the device.

    Returns a summary line, or None (after a logged warning) when there is no CUDA device and
    no ``device``/``$POWERINFER_OFFLOAD_DEVICE``: everything then runs on the CPU. A budget above
    the GPU's free memory (less a 256 MiB margin) is clamped with a warning. Without an
    activation folder the dense parts are still placed and the FFNs stay on the CPU (warned).
    Raises PowerInferError for a negative or non-finite budget or an unknown device.
    """
    from ..convert.gpu_index import GIB, dense_vram_bytes, ensure_gpu_index
    from ..formats.gguf_file import open_gguf

    if not math.isfinite(vram_budget_gib) or vram_budget_gib < 0:
        raise PowerInferError(f"--vram-budget {vram_budget_gib}: must be a finite number >= 0 GiB")
    dev = _device_for(device)
    if dev is None:
        log.warning("no CUDA device: --vram-budget ignored, every neuron runs on the CPU")
        return None
    if dev.type == "cuda":
        free = max(0, torch.cuda.mem_get_info(dev)[0] - VRAM_MARGIN) / GIB
        if vram_budget_gib > free:
            log.warning("--vram-budget %.2f GiB is more than the %.2f GiB free on %s (less a 256 MiB margin): "
                        "using %.2f GiB", vram_budget_gib, free, dev, free)
            vram_budget_gib = free
    g = g if g is not None else open_gguf(model_path)  # ``g``: the file the model was loaded from, opened once
    budget = int(vram_budget_gib * GIB)
    plan = plan_dense(g, model.n_ctx, budget, cuda=dev.type == "cuda")
    masks, index = None, "no FFN neurons: the dense parts took the budget"
    if plan.n_neurons > 0:
        # the index's unit is the file's neuron bytes: hand it the budget that holds exactly n_neurons
        cap = min(plan.n_neurons, model.args.n_layer * model.args.n_ff)
        if plan.neuron_bytes == plan.file_neuron_bytes and plan.dense_bytes == dense_vram_bytes(g, model.n_ctx):
            index_budget = vram_budget_gib  # the same numbers: an index pi-convert built is reused
        else:
            index_budget = (dense_vram_bytes(g, model.n_ctx) + cap * plan.file_neuron_bytes
                            + plan.file_neuron_bytes // 2) / GIB
        gp = ensure_gpu_index(model_path, index_budget, activation_dir, n_ctx=model.n_ctx, reset=reset, g=g)
        if gp is not None:
            masks = gp.gpu
            index = f"GPU index {'reused' if gp.reused else 'built'} ({gp.path})"
        else:
            index = "no GPU index: the FFNs stay on the CPU"
    pl = place_model(model, plan.n_layers, plan.head, masks, dev)
    share = pl.n_gpu_neurons / max(1, pl.n_neurons)
    L = len(model.layers)
    return (f"offload to {dev}: attention, norms, predictors and KV cache of {plan.n_layers}/{L} layers"
            f"{', the output' if pl.head else ''}, {share:.1%} of FFN neurons; {index}; "
            f"{(pl.bytes['device'] + pl.kv_bytes['device']) / 1e6:.1f} MB on {dev}, "
            f"{(pl.bytes['cpu'] + pl.kv_bytes['cpu']) / 1e6:.1f} MB on the CPU")


# ---------------------------------------------------------------------------- --bench
def placement_lines(model, n_decode: int) -> list[str]:
    """``--bench`` lines: per device the MB placed (weights, KV cache) and its busy share of the
    last ``n_decode`` forward passes (the decode steps). Empty when nothing was offloaded."""
    pl = getattr(model, "placement", None)
    if pl is None:
        return []
    L = len(model.layers)
    dev = f"device side ({pl.device}{', forced onto the CPU' if pl.device.type == 'cpu' else ''})"
    share = pl.n_gpu_neurons / max(1, pl.n_neurons)
    lines = [f"  placement: {dev}: {(pl.bytes['device'] + pl.kv_bytes['device']) / 1e6:.1f} MB "
             f"(weights {pl.bytes['device'] / 1e6:.1f} MB, KV cache {pl.kv_bytes['device'] / 1e6:.1f} MB): "
             f"attention, norms, predictors of {pl.n_layers}/{L} layers{', output' if pl.head else ''}, "
             f"{100 * share:.1f}% of FFN neurons",
             f"             CPU side: {(pl.bytes['cpu'] + pl.kv_bytes['cpu']) / 1e6:.1f} MB "
             f"(weights {pl.bytes['cpu'] / 1e6:.1f} MB, KV cache {pl.kv_bytes['cpu'] / 1e6:.1f} MB): "
             f"token embedding, {L - pl.n_layers}/{L} layers' dense parts"
             f"{'' if pl.head else ', output'}, {100 * (1 - share):.1f}% of FFN neurons"]
    steps = [r for r in pl.history if r[0] == 1][-n_decode:] if n_decode > 0 else []
    wall = sum(r[1] for r in steps)
    if wall > 0:
        lines.append(f"  busy share of decode time: device side {100 * sum(r[2] for r in steps) / wall:.1f}%, "
                     f"CPU side {100 * sum(r[3] for r in steps) / wall:.1f}% (they overlap)")
    return lines

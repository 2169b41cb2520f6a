"""Hybrid GPU/CPU FFNs: hot neurons on the GPU, cold ones on the CPU (PowerInfer section 4).

A layer's neurons are split by its GPU index mask. The hot rows of gate, up and
``down_t`` are moved to the GPU device, the cold rows stay on the CPU; the
predictor runs once on the CPU, its mask is split the same way, each side
computes its own predicted-active neurons where their rows live, and the two
partial outputs are summed. Both parts compute exactly the neurons the
unsplit FFN would, so the output equals the unsplit one within fp error
whatever the split (upstream produced garbage with a partly offloaded FFN).

The GPU side is only a ``device`` argument: tests run it with both sides on the
CPU. Attention, norms and the KV cache stay on the CPU in this runtime; the GPU
index is still sized the way upstream PowerInfer places dense tensors first, so
the same index file serves both engines.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from ..quant.qweight import QWeight
from .ffn import FFN
from .kernels import dequant_rows

log = logging.getLogger(__name__)


def _rows(t, ids: torch.Tensor, device: torch.device | str):
    """Rows ``ids`` of ``t`` on ``device``: a quantized weight stays quantized on the CPU and
    is dequantized (fp32) for another device."""
    if t is None:
        return None
    if isinstance(t, QWeight):
        sel = t.index_select(0, ids)
        return sel if torch.device(device).type == "cpu" else dequant_rows(sel, 0, sel.n_rows).to(device)
    return t.index_select(0, ids).to(device).contiguous()


class HybridFFN:
    """An FFN whose neurons ``gpu_mask`` (bool ``[F]``) live on ``device`` and the rest on the CPU."""

    def __init__(self, ffn: FFN, gpu_mask: np.ndarray | torch.Tensor, device: torch.device | str):
        mask = torch.as_tensor(np.asarray(gpu_mask, dtype=bool))
        if mask.shape != (ffn.up.shape[0],):
            raise ValueError(f"GPU mask has {mask.shape[0]} neurons, the FFN has {ffn.up.shape[0]}")
        self.device = torch.device(device)
        self.gpu_ids = mask.nonzero().view(-1)
        self.cpu_ids = (~mask).nonzero().view(-1)
        self.family, self.act, self.threshold = ffn.family, ffn.act, ffn.threshold
        self.n_ff, self.n_embd = ffn.up.shape
        self.fc1, self.fc2 = ffn.fc1, ffn.fc2
        empty = torch.empty(0, self.n_embd, dtype=ffn.up.dtype)
        # a predictor-only FFN so the full rows are not kept alive
        self._pred = dataclasses.replace(ffn, gate=None, up=empty, down_t=empty, gate_b=None, up_b=None, down_b=None)

        def part(ids: torch.Tensor, dev: torch.device | str, down_b: torch.Tensor | None) -> FFN | None:
            if ids.numel() == 0:
                return None
            return FFN(ffn.family, ffn.act, _rows(ffn.gate, ids, dev), _rows(ffn.up, ids, dev),
                       _rows(ffn.down_t, ids, dev), _rows(ffn.gate_b, ids, dev), _rows(ffn.up_b, ids, dev),
                       None if down_b is None else down_b.to(dev), threshold=ffn.threshold)

        self.cpu = part(self.cpu_ids, "cpu", ffn.down_b)
        self.gpu = part(self.gpu_ids, self.device, ffn.down_b if self.cpu is None else None)
        self.n_active = self.n_calls = 0
        self.t_ffn = self.t_predict = 0.0

    @property
    def sparse(self) -> bool:
        return self.fc1 is not None

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = 0
        self.t_ffn = self.t_predict = 0.0

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        return self._pred.predict(h)

    def preact(self, xn: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Gate/up pre-activations ``[T, F]`` of every neuron, gathered from both sides (on the CPU)."""
        T = xn.shape[0]
        gate = torch.empty(T, self.n_ff, dtype=xn.dtype) if self.family.gated else None
        up = torch.empty(T, self.n_ff, dtype=xn.dtype)
        for part, ids in ((self.cpu, self.cpu_ids), (self.gpu, self.gpu_ids)):
            if part is None:
                continue
            g, u = part.preact(xn.to(part.up.device))
            up[:, ids] = u.to("cpu", xn.dtype)
            if gate is not None:
                gate[:, ids] = g.to("cpu", xn.dtype)
        return gate, up

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as :meth:`FFN.__call__`: ``[T, D]`` output on the CPU."""
        t0 = time.perf_counter()
        try:
            return self._forward(h, xn, mask, t0)
        finally:
            self.t_ffn += time.perf_counter() - t0

    def _forward(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None, t0: float) -> torch.Tensor:
        if mask is None and self.sparse:
            mask = self.predict(h)
            self.t_predict += time.perf_counter() - t0
        if mask is not None:
            self.n_calls += xn.shape[0]
            self.n_active += int(mask.sum())
        out = torch.zeros_like(xn)
        if self.cpu is not None:
            m = None if mask is None else mask.index_select(1, self.cpu_ids)
            out = out + self.cpu(h, xn, m)
        if self.gpu is not None:
            xg = xn.to(self.device)
            gate, up = self.gpu.preact(xg)
            hidden = self.family.combine(self.act, gate, up)
            if mask is not None:  # the GPU computes its hot rows densely, then keeps the predicted ones
                hidden = hidden * mask.index_select(1, self.gpu_ids).to(self.device, hidden.dtype)
            out = out + self.gpu.down(hidden).to("cpu", xn.dtype)
        return out


def place_ffns(model, gpu_masks: list[np.ndarray], device: torch.device | str) -> float:
    """Replace each layer's FFN by a :class:`HybridFFN`; returns the share of neurons on ``device``."""
    if len(gpu_masks) != len(model.layers):
        raise ValueError(f"{len(gpu_masks)} GPU masks for {len(model.layers)} layers")
    for layer, m in zip(model.layers, gpu_masks):
        layer.ffn = HybridFFN(layer.ffn, m, device)
    return float(sum(int(np.asarray(m).sum()) for m in gpu_masks)) / sum(np.asarray(m).size for m in gpu_masks)


def offload(model, model_path, vram_budget_gib: float, activation_dir=None, reset: bool = False,
            device: str | None = None) -> str | None:
    """``pi-run --vram-budget``: build or reuse the GPU index and split every FFN.

    Returns a summary line, or None (after a logged warning) when nothing was placed.

    Without CUDA (and no explicit ``device``) it warns and leaves the model on the CPU. A
    budget above the device's free memory is clamped with a warning. Raises
    PowerInferError for a negative budget or one that cannot hold the dense tensors.
    """
    from ..convert.gpu_index import GIB, ensure_gpu_index
    from ..errors import PowerInferError

    if vram_budget_gib < 0:
        raise PowerInferError(f"--vram-budget {vram_budget_gib}: must be >= 0 GiB")
    if device is None:
        if not torch.cuda.is_available():
            log.warning("no CUDA device: --vram-budget ignored, every neuron runs on the CPU")
            return None
        device = "cuda"
        free = torch.cuda.mem_get_info()[0] / GIB
        if vram_budget_gib > free:
            log.warning("--vram-budget %.2f GiB is more than the %.2f GiB free on the GPU: using %.2f GiB",
                        vram_budget_gib, free, free)
            vram_budget_gib = free
    plan = ensure_gpu_index(model_path, vram_budget_gib, activation_dir, n_ctx=model.n_ctx, reset=reset)
    if plan is None:  # ensure_gpu_index warned
        return None
    share = place_ffns(model, plan.gpu, device)
    how = "reused" if plan.reused else "built"
    return f"GPU index {how} ({plan.path}): {share:.1%} of FFN neurons on {device}; {plan.summary}"

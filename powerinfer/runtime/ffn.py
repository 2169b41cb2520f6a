"""Dense and sparse FFNs.

A sparse FFN (PowerInfer, SOSP'24, section 5) first runs the layer's predictor
``fc2(relu(fc1 h))`` on the residual ``h`` and computes only the neurons whose
logit is at least ``sparse_threshold``. For one token (decoding) it reads only
those neurons' rows: the gate and up rows are dotted with the input straight
from the weight matrices (:func:`kernels.rows_dot`), the activation is applied
to the ``k`` results, and the matching rows of ``down_t`` are added up weighted
by them (:func:`kernels.rows_axpy`: one AXPY per neuron). No per-token Python
work depends on ``n_ff``. Neurons the predictor misses are skipped even if they would fire;
neurons it wrongly marks contribute exactly zero after the ReLU. For several
tokens at once (the prompt) each token runs its own active rows as decoding does when the
predicted-active share is at most :data:`ROWS_MAX_SHARE`; above it the per-token masks
are applied to a dense computation (every row read once for all tokens), which gives the
same numbers.

Shapes: ``h``, ``xn``: ``[T, D]``; ``gate``/``up``/``down_t``: ``[F, D]``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property

import torch

from ..families import Activation, Family
from ..quant.qweight import QWeight
from . import kernels
from .kernels import linear


# A prompt whose predicted-active share is at most this runs each token's active rows (the
# decode kernels, memory-bound on ~share of the bytes) instead of every row for all tokens
# at once (compute-bound). Measured on a 7B-shaped layer (n_embd 4096, n_ff 11008), 64
# tokens, 13% predicted active, 1 thread, AVX2: Q4_0 167 ms against 316 ms, f16 335 against 600.
ROWS_MAX_SHARE = 0.3


def gate_min(act: Activation, gate_bias: bool) -> float | None:
    """Gate value at or below which a gated neuron's output is exactly 0 whatever its up product
    (ReLU: 0; FATReLU: just below its threshold); None for dense activations or when a bias is
    added to the gate after the product (the kernels then read every up row)."""
    if gate_bias:
        return None
    if act.kind == "relu":
        return 0.0
    if act.kind == "fatrelu":
        return math.nextafter(float(act.threshold), -math.inf)
    return None


@dataclass
class FFN:
    family: Family
    act: Activation
    gate: torch.Tensor | None  # [F, D] or None (Falcon/OPT)
    up: torch.Tensor  # [F, D]
    down_t: torch.Tensor  # [F, D]: row j is neuron j's output vector (a transposed view for dense files)
    gate_b: torch.Tensor | None = None  # [F] biases (OPT); None for bias-free families
    up_b: torch.Tensor | None = None  # [F]
    down_b: torch.Tensor | None = None  # [D]
    fc1: torch.Tensor | None = None  # [H, D] predictor, None when dense
    fc2: torch.Tensor | None = None  # [F, H]
    threshold: float = 0.0
    rows_max_share: float = ROWS_MAX_SHARE  # prompts at most this active run per-token rows (0: never)
    n_active: int = 0  # neurons computed, summed over calls (sparse only)
    n_calls: int = 0  # tokens seen
    n_fired: int = 0  # neurons whose activation was non-zero, summed over calls (sparse, count_fired only)
    count_fired: bool = False  # count n_fired (a --bench figure; a sync-free count_nonzero per call)
    t_ffn: float = 0.0  # seconds spent in this FFN (predictor included), summed over calls
    t_predict: float = 0.0  # seconds spent in the predictor

    @property
    def sparse(self) -> bool:
        return self.fc1 is not None

    @cached_property
    def gate_min(self) -> float | None:
        """Gate value at or below which a gated neuron's output is exactly 0 whatever its up
        product (ReLU: 0; FATReLU: just below its threshold); None for dense activations
        or when biases are added after the product."""
        return gate_min(self.act, self.gate_b is not None)

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = self.n_fired = 0
        self.t_ffn = self.t_predict = 0.0

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted-active mask ``[T, F]`` (bool) from the residual ``h`` ``[T, D]``."""
        return kernels.predict(h, self.fc1, self.fc2, self.threshold)

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FFN output ``[T, D]`` for normed input ``xn``; ``mask`` overrides the predictor."""
        t0 = time.perf_counter()
        try:
            return self._forward(h, xn, mask, t0)
        finally:
            self.t_ffn += time.perf_counter() - t0

    def fused(self) -> "kernels.SparseFFNCall | None":
        """The one-call C path for a decode step of this FFN, or None when its weights need the
        Python path (rebuilt when a weight, bias, the activation, the FFN kind, the threshold or
        the kernel backend is replaced)."""
        key = (id(self.fc1), id(self.fc2), id(self.gate), id(self.up), id(self.down_t), id(self.gate_b),
               id(self.up_b), id(self.down_b), self.act, self.family.ffn, self.threshold, kernels.backend())
        if getattr(self, "_fused_key", None) != key:
            biases = any(b is not None for b in (self.gate_b, self.up_b, self.down_b))
            self._fused_call = None if not self.sparse else kernels.SparseFFNCall.make(
                self.family.ffn, self.act.kind, self.act.threshold or 0.0, self.gate_min, self.threshold,
                self.fc1, self.fc2, self.gate, self.up, self.down_t, biases)
            self._fused_key = key
        return self._fused_call

    def _forward(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None, t0: float) -> torch.Tensor:
        if not self.sparse and mask is None:
            return self.dense(xn)
        if mask is None and xn.shape[0] == 1 and (call := self.fused()) is not None:  # decode: one C call
            out, k, fired, t_pred = call(h[0], xn[0])
            self.n_calls += 1
            self.n_active += k
            self.t_predict += t_pred
            if self.count_fired:
                self.n_fired += fired
            return out.to(xn.dtype)[None]
        if mask is None:
            mask = self.predict(h)
            self.t_predict += time.perf_counter() - t0
        T = xn.shape[0]
        self.n_calls += T
        if T == 1:
            idx = mask.view(-1).nonzero().view(-1)  # [k]
            self.n_active += idx.numel()
            return self.rows(xn[0], idx)[None]
        n_active = int(mask.sum())
        self.n_active += n_active
        if n_active <= self.rows_max_share * mask.numel():  # a sparse prompt: each token's rows, as decoding reads them
            return torch.stack([self.rows(xn[t], mask[t].nonzero().view(-1)) for t in range(T)])
        gate, up = self.preact(xn)
        hidden = self.family.combine(self.act, gate, up) * mask.to(xn.dtype)
        if self.count_fired:
            self.n_fired += int(torch.count_nonzero(hidden))
        return self.down(hidden)

    def preact(self, xn: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Gate and up pre-activations ``[T, F]`` of every neuron (gate None without a gate)."""
        gate = linear(xn, self.gate, self.gate_b) if self.gate is not None else None
        return gate, linear(xn, self.up, self.up_b)

    def down(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ down_t`` (+ bias): ``[T, F] -> [T, D]``."""
        if self.down_t.T.is_contiguous():  # dense file: down_t is a view of ffn_down [D, F]
            out = linear(hidden, self.down_t.T)
        elif isinstance(self.down_t, QWeight):  # a quantized PWRI file run with --dense or a prompt
            out = kernels.matmul(hidden, self.down_t).to(hidden.dtype)
        else:  # a PWRI file run with --dense: [F, D] rows
            out = hidden @ self.down_t
        return out if self.down_b is None else out + self.down_b

    def dense(self, xn: torch.Tensor) -> torch.Tensor:
        gate, up = self.preact(xn)
        return self.down(self.family.combine(self.act, gate, up))

    def rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Only neurons ``idx`` (LongTensor ``[k]``) for one token ``x`` ``[D]`` -> ``[D]``."""
        if self.gate is not None:
            gate, up = kernels.rows_dot(x, idx, self.gate, self.up, self.gate_min)  # fp32 [k] each
        else:
            gate, up = None, kernels.rows_dot(x, idx, self.up)[0]
        return finish_rows(self, idx, gate, up, self.down_t, idx, x.dtype)


def finish_rows(f, idx: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down_t, down_idx: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The rest of one token's sparse FFN once its ``k`` gate/up products are known (fp32 ``[k]``,
    neurons ``idx``): biases, the family's activation rule, the fired count, and the down rows
    ``down_idx`` of ``down_t`` summed with those weights -> ``[D]`` in ``dtype``. ``f``: the
    :class:`FFN` (or the RAM-budget FFN, whose rows sit at other indices) holding the biases,
    family, activation and counters."""
    if f.gate_b is not None:
        gate = gate + f.gate_b[idx]
    if f.up_b is not None:
        up = up + f.up_b[idx]
    hidden = f.family.combine(f.act, gate, up)  # [k]
    if f.count_fired:
        f.n_fired += int(torch.count_nonzero(hidden))
    out = kernels.rows_axpy(down_idx, down_t, hidden).to(dtype)
    return out if f.down_b is None else out + f.down_b

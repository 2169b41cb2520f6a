"""Dense and sparse FFNs.

A sparse FFN (PowerInfer, SOSP'24, section 5) first runs the layer's predictor
``fc2(relu(fc1 h))`` on the residual ``h`` and computes only the neurons whose
logit is at least ``sparse_threshold``: it gathers those rows of gate/up, applies
the activation, and adds the matching rows of ``down_t`` (one AXPY per neuron,
done here with ``embedding_bag``). Neurons the predictor misses are skipped even
if they would fire; neurons it wrongly marks contribute exactly zero after the
ReLU. For several tokens at once (the prompt) the per-token masks are applied
to a dense computation, which gives the same numbers.

Shapes: ``h``, ``xn``: ``[T, D]``; ``gate``/``up``/``down_t``: ``[F, D]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import PowerInferError
from ..families import Activation, Family
from .args import ModelArgs


@dataclass
class FFN:
    family: Family
    act: Activation
    gate: torch.Tensor | None  # [F, D] or None (Falcon/OPT)
    up: torch.Tensor  # [F, D]
    down_t: torch.Tensor  # [F, D]: row j is neuron j's output vector
    fc1: torch.Tensor | None = None  # [H, D] predictor, None when dense
    fc2: torch.Tensor | None = None  # [F, H]
    threshold: float = 0.0
    n_active: int = 0  # neurons computed, summed over calls (sparse only)
    n_calls: int = 0  # tokens seen

    @property
    def sparse(self) -> bool:
        return self.fc1 is not None

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted-active mask ``[T, F]`` (bool) from the residual ``h`` ``[T, D]``."""
        return (torch.relu(h @ self.fc1.T) @ self.fc2.T) >= self.threshold

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FFN output ``[T, D]`` for normed input ``xn``; ``mask`` overrides the predictor."""
        if not self.sparse and mask is None:
            return self.dense(xn)
        if mask is None:
            mask = self.predict(h)
        T = xn.shape[0]
        self.n_calls += T
        if T == 1:
            idx = mask[0].nonzero().squeeze(1)
            self.n_active += idx.numel()
            return self.rows(xn[0], idx).unsqueeze(0)
        self.n_active += int(mask.sum())
        gate = xn @ self.gate.T if self.gate is not None else None
        hidden = self.family.combine(self.act, gate, xn @ self.up.T) * mask.to(xn.dtype)
        return hidden @ self.down_t

    def dense(self, xn: torch.Tensor) -> torch.Tensor:
        gate = xn @ self.gate.T if self.gate is not None else None
        return self.family.combine(self.act, gate, xn @ self.up.T) @ self.down_t

    def rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Only neurons ``idx`` (LongTensor ``[k]``) for one token ``x`` ``[D]`` -> ``[D]``."""
        gate = F.embedding(idx, self.gate) @ x if self.gate is not None else None
        hidden = self.family.combine(self.act, gate, F.embedding(idx, self.up) @ x)  # [k]
        return F.embedding_bag(idx.unsqueeze(0), self.down_t, per_sample_weights=hidden.unsqueeze(0),
                               mode="sum")[0]


def build_ffn(g, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool,
              load: Callable[..., torch.Tensor]) -> FFN:
    """Layer ``i``'s FFN from GGUF ``g``: PWRI files give ``ffn_down_t`` and the predictor."""
    p = f"blk.{i}."
    gate = load(g, p + "ffn_gate.weight", dtype) if a.family.gated else None
    up = load(g, p + "ffn_up.weight", dtype)
    if a.sparse:
        down_t = load(g, p + "ffn_down_t.weight", dtype)
    else:
        down_t = load(g, p + "ffn_down.weight", dtype).T  # [F, D] view of [D, F]
    ffn = FFN(a.family, a.activation, gate, up, down_t, threshold=a.sparse_threshold)
    for w, name in ((gate, "ffn_gate"), (up, "ffn_up"), (down_t, "ffn_down_t")):
        if w is not None and tuple(w.shape) != (a.n_ff, a.n_embd):
            raise PowerInferError(f"{g.path}: blk.{i}.{name} has shape {tuple(w.shape)}, "
                                  f"expected [n_ff={a.n_ff}, n_embd={a.n_embd}]")
    if a.sparse and not dense:
        ffn.fc1 = load(g, p + "fc1.weight", dtype)
        ffn.fc2 = load(g, p + "fc2.weight", dtype)
        if ffn.fc1.shape[1] != a.n_embd or ffn.fc2.shape != (a.n_ff, ffn.fc1.shape[0]):
            raise PowerInferError(f"{g.path}: blk.{i} predictor shapes {tuple(ffn.fc1.shape)}, "
                                  f"{tuple(ffn.fc2.shape)} do not match the model")
    return ffn

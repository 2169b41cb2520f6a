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
import torch
import torch.nn.functional as F

from ..families import Activation, Family


@dataclass
class FFN:
    family: Family
    act: Activation
    gate: torch.Tensor | None  # [F, D] or None (Falcon/OPT)
    up: torch.Tensor  # [F, D]
    down_t: torch.Tensor  # [F, D]: row j is neuron j's output vector
    gate_b: torch.Tensor | None = None  # [F] biases (OPT); None for bias-free families
    up_b: torch.Tensor | None = None  # [F]
    down_b: torch.Tensor | None = None  # [D]
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
        gate, up = self.preact(xn)
        return self.down(self.family.combine(self.act, gate, up) * mask.to(xn.dtype))

    def preact(self, xn: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Gate and up pre-activations ``[T, F]`` of every neuron (gate None without a gate)."""
        gate = xn @ self.gate.T if self.gate is not None else None
        if self.gate_b is not None:
            gate = gate + self.gate_b
        up = xn @ self.up.T
        return gate, up if self.up_b is None else up + self.up_b

    def down(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.down_t
        return out if self.down_b is None else out + self.down_b

    def dense(self, xn: torch.Tensor) -> torch.Tensor:
        gate, up = self.preact(xn)
        return self.down(self.family.combine(self.act, gate, up))

    def rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Only neurons ``idx`` (LongTensor ``[k]``) for one token ``x`` ``[D]`` -> ``[D]``."""
        gate = F.embedding(idx, self.gate) @ x if self.gate is not None else None
        up = F.embedding(idx, self.up) @ x
        if self.gate_b is not None:
            gate = gate + self.gate_b[idx]
        if self.up_b is not None:
            up = up + self.up_b[idx]
        hidden = self.family.combine(self.act, gate, up)  # [k]
        out = F.embedding_bag(idx.unsqueeze(0), self.down_t, per_sample_weights=hidden.unsqueeze(0), mode="sum")[0]
        return out if self.down_b is None else out + self.down_b

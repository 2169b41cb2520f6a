"""ProSparse-Llama 2 (``SparseLlamaForCausalLM``, ``model_type: sparsellama``) without remote code.

The published ProSparse checkpoints ship their own modeling file; the architecture is
Llama 2 with the FFN activation FATReLU, ``fatrelu_t(v) = v if v >= t else 0`` with
``t = hidden_act_param`` (ProSparse, Song et al. 2024, "activation threshold
shifting"). These classes are transformers' Llama modules with that one change, so the
checkpoints load with ``trust_remote_code=False``.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class FATReLU(torch.nn.Module):
    """``v`` where ``v >= threshold``, else 0 (same shape and dtype as ``v``)."""

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = float(threshold)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v * (v >= self.threshold).to(v.dtype)

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}"


class SparseLlamaConfig(LlamaConfig):
    """LlamaConfig with ``hidden_act: fatrelu`` and the threshold ``hidden_act_param`` (float)."""

    model_type = "sparsellama"
    hidden_act: str = "fatrelu"
    hidden_act_param: float = 0.0


class SparseLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose MLPs apply FATReLU to the gate projection."""

    config_class = SparseLlamaConfig

    def __init__(self, config: SparseLlamaConfig):
        act = config.hidden_act
        config.hidden_act = "relu"  # LlamaMLP looks its activation up by name; FATReLU is set below
        try:
            super().__init__(config)
        finally:
            config.hidden_act = act
        if act == "fatrelu":
            for layer in self.model.layers:
                layer.mlp.act_fn = FATReLU(config.hidden_act_param)

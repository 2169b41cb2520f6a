"""Bamboo-7B (``BambooForCausalLM``, ``model_type: bamboo``) without remote code.

Bamboo (PowerInfer team, 2024) is Mistral-7B continued-trained with dReLU: both FFN
branches go through ReLU, ``down(relu(gate x) * relu(up x))``. Everything else --
GQA attention, RoPE, RMSNorm, the ``sliding_window`` attention mask -- is Mistral's,
so these classes are transformers' Mistral modules with the MLP's forward changed.
"""
from __future__ import annotations

import torch
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral.modeling_mistral import MistralMLP


class BambooConfig(MistralConfig):
    """MistralConfig for dReLU models (``hidden_act`` relu)."""

    model_type = "bamboo"
    hidden_act: str = "relu"


class BambooMLP(MistralMLP):
    """dReLU FFN: ``down(act(gate x) * act(up x))``; ``x`` ``[..., n_embd]`` -> ``[..., n_embd]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.act_fn(self.up_proj(x)))


class BambooForCausalLM(MistralForCausalLM):
    """MistralForCausalLM with dReLU MLPs."""

    config_class = BambooConfig

    def __init__(self, config: BambooConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = BambooMLP(config)

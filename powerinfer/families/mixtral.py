"""Mixtral 8x7B / 8x22B (``MixtralForCausalLM``): the ``llama`` GGUF architecture with experts.

A Mistral body (:mod:`.mistral`: GQA, Q/K rows permuted, an optional ``sliding_window``) whose FFN
is a mixture of experts (:mod:`.experts`): the router ``block_sparse_moe.gate`` picks
``num_experts_per_tok`` of ``num_local_experts`` SiLU-gated experts (``w1`` gate, ``w3`` up, ``w2``
down, width ``intermediate_size``) by softmax and top-k, and renormalises the k weights
(transformers' ``MixtralTopKRouter``; llama.cpp's ``llama`` graph, ``norm_w`` true). llama.cpp's
converter writes it as arch ``llama`` with ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``; a
``llama`` file is read as Mixtral when it has ``llama.expert_count``.
"""
from __future__ import annotations

from typing import Any

from .base import register_family
from .experts import checkpoint_ffn, expert_counts, expert_kv, expert_rules, require_hidden_act
from .llama import LLAMA_RULES
from .mistral import MISTRAL, _mistral_kv

_KINDS = {"w1": "gate", "w3": "up", "w2": "down"}
_ROUTER, _EXPERT = "block_sparse_moe.gate", "block_sparse_moe.experts"


def _adapt(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    expert_counts(cfg, source)
    require_hidden_act(cfg, source, "mixtral", "silu")
    return cfg


def _ffn(cfg: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    return checkpoint_ffn(cfg, i, _ROUTER, _EXPERT, _KINDS, cfg["intermediate_size"])


MIXTRAL = register_family(MISTRAL.replace(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    tensor_rules=tuple(r for r in LLAMA_RULES if ".mlp." not in r.hf.replace("\\", ""))
    + expert_rules(r"model\.layers\.(?P<bid>\d+)\.", _ROUTER, _EXPERT, _KINDS),
    experts=True,
    checkpoint_ffn=_ffn,
    adapt_config=_adapt,
    gguf_kv=lambda cfg: {**_mistral_kv(cfg), **expert_kv("llama", cfg)},
))

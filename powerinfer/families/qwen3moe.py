"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): the ``qwen3moe`` GGUF architecture.

A Qwen3 body (:mod:`.qwen`: NeoX RoPE, per-head Q/K RMSNorm, explicit ``head_dim``) whose every FFN
is a mixture of experts (:mod:`.experts`): router ``mlp.gate``, ``num_experts`` SiLU-gated experts
``mlp.experts.{x}.gate_proj/up_proj/down_proj`` of width ``moe_intermediate_size`` (written as
``qwen3moe.expert_feed_forward_length``), ``num_experts_per_tok`` of them per token, no shared
expert. transformers renormalises the k softmax weights only when ``norm_topk_prob`` is true (every
published Qwen3-MoE); llama.cpp's ``qwen3moe`` graph always does. For a ``norm_topk_prob: false``
config we write ``qwen3moe.expert_weights_norm = false``, which ``pi-run`` honours (llama.cpp
ignores the key for this architecture, so the two engines then differ).

Layers without experts (``mlp_only_layers`` not empty, or ``decoder_sparse_step`` > 1) are refused
in one line: llama.cpp's ``qwen3moe`` loader requires a router in every layer, so no GGUF reader
runs such a file.
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import TensorRule, register_family
from .experts import checkpoint_ffn, expert_counts, expert_kv, expert_rules, require_hidden_act
from .qwen import QWEN3, _UNPERMUTED, adapt_qwen_config

_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_ROUTER, _EXPERT = "mlp.gate", "mlp.experts"
_L = r"model\.layers\.(?P<bid>\d+)\."


def _adapt(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    cfg = adapt_qwen_config(cfg, source)
    expert_counts(cfg, source)
    require_hidden_act(cfg, source, "qwen3moe", "silu")
    step = cfg.get("decoder_sparse_step", 1)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise PowerInferError(f"{source}: decoder_sparse_step = {step!r} is not a positive integer")
    if cfg.get("mlp_only_layers") or (step or 1) != 1:
        raise PowerInferError(f"{source}: layers without experts (mlp_only_layers {cfg.get('mlp_only_layers')}, "
                              f"decoder_sparse_step {cfg.get('decoder_sparse_step')}) are not supported: "
                              "llama.cpp's qwen3moe files have a router in every layer")
    w = cfg.get("moe_intermediate_size")
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise PowerInferError(f"{source}: moe_intermediate_size = {w!r} is missing or out of range")
    return cfg


def _kv(cfg: dict[str, Any]) -> dict[str, Any]:
    kv = {**expert_kv("qwen3moe", cfg), "qwen3moe.expert_feed_forward_length": int(cfg["moe_intermediate_size"])}
    if not cfg.get("norm_topk_prob", False):  # transformers' default is false; llama.cpp always renormalises
        kv["qwen3moe.expert_weights_norm"] = False
    return kv


def _ffn(cfg: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    return checkpoint_ffn(cfg, i, _ROUTER, _EXPERT, _KINDS, cfg["moe_intermediate_size"])


QWEN3MOE = register_family(QWEN3.replace(
    name="qwen3moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    gguf_arch="qwen3moe",
    tensor_rules=tuple(r for r in _UNPERMUTED if ".mlp." not in r.hf.replace("\\", ""))
    + (TensorRule(_L + r"self_attn\.(?P<p>[qk])_norm\.weight", "blk.{bid}.attn_{p}_norm.weight"),)
    + expert_rules(_L, _ROUTER, _EXPERT, _KINDS),
    experts=True,
    checkpoint_ffn=_ffn,
    adapt_config=_adapt,
    gguf_kv=_kv,
))

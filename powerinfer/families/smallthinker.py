"""SmallThinker (``SmallThinkerForCausalLM``: PowerInfer/SmallThinker-4BA0.6B, -21BA3B): GGUF ``smallthinker``.

A mixture-of-experts decoder (:mod:`.experts`) as llama.cpp's ``conversion/smallthinker.py`` and
``src/models/smallthinker.cpp`` define it (transformers has no class for it, so llama.cpp's outputs
are the reference):

* the router ``block_sparse_moe.primary_router`` reads the layer's *input*, before the attention norm
  (the experts read the FFN norm's output as usual), ``moe_num_primary_experts`` experts
  ``block_sparse_moe.experts.{x}.gate/up/down`` of width ``moe_ffn_hidden_size``,
  ``moe_num_active_primary_experts`` per token, ReLU-gated (``down(relu(gate x) * up x)``), the k weights
  renormalised; the gate is a softmax when ``moe_primary_router_apply_softmax`` is true, else a
  sigmoid (``smallthinker.expert_gating_func`` 1 or 2);
* a ``sliding_window_layout`` with any sliding layer is written as ``smallthinker.attention.sliding_window``
  (``sliding_window_size``); llama.cpp then runs every 4th layer (0, 4, 8...) with full attention and no
  RoPE (NoPE) and the others with the window and RoPE (NeoX); without it every layer is full attention
  with RoPE. The runtime follows those rules (:mod:`powerinfer.runtime.smallthinker`).

No Q/K/V permutation (NeoX RoPE), no biases; ``feed_forward_length`` is the expert width, as
llama.cpp's converter writes it.
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import Family, TensorRule, hf_dims, register_family
from .experts import checkpoint_ffn, expert_kv, expert_rules, require_hidden_act
from .llama import LLAMA_LAYER

_L = r"model\.layers\.(?P<bid>\d+)\."
_KINDS = {"gate": "gate", "up": "up", "down": "down"}
_ROUTER, _EXPERT = "block_sparse_moe.primary_router", "block_sparse_moe.experts"
GATING = {True: 1, False: 2}  # llama.cpp's expert_gating_func: softmax, sigmoid
NOPE_PERIOD = 4  # llama.cpp: with sliding layers, layers 0, 4, 8... are full attention without RoPE


def _adapt(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """SmallThinker's keys in the names the other stages read (``num_local_experts``, ``intermediate_size``...)."""
    cfg = dict(cfg)
    for ours, theirs in (("num_local_experts", "moe_num_primary_experts"),
                         ("num_experts_per_tok", "moe_num_active_primary_experts"),
                         ("intermediate_size", "moe_ffn_hidden_size")):
        if theirs not in cfg:
            raise PowerInferError(f"{source}: {theirs} is missing")
        cfg[ours] = cfg[theirs]
    from .experts import expert_counts

    expert_counts(cfg, source, ("moe_num_primary_experts", "moe_num_active_primary_experts"))
    require_hidden_act(cfg, source, "smallthinker", "relu")
    softmax = cfg.get("moe_primary_router_apply_softmax", False)
    if not isinstance(softmax, bool):  # a string "no" would be truthy: softmax
        raise PowerInferError(f"{source}: moe_primary_router_apply_softmax = {softmax!r} is not a bool")
    layout, n_layer = cfg.get("sliding_window_layout"), cfg.get("num_hidden_layers")
    if layout is not None and (not isinstance(layout, list) or len(layout) != n_layer
                               or any(v not in (0, 1) or isinstance(v, float) for v in layout)):
        raise PowerInferError(f"{source}: sliding_window_layout = {layout!r:.80} is not a list of 0/1, one per "
                              f"layer ({n_layer} layers)")
    if any(cfg.get("sliding_window_layout") or []) and not cfg.get("sliding_window_size"):
        raise PowerInferError(f"{source}: sliding_window_layout has sliding layers but no sliding_window_size")
    return cfg


def _kv(cfg: dict[str, Any]) -> dict[str, Any]:
    kv = {**expert_kv("smallthinker", cfg), "smallthinker.expert_feed_forward_length": int(cfg["moe_ffn_hidden_size"]),
          "smallthinker.expert_gating_func": GATING[bool(cfg.get("moe_primary_router_apply_softmax"))]}
    if any(cfg.get("sliding_window_layout") or []):
        kv["smallthinker.attention.sliding_window"] = int(cfg["sliding_window_size"])
    return kv


def _ffn(cfg: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    return checkpoint_ffn(cfg, i, _ROUTER, _EXPERT, _KINDS, cfg["moe_ffn_hidden_size"])


def _checkpoint(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a SmallThinker checkpoint with its torch shape (transformers cannot build one)."""
    d = hf_dims(cfg)
    D, hd, V = d["n_embd"], d["head_dim"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, D)
    for i in range(d["n_layer"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (d["n_head"] * hd, D),
                    p + "self_attn.k_proj.weight": (d["n_head_kv"] * hd, D),
                    p + "self_attn.v_proj.weight": (d["n_head_kv"] * hd, D),
                    p + "self_attn.o_proj.weight": (D, d["n_head"] * hd)})
        out.update(_ffn(cfg, i))
    return out


SMALLTHINKER: Family = register_family(Family(
    name="smallthinker",
    hf_architectures=("SmallThinkerForCausalLM",),
    hf_model_types=("smallthinker",),
    gguf_arch="smallthinker",
    ffn="reglu",
    layers_attr="model.layers",
    gate_attr=None,
    up_attr="block_sparse_moe",
    down_attr="block_sparse_moe",
    predictor_input_attr=None,
    tensor_rules=(
        TensorRule(r"model\.embed_tokens\.weight", "token_embd.weight"),
        TensorRule(r"model\.norm\.weight", "output_norm.weight"),
        TensorRule(r"lm_head\.weight", "output.weight"),
        TensorRule(_L + r"input_layernorm\.weight", "blk.{bid}.attn_norm.weight"),
        TensorRule(_L + r"self_attn\.(?P<p>[qkv])_proj\.weight", "blk.{bid}.attn_{p}.weight"),
        TensorRule(_L + r"self_attn\.o_proj\.weight", "blk.{bid}.attn_output.weight"),
        TensorRule(_L + r"post_attention_layernorm\.weight", "blk.{bid}.ffn_norm.weight"),
    ) + expert_rules(_L, _ROUTER, _EXPERT, _KINDS),
    gguf_layer_tensors=LLAMA_LAYER,
    gguf_global_tensors=("token_embd", "output_norm", "output"),
    rope="neox",
    output_optional=True,
    dense_gguf_activation="relu",
    default_activation="relu",
    experts=True,
    checkpoint_ffn=_ffn,
    checkpoint_tensors=_checkpoint,
    adapt_config=_adapt,
    gguf_kv=_kv,
))

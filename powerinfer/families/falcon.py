"""ReLU-Falcon-40B (and Falcon-7B-style models): the ``falcon`` GGUF architecture.

Falcon-40B's decoder (``new_decoder_architecture``) is parallel: attention and the FFN
both read the layer input ``x`` through their own LayerNorm (``ln_attn``, ``ln_mlp``,
with bias) and ``x + attn(ln_attn x) + ffn(ln_mlp x)`` is the output. The FFN is
``down(act(up x))`` with no gate and no biases; neuron i is active iff ``up_i x > 0``.
The predictor reads the layer input (upstream ``build_falcon`` passes ``inpL``).
Attention uses a fused QKV matrix, NeoX (rotate-half) RoPE and GQA.

GGUF facts confirmed in upstream PowerInfer (``gguf-py/gguf/tensor_mapping.py`` and
``llama.cpp``'s falcon loader/graph): ``ln_mlp`` -> ``attn_norm`` (the FFN's norm),
``ln_attn`` -> ``attn_norm_2`` (attention's norm, optional: one-norm models have only
``attn_norm``), weights and biases for both; ``attn_qkv`` in the "jploski" order (all
Q heads, then all K heads, then all V heads; HF groups them per kv head as
``[q..q, k, v]``), ``falcon.tensor_data_layout = "jploski"``; no ``ffn_norm``, no gate.

The activation comes from the config's ``activation`` key (transformers' default is
GELU, which is what a config without the key runs). Legacy ``RWForCausalLM`` configs
(``model_type`` ``RefinedWeb`` for 40B, ``RefinedWebModel`` for 7B, keys ``n_layer``,
``n_head``, ``n_head_kv``) are mapped onto transformers' ``FalconConfig``; they never
reach the Llama path (upstream's ``_get_model_architecture`` maps ``RWForCausalLM``
to ``LLAMA``).
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import Family, TensorRule, register_family, weight_and_bias

LEGACY_MODEL_TYPES = ("RefinedWeb", "RefinedWebModel")
_LEGACY_KEYS = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                "n_head_kv": "num_kv_heads", "n_embd": "hidden_size"}


def adapt_falcon_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A Falcon config (legacy RW or current) as ``FalconConfig`` keys.

    ``num_kv_heads`` is set to the number of K/V heads the attention really has (1 for
    multi-query Falcon-7B, ``num_attention_heads`` for the oldest layout), so every
    stage can read it directly. Raises PowerInferError for ALiBi or sequential
    (non-parallel) Falcon layouts, which upstream's falcon graph cannot run.
    """
    legacy = cfg.get("model_type") in LEGACY_MODEL_TYPES or "RWForCausalLM" in (cfg.get("architectures") or [])
    if legacy:
        for old, new in _LEGACY_KEYS.items():
            if old in cfg and new not in cfg:
                cfg[new] = cfg.pop(old)
        if "new_decoder_architecture" not in cfg:  # the 40B RW code always used the new decoder
            cfg["new_decoder_architecture"] = cfg.get("model_type") == "RefinedWeb"
        cfg["model_type"] = "falcon"
        cfg["architectures"] = ["FalconForCausalLM"]
        cfg.pop("auto_map", None)
    if cfg.get("alibi"):
        raise PowerInferError(f"{source}: Falcon with ALiBi positions is not supported (upstream's falcon graph uses RoPE)")
    new_arch = bool(cfg.get("new_decoder_architecture"))
    if not new_arch and cfg.get("parallel_attn") is False:
        raise PowerInferError(f"{source}: Falcon with sequential attention (parallel_attn false) is not supported "
                              "(upstream's falcon graph is parallel-attention only)")
    n_head = cfg.get("num_attention_heads")
    if new_arch:
        cfg["num_kv_heads"] = cfg.get("num_kv_heads") or n_head
    else:
        cfg["num_kv_heads"] = 1 if cfg.get("multi_query", True) else n_head
    return cfg


def _one_norm(cfg: dict[str, Any]) -> bool:
    n_ln = cfg.get("num_ln_in_parallel_attn")
    return not cfg.get("new_decoder_architecture") or n_ln == 1


def specialize_falcon(fam: Family, cfg: dict[str, Any]) -> Family:
    """Falcon-7B-style models (one input layernorm) have no ``attn_norm_2``."""
    if not _one_norm(cfg):
        return fam
    return fam.replace(gguf_layer_tensors=tuple(t for t in fam.gguf_layer_tensors if not t.startswith("attn_norm_2")))


_H = r"transformer\.h\.(?P<bid>\d+)\."

FALCON = register_family(Family(
    name="falcon",
    hf_architectures=("FalconForCausalLM", "RWForCausalLM"),
    hf_model_types=("falcon",) + LEGACY_MODEL_TYPES,
    gguf_arch="falcon",
    ffn="relu",
    layers_attr="transformer.h",
    gate_attr=None,
    up_attr="mlp.dense_h_to_4h",
    down_attr="mlp.dense_4h_to_h",
    predictor_input_attr=None,
    tensor_rules=(
        TensorRule(r"transformer\.word_embeddings\.weight", "token_embd.weight"),
        weight_and_bias(r"transformer\.ln_f", "output_norm"),
        TensorRule(r"lm_head\.weight", "output.weight"),
        weight_and_bias(_H + r"ln_mlp", "blk.{bid}.attn_norm"),
        weight_and_bias(_H + r"input_layernorm", "blk.{bid}.attn_norm"),
        weight_and_bias(_H + r"ln_attn", "blk.{bid}.attn_norm_2"),
        TensorRule(_H + r"self_attention\.query_key_value\.weight", "blk.{bid}.attn_qkv.weight", "qkv_jploski"),
        TensorRule(_H + r"self_attention\.dense\.weight", "blk.{bid}.attn_output.weight"),
        TensorRule(_H + r"mlp\.dense_h_to_4h\.weight", "blk.{bid}.ffn_up.weight"),
        TensorRule(_H + r"mlp\.dense_4h_to_h\.weight", "blk.{bid}.ffn_down.weight", "down"),
    ),
    gguf_layer_tensors=("attn_norm", "attn_norm.bias", "attn_norm_2", "attn_norm_2.bias", "attn_qkv", "attn_output"),
    gguf_global_tensors=("token_embd", "output_norm", "output_norm.bias", "output"),
    norm="layer",
    rope="neox",
    parallel_attn=True,
    activation_keys=("activation",),
    default_activation="gelu",
    adapt_config=adapt_falcon_config,
    specialize=specialize_falcon,
    gguf_kv=lambda cfg: {"falcon.tensor_data_layout": "jploski"},
))

"""OPT (``OPTForCausalLM``): the ``opt`` GGUF architecture.

Pre-LN decoder with LayerNorms and biases everywhere, learned absolute positions
(HF's ``OPTLearnedPositionalEmbedding`` keeps two unused rows first, so position p is
row ``p + 2``; upstream's engine adds the same 2 to every position) and an output
projection tied to the token embedding. FFN ``fc2(relu(fc1 x))``: neuron i active iff
``fc1_i x > 0``; the predictor reads the residual before the FFN layernorm (upstream
``build_opt`` passes ``ffn_inp``).

Upstream's OPT loader (PowerInfer ``llama.cpp``) wants ``token_embd``,
``position_embd`` (exactly 2050 rows: it hard-codes ``n_ctx_train = 2050``, i.e.
``max_position_embeddings`` 2048), ``output_norm`` weight+bias and no ``output``
tensor; per layer every projection and norm with its bias, and in PowerInfer files
``ffn_down_t.weight`` + ``ffn_down_t.bias``. Checkpoints may name tensors
``decoder.*`` (the published facebook/opt files) or ``model.decoder.*``.
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import Family, TensorRule, register_family, weight_and_bias


def adapt_opt_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuse OPT variants upstream's pre-LN ``opt`` graph cannot run (opt-350m and kin)."""
    if cfg.get("do_layer_norm_before") is False:
        raise PowerInferError(f"{source}: post-LN OPT (do_layer_norm_before false, e.g. opt-350m) is not supported")
    proj = cfg.get("word_embed_proj_dim")
    if proj is not None and proj != cfg.get("hidden_size"):
        raise PowerInferError(f"{source}: OPT with word_embed_proj_dim {proj} != hidden_size (project_in/out) "
                              "is not supported")
    if cfg.get("tie_word_embeddings") is False or cfg.get("enable_bias") is False \
            or cfg.get("_remove_final_layer_norm"):
        raise PowerInferError(f"{source}: this OPT variant (untied output, no biases or no final layernorm) "
                              "does not fit upstream's opt tensor set")
    return cfg


_D = r"(?:model\.)?decoder\."
_L = _D + r"layers\.(?P<bid>\d+)\."

OPT = register_family(Family(
    name="opt",
    hf_architectures=("OPTForCausalLM",),
    hf_model_types=("opt",),
    gguf_arch="opt",
    ffn="relu",
    layers_attr="model.decoder.layers",
    gate_attr=None,
    up_attr="fc1",
    down_attr="fc2",
    predictor_input_attr="final_layer_norm",
    tensor_rules=(
        TensorRule(_D + r"embed_tokens\.weight", "token_embd.weight"),
        TensorRule(_D + r"embed_positions\.weight", "position_embd.weight"),
        weight_and_bias(_D + r"final_layer_norm", "output_norm"),
        TensorRule(r"lm_head\.weight", None),  # tied to token_embd; upstream stores no output tensor
        weight_and_bias(_L + r"self_attn_layer_norm", "blk.{bid}.attn_norm"),
        weight_and_bias(_L + r"self_attn\.q_proj", "blk.{bid}.attn_q"),
        weight_and_bias(_L + r"self_attn\.k_proj", "blk.{bid}.attn_k"),
        weight_and_bias(_L + r"self_attn\.v_proj", "blk.{bid}.attn_v"),
        weight_and_bias(_L + r"self_attn\.out_proj", "blk.{bid}.attn_output"),
        weight_and_bias(_L + r"final_layer_norm", "blk.{bid}.ffn_norm"),
        weight_and_bias(_L + r"fc1", "blk.{bid}.ffn_up"),
        weight_and_bias(_L + r"fc2", "blk.{bid}.ffn_down", "down"),
    ),
    gguf_layer_tensors=("attn_norm", "attn_norm.bias", "attn_q", "attn_q.bias", "attn_k", "attn_k.bias",
                        "attn_v", "attn_v.bias", "attn_output", "attn_output.bias", "ffn_norm", "ffn_norm.bias"),
    gguf_global_tensors=("token_embd", "position_embd", "output_norm", "output_norm.bias"),
    norm="layer",
    rope=None,
    ffn_bias=True,
    learned_pos_offset=2,
    activation_keys=("activation_function",),
    default_activation="relu",
    adapt_config=adapt_opt_config,
))

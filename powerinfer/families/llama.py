"""ReLU-Llama 2 (ReluLLaMA-7B/13B/70B) and ProSparse-Llama 2: the ``llama`` GGUF architecture.

Both are Llama 2 bodies (RMSNorm, GQA attention, rotate-half RoPE stored permuted to
GGML's interleaved layout) with a gated FFN ``down(act(gate x) * up x)``: ReLU-Llama
has ``hidden_act: relu``, ProSparse (``SparseLlamaForCausalLM``, ``model_type:
sparsellama``) has ``hidden_act: fatrelu`` with its threshold in ``hidden_act_param``
(neuron i active iff ``gate_i x >= t``). The predictor reads the residual stream after
attention, before ``ffn_norm`` (upstream ``build_llama_variants`` passes ``ffn_inp``).

Upstream PowerInfer has no ProSparse path in its converters (``convert.py`` sends
``model_type`` ``sparsellama`` to ``convert-hf-to-powerinfer-gguf.py``, which knows no
``SparseLlamaForCausalLM``) and its engine runs every ``llama`` PWRI file with plain
ReLU, ignoring the threshold. We write ProSparse as ``llama`` plus our key
``powerinfer.activation_threshold``, which ``pi-run`` honours.

A ``LlamaForCausalLM`` config whose activation is dense (SiLU: Llama 2, Llama 3.x) is the
``llama3`` record (:mod:`.llama3`), which :func:`dense_llama` picks after the activation is
known; GGUF ``llama`` files are read with this record either way (the runtime facts are
the same, the file says the activation and RoPE scaling).
"""
from __future__ import annotations

from typing import Any

from .base import FAMILIES, Family, TensorRule, activation_from_config, register_family

_L = r"model\.layers\.(?P<bid>\d+)\."

LLAMA_RULES = (
    TensorRule(r"model\.embed_tokens\.weight", "token_embd.weight"),
    TensorRule(r"model\.norm\.weight", "output_norm.weight"),
    TensorRule(r"lm_head\.weight", "output.weight"),
    TensorRule(_L + r"input_layernorm\.weight", "blk.{bid}.attn_norm.weight"),
    TensorRule(_L + r"self_attn\.q_proj\.weight", "blk.{bid}.attn_q.weight", "permute_q"),
    TensorRule(_L + r"self_attn\.k_proj\.weight", "blk.{bid}.attn_k.weight", "permute_k"),
    TensorRule(_L + r"self_attn\.v_proj\.weight", "blk.{bid}.attn_v.weight"),
    TensorRule(_L + r"self_attn\.o_proj\.weight", "blk.{bid}.attn_output.weight"),
    TensorRule(_L + r"post_attention_layernorm\.weight", "blk.{bid}.ffn_norm.weight"),
    TensorRule(_L + r"mlp\.gate_proj\.weight", "blk.{bid}.ffn_gate.weight"),
    TensorRule(_L + r"mlp\.up_proj\.weight", "blk.{bid}.ffn_up.weight"),
    TensorRule(_L + r"mlp\.down_proj\.weight", "blk.{bid}.ffn_down.weight", "down"),
)
LLAMA_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")


def dense_llama(fam: Family, cfg: dict[str, Any]) -> Family:
    """The ``llama3`` record for a config whose FFN activation is dense (SiLU), else ``fam``."""
    return fam if activation_from_config(cfg, fam).is_sparse else FAMILIES["llama3"]

RELU_LLAMA = register_family(Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_arch="llama",
    ffn="reglu",
    layers_attr="model.layers",
    gate_attr="mlp.gate_proj",
    up_attr="mlp.up_proj",
    down_attr="mlp.down_proj",
    predictor_input_attr="post_attention_layernorm",
    tensor_rules=LLAMA_RULES,
    gguf_layer_tensors=LLAMA_LAYER,
    gguf_global_tensors=("token_embd", "output_norm", "output"),
    dense_gguf_activation="silu",  # upstream PWRI llama files are ReLU, llama.cpp's dense ones SiLU
    specialize=dense_llama,
))

PROSPARSE = register_family(RELU_LLAMA.replace(
    name="prosparse",
    hf_architectures=("SparseLlamaForCausalLM",),
    hf_model_types=("sparsellama",),
    specialize=None,
))

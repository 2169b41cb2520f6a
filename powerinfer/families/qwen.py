"""Qwen2 / Qwen2.5 and Qwen3 (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): GGUF ``qwen2`` and ``qwen3``.

Both are Llama-shaped decoders (RMSNorm, GQA, SiLU gated FFN) with NeoX RoPE: each head
rotates ``(x[i], x[i + d/2])`` (HF's rotate-half), so llama.cpp's converter stores Q and K
rows as they are (no permutation) and its ``qwen2``/``qwen3`` graphs use
``LLAMA_ROPE_TYPE_NEOX``. What differs (llama.cpp ``src/models/qwen2.cpp``, ``qwen3.cpp``):

* Qwen2: Q, K and V projections with biases (``blk.N.attn_q.bias`` ...), no bias on the
  output projection;
* Qwen3: no biases, a per-head RMSNorm of Q and of K before RoPE (``blk.N.attn_q_norm.weight``,
  ``attn_k_norm.weight``, ``[head_dim]``, eps ``rms_norm_eps``) and an explicit ``head_dim``
  (``qwen3.attention.key_length``/``value_length``);
* small sizes tie the output to the embedding: no ``output.weight`` then (llama.cpp's
  loaders reuse ``token_embd``).

Qwen2's per-layer sliding window (``use_sliding_window: true``, off in every published
Qwen2/2.5/3 config) is refused: llama.cpp does not apply it either.
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import Family, TensorRule, register_family
from .llama import LLAMA_LAYER, LLAMA_RULES, RELU_LLAMA

_L = r"model\.layers\.(?P<bid>\d+)\."
_UNPERMUTED = tuple(TensorRule(r.hf, r.gguf, None if r.transform in ("permute_q", "permute_k") else r.transform)
                    for r in LLAMA_RULES)


def adapt_qwen_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuse Qwen's sliding-window layers (``use_sliding_window``), which no GGUF reader applies."""
    if cfg.get("use_sliding_window"):
        raise PowerInferError(f"{source}: use_sliding_window true (Qwen sliding-window attention layers) "
                              "is not supported")
    return cfg


QWEN2 = register_family(RELU_LLAMA.replace(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_arch="qwen2",
    tensor_rules=_UNPERMUTED + (TensorRule(_L + r"self_attn\.(?P<p>[qkv])_proj\.bias", "blk.{bid}.attn_{p}.bias"),),
    gguf_layer_tensors=LLAMA_LAYER + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    rope="neox",
    output_optional=True,
    dense_gguf_activation="silu",
    adapt_config=adapt_qwen_config,
    specialize=None,
))

QWEN3: Family = register_family(QWEN2.replace(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_arch="qwen3",
    tensor_rules=_UNPERMUTED + (TensorRule(_L + r"self_attn\.(?P<p>[qk])_norm\.weight", "blk.{bid}.attn_{p}_norm.weight"),),
    gguf_layer_tensors=LLAMA_LAYER + ("attn_q_norm", "attn_k_norm"),
    qk_norm=True,
))

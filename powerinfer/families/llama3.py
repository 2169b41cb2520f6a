"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 with their SiLU FFN: the ``llama`` GGUF architecture, dense.

The ReLU-Llama body (:mod:`.llama`: RMSNorm, GQA, Q/K rows permuted to GGML's interleaved
RoPE) with ``down(silu(gate x) * up x)``. ``LlamaForCausalLM`` configs reach this record
through :func:`.llama.dense_llama` when their activation is dense. What Llama 3.x adds is
stated in the config and written as llama.cpp's converter writes it: ``rope_scaling`` of
type ``llama3`` as the ``rope_freqs.weight`` factors (:mod:`.rope_scaling`), an explicit
``head_dim`` as ``llama.attention.key_length``/``value_length``, and tied embeddings (3.2
1B/3B: the checkpoint has no ``lm_head``) as a file without ``output.weight``, which
llama.cpp's loader replaces by ``token_embd``.
"""
from __future__ import annotations

from .base import register_family
from .llama import RELU_LLAMA

LLAMA3 = register_family(RELU_LLAMA.replace(
    name="llama3",
    output_optional=True,
    specialize=None,
))

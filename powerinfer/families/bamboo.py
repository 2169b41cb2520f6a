"""Bamboo-7B (and TurboSparse-Mistral): the ``bamboo`` GGUF architecture.

A Mistral body (RMSNorm, GQA with 8 kv heads, RoPE, ``sliding_window``) whose FFN is
dReLU, ``down(relu(gate x) * relu(up x))``: neuron i is active iff ``gate_i x > 0``
and ``up_i x > 0`` (upstream ``llm_build_ffn_sparse`` with ``LLM_FFN_SYM``). HF
tensor names are Llama's; upstream's ``convert.py`` writes ``model_type: bamboo`` as
the ``bamboo`` architecture with the same tensor set as ``llama``.

The attention window is written as ``bamboo.attention.sliding_window`` (the key
today's llama.cpp uses for windowed models). Upstream PowerInfer ignores it and
attends to the whole context, which differs from the trained model only past
``sliding_window`` (4096) tokens; ``pi-run`` applies the window.
"""
from __future__ import annotations

from typing import Any

from .base import register_family
from .llama import RELU_LLAMA


def _bamboo_kv(cfg: dict[str, Any]) -> dict[str, Any]:
    w = cfg.get("sliding_window")
    return {"bamboo.attention.sliding_window": int(w)} if w else {}


BAMBOO = register_family(RELU_LLAMA.replace(
    name="bamboo",
    hf_architectures=("BambooForCausalLM",),
    hf_model_types=("bamboo",),
    gguf_arch="bamboo",
    ffn="dreglu",
    gguf_kv=_bamboo_kv,
    dense_gguf_activation="relu",
    specialize=None,
))

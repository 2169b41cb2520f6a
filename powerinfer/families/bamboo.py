"""Bamboo-7B and TurboSparse-Mistral: the ``bamboo`` GGUF architecture.

A Mistral body (RMSNorm, GQA with 8 kv heads, RoPE, ``sliding_window``) whose FFN is
dReLU, ``down(relu(gate x) * relu(up x))``: neuron i is active iff ``gate_i x > 0``
and ``up_i x > 0`` (upstream ``llm_build_ffn_sparse`` with ``LLM_FFN_SYM``). HF
tensor names are Llama's; upstream's ``convert.py`` writes ``model_type: bamboo`` as
the ``bamboo`` architecture with the same tensor set as ``llama``.

The attention window is written as ``bamboo.attention.sliding_window`` (the key
today's llama.cpp uses for windowed models). Upstream PowerInfer ignores it and
attends to the whole context, which differs from the trained model only past
``sliding_window`` (4096) tokens; ``pi-run`` applies the window.

TurboSparse-Mistral (``PowerInfer/TurboSparse-Mistral-Instruct``) has the same config
(``BambooForCausalLM``, ``model_type: bamboo``) and carries its own predictor in every
layer: ``model.layers.N.mlp.predictor.fc1.weight`` ``[H, n_embd]`` and ``fc2.weight``
``[n_ff, H]``, no biases, reading the residual before ``post_attention_layernorm``; its
modelling code keeps neuron j where ``round(sigmoid(fc2(relu(fc1 x))))_j`` is 1, i.e. logit > 0.
They map to ``blk.N.fc1``/``fc2`` as upstream's open PR #212 maps them (transform
``predictor``: written only when the file takes the checkpoint's own predictors,
:mod:`powerinfer.convert.own_predictors`).
"""
from __future__ import annotations

from typing import Any

from .base import TensorRule, register_family
from .llama import LLAMA_RULES, RELU_LLAMA

OWN_PREDICTOR_RULE = TensorRule(r"model\.layers\.(?P<bid>\d+)\.mlp\.predictor\.(?P<fc>fc1|fc2)\.weight",
                                "blk.{bid}.{fc}.weight", "predictor")


def _bamboo_kv(cfg: dict[str, Any]) -> dict[str, Any]:
    w = cfg.get("sliding_window")
    return {"bamboo.attention.sliding_window": int(w)} if w else {}


BAMBOO = register_family(RELU_LLAMA.replace(
    name="bamboo",
    hf_architectures=("BambooForCausalLM",),
    hf_model_types=("bamboo",),
    gguf_arch="bamboo",
    ffn="dreglu",
    tensor_rules=LLAMA_RULES + (OWN_PREDICTOR_RULE,),
    gguf_kv=_bamboo_kv,
    dense_gguf_activation="relu",
    specialize=None,
))

"""Mistral 7B v0.1-v0.3 and Mistral-Nemo (``MistralForCausalLM``): the ``llama`` GGUF architecture.

A Llama 3 body (:mod:`.llama3`: SiLU FFN, GQA with 8 kv heads, Q/K rows permuted as for
Llama, which llama.cpp's converter also does for ``MistralForCausalLM``) with two facts of
its own in the config:

* ``sliding_window`` (v0.1: 4096; null in v0.2/v0.3): query ``p`` attends to keys
  ``p - W + 1 .. p``, as transformers' Mistral does. We write it as
  ``llama.attention.sliding_window``, which ``pi-run`` applies; llama.cpp's converter writes
  no window for this architecture and its ``llama`` graph attends to the whole context, so
  the two differ only past ``W`` tokens.
* ``head_dim`` not ``n_embd / n_head`` (Nemo: 5120 wide, 32 heads of 128): written as
  ``llama.attention.key_length``/``value_length`` and ``rope.dimension_count``.
"""
from __future__ import annotations

from typing import Any

from .base import register_family
from .llama3 import LLAMA3


def _mistral_kv(cfg: dict[str, Any]) -> dict[str, Any]:
    w = cfg.get("sliding_window")
    return {"llama.attention.sliding_window": int(w)} if w else {}


MISTRAL = register_family(LLAMA3.replace(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    gguf_kv=_mistral_kv,
))

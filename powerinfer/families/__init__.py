"""Model families: the one place that knows each architecture's facts.

Every stage (profile, predictor training, conversion, runtime) asks this package
instead of hard-coding names. One small module per family declares its
:class:`Family` record (FORMATS.md section 1; upstream PowerInfer's converters and
``llama.cpp`` loaders for the GGUF side):

* :mod:`.llama`  -- ReLU-Llama 2 and ProSparse-Llama 2 (GGUF ``llama``)
* :mod:`.llama3` -- Llama 2 / 3.x with SiLU (GGUF ``llama``; ``rope_freqs``, tied output)
* :mod:`.mistral` -- Mistral 7B and Mistral-Nemo (GGUF ``llama``; sliding window, head_dim)
* :mod:`.qwen`   -- Qwen2 / Qwen2.5 and Qwen3 (GGUF ``qwen2``, ``qwen3``)
* :mod:`.mixtral` -- Mixtral, experts on a Mistral body (GGUF ``llama`` with ``ffn_*_exps``; :mod:`.experts`)
* :mod:`.qwen3moe` -- Qwen3-MoE (GGUF ``qwen3moe``)
* :mod:`.smallthinker` -- SmallThinker: pre-attention router, NoPE and sliding layers (GGUF ``smallthinker``)
* :mod:`.bamboo` -- Bamboo-7B, dReLU on a Mistral body (GGUF ``bamboo``)
* :mod:`.falcon` -- ReLU-Falcon-40B, also legacy ``RWForCausalLM`` configs (GGUF ``falcon``)
* :mod:`.opt`    -- OPT (GGUF ``opt``)

Registration order matters only for :func:`family_for_gguf_arch`: ``llama`` files
are read with the ReLU-Llama record (ProSparse differs only in its activation,
which the file states in ``powerinfer.activation``).
"""
from __future__ import annotations

from .base import (DENSE_ACTIVATIONS, FAMILIES, SPARSE_ACTIVATIONS, Activation, Family, TensorRule,
                   activation_from_config, adapt_config, family_for_config, family_for_gguf_arch, get_attr,
                   hf_dims, model_layers, read_hf_config, register_family, rope_theta, weight_and_bias)
from .activation_source import ACTIVATION_CHOICES, ffn_activation_override, resolve_activation
from .llama import PROSPARSE, RELU_LLAMA  # noqa: E402  (registration order: llama first)
from .llama3 import LLAMA3  # noqa: E402
from .mistral import MISTRAL  # noqa: E402
from .qwen import QWEN2, QWEN3  # noqa: E402
from .mixtral import MIXTRAL  # noqa: E402
from .qwen3moe import QWEN3MOE  # noqa: E402
from .smallthinker import SMALLTHINKER  # noqa: E402
from .bamboo import BAMBOO  # noqa: E402
from .falcon import FALCON  # noqa: E402
from .opt import OPT  # noqa: E402

__all__ = [
    "Activation", "Family", "TensorRule", "FAMILIES", "SPARSE_ACTIVATIONS", "DENSE_ACTIVATIONS",
    "register_family", "family_for_config", "family_for_gguf_arch", "read_hf_config", "adapt_config",
    "activation_from_config", "hf_dims", "rope_theta", "get_attr", "model_layers", "weight_and_bias",
    "RELU_LLAMA", "PROSPARSE", "LLAMA3", "MISTRAL", "QWEN2", "QWEN3", "MIXTRAL", "QWEN3MOE", "SMALLTHINKER", "BAMBOO", "FALCON", "OPT",
    "ACTIVATION_CHOICES", "ffn_activation_override", "resolve_activation",
]

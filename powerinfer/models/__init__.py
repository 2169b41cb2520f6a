"""Our transformers classes for families whose published repos need ``trust_remote_code``.

:func:`register` adds them to ``AutoConfig``/``AutoModelForCausalLM`` (idempotent);
:mod:`powerinfer.hf` calls it on import, so ``AutoModelForCausalLM.from_pretrained``
loads ProSparse (``sparsellama``) and Bamboo (``bamboo``) folders with
``trust_remote_code=False``: a config's ``auto_map`` is ignored once its ``model_type``
is known locally.
"""
from __future__ import annotations

from .bamboo import BambooConfig, BambooForCausalLM, BambooMLP
from .sparsellama import FATReLU, SparseLlamaConfig, SparseLlamaForCausalLM

__all__ = ["register", "BambooConfig", "BambooForCausalLM", "BambooMLP", "FATReLU",
           "SparseLlamaConfig", "SparseLlamaForCausalLM"]

_PAIRS = ((SparseLlamaConfig, SparseLlamaForCausalLM), (BambooConfig, BambooForCausalLM))


def register() -> None:
    """Register every (config, model) pair with the transformers Auto classes (safe to call twice)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for cfg_cls, model_cls in _PAIRS:
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)

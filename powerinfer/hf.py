"""Load Hugging Face checkpoints from local folders, safely and offline.

Never passes ``trust_remote_code``: families whose published repos ship custom
modeling code (ProSparse ``sparsellama``, Bamboo ``bamboo``) get classes of ours
(:mod:`powerinfer.models`), registered with transformers when this module is
imported. Legacy Falcon configs (``RWForCausalLM``, ``model_type`` ``RefinedWeb``)
are rewritten to transformers' ``FalconConfig`` by the Falcon family
(:func:`powerinfer.families.falcon.adapt_falcon_config`) and loaded with it. A hub
name works only when it is already cached or the network is up; local folders are
the normal input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import models
from .errors import PowerInferError
from .families import (Activation, Family, adapt_config, family_for_config, read_hf_config,
                       resolve_activation)

models.register()


def resolve_model(model_dir: str | Path) -> tuple[Family, dict[str, Any], Activation]:
    """Family (the variant this config needs), adapted config dict and FFN activation of a HF folder.

    The config dict is in the keys of the family's transformers config class (legacy
    Falcon keys mapped), so :func:`powerinfer.families.hf_dims` reads it directly.
    Raises PowerInferError naming ``config.json`` for unsupported architectures,
    layouts or activations.
    """
    src = Path(model_dir) / "config.json"
    raw = read_hf_config(model_dir)
    fam = family_for_config(raw, src)
    cfg = adapt_config(fam, raw, src)
    act, cfg = resolve_activation(model_dir, fam, raw, cfg)  # config key, else modelling code as text, else
    return fam.for_config(cfg), cfg, act  # --ffn-activation, else the family default


def _adapted_config(model_dir: str | Path):
    """A transformers config built from the adapted dict when it differs from ``config.json`` (legacy
    Falcon), else None (transformers reads the folder itself)."""
    from transformers import AutoConfig

    _, cfg, _ = resolve_model(model_dir)
    if cfg == read_hf_config(model_dir):
        return None
    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def load_hf_config(model_dir: str | Path):
    """The transformers config object of a local folder (legacy Falcon keys adapted), read offline.

    Raises PowerInferError naming ``config.json`` for unsupported or unreadable configs.
    """
    from transformers import AutoConfig

    config = _adapted_config(model_dir)
    if config is not None:
        return config
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise PowerInferError(f"{Path(model_dir) / 'config.json'}: could not read it ({str(e).splitlines()[0]})") from None


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` for a local folder, in eval mode, on CPU.

    Raises PowerInferError for unsupported configs (before touching the weights) or
    unreadable weights.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    kwargs: dict[str, Any] = dict(dtype=dtype, local_files_only=True, trust_remote_code=False)
    config = _adapted_config(model_dir)
    if config is not None:  # and not the generation defaults from the legacy config.json either
        kwargs.update(config=config, generation_config=GenerationConfig.from_model_config(config))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, SafetensorError, ... all mean bad files
        raise PowerInferError(f"{model_dir}: could not load the model weights ({str(e).splitlines()[0]})") from None
    return model.eval()


def load_hf_tokenizer(model_dir: str | Path):
    """The tokenizer stored with a model folder (SentencePiece or tokenizer.json)."""
    from transformers import AutoTokenizer

    try:  # a legacy Falcon config.json would otherwise be read (with a warning) by AutoTokenizer
        config = _adapted_config(model_dir)
    except PowerInferError:  # no or unsupported config.json: the tokenizer files alone decide
        config = None
    kwargs: dict[str, Any] = {"config": config} if config is not None else {}
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as e:
        raise PowerInferError(f"{model_dir}: could not load its tokenizer ({e})") from None

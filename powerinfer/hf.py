"""Load Hugging Face checkpoints from local folders, safely and offline.

Never passes ``trust_remote_code``: families whose published repos ship custom
modeling code get classes of ours registered with transformers instead. A hub
name works only when it is already cached or the network is up; local folders
are the normal input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import PowerInferError
from .families import Activation, Family, activation_from_config, family_for_config, read_hf_config


def resolve_model(model_dir: str | Path) -> tuple[Family, dict[str, Any], Activation]:
    """Family, raw config dict and FFN activation of a HF model folder (errors name the path)."""
    cfg = read_hf_config(model_dir)
    fam = family_for_config(cfg, Path(model_dir) / "config.json")
    try:
        act = activation_from_config(cfg)
    except PowerInferError as e:
        raise PowerInferError(f"{Path(model_dir) / 'config.json'}: {e}") from None
    return fam, cfg, act


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` for a local folder, in eval mode, on CPU."""
    from transformers import AutoModelForCausalLM

    resolve_model(model_dir)  # fail early with our message for unsupported configs
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise PowerInferError(f"{model_dir}: could not load the model weights ({e})") from None
    return model.eval()


def load_hf_tokenizer(model_dir: str | Path):
    """The tokenizer stored with a model folder (SentencePiece or tokenizer.json)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise PowerInferError(f"{model_dir}: could not load its tokenizer ({e})") from None

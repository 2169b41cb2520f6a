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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import models
from .errors import PowerInferError
from .limits import MAX_LAYERS, MAX_ROPE_BASE, MAX_THRESHOLD
from .families import (Activation, Family, adapt_config, family_for_config, read_hf_config,
                       resolve_activation)
from .families import hf_dims

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


MAX_VOCAB = 1 << 21
# config keys we read as floats: (lowest allowed, highest allowed, lowest is excluded)
FLOAT_KEYS = {"rms_norm_eps": (0.0, 1.0, True), "layer_norm_eps": (0.0, 1.0, True),
              "layer_norm_epsilon": (0.0, 1.0, True), "rope_theta": (1.0, MAX_ROPE_BASE, False),
              "hidden_act_param": (0.0, MAX_THRESHOLD, False)}
INT_KEYS = {"num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "vocab_size": MAX_VOCAB}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors names of the weight dtypes we convert


@dataclass
class CheckedModel:
    """A model folder whose config and checkpoint agree (:func:`check_model`)."""

    family: Family
    cfg: dict[str, Any]
    act: Activation
    dims: dict[str, int]
    n_vocab: int


def check_config_values(cfg: dict[str, Any], src: str | Path) -> None:
    """Types and ranges of the config values the stages read, before anything is built from them.

    Floats (``rms_norm_eps``, ``rope_theta``, ...): numbers, not bools or strings, finite, in
    range; counts (``num_hidden_layers`` at most :data:`MAX_LAYERS`, ``vocab_size``): positive
    integers. Raises PowerInferError naming ``src`` (the config.json) and the key.
    """
    for key, (lo, hi, lo_open) in FLOAT_KEYS.items():
        if key not in cfg or cfg[key] is None:
            continue
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PowerInferError(f"{src}: {key} must be a finite number, got {v!r}")
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise PowerInferError(f"{src}: {key} = {v!r} is out of range ({'(' if lo_open else '['}{lo:g}, {hi:g}])")
    for key, hi in INT_KEYS.items():
        if key not in cfg or cfg[key] is None:
            continue
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= hi:
            raise PowerInferError(f"{src}: {key} must be an integer in 1..{hi}, got {v!r}")


def _checkpoint_layers(reader: Any, family: Family) -> int:
    """Decoder layers in a checkpoint: 1 + the highest index under the family's layer list."""
    import re

    last = re.escape(family.layers_attr.split(".")[-1])
    pat = re.compile(rf"(?:^|\.){last}\.(\d+)\.")
    found = {int(m.group(1)) for n in reader.names() if (m := pat.search(n))}
    return max(found) + 1 if found else 0


def _shape_note(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    return " (transposed)" if len(got) == 2 and got == want[::-1] else ""


def check_model(model_dir: str | Path) -> CheckedModel:
    """The config and checkpoint validation shared by ``pi-profile``, ``pi-train-predictor`` and
    ``pi-convert``; reads only config.json and the shard headers (no weights).

    1. the family, adapted config and activation (:func:`resolve_model`);
    2. config value types and ranges (:func:`check_config_values`), the layer count bounded
       before anything is built from it;
    3. the decoder-layer count of the checkpoint's tensor names equals ``num_hidden_layers``;
    4. the transformers model built from the config on the ``meta`` device (no memory): every
       parameter it has is in the checkpoint with the same shape (the embedding's rows are
       ``vocab_size``; a transposed matrix is named as such) and a floating-point dtype
       (int8/uint8 quantized checkpoints are refused).

    Returns a :class:`CheckedModel`. Raises PowerInferError naming the file and both numbers
    when config and weights disagree.
    """
    from .calibrate.checkpoint import CheckpointReader

    model_dir = Path(model_dir)
    src = model_dir / "config.json"
    family, cfg, act = resolve_model(model_dir)
    check_config_values(cfg, src)
    try:
        dims = hf_dims(cfg)
    except PowerInferError as e:
        raise PowerInferError(f"{src}: {str(e).removeprefix('config: ')}") from None
    if dims["n_layer"] > MAX_LAYERS:
        raise PowerInferError(f"{src}: {dims['n_layer']} layers is more than the {MAX_LAYERS} supported")
    reader = CheckpointReader(model_dir, "")
    try:
        n_ckpt = _checkpoint_layers(reader, family)
        if n_ckpt == 0:
            first = sorted(reader.names())[:1]
            raise PowerInferError(f"{model_dir}: the checkpoint has no {family.layers_attr}.N.* tensors, the decoder "
                                  f"layers of the {family.name} family that config.json names (its first tensor is "
                                  f"{first[0] if first else None!r}): the config does not belong to these weights")
        if n_ckpt != dims["n_layer"]:
            raise PowerInferError(f"{src}: num_hidden_layers is {dims['n_layer']} but the checkpoint holds "
                                  f"{n_ckpt} decoder layers")
        n_vocab = _check_tensors(model_dir, family, reader)
    finally:
        reader.close()
    return CheckedModel(family, cfg, act, dims, n_vocab)


def _check_tensors(model_dir: Path, family: Family, reader: Any) -> int:
    """Every parameter of the meta-device model (or of the family's ``checkpoint_tensors``) against the
    checkpoint headers; returns the embedding's row count."""
    seen: set[int] = set()
    if family.checkpoint_tensors is not None:  # a family transformers has no class for (SmallThinker)
        params = {k: torch.empty(s, device="meta") for k, s in family.checkpoint_tensors(resolve_model(model_dir)[1]).items()}
        n_rows = params["model.embed_tokens.weight"].shape[0]
        reader.prefix = "model"
    else:
        params, n_rows = _meta_params(model_dir, family, reader)
    for key, t in params.items():
        if id(t) in seen:  # a tied copy (the output head of a tied model)
            continue
        seen.add(id(t))
        want = tuple(t.shape)
        got = reader.shape(key)
        if got is None:
            raise PowerInferError(f"{model_dir}: the checkpoint has no tensor {key!r}, which the config implies "
                                  f"(shape {list(want)})")
        if got != want:
            raise PowerInferError(f"{model_dir}: tensor {key!r} has shape {list(got)} in the checkpoint but "
                                  f"config.json implies {list(want)}{_shape_note(got, want)}")
        dtype = reader.dtype(key)
        if t.is_floating_point() and dtype not in FLOAT_DTYPES:
            raise PowerInferError(f"{model_dir}: tensor {key!r} is stored as {dtype}; only float weights "
                                  f"({', '.join(FLOAT_DTYPES)}) can be read (a quantized checkpoint?)")
    return int(n_rows)


def _meta_params(model_dir: Path, family: Family, reader: Any) -> tuple[dict[str, torch.Tensor], int]:
    """The parameters (meta device) of the transformers model the config builds, with MoE experts in
    the published checkpoint's per-expert names, and the embedding's row count."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(model_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers rejects an inconsistent config in many ways
        raise PowerInferError(f"{model_dir / 'config.json'}: transformers cannot build this model "
                              f"({str(e).splitlines()[0][:300]})") from None
    reader.prefix = model.base_model_prefix
    params = dict(model.state_dict(keep_vars=True))
    if family.checkpoint_ffn is not None:  # MoE: transformers 5 fuses the experts the checkpoint stores one by one
        cfg = resolve_model(model_dir)[1]
        params = {k: t for k, t in params.items() if ".mlp." not in k}
        for i in range(config.num_hidden_layers):
            params.update({k: torch.empty(s, device="meta") for k, s in family.checkpoint_ffn(cfg, i).items()})
    return params, int(model.get_input_embeddings().weight.shape[0])


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
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, huggingface_hub's strict-field TypeErrors...
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise PowerInferError(f"{Path(model_dir) / 'config.json'}: could not read it ({first})") from None


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


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json")


def require_tokenizer_files(model_dir: str | Path) -> None:
    """A vocabulary file must be there: ``tokenizer.model`` (SentencePiece), ``tokenizer.json``
    or ``vocab.json`` (BPE). ``tokenizer_config.json`` alone is not one: transformers would then
    fall back to another tokenizer and every stage would see other token ids. Raises
    PowerInferError naming the folder (as ``pi-convert`` refuses it)."""
    d = Path(model_dir)
    if not any((d / n).is_file() for n in TOKENIZER_FILES):
        raise PowerInferError(f"{d}: no tokenizer.model, tokenizer.json or vocab.json, so the model's vocabulary "
                              "is unknown (tokenizer_config.json alone does not give it); copy the tokenizer "
                              "files from the model's repository")


def load_hf_tokenizer(model_dir: str | Path):
    """The tokenizer stored with a model folder (SentencePiece or tokenizer.json).

    Raises PowerInferError when the folder has no vocabulary file
    (:func:`require_tokenizer_files`) or transformers cannot load it.
    """
    from transformers import AutoTokenizer

    require_tokenizer_files(model_dir)

    try:  # a legacy Falcon config.json would otherwise be read (with a warning) by AutoTokenizer
        config = _adapted_config(model_dir)
    except PowerInferError:  # no or unsupported config.json: the tokenizer files alone decide
        config = None
    kwargs: dict[str, Any] = {"config": config} if config is not None else {}
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as e:
        raise PowerInferError(f"{model_dir}: could not load its tokenizer ({e})") from None

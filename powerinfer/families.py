"""Model families: the one place that knows each architecture's facts.

Every stage (profile, predictor training, conversion, runtime) asks this module
instead of hard-coding names. A family says how its FFN is built, when an FFN
neuron counts as *active*, where the predictor reads its input, and how its
Hugging Face tensors map onto PowerInfer GGUF tensors. The facts follow
``shared/FORMATS.md`` section 1 and upstream PowerInfer's converter
(``convert-hf-to-powerinfer-gguf.py``).

FFN kinds (``x`` is the FFN input after the norm, ``act`` the family activation):

* ``reglu``  : ``down(act(gate x) * up x)``; neuron i active iff ``act`` fires on ``gate_i x``
* ``dreglu`` : ``down(act(gate x) * act(up x))``; active iff it fires on both
* ``relu``   : ``down(act(up x))``; active iff it fires on ``up_i x``
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import PowerInferError

__all__ = [
    "Activation",
    "Family",
    "FAMILIES",
    "family_for_config",
    "family_for_gguf_arch",
    "read_hf_config",
    "activation_from_config",
]


# --------------------------------------------------------------------------- activation
SPARSE_ACTIVATIONS = ("relu", "fatrelu")
DENSE_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Activation:
    """An FFN activation function and its "neuron is active" rule.

    ``relu``: ``relu(v)``, active when ``v > 0``. ``fatrelu`` (ProSparse): ``v`` if
    ``v >= threshold`` else 0, active when ``v >= threshold``. Dense activations
    (``silu``, ``gelu``) have no active rule: every neuron always contributes.
    """

    kind: str
    threshold: float = 0.0

    @property
    def is_sparse(self) -> bool:
        return self.kind in SPARSE_ACTIVATIONS

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        if self.kind == "relu":
            return torch.relu(v)
        if self.kind == "fatrelu":
            return v * (v >= self.threshold).to(v.dtype)
        if self.kind == "silu":
            return torch.nn.functional.silu(v)
        if self.kind in ("gelu",):
            return torch.nn.functional.gelu(v)
        if self.kind in ("gelu_new", "gelu_pytorch_tanh"):
            return torch.nn.functional.gelu(v, approximate="tanh")
        raise PowerInferError(f"activation {self.kind!r} is not supported")

    def fires(self, v: torch.Tensor) -> torch.Tensor:
        """Boolean tensor, same shape as ``v``: where the activation is non-zero."""
        if self.kind == "relu":
            return v > 0
        if self.kind == "fatrelu":
            return v >= self.threshold
        raise PowerInferError(f"activation {self.kind!r} has no sparsity: neurons are always active")


# --------------------------------------------------------------------------- families
@dataclass(frozen=True)
class TensorRule:
    """Maps one Hugging Face tensor name (regex with ``(?P<bid>\\d+)`` for the layer)
    to a GGUF name (``{bid}`` placeholder) and a transform applied on the way."""

    hf: str
    gguf: str
    transform: str | None = None  # None | "permute_q" | "permute_k" | "down"

    def match(self, name: str) -> tuple[str, str | None] | None:
        m = re.fullmatch(self.hf, name)
        if m is None:
            return None
        return self.gguf.format(bid=m.groupdict().get("bid", "")), self.transform


@dataclass(frozen=True)
class Family:
    """Architecture facts shared by every stage.

    Attribute paths are dotted paths into the transformers module tree:
    ``layers_attr`` from the ``*ForCausalLM`` object to the decoder-layer list;
    ``gate_attr``/``up_attr``/``down_attr`` and ``predictor_input_attr`` from one
    decoder layer. ``predictor_input_attr`` names the module whose *input* is the
    predictor input (None: the decoder layer's own input, as for Falcon).
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_arch: str
    ffn: str
    layers_attr: str
    gate_attr: str | None
    up_attr: str
    down_attr: str
    predictor_input_attr: str | None
    tensor_rules: tuple[TensorRule, ...] = field(default_factory=tuple)
    # GGUF tensors per layer besides the FFN/predictor ones, for checking a file.
    gguf_layer_tensors: tuple[str, ...] = field(default_factory=tuple)
    gguf_global_tensors: tuple[str, ...] = field(default_factory=tuple)
    norm: str = "rms"  # "rms" (RMSNorm, no bias) | "layer" (LayerNorm with bias)
    rope: str | None = "normal"  # GGML rope mode: "normal" (interleaved pairs) | "neox" | None

    @property
    def gated(self) -> bool:
        return self.gate_attr is not None

    def active_mask(self, act: Activation, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """Which neurons fire. ``gate``/``up``: pre-activations ``[..., n_ff]``; returns bool ``[..., n_ff]``."""
        if self.ffn == "reglu":
            return act.fires(gate)
        if self.ffn == "dreglu":
            return act.fires(gate) & act.fires(up)
        if self.ffn == "relu":
            return act.fires(up)
        raise AssertionError(self.ffn)

    def combine(self, act: Activation, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """The FFN hidden activations ``h`` (``down(h)`` is the FFN output); shapes ``[..., n_ff]``."""
        if self.ffn == "reglu":
            return act.apply(gate) * up
        if self.ffn == "dreglu":
            return act.apply(gate) * act.apply(up)
        if self.ffn == "relu":
            return act.apply(up)
        raise AssertionError(self.ffn)

    def ffn_neuron_bytes(self, n_embd: int, bytes_per_weight: float) -> float:
        """Bytes one FFN neuron's rows occupy: gate + up + down rows (or up + down)."""
        return n_embd * bytes_per_weight * (3 if self.gated else 2)

    def map_tensor(self, hf_name: str) -> tuple[str, str | None] | None:
        for rule in self.tensor_rules:
            hit = rule.match(hf_name)
            if hit is not None:
                return hit
        return None

    def expected_gguf_tensors(self, n_layer: int, sparse: bool) -> list[str]:
        """The exact tensor-name set upstream's loader wants (FORMATS.md section 4)."""
        names = [f"{n}.weight" if "." not in n else n for n in self.gguf_global_tensors]
        for i in range(n_layer):
            for t in self.gguf_layer_tensors:
                names.append(f"blk.{i}.{t}")
            if self.gated:
                names.append(f"blk.{i}.ffn_gate.weight")
            names.append(f"blk.{i}.ffn_up.weight")
            if sparse:
                names += [f"blk.{i}.ffn_down_t.weight", f"blk.{i}.fc1.weight", f"blk.{i}.fc2.weight"]
            else:
                names.append(f"blk.{i}.ffn_down.weight")
        return names


_LLAMA_RULES = (
    TensorRule(r"model\.embed_tokens\.weight", "token_embd.weight"),
    TensorRule(r"model\.norm\.weight", "output_norm.weight"),
    TensorRule(r"lm_head\.weight", "output.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.input_layernorm\.weight", "blk.{bid}.attn_norm.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.self_attn\.q_proj\.weight", "blk.{bid}.attn_q.weight", "permute_q"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.self_attn\.k_proj\.weight", "blk.{bid}.attn_k.weight", "permute_k"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.self_attn\.v_proj\.weight", "blk.{bid}.attn_v.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.self_attn\.o_proj\.weight", "blk.{bid}.attn_output.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.post_attention_layernorm\.weight", "blk.{bid}.ffn_norm.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.mlp\.gate_proj\.weight", "blk.{bid}.ffn_gate.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.mlp\.up_proj\.weight", "blk.{bid}.ffn_up.weight"),
    TensorRule(r"model\.layers\.(?P<bid>\d+)\.mlp\.down_proj\.weight", "blk.{bid}.ffn_down.weight", "down"),
)
_LLAMA_LAYER = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "ffn_norm.weight",
)

RELU_LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_arch="llama",
    ffn="reglu",
    layers_attr="model.layers",
    gate_attr="mlp.gate_proj",
    up_attr="mlp.up_proj",
    down_attr="mlp.down_proj",
    predictor_input_attr="post_attention_layernorm",
    tensor_rules=_LLAMA_RULES,
    gguf_layer_tensors=_LLAMA_LAYER,
    gguf_global_tensors=("token_embd", "output_norm", "output"),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (RELU_LLAMA,)}

def register_family(family: Family) -> None:
    """Add a family (used by the family modules that extend this table)."""
    FAMILIES[family.name] = family


# --------------------------------------------------------------------------- config helpers
def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of a Hugging Face model folder.

    Raises PowerInferError naming the path if the folder or its config is missing
    or not valid JSON.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PowerInferError(f"{model_dir}: not a directory (expected a Hugging Face model folder)")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise PowerInferError(f"{model_dir}: no config.json, so this is not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PowerInferError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PowerInferError(f"{cfg_path}: expected a JSON object")
    return cfg


def family_for_config(cfg: dict[str, Any], source: str | Path = "config.json") -> Family:
    """Pick the family from a config's ``architectures`` (then ``model_type``).

    Raises PowerInferError naming the architecture when it is not supported.
    """
    archs = cfg.get("architectures") or []
    for arch in archs:
        for fam in FAMILIES.values():
            if arch in fam.hf_architectures:
                return fam
    if not archs:
        mt = cfg.get("model_type")
        for fam in FAMILIES.values():
            if mt in fam.hf_model_types:
                return fam
    name = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
    known = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise PowerInferError(f"{source}: architecture {name} is not supported (supported: {', '.join(known)})")


def family_for_gguf_arch(arch: str, source: str | Path = "GGUF") -> Family:
    for fam in FAMILIES.values():
        if fam.gguf_arch == arch:
            return fam
    raise PowerInferError(f"{source}: GGUF architecture {arch!r} is not supported")


def activation_from_config(cfg: dict[str, Any]) -> Activation:
    """The FFN activation a config declares (``hidden_act``/``activation_function``/``activation``)."""
    kind = cfg.get("hidden_act") or cfg.get("activation_function") or cfg.get("activation") or "silu"
    kind = str(kind).lower()
    if kind == "fatrelu":
        t = float(cfg.get("hidden_act_param", 0.0))
        if not math.isfinite(t):
            raise PowerInferError(f"hidden_act_param {t} is not finite")
        return Activation("fatrelu", t)
    if kind in SPARSE_ACTIVATIONS or kind in DENSE_ACTIVATIONS:
        return Activation(kind)
    raise PowerInferError(f"activation {kind!r} is not supported (known: relu, fatrelu, silu, gelu)")


def get_attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def model_layers(family: Family, model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(get_attr(model, family.layers_attr))


def hf_dims(cfg: dict[str, Any]) -> dict[str, int]:
    """n_embd, n_ff, n_layer, n_head, n_head_kv, n_ctx from a HF config (llama-style keys)."""
    g = cfg.get
    n_embd = g("hidden_size") or g("n_embd") or g("d_model")
    n_layer = g("num_hidden_layers") or g("n_layer")
    n_head = g("num_attention_heads") or g("n_head")
    n_head_kv = g("num_key_value_heads") or g("num_kv_heads") or g("n_head_kv") or n_head
    n_ff = g("intermediate_size") or g("ffn_dim") or g("ffn_hidden_size") or (4 * n_embd if n_embd else None)
    n_ctx = g("max_position_embeddings") or g("max_sequence_length") or 2048
    out = dict(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ctx=n_ctx)
    for k, v in out.items():
        if not isinstance(v, int) or v <= 0 or v > 1 << 20:
            raise PowerInferError(f"config: {k} = {v!r} is missing or out of range")
    return out

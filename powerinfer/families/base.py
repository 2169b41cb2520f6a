"""The family record and the helpers every family module and stage share.

A :class:`Family` is one declaration of an architecture's facts (FORMATS.md section 1
and 4): how its FFN combines gate/up, when a neuron is *active*, where the predictor
reads its input, the transformers module paths the profiler hooks, and how the HF
tensors become upstream PowerInfer's GGUF tensors. The family modules next to this one
(``llama``, ``llama3``, ``mistral``, ``qwen``, ``bamboo``, ``falcon``, ``opt``) each build one or
two records and register them; nothing else in the toolkit hard-codes an architecture name.

FFN kinds (``x`` is the FFN input after the norm, ``act`` the family activation):

* ``reglu``  : ``down(act(gate x) * up x)``; neuron i active iff ``act`` fires on ``gate_i x``
* ``dreglu`` : ``down(act(gate x) * act(up x))``; active iff it fires on both
* ``relu``   : ``down(act(up x))``; active iff it fires on ``up_i x``
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import PowerInferError

SPARSE_ACTIVATIONS = ("relu", "fatrelu")
DENSE_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")


# --------------------------------------------------------------------------- activation
@dataclass(frozen=True)
class Activation:
    """An FFN activation function and its "neuron is active" rule.

    ``relu``: ``relu(v)``, active when ``v > 0``. ``fatrelu`` (ProSparse): ``v`` if
    ``v >= threshold`` else 0, active when ``v >= threshold``. Dense activations
    (``silu``, ``gelu``) have no active rule: every neuron always contributes.

    ``origin`` says what decided the activation (``config.json hidden_act``, the model's
    modelling file read as text, ``--ffn-activation``, the family default) and ``note``
    what a refusal of a dense activation should add (how to state a ReLU model); neither
    takes part in comparisons. See :mod:`powerinfer.families.activation_source`.
    """

    kind: str
    threshold: float = 0.0
    origin: str = field(default="", compare=False)
    note: str = field(default="", compare=False)

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


# --------------------------------------------------------------------------- tensor rules
@dataclass(frozen=True)
class TensorRule:
    """Maps Hugging Face tensor names to one GGUF name and a transform applied on the way.

    ``hf`` is a regex matched against the whole name; its named groups fill the
    ``gguf`` template (``(?P<bid>\\d+)`` the layer, ``(?P<wb>weight|bias)`` the
    suffix). ``gguf=None`` drops the tensor on purpose (a tied copy upstream does
    not store). Transforms (applied by the converter): ``permute_q``/``permute_k``
    (HF rotate-half rows -> GGML interleaved RoPE rows), ``down`` (transposed to
    ``ffn_down_t`` in PowerInfer files), ``qkv_jploski`` (Falcon's fused QKV regrouped
    as all Q heads, then all K, then all V).
    """

    hf: str
    gguf: str | None
    transform: str | None = None

    def match(self, name: str) -> tuple[str | None, str | None] | None:
        m = re.fullmatch(self.hf, name)
        if m is None:
            return None
        if self.gguf is None:
            return None, None
        return self.gguf.format(**{k: v for k, v in m.groupdict().items() if v is not None}), self.transform


def weight_and_bias(hf_prefix: str, gguf_prefix: str, transform: str | None = None) -> TensorRule:
    """One rule for ``{hf_prefix}.weight``/``.bias`` -> ``{gguf_prefix}.weight``/``.bias``."""
    return TensorRule(hf_prefix + r"\.(?P<wb>weight|bias)", gguf_prefix + ".{wb}", transform)


# --------------------------------------------------------------------------- family
ConfigAdapter = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """Architecture facts shared by every stage.

    Attribute paths are dotted paths into the transformers module tree:
    ``layers_attr`` from the ``*ForCausalLM`` object to the decoder-layer list;
    ``gate_attr``/``up_attr``/``down_attr`` and ``predictor_input_attr`` from one
    decoder layer. ``predictor_input_attr`` names the module whose *input* is the
    predictor input (None: the decoder layer's own input, as for Falcon).

    GGUF side: ``gguf_arch`` is upstream's architecture name; ``gguf_global_tensors``
    and ``gguf_layer_tensors`` list the non-FFN tensors upstream's loader requires
    (a bare name means ``.weight``), the FFN/predictor tensors follow from ``ffn`` and
    ``ffn_bias`` (see :meth:`expected_gguf_tensors`).

    Runtime side: ``norm`` (``rms``: RMSNorm without bias, ``layer``: LayerNorm with
    bias), ``rope`` (GGML mode ``normal`` = interleaved pairs, ``neox`` = rotate-half,
    None = learned positions), ``parallel_attn`` (attention and FFN both read the layer
    input, Falcon), ``learned_pos_offset`` (row of ``position_embd`` that holds
    position 0: OPT stores two unused rows first), ``qk_norm`` (every layer has
    ``attn_q_norm``/``attn_k_norm`` ``[head_dim]``: RMSNorm of each Q and K head before
    RoPE, Qwen3), ``dense_gguf_activation`` (what a dense GGUF of this architecture without
    ``powerinfer.activation`` runs: SiLU for llama.cpp's ``llama``/``qwen2``/``qwen3`` files,
    ReLU for upstream PowerInfer's ``bamboo``/``falcon``/``opt``; sparse files are ReLU).

    Writer side: ``output_optional`` True means a tied checkpoint (no ``lm_head``) gets no
    ``output.weight``, as llama.cpp's converter writes it (its loaders reuse
    ``token_embd``); False writes a copy of the embedding (upstream PowerInfer's loaders
    require the tensor).

    Config side: ``activation_keys`` are the config keys naming the FFN activation
    (first present wins) and ``default_activation`` is what transformers uses when
    none is given. ``adapt_config`` turns a raw ``config.json`` dict into the dict the
    family's transformers config class accepts (legacy Falcon keys, refusals of
    layouts we cannot run); ``specialize`` returns the variant of the family a config
    needs (e.g. one-layernorm Falcon); ``gguf_kv`` gives extra GGUF metadata.

    Mixture of experts (:mod:`.experts`): ``experts`` True means every layer's FFN is a
    router ``ffn_gate_inp`` and 3-D expert tensors ``ffn_{gate,up,down}_exps`` (llama.cpp's
    names; the runtime's :mod:`powerinfer.runtime.moe`); ``checkpoint_ffn(cfg, layer)`` gives
    the published checkpoint's FFN tensor names and shapes of one layer (transformers 5 builds
    fused expert parameters on the meta device, so the config check compares these instead);
    ``checkpoint_tensors(cfg)``: every checkpoint tensor and shape, for a family transformers has no
    class for (SmallThinker), which the config check then compares instead of a meta-device model.
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
    gguf_layer_tensors: tuple[str, ...] = field(default_factory=tuple)
    gguf_global_tensors: tuple[str, ...] = field(default_factory=tuple)
    norm: str = "rms"
    rope: str | None = "normal"
    parallel_attn: bool = False
    ffn_bias: bool = False
    learned_pos_offset: int = 0
    qk_norm: bool = False
    dense_gguf_activation: str = "relu"
    output_optional: bool = False
    activation_keys: tuple[str, ...] = ("hidden_act",)
    default_activation: str = "silu"
    adapt_config: ConfigAdapter | None = None
    specialize: Callable[["Family", dict[str, Any]], "Family"] | None = None
    gguf_kv: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    experts: bool = False
    checkpoint_ffn: Callable[[dict[str, Any], int], dict[str, tuple[int, ...]]] | None = None
    checkpoint_tensors: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]] | None = None

    @property
    def gated(self) -> bool:
        return self.gate_attr is not None

    def replace(self, **changes: Any) -> "Family":
        return dataclasses.replace(self, **changes)

    def for_config(self, cfg: dict[str, Any]) -> "Family":
        """The variant of this family that ``cfg`` (an adapted config) needs."""
        return self.specialize(self, cfg) if self.specialize is not None else self

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

    def map_tensor(self, hf_name: str) -> tuple[str | None, str | None] | None:
        """``(gguf_name, transform)`` for an HF tensor; ``(None, None)`` = drop it; None = unknown."""
        for rule in self.tensor_rules:
            hit = rule.match(hf_name)
            if hit is not None:
                return hit
        return None

    def expected_gguf_tensors(self, n_layer: int, sparse: bool) -> list[str]:
        """The exact tensor-name set upstream's loader wants (FORMATS.md section 4), in file order."""
        names = [n if "." in n else f"{n}.weight" for n in self.gguf_global_tensors]
        parts = ("weight", "bias") if self.ffn_bias else ("weight",)
        for i in range(n_layer):
            names += [f"blk.{i}.{t}" if "." in t else f"blk.{i}.{t}.weight" for t in self.gguf_layer_tensors]
            ffn = (["ffn_gate"] if self.gated else []) + ["ffn_up", "ffn_down_t" if sparse else "ffn_down"]
            if self.experts:  # llama.cpp's order: router, then the stacked experts
                ffn = ["ffn_gate_inp", "ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"]
            names += [f"blk.{i}.{t}.{p}" for t in ffn for p in parts]
            if sparse:
                names += [f"blk.{i}.fc1.weight", f"blk.{i}.fc2.weight"]
        return names


# --------------------------------------------------------------------------- registry
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family to the table (the family modules call this on import)."""
    FAMILIES[family.name] = family
    return family


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of a Hugging Face model folder.

    Raises PowerInferError naming the path if the folder or its config is missing
    or not valid JSON.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PowerInferError(f"{model_dir}: not a folder (expected a Hugging Face model folder)" if model_dir.exists()
                              else f"{model_dir}: model folder not found")
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

    Matching is exact: ``RWForCausalLM`` is Falcon, never Llama. Raises
    PowerInferError naming the architecture when it is not supported.
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
    name = ", ".join(map(str, archs)) if archs else f"model_type {cfg.get('model_type')!r}"
    known = sorted({a for f in FAMILIES.values() for a in f.hf_architectures})
    raise PowerInferError(f"{source}: architecture {name} is not supported (supported: {', '.join(known)})")


def family_for_gguf_arch(arch: str, source: str | Path = "GGUF") -> Family:
    """The family that reads GGUF architecture ``arch`` (first registered wins: ``llama`` is ReLU-Llama)."""
    for fam in FAMILIES.values():
        if fam.gguf_arch == arch:
            return fam
    raise PowerInferError(f"{source}: GGUF architecture {arch!r} is not supported")


def adapt_config(family: Family, cfg: dict[str, Any], source: str | Path = "config.json") -> dict[str, Any]:
    """``cfg`` in the form the family's transformers config class takes (a new dict)."""
    return family.adapt_config(dict(cfg), str(source)) if family.adapt_config is not None else dict(cfg)


def activation_from_config(cfg: dict[str, Any], family: Family | None = None) -> Activation:
    """The FFN activation a config declares.

    Reads the family's ``activation_keys`` (``hidden_act`` for Llama/Mistral,
    ``activation`` for Falcon, ``activation_function`` for OPT); without a family any
    of them. A config that names none gets the family's transformers default (SiLU
    for Llama, GELU for Falcon, ReLU for OPT), so a Falcon config is ReLU only when
    it says so. ``fatrelu`` reads its threshold from ``hidden_act_param``. Raises
    PowerInferError for unknown activations or a non-finite threshold.
    """
    keys = family.activation_keys if family else ("hidden_act", "activation_function", "activation")
    kind = next((cfg[k] for k in keys if cfg.get(k)), family.default_activation if family else "silu")
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


def rope_theta(cfg: dict[str, Any], default: float = 10000.0) -> float:
    """RoPE base from ``rope_theta`` or transformers 5's ``rope_parameters`` (default 10000)."""
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None) or default)


def hf_dims(cfg: dict[str, Any]) -> dict[str, int]:
    """n_embd, n_ff, n_layer, n_head, n_head_kv, n_ctx, head_dim from an (adapted) HF config.

    Knows the Llama/Mistral (``num_key_value_heads``), Falcon (``num_kv_heads``,
    ``ffn_hidden_size``) and OPT (``ffn_dim``) key names. ``head_dim`` is the config's own
    (Qwen3, Mistral-Nemo: not ``n_embd / n_head``) or ``n_embd / n_head``, which must then
    divide. Raises PowerInferError for a missing or out-of-range dimension.
    """
    g = cfg.get
    n_embd = g("hidden_size") or g("n_embd") or g("d_model")
    n_layer = g("num_hidden_layers") or g("n_layer")
    n_head = g("num_attention_heads") or g("n_head")
    n_head_kv = g("num_key_value_heads") or g("num_kv_heads") or g("n_head_kv") or n_head
    n_ff = g("intermediate_size") or g("ffn_dim") or g("ffn_hidden_size") or (4 * n_embd if isinstance(n_embd, int) else None)
    n_ctx = g("max_position_embeddings") or g("max_sequence_length") or 2048
    explicit = g("head_dim")
    out = dict(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ctx=n_ctx)
    if explicit is not None:
        out["head_dim"] = explicit
    for k, v in out.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > 1 << 20:
            raise PowerInferError(f"config: {k} = {v!r} is missing or out of range")
    if (explicit is None and n_embd % n_head) or n_head % n_head_kv or out.get("head_dim", 2) % 2:
        raise PowerInferError(f"config: n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv}"
                              f"{f', head_dim {explicit}' if explicit is not None else ''} are inconsistent")
    out.setdefault("head_dim", n_embd // n_head)
    return out

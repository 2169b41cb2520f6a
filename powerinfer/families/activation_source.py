"""Which FFN activation a model folder runs, and how that was decided.

Most configs name their activation (``hidden_act``, ``activation``, ``activation_function``).
Some published checkpoints do not: ReluFalcon-40B ships a legacy ``RWForCausalLM`` config with
no ``activation`` key and its own ``modelling_RW.py``, in which the MLP builds ``nn.ReLU()``;
transformers' ``FalconConfig`` would default to GELU. The order here:

1. the config's activation key, when present (what transformers runs with our classes);
2. otherwise the model's own modelling code, **read as text and parsed, never imported or
   run**: the files named by ``auto_map`` and any ``modeling_*.py`` / ``modelling_*.py`` in the
   folder; in the class that owns the family's up projection (``dense_h_to_4h`` for Falcon),
   the activation modules or functions it uses (``nn.ReLU``, ``F.relu``, ``nn.GELU``, ...,
   ``ACT2FN["relu"]``). One kind found is an answer; none or several is not;
3. otherwise the family's transformers default (GELU for Falcon, SiLU for Llama).

The stages' ``--ffn-activation relu`` option (:func:`ffn_activation_override`) states the
activation when neither 1 nor 2 does; it is refused when the config or the code says another
one. The result is an :class:`~powerinfer.families.base.Activation` whose ``origin`` says
which of these decided (the stages record it in their outputs) and whose ``note`` tells,
for a defaulted dense activation, both ways to state a ReLU model.
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator

from ..errors import PowerInferError
from .base import DENSE_ACTIVATIONS, SPARSE_ACTIVATIONS, Activation, Family, activation_from_config

__all__ = ["ACTIVATION_CHOICES", "ffn_activation_override", "code_activation", "resolve_activation"]

#: What ``--ffn-activation`` accepts (FATReLU needs a threshold only a config can give).
ACTIVATION_CHOICES = ("relu",)
MAX_CODE_BYTES = 4 << 20  # a modelling file larger than this is not read
MAX_CODE_FILES = 16

_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("ffn_activation", default=None)

# names of activation modules / functions in modelling code -> our kind
_CODE_NAMES = {
    "relu": "relu", "ReLU": "relu",
    "gelu": "gelu", "GELU": "gelu", "GELUActivation": "gelu",
    "gelu_new": "gelu_new", "NewGELUActivation": "gelu_new",
    "silu": "silu", "SiLU": "silu", "SiLUActivation": "silu", "swish": "silu",
}


@contextlib.contextmanager
def ffn_activation_override(kind: str | None) -> Iterator[None]:
    """Within the block, models whose config names no activation run ``kind`` (``--ffn-activation``).

    ``kind``: one of :data:`ACTIVATION_CHOICES`, or None (no override). Raises
    PowerInferError for any other value.
    """
    if kind is not None and kind not in ACTIVATION_CHOICES:
        raise PowerInferError(f"--ffn-activation {kind!r}: expected one of {', '.join(ACTIVATION_CHOICES)}")
    token = _OVERRIDE.set(kind)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def _code_files(model_dir: Path, raw_cfg: dict[str, Any]) -> list[Path]:
    names: list[str] = []
    auto_map = raw_cfg.get("auto_map")
    if isinstance(auto_map, dict):
        for ref in auto_map.values():
            ref = ref[0] if isinstance(ref, list) and ref else ref
            if isinstance(ref, str) and "--" not in ref and "." in ref:  # "repo--module.Class" is another repo
                names.append(ref.rsplit(".", 1)[0] + ".py")
    names += sorted(p.name for p in model_dir.glob("model*ing_*.py"))
    out: list[Path] = []
    for n in dict.fromkeys(names):
        p = model_dir / n
        if "/" not in n and p.is_file() and p not in out:
            out.append(p)
    return out[:MAX_CODE_FILES]


def _kinds_in(node: ast.AST) -> set[str]:
    """Activation kinds a class body uses: called names/attributes, ``ACT2FN["..."]`` lookups."""
    kinds: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _CODE_NAMES:
                kinds.add(_CODE_NAMES[name])
        elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "ACT2FN" \
                and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            k = n.slice.value.lower()
            kinds.add(_CODE_NAMES.get(k, k))
    return kinds


def code_activation(model_dir: str | Path, family: Family, raw_cfg: dict[str, Any]) -> tuple[str | None, str]:
    """The FFN activation the model's own modelling code uses, read as text (never executed).

    Returns ``(kind, what)``: ``kind`` is ``relu``/``gelu``/``silu``/... or None when no file
    says one thing; ``what`` describes what was read (for messages). Files that cannot be
    read or parsed, or are over :data:`MAX_CODE_BYTES`, are skipped.
    """
    model_dir = Path(model_dir)
    up = family.up_attr.rsplit(".", 1)[-1]
    found: dict[str, set[str]] = {}
    read: list[str] = []
    for p in _code_files(model_dir, raw_cfg):
        try:
            if p.stat().st_size > MAX_CODE_BYTES:
                continue
            tree = ast.parse(p.read_bytes().decode("utf-8"), filename=str(p))  # parsing runs nothing
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            continue
        read.append(p.name)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            owns_up = any(isinstance(t, ast.Attribute) and t.attr == up
                          for a in ast.walk(cls) if isinstance(a, (ast.Assign, ast.AnnAssign))
                          for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))
            if owns_up:
                kinds = _kinds_in(cls)
                if kinds:
                    found.setdefault(p.name, set()).update(kinds)
    if not read:
        return None, "there is no modelling .py file beside it"
    kinds = set().union(*found.values()) if found else set()
    if len(kinds) == 1:
        (kind,) = kinds
        return kind, f"{', '.join(sorted(found))} (read as text, not run) uses {kind} in its MLP"
    if kinds:
        return None, f"{', '.join(read)} (read as text) uses several activations ({', '.join(sorted(kinds))})"
    return None, f"{', '.join(read)} (read as text) names no activation in the class holding {up}"


def _to_activation(kind: str, origin: str, note: str = "") -> Activation:
    if kind not in SPARSE_ACTIVATIONS and kind not in DENSE_ACTIVATIONS:
        raise PowerInferError(f"{origin}: activation {kind!r} is not supported (known: relu, fatrelu, silu, gelu)")
    return Activation(kind, origin=origin, note=note)


def resolve_activation(model_dir: str | Path, family: Family, raw_cfg: dict[str, Any],
                       cfg: dict[str, Any]) -> tuple[Activation, dict[str, Any]]:
    """The FFN activation of a model folder (see the module docstring) and ``cfg`` with it stated.

    ``raw_cfg``: ``config.json`` as read; ``cfg``: the family-adapted dict. When the code or
    ``--ffn-activation`` decided, the returned config copy carries the kind under the family's
    activation key, so the transformers model built from it runs that activation. Raises
    PowerInferError naming ``config.json`` (and the code file) when the option contradicts
    the config or the code, or for an unsupported activation.
    """
    src = Path(model_dir) / "config.json"
    override = _OVERRIDE.get()
    key = next((k for k in family.activation_keys if cfg.get(k)), None)
    if key is not None:
        try:
            act = activation_from_config(cfg, family)
        except PowerInferError as e:
            raise PowerInferError(f"{src}: {e}") from None
        if override is not None and act.kind != override:
            raise PowerInferError(f"{src}: {key} is {act.kind!r}, but --ffn-activation says {override!r}; the "
                                  "option is only for configs that name no activation (drop it, or fix the config)")
        return Activation(act.kind, act.threshold, origin=f"config.json {key}"), cfg
    code_kind, code_what = code_activation(model_dir, family, raw_cfg)
    if override is not None:
        if code_kind is not None and code_kind != override:
            raise PowerInferError(f"{src}: --ffn-activation {override!r}, but {code_what}; check which one the "
                                  "checkpoint was trained with")
        act = _to_activation(override, f"--ffn-activation {override}")
    elif code_kind is not None:
        act = _to_activation(code_kind, f"{src.parent.name}/{code_what}")
    else:
        kind = family.default_activation
        note = ""
        if kind not in SPARSE_ACTIVATIONS:
            note = (f"; config.json has no {'/'.join(family.activation_keys)} key and {code_what}, "
                    f"so the {family.name} default {kind!r} applies. If this model's FFN is ReLU (ReluFalcon-40B's "
                    f"ReLU lives in its modelling_RW.py), either put that modelling file beside config.json (it is "
                    f"read as text, never run) or pass --ffn-activation relu to every stage")
        return _to_activation(kind, f"{family.name} default (config.json names none)", note), cfg
    stated = dict(cfg)
    stated[family.activation_keys[0]] = act.kind
    return act, stated


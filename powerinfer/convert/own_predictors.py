"""Predictors a checkpoint carries itself (TurboSparse-Mistral), checked from the shard headers.

TurboSparse-Mistral's published checkpoint (``PowerInfer/TurboSparse-Mistral-Instruct``)
holds one predictor per layer beside the FFN: ``model.layers.N.mlp.predictor.fc1.weight``
``[H_N, n_embd]`` and ``fc2.weight`` ``[n_ff, H_N]``, bf16, no biases. Its modelling code
computes ``fc2(relu(fc1 x))`` on the residual before ``post_attention_layernorm`` and keeps
neuron j where ``round(sigmoid(logit_j))`` is 1, i.e. ``logit_j > 0``. That is PowerInfer's
predictor (FORMATS.md section 3) with threshold 0, so ``pi-convert`` writes the two matrices
as ``blk.N.fc1.weight`` / ``blk.N.fc2.weight`` unchanged (torch order ``[rows, cols]``; GGUF
stores the dimensions reversed), with ``powerinfer.sparse_threshold`` 0, and no predictor
folder is needed. The one difference is a logit of exactly 0: TurboSparse drops that neuron
(``round(0.5)`` is 0), PowerInfer computes it (``logit >= threshold``).

A family declares where its checkpoints keep predictors with tensor rules whose transform is
:data:`PREDICTOR` (:mod:`powerinfer.families.bamboo`). :func:`find_own_predictors` checks
names and shapes from the headers alone, before a weight is read or a file created; every
complaint is one line naming the shard and the tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PowerInferError
from ..families import Family
from ..formats.predictor import MAX_HIDDEN
from .hf_tensors import HFTensors

PREDICTOR = "predictor"  # the TensorRule transform of a predictor matrix the checkpoint carries
THRESHOLD = 0.0  # TurboSparse keeps neuron j where sigmoid(logit_j) rounds to 1: logit_j > 0
_PART = re.compile(r"blk\.(\d+)\.(fc1|fc2)\.weight")


@dataclass(frozen=True)
class OwnPredictors:
    """The predictor matrices of a checkpoint: HF name -> GGUF name, and ``H`` of each layer."""

    names: dict[str, str]
    hidden: tuple[int, ...]

    def load(self, tensors: HFTensors, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored; PowerInferError naming it when it is not finite floats."""
        t = tensors.get(name)
        if not t.is_floating_point():
            raise PowerInferError(f"{tensors.file(name)}: tensor {name!r} holds "
                                  f"{str(t.dtype).removeprefix('torch.')}, a predictor needs floats")
        if not bool(torch.isfinite(t).all()):
            raise PowerInferError(f"{tensors.file(name)}: tensor {name!r} holds NaN or infinite values")
        return t


def _predictor_rules(family: Family) -> bool:
    return any(rule.transform == PREDICTOR for rule in family.tensor_rules)


def find_own_predictors(family: Family, tensors: HFTensors, n_layer: int, n_embd: int,
                        n_ff: int) -> OwnPredictors | None:
    """The checkpoint's own predictors, or None when it carries none.

    Checked from names and shapes (no weights read): every layer ``0..n_layer-1`` has both
    ``fc1`` ``[H, n_embd]`` and ``fc2`` ``[n_ff, H]`` with the same ``0 < H <= MAX_HIDDEN``, no
    layer beyond, and no other tensor under a ``predictor`` module (biases: PowerInfer's
    predictor has none). Raises PowerInferError naming the shard and tensor otherwise.
    """
    if not _predictor_rules(family):
        return None
    parts: dict[int, dict[str, str]] = {}
    names: dict[str, str] = {}
    for name in tensors.names():
        hit = family.map_tensor(name)
        if hit is None or hit[1] != PREDICTOR:
            if ".predictor." in name and hit is None:
                raise PowerInferError(f"{tensors.file(name)}: tensor {name!r} is not a predictor matrix PowerInfer's "
                                      "file holds (fc1.weight and fc2.weight per layer, no biases)")
            continue
        gname = hit[0]
        m = _PART.fullmatch(gname or "")
        if m is None:  # a family rule that maps a predictor elsewhere: a bug in the family table
            raise AssertionError(f"{family.name}: predictor rule gave {gname!r}")
        layer, part = int(m.group(1)), m.group(2)
        if layer >= n_layer:
            raise PowerInferError(f"{tensors.file(name)}: tensor {name!r} is a predictor for layer {layer}, but "
                                  f"the model has {n_layer} layers")
        parts.setdefault(layer, {})[part] = name
        names[name] = gname
    if not names:
        return None
    hidden = []
    for i in range(n_layer):
        have = parts.get(i, {})
        for part in ("fc1", "fc2"):
            if part not in have:
                k, other = next((k, p[part]) for k, p in sorted(parts.items()) if part in p)
                missing = other.replace(f".{k}.", f".{i}.", 1)
                raise PowerInferError(f"{tensors.model_dir}: the checkpoint has no tensor {missing!r}, but carries "
                                      f"predictors for other layers ({other!r}): every layer needs fc1 and fc2")
        fc1, fc2 = have["fc1"], have["fc2"]
        s1, s2 = tensors.shape(fc1), tensors.shape(fc2)
        if len(s1) != 2 or s1[1] != n_embd or not 0 < s1[0] <= MAX_HIDDEN:
            raise PowerInferError(f"{tensors.file(fc1)}: tensor {fc1!r} has shape {list(s1)}; a predictor's fc1 "
                                  f"is [H, n_embd={n_embd}] with 0 < H <= {MAX_HIDDEN}")
        if tuple(s2) != (n_ff, s1[0]):
            raise PowerInferError(f"{tensors.file(fc2)}: tensor {fc2!r} has shape {list(s2)}; a predictor's fc2 "
                                  f"is [n_ff={n_ff}, H={s1[0]}] (H from {fc1!r})")
        hidden.append(int(s1[0]))
    return OwnPredictors(names, tuple(hidden))


def has_own_predictors(model_dir: str | Path, family: Family) -> bool:
    """Whether ``model_dir``'s checkpoint names any predictor matrix of ``family`` (names only)."""
    if not _predictor_rules(family):
        return False
    tensors = HFTensors(model_dir)
    return any((hit := family.map_tensor(n)) is not None and hit[1] == PREDICTOR for n in tensors.names())

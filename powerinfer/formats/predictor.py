"""Predictor folders: ``model_{i}.pt`` per layer plus ``config.json`` (FORMATS.md section 3).

Each ``model_{i}.pt`` is a ``torch.save``d state dict with exactly ``fc1.weight``
``[H_i, n_embd]`` and ``fc2.weight`` ``[n_ff, H_i]`` (no biases). The predictor is
``logits = fc2(relu(fc1(x)))`` and neuron j is predicted active when
``logits_j >= sparse_threshold``. Layers are found by the number in the file name:
a missing ``model_5.pt`` is an error (upstream silently dropped every later
layer) and unrelated ``.pt`` files are ignored (upstream counted them).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import PowerInferError
from ._atomic import atomic_dir
from .activation import check_layers, layer_files, torch_load

CONFIG_FILE = "config.json"
_NAME = re.compile(r"model_(\d+)\.pt")
OWNED = r"model_\d+\.pt|config\.json|\.gitkeep"  # what a predictor folder may hold
MAX_HIDDEN = 1 << 16


@dataclass
class LayerPredictor:
    """One layer's predictor weights (fp32 on CPU)."""

    fc1: torch.Tensor  # [H, n_embd]
    fc2: torch.Tensor  # [n_ff, H]

    @property
    def hidden(self) -> int:
        return self.fc1.shape[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., n_embd]`` -> ``[..., n_ff]`` logits."""
        return torch.relu(x @ self.fc1.T) @ self.fc2.T


def save_predictor_dir(out_dir: str | Path, layers: Sequence[LayerPredictor], config: dict[str, Any]) -> Path:
    """Write ``model_{i}.pt`` and ``config.json`` atomically (``config`` must hold sparse_threshold)."""
    with atomic_dir(out_dir, OWNED) as tmp:
        for i, lp in enumerate(layers):
            sd = {"fc1.weight": lp.fc1.detach().float().cpu().contiguous().clone(),
                  "fc2.weight": lp.fc2.detach().float().cpu().contiguous().clone()}
            torch.save(sd, tmp / f"model_{i}.pt")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


from ..limits import MAX_THRESHOLD as MAX_ABS_THRESHOLD  # noqa: E402  beyond it every neuron (or none) is active


def check_sparse_threshold(t: Any, where: str) -> float:
    """``t`` as the float sparse_threshold, or PowerInferError naming ``where``.

    A number (not a bool: JSON ``true`` is not 1.0), finite, with ``|t| <= MAX_ABS_THRESHOLD``:
    predictor logits are O(10), so a threshold of 1e30 computes no neuron at all (and 1e300
    cannot even be stored as the GGUF's float32).
    """
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise PowerInferError(f"{where}: sparse_threshold must be a number, got {t!r}")
    if not math.isfinite(t) or abs(t) > MAX_ABS_THRESHOLD:
        raise PowerInferError(f"{where}: sparse_threshold {t!r} must be a finite number within "
                              f"+-{MAX_ABS_THRESHOLD:g}")
    return float(t)


def read_predictor_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a predictor folder ({} when absent); its ``sparse_threshold`` checked by
    :func:`check_sparse_threshold`. Raises PowerInferError naming the file."""
    from ._json import read_json_object

    p = Path(folder) / CONFIG_FILE
    if not p.exists():
        return {}
    cfg = read_json_object(p)
    if "sparse_threshold" in cfg:
        check_sparse_threshold(cfg["sparse_threshold"], str(p))
    return cfg


def _check_tensor(t: Any, p: Path, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PowerInferError(f"{p}: {name} must be a tensor, found a {type(t).__name__}")
    if t.dim() != 2:
        raise PowerInferError(f"{p}: {name} must be 2-D, has shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise PowerInferError(f"{p}: {name} holds {str(t.dtype).removeprefix('torch.')}, expected floats")
    t = t.float()
    if not bool(torch.isfinite(t).all()):
        raise PowerInferError(f"{p}: {name} holds NaN or infinite values")
    return t


def load_predictor_dir(folder: str | Path, n_layer: int, n_embd: int, n_ff: int) -> list[LayerPredictor]:
    """Read and check every layer's predictor for a model of the given dimensions.

    Raises PowerInferError naming the file for a missing layer, an unreadable
    file, missing/extra entries, biases, entries that are not 2-D floating-point tensors,
    NaN/inf weights, or shapes that do not match the model.
    """
    folder = Path(folder)
    found = layer_files(folder, _NAME, "predictor")
    check_layers(found, folder, "model_{i}.pt", n_layer, "predictor")
    out = []
    for i in range(n_layer):
        p = found[i]
        sd = torch_load(p)
        if not isinstance(sd, dict) or set(sd) != {"fc1.weight", "fc2.weight"}:
            keys = sorted(map(str, sd)) if isinstance(sd, dict) else f"a {type(sd).__name__}"
            raise PowerInferError(f"{p}: expected exactly fc1.weight and fc2.weight, found {keys}")
        fc1, fc2 = (_check_tensor(sd[k], p, k) for k in ("fc1.weight", "fc2.weight"))
        h = fc1.shape[0]
        if not (0 < h <= MAX_HIDDEN) or tuple(fc1.shape) != (h, n_embd) or tuple(fc2.shape) != (n_ff, h):
            raise PowerInferError(
                f"{p}: predictor shapes fc1 {tuple(fc1.shape)}, fc2 {tuple(fc2.shape)} do not match the model "
                f"(expected fc1 [H, n_embd={n_embd}], fc2 [n_ff={n_ff}, H])")
        out.append(LayerPredictor(fc1, fc2))
    return out

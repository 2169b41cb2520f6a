"""Activation statistics folders: ``activation_{i}.pt`` per layer (FORMATS.md section 2).

Each file holds a 1-D tensor of length ``n_ff``: how many calibration tokens
activated each neuron of layer ``i``. We write int64 counts and accept any real
dtype when reading. Layers are found by the number in the file name, never by
sorting names as strings (upstream's exporter put ``activation_10`` before
``activation_2``) and never by counting files, so a README or ``.gitkeep`` beside
them is harmless. Our own metadata goes in ``powerinfer_stats.json``, which
upstream readers (globbing ``activation_*.pt``) ignore, as they ignore the
``report.png`` that ``pi-profile`` draws beside them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import PowerInferError
from ..limits import MAX_LAYERS
from ._atomic import atomic_dir

STATS_FILE = "powerinfer_stats.json"
_NAME = re.compile(r"activation_(\d+)\.pt")
OWNED = r"activation_\d+\.pt|powerinfer_stats\.json|report\.png|\.gitkeep"  # what an activation folder may hold
MAX_N_FF = 1 << 22


def save_activation_dir(out_dir: str | Path, counts: Sequence[torch.Tensor], stats: dict[str, Any] | None = None) -> Path:
    """Write per-layer counts (each 1-D, length n_ff) and an optional stats dict, atomically."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, OWNED) as tmp:
        for i, c in enumerate(counts):
            if c.dim() != 1:
                raise ValueError(f"layer {i}: counts must be 1-D, got shape {tuple(c.shape)}")
            torch.save(c.detach().to(torch.int64).cpu().clone(), tmp / f"activation_{i}.pt")
        if stats is not None:
            (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return out_dir


def layer_files(folder: str | Path, pattern: re.Pattern[str], what: str) -> dict[int, Path]:
    """Map layer number -> file for names matching ``pattern`` (group 1 = layer).

    Only the exact name counts (``model_1.pt``, never ``model_01.pt``); a folder holding both
    spellings of one layer is ambiguous and refused (PowerInferError naming both files), and a
    lone zero-padded name is named in the "missing layer" error of :func:`check_layers`.
    """
    folder = Path(folder)
    if not folder.is_dir():
        from ._atomic import recover

        recover(folder)  # a folder swap killed halfway is finished (or undone) first
    if not folder.is_dir():
        raise PowerInferError(f"{folder}: {what} folder not found")
    found: dict[int, Path] = {}
    padded: dict[int, Path] = {}
    for p in sorted(folder.iterdir()):
        m = pattern.fullmatch(p.name)
        if m and p.is_file():
            i = int(m.group(1))
            if i >= MAX_LAYERS:
                raise PowerInferError(f"{p}: layer number {i} is out of range")
            if m.group(1) != str(i):
                padded.setdefault(i, p)
            else:
                found[i] = p
    for i, p in sorted(padded.items()):
        if i in found:
            raise PowerInferError(f"{folder}: both {found[i].name} and {p.name} are there for layer {i}; "
                                  f"remove one (layer files are named without leading zeros)")
    return found


def check_layers(found: dict[int, Path], folder: Path, template: str, n_layer: int | None, what: str) -> int:
    """Layers must be exactly 0..L-1 (L = n_layer if given). Returns L."""
    if not found:
        raise PowerInferError(f"{folder}: no {template.format(i='{i}')} files in this {what} folder")
    L = n_layer if n_layer is not None else max(found) + 1
    missing = [i for i in range(L) if i not in found]
    if missing:
        names = ", ".join(template.format(i=i) for i in missing[:5])
        head, tail = template.split("{i}")
        padded = [p for i in missing[:5] for p in sorted(folder.glob(f"{head}0*{i}{tail}"))
                  if re.fullmatch(re.escape(head) + f"0+{i}" + re.escape(tail), p.name)]
        note = "".join(f"; {p.name} is not read (layer files are named without leading zeros)" for p in padded)
        raise PowerInferError(f"{folder}: missing layer file(s) {names} ({what} folder must hold layers 0..{L - 1})"
                              f"{note}")
    extra = sorted(i for i in found if i >= L)
    if extra:
        raise PowerInferError(f"{folder}: has {template.format(i=extra[0])} but the model has only {L} layers")
    return L


def torch_load(p: Path):
    """``torch.load(p, weights_only=True)``: tensors and plain containers only, never pickled code.

    Raises PowerInferError naming the file when it is not a readable torch file or holds
    anything but tensors and plain containers.
    """
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Weights only" in first:
            first = "it holds objects other than tensors, refused for safety"
        raise PowerInferError(f"{p}: not a readable torch tensor file ({first})") from None


def load_activation_dir(folder: str | Path, n_layer: int | None = None, n_ff: int | None = None) -> list[torch.Tensor]:
    """Read ``activation_{i}.pt`` for i = 0..L-1 as float64 tensors of length n_ff.

    Raises PowerInferError naming the file for: a missing folder or layer, a file
    that is not a torch tensor, a tensor that is not 1-D and real, negative or
    non-finite counts, or lengths that differ between layers or from ``n_ff``.
    """
    folder = Path(folder)
    found = layer_files(folder, _NAME, "activation")
    L = check_layers(found, folder, "activation_{i}.pt", n_layer, "activation")
    out: list[torch.Tensor] = []
    for i in range(L):
        p = found[i]
        t = torch_load(p)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_complex() or t.dtype == torch.bool:
            raise PowerInferError(f"{p}: expected a 1-D tensor of activation counts")
        if t.numel() == 0 or t.numel() > MAX_N_FF:
            raise PowerInferError(f"{p}: length {t.numel()} is out of range")
        t = t.to(torch.float64)
        if not torch.isfinite(t).all() or (t < 0).any():
            raise PowerInferError(f"{p}: counts must be finite and non-negative")
        want = n_ff if n_ff is not None else (out[0].numel() if out else None)
        if want is not None and t.numel() != want:
            raise PowerInferError(f"{p}: has {t.numel()} neurons, expected n_ff = {want}")
        out.append(t)
    return out


def load_activation_stats(folder: str | Path) -> dict[str, Any] | None:
    """``powerinfer_stats.json`` of an activation folder as a dict, or None when there is none.

    Raises PowerInferError naming the file when it is not UTF-8 JSON holding an object.
    """
    from ._json import read_json_object

    p = Path(folder) / STATS_FILE
    if not p.exists():
        return None
    return read_json_object(p)

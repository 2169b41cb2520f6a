"""Predictor training data: (predictor input, FFN active mask) rows per split and layer.

The work-dir contract between the calibration pass (:mod:`powerinfer.calibrate.stream`,
which writes it) and predictor training (:mod:`powerinfer.train_predictor.train`, which
reads it). Per split (``train``, ``heldout``) and layer ``i``, in ``WORK/collect/``:

* ``{split}_x_{i}.bin``: float16 ``[N, n_embd]`` predictor inputs (the hidden state the
  runtime's predictor sees just before layer ``i``'s FFN);
* ``{split}_mask_{i}.bin``: uint8 ``[N, ceil(n_ff / 8)]`` active masks, bit-packed with
  ``numpy.packbits(bitorder="little")`` (bit ``j % 8`` of byte ``j // 8`` = neuron ``j``);
* ``meta.json``: dimensions, token counts per split, per-layer active share, and the
  *key* (model + data fingerprints and settings) with ``"complete": true``, written last.

Rows are in calibration-batch order. They are read back as ``numpy.memmap``; a later
run with the same key reuses them instead of running the model again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import PowerInferError
from ._atomic import atomic_path

__all__ = ["CollectedData", "COLLECT_DIR", "META_FILE", "FORMAT_VERSION", "fingerprint", "unpack_mask", "pack_mask", "unpack_mask_torch",
           "x_file", "mask_file", "write_meta"]

COLLECT_DIR = "collect"
META_FILE = "meta.json"
FORMAT_VERSION = 1


def x_file(split: str, layer: int) -> str:
    return f"{split}_x_{layer}.bin"


def mask_file(split: str, layer: int) -> str:
    return f"{split}_mask_{layer}.bin"


def fingerprint(path: str | Path) -> list[list[Any]]:
    """``[relative name, size, mtime_ns]`` of a file, or of every file under a folder (sorted).

    Identifies a model or data source cheaply for the resume check; a non-path source
    (``hf:NAME``) is returned as its name.
    """
    p = Path(path)
    if not p.exists():
        return [[str(path)]]
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.relative_to(p)) if f != p else f.name, st.st_size, st.st_mtime_ns])
    return out


def unpack_mask(packed: np.ndarray, n_ff: int) -> np.ndarray:
    """uint8 ``[N, ceil(n_ff/8)]`` packed rows -> uint8 ``[N, n_ff]`` of 0/1."""
    return np.unpackbits(packed, axis=1, count=n_ff, bitorder="little")


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[N, n_ff]`` -> uint8 ``[N, ceil(n_ff/8)]`` on the same device, bit ``j % 8`` of byte
    ``j // 8`` = neuron ``j`` (``numpy.packbits(bitorder="little")``'s layout)."""
    n, n_ff = mask.shape
    pad = (-n_ff) % 8
    m = mask.to(torch.uint8)
    if pad:
        m = torch.nn.functional.pad(m, (0, pad))
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m.view(n, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_mask_torch(packed: torch.Tensor, n_ff: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: uint8 ``[N, ceil(n_ff/8)]`` -> bool ``[N, n_ff]``."""
    bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) & bits) != 0).reshape(packed.shape[0], -1)[:, :n_ff]


@dataclass
class CollectedData:
    """Collected pairs in a work dir (see the module docstring for the file layout)."""

    root: Path
    n_layer: int
    n_embd: int
    n_ff: int
    n_tokens: dict[str, int]
    active_share: dict[str, list[float]]
    key: dict[str, Any]

    @property
    def mask_bytes(self) -> int:
        return (self.n_ff + 7) // 8

    def inputs(self, split: str, layer: int) -> np.ndarray:
        """Read-only float16 memmap ``[N, n_embd]`` of layer ``layer``'s predictor inputs."""
        return self._open(x_file(split, layer), np.float16, self.n_embd, split)

    def masks(self, split: str, layer: int) -> np.ndarray:
        """Read-only uint8 memmap ``[N, ceil(n_ff/8)]`` of packed active masks (:func:`unpack_mask`)."""
        return self._open(mask_file(split, layer), np.uint8, self.mask_bytes, split)

    def _open(self, name: str, dtype: Any, width: int, split: str) -> np.ndarray:
        n = self.n_tokens[split]
        path = self.root / name
        want = n * width * np.dtype(dtype).itemsize
        if not path.is_file() or path.stat().st_size != want:
            raise PowerInferError(f"{path}: missing or truncated collected data (delete the work dir and rerun)")
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, width))

    @classmethod
    def open(cls, work_dir: str | Path) -> "CollectedData | None":
        """The complete collection in ``work_dir``, or None if there is none."""
        root = Path(work_dir) / COLLECT_DIR
        try:
            meta = json.loads((root / META_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if not isinstance(meta, dict) or not meta.get("complete") or meta.get("format") != FORMAT_VERSION:
            return None
        try:
            dims = [meta[k] for k in ("n_layer", "n_embd", "n_ff")]
            n_tokens, share, key = dict(meta["n_tokens"]), dict(meta["active_share"]), meta["key"]
        except (KeyError, TypeError, ValueError):
            return None  # not ours or damaged: collected again
        if not all(isinstance(v, int) and 0 < v <= 1 << 22 for v in dims) or \
                not all(isinstance(v, int) and 0 < v <= 1 << 40 for v in n_tokens.values()):
            return None
        return cls(root, *dims, n_tokens, share, key)


def write_meta(root: Path, n_layer: int, n_embd: int, n_ff: int, n_tokens: dict[str, int],
               active_share: dict[str, list[float]], key: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write ``meta.json`` (atomically, last): the collection in ``root`` is complete."""
    meta = dict(format=FORMAT_VERSION, complete=True, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff,
                n_tokens=n_tokens, active_share=active_share, key=key,
                key_hash=hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16], **(extra or {}))
    with atomic_path(Path(root) / META_FILE) as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n")

"""Collect predictor training pairs: (predictor input, FFN active mask) per token and layer.

PowerInfer's (and Deja Vu's) activation predictor for layer ``i`` sees the hidden state the
runtime has just before that layer's FFN and must say which FFN neurons will fire. The
point is the family's ``predictor_input_attr``: the *input* of that module (for
ReLU-Llama, ``post_attention_layernorm``, i.e. the residual stream after attention and
before ``ffn_norm``), or the decoder layer's own input when it is None (Falcon). Labels
are ``family.active_mask(act, gate_out, up_out)`` from the same forward pass
(:class:`powerinfer.profile.collect.ActiveNeuronHooks`).

Storage (bounded memory whatever the token count): per split (``train``, ``heldout``) and
layer ``i``, rows are appended to raw files in ``WORK/collect/``:

* ``{split}_x_{i}.bin``: float16 ``[N, n_embd]`` predictor inputs;
* ``{split}_mask_{i}.bin``: uint8 ``[N, ceil(n_ff / 8)]`` active masks, bit-packed with
  ``numpy.packbits(bitorder="little")`` (bit ``j % 8`` of byte ``j // 8`` = neuron ``j``);
* ``meta.json``: dimensions, token counts per split, per-layer active share, and the
  *key* (model + data fingerprints and settings) with ``"complete": true`` written last.

They are read back as ``numpy.memmap``. A later run with the same key reuses the files
instead of running the model again; a different key or an interrupted run starts over.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..errors import PowerInferError
from ..families import Activation, Family, get_attr, model_layers
from ..formats._atomic import atomic_path
from ..profile.collect import ActiveNeuronHooks, forward_layers

__all__ = ["CollectedData", "fingerprint", "collect_predictor_data", "unpack_mask"]

COLLECT_DIR = "collect"
META_FILE = "meta.json"
FORMAT_VERSION = 1


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
        return self._open(f"{split}_x_{layer}.bin", np.float16, self.n_embd, split)

    def masks(self, split: str, layer: int) -> np.ndarray:
        """Read-only uint8 memmap ``[N, ceil(n_ff/8)]`` of packed active masks (:func:`unpack_mask`)."""
        return self._open(f"{split}_mask_{layer}.bin", np.uint8, self.mask_bytes, split)

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
        if not meta.get("complete") or meta.get("format") != FORMAT_VERSION:
            return None
        return cls(root, meta["n_layer"], meta["n_embd"], meta["n_ff"], meta["n_tokens"],
                   meta["active_share"], meta["key"])


class _LayerWriter:
    """Appends one batch's rows per layer to the split's files."""

    def __init__(self, root: Path, split: str, n_layer: int, n_ff: int):
        self.root, self.split, self.n_ff = root, split, n_ff
        self.active = [0] * n_layer
        self.rows = [0] * n_layer
        for i in range(n_layer):
            for kind in ("x", "mask"):
                (root / f"{split}_{kind}_{i}.bin").write_bytes(b"")

    def write(self, i: int, x: torch.Tensor, mask: torch.Tensor) -> None:
        # x: [N, n_embd] float, mask: [N, n_ff] bool
        if x.shape[0] != mask.shape[0]:
            raise AssertionError(f"layer {i}: {x.shape[0]} inputs but {mask.shape[0]} masks")
        xs = x.to(torch.float16).cpu().numpy()
        ms = mask.cpu().numpy()
        with open(self.root / f"{self.split}_x_{i}.bin", "ab") as f:
            f.write(np.ascontiguousarray(xs).tobytes())
        with open(self.root / f"{self.split}_mask_{i}.bin", "ab") as f:
            f.write(np.packbits(ms, axis=1, bitorder="little").tobytes())
        self.active[i] += int(ms.sum())
        self.rows[i] += ms.shape[0]


def _collect_split(model: torch.nn.Module, family: Family, act: Activation, batches: Iterable[torch.Tensor],
                   writer: _LayerWriter, progress: Callable[[int], None] | None) -> int:
    layers = model_layers(family, model)
    inputs: list[torch.Tensor | None] = [None] * len(layers)
    handles = []

    def grab(i: int):
        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            inputs[i] = hooks.rows(h.detach())
        return pre_hook

    def on_mask(i: int, mask: torch.Tensor) -> None:
        x = inputs[i]
        if x is None:
            raise PowerInferError(f"layer {i}: the FFN ran before the predictor input "
                                  f"{family.predictor_input_attr!r} was seen (family {family.name})")
        writer.write(i, x, mask)
        inputs[i] = None

    n_tokens = 0
    with ActiveNeuronHooks(model, family, act, on_mask) as hooks:
        try:
            for i, layer in enumerate(layers):
                mod = layer if family.predictor_input_attr is None else get_attr(layer, family.predictor_input_attr)
                handles.append(mod.register_forward_pre_hook(grab(i), with_kwargs=True))
            for ids in batches:
                forward_layers(model, ids)
                n_tokens += ids.numel()
                if progress is not None:
                    progress(ids.numel())
        finally:
            for h in handles:
                h.remove()
    return n_tokens


def collect_predictor_data(model: torch.nn.Module, family: Family, act: Activation, n_embd: int, n_ff: int,
                           splits: dict[str, Callable[[], Iterable[torch.Tensor]]], work_dir: str | Path,
                           key: dict[str, Any], progress: bool = False, totals: dict[str, int] | None = None,
                           log: Callable[[str], None] | None = None) -> CollectedData:
    """Run the model over each split's batches and store (input, mask) rows per layer.

    ``splits`` maps a split name (``"train"``, ``"heldout"``) to a function returning its
    batches: LongTensor ``[B, T]`` packed token ids without padding
    (:func:`powerinfer.data.calibration_batches`); the functions are only called when the
    data must be collected. ``key`` (JSON-able: model and data fingerprints, token caps,
    seq_len, ...) identifies the collection: if ``work_dir`` already holds a complete
    collection with an equal key it is returned without running the model. ``totals``:
    expected tokens per split, for the progress bars only.

    Returns the :class:`CollectedData`. Raises PowerInferError if a split yields no tokens.
    """
    key = json.loads(json.dumps(key))  # normalise (tuples -> lists) for the comparison
    have = CollectedData.open(work_dir)
    if have is not None and have.key == key:
        if log is not None:
            log(f"reusing collected data in {have.root} ({have.n_tokens})")
        return have
    root = Path(work_dir) / COLLECT_DIR
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    n_layer = len(model_layers(family, model))
    n_tokens: dict[str, int] = {}
    active_share: dict[str, list[float]] = {}
    for split, make_batches in splits.items():
        writer = _LayerWriter(root, split, n_layer, n_ff)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=(totals or {}).get(split), unit="tok", desc=f"collect {split}", leave=False)
        try:
            n = _collect_split(model, family, act, make_batches(), writer,
                               bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        if n == 0:
            raise PowerInferError(f"the {split} split of the calibration data gave no tokens")
        if any(r != n for r in writer.rows):
            raise PowerInferError(f"collected {writer.rows} rows per layer for {n} tokens ({split} split)")
        n_tokens[split] = n
        active_share[split] = [a / (n * n_ff) for a in writer.active]
    meta = dict(format=FORMAT_VERSION, complete=True, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff,
                n_tokens=n_tokens, active_share=active_share, key=key,
                key_hash=hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16])
    with atomic_path(root / META_FILE) as tmp:
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
    data = CollectedData.open(work_dir)
    assert data is not None
    if log is not None:
        log(f"collected {n_tokens} tokens x {n_layer} layers into {root}")
    return data

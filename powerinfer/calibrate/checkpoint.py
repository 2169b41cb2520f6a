"""Read single tensors of a Hugging Face checkpoint without loading the model.

A 7B checkpoint is 13.5 GB in bf16 and 27 GB in f32, a 70B one 140 GB: the layer-streamed
calibration pass (:mod:`powerinfer.calibrate.stream`) needs one decoder layer at a time, so
it asks this reader for tensors by name:

* ``*.safetensors`` shards (one file, or several with ``model.safetensors.index.json``) are
  opened with ``safetensors.safe_open``, which memory-maps the file: reading a tensor
  touches only its bytes;
* ``pytorch_model*.bin`` shards are read with ``torch.load(..., weights_only=True,
  mmap=True)`` (zip-format files; legacy pickles are loaded whole), one shard at a time:
  the reader keeps only the shard it last opened.

Names are matched the way transformers does for a ``*ForCausalLM``: the model's key
(``model.layers.0.mlp.up_proj.weight``) or the same key without the base-model prefix
(``layers.0...``; published OPT files say ``decoder.layers...``). Index files are bounded and
every shard they name must lie inside the model folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import PowerInferError

__all__ = ["CheckpointReader"]

MAX_INDEX_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
_TORCH_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


class CheckpointReader:
    """Tensor-by-name access to the weights of a local HF model folder.

    ``prefix``: the model's base-model prefix (``"model"`` for Llama/OPT, ``"transformer"``
    for Falcon); a key is also looked up with it removed or added.

    Raises PowerInferError naming the folder or file when there are no weights, an index
    is malformed or points outside the folder, or a shard cannot be read.
    """

    def __init__(self, model_dir: str | Path, prefix: str = ""):
        self.model_dir = Path(model_dir)
        self.prefix = prefix
        self._files: dict[str, Path] = {}  # tensor name -> shard
        self._safe: dict[Path, Any] = {}
        self._bin_path: Path | None = None
        self._bin: dict[str, torch.Tensor] | None = None
        self.kind = self._index()

    # ------------------------------------------------------------------ index
    def _index(self) -> str:
        d = self.model_dir
        for kind, index_name, single, pattern in (
                ("safetensors", "model.safetensors.index.json", "model.safetensors", "*.safetensors"),
                ("bin", "pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")):
            index = d / index_name
            if index.is_file():
                self._read_index(index)
                return kind
            if (d / single).is_file():
                self._scan([d / single], kind)
                return kind
            shards = sorted(d.glob(pattern))
            if shards:
                self._scan(shards, kind)
                return kind
        raise PowerInferError(f"{d}: no model weights (*.safetensors or pytorch_model*.bin)")

    def _read_index(self, index: Path) -> None:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise PowerInferError(f"{index}: index file is implausibly large")
        try:
            data = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PowerInferError(f"{index}: not a valid JSON index ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm or len(wm) > MAX_TENSORS:
            raise PowerInferError(f"{index}: no usable weight_map")
        for name, file in wm.items():
            if not isinstance(name, str) or not isinstance(file, str):
                raise PowerInferError(f"{index}: weight_map entries must be strings")
            # the shard's *name* must stay in the folder; its file may be a symlink (the HF cache's are)
            parts = Path(file).parts
            if not file or len(file) > 255 or "\x00" in file or Path(file).is_absolute() or ".." in parts:
                raise PowerInferError(f"{index}: shard {file[:80]!r} lies outside the model folder")
            self._files[name] = self.model_dir / file
        missing = sorted({p for p in self._files.values() if not p.is_file()})
        if missing:
            raise PowerInferError(f"{missing[0]}: shard named in {index.name} is missing")

    def _scan(self, shards: list[Path], kind: str) -> None:
        for shard in shards:
            names = self._open_safe(shard).keys() if kind == "safetensors" else self._open_bin(shard).keys()
            for name in names:
                self._files.setdefault(name, shard)
        if kind == "bin":  # scanning read every shard; keep none of them
            self._bin_path, self._bin = None, None

    # ------------------------------------------------------------------ shards
    def _open_safe(self, path: Path):
        f = self._safe.get(path)
        if f is None:
            from safetensors import safe_open

            try:
                f = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a bad file
                raise PowerInferError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
            self._safe[path] = f
        return f

    def _open_bin(self, path: Path) -> dict[str, torch.Tensor]:
        if self._bin_path == path and self._bin is not None:
            return self._bin
        self._bin_path, self._bin = None, None  # drop the previous shard first
        try:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
                sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if "weights_only" in str(e) or "Weights only" in first:
                first = "it holds objects other than tensors, refused for safety"
            raise PowerInferError(f"{path}: not a readable torch checkpoint ({first})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise PowerInferError(f"{path}: expected a dict of tensors")
        self._bin_path, self._bin = path, sd
        return sd

    # ------------------------------------------------------------------ lookup
    def resolve(self, key: str) -> str | None:
        """The checkpoint's name for model key ``key`` (None when absent)."""
        cands = [key]
        p = self.prefix + "." if self.prefix else ""
        if p and key.startswith(p):
            cands.append(key[len(p):])
        elif p:
            cands.append(p + key)
        return next((c for c in cands if c in self._files), None)

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint (its own spelling)."""
        return list(self._files)

    def _header(self, key: str, from_safetensors, from_bin):
        """``from_safetensors(slice)`` or ``from_bin(tensor)`` for tensor ``key`` without reading its
        data (a safetensors slice, or a lazily loaded .bin tensor); None when absent."""
        name = self.resolve(key)
        if name is None:
            return None
        path = self._files[name]
        try:
            if path.suffix == ".safetensors":
                return from_safetensors(self._open_safe(path).get_slice(name))
            return from_bin(self._open_bin(path)[name])
        except PowerInferError:
            raise
        except Exception as e:  # noqa: BLE001
            raise PowerInferError(f"{path}: could not read tensor {name!r} ({str(e).splitlines()[0]})") from None

    def shape(self, key: str) -> tuple[int, ...] | None:
        """Shape of tensor ``key`` (model naming) from the shard's header, without reading it;
        None when absent."""
        return self._header(key, lambda sl: tuple(sl.get_shape()), lambda t: tuple(t.shape))

    def dtype(self, key: str) -> str | None:
        """Stored dtype of tensor ``key`` in safetensors' spelling (``F32``, ``BF16``, ``I8``...),
        from the shard header; None when absent."""
        return self._header(key, lambda sl: str(sl.get_dtype()),
                            lambda t: _TORCH_DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.").upper()))

    def __contains__(self, key: str) -> bool:
        return self.resolve(key) is not None

    def get(self, key: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """Tensor ``key`` (model naming), converted to ``dtype`` on ``device`` (a new tensor).

        Raises PowerInferError when the checkpoint lacks it or its shard is unreadable.
        """
        name = self.resolve(key)
        if name is None:
            raise PowerInferError(f"{self.model_dir}: checkpoint has no tensor {key!r}")
        path = self._files[name]
        try:
            if path.suffix == ".safetensors":
                t = self._open_safe(path).get_tensor(name)
            else:
                t = self._open_bin(path)[name]
        except PowerInferError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or corrupt shard
            raise PowerInferError(f"{path}: could not read tensor {name!r} ({str(e).splitlines()[0]})") from None
        return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                    copy=True)

    def close(self) -> None:
        """Drop open shards (unmapping them); later lookups reopen what they need."""
        self._safe.clear()
        self._bin_path, self._bin = None, None

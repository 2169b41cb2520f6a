"""Stream tensors out of a Hugging Face checkpoint one at a time.

Reads ``*.safetensors`` shards lazily (``safe_open``), so a 70B model converts in
bounded memory, the way llama.cpp's converter does. ``pytorch_model*.bin`` is
accepted too, loaded with ``weights_only=True`` (no pickled code runs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ..errors import PowerInferError


class HFTensors:
    """Name -> shape and lazy loading for every tensor of a model folder."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        st = sorted(self.model_dir.glob("*.safetensors"))
        if st:
            from safetensors import safe_open

            for f in st:
                try:
                    with safe_open(str(f), framework="pt") as h:
                        for k in h.keys():
                            self._where[k] = f
                except Exception as e:  # noqa: BLE001
                    raise PowerInferError(f"{f}: not a readable safetensors file ({e})") from None
            self._kind = "safetensors"
        else:
            bins = sorted(self.model_dir.glob("pytorch_model*.bin"))
            if not bins:
                raise PowerInferError(f"{self.model_dir}: no *.safetensors or pytorch_model*.bin weights found")
            self._kind = "bin"
            self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
            for f in bins:
                for k in self._load_bin(f):
                    self._where[k] = f

    def _load_bin(self, f: Path) -> dict[str, torch.Tensor]:
        if f not in self._bin_cache:
            self._bin_cache.clear()  # keep at most one shard in memory
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001
                raise PowerInferError(f"{f}: not a readable torch checkpoint ({e})") from None
            if not isinstance(sd, dict):
                raise PowerInferError(f"{f}: expected a state dict")
            self._bin_cache[f] = sd
        return self._bin_cache[f]

    def names(self) -> list[str]:
        return list(self._where)

    def file(self, name: str) -> Path:
        """The shard that holds ``name``."""
        return self._where[name]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        f = self._where[name]
        if self._kind == "safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                return tuple(h.get_slice(name).get_shape())
        return tuple(self._load_bin(f)[name].shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (its own dtype), on CPU.

        Raises PowerInferError naming the shard when the tensor cannot be read (a file cut
        short, a corrupt header).
        """
        f = self._where[name]
        try:
            if self._kind == "safetensors":
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as h:
                    return h.get_tensor(name)
            t = self._load_bin(f)[name]
        except PowerInferError:
            raise
        except Exception as e:  # noqa: BLE001 - SafetensorError, a failed reshape of a short file, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise PowerInferError(f"{f}: could not read tensor {name!r} ({first}; is the file truncated?)") from None
        if not isinstance(t, torch.Tensor):
            raise PowerInferError(f"{f}: {name!r} is a {type(t).__name__}, not a tensor")
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

"""Open GGUF and PowerInfer GGUF (``PWRI`` magic) files with the ``gguf`` package.

A PowerInfer GGUF is a GGUF v3 file whose first four bytes read ``PWRI``; the
magic alone tells upstream PowerInfer to run sparse (FORMATS.md section 4). The
``gguf`` package's reader refuses any magic but ``GGUF``, so :class:`PwriReader`
accepts both. Every file is memory-mapped, never read whole, and every tensor's
extent is checked against the file size so a truncated file fails cleanly.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.constants import GGUF_MAGIC

from ..errors import PowerInferError

GGUF_BYTES = b"GGUF"
PWRI_BYTES = b"PWRI"
PWRI_MAGIC = int.from_bytes(PWRI_BYTES, "little")


class PwriReader(GGUFReader):
    """``gguf.GGUFReader`` that also accepts the ``PWRI`` magic."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        arr = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and np.dtype(dtype) == np.uint32 and arr.size == 1 and int(arr[0]) == PWRI_MAGIC:
            return np.array([GGUF_MAGIC], dtype=np.uint32)
        return arr

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """Refuse, naming the tensor, a block-quantized tensor whose rows are not whole blocks
        (the ``gguf`` reader's own message names no tensor)."""
        for field in fields:
            _, name_data, _, dims, raw_dtype, _ = field.parts
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise ValueError(f"tensor {bytes(name_data).decode(errors='replace')!r} has unknown "
                                 f"type {int(raw_dtype[0])}") from None
            block = GGML_QUANT_SIZES[qtype][0]
            if len(dims) and int(dims[0]) % block:
                raise ValueError(f"tensor {bytes(name_data).decode(errors='replace')!r} ({qtype.name}) has rows of "
                                 f"{int(dims[0])} values, not a multiple of the {qtype.name} block size {block}")
        super()._build_tensors(start_offs, fields)


def read_magic(path: str | Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def set_magic(path: str | Path, magic: bytes) -> None:
    """Overwrite the first 4 bytes of a just-written GGUF (``GGUF`` -> ``PWRI``)."""
    assert len(magic) == 4
    with open(path, "r+b") as f:
        if f.read(4) != GGUF_BYTES:
            raise PowerInferError(f"{path}: expected a GGUF file to re-stamp")
        f.seek(0)
        f.write(magic)


@dataclass
class GGUFFile:
    """An opened (memory-mapped) GGUF. ``sparse`` is True for ``PWRI`` files."""

    path: Path
    reader: GGUFReader
    sparse: bool

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python scalar, string or list (``default`` if absent)."""
        f = self.reader.get_field(key)
        if f is None:
            return default
        return f.contents()

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise PowerInferError(f"{self.path}: metadata key {key!r} is missing")
        return v

    @cached_property
    def tensors(self) -> dict[str, Any]:
        """Tensors by name (built once: model loading looks names up hundreds of times)."""
        return {t.name: t for t in self.reader.tensors}

    @property
    def arch(self) -> str:
        return str(self.require("general.architecture"))


def open_gguf(path: str | Path, reader_cls: type[GGUFReader] = PwriReader) -> GGUFFile:
    """Memory-map a GGUF or PowerInfer GGUF.

    Raises PowerInferError naming the path when the file is missing, has another
    magic, is truncated, or does not parse.
    """
    path = Path(path)
    if not path.is_file():
        raise PowerInferError(f"{path}: file not found")
    size = path.stat().st_size
    magic = read_magic(path)
    if magic not in (GGUF_BYTES, PWRI_BYTES):
        raise PowerInferError(f"{path}: wrong magic {magic!r} (expected b'GGUF' or b'PWRI'); not a GGUF file")
    if size < 24:
        raise PowerInferError(f"{path}: truncated ({size} bytes is shorter than a GGUF header)")
    try:
        reader = reader_cls(path, "r")
    except Exception as e:  # noqa: BLE001 - gguf raises many types on corrupt input
        raise PowerInferError(f"{path}: not a valid GGUF file, truncated or corrupt ({e})") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise PowerInferError(f"{path}: truncated: tensor {t.name!r} extends past the end of the file")
    return GGUFFile(path, reader, magic == PWRI_BYTES)

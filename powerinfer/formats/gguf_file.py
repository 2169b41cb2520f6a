"""Open GGUF and PowerInfer GGUF (``PWRI`` magic) files with the ``gguf`` package.

A PowerInfer GGUF is a GGUF v3 file whose first four bytes read ``PWRI``; the
magic alone tells upstream PowerInfer to run sparse (FORMATS.md section 4). The
``gguf`` package's reader refuses any magic but ``GGUF``, so :class:`PwriReader`
accepts both. Every file is memory-mapped, never read whole, and its header is checked
first by :mod:`.gguf_validate` (bounded counts, tensor layout, metadata values), so a
truncated, corrupt or hostile file fails with one clean message before anything is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGUF_MAGIC

from ..errors import PowerInferError
from .gguf_validate import validate_gguf

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

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        """As ``GGUFReader``'s, but an array of numbers is one numpy view, not one array per element
        (the reader's way costs ~100 bytes and a Python loop turn per element)."""
        if raw_type == GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0])))
            if nptype is not None:
                alen = self._get(orig_offs + 4, np.uint64)
                vals = self._get(orig_offs + 12, nptype, int(alen[0]))
                types = [GGUFValueType.ARRAY, GGUFValueType(int(itype[0]))]
                return 12 + int(vals.nbytes), [itype, alen, vals], [2], types
        return super()._get_field_parts(orig_offs, raw_type)


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
    """Memory-map a GGUF or PowerInfer GGUF, after :func:`~.gguf_validate.validate_gguf` has
    checked its header (bounds, tensor layout, metadata types and ranges).

    Raises PowerInferError naming the path when the file is missing, has another
    magic, is truncated, or fails any check.
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
    header = validate_gguf(path)
    try:
        reader = reader_cls(path, "r")
    except Exception as e:  # noqa: BLE001 - gguf raises many types on corrupt input
        raise PowerInferError(f"{path}: not a valid GGUF file, truncated or corrupt ({e})") from None
    if [(t.name, t.data_offset, t.n_bytes) for t in reader.tensors] != \
            [(t.name, header.data_start + t.offset, t.nbytes) for t in header.tensors]:  # both parsers agree
        raise PowerInferError(f"{path}: not a valid GGUF file: its tensor table does not parse consistently")
    return GGUFFile(path, reader, magic == PWRI_BYTES)

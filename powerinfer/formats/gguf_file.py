"""Open GGUF and PowerInfer GGUF (``PWRI`` magic) files with the ``gguf`` package.

A PowerInfer GGUF is a GGUF v3 file whose first four bytes read ``PWRI``; the
magic alone tells upstream PowerInfer to run sparse (FORMATS.md section 4). The
``gguf`` package's reader refuses any magic but ``GGUF``, so :class:`PwriReader`
accepts both. Every file is memory-mapped, never read whole, and its header is checked
first by :mod:`.gguf_validate` (bounded counts, tensor layout, metadata values), so a
truncated, corrupt or hostile file fails with one clean message before anything is allocated.
"""
from __future__ import annotations

import struct
import sys
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
        """As ``GGUFReader``'s, but cheaper for arrays (the reader's way makes one or two numpy
        arrays and several calls per element: ~10 s for a 130k-token vocabulary with merges):
        an array of numbers is one numpy view, an array of strings one :class:`_Str` per string.
        Only called on headers :func:`~.gguf_validate.validate_gguf` has checked."""
        if raw_type == GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            sub = GGUFValueType(int(itype[0]))
            types = [GGUFValueType.ARRAY, sub]
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is not None:
                vals = self._get(orig_offs + 12, nptype, int(alen[0]))
                return 12 + int(vals.nbytes), [itype, alen, vals], [2], types
            if sub == GGUFValueType.STRING:
                n, pos = int(alen[0]), orig_offs + 12
                mv = memoryview(self.data)
                length = struct.Struct(("<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">") + "Q")
                parts: list = [itype, alen]
                for _ in range(n):
                    k = length.unpack_from(mv, pos)[0]
                    parts.append(_Str(mv[pos + 8:pos + 8 + k]))
                    pos += 8 + k
                return pos - orig_offs, parts, list(range(2, 2 + n)), types
        return super()._get_field_parts(orig_offs, raw_type)


class _Str(bytes):
    """One string of a metadata array, with the two numpy members the ``gguf`` reader uses."""

    def tobytes(self) -> bytes:
        return bytes(self)

    @property
    def nbytes(self) -> int:
        return len(self)


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


def check_gguf(path: str | Path):
    """The validated header of ``path`` (:func:`~.gguf_validate.validate_gguf`), read without
    mapping the tensors: what a front end checks before it spends time on anything else.

    Raises PowerInferError naming the path when the file is missing, has another magic, is
    truncated, or fails any check.
    """
    path = Path(path)
    if not path.is_file():
        raise PowerInferError(f"{path}: {'not a file' if path.exists() else 'file not found'}")
    size = path.stat().st_size
    magic = read_magic(path)
    if magic not in (GGUF_BYTES, PWRI_BYTES):
        raise PowerInferError(f"{path}: wrong magic {magic!r} (expected b'GGUF' or b'PWRI'); not a GGUF file")
    if size < 24:
        raise PowerInferError(f"{path}: truncated ({size} bytes is shorter than a GGUF header)")
    return validate_gguf(path)


def open_gguf(path: str | Path, reader_cls: type[GGUFReader] = PwriReader) -> GGUFFile:
    """Memory-map a GGUF or PowerInfer GGUF, after :func:`~.gguf_validate.validate_gguf` has
    checked its header (bounds, tensor layout, metadata types and ranges).

    Raises PowerInferError naming the path when the file is missing, has another
    magic, is truncated, or fails any check.
    """
    path = Path(path)
    header = check_gguf(path)
    magic = read_magic(path)
    try:
        reader = reader_cls(path, "r")
    except Exception as e:  # noqa: BLE001 - gguf raises many types on corrupt input
        raise PowerInferError(f"{path}: not a valid GGUF file, truncated or corrupt ({e})") from None
    if [(t.name, t.data_offset, t.n_bytes) for t in reader.tensors] != \
            [(t.name, header.data_start + t.offset, t.nbytes) for t in header.tensors]:  # both parsers agree
        raise PowerInferError(f"{path}: not a valid GGUF file: its tensor table does not parse consistently")
    return GGUFFile(path, reader, magic == PWRI_BYTES)

"""``pi-quantize IN.gguf OUT.gguf TYPE``: an f32/f16/bf16 GGUF or PowerInfer GGUF -> Q4_0/Q8_0.

Upstream PowerInfer's (and llama.cpp's) ``quantize`` tool, for the types this project
writes: the output keeps the input's magic (``PWRI`` stays ``PWRI``), every metadata key
and value in the same order (``general.file_type`` set to ``MOSTLY_Q4_0`` /
``MOSTLY_Q8_0``), and the same tensors in the same order under the same names. Each
float tensor gets the type :func:`.tensor_types.tensor_type` gives it, the same rule as
``pi-convert --outtype`` (so ``pi-quantize`` of an f32 file and ``pi-convert --outtype``
write the same tensor bytes); tensors already quantized and integer tensors are copied
as they are.

Streaming: tensors are read from the input's memory map, converted a chunk of rows at a
time and written one after the other, and each tensor's input pages are handed back to
the kernel once it is written, so peak RSS is about one tensor's input pages plus one
chunk's temporaries whatever the model size (measured: +47 MB on a 168 MB f32 file of
33.5 MB tensors, +178 MB without handing the pages back).
Every tensor's type and byte size is checked before anything is written; the output is
written to a temporary file renamed over ``OUT`` only when complete, so a failed or
killed run leaves an earlier ``OUT`` as it was.
"""
from __future__ import annotations

import logging
import mmap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..errors import PowerInferError
from ..formats._atomic import atomic_path
from ..formats.gguf_file import PWRI_BYTES, GGUFFile, open_gguf, read_magic, set_magic
from ..progress import progress as progress_bar
from ..quant.types import WRITE_TYPES
from .outfile import check_outfile
from .tensor_types import (FILE_TYPES, PREDICTOR_TYPES, UPSTREAM_Q8_0_SPARSE, Encoded, encode, fallback_note,
                           falls_back, tensor_type)

log = logging.getLogger(__name__)

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
_FLOAT_IN = {QT.F32, QT.F16, QT.BF16, QT.F64}  # tensors pi-quantize converts; others are copied
_COPY_CHUNK = 16 << 20  # bytes copied per write for tensors kept as they are
FILE_TYPE_KEY = gguf.Keys.General.FILE_TYPE


@dataclass
class QuantizeResult:
    path: Path
    in_bytes: int
    out_bytes: int
    types: Counter  # output type name -> tensor count
    sparse: bool

    @property
    def summary(self) -> str:
        types = ", ".join(f"{n} {k.lower()}" for k, n in self.types.most_common())
        kind = "PWRI" if self.sparse else "GGUF"
        return (f"wrote {self.path} ({kind}): {self.in_bytes / 1e6:.2f} MB -> {self.out_bytes / 1e6:.2f} MB, "
                f"tensors: {types}")


def _torch_shape(t: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _rows(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's values from the memory map, torch shape (bf16 widened a chunk at a time by the caller)."""
    if t.tensor_type == QT.BF16:
        return t.data.reshape(-1).view(np.uint16).reshape(shape)
    return t.data.reshape(shape)


class _Widened:
    """Row-sliceable view of a bf16 tensor that yields fp32 rows (only the slice is converted)."""

    def __init__(self, u16: np.ndarray):
        self._u = u16
        self.shape, self.ndim = u16.shape, u16.ndim

    def reshape(self, *shape: Any) -> "_Widened":
        return _Widened(self._u.reshape(*shape))

    def __getitem__(self, idx: Any) -> np.ndarray:
        return _bf16_to_f32(np.ascontiguousarray(self._u[idx]))


def _copy_raw(t: Any) -> Encoded:
    raw = t.data.reshape(-1).view(np.uint8)
    return Encoded(int(t.n_bytes), lambda: (raw[s:s + _COPY_CHUNK] for s in range(0, raw.size, _COPY_CHUNK)))


def _drop_pages(g: GGUFFile, t: Any) -> None:
    """Hand the input pages of tensor ``t`` back to the kernel (they are clean file pages: a
    later read faults them in again), so peak RSS does not grow with the input size."""
    mm = getattr(g.reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass


def _field_value(path: Path, f: Any) -> tuple[Any, VT, VT | None]:
    """A metadata field as ``GGUFWriter.add_key_value`` takes it, byte-exact (strings stay bytes)."""
    main = f.types[0]
    if main == VT.STRING:
        return bytes(f.parts[f.data[0]]), main, None
    if main == VT.ARRAY:
        if len(f.types) != 2:
            raise PowerInferError(f"{path}: metadata key {f.name!r} is a nested array; not supported")
        if not f.data:
            raise PowerInferError(f"{path}: metadata key {f.name!r} is an empty array, which the gguf "
                                  "package cannot write")
        sub = f.types[1]
        if sub == VT.STRING:
            return [bytes(f.parts[i]) for i in f.data], main, sub
        return np.concatenate([f.parts[i] for i in f.data]).tolist(), main, sub
    return f.parts[f.data[0]][0].item(), main, None


def _copy_metadata(w: gguf.GGUFWriter, g: GGUFFile, file_type: int) -> None:
    """Every key of ``g`` in its order, ``general.file_type`` replaced (added last if absent)."""
    order = []
    for f in g.reader.fields.values():
        if f.name.startswith("GGUF."):  # header pseudo-fields: version, tensor and kv counts
            continue
        order.append(f.name)
        if f.name == FILE_TYPE_KEY:
            w.add_uint32(FILE_TYPE_KEY, file_type)
            continue
        if f.name == gguf.Keys.General.ARCHITECTURE:  # the writer's own, from g.arch
            continue
        val, vt, sub = _field_value(g.path, f)
        if f.name == gguf.Keys.General.ALIGNMENT:
            w.add_custom_alignment(int(val))
        else:
            w.add_key_value(f.name, val, vt, sub_type=sub)
    if FILE_TYPE_KEY not in order:
        w.add_uint32(FILE_TYPE_KEY, file_type)
        order.append(FILE_TYPE_KEY)
    kv = w.kv_data[0]  # the writer put general.architecture first; keep the input's order
    w.kv_data[0] = {k: kv[k] for k in order}


def quantize_file(src: str | Path, dst: str | Path, qtype: str, predictor_type: str | None = None,
                  progress: bool = False) -> QuantizeResult:
    """Write ``src`` quantized to ``qtype`` (``q4_0`` or ``q8_0``) at ``dst``.

    ``predictor_type``: type of the predictor matrices (``f16``, ``q8_0``, ``q4_0``; None:
    :data:`.tensor_types.DEFAULT_PREDICTOR_TYPE`). Raises PowerInferError (nothing written
    at ``dst``) for an unsupported type, an unreadable, truncated or inconsistent input, a
    GPU index file, ``dst`` naming the input, or NaN/inf values in a tensor to quantize.
    """
    src, dst = Path(src), Path(dst)
    qtype = qtype.lower()
    if qtype not in WRITE_TYPES:
        raise PowerInferError(f"type {qtype!r} is not supported; supported: {', '.join(sorted(WRITE_TYPES))}")
    if predictor_type is not None and predictor_type not in PREDICTOR_TYPES:
        raise PowerInferError(f"--predictor-type {predictor_type!r} is not supported; "
                              f"supported: {', '.join(PREDICTOR_TYPES)}")
    g = open_gguf(src)
    arch = g.arch
    if arch == "generic.gpu_index":
        raise PowerInferError(f"{src}: a GPU index file (generic.gpu_index), not a model; nothing to quantize")
    check_outfile(dst, [src])  # only an earlier GGUF output may be replaced

    plan = []  # (tensor, torch shape, output type or None to copy as is)
    for t in g.reader.tensors:
        shape = _torch_shape(t)
        out = tensor_type(t.name, shape, qtype, predictor_type) if t.tensor_type in _FLOAT_IN else None
        plan.append((t, shape, out))
    other = Counter(t.tensor_type.name for t, s, o in plan if o is None and len(s) == 2
                    and t.tensor_type != tensor_type(t.name, s, qtype, predictor_type))
    if other:
        raise PowerInferError(f"{src}: already quantized ({', '.join(f'{n} {k}' for k, n in other.items())} "
                              f"tensors), not {qtype}: pi-quantize does not requantize (that compounds the rounding); "
                              "quantize the f32/f16/bf16 file instead")
    kept = [(t.name, s) for t, s, o in plan if o is not None and falls_back(t.name, s, qtype, predictor_type)]
    if kept:
        log.warning(fallback_note(kept, qtype))
    if g.sparse and qtype == "q8_0":
        log.warning(UPSTREAM_Q8_0_SPARSE)

    types: Counter = Counter()
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        _copy_metadata(w, g, int(FILE_TYPES[qtype]))
        encoded = []
        for t, shape, out in plan:
            qt = out if out is not None else t.tensor_type
            if out is None or out == t.tensor_type:
                e = _copy_raw(t)
            else:
                rows = _rows(t, shape)
                e = encode(_Widened(rows) if t.tensor_type == QT.BF16 else rows, out, t.name)
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), e.nbytes, raw_dtype=qt)
            encoded.append((t, e))
            types[qt.name] += 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        it: Any = encoded
        if progress:
            it = progress_bar(encoded, desc=f"quantizing {dst.name}", unit="tensor")
        for t, e in it:
            w.write_tensor_data(e)
            _drop_pages(g, t)
        w.close()
        if g.sparse:
            set_magic(tmp, PWRI_BYTES)
        assert read_magic(tmp) == read_magic(src)
    return QuantizeResult(dst, src.stat().st_size, dst.stat().st_size, types, g.sparse)

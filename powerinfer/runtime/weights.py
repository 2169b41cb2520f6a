"""Turn GGUF tensors into torch tensors for the runtime, without duplicate copies.

Memory rule: every weight is resident once, in the file's type where the kernels compute
on it, else in the compute dtype.

* When the file stores a tensor in the compute dtype, the runtime uses a view
  of the file's memory map (zero copy; pages come from the page cache).
* Otherwise (norms and biases of 16-bit files; every weight with the torch backend) the
  tensor is converted into anonymous memory and the file pages it was read from are
  released from this process (``madvise(MADV_DONTNEED)``), so resident memory
  is the converted copy only, not converted copy + mapped file.
* With the C kernels, matrices stored as Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, f16 or bf16 stay in the
  memory map as :class:`QWeight` (:func:`load_matrix`), which the kernels compute on in
  place (f16 converted in registers by F16C, bf16 by a 16-bit shift): resident memory is
  the file size, and a 16-bit file is read at 2 bytes a weight on any AVX2 CPU.
* Other block-quantized types (and every one with the torch backend) are dequantized at load,
  by one rule (:func:`check_dequantized`, before anything is allocated): only when the copies
  fit in available memory, with a warning giving their size; else the file is refused, the
  type and the first such tensor named.
* :func:`load_rows_into` fills a slice of a preallocated tensor (e.g. Q, K and
  V into one fused ``wqkv``), so fused layouts cost no extra copy either.

Big anonymous buffers are private mappings, 2 MiB-aligned, with ``MADV_HUGEPAGE``
(transparent huge pages where the kernel allows them): a sparse FFN reads 8 KB
rows scattered over the whole matrix, and with 4 KB pages every row costs TLB
misses (measured: gathers ~1.5x faster on huge pages).

:func:`compute_dtype` picks the CPU compute dtype for ``--dtype auto``: bf16
when the CPU has native bf16 dot products (AVX512_BF16, AMX-BF16, Arm BF16),
f32 otherwise (f16 matmuls are slow on CPUs).
"""
from __future__ import annotations

import logging
import mmap
import warnings

import numpy as np
import torch

from ..errors import PowerInferError
from ..hardware import cpu_has_bf16
from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES, QWeight
from ..quant.types import FLOAT_TYPES

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
log = logging.getLogger(__name__)
_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20
_NATIVE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---------------------------------------------------------------------------- dtype choice
def compute_dtype(name: str, flags: frozenset[str] | set[str] | None = None) -> torch.dtype:
    """``auto`` | ``bf16`` | ``f32`` -> torch dtype. ``auto``: bf16 if :func:`cpu_has_bf16`, else f32."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_bf16(flags) else torch.float32
    if name not in DTYPES:
        raise PowerInferError(f"--dtype {name!r}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# ---------------------------------------------------------------------------- allocation
def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; big ones (>= 2 MiB) in huge-page-advised anonymous memory."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, n + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # kept alive by the tensor
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled: plain pages
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    off = -raw.data_ptr() % _HUGE  # start on a 2 MiB boundary so whole huge pages back it
    tail = off + n // _HUGE * _HUGE  # the last, partial 2 MiB: small pages, so no huge page overshoots n
    if n % _HUGE and hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_NOHUGEPAGE, tail, len(buf) - tail)
        except OSError:
            pass
    return raw[off:off + n].view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages become resident only when written (big ones: a fresh anonymous
    mapping reads as zeros without being touched), e.g. a KV cache sized for the whole context."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    return empty(shape, dtype)  # MAP_ANONYMOUS memory is zero-filled on first touch


# ---------------------------------------------------------------------------- reading
def _tensor(g: GGUFFile, name: str):
    t = g.tensors.get(name)
    if t is None:
        raise PowerInferError(f"{g.path}: tensor {name!r} is missing")
    return t


def _as_torch(g: GGUFFile, name: str, t) -> torch.Tensor:
    """The tensor's data as torch, torch order: a view of the map, or dequantized (a copy)."""
    kind = t.tensor_type.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the map is read-only; we never write to weights
        if kind in ("F32", "F16"):
            return torch.from_numpy(t.data)
        if kind == "BF16":  # the reader gives raw bytes [..., 2 n]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            return torch.from_numpy(t.data).view(torch.bfloat16).view(shape)
    from gguf import quants

    try:
        return torch.from_numpy(quants.dequantize(np.asarray(t.data), t.tensor_type))
    except NotImplementedError:
        raise PowerInferError(f"{g.path}: tensor {name!r} has type {kind}, not supported") from None


def _release(g: GGUFFile, t) -> None:
    """Drop the file pages under tensor ``t`` from this process (they stay in the page cache)."""
    mm = getattr(g.reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = (t.data_offset + _PAGE - 1) // _PAGE * _PAGE
    end = (t.data_offset + t.n_bytes) // _PAGE * _PAGE
    if end > start:
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def is_mapped(g: GGUFFile, x: torch.Tensor) -> bool:
    """True when ``x``'s memory lies inside ``g``'s memory map (a zero-copy weight)."""
    base = g.reader.data.ctypes.data
    return base <= x.data_ptr() < base + g.reader.data.nbytes


def load_tensor(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in torch order, ``dtype``.

    Zero-copy (a view of the memory map) when the file already stores ``dtype``;
    otherwise one converted copy, with the mapped file pages released.
    Raises PowerInferError for a missing tensor or an unsupported GGML type.
    """
    t = _tensor(g, name)
    src = _as_torch(g, name, t)
    if _NATIVE.get(t.tensor_type.name) == dtype:
        return src
    out = empty(src.shape, dtype)
    out.copy_(src)
    _release(g, t)
    return out


def tensor_shape(g: GGUFFile, name: str) -> tuple[int, ...]:
    """Torch-order shape of a GGUF tensor (no data read)."""
    return tuple(int(d) for d in reversed(_tensor(g, name).shape.tolist()))


def load_rows_into(g: GGUFFile, name: str, out: torch.Tensor) -> None:
    """Copy tensor ``name`` into ``out`` (same shape, any dtype/strides), then release its pages."""
    t = _tensor(g, name)
    src = _as_torch(g, name, t)
    if tuple(src.shape) != tuple(out.shape):
        raise PowerInferError(f"{g.path}: tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(out.shape)}")
    out.copy_(src)
    _release(g, t)


def load_concat(g: GGUFFile, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """Tensors ``names`` (same trailing dims) stacked along dim 0 into one new tensor, no temporaries."""
    shapes = [tensor_shape(g, n) for n in names]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise PowerInferError(f"{g.path}: {', '.join(names)} have shapes {shapes} that do not stack")
    out = empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype)
    r = 0
    for n, s in zip(names, shapes):
        load_rows_into(g, n, out[r:r + s[0]])
        r += s[0]
    return out


# ---------------------------------------------------------------------------- quantized files
def weight_nbytes(w) -> float:
    """Bytes of a tensor, a QWeight or a (nested) list or tuple of them; 0 for None."""
    if w is None:
        return 0.0
    if isinstance(w, (list, tuple)):
        return sum(weight_nbytes(p) for p in w)
    return float(w.nbytes) if isinstance(w, QWeight) else float(w.numel() * w.element_size())


def weight_type(w) -> str:
    """A weight's storage type as a name: ``q4_0``, ``f16``, ``bf16``, ``float32``... (``+``-joined for a list)."""
    if isinstance(w, (list, tuple)):
        return "+".join(dict.fromkeys(weight_type(p) for p in w))
    return w.btype.name.lower() if isinstance(w, QWeight) else str(w.dtype).removeprefix("torch.")


def is_quantized(g: GGUFFile) -> bool:
    """True when any tensor of ``g`` has a block-quantized type."""
    return any(t.tensor_type.name not in FLOAT_TYPES for t in g.tensors.values())


def _computed_in_place(kind: str, ndim: int, mapped: bool) -> bool:
    """True when a tensor of GGML type ``kind`` stays in the file's bytes (a :class:`QWeight` the
    C kernels compute on): ``mapped`` (the C backend), a 2-D matrix of one of :data:`MAPPED_TYPES`, or
    a 3-D stack of such matrices (MoE experts, sliced by rows in :mod:`.moe`)."""
    return mapped and kind in MAPPED_TYPES and ndim in (2, 3)


def _dequantizable(t) -> bool:
    """True when ``gguf``'s numpy dequantizers read tensor ``t``'s type."""
    from gguf import GGML_QUANT_SIZES, quants

    try:
        quants.dequantize(np.zeros(GGML_QUANT_SIZES[t.tensor_type][1], np.uint8), t.tensor_type)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def check_dequantized(g: GGUFFile, dtype: torch.dtype, mapped: bool, available: int | None) -> int:
    """The one rule for block-quantized tensors the kernels do not compute on (a type without a C
    kernel, or every quantized tensor with the torch backend: ``mapped`` False): they are dequantized
    to ``dtype`` at load only if all those copies fit in ``available`` bytes (None: unknown, taken as
    fitting); then, with the C kernels, a warning gives the copies' size. Else PowerInferError naming
    the first such tensor and its type, before anything is allocated; also for a type ``gguf`` cannot
    dequantize either. Returns the copies' bytes (0 when every quantized tensor has a kernel)."""
    size = torch.empty((), dtype=dtype).element_size()
    copies: dict[str, list] = {}  # type -> [first tensor, count, bytes]
    for name, t in g.tensors.items():
        kind = t.tensor_type.name
        if kind in FLOAT_TYPES or _computed_in_place(kind, len(t.shape), mapped):
            continue
        if not _dequantizable(t):
            raise PowerInferError(f"{g.path}: tensor {name!r} has type {kind}, which neither the kernels nor "
                                  "gguf's dequantizers read: not supported")
        c = copies.setdefault(kind, [name, 0, 0])
        c[1] += 1
        c[2] += int(np.prod([int(d) for d in t.shape])) * size
    total = sum(c[2] for c in copies.values())
    if not copies:
        return 0
    dt = str(dtype).removeprefix("torch.")
    kind, (first, count, _) = next(iter(copies.items()))
    if available is not None and total > available:
        why = "has no kernel here" if mapped else "is dequantized by the torch backend"
        n = sum(c[1] for c in copies.values())
        others = f" (with the {n - 1} other tensors without a kernel)" if n > 1 else ""
        raise PowerInferError(f"{g.path}: tensor {first!r} has type {kind}, which {why}; its {dt} copy{others} "
                              f"needs {_mib(total)}, more than the {_mib(available)} of memory available")
    if mapped:
        for kind, (first, count, nbytes) in copies.items():
            log.warning("%s: %d %s tensors (%s, ...) have no kernel here: dequantized to %s at load, %s "
                        "(the file holds them in %s)", g.path, count, kind, first, dt, _mib(nbytes),
                        _mib(sum(int(g.tensors[n].n_bytes) for n, tt in g.tensors.items()
                                 if tt.tensor_type.name == kind)))
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def load_matrix(g: GGUFFile, name: str, dtype: torch.dtype, mapped: bool, dense_use: bool = False):
    """A 2-D weight: a :class:`QWeight` view of the map when ``mapped`` and its type is one the
    kernels compute on (:data:`MAPPED_TYPES`: block-quantized, f16, bf16), else
    :func:`load_tensor` in ``dtype`` (a view of the map when the file stores ``dtype``: f32,
    or bf16 computed in bf16 on a CPU with bf16 dot products; a dequantized copy for a quantized
    type without a kernel, which :func:`check_dequantized` allowed before the load began).

    ``dense_use``: the matrix is only used in dense products (never by rows), so a Q4_0 one
    is re-laid out in 8-row groups (``kernels.for_dense_products``; a copy in anonymous
    memory, the mapped pages released: resident once either way).

    A tensor whose byte size does not match its type and shape, or whose rows are not whole
    blocks, never gets here: :func:`~powerinfer.formats.gguf_file.open_gguf` refuses the file.
    """
    t = _tensor(g, name)
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if not _computed_in_place(kind, len(shape), mapped) or _NATIVE.get(kind) == dtype:
        return load_tensor(g, name, dtype)  # a quantized one: allowed by check_dequantized
    w = mapped_rows(g, name, shape[0], shape[1])
    return dense_layout(g, [name], w) if dense_use else w


def mapped_rows(g: GGUFFile, name: str, n_rows: int, n_cols: int) -> QWeight:
    """Tensor ``name`` (a type of :data:`MAPPED_TYPES`) as one :class:`QWeight` view of the map of
    ``n_rows`` rows of ``n_cols`` values (a 3-D stack of experts: ``n_expert * rows`` rows), its
    scales checked: PowerInferError naming the file, tensor and row for a NaN or infinite one."""
    t = _tensor(g, name)
    kind = t.tensor_type.name
    bt = MAPPED_TYPES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only map; weights are never written
        raw = torch.from_numpy(t.data.view(np.uint8).reshape(n_rows, bt.row_bytes(n_cols)))
    w = QWeight(raw, bt, n_rows, n_cols)
    bad = w.first_nonfinite_row()
    if bad is not None:
        what = "value" if kind == "F16" else "block scale"
        raise PowerInferError(f"{g.path}: tensor {name!r} ({kind}) has a NaN or infinite {what} in row {bad}: "
                              "the file is corrupt")
    return w


def dense_layout(g: GGUFFile, names: list[str], w):
    """``w`` (loaded from tensors ``names``) in the layout dense products run fastest on,
    releasing the pages it was read from when that made a copy."""
    from .kernels import for_dense_products

    out = for_dense_products(w, empty)
    if out is not w and is_mapped(g, w.raw):
        for n in names:
            _release(g, _tensor(g, n))
    return out


def stack_rows(g: GGUFFile, names: list[str], parts: list) -> "QWeight | list":
    """QWeights ``parts`` (same type and row length) stacked into one (copied into anonymous
    memory, the mapped pages released), or the list itself when their types differ."""
    first = parts[0]
    if any(p.btype != first.btype or p.n_cols != first.n_cols for p in parts):
        return list(parts)
    n = sum(p.n_rows for p in parts)
    raw = empty((n, first.raw.shape[1]), torch.uint8)
    r = 0
    for name, p in zip(names, parts):
        raw[r:r + p.n_rows].copy_(p.raw)
        r += p.n_rows
        _release(g, _tensor(g, name))
    return QWeight(raw, first.btype, n, first.n_cols)

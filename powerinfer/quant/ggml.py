"""Q4_0 and Q8_0 quantizers that give ggml's reference bytes, bit for bit.

They follow ``quantize_row_q4_0_reference`` / ``quantize_row_q8_0_reference`` in ggml's
``ggml-quants.c`` (upstream PowerInfer's copy of ggml has the same loops), which
llama.cpp's and PowerInfer's ``quantize`` tools use to write model files. Per block of
32 fp32 values, all arithmetic in fp32:

* Q4_0: ``max`` = the value of largest ``|x|`` with its sign (the first on ties; ``+0.0``
  for an all-zero block), ``d = max / -8``, ``id = d ? 1/d : 0``,
  ``q_j = MIN(15, (int8_t)(x_j * id + 8.5f))`` (truncation toward zero); byte ``j`` of
  ``qs`` holds ``q_j`` in its low nibble and ``q_{j+16}`` in its high nibble.
* Q8_0: ``amax = max |x|``, ``d = amax / 127``, ``id = d ? 1/d : 0``,
  ``q_j = roundf(x_j * id)`` (halves away from zero).

``d`` is stored as an IEEE half, rounded to nearest even (``GGML_FP32_TO_FP16``).

Where C leaves the float-to-``int8_t`` conversion undefined (an infinite ``x * id``,
which happens only when ``|d| <= 2**-128``, i.e. blocks whose largest ``|x|`` is below
about 2.4e-38 for Q4_0 or 3.7e-37 for Q8_0, or 0 * inf = NaN) we give what x86 builds produce: ``cvttss2si`` returns
``INT32_MIN`` and the low byte, 0, is kept. NaN and inf inputs are refused.

The ``gguf`` package's ``gguf.quants.quantize`` agrees with these functions except that
its Q4_0 takes ``max`` from ``argmax(|x|)`` as numpy stores it, so an all-zero block
whose first value is ``-0.0`` gets ``d = +0.0`` where ggml writes ``-0.0`` (tested in
``tests/test_quantize.py``). We assume the C compiler does not contract
``x * id + 8.5f`` into a fused multiply-add (``-ffp-contract=off``, or a target without
FMA); with contraction a tie can round the other way.

Whole ``[N, K]`` matrices are processed at once, in chunks of rows so the temporaries
stay near :data:`CHUNK_VALUES` values whatever the tensor size.
"""
from __future__ import annotations

import numpy as np

from ..errors import PowerInferError
from .types import WRITE_TYPES, BlockType

QK = 32  # values per block, both types
CHUNK_VALUES = 1 << 20  # fp32 values quantized per step (a few MB of temporaries)

_F = np.float32


def _block_type(name: str) -> BlockType:
    bt = WRITE_TYPES.get(name.lower())
    if bt is None:
        raise PowerInferError(f"quantization type {name!r} is not supported; "
                              f"supported: {', '.join(sorted(WRITE_TYPES))}")
    return bt


def _c_int8(t: np.ndarray) -> np.ndarray:
    """C's ``(int8_t)`` of fp32 ``t`` as x86 compiles it: truncate to int32
    (``cvttss2si``: NaN and out-of-range give ``INT32_MIN``), keep the low byte. int16."""
    ok = np.isfinite(t) & (np.abs(t) < _F(2.0**31))
    i = np.where(ok, np.trunc(t), _F(-2.0**31)).astype(np.int64)
    return (((i & 0xFF) ^ 0x80) - 0x80).astype(np.int16)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` in fp32 (overflows to inf as C does)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, _F(1.0) / np.where(d != 0, d, _F(1.0)), _F(0.0)).astype(_F)


def _half_bytes(d: np.ndarray) -> np.ndarray:
    """fp32 ``[n]`` -> the little-endian bytes ``[n, 2]`` of IEEE halves, nearest-even
    (|d| >= 65520 becomes inf, as ``GGML_FP32_TO_FP16`` gives)."""
    with np.errstate(over="ignore"):
        return d.astype("<f2").view(np.uint8).reshape(-1, 2)


def _q4_0_blocks(b: np.ndarray) -> np.ndarray:
    """fp32 ``[n, 32]`` blocks -> uint8 ``[n, 18]``."""
    a = np.abs(b)
    rows = np.arange(b.shape[0])
    imax = a.argmax(axis=1)  # first index of the largest |x|, as the C loop's strict '<'
    mx = b[rows, imax]
    mx = np.where(a[rows, imax] > 0, mx, _F(0.0))  # C keeps max = +0.0 unless some |x| > 0
    d = (mx / _F(-8.0)).astype(_F)
    idv = _inverse(d)
    with np.errstate(over="ignore", invalid="ignore"):
        t = b * idv[:, None]  # fp32: x * id, then + 8.5f
        t += _F(8.5)
    if np.isfinite(idv).all():  # then 0.5 <= t < 17: a plain truncating cast is C's
        q = np.minimum(t.astype(np.uint8), np.uint8(15))
    else:
        q = np.minimum(_c_int8(t), 15).astype(np.uint8)  # MIN(15, (int8_t)...) stored in a uint8_t
    qs = q[:, :16] | (q[:, 16:] << 4)
    out = np.empty((b.shape[0], 18), np.uint8)
    out[:, :2] = _half_bytes(d)
    out[:, 2:] = qs
    return out


def _roundf(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: nearest, halves away from zero (exact: ``x - trunc(x)`` has no rounding)."""
    r = np.trunc(x)
    return r + np.where(np.abs(x - r) >= _F(0.5), np.sign(x), _F(0.0)).astype(_F)


def _q8_0_blocks(b: np.ndarray) -> np.ndarray:
    """fp32 ``[n, 32]`` blocks -> uint8 ``[n, 34]``."""
    d = (np.abs(b).max(axis=1) / _F(127.0)).astype(_F)
    idv = _inverse(d)
    with np.errstate(over="ignore", invalid="ignore"):
        r = _roundf(b * idv[:, None])
    q = r.astype(np.int8) if np.isfinite(idv).all() else _c_int8(r)  # |r| <= 127 when id is finite
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = _half_bytes(d)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out


_BLOCKS = {"q4_0": _q4_0_blocks, "q8_0": _q8_0_blocks}


def quantize(arr: np.ndarray, name: str, tensor: str = "tensor", first_row: int = 0) -> np.ndarray:
    """Quantize ``arr`` (``[N, K]`` or ``[K]``, any float dtype; a memory map is read and
    widened to fp32 a chunk of rows at a time) to ``name`` (``"q4_0"`` or ``"q8_0"``):
    uint8 ``[N, row_bytes]`` (``row_bytes = K / 32 * 18`` for Q4_0, ``K / 32 * 34`` for Q8_0).

    Raises PowerInferError naming ``tensor`` for an unknown ``name``, a ``K`` that is not
    a multiple of 32, or a NaN or infinite value (its row counted from ``first_row``).
    """
    bt = _block_type(name)
    fn = _BLOCKS[bt.name.lower()]
    a2 = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if a2.ndim != 2:
        raise PowerInferError(f"{tensor}: expected a 1-D or 2-D array to quantize, got shape {list(arr.shape)}")
    n, k = a2.shape
    if k % QK:
        raise PowerInferError(f"{tensor}: rows of {k} values are not a multiple of the block size {QK}; "
                              "cannot quantize")
    rb = bt.row_bytes(k)
    out = np.empty((n, rb), np.uint8)
    step = max(1, CHUNK_VALUES // max(k, 1))
    for s in range(0, n, step):
        x = np.asarray(a2[s:s + step], dtype=_F)
        with np.errstate(over="ignore", invalid="ignore"):
            total = x.sum(dtype=_F)  # one cheap sum in the usual case; huge finite values may overflow it
        if not np.isfinite(total) and not np.isfinite(x).all():
            r = first_row + s + int(np.argwhere(~np.isfinite(x))[0][0])
            raise PowerInferError(f"{tensor}: row {r} holds NaN or infinite values; refusing to quantize")
        out[s:s + x.shape[0]] = fn(x.reshape(-1, QK)).reshape(x.shape[0], rb)
    return out


def dequantize(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 array of torch-order ``shape`` from quantized bytes ``raw`` (uint8, any shape
    with ``row_bytes`` bytes per row); the exact inverse map ggml's ``dequantize_row_*``
    computes (``d * q``, fp16 ``d`` widened to fp32)."""
    import gguf

    bt = _block_type(name)
    flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, bt.nbytes)
    n = 1
    for s in shape:
        n *= s
    if flat.shape[0] * QK != n:
        raise PowerInferError(f"{bt.name} data of {raw.nbytes} bytes does not hold shape {list(shape)}")
    return gguf.quants.dequantize(flat, bt.ggml).reshape(shape)

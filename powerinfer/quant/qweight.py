"""A block-quantized (or f16) weight matrix kept as the file stores it.

:class:`QWeight` holds the raw bytes of an ``[N, K]`` matrix (``N`` rows of ``K`` values,
torch ``Linear`` layout) in one of :data:`MAPPED_TYPES`, usually as a zero-copy view of
the GGUF memory map, so a quantized model is resident at its file size. The runtime's
kernels (``powerinfer.runtime.kernels``) compute on it directly; :meth:`dequantize`
is the reference (``gguf``'s numpy dequantizers) for tests and the torch backend.

``layout`` is ``rows`` (the file's row-major blocks) or ``x8``: a Q4_0/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrix
re-laid out in groups of 8 rows for dense products (:meth:`QWeight.to_x8`; same size, see
``qkernels.c``), which cannot be sliced by row.

``.T`` gives the same bytes marked transposed (``[K, N]``), so a dense file's ``ffn_down``
``[n_embd, n_ff]`` can stand where the FFN expects ``down_t`` ``[n_ff, n_embd]``, as a
transposed torch view does for float weights; :meth:`is_contiguous` is False for it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import quants

from .types import KERNEL_TYPES, BlockType, _bt

F16 = BlockType("F16", _bt("F16").ggml, 1, 2)
BF16 = BlockType("BF16", _bt("BF16").ggml, 1, 2)
MAPPED_TYPES: dict[str, BlockType] = {**KERNEL_TYPES, "F16": F16, "BF16": BF16}


@dataclass(eq=False)
class QWeight:
    raw: torch.Tensor  # uint8 [N, row_bytes]
    btype: BlockType
    n_rows: int  # N
    n_cols: int  # K (values per row)
    transposed: bool = False
    layout: str = "rows"  # or "x8" (Q4_0/Q8_0, n_rows a multiple of 8)

    def __post_init__(self):
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (self.n_rows, self.btype.row_bytes(self.n_cols)):
            raise ValueError(f"{self.btype.name} [{self.n_rows}, {self.n_cols}]: raw bytes {tuple(self.raw.shape)} "
                             f"{self.raw.dtype} do not match")

    # ------------------------------------------------------------ tensor-like surface
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n_cols, self.n_rows) if self.transposed else (self.n_rows, self.n_cols))

    @property
    def T(self) -> "QWeight":
        return replace(self, transposed=not self.transposed)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of what it computes in (f32): the quantized bytes have no torch dtype."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def is_contiguous(self) -> bool:
        return not self.transposed and self.raw.is_contiguous()

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def numel(self) -> int:
        return self.n_rows * self.n_cols

    def element_size(self) -> float:
        """Bytes per value (fractional: Q4_0 is 18/32)."""
        return self.btype.nbytes / self.btype.block

    # ------------------------------------------------------------ checks
    _SCALES = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q5_K": (0, 2)}  # byte offsets of fp16 scales

    def first_nonfinite_row(self, rows_per_chunk: int = 4096) -> int | None:
        """The first stored row holding a NaN/inf fp16 block scale (every value for F16/BF16), or None.

        Reads the scales only (2-4 bytes per block), ``rows_per_chunk`` rows at a time.
        """
        raw = self._rows_raw()
        for r0 in range(0, self.n_rows, rows_per_chunk):
            part = raw[r0:r0 + rows_per_chunk]
            if self.btype in (F16, BF16):
                halves = part.view(np.uint16)
                exp = 0x7C00 if self.btype is F16 else 0x7F80
                bad = ((halves & exp) == exp).any(axis=1)
                if bad.any():
                    return r0 + int(np.argmax(bad))
                continue
            else:
                blocks = part.reshape(part.shape[0], -1, self.btype.nbytes)
                halves = np.concatenate([blocks[:, :, o:o + 2].copy().view(np.uint16)
                                         for o in self._SCALES[self.btype.name]], axis=1)
            bad = ((halves & 0x7C00) == 0x7C00).any(axis=tuple(range(1, halves.ndim)))
            if bad.any():
                return r0 + int(np.argmax(bad))
        return None

    # ------------------------------------------------------------ 8-row groups
    X8_TYPES = ("Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

    def can_x8(self) -> bool:
        return (self.btype.name in self.X8_TYPES and self.layout == "rows" and self.n_rows % 8 == 0
                and not self.transposed)

    def _x8_parts(self) -> tuple[int, int, int]:
        """(bytes before the chunks, bytes in 4-byte chunks, bytes after them) of one block in ``x8``:
        Q4_0/Q8_0/Q5_0 put their fp16 scale first (Q5_1 its scale and min); the K-quants chunk from
        byte 0 (Q6_K's last 2 bytes, its fp16 d, after the chunks)."""
        bb, head = self.btype.nbytes, {"Q4_0": 2, "Q8_0": 2, "Q5_0": 2, "Q5_1": 4}.get(self.btype.name, 0)
        return head, (bb - head) // 4 * 4, (bb - head) % 4

    def to_x8(self, out: torch.Tensor | None = None) -> "QWeight":
        """This Q4_0/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrix in the ``x8`` layout (into ``out``, uint8 of the same
        shape, if given): same bytes, grouped for kernels that compute 8 rows at once.

        Group ``g`` of 8 rows, block ``b``: the 8 rows' leading bytes (Q4_0/Q8_0: their fp16
        scales), row after row; then for each 4-byte chunk ``c`` of the block's middle (Q4_0: its
        16 nibble bytes; Q8_0: its 32 quants; Q5_0/Q5_1: qh and the nibbles; Q4_K/Q5_K: the whole block;
        Q6_K: all but its fp16 d)
        the bytes ``4c..4c+3`` of each row, row after row; then the 8 rows' trailing bytes
        (Q6_K's d). ``qkernels.c`` (x8 sections) reads it.
        """
        if not self.can_x8():
            raise ValueError(f"{self!r}: only untransposed {'/'.join(self.X8_TYPES)} rows, a multiple of 8 of "
                             "them, go to x8")
        G, bb = self.n_rows // 8, self.btype.nbytes
        nb = self.n_cols // self.btype.block
        head, mid, tail = self._x8_parts()
        out = torch.empty_like(self.raw) if out is None else out
        src, dst = self.raw.numpy(), out.numpy()
        step = max(1, (1 << 24) // max(1, 8 * src.shape[1]))  # ~16 MB of rows per chunk
        for g0 in range(0, G, step):
            n = min(G, g0 + step) - g0
            blk = src[8 * g0:8 * (g0 + n)].reshape(n, 8, nb, bb)
            part = dst[8 * g0:8 * (g0 + n)].reshape(n, nb, 8 * bb)
            part[..., :8 * head] = blk[..., :head].transpose(0, 2, 1, 3).reshape(n, nb, 8 * head)
            part[..., 8 * head:8 * (head + mid)] = blk[..., head:head + mid].reshape(n, 8, nb, mid // 4, 4).transpose(
                0, 2, 3, 1, 4).reshape(n, nb, 8 * mid)
            part[..., 8 * (head + mid):] = blk[..., head + mid:].transpose(0, 2, 1, 3).reshape(n, nb, 8 * tail)
        return QWeight(out, self.btype, self.n_rows, self.n_cols, layout="x8")

    def _rows_raw(self) -> np.ndarray:
        """The row-major block bytes ``[N, row_bytes]`` (undoing ``x8``)."""
        raw = self.raw.numpy()
        if self.layout == "rows":
            return raw
        G, bb = self.n_rows // 8, self.btype.nbytes
        nb = self.n_cols // self.btype.block
        head, mid, tail = self._x8_parts()
        blk = raw.reshape(G, nb, 8 * bb)
        out = np.empty((G, 8, nb, bb), np.uint8)
        out[..., :head] = blk[..., :8 * head].reshape(G, nb, 8, head).transpose(0, 2, 1, 3)
        out[..., head:head + mid] = blk[..., 8 * head:8 * (head + mid)].reshape(G, nb, mid // 4, 8, 4).transpose(
            0, 3, 1, 2, 4).reshape(G, 8, nb, mid)
        out[..., head + mid:] = blk[..., 8 * (head + mid):].reshape(G, nb, 8, tail).transpose(0, 2, 1, 3)
        return out.reshape(self.n_rows, -1)

    def index_select(self, dim: int, ids: torch.Tensor) -> "QWeight":
        """Rows ``ids`` (of the stored, untransposed matrix) copied into a new QWeight."""
        if dim != 0 or self.transposed or self.layout != "rows":
            raise ValueError("QWeight selects stored rows only (dim 0, untransposed, row layout)")
        return QWeight(self.raw.index_select(0, ids.to(torch.long)).contiguous(), self.btype, int(ids.numel()),
                       self.n_cols)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The stored rows (all, a slice, or LongTensor ``rows``) as ``dtype`` ``[n, K]``, untransposed.

        Reference implementation (``gguf.quants.dequantize``, numpy), not the fast path.
        """
        arr = self._rows_raw()
        arr = arr if rows is None else arr[rows.numpy() if isinstance(rows, torch.Tensor) else rows]
        if self.btype is F16:
            out = arr.view(np.float16).astype(np.float32)
        elif self.btype is BF16:
            out = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            out = quants.dequantize(arr, self.btype.ggml)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(dtype)

    def __repr__(self) -> str:
        t = ".T" if self.transposed else ""
        lay = "" if self.layout == "rows" else f", {self.layout}"
        return f"QWeight({self.btype.name}{lay}, [{self.n_rows}, {self.n_cols}]{t}, {self.nbytes} bytes)"

"""A block-quantized (or f16) weight matrix kept as the file stores it.

:class:`QWeight` holds the raw bytes of an ``[N, K]`` matrix (``N`` rows of ``K`` values,
torch ``Linear`` layout) in one of :data:`MAPPED_TYPES`, usually as a zero-copy view of
the GGUF memory map, so a quantized model is resident at its file size. The runtime's
kernels (``powerinfer.runtime.kernels``) compute on it directly; :meth:`dequantize`
is the reference (``gguf``'s numpy dequantizers) for tests and the torch backend.

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
MAPPED_TYPES: dict[str, BlockType] = {**KERNEL_TYPES, "F16": F16}


@dataclass(eq=False)
class QWeight:
    raw: torch.Tensor  # uint8 [N, row_bytes]
    btype: BlockType
    n_rows: int  # N
    n_cols: int  # K (values per row)
    transposed: bool = False

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

    # ------------------------------------------------------------ rows
    def index_select(self, dim: int, ids: torch.Tensor) -> "QWeight":
        """Rows ``ids`` (of the stored, untransposed matrix) copied into a new QWeight."""
        if dim != 0 or self.transposed:
            raise ValueError("QWeight selects stored rows only (dim 0, untransposed)")
        return QWeight(self.raw.index_select(0, ids.to(torch.long)).contiguous(), self.btype, int(ids.numel()),
                       self.n_cols)

    def rows(self, r0: int, r1: int) -> "QWeight":
        """Rows ``[r0, r1)`` as a view."""
        return QWeight(self.raw[r0:r1], self.btype, r1 - r0, self.n_cols)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The stored rows (all, a slice, or LongTensor ``rows``) as ``dtype`` ``[n, K]``, untransposed.

        Reference implementation (``gguf.quants.dequantize``, numpy), not the fast path.
        """
        raw = self.raw if rows is None else self.raw[rows]
        arr = raw.numpy()
        if self.btype is F16:
            out = arr.view(np.float16).astype(np.float32)
        else:
            out = quants.dequantize(arr, self.btype.ggml)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(dtype)

    def __repr__(self) -> str:
        t = ".T" if self.transposed else ""
        return f"QWeight({self.btype.name}, [{self.n_rows}, {self.n_cols}]{t}, {self.nbytes} bytes)"

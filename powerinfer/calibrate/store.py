"""Row files: flat ``[N, width]`` arrays on disk, read and written by row range.

The layer-streamed pass keeps every calibration token's hidden state between layers
(``N x n_embd`` in the compute dtype: 0.5 GiB for 65,536 tokens of a 7B in bf16) and
writes predictor training rows at known offsets. Both go through :class:`RowFile`:
explicit ``pread``/``pwrite`` of row ranges, so the process holds one batch at a time
whatever ``N`` is, and the operating system's page cache keeps the file in memory when
there is room (it does not count towards the process's resident memory). A killed run
leaves complete rows behind for every batch it finished, which is what makes resuming
safe (:mod:`powerinfer.calibrate.stream`).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["RowFile"]

_CHUNK = 1 << 30  # bytes per pread/pwrite call (Linux moves at most ~2 GiB per call)
_AS_NUMPY = {torch.bfloat16: torch.int16, torch.float16: torch.float16, torch.float32: torch.float32,
             torch.uint8: torch.uint8}


class RowFile:
    """A file of ``rows x width`` elements of ``dtype`` (row-major), opened for reading and writing.

    ``create=True`` (re)creates it at its full size (sparse; zero bytes until written).
    Raises OSError from the file system, naming this file (a full disk shows up in ``write``).
    """

    def __init__(self, path: str | Path, rows: int, width: int, dtype: torch.dtype, create: bool = False):
        self.path, self.rows, self.width, self.dtype = Path(path), int(rows), int(width), dtype
        self.row_bytes = self.width * torch.empty((), dtype=dtype).element_size()
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        self.fd = os.open(self.path, flags, 0o666)
        if create:
            os.ftruncate(self.fd, self.rows * self.row_bytes)
        else:
            size = os.fstat(self.fd).st_size
            if size != self.rows * self.row_bytes:
                os.close(self.fd)
                raise OSError(f"{self.path}: {size} bytes, expected {self.rows} rows x {self.row_bytes} bytes")

    def _bytes(self, t: torch.Tensor) -> memoryview:
        return memoryview(t.view(_AS_NUMPY[self.dtype]).numpy()).cast("B")

    def read(self, row: int, n: int) -> torch.Tensor:
        """Rows ``row .. row+n-1`` as a new CPU tensor ``[n, width]``."""
        if row < 0 or n < 0 or row + n > self.rows:
            raise IndexError(f"{self.path}: rows {row}..{row + n} out of 0..{self.rows}")
        t = torch.empty(n, self.width, dtype=self.dtype)
        mv, off, done = self._bytes(t), row * self.row_bytes, 0
        while done < len(mv):
            k = os.preadv(self.fd, [mv[done:done + _CHUNK]], off + done)
            if k <= 0:
                raise OSError(f"{self.path}: short read at byte {off + done}")
            done += k
        return t

    def write(self, row: int, t: torch.Tensor) -> None:
        """Write ``t`` ``[n, width]`` (any device; converted to ``dtype``) at row ``row``."""
        t = t.detach().reshape(-1, self.width).to(device="cpu", dtype=self.dtype).contiguous()
        if row < 0 or row + t.shape[0] > self.rows:
            raise IndexError(f"{self.path}: rows {row}..{row + t.shape[0]} out of 0..{self.rows}")
        mv, off, done = self._bytes(t), row * self.row_bytes, 0
        try:
            while done < len(mv):
                done += os.pwritev(self.fd, [mv[done:done + _CHUNK]], off + done)
        except OSError as e:  # ENOSPC from a sparse file filling up: say which file
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RowFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Cold FFN rows read from disk under a RAM budget (``--ram-budget``; plan in :mod:`.residency`).

**Sources.** A neuron's rows are read either from the PowerInfer GGUF itself (gate, up and
down_t rows of neuron ``j`` lie in three tensors, up and down_t in two for ungated families: one
read per tensor, in neuron order) or from a
*row cache*: one file beside the kernels' cache (``~/.cache/powerinfer/rows/``, or
``$POWERINFER_ROW_CACHE``, a folder) holding, per layer, each neuron's gate, up and down
rows as one record (padded to whole pages), the layer's hot neurons first, then by
activation count: one read per neuron, and neurons likely to be needed together lie side by
side, so runs of them coalesce (row-column bundling, LLM in a Flash). The GGUF stays as it
is; the row cache is written atomically on first use (a temporary file renamed; a few seconds
per GB) and is used only while it matches the GGUF, else rebuilt, never reused:

* its file name holds a hash of what its layout follows from (the GGUF's header and size, the
  row types, the record order, which the activation counts give), so runs with different
  ``--activation`` folders use different files side by side;
* its header holds the sha256 of the FFN rows it was copied from (hashed as they were read) and
  the GGUF's stamp then (device, inode, size, modification and status-change times: the
  kernel moves ``st_ctime`` on every write, and user space cannot set it back). While the
  stamp is unchanged the rows are the GGUF's; when it changed (re-converted, fine-tuned,
  copied, touched) the GGUF's FFN rows are hashed again (~1.5 GB/s: ~2 s for a 7B Q4_0
  model's FFN) and a different hash rebuilds the cache; the same hash is noted with the new
  stamp in a small ``.stamp`` file beside the cache, so the next open does not hash again.

``$POWERINFER_ROW_CACHE=off`` reads the GGUF.

**Reads.** Per layer and token, the predicted-active neurons not resident are read in one
batch: sorted by file position, neighbours within :data:`MAX_GAP` records merged into one read
(the records between are read and dropped), shared out among :data:`IO_THREADS` threads by
``cold_rows.c`` (compiled once like the kernels, called from a thread so the GIL is free; without
a compiler ``os.preadv`` from a thread pool). While they are in flight the resident neurons'
gate/up products run. The page-aligned row cache is read with ``O_DIRECT`` into a staging buffer
per thread (nothing enters the page cache); the GGUF's rows are read buffered, the file opened
with ``POSIX_FADV_RANDOM`` and the pages a layer read dropped after it (``POSIX_FADV_DONTNEED``),
so the page cache does not grow past the budget either way.

**Resident rows.** One slab per FFN matrix for the whole model (:class:`RowPool`, in the file's
type, a :class:`QWeight`): each layer's pinned hot rows in a fixed range (read once at load),
then the reuse window shared by the layers (the slots of the oldest tokens replaced first). The
products run on the slab with the same row kernels as the full matrices, the slots given in
neuron order, so a token's numbers equal those of the unlimited run (unless one layer needs more
cold neurons than the whole window holds: those run in passes whose sums are added, which may
round differently; :attr:`ReadStats.split` counts them).

**Errors.** A short read (the file shrank), a read error, or a file whose size, time stamp
or inode changed since it was opened is a PowerInferError naming the file (and the offset
for reads); every forward pass checks first (:meth:`RowReader.check`).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES, QWeight
from . import kernels
from .ffn import finish_rows, gate_min
from .residency import ResidencyPlan

log = logging.getLogger(__name__)

IO_THREADS = 16  # reads in flight
MAX_GAP = 2  # records (or rows) between two needed ones still read in one request
MAX_IOV = 1000  # buffers per preadv (IOV_MAX is 1024 on Linux)
MAX_JOB = 1 << 20  # bytes per O_DIRECT read (each reading thread has a staging buffer this size)
DIRECT_ENV = "POWERINFER_ROW_DIRECT"  # off: buffered reads + POSIX_FADV_DONTNEED instead of O_DIRECT
PAGE = 4096
ROW_CACHE_ENV = "POWERINFER_ROW_CACHE"
MAGIC = b"PIROWS01"
HEADER_MAX = 1 << 20
WRITE_CHUNK = 8 << 20  # bytes of FFN rows write_row_cache and weights_digest hold at a time
SETTLE_NS = 2_000_000_000  # a GGUF changed this recently when its rows were copied: its stamp is not trusted


# ---------------------------------------------------------------------------- file identity
@dataclass(frozen=True)
class _Stamp:
    size: int
    mtime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_Stamp":
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class _File:
    """One file opened for reads, with its identity when opened; ``direct``: also opened with
    ``O_DIRECT`` (``dfd``, -1 where the file system refuses it, or after a read it refused:
    buffered reads then). ``watch_name``: :meth:`check` also fails when the path names another
    file now (the GGUF); a row cache another process replaced is harmless (the open file is
    still read), so its name is not watched."""

    def __init__(self, path: Path, direct: bool = False, watch_name: bool = True):
        self.path = Path(path)
        self.watch_name = watch_name
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.dfd = -1
        if direct and hasattr(os, "O_DIRECT") and os.environ.get(DIRECT_ENV) != "off":
            try:
                self.dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self.dfd = -1
        self.stamp = _Stamp.of(os.fstat(self.fd))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def check(self) -> None:
        """PowerInferError when the file was truncated, rewritten or replaced since it was opened."""
        try:
            now = _Stamp.of(os.fstat(self.fd))
            named = _Stamp.of(os.stat(self.path)) if self.watch_name else now
        except OSError as e:
            raise PowerInferError(f"{self.path}: changed while running ({e.strerror or e})") from None
        if now != self.stamp or (named.ino, named.dev) != (self.stamp.ino, self.stamp.dev):
            what = ("truncated or extended" if now.size != self.stamp.size else
                    "replaced" if (named.ino, named.dev) != (now.ino, now.dev) else "rewritten")
            raise PowerInferError(f"{self.path}: the file was {what} while running: its rows can no longer be read")

    def drop_direct(self) -> None:
        """Read buffered from now on (the file system refused an O_DIRECT read)."""
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def drop_cache(self, off: int, n: int) -> None:
        if n > 0 and self.fd >= 0 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1


def _read_failed(f: _File, off: int, n: int, got: int, err: str | None = None) -> PowerInferError:
    """The error for a read of ``n`` bytes at ``off`` that failed (``err``) or returned ``got``."""
    if err is not None:
        return PowerInferError(f"{f.path}: read error at offset {off} ({n} bytes): {err}")
    return PowerInferError(f"{f.path}: short read at offset {off}: {got} of {n} bytes (the file is "
                           f"{os.fstat(f.fd).st_size} bytes now, {f.stamp.size} when opened): "
                           "it changed while running")


def _preadv(f: _File, bufs: list, off: int, n: int) -> int:
    """Read ``n`` bytes at ``off`` into ``bufs``; PowerInferError naming the file and offset on an
    error or a short read."""
    try:
        got = os.preadv(f.fd, bufs, off)
    except OSError as e:
        raise _read_failed(f, off, n, 0, str(e.strerror or e)) from None
    if got != n:
        raise _read_failed(f, off, n, got)
    return got


# ---------------------------------------------------------------------------- the C reader
_C = {"lib": None, "tried": False}
CSOURCE = Path(__file__).with_name("cold_rows.c")
READER_ENV = "POWERINFER_ROW_READER"  # python: os.preadv from a thread pool instead of cold_rows.c


def _lib():
    """``cold_rows.c`` compiled once (cached by source and compiler under the kernels' cache), or
    None when it cannot be built (the Python reader is used then, with a note)."""
    if os.environ.get(READER_ENV) == "python":
        return None
    if not _C["tried"]:
        _C["tried"] = True
        cc = os.environ.get("CC", "cc")
        flags = ["-O2", "-shared", "-fPIC", "-pthread"]
        try:  # a missing source (an install without it) falls back like a missing compiler
            key = hashlib.sha256(CSOURCE.read_bytes() + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
            out = kernels._cache_dir() / f"cold_rows-{key}.so"
            if not out.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
                os.close(fd)
                try:
                    r = subprocess.run([cc, *flags, str(CSOURCE), "-o", tmp], capture_output=True, text=True,
                                       timeout=120)
                    if r.returncode != 0:
                        raise OSError(r.stderr.strip()[-300:])
                    os.replace(tmp, out)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            lib = ctypes.CDLL(str(out))
            P, I = ctypes.c_void_p, ctypes.c_int64
            C = ctypes.c_int
            lib.pi_read_records.argtypes = [C, C, I, I, C, P, P, P, P, P, P, P, I, I, I, C, P, I, P, P]
            lib.pi_read_records.restype = I
            _C["lib"] = lib
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("the C row reader could not be built (%s): reading with os.preadv threads", e)
    return _C["lib"]


# ---------------------------------------------------------------------------- sources
@dataclass
class Stream:
    """Records of one layer in one file: record ``p`` at ``base + p * stride`` holds parts
    ``(offset in record, bytes, matrix)``; ``pos[j]``: neuron ``j``'s record."""

    file: _File
    base: int
    stride: int
    parts: list[tuple[int, int, int]]
    pos: np.ndarray  # int64 [n_ff]
    aligned: bool = field(init=False)  # page-aligned records, at most MAX_JOB bytes each
    c_parts: tuple = field(init=False, repr=False)  # the parts' offsets, lengths, matrices for cold_rows.c

    def __post_init__(self):
        self.aligned = self.base % PAGE == 0 and self.stride % PAGE == 0 and self.stride <= MAX_JOB
        P = ctypes.c_int64 * len(self.parts)
        self.c_parts = tuple(P(*[p[k] for p in self.parts]) for k in range(3))

    @property
    def direct(self) -> bool:
        """Read with O_DIRECT: aligned records in a file opened so (and not fallen back since)."""
        return self.aligned and self.file.dfd >= 0


class Slabs:
    """Where reads land: one flat byte view per FFN matrix (``views``) and its row bytes, with the
    arrays ``cold_rows.c`` takes built once."""

    def __init__(self, views: list[memoryview], row_bytes: list[int]):
        self.views, self.row_bytes = views, list(row_bytes)
        self.c_bases = (ctypes.c_void_p * len(views))(*[ctypes.addressof(ctypes.c_char.from_buffer(v))
                                                        for v in views])
        self.c_row_bytes = (ctypes.c_int64 * len(self.row_bytes))(*self.row_bytes)


def _page_round(n: int) -> int:
    if n >= PAGE // 2:
        return -(-n // PAGE) * PAGE
    return 1 << max(0, (n - 1).bit_length())


def default_cache_dir() -> Path | None:
    """The row cache folder (None: ``$POWERINFER_ROW_CACHE=off``)."""
    env = os.environ.get(ROW_CACHE_ENV)
    if env == "off":
        return None
    if env:
        return Path(env)
    return kernels._cache_dir() / "rows"


def _cache_header(g: GGUFFile, plan: ResidencyPlan) -> dict:
    """What a row cache's content follows from, but the weights' bytes: the GGUF's header
    (:func:`~powerinfer.formats.gpuidx.model_identity`: shapes, types, metadata, size), the
    record layout and the record order (from the activation counts: ``plan.order``, the same for
    every budget). Its hash names the file, so caches of other orders live side by side."""
    from ..formats.gpuidx import model_identity

    order = np.stack([np.asarray(o, dtype=np.int32) for o in plan.order])
    return {"version": 2, "model_id": model_identity(g), "n_layer": plan.n_layer, "n_ff": plan.n_ff,
            "parts": [list(p) for p in plan.parts], "record": _page_round(plan.neuron_bytes),
            "order_sha": hashlib.sha256(order.tobytes()).hexdigest()[:32]}


def _cache_path(folder: Path, g: GGUFFile, head: dict) -> Path:
    key = hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{Path(g.path).name}.{key}.pirows"


def _read_cache_header(path: Path) -> tuple[dict, int] | None:
    """(header, data start) of a row cache, or None when it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) != 16 or head[:8] != MAGIC:
                return None
            n = int.from_bytes(head[8:16], "little")
            if not 0 < n <= HEADER_MAX:
                return None
            meta = json.loads(f.read(n).decode())
            if not isinstance(meta, dict) or not isinstance(meta.get("data_start"), int):
                return None
            return meta, meta["data_start"]
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _source_stamp(st: os.stat_result) -> list[int]:
    """What the kernel changes whenever a file's bytes change: device, inode, size, modification
    and status-change times (``st_ctime`` cannot be set from user space: ``touch -d`` or a copy
    that keeps times still moves it)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _ffn_spans(g: GGUFFile, plan: ResidencyPlan):
    """``(layer, part, tensor name, GGML type, offset, row bytes)`` of every FFN matrix, in the
    order :func:`weights_digest` and :func:`write_row_cache` hash them."""
    for i in range(plan.n_layer):
        for m, (suffix, kind, rb) in enumerate(plan.parts):
            name = f"blk.{i}.{suffix}"
            yield i, m, name, kind, int(g.tensors[name].data_offset), rb


def weights_digest(g: GGUFFile, plan: ResidencyPlan, src: "_File | None" = None) -> str:
    """sha256 (hex) of every FFN row's bytes in ``g`` (layer by layer, gate, up, down_t, each
    matrix in file order), read :data:`WRITE_CHUNK` bytes at a time with ``pread`` (pages dropped
    after). What a row cache's rows were copied from; ~1.5 GB/s on one core here (sha256 with
    SHA-NI), so a 7B Q4_0 model's 2.4 GB of FFN rows take ~2 s from the page cache."""
    own = src is None
    f = _File(Path(g.path)) if own else src
    h = hashlib.sha256()
    try:
        buf = np.empty(WRITE_CHUNK, dtype=np.uint8)
        for _, _, _, _, off, rb in _ffn_spans(g, plan):
            total = plan.n_ff * rb
            for o in range(0, total, WRITE_CHUNK):
                n = min(WRITE_CHUNK, total - o)
                _preadv(f, [buf[:n]], off + o, n)
                h.update(buf[:n])
            f.drop_cache(off, total)
    finally:
        if own:
            f.close()
    return h.hexdigest()


def write_row_cache(g: GGUFFile, plan: ResidencyPlan, path: Path) -> None:
    """Write the row cache of ``g`` in ``plan.order`` to ``path`` (atomically: a temporary file
    renamed): header, then per layer ``n_ff`` records of :func:`_page_round` (neuron bytes)
    bytes. Holds at most :data:`WRITE_CHUNK` bytes of rows at a time (one matrix's rows read in
    file order with ``pread``, their pages dropped after, each row written into its record), so
    it stays within the plan's scratch. The header records the sha256 of the FFN rows as read
    (:func:`weights_digest`'s) and the GGUF's :func:`_source_stamp`, left out when the GGUF
    changed less than :data:`SETTLE_NS` before the copy began (a write in the same clock tick
    would not move its times): the next open rehashes then."""
    from ..formats._atomic import atomic_path

    head = _cache_header(g, plan)
    rec = head["record"]
    src = _File(Path(g.path))
    t0 = time.perf_counter()
    began = time.time_ns()
    stamp = _source_stamp(os.fstat(src.fd))
    probe = json.dumps({**head, "weights_sha": "0" * 64, "source": stamp, "data_start": 1 << 40}).encode()
    start = -(-(16 + len(probe) + 64) // PAGE) * PAGE
    data = plan.n_layer * plan.n_ff * rec
    h = hashlib.sha256()
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as out:
                fd = out.fileno()
                os.ftruncate(fd, start + data)  # the pads read as zeros
                buf = np.empty(WRITE_CHUNK, dtype=np.uint8)
                offs = np.cumsum([0] + [rb for _, _, rb in plan.parts])
                pos = np.empty(plan.n_ff, dtype=np.int64)
                for i, m, name, kind, off, rb in _ffn_spans(g, plan):
                    pos[plan.order[i]] = np.arange(plan.n_ff)  # neuron -> record
                    base = start + i * plan.n_ff * rec + int(offs[m])
                    step = max(1, WRITE_CHUNK // rb)
                    bt = MAPPED_TYPES[kind]
                    for r0 in range(0, plan.n_ff, step):
                        n = min(step, plan.n_ff - r0)
                        rows = buf[:n * rb].reshape(n, rb)
                        _preadv(src, [rows], off + r0 * rb, n * rb)
                        h.update(rows)
                        bad = QWeight(torch.from_numpy(rows), bt, n, rb * bt.block // bt.nbytes).first_nonfinite_row()
                        if bad is not None:
                            raise PowerInferError(f"{g.path}: tensor '{name}' ({kind}) has a NaN or infinite "
                                                  f"block scale in row {r0 + bad}: the file is corrupt")
                        for j, p in enumerate(pos[r0:r0 + n].tolist()):
                            os.pwrite(fd, rows[j], base + p * rec)
                    src.drop_cache(off, plan.n_ff * rb)
                    if m == len(plan.parts) - 1:  # a layer done: written out, its pages dropped
                        os.fdatasync(fd)
                        if hasattr(os, "posix_fadvise"):
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                src.check()  # rewritten while copied: the hash would not be its rows'
                settled = stamp[4] < began - SETTLE_NS
                blob = json.dumps({**head, "weights_sha": h.hexdigest(), "source": stamp if settled else None,
                                   "data_start": start}).encode()
                if 16 + len(blob) > start:
                    raise PowerInferError(f"{path}: row cache header of {len(blob)} bytes does not fit")
                os.pwrite(fd, MAGIC + len(blob).to_bytes(8, "little") + blob, 0)
                os.fdatasync(fd)
    finally:
        src.close()
    log.info("wrote the row cache %s (%.1f GB, %.0f s)", path, (start + data) / 1e9, time.perf_counter() - t0)


def open_streams(g: GGUFFile, plan: ResidencyPlan, note=None) -> tuple[list[list[Stream]], list[_File], str]:
    """Per layer the streams its FFN rows are read from, the files opened (the one read first; the
    GGUF, when only watched, after it: :class:`RowReader` checks and closes them all), and a
    description. Uses (building it when missing or stale) the row cache unless
    ``$POWERINFER_ROW_CACHE=off``. Nothing stays open when it raises."""
    folder = default_cache_dir()
    gguf = _File(Path(g.path))
    try:
        if folder is None:
            streams = []
            for i in range(plan.n_layer):
                streams.append([Stream(gguf, int(g.tensors[f"blk.{i}.{s}"].data_offset), rb, [(0, rb, m)],
                                       np.arange(plan.n_ff, dtype=np.int64))
                                for m, (s, _, rb) in enumerate(plan.parts)])
            return streams, [gguf], f"rows read from {g.path} ({len(plan.parts)} reads per neuron)"
        streams, f, where = _cache_streams(g, plan, folder, note, gguf)
    except BaseException:
        gguf.close()
        raise
    return streams, [f, gguf], where  # the GGUF's identity is still checked (RowReader.check)


def _cache_is_current(path: Path, meta: dict, start: int, head: dict, g: GGUFFile, plan: ResidencyPlan,
                      gguf: _File) -> bool:
    """The row cache at ``path`` holds ``g``'s rows in ``plan.order``: its identity matches
    ``head`` (header, layout, order), its size is right, and its rows are the GGUF's now (the
    GGUF's stamp unchanged since they were hashed, else the FFN rows rehashed and compared)."""
    data = plan.n_layer * plan.n_ff * head["record"]
    if any(meta.get(k) != v for k, v in head.items()) or path.stat().st_size != start + data:
        log.warning("%s: does not match %s (its header, layout or activation order): rebuilding it", path, g.path)
        return False
    now = _source_stamp(os.fstat(gguf.fd))
    side = _stamp_path(path)
    if meta.get("source") == now:
        return True
    try:
        vouched = json.loads(side.read_text())
        if vouched == {"weights_sha": meta.get("weights_sha"), "source": now}:
            return True
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    began = time.time_ns()
    sha = weights_digest(g, plan, gguf)
    if sha != meta.get("weights_sha"):
        log.warning("%s: the FFN weights of %s are not those it was built from: rebuilding it", path, g.path)
        return False
    log.info("%s: %s changed on disk since the row cache was written, its FFN rows did not (%.1f GB hashed in "
             "%.1f s)", path, g.path, plan.ffn_bytes / 1e9, time.perf_counter() - t0)
    if now[4] < began - SETTLE_NS:  # the stamp the rows were just verified under, for the next open
        from ..formats._atomic import write_text

        try:
            write_text(side, json.dumps({"weights_sha": sha, "source": now}))
        except (OSError, PowerInferError):
            pass  # a read-only cache folder: the next open hashes again
    return True


def _stamp_path(path: Path) -> Path:
    """Beside a row cache: the GGUF stamp its rows were last verified under (``{"weights_sha",
    "source"}``), for a GGUF whose stamp moved (copied, touched) while its rows did not."""
    return path.with_name(path.name + ".stamp")


def _cache_streams(g: GGUFFile, plan: ResidencyPlan, folder: Path, note,
                   gguf: _File) -> tuple[list[list[Stream]], _File, str]:
    """:func:`open_streams` from the row cache in ``folder`` (written when missing or stale).
    Nothing it opened stays open when it raises."""
    head = _cache_header(g, plan)
    path = _cache_path(folder, g, head)
    rec = head["record"]
    data = plan.n_layer * plan.n_ff * rec  # bytes after the header
    found = _read_cache_header(path) if path.is_file() else None
    if found is not None and not _cache_is_current(path, *found, head, g, plan, gguf):
        found = None
    if found is None:
        folder.mkdir(parents=True, exist_ok=True)
        if note is not None:
            note(f"writing the row cache {path} ({plan.ffn_bytes / 1e9:.1f} GB of FFN rows, once)")
        write_row_cache(g, plan, path)
        found = _read_cache_header(path)
        if found is None:
            raise PowerInferError(f"{path}: the row cache just written does not read back")
    _, start = found
    f = _File(path, direct=True, watch_name=False)
    try:
        if f.stamp.size != start + data:
            raise PowerInferError(f"{path}: {f.stamp.size} bytes, expected {start + data}: "
                                  f"a row cache that does not match {g.path}")
        streams = []
        parts, o = [], 0
        for m, (_, _, rb) in enumerate(plan.parts):
            parts.append((o, rb, m))
            o += rb
        for i in range(plan.n_layer):
            pos = np.empty(plan.n_ff, dtype=np.int64)
            pos[plan.order[i]] = np.arange(plan.n_ff)
            streams.append([Stream(f, start + i * plan.n_ff * rec, rec, parts, pos)])
    except BaseException:
        f.close()
        raise
    return streams, f, f"rows read from the row cache {path} (1 read per neuron)"


# ---------------------------------------------------------------------------- the reader
@dataclass
class ReadStats:
    reads: int = 0  # preadv calls
    bytes: int = 0  # bytes read (the junk between merged records included)
    neurons: int = 0  # neurons read
    active: int = 0  # predicted-active neurons over all layers and tokens
    hot_hits: int = 0  # of them pinned resident
    window_hits: int = 0  # of them found in the reuse window
    tokens: int = 0  # forward-pass tokens (one per layer-0 call)
    split: int = 0  # token-layer steps whose non-pinned neurons outnumbered the window (several passes)
    t_wait: float = 0.0  # seconds waiting for reads


class RowReader:
    """Reads neurons' rows into slab slots; one per model (a thread pool shared by the layers)."""

    def __init__(self, files: list[_File], threads: int = IO_THREADS):
        self.files = files  # read from or watched (check), closed by close()
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="powerinfer-rows")
        self.stats = ReadStats()
        self.verify = False  # check the block scales of every row read (rows straight from the GGUF)
        self.pool: RowPool | None = None
        self.lib = _lib()  # None: os.preadv from the thread pool
        self._junk = np.empty(1 << 20, dtype=np.uint8)
        self._jv = memoryview(self._junk)
        self._stage = None
        self._stage_lock = threading.Lock()
        self.closed = False

    def check(self) -> None:
        """PowerInferError when a file read from changed since it was opened."""
        for f in self.files:
            f.check()

    def submit(self, streams: list[Stream], neurons: np.ndarray, slots: np.ndarray, slabs: Slabs,
               count: bool = True) -> list:
        """Start reading ``neurons`` (int64 ``[m]``) into ``slots`` of ``slabs``; returns the
        futures (each returns bytes read). ``count``: add the reads to :attr:`stats` (not for the
        hot rows read at load)."""
        futs = []
        lib = self.lib
        for st in streams:
            pos = st.pos[neurons]
            order = np.argsort(pos, kind="stable")
            pos, sl = pos[order], slots[order]
            if lib is not None:
                futs.append(self.executor.submit(self._c_read, lib, st, np.ascontiguousarray(pos),
                                                 np.ascontiguousarray(sl), slabs, count))
                continue
            cuts = np.flatnonzero(np.diff(pos) > MAX_GAP + 1) + 1
            for run_pos, run_sl in zip(np.split(pos, cuts), np.split(sl, cuts)):
                for job in self._iov_jobs(st, run_pos.tolist(), run_sl.tolist(), slabs.views, slabs.row_bytes):
                    futs.append(self.executor.submit(_preadv, *job))
                    if count:
                        self.stats.reads += 1
                        self.stats.bytes += job[3]
        if count:
            self.stats.neurons += len(neurons)
        return futs

    def _c_read(self, lib, st: Stream, pos: np.ndarray, slots: np.ndarray, slabs: Slabs, count: bool) -> int:
        """One stream's records read by ``cold_rows.c`` (in an executor thread: ctypes lets go of the GIL).

        O_DIRECT reads hold :attr:`_stage_lock` (one staging area, used by one call at a time; the
        call's own threads each use their part of it). EINVAL from such a read (a file system that
        takes the O_DIRECT open but not the read) drops O_DIRECT for that file, with one warning,
        and the records are read again buffered."""
        offs, lens, mats = st.c_parts
        out = (ctypes.c_int64 * 5)()

        def call(direct: bool) -> int:
            return lib.pi_read_records(st.file.dfd if direct else st.file.fd, int(direct), st.base, st.stride,
                                       len(st.parts), offs, lens, mats, slabs.c_bases, slabs.c_row_bytes,
                                       pos.ctypes.data, slots.ctypes.data, len(pos), MAX_GAP, MAX_JOB, self.threads,
                                       self._junk.ctypes.data, self._junk.nbytes,
                                       self._stage_ptr() if direct else None, out)

        n = None
        if st.direct:
            with self._stage_lock:
                if st.direct:  # another read may have dropped O_DIRECT meanwhile
                    n = call(True)
                    if n < 0 and out[2] == errno.EINVAL:
                        log.warning("%s: the file system refused an O_DIRECT read (%s): reading it buffered",
                                    st.file.path, os.strerror(errno.EINVAL))
                        st.file.drop_direct()
                        n = None
        if n is None:
            n = call(False)
        if n < 0:
            off, err, got, want = out[1], out[2], out[3], out[4]
            raise _read_failed(st.file, off, want, got, os.strerror(err) if err else None)
        if count:
            self.stats.reads += n
            self.stats.bytes += out[0]
        return out[0]

    def _stage_ptr(self) -> int:
        """Page-aligned staging buffers for O_DIRECT reads: one of :data:`MAX_JOB` bytes per thread
        (allocated at first use; the caller holds :attr:`_stage_lock`)."""
        if self._stage is None or self._stage_n != self.threads:
            raw = np.empty(self.threads * MAX_JOB + PAGE, dtype=np.uint8)
            off = -raw.ctypes.data % PAGE
            self._stage, self._stage_n = raw[off:off + self.threads * MAX_JOB], self.threads
        return self._stage.ctypes.data

    def _iov_jobs(self, st: Stream, pos: list[int], slots: list[int], slabs, row_bytes):
        """``(file, buffers, offset, nbytes)`` for one run of records, split at MAX_IOV buffers."""
        jv, rec = self._jv, st.stride
        bufs: list = []
        start = prev = pos[0]
        for p, s in zip(pos, slots):
            if len(bufs) + 2 * len(st.parts) + 2 > MAX_IOV:
                yield st.file, bufs, st.base + start * rec, (prev + 1 - start) * rec
                bufs, start = [], p
            elif p > prev + 1:  # records between two needed ones: into the junk buffer
                bufs.append(jv[:(p - prev - 1) * rec])
            o = 0
            for off, nb, m in st.parts:
                if off > o:
                    bufs.append(jv[:off - o])
                rb = row_bytes[m]
                bufs.append(slabs[m][s * rb:(s + 1) * rb])
                o = off + nb
            if rec > o:
                bufs.append(jv[:rec - o])
            prev = p
        yield st.file, bufs, st.base + start * rec, (prev + 1 - start) * rec

    def wait(self, futs: list, count: bool = True) -> None:
        """Wait for the reads ``futs``; the first PowerInferError raised. ``count``: add the time to
        :attr:`ReadStats.t_wait` (not for the hot rows read at load)."""
        t = time.perf_counter()
        err = None
        for f in futs:
            try:
                f.result()
            except PowerInferError as e:
                err = err or e
        if count:
            self.stats.t_wait += time.perf_counter() - t
        if err is not None:
            raise err

    def drop_cache(self, streams: list[Stream], n_ff: int) -> None:
        """Drop the pages buffered reads of ``streams`` left in the page cache."""
        for st in streams:
            if not (self.lib is not None and st.direct):
                st.file.drop_cache(st.base, n_ff * st.stride)

    def close(self) -> None:
        """Stop the read threads and close the files (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        self.executor.shutdown(wait=True)
        for f in self.files:
            f.close()


# ---------------------------------------------------------------------------- the FFN
class _RowsInfo:
    """What ``decode_bytes_per_token`` and ``--bench`` read of a full FFN matrix: its size and type."""

    def __init__(self, n_rows: int, n_cols: int, type_name: str):
        self.shape = torch.Size((n_rows, n_cols))
        self.btype = MAPPED_TYPES[type_name]
        self.dtype = type_name.lower()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> float:
        return self.btype.nbytes / self.btype.block


class RowPool:
    """The model's resident FFN rows: one slab per FFN matrix (``[hot + window, n_embd]`` in the
    file's type, a :class:`QWeight`), each layer's pinned hot rows in a fixed range, then the reuse
    window, shared by all layers (least recently used slot replaced first), so one layer may use
    more of it on a token that needs many cold neurons."""

    def __init__(self, parts, n_embd: int, n_hot: list[int], window: int):
        from .weights import empty

        self.hot_start = np.concatenate([[0], np.cumsum(n_hot)]).astype(np.int64)
        self.H = int(self.hot_start[-1])
        cap = self.H + int(window)
        self.window = int(window)
        self.row_bytes = [rb for _, _, rb in parts]
        self.mats = [QWeight(empty((cap, rb), torch.uint8), MAPPED_TYPES[k], cap, n_embd) for _, k, rb in parts]
        self.flat = [memoryview(w.raw.numpy()).cast("B") for w in self.mats]
        self.slabs = Slabs(self.flat, self.row_bytes)
        self.last = np.full(cap, -1, dtype=np.int64)  # the last step (layer pass) that used the slot
        self.last_token = np.full(cap, -1, dtype=np.int64)  # the last token that used it (eviction order)
        self.token = 0
        self.owner = np.full(cap, -1, dtype=np.int64)  # layer whose neuron the slot holds
        self.neuron_of = np.full(cap, -1, dtype=np.int64)
        self.slot_maps: dict[int, np.ndarray] = {}  # layer -> slot of each neuron (-1: not resident)
        self.stamp = 0

    def take(self, layer: int, neurons: np.ndarray) -> np.ndarray | None:
        """Window slots for ``neurons`` of ``layer`` (those used by the oldest tokens, none used in
        this step), their old holders forgotten; None when fewer are free. Ordered by token, not by
        step: each token visits the layers in turn, so the least recently used step would be the
        next layers' rows of the previous token, the ones needed next."""
        free = self.H + np.flatnonzero(self.last[self.H:] < self.stamp)
        n = len(neurons)
        if len(free) < n:
            return None
        if len(free) > n:
            free = free[np.argpartition(self.last_token[free], n - 1)[:n]]
        old_layer, old = self.owner[free], self.neuron_of[free]
        for lay in np.unique(old_layer[old_layer >= 0]):
            self.slot_maps[int(lay)][old[old_layer == lay]] = -1
        self.slot_maps[layer][neurons] = free
        self.owner[free], self.neuron_of[free], self.last[free] = layer, neurons, self.stamp
        self.last_token[free] = self.token
        return free

    def forget(self, slots: np.ndarray) -> None:
        """Slots whose reads failed hold no neuron."""
        for s in slots.tolist():
            lay = int(self.owner[s])
            if lay >= 0:
                self.slot_maps[lay][self.neuron_of[s]] = -1
        self.owner[slots], self.neuron_of[slots], self.last[slots], self.last_token[slots] = -1, -1, -1, -1


class BudgetFFN:
    """A sparse FFN whose rows are partly resident (hot neurons + the shared reuse window) and
    partly read from disk per token. Same call contract as :class:`~powerinfer.runtime.ffn.FFN`:
    ``(h [T, D], xn [T, D], mask [T, F] | None) -> [T, D]`` in ``xn``'s dtype.

    ``hot``: bool ``[F]``, the pinned neurons (``pool.hot_start[layer]`` onwards in ``pool``);
    ``streams``: where its rows are in the files; ``reader``: the model's :class:`RowReader`.
    """

    def __init__(self, layer: int, family, act, fc1, fc2, threshold: float, parts, n_embd: int,
                 hot: np.ndarray, pool: RowPool, streams: list[Stream], reader: RowReader,
                 gate_b=None, up_b=None, down_b=None):
        self.layer, self.family, self.act, self.threshold = layer, family, act, threshold
        self.fc1, self.fc2 = fc1, fc2
        self.gate_b, self.up_b, self.down_b = gate_b, up_b, down_b
        self.gmin = gate_min(act, gate_b is not None)
        self.streams, self.reader, self.pool = streams, reader, pool
        n_ff = len(hot)
        self.n_ff = n_ff
        hot_ids = np.flatnonzero(hot).astype(np.int64)
        self.n_hot = len(hot_ids)
        if self.n_hot != pool.hot_start[layer + 1] - pool.hot_start[layer]:
            raise ValueError(f"layer {layer}: {self.n_hot} hot neurons, the pool holds "
                             f"{pool.hot_start[layer + 1] - pool.hot_start[layer]}")
        self.row_bytes = pool.row_bytes
        self.slot_of = np.full(n_ff, -1, dtype=np.int64)
        pool.slot_maps[layer] = self.slot_of
        self.is_hot = np.asarray(hot, dtype=bool)
        gated = family.gated
        self.gate_info = _RowsInfo(n_ff, n_embd, parts[0][1]) if gated else None
        self.up_info = _RowsInfo(n_ff, n_embd, parts[1 if gated else 0][1])
        self.down_info = _RowsInfo(n_ff, n_embd, parts[-1][1])
        if self.n_hot:
            h0 = int(pool.hot_start[layer])
            slots = np.arange(h0, h0 + self.n_hot, dtype=np.int64)
            reader.wait(reader.submit(streams, hot_ids, slots, pool.slabs, count=False), count=False)
            reader.drop_cache(streams, n_ff)
            self.slot_of[hot_ids] = slots
            pool.owner[slots], pool.neuron_of[slots] = layer, hot_ids
            for w in pool.mats if reader.verify else ():  # NaN/inf block scales: a corrupt file (the
                bad = QWeight(w.raw[h0:h0 + self.n_hot], w.btype, self.n_hot, n_embd).first_nonfinite_row()
                if bad is not None:  # row cache's rows were checked when it was written)
                    raise PowerInferError(f"{streams[0].file.path}: layer {layer} neuron {hot_ids[bad]} has a NaN or "
                                          "infinite block scale: the file is corrupt")
        self.n_active = self.n_calls = self.n_fired = 0
        self.count_fired = False
        self.t_ffn = self.t_predict = 0.0

    @property
    def mats(self) -> list[QWeight]:
        return self.pool.mats

    # the surface decode_bytes_per_token and --bench read
    gate = property(lambda self: self.gate_info)
    up = property(lambda self: self.up_info)
    down_t = property(lambda self: self.down_info)
    sparse = property(lambda self: True)

    def resident_bytes(self) -> int:
        """Bytes of this layer's pinned hot rows."""
        return self.n_hot * sum(self.row_bytes)

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = self.n_fired = 0
        self.t_ffn = self.t_predict = 0.0

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        return kernels.predict(h, self.fc1, self.fc2, self.threshold)

    def preact(self, xn: torch.Tensor):
        raise PowerInferError("--ram-budget: the oracle (every neuron's pre-activation) needs every FFN row resident")

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            if mask is None:
                mask = self.predict(h)
                self.t_predict += time.perf_counter() - t0
            T = xn.shape[0]
            self.n_calls += T
            if self.layer == 0:
                self.reader.stats.tokens += T
            outs = [self._token(xn[t], mask[t].nonzero().view(-1)) for t in range(T)]
            return torch.stack(outs).to(xn.dtype)
        finally:
            self.t_ffn += time.perf_counter() - t0

    def _token(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """One token's output ``[D]`` fp32 over neurons ``idx`` (ascending)."""
        if self.layer == 0:
            self.pool.token += 1
        self.n_active += idx.numel()
        self.reader.stats.active += idx.numel()
        ids = idx.numpy()
        nh = ~self.is_hot[ids]
        W = self.pool.window
        n_cold = int(nh.sum())
        if n_cold <= W:
            return self._pass(x, idx, len(ids) - n_cold)
        # more non-pinned neurons than the window holds: passes of at most W of them, sums added
        self.reader.stats.split += 1
        group = (np.cumsum(nh) - nh) // W
        cuts = np.flatnonzero(np.diff(group)) + 1
        out = None
        for sel in np.split(np.arange(len(ids)), cuts):
            y = self._pass(x, idx[torch.from_numpy(sel)], len(sel) - int(nh[sel].sum()))
            out = y if out is None else out + y
        return out

    def _pass(self, x: torch.Tensor, idx: torch.Tensor, n_hot: int) -> torch.Tensor:
        """Neurons ``idx`` (at most the window's size of them not pinned, ``n_hot`` pinned): the
        missing ones read into the least recently used window slots, then computed."""
        st, pool = self.reader.stats, self.pool
        pool.stamp += 1
        ids = idx.numpy()
        slots = self.slot_of[ids]
        res = slots >= 0
        n_res = int(res.sum())
        st.hot_hits += n_hot
        st.window_hits += n_res - n_hot
        pool.last[slots[res]] = pool.stamp
        pool.last_token[slots[res]] = pool.token
        miss = np.flatnonzero(~res)
        if len(miss) == 0:
            return self._compute(x, idx, torch.from_numpy(slots))
        need = ids[miss]
        take = pool.take(self.layer, need)
        if take is None:
            raise PowerInferError(f"--ram-budget: layer {self.layer} needs {len(need)} cold rows, the reuse window "
                                  "has fewer free slots")
        slots[miss] = take
        try:
            futs = self.reader.submit(self.streams, need, take, pool.slabs)
        except BaseException:
            pool.forget(take)
            raise
        res_slots = torch.from_numpy(slots[res])
        try:
            if self.family.gated:  # the resident neurons' gate/up products while the reads are in flight
                g_r, u_r = kernels.rows_dot(x, res_slots, self.mats[0], self.mats[1], self.gmin)
            else:
                g_r, u_r = None, kernels.rows_dot(x, res_slots, self.mats[0])[0]
        finally:
            try:
                self.reader.wait(futs)
                self.reader.drop_cache(self.streams, self.n_ff)
            except BaseException:
                pool.forget(take)
                raise
        if self.reader.verify:
            self._check_rows(take)
        m_idx = torch.from_numpy(take)
        if self.family.gated:
            g_m, u_m = kernels.rows_dot(x, m_idx, self.mats[0], self.mats[1], self.gmin)
        else:
            g_m, u_m = None, kernels.rows_dot(x, m_idx, self.mats[0])[0]
        k = len(ids)
        res_t, miss_t = torch.from_numpy(np.flatnonzero(res)), torch.from_numpy(miss)
        up = torch.empty(k, dtype=torch.float32)
        up[res_t], up[miss_t] = u_r, u_m
        gate = None
        if self.family.gated:
            gate = torch.empty(k, dtype=torch.float32)
            gate[res_t], gate[miss_t] = g_r, g_m
        return self._finish(idx, torch.from_numpy(slots), gate, up)

    def _check_rows(self, slots: np.ndarray) -> None:
        for w in self.mats:
            sub = QWeight(w.raw[torch.from_numpy(slots)], w.btype, len(slots), w.n_cols)
            if sub.first_nonfinite_row() is not None:
                self.pool.forget(slots)
                raise PowerInferError(f"{self.streams[0].file.path}: layer {self.layer}: a row read has a NaN or "
                                      "infinite block scale: the file is corrupt or changed while running")

    def _compute(self, x: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.family.gated:
            gate, up = kernels.rows_dot(x, slots, self.mats[0], self.mats[1], self.gmin)
        else:
            gate, up = None, kernels.rows_dot(x, slots, self.mats[0])[0]
        return self._finish(idx, slots, gate, up)

    def _finish(self, idx, slots, gate, up):
        return finish_rows(self, idx, gate, up, self.mats[-1], slots, torch.float32)


# ---------------------------------------------------------------------------- loading
def _builder(plan: ResidencyPlan, streams: list[list[Stream]], reader: RowReader, pool: RowPool):
    """A ``build_ffn`` stand-in (same arguments) that builds :class:`BudgetFFN` layers."""
    from .model import load_ffn_biases, load_predictor

    def build(g: GGUFFile, i: int, a, dtype: torch.dtype, dense: bool, mapped: bool = False) -> BudgetFFN:
        fc1, fc2 = load_predictor(g, i, a, dtype, mapped)
        gate_b, up_b, down_b = load_ffn_biases(g, i, a, dtype)  # a PWRI file: ffn_down_t.bias
        return BudgetFFN(i, a.family, a.activation, fc1, fc2, a.sparse_threshold, plan.parts, a.n_embd,
                         plan.hot[i], pool, streams[i], reader, gate_b, up_b, down_b)

    return build


def activation_counts(model_path: str, activation_dir: str | None, n_layer: int, n_ff: int):
    """``(counts per layer or None, where from)``: ``activation_dir``, else ``activation/`` beside the model."""
    from ..formats.activation import load_activation_dir

    folder = Path(activation_dir) if activation_dir is not None else Path(model_path).parent / "activation"
    if not folder.is_dir():
        if activation_dir is not None:
            raise PowerInferError(f"--activation {activation_dir}: not a folder")
        return None, "none (no activation folder: the reuse window keeps recently used neurons)"
    counts = load_activation_dir(folder, n_layer=n_layer, n_ff=n_ff)
    return [c.numpy() for c in counts], str(folder)


def load_budgeted(g: GGUFFile, dtype: torch.dtype, n_ctx: int | None, budget_gib: float,
                  activation_dir: str | None = None, note=None, interpreter: int | None = None,
                  cache_type_k=None, cache_type_v=None):
    """``(model, plan, reader)``: the model of the opened PWRI file ``g`` built within
    ``budget_gib`` GiB (:func:`~.residency.plan_residency`; its minimum is checked before any
    weight is read; ``interpreter``: bytes the process holds, default its resident set now).
    When the whole model fits (``plan.resident``) it is the ordinary model and ``reader`` None.
    ``cache_type_k``/``_v``: the KV cache's types (:class:`~.model.Transformer`'s; None: ``dtype``),
    counted in the plan's minimum in those bytes.
    Raises PowerInferError for a budget below the minimum, a dense file, FFN
    rows of a type the row kernels do not read, or an unreadable activation folder."""
    from .args import ModelArgs
    from .kv_cache import kv_dtypes
    from .model import Transformer, context_length
    from .residency import plan_residency
    from .weights import _release

    if kernels.backend() != "c":
        raise PowerInferError("--ram-budget needs the C kernels (--kernels c): the torch backend copies every weight")
    a = ModelArgs.from_gguf(g)
    _, ctx = context_length(g, a, n_ctx)  # the Transformer's own (position_embd's cap included)
    counts, source = activation_counts(str(g.path), activation_dir, a.n_layer, a.n_ff) if a.sparse else (None, "")
    kv = kv_dtypes(cache_type_k, cache_type_v, dtype)
    plan = plan_residency(g, ctx, kv, budget_gib, counts, source, interpreter)
    if plan.resident:  # the whole model fits: the ordinary run, nothing read from disk
        return Transformer(g, dtype, n_ctx=n_ctx, cache_type_k=kv[0], cache_type_v=kv[1]), plan, None
    streams, files, where = open_streams(g, plan, note)
    reader = RowReader(files)
    try:
        reader.verify = files[0].path == Path(g.path)
        reader.pool = RowPool(plan.parts, a.n_embd, [int(h.sum()) for h in plan.hot], plan.window_total)
        model = Transformer(g, dtype, n_ctx=n_ctx, ffn_builder=_builder(plan, streams, reader, reader.pool),
                            cache_type_k=kv[0], cache_type_v=kv[1])
        embd = g.tensors.get("token_embd.weight")
        tied = model.output is model.tok_embd

        def before_forward() -> None:
            reader.check()
            if embd is not None and not tied:  # rows looked up on demand: their pages do not pile up
                _release(g, embd)

        before_forward()
    except BaseException:
        reader.close()
        raise
    for f in reader.files:  # what loading read through the page cache
        f.drop_cache(0, f.stamp.size)
    model.resources.append(reader)  # closed by model.close() (or `with model:`)
    weakref.finalize(model, reader.close)  # and when the model is collected
    model.before_forward = before_forward
    model.residency = (plan, reader, where)
    return model, plan, reader


def budget_lines(model) -> list[str]:
    """``--bench`` lines under ``--ram-budget``: resident MB by kind, reads and MB read per token,
    the resident set's hit rate. Empty without a budget."""
    from .residency import peak_rss_bytes, rss_bytes
    from .weights import weight_nbytes

    r = getattr(model, "residency", None)
    if r is None:
        return []
    plan, reader, where = r
    st = reader.stats
    mb = 1e6
    hot = sum(l.ffn.resident_bytes() for l in model.layers)
    win = reader.pool.window * sum(reader.pool.row_bytes)
    attn = sum(weight_nbytes(getattr(l, k)) for l in model.layers for k in ("wqkv", "bqkv", "wo", "bo"))
    pred = sum(weight_nbytes(l.ffn.fc1) + weight_nbytes(l.ffn.fc2) for l in model.layers)
    out = 0.0 if model.output is model.tok_embd else weight_nbytes(model.output)
    kv = weight_nbytes(model.cache.k) + weight_nbytes(model.cache.v)
    n = max(1, st.tokens)
    act = max(1, st.active)
    return [f"  RAM budget {plan.budget / 2**30:.2f} GiB: resident MB: attention {attn / mb:.0f}, predictors "
            f"{pred / mb:.0f}, output {out / mb:.0f}, hot FFN neurons {hot / mb:.0f} "
            f"({plan.n_hot / (plan.n_layer * plan.n_ff):.1%} of neurons), reuse window {win / mb:.0f}, KV cache "
            f"{kv / mb:.0f} (reserved); process now {rss_bytes() / mb:.0f} MB, peak {peak_rss_bytes() / mb:.0f} MB",
            f"  cold rows: {where}; per token {st.reads / n:.0f} reads, {st.bytes / n / mb:.1f} MB read, "
            f"{st.neurons / n:.0f} neurons; hit rate {(st.hot_hits + st.window_hits) / act:.1%} "
            f"(hot {st.hot_hits / act:.1%}, window {st.window_hits / act:.1%}); waiting for reads "
            f"{st.t_wait / n * 1e3:.0f} ms per token"]

"""GPU index files: ``<model file>.generated.gpuidx`` (FORMATS.md section 5).

The layout is upstream PowerInfer's (``powerinfer-py/powerinfer/export_split.py`` writes
it, ``llama_gpu_split_loader`` in ``llama.cpp`` reads it):

* a GGUF v3 file whose first 8 bytes are then overwritten with ``PWRI`` and the u32 3;
* ``general.architecture = "generic.gpu_index"``, ``generic.gpu_index.block_count`` (u32),
  ``split.vram_capacity`` (u64 bytes; upstream's loader refuses the file when it exceeds
  the current VRAM budget);
* per layer i, in this order, ``blk.{i}.gpu_idx`` (I32 ``[n_ff]``, 1 = neuron on the GPU)
  and ``blk.{i}.gpu_bucket`` (I32, the sorted GPU neuron indices). Upstream's loader takes
  them by position (tensor 2i and 2i+1) and only checks the tensor count (2 x n_layer). A
  layer with no GPU neuron has a zero-length bucket (upstream writes
  ``torch.topk(k=0)`` -> shape ``(0,)``; its loader then ignores the bucket, as it also
  does for a layer that is entirely on the GPU).
* The tensors carry GGML type id **18**, upstream ggml's I32 (today's ``gguf`` package
  calls 18 IQ3_XXS and uses 26 for I32). We write with ``gguf.GGUFWriter`` (type 26), then
  patch the ids to 18 and stamp the magic, in a temporary file renamed into place. The
  reader accepts 18 and 26 and never lets ``gguf`` decode 18 as IQ3_XXS.

Our own keys (upstream ignores unknown keys) let a reader check that an index belongs to a
model: ``powerinfer.gpu_index.n_ff`` (u32), ``powerinfer.gpu_index.model_id`` (string from
:func:`model_identity`), plus ``chunk``, ``neurons``, ``bytes_used`` and ``solver`` for
information.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType

from ..errors import PowerInferError
from ._atomic import atomic_path
from .gguf_file import PWRI_BYTES, GGUFFile, PwriReader, open_gguf, set_magic

__all__ = [
    "GPU_INDEX_ARCH",
    "GpuIndex",
    "GpuIndexMismatch",
    "INDEX_SUFFIX",
    "default_index_path",
    "model_identity",
    "read_gpu_index",
    "write_gpu_index",
]

GPU_INDEX_ARCH = "generic.gpu_index"
INDEX_SUFFIX = ".generated.gpuidx"
UPSTREAM_I32 = 18  # upstream ggml's GGML_TYPE_I32
GGUF_I32 = int(GGMLQuantizationType.I32)  # 26 in today's ggml / gguf package
INDEX_VERSION = 3

KEY_BLOCK_COUNT = f"{GPU_INDEX_ARCH}.block_count"
KEY_VRAM = "split.vram_capacity"
KEY_N_FF = "powerinfer.gpu_index.n_ff"
KEY_MODEL = "powerinfer.gpu_index.model_id"
KEY_CHUNK = "powerinfer.gpu_index.chunk"
KEY_NEURONS = "powerinfer.gpu_index.neurons"
KEY_BYTES = "powerinfer.gpu_index.bytes_used"
KEY_SOLVER = "powerinfer.gpu_index.solver"
KEY_ACTIVATION = "powerinfer.gpu_index.activation_id"  # digest of the placement inputs (counts, chunk)


class GpuIndexMismatch(PowerInferError):
    """A valid GPU index built for another model, layer count, ``n_ff`` or budget (rebuild it)."""


def default_index_path(model_path: str | Path) -> Path:
    """Where upstream looks for a model's index: ``<model file>.generated.gpuidx``."""
    return Path(str(model_path) + INDEX_SUFFIX)


def model_identity(model: str | Path | GGUFFile) -> str:
    """A short string identifying a GGUF model file: its size and header hash.

    ``sha256`` over every byte before the tensor data (magic, version, metadata and tensor
    table: names, shapes, types, offsets), plus the file size. Copying or touching the file
    keeps it; re-converting to other shapes, types, metadata or a different file does not.
    ``model``: a path, or an already opened :class:`GGUFFile` (saves parsing it twice).
    Raises PowerInferError (naming the path) if the file is missing or not a GGUF.
    """
    f = model if isinstance(model, GGUFFile) else open_gguf(model)
    header_end = int(f.reader.data_offset)
    size = f.path.stat().st_size
    h = hashlib.sha256()
    h.update(np.asarray(f.reader.data[:header_end]).tobytes())
    return f"size={size};sha256={h.hexdigest()[:32]}"


@dataclass
class GpuIndex:
    """A GPU index read back.

    ``gpu[l]``: bool ``[n_ff_l]``; ``buckets[l]``: int32 sorted GPU neuron indices (may be
    empty); ``vram_capacity``: ``split.vram_capacity`` (bytes); ``model_id``: our identity
    key (None for upstream-written files); ``raw_types``: the GGML type id of each tensor as
    stored (18 for upstream files); ``meta``: our other keys.
    """

    path: Path
    gpu: list[np.ndarray]
    buckets: list[np.ndarray]
    vram_capacity: int
    model_id: str | None
    raw_types: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        return len(self.gpu)

    @property
    def n_ff(self) -> list[int]:
        return [g.size for g in self.gpu]

    @property
    def n_gpu(self) -> list[int]:
        return [int(b.size) for b in self.buckets]


# --------------------------------------------------------------------------- write
def write_gpu_index(
    path: str | Path,
    gpu: Any,
    vram_capacity: int,
    *,
    model_id: str | None = None,
    activation_id: str | None = None,
    upstream_types: bool = True,
) -> Path:
    """Write a GPU index atomically (temp file + rename) in upstream's layout.

    ``gpu``: a :class:`~powerinfer.convert.placement.Placement`, or per layer a 1-D
    bool/0-1 array ``[n_ff_l]``. ``vram_capacity``: bytes, stored as ``split.vram_capacity``
    (u64; upstream stores the budget the index was solved for). ``model_id``: from
    :func:`model_identity`, stored so :func:`read_gpu_index` can reject an index of another
    model. ``activation_id``: digest of the activation counts the placement was solved from,
    stored so a caller can tell a stale index after re-profiling. ``upstream_types``: write type id 18 (upstream's I32; default) or 26.

    Raises PowerInferError for no layers, a non 1-D or non 0/1 mask, or a negative or
    too-large ``vram_capacity``.
    """
    path = Path(path)
    masks, extra = _masks_of(gpu)
    if not isinstance(vram_capacity, (int, np.integer)) or not 0 <= int(vram_capacity) < 2**64:
        raise PowerInferError(f"{path}: vram capacity {vram_capacity!r} must be a non-negative byte count")
    with atomic_path(path) as tmp:
        w = GGUFWriter(str(tmp), GPU_INDEX_ARCH)
        for i, g in enumerate(masks):
            idx = g.astype(np.int32)
            bucket = np.flatnonzero(g).astype(np.int32)
            w.add_tensor(f"blk.{i}.gpu_idx", idx, raw_dtype=GGMLQuantizationType.I32)
            w.add_tensor(f"blk.{i}.gpu_bucket", bucket, raw_dtype=GGMLQuantizationType.I32)
        w.add_block_count(len(masks))
        w.add_uint64(KEY_VRAM, int(vram_capacity))
        w.add_uint32(KEY_N_FF, int(masks[0].size))
        if model_id is not None:
            w.add_string(KEY_MODEL, str(model_id))
        if activation_id is not None:
            w.add_string(KEY_ACTIVATION, str(activation_id))
        w.add_uint64(KEY_NEURONS, int(sum(int(g.sum()) for g in masks)))
        for key, (kind, value) in extra.items():
            getattr(w, f"add_{kind}")(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if upstream_types:
            _patch_tensor_types(tmp, UPSTREAM_I32)
        set_magic(tmp, PWRI_BYTES)
        with open(tmp, "r+b") as fh:  # upstream rewrites the version too: PWRI + u32 3
            fh.seek(4)
            fh.write(struct.pack("<I", INDEX_VERSION))
    return path


def _masks_of(gpu: Any) -> tuple[list[np.ndarray], dict[str, tuple[str, Any]]]:
    extra: dict[str, tuple[str, Any]] = {}
    if hasattr(gpu, "gpu") and hasattr(gpu, "info"):  # a Placement
        extra[KEY_CHUNK] = ("uint32", int(gpu.chunk))
        extra[KEY_SOLVER] = ("string", f"{gpu.info.method} {gpu.info.status}")
        if gpu.bytes_used is not None:
            extra[KEY_BYTES] = ("uint64", int(gpu.bytes_used))
        gpu = gpu.gpu
    if gpu is None or len(gpu) == 0:
        raise PowerInferError("GPU index: no layers to write")
    masks = []
    for i, g in enumerate(gpu):
        a = np.asarray(g.detach().cpu().numpy() if hasattr(g, "detach") else g)
        if a.ndim != 1 or a.size == 0 or not np.isin(a, (0, 1)).all():
            raise PowerInferError(f"GPU index: layer {i} mask must be a non-empty 1-D array of 0/1")
        masks.append(a.astype(bool))
    return masks, extra


def _patch_tensor_types(path: Path, type_id: int) -> None:
    """Rewrite every tensor's GGML type id in place (the tensor-info table only)."""
    r = GGUFReader(path, "r+")
    for t in r.tensors:
        t.field.parts[4][0] = type_id
    r.data.flush()
    del r


# --------------------------------------------------------------------------- read
class GpuIndexReader(PwriReader):
    """``PwriReader`` that reads type id 18 as I32 (not IQ3_XXS) in ``generic.gpu_index`` files.

    ``raw_types``: each tensor's type id as stored in the file.
    """

    raw_types: list[int]

    def _build_tensors(self, start_offs: int, fields: list[Any], *args: Any, **kwargs: Any) -> None:
        self.raw_types = [int(f.parts[4][0]) for f in fields]
        arch = self.fields.get("general.architecture")
        if arch is not None and _field_str(arch) == GPU_INDEX_ARCH:
            for f in fields:
                if int(f.parts[4][0]) == UPSTREAM_I32:
                    f.parts[4] = np.array([GGUF_I32], dtype=np.uint32)
        super()._build_tensors(start_offs, fields, *args, **kwargs)


def _field_str(f: Any) -> str | None:
    try:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    except Exception:  # noqa: BLE001 - not a string field
        return None


def read_gpu_index(
    path: str | Path,
    *,
    n_layer: int | None = None,
    n_ff: int | Sequence[int] | None = None,
    model_id: str | None = None,
    vram_capacity: int | None = None,
) -> GpuIndex:
    """Read and check a GPU index (ours or upstream's).

    Always checked (PowerInferError naming the path): it parses as GGUF/PWRI,
    ``general.architecture`` is ``generic.gpu_index``, the block count and
    ``split.vram_capacity`` keys exist, there are exactly 2 x block_count tensors named
    ``blk.{i}.gpu_idx``/``blk.{i}.gpu_bucket`` in that order, of type 18 or 26, 1-D, masks
    are 0/1 and each bucket equals the sorted indices of its mask.

    Checked when given (:class:`GpuIndexMismatch`, a PowerInferError: rebuild the index):
    ``n_layer``; ``n_ff`` (one int for all layers or one per layer); ``model_id`` (an index
    without our identity key, e.g. upstream's, is rejected too); ``vram_capacity`` (bytes;
    the stored budget must be equal -- stricter than upstream, which only refuses a larger one).
    """
    path = Path(path)
    f = open_gguf(path, reader_cls=GpuIndexReader)
    arch = f.get("general.architecture")
    if arch != GPU_INDEX_ARCH:
        raise PowerInferError(f"{path}: not a GPU index (general.architecture is {arch!r}, expected {GPU_INDEX_ARCH!r})")
    L = f.get(KEY_BLOCK_COUNT)
    vram = f.get(KEY_VRAM)
    if not isinstance(L, int) or L <= 0:
        raise PowerInferError(f"{path}: GPU index has no valid {KEY_BLOCK_COUNT} key")
    if not isinstance(vram, int):
        raise PowerInferError(f"{path}: GPU index has no valid {KEY_VRAM} key")
    tensors = f.reader.tensors
    raw_types = list(getattr(f.reader, "raw_types", [int(t.tensor_type) for t in tensors]))
    if len(tensors) != 2 * L:
        raise PowerInferError(f"{path}: GPU index has {len(tensors)} tensors, expected 2 x {L} layers")
    gpu, buckets = [], []
    for i in range(L):
        for j, want in ((2 * i, f"blk.{i}.gpu_idx"), (2 * i + 1, f"blk.{i}.gpu_bucket")):
            t = tensors[j]
            if t.name != want:
                raise PowerInferError(f"{path}: tensor {j} is {t.name!r}, expected {want!r}")
            if raw_types[j] not in (UPSTREAM_I32, GGUF_I32) or len(t.shape) != 1:
                raise PowerInferError(f"{path}: tensor {want!r} must be 1-D I32 (type 18 or 26), got type {raw_types[j]} shape {list(t.shape)}")
        idx = np.array(tensors[2 * i].data, dtype=np.int32).reshape(-1)
        bucket = np.array(tensors[2 * i + 1].data, dtype=np.int32).reshape(-1)
        if idx.size == 0 or not np.isin(idx, (0, 1)).all():
            raise PowerInferError(f"{path}: blk.{i}.gpu_idx must be a non-empty 0/1 mask")
        g = idx.astype(bool)
        if not np.array_equal(bucket, np.flatnonzero(g)):
            raise PowerInferError(f"{path}: blk.{i}.gpu_bucket does not list the GPU neurons of blk.{i}.gpu_idx")
        gpu.append(g)
        buckets.append(bucket)
    meta = {k: f.get(k) for k in (KEY_N_FF, KEY_CHUNK, KEY_NEURONS, KEY_BYTES, KEY_SOLVER, KEY_ACTIVATION) if f.get(k) is not None}
    index = GpuIndex(path, gpu, buckets, int(vram), f.get(KEY_MODEL), raw_types, meta)
    _check_expected(index, n_layer, n_ff, model_id, vram_capacity)
    return index


def _check_expected(ix: GpuIndex, n_layer: int | None, n_ff: int | Sequence[int] | None,
                    model_id: str | None, vram_capacity: int | None) -> None:
    p = ix.path
    if n_layer is not None and ix.n_layer != n_layer:
        raise GpuIndexMismatch(f"{p}: GPU index is for {ix.n_layer} layers but the model has {n_layer}; rebuild it")
    if n_ff is not None:
        want = [int(n_ff)] * ix.n_layer if isinstance(n_ff, (int, np.integer)) else [int(x) for x in n_ff]
        if want != ix.n_ff:
            bad = next(i for i in range(max(len(want), ix.n_layer)) if i >= len(want) or i >= ix.n_layer or want[i] != ix.n_ff[i])
            have = ix.n_ff[bad] if bad < ix.n_layer else None
            exp = want[bad] if bad < len(want) else None
            raise GpuIndexMismatch(f"{p}: GPU index layer {bad} has n_ff {have}, the model has {exp}; rebuild it")
    if model_id is not None and ix.model_id != model_id:
        why = "has no model identity (not written by this toolkit)" if ix.model_id is None else "was built for another model"
        raise GpuIndexMismatch(f"{p}: GPU index {why} ({ix.model_id!r}, model is {model_id!r}); rebuild it")
    if vram_capacity is not None and ix.vram_capacity != int(vram_capacity):
        raise GpuIndexMismatch(
            f"{p}: GPU index was built for a VRAM budget of {ix.vram_capacity} bytes, not {int(vram_capacity)}; rebuild it")

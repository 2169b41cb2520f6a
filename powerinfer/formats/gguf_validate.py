"""Check a GGUF header before anything parses or allocates from it: bounds, layout, values.

The ``gguf`` package's reader trusts the file: it loops over any count it reads (an array
of 2**60 elements, or a nested array, runs for minutes and exhausts memory), adds tensor
offsets in wrapping 64-bit arithmetic, and accepts any metadata value. :func:`validate_gguf`
walks the header itself first, with every count, length and dimension bounded by the file
size and by fixed limits, and raises :class:`PowerInferError` naming the file and what is
wrong. It reads only the header (the tensor data is never touched) and keeps only
metadata values (arrays of numbers as one numpy array each).

Checks, in order:

* **structure** (:func:`scan_header`): magic, version 2 or 3, tensor and key counts, key and
  string lengths, value types (arrays of arrays are refused: no known GGUF writer makes
  them), array lengths (at most :data:`MAX_ARRAY` each, :data:`MAX_STRINGS` strings in all), tensor-info dimensions (1 to 4). Every string
  (keys, values, token texts, tensor names) must be valid UTF-8, as the GGUF specification
  says: an invalid one is **refused**, not replaced. llama.cpp keeps such a token's raw bytes;
  replacing them would give two tokens the same text and change tokenization silently.
* **tensors** (:func:`check_tensors`): a known GGML type id (in ``generic.gpu_index`` files id
  18 is upstream's I32, FORMATS.md section 5), rows of whole blocks, a byte size that fits the
  file, offsets that are multiples of ``general.alignment`` (a power of two up to
  :data:`MAX_ALIGNMENT`), and llama.cpp's layout rule: tensors lie in the order of their
  infos, each padded to the alignment, so none overlaps another or wraps past 2**64; unique
  names; the ``blk.N`` layers present are exactly ``0 .. {arch}.block_count - 1`` (files
  with no ``blk.N`` tensor, such as vocabulary-only ones, are not checked for layers); and
  ``token_embd`` / ``output`` have one row per token.
* **metadata** (:func:`check_metadata`): the keys the toolkit reads have the right type
  (a number is not a bool or a string) and a sane value: dimensions in range, norm epsilons
  in (0, 1], ``rope.freq_base`` in [1, :data:`MAX_ROPE_BASE`], ``rope.scaling.factor`` in
  [0, :data:`MAX_ROPE_SCALE`], ``rope.scaling.type`` a string, the sparse threshold within
  +-:data:`MAX_THRESHOLD` and FATReLU's in [0, :data:`MAX_THRESHOLD`] (all finite), tokens
  an array of strings, scores (no NaN) and token types one flat array entry per token, bos/eos
  ids inside the vocabulary (other special ids out of range are ignored, as llama.cpp does).
"""
from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import PowerInferError

# ---------------------------------------------------------------------------- limits
MAX_KEYS = 1 << 16  # metadata entries
MAX_KEY_BYTES = 1 << 16
MAX_TENSORS = 1 << 20
MAX_NAME_BYTES = 63  # llama.cpp: GGML_MAX_NAME (64) including the terminating NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 48  # per tensor (the byte size must also fit the file)
MAX_ARRAY = 1 << 22  # elements of one metadata array (vocabularies are < 300k today)
MAX_STRINGS = 1 << 20  # strings in all metadata arrays together (tokens + merges: ~400k at most today)
MAX_ALIGNMENT = 1 << 16
DEFAULT_ALIGNMENT = 32
# model dimensions (read by runtime/args.py)
MAX_DIM = 1 << 20
MAX_CTX = 1 << 22
MAX_ROPE_SCALE = 1 << 16  # rope.scaling.factor (Llama 3.1 uses 8, long-context YaRN files 4..64)
from ..limits import MAX_LAYERS, MAX_ROPE_BASE, MAX_THRESHOLD  # noqa: E402,F401  (shared with the stages)

# GGUF value types (gguf.GGUFValueType)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
               7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_INTS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_FLOATS = frozenset({6, 12})
GPU_INDEX_ARCH = "generic.gpu_index"
UPSTREAM_I32, GGUF_I32 = 18, 26


@dataclass
class Value:
    """One metadata value: ``vtype`` (a GGUF value type id), ``itype`` the element type of an
    array (else None) and ``value``: a Python scalar or str, a list of str, or a numpy array."""

    vtype: int
    value: Any
    itype: int | None = None

    @property
    def type_name(self) -> str:
        if self.vtype == _ARRAY:
            return f"array of {_TYPE_NAMES.get(self.itype, '?')}"
        return _TYPE_NAMES[self.vtype]


@dataclass
class TensorInfo:
    """One tensor-info record: ``dims`` in GGUF order (fastest first), ``offset`` relative to
    the data section, ``type_id`` as stored; ``nbytes`` is set by :func:`check_tensors`."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int = 0


@dataclass
class Header:
    """A scanned GGUF header: metadata by key, tensor infos in file order, where data starts."""

    path: Path
    file_size: int
    version: int
    kv: dict[str, Value] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    header_end: int = 0
    alignment: int = DEFAULT_ALIGNMENT

    @property
    def data_start(self) -> int:
        return -(-self.header_end // self.alignment) * self.alignment

    def scalar(self, key: str) -> Any:
        v = self.kv.get(key)
        return None if v is None or v.vtype == _ARRAY else v.value


def validate_gguf(path: str | Path) -> Header:
    """Scan and check the header of GGUF ``path`` (all three stages above); the :class:`Header`.

    Raises PowerInferError naming the path and the first problem found.
    """
    h = scan_header(path)
    check_metadata(h)
    check_tensors(h)
    return h


# ---------------------------------------------------------------------------- structure
class _Cursor:
    def __init__(self, buf: Any, path: Path, order: str):
        self.buf, self.path, self.order, self.pos, self.size = buf, path, order, 0, len(buf)

    def fail(self, what: str) -> PowerInferError:
        return PowerInferError(f"{self.path}: not a valid GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes): "
                            "truncated or corrupt")

    def scalar(self, code: str, what: str) -> Any:
        n = struct.calcsize(code)
        self.need(n, what)
        v = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str, limit: int | None = None) -> str:
        start = self.pos
        n = self.scalar("Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} at byte {start} is {n} bytes long, more than the {limit} allowed")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8 (invalid byte {raw[e.start]:#04x} at "
                            f"position {e.start} of {raw[:40]!r})") from None


def scan_header(path: str | Path) -> Header:
    """Walk the header of ``path`` with every count bounded (no value is trusted before it is
    checked); raises PowerInferError for anything malformed."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            raise PowerInferError(f"{path}: empty file, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return _scan(buf, path, size)
            finally:
                buf.release()


def _scan(buf: Any, path: Path, size: int) -> Header:
    c = _Cursor(buf, path, "<")
    c.need(24, "the header")
    c.pos = 4  # magic: checked by the caller (GGUF or PWRI)
    version = c.scalar("I", "version")
    if version & 0xFFFF == 0:  # written on a big-endian machine (the gguf reader's own rule)
        c.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise c.fail(f"version {version} is not supported (2 or 3)")
    n_tensors = c.scalar("Q", "the tensor count")
    n_kv = c.scalar("Q", "the metadata key count")
    # smallest possible records: a key is 8 + 4 + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8
    if n_kv > MAX_KEYS:
        raise c.fail(f"metadata key count {n_kv} is more than the {MAX_KEYS} this reader accepts")
    if n_kv * 13 > size - c.pos:
        raise c.fail(f"truncated: {n_kv} metadata keys cannot fit in a file of {size} bytes")
    if n_tensors > MAX_TENSORS:
        raise c.fail(f"tensor count {n_tensors} is more than the {MAX_TENSORS} this reader accepts")
    if n_tensors * 32 > size - c.pos:
        raise c.fail(f"truncated: {n_tensors} tensor records cannot fit in a file of {size} bytes")
    h = Header(path, size, version)
    strings = [0]
    for i in range(n_kv):
        key = c.string(f"metadata key {i}", MAX_KEY_BYTES)
        if key in h.kv:
            raise c.fail(f"metadata key {key!r} appears twice")
        vtype = c.scalar("I", f"the type of {key}")
        h.kv[key] = _value(c, key, vtype, strings)
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}", MAX_NAME_BYTES)
        n_dims = c.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(c.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims))
        type_id = c.scalar("I", f"the type of tensor {name!r}")
        offset = c.scalar("Q", f"the data offset of tensor {name!r}")
        h.tensors.append(TensorInfo(name, dims, type_id, offset))
    h.header_end = c.pos
    al = h.kv.get("general.alignment")
    if al is not None:
        if al.vtype != 4:
            raise c.fail(f"general.alignment is a {al.type_name}, not a uint32")
        a = al.value
        if not (0 < a <= MAX_ALIGNMENT and a & (a - 1) == 0):
            raise c.fail(f"general.alignment {a} is not a power of two between 1 and {MAX_ALIGNMENT}")
        h.alignment = a
    return h


def _value(c: _Cursor, key: str, vtype: int, strings: list[int]) -> Value:
    if vtype == _STRING:
        return Value(vtype, c.string(f"the value of {key}"))
    if vtype in _SCALAR:
        return Value(vtype, c.scalar(_SCALAR[vtype], f"the value of {key}"))
    if vtype != _ARRAY:
        raise c.fail(f"metadata key {key!r} has unknown value type {vtype}")
    itype = c.scalar("I", f"the element type of {key}")
    n = c.scalar("Q", f"the length of {key}")
    if itype == _ARRAY:
        raise c.fail(f"metadata key {key!r} is an array of arrays (not supported)")
    if itype != _STRING and itype not in _SCALAR:
        raise c.fail(f"metadata key {key!r} is an array of unknown type {itype}")
    item = 8 if itype == _STRING else struct.calcsize(_SCALAR[itype])
    if n > MAX_ARRAY or n * item > c.size - c.pos:
        raise c.fail(f"metadata array {key!r} has {n} elements: more than "
                     f"{'the file holds' if n <= MAX_ARRAY else f'the {MAX_ARRAY} allowed'}")
    if itype == _STRING:
        strings[0] += n
        if strings[0] > MAX_STRINGS:
            raise c.fail(f"metadata arrays hold more than {MAX_STRINGS} strings in all (at {key!r})")
        return Value(vtype, [c.string(f"element {j} of {key}") for j in range(n)], itype)
    dt = np.dtype(_SCALAR[itype]).newbyteorder(c.order)
    arr = np.frombuffer(c.buf, dtype=dt, count=n, offset=c.pos).copy()
    c.pos += n * item
    return Value(vtype, arr, itype)


# ---------------------------------------------------------------------------- tensors
_BLK = re.compile(r"blk\.(\d+)\.")


def tensor_type(h: Header, t: TensorInfo) -> GGMLQuantizationType:
    """The GGML type of ``t`` (type id 18 is I32 in GPU-index files); PowerInferError if unknown."""
    tid = t.type_id
    if tid == UPSTREAM_I32 and h.scalar("general.architecture") == GPU_INDEX_ARCH:
        tid = GGUF_I32
    try:
        q = GGMLQuantizationType(tid)
    except ValueError:
        q = None
    if q is None or q not in GGML_QUANT_SIZES:
        raise PowerInferError(f"{h.path}: tensor {t.name!r} has unknown type id {t.type_id}")
    return q


def check_tensors(h: Header) -> None:
    """Types, sizes and the data layout of every tensor; the layer count (see the module doc)."""
    p, align, data = h.path, h.alignment, h.data_start
    room = h.file_size - data
    seen: set[str] = set()
    expect, prev = 0, None  # prev: the previous TensorInfo
    for t in h.tensors:
        if t.name in seen:
            raise PowerInferError(f"{p}: tensor {t.name!r} appears twice")
        seen.add(t.name)
        q = tensor_type(h, t)
        block, type_size = GGML_QUANT_SIZES[q]
        n = 1
        for d in t.dims:
            if not 0 <= d <= MAX_ELEMENTS:
                raise PowerInferError(f"{p}: tensor {t.name!r} has a dimension of {d} ({list(t.dims)})")
            n *= d
        if n > MAX_ELEMENTS:
            raise PowerInferError(f"{p}: tensor {t.name!r} has {n} elements ({list(t.dims)}), too many")
        if t.dims[0] % block:
            raise PowerInferError(f"{p}: tensor {t.name!r} ({q.name}) has rows of {t.dims[0]} values, "
                                  f"not a multiple of the {q.name} block size {block}")
        t.nbytes = n // block * type_size
        if t.offset % align:
            raise PowerInferError(f"{p}: tensor {t.name!r} has data offset {t.offset}, not a multiple of "
                                  f"general.alignment {align}: the file is corrupt")
        if t.offset > room or t.nbytes > room - t.offset:
            raise PowerInferError(f"{p}: truncated or corrupt: tensor {t.name!r} ({q.name}, {list(t.dims)}, "
                                  f"{t.nbytes} bytes at data offset {t.offset}) extends past the end of the file "
                                  f"({h.file_size} bytes, data from byte {data})")
        if t.offset != expect:
            if prev is None:
                where = "the first tensor's data must start at offset 0"
            else:
                how = "it overlaps tensor" if t.offset < expect else "a gap after tensor"
                where = (f"{how} {prev.name!r} ({tensor_type(h, prev).name}, {list(prev.dims)}, {prev.nbytes} bytes, "
                         f"which ends at {expect} once padded)")
            raise PowerInferError(f"{p}: tensor {t.name!r} has data offset {t.offset}, expected {expect}: {where}; "
                                  f"tensors are stored in order, each padded to general.alignment {align}, so a "
                                  "type, shape or offset is corrupt")
        expect += -(-t.nbytes // align) * align
        prev = t
    _check_layers(h)
    _check_vocab_rows(h)


def _check_layers(h: Header) -> None:
    arch = h.scalar("general.architecture")
    if not isinstance(arch, str) or f"{arch}.block_count" not in h.kv:
        return
    n_layer = h.scalar(f"{arch}.block_count")
    present = {int(m.group(1)) for t in h.tensors if (m := _BLK.match(t.name))}
    if not present:  # a vocabulary-only file (llama.cpp's ggml-vocab-*.gguf) or no layered tensors
        return
    extra = sorted(i for i in present if i >= n_layer)
    if extra:
        raise PowerInferError(f"{h.path}: {arch}.block_count is {n_layer} but the file has tensors for layer "
                              f"{extra[0]} (blk.{extra[0]}.*){f' and {len(extra) - 1} more' if len(extra) > 1 else ''}")
    missing = [i for i in range(n_layer) if i not in present]
    if missing:
        raise PowerInferError(f"{h.path}: {arch}.block_count is {n_layer} but layer {missing[0]} has no tensors "
                              f"(blk.{missing[0]}.*){f'; {len(missing)} layers are missing' if len(missing) > 1 else ''}")


def _check_vocab_rows(h: Header) -> None:
    """``token_embd`` and ``output`` have one row per token of ``tokenizer.ggml.tokens`` (a
    file padded to a larger vocabulary would otherwise be mapped and converted before failing)."""
    toks = h.kv.get("tokenizer.ggml.tokens")
    if toks is None:
        return
    for t in h.tensors:
        if t.name in ("token_embd.weight", "output.weight") and len(t.dims) == 2 and t.dims[1] != len(toks.value):
            raise PowerInferError(f"{h.path}: tensor {t.name!r} has {t.dims[1]} rows, but the vocabulary "
                                  f"(tokenizer.ggml.tokens) has {len(toks.value)} tokens")


# ---------------------------------------------------------------------------- metadata
def _bad(h: Header, key: str, v: Value, why: str) -> PowerInferError:
    shown = v.value if v.vtype != _ARRAY else f"[{v.type_name}, {len(v.value)} elements]"
    return PowerInferError(f"{h.path}: metadata {key} {shown!r} {why} (stored as {v.type_name})")


def _int(h: Header, key: str, lo: int, hi: int, why: str = "") -> None:
    v = h.kv.get(key)
    if v is None:
        return
    if v.vtype not in _INTS:
        raise _bad(h, key, v, "is not an integer")
    if not lo <= v.value <= hi:
        raise _bad(h, key, v, f"is out of range ({lo} to {hi}{why})")


def _float(h: Header, key: str, lo: float, hi: float, *, ints: bool = False, lo_open: bool = False) -> None:
    v = h.kv.get(key)
    if v is None:
        return
    if v.vtype not in _FLOATS and not (ints and v.vtype in _INTS):
        raise _bad(h, key, v, "is not a number" if ints else "is not a float")
    x = float(v.value)
    ok = math.isfinite(x) and (lo < x if lo_open else lo <= x) and x <= hi
    if not ok:
        raise _bad(h, key, v, f"is out of range: it must be finite, in {'(' if lo_open else '['}{lo:g}, {hi:g}]")


def _kind(h: Header, key: str, vtype: int, itypes: frozenset[int] | None = None) -> Value | None:
    v = h.kv.get(key)
    if v is None:
        return None
    if v.vtype != vtype or (itypes is not None and v.itype not in itypes):
        want = _TYPE_NAMES[vtype] if itypes is None else \
            f"array of {' or '.join(sorted({_TYPE_NAMES[i] for i in itypes}))}"
        raise PowerInferError(f"{h.path}: metadata {key} is {'an' if v.type_name[0] in 'aeiou' else 'a'} "
                              f"{v.type_name}, expected {'a' if want[0] not in 'aeiou' else 'an'} {want}")
    return v


def check_metadata(h: Header) -> None:
    """Types and ranges of the metadata keys the toolkit reads (PowerInferError naming the key)."""
    arch_v = _kind(h, "general.architecture", _STRING)
    if arch_v is not None:
        arch = arch_v.value
        if not arch:
            raise PowerInferError(f"{h.path}: metadata general.architecture is empty")
        for key, hi in (("context_length", MAX_CTX), ("embedding_length", MAX_DIM), ("feed_forward_length", MAX_DIM),
                        ("block_count", MAX_LAYERS), ("attention.head_count", MAX_DIM),
                        ("attention.head_count_kv", MAX_DIM), ("rope.dimension_count", MAX_DIM),
                        ("attention.sliding_window", MAX_CTX), ("attention.key_length", MAX_DIM),
                        ("attention.value_length", MAX_DIM)):
            _int(h, f"{arch}.{key}", 1, hi)
        for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
            _float(h, f"{arch}.{key}", 0.0, 1.0, lo_open=True)
        _float(h, f"{arch}.rope.freq_base", 1.0, MAX_ROPE_BASE)
        for key in ("rope.scaling.factor", "rope.scale_linear"):  # 0: no scaling (llama.cpp)
            _float(h, f"{arch}.{key}", 0.0, MAX_ROPE_SCALE)
        _kind(h, f"{arch}.rope.scaling.type", _STRING)
    _float(h, "powerinfer.sparse_threshold", -MAX_THRESHOLD, MAX_THRESHOLD, ints=True)
    _float(h, "powerinfer.activation_threshold", 0.0, MAX_THRESHOLD, ints=True)
    for key in ("powerinfer.activation", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        _kind(h, key, _STRING)
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        _kind(h, key, _BOOL)
    _check_vocab(h)


def _check_vocab(h: Header) -> None:
    toks = _kind(h, "tokenizer.ggml.tokens", _ARRAY, frozenset({_STRING}))
    merges = _kind(h, "tokenizer.ggml.merges", _ARRAY, frozenset({_STRING}))
    model = h.kv.get("tokenizer.ggml.model")
    if model is not None and model.value == "gpt2" and merges is None:  # llama.cpp refuses it too
        raise PowerInferError(f"{h.path}: metadata tokenizer.ggml.merges is missing: tokenizer.ggml.model 'gpt2' "
                              f"(byte-level BPE) cannot tokenize without its merges")
    n = len(toks.value) if toks is not None else None
    if n == 0:
        raise PowerInferError(f"{h.path}: metadata tokenizer.ggml.tokens is empty")
    for key, itypes in (("tokenizer.ggml.scores", _FLOATS), ("tokenizer.ggml.token_type", _INTS)):
        v = _kind(h, key, _ARRAY, itypes)
        if v is None:
            continue
        if n is None or len(v.value) != n:
            raise PowerInferError(f"{h.path}: metadata {key} has {len(v.value)} entries, but there are "
                                  f"{n or 0} tokens (tokenizer.ggml.tokens)")
        if v.itype in _FLOATS and np.isnan(v.value).any():
            raise PowerInferError(f"{h.path}: metadata {key} has a NaN at token {int(np.isnan(v.value).argmax())}")
    for which in ("bos", "eos"):
        key = f"tokenizer.ggml.{which}_token_id"
        if n is None and key in h.kv:
            raise PowerInferError(f"{h.path}: metadata {key} is set but the file has no tokenizer.ggml.tokens")
        _int(h, key, 0, (n or 1) - 1, f": the vocabulary has {n} tokens")
    for which in ("unknown", "padding", "seperator", "separator", "cls", "mask"):  # out of range: ignored
        _int(h, f"tokenizer.ggml.{which}_token_id", -(2**63), 2**64)

"""Edit GGUF files for the validation and fuzz tests: a small parser/writer written from the GGUF
specification (independent of powerinfer's reader), and the demo PowerInfer GGUF they mutate.

:func:`parse` gives the header as plain Python values plus the byte position of every field
(so raw mutants can hit a chosen field); :func:`serialize` writes a header back in front of the
original tensor data, so structural mutants (a value's type, an array's shape, a tensor info)
keep the data section intact. ``serialize(parse(b)) == b`` for files written by gguf-py.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STRING, ARRAY = 8, 9
FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
U32, I32, F32, BOOL, U64, F64 = 4, 5, 6, 7, 10, 12


@dataclass
class KV:
    key: str
    vtype: int
    value: Any  # scalar, str, or for arrays a list (of values, or of (itype, list) for nested ones)
    itype: int | None = None


@dataclass
class TInfo:
    name: str
    dims: list[int]
    type_id: int
    offset: int


@dataclass
class Spot:
    """A field of the header: ``kind`` (count, keylen, vtype, value, strlen, text, itype, alen,
    tname, ndims, dim, ttype, toffset), its byte range and the key or tensor it belongs to."""

    kind: str
    pos: int
    size: int
    owner: str


@dataclass
class Gguf:
    magic: bytes
    version: int
    kvs: list[KV]
    tensors: list[TInfo]
    data: bytes  # the data section (from the aligned data start to the end of the file)
    spots: list[Spot] = field(default_factory=list)
    data_start: int = 0

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    @property
    def alignment(self) -> int:
        a = [k.value for k in self.kvs if k.key == "general.alignment"]
        return a[0] if a else 32


def parse(b: bytes) -> Gguf:
    pos = 0
    spots: list[Spot] = []

    def take(fmt: str, kind: str, owner: str) -> Any:
        nonlocal pos
        n = struct.calcsize(fmt)
        spots.append(Spot(kind, pos, n, owner))
        v = struct.unpack_from("<" + fmt, b, pos)[0]
        pos += n
        return v

    def string(kind: str, owner: str) -> str:
        nonlocal pos
        n = take("Q", kind + "len", owner)
        spots.append(Spot(kind, pos, n, owner))
        s = b[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(vtype: int, owner: str) -> Any:
        if vtype == STRING:
            return string("text", owner)
        if vtype == ARRAY:
            it = take("I", "itype", owner)
            n = take("Q", "alen", owner)
            return it, [value(it, owner) for _ in range(n)]
        return take(FMT[vtype], "value", owner)

    magic = b[:4]
    pos = 4
    version = take("I", "version", "header")
    nt = take("Q", "count", "tensor_count")
    nk = take("Q", "count", "kv_count")
    kvs = []
    for _ in range(nk):
        key = string("key", "")
        spots[-1].owner = spots[-2].owner = key
        vt = take("I", "vtype", key)
        v = value(vt, key)
        kvs.append(KV(key, vt, v[1], v[0]) if vt == ARRAY else KV(key, vt, v))
    tensors = []
    for _ in range(nt):
        name = string("tname", "")
        spots[-1].owner = spots[-2].owner = name
        nd = take("I", "ndims", name)
        dims = [take("Q", "dim", name) for _ in range(nd)]
        tt = take("I", "ttype", name)
        off = take("Q", "toffset", name)
        tensors.append(TInfo(name, dims, tt, off))
    g = Gguf(magic, version, kvs, tensors, b"", spots)
    g.data_start = -(-pos // g.alignment) * g.alignment
    g.data = b[g.data_start:]
    return g


def _pack_value(vtype: int, v: Any, itype: int | None = None) -> bytes:
    if vtype == STRING:
        raw = v.encode("utf-8", "surrogateescape") if isinstance(v, str) else bytes(v)
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        head = struct.pack("<IQ", itype, len(v))
        if itype in FMT:
            return head + struct.pack(f"<{len(v)}{FMT[itype]}", *v)
        return head + b"".join(_pack_value(ARRAY, x[1], x[0]) if itype == ARRAY else _pack_value(itype, x) for x in v)
    return struct.pack("<" + FMT[vtype], v)


def serialize(g: Gguf, pad: int | None = None) -> bytes:
    """The file: header, zero padding to ``pad`` (default: the file's alignment), the data section."""
    out = g.magic + struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs))
    for k in g.kvs:
        out += _pack_value(STRING, k.key) + struct.pack("<I", k.vtype) + _pack_value(k.vtype, k.value, k.itype)
    for t in g.tensors:
        out += _pack_value(STRING, t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, t.type_id, t.offset)
    out += bytes(-len(out) % (pad or g.alignment))
    return out + g.data


def build_demo_pwri(folder: Path) -> Path:
    """The packaged demo model (stories260K-relu, 5 layers, vocab 512) as an f32 PowerInfer GGUF
    with seeded random predictors (as tests/test_perplexity.py builds it)."""
    import torch

    import powerinfer
    from powerinfer.convert.writer import convert
    from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir

    cfg = json.loads((powerinfer.DEMO_MODEL / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    layers = [LayerPredictor(torch.randn(16, cfg["hidden_size"], generator=gen),
                             torch.randn(cfg["intermediate_size"], 16, generator=gen))
              for _ in range(cfg["num_hidden_layers"])]
    pred = save_predictor_dir(folder / "pred", layers, {"sparse_threshold": 0.0})
    return Path(convert(powerinfer.DEMO_MODEL, folder / "demo.powerinfer.gguf", pred, outtype="f32", progress=False))


def greedy(path: Path, prompt: str = "Once upon a time", n: int = 4) -> tuple[list[int], list[int]]:
    """Load ``path`` as pi-run does (default context) and return (prompt ids, ``n`` greedy ids)."""
    import torch

    from powerinfer.runtime.loading import load_model

    model, tok = load_model(str(path), "f32")
    ids = tok.encode(prompt)
    out: list[int] = []
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids), 0)
        for i in range(n):
            out.append(int(logits.argmax()))
            if i + 1 < n:
                logits = model.forward(torch.tensor([out[-1]]), len(ids) + i)
    return ids, out

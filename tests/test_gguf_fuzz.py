"""Seeded GGUF fuzz test: a few hundred mutants of the demo PowerInfer GGUF.

Each mutant is loaded in-process as pi-run loads a model (``load_model``: the model with the
default context, then its tokenizer) and run greedily for a few tokens. It must either fail with
one clean :class:`PowerInferError`, or load and give the same prompt ids and the same greedy
tokens as the original file. Any other exception, or different tokens, is a failure.

Mutant classes (counts in ``CLASSES``), all seeded:

* ``truncate``: the file cut at random points of the header, data start and data section;
* ``flip_field``: one random bit flipped in a structural field (counts, version, key and string
  lengths, value types, array types and lengths, tensor dimension counts, dimensions, types,
  offsets) or in a model dimension's value;
* ``flip_text``: bit 7 flipped in one byte of a key, string value, token or tensor name (this
  always makes invalid UTF-8);
* ``huge``: a count, length or dimension set to 2**32 .. 2**64 - 1;
* ``type_id``: a tensor type id replaced (unknown ids, and real types of another size) or a
  metadata value type id made unknown;
* ``offset``: a tensor offset misaligned, overlapping the previous tensor, past the end,
  wrapped past 2**64, or two same-size tensors' offsets swapped;
* ``alignment``: general.alignment set to 0, a non-power of two, a huge value, a larger power
  of two (moving the data start), or stored as another type;
* ``float``: rms epsilon, rope.freq_base, the sparse and activation thresholds set to NaN,
  +-inf, 0, negative or 1e30, or stored as a string or a bool;
* ``vocab``: tokens stored as int32, scores nested (an array of arrays) or as strings or of the
  wrong length, a NaN score, token types of the wrong length, an empty vocabulary, bos/eos ids
  outside the vocabulary;
* ``layers``: block_count too small, too large or 0, an extra ``blk.5`` tensor, a layer removed;
* ``context``: context_length changed (a huge one must run with the default 4096 context);
* ``equivalent``: the same values stored another valid way (an integer of another width, a
  float64, ``-0.0``), unknown keys added, an explicit or larger alignment with the data laid out
  to match: these must run, with the same tokens (the checks are not stricter than the format).

Not generated, because no file format can tell them from a different valid file: a bit flip
that turns one valid name into another (``tokenizer.ggml.scores`` renamed drops the scores), a
changed token text that is still valid UTF-8, a different but in-range bos id, a smaller
alignment, and changes inside the tensor data.
"""
from __future__ import annotations

import collections
import math
import random
import struct
import time

import pytest

from gguf_edit import ARRAY, BOOL, F32, F64, I32, STRING, U32, U64, KV, TInfo, build_demo_pwri, greedy, parse, serialize
from powerinfer.errors import PowerInferError

SEED = 12
CLASSES = {"truncate": 40, "flip_field": 90, "flip_text": 50, "huge": 25, "type_id": 30, "offset": 35,
           "alignment": 8, "float": 40, "vocab": 20, "layers": 6, "context": 4, "equivalent": 14}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = build_demo_pwri(tmp_path_factory.mktemp("fuzz"))
    return path, path.read_bytes()


def _set(b: bytes, pos: int, fmt: str, v) -> bytes:
    n = struct.calcsize(fmt)
    return b[:pos] + struct.pack("<" + fmt, v) + b[pos + n:]


def _edit(data: bytes, fn, pad: int | None = None) -> bytes:
    g = parse(data)
    pad = pad or g.alignment
    fn(g)
    return serialize(g, pad)  # data laid out as written, whatever the edited header claims


def _put(g, key: str, vtype: int, value, itype=None) -> None:
    """Set (or add) metadata ``key``."""
    for k in g.kvs:
        if k.key == key:
            k.vtype, k.value, k.itype = vtype, value, itype
            return
    g.kvs.append(KV(key, vtype, value, itype))


def mutants(data: bytes) -> list[tuple[str, str, bytes]]:
    rng = random.Random(SEED)
    g0 = parse(data)
    spots, size, start = g0.spots, len(data), g0.data_start
    out: list[tuple[str, str, bytes]] = []
    add = lambda cls, what, b: out.append((cls, what, b))  # noqa: E731

    # truncate
    cuts = [rng.randrange(0, start) for _ in range(20)] + [start - 1, start, start + 1] + \
        [rng.randrange(start, size) for _ in range(CLASSES["truncate"] - 24)] + [size - 1]
    for c in cuts:
        add("truncate", f"cut at {c}", data[:c])

    # one bit in a structural field or a dimension value
    dim_keys = {"llama.embedding_length", "llama.block_count", "llama.feed_forward_length", "llama.context_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count"}
    fields = [s for s in spots if s.kind in ("count", "version", "keylen", "vtype", "textlen", "itype", "alen",
                                             "tnamelen", "ndims", "dim", "ttype", "toffset")
              or (s.kind == "value" and s.owner in dim_keys)]
    for _ in range(CLASSES["flip_field"]):
        s = rng.choice(fields)
        byte = s.pos + rng.randrange(s.size)
        bit = rng.randrange(8)
        add("flip_field", f"{s.kind} of {s.owner or 'header'}: byte {byte} bit {bit}",
            data[:byte] + bytes([data[byte] ^ (1 << bit)]) + data[byte + 1:])

    # bit 7 of one byte of text
    texts = [s for s in spots if s.kind in ("key", "text", "tname") and s.size]
    for _ in range(CLASSES["flip_text"]):
        s = rng.choice(texts)
        byte = s.pos + rng.randrange(s.size)
        add("flip_text", f"{s.kind} of {s.owner}: byte {byte}", data[:byte] + bytes([data[byte] ^ 0x80]) + data[byte + 1:])

    # huge counts, lengths and dimensions
    big = [2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
    huge_fields = [s for s in spots if s.kind in ("count", "keylen", "textlen", "alen", "tnamelen", "dim")]
    huge_fields += [s for s in spots if s.kind == "ndims"][:3]
    for _ in range(CLASSES["huge"]):
        s = rng.choice(huge_fields)
        v = rng.choice(big) if s.size == 8 else rng.choice([2**31, 2**32 - 1, 5, 1000])
        add("huge", f"{s.kind} of {s.owner or 'header'} = {v}", _set(data, s.pos, "Q" if s.size == 8 else "I", v))

    # tensor and value type ids
    ttypes = [s for s in spots if s.kind == "ttype"]
    vtypes = [s for s in spots if s.kind in ("vtype", "itype")]
    for i in range(CLASSES["type_id"]):
        if i % 5 == 4:
            s = rng.choice(vtypes)
            v = rng.choice([13, 14, 100, 2**31])
        else:
            s = rng.choice(ttypes)
            v = rng.choice([1, 2, 3, 4, 5, 8, 12, 14, 18, 30, 31, 36, 41, 99, 2**31, 2**32 - 1])
        add("type_id", f"{s.kind} of {s.owner} = {v}", _set(data, s.pos, "I", v))

    # tensor offsets
    offs = [s for s in spots if s.kind == "toffset"]
    by_size: dict[int, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(g0.tensors):
        by_size[math.prod(t.dims)].append(i)
    pairs = [v for v in by_size.values() if len(v) > 1]
    for i in range(CLASSES["offset"]):
        k = rng.randrange(1, len(offs))
        s, t = offs[k], g0.tensors[k]
        how = i % 6
        if how == 0:
            v, what = t.offset + rng.choice([1, 2, 4, 8, 16, 31]), "misaligned"
        elif how == 1:
            v, what = g0.tensors[k - 1].offset, "overlapping the previous tensor"
        elif how == 2:
            v, what = 2**64 - start + rng.choice([0, 32, 64, 4096]), "wrapped past 2**64 into the header"
        elif how == 3:
            v, what = size - start - 32 * rng.randrange(1, 4), "near the end"
        elif how == 4:
            v, what = t.offset + 32 * rng.randrange(1, 8), "a gap after the previous tensor"
        else:
            a, b_ = rng.sample(rng.choice(pairs), 2)
            sa, sb = offs[a], offs[b_]
            m = _set(data, sa.pos, "Q", g0.tensors[b_].offset)
            add("offset", f"offsets of {g0.tensors[a].name} and {g0.tensors[b_].name} swapped",
                _set(m, sb.pos, "Q", g0.tensors[a].offset))
            continue
        add("offset", f"{t.name} {what} ({v})", _set(data, s.pos, "Q", v % 2**64))

    # general.alignment
    for v, vt in [(0, U32), (3, U32), (48, U32), (2**31, U32), (64, U32), (4096, U32), (32, U64), (32, I32)][
            :CLASSES["alignment"]]:
        add("alignment", f"general.alignment = {v} ({vt})", _edit(data, lambda g, v=v, vt=vt: _put(g, "general.alignment", vt, v)))

    # metadata floats
    fkeys = ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "powerinfer.sparse_threshold",
             "powerinfer.activation_threshold"]
    fvals = [(F32, math.nan), (F32, math.inf), (F32, -math.inf), (F32, 0.0), (F32, -1.0), (F32, 1e30),
             (F32, -1e30), (STRING, "x"), (BOOL, True), (STRING, "1e-5")]
    for key in fkeys:
        for vt, v in fvals[:CLASSES["float"] // len(fkeys)]:
            if key == "powerinfer.activation_threshold" and vt == F32 and v == 0.0:
                v = -0.5  # 0 is ReLU's threshold: valid
            if key == "powerinfer.sparse_threshold" and vt == F32 and v in (0.0, -1.0):
                v = 1e4 if v else -1e4  # 0 and -1 are valid logit thresholds
            add("float", f"{key} = {v!r} ({vt})", _edit(data, lambda g, k=key, vt=vt, v=v: _put(g, k, vt, v)))

    # vocabulary
    n = len(g0.kv("tokenizer.ggml.tokens").value)
    scores = g0.kv("tokenizer.ggml.scores").value
    vocab = [
        ("tokens as int32", lambda g: _put(g, "tokenizer.ggml.tokens", ARRAY, list(range(n)), I32)),
        ("tokens empty", lambda g: _put(g, "tokenizer.ggml.tokens", ARRAY, [], STRING)),
        ("scores nested", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY, [(F32, [x] * 8) for x in scores], ARRAY)),
        ("scores nested, huge inner", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY,
                                                     [(F32, [0.0] * 4000)] * 200, ARRAY)),
        ("scores as strings", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY, [str(x) for x in scores], STRING)),
        ("scores one short", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY, scores[:-1], F32)),
        ("scores one long", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY, scores + [0.0], F32)),
        ("a NaN score", lambda g: _put(g, "tokenizer.ggml.scores", ARRAY, scores[:100] + [math.nan] + scores[101:], F32)),
        ("token types one short", lambda g: _put(g, "tokenizer.ggml.token_type", ARRAY,
                                                 g.kv("tokenizer.ggml.token_type").value[:-1], I32)),
        ("token types as floats", lambda g: _put(g, "tokenizer.ggml.token_type", ARRAY, [1.0] * n, F32)),
        ("a token of invalid UTF-8", lambda g: g.kv("tokenizer.ggml.tokens").value.__setitem__(300, b"\xff\xfe")),
        ("tokens as one string", lambda g: _put(g, "tokenizer.ggml.tokens", STRING, "abc")),
        ("bos 512", lambda g: _put(g, "tokenizer.ggml.bos_token_id", U32, 512)),
        ("bos 2**31", lambda g: _put(g, "tokenizer.ggml.bos_token_id", U32, 2**31)),
        ("bos -1", lambda g: _put(g, "tokenizer.ggml.bos_token_id", I32, -1)),
        ("bos as string", lambda g: _put(g, "tokenizer.ggml.bos_token_id", STRING, "1")),
        ("bos as float", lambda g: _put(g, "tokenizer.ggml.bos_token_id", F32, 1.0)),
        ("eos 512", lambda g: _put(g, "tokenizer.ggml.eos_token_id", U32, 512)),
        ("eos 2**32-1", lambda g: _put(g, "tokenizer.ggml.eos_token_id", U32, 2**32 - 1)),
        ("add_bos_token as string", lambda g: _put(g, "tokenizer.ggml.add_bos_token", STRING, "yes")),
    ]
    for what, fn in vocab[:CLASSES["vocab"]]:
        add("vocab", what, _edit(data, fn))

    # layers
    def extra_layer(g):
        t = g.tensors[-1]
        nbytes = math.prod(t.dims) * 4
        g.tensors.append(TInfo("blk.5.fc2.weight", list(t.dims), t.type_id, t.offset + nbytes))
        g.data += g.data[t.offset:t.offset + nbytes]

    def drop_layer(g):
        keep = [t for t in g.tensors if not t.name.startswith("blk.4.")]
        g.tensors = keep  # blk.4 was last: the others keep their offsets
        g.data = g.data[:keep[-1].offset + math.prod(keep[-1].dims) * 4]

    layer_cases = [("block_count 4 with 5 layers", lambda g: _put(g, "llama.block_count", U32, 4)),
                   ("block_count 6 with 5 layers", lambda g: _put(g, "llama.block_count", U32, 6)),
                   ("block_count 0", lambda g: _put(g, "llama.block_count", U32, 0)),
                   ("block_count as string", lambda g: _put(g, "llama.block_count", STRING, "5")),
                   ("an extra blk.5 tensor", extra_layer), ("layer 4 removed", drop_layer)]
    for what, fn in layer_cases[:CLASSES["layers"]]:
        add("layers", what, _edit(data, fn))

    # context length
    for v in [4194304, 8192, 2**31, 0][:CLASSES["context"]]:
        add("context", f"context_length {v}", _edit(data, lambda g, v=v: _put(g, "llama.context_length", U32, v)))

    # the same model, stored another valid way
    equivalent = [
        ("context_length as uint64", lambda g: _put(g, "llama.context_length", U64, 512)),
        ("context_length as int32", lambda g: _put(g, "llama.context_length", I32, 512)),
        ("freq_base as float64", lambda g: _put(g, "llama.rope.freq_base", F64, 10000.0)),
        ("rms epsilon as float64", lambda g: _put(g, "llama.attention.layer_norm_rms_epsilon", F64,
                                                  g.kv("llama.attention.layer_norm_rms_epsilon").value)),
        ("sparse_threshold -0.0", lambda g: _put(g, "powerinfer.sparse_threshold", F32, -0.0)),
        ("sparse_threshold as int32 0", lambda g: _put(g, "powerinfer.sparse_threshold", I32, 0)),
        ("activation_threshold 0 added", lambda g: _put(g, "powerinfer.activation_threshold", F32, 0.0)),
        ("bos as int32", lambda g: _put(g, "tokenizer.ggml.bos_token_id", I32, 1)),
        ("bos as uint64", lambda g: _put(g, "tokenizer.ggml.bos_token_id", U64, 1)),
        ("an unknown string key", lambda g: _put(g, "general.note", STRING, "h\u00e9llo")),
        ("an unknown array key", lambda g: _put(g, "general.blob", ARRAY, list(range(200)), 0)),
        ("add_eos_token removed", lambda g: g.kvs.remove(g.kv("tokenizer.ggml.add_eos_token"))),
        ("general.alignment 32 explicit", lambda g: _put(g, "general.alignment", U32, 32)),
    ]
    for what, fn in equivalent:
        add("equivalent", what, _edit(data, fn))
    add("equivalent", "general.alignment 64, data laid out for it",
        _edit(data, lambda g: _put(g, "general.alignment", U32, 64), pad=64))
    return out


def run_mutant(path, expect) -> str:
    """``error`` (a clean PowerInferError) or ``same`` (same ids and tokens); raises otherwise."""
    try:
        got = greedy(path)
    except PowerInferError as e:
        msg = str(e)
        assert str(path) in msg and "\n" not in msg.strip(), msg
        return "error"
    assert got == expect, f"ran, but gave {got} instead of {expect}"
    return "same"


def test_fuzz_mutants_fail_cleanly_or_run_identically(demo, tmp_path, capsys):
    path, data = demo
    expect = greedy(path)
    assert len(expect[1]) == 4 and expect[0][0] == 1  # BOS, then the prompt; 4 greedy tokens
    assert serialize(parse(data)) == data  # the test's own writer reproduces the file
    ms = mutants(data)
    assert len(ms) == sum(CLASSES.values())
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    t0 = time.time()
    for i, (cls, what, b) in enumerate(ms):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(b)
        try:
            counts[cls][run_mutant(p, expect)] += 1
        except Exception as e:  # noqa: BLE001 - a traceback or different tokens: record and go on
            counts[cls]["FAIL"] += 1
            failures.append(f"{cls}: {what}: {type(e).__name__}: {str(e)[:200]}")
        p.unlink()
    elapsed = time.time() - t0
    total = sum(counts.values(), collections.Counter())
    table = "\n".join(f"  {cls:10s} {dict(c)}" for cls, c in counts.items())
    with capsys.disabled():
        print(f"\nGGUF fuzz (seed {SEED}): {len(ms)} mutants in {elapsed:.1f} s: {dict(total)}\n{table}")
    assert not failures, f"{len(failures)} of {len(ms)} mutants failed:\n" + "\n".join(failures)
    assert counts["equivalent"]["same"] == CLASSES["equivalent"]  # the harness does run models
    assert counts["context"]["same"] == 2

"""The GGUF validation layer (powerinfer/formats/gguf_validate.py) on each defect of issue 12's
"Tracebacks, hangs, memory" and "Corrupt files that run and print garbage" lists (the loader
ones), and the default context of min(model's, 4096).

Every mutant is a copy of the demo PowerInfer GGUF with one field changed; pi-run must refuse it
with one ``Error:`` line naming the file and the problem (exit 1), never run it.
"""
from __future__ import annotations

import logging
import math
import struct
import tracemalloc

import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from gguf_edit import ARRAY, BOOL, F32, I32, STRING, U32, KV, build_demo_pwri, greedy, parse, serialize
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import PwriReader, open_gguf
from powerinfer.formats.gguf_validate import MAX_ARRAY, validate_gguf
from powerinfer.runtime.cli import main as run_main
from powerinfer.runtime.loading import load_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_pwri(tmp_path_factory.mktemp("demo"))


def _refused_before_reading(p, match: str) -> None:
    """``open_gguf(p)`` is refused by the header scan alone: the ``gguf`` reader is never built
    and the scan allocates little (the defects guarded against read gigabytes or looped over
    2**62 entries). Counted, not timed, so it holds on any machine."""
    built = []

    class Reader(PwriReader):
        def __init__(self, *a, **k):
            built.append(a)
            super().__init__(*a, **k)

    tracemalloc.start()
    try:
        with pytest.raises(PowerInferError, match=match):
            open_gguf(p, reader_cls=Reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert built == [] and peak < 64 << 20, (len(built), peak)


def _variant(tmp_path, demo, fn, name="m.gguf"):
    g = parse(demo.read_bytes())
    pad = g.alignment
    fn(g)
    p = tmp_path / name
    p.write_bytes(serialize(g, pad))
    return p


def _put(key, vtype, value, itype=None):
    def fn(g):
        for k in g.kvs:
            if k.key == key:
                k.vtype, k.value, k.itype = vtype, value, itype
                return
        g.kvs.append(KV(key, vtype, value, itype))
    return fn


def _refused(path, *needles):
    """pi-run refuses ``path``: exit 1, one Error line naming the file and each needle."""
    r = CliRunner().invoke(run_main, ["-m", str(path), "-n", "2", "--temp", "0"])
    assert r.exit_code == 1, r.output
    assert r.output.count("Error:") == 1 and "Traceback" not in r.output, r.output
    for n in (str(path), *needles):
        assert n in r.output, r.output
    return r.output


def _tensor(g, name):
    return next(t for t in g.tensors if t.name == name)


# --------------------------------------------------------------------- tracebacks, hangs, memory
def test_invalid_utf8_token_is_refused(tmp_path, demo):
    p = _variant(tmp_path, demo, lambda g: g.kv("tokenizer.ggml.tokens").value.__setitem__(300, b"ab\xffc"))
    _refused(p, "element 300 of tokenizer.ggml.tokens", "not valid UTF-8", "0xff")


@pytest.mark.parametrize("bos", [512, 2**31])
def test_bos_outside_the_vocabulary(tmp_path, demo, bos):
    p = _variant(tmp_path, demo, _put("tokenizer.ggml.bos_token_id", U32, bos))
    _refused(p, f"bos_token_id {bos} is out of range", "512 tokens")


def test_tokens_stored_as_int32(tmp_path, demo):
    p = _variant(tmp_path, demo, _put("tokenizer.ggml.tokens", ARRAY, list(range(512)), I32))
    _refused(p, "tokenizer.ggml.tokens is an array of int32, expected an array of string")


@pytest.mark.parametrize("value,vtype,why", [("x", STRING, "is not a number"), (True, BOOL, "is not a number"),
                                             (math.nan, F32, "must be finite"), (-0.5, F32, "must be finite")])
def test_activation_threshold_bad_values(tmp_path, demo, value, vtype, why):
    p = _variant(tmp_path, demo, _put("powerinfer.activation_threshold", vtype, value))
    _refused(p, "powerinfer.activation_threshold", why)


def test_nested_scores_are_refused_at_once(tmp_path, demo):
    """Was: 70 s and 7.5 GB, then MemoryError. The scan refuses nested arrays before any reading."""
    scores = parse(demo.read_bytes()).kv("tokenizer.ggml.scores").value
    p = _variant(tmp_path, demo, _put("tokenizer.ggml.scores", ARRAY, [(F32, [s]) for s in scores], ARRAY))
    _refused_before_reading(p, "'tokenizer.ggml.scores' is an array of arrays")


@pytest.mark.parametrize("field", ["alen", "textlen", "keylen", "count", "dim"])
def test_huge_counts_are_refused_before_reading(tmp_path, demo, field):
    """A count or length of 2**62 is refused from the file size alone (the gguf reader would
    loop over it or slice past the end)."""
    data = demo.read_bytes()
    spot = next(s for s in parse(data).spots if s.kind == field)
    p = tmp_path / "huge.gguf"
    p.write_bytes(data[:spot.pos] + struct.pack("<Q", 2**62) + data[spot.pos + 8:])
    _refused_before_reading(p, str(p))


def test_a_file_cut_inside_its_header_is_called_truncated(tmp_path, demo):
    """A real file cut to 100 bytes: its key count is genuine but the keys cannot fit, so the
    message says truncated (not a bound the count exceeded)."""
    p = tmp_path / "cut.gguf"
    p.write_bytes(demo.read_bytes()[:100])
    with pytest.raises(PowerInferError, match=r"truncated: \d+ metadata keys cannot fit in a file of 100 bytes"):
        open_gguf(p)


def test_scores_of_the_wrong_length(tmp_path, demo):
    p = _variant(tmp_path, demo, lambda g: g.kv("tokenizer.ggml.scores").value.pop())
    _refused(p, "tokenizer.ggml.scores has 511 entries, but there are 512 tokens")


# --------------------------------------------------------------------- the default context
def test_huge_context_length_gets_the_default_context(tmp_path, demo, caplog):
    """Was: a KV cache of 4194304 positions (3 GB for a 0.75 MB file). Now 4096 by default, with
    the KV-cache size in a warning, and -c (n_ctx) up to the model's length."""
    p = _variant(tmp_path, demo, _put("llama.context_length", U32, 4194304))
    with caplog.at_level(logging.WARNING, logger="powerinfer.runtime.model"):
        model, _ = load_model(str(p), "f32")
    assert (model.n_ctx, model.max_ctx) == (4096, 4194304)
    kv = 2 * 5 * 4 * 8 * 4  # K and V bytes per position: 5 layers, 4 kv heads of 8, f32
    assert tuple(model.cache.k.shape) == (5, 4096, 4, 8)
    assert f"KV cache {kv * 4096 / 2**20:.0f} MiB" in caplog.text
    assert f"-c 4194304 for the whole context (KV cache {kv * 4194304 / 2**30:.1f} GiB)" in caplog.text
    model, _ = load_model(str(p), "f32", n_ctx=10000)
    assert model.n_ctx == 10000
    assert greedy(p) == greedy(demo)


def test_short_models_keep_their_context_without_a_warning(demo, caplog):
    with caplog.at_level(logging.WARNING, logger="powerinfer.runtime.model"):
        model, _ = load_model(str(demo), "f32")
    assert model.n_ctx == model.max_ctx == 512
    assert "context" not in caplog.text


# --------------------------------------------------------------------- corrupt files that ran
def test_offset_wrapping_past_2_64_into_the_header(tmp_path, demo):
    def fn(g):
        _tensor(g, "blk.0.attn_q.weight").offset = 2**64 - g.data_start  # data_start + offset wraps to 0
    _refused(_variant(tmp_path, demo, fn), "'blk.0.attn_q.weight'", "extends past the end of the file")


def test_misaligned_offset(tmp_path, demo):
    def fn(g):
        _tensor(g, "blk.1.ffn_up.weight").offset += 4
    _refused(_variant(tmp_path, demo, fn), "'blk.1.ffn_up.weight'", "not a multiple of general.alignment 32")


def test_overlapping_offsets(tmp_path, demo):
    def fn(g):
        t = _tensor(g, "blk.1.attn_k.weight")
        t.offset = _tensor(g, "blk.1.attn_q.weight").offset  # same size: aligned, inside the file
    _refused(_variant(tmp_path, demo, fn), "'blk.1.attn_k.weight'", "overlaps tensor 'blk.1.attn_q.weight'")


def test_swapped_offsets_of_same_size_tensors(tmp_path, demo):
    """Aligned, in the file, no overlap, but not in the order of the tensor infos (llama.cpp's rule)."""
    def fn(g):
        a, b = _tensor(g, "blk.0.attn_q.weight"), _tensor(g, "blk.0.attn_output.weight")
        a.offset, b.offset = b.offset, a.offset
    _refused(_variant(tmp_path, demo, fn), "'blk.0.attn_q.weight'", "expected")


@pytest.mark.parametrize("type_id,name", [(1, "F16"), (2, "Q4_0"), (30, "BF16")])
def test_type_id_that_does_not_match_the_byte_size(tmp_path, demo, type_id, name):
    def fn(g):
        _tensor(g, "blk.2.ffn_gate.weight").type_id = type_id
    _refused(_variant(tmp_path, demo, fn), "'blk.2.ffn_gate.weight'")


@pytest.mark.parametrize("type_id", [4, 31, 99, 2**32 - 1])
def test_unknown_type_id(tmp_path, demo, type_id):
    def fn(g):
        _tensor(g, "output_norm.weight").type_id = type_id
    _refused(_variant(tmp_path, demo, fn), f"'output_norm.weight' has unknown type id {type_id}")


def test_block_count_smaller_than_the_layers_present(tmp_path, demo):
    p = _variant(tmp_path, demo, _put("llama.block_count", U32, 4))
    _refused(p, "llama.block_count is 4 but the file has tensors for layer 4 (blk.4.*)")


def test_block_count_larger_than_the_layers_present(tmp_path, demo):
    p = _variant(tmp_path, demo, _put("llama.block_count", U32, 6))
    _refused(p, "llama.block_count is 6 but layer 5 has no tensors")


@pytest.mark.parametrize("key", ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"])
@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf, -math.inf, 0.0])
def test_norm_epsilon_and_rope_base_must_be_finite_and_positive(tmp_path, demo, key, value):
    _refused(_variant(tmp_path, demo, _put(key, F32, value)), key, "must be finite")


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e30, -1e30])
def test_sparse_threshold_must_be_finite_and_bounded(tmp_path, demo, value):
    _refused(_variant(tmp_path, demo, _put("powerinfer.sparse_threshold", F32, value)),
             "powerinfer.sparse_threshold", "must be finite")


@pytest.mark.parametrize("value,vtype", [(True, BOOL), ("0.5", STRING)])
def test_sparse_threshold_must_be_a_number(tmp_path, demo, value, vtype):
    _refused(_variant(tmp_path, demo, _put("powerinfer.sparse_threshold", vtype, value)),
             "powerinfer.sparse_threshold", "is not a number")


def test_valid_thresholds_still_load(tmp_path, demo):
    """A negative logit threshold and an integer one are valid (more / fewer neurons predicted)."""
    for v, vt in ((-2.5, F32), (1, I32)):
        model, _ = load_model(str(_variant(tmp_path, demo, _put("powerinfer.sparse_threshold", vt, v))), "f32")
        assert model.args.sparse_threshold == v


# --------------------------------------------------------------------- the reader itself
def test_numeric_arrays_read_as_one_view_match_the_gguf_reader(demo):
    """PwriReader reads a numeric array as one numpy view; values equal gguf's own reader."""
    data = demo.read_bytes()
    plain = demo.with_name("plain.gguf")
    plain.write_bytes(b"GGUF" + data[4:])
    ours, theirs = PwriReader(demo), GGUFReader(plain)
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens", "llama.block_count"):
        assert ours.get_field(key).contents() == theirs.get_field(key).contents(), key
    assert len(ours.get_field("tokenizer.ggml.scores").contents()) == 512


def test_header_scan_matches_the_file(demo):
    h = validate_gguf(demo)
    g = parse(demo.read_bytes())
    assert h.data_start == g.data_start and h.alignment == 32
    assert [(t.name, list(t.dims), t.type_id, t.offset) for t in h.tensors] == \
        [(t.name, t.dims, t.type_id, t.offset) for t in g.tensors]
    assert h.tensors[-1].offset + h.tensors[-1].nbytes == demo.stat().st_size - h.data_start
    assert list(h.kv["tokenizer.ggml.scores"].value) == pytest.approx(g.kv("tokenizer.ggml.scores").value)


def test_array_longer_than_the_limit(tmp_path, demo):
    p = _variant(tmp_path, demo, _put("general.padding", ARRAY, [0] * (MAX_ARRAY + 1), 0))
    with pytest.raises(PowerInferError, match=f"more than the {MAX_ARRAY} allowed"):
        open_gguf(p)


def test_string_arrays_are_bounded_and_read_quickly(tmp_path, demo):
    """A string array near the limit opens without a numpy read per string (the gguf reader's way
    took 148 s and 1.4 GB for 2**20 strings on the test machine: the reads are counted here, not
    timed); past the limit (all arrays together) it is refused."""
    from powerinfer.formats.gguf_validate import MAX_STRINGS

    n = MAX_STRINGS - 512 - 100  # the vocabulary holds 512 strings
    p = _variant(tmp_path, demo, _put("general.junk", ARRAY, ["ab"] * n, STRING))
    reads = []

    class Counting(PwriReader):
        def _get(self, *a, **k):
            reads.append(a[0])
            return super()._get(*a, **k)

    assert open_gguf(p, reader_cls=Counting).get("general.junk")[-2:] == ["ab", "ab"]
    assert 0 < len(reads) < 10_000  # the gguf reader's own way makes two reads per string: 2 * 2**20
    p = _variant(tmp_path, demo, _put("general.junk", ARRAY, ["ab"] * (n + 101), STRING))
    with pytest.raises(PowerInferError, match=f"more than {MAX_STRINGS} strings in all"):
        open_gguf(p)


def test_embedding_rows_must_match_the_vocabulary(tmp_path, demo):
    """A file padded to a larger vocabulary than its tokens (pi-convert with vocab_size 1e6 and
    512 tokens) is refused from the header, before 1M rows are mapped or converted."""
    p = _variant(tmp_path, demo, lambda g: g.kv("tokenizer.ggml.tokens").value.pop())
    g = parse(p.read_bytes())  # scores and types keep 512 entries: shorten them too
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        g.kv(key).value.pop()
    p.write_bytes(serialize(g))
    _refused(p, "'token_embd.weight' has 512 rows, but the vocabulary (tokenizer.ggml.tokens) has 511 tokens")

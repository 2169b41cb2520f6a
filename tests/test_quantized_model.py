"""Whole quantized models through pi-run's runtime: sparse = dense with every neuron active,
Q8_0/Q4_0 against f32 on real weights, weights kept in the memory map, bad files refused."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from powerinfer.convert.quantize import quantize_file
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.quant.qweight import QWeight
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.weights import is_mapped

from helpers import all_active_predictors, teacher_forced

IDS = [1, 403, 407, 261, 378, 432, 383, 286, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]


@pytest.fixture(scope="module")
def files(tmp_path_factory, relu_hf):
    """stories260K-relu (real weights): f32 dense, f32 PWRI with every neuron predicted active,
    and both in Q8_0 and Q4_0 (f16 predictors, so the masks stay all-active)."""
    tmp = tmp_path_factory.mktemp("qmodel")
    cfg = json.loads((relu_hf / "config.json").read_text())
    pred = all_active_predictors(tmp / "pred", cfg["hidden_size"], cfg["intermediate_size"],
                                 cfg["num_hidden_layers"])
    out = {"f32": convert(relu_hf, tmp / "m.gguf", None, outtype="f32", progress=False),
           "f32-sparse": convert(relu_hf, tmp / "m.powerinfer.gguf", pred, outtype="f32", progress=False)}
    for t in ("q8_0", "q4_0"):
        out[t] = quantize_file(out["f32"], tmp / f"m-{t}.gguf", t).path
        out[f"{t}-sparse"] = quantize_file(out["f32-sparse"], tmp / f"m-{t}.powerinfer.gguf", t,
                                           predictor_type="f16").path
    return out


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_sparse_with_every_neuron_active_equals_quantized_dense(backend, files, qtype):
    f = files[f"{qtype}-sparse"]
    sparse = Transformer(open_gguf(f))
    assert sparse.quantized == (backend == "c")
    a = teacher_forced(sparse, IDS, 6)
    b = teacher_forced(Transformer(open_gguf(f), dense=True), IDS, 6)
    assert sparse.active_share() == 1.0
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.parametrize("qtype,max_diff,min_margin", [("q8_0", 0.15, 1.0), ("q4_0", 2.0, 4.0)])
@pytest.mark.parametrize("kind", ["", "-sparse"])
def test_quantized_logits_track_f32_on_real_weights(files, qtype, max_diff, min_margin, kind):
    """Teacher-forced on the same tokens: logits within ``max_diff`` of f32's spread, and the
    same next token wherever f32's top-2 margin exceeds ``min_margin``. stories260K with ReLU
    swapped in is only 64 wide, so 4-bit weights move its logits by up to ~1.7 spreads."""
    ref = teacher_forced(Transformer(open_gguf(files["f32" + kind])), IDS, 6)
    got = teacher_forced(Transformer(open_gguf(files[qtype + kind])), IDS, 6)
    assert (got - ref).abs().max().item() <= max_diff * ref.std().item()
    top = ref.topk(2, -1).values
    sure = top[:, 0] - top[:, 1] > min_margin
    assert sure.sum() >= 2
    assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


def test_quantized_matrices_stay_in_the_memory_map(c_kernels, files):
    g = open_gguf(files["q4_0-sparse"])
    model = Transformer(g)
    rows = [model.tok_embd]  # zero-copy views of the map
    for layer in model.layers:
        f = layer.ffn
        rows += [f.gate, f.up, f.down_t, f.fc1, f.fc2]  # the sparse FFN reads neuron rows in place
        # dense-only Q4_0 matrices are re-laid out in 8-row groups (one copy, the map pages released)
        assert layer.wo.layout == layer.wqkv.layout == "x8" and not is_mapped(g, layer.wo.raw)
    assert all(isinstance(w, QWeight) and w.layout == "rows" and is_mapped(g, w.raw) for w in rows)
    assert model.layers[0].ffn.fc2.btype.name == "F16"  # fc2 rows of 4 values: kept f16, still mapped
    assert {w.btype.name for w in rows} == {"Q4_0", "F16"}
    assert model.output.btype.name == "Q8_0" and model.output.layout == "x8"


def _patch_first_dim(path, tensor: str, new_ne0: int):
    """Rewrite the first dimension of ``tensor``'s info in a GGUF header (offsets unchanged)."""
    raw = bytearray(path.read_bytes())
    name = tensor.encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", raw, at)[0] == 2  # n_dims, then ne[0], ne[1] as u64
    struct.pack_into("<Q", raw, at + 4, new_ne0)
    path.write_bytes(bytes(raw))


def test_quantized_tensor_with_partial_blocks_is_refused_naming_it(files, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(files["q4_0"].read_bytes())
    _patch_first_dim(bad, "blk.1.ffn_up.weight", 48)  # 64 -> 48 values per row: 1.5 Q4_0 blocks
    with pytest.raises(PowerInferError, match=r"blk\.1\.ffn_up\.weight.*multiple of the Q4_0 block size"):
        Transformer(open_gguf(bad))


def test_nan_block_scale_is_refused_naming_the_tensor(c_kernels, files, tmp_path):
    """One NaN fp16 scale in one Q4_0 block would turn every token into garbage: refused at load."""
    g = open_gguf(files["q4_0"])
    t = g.tensors["blk.2.ffn_up.weight"]
    raw = bytearray(files["q4_0"].read_bytes())
    at = int(t.data_offset) + 5 * 36 + 18  # row 5, second block: its fp16 scale
    raw[at:at + 2] = (0x7E00).to_bytes(2, "little")  # NaN
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(PowerInferError, match=r"blk\.2\.ffn_up\.weight.*NaN or infinite block scale in row 5"):
        Transformer(open_gguf(bad))


def test_token_ids_outside_the_vocabulary_are_refused(c_kernels, files):
    model = Transformer(open_gguf(files["q4_0"]))
    with pytest.raises(PowerInferError, match="outside the vocabulary"):
        model.forward(torch.tensor([1, 512]), 0)
    with pytest.raises(PowerInferError, match="outside the vocabulary"):
        model.forward(torch.tensor([-1]), 0)

"""f16 and bf16 files run in their own bytes: every matrix a QWeight of the file's type, read
in place from the memory map (AVX2+F16C kernels, or the scalar build), never an f32 copy.

The reference is the same file's values in f32 through plain torch (the ``torch`` backend
widens each matrix to f32 at load): the kernels must give those logits to f32 summation
error, and the process must stay at about the file's size.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers import make_tiny_llama, teacher_forced
from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.quant.qweight import QWeight
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.weights import is_mapped

IDS = [1, 403, 407, 261, 378, 432, 383, 286, 300, 301, 302, 303]
N_LAYER, N_EMBD, N_FF = 2, 256, 1024


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same model and predictors as f16 and bf16 PowerInfer GGUFs."""
    tmp = tmp_path_factory.mktemp("b16")
    hf = make_tiny_llama(tmp / "hf", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, n_head=4, n_head_kv=4)
    g = torch.Generator().manual_seed(0)
    preds = [LayerPredictor(torch.randn(32, N_EMBD, generator=g), torch.randn(N_FF, 32, generator=g))
             for _ in range(N_LAYER)]
    save_predictor_dir(tmp / "pred", preds, {"sparse_threshold": 0.0})
    return {t: convert(hf, tmp / f"m.{t}.powerinfer.gguf", tmp / "pred", outtype=t, progress=False)
            for t in ("f16", "bf16")}


def _matrices(model):
    out = [model.tok_embd, model.output]
    for layer in model.layers:
        f = layer.ffn
        out += [layer.wqkv, layer.wo, f.gate, f.up, f.down_t, f.fc1, f.fc2]
    return [w for w in out if w is not None]


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_every_matrix_stays_in_the_files_type(files, kind):
    g = open_gguf(files[kind])
    model = Transformer(g, torch.float32)
    for w in _matrices(model):
        assert isinstance(w, QWeight) and w.btype.name == kind.upper(), w
    for layer in model.layers:  # the sparse FFN rows and the predictor are read straight from the map
        for w in (layer.ffn.gate, layer.ffn.up, layer.ffn.down_t, layer.ffn.fc2):
            assert is_mapped(g, w.raw)
    assert is_mapped(g, model.output.raw)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("dense", [False, True])
def test_logits_equal_the_same_values_in_f32(lib, files, kind, dense):
    """Native and scalar builds (``lib``) against torch's f32 math on the widened values."""
    got = teacher_forced(Transformer(open_gguf(files[kind]), torch.float32, dense=dense), IDS, 5)
    saved = kernels.backend()
    kernels.set_backend("torch")
    try:
        ref_model = Transformer(open_gguf(files[kind]), torch.float32, dense=dense)
        assert all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in _matrices(ref_model))
        ref = teacher_forced(ref_model, IDS, 5)
    finally:
        kernels.set_backend(saved)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_bf16_file_values_are_f32_rounded_to_nearest_even(files):
    """Every value of a bf16 matrix is the checkpoint's f32 value rounded to nearest even (as
    torch rounds to bfloat16), bit for bit; 1-D tensors stay f32."""
    from safetensors.torch import load_file

    hf = load_file(str(files["bf16"].parent / "hf" / "model.safetensors"))
    g = open_gguf(files["bf16"])
    for gguf_name, hf_name in (("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
                               ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight")):
        t = g.tensors[gguf_name]
        assert t.tensor_type.name == "BF16"
        got = np.asarray(t.data).view(np.uint16).reshape(N_FF, N_EMBD)
        want = hf[hf_name].float().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, want)
    assert g.tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"


def test_bf16_matrix_with_nan_is_refused_naming_the_tensor_and_row(files, tmp_path):
    from powerinfer.errors import PowerInferError

    bad = tmp_path / "nan.powerinfer.gguf"
    data = bytearray(files["bf16"].read_bytes())
    t = open_gguf(files["bf16"]).tensors["blk.1.ffn_gate.weight"]
    row = 7
    at = t.data_offset + row * N_EMBD * 2 + 10
    data[at:at + 2] = bytes([0xC0, 0x7F])  # bf16 NaN
    bad.write_bytes(bytes(data))
    with pytest.raises(PowerInferError, match=r"blk\.1\.ffn_gate\.weight.*BF16.*row 7"):
        Transformer(open_gguf(bad), torch.float32)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_f16_file_is_resident_once(files):
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    r0 = rss()
    model = Transformer(open_gguf(files["f16"]), torch.float32)
    with torch.inference_mode():
        model.forward(torch.tensor(IDS[:4]), 0)
    grown = rss() - r0
    weights = sum(w.nbytes for w in {id(w): w for w in _matrices(model)}.values())
    assert grown <= 1.15 * weights + (24 << 20), f"RSS grew {grown / 1e6:.1f} MB for {weights / 1e6:.1f} MB"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_kv_cache_pages_become_resident_only_as_positions_are_written():
    from powerinfer.runtime.model import KVCache

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    r0 = rss()
    cache = KVCache(4, 4096, 8, 128, torch.float32)  # 128 MiB of keys and values
    assert rss() - r0 < (16 << 20)
    k, v = cache.layer(3)
    assert not k.any() and not v.any()  # reads as zeros before any write
    k[:8] = 1.0
    assert k[:8].eq(1).all() and not k[8:].any() and not cache.layer(2)[0].any()

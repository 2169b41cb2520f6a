"""Files quantized by llama.cpp itself (its Q4_0 with a Q6_K output, its Q4_K_M mixing Q4_K and
Q6_K, Q/K/V of different types) run in pi-run and give llama.cpp's logits.

Skipped without ``llama-cpp-python`` (``pip install llama-cpp-python``), which quantizes the
files and computes the reference logits.
"""
from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
import pytest
import torch

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.quant.qweight import QWeight
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer

from helpers import make_tiny_llama, teacher_forced

llama_cpp = pytest.importorskip("llama_cpp")

IDS = [1, 403, 407, 261, 378, 432, 383, 286, 300, 301, 302, 303, 304, 305, 306, 307]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llamacpp")
    # SiLU, as llama.cpp runs every dense llama file; rows of 256 so the K-quants apply
    hf = make_tiny_llama(tmp / "hf", n_layer=2, hidden_act="silu", n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
    out = {"f32": convert(hf, tmp / "m.gguf", None, outtype="f32", progress=False)}
    for name, ftype in (("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0), ("q4_k_m", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.nthread = ftype, 1
        dst = tmp / f"m-{name}.gguf"
        assert llama_cpp.llama_model_quantize(str(out["f32"]).encode(), str(dst).encode(), ctypes.byref(p)) == 0
        out[name] = dst
    return out


def llamacpp_logits(path) -> torch.Tensor:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(IDS)
        return torch.from_numpy(np.array(llm.scores[:len(IDS)], dtype=np.float32))
    finally:
        llm.close()


@pytest.mark.parametrize("name,types", [("q4_0", {"Q4_0", "Q6_K"}), ("q4_k_m", {"Q4_K", "Q6_K"})])
def test_llamacpp_quantized_files_run_in_place_and_match_llamacpp(files, name, types):
    kernels.set_backend("c")
    g = open_gguf(files[name])
    assert types <= Counter(t.tensor_type.name for t in g.reader.tensors).keys()
    model = Transformer(g)
    assert model.quantized and isinstance(model.output, QWeight) and model.output.btype.name == "Q6_K"
    ours = teacher_forced(model, IDS, 4)
    ref = llamacpp_logits(files[name])
    f32 = teacher_forced(Transformer(open_gguf(files["f32"])), IDS, 4)
    # This random model amplifies rounding: 4-bit weights move its logits by 9-14 (spread
    # 3.2). On the same quantized bytes pi-run and llama.cpp stay within ~1 of each other
    # (measured 0.96 for Q4_0, 1.15 for Q4_K_M): they round activations differently (q8_0
    # blocks with fp16 scales / q8_K blocks of 256 there; q8_0 blocks of 32, fp32 scales here).
    gap = (ours - ref).abs().max().item()
    assert gap <= 0.2 * (ref - f32).abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_torch_backend_reads_the_same_files(files):
    kernels.set_backend("torch")
    try:
        model = Transformer(open_gguf(files["q4_k_m"]))
        assert not model.quantized  # dequantized at load without the C kernels
        ours = teacher_forced(model, IDS, 4)
    finally:
        kernels.set_backend("auto")
    kernels.set_backend("c")
    fast = teacher_forced(Transformer(open_gguf(files["q4_k_m"])), IDS, 4)
    # the C kernels round activations to 8-bit blocks, the dequantized torch path does not;
    # both stay as close to llama.cpp as to each other
    ref = llamacpp_logits(files["q4_k_m"])
    assert (ours - fast).abs().max().item() <= 2 * max((ref - fast).abs().max().item(), (ref - ours).abs().max().item())


def test_f32_file_matches_llamacpp(files):
    ours = teacher_forced(Transformer(open_gguf(files["f32"])), IDS, 4)
    ref = llamacpp_logits(files["f32"])
    assert (ours - ref).abs().max().item() <= 0.05 * ref.std().item()  # measured 0.08 of a 3.2 spread

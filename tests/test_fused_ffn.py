"""One token's sparse FFN as one C call (``sparse_ffn.c``) gives the Python path's numbers,
counts and skipped rows, for every weight type, FFN kind and sparse activation, on the native
and the scalar build; FFNs the call cannot take run the Python path."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import make_tiny_llama, random_predictors
from powerinfer.convert.writer import convert
from powerinfer.families import Activation
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer

N_EMBD, N_FF = 64, 256


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused")
    hf = make_tiny_llama(tmp / "hf", n_layer=3, n_embd=N_EMBD, n_ff=N_FF, n_head=4, n_head_kv=4)
    random_predictors(tmp / "pred", 3, N_EMBD, N_FF, hidden=(32, 40, 8))  # x8 and row-layout predictors
    pred = tmp / "pred"
    return {t: convert(hf, tmp / f"m.{t}.powerinfer.gguf", pred, outtype=t, progress=False)
            for t in ("f16", "bf16", "q4_0", "q8_0")}


def _both(ffn, h, x):
    """(fused output, python output) and the counters each added."""
    assert ffn.fused() is not None
    ffn.reset_stats()
    ffn.count_fired = True
    fused = ffn(h, x)
    counts = (ffn.n_active, ffn.n_fired, ffn.n_calls)
    ffn.reset_stats()
    ref = ffn(h, x, ffn.predict(h))  # an explicit mask takes the Python path
    return fused, ref, counts, (ffn.n_active, ffn.n_fired, ffn.n_calls)


@pytest.mark.parametrize("kind", ["f16", "bf16", "q4_0", "q8_0"])
def test_fused_call_equals_python_path(lib, files, kind):
    model = Transformer(open_gguf(files[kind]), torch.float32)
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        h, x = torch.randn(1, N_EMBD, generator=g), torch.randn(1, N_EMBD, generator=g)
        fused, ref, c1, c2 = _both(layer.ffn, h, x)
        assert fused.shape == (1, N_EMBD) and fused.dtype == torch.float32
        assert torch.allclose(fused, ref, rtol=0, atol=1e-5 * max(1.0, ref.abs().max().item()))
        assert c1 == c2 and 0 < c1[1] < c1[0] < N_FF  # some neurons predicted, fewer fired


@pytest.mark.parametrize("ffn_kind,act", [("dreglu", Activation("relu")), ("reglu", Activation("fatrelu", 0.3)),
                                          ("relu", Activation("relu"))])
def test_fused_call_covers_each_ffn_kind_and_activation(files, ffn_kind, act):
    model = Transformer(open_gguf(files["q4_0"]), torch.float32)
    ffn = model.layers[1].ffn
    ffn.family = dataclasses.replace(ffn.family, ffn=ffn_kind)
    ffn.act = act
    ffn.__dict__.pop("gate_min", None)
    if ffn_kind == "relu":
        ffn.gate = None
    h, x = torch.randn(1, N_EMBD), torch.randn(1, N_EMBD)
    fused, ref, c1, c2 = _both(ffn, h, x)
    assert torch.allclose(fused, ref, rtol=0, atol=1e-5 * max(1.0, ref.abs().max().item())) and c1 == c2


def _reference(ffn, kind: str, thr: float | None, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The FFN output for neurons ``idx`` in float64 from the dequantized weights, with the
    activation written here from its definition (ReLU: v if v > 0; FATReLU: v if v >= thr, else 0),
    independent of Activation.apply, gate_min and the kernels."""
    def deq(w):
        return (w.dequantize() if hasattr(w, "dequantize") else w).double()

    def act(v):
        return torch.where(v > 0, v, 0.0) if thr is None else torch.where(v >= thr, v, 0.0)

    xd = x.double().view(-1)
    u = deq(ffn.up)[idx] @ xd
    if kind == "relu":
        hidden = act(u)
    else:
        g = deq(ffn.gate)[idx] @ xd
        hidden = act(g) * (u if kind == "reglu" else act(u))
    return hidden @ deq(ffn.down_t)[idx]


@pytest.mark.parametrize("ffn_kind", ["reglu", "dreglu", "relu"])
def test_fused_call_applies_the_fatrelu_threshold(files, ffn_kind):
    """Each FFN kind with FATReLU (threshold 0.3) against an independent float64 reference on the f16
    file (no activation rounding), and not equal to the same FFN under plain ReLU: among the
    predicted neurons some pre-activations lie in (0, 0.3), so an activation that ignored the
    threshold (in the C call, in gate_min or in both) would show. (The Python-path comparison above
    cannot see that: both paths share gate_min, which skips the up rows below the threshold.)"""
    thr = 0.3
    model = Transformer(open_gguf(files["f16"]), torch.float32)
    ffn = model.layers[1].ffn
    ffn.family = dataclasses.replace(ffn.family, ffn=ffn_kind)
    if ffn_kind == "relu":
        ffn.gate = None
    g = torch.Generator().manual_seed(7)
    h, x = torch.randn(1, N_EMBD, generator=g), 2 * torch.randn(1, N_EMBD, generator=g)
    idx = ffn.predict(h).view(-1).nonzero().view(-1)
    pre = ffn.up.dequantize().double()[idx] @ x.double().view(-1) if ffn_kind == "relu" else \
        ffn.gate.dequantize().double()[idx] @ x.double().view(-1)
    assert ((pre > 0) & (pre < thr)).sum() >= 3  # the threshold decides for these neurons

    outs = {}
    for name, act in (("fatrelu", Activation("fatrelu", thr)), ("relu", Activation("relu"))):
        ffn.act = act
        ffn.__dict__.pop("gate_min", None)
        assert ffn.fused() is not None
        ffn.reset_stats()
        outs[name] = ffn(h, x)[0].double()
        assert ffn.n_calls == 1 and ffn.n_active == idx.numel()  # the one-call path ran, on these rows
        want = _reference(ffn, ffn_kind, thr if name == "fatrelu" else None, x, idx)
        assert torch.allclose(outs[name], want, rtol=0, atol=1e-4 * max(1.0, want.abs().max().item())), name
    assert (outs["fatrelu"] - outs["relu"]).abs().max() > 1e-2


def test_python_path_where_the_call_cannot_run(files):
    model = Transformer(open_gguf(files["q4_0"]), torch.float32)
    ffn = model.layers[0].ffn
    assert ffn.fused() is not None
    ffn.up_b = torch.zeros(N_FF)  # biases: the Python path (the call is rebuilt when they change)
    assert ffn.fused() is None
    ffn.up_b = None
    assert ffn.fused() is not None
    ffn.act = Activation("silu")  # a dense activation: the Python path
    assert ffn.fused() is None
    saved = kernels.backend()
    try:
        kernels.set_backend("torch")
        assert Transformer(open_gguf(files["q4_0"]), torch.float32).layers[0].ffn.fused() is None
    finally:
        kernels.set_backend(saved)

"""The fast CPU decode path: kernels against plain torch math, sparse = dense when every
neuron is predicted active, the compute-dtype choice, and weights loaded without copies."""
from __future__ import annotations

import json
import os

import pytest
import torch

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.weights import compute_dtype, is_mapped

from helpers import all_active_predictors, make_tiny_llama, teacher_forced

def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2  # relative to the values' scale


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [0.0, 1 / 64, 0.1, 0.5, 1.0])
def test_gathered_rows_equal_plain_reference(backend, dtype, share):
    g = torch.Generator().manual_seed(int(share * 1000))
    n_ff, d = 300, 200  # not multiples of the vector width: tails are exercised
    gate, up, down_t = (torch.randn(n_ff, d, generator=g).to(dtype) for _ in range(3))
    x = torch.randn(d, generator=g).to(dtype)
    idx = (torch.rand(n_ff, generator=g) < share).nonzero().view(-1)
    if share == 1 / 64:
        idx = idx[:1]  # exactly one row
    g_ref, u_ref = gate.float()[idx] @ x.float(), up.float()[idx] @ x.float()
    rg, ru = kernels.rows_dot(x, idx, gate, up)
    assert rg.shape == ru.shape == (idx.numel(),)
    scale = max(1.0, g_ref.abs().max().item() if idx.numel() else 1.0)
    assert (rg - g_ref).abs().max().item() <= _tol(dtype) * scale if idx.numel() else True
    assert (ru - u_ref).abs().max().item() <= _tol(dtype) * scale if idx.numel() else True
    only_up, none = kernels.rows_dot(x, idx, up)
    assert none is None and torch.equal(only_up, ru)
    coef = torch.relu(g_ref) * u_ref
    out = kernels.rows_axpy(idx, down_t, coef).float()
    ref = coef @ down_t.float()[idx] if idx.numel() else torch.zeros(d)
    assert out.shape == (d,)
    assert (out - ref).abs().max().item() <= _tol(dtype) * max(1.0, ref.abs().max().item())


def test_c_bf16_products_are_fp32_sums_of_exact_products():
    """The C kernels' bf16 rows (AVX512_BF16's vdpbf16ps where the CPU has it, else widened
    to fp32) sum the exact bf16 x bf16 products in fp32: within fp32 rounding of a float64
    reference (1e-5 of the sum of |products|), far inside bf16's own 2^-9, so a kernel that
    rounded its sums to bf16, or dropped a lane or a tail, would show."""
    try:
        kernels.set_backend("c")
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        g = torch.Generator().manual_seed(7)
        for K in (32, 64, 200, 1032):  # below, at, between and past the 64-wide steps
            w = torch.randn(40, K, generator=g).bfloat16()
            x = torch.randn(K, generator=g).bfloat16()
            ref, mag = w.double() @ x.double(), w.double().abs() @ x.double().abs()
            idx = torch.arange(0, 40, 3)
            got = {"gemv": kernels._mv(w, x), "rows": kernels.rows_dot(x, idx, w)[0]}
            for name, y in got.items():
                want, m = (ref, mag) if name == "gemv" else (ref[idx], mag[idx])
                assert y.dtype == torch.float32
                assert ((y.double() - want).abs() <= 1e-5 * m).all(), (name, K)
            coef = torch.randn(idx.numel(), generator=g)
            out = kernels.rows_axpy(idx, w, coef).double()
            wd = w.double()[idx]
            assert ((out - coef.double() @ wd).abs() <= 1e-5 * (coef.double().abs() @ wd.abs())).all(), K
    finally:
        kernels.set_backend("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_and_predict_equal_plain_reference(backend, dtype):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(70, 130, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    x = torch.randn(1, 130, generator=g).to(dtype)
    ref = x.float() @ w.float().T + b.float()
    got = kernels.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (1, 70)
    assert (got.float() - ref).abs().max().item() <= _tol(dtype) * ref.abs().max().item()
    fc1, fc2 = torch.randn(16, 130, generator=g).to(dtype), torch.randn(70, 16, generator=g).to(dtype)
    logits = torch.relu(x.float() @ fc1.float().T) @ fc2.float().T
    mask = kernels.predict(x, fc1, fc2, 0.0)
    assert mask.shape == (1, 70) and mask.dtype == torch.bool
    clear = logits.abs() > _tol(dtype) * logits.abs().max()  # ignore logits rounding can flip
    assert torch.equal(mask[clear], (logits >= 0)[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,n_pos", [(4, 4, 64, 1), (8, 2, 32, 37), (6, 3, 8, 5)])
def test_decode_attention_equals_sdpa(backend, dtype, n_head, n_head_kv, head_dim, n_pos):
    g = torch.Generator().manual_seed(n_pos)
    cache_k, cache_v = (torch.randn(64, n_head_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(n_head, head_dim, generator=g).to(dtype)
    k, v = cache_k[3:3 + n_pos], cache_v[3:3 + n_pos]  # a window of the cache, as the model passes it
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, None], k.float().transpose(0, 1), v.float().transpose(0, 1), enable_gqa=True)[:, 0]
    got = kernels.attend_one(q, k, v)
    assert got.shape == (n_head, head_dim) and got.dtype == dtype
    assert (got.float() - ref).abs().max().item() <= _tol(dtype)


def test_c_backend_builds_here_with_a_compiler():
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    try:
        assert kernels.set_backend("c") == "c"
    finally:
        kernels.set_backend("auto")


# ---------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def all_active_file(tmp_path_factory, relu_hf):
    tmp = tmp_path_factory.mktemp("fast")
    cfg = json.loads((relu_hf / "config.json").read_text())
    pred = all_active_predictors(tmp / "pred", cfg["hidden_size"], cfg["intermediate_size"],
                                  cfg["num_hidden_layers"])
    return convert(relu_hf, tmp / "m.powerinfer.gguf", pred, outtype="f32", progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_with_every_neuron_active_equals_dense(backend, dtype, all_active_file):
    ids = [1, 403, 407, 261, 378, 432, 383, 286, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]
    sparse = Transformer(open_gguf(all_active_file), dtype)
    a = teacher_forced(sparse, ids, 6)
    b = teacher_forced(Transformer(open_gguf(all_active_file), dtype, dense=True), ids, 6)
    assert sparse.active_share() == 1.0
    if dtype == torch.float32:
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.std().item())
    else:  # bf16 rounds at different points in the two paths; both track the f32 model as closely
        ref = teacher_forced(Transformer(open_gguf(all_active_file), torch.float32, dense=True), ids, 6)
        for got in (a, b):
            assert (got - ref).abs().max().item() <= 0.2 * ref.std().item()
            assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
        assert (a - b).abs().max().item() <= 0.15 * b.std().item()


# ---------------------------------------------------------------------------- dtype choice
def test_dtype_auto_picks_bf16_only_with_native_bf16_dot_products():
    assert compute_dtype("auto", {"avx512f", "avx512_bf16"}) == torch.bfloat16
    assert compute_dtype("auto", {"avx2", "amx_bf16"}) == torch.bfloat16
    assert compute_dtype("auto", {"avx2", "fma", "f16c"}) == torch.float32
    assert compute_dtype("auto", set()) == torch.float32
    assert compute_dtype("f32", {"avx512_bf16"}) == torch.float32
    assert compute_dtype("bf16", set()) == torch.bfloat16


def test_dtype_auto_without_flags_reads_the_machine_flags(monkeypatch):
    """``compute_dtype("auto")`` with no flags must consult /proc/cpuinfo's flags (x86) or
    Features (Arm): a fake cpuinfo decides the answer, both ways."""
    import io

    from powerinfer import hardware

    def fake_cpuinfo(text):
        monkeypatch.setattr(hardware, "open", lambda *a, **k: io.StringIO(text), raising=False)
        hardware.cpu_flags.cache_clear()

    try:
        monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
        fake_cpuinfo("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
        assert hardware.cpu_flags() == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
        assert compute_dtype("auto") == torch.bfloat16
        fake_cpuinfo("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\n")
        assert compute_dtype("auto") == torch.float32
        fake_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm names it bf16, not avx512_bf16
        assert compute_dtype("auto") == torch.float32  # ... but this machine claims to be x86
        monkeypatch.setattr(hardware.platform, "machine", lambda: "aarch64")
        assert compute_dtype("auto") == torch.bfloat16
        fake_cpuinfo("processor\t: 0\n")  # no flags line at all
        assert hardware.cpu_flags() == frozenset() and compute_dtype("auto") == torch.float32
    finally:
        monkeypatch.undo()
        hardware.cpu_flags.cache_clear()


# ---------------------------------------------------------------------------- memory
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _weights(model):
    ts = [model.tok_embd, model.output]
    for layer in model.layers:
        f = layer.ffn
        ts += [layer.wqkv, layer.wo, f.gate, f.up, f.down_t, f.fc1, f.fc2]
    seen, out = set(), []
    for t in ts:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


@pytest.fixture(scope="module")
def medium_f32(tmp_path_factory):
    """A ~40 MB f32 PowerInfer GGUF (4 layers, n_embd 512, n_ff 2048, half the neurons predicted)."""
    tmp = tmp_path_factory.mktemp("mem")
    hf = make_tiny_llama(tmp / "hf", n_layer=4, n_embd=512, n_ff=2048, n_head=8, n_head_kv=8)
    g = torch.Generator().manual_seed(0)
    preds = [LayerPredictor(torch.randn(32, 512, generator=g), torch.randn(2048, 32, generator=g)) for _ in range(4)]
    save_predictor_dir(tmp / "pred", preds, {"sparse_threshold": 0.0})
    return convert(hf, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f32", progress=False)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_f32_file_with_f32_compute_maps_the_big_matrices_without_copies(medium_f32):
    r0 = _rss()
    g = open_gguf(medium_f32)
    model = Transformer(g, torch.float32)
    with torch.inference_mode():
        model.forward(torch.tensor([1, 2, 3]), 0)
        model.forward(torch.tensor([4]), 3)
    grown = _rss() - r0
    ws = _weights(model)
    total = sum(t.numel() * t.element_size() for t in ws)
    copied = [t for t in ws if not is_mapped(g, t)]
    # only the fused wqkv is built in memory (once); every other matrix is a view of the map
    assert all(any(t.data_ptr() == layer.wqkv.data_ptr() for layer in model.layers) for t in copied)
    for layer in model.layers:
        assert is_mapped(g, layer.ffn.gate) and is_mapped(g, layer.ffn.down_t) and is_mapped(g, layer.ffn.fc2)
    assert is_mapped(g, model.output)
    assert grown <= 1.15 * total + (16 << 20), f"RSS grew {grown / 1e6:.1f} MB for {total / 1e6:.1f} MB of weights"


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_converted_weights_are_resident_once(medium_f32):
    """f32 file, bf16 compute: the converted copy is resident, the mapped file pages are not."""
    r0 = _rss()
    model = Transformer(open_gguf(medium_f32), torch.bfloat16)
    with torch.inference_mode():
        model.forward(torch.tensor([1, 2, 3]), 0)
    grown = _rss() - r0
    total = sum(t.numel() * t.element_size() for t in _weights(model))
    assert grown <= 1.15 * total + (16 << 20), f"RSS grew {grown / 1e6:.1f} MB for {total / 1e6:.1f} MB of weights"


# ---------------------------------------------------------------------------- pi-run
def test_pi_run_bench_reports_speed_ffn_share_and_active_share(all_active_file):
    from click.testing import CliRunner

    from powerinfer.runtime.cli import main

    r = CliRunner().invoke(main, ["-m", str(all_active_file), "--bench", "-n", "8", "--dtype", "f32"])
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.output and "1 thread)" in r.output  # a 1 MB model runs on one thread by default
    assert "% of decode time" in r.output
    assert "FFN neurons computed: 100.0% of n_ff" in r.output
    assert "MB per token" in r.output


def test_default_threads_one_for_small_models_all_cores_for_big(all_active_file, monkeypatch):
    from powerinfer.runtime import loading

    model = Transformer(open_gguf(all_active_file), torch.float32)
    assert loading.default_threads(model) == 1
    monkeypatch.setattr(loading, "SMALL_MODEL_BYTES", 0)
    assert loading.default_threads(model) == torch.get_num_threads()


def test_a_cpu_without_avx2_is_told_once_that_the_kernels_run_scalar(capsys, monkeypatch):
    from powerinfer import hardware

    assert hardware.missing_simd({"sse2", "avx", "fma"}, "x86_64") == ["avx2", "f16c"]
    assert hardware.missing_simd({"avx2", "fma", "f16c", "sse2"}, "x86_64") == []
    assert hardware.missing_simd({"asimd", "fp"}, "aarch64") == []  # no x86 vector path to miss
    assert hardware.missing_simd(set(), "x86_64") == []  # flags unreadable: nothing to say
    import shutil

    saved = kernels.backend()
    # build the kernels here whatever ran before (alone, or with POWERINFER_KERNELS=torch, nothing had
    # built them and the test skipped); only a machine without a compiler has nothing to warn about
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: no kernels to warn about")
    kernels.set_backend("c")
    monkeypatch.setattr(hardware, "missing_simd", lambda: ["avx2"])
    monkeypatch.setitem(kernels._state, "simd_noted", False)
    try:
        kernels.set_backend("auto")
        kernels.set_backend("auto")
    finally:
        kernels.set_backend(saved)
    assert capsys.readouterr().err.count("no AVX2: the C kernels run their portable scalar code") == 1

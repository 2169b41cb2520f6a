"""Hybrid GPU/CPU FFN split: identical output for any placement (the 'GPU' side runs on the CPU here)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.runtime.generate import SamplerSettings, generate
from powerinfer.runtime.hybrid import place_ffns
from powerinfer.runtime.model import Transformer


@pytest.fixture(scope="module")
def sparse_file(tmp_path_factory, relu_hf):
    tmp = tmp_path_factory.mktemp("hyb")
    cfg = json.loads((relu_hf / "config.json").read_text())
    L, D, n_ff = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(3)
    # random predictors: about half the neurons predicted active, a different set per token
    preds = [LayerPredictor(torch.randn(16, D, generator=g), torch.randn(n_ff, 16, generator=g)) for _ in range(L)]
    save_predictor_dir(tmp / "pred", preds, {"sparse_threshold": 0.0})
    return convert(relu_hf, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f32", progress=False), L, n_ff


def _masks(kind, L, n_ff):
    rng = np.random.default_rng(0)
    if kind == "none":
        return [np.zeros(n_ff, bool) for _ in range(L)]
    if kind == "all":
        return [np.ones(n_ff, bool) for _ in range(L)]
    if kind == "partial":
        return [rng.random(n_ff) < 0.5 for _ in range(L)]
    # mixed: some layers all-CPU, some all-GPU, some split
    return [np.zeros(n_ff, bool), np.ones(n_ff, bool)] + [rng.random(n_ff) < 0.3 for _ in range(L - 2)]


def _run(path, masks, prompt, n):
    m = Transformer(open_gguf(path))
    if masks is not None:
        place_ffns(m, masks, "cpu")
    with torch.inference_mode():
        logits = m.forward(torch.tensor(prompt), 0, all_logits=True)
    m2 = Transformer(open_gguf(path))
    if masks is not None:
        place_ffns(m2, masks, "cpu")
    st = generate(m2, prompt, n, SamplerSettings(temp=0.0))
    return logits, st.token_ids, m2.active_share()


@pytest.mark.parametrize("prompt", [[1], [1, 403, 407, 261, 378, 432, 383, 286]], ids=["one-token", "multi-token"])
@pytest.mark.parametrize("kind", ["none", "partial", "mixed", "all"])
def test_split_gives_identical_tokens_and_logits(sparse_file, kind, prompt):
    path, L, n_ff = sparse_file
    ref_logits, ref_tokens, ref_share = _run(path, None, prompt, 24)
    logits, tokens, share = _run(path, _masks(kind, L, n_ff), prompt, 24)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert share == pytest.approx(ref_share)
    assert 0.2 < share < 0.8  # the predictor really skipped neurons


def test_oracle_masks_work_through_the_split(sparse_file, relu_hf):
    path, L, n_ff = sparse_file
    a = Transformer(open_gguf(path))
    a.oracle_masks()
    b = Transformer(open_gguf(path))
    place_ffns(b, _masks("partial", L, n_ff), "cpu")
    b.oracle_masks()
    ids = torch.tensor([1, 403, 407, 261, 378, 432])
    with torch.inference_mode():
        assert (a.forward(ids, 0, True) - b.forward(ids, 0, True)).abs().max().item() <= 1e-4


def test_mask_of_the_wrong_length_is_refused(sparse_file):
    path, L, n_ff = sparse_file
    with pytest.raises(ValueError, match="neurons"):
        place_ffns(Transformer(open_gguf(path)), [np.zeros(n_ff + 1, bool)] * L, "cpu")


def test_offload_builds_index_and_splits(sparse_file, tmp_path):
    """A budget for about one layer's neurons: some neurons on each side, the same output as the CPU run."""
    import shutil

    from powerinfer.convert.gpu_index import GIB, dense_vram_bytes
    from powerinfer.convert.placement import neuron_bytes
    from powerinfer.formats.activation import save_activation_dir
    from powerinfer.runtime.hybrid import HybridFFN, offload
    path, L, n_ff = sparse_file
    p = tmp_path / path.name
    shutil.copy(path, p)
    # later layers hotter, and within a layer the higher index, so the solver has one clear order
    save_activation_dir(tmp_path / "activation", [torch.arange(n_ff, dtype=torch.int64) * (i + 1) for i in range(L)])
    m = Transformer(open_gguf(p))
    g = open_gguf(p)
    budget = (dense_vram_bytes(g, m.n_ctx) + n_ff * neuron_bytes(g.require("llama.embedding_length"), "f32", True)) / GIB
    msg = offload(m, p, budget, device="cpu")
    assert "built" in msg and all(isinstance(l.ffn, HybridFFN) for l in m.layers)
    n_gpu = [l.ffn.gpu_ids.numel() for l in m.layers]
    assert 0 < sum(n_gpu) <= n_ff < L * n_ff, n_gpu  # both sides hold neurons ...
    assert any(0 < k < n_ff for k in n_gpu), n_gpu  # ... and at least one layer is itself split
    for l in m.layers:  # the GPU side holds the hottest neurons of its layer (here: the top indices)
        assert torch.equal(l.ffn.gpu_ids, torch.arange(n_ff - l.ffn.gpu_ids.numel(), n_ff))
    prompt = [1, 403, 407, 261, 378, 432, 383, 286]
    ref_logits, ref_tokens, ref_share = _run(p, None, prompt, 24)
    with torch.inference_mode():
        logits = m.forward(torch.tensor(prompt), 0, all_logits=True)
    m2 = Transformer(open_gguf(p))
    assert "reused" in offload(m2, p, budget, device="cpu")
    assert [l.ffn.gpu_ids.numel() for l in m2.layers] == n_gpu
    tokens = generate(m2, prompt, 24, SamplerSettings(temp=0.0)).token_ids
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert tokens == ref_tokens and m2.active_share() == pytest.approx(ref_share)


def test_pi_run_without_cuda_warns_and_runs_on_cpu(sparse_file, caplog, monkeypatch):
    monkeypatch.delenv("POWERINFER_OFFLOAD_DEVICE", raising=False)
    from click.testing import CliRunner

    from powerinfer.runtime.cli import main
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    path, *_ = sparse_file
    r = CliRunner().invoke(main, ["-m", str(path), "-n", "4", "--temp", "0", "--vram-budget", "1"])
    assert r.exit_code == 0, r.output
    assert "no CUDA device" in caplog.text


def test_split_ffn_time_is_counted_for_bench(sparse_file):
    path, L, n_ff = sparse_file
    m = Transformer(open_gguf(path))
    place_ffns(m, _masks("partial", L, n_ff), "cpu")
    generate(m, [1, 403], 4, SamplerSettings(temp=0.0))
    assert all(l.ffn.t_ffn > l.ffn.t_predict > 0 for l in m.layers)


# --------------------------------------------------------------------------- whole-layer placement
# The device side runs on the CPU here (device="cpu"): same code path as CUDA, weights shared,
# so every placement must reproduce the all-CPU run. test_cuda_* run only where CUDA is present
# (benchmarks/gpu_check.py runs them on a GPU machine).
from family_models import BUILDERS  # noqa: E402

from powerinfer.runtime.hybrid import (HybridFFN, place_model,  # noqa: E402
                                       plan_dense, offload)
from powerinfer.runtime.weights import weight_nbytes  # noqa: E402

FAM_PROMPT = [1, 5, 9, 14, 3, 7, 11, 2, 6, 10, 4, 8]  # longer than Bamboo's sliding window (8)


@pytest.fixture(scope="module", params=list(BUILDERS))
def fam_file(request, tmp_path_factory):
    """One family's tiny model as an f32 PWRI file with random predictors, and an activation folder."""
    from powerinfer.families import hf_dims
    from powerinfer.formats.activation import save_activation_dir
    from powerinfer.hf import resolve_model

    tmp = tmp_path_factory.mktemp(request.param)
    d = BUILDERS[request.param](tmp / "hf")
    _, cfg, _ = resolve_model(d)
    dims = hf_dims(cfg)
    g = torch.Generator().manual_seed(11)
    L = dims["n_layer"]
    preds = [LayerPredictor(torch.randn(16, dims["n_embd"], generator=g), torch.randn(dims["n_ff"], 16, generator=g))
             for _ in range(L)]
    save_predictor_dir(tmp / "pred", preds, {"sparse_threshold": 0.0})
    path = convert(d, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f32", progress=False)
    save_activation_dir(tmp / "activation", [torch.randint(0, 1000, (dims["n_ff"],), generator=g) for _ in range(L)])
    return path


def _teacher_forced(m, ids, n_prefill=8):
    with torch.inference_mode():
        out = [m.forward(torch.tensor(ids[:n_prefill]), 0, all_logits=True)]
        for pos in range(n_prefill, len(ids)):
            out.append(m.forward(torch.tensor([ids[pos]]), pos)[None])
    return torch.cat(out)


def _budget(path, n_ctx, kind):
    """Budgets in bytes: nothing, one layer's dense part, every dense part + half the neurons, everything."""
    from powerinfer.convert.gpu_index import dense_vram_bytes
    g = open_gguf(path)
    p = plan_dense(g, n_ctx, 0, cuda=False)
    n_ff = int(g.require(f"{g.arch}.feed_forward_length"))
    all_neurons = len(p.layer_bytes) * n_ff * p.neuron_bytes
    dense = dense_vram_bytes(g, n_ctx)
    return {"0%": 0, "one-layer": p.layer_bytes[0] + 1, "dense+half": dense + all_neurons // 2,
            "100%": dense + all_neurons}[kind]


@pytest.mark.parametrize("kind", ["0%", "one-layer", "dense+half", "100%"])
def test_every_family_every_budget_equals_the_cpu_run(fam_file, kind, monkeypatch, tmp_path):
    """Tokens and logits (prefill + decode) of the offloaded model equal the all-CPU run."""
    import shutil

    from powerinfer.convert.gpu_index import GIB
    p = tmp_path / fam_file.name
    shutil.copy(fam_file, p)
    shutil.copytree(fam_file.parent / "activation", tmp_path / "activation")
    ref = Transformer(open_gguf(p))
    ref_logits = _teacher_forced(ref, FAM_PROMPT)
    ref_tokens = generate(Transformer(open_gguf(p)), FAM_PROMPT[:8], 12, SamplerSettings(temp=0.0)).token_ids

    def placed():
        m = Transformer(open_gguf(p))
        msg = offload(m, p, _budget(p, m.n_ctx, kind) / GIB, device="cpu")
        return m, msg

    m, msg = placed()
    L, pl = len(m.layers), m.placement
    n_dev = sum(l.on_device for l in m.layers)
    want_layers = {"0%": 0, "one-layer": 1, "dense+half": L, "100%": L}[kind]
    assert n_dev == want_layers == pl.n_layers, msg
    assert m.cache.k.shape[0] == L - n_dev  # the CPU KV block holds only the CPU layers
    share = pl.n_gpu_neurons / pl.n_neurons
    if kind == "dense+half":  # whole chunks of hot neurons up to half of them (a tiny layer is one chunk)
        assert 0 < share <= 0.5
    else:
        assert share == {"0%": 0, "one-layer": 0, "100%": 1}[kind]
    assert m.head_on_device == (kind in ("dense+half", "100%") and m.output is not m.tok_embd)
    logits = _teacher_forced(m, FAM_PROMPT)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    m2, _ = placed()
    assert generate(m2, FAM_PROMPT[:8], 12, SamplerSettings(temp=0.0)).token_ids == ref_tokens


def test_device_layers_keep_their_kv_cache_on_the_device_side(sparse_file):
    path, L, n_ff = sparse_file
    ref = Transformer(open_gguf(path))
    m = Transformer(open_gguf(path))
    place_model(m, 2, False, None, "cpu")
    assert m.cache.k.shape[0] == L - 2 and m.cache.v.shape[0] == L - 2
    for i in range(L):
        k, v = m.cache.layer(i)
        assert k.shape == ref.cache.k[i].shape
        shares = k.untyped_storage().data_ptr() == m.cache.k.untyped_storage().data_ptr()
        assert shares == (i >= 2)  # device layers own separate tensors, CPU layers are rows of the block
    ids = [1, 403, 407, 261, 378, 432]
    _teacher_forced(ref, ids, 4)
    _teacher_forced(m, ids, 4)
    for i in range(L):  # every layer's cache, wherever it lives, holds what the CPU run wrote
        k, v = m.cache.layer(i)
        assert k[:len(ids)].abs().sum() > 0
        torch.testing.assert_close(k[:len(ids)], ref.cache.k[i, :len(ids)], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:len(ids)], ref.cache.v[i, :len(ids)], atol=1e-5, rtol=0)
        assert k[len(ids):].abs().sum() == 0


def test_plan_spends_the_budget_layer_by_layer_then_output_then_neurons(sparse_file):
    from powerinfer.convert.gpu_index import dense_vram_bytes
    path, L, n_ff = sparse_file
    g = open_gguf(path)
    n_ctx = Transformer(g).n_ctx
    p0 = plan_dense(g, n_ctx, 0, cuda=False)
    assert sum(p0.layer_bytes) + p0.head_bytes == dense_vram_bytes(g, n_ctx)  # the GPU index's dense size
    n_embd = g.require("llama.embedding_length")
    n_kv = g.require("llama.attention.head_count_kv")
    kv = 2 * n_ctx * n_kv * (n_embd // g.require("llama.attention.head_count")) * 2
    rows = {f"blk.1.{n}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down_t")}  # the neurons' rows
    names = [t for t in g.tensors if t.startswith("blk.1.") and t not in rows]
    assert {"blk.1.ffn_norm.weight", "blk.1.fc1.weight", "blk.1.attn_q.weight"} <= set(names)
    assert p0.layer_bytes[1] == kv + sum(int(g.tensors[t].n_bytes) for t in names)
    for k in range(L + 1):
        edge = sum(p0.layer_bytes[:k])
        assert plan_dense(g, n_ctx, edge, False).n_layers == k
        if k:
            assert plan_dense(g, n_ctx, edge - 1, False).n_layers == k - 1
    full = sum(p0.layer_bytes)
    assert not plan_dense(g, n_ctx, full + p0.head_bytes - 1, False).head
    p = plan_dense(g, n_ctx, full + p0.head_bytes + 10 * p0.neuron_bytes + 3, False)
    assert p.head and p.ffn_budget == 10 * p0.neuron_bytes + 3 and p.n_neurons == 10
    assert plan_dense(g, n_ctx, full - 1, False).ffn_budget == 0  # no neuron before every dense part


def test_cold_neurons_run_in_the_worker_and_none_when_all_fit(sparse_file, monkeypatch):
    import threading
    path, L, n_ff = sparse_file
    seen = []
    orig = HybridFFN._cold

    def spy(self, *a):
        seen.append(threading.current_thread().name)
        return orig(self, *a)

    monkeypatch.setattr(HybridFFN, "_cold", spy)
    m = Transformer(open_gguf(path))
    place_model(m, L, True, _masks("partial", L, n_ff), "cpu")
    generate(m, [1, 403], 3, SamplerSettings(temp=0.0))
    assert seen and all(n.startswith("powerinfer-cold") for n in seen)  # overlapped with the hot part
    seen.clear()
    m = Transformer(open_gguf(path))
    pl = place_model(m, L, True, _masks("all", L, n_ff), "cpu")
    generate(m, [1, 403], 3, SamplerSettings(temp=0.0))
    assert seen == [] and pl.worker is None and all(l.ffn.cpu is None for l in m.layers)  # no CPU FFN work


def _weight_bytes(m):
    """Every weight byte of an unplaced model, counted from its own tensors."""
    n = weight_nbytes(m.tok_embd) + weight_nbytes(m.pos_embd) + weight_nbytes(m.output_norm.w) + weight_nbytes(m.output_norm.b)
    n += 0 if m.output is m.tok_embd else weight_nbytes(m.output)
    for l in m.layers:
        norms = [l.attn_norm] + ([] if l.ffn_norm is l.attn_norm else [l.ffn_norm])
        n += sum(weight_nbytes(x.w) + weight_nbytes(x.b) for x in norms)
        n += sum(weight_nbytes(getattr(l, k)) for k in ("wqkv", "bqkv", "wo", "bo"))
        n += sum(weight_nbytes(getattr(l.ffn, k)) for k in ("gate", "up", "down_t", "gate_b", "up_b", "down_b", "fc1", "fc2"))
    return n


@pytest.mark.parametrize("kind", ["none", "partial", "all"])
def test_placed_bytes_add_up_to_the_model(sparse_file, kind):
    path, L, n_ff = sparse_file
    total = _weight_bytes(Transformer(open_gguf(path)))
    m = Transformer(open_gguf(path))
    kv_all = weight_nbytes(m.cache.k) + weight_nbytes(m.cache.v)
    n_layers = {"none": 0, "partial": 3, "all": L}[kind]
    pl = place_model(m, n_layers, kind == "all", _masks(kind, L, n_ff) if kind != "partial" else None, "cpu")
    assert pl.bytes["device"] + pl.bytes["cpu"] == pytest.approx(total)
    assert pl.kv_bytes["device"] == pytest.approx(kv_all * n_layers / L)
    assert pl.kv_bytes["cpu"] == pytest.approx(kv_all * (L - n_layers) / L)
    if kind == "all":  # only the token embedding stays on the CPU
        assert pl.bytes["cpu"] == weight_nbytes(m.tok_embd)


def test_pi_run_bench_prints_the_placement_per_device(sparse_file, tmp_path):
    import re
    import shutil

    from click.testing import CliRunner

    from powerinfer.formats.activation import save_activation_dir
    from powerinfer.runtime.cli import main
    path, L, n_ff = sparse_file
    p = tmp_path / path.name
    shutil.copy(path, p)
    save_activation_dir(tmp_path / "activation", [torch.arange(n_ff, dtype=torch.int64) for _ in range(L)])
    r = CliRunner().invoke(main, ["-m", str(p), "-n", "6", "--bench", "--vram-budget", "1", "--dtype", "f32"],
                           env={"POWERINFER_OFFLOAD_DEVICE": "cpu"})
    assert r.exit_code == 0, r.output
    m = Transformer(open_gguf(p), cache_type_k="f16", cache_type_v="f16")  # pi-run's default KV cache
    total = _weight_bytes(m)
    kv = weight_nbytes(m.cache.k) + weight_nbytes(m.cache.v)
    dev = re.search(r"placement: device side \(cpu, forced onto the CPU\): ([\d.]+) MB .*of (\d+)/(\d+) layers, "
                    r"output, ([\d.]+)% of FFN neurons", r.output)
    assert dev, r.output
    assert float(dev[1]) == pytest.approx((total - weight_nbytes(m.tok_embd) + kv) / 1e6, abs=0.051)
    assert (int(dev[2]), int(dev[3]), float(dev[4])) == (L, L, 100.0)
    cpu = re.search(r"CPU side: ([\d.]+) MB \(weights ([\d.]+) MB, KV cache ([\d.]+) MB\)", r.output)
    assert float(cpu[2]) == pytest.approx(weight_nbytes(m.tok_embd) / 1e6, abs=0.051) and float(cpu[3]) == 0
    busy = re.search(r"busy share of decode time: device side ([\d.]+)%, CPU side ([\d.]+)%", r.output)
    assert busy and 0 < float(busy[1]) <= 100 and float(busy[2]) <= 100


def test_offload_bad_input(sparse_file, monkeypatch):
    from powerinfer.errors import PowerInferError
    path, *_ = sparse_file
    m = Transformer(open_gguf(path))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(PowerInferError, match="--vram-budget"):
            offload(m, path, bad, device="cpu")
    with pytest.raises(PowerInferError, match="expected cpu or cuda"):
        offload(m, path, 1.0, device="tpu")
    monkeypatch.setenv("POWERINFER_OFFLOAD_DEVICE", "npu")
    with pytest.raises(PowerInferError, match="'npu'"):
        offload(m, path, 1.0)
    if not torch.cuda.is_available():
        with pytest.raises(PowerInferError, match="no CUDA device"):
            offload(m, path, 1.0, device="cuda")
    assert m.placement is None and not any(l.on_device for l in m.layers)  # nothing half-placed


def test_no_activation_folder_still_places_the_dense_parts(sparse_file, tmp_path, caplog):
    import shutil
    path, L, n_ff = sparse_file
    p = tmp_path / path.name
    shutil.copy(path, p)
    m = Transformer(open_gguf(p))
    msg = offload(m, p, 1.0, device="cpu")
    assert "no activation folder" in caplog.text and "no GPU index" in msg
    assert all(l.on_device for l in m.layers) and m.placement.n_gpu_neurons == 0


# --------------------------------------------------------------------------- CUDA (gpu_check.py)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("kind", ["0%", "one-layer", "dense+half", "100%"])
def test_cuda_offload_matches_the_cpu_run(fam_file, kind, tmp_path):
    """f16 on the GPU against f32 on the CPU: logits close, and what was placed is on the GPU."""
    import shutil

    from powerinfer.convert.gpu_index import GIB
    p = tmp_path / fam_file.name
    shutil.copy(fam_file, p)
    shutil.copytree(fam_file.parent / "activation", tmp_path / "activation")
    ref = _teacher_forced(Transformer(open_gguf(p)), FAM_PROMPT)
    m = Transformer(open_gguf(p))
    offload(m, p, _budget(p, m.n_ctx, kind) / GIB, device="cuda")
    for i, l in enumerate(m.layers):
        want = "cuda" if l.on_device else "cpu"
        assert l.wo.device.type == want and m.cache.layer(i)[0].device.type == want
    logits = _teacher_forced(m, FAM_PROMPT)
    assert (logits - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


@cuda
def test_cuda_budget_above_free_memory_is_clamped(sparse_file, caplog):
    path, L, n_ff = sparse_file
    m = Transformer(open_gguf(path))
    offload(m, path, 1e6, device="cuda")
    assert "more than the" in caplog.text and "using" in caplog.text
    assert all(l.on_device for l in m.layers)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_file_keeps_quantized_kernels_and_equals_the_cpu_run(sparse_file, tmp_path, qtype):
    from powerinfer.convert.quantize import quantize_file
    from powerinfer.quant.qweight import QWeight
    from powerinfer.runtime import kernels
    if kernels.backend() != "c":
        pytest.skip("quantized weights stay quantized with the C kernels only")
    path, L, n_ff = sparse_file
    q = quantize_file(path, tmp_path / f"m-{qtype}.powerinfer.gguf", qtype).path
    prompt = [1, 403, 407, 261, 378, 432, 383, 286]
    ref_logits, ref_tokens, _ = _run(q, None, prompt, 16)
    m = Transformer(open_gguf(q))
    place_model(m, 3, False, _masks("partial", L, n_ff), "cpu")
    assert all(isinstance(l.ffn.cpu.up, QWeight) and isinstance(l.ffn.gpu.up, QWeight) for l in m.layers)
    assert (_teacher_forced(m, prompt, 8) - ref_logits).abs().max().item() <= 1e-4
    m2 = Transformer(open_gguf(q))
    place_model(m2, 3, False, _masks("partial", L, n_ff), "cpu")
    assert generate(m2, prompt, 16, SamplerSettings(temp=0.0)).token_ids == ref_tokens

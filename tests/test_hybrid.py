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


def test_pi_run_without_cuda_warns_and_runs_on_cpu(sparse_file, caplog):
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

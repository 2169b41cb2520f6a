"""pi-convert/pi-run's GPU index: budget accounting, reuse and invalidation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from powerinfer.convert.gpu_index import GIB, dense_vram_bytes, ensure_gpu_index
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.activation import save_activation_dir
from powerinfer.formats.gguf_file import open_gguf


@pytest.fixture()
def model_with_activation(relu_hf, tmp_path):
    cfg = json.loads((relu_hf / "config.json").read_text())
    L, n_ff = cfg["num_hidden_layers"], cfg["intermediate_size"]
    out = convert(relu_hf, tmp_path / "m.gguf", outtype="f16", progress=False)
    save_activation_dir(tmp_path / "activation", list(_distinct_counts(L, n_ff, seed=0)))
    return out, L, n_ff


def _distinct_counts(L, n_ff, seed):
    """Per-layer counts ``[L, n_ff]``, all distinct across the model: the hottest k neurons are one set."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(L * n_ff, generator=g).view(L, n_ff).to(torch.int64)


def _hottest(counts, k):
    """Masks of the k globally hottest neurons, computed directly from the counts."""
    flat = counts.reshape(-1)
    cut = flat.sort(descending=True).values[k - 1]
    return [(row >= cut).numpy() for row in counts]


def test_dense_bytes_counts_everything_but_embedding_and_ffn_rows(model_with_activation):
    path, L, n_ff = model_with_activation
    g = open_gguf(path)
    D, n_ctx = 64, 512
    attn = L * (D * D + 2 * 32 * D + D * D) * 2  # q, k, v (GQA 8/4), o in f16
    norms = (2 * L + 1) * D * 4
    output = 512 * D * 2
    kv = 2 * L * n_ctx * 32 * 2
    assert dense_vram_bytes(g, n_ctx) == attn + norms + output + kv


def test_budget_fills_ffn_with_the_hottest_neurons_and_is_reused(model_with_activation):
    path, L, n_ff = model_with_activation
    dense = dense_vram_bytes(open_gguf(path), 512)
    per_neuron = 64 * 2 * 3
    budget_gib = (dense + 100 * per_neuron) / GIB
    counts = _distinct_counts(L, n_ff, seed=0)
    plan = ensure_gpu_index(path, budget_gib, chunk=1)
    assert not plan.reused and plan.path.exists()
    # exactly the bytes that fit (no fudge factor), and exactly the 100 hottest neurons of the model
    assert sum(int(m.sum()) for m in plan.gpu) == 100
    assert all(np.array_equal(a, b) for a, b in zip(plan.gpu, _hottest(counts, 100)))
    again = ensure_gpu_index(path, budget_gib, chunk=1)
    assert again.reused and all(np.array_equal(a, b) for a, b in zip(plan.gpu, again.gpu))
    # a budget change invalidates the cached index
    bigger = ensure_gpu_index(path, (dense + 200 * per_neuron) / GIB, chunk=1)
    assert not bigger.reused
    assert all(np.array_equal(a, b) for a, b in zip(bigger.gpu, _hottest(counts, 200)))


def test_index_is_rebuilt_after_a_re_profile(model_with_activation, caplog):
    """New activation counts (same model, same budget) must not reuse the placement of the old ones."""
    path, L, n_ff = model_with_activation
    budget_gib = (dense_vram_bytes(open_gguf(path), 512) + 100 * 64 * 2 * 3) / GIB
    old = ensure_gpu_index(path, budget_gib, chunk=1)
    assert all(np.array_equal(a, b) for a, b in zip(old.gpu, _hottest(_distinct_counts(L, n_ff, 0), 100)))
    new_counts = _distinct_counts(L, n_ff, seed=1)
    save_activation_dir(path.parent / "activation", list(new_counts))  # pi-profile again
    new = ensure_gpu_index(path, budget_gib, chunk=1)
    assert not new.reused and "other activation counts" in caplog.text
    assert all(np.array_equal(a, b) for a, b in zip(new.gpu, _hottest(new_counts, 100)))
    assert ensure_gpu_index(path, budget_gib, chunk=1).reused  # and that one is reused while it holds
    # other solver settings on the same counts are other inputs too
    assert not ensure_gpu_index(path, budget_gib, chunk=2).reused


def test_index_is_reused_when_the_activation_folder_is_gone(model_with_activation):
    import shutil

    path, L, n_ff = model_with_activation
    plan = ensure_gpu_index(path, 1.0)
    shutil.rmtree(path.parent / "activation")
    again = ensure_gpu_index(path, 1.0)
    assert again.reused and all(np.array_equal(a, b) for a, b in zip(plan.gpu, again.gpu))


def test_index_of_another_model_is_rebuilt(model_with_activation, relu_hf, tmp_path):
    path, L, n_ff = model_with_activation
    plan = ensure_gpu_index(path, 1.0)
    convert(relu_hf, path, outtype="f32", progress=False)  # same name, other file
    again = ensure_gpu_index(path, 1.0)
    assert not again.reused
    assert all(m.all() for m in plan.gpu) and all(m.all() for m in again.gpu)  # 1 GiB holds it all


def test_budget_too_small_for_dense_tensors_is_an_error(model_with_activation):
    path, *_ = model_with_activation
    with pytest.raises(PowerInferError, match="cannot be met"):
        ensure_gpu_index(path, 1e-6)
    with pytest.raises(PowerInferError, match=">= 0"):
        ensure_gpu_index(path, -1.0)


def test_missing_activation_folder_warns_and_places_nothing(relu_hf, tmp_path, caplog):
    path = convert(relu_hf, tmp_path / "m.gguf", progress=False)
    assert ensure_gpu_index(path, 1.0) is None
    assert "no activation folder" in caplog.text

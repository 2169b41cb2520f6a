"""A sparse prompt runs each token's predicted-active rows (the decode kernels) when few neurons
are active, and every row for all tokens at once when many are: both give the same FFN output,
for every weight type and both kernel backends, and the model picks rows below
:data:`powerinfer.runtime.ffn.ROWS_MAX_SHARE`."""
from __future__ import annotations

import pytest
import torch

from helpers import all_active_predictors, make_tiny_llama
from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import ffn as ffn_mod
from powerinfer.runtime.model import Transformer

N_EMBD, N_FF, T = 64, 256, 9


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    hf = make_tiny_llama(tmp / "hf", n_layer=1, n_embd=N_EMBD, n_ff=N_FF, n_head=4, n_head_kv=4)
    pred = all_active_predictors(tmp / "pred", N_EMBD, N_FF, 1)
    return {t: convert(hf, tmp / f"m.{t}.powerinfer.gguf", pred, outtype=t, progress=False)
            for t in ("f32", "f16", "q4_0", "q8_0")}


def _mask(share: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(share * 100))
    return torch.rand(T, N_FF, generator=g) < share


@pytest.mark.parametrize("kind", ["f32", "f16", "q4_0", "q8_0"])
@pytest.mark.parametrize("share", [0.1, 0.6])
def test_rows_per_token_equal_all_rows_masked(backend, files, kind, share):
    ffn = Transformer(open_gguf(files[kind]), torch.float32).layers[0].ffn
    x = torch.randn(T, N_EMBD, generator=torch.Generator().manual_seed(1))
    mask = _mask(share)
    ffn.rows_max_share = 1.0
    rows = ffn(x, x, mask)
    ffn.rows_max_share = 0.0
    dense = ffn(x, x, mask)
    assert rows.shape == dense.shape == (T, N_EMBD)
    assert (rows - dense).abs().max().item() <= 1e-4 * max(1.0, dense.abs().max().item())
    assert ffn.n_active == 2 * int(mask.sum()) and ffn.n_calls == 2 * T


def test_the_rows_path_is_taken_below_the_share_and_not_above(files, monkeypatch):
    ffn = Transformer(open_gguf(files["q4_0"]), torch.float32).layers[0].ffn
    calls = []
    monkeypatch.setattr(type(ffn), "rows", lambda self, x, idx: calls.append(idx.numel()) or torch.zeros(N_EMBD))
    x = torch.randn(T, N_EMBD)
    low, high = _mask(ffn_mod.ROWS_MAX_SHARE / 3), _mask(min(1.0, ffn_mod.ROWS_MAX_SHARE * 2.5))
    ffn(x, x, low)
    assert calls == low.sum(1).tolist()  # one call per token, with that token's active neurons
    calls.clear()
    ffn(x, x, high)
    assert calls == []

"""pi-run's model against transformers and against the llama2.c reference output."""
from __future__ import annotations

import json

import pytest
import torch

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import load_hf_model, load_hf_tokenizer
from powerinfer.runtime.generate import SamplerSettings, generate
from powerinfer.runtime.model import Transformer

from helpers import STORIES, all_active_predictors, story_text, teacher_forced

GREEDY = SamplerSettings(temp=0.0)


def test_real_stories260k_dense_reproduces_reference_greedy_ids(stories_hf, tmp_path):
    ref = json.loads((STORIES / "greedy_t0_256.ids.json").read_text())
    out = convert(stories_hf, tmp_path / "s.gguf", outtype="f32", progress=False)
    model = Transformer(open_gguf(out))
    st = generate(model, ref["prompt_ids"], len(ref["generated_ids"]), GREEDY)
    assert st.token_ids == ref["generated_ids"]


def _prompt_ids(model_dir, n_min=32):
    ids = load_hf_tokenizer(model_dir)(story_text(600)).input_ids
    assert len(ids) >= n_min
    return ids


@pytest.mark.parametrize("which", ["stories_hf", "relu_hf"])
def test_dense_logits_equal_transformers_prefill_and_decode(which, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    ids = _prompt_ids(model_dir)
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    model = Transformer(open_gguf(convert(model_dir, tmp_path / "m.gguf", outtype="f32", progress=False)))
    n_prefill = 32
    with torch.inference_mode():
        got = model.forward(torch.tensor(ids[:n_prefill]), 0, all_logits=True)
        assert (got - ref[:n_prefill]).abs().max().item() <= 1e-4
        # decode steps through the KV cache, one token at a time
        for pos in range(n_prefill, min(len(ids), n_prefill + 12)):
            step = model.forward(torch.tensor([ids[pos]]), pos)
            assert (step - ref[pos]).abs().max().item() <= 1e-4, f"decode step at position {pos}"


@pytest.fixture()
def relu_sparse_files(relu_hf, tmp_path):
    cfg = json.loads((relu_hf / "config.json").read_text())
    n_embd, n_ff, n_layer = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    pred_all = all_active_predictors(tmp_path / "pred_all", n_embd, n_ff, n_layer)
    sparse = convert(relu_hf, tmp_path / "m.powerinfer.gguf", pred_all, outtype="f32", progress=False)
    dense = convert(relu_hf, tmp_path / "m.gguf", outtype="f32", progress=False)
    return dense, sparse


def test_sparse_with_oracle_masks_equals_dense(relu_hf, relu_sparse_files):
    dense_path, sparse_path = relu_sparse_files
    ids = _prompt_ids(relu_hf)[:48]
    dense = teacher_forced(Transformer(open_gguf(dense_path)), ids, 32)
    sparse_model = Transformer(open_gguf(sparse_path))
    sparse_model.oracle_masks()
    sparse = teacher_forced(sparse_model, ids, 32)
    assert (sparse - dense).abs().max().item() <= 1e-4
    # the oracle really skipped neurons: the raw ReLU model is about half sparse
    assert sparse_model.active_share() < 0.7


def test_sparse_with_every_neuron_predicted_equals_dense(relu_hf, relu_sparse_files):
    dense_path, sparse_path = relu_sparse_files
    ids = _prompt_ids(relu_hf)[:40]
    dense = teacher_forced(Transformer(open_gguf(dense_path)), ids, 8)
    m = Transformer(open_gguf(sparse_path))
    sparse = teacher_forced(m, ids, 8)
    assert m.active_share() == 1.0
    assert (sparse - dense).abs().max().item() <= 1e-4


def test_dense_flag_on_pwri_file_matches_dense_file(relu_hf, relu_sparse_files):
    dense_path, sparse_path = relu_sparse_files
    ids = _prompt_ids(relu_hf)[:20]
    a = teacher_forced(Transformer(open_gguf(dense_path)), ids, 10)
    m = Transformer(open_gguf(sparse_path), dense=True)
    b = teacher_forced(m, ids, 10)
    assert m.active_share() is None
    assert (a - b).abs().max().item() <= 1e-4

"""Numbers the rest of the suite leaves at their defaults: a RoPE base other than 10000, a
predictor threshold other than 0, f16 files' values in every family, a prompt evaluated in
chunks (prefill at a position above 0), and the streamed text of a sampled pi-run.

References are transformers' own models, a predictor mask built here from the predictor's
matrices, and values rounded here from the f32 file.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import load_hf_model, load_hf_tokenizer
from powerinfer.runtime.model import Transformer

from family_models import BUILDERS
from helpers import make_tiny_llama, need, random_predictors, story_text, teacher_forced


def _ids(model_dir, n):
    ids = load_hf_tokenizer(model_dir)(story_text(800)).input_ids[:n]
    assert len(ids) == n
    return ids


# ---------------------------------------------------------------------------- RoPE base
def test_rope_freq_base_other_than_10000_matches_transformers(tmp_path):
    """Llama-3-style base 500000: the file says so and pi-run's logits are transformers' (40
    positions, where a base of 10000 gives other numbers)."""
    d = make_tiny_llama(tmp_path / "hf", rope_theta=500000.0)
    ids = _ids(d, 40)
    with torch.no_grad():
        ref = load_hf_model(d)(torch.tensor([ids])).logits[0]
    path = convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)
    g = open_gguf(path)
    assert g.get("llama.rope.freq_base") == pytest.approx(500000.0)
    got = teacher_forced(Transformer(g), ids, 24)
    assert (got - ref).abs().max().item() <= 1e-4
    # the base is really used: the same weights with the default base disagree
    d2 = make_tiny_llama(tmp_path / "hf2")
    with torch.no_grad():
        ref_default = load_hf_model(d2)(torch.tensor([ids])).logits[0]
    assert (ref_default - ref).abs().max().item() > 1e-2


# ---------------------------------------------------------------------------- predictor threshold
def _masked_reference(hf, layers, ids, threshold):
    """transformers' logits with each FFN restricted to the neurons the predictor marks active:
    ``fc2 relu(fc1 x) >= threshold``, ``x`` the input of the FFN's norm (the residual stream)."""
    handles, pred_in = [], {}
    for i, layer in enumerate(hf.model.layers):
        def grab(mod, args, i=i):
            pred_in[i] = args[0]

        def masked(mod, args, out, i=i):
            h = args[0]
            mask = (torch.relu(pred_in[i] @ layers[i].fc1.T) @ layers[i].fc2.T) >= threshold
            return mod.down_proj(torch.relu(mod.gate_proj(h)) * mod.up_proj(h) * mask)

        handles += [layer.post_attention_layernorm.register_forward_pre_hook(grab),
                    layer.mlp.register_forward_hook(masked)]
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        for h in handles:
            h.remove()


def test_predictor_threshold_other_than_0_matches_a_hand_built_mask(tmp_path):
    d = make_tiny_llama(tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    layers = random_predictors(tmp_path / "pred", cfg["num_hidden_layers"], cfg["hidden_size"],
                               cfg["intermediate_size"])  # threshold 0.25 in its config.json
    path = convert(d, tmp_path / "m.powerinfer.gguf", tmp_path / "pred", outtype="f32", progress=False)
    g = open_gguf(path)
    assert g.get("powerinfer.sparse_threshold") == pytest.approx(0.25)
    ids = _ids(d, 32)
    hf = load_hf_model(d)
    ref = _masked_reference(hf, layers, ids, 0.25)
    m = Transformer(g)
    got = teacher_forced(m, ids, 20)
    assert (got - ref).abs().max().item() <= 1e-4
    assert 0.1 < m.active_share() < 0.9
    # the threshold matters here: at 0 the masks, and so the logits, differ
    assert (_masked_reference(hf, layers, ids, 0.0) - ref).abs().max().item() > 1e-2


# ---------------------------------------------------------------------------- f16 values per family
@pytest.mark.parametrize("name", list(BUILDERS))
def test_f16_file_holds_the_f32_values_rounded_to_f16(name, tmp_path):
    """Every 2-D tensor of the f16 PowerInfer file (weights and predictors) is the f32 file's
    tensor rounded to f16, bit for bit; 1-D tensors are the same f32 values. (The f32 file's
    values are tied to transformers by the logits tests in test_families.py.)"""
    from family_models import N_LAYER
    from powerinfer.families import hf_dims
    from powerinfer.hf import resolve_model

    d = BUILDERS[name](tmp_path / "hf")
    dims = hf_dims(resolve_model(d)[1])
    random_predictors(tmp_path / "pred", N_LAYER, dims["n_embd"], dims["n_ff"])
    g32 = open_gguf(convert(d, tmp_path / "m32.powerinfer.gguf", tmp_path / "pred", outtype="f32", progress=False))
    g16 = open_gguf(convert(d, tmp_path / "m16.powerinfer.gguf", tmp_path / "pred", outtype="f16", progress=False))
    assert set(g16.tensors) == set(g32.tensors)
    n_f16 = 0
    for name_, t16 in g16.tensors.items():
        a32 = np.asarray(g32.tensors[name_].data)
        a16 = np.asarray(t16.data)
        assert a16.shape == a32.shape, name_
        if t16.tensor_type.name == "F16":
            n_f16 += 1
            assert a16.dtype == np.float16
            assert np.array_equal(a16.view(np.uint16), a32.astype(np.float16).view(np.uint16)), name_
        else:
            assert t16.tensor_type.name == "F32" and a32.ndim == 1, (name_, t16.tensor_type.name)
            assert np.array_equal(a16, a32), name_
    assert n_f16 >= 5 * N_LAYER  # attention, FFN and predictor matrices of every layer


# ---------------------------------------------------------------------------- prefill at pos > 0
@pytest.fixture(scope="module")
def chunk_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chunks")
    d = make_tiny_llama(tmp / "hf", n_layer=2)
    cfg = json.loads((d / "config.json").read_text())
    random_predictors(tmp / "pred", 2, cfg["hidden_size"], cfg["intermediate_size"])
    return (_ids(d, 40), convert(d, tmp / "m.gguf", outtype="f32", progress=False),
            convert(d, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f32", progress=False))


@pytest.mark.parametrize("which", [1, 2], ids=["dense", "sparse"])
def test_prompt_in_chunks_equals_one_prefill(chunk_files, which):
    """A prompt evaluated as chunks at positions 0, 7 and 23 (a reused prefix, a long prompt cut
    in batches) gives the logits of one prefill, and the cache then decodes the same."""
    ids, path = chunk_files[0], chunk_files[which]
    with torch.inference_mode():
        full = Transformer(open_gguf(path))
        ref = full.forward(torch.tensor(ids[:36]), 0, all_logits=True)
        ref_next = full.forward(torch.tensor([ids[36]]), 36)
        m = Transformer(open_gguf(path))
        parts = [m.forward(torch.tensor(ids[a:b]), a, all_logits=True) for a, b in ((0, 7), (7, 23), (23, 36))]
        got_next = m.forward(torch.tensor([ids[36]]), 36)
    got = torch.cat(parts)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4
    assert (got_next - ref_next).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------- pi-run's streamed text
def test_sampled_pi_run_prints_exactly_the_decoded_tokens_of_its_seed(tmp_path, stories_hf):
    """pi-run with --temp 0.8 --seed 5 prints the prompt and then exactly the text of the tokens
    the sampler draws with that seed (and the same text again on a second run)."""
    from powerinfer.runtime.cli import main as run_main
    from powerinfer.runtime.generate import SamplerSettings, generate
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    path = convert(stories_hf, tmp_path / "s.gguf", outtype="f32", progress=False)
    g = open_gguf(path)
    tok = GGUFTokenizer(g)
    ids = tok.encode("Lily saw a")
    model = Transformer(g, cache_type_k="f16", cache_type_v="f16")  # pi-run's default KV cache
    st = generate(model, ids, 20, SamplerSettings(temp=0.8, top_k=40, top_p=0.95, seed=5),
                  eos_id=tok.eos_id, stop_after_first=[tok.bos_id])
    # after BOS the decode keeps SentencePiece's dummy leading space, as llama.cpp's does; pi-run prints the
    # prompt as typed, then what the new tokens add
    text = tok.decode(ids + st.token_ids).removeprefix(" ")
    args = ["-m", str(path), "-t", "1", "-p", "Lily saw a", "-n", "20", "--temp", "0.8", "--top-k", "40",
            "--top-p", "0.95", "-s", "5", "--dtype", "f32"]
    outs = [CliRunner().invoke(run_main, args) for _ in range(2)]
    for r in outs:
        assert r.exit_code == 0, r.output
        assert r.stdout == text + "\n", (r.stdout, text)


def test_need_fails_rather_than_skips_for_a_missing_ci_input(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="is missing"):
        need(tmp_path / "not-there.txt")

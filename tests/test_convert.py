"""pi-convert's output against the file contract (FORMATS.md section 4) and its source weights."""
from __future__ import annotations

import json

import numpy as np
import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file

from powerinfer.convert.writer import convert, permute_rope
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf, read_magic

from helpers import make_tiny_llama, random_predictors


@pytest.fixture(scope="module")
def converted(tmp_path_factory, relu_hf):
    tmp = tmp_path_factory.mktemp("conv")
    cfg = json.loads((relu_hf / "config.json").read_text())
    preds = random_predictors(tmp / "pred", cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"])
    out = convert(relu_hf, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f16", progress=False)
    return relu_hf, cfg, preds, out


def test_magic_is_pwri_and_header_keys(converted):
    src, cfg, _, out = converted
    assert read_magic(out) == b"PWRI"
    g = open_gguf(out)
    assert g.sparse and g.arch == "llama"
    assert g.get("llama.context_length") == cfg["max_position_embeddings"]  # the real one, not 2048
    assert g.get("llama.block_count") == cfg["num_hidden_layers"]
    assert g.get("llama.feed_forward_length") == cfg["intermediate_size"]
    assert g.get("llama.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert g.get("powerinfer.sparse_threshold") == pytest.approx(0.25)
    assert g.get("powerinfer.activation") == "relu"


def test_exact_tensor_set_shapes_and_dtypes(converted):
    _, cfg, preds, out = converted
    L, D, Fd = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    kv = D // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    want = {"token_embd.weight": (512, D), "output_norm.weight": (D,), "output.weight": (512, D)}
    for i in range(L):
        H = preds[i].hidden
        want.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.attn_q.weight": (D, D),
                     f"blk.{i}.attn_k.weight": (kv, D), f"blk.{i}.attn_v.weight": (kv, D),
                     f"blk.{i}.attn_output.weight": (D, D), f"blk.{i}.ffn_norm.weight": (D,),
                     f"blk.{i}.ffn_gate.weight": (Fd, D), f"blk.{i}.ffn_up.weight": (Fd, D),
                     f"blk.{i}.ffn_down_t.weight": (Fd, D),
                     f"blk.{i}.fc1.weight": (H, D), f"blk.{i}.fc2.weight": (Fd, H)})
    g = open_gguf(out)
    got = {t.name: t for t in g.reader.tensors}
    assert set(got) == set(want) and len(got) == 3 + 11 * L
    for name, shape in want.items():
        t = got[name]
        assert tuple(int(x) for x in t.shape[::-1]) == shape, name  # GGUF ne is reversed torch order
        assert t.tensor_type.name == ("F16" if len(shape) == 2 else "F32"), name


def test_vocabulary_equals_the_tokenizer(converted):
    src, _, _, out = converted
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    g = open_gguf(out)
    assert g.get("tokenizer.ggml.model") == "llama"
    assert g.get("tokenizer.ggml.tokens") == [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    assert np.allclose(g.get("tokenizer.ggml.scores"), [sp.GetScore(i) for i in range(sp.vocab_size())])
    types = g.get("tokenizer.ggml.token_type")
    assert types[0] == 2 and types[1] == 3 and types[2] == 3  # <unk> UNKNOWN, <s> </s> CONTROL
    assert all(types[i] == 6 for i in range(3, 259))  # byte-fallback pieces <0x00>..<0xFF>
    assert (g.get("tokenizer.ggml.bos_token_id"), g.get("tokenizer.ggml.eos_token_id")) == (1, 2)


def test_weights_read_back_equal_the_source(converted):
    src, cfg, preds, out = converted
    sd = load_file(src / "model.safetensors")
    g = open_gguf(out).tensors

    def back(name):
        return torch.from_numpy(np.array(g[name].data)).float()

    def f16(t):
        return t.half().float()

    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert torch.equal(back(f"blk.{i}.attn_q.weight"), f16(permute_rope(sd[p + "self_attn.q_proj.weight"], H)))
        assert torch.equal(back(f"blk.{i}.attn_k.weight"), f16(permute_rope(sd[p + "self_attn.k_proj.weight"], Hkv)))
        assert torch.equal(back(f"blk.{i}.attn_v.weight"), f16(sd[p + "self_attn.v_proj.weight"]))
        assert torch.equal(back(f"blk.{i}.ffn_gate.weight"), f16(sd[p + "mlp.gate_proj.weight"]))
        assert torch.equal(back(f"blk.{i}.ffn_down_t.weight"), f16(sd[p + "mlp.down_proj.weight"].T))
        assert torch.equal(back(f"blk.{i}.ffn_norm.weight"), sd[p + "post_attention_layernorm.weight"])
        assert torch.equal(back(f"blk.{i}.fc1.weight"), f16(preds[i].fc1))
        assert torch.equal(back(f"blk.{i}.fc2.weight"), f16(preds[i].fc2))
    # tied embeddings: output.weight is written explicitly and equals the embedding
    assert torch.equal(back("output.weight"), f16(sd["model.embed_tokens.weight"]))


def test_permute_rope_matches_interleaved_rotation():
    """Rotate-half on HF rows == interleaved-pair rotation on permuted rows."""
    d, n_head = 8, 2
    w = torch.randn(n_head * d, 5)
    x = torch.randn(5)
    q_hf = (w @ x).view(n_head, d)
    ang = torch.tensor([0.3, 1.1, 2.0, 0.7])
    c, s = ang.cos(), ang.sin()
    a, b = q_hf[:, : d // 2], q_hf[:, d // 2:]
    rot_hf = torch.cat([a * c - b * s, b * c + a * s], -1)
    q_gg = (permute_rope(w, n_head) @ x).view(n_head, d // 2, 2)
    rot_gg = torch.stack([q_gg[..., 0] * c - q_gg[..., 1] * s, q_gg[..., 0] * s + q_gg[..., 1] * c], -1)
    assert torch.allclose(rot_gg.flatten(1), permute_rope(rot_hf.reshape(-1, 1), n_head).view(n_head, d), atol=1e-6)


def test_dense_conversion_has_ffn_down_and_gguf_magic(relu_hf, tmp_path):
    out = convert(relu_hf, tmp_path / "d.gguf", progress=False)
    assert read_magic(out) == b"GGUF"
    names = {t.name for t in open_gguf(out).reader.tensors}
    assert "blk.0.ffn_down.weight" in names and not any("ffn_down_t" in n or ".fc1." in n for n in names)


# --------------------------------------------------------------------------- bad input
def _refused(fn, *parts):
    with pytest.raises(PowerInferError) as e:
        fn()
    for p in parts:
        assert str(p) in str(e.value)
    return str(e.value)


def test_missing_model_dir(tmp_path):
    _refused(lambda: convert(tmp_path / "nope", tmp_path / "o.gguf", progress=False), tmp_path / "nope")
    assert not (tmp_path / "o.gguf").exists()


def test_unsupported_architecture_is_named(tmp_path, relu_hf):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    _refused(lambda: convert(d, tmp_path / "o.gguf", progress=False), "GPTNeoXForCausalLM")
    assert not (tmp_path / "o.gguf").exists()


def test_silu_model_refused_for_sparse_but_converts_dense(stories_hf, tmp_path):
    random_predictors(tmp_path / "pred", 5, 64, 172)
    _refused(lambda: convert(stories_hf, tmp_path / "o.gguf", tmp_path / "pred", progress=False), "silu")
    assert not (tmp_path / "o.gguf").exists()
    assert convert(stories_hf, tmp_path / "o.gguf", progress=False).exists()


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m8", n_layer=8)


def test_predictor_folder_missing_model_5(eight_layers, tmp_path):
    pred = tmp_path / "pred"
    random_predictors(pred, 8, 32, 48)
    (pred / "model_5.pt").unlink()
    _refused(lambda: convert(eight_layers, tmp_path / "o.gguf", pred, progress=False), "model_5.pt", pred)
    assert not (tmp_path / "o.gguf").exists()


def test_unrelated_pt_files_are_ignored_layers_found_by_number(eight_layers, tmp_path):
    pred = tmp_path / "pred"
    preds = random_predictors(pred, 8, 32, 48, hidden=(4, 8, 12, 16, 20, 24, 28, 32))
    torch.save({"step": 3}, pred / "optimizer.pt")
    torch.save({"x": torch.zeros(2)}, pred / "model_final.pt")
    out = convert(eight_layers, tmp_path / "o.gguf", pred, progress=False)
    g = open_gguf(out).tensors
    for i in (2, 5, 7):  # layer i's predictor lands in blk.i (widths differ per layer)
        assert tuple(int(x) for x in g[f"blk.{i}.fc1.weight"].shape[::-1]) == (preds[i].hidden, 32)


def test_predictor_shapes_that_do_not_match_the_model(eight_layers, tmp_path):
    pred = tmp_path / "pred"
    random_predictors(pred, 8, 32, 40)  # n_ff 40, the model has 48
    _refused(lambda: convert(eight_layers, tmp_path / "o.gguf", pred, progress=False), "model_0.pt", "n_ff=48")
    assert not (tmp_path / "o.gguf").exists()


def test_unmappable_tensor_leaves_no_output(eight_layers, tmp_path):
    import shutil

    from safetensors.torch import save_file
    d = tmp_path / "m"
    shutil.copytree(eight_layers, d)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.surprise.weight"] = torch.zeros(2, 2)
    save_file(sd, d / "model.safetensors")
    _refused(lambda: convert(d, tmp_path / "o.gguf", progress=False), "model.layers.0.mlp.surprise.weight")
    assert not (tmp_path / "o.gguf").exists()

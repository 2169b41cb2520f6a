"""Every family through every stage: HF loading, profile rule, conversion to upstream's tensor set, pi-run.

Models are small random ones in each family's published HF layout (``family_models.py``).
Reference logits come from transformers' own classes (or ours, registered for ProSparse
and Bamboo); upstream tensor sets are written out here from PowerInfer's ``llama.cpp``
loaders (``llm_load_sparse_model_tensors`` / ``llm_load_tensors``), not from our family table.
"""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from powerinfer.convert.cli import main as convert_main
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.families import FALCON, RELU_LLAMA, family_for_config, hf_dims
from powerinfer.formats.gguf_file import open_gguf, read_magic
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.hf import load_hf_model, load_hf_tokenizer, resolve_model
from powerinfer.runtime.cli import main as run_main
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.tokenizer import GGUFTokenizer

from family_models import BUILDERS, N_LAYER, PROSPARSE_THRESHOLD, SLIDING_WINDOW, make_falcon, make_opt
from helpers import TEXT, need, story_text

ARCH = {"relu_llama": "llama", "prosparse": "llama", "bamboo": "bamboo", "falcon": "falcon",
        "falcon_legacy": "falcon", "opt": "opt"}
HF_CLASS = {"relu_llama": "LlamaForCausalLM", "prosparse": "SparseLlamaForCausalLM", "bamboo": "BambooForCausalLM",
            "falcon": "FalconForCausalLM", "falcon_legacy": "FalconForCausalLM", "opt": "OPTForCausalLM"}
N_PREFILL, N_TOKENS = 24, 40  # prompt > Bamboo's sliding window (8), then 16 decode steps


def upstream_tensors(arch: str, n_layer: int, sparse: bool) -> list[str]:
    """The tensors upstream PowerInfer's loader creates for ``arch`` (an extra or missing one fails to load)."""
    wb = lambda *names: [f"{n}.{p}" for n in names for p in ("weight", "bias")]  # noqa: E731
    if arch in ("llama", "bamboo"):
        glob = ["token_embd.weight", "output_norm.weight", "output.weight"]
        layer = [f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                         "ffn_gate", "ffn_up")]
        ffn = ["ffn_down_t.weight", "fc1.weight", "fc2.weight"] if sparse else ["ffn_down.weight"]
    elif arch == "falcon":
        glob = ["token_embd.weight", *wb("output_norm"), "output.weight"]
        layer = [*wb("attn_norm", "attn_norm_2"), "attn_qkv.weight", "attn_output.weight", "ffn_up.weight"]
        ffn = ["ffn_down_t.weight", "fc1.weight", "fc2.weight"] if sparse else ["ffn_down.weight"]
    elif arch == "opt":  # no output tensor: the graph multiplies by token_embd
        glob = ["token_embd.weight", "position_embd.weight", *wb("output_norm")]
        layer = wb("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_up")
        ffn = [*wb("ffn_down_t"), "fc1.weight", "fc2.weight"] if sparse else wb("ffn_down")
    else:
        raise AssertionError(arch)
    return glob + [f"blk.{i}.{t}" for i in range(n_layer) for t in layer + ffn]


def random_predictors(folder, n_layer, n_embd, n_ff):
    g = torch.Generator().manual_seed(5)
    layers = [LayerPredictor(torch.randn(8 + 4 * i, n_embd, generator=g), torch.randn(n_ff, 8 + 4 * i, generator=g))
              for i in range(n_layer)]
    return save_predictor_dir(folder, layers, {"sparse_threshold": 0.0})


@pytest.fixture(scope="module", params=list(BUILDERS))
def fam(request, tmp_path_factory):
    """One family's model folder, its transformers reference logits and its converted files."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    d = BUILDERS[name](tmp / "hf")
    family, cfg, act = resolve_model(d)
    dims = hf_dims(cfg)
    n_embd, n_ff = dims["n_embd"], dims["n_ff"]
    hf = load_hf_model(d)
    ids = load_hf_tokenizer(d)(story_text(600), add_special_tokens=False).input_ids[:N_TOKENS]
    assert len(ids) == N_TOKENS
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    pred = random_predictors(tmp / "pred", N_LAYER, n_embd, n_ff)
    return SimpleNamespace(
        name=name, dir=d, family=family, cfg=cfg, act=act, hf=hf, ids=ids, ref=ref, n_embd=n_embd, n_ff=n_ff,
        dense=convert(d, tmp / "m.gguf", outtype="f32", progress=False),
        sparse=convert(d, tmp / "m.powerinfer.gguf", pred, outtype="f32", progress=False),
        sparse_f16=convert(d, tmp / "m16.powerinfer.gguf", pred, progress=False),
        dense_f16=convert(d, tmp / "m16.gguf", progress=False),
    )


def teacher_forced(model: Transformer, ids: list[int], n_prefill: int) -> torch.Tensor:
    """Logits ``[T, V]``: one prefill of ``n_prefill`` tokens, then one decode step per token."""
    with torch.inference_mode():
        out = [model.forward(torch.tensor(ids[:n_prefill]), 0, all_logits=True)]
        for pos in range(n_prefill, len(ids)):
            out.append(model.forward(torch.tensor([ids[pos]]), pos)[None])
    return torch.cat(out)


# --------------------------------------------------------------------------- loading
def test_hf_class_is_the_familys_own_without_remote_code(fam):
    assert type(fam.hf).__name__ == HF_CLASS[fam.name]
    assert fam.act.is_sparse
    if fam.name == "prosparse":
        assert (fam.act.kind, fam.act.threshold) == ("fatrelu", PROSPARSE_THRESHOLD)


# --------------------------------------------------------------------------- pi-run vs transformers
def test_dense_logits_equal_transformers_prefill_and_decode(fam):
    got = teacher_forced(Transformer(open_gguf(fam.dense)), fam.ids, N_PREFILL)
    err = (got - fam.ref).abs().max().item()
    assert err <= 1e-4, f"{fam.name}: max |pi-run - transformers| = {err:.2e}"


def test_sparse_with_oracle_masks_equals_dense(fam):
    dense = teacher_forced(Transformer(open_gguf(fam.dense)), fam.ids, N_PREFILL)
    m = Transformer(open_gguf(fam.sparse))
    m.oracle_masks()
    sparse = teacher_forced(m, fam.ids, N_PREFILL)
    assert (sparse - dense).abs().max().item() <= 1e-4
    assert 0.0 < m.active_share() < 0.9  # neurons really were skipped


def test_pi_run_cli_generates_from_the_sparse_file(fam):
    r = CliRunner().invoke(run_main, ["-m", str(fam.sparse_f16), "-n", "6", "--temp", "0", "-p", "Once upon"])
    assert r.exit_code == 0, r.output
    assert f"({ARCH[fam.name]}, sparse" in r.output


def test_tokenizer_from_the_gguf_equals_the_models_own(fam):
    text = story_text(400)
    ours = GGUFTokenizer(open_gguf(fam.dense)).encode(text, add_bos=False)
    assert ours == load_hf_tokenizer(fam.dir)(text, add_special_tokens=False).input_ids


# --------------------------------------------------------------------------- file contract
@pytest.mark.parametrize("which", ["sparse_f16", "dense_f16"])
def test_gguf_holds_exactly_upstreams_tensor_set(fam, which):
    sparse = which.startswith("sparse")
    g = open_gguf(getattr(fam, which))
    names = [t.name for t in g.reader.tensors]
    want = upstream_tensors(ARCH[fam.name], N_LAYER, sparse)
    assert g.arch == ARCH[fam.name] and g.sparse == sparse
    assert read_magic(g.path) == (b"PWRI" if sparse else b"GGUF")
    assert len(names) == len(want) and set(names) == set(want)
    for t in g.reader.tensors:  # 2-D weights f16, 1-D (norms, biases) f32
        assert t.tensor_type.name == ("F16" if len(t.shape) == 2 else "F32"), t.name


def test_family_metadata_keys(fam):
    g = open_gguf(fam.sparse)
    arch = g.arch
    assert g.get("powerinfer.activation") == fam.act.kind
    assert g.get(f"{arch}.block_count") == N_LAYER
    assert g.get(f"{arch}.feed_forward_length") == fam.n_ff
    if fam.name == "prosparse":
        assert g.get("powerinfer.activation_threshold") == pytest.approx(PROSPARSE_THRESHOLD)
    if fam.name == "bamboo":
        assert g.get("bamboo.attention.sliding_window") == SLIDING_WINDOW
        assert g.get("bamboo.attention.head_count_kv") == 2
    if arch == "falcon":
        assert g.get("falcon.tensor_data_layout") == "jploski"
        assert g.get("falcon.attention.head_count_kv") == 2
        assert g.get("falcon.attention.layer_norm_epsilon") == pytest.approx(1e-5)
        assert g.get("tokenizer.ggml.pre") == "falcon"
    if arch == "opt":
        assert g.get("opt.context_length") == 2048
        assert tuple(int(x) for x in g.tensors["position_embd.weight"].shape[::-1]) == (2050, fam.n_embd)
        toks = g.get("tokenizer.ggml.tokens")
        assert toks[-3:] == [f"[PAD{len(toks) - 3 + i}]" for i in range(3)]  # vocab_size > tokenizer size


def test_falcon_qkv_is_regrouped_in_jploski_order(tmp_path):
    d = make_falcon(tmp_path / "hf")
    sd = load_file(d / "model.safetensors")
    g = open_gguf(convert(d, tmp_path / "f.gguf", outtype="f32", progress=False)).tensors
    n_head, n_kv, hd = 8, 2, 8
    group = n_head // n_kv
    for i in range(N_LAYER):
        hf = sd[f"transformer.h.{i}.self_attention.query_key_value.weight"].view(-1, hd, 64)  # [(G+2) Hkv, d, D]
        ours = torch.from_numpy(np.array(g[f"blk.{i}.attn_qkv.weight"].data)).view(-1, hd, 64)
        for h in range(n_head):  # Q head h sits in kv group h // G at slot h % G
            assert torch.equal(ours[h], hf[(h // group) * (group + 2) + h % group])
        for k in range(n_kv):
            assert torch.equal(ours[n_head + k], hf[k * (group + 2) + group])
            assert torch.equal(ours[n_head + n_kv + k], hf[k * (group + 2) + group + 1])
    # ln_mlp (the FFN's norm) is attn_norm, ln_attn (attention's) is attn_norm_2
    assert np.array_equal(np.array(g["blk.0.attn_norm.bias"].data), sd["transformer.h.0.ln_mlp.bias"].numpy())
    assert np.array_equal(np.array(g["blk.0.attn_norm_2.bias"].data), sd["transformer.h.0.ln_attn.bias"].numpy())


def test_legacy_rw_config_converts_to_the_same_falcon_file(tmp_path):
    new = convert(make_falcon(tmp_path / "new"), tmp_path / "new.gguf", outtype="f32", progress=False)
    old_dir = make_falcon(tmp_path / "old", legacy=True)
    assert json.loads((old_dir / "config.json").read_text())["architectures"] == ["RWForCausalLM"]
    old = convert(old_dir, tmp_path / "old.gguf", outtype="f32", progress=False)
    a, b = open_gguf(new), open_gguf(old)
    assert b.arch == "falcon"
    assert [t.name for t in a.reader.tensors] == [t.name for t in b.reader.tensors]
    for ta, tb in zip(a.reader.tensors, b.reader.tensors):
        assert np.array_equal(np.array(ta.data), np.array(tb.data)), ta.name
    for key in ("falcon.attention.head_count", "falcon.attention.head_count_kv", "falcon.block_count",
                "falcon.feed_forward_length", "falcon.context_length", "powerinfer.activation"):
        assert a.get(key) == b.get(key), key


def test_falcon_7b_layout_one_layernorm_multi_query(tmp_path):
    """Falcon-7B's layout: ``input_layernorm`` only (so no ``attn_norm_2``), one K/V head."""
    d = make_falcon(tmp_path / "hf", seven_b=True)
    out = convert(d, tmp_path / "f.gguf", outtype="f32", progress=False)
    g = open_gguf(out)
    want = [n for n in upstream_tensors("falcon", N_LAYER, sparse=False) if ".attn_norm_2." not in n]
    assert sorted(t.name for t in g.reader.tensors) == sorted(want)
    assert g.get("falcon.attention.head_count_kv") == 1
    ids = load_hf_tokenizer(d)(story_text(300), add_special_tokens=False).input_ids[:16]
    with torch.no_grad():
        ref = load_hf_model(d)(torch.tensor([ids])).logits[0]
    assert (teacher_forced(Transformer(g), ids, 8) - ref).abs().max().item() <= 1e-4


def test_opt_published_decoder_prefix_converts_the_same(tmp_path):
    a = convert(make_opt(tmp_path / "a"), tmp_path / "a.gguf", outtype="f32", progress=False)
    b = convert(make_opt(tmp_path / "b", decoder_prefix=True), tmp_path / "b.gguf", outtype="f32", progress=False)
    ta, tb = open_gguf(a).reader.tensors, open_gguf(b).reader.tensors
    assert [t.name for t in ta] == [t.name for t in tb]
    assert all(np.array_equal(np.array(x.data), np.array(y.data)) for x, y in zip(ta, tb))


# --------------------------------------------------------------------------- what each family's structure changes
def test_bamboo_sliding_window_matters_and_is_applied(tmp_path):
    d = BUILDERS["bamboo"](tmp_path / "hf")
    hf = load_hf_model(d)
    ids = load_hf_tokenizer(d)(story_text(600), add_special_tokens=False).input_ids[:N_TOKENS]
    with torch.no_grad():
        windowed = hf(torch.tensor([ids])).logits[0]
        hf.config.sliding_window = None
        full = hf(torch.tensor([ids])).logits[0]
    assert (windowed - full)[SLIDING_WINDOW:].abs().max() > 1e-2  # the window changes later positions
    got = teacher_forced(Transformer(open_gguf(convert(d, tmp_path / "b.gguf", outtype="f32", progress=False))),
                         ids, N_PREFILL)
    assert (got - windowed).abs().max().item() <= 1e-4


def test_prosparse_threshold_matters_and_pi_run_honours_it(tmp_path):
    d = BUILDERS["prosparse"](tmp_path / "hf")
    ids = load_hf_tokenizer(d)(story_text(600), add_special_tokens=False).input_ids[:N_TOKENS]
    hf = load_hf_model(d)
    with torch.no_grad():
        fat = hf(torch.tensor([ids])).logits[0]
        for layer in hf.model.layers:
            layer.mlp.act_fn.threshold = 0.0  # plain ReLU, what upstream's engine computes for this file
        relu = hf(torch.tensor([ids])).logits[0]
    assert (fat - relu).abs().max() > 1e-2
    got = teacher_forced(Transformer(open_gguf(convert(d, tmp_path / "p.gguf", outtype="f32", progress=False))),
                         ids, N_PREFILL)
    assert (got - fat).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------- profile rule
RULES = {  # neuron j active, written from FORMATS.md section 1 (module names are the HF ones)
    "relu_llama": (("mlp.gate_proj", "mlp.up_proj"), lambda gate, up: gate > 0),
    "prosparse": (("mlp.gate_proj", "mlp.up_proj"), lambda gate, up: gate >= PROSPARSE_THRESHOLD),
    "bamboo": (("mlp.gate_proj", "mlp.up_proj"), lambda gate, up: (gate > 0) & (up > 0)),
    "falcon": ((None, "mlp.dense_h_to_4h"), lambda gate, up: up > 0),
    "falcon_legacy": ((None, "mlp.dense_h_to_4h"), lambda gate, up: up > 0),
    "opt": ((None, "fc1"), lambda gate, up: up > 0),
}


def test_profile_counts_follow_the_familys_active_rule(fam):
    from powerinfer.profile.collect import count_active_neurons

    (gate_name, up_name), rule = RULES[fam.name]
    layers = fam.family.layers_attr.split(".")
    decoder = fam.hf
    for part in layers:
        decoder = getattr(decoder, part)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(decoder):
        for kind, mod_name in (("gate", gate_name), ("up", up_name)):
            if mod_name is not None:
                mod = layer.get_submodule(mod_name)
                handles.append(mod.register_forward_hook(
                    lambda m, inp, out, i=i, kind=kind: seen.__setitem__((i, kind), out.detach().reshape(-1, out.shape[-1]))))
    batch = torch.tensor([fam.ids])
    with torch.no_grad():
        fam.hf(batch)
    for h in handles:
        h.remove()
    counts, n_tokens = count_active_neurons(fam.hf, fam.family, fam.act, [batch])
    assert n_tokens == N_TOKENS
    for i in range(N_LAYER):
        want = rule(seen.get((i, "gate")), seen[(i, "up")]).sum(0)
        assert torch.equal(counts[i], want), f"layer {i}"
        if fam.name == "prosparse":  # the threshold really removed neurons plain ReLU counts
            assert (counts[i] < (seen[(i, "gate")] > 0).sum(0)).any()
        if fam.name == "bamboo":  # and dReLU needs both branches
            assert (counts[i] < (seen[(i, "gate")] > 0).sum(0)).any()


# --------------------------------------------------------------------------- the whole pipeline
def test_profile_train_convert_run_with_no_hand_edits(fam, tmp_path):
    from powerinfer.profile.collect import profile_model_dir
    from powerinfer.train_predictor.stage import train_predictor_dir
    from powerinfer.train_predictor.train import TrainSettings

    data = need(TEXT / "tinystories_val.txt")
    stats = profile_model_dir(fam.dir, data, tmp_path / "act", max_tokens=128, seq_len=64, batch_size=2)
    assert sorted(p.name for p in (tmp_path / "act").glob("activation_*.pt")) == \
        sorted(f"activation_{i}.pt" for i in range(N_LAYER))
    assert 0.0 < stats["mean_sparsity"] < 1.0
    train_predictor_dir(fam.dir, data, tmp_path / "pred", work_dir=tmp_path / "work", max_tokens=256,
                        heldout_tokens=64, seq_len=64, hidden=16,
                        settings=TrainSettings(epochs=2, batch_size=256, patience=2))
    out = convert(fam.dir, tmp_path / "m.powerinfer.gguf", tmp_path / "pred", progress=False)
    r = CliRunner().invoke(run_main, ["-m", str(out), "-n", "8", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "FFN neurons computed" in r.output


# --------------------------------------------------------------------------- bad input
def test_unknown_architecture_exits_non_zero_naming_it(tmp_path, relu_hf):
    d = tmp_path / "m"
    shutil.copytree(relu_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe")
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 1 and "Qwen2MoeForCausalLM" in r.output
    assert not (tmp_path / "o.gguf").exists()


def test_rw_config_never_takes_the_llama_path(tmp_path, relu_hf):
    """Upstream's converter maps RWForCausalLM to LLAMA; ours to Falcon, and a Llama body under an
    RW config is refused at its first tensor instead of being written as a llama file."""
    assert family_for_config({"architectures": ["RWForCausalLM"]}) is FALCON
    assert family_for_config({"model_type": "RefinedWebModel"}) is FALCON
    assert family_for_config({"architectures": ["LlamaForCausalLM"]}) is RELU_LLAMA
    d = tmp_path / "m"
    shutil.copytree(relu_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["RWForCausalLM"], model_type="RefinedWeb", n_layer=cfg.pop("num_hidden_layers"),
               n_head=cfg.pop("num_attention_heads"), activation="relu")
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 1 and "model.embed_tokens.weight" in r.output and "falcon" in r.output
    assert not (tmp_path / "o.gguf").exists()


def test_falcon_without_relu_in_its_config_is_gelu_dense_only(tmp_path):
    d = make_falcon(tmp_path / "hf", legacy=True, activation=None)
    _, _, act = resolve_model(d)
    assert act.kind == "gelu"  # what transformers and the original RW code run
    pred = random_predictors(tmp_path / "pred", N_LAYER, 64, 256)
    with pytest.raises(PowerInferError, match="gelu"):
        convert(d, tmp_path / "o.powerinfer.gguf", pred, progress=False)
    assert not (tmp_path / "o.powerinfer.gguf").exists()
    dense = convert(d, tmp_path / "o.gguf", outtype="f32", progress=False)
    assert open_gguf(dense).get("powerinfer.activation") == "gelu"
    ids = load_hf_tokenizer(d)(story_text(300), add_special_tokens=False).input_ids[:16]
    with torch.no_grad():
        ref = load_hf_model(d)(torch.tensor([ids])).logits[0]
    assert (teacher_forced(Transformer(open_gguf(dense)), ids, 8) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("extra", ["transformer.h.1.self_attention.query_key_value.bias", "transformer.h.0.mlp.gate.weight"])
def test_unmappable_falcon_tensor_leaves_no_output(tmp_path, extra):
    d = make_falcon(tmp_path / "hf")
    sd = load_file(d / "model.safetensors")
    sd[extra] = torch.zeros(4)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 1 and extra in r.output
    assert not any(p.name.startswith(("o.gguf", ".o.gguf")) for p in tmp_path.iterdir())


def test_post_ln_opt_is_refused_naming_the_reason(tmp_path):
    d = make_opt(tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["do_layer_norm_before"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(tmp_path / "o.gguf")])
    assert r.exit_code == 1 and "do_layer_norm_before" in r.output
    assert not (tmp_path / "o.gguf").exists()

"""Mixture-of-experts families both ways: Mixtral (GGUF ``llama`` with experts) and Qwen3-MoE (``qwen3moe``).

1. From Hugging Face: the tiny random models of ``family_models.MOE_BUILDERS`` (Mixtral: 4 experts of
   width 64, 2 per token; Qwen3-MoE: 8 experts of width 32, 3 per token, q/k norms, head_dim 32),
   converted by ``pi-convert``; our logits over a prompt and cached decode steps equal transformers'.
2. From llama.cpp: ``tests/data/llamacpp/{mixtral,qwen3moe}.gguf`` are the files llama.cpp's converter
   wrote from the same models (``tests/data/README.md``); our converter writes the same tensors bit for
   bit; on llama.cpp's files our greedy ids equal ``llama-server``'s and ``pi-perplexity`` equals
   ``llama-perplexity`` within 0.1% (``moe_references.json``; the test needs no llama.cpp).
3. Quantized experts (Q4_0, Q8_0) are computed in the file's bytes and equal a dequantized reference;
   batched decoding (``-np``: the union of the routed experts) equals each sequence alone.
4. SmallThinker (no transformers class: llama.cpp is the reference): ``make_smallthinker``'s checkpoint
   converted by ``pi-convert`` gives llama.cpp's converter's tensors; on llama.cpp's file our greedy ids
   and PPL equal llama.cpp's; its NoPE layer, pre-attention router and sigmoid gate each matter.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from family_models import MOE_BUILDERS, make_smallthinker
from gguf_edit import BOOL, KV, U32, parse, serialize
from helpers import DATA, alone, batched, need, teacher_forced
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.eval.cli import main as ppl_main
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import load_hf_model
from powerinfer.quant.qweight import QWeight
from powerinfer.runtime import kernels
from powerinfer.runtime.loading import load_model
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.moe import ExpertsFFN
from powerinfer.runtime.tokenizer import GGUFTokenizer
from test_qkernels import close, reference

LLAMACPP = DATA / "llamacpp"
ARCH = {"mixtral": "llama", "qwen3moe": "qwen3moe"}
EXPERTS = {"mixtral": (4, 2, 64), "qwen3moe": (8, 3, 32)}  # n_expert, n_used, expert width
IDS = list(range(3, 43))
N_PREFILL = 24
REFERENCE_MODELS = [*MOE_BUILDERS, "smallthinker"]  # moe_references.json
PROMPTS = [[1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [1, 200, 201], [1, 300, 5, 6, 7, 8], [1, 42]]


def references() -> dict:
    return json.loads(need(LLAMACPP / "moe_references.json").read_text())


@pytest.fixture(scope="module", params=list(MOE_BUILDERS))
def fam(request, tmp_path_factory):
    """One MoE family's HF folder, transformers' logits over IDS and our f32 / Q4_0 / Q8_0 conversions."""
    kernels.set_backend("auto")
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    d = MOE_BUILDERS[name](tmp / "hf")
    hf = load_hf_model(d)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    return SimpleNamespace(name=name, dir=d, ref=ref, tmp=tmp,
                           f32=convert(d, tmp / "m.gguf", outtype="f32", progress=False),
                           q4=convert(d, tmp / "m-q4_0.gguf", outtype="q4_0", progress=False),
                           q8=convert(d, tmp / "m-q8_0.gguf", outtype="q8_0", progress=False),
                           f16=convert(d, tmp / "m-f16.gguf", outtype="f16", progress=False),
                           bf16=convert(d, tmp / "m-bf16.gguf", outtype="bf16", progress=False))


# --------------------------------------------------------------------------- Hugging Face -> ours
def test_metadata_and_tensor_types(fam):
    """llama.cpp's keys and names; router f32 in every file, experts quantized as 3-D tensors."""
    n, k, w = EXPERTS[fam.name]
    arch = ARCH[fam.name]
    g = open_gguf(fam.q4)
    assert g.arch == arch and g.get(f"{arch}.expert_count") == n and g.get(f"{arch}.expert_used_count") == k
    assert g.get(f"{arch}.expert_feed_forward_length") == (w if fam.name == "qwen3moe" else None)
    assert g.tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    for kind in ("gate", "up", "down"):
        t = g.tensors[f"blk.2.ffn_{kind}_exps.weight"]
        assert t.tensor_type.name == "Q4_0" and len(t.shape) == 3 and int(t.shape[-1]) == n
    assert not any(name.startswith("blk.0.ffn_gate.") or name.startswith("blk.0.ffn_up.") for name in g.tensors)
    ffn = Transformer(g).layers[0].ffn
    assert isinstance(ffn, ExpertsFFN) and len(ffn.gate) == n and ffn.ea.n_used == k and ffn.ea.norm_w
    row = g.tensors["blk.0.ffn_gate_exps.weight"].n_bytes // (n * w)  # Q4_0 bytes, no f32 copies:
    assert all(isinstance(x, QWeight) and x.shape == (w, 64) and x.layout == "x8" and x.nbytes == w * row
               for x in ffn.gate)  # each expert its own rows in 8-row groups, as dense matrices
    g32 = open_gguf(fam.f32)
    f32 = Transformer(g32).layers[0].ffn
    base = g32.tensors["blk.0.ffn_gate_exps.weight"].data.ctypes.data
    assert [x.data_ptr() for x in f32.gate] == [base + e * w * 64 * 4 for e in range(n)]  # f32: views of the map


def test_logits_equal_transformers_prefill_and_decode(fam):
    got = teacher_forced(Transformer(open_gguf(fam.f32)), IDS, N_PREFILL)
    err = (got - fam.ref).abs().max().item()
    assert err <= 1e-4, f"{fam.name}: max |ours - transformers| = {err:.2e}"


def test_routing_is_exercised(fam):
    """In every layer more experts serve the 40 tokens than one token uses, tokens differ in their
    experts, and top-1 routing (or no renormalisation) changes the logits: the router and the k
    weights are really in the path."""
    m = Transformer(open_gguf(fam.f32))
    base = teacher_forced(m, IDS, N_PREFILL)
    for layer in m.layers:
        assert int((layer.ffn.expert_hits > 0).sum()) > EXPERTS[fam.name][1], layer.ffn.expert_hits
    sel = m.layers[1].ffn.route(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))[1]
    assert len({tuple(sorted(r)) for r in sel.tolist()}) > 1
    import dataclasses

    for change in ({"n_used": 1}, {"norm_w": False}):
        for layer in m.layers:
            layer.ffn.ea = dataclasses.replace(layer.ffn.ea, **change)
        broken = teacher_forced(m, IDS, N_PREFILL)
        assert (broken - base).abs().max().item() > 1e-2, change
        for layer in m.layers:
            layer.ffn.ea = dataclasses.replace(layer.ffn.ea, n_used=EXPERTS[fam.name][1], norm_w=True)


@pytest.mark.parametrize("which", ["f32", "q4", "q8"])
def test_batched_decode_equals_each_sequence_alone(fam, which):
    """Four sequences joining at steps 0, 0, 1, 3: every step's logits equal the sequence's own, bit for
    bit; quantized files run each step's batch as one pass over the union of the routed experts."""
    model = Transformer(open_gguf(getattr(fam, which)))
    want = [alone(model, p, 6) for p in PROMPTS]
    toks, logits, dec = batched(model, PROMPTS, 6, "auto", start=[0, 0, 1, 3])
    for b in range(len(PROMPTS)):
        assert toks[b] == want[b][0], f"sequence {b}"
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}: max diff {(logits[b] - want[b][1]).abs().max()}"
    assert dec._dense_shared(model.layers[0]) == (which != "f32")


@pytest.mark.parametrize("which, btype", [("q4", "Q4_0"), ("q8", "Q8_0"), ("f16", "F16"), ("bf16", "BF16")])
def test_quantized_experts_equal_dequantized_reference(fam, which, btype):
    """One layer's MoE output on 5 tokens, computed on the Q4_0/Q8_0/F16/BF16 bytes (f32 compute), equals
    the same routing over experts dequantized by gguf (activations rounded to 8 bits as the kernels
    round them for Q4_0/Q8_0)."""
    ffn = Transformer(open_gguf(getattr(fam, which))).layers[1].ffn
    assert {w.btype.name for w in (*ffn.gate, *ffn.up, *ffn.down)} == {btype}
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    got = ffn(x, x)
    w, sel = ffn.route(x)
    want = torch.zeros(5, 64, dtype=torch.float64)
    for t in range(5):
        for j in range(sel.shape[1]):
            e = int(sel[t, j])
            h = torch.nn.functional.silu(reference(ffn.gate[e], x[t:t + 1])) * reference(ffn.up[e], x[t:t + 1])
            want[t] += w[t, j].double() * reference(ffn.down[e], h.float())[0]
    assert close(got, want, rel=2e-5), (got.double() - want).abs().max()


def test_norm_topk_prob_false_is_honoured(tmp_path):
    """A Qwen3-MoE config with norm_topk_prob false (transformers' default): written as
    qwen3moe.expert_weights_norm false, and our logits still equal transformers'."""
    d = MOE_BUILDERS["qwen3moe"](tmp_path / "hf", norm_topk_prob=False)
    out = convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)
    g = open_gguf(out)
    assert g.get("qwen3moe.expert_weights_norm") is False
    with torch.no_grad():
        ref = load_hf_model(d)(torch.tensor([IDS])).logits[0]
    got = teacher_forced(Transformer(g), IDS, N_PREFILL)
    assert (got - ref).abs().max().item() <= 1e-4


def test_our_tensors_equal_llama_cpps_converter(fam):
    ours, theirs = open_gguf(fam.f32).tensors, open_gguf(need(LLAMACPP / f"{fam.name}.gguf")).tensors
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), name


def test_llamacpp_gguf_logits_equal_transformers(fam):
    got = teacher_forced(Transformer(open_gguf(need(LLAMACPP / f"{fam.name}.gguf"))), IDS, N_PREFILL)
    assert (got - fam.ref).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------- llama.cpp's GGUF -> ours
@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_llamacpp_gguf_greedy_equals_llamacpp(name):
    r = references()[name]
    g = open_gguf(need(LLAMACPP / r["gguf"]))
    assert GGUFTokenizer(g).encode(r["prompt"], add_bos=True) == r["prompt_ids"]
    m = load_model(str(LLAMACPP / r["gguf"]), "f32", n_ctx=256, g=g)[0]  # SmallThinker: its own Transformer
    ids, out = list(r["prompt_ids"]), []
    with torch.inference_mode():
        logits = m.forward(torch.tensor(ids), 0)
        for _ in range(len(r["greedy_ids"])):
            out.append(int(logits.argmax()))
            logits = m.forward(torch.tensor(out[-1:]), len(ids) + len(out) - 1)
    assert out == r["greedy_ids"]


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_llamacpp_gguf_perplexity_equals_llamacpp(name):
    r = references()[name]
    res = CliRunner().invoke(ppl_main, ["-m", str(need(LLAMACPP / r["gguf"])), "-f", str(need(DATA / r["ppl_text"])),
                                        "-c", str(r["ppl_ctx"]), "-b", str(r["ppl_ctx"]), "-t", "1", "--dtype", "f32"])
    assert res.exit_code == 0, res.output
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", res.output).group(1))
    assert abs(ppl / r["ppl"] - 1) < 1e-3, f"{name}: pi-perplexity {ppl:.4f}, llama-perplexity {r['ppl']:.4f}"


def test_llamacpp_k_quant_moe_file_runs_in_place_and_follows_llamacpp():
    """llama.cpp's Q4_K_M of a 256-wide Mixtral (Q4_K experts, a Q6_K ffn_down_exps): every expert runs
    in its own bytes; fed llama.cpp's 32 greedy tokens, its choice is our best logit at >= 28 steps and
    within 0.05 of it at all; the perplexity is within 0.5% of llama-perplexity's. The engines round
    the activations of K-quant products differently (q8_K blocks of 256 there, q8 blocks of 32 here),
    which moves near-ties, as for dense K-quant files (test_kquants)."""
    r = references()["mixtral_q4_k_m"]
    p = need(LLAMACPP / r["gguf"])
    m = Transformer(open_gguf(p), n_ctx=256)
    kinds = {w.btype.name for layer in m.layers for w in (*layer.ffn.gate, *layer.ffn.up, *layer.ffn.down)}
    assert kinds == {"Q4_K", "Q6_K"} and all(w.layout == "x8" for w in m.layers[1].ffn.down)
    seq = r["prompt_ids"] + r["greedy_ids"]
    with torch.inference_mode():
        logits = m.forward(torch.tensor(seq[:-1]), 0, all_logits=True)[len(r["prompt_ids"]) - 1:]
    gap = [float(lg.max() - lg[t]) for lg, t in zip(logits, r["greedy_ids"])]
    assert sum(g == 0 for g in gap) >= 28 and max(gap) < 0.05, gap
    res = CliRunner().invoke(ppl_main, ["-m", str(p), "-f", str(need(DATA / r["ppl_text"])), "-c", str(r["ppl_ctx"]),
                                        "-b", str(r["ppl_ctx"]), "-t", "1", "--dtype", "f32"])
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", res.output).group(1))
    assert abs(ppl / r["ppl"] - 1) < 5e-3, (ppl, r["ppl"])


# --------------------------------------------------------------------------- bad input
def _edited(tmp_path, name: str, edit) -> str:
    g = parse(need(LLAMACPP / f"{name}.gguf").read_bytes())
    edit(g)
    p = tmp_path / "bad.gguf"
    p.write_bytes(serialize(g))
    return str(p)


def _set(key: str, vtype: int, value):
    def edit(g):
        g.kvs = [k for k in g.kvs if k.key != key] + [KV(key, vtype, value)]
    return edit


@pytest.mark.parametrize("name, edit, msg", [
    ("mixtral", _set("llama.expert_count", U32, 5),
     r"tensor 'blk.0.ffn_gate_inp.weight' has shape \[4, 64\], but llama.expert_count 5"),
    ("mixtral", _set("llama.expert_used_count", U32, 6), r"llama.expert_used_count 6 is more than llama.expert_count 4"),
    ("mixtral", lambda g: g.kvs.remove(g.kv("llama.expert_used_count")),
     r"mixture-of-experts tensors but no llama.expert_used_count"),
    ("mixtral", _set("llama.feed_forward_length", U32, 96), r"ffn_gate_exps.weight' has shape \[4, 64, 64\], .*width 96"),
    ("qwen3moe", _set("qwen3moe.expert_feed_forward_length", U32, 64), r"the expert width 64"),
    ("qwen3moe", _set("qwen3moe.expert_gating_func", U32, 2),
     r"qwen3moe.expert_gating_func = 2: the qwen3moe gating supported is softmax \(1\)$"),
    ("qwen3moe", _set("qwen3moe.expert_weights_norm", U32, 1), r"expert_weights_norm = 1 is not a bool"),
])
def test_bad_expert_metadata_is_one_line_before_loading(tmp_path, name, edit, msg):
    p = _edited(tmp_path, name, edit)
    with pytest.raises(PowerInferError, match=f"^{re.escape(p)}: .*{msg}"):
        Transformer(open_gguf(p))


def test_smallthinker_gating_outside_softmax_and_sigmoid_is_refused(tmp_path):
    p = _edited(tmp_path, "smallthinker", _set("smallthinker.expert_gating_func", U32, 4))
    with pytest.raises(PowerInferError, match=r"= 4: the smallthinker gating supported is softmax \(1\) or sigmoid \(2\)$"):
        load_model(p, "f32")


def test_expert_keys_are_read_as_written(tmp_path):
    """A bool expert_weights_norm false in a file llama.cpp wrote is honoured (a sanity check of _set)."""
    p = _edited(tmp_path, "mixtral", _set("llama.expert_weights_norm", BOOL, False))
    assert Transformer(open_gguf(p)).layers[0].ffn.ea.norm_w is False


@pytest.mark.parametrize("edit, msg", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
    ({"num_local_experts": 0}, r"num_local_experts / num_experts = 0 is missing or out of range"),
])
def test_bad_expert_config_is_refused_by_pi_convert(tmp_path, edit, msg):
    d = MOE_BUILDERS["mixtral"](tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.gguf"
    with pytest.raises(PowerInferError, match=f"config.json: {msg}"):
        convert(d, out, outtype="f32", progress=False)
    assert not out.exists()


def test_qwen3moe_dense_layers_are_refused(tmp_path):
    d = MOE_BUILDERS["qwen3moe"](tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mlp_only_layers"] = [1]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PowerInferError, match=r"config.json: layers without experts \(mlp_only_layers \[1\]"):
        convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)


def test_missing_expert_in_the_checkpoint_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    d = MOE_BUILDERS["mixtral"](tmp_path / "hf")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PowerInferError, match=r"no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'"):
        convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)


def test_ram_and_vram_budgets_are_refused_in_one_line():
    from powerinfer.runtime.loading import open_for_inference

    p = str(need(LLAMACPP / "mixtral.gguf"))
    with pytest.raises(PowerInferError, match="--ram-budget does not run mixture-of-experts files"):
        open_for_inference(p, ram_budget=1.0)
    with pytest.raises(PowerInferError, match="--vram-budget does not run mixture-of-experts files"):
        open_for_inference(p, vram_budget=1.0)


def test_pi_server_np4_serves_moe_requests_as_each_alone(tmp_path):
    """pi-server -np 4 on a Q4_0 Mixtral file (llama.cpp's, re-quantized by pi-quantize): four greedy
    requests at once get the text each gets alone, decoded together (steps of several sequences)."""
    import threading

    import httpx

    from powerinfer.convert.quantize import quantize_file
    from test_server import Server

    q4 = quantize_file(need(LLAMACPP / "mixtral.gguf"), tmp_path / "m-q4_0.gguf", "q4_0").path
    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to", "One day a bird"]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    s = Server(q4, "-np", 4, "-c", 512, "--metrics")
    try:
        post = lambda p: httpx.post(s.url + "/v1/completions", timeout=120, json={**body, "prompt": p}).json()
        want = {p: post(p)["choices"][0]["text"] for p in prompts}
        got: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, post(p)["choices"][0]["text"]))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want and len(set(want.values())) == 4
        m = httpx.get(s.url + "/metrics", timeout=10).text
        busy = float(re.search(r"^powerinfer_busy_slots_per_decode ([0-9.]+)", m, re.M).group(1))
        assert busy > 1.0  # the four shared decode steps
    finally:
        s.stop()


def test_published_qwen3moe_key_num_experts_is_read(tmp_path):
    """Published Qwen3-MoE configs name the expert count ``num_experts`` (transformers 5 saves
    ``num_local_experts``): the same file either way."""
    d = MOE_BUILDERS["qwen3moe"](tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (d / "config.json").write_text(json.dumps(cfg))
    g = open_gguf(convert(d, tmp_path / "m.gguf", outtype="f32", progress=False))
    assert g.get("qwen3moe.expert_count") == 8 and "blk.2.ffn_down_exps.weight" in g.tensors


def test_profiling_an_moe_model_is_refused_in_one_line(tmp_path):
    from powerinfer.calibrate.session import open_session

    d = MOE_BUILDERS["mixtral"](tmp_path / "hf")
    with pytest.raises(PowerInferError, match=r"config.json: pi-profile does not support mixture-of-experts models"):
        open_session(d, "pi-profile")



# --------------------------------------------------------------------------- SmallThinker
@pytest.fixture(scope="module")
def smallthinker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smallthinker")
    d = make_smallthinker(tmp / "hf")
    return SimpleNamespace(dir=d, f32=convert(d, tmp / "m.gguf", outtype="f32", progress=False))


def test_smallthinker_tensors_equal_llama_cpps_converter(smallthinker):
    ours, theirs = open_gguf(smallthinker.f32), open_gguf(need(LLAMACPP / "smallthinker.gguf"))
    assert set(ours.tensors) == set(theirs.tensors)
    for name, t in theirs.tensors.items():
        assert np.array_equal(np.asarray(ours.tensors[name].data), np.asarray(t.data)), name
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length", "expert_gating_func",
                "attention.sliding_window", "feed_forward_length"):
        assert ours.get(f"smallthinker.{key}") == theirs.get(f"smallthinker.{key}"), key


def test_smallthinker_features_are_not_vacuous(smallthinker):
    """RoPE on the NoPE layer 0, the router on the FFN norm's output instead of the layer input, or a
    softmax gate instead of the sigmoid each change the logits (llama.cpp agrees with the base: above)."""
    import dataclasses

    from powerinfer.runtime.smallthinker import SmallThinkerTransformer

    g = open_gguf(smallthinker.f32)
    m = SmallThinkerTransformer(g)
    assert m.rules == [(False, None), (True, 4096), (True, 4096)]
    base = teacher_forced(m, IDS, N_PREFILL)
    for change in ("rope", "router", "gate"):
        m = SmallThinkerTransformer(g)
        if change == "rope":
            m.rules[0] = (True, None)
        for layer in m.layers:
            if change == "router":
                layer.ffn.pre_attention = False
            elif change == "gate":
                layer.ffn.ea = dataclasses.replace(layer.ffn.ea, gating="softmax")
        assert (teacher_forced(m, IDS, N_PREFILL) - base).abs().max().item() > 1e-2, change


def test_smallthinker_refusals_are_one_line(tmp_path):
    """The plain Transformer (no pre-attention router), several sequences at once, and a sliding-window
    pattern other than llama.cpp's default: one line each, before anything is loaded."""
    from powerinfer.runtime.batch import check_batchable

    p = need(LLAMACPP / "smallthinker.gguf")
    with pytest.raises(PowerInferError, match=f"^{re.escape(str(p))}: smallthinker files run with "):
        Transformer(open_gguf(p))
    with pytest.raises(PowerInferError, match=r"-np > 1\) do not run SmallThinker files yet"):
        check_batchable(load_model(str(p), "f32")[0])
    bad = _edited(tmp_path, "smallthinker", _set("smallthinker.attention.sliding_window_pattern", U32, 2))
    with pytest.raises(PowerInferError, match="sliding_window_pattern is not supported"):
        load_model(bad, "f32")


def test_smallthinker_with_predictors_is_refused(smallthinker, tmp_path):
    """SmallThinker is ReLU, but its neurons belong to experts: pi-convert with a predictor folder refuses."""
    with pytest.raises(PowerInferError, match="mixture-of-experts model: predictor"):
        convert(smallthinker.dir, tmp_path / "m.gguf", tmp_path / "no-predictors", progress=False)


def test_pi_run_names_the_experts():
    """pi-run's summary says the FFN runs k of E experts (not "dense")."""
    from powerinfer.runtime.cli import main as run_main

    r = CliRunner().invoke(run_main, ["-m", str(need(LLAMACPP / "qwen3moe.gguf")), "-p", "Once upon a time", "-n", "4",
                                      "--temp", "0", "--dtype", "f32"])
    assert r.exit_code == 0, r.output
    assert "(qwen3moe, experts 3 of 8, float32," in r.output

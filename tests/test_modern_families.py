"""The modern dense families both ways: Llama 3.x, Qwen2, Qwen3, Mistral and Mistral-Nemo.

1. From Hugging Face: the tiny random models of ``family_models.MODERN_BUILDERS`` (Llama 3.1 with
   ``llama3`` RoPE scaling and GQA, its tied 3.2-style variant, Qwen2 with Q/K/V biases and a tied
   output, Qwen3 with per-head q/k norms and head_dim 32 != n_embd / n_head, Mistral with a
   sliding window of 8 < the prompt, Nemo-style head_dim 24) converted by ``pi-convert``; our
   logits over a prompt and cached decode steps equal transformers'; batched decoding equals
   each sequence alone.
2. From llama.cpp: ``tests/data/llamacpp/*.gguf`` are the GGUFs llama.cpp's own converter wrote
   from the same tiny models (``tests/data/README.md`` gives the commands); our converter writes
   the same tensors bit for bit; ``Transformer`` on llama.cpp's file gives the greedy ids
   llama.cpp's ``llama-server`` produced and ``pi-perplexity`` the PPL of ``llama-perplexity``
   within 0.1% (``references.json``, recorded with the October 2026 llama.cpp; the test needs no
   llama.cpp).
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from family_models import LLAMA3_ROPE, MISTRAL_WINDOW, MODERN_BUILDERS
from gguf_edit import F32, KV, STRING, parse, serialize
from helpers import DATA, alone, batched, need, teacher_forced
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.eval.cli import main as ppl_main
from powerinfer.families.rope_scaling import llama3_factors
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.hf import load_hf_model, resolve_model
from powerinfer.runtime import kernels
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.tokenizer import GGUFTokenizer

LLAMACPP = DATA / "llamacpp"
ARCH = {"llama3": "llama", "llama3_tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
        "nemo": "llama"}
HEAD_DIM = {"llama3": 16, "llama3_tied": 16, "qwen2": 16, "qwen3": 32, "mistral": 16, "nemo": 24}
IDS = list(range(3, 43))  # 40 ids of the 512-token vocabulary
N_PREFILL = 24  # > Mistral's window of 8; then 16 cached decode steps
PROMPTS = [[1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], [1, 200, 201], [1, 300, 5, 6, 7, 8], [1, 42]]


def references() -> dict:
    return json.loads(need(LLAMACPP / "references.json").read_text())


@pytest.fixture(scope="module", params=list(MODERN_BUILDERS))
def fam(request, tmp_path_factory):
    """One family's HF folder, transformers' logits over IDS and our f32 and Q4_0 conversions."""
    kernels.set_backend("auto")
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    d = MODERN_BUILDERS[name](tmp / "hf")
    hf = load_hf_model(d)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]  # [T, V]
    return SimpleNamespace(name=name, dir=d, hf=hf, ref=ref,
                           f32=convert(d, tmp / "m.gguf", outtype="f32", progress=False),
                           q4=convert(d, tmp / "m-q4_0.gguf", outtype="q4_0", progress=False))


# --------------------------------------------------------------------------- Hugging Face -> ours
def test_family_record_and_metadata(fam):
    family, cfg, act = resolve_model(fam.dir)
    assert family.name == {"llama3_tied": "llama3", "nemo": "mistral"}.get(fam.name, fam.name)
    assert act.kind == "silu" and not act.is_sparse
    g = open_gguf(fam.f32)
    arch = g.arch
    assert arch == ARCH[fam.name] and g.get("powerinfer.activation") == "silu"
    a = Transformer(g).args
    assert a.head_dim == HEAD_DIM[fam.name] and a.n_rot == HEAD_DIM[fam.name] and a.n_head_kv == 2
    explicit = HEAD_DIM[fam.name] != 64 // 4
    assert (g.get(f"{arch}.attention.key_length") == HEAD_DIM[fam.name]) == explicit
    assert g.get(f"{arch}.attention.sliding_window") == (MISTRAL_WINDOW if fam.name == "mistral" else None)
    assert a.sliding_window == (MISTRAL_WINDOW if fam.name == "mistral" else None)
    names = set(g.tensors)
    assert ("output.weight" in names) == (fam.name not in ("llama3_tied", "qwen2"))  # tied: llama.cpp's way
    assert ("rope_freqs.weight" in names) == fam.name.startswith("llama3")
    assert ("blk.0.attn_q.bias" in names) == (fam.name == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in names) == (fam.name == "qwen3")


def test_logits_equal_transformers_prefill_and_decode(fam):
    got = teacher_forced(Transformer(open_gguf(fam.f32)), IDS, N_PREFILL)
    err = (got - fam.ref).abs().max().item()
    assert err <= 1e-4, f"{fam.name}: max |ours - transformers| = {err:.2e}"


@pytest.mark.parametrize("which", ["f32", "q4"])
def test_batched_decode_equals_each_sequence_alone(fam, which):
    """Four sequences joining at steps 0, 0, 1, 3 decoded through BatchDecoder: every step's logits
    equal the sequence's own, bit for bit (q/k norms, rope_freqs, biases, the window in the batch path)."""
    model = Transformer(open_gguf(getattr(fam, which)))
    want = [alone(model, p, 6) for p in PROMPTS]
    toks, logits, _ = batched(model, PROMPTS, 6, "per-seq", start=[0, 0, 1, 3])
    for b in range(len(PROMPTS)):
        assert toks[b] == want[b][0], f"sequence {b}"
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}: max diff {(logits[b] - want[b][1]).abs().max()}"


def test_our_tensors_equal_llama_cpps_converter(fam):
    """pi-convert writes every tensor llama.cpp's converter wrote from the same checkpoint, bit for
    bit (Q/K permuted for llama, not for qwen; llama3's rope_freqs factors; tied: no output)."""
    ours, theirs = open_gguf(fam.f32).tensors, open_gguf(need(LLAMACPP / f"{fam.name}.gguf")).tensors
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), name


def test_features_are_not_vacuous(fam):
    """What each tiny model claims to exercise changes its logits: without it ours would differ."""
    g = open_gguf(fam.f32)
    base = teacher_forced(Transformer(g), IDS, N_PREFILL)
    m = Transformer(g)
    if fam.name.startswith("llama3"):  # rope_freqs factors ignored
        from powerinfer.runtime.model import rope_tables
        m.cos, m.sin = rope_tables(m.n_ctx, m.args.n_rot, m.args.rope_base)
    elif fam.name == "qwen2":
        for l in m.layers:
            l.bqkv = None
    elif fam.name == "qwen3":
        for l in m.layers:
            l.q_norm = l.k_norm = None
    elif fam.name == "mistral":
        import dataclasses
        m.args = dataclasses.replace(m.args, sliding_window=None)
    else:  # nemo: head_dim 24 is structural (a wrong one cannot load); the heads really are not n_embd / n_head
        a = m.args
        assert a.head_dim * a.n_head != a.n_embd and tuple(m.layers[0].wo.shape) == (a.n_embd, a.n_head * a.head_dim)
        return
    broken = teacher_forced(m, IDS, N_PREFILL)
    assert (broken - base).abs().max().item() > 1e-2


# --------------------------------------------------------------------------- llama.cpp's GGUF -> ours
@pytest.mark.parametrize("name", list(MODERN_BUILDERS))
def test_llamacpp_gguf_greedy_equals_llamacpp(name):
    r = references()[name]
    g = open_gguf(need(LLAMACPP / r["gguf"]))
    assert GGUFTokenizer(g).encode(r["prompt"], add_bos=True) == r["prompt_ids"]
    m = Transformer(g, n_ctx=256)
    ids, out = list(r["prompt_ids"]), []
    with torch.inference_mode():
        logits = m.forward(torch.tensor(ids), 0)
        for _ in range(len(r["greedy_ids"])):
            out.append(int(logits.argmax()))
            logits = m.forward(torch.tensor(out[-1:]), len(ids) + len(out) - 1)
    assert out == r["greedy_ids"]


@pytest.mark.parametrize("name", list(MODERN_BUILDERS))
def test_llamacpp_gguf_perplexity_equals_llamacpp(name):
    r = references()[name]
    res = CliRunner().invoke(ppl_main, ["-m", str(need(LLAMACPP / r["gguf"])), "-f", str(need(DATA / r["ppl_text"])),
                                        "-c", str(r["ppl_ctx"]), "-b", str(r["ppl_ctx"]), "-t", "1", "--dtype", "f32"])
    assert res.exit_code == 0, res.output
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", res.output).group(1))
    assert abs(ppl / r["ppl"] - 1) < 1e-3, f"{name}: pi-perplexity {ppl:.4f}, llama-perplexity {r['ppl']:.4f}"


def test_llamacpp_gguf_logits_equal_transformers(fam):
    """llama.cpp's own file of the same model gives transformers' logits (its Mistral file has no
    window: llama.cpp's llama graph attends to everything, so the reference is transformers without it)."""
    ref = fam.ref
    if fam.name == "mistral":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(fam.dir), sliding_window=None, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(torch.tensor([IDS])).logits[0]
        assert (ref - fam.ref).abs().max().item() > 1e-2  # the window matters to this prompt
    got = teacher_forced(Transformer(open_gguf(need(LLAMACPP / f"{fam.name}.gguf"))), IDS, N_PREFILL)
    assert (got - ref).abs().max().item() <= 1e-4


def test_rope_freqs_are_llama_cpps_factors():
    """Our factors of the tiny Llama 3.1 config equal the tensor llama.cpp's converter wrote; all three
    bands (kept, smoothed, divided by factor 8) occur."""
    theirs = torch.from_numpy(np.array(open_gguf(need(LLAMACPP / "llama3.gguf")).tensors["rope_freqs.weight"].data))
    ours = llama3_factors(16, 500000.0, LLAMA3_ROPE["factor"], LLAMA3_ROPE["low_freq_factor"],
                          LLAMA3_ROPE["high_freq_factor"], LLAMA3_ROPE["original_max_position_embeddings"])
    assert torch.equal(ours, theirs)
    assert (ours == 1).any() and (ours == 8).any() and ((ours > 1) & (ours < 8)).any()


# --------------------------------------------------------------------------- bad input
def test_unsupported_rope_scaling_type_is_refused_by_pi_convert(tmp_path):
    d = MODERN_BUILDERS["llama3"](tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                              "original_max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.gguf"
    with pytest.raises(PowerInferError, match=r"config\.json: rope scaling type 'yarn' is not supported"):
        convert(d, out, outtype="f32", progress=False)
    assert not out.exists()


@pytest.mark.parametrize("kv, msg", [
    (KV("llama.rope.scaling.type", STRING, "yarn"), r"rope scaling type 'yarn' \(llama.rope.scaling.type\)"),
    (KV("llama.rope.scaling.type", STRING, "longrope"), r"rope scaling type 'longrope'"),
])
def test_unsupported_rope_scaling_in_a_gguf_is_refused(tmp_path, kv, msg):
    g = parse(need(LLAMACPP / "llama3.gguf").read_bytes())
    g.kvs.append(kv)
    p = tmp_path / "bad.gguf"
    p.write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match=f"{re.escape(str(p))}: {msg}"):
        Transformer(open_gguf(p))


def test_linear_rope_scaling_in_a_gguf_scales_positions(tmp_path):
    """``rope.scaling.factor`` 2 (linear): position p rotates as p / 2 did, as llama.cpp's freq_scale."""
    g = parse(need(LLAMACPP / "qwen3.gguf").read_bytes())
    g.kvs += [KV("qwen3.rope.scaling.type", STRING, "linear"), KV("qwen3.rope.scaling.factor", F32, 2.0)]
    p = tmp_path / "linear.gguf"
    p.write_bytes(serialize(g))
    scaled, plain = Transformer(open_gguf(p)), Transformer(open_gguf(LLAMACPP / "qwen3.gguf"))
    assert scaled.args.rope_freq_scale == 0.5
    half = torch.arange(0, 64, 2)
    assert torch.allclose(scaled.cos[half], plain.cos[half // 2], atol=1e-6)
    assert not torch.allclose(scaled.cos[1:10], plain.cos[1:10])


def test_unsupported_gguf_architecture_is_one_line(tmp_path):
    g = parse(need(LLAMACPP / "qwen2.gguf").read_bytes())
    g.kv("general.architecture").value = "qwen2moe"
    for k in g.kvs:
        k.key = k.key.replace("qwen2.", "qwen2moe.")
    p = tmp_path / "moe.gguf"
    p.write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match=f"{re.escape(str(p))}: GGUF architecture 'qwen2moe' is not supported"):
        Transformer(open_gguf(p))


def test_qwen_sliding_window_layers_are_refused(tmp_path):
    d = MODERN_BUILDERS["qwen2"](tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PowerInferError, match="use_sliding_window true"):
        convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)


def test_relu_llama_is_still_the_relu_record_and_llama_gguf_arch_reads_with_it(tmp_path):
    """A ReLU LlamaForCausalLM stays on the ReLU-Llama record (upstream's file: output copied when
    tied), and GGUF ``llama`` files are read with it; a SiLU one is Llama 3's."""
    from family_models import make_relu_llama
    from powerinfer.families import family_for_gguf_arch

    assert resolve_model(make_relu_llama(tmp_path / "relu"))[0].name == "llama"
    assert family_for_gguf_arch("llama").name == "llama"


@pytest.mark.parametrize("key, vtype, value, msg", [
    ("llama.attention.key_length", 4, 0, "llama.attention.key_length"),
    ("llama.attention.value_length", 4, 1 << 21, "llama.attention.value_length"),
    ("llama.rope.scaling.factor", F32, -2.0, "llama.rope.scaling.factor"),
    ("llama.rope.scaling.type", 4, 3, "llama.rope.scaling.type"),
])
def test_head_and_rope_keys_are_validated_at_open(tmp_path, key, vtype, value, msg):
    """Out-of-range head sizes, a negative scaling factor or a non-string scaling type: one line
    naming the file and the key when the file is opened, before anything is read from it."""
    g = parse(need(LLAMACPP / "llama3.gguf").read_bytes())
    g.kvs = [k for k in g.kvs if k.key != key] + [KV(key, vtype, value)]
    p = tmp_path / "bad.gguf"
    p.write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match=f"{re.escape(str(p))}: metadata {re.escape(msg)}"):
        open_gguf(p)


def test_value_length_other_than_key_length_is_refused(tmp_path):
    g = parse(need(LLAMACPP / "llama3.gguf").read_bytes())
    g.kv("llama.attention.value_length").value = 32
    p = tmp_path / "kv.gguf"
    p.write_bytes(serialize(g))
    with pytest.raises(PowerInferError, match=f"{re.escape(str(p))}: llama.attention.value_length 32 != key_length 16"):
        Transformer(open_gguf(p))

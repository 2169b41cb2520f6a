"""pi-profile: activation counts are the hand-computed ones, files follow FORMATS.md section 2."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from powerinfer.data import calibration_batches
from powerinfer.families import RELU_LLAMA, Activation
from powerinfer.formats.activation import STATS_FILE
from powerinfer.hf import load_hf_model, load_hf_tokenizer
from powerinfer.profile.cli import main as profile_main
from powerinfer.profile.collect import activation_stats, count_active_neurons

from helpers import make_tiny_llama, story_text


# --------------------------------------------------------------------------- a Llama by hand
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta):
    # x: [B, H, T, hd], HF rotate-half layout
    hd, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)  # [T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def hand_gate_preacts(model, ids):
    """Per layer, gate(ffn_norm(h)) ``[B, T, n_ff]`` in float64, computed without transformers' forward."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    n_head, n_kv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    theta = cfg.rope_parameters["rope_theta"]
    h = sd["model.embed_tokens.weight"][ids]  # [B, T, n_embd]
    B, T, D = h.shape
    hd = D // n_head
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = _rms(h, sd[p + "input_layernorm.weight"], eps)
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, n_head, hd).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, n_kv, hd).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, n_kv, hd).transpose(1, 2)
        q, k = _rope(q, theta), _rope(k, theta)
        k, v = k.repeat_interleave(n_head // n_kv, 1), v.repeat_interleave(n_head // n_kv, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        a = (att @ v).transpose(1, 2).reshape(B, T, D) @ sd[p + "self_attn.o_proj.weight"].T
        h = h + a
        x = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        out.append(gate)
        h = h + (torch.relu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return out


def hand_counts(model, batches):
    counts = None
    for ids in batches:
        gates = hand_gate_preacts(model, ids)
        # the comparison is exact only if no pre-activation sits within float error of 0
        assert min(g.abs().min().item() for g in gates) > 1e-5
        c = [(g > 0).reshape(-1, g.shape[-1]).sum(0) for g in gates]
        counts = c if counts is None else [a + b for a, b in zip(counts, c)]
    return counts


@pytest.fixture(scope="module")
def tiny_relu(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", n_layer=3, seed=1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "calib.txt"
    p.write_text(story_text(3000))
    return p


# --------------------------------------------------------------------------- counts
def test_counts_equal_hand_computed_counts(tiny_relu):
    model = load_hf_model(tiny_relu)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 512, (2, 16), generator=g) for _ in range(3)]
    counts, n_tokens = count_active_neurons(model, RELU_LLAMA, Activation("relu"), batches)
    want = hand_counts(model, batches)
    assert n_tokens == 96
    assert len(counts) == 3
    for got, exp in zip(counts, want):
        assert got.dtype == torch.int64 and got.shape == (48,)
        assert torch.equal(got, exp)
    assert 0 < sum(int(c.sum()) for c in counts) < 3 * 96 * 48  # neither all off nor all on


def test_padding_tokens_are_not_counted(tiny_relu):
    model = load_hf_model(tiny_relu)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (1, 12), generator=g)
    alone, n_alone = count_active_neurons(model, RELU_LLAMA, Activation("relu"), [ids])
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1)  # right padding
    attn = torch.cat([torch.ones(1, 12), torch.zeros(1, 5)], 1).long()
    with_pad, n_pad = count_active_neurons(model, RELU_LLAMA, Activation("relu"), [(padded, attn)])
    assert n_alone == n_pad == 12
    for a, b in zip(alone, with_pad):
        assert torch.equal(a, b)


def test_stats_values():
    counts = [torch.tensor([10, 0, 5, 5, 0, 0, 0, 0, 0, 0], dtype=torch.int64)]
    st = activation_stats(counts, n_tokens=10)["layers"][0]
    assert st["active_share"] == pytest.approx(20 / 100)
    assert st["sparsity"] == pytest.approx(0.8)
    assert st["top10_coverage"] == pytest.approx(10 / 20)  # 1 hottest neuron of 10
    assert st["top20_coverage"] == pytest.approx(15 / 20)
    assert st["dead_neurons"] == 7
    # log(count) vs log(rank) over 10, 5, 5 -> least-squares slope
    x = torch.log(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    y = torch.log(torch.tensor([10.0, 5.0, 5.0], dtype=torch.float64))
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert st["powerlaw_slope"] == pytest.approx(slope.item())


# --------------------------------------------------------------------------- files via the CLI
def test_cli_writes_plain_1d_int_tensors_and_stats(tiny_relu, text_file, tmp_path):
    out = tmp_path / "act"
    r = CliRunner().invoke(profile_main, [str(tiny_relu), "--data", str(text_file), "--out", str(out),
                                          "--max-tokens", "200", "--seq-len", "32", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    assert "sparsity" in r.output and "top10%" in r.output
    for i in range(3):
        t = torch.load(out / f"activation_{i}.pt", weights_only=True)
        assert isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 48 and t.dtype == torch.int64
        assert 0 <= int(t.min()) and int(t.max()) <= 200
    stats = json.loads((out / STATS_FILE).read_text())
    assert stats["n_tokens"] == 200
    assert [l["layer"] for l in stats["layers"]] == [0, 1, 2]
    assert sorted(p.name for p in out.iterdir()) == [f"activation_{i}.pt" for i in range(3)] + [STATS_FILE, "report.png"]


def test_layer_10_file_holds_layer_10_counts(tmp_path, text_file):
    model_dir = make_tiny_llama(tmp_path / "m11", n_layer=11, n_embd=16, n_ff=24, n_head=2, n_head_kv=1, seed=3)
    out = tmp_path / "act"
    args = dict(max_tokens=96, seq_len=24, batch_size=2)
    # f32: the reference below is an f32 forward, exact only to 1e-5 of each pre-activation (bf16, the
    # default on a CPU with AVX512_BF16, moves a few near-zero ones across 0)
    r = CliRunner().invoke(profile_main, [str(model_dir), "--data", str(text_file), "--out", str(out),
                                          "--max-tokens", "96", "--seq-len", "24", "--batch-size", "2",
                                          "--dtype", "f32"])
    assert r.exit_code == 0, r.output
    batches = list(calibration_batches(text_file, load_hf_tokenizer(model_dir), args["max_tokens"],
                                       args["seq_len"], args["batch_size"]))
    want = hand_counts(load_hf_model(model_dir), batches)
    files = [torch.load(out / f"activation_{i}.pt", weights_only=True) for i in range(11)]
    # the layers' counts are all different, so a mix-up (activation_10 <- layer 1 or 2) would show
    assert len({tuple(c.tolist()) for c in want}) == 11
    for i in range(11):
        assert torch.equal(files[i], want[i]), f"activation_{i}.pt does not hold layer {i}"


def test_cli_dense_silu_model_gets_input_histograms(tmp_path, text_file):
    """A SiLU model has no neurons to count: pi-profile writes the input histograms (tests/test_teal_calibrate.py
    checks their values) and no activation counts."""
    model_dir = make_tiny_llama(tmp_path / "silu", n_layer=1, hidden_act="silu")
    out = tmp_path / "act"
    r = CliRunner().invoke(profile_main, [str(model_dir), "--data", str(text_file), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["input_hist.json", "input_hist_0.pt", "wina_hist_0.pt"]


def test_cli_refuses_a_relu_gguf(tmp_path, text_file, tiny_relu):
    """A GGUF is profiled through the runtime for input sparsity only: a ReLU one is refused in one line."""
    from powerinfer.convert.writer import convert

    f = convert(tiny_relu, tmp_path / "relu.gguf", outtype="f32", progress=False)
    r = CliRunner().invoke(profile_main, [str(f), "--data", str(text_file), "--out", str(tmp_path / "act")])
    assert r.exit_code == 1 and "SiLU/GELU-gated" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "act").exists()


def test_cli_missing_model_dir(tmp_path, text_file):
    missing = tmp_path / "no-such-model"
    r = CliRunner().invoke(profile_main, [str(missing), "--data", str(text_file), "--out", str(tmp_path / "a")])
    assert r.exit_code == 1
    assert f"{missing}: model folder not found" in r.output
    assert not (tmp_path / "a").exists()


def test_cli_missing_data_file(tiny_relu, tmp_path):
    missing = tmp_path / "nope.txt"
    r = CliRunner().invoke(profile_main, [str(tiny_relu), "--data", str(missing), "--out", str(tmp_path / "a")])
    assert r.exit_code == 1
    assert f"{missing}: data file not found" in r.output
    assert not (tmp_path / "a").exists()


def test_cli_empty_data_file(tiny_relu, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    r = CliRunner().invoke(profile_main, [str(tiny_relu), "--data", str(empty), "--out", str(tmp_path / "a")])
    assert r.exit_code == 1
    assert "no text" in r.output and str(empty) in r.output

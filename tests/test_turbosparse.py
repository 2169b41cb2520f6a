"""TurboSparse-Mistral converted as published: its own predictors, no predictor folder.

The model is a tiny random one in the published checkpoint's layout (``family_models.
make_turbosparse_mistral``: config keys, bf16 shards with an index, ``mlp.predictor.fc1/fc2``
per layer). transformers has no TurboSparse class, so the reference forward is our Bamboo
class (dReLU, Mistral body) with the published predictor rule applied by hooks written here
from the model card's facts: the predictor reads the residual before
``post_attention_layernorm`` and neuron j is kept where ``round(sigmoid(fc2(relu(fc1 x))))_j``
is 1.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from powerinfer.convert.cli import main as convert_main
from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf, read_magic
from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir
from powerinfer.hf import load_hf_model, load_hf_tokenizer
from powerinfer.runtime.cli import main as run_main
from powerinfer.runtime.model import Transformer

from family_models import N_LAYER, TURBOSPARSE_HIDDEN, make_turbosparse_mistral
from helpers import TEXT, need, story_text
from test_families import N_PREFILL, N_TOKENS, teacher_forced, upstream_tensors

N_EMBD, N_FF = 64, 96


def checkpoint(d) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def reference_logits(d, ids: list[int], masked: bool = True) -> torch.Tensor:
    """Logits ``[T, V]`` of the checkpoint in f32, with TurboSparse's predictor masks when ``masked``."""
    hf = load_hf_model(d)
    sd = checkpoint(d)
    handles = []
    for i, layer in enumerate(hf.model.layers):
        fc1 = sd[f"model.layers.{i}.mlp.predictor.fc1.weight"].float()
        fc2 = sd[f"model.layers.{i}.mlp.predictor.fc2.weight"].float()
        seen: dict[str, torch.Tensor] = {}
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, args, s=seen: s.__setitem__("x", args[0])))  # the residual before the FFN norm

        def keep(m, args, s=seen, fc1=fc1, fc2=fc2):
            return (args[0] * torch.round(torch.sigmoid(torch.relu(s["x"] @ fc1.T) @ fc2.T)),)

        if masked:
            handles.append(layer.mlp.down_proj.register_forward_pre_hook(keep))
    with torch.no_grad():
        out = hf(torch.tensor([ids])).logits[0]
    for h in handles:
        h.remove()
    return out


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("turbosparse")
    d = make_turbosparse_mistral(tmp / "hf")
    ids = load_hf_tokenizer(d)(story_text(600), add_special_tokens=False).input_ids[:N_TOKENS]
    assert len(ids) == N_TOKENS
    return SimpleNamespace(dir=d, tmp=tmp, ids=ids, sd=checkpoint(d),
                           f32=convert(d, tmp / "m.powerinfer.gguf", outtype="f32", progress=False),
                           f16=convert(d, tmp / "m16.powerinfer.gguf", progress=False))


# --------------------------------------------------------------------------- the file
def test_published_layout_converts_to_upstreams_bamboo_tensor_set(ts):
    assert json.loads((ts.dir / "config.json").read_text())["architectures"] == ["BambooForCausalLM"]
    assert (ts.dir / "model.safetensors.index.json").is_file() and not list(ts.dir.glob("model_*.pt"))
    for path in (ts.f32, ts.f16):
        g = open_gguf(path)
        assert read_magic(path) == b"PWRI" and g.arch == "bamboo" and g.sparse
        names = [t.name for t in g.reader.tensors]
        want = upstream_tensors("bamboo", N_LAYER, sparse=True)
        assert len(names) == len(want) and set(names) == set(want)
        assert g.get("powerinfer.sparse_threshold") == 0.0
        assert g.get("powerinfer.activation") == "relu"
    for t in open_gguf(ts.f16).reader.tensors:  # what upstream computes with: 2-D f16, 1-D f32
        assert t.tensor_type.name == ("F16" if len(t.shape) == 2 else "F32"), t.name


@pytest.mark.parametrize("which", ["f32", "f16"])
def test_predictor_tensors_equal_the_checkpoints(ts, which):
    g = open_gguf(getattr(ts, which)).tensors
    dtype = {"f32": torch.float32, "f16": torch.float16}[which]
    for i, h in enumerate(TURBOSPARSE_HIDDEN):
        for part, shape in (("fc1", (h, N_EMBD)), ("fc2", (N_FF, h))):
            t = g[f"blk.{i}.{part}.weight"]
            assert tuple(int(n) for n in t.shape) == shape[::-1]  # GGUF ne: torch [rows, cols] reversed
            ours = torch.from_numpy(np.array(t.data)).reshape(shape)
            want = ts.sd[f"model.layers.{i}.mlp.predictor.{part}.weight"].to(dtype)
            assert ours.dtype == dtype and torch.equal(ours, want), f"layer {i} {part}"


# --------------------------------------------------------------------------- pi-run vs the reference
def test_pi_run_logits_equal_the_reference_with_turbosparse_masks(ts):
    masked = reference_logits(ts.dir, ts.ids)
    dense = reference_logits(ts.dir, ts.ids, masked=False)
    assert (masked - dense).abs().max().item() > 1e-1  # the predictor really removes neurons that fire
    m = Transformer(open_gguf(ts.f32))
    got = teacher_forced(m, ts.ids, N_PREFILL)
    err = (got - masked).abs().max().item()
    assert err <= 1e-4, f"max |pi-run - masked reference| = {err:.2e}"
    assert 0.2 < m.active_share() < 0.8  # about half the neurons predicted active (random predictors)


def test_pi_run_cli_generates_sparse_from_the_file(ts):
    r = CliRunner().invoke(run_main, ["-m", str(ts.f16), "-n", "6", "--temp", "0", "-p", "Once upon"])
    assert r.exit_code == 0, r.output
    assert "(bamboo, sparse" in r.output and "FFN neurons computed" in r.output


def test_pi_convert_cli_needs_no_predictor_folder(ts, tmp_path):
    out = tmp_path / "c.powerinfer.gguf"
    r = CliRunner().invoke(convert_main, [str(ts.dir), "--outfile", str(out), "--for-pi-run"])
    assert r.exit_code == 0, r.output
    assert "the checkpoint's own predictors" in r.output and read_magic(out) == b"PWRI"


def test_dense_flag_writes_the_unmasked_model(ts, tmp_path):
    out = tmp_path / "d.gguf"
    r = CliRunner().invoke(convert_main, [str(ts.dir), "--outfile", str(out), "--outtype", "f32", "--dense"])
    assert r.exit_code == 0, r.output
    g = open_gguf(out)
    assert read_magic(out) == b"GGUF" and not any(".fc1." in t.name for t in g.reader.tensors)
    got = teacher_forced(Transformer(g), ts.ids, N_PREFILL)
    assert (got - reference_logits(ts.dir, ts.ids, masked=False)).abs().max().item() <= 1e-4


def test_a_predictor_folder_replaces_the_checkpoints_own(ts, tmp_path):
    g = torch.Generator().manual_seed(9)
    layers = [LayerPredictor(torch.randn(8, N_EMBD, generator=g), torch.randn(N_FF, 8, generator=g))
              for _ in range(N_LAYER)]
    pred = save_predictor_dir(tmp_path / "pred", layers, {"sparse_threshold": 0.5})
    f = open_gguf(convert(ts.dir, tmp_path / "p.powerinfer.gguf", pred, outtype="f32", progress=False))
    assert f.get("powerinfer.sparse_threshold") == 0.5
    for i, lp in enumerate(layers):
        assert torch.equal(torch.from_numpy(np.array(f.tensors[f"blk.{i}.fc1.weight"].data)).reshape(8, N_EMBD), lp.fc1)


# --------------------------------------------------------------------------- placement
def test_vram_budget_needs_counts_and_takes_pi_profiles(ts, tmp_path):
    from powerinfer.profile.collect import profile_model_dir

    out = tmp_path / "v.powerinfer.gguf"
    r = CliRunner().invoke(convert_main, [str(ts.dir), "--outfile", str(out), "--vram-budget", "1"])
    assert r.exit_code == 1 and "pi-profile" in r.output and "--activation" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
    act = tmp_path / "act"
    profile_model_dir(ts.dir, need(TEXT / "tinystories_val.txt"), act, max_tokens=128, seq_len=64, batch_size=2)
    r = CliRunner().invoke(convert_main, [str(ts.dir), "--outfile", str(out), "--vram-budget", "0.01",
                                          "--activation", str(act), "--for-pi-run"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "v.powerinfer.gguf.generated.gpuidx").is_file()


# --------------------------------------------------------------------------- bad input
def _edit(ts, tmp_path, change):
    """A copy of the model folder whose second shard went through ``change(state_dict)``."""
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(ts.dir, d)
    f = d / "model-00002-of-00002.safetensors"
    sd = load_file(f)
    change(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("change, words", [
    (lambda sd: sd.__setitem__("model.layers.1.mlp.predictor.fc1.weight", torch.zeros(24, N_EMBD - 1)),
     ["model-00002-of-00002.safetensors", "'model.layers.1.mlp.predictor.fc1.weight'", "[24, 63]", "n_embd=64"]),
    (lambda sd: sd.__setitem__("model.layers.2.mlp.predictor.fc2.weight", torch.zeros(N_FF, 11)),
     ["model-00002-of-00002.safetensors", "'model.layers.2.mlp.predictor.fc2.weight'", "[96, 11]", "n_ff=96, H=12"]),
    (lambda sd: sd.pop("model.layers.2.mlp.predictor.fc2.weight"),
     ["bad: the checkpoint has no tensor 'model.layers.2.mlp.predictor.fc2.weight'", "every layer needs"]),
    (lambda sd: sd.__setitem__("model.layers.1.mlp.predictor.fc1.bias", torch.zeros(24)),
     ["model-00002-of-00002.safetensors", "'model.layers.1.mlp.predictor.fc1.bias'", "no biases"]),
])
def test_bad_predictor_is_one_line_naming_the_tensor_before_writing(ts, tmp_path, change, words):
    d = _edit(ts, tmp_path, change)
    out = tmp_path / "o.powerinfer.gguf"
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(out)])
    assert r.exit_code == 1
    assert len(r.output.strip().splitlines()) == 1, r.output
    for w in words:
        assert w in r.output, r.output
    assert not out.exists() and not list(tmp_path.glob(".o.powerinfer.gguf*"))


def test_dense_and_a_predictor_folder_together_are_refused(ts, tmp_path):
    r = CliRunner().invoke(convert_main, [str(ts.dir), str(tmp_path), "--outfile", str(tmp_path / "x.gguf"),
                                          "--dense"])
    assert r.exit_code == 1 and "not both" in r.output

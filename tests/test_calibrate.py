"""The layer-streamed calibration pass: same counts and rows as a whole-model forward, bounded
by one layer, resumable at the layer it was killed in, identical under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import powerinfer.calibrate.stream as stream_mod
from powerinfer.calibrate.checkpoint import CheckpointReader
from powerinfer.calibrate.hooks import ActiveNeuronHooks
from powerinfer.calibrate.plan import build_plan
from powerinfer.calibrate.stream import stream_calibration
from powerinfer.errors import PowerInferError
from powerinfer.families import get_attr, model_layers
from powerinfer.formats.activation import load_activation_dir
from powerinfer.formats.collected import pack_mask, unpack_mask, unpack_mask_torch
from powerinfer.hardware import cpu_has_bf16
from powerinfer.hf import load_hf_model, load_hf_tokenizer, resolve_model
from powerinfer.profile.cli import main as profile_main
from powerinfer.profile.collect import count_active_neurons, forward_layers, profile_model_dir

from family_models import BUILDERS
from helpers import ROOT, make_tiny_llama, story_text

DEMO = ROOT / "powerinfer" / "assets" / "stories260K-relu"
DEMO_TEXT = ROOT / "powerinfer" / "assets" / "calibration.txt"


def whole_model_pairs(model, family, act, batches):
    """Reference: per layer, (predictor inputs, masks) from hooks on the whole model, in batch order."""
    xs: dict[int, list[torch.Tensor]] = {}
    ms: dict[int, list[torch.Tensor]] = {}
    pending: dict[int, torch.Tensor] = {}
    handles = []

    def grab(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            pending[i] = h.reshape(-1, h.shape[-1])
        return hook

    for i, layer in enumerate(model_layers(family, model)):
        mod = layer if family.predictor_input_attr is None else get_attr(layer, family.predictor_input_attr)
        handles.append(mod.register_forward_pre_hook(grab(i), with_kwargs=True))

    def on_mask(i, mask):
        xs.setdefault(i, []).append(pending.pop(i).to(torch.float16))
        ms.setdefault(i, []).append(mask)

    with ActiveNeuronHooks(model, family, act, on_mask):
        for ids in batches:
            forward_layers(model, ids)
    for h in handles:
        h.remove()
    return {i: (torch.cat(xs[i]), torch.cat(ms[i])) for i in xs}


def dies_at(layer_index, exc):
    """A stand-in for the pass's per-layer step that raises ``exc`` when it reaches ``layer_index``."""
    real = stream_mod._run_layer

    def run(stack, layer, i, *a, **k):
        if i == layer_index:
            raise exc()
        return real(stack, layer, i, *a, **k)

    return run


def _stream(model_dir, data, tmp, caps, seq_len=32, batch=3, pairs=False, **kw):
    family, cfg, act = resolve_model(model_dir)
    plan = build_plan(str(data), load_hf_tokenizer(model_dir), caps, seq_len, batch)
    res = stream_calibration(model_dir, family, act, plan, tmp, {"test": 1}, pairs=pairs, **kw)
    return family, act, plan, res


# --------------------------------------------------------------------------- equality with the whole model
@pytest.mark.parametrize("name", ["demo"] + list(BUILDERS))
def test_streamed_counts_and_rows_equal_the_whole_model_pass(name, tmp_path):
    model_dir = DEMO if name == "demo" else BUILDERS[name](tmp_path / "hf")
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(story_text(6000).split("\n\n")[:40]))
    family, act, plan, res = _stream(model_dir, text, tmp_path / "work", {"train": 300, "heldout": 100}, pairs=True)
    assert res.n_tokens == {"train": 300, "heldout": 100}
    model = load_hf_model(model_dir)  # float32, the whole model
    for split in ("train", "heldout"):
        batches = [b.ids for b in plan.batches if b.split == split]
        want, n = count_active_neurons(model, family, act, batches)
        assert n == res.n_tokens[split]
        for i, c in enumerate(res.counts[split]):
            assert torch.equal(c, want[i]), f"{name} {split} layer {i}"
        pairs = whole_model_pairs(model, family, act, batches)
        for i in range(res.n_layer):
            x, m = pairs[i]
            assert np.array_equal(np.asarray(res.collected.inputs(split, i)), x.numpy()), f"{name} layer {i} inputs"
            got = unpack_mask(np.asarray(res.collected.masks(split, i)), res.n_ff).astype(bool)
            assert np.array_equal(got, m.numpy()), f"{name} layer {i} masks"
    assert 0 < sum(int(c.sum()) for c in res.all_counts()) < 400 * res.n_layer * res.n_ff
    assert not list((tmp_path / "work" / "stream").rglob("hidden_*.bin"))  # GB-sized at scale: removed


def test_mask_packing_is_numpys_little_bit_order():
    m = torch.from_numpy(np.random.default_rng(0).random((5, 21)) > 0.5)
    packed = pack_mask(m)
    assert np.array_equal(packed.numpy(), np.packbits(m.numpy(), axis=1, bitorder="little"))
    assert torch.equal(unpack_mask_torch(packed, 21), m)


# --------------------------------------------------------------------------- checkpoints
def _bin_shards(src: Path, out: Path, n: int) -> None:
    """The older transformers layout: ``pytorch_model-0000k-of-0000n.bin`` + ``pytorch_model.bin.index.json``."""
    from safetensors.torch import load_file

    sd = load_file(src / "model.safetensors")
    out.mkdir()
    names = sorted(sd)
    weight_map = {}
    for k in range(n):
        part = names[k::n]
        fname = f"pytorch_model-{k + 1:05d}-of-{n:05d}.bin"
        torch.save({name: sd[name] for name in part}, out / fname)
        weight_map.update({name: fname for name in part})
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        (out / f).write_bytes((src / f).read_bytes())


def test_bin_shards_and_safetensors_shards_give_the_same_counts(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "st", n_layer=3, seed=3)
    _bin_shards(src, tmp_path / "bin", 3)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for f in ("tokenizer.model", "tokenizer_config.json"):
        (tmp_path / "sharded" / f).write_bytes((src / f).read_bytes())
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    assert CheckpointReader(tmp_path / "bin", "model").kind == "bin"
    text = tmp_path / "t.txt"
    text.write_text(story_text(3000))
    ref = _stream(src, text, tmp_path / "w0", {"all": 200})[3]
    for d in ("bin", "sharded"):
        got = _stream(tmp_path / d, text, tmp_path / f"w-{d}", {"all": 200})[3]
        assert all(torch.equal(a, b) for a, b in zip(ref.all_counts(), got.all_counts())), d


def test_reader_refuses_index_pointing_outside_the_folder(tmp_path):
    d = make_tiny_llama(tmp_path / "m", n_layer=1)
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "../../etc/passwd"}}))
    with pytest.raises(PowerInferError, match="outside the model folder"):
        CheckpointReader(d, "model")


def _profile_edited(tmp_path, edit, seed=0):
    """pi-profile on a tiny model whose state dict ``edit`` changed; returns the CLI result."""
    from safetensors.torch import load_file, save_file

    d = make_tiny_llama(tmp_path / "m", n_layer=3, seed=seed)
    sd = load_file(d / "model.safetensors")
    edit(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    r = CliRunner().invoke(profile_main, [str(d), "--data", str(text), "--out", str(tmp_path / "a"),
                                          "--max-tokens", "64"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert not (tmp_path / "a").exists()
    return r


def test_missing_layer_tensor_is_a_clear_error(tmp_path):
    r = _profile_edited(tmp_path, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    assert "model.layers.1.mlp.up_proj.weight" in r.output


# --------------------------------------------------------------------------- memory: one layer at a time
def test_at_most_one_decoder_layer_is_materialised_at_a_time(tmp_path, monkeypatch):
    d = make_tiny_llama(tmp_path / "m", n_layer=4, seed=2)
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    real_run = stream_mod._run_layer
    live = []

    def spy(stack, layer, i, *a, **k):
        live.append([j for j, l in enumerate(stack.layers) if not next(l.parameters()).is_meta])
        return real_run(stack, layer, i, *a, **k)

    monkeypatch.setattr(stream_mod, "_run_layer", spy)
    _stream(d, text, tmp_path / "w", {"all": 100})
    assert live == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------- resuming
def test_killed_profile_resumes_at_its_layer_and_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    d = make_tiny_llama(tmp_path / "m", n_layer=4, seed=4)
    text = tmp_path / "t.txt"
    text.write_text(story_text(3000))
    kw = dict(max_tokens=256, seq_len=32, batch_size=2)
    profile_model_dir(d, text, tmp_path / "ref", **kw)
    ref = load_activation_dir(tmp_path / "ref")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "activation_0.pt").write_bytes((tmp_path / "ref" / "activation_0.pt").read_bytes())
    before = (tmp_path / "out" / "activation_0.pt").read_bytes()
    real_run, ran = stream_mod._run_layer, []

    def dies_in_layer_2(stack, layer, i, *a, **k):
        ran.append(i)
        if i == 2:
            raise KeyboardInterrupt  # killed while layer 2's outputs were being written
        return real_run(stack, layer, i, *a, **k)

    monkeypatch.setattr(stream_mod, "_run_layer", dies_in_layer_2)
    with pytest.raises(KeyboardInterrupt):
        profile_model_dir(d, text, tmp_path / "out", **kw)
    assert ran == [0, 1, 2]
    assert (tmp_path / "out" / "activation_0.pt").read_bytes() == before  # the earlier output is untouched

    ran.clear()
    monkeypatch.setattr(stream_mod, "_run_layer", lambda *a, **k: (ran.append(a[2]), real_run(*a, **k))[1])
    monkeypatch.setattr(stream_mod.LayerStack, "layer_inputs", lambda *a, **k: pytest.fail("re-embedded"))
    stats = profile_model_dir(d, text, tmp_path / "out", **kw)
    assert ran == [2, 3]  # layers 0 and 1 were not recomputed
    assert stats["stream"]["resumed_at_layer"] == 2
    got = load_activation_dir(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not (tmp_path / "out-work").exists()  # cleaned up after success


@pytest.mark.parametrize("change", ["settings", "hidden_files_gone"])
def test_a_half_done_pass_that_cannot_be_reused_starts_over(change, tmp_path, monkeypatch):
    """Other settings (a different key), or a state whose hidden-state files were deleted (a
    cleaned-up /tmp): the rerun starts at layer 1 and ends equal to a fresh run."""
    d = make_tiny_llama(tmp_path / "m", n_layer=3, seed=5)
    text = tmp_path / "t.txt"
    text.write_text(story_text(3000))
    kw = dict(seq_len=32, batch_size=2)
    monkeypatch.setattr(stream_mod, "_run_layer", dies_at(1, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        profile_model_dir(d, text, tmp_path / "a", max_tokens=128, **kw)
    monkeypatch.undo()
    if change == "hidden_files_gone":
        for h in (tmp_path / "a-work").rglob("hidden_*.bin"):
            h.unlink()
    tokens = 96 if change == "settings" else 128
    stats = profile_model_dir(d, text, tmp_path / "a", max_tokens=tokens, **kw)
    assert stats["stream"]["resumed_at_layer"] == 0 and stats["n_tokens"] == tokens
    profile_model_dir(d, text, tmp_path / "b", max_tokens=tokens, **kw)
    assert all(torch.equal(x, y) for x, y in zip(load_activation_dir(tmp_path / "a"), load_activation_dir(tmp_path / "b")))


# --------------------------------------------------------------------------- progress and options
def test_progress_is_one_line_per_layer_without_a_terminal(tmp_path):
    d = make_tiny_llama(tmp_path / "m", n_layer=3, seed=6)
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    r = CliRunner().invoke(profile_main, [str(d), "--data", str(text), "--out", str(tmp_path / "a"),
                                          "--max-tokens", "100", "--seq-len", "20"])
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if l.startswith("layer ") and "tok/s" in l]
    assert [l.split(":")[0] for l in lines] == ["layer 1/3", "layer 2/3", "layer 3/3"]
    assert all("100 tokens" in l for l in lines)
    assert "\r" not in r.output
    stats = json.loads((tmp_path / "a" / "powerinfer_stats.json").read_text())
    # no --dtype: the CPU's default, bf16 where it has bf16 dot products (AVX512_BF16, AMX), else f32
    want_dtype = "bf16" if cpu_has_bf16() else "f32"
    assert len(stats["stream"]["layer_seconds"]) == 3 and stats["stream"]["dtype"] == want_dtype


def test_device_and_dtype_errors_are_one_line(tmp_path):
    d = make_tiny_llama(tmp_path / "m", n_layer=1)
    text = tmp_path / "t.txt"
    text.write_text(story_text(500))
    base = [str(d), "--data", str(text), "--out", str(tmp_path / "a")]
    if not torch.cuda.is_available():
        r = CliRunner().invoke(profile_main, base + ["--device", "cuda"])
        assert r.exit_code == 1 and "no CUDA GPU" in r.output
    r = CliRunner().invoke(profile_main, base + ["--device", "tpu:0"])
    assert r.exit_code == 1 and "--device" in r.output
    r = CliRunner().invoke(profile_main, base + ["--dtype", "f16"])
    assert r.exit_code == 1 and "f16" in r.output
    assert not (tmp_path / "a").exists()


def test_bf16_counts_stay_close_to_f32_on_the_demo_model(tmp_path):
    """The measurement behind the dtype defaults: bf16 flips well under 1% of activation decisions."""
    _, _, _, f32 = _stream(DEMO, DEMO_TEXT, tmp_path / "a", {"all": 2048}, seq_len=128, batch=4)
    _, _, _, bf16 = _stream(DEMO, DEMO_TEXT, tmp_path / "b", {"all": 2048}, seq_len=128, batch=4,
                            dtype=torch.bfloat16)
    for a, b in zip(f32.all_counts(), bf16.all_counts()):
        rel = (a - b).abs().sum().item() / a.sum().item()
        assert 0 < rel < 0.01  # differs (bf16 is not f32) but by little (0.37% measured)
        assert abs(a.sum().item() - b.sum().item()) / a.sum().item() < 0.005


# --------------------------------------------------------------------------- torchrun
def _torchrun(args, nproc, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m"] + args
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_two_gloo_processes_give_the_one_process_results(tmp_path):
    """pi-profile and pi-train-predictor under torchrun with two gloo processes write what one
    plain process writes (the plain runs are in this process: 2 of the 4 interpreter starts saved)."""
    from powerinfer.train_predictor.cli import main as train_main

    d = make_tiny_llama(tmp_path / "m", n_layer=2, seed=7)
    text = tmp_path / "t.txt"
    text.write_text(story_text(8000))
    common = ["--data", str(text), "--seq-len", "32", "--forward-batch", "2", "--threads", "1"]
    prof = [str(d), "--max-tokens", "300"] + common
    pred = [str(d), "--max-tokens", "512", "--heldout-tokens", "128", "--epochs", "3", "--hidden", "16",
            "--batch-size", "128"] + common
    threads = torch.get_num_threads()
    try:
        r = CliRunner().invoke(profile_main, prof + ["--out", str(tmp_path / "act1")])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(train_main, pred + ["--out", str(tmp_path / "pred1"), "--activation-out",
                                                   str(tmp_path / "pa1")])
        assert r.exit_code == 0, r.output
    finally:
        torch.set_num_threads(threads)
    r = _torchrun(["powerinfer.profile.cli"] + prof + ["--out", str(tmp_path / "act2")], 2, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(["powerinfer.train_predictor.cli"] + pred + ["--out", str(tmp_path / "pred2"), "--activation-out",
                                                              str(tmp_path / "pa2")], 2, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for a, b in zip(load_activation_dir(tmp_path / "act1"), load_activation_dir(tmp_path / "act2")):
        assert torch.equal(a, b)
    for a, b in zip(load_activation_dir(tmp_path / "pa1"), load_activation_dir(tmp_path / "pa2")):
        assert torch.equal(a, b)
    s2 = json.loads((tmp_path / "act2" / "powerinfer_stats.json").read_text())
    assert s2["settings"]["world_size"] == 2 and s2["n_tokens"] == 300
    for i in range(2):
        w1 = torch.load(tmp_path / "pred1" / f"model_{i}.pt", weights_only=True)
        w2 = torch.load(tmp_path / "pred2" / f"model_{i}.pt", weights_only=True)
        assert all(torch.equal(w1[k], w2[k]) for k in w1)
    c1 = json.loads((tmp_path / "pred1" / "config.json").read_text())
    c2 = json.loads((tmp_path / "pred2" / "config.json").read_text())
    assert [l["recall"] for l in c1["layers"]] == [l["recall"] for l in c2["layers"]]
    assert c2["settings"]["world_size"] == 2


def test_nan_weights_are_named_not_counted(tmp_path):
    def poison(sd):
        sd["model.layers.1.self_attn.v_proj.weight"][0, 0] = float("nan")

    r = _profile_edited(tmp_path, poison, seed=8)
    assert "layer 1: hidden states became NaN or infinite" in r.output


# --------------------------------------------------------------------------- bad input, before any work
def test_hf_cache_layout_with_symlinked_shards_is_read(tmp_path):
    """The HF download cache links every file of snapshots/<rev>/ to ../../blobs/<hash>."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_llama(tmp_path / "src", n_layer=2, seed=10)
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    snap, blobs = tmp_path / "cache" / "snapshots" / "rev", tmp_path / "cache" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for k, f in enumerate(sorted((tmp_path / "sharded").iterdir()) + [src / "tokenizer.model", src / "tokenizer_config.json"]):
        (blobs / f"h{k}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"h{k}")
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    ref = _stream(src, text, tmp_path / "w0", {"all": 100})[3]
    got = _stream(snap, text, tmp_path / "w1", {"all": 100})[3]
    assert all(torch.equal(a, b) for a, b in zip(ref.all_counts(), got.all_counts()))


@pytest.mark.parametrize("case", ["fewer_layers", "more_layers", "no_tokenizer", "overlap", "work_is_file"])
def test_mistakes_are_refused_before_the_pass_and_leave_nothing(case, tmp_path):
    d = make_tiny_llama(tmp_path / "m", n_layer=3, seed=11)
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    out, work = tmp_path / "a", tmp_path / "a-work"
    if case in ("fewer_layers", "more_layers"):
        cfg = json.loads((d / "config.json").read_text())
        cfg["num_hidden_layers"] = 2 if case == "fewer_layers" else 5
        (d / "config.json").write_text(json.dumps(cfg))
        want = f"num_hidden_layers is {cfg['num_hidden_layers']} but the checkpoint holds 3 decoder layers"
    elif case == "no_tokenizer":
        (d / "tokenizer.model").unlink()
        want = "no tokenizer.model, tokenizer.json or vocab.json"
    elif case == "overlap":
        work = out / "w"
        want = "overlap"
    else:
        work = tmp_path / "afile"
        work.write_text("mine")
        want = "is a file"
    r = CliRunner().invoke(profile_main, [str(d), "--data", str(text), "--out", str(out), "--work-dir", str(work),
                                          "--max-tokens", "64"])
    assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, r.output
    assert not out.exists()
    assert case == "work_is_file" or not work.exists()


def test_two_runs_cannot_share_a_work_folder(tmp_path):
    from powerinfer.calibrate.stream import _lock

    (tmp_path / "w" / "stream").mkdir(parents=True)
    held = _lock(tmp_path / "w" / "stream" / "rank0of1.lock")
    d = make_tiny_llama(tmp_path / "m", n_layer=2, seed=12)
    text = tmp_path / "t.txt"
    text.write_text(story_text(2000))
    r = CliRunner().invoke(profile_main, [str(d), "--data", str(text), "--out", str(tmp_path / "a"),
                                          "--work-dir", str(tmp_path / "w"), "--max-tokens", "64"])
    assert r.exit_code == 1 and "another calibration run is using this work folder" in r.output
    held.close()
    r = CliRunner().invoke(profile_main, [str(d), "--data", str(text), "--out", str(tmp_path / "a"),
                                          "--work-dir", str(tmp_path / "w"), "--max-tokens", "64"])
    assert r.exit_code == 0, r.output

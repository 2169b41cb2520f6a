"""GPU index files (powerinfer.formats.gpuidx) and ``python -m powerinfer``."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from powerinfer.convert.placement import solve_placement
from powerinfer.errors import PowerInferError
from powerinfer.formats.gpuidx import (
    GpuIndexMismatch,
    default_index_path,
    model_identity,
    read_gpu_index,
    write_gpu_index,
)

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- raw GGUF walker
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def raw_header(path):
    """Parse a GGUF header by hand: (magic, version, {key: (type, value)}, [(name, dims, type)])."""
    b = Path(path).read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, b, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = b[pos: pos + n].decode()
        pos += n
        return s

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(_SCALARS[t])

    magic, version = b[:4], struct.unpack_from("<I", b, 4)[0]
    pos = 8
    n_t, n_kv = take("<Q"), take("<Q")
    kv = {}
    for _ in range(n_kv):
        k = string()
        t = take("<I")
        kv[k] = (t, value(t))
    tensors = []
    for _ in range(n_t):
        name = string()
        nd = take("<I")
        dims = [take("<Q") for _ in range(nd)]
        tensors.append((name, dims, take("<I")))
        take("<Q")
    return magic, version, kv, tensors


def tiny_model(path, n_ff=16, tag="a"):
    """A small GGUF standing in for a model file."""
    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", tag)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((n_ff, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def masks(n_layer=3, n_ff=16):
    rng = np.random.default_rng(0)
    g = [rng.random(n_ff) < 0.4 for _ in range(n_layer)]
    g[1][:] = False  # an empty bucket
    g[2][:] = True   # a layer wholly on the GPU
    return g


# --------------------------------------------------------------------------- layout
def test_upstream_layout(tmp_path):
    p = write_gpu_index(tmp_path / "m.gguf.generated.gpuidx", masks(), 6 * 2**30, model_id="size=1;sha256=x")
    raw = p.read_bytes()
    assert raw[:4] == b"PWRI" and struct.unpack("<I", raw[4:8])[0] == 3
    magic, version, kv, tensors = raw_header(p)
    assert kv["general.architecture"] == (8, "generic.gpu_index")
    assert kv["generic.gpu_index.block_count"] == (4, 3)        # u32
    assert kv["split.vram_capacity"] == (10, 6 * 2**30)         # u64
    assert kv["powerinfer.gpu_index.n_ff"] == (4, 16)
    assert kv["powerinfer.gpu_index.model_id"] == (8, "size=1;sha256=x")
    names = [t[0] for t in tensors]
    assert names == [f"blk.{i}.{n}" for i in range(3) for n in ("gpu_idx", "gpu_bucket")]
    assert all(t[2] == 18 for t in tensors)                     # upstream's I32
    g = masks()
    for i in range(3):
        assert tensors[2 * i][1] == [16]
        assert tensors[2 * i + 1][1] == [int(g[i].sum())]
    assert tensors[3][1] == [0]                                  # empty bucket: zero-length, as upstream


def test_round_trip_and_type_26(tmp_path):
    g = masks()
    for types in (True, False):
        p = write_gpu_index(tmp_path / f"x{types}.gpuidx", g, 12345, model_id="abc", upstream_types=types)
        ix = read_gpu_index(p, n_layer=3, n_ff=16, model_id="abc", vram_capacity=12345)
        assert ix.raw_types == [18 if types else 26] * 6
        assert [a.tolist() for a in ix.gpu] == [a.tolist() for a in g]
        assert [b.tolist() for b in ix.buckets] == [np.flatnonzero(a).tolist() for a in g]
        assert all(b.dtype == np.int32 for b in ix.buckets)
        assert ix.n_gpu == [int(a.sum()) for a in g] and ix.vram_capacity == 12345


def test_placement_is_written_with_solver_keys(tmp_path):
    rng = np.random.default_rng(1)
    counts = [rng.integers(0, 100, 200) for _ in range(4)]
    pl = solve_placement(counts, 300, chunk=64)
    p = write_gpu_index(tmp_path / "p.gpuidx", pl, 999)
    ix = read_gpu_index(p, n_layer=4, n_ff=200)
    assert [a.tolist() for a in ix.gpu] == [a.tolist() for a in pl.gpu]
    assert ix.meta["powerinfer.gpu_index.chunk"] == 64
    assert ix.meta["powerinfer.gpu_index.neurons"] == pl.used
    assert ix.model_id is None


def test_mismatches_are_rejected(tmp_path):
    p = write_gpu_index(tmp_path / "x.gpuidx", masks(), 1000, model_id="model-a")
    for kw, what in (
        ({"model_id": "model-b"}, "another model"),
        ({"n_layer": 4}, "layers"),
        ({"n_ff": 32}, "n_ff"),
        ({"n_ff": [16, 16, 8]}, "n_ff"),
        ({"vram_capacity": 2000}, "VRAM budget"),
    ):
        with pytest.raises(GpuIndexMismatch, match=what):
            read_gpu_index(p, **kw)
    anon = write_gpu_index(tmp_path / "anon.gpuidx", masks(), 1000)  # like upstream: no identity
    read_gpu_index(anon)
    with pytest.raises(GpuIndexMismatch, match="no model identity"):
        read_gpu_index(anon, model_id="model-a")


def test_wrong_model_file_is_rejected(tmp_path):
    a = tiny_model(tmp_path / "a.gguf", tag="a")
    b = tiny_model(tmp_path / "b.gguf", tag="b")
    assert model_identity(a) == model_identity(a)
    assert model_identity(a) != model_identity(b)
    ix_path = write_gpu_index(default_index_path(a), masks(), 1000, model_id=model_identity(a))
    assert ix_path.name == "a.gguf.generated.gpuidx"
    read_gpu_index(ix_path, model_id=model_identity(a))
    with pytest.raises(GpuIndexMismatch):
        read_gpu_index(ix_path, model_id=model_identity(b))


def test_bad_files(tmp_path):
    with pytest.raises(PowerInferError, match="not found"):
        read_gpu_index(tmp_path / "none.gpuidx")
    model = tiny_model(tmp_path / "m.gguf")
    with pytest.raises(PowerInferError, match="not a GPU index"):
        read_gpu_index(model)
    p = write_gpu_index(tmp_path / "t.gpuidx", masks(), 1)
    trunc = tmp_path / "trunc.gpuidx"
    trunc.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(PowerInferError, match="trunc"):
        read_gpu_index(trunc)
    with pytest.raises(PowerInferError):
        write_gpu_index(tmp_path / "bad.gpuidx", [np.array([0, 2, 1])], 1)
    assert not (tmp_path / "bad.gpuidx").exists()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# --------------------------------------------------------------------------- python -m powerinfer
def upstream_folder(folder, n_layer=12, n_ff=100):
    folder.mkdir(parents=True)
    for k in range(n_layer):
        t = torch.arange(n_ff, dtype=torch.float32).flip(0)  # neuron 0 hottest ...
        t[k] = 1000.0                                       # ... except neuron k
        torch.save(t, folder / f"activation_{k}.pt")
    (folder / "README").write_text("x")
    return folder


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "powerinfer", *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_cli_writes_upstream_index(tmp_path):
    act = upstream_folder(tmp_path / "activation")
    model = tiny_model(tmp_path / "model.powerinfer.gguf")
    out = default_index_path(model)
    r = run_cli("--activation", str(act), "--layer", "12", "--neuron", "100", "--capacity", "300",
                "--vram-capacity", "123456789", "--output", str(out), "--batch", "32", "--threshold", "0")
    assert r.returncode == 0, r.stderr
    magic, version, kv, tensors = raw_header(out)
    assert magic == b"PWRI" and version == 3 and len(tensors) == 24 and {t[2] for t in tensors} == {18}
    ix = read_gpu_index(out, n_layer=12, n_ff=100, vram_capacity=123456789, model_id=model_identity(model))
    # every layer values its chunks alike, so the hottest 9 chunks of 32 go to 9 layers (by file number)
    assert sum(ix.n_gpu) == 288
    for k, g in enumerate(ix.gpu):
        if g.any():
            assert g[k], f"layer {k} must hold its own hottest neuron {k}"


def test_cli_missing_folder(tmp_path):
    out = tmp_path / "x.gpuidx"
    r = run_cli("--activation", str(tmp_path / "nope"), "--layer", "2", "--neuron", "16", "--capacity", "8",
                "--vram-capacity", "100", "--output", str(out))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "nope") in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == []


def test_cli_layer_mismatch(tmp_path):
    act = upstream_folder(tmp_path / "activation", n_layer=3, n_ff=20)
    out = tmp_path / "x.gpuidx"
    r = run_cli("--activation", str(act), "--layer", "3", "--neuron", "32", "--capacity", "8",
                "--vram-capacity", "100", "--output", str(out))
    assert r.returncode == 1 and "n_ff" in r.stderr and not out.exists()

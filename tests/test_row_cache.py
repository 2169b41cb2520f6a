"""``--ram-budget``'s row cache and reader in production conditions (cold_rows.py, residency.py),
and the C kernels' own argument and allocation checks.

The row cache is reused only while it holds the GGUF's FFN rows in the activation order asked
for: a re-converted GGUF with the same header but other weights gives the new weights' logits, a
new activation folder gets its own cache file (an open model on the other one keeps running).
O_DIRECT reads fall back to buffered ones on EINVAL and never share the staging buffer; no file
descriptor outlives a failed open or a closed model; a budget the whole model fits in runs the
ordinary resident model; a kernel that cannot allocate, or is asked for more tokens than it
holds, raises instead of writing out of bounds."""
from __future__ import annotations

import ctypes
import errno
import gc
import os
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from helpers import ROOT, make_tiny_llama, random_predictors
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.activation import save_activation_dir
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.formats.gpuidx import model_identity
from powerinfer.runtime import cold_rows, kernels, residency
from powerinfer.runtime.loading import load_model
from powerinfer.runtime.residency import GIB, plan_residency

N_LAYER, N_EMBD, N_FF = 2, 64, 1024
PROMPT = [1, 403, 407, 261, 378, 22]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two conversions of one architecture (same header, other weights: seeds 0 and 1), one
    predictor folder, two activation folders with different counts."""
    if kernels.set_backend("auto") != "c":
        pytest.skip("--ram-budget needs the C kernels")
    tmp = tmp_path_factory.mktemp("rowcache")
    random_predictors(tmp / "pred", N_LAYER, N_EMBD, N_FF, hidden=(32, 40))
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        hf = make_tiny_llama(tmp / name / "tiny", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, n_head=4, n_head_kv=4,
                             seed=seed)
        out[name] = convert(hf, tmp / name / "m.q4_0.powerinfer.gguf", tmp / "pred", outtype="q4_0", progress=False)
    for name, seed in (("act_a", 1), ("act_b", 2)):
        gen = torch.Generator().manual_seed(seed)
        save_activation_dir(tmp / name, [torch.randint(0, 1000, (N_FF,), generator=gen) for _ in range(N_LAYER)],
                            {"n_tokens": 1000})
        out[name] = tmp / name
    return out


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv(cold_rows.ROW_CACHE_ENV, str(tmp_path / "rows"))
    monkeypatch.setenv("POWERINFER_ROW_READS", "always")  # residency.ROW_READS_ENV: the small model fits any budget above the minimum
    return tmp_path / "rows"


def test_row_reads_env_is_the_one_the_planner_reads():
    assert residency.ROW_READS_ENV == "POWERINFER_ROW_READS"


def _budget(path) -> float:
    g = open_gguf(path)
    return plan_residency(g, 64, torch.float32, 1e6).minimum / GIB + 0.02


def _logits(model) -> torch.Tensor:
    """Logits after each prompt token, fed one at a time (the one-token sparse path in both runs)."""
    out = []
    with torch.inference_mode():
        for p, t in enumerate(PROMPT):
            out.append(model.forward(torch.tensor([t]), p).float().clone())
    return torch.stack(out)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


# ---------------------------------------------------------------------------- identity
def test_reconverted_gguf_with_the_same_header_gives_the_new_weights_logits(files, env, tmp_path):
    assert model_identity(files["a"]) == model_identity(files["b"])  # the header alone cannot tell them apart
    path = tmp_path / "m.q4_0.powerinfer.gguf"
    act = str(files["act_a"])
    refs = {}
    for name in ("a", "b"):
        shutil.copy(files[name], tmp_path / "new")
        os.replace(tmp_path / "new", path)  # re-converted in place: same name, same size
        refs[name] = _logits(load_model(str(path), "f32", n_ctx=64)[0])
        model, _ = load_model(str(path), "f32", n_ctx=64, ram_budget=_budget(path), activation_dir=act)
        got = _logits(model)
        model.residency[1].close()
        assert torch.allclose(got, refs[name], rtol=0, atol=1e-4), name
    assert (refs["a"] - refs["b"]).abs().max() > 0.1  # the two weights give other logits
    assert len(list(env.glob("*.pirows"))) == 1  # one file for one header and order, rebuilt in place


def test_changed_stamp_rehashes_and_keeps_a_cache_whose_rows_match(files, env, tmp_path, monkeypatch):
    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(files["a"], path)
    kw = dict(n_ctx=64, ram_budget=_budget(path), activation_dir=str(files["act_a"]))
    with load_model(str(path), "f32", **kw)[0]:
        pass
    (cache,) = env.glob("*.pirows")
    written = cache.stat().st_mtime_ns
    hashed = []
    real = cold_rows.weights_digest
    monkeypatch.setattr(cold_rows, "weights_digest", lambda *a: hashed.append(1) or real(*a))
    meta, _ = cold_rows._read_cache_header(cache)
    assert meta["source"] is None  # the GGUF was copied just before: its stamp is not trusted yet
    assert meta["weights_sha"] == real(open_gguf(path), plan_residency(open_gguf(path), 64, torch.float32, 1e6))
    monkeypatch.setattr(cold_rows, "SETTLE_NS", 0)
    os.utime(path, ns=(time.time_ns(), time.time_ns()))  # touched: the rows are hashed again, and match
    with load_model(str(path), "f32", **kw)[0] as model:
        assert torch.allclose(_logits(model), _logits(load_model(str(path), "f32", n_ctx=64)[0]), rtol=0, atol=1e-4)
    assert len(hashed) == 1 and cache.stat().st_mtime_ns == written  # not rebuilt
    with load_model(str(path), "f32", **kw)[0]:  # the stamp the rows were verified under is kept beside
        pass
    assert len(hashed) == 1 and (env / (cache.name + ".stamp")).is_file()


@needs_proc
def test_new_activation_folder_gets_its_own_cache_and_the_open_model_keeps_running(files, env):
    path = files["a"]
    b = _budget(path)
    model_a, _ = load_model(str(path), "f32", n_ctx=64, ram_budget=b, activation_dir=str(files["act_a"]))
    cache_a = model_a.residency[1].files[0].path
    first = cache_a.stat().st_mtime_ns
    model_b, _ = load_model(str(path), "f32", n_ctx=64, ram_budget=b, activation_dir=str(files["act_b"]))
    cache_b = model_b.residency[1].files[0].path
    assert cache_b != cache_a and cache_a.is_file() and cache_b.is_file()  # side by side, not clobbered
    ref = _logits(load_model(str(path), "f32", n_ctx=64)[0])
    assert torch.allclose(_logits(model_a), ref, rtol=0, atol=1e-4)  # still reading its own file
    assert torch.allclose(_logits(model_b), ref, rtol=0, atol=1e-4)
    model_a.residency[1].close()
    model_b.residency[1].close()
    again, _ = load_model(str(path), "f32", n_ctx=64, ram_budget=b, activation_dir=str(files["act_a"]))
    assert again.residency[1].files[0].path == cache_a and cache_a.stat().st_mtime_ns == first  # reused
    again.residency[1].close()


# ---------------------------------------------------------------------------- writing
def test_row_cache_write_holds_one_bounded_chunk(files, tmp_path, monkeypatch):
    """write_row_cache's buffers stay within WRITE_CHUNK, far below one FFN matrix (here 36 KB),
    not a layer's three matrices at once; the cache it writes reads back as the GGUF's rows."""
    g = open_gguf(files["a"])
    plan = plan_residency(g, 64, torch.float32, 1e6)
    monkeypatch.setattr(cold_rows, "WRITE_CHUNK", 4096, raising=False)
    head = cold_rows._cache_header(g, plan)  # (hashing the GGUF's 13 KB header copies it: not rows)
    monkeypatch.setattr(cold_rows, "_cache_header", lambda *a: head)
    matrix = N_FF * plan.parts[0][2]
    assert matrix == 36 * 1024
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        cold_rows.write_row_cache(g, plan, tmp_path / "c.pirows")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < matrix, peak  # (a layer's three matrices: 108 KB)
    meta, start = cold_rows._read_cache_header(tmp_path / "c.pirows")
    raw = np.fromfile(tmp_path / "c.pirows", dtype=np.uint8)[start:].reshape(N_LAYER, N_FF, meta["record"])
    for i in range(N_LAYER):
        o = 0
        for suffix, _, rb in plan.parts:
            want = np.asarray(g.reader.data[int(g.tensors[f"blk.{i}.{suffix}"].data_offset):][:N_FF * rb])
            assert np.array_equal(raw[i, :, o:o + rb], want.reshape(N_FF, rb)[plan.order[i]])
            o += rb


def test_row_cache_write_prints_one_line(files, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), cold_rows.ROW_CACHE_ENV: str(tmp_path / "rows"),
           "POWERINFER_ROW_READS": "always", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(files["a"]), "-n", "2", "-c", "64",
                        "--temp", "0", "--ram-budget", f"{_budget(files['a']) + 0.2:.3f}",
                        "--activation", str(files["act_a"])],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    (cache,) = (tmp_path / "rows").glob("*.pirows")
    lines = [ln for ln in r.stderr.splitlines() if cache.name in ln]
    assert len(lines) == 1 and lines[0].startswith("writing the row cache"), r.stderr


# ---------------------------------------------------------------------------- O_DIRECT
class _DirectRefused:
    """cold_rows.c as a file system that takes O_DIRECT opens but fails O_DIRECT reads with EINVAL."""

    def __init__(self, lib):
        self.lib, self.direct_calls = lib, 0

    def pi_read_records(self, fd, direct, *args):
        if direct:
            self.direct_calls += 1
            out = args[-1]
            ctypes.memset(out, 0, 5 * 8)
            out[1], out[2] = args[0], errno.EINVAL
            return -1
        return self.lib.pi_read_records(fd, direct, *args)


def _records_file(tmp_path, n=8):
    data = np.random.default_rng(0).integers(0, 256, n * 4096, dtype=np.uint8)
    p = tmp_path / "rec.bin"
    p.write_bytes(data.tobytes())
    return p, data


def _direct_file(p):
    """A _File whose O_DIRECT descriptor exists (a plain one where the file system refuses O_DIRECT:
    the fake reader never reads through it)."""
    f = cold_rows._File(p, direct=True)
    if f.dfd < 0:
        f.dfd = os.open(p, os.O_RDONLY)
    return f


def test_einval_on_an_o_direct_read_falls_back_to_buffered_reads(tmp_path, caplog):
    lib = cold_rows._lib()
    if lib is None:
        pytest.skip("no C compiler for the row reader")
    p, data = _records_file(tmp_path)
    f = _direct_file(p)
    st = cold_rows.Stream(f, 0, 4096, [(100, 50, 0)], np.arange(8, dtype=np.int64))
    assert st.direct
    reader = cold_rows.RowReader([f])
    fake = _DirectRefused(lib)
    a = bytearray(4 * 50)
    slabs = cold_rows.Slabs([memoryview(a)], [50])
    for recs in ([1, 2, 5], [0, 7]):  # the second read goes buffered at once
        reader._c_read(fake, st, np.array(recs), np.arange(len(recs)), slabs, True)
        for slot, rec in enumerate(recs):
            assert a[slot * 50:(slot + 1) * 50] == data[rec * 4096 + 100:rec * 4096 + 150].tobytes()
    assert fake.direct_calls == 1 and not st.direct and f.dfd == -1
    assert sum("refused an O_DIRECT read" in r.message for r in caplog.records) == 1
    reader.close()


def test_concurrent_o_direct_reads_never_share_the_staging_buffer(tmp_path):
    """Two streams read at once (two executor threads): a call's staging buffer is never in use by
    another call at the same time."""
    lib = cold_rows._lib()
    if lib is None:
        pytest.skip("no C compiler for the row reader")
    p, data = _records_file(tmp_path)
    f = _direct_file(p)
    if os.fstat(f.dfd).st_ino != os.fstat(f.fd).st_ino:
        pytest.skip("unexpected file")
    spans, lock = [], threading.Lock()

    class Slow:
        def pi_read_records(self, fd, direct, *args):
            t0 = time.perf_counter()
            time.sleep(0.2)
            rc = lib.pi_read_records(f.fd, 0, *args)  # the reads themselves buffered: any file system
            with lock:
                spans.append((args[-2], t0, time.perf_counter()))
            return rc

    reader = cold_rows.RowReader([f])
    reader.lib = Slow()
    a, b = bytearray(2 * 50), bytearray(2 * 50)
    s1 = cold_rows.Stream(f, 0, 4096, [(100, 50, 0)], np.arange(8, dtype=np.int64))
    s2 = cold_rows.Stream(f, 0, 4096, [(100, 50, 0)], np.arange(8, dtype=np.int64))
    futs = reader.submit([s1], np.array([1, 2]), np.array([0, 1]), cold_rows.Slabs([memoryview(a)], [50]))
    futs += reader.submit([s2], np.array([5, 6]), np.array([0, 1]), cold_rows.Slabs([memoryview(b)], [50]))
    reader.wait(futs)
    assert len(spans) == 2
    (p1, t1, e1), (p2, t2, e2) = sorted(spans, key=lambda s: s[1])
    assert p1 is not None and p2 is not None
    assert p1 != p2 or e1 <= t2  # the same buffer only one after the other
    assert a == data[4096 + 100:4096 + 150].tobytes() + data[2 * 4096 + 100:2 * 4096 + 150].tobytes()
    assert b == data[5 * 4096 + 100:5 * 4096 + 150].tobytes() + data[6 * 4096 + 100:6 * 4096 + 150].tobytes()
    reader.close()


# ---------------------------------------------------------------------------- file descriptors
@needs_proc
def test_cache_streams_closes_the_cache_file_when_it_fails_after_opening(files, env, monkeypatch):
    g = open_gguf(files["a"])
    plan = plan_residency(g, 64, torch.float32, 1e6)
    cold_rows.open_streams(g, plan)[1][0].close()  # the cache written (and its files closed: below)
    gc.collect()
    before = _fds()
    real = cold_rows.Stream

    def fail(*a, **k):
        if len(a) > 1 and a[1] > 0:
            raise PowerInferError("no memory for the streams")
        return real(*a, **k)

    monkeypatch.setattr(cold_rows, "Stream", fail)
    with pytest.raises(PowerInferError, match="no memory"):
        cold_rows.open_streams(g, plan)
    assert _fds() == before


def _open_files() -> dict[str, str]:
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[n] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            pass
    return out


@needs_proc
@pytest.mark.parametrize("how", ["close", "with", "collected"])
def test_a_budgeted_models_reader_is_closed_with_the_model(files, env, how):
    path = files["a"]
    b = _budget(path)
    with load_model(str(path), "f32", n_ctx=64, ram_budget=b)[0]:  # the row cache written, the C reader built
        pass
    gc.collect()
    before = _open_files()
    model, tok = load_model(str(path), "f32", n_ctx=64, ram_budget=b)
    reader = model.residency[1]
    cache = str(reader.files[0].path)
    new = {n: p for n, p in _open_files().items() if before.get(n) != p}
    assert sorted(new.values()) == sorted([str(path)] * 2 + [cache] * 2)  # memory map + reader's; the cache twice
    if how == "close":
        model.close()
    elif how == "with":
        with model:
            _logits(model)
    else:
        del model, tok
        gc.collect()
    now = _open_files()
    left = sorted(p for n, p in new.items() if now.get(n) == p)
    assert left == ([] if how == "collected" else [str(path)])  # the model's own memory map only
    assert reader.closed and not any(t.name.startswith("powerinfer-rows") for t in threading.enumerate())


# ---------------------------------------------------------------------------- a model that fits
def test_a_budget_the_whole_model_fits_runs_the_resident_model(files, tmp_path, monkeypatch):
    monkeypatch.setenv(cold_rows.ROW_CACHE_ENV, str(tmp_path / "rows"))
    notes = []
    model, _ = load_model(str(files["a"]), "f32", n_ctx=64, ram_budget=4.0, note=notes.append)
    assert getattr(model, "residency", None) is None  # no row reader
    assert all(type(layer.ffn).__name__ == "FFN" for layer in model.layers)
    assert not (tmp_path / "rows").exists()  # nothing written, nothing read from disk
    (line,) = notes
    assert "the whole model fits" in line and "no FFN row is read from disk" in line
    ref = load_model(str(files["a"]), "f32", n_ctx=64)[0]
    assert torch.equal(_logits(model), _logits(ref))


def test_cli_says_the_model_fits(files, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from powerinfer.runtime.cli import main

    monkeypatch.setenv(cold_rows.ROW_CACHE_ENV, str(tmp_path / "rows"))
    r = CliRunner().invoke(main, ["-m", str(files["a"]), "-n", "4", "-c", "64", "--temp", "0", "--bench",
                                  "--ram-budget", "4"])
    assert r.exit_code == 0, r.output
    assert "the whole model fits" in r.output and "read from disk" not in r.output.replace("no FFN row is read from disk", "")
    assert not (tmp_path / "rows").exists()


# ---------------------------------------------------------------------------- C kernels
@pytest.fixture
def qmodel(files):
    from powerinfer.runtime.model import Transformer

    kernels.set_backend("c")
    return Transformer(open_gguf(files["a"]), torch.float32)


def test_several_token_kernel_refuses_more_tokens_than_it_holds_in_c(qmodel, monkeypatch):
    ffn = qmodel.layers[0].ffn
    T, n = kernels.QGEMM_MAX_T + 1, 8
    x = torch.randn(T, N_EMBD)
    idx = torch.arange(n)
    sel = torch.zeros(T, n, dtype=torch.bool)
    sel[torch.arange(n), torch.arange(n)] = True  # one token per row: no ts[] overflow even unchecked
    monkeypatch.setattr(kernels, "QGEMM_MAX_T", 1 << 20)  # the Python guard out of the way: C's own check
    with pytest.raises(PowerInferError, match="pi_q_dot_rows_multi: an argument out of range"):
        kernels.rows_dot_multi(x, idx, sel, ffn.gate, ffn.up, 0.0)
    ok = kernels.rows_dot_multi(x[:64], idx, sel[:64], ffn.gate, ffn.up, 0.0)[0]  # 64 tokens: computed
    want = kernels.rows_dot(x[3], idx, ffn.gate)[0]
    assert torch.equal(ok[3, 3], want[3])


_ALLOC_FAILS = r"""
import sys, torch
from powerinfer.runtime import kernels
kernels.set_backend("c")
lib = kernels._state["lib"]
W, x, y = torch.zeros(64 * 18, dtype=torch.uint8), torch.zeros(64), torch.zeros(64)
idx, coef = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
calls = {
    "pi_q_axpy_rows": lambda: lib.pi_q_axpy_rows(10, W.data_ptr(), idx.data_ptr(), coef.data_ptr(), 1 << 58, 64,
                                                 y.data_ptr()),
    "pi_q_gemm": lambda: lib.pi_q_gemm(10, W.data_ptr(), 1, 64, x.data_ptr(), 1 << 50, y.data_ptr()),
    "pi_q_dot_rows": lambda: lib.pi_q_dot_rows(10, W.data_ptr(), W.data_ptr(), idx.data_ptr(), 1 << 58, 64,
                                               x.data_ptr(), y.data_ptr(), y.data_ptr(), 0.0),
    "pi_q_axpy_rows_multi": lambda: lib.pi_q_axpy_rows_multi(10, W.data_ptr(), idx.data_ptr(), coef.data_ptr(),
                                                             1 << 29, 64, 1 << 29, y.data_ptr(), 0),
}
for name, f in calls.items():
    try:
        f()
        print(name, "returned")
    except MemoryError as e:
        print(name, "MemoryError", e)
"""


def test_kernel_allocation_failure_is_a_memory_error(files):
    """Scratch too large to allocate (a count no model has): MemoryError naming the kernel, before
    any row is read (unchecked, the kernel wrote through a NULL pointer: the process died)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _ALLOC_FAILS], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    for line, name in zip(lines, ("pi_q_axpy_rows", "pi_q_gemm", "pi_q_dot_rows", "pi_q_axpy_rows_multi")):
        assert line.startswith(f"{name} MemoryError {name}: the C kernels could not allocate"), line


def test_sparse_ffn_call_checks_lengths_against_the_weights(qmodel):
    ffn = qmodel.layers[0].ffn
    call = ffn.fused()
    assert call is not None
    h, x = torch.randn(N_EMBD), torch.randn(N_EMBD)
    out, k, _, _ = call(h, x)
    assert out.shape == (N_EMBD,) and k > 0
    with pytest.raises(PowerInferError, match="h has 63 values, x 64; the weights take 64 and 64"):
        call(h[:-1], x)
    with pytest.raises(PowerInferError, match="h has 64 values, x 32"):
        call(h, x[:32])
    with pytest.raises(PowerInferError, match="down_t"):
        kernels.SparseFFNCall(*call.args, call.fc1, call.fc2, call.gate, call.up,
                              dataclasses_replace(call.down_t, n_rows=N_FF // 2))


def dataclasses_replace(w, **kw):
    import dataclasses

    return dataclasses.replace(w, raw=w.raw[:kw["n_rows"]], **kw)

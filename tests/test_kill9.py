"""kill -9 while each writer writes its output (issue 12): nothing earlier is lost, nothing partial is left.

Each test makes a complete output with a normal run, starts the real CLI again on the same
target, polls the target's folder every ~1 ms for that process's temporary file or folder
(``.NAME.PID.*``, :mod:`powerinfer.formats._atomic`) and sends SIGKILL as soon as it appears.
A kill counts as landed mid-write when the process died of the SIGKILL and its temporary
entry is still there afterwards (the rename had not happened); each test retries until one
lands and fails if none does. Then: the target is byte-identical to the earlier output (or,
for a folder swap the reader finishes, equal to an uninterrupted run's), the reader accepts
it, and the next normal run succeeds and leaves no temporary entry behind.

The CLI processes are forked from a server that has already imported torch, transformers
and the CLIs (multiprocessing's ``forkserver``): each child runs the command's own
``main`` in a process of its own, and is killed like any other, but starts in milliseconds
instead of the seconds an interpreter takes to import torch.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import make_tiny_llama, random_predictors, story_text

PRELOAD = ["torch", "transformers", "transformers.models.auto.tokenization_auto",
           "transformers.models.llama.tokenization_llama_fast", "transformers.convert_slow_tokenizer", "gguf",
           "matplotlib.pyplot", "powerinfer.profile.cli", "powerinfer.train_predictor.cli", "powerinfer.convert.cli",
           "powerinfer.convert.quantize_cli", "powerinfer.report.cli", "powerinfer.runtime.cli", "powerinfer.__main__",
           "powerinfer.profile.collect", "powerinfer.train_predictor.stage", "powerinfer.calibrate.stream",
           "powerinfer.calibrate.session", "powerinfer.hf", "powerinfer.data", "powerinfer.convert.writer",
           "powerinfer.convert.gpu_index", "powerinfer.report.plot", "powerinfer.runtime.loading",
           "powerinfer.runtime.hybrid"]  # what the commands import when they run, so a child starts at once
TRIES = 6  # runs per writer before giving up on landing a kill mid-write
LANDED: dict[str, list[int]] = {}  # writer -> [kills landed mid-write, runs started]


def _cli_child(module: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """The body of one CLI process: ``module``'s click command on ``argv``, output to ``log``."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    importlib.import_module(module).main(args=argv, prog_name=module)  # exits via SystemExit


@pytest.fixture(scope="module")
def ctx():
    if sys.platform != "linux":
        pytest.skip("fork server and SIGKILL: Linux")
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(PRELOAD)
    return c


class Cli:
    """Runs one CLI (``module``) in forked processes, normally or killed mid-write."""

    def __init__(self, ctx, module: str, logs: Path, env: dict[str, str] | None = None):
        self.ctx, self.module, self.logs, self.env = ctx, module, logs, env or {}
        self.n = 0

    def _start(self, argv):
        self.n += 1
        log = self.logs / f"{self.module}.{self.n}.log"
        p = self.ctx.Process(target=_cli_child, args=(self.module, [str(a) for a in argv], self.env, str(log)))
        p.start()
        return p, log

    def ok(self, argv) -> str:
        p, log = self._start(argv)
        p.join(120)
        assert p.exitcode == 0, log.read_text()
        return log.read_text()

    def kill(self, argv, folder: Path, name: str | re.Pattern, label: str) -> None:
        """Run until a SIGKILL lands while ``folder/.NAME.PID.*`` exists (see the module docstring).

        ``name``: the target's file name, or a pattern of names (a writer of several files)."""
        stat = LANDED.setdefault(label, [0, 0])
        name_re = name.pattern if isinstance(name, re.Pattern) else re.escape(name)
        for _ in range(TRIES):
            p, log = self._start(argv)
            ours = re.compile(rf"\.(?:{name_re})\.{p.pid}\..*")
            stat[1] += 1
            while p.exitcode is None:
                try:
                    names = os.listdir(folder)
                except FileNotFoundError:
                    names = []
                if any(ours.fullmatch(n) for n in names):
                    os.kill(p.pid, signal.SIGKILL)
                    break
                time.sleep(0.001)
            p.join(120)
            left = [n for n in os.listdir(folder) if ours.fullmatch(n)] if folder.is_dir() else []
            if p.exitcode == -signal.SIGKILL and left:
                stat[0] += 1
                return
            assert p.exitcode in (0, -signal.SIGKILL), log.read_text()
        pytest.fail(f"{label}: no kill landed while {folder}/.{name}.* existed in {TRIES} runs")


def _hash(path: Path) -> dict[str, str] | str:
    """sha256 of a file, or {name: sha256} of a folder's files (hidden ones included)."""
    if path.is_dir():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _no_temps(folder: Path, name: str) -> None:
    """Nothing named ``.NAME.*`` (a writer's temporary entry, any PID) is left in ``folder``."""
    left = [n for n in os.listdir(folder) if n.startswith(f".{name}.")]
    assert not left, left


def _no_hidden(folder: Path) -> None:
    left = [n for n in os.listdir(folder) if n.startswith(".")]
    assert not left, left


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "stories.txt"
    p.write_text(story_text(3000))
    return p


@pytest.fixture(scope="module")
def act(tmp_path_factory, ctx, relu_hf, text):
    """A complete activation folder of the ReLU demo model (pi-profile, run normally)."""
    d = tmp_path_factory.mktemp("act") / "act"
    Cli(ctx, "powerinfer.profile.cli", d.parent).ok([relu_hf, "--data", text, "--out", d])
    return d


def _counts(folder):
    from powerinfer.formats.activation import load_activation_dir

    return [c.tolist() for c in load_activation_dir(folder)]


def test_pi_profile(ctx, tmp_path, relu_hf, text, act):
    from powerinfer.formats.activation import load_activation_dir

    out = tmp_path / "act"
    import shutil
    shutil.copytree(act, out)
    before, counts = _hash(out), _counts(act)
    argv = [relu_hf, "--data", text, "--out", out]
    cli = Cli(ctx, "powerinfer.profile.cli", tmp_path)
    # 1. killed while the new folder is filled or swapped in
    cli.kill(argv, tmp_path, "act", "pi-profile: activation folder")
    assert len(load_activation_dir(out)) == 5  # the reader finishes or undoes a swap the kill interrupted
    now = _hash(out)
    assert now == before or (_counts(out) == counts and set(now) >= {f"activation_{i}.pt" for i in range(5)})
    cli.ok(argv)
    _no_temps(tmp_path, "act")
    _no_hidden(out)
    assert _counts(out) == counts and (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 2. killed while report.png is drawn into the new folder (after the swap): the folder is whole,
    # report.png absent or complete, and the next run cleans the killed writer's temp file
    cli.kill(argv, out, "report.png", "pi-profile: report.png")
    assert _counts(out) == counts
    assert not (out / "report.png").exists() or (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cli.ok(argv)  # failed before the fix: "holds other files (.report.png.PID....tmp)"
    _no_temps(tmp_path, "act")
    _no_hidden(out)
    assert _counts(out) == counts


TRAIN = ["--max-tokens", "1500", "--heldout-tokens", "300", "--seq-len", "64", "--epochs", "3",
         "--hidden", "16", "--batch-size", "64", "--threads", "1"]


def _pred_tensors(folder):
    from powerinfer.formats.predictor import load_predictor_dir

    layers = load_predictor_dir(folder, 5, 64, 172)  # the demo model's n_layer, n_embd, n_ff
    return [(l.fc1, l.fc2) for l in layers], json.loads((Path(folder) / "config.json").read_text())["sparse_threshold"]


def test_pi_train_predictor_resumes_after_kills(ctx, tmp_path, relu_hf, text):
    cli = Cli(ctx, "powerinfer.train_predictor.cli", tmp_path)
    out = tmp_path / "pred"
    cli.ok([relu_hf, "--data", text, "--out", out, "--work-dir", tmp_path / "w0", *TRAIN])  # uninterrupted
    before, ref = _hash(out), _pred_tensors(out)
    argv = [relu_hf, "--data", text, "--out", out, "--work-dir", tmp_path / "w1", *TRAIN]
    # 1. killed while a layer checkpoint of the work folder is written
    (tmp_path / "w1" / "train").mkdir(parents=True)
    cli.kill(argv, tmp_path / "w1" / "train", re.compile(r"layer_\d+\.pt"), "pi-train-predictor: work-folder checkpoint")
    assert _hash(out) == before  # the predictor folder is untouched
    # 2. the rerun resumes; killed while the predictor folder is written
    cli.kill(argv, tmp_path, "pred", "pi-train-predictor: predictor folder")
    got = _pred_tensors(out)  # the reader finishes or undoes a swap the kill interrupted
    assert _hash(out) == before or _same_preds(got, ref)
    # 3. the next run resumes and gives the uninterrupted run's predictors
    log = cli.ok(argv)
    assert "not retrained" in log or "resum" in log, log
    _no_temps(tmp_path, "pred")
    _no_hidden(out)
    assert _same_preds(_pred_tensors(out), ref)
    for d in (tmp_path / "w1").rglob("*"):
        assert not d.name.startswith("."), d


def _same_preds(a, b) -> bool:
    (la, ta), (lb, tb) = a, b
    return ta == tb and len(la) == len(lb) and all(torch.equal(x1, y1) and torch.equal(x2, y2)
                                                   for (x1, x2), (y1, y2) in zip(la, lb))


@pytest.fixture(scope="module")
def pred(tmp_path_factory):
    d = tmp_path_factory.mktemp("pred") / "pred"
    random_predictors(d, 5, 64, 172)
    return d


def _gguf_ok(path: Path) -> None:
    from powerinfer.formats.gguf_file import open_gguf

    g = open_gguf(path)
    assert g.arch == "llama" and "blk.4.ffn_up.weight" in g.tensors


def test_pi_convert(ctx, tmp_path, relu_hf, pred):
    cli = Cli(ctx, "powerinfer.convert.cli", tmp_path)
    out = tmp_path / "m.gguf"
    argv = [relu_hf, pred, "--outfile", out]
    cli.ok(argv)
    before = _hash(out)
    cli.kill(argv, tmp_path, "m.gguf", "pi-convert: GGUF")
    assert _hash(out) == before  # conversion is deterministic: earlier and uninterrupted output are the same bytes
    _gguf_ok(out)
    cli.ok(argv)
    assert _hash(out) == before
    _no_hidden(tmp_path)


def test_pi_convert_vram_budget_gpu_index(ctx, tmp_path, relu_hf, pred, act):
    from powerinfer.formats.gpuidx import read_gpu_index

    cli = Cli(ctx, "powerinfer.convert.cli", tmp_path)
    out = tmp_path / "m.gguf"
    idx = tmp_path / "m.gguf.generated.gpuidx"
    argv = [relu_hf, pred, "--outfile", out, "--vram-budget", "1", "--activation", act]
    cli.ok(argv)
    before = _hash(out), _hash(idx)
    cli.kill(argv, tmp_path, idx.name, "pi-convert --vram-budget: GPU index")
    assert (_hash(out), _hash(idx)) == before
    assert read_gpu_index(idx, n_layer=5, n_ff=172).n_layer == 5
    cli.ok(argv)
    assert (_hash(out), _hash(idx)) == before
    _no_hidden(tmp_path)


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory, ctx):
    """A larger random ReLU Llama (12 layers, n_embd 256, n_ff 1024) as an f32 GGUF with its activation folder:
    its GPU index and quantized copy take long enough to write that a 1 ms poll sees the temp file."""
    d = tmp_path_factory.mktemp("big")
    model = make_tiny_llama(d / "hf", n_layer=12, n_embd=256, n_ff=1024, n_head=8, n_head_kv=4)
    random_predictors(d / "pred", 12, 256, 1024)
    Cli(ctx, "powerinfer.convert.cli", d).ok([model, d / "pred", "--outfile", d / "m.gguf", "--outtype", "f32"])
    from powerinfer.formats.activation import save_activation_dir

    g = torch.Generator().manual_seed(0)
    save_activation_dir(d / "activation", [torch.randint(0, 1000, (1024,), generator=g) for _ in range(12)])
    return d / "m.gguf"


def test_pi_quantize(ctx, tmp_path, big_gguf):
    cli = Cli(ctx, "powerinfer.convert.quantize_cli", tmp_path)
    out = tmp_path / "q.gguf"
    argv = [big_gguf, out, "q8_0", "--no-progress"]
    cli.ok(argv)
    before = _hash(out)
    cli.kill(argv, tmp_path, "q.gguf", "pi-quantize: GGUF")
    assert _hash(out) == before
    from powerinfer.formats.gguf_file import open_gguf

    assert "blk.11.ffn_up.weight" in open_gguf(out).tensors
    cli.ok(argv)
    assert _hash(out) == before
    _no_hidden(tmp_path)


def test_pi_report(ctx, tmp_path, act):
    import shutil

    a = tmp_path / "act"
    shutil.copytree(act, a)
    cli = Cli(ctx, "powerinfer.report.cli", tmp_path)
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    argv = [a, "-o", png, "--json", js]
    cli.ok(argv)
    before = _hash(png), _hash(js)
    for target, label in ((png, "pi-report: PNG"), (js, "pi-report: JSON")):
        cli.kill(argv, tmp_path, target.name, label)
        assert (_hash(png), _hash(js)) == before
        assert len(json.loads(js.read_text())["layers"]) == 5 and png.read_bytes()[:4] == b"\x89PNG"
        cli.ok(argv)
        assert (_hash(png), _hash(js)) == before
        _no_hidden(tmp_path)
    # its default output, report.png inside the activation folder: a later pi-profile must still accept the folder
    cli.kill([a], a, "report.png", "pi-report: ACT_DIR/report.png")
    from powerinfer.formats._atomic import check_replaceable
    from powerinfer.formats.activation import OWNED

    check_replaceable(a, OWNED)  # failed before the fix: the killed writer's temp file counted as a foreign file
    _no_hidden(a)


def _index_of(path: Path):
    from powerinfer.formats.gpuidx import read_gpu_index

    return read_gpu_index(path, n_layer=12, n_ff=1024)


def test_pi_run_vram_budget_gpu_index(ctx, tmp_path, big_gguf):
    import shutil

    m = tmp_path / "m.gguf"
    shutil.copy(big_gguf, m)
    shutil.copytree(big_gguf.parent / "activation", tmp_path / "activation")
    cli = Cli(ctx, "powerinfer.runtime.cli", tmp_path, env={"POWERINFER_OFFLOAD_DEVICE": "cpu"})
    argv = ["-m", m, "-p", "Once", "-n", "1", "--temp", "0", "--vram-budget", "0.02", "--reset-gpu-index"]
    cli.ok(argv)
    idx = tmp_path / "m.gguf.generated.gpuidx"
    before = _hash(idx)
    assert 0 < sum(_index_of(idx).n_gpu) < 12 * 1024  # a real split, not all or nothing
    cli.kill(argv, tmp_path, idx.name, "pi-run --vram-budget: GPU index")
    assert _hash(idx) == before
    _index_of(idx)
    cli.ok(argv)
    assert _hash(idx) == before
    _no_hidden(tmp_path)


def test_python_m_powerinfer_gpu_index(ctx, tmp_path, big_gguf):
    cli = Cli(ctx, "powerinfer.__main__", tmp_path)
    idx = tmp_path / "x.gpuidx"
    argv = ["--activation", big_gguf.parent / "activation", "--capacity", "4000", "--vram-capacity", str(1 << 22),
            "--output", idx, "--model", big_gguf]
    cli.ok(argv)
    before = _hash(idx)
    cli.kill(argv, tmp_path, idx.name, "python -m powerinfer: GPU index")
    assert _hash(idx) == before
    assert 0 < sum(_index_of(idx).n_gpu) <= 4000
    cli.ok(argv)
    assert _hash(idx) == before
    _no_hidden(tmp_path)


@pytest.fixture(scope="module", autouse=True)
def _summary():
    """At the end of the module, how many kills landed mid-write per writer (shown with -s)."""
    yield
    for label, (landed, runs) in LANDED.items():
        print(f"\n  {label}: {landed} kill(s) landed mid-write in {runs} killed run(s)", end="")

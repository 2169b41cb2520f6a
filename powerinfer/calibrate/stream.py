"""The layer-streamed calibration pass shared by ``pi-profile`` and ``pi-train-predictor``.

GPTQ and AWQ calibrate models larger than memory this way, and so do we:

1. every calibration token is embedded once (the model's own forward, stopped at layer 0:
   :class:`~powerinfer.calibrate.layers.LayerStack`) and the hidden states go to a row file;
2. for each decoder layer in order: load only that layer's tensors from the checkpoint in
   the compute dtype, run every calibration batch through it, count which FFN neurons
   fire (:class:`~powerinfer.calibrate.hooks.ActiveNeuronHooks`) and, for predictor
   training, write the (predictor input, active mask) rows
   (:mod:`powerinfer.formats.collected`); the layer's outputs become the next layer's
   inputs (a second row file; the two alternate); then free the layer.

Peak memory is one layer, the stem (embeddings), one batch's activations and the
counters -- it does not grow with ``n_layer`` or with the token count (the hidden states
live in files; the page cache keeps them in memory when there is room). In float32 the
counts are bit-for-bit those of a whole-model forward over the same batches: each batch
meets the same transformers modules with the same arguments.

Resuming: ``WORK/stream/rank{r}of{W}/state.json`` records the next layer to run and which
row file holds its inputs; a layer's counts (``counts_{i}.pt``) and rows are written
before the state moves past it. A killed run therefore restarts at the layer it was in
(its inputs are intact: only the other file was being written), never recomputes a
finished layer, and never touches a finished output folder (the stages write those
atomically at the very end). A state whose key (model and data fingerprints, settings,
dtype, device type, world size) differs is discarded.

Distributed (:mod:`powerinfer.calibrate.distributed`): rank ``r`` streams its contiguous
share of the batches through all layers independently; at the end the counts are summed
over ranks with one ``all_reduce``, and every rank has written its own rows of each
predictor-data file at the rows the one-process run would have used, so the results are
identical to one process.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import PowerInferError
from ..families import Activation, Family, get_attr
from ..hardware import release_memory
from ..formats._atomic import atomic_path
from ..formats.collected import COLLECT_DIR, META_FILE, CollectedData, mask_file, pack_mask, write_meta, x_file
from .distributed import Dist
from .hooks import ActiveNeuronHooks
from .layers import LayerStack
from .plan import Batch, CalibrationPlan
from .store import RowFile

__all__ = ["StreamResult", "stream_calibration", "DTYPES", "STREAM_DIR", "dtype_name"]

STREAM_DIR = "stream"
STATE_FILE = "state.json"
STATE_VERSION = 1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass
class StreamResult:
    """What the pass measured (counts summed over every rank of a torchrun job).

    ``counts[split][i]``: int64 ``[n_ff]``, tokens of ``split`` for which neuron ``j`` of
    layer ``i`` fired; ``n_tokens[split]``: tokens per split; ``layer_seconds[i]``: this
    rank's wall time for layer ``i`` (loading included; from the run that computed it);
    ``rank_tokens``: tokens this rank streamed; ``collected``: the predictor rows when
    asked for.
    """

    counts: dict[str, list[torch.Tensor]]
    n_tokens: dict[str, int]
    n_layer: int
    n_embd: int
    n_ff: int
    n_params: int
    layer_seconds: list[float]
    embed_seconds: float
    rank_tokens: int
    device: str
    dtype: str
    resumed_at: int
    world_size: int
    threads: int
    collected: CollectedData | None = None

    def all_counts(self) -> list[torch.Tensor]:
        """Per layer, counts over every split."""
        splits = list(self.counts)
        return [sum(self.counts[s][i] for s in splits) for i in range(self.n_layer)]

    def summary(self) -> dict[str, Any]:
        """JSON-able timing record (``powerinfer_stats.json`` / ``config.json`` key ``stream``)."""
        return dict(n_tokens=sum(self.n_tokens.values()), rank_tokens=self.rank_tokens, device=self.device,
                    dtype=self.dtype, threads=self.threads, world_size=self.world_size,
                    embed_seconds=round(self.embed_seconds, 3),
                    layer_seconds=[round(s, 3) for s in self.layer_seconds], resumed_at_layer=self.resumed_at)


class _Progress:
    """``layer k/L`` progress: a tqdm bar over the layer's tokens on a terminal, and one line
    per finished layer (the only output when stderr is not a terminal)."""

    def __init__(self, enabled: bool, log: Callable[[str], None] | None, tokens: int, tag: str):
        self.enabled, self.log, self.tokens, self.tag = enabled, log, tokens, tag
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None

    def start(self, what: str) -> None:
        if self.tty:  # in a log the per-layer line of done() is enough
            from ..progress import progress

            self.bar = progress(total=self.tokens, unit="tok", desc=f"{self.tag}{what}", leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def done(self, what: str, seconds: float) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled and self.log is not None:
            rate = self.tokens / max(seconds, 1e-9)
            self.log(f"{self.tag}{what}: {self.tokens} tokens in {seconds:.1f} s ({rate:.0f} tok/s)")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"f32"`` (the names of :data:`DTYPES`)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def _lock(path: Path):
    """Hold an exclusive lock on ``path`` (an open file; closing it releases the lock): two runs
    sharing a work folder would overwrite each other's hidden states. Raises PowerInferError
    when another process holds it."""
    import fcntl

    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise PowerInferError(f"{path.parent.parent}: another calibration run is using this work folder "
                              f"(lock {path.name}); wait for it or pick another --work-dir") from None
    return f


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _resumable(state: "_State", root: Path, hidden: list[Path], n_layer: int, hidden_bytes: int, n_split: int,
               n_ff: int) -> bool:
    """Whether a saved state's files are all there: counts of every finished layer and, when
    layers remain, the next layer's full-size input file."""
    nxt = int(state.data["next_layer"])
    if not 0 <= nxt <= n_layer:
        return False
    for i in range(nxt):
        try:
            c = torch.load(root / f"counts_{i}.pt", weights_only=True)
        except Exception:  # noqa: BLE001 - missing or damaged: that layer must run again
            return False
        if not isinstance(c, torch.Tensor) or c.dtype != torch.int64 or c.dim() != 2 or c.shape[0] != n_split \
                or c.shape[1] != n_ff:
            return False
    if nxt == n_layer:
        return True
    src = hidden[int(state.data["buffer"]) % 2]
    return src.is_file() and src.stat().st_size == hidden_bytes


def _json_norm(x: Any) -> Any:
    return json.loads(json.dumps(x))


class _State:
    """This rank's resume record (see the module docstring)."""

    def __init__(self, root: Path, key: dict[str, Any]):
        self.root, self.key = root, key
        self.path = root / STATE_FILE
        self.data: dict[str, Any] = dict(version=STATE_VERSION, key=key, embedded=False, next_layer=0, buffer=0,
                                         layer_seconds={}, embed_seconds=0.0)

    def load(self) -> bool:
        """True when a state with this key was found (and adopted)."""
        try:
            d = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION or d.get("key") != self.key:
            return False
        ok = (isinstance(d.get("embedded"), bool) and type(d.get("next_layer")) is int and d["next_layer"] >= 0
              and d.get("buffer") in (0, 1) and isinstance(d.get("layer_seconds"), dict)
              and isinstance(d.get("embed_seconds"), (int, float)))
        if not ok:
            return False  # damaged: treated as another run's
        self.data = d
        return True

    def save(self) -> None:
        with atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")


def _pair_files(root: Path, split: str, layer: int, rows: int, n_embd: int, n_ff: int) -> tuple[RowFile, RowFile]:
    """The split's row files of one layer, created at full size if absent or of another size."""
    out = []
    for name, width, dtype in ((x_file(split, layer), n_embd, torch.float16),
                               (mask_file(split, layer), (n_ff + 7) // 8, torch.uint8)):
        path = root / name
        want = rows * width * (2 if dtype == torch.float16 else 1)
        if not path.is_file() or path.stat().st_size != want:
            with open(path, "ab") as f:  # several ranks may get here: each sets the same size
                f.truncate(want)
        out.append(RowFile(path, rows, width, dtype))
    return out[0], out[1]


def stream_calibration(model_dir: str | Path, family: Family, act: Activation, plan: CalibrationPlan,
                       work_dir: str | Path, key: dict[str, Any], *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", pairs: bool = False, dist: Dist | None = None,
                       progress: bool = False, log: Callable[[str], None] | None = None) -> StreamResult:
    """Run the layer-streamed pass (module docstring) over ``plan`` and return its counts.

    ``key``: JSON-able identity of the run (model/data fingerprints, token caps, seq_len,
    batch size...); dtype, device type and world size are added here. ``pairs``: also
    write the predictor training rows to ``work_dir/collect`` (:class:`CollectedData`,
    returned in ``collected``).

    Raises PowerInferError for unreadable checkpoints, a model whose layers do not match
    its config, or a checkpoint without a tensor the model needs.
    """
    dist = dist or Dist()
    threads = torch.get_num_threads()
    device = torch.device(device)
    name = dtype_name(dtype)
    key = _json_norm(dict(key, dtype=name, device=device.type, world=dist.world, pairs=pairs))
    work_dir = Path(work_dir)
    stack = LayerStack(model_dir, family, dtype, device)  # checks the checkpoint before any file is written
    root = work_dir / STREAM_DIR / f"rank{dist.rank}of{dist.world}"
    root.mkdir(parents=True, exist_ok=True)
    lock = _lock(work_dir / STREAM_DIR / f"rank{dist.rank}of{dist.world}.lock")
    state = _State(root, key)
    if not state.load():
        if state.path.is_file() and log is not None and dist.is_main:
            log(f"{root}: discarding a calibration state made with other settings (model, data, tokens, "
                f"dtype or process count changed); starting from layer 1")
        for p in root.iterdir():  # another run's leftovers: start this rank over
            p.unlink() if p.is_file() else shutil.rmtree(p)
        state.save()
    collect_root = work_dir / COLLECT_DIR
    if pairs:
        collect_root.mkdir(parents=True, exist_ok=True)
        have = CollectedData.open(work_dir)
        if have is not None and have.key != key and dist.is_main:
            (collect_root / META_FILE).unlink()

    n_layer = stack.n_layer
    if n_layer == 0:
        raise PowerInferError(f"{model_dir}: the model has no decoder layers")
    cfg = stack.model.config
    n_embd = int(getattr(cfg, "hidden_size"))
    n_ff = int(get_attr(stack.layers[0], family.up_attr).weight.shape[0])
    mine = plan.shard(dist.rank, dist.world)
    rank_tokens = sum(b.n_tokens for b in mine)
    splits = plan.splits
    split_rows = plan.n_tokens
    tag = f"[rank {dist.rank}] " if dist.world > 1 else ""
    prog = _Progress(progress and (dist.is_main or dist.world == 1), log, rank_tokens, tag)
    hidden = [root / "hidden_0.bin", root / "hidden_1.bin"]
    if state.data["embedded"] and not _resumable(state, root, hidden, n_layer, rank_tokens * n_embd * _elem_size(dtype),
                                                 len(splits), n_ff):
        if log is not None:
            log(f"{tag}{root}: the saved state is incomplete (files missing or cut short); starting over")
        state.data.update(embedded=False, next_layer=0, buffer=0, layer_seconds={})
    resumed_at = int(state.data["next_layer"]) if state.data["embedded"] else 0
    if log is not None and dist.is_main:
        if resumed_at == n_layer:
            log(f"{tag}the calibration pass is already complete in {root}: reusing it")
        elif resumed_at:
            log(f"{tag}resuming at layer {resumed_at + 1}/{n_layer} (layers before it are done, in {root})")
        sizes = [len(plan.shard(r, dist.world)) for r in range(dist.world)]
        if dist.world > 1 and max(sizes) - min(sizes) > max(1, max(sizes) // 10):
            log(f"the {len(plan.batches)} forward batches split unevenly over {dist.world} processes "
                f"({min(sizes)} to {max(sizes)} each); a smaller --forward-batch balances them")

    if not state.data["embedded"]:
        t0 = time.perf_counter()
        prog.start("embed")
        with RowFile(hidden[0], rank_tokens, n_embd, dtype, create=True) as out:
            row = 0
            for b in mine:
                out.write(row, stack.layer_inputs(b.ids).reshape(-1, n_embd))
                row += b.n_tokens
                prog.update(b.n_tokens)
        seconds = time.perf_counter() - t0
        prog.done("embed", seconds)
        state.data.update(embedded=True, next_layer=0, buffer=0, embed_seconds=seconds)
        state.save()

    start = int(state.data["next_layer"])
    for i in range(start, n_layer):
        t0 = time.perf_counter()
        buf = int(state.data["buffer"])
        prog.start(f"layer {i + 1}/{n_layer}")
        layer = stack.load_layer(i)
        counts = _run_layer(stack, layer, i, family, act, mine, hidden[buf], hidden[1 - buf], rank_tokens,
                            n_embd, n_ff, dtype, splits, split_rows, collect_root if pairs else None, prog)
        stack.free_layer(i)
        release_memory()
        with atomic_path(root / f"counts_{i}.pt") as tmp:
            torch.save(counts.cpu(), tmp)
        seconds = time.perf_counter() - t0
        state.data["layer_seconds"][str(i)] = seconds
        state.data.update(next_layer=i + 1, buffer=1 - buf)
        state.save()
        prog.done(f"layer {i + 1}/{n_layer}", seconds)
    stack.close()

    # every layer is done: sum this rank's per-layer counts over all ranks
    local = torch.stack([torch.load(root / f"counts_{i}.pt", weights_only=True) for i in range(n_layer)])
    total = dist.all_reduce_sum(local.to(device if dist.backend == "nccl" else "cpu")).cpu()  # [L, n_split, n_ff]
    counts_by_split = {s: [total[i, k].clone() for i in range(n_layer)] for k, s in enumerate(splits)}
    n_tokens = plan.n_tokens

    collected = None
    if pairs:
        dist.barrier()  # every rank's rows are in place
        if dist.is_main:
            share = {s: [float(c.sum()) / (n_tokens[s] * n_ff) for c in counts_by_split[s]] for s in splits}
            write_meta(collect_root, n_layer, n_embd, n_ff, n_tokens, share, key)
        dist.barrier()
        collected = CollectedData.open(work_dir)
        if collected is None:
            raise PowerInferError(f"{collect_root}: predictor data incomplete after the pass")
    for h in hidden:  # the hidden states are GBs at 7B scale and no longer needed
        h.unlink(missing_ok=True)
    seconds = [float(state.data["layer_seconds"].get(str(i), 0.0)) for i in range(n_layer)]
    lock.close()
    return StreamResult(counts=counts_by_split, n_tokens=n_tokens, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff,
                        n_params=stack.n_params(), layer_seconds=seconds,
                        embed_seconds=float(state.data["embed_seconds"]), rank_tokens=rank_tokens,
                        device=str(device), dtype=name, resumed_at=resumed_at, world_size=dist.world,
                        threads=threads, collected=collected)


def _run_layer(stack: LayerStack, layer: torch.nn.Module, i: int, family: Family, act: Activation,
               batches: list[Batch], src: Path, dst: Path, rows: int, n_embd: int, n_ff: int, dtype: torch.dtype,
               splits: list[str], split_rows: dict[str, int], collect_root: Path | None,
               prog: _Progress) -> torch.Tensor:
    """Stream this rank's batches through layer ``i``; returns int64 counts ``[n_split, n_ff]``."""
    counts = torch.zeros(len(splits), n_ff, dtype=torch.int64, device=stack.device)
    seen = 0
    current: dict[str, Any] = {}
    files: dict[str, tuple[RowFile, RowFile]] = {}

    def on_mask(_: int, mask: torch.Tensor) -> None:
        nonlocal seen
        if mask.shape[1] != n_ff:
            raise PowerInferError(f"layer {i}: {mask.shape[1]} FFN neurons, expected n_ff = {n_ff}")
        seen += mask.shape[0]
        counts[current["split"]] += mask.sum(dim=0, dtype=torch.int64)
        if collect_root is not None:
            b: Batch = current["batch"]
            x = current.pop("x", None)
            if x is None:
                raise PowerInferError(f"layer {i}: the FFN ran before the predictor input "
                                      f"{family.predictor_input_attr!r} was seen (family {family.name})")
            if b.split not in files:
                files[b.split] = _pair_files(collect_root, b.split, i, split_rows[b.split], n_embd, mask.shape[1])
            xf, mf = files[b.split]
            xf.write(b.split_row, x.reshape(-1, n_embd))
            mf.write(b.split_row, pack_mask(mask))

    handles = []
    if collect_root is not None:
        mod = layer if family.predictor_input_attr is None else get_attr(layer, family.predictor_input_attr)

        def grab(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            current["x"] = h.detach().to(torch.float16)

        handles.append(mod.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with ActiveNeuronHooks(None, family, act, on_mask, layers={i: layer}), torch.inference_mode(), \
                RowFile(src, rows, n_embd, dtype) as fin, RowFile(dst, rows, n_embd, dtype, create=True) as fout:
            row = 0
            for b in batches:
                current.update(split=splits.index(b.split), batch=b)
                h = fin.read(row, b.n_tokens).to(stack.device, non_blocking=True).view(*b.shape, n_embd)
                out = stack.run_layer(layer, h)
                # one f32-accumulated sum is NaN/inf iff an element is (short of a 3e38 total): ~3 ms per
                # 4096 x 4096 batch on 2 cores, against ~70 ms for isfinite(out).all()
                if not bool(torch.isfinite(torch.sum(out, dtype=torch.float32))):
                    raise PowerInferError(
                        f"layer {i}: hidden states became NaN or infinite in {str(dtype).removeprefix('torch.')} "
                        f"(weights holding NaN/inf, or values beyond the dtype's range: try --dtype f32 or bf16)")
                fout.write(row, out.reshape(-1, n_embd))
                row += b.n_tokens
                prog.update(b.n_tokens)
    finally:
        for h in handles:
            h.remove()
        for xf, mf in files.values():
            xf.close()
            mf.close()
    if seen != rows:
        raise PowerInferError(f"layer {i}: saw FFN activations for {seen} of {rows} tokens (family {family.name})")
    return counts

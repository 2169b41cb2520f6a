"""Train the runtime's activation predictors, one layer at a time (Deja Vu recipe).

Model: exactly what the PowerInfer runtime evaluates (FORMATS.md section 3),
``logits = fc2(relu(fc1(x)))`` with ``fc1 = Linear(n_embd, H, bias=False)`` and
``fc2 = Linear(H, n_ff, bias=False)``; neuron ``j`` is predicted active when
``logits_j >= sparse_threshold`` (default 0.0, i.e. sigmoid 0.5). Training the ReLU in
(and no biases) matters: a predictor trained without it is evaluated differently at run time.

Loss (Deja Vu, ``sparse_predictor/trainer_mlp.py``): per batch, with ``y`` the 0/1 active
mask ``[B, n_ff]`` and ``w = mean(y) + 0.005`` (the batch's positive rate + 0.005), each
element's BCE is weighted 1 for an active neuron and ``w`` for an inactive one,
``loss = mean(weight * BCE(sigmoid(logits), y))``. (Equivalently ``pos_weight = 1/w`` up to
a constant factor.) Missing an active neuron costs ~``1/w`` times more than a false
alarm, which pushes recall up, as a sparse FFN must not skip neurons that fire. We use
``binary_cross_entropy_with_logits`` (same value, numerically stable).

Optimiser and stopping: AdamW (weight decay 0.01, as Deja Vu), batch 1024, shuffled
every epoch, peak learning rate :func:`default_lr` (unless given) decayed along a cosine
to a tenth of it by the last epoch; after each epoch the held-out split is scored. Deja Vu keeps the epoch
with the best held-out recall and stops after 5 epochs without improvement; recall
alone also rewards predicting everything active, so here the score is held-out recall
minus ``FALSE_ALARM_COST`` times the false-alarm share (predicted-active but inactive,
as a share of all neurons), which ranks epochs by recall while refusing gains bought
with many extra neurons. The best epoch's weights are kept; training stops after
``patience`` epochs without a better score or at ``epochs``. A probe of the width search
(:mod:`powerinfer.train_predictor.search`, ``give_up_below=R``) also stops once the best
held-out recall so far, going on at its pace of the last :data:`PACE_EPOCHS` epochs until
the last epoch, would still stay below ``R``: recall curves flatten, so that straight line
is optimistic, and such a run would not have reached ``R``. Its checkpoint is left
unfinished; a later call without ``give_up_below`` continues it exactly.

Resumable (nanoGPT style): after every epoch a checkpoint ``WORK/train/layer_{i}.pt``
holds the weights, optimiser state, best weights, history and a key (data + width +
settings). A rerun continues an unfinished layer and does not retrain a finished one.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PowerInferError
from ..formats._atomic import atomic_path
from ..formats.predictor import LayerPredictor
from ..formats.collected import CollectedData, unpack_mask, unpack_mask_torch

__all__ = ["TrainSettings", "Predictor", "default_lr", "lr_at", "deja_vu_loss", "heldout_metrics", "train_layer",
           "train_all_layers", "FinishedPredictors", "FALSE_ALARM_COST", "PACE_EPOCHS", "hopeless"]

TRAIN_DIR = "train"
FALSE_ALARM_COST = 0.5
PACE_EPOCHS = 3  # a probe's recall pace is measured over this many epochs
_DEJA_VU_EPS = 0.005
_NOT_IN_KEY = ("eval_rows", "ram_bytes", "device")  # settings that do not change the result


@dataclass
class TrainSettings:
    """Training hyper-parameters (defaults: Deja Vu's batch 1024, AdamW, wd 0.01)."""

    epochs: int = 20
    batch_size: int = 1024
    lr: float | None = None  # None: default_lr(n_embd)
    weight_decay: float = 0.01
    patience: int = 3
    threshold: float = 0.0
    seed: int = 0
    eval_rows: int = 1024  # held-out rows scored per chunk (x n_ff logits and labels in memory)
    ram_bytes: int = 2 << 30  # a layer's split is held in memory (on the device) when it fits in this
    device: str = "cpu"  # cpu or cuda[:N]; on a GPU the matmuls run in bf16 autocast


def default_lr(n_embd: int) -> float:
    """Peak AdamW learning rate when none is given: ``min(1e-2, 0.08 / sqrt(n_embd))``.

    1e-2 for n_embd 64, 1.25e-3 for 4096 (wider inputs, smaller steps, as usual for Adam).
    """
    return min(1e-2, 0.08 / math.sqrt(n_embd))


def lr_at(step: int, total: int, peak: float) -> float:
    """Cosine decay from ``peak`` to ``peak / 10`` over ``total`` steps (nanoGPT style, no warmup)."""
    frac = min(max(step / max(total, 1), 0.0), 1.0)
    return peak / 10 + 0.5 * (peak - peak / 10) * (1 + math.cos(math.pi * frac))


class Predictor(torch.nn.Module):
    """``fc2(relu(fc1 x))``, no biases: ``x`` ``[..., n_embd]`` -> logits ``[..., n_ff]``."""

    def __init__(self, n_embd: int, hidden: int, n_ff: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(n_embd, hidden, bias=False)
        self.fc2 = torch.nn.Linear(hidden, n_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def to_layer_predictor(self) -> LayerPredictor:
        return LayerPredictor(self.fc1.weight.detach().float().clone(), self.fc2.weight.detach().float().clone())


def deja_vu_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Weighted BCE of Deja Vu: weight 1 on active (``y=1``), ``mean(y)+0.005`` on inactive.

    ``logits``, ``y``: float ``[B, n_ff]``; returns the scalar mean over all elements.
    """
    w = y.mean() + _DEJA_VU_EPS
    weight = y * (1.0 - w) + w
    return F.binary_cross_entropy_with_logits(logits, y, weight=weight)


def _rows(x: np.ndarray, m: np.ndarray, idx: np.ndarray | slice, n_ff: int) -> tuple[torch.Tensor, torch.Tensor]:
    xb = torch.from_numpy(np.asarray(x[idx], dtype=np.float32))
    yb = torch.from_numpy(unpack_mask(np.asarray(m[idx]), n_ff)).float()
    return xb, yb


class _Split:
    """Row access to one layer's split on ``device``.

    When the split fits in ``ram_bytes`` as stored (float16 inputs, bit-packed masks: 1/3
    of the float32 + byte-mask size), it is held on the device and batches are gathered
    and unpacked there; otherwise rows are read from the memmaps batch by batch. Batches
    come back as float32 ``x`` ``[B, n_embd]`` and float32 0/1 ``y`` ``[B, n_ff]``.
    """

    def __init__(self, x: np.ndarray, m: np.ndarray, n_ff: int, ram_bytes: int, device: torch.device):
        self.n, self.n_ff, self.device = x.shape[0], n_ff, device
        self.x, self.m = x, m
        self.in_ram = x.nbytes + m.nbytes <= ram_bytes
        if self.in_ram:
            self.x = torch.from_numpy(np.array(x)).to(device)  # a copy in memory, not the read-only map
            self.m = torch.from_numpy(np.array(m)).to(device)

    def get(self, idx: np.ndarray | slice) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_ram:
            i = idx if isinstance(idx, slice) else torch.from_numpy(idx).to(self.device)
            return self.x[i].float(), unpack_mask_torch(self.m[i], self.n_ff).float()
        xb, yb = _rows(self.x, self.m, idx, self.n_ff)
        return xb.to(self.device), yb.to(self.device)


def _autocast(device: torch.device):
    """bf16 autocast for the predictor's matmuls on a GPU (the loss stays f32); nothing on the CPU,
    where bf16 matmuls are slow without bf16 instructions."""
    import contextlib

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def _evaluate(model: torch.nn.Module, rows: _Split, threshold: float, chunk: int, batch_size: int) -> dict[str, float]:
    """Held-out scores: Deja Vu ``loss`` (weights per ``batch_size`` rows, as in training),
    ``recall`` / ``precision`` flattened over tokens and neurons at ``logits >= threshold``,
    ``pred_active`` / ``true_active`` shares and ``false_alarm`` (share of all neurons
    predicted active but inactive)."""
    tp = fp = fn = n = 0
    loss_sum = 0.0
    for s in range(0, rows.n, chunk):
        xb, yb = rows.get(slice(s, s + chunk))
        with _autocast(rows.device):
            logits = model(xb).float()
        for b in range(0, xb.shape[0], batch_size):
            k = min(batch_size, xb.shape[0] - b)
            loss_sum += deja_vu_loss(logits[b:b + k], yb[b:b + k]).item() * k
        pred = logits >= threshold
        yt = yb.bool()
        tp += int((pred & yt).sum())
        fp += int((pred & ~yt).sum())
        fn += int((~pred & yt).sum())
        n += yt.numel()
    return dict(loss=loss_sum / max(rows.n, 1),
                recall=tp / (tp + fn) if tp + fn else 1.0,
                precision=tp / (tp + fp) if tp + fp else 1.0,
                pred_active=(tp + fp) / max(n, 1), true_active=(tp + fn) / max(n, 1),
                false_alarm=fp / max(n, 1))


def heldout_metrics(pred: LayerPredictor, x: np.ndarray, m: np.ndarray, n_ff: int, threshold: float = 0.0,
                    chunk: int = 8192) -> dict[str, float]:
    """scikit-learn recall/precision of a runtime predictor on held-out rows, at the runtime rule.

    ``x``: float16/float32 ``[N, n_embd]``; ``m``: packed masks ``[N, ceil(n_ff/8)]``. The
    prediction is ``pred.logits(x) >= threshold`` exactly as the runtime decides. Masks are
    flattened over tokens and neurons; counts are summed per chunk with
    ``sklearn.metrics.confusion_matrix``, so recall and precision equal ``recall_score`` /
    ``precision_score`` on the whole flattened arrays, in bounded memory.
    Returns ``recall``, ``precision``, ``pred_active``, ``true_active``, ``n_tokens``.
    """
    from sklearn.metrics import confusion_matrix

    cm = np.zeros((2, 2), dtype=np.int64)
    for s in range(0, x.shape[0], chunk):
        xb, yb = _rows(x, m, slice(s, s + chunk), n_ff)
        p = (pred.logits(xb) >= threshold).numpy().ravel()
        cm += confusion_matrix(yb.numpy().ravel().astype(bool), p, labels=[False, True]).astype(np.int64)
    (tn, fp), (fn, tp) = cm
    total = int(cm.sum())
    return dict(recall=float(tp / (tp + fn)) if tp + fn else 1.0,
                precision=float(tp / (tp + fp)) if tp + fp else 1.0,
                pred_active=float((tp + fp) / total) if total else 0.0,
                true_active=float((tp + fn) / total) if total else 0.0,
                n_tokens=int(x.shape[0]))


def _score(ev: dict[str, float]) -> float:
    return ev["recall"] - FALSE_ALARM_COST * ev["false_alarm"]


def hopeless(history: Sequence[dict[str, Any]], target: float, epochs: int) -> bool:
    """Would the best held-out recall so far (``history``: per-epoch dicts with ``recall``), going
    on at its pace of the last PACE_EPOCHS epochs until epoch ``epochs``, stay below ``target``?"""
    best = np.maximum.accumulate([h["recall"] for h in history]) if history else []
    if len(best) <= PACE_EPOCHS:
        return False
    pace = (best[-1] - best[-1 - PACE_EPOCHS]) / PACE_EPOCHS
    return bool(best[-1] + pace * (epochs - len(best)) < target)


def _state_damage(sd: Any, model: torch.nn.Module) -> str | None:
    """Why ``sd`` is not a state dict of ``model`` (keys, shapes, finite floats), or None."""
    want = model.state_dict()
    if not isinstance(sd, dict) or set(sd) != set(want):
        return f"weights {sorted(map(str, sd)) if isinstance(sd, dict) else type(sd).__name__}, expected {sorted(want)}"
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want[k].shape) or not t.is_floating_point():
            return f"{k}: expected a float tensor of shape {tuple(want[k].shape)}"
        if not bool(torch.isfinite(t).all()):
            return f"{k}: NaN or infinite weights"
    return None


def _damage(ckpt: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, epochs: int) -> str | None:
    """Why a training checkpoint with the right key cannot be resumed, or None; when usable, an
    unfinished run's model and optimiser states are loaded into ``model`` and ``opt``."""
    def count(name: str, lo: int, hi: int) -> bool:
        v = ckpt.get(name)
        return type(v) is int and lo <= v <= hi

    if not (count("epoch", 0, epochs) and count("bad_epochs", 0, epochs) and count("best_epoch", -1, epochs)):
        return "epoch counters are not integers in range"
    hist = ckpt.get("history")
    if not isinstance(hist, list) or len(hist) != ckpt["epoch"] or not all(
            isinstance(h, dict) and all(isinstance(h.get(k), (int, float)) and not isinstance(h.get(k), bool)
                                        for k in ("recall", "pred_active", "true_active", "score")) for h in hist):
        return "history is not one record of numbers per epoch"
    for name in ("seconds", "best_score"):
        v = ckpt.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return f"{name} is not a number"
    if not isinstance(ckpt.get("done"), bool):
        return "done is not true or false"
    if ckpt["epoch"] > 0 or ckpt["done"]:
        if not 0 <= ckpt["best_epoch"] < ckpt["epoch"]:
            return "best_epoch is not one of the epochs run"
        why = _state_damage(ckpt.get("best_model"), model)
        if why is not None:
            return f"best weights: {why}"
    if ckpt["done"]:
        info = ckpt.get("info")
        if not isinstance(info, dict) or not all(k in info for k in ("hidden", "epochs", "best_epoch", "history")):
            return "a finished checkpoint without its summary"
        return None
    why = _state_damage(ckpt.get("model"), model)
    if why is not None:
        return f"weights: {why}"
    try:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    except Exception as e:  # noqa: BLE001 - KeyError, ValueError, RuntimeError from a mismatched state
        return f"optimiser state: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    for group in opt.param_groups:  # load_state_dict does not look at the moment tensors' shapes
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                    return f"optimiser state {k}: shape {tuple(v.shape)}, expected {tuple(p.shape)}"
    return None


def _save(ckpt: dict[str, Any], path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)


def train_layer(data: CollectedData, layer: int, hidden: int, settings: TrainSettings, work_dir: str | Path,
                log: Callable[[str], None] | None = None, progress: bool = False,
                give_up_below: float | None = None) -> tuple[LayerPredictor, dict[str, Any]]:
    """Train (or resume, or reuse) the predictor of one layer on collected pairs.

    Trains on ``data``'s ``train`` split, scores each epoch on its ``heldout`` split (see
    the module docstring for loss, optimiser and stopping) and checkpoints to
    ``work_dir/train/layer_{layer}.pt``. A finished checkpoint with the same key is
    returned without training. ``give_up_below``: a width-search probe's target recall
    (module docstring: stop early once it is out of reach; not part of the key).

    Returns ``(predictor, info)``: the best epoch's :class:`LayerPredictor` (fp32 ``fc1``
    ``[hidden, n_embd]``, ``fc2`` ``[n_ff, hidden]``) and a JSON-able dict with ``hidden``,
    ``epochs`` run, ``best_epoch`` (0-based: an index into ``history``; ``config.json`` counts from 1), ``history`` (per-epoch train loss and held-out scores),
    ``seconds``, ``done`` (False for a probe that gave up), ``resumed`` ("no", "partial" or
    "finished").
    """
    path = Path(work_dir) / TRAIN_DIR / f"layer_{layer}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    s = settings
    if s.lr is None:
        s = replace(s, lr=default_lr(data.n_embd))
    key = dict(data=data.key, layer=layer, hidden=hidden,
               settings={k: v for k, v in asdict(s).items() if k not in _NOT_IN_KEY})
    key = json.loads(json.dumps(key))
    n_embd, n_ff = data.n_embd, data.n_ff
    torch.manual_seed(s.seed * 1000003 + layer)
    device = torch.device(s.device)
    model = Predictor(n_embd, hidden, n_ff).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)

    ckpt: dict[str, Any] | None = None
    if path.is_file():
        try:
            ckpt = torch.load(path, map_location=device, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged checkpoint is retrained
            ckpt = None
            if log is not None:
                log(f"{path}: not a readable checkpoint; training layer {layer} again")
        if ckpt is not None and not (isinstance(ckpt, dict) and ckpt.get("key") == key):
            ckpt = None  # another run's (other data, width or settings), or not ours at all
        if ckpt is not None:
            damage = _damage(ckpt, model, opt, s.epochs)
            if damage is not None:
                if log is not None:
                    log(f"{path}: damaged checkpoint ({damage}); training layer {layer} again")
                ckpt = None
                torch.manual_seed(s.seed * 1000003 + layer)  # _damage may have loaded part of it: start afresh
                model = Predictor(n_embd, hidden, n_ff).to(device)
                opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    resumed = "no"
    if ckpt is not None and ckpt.get("done"):
        model.load_state_dict(ckpt["best_model"])
        model.cpu()
        info = dict(ckpt["info"], done=True, resumed="finished")
        if log is not None:
            log(f"layer {layer}: finished checkpoint found, not retrained")
        return model.to_layer_predictor(), info
    if ckpt is not None:  # _damage loaded the model and optimiser states
        resumed = "partial"
    else:
        ckpt = dict(key=key, epoch=0, best_model=None, best_score=-float("inf"), best_epoch=-1,
                    bad_epochs=0, history=[], seconds=0.0, done=False)

    train = _Split(data.inputs("train", layer), data.masks("train", layer), n_ff, s.ram_bytes, device)
    heldout = _Split(data.inputs("heldout", layer), data.masks("heldout", layer), n_ff, s.ram_bytes, device)
    n = train.n
    steps_per_epoch = math.ceil(n / s.batch_size)
    t0 = time.perf_counter() - ckpt["seconds"]
    bar = None
    if progress:
        from ..progress import progress as progress_bar  # a bar on a terminal, lines in a log

        bar = progress_bar(total=s.epochs, initial=ckpt["epoch"], desc=f"layer {layer} (H={hidden})", unit="epoch",
                           leave=False)
    try:
        while ckpt["epoch"] < s.epochs and ckpt["bad_epochs"] < s.patience and \
                not (give_up_below is not None and hopeless(ckpt["history"], give_up_below, s.epochs)):
            epoch = ckpt["epoch"]
            rng = np.random.default_rng([s.seed, layer, epoch])  # same order on resume
            perm = rng.permutation(n)
            model.train()
            loss_sum = 0.0
            for k, b in enumerate(range(0, n, s.batch_size)):
                for group in opt.param_groups:
                    group["lr"] = lr_at(epoch * steps_per_epoch + k, s.epochs * steps_per_epoch, s.lr)
                idx = np.sort(perm[b:b + s.batch_size])
                xb, yb = train.get(idx)
                with _autocast(device):
                    logits = model(xb)
                loss = deja_vu_loss(logits.float(), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach() * len(idx)
            model.eval()
            ev = _evaluate(model, heldout, s.threshold, s.eval_rows, s.batch_size)
            score = _score(ev)
            ckpt["history"].append(dict(epoch=epoch, train_loss=float(loss_sum) / n, **ev, score=score))
            if score > ckpt["best_score"]:
                ckpt.update(best_score=score, best_epoch=epoch, bad_epochs=0,
                            best_model={k: v.clone() for k, v in model.state_dict().items()})
            else:
                ckpt["bad_epochs"] += 1
            ckpt.update(epoch=epoch + 1, model=model.state_dict(), optimizer=opt.state_dict(),
                        seconds=time.perf_counter() - t0)
            _save(ckpt, path)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(recall=f"{ev['recall']:.3f}", pred=f"{ev['pred_active']:.3f}",
                                true=f"{ev['true_active']:.3f}")
    finally:
        if bar is not None:
            bar.close()
    model.load_state_dict(ckpt["best_model"])
    model.cpu()
    info = dict(hidden=hidden, lr=s.lr, epochs=ckpt["epoch"], best_epoch=ckpt["best_epoch"],
                seconds=round(time.perf_counter() - t0, 3), history=ckpt["history"])
    if ckpt["epoch"] < s.epochs and ckpt["bad_epochs"] < s.patience:  # a probe that gave up: not finished
        return model.to_layer_predictor(), dict(info, done=False, resumed=resumed)
    ckpt.update(done=True, info=info)
    _save(ckpt, path)
    if log is not None:
        h = ckpt["history"][ckpt["best_epoch"]]
        log(f"layer {layer}: H={hidden}, best epoch {ckpt['best_epoch'] + 1}/{ckpt['epoch']}, held-out recall "
            f"{h['recall']:.3f}, predicted active {h['pred_active']:.3f} (true {h['true_active']:.3f}), "
            f"{info['seconds']:.1f} s")
    return model.to_layer_predictor(), dict(info, done=True, resumed=resumed)


class FinishedPredictors(Sequence[LayerPredictor]):
    """The best predictors of finished layers, read back from their training checkpoints one at
    a time (all of a 7B's are ~2.4 GB in float32: more than the rest of the stage needs)."""

    def __init__(self, work_dir: str | Path, n_layer: int):
        self.root, self.n_layer = Path(work_dir) / TRAIN_DIR, n_layer

    def __len__(self) -> int:
        return self.n_layer

    def __getitem__(self, i: int) -> LayerPredictor:  # type: ignore[override]
        if not 0 <= i < self.n_layer:
            raise IndexError(i)
        from ..formats.activation import torch_load

        path = self.root / f"layer_{i}.pt"
        ckpt = torch_load(path)
        if not isinstance(ckpt, dict) or not ckpt.get("done"):
            raise PowerInferError(f"{path}: layer {i} is not trained yet (or its checkpoint is damaged: rerun)")
        sd = ckpt.get("best_model")
        if not isinstance(sd, dict) or not all(isinstance(sd.get(k), torch.Tensor) and sd[k].dim() == 2
                                               for k in ("fc1.weight", "fc2.weight")):
            raise PowerInferError(f"{path}: damaged checkpoint (no fc1/fc2 weights); rerun to train layer {i} again")
        return LayerPredictor(sd["fc1.weight"].float(), sd["fc2.weight"].float())


def train_all_layers(data: CollectedData, hidden: list[int], settings: TrainSettings, work_dir: str | Path,
                     log: Callable[[str], None] | None = None,
                     progress: bool = False) -> tuple[FinishedPredictors, list[dict[str, Any]]]:
    """Train every layer in order (:func:`train_layer`) and score it with :func:`heldout_metrics`.

    ``hidden[i]``: layer ``i``'s width. Returns the predictors (read lazily from the
    per-layer checkpoints, so memory holds one at a time) and per-layer dicts: the training
    info plus ``recall``, ``precision``, ``pred_active``, ``true_active`` on the held-out
    split at ``settings.threshold``.
    """
    from ..hardware import release_memory

    if len(hidden) != data.n_layer:
        raise ValueError(f"need {data.n_layer} widths, got {len(hidden)}")
    infos = []
    for i in range(data.n_layer):
        p, info = train_layer(data, i, hidden[i], settings, work_dir, log=log, progress=progress)
        info.update(heldout_metrics(p, data.inputs("heldout", i), data.masks("heldout", i), data.n_ff,
                                    settings.threshold, chunk=settings.eval_rows))
        infos.append(info)
        del p
        release_memory()
    return FinishedPredictors(work_dir, data.n_layer), infos

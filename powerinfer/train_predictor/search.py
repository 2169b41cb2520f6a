"""Per-layer predictor width from a target held-out recall (``pi-train-predictor --target-recall``).

The PowerInfer paper grows each layer's predictor until its accuracy stops improving,
so layers that are harder to predict get wider predictors. Here, per layer:

1. Cap: the width the parameter-budget rule gives the layer
   (:func:`powerinfer.train_predictor.sizing.predictor_hidden_sizes`), so the searched
   predictors never cost more than the budget ones; ``--budget`` raises the caps.
2. Ladder: ``step, 2 step, 4 step, ...`` below the cap, then the cap (``step`` from
   :func:`~powerinfer.train_predictor.sizing.size_rule`: 8 for n_embd 64, 256 for 4096,
   so 8, 16, 32, 64 on the demo model and 256, 512, 1024, cap on a 7B). Each rung is
   trained (a *probe*) and its recall measured on the held-out split at the runtime
   threshold.
3. Stop at the first rung whose held-out recall reaches the target (``reached target``),
   at a rung that did not improve on the previous one (``recall stopped improving``: the
   previous, narrower width is kept, as a wider one buys nothing), or at the cap (``hit
   budget cap``). "Improve" is measured by the training's own epoch score, recall minus
   half the false-alarm share (:func:`~powerinfer.train_predictor.train.heldout_metrics`
   terms): a rung improves when it closes at least :data:`STALL_GAIN` of the previous
   rung's gap to a perfect 1. Recall alone would mislead here: a too-narrow predictor buys
   recall by marking many neurons active, and the next width up may trade a little of it
   for far fewer false alarms on its way to the target.
4. Refine: between the last rung that fell short and the one that reached, bisect on
   multiples of ``step`` for the smallest width that reaches the target.
5. The chosen width's run becomes the layer's predictor (a run that gave up early, at the
   cap or at the narrower width kept when recall stopped improving, is first continued
   to the end of its schedule).

The recall of a width is that of an ordinary training run at that width (its best epoch by
the usual score), measured like ``config.json``'s recall
(:func:`~powerinfer.train_predictor.train.heldout_metrics`).

Cost. Each width tried (a *probe*) is the ordinary training run
(:func:`powerinfer.train_predictor.train.train_layer`, same settings, same key), so the
chosen width's probe *is* the layer's predictor, never retrained. A probe gives up
early once it cannot reach the target (its best recall, going on at the pace of its last
3 epochs, would still fall short by the last epoch); recall plateaus within a few epochs at
a width that is too narrow, so the narrow rungs cost a few epochs each. Probes are not
given a smaller epoch budget instead: a short schedule underestimates recall (on the
demo model a 5-epoch schedule gives 0.970-0.983 at width 64 where 20 epochs give
0.993-0.998), which would pick needlessly wide predictors. Measured on the demo model
(5 layers, 50K training tokens, 2 cores): at target 0.99 each layer tries 6 widths (8, 16,
32, 64, then 48 and 56) and training takes 80 s against 32 s for the budget widths alone
(2.5x); the narrow rungs give up after 4-7 epochs.

Why the recall measured is the usual best epoch's: a target alone is not a guard against
a narrow predictor that marks most neurons active (on a synthetic 50%-dense layer, width 8
reached 0.93 recall by marking 81% active); the usual score (recall - half the false-alarm
share) picks epochs that do not buy recall that way, and ``config.json`` records every
width's predicted-active share beside its recall.

Resumable: each probe checkpoints like any training run (under
``WORK/search/h{H}/train/``), and ``WORK/search/layer_{i}.json`` records finished probes,
so a killed search restarts at the probe it was in. When a layer is decided its chosen
checkpoint moves to ``WORK/train/layer_{i}.pt`` (where training always keeps it) and the
other probes' checkpoints are deleted.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from ..formats._atomic import atomic_path
from ..formats.collected import CollectedData
from .train import FALSE_ALARM_COST, TRAIN_DIR, TrainSettings, heldout_metrics, train_layer
from .defaults import DEFAULT_TARGET_RECALL

__all__ = ["DEFAULT_TARGET_RECALL", "STALL_GAIN", "REACHED", "CAPPED", "STALLED", "width_ladder", "search_width"]

STALL_GAIN = 0.1  # a rung closing under 10% of the previous rung's gap to a perfect score: stopped improving
SEARCH_DIR = "search"
REACHED, CAPPED, STALLED = "reached target", "hit budget cap", "recall stopped improving"


def width_ladder(cap: int, step: int) -> list[int]:
    """``[step, 2 step, 4 step, ...]`` below ``cap``, then ``cap``; e.g. (64, 8) -> [8, 16, 32, 64]."""
    if not 0 < step or not 0 < cap:
        raise ValueError(f"need positive cap and step, got {cap}, {step}")
    out, w = [], step
    while w < cap:
        out.append(w)
        w *= 2
    return out + [cap]


def _stalled(prev: dict[str, Any], cur: dict[str, Any]) -> bool:
    """Did widening from probe ``prev`` to ``cur`` close less than STALL_GAIN of the score's gap to 1?"""
    return 1.0 - cur["score"] > (1.0 - STALL_GAIN) * (1.0 - prev["score"])


def _record_ok(rec: dict[str, Any], cap: int) -> bool:
    """Whether a search record read back from WORK/search has the structure this module writes."""
    def num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    probes = rec.get("probes")
    if not isinstance(probes, dict) or not num(rec.get("seconds")) or not isinstance(rec.get("done"), bool):
        return False
    for h, pr in probes.items():
        if not (isinstance(pr, dict) and str(pr.get("hidden")) == h and type(pr.get("hidden")) is int
                and all(num(pr.get(k)) for k in ("recall", "pred_active", "score", "epochs"))
                and isinstance(pr.get("reached"), bool)):
            return False
    if rec["done"]:
        return type(rec.get("hidden")) is int and 0 < rec["hidden"] <= cap and \
            rec.get("stop") in (REACHED, CAPPED, STALLED)
    return True


def search_width(data: CollectedData, layer: int, target: float, cap: int, step: int, settings: TrainSettings,
                 work_dir: str | Path, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Choose layer ``layer``'s width for held-out recall ``target`` and train it (module docstring).

    ``cap``: the widest allowed (the budget rule's width); ``step``: the width granularity;
    ``settings``: the training settings. Afterwards ``work_dir/train/layer_{layer}.pt`` holds
    the finished predictor of the chosen width, as :func:`~powerinfer.train_predictor.train.train_layer`
    with the same settings would have trained it (so that call returns it without training).

    Returns a JSON-able record: ``hidden`` (the chosen width), ``cap``, ``target_recall``,
    ``stop`` (:data:`REACHED`, :data:`CAPPED` or :data:`STALLED`), ``probes`` (per width
    tried, in order: ``hidden``, held-out ``recall``, ``pred_active`` and ``score`` at
    ``settings.threshold``, ``epochs`` run, ``reached``), ``search_seconds`` (the layer's
    search and training) and ``resumed`` ("no", "partial" or "finished": how much of the
    search an earlier run had done).
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target recall must be in (0, 1], got {target}")
    work_dir = Path(work_dir)
    root = work_dir / SEARCH_DIR
    rec_path = root / f"layer_{layer}.json"
    key = dict(data=data.key, layer=layer, target=target, cap=cap, step=step,
               settings={k: v for k, v in asdict(settings).items() if k not in ("eval_rows", "ram_bytes", "device")})
    key = json.loads(json.dumps(key))
    rec: dict[str, Any] = {}
    if rec_path.is_file():
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, json.JSONDecodeError):
            rec = {}
        if not isinstance(rec, dict) or rec.get("key") != key or not _record_ok(rec, cap):
            rec = {}  # another run's, or damaged: searched again (finished probes are reused)
    resumed = "finished" if rec.get("done") else "partial" if rec.get("probes") else "no"
    rec = rec or dict(key=key, probes={}, seconds=0.0, done=False)
    t0 = time.perf_counter() - rec["seconds"]
    probes: dict[str, dict[str, Any]] = rec["probes"]  # str(width) -> result, in the order tried

    def save() -> None:
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        root.mkdir(parents=True, exist_ok=True)
        with atomic_path(rec_path) as tmp:
            tmp.write_text(json.dumps(rec, indent=1) + "\n")

    def probe(h: int) -> dict[str, Any]:
        if str(h) not in probes:
            pred, info = train_layer(data, layer, h, settings, root / f"h{h}", give_up_below=target)
            m = heldout_metrics(pred, data.inputs("heldout", layer), data.masks("heldout", layer), data.n_ff,
                                settings.threshold, chunk=settings.eval_rows)
            false_alarm = m["pred_active"] - m["recall"] * m["true_active"]  # share of all neurons
            probes[str(h)] = dict(hidden=h, recall=m["recall"], pred_active=m["pred_active"],
                                  score=m["recall"] - FALSE_ALARM_COST * false_alarm, epochs=info["epochs"],
                                  reached=m["recall"] >= target)
            save()
            if log is not None:
                log(f"layer {layer}: H={h}: held-out recall {m['recall']:.4f}, predicted active "
                    f"{m['pred_active']:.3f} after {info['epochs']} epochs"
                    + (" (target reached)" if m["recall"] >= target else "" if info["done"] else " (gave up)"))
        return probes[str(h)]

    if not rec["done"]:
        prev, lo = None, 0
        chosen, stop = cap, CAPPED
        for h in width_ladder(cap, step):
            cur = probe(h)
            if cur["reached"]:
                chosen, stop = h, REACHED
                break
            if prev is not None and _stalled(prev, cur):
                chosen, stop = prev["hidden"], STALLED
                break
            prev, lo = cur, h
        if stop == REACHED:  # bisect between the last rung short of the target and the first reaching it
            hi = chosen
            while hi - lo > step:
                mid = lo + step * max(1, round((hi - lo) / (2 * step)))
                if probe(mid)["reached"]:
                    hi = mid
                else:
                    lo = mid
            chosen = hi
        final = work_dir / TRAIN_DIR / f"layer_{layer}.pt"
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f"h{chosen}" / TRAIN_DIR / f"layer_{layer}.pt", final)
        rec.update(done=True, hidden=chosen, stop=stop)
        save()
        for h in probes:  # the chosen one lives on in WORK/train; probes are large for big models
            (root / f"h{h}" / TRAIN_DIR / f"layer_{layer}.pt").unlink(missing_ok=True)
    # finish the chosen run: a no-op when it finished as a probe; a probe that gave up (the cap, or
    # the narrower width when recall stopped improving) is continued to the end of its schedule
    train_layer(data, layer, rec["hidden"], settings, work_dir)
    save()
    order = list(probes.values())
    if log is not None:
        tried = ", ".join(f"{p['hidden']} ({p['recall']:.4f})" for p in order)
        log(f"layer {layer}: widths tried {tried} -> H={rec['hidden']} ({rec['stop']}, target {target}, cap {cap})")
    return dict(hidden=rec["hidden"], cap=cap, target_recall=target, stop=rec["stop"], probes=order,
                search_seconds=rec["seconds"], resumed=resumed)

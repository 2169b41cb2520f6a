"""The ``pi-train-predictor`` stage as one call: calibrate, size, train, write.

The calibration pass is the layer-streamed one shared with ``pi-profile``
(:func:`powerinfer.calibrate.stream.stream_calibration`), so a 7B-70B model is read one
decoder layer at a time; with ``activation_out`` the same pass also writes the
activation folder ``pi-profile`` would, so a large model is read from disk once, not
twice. Under ``torchrun`` the ranks share the calibration text and then the layers'
predictor training (layer ``i`` on rank ``i mod WORLD_SIZE``); rank 0 writes the folder.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable


from .search import DEFAULT_TARGET_RECALL
from .train import FALSE_ALARM_COST, TrainSettings, train_all_layers, train_layer

__all__ = ["train_predictor_dir"]


def train_predictor_dir(model_dir: str | Path, data: str | Path, out_dir: str | Path, *,
                        work_dir: str | Path | None = None, max_tokens: int = 65536,
                        heldout_tokens: int | None = None, heldout_frac: float = 0.1, seq_len: int = 256,
                        collect_batch_size: int = 16, text_field: str = "text", budget: float | None = None,
                        hidden: int | None = None, target_recall: float | None = DEFAULT_TARGET_RECALL,
                        settings: TrainSettings | None = None,
                        threads: int | None = None, progress: bool = False,
                        log: Callable[[str], None] | None = None, device: str = "cpu", dtype: str | None = None,
                        activation_out: str | Path | None = None) -> dict[str, Any] | None:
    """Collect, size, train and write a predictor folder.

    1. Calibrate: up to ``max_tokens`` training tokens from the ``train`` split of ``data``
       and up to ``heldout_tokens`` (default ``max_tokens // 4``) from its ``heldout`` split
       (:mod:`powerinfer.data`), in ``[collect_batch_size, seq_len]`` batches, streamed through
       the model layer by layer on ``device`` in ``dtype`` (None:
       :func:`powerinfer.calibrate.session.default_dtype`); the (predictor input, active mask) rows go to ``work_dir/collect`` (default
       ``<out_dir>-work``; reused when the same run comes again, resumed at the layer a
       killed run was in).
    2. Size each layer: with ``target_recall`` (the default,
       :data:`~powerinfer.train_predictor.search.DEFAULT_TARGET_RECALL`), the narrowest width
       whose held-out recall reaches it, searched up to the budget rule's width
       (:func:`powerinfer.train_predictor.search.search_width`); with ``target_recall=None``
       the budget rule's width itself
       (:func:`powerinfer.train_predictor.sizing.predictor_hidden_sizes`, from the training
       masks' active share and ``budget``); ``hidden`` (which overrides both) for all.
    3. Train every layer (:func:`powerinfer.train_predictor.train.train_layer`, resumable per
       layer) on ``device``; the width search trains as it searches.
    4. Write ``out_dir`` atomically with :func:`powerinfer.formats.predictor.save_predictor_dir`:
       ``model_{i}.pt`` (fp32 ``fc1.weight`` ``[H_i, n_embd]``, ``fc2.weight`` ``[n_ff, H_i]``)
       and ``config.json`` (``sparse_threshold``, per-layer sizes and held-out metrics (``epochs``
       run and ``best_epoch``, counted from 1 as the table prints them: ``best_epoch`` 3 of
       ``epochs`` 6 is the third epoch),
       settings, per-layer calibration timings under ``stream``; with a target recall,
       per layer also the ``cap``, why the search stopped (``stop``) and the widths it tried
       (``probes``)). With ``activation_out``,
       also the activation folder of both splits' tokens (``pi-profile``'s output).

    ``threads``: torch CPU threads (None: :func:`powerinfer.calibrate.hooks.torch_threads`
    decides, separately for the calibration pass and for training).

    Returns the config dict (None on ranks other than 0). Raises PowerInferError for a
    missing model or data, an unsupported architecture, a dense activation, too little
    text for a held-out split, or too little free disk -- before writing ``out_dir``.
    """
    from ..calibrate.hooks import torch_threads
    from ..calibrate.plan import build_plan, check_tokens, shortfall_notes
    from ..calibrate.session import check_disk, check_paths, open_session, run_key
    from ..hardware import release_memory
    from ..calibrate.stream import stream_calibration
    from ..formats._atomic import check_replaceable
    from ..formats.activation import OWNED as ACTIVATION_OWNED
    from ..formats.activation import save_activation_dir
    from ..formats.predictor import OWNED as PREDICTOR_OWNED
    from ..formats.predictor import save_predictor_dir
    from ..hf import load_hf_tokenizer
    from ..profile.collect import activation_stats
    from .search import search_width
    from .sizing import DEFAULT_BUDGET, predictor_hidden_sizes, predictor_params, size_rule

    settings = settings or TrainSettings()
    budget = DEFAULT_BUDGET if budget is None else budget
    if hidden is not None:
        target_recall = None
    if target_recall is not None and not 0.0 < target_recall <= 1.0:
        raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
    heldout_tokens = heldout_tokens if heldout_tokens is not None else max(max_tokens // 4, seq_len)
    work_dir = Path(work_dir) if work_dir is not None else Path(str(out_dir).rstrip("/") + "-work")
    say = log or (lambda _msg: None)

    session = open_session(model_dir, "predictor training", device, dtype)
    dist = session.dist
    check_replaceable(Path(out_dir), PREDICTOR_OWNED)
    if activation_out is not None:
        check_replaceable(Path(activation_out), ACTIVATION_OWNED)
    check_paths(out=out_dir, work_dir=work_dir, activation_out=activation_out)
    family, act = session.family, session.act
    n_layer, n_embd, n_ff = session.dims["n_layer"], session.dims["n_embd"], session.dims["n_ff"]
    tokenizer = load_hf_tokenizer(model_dir)
    caps = {"train": max_tokens, "heldout": heldout_tokens}
    plan = build_plan(str(data), tokenizer, caps, seq_len, collect_batch_size, heldout=heldout_frac,
                      text_field=text_field)
    check_tokens(plan, tokenizer, session.cfg.get("vocab_size"), str(model_dir))
    if dist.is_main:
        for note in shortfall_notes(plan, caps, str(data)):
            say(note)
    check_disk(work_dir, plan.total_tokens, session, pairs=True)
    key = run_key(model_dir, data, text_field=text_field, max_tokens=max_tokens, heldout_tokens=heldout_tokens,
                  heldout_frac=heldout_frac, seq_len=seq_len, batch_size=collect_batch_size)

    t0 = time.perf_counter()
    with torch_threads(threads, collect_batch_size * seq_len * n_embd * n_ff):
        res = stream_calibration(model_dir, family, act, plan, work_dir, key, dtype=session.dtype,
                                 device=session.device, pairs=True, dist=dist, progress=progress,
                                 log=say if dist.is_main else None)
    t_collect = time.perf_counter() - t0
    collected = res.collected
    assert collected is not None
    n_params = res.n_params
    if activation_out is not None and dist.is_main:
        counts = res.all_counts()
        stats = activation_stats(counts, sum(res.n_tokens.values()))
        stats.update(model=str(model_dir), data=str(data), family=family.name, activation=act.kind, n_ff=n_ff,
                     activation_source=act.origin,
                     n_embd=n_embd, seconds=round(t_collect, 3), stream=res.summary(),
                     settings=dict(max_tokens=max_tokens, heldout_tokens=heldout_tokens, seq_len=seq_len,
                                   batch_size=collect_batch_size, text_field=text_field, splits=plan.splits,
                                   device=str(session.device), dtype=session.dtype_name))
        save_activation_dir(activation_out, counts, stats)

    share = collected.active_share["train"]
    widths = [int(hidden)] * n_layer if hidden is not None else \
        predictor_hidden_sizes(share, n_embd, n_ff, n_params, budget=budget)
    if dist.is_main:
        p_params = predictor_params(widths, n_embd, n_ff)
        say(f"predictor widths {widths}: {p_params} parameters, {p_params / n_params:.1%} of the model's {n_params}"
            if target_recall is None else
            f"predictor widths for held-out recall {target_recall}: searched per layer up to the budget's {widths}")

    t1 = time.perf_counter()
    settings = replace(settings, device=str(session.device))
    searches: dict[int, dict[str, Any]] = {}
    with torch_threads(threads, settings.batch_size * max(widths) * (n_embd + n_ff)):
        resumed: dict[int, str] = {}
        if target_recall is not None:  # each rank searches (and trains) its layers; rank 0 gathers them
            step = size_rule(n_embd)[0]
            for i in range(dist.rank, n_layer, dist.world):
                searches[i] = search_width(collected, i, target_recall, widths[i], step, settings, work_dir,
                                           log=say)
                resumed[i] = searches[i]["resumed"]
                release_memory()
            searches = dist.gather_dicts(searches)
            resumed = dist.gather_dicts(resumed)
            widths = [searches[i]["hidden"] for i in range(n_layer)]
        elif dist.world > 1:  # each rank trains its layers; rank 0 then gathers the finished checkpoints
            for i in range(dist.rank, n_layer, dist.world):
                resumed[i] = train_layer(collected, i, widths[i], settings, work_dir, log=say, progress=False)[1]["resumed"]
                release_memory()
            resumed = dist.gather_dicts(resumed)
        if dist.is_main:
            preds, infos = train_all_layers(collected, widths, settings, work_dir, log=None if resumed else say,
                                            progress=progress and dist.world == 1 and sys.stderr.isatty())
            for i, how in resumed.items():
                infos[i]["resumed"] = how  # how the rank that trained layer i found it
    t_train = time.perf_counter() - t1
    if not dist.is_main:
        dist.barrier()
        dist.close()
        return None

    p_params = predictor_params(widths, n_embd, n_ff)
    layers = []
    for i, info in enumerate(infos):
        layers.append(dict(layer=i, hidden=widths[i], sparsity=1.0 - share[i],
                           recall=info["recall"], precision=info["precision"],
                           pred_active=info["pred_active"], true_active=info["true_active"],
                           heldout_tokens=info["n_tokens"], epochs=info["epochs"], best_epoch=info["best_epoch"] + 1,
                           lr=info["lr"], train_seconds=info["seconds"], resumed=info["resumed"]))
        if i in searches:  # why this width: the budget cap, the reason the search stopped, the widths tried
            srch = searches[i]
            layers[-1].update(cap=srch["cap"], stop=srch["stop"], search_seconds=srch["search_seconds"],
                              probes=srch["probes"])
    config = dict(
        sparse_threshold=float(settings.threshold),
        model=str(model_dir), family=family.name, activation=act.kind, activation_source=act.origin,
        n_layer=n_layer, n_embd=n_embd, n_ff=n_ff,
        hidden=widths, predictor_params=p_params, model_params=n_params, predictor_share=p_params / n_params,
        sizing="fixed width" if hidden is not None else "budget" if target_recall is None else "target recall",
        target_recall=target_recall,
        n_tokens=collected.n_tokens,
        layers=layers,
        seconds=dict(collect=round(t_collect, 3), train=round(t_train, 3)),
        stream=res.summary(),
        settings=dict(asdict(settings), data=str(data), text_field=text_field, max_tokens=max_tokens,
                      heldout_tokens=heldout_tokens, heldout_frac=heldout_frac, seq_len=seq_len,
                      forward_batch=collect_batch_size, budget=budget if hidden is None else None,
                      target_recall=target_recall,
                      fixed_hidden=hidden, threads=threads, dtype=session.dtype_name, world_size=dist.world),
        recipe=("Deja Vu: weighted BCE-with-logits (weight 1 on active neurons, batch positive rate + 0.005 "
                "on inactive), AdamW, cosine lr; best epoch by held-out recall - "
                f"{FALSE_ALARM_COST} x false-alarm share"),
    )
    save_predictor_dir(out_dir, preds, config)
    dist.barrier()
    dist.close()
    return config

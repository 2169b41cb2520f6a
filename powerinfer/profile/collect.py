"""Count how often each FFN neuron fires over calibration text (PowerInfer's profiler).

PowerInfer places the hot neurons (those active for many tokens) on the GPU and the
cold ones on the CPU. Its offline profiler runs the model over general text and counts,
per layer, how many tokens activate each neuron; those counts are the
``activation/activation_{i}.pt`` files (FORMATS.md section 2) that the neuron placement
solver reads. This module does the same in plain PyTorch:

* :class:`ActiveNeuronHooks` hooks each decoder layer's gate/up projections (paths from
  the :class:`~powerinfer.families.Family`) and hands the layer's boolean active mask,
  ``family.active_mask(act, gate_out, up_out)``, to a callback as soon as the layer has run;
  predictor training reuses it to collect labels.
* :func:`count_active_neurons` accumulates int64 counts ``[n_ff]`` per layer batch by batch,
  so memory does not grow with the token count.
* :func:`activation_stats` summarises the counts: sparsity, the share of all activations
  that the hottest 10% / 20% of neurons cover (the paper's "power-law" skew that makes
  hot/cold placement pay), and a power-law fit of frequency against rank.
* :func:`profile_model_dir` is the whole ``pi-profile`` stage as one call.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import PowerInferError
from ..calibrate.hooks import ActiveNeuronHooks, require_sparse, torch_threads
from ..families import Activation, Family, model_layers

__all__ = ["ActiveNeuronHooks", "forward_layers", "count_active_neurons", "activation_stats", "powerlaw_fit",
           "require_sparse", "torch_threads", "profile_model_dir"]


def forward_layers(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> None:
    """Run the decoder stack on ``input_ids`` ``[B, T]`` for its hooks' sake.

    No KV cache; the LM head is evaluated for the last position only
    (``logits_to_keep=1``) when the model supports it, since only the FFNs matter here.
    """
    kwargs: dict[str, Any] = dict(input_ids=input_ids, use_cache=False)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.inference_mode():
        try:
            model(**kwargs, logits_to_keep=1)
        except TypeError:  # a model class without logits_to_keep
            model(**kwargs)


def count_active_neurons(model: torch.nn.Module, family: Family, act: Activation,
                         batches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
                         progress: Callable[[int], None] | None = None) -> tuple[list[torch.Tensor], int]:
    """Per-layer activation counts over all tokens of ``batches``.

    ``batches`` yields LongTensor ``input_ids`` ``[B, T]`` (every position a real token, as
    :func:`powerinfer.data.calibration_batches` packs them) or ``(input_ids, attention_mask)``
    pairs whose padding positions (mask 0) are excluded from the counts. ``progress`` is
    called with each batch's token count.

    Returns ``(counts, n_tokens)``: ``counts[i]`` is int64 ``[n_ff]``, how many tokens made
    neuron ``j`` of layer ``i`` active under the family's rule (e.g. ``gate_j(x) > 0`` for
    ReLU-Llama); ``n_tokens`` the number of tokens counted. Memory is one batch's
    activations plus ``n_layer * n_ff`` counters. Raises PowerInferError if no batch came.
    """
    layers = model_layers(family, model)
    counts: list[torch.Tensor | None] = [None] * len(layers)

    def on_mask(i: int, mask: torch.Tensor) -> None:
        c = mask.sum(dim=0, dtype=torch.int64)
        counts[i] = c if counts[i] is None else counts[i] + c

    n_tokens = 0
    with ActiveNeuronHooks(model, family, act, on_mask) as hooks:
        for batch in batches:
            ids, attn = batch if isinstance(batch, tuple) else (batch, None)
            hooks.token_mask = None if attn is None else attn.bool()
            forward_layers(model, ids, attn)
            n = ids.numel() if attn is None else int(attn.bool().sum())
            n_tokens += n
            if progress is not None:
                progress(n)
    if n_tokens == 0 or any(c is None for c in counts):
        raise PowerInferError("no calibration tokens reached the model")
    return [c.cpu() for c in counts], n_tokens  # type: ignore[union-attr]


def powerlaw_fit(counts: np.ndarray) -> tuple[float | None, float | None, float | None]:
    """Least-squares line through ``log(count)`` against ``log(rank)`` over the active neurons.

    ``counts``: 1-D activation counts (any scale: frequencies give the same slope).
    Returns ``(slope, intercept, r2)``, natural logs, rank 1 = the hottest neuron;
    ``count ~ exp(intercept) * rank ** slope``. Equal counts give slope 0, R^2 1; fewer
    than 2 active neurons give ``(None, None, None)``.
    """
    c = np.sort(counts[counts > 0])[::-1].astype(np.float64)
    if c.size < 2 or c[0] == c[-1]:
        return (0.0, float(np.log(c[0])), 1.0) if c.size >= 2 else (None, None, None)
    x, y = np.log(np.arange(1, c.size + 1)), np.log(c)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
    return float(slope), float(intercept), r2


def activation_stats(counts: Sequence[torch.Tensor], n_tokens: int) -> dict[str, Any]:
    """Summary of per-layer activation counts (JSON-ready).

    ``counts[i]``: 1-D ``[n_ff]`` counts of layer ``i`` over ``n_tokens`` tokens. Per layer:

    * ``active_share``: mean share of neurons active per token, ``sum(counts) / (n_tokens*n_ff)``;
    * ``sparsity``: ``1 - active_share`` (FORMATS.md section 1 quotes ~67% for ReluLLaMA-7B);
    * ``top10_coverage`` / ``top20_coverage``: share of all activations that fall on the
      hottest 10% / 20% of neurons (``ceil`` of the share of ``n_ff``); 0.1 / 0.2 means no skew;
    * ``dead_neurons``: neurons never active;
    * ``powerlaw_slope``, ``powerlaw_r2``: straight-line fit of ``log count`` against
      ``log rank`` over the active neurons (slope ~ -1 is Zipf-like; None if < 2 active).
    """
    layers = []
    for i, c in enumerate(counts):
        a = c.detach().cpu().to(torch.float64).numpy()
        n_ff = a.size
        total = float(a.sum())
        share = total / (n_tokens * n_ff) if n_tokens else 0.0
        desc = np.sort(a)[::-1]
        cover = {}
        for pct in (10, 20):
            k = max(1, math.ceil(n_ff * pct / 100))
            cover[pct] = float(desc[:k].sum() / total) if total > 0 else 0.0
        slope, _, r2 = powerlaw_fit(a)
        layers.append(dict(layer=i, n_ff=n_ff, active_share=share, sparsity=1.0 - share,
                           top10_coverage=cover[10], top20_coverage=cover[20],
                           dead_neurons=int((a == 0).sum()), powerlaw_slope=slope, powerlaw_r2=r2))
    return dict(n_tokens=int(n_tokens), n_layer=len(layers),
                mean_sparsity=float(np.mean([l["sparsity"] for l in layers])) if layers else None,
                layers=layers)


def profile_model_dir(model_dir: str | Path, data: str | Path, out_dir: str | Path, *,
                      max_tokens: int | None = 65536, seq_len: int = 256, batch_size: int = 16,
                      text_field: str = "text", threads: int | None = None, progress: bool = False,
                      log: Callable[[str], None] | None = None, device: str = "cpu", dtype: str | None = None,
                      work_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The ``pi-profile`` stage: count activations of a HF model folder and write ``out_dir``.

    Packs ``data`` (:mod:`powerinfer.data`; all documents, capped at ``max_tokens``) into
    ``[batch_size, seq_len]`` batches and streams them through the model one decoder layer
    at a time (:func:`powerinfer.calibrate.stream.stream_calibration`: memory is one layer,
    not the model), on ``device`` (``cpu``, ``cuda``, ``cuda:N``) in ``dtype`` (``f32``,
    ``bf16``, ``f16``; None: :func:`powerinfer.calibrate.session.default_dtype`). Under ``torchrun`` each
    process takes a share of the batches and the counts are all-reduced. Then writes
    ``activation_{i}.pt`` (int64 ``[n_ff]``) plus ``powerinfer_stats.json``
    (:func:`activation_stats`, settings and per-layer timings under ``stream``) atomically
    via :func:`powerinfer.formats.activation.save_activation_dir`.

    ``work_dir`` (default ``<out_dir>-work``) holds the resumable state: a killed run
    restarts at the layer it was in; it is removed after success. ``threads``: torch CPU
    threads (None: :func:`torch_threads` decides).

    Returns the stats dict (None on ranks other than 0 of a torchrun job). Raises
    PowerInferError for a missing model/data, an unsupported architecture or a dense
    (non-ReLU) activation -- before writing anything.
    """
    import shutil

    from ..calibrate.plan import build_plan, check_tokens, shortfall_notes
    from ..calibrate.session import check_disk, check_paths, open_session, run_key
    from ..calibrate.stream import STREAM_DIR, stream_calibration
    from ..formats._atomic import check_replaceable
    from ..formats.activation import OWNED as ACTIVATION_OWNED
    from ..formats.activation import save_activation_dir
    from ..hf import load_hf_tokenizer

    session = open_session(model_dir, "profiling", device, dtype)
    check_replaceable(Path(out_dir), ACTIVATION_OWNED)
    work_dir = Path(work_dir) if work_dir is not None else Path(str(out_dir).rstrip("/") + "-work")
    check_paths(out=out_dir, work_dir=work_dir)
    dims = session.dims
    tokenizer = load_hf_tokenizer(model_dir)
    caps = {"all": max_tokens}
    plan = build_plan(str(data), tokenizer, caps, seq_len, batch_size, text_field=text_field)
    check_tokens(plan, tokenizer, session.cfg.get("vocab_size"), str(model_dir))
    if log is not None and session.dist.is_main:
        for note in shortfall_notes(plan, caps, str(data)):
            log(note)
    check_disk(work_dir, plan.total_tokens // session.dist.world + seq_len * batch_size, session, pairs=False)
    key = run_key(model_dir, data, max_tokens=max_tokens, seq_len=seq_len, batch_size=batch_size,
                  text_field=text_field)
    t0 = time.perf_counter()
    with torch_threads(threads, batch_size * seq_len * dims["n_embd"] * dims["n_ff"]):
        res = stream_calibration(model_dir, session.family, session.act, plan, work_dir, key, dtype=session.dtype,
                                 device=session.device, dist=session.dist, progress=progress, log=log)
    seconds = time.perf_counter() - t0
    counts = res.all_counts()
    n_tokens = sum(res.n_tokens.values())
    stats = activation_stats(counts, n_tokens)
    stats.update(model=str(model_dir), data=str(data), family=session.family.name, activation=session.act.kind,
                 activation_source=session.act.origin,
                 n_ff=dims["n_ff"], n_embd=dims["n_embd"], seconds=round(seconds, 3), stream=res.summary(),
                 settings=dict(max_tokens=max_tokens, seq_len=seq_len, batch_size=batch_size,
                               text_field=text_field, threads=threads, device=str(session.device),
                               dtype=session.dtype_name, world_size=session.dist.world))
    if session.dist.is_main:
        save_activation_dir(out_dir, counts, stats)
    session.dist.barrier()
    rank_dir = work_dir / STREAM_DIR / f"rank{session.dist.rank}of{session.dist.world}"
    shutil.rmtree(rank_dir, ignore_errors=True)
    rank_dir.with_suffix(".lock").unlink(missing_ok=True)
    session.dist.barrier()
    if session.dist.is_main:
        for p in (work_dir / STREAM_DIR, work_dir):  # only if nothing else is in there
            try:
                p.rmdir()
            except OSError:
                break
    session.dist.close()
    if log is not None and session.dist.is_main:
        if res.resumed_at:
            log(f"profiled {n_tokens} tokens; this run did layers {res.resumed_at + 1}-{res.n_layer} in {seconds:.2f} s")
        else:
            log(f"profiled {n_tokens} tokens in {seconds:.2f} s ({n_tokens / max(seconds, 1e-9):.0f} tok/s)")
    return stats if session.dist.is_main else None

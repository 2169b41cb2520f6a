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

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..errors import PowerInferError
from ..families import Activation, Family, get_attr, hf_dims, model_layers

__all__ = ["ActiveNeuronHooks", "forward_layers", "count_active_neurons", "activation_stats",
           "require_sparse", "torch_threads", "profile_model_dir"]

MaskCallback = Callable[[int, torch.Tensor], None]
SMALL_MATMUL_MACS = 1 << 28


@contextlib.contextmanager
def torch_threads(threads: int | None, largest_matmul_macs: float) -> Iterator[int]:
    """Run the block with ``threads`` torch CPU threads (restored afterwards).

    ``threads=None`` picks: 1 thread when the largest matrix product of the work is under
    ``SMALL_MATMUL_MACS`` multiply-adds (2^28; e.g. the 260K-parameter demo model), where
    starting and synchronising threads costs more than it saves -- several times more on
    a busy machine -- and torch's default otherwise. Yields the thread count used.
    """
    before = torch.get_num_threads()
    n = threads if threads is not None else (1 if largest_matmul_macs < SMALL_MATMUL_MACS else before)
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


class ActiveNeuronHooks:
    """Forward hooks that report each layer's FFN active mask while the model runs.

    For every decoder layer ``i`` (``family.layers_attr``) the hooks capture the outputs of
    ``family.gate_attr`` (if the family has a gate) and ``family.up_attr`` -- the
    pre-activations ``[B, T, n_ff]`` -- and, once both are in, call
    ``on_mask(i, mask)`` with ``mask = family.active_mask(act, gate, up)`` flattened to
    bool ``[N, n_ff]``, one row per real token (rows are in ``[B, T]`` row-major order).

    Set :attr:`token_mask` (bool ``[B, T]``, True = real token) before a forward pass of
    a padded batch to drop padding rows; None (default) keeps every position.

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, model: torch.nn.Module, family: Family, act: Activation, on_mask: MaskCallback):
        self.family, self.act, self.on_mask = family, act, on_mask
        self.token_mask: torch.Tensor | None = None
        self.layers = model_layers(family, model)
        self._handles: list[Any] = []
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]

    def __enter__(self) -> "ActiveNeuronHooks":
        fam = self.family
        for i, layer in enumerate(self.layers):
            names = ["up"] + (["gate"] if fam.gated else [])
            for name in names:
                attr = fam.gate_attr if name == "gate" else fam.up_attr
                try:
                    module = get_attr(layer, attr)
                except AttributeError:
                    self.__exit__(None, None, None)
                    raise PowerInferError(f"layer {i} has no module {attr!r} (family {fam.name})") from None
                self._handles.append(module.register_forward_hook(self._hook(i, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = [{} for _ in self.layers]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` -> ``[N, D]``: the rows of real tokens (all rows if no token_mask)."""
        if self.token_mask is None:
            return t.reshape(-1, t.shape[-1])
        return t[self.token_mask.to(device=t.device, dtype=torch.bool)]

    def _hook(self, i: int, name: str):
        need = 2 if self.family.gated else 1

        def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            pending = self._pending[i]
            pending[name] = output.detach()
            if len(pending) == need:
                mask = self.family.active_mask(self.act, pending.get("gate"), pending["up"])
                self._pending[i] = {}
                self.on_mask(i, self.rows(mask))

        return hook


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


def _powerlaw_fit(counts: np.ndarray) -> tuple[float | None, float | None]:
    """Least-squares slope and R^2 of log(count) vs log(rank) over the active neurons."""
    c = np.sort(counts[counts > 0])[::-1].astype(np.float64)
    if c.size < 2 or c[0] == c[-1]:
        return (0.0, 1.0) if c.size >= 2 else (None, None)
    x, y = np.log(np.arange(1, c.size + 1)), np.log(c)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
    return float(slope), r2


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
        slope, r2 = _powerlaw_fit(a)
        layers.append(dict(layer=i, n_ff=n_ff, active_share=share, sparsity=1.0 - share,
                           top10_coverage=cover[10], top20_coverage=cover[20],
                           dead_neurons=int((a == 0).sum()), powerlaw_slope=slope, powerlaw_r2=r2))
    return dict(n_tokens=int(n_tokens), n_layer=len(layers),
                mean_sparsity=float(np.mean([l["sparsity"] for l in layers])) if layers else None,
                layers=layers)


def require_sparse(act: Activation, model_dir: str | Path, what: str) -> None:
    """Raise PowerInferError unless ``act`` is a ReLU-family (sparse) activation."""
    if not act.is_sparse:
        raise PowerInferError(
            f"{Path(model_dir) / 'config.json'}: activation {act.kind!r} is dense (every neuron fires for "
            f"every token), so {what} needs a ReLU-family model (hidden_act relu or fatrelu)")


def profile_model_dir(model_dir: str | Path, data: str | Path, out_dir: str | Path, *,
                      max_tokens: int | None = 65536, seq_len: int = 256, batch_size: int = 16,
                      text_field: str = "text", threads: int | None = None, progress: bool = False,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``pi-profile`` stage: count activations of a HF model folder and write ``out_dir``.

    Loads the model (fp32, CPU) and its tokenizer, packs ``data`` (see
    :mod:`powerinfer.data`; all documents, capped at ``max_tokens``) into ``[batch_size,
    seq_len]`` batches, counts active neurons per layer and writes ``activation_{i}.pt``
    (int64 ``[n_ff]``) plus ``powerinfer_stats.json`` (:func:`activation_stats` and the
    settings) atomically via :func:`powerinfer.formats.activation.save_activation_dir`.
    ``threads``: torch CPU threads (None: :func:`torch_threads` decides).

    Returns the stats dict. Raises PowerInferError for a missing model/data, an
    unsupported architecture or a dense (non-ReLU) activation -- before writing anything.
    """
    from ..data import calibration_batches
    from ..formats.activation import save_activation_dir
    from ..formats._atomic import check_replaceable
    from ..formats.activation import OWNED as ACTIVATION_OWNED
    from ..hf import load_hf_model, load_hf_tokenizer, resolve_model

    family, cfg, act = resolve_model(model_dir)
    require_sparse(act, model_dir, "profiling")
    check_replaceable(Path(out_dir), ACTIVATION_OWNED)
    dims = hf_dims(cfg)
    tokenizer = load_hf_tokenizer(model_dir)
    batches = calibration_batches(data, tokenizer, max_tokens, seq_len, batch_size, split="all",
                                  text_field=text_field)
    model = load_hf_model(model_dir)
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=max_tokens, unit="tok", desc="profile", leave=False)
    try:
        with torch_threads(threads, batch_size * seq_len * dims["n_embd"] * dims["n_ff"]):
            counts, n_tokens = count_active_neurons(model, family, act, batches,
                                                    progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    for i, c in enumerate(counts):
        if c.numel() != dims["n_ff"]:
            raise PowerInferError(f"layer {i}: counted {c.numel()} neurons but config says n_ff = {dims['n_ff']}")
    stats = activation_stats(counts, n_tokens)
    stats.update(model=str(model_dir), data=str(data), family=family.name, activation=act.kind,
                 n_ff=dims["n_ff"], n_embd=dims["n_embd"], seconds=round(seconds, 3),
                 settings=dict(max_tokens=max_tokens, seq_len=seq_len, batch_size=batch_size,
                               text_field=text_field, threads=threads))
    save_activation_dir(out_dir, counts, stats)
    if log is not None:
        log(f"profiled {n_tokens} tokens in {seconds:.2f} s ({n_tokens / max(seconds, 1e-9):.0f} tok/s)")
    return stats

"""The generation loop: prefill, decode one token at a time, sample, time it.

Sampling follows llama.cpp's order and meaning: the repetition penalty (off by
default here, 1.1 in llama.cpp), then top-k, then top-p (nucleus), then min-p
(off by default here, 0.05 in llama.cpp), then temperature; ``temp <= 0`` is
greedy (argmax, after the penalty).

Timing: :class:`GenStats` keeps the prompt time, every decode step's time, and
the time the FFNs (and their predictors) took during decoding, so a run can say
where its time went; :func:`decode_bytes_per_token` gives the weight bytes one
decode step reads, the quantity that bounds batch-1 speed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import torch

from ..errors import PowerInferError
from . import kernels
from .model import Transformer
from .weights import weight_nbytes


@dataclass
class SamplerSettings:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = -1  # -1: random
    repeat_penalty: float = 1.0  # 1.0: off (llama.cpp's default is 1.1)
    repeat_last_n: int = 64  # tokens of history penalized; 0: off, -1: the context size
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0.0: off (llama.cpp's default is 0.05)


def apply_repeat_penalty(logits: torch.Tensor, history: Sequence[int], penalty: float) -> torch.Tensor:
    """llama.cpp's repetition penalty: each distinct token of ``history`` has its logit divided
    by ``penalty`` when positive, multiplied by it when negative. Returns a new tensor."""
    if penalty == 1.0 or not history:
        return logits
    idx = torch.tensor(sorted({int(t) for t in history if 0 <= t < logits.numel()}), dtype=torch.long)
    out = logits.clone()
    v = out[idx]
    out[idx] = torch.where(v > 0, v / penalty, v * penalty)
    return out


def sample(logits: torch.Tensor, s: SamplerSettings, gen: torch.Generator | None,
           history: Sequence[int] = ()) -> int:
    """One token id from fp32 logits ``[V]`` (``history``: the last tokens, for the repetition penalty)."""
    logits = apply_repeat_penalty(logits, history, s.repeat_penalty)
    if s.temp <= 0:
        return int(logits.argmax())
    if torch.isinf(logits).any():  # a tiny penalty (5e-324) divides a logit to inf: the largest float instead
        logits = logits.clamp(-torch.finfo(logits.dtype).max, torch.finfo(logits.dtype).max)
    if 0 < s.top_k < logits.numel():
        vals, idx = logits.topk(s.top_k)
    else:
        vals, idx = logits.sort(descending=True)
    probs = torch.softmax(vals, -1)
    if s.top_p < 1.0:
        keep = int((probs.cumsum(-1) < s.top_p).sum()) + 1
        vals, idx = vals[:keep], idx[:keep]
    if s.min_p > 0.0:  # llama.cpp's min-p: logits within log(min_p) of the best one
        keep = max(1, int((vals >= vals[0] + math.log(s.min_p)).sum()))
        vals, idx = vals[:keep], idx[:keep]
    scaled = vals / s.temp
    if not torch.isfinite(scaled).all():  # a temperature too small for fp32 (5e-324): softmax(inf - inf) is NaN;
        return int(idx[0])  # its limit is the best token (vals are sorted, best first)
    probs = torch.softmax(scaled, -1)
    return int(idx[torch.multinomial(probs, 1, generator=gen)])


@dataclass
class GenStats:
    n_prompt: int = 0  # prompt tokens evaluated
    n_reused: int = 0  # prompt tokens found in the KV cache (not evaluated)
    n_gen: int = 0
    n_eval: int = 0  # decode forward passes timed in t_gen
    t_prompt: float = 0.0  # seconds
    t_gen: float = 0.0
    active_share: float | None = None  # mean share of FFN neurons computed (prompt and decode)
    token_ids: list[int] = field(default_factory=list)
    t_steps: list[float] = field(default_factory=list)  # seconds of each decode forward pass
    cpu_gen: float = 0.0  # CPU seconds of the calling thread over t_gen (with 1 thread: time not preempted)
    t_ffn: float = 0.0  # seconds in FFNs (predictors included) during decode passes
    t_predict: float = 0.0  # seconds in predictors during decode passes
    decode_active_share: float | None = None  # active share over decode tokens only
    decode_fired_share: float | None = None  # share of neurons with a non-zero activation, decode tokens
    stop: str = ""  # why generation ended: "n_predict", "eos" (an end token), "context" (the context is full),
    # "cancelled" (should_stop said so)

    @property
    def ffn_share(self) -> float:
        """Share of decode time spent in the FFNs (predictors included)."""
        return self.t_ffn / self.t_gen if self.t_gen > 0 else float("nan")

    @property
    def predict_share(self) -> float:
        return self.t_predict / self.t_gen if self.t_gen > 0 else float("nan")

    @property
    def prompt_tps(self) -> float | None:
        """Prompt tokens evaluated per second; None when none were (no NaN in reports or JSON)."""
        return self.n_prompt / self.t_prompt if self.t_prompt > 0 and self.n_prompt else None

    @property
    def gen_tps(self) -> float | None:
        """Decode steps per second; None when there were none."""
        return self.n_eval / self.t_gen if self.t_gen > 0 and self.n_eval else None


def count_fired(model: Transformer, on: bool = True) -> None:
    """Have the model's sparse FFNs count the neurons whose activation is non-zero (for
    ``GenStats.decode_fired_share`` and the bytes a decode step reads); off by default, as it
    costs a count per layer and token. FFNs split by GPU offload do not count."""
    for layer in model.layers:
        if hasattr(layer.ffn, "count_fired"):
            layer.ffn.count_fired = on


def ffn_mode(model: Transformer) -> str:
    """How the model's FFNs run, for the front ends' banners: ``dense``, ``sparse`` (predictors) or, for a
    mixture of experts, ``experts k of E`` (:attr:`.moe.ExpertsFFN.mode`)."""
    return getattr(model.layers[0].ffn, "mode", None) or ("dense" if model.dense else "sparse")


def ffn_counters(model: Transformer) -> tuple[float, float, int, int, int]:
    """``(t_ffn, t_predict, n_active, n_calls, n_fired)`` summed over the model's FFNs."""
    ffns = [layer.ffn for layer in model.layers]
    return (sum(f.t_ffn for f in ffns), sum(f.t_predict for f in ffns),
            sum(f.n_active for f in ffns), sum(f.n_calls for f in ffns), sum(getattr(f, "n_fired", 0) for f in ffns))


def decode_bytes_per_token(model: Transformer, active_share: float | None = None,
                           fired_share: float | None = None) -> int:
    """Weight bytes one decode step reads: attention, output, predictors, and the FFN rows
    computed (all of them when dense, ``active_share`` of them when sparse). The token
    embedding contributes one row, which is ignored.

    With ``fired_share`` (the share of neurons whose activation was non-zero) and the C
    kernels, a sparse FFN is counted as it reads: the gate rows of the predicted-active
    neurons, the up and down rows only of those that fired (a silent gate's up row and a
    zero activation's down row are skipped); without a gate, up rows of the predicted
    neurons and down rows of the fired ones."""
    n = weight_nbytes(model.output)
    for layer in model.layers:
        f = layer.ffn
        for w in (layer.wqkv, layer.wo):
            n += weight_nbytes(w)
        if hasattr(f, "decode_bytes"):  # a mixture of experts (moe.py): the router and k of the experts
            n += f.decode_bytes()
            continue
        parts = [f] if hasattr(f, "up") else [p for p in (f.cpu, f.gpu) if p is not None]  # HybridFFN: both sides
        def rows_of(*names: str) -> float:
            return sum(weight_nbytes(w) for p in parts for w in (getattr(p, k) for k in names) if w is not None)

        rows = rows_of("gate", "up", "down_t")
        if f.sparse and not model.dense:
            n += weight_nbytes(f.fc1) + weight_nbytes(f.fc2)
            if fired_share is not None and kernels.backend() == "c" and hasattr(f, "up"):
                first = ("gate",) if f.gate is not None else ("up",)
                rest = ("up", "down_t") if f.gate is not None else ("down_t",)
                rows = rows_of(*first) * (active_share or 0.0) + rows_of(*rest) * fired_share
            else:
                rows *= 1.0 if active_share is None else active_share
        n += rows
    return int(n)


def generate(model: Transformer, prompt_ids: list[int], n_predict: int, sampler: SamplerSettings,
             eos_id: int | Collection[int] | None = None, on_token: Callable[[int], None] | None = None,
             stop_after_first: Sequence[int] = (), n_past: int = 0,
             should_stop: Callable[[], bool] | None = None) -> GenStats:
    """Generate up to ``n_predict`` tokens after ``prompt_ids`` (``n_predict < 0``: until an end
    token or the context end). Stops at ``eos_id`` (one id or a set, e.g. the vocabulary's
    end-of-generation ids from :func:`~.session.end_ids`) and, from the second generated token on, at any
    id of ``stop_after_first`` (BOS for llama2.c-style models, which emit it between stories);
    the end token is neither kept nor passed to ``on_token``. ``GenStats.stop`` says why it stopped.

    ``n_past``: the first ``n_past`` prompt tokens are already in the KV cache at positions
    ``0..n_past-1`` (a reused prefix); only the rest is evaluated (at least one token is).
    ``should_stop``: asked after each token; True ends generation (``stop = "cancelled"``).
    After the call the KV cache holds ``prompt_ids + token_ids[:n_eval]``.

    Raises PowerInferError if the prompt is empty or does not fit in the context.
    """
    if not prompt_ids:
        raise PowerInferError("the prompt is empty (no tokens to start from)")
    if len(prompt_ids) >= model.n_ctx:
        raise PowerInferError(f"the prompt has {len(prompt_ids)} tokens, more than the context length "
                              f"{model.n_ctx} allows (at least one must be left to generate)")
    n_past = max(0, min(n_past, len(prompt_ids) - 1))
    gen = None
    if sampler.temp > 0:
        gen = torch.Generator()
        gen.manual_seed(sampler.seed if sampler.seed >= 0 else int(time.time_ns() % (1 << 31)))
    penalty, last_n = sampler.repeat_penalty, sampler.repeat_last_n
    last_n = model.n_ctx if last_n < 0 else last_n
    history = list(prompt_ids) if penalty != 1.0 and last_n > 0 else None
    late_stops = set(stop_after_first)
    end = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    kernels.backend()  # chooses (and on first use compiles) the kernels, outside the prompt's time
    st = GenStats(n_prompt=len(prompt_ids) - n_past, n_reused=n_past)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor(prompt_ids[n_past:], dtype=torch.long), n_past)
        st.t_prompt = time.perf_counter() - t0
        pos = len(prompt_ids)
        c0 = ffn_counters(model)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        st.stop = "n_predict"
        while n_predict < 0 or len(st.token_ids) < n_predict:
            tok = sample(logits, sampler, gen, history[-last_n:] if history is not None else ())
            if tok in end or (st.token_ids and tok in late_stops):
                st.stop = "eos"
                break
            st.token_ids.append(tok)
            if history is not None:
                history.append(tok)
                del history[:-last_n]
            if on_token is not None:
                on_token(tok)
            if len(st.token_ids) == n_predict:
                break
            if should_stop is not None and should_stop():
                st.stop = "cancelled"
                break
            if pos >= model.n_ctx:
                st.stop = "context"
                break
            ts = time.perf_counter()
            logits = model.forward(torch.tensor([tok], dtype=torch.long), pos)
            st.t_steps.append(time.perf_counter() - ts)
            pos += 1
            st.n_eval += 1
        st.t_gen, st.cpu_gen = time.perf_counter() - t0, time.thread_time() - cpu0
        c1 = ffn_counters(model)
    st.n_gen = len(st.token_ids)
    st.active_share = model.active_share()
    st.t_ffn, st.t_predict = c1[0] - c0[0], c1[1] - c0[1]
    if not model.dense and c1[3] > c0[3]:
        st.decode_active_share = (c1[2] - c0[2]) / ((c1[3] - c0[3]) * model.args.n_ff)
        if all(getattr(layer.ffn, "count_fired", False) for layer in model.layers):  # see count_fired
            st.decode_fired_share = (c1[4] - c0[4]) / ((c1[3] - c0[3]) * model.args.n_ff)
    return st

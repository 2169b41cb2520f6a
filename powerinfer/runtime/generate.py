"""The generation loop: prefill, decode one token at a time, sample, time it.

Sampling follows llama.cpp's order and meaning: top-k, then top-p (nucleus),
then temperature; ``temp <= 0`` is greedy (argmax).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import PowerInferError
from .model import Transformer


@dataclass
class SamplerSettings:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = -1  # -1: random


def sample(logits: torch.Tensor, s: SamplerSettings, gen: torch.Generator | None) -> int:
    """One token id from fp32 logits ``[V]``."""
    if s.temp <= 0:
        return int(logits.argmax())
    if 0 < s.top_k < logits.numel():
        vals, idx = logits.topk(s.top_k)
    else:
        vals, idx = logits.sort(descending=True)
    probs = torch.softmax(vals, -1)
    if s.top_p < 1.0:
        keep = int((probs.cumsum(-1) < s.top_p).sum()) + 1
        vals, idx = vals[:keep], idx[:keep]
    probs = torch.softmax(vals / s.temp, -1)
    return int(idx[torch.multinomial(probs, 1, generator=gen)])


@dataclass
class GenStats:
    n_prompt: int = 0
    n_gen: int = 0
    n_eval: int = 0  # decode forward passes timed in t_gen
    t_prompt: float = 0.0  # seconds
    t_gen: float = 0.0
    active_share: float | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.t_prompt if self.t_prompt > 0 else float("nan")

    @property
    def gen_tps(self) -> float:
        return self.n_eval / self.t_gen if self.t_gen > 0 and self.n_eval else float("nan")


def generate(model: Transformer, prompt_ids: list[int], n_predict: int, sampler: SamplerSettings,
             eos_id: int | None = None, on_token: Callable[[int], None] | None = None) -> GenStats:
    """Generate up to ``n_predict`` tokens after ``prompt_ids`` (stops at EOS or the context end).

    Raises PowerInferError if the prompt is empty or does not fit in the context.
    """
    if not prompt_ids:
        raise PowerInferError("the prompt is empty (no tokens to start from)")
    if len(prompt_ids) >= model.n_ctx:
        raise PowerInferError(f"the prompt has {len(prompt_ids)} tokens, more than the context length "
                              f"{model.n_ctx} allows (at least one must be left to generate)")
    gen = None
    if sampler.temp > 0:
        gen = torch.Generator()
        gen.manual_seed(sampler.seed if sampler.seed >= 0 else int(time.time_ns() % (1 << 31)))
    st = GenStats(n_prompt=len(prompt_ids))
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor(prompt_ids, dtype=torch.long), 0)
        st.t_prompt = time.perf_counter() - t0
        pos = len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(n_predict):
            tok = sample(logits, sampler, gen)
            if eos_id is not None and tok == eos_id:
                break
            st.token_ids.append(tok)
            if on_token is not None:
                on_token(tok)
            if pos >= model.n_ctx or len(st.token_ids) == n_predict:
                break
            logits = model.forward(torch.tensor([tok], dtype=torch.long), pos)
            pos += 1
            st.n_eval += 1
        st.t_gen = time.perf_counter() - t0
    st.n_gen = len(st.token_ids)
    st.active_share = model.active_share()
    return st

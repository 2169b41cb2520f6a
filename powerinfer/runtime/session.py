"""A model's KV cache kept across calls, and text streaming with stop strings.

:class:`Session` remembers which tokens its model's KV cache holds. A new prompt that
starts with them (the next turn of a chat, a server request that repeats a system
prompt) evaluates only what follows the longest common prefix, as llama.cpp's
``cache_prompt`` does. :class:`StopMatcher` cuts generated text at the first stop
string and holds back a tail that could still become one, so no client ever sees
part of a stop string.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .generate import GenStats, SamplerSettings, generate
from .model import Transformer
from .tokenizer import GGUFTokenizer, TextStream


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def end_ids(tok: GGUFTokenizer, ignore_eos: bool = False) -> tuple[frozenset[int], tuple[int, ...]]:
    """``(end_ids, stop_after_first)`` for :func:`generate`: the vocabulary's end-of-generation ids
    (``tok.eog_ids``: EOS, EOT, EOM and the tokens llama.cpp treats as ending a turn, such as
    ``<|eot_id|>`` or ``<|im_end|>``), and BOS from the second token on (llama2.c-style models
    emit BOS between stories); none with ``ignore_eos``."""
    if ignore_eos:
        return frozenset(), ()
    eog = getattr(tok, "eog_ids", None)
    if eog is None:
        eog = frozenset(() if tok.eos_id is None else (tok.eos_id,))
    return frozenset(eog), (() if tok.bos_id is None else (tok.bos_id,))


class Session:
    """One model and tokenizer, and the ids its KV cache holds (``cached``, positions 0..)."""

    def __init__(self, model: Transformer, tok: GGUFTokenizer):
        self.model, self.tok = model, tok
        self.cached: list[int] = []

    def generate(self, ids: list[int], n_predict: int, sampler: SamplerSettings, *, ignore_eos: bool = False,
                 on_token: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenStats:
        """:func:`~powerinfer.runtime.generate.generate` after ``ids``, evaluating only the part not
        already cached (``GenStats.n_reused`` says how many were). Raises PowerInferError as it does;
        an exception mid-way (Ctrl-C) leaves the cache marked as holding the reused prefix only."""
        n_past = common_prefix(self.cached, ids)
        self.cached = self.cached[:n_past]
        eos, late = end_ids(self.tok, ignore_eos)
        st = generate(self.model, ids, n_predict, sampler, eos, on_token, late, n_past=n_past,
                      should_stop=should_stop)
        self.cached = list(ids) + st.token_ids[:st.n_eval]
        return st

    def generate_text(self, ids: list[int], n_predict: int, sampler: SamplerSettings, on_text: Callable[[str], None],
                      *, stops: Sequence[str] = (), ignore_eos: bool = False,
                      should_stop: Callable[[], bool] | None = None) -> tuple[GenStats, str | None]:
        """:meth:`generate` with the reply as text: ``on_text`` gets each piece (whole UTF-8 characters,
        cut before the first of ``stops``, which ends generation). Returns the stats and the stop
        string that ended it (None if none did)."""
        stream, matcher = TextStream(self.tok, ids), StopMatcher(stops)

        def on_token(t: int) -> None:
            piece = matcher.feed(stream.push(t))
            if piece:
                on_text(piece)

        st = self.generate(ids, n_predict, sampler, ignore_eos=ignore_eos, on_token=on_token,
                           should_stop=lambda: matcher.matched is not None or (should_stop is not None and should_stop()))
        tail = matcher.flush()
        if tail:
            on_text(tail)
        return st, matcher.matched

    def reset(self) -> None:
        self.cached = []


class StopMatcher:
    """Feeds text deltas, returns what may be shown: text up to the first stop string (then
    ``matched`` is set and nothing more is shown), holding back a tail that is a prefix of one."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        self.buf += text
        hit = min(((self.buf.find(s), s) for s in self.stops if s in self.buf), default=None)
        if hit is not None:
            out, self.matched, self.buf = self.buf[:hit[0]], hit[1], ""
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        """The held-back tail, at the end of generation (no stop string completed)."""
        out, self.buf = ("" if self.matched is not None else self.buf), ""
        return out

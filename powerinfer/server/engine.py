"""A request as the server's generation worker (:mod:`.scheduler`) sees it, and how it ended.

Each request's tokens stream back to its asyncio handler as they come (:meth:`Job.emit`). A
request is cancelled (its ``cancel`` event set, e.g. when the client disconnects) before it
starts or at its next step; its slot is then free for the next one.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..runtime.generate import GenStats, SamplerSettings

WAKE_INTERVAL_S = 0.02  # a streamed chunk carries the tokens of up to 20 ms


class QueueFull(Exception):
    """More requests are waiting than the server accepts (``--max-queue``)."""


@dataclass
class Result:
    """How a request ended: ``finish_reason`` is OpenAI's "stop" (end of text or a stop string) or
    "length" (max_tokens or a full context); ``stop_type`` llama.cpp's eos, word or limit."""

    finish_reason: str
    stop_type: str
    stopping_word: str
    stats: GenStats


@dataclass(eq=False)  # hashed by identity: the engine keeps a set of live jobs
class Job:
    """One request: prompt ids, limits and sampler. The worker appends events to ``events``:
    ``("text", str)``, then ``("done", Result)`` or ``("error", str)``, and wakes the request's
    handler on ``loop``; one wake-up may cover many tokens when the handler is slower than the
    model (the handler then sends them as one chunk)."""

    ids: list[int]
    n_predict: int
    sampler: SamplerSettings
    stop: list[str]
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    events: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cancel: threading.Event = field(default_factory=threading.Event)
    _wake_pending: bool = False
    _last_wake: float = float("-inf")

    def emit(self, kind: str, value) -> None:
        """Called by the worker thread. Text wakes the handler at most every :data:`WAKE_INTERVAL_S`
        (the first token at once): waking the event loop costs the worker the GIL for a while, which
        at hundreds of tokens/s is a fifth of its time; text waiting is sent with the next wake-up."""
        self.events.append((kind, value))
        now = time.perf_counter()
        if kind == "text" and now - self._last_wake < WAKE_INTERVAL_S:
            return
        if not self._wake_pending:
            self._last_wake = now
            self._wake_pending = True
            try:
                self.loop.call_soon_threadsafe(self._wake_up)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                self.cancel.set()

    def _wake_up(self) -> None:  # on the event loop
        self._wake_pending = False
        self.wake.set()

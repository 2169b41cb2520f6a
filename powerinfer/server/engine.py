"""The server's generation worker: one model, one request at a time, first come first served.

The runtime decodes one sequence (batch 1) with one KV cache, so requests wait in a FIFO
queue of bounded length and a single worker thread serves them in arrival order; each
request's tokens stream back to its asyncio handler as they come. The KV cache is kept
between requests: a prompt that starts like the previous one (a chat's next turn, a
shared system prompt) evaluates only what follows the common prefix.

A request is cancelled (its ``cancel`` event set, e.g. when the client disconnects)
before it starts or at its next token; the worker then takes the next one.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import PowerInferError
from ..runtime.generate import GenStats, SamplerSettings
from ..runtime.session import Session

log = logging.getLogger("powerinfer.server")
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


class Engine:
    """Owns the :class:`Session` and the worker thread; ``submit`` is called from the event loop."""

    def __init__(self, session: Session, max_queue: int = 64):
        self.session = session
        self.max_queue = max_queue
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.busy = False
        self.n_served = 0
        self.n_cancelled = 0
        self._live: set[Job] = set()
        self._closing: str | None = None
        import torch

        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="powerinfer-generate", daemon=True)
        self._thread.start()

    @property
    def n_waiting(self) -> int:
        """Requests queued and not yet started."""
        return len(self._live) - int(self.busy)

    def submit(self, job: Job) -> None:
        """Queue ``job``; QueueFull when ``max_queue`` requests already wait, or after :meth:`shutdown`."""
        with self._lock:
            if self._closing is not None:
                raise QueueFull(self._closing)
            if self.n_waiting >= self.max_queue:
                raise QueueFull(f"{self.n_waiting} requests are already waiting (--max-queue {self.max_queue})")
            self._live.add(job)
        self._q.put(job)

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """End every queued and running request now with an error event, and stop the worker
        (called when the server is asked to exit, so no client waits for a whole generation)."""
        with self._lock:
            self._closing = reason
            jobs = list(self._live)
        for job in jobs:
            job.cancel.set()
            job.emit("error", reason)
        self._q.put(None)

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        import torch

        # OpenMP's thread count is per calling thread: the C kernels ask omp_get_max_threads(), which
        # in a new thread is the machine default, not what -t set in the main thread
        torch.set_num_threads(self._threads)
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.busy = True
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self.busy = False
                    self._live.discard(job)

    def _serve(self, job: Job) -> None:
        if job.cancel.is_set():
            self.n_cancelled += 1
            return
        try:
            st, matched = self.session.generate_text(job.ids, job.n_predict, job.sampler,
                                                     lambda piece: job.emit("text", piece), stops=job.stop,
                                                     ignore_eos=job.ignore_eos, should_stop=job.cancel.is_set)
        except PowerInferError as e:
            job.emit("error", str(e))
            return
        except Exception as e:  # noqa: BLE001  (one bad request must not stop the server)
            log.exception("generation failed")
            job.emit("error", f"internal error: {type(e).__name__}: {e}")
            return
        if job.cancel.is_set():
            self.n_cancelled += 1
            if self._closing is None:
                log.info("request cancelled after %d tokens (client gone)", st.n_gen)
            return
        self.n_served += 1
        if matched is not None:
            res = Result("stop", "word", matched, st)
        elif st.stop == "eos":
            res = Result("stop", "eos", "", st)
        else:
            res = Result("length", "limit", "", st)
        job.emit("done", res)

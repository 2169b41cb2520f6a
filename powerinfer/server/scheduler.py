"""The server's generation worker: ``-np N`` slots and continuous batching.

Each slot holds one request at a time with its own KV cache (``n_ctx / N`` positions, the
``-c`` context split across the slots as llama.cpp's ``-np`` splits it), sampler, stop
strings and prompt cache (the ids its KV cache holds). A new request goes, as in llama-server, to
the idle slot whose cache shares the largest fraction of its prompt (common prefix / prompt length)
when that fraction exceeds ``slot_prompt_similarity`` (``--slot-prompt-similarity``, llama.cpp's
``-sps``), else to the least recently used idle slot (an empty one first), and evaluates only what
follows the shared prefix; so a prompt sharing only BOS with a slot's cache takes an empty slot
rather than evicting that cache. A request is placed in a free slot the moment it is submitted;
requests beyond the free slots wait in a FIFO queue of at most ``max_queue`` (more:
:class:`QueueFull`, a 503), where one whose client has gone no longer counts.

One worker thread runs the loop; each iteration:

1. starts the requests placed in slots (at submit, or from the queue when a slot came free) and
   frees the slots whose request was cancelled (the client went away);
2. runs one forward pass (:class:`~powerinfer.runtime.batch.BatchDecoder`) over the pending token
   of every generating slot and up to ``ubatch`` prompt tokens of the admitted requests (the
   earliest first, each token at its own position: a prompt is a run of entries of one sequence),
   so a running stream waits at most one step of ``ubatch`` prompt tokens plus the batch's own
   tokens between two of its tokens, and several new prompts share their weight reads;
3. samples each generating slot's next token (and the first token of a prompt just completed),
   streams its text, and ends the requests that are done: the slot is freed (and the next queued
   request placed there) before the request's "done" or "error" event is sent, so a client that
   sends its next request on "done" finds the slot free.

Every entry's numbers are those of token-by-token decoding (batch.py), so a request's tokens do
not depend on what else is in the batch: its greedy text alone and beside others is the same.

With ``-np 1`` this is the one-request-at-a-time FIFO server it was: one slot, whose KV cache is
the model's own (GPU offload included), the whole prompt in one prompt pass, the model's decode path.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import PowerInferError
from ..runtime.batch import BatchDecoder, new_cache, prefill
from ..runtime.generate import GenStats, sample
from ..runtime.kv_cache import KVCache
from ..runtime.model import Transformer
from ..runtime.session import StopMatcher, common_prefix, end_ids
from ..runtime.tokenizer import GGUFTokenizer, TextStream
from .engine import Job, QueueFull, Result

log = logging.getLogger("powerinfer.server")
DEFAULT_UBATCH = 32  # prompt tokens per batched step (-np > 1)
# --slot-prompt-similarity's default: 0.5, so that a prompt sharing only BOS with a slot's cache (a share
# of 1/n <= 0.5) never evicts it while another slot is free. llama.cpp's option has the same meaning; its
# default in the October 2026 source (common/common.h) is 0.1, under which a prompt of fewer than 10
# tokens sharing only BOS still takes the cached slot.
DEFAULT_SLOT_PROMPT_SIMILARITY = 0.5
MIN_USEFUL_SLOT_CTX = 64  # fewer tokens per slot: a warning (a prompt and a reply hardly fit)
JOIN_TIMEOUT_S = 30.0  # how long shutdown()/close() wait for the worker to leave the step it is in


@dataclass(eq=False)
class Slot:
    """One sequence's state. ``state``: ``idle``, ``prompt`` (evaluating its prompt) or ``generating``."""

    id: int
    n_ctx: int
    cache: KVCache | None = None  # made on first use
    cached: list[int] = field(default_factory=list)  # ids whose keys/values the cache holds, positions 0..
    state: str = "idle"
    job: Job | None = None
    n_done: int = 0  # prompt tokens in the cache
    pos: int = 0  # the position the pending token goes to
    pending: int | None = None  # the last sampled token, evaluated at the next step
    st: GenStats = field(default_factory=GenStats)
    t_admit: float = 0.0
    t_gen0: float = 0.0
    last_used: float = 0.0
    gen: torch.Generator | None = None
    history: list[int] | None = None
    last_n: int = 0
    stream: TextStream | None = None
    matcher: StopMatcher | None = None
    eos: frozenset[int] = frozenset()
    late: tuple[int, ...] = ()

    def info(self) -> dict:
        """The slot as ``GET /slots`` shows it."""
        job = self.job
        state = "prompt" if job is not None and self.state == "idle" else self.state  # placed, starts next step
        return {"id": self.id, "state": state, "is_processing": job is not None, "n_ctx": self.n_ctx,
                "n_cached": len(self.cached), "n_prompt_tokens": len(job.ids) if job else 0,
                "n_prompt_done": self.n_done if job else 0, "n_decoded": len(self.st.token_ids) if job else 0,
                "n_predict": job.n_predict if job else None}


class Scheduler:
    """``n_slots`` slots over one model and a worker thread; ``submit`` is called from the event loop.

    ``n_ctx``: tokens per slot (``model.n_ctx // n_slots``: llama-server too splits ``-c`` evenly
    across ``-np``, and neither refuses small slots; below :data:`MIN_USEFUL_SLOT_CTX` tokens a
    warning is logged); ``ubatch``: prompt tokens per batched step (``n_slots > 1``); ``ffn_mode``:
    :class:`BatchDecoder`'s; ``slot_prompt_similarity``: in [0, 1], the share of a prompt a slot's
    cache must exceed to be chosen for it (0: least recently used slot always, llama.cpp's
    meaning). Raises PowerInferError when the model cannot run several sequences (GPU offload with
    ``n_slots > 1``) or a slot's context would hold fewer than 2 tokens."""

    def __init__(self, model: Transformer, tok: GGUFTokenizer, n_slots: int = 1, max_queue: int = 64,
                 ubatch: int = DEFAULT_UBATCH, ffn_mode: str = "auto",
                 slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY):
        if n_slots < 1 or ubatch < 1:
            raise PowerInferError(f"-np {n_slots}, --ubatch-size {ubatch}: both must be at least 1")
        if not 0.0 <= slot_prompt_similarity <= 1.0:
            raise PowerInferError(f"--slot-prompt-similarity {slot_prompt_similarity}: must be in [0, 1]")
        self.model, self.tok = model, tok
        self.n_slots, self.max_queue, self.ubatch = n_slots, max_queue, ubatch
        self.similarity = slot_prompt_similarity
        self.n_ctx = model.n_ctx // n_slots
        if self.n_ctx < 2:
            raise PowerInferError(f"a context of {model.n_ctx} tokens split across -np {n_slots} slots leaves "
                                  f"{self.n_ctx} per slot: ask for a larger -c or fewer slots")
        if self.n_ctx < MIN_USEFUL_SLOT_CTX:
            log.warning("-c %d split across -np %d slots leaves %d tokens per slot (prompt and reply together; "
                        "fewer than %d): ask for -c %d or more, or fewer slots", model.n_ctx, n_slots, self.n_ctx,
                        MIN_USEFUL_SLOT_CTX, MIN_USEFUL_SLOT_CTX * n_slots)
        self.decoder = BatchDecoder(model, ffn_mode) if n_slots > 1 else None
        self.slots = [Slot(i, self.n_ctx) for i in range(n_slots)]
        if n_slots == 1:
            self.slots[0].cache = model.cache  # -np 1: the model's own cache (moved layers and all)
        self._queue: deque[Job] = deque()
        self._placed: list[Slot] = []  # slots given a job (by submit or _admit), not started yet
        self._cv = threading.Condition()
        self._live: set[Job] = set()
        self._closing: str | None = None
        self._stop = False
        self.n_served = self.n_cancelled = self.n_failed = 0
        self.n_prompt_tokens = self.n_predicted = self.n_decode_steps = self.n_decode_seqs = 0
        self.t_prompt = self.t_decode = 0.0
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="powerinfer-generate", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side
    @property
    def n_processing(self) -> int:
        """Slots holding a request."""
        return sum(s.job is not None for s in self.slots)

    @property
    def n_waiting(self) -> int:
        """Requests queued and not yet in a slot."""
        return len(self._queue)

    def submit(self, job: Job) -> None:
        """Place ``job`` in a free slot at once, else queue it; QueueFull when ``max_queue`` requests
        whose clients are still there already wait, or after :meth:`shutdown`."""
        with self._cv:
            if self._closing is not None:
                raise QueueFull(self._closing)
            self._drop_cancelled()
            if len(self._queue) >= self.max_queue and not any(s.job is None for s in self.slots):
                raise QueueFull(f"{len(self._queue)} requests are already waiting (--max-queue {self.max_queue})")
            self._live.add(job)
            self._queue.append(job)
            self._admit()
            self._cv.notify()

    def _drop_cancelled(self) -> None:
        """Forget the queued requests whose client has gone (called with the lock held)."""
        if any(j.cancel.is_set() for j in self._queue):
            keep = deque()
            for j in self._queue:
                if j.cancel.is_set():
                    self.n_cancelled += 1
                    self._live.discard(j)
                else:
                    keep.append(j)
            self._queue = keep

    def slots_info(self) -> list[dict]:
        return [s.info() for s in self.slots]

    def shutdown(self, reason: str = "the server is shutting down", timeout: float = JOIN_TIMEOUT_S) -> bool:
        """End every queued and running request now with an error event, stop the worker and wait
        (at most ``timeout`` seconds) for it to leave the step it is in, so no C kernel runs on
        after the process starts exiting. True when the worker has stopped."""
        with self._cv:
            self._closing = reason
            jobs = list(self._live)
            self._stop = True
            self._cv.notify()
        for job in jobs:
            job.cancel.set()
            job.emit("error", reason)
        return self._join(timeout)

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> bool:
        """Stop the worker after its current step (requests left as they are) and wait for it, at
        most ``timeout`` seconds; True when it has stopped."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        return self._join(timeout)

    def _join(self, timeout: float) -> bool:
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the generation worker is still in a step after %.0f s; exiting without it", timeout)
            return False
        return True

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        # OpenMP's thread count is per calling thread: the C kernels ask omp_get_max_threads(), which
        # in a new thread is the machine default, not what -t set in the main thread
        torch.set_num_threads(self._threads)
        while True:
            with self._cv:
                while not self._stop and not self._placed and not any(s.state != "idle" for s in self.slots):
                    self._cv.wait()
                if self._stop:
                    return
                self._admit()
                placed, self._placed = self._placed, []
            for s in placed:
                try:
                    self._start(s)
                except Exception as e:  # noqa: BLE001  (one bad request must not stop the worker)
                    self._fail(s, e)
            for s in self.slots:  # started slots only: one placed by submit() meanwhile waits for its start
                if s.state != "idle" and s.job.cancel.is_set():
                    self._finish(s, "cancelled")
            if self.decoder is None:  # -np 1: whole prompts and the model's decode path, as ever
                self._prompt_work()
                self._decode_step()
            else:
                self._batch_step()

    def _admit(self) -> None:
        """Waiting requests into free slots, onto ``_placed`` (called with the lock held)."""
        while self._queue:
            free = [s for s in self.slots if s.job is None]
            if not free:
                break
            job = self._queue.popleft()
            if job.cancel.is_set():
                self.n_cancelled += 1
                self._live.discard(job)
                continue
            slot = self._choose(free, job.ids)
            slot.job = job
            self._placed.append(slot)

    def _choose(self, free: list[Slot], ids: list[int]) -> Slot:
        """llama-server's slot choice: the free slot whose cache holds the largest share of ``ids``
        as a common prefix, if that share exceeds ``similarity`` (and similarity is not 0); else
        the least recently used free slot (never used ones first, then by id)."""
        if self.similarity > 0:
            best, best_sim = None, 0.0
            for s in free:
                if s.cached:
                    sim = common_prefix(s.cached, ids) / len(ids)
                    if sim > best_sim and sim > self.similarity:
                        best, best_sim = s, sim
            if best is not None:
                return best
        return min(free, key=lambda s: (s.last_used, s.id))

    def _start(self, s: Slot) -> None:
        job = s.job
        ids = job.ids
        if s.cache is None:
            s.cache = new_cache(self.model, self.n_ctx)
        n_past = min(common_prefix(s.cached, ids), len(ids) - 1)
        s.cached = s.cached[:n_past]
        s.n_done, s.pending, s.state = n_past, None, "prompt"
        s.st = GenStats(n_prompt=len(ids) - n_past, n_reused=n_past)
        s.t_admit = time.perf_counter()
        sm = job.sampler
        s.gen = None
        if sm.temp > 0:
            s.gen = torch.Generator()
            s.gen.manual_seed(sm.seed if sm.seed >= 0 else int(time.time_ns() % (1 << 31)))
        s.last_n = self.n_ctx if sm.repeat_last_n < 0 else sm.repeat_last_n
        s.history = list(ids) if sm.repeat_penalty != 1.0 and s.last_n > 0 else None
        s.stream, s.matcher = TextStream(self.tok, ids), StopMatcher(job.stop)
        s.eos, s.late = end_ids(self.tok, job.ignore_eos)

    def _prompt_work(self) -> None:
        waiting = [s for s in self.slots if s.state == "prompt"]
        if not waiting:
            return
        s = min(waiting, key=lambda s: s.t_admit)  # -np 1: the one slot, its whole prompt in one pass
        ids = s.job.ids
        n = len(ids) - s.n_done
        t0 = time.perf_counter()
        try:
            logits = prefill(self.model, s.cache, ids[s.n_done:s.n_done + n], s.n_done)
        except Exception as e:  # noqa: BLE001  (one bad request must not stop the server)
            self._fail(s, e)
            return
        dt = time.perf_counter() - t0
        s.st.t_prompt += dt
        self.t_prompt += dt
        self.n_prompt_tokens += n
        s.cached.extend(ids[s.n_done:s.n_done + n])
        s.n_done += n
        if s.n_done == len(ids):
            s.state, s.pos, s.t_gen0 = "generating", len(ids), time.perf_counter()
            self._next(s, logits)

    def _batch_step(self) -> None:
        """One forward pass (-np > 1): the pending token of every generating slot, and up to ``ubatch``
        prompt tokens of the admitted requests (earliest first) as entries at their own positions;
        a prompt evaluated so equals token-by-token decoding, bit for bit, batch or not."""
        gen = [s for s in self.slots if s.state == "generating" and s.pending is not None]
        toks, caches, pos, want = [], [], [], []
        for s in gen:
            want.append(len(toks))
            toks.append(s.pending)
            caches.append(s.cache)
            pos.append(s.pos)
        budget, chunks = self.ubatch, []
        for s in sorted((s for s in self.slots if s.state == "prompt"), key=lambda s: s.t_admit):
            if budget == 0:
                break
            ids = s.job.ids
            n = min(budget, len(ids) - s.n_done)
            toks.extend(ids[s.n_done:s.n_done + n])
            caches.extend([s.cache] * n)
            pos.extend(range(s.n_done, s.n_done + n))
            budget -= n
            done = s.n_done + n == len(ids)
            if done:
                want.append(len(toks) - 1)
            chunks.append((s, n, done))
        if not toks:
            return
        t0 = time.perf_counter()
        try:
            logits = self.decoder.step(toks, caches, pos, want)
        except Exception as e:  # noqa: BLE001
            for s in gen + [c[0] for c in chunks]:
                self._fail(s, e)
            return
        dt = time.perf_counter() - t0
        n_prompt = len(toks) - len(gen)
        self.t_prompt += dt * n_prompt / len(toks)  # the step's time shared by entry
        self.n_prompt_tokens += n_prompt
        if gen:
            self.t_decode += dt * len(gen) / len(toks)
            self.n_decode_steps += 1
            self.n_decode_seqs += len(gen)
        self._advance(gen, logits)
        k = len(gen)
        for s, n, done in chunks:
            s.st.t_prompt += dt
            s.cached.extend(s.job.ids[s.n_done:s.n_done + n])
            s.n_done += n
            if done:
                s.state, s.pos, s.t_gen0 = "generating", s.n_done, time.perf_counter()
                self._next(s, logits[k])
                k += 1

    def _decode_step(self) -> None:
        """-np 1: the one slot's pending token through the model's decode path."""
        run = [s for s in self.slots if s.state == "generating" and s.pending is not None]
        if not run:
            return
        t0 = time.perf_counter()
        try:
            logits = prefill(self.model, run[0].cache, [run[0].pending], run[0].pos)[None]
        except Exception as e:  # noqa: BLE001
            for s in run:
                self._fail(s, e)
            return
        self.t_decode += time.perf_counter() - t0
        self.n_decode_steps += 1
        self.n_decode_seqs += len(run)
        self._advance(run, logits)

    def _advance(self, run: list[Slot], logits) -> None:
        """Each slot of ``run`` has evaluated its pending token (its logits the matching row)."""
        for s, lg in zip(run, logits):
            s.cached.append(s.pending)
            s.pos += 1
            s.st.n_eval += 1
            self._next(s, lg)

    def _next(self, s: Slot, logits: torch.Tensor) -> None:
        """Sample slot ``s``'s next token from ``logits`` ``[V]``, stream it, end the request when done
        (the rules of :func:`~powerinfer.runtime.generate.generate`); an error in sampling or text ends
        that request alone."""
        job = s.job
        try:
            self._sample_next(s, logits)
        except Exception as e:  # noqa: BLE001  (one bad request must not stop the worker)
            if s.job is job:
                self._fail(s, e)
            else:  # failed after the request ended: nobody left to tell
                log.exception("after a request ended", exc_info=e)

    def _sample_next(self, s: Slot, logits: torch.Tensor) -> None:
        job, st = s.job, s.st
        s.pending = None
        if job.n_predict == 0:  # max_tokens 0: the prompt only, as generate() does
            return self._finish(s, "n_predict")
        tok = sample(logits, job.sampler, s.gen, s.history[-s.last_n:] if s.history is not None else ())
        if tok in s.eos or (st.token_ids and tok in s.late):
            return self._finish(s, "eos")
        st.token_ids.append(tok)
        self.n_predicted += 1
        if s.history is not None:
            s.history.append(tok)
            del s.history[:-s.last_n]
        piece = s.matcher.feed(s.stream.push(tok))
        if piece:
            job.emit("text", piece)
        if len(st.token_ids) == job.n_predict:
            return self._finish(s, "n_predict")
        if s.matcher.matched is not None or job.cancel.is_set():
            return self._finish(s, "cancelled")
        if s.pos >= self.n_ctx:
            return self._finish(s, "context")
        s.pending = tok

    def _finish(self, s: Slot, stop: str) -> None:
        job, st = s.job, s.st
        st.stop = stop
        st.n_gen = len(st.token_ids)
        if s.state == "generating":
            st.t_gen = time.perf_counter() - s.t_gen0
        tail = s.matcher.flush() if s.matcher is not None else ""
        if tail and not job.cancel.is_set():
            job.emit("text", tail)
        res = None
        if job.cancel.is_set():
            self.n_cancelled += 1
            if self._closing is None:
                log.info("slot %d: request cancelled after %d tokens (client gone)", s.id, st.n_gen)
        else:
            self.n_served += 1
            if s.matcher is not None and s.matcher.matched is not None:
                res = Result("stop", "word", s.matcher.matched, st)
            elif stop == "eos":
                res = Result("stop", "eos", "", st)
            else:
                res = Result("length", "limit", "", st)
        self._free(s)
        if res is not None:
            job.emit("done", res)

    def _fail(self, s: Slot, e: Exception) -> None:
        job = s.job
        if isinstance(e, PowerInferError):
            msg = str(e)
        else:
            log.exception("generation failed", exc_info=e)
            msg = f"internal error: {type(e).__name__}: {e}"
        self.n_failed += 1
        s.cached = []  # what the cache holds is unknown now
        self._free(s)
        job.emit("error", msg)

    def _free(self, s: Slot) -> None:
        """The slot idle again, and the next queued request placed (the event is sent after this)."""
        job = s.job
        s.stream = s.matcher = s.gen = s.history = None
        with self._cv:
            s.job, s.state, s.pending, s.last_used = None, "idle", None, time.perf_counter()
            self._live.discard(job)
            self._admit()

"""Perplexity of a GGUF or PowerInfer GGUF, computed the way llama.cpp's ``llama-perplexity`` does.

Follows ``perplexity()`` in llama.cpp's ``examples/perplexity/perplexity.cpp`` (checked
against tag b4747, the default path without ``--ppl-stride``):

* the whole text is tokenized once, with BOS first when the vocabulary adds BOS
  (``common_tokenize(ctx, text, add_special=true)``); a text file loses one trailing ``\\n``
  (``-f`` in llama.cpp's ``common/arg.cpp``);
* the tokens are cut into non-overlapping chunks of ``n_ctx`` tokens (the tail that does not
  fill a chunk is dropped) and at least ``2 * n_ctx`` tokens are required;
* each chunk is evaluated from position 0 with a fresh cache, its first token replaced by BOS
  when the vocabulary adds BOS, in prompt batches of ``n_batch`` tokens;
* only the second half is scored: with ``first = n_ctx // 2``, the logits at positions
  ``first .. n_ctx - 2`` predict tokens ``first + 1 .. n_ctx - 1`` (``n_ctx - first - 1`` tokens
  per chunk);
* the negative log-probabilities ``v`` are summed (``nll``) and so are their squares (``nll2``);
  after each chunk the running value ``exp(nll / count)`` is reported (``[1]12.3456,[2]...``);
  at the end ``PPL = exp(mean v)`` and its uncertainty is
  ``PPL * sqrt((mean v^2 - (mean v)^2) / (count - 1))``.

The log-softmax is taken in float64 from the model's float32 logits (llama.cpp: ``expf`` of
float32 differences summed in double). Where llama.cpp would evaluate several chunks as
parallel sequences (``-b`` larger than ``-c``) we evaluate them one after the other: the
numbers are the same.

``active_share`` is the mean share of FFN neurons computed per token and layer over every
evaluated token (prompt positions included), from the runtime's own counters; None when every
neuron is computed (a dense file or dense mode).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import PowerInferError
from ..runtime.model import Transformer

LOGSOFTMAX_ROWS = 64  # rows per float64 log-softmax: bounds memory for large vocabularies


@dataclass
class ChunkInfo:
    """What :func:`perplexity` reports after each chunk (for progress output)."""

    index: int  # 1-based
    n_chunks: int
    running_ppl: float  # exp(mean nll) over every chunk so far
    seconds: float  # wall time of this chunk's forward passes and scoring
    n_ctx: int


@dataclass
class PerplexityResult:
    """Perplexity over ``n_chunks`` chunks of ``n_ctx`` tokens (llama.cpp's definitions).

    ``ppl``: ``exp`` of the mean negative log-likelihood (nats) of the scored tokens;
    ``stderr``: llama.cpp's uncertainty of ``ppl`` (NaN when it is undefined: fewer than two
    scored tokens or zero variance); ``chunk_ppl``: the running value after each chunk, as
    printed by llama.cpp; ``nll``: the mean negative log-likelihood in nats;
    ``n_tokens_scored`` = ``n_chunks * (n_ctx - n_ctx // 2 - 1)``; ``active_share``: mean share
    of FFN neurons computed (None when dense); ``seconds``: wall time of the evaluation.
    """

    ppl: float
    stderr: float
    nll: float
    chunk_ppl: list[float]
    n_tokens_scored: int
    n_ctx: int
    n_chunks: int
    active_share: float | None
    seconds: float = 0.0
    token_nll: list[float] = field(default_factory=list, repr=False)  # per scored token, chunk order


MAX_TEXT_BYTES = 256 << 20  # -f: larger texts are refused (wiki.test.raw is 1.3 MB)


def read_text(path: str | Path) -> str:
    """The text of ``path`` as llama.cpp's ``-f`` reads it: whole file, one trailing ``\\n`` removed.

    Raises PowerInferError for a missing/unreadable file, anything but a regular file (a FIFO
    would block, ``/dev/zero`` never ends), a file over :data:`MAX_TEXT_BYTES`, text that is not
    UTF-8, or an empty text.
    """
    import stat

    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise PowerInferError(f"{p}: file not found") from None
    except OSError as e:
        raise PowerInferError(f"{p}: cannot read it ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise PowerInferError(f"{p}: is a directory, expected a text file")
    if not stat.S_ISREG(st.st_mode):
        raise PowerInferError(f"{p}: not a regular file (a pipe or device); give a text file")
    if st.st_size > MAX_TEXT_BYTES:
        raise PowerInferError(f"{p}: {st.st_size / 2**20:.0f} MiB, more than the {MAX_TEXT_BYTES >> 20} MiB of text "
                              "pi-perplexity reads (cut it, or use --chunks on a shorter file)")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)  # bounded even if the file grows meanwhile
    except OSError as e:
        raise PowerInferError(f"{p}: cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_TEXT_BYTES:
        raise PowerInferError(f"{p}: more than the {MAX_TEXT_BYTES >> 20} MiB of text pi-perplexity reads")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PowerInferError(f"{p}: not UTF-8 text (byte {e.start})") from None
    text = text.removesuffix("\n")
    if not text.strip():
        raise PowerInferError(f"{p}: the text is empty")
    return text


def chunk_tokens(ids: Sequence[int], n_ctx: int, n_chunks: int | None = None,
                 bos_id: int | None = None) -> list[list[int]]:
    """Cut ``ids`` (the whole text's tokens) into ``n_chunks`` chunks of ``n_ctx`` tokens.

    ``n_chunks`` None means every whole chunk (``len(ids) // n_ctx``); a larger value is capped
    there, as llama.cpp does. With ``bos_id`` given (the vocabulary adds BOS), each chunk's first
    token is replaced by it. Raises PowerInferError when there are fewer than ``2 * n_ctx``
    tokens (llama.cpp's requirement) or when ``n_ctx < 4`` or ``n_chunks <= 0``.
    """
    if n_ctx < 4:
        raise PowerInferError(f"-c {n_ctx}: the context must be at least 4 tokens (half of it is scored)")
    if n_chunks is not None and n_chunks <= 0:
        raise PowerInferError(f"--chunks {n_chunks}: must be > 0 (omit it for every chunk)")
    if len(ids) < 2 * n_ctx:
        raise PowerInferError(f"the text tokenizes to only {len(ids)} tokens; at least {2 * n_ctx} "
                              f"(2 x -c {n_ctx}) are needed, as in llama.cpp: use a longer text or a smaller -c")
    n_max = len(ids) // n_ctx
    n = n_max if n_chunks is None else min(n_chunks, n_max)
    chunks = []
    for i in range(n):
        c = list(ids[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            c[0] = bos_id
        chunks.append(c)
    return chunks


def chunk_logits(model: Transformer, ids: Sequence[int], first: int, n_batch: int) -> torch.Tensor:
    """Evaluate one chunk from position 0 in batches of ``n_batch`` tokens.

    Returns the float32 logits ``[len(ids) - first, V]`` of positions ``first .. len(ids) - 1``.
    Batches that end before ``first`` only fill the KV cache (their logits are not needed).
    The cache needs no clearing: attention at position ``p`` reads cache rows ``< p + T`` only,
    all written by this chunk.
    """
    out = []
    with torch.inference_mode():
        for b0 in range(0, len(ids), n_batch):
            toks = torch.tensor(ids[b0:b0 + n_batch], dtype=torch.long)
            if b0 + toks.numel() <= first:
                model.forward(toks, b0)
            else:
                logits = model.forward(toks, b0, all_logits=True)  # [T, V]
                out.append(logits[max(0, first - b0):])
    return torch.cat(out)


def token_nll(logits: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """Negative log-probabilities (nats, float64 ``[N]``) of ``targets`` under ``logits`` ``[N, V]``."""
    tgt = torch.tensor(targets, dtype=torch.long)
    parts = []
    for r0 in range(0, logits.shape[0], LOGSOFTMAX_ROWS):
        lp = torch.log_softmax(logits[r0:r0 + LOGSOFTMAX_ROWS].double(), dim=-1)
        parts.append(-lp.gather(1, tgt[r0:r0 + LOGSOFTMAX_ROWS, None])[:, 0])
    return torch.cat(parts)


def ppl_and_stderr(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    """llama.cpp's final estimate from the sums of ``v`` and ``v^2`` over ``count`` scored tokens:
    ``(exp(mean v), exp(mean v) * sqrt(var / (count - 1)))`` with ``var = mean v^2 - (mean v)^2``;
    the second is NaN when ``count < 2`` or ``var <= 0`` (llama.cpp prints an error there)."""
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    if count < 2 or var <= 0:
        return ppl, float("nan")
    return ppl, ppl * math.sqrt(var / (count - 1))


def reset_ffn_stats(model: Transformer) -> None:
    """Zero every FFN's counters so :meth:`Transformer.active_share` covers what follows."""
    for layer in model.layers:
        layer.ffn.reset_stats()


def perplexity(model: Transformer, chunks: Sequence[Sequence[int]], n_batch: int | None = None,
               on_chunk: Callable[[ChunkInfo], None] | None = None) -> PerplexityResult:
    """Perplexity of ``model`` (as it is set up: dense, predictor or oracle masks) on ``chunks``.

    ``chunks``: equal-length token id lists from :func:`chunk_tokens` (BOS already in place);
    ``n_batch``: tokens per forward call (default: the whole chunk; 1 decodes token by token
    through the runtime's T = 1 kernels). ``on_chunk`` is called after each chunk. The FFN
    counters are reset first. Raises PowerInferError when a chunk does not fit the model's
    context or the chunks differ in length.
    """
    if not chunks:
        raise PowerInferError("no chunks to evaluate")
    n_ctx = len(chunks[0])
    if any(len(c) != n_ctx for c in chunks):
        raise PowerInferError("every chunk must have the same length")
    if n_ctx > model.n_ctx:
        raise PowerInferError(f"chunks of {n_ctx} tokens exceed the model's context length {model.n_ctx}")
    if n_batch is not None and n_batch <= 0:
        raise PowerInferError(f"-b {n_batch}: must be > 0")
    n_batch = min(n_batch or n_ctx, n_ctx)
    first = n_ctx // 2
    reset_ffn_stats(model)
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    all_nll: list[float] = []
    t_start = time.perf_counter()
    for k, ids in enumerate(chunks):
        t0 = time.perf_counter()
        logits = chunk_logits(model, ids, first, n_batch)  # [n_ctx - first, V]
        v = token_nll(logits[:-1], ids[first + 1:])  # positions first .. n_ctx-2 predict the next token
        nll_sum += float(v.sum())
        nll2_sum += float((v * v).sum())
        count += v.numel()
        all_nll.extend(v.tolist())
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(ChunkInfo(k + 1, len(chunks), running[-1], time.perf_counter() - t0, n_ctx))
    ppl, stderr = ppl_and_stderr(nll_sum, nll2_sum, count)
    return PerplexityResult(ppl=ppl, stderr=stderr, nll=nll_sum / count, chunk_ppl=running,
                            n_tokens_scored=count, n_ctx=n_ctx, n_chunks=len(chunks),
                            active_share=model.active_share(), seconds=time.perf_counter() - t_start,
                            token_nll=all_nll)

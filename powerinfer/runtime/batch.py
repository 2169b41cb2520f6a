"""Batched decoding: one new token for each of ``B`` sequences in one forward pass.

Each sequence has its own KV cache (:class:`~powerinfer.runtime.kv_cache.KVCache` of its own
length, resident only as positions are written) and its own position. One step runs the
Transformer's layers once over ``x`` ``[B, D]``:

* dense products (QKV, attention output, predictors, the output head) take all ``B`` tokens
  in one kernel call, so each weight is read once per step, not once per sequence
  (``pi_x8_gemm``/``pi_q_gemm`` tiles of several tokens);
* attention is per sequence: RoPE at its own position, its keys and values written to its
  own cache, one query against its own ``0..pos`` (:func:`kernels.attend_many`: all of the step's
  queries in one call, each with :func:`kernels.attend_one`'s numbers);
* the sparse FFN runs either **per sequence** (the one-call decode of each token,
  ``sparse_ffn.c``: each reads its own predicted-active rows) or over the **union** of the
  ``B`` tokens' predicted-active neurons (each row of the union read once and dotted with every
  token that selected it, :func:`kernels.rows_dot_multi`; the down rows likewise,
  :func:`kernels.rows_axpy_multi`). Hot neurons are shared between tokens, so the union grows
  slower than ``B``; which wins is measured (``benchmarks/bench_batch_ffn.py``) and
  :data:`UNION_MIN_BATCH` holds the crossover.

Numbers: every kernel used on several tokens computes each token's values with the same
block products, sums and order as the one-token kernel, so a sequence decoded in a batch gets
bit for bit the logits it gets alone (``tests/test_batch.py`` checks logits and greedy tokens).
A product whose several-token kernel would round differently (an f32 or torch-backend matrix,
where ``F.linear`` on ``[B, D]`` sums in another order than the C matrix-vector kernel) runs
token by token instead: exact, but it reads such a weight ``B`` times (f32 test models only;
quantized and 16-bit files on the C kernels take the shared path).

Not supported: GPU offload (``--vram-budget``) and a RAM budget (``--ram-budget``);
:func:`check_batchable` says so.

Shapes: ``B`` sequences in the step, ``D = n_embd``, ``V`` vocabulary.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from ..errors import PowerInferError
from ..quant.qweight import QWeight
from . import kernels
from .kernels import attend_many, embed, linear
from .kv_cache import KVCache, store
from .model import Layer, Transformer

# Union rows from this batch size on, per-sequence rows below it (measured with
# benchmarks/bench_batch_ffn.py on the 4-layer 7B-shaped Q4_0 model, 2 threads; see the README).
UNION_MIN_BATCH = 2
# values of n_embd each token's down rows are summed over before the next token's (0: a thread's
# whole slice). Measured on the 4-layer 7B-shaped Q4_0 model, 8 sequences, 2 threads: 0, 256, 512
# and 1024 all within the noise (29.4-30.4 ms of FFN per step): the union's rows stay in cache.
AXPY_CHUNK = 0
FFN_MODES = ("auto", "union", "per-seq")


def new_cache(model: Transformer, n_ctx: int) -> KVCache:
    """A KV cache of ``n_ctx`` positions for one sequence of ``model``, in the model's cache types
    (``model.cache_dtypes``; memory is taken as positions are written). Raises PowerInferError when ``n_ctx`` is not in ``1..model.n_ctx``."""
    if not 1 <= n_ctx <= model.n_ctx:
        raise PowerInferError(f"a sequence's context of {n_ctx} tokens is outside 1..{model.n_ctx}")
    a = model.args
    return KVCache(a.n_layer, n_ctx, a.n_head_kv, a.head_dim, *model.cache_dtypes)


def check_batchable(model: Transformer) -> None:
    """PowerInferError when ``model`` cannot decode several sequences at once (GPU offload, or a RAM
    budget: its FFN rows are not full matrices the batched kernels could read)."""
    if getattr(model, "teal", None) is not None:
        raise PowerInferError("several sequences at once (-np > 1) do not run input-sparse (TEAL) files yet: "
                              "run them with -np 1")
    if model.placement is not None:
        raise PowerInferError("several sequences at once (-np > 1) do not run with GPU offload (--vram-budget) yet")
    if getattr(model, "per_layer_attention", False):
        raise PowerInferError("several sequences at once (-np > 1) do not run SmallThinker files yet (per-layer RoPE "
                              "and window, pre-attention router): run them with -np 1")
    if getattr(model, "residency", None) is not None:
        raise PowerInferError("several sequences at once (-np > 1) do not run under a RAM budget (--ram-budget) yet: "
                              "the batched steps read every sequence's FFN rows from full matrices")


def cache_len(cache: KVCache) -> int:
    """Positions ``cache`` holds (layer 0's, wherever that layer lives)."""
    return cache.layer(0)[0].shape[0]


@contextmanager
def using_cache(model: Transformer, cache: KVCache) -> Iterator[None]:
    """``model.forward`` reads and writes ``cache`` inside the block (one thread at a time)."""
    saved = model.cache
    model.cache = cache
    try:
        yield
    finally:
        model.cache = saved


def prefill(model: Transformer, cache: KVCache, tokens: Sequence[int], pos: int) -> torch.Tensor:
    """Evaluate ``tokens`` of one sequence at positions ``pos..`` into ``cache`` (the model's
    prompt path); returns the last token's logits ``[V]`` fp32. PowerInferError past the cache."""
    n_ctx = cache_len(cache)
    if pos + len(tokens) > n_ctx or not tokens:
        raise PowerInferError(f"{pos + len(tokens)} tokens exceed the sequence's context of {n_ctx}")
    with using_cache(model, cache), torch.inference_mode():
        return model.forward(torch.tensor(list(tokens), dtype=torch.long), pos)


def _shared(w) -> bool:
    """True when one kernel call on several tokens gives each the numbers it gets alone
    (quantized or 16-bit weights on the C kernels, row or x8 layout)."""
    if isinstance(w, (list, tuple)):
        return all(_shared(p) for p in w)
    return (isinstance(w, QWeight) and not w.transposed and kernels.backend() == "c"
            and (w.layout == "x8" or kernels._q_c_ok(w)))


def _rows_ok(f) -> bool:
    """The C row kernels take ``f``'s sparse rows (:meth:`kernels.SparseFFNCall.takes`, the one-call
    decode's conditions but biases: the union adds OPT's biases per row as :meth:`FFN.rows
    <powerinfer.runtime.ffn.FFN.rows>` does for one token)."""
    return kernels.SparseFFNCall.takes(f.family.ffn, f.act.kind, f.fc1, f.fc2, f.gate, f.up, f.down_t)


def blinear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kernels.linear` on ``[B, K]``: one call per :data:`kernels.QGEMM_MAX_T` rows (weights read
    once per call) where that gives each row its one-token numbers, else row by row."""
    B, n = x.shape[0], kernels.QGEMM_MAX_T
    if B == 1 or (_shared(w) and B <= n):
        return linear(x, w, b)
    if _shared(w):
        return torch.cat([linear(x[i:i + n], w, b) for i in range(0, B, n)])
    return torch.cat([linear(x[i:i + 1], w, b) for i in range(B)])


class BatchDecoder:
    """Decodes one token for each of several sequences of ``model`` per :meth:`step`.

    ``ffn_mode``: ``auto`` (union rows from :data:`UNION_MIN_BATCH` sequences on), ``union`` or
    ``per-seq``. ``stats`` counts the FFN calls taken each way and their seconds (``t_union``,
    ``t_per-seq``, predictors included), and the seconds of the dense products (``t_dense``: QKV,
    attention output and the output head, for the whole batch) and of the per-sequence attention
    over the caches (``t_attend``: RoPE, cache writes, one query each).
    """

    def __init__(self, model: Transformer, ffn_mode: str = "auto"):
        if ffn_mode not in FFN_MODES:
            raise ValueError(f"ffn_mode {ffn_mode!r}: expected one of {', '.join(FFN_MODES)}")
        check_batchable(model)
        self.model, self.ffn_mode = model, ffn_mode
        self.stats = {"union": 0, "per-seq": 0, "t_union": 0.0, "t_per-seq": 0.0, "t_dense": 0.0, "t_attend": 0.0}

    # ------------------------------------------------------------------ one step
    def step(self, tokens: Sequence[int], caches: Sequence[KVCache], positions: Sequence[int],
             logits_for: Sequence[int] | None = None) -> torch.Tensor:
        """Run token ``tokens[b]`` at position ``positions[b]`` with cache ``caches[b]``, for every entry
        ``b``. A cache may appear several times (a sequence's prompt tokens at consecutive positions):
        every entry's keys and values are written before any attends, so entry ``b`` sees its cache's
        positions ``0..positions[b]``, earlier ones written before this step or in it. Returns fp32 logits
        ``[len(logits_for), V]`` for the entries ``logits_for`` (default: all, ``[B, V]``). The last layer
        runs attention, its output product and the FFN for those entries only (the others need just their
        keys and values there), as llama.cpp skips the outputs nobody reads.
        Raises PowerInferError when a position is past its cache, repeats, or the lists differ in length."""
        B = len(tokens)
        if not (B == len(caches) == len(positions)) or B == 0:
            raise PowerInferError(f"a batch step needs one token, cache and position per sequence "
                                  f"(got {len(tokens)}, {len(caches)}, {len(positions)})")
        seen = set()
        for c, p in zip(caches, positions):
            if not 0 <= p < cache_len(c):
                raise PowerInferError(f"position {p} is past a sequence's context of {cache_len(c)} tokens")
            if (id(c), p) in seen:
                raise PowerInferError(f"position {p} of one sequence twice in a batch step")
            seen.add((id(c), p))
        m = self.model
        with torch.inference_mode():
            x = embed(m.tok_embd, torch.tensor(list(tokens), dtype=torch.long)).to(m.dtype)  # [B, D]
            if m.pos_embd is not None:
                off = m.args.family.learned_pos_offset
                x = x + m.pos_embd[torch.tensor([p + off for p in positions])]
            keep = None if logits_for is None else torch.tensor(list(logits_for), dtype=torch.long)
            last = len(m.layers) - 1
            for i, layer in enumerate(m.layers):
                x = self._block(i, layer, x, caches, positions, keep if i == last else None)
            if x.shape[0] == 0:  # no logits asked for (a step of prompt chunks)
                return torch.empty(0, m.output.shape[0], dtype=torch.float32)
            return self._dense(m.output_norm(x), m.output).float()

    def _block(self, i: int, layer: Layer, x, caches, positions, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One layer over the entries ``[B, D]``; with ``keep`` (entry indices), every entry's keys and
        values are written but the output ``[len(keep), D]`` holds the ``keep`` entries only."""
        if keep is not None and keep.numel() == 0:  # no entry's output is read: keys and values only
            self._attention(i, layer, layer.attn_norm(x), caches, positions, keep)
            return x[keep]
        if self.model.args.family.parallel_attn:
            xa = layer.attn_norm(x)
            a = self._attention(i, layer, xa, caches, positions, keep)
            if keep is not None:
                x, xa = x[keep], xa[keep]
            xn = xa if layer.ffn_norm is layer.attn_norm else layer.ffn_norm(x)
            return x + a + self._ffn(i, layer, x, xn)
        a = self._attention(i, layer, layer.attn_norm(x), caches, positions, keep)
        x = (x if keep is None else x[keep]) + a
        return x + self._ffn(i, layer, x, layer.ffn_norm(x))

    def _attention(self, i: int, layer: Layer, x: torch.Tensor, caches, positions,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        a, hd = m.args, m.args.head_dim
        qkv = self._dense(x, layer.wqkv, layer.bqkv)  # [B, (Hq + 2Hkv) d]: every sequence's QKV from one read
        t0 = time.perf_counter()
        q, k, v = qkv.split([a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], dim=-1)
        W, B = a.sliding_window, x.shape[0]
        q, k, v = q.reshape(B, a.n_head, hd), k.reshape(B, a.n_head_kv, hd), v.reshape(B, a.n_head_kv, hd)
        q, k = layer.norm_qk(q, k)  # Qwen3's per-head norms (row by row, as alone)
        if m.rope is not None:  # elementwise: each row as it is alone (tests/test_batch.py checks the bits)
            p = torch.tensor(list(positions), dtype=torch.long)
            cos, sin = m.cos[p], m.sin[p]
            q, k = m.rope(q, cos, sin), m.rope(k, cos, sin)
        for b, (cache, pos) in enumerate(zip(caches, positions)):  # every entry's keys and values first
            ck, cv = cache.layer(i)
            store(ck, pos, k[b:b + 1])
            store(cv, pos, v[b:b + 1])
        rows = range(B) if keep is None else keep.tolist()
        if not rows:
            return x[:0]
        ks, vs = [], []
        for b in rows:  # then one query each (the kept entries') against its cache, in one call
            ck, cv = caches[b].layer(i)
            pos = positions[b]
            k0 = max(0, pos + 1 - W) if W else 0
            ks.append(ck[k0:pos + 1])
            vs.append(cv[k0:pos + 1])
        out = attend_many(q if keep is None else q[keep], ks, vs).reshape(len(rows), a.n_head * hd)
        self.stats["t_attend"] += time.perf_counter() - t0
        return self._dense(out, layer.wo, layer.bo)

    def _dense(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        y = blinear(x, w, b)
        self.stats["t_dense"] += time.perf_counter() - t0
        return y

    # ------------------------------------------------------------------ FFN
    def union_ok(self, layer: Layer, B: int) -> bool:
        """True when layer's FFN can run as union rows for ``B`` tokens (sparse, C kernels, one
        quantized type, the one-call decode's conditions, predictors batchable)."""
        f = layer.ffn
        return (self.model.mask_fn is None and f.sparse and not self.model.dense and 1 < B <= kernels.QGEMM_MAX_T
                and _rows_ok(f) and _shared(f.fc1) and _shared(f.fc2))

    def mode_for(self, layer: Layer, B: int) -> str:
        """``union`` or ``per-seq`` for this layer's FFN at batch size ``B``."""
        if not self.union_ok(layer, B):
            return "per-seq"
        if self.ffn_mode == "auto":
            return "union" if B >= UNION_MIN_BATCH else "per-seq"
        return self.ffn_mode

    def _ffn(self, i: int, layer: Layer, h: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        m, B, n = self.model, h.shape[0], kernels.QGEMM_MAX_T
        if B > n:  # the several-token kernels take at most n tokens a call
            return torch.cat([self._ffn(i, layer, h[j:j + n], xn[j:j + n]) for j in range(0, B, n)])
        mode = self.mode_for(layer, B)
        t0 = time.perf_counter()
        if mode == "union":
            out = self.ffn_union(layer, h, xn)
        elif self._dense_shared(layer):
            out = m._ffn(i, layer, h, xn)  # dense: every weight read once for the batch
        else:
            out = torch.cat([m._ffn(i, layer, h[b:b + 1], xn[b:b + 1]) for b in range(B)])
        self.stats[mode] += 1
        self.stats["t_" + mode] += time.perf_counter() - t0
        return out

    def _dense_shared(self, layer: Layer) -> bool:
        """A dense FFN whose three products can take the batch in one call each (a mixture of experts,
        :mod:`.moe`: the union of the experts the batch's tokens route to, each run once on its tokens)."""
        f = layer.ffn
        if hasattr(f, "batch_shared"):
            return self.model.mask_fn is None and f.batch_shared
        return (not f.sparse and self.model.mask_fn is None and _shared([w for w in (f.gate, f.up) if w is not None])
                and isinstance(f.down_t, QWeight) and f.down_t.transposed and _shared(f.down_t.T))

    def ffn_union(self, layer: Layer, h: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        """The sparse FFN of ``B`` tokens over the union of their predicted-active neurons: ``[B, D]``.

        Each token computes exactly its own predicted rows (the others are masked to 0, and
        zero coefficients are skipped in the down sum), so its output equals the one-call decode's."""
        f = layer.ffn
        t0 = time.perf_counter()
        mask = kernels.predict(h, f.fc1, f.fc2, f.threshold)  # [B, F]: predictor weights read once
        f.t_predict += time.perf_counter() - t0
        idx = mask.any(0).nonzero().view(-1)  # [n] ascending: the union
        sel = mask[:, idx]  # [B, n]
        if f.gate is not None:
            g, u = kernels.rows_dot_multi(xn, idx, sel, f.gate, f.up, f.gate_min)
        else:
            g, u = None, kernels.rows_dot_multi(xn, idx, sel, f.up)[0]
        if f.gate_b is not None:  # biases (OPT) on each token's own rows, as FFN.rows adds them;
            g = torch.where(sel, g + f.gate_b[idx], 0.0)  # the rows a token did not select stay 0
        if f.up_b is not None:
            u = torch.where(sel, u + f.up_b[idx], 0.0)
        hidden = f.family.combine(f.act, g, u)  # the family's rule, as FFN.rows applies it
        out = kernels.rows_axpy_multi(idx, f.down_t, hidden, AXPY_CHUNK).to(xn.dtype)
        f.n_calls += h.shape[0]
        f.n_active += int(sel.sum())
        f.t_ffn += time.perf_counter() - t0
        return out if f.down_b is None else out + f.down_b


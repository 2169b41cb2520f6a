"""Sparse ReLU-gated experts: inside each routed expert only the rows of the neurons that fire.

A ReLU-gated expert (SmallThinker; ``relu(gate x) * up x`` then ``down``) computes neuron ``j``'s up
row and down column for nothing when ``gate_j . x <= 0``: its hidden value is exactly 0. Without a
predictor the gate is the predictor, as in the one-token sparse FFN of dense files
(:class:`~.kernels.SparseFFNCall`): every gate row of the expert is dotted with ``x``, then only the up
rows of the neurons whose gate is positive, then only their down columns. A dReLU expert
(``relu(gate x) * relu(up x)``) is the same with ``relu`` on the up product too (``FFN_KINDS``).

The down matrix is stored output-major (``ffn_down_exps``: ``[n_embd, n_ff_exp]`` per expert, blocks of
32 along ``n_ff_exp``), so a fired neuron is a column spread over every row's blocks. At load it is
re-laid out (``sparse_experts.c``, down kinds):

* Q4_0/Q8_0: by block column, the same bytes (:class:`DownCols`): the scales of block ``b`` for every
  row, then each neuron's quants as one row; the hidden vector is rounded to 8-bit blocks as the dense
  product rounds it and only the blocks with a fired neuron are read, each fired neuron's quants once;
* f16/bf16: the transpose ``down_t`` ``[n_ff_exp, n_embd]`` (exact, same bytes), one AXPY per fired neuron;
* K-quants and Q5_0/Q5_1: no exact re-layout (the blocks run along ``n_ff_exp``); the down product stays
  dense (every row, on the sparse hidden vector), gate and up as above.

Outputs equal the dense expert's up to float summation order (``tests/test_sparse_experts.py``). A decode
step is one C call per layer over the token's ``k`` experts in ascending order, summed with the router's
weights as :class:`~.moe.ExpertsFFN` sums them. A prompt is grouped by expert as the dense experts group
it: each hit expert's gate is read once for all its tokens, then each token reads its own fired up rows
and down columns (``benchmarks/bench_sparse_experts.py`` measures prompts and decode against dense experts).

Used for every ReLU-expert file the C kernels compute in place (:func:`build`), unless ``dense``
(``pi-run --dense``); f32 files and the torch backend keep dense experts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES, QWeight
from . import kernels
from .args import ModelArgs
from .moe import ExpertArgs, ExpertsFFN, load_experts
from .weights import _NATIVE, _release, _tensor, empty, load_tensor, mapped_rows, tensor_shape, weight_nbytes

QK = 32
DOWN_COLS, DOWN_ROWS, DOWN_DENSE = 0, 1, 2  # sparse_experts.c's down_kind
FFN_KINDS = {"reglu": 0, "dreglu": 1}  # relu(g) * u, relu(g) * relu(u)
COLS_TYPES = ("Q4_0", "Q8_0")
ROWS_TYPES = ("F16", "BF16")
EXPERT_CHUNK = 8  # experts re-laid out at a time (bounds the transient copies)


@dataclass(eq=False)
class DownCols:
    """One expert's Q4_0/Q8_0 ``down`` ``[D, F]`` by block column: ``scales`` uint8 ``[F/32, 2 D]``
    (the f16 scale of block ``b`` of each row ``d``), ``quants`` uint8 ``[F, D/2]`` (Q4_0: per 32 values of
    ``d`` 16 bytes, value ``i`` in the low nibble of byte ``i``, value ``i + 16`` in its high nibble) or
    ``[F, D]`` (Q8_0, int8). The same bytes as the file's rows."""

    scales: torch.Tensor
    quants: torch.Tensor
    btype: str

    @property
    def nbytes(self) -> int:
        return self.scales.numel() + self.quants.numel()


def down_cols(raw: torch.Tensor, btype: str, D: int, F: int, scales: torch.Tensor | None = None,
              quants: torch.Tensor | None = None) -> list[DownCols]:
    """:class:`DownCols` of ``n`` experts from their rows: ``raw`` uint8 ``[n * D, row_bytes]`` (Q4_0 or
    Q8_0 ``[D, F]`` matrices stacked). ``scales`` ``[n, F/32, 2 D]`` and ``quants`` ``[n, F, D/2 or D]``
    (uint8): where to write them (None: new tensors)."""
    nb, bb = F // QK, 18 if btype == "Q4_0" else 34
    blocks = raw.reshape(-1, D, nb, bb)
    n = blocks.shape[0]
    if scales is None:
        scales = torch.empty(n, nb, 2 * D, dtype=torch.uint8)
        quants = torch.empty(n, F, D // 2 if btype == "Q4_0" else D, dtype=torch.uint8)
    scales.view(n, nb, D, 2).copy_(blocks[..., :2].permute(0, 2, 1, 3))
    qs = blocks[..., 2:]
    if btype == "Q4_0":  # nibbles -> values 0..15 in F order, transposed, packed again along D
        vals = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, D, F).transpose(1, 2).reshape(n, F, D // QK, QK)
        quants.view(n, F, D // QK, 16).copy_(vals[..., :16] | (vals[..., 16:] << 4))
    else:
        quants.copy_(qs.reshape(n, D, F).transpose(1, 2))
    return [DownCols(scales[e], quants[e], btype) for e in range(n)]


def down_t_16(raw: torch.Tensor, bt, D: int, F: int, out: torch.Tensor | None = None) -> list[QWeight]:
    """f16/bf16 ``down`` rows ``raw`` uint8 ``[n * D, 2 F]`` -> ``n`` QWeights ``down_t`` ``[F, D]``, written
    into ``out`` uint8 ``[n, F, 2 D]`` (None: a new tensor)."""
    t = raw.view(torch.int16).reshape(-1, D, F)
    out = torch.empty(t.shape[0], F, 2 * D, dtype=torch.uint8) if out is None else out
    out.view(torch.int16).copy_(t.transpose(1, 2))
    return [QWeight(out[e], bt, F, D) for e in range(t.shape[0])]


def load_down(g: GGUFFile, name: str) -> tuple[int, list]:
    """``(down_kind, E matrices)`` of stacked ``ffn_down_exps`` ``[E, D, F]``: re-laid out into anonymous
    (huge-page-advised) memory and the file's pages released where :data:`COLS_TYPES` or
    :data:`ROWS_TYPES`, else row views of the map."""
    E, D, F = tensor_shape(g, name)
    kind = g.tensors[name].tensor_type.name
    w = mapped_rows(g, name, E * D, F)
    if kind not in COLS_TYPES and kind not in ROWS_TYPES:
        return DOWN_DENSE, [QWeight(w.raw[e * D:(e + 1) * D], w.btype, D, F) for e in range(E)]
    if kind in COLS_TYPES:
        scales = empty((E, F // QK, 2 * D), torch.uint8)
        quants = empty((E, F, D // 2 if kind == "Q4_0" else D), torch.uint8)
    else:
        out = empty((E, F, 2 * D), torch.uint8)
    res = []
    for e0 in range(0, E, EXPERT_CHUNK):  # a few experts at a time: small transient copies
        e1 = min(E, e0 + EXPERT_CHUNK)
        rows = w.raw[e0 * D:e1 * D]
        res += (down_cols(rows, kind, D, F, scales[e0:e1], quants[e0:e1]) if kind in COLS_TYPES
                else down_t_16(rows, w.btype, D, F, out[e0:e1]))
    _release(g, _tensor(g, name))
    return (DOWN_COLS if kind in COLS_TYPES else DOWN_ROWS), res


def load_up(g: GGUFFile, name: str) -> list[QWeight]:
    """The ``E`` up matrices ``[F, D]`` of stacked ``ffn_up_exps``, in the file's row layout (rows are read
    one by one), copied once into anonymous memory and the file's pages released, as the dense matrices
    are (so the page cache cannot drop them under memory pressure)."""
    E, F, D = tensor_shape(g, name)
    w = mapped_rows(g, name, E * F, D)
    raw = empty(tuple(w.raw.shape), torch.uint8)
    raw.copy_(w.raw)
    _release(g, _tensor(g, name))
    return [QWeight(raw[e * F:(e + 1) * F], w.btype, F, D) for e in range(E)]


def takes(g: GGUFFile, i: int, a: ModelArgs, ea: ExpertArgs, dtype: torch.dtype, mapped: bool) -> bool:
    """True when layer ``i``'s experts run sparse: ReLU experts, the C kernels, gate/up/down of one type
    computed in place (not converted at load), widths multiples of 32."""
    if a.activation.kind != "relu" or a.family.ffn not in FFN_KINDS or not mapped or kernels.backend() != "c":
        return False
    kinds = {g.tensors[f"blk.{i}.ffn_{k}_exps.weight"].tensor_type.name for k in ("gate", "up", "down")}
    kind = kinds.pop()
    return (not kinds and kind in MAPPED_TYPES and _NATIVE.get(kind) != dtype
            and ea.n_ff_exp % QK == 0 and a.n_embd % QK == 0)


class SparseExpertsFFN(ExpertsFFN):
    """:class:`~.moe.ExpertsFFN` whose routed experts compute only their fired neurons' rows
    (``sparse_experts.c``). ``gate``: ``E`` QWeights ``[F, D]`` (x8 layout for block types), ``up``: ``E`` row-layout
    QWeights ``[F, D]`` (copies of the file's rows);
    ``down``: ``E`` :class:`DownCols`, ``down_t`` QWeights ``[F, D]`` or ``down`` QWeights ``[D, F]``
    as ``down_kind`` says; ``down_scales``: the DownCols' scales (else None). ``n_fired``: neurons whose
    hidden value was not 0, summed over expert evaluations."""

    def __init__(self, *args, down_kind: int = DOWN_DENSE, **kw):
        super().__init__(*args, **kw)
        self.down_kind = down_kind
        self.n_fired = 0
        self.ffn_kind = FFN_KINDS[self.family.ffn]
        self.btype = self.up[0].btype.name
        self.gate_x8 = self.gate[0].layout == "x8"
        ptrs = lambda ws: torch.tensor([w.raw.data_ptr() for w in ws], dtype=torch.int64)  # noqa: E731
        self._gate, self._up = ptrs(self.gate), ptrs(self.up)
        if down_kind == DOWN_COLS:
            self._down = torch.tensor([d.quants.data_ptr() for d in self.down], dtype=torch.int64)
            self._scales = torch.tensor([d.scales.data_ptr() for d in self.down], dtype=torch.int64)
        else:
            self._down, self._scales = ptrs(self.down), torch.zeros(self.ea.n_expert, dtype=torch.int64)
        F, D = self.ea.n_ff_exp, self.up[0].n_cols
        self._buf = torch.empty(4 * F + D, dtype=torch.float32)
        self._ibuf = torch.empty(2 * F + 2 * (F // QK) + 2, dtype=torch.int64)
        self._qbuf = torch.empty(F, dtype=torch.int8)

    @property
    def batch_shared(self) -> bool:
        return False  # every token computes alone anyway; batched steps run each sequence by itself

    @property
    def mode(self) -> str:
        return f"experts {self.ea.n_used} of {self.ea.n_expert}, fired rows"

    def reset_stats(self) -> None:
        super().reset_stats()
        self.n_fired = 0

    def token(self, x: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``sum_j w[j] * expert_{e[j]}(x)``: ``x`` fp32 ``[D]``, ``w`` fp32 ``[n]``, ``e`` LongTensor ``[n]``
        in ascending order -> fp32 ``[D]``."""
        out = torch.zeros(x.numel(), dtype=torch.float32)
        g, u, s, d = self._gate[e], self._up[e], self._scales[e], self._down[e]
        w = w.float().contiguous()
        fired = kernels._state["lib"].pi_sparse_experts(
            kernels._QT[self.btype], self.ffn_kind, self.down_kind, self.gate_x8, e.numel(), g.data_ptr(),
            u.data_ptr(), s.data_ptr(), d.data_ptr(), w.data_ptr(), self.ea.n_ff_exp, x.numel(), x.data_ptr(),
            out.data_ptr(), self._buf.data_ptr(), self._ibuf.data_ptr(), self._qbuf.data_ptr())
        self.n_fired += int(fired)
        return out

    def tokens(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``w[t] * expert_e(x[t])`` for the ``n`` tokens routed to expert ``e`` (``x`` fp32 ``[n, D]``, ``w``
        fp32 ``[n]``) -> fp32 ``[n, D]``: the gate read once for all of them (the dense products, each token's
        numbers as it gets them alone up to :data:`~.kernels.QGEMM_MAX_T` tokens), then each token's fired rows."""
        g = kernels.linear(x, self.gate[e]).float().contiguous()
        out = torch.zeros_like(x)
        w = w.float().contiguous()
        fired = kernels._state["lib"].pi_sparse_expert_tokens(
            kernels._QT[self.btype], self.ffn_kind, self.down_kind, x.shape[0], g.data_ptr(), int(self._up[e]),
            int(self._scales[e]), int(self._down[e]), w.data_ptr(), self.ea.n_ff_exp, x.shape[1], x.data_ptr(),
            out.data_ptr(), self._buf.data_ptr(), self._ibuf.data_ptr(), self._qbuf.data_ptr())
        self.n_fired += int(fired)
        return out

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FFN output ``[T, D]`` for normed input ``xn`` ``[T, D]``: one token through :meth:`token`; several
        (a prompt) grouped by expert through :meth:`tokens`, each token adding its experts in ascending order."""
        t0 = time.perf_counter()
        w, sel = self.route(self._router_input(xn))
        xf = xn.float().contiguous()
        T = xn.shape[0]
        hit = torch.bincount(sel.view(-1), minlength=self.ea.n_expert)
        if T == 1:
            es, slots = sel[0].sort()
            out = self.token(xf[0], w[0, slots], es)[None]
        else:
            out = torch.zeros(T, xf.shape[1], dtype=torch.float32)
            for e in hit.nonzero().view(-1).tolist():  # ascending
                tok, slot = (sel == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, self.tokens(e, xf[tok].contiguous(), w[tok, slot]))
        self.expert_hits += hit
        self.n_calls += T
        self.n_active += T * self.ea.n_used
        self.t_ffn += time.perf_counter() - t0
        return out.to(xn.dtype)

    def decode_bytes(self) -> float:
        """Weight bytes one token reads: the router and, for each of ``k`` experts, the gate, and the up rows
        and down rows or columns of the share of neurons that fired so far (all of them before any call;
        the scales of every block of a block-column down matrix; every row of a dense down matrix)."""
        E, k = self.ea.n_expert, self.ea.n_used
        share = self.n_fired / (self.n_active * self.ea.n_ff_exp) if self.n_active else 1.0
        gate, up = weight_nbytes(self.gate) / E, weight_nbytes(self.up) / E
        if self.down_kind == DOWN_COLS:
            down = sum(share * d.quants.numel() + d.scales.numel() for d in self.down) / E
        else:
            down = weight_nbytes(self.down) / E * (share if self.down_kind == DOWN_ROWS else 1.0)
        return weight_nbytes(self.router) + k * (gate + share * up + down)


def build(g: GGUFFile, i: int, a: ModelArgs, ea: ExpertArgs, dtype: torch.dtype, pre_attention: bool) -> SparseExpertsFFN:
    """Layer ``i``'s :class:`SparseExpertsFFN` (call when :func:`takes`): gate in the dense products'
    layout (:func:`~.moe.load_experts`: every row is read), up in rows (:func:`load_up`), down re-laid
    out (:func:`load_down`); every one an anonymous copy of the file's bytes, as dense experts are."""
    p = f"blk.{i}."
    router = load_tensor(g, p + "ffn_gate_inp.weight", dtype)
    E, F, D = tensor_shape(g, p + "ffn_gate_exps.weight")
    gate = load_experts(g, p + "ffn_gate_exps.weight", dtype, True)  # every row read: the dense layout
    up = load_up(g, p + "ffn_up_exps.weight")
    down_kind, down = load_down(g, p + "ffn_down_exps.weight")
    return SparseExpertsFFN(a.family, a.activation, router, gate, up, down, ea=ea,
                            pre_attention=pre_attention, down_kind=down_kind)

"""Input-sparse decoding of SiLU/GELU-gated models (TEAL, arXiv 2408.14690), on TEAL GGUF files.

Every product ``y = W x`` of a block whose input threshold ``t`` is > 0 (the file's
``blk.{i}.teal_thresholds``, :mod:`powerinfer.formats.teal`) reads ``W^T`` (``[K, N]``, row ``j``
= column ``j`` of ``W``) and computes, for one token (decode),

    ``y = sum over j with |x_j| >= t of x_j * W^T[j]``

with :func:`kernels.rows_axpy` (``pi_q_axpy_rows``/``pi_axpy_rows``: Q4_0, Q8_0, Q4_K, Q6_K, f16,
bf16 and f32 rows, fp32 sums); the rows of the zeroed inputs are never read. The four inputs of
a block (:data:`~powerinfer.formats.teal.KINDS`) are the normed attention input (q, k and v: their
``W^T`` concatenated along the outputs, one AXPY pass), the heads' output (``attn_output``),
the normed FFN input (gate and up, concatenated) and the gated activation ``act(gate) * up``
(``ffn_down``: ``W^T`` is PowerInfer's ``ffn_down_t``). An input whose threshold is 0 runs the
ordinary dense kernels on the row-major matrix.

Prompts (several tokens) zero the same inputs (``|x| < t``) and run the dense tile products on
``W^T`` (:func:`kernels.matmul`: each row read once for all tokens), so a prompt gives the numbers
token-by-token decoding gives and perplexity measures the sparse model. Per-token AXPYs read the
kept rows once per token instead: slower for a prompt whenever more than ``1 / T`` of the rows
are kept (always, at the sparsities TEAL uses).

``dense=True`` runs every product on all inputs (the same weights: ``pi-perplexity --compare``'s
dense side, and calibration on a dense file). Activations are not quantized: block-quantized
``W^T`` rows are dequantized in registers and scaled by the fp32 ``x_j``, so the reference of a
sparse product is ``(x * (|x| >= t)) @ dequant(W^T)``.

Not supported (PowerInferError at load): PWRI files, fused ``attn_qkv``, families whose FFN is not
gated or whose activation is not SiLU/GELU, ``--ram-budget``, ``--vram-budget``, batched decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from ..formats.teal import KINDS, MATRICES, TealInfo, read_teal, stored_name
from ..quant.qweight import QWeight
from . import kernels
from .args import ModelArgs
from .kernels import linear
from .model import Layer, Norm, Transformer, load_head_norm, load_norm, _maybe
from .weights import _release, dense_layout, load_matrix, stack_rows, tensor_shape

DENSE_ACTS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")


def check_family(a: ModelArgs, path: str) -> None:
    """PowerInferError unless the model is a gated SiLU/GELU one with separate Q/K/V (TEAL's models)."""
    fam = a.family
    if not fam.gated or fam.ffn != "reglu" or a.activation.kind not in DENSE_ACTS:
        raise PowerInferError(f"{path}: input sparsity needs a SiLU/GELU-gated FFN; this {fam.name} model's FFN is "
                              f"{'gated ' if fam.gated else 'not gated, '}{a.activation.kind}")
    if fam.parallel_attn or fam.rope is None:
        raise PowerInferError(f"{path}: input sparsity supports sequential RoPE blocks (Llama, Qwen2/3, Mistral) only")


def _hcat(parts: list):
    """Matrices ``[K, N_i]`` (torch order) joined along their outputs -> ``[K, sum N_i]``: one QWeight
    (same type: each row's blocks one after the other) or tensor; the list when types differ."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, QWeight) and p.btype == parts[0].btype and p.layout == "rows" for p in parts):
        raw = torch.cat([p.raw for p in parts], dim=1)
        return QWeight(raw, parts[0].btype, parts[0].n_rows, sum(p.n_cols for p in parts))
    if all(isinstance(p, torch.Tensor) and p.dtype == parts[0].dtype for p in parts):
        return torch.cat(parts, dim=1)
    return parts


@dataclass
class InputSparseLinear:
    """``x @ W.T (+ b)`` for ``x`` ``[T, K]``, zeroing inputs with ``|x_j| < threshold``.

    ``w``: ``W^T`` ``[K, N]`` (a row-layout QWeight, a tensor, or a list of them sharing ``K``, joined
    along ``N``) when ``threshold`` > 0; ``W`` ``[N, K]`` row-major (or a list stacked along ``N``) when
    it is 0 (dense kernels). Counts decode tokens' inputs seen and kept (``n_in``, ``n_kept``)."""

    kind: str
    w: object
    threshold: float
    bias: torch.Tensor | None = None
    n_in: int = 0
    n_kept: int = 0
    recorder: Callable[[torch.Tensor], None] | None = None  # calibration: sees every input before masking
    mask_threshold: float = 0.0  # calibration (greedy allocation): zero inputs below it on a row-major W too

    @property
    def input_major(self) -> bool:
        return self.threshold > 0

    def dense_view(self):
        """``W`` ``[N, K]`` as the ordinary kernels take it (a transposed view of ``W^T``)."""
        if not self.input_major:
            return self.w
        return [p.T for p in self.w] if isinstance(self.w, list) else self.w.T

    def __call__(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder(x)
        T = x.shape[0]
        if self.mask_threshold > 0:
            x = x * (x.abs() >= self.mask_threshold)
        if not self.input_major:
            self.n_in += x.numel()
            self.n_kept += x.numel()
            return linear(x, self.w, self.bias)
        thr = 0.0 if dense else self.threshold
        ws = self.w if isinstance(self.w, list) else [self.w]
        if T == 1:
            x0 = x[0]
            idx = torch.arange(x0.numel()) if dense else (x0.abs() >= thr).nonzero().view(-1)
            self.n_in += x0.numel()
            self.n_kept += idx.numel()
            coef = x0.float()[idx]
            y = torch.cat([kernels.rows_axpy(idx, w, coef).float() for w in ws])[None]
        else:
            keep = x.abs() >= thr
            self.n_in += x.numel()
            self.n_kept += x.numel() if dense else int(keep.sum())
            xm = x.float() if dense else x.float() * keep
            y = torch.cat([_rows_matmul(xm, w) for w in ws], dim=-1)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def _rows_matmul(x: torch.Tensor, wt) -> torch.Tensor:
    """``x @ wt``: ``[T, K] x [K, N] -> [T, N]`` fp32 (dequantized tiles for a QWeight)."""
    if isinstance(wt, QWeight):
        return kernels.matmul(x, wt)
    return (x.to(wt.dtype) @ wt).float()  # a bf16 W^T computed in bf16 (as the dense kernels do)


@dataclass
class TealFFN:
    """A gated FFN ``down(act(gate x) * up x)`` on two :class:`InputSparseLinear` (gate and up joined:
    ``[T, D] -> [T, 2F]``; down: ``[T, F] -> [T, D]``). The counters and weight attributes are those the
    runtime's reports read from an FFN (``n_active``: down inputs computed, of ``n_calls * n_ff``)."""

    family: object
    act: object
    gate_up: InputSparseLinear
    down: InputSparseLinear
    n_ff: int
    dense: bool = False
    n_active: int = 0
    n_calls: int = 0
    n_fired: int = 0
    count_fired: bool = False
    t_ffn: float = 0.0
    t_predict: float = 0.0
    sparse: bool = False  # no predictor
    fc1: object = None
    fc2: object = None
    gate: object = None
    up: object = None  # the weights, for byte counts (set at build)
    down_t: object = None

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = self.n_fired = 0
        self.t_ffn = self.t_predict = 0.0
        for p in (self.gate_up, self.down):
            p.n_in = p.n_kept = 0

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        gu = self.gate_up(xn, self.dense)
        gate, up = gu.split([self.n_ff, self.n_ff], dim=-1)
        hidden = self.family.combine(self.act, gate, up)
        kept0 = self.down.n_kept
        out = self.down(hidden, self.dense)
        T = xn.shape[0]
        self.n_calls += T
        self.n_active += self.down.n_kept - kept0
        self.t_ffn += time.perf_counter() - t0
        return out


@dataclass
class TealLayer:
    """The four input-sparse products of one block, :data:`KINDS` order."""

    qkv: InputSparseLinear
    o: InputSparseLinear
    ffn: TealFFN
    products: dict = field(default_factory=dict)


def _load_product(g: GGUFFile, i: int, kind: str, thr: float, a: ModelArgs, dtype: torch.dtype, mapped: bool,
                  want: list[tuple[int, int]]) -> InputSparseLinear:
    """The product of ``kind`` in layer ``i``: its matrices (torch shapes ``want``, ``W`` ``[N, K]``) read
    input-major (``_t``) when ``thr`` > 0, row-major otherwise; shapes checked."""
    names = [f"blk.{i}.{m}" for m in MATRICES[kind]]
    sparse = thr > 0
    parts = []
    for name, shp in zip(names, want):
        tn = stored_name(name, sparse)
        got = tensor_shape(g, tn)
        exp = (shp[1], shp[0]) if sparse else shp
        if tuple(got) != exp:
            raise PowerInferError(f"{g.path}: {tn} has shape {list(got)}, expected {list(exp)}")
        parts.append(load_matrix(g, tn, dtype, mapped))
    stored = [stored_name(n, sparse) for n in names]
    if sparse:
        w = _hcat(parts)
    elif len(parts) > 1 and all(isinstance(p, torch.Tensor) and p.dtype == parts[0].dtype for p in parts):
        w = torch.cat(parts, dim=0)
    elif len(parts) > 1 and all(isinstance(p, QWeight) for p in parts):
        w = stack_rows(g, stored, parts)  # one matrix (same type) for one dense kernel call, as model.py does
        w = dense_layout(g, stored, w) if isinstance(w, QWeight) else [dense_layout(g, [n], p) for n, p in zip(stored, w)]
    else:
        w = [dense_layout(g, [n], p) if isinstance(p, QWeight) else p for n, p in zip(stored, parts)]
        w = w[0] if len(w) == 1 else w
    if len(parts) > 1 and (sparse or isinstance(w, torch.Tensor)) and not isinstance(w, list):
        del parts  # joined into a copy: the mapped pages are dropped
        for name in stored:
            _release(g, g.tensors[name])
    bias = None
    if kind == "qkv":
        bs = [_maybe(g, f"{n}.bias", dtype) for n in names]
        if any(b is not None for b in bs):
            if not all(b is not None and tuple(b.shape) == (s[0],) for b, s in zip(bs, want)):
                raise PowerInferError(f"{g.path}: blk.{i} q/k/v biases are incomplete or of the wrong shape")
            bias = torch.cat(bs)
    elif any(f"{n}.bias" in g.tensors for n in names):
        raise PowerInferError(f"{g.path}: blk.{i} {kind} biases are not supported with input sparsity")
    return InputSparseLinear(kind, w, float(thr), bias)


class TealTransformer(Transformer):
    """:class:`Transformer` of a TEAL file (or of a dense file, every product dense: calibration).

    ``dense=True`` runs every product on all its inputs. ``teal`` is the file's
    :class:`~powerinfer.formats.teal.TealInfo` (None for a dense file); ``teal_layers[i]`` the products
    of layer ``i``. Raises PowerInferError for files it cannot run (see the module docstring)."""

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, dense: bool = False,
                 n_ctx: int | None = None):
        a = ModelArgs.from_gguf(g)
        if a.sparse:
            raise PowerInferError(f"{g.path}: a PowerInfer (PWRI) file: input sparsity runs dense GGUFs of "
                                  "SiLU-gated models")
        check_family(a, g.path)
        from .moe import is_moe

        if is_moe(g):
            raise PowerInferError(f"{g.path}: a mixture-of-experts file: input sparsity (TEAL) is not supported for experts")
        if "blk.0.attn_qkv.weight" in g.tensors:
            raise PowerInferError(f"{g.path}: fused attn_qkv is not supported with input sparsity")
        self.teal: TealInfo | None = read_teal(g, a.n_layer)
        self.teal_layers: list[TealLayer] = []
        self.teal_dense = dense
        super().__init__(g, dtype, dense=True, n_ctx=n_ctx)
        self.dense = dense or self.teal is None

    def _load_layer(self, g, i, a, dtype, dense, mapped, ffn_builder) -> Layer:
        p = f"blk.{i}."
        thr = self.teal.thresholds[i] if self.teal is not None else (0.0,) * len(KINDS)
        hd, D, Fn = a.head_dim, a.n_embd, a.n_ff
        qkv = _load_product(g, i, "qkv", thr[0], a, dtype, mapped,
                            [(a.n_head * hd, D), (a.n_head_kv * hd, D), (a.n_head_kv * hd, D)])
        o = _load_product(g, i, "o", thr[1], a, dtype, mapped, [(D, a.n_head * hd)])
        gu = _load_product(g, i, "gate_up", thr[2], a, dtype, mapped, [(Fn, D), (Fn, D)])
        down = _load_product(g, i, "down", thr[3], a, dtype, mapped, [(D, Fn)])
        ffn = TealFFN(a.family, a.activation, gu, down, Fn, dense=self.teal_dense)
        ffn.up, ffn.down_t = gu.w, down.w  # byte counts and the --bench type line
        self.teal_layers.append(TealLayer(qkv, o, ffn, {"qkv": qkv, "o": o, "gate_up": gu, "down": down}))
        q_norm = k_norm = None
        if a.family.qk_norm:
            q_norm, k_norm = (Norm(load_head_norm(g, f"{p}attn_{n}_norm.weight", a, dtype), None, a.norm_eps, True)
                              for n in "qk")
        # wqkv / wo: W as the ordinary kernels take it (any dense consumer computes the dense product)
        return Layer(load_norm(g, p + "attn_norm", a, dtype), load_norm(g, p + "ffn_norm", a, dtype),
                     qkv.dense_view(), qkv.bias, o.dense_view(), None, ffn, q_norm=q_norm, k_norm=k_norm)

    def _project(self, i: int, layer: Layer, kind: str, x: torch.Tensor) -> torch.Tensor:
        tl = self.teal_layers[i]
        return (tl.qkv if kind == "qkv" else tl.o)(x, self.teal_dense)

    def products(self):
        """``(layer, kind, InputSparseLinear)`` for every product, :data:`KINDS` order within a layer."""
        for i, tl in enumerate(self.teal_layers):
            for kind in KINDS:
                yield i, kind, tl.products[kind]

    def reset_sparsity_stats(self) -> None:
        for _, _, p in self.products():
            p.n_in = p.n_kept = 0

    def sparsity_by_kind(self) -> dict[str, float | None]:
        """Share of inputs zeroed per kind (over all layers and tokens so far), None before any token."""
        out = {}
        for kind in KINDS:
            n = sum(p.n_in for _, k, p in self.products() if k == kind)
            kept = sum(p.n_kept for _, k, p in self.products() if k == kind)
            out[kind] = None if n == 0 else 1.0 - kept / n
        return out


def bytes_per_token(model: TealTransformer) -> int:
    """Weight bytes one token reads: the output head, and each product's matrix times the share of its
    inputs kept so far (all of it for a dense input or before any token)."""
    from .weights import weight_nbytes

    n = weight_nbytes(model.output)
    for _, _, p in model.products():
        share = p.n_kept / p.n_in if p.input_major and p.n_in else 1.0
        n += weight_nbytes(p.w) * share
    return int(n)


def sparsity_lines(model) -> list[str]:
    """``pi-run --bench`` lines: the input sparsity reached per matrix kind (TEAL files only)."""
    if not isinstance(model, TealTransformer) or model.teal is None:
        return []
    by = model.sparsity_by_kind()
    parts = ", ".join(f"{k} {'-' if v is None else f'{100 * v:.1f}%'}" for k, v in by.items())
    t = model.teal
    return [f"  input sparsity reached, prompt and decode (target {100 * t.sparsity:.0f}%, {t.method}"
            f"{', dense run' if model.teal_dense else ''}): {parts}"]

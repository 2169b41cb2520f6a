"""The decoder: weights from a GGUF, a preallocated KV cache, dense or sparse FFNs.

Batch 1, one sequence, positions indexed into a cache allocated once
(gpt-fast style). One block class covers every family; the family record says
which pieces it has (upstream PowerInfer's ``build_llama_variants``,
``build_falcon`` and ``build_opt`` graphs):

* norms: RMSNorm without bias (Llama, Bamboo) or LayerNorm with bias (Falcon, OPT);
* positions: GGML "normal" RoPE on Q/K rows stored permuted (Llama, Bamboo, so no
  un-permuting is needed), NeoX rotate-half RoPE (Falcon, Qwen2/3), or learned absolute
  positions added to the embedding (OPT, row ``p + 2`` for position ``p``); RoPE
  frequencies divided by ``rope_freqs.weight`` where the file has it (Llama 3.1+) and
  positions scaled by the linear ``freq_scale`` (:func:`rope_tables`);
* Q/K norms: a per-head RMSNorm of Q and K before RoPE (Qwen3's ``attn_q_norm``/``attn_k_norm``);
* attention: fused QKV (Falcon's ``attn_qkv`` in the jploski order: all Q heads, all
  K, all V) or separate Q/K/V concatenated at load, optional biases (OPT), GQA,
  optional sliding window (Bamboo's Mistral body: query ``p`` sees keys ``> p - W``);
* layout: sequential ``x += attn(norm1 x); x += ffn(norm2 x)`` or parallel (Falcon)
  ``x += attn(ln_attn x) + ffn(ln_mlp x)``; the predictor reads the residual before
  the FFN norm (sequential) or the layer input (parallel);
* output: ``output.weight``, or the token embedding when tied (OPT);
* FFN: :mod:`.ffn`'s dense or predictor-sparse one, or a mixture of experts (:mod:`.moe`: Mixtral,
  Qwen3-MoE; SmallThinker's layers in :mod:`.smallthinker`), chosen from the file.

Shapes: ``T`` tokens in this call, ``P`` the position of the first of them,
``D = n_embd``, ``F = n_ff``, ``Hq/Hkv`` heads, ``d`` head dim (``{arch}.attention.key_length``
where the file gives it: Qwen3, Mistral-Nemo; else ``D / Hq``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from .args import ModelArgs
from ..quant.qweight import QWeight
from .ffn import FFN
from .kernels import attend_one, embed, linear
from .moe import experts_builder
from .kv_cache import KVCache, available_memory, check_head_dim, kv_dtypes, load, size_text as _size, store
from .weights import (check_dequantized, dense_layout, is_quantized, load_concat, load_matrix, load_tensor, stack_rows,
                      tensor_shape, zeros)

DEFAULT_CTX = 4096  # context when none is asked for, if the model's is longer (llama.cpp's default too)
# Prompt memory, bounded as llama.cpp bounds it (its n_ubatch): a forward pass takes at most UBATCH
# tokens (longer calls run in consecutive passes, the same numbers per token up to GEMM rounding), and
# SDPA takes query rows in blocks whose score matrix [Hq, rows, keys] fp32 stays within
# SDPA_SCORE_BYTES (CPU SDPA materialises it, and its softmax: ~1 GB at 1940 tokens of a 7B otherwise).
UBATCH = 512
SDPA_SCORE_BYTES = 32 << 20
log = logging.getLogger(__name__)


@dataclass
class Norm:
    """RMSNorm (``b`` None, ``rms`` True) or LayerNorm with bias over the last dim ``D``."""

    w: torch.Tensor  # [D]
    b: torch.Tensor | None  # [D]
    eps: float
    rms: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return rms_norm(x, self.w, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


@dataclass
class Layer:
    attn_norm: Norm  # feeds attention (Falcon-40B: attn_norm_2 = ln_attn)
    ffn_norm: Norm  # feeds the FFN (Falcon: attn_norm = ln_mlp; the same object when one norm)
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) d, D]: Q rows, then K, then V
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) d]
    wo: torch.Tensor  # [D, Hq d]
    bo: torch.Tensor | None  # [D]
    ffn: FFN
    on_device: bool = False  # attention, norms, predictor and KV cache on the offload device (hybrid.py)
    q_norm: Norm | None = None  # [d] RMSNorm of every Q head before RoPE (Qwen3)
    k_norm: Norm | None = None  # [d] RMSNorm of every K head before RoPE (Qwen3)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, Hq, d]`` and ``k`` ``[T, Hkv, d]`` through the per-head norms, if the layer has them."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


def rope_tables(n_ctx: int, n_rot: int, base: float, freq_factors: torch.Tensor | None = None,
                freq_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n_ctx, n_rot/2]`` in fp32 of the angle ``p * freq_scale * base^(-2i/n_rot) / f_i``
    for position ``p`` and pair ``i``, as ggml's ``rope_ext`` computes it: ``freq_factors``
    ``[n_rot/2]`` the ``f_i`` (Llama 3's ``rope_freqs.weight``; None: all 1), ``freq_scale`` the
    linear scaling (1 / ``rope.scaling.factor``)."""
    inv = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot))
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    pos = torch.arange(n_ctx, dtype=torch.float32)
    if freq_scale != 1.0:
        pos = pos * freq_scale
    ang = torch.outer(pos, inv)
    return ang.cos(), ang.sin()


def load_rope_factors(g: GGUFFile, a: ModelArgs) -> torch.Tensor | None:
    """``rope_freqs.weight`` ``[n_rot/2]`` fp32 when the file has it (Llama 3.1+), else None.
    Raises PowerInferError for another shape or a factor that is not positive and finite."""
    if "rope_freqs.weight" not in g.tensors:
        return None
    f = load_tensor(g, "rope_freqs.weight", torch.float32)
    if tuple(f.shape) != (a.n_rot // 2,):
        raise PowerInferError(f"{g.path}: rope_freqs.weight has shape {tuple(f.shape)}, expected [n_rot/2={a.n_rot // 2}]")
    if not bool(torch.isfinite(f).all()) or not bool((f > 0).all()):
        raise PowerInferError(f"{g.path}: rope_freqs.weight holds a factor that is not a positive finite number")
    return f


_RMS_NORM = getattr(F, "rms_norm", None)  # torch >= 2.4


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GGML normal mode: rotate adjacent pairs ``(x[2i], x[2i+1])``. ``x``: ``[T, H, d]``; cos/sin ``[T, d/2]``.

    Each pair is a complex number times ``cos + i sin`` (``x0 c - x1 s``, ``x0 s + x1 c``, the
    same products and sums): 4 torch operations instead of 12 (a decode step's Python cost)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    out = torch.view_as_real(xc * torch.complex(cos, sin)[:, None, :]).flatten(-2)
    return out.to(x.dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GGML NeoX mode (HF rotate-half): rotate ``(x[i], x[i + d/2])``. Shapes as :func:`apply_rope`."""
    xf = x.float()
    x0, x1 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and w.dtype == torch.float32 and _RMS_NORM is not None:
        return _RMS_NORM(x, (x.shape[-1],), w, eps)  # one fused op: x rsqrt(mean(x^2) + eps) w
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _maybe(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    return load_tensor(g, name, dtype) if name in g.tensors else None


def load_norm(g: GGUFFile, prefix: str, a: ModelArgs, dtype: torch.dtype) -> Norm:
    """``{prefix}.weight`` (+ ``.bias`` for LayerNorm families), checked to be ``[D]``."""
    w = load_tensor(g, prefix + ".weight", dtype)
    rms = a.family.norm == "rms"
    b = None if rms else load_tensor(g, prefix + ".bias", dtype)
    for t in (w, b):
        if t is not None and tuple(t.shape) != (a.n_embd,):
            raise PowerInferError(f"{g.path}: {prefix} has shape {tuple(t.shape)}, expected [n_embd={a.n_embd}]")
    return Norm(w, b, a.norm_eps, rms)


def load_attention(g: GGUFFile, p: str, a: ModelArgs, dtype: torch.dtype, mapped: bool = False):
    """``(wqkv, bqkv, wo, bo)`` of layer prefix ``p``: fused ``attn_qkv`` or ``attn_q/k/v``, biases if stored.

    ``mapped``: quantized matrices stay quantized (:func:`load_matrix`); Q, K and V of
    different quantized types stay three weights (``wqkv`` a list).
    """
    hd = a.head_dim
    rows = (a.n_head + 2 * a.n_head_kv) * hd
    if p + "attn_qkv.weight" in g.tensors:
        wqkv = load_matrix(g, p + "attn_qkv.weight", dtype, mapped, dense_use=True)
        bqkv = _maybe(g, p + "attn_qkv.bias", dtype)
    else:
        names = [f"{p}attn_{n}.weight" for n in "qkv"]
        want = [(a.n_head * hd, a.n_embd), (a.n_head_kv * hd, a.n_embd), (a.n_head_kv * hd, a.n_embd)]
        if [tensor_shape(g, n) for n in names] != want:
            raise PowerInferError(f"{g.path}: {p}attn_q/k/v shapes do not match the metadata")
        parts = [load_matrix(g, n, dtype, mapped) for n in names]
        if all(isinstance(w, torch.Tensor) for w in parts):
            del parts
            wqkv = load_concat(g, names, dtype)  # filled in place: no per-tensor copies to concatenate
        elif all(isinstance(w, QWeight) for w in parts):
            wqkv = stack_rows(g, names, parts)
            wqkv = dense_layout(g, names, wqkv) if isinstance(wqkv, QWeight) else \
                [dense_layout(g, [n], w) for n, w in zip(names, wqkv)]
        else:
            wqkv = [dense_layout(g, [n], w) for n, w in zip(names, parts)]
        bs = [_maybe(g, f"{p}attn_{n}.bias", dtype) for n in "qkv"]
        bqkv = torch.cat(bs) if all(b is not None for b in bs) else None
    wo = load_matrix(g, p + "attn_output.weight", dtype, mapped, dense_use=True)
    bo = _maybe(g, p + "attn_output.bias", dtype)
    if isinstance(wqkv, list):
        if [tuple(w.shape) for w in wqkv] != want:
            raise PowerInferError(f"{g.path}: {p}attn_q/k/v shapes do not match the metadata")
    elif tuple(wqkv.shape) != (rows, a.n_embd) or (bqkv is not None and tuple(bqkv.shape) != (rows,)) \
            or tuple(wo.shape) != (a.n_embd, a.n_head * hd):
        raise PowerInferError(f"{g.path}: {p} attention shapes do not match the metadata")
    return wqkv, bqkv, wo, bo


def build_ffn(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool, mapped: bool = False) -> FFN:
    """Layer ``i``'s FFN from GGUF ``g``: PWRI files give ``ffn_down_t`` and the predictor.

    Biases (OPT: ``ffn_up.bias`` ``[F]``, ``ffn_down(_t).bias`` ``[D]``) are loaded when
    the family has them. Raises PowerInferError for missing tensors or wrong shapes.
    """
    p = f"blk.{i}."
    fam = a.family
    down = "ffn_down_t" if a.sparse else "ffn_down"
    by_rows = a.sparse and not dense  # a sparse FFN reads gate/up/down_t by neuron rows
    gate = load_matrix(g, p + "ffn_gate.weight", dtype, mapped, not by_rows) if fam.gated else None
    up = load_matrix(g, p + "ffn_up.weight", dtype, mapped, not by_rows)
    down_t = load_matrix(g, f"{p}{down}.weight", dtype, mapped, not a.sparse)  # PWRI down_t: rows
    if not a.sparse:
        down_t = down_t.T  # [F, D] view of ffn_down [D, F] (the FFN runs F.linear on it)
    ffn = FFN(fam, a.activation, gate, up, down_t, threshold=a.sparse_threshold)
    for w, name in ((gate, "ffn_gate"), (up, "ffn_up"), (down_t, "ffn_down_t")):
        if w is not None and tuple(w.shape) != (a.n_ff, a.n_embd):
            raise PowerInferError(f"{g.path}: blk.{i}.{name} has shape {tuple(w.shape)}, "
                                  f"expected [n_ff={a.n_ff}, n_embd={a.n_embd}]")
    ffn.gate_b, ffn.up_b, ffn.down_b = load_ffn_biases(g, i, a, dtype)
    if a.sparse and not dense:
        ffn.fc1, ffn.fc2 = load_predictor(g, i, a, dtype, mapped)
    return ffn


def load_ffn_biases(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype):
    """Layer ``i``'s FFN biases ``(gate [F] | None, up [F], down [D])`` when the family has them
    (``ffn_down_t.bias`` in a PWRI file, ``ffn_down.bias`` in a dense one), else three Nones.
    Raises PowerInferError for wrong shapes."""
    if not a.family.ffn_bias:
        return None, None, None
    p = f"blk.{i}."
    down = "ffn_down_t" if a.sparse else "ffn_down"
    gate_b = load_tensor(g, p + "ffn_gate.bias", dtype) if a.family.gated else None
    up_b = load_tensor(g, p + "ffn_up.bias", dtype)
    down_b = load_tensor(g, f"{p}{down}.bias", dtype)
    if up_b.shape != (a.n_ff,) or down_b.shape != (a.n_embd,):
        raise PowerInferError(f"{g.path}: blk.{i} FFN bias shapes do not match n_ff/n_embd")
    return gate_b, up_b, down_b


def load_predictor(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, mapped: bool = False):
    """Layer ``i``'s predictor ``(fc1 [H, D], fc2 [F, H])`` of a PWRI file; PowerInferError for
    shapes that do not match the model."""
    p = f"blk.{i}."
    fc1 = load_matrix(g, p + "fc1.weight", dtype, mapped, dense_use=True)
    fc2 = load_matrix(g, p + "fc2.weight", dtype, mapped, dense_use=True)
    if fc1.shape[1] != a.n_embd or fc2.shape != (a.n_ff, fc1.shape[0]):
        raise PowerInferError(f"{g.path}: blk.{i} predictor shapes {tuple(fc1.shape)}, "
                              f"{tuple(fc2.shape)} do not match the model")
    return fc1, fc2


def context_length(g: GGUFFile, a: ModelArgs, n_ctx: int | None) -> tuple[int, int]:
    """``(the model's context length, the one used)``: the metadata's, cut by the rows of
    ``position_embd`` for learned positions (OPT); ``n_ctx`` cut to it, None: at most
    :data:`DEFAULT_CTX`. No tensor data is read (``--ram-budget`` plans with it before loading)."""
    max_ctx = a.n_ctx
    if a.family.rope is None:
        max_ctx = min(max_ctx, tensor_shape(g, "position_embd.weight")[0] - a.family.learned_pos_offset)
    return max_ctx, min(n_ctx or min(max_ctx, DEFAULT_CTX), max_ctx)


def build_layer(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool, mapped: bool = False,
                ffn_builder: Callable | None = None) -> Layer:
    """Layer ``i``: its norms by the family's layout, attention and FFN (``ffn_builder``, same
    arguments as :func:`build_ffn`, replaces it: ``--ram-budget``'s FFNs)."""
    p = f"blk.{i}."
    if a.family.parallel_attn:  # Falcon: attn_norm feeds the FFN, attn_norm_2 (if any) the attention
        ffn_norm = load_norm(g, p + "attn_norm", a, dtype)
        attn_norm = load_norm(g, p + "attn_norm_2", a, dtype) if p + "attn_norm_2.weight" in g.tensors else ffn_norm
    else:
        attn_norm, ffn_norm = load_norm(g, p + "attn_norm", a, dtype), load_norm(g, p + "ffn_norm", a, dtype)
    wqkv, bqkv, wo, bo = load_attention(g, p, a, dtype, mapped)
    q_norm = k_norm = None
    if a.family.qk_norm:  # Qwen3: RMSNorm over each head's d values, eps of the model's norms
        q_norm, k_norm = (Norm(load_head_norm(g, f"{p}attn_{n}_norm.weight", a, dtype), None, a.norm_eps, True)
                          for n in "qk")
    return Layer(attn_norm, ffn_norm, wqkv, bqkv, wo, bo, (ffn_builder or build_ffn)(g, i, a, dtype, dense, mapped),
                 q_norm=q_norm, k_norm=k_norm)


def load_head_norm(g: GGUFFile, name: str, a: ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    """A per-head norm weight ``[d]`` (Qwen3's ``attn_q_norm``/``attn_k_norm``); PowerInferError otherwise."""
    w = load_tensor(g, name, dtype)
    if tuple(w.shape) != (a.head_dim,):
        raise PowerInferError(f"{g.path}: {name} has shape {tuple(w.shape)}, expected [head_dim={a.head_dim}]")
    return w


class Transformer:
    """A GGUF model ready to run. ``dense=True`` computes every FFN neuron even in a PWRI file.

    With the C kernels in use every matrix stays in the file's type (block-quantized, f16,
    bf16; ``quantized`` is True for a block-quantized file), in the memory map or in one
    packed copy; a matrix already in ``dtype`` (f32, or bf16 with bf16 compute) is a view of
    the map. With the torch backend they are converted to ``dtype`` at load. ``n_ctx``: the context length in tokens (KV cache and RoPE tables),
    cut to the model's; None: the model's, but at most :data:`DEFAULT_CTX` (a warning gives
    the KV-cache size then). ``cache_type_k``, ``cache_type_v``: the KV cache's key and value types
    (``f32``/``f16``/``bf16``/``q8_0`` or a torch dtype; None: ``dtype``; the command-line tools default to
    f16, llama.cpp's ``-ctk``/``-ctv``; :mod:`.kv_cache`). Raises PowerInferError when the file's
    tensors do not match its metadata, or for a cache type not supported.
    """

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, dense: bool = False,
                 n_ctx: int | None = None, ffn_builder: Callable | None = None,
                 cache_type_k: str | torch.dtype | None = None, cache_type_v: str | torch.dtype | None = None):
        self.args = a = ModelArgs.from_gguf(g)
        fam = a.family
        self.dtype = dtype
        self.dense = dense or not a.sparse
        self.cache_dtypes = kv_dtypes(cache_type_k, cache_type_v, dtype)  # (keys, values), checked before loading
        check_head_dim(self.cache_dtypes, a.head_dim)
        from . import kernels

        # With the C kernels every matrix is computed on in the file's own bytes (block-quantized,
        # f16 or bf16: no f32 copy); the torch backend dequantizes to ``dtype`` at load.
        mapped = kernels.backend() == "c"
        check_dequantized(g, dtype, mapped, available_memory())  # before any allocation
        ffn_builder = ffn_builder or experts_builder(g, a)  # mixture-of-experts files (moe.py), checked here
        self.quantized = is_quantized(g) and mapped
        self.tok_embd = load_matrix(g, "token_embd.weight", dtype, mapped)  # [V, D]
        if self.tok_embd.shape != (a.n_vocab or self.tok_embd.shape[0], a.n_embd):
            raise PowerInferError(f"{g.path}: token_embd shape {tuple(self.tok_embd.shape)} does not match n_embd {a.n_embd}")
        self.output_norm = load_norm(g, "output_norm", a, dtype)
        out = load_matrix(g, "output.weight", dtype, mapped, dense_use=True) if "output.weight" in g.tensors else None
        self.output = self.tok_embd if out is None else out  # [V, D]; OPT ties it to the embedding
        if self.output.shape != self.tok_embd.shape:
            raise PowerInferError(f"{g.path}: output shape {tuple(self.output.shape)} does not match token_embd")
        self.pos_embd = None
        if fam.rope is None:  # learned positions: row p + offset holds position p
            self.pos_embd = load_tensor(g, "position_embd.weight", dtype)  # [n_pos, D]
            if self.pos_embd.shape[1] != a.n_embd:
                raise PowerInferError(f"{g.path}: position_embd shape {tuple(self.pos_embd.shape)} does not match n_embd")
        max_ctx, self.n_ctx = context_length(g, a, n_ctx)
        self.max_ctx = max_ctx  # the model's own context length (n_ctx may be smaller: -c)
        if not n_ctx and self.n_ctx < max_ctx:
            kv = KVCache.nbytes(a.n_layer, 1, a.n_head_kv, a.head_dim, *self.cache_dtypes)
            log.warning("context: %d tokens of the model's %d (KV cache %s); -c %d for the whole context "
                        "(KV cache %s)", self.n_ctx, max_ctx, _size(kv * self.n_ctx), max_ctx, _size(kv * max_ctx))
        self.layers: list[Layer] = [self._load_layer(g, i, a, dtype, self.dense, mapped, ffn_builder)
                                    for i in range(a.n_layer)]
        self.rope = {"normal": apply_rope, "neox": apply_rope_neox, None: None}[fam.rope]
        self.cos, self.sin = rope_tables(self.n_ctx, a.n_rot, a.rope_base, load_rope_factors(g, a), a.rope_freq_scale)
        self.cache = KVCache(a.n_layer, self.n_ctx, a.n_head_kv, a.head_dim, *self.cache_dtypes)
        self.mask_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.placement = None  # hybrid.DevicePlacement once offloaded: device, dtype, timing
        self.head_on_device = False  # output norm and matrix on the offload device
        self._rope_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.before_forward: Callable[[], None] | None = None  # --ram-budget: files checked, pages dropped
        self.resources: list = []  # what close() closes (--ram-budget: the row reader's threads and files)

    def _load_layer(self, g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool, mapped: bool,
                    ffn_builder: Callable | None) -> Layer:
        """Layer ``i`` (:func:`build_layer`; a subclass with another file layout overrides it)."""
        return build_layer(g, i, a, dtype, dense, mapped, ffn_builder)

    def _project(self, i: int, layer: Layer, kind: str, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention product ``kind``: ``qkv`` (``x @ wqkv.T + bqkv``, ``[T, D] -> [T, (Hq + 2Hkv) d]``)
        or ``o`` (``x @ wo.T + bo``, ``[T, Hq d] -> [T, D]``); a subclass may compute them another way."""
        if kind == "qkv":
            return linear(x, layer.wqkv, layer.bqkv)
        return linear(x, layer.wo, layer.bo)

    def close(self) -> None:
        """Close what the model holds open beyond its memory map (the ``--ram-budget`` row reader's
        threads and file descriptors); a no-op for other models. ``with model:`` closes at exit."""
        while self.resources:
            self.resources.pop().close()

    def __enter__(self) -> "Transformer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rope(self, device: torch.device, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows ``pos..pos+T-1`` on ``device`` (copied there once)."""
        if device.type == "cpu":
            return self.cos[pos:pos + T], self.sin[pos:pos + T]
        if device not in self._rope_on:
            self._rope_on[device] = (self.cos.to(device), self.sin.to(device))
        cos, sin = self._rope_on[device]
        return cos[pos:pos + T], sin[pos:pos + T]

    def _side(self, x: torch.Tensor, on_device: bool) -> torch.Tensor:
        """``x`` on the offload device (in its dtype) or on the CPU (in the model's dtype)."""
        p = self.placement
        if p is None:
            return x
        return x.to(p.device, p.dtype) if on_device else x.to("cpu", self.dtype)

    # ------------------------------------------------------------------ forward
    def attention(self, i: int, layer: Layer, x: torch.Tensor, pos: int) -> torch.Tensor:
        a = self.args
        T, hd = x.shape[0], a.head_dim
        qkv = self._project(i, layer, "qkv", x)  # [T, (Hq + 2Hkv) d]
        q, k, v = qkv.split([a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], dim=-1)
        q, k = layer.norm_qk(q.view(T, a.n_head, hd), k.view(T, a.n_head_kv, hd))
        if self.rope is not None:
            cos, sin = self._rope(x.device, pos, T)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        ck, cv = self.cache.layer(i)  # [n_ctx, Hkv, d] on x's device
        store(ck, pos, k)
        store(cv, pos, v.view(T, a.n_head_kv, hd))
        S, W = pos + T, a.sliding_window
        k0 = max(0, pos + 1 - W) if W else 0  # the earliest key the first query may see
        if T == 1 and x.device.type == "cpu":  # decode: one query against the cache (C kernel)
            o = attend_one(q[0], ck[k0:S], cv[k0:S])  # [Hq, d]
            return self._project(i, layer, "o", o.reshape(1, a.n_head * hd))
        kk = load(ck[k0:S], q.dtype).transpose(0, 1)  # [Hkv, S - k0, d]; a cache in another type: converted span
        vv = load(cv[k0:S], q.dtype).transpose(0, 1)
        mask = None
        if T > 1:
            qpos = torch.arange(pos, S, device=x.device)[:, None]
            kpos = torch.arange(k0, S, device=x.device)[None, :]
            mask = kpos <= qpos
            if W:
                mask &= kpos > qpos - W
        qt = q.transpose(0, 1)  # [Hq, T, d]
        rows = max(1, SDPA_SCORE_BYTES // (4 * a.n_head * (S - k0)))  # query rows per SDPA call
        o = torch.cat([F.scaled_dot_product_attention(qt[:, r:r + rows], kk, vv,
                                                      attn_mask=None if mask is None else mask[r:r + rows],
                                                      enable_gqa=a.n_head != a.n_head_kv)
                       for r in range(0, T, rows)], dim=1) if T > rows else \
            F.scaled_dot_product_attention(qt, kk, vv, attn_mask=mask, enable_gqa=a.n_head != a.n_head_kv)
        return self._project(i, layer, "o", o.transpose(0, 1).reshape(T, a.n_head * hd))

    def _ffn(self, i: int, layer: Layer, h: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        """FFN of layer ``i``: ``h`` is the predictor input, ``xn`` the normed FFN input."""
        mask = self.mask_fn(i, h, xn) if self.mask_fn is not None else None
        return layer.ffn(h, xn, mask)

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        """Run ``tokens`` (LongTensor ``[T]``) at positions ``pos..pos+T-1``.

        Returns logits ``[T, V]`` if ``all_logits`` else ``[V]`` for the last token,
        in float32. More than :data:`UBATCH` tokens run as consecutive passes of at most that many.
        Raises PowerInferError when the context would overflow.
        """
        T = tokens.shape[0]
        if pos + T > self.n_ctx:
            raise PowerInferError(f"{pos + T} tokens exceed the context length {self.n_ctx}")
        if T > UBATCH:  # activations of UBATCH tokens at a time (llama.cpp's n_ubatch), not of the whole prompt
            outs = [self.forward(tokens[i:i + UBATCH], pos + i, all_logits) for i in range(0, T, UBATCH)]
            return torch.cat(outs) if all_logits else outs[-1]
        if self.before_forward is not None:
            self.before_forward()
        x = embed(self.tok_embd, tokens).to(self.dtype)  # [T, D]
        if self.pos_embd is not None:
            off = pos + self.args.family.learned_pos_offset
            x = x + self.pos_embd[off:off + T]
        pl = self.placement  # offloaded: the residual moves to a layer's side (a few KB), never weights
        if pl is None:  # all on the CPU: nothing to move or time per layer
            for i, layer in enumerate(self.layers):
                x = self.block(i, layer, x, pos)
            logits = linear(self.output_norm(x if all_logits else x[-1:]), self.output).float()
            return logits if all_logits else logits[0]
        pl.begin_forward()
        for i, layer in enumerate(self.layers):
            x = self._side(x, layer.on_device)
            pl.segment_start(layer.on_device)
            x = self.block(i, layer, x, pos)
            pl.segment_end(layer.on_device)
        x = self._side(x if all_logits else x[-1:], self.head_on_device)
        pl.segment_start(self.head_on_device)
        logits = linear(self.output_norm(x), self.output)
        logits = logits.float().cpu() if all_logits else logits[0].float().cpu()
        pl.segment_end(self.head_on_device)
        pl.end_forward(T)
        return logits

    def block(self, i: int, layer: Layer, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Layer ``i`` on ``x`` ``[T, D]`` (on the device the layer's attention lives on)."""
        if self.args.family.parallel_attn:  # Falcon: both branches read the layer input x
            xa = layer.attn_norm(x)
            xn = xa if layer.ffn_norm is layer.attn_norm else layer.ffn_norm(x)
            return x + self.attention(i, layer, xa, pos) + self._ffn(i, layer, x, xn)
        x = x + self.attention(i, layer, layer.attn_norm(x), pos)
        return x + self._ffn(i, layer, x, layer.ffn_norm(x))

    def oracle_masks(self) -> None:
        """Use the true active set instead of the predictor (for tests and predictor studies).

        The oracle computes every neuron's pre-activation to find the set, so prompts apply
        the masks to those (never per-token rows): it equals dense bit for bit."""
        a = self.args
        for layer in self.layers:
            layer.ffn.rows_max_share = 0.0

        def fn(i: int, x: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
            gate, up = self.layers[i].ffn.preact(xn)
            return a.family.active_mask(a.activation, gate, up)

        self.mask_fn = fn

    def active_share(self) -> float | None:
        """Mean share of FFN neurons computed per token and layer so far (None if dense)."""
        n = sum(l.ffn.n_calls for l in self.layers)
        if self.dense or n == 0:
            return None
        return sum(l.ffn.n_active for l in self.layers) / (n * self.args.n_ff)

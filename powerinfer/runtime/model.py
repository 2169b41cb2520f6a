"""The decoder: weights from a GGUF, a preallocated KV cache, dense or sparse FFNs.

Batch 1, one sequence, positions indexed into a cache allocated once
(gpt-fast style). Llama-family blocks (RMSNorm, interleaved "normal" GGML RoPE,
GQA attention) read the Q/K rows in GGML's permuted layout directly, so no
un-permuting is needed.

Shapes: ``T`` tokens in this call, ``P`` the position of the first of them,
``D = n_embd``, ``F = n_ff``, ``Hq/Hkv`` heads, ``d`` head dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from .args import ModelArgs
from .ffn import FFN
from .weights import load_tensor


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [D]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) d, D]
    wo: torch.Tensor  # [D, Hq d]
    ffn_norm: torch.Tensor  # [D]
    ffn: FFN


class KVCache:
    """Keys and values for every layer and position: ``[n_layer, n_ctx, Hkv, d]`` each."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, dtype: torch.dtype):
        self.k = torch.zeros(n_layer, n_ctx, n_head_kv, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)


def rope_tables(n_ctx: int, n_rot: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n_ctx, n_rot/2]`` in fp32 for GGML normal-mode RoPE."""
    inv = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot))
    ang = torch.outer(torch.arange(n_ctx, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])``. ``x``: ``[T, H, d]``; cos/sin ``[T, d/2]``."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def build_ffn(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool) -> FFN:
    """Layer ``i``'s FFN from GGUF ``g``: PWRI files give ``ffn_down_t`` and the predictor."""
    p = f"blk.{i}."
    gate = load_tensor(g, p + "ffn_gate.weight", dtype) if a.family.gated else None
    up = load_tensor(g, p + "ffn_up.weight", dtype)
    if a.sparse:
        down_t = load_tensor(g, p + "ffn_down_t.weight", dtype)
    else:
        down_t = load_tensor(g, p + "ffn_down.weight", dtype).T  # [F, D] view of [D, F]
    ffn = FFN(a.family, a.activation, gate, up, down_t, threshold=a.sparse_threshold)
    for w, name in ((gate, "ffn_gate"), (up, "ffn_up"), (down_t, "ffn_down_t")):
        if w is not None and tuple(w.shape) != (a.n_ff, a.n_embd):
            raise PowerInferError(f"{g.path}: blk.{i}.{name} has shape {tuple(w.shape)}, "
                                  f"expected [n_ff={a.n_ff}, n_embd={a.n_embd}]")
    if a.sparse and not dense:
        ffn.fc1 = load_tensor(g, p + "fc1.weight", dtype)
        ffn.fc2 = load_tensor(g, p + "fc2.weight", dtype)
        if ffn.fc1.shape[1] != a.n_embd or ffn.fc2.shape != (a.n_ff, ffn.fc1.shape[0]):
            raise PowerInferError(f"{g.path}: blk.{i} predictor shapes {tuple(ffn.fc1.shape)}, "
                                  f"{tuple(ffn.fc2.shape)} do not match the model")
    return ffn


class Transformer:
    """A GGUF model ready to run. ``dense=True`` computes every FFN neuron even in a PWRI file.

    Raises PowerInferError when the file's tensors do not match its metadata.
    """

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, dense: bool = False,
                 n_ctx: int | None = None):
        self.args = a = ModelArgs.from_gguf(g)
        if a.family.norm != "rms" or a.family.rope != "normal":
            raise PowerInferError(f"{g.path}: the runtime has no {a.family.name} decoder block yet")
        self.dtype = dtype
        self.dense = dense or not a.sparse
        self.n_ctx = min(n_ctx or a.n_ctx, a.n_ctx)
        self.tok_embd = load_tensor(g, "token_embd.weight", dtype)  # [V, D]
        self.output_norm = load_tensor(g, "output_norm.weight", dtype)
        self.output = load_tensor(g, "output.weight", dtype)  # [V, D]
        if self.tok_embd.shape != (a.n_vocab or self.tok_embd.shape[0], a.n_embd):
            raise PowerInferError(f"{g.path}: token_embd shape {tuple(self.tok_embd.shape)} does not match n_embd {a.n_embd}")
        self.layers: list[Layer] = []
        for i in range(a.n_layer):
            p = f"blk.{i}."
            wq, wk, wv = (load_tensor(g, p + n, dtype) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight"))
            hd = a.head_dim
            want = [(a.n_head * hd, a.n_embd), (a.n_head_kv * hd, a.n_embd), (a.n_head_kv * hd, a.n_embd)]
            if [tuple(w.shape) for w in (wq, wk, wv)] != want:
                raise PowerInferError(f"{g.path}: layer {i} attention shapes do not match the metadata")
            self.layers.append(Layer(
                attn_norm=load_tensor(g, p + "attn_norm.weight", dtype),
                wqkv=torch.cat([wq, wk, wv], 0),
                wo=load_tensor(g, p + "attn_output.weight", dtype),
                ffn_norm=load_tensor(g, p + "ffn_norm.weight", dtype),
                ffn=build_ffn(g, i, a, dtype, self.dense),
            ))
        self.cos, self.sin = rope_tables(self.n_ctx, a.n_rot, a.rope_base)
        self.cache = KVCache(a.n_layer, self.n_ctx, a.n_head_kv, a.head_dim, dtype)
        self.mask_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ forward
    def attention(self, i: int, layer: Layer, x: torch.Tensor, pos: int) -> torch.Tensor:
        a = self.args
        T, hd = x.shape[0], a.head_dim
        qkv = x @ layer.wqkv.T  # [T, (Hq + 2Hkv) d]
        q, k, v = qkv.split([a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], dim=-1)
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]
        q = apply_rope(q.view(T, a.n_head, hd), cos, sin)
        k = apply_rope(k.view(T, a.n_head_kv, hd), cos, sin)
        self.cache.k[i, pos:pos + T] = k
        self.cache.v[i, pos:pos + T] = v.view(T, a.n_head_kv, hd)
        S = pos + T
        kk = self.cache.k[i, :S].transpose(0, 1)  # [Hkv, S, d]
        vv = self.cache.v[i, :S].transpose(0, 1)
        mask = None
        if T > 1:
            mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=pos)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask,
                                           enable_gqa=a.n_head != a.n_head_kv)  # [Hq, T, d]
        return o.transpose(0, 1).reshape(T, a.n_head * hd) @ layer.wo.T

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        """Run ``tokens`` (LongTensor ``[T]``) at positions ``pos..pos+T-1``.

        Returns logits ``[T, V]`` if ``all_logits`` else ``[V]`` for the last token,
        in float32. Raises PowerInferError when the context would overflow.
        """
        a = self.args
        T = tokens.shape[0]
        if pos + T > self.n_ctx:
            raise PowerInferError(f"{pos + T} tokens exceed the context length {self.n_ctx}")
        x = self.tok_embd[tokens]  # [T, D]
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, layer, rms_norm(x, layer.attn_norm, a.norm_eps), pos)
            xn = rms_norm(x, layer.ffn_norm, a.norm_eps)
            mask = self.mask_fn(i, x, xn) if self.mask_fn is not None else None
            x = x + layer.ffn(x, xn, mask)
        if not all_logits:
            x = x[-1:]
        logits = rms_norm(x, self.output_norm, a.norm_eps) @ self.output.T
        return logits.float() if all_logits else logits[0].float()

    def oracle_masks(self) -> None:
        """Use the true active set instead of the predictor (for tests and predictor studies)."""
        a = self.args

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

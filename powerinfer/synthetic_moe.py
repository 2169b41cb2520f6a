"""Mixture-of-experts models with random weights and *designed* routing and neuron sparsity.

What the MoE decode benchmark (``benchmarks/make_moe_model.py``, ``benchmarks/bench_moe.py``) is
built from, as :mod:`powerinfer.synthetic` builds the dense and PowerInfer ones. Two families, in
the layout of their published checkpoints (per-expert tensors), which llama.cpp's
``convert_hf_to_gguf.py`` reads:

* ``qwen3moe``: ``Qwen3MoeForCausalLM`` (router ``mlp.gate`` on the FFN-normed residual, softmax,
  top-k renormalized, SwiGLU experts ``mlp.experts.E.{gate,up,down}_proj``, per-head Q/K norms);
* ``smallthinker``: ``SmallThinkerForCausalLM`` (router ``block_sparse_moe.primary_router`` on the
  layer's input before attention, ReGLU experts ``block_sparse_moe.experts.E.{gate,up,down}``, NoPE
  on the global layers and RoPE with a 4096-token window on the others, ``rope_layout`` /
  ``sliding_window_layout``).

The design. Every embedding row is ``mu 1 + N(0, sigma^2)`` (mu = sigma = 0.02): the residual
stream has a common component, so ``mean(x) > 0`` for every token's (normed or raw) residual
``x``, and a matrix row ``w = g + (c / n_embd) 1`` reads ``w . x = g . x + c mean(x)``: ``c`` acts
as a bias. Each layer's two additions (attention's ``o_proj``, the experts' ``down``) are scaled so
they add ``layer_gain * sigma`` per dimension, so the residual stays close to the embedding and
every layer, in the shallow model or repeated by ``make_deep_model.py``, sees about the same input
distribution as the one it was designed on.

* Routing: router row ``e`` is ``g_e + (c_e / n_embd) 1``, ``c_e`` found by iteration so that expert
  ``e`` is among the top ``n_expert_used`` for a share ``p_e`` of the tokens, ``p`` a power law over
  experts (:func:`powerinfer.synthetic.power_law_probs` with mean ``n_expert_used / n_expert``: the
  hottest 10% of experts carry ``expert_top10`` of the routings), experts shuffled per layer.
* Neurons (ReGLU experts only): gate row ``j`` of each expert is ``g_j + (c_j / n_embd) 1``, ``c_j``
  from the Gaussian quantile of ``g_j . x / mean(x)``, so that neuron ``j`` fires (``gate_j x > 0``)
  with probability ``p_j``, a power law over the expert's neurons with mean ``neuron_active`` (the
  hottest 10% carry ``neuron_top10``), as the PowerInfer benchmark models' predictors are designed.

Designed on the even tokens of a calibration text, measured on the odd ones, in the shallow model
and in its layers repeated ``repeat`` times each (the deep file's layer ``k`` is layer ``k // repeat``);
with ``repeat`` > 1 each layer is designed on the residuals its first copy in the deep file sees (the
deep file is the one benchmarked; the residual's noise still grows a little over the copies, and the
firing shares with it: ``design.json`` has every layer's figures).
The measuring forward pass (:func:`forward_layer`) is this module's own, f32 from the f16 weights
as written; it is for the statistics, not a reference for logits (the tests compare the runtimes
with transformers and llama.cpp). The model is random: its text is noise, it is for speed.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .synthetic import power_law_probs

__all__ = ["MoeShape", "smallthinker_21b", "qwen3_30b", "hf_config", "build_moe_hf"]

MU = SIGMA = 0.02  # embedding rows: MU + N(0, SIGMA^2) per dimension
INIT = 0.02  # std of every other random matrix before scaling


@dataclass(frozen=True)
class MoeShape:
    """The model's dimensions (the published config's names in comments) and the design targets."""

    family: str  # "qwen3moe" | "smallthinker"
    n_layer: int  # num_hidden_layers (cut)
    n_embd: int  # hidden_size
    n_head: int  # num_attention_heads
    n_head_kv: int  # num_key_value_heads
    head_dim: int
    n_expert: int  # num_experts / moe_num_primary_experts
    n_expert_used: int  # num_experts_per_tok / moe_num_active_primary_experts
    n_ff_exp: int  # moe_intermediate_size / moe_ffn_hidden_size
    n_vocab: int = 151936
    n_ctx: int = 16384
    rope_theta: float = 1e6
    expert_top10: float = 0.30  # share of routings on the hottest 10% of experts
    neuron_active: float = 0.10  # ReGLU experts: mean firing probability of a neuron
    neuron_top10: float = 0.54  # ReGLU experts: share of firings on the hottest 10% of an expert's neurons
    layer_gain: float = 0.05  # each layer's additions, per dimension, in units of SIGMA
    calib_tokens: int = 1024
    seed: int = 0

    @property
    def relu(self) -> bool:
        return self.family == "smallthinker"

    def uses_rope(self, il: int) -> bool:
        """SmallThinker-21B: layers 0, 4, 8, ... are global NoPE layers, the others RoPE + window."""
        return self.family != "smallthinker" or il % 4 != 0


def smallthinker_21b(n_layer: int = 4, **kw) -> MoeShape:
    """SmallThinker-21BA3B's dimensions (52 layers published) cut to ``n_layer``: the model card's table
    (SJTU-IPADS/SmallThinker README: 2560, 28 / 4 heads, 64 experts of 768, 6 used, vocab 151936, 16K
    context) and its config's layouts (13 global layers at 0, 4, 8, ... of 52, ``sliding_window_size``
    4096). ``rope_theta`` 1.5e6 and the softmax gate are the 4B config's, not checked for the 21B."""
    return MoeShape("smallthinker", n_layer, n_embd=2560, n_head=28, n_head_kv=4, head_dim=128, n_expert=64,
                    n_expert_used=6, n_ff_exp=768, n_ctx=16384, rope_theta=1.5e6, **kw)


def qwen3_30b(n_layer: int = 4, **kw) -> MoeShape:
    """Qwen3-30B-A3B's dimensions (48 layers published) cut to ``n_layer``."""
    return MoeShape("qwen3moe", n_layer, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
                    n_expert_used=8, n_ff_exp=768, n_ctx=40960, rope_theta=1e6, **kw)


def hf_config(s: MoeShape, bos: int, eos: int) -> dict:
    """The ``config.json`` of the published checkpoint's family with ``s``'s dimensions."""
    common = {"hidden_size": s.n_embd, "num_hidden_layers": s.n_layer, "num_attention_heads": s.n_head,
              "num_key_value_heads": s.n_head_kv, "head_dim": s.head_dim, "vocab_size": s.n_vocab,
              "max_position_embeddings": s.n_ctx, "rope_theta": s.rope_theta, "rms_norm_eps": 1e-6,
              "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos,
              "initializer_range": INIT, "attention_dropout": 0.0, "torch_dtype": "float16", "use_cache": True}
    if s.family == "qwen3moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "hidden_act": "silu", "attention_bias": False, "intermediate_size": 6144, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "moe_intermediate_size": s.n_ff_exp, "num_experts": s.n_expert,
                "num_experts_per_tok": s.n_expert_used, "norm_topk_prob": True, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "max_window_layers": s.n_layer, "sliding_window": None,
                "use_sliding_window": False}
    return {"architectures": ["SmallThinkerForCausalLM"], "model_type": "smallthinker", **common,
            "moe_ffn_hidden_size": s.n_ff_exp, "moe_num_primary_experts": s.n_expert,
            "moe_num_active_primary_experts": s.n_expert_used, "moe_primary_router_apply_softmax": True,
            "norm_topk_prob": True, "output_router_logits": False,
            "rope_layout": [int(s.uses_rope(i)) for i in range(s.n_layer)],
            "sliding_window_layout": [int(s.uses_rope(i)) for i in range(s.n_layer)],
            "sliding_window_size": 4096}


# ---------------------------------------------------------------------------- weights of one layer
def _randn(shape: tuple[int, ...], gen: torch.Generator, std: float = INIT) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(torch.float16)


def _names(s: MoeShape, il: int) -> dict[str, str]:
    p = f"model.layers.{il}."
    moe = p + ("mlp." if s.family == "qwen3moe" else "block_sparse_moe.")
    suffix = "_proj" if s.family == "qwen3moe" else ""
    return {"router": moe + ("gate" if s.family == "qwen3moe" else "primary_router") + ".weight",
            "expert": moe + "experts.{e}.{w}" + suffix + ".weight", "attn": p + "self_attn.{w}_proj.weight",
            "norm": p + "{w}.weight"}


@dataclass
class Layer:
    """One layer's f16 weights, torch ``[out, in]``; experts ``[n_expert, out, in]``."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def tensors(self, s: MoeShape, il: int) -> dict[str, torch.Tensor]:
        """The HF tensor names of layer ``il`` -> contiguous f16 tensors (norm weights 1)."""
        n = _names(s, il)
        out = {n["attn"].format(w=w): t for w, t in (("q", self.wq), ("k", self.wk), ("v", self.wv), ("o", self.wo))}
        ones = torch.ones(s.n_embd, dtype=torch.float16)
        out[n["norm"].format(w="input_layernorm")] = ones
        out[n["norm"].format(w="post_attention_layernorm")] = ones.clone()
        if s.family == "qwen3moe":
            for w in ("q_norm", "k_norm"):
                out[n["norm"].format(w="self_attn." + w)] = torch.ones(s.head_dim, dtype=torch.float16)
        out[n["router"]] = self.router
        for w, t in (("gate", self.gate), ("up", self.up), ("down", self.down)):
            for e in range(s.n_expert):
                out[n["expert"].format(e=e, w=w)] = t[e].clone()
        return out


def random_layer(s: MoeShape, gen: torch.Generator) -> Layer:
    d, q, kv, f, E = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_ff_exp, s.n_expert
    return Layer(wq=_randn((q, d), gen), wk=_randn((kv, d), gen), wv=_randn((kv, d), gen), wo=_randn((d, q), gen),
                 router=_randn((E, d), gen), gate=_randn((E, f, d), gen), up=_randn((E, f, d), gen),
                 down=_randn((E, d, f), gen))


# ---------------------------------------------------------------------------- the measuring forward pass
def _rms(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate-half RoPE on ``[T, heads, head_dim]`` at positions 0..T-1."""
    T, _, hd = x.shape
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(s: MoeShape, L: Layer, h: torch.Tensor, il: int) -> torch.Tensor:
    """Causal GQA self-attention's output ``[T, n_embd]`` (before the residual add); T <= 4096, so the
    sliding window of SmallThinker's RoPE layers does not apply."""
    x = _rms(h)
    T = x.shape[0]
    q = (x @ L.wq.float().T).view(T, s.n_head, s.head_dim)
    k = (x @ L.wk.float().T).view(T, s.n_head_kv, s.head_dim)
    v = (x @ L.wv.float().T).view(T, s.n_head_kv, s.head_dim)
    if s.family == "qwen3moe":
        q, k = _rms(q), _rms(k)
    if s.uses_rope(il):
        q, k = _rope(q, s.rope_theta), _rope(k, s.rope_theta)
    rep = s.n_head // s.n_head_kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)
    return a.transpose(0, 1).reshape(T, -1) @ L.wo.float().T


def router_input(s: MoeShape, h_in: torch.Tensor, h_mid: torch.Tensor) -> torch.Tensor:
    """SmallThinker routes the layer's raw input (before attention), Qwen3-MoE the FFN-normed residual."""
    return h_in if s.family == "smallthinker" else _rms(h_mid)


def route(s: MoeShape, L: Layer, xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids ``[T, k]``, weights ``[T, k]``): top-k of the router logits, weights softmaxed over the
    k (Qwen3-MoE: softmax over all then renormalized, the same numbers)."""
    logits = xr @ L.router.float().T
    top, ids = logits.topk(s.n_expert_used, dim=-1)
    return ids, torch.softmax(top, -1)


def experts(s: MoeShape, L: Layer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
            active: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, n_embd]``; ``active`` (``[n_expert, n_ff_exp]``, ReGLU only)
    gets each neuron's firing count on the tokens routed to it, for :func:`forward_layer`'s statistics."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        g = xe @ L.gate[e].float().T
        act = torch.relu(g) if s.relu else torch.nn.functional.silu(g)
        if active is not None:
            active[e] += (g > 0).sum(0)
        y = (act * (xe @ L.up[e].float().T)) @ L.down[e].float().T
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out


@dataclass
class LayerStats:
    """Routing and neuron statistics of one layer on a set of tokens."""

    freq: np.ndarray  # [n_expert]: share of tokens routed to each expert
    active: float | None  # ReGLU: mean share of the routed experts' neurons that fire

    def summary(self, s: MoeShape) -> dict:
        f = np.sort(self.freq)[::-1]
        n10 = max(1, s.n_expert // 10)
        return {"hottest_expert": round(float(f[0]), 3), "coldest_expert": round(float(f[-1]), 4),
                "top10_share": round(float(f[:n10].sum() / f.sum()), 3),
                **({"neuron_active": round(self.active, 3)} if self.active is not None else {})}


def forward_layer(s: MoeShape, L: Layer, h: torch.Tensor, il: int, held: slice) -> tuple[torch.Tensor, LayerStats]:
    """Layer ``il`` on residuals ``h`` ``[T, n_embd]``: the next residuals and the statistics on tokens ``held``."""
    mid = h + attention(s, L, h, il)
    ids, w = route(s, L, router_input(s, h, mid))
    x = _rms(mid)
    active = torch.zeros(s.n_expert, s.n_ff_exp, dtype=torch.int64) if s.relu else None
    hold = torch.zeros(h.shape[0], dtype=torch.bool)
    hold[held] = True
    out = mid + experts(s, L, x, ids, w)
    freq = torch.bincount(ids[hold].reshape(-1), minlength=s.n_expert).double() / int(hold.sum())
    share = None
    if s.relu:  # neuron statistics on the held tokens only
        experts(s, L, x[hold], ids[hold], w[hold], active)
        share = float(active.sum()) / (int(hold.sum()) * s.n_expert_used * s.n_ff_exp)
    return out, LayerStats(freq.numpy(), share)


# ---------------------------------------------------------------------------- the design
def _gaussian_offsets(r: torch.Tensor, p: np.ndarray) -> torch.Tensor:
    """``q[j]`` with ``P(r[:, j] >= q[j]) ~ p[j]`` from the mean and std of each column of ``r`` ``[T, F]``
    (steadier than an empirical quantile for rare ones, as in :func:`powerinfer.synthetic.design_predictor`)."""
    z = torch.special.ndtri(torch.from_numpy(1.0 - p).float().clamp(1e-6, 1 - 1e-6))
    return r.mean(0) + r.std(0) * z


def design_router(s: MoeShape, L: Layer, xr: torch.Tensor, p: np.ndarray, steps: int = 400) -> None:
    """Add ``(c_e / n_embd) 1`` to router row ``e`` so the top-k frequency of expert ``e`` on ``xr`` is ``p[e]``."""
    S = xr @ L.router.float().T  # [T, E]
    m = xr.mean(1, keepdim=True)  # [T, 1], > 0
    target = torch.from_numpy(p).float()
    c = torch.zeros(s.n_expert)
    scale = float(S.std() / m.mean())
    T = xr.shape[0]
    for it in range(steps):
        ids = (S + c * m).topk(s.n_expert_used, dim=-1).indices
        freq = torch.bincount(ids.reshape(-1), minlength=s.n_expert).float() / T
        lr = 0.3 * (1 - it / steps) + 0.01
        c += lr * scale * (target.log() - freq.clamp(min=0.5 / T).log())
    L.router = (L.router.float() + c[:, None] / s.n_embd).to(torch.float16)


def design_neurons(s: MoeShape, L: Layer, x: torch.Tensor, gen: torch.Generator, p: np.ndarray) -> None:
    """Add ``(c_j / n_embd) 1`` to each expert's gate row ``j`` so that neuron ``j`` fires with probability
    ``p`` (shuffled per expert) on the FFN inputs ``x``."""
    m = x.mean(1, keepdim=True)
    for e in range(s.n_expert):
        pe = np.empty_like(p)
        pe[torch.randperm(s.n_ff_exp, generator=gen).numpy()] = p
        g = L.gate[e].float()
        q = _gaussian_offsets((x @ g.T) / m, pe)  # neuron j fires iff g_j . x / mean(x) >= q_j
        L.gate[e] = (g - q[:, None] / s.n_embd).to(torch.float16)


def _scale_to(t: torch.Tensor, y: torch.Tensor, target: float) -> torch.Tensor:
    """``t`` scaled so that ``y`` (linear in ``t``) has per-dimension std ``target``."""
    return (t.float() * (target / float(y.std()))).to(torch.float16)


def design_layer(s: MoeShape, L: Layer, h: torch.Tensor, il: int, gen: torch.Generator, design: slice) -> None:
    """Fix layer ``il``'s router, gates and output scales on the residuals ``h[design]``."""
    hd = h[design]
    target = s.layer_gain * SIGMA
    L.wo = _scale_to(L.wo, attention(s, L, hd, il), target)
    mid = hd + attention(s, L, hd, il)
    p_exp, _ = power_law_probs(s.n_expert, s.n_expert_used / s.n_expert, s.expert_top10)
    pe = np.empty_like(p_exp)
    pe[torch.randperm(s.n_expert, generator=gen).numpy()] = p_exp
    design_router(s, L, router_input(s, hd, mid), pe)
    x = _rms(mid)
    if s.relu:
        p_neuron, _ = power_law_probs(s.n_ff_exp, s.neuron_active, s.neuron_top10)
        design_neurons(s, L, x, gen, p_neuron)
    ids, w = route(s, L, router_input(s, hd, mid))
    L.down = _scale_to(L.down, experts(s, L, x, ids, w), target)


# ---------------------------------------------------------------------------- the HF folder
def calibration_ids(tokenizer_json: Path, text: str, n: int) -> list[int]:
    """The first ``n`` ids of ``text`` under the folder's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text[: n * 8]).ids[:n]
    if len(ids) < n:
        raise ValueError(f"calibration text: {len(ids)} tokens, {n} needed")
    return ids


def _save(d: Path, name: str, tensors: dict[str, torch.Tensor], index: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(d / name), metadata={"format": "pt"})
    index.update({k: name for k in tensors})


def build_moe_hf(d: str | Path, s: MoeShape, tokenizer_files: dict[str, Path], text: str, repeat: int = 1,
                 log: Callable[[str], None] = print) -> dict:
    """Write the HF folder ``d`` for ``s`` (module docstring): ``config.json``, one safetensors shard per
    layer and one for the embeddings, ``tokenizer_files`` copied in (name -> source; ``tokenizer.json``
    needed, for the calibration text), and ``design.json``: the shape and the statistics measured on the
    held-out tokens, per layer of the shallow model and of its layers each repeated ``repeat`` times."""
    import shutil

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for name, src in tokenizer_files.items():
        shutil.copy(src, d / name)
    gen_cfg = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").is_file() else {}
    bos, eos = gen_cfg.get("bos_token_id", 1), gen_cfg.get("eos_token_id", 2)
    ids = calibration_ids(d / "tokenizer.json", text, s.calib_tokens)
    gen = torch.Generator().manual_seed(s.seed)
    index: dict[str, str] = {}
    n_shards = s.n_layer + 1
    shard = "model-{:05d}-of-{:05d}.safetensors"
    emb = torch.empty(s.n_vocab, s.n_embd, dtype=torch.float16)
    for rows in emb.split(8192):
        rows.copy_(torch.randn(rows.shape, generator=gen) * SIGMA + MU)
    lm_head = torch.empty(s.n_vocab, s.n_embd, dtype=torch.float16)
    for rows in lm_head.split(8192):
        rows.copy_(torch.randn(rows.shape, generator=gen) * INIT)
    h = emb[torch.tensor(ids)].float()
    h_deep = h.clone()
    _save(d, shard.format(n_shards, n_shards), {"model.embed_tokens.weight": emb, "lm_head.weight": lm_head,
                                                "model.norm.weight": torch.ones(s.n_embd, dtype=torch.float16)}, index)
    del emb, lm_head
    design, held = slice(0, None, 2), slice(1, None, 2)
    shallow_stats, deep_stats = [], []
    for il in range(s.n_layer):
        t1 = time.time()
        L = random_layer(s, gen)
        if repeat > 1:  # designed on what the deep file's first copy of this layer sees
            design_layer(s, L, h_deep, il * repeat, gen, design)
        else:
            design_layer(s, L, h, il, gen, design)
        h, st = forward_layer(s, L, h, il, held)
        shallow_stats.append(st.summary(s))
        for r in range(repeat if repeat > 1 else 0):
            h_deep, st = forward_layer(s, L, h_deep, il * repeat + r, held)
            deep_stats.append(st.summary(s))
        _save(d, shard.format(il + 1, n_shards), L.tensors(s, il), index)
        log(f"{d.name} layer {il}: {shallow_stats[-1]} ({time.time() - t1:.0f} s)")
        del L
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (d / "config.json").write_text(json.dumps(hf_config(s, bos, eos), indent=1))
    summary = {"shape": asdict(s), "repeat": repeat, "calib_tokens_held_out": len(ids) // 2,
               "residual_growth": round(float(h.std() / SIGMA), 3),
               "layers": shallow_stats, "deep_layers": deep_stats, "seconds": round(time.time() - t0, 1)}
    (d / "design.json").write_text(json.dumps(summary, indent=1))
    return summary


def tiny(s: MoeShape, **kw) -> MoeShape:
    """``s`` shrunk for tests and smoke runs (the family's structure kept)."""
    return replace(s, **{"n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32, "n_expert": 16,
                         "n_expert_used": min(4, s.n_expert_used), "n_ff_exp": 64, **kw})

"""A Llama-shaped ReLU model with random weights and *designed* predictors, of any size.

What the decode benchmark (``benchmarks/make_bench_model.py``: 7B width, 4 layers, Llama-2
vocabulary) and the demo's speed stage (:mod:`powerinfer.speed_demo`: 7B width, 2 layers, the
demo model's 512-token vocabulary) are built from. :func:`build_designed_model` writes, under OUT:

* ``hf/``: a ``LlamaForCausalLM`` with ``hidden_act: relu`` and random weights (f16
  safetensors) plus the tokenizer files of ``tokenizer_dir``;
* ``predictor/``: per-layer ``model_{i}.pt`` predictors whose ``fc2`` is designed so that
  about ``active`` (e.g. 10%) of the FFN neurons are predicted active per token, with a power
  law over neurons (neuron of rank r fires with probability ~ r^-alpha, alpha chosen so the
  hottest 10% of neurons carry ``top10`` of all activations), neurons shuffled;
* ``activation/``: per-layer counts of predicted-active tokens per neuron on the calibration
  text (on a random model the predictor *defines* the sparsity: which neurons are computed is
  what decides the bytes read per token);
* a PWRI file (with the predictors) and a dense GGUF, both written by
  :func:`powerinfer.convert.writer.convert` in the asked type.

Predictor design: ``fc1`` is random, so ``z = relu(fc1 x)`` is a non-negative vector whose
mean ``m(z)`` is positive. Row ``j`` of ``fc2`` is a random vector ``g_j`` plus ``c_j / H`` on
every entry, so ``logit_j = g_j . z + c_j m(z)``: neuron j is active iff
``g_j . z / m(z) >= -c_j``. ``c_j`` is set from the (Gaussian) quantile of ``g_j . z / m(z)``
over residual states of the real model on calibration text, giving neuron j the target
probability ``p_j``. The share measured on held-out tokens (odd tokens; the design uses the
even ones) is returned and logged.

The model is random, so its text is noise: it is for speed, not for reading.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

__all__ = ["Shape", "power_law_probs", "make_hf", "residuals", "design_predictor", "build_designed_model"]


@dataclass(frozen=True)
class Shape:
    """The designed model's dimensions and predictor targets."""

    n_layer: int = 4
    n_embd: int = 4096
    n_ff: int = 11008
    n_head: int = 32
    n_vocab: int = 32000
    n_ctx: int = 2048
    hidden: int = 1024  # predictor width H
    active: float = 0.10  # target predicted-active share per token
    top10: float = 0.54  # share of activations on the hottest 10% of neurons
    calib_tokens: int = 1024
    seed: int = 0
    n_head_kv: int = 0  # 0: n_head (no GQA)
    hidden_act: str = "relu"  # "silu": a SwiGLU model as Llama 3 (dense benchmarks; no predictor design)
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # HF rope_scaling items, e.g. (("rope_type", "llama3"), ("factor", 8.0), ...)


def power_law_probs(n_ff: int, mean: float, top10: float, p_max: float = 0.9) -> tuple[np.ndarray, float]:
    """Per-rank firing probabilities ``min(p_max, C r^-alpha)`` with the given mean and top-10% share."""

    def probs(alpha: float) -> np.ndarray:
        r = np.arange(1, n_ff + 1, dtype=np.float64) ** -alpha
        lo, hi = 0.0, 1e9
        for _ in range(200):  # C such that the mean is `mean`
            c = (lo + hi) / 2
            if np.minimum(p_max, c * r).mean() > mean:
                hi = c
            else:
                lo = c
        return np.minimum(p_max, lo * r)

    lo, hi = 0.0, 4.0
    for _ in range(60):  # alpha such that the hottest 10% carry `top10` of the activations
        a = (lo + hi) / 2
        p = probs(a)
        share = p[: max(1, n_ff // 10)].sum() / p.sum()
        if share > top10:
            hi = a
        else:
            lo = a
    return probs(lo), lo


def make_hf(out: Path, shape: Shape, tokenizer_dir: Path, log: Callable[[str], None] = print) -> Path:
    """``out/hf``: the random-weight Llama (f16 safetensors; ``shape.hidden_act``, ReLU by default,
    ``shape.n_head_kv`` KV heads, ``shape.rope_theta``/``rope_scaling``) with ``tokenizer_dir``'s
    ``tokenizer.model`` and ``tokenizer_config.json``; reused when it is already there. The converter
    pads the vocabulary with ``[PAD{i}]`` tokens when ``n_vocab`` exceeds the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = out / "hf"
    if (d / "config.json").is_file() and list(d.glob("*.safetensors")):
        log(f"{d}: exists, reused")
        return d
    torch.manual_seed(shape.seed)
    cfg = LlamaConfig(vocab_size=shape.n_vocab, hidden_size=shape.n_embd, intermediate_size=shape.n_ff,
                      num_hidden_layers=shape.n_layer, num_attention_heads=shape.n_head,
                      num_key_value_heads=shape.n_head_kv or shape.n_head, hidden_act=shape.hidden_act,
                      max_position_embeddings=shape.n_ctx, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, dtype="float16", rope_theta=shape.rope_theta,
                      rope_scaling=dict(shape.rope_scaling) or None)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.float16)
    gen = torch.Generator().manual_seed(shape.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # N(0, 0.02) as Llama's init, drawn in chunks to bound memory
                for chunk in p.split(4096):
                    chunk.copy_(torch.randn(chunk.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)
    model.config.dtype = torch.float16
    model.save_pretrained(d)
    del model
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, d / name)
        (d / name).chmod(0o644)
    return d


def residuals(hf_dir: Path, text: str, n_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each layer's predictor input (residual before ``ffn_norm``) ``[T, n_embd]`` fp32 on ``text``."""
    from .hf import load_hf_model, load_hf_tokenizer

    tok = load_hf_tokenizer(hf_dir)
    ids = tok(text[: n_tokens * 8], verbose=False).input_ids[:n_tokens]  # may pass the tokenizer's max length
    ids = [i % tok.vocab_size for i in ids]
    model = load_hf_model(hf_dir, torch.float32)
    got: dict[int, torch.Tensor] = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda m, a, i=i: got.__setitem__(i, a[0][0].detach().float().clone()))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    del model
    return [got[i] for i in range(len(got))], ids


def design_predictor(x: torch.Tensor, n_ff: int, hidden: int, p: np.ndarray, gen: torch.Generator):
    """fc1 ``[H, D]``, fc2 ``[F, H]`` giving neuron j the firing probability ``p[j]`` on states ``x``."""
    D = x.shape[1]
    fc1 = torch.randn(hidden, D, generator=gen) / D ** 0.5
    g = torch.randn(n_ff, hidden, generator=gen) / hidden ** 0.5
    z = torch.relu(x @ fc1.T)  # [T, H]
    r = (z @ g.T) / z.mean(1, keepdim=True)  # [T, F]: g_j . z / m(z)
    # r_j over tokens is close to Gaussian: its (1 - p_j) quantile from mean and std is
    # steadier than an empirical quantile for the rare neurons
    z_score = torch.special.ndtri(torch.from_numpy(1.0 - p).float().clamp(1e-6, 1 - 1e-6))
    q = r.mean(0) + r.std(0) * z_score  # [F]
    fc2 = g - q[:, None] / hidden  # logit_j = g_j . z - q_j m(z)
    return fc1, fc2


def build_designed_model(out: str | Path, shape: Shape, tokenizer_dir: str | Path, text: str, *,
                         sparse_name: str, dense_name: str, outtype: str = "f16", upstream_warnings: bool = True,
                         log: Callable[[str], None] = print) -> dict:
    """Write ``hf/``, ``predictor/``, ``activation/``, ``out/sparse_name`` (PWRI) and
    ``out/dense_name`` (dense GGUF) for ``shape`` (module docstring); returns a summary
    (the shape, alpha, the measured predicted-active share, file sizes, seconds).
    ``upstream_warnings``: as :func:`~powerinfer.convert.writer.convert` (False: files for pi-run only)."""
    from .convert.writer import convert
    from .formats.activation import save_activation_dir
    from .formats.predictor import LayerPredictor, save_predictor_dir

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    hf = make_hf(out, shape, Path(tokenizer_dir), log)
    log(f"hf model: {hf} ({time.time() - t0:.0f} s)")
    xs, _ = residuals(hf, text, shape.calib_tokens)
    p, alpha = power_law_probs(shape.n_ff, shape.active, shape.top10)
    log(f"power law: alpha {alpha:.3f}, hottest neuron p {p[0]:.2f}, coldest {p[-1]:.4f}")
    gen = torch.Generator().manual_seed(shape.seed + 1)
    preds, counts, shares = [], [], []
    for i, x in enumerate(xs):
        perm = torch.randperm(shape.n_ff, generator=gen).numpy()  # hot neurons scattered over the rows
        pj = np.empty_like(p)
        pj[perm] = p
        fc1, fc2 = design_predictor(x[0::2],  # design on even tokens, measure on odd
                                      shape.n_ff, shape.hidden, pj, gen)
        lp = LayerPredictor(fc1, fc2)
        act = lp.logits(x) >= 0  # [T, F]
        held = act[1::2].float()
        cnt = held.sum(0)
        top = cnt.sort(descending=True).values
        shares.append(held.mean().item())
        log(f"layer {i}: predicted-active share {held.mean().item():.3f} on held-out tokens "
            f"(min {held.mean(1).min().item():.3f}, max {held.mean(1).max().item():.3f}); "
            f"hottest 10% carry {top[: shape.n_ff // 10].sum().item() / max(1.0, cnt.sum().item()):.2f}")
        preds.append(lp)
        counts.append(act.sum(0).long())
    log(f"mean predicted-active share: {np.mean(shares):.3f} (target {shape.active})")
    save_predictor_dir(out / "predictor", preds, {"sparse_threshold": 0.0})
    save_activation_dir(out / "activation", counts, {
        "n_tokens": len(xs[0]), "note": "predicted-active counts of the designed predictors (benchmark model)",
        "sparsity": [1 - s for s in shares]})
    del xs
    t1 = time.time()
    sparse = convert(hf, out / sparse_name, out / "predictor", outtype=outtype, progress=False,
                     upstream_warnings=upstream_warnings)
    dense = convert(hf, out / dense_name, outtype=outtype, progress=False, upstream_warnings=upstream_warnings)
    log(f"wrote {sparse} ({sparse.stat().st_size / 1e9:.2f} GB) and {dense} "
        f"({dense.stat().st_size / 1e9:.2f} GB) in {time.time() - t1:.0f} s")
    return {**asdict(shape), "alpha": alpha, "predicted_active_share": float(np.mean(shares)), "outtype": outtype,
            "bytes": {sparse_name: sparse.stat().st_size, dense_name: dense.stat().st_size},
            "seconds": round(time.time() - t0, 1)}

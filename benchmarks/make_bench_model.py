"""Build the decode benchmark model: a Llama-2-7B-shaped ReLU model with designed predictors.

Writes, under OUT (default ``out/bench/``; never committed):

* ``hf/``: a ``LlamaForCausalLM`` with ``hidden_act: relu`` and random weights
  (f16 safetensors) plus the Llama-2 SentencePiece tokenizer (vocab 32000);
* ``predictor/``: per-layer ``model_{i}.pt`` predictors whose ``fc2`` is designed
  so that about ``--active`` (default 10%) of the FFN neurons are predicted
  active per token, with a power law over neurons (neuron of rank r fires with
  probability ~ r^-alpha, alpha chosen so the hottest 10% of neurons carry
  ``--top10`` of all activations, ~54% by default), neurons shuffled;
* ``activation/``: per-layer counts of predicted-active tokens per neuron on the
  calibration text (on a random model the predictor *defines* the sparsity:
  which neurons are computed is what decides the bytes read per token);
* ``bench.powerinfer.gguf`` (PWRI, f16) and ``bench.gguf`` (dense f16 for
  llama.cpp), both written by :func:`powerinfer.convert.writer.convert`.

Predictor design: ``fc1`` is random, so ``z = relu(fc1 x)`` is a non-negative
vector whose mean ``m(z)`` is positive. Row ``j`` of ``fc2`` is a random vector
``g_j`` plus ``c_j / H`` on every entry, so ``logit_j = g_j . z + c_j m(z)``:
neuron j is active iff ``g_j . z / m(z) >= -c_j``. ``c_j`` is set from the
(Gaussian) quantile of ``g_j . z / m(z)`` over residual states of the real model on
calibration text, giving neuron j the target probability ``p_j``. The measured
share on held-out tokens is printed.

Default size is the 7B shape cut to 4 layers (~1.9 GB per f16 file);
``--tiny`` (or ``--n-layer/--n-embd/...``) makes a small one for smoke runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TOKENIZER = SHARED / "tokenizers" / "llama2"
TEXT = SHARED / "data" / "tinystories" / "tinystories_sample.txt"


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


def make_hf(out: Path, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_vocab: int, n_ctx: int, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = out / "hf"
    if (d / "config.json").is_file() and list(d.glob("*.safetensors")):
        print(f"{d}: exists, reused")
        return d
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer,
                      num_attention_heads=n_head, num_key_value_heads=n_head, hidden_act="relu",
                      max_position_embeddings=n_ctx, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, dtype="float16")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.float16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # N(0, 0.02) as Llama's init, drawn in chunks to bound memory
                for chunk in p.split(4096):
                    chunk.copy_(torch.randn(chunk.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)
    model.config.torch_dtype = torch.float16
    model.save_pretrained(d)
    del model
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, d / name)
        (d / name).chmod(0o644)
    return d


def residuals(hf_dir: Path, n_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each layer's predictor input (residual before ``ffn_norm``) ``[T, n_embd]`` fp32 on real text."""
    from powerinfer.hf import load_hf_model, load_hf_tokenizer

    tok = load_hf_tokenizer(hf_dir)
    ids = tok(TEXT.read_text()[: n_tokens * 8]).input_ids[:n_tokens]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out/bench", help="output folder (default out/bench)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-vocab", type=int, default=32000)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024, help="predictor hidden size H")
    ap.add_argument("--active", type=float, default=0.10, help="target predicted-active share per token")
    ap.add_argument("--top10", type=float, default=0.54, help="share of activations on the hottest 10%% of neurons")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="2 layers, 256/688 dims, 128 hidden: a smoke-run model")
    ap.add_argument("--force", action="store_true", help="rebuild the HF folder too")
    a = ap.parse_args(argv)
    if a.tiny:
        a.n_layer, a.n_embd, a.n_ff, a.n_head, a.hidden = 2, 256, 688, 4, 128
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.force and (out / "hf").exists():
        shutil.rmtree(out / "hf")

    from powerinfer.convert.writer import convert
    from powerinfer.formats.activation import save_activation_dir
    from powerinfer.formats.predictor import LayerPredictor, save_predictor_dir

    t0 = time.time()
    hf = make_hf(out, a.n_layer, a.n_embd, a.n_ff, a.n_head, a.n_vocab, a.n_ctx, a.seed)
    print(f"hf model: {hf} ({time.time() - t0:.0f} s)")
    xs, _ = residuals(hf, a.calib_tokens)
    p, alpha = power_law_probs(a.n_ff, a.active, a.top10)
    print(f"power law: alpha {alpha:.3f}, hottest neuron p {p[0]:.2f}, coldest {p[-1]:.4f}")
    gen = torch.Generator().manual_seed(a.seed + 1)
    preds, counts, shares = [], [], []
    for i, x in enumerate(xs):
        perm = torch.randperm(a.n_ff, generator=gen).numpy()  # hot neurons scattered over the rows
        pj = np.empty_like(p)
        pj[perm] = p
        fc1, fc2 = design_predictor(x[0::2],  # design on even tokens, measure on odd
                                      a.n_ff, a.hidden, pj, gen)
        lp = LayerPredictor(fc1, fc2)
        act = lp.logits(x) >= 0  # [T, F]
        held = act[1::2].float()
        cnt = held.sum(0)
        top = cnt.sort(descending=True).values
        shares.append(held.mean().item())
        print(f"layer {i}: predicted-active share {held.mean().item():.3f} on held-out tokens "
              f"(min {held.mean(1).min().item():.3f}, max {held.mean(1).max().item():.3f}); "
              f"hottest 10% carry {top[: a.n_ff // 10].sum().item() / max(1.0, cnt.sum().item()):.2f}")
        preds.append(lp)
        counts.append(act.sum(0).long())
    print(f"mean predicted-active share: {np.mean(shares):.3f} (target {a.active})")
    save_predictor_dir(out / "predictor", preds, {"sparse_threshold": 0.0})
    save_activation_dir(out / "activation", counts, {
        "n_tokens": len(xs[0]), "note": "predicted-active counts of the designed predictors (benchmark model)",
        "sparsity": [1 - s for s in shares]})
    del xs
    t0 = time.time()
    sparse = convert(hf, out / "bench.powerinfer.gguf", out / "predictor", outtype="f16", progress=False)
    dense = convert(hf, out / "bench.gguf", outtype="f16", progress=False)
    print(f"wrote {sparse} ({sparse.stat().st_size / 1e9:.2f} GB) and {dense} "
          f"({dense.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    (out / "bench.json").write_text(json.dumps({
        "n_layer": a.n_layer, "n_embd": a.n_embd, "n_ff": a.n_ff, "n_head": a.n_head, "n_vocab": a.n_vocab,
        "hidden": a.hidden, "alpha": alpha, "predicted_active_share": float(np.mean(shares))}, indent=2) + "\n")


if __name__ == "__main__":
    main()

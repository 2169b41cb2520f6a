"""What the mixture-of-experts families share: config keys, checkpoint names, GGUF keys.

A mixture-of-experts FFN (Mixtral, Qwen3-MoE) replaces each layer's one gated FFN by a router
``ffn_gate_inp`` ``[n_expert, n_embd]`` and ``n_expert`` gated SiLU FFNs of width ``n_ff_exp``.
In the published Hugging Face checkpoints every expert is its own three matrices
(``...experts.{x}.w1/w3/w2`` for Mixtral, ``...experts.{x}.gate_proj/up_proj/down_proj`` for
Qwen3-MoE); llama.cpp's converter stacks them into one 3-D tensor per kind,
``blk.N.ffn_gate_exps.weight``/``ffn_up_exps`` (torch order ``[n_expert, n_ff_exp, n_embd]``) and
``ffn_down_exps`` (``[n_expert, n_embd, n_ff_exp]``), and writes ``{arch}.expert_count`` and
``{arch}.expert_used_count`` (Qwen3-MoE also ``{arch}.expert_feed_forward_length``). The writer's
rule transform ``expert`` marks a tensor stacked that way (:mod:`powerinfer.convert.experts`).

Config keys: ``num_local_experts`` (Mixtral; transformers 5 also saves Qwen3-MoE under it) or
``num_experts`` (the published Qwen3-MoE configs), and ``num_experts_per_tok``; both must be
positive with ``num_experts_per_tok <= n_expert``, checked here with ``config.json`` named.
"""
from __future__ import annotations

from typing import Any

from ..errors import PowerInferError
from .base import TensorRule

MAX_EXPERTS = 1 << 12


COUNT_KEYS = ("num_local_experts / num_experts", "num_experts_per_tok")  # as the messages name them


def expert_counts(cfg: dict[str, Any], source: str = "config.json", keys: tuple[str, str] = COUNT_KEYS
                  ) -> tuple[int, int]:
    """``(n_expert, n_expert_used)`` of an MoE config; PowerInferError naming ``source`` when they
    are missing, not positive integers, or ``n_expert_used > n_expert``. ``keys``: the config's own
    names of the two counts, for the messages (a family that maps its keys onto ours)."""
    n = cfg.get("num_local_experts", cfg.get("num_experts"))
    k = cfg.get("num_experts_per_tok")
    for key, v in zip(keys, (n, k)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_EXPERTS:
            raise PowerInferError(f"{source}: {key} = {v!r} is missing or out of range (1..{MAX_EXPERTS})")
    if k > n:
        raise PowerInferError(f"{source}: {keys[1]} {k} is more than the {n} experts")
    return n, k


_ACTS = {"silu": ("SiLU", ("silu", "swish")), "relu": ("ReLU", ("relu",))}  # label, config spellings


def require_hidden_act(cfg: dict[str, Any], source: str, family: str, want: str) -> None:
    """PowerInferError naming ``source`` unless ``hidden_act`` (absent: ``want``) is ``want``, the
    activation llama.cpp's graph of ``family`` gives its experts (the GGUF has no key for another one)."""
    label, names = _ACTS[want]
    act = cfg.get("hidden_act", want)
    if act not in names:
        raise PowerInferError(f"{source}: hidden_act {act!r}: {family}'s experts are {label}-gated "
                              f"(llama.cpp's {family} graph); no other activation is converted")


def expert_rules(layer: str, router: str, expert: str, kinds: dict[str, str]) -> tuple[TensorRule, ...]:
    """Rules for one layer's router and experts: ``layer`` the HF layer prefix regex (with ``bid``),
    ``router`` the router's name after it, ``expert`` the experts' prefix after it; ``kinds`` maps each
    checkpoint matrix name (``w1``, ``gate_proj``...) to its GGUF kind (``gate``, ``up``, ``down``)."""
    rules = [TensorRule(layer + router.replace(".", r"\.") + r"\.weight", "blk.{bid}.ffn_gate_inp.weight")]
    for hf, kind in kinds.items():
        rules.append(TensorRule(layer + expert.replace(".", r"\.") + r"\.(?P<xid>\d+)\." + hf + r"\.weight",
                                f"blk.{{bid}}.ffn_{kind}_exps.weight", "expert"))
    return tuple(rules)


def checkpoint_ffn(cfg: dict[str, Any], i: int, router: str, expert: str, kinds: dict[str, str],
                   n_ff_exp: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s router and expert matrices as the published checkpoint names them, with their
    torch shapes (gate/up ``[n_ff_exp, n_embd]``, down ``[n_embd, n_ff_exp]``)."""
    n, _ = expert_counts(cfg)
    d = cfg["hidden_size"]
    p = f"model.layers.{i}."
    out = {f"{p}{router}.weight": (n, d)}
    for x in range(n):
        for hf, kind in kinds.items():
            out[f"{p}{expert}.{x}.{hf}.weight"] = (d, n_ff_exp) if kind == "down" else (n_ff_exp, d)
    return out


def expert_kv(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``{arch}.expert_count`` and ``{arch}.expert_used_count``, as llama.cpp's converter writes them."""
    n, k = expert_counts(cfg)
    return {f"{arch}.expert_count": n, f"{arch}.expert_used_count": k}

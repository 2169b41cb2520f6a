"""``pi-profile`` on a mixture-of-experts GGUF: how often each layer's router picks each expert.

The file runs through this project's runtime (:func:`~powerinfer.runtime.loading.load_model`: Mixtral,
Qwen3-MoE, SmallThinker), every product as ``pi-run`` computes it; the text is tokenized once (BOS first as
the file says), cut to ``max_tokens`` and run in chunks of ``n_ctx`` tokens, each from position 0 (as the
input-histogram profile runs). Each layer's :class:`~powerinfer.runtime.moe.ExpertsFFN` counts the tokens
routed to each expert (``expert_hits``), which are written as ``expert_counts.json``
(:mod:`powerinfer.formats.expert_counts`): what ``--ram-budget`` keeps resident by.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import PowerInferError

DEFAULT_CHUNK = 512  # tokens per chunk (as the input-histogram profile)


def count_routing(model, ids: list[int], n_ctx: int) -> torch.Tensor:
    """int64 ``[n_layer, n_expert]``: tokens of ``ids`` routed to each expert, run through ``model`` (a
    runtime Transformer with :class:`~powerinfer.runtime.moe.ExpertsFFN` layers) in chunks of ``n_ctx``."""
    for layer in model.layers:
        layer.ffn.reset_stats()
    with torch.inference_mode():
        for s in range(0, len(ids), n_ctx):
            model.forward(torch.tensor(ids[s:s + n_ctx], dtype=torch.long), 0)
    return torch.stack([layer.ffn.expert_hits.clone() for layer in model.layers])


def profile_experts(gguf_path: str | Path, data: str | Path, out_dir: str | Path, *, n_ctx: int = DEFAULT_CHUNK,
                    max_tokens: int = 16384, text_field: str = "text") -> tuple[torch.Tensor, int]:
    """Count the routing of the mixture-of-experts GGUF ``gguf_path`` over ``data`` and write
    ``out_dir/expert_counts.json``. Returns ``(counts [n_layer, n_expert], tokens)``. PowerInferError
    for a file that is not a mixture of experts or a text of fewer than 2 tokens."""
    from ..formats.expert_counts import save_expert_counts
    from ..formats.gguf_file import open_gguf
    from ..runtime.loading import load_model
    from ..runtime.moe import is_moe
    from .inputs import calibration_text

    g = open_gguf(str(gguf_path))
    if not is_moe(g):
        raise PowerInferError(f"{gguf_path}: not a mixture-of-experts file")
    model, tok = load_model(str(gguf_path), "f32", n_ctx=n_ctx, g=g)
    ids = tok.encode(calibration_text(data, text_field))[:max_tokens]
    if len(ids) < 2:
        raise PowerInferError(f"{data}: {len(ids)} tokens of calibration text; give at least 2")
    counts = count_routing(model, ids, model.n_ctx)
    save_expert_counts(out_dir, counts, model.layers[0].ffn.ea.n_used, len(ids), str(gguf_path))
    return counts, len(ids)


def routing_table(counts: torch.Tensor) -> str:
    """Per layer: the share of routings the hottest expert and the hottest 10% of experts take, unused experts."""
    from .cli import format_table

    rows = []
    for i, c in enumerate(counts):
        tot = max(1, int(c.sum()))
        s = c.sort(descending=True).values
        top = max(1, len(c) // 10)
        rows.append((i, float(s[0]) / tot, float(s[:top].sum()) / tot, int((c == 0).sum())))
    return format_table(("layer", "hottest", "top10%", "unused"), rows)

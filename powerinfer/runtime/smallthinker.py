"""SmallThinker GGUFs (arch ``smallthinker``): a pre-attention router, NoPE and sliding-window layers.

What differs from the other mixture-of-experts files (:mod:`.moe`), as llama.cpp's
``src/models/smallthinker.cpp`` computes it:

* each layer's router reads the layer's input ``x`` (before ``attn_norm``), the experts the FFN
  norm's output; :meth:`SmallThinkerTransformer.block` hands ``x`` to the layer's
  :class:`~.moe.ExpertsFFN` (``router_in``);
* with ``smallthinker.attention.sliding_window`` in the file, layers ``0, 4, 8, ...`` attend to the whole
  context without RoPE (NoPE) and the others within the window, with RoPE; without it every layer is
  full attention with RoPE (:func:`layer_rules`). llama.cpp uses a window of 4096 whatever the key says
  (published SmallThinker configs say 4096); we use the key's value. A
  ``smallthinker.attention.sliding_window_pattern`` key (another period, or per-layer flags) is refused.

Several sequences at once (``-np`` > 1) are refused (:func:`~.batch.check_batchable`): the batched
step has no per-layer RoPE and window, nor the pre-attention router.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import PowerInferError
from ..families.smallthinker import NOPE_PERIOD
from ..formats.gguf_file import GGUFFile
from .args import ModelArgs
from .model import Layer, Transformer
from .moe import experts_builder


def layer_rules(g: GGUFFile, a: ModelArgs) -> list[tuple[bool, int | None]]:
    """Per layer ``(rope, window)``: whether RoPE applies and the sliding window (None: whole context)."""
    if f"{g.arch}.attention.sliding_window_pattern" in g.reader.fields:
        raise PowerInferError(f"{g.path}: {g.arch}.attention.sliding_window_pattern is not supported (llama.cpp's "
                              f"default period {NOPE_PERIOD} only)")
    if not a.sliding_window:
        return [(True, None)] * a.n_layer
    return [(True, a.sliding_window) if i % NOPE_PERIOD else (False, None) for i in range(a.n_layer)]


class SmallThinkerTransformer(Transformer):
    """:class:`Transformer` of a ``smallthinker`` file (arguments as the base class's; ``ffn_builder``: another
    expert FFN builder, ``--ram-budget``'s)."""

    per_layer_attention = True  # batch.check_batchable refuses several sequences at once

    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.float32, dense: bool = False,
                 n_ctx: int | None = None, cache_type_k=None, cache_type_v=None, ffn_builder=None):
        a = ModelArgs.from_gguf(g)
        self.rules = layer_rules(g, a)
        builder = experts_builder(g, a, pre_attention=True, sparse=not dense)  # counts and shapes checked before any load
        super().__init__(g, dtype, dense, n_ctx, ffn_builder=ffn_builder or builder, cache_type_k=cache_type_k,
                         cache_type_v=cache_type_v)
        self._layer_args = [dataclasses.replace(self.args, sliding_window=w) for _, w in self.rules]

    def block(self, i: int, layer: Layer, x: torch.Tensor, pos: int) -> torch.Tensor:
        layer.ffn.router_in = x  # the router reads the layer input
        early = getattr(layer.ffn, "route_early", None)
        if early is not None:  # --ram-budget (expert_residency.py): route now, read cold experts during attention
            early(x)
        return super().block(i, layer, x, pos)

    def attention(self, i: int, layer: Layer, x: torch.Tensor, pos: int) -> torch.Tensor:
        saved = self.rope, self.args
        self.rope = saved[0] if self.rules[i][0] else None
        self.args = self._layer_args[i]
        try:
            return super().attention(i, layer, x, pos)
        finally:
            self.rope, self.args = saved

"""Pieces of the calibration pass shared by profiling and predictor training.

* :class:`ActiveNeuronHooks` hooks decoder layers' gate/up projections (paths from the
  :class:`~powerinfer.families.Family`) and hands each layer's boolean active mask,
  ``family.active_mask(act, gate_out, up_out)``, to a callback as soon as the layer has run;
* :func:`torch_threads` picks the CPU thread count for the work's size;
* :func:`require_sparse` refuses dense (SiLU/GELU) models with the reason.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import PowerInferError
from ..families import Activation, Family, get_attr, model_layers

__all__ = ["ActiveNeuronHooks", "torch_threads", "require_sparse", "SMALL_MATMUL_MACS"]

MaskCallback = Callable[[int, torch.Tensor], None]
SMALL_MATMUL_MACS = 1 << 28


@contextlib.contextmanager
def torch_threads(threads: int | None, largest_matmul_macs: float) -> Iterator[int]:
    """Run the block with ``threads`` torch CPU threads (restored afterwards).

    ``threads=None`` picks: 1 thread when the largest matrix product of the work is under
    ``SMALL_MATMUL_MACS`` multiply-adds (2^28; e.g. the 260K-parameter demo model), where
    starting and synchronising threads costs more than it saves -- several times more on
    a busy machine -- and torch's default otherwise. Yields the thread count used.
    """
    before = torch.get_num_threads()
    n = threads if threads is not None else (1 if largest_matmul_macs < SMALL_MATMUL_MACS else before)
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


class ActiveNeuronHooks:
    """Forward hooks that report each layer's FFN active mask while the model runs.

    For every decoder layer ``i`` (``family.layers_attr``) the hooks capture the outputs of
    ``family.gate_attr`` (if the family has a gate) and ``family.up_attr`` -- the
    pre-activations ``[B, T, n_ff]`` -- and, once both are in, call
    ``on_mask(i, mask)`` with ``mask = family.active_mask(act, gate, up)`` flattened to
    bool ``[N, n_ff]``, one row per real token (rows are in ``[B, T]`` row-major order).

    Set :attr:`token_mask` (bool ``[B, T]``, True = real token) before a forward pass of
    a padded batch to drop padding rows; None (default) keeps every position.

    ``layers``: hook only these decoder layers (layer number -> module) instead of all of
    ``model``'s; ``model`` may then be None (the layer-streamed pass hooks one layer at a time).

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, model: torch.nn.Module | None, family: Family, act: Activation, on_mask: MaskCallback,
                 layers: Mapping[int, torch.nn.Module] | None = None):
        self.family, self.act, self.on_mask = family, act, on_mask
        self.token_mask: torch.Tensor | None = None
        if layers is None:
            if model is None:
                raise ValueError("need a model or layers")
            layers = dict(enumerate(model_layers(family, model)))
        self.layers = dict(layers)
        self._handles: list[Any] = []
        self._pending: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self.layers}

    def __enter__(self) -> "ActiveNeuronHooks":
        fam = self.family
        for i, layer in self.layers.items():
            names = ["up"] + (["gate"] if fam.gated else [])
            for name in names:
                attr = fam.gate_attr if name == "gate" else fam.up_attr
                try:
                    module = get_attr(layer, attr)
                except AttributeError:
                    self.__exit__(None, None, None)
                    raise PowerInferError(f"layer {i} has no module {attr!r} (family {fam.name})") from None
                self._handles.append(module.register_forward_hook(self._hook(i, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = {i: {} for i in self.layers}

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` -> ``[N, D]``: the rows of real tokens (all rows if no token_mask)."""
        if self.token_mask is None:
            return t.reshape(-1, t.shape[-1])
        return t[self.token_mask.to(device=t.device, dtype=torch.bool)]

    def _hook(self, i: int, name: str):
        need = 2 if self.family.gated else 1

        def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            pending = self._pending[i]
            pending[name] = output.detach()
            if len(pending) == need:
                mask = self.family.active_mask(self.act, pending.get("gate"), pending["up"])
                self._pending[i] = {}
                self.on_mask(i, self.rows(mask))

        return hook


def require_sparse(act: Activation, model_dir: str | Path, what: str) -> None:
    """Raise PowerInferError unless ``act`` is a ReLU-family (sparse) activation."""
    if not act.is_sparse:
        raise PowerInferError(
            f"{Path(model_dir) / 'config.json'}: activation {act.kind!r} is dense (every neuron fires for "
            f"every token), so {what} needs a ReLU-family model (hidden_act relu or fatrelu){act.note}")

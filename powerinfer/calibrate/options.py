"""Command-line options shared by the calibration stages (``pi-profile``, ``pi-train-predictor``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

__all__ = ["calibration_options"]


def calibration_options(*batch_names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--device``, ``--dtype``, ``--threads``, ``--work-dir`` and the forward batch size
    (option names ``batch_names``, parameter ``forward_batch``) to a click command."""
    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        options = [
            click.option("--device", default="cpu", show_default=True,
                         help="cpu, cuda (under torchrun: each process's own GPU) or cuda:N. The model is "
                              "streamed one decoder layer at a time, so a 24 GB GPU calibrates a 70B model."),
            click.option("--dtype", type=click.Choice(["f32", "bf16", "f16"]), default=None,
                         help="Compute dtype of the calibration pass [default: bf16 on a GPU or a CPU with bf16 instructions, "
                              "else f32]."),
            click.option("--threads", default=None, type=click.IntRange(min=1),
                         help="CPU threads for torch [default: 1 for tiny models, else torch's choice]."),
            click.option(*batch_names, "forward_batch", default=16, show_default=True, type=click.IntRange(min=1),
                         help="Calibration sequences per layer forward (more keeps a GPU busy; memory grows "
                              "with it)."),
            click.option("--work-dir", default=None, type=click.Path(path_type=Path),
                         help="Resumable state (hidden states between layers, per-layer results) "
                              "[default: OUT-work]. A killed run restarts at the layer it was in."),
        ]
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return add

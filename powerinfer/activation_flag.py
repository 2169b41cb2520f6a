"""``--ffn-activation``: the option every offline stage takes for configs that name no activation.

ReluFalcon-40B as published has a legacy ``RWForCausalLM`` config without an ``activation``
key; its ReLU lives in its own ``modelling_RW.py``. ``pi-profile``, ``pi-train-predictor`` and
``pi-convert`` read that file as text when it is there; ``--ffn-activation relu`` states it
when it is not (:mod:`powerinfer.families.activation_source` holds the rules). Kept apart from
``families`` so that a CLI's ``--help`` does not import torch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import click

__all__ = ["ffn_activation_option"]

CHOICES = ("relu",)  # = families.activation_source.ACTIVATION_CHOICES (checked by a test)


def ffn_activation_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--ffn-activation`` to a click command; the command then runs under
    :func:`powerinfer.families.ffn_activation_override` with the chosen value (or none)."""
    @functools.wraps(fn)
    def run(*args: Any, ffn_activation: str | None = None, **kwargs: Any) -> Any:
        if ffn_activation is None:
            return fn(*args, **kwargs)
        from .families.activation_source import ffn_activation_override

        with ffn_activation_override(ffn_activation):
            return fn(*args, **kwargs)

    return click.option(
        "--ffn-activation", type=click.Choice(CHOICES), default=None,
        help="The FFN activation of a model whose config.json names none (ReluFalcon-40B's legacy RW config): "
             "relu. Without it the model's modelling_*.py is read as text (never run) to find it, else the "
             "family default applies (GELU for Falcon, which is dense). Recorded in the outputs.")(run)

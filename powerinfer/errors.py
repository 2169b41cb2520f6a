"""One exception type for bad input; the CLIs turn it into a one-line message and exit 1."""
from __future__ import annotations

import functools
from typing import Any, Callable


class PowerInferError(Exception):
    """Bad input or an unusable file. The message names the path and what is wrong."""


def cli_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a click command: PowerInferError becomes ``Error: <message>``, exit code 1."""
    import click

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PowerInferError as e:
            raise click.ClickException(str(e)) from None

    return wrapper

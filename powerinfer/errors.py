"""One exception type for bad input; the CLIs turn it into a one-line message and exit 1."""
from __future__ import annotations

import functools
from typing import Any, Callable


class PowerInferError(Exception):
    """Bad input or an unusable file. The message names the path and what is wrong."""


def cli_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a click command: PowerInferError becomes ``Error: <message>``, exit code 1; so does an
    OSError from the file system (``Error: <path>: <reason>``), e.g. a read-only or full disk."""
    import click

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PowerInferError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # read-only or full disk, a file where a folder should be, ...
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None

    return wrapper

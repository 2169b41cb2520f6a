"""One exception type for bad input; the CLIs turn it into a one-line message and exit 1."""
from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator


class PowerInferError(Exception):
    """Bad input or an unusable file. The message names the path and what is wrong."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is (see :func:`sigterm_as_interrupt`). A loop that treats
    Ctrl-C as "stop this reply" (an interactive chat) should re-raise this one."""


def _sigterm(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated`, a KeyboardInterrupt, as Ctrl-C does, so ``finally`` blocks (the
    temporary-file cleanup of :mod:`powerinfer.formats._atomic`) run before the process exits.
    A no-op outside the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a click command: PowerInferError becomes ``Error: <message>``, exit code 1; so does an
    OSError from the file system (``Error: <path>: <reason>``), e.g. a read-only or full disk. SIGTERM
    is handled like Ctrl-C (click prints ``Aborted!``, exit code 1) after temporary files are removed."""
    import click

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with sigterm_as_interrupt():
                return fn(*args, **kwargs)
        except PowerInferError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # read-only or full disk, a file where a folder should be, ...
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None

    return wrapper

"""Click parameter types shared by every command-line tool.

``float`` and ``click.FloatRange`` accept ``nan``, ``inf`` and ``1e300``: NaN passes every
range comparison and an infinite or huge value overflows later (``int(inf)``, ``struct.pack``).
:class:`FiniteFloat` refuses them when the command line is parsed, before any file is read or
written.

Every ``pi-*`` command is a :class:`PiCommand`: a wrong command line (a value click's types
refuse, an unknown or missing option) gets the one-line form that the checks below and
:class:`~powerinfer.errors.PowerInferError` give, ``Error: OPTION VALUE: what is wrong``, and exit
code 1 (as llama.cpp's tools print one line and exit 1), instead of click's usage block and exit 2.

The checks here import nothing heavy (no torch, transformers or numpy), so a command refuses a
wrong value or a missing input in a fraction of a second, before it imports what it runs on:
:func:`check_threads`, :func:`check_ctx_size`, :func:`require_file`, :func:`require_folder`, and
:func:`version_option`, the ``--version`` every ``pi-*`` command has, and :func:`cache_type_options`
(llama.cpp's ``-ctk``/``-ctv``) with :func:`check_cache_type`. Missing inputs have one
wording everywhere: ``PATH: file not found`` / ``PATH: <what> folder not found``.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import click

from .errors import PowerInferError

__all__ = ["PiCommand", "FiniteFloat", "check_threads", "check_ctx_size", "require_file", "require_folder",
           "require_model_folder", "require_gguf", "require_data", "version_option", "plural", "rate",
           "KV_CACHE_TYPES", "DEFAULT_KV_CACHE_TYPE", "check_cache_type", "cache_type_options"]

# KV cache types (runtime/kv_cache.py): llama.cpp's names; its default is f16 whatever the compute type
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
DEFAULT_KV_CACHE_TYPE = "f16"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 token``, ``2 tokens`` (``many``: the plural when it is not ``word + 's'``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def rate(n: int, seconds: float, unit: str = "tokens/s") -> str:
    """`` (12.3 tokens/s)``, or nothing when there is no rate to give (no tokens or no time):
    never a NaN or an infinity in a report."""
    return f" ({n / seconds:.1f} {unit})" if n > 0 and seconds > 0 else ""


class PiCommand(click.Command):
    """A click command whose usage errors are one line and exit code 1 (see the module docstring):
    ``Error: --port 70000: not in the range 0<=x<=65535``; ``-h`` tells the options."""

    def make_context(self, info_name, args, parent=None, **extra):
        raw = list(args)  # click's parser consumes the list it is given
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise click.ClickException(usage_line(e, raw)) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # raised by a command's own checks (two options that exclude each other)
            raise click.ClickException(usage_line(e, [])) from None


def usage_line(e: click.UsageError, args: list[str]) -> str:
    """One line for a click usage error: ``OPTION VALUE: reason`` for a refused value (the value as
    typed, found in ``args``), click's own sentence otherwise."""
    if not isinstance(e, click.BadParameter) or isinstance(e, click.MissingParameter) or e.param is None:
        return e.format_message()
    param = e.param
    if not isinstance(param, click.Option):
        return f"{(param.human_readable_name or '').upper()}: {e.message}"
    flag, value = param.opts[0], None
    opts = [*param.opts, *param.secondary_opts]
    for i, a in enumerate(args):
        if a in opts and i + 1 < len(args):
            flag, value = a, args[i + 1]
        elif a.startswith("--") and "=" in a and a.split("=", 1)[0] in opts:
            flag, value = a.split("=", 1)
    reason = e.message.rstrip(".")
    if value is not None:
        for lead in (f"{value!r} is ", f"{value} is "):
            if reason.startswith(lead):
                reason = _range_words(reason[len(lead):])
                break
        return f"{flag} {value}: {reason}"
    return f"{flag}: {reason}"


def _range_words(reason: str) -> str:
    """click's ``not in the range 1<=x<=256`` (or ``x>=1``) and FiniteFloat's ``not in the range
    [0, 8]`` as the checks here word it: ``must be in [1, 256]``, ``must be >= 1``."""
    m = re.fullmatch(r"not in the range (\S+?)(<=|<)x(<=|<)(\S+)", reason)
    if m:
        return f"must be in {'[' if m[2] == '<=' else '('}{m[1]}, {m[4]}{']' if m[3] == '<=' else ')'}"
    m = re.fullmatch(r"not in the range x(>=|>|<=|<)(\S+)", reason)
    if m:
        return f"must be {m[1]} {m[2]}"
    if reason.startswith("not in the range "):
        return "must be in " + reason[len("not in the range "):]
    return reason


def version_option(prog: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--version``: ``<prog> (powerinfer) <version>``, answered before anything is imported."""
    from . import __version__

    return click.version_option(__version__, "--version", prog_name=prog, message="%(prog)s (powerinfer) %(version)s")


def check_threads(threads: int) -> int:
    """``-t``: 0 (automatic) up to 4 x the CPU count; raises PowerInferError otherwise."""
    top = 4 * (os.cpu_count() or 1)
    if not 0 <= threads <= top:
        raise PowerInferError(f"-t {threads}: must be between 0 (automatic) and {top} (4 x the {os.cpu_count()} CPUs)")
    return threads


def check_ctx_size(ctx_size: int, zero: str = "the model's context length") -> int:
    """``-c``: >= 0 (0 means ``zero``); raises PowerInferError otherwise."""
    if ctx_size < 0:
        raise PowerInferError(f"-c {ctx_size}: must be >= 0 (0: {zero})")
    return ctx_size


def check_cache_type(name: str, flag: str = "--cache-type-k") -> str:
    """``-ctk``/``-ctv``: one of :data:`KV_CACHE_TYPES` (case as llama.cpp: lower); raises PowerInferError
    ``--cache-type-k q4_1: unsupported KV cache type (supported: f32, f16, bf16, q8_0)`` otherwise."""
    if name not in KV_CACHE_TYPES:
        raise PowerInferError(f"{flag} {name}: unsupported KV cache type (supported: {', '.join(KV_CACHE_TYPES)})")
    return name


def cache_type_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``-ctk/--cache-type-k`` and ``-ctv/--cache-type-v`` (llama.cpp's flags; default f16), passed
    as ``cache_type_k``, ``cache_type_v``; check them with :func:`check_cache_type`."""
    types = ", ".join(KV_CACHE_TYPES)
    f = click.option("-ctv", "--cache-type-v", "cache_type_v", default=DEFAULT_KV_CACHE_TYPE, show_default=True,
                     help=f"KV cache type of the values ({types}).")(f)
    return click.option("-ctk", "--cache-type-k", "cache_type_k", default=DEFAULT_KV_CACHE_TYPE, show_default=True,
                        help=f"KV cache type of the keys ({types}).")(f)


def require_file(path: str | Path, flag: str | None = None) -> Path:
    """``path`` unless it is missing (PowerInferError ``[FLAG ]PATH: file not found``) or a folder
    (``not a file``); what else a reader refuses (a FIFO, a device) is left to the reader."""
    p = Path(path)
    if not p.exists() or p.is_dir():
        where = f"{flag} {path}" if flag else f"{path}"
        raise PowerInferError(f"{where}: {'not a file' if p.exists() else 'file not found'}")
    return p


def require_folder(path: str | Path, what: str, recover: bool = True) -> Path:
    """``path`` when it is an existing folder (with ``recover``, after finishing or undoing a folder
    swap a killed writer left half done, as the folder loaders do); PowerInferError
    ``PATH: <what> folder not found`` (or ``not a folder``) otherwise."""
    p = Path(path)
    if not p.is_dir() and recover:
        from .formats._atomic import recover as finish_swap

        finish_swap(p)
    if not p.is_dir():
        raise PowerInferError(f"{path}: {'not a folder' if p.exists() else f'{what} folder not found'}")
    return p


def require_model_folder(path: str | Path) -> Path:
    """A Hugging Face model folder argument: PowerInferError ``PATH: model folder not found``,
    ``PATH: not a folder (expected a Hugging Face model folder)`` or ``PATH: no config.json, so
    this is not a Hugging Face model folder`` (the loader's wording), before anything heavy is
    imported."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PowerInferError(f"{path}: not a folder (expected a Hugging Face model folder)")
    require_folder(p, "model", recover=False)
    if not (p / "config.json").is_file():
        raise PowerInferError(f"{path}: no config.json, so this is not a Hugging Face model folder")
    return p


def require_gguf(path: str | Path) -> Path:
    """A GGUF model argument: :func:`require_file`, then its header checked
    (:func:`powerinfer.formats.gguf_file.check_gguf`: magic, bounds, metadata; numpy and gguf, no
    torch), so a text file named ``.gguf`` is refused in a fraction of a second."""
    p = require_file(path)
    from .formats.gguf_file import check_gguf

    check_gguf(p)
    return p


def require_data(data: str) -> None:
    """``--data`` of the calibration stages: ``hf:NAME`` is looked up later; a path must exist
    (PowerInferError ``PATH: data file not found``, the wording of :mod:`powerinfer.data`)."""
    if data.startswith("hf:"):
        return
    path = Path(data).expanduser()
    if not path.exists():
        raise PowerInferError(f"{path}: data file not found")


class FiniteFloat(click.ParamType):
    """A finite float inside ``[lo, hi]`` (ends excluded with ``lo_open`` / ``hi_open``).

    ``-0.0`` is read as ``0.0``. ``lo``/``hi`` None means no bound on that side, but the value
    must still be finite. Example: ``FiniteFloat(0, 1, lo_open=True)`` for a share in (0, 1].
    """

    name = "float"

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open

    def _range(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"

        left = "-inf" if self.lo is None else num(self.lo)
        right = "inf" if self.hi is None else num(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{left}, {right}{')' if self.hi_open or self.hi is None else ']'}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a number", param, ctx)
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        v = v + 0.0  # -0.0 -> 0.0
        below = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        above = self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)
        if below or above:
            self.fail(f"{value} is not in the range {self._range()}", param, ctx)
        return v

    def __repr__(self) -> str:
        return f"FiniteFloat{self._range()}"

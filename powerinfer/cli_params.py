"""Click parameter types shared by every command-line tool.

``float`` and ``click.FloatRange`` accept ``nan``, ``inf`` and ``1e300``: NaN passes every
range comparison and an infinite or huge value overflows later (``int(inf)``, ``struct.pack``).
:class:`FiniteFloat` refuses them when the command line is parsed, with click's usual
"Invalid value for '--opt'" message and exit code 2, before any file is read or written.
"""
from __future__ import annotations

import math
from typing import Any

import click

__all__ = ["FiniteFloat"]


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

"""Progress for long steps: a tqdm bar on a terminal, plain lines in a log.

tqdm redraws its bar with ``\\r`` frames, which fill a log file (~35 KB for one
conversion) when stderr is not a terminal. :func:`progress` gives a tqdm bar when stderr
is a terminal, and otherwise writes one line to stderr each time another tenth of the
total is done (and at the end), e.g. ``writing m.gguf: 29/58 tensor (50%)``.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator

__all__ = ["progress", "LineProgress"]


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` / iteration, as lines on stderr per ``step`` share."""

    def __init__(self, iterable: Iterable[Any] | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, step: float = 0.1, **_: Any):
        self.iterable, self.desc, self.unit, self.n = iterable, desc, unit, initial
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.parts = total, max(1, round(1 / step))
        self.postfix = ""
        self._part = self._part_of(initial)
        self._closed = False
        self._printed: int | None = None

    def _part_of(self, n: int) -> int:
        """How many whole ``step`` shares of the total ``n`` is (0 without a total)."""
        return n * self.parts // self.total if self.total else 0

    def _line(self) -> None:
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        of = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"{self.desc}: {self.n}{of} {self.unit}{pct}{self.postfix}\n")
        sys.stderr.flush()
        self._printed = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        part = self._part_of(self.n)
        if part > self._part:
            self._part = part
            if self.n < self.total:  # the last line comes from close()
                self._line()

    def set_postfix(self, **kw: Any) -> None:
        self.postfix = "".join(f", {k} {v}" for k, v in kw.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if (self.n or self.total) and self._printed != self.n:
                self._line()

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        try:
            for x in self.iterable:
                yield x
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A tqdm bar over ``iterable`` (or with ``total=``) when stderr is a terminal, else a
    :class:`LineProgress` with the same arguments (``desc``, ``unit``, ``total``, ``initial``)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, **kwargs)
    return LineProgress(iterable, **kwargs)

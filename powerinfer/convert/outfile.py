"""Which existing file ``pi-convert --outfile`` / ``pi-quantize OUT`` may replace.

Only an earlier output: a regular file that starts with the ``GGUF`` or ``PWRI`` magic and is
not one of the inputs. Anything else at that path -- a model's ``model.safetensors``, a
predictor's ``model_0.pt``, a text file, a FIFO -- is the user's, and is never replaced.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from ..errors import PowerInferError
from ..formats.gguf_file import GGUF_BYTES, PWRI_BYTES, read_magic

__all__ = ["check_outfile"]


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_outfile(outfile: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse (PowerInferError naming ``outfile``) an output path that would replace an input or
    a file that is not a GGUF.

    ``inputs``: input files and folders; ``outfile`` may not be one of them nor a file inside
    one of the folders unless it is a GGUF (an earlier output written there).
    """
    out = Path(outfile)
    inputs = [Path(d) for d in inputs if d is not None]
    if not os.path.lexists(out):
        return
    if out.is_dir():
        raise PowerInferError(f"{out}: is a folder; give a file name to write")
    if not out.is_file():
        raise PowerInferError(f"{out}: exists and is not a regular file; refusing to replace it")
    for inp in inputs:
        if _same(out, inp):
            raise PowerInferError(f"{out}: is an input file; write the output somewhere else")
    try:
        magic = read_magic(out)
    except OSError as e:
        raise PowerInferError(f"{out}: exists and cannot be read ({e.strerror or e}); refusing to replace it") from None
    if magic not in (GGUF_BYTES, PWRI_BYTES):
        where = next((d for d in inputs if d.is_dir() and _same(out.resolve().parent, d)), None)
        what = f"an input file of {where}" if where is not None else "not a GGUF file"
        raise PowerInferError(f"{out}: exists and is {what}; refusing to replace it (write the GGUF "
                              "somewhere else, or remove the file first)")

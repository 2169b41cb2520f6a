"""Write a file or folder so that readers never see a partial result.

A file is written to a temporary sibling and renamed over the target. A folder is
filled in a temporary sibling folder, then swapped in: an earlier folder at the
target survives until the new one is complete. A folder is only ever replaced
when everything in it is ours (names matching ``owned``), so pointing ``--out`` at
a model folder or a folder of the user's files is refused instead of deleting it.
Results get the usual permissions (0666/0777 less the umask), not mkstemp's 0600.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import PowerInferError


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary file path next to ``target``; rename it to ``target`` on success.

    Raises PowerInferError if ``target`` is an existing folder.
    """
    target = Path(target)
    if target.is_dir():
        raise PowerInferError(f"{target}: is a folder; give a file name to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def check_replaceable(target: Path, owned: str) -> None:
    """Refuse to replace ``target`` unless it is absent, empty, or holds only names matching ``owned``."""
    if not target.exists():
        return
    if not target.is_dir():
        raise PowerInferError(f"{target}: exists and is not a folder; refusing to replace it")
    foreign = sorted(p.name for p in target.iterdir() if not re.fullmatch(owned, p.name))
    if foreign:
        raise PowerInferError(f"{target}: holds other files ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                              "refusing to replace it -- choose an empty or new folder")


@contextlib.contextmanager
def atomic_dir(target: str | Path, owned: str = r"") -> Iterator[Path]:
    """Yield an empty temporary folder next to ``target``; swap it in on success.

    ``owned``: regex of the file names this writer produces; an existing ``target``
    holding anything else is refused (PowerInferError) before any work is done.
    """
    target = Path(target)
    check_replaceable(target, owned)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        check_replaceable(target, owned)
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.rmdir(old)
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

"""Write a file or folder so that readers never see a partial result.

A file is written to a temporary sibling and renamed over the target. A folder is
filled in a temporary sibling folder, then swapped in: an earlier folder at the
target survives until the new one is complete. A folder is only ever replaced
when everything in it is ours (names matching ``owned``), so pointing ``--out`` at
a model folder or a folder of the user's files is refused instead of deleting it.
Results get the usual permissions (0666/0777 less the umask), not mkstemp's 0600.

Temporary names carry the writer's process id: ``.NAME.PID.XXXXXXXX.tmp`` (being written),
``.NAME.PID.new`` (a complete folder about to be swapped in) and ``.NAME.PID.old`` (the
folder it replaces). A run killed at any point (kill -9, power loss) leaves at most these;
the next writer of the same target (and a reader that finds the target missing,
:func:`recover`) removes those of dead processes and completes an interrupted folder swap:

* ``.new`` present: it is complete, so it becomes the target (the older target, if still
  there, is dropped);
* only ``.old`` present and no target: the swap had moved the old folder aside and the new
  one was not ready, so the old one is put back.

A write that fails for lack of space or permission (an ``OSError``, or torch's
``RuntimeError`` from ``torch.save``, which does not say which file) becomes a
PowerInferError naming the target.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import PowerInferError

__all__ = ["atomic_path", "atomic_dir", "check_replaceable", "recover", "save_torch", "write_text"]

_TORCH_WRITE_ERRORS = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")
_TEMP_NAME = re.compile(r"\.(.+)\.\d+\.(?:[a-z0-9_]{8}\.tmp|new|old)")  # .NAME.PID.*: group 1 is NAME
LEGACY_TMP_AGE = 24 * 3600  # seconds: a temporary file of a version without PIDs in its name is stale after this


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def recover(target: str | Path) -> None:
    """Clean what killed writers of ``target`` left beside it, and finish or undo an interrupted
    folder swap (module docstring). Leftovers of live processes are not touched."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return
    name = re.escape(target.name)
    pat = re.compile(rf"\.{name}\.(\d+)\.(?:[a-z0-9_]{{8}}\.(tmp)|(new)|(old))"  # ours
                     rf"|\.{name}\.[a-z0-9_]{{8}}\.(?:(tmp)|(old))")  # an earlier version's (no PID)
    leftovers: dict[str, list[Path]] = {"tmp": [], "new": [], "old": []}
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for p in entries:
        m = pat.fullmatch(p.name)
        if m is None:
            continue
        pid = m.group(1)
        kind = next(k for k in m.groups()[1:] if k)  # tmp, new or old
        if pid is not None and _alive(int(pid)):
            continue
        if pid is None:  # a name without a PID: an earlier version's; stale once old enough
            try:
                if time.time() - p.lstat().st_mtime < LEGACY_TMP_AGE:
                    continue
            except OSError:
                continue
        leftovers[kind].append(p)
    for p in leftovers["tmp"]:
        _remove(p)
    news = sorted(leftovers["new"], key=lambda p: p.stat().st_mtime)
    if news:  # a complete folder that a killed run was swapping in: finish the swap
        newest = news[-1]
        if target.exists():
            _remove(target)
        os.replace(newest, target)
        for p in news[:-1] + leftovers["old"]:
            _remove(p)
        return
    olds = sorted(leftovers["old"], key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():  # moved aside but never replaced: put it back
        os.replace(olds[-1], target)
        olds = olds[:-1]
    for p in olds:
        _remove(p)


def _write_error(e: BaseException, target: Path) -> PowerInferError | None:
    """A PowerInferError naming ``target`` for a failed write, or None for other errors."""
    if isinstance(e, OSError):
        where = e.filename if e.filename and str(e.filename) != str(target) else None
        reason = e.strerror or str(e)
        return PowerInferError(f"{target}: could not write it ({reason}{f': {where}' if where else ''})")
    if isinstance(e, RuntimeError) and any(k in str(e) for k in _TORCH_WRITE_ERRORS):
        return PowerInferError(f"{target}: could not write it (the write failed: is the disk full or "
                               f"read-only?)")
    return None


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[None]:
    try:
        yield
    except (OSError, RuntimeError) as e:
        err = _write_error(e, target)
        if err is None:
            raise
        raise err from None


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.{os.getpid()}."


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary file path next to ``target``; rename it to ``target`` on success.

    Raises PowerInferError if ``target`` is an existing folder, or naming ``target`` when the
    write fails (disk full, no permission). The temporary file is removed on any error,
    Ctrl-C and SIGTERM (:func:`powerinfer.errors.sigterm_as_interrupt`).
    """
    target = Path(target)
    if target.is_dir():
        raise PowerInferError(f"{target}: is a folder; give a file name to write")
    with _writing(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        recover(target)
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(target), suffix=".tmp", dir=target.parent)
        os.close(fd)
    tmp_path = Path(tmp)
    try:
        with _writing(target):
            yield tmp_path
            os.chmod(tmp_path, 0o666 & ~_umask())
            os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def save_torch(obj: Any, target: str | Path) -> None:
    """``torch.save(obj)`` to ``target`` atomically; a failed write names ``target`` (PowerInferError)."""
    import torch

    with atomic_path(target) as tmp:
        torch.save(obj, tmp)


def write_text(target: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``target`` atomically; a failed write names ``target`` (PowerInferError)."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_replaceable(target: Path, owned: str) -> None:
    """Refuse to replace ``target`` unless it is absent, empty, or holds only names matching ``owned``."""
    recover(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise PowerInferError(f"{target}: exists and is not a folder; refusing to replace it")
    for p in list(target.iterdir()):  # a killed writer of one of our files in it (report.png) left its temp file
        m = _TEMP_NAME.fullmatch(p.name)
        if m is not None and re.fullmatch(owned, m.group(1)):
            recover(target / m.group(1))  # removed if that writer is dead; a live one's stays foreign
    foreign = sorted(p.name for p in target.iterdir() if not re.fullmatch(owned, p.name))
    if foreign:
        raise PowerInferError(f"{target}: holds other files ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                              "refusing to replace it -- choose an empty or new folder")


@contextlib.contextmanager
def atomic_dir(target: str | Path, owned: str = r"") -> Iterator[Path]:
    """Yield an empty temporary folder next to ``target``; swap it in on success.

    ``owned``: regex of the file names this writer produces; an existing ``target``
    holding anything else is refused (PowerInferError) before any work is done. A failed
    write (disk full, no permission) raises PowerInferError naming ``target``; the
    temporary folder is removed on any error, Ctrl-C and SIGTERM. See the module docstring
    for the swap and how the next run completes one that was killed.
    """
    target = Path(target)
    check_replaceable(target, owned)
    with _writing(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target), suffix=".tmp", dir=target.parent))
    base = target.parent / f".{target.name}.{os.getpid()}"
    new, old = base.with_name(base.name + ".new"), base.with_name(base.name + ".old")
    try:
        with _writing(target):
            yield tmp
            os.chmod(tmp, 0o777 & ~_umask())
            check_replaceable(target, owned)
            os.replace(tmp, new)  # complete: from here on a killed run is finished by the next one
            if target.exists():
                os.replace(target, old)
            os.replace(new, target)
            if old.exists():
                shutil.rmtree(old, ignore_errors=True)
    finally:  # an error or Ctrl-C/SIGTERM inside the swap: the earlier folder stays the target
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
        if old.exists() and not target.exists():
            os.replace(old, target)

"""Read a small JSON file that must hold an object (configs, stats, metadata) as bad input allows."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PowerInferError

MAX_JSON_BYTES = 64 << 20


def read_json_object(p: str | Path, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in file ``p``.

    Raises PowerInferError naming ``p`` when it is not a regular file, is larger than
    ``max_bytes``, is not UTF-8, not valid JSON (or nested too deep), or holds anything but
    an object.
    """
    p = Path(p)
    try:
        if not p.is_file():
            raise PowerInferError(f"{p}: not a regular file")
        if p.stat().st_size > max_bytes:
            raise PowerInferError(f"{p}: {p.stat().st_size} bytes, more than the {max_bytes} a JSON file here may hold")
        raw = p.read_bytes()
    except OSError as e:
        raise PowerInferError(f"{p}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PowerInferError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise PowerInferError(f"{p}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise PowerInferError(f"{p}: expected a JSON object, found a {type(data).__name__}")
    return data

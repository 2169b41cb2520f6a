"""Routing frequency of a mixture-of-experts model in an activation folder: ``expert_counts.json``.

``pi-profile`` on a mixture-of-experts GGUF counts, per layer, how many calibration tokens the router
sent to each expert; ``--ram-budget`` keeps the most routed experts resident
(:mod:`powerinfer.runtime.expert_residency`). Folder contract (this project's, beside pi-profile's
``activation_{i}.pt`` and the input histograms, which it keeps; a reader that globs ``activation_*.pt``
is not disturbed): one JSON object

* ``format``: ``"powerinfer-expert-counts"``, ``version``: 1;
* ``n_layer``, ``n_expert`` (E), ``n_used`` (k, experts per token), ``n_tokens`` (calibration tokens);
* ``counts``: ``n_layer`` lists of ``E`` non-negative integers, layer ``i``'s ``counts[i][e]`` the tokens
  routed to expert ``e`` (each layer's sum is ``n_tokens * n_used``);
* ``source``: the model file profiled.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ..errors import PowerInferError
from ._atomic import atomic_dir
from ._json import read_json_object
from .activation import OWNED
from .input_hist import HIST_OWNED

COUNTS_FILE = "expert_counts.json"
FORMAT = "powerinfer-expert-counts"
VERSION = 1
COUNTS_OWNED = re.escape(COUNTS_FILE)


def save_expert_counts(folder: str | Path, counts: torch.Tensor, n_used: int, n_tokens: int, source: str) -> Path:
    """Write ``counts`` (int64 ``[n_layer, n_expert]``) into ``folder`` atomically; its neuron counts,
    stats, report and input histograms are kept, an older ``expert_counts.json`` replaced."""
    folder = Path(folder)
    keep = OWNED + "|" + HIST_OWNED
    with atomic_dir(folder, COUNTS_OWNED + "|" + keep) as tmp:
        if folder.is_dir():
            for p in folder.iterdir():
                if re.fullmatch(keep, p.name):
                    shutil.copy2(p, tmp / p.name)
        L, E = counts.shape
        (tmp / COUNTS_FILE).write_text(json.dumps({
            "format": FORMAT, "version": VERSION, "n_layer": int(L), "n_expert": int(E), "n_used": int(n_used),
            "n_tokens": int(n_tokens), "source": str(source), "counts": counts.tolist()}) + "\n")
    return folder


def load_expert_counts(folder: str | Path, n_layer: int, n_expert: int) -> torch.Tensor | None:
    """int64 ``[n_layer, n_expert]`` from ``folder``'s ``expert_counts.json``; None when the folder has none.
    PowerInferError naming the file when it is not this format or its shape is not the model's."""
    p = Path(folder) / COUNTS_FILE
    if not p.exists():
        return None
    m = read_json_object(p)
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise PowerInferError(f"{p}: not a {FORMAT} file of version {VERSION}")
    c = m.get("counts")
    if (m.get("n_layer"), m.get("n_expert")) != (n_layer, n_expert) or not isinstance(c, list) or len(c) != n_layer \
            or any(not isinstance(r, list) or len(r) != n_expert for r in c):
        raise PowerInferError(f"{p}: counts of {m.get('n_layer')} layers x {m.get('n_expert')} experts, the model has "
                              f"{n_layer} x {n_expert}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for r in c for v in r):
        raise PowerInferError(f"{p}: counts must be non-negative integers")
    return torch.tensor(c, dtype=torch.long)

"""Input-magnitude histograms in an activation folder: what input sparsity (TEAL, WINA) is calibrated from.

Per layer and per matrix input (:data:`~powerinfer.formats.teal.KINDS`: q/k/v, attn_output, gate/up,
down), the count of input entries per magnitude bin over every calibration token, in :data:`N_BINS`
log-spaced bins from :data:`LO` to :data:`HI` (the first bin also takes smaller values and zeros, the
last larger ones). The bin ratio ``(HI/LO)^(1/N_BINS)`` is about 1.0068, so the threshold for any
sparsity is read off to within 0.7% of its value (:func:`threshold_for`).

Folder contract (this project's, beside pi-profile's ``activation_{i}.pt`` counts, which it keeps):

* ``input_hist_{i}.pt``: int64 ``[4, N_BINS]``, rows in KINDS order, counts of ``|x_j|`` (TEAL's
  criterion); ``torch.save`` of a plain tensor (read with ``torch.load(weights_only=True)``);
* ``wina_hist_{i}.pt``: the same for ``|x_j| * ||W[:, j]||_2``, the input's magnitude times the norm of
  the column of the matrix that consumes it (WINA, arXiv 2505.19427; q/k/v and gate/up: the norm over
  the outputs of the matrices joined); optional (folders written before it have none);
* ``input_hist.json``: ``lo``, ``hi``, ``n_bins``, ``n_tokens``, ``kinds``, ``source`` (the model file or
  folder), ``wina`` (whether the ``wina_hist`` files are there).

Layers are found by number (:func:`~powerinfer.formats.activation.layer_files`), not by sorted names.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from ..errors import PowerInferError
from ._atomic import atomic_dir
from .activation import OWNED, layer_files, torch_load
from .teal import KINDS

LO, HI, N_BINS = 1e-6, 1e3, 3072
HIST_FILE = "input_hist_{i}.pt"
WINA_FILE = "wina_hist_{i}.pt"
HIST_META = "input_hist.json"
HIST_OWNED = r"input_hist_\d+\.pt|wina_hist_\d+\.pt|input_hist\.json"
CRITERIA = {"abs": (HIST_FILE, r"input_hist_(\d+)\.pt"), "wina": (WINA_FILE, r"wina_hist_(\d+)\.pt")}


def new_hist(n_layer: int) -> torch.Tensor:
    """Zero counts int64 ``[n_layer, 4, N_BINS]``."""
    return torch.zeros(n_layer, len(KINDS), N_BINS, dtype=torch.int64)


def log_edges() -> torch.Tensor:
    """The ``N_BINS + 1`` bin edges (float64) of the magnitude."""
    return torch.logspace(math.log10(LO), math.log10(HI), N_BINS + 1, dtype=torch.float64)


def add_values(hist: torch.Tensor, x: torch.Tensor) -> None:
    """Count every entry of ``|x|`` (any shape, any float dtype) into ``hist`` int64 ``[N_BINS]`` (in place)."""
    v = torch.log10(x.detach().float().abs().clamp_min(LO)).clamp_max(math.log10(HI) - 1e-9).view(-1)
    b = ((v - math.log10(LO)) / (math.log10(HI) - math.log10(LO)) * N_BINS).long().clamp_(0, N_BINS - 1)
    hist += torch.bincount(b, minlength=N_BINS)


def threshold_for(hist: torch.Tensor, s: float) -> float:
    """The magnitude below which a share ``s`` of the histogram's values lie (a bin edge, log-spaced); 0
    for ``s`` 0 or an empty histogram. ``hist``: int64 ``[N_BINS]``."""
    if s <= 0:
        return 0.0
    c = torch.cumsum(hist.double(), 0)
    total = float(c[-1])
    if total == 0:
        return 0.0
    k = int(torch.searchsorted(c, torch.tensor(s * total, dtype=torch.float64)))  # first bin reaching s
    return float(log_edges()[min(k + 1, N_BINS)])


def save_hist(folder: str | Path, hist: torch.Tensor, n_tokens: int, source: str,
              wina: torch.Tensor | None = None) -> Path:
    """Write ``hist`` (and ``wina``), int64 ``[n_layer, 4, N_BINS]``, into ``folder`` atomically; an
    activation folder's other files (pi-profile's counts, stats, report) are kept, old histograms replaced."""
    folder = Path(folder)
    with atomic_dir(folder, HIST_OWNED + "|" + OWNED) as tmp:
        if folder.is_dir():
            for p in folder.iterdir():
                if re.fullmatch(OWNED, p.name):
                    shutil.copy2(p, tmp / p.name)
        for i in range(hist.shape[0]):
            torch.save(hist[i].clone(), tmp / HIST_FILE.format(i=i))
            if wina is not None:
                torch.save(wina[i].clone(), tmp / WINA_FILE.format(i=i))
        (tmp / HIST_META).write_text(json.dumps({"lo": LO, "hi": HI, "n_bins": N_BINS, "n_tokens": int(n_tokens),
                                                 "kinds": list(KINDS), "source": str(source),
                                                 "wina": wina is not None}, indent=1) + "\n")
    return folder


def load_hist(folder: str | Path, n_layer: int, criterion: str = "abs") -> torch.Tensor:
    """int64 ``[n_layer, 4, N_BINS]`` of ``criterion`` (``abs``: ``|x|``; ``wina``: ``|x| * column norm``)
    from an activation folder; PowerInferError naming the folder and what is wrong."""
    folder = Path(folder)
    meta = folder / HIST_META
    if not meta.is_file():
        raise PowerInferError(f"{folder}: no {HIST_META} (write the histograms with pi-profile MODEL --data TEXT "
                              f"--out {folder}, or pi-sparsify --data TEXT --activation {folder})")
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise PowerInferError(f"{meta}: not readable JSON ({e})") from None
    if not isinstance(m, dict) or (m.get("lo"), m.get("hi"), m.get("n_bins")) != (LO, HI, N_BINS):
        got = (m.get("lo"), m.get("hi"), m.get("n_bins")) if isinstance(m, dict) else m
        raise PowerInferError(f"{meta}: histogram bins {got} are not this version's ({LO}, {HI}, {N_BINS})")
    template, pattern = CRITERIA[criterion]
    if criterion == "wina" and not m.get("wina"):
        raise PowerInferError(f"{folder}: no WINA histograms (wina_hist_{{i}}.pt); recalibrate with this version "
                              "(pi-profile or --data) for --method wina")
    files = layer_files(folder, re.compile(pattern), "activation")
    if sorted(files) != list(range(n_layer)):
        raise PowerInferError(f"{folder}: {template.split('_{')[0]} files for layers {sorted(files)[:8]}, "
                              f"the model has {n_layer}")
    out = []
    for i in range(n_layer):
        h = torch_load(files[i])  # PowerInferError naming the file when it is not a readable tensor file
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != (len(KINDS), N_BINS) or h.is_floating_point() \
                or (h < 0).any():
            raise PowerInferError(f"{files[i]}: expected non-negative integer counts [4, {N_BINS}]")
        empty = [k for k, row in zip(KINDS, h) if not bool(row.any())]
        if empty:  # a calibration counts every entry of every input: its thresholds would all be 0 (dense)
            raise PowerInferError(f"{files[i]}: an input with no counts ({', '.join(empty)}); recalibrate")
        out.append(h.to(torch.int64))
    return torch.stack(out)

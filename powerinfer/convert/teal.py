"""Calibrate and write input-sparse (TEAL) GGUF files (contract: :mod:`powerinfer.formats.teal`).

Calibration runs this project's own decoder (:class:`~powerinfer.runtime.input_sparse.TealTransformer`
on the dense file, every product dense) over a text and records, per layer and per input kind
(:data:`~powerinfer.formats.teal.KINDS`), the histogram of ``|x|`` over every token and entry, in
:data:`N_BINS` log-spaced bins from :data:`LO` to :data:`HI` (the first bin also takes smaller values
and zeros, the last larger ones): bin ratio ``(HI/LO)^(1/N_BINS)`` ~ 1.0068, so a threshold for any
sparsity is read off to within 0.7% of its value (TEAL, arXiv 2408.14690, sets its thresholds the
same way from calibration distributions). A GGUF needs no Hugging Face copy.

Activation folder (this project's contract, beside the ``activation_{i}.pt`` counts): per layer
``input_hist_{i}.pt`` (int64 ``[4, N_BINS]``, :data:`KINDS` rows; ``torch.load(weights_only=True)``)
and ``input_hist.json`` (``lo``, ``hi``, ``n_bins``, ``n_tokens``, ``source``).

Allocation (``method``):

* ``uniform``: every input at the target sparsity ``S`` (the parameter-weighted average is ``S`` too);
* ``greedy``: TEAL's block-wise greedy allocation. Per block, on the block inputs of the first
  :data:`GREEDY_TOKENS` calibration tokens (the dense model's residual stream), all four inputs start
  dense; each step considers raising one input's sparsity by as much as raises the block's
  parameter-weighted sparsity (q/k/v, attn_output, gate+up, down weighted by their parameters) by
  :data:`GREEDY_STEP`, and takes the raise that grows the squared error of the block output (against
  the dense block) least, until the block's sparsity reaches ``S``.

Writing streams the input GGUF (every tensor and key kept, in order; the TEAL keys added; each
sparsified matrix dequantized, transposed and re-encoded along its outputs in its own type, or
``outtype``), through a temporary file renamed when complete.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import PowerInferError
from ..formats._atomic import atomic_dir, atomic_path
from ..formats.activation import layer_files
from ..formats.gguf_file import GGUFFile, open_gguf
from ..formats.teal import KINDS, MATRICES, MAX_SPARSITY, METHOD_KEY, SPARSITY_KEY, THRESHOLDS, is_teal
from .outfile import check_outfile
from .quantize import _copy_metadata, _copy_raw, _drop_pages, _torch_shape
from .tensor_types import encode

LO, HI, N_BINS = 1e-6, 1e3, 3072
GREEDY_TOKENS = 256  # calibration tokens the greedy allocation measures block errors on
GREEDY_STEP = 0.025  # block-level sparsity added per greedy step
MIN_TOKENS = 256  # calibration tokens needed (each input then has >= 256 * n_embd samples)
HIST_FILE = "input_hist_{i}.pt"
HIST_META = "input_hist.json"
_WRITABLE = {"F32", "F16", "BF16", "Q4_0", "Q8_0"}
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QT = gguf.GGMLQuantizationType


def check_sparsity(s: float) -> float:
    """``s`` if in ``[0, MAX_SPARSITY]``, else PowerInferError."""
    if not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= MAX_SPARSITY:
        raise PowerInferError(f"--sparsity {s!r}: expected a number in [0, {MAX_SPARSITY}]")
    return float(s)


def _log_edges() -> torch.Tensor:
    """The ``N_BINS + 1`` bin edges (float64) of |x|."""
    return torch.logspace(math.log10(LO), math.log10(HI), N_BINS + 1, dtype=torch.float64)


def _add(hist: torch.Tensor, x: torch.Tensor) -> None:
    v = torch.log10(x.detach().float().abs().clamp_min(LO)).clamp_max(math.log10(HI) - 1e-9).view(-1)
    b = ((v - math.log10(LO)) / (math.log10(HI) - math.log10(LO)) * N_BINS).long().clamp_(0, N_BINS - 1)
    hist += torch.bincount(b, minlength=N_BINS)


def calibrate(gguf_path: str | Path, text: str, n_ctx: int = 512, max_tokens: int = 16384) -> tuple[torch.Tensor, int]:
    """Histograms int64 ``[n_layer, 4, N_BINS]`` of ``|x|`` of every input over ``text`` (at most
    ``max_tokens`` tokens, run in chunks of ``n_ctx``), and the token count. Raises
    PowerInferError for a text shorter than :data:`MIN_TOKENS` tokens or a model TEAL cannot run."""
    from ..runtime.input_sparse import TealTransformer
    from ..runtime.tokenizer import GGUFTokenizer

    g = open_gguf(gguf_path)
    if is_teal(g):
        raise PowerInferError(f"{gguf_path}: already an input-sparse (TEAL) file; calibrate the dense one")
    tok = GGUFTokenizer(g)
    ids = tok.encode(text)[:max_tokens]
    if len(ids) < MIN_TOKENS:
        raise PowerInferError(f"calibration text too short: {len(ids)} tokens, at least {MIN_TOKENS} needed")
    model = TealTransformer(g, torch.float32, dense=True, n_ctx=n_ctx)
    hist = torch.zeros(model.args.n_layer, len(KINDS), N_BINS, dtype=torch.int64)
    for i, kind, p in model.products():
        p.recorder = (lambda h: (lambda x: _add(h, x)))(hist[i, KINDS.index(kind)])
    step = model.n_ctx
    with torch.inference_mode():
        for s in range(0, len(ids), step):
            chunk = ids[s:s + step]
            model.forward(torch.tensor(chunk, dtype=torch.long), 0)
    return hist, len(ids)


def save_hist(folder: str | Path, hist: torch.Tensor, n_tokens: int, source: str) -> Path:
    """Write ``hist`` ``[n_layer, 4, N_BINS]`` as ``input_hist_{i}.pt`` + ``input_hist.json`` (atomically);
    an activation folder's other files (``pi-profile``'s counts, stats, report) are kept."""
    import shutil

    from ..formats.activation import OWNED

    owned = r"input_hist_\d+\.pt|input_hist\.json|" + OWNED
    folder = Path(folder)
    with atomic_dir(folder, owned) as tmp:
        if folder.is_dir():
            for p in folder.iterdir():
                if re.fullmatch(OWNED, p.name):
                    shutil.copy2(p, tmp / p.name)
        for i in range(hist.shape[0]):
            torch.save(hist[i].clone(), tmp / HIST_FILE.format(i=i))
        (tmp / HIST_META).write_text(json.dumps({"lo": LO, "hi": HI, "n_bins": N_BINS, "n_tokens": n_tokens,
                                                 "kinds": list(KINDS), "source": source}, indent=1) + "\n")
    return Path(folder)


def load_hist(folder: str | Path, n_layer: int) -> torch.Tensor:
    """``[n_layer, 4, N_BINS]`` from an activation folder; PowerInferError naming what is wrong."""
    folder = Path(folder)
    meta = folder / HIST_META
    if not meta.is_file():
        raise PowerInferError(f"{folder}: no {HIST_META} (calibrate with --data TEXT or pi-sparsify --data)")
    m = json.loads(meta.read_text())
    if (m.get("lo"), m.get("hi"), m.get("n_bins")) != (LO, HI, N_BINS):
        raise PowerInferError(f"{meta}: histogram bins {m.get('lo')}..{m.get('hi')} x {m.get('n_bins')} are not "
                              f"this version's {LO}..{HI} x {N_BINS}")
    files = layer_files(folder, re.compile(r"input_hist_(\d+)\.pt"), "activation")
    if sorted(files) != list(range(n_layer)):
        raise PowerInferError(f"{folder}: input histograms for layers {sorted(files)[:8]}..., the model has {n_layer}")
    out = []
    for i in range(n_layer):
        h = torch.load(files[i], weights_only=True)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != (len(KINDS), N_BINS) or (h < 0).any():
            raise PowerInferError(f"{files[i]}: expected non-negative counts [4, {N_BINS}]")
        out.append(h.to(torch.int64))
    return torch.stack(out)


def threshold_for(hist: torch.Tensor, s: float) -> float:
    """The |x| below which a share ``s`` of the histogram's values lie (a bin edge, log-spaced); 0
    for ``s`` 0. ``hist``: int64 ``[N_BINS]``."""
    if s <= 0:
        return 0.0
    c = torch.cumsum(hist.double(), 0)
    total = float(c[-1])
    if total == 0:
        return 0.0
    k = int(torch.searchsorted(c, torch.tensor(s * total, dtype=torch.float64)))  # first bin reaching s
    return float(_log_edges()[min(k + 1, N_BINS)])


def uniform_thresholds(hist: torch.Tensor, s: float) -> torch.Tensor:
    """float32 ``[n_layer, 4]``: every input's threshold for sparsity ``s``."""
    n_layer = hist.shape[0]
    return torch.tensor([[threshold_for(hist[i, k], s) for k in range(len(KINDS))] for i in range(n_layer)],
                        dtype=torch.float32)


def greedy_levels(gguf_path: str | Path, hist: torch.Tensor, text: str, s: float, step: float = GREEDY_STEP,
                  n_tokens: int = GREEDY_TOKENS) -> torch.Tensor:
    """Per-input sparsity levels float32 ``[n_layer, 4]`` by TEAL's greedy block-wise allocation (module
    docstring) for target ``s``, from histograms ``hist`` and the first ``n_tokens`` tokens of ``text``."""
    from ..runtime.input_sparse import TealTransformer
    from ..runtime.tokenizer import GGUFTokenizer

    g = open_gguf(gguf_path)
    ids = GGUFTokenizer(g).encode(text)[:n_tokens]
    if len(ids) < MIN_TOKENS:
        raise PowerInferError(f"calibration text too short: {len(ids)} tokens, at least {MIN_TOKENS} needed")
    model = TealTransformer(g, torch.float32, dense=True, n_ctx=len(ids))
    a = model.args
    hd = a.head_dim
    params = torch.tensor([(a.n_head + 2 * a.n_head_kv) * hd * a.n_embd, a.n_embd * a.n_head * hd,
                           2 * a.n_ff * a.n_embd, a.n_ff * a.n_embd], dtype=torch.float64)
    wgt = params / params.sum()
    inputs = {}
    block = model.block
    model.block = lambda i, layer, x, pos: (inputs.__setitem__(i, x.clone()), block(i, layer, x, pos))[1]
    levels = torch.zeros(a.n_layer, len(KINDS), dtype=torch.float64)
    try:
        with torch.inference_mode():
            model.forward(torch.tensor(ids, dtype=torch.long), 0)
            for i, layer in enumerate(model.layers):
                prods = [model.teal_layers[i].products[k] for k in KINDS]
                x = inputs[i]

                def err(lv) -> float:
                    for k, p in enumerate(prods):
                        p.mask_threshold = threshold_for(hist[i, k], float(lv[k]))
                    return float(((block(i, layer, x, 0) - ref) ** 2).sum())

                for p in prods:
                    p.mask_threshold = 0.0
                ref = block(i, layer, x, 0)
                lv = levels[i]
                while float((lv * wgt).sum()) < s - 1e-9:
                    best = None
                    for k in range(len(KINDS)):
                        if lv[k] >= MAX_SPARSITY - 1e-9:
                            continue
                        trial = lv.clone()  # each candidate raises the block's sparsity by the same step
                        trial[k] = min(MAX_SPARSITY, float(lv[k]) + step / float(wgt[k]))
                        e = err(trial)
                        if best is None or e < best[0]:
                            best = (e, k, trial)
                    if best is None:
                        break
                    lv.copy_(best[2])
                    over = float((lv * wgt).sum()) - s  # the last step may overshoot: take it back partly
                    if over > 0:
                        lv[best[1]] -= over / float(wgt[best[1]])
                for p in prods:
                    p.mask_threshold = 0.0
    finally:
        del model.block
    return levels.float()


def level_thresholds(hist: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """float32 ``[n_layer, 4]``: each input's threshold for its own sparsity level ``levels[i, k]``."""
    return torch.tensor([[threshold_for(hist[i, k], float(levels[i, k])) for k in range(len(KINDS))]
                         for i in range(hist.shape[0])], dtype=torch.float32)


def write_teal(src: str | Path, dst: str | Path, thresholds: torch.Tensor, sparsity: float, method: str = "uniform",
               outtype: str | None = None) -> Path:
    """Write ``src`` (a dense GGUF) as a TEAL file at ``dst``: thresholds ``[n_layer, 4]``, each matrix of a
    sparsified input stored input-major in its own type (or ``outtype``). Raises PowerInferError (nothing
    written) for a type that cannot be written along the outputs or a row length not whole blocks."""
    from ..runtime.args import ModelArgs
    from ..runtime.input_sparse import check_family

    src, dst = Path(src), Path(dst)
    g = open_gguf(src)
    a = ModelArgs.from_gguf(g)
    check_family(a, str(src))
    if is_teal(g) or g.sparse:
        raise PowerInferError(f"{src}: not a dense GGUF (already input-sparse or PWRI)")
    if "blk.0.attn_qkv.weight" in g.tensors:
        raise PowerInferError(f"{src}: fused attn_qkv is not supported with input sparsity")
    if tuple(thresholds.shape) != (a.n_layer, len(KINDS)):
        raise PowerInferError(f"thresholds of shape {tuple(thresholds.shape)}, the model has {a.n_layer} layers")
    if not bool(torch.isfinite(thresholds).all()) or bool((thresholds < 0).any()):
        raise PowerInferError("thresholds must be finite and >= 0")
    if outtype is not None and outtype.lower() not in OUTTYPES:
        raise PowerInferError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    check_outfile(dst, [src])
    sparse_of = {}
    for i in range(a.n_layer):
        for k, kind in enumerate(KINDS):
            if float(thresholds[i, k]) > 0:
                for m in MATRICES[kind]:
                    sparse_of[f"blk.{i}.{m}.weight"] = f"blk.{i}.{m}_t.weight"
    plan = []
    for t in g.reader.tensors:
        shape = _torch_shape(t)
        if t.name not in sparse_of:
            plan.append((t, t.name, shape, t.tensor_type, None))
            continue
        qt = QT[outtype.upper()] if outtype else t.tensor_type
        if qt.name not in _WRITABLE:
            raise PowerInferError(f"{src}: {t.name} is {t.tensor_type.name}, which cannot be re-encoded along its "
                                  f"outputs here; give --outtype ({', '.join(OUTTYPES)})")
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if shape[0] % block:
            raise PowerInferError(f"{src}: {t.name} has {shape[0]} outputs, not a multiple of {qt.name}'s block of "
                                  f"{block}: give --outtype f16 or f32")
        plan.append((t, sparse_of[t.name], (shape[1], shape[0]), qt, "T"))
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(str(tmp), g.arch)
        _copy_metadata(w, g, int(g.get("general.file_type", 0) or 0))
        w.add_float32(SPARSITY_KEY, float(sparsity))
        w.add_string(METHOD_KEY, method)
        encoded = []
        for t, name, shape, qt, how in plan:
            if how is None:
                e = _copy_raw(t)
            else:
                wmat = _dequant(t, _torch_shape(t))
                e = encode(np.ascontiguousarray(wmat.T), qt, name)
            w.add_tensor_info(name, shape, np.dtype(np.float32), e.nbytes, raw_dtype=qt)
            encoded.append((t, e))
        thr_enc = []
        for i in range(a.n_layer):
            arr = thresholds[i].numpy().astype(np.float32)
            e = encode(arr, QT.F32, THRESHOLDS.format(i=i))
            w.add_tensor_info(THRESHOLDS.format(i=i), (4,), np.dtype(np.float32), e.nbytes, raw_dtype=QT.F32)
            thr_enc.append(e)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, e in encoded:
            w.write_tensor_data(e)
            _drop_pages(g, t)
        for e in thr_enc:
            w.write_tensor_data(e)
        w.close()
    return dst


def _dequant(t, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor of the reader as fp32 ``shape`` (torch order)."""
    if t.tensor_type == QT.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    if t.tensor_type == QT.F16:
        return np.asarray(t.data).view(np.float16).astype(np.float32).reshape(shape)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)


def sparsify(src: str | Path, dst: str | Path, sparsity: float, text: str | None = None,
             act_dir: str | Path | None = None, outtype: str | None = None, n_ctx: int = 512,
             method: str = "uniform") -> tuple[Path, torch.Tensor]:
    """Calibrate ``src`` on ``text`` (histograms saved to ``act_dir`` when given) or read ``act_dir``'s
    histograms, set thresholds for ``sparsity`` by ``method`` (``uniform``; ``greedy`` needs ``text``)
    and write ``dst``; returns it and the thresholds."""
    sparsity = check_sparsity(sparsity)
    if method not in ("uniform", "greedy"):
        raise PowerInferError(f"--method {method!r}: expected uniform or greedy")
    if method == "greedy" and text is None:
        raise PowerInferError("--method greedy measures block errors on the calibration text: give --data TEXT")
    from ..runtime.args import ModelArgs
    from ..runtime.input_sparse import check_family

    g = open_gguf(src)
    a = ModelArgs.from_gguf(g)
    check_family(a, str(src))
    check_outfile(dst, [src])
    if text is not None:
        hist, n = calibrate(src, text, n_ctx)
        if act_dir is not None:
            save_hist(act_dir, hist, n, str(src))
    elif act_dir is not None:
        hist = load_hist(act_dir, a.n_layer)
    else:
        raise PowerInferError("give --data TEXT (calibrate now) or an activation folder with input histograms")
    if method == "greedy":
        thr = level_thresholds(hist, greedy_levels(src, hist, text, sparsity))
    else:
        thr = uniform_thresholds(hist, sparsity)
    return write_teal(src, dst, thr, sparsity, method, outtype), thr

"""Calibrate and write input-sparse (TEAL) GGUF files (contract: :mod:`powerinfer.formats.teal`).

Calibration runs this project's own decoder (:class:`~powerinfer.runtime.input_sparse.TealTransformer`
on the dense file, every product dense) over a text and records, per layer and per input kind
(:data:`~powerinfer.formats.teal.KINDS`), the histograms of ``|x|`` and of WINA's ``|x_j| * ||W[:, j]||``
over every token and entry (:mod:`powerinfer.formats.input_hist`: log-spaced bins, a threshold for any
sparsity to within 0.7%; TEAL, arXiv 2408.14690, sets its thresholds the same way). A GGUF needs no
Hugging Face copy; ``pi-profile`` records the same histograms from a Hugging Face folder
(:mod:`powerinfer.profile.inputs`).

Allocation (``method``):

* ``uniform``: every input at the target sparsity ``S`` (the parameter-weighted average is ``S`` too);
* ``greedy``: TEAL's block-wise greedy allocation. Per block, on the block inputs of the first
  :data:`GREEDY_TOKENS` calibration tokens (the dense model's residual stream), all four inputs start
  dense; each step considers raising one input's sparsity by as much as raises the block's
  parameter-weighted sparsity (q/k/v, attn_output, gate+up, down weighted by their parameters) by
  :data:`GREEDY_STEP`, and takes the raise that grows the squared error of the block output (against
  the dense block) least, until the block's sparsity reaches ``S``;
* ``wina``: every input at ``S``, ranked by ``|x_j| * c_j`` with ``c_j`` the norm of column ``j`` of the
  matrix consuming it (WINA, arXiv 2505.19427): the thresholds come from the weighted histograms and
  the norms are stored in the file (:data:`~powerinfer.formats.teal.COLNORM`);
* ``wina-greedy``: WINA's criterion with TEAL's greedy allocation (the masks of the search rank by
  ``|x_j| * c_j``), as WINA's own release allocates its levels.

Writing streams the input GGUF (every tensor and key kept, in order; the TEAL keys added; each
sparsified matrix dequantized, transposed and re-encoded along its outputs in its own type, or
``outtype``: K-quant and Q5 sources need one), through a temporary file renamed when complete.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import PowerInferError
from ..formats._atomic import atomic_path
from ..formats.gguf_file import GGUFFile, open_gguf
from ..formats.input_hist import add_values, load_hist, new_hist, save_hist, threshold_for
from ..formats.teal import (COLNORM, KINDS, MATRICES, MAX_SPARSITY, METHOD_KEY, METHODS, SPARSITY_KEY, THRESHOLDS,
                            WEIGHTED, is_teal, stored_name)
from .outfile import check_outfile
from .quantize import _copy_metadata, _copy_raw, _drop_pages, _torch_shape
from .tensor_types import encode

GREEDY_TOKENS = 256  # calibration tokens the greedy allocation measures block errors on
GREEDY_STEP = 0.025  # block-level sparsity added per greedy step
MIN_TOKENS = 256  # calibration tokens needed (each input then has >= 256 * n_embd samples)
_WRITABLE = {"F32", "F16", "BF16", "Q4_0", "Q8_0"}
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QT = gguf.GGMLQuantizationType
__all__ = ["Calibration", "calibrate", "calibrate_inputs", "check_sparsity", "check_tokens", "column_norms",
           "greedy_levels", "level_thresholds", "load_hist", "plan_thresholds", "save_hist", "sparsify",
           "threshold_for", "uniform_thresholds", "write_teal"]


def check_sparsity(s: float) -> float:
    """``s`` if in ``[0, MAX_SPARSITY]``, else PowerInferError."""
    if not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= MAX_SPARSITY:
        raise PowerInferError(f"--sparsity {s!r}: expected a number in [0, {MAX_SPARSITY}]")
    return float(s)


def check_tokens(n: int) -> None:
    """PowerInferError unless ``n`` calibration tokens are at least :data:`MIN_TOKENS`."""
    if n < MIN_TOKENS:
        raise PowerInferError(f"calibration text too short: {n} tokens, at least {MIN_TOKENS} needed")


def check_method(method: str) -> str:
    if method not in METHODS:
        raise PowerInferError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    return method


@dataclass
class Calibration:
    """Histograms int64 ``[n_layer, 4, N_BINS]`` of ``|x|`` (``hist``) and of ``|x_j| * c_j`` (``wina``; None
    when not recorded), over ``n_tokens`` tokens."""

    hist: torch.Tensor
    wina: torch.Tensor | None
    n_tokens: int


def column_norms(g: GGUFFile, n_layer: int) -> list[list[torch.Tensor]]:
    """``[n_layer][4]`` float32 ``[K]``: ``||W[:, j]||_2`` of each input's consuming matrix (q/k/v and gate/up
    joined along their outputs), dequantized from ``g`` (row-major ``W`` or input-major ``W^T``)."""
    out = []
    for i in range(n_layer):
        row = []
        for kind in KINDS:
            sq = None
            for m in MATRICES[kind]:
                base = f"blk.{i}.{m}"
                t_major = stored_name(base, True) in g.tensors
                t = g.tensors[stored_name(base, t_major)]
                w = _dequant(t, _torch_shape(t)).astype(np.float64)
                part = (w * w).sum(axis=1 if t_major else 0)
                sq = part if sq is None else sq + part
            row.append(torch.from_numpy(np.sqrt(sq)).float())
        out.append(row)
    return out


def calibrate_inputs(gguf_path: str | Path, text: str, n_ctx: int = 512, max_tokens: int = 16384,
                     wina: bool = True) -> Calibration:
    """The histograms of every input over ``text`` (at most ``max_tokens`` tokens, BOS first as the file says,
    run in chunks of ``n_ctx`` tokens each from position 0). Raises PowerInferError for a text shorter than
    :data:`MIN_TOKENS` tokens or a model TEAL cannot run."""
    from ..runtime.input_sparse import TealTransformer
    from ..runtime.tokenizer import GGUFTokenizer

    g = open_gguf(gguf_path)
    if is_teal(g):
        raise PowerInferError(f"{gguf_path}: already an input-sparse (TEAL) file; calibrate the dense one")
    ids = GGUFTokenizer(g).encode(text)[:max_tokens]
    check_tokens(len(ids))
    model = TealTransformer(g, torch.float32, dense=True, n_ctx=n_ctx)
    cal = Calibration(new_hist(model.args.n_layer), new_hist(model.args.n_layer) if wina else None, len(ids))
    norms = column_norms(g, model.args.n_layer) if wina else None
    for i, kind, p in model.products():
        p.recorder = recorder(cal, i, kind, None if norms is None else norms[i][KINDS.index(kind)])
    with torch.inference_mode():
        for s in range(0, len(ids), model.n_ctx):
            model.forward(torch.tensor(ids[s:s + model.n_ctx], dtype=torch.long), 0)
    return cal


def recorder(cal: Calibration, i: int, kind: str, colnorm: torch.Tensor | None):
    """A callback counting an input ``x`` ``[T, K]`` of layer ``i``'s ``kind`` into ``cal`` (``colnorm`` ``[K]``:
    WINA's weights, None when ``cal.wina`` is None)."""
    k = KINDS.index(kind)

    def rec(x: torch.Tensor) -> None:
        add_values(cal.hist[i, k], x)
        if colnorm is not None:
            add_values(cal.wina[i, k], x.float().abs() * colnorm)
    return rec


def calibrate(gguf_path: str | Path, text: str, n_ctx: int = 512, max_tokens: int = 16384) -> tuple[torch.Tensor, int]:
    """``|x|`` histograms int64 ``[n_layer, 4, N_BINS]`` and the token count (:func:`calibrate_inputs`)."""
    cal = calibrate_inputs(gguf_path, text, n_ctx, max_tokens, wina=False)
    return cal.hist, cal.n_tokens


def uniform_thresholds(hist: torch.Tensor, s: float) -> torch.Tensor:
    """float32 ``[n_layer, 4]``: every input's threshold for sparsity ``s``."""
    n_layer = hist.shape[0]
    return torch.tensor([[threshold_for(hist[i, k], s) for k in range(len(KINDS))] for i in range(n_layer)],
                        dtype=torch.float32)


def greedy_levels(gguf_path: str | Path, hist: torch.Tensor, text: str, s: float, step: float = GREEDY_STEP,
                  n_tokens: int = GREEDY_TOKENS, colnorms: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Per-input sparsity levels float32 ``[n_layer, 4]`` by TEAL's greedy block-wise allocation (module
    docstring) for target ``s``, from histograms ``hist`` and the first ``n_tokens`` tokens of ``text``; with
    ``colnorms`` (:func:`column_norms`), ``hist`` is WINA's and the masks rank inputs by ``|x_j| * c_j``."""
    from ..runtime.input_sparse import TealTransformer
    from ..runtime.tokenizer import GGUFTokenizer

    g = open_gguf(gguf_path)
    ids = GGUFTokenizer(g).encode(text)[:n_tokens]
    check_tokens(len(ids))
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
                for k, p in enumerate(prods):
                    p.colnorm = None if colnorms is None else colnorms[i][k]
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
                    p.mask_threshold, p.colnorm = 0.0, None
    finally:
        del model.block
    return levels.float()


def level_thresholds(hist: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """float32 ``[n_layer, 4]``: each input's threshold for its own sparsity level ``levels[i, k]``."""
    return torch.tensor([[threshold_for(hist[i, k], float(levels[i, k])) for k in range(len(KINDS))]
                         for i in range(hist.shape[0])], dtype=torch.float32)


def write_teal(src: str | Path, dst: str | Path, thresholds: torch.Tensor, sparsity: float, method: str = "uniform",
               outtype: str | None = None, colnorms: list[list[torch.Tensor]] | None = None) -> Path:
    """Write ``src`` (a dense GGUF) as a TEAL file at ``dst``: thresholds ``[n_layer, 4]``, each matrix of a
    sparsified input stored input-major in its own type (or ``outtype``); for a weighted ``method`` (``wina``)
    the ``colnorms`` (``[n_layer][4]`` float32 ``[K]``, :func:`column_norms`) of the sparsified inputs. Raises
    PowerInferError (nothing written) for a type that cannot be written along the outputs (K-quants, Q5: give
    ``outtype``) or a row length not whole blocks."""
    from ..runtime.args import ModelArgs
    from ..runtime.input_sparse import check_family

    src, dst = Path(src), Path(dst)
    g = open_gguf(src)
    a = ModelArgs.from_gguf(g)
    check_family(a, str(src))
    check_method(method)
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
    if (method in WEIGHTED) != (colnorms is not None):
        raise PowerInferError(f"method {method}: column norms are {'required' if method in WEIGHTED else 'not used'}")
    check_outfile(dst, [src])
    sparse_of = {}
    for i in range(a.n_layer):
        for k, kind in enumerate(KINDS):
            if float(thresholds[i, k]) > 0:
                for m in MATRICES[kind]:
                    sparse_of[f"blk.{i}.{m}.weight"] = f"blk.{i}.{m}_t.weight"
    plan, unwritable = [], {}
    for t in g.reader.tensors:
        shape = _torch_shape(t)
        if t.name not in sparse_of:
            plan.append((t, t.name, shape, t.tensor_type, None))
            continue
        qt = QT[outtype.upper()] if outtype else t.tensor_type
        if qt.name not in _WRITABLE:
            unwritable.setdefault(qt.name, t.name)
            continue
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if shape[0] % block:
            raise PowerInferError(f"{src}: {t.name} has {shape[0]} outputs, not a multiple of {qt.name}'s block of "
                                  f"{block}: give --outtype f16 or f32")
        plan.append((t, sparse_of[t.name], (shape[1], shape[0]), qt, "T"))
    if unwritable:
        kq = any(n.endswith("_K") for n in unwritable)
        first = next(iter(unwritable.values()))
        raise PowerInferError(f"{src}: {', '.join(unwritable)} matrices (first {first}) cannot be re-encoded "
                              f"input-major here ({'the gguf package writes no K-quants; ' if kq else ''}"
                              f"writable: F32, F16, BF16, Q8_0, Q4_0): give --outtype q4_0, q8_0 or f16")
    extra = []  # (name, float32 array): thresholds, then column norms
    for i in range(a.n_layer):
        extra.append((THRESHOLDS.format(i=i), thresholds[i].numpy().astype(np.float32)))
    if colnorms is not None:
        for i in range(a.n_layer):
            for k, kind in enumerate(KINDS):
                if float(thresholds[i, k]) > 0:
                    c = np.ascontiguousarray(colnorms[i][k].float().numpy())
                    if not np.isfinite(c).all() or (c < 0).any():
                        raise PowerInferError(f"column norms of layer {i} {kind} must be finite and >= 0")
                    extra.append((COLNORM.format(i=i, kind=kind), c))
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
        extra_enc = []
        for name, arr in extra:
            e = encode(arr, QT.F32, name)
            w.add_tensor_info(name, arr.shape, np.dtype(np.float32), e.nbytes, raw_dtype=QT.F32)
            extra_enc.append(e)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, e in encoded:
            w.write_tensor_data(e)
            _drop_pages(g, t)
        for e in extra_enc:
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


def plan_thresholds(src: str | Path, method: str, cal: Calibration, sparsity: float,
                    text: str | None = None) -> tuple[torch.Tensor, list[list[torch.Tensor]] | None]:
    """Thresholds float32 ``[n_layer, 4]`` for ``sparsity`` by ``method`` from ``cal`` (``greedy`` also runs
    ``text``), and the column norms a weighted method stores (None otherwise)."""
    if method.endswith("greedy") and text is None:
        raise PowerInferError(f"--method {method} measures block errors on the calibration text: give --data TEXT")
    norms = None
    if method in WEIGHTED:
        if cal.wina is None:
            raise PowerInferError(f"--method {method}: the calibration has no weighted histograms")
        norms = column_norms(open_gguf(src), cal.wina.shape[0])
    hist = cal.hist if norms is None else cal.wina
    if method.endswith("greedy"):
        return level_thresholds(hist, greedy_levels(src, hist, text, sparsity, colnorms=norms)), norms
    return uniform_thresholds(hist, sparsity), norms


def sparsify(src: str | Path, dst: str | Path, sparsity: float, text: str | None = None,
             act_dir: str | Path | None = None, outtype: str | None = None, n_ctx: int = 512,
             method: str = "uniform") -> tuple[Path, torch.Tensor]:
    """Calibrate ``src`` on ``text`` (histograms saved to ``act_dir`` when given) or read ``act_dir``'s
    histograms, set thresholds for ``sparsity`` by ``method`` (``uniform``, ``wina``; ``greedy`` needs
    ``text``) and write ``dst``; returns it and the thresholds."""
    sparsity = check_sparsity(sparsity)
    check_method(method)
    if method.endswith("greedy") and text is None:
        raise PowerInferError(f"--method {method} measures block errors on the calibration text: give --data TEXT")
    from ..runtime.args import ModelArgs
    from ..runtime.input_sparse import check_family

    g = open_gguf(src)
    a = ModelArgs.from_gguf(g)
    check_family(a, str(src))
    check_outfile(dst, [src])
    if text is not None:
        cal = calibrate_inputs(src, text, n_ctx)
        if act_dir is not None:
            save_hist(act_dir, cal.hist, cal.n_tokens, str(src), cal.wina)
    elif act_dir is not None:
        weighted = method in WEIGHTED
        cal = Calibration(load_hist(act_dir, a.n_layer), load_hist(act_dir, a.n_layer, "wina") if weighted else None,
                          0)
    else:
        raise PowerInferError("give --data TEXT (calibrate now) or an activation folder with input histograms")
    thr, norms = plan_thresholds(src, method, cal, sparsity, text)
    return write_teal(src, dst, thr, sparsity, method, outtype, norms), thr

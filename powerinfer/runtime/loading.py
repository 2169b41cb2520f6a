"""Open a model for inference the same way in every front end (pi-run, pi-perplexity, pi-server):
kernels chosen, weights mapped, threads set, hot neurons offloaded when a VRAM budget is given."""
from __future__ import annotations

import sys
from typing import Callable

import torch

from ..cli_params import check_cache_type, check_ctx_size, check_threads
from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile, open_gguf
from . import kernels
from .generate import decode_bytes_per_token
from .model import Transformer
from .moe import is_moe
from .tokenizer import GGUFTokenizer
from .kv_cache import DEFAULT_KV_CACHE_TYPE
from .weights import compute_dtype

SMALL_MODEL_BYTES = 64 << 20  # below this many weight bytes per token, one thread is fastest


def load_model(path: str, dtype: str = "f32", dense: bool = False, n_ctx: int | None = None,
               ram_budget: float | None = None, activation_dir: str | None = None,
               note: Callable[[str], None] | None = None, g: GGUFFile | None = None,
               cache_type_k: str | None = None, cache_type_v: str | None = None):
    """Open ``path`` and build the runtime model and its tokenizer (``dtype``: auto, bf16, f32;
    ``cache_type_k``/``_v``: the KV cache's types, f32/f16/bf16/q8_0, None: the compute dtype as
    :class:`Transformer`; the front ends pass their ``-ctk``/``-ctv``, f16 by default).

    ``ram_budget`` (GiB): hot FFN neurons resident, cold ones read from the file
    (:mod:`.residency`, :mod:`.cold_rows`). ``g``: ``path`` already opened (validated once)."""
    g = g if g is not None else open_gguf(path)
    tok = GGUFTokenizer(g)  # an unsupported vocabulary is refused before any weight is mapped
    from ..formats.teal import is_teal

    if is_teal(g):  # input-sparse (TEAL) file: its own decoder (runtime/input_sparse.py)
        if ram_budget is not None:
            raise PowerInferError(f"{path}: --ram-budget does not run input-sparse (TEAL) files yet: "
                                  "they read every matrix by input rows, which the budget's FFN does not hold")
        from .input_sparse import TealTransformer

        return TealTransformer(g, compute_dtype(dtype), dense=dense, n_ctx=n_ctx), tok
    if ram_budget is not None:  # (and the budget's plan measures what the process holds after it)
        if is_moe(g):  # the most routed experts resident, the others read when routed (expert_residency.py)
            from .expert_residency import load_experts_budgeted

            model, plan = load_experts_budgeted(g, compute_dtype(dtype), n_ctx, ram_budget, activation_dir,
                                                cache_type_k=cache_type_k, cache_type_v=cache_type_v)
            if note is not None:
                note(plan.summary())
            return model, tok
        if dense:
            raise PowerInferError("--ram-budget and --dense: a dense FFN reads every row every token; "
                                  "the budget needs the sparse FFN")
        from .cold_rows import load_budgeted

        model, plan, _ = load_budgeted(g, compute_dtype(dtype), n_ctx, ram_budget, activation_dir, note,
                                       cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        if note is not None:
            note(plan.summary())
        return model, tok
    cls = Transformer
    if g.arch == "smallthinker":  # pre-attention router, NoPE and sliding layers (runtime/smallthinker.py)
        from .smallthinker import SmallThinkerTransformer as cls
    model = cls(g, compute_dtype(dtype), dense=dense, n_ctx=n_ctx, cache_type_k=cache_type_k,
                cache_type_v=cache_type_v)
    return model, tok


def default_threads(model: Transformer) -> int:
    """1 for small models (per-token work is too short to split), else torch's default
    (the physical cores)."""
    return 1 if decode_bytes_per_token(model, 1.0) < SMALL_MODEL_BYTES else torch.get_num_threads()


def set_kernels(kernel_backend: str | None) -> None:
    """``--kernels``: c, torch or auto (None: $POWERINFER_KERNELS or auto); PowerInferError when the C
    kernels cannot be built."""
    if kernel_backend is None:
        return
    try:
        kernels.set_backend(kernel_backend)
    except RuntimeError as e:
        raise PowerInferError(f"--kernels {kernel_backend}: {e}") from None


def open_for_inference(model_path: str, *, dtype: str = "auto", dense: bool = False, ctx_size: int = 0,
                       threads: int = 0, kernel_backend: str | None = None, vram_budget: float | None = None,
                       activation_dir: str | None = None, reset_gpu_index: bool = False,
                       disable_gpu_index: bool = False, ram_budget: float | None = None,
                       note: Callable[[str], None] = lambda s: sys.stderr.write(s + "\n"),
                       cache_type_k: str = DEFAULT_KV_CACHE_TYPE, cache_type_v: str = DEFAULT_KV_CACHE_TYPE):
    """The model and tokenizer of ``model_path``, ready to decode: ``ctx_size`` 0 is the model's
    context (larger values are cut to it, with a ``note``), ``threads`` 0 picks by model size,
    ``vram_budget`` (GiB) places hot neurons on the GPU; ``ram_budget`` (GiB) keeps the process
    within that much resident memory, cold FFN rows read from the file (not with ``vram_budget``
    for now); ``cache_type_k``/``_v``: the KV cache's key and value types (f32, f16, bf16, q8_0; f16 by
    default, as llama.cpp). Raises PowerInferError on bad values."""
    check_ctx_size(ctx_size)  # the front ends check these before importing torch; kept for library callers
    check_threads(threads)
    check_cache_type(cache_type_k, "--cache-type-k")
    check_cache_type(cache_type_v, "--cache-type-v")
    set_kernels(kernel_backend)
    if ram_budget is not None and vram_budget is not None and not disable_gpu_index:
        raise PowerInferError("--ram-budget with --vram-budget: not supported yet (the GPU split copies the CPU "
                              "side's rows out of full matrices, which a RAM budget never holds); give one")
    g = open_gguf(model_path)  # opened and validated once: the model, the plan and the GPU index read it
    if vram_budget is not None and not disable_gpu_index and is_moe(g):
        raise PowerInferError(f"{model_path}: --vram-budget does not run mixture-of-experts files yet")
    model, tok = load_model(model_path, dtype, dense, ctx_size or None, ram_budget, activation_dir, note, g,
                            cache_type_k, cache_type_v)
    if ctx_size > model.n_ctx:
        note(f"note: -c {ctx_size} is more than the model's context length; using {model.n_ctx}")
    torch.set_num_threads(threads or default_threads(model))
    if vram_budget is not None and not disable_gpu_index:
        if getattr(model, "teal", None) is not None:
            raise PowerInferError(f"{model_path}: --vram-budget does not run input-sparse (TEAL) files yet")

        from .hybrid import offload

        summary = offload(model, model_path, vram_budget, activation_dir, reset_gpu_index, g=g)
        if summary is not None:
            note(summary)
    return model, tok

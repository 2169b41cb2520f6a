"""``pi-perplexity``: perplexity of a GGUF or PowerInfer GGUF on a text file (llama.cpp's method).

Output follows ``llama-perplexity``: the running value after each chunk on stdout
(``[1]12.3456,[2]12.5012,...``), then ``Final estimate: PPL = 12.3456 +/- 0.12345``.
Progress goes to stderr: one line per chunk when stderr is not a terminal, else the
first chunk's time and an ETA, as llama.cpp prints.

Modes: a PWRI file runs sparse with its predictors (``predictor``), ``--dense`` computes
every FFN neuron, ``--oracle`` computes exactly the truly active neurons (what a perfect
predictor would choose), and ``--compare`` evaluates all three on the same tokens and
prints each perplexity, its change against dense and the share of FFN neurons computed:
predictor vs dense is the cost of the predictor's misses, oracle vs dense should be zero
(else the conversion or the sparse kernels are at fault). ``--compare`` and ``--oracle``
on a dense GGUF (no predictors) are an error.
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

from typing import TYPE_CHECKING

import click

from ..cli_params import (DEFAULT_KV_CACHE_TYPE, PiCommand, FiniteFloat, cache_type_options, check_cache_type,
                          check_ctx_size, check_threads, require_file, require_gguf, version_option)
from ..errors import PowerInferError, cli_errors
from ..limits import MAX_BUDGET_GIB
from ..runtime.cli import DTYPE_NAMES

if TYPE_CHECKING:  # torch and the runtime are imported when the command runs, so --help answers at once
    from .perplexity import ChunkInfo, PerplexityResult

DEFAULT_CTX = 512  # llama.cpp's default for llama-perplexity, capped by the model's context
MODES = {"dense": "every FFN neuron", "predictor": "neurons the predictor marks active",
         "oracle": "exactly the truly active neurons",
         "teal": "matrix inputs below the file's thresholds zeroed (input-sparse TEAL file)"}


@dataclass
class Setup:
    model_path: str
    text: str
    ctx_size: int | None
    n_chunks: int | None
    n_batch: int | None
    threads: int
    dtype: str
    capped: bool = False  # the note that -c was cut to the model's context was printed
    ram_budget: float | None = None  # --ram-budget GiB (predictor mode only)
    activation_dir: str | None = None
    cache_type_k: str = DEFAULT_KV_CACHE_TYPE  # -ctk / -ctv: the KV cache's types (f16, as llama.cpp)
    cache_type_v: str = DEFAULT_KV_CACHE_TYPE


def _progress(label: str):
    """Per-chunk callback: running values on stdout, progress on stderr."""
    tty = sys.stderr.isatty()

    def on_chunk(c: ChunkInfo) -> None:
        if not tty:
            tps = f" ({c.n_ctx / c.seconds:.0f} tokens/s)" if c.seconds > 0 else ""
            sys.stderr.write(f"{label}: chunk {c.index}/{c.n_chunks}: {c.seconds:.2f} s{tps}, "
                             f"running PPL {c.running_ppl:.4f}\n")
        elif c.index == 1:  # before the first value, as llama.cpp prints it
            eta = c.seconds * (c.n_chunks - 1)
            sys.stderr.write(f"{label}: {c.seconds:.2f} seconds per pass - ETA {eta / 60:.2f} minutes\n")
        sys.stderr.flush()
        sys.stdout.write(f"[{c.index}]{c.running_ppl:.4f},")
        sys.stdout.flush()

    return on_chunk


def _load(s: Setup, mode: str):
    """Load the model for ``mode`` with the context ``-c`` asks for; check it fits."""
    import torch

    from ..runtime.loading import default_threads, load_model

    model, tok = load_model(s.model_path, s.dtype, dense=mode == "dense", n_ctx=s.ctx_size or DEFAULT_CTX,
                            ram_budget=s.ram_budget if mode == "predictor" else None, activation_dir=s.activation_dir,
                            note=lambda m: sys.stderr.write(m + "\n"), cache_type_k=s.cache_type_k,
                            cache_type_v=s.cache_type_v)
    if s.ctx_size and model.n_ctx < s.ctx_size and not s.capped:  # capped with a note, as pi-run does
        sys.stderr.write(f"note: -c {s.ctx_size} is more than the model's context length; using {model.n_ctx}\n")
        s.capped = True
    if mode == "oracle":
        model.oracle_masks()
    torch.set_num_threads(s.threads or default_threads(model))
    return model, tok


def _evaluate(s: Setup, mode: str, chunks: list[list[int]] | None, model=None, tok=None, header=False):
    """Perplexity in ``mode``; tokenizes and chunks the text when ``chunks`` is None."""
    import torch

    from .perplexity import chunk_tokens, perplexity
    if model is None:
        model, tok = _load(s, mode)
    if chunks is None:
        ids = tok.encode(s.text)  # BOS first when the vocabulary adds BOS
        bos = tok.bos_id if tok.add_bos else None
        chunks = chunk_tokens(ids, model.n_ctx, s.n_chunks, bos)
        n = len(chunks)
        sys.stderr.write(f"perplexity: {s.model_path} ({model.args.family.name}, "
                         f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s)): "
                         f"{len(ids)} tokens, {n} chunk{'s' if n > 1 else ''} of {model.n_ctx}, "
                         f"{n * (model.n_ctx - model.n_ctx // 2 - 1)} tokens scored\n")
    if header:
        sys.stdout.write(f"== {mode}: {MODES[mode]}\n")
    res = perplexity(model, chunks, s.n_batch, _progress(mode))
    sys.stdout.write("\n")
    _final(res)
    return res, chunks, model, tok


def _final(res: PerplexityResult) -> None:
    # no uncertainty from a single scored token (or no spread): the PPL alone, never "+/- nan"
    err = "" if math.isnan(res.stderr) else f" +/- {res.stderr:.5f}"
    sys.stdout.write(f"Final estimate: PPL = {res.ppl:.4f}{err}\n")
    sys.stdout.flush()


def _share(res: PerplexityResult) -> str:
    return "100.0%" if res.active_share is None else f"{100 * res.active_share:.1f}%"


def compare_table(results: dict[str, PerplexityResult]) -> str:
    """The ``--compare`` summary: PPL, uncertainty, change vs dense, share of FFN neurons computed."""
    base = results["dense"].ppl
    rows = [("mode", "PPL", "+/-", "vs dense", "FFN neurons computed")]
    for mode, r in results.items():
        delta = "-" if mode == "dense" else f"{100 * (r.ppl / base - 1):+.3f}%"
        rows.append((mode, f"{r.ppl:.4f}", "-" if math.isnan(r.stderr) else f"{r.stderr:.5f}", delta, _share(r)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", "model_path", required=True, type=click.Path(dir_okay=False),
              help="GGUF (dense) or PowerInfer GGUF (PWRI magic, sparse) file.")
@click.option("-f", "--file", "text_path", required=True, type=click.Path(dir_okay=False),
              help="UTF-8 text file (e.g. wiki.test.raw); needs at least 2 x -c tokens.")
@click.option("-c", "--ctx-size", default=0,
              help=f"Tokens per chunk (0: {DEFAULT_CTX}, larger values are cut to the model's context length, with a note).")
@click.option("--chunks", "n_chunks", type=int, default=None, help="Evaluate at most this many chunks (default: all).")
@click.option("-b", "--batch-size", "n_batch", type=int, default=None,
              help="Tokens per forward pass (default: the whole chunk; 1: token by token).")
@click.option("-t", "--threads", default=0,
              help="CPU threads (0: 1 for models under 64 MB of weights per token, else torch's default).")
@click.option("--dtype", type=click.Choice(["auto", *sorted(DTYPE_NAMES)]), default="auto", show_default=True,
              help="Compute dtype (auto: bf16 if the CPU has bf16 dot products, else f32).")
@click.option("--dense", is_flag=True, help="Compute every FFN neuron even in a PWRI file.")
@click.option("--oracle", is_flag=True, help="Compute exactly the truly active FFN neurons (needs a PWRI file).")
@click.option("--compare", is_flag=True,
              help="Dense, predictor and oracle on the same tokens: PPL, change vs dense, neurons computed.")
@click.option("--ram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None,
              help="GiB of RAM to stay within: hot FFN neurons resident, cold rows read from the file, as pi-run "
                   "(predictor mode only).")
@click.option("--activation", "activation_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder choosing the hot neurons for --ram-budget (default: activation/ beside the model).")
@cache_type_options
@version_option("pi-perplexity")
@cli_errors
def main(model_path, text_path, ctx_size, n_chunks, n_batch, threads, dtype, dense, oracle, compare, ram_budget,
         activation_dir, cache_type_k, cache_type_v):
    """Perplexity of a model on a text, computed as llama.cpp's llama-perplexity does."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    # values and input files are checked before torch is imported (seconds on a cold start)
    check_ctx_size(ctx_size, f"{DEFAULT_CTX} or the model's context length")
    if ctx_size and ctx_size < 4:
        raise PowerInferError(f"-c {ctx_size}: the context must be at least 4 tokens (half of it is scored)")
    if n_chunks is not None and n_chunks <= 0:
        raise PowerInferError(f"--chunks {n_chunks}: must be > 0 (omit it for every chunk)")
    if n_batch is not None and n_batch <= 0:
        raise PowerInferError(f"-b {n_batch}: must be > 0")
    check_threads(threads)
    check_cache_type(cache_type_k, "--cache-type-k")
    check_cache_type(cache_type_v, "--cache-type-v")
    if sum((dense, oracle, compare)) > 1:
        raise PowerInferError("--dense, --oracle and --compare exclude each other (--compare runs all three)")
    if ram_budget is not None and (dense or oracle or compare):
        raise PowerInferError("--ram-budget runs the predictor's sparse FFN: it cannot be combined with --dense, "
                              "--oracle or --compare")
    require_gguf(model_path)
    require_file(text_path)
    from ..formats.gguf_file import open_gguf
    from .perplexity import read_text

    text = read_text(text_path)  # a bad text fails before the model is loaded
    from ..formats.teal import is_teal

    g = open_gguf(model_path)
    if is_teal(g):  # input-sparse file: dense and sparse runs of the same weights
        return _teal(Setup(model_path, text, ctx_size or None, n_chunks, n_batch, threads, dtype),
                     dense, oracle, compare, ram_budget)
    sparse_file = g.sparse
    if (oracle or compare) and not sparse_file:
        flag = "--oracle" if oracle else "--compare"
        raise PowerInferError(f"{model_path}: a dense GGUF (no predictors, no TEAL thresholds): {flag} needs a "
                              "PowerInfer GGUF (PWRI, from pi-convert MODEL PRED_DIR) or an input-sparse GGUF "
                              "(pi-sparsify); without the flag it is evaluated dense")
    if ram_budget is not None and not sparse_file:  # as pi-run: a budget is not silently ignored
        raise PowerInferError(f"{model_path}: a dense GGUF (no predictors): --ram-budget needs a PowerInfer GGUF "
                              "(PWRI, from pi-convert MODEL PRED_DIR) whose predictors say which FFN rows to read")
    s = Setup(model_path, text, ctx_size or None, n_chunks, n_batch, threads, dtype,
              ram_budget=ram_budget, activation_dir=activation_dir, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    if not compare:
        mode = "oracle" if oracle else "dense" if (dense or not sparse_file) else "predictor"
        res, *_ = _evaluate(s, mode, None)
        if res.active_share is not None:
            sys.stdout.write(f"FFN neurons computed: {100 * res.active_share:.1f}% of n_ff on average\n")
        return
    results: dict[str, PerplexityResult] = {}
    results["dense"], chunks, model, _ = _evaluate(s, "dense", None, header=True)
    del model  # one model in memory at a time
    model, tok = _load(s, "predictor")
    results["predictor"], *_ = _evaluate(s, "predictor", chunks, model, tok, header=True)
    model.oracle_masks()
    results["oracle"], *_ = _evaluate(s, "oracle", chunks, model, tok, header=True)
    sys.stdout.write("\n" + compare_table(results))


def _teal(s: Setup, dense: bool, oracle: bool, compare: bool, ram_budget: float | None) -> None:
    """An input-sparse (TEAL) file: ``teal`` (its thresholds), ``--dense`` (every input, same weights) or
    ``--compare`` (both on the same tokens; the last column is then the share of ``ffn_down``'s inputs kept)."""
    if oracle or ram_budget is not None:
        raise PowerInferError(f"{s.model_path}: an input-sparse (TEAL) file has no predictors: "
                              f"{'--oracle' if oracle else '--ram-budget'} needs a PowerInfer GGUF")
    if not compare:
        res, *_ = _evaluate(s, "dense" if dense else "teal", None)
        if not dense and res.active_share is not None:
            sys.stdout.write(f"ffn_down inputs kept: {100 * res.active_share:.1f}% on average\n")
        return
    results: dict[str, PerplexityResult] = {}
    results["dense"], chunks, model, _ = _evaluate(s, "dense", None, header=True)
    del model
    results["teal"], *_ = _evaluate(s, "teal", chunks, header=True)
    sys.stdout.write("\n" + compare_table(results))


if __name__ == "__main__":
    main()

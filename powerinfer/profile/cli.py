"""``pi-profile``: count FFN neuron activations of a ReLU-family model over calibration text.

Writes ``OUT/activation_{i}.pt`` (int64 ``[n_ff]`` per layer, FORMATS.md section 2) and
``OUT/powerinfer_stats.json``, then prints a per-layer table and draws ``OUT/report.png``
(:mod:`powerinfer.report`; skipped with one line when matplotlib is not installed). See
:mod:`powerinfer.profile.collect` for what is counted.

A SiLU/GELU-gated model (a Hugging Face folder, or a GGUF file through the runtime) has no neurons to
count: it gets the input-magnitude histograms input sparsity is set from instead
(``OUT/input_hist_{i}.pt``, ``OUT/wina_hist_{i}.pt``, ``OUT/input_hist.json``;
:mod:`powerinfer.profile.inputs`), which ``pi-convert MODEL OUT --sparsity S`` and
``pi-sparsify IN OUT --activation OUT`` read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import click

from ..calibrate.options import calibration_options
from ..activation_flag import ffn_activation_option
from ..cli_params import PiCommand, require_data, require_model_folder, version_option
from ..errors import cli_errors

__all__ = ["main", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned plain-text table; floats printed with 3 decimals, None as ``-``."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[k]) for r in cells]) for k, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def profile_table(stats: dict[str, Any]) -> str:
    """The per-layer summary ``pi-profile`` prints (from :func:`activation_stats`)."""
    rows = [(l["layer"], l["sparsity"], l["top10_coverage"], l["top20_coverage"], l["dead_neurons"],
             l["powerlaw_slope"]) for l in stats["layers"]]
    return format_table(("layer", "sparsity", "top10%", "top20%", "dead", "powerlaw_slope"), rows)


@click.command(cls=PiCommand, context_settings=dict(help_option_names=["-h", "--help"]))
@click.argument("model_dir", metavar="MODEL", type=click.Path(path_type=Path))
@click.option("--data", required=True, type=str,
              help="Calibration text: any UTF-8 text file (paragraphs end at blank lines; e.g. WikiText's "
                   ".raw), .json/.jsonl (field --text-field), a folder of those, or hf:NAME[:CONFIG].")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Output folder for activation_{i}.pt (replaced atomically).")
@click.option("--max-tokens", default=65536, show_default=True, type=click.IntRange(min=1),
              help="Stop after this many calibration tokens.")
@click.option("--seq-len", default=None, type=click.IntRange(min=2),
              help="Tokens per packed sequence (BOS + text) [default: 256]; for a SiLU model, tokens per "
                   "calibration chunk [default: 512, as pi-sparsify -c].")
@click.option("--text-field", default="text", show_default=True, help="JSON field holding the text.")
@calibration_options("--forward-batch", "--batch-size")
@ffn_activation_option
@version_option("pi-profile")
@cli_errors
def main(model_dir: Path, data: str, out_dir: Path, max_tokens: int, seq_len: int, text_field: str,
         device: str, dtype: str | None, threads: int | None, forward_batch: int, work_dir: Path | None) -> None:
    """Profile MODEL: a Hugging Face model folder with a ReLU-family FFN, or a SiLU/GELU-gated one (folder
    or GGUF file).

    Counts, per layer, how many calibration tokens activate each FFN neuron, and writes
    the counts PowerInfer's neuron placement reads, with OUT/report.png, the power-law
    picture `pi-report` redraws (needs matplotlib: pip install 'powerinfer[report]';
    without it the picture is skipped with one line). The model is streamed from its
    checkpoint one decoder layer at a time; run it under `torchrun --nproc-per-node N`
    to share the text between processes.

    A mixture-of-experts GGUF (Mixtral, Qwen3-MoE, SmallThinker) gets, per layer, how many calibration tokens
    the router sends to each expert (OUT/expert_counts.json), what `pi-run --ram-budget` keeps experts
    resident by.

    A SiLU/GELU-gated model (Llama 2/3, Qwen2/3, Mistral; a Hugging Face folder, or a GGUF file run by this
    project's runtime, so a llama.cpp GGUF needs no Hugging Face copy) gets, per layer and matrix input, the
    histograms of |x| and of WINA's |x_j| * ||W[:, j]|| instead: what `pi-convert MODEL OUT --sparsity S`
    and `pi-sparsify --activation OUT` set input-sparsity thresholds from (f32, CPU, one process).
    """
    require_data(data)
    if model_dir.is_file():
        _require_gguf_model(model_dir)
        if _is_moe_file(model_dir):
            return _profile_experts(model_dir, data, out_dir, max_tokens, seq_len, text_field, device, dtype, threads)
        return _profile_inputs(model_dir, data, out_dir, max_tokens, seq_len, text_field, device, dtype, threads)
    require_model_folder(model_dir)  # before torch and transformers are imported (seconds)
    from .inputs import is_input_sparse_model

    if is_input_sparse_model(model_dir):
        return _profile_inputs(model_dir, data, out_dir, max_tokens, seq_len, text_field, device, dtype, threads)
    seq_len = seq_len or 256
    from .collect import profile_model_dir

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own tqdm bars say what is going on
    stats = profile_model_dir(model_dir, data, out_dir, max_tokens=max_tokens, seq_len=seq_len,
                              batch_size=forward_batch, text_field=text_field, threads=threads, progress=True,
                              log=lambda msg: click.echo(msg, err=True), device=device, dtype=dtype,
                              work_dir=work_dir)
    if stats is None:  # not rank 0 of a torchrun job
        return
    click.echo(profile_table(stats))
    click.echo(f"{stats['n_tokens']} tokens, mean sparsity {stats['mean_sparsity']:.3f}, "
               f"{stats['seconds']:.2f} s -> {out_dir}")
    from ..report.plot import MISSING_MATPLOTLIB, write_folder_report

    png = write_folder_report(out_dir)
    click.echo(f"power-law report -> {png} (redraw with pi-report)" if png is not None else MISSING_MATPLOTLIB,
               err=True)


def _require_gguf_model(path: Path) -> None:
    """A file given as MODEL must be a GGUF (magic checked before anything heavy is imported)."""
    from ..cli_params import require_gguf
    from ..errors import PowerInferError

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (b"GGUF", b"PWRI"):
        raise PowerInferError(f"{path}: not a folder or a GGUF file (expected a Hugging Face model folder, or the "
                              "GGUF of a SiLU/GELU-gated model)")
    require_gguf(path)


def _is_moe_file(path: Path) -> bool:
    from ..formats.gguf_file import open_gguf
    from ..runtime.moe import is_moe

    return is_moe(open_gguf(str(path)))


def _profile_experts(model: Path, data: str, out_dir: Path, max_tokens: int, seq_len: int | None, text_field: str,
                     device: str, dtype: str | None, threads: int | None) -> None:
    """The routing profile of a mixture-of-experts GGUF (:func:`powerinfer.profile.experts.profile_experts`)."""
    import time

    from ..errors import PowerInferError
    from .experts import DEFAULT_CHUNK, profile_experts, routing_table

    if device != "cpu" or dtype not in (None, "f32"):
        raise PowerInferError("--device/--dtype: the routing of a mixture-of-experts file is counted in f32 on the CPU")
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    counts, n = profile_experts(model, data, out_dir, n_ctx=seq_len or DEFAULT_CHUNK, max_tokens=max_tokens,
                                text_field=text_field)
    click.echo(routing_table(counts))
    click.echo(f"{n} tokens, routing counts of {counts.shape[0]} layers x {counts.shape[1]} experts, "
               f"{time.perf_counter() - t0:.2f} s -> {out_dir / 'expert_counts.json'}")


def _profile_inputs(model: Path, data: str, out_dir: Path, max_tokens: int, seq_len: int | None, text_field: str,
                    device: str, dtype: str | None, threads: int | None) -> None:
    """The input-histogram profile of a SiLU/GELU-gated model (:func:`powerinfer.profile.inputs.profile_inputs`)."""
    import time

    from ..errors import PowerInferError
    from .inputs import DEFAULT_CHUNK, profile_inputs, threshold_table

    if device != "cpu" or dtype not in (None, "f32"):
        raise PowerInferError("--device/--dtype: the input histograms of a SiLU/GELU-gated model are recorded in "
                              "f32 on the CPU")
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cal = profile_inputs(model, data, out_dir, n_ctx=seq_len or DEFAULT_CHUNK, max_tokens=max_tokens,
                         text_field=text_field)
    click.echo(threshold_table(cal))
    click.echo(f"{cal.n_tokens} tokens, input histograms (|x| and WINA) of {cal.hist.shape[0]} layers, "
               f"{time.perf_counter() - t0:.2f} s -> {out_dir}")


if __name__ == "__main__":  # pragma: no cover
    main()

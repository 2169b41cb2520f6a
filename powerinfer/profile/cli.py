"""``pi-profile``: count FFN neuron activations of a ReLU-family model over calibration text.

Writes ``OUT/activation_{i}.pt`` (int64 ``[n_ff]`` per layer, FORMATS.md section 2) and
``OUT/powerinfer_stats.json``, then prints a per-layer table and draws ``OUT/report.png``
(:mod:`powerinfer.report`; skipped with one line when matplotlib is not installed). See
:mod:`powerinfer.profile.collect` for what is counted.
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
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--data", required=True, type=str,
              help="Calibration text: any UTF-8 text file (paragraphs end at blank lines; e.g. WikiText's "
                   ".raw), .json/.jsonl (field --text-field), a folder of those, or hf:NAME[:CONFIG].")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Output folder for activation_{i}.pt (replaced atomically).")
@click.option("--max-tokens", default=65536, show_default=True, type=click.IntRange(min=1),
              help="Stop after this many calibration tokens.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2),
              help="Tokens per packed sequence (BOS + text).")
@click.option("--text-field", default="text", show_default=True, help="JSON field holding the text.")
@calibration_options("--forward-batch", "--batch-size")
@ffn_activation_option
@version_option("pi-profile")
@cli_errors
def main(model_dir: Path, data: str, out_dir: Path, max_tokens: int, seq_len: int, text_field: str,
         device: str, dtype: str | None, threads: int | None, forward_batch: int, work_dir: Path | None) -> None:
    """Profile MODEL_DIR (a Hugging Face model folder with a ReLU-family FFN).

    Counts, per layer, how many calibration tokens activate each FFN neuron, and writes
    the counts PowerInfer's neuron placement reads, with OUT/report.png, the power-law
    picture `pi-report` redraws (needs matplotlib: pip install 'powerinfer[report]';
    without it the picture is skipped with one line). The model is streamed from its
    checkpoint one decoder layer at a time; run it under `torchrun --nproc-per-node N`
    to share the text between processes.
    """
    require_model_folder(model_dir)  # before torch and transformers are imported (seconds)
    require_data(data)
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


if __name__ == "__main__":  # pragma: no cover
    main()

"""``pi-sparsify IN.gguf OUT.gguf --sparsity S --data TEXT``: a dense llama.cpp GGUF -> input-sparse (TEAL) GGUF."""
from __future__ import annotations

import click

from ..cli_params import PiCommand, require_file, require_gguf, version_option
from ..errors import PowerInferError, cli_errors

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def read_text(path: str) -> str:
    """The calibration text of ``path`` (UTF-8); PowerInferError naming it when unreadable."""
    try:
        return open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        raise PowerInferError(f"{path}: cannot read the calibration text ({e.strerror})") from None


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("infile", type=click.Path(dir_okay=False))
@click.argument("outfile", type=click.Path(dir_okay=False))
@click.option("--sparsity", type=float, required=True, help="Model-wide share of matrix inputs zeroed, 0..0.9.")
@click.option("--data", "data", type=click.Path(dir_okay=False), default=None,
              help="Calibration text (at least 256 tokens); its histograms go to --activation when given.")
@click.option("--activation", "act_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder: input_hist_{i}.pt written (with --data) or read (without).")
@click.option("--outtype", type=click.Choice(OUTTYPES, case_sensitive=False), default=None,
              help="Type of the input-major matrices (default: each matrix's own type; K-quants need one).")
@click.option("--method", type=click.Choice(("uniform", "greedy", "wina", "wina-greedy")), default="uniform",
              show_default=True,
              help="Per-input levels: every input at SPARSITY by |x|; TEAL's greedy block-wise allocation (needs "
                   "--data); every input at SPARSITY by WINA's |x_j| * ||W[:, j]||; or wina-greedy, both "
                   "(needs --data).")
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(16, 1 << 16), default=512, show_default=True,
              help="Tokens per calibration chunk.")
@version_option("pi-sparsify")
@cli_errors
def main(infile, outfile, sparsity, data, act_dir, method, outtype, n_ctx):
    """Calibrate INFILE (a dense SiLU/GELU-gated GGUF: Llama, Qwen2/3, Mistral) through the runtime and write
    OUTFILE with per-input thresholds for SPARSITY and the sparsified matrices stored input-major."""
    from .teal import check_sparsity

    check_sparsity(sparsity)  # before anything is read
    require_file(infile)
    text = read_text(data) if data is not None else None
    from .teal import sparsify

    out, thr = sparsify(infile, outfile, sparsity, text, act_dir, outtype.lower() if outtype else None, n_ctx, method)
    click.echo(f"wrote {out} (input-sparse GGUF, target {100 * sparsity:.0f}%, {method}; "
               f"{out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()

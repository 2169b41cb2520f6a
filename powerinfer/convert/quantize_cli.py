"""``pi-quantize IN.gguf OUT.gguf TYPE``: quantize a GGUF or PowerInfer GGUF to Q4_0 or Q8_0."""
from __future__ import annotations

import logging

import click

from ..cli_params import PiCommand, require_file, version_option
from ..errors import PowerInferError, cli_errors
from .type_names import DEFAULT_PREDICTOR_TYPE, PREDICTOR_TYPES, QUANTIZE_TYPES


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("infile", type=click.Path(dir_okay=False))
@click.argument("outfile", type=click.Path(dir_okay=False))
@click.argument("qtype", metavar="TYPE")
@click.option("--predictor-type", type=click.Choice(PREDICTOR_TYPES, case_sensitive=False), default=None,
              help=f"Type of the predictor matrices fc1/fc2 (default {DEFAULT_PREDICTOR_TYPE}).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="A progress bar per tensor.")
@version_option("pi-quantize")
@cli_errors
def main(infile, outfile, qtype, predictor_type, progress):
    """Write INFILE (f32/f16/bf16 GGUF or PowerInfer GGUF) with its 2-D weights in TYPE (q4_0 or q8_0).

    Same magic, metadata (general.file_type updated), tensor names and order; norms and biases
    f32, output.weight Q8_0, rows not a multiple of 32 f16, quantized tensors copied as they are.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    if qtype.lower() not in QUANTIZE_TYPES:
        raise PowerInferError(f"TYPE {qtype!r} is not supported; supported: {', '.join(QUANTIZE_TYPES)}")
    require_file(infile)
    from .quantize import quantize_file  # numpy and gguf: imported to run, not for --help

    res = quantize_file(infile, outfile, qtype, predictor_type.lower() if predictor_type else None, progress)
    click.echo(res.summary)


if __name__ == "__main__":
    main()

"""``pi-convert``: Hugging Face model (+ predictors) -> GGUF / PowerInfer GGUF."""
from __future__ import annotations

import logging
from pathlib import Path

import click

from ..errors import PowerInferError, cli_errors
from ..families import hf_dims, read_hf_config
from ..formats.activation import load_activation_dir
from .gpu_index import ensure_gpu_index
from .writer import OUTTYPES, convert


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("pred_dir", required=False, type=click.Path(file_okay=False))
@click.option("--outfile", required=True, type=click.Path(dir_okay=False),
              help="Output file (*.powerinfer.gguf with predictors, *.gguf without).")
@click.option("--outtype", type=click.Choice(sorted(OUTTYPES)), default="f16", show_default=True,
              help="2-D weight dtype (1-D tensors are always f32).")
@click.option("--sparse-threshold", type=float, default=None,
              help="Predictor logit threshold (default: the predictor folder's config.json, else 0.0).")
@click.option("--vram-budget", type=float, default=None,
              help="GiB of GPU memory: also write <outfile>.generated.gpuidx placing the hottest neurons.")
@click.option("--activation", "activation_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder for the placement (default: MODEL_DIR/activation).")
@cli_errors
def main(model_dir, pred_dir, outfile, outtype, sparse_threshold, vram_budget, activation_dir):
    """Write MODEL_DIR as a PowerInfer GGUF with the predictors in PRED_DIR, or a dense GGUF without."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    act_dir = Path(activation_dir) if activation_dir else Path(model_dir) / "activation"
    if vram_budget is not None:  # check the placement inputs before writing anything
        if vram_budget < 0:
            raise PowerInferError(f"--vram-budget {vram_budget}: must be >= 0 GiB")
        if activation_dir is not None or act_dir.is_dir():
            dims = hf_dims(read_hf_config(model_dir))
            load_activation_dir(act_dir, n_layer=dims["n_layer"], n_ff=dims["n_ff"])
    out = convert(model_dir, outfile, pred_dir, outtype, sparse_threshold)
    kind = "PowerInfer GGUF (PWRI, sparse)" if pred_dir else "dense GGUF"
    click.echo(f"wrote {out} ({kind}, {out.stat().st_size / 1e6:.2f} MB)")
    if vram_budget is not None:
        plan = ensure_gpu_index(out, vram_budget, act_dir, reset=True)
        if plan is not None:
            click.echo(f"wrote {plan.path}: {plan.summary}")


if __name__ == "__main__":
    main()

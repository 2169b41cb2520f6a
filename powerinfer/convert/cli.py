"""``pi-convert``: Hugging Face model (+ predictors) -> GGUF / PowerInfer GGUF."""
from __future__ import annotations

import logging
from pathlib import Path

import click

from ..activation_flag import ffn_activation_option
from ..cli_params import PiCommand, FiniteFloat, require_folder, require_model_folder, version_option
from ..errors import PowerInferError, cli_errors
from .type_names import DEFAULT_PREDICTOR_TYPE, OUTTYPES, PREDICTOR_TYPES

from ..limits import MAX_BUDGET_GIB, MAX_THRESHOLD


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("pred_dir", required=False, type=click.Path(file_okay=False))
@click.option("--outfile", required=True, type=click.Path(dir_okay=False),
              help="Output file (*.powerinfer.gguf with predictors, *.gguf without).")
@click.option("--outtype", type=click.Choice(OUTTYPES, case_sensitive=False), default="f16", show_default=True,
              help="2-D weight type (1-D tensors are always f32). bf16: not for upstream PowerInfer. q4_0/q8_0: "
                   "ggml's reference quantizers; output.weight then Q8_0, rows not a multiple of 32 stay f16.")
@click.option("--predictor-type", type=click.Choice(PREDICTOR_TYPES, case_sensitive=False), default=None,
              help=f"Type of the predictor matrices fc1/fc2 (default: the outtype for f16/bf16/f32, "
                   f"{DEFAULT_PREDICTOR_TYPE} for quantized files).")
@click.option("--sparse-threshold", type=FiniteFloat(-MAX_THRESHOLD, MAX_THRESHOLD), default=None,
              help="Predictor logit threshold (default: the predictor folder's config.json, else 0.0).")
@click.option("--vram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None,
              help="GiB of GPU memory: also write <outfile>.generated.gpuidx placing the hottest neurons.")
@click.option("--activation", "activation_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder for the placement (default: MODEL_DIR/activation).")
@click.option("--dense", "dense", is_flag=True,
              help="Write a dense GGUF even when the checkpoint carries its own predictors (TurboSparse-Mistral's "
                   "mlp.predictor.fc1/fc2, which are otherwise written and make the file sparse).")
@click.option("--for-pi-run", "for_pi_run", is_flag=True,
              help="The file is for pi-run only: no warnings about what upstream PowerInfer or llama.cpp would make "
                   "of it (n_ff <= 1000, f32/Q8_0 ffn_down_t, a dense ReLU llama file). Without it those are warned.")
@click.option("--sparsity", type=float, default=None,
              help="Write an input-sparse (TEAL) GGUF for this model-wide sparsity (0..0.9) of a SiLU-gated model; "
                   "the second argument is then the activation folder of its input histograms (or give --data).")
@click.option("--data", "data", type=click.Path(dir_okay=False), default=None,
              help="With --sparsity: calibrate on this text in the same run (histograms saved to the activation "
                   "folder when one is given).")
@click.option("--method", type=click.Choice(("uniform", "greedy", "wina", "wina-greedy")), default="uniform",
              show_default=True,
              help="With --sparsity: every input at S by |x|, TEAL's greedy block-wise allocation (needs --data), or "
                   "every input at S by WINA's |x_j| * ||W[:, j]||, or wina-greedy: both (needs --data).")
@ffn_activation_option
@version_option("pi-convert")
@cli_errors
def main(model_dir, pred_dir, outfile, outtype, predictor_type, sparse_threshold, vram_budget, activation_dir,
         dense, for_pi_run, sparsity, data, method):
    """Write MODEL_DIR as a PowerInfer GGUF with the predictors in PRED_DIR, or a dense GGUF without.

    A checkpoint that carries its own predictors (TurboSparse-Mistral) needs no PRED_DIR: they
    are written as published, unless --dense."""
    if sparsity is not None:
        from .teal import check_sparsity

        check_sparsity(sparsity)
    elif data is not None:
        raise PowerInferError("--data calibrates input sparsity: give --sparsity S with it")
    require_model_folder(model_dir)  # before torch and transformers are imported (seconds)
    if sparsity is not None:
        return _convert_teal(model_dir, pred_dir, outfile, outtype.lower(), sparsity, data, method)
    if pred_dir is not None and dense:
        raise PowerInferError("--dense writes no predictors: give PRED_DIR or --dense, not both")
    if pred_dir is not None:
        require_folder(pred_dir, "predictor")
    if activation_dir is not None:
        require_folder(activation_dir, "activation")
    from ..formats.activation import load_activation_dir  # torch, transformers: imported to run, not for --help
    from .gpu_index import check_budget, dense_bytes, ensure_gpu_index
    from .writer import convert

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    act_dir = Path(activation_dir) if activation_dir else Path(model_dir) / "activation"
    if vram_budget is not None:
        _refuse_placement_of_experts(model_dir)
    if vram_budget is not None and pred_dir is None and not dense and not act_dir.is_dir():
        _refuse_placement_without_counts(model_dir, act_dir)
    before_write = None
    if vram_budget is not None:  # check the placement inputs and the budget before writing anything
        def before_write(tensors, dims):
            dense = dense_bytes(tensors, dims["n_layer"], dims["n_embd"], dims["n_head"], dims["n_head_kv"],
                                dims["n_ctx"])
            check_budget(vram_budget, dense, dims["n_ctx"], outfile)
            if activation_dir is not None or act_dir.is_dir():
                load_activation_dir(act_dir, n_layer=dims["n_layer"], n_ff=dims["n_ff"])
    out = convert(model_dir, outfile, pred_dir, outtype.lower(), sparse_threshold,
                  predictor_type=predictor_type.lower() if predictor_type else None, before_write=before_write,
                  upstream_warnings=not for_pi_run, own_predictors=not dense)
    from ..formats.gguf_file import PWRI_BYTES, read_magic

    kind = "dense GGUF" if read_magic(out) != PWRI_BYTES else "PowerInfer GGUF (PWRI, sparse)" if pred_dir \
        else "PowerInfer GGUF (PWRI, sparse; the checkpoint's own predictors)"
    click.echo(f"wrote {out} ({kind}, {out.stat().st_size / 1e6:.2f} MB)")
    if vram_budget is not None:
        plan = ensure_gpu_index(out, vram_budget, act_dir, reset=True)
        if plan is not None:
            click.echo(f"wrote {plan.path}: {plan.summary}")


def _refuse_placement_of_experts(model_dir: str) -> None:
    """``--vram-budget`` places the hot neurons of one FFN per layer; a mixture-of-experts checkpoint has
    no such counts (pi-profile refuses it): PowerInferError naming its config.json before anything is written."""
    from ..hf import resolve_model

    family = resolve_model(model_dir)[0]
    if family.experts:
        raise PowerInferError(f"{Path(model_dir) / 'config.json'}: --vram-budget does not place mixture-of-experts "
                              f"models ({family.name}) yet: convert without it")


def _refuse_placement_without_counts(model_dir: str, act_dir: Path) -> None:
    """``--vram-budget`` for a checkpoint with its own predictors needs neuron frequencies, which no
    predictor training left behind: refused (PowerInferError) before anything is written, naming
    the step that gives them (pi-profile counts each neuron's real dReLU firing on calibration text)."""
    from ..hf import resolve_model
    from .own_predictors import has_own_predictors

    if has_own_predictors(model_dir, resolve_model(model_dir)[0]):
        raise PowerInferError(
            f"{act_dir}: no activation folder, and --vram-budget places the hottest neurons by how often each "
            f"fires; this checkpoint carries its own predictors, so nothing has counted that yet: run pi-profile "
            f"{model_dir} --data TEXT --out ACT_DIR, then pass --activation ACT_DIR")


def _convert_teal(model_dir: str, act_dir: str | None, outfile: str, outtype: str, sparsity: float,
                  data: str | None, method: str = "uniform") -> None:
    """``--sparsity``: MODEL_DIR -> a temporary dense GGUF (``outtype``) -> calibrated (``data``) or read
    (``act_dir``) histograms -> the TEAL file at ``outfile``; the temporary file is removed."""
    import tempfile

    from .outfile import check_outfile
    from .teal import sparsify
    from .teal_cli import read_text
    from .writer import convert

    if data is None and act_dir is None:
        raise PowerInferError("--sparsity needs the input histograms: an activation folder (second argument) "
                              "or --data TEXT")
    from ..profile.inputs import check_hf_family, check_hf_text

    check_hf_family(Path(model_dir))  # a model input sparsity cannot run, or too short a text: refused before
    text = read_text(data) if data is not None else None  # converting
    if text is not None:
        check_hf_text(model_dir, text)
    check_outfile(outfile, [model_dir])
    with tempfile.TemporaryDirectory(prefix="pi-teal-", dir=Path(outfile).resolve().parent) as tmp:
        dense = convert(model_dir, Path(tmp) / "dense.gguf", None, outtype, None, upstream_warnings=False,
                        own_predictors=False)
        out, _ = sparsify(dense, outfile, sparsity, text, act_dir, None, method=method)
    click.echo(f"wrote {out} (input-sparse GGUF, target {100 * sparsity:.0f}%, {method}; "
               f"{out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()

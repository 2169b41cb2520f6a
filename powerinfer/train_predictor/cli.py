"""``pi-train-predictor``: train the per-layer activation predictors of a ReLU-family model.

Collects (predictor input, active mask) pairs from calibration text, sizes each layer's
predictor (by default the narrowest width reaching a target held-out recall, within the
parameter budget: :mod:`powerinfer.train_predictor.search`), trains ``fc2(relu(fc1 x))``
per layer with the Deja Vu loss and writes ``PRED_DIR/model_{i}.pt`` + ``config.json``
(FORMATS.md section 3). Details: :mod:`powerinfer.train_predictor.train`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..calibrate.options import calibration_options
from ..activation_flag import ffn_activation_option
from ..errors import cli_errors
from ..profile.cli import format_table
from ..cli_params import PiCommand, FiniteFloat, require_data, require_model_folder, version_option
from ..limits import MAX_THRESHOLD
from .defaults import DEFAULT_TARGET_RECALL

__all__ = ["main", "predictor_table"]


def predictor_table(config: dict[str, Any]) -> str:
    """The per-layer summary ``pi-train-predictor`` prints (from the written config.json)."""
    searched = all("stop" in l for l in config["layers"])
    rows = [(l["layer"], l["hidden"], l["sparsity"], l["recall"], l["precision"], l["pred_active"],
             l["true_active"], f"{l['best_epoch']}/{l['epochs']}", f"{l['train_seconds']:.1f}")
            + ((l["cap"], "/".join(str(p["hidden"]) for p in l["probes"]), l["stop"]) if searched else ())
            for l in config["layers"]]
    return format_table(("layer", "H", "sparsity", "recall", "precision", "pred_active", "true_active",
                         "epoch", "seconds") + (("cap", "widths tried", "stop") if searched else ()), rows)


@click.command(cls=PiCommand, context_settings=dict(help_option_names=["-h", "--help"]))
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--data", required=True, type=str,
              help="Calibration text: any UTF-8 text file (paragraphs end at blank lines; e.g. WikiText's "
                   ".raw), .json/.jsonl (field --text-field), a folder of those, or hf:NAME[:CONFIG]. The last "
                   "--heldout-frac of it is held out.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Predictor folder to write (model_{i}.pt + config.json, replaced atomically).")
@click.option("--max-tokens", default=65536, show_default=True, type=click.IntRange(min=2),
              help="Training tokens to collect.")
@click.option("--heldout-tokens", default=None, type=click.IntRange(min=2),
              help="Held-out tokens to collect [default: max-tokens / 4].")
@click.option("--heldout-frac", default=0.1, show_default=True, type=FiniteFloat(0, 1, lo_open=True, hi_open=True),
              help="Share of the documents (the last ones; of the tokens for texts under 20 documents) held "
                   "out for early stopping and metrics.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2),
              help="Tokens per packed sequence.")
@click.option("--epochs", default=20, show_default=True, type=click.IntRange(min=1), help="Maximum epochs per layer.")
@click.option("--patience", default=3, show_default=True, type=click.IntRange(min=1),
              help="Stop a layer after this many epochs without a better held-out score.")
@click.option("--batch-size", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Tokens per training step.")
@click.option("--lr", default=None, type=FiniteFloat(0, 10, lo_open=True),
              help="Peak AdamW learning rate [default: min(1e-2, 0.08/sqrt(n_embd))], cosine-decayed.")
@click.option("--target-recall", default=None, type=FiniteFloat(0, 1),
              help=f"Per layer, the narrowest predictor whose held-out recall (at --threshold) reaches this, "
                   f"searched over widths step, 2 step, 4 step, ... up to the budget rule's width, then bisected; "
                   f"a width that stops improving recall, or the cap, ends the search (config.json records why); "
                   f"training takes ~2.5x as long as at fixed widths (demo model). "
                   f"0: no search, the budget rule's widths. [default: {DEFAULT_TARGET_RECALL}, from "
                   f"benchmarks/bench_target_recall.py on the demo model (pi-perplexity --compare on held-out "
                   f"TinyStories): 0.99 costs +0.08% perplexity computing 15.9% of FFN neurons; 0.95 gives 31% "
                   f"fewer predictor parameters but +1.5% at 19.0% computed (narrower predictors mark more "
                   f"neurons active); 0.995 gives +0.18% at 15.8%. README: 'Predictor width from a target "
                   f"recall']")
@click.option("--budget", default=None, type=FiniteFloat(0, 1, lo_open=True),
              help="Predictor parameters as a share of the model's [default: 0.09]: caps each layer's width "
                   "(widths follow sparsity), or sets it with --target-recall 0.")
@click.option("--hidden", default=None, type=click.IntRange(min=1),
              help="Use this width for every layer (no search, no budget rule).")
@click.option("--threshold", default=0.0, show_default=True, type=FiniteFloat(-MAX_THRESHOLD, MAX_THRESHOLD),
              help="sparse_threshold: a neuron is predicted active when its logit >= this.")
@click.option("--text-field", default="text", show_default=True, help="JSON field holding the text.")
@click.option("--activation-out", default=None, type=click.Path(path_type=Path),
              help="Also write pi-profile's activation folder from the same pass (counts over both splits), "
                   "so a large model is read from disk once.")
@calibration_options("--forward-batch")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for initialisation and shuffling.")
@ffn_activation_option
@version_option("pi-train-predictor")
@cli_errors
def main(model_dir: Path, data: str, out_dir: Path, max_tokens: int, heldout_tokens: int | None,
         heldout_frac: float, seq_len: int, epochs: int, patience: int, batch_size: int, lr: float | None,
         target_recall: float | None, budget: float | None, hidden: int | None, threshold: float, text_field: str,
         activation_out: Path | None, device: str, dtype: str | None, threads: int | None, forward_batch: int, work_dir: Path | None,
         seed: int) -> None:
    """Train activation predictors for MODEL_DIR (a Hugging Face model folder with a ReLU-family FFN).

    The model is streamed from its checkpoint one decoder layer at a time. Re-running
    with the same arguments reuses the collected data, resumes a killed pass at its layer
    and skips finished predictors. Under `torchrun --nproc-per-node N` the processes share
    the calibration text, then the layers' training.
    """
    if hidden is not None and target_recall:
        raise click.UsageError("--hidden and --target-recall choose the width in different ways; give one")
    require_model_folder(model_dir)  # before torch and transformers are imported (seconds)
    require_data(data)
    from .stage import train_predictor_dir
    from .train import TrainSettings
    if target_recall is None:
        target_recall = None if hidden is not None else DEFAULT_TARGET_RECALL
    elif target_recall == 0:
        target_recall = None

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own tqdm bars say what is going on
    settings = TrainSettings(epochs=epochs, batch_size=batch_size, lr=lr, patience=patience,
                             threshold=threshold, seed=seed)
    cfg = train_predictor_dir(model_dir, data, out_dir, work_dir=work_dir, max_tokens=max_tokens,
                              heldout_tokens=heldout_tokens, heldout_frac=heldout_frac, seq_len=seq_len,
                              text_field=text_field, budget=budget, hidden=hidden,
                              target_recall=target_recall, settings=settings,
                              threads=threads, progress=True, log=lambda msg: click.echo(msg, err=True),
                              device=device, dtype=dtype, collect_batch_size=forward_batch,
                              activation_out=activation_out)
    if cfg is None:  # not rank 0 of a torchrun job
        return
    click.echo(predictor_table(cfg))
    click.echo(f"{cfg['n_tokens']['train']} training / {cfg['n_tokens']['heldout']} held-out tokens; predictors "
               f"{cfg['predictor_params']} parameters ({cfg['predictor_share']:.1%} of the model); "
               f"collect {cfg['seconds']['collect']:.1f} s, train {cfg['seconds']['train']:.1f} s -> {out_dir}")


if __name__ == "__main__":  # pragma: no cover
    main()

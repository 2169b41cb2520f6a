"""``python -m powerinfer``: the neuron placement solver upstream's engine calls.

Upstream llama.cpp (``llm_load_gpu_split_with_budget``) regenerates a missing
``<model>.generated.gpuidx`` by running::

    python3 -m powerinfer --activation <model dir>/activation --layer N_LAYER \\
        --neuron N_FF --capacity NEURONS --vram-capacity BYTES --output <model>.generated.gpuidx

This command accepts the same flags with the same meaning as upstream's
``powerinfer-py/powerinfer/__main__.py`` (``--capacity`` in neurons, ``--vram-capacity``
in bytes and stored as ``split.vram_capacity``, ``--batch`` the chunk size in neurons,
``--threshold`` the per-layer minimum in neurons, default 0) and writes the same file,
solved with :mod:`powerinfer.convert.placement` (exact; no cvxopt/GLPK).

Differences from upstream, all deliberate: ``--batch`` defaults to 64 neurons, the paper's chunk
and the one ``pi-convert``/``pi-run --vram-budget`` solve with (upstream's script: 256; pass
``--batch 256`` for its chunks); ``--layer`` and ``--neuron`` default to what
the activation folder holds (upstream's defaults 59 and 32768 are one model's), and are
checked against it when given; ``--capacity`` and ``--vram-capacity`` are required (upstream
crashes without the latter); ``n_ff`` need not be a multiple of ``--batch``; layers are
read by file number (upstream's exporter sorts names as strings); ``--threshold`` is honoured
as "at least T neurons" (upstream truncates it to whole chunks); neurons a capacity leaves
unplaced (whole chunks only) are explained in the output. Our own options:
``--model`` (the model file, to stamp its identity into the index; by default the output
path minus ``.generated.gpuidx`` when that file exists), ``--min-share`` and
``--time-limit``. Errors print one line naming the path and exit 1; no output file is left.
"""
from __future__ import annotations

from pathlib import Path

import click

from .cli_params import PiCommand, FiniteFloat, require_folder, version_option
from .errors import PowerInferError, cli_errors

DEFAULT_CHUNK = 64  # = convert.gpu_index.ensure_gpu_index's chunk (checked by a test), the paper's


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--activation", required=True, type=str, help="Folder holding activation_{i}.pt (one per layer).")
@click.option("--neuron", type=int, default=None, help="FFN neurons per layer (n_ff); default: from the files.")
@click.option("--capacity", type=int, required=True, help="Neurons the GPU may hold, all layers together.")
@click.option("--layer", type=int, default=None, help="Number of layers; default: from the files.")
@click.option("--vram-capacity", "vram_capacity", type=int, required=True,
              help="VRAM budget in bytes, stored in the index as split.vram_capacity.")
@click.option("--batch", type=int, default=DEFAULT_CHUNK, show_default=True,
              help="Chunk size in neurons: a layer's hottest neurons go to the GPU in whole chunks (the paper's and "
                   "pi-convert's 64; upstream's script defaults to 256).")
@click.option("--threshold", type=int, default=0, show_default=True,
              help="Per-layer minimum: a layer holds 0 or at least this many neurons on the GPU.")
@click.option("--output", required=True, type=str, help="Index file to write (<model>.generated.gpuidx).")
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None,
              help="Model file whose identity is stored in the index (ours; default: output minus .generated.gpuidx).")
@click.option("--min-share", type=FiniteFloat(0, 1), default=0.0, show_default=True,
              help="Per-layer minimum as a share of n_ff (ours; combined with --threshold).")
@click.option("--time-limit", type=FiniteFloat(0, 86400, lo_open=True), default=30.0, show_default=True, help="Seconds for the MILP solver (ours).")
@version_option("python -m powerinfer")
@cli_errors
def main(activation: str, neuron: int | None, capacity: int, layer: int | None, vram_capacity: int, batch: int,
         threshold: int, output: str, model: str | None, min_share: float, time_limit: float) -> None:
    """Place FFN neurons on the GPU and write a PowerInfer GPU index (.gpuidx)."""
    out = Path(output)
    for name, v in (("--layer", layer), ("--neuron", neuron), ("--batch", batch)):
        if v is not None and v <= 0:
            raise PowerInferError(f"{out}: {name} {v} must be positive")
    for name, v in (("--capacity", capacity), ("--vram-capacity", vram_capacity), ("--threshold", threshold)):
        if v < 0:
            raise PowerInferError(f"{out}: {name} {v} must not be negative")
    require_folder(activation, "activation")  # before numpy and the solver are imported
    from .convert.placement import solve_placement
    from .formats.activation import load_activation_dir
    from .formats.gpuidx import INDEX_SUFFIX, model_identity, write_gpu_index

    counts = load_activation_dir(activation, n_layer=layer, n_ff=neuron)
    if model is None and out.name.endswith(INDEX_SUFFIX):
        guess = out.with_name(out.name[: -len(INDEX_SUFFIX)])
        model = str(guess) if guess.is_file() else None
    model_id = model_identity(model) if model is not None else None
    p = solve_placement(counts, capacity, chunk=batch, min_share=min_share, min_neurons=threshold,
                        time_limit=time_limit)
    write_gpu_index(out, p, vram_capacity, model_id=model_id)
    click.echo(f"solved: {p.summary()}")
    click.echo(f"per-layer GPU neurons: {p.n_gpu}")
    why = unplaced_note(p.n_ff, p.used, capacity, batch, threshold)
    if why:
        click.echo(why)
    click.echo(f"Exported to {out}")


def unplaced_note(n_ff: list[int], used: int, capacity: int, batch: int, threshold: int) -> str:
    """Why a capacity that could hold more neurons holds only ``used`` (empty when nothing is
    unexplained): placement goes in whole chunks, hottest first within each layer."""
    total = sum(n_ff)
    if used >= min(capacity, total):
        return ""
    first = min(min(batch, n) for n in n_ff)  # the smallest chunk a layer can start with
    first = max(first, min(threshold, min(n_ff)))  # a per-layer minimum raises it
    if used == 0:
        need = f"--threshold {threshold}" if threshold > min(batch, min(n_ff)) else f"--batch {batch}"
        return (f"note: no neuron placed: --capacity {capacity} is less than the smallest first chunk of a layer "
                f"({first} neurons with {need}); lower --batch or raise --capacity")
    return (f"note: {capacity - used} of the --capacity {capacity} neurons left unused: neurons are placed in whole "
            f"chunks of --batch {batch} (a layer's last chunk may be smaller), hottest first, and no further chunk fits")


if __name__ == "__main__":
    main()

"""The demo's last stage: sparse against dense where the FFN is most of the work.

``python -m powerinfer.speed_demo [OUT]`` (``recipes/demo.sh`` runs it into ``out/demo/speed``):

1. builds, once, a ReLU Llama of Llama-2-7B width (n_embd 4096, n_ff 11008, 32 heads) cut to
   2 layers, with the demo model's 512-token vocabulary and *designed* predictors (about 10%
   of the FFN neurons predicted active per token, hottest 10% carrying ~54%:
   :mod:`powerinfer.synthetic`), written as Q4_0 files by ``pi-convert``'s writer: a PWRI file
   and a dense GGUF (~0.25 GB each). The Hugging Face folder and predictor folder it is made
   from (~0.9 GB) are deleted once the files are written; a rerun reuses the files;
2. loads both and decodes the same greedy tokens with each, interleaved (sparse, dense, dense,
   sparse, ...) for ``--rounds`` rounds on ``--threads`` threads, and prints each one's
   median tokens/s, the share of FFN neurons the sparse run computed, and the ratio.

The weights are random, so the text is noise and is not printed: this stage is about speed.
At this width the FFN is two thirds of a layer's weights and each token reads every weight it
uses once, so computing ~10% of the neurons reads about half the bytes per token; in the
bundled stories model (n_embd 64, n_ff 172) the FFN is a small part of each token's time (about
a fifth, dense: attention, norms and Python take the rest), so skipping most neurons saves at
most that share and sparse and dense run at about the same speed there.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click

from .cli_params import PiCommand, check_threads, version_option
from .errors import cli_errors

SPARSE_NAME, DENSE_NAME, STAMP = "speed.powerinfer.gguf", "speed.gguf", "speed.json"
OUTTYPE = "q4_0"  # the faster type of both engines on AVX2 CPUs (benchmarks/README.md)
PROMPT = "Once upon a time"


def demo_shape():
    from .synthetic import Shape

    return Shape(n_layer=2, n_vocab=512, n_ctx=1024)


def build(out: Path, log) -> dict:
    """The two files under ``out``, built unless a previous run's match ``demo_shape()``."""
    from transformers.utils import logging as hf_logging

    from . import DEMO_CALIBRATION, DEMO_MODEL
    from .synthetic import build_designed_model

    hf_logging.disable_progress_bar()  # the stage's own lines say what is going on
    hf_logging.set_verbosity_error()

    shape = demo_shape()
    stamp = out / STAMP
    want = json.loads(json.dumps({**asdict(shape), "outtype": OUTTYPE}))  # as the stamp holds it (tuples: lists)
    if stamp.is_file() and (out / SPARSE_NAME).is_file() and (out / DENSE_NAME).is_file():
        try:
            info = json.loads(stamp.read_text())
        except (OSError, ValueError):
            info = {}
        if all(info.get(k) == v for k, v in want.items()):
            log(f"{out}: the 7B-width model from an earlier run, reused")
            return info
    stamp.unlink(missing_ok=True)  # written last: a killed build is redone
    info = build_designed_model(out, shape, DEMO_MODEL, DEMO_CALIBRATION.read_text(encoding="utf-8"),
                                sparse_name=SPARSE_NAME, dense_name=DENSE_NAME, outtype=OUTTYPE,
                                upstream_warnings=False, log=log)
    for d in ("hf", "predictor"):  # ~0.9 GB the files are made from; the files are what the demo runs
        shutil.rmtree(out / d, ignore_errors=True)
    stamp.write_text(json.dumps(info, indent=2) + "\n")
    log(f"built in {info['seconds']:.0f} s")
    return info


def measure(out: Path, n_predict: int, rounds: int, threads: int, log) -> dict:
    """Median decode tokens/s of the sparse and the dense file over interleaved rounds."""
    import torch

    from .runtime.generate import SamplerSettings, generate
    from .runtime.loading import load_model

    torch.set_num_threads(threads)
    sparse, tok = load_model(str(out / SPARSE_NAME), "auto", dense=False, n_ctx=256)
    dense, _ = load_model(str(out / DENSE_NAME), "auto", dense=True, n_ctx=256)
    ids = tok.encode(PROMPT)
    greedy = SamplerSettings(temp=0.0)
    generate(sparse, ids, 4, greedy)  # kernels built and weights paged in before any timing
    generate(dense, ids, 4, greedy)
    tps: dict[str, list[float]] = {"sparse": [], "dense": []}
    shares: list[float] = []
    for r in range(rounds):
        order = (("sparse", sparse), ("dense", dense)) if r % 2 == 0 else (("dense", dense), ("sparse", sparse))
        for name, model in order:
            st = generate(model, ids, n_predict, greedy)
            tps[name].append(st.gen_tps or 0.0)
            if name == "sparse" and st.decode_active_share is not None:
                shares.append(st.decode_active_share)
        log(f"round {r + 1}/{rounds}: sparse {tps['sparse'][-1]:.1f} tok/s, dense {tps['dense'][-1]:.1f} tok/s")
    s, d = statistics.median(tps["sparse"]), statistics.median(tps["dense"])
    return {"sparse_tps": s, "dense_tps": d, "ratio": s / d if d > 0 else None,
            "share_computed": statistics.mean(shares) if shares else None, "rounds": rounds,
            "n_predict": n_predict, "threads": threads}


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", default="out/demo/speed", type=click.Path(file_okay=False, path_type=Path))
@click.option("-n", "--n-predict", default=64, show_default=True, type=click.IntRange(8, 400),
              help="Greedy tokens decoded per run.")
@click.option("--rounds", default=4, show_default=True, type=click.IntRange(1, 50),
              help="Interleaved rounds (sparse and dense once each, the order alternating).")
@click.option("-t", "--threads", default=1, show_default=True, help="CPU threads (as the demo's pi-run -t 1).")
@version_option("python -m powerinfer.speed_demo")
@cli_errors
def main(out: Path, n_predict: int, rounds: int, threads: int) -> None:
    """Sparse against dense decoding on a 7B-width model (2 layers, designed predictors, Q4_0)."""
    check_threads(threads)
    if threads == 0:
        threads = 1
    t0 = time.time()

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    out.mkdir(parents=True, exist_ok=True)
    info = build(out, log)
    res = measure(out, n_predict, rounds, threads, log)
    (out / "speed_result.json").write_text(json.dumps(res, indent=2) + "\n")
    share = res["share_computed"]
    click.echo(f"7B-width model ({info['n_layer']} layers, n_embd {info['n_embd']}, n_ff {info['n_ff']}, "
               f"{OUTTYPE.upper()}, {threads} thread{'s' if threads > 1 else ''}), {n_predict} greedy tokens, "
               f"median of {rounds} interleaved rounds:")
    click.echo(f"  sparse: {res['sparse_tps']:.1f} tok/s, computing "
               f"{'?' if share is None else f'{100 * share:.1f}%'} of the FFN neurons per token")
    click.echo(f"  dense:  {res['dense_tps']:.1f} tok/s, computing 100%")
    if res["ratio"] is not None:
        click.echo(f"  sparse is {res['ratio']:.1f}x dense")
    click.echo("Why the stories model above gains little: at n_embd 64 its FFN (172 neurons) is a small part of "
               "each token's time (about a fifth, dense), so skipping most neurons saves at most that; at 7B width "
               "the FFN is two thirds of the weights each token reads, so skipping most of it pays.")
    log(f"({time.time() - t0:.0f} s; results in {out / 'speed_result.json'})")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

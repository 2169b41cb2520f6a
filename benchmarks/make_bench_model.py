"""Build the decode benchmark model: a Llama-2-7B-shaped ReLU model with designed predictors.

Writes, under OUT (default ``out/bench/``; never committed), with
:func:`powerinfer.synthetic.build_designed_model` (its docstring describes the predictor
design): ``hf/`` (random f16 weights + the Llama-2 SentencePiece tokenizer, vocab 32000,
from ``tests/data/tokenizers/llama2``; predictors designed on ``tests/data/text/tinystories_sample.txt``),
``predictor/`` (about ``--active`` of the FFN neurons predicted active per token, the hottest
10% carrying ``--top10`` of the activations), ``activation/``, ``bench.powerinfer.gguf`` (PWRI,
f16) and ``bench.gguf`` (dense f16 for llama.cpp), and ``bench.json``.

Default size is the 7B shape cut to 4 layers (~1.9 GB per f16 file);
``--tiny`` (or ``--n-layer/--n-embd/...``) makes a small one for smoke runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from powerinfer.synthetic import Shape, build_designed_model  # noqa: E402

DATA = ROOT / "tests" / "data"  # bundled with the repository: sources, licences, sha256 in its README.md
TOKENIZER = DATA / "tokenizers" / "llama2"
TEXT = DATA / "text" / "tinystories_sample.txt"

def main(argv: list[str] | None = None) -> None:
    d = Shape()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out/bench", help="output folder (default out/bench)")
    ap.add_argument("--n-layer", type=int, default=d.n_layer)
    ap.add_argument("--n-embd", type=int, default=d.n_embd)
    ap.add_argument("--n-ff", type=int, default=d.n_ff)
    ap.add_argument("--n-head", type=int, default=d.n_head)
    ap.add_argument("--n-vocab", type=int, default=d.n_vocab)
    ap.add_argument("--n-ctx", type=int, default=d.n_ctx)
    ap.add_argument("--hidden", type=int, default=d.hidden, help="predictor hidden size H")
    ap.add_argument("--active", type=float, default=d.active, help="target predicted-active share per token")
    ap.add_argument("--top10", type=float, default=d.top10, help="share of activations on the hottest 10%% of neurons")
    ap.add_argument("--calib-tokens", type=int, default=d.calib_tokens)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--tiny", action="store_true", help="2 layers, 256/688 dims, 128 hidden: a smoke-run model")
    ap.add_argument("--force", action="store_true", help="rebuild the HF folder too")
    a = ap.parse_args(argv)
    if a.tiny:
        a.n_layer, a.n_embd, a.n_ff, a.n_head, a.hidden = 2, 256, 688, 4, 128
    out = Path(a.out)
    if a.force and (out / "hf").exists():
        shutil.rmtree(out / "hf")
    shape = Shape(a.n_layer, a.n_embd, a.n_ff, a.n_head, a.n_vocab, a.n_ctx, a.hidden, a.active, a.top10,
                  a.calib_tokens, a.seed)
    info = build_designed_model(out, shape, TOKENIZER, TEXT.read_text(), sparse_name="bench.powerinfer.gguf",
                                dense_name="bench.gguf", outtype="f16")
    (out / "bench.json").write_text(json.dumps({
        "n_layer": a.n_layer, "n_embd": a.n_embd, "n_ff": a.n_ff, "n_head": a.n_head, "n_vocab": a.n_vocab,
        "hidden": a.hidden, "alpha": info["alpha"], "predicted_active_share": info["predicted_active_share"]},
        indent=2) + "\n")


if __name__ == "__main__":
    main()

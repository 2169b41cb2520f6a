"""pi-perplexity against llama.cpp (llama-cpp-python) on the same GGUF, text and token ids.

For each text it tokenizes once with our GGUF tokenizer, cuts llama.cpp-style chunks
(``powerinfer.eval.perplexity.chunk_tokens``), then evaluates every chunk twice: with
:func:`powerinfer.eval.perplexity.perplexity` and with llama.cpp (``Llama.eval`` of the same
ids after ``reset()``, logits from ``Llama.scores``), scoring llama.cpp's logits with
llama.cpp's formula (second half of each chunk, ``PPL +/- stderr``). It also says whether
llama.cpp's own tokenizer gives the same ids.

    python benchmarks/ppl_vs_llamacpp.py                       # stories260K, TinyStories val + WikiText-2 test
    python benchmarks/ppl_vs_llamacpp.py -m X.gguf -f a.txt -c 512 --chunks 50

Needs ``pip install llama-cpp-python`` (the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from powerinfer.eval.perplexity import chunk_tokens, perplexity, ppl_and_stderr, read_text
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.tokenizer import GGUFTokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"  # bundled: sources, licences, sha256 in its README.md
MODEL = DATA / "stories260K" / "stories260K.ggml-org.gguf"
TEXTS = [DATA / "text" / "tinystories_val.txt", DATA / "text" / "wiki.test.raw"]


def llama_cpp_ppl(llm, chunks: list[list[int]]) -> tuple[float, float]:
    """llama.cpp's estimate from llama.cpp's logits of ``chunks`` (float64 log-softmax)."""
    nll = nll2 = 0.0
    count = 0
    for ids in chunks:
        llm.reset()
        llm.eval(ids)
        n, first = len(ids), len(ids) // 2
        logits = torch.from_numpy(np.asarray(llm.scores[first:n - 1], dtype=np.float32)).double()
        v = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[first + 1:])[:, None])[:, 0]
        nll, nll2, count = nll + float(v.sum()), nll2 + float((v * v).sum()), count + v.numel()
    return ppl_and_stderr(nll, nll2, count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("-f", "--file", action="append", help="text file (repeatable)")
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=300)
    args = ap.parse_args()
    from llama_cpp import Llama

    torch.set_num_threads(1)
    g = open_gguf(args.model)
    tok = GGUFTokenizer(g)
    model = Transformer(g, torch.float32, n_ctx=args.ctx_size)
    llm = Llama(args.model, n_ctx=args.ctx_size, n_batch=args.ctx_size, logits_all=True, n_threads=1, verbose=False)
    for path in args.file or TEXTS:
        text = read_text(path)
        ids = tok.encode(text)
        same_ids = llm.tokenize(text.encode(), add_bos=tok.add_bos, special=False) == ids
        chunks = chunk_tokens(ids, args.ctx_size, args.chunks, tok.bos_id if tok.add_bos else None)
        t0 = time.perf_counter()
        ours = perplexity(model, chunks)
        t1 = time.perf_counter()
        ref, ref_err = llama_cpp_ppl(llm, chunks)
        t2 = time.perf_counter()
        print(f"{Path(path).name}: {len(chunks)} chunks of {args.ctx_size} ({ours.n_tokens_scored} tokens scored); "
              f"llama.cpp tokenizer gives the same ids: {same_ids}")
        print(f"  pi-perplexity  PPL = {ours.ppl:.4f} +/- {ours.stderr:.5f}  ({t1 - t0:.1f} s)")
        print(f"  llama.cpp      PPL = {ref:.4f} +/- {ref_err:.5f}  ({t2 - t1:.1f} s)")
        print(f"  relative difference {abs(ours.ppl / ref - 1):.2e}; "
              f"mean NLL difference {abs(ours.nll - math.log(ref)):.2e} nats")


if __name__ == "__main__":
    main()

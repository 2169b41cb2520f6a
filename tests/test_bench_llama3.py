"""The Llama-3-shaped benchmark model (synthetic.make_hf with GQA, SwiGLU, rope theta and a padded
vocabulary, as benchmarks/make_llama3_model.py builds it) and bench_llama3.py's tables."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from powerinfer.formats.gguf_file import open_gguf  # noqa: E402
from powerinfer.synthetic import Shape, make_hf  # noqa: E402

TOKENIZER = ROOT / "tests" / "data" / "tokenizers" / "llama2"  # 32000 SentencePiece tokens


def test_llama3_shape_hf_and_gguf(tmp_path):
    from make_llama3_model import llama3_shape

    from powerinfer.convert.writer import convert
    from powerinfer.runtime.model import Transformer

    big = llama3_shape(4)
    assert (big.n_embd, big.n_ff, big.n_head, big.n_head_kv, big.n_vocab, big.hidden_act, big.rope_theta) == (
        4096, 14336, 32, 8, 128256, "silu", 500000.0)
    shape = replace(big, n_layer=2, n_embd=64, n_ff=160, n_head=4, n_head_kv=2, n_vocab=32100, n_ctx=128)
    hf = make_hf(tmp_path, shape, TOKENIZER, log=lambda s: None)
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["hidden_act"] == "silu" and cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 32100
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    assert theta == 500000.0
    path = convert(hf, tmp_path / "m.gguf", outtype="f16", progress=False, upstream_warnings=False)
    g = open_gguf(path)
    assert g.get("llama.attention.head_count_kv") == 2 and g.get("llama.rope.freq_base") == 500000.0
    tokens = g.get("tokenizer.ggml.tokens")
    assert len(tokens) == 32100 and tokens[31999] != "[PAD31999]" and tokens[32000] == "[PAD32000]" and tokens[-1] == "[PAD32099]"
    assert tuple(g.tensors["token_embd.weight"].shape) == (64, 32100)
    # the runtime computes what transformers computes on it (GQA 4/2, theta 500000, SwiGLU)
    from transformers import LlamaForCausalLM

    ids = [1, 306, 4966, 23, 31999]
    want = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)(torch.tensor([ids])).logits[0, -1]
    m = Transformer(g, torch.float32, dense=True, n_ctx=32)
    got = m.forward(torch.tensor(ids), 0)
    assert got.shape == (32100,)
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), (got - want).abs().max()


def test_default_shape_unchanged(tmp_path):
    hf = make_hf(tmp_path, Shape(n_layer=1, n_embd=32, n_ff=64, n_head=2, n_vocab=32000), TOKENIZER, log=lambda s: None)
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["hidden_act"] == "relu" and cfg["num_key_value_heads"] == 2
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    assert theta == 10000.0


def test_tables_ratios_and_failures():
    from bench_llama3 import Result, tables

    def r(engine, dec, pp, rnd, err=""):
        return Result(engine, "q4_0", 4, 1, rnd, f"/x/{engine}.gguf", 2_000_000_000, dec, pp,
                      None if err else 2_500_000_000, 1.5 + rnd, 10.0, error=err)

    runs = [r("llama.cpp", 4.0, 40.0, 1), r("llama.cpp", 6.0, 60.0, 2), r("llama.cpp", 5.0, 50.0, 3),
            r("pi-run", 10.0, 20.0, 1), r("pi-run", 12.0, 30.0, 2), r("pi-run", 0, 0, 3, err="exit 1: boom")]
    text = tables(runs)
    row = next(line for line in text.splitlines() if line.startswith("| Q4_0 | pi-run,"))
    # medians of the runs that worked: decode 11 / 5, prompt 25 / 50; RSS 2.5 GB of a 2 GB file
    assert "| 11.00 (10.00-12.00) | 2.20x | 25.00 (20.00-30.00) | 0.50x | 2.50 | 2.00 | 1.25 | 2.5-4.5 | 2/3 |" in row
    ref = next(line for line in text.splitlines() if line.startswith("| Q4_0 | llama.cpp,"))
    assert "| 5.00 (4.00-6.00) | 1.00x |" in ref
    assert "| Q4_0 | 4 | pi-run | 2.20x | 0.50x |" in text


@pytest.mark.parametrize("bad", ["q5_k", "f16"])
def test_bench_refuses_unknown_type(tmp_path, bad, capsys):
    from bench_llama3 import main

    lb = tmp_path / "llama-bench"
    lb.write_text("")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--llama-bench", str(lb), "--types", bad])
    assert f"--types: {bad} not among q4_0, q4_k_m, q8_0" in capsys.readouterr().err

"""The KV cache in its own type (runtime/kv_cache.py, llama.cpp's -ctk/-ctv, f16 by default):
the C decode attention reads f16/bf16 keys and values in place and equals attention computed on
the same rounded values; a model with an f16 cache stays close to the f32-cache one and decodes
llama2.c's greedy reference; batched decoding over f16 caches equals each sequence alone; the
cache's bytes halve everywhere they are counted; unsupported types are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from helpers import STORIES, alone, batched, need
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import batch, kernels
from powerinfer.runtime.generate import SamplerSettings, generate
from powerinfer.runtime.kv_cache import KVCache, cache_dtype
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.weights import weight_nbytes

F16, BF16, F32, Q8 = torch.float16, torch.bfloat16, torch.float32, torch.uint8  # uint8: q8_0 bytes
GGUF = STORIES / "stories260K.ggml-org.gguf"  # llama.cpp's own file: 5 layers, 4 KV heads of 8


def _ref(q, k, v):
    """Attention in float64 over the values the cache holds (already rounded to its type)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, None], k.double().transpose(0, 1), v.double().transpose(0, 1), enable_gqa=True)[:, 0]


@pytest.mark.parametrize("kt,vt", [(F16, F16), (BF16, BF16), (F16, F32), (F32, BF16)])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,n_pos", [(16, 4, 64, 300), (6, 3, 40, 7), (4, 4, 8, 1)])
def test_attention_over_a_16bit_cache_equals_attention_on_the_rounded_values(lib, kt, vt, n_head, n_head_kv,
                                                                              head_dim, n_pos):
    """f16 (F16C / AVX512 conversion) and bf16 keys and values read in place, native and scalar builds,
    head dims with and without a SIMD tail, GQA, a window of the cache as the model passes it."""
    g = torch.Generator().manual_seed(n_pos)
    ck = (3 * torch.randn(n_pos + 9, n_head_kv, head_dim, generator=g)).to(kt)
    cv = torch.randn(n_pos + 9, n_head_kv, head_dim, generator=g).to(vt)
    ck[0, 0, :3] = torch.tensor([6e-8, -1e-6, 0.0]).to(kt)  # f16 subnormals take the scalar converter's other branch
    q = torch.randn(n_head, head_dim, generator=g)
    k, v = ck[5:5 + n_pos], cv[5:5 + n_pos]
    got = kernels.attend_one(q, k, v)
    assert got.dtype == F32 and got.shape == (n_head, head_dim)
    assert (got.double() - _ref(q, k, v)).abs().max().item() < 1e-5  # f32 sums
    # the f16 bytes are read as f16: the same bits read as bf16 would be far off
    if kt == F16 and n_pos > 1:
        wrong = _ref(q, k.view(torch.int16).view(BF16).float(), v.float())
        assert (got.double() - wrong).abs().max().item() > 1e-2
    many = kernels.attend_many(torch.stack([q, q.flip(0)]), [k, ck[:n_pos + 9]], [v, cv[:n_pos + 9]])
    assert torch.equal(many[0], got)  # the batched call gives each entry attend_one's numbers
    assert torch.equal(many[1], kernels.attend_one(q.flip(0), ck, cv))


def test_every_f16_value_converts_exactly(lib):
    """Every f16 bit pattern but NaN (normals, subnormals, zeros, infinities) read from the cache
    equals torch's conversion: one position, so the output is the value row itself (p = 1)."""
    vals = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(F16)
    vals = vals[~torch.isnan(vals)]
    vals = vals[:vals.numel() // 16 * 16].view(1, -1, 16)  # [S = 1, Hkv, d = 16]: AVX512 lanes and F16C
    for d in (16, 8, 5):  # SIMD loads, 8-wide, and the scalar tail
        v = vals[..., :d].contiguous()
        got = kernels.attend_one(torch.zeros(v.shape[1], d), torch.zeros_like(v), v)
        assert torch.equal(got, v[0].float())


def test_nbytes_halve_and_the_model_sizes_its_cache_in_the_chosen_type():
    """2 x n_layer x n_ctx x n_head_kv x head_dim x bytes, hand-computed for stories260K (5 x 4 x 8)."""
    assert KVCache.nbytes(32, 2048, 32, 128, F32) == 2 * 32 * 2048 * 32 * 128 * 4  # 2 GiB: a 7B at 2048
    assert KVCache.nbytes(32, 2048, 32, 128, F16) == 2 ** 30  # llama.cpp's 1024 MiB
    assert KVCache.nbytes(32, 2048, 32, 128, F16, F32) == 3 * 2 ** 29
    g = open_gguf(need(GGUF))
    m32 = Transformer(g, n_ctx=256)
    m16 = Transformer(g, n_ctx=256, cache_type_k="f16", cache_type_v="f16")
    mix = Transformer(g, n_ctx=256, cache_type_k="bf16", cache_type_v="f32")
    assert weight_nbytes(m32.cache.k) + weight_nbytes(m32.cache.v) == 2 * 5 * 256 * 4 * 8 * 4
    assert weight_nbytes(m16.cache.k) + weight_nbytes(m16.cache.v) == 2 * 5 * 256 * 4 * 8 * 2
    assert (m16.cache.k.dtype, m16.cache.v.dtype) == (F16, F16)
    assert (mix.cache.k.dtype, mix.cache.v.dtype) == (BF16, F32)
    one = batch.new_cache(m16, 100)  # server slots and batched sequences take the model's types
    assert (one.k.dtype, one.v.dtype) == (F16, F16)
    assert weight_nbytes(one.k) + weight_nbytes(one.v) == 2 * 5 * 100 * 4 * 8 * 2


def test_memory_check_and_context_warning_count_the_chosen_type(monkeypatch):
    """The cache refuses to be made when it would not fit the memory available, in its own bytes (a
    limit between the f16 and the f32 size lets only f16 through), and Transformer's context
    warning sizes the cache in the chosen type."""
    from powerinfer.runtime import kv_cache, model as model_mod

    n16 = KVCache.nbytes(4, 4096, 8, 128, F16)
    monkeypatch.setattr(kv_cache, "available_memory", lambda: n16 + 1)
    assert KVCache(4, 4096, 8, 128, F16).k.dtype == F16
    with pytest.raises(PowerInferError, match="needs 0.1 GiB, more than the 0.1 GiB"):
        KVCache(4, 4096, 8, 128, F16, F32)
    monkeypatch.undo()
    sizes = []
    monkeypatch.setattr(model_mod, "DEFAULT_CTX", 64)  # the file's 2048 positions cut to 64: the warning
    monkeypatch.setattr(model_mod, "_size", lambda n: sizes.append(n) or "x")
    g = open_gguf(need(GGUF))
    for t, es in (("f16", 2), ("f32", 4)):
        sizes.clear()
        Transformer(g, cache_type_k=t, cache_type_v=t)
        assert sizes == [2 * 5 * 4 * 8 * es * 64, 2 * 5 * 4 * 8 * es * 2048]


def test_ram_budget_plan_counts_the_cache_in_its_type(tmp_path):
    """--ram-budget's plan: the KV cache's bytes, hand-computed, in the types -ctk/-ctv give."""
    from helpers import make_tiny_llama, random_predictors
    from powerinfer.convert.writer import convert
    from powerinfer.runtime.residency import plan_residency

    hf = make_tiny_llama(tmp_path / "hf", n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2)
    random_predictors(tmp_path / "pred", 2, 64, 256, hidden=(8,))
    g = open_gguf(convert(hf, tmp_path / "m.powerinfer.gguf", tmp_path / "pred", outtype="q4_0", progress=False))
    per = 2 * 2 * 100 * 2 * 16  # 2 (K, V) x n_layer x n_ctx x n_head_kv x head_dim
    plans = {t: plan_residency(g, 100, t, 1e6, interpreter=0) for t in (F32, (F16, F16), (BF16, F32))}
    assert [p.kv_cache for p in plans.values()] == [per * 4, per * 2, per * 3]
    assert plans[F32].minimum - plans[(F16, F16)].minimum == per * 2


def test_f16_cache_logits_close_to_f32_and_greedy_ids_equal_the_reference():
    """llama.cpp's stories260K GGUF: teacher-forced logits with an f16 cache within a bound of the f32
    cache's (and not identical: the cache really is f16), and the 256-token greedy decode equal to
    llama2.c's reference ids, as with the f32 cache."""
    ref = json.loads((STORIES / "greedy_t0_256.ids.json").read_text())
    g = open_gguf(need(GGUF))
    ids = ref["prompt_ids"] + ref["generated_ids"][:100]
    out = {}
    for t in ("f32", "f16", "bf16"):
        m = Transformer(g, n_ctx=512, cache_type_k=t, cache_type_v=t)
        with torch.inference_mode():
            pre = m.forward(torch.tensor(ids[:40]), 0, all_logits=True)  # prompt: SDPA over the cache
            dec = torch.stack([m.forward(torch.tensor([ids[p]]), p) for p in range(40, len(ids))])  # C kernel
        out[t] = torch.cat([pre, dec])
    d16 = (out["f16"] - out["f32"]).abs().max().item()
    dbf = (out["bf16"] - out["f32"]).abs().max().item()
    assert 0 < d16 < 2e-2, d16
    assert d16 < dbf < 2e-1, (d16, dbf)  # bf16 keeps 8 bits of mantissa, f16 11
    m = Transformer(g, n_ctx=512, cache_type_k="f16", cache_type_v="f16")
    st = generate(m, ref["prompt_ids"], len(ref["generated_ids"]), SamplerSettings(temp=0.0))
    assert st.token_ids == ref["generated_ids"]


def test_batched_decode_over_f16_caches_equals_each_sequence_alone():
    """Four sequences joining at different steps, each with its own f16 cache: every step's logits
    equal the ones the sequence gets alone, bit for bit."""
    kernels.set_backend("auto")
    m = Transformer(open_gguf(need(GGUF)), n_ctx=256, cache_type_k="f16", cache_type_v="f16")
    prompts = [[1, 403, 407, 261], [1, 300, 301, 302, 303, 304, 305], [1, 378], [1, 432, 383, 286, 300]]
    want = [alone(m, p, 16) for p in prompts]
    assert batch.new_cache(m, 8).k.dtype == F16
    toks, logits, _ = batched(m, prompts, 16, "per-seq", start=[0, 0, 2, 5])
    for b in range(len(prompts)):
        assert toks[b] == want[b][0]
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}"


def test_unsupported_types_are_refused_in_one_line(tmp_path):
    from powerinfer.eval.cli import main as ppl_main
    from powerinfer.runtime.cli import main as run_main
    from powerinfer.server.cli import main as server_main

    missing = tmp_path / "none.gguf"  # refused before the file is looked at
    text = tmp_path / "t.txt"
    text.write_text("x")
    for cmd, extra in ((run_main, []), (ppl_main, ["-f", str(text)]), (server_main, [])):
        for flag, name in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
            r = CliRunner().invoke(cmd, ["-m", str(missing), *extra, flag, "q4_1"])
            assert r.exit_code == 1, r.output
            assert r.output.strip() == \
                f"Error: {name} q4_1: unsupported KV cache type (supported: f32, f16, bf16, q8_0)"
    with pytest.raises(PowerInferError, match="--cache-type-v iq4_nl: unsupported KV cache type"):
        cache_dtype("iq4_nl", "--cache-type-v")
    with pytest.raises(PowerInferError, match="unsupported KV cache type"):
        Transformer(open_gguf(need(GGUF)), n_ctx=16, cache_type_k="q4_0")


def test_cli_default_is_f16_and_ctk_f32_gives_the_f32_numbers(tmp_path):
    """pi-perplexity on the f16 default equals an in-process model with an f16 cache, and -ctk f32
    -ctv f32 the f32-cache one (and the two differ)."""
    import re

    from powerinfer.eval.cli import main as ppl_main
    from powerinfer.eval.perplexity import chunk_tokens, perplexity
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    path = need(GGUF)
    text = need(STORIES.parent / "text" / "tinystories_val.txt").read_text()[:20000]
    g = open_gguf(path)
    tok = GGUFTokenizer(g)
    chunks = chunk_tokens(tok.encode(text), 128, 2, tok.bos_id)
    final = re.compile(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)")
    got = {}
    (tmp_path / "t.txt").write_text(text)
    for args in ([], ["-ctk", "f32", "-ctv", "f32"]):
        r = CliRunner().invoke(ppl_main, ["-m", str(path), "-f", str(tmp_path / "t.txt"), "-c", "128", "--chunks", "2",
                                          "--dtype", "f32", "-t", "1", *args])
        assert r.exit_code == 0, r.output
        got[bool(args)] = float(final.search(r.stdout).group(1))
    assert got[False] != got[True]
    for f32, t in ((False, "f16"), (True, "f32")):
        res = perplexity(Transformer(g, n_ctx=128, cache_type_k=t, cache_type_v=t), chunks, n_batch=16)
        assert got[f32] == round(res.ppl, 4), t


def test_long_prompts_run_in_ubatches_and_query_blocks_with_the_same_logits(monkeypatch):
    """A prompt longer than UBATCH runs as several passes, and SDPA in query blocks when the score
    matrix would pass SDPA_SCORE_BYTES (prompt memory bounded as llama.cpp's n_ubatch bounds it):
    the logits equal the one-pass ones up to GEMM rounding, the cache holds the same keys."""
    import powerinfer.runtime.model as model_mod

    g = open_gguf(need(GGUF))
    ids = torch.tensor(json.loads((STORIES / "greedy_t0_256.ids.json").read_text())["generated_ids"][:150])
    one = Transformer(g, n_ctx=256, cache_type_k="f16", cache_type_v="f16")
    with torch.inference_mode():
        want = one.forward(ids, 0, all_logits=True)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", lambda q, *a, **k: calls.append(q.shape[1])
                        or sdpa(q, *a, **k))
    monkeypatch.setattr(model_mod, "UBATCH", 64)
    monkeypatch.setattr(model_mod, "SDPA_SCORE_BYTES", 4 * 8 * 150 * 10)  # 8 heads x 150 keys: 10 rows a call
    split = Transformer(g, n_ctx=256, cache_type_k="f16", cache_type_v="f16")
    with torch.inference_mode():
        got = split.forward(ids, 0, all_logits=True)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4
    # every query row once per layer (5), in calls of at most 64 // (keys / 10) rows: 64 keys -> 23 rows
    assert sum(calls) == 150 * 5 and max(calls) == 23 and len(calls) > 3 * 5
    assert (split.cache.k[:, :150].float() - one.cache.k[:, :150].float()).abs().max() < 1e-3


# ---------------------------------------------------------------------------- q8_0
@pytest.mark.parametrize("kt,vt", [(Q8, Q8), (Q8, F16), (F32, Q8)])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,n_pos", [(8, 2, 64, 70), (4, 4, 32, 1), (6, 3, 128, 33)])
def test_attention_over_a_q8_0_cache_equals_attention_on_the_dequantized_values(lib, kt, vt, n_head, n_head_kv,
                                                                                 head_dim, n_pos):
    """q8_0 keys/values (ggml's 34-byte blocks) read in place equal attention over their dequantized
    values (native and scalar builds, GQA, mixed with another type, a window of the cache)."""
    from powerinfer.runtime.kv_cache import dequantize_q8_0, quantize_q8_0

    g = torch.Generator().manual_seed(n_pos + head_dim)
    raw = [torch.randn(n_pos + 4, n_head_kv, head_dim, generator=g) for _ in range(2)]
    ck, cv = (quantize_q8_0(x) if t == Q8 else x.to(t) for x, t in zip(raw, (kt, vt)))
    deq = [dequantize_q8_0(c) if c.dtype == Q8 else c.float() for c in (ck, cv)]
    q = torch.randn(n_head, head_dim, generator=g)
    got = kernels.attend_one(q, ck[2:2 + n_pos], cv[2:2 + n_pos])
    assert (got.double() - _ref(q, deq[0][2:2 + n_pos], deq[1][2:2 + n_pos])).abs().max().item() < 1e-5
    many = kernels.attend_many(torch.stack([q, -q]), [ck[2:2 + n_pos], ck], [cv[2:2 + n_pos], cv])
    assert torch.equal(many[0], got) and torch.equal(many[1], kernels.attend_one(-q, ck, cv))


def test_q8_0_blocks_are_ggml_blocks():
    """Hand-computed block: scale = amax / 127 as f16 (little-endian) first, then round(x / scale) int8."""
    from powerinfer.runtime.kv_cache import dequantize_q8_0, quantize_q8_0

    x = torch.zeros(32)
    x[0], x[1], x[2] = 2.54, -1.27, 0.5  # scale 0.02: 127, -64 (-63.5 rounds to even), 25
    raw = quantize_q8_0(x)
    assert raw.shape == (34,) and raw.dtype == torch.uint8
    assert raw[:2].view(F16).item() == torch.tensor(0.02, dtype=F16).item()
    assert raw[2:5].view(torch.int8).tolist() == [127, -64, 25] and not raw[5:].any()
    assert dequantize_q8_0(raw)[:3].tolist() == pytest.approx([127 * 0.02, -64 * 0.02, 25 * 0.02], rel=1e-3)
    assert not dequantize_q8_0(quantize_q8_0(torch.zeros(64))).any()  # an all-zero block: scale 0, no NaN


def test_q8_0_cache_model_decodes_close_to_f16_and_batches_exactly(tmp_path):
    """A tiny Llama with head_dim 32: logits with a q8_0 cache near the f32 cache's (further than f16's), the bytes
    34/32 per value, batched decode equal to alone; head_dim 8 (stories260K) is refused in one line."""
    from helpers import make_tiny_llama
    from powerinfer.convert.writer import convert

    hf = make_tiny_llama(tmp_path / "hf", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, hidden_act="silu")
    g = open_gguf(convert(hf, tmp_path / "m.gguf", outtype="f32", progress=False))
    ids = torch.tensor([1, 403, 407, 261, 300, 301, 302, 303, 304, 305, 432, 383])
    out = {}
    for t in ("f32", "f16", "q8_0"):
        m = Transformer(g, n_ctx=64, cache_type_k=t, cache_type_v=t)
        with torch.inference_mode():
            pre = m.forward(ids[:6], 0, all_logits=True)
            out[t] = torch.cat([pre] + [m.forward(ids[p:p + 1], p)[None] for p in range(6, len(ids))])
        if t == "q8_0":
            assert weight_nbytes(m.cache.k) + weight_nbytes(m.cache.v) == 2 * 2 * 64 * 2 * 34
    d8, d16 = ((out[t] - out["f32"]).abs().max().item() for t in ("q8_0", "f16"))
    top = out["f32"].abs().max().item()  # 8.8 here; q8_0 (8 bits per block of 32) lands at 0.22, f16 at 0.009
    assert d16 < d8 < 0.05 * top, (d16, d8, top)
    m = Transformer(g, n_ctx=128, cache_type_k="q8_0", cache_type_v="q8_0")  # the helpers' 128-token caches
    prompts = [[1, 403, 407], [1, 300, 301, 302, 303]]
    want = [alone(m, p, 8) for p in prompts]
    toks, logits, _ = batched(m, prompts, 8, "per-seq", start=[0, 2])
    for b in range(2):
        assert toks[b] == want[b][0] and torch.equal(logits[b], want[b][1])
    with pytest.raises(PowerInferError, match=r"^--cache-type-v q8_0: head_dim 8 is not a multiple of 32"):
        Transformer(open_gguf(need(GGUF)), n_ctx=16, cache_type_v="q8_0")

"""Batched decoding (runtime/batch.py): a sequence decoded in a batch gets, bit for bit, the logits
and greedy tokens it gets alone, whatever joins or leaves the batch; the several-token row kernels
equal the one-token ones; bad calls are refused."""
from __future__ import annotations


import pytest
import torch

from helpers import alone, batched, entries_batched
from powerinfer.convert.quantize import quantize_file
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import batch, kernels
from powerinfer.runtime.model import Transformer
from test_qkernels import make

# prompts of different lengths (stories260K ids), so the sequences sit at different positions
PROMPTS = [[1, 403, 407, 261], [1, 300, 301, 302, 303, 304, 305], [1, 378], [1, 432, 383, 286, 300],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 286, 300]]
N = 20  # tokens generated per sequence


@pytest.fixture(scope="module")
def files(tmp_path_factory, relu_hf, relu_sparse_gguf):
    """stories260K-relu with random predictors (a real sparse mix of rows per token): f32, Q4_0
    and Q8_0 (Q8_0 predictors), and the dense f32 file."""
    tmp = tmp_path_factory.mktemp("batch")
    f32 = relu_sparse_gguf
    out = {"f32": f32, "dense": convert(relu_hf, tmp / "m.gguf", None, outtype="f32", progress=False)}
    for t in ("q4_0", "q8_0"):
        out[t] = quantize_file(f32, tmp / f"m-{t}.powerinfer.gguf", t).path
    out["dense-q4_0"] = quantize_file(out["dense"], tmp / "m-q4_0.gguf", "q4_0").path
    return out


@pytest.mark.parametrize("kind", ["f32", "q4_0", "q8_0", "dense", "dense-q4_0"])
@pytest.mark.parametrize("mode", ["union", "per-seq"])
def test_batch_logits_equal_each_sequence_alone(files, kind, mode):
    """Five sequences joining at different steps (the batch grows 1..5 and shrinks): every step's
    logits equal the ones each sequence gets alone, bit for bit, so the greedy tokens do too."""
    kernels.set_backend("auto")
    model = Transformer(open_gguf(files[kind]))
    want = [alone(model, p, N) for p in PROMPTS[:5]]
    toks, logits, dec = batched(model, PROMPTS[:5], N, mode, start=[0, 0, 1, 3, 6])
    for b in range(5):
        assert toks[b] == want[b][0], f"sequence {b}"
        assert torch.equal(logits[b], want[b][1]), f"sequence {b}: max diff {(logits[b] - want[b][1]).abs().max()}"
    sparse = not kind.startswith("dense")
    if mode == "union" and sparse and kind != "f32" and kernels.backend() == "c":
        assert dec.stats["union"] > dec.stats["per-seq"]
    if mode == "per-seq" or not sparse:
        assert dec.stats["union"] == 0


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_prompts_as_batch_entries_equal_token_by_token_decoding(files, kind):
    """Prompts evaluated as entries of batched steps (3 tokens of one prompt per step beside the
    other sequences' decode tokens, a cache appearing several times in a step) give each sequence
    the logits of token-by-token decoding alone, bit for bit."""
    kernels.set_backend("auto")
    model = Transformer(open_gguf(files[kind]))
    prompts = PROMPTS[:4]
    want = [alone(model, p, 12, token_by_token=True) for p in prompts]
    toks, logits, _ = entries_batched(model, prompts, 12, "auto", per_step=3)
    for b in range(len(prompts)):
        assert toks[b] == want[b][0]
        assert torch.equal(logits[b], want[b][1]), b


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_steps_that_read_no_logits_still_fill_the_caches(files, kind):
    """A step of prompt entries only, none of whose logits are asked for (``logits_for=[]``: chunks of
    prompts longer than a step), writes every entry's keys and values (the last layer skips the rest);
    the sequences then go on with token-by-token decoding's logits, bit for bit. One step asks for a
    single entry in the middle of a chunk."""
    kernels.set_backend("auto")
    model = Transformer(open_gguf(files[kind]))
    prompts = [PROMPTS[0] * 2, PROMPTS[1] * 2]
    want = [alone(model, p, 3, token_by_token=True) for p in prompts]
    dec = batch.BatchDecoder(model)
    caches = [batch.new_cache(model, 128) for _ in prompts]
    n0 = len(prompts[0]) - 1  # every prompt token but the last: steps of 4 entries of both prompts
    for s0 in range(0, n0, 4):
        ent = [(b, p) for p in range(s0, min(s0 + 4, n0)) for b in range(2) if p < len(prompts[b]) - 1]
        out = dec.step([prompts[b][p] for b, p in ent], [caches[b] for b, _ in ent], [p for _, p in ent],
                       [] if s0 else [1])
        assert out.shape == (0 if s0 else 1, model.output.shape[0])
    for b in range(2):  # the rest of each prompt, then two decode steps, alone in the batch decoder
        for p in range(n0, len(prompts[b]) - 1):
            dec.step([prompts[b][p]], [caches[b]], [p], [])
    got = [[dec.step([p[-1]], [c], [len(p) - 1])[0]] for p, c in zip(prompts, caches)]
    for i in range(2):
        toks = [int(g[-1].argmax()) for g in got]
        lg = dec.step(toks, caches, [len(p) + i for p in prompts])
        for b in range(2):
            got[b].append(lg[b])
    for b in range(2):
        assert torch.equal(torch.stack(got[b]), want[b][1]), b


def test_greedy_tokens_differ_between_sequences(files):
    """The equality above is not vacuous: the sequences' greedy continuations are not all the same."""
    model = Transformer(open_gguf(files["q4_0"]))
    outs = {tuple(alone(model, p, N)[0]) for p in PROMPTS[:5]}
    assert len(outs) >= 4


def test_union_rows_counted_and_predicted_per_token(files):
    """Union mode computes for each token exactly its own predicted-active rows: the FFN's
    active count equals the per-sequence run's."""
    kernels.set_backend("auto")
    if kernels.backend() != "c":
        pytest.skip("union rows need the C kernels")
    counts = {}
    for mode in ("union", "per-seq"):
        model = Transformer(open_gguf(files["q4_0"]))
        batched(model, PROMPTS, 8, mode)
        counts[mode] = [(l.ffn.n_active, l.ffn.n_calls) for l in model.layers]
    assert counts["union"] == counts["per-seq"]
    assert all(0 < a < c * model.args.n_ff for a, c in counts["union"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16", "BF16"])
def test_multi_row_kernels_equal_one_token_kernels(lib, qtype):
    """rows_dot_multi / rows_axpy_multi on 7 tokens with their own row sets inside a union equal
    rows_dot / rows_axpy of each token alone, bit for bit (native and portable builds)."""
    F_, D, T = 96, 256, 7
    gate, up, down = make(qtype, F_, D, 1), make(qtype, F_, D, 2), make(qtype, F_, D, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    masks = torch.rand(T, F_, generator=g) < 0.3
    masks[0] = False  # a token with no active row
    idx = masks.any(0).nonzero().view(-1)
    sel = masks[:, idx]
    ga, ua = kernels.rows_dot_multi(x, idx, sel, gate, up, 0.0)
    coef = torch.where(sel, torch.relu(ga) * ua, torch.zeros(()))
    for chunk in (0, 32, 96):
        out = kernels.rows_axpy_multi(idx, down, coef, chunk)
        for t in range(T):
            own = masks[t].nonzero().view(-1)
            g1, u1 = kernels.rows_dot(x[t], own, gate, up, 0.0)
            assert torch.equal(ga[t][sel[t]], g1) and torch.equal(ua[t][sel[t]], u1)
            assert not ga[t][~sel[t]].any() and not ua[t][~sel[t]].any()
            h1 = torch.relu(g1) * u1
            assert torch.equal(out[t], kernels.rows_axpy(own, down, h1)), (t, chunk)
    assert torch.equal(out[0], torch.zeros(D))


def test_multi_row_kernels_refuse_what_they_cannot_take():
    kernels.set_backend("auto")
    w = torch.zeros(8, 32)
    with pytest.raises(ValueError, match="QWeight"):
        kernels.rows_dot_multi(torch.zeros(2, 32), torch.arange(2), torch.ones(2, 2, dtype=torch.bool), w)
    with pytest.raises(ValueError, match="QWeight"):
        kernels.rows_axpy_multi(torch.arange(2), w, torch.ones(2, 2))


def test_bad_batch_calls_are_refused(files):
    model = Transformer(open_gguf(files["q4_0"]))
    dec = batch.BatchDecoder(model)
    c = batch.new_cache(model, 16)
    with pytest.raises(PowerInferError, match="one token, cache and position per sequence"):
        dec.step([1, 2], [c], [0, 0])
    with pytest.raises(PowerInferError, match="position 16 is past a sequence's context of 16"):
        dec.step([1], [c], [16])
    with pytest.raises(PowerInferError, match="position 3 of one sequence twice"):
        dec.step([1, 2], [c, c], [3, 3])
    with pytest.raises(PowerInferError, match="outside 1..512"):
        batch.new_cache(model, 513)
    with pytest.raises(PowerInferError, match="20 tokens exceed the sequence's context of 16"):
        batch.prefill(model, c, list(range(1, 21)), 0)
    with pytest.raises(ValueError, match="ffn_mode 'both'"):
        batch.BatchDecoder(model, "both")
    model.placement = object()  # as GPU offload leaves it
    with pytest.raises(PowerInferError, match="--vram-budget"):
        batch.BatchDecoder(model)

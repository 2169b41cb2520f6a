"""The token sampler (``powerinfer.runtime.generate.sample``) against hand-computed answers.

llama.cpp's order: repetition penalty, top-k, top-p on the probabilities at temperature 1
(the nucleus: the fewest most likely tokens whose probability sums to at least ``top_p``),
then temperature; ``temp <= 0`` is argmax. Draws are checked by frequency over many seeded
draws, with bounds of 5 binomial standard deviations.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from powerinfer.runtime.generate import SamplerSettings, apply_repeat_penalty, sample

# probabilities 0.05 .. 0.5, stored out of order so that nothing relies on the token order
PROBS = {3: 0.5, 0: 0.2, 4: 0.15, 1: 0.1, 2: 0.05}
LOGITS = torch.tensor([math.log(PROBS[i]) for i in range(5)]) + 3.0  # a shift changes nothing


def _draws(logits, s, n, seed=0, history=()):
    gen = torch.Generator().manual_seed(seed)
    return Counter(sample(logits, s, gen, history) for _ in range(n))


def _assert_frequencies(counts, want, n):
    assert set(counts) <= {t for t, p in want.items() if p > 0}, counts
    for t, p in want.items():
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[t] / n - p) <= 5 * sd + 1e-9, (t, counts[t] / n, p)


def test_greedy_and_top_k_1_are_the_argmax():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(300, generator=g) * 3
        best = int(logits.argmax())
        assert sample(logits, SamplerSettings(temp=0.0), None) == best
        assert sample(logits, SamplerSettings(temp=-1.0), None) == best
        assert sample(logits, SamplerSettings(temp=1.5, top_k=1, top_p=1.0), g) == best


def test_draws_follow_the_softmax_with_every_filter_off():
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=1.0, top_k=0, top_p=1.0), n)
    _assert_frequencies(counts, PROBS, n)


def test_temperature_sharpens_as_p_to_the_power_1_over_t():
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=0.5, top_k=0, top_p=1.0), n, seed=1)
    z = sum(p ** 2 for p in PROBS.values())
    _assert_frequencies(counts, {t: p ** 2 / z for t, p in PROBS.items()}, n)


def test_top_k_keeps_the_k_most_likely_renormalised():
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=1.0, top_k=2, top_p=1.0), n, seed=2)
    _assert_frequencies(counts, {3: 0.5 / 0.7, 0: 0.2 / 0.7, 4: 0, 1: 0, 2: 0}, n)


@pytest.mark.parametrize("top_p,nucleus", [(0.45, [3]), (0.6, [3, 0]), (0.8, [3, 0, 4]), (0.9, [3, 0, 4, 1])])
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus):
    """Cumulative probabilities in order 3, 0, 4, 1, 2: 0.5, 0.7, 0.85, 0.95, 1.0; the nucleus
    ends at the first token that brings the sum to ``top_p`` or more."""
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=1.0, top_k=0, top_p=top_p), n, seed=3)
    mass = sum(PROBS[t] for t in nucleus)
    _assert_frequencies(counts, {t: (PROBS[t] / mass if t in nucleus else 0.0) for t in PROBS}, n)
    assert set(counts) == set(nucleus)


def test_top_p_is_taken_before_the_temperature():
    """At temp 0.25 token 0 keeps (0.2/0.5)**4 = 2.5% of token 3's weight; had the temperature
    come first, 3 alone would already pass top_p 0.6 and 0 would never be drawn."""
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=0.25, top_k=0, top_p=0.6), n, seed=4)
    w3, w0 = 0.5 ** 4, 0.2 ** 4
    _assert_frequencies(counts, {3: w3 / (w3 + w0), 0: w0 / (w3 + w0), 4: 0, 1: 0, 2: 0}, n)
    assert counts[0] > 0


def test_top_k_then_top_p():
    """top_k 3 renormalises 0.5, 0.2, 0.15 to 0.588, 0.235, 0.176: top_p 0.8 then stops at the
    second (0.824), where without top_k it would take the third (0.85)."""
    n = 5000
    counts = _draws(LOGITS, SamplerSettings(temp=1.0, top_k=3, top_p=0.8), n, seed=5)
    _assert_frequencies(counts, {3: 0.5 / 0.7, 0: 0.2 / 0.7, 4: 0, 1: 0, 2: 0}, n)


def test_same_seed_same_draws_other_seed_other_draws():
    logits = torch.zeros(50)  # flat: every draw is as random as it gets
    s = SamplerSettings(temp=1.0, top_k=0, top_p=1.0)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, s, g) for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len(set(run(7))) > 10


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_once_per_token():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repeat_penalty(logits, [0, 1, 0, 0, 99], 2.0)  # 99: outside the vocabulary, ignored
    assert torch.equal(out, torch.tensor([1.0, -4.0, 1.0, 0.5]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.5]))  # input untouched
    assert apply_repeat_penalty(logits, [0, 1], 1.0) is logits
    # greedy after the penalty: token 0 (2.0 -> 0.8) loses to token 2 (1.0)
    assert sample(logits, SamplerSettings(temp=0.0, repeat_penalty=2.5), None, history=[0]) == 2


def test_min_p_keeps_tokens_within_a_share_of_the_best():
    """min_p 0.25: p >= 0.25 * 0.5 = 0.125 keeps tokens 3, 0, 4 (0.5, 0.2, 0.15), renormalized over 0.85
    (no probability sits on the cut-off, which float rounding could put on either side)."""
    n = 4000
    counts = _draws(LOGITS, SamplerSettings(temp=1.0, top_k=0, top_p=1.0, min_p=0.25), n)
    _assert_frequencies(counts, {3: 0.5 / 0.85, 0: 0.2 / 0.85, 4: 0.15 / 0.85, 1: 0.0, 2: 0.0}, n)
    # min_p 1.0 keeps only the best token; 0 is off
    assert set(_draws(LOGITS, SamplerSettings(temp=1.0, top_k=0, top_p=1.0, min_p=1.0), 200)) == {3}
    assert set(_draws(LOGITS, SamplerSettings(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), 2000)) == {0, 1, 2, 3, 4}


def test_tiny_temperature_and_penalty_give_a_token_not_an_error():
    """Found by the server's fuzz test (test_server_fuzz.py): temperature 5e-324 divided the logits to
    inf and the softmax to NaN (a 500); a repeat penalty of 5e-324 divided a positive logit to inf.
    Now a tiny temperature draws the best token (the limit of p ** (1 / t)), and a tiny penalty makes
    the penalized tokens with positive logits the most likely ones (the limit of logit / penalty)."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    for t in (5e-324, 1e-45, 1e-300):
        assert {sample(logits, SamplerSettings(temp=t, top_k=0, top_p=1.0), g) for _ in range(20)} == {1}
    s = SamplerSettings(temp=0.8, top_k=0, top_p=1.0, repeat_penalty=5e-324)
    assert {sample(logits, s, g, history=[2]) for _ in range(20)} == {2}
    s = SamplerSettings(temp=5e-324, top_k=0, top_p=1.0, repeat_penalty=5e-324)
    assert {sample(logits, s, g, history=[0, 3]) for _ in range(20)} == {0}

"""Neuron placement solver (powerinfer.convert.placement)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from powerinfer.convert.placement import (
    capacity_for_budget,
    neuron_bytes,
    place_neurons,
    solve_placement,
)
from powerinfer.errors import PowerInferError
from powerinfer.formats.activation import load_activation_dir


def write_upstream_activations(folder, n_layer=12, n_ff=16):
    """activation_{k}.pt as upstream writes them (torch.save of a 1-D tensor);
    layer k's hottest neuron is neuron k."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for k in range(n_layer):
        t = torch.randint(0, 10, (n_ff,), generator=g).to(torch.float32)
        t[k % n_ff] = 1000.0 + k
        torch.save(t, folder / f"activation_{k}.pt")
    return folder


def brute_force(counts, capacity, chunk, min_neurons=0, min_share=0.0):
    """Best total over every per-layer chunk count (tiny problems only)."""
    per_layer = []
    for c in counts:
        s = np.sort(np.asarray(c, dtype=np.float64))[::-1]
        n = s.size
        m = min(max(math.ceil(min_share * n - 1e-9), min_neurons), n) if (min_share or min_neurons) else 0
        opts = []
        for k in range(0, -(-n // chunk) + 1):
            neurons = min(k * chunk, n)
            if k and neurons < m:
                continue
            opts.append((neurons, float(s[:neurons].sum())))
        per_layer.append(opts)
    best = 0.0
    for combo in itertools.product(*per_layer):
        if sum(o[0] for o in combo) <= capacity:
            best = max(best, sum(o[1] for o in combo))
    return best


def gpu_value(p, counts):
    return float(sum(np.asarray(c, dtype=np.float64)[g].sum() for c, g in zip(counts, p.gpu)))


def assert_prefix(p, counts):
    """GPU neurons of each layer are its hottest ones."""
    for c, g in zip(counts, p.gpu):
        c = np.asarray(c, dtype=np.float64)
        if g.any() and (~g).any():
            assert c[g].min() >= c[~g].max()


# --------------------------------------------------------------------------- folders
def test_layers_are_read_by_number(tmp_path):
    folder = write_upstream_activations(tmp_path / "activation")
    counts = load_activation_dir(folder)
    p = solve_placement(counts, 12, chunk=1)
    for k, g in enumerate(p.gpu):
        assert np.flatnonzero(g).tolist() == [k], f"layer {k}"
    assert p.used == 12


def test_extra_files_are_ignored(tmp_path):
    folder = write_upstream_activations(tmp_path / "activation")
    (folder / "README").write_text("calibration on wikitext\n")
    (folder / ".gitkeep").write_text("")
    counts = load_activation_dir(folder)
    assert len(counts) == 12
    p = solve_placement(counts, 12, chunk=1)
    assert [np.flatnonzero(g).tolist() for g in p.gpu] == [[k] for k in range(12)]


def test_missing_layer_file_is_an_error(tmp_path):
    folder = write_upstream_activations(tmp_path / "activation")
    (folder / "activation_5.pt").unlink()
    with pytest.raises(PowerInferError, match="activation_5.pt"):
        load_activation_dir(folder)


# --------------------------------------------------------------------------- budgets
def test_budget_zero_places_nothing():
    counts = [np.arange(100, dtype=np.int64) for _ in range(3)]
    for kw in ({}, {"min_share": 0.3}):
        p = place_neurons(counts, 0, 24576, chunk=64, **kw)
        assert p.used == 0 and p.bytes_used == 0
        assert not any(g.any() for g in p.gpu)
        assert p.served_total == 0.0


def test_budget_above_total_places_everything():
    counts = [np.arange(100) for _ in range(3)]
    nb = neuron_bytes(64, "f16", True)
    p = place_neurons(counts, 10**12, nb, chunk=64, min_share=0.5)
    assert all(g.all() for g in p.gpu)
    assert p.used == 300 and p.bytes_used == 300 * nb
    assert p.served_total == pytest.approx(1.0)


def test_negative_budget_and_bad_arguments():
    counts = [np.ones(10)]
    with pytest.raises(PowerInferError):
        place_neurons(counts, -1, 100)
    with pytest.raises(PowerInferError):
        solve_placement(counts, -5)
    with pytest.raises(PowerInferError):
        solve_placement(counts, 5, chunk=0)
    with pytest.raises(PowerInferError):
        solve_placement(counts, 5, min_share=1.5)
    with pytest.raises(PowerInferError):
        solve_placement([np.array([1.0, -1.0])], 1)
    with pytest.raises(PowerInferError):
        solve_placement([], 1)


def test_neuron_bytes():
    assert neuron_bytes(4096, "f16", True) == 4096 * 2 * 3 == 24576
    assert neuron_bytes(4096, "F32", False) == 4096 * 4 * 2
    assert neuron_bytes(4096, "bf16", True) == 24576
    assert neuron_bytes(4096, "q8_0", True) == 4096 // 32 * 34 * 3
    assert neuron_bytes(4096, "q4_0", False) == 4096 // 32 * 18 * 2
    with pytest.raises(PowerInferError):
        neuron_bytes(100, "q4_0", True)
    with pytest.raises(PowerInferError):
        neuron_bytes(4096, "q5_k", True)
    assert capacity_for_budget(4 * 2**30, 24576) == 174762
    assert capacity_for_budget(10, 2.5) == 4
    assert capacity_for_budget(9.99, 2.5) == 3


def test_7b_shape_places_exactly_the_budget():
    """ReluLLaMA-7B: n_embd 4096, n_ff 11008, 32 layers, f16, gated: 24 KiB per neuron.
    4 GiB holds floor(4 GiB / 24 KiB) = 174762 neurons; with 64-neuron chunks (11008 = 172 x 64,
    no short chunk) exactly floor(174762 / 64) x 64 = 174720."""
    rng = np.random.default_rng(1)
    counts = [rng.integers(0, 1000, 11008) for _ in range(32)]
    nb = neuron_bytes(4096, "f16", gated=True)
    assert nb == 24 * 1024
    budget = 4 * 2**30
    p1 = place_neurons(counts, budget, nb, chunk=1)
    assert p1.used == budget // nb == 174762
    assert p1.bytes_used == 174762 * 24576 <= budget
    assert p1.info.method == "greedy" and p1.info.status == "optimal"
    p64 = place_neurons(counts, budget, nb, chunk=64)
    assert p64.used == 174762 // 64 * 64 == 174720
    assert all(n % 64 == 0 for n in p64.n_gpu)
    assert_prefix(p1, counts)
    assert_prefix(p64, counts)


# --------------------------------------------------------------------------- exactness
def test_n_ff_not_a_multiple_of_chunk():
    rng = np.random.default_rng(2)
    counts = [rng.integers(0, 50, n) for n in (100, 70, 37)]  # tails of 36, 6, 37 neurons
    for cap in (0, 5, 36, 64, 100, 101, 130, 170, 200, 206, 207, 300):
        p = solve_placement(counts, cap, chunk=64)
        assert p.used <= cap
        assert gpu_value(p, counts) == pytest.approx(brute_force(counts, cap, 64)), cap
        assert_prefix(p, counts)
        for g, n in zip(p.gpu, p.n_gpu):
            assert g.sum() == n


def test_exact_against_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(25):
        L = int(rng.integers(2, 4))
        chunk = int(rng.integers(2, 9))
        counts = [rng.pareto(1.0, int(rng.integers(5, 30))).round(2) * 10 for _ in range(L)]
        total = sum(c.size for c in counts)
        cap = int(rng.integers(0, total + 1))
        share = float(rng.choice([0.0, 0.25, 0.5]))
        p = solve_placement(counts, cap, chunk=chunk, min_share=share)
        best = brute_force(counts, cap, chunk, min_share=share)
        assert gpu_value(p, counts) == pytest.approx(best, rel=1e-9, abs=1e-9), (trial, p.info)


def test_milp_never_worse_than_greedy():
    rng = np.random.default_rng(4)
    for trial in range(12):
        L = int(rng.integers(3, 8))
        counts = [rng.pareto(1.1, int(rng.integers(50, 300))) * 100 for _ in range(L)]
        total = sum(c.size for c in counts)
        cap = int(rng.integers(1, total))
        share = float(rng.choice([0.0, 0.1, 0.4]))
        g = solve_placement(counts, cap, chunk=16, min_share=share, method="greedy")
        m = solve_placement(counts, cap, chunk=16, min_share=share, method="milp")
        a = solve_placement(counts, cap, chunk=16, min_share=share)
        assert m.info.objective >= g.info.objective - 1e-9
        assert a.info.objective >= g.info.objective - 1e-9
        assert m.used <= cap and g.used <= cap


def test_per_layer_minimum():
    rng = np.random.default_rng(5)
    counts = [rng.pareto(1.0 + l / 4, 512) * 10 for l in range(8)]
    for share in (0.1, 0.3, 0.6):
        for cap in (100, 700, 1500, 3000):
            p = solve_placement(counts, cap, chunk=32, min_share=share)
            need = math.ceil(share * 512)
            assert p.used <= cap
            for n in p.n_gpu:
                assert n == 0 or n >= need, (share, cap, p.n_gpu)
            assert p.min_neurons == [need] * 8
    p = solve_placement(counts, 1000, chunk=64, min_neurons=300)  # upstream --threshold, in neurons
    assert all(n == 0 or n >= 300 for n in p.n_gpu)


def test_placement_record():
    counts = [np.array([5, 0, 3, 1]), np.array([0, 0, 0, 0])]
    p = place_neurons(counts, 3 * 10, 10, chunk=1)
    assert p.n_gpu == [3, 0]
    assert p.buckets()[0].tolist() == [0, 2, 3] and p.buckets()[1].dtype == np.int32
    assert p.buckets()[1].size == 0
    assert p.served == [1.0, 0.0]
    assert p.served_total == 1.0
    assert p.bytes_used == 30 and p.capacity == 3
    assert p.info.method in ("greedy", "milp") and p.info.time_s >= 0
    torch_counts = [torch.tensor([5, 0, 3, 1]), torch.tensor([0.0, 0, 0, 0])]
    assert solve_placement(torch_counts, 3, chunk=1).n_gpu == [3, 0]


def test_dp_and_milp_agree_with_tails_and_minimum():
    rng = np.random.default_rng(6)
    counts = [rng.pareto(1.0 + l / 8, 1000) * 100 for l in range(10)]  # 1000 = 15 x 64 + 40
    for share in (0.0, 0.3):
        for cap in (1500, 4100, 7000):
            a = solve_placement(counts, cap, chunk=64, min_share=share)
            m = solve_placement(counts, cap, chunk=64, min_share=share, method="milp", time_limit=60)
            assert a.info.status == "optimal"
            assert a.info.objective == pytest.approx(m.info.objective, rel=1e-9)
            assert a.used <= cap


def test_milp_time_limit_falls_back_to_a_feasible_answer():
    rng = np.random.default_rng(7)
    counts = [rng.pareto(1.2, 3000) * 100 for _ in range(20)]
    g = solve_placement(counts, 9000, chunk=32, min_share=0.3, method="greedy")
    p = solve_placement(counts, 9000, chunk=32, min_share=0.3, method="milp", time_limit=1e-6)
    assert p.info.status in ("time_limit", "optimal", "failed")
    assert p.used <= 9000 and p.info.objective >= g.info.objective
    assert all(n == 0 or n >= 900 for n in p.n_gpu)

"""``--ram-budget`` on mixture-of-experts files (runtime/expert_residency.py) and pi-profile's routing counts.

1. Under a budget that forces reads (the reuse cache holds only the experts one token uses; with routing
   counts, a few experts pinned), prompt logits and greedy decode logits equal the unlimited run's bit for
   bit, for Mixtral, Qwen3-MoE and SmallThinker files (llama.cpp's converter's, f32), Q4_0 and Q8_0
   re-quantizations (experts in the 8-row-group layout) and llama.cpp's own Q4_K_M file; experts were read
   and replaced.
2. Accounting: what the plan keeps resident is at most the budget, and the store holds exactly the bytes
   the plan gives it; a budget below the minimum is one line with the minimum, before any weight is read.
3. SmallThinker: the routed cold experts are being read when attention runs (the router is on the layer input).
4. pi-profile's counts equal the routing transformers' Mixtral computes (``output_router_logits``) on the same
   tokens.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from family_models import MOE_BUILDERS
from helpers import DATA, need
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime import kernels
from powerinfer.runtime.expert_residency import GIB, load_experts_budgeted, plan_experts
from powerinfer.runtime.loading import load_model

LLAMACPP = DATA / "llamacpp"
PROMPT = "Once upon a time, there was a little girl named Lily. She"
N_CTX = 64


@pytest.fixture(autouse=True)
def _reads_always(monkeypatch):
    monkeypatch.setenv("POWERINFER_ROW_READS", "always")  # the tiny files fit any budget otherwise


def _file(name: str, tmp_path) -> str:
    if name.endswith(("-q4_0", "-q8_0")):
        from powerinfer.convert.quantize import quantize_file

        base, q = name.rsplit("-", 1)
        return str(quantize_file(need(LLAMACPP / f"{base}.gguf"), tmp_path / f"{name}.gguf", q).path)
    return str(need(LLAMACPP / f"{name}.gguf"))


def _reference(path: str, n: int = 8):
    """The unlimited run with every routed expert computed whole (``dense``: what a budgeted run computes;
    sparse ReLU experts, the default, sum the same products in another order)."""
    model, tok = load_model(path, "f32", dense=True, n_ctx=N_CTX)
    ids = torch.tensor(tok.encode(PROMPT))
    return ids, _run(model, ids, n)


def _run(model, ids, n: int, forced: list[int] | None = None):
    """Prompt logits ``[T, V]`` and ``n`` greedy decode steps' logits (``forced``: the tokens fed)."""
    out = [model.forward(ids, 0, all_logits=True)]
    nxt, p = int(out[0][-1].argmax()), len(ids)
    for s in range(n):
        out.append(model.forward(torch.tensor([nxt if forced is None else forced[s]]), p))
        nxt, p = int(out[-1].argmax()), p + 1
    return out


def _minimum(path: str, counts=None) -> tuple:
    g = open_gguf(path)
    from powerinfer.runtime.args import ModelArgs
    from powerinfer.runtime.moe import expert_args

    ea = expert_args(g, ModelArgs.from_gguf(g))
    plan = plan_experts(g, N_CTX, torch.float32, 1000.0, ea.n_expert, ea.n_used, counts, interpreter=0)
    return g, plan


def _counts_dir(tmp_path, path: str, tokens: int = 400):
    from powerinfer.profile.experts import profile_experts

    out = tmp_path / "act"
    profile_experts(path, need(DATA / "text" / "tinystories_sample.txt"), out, n_ctx=N_CTX, max_tokens=tokens)
    return out


FILES = ["mixtral", "qwen3moe", "smallthinker", "mixtral-q4_0", "smallthinker-q8_0", "mixtral_q4_k_m"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("pinned", [0, 3], ids=["cache-only", "pinned"])
def test_budget_run_equals_unlimited(name, pinned, tmp_path):
    if kernels.backend() != "c" and name != "mixtral":
        pytest.skip("quantized experts under a budget need the C kernels")
    path = _file(name, tmp_path)
    ids, want = _reference(path)
    act = _counts_dir(tmp_path, path) if pinned else None
    g, plan0 = _minimum(path)
    budget = (plan0.minimum + pinned * plan0.slot_bytes) / GIB  # pinned: room for a few experts above the minimum
    model, plan = load_experts_budgeted(g, torch.float32, N_CTX, budget, None if act is None else str(act),
                                        interpreter=0)
    assert not plan.resident and plan.cache_slots >= plan.n_used
    if pinned:
        assert 0 < plan.n_hot < plan.n_layer * plan.n_expert
    else:
        assert plan.n_hot == 0 and plan.cache_slots == max(plan.n_used, plan.min_cache_bytes // plan.slot_bytes)
    got = _run(model, ids, 8, forced=[int(w.argmax()) for w in [want[0][-1]] + want[1:-1]])
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    st = model.expert_residency[1].stats
    distinct = len({k for k in model.expert_residency[1].slot_of})
    assert st["experts_read"] > distinct  # experts were read, replaced and read again
    if pinned:
        assert st["hits_resident"] > 0
    model.close()


def test_accounting_and_store_bytes(tmp_path):
    path = _file("mixtral-q4_0", tmp_path)
    act = _counts_dir(tmp_path, path)
    g, plan0 = _minimum(path)
    for extra in (0, 2, 5):
        budget = (plan0.minimum + extra * plan0.slot_bytes + 12345) / GIB
        model, plan = load_experts_budgeted(g, torch.float32, N_CTX, budget, str(act), interpreter=0)
        store = model.expert_residency[1]
        assert plan.resident_total <= plan.budget
        assert store.resident_bytes() == plan.hot_bytes
        assert store.cache_nbytes() == plan.cache_slots * plan.slot_bytes
        assert plan.cache_slots >= plan.n_used
        hot_per_layer = [int(h.sum()) for h in plan.hot]
        assert sum(hot_per_layer) == plan.n_hot
        if extra:
            assert plan.n_hot >= 1
        model.close()


def test_too_small_budget_is_one_line_before_loading(tmp_path, monkeypatch):
    path = _file("qwen3moe", tmp_path)
    g, plan = _minimum(path)
    from powerinfer.runtime import expert_residency

    def no_store(*a, **k):
        raise AssertionError("the store was built")

    monkeypatch.setattr(expert_residency, "ExpertStore", no_store)
    with pytest.raises(PowerInferError) as e:
        load_experts_budgeted(g, torch.float32, N_CTX, (plan.minimum - 1) / GIB, interpreter=0)
    msg = str(e.value)
    assert "\n" not in msg and "is below the" in msg and f"give at least {plan.minimum / GIB:.2f} GiB" in msg
    assert "reuse cache of 3 experts" in msg


def test_open_for_inference_runs_moe_under_a_budget(monkeypatch):
    """The front ends' path: --ram-budget on an MoE file loads the budgeted model (no longer refused)."""
    from powerinfer.runtime.loading import open_for_inference
    from powerinfer.runtime.residency import rss_bytes

    notes = []
    budget = (rss_bytes() + (160 << 20)) / GIB  # the interpreter as it stands (earlier tests grow it), the scratch
    model, tok = open_for_inference(str(need(LLAMACPP / "mixtral.gguf")), dtype="f32", ctx_size=N_CTX,
                                    ram_budget=budget, note=notes.append)
    assert hasattr(model, "expert_residency") and "experts" in notes[-1] and "read from disk" in notes[-1]
    model.close()


def test_smallthinker_reads_are_in_flight_during_attention(tmp_path, monkeypatch):
    """The router reads the layer input: the layer's routed cold experts are submitted before attention."""
    path = _file("smallthinker", tmp_path)
    g, plan0 = _minimum(path)
    model, _ = load_experts_budgeted(g, torch.float32, N_CTX, plan0.minimum / GIB, interpreter=0)
    store = model.expert_residency[1]
    seen = []
    attention = type(model).attention

    def spy(self, i, layer, x, pos):
        submitted = {e for (l, e) in store.slot_of if l == i and store.busy[store.slot_of[(l, e)]]}
        seen.append(submitted)
        return attention(self, i, layer, x, pos)

    monkeypatch.setattr(type(model), "attention", spy)
    tok = [1, 2, 3, 4, 5, 6]
    model.forward(torch.tensor(tok), 0)
    model.forward(torch.tensor([7]), len(tok))
    assert len(seen) == 2 * plan0.n_layer
    decode = seen[plan0.n_layer:]
    assert all(len(s) == plan0.n_used for s in decode)  # every routed expert of the token, before attention
    model.close()


def test_profile_counts_equal_transformers_routing(tmp_path):
    """pi-profile's expert_counts.json on our conversion of a tiny Mixtral: per layer, the tokens routed to
    each expert equal the top-k of transformers' router logits on the same token ids."""
    from powerinfer.convert.writer import convert
    from powerinfer.hf import load_hf_model
    from powerinfer.profile.cli import main as profile_main
    from powerinfer.runtime.tokenizer import GGUFTokenizer

    d = MOE_BUILDERS["mixtral"](tmp_path / "hf")
    gguf = convert(d, tmp_path / "m.gguf", outtype="f32", progress=False)
    text = need(DATA / "text" / "tinystories_sample.txt")
    r = CliRunner().invoke(profile_main, [str(gguf), "--data", str(text), "--out", str(tmp_path / "act"),
                                          "--max-tokens", "300", "--seq-len", "100"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "act" / "expert_counts.json").read_text())
    counts = torch.tensor(meta["counts"])
    assert meta["n_tokens"] == 300 and meta["n_used"] == 2 and counts.shape == (3, 4)
    assert (counts.sum(1) == 300 * 2).all()
    from powerinfer.profile.inputs import calibration_text

    ids = GGUFTokenizer(open_gguf(str(gguf))).encode(calibration_text(text))[:300]
    hf = load_hf_model(d, torch.float32)
    want = torch.zeros(3, 4, dtype=torch.long)
    with torch.no_grad():
        for s in range(0, 300, 100):
            out = hf(torch.tensor([ids[s:s + 100]]), output_router_logits=True)
            for i, logits in enumerate(out.router_logits):
                top = logits.view(-1, 4).topk(2, dim=-1).indices
                want[i] += torch.bincount(top.view(-1), minlength=4)
    assert torch.equal(counts, want)
    assert len(set(counts.view(-1).tolist())) > 3  # the routing is not uniform: the counts tell experts apart


def test_bad_expert_counts_are_one_line(tmp_path):
    path = _file("mixtral", tmp_path)
    act = tmp_path / "act"
    act.mkdir()
    (act / "expert_counts.json").write_text(json.dumps({"format": "powerinfer-expert-counts", "version": 1,
                                                        "n_layer": 2, "n_expert": 4, "counts": [[1] * 4] * 2}))
    g, plan = _minimum(path)
    with pytest.raises(PowerInferError, match=r"expert_counts.json: counts of 2 layers x 4 experts, the model has 3 x 4"):
        load_experts_budgeted(g, torch.float32, N_CTX, plan.minimum / GIB, str(act), interpreter=0)
    (act / "expert_counts.json").unlink()
    with pytest.raises(PowerInferError, match=r"no expert_counts.json \(pi-profile MODEL"):
        load_experts_budgeted(g, torch.float32, N_CTX, plan.minimum / GIB, str(act), interpreter=0)


def test_pi_run_bench_reports_the_expert_reads(tmp_path, monkeypatch):
    """pi-run --ram-budget --bench on a Q8_0 SmallThinker file at its minimum (the interpreter counted as 0, so
    the cache holds k experts): the plan's line, then the resident and cache MB, the reads per decode token and
    the hit rate, from the store's counters."""
    import re

    from powerinfer.runtime import expert_residency
    from powerinfer.runtime.cli import main as run_main

    path = _file("smallthinker-q8_0", tmp_path)
    monkeypatch.setattr(expert_residency, "rss_bytes", lambda: 0)
    budget = _minimum(path)[1].minimum / GIB
    r = CliRunner().invoke(run_main, ["-m", path, "-p", PROMPT, "-n", "6", "-c", str(N_CTX), "--dtype", "f32",
                                      "--ram-budget", repr(budget), "--bench"])
    assert r.exit_code == 0, r.output
    assert re.search(r"resident experts \d+ of 12 \(\d+ MB\), reuse cache \d+ experts", r.output)
    m = re.search(r"per decode token: ([\d.]+) experts read \(([\d.]+) MB\)", r.output)
    assert m and 0 < float(m.group(1)) <= 3 * 2  # at most k experts in each of the 3 layers
    hit = re.search(r"hit rate ([\d.]+)% \(resident ([\d.]+)%, cache ([\d.]+)%\)", r.output)
    assert hit and float(hit.group(1)) < 100

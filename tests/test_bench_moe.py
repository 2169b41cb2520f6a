"""bench_moe.py's pieces that decide its tables: refusals found in a child's output, the killed-is-0 rule,
the NVMe projection and the in-RAM medians."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_moe as bm  # noqa: E402
import bench_ram_budget as rb  # noqa: E402
from bench_llama3 import Result  # noqa: E402


def test_refusal_is_the_runtimes_one_line():
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 3\n"
          "powerinfer.errors.PowerInferError: /m.gguf: GGUF architecture 'smallthinker' is not supported\n")
    assert bm.refusal(tb) == "Error: /m.gguf: GGUF architecture 'smallthinker' is not supported"
    assert bm.refusal("loading\nError: /m.gguf: --ram-budget does not run mixture-of-experts files yet\n") == \
        "Error: /m.gguf: --ram-budget does not run mixture-of-experts files yet"
    assert bm.refusal("a\nlast line\n") == "last line" and bm.refusal("") == "no output"


def test_killed_counts_as_zero_and_projection():
    ok = rb.Result("x", True, tps=0.5)
    ok.extra.update(n_tokens=5, disk_reqs=5 * 10_000, disk_bytes=5 * 600_000_000)
    assert bm.tps0(ok) == 0.5
    # 1/2 s of compute per token (unlimited 2 tok/s) + max(10K reads / 500K IOPS, 0.6 GB / 3 GB/s) = 0.7 s
    assert bm.projection(ok, 2.0) == f"{1 / 0.7:.2f}"
    killed = rb.Result("x", True, tps=3.0, killed=True)
    killed.extra.update(n_tokens=5, disk_reqs=1, disk_bytes=1)
    assert bm.tps0(killed) == 0.0 and bm.projection(killed, 2.0) == "-" and bm.tps0(None) == 0.0


def test_ram_medians_and_generated_text():
    rs = [Result(e, "qwen3-30b-a3b", 16, 1, i, "f", 1, decode_tps=v)
          for i, (e, v) in enumerate([("llama.cpp", 5.0), ("llama.cpp", 7.0), ("llama.cpp", 6.0),
                                      ("pi-run avx2", 8.0), ("pi-run avx2", 9.0)])]
    rs.append(Result("pi-run avx2", "qwen3-30b-a3b", 16, 1, 9, "f", 1, error="not loadable: x"))
    m = bm.ram_medians(rs)
    assert m[("qwen3-30b-a3b", 1, "llama.cpp")] == 6.0 and m[("qwen3-30b-a3b", 1, "pi-run")] == pytest.approx(8.5)
    assert bm.generated(rb.PROMPT + " tokens here") == "tokens here" and bm.generated(" only ") == "only"

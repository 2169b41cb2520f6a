"""Fixtures: real inputs from tests/data and small models built on the fly."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import STORIES, need


# The longest files first. Under the README's `pytest -n auto` (pyproject: --dist loadfile
# --no-loadscope-reorder) each file is one unit of work and the units go to the workers in
# collection order: a long file collected last would finish alone after everything else.
SLOW_FIRST = ("test_demo_model.py", "test_kill9.py", "test_calibrate.py", "test_server.py", "test_batch_server.py", "test_server_fuzz.py", "test_chat.py",
              "test_gguf_validate.py", "test_profile.py", "test_train_predictor.py", "test_gpuidx.py")


def pytest_configure(config):
    """Under ``-n``, the workers already fill the cores: each computes with its share of them
    (two workers with two OpenMP threads each on two cores mostly wait for each other)."""
    n_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if n_workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // n_workers))


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def stories_hf() -> Path:
    """The real pretrained stories260K (SiLU Llama) in HF layout."""
    return need(STORIES / "hf")


@pytest.fixture(scope="session")
def relu_hf(tmp_path_factory, stories_hf) -> Path:
    """stories260K with hidden_act switched to relu (real weights, ReLU FFN, not fine-tuned)."""
    d = tmp_path_factory.mktemp("relu") / "stories260K-relu-raw"
    shutil.copytree(stories_hf, d)
    for p in d.iterdir():
        p.chmod(0o644)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "relu"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(params=["native", "scalar"])
def lib(request):
    """The C kernels as built for this CPU, and the portable build without SIMD (skipped where
    the C kernels cannot be built)."""
    from powerinfer.runtime import kernels

    try:
        kernels.set_backend("c")
    except RuntimeError as e:
        pytest.skip(str(e))
    saved = kernels._state["lib"]
    if request.param == "scalar":
        kernels._state["lib"] = kernels._build(native=False)
    yield request.param
    kernels._state["lib"] = saved
    kernels.set_backend("auto")


@pytest.fixture(params=["torch", "c"])
def backend(request):
    """Run the test with each kernel backend (c is skipped where it cannot be built)."""
    from powerinfer.runtime import kernels

    try:
        kernels.set_backend(request.param)
    except RuntimeError as e:
        pytest.skip(str(e))
    yield request.param
    kernels.set_backend("auto")


@pytest.fixture(scope="session")
def relu_sparse_gguf(tmp_path_factory, relu_hf) -> Path:
    """stories260K-relu with random predictors (a real sparse mix of rows per token), as an f32 PWRI file."""
    from helpers import random_predictors
    from powerinfer.convert.writer import convert

    tmp = tmp_path_factory.mktemp("relu-sparse")
    cfg = json.loads((relu_hf / "config.json").read_text())
    random_predictors(tmp / "pred", cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"])
    return convert(relu_hf, tmp / "m.powerinfer.gguf", tmp / "pred", outtype="f32", progress=False)


@pytest.fixture
def c_kernels():
    """The C kernels for one test; the backend in effect before is restored after it."""
    from powerinfer.runtime import kernels

    saved = dict(kernels._state)
    kernels.set_backend("c")
    yield
    kernels._state.update(saved)

"""A normal (non-editable) install: the wheel holds every file the package reads beside its modules.

The C sources are compiled at first use from paths next to the modules (``kernels.SOURCE``,
``cold_rows.CSOURCE``...) and the demo model is read from ``powerinfer.ASSETS``: a wheel missing
one of them breaks that command only in a real install (an editable one reads the source tree).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

PKG = ROOT / "powerinfer"


def _data_files() -> set[str]:
    """Every file under ``powerinfer/`` that is not Python source or bytecode, as wheel names."""
    out = set()
    for p in PKG.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc"):
            out.add(p.relative_to(ROOT).as_posix())
    return out


def _paths_the_runtime_opens() -> set[str]:
    """The package's module-level Path constants that point inside it (the C sources, the assets)."""
    import importlib
    import pkgutil

    import powerinfer

    found = set()
    names = ["powerinfer"] + [m.name for m in pkgutil.walk_packages(powerinfer.__path__, "powerinfer.")
                              if m.name.startswith("powerinfer.runtime.")]
    for name in names:
        for v in vars(importlib.import_module(name)).values():
            if isinstance(v, Path) and v.resolve().is_relative_to(PKG.resolve()):
                for f in ([v] if v.is_file() else [q for q in v.rglob("*") if q.is_file()]):
                    found.add(f.resolve().relative_to(ROOT.resolve()).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    # a setuptools here that builds wheels: offline; else pip fetches one from the index (isolated build)
    offline = subprocess.run([sys.executable, "-c", "import setuptools.command.bdist_wheel"],
                             capture_output=True).returncode == 0
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(PKG, src / "powerinfer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = src / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *(["--no-build-isolation"] if offline else []),
                        "-q", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = dist.glob("powerinfer-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def test_wheel_ships_every_data_file(wheel_names):
    data = _data_files()
    assert "powerinfer/runtime/cold_rows.c" in data and "powerinfer/assets/stories260K-relu/config.json" in data
    missing = sorted(data - wheel_names)
    assert not missing, f"pyproject.toml's package-data leaves these out of the wheel: {missing}"


def test_wheel_ships_what_the_runtime_opens(wheel_names):
    opened = _paths_the_runtime_opens()
    # the four C sources the kernels and the row reader compile, and the demo model
    assert {"powerinfer/runtime/kernels.c", "powerinfer/runtime/qkernels.c", "powerinfer/runtime/sparse_ffn.c",
            "powerinfer/runtime/cold_rows.c", "powerinfer/assets/stories260K-relu/model.safetensors"} <= opened
    assert not sorted(opened - wheel_names)

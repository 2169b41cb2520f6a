"""What both calibration stages do before the pass: check the model, pick device and dtype,
join a torchrun job, check the disk, and name the run for resuming."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import PowerInferError
from ..families import Activation, Family
from ..formats.collected import fingerprint
from .distributed import Dist, env_int, init_distributed, resolve_device
from .hooks import require_sparse
from .stream import DTYPES, dtype_name

__all__ = ["CalibrationSession", "open_session", "default_dtype", "run_key", "check_disk", "check_paths"]


def default_dtype(device: torch.device) -> str:
    """``bf16`` on a GPU; on the CPU ``bf16`` where it has bf16 dot-product instructions
    (AVX512-BF16, AMX, Arm BF16), else ``f32``.

    From measurements (README, "Profiling a 7B..."; ``benchmarks/bench_dtype.py``): against
    f32, bf16 flips 0.1-0.4% of the (token, neuron) activation decisions and leaves
    predictor recall within 0.001, so it costs nothing in quality; but without bf16
    instructions (AVX2-only CPUs such as this project's machines) torch's bf16 matmul runs
    ~8x slower than f32, so there f32 is the default.
    """
    from ..hardware import cpu_has_bf16

    return "bf16" if device.type == "cuda" or cpu_has_bf16() else "f32"


@dataclass
class CalibrationSession:
    """A checked model folder and the device, dtype and torchrun job it will be calibrated on."""

    model_dir: Path
    family: Family
    cfg: dict[str, Any]
    act: Activation
    dims: dict[str, int]
    device: torch.device
    dtype: torch.dtype
    dist: Dist

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def open_session(model_dir: str | Path, what: str, device: str = "cpu", dtype: str | None = None) -> CalibrationSession:
    """Resolve the model's family, refuse dense models, resolve the device and join torchrun.

    ``dtype``: ``f32``, ``bf16``, ``f16`` or None (:func:`default_dtype`). Raises
    PowerInferError for an unsupported or dense model, a config that disagrees with its checkpoint
    (:func:`powerinfer.hf.check_model`), an unknown dtype or device.
    """
    from ..hf import check_model, resolve_model

    family, cfg, act = resolve_model(model_dir)
    if family.experts:
        raise PowerInferError(f"{Path(model_dir) / 'config.json'}: {what} does not support mixture-of-experts models "
                              f"({family.name}): their FFN neurons belong to experts, which no predictor layout covers "
                              "(pi-profile on the model's GGUF counts its routing)")
    require_sparse(act, model_dir, what)  # a dense model is refused before its checkpoint is read
    checked = check_model(model_dir)  # config values, layer count, every tensor's shape and dtype
    family, cfg, act, dims = checked.family, checked.cfg, checked.act, checked.dims
    dev = resolve_device(device, env_int("LOCAL_RANK", 0))
    name = dtype or default_dtype(dev)
    if name not in DTYPES:
        raise PowerInferError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    if dev.type == "cpu" and name == "f16":
        raise PowerInferError("--dtype f16 is for GPUs: CPU f16 matmuls are slow and inexact; use f32 or bf16")
    return CalibrationSession(Path(model_dir), family, cfg, act, dims, dev, DTYPES[name], init_distributed(dev))


def run_key(model_dir: str | Path, data: str | Path, **settings: Any) -> dict[str, Any]:
    """The identity of a calibration run: model and data fingerprints plus ``settings``."""
    return dict(model=str(Path(model_dir).resolve()), model_files=fingerprint(model_dir), data=str(data),
                data_files=fingerprint(data), **settings)


def _existing_parent(p: Path) -> Path:
    """``p`` itself or its nearest existing ancestor."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_disk(work_dir: Path, n_tokens: int, s: CalibrationSession, pairs: bool) -> None:
    """Refuse to start when the work folder's disk cannot hold the run's files.

    Hidden states: two ``[n_tokens, n_embd]`` files in the compute dtype (per process);
    predictor rows: ``n_layer`` x (float16 inputs + bit-packed masks) per token.
    """
    d = s.dims
    elem = torch.empty((), dtype=s.dtype).element_size()
    need = 2 * n_tokens * d["n_embd"] * elem
    if pairs:
        need += n_tokens * d["n_layer"] * (2 * d["n_embd"] + (d["n_ff"] + 7) // 8)
    probe = _existing_parent(work_dir)  # nothing is created before the pass starts
    if probe.exists() and not probe.is_dir():
        raise PowerInferError(f"{probe}: is a file, so --work-dir {work_dir} cannot be a folder")
    free = shutil.disk_usage(probe).free
    if need > free:
        raise PowerInferError(f"{work_dir}: calibrating {n_tokens} tokens needs about {need / 2**30:.2f} GiB of disk "
                              f"but only {free / 2**30:.2f} GiB is free (lower --max-tokens or pick another --work-dir)")


def check_paths(**paths: Path | str | None) -> None:
    """The stage's output folders (``out=``, ``work_dir=``, ``activation_out=`` ...) must be
    separate (none inside another) and creatable -- checked before hours of work, not after.
    Raises PowerInferError naming the options."""
    given = {k: Path(v).resolve() for k, v in paths.items() if v is not None}
    names = list(given)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            pa, pb = given[a], given[b]
            if pa == pb or pa in pb.parents or pb in pa.parents:
                raise PowerInferError(f"--{a.replace('_', '-')} {paths[a]} and --{b.replace('_', '-')} {paths[b]} "
                                      f"overlap; give each its own folder")
    for k, p in given.items():
        probe = _existing_parent(p)
        folder = probe if probe.is_dir() else probe.parent
        if not os.access(folder, os.W_OK):
            raise PowerInferError(f"{paths[k]}: cannot be written (--{k.replace('_', '-')}: {folder} is not writable)")

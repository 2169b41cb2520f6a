"""Data-parallel calibration with ``torchrun`` (``torch.distributed``).

``torchrun --nproc-per-node N pi-profile ...`` starts N copies of the stage; each reads
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the environment torchrun sets, calibrates its
contiguous share of the batches (:meth:`powerinfer.calibrate.plan.CalibrationPlan.shard`)
through every layer, and the per-neuron counts are summed with ``all_reduce`` (gloo for
CPU processes, nccl for GPUs). Multi-node runs are the same command with torchrun's
rendezvous flags (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``); predictor training
then needs its work folder on a file system every node sees, since each layer's rows
come from every rank.

Without torchrun (``WORLD_SIZE`` unset or 1) everything here is a no-op on one process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import PowerInferError

__all__ = ["Dist", "init_distributed", "resolve_device", "env_int"]


@dataclass
class Dist:
    """This process's place in the job (``world == 1``: not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over all ranks (in place; returns it). nccl needs ``t`` on this rank's GPU."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather_dicts(self, d: dict) -> dict:
        """The union of every rank's dict (picklable values); also a barrier."""
        if self.world == 1:
            return dict(d)
        import torch.distributed as dist

        parts: list = [None] * self.world
        dist.all_gather_object(parts, d)
        out: dict = {}
        for part in parts:
            out.update(part)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def env_int(name: str, default: int) -> int:
    """A non-negative integer from the environment torchrun sets. Raises PowerInferError."""
    raw = os.environ.get(name, "") or str(default)
    if not raw.isdigit() or int(raw) > 1 << 20:
        raise PowerInferError(f"environment variable {name}={raw!r}: expected a small non-negative integer "
                              f"(torchrun sets it)")
    return int(raw)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``cpu``, ``cuda`` (this process's GPU: ``cuda:LOCAL_RANK``) or ``cuda:N``.

    Raises PowerInferError for an unknown device or a GPU that is not there.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PowerInferError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise PowerInferError(f"--device {device!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise PowerInferError(f"--device {device}: no CUDA GPU is available to this torch "
                              f"({torch.__version__}); use --device cpu")
    index = dev.index if dev.index is not None else local_rank
    if index >= torch.cuda.device_count():
        raise PowerInferError(f"--device {device}: GPU {index} does not exist "
                              f"({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(device: torch.device | str = "cpu") -> Dist:
    """Join the torchrun job described by the environment (or return a one-process Dist).

    Backend: nccl when ``device`` is a GPU, gloo otherwise. Raises PowerInferError when
    the environment names a job but the process group cannot be formed.
    """
    world = env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Dist()
    import torch.distributed as dist

    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend)
        except Exception as e:  # noqa: BLE001 - rendezvous failures come in many types
            raise PowerInferError(f"could not join the torchrun job (rank {rank} of {world}, {backend}): "
                                  f"{str(e).splitlines()[0]}") from None
    return Dist(rank=rank, world=world, local_rank=local_rank, backend=backend)

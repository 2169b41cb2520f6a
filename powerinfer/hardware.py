"""What the CPU can do fast: feature flags and native bf16 dot products.

Shared by the runtime (its ``--dtype auto``) and the calibration stages (their CPU
default dtype).
"""
from __future__ import annotations

import platform
from functools import lru_cache

__all__ = ["cpu_flags", "cpu_has_bf16"]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(val.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16(flags: frozenset[str] | set[str] | None = None) -> bool:
    """True when the CPU computes bf16 dot products natively (so bf16 matmuls are fast)."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512_bf16", "amx_bf16"} & set(flags):
        return True
    return platform.machine().lower() in ("aarch64", "arm64") and "bf16" in flags

"""The machine: CPU feature flags, native bf16 dot products, handing freed memory back.

Shared by the runtime (its ``--dtype auto``) and the calibration stages (their CPU
default dtype, their per-layer memory release).
"""
from __future__ import annotations

import platform
from functools import lru_cache

__all__ = ["cpu_flags", "cpu_has_bf16", "missing_simd", "release_memory"]

SIMD = ("avx2", "fma", "f16c")  # what the C kernels' vector paths need on x86-64 (qkernels.c: PI_AVX2)


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


def missing_simd(flags: frozenset[str] | set[str] | None = None, machine: str | None = None) -> list[str]:
    """The x86 features of :data:`SIMD` this CPU lacks (then the C kernels compile their
    portable scalar code, which is correct but several times slower); [] elsewhere or when
    the flags cannot be read."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64") or not flags:
        return []
    return [f for f in SIMD if f not in flags]


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere a no-op).

    The calibration stages call it after each layer: a layer's tensors and activations are
    tens of MB each, often below glibc's adaptive mmap threshold, so they come from the heap,
    whose high-water mark otherwise creeps up by about one activation tensor per layer
    (~22 MB per 7B layer measured).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass

"""The KV cache: keys and values of every layer and position, in a type of their own.

llama.cpp keeps keys and values in f16 whatever the compute type (``-ctk``/``--cache-type-k`` and
``-ctv``/``--cache-type-v`` choose another, default ``f16``); this runtime does the same: the
compute dtype (f32 on AVX2 CPUs, bf16 with AVX512_BF16) is rounded to the cache type when a
position is written, and read back

* by the C decode attention (:func:`~powerinfer.runtime.kernels.attend_one`/``attend_many``) in
  the cache's own bytes: f16 converted to fp32 in registers (F16C / AVX512F), bf16 by a 16-bit
  shift, q8_0 int8 times its block's scale, fp32 sums; no f32 copy of the cache is made per step;
* by prompts (torch SDPA), which convert the span they read to the compute dtype.

Types (:data:`~powerinfer.cli_params.KV_CACHE_TYPES`): ``f32``, ``f16``, ``bf16`` and ``q8_0``
(ggml's block: per 32 values an f16 scale ``amax / 127`` and 32 int8, 34 bytes; head_dim must be a
multiple of 32, as llama.cpp requires), held as bytes (``torch.uint8``, the marker dtype
:data:`Q8_0`). Values are quantized when written (:func:`store`); prompts dequantize the span they
read (:func:`load`). llama.cpp's other quantized cache types (``q4_0``, ``q4_1``, ``q5_0``,
``iq4_nl``, ...) are refused with a message naming the supported ones.

Shapes: ``[n_layer, n_ctx, Hkv, W]`` each for keys and values; ``Hkv`` = n_head_kv, ``W`` = head_dim
``d`` (``d / 32 * 34`` bytes for q8_0).
"""
from __future__ import annotations

import torch

from ..cli_params import DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES, check_cache_type
from ..errors import PowerInferError
from .weights import zeros

Q8_0 = torch.uint8  # a q8_0 cache is held as its bytes
Q8_BLOCK, Q8_BYTES = 32, 34  # values per block, bytes per block (f16 scale + 32 int8)
CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": Q8_0}
assert tuple(CACHE_DTYPES) == KV_CACHE_TYPES
__all__ = ["KVCache", "CACHE_DTYPES", "Q8_0", "DEFAULT_KV_CACHE_TYPE", "store", "load", "quantize_q8_0",
           "dequantize_q8_0", "cache_dtype", "check_head_dim", "type_name", "kv_dtypes", "available_memory",
           "size_text"]


def cache_dtype(name: str | torch.dtype, flag: str = "--cache-type-k") -> torch.dtype:
    """``f32`` | ``f16`` | ``bf16`` | ``q8_0`` (or a torch dtype among them, :data:`Q8_0` for q8_0) ->
    torch dtype; PowerInferError ``--cache-type-k q4_1: unsupported KV cache type (supported: f32, f16,
    bf16, q8_0)`` otherwise."""
    if isinstance(name, torch.dtype):
        if name not in CACHE_DTYPES.values():
            raise PowerInferError(f"{flag} {name}: unsupported KV cache type (supported: {', '.join(KV_CACHE_TYPES)})")
        return name
    return CACHE_DTYPES[check_cache_type(name, flag)]


def type_name(dtype: torch.dtype) -> str:
    """``f32`` / ``f16`` / ``bf16`` / ``q8_0``: the ``-ctk``/``-ctv`` name of a cache dtype."""
    return next(n for n, t in CACHE_DTYPES.items() if t == dtype)


def kv_dtypes(k: str | torch.dtype | None, v: str | torch.dtype | None,
              default: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(key dtype, value dtype)``; None: ``default`` (a library caller's compute dtype)."""
    return (default if k is None else cache_dtype(k, "--cache-type-k"),
            default if v is None else cache_dtype(v, "--cache-type-v"))


def check_head_dim(dtypes: tuple[torch.dtype, torch.dtype], head_dim: int) -> None:
    """PowerInferError ``--cache-type-k q8_0: head_dim 8 is not a multiple of 32 ...`` when a q8_0
    cache cannot hold this model's heads (checked before the weights are loaded)."""
    for t, flag in zip(dtypes, ("--cache-type-k", "--cache-type-v")):
        if t == Q8_0 and head_dim % Q8_BLOCK:
            raise PowerInferError(f"{flag} q8_0: head_dim {head_dim} is not a multiple of {Q8_BLOCK} "
                                  "(q8_0 blocks); use f16")


def size_text(nbytes: int) -> str:
    """``512 MiB`` or ``2.0 GiB``."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.1f} GiB"


def available_memory() -> int | None:
    """Bytes of memory the system could give now (MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one head's row in the cache: ``head_dim``, or its q8_0 bytes."""
    return head_dim // Q8_BLOCK * Q8_BYTES if dtype == Q8_0 else head_dim


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one head's keys (or values) at one position."""
    return row_width(dtype, head_dim) * _elem(dtype)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., d]`` (d a multiple of 32) -> q8_0 bytes ``[..., d / 32 * 34]`` uint8: per block the
    f16 scale ``amax / 127``, then ``round(x / scale)`` as int8 (ggml's ``quantize_row_q8_0`` rule)."""
    b = x.float().unflatten(-1, (-1, Q8_BLOCK))  # [..., nb, 32]
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1 / d, torch.zeros_like(d))).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [..., nb, 34]
    return out.flatten(-2)


def dequantize_q8_0(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q8_0 bytes ``[..., nb * 34]`` -> values ``[..., nb * 32]`` in ``dtype``."""
    b = raw.unflatten(-1, (-1, Q8_BYTES))
    d = b[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).flatten(-2).to(dtype)


def store(dst: torch.Tensor, pos: int, x: torch.Tensor) -> None:
    """Write ``x`` ``[T, Hkv, d]`` at positions ``pos..pos+T-1`` of a layer's keys or values ``dst``
    ``[n_ctx, Hkv, W]``: rounded to ``dst``'s type (quantized for q8_0)."""
    if dst.dtype == Q8_0:
        dst[pos:pos + x.shape[0]] = quantize_q8_0(x)
    else:
        dst[pos:pos + x.shape[0]] = x


def load(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A span of a layer's keys or values ``[S, Hkv, W]`` as values ``[S, Hkv, d]`` in ``dtype``
    (a copy unless already in ``dtype``)."""
    return dequantize_q8_0(src, dtype) if src.dtype == Q8_0 else src.to(dtype)


class KVCache:
    """Keys ``k`` and values ``v`` for every layer and position: ``[n_layer, n_ctx, Hkv, d]`` each,
    keys in ``dtype``, values in ``v_dtype`` (default ``dtype``; llama.cpp's ``-ctk``/``-ctv``).

    Memory becomes resident as positions are written. Raises PowerInferError, before allocating,
    when the whole cache would not fit the memory available now."""

    @staticmethod
    def nbytes(n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, dtype: torch.dtype,
               v_dtype: torch.dtype | None = None) -> int:
        """Bytes of keys (``dtype``) plus values (``v_dtype``, default ``dtype``) for ``n_ctx`` positions."""
        per = n_layer * n_ctx * n_head_kv
        return per * (row_bytes(dtype, head_dim) + row_bytes(v_dtype or dtype, head_dim))

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, dtype: torch.dtype,
                 v_dtype: torch.dtype | None = None):
        dtype, v_dtype = cache_dtype(dtype), cache_dtype(v_dtype or dtype, "--cache-type-v")
        check_head_dim((dtype, v_dtype), head_dim)
        nbytes = self.nbytes(n_layer, n_ctx, n_head_kv, head_dim, dtype, v_dtype)
        avail = available_memory()
        if avail is not None and nbytes > avail:
            raise PowerInferError(f"the KV cache for a context of {n_ctx} tokens needs {nbytes / 2**30:.1f} GiB, "
                                  f"more than the {avail / 2**30:.1f} GiB of memory available: ask for less with -c"
                                  + (" or a smaller --cache-type-k/-v" if max(_elem(dtype), _elem(v_dtype)) > 1 else ""))
        self.dtypes = (dtype, v_dtype)
        # resident as positions are written, not all at once (a 4096-token f16 cache of a 7B is 2 GiB)
        self.head_dim = head_dim
        self.k = zeros((n_layer, n_ctx, n_head_kv, row_width(dtype, head_dim)), dtype)
        self.v = zeros((n_layer, n_ctx, n_head_kv, row_width(v_dtype, head_dim)), v_dtype)
        self._layers = [(self.k[i], self.v[i]) for i in range(n_layer)]  # views, made once (not per token)
        self._cpu = list(range(n_layer))  # layers whose keys and values are rows of k, v

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values ``[n_ctx, Hkv, W]`` each, on the device that layer runs on
        (write with :func:`store`, read with :func:`load` or the C attention)."""
        return self._layers[i]

    def move_layers(self, ids: list[int], device: torch.device | str, dtype: torch.dtype) -> None:
        """Keep layers ``ids``' keys and values on ``device`` in ``dtype`` (the device side's compute
        dtype, what its SDPA reads; a CPU device keeps the cache's own types, which the C attention
        reads); what they hold so far is copied. The CPU block shrinks to the remaining layers."""
        gone = set(ids) & set(self._cpu)
        cpu = torch.device(device).type == "cpu"
        for i in gone:
            k, v = self._layers[i]
            self._layers[i] = (k.to(device, copy=True) if cpu else load(k, dtype).to(device),
                               v.to(device, copy=True) if cpu else load(v, dtype).to(device))
        self._cpu = [i for i in self._cpu if i not in gone]
        if self._cpu:  # a new, smaller CPU block holding the remaining layers
            self.k = torch.stack([self._layers[i][0] for i in self._cpu])
            self.v = torch.stack([self._layers[i][1] for i in self._cpu])
        else:
            self.k, self.v = self.k[:0].clone(), self.v[:0].clone()
        for r, i in enumerate(self._cpu):
            self._layers[i] = (self.k[r], self.v[r])

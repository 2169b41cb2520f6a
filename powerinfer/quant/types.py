"""GGML block types: block size, bytes per block, and checks for a tensor of that type.

Layouts (ggml-common.h; little-endian, ``d`` an IEEE half):

* ``Q4_0`` (32 values, 18 bytes): ``d``, then 16 bytes of nibbles; value ``j`` (``j < 16``)
  is ``d * ((qs[j] & 15) - 8)``, value ``j + 16`` is ``d * ((qs[j] >> 4) - 8)``.
* ``Q8_0`` (32 values, 34 bytes): ``d``, then 32 signed bytes; value ``j`` is ``d * qs[j]``.
* ``Q4_K`` (256 values, 144 bytes) and ``Q6_K`` (256 values, 210 bytes): super-blocks with
  6-bit sub-block scales (read, not written: ``gguf`` has no reference quantizer for them).
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import PowerInferError


@dataclass(frozen=True)
class BlockType:
    name: str  # GGML's name: "Q4_0"
    ggml: QT
    block: int  # values per block
    nbytes: int  # bytes per block

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` values (``n`` a multiple of :attr:`block`)."""
        return n // self.block * self.nbytes


def _bt(name: str) -> BlockType:
    q = QT[name]
    block, nbytes = GGML_QUANT_SIZES[q]
    return BlockType(name, q, block, nbytes)


FLOAT_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
# Types the runtime computes on in place (C kernels); others are dequantized at load.
KERNEL_TYPES = {n: _bt(n) for n in ("Q4_0", "Q8_0", "Q4_K", "Q6_K")}
# Types pi-convert --outtype and pi-quantize write (ggml-exact quantizers in .ggml).
WRITE_TYPES = {"q4_0": KERNEL_TYPES["Q4_0"], "q8_0": KERNEL_TYPES["Q8_0"]}


def check_quantized(path, name: str, qtype: QT, shape: tuple[int, ...], n_bytes: int) -> BlockType | None:
    """The :class:`BlockType` of a file tensor (None for float types), after checking its size.

    ``shape`` is torch order (rows first). Raises PowerInferError naming the tensor when
    the row length is not a multiple of the block size or the byte size does not match
    type and shape.
    """
    if qtype.name in FLOAT_TYPES:
        return None
    block, nbytes = GGML_QUANT_SIZES[qtype]
    k = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    if k % block:
        raise PowerInferError(f"{path}: tensor {name!r} ({qtype.name}) has rows of {k} values, "
                              f"not a multiple of the {qtype.name} block size {block}")
    want = rows * (k // block) * nbytes
    if want != n_bytes:
        raise PowerInferError(f"{path}: tensor {name!r} ({qtype.name}, shape {list(shape)}) has {n_bytes} bytes, "
                              f"expected {want}")
    return KERNEL_TYPES.get(qtype.name)

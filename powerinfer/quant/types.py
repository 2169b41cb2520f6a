"""GGML block types: block size, bytes per block, and checks for a tensor of that type.

Layouts (ggml-common.h; little-endian, ``d`` an IEEE half):

* ``Q4_0`` (32 values, 18 bytes): ``d``, then 16 bytes of nibbles; value ``j`` (``j < 16``)
  is ``d * ((qs[j] & 15) - 8)``, value ``j + 16`` is ``d * ((qs[j] >> 4) - 8)``.
* ``Q8_0`` (32 values, 34 bytes): ``d``, then 32 signed bytes; value ``j`` is ``d * qs[j]``.
* ``Q5_0`` (32 values, 22 bytes): ``d``, 4 bytes ``qh``, 16 bytes of nibbles as Q4_0; value ``j``
  is ``d * ((nibble | bit j of qh << 4) - 16)``. ``Q5_1`` (24 bytes): ``d``, ``m``, ``qh``, nibbles;
  value ``d * q + m``. llama.cpp's quantizer writes them in Q4_K_M / Q5_K_M files for the tensors
  whose rows are not a multiple of 256 values (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0;
  ``tensor_type_fallback`` in ``src/llama-quant.cpp``), e.g. Qwen2.5-0.5B's n_embd 896.
* ``Q4_K`` (256 values, 144 bytes), ``Q5_K`` (176 bytes) and ``Q6_K`` (210 bytes): super-blocks
  with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales (read, not written: ``gguf`` 0.19 has
  dequantizers but no reference quantizers for them).
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT



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
KERNEL_TYPES = {n: _bt(n) for n in ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
# Types pi-convert --outtype and pi-quantize write (ggml-exact quantizers in .ggml).
WRITE_TYPES = {"q4_0": KERNEL_TYPES["Q4_0"], "q8_0": KERNEL_TYPES["Q8_0"]}



"""Quantized weights: GGML block types, ggml-exact quantizers, and the weights the runtime computes on.

* :mod:`.types`: the block layouts this project reads and writes (GGML's Q4_0, Q8_0, and
  the types it reads: Q5_0, Q5_1 and the K-quants Q4_K/Q5_K/Q6_K of llama.cpp's K-quant files), row sizes,
  and the checks a file's tensor must pass.
* :mod:`.ggml`: numpy quantizers that reproduce ggml's reference ``quantize_row_*_ref``
  bit for bit (used by ``pi-convert --outtype`` and ``pi-quantize``).
* :mod:`.qweight`: :class:`QWeight`, a quantized matrix kept in the file's memory map,
  which the runtime's kernels compute on directly.
"""

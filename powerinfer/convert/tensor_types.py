"""Which GGML type each tensor gets in a written file, and its bytes in that type.

One rule, shared by ``pi-convert --outtype`` and ``pi-quantize`` (:func:`tensor_type`):

* 1-D tensors (norms, biases) and MoE routers (``blk.i.ffn_gate_inp.weight``, as llama.cpp's
  converter and quantizer keep them) are F32; 3-D stacked experts (``ffn_*_exps``) are typed as
  2-D matrices are, row by row;
* the predictor matrices ``blk.i.fc1.weight`` / ``blk.i.fc2.weight`` get the predictor
  type: ``--predictor-type`` when given, else the outtype for ``f16``/``f32`` files and
  :data:`DEFAULT_PREDICTOR_TYPE` for quantized ones;
* ``output.weight`` is Q8_0 in a quantized file. Upstream PowerInfer's ``quantize`` (as
  llama.cpp's) writes it as Q6_K; the ``gguf`` package has no Q6_K quantizer, and Q8_0
  (8.5 bits per weight) is the more precise of the two, at ~30% more bytes for that one
  tensor;
* every other 2-D tensor, ``token_embd`` included (as llama.cpp does), gets the outtype;
* a quantized type needs rows whose length is a multiple of 32: a 2-D tensor whose rows
  are not falls back to F16 (the caller logs one note naming them, :func:`fallback_note`).

:data:`DEFAULT_PREDICTOR_TYPE` is Q8_0, from ``benchmarks/bench_predictor_quant.py`` on
the demo model's trained predictors (6,316 held-out tokens, threshold 0): with Q8_0
weights held-out recall moves by at most 0.0002 from f32/f16 on every layer and the
predicted-active share by at most 0.0005; with Q4_0 recall drops by 0.024-0.071 per layer
(0.998 -> 0.927 on layer 3) while the predicted-active share grows by 0.0015-0.0142. Upstream
PowerInfer's ``quantize`` quantizes the predictors along with the model (to Q4_0 for a
Q4_0 file; its maintainers say so in upstream issue #120). Q8_0 costs ~1.9x Q4_0's bytes
for the predictors only.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import gguf
import numpy as np

from ..quant import ggml
from ..quant.types import WRITE_TYPES

QT = gguf.GGMLQuantizationType

from .type_names import DEFAULT_PREDICTOR_TYPE, OUTTYPES, PREDICTOR_TYPES  # noqa: E402  (the CLIs' names)
OUTPUT_TYPE = "q8_0"  # output.weight in quantized files

GGML_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q4_0": QT.Q4_0, "q8_0": QT.Q8_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
UPSTREAM_Q8_0_SPARSE = (
    "q8_0 output: upstream PowerInfer's CPU sparse kernel reads ffn_down_t only as f16/Q4_0 (ggml.c, "
    "mul_mat_axpy; upstream issue #233: q8_0 files print '###'); use q4_0 for upstream, this file with pi-run")
_PREDICTOR = re.compile(r"blk\.\d+\.fc[12]\.weight")


def is_predictor(name: str) -> bool:
    return _PREDICTOR.fullmatch(name) is not None


def _wanted(name: str, shape: tuple[int, ...], outtype: str, predictor_type: str | None) -> str:
    if len(shape) < 2 or len(shape) > 3 or name.endswith(".ffn_gate_inp.weight"):
        return "f32"
    if is_predictor(name):
        return predictor_type or (outtype if outtype in ("f16", "bf16", "f32") else DEFAULT_PREDICTOR_TYPE)
    if name == "output.weight" and outtype in WRITE_TYPES:
        return OUTPUT_TYPE
    return outtype


def falls_back(name: str, shape: tuple[int, ...], outtype: str, predictor_type: str | None = None) -> bool:
    """True when ``name`` is written in F16 only because its rows are not a multiple of 32."""
    return _wanted(name, shape, outtype, predictor_type) in WRITE_TYPES and shape[-1] % ggml.QK != 0


def tensor_type(name: str, shape: tuple[int, ...], outtype: str, predictor_type: str | None = None) -> QT:
    """The GGML type of tensor ``name`` (torch-order ``shape``) in an ``outtype`` file
    (one of :data:`OUTTYPES`); ``predictor_type`` None means the default for ``outtype``."""
    if falls_back(name, shape, outtype, predictor_type):
        return QT.F16
    return GGML_TYPES[_wanted(name, shape, outtype, predictor_type)]


def fallback_note(names_shapes: list[tuple[str, tuple[int, ...]]], outtype: str) -> str:
    """The one log line for tensors kept in F16 because their rows are not a multiple of 32."""
    shown = ", ".join(f"{n} {list(s)}" for n, s in names_shapes[:6])
    more = f" and {len(names_shapes) - 6} more" if len(names_shapes) > 6 else ""
    return (f"{len(names_shapes)} tensor(s) kept in f16 instead of {outtype}: rows of a length that is not a "
            f"multiple of {ggml.QK} cannot be quantized ({shown}{more})")


def nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    """Bytes of a tensor of torch-order ``shape`` in ``qtype``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    return n // block * size


class Encoded:
    """A tensor's bytes in its file type, produced a chunk of rows at a time when written.

    Passed to ``gguf.GGUFWriter.write_tensor_data``, which needs only ``nbytes`` and
    ``tofile``, so a tensor is never held whole in its output type.
    """

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[np.ndarray]]):
        self.nbytes = nbytes
        self._chunks = chunks

    def tofile(self, f) -> None:
        n = 0
        for c in self._chunks():
            c = np.ascontiguousarray(c)
            f.write(memoryview(c).cast("B"))
            n += c.nbytes
        if n != self.nbytes:
            raise AssertionError(f"wrote {n} bytes, expected {self.nbytes}")


def encode(arr: Any, qtype: QT, tensor: str, chunk_values: int = ggml.CHUNK_VALUES) -> Encoded:
    """``arr`` (torch order, any float dtype; anything with ``shape``, ``ndim``, ``reshape``
    and row slicing, such as a memory map, is read a chunk of rows at a time) in ``qtype``
    (F32, F16, BF16, Q4_0 or Q8_0). Quantizing raises PowerInferError naming ``tensor`` and the row
    for NaN or infinite values (at write time)."""
    shape = tuple(arr.shape)
    rows = arr.reshape(1, -1) if arr.ndim < 2 else arr.reshape(-1, shape[-1])
    step = max(1, chunk_values // max(rows.shape[1], 1))
    name = qtype.name.lower()
    if name in WRITE_TYPES:
        def convert(x: np.ndarray, s: int) -> np.ndarray:
            return ggml.quantize(x, name, tensor, first_row=s)
    elif qtype == QT.BF16:  # fp32 rounded to nearest even on the top 16 bits (gguf's reference)
        def convert(x: np.ndarray, s: int) -> np.ndarray:
            return gguf.quants.quantize(np.asarray(x, dtype=np.float32), QT.BF16)
    else:
        dt = {QT.F32: np.float32, QT.F16: np.float16}[qtype]

        def convert(x: np.ndarray, s: int) -> np.ndarray:
            return np.asarray(x).astype(dt, copy=False)
    return Encoded(nbytes(shape, qtype),
                   lambda: (convert(rows[s:s + step], s) for s in range(0, rows.shape[0], step)))

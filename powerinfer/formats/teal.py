"""Input-sparse (TEAL-style) GGUF files: calibrated thresholds on the inputs of every matrix.

Training-free activation sparsity (TEAL, arXiv 2408.14690) zeroes the entries ``x_j`` of a
matrix's *input* whose magnitude is below a per-matrix threshold, so ``y = W x`` only needs
the columns ``j`` of ``W`` with ``|x_j| >= t``. A sparse file stores those columns as rows.

Contract (this project's; no upstream reader knows these keys):

* An ordinary GGUF (magic ``GGUF``, never ``PWRI``: there is no predictor) of a gated SiLU/GELU
  family (``llama``, ``qwen2``, ``qwen3``), with all its usual metadata, plus
* ``powerinfer.teal.sparsity`` (FLOAT32): the model-wide target it was calibrated for, in
  ``[0, MAX_SPARSITY]`` (the share of input entries zeroed, weighted by parameters);
* ``powerinfer.teal.method`` (STRING): how the per-matrix levels were chosen (``uniform``:
  every input at the target; ``greedy``: TEAL's block-wise allocation; ``wina``: every input at
  the target, ranked by WINA's weighted magnitude, below; ``wina-greedy``: that ranking with the
  block-wise allocation);
* per layer ``i``, ``blk.{i}.teal_thresholds`` (F32 ``[4]``): thresholds on ``|x|`` for the
  input of q/k/v (the normed attention input), of ``attn_output`` (the attention heads'
  output), of ``ffn_gate``/``ffn_up`` (the normed FFN input) and of ``ffn_down`` (the gated
  activation ``act(gate) * up``), in :data:`KINDS` order. 0 means that input runs dense;
* each matrix whose input threshold is > 0 stored input-major under its name + ``_t``
  (``blk.{i}.attn_q_t.weight`` holds ``W^T``: GGUF shape ``[n_out, n_in]``, i.e. torch
  ``[n_in, n_out]``, row ``j`` = column ``j`` of ``W``, quantized along the outputs, as
  PowerInfer stores ``ffn_down_t``), and *not* under its usual name; a matrix whose threshold
  is 0 stays row-major under its usual name. Biases (Qwen2's q/k/v) keep their names.
  ``output.weight`` and ``token_embd.weight`` stay as they are (dense);
* methods ``wina`` and ``wina-greedy`` only (WINA, arXiv 2505.19427): per layer ``i`` and sparsified input ``kind``,
  ``blk.{i}.teal_colnorm_{kind}`` (F32 ``[K]``, K the input's length): ``c_j = ||W[:, j]||_2``, the
  norm of column ``j`` of the matrix consuming the input (q/k/v and gate/up: over the outputs of the
  matrices joined), from the dense source's weights. The threshold then applies to the weighted
  magnitude: input ``j`` is kept when ``|x_j| * c_j >= t``. The norms are stored, not folded into the
  weights (folding would scale norm weights and rows, so the stored matrices would no longer be the
  source's and a dense run of the same file would differ by rounding); other methods have none.

Validation (:func:`read_teal`): both keys of the right types, the sparsity in range, one
threshold tensor per layer (F32, ``[4]``, finite, ``>= 0``, ``<= MAX_THRESHOLD``), every matrix
present under exactly the name its threshold asks for with the transposed shape of the dense
one, and for ``wina`` one column-norm tensor per sparsified input (F32, ``[K]``, finite, ``>= 0``);
PowerInferError naming the file and the tensor otherwise. A file without the keys is a
dense file (None).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import PowerInferError
from .gguf_file import GGUFFile

SPARSITY_KEY = "powerinfer.teal.sparsity"
METHOD_KEY = "powerinfer.teal.method"
THRESHOLDS = "blk.{i}.teal_thresholds"
COLNORM = "blk.{i}.teal_colnorm_{kind}"
KINDS = ("qkv", "o", "gate_up", "down")  # the four inputs of a block, in threshold order
MATRICES = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
            "down": ("ffn_down",)}
METHODS = ("uniform", "greedy", "wina", "wina-greedy")
WEIGHTED = ("wina", "wina-greedy")  # methods whose thresholds apply to |x_j| * c_j (COLNORM tensors in the file)
MAX_SPARSITY = 0.9
MAX_THRESHOLD = 1e6  # |x| of a normed activation; anything larger is a corrupt file


@dataclass(frozen=True)
class TealInfo:
    """What a sparse file says: target ``sparsity``, ``method``, ``thresholds`` ``[n_layer][4]`` (floats,
    :data:`KINDS` order) and, for a weighted method, ``colnorms`` ``[n_layer][4]`` (float32 numpy ``[K]``,
    None for a dense input)."""

    sparsity: float
    method: str
    thresholds: tuple[tuple[float, float, float, float], ...]
    colnorms: tuple[tuple, ...] | None = field(default=None, compare=False)  # numpy arrays: not compared

    def sparse(self, i: int, kind: str) -> bool:
        return self.thresholds[i][KINDS.index(kind)] > 0

    def colnorm(self, i: int, kind: str) -> np.ndarray | None:
        """float32 ``[K]``: the weights of input ``kind``'s magnitudes in layer ``i`` (None: plain ``|x|``)."""
        return None if self.colnorms is None else self.colnorms[i][KINDS.index(kind)]


def is_teal(g: GGUFFile) -> bool:
    """True when ``g`` carries the TEAL keys (whether or not they are valid)."""
    return g.get(SPARSITY_KEY) is not None or g.get(METHOD_KEY) is not None


def stored_name(name: str, sparse: bool) -> str:
    """``blk.0.attn_q`` -> ``blk.0.attn_q_t.weight`` when sparse, else ``blk.0.attn_q.weight``."""
    return f"{name}_t.weight" if sparse else f"{name}.weight"


def _shape(g: GGUFFile, name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(g.tensors[name].shape.tolist()))  # torch order


def read_teal(g: GGUFFile, n_layer: int) -> TealInfo | None:
    """The TEAL record of ``g`` (a model of ``n_layer`` layers, already bounded), or None for a
    dense file. Raises PowerInferError naming the file and what is wrong; reads only ``4 n_layer``
    floats of tensor data (and the column norms of a ``wina`` file, the inputs' lengths)."""
    if not is_teal(g):
        return None
    s, m = g.get(SPARSITY_KEY), g.get(METHOD_KEY)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= MAX_SPARSITY:
        raise PowerInferError(f"{g.path}: {SPARSITY_KEY} = {s!r}: expected a number in [0, {MAX_SPARSITY}]")
    if m not in METHODS:
        raise PowerInferError(f"{g.path}: {METHOD_KEY} = {m!r}: expected one of {', '.join(METHODS)}")
    if g.sparse:
        raise PowerInferError(f"{g.path}: a PWRI (predictor) file with TEAL keys: the two kinds of sparsity "
                              "do not combine")
    rows, norms = [], []
    for i in range(n_layer):
        name = THRESHOLDS.format(i=i)
        t = g.tensors.get(name)
        if t is None:
            raise PowerInferError(f"{g.path}: {name} is missing (a TEAL file has one per layer)")
        if t.tensor_type.name != "F32" or _shape(g, name) != (4,):
            raise PowerInferError(f"{g.path}: {name} is {t.tensor_type.name} {list(_shape(g, name))}, "
                                  "expected F32 [4]")
        v = np.asarray(t.data, dtype=np.float32).reshape(4)
        if not np.isfinite(v).all() or (v < 0).any() or (v > MAX_THRESHOLD).any():
            raise PowerInferError(f"{g.path}: {name} = {v.tolist()}: thresholds must be finite, >= 0 and "
                                  f"<= {MAX_THRESHOLD:g}")
        rows.append(tuple(float(x) for x in v))
        for kind, thr in zip(KINDS, v):
            for mat in MATRICES[kind]:
                base = f"blk.{i}.{mat}"
                want, other = stored_name(base, thr > 0), stored_name(base, not thr > 0)
                if other in g.tensors:
                    raise PowerInferError(f"{g.path}: {other} present but {name} says the {kind} input is "
                                          f"{'sparse' if thr > 0 else 'dense'} (expected {want})")
                if want not in g.tensors:
                    if mat == "ffn_gate" and stored_name(base, False) not in g.tensors \
                            and stored_name(base, True) not in g.tensors:
                        raise PowerInferError(f"{g.path}: {base} is missing: TEAL files need a gated FFN")
                    raise PowerInferError(f"{g.path}: {want} is missing")
                if thr > 0 and len(_shape(g, want)) != 2:
                    raise PowerInferError(f"{g.path}: {want} is not a matrix")
        norms.append(tuple(_colnorm(g, i, kind, thr > 0, m) for kind, thr in zip(KINDS, v)))
    return TealInfo(float(s), str(m), tuple(rows), tuple(norms) if m in WEIGHTED else None)


def _colnorm(g: GGUFFile, i: int, kind: str, sparse: bool, m: str) -> np.ndarray | None:
    """The checked ``blk.{i}.teal_colnorm_{kind}`` (float32 ``[K]``) of a sparse input of a weighted method;
    None otherwise (the tensor must then be absent)."""
    name = COLNORM.format(i=i, kind=kind)
    t = g.tensors.get(name)
    if not (sparse and m in WEIGHTED):
        if t is not None:
            raise PowerInferError(f"{g.path}: {name} present, but only a sparse input of method "
                                  f"{' or '.join(WEIGHTED)} has column norms")
        return None
    if t is None:
        raise PowerInferError(f"{g.path}: {name} is missing (a {m} file has one per sparse input)")
    k = _shape(g, stored_name(f"blk.{i}.{MATRICES[kind][0]}", True))[0]
    if t.tensor_type.name != "F32" or _shape(g, name) != (k,):
        raise PowerInferError(f"{g.path}: {name} is {t.tensor_type.name} {list(_shape(g, name))}, expected F32 [{k}]")
    c = np.asarray(t.data, dtype=np.float32).reshape(k).copy()
    if not np.isfinite(c).all() or (c < 0).any():
        raise PowerInferError(f"{g.path}: {name}: column norms must be finite and >= 0")
    return c

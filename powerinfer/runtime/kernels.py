"""Decode-time CPU kernels: matrix-vector products that stream weights at memory speed.

At batch 1 every decode step is a chain of matrix-vector products, and the
speed limit is the bytes of weights read per token. Three operations cover it:

* :func:`linear`: ``x @ w.T`` for one token (attention, output, predictor, dense FFN);
* :func:`rows_dot`: dot products of ``x`` with the active rows of gate and up, read
  straight from the weight matrices (no gathered copy);
* :func:`rows_axpy`: ``sum_i coef[i] * down_t[idx[i]]``, one AXPY per active neuron;
* :func:`attend_one`: one query token against the KV cache (decode attention), keys and values
  read in the cache's own type (f32, f16 or bf16, :mod:`.kv_cache`), converted in registers;
* :func:`rows_dot_multi`, :func:`rows_axpy_multi`: the row ops for several tokens over the
  union of their rows, each row read once (batched decoding, ``runtime/batch.py``), each
  token's numbers those of the one-token op.

Each op also takes a :class:`powerinfer.quant.qweight.QWeight` (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
f16 or bf16 bytes kept in the file's memory map) and computes on it in place with
``qkernels.c``: block-quantized products quantize the activation to 8-bit blocks once per
product (as ggml does: blocks of 32, or q8_K's blocks of 256 for Q4_K/Q5_K/Q6_K) and sum integers
per block (per 256-value super-block for the K-quants); f16 rows convert to fp32 in registers
(F16C), bf16 rows by a 16-bit shift. :class:`SparseFFNCall` runs one token's whole sparse
FFN (predictor, selection, rows, down) in one call (``sparse_ffn.c``). Dense matrices in the
``x8`` layout (every dense product of a Q4_0/Q8_0/Q5_0/Q5_1/K-quant file) run the integer C
kernels at every token count (tiles of up to 4 tokens, 32 for the K-quants). Row-layout matrices
with prompts of more than :data:`QGEMM_MAX_T` tokens dequantize :data:`TILE_ROWS` rows at a time
to fp32 and use torch matmuls on the activation rounded as the kernels round it, so prompt and
decode give the same numbers; :func:`matmul` does ``hidden @ down_t`` that way, :func:`embed`
looks up token rows.

Two backends:

* ``c``: ``kernels.c``, compiled once per machine with the system C compiler
  (``cc -O3 -march=native -fopenmp``, ~1 s, cached under ``~/.cache/powerinfer``)
  and called through ctypes. ``POWERINFER_MARCH`` replaces ``native`` (e.g.
  ``POWERINFER_MARCH=haswell``: the AVX2 code an AVX2-only CPU runs, on an AVX-512 machine,
  for measuring it there); ``CC`` names the compiler. bf16 rows are multiplied with AVX512_BF16 dot-product
  instructions (fp32 sums; other CPUs convert to fp32 in registers), and gathers
  prefetch the next active row while reading the current one. Threads come from
  torch's OpenMP runtime, so ``torch.set_num_threads`` governs them too.
* ``torch``: plain torch ops (``F.linear``; ``index_select`` + ``F.linear`` for the
  gathered rows; ``embedding_bag`` with per-sample weights for the AXPYs). Always
  available, roughly half the speed of ``c`` on bf16 weights.

``set_backend("auto")`` (the default) uses ``c`` when it builds and loads, else
``torch``; the environment variable ``POWERINFER_KERNELS`` (``auto``/``c``/``torch``)
sets the default. The ``torch`` backend processes prompts with torch matmuls.

Shapes: ``x`` ``[T, K]``; ``w`` ``[N, K]`` (torch ``Linear`` layout); ``idx``
LongTensor ``[k]`` of row numbers, ascending.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import PowerInferError
from ..quant.qweight import QWeight

SOURCE = Path(__file__).with_name("kernels.c")
QSOURCE = Path(__file__).with_name("qkernels.c")
FSOURCE = Path(__file__).with_name("sparse_ffn.c")  # one token's sparse FFN in one call
ESOURCE = Path(__file__).with_name("sparse_experts.c")  # one token's routed ReLU experts, fired rows only
_DT = {torch.float32: 0, torch.bfloat16: 1}
_KV = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}  # kernels.c's KV cache types
# (kv_cache.py; uint8: q8_0 blocks)
_QT = {"F16": 2, "BF16": 30, "Q4_0": 10, "Q8_0": 11, "Q4_K": 12, "Q6_K": 13, "Q5_0": 14, "Q5_1": 15,
       "Q5_K": 16}  # qkernels.c type codes
QGEMM_MAX_T = 64  # up to this many tokens a row-layout product runs in the C kernel, above it tiles + torch
TILE_ROWS = 512  # rows dequantized at a time for prompt products
Q8_ACT = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K")  # products round the activation to 8-bit blocks
PREFETCH_ROWS = 1  # rows ahead to prefetch in gathers (1 measured best for 8 KB rows)
_state: dict = {"backend": None, "lib": None, "error": None}


# ---------------------------------------------------------------------------- building
def _cache_dir() -> Path:
    root = os.environ.get("POWERINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "powerinfer")
    return Path(root)


def _build(native: bool = True) -> ctypes.CDLL:
    """Compile ``kernels.c`` and ``qkernels.c`` for this CPU (cached by source, compiler and CPU
    flags) and load them. ``native=False`` builds the portable scalar code (tests use it)."""
    from ..hardware import cpu_flags

    sources = (SOURCE, QSOURCE, FSOURCE, ESOURCE)
    src = b"".join(p.read_bytes() for p in sources)
    cc = os.environ.get("CC", "cc")
    march = os.environ.get("POWERINFER_MARCH") or "native"  # e.g. haswell: AVX2 code on an AVX-512 CPU
    flags = ["-O3", f"-march={march}" if native else "-mtune=generic", "-fopenmp", "-shared", "-fPIC"]
    libs = ["-lm"]
    key = hashlib.sha256(src + cc.encode() + " ".join(flags).encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    out = _cache_dir() / f"kernels-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, *libs], capture_output=True, text=True,
                               timeout=120)
            if r.returncode != 0:
                raise OSError(f"{cc} failed: {r.stderr.strip()[-400:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))  # after `import torch`: its libgomp.so.1 is the one this binds to
    P, I, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pi_gemv.argtypes = [C, P, I, I, P, P]
    lib.pi_gemv.restype = None
    lib.pi_dot_rows.argtypes = [C, P, P, P, I, I, P, P, P, C, ctypes.c_float]
    lib.pi_dot_rows.restype = None
    lib.pi_axpy_rows.argtypes = [C, P, P, P, I, I, P, C]
    lib.pi_axpy_rows.restype = None
    lib.pi_attend_one.argtypes = [C, C, P, P, P, I, I, I, I, I, I, ctypes.c_float, P, P]
    lib.pi_attend_one.restype = None
    lib.pi_attend_many.argtypes = [C, C, I, P, P, P, P, I, I, I, I, I, I, ctypes.c_float, P, P]
    lib.pi_attend_many.restype = None
    F32 = ctypes.c_float
    lib.pi_q_gemm.argtypes = [C, P, I, I, P, I, P]
    lib.pi_q_dot_rows.argtypes = [C, P, P, P, I, I, P, P, P, F32]
    lib.pi_q_axpy_rows.argtypes = [C, P, P, P, I, I, P]
    lib.pi_q_dequant_rows.argtypes = [C, P, P, I, I, P]
    lib.pi_x8_gemm.argtypes = [C, P, I, I, P, I, P]
    lib.pi_q_dequant_rows.restype = None
    lib.pi_q_sparse_ffn.argtypes = [C, C, P, I, C, C, P, F32, C, C, P, P, P, I, I, C, F32, F32, P, P, P, P, P, P, P]
    lib.pi_q_sparse_ffn.restype = I
    lib.pi_q_dot_rows_multi.argtypes = [C, P, P, P, I, I, P, I, P, P, P, F32]
    lib.pi_q_axpy_rows_multi.argtypes = [C, P, P, P, I, I, I, P, I]
    lib.pi_q_axpy_sparse.argtypes = [C, P, P, I, F32, I, P, P]
    lib.pi_sparse_experts.argtypes = [C, C, C, C, I, P, P, P, P, P, I, I, P, P, P, P, P]
    lib.pi_sparse_experts.restype = I
    lib.pi_sparse_expert_tokens.argtypes = [C, C, C, I, P, P, P, P, P, I, I, P, P, P, P, P]
    lib.pi_sparse_expert_tokens.restype = I
    for f in (lib.pi_q_gemm, lib.pi_q_dot_rows, lib.pi_q_axpy_rows, lib.pi_x8_gemm, lib.pi_q_dot_rows_multi,
              lib.pi_q_axpy_rows_multi, lib.pi_q_axpy_sparse):
        f.restype = C
    for f in (lib.pi_q_gemm, lib.pi_q_dot_rows, lib.pi_q_axpy_rows, lib.pi_x8_gemm, lib.pi_q_dot_rows_multi,
              lib.pi_q_axpy_rows_multi, lib.pi_q_sparse_ffn, lib.pi_q_axpy_sparse, lib.pi_sparse_experts,
              lib.pi_sparse_expert_tokens):
        f.errcheck = _check_rc
    return lib


C_ENOMEM, C_EINVAL = -1, -2  # qkernels.c's PI_ENOMEM, PI_EINVAL


def _check_rc(rc: int, func, args):
    """ctypes ``errcheck`` of the kernels that allocate or bound their arguments: a negative result
    is MemoryError (an allocation failed: nothing was computed) or PowerInferError (an argument out
    of range, e.g. more tokens than the several-token kernels hold)."""
    if rc == C_ENOMEM:
        raise MemoryError(f"{func.__name__}: the C kernels could not allocate their scratch memory")
    if rc < 0:
        raise PowerInferError(f"{func.__name__}: an argument out of range (error {rc}; at most {QGEMM_MAX_T} "
                              "tokens per several-token call)")
    return rc


def set_backend(name: str = "auto") -> str:
    """Choose ``auto`` | ``c`` | ``torch``; returns the backend in use.

    ``c`` raises RuntimeError when the kernels cannot be built; ``auto`` falls back to torch.
    """
    if name not in ("auto", "c", "torch"):
        raise ValueError(f"kernel backend {name!r}: expected auto, c or torch")
    if name in ("auto", "c") and _state["lib"] is None and _state["error"] is None:
        try:
            _state["lib"] = _build()
        except (OSError, subprocess.SubprocessError) as e:
            _state["error"] = str(e)
            if name == "auto":  # said once per process
                print(f"note: C kernels unavailable ({e}); decoding with torch ops", file=sys.stderr)
    if name == "c" and _state["lib"] is None:
        raise RuntimeError(f"C kernels unavailable: {_state['error']}")
    if _state["lib"] is not None and not _state.get("simd_noted"):
        from ..hardware import missing_simd

        _state["simd_noted"] = True
        if missing := missing_simd():  # said once per process; -march=native then leaves the vector paths out
            print(f"note: this CPU has no {'/'.join(f.upper() for f in missing)}: the C kernels run their portable "
                  "scalar code (correct, several times slower than on an AVX2 CPU)", file=sys.stderr)
    _state["backend"] = "c" if name != "torch" and _state["lib"] is not None else "torch"
    return _state["backend"]


def backend() -> str:
    """The backend in use (chosen on first use from ``POWERINFER_KERNELS``, default ``auto``)."""
    if _state["backend"] is None:
        set_backend(os.environ.get("POWERINFER_KERNELS", "auto"))
    return _state["backend"]


def _c_ok(*ws: torch.Tensor | None) -> bool:
    return backend() == "c" and all(
        w is None or (not isinstance(w, QWeight) and w.dtype in _DT and w.is_contiguous() and w.device.type == "cpu")
        for w in ws)


def _q_c_ok(w: QWeight) -> bool:
    return (backend() == "c" and w.btype.name in _QT and w.raw.device.type == "cpu" and w.raw.is_contiguous()
            and w.layout == "rows")


def for_dense_products(w, alloc=None):
    """``w`` laid out for dense products when that is faster: an untransposed Q4_0/Q8_0/Q5_0/Q5_1/Q4_K/
    Q5_K/Q6_K QWeight with a multiple of 8 rows goes to the ``x8`` layout (C backend only; ``alloc(shape,
    dtype)`` gives its memory); anything else is returned as it is."""
    if isinstance(w, QWeight) and w.can_x8() and backend() == "c":
        return w.to_x8(None if alloc is None else alloc(tuple(w.raw.shape), torch.uint8))
    return w


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------- public ops
def _mv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w @ x`` fp32 ``[N]`` for ``x`` ``[K]`` (C backend; ``x`` is taken in ``w``'s dtype)."""
    N, K = w.shape
    xw = x.to(w.dtype).contiguous()
    y = torch.empty(N, dtype=torch.float32)
    _state["lib"].pi_gemv(_DT[w.dtype], w.data_ptr(), N, K, xw.data_ptr(), y.data_ptr())
    return y


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)``: ``[T, K] x [N, K] -> [T, N]`` in ``x``'s dtype.

    ``w``: a tensor, a :class:`QWeight`, or a list of them stacked along ``N`` (a fused
    QKV whose parts have different quantized types).
    """
    if isinstance(w, (list, tuple)):
        y = torch.cat([linear(x, p) for p in w], dim=-1)
    elif isinstance(w, QWeight):
        y = _q_linear(x, w).to(x.dtype)
    else:
        y = _mv(w, x[0]).to(x.dtype)[None] if x.shape[0] == 1 and _c_ok(w) else F.linear(x, w)
    return y if b is None else y + b


def dequant_rows(w: QWeight, r0: int, r1: int, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Stored rows ``[r0, r1)`` (or rows ``idx``) of ``w`` as fp32 ``[n, K]``."""
    if not _q_c_ok(w):
        return w.dequantize(rows=slice(r0, r1) if idx is None else idx).float()
    n = r1 - r0 if idx is None else idx.numel()
    out = torch.empty(n, w.n_cols, dtype=torch.float32)
    if n:
        idx = None if idx is None else idx.contiguous()
        _state["lib"].pi_q_dequant_rows(_QT[w.btype.name], w.raw[r0:].data_ptr() if idx is None else w.raw.data_ptr(),
                                        _ptr(idx), n, w.n_cols, out.data_ptr())
    return out


def _q_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """``x @ w.T`` fp32 ``[T, N]`` for untransposed ``w`` ``[N, K]``."""
    if w.transposed:
        return matmul(x, w.T)
    T, (N, K) = x.shape[0], w.shape
    xf = x.float().contiguous()
    if w.layout == "x8" and backend() == "c":  # every T: the 8-row kernel also tiles 4 tokens
        y = torch.empty(T, N, dtype=torch.float32)
        _state["lib"].pi_x8_gemm(_QT[w.btype.name], w.raw.data_ptr(), N, K, xf.data_ptr(), T, y.data_ptr())
        return y
    if T <= QGEMM_MAX_T and _q_c_ok(w):
        y = torch.empty(T, N, dtype=torch.float32)
        _state["lib"].pi_q_gemm(_QT[w.btype.name], w.raw.data_ptr(), N, K, xf.data_ptr(), T, y.data_ptr())
        return y
    if w.btype.name in Q8_ACT:  # the activation rounded as the kernels round it, so
        xf = q8_round_trip(xf, w.btype.name)  # a prompt gives the numbers token-by-token decoding gives
    y = torch.empty(T, N, dtype=torch.float32)
    for r0 in range(0, N, TILE_ROWS):
        r1 = min(N, r0 + TILE_ROWS)
        torch.matmul(xf, dequant_rows(w, r0, r1).T, out=y[:, r0:r1])
    return y


K_ACT = ("Q4_K", "Q5_K", "Q6_K")  # products round the activation to ggml's q8_K (blocks of 256)


def q8_round_trip(x: torch.Tensor, type_name: str = "Q8_0") -> torch.Tensor:
    """fp32 ``x`` ``[..., K]`` as the products on weights of type ``type_name`` see it.

    Q4_0/Q8_0/Q5_0/Q5_1 (``K`` a multiple of 32): 8-bit blocks of 32, scale ``amax / 127`` in
    fp32, values rounded to nearest even. Q4_K/Q5_K/Q6_K (``K`` a multiple of 256): ggml's q8_K,
    blocks of 256, ``iscale = 127 / amax``, scale ``1 / iscale`` (fp32 divisions), values
    ``round(x * iscale)`` to nearest even."""
    if type_name in K_ACT:
        b = x.reshape(-1, 256)
        amax = b.abs().amax(1, keepdim=True)
        # (a tensor divided by a tensor: torch's ``127 / t`` multiplies by a reciprocal, one rounding more)
        iscale = torch.where(amax != 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
        d = torch.where(amax != 0, 1 / iscale, torch.zeros_like(amax))
        return (torch.round(b * iscale) * d).reshape(x.shape)
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    q = torch.round(b * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (q * d).reshape(x.shape)


def matmul(h: torch.Tensor, w: QWeight) -> torch.Tensor:
    """``h @ w``: ``[T, F] x [F, D] -> [T, D]`` fp32 for a QWeight stored as ``F`` rows of ``D``
    (a PWRI ``ffn_down_t``); one AXPY over every row per token for one token, else tiles."""
    if w.transposed:
        return _q_linear(h, w.T)
    T, (F_, D) = h.shape[0], w.shape
    hf = h.float().contiguous()
    if T == 1:
        return rows_axpy(torch.arange(F_), w, hf[0])[None]
    y = torch.zeros(T, D, dtype=torch.float32)
    for r0 in range(0, F_, TILE_ROWS):
        r1 = min(F_, r0 + TILE_ROWS)
        y.addmm_(hf[:, r0:r1], dequant_rows(w, r0, r1))
    return y


def embed(w, tokens: torch.Tensor) -> torch.Tensor:
    """Rows ``tokens`` (LongTensor ``[T]``) of an embedding table ``[V, D]`` -> ``[T, D]``
    (fp32 for a QWeight)."""
    if tokens.numel():  # the C lookup reads memory by these ids: bound them (a caller's or a bad file's ids)
        lo, hi = (int(v) for v in torch.aminmax(tokens))
        if lo < 0 or hi >= w.shape[0]:
            raise PowerInferError(f"token id {hi if hi >= w.shape[0] else lo} is outside the vocabulary "
                                  f"(0..{w.shape[0] - 1})")
    if isinstance(w, QWeight):
        return dequant_rows(w, 0, 0, tokens.to(torch.long))
    return w[tokens]


def rows_dot(x: torch.Tensor, idx: torch.Tensor, a, b=None,
             gmin: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a[idx] @ x, b[idx] @ x)``: fp32 ``[k]`` each (the second None when ``b`` is None).

    ``x`` ``[K]``; ``a``, ``b`` ``[F, K]`` with the same dtype (or QWeights of one type).
    ``gmin``: an entry of the second result may be 0 instead of its product where the first
    is ``<= gmin`` (a gated ReLU neuron whose gate does not fire; its up row is not read).
    """
    k = idx.numel()
    if b is not None and (type(a) is not type(b) or getattr(a, "btype", a.dtype) != getattr(b, "btype", b.dtype)):
        ra = rows_dot(x, idx, a)[0]  # gate and up of different types (a mixed file): one call each
        return ra, rows_dot(x, idx, b)[0]
    if isinstance(a, QWeight):
        if _q_c_ok(a):
            xf, idx = x.float().contiguous(), idx.contiguous()
            ra = torch.empty(k, dtype=torch.float32)
            rb = None if b is None else torch.empty(k, dtype=torch.float32)
            _state["lib"].pi_q_dot_rows(_QT[a.btype.name], a.raw.data_ptr(), None if b is None else b.raw.data_ptr(),
                                        idx.data_ptr(), k, a.n_cols, xf.data_ptr(), ra.data_ptr(), _ptr(rb),
                                        float("-inf") if gmin is None else gmin)
            return ra, rb
        xf = q8_round_trip(x.float(), a.btype.name) if a.btype.name in Q8_ACT else x.float()
        return a.dequantize(rows=idx) @ xf, None if b is None else b.dequantize(rows=idx) @ xf
    if _c_ok(a, b) and (b is None or b.dtype == a.dtype):
        xw = x.to(a.dtype).contiguous()
        ra = torch.empty(k, dtype=torch.float32)
        rb = None if b is None else torch.empty(k, dtype=torch.float32)
        idx = idx.contiguous()
        _state["lib"].pi_dot_rows(_DT[a.dtype], a.data_ptr(), _ptr(b), idx.data_ptr(), k, a.shape[1],
                                  xw.data_ptr(), ra.data_ptr(), _ptr(rb), PREFETCH_ROWS,
                                  float("-inf") if gmin is None else gmin)
        return ra, rb
    xa = x.to(a.dtype)
    ra = F.linear(a.index_select(0, idx), xa).float()
    rb = None if b is None else F.linear(b.index_select(0, idx), xa).float()
    return ra, rb


def rows_axpy(idx: torch.Tensor, w, coef: torch.Tensor) -> torch.Tensor:
    """``sum_i coef[i] * w[idx[i]]``: ``[D]`` fp32 (c) or ``w``'s dtype (torch); rows read once."""
    if isinstance(w, QWeight):
        cf, idx = coef.float().contiguous(), idx.contiguous()
        if not _q_c_ok(w):
            return cf @ w.dequantize(rows=idx) if idx.numel() else torch.zeros(w.n_cols)
        out = torch.empty(w.n_cols, dtype=torch.float32)
        _state["lib"].pi_q_axpy_rows(_QT[w.btype.name], w.raw.data_ptr(), idx.data_ptr(), cf.data_ptr(), idx.numel(),
                                     w.n_cols, out.data_ptr())
        return out
    if _c_ok(w):
        cf, idx = coef.float().contiguous(), idx.contiguous()
        out = torch.empty(w.shape[1], dtype=torch.float32)
        _state["lib"].pi_axpy_rows(_DT[w.dtype], w.data_ptr(), idx.data_ptr(), cf.data_ptr(), idx.numel(),
                                   w.shape[1], out.data_ptr(), PREFETCH_ROWS)
        return out
    if idx.numel() == 0:
        return torch.zeros(w.shape[1], dtype=w.dtype)
    return F.embedding_bag(idx[None], w, per_sample_weights=coef.to(w.dtype)[None], mode="sum")[0]


def rows_axpy_sparse(x: torch.Tensor, w: QWeight, threshold: float) -> tuple[torch.Tensor, int]:
    """``sum over j with |x[j]| >= threshold of x[j] * w[j]`` for a Q4_0/Q8_0 row-layout ``w`` ``[K, D]``
    (C backend; :func:`axpy_sparse_ok`), ``x`` ``[K]`` fp32 -> (fp32 ``[D]``, number of inputs kept) with
    integer products: ``pi_q_axpy_sparse`` in ``qkernels.c`` (coefficients rounded per group of 32 kept
    rows and output block, the analogue of the activation rounding of a dense product)."""
    xf = x.float().contiguous()
    out = torch.empty(w.n_cols, dtype=torch.float32)
    kept = ctypes.c_int64(0)
    _state["lib"].pi_q_axpy_sparse(_QT[w.btype.name], w.raw.data_ptr(), xf.data_ptr(), xf.numel(), float(threshold),
                                   w.n_cols, out.data_ptr(), ctypes.byref(kept))
    return out, kept.value


def axpy_sparse_ok(w) -> bool:
    """Whether :func:`rows_axpy_sparse` takes ``w`` (a Q4_0/Q8_0 row-layout QWeight, C backend)."""
    return isinstance(w, QWeight) and w.btype.name in ("Q4_0", "Q8_0") and _q_c_ok(w) and w.n_cols % 32 == 0


def rows_dot_multi(x: torch.Tensor, idx: torch.Tensor, sel: torch.Tensor, a: QWeight, b: QWeight | None = None,
                   gmin: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rows_dot` for ``T`` tokens at once over a shared row set: ``x`` ``[T, K]``, ``idx``
    LongTensor ``[n]`` ascending, ``sel`` bool ``[T, n]`` (which rows each token computes) ->
    fp32 ``[T, n]`` each, 0 where not selected. Each row is read once for all tokens; a token's
    values equal what :func:`rows_dot` gives it alone, bit for bit. C backend, ``a`` (and ``b``,
    of the same type) QWeights in row layout (:func:`_q_c_ok`) only; ValueError otherwise."""
    if not (isinstance(a, QWeight) and _q_c_ok(a)) or (
            b is not None and not (isinstance(b, QWeight) and _q_c_ok(b) and b.btype == a.btype)):
        raise ValueError("rows_dot_multi: needs the C kernels and row-layout QWeights of one type")
    (T, K), n = x.shape, idx.numel()
    if T > QGEMM_MAX_T:
        raise ValueError(f"rows_dot_multi: {T} tokens, at most {QGEMM_MAX_T} per call")
    xf, idx, s8 = x.float().contiguous(), idx.contiguous(), sel.to(torch.uint8).contiguous()
    ra = torch.empty(T, n, dtype=torch.float32)
    rb = None if b is None else torch.empty(T, n, dtype=torch.float32)
    _state["lib"].pi_q_dot_rows_multi(_QT[a.btype.name], a.raw.data_ptr(), None if b is None else b.raw.data_ptr(),
                                      idx.data_ptr(), n, K, xf.data_ptr(), T, s8.data_ptr(), ra.data_ptr(), _ptr(rb),
                                      float("-inf") if gmin is None else gmin)
    return ra, rb


def rows_axpy_multi(idx: torch.Tensor, w: QWeight, coef: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """:func:`rows_axpy` for ``T`` tokens over a shared row set: ``coef`` ``[T, n]`` -> fp32 ``[T, D]``,
    ``out[t] = sum_i coef[t, i] * w[idx[i]]`` (zero coefficients skipped); token ``t``'s result equals
    :func:`rows_axpy` over its own non-zero rows bit for bit. ``chunk``: values of ``D`` done for every
    token before the next (0: a thread's whole slice), so shared rows come from cache. C backend,
    row-layout QWeight only (ValueError otherwise)."""
    if not (isinstance(w, QWeight) and _q_c_ok(w)):
        raise ValueError("rows_axpy_multi: needs the C kernels and a row-layout QWeight")
    T, n = coef.shape
    cf, idx = coef.float().contiguous(), idx.contiguous()
    out = torch.empty(T, w.n_cols, dtype=torch.float32)
    _state["lib"].pi_q_axpy_rows_multi(_QT[w.btype.name], w.raw.data_ptr(), idx.data_ptr(), cf.data_ptr(), n,
                                       w.n_cols, T, out.data_ptr(), int(chunk))
    return out


def predict(h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float) -> torch.Tensor:
    """Predicted-active mask ``[T, F]`` (bool): ``fc2 relu(fc1 h) >= threshold``, ``h`` ``[T, D]``."""
    if isinstance(fc1, QWeight) or isinstance(fc2, QWeight):  # logits in fp32
        return linear(torch.relu(linear(h.float(), fc1)), fc2) >= threshold
    if h.shape[0] == 1 and _c_ok(fc1, fc2):
        return (_mv(fc2, torch.relu(_mv(fc1, h[0]))) >= threshold)[None]  # logits kept in fp32
    return F.linear(torch.relu(F.linear(h, fc1)), fc2) >= threshold


_FFN_KINDS = {"reglu": 0, "dreglu": 1, "relu": 2}  # sparse_ffn.c's ffn_kind
_ACTS = {"relu": 0, "fatrelu": 1}


class SparseFFNCall:
    """One token's sparse FFN as one C call (``sparse_ffn.c``): predictor, selection, gate/up
    rows, activation and down rows, the same kernels and numbers as the Python path.

    Built by :meth:`make` for an FFN whose weights the call can take: gate/up/down_t QWeights
    of one type in row layout, fc1/fc2 QWeights (row or ``x8`` layout), a relu or fatrelu
    activation, no biases, the C backend. Holds its scratch buffers (``idx`` [F], ``buf``
    [H + 3F]), so one instance serves one decoding thread at a time.
    """

    def __init__(self, ffn_kind: int, act: int, act_thr: float, gmin: float, threshold: float,
                 fc1: QWeight, fc2: QWeight, gate: QWeight | None, up: QWeight, down_t: QWeight):
        self.args = (ffn_kind, act, act_thr, gmin, threshold)
        self.fc1, self.fc2, self.gate, self.up, self.down_t = fc1, fc2, gate, up, down_t
        F, H = fc2.shape
        D = up.n_cols
        shapes = {"fc1": (tuple(fc1.shape), (H, D)), "up": (tuple(up.shape), (F, D)),
                  "down_t": (tuple(down_t.shape), (F, D))}
        if gate is not None:
            shapes["gate"] = (tuple(gate.shape), (F, D))
        bad = [f"{k} {got}, expected {want}" for k, (got, want) in shapes.items() if got != want]
        if bad:  # the C call indexes every matrix by F, H and D
            raise PowerInferError(f"sparse FFN call: weights of mismatched shapes: {'; '.join(bad)}")
        self.idx = torch.empty(F, dtype=torch.int64)
        self.buf = torch.empty(H + 3 * F, dtype=torch.float32)
        self._n_fired = ctypes.c_int64()
        self._t_pred = ctypes.c_double()

    @staticmethod
    def takes(family_ffn: str, act_kind: str, fc1, fc2, gate, up, down_t) -> bool:
        """True when the C kernels take these weights as they are: gate/up/down rows of one quantized
        row-layout type (:func:`_q_c_ok`), predictors quantized (x8 or rows), an FFN kind and
        activation the C code knows, the C backend. Biases are the caller's to add (the one-call
        decode takes none; the batch's union rows add them per row)."""
        if family_ffn not in _FFN_KINDS or act_kind not in _ACTS or backend() != "c":
            return False
        rows = [w for w in (gate, up, down_t) if w is not None]
        if not all(isinstance(w, QWeight) and _q_c_ok(w) and w.btype == up.btype for w in rows):
            return False
        if (gate is None) != (family_ffn == "relu"):
            return False
        # x8 weights are always contiguous CPU copies (for_dense_products)
        return all(isinstance(w, QWeight) and (w.layout == "x8" or _q_c_ok(w)) for w in (fc1, fc2))

    @staticmethod
    def make(family_ffn: str, act_kind: str, act_thr: float, gmin: float | None, threshold: float,
             fc1, fc2, gate, up, down_t, biases: bool) -> "SparseFFNCall | None":
        """The call for these weights, or None when the Python path must run them (biases, or
        weights :meth:`takes` refuses)."""
        if biases or not SparseFFNCall.takes(family_ffn, act_kind, fc1, fc2, gate, up, down_t):
            return None
        return SparseFFNCall(_FFN_KINDS[family_ffn], _ACTS[act_kind], float(act_thr),
                             -math.inf if gmin is None else float(gmin), float(threshold), fc1, fc2, gate, up, down_t)

    def __call__(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int, int, float]:
        """``(out [D] fp32, predicted-active count, fired count, predictor seconds)`` for one token:
        ``h`` [D] the predictor input, ``x`` [D] the normed FFN input."""
        ffn_kind, act, act_thr, gmin, threshold = self.args
        fc1, fc2, up = self.fc1, self.fc2, self.up
        if h.numel() != fc1.n_cols or x.numel() != up.n_cols:  # the C call reads n_embd values of each
            raise PowerInferError(f"sparse FFN call: h has {h.numel()} values, x {x.numel()}; the weights take "
                                  f"{fc1.n_cols} and {up.n_cols} (n_embd)")
        hf, xf = h.float().contiguous(), x.float().contiguous()
        out = torch.empty(up.n_cols, dtype=torch.float32)
        k = _state["lib"].pi_q_sparse_ffn(
            _QT[fc1.btype.name], fc1.layout == "x8", fc1.raw.data_ptr(), fc1.n_rows,
            _QT[fc2.btype.name], fc2.layout == "x8", fc2.raw.data_ptr(), threshold,
            _QT[up.btype.name], ffn_kind, _ptr(None if self.gate is None else self.gate.raw), up.raw.data_ptr(),
            self.down_t.raw.data_ptr(), up.n_rows, up.n_cols, act, act_thr, gmin, hf.data_ptr(), xf.data_ptr(),
            out.data_ptr(), self.idx.data_ptr(), self.buf.data_ptr(), ctypes.byref(self._n_fired),
            ctypes.byref(self._t_pred))
        return out, int(k), self._n_fired.value, self._t_pred.value


def _attend_c_ok(k: torch.Tensor, v: torch.Tensor, d: int) -> bool:
    """The C attention reads this cache span: keys and values each f32, f16, bf16 or q8_0 (not
    necessarily the same), each head's row contiguous (``d`` values, or their q8_0 bytes), at least
    one position, on the CPU."""
    from .kv_cache import row_width

    return all(t.dtype in _KV and t.stride(2) == 1 and t.shape[2] == row_width(t.dtype, d) and t.stride(1) == t.shape[2]
               and t.device.type == "cpu" for t in (k, v)) and k.shape[0] > 0 and (d % 32 == 0 or torch.uint8 not in
                                                                                  (k.dtype, v.dtype))


def attend_many(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """:func:`attend_one` for ``n`` queries at once, each against its own cache span: ``q``
    ``[n, Hq, d]``, ``ks[i]``, ``vs[i]`` ``[S_i, Hkv, d]`` -> ``[n, Hq, d]`` in ``q``'s dtype. Entry
    ``i`` gets exactly ``attend_one(q[i], ks[i], vs[i])``; one C call for all of them where every
    span is a C-readable cache view of one position stride and types, else one :func:`attend_one` each."""
    n, Hq, d = q.shape
    if n and _c_ok() and all(_attend_c_ok(k, v, d) and k.dtype == ks[0].dtype and v.dtype == vs[0].dtype
                             and k.stride(0) == ks[0].stride(0) and v.stride(0) == vs[0].stride(0)
                             for k, v in zip(ks, vs)):
        Hkv = ks[0].shape[1]
        qf = q.float().contiguous()
        S = torch.tensor([k.shape[0] for k in ks], dtype=torch.int64)
        kp = torch.tensor([k.data_ptr() for k in ks], dtype=torch.int64)
        vp = torch.tensor([v.data_ptr() for v in vs], dtype=torch.int64)
        smax = int(S.max())
        scores = torch.empty(n, Hq, smax, dtype=torch.float32)
        out = torch.empty(n, Hq, d, dtype=torch.float32)
        _state["lib"].pi_attend_many(_KV[ks[0].dtype], _KV[vs[0].dtype], n, qf.data_ptr(), kp.data_ptr(),
                                     vp.data_ptr(), S.data_ptr(), smax, Hq, Hkv, d, ks[0].stride(0) * ks[0].element_size(),
                                     vs[0].stride(0) * vs[0].element_size(), d ** -0.5, scores.data_ptr(),
                                     out.data_ptr())
        return out.to(q.dtype)
    return torch.stack([attend_one(q[i], k, v) for i, (k, v) in enumerate(zip(ks, vs))]) if n else q.clone()


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode attention of one query: ``q`` ``[Hq, d]`` against ``k``, ``v`` ``[S, Hkv, W]`` (views of
    the KV cache, every position visible; ``W`` = d, or d's q8_0 bytes) -> ``[Hq, d]`` in ``q``'s
    dtype; ``Hq`` a multiple of ``Hkv``.

    The C kernel takes the query in f32 and reads f32, f16, bf16 or q8_0 keys and values in place
    (converted in registers, f32 sums: llama.cpp's f16 KV cache without an f32 copy); the torch path
    converts the span to ``q``'s dtype for SDPA."""
    from .kv_cache import load

    (Hq, d), (S, Hkv, _) = q.shape, k.shape
    if _c_ok() and _attend_c_ok(k, v, d):
        qf = q.float().contiguous()
        scores = torch.empty(Hq, S, dtype=torch.float32)
        out = torch.empty(Hq, d, dtype=torch.float32)
        _state["lib"].pi_attend_one(_KV[k.dtype], _KV[v.dtype], qf.data_ptr(), k.data_ptr(), v.data_ptr(), S, Hq,
                                    Hkv, d, k.stride(0) * k.element_size(), v.stride(0) * v.element_size(),
                                    d ** -0.5, scores.data_ptr(), out.data_ptr())
        return out.to(q.dtype)
    o = F.scaled_dot_product_attention(q[:, None], load(k, q.dtype).transpose(0, 1), load(v, q.dtype).transpose(0, 1),
                                       enable_gqa=Hq != Hkv)
    return o[:, 0]

"""Mixture-of-experts FFNs (Mixtral, Qwen3-MoE) on llama.cpp's GGUF layout.

A layer's FFN is a router ``blk.N.ffn_gate_inp.weight`` ``[E, D]`` and ``E`` SiLU-gated experts stacked
in 3-D tensors ``blk.N.ffn_gate_exps.weight``/``ffn_up_exps`` (torch order ``[E, F, D]``, ``F`` the
expert width) and ``ffn_down_exps`` (``[E, D, F]``). For normed input ``x`` ``[T, D]`` (llama.cpp's
``build_moe_ffn`` with a softmax gate, transformers' ``MixtralSparseMoeBlock``/``Qwen3MoeSparseMoeBlock``):

    ``p = softmax(x @ router.T)`` (fp32, ``[T, E]``), ``(w, e) = top-k(p)`` with ``k`` the used count,
    ``w /= sum(w)`` where the file renormalises, ``out = sum_j w_j * down_e_j(silu(gate_e_j x) * up_e_j x)``.

SmallThinker (arch ``smallthinker``, :mod:`.smallthinker`) differs in three places: a sigmoid instead
of the softmax when ``expert_gating_func`` is 2, ReLU instead of SiLU, and the router reading the
layer's input (``pre_attention``: the block sets ``router_in``) instead of ``x``.

Only the routed experts are computed. Expert ``e``'s matrices are the contiguous rows ``e*F..(e+1)*F``
(``e*D..`` for down) of the stacked tensor, so each is a :class:`QWeight` of those rows (Q4_0, Q8_0,
K-quants, f16, bf16: computed in the file's bytes by the existing C kernels, never copied to f32;
block-quantized ones re-laid out in 8-row groups as dense matrices are, :func:`load_experts`) or a
torch view (f32 files; every type with the torch backend, dequantized at load). Several tokens
(a prompt, a batched decode step) are grouped by expert: each hit expert runs once on all the tokens
routed to it, so its rows are read once per pass, and tokens sum their experts in expert order, so a
token's output is the same whichever tokens share its pass (with row-layout QWeights, whose kernels
compute each token alone; f32 torch products of one and of several tokens round differently).

GGUF keys (llama.cpp's names; ``{arch}`` ``llama`` for Mixtral, ``qwen3moe``): ``expert_count``,
``expert_used_count``, ``expert_feed_forward_length`` (the expert width; else ``feed_forward_length``
for ``llama``, ``feed_forward_length / expert_used_count`` for ``qwen3moe`` as llama.cpp derives it),
``expert_weights_norm`` (default true: llama.cpp's ``llama`` and ``qwen3moe`` graphs always renormalise;
our converter writes false for a Qwen3-MoE config with ``norm_topk_prob: false``), ``expert_weights_scale``
(0 or 1: none), ``expert_gating_func`` (absent or 1, softmax; 2, sigmoid, for ``smallthinker``, whose
llama.cpp graph reads the key; others are refused). Every count and
shape is checked against the tensors before any weight is loaded (:func:`experts_builder`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile
from ..quant.qweight import MAPPED_TYPES, QWeight
from . import kernels
from .args import ModelArgs
from .kernels import linear
from .weights import _NATIVE, dense_layout, load_tensor, mapped_rows, tensor_shape, weight_nbytes

GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, _SIGMOID
SIGMOID_ARCHS = ("smallthinker",)  # the architectures whose llama.cpp graph honours a sigmoid gate
MAX_EXPERTS = 1 << 12
NORM_MIN = 6.103515625e-5  # llama.cpp clamps the sum of the k weights to the smallest normal f16


@dataclass(frozen=True)
class ExpertArgs:
    """A file's expert facts: ``n_expert`` (E), ``n_used`` (k), ``n_ff_exp`` (F), ``norm_w``
    (renormalise the k weights), ``w_scale`` (multiply them; 1.0: none)."""

    n_expert: int
    n_used: int
    n_ff_exp: int
    norm_w: bool = True
    w_scale: float = 1.0
    gating: str = "softmax"  # or "sigmoid" (SmallThinker without a softmax router)


def is_moe(g: GGUFFile) -> bool:
    """True when ``g`` is a mixture-of-experts file: ``{arch}.expert_count`` > 0 or a router tensor."""
    return bool(g.get(f"{g.arch}.expert_count", 0)) or any(n.endswith(".ffn_gate_inp.weight") for n in g.tensors)


def _int_key(g: GGUFFile, key: str, default: int | None = None) -> int:
    v = g.get(key, default)
    if v is None:
        raise PowerInferError(f"{g.path}: mixture-of-experts tensors but no {key}")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_EXPERTS * 1024:
        raise PowerInferError(f"{g.path}: {key} = {v!r} is out of range")
    return v


def expert_args(g: GGUFFile, a: ModelArgs) -> ExpertArgs:
    """The expert keys of ``g``, checked against each other and against every layer's expert tensor
    shapes (no data read). Raises PowerInferError naming the file and the key or tensor."""
    arch = g.arch
    n = _int_key(g, f"{arch}.expert_count")
    k = _int_key(g, f"{arch}.expert_used_count")
    if n > MAX_EXPERTS:
        raise PowerInferError(f"{g.path}: {arch}.expert_count = {n} is out of range (1..{MAX_EXPERTS})")
    if k > n:
        raise PowerInferError(f"{g.path}: {arch}.expert_used_count {k} is more than {arch}.expert_count {n}")
    fallback = a.n_ff // k if arch == "qwen3moe" else a.n_ff  # llama.cpp's n_ff_exp when the key is absent
    f = _int_key(g, f"{arch}.expert_feed_forward_length", fallback)
    gating = g.get(f"{arch}.expert_gating_func", 1)
    allowed = {k: v for k, v in GATING.items() if k == 1 or arch in SIGMOID_ARCHS}
    if isinstance(gating, bool) or gating not in allowed:
        raise PowerInferError(f"{g.path}: {arch}.expert_gating_func = {gating!r}: the {arch} gating supported is "
                              + " or ".join(f"{v} ({k})" for k, v in allowed.items()))
    norm_w = g.get(f"{arch}.expert_weights_norm", True)
    scale = g.get(f"{arch}.expert_weights_scale", 0.0)
    if not isinstance(norm_w, bool):
        raise PowerInferError(f"{g.path}: {arch}.expert_weights_norm = {norm_w!r} is not a bool")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale < 1e6:
        raise PowerInferError(f"{g.path}: {arch}.expert_weights_scale = {scale!r} is out of range")
    ea = ExpertArgs(n, k, f, norm_w, float(scale) if scale not in (0, 0.0) else 1.0, GATING[gating])
    for i in range(a.n_layer):
        for name, want in expected_shapes(i, a.n_embd, ea).items():
            if name not in g.tensors:
                raise PowerInferError(f"{g.path}: tensor {name!r} is missing (a mixture-of-experts layer needs "
                                      "ffn_gate_inp and ffn_gate/up/down_exps)")
            got = tensor_shape(g, name)
            if got != want:
                raise PowerInferError(f"{g.path}: tensor {name!r} has shape {list(got)}, but {arch}.expert_count "
                                      f"{n}, the expert width {f} and n_embd {a.n_embd} need {list(want)}")
    return ea


def expected_shapes(i: int, n_embd: int, ea: ExpertArgs) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s router and expert tensors, torch order."""
    p, E, Fx, D = f"blk.{i}.", ea.n_expert, ea.n_ff_exp, n_embd
    return {p + "ffn_gate_inp.weight": (E, D), p + "ffn_gate_exps.weight": (E, Fx, D),
            p + "ffn_up_exps.weight": (E, Fx, D), p + "ffn_down_exps.weight": (E, D, Fx)}


def load_experts(g: GGUFFile, name: str, dtype: torch.dtype, mapped: bool) -> list:
    """The ``E`` matrices ``[R, C]`` of a stacked tensor ``[E, R, C]``: when the kernels compute on its
    type (``mapped``), :class:`QWeight` s of expert ``e``'s rows ``e*R..(e+1)*R`` of the map, each in the
    layout dense products run fastest on (:func:`~.weights.dense_layout`: Q4_0/Q8_0/Q5_x/K-quants in
    8-row groups, the same bytes copied once into anonymous memory and the mapped pages released, as
    for every dense matrix; f16/bf16 stay views of the map); else torch views of one tensor in ``dtype``
    (a view of the map for f32, or bf16 computed in bf16; else one converted copy)."""
    E, R, C = tensor_shape(g, name)
    kind = g.tensors[name].tensor_type.name
    if mapped and kind in MAPPED_TYPES and _NATIVE.get(kind) != dtype:
        w = mapped_rows(g, name, E * R, C)
        return [dense_layout(g, [name], QWeight(w.raw[e * R:(e + 1) * R], w.btype, R, C)) for e in range(E)]
    return list(load_tensor(g, name, dtype).unbind(0))


@dataclass
class ExpertsFFN:
    """One layer's mixture-of-experts FFN. ``router`` ``[E, D]``; ``gate``/``up``: ``E`` matrices
    ``[F, D]``; ``down``: ``E`` matrices ``[D, F]``. Counters as :class:`~.ffn.FFN`'s (``n_active``:
    expert evaluations, ``n_calls``: tokens); ``expert_hits[e]``: tokens routed to expert ``e``."""

    family: object
    act: object
    router: torch.Tensor
    gate: list
    up: list
    down: list
    ea: ExpertArgs
    n_active: int = 0
    n_calls: int = 0
    t_ffn: float = 0.0
    t_predict: float = 0.0
    expert_hits: torch.Tensor = field(default=None)
    sparse: bool = False
    fc1: None = None
    fc2: None = None
    pre_attention: bool = False  # the router reads the layer's input, set in router_in by the block (SmallThinker)
    router_in: torch.Tensor | None = None

    def __post_init__(self):
        if self.expert_hits is None:
            self.expert_hits = torch.zeros(self.ea.n_expert, dtype=torch.long)

    @property
    def batch_shared(self) -> bool:
        """True when a batch of tokens may share one pass bit for bit with each token alone (every
        expert matrix a QWeight, whose kernels compute each token by itself)."""
        return all(isinstance(w, QWeight) and w.layout in ("rows", "x8") for w in (*self.gate, *self.up, *self.down))

    @property
    def mode(self) -> str:
        return f"experts {self.ea.n_used} of {self.ea.n_expert}"

    def reset_stats(self) -> None:
        self.n_active = self.n_calls = 0
        self.t_ffn = self.t_predict = 0.0
        self.expert_hits.zero_()

    def route(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``: fp32 ``[T, k]`` and LongTensor ``[T, k]`` for router input ``[T, D]`` (the
        normed FFN input, or the layer input for a pre-attention router)."""
        T = xn.shape[0]
        if 1 < T <= kernels.QGEMM_MAX_T:  # a batched decode step: each token's logits as it gets them alone
            logits = torch.cat([linear(xn[t:t + 1], self.router) for t in range(T)])  # (the matrix-vector kernel)
        else:
            logits = linear(xn, self.router)
        logits = logits.float()
        probs = torch.softmax(logits, dim=-1) if self.ea.gating == "softmax" else torch.sigmoid(logits)  # [T, E]
        w, e = torch.topk(probs, self.ea.n_used, dim=-1)
        if self.ea.norm_w:
            w = w / w.sum(-1, keepdim=True).clamp_min(NORM_MIN)
        if self.ea.w_scale != 1.0:
            w = w * self.ea.w_scale
        return w, e

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x`` ``[n, D]`` -> ``[n, D]`` in ``x``'s dtype."""
        h = self.act.apply(linear(x, self.gate[e])) * linear(x, self.up[e])
        return linear(h, self.down[e])

    def __call__(self, h: torch.Tensor, xn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FFN output ``[T, D]`` for normed input ``xn`` ``[T, D]`` (``h``, ``mask``: unused, no predictor)."""
        t0 = time.perf_counter()
        if self.pre_attention:
            if self.router_in is None or self.router_in.shape[0] != xn.shape[0]:
                raise RuntimeError("a pre-attention router needs router_in set by the block")
            w, sel = self.route(self.router_in)
            self.router_in = None
        else:
            w, sel = self.route(xn)
        T = xn.shape[0]
        out = torch.zeros(T, xn.shape[1], dtype=torch.float32)
        if T == 1:  # decode: the same sums in the same (ascending expert) order, less Python per step
            es, slots = sel[0].sort()
            for e, j in zip(es.tolist(), slots.tolist()):
                out += self.expert(e, xn).float() * w[0, j]
            self.expert_hits[es] += 1
        else:
            hit = torch.bincount(sel.view(-1), minlength=self.ea.n_expert)
            for e in hit.nonzero().view(-1).tolist():  # ascending: every token sums its experts in one order
                tok, slot = (sel == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, self.expert(e, xn[tok]).float() * w[tok, slot, None])
            self.expert_hits += hit
        self.n_calls += T
        self.n_active += T * self.ea.n_used
        self.t_ffn += time.perf_counter() - t0
        return out.to(xn.dtype)

    def decode_bytes(self) -> float:
        """Weight bytes one token reads: the router and ``k`` of the ``E`` experts."""
        experts = weight_nbytes(self.gate) + weight_nbytes(self.up) + weight_nbytes(self.down)
        return weight_nbytes(self.router) + experts * self.ea.n_used / self.ea.n_expert


PRE_ATTENTION_ROUTER = ("smallthinker",)  # architectures whose router reads the layer input (.smallthinker)
ACTIVATIONS = {"llama": "silu", "qwen3moe": "silu", "smallthinker": "relu"}  # the experts' activation (llama.cpp)


def experts_builder(g: GGUFFile, a: ModelArgs, pre_attention: bool = False):
    """The FFN builder for ``g`` when it is a mixture-of-experts file (its counts and every layer's
    shapes checked now, before anything is loaded), else None. Same arguments as
    :func:`~.model.build_ffn`. ``pre_attention``: the caller's block sets each FFN's ``router_in`` to the
    layer input (:class:`~.smallthinker.SmallThinkerTransformer`); a file that needs that is refused
    without it."""
    if not is_moe(g) and not getattr(a.family, "experts", False):
        return None
    if a.sparse:
        raise PowerInferError(f"{g.path}: a PowerInfer (PWRI) file with experts is not supported")
    if (g.arch in PRE_ATTENTION_ROUTER) != pre_attention:
        raise PowerInferError(f"{g.path}: {g.arch} files run with runtime.smallthinker.SmallThinkerTransformer "
                              "(load_model picks it)" if not pre_attention else f"{g.path}: not a {PRE_ATTENTION_ROUTER} file")
    want = ACTIVATIONS.get(g.arch)
    if want is None or a.activation.kind != want:
        raise PowerInferError(f"{g.path}: {g.arch} experts with the {a.activation.kind} activation are not supported"
                              f"{f' ({want} only)' if want else ''}")
    ea = expert_args(g, a)

    def build(g: GGUFFile, i: int, a: ModelArgs, dtype: torch.dtype, dense: bool, mapped: bool = False):
        p = f"blk.{i}."
        router = load_tensor(g, p + "ffn_gate_inp.weight", dtype)
        parts = [load_experts(g, f"{p}ffn_{k}_exps.weight", dtype, mapped) for k in ("gate", "up", "down")]
        return ExpertsFFN(a.family, a.activation, router, *parts, ea=ea, pre_attention=pre_attention)

    return build

"""Model hyper-parameters read from a GGUF's metadata: the one place that knows the dims.

The family (and with it norm kind, RoPE mode, block layout) follows from
``general.architecture``; the FFN activation from our key ``powerinfer.activation``
(+ ``powerinfer.activation_threshold`` for ProSparse's FATReLU, which upstream
PowerInfer ignores); files without it (upstream's and llama.cpp's) are ReLU when sparse,
else the family's ``dense_gguf_activation`` (SiLU for ``llama``/``qwen2``/``qwen3``, ReLU for
upstream PowerInfer's ``bamboo``/``falcon``/``opt``).

Heads and RoPE as llama.cpp's loader reads them: ``{arch}.attention.key_length`` (and
``value_length``, which must equal it) is the head dim when present, else ``n_embd / n_head``;
``rope.dimension_count`` must equal it (no partial rotary); ``{arch}.rope.scaling.type``
absent, ``none`` or ``linear`` with ``rope.scaling.factor`` (or the older
``rope.scale_linear``) giving ``freq_scale = 1 / factor``; ``yarn``, ``longrope`` and any other
type are refused with the file named, before anything is allocated. Llama 3's per-frequency
factors are the tensor ``rope_freqs.weight`` (loaded by the model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import PowerInferError
from ..families import Activation, Family, family_for_gguf_arch
from ..formats.gguf_file import GGUFFile
from ..formats.gguf_validate import MAX_CTX, MAX_DIM, MAX_LAYERS


@dataclass(frozen=True)
class ModelArgs:
    """Dimensions and options of one model (batch 1; llama.cpp key names in comments)."""

    family: Family
    activation: Activation
    n_vocab: int
    n_embd: int  # {arch}.embedding_length
    n_ff: int  # {arch}.feed_forward_length
    n_layer: int  # {arch}.block_count
    n_head: int  # {arch}.attention.head_count
    n_head_kv: int  # {arch}.attention.head_count_kv
    n_ctx: int  # {arch}.context_length
    norm_eps: float
    rope_base: float
    n_rot: int  # {arch}.rope.dimension_count
    sparse: bool  # PWRI file: predictors present
    sparse_threshold: float  # powerinfer.sparse_threshold
    sliding_window: int | None = None  # {arch}.attention.sliding_window (Bamboo/Mistral); None = whole context
    key_length: int | None = None  # {arch}.attention.key_length (= value_length); None: n_embd / n_head
    rope_freq_scale: float = 1.0  # 1 / {arch}.rope.scaling.factor (linear scaling); positions times this

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelArgs":
        """Read and bound every dimension. Raises PowerInferError naming the file.

        Types and ranges of the float keys (epsilons, ``rope.freq_base``, thresholds) were
        checked when the file was opened (:mod:`powerinfer.formats.gguf_validate`)."""
        arch = g.arch
        fam = family_for_gguf_arch(arch, g.path)

        def dim(key: str, default: int | None = None, hi: int = MAX_DIM) -> int:
            v = g.get(f"{arch}.{key}", default)
            if v is None:
                raise PowerInferError(f"{g.path}: metadata key {arch}.{key} is missing")
            if not isinstance(v, int) or not 0 < v <= hi:
                raise PowerInferError(f"{g.path}: {arch}.{key} = {v!r} is out of range")
            return v

        n_embd, n_head = dim("embedding_length"), dim("attention.head_count")
        n_head_kv = dim("attention.head_count_kv", n_head)
        key_length = g.get(f"{arch}.attention.key_length")
        if key_length is not None:
            key_length = dim("attention.key_length")
            if dim("attention.value_length", key_length) != key_length:
                raise PowerInferError(f"{g.path}: {arch}.attention.value_length {g.get(f'{arch}.attention.value_length')} "
                                      f"!= key_length {key_length} (different K and V head sizes are not supported)")
        if (key_length is None and n_embd % n_head) or n_head % n_head_kv:
            raise PowerInferError(f"{g.path}: n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv} are inconsistent")
        head_dim = key_length or n_embd // n_head
        kind = g.get("powerinfer.activation")
        if kind is None:  # upstream's PWRI files are ReLU; dense ones run what llama.cpp runs for the arch
            kind = "relu" if g.sparse else fam.dense_gguf_activation
        act = Activation(str(kind), float(g.get("powerinfer.activation_threshold", 0.0)))
        toks = g.get("tokenizer.ggml.tokens")
        n_vocab = len(g.reader.get_field("tokenizer.ggml.tokens").data) if toks is not None else 0
        eps = g.get(f"{arch}.attention.layer_norm_rms_epsilon", g.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))
        window = g.get(f"{arch}.attention.sliding_window")
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise PowerInferError(f"{g.path}: {arch}.attention.sliding_window = {window!r} is out of range")
        n_rot = int(g.get(f"{arch}.rope.dimension_count", head_dim))
        if fam.rope is not None and n_rot != head_dim:
            raise PowerInferError(f"{g.path}: {arch}.rope.dimension_count {n_rot} != head dim {head_dim} "
                                  "(partial rotary embeddings are not supported)")
        freq_scale = rope_freq_scale(g, arch) if fam.rope is not None else 1.0
        return cls(
            family=fam, activation=act, n_vocab=n_vocab,
            n_embd=n_embd, n_ff=dim("feed_forward_length"), n_layer=dim("block_count", hi=MAX_LAYERS),
            n_head=n_head, n_head_kv=n_head_kv, n_ctx=dim("context_length", 2048, hi=MAX_CTX),
            norm_eps=float(eps), rope_base=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
            n_rot=n_rot, sparse=g.sparse, sparse_threshold=float(g.get("powerinfer.sparse_threshold", 0.0)),
            sliding_window=window, key_length=key_length if key_length != n_embd // n_head else None,
            rope_freq_scale=freq_scale,
        )


ROPE_SCALING_TYPES = ("none", "linear")  # llama.cpp's names; yarn and longrope are not implemented here


def rope_freq_scale(g: GGUFFile, arch: str) -> float:
    """``freq_scale`` of a file's RoPE (positions are multiplied by it), as llama.cpp's loader
    derives it: ``1 / {arch}.rope.scaling.factor`` (or the older ``rope.scale_linear``), 1 when
    neither is set. Raises PowerInferError naming the file for a scaling type other than
    ``none``/``linear`` (absent means ``linear``, as in llama.cpp) or a factor that is not a
    positive finite number."""
    kind = g.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise PowerInferError(f"{g.path}: rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported "
                              f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
    key = f"{arch}.rope.scaling.factor"
    if g.get(key) is None:
        key = f"{arch}.rope.scale_linear"
    factor = g.get(key, 0.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        raise PowerInferError(f"{g.path}: {key} = {factor!r} is out of range")
    return 1.0 if factor == 0 else 1.0 / float(factor)

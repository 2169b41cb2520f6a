"""Model hyper-parameters read from a GGUF's metadata: the one place that knows the dims.

The family (and with it norm kind, RoPE mode, block layout) follows from
``general.architecture``; the FFN activation from our key ``powerinfer.activation``
(+ ``powerinfer.activation_threshold`` for ProSparse's FATReLU, which upstream
PowerInfer ignores); files without it (upstream's) are ReLU when sparse or not
``llama``.
"""
from __future__ import annotations

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

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

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
        if n_embd % n_head or n_head % n_head_kv:
            raise PowerInferError(f"{g.path}: n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv} are inconsistent")
        kind = g.get("powerinfer.activation")
        if kind is None:  # upstream files: PWRI llama-family files are ReLU, plain llama GGUFs are SiLU
            kind = "relu" if (g.sparse or arch != "llama") else "silu"
        act = Activation(str(kind), float(g.get("powerinfer.activation_threshold", 0.0)))
        toks = g.get("tokenizer.ggml.tokens")
        n_vocab = len(g.reader.get_field("tokenizer.ggml.tokens").data) if toks is not None else 0
        eps = g.get(f"{arch}.attention.layer_norm_rms_epsilon", g.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))
        window = g.get(f"{arch}.attention.sliding_window")
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise PowerInferError(f"{g.path}: {arch}.attention.sliding_window = {window!r} is out of range")
        n_rot = int(g.get(f"{arch}.rope.dimension_count", n_embd // n_head))
        if fam.rope is not None and n_rot != n_embd // n_head:
            raise PowerInferError(f"{g.path}: {arch}.rope.dimension_count {n_rot} != head dim {n_embd // n_head} "
                                  "(partial rotary embeddings are not supported)")
        return cls(
            family=fam, activation=act, n_vocab=n_vocab,
            n_embd=n_embd, n_ff=dim("feed_forward_length"), n_layer=dim("block_count", hi=MAX_LAYERS),
            n_head=n_head, n_head_kv=n_head_kv, n_ctx=dim("context_length", 2048, hi=MAX_CTX),
            norm_eps=float(eps), rope_base=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
            n_rot=n_rot, sparse=g.sparse, sparse_threshold=float(g.get("powerinfer.sparse_threshold", 0.0)),
            sliding_window=window,
        )

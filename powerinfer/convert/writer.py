"""Write a Hugging Face model (plus predictors) as a GGUF or PowerInfer GGUF.

With predictors the file is a PowerInfer GGUF (FORMATS.md section 4): magic
``PWRI``, ``blk.i.ffn_down_t.weight`` (the down projection transposed to
``[n_ff, n_embd]`` so each neuron is one contiguous row) instead of
``ffn_down``, and the per-layer predictor ``blk.i.fc1.weight`` ``[H_i, n_embd]``
/ ``blk.i.fc2.weight`` ``[n_ff, H_i]``. Without predictors it is a plain dense
GGUF that llama.cpp reads. Q and K rows are permuted from the HF rotate-half
layout to GGML's interleaved RoPE layout, as llama.cpp's converter does.

Tensors are streamed: tensor infos are written first from shapes alone, then
each tensor is loaded, transformed and written (quantized a chunk of rows at a
time for ``--outtype q4_0|q8_0``), so memory stays bounded. The output goes to a
temporary file that is renamed only when complete. Which type each tensor gets is
:func:`.tensor_types.tensor_type`, shared with ``pi-quantize``.

Per architecture the tensor set is exactly what upstream's loader creates
(FORMATS.md section 4; :meth:`powerinfer.families.Family.expected_gguf_tensors`):
``llama``/``bamboo`` 3 + 11 per layer, ``falcon`` fused ``attn_qkv`` regrouped in
the "jploski" order with ``falcon.tensor_data_layout = "jploski"``, ``opt`` with
every bias (``ffn_down_t.bias`` in PowerInfer files), ``position_embd`` and no
``output`` (tied). Anything else in the checkpoint that the family cannot map stops
the conversion before a byte is written.

Beyond upstream's keys we write ``powerinfer.activation`` (and
``powerinfer.activation_threshold`` for FATReLU) so no reader guesses the FFN
activation from the architecture name, the model's real context length
(upstream's converter hard-codes 2048), and the family's extra keys (Bamboo's
``bamboo.attention.sliding_window``).

As llama.cpp's converter does: a config's RoPE scaling becomes ``{arch}.rope.scaling.*`` keys
or the ``rope_freqs.weight`` tensor (Llama 3.1+, :mod:`powerinfer.families.rope_scaling`); a
``head_dim`` that is not ``n_embd / n_head`` (Qwen3, Mistral-Nemo) is
``{arch}.attention.key_length``/``value_length`` and ``rope.dimension_count``; families with
``output_optional`` (Llama 3, Mistral, Qwen) write no ``output.weight`` for a tied checkpoint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import gguf
import numpy as np
import torch

from ..errors import PowerInferError
from ..families import Activation, Family, rope_theta
from ..families.rope_scaling import RopeScaling, hf_rope_scaling
from ..formats._atomic import atomic_path
from ..formats.gguf_file import PWRI_BYTES, set_magic
from ..formats.predictor import LayerPredictor, check_sparse_threshold, load_predictor_dir, read_predictor_config
from ..hf import check_model
from ..progress import progress as progress_bar
from ..families.experts import expert_counts
from .experts import expert_index, plan_stacks
from .outfile import check_outfile
from .hf_tensors import HFTensors
from .tensor_types import (FILE_TYPES, OUTTYPES, PREDICTOR_TYPES, UPSTREAM_Q8_0_SPARSE, encode, fallback_note,
                           falls_back, nbytes, tensor_type)
from .vocab import add_vocab

log = logging.getLogger(__name__)

# Buffers in HF checkpoints that carry no weights of their own (whole dotted components:
# Falcon's "ln_attn.bias" is a weight).
_SKIP_SUFFIXES = (".rotary_emb.inv_freq", ".attn.masked_bias", ".attn.bias")

UPSTREAM_SMALL_FFN = 1000  # upstream ggml.c: sparse FFNs with n_ff <= this take a broken block path



def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> GGML interleaved rows, per head (llama.cpp's ``permute``).

    ``w``: ``[n_head * head_dim, n_embd]`` (or 1-D bias). Within each head, rows
    ``[0..d/2)`` and ``[d/2..d)`` are interleaved so pair ``(2i, 2i+1)`` rotates together.
    """
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def falcon_qkv_jploski(w: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """Falcon's fused QKV rows, HF order -> upstream's "jploski" order.

    HF (``new_decoder_architecture``, and the older layouts as its special cases)
    groups the ``(n_head + 2 n_head_kv) * head_dim`` rows per kv head as
    ``[q_1 .. q_g, k, v]`` with ``g = n_head / n_head_kv``; GGML wants all Q heads,
    then all K heads, then all V heads. ``w``: ``[rows, n_embd]``.
    """
    g = w.reshape(n_head_kv, n_head // n_head_kv + 2, -1, *w.shape[1:])
    q, k, v = g[:, :-2], g[:, -2], g[:, -1]
    return torch.cat([q.reshape(-1, *w.shape[1:]), k.reshape(-1, *w.shape[1:]), v.reshape(-1, *w.shape[1:])])


@dataclass
class PlannedTensor:
    gguf_name: str
    shape: tuple[int, ...]  # torch order
    load: Callable[[], torch.Tensor]


def _plan(family: Family, cfg: dict, dims: dict, tensors: HFTensors, sparse: bool,
          predictors: list[LayerPredictor] | None, src: Path,
          rope: RopeScaling | None = None) -> list[PlannedTensor]:
    n_head, n_head_kv = dims["n_head"], dims["n_head_kv"]
    transforms = {
        None: lambda t: t,
        "permute_q": lambda t: permute_rope(t, n_head),
        "permute_k": lambda t: permute_rope(t, n_head_kv),
        "down": (lambda t: t.T.contiguous() if t.dim() == 2 else t) if sparse else (lambda t: t),
        "qkv_jploski": lambda t: falcon_qkv_jploski(t, n_head, n_head_kv),
    }
    by_name: dict[str, PlannedTensor] = {}
    experts: dict[str, dict[int, str]] = {}  # stacked expert tensor -> {expert: checkpoint name}
    for name in tensors.names():
        if name.endswith(_SKIP_SUFFIXES):
            continue
        hit = family.map_tensor(name)
        if hit is None:
            raise PowerInferError(f"{src}: tensor {name!r} has no GGUF name in the {family.name} family; "
                                  "refusing to write a file that would miss it")
        gname, tr = hit
        if gname is None:  # a tied copy upstream does not store
            continue
        if tr == "expert":  # one matrix of a 3-D expert stack (convert/experts.py)
            experts.setdefault(gname, {})[expert_index(name)] = name
            continue
        shape = tensors.shape(name)
        if tr == "down" and sparse:
            gname = gname.replace(".ffn_down.", ".ffn_down_t.")
            shape = shape[::-1]
        if gname in by_name:
            raise PowerInferError(f"{src}: two checkpoint tensors map to {gname} (the second is {name!r})")
        fn = transforms[tr]
        by_name[gname] = PlannedTensor(gname, shape, (lambda n=name, f=fn: f(tensors.get(n))))
    if experts:
        n_expert = expert_counts(cfg, src / "config.json")[0]
        for gname, (shape, load) in plan_stacks(experts, tensors.shape, tensors.get, n_expert, src).items():
            by_name[gname] = PlannedTensor(gname, shape, load)
    expected = family.expected_gguf_tensors(dims["n_layer"], sparse)
    # Tied embeddings: the upstream loader wants an explicit output.weight; llama.cpp's reuses token_embd.
    tied = "output.weight" not in by_name and "output.weight" in expected
    if tied and family.output_optional:
        expected.remove("output.weight")
    elif tied:
        emb = by_name.get("token_embd.weight")
        if emb is None:
            raise PowerInferError(f"{src}: no token embedding found")
        by_name["output.weight"] = PlannedTensor("output.weight", emb.shape, emb.load)
    if predictors is not None:
        for i, lp in enumerate(predictors):
            for part in ("fc1", "fc2"):
                t = getattr(lp, part)
                by_name[f"blk.{i}.{part}.weight"] = PlannedTensor(
                    f"blk.{i}.{part}.weight", tuple(t.shape), (lambda t=t: t))
    for name, t in (rope.tensors if rope is not None else {}).items():  # computed from the config
        by_name[name] = PlannedTensor(name, tuple(t.shape), (lambda t=t: t))
        expected.insert(0, name)
    missing = [n for n in expected if n not in by_name]
    extra = [n for n in by_name if n not in set(expected)]
    if missing or extra:
        raise PowerInferError(f"{src}: the checkpoint does not give the {family.gguf_arch} tensor set: "
                              f"missing {missing[:4]}, unexpected {extra[:4]}")
    return [by_name[n] for n in expected]


def _add_hparams(w: gguf.GGUFWriter, family: Family, cfg: dict, dims: dict, act: Activation, name: str,
                 rope: RopeScaling | None = None) -> None:
    w.add_name(name)
    w.add_context_length(dims["n_ctx"])
    w.add_embedding_length(dims["n_embd"])
    w.add_block_count(dims["n_layer"])
    w.add_feed_forward_length(dims["n_ff"])
    w.add_head_count(dims["n_head"])
    w.add_head_count_kv(dims["n_head_kv"])
    if family.norm == "rms":
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    else:
        w.add_layer_norm_eps(float(cfg.get("layer_norm_epsilon", cfg.get("layer_norm_eps", 1e-5))))
    if dims["head_dim"] != dims["n_embd"] // dims["n_head"]:
        w.add_key_length(dims["head_dim"])
        w.add_value_length(dims["head_dim"])
    if family.rope is not None:
        w.add_rope_dimension_count(dims["head_dim"])
        w.add_rope_freq_base(rope_theta(cfg))
        for key, value in (rope.kv if rope is not None else {}).items():
            _add_kv(w, f"{family.gguf_arch}.{key}", value)
    for key, value in (family.gguf_kv(cfg) if family.gguf_kv is not None else {}).items():
        _add_kv(w, key, value)
    w.add_string("powerinfer.activation", act.kind)
    if act.origin:  # what decided it: the config key, the modelling file read as text, --ffn-activation
        w.add_string("powerinfer.activation_source", act.origin)
    if act.kind == "fatrelu":
        w.add_float32("powerinfer.activation_threshold", act.threshold)


def _add_kv(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        raise TypeError(f"GGUF key {key}: unsupported value {value!r}")


def _model_name(model_dir: Path) -> str:
    d = model_dir.resolve()
    return d.parent.name if d.name in ("hf", "model") else d.name


def convert(model_dir: str | Path, outfile: str | Path, pred_dir: str | Path | None = None,
            outtype: str = "f16", sparse_threshold: float | None = None, progress: bool = True,
            predictor_type: str | None = None,
            before_write: Callable[[list[tuple[str, int]], dict], None] | None = None,
            upstream_warnings: bool = True) -> Path:
    """Convert ``model_dir`` (+ ``pred_dir``) to ``outfile``; returns the output path.

    ``outtype``: ``f16`` (2-D weights in f16, 1-D in f32; what upstream PowerInfer
    computes with), ``bf16`` (pi-run and llama.cpp; upstream PowerInfer has no BF16), ``f32``,
    or ``q4_0`` / ``q8_0`` (ggml's reference quantizers, :mod:`powerinfer.quant.ggml`). Which
    tensor gets which type, for quantized files too (``output.weight`` Q8_0, predictors
    ``predictor_type``, F16 for rows that are not a multiple of 32), is :func:`powerinfer.convert.tensor_types.tensor_type`.
    ``sparse_threshold`` overrides the predictor folder's ``config.json``. Raises
    PowerInferError for unsupported models or types, predictor folders that do not
    match, unmappable tensors, or NaN/inf weights in a quantized tensor; nothing is
    written at ``outfile`` then. The config must agree with the checkpoint
    (:func:`powerinfer.hf.check_model`), and ``outfile`` may replace only an earlier GGUF that is
    not an input (:func:`powerinfer.convert.outfile.check_outfile`).
    ``before_write(tensors, dims)``: called with every planned ``(gguf_name, bytes)`` and the
    model's dims once everything is checked, before the file is created; it may raise (the
    ``--vram-budget`` check). ``upstream_warnings`` False: the file is for pi-run only, so no
    warning about what upstream PowerInfer or llama.cpp would make of it (``pi-convert --for-pi-run``).
    """
    model_dir, outfile = Path(model_dir), Path(outfile)
    if outtype not in OUTTYPES:
        raise PowerInferError(f"--outtype {outtype!r} is not supported; supported: {', '.join(OUTTYPES)}")
    if predictor_type is not None and predictor_type not in PREDICTOR_TYPES:
        raise PowerInferError(f"--predictor-type {predictor_type!r} is not supported; "
                              f"supported: {', '.join(PREDICTOR_TYPES)}")
    check_outfile(outfile, [model_dir, pred_dir])  # a re-run may replace a GGUF there, nothing else
    if sparse_threshold is not None:
        sparse_threshold = check_sparse_threshold(sparse_threshold, "--sparse-threshold")
    checked = check_model(model_dir)
    family, cfg, act, dims = checked.family, checked.cfg, checked.act, checked.dims
    sparse = pred_dir is not None
    predictors = None
    if sparse:
        if family.experts:
            raise PowerInferError(f"{model_dir / 'config.json'}: {family.name} is a mixture-of-experts model: "
                                  "predictor (PowerInfer) files of experts are not supported; convert without predictors")
        if not act.is_sparse:
            raise PowerInferError(f"{model_dir / 'config.json'}: activation {act.kind!r} is not ReLU-family, so its FFN "
                                  "has no sparsity to predict; convert without predictors for a dense GGUF" + act.note)
        predictors = load_predictor_dir(pred_dir, dims["n_layer"], dims["n_embd"], dims["n_ff"])
        if sparse_threshold is None:  # checked by read_predictor_config
            sparse_threshold = float(read_predictor_config(pred_dir).get("sparse_threshold", 0.0))
        if outtype == "f32" and upstream_warnings:
            log.warning("f32 output: upstream PowerInfer's CPU kernel reads ffn_down_t only as f16/Q4_0 "
                        "and computes garbage from f32; use this file with pi-run only")
        if outtype == "q8_0" and upstream_warnings:
            log.warning(UPSTREAM_Q8_0_SPARSE)
        if outtype == "bf16" and upstream_warnings:
            log.warning("bf16 output: upstream PowerInfer's ggml has no BF16 type and refuses the file; "
                        "use it with pi-run (llama.cpp reads a dense bf16 GGUF)")
        if dims["n_ff"] <= UPSTREAM_SMALL_FFN and upstream_warnings:
            log.warning("n_ff %d <= %d: upstream PowerInfer's CPU build routes such small FFNs to a block "
                        "kernel that ignores the predictor (ggml.c, mul_mat_sparse_head) and prints garbage; "
                        "the file is correct and pi-run runs it", dims["n_ff"], UPSTREAM_SMALL_FFN)
    elif family.gguf_arch == "llama" and act.kind != "silu" and upstream_warnings:
        log.warning("dense %s GGUF: upstream PowerInfer and llama.cpp run dense llama files with SiLU and "
                    "ignore powerinfer.activation; this file is for pi-run (convert with predictors for upstream)",
                    act.kind)
    rope = hf_rope_scaling(cfg, dims["head_dim"], rope_theta(cfg), str(model_dir / "config.json")) \
        if family.rope is not None else None
    tensors = HFTensors(model_dir)
    plan = _plan(family, cfg, dims, tensors, sparse, predictors, model_dir, rope)
    types = [tensor_type(pt.gguf_name, pt.shape, outtype, predictor_type) for pt in plan]
    kept = [(pt.gguf_name, pt.shape) for pt in plan if falls_back(pt.gguf_name, pt.shape, outtype, predictor_type)]
    if kept:
        log.warning(fallback_note(kept, outtype))
    n_vocab = checked.n_vocab  # the embedding's rows, which config.json's vocab_size was checked against
    if before_write is not None:
        before_write([(pt.gguf_name, nbytes(pt.shape, qt)) for pt, qt in zip(plan, types)], dims)

    with atomic_path(outfile) as tmp:
        w = gguf.GGUFWriter(str(tmp), family.gguf_arch)
        _add_hparams(w, family, cfg, dims, act, _model_name(model_dir), rope)
        w.add_file_type(FILE_TYPES[outtype])
        if sparse:
            w.add_float32("powerinfer.sparse_threshold", float(sparse_threshold))
        add_vocab(w, model_dir, n_vocab)
        for pt, qt in zip(plan, types):
            w.add_tensor_info(pt.gguf_name, pt.shape, np.dtype(np.float32), nbytes(pt.shape, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        it: Iterable[tuple[PlannedTensor, gguf.GGMLQuantizationType]] = list(zip(plan, types))
        if progress:
            it = progress_bar(it, desc=f"writing {outfile.name}", unit="tensor")
        for pt, qt in it:
            t = pt.load().detach().to(torch.float32)
            if tuple(t.shape) != pt.shape:
                raise PowerInferError(f"{model_dir}: tensor for {pt.gguf_name} has shape {tuple(t.shape)}, "
                                      f"expected {pt.shape}")
            w.write_tensor_data(encode(t.numpy(), qt, pt.gguf_name))
        w.close()
        if sparse:
            set_magic(tmp, PWRI_BYTES)
    return outfile

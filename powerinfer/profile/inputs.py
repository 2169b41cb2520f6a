"""``pi-profile`` for SiLU/GELU-gated models: the input-magnitude histograms input sparsity is set from.

A SiLU model has no inactive neurons to count; what TEAL and WINA need instead is, per layer and per
matrix input (q/k/v, attn_output, gate/up, down), the distribution of the input's magnitudes, from which
a threshold for any sparsity is read (:mod:`powerinfer.formats.input_hist`, the activation-folder files
``input_hist_{i}.pt``, ``wina_hist_{i}.pt``, ``input_hist.json``). Two sources give the same histograms on
the same model and text:

* a Hugging Face folder: transformers' own model (f32, CPU, loaded whole: 4 bytes a parameter, unlike the
  layer-streamed neuron profile), a forward pre-hook on ``q_proj``,
  ``o_proj``, ``gate_proj`` and ``down_proj`` of every decoder layer (:func:`hf_calibrate`);
* a GGUF file (a user's llama.cpp file, no Hugging Face copy): this project's runtime, every product
  dense (:func:`powerinfer.convert.teal.calibrate_inputs`).

Both tokenize the whole text once (BOS first, as the tokenizer says), keep the first ``max_tokens``
tokens and run them in chunks of ``n_ctx`` tokens, each from position 0, so the same model and text give
the same token ids and activations (up to f32 rounding: a few values in a million change bin).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import PowerInferError

DENSE_ACTS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh")
ATTN_INPUTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",)}
DEFAULT_CHUNK = 512  # tokens per calibration chunk (pi-sparsify's and pi-convert --data's -c default)


def calibration_text(data: str | Path, text_field: str = "text") -> str:
    """The text of ``data``: a plain text file as it is (as ``pi-sparsify --data`` reads it); JSON/JSONL
    files, folders and ``hf:`` datasets as their documents joined by blank lines (:mod:`powerinfer.data`)."""
    from ..convert.teal_cli import read_text
    from ..data import iter_documents

    p = Path(data)
    if p.is_file() and p.suffix.lower() not in (".json", ".jsonl"):
        return read_text(str(p))
    return "\n\n".join(iter_documents(data, text_field=text_field))


def is_input_sparse_model(model: str | Path) -> bool:
    """True when ``model`` is a GGUF file or a Hugging Face folder whose FFN activation is not ReLU-family
    (its profile is the input histograms, not neuron counts)."""
    p = Path(model)
    if p.is_file():
        return True
    from ..hf import resolve_model

    _, _, act = resolve_model(p)
    return not act.is_sparse


def check_hf_family(model_dir: Path):
    """``(family, config dict, activation)`` of a gated SiLU/GELU model with sequential RoPE blocks and the
    Llama module names, not a mixture of experts; PowerInferError naming ``config.json`` otherwise."""
    from ..hf import resolve_model

    fam, cfg, act = resolve_model(model_dir)
    src = model_dir / "config.json"
    if fam.experts:  # the hooks read one FFN's gate/up/down per layer; a GGUF of experts is refused likewise
        raise PowerInferError(f"{src}: input sparsity (TEAL) is not supported for mixture-of-experts models "
                              f"({fam.name})")
    if not fam.gated or fam.ffn != "reglu" or act.kind not in DENSE_ACTS:
        raise PowerInferError(f"{src}: input sparsity needs a SiLU/GELU-gated FFN; this {fam.name} model's FFN is "
                              f"{'gated ' if fam.gated else 'not gated, '}{act.kind}{act.note}")
    if fam.parallel_attn or fam.rope is None:
        raise PowerInferError(f"{src}: input sparsity supports sequential RoPE blocks (Llama, Qwen2/3, Mistral) only")
    return fam, cfg, act


def check_hf_text(model_dir: str | Path, text: str) -> None:
    """PowerInferError (:func:`~powerinfer.convert.teal.check_tokens`) when ``text`` has fewer calibration tokens
    than needed under the folder's tokenizer; only its first 64 KiB characters are tokenized."""
    from ..convert.teal import MIN_TOKENS, check_tokens
    from ..hf import load_hf_tokenizer

    head = text[:1 << 16]
    n = len(load_hf_tokenizer(model_dir)(head, add_special_tokens=True, verbose=False)["input_ids"])
    if n < MIN_TOKENS and len(head) == len(text):
        check_tokens(n)


def hf_calibrate(model_dir: str | Path, text: str, n_ctx: int = DEFAULT_CHUNK, max_tokens: int = 16384,
                 progress: Callable[[int], None] | None = None):
    """:class:`~powerinfer.convert.teal.Calibration` of a Hugging Face folder over ``text`` (module docstring):
    ``|x|`` and ``|x_j| * ||W[:, j]||`` histograms ``[n_layer, 4, N_BINS]`` of every matrix input, in f32 on
    the CPU. ``n_ctx`` is cut to the model's context length. Raises PowerInferError for a model that is not
    SiLU/GELU-gated or a text shorter than the minimum, before the weights are read."""
    from ..convert.teal import Calibration, check_tokens, recorder
    from ..families import get_attr, model_layers
    from ..formats.input_hist import new_hist
    from ..formats.teal import KINDS
    from ..hf import check_model, load_hf_model, load_hf_tokenizer
    from .collect import forward_layers

    model_dir = Path(model_dir)
    fam, cfg, _ = check_hf_family(model_dir)
    check_model(model_dir)  # config values and every tensor's shape, before the weights are loaded
    tok = load_hf_tokenizer(model_dir)
    ids = tok(text, add_special_tokens=True, verbose=False)["input_ids"][:max_tokens]
    check_tokens(len(ids))
    n_ctx = min(n_ctx, int(cfg.get("max_position_embeddings") or n_ctx))
    model = load_hf_model(model_dir, torch.float32)
    layers = model_layers(fam, model)
    paths = dict(ATTN_INPUTS, gate_up=(fam.gate_attr, fam.up_attr), down=(fam.down_attr,))
    cal = Calibration(new_hist(len(layers)), new_hist(len(layers)), len(ids))
    hooks = []
    try:
        for i, layer in enumerate(layers):
            for kind in KINDS:
                mods = [get_attr(layer, p) for p in paths[kind]]
                sq = sum((m.weight.detach().double() ** 2).sum(dim=0) for m in mods)  # W [N, K]: over outputs
                rec = recorder(cal, i, kind, sq.sqrt().float())
                hooks.append(mods[0].register_forward_pre_hook(
                    (lambda r: (lambda mod, args: r(args[0].reshape(-1, args[0].shape[-1]))))(rec)))
        for s in range(0, len(ids), n_ctx):
            chunk = ids[s:s + n_ctx]
            forward_layers(model, torch.tensor([chunk], dtype=torch.long))
            if progress is not None:
                progress(len(chunk))
    finally:
        for h in hooks:
            h.remove()
    return cal


def profile_inputs(model: str | Path, data: str | Path, out_dir: str | Path, *, n_ctx: int = DEFAULT_CHUNK,
                   max_tokens: int = 16384, text_field: str = "text"):
    """The ``pi-profile`` stage of a SiLU/GELU-gated model (a Hugging Face folder or a GGUF file): its input
    histograms over ``data``, written into ``out_dir`` (atomically; pi-profile's neuron counts there are kept).
    Returns the :class:`~powerinfer.convert.teal.Calibration`."""
    from ..convert.teal import calibrate_inputs
    from ..formats.input_hist import save_hist

    text = calibration_text(data, text_field)
    p = Path(model)
    cal = calibrate_inputs(p, text, n_ctx, max_tokens) if p.is_file() else hf_calibrate(p, text, n_ctx, max_tokens)
    save_hist(out_dir, cal.hist, cal.n_tokens, str(model), cal.wina)
    return cal


def threshold_table(cal, levels=(0.25, 0.4, 0.5)) -> str:
    """What ``pi-profile`` prints for a SiLU model: per layer and input, the ``|x|`` threshold at each of
    ``levels`` (uniform allocation)."""
    from ..formats.input_hist import threshold_for
    from ..formats.teal import KINDS
    from .cli import format_table

    heads = ["layer", "input"] + [f"|x| at {100 * s:.0f}%" for s in levels]
    rows = [[i, kind] + [f"{threshold_for(cal.hist[i, k], s):.4g}" for s in levels]
            for i in range(cal.hist.shape[0]) for k, kind in enumerate(KINDS)]
    return format_table(heads, rows)

"""Calibration text: documents from local files (or the hub) packed into token batches.

Profiling (``pi-profile``) and predictor training (``pi-train-predictor``) both run the
model over plain text. This module turns a *source* into batches of token ids:

* a ``.txt`` file: loaded with ``datasets.load_dataset("text", sample_by="paragraph")``,
  so one document = one paragraph (lines up to a blank line); a line holding only
  ``<|endoftext|>`` also ends a document (TinyStories / GPT-2 style dumps);
* a ``.json`` / ``.jsonl`` file: ``load_dataset("json")``, one document per record, taken
  from the ``text`` field (``text_field`` picks another);
* a folder: every ``*.txt``, ``*.json``, ``*.jsonl`` below it, in sorted path order;
* ``hf:NAME`` or ``hf:NAME:CONFIG``: a Hugging Face hub dataset's ``train`` split (needs the
  network or the local datasets cache; never required).

``datasets`` keeps the text in memory-mapped Arrow files, and documents are tokenized a
few hundred at a time, so memory stays bounded whatever the corpus size.

Packing (the usual causal-LM recipe, no padding): documents are tokenized without special
tokens and concatenated into one stream, each followed by the EOS token (or, for a
tokenizer without EOS, the token of ``"\\n"``). The stream is cut into sequences of
``seq_len`` tokens; each sequence starts with BOS (when the tokenizer has one) followed by
the next ``seq_len - 1`` stream tokens, so documents may continue across sequences.

Held-out split: the last ``heldout`` share of documents (by position in the source,
deterministic, at least one) is the ``"heldout"`` split and the rest the ``"train"``
split; ``"all"`` is everything. Predictor training stops early on the held-out split,
so its tokens are never training tokens.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .errors import PowerInferError

__all__ = ["DOC_SEPARATOR", "SPLITS", "load_documents", "count_documents", "iter_documents",
           "pack_token_ids", "calibration_batches"]

DOC_SEPARATOR = "<|endoftext|>"
SPLITS = ("all", "train", "heldout")
_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json"}
_TOKENIZE_CHUNK = 256  # documents tokenized per call


# --------------------------------------------------------------------------- documents
def _data_files(source: Path) -> list[Path]:
    if source.is_file():
        if source.suffix.lower() not in _SUFFIXES:
            raise PowerInferError(f"{source}: unsupported data file type {source.suffix!r} "
                                  f"(expected .txt, .json or .jsonl)")
        return [source]
    files = sorted(p for p in source.rglob("*")
                   if p.is_file() and p.suffix.lower() in _SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(source).parts))
    if not files:
        raise PowerInferError(f"{source}: data folder holds no .txt, .json or .jsonl files")
    return files


def _load_file(path: Path, text_field: str):
    import datasets

    datasets.disable_progress_bars()
    kind = _SUFFIXES[path.suffix.lower()]
    if path.stat().st_size == 0:
        return None  # datasets cannot build a dataset from an empty file
    try:
        if kind == "text":
            ds = datasets.load_dataset("text", data_files=str(path), sample_by="paragraph",
                                       keep_linebreaks=True, split="train")
            field = "text"
        else:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
            field = text_field
    except Exception as e:  # noqa: BLE001 - datasets raises many types for bad files
        raise PowerInferError(f"{path}: could not read it as {kind} data ({type(e).__name__}: {e})") from None
    if len(ds) and field not in ds.column_names:
        raise PowerInferError(f"{path}: records have no {field!r} field (fields: {', '.join(ds.column_names)}); "
                              f"pick one with the text-field option")
    return ds, field, str(path)


def _load_hub(spec: str, text_field: str):
    import datasets

    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"hf:{spec}: could not load this hub dataset "
                              f"(offline, or no such dataset? {type(e).__name__}: {e})") from None
    if text_field not in ds.column_names:
        raise PowerInferError(f"hf:{spec}: records have no {text_field!r} field "
                              f"(fields: {', '.join(ds.column_names)})")
    return ds, text_field, f"hf:{spec}"


def load_documents(source: str | Path, text_field: str = "text") -> list[tuple[Any, str, str]]:
    """Open a calibration source: a list of ``(datasets.Dataset, field, name)`` parts.

    ``source`` is a ``.txt``/``.json``/``.jsonl`` file, a folder of them, or ``hf:NAME[:CONFIG]``
    (see the module docstring). Nothing is tokenized yet; the Arrow data is memory-mapped.

    Raises PowerInferError naming the path for a missing file or folder, an unsupported
    file type, an unreadable file, or JSON records without ``text_field``.
    """
    if isinstance(source, str) and source.startswith("hf:"):
        return [_load_hub(source[3:], text_field)]
    path = Path(source).expanduser()
    if not path.exists():
        raise PowerInferError(f"{path}: data file not found")
    parts = [_load_file(p, text_field) for p in _data_files(path)]
    parts = [p for p in parts if p is not None]
    if not parts:
        raise PowerInferError(f"{path}: no text (the calibration data is empty)")
    return parts


def count_documents(parts: list[tuple[Any, str, str]]) -> int:
    """Number of documents (rows: paragraphs of text files, records of JSON files)."""
    return sum(len(ds) for ds, _, _ in parts)


def _split_range(n_docs: int, split: str, heldout: float, source: str | Path) -> tuple[int, int]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "all":
        return 0, n_docs
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout must be in (0, 1), got {heldout}")
    if n_docs < 2:
        raise PowerInferError(f"{source}: has {n_docs} document(s); a held-out split needs at least 2 "
                              f"(documents are paragraphs of .txt files, records of JSON files)")
    n_held = min(n_docs - 1, max(1, round(n_docs * heldout)))
    cut = n_docs - n_held
    return (0, cut) if split == "train" else (cut, n_docs)


def iter_documents(source: str | Path, split: str = "all", heldout: float = 0.1,
                   text_field: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of one split of ``source`` as stripped strings.

    ``split``: ``"all"``, ``"train"`` (all but the last ``heldout`` share of documents) or
    ``"heldout"`` (that last share, at least one document). A ``.txt`` paragraph holding
    ``<|endoftext|>`` lines yields one document per piece (in the paragraph's split).

    Raises PowerInferError as :func:`load_documents`, and when the split has no text.
    """
    parts = load_documents(source, text_field)  # errors now, not at the first next()
    lo, hi = _split_range(count_documents(parts), split, heldout, source)
    if hi <= lo:
        raise PowerInferError(f"{source}: no text (the calibration data is empty)")
    return _documents(parts, lo, hi, split, source)


def _documents(parts, lo: int, hi: int, split: str, source) -> Iterator[str]:
    n_yielded = 0
    offset = 0
    for ds, field, name in parts:
        a, b = max(lo - offset, 0), min(hi - offset, len(ds))
        offset += len(ds)
        for start in range(a, b, _TOKENIZE_CHUNK):
            for text in ds[start:min(start + _TOKENIZE_CHUNK, b)][field]:
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise PowerInferError(f"{name}: field {field!r} holds {type(text).__name__}, expected text")
                for piece in text.split(DOC_SEPARATOR):
                    piece = piece.strip()
                    if piece:
                        n_yielded += 1
                        yield piece
    if n_yielded == 0:
        what = "" if split == "all" else f" in its {split} split"
        raise PowerInferError(f"{source}: no text{what} (the calibration data is empty)")


# --------------------------------------------------------------------------- packing
def _separator_ids(tokenizer) -> list[int]:
    if tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
    return [int(ids[-1])] if ids else []


def pack_token_ids(documents: Iterable[str], tokenizer, seq_len: int,
                   max_tokens: int | None = None) -> Iterator[list[int]]:
    """Pack documents into token sequences (lists of ints), ``seq_len`` long except the last.

    Each sequence is ``[BOS] + next seq_len-1 tokens`` of the stream ``doc_0 EOS doc_1 EOS ...``
    (no BOS if the tokenizer has none). The last sequence is shorter when the text or the
    ``max_tokens`` cap runs out; the total length of all sequences is
    ``min(max_tokens, available)``. Sequences shorter than 2 tokens are dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bos = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
    sep = _separator_ids(tokenizer)
    body = seq_len - len(bos)
    left = math.inf if max_tokens is None else max_tokens
    buf: list[int] = []

    def take(n: int) -> list[int]:
        nonlocal buf, left
        seq = bos + buf[:n]
        buf = buf[n:]
        seq = seq[: int(min(len(seq), left))]
        left -= len(seq)
        return seq

    docs = iter(documents)
    while left > 0:
        chunk = [d for _, d in zip(range(_TOKENIZE_CHUNK), docs)]
        if not chunk:
            break
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            buf.extend(ids)
            buf.extend(sep)
        while len(buf) >= body and left > 0:
            seq = take(body)
            if len(seq) >= 2:
                yield seq
    if buf and left > 0:
        seq = take(len(buf))
        if len(seq) >= 2:
            yield seq


def calibration_batches(source: str | Path, tokenizer, max_tokens: int | None, seq_len: int,
                        batch_size: int, split: str = "all", heldout: float = 0.1,
                        text_field: str = "text") -> Iterator[torch.Tensor]:
    """Yield LongTensor batches ``[B, T]`` of packed token ids from one split of ``source``.

    ``T = seq_len`` and ``B = batch_size`` for full batches; the final full-length
    sequences may form a smaller ``B``, and a final shorter sequence (text or cap ran
    out) comes alone as ``[1, t]``. No padding anywhere, so every position is a real token.
    The total number of tokens yielded (BOS included) is at most ``max_tokens``
    (None: no cap). Packing and splits are described in the module docstring.

    Raises PowerInferError for a missing/unreadable source or when the split has no text.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    docs = iter_documents(source, split, heldout, text_field)  # opens the source now
    return _batches(pack_token_ids(docs, tokenizer, seq_len, max_tokens), seq_len, batch_size)


def _batches(seqs: Iterator[list[int]], seq_len: int, batch_size: int) -> Iterator[torch.Tensor]:
    rows: list[list[int]] = []
    for seq in seqs:
        if len(seq) < seq_len:
            if rows:
                yield torch.tensor(rows, dtype=torch.long)
                rows = []
            yield torch.tensor([seq], dtype=torch.long)
            continue
        rows.append(seq)
        if len(rows) == batch_size:
            yield torch.tensor(rows, dtype=torch.long)
            rows = []
    if rows:
        yield torch.tensor(rows, dtype=torch.long)

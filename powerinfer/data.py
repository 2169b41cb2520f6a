"""Calibration text: documents from local files (or the hub) packed into token batches.

Profiling (``pi-profile``) and predictor training (``pi-train-predictor``) both run the
model over plain text. This module turns a *source* into batches of token ids:

* a plain-text file (any suffix but ``.json``/``.jsonl``: ``.txt``, WikiText's ``.raw``,
  ``.md``, ...): one document = one paragraph, i.e. the lines up to a *blank* line, a line
  that is empty or holds only whitespace (WikiText's blank lines hold a single space); a
  line holding only ``<|endoftext|>`` also ends a document (TinyStories / GPT-2 style
  dumps). The file must decode as UTF-8 (a leading BOM is dropped; ``\\r\\n`` and ``\\r``
  end lines too); anything else, a NUL byte included (a ``.safetensors`` or ``.gguf``
  passed by mistake), is refused with the path and the byte offset. The file is streamed,
  never read whole: a paragraph longer than about a million characters is cut into
  documents at line ends (and a longer line at that length);
* a ``.json`` / ``.jsonl`` file: ``load_dataset("json")``, one document per record, taken
  from the ``text`` field (``text_field`` picks another);
* a folder: every ``*.txt``, ``*.raw``, ``*.md``, ``*.json``, ``*.jsonl`` below it, in sorted
  path order, skipping hidden files and folders;
* ``hf:NAME`` or ``hf:NAME:CONFIG``: a Hugging Face hub dataset's ``train`` split (needs the
  network or the local datasets cache; never required).

Text files are read in a streaming pass (checked and counted once when opened; the
count is remembered per file size and mtime), ``datasets`` keeps JSON and hub text in
memory-mapped Arrow files, and documents are tokenized a few hundred (at most about a
million characters) at a time, so memory stays bounded whatever the corpus size.

Packing (the usual causal-LM recipe, no padding): documents are tokenized without special
tokens and concatenated into one stream, each followed by the EOS token (or, for a
tokenizer without EOS, the token of ``"\\n"``). The stream is cut into sequences of
``seq_len`` tokens; each sequence starts with BOS (when the tokenizer has one) followed by
the next ``seq_len - 1`` stream tokens, so documents may continue across sequences.

Held-out split (deterministic; ``"all"`` is everything):

* by documents, when the source has at least ``MIN_SPLIT_DOCUMENTS`` (20) documents and
  ``round(n_documents * heldout)`` is between 1 and ``n_documents - 1``: the last that many
  documents (by position in the source) are the ``"heldout"`` split, the rest the
  ``"train"`` split;
* by tokens otherwise (a text of few paragraphs, or a held-out share that rounds to no
  document or to all of them): the whole source is packed into one stream as above, its
  last ``max(MIN_SPLIT_TOKENS, round(n_stream_tokens * heldout))`` tokens are the
  ``"heldout"`` split and the tokens before them the ``"train"`` split, each packed into
  sequences on its own (each sequence starts with BOS). The train part needs at least
  ``MIN_SPLIT_TOKENS`` (16) tokens too, else PowerInferError. Only
  :func:`calibration_batches` (which has the tokenizer) can split this way;
  :func:`iter_documents` refuses such a split.

Either way the two splits partition the source: predictor training stops early on the
held-out split, so its tokens are never training tokens.
"""
from __future__ import annotations

import codecs
import math
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .errors import PowerInferError

__all__ = ["DOC_SEPARATOR", "SPLITS", "MIN_SPLIT_DOCUMENTS", "MIN_SPLIT_TOKENS", "load_documents",
           "count_documents", "iter_documents", "pack_token_ids", "calibration_batches"]

DOC_SEPARATOR = "<|endoftext|>"
SPLITS = ("all", "train", "heldout")
MIN_SPLIT_DOCUMENTS = 20  # fewer documents: the held-out split is by tokens
MIN_SPLIT_TOKENS = 16  # least tokens in each split of a split by tokens
_JSON_SUFFIXES = {".json", ".jsonl"}
_FOLDER_SUFFIXES = {".txt", ".raw", ".md"} | _JSON_SUFFIXES
_TOKENIZE_CHUNK = 256  # documents tokenized per call ...
_TOKENIZE_CHARS = 1 << 20  # ... or fewer, once they hold this many characters
_MAX_DOC_CHARS = 1 << 20  # a longer paragraph is cut at line ends (a longer line at this length)
_READ_BYTES = 1 << 20  # text files are read this many bytes at a time
_SCANNED: dict[tuple[str, int, int], int] = {}  # (path, size, mtime_ns) -> documents


# --------------------------------------------------------------------------- text files
def _not_text(path: Path, offset: int, what: str) -> PowerInferError:
    return PowerInferError(f"{path}: not UTF-8 text (byte offset {offset}: {what}); calibration data "
                           f"is plain text, .json or .jsonl")


def _text_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file without their ends (``\\n``, ``\\r\\n``, ``\\r``), streamed.

    Raises PowerInferError at the first byte that does not decode or is NUL.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    pos = 0  # bytes read so far
    pending = ""  # text after the last line end
    first = True
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_BYTES)
            final = not chunk
            held = len(decoder.getstate()[0])  # bytes of a split character kept from the last chunk
            start = pos - held  # file offset of the first byte decoded now
            nul = chunk.find(b"\x00")  # NUL is valid UTF-8 but not text
            try:
                text = decoder.decode(chunk, final)
            except UnicodeDecodeError as e:
                if nul < 0 or pos + nul > start + e.start:  # else the NUL comes first
                    raise _not_text(path, start + e.start, f"byte 0x{e.object[e.start]:02x}, {e.reason}") from None
            if nul >= 0:
                raise _not_text(path, pos + nul, "a NUL byte")
            pos += len(chunk)
            if first and text:
                first = False
                text = text.removeprefix("\ufeff")
            text = pending + text
            tail = ""
            if not final and text.endswith("\r"):  # maybe the first half of \r\n
                text, tail = text[:-1], "\r"
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            pending = lines.pop() + tail
            yield from lines
            while len(pending) > _MAX_DOC_CHARS:
                yield pending[:_MAX_DOC_CHARS]
                pending = pending[_MAX_DOC_CHARS:]
            if final:
                break
    if pending:
        yield pending


def _text_documents(path: Path) -> Iterator[str]:
    """The documents of a text file (module docstring), stripped and non-empty, streamed."""
    lines: list[str] = []
    size = 0

    def flush() -> Iterator[str]:
        nonlocal size
        text = "\n".join(lines)
        lines.clear()
        size = 0
        for piece in text.split(DOC_SEPARATOR):
            piece = piece.strip()
            if piece:
                yield piece

    for line in _text_lines(path):
        if not line or line.isspace():
            yield from flush()
            continue
        for i in range(0, len(line), _MAX_DOC_CHARS):
            piece = line[i:i + _MAX_DOC_CHARS]
            if lines and size + len(piece) > _MAX_DOC_CHARS:
                yield from flush()
            lines.append(piece)
            size += len(piece) + 1
    yield from flush()


class _TextFile:
    """A plain-text file as documents: ``len()`` counts them, :meth:`rows` streams them.

    Opening it decodes the whole file once (errors now, not mid-run) unless a file of the
    same path, size and mtime was counted before.
    """

    def __init__(self, path: Path):
        self.path = path
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _SCANNED:
            _SCANNED[key] = sum(1 for _ in _text_documents(path))
        self.n = _SCANNED[key]

    def __len__(self) -> int:
        return self.n

    def rows(self, a: int, b: int) -> Iterator[str]:
        return islice(_text_documents(self.path), a, b)


# --------------------------------------------------------------------------- documents
def _data_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    files = sorted(p for p in source.rglob("*")
                   if p.is_file() and p.suffix.lower() in _FOLDER_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(source).parts))
    if not files:
        raise PowerInferError(f"{source}: data folder holds no .txt, .raw, .md, .json or .jsonl files")
    return files


def _load_file(path: Path, text_field: str):
    if path.suffix.lower() not in _JSON_SUFFIXES:
        return _TextFile(path), "text", str(path)
    import datasets

    datasets.disable_progress_bars()
    if path.stat().st_size == 0:
        return None  # datasets cannot build a dataset from an empty file
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for bad files
        raise PowerInferError(f"{path}: could not read it as json data ({type(e).__name__}: {e})") from None
    if len(ds) and text_field not in ds.column_names:
        raise PowerInferError(f"{path}: records have no {text_field!r} field (fields: {', '.join(ds.column_names)}); "
                              f"pick one with the text-field option")
    return ds, text_field, str(path)


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
    """Open a calibration source: a list of ``(documents, field, name)`` parts.

    ``source`` is a text or ``.json``/``.jsonl`` file, a folder of them, or ``hf:NAME[:CONFIG]``
    (see the module docstring). ``documents`` is a ``datasets.Dataset`` (JSON, hub) or a
    streamed text file; ``len()`` of either counts its documents. Nothing is tokenized yet.

    Raises PowerInferError naming the path for a missing file or folder, a file that is
    not UTF-8 text (nor JSON), an unreadable file, or JSON records without ``text_field``.
    """
    if isinstance(source, str) and source.startswith("hf:"):
        return [_load_hub(source[3:], text_field)]
    path = Path(source).expanduser()
    if not path.exists():
        raise PowerInferError(f"{path}: data file not found")
    try:
        parts = [_load_file(p, text_field) for p in _data_files(path)]
    except OSError as e:
        raise PowerInferError(f"{e.filename or path}: cannot read it ({e.strerror or e})") from None
    parts = [p for p in parts if p is not None]
    if not parts:
        raise PowerInferError(f"{path}: no text (the calibration data is empty)")
    return parts


def count_documents(parts: list[tuple[Any, str, str]]) -> int:
    """Number of documents (paragraphs of text files, records of JSON files)."""
    return sum(len(ds) for ds, _, _ in parts)


def _check_split(split: str, heldout: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split != "all" and not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout must be in (0, 1), got {heldout}")


def _split_by_documents(n_docs: int, heldout: float) -> bool:
    """The rule of the module docstring: hold out whole documents, or else tokens."""
    return n_docs >= MIN_SPLIT_DOCUMENTS and 1 <= round(n_docs * heldout) <= n_docs - 1


def _split_range(n: int, split: str, heldout: float) -> tuple[int, int]:
    """``[lo, hi)`` of ``n`` documents (by-documents split) or stream tokens (by tokens)."""
    if split == "all":
        return 0, n
    cut = n - max(1, round(n * heldout))
    return (0, cut) if split == "train" else (cut, n)


def _token_split_range(n_tokens: int, n_docs: int, split: str, heldout: float, source) -> tuple[int, int]:
    n_held = max(MIN_SPLIT_TOKENS, round(n_tokens * heldout))
    cut = n_tokens - n_held
    if cut < MIN_SPLIT_TOKENS:
        raise PowerInferError(
            f"{source}: too little text for a held-out split: {n_tokens} tokens in {n_docs} document(s); a "
            f"held-out split needs at least 2 x {MIN_SPLIT_TOKENS} tokens ({MIN_SPLIT_TOKENS} to train on and "
            f"{MIN_SPLIT_TOKENS} held out, or the --heldout-frac share of them if that is more)")
    return (0, cut) if split == "train" else (cut, n_tokens)


def iter_documents(source: str | Path, split: str = "all", heldout: float = 0.1,
                   text_field: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of one split of ``source`` as stripped strings.

    ``split``: ``"all"``, ``"train"`` (all but the last ``heldout`` share of documents) or
    ``"heldout"`` (that last share, at least one document). A text paragraph or JSON
    record holding ``<|endoftext|>`` yields one document per piece (in its split).

    Raises PowerInferError as :func:`load_documents`, when the split has no text, and for
    ``"train"``/``"heldout"`` when the source is split by tokens (too few documents, see
    the module docstring; :func:`calibration_batches` splits those).
    """
    _check_split(split, heldout)
    parts = load_documents(source, text_field)  # errors now, not at the first next()
    n_docs = count_documents(parts)
    if n_docs == 0:
        raise PowerInferError(f"{source}: no text (the calibration data is empty)")
    if split != "all" and not _split_by_documents(n_docs, heldout):
        raise PowerInferError(f"{source}: {n_docs} document(s) are too few to hold out whole documents "
                              f"(at least {MIN_SPLIT_DOCUMENTS} needed); its held-out split is by tokens, "
                              f"which calibration_batches makes")
    lo, hi = _split_range(n_docs, split, heldout)
    return _documents(parts, lo, hi, split, source)


def _rows(part, field: str, a: int, b: int) -> Iterator[Any]:
    if isinstance(part, _TextFile):
        yield from part.rows(a, b)
        return
    for start in range(a, b, _TOKENIZE_CHUNK):
        yield from part[start:min(start + _TOKENIZE_CHUNK, b)][field]


def _documents(parts, lo: int, hi: int, split: str, source) -> Iterator[str]:
    n_yielded = 0
    offset = 0
    for ds, field, name in parts:
        a, b = max(lo - offset, 0), min(hi - offset, len(ds))
        offset += len(ds)
        if a >= b:
            continue
        for text in _rows(ds, field, a, b):
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


def _token_stream(documents: Iterable[str], tokenizer) -> Iterator[list[int]]:
    """The stream ``doc_0 SEP doc_1 SEP ...`` as successive lists of token ids."""
    sep = _separator_ids(tokenizer)
    # Documents are tokenized whole and then cut into seq_len pieces, so a document longer than
    # the model's context is expected here; mark transformers' once-only "sequence length is
    # longer than the specified maximum" warning as already given instead of alarming users.
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    docs = iter(documents)
    while True:
        chunk, n_chars = [], 0
        for d in docs:
            chunk.append(d)
            n_chars += len(d)
            if len(chunk) >= _TOKENIZE_CHUNK or n_chars >= _TOKENIZE_CHARS:
                break
        if not chunk:
            return
        out: list[int] = []
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            out.extend(ids)
            out.extend(sep)
        yield out


def _slice_stream(stream: Iterable[list[int]], lo: int, hi: int) -> Iterator[list[int]]:
    """Tokens ``[lo, hi)`` of a stream given as lists of ids."""
    pos = 0
    for ids in stream:
        a, b = max(lo - pos, 0), min(hi - pos, len(ids))
        pos += len(ids)
        if a < b:
            yield ids[a:b]
        if pos >= hi:
            return


def _pack(stream: Iterable[list[int]], tokenizer, seq_len: int, max_tokens: int | None) -> Iterator[list[int]]:
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return _pack_gen(stream, tokenizer, seq_len, max_tokens)


def _pack_gen(stream, tokenizer, seq_len: int, max_tokens: int | None) -> Iterator[list[int]]:
    bos = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
    body = seq_len - len(bos)
    left = math.inf if max_tokens is None else max_tokens
    buf: list[int] = []
    start = 0  # buf[:start] is used up

    def take(n: int) -> list[int]:
        nonlocal start, left
        seq = bos + buf[start:start + n]
        start += n
        seq = seq[: int(min(len(seq), left))]
        left -= len(seq)
        return seq

    for ids in stream:
        buf.extend(ids)
        while len(buf) - start >= body and left > 0:
            seq = take(body)
            if len(seq) >= 2:
                yield seq
        if left <= 0:
            return  # pull no more text
        del buf[:start]
        start = 0
    if len(buf) > start and left > 0:
        seq = take(len(buf) - start)
        if len(seq) >= 2:
            yield seq


def pack_token_ids(documents: Iterable[str], tokenizer, seq_len: int,
                   max_tokens: int | None = None) -> Iterator[list[int]]:
    """Pack documents into token sequences (lists of ints), ``seq_len`` long except the last.

    Each sequence is ``[BOS] + next seq_len-1 tokens`` of the stream ``doc_0 EOS doc_1 EOS ...``
    (no BOS if the tokenizer has none). The last sequence is shorter when the text or the
    ``max_tokens`` cap runs out; the total length of all sequences is
    ``min(max_tokens, available)``. Sequences shorter than 2 tokens are dropped.
    """
    return _pack(_token_stream(documents, tokenizer), tokenizer, seq_len, max_tokens)


def calibration_batches(source: str | Path, tokenizer, max_tokens: int | None, seq_len: int,
                        batch_size: int, split: str = "all", heldout: float = 0.1,
                        text_field: str = "text") -> Iterator[torch.Tensor]:
    """Yield LongTensor batches ``[B, T]`` of packed token ids from one split of ``source``.

    ``T = seq_len`` and ``B = batch_size`` for full batches; the final full-length
    sequences may form a smaller ``B``, and a final shorter sequence (text or cap ran
    out) comes alone as ``[1, t]``. No padding anywhere, so every position is a real token.
    The total number of tokens yielded (BOS included) is at most ``max_tokens``
    (None: no cap). Packing and splits (by documents, or by tokens for a source of few
    documents) are described in the module docstring.

    Raises PowerInferError for a missing/unreadable source, when the split has no text, and
    when a source split by tokens has too few tokens for both splits -- all at the call,
    before the first batch (a split by tokens tokenizes the whole source once to count).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_split(split, heldout)
    parts = load_documents(source, text_field)
    n_docs = count_documents(parts)
    if n_docs == 0:
        raise PowerInferError(f"{source}: no text (the calibration data is empty)")
    if split == "all" or _split_by_documents(n_docs, heldout):
        lo, hi = _split_range(n_docs, split, heldout)
        stream = _token_stream(_documents(parts, lo, hi, split, source), tokenizer)
    else:
        n_tokens = sum(len(ids) for ids in _token_stream(_documents(parts, 0, n_docs, "all", source), tokenizer))
        lo, hi = _token_split_range(n_tokens, n_docs, split, heldout, source)
        stream = _slice_stream(_token_stream(_documents(parts, 0, n_docs, "all", source), tokenizer), lo, hi)
    return _batches(_pack(stream, tokenizer, seq_len, max_tokens), seq_len, batch_size)


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

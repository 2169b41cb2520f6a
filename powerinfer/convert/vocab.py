"""Tokenizer metadata for GGUF, as llama.cpp writes it, via the ``gguf`` package.

SentencePiece models (``tokenizer.model``) become ``tokenizer.ggml.model = llama``
with tokens, scores and token types; GPT-2-style BPE ``tokenizer.json`` files
become ``gpt2`` with tokens, types and merges. Special token ids and the
add-BOS/EOS flags come from the model folder (``gguf.SpecialVocab``).

For BPE vocabularies we also write ``tokenizer.ggml.pre``, the pre-tokenizer name
today's llama.cpp uses (``falcon``: punctuation runs, GPT-2 byte-level regex, digit
runs split in threes; ``gpt-2``: the byte-level regex alone), read from the folder's
``tokenizer.json``. Upstream PowerInfer ignores the key and splits every BPE text
with the GPT-2 regex; ``pi-run``'s tokenizer applies the named one, so it matches the
model's own tokenizer (see ``tests/test_tokenizers.py`` for the cases that differ).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from ..errors import PowerInferError


def load_vocab(model_dir: str | Path) -> gguf.vocab.Vocab:
    """The folder's vocabulary: SentencePiece if ``tokenizer.model`` exists, else BPE."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.model").is_file():
        try:
            return gguf.vocab.SentencePieceVocab(model_dir)
        except Exception as e:  # noqa: BLE001
            raise PowerInferError(f"{model_dir / 'tokenizer.model'}: not a usable SentencePiece model ({e})") from None
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "vocab.json").is_file():
        try:
            return gguf.vocab.BpeVocab(model_dir)
        except Exception as e:  # noqa: BLE001
            raise PowerInferError(f"{model_dir}: tokenizer is not a GPT-2 style BPE nor SentencePiece ({e})") from None
    raise PowerInferError(f"{model_dir}: no tokenizer.model or tokenizer.json found")


def _is_falcon_pre(pre: dict[str, Any]) -> bool:
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    kinds = [p.get("type") for p in steps or []]
    return kinds == ["Punctuation", "ByteLevel", "Digits", "Split"] and \
        steps[3].get("pattern", {}).get("Regex") == "[0-9][0-9][0-9]"


def bpe_pre_tokenizer(model_dir: str | Path) -> str:
    """llama.cpp's name for the folder's BPE pre-tokenizer: ``falcon`` or ``gpt-2``.

    Reads ``tokenizer.json``'s ``pre_tokenizer``; a folder with only ``vocab.json`` +
    ``merges.txt`` (GPT-2, OPT) is ``gpt-2``. Raises PowerInferError for any other
    pre-tokenizer, which ``pi-run`` could not reproduce.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return "gpt-2"
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if _is_falcon_pre(pre):
        return "falcon"
    raise PowerInferError(f"{path}: BPE pre-tokenizer {pre.get('type')!r} is not one we can reproduce "
                          "(known: GPT-2 byte-level, Falcon)")


def add_vocab(writer: gguf.GGUFWriter, model_dir: str | Path, n_vocab: int) -> int:
    """Write tokenizer keys for ``model_dir`` into ``writer``; returns the vocab size.

    Pads with ``[PAD{i}]`` tokens (type UNUSED) when the model's embedding has
    more rows than the tokenizer has tokens, as llama.cpp's converter does.
    Raises PowerInferError when the tokenizer has more tokens than ``n_vocab``.
    """
    vocab = load_vocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    if len(tokens) > n_vocab:
        raise PowerInferError(f"{model_dir}: tokenizer has {len(tokens)} tokens but the model's vocab_size is {n_vocab}")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_token_list(tokens)
    if vocab.tokenizer_model == "llama":
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    if vocab.tokenizer_model == "gpt2":
        writer.add_string("tokenizer.ggml.pre", bpe_pre_tokenizer(model_dir))
    special = gguf.SpecialVocab(Path(model_dir), load_merges=vocab.tokenizer_model == "gpt2", n_vocab=n_vocab)
    if vocab.tokenizer_model == "llama" and "unk" not in special.special_token_ids:
        special.special_token_ids["unk"] = vocab.sentencepiece_tokenizer.unk_id()
    special.chat_template = None  # ours below, checked
    special.add_to_gguf(writer, quiet=True)
    template = chat_template(model_dir)
    if template is not None:
        writer.add_chat_template(template)
    return len(tokens)


MAX_CHAT_TEMPLATE = 1 << 20  # bytes; published templates are a few KB


def chat_template(model_dir: str | Path) -> str | None:
    """The model's chat template (Jinja source), or None when the folder has none.

    From ``tokenizer_config.json``'s ``chat_template``: a string, or a list of
    ``{"name", "template"}`` from which the one named ``default`` is taken; else from a
    ``chat_template.jinja`` file beside it. ``pi-convert`` writes it as the GGUF key
    ``tokenizer.chat_template``; it is untrusted text, only stored here (readers render it
    sandboxed). Raises PowerInferError naming the file for another type, a list without a
    ``default``, or a template longer than :data:`MAX_CHAT_TEMPLATE` bytes.
    """
    from ..formats._json import read_json_object

    d = Path(model_dir)
    src = d / "tokenizer_config.json"
    value = read_json_object(src).get("chat_template") if src.is_file() else None
    if value is None and (d / "chat_template.jinja").is_file():
        src = d / "chat_template.jinja"
        if src.stat().st_size > MAX_CHAT_TEMPLATE:
            raise PowerInferError(f"{src}: chat template of {src.stat().st_size} bytes, more than {MAX_CHAT_TEMPLATE}")
        try:
            value = src.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise PowerInferError(f"{src}: not UTF-8 text (byte {e.start})") from None
    if value is None:
        return None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise PowerInferError(f"{src}: chat_template lists templates {sorted(map(str, named))[:5]} but none "
                                  f"named 'default'")
        value = named["default"]
    if not isinstance(value, str):
        raise PowerInferError(f"{src}: chat_template must be a string, found a {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise PowerInferError(f"{src}: chat_template holds an unpaired surrogate (not valid Unicode)") from None
    if size > MAX_CHAT_TEMPLATE:
        raise PowerInferError(f"{src}: chat_template is longer than {MAX_CHAT_TEMPLATE} bytes")
    if "\x00" in value:
        raise PowerInferError(f"{src}: chat_template holds a NUL character")
    return value

"""Tokenizer metadata for GGUF, as llama.cpp writes it, via the ``gguf`` package.

SentencePiece models (``tokenizer.model``) become ``tokenizer.ggml.model = llama``
with tokens, scores and token types; GPT-2-style BPE ``tokenizer.json`` files
become ``gpt2`` with tokens, types and merges. Special token ids and the
add-BOS/EOS flags come from the model folder (``gguf.SpecialVocab``).
"""
from __future__ import annotations

from pathlib import Path

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
    special = gguf.SpecialVocab(Path(model_dir), load_merges=vocab.tokenizer_model == "gpt2", n_vocab=n_vocab)
    if vocab.tokenizer_model == "llama" and "unk" not in special.special_token_ids:
        special.special_token_ids["unk"] = vocab.sentencepiece_tokenizer.unk_id()
    special.add_to_gguf(writer, quiet=True)
    return len(tokens)

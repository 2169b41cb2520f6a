"""Tokenize with the vocabulary stored in the GGUF itself.

``tokenizer.ggml.model = llama`` (SentencePiece BPE with scores): we rebuild a
SentencePiece model proto from the file's tokens, scores and token types and
let the ``sentencepiece`` library tokenize, so the result is SentencePiece's own
(the same as the model's original ``tokenizer.model``). ``gpt2`` (byte-level
BPE with merges) uses the ``tokenizers`` library with the pre-tokenizer named by
``tokenizer.ggml.pre``: ``falcon`` (Falcon's ``tokenizer.json``: punctuation runs,
the GPT-2 regex, digit runs split into groups of three) or ``gpt-2`` (the GPT-2
regex alone). Files without the key (upstream's) get ``falcon`` when the
architecture is ``falcon``, else ``gpt-2``. Upstream PowerInfer's C++ tokenizer
applies the GPT-2 regex to every BPE vocabulary, so on Falcon it splits some
texts differently from the model's own tokenizer; we follow the model's.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile

_BYTE, _UNKNOWN, _CONTROL, _USER_DEFINED = 6, 2, 3, 4


class GGUFTokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for a GGUF's vocabulary."""

    def __init__(self, g: GGUFFile):
        model = g.get("tokenizer.ggml.model")
        tok_field = g.reader.get_field("tokenizer.ggml.tokens")
        if model is None or tok_field is None:
            raise PowerInferError(f"{g.path}: no tokenizer in this GGUF (tokenizer.ggml.* keys missing)")
        self.tokens: list[str] = list(g.get("tokenizer.ggml.tokens"))
        self.bos_id = g.get("tokenizer.ggml.bos_token_id")
        self.eos_id = g.get("tokenizer.ggml.eos_token_id")
        n_tok = len(self.tokens)
        for key, v in (("bos", self.bos_id), ("eos", self.eos_id)):
            if v is not None and not (isinstance(v, int) and 0 <= v < max(n_tok, 1)):
                raise PowerInferError(f"{g.path}: tokenizer.ggml.{key}_token_id {v} is out of range "
                                      f"(the vocabulary has {n_tok} tokens)")
        self.add_bos = bool(g.get("tokenizer.ggml.add_bos_token", model == "llama"))
        types = g.get("tokenizer.ggml.token_type") or [1] * len(self.tokens)
        if model == "llama":
            scores = g.get("tokenizer.ggml.scores") or [0.0] * len(self.tokens)
            self._sp = _sentencepiece_from_vocab(self.tokens, scores, types, g)
            self._sp_cont = None  # the same vocabulary without the dummy leading space: built on first use
            self._sp_src = (scores, types, g)
            self._bpe = None
        elif model == "gpt2":
            self._sp = None
            pre = g.get("tokenizer.ggml.pre") or ("falcon" if g.get("general.architecture") == "falcon" else "gpt-2")
            self._bpe = _bpe_from_vocab(self.tokens, g.get("tokenizer.ggml.merges") or [], g, pre)
        else:
            raise PowerInferError(f"{g.path}: tokenizer model {model!r} is not supported (llama, gpt2)")
        self.control_ids = {i for i, t in enumerate(types) if t == _CONTROL}
        self.special_ids = {i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)}  # parse_special
        self._special_re = None  # built on first use by _split_special
        self.chat_template: str | None = g.get("tokenizer.chat_template")

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               continuation: bool = False) -> list[int]:
        """Token ids of ``text`` (BOS first when ``add_bos``, default the file's
        ``tokenizer.ggml.add_bos_token``).

        ``parse_special``: the text of a control token (``<s>``, ``</s>``, ``<|im_end|>``...) becomes
        that token, and the text between them is tokenized piece by piece, as llama.cpp does for
        chat prompts (each SentencePiece piece gets its dummy leading space, as llama.cpp adds one
        after a special token). Off, such text is plain characters, as for a user's prompt.

        ``continuation``: ``text`` continues text already tokenized, so its start gets no dummy
        leading space (SentencePiece adds one to a sequence's first word); a chat's next turn or
        an interactive line then tokenizes as it would inside the whole transcript. No BOS."""
        if continuation:
            add_bos = False
        add_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        if not parse_special:
            return ids + self._encode_raw(text, continuation)
        prev_special = not continuation
        for piece, special_id in self._split_special(text):
            ids += [special_id] if special_id is not None else self._encode_raw(piece, not prev_special)
            prev_special = special_id is not None
        return ids

    def _encode_raw(self, text: str, continuation: bool = False) -> list[int]:
        if not text:
            return []
        if self._sp is not None:
            if continuation:
                if self._sp_cont is None:
                    self._sp_cont = _sentencepiece_from_vocab(self.tokens, *self._sp_src, dummy_prefix=False)
                return list(self._sp_cont.EncodeAsIds(text))
            return list(self._sp.EncodeAsIds(text))
        return self._bpe.encode(text, add_special_tokens=False).ids

    def _split_special(self, text: str) -> list[tuple[str, int | None]]:
        """``text`` cut at control-token strings: ``(piece, None)`` for plain text, ``(s, id)`` for a token."""
        if self._special_re is None:
            import re

            by_text = {self.tokens[i]: i for i in sorted(self.special_ids) if self.tokens[i]}
            self._special_ids = by_text
            alts = sorted(by_text, key=len, reverse=True)  # the longest match wins, as llama.cpp's partition
            self._special_re = re.compile("|".join(map(re.escape, alts))) if alts else re.compile(r"(?!x)x")
        out: list[tuple[str, int | None]] = []
        at = 0
        for m in self._special_re.finditer(text):
            if m.start() > at:
                out.append((text[at:m.start()], None))
            out.append((m.group(), self._special_ids[m.group()]))
            at = m.end()
        if at < len(text):
            out.append((text[at:], None))
        return out

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary string of ``token_id`` ("" for None), e.g. ``<s>`` for a chat template's bos_token."""
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else ""

    def decode(self, ids: Sequence[int]) -> str:
        ids = [i for i in ids if i not in self.control_ids]
        if self._sp is not None:
            return self._sp.DecodeIds(ids)
        return self._bpe.decode(ids, skip_special_tokens=False)


class TextStream:
    """Turns a growing id sequence into text deltas without splitting UTF-8 characters.

    Seeded with the prompt's ids, it emits what the new tokens add to ``decode(prompt)``:
    ``decode(prompt + generated) - decode(prompt)``, so the first generated piece keeps its
    leading space (SentencePiece drops the space of a sequence's first piece).

    Only a window of the last :attr:`CONTEXT` to ``2 * CONTEXT`` tokens is decoded (the window
    slides when the text so far is whole characters), so a push costs the same at token 10 and
    token 10,000 instead of re-decoding everything."""

    CONTEXT = 8

    def __init__(self, tok: GGUFTokenizer, prefix_ids: Sequence[int] = ()):
        self.tok, self.ids = tok, list(prefix_ids)[-self.CONTEXT:]
        self.emitted = tok.decode(self.ids) if self.ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more bytes
            return ""
        n = len(self.emitted)
        if not text.startswith(self.emitted):  # printed text stays: only what follows the common prefix is new
            n = next((i for i, (a, b) in enumerate(zip(text, self.emitted)) if a != b), min(len(text), n))
        delta = text[n:]
        if len(self.ids) >= 2 * self.CONTEXT:  # slide: the last CONTEXT tokens, decoded on their own, are the base
            self.ids = self.ids[-self.CONTEXT:]
            self.emitted = self.tok.decode(self.ids)
        else:
            self.emitted = text
        return delta


def _sentencepiece_from_vocab(tokens: list[str], scores: list[float], types: list[int], g: GGUFFile,
                              dummy_prefix: bool = True):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = any(t == _BYTE for t in types)
    for key, field in (("unknown", "unk_id"), ("bos", "bos_id"), ("eos", "eos_id"), ("padding", "pad_id")):
        v = g.get(f"tokenizer.ggml.{key}_token_id")
        setattr(m.trainer_spec, field, int(v) if v is not None and 0 <= v < len(tokens) else -1)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = dummy_prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for text, score, ttype in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece, p.score = text, float(score)
        p.type = ttype if ttype in (1, 2, 3, 4, 5, 6) else 1
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(m.SerializeToString())
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"{g.path}: its SentencePiece vocabulary is unusable ({e})") from None
    return sp


def _pre_tokenizer(name: str, g: GGUFFile):
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "falcon":
        return pt.Sequence([pt.Punctuation("contiguous"), byte_level, pt.Digits(individual_digits=False),
                            pt.Split(Regex("[0-9][0-9][0-9]"), "isolated")])
    if name in ("gpt-2", "gpt2", "default"):
        return byte_level
    raise PowerInferError(f"{g.path}: BPE pre-tokenizer {name!r} is not supported (falcon, gpt-2)")


def _bpe_from_vocab(tokens: list[str], merges: list[str], g: GGUFFile, pre: str):
    from tokenizers import Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"{g.path}: its BPE vocabulary is unusable ({e})") from None
    tk.pre_tokenizer = _pre_tokenizer(pre, g)
    tk.decoder = decoders.ByteLevel()
    return tk

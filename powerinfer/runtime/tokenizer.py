"""Tokenize with the vocabulary stored in the GGUF itself, as llama.cpp does.

What follows llama.cpp's ``src/llama-vocab.cpp`` (October 2026), fact by fact:

* Special tokens are cut out of the text first, longest text first (llama.cpp's
  ``tokenizer_st_partition``): ``user-defined`` tokens always, ``control`` and ``unknown`` ones
  only with ``parse_special`` (chat prompts). Phi-3 files (``general.name`` containing ``phi-3``
  or ``phi3``) strip the whitespace right of most special tokens, as llama.cpp's per-model
  attributes say.
* ``tokenizer.ggml.model = llama`` (SentencePiece BPE with scores): each text fragment, with a
  space in front where it starts the text or follows a special token (``add_space_prefix``), is
  tokenized by the ``sentencepiece`` library on a model proto rebuilt from the file's tokens,
  scores and types (the merge order is the scores', byte fallback for unknown characters).
* ``gpt2`` (byte-level BPE with merges): the HF ``tokenizers`` library with a pre-tokenizer made
  of llama.cpp's regexes for the file's ``tokenizer.ggml.pre`` (:data:`BPE_PRE`, each regex
  splitting every piece, matches and gaps kept), then the GPT-2 byte-to-character map and the
  file's merges; ``llama-bpe`` takes a word that is itself a token whole (``ignore_merges``).
  Files without the key (upstream PowerInfer's) get ``falcon`` when the architecture is
  ``falcon``, else ``gpt-2``.
* Decoding is llama.cpp's ``token_to_piece`` per token, concatenated: control and unknown tokens
  give nothing (unless ``special``), user-defined ones their text, SentencePiece pieces their
  text with ``▁`` as space and ``<0xXX>`` as that byte, byte-level BPE its bytes; the first
  SentencePiece piece loses its leading space. ``clean_spaces=True`` adds ``llama_detokenize``'s
  clean-up of the vocabularies that have it (``" ?"`` -> ``"?"``...).
* End of generation (:attr:`GGUFTokenizer.eog_ids`): ``eos``, ``eot`` and ``eom`` ids (from the
  metadata, else found by their texts such as ``<|eot_id|>``, ``<|im_end|>``), the FIM
  pad/repo/separator tokens, and every token whose text llama.cpp lists as ending a turn.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile

_UNDEFINED, _NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = range(7)

# ---------------------------------------------------------------------------------------------
# llama.cpp's pre-tokenizers for ``tokenizer.ggml.pre`` (the regexes of llm_tokenizer_bpe, in
# their adapted, case-explicit form; each one splits every piece the previous ones left).
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#: The parts HF ``tokenizer.json`` files write with an inline flag, and llama.cpp's adapted form of
#: each (used by the converter to recognise a folder's pre-tokenizer regex among :data:`BPE_PRE`'s).
HF_REGEX_FORMS = {"(?i:'s|'t|'re|'ve|'m|'ll|'d)": _CONTRACTIONS}
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")


def _cls(ranges: str) -> str:
    """A regex character class from code point ranges written ``"41-5A B5 C0-D6"`` (hex)."""
    parts = []
    for r in ranges.split():
        lo, _, hi = r.partition("-")
        parts.append(f"\\x{{{lo}}}" + (f"-\\x{{{hi}}}" if hi else ""))
    return "[" + "".join(parts) + "]"


# deepseek-llm's classes: cased letters; ASCII and full-width punctuation, quotes, ideographic
# space and marks; CJK, Hangul and the blocks between them.
_CASED = _cls("41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376-377 37B-37D 37F 386 388-38A "
              "38C 38E-3A1 3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF "
              "1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D "
              "1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 "
              "1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 213C-213F "
              "2145-2149 214E 2183-2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2-2CF3 A640-A66D A680-A69B A722-A76F "
              "A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 "
              "104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943")
_PUNCT = _cls("21-2F 3A-7E FF01-FF0F FF1A-FF5E 2018-201F 3000-3002")
_CJK = _cls("4E00-9FA5 800-4E00 AC00-D7FF")
_DEEPSEEK_LLM = [r"[\r\n]", r"\s?" + _CASED + "+", r"\s?" + _PUNCT + "+", r"\s+$", _CJK + "+", r"\p{N}+"]


class _Pre:
    """One llama.cpp pre-tokenizer type: its regexes and the vocabulary flags llama.cpp sets with it."""

    def __init__(self, regexes: list[str], clean_spaces: bool = True, ignore_merges: bool = False,
                 add_bos: bool = False):
        self.regexes, self.clean_spaces, self.ignore_merges, self.add_bos = regexes, clean_spaces, ignore_merges, add_bos


_LLAMA3_PRE = _Pre([_LLAMA3], ignore_merges=True, add_bos=True)
_QWEN2_PRE = _Pre([_QWEN2], clean_spaces=False)
_GPT2_PRE = _Pre([_GPT2])
_FALCON_PRE = _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"])
_STARCODER_PRE = _Pre([r"\p{N}", _GPT2])

#: ``tokenizer.ggml.pre`` names this tokenizer reproduces, each as llama.cpp maps it. Checked
#: against llama.cpp's test vectors: llama-bpe, qwen2, qwen35, deepseek-llm, falcon, gpt-2,
#: starcoder, refact, mpt, deepseek-coder, command-r (tests/test_tokenizers.py and the report
#: of issue 26); the other names share one of those regex sets in llama.cpp.
BPE_PRE: dict[str, _Pre] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
                    _LLAMA3_PRE),
    "dbrx": _Pre([_LLAMA3]), "smaug-bpe": _Pre([_LLAMA3]),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "hunyuan", "solar-open"], _QWEN2_PRE),
    "stablelm2": _Pre([_QWEN2]),
    "qwen35": _Pre([_QWEN35], clean_spaces=False),
    "deepseek-llm": _Pre(_DEEPSEEK_LLM, clean_spaces=False),
    "deepseek-coder": _Pre([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK + "+", r"\p{N}"], clean_spaces=False),
    "falcon": _FALCON_PRE,
    "default": _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], _GPT2_PRE),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"], _STARCODER_PRE),
    **dict.fromkeys(["command-r", "smollm"], _Pre([r"\p{N}", _GPT2], clean_spaces=False)),
}

# Texts llama.cpp takes as end-of-turn (eot) and end-of-generation tokens when the file does not say.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {  # FIM pad / repo / separator: llama.cpp counts them as end of generation
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
_SPACE = "▁"


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_chars()


class GGUFTokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for a GGUF's vocabulary, as llama.cpp.

    Attributes: ``tokens`` (list of str, one per id), ``bos_id``/``eos_id``/``eot_id``/``eom_id``
    (int or None), ``eog_ids`` (frozenset of ids ending generation), ``add_bos``, ``chat_template``.
    Raises PowerInferError (one line naming the file) for a tokenizer model or pre-tokenizer it
    does not reproduce, or for a malformed vocabulary, before building anything large."""

    def __init__(self, g: GGUFFile):
        model = g.get("tokenizer.ggml.model")
        tok_field = g.reader.get_field("tokenizer.ggml.tokens")
        if model is None or tok_field is None:
            raise PowerInferError(f"{g.path}: no tokenizer in this GGUF (tokenizer.ggml.* keys missing)")
        if model not in ("llama", "gpt2"):
            raise PowerInferError(f"{g.path}: tokenizer model {model!r} is not supported (llama, gpt2)")
        pre = None
        if model == "gpt2":
            name = g.get("tokenizer.ggml.pre") or ("falcon" if g.get("general.architecture") == "falcon" else "gpt-2")
            pre = BPE_PRE.get(name)
            if pre is None:
                raise PowerInferError(f"{g.path}: BPE pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported "
                                      f"({', '.join(sorted(BPE_PRE))})")
        self.tokens: list[str] = list(g.get("tokenizer.ggml.tokens"))
        n_tok = len(self.tokens)
        types = g.get("tokenizer.ggml.token_type")
        types = list(types) if types is not None else [_NORMAL] * n_tok
        if len(types) < n_tok:
            raise PowerInferError(f"{g.path}: tokenizer.ggml.token_type has {len(types)} entries for {n_tok} tokens")
        self._types = types = types[:n_tok]

        def special(key: str) -> int | None:
            v = g.get(f"tokenizer.ggml.{key}_token_id")
            if v is None:
                return None
            if not (isinstance(v, int) and 0 <= v < n_tok):
                raise PowerInferError(f"{g.path}: tokenizer.ggml.{key}_token_id {v} is out of range "
                                      f"(the vocabulary has {n_tok} tokens)")
            return v

        self.bos_id, self.eos_id, self.unk_id = special("bos"), special("eos"), special("unknown")
        self.eot_id, self.eom_id = special("eot"), special("eom")
        self.is_spm = model == "llama"
        self.add_bos = bool(g.get("tokenizer.ggml.add_bos_token", True if self.is_spm else pre.add_bos))
        self.add_space_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", self.is_spm))
        self.clean_spaces = False if self.is_spm else pre.clean_spaces
        self.control_ids = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}  # no text unless special
        self.user_ids = {i for i, t in enumerate(types) if t == _USER_DEFINED}
        self._eog(g, {k: special(k) for k in ("fim_pad", "fim_rep", "fim_sep")})
        self.special_ids = self.control_ids | self.user_ids  # cut out of the text with parse_special
        self._rstrip = self._strip_sets(g)
        by_len = sorted((i for i in self.special_ids if self.tokens[i]),
                        key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))
        self._always = [i for i in by_len if i in self.user_ids and i not in self.control_ids]
        self._all = by_len
        self.chat_template: str | None = g.get("tokenizer.chat_template")
        self._pieces: dict[int, bytes] = {}
        if self.is_spm:
            scores = g.get("tokenizer.ggml.scores")
            scores = list(scores) if scores is not None else [0.0] * n_tok
            if len(scores) < n_tok:
                raise PowerInferError(f"{g.path}: tokenizer.ggml.scores has {len(scores)} entries for {n_tok} tokens")
            self._sp = _sentencepiece_from_vocab(self.tokens, scores, types, self.unk_id, g)
            self._bpe = None
        else:
            self._sp = None
            self._bpe = _bpe_from_vocab(self.tokens, g.get("tokenizer.ggml.merges") or [], g, pre)

    # ------------------------------------------------------------------ special tokens
    def _eog(self, g: GGUFFile, fim: dict[str, int | None]) -> None:
        """llama.cpp's end-of-generation set (``special_eog_ids``): derived ids get the control type."""
        by_text: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            by_text[t] = i  # the last of duplicate texts, as llama.cpp's token_to_id

        def find(texts: Sequence[str]) -> int | None:
            return next((by_text[t] for t in texts if t in by_text), None)

        if self.eot_id is None:
            self.eot_id = find(_EOT_TEXTS)
        if self.eom_id is None:
            self.eom_id = find(_EOM_TEXTS)
        fim = {k: v if v is not None else find(_FIM_TEXTS[k]) for k, v in fim.items()}
        eog = {v for v in fim.values() if v is not None}
        eog |= {i for t, i in by_text.items() if t in _EOG_TEXTS}
        derived = set(eog) | {v for v in (self.eot_id, self.eom_id) if v is not None}
        self.control_ids |= derived  # llama.cpp: "control-looking token ... its type will be overridden"
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if t in by_text:
                self.control_ids.discard(by_text[t])
                self.user_ids.add(by_text[t])
        eog |= {v for v in (self.eos_id, self.eot_id, self.eom_id) if v is not None}
        texts = {self.tokens[i]: i for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])  # harmony / solar-open: <|end|> ends a message, not generation
            self.control_ids.discard(texts["<|end|>"])
            self.user_ids.add(texts["<|end|>"])
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])  # a normal </s> there
            self.control_ids.discard(texts["</s>"])
            self.user_ids.discard(texts["</s>"])
        self.eog_ids: frozenset[int] = frozenset(eog)

    def _strip_sets(self, g: GGUFFile) -> frozenset[int]:
        """Ids whose right-hand whitespace llama.cpp strips when cutting them out (Phi-3's attributes)."""
        name = str(g.get("general.name") or "").lower()
        if "phi-3" not in name and "phi3" not in name:
            return frozenset()
        ids = set(self.special_ids) | {i for i, t in enumerate(self.tokens) if t == "</s>"}
        return frozenset(i for i in ids if self.tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def is_eog(self, token_id: int) -> bool:
        """True when ``token_id`` ends generation (llama.cpp's ``llama_vocab_is_eog``)."""
        return token_id in self.eog_ids

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               continuation: bool = False) -> list[int]:
        """Token ids of ``text`` (BOS first when ``add_bos``, default the file's
        ``tokenizer.ggml.add_bos_token`` or llama.cpp's default for the vocabulary type), as
        llama.cpp's ``llama_tokenize(add_special=add_bos, parse_special)``; ``eos`` is never added.

        ``parse_special``: the text of a control token (``<s>``, ``<|eot_id|>``, ``<|im_end|>``...)
        becomes that token, as llama.cpp does for chat prompts. Off, such text is plain characters,
        as for a user's prompt (user-defined tokens are cut out either way, as in llama.cpp).

        ``continuation``: ``text`` continues text already tokenized, so its start gets no dummy
        leading space (SentencePiece adds one to a sequence's first word); a chat's next turn or
        an interactive line then tokenizes as it would inside the whole transcript. No BOS."""
        if continuation:
            add_bos = False
        add_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        prev_special = not continuation
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self._sp is not None:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                ids += self._sp.EncodeAsIds(frag)
            else:
                ids += self._bpe.encode(frag, add_special_tokens=False).ids
            prev_special = False
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` as plain fragments (str) and special-token ids (int), llama.cpp's
        ``tokenizer_st_partition``: each special token, longest first, is cut out of every
        fragment left, at each occurrence; right-hand whitespace goes where the token strips it."""
        frags: list[str | int] = [text] if text else []
        for tid in (self._all if parse_special else self._always):
            t = self.tokens[tid]
            if t not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or t not in f:
                    out.append(f)
                    continue
                at = 0
                while True:
                    k = f.find(t, at)
                    if k < 0:
                        break
                    if k > at:
                        out.append(f[at:k])
                    out.append(tid)
                    at = k + len(t)
                    if tid in self._rstrip:
                        while at < len(f) and f[at] in " \t\n\v\f\r":
                            at += 1
                if at < len(f):
                    out.append(f[at:])
            frags = out
        return frags

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary string of ``token_id`` ("" for None), e.g. ``<s>`` for a chat template's bos_token."""
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else ""

    # ------------------------------------------------------------------ decode
    def piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes llama.cpp's ``llama_token_to_piece(special)`` gives for ``token_id`` (b"" for
        control and unknown tokens unless ``special``; a byte-level piece may be part of a character)."""
        key = token_id if not special else ~token_id
        p = self._pieces.get(key)
        if p is None:
            p = self._pieces[key] = self._piece(token_id, special)
        return p

    def _piece(self, i: int, special: bool) -> bytes:
        if not 0 <= i < len(self.tokens):
            return b""
        text = self.tokens[i]
        if i in self.control_ids:
            return text.encode("utf-8") if special else b""
        if i in self.user_ids:
            return text.encode("utf-8")
        kind = self._types[i]
        if kind == _BYTE:
            try:
                return bytes([int(text[3:5], 16)]) if self.is_spm else bytes([_BYTE_OF[text]])
            except (ValueError, KeyError):
                return b""
        if kind != _NORMAL:
            return b""
        if self.is_spm:
            return text.replace(_SPACE, " ").encode("utf-8")
        out = bytearray()
        for ch in text:
            b = _BYTE_OF.get(ch)
            if b is None:  # not a byte-level character: llama.cpp writes it out so
                out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
            else:
                out.append(b)
        return bytes(out)

    def decode_bytes(self, ids: Sequence[int], special: bool = False) -> bytes:
        """The pieces of ``ids`` joined, the first one's leading space dropped where the vocabulary
        adds one (SentencePiece), as ``llama_detokenize(remove_special=False)`` before its clean-up."""
        out = b"".join(self.piece(i, special) for i in ids)
        if self.add_space_prefix and ids and out.startswith(b" ") and self.piece(ids[0], special)[:1] == b" ":
            out = out[1:]
        return out

    def decode(self, ids: Sequence[int], special: bool = False, clean_spaces: bool = False) -> str:
        """Text of ``ids`` (:meth:`decode_bytes`, invalid UTF-8 as U+FFFD): what llama.cpp prints
        for them. ``clean_spaces``: also apply ``llama_detokenize``'s clean-up where the
        vocabulary has it (``" ?"``, ``" !"``, ``" ."``, ``" ,"`` lose the space, ``" ' "`` its
        spaces, ``" 's"``, ``" 'm"``, ``" 're"``, ``" 've"`` theirs), for its exact output."""
        text = self.decode_bytes(ids, special).decode("utf-8", errors="replace")
        return _clean_spaces(text) if clean_spaces and self.clean_spaces else text


def _clean_spaces(text: str) -> str:
    """llama_detokenize's three clean-up passes (clean_up_tokenization_spaces)."""
    out: list[str] = []
    for i, ch in enumerate(text):  # " ?", " !", " .", " ,"
        if i and ch in "?!.," and text[i - 1] == " ":
            out.pop()
        out.append(ch)
    text, out, i = "".join(out), [], 0
    while i < len(text):  # " ' " -> "'"
        ch = text[i]
        if i and ch == "'" and i + 1 < len(text) and text[i - 1] == " " and text[i + 1] == " ":
            out.pop()
            out.append(ch)
            i += 2
            continue
        out.append(ch)
        i += 1
    text, out = "".join(out), []
    for i, ch in enumerate(text):  # " 's", " 'm", " 're", " 've"
        if i and ch == "'" and text[i - 1] == " " and (text[i + 1:i + 2] in ("s", "m") or text[i + 1:i + 3] in ("re", "ve")):
            out.pop()
        out.append(ch)
    return "".join(out)


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


def _sentencepiece_from_vocab(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
                              g: GGUFFile):
    """A SentencePiece BPE processor for the vocabulary, without a dummy prefix (the caller adds
    the space). One piece is ``unknown`` (the file's unk id, else the first of that type), byte
    pieces stay byte pieces, duplicate texts become control pieces (never matched), the rest are
    normal pieces merged by score."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = any(t == _BYTE for t in types)
    m.trainer_spec.unk_id = -1 if unk_id is None else unk_id
    for field in ("bos_id", "eos_id", "pad_id"):
        setattr(m.trainer_spec, field, -1)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    seen: set[str] = set()
    for i, (text, score, ttype) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.score = float(score)
        # llama.cpp merges into any token whose text the pieces make (special tokens are cut out
        # before), so every piece but the unknown and byte ones is a normal one here
        ttype = _UNKNOWN if i == unk_id else _BYTE if ttype == _BYTE else _NORMAL
        if text in seen or not text:
            text, ttype = f"\x00dup{i}", _CONTROL  # never in text
        seen.add(text)
        p.piece, p.type = text, ttype
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(m.SerializeToString())
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"{g.path}: its SentencePiece vocabulary is unusable ({e})") from None
    return sp


def _bpe_from_vocab(tokens: list[str], merges: list[str], g: GGUFFile, pre: _Pre):
    """An HF ``tokenizers`` byte-level BPE with ``pre``'s regexes (no special tokens: the caller
    cuts those out first)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers as pt

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        k = m.find(" ", 1)
        if k > 0:
            pairs.append((m[:k], m[k + 1:]))
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
        tk.pre_tokenizer = pt.Sequence([pt.Split(Regex(r), "isolated") for r in pre.regexes]
                                       + [pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"{g.path}: its BPE vocabulary is unusable ({e})") from None
    return tk

"""Tokenizer metadata for GGUF, as llama.cpp's ``convert_hf_to_gguf.py`` writes it, via ``gguf``.

SentencePiece models (``tokenizer.model``) become ``tokenizer.ggml.model = llama`` with tokens,
scores and token types (``gguf.SentencePieceVocab``). Byte-level BPE folders become ``gpt2`` with
tokens, types, merges and ``tokenizer.ggml.pre``:

* ``tokenizer.json`` with a ``Split``-regex pre-tokenizer (Llama 3.x, Qwen2/2.5/3): tokens are the
  model's vocab plus ``added_tokens`` at their ids, ids neither has are ``[PAD{i}]`` (type unused)
  up to the model's vocab size; an added token is ``control`` when it is marked ``special`` or looks
  special (``<|...|>``, ``<｜...｜>``, ``<pad>``, ``<mask>``, ``<unused...>``), else ``user-defined``
  (``▁`` as a space), every other token ``normal``: llama.cpp's ``get_vocab_base``.
* GPT-2 / OPT (``vocab.json`` + ``merges.txt``, or a byte-level ``tokenizer.json``) and Falcon:
  ``gguf.BpeVocab`` as before, pre-tokenizer ``gpt-2`` or ``falcon``; their types are upstream
  PowerInfer's (``tests/test_tokenizers.py`` pins Falcon's to its ``ggml-vocab-falcon.gguf``).

The pre-tokenizer name (:func:`bpe_pre_tokenizer`): llama.cpp's converter hashes the ids the model's
tokenizer gives a fixed text and looks the hash up, so it knows only vocabularies it has seen (a
fine-tune that adds a token, or a new model reusing Llama 3's regex, changes the hash). We read the
pre-tokenizer itself: the ``Split`` regexes of ``tokenizer.json`` are matched against the regexes
``pi-run`` applies for each name (:data:`powerinfer.runtime.tokenizer.BPE_PRE`, one table), with
the BPE model's ``ignore_merges`` and the config's ``clean_up_tokenization_spaces`` choosing among
names that share a regex. Then the folder's own tokenizer (HF ``tokenizers``) and pi-run's, built
from the tokens and merges being written, must give the same ids for :data:`CHECK_TEXT`, so a
normalizer or option we do not reproduce is refused rather than written. Anything else (Mistral's
tekken included) is refused in one line naming the file.

Special token ids, add-BOS/EOS flags and merges come from ``gguf.SpecialVocab``; the add flags are
then set from ``tokenizer.json``'s ``post_processor`` as today's llama.cpp does (a ``ByteLevel``
processor: no BOS and no EOS; a ``TemplateProcessing`` that starts with the BOS token: BOS; that
ends with the EOS token: EOS; these win over ``tokenizer_config.json``'s ``add_bos_token``).
``generation_config.json`` is not read, as llama.cpp does not read it: its extra end ids (Llama
3.1's ``<|eom_id|>``, ``<|eot_id|>``, Qwen's ``<|endoftext|>``) end generation in pi-run because
their texts do (``GGUFTokenizer.eog_ids``).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf

from ..errors import PowerInferError

MAX_TOKENIZER_JSON = 64 << 20  # bytes; Llama 3's tokenizer.json is 9 MB, Qwen2.5's 7 MB
MAX_VOCAB = 1 << 21  # tokens; the largest published vocabularies have ~262k

#: Text tokenized by the folder's tokenizer and by pi-run's to confirm the pre-tokenizer: runs of
#: spaces, tabs and newlines, digit runs of 1 to 8, emoji joined by ZWJ, combining marks (Khmer,
#: Devanagari; Arabic vowel marks, which tell ``qwen35`` from ``qwen2`` on Qwen's vocabulary), CJK
#: and full-width forms, Cyrillic, Greek, mixed-case contractions, punctuation runs. It is NFC-stable
#: on purpose: Qwen's NFC normalizer is one llama.cpp does not apply either, and must not refuse Qwen.
CHECK_TEXT = ("\n \n\n \t\t \t \n\n\n   \n    x  y\r\n\r\n"
              "7 42 316 2718 31415 271828 3141592 27182818 1.5 2..5 3...5 "
              "\U0001F469\u200d\U0001F4BB \U0001F3F3\ufe0f\u200d\U0001F308 \U0001F44D\U0001F3FD \u2705\u2705 "
              "\u1796\u17d2\u179a\u17c7\u17a2\u17b6\u1791\u17b7\u178f\u17d2\u1799 \u0939\u093f\u0928\u094d\u0926\u0940 "
              "\u4eca\u5929\u5929\u6c14\u5f88\u597dapple123\u53f7 \uff5e\u3000\u300c\u30c6\u30b9\u30c8\u300d "
              "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 "
              "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
              "\u00c9COLE \u00e9cole \u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627 "
              "---=== ''''``\"\"...!!??  "
              "I'm you're WE'VE it'S they'D she'll 'Tis O'Neil don't")


def load_vocab(model_dir: str | Path) -> gguf.vocab.Vocab:
    """The folder's SentencePiece (``tokenizer.model``) or GPT-2 BPE (``vocab.json`` or ``tokenizer.json``)
    vocabulary, through ``gguf``'s readers (upstream PowerInfer's types: added tokens control, or normal
    where the model's vocab has them too). :func:`add_vocab` uses it for SentencePiece, GPT-2 and Falcon."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.model").is_file():
        try:
            return gguf.vocab.SentencePieceVocab(model_dir)
        except Exception as e:  # noqa: BLE001
            raise PowerInferError(f"{model_dir / 'tokenizer.model'}: not a usable SentencePiece model ({e})") from None
    if (model_dir / "vocab.json").is_file() or (model_dir / "tokenizer.json").is_file():
        try:
            return gguf.vocab.BpeVocab(model_dir)
        except Exception as e:  # noqa: BLE001
            raise PowerInferError(f"{model_dir}: tokenizer is not a GPT-2 style BPE nor SentencePiece ({e})") from None
    if (model_dir / "tekken.json").is_file():
        raise PowerInferError(f"{model_dir / 'tekken.json'}: Mistral's tekken vocabulary is not supported by pi-run's "
                              "tokenizer (SentencePiece tokenizer.model and byte-level BPE tokenizer.json are)")
    raise PowerInferError(f"{model_dir}: no tokenizer.model, tokenizer.json or vocab.json found")


def _read_json(path: Path, limit: int = MAX_TOKENIZER_JSON) -> dict[str, Any]:
    size = path.stat().st_size
    if size > limit:
        raise PowerInferError(f"{path}: {size} bytes, more than the {limit} a tokenizer file may have")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PowerInferError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise PowerInferError(f"{path}: a JSON object expected, found a {type(value).__name__}")
    return value


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    return _read_json(path) if path.is_file() else {}


def _is_falcon_pre(pre: dict[str, Any]) -> bool:
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    kinds = [p.get("type") for p in steps or [] if isinstance(p, dict)]
    return kinds == ["Punctuation", "ByteLevel", "Digits", "Split"] and \
        (steps[3].get("pattern") or {}).get("Regex") == "[0-9][0-9][0-9]"


def _split_regexes(pre: dict[str, Any]) -> list[str] | None:
    """The regexes of a ``Sequence`` of isolating ``Split`` steps closed by a regex-less ``ByteLevel``
    (the Llama 3 / Qwen layout), rewritten in llama.cpp's adapted form; None for another layout."""
    from ..runtime.tokenizer import HF_REGEX_FORMS

    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) < 2 or not all(isinstance(p, dict) for p in steps):
        return None
    *splits, last = steps
    if last.get("type") != "ByteLevel" or last.get("use_regex", True) or last.get("add_prefix_space", False):
        return None
    out = []
    for p in splits:
        pattern = p.get("pattern") or {}
        if p.get("type") != "Split" or p.get("behavior") != "Isolated" or p.get("invert", False) \
                or not isinstance(pattern, dict) or not isinstance(pattern.get("Regex"), str):
            return None
        regex = pattern["Regex"]
        for hf, ours in HF_REGEX_FORMS.items():
            regex = regex.replace(hf, ours)
        out.append(regex)
    return out


#: Names a Split-regex pre-tokenizer may get, tried in this order (the first whose regexes and flags
#: fit): llama.cpp's converter names Llama 3.x ``llama-bpe``, Qwen2/2.5/3 ``qwen2``, Qwen3.5 ``qwen35``.
HF_PRE_NAMES = ("llama-bpe", "smaug-bpe", "qwen2", "stablelm2", "qwen35")
_TEKKEN_MARK = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_KNOWN = "known: " + ", ".join(HF_PRE_NAMES) + ", gpt-2, falcon"


def bpe_pre_tokenizer(model_dir: str | Path, tokenizer_json: dict[str, Any] | None = None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for the folder's byte-level BPE pre-tokenizer.

    ``gpt-2`` for a ``ByteLevel`` pre-tokenizer with its regex (or no ``tokenizer.json``: GPT-2,
    OPT), ``falcon`` for Falcon's sequence, else the first of :data:`HF_PRE_NAMES` whose regexes
    equal the ``Split`` regexes and whose ``ignore_merges`` equals ``tokenizer.json``'s
    ``model.ignore_merges`` (and ``clean_spaces`` the config's ``clean_up_tokenization_spaces``,
    where a name fits both). Raises PowerInferError naming the file for any other one (Mistral's
    tekken included), which pi-run could not reproduce.
    """
    from ..runtime.tokenizer import BPE_PRE

    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if tokenizer_json is None:
        if not path.is_file():
            return "gpt-2"
        tokenizer_json = _read_json(path)
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if not isinstance(pre, dict):
        raise PowerInferError(f"{path}: pre_tokenizer is a {type(pre).__name__}, not an object")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if _is_falcon_pre(pre):
        return "falcon"
    regexes = _split_regexes(pre)
    if regexes is None:
        raise PowerInferError(f"{path}: BPE pre-tokenizer {pre.get('type')!r} is not one we can reproduce ({_KNOWN}; "
                              "a Sequence of Split regexes then ByteLevel without its regex)")
    model = tokenizer_json.get("model")
    ignore_merges = bool(model.get("ignore_merges", False)) if isinstance(model, dict) else False
    clean = _tokenizer_config(model_dir).get("clean_up_tokenization_spaces")
    same = [n for n in HF_PRE_NAMES if BPE_PRE[n].regexes == regexes]
    fit = [n for n in same if BPE_PRE[n].ignore_merges == ignore_merges]
    fit = [n for n in fit if not isinstance(clean, bool) or BPE_PRE[n].clean_spaces == clean] or fit
    if fit:
        return fit[0]
    if same:
        raise PowerInferError(f"{path}: the pre-tokenizer regex is {same[0]!r}'s but model.ignore_merges is "
                              f"{ignore_merges}, which no known tokenizer type pairs with it ({_KNOWN})")
    if any(_TEKKEN_MARK in r for r in regexes):
        raise PowerInferError(f"{path}: Mistral's tekken pre-tokenizer (Mistral-Nemo, v0.3 tekken) is not supported "
                              f"by pi-run's tokenizer ({_KNOWN})")
    shown = regexes[0] if len(regexes[0]) <= 80 else regexes[0][:77] + "..."
    raise PowerInferError(f"{path}: BPE pre-tokenizer regex {shown!r} is not one we can reproduce ({_KNOWN})")


def _looks_special(text: str) -> bool:
    """llama.cpp's ``does_token_look_special``: added tokens it makes control though not marked special."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>")) \
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>")) \
        or (text.startswith("<unused") and text.endswith(">"))


def hf_bpe_tokens(model_dir: str | Path, tokenizer_json: dict[str, Any], n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens and token types (``gguf.TokenType``), ``n_vocab`` of each, of a byte-level BPE
    ``tokenizer.json``, as llama.cpp's ``get_vocab_base`` makes them (see the module docstring).

    Raises PowerInferError naming the file for a model that is not byte-level BPE, more than
    :data:`MAX_VOCAB` entries, an id outside ``0 .. n_vocab-1`` or a token that is not a string.
    """
    path = Path(model_dir) / "tokenizer.json"
    model = tokenizer_json.get("model")
    decoder = tokenizer_json.get("decoder") or {}
    dtype = decoder.get("type") if isinstance(decoder, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback", False) \
            or dtype != "ByteLevel" or not isinstance(model.get("vocab"), dict):
        mtype = model.get("type") if isinstance(model, dict) else None
        raise PowerInferError(f"{path}: not a byte-level BPE tokenizer (model {mtype!r}, decoder {dtype!r})")
    vocab, added = model["vocab"], tokenizer_json.get("added_tokens") or []
    if not isinstance(added, list):
        raise PowerInferError(f"{path}: added_tokens is a {type(added).__name__}, not a list")
    if len(vocab) + len(added) > MAX_VOCAB:
        raise PowerInferError(f"{path}: {len(vocab)} + {len(added)} tokens, more than {MAX_VOCAB}")
    tokens: list[str | None] = [None] * n_vocab
    types = [int(gguf.TokenType.NORMAL)] * n_vocab

    def put(i: Any, text: Any, what: str) -> None:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_vocab or not isinstance(text, str):
            raise PowerInferError(f"{path}: {what} {str(text)[:40]!r} with id {i!r}: not a string token with an id "
                                  f"in 0..{n_vocab - 1} (the model's vocab_size)")
        tokens[i] = text

    for text, i in vocab.items():
        put(i, text, "token")
    for a in added:
        if not isinstance(a, dict):
            raise PowerInferError(f"{path}: an added_tokens entry is a {type(a).__name__}, not an object")
        text, i = a.get("content"), a.get("id")
        put(i, text, "added token")
        if a.get("special", False) or _looks_special(text):
            types[i] = int(gguf.TokenType.CONTROL)
        else:
            tokens[i] = text.replace("\u2581", " ")
            types[i] = int(gguf.TokenType.USER_DEFINED)
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = int(gguf.TokenType.UNUSED)
    return tokens, types  # type: ignore[return-value]


def check_pre_tokenizer(model_dir: str | Path, pre: str, tokens: list[str], merges: list[str],
                        tokenizer_json: dict[str, Any] | None = None) -> None:
    """Raise PowerInferError unless pi-run's tokenizer for ``pre`` on ``tokens`` + ``merges`` gives the ids the
    folder's own ``tokenizer.json`` (HF ``tokenizers``: its normalizer, pre-tokenizer and BPE; added tokens and
    post-processor left out, as pi-run cuts those out by llama.cpp's rules) gives for :data:`CHECK_TEXT`."""
    from tokenizers import Tokenizer

    from ..runtime.tokenizer import BPE_PRE, _bpe_from_vocab

    path = Path(model_dir) / "tokenizer.json"
    tj = dict(_read_json(path) if tokenizer_json is None else tokenizer_json, added_tokens=[], post_processor=None)
    try:
        theirs = Tokenizer.from_str(json.dumps(tj)).encode(CHECK_TEXT, add_special_tokens=False).ids
    except Exception as e:  # noqa: BLE001
        raise PowerInferError(f"{path}: the tokenizers library cannot load it ({e})") from None
    ours = _bpe_from_vocab(tokens, merges, SimpleNamespace(path=path), BPE_PRE[pre]).encode(
        CHECK_TEXT, add_special_tokens=False).ids
    if ours != theirs:
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise PowerInferError(f"{path}: its pre-tokenizer reads as {pre!r}, but the folder's tokenizer and pi-run's "
                              f"split a check text differently from token {k} (ids {theirs[k:k + 4]} vs "
                              f"{ours[k:k + 4]}): it has a normalizer or option pi-run does not reproduce")


def _post_processor_adds(tokenizer_json: dict[str, Any], config: dict[str, Any]) -> dict[str, bool]:
    """``{"bos": bool, "eos": bool}`` as far as today's llama.cpp reads them off ``post_processor``."""
    def content(v: Any) -> Any:
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = content(config.get("bos_token")), content(config.get("eos_token"))
    pp = tokenizer_json.get("post_processor")
    adds: dict[str, bool] = {}
    procs = pp.get("processors", [pp]) if isinstance(pp, dict) else []
    for proc in procs if isinstance(procs, list) else []:
        if not isinstance(proc, dict):
            continue
        if proc.get("type") == "ByteLevel":
            adds.setdefault("bos", False)
            adds.setdefault("eos", False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single")
            if isinstance(single, list) and len(single) > 1 and all(isinstance(s, dict) for s in single):
                first = (single[0].get("SpecialToken") or {}).get("id")
                last = (single[-1].get("SpecialToken") or {}).get("id")
                if first:
                    adds["bos"] = first == bos
                if last:
                    adds["eos"] = last == eos
    return adds


def add_vocab(writer: gguf.GGUFWriter, model_dir: str | Path, n_vocab: int) -> int:
    """Write tokenizer keys for ``model_dir`` into ``writer``; returns the vocab size (``n_vocab``).

    Pads with ``[PAD{i}]`` tokens (type UNUSED) when the model's embedding has more rows than the
    tokenizer has tokens, as llama.cpp's converter does. Everything is read and checked before the
    first key is written. Raises PowerInferError when the tokenizer has more tokens than ``n_vocab``,
    for an unusable tokenizer, and for a pre-tokenizer pi-run cannot reproduce.
    """
    model_dir = Path(model_dir)
    tj_path = model_dir / "tokenizer.json"
    pre: str | None = None
    if not (model_dir / "tokenizer.model").is_file() and not (model_dir / "vocab.json").is_file() \
            and tj_path.is_file():
        tokenizer_json = _read_json(tj_path)
        pre = bpe_pre_tokenizer(model_dir, tokenizer_json)
    from_json = pre in HF_PRE_NAMES  # GPT-2 and Falcon keep gguf.BpeVocab's types, as upstream PowerInfer's files
    scores: list[float] = []
    if from_json:
        tokens, types = hf_bpe_tokens(model_dir, tokenizer_json, n_vocab)
        tokenizer_model = "gpt2"
    else:
        vocab = load_vocab(model_dir)
        tokens, types = [], []
        for text, score, ttype in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(ttype)
        if len(tokens) > n_vocab:
            raise PowerInferError(f"{model_dir}: tokenizer has {len(tokens)} tokens but the model's vocab_size is "
                                  f"{n_vocab}")
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
        tokenizer_model = vocab.tokenizer_model
        pre = (pre or bpe_pre_tokenizer(model_dir)) if tokenizer_model == "gpt2" else None
    special = gguf.SpecialVocab(model_dir, load_merges=tokenizer_model == "gpt2", n_vocab=n_vocab)
    if tokenizer_model == "llama" and "unk" not in special.special_token_ids:
        special.special_token_ids["unk"] = vocab.sentencepiece_tokenizer.unk_id()
    if from_json:
        special.add_special_token.update(_post_processor_adds(tokenizer_json, _tokenizer_config(model_dir)))
        check_pre_tokenizer(model_dir, pre, tokens, special.merges, tokenizer_json)
    special.chat_template = None  # ours below, checked
    template = chat_template(model_dir)

    writer.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if tokenizer_model == "llama":
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
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

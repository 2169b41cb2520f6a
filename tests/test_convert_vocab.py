"""pi-convert writes a Llama 3 / Qwen byte-level BPE vocabulary as llama.cpp's converter does.

The real ``tokenizer.json`` files are not in the repository, so each test builds the Hugging Face
tokenizer folder from llama.cpp's vocab GGUF of that model (``tests/data/tokenizers/gguf-vocab``):
the model's vocab and merges, the pre-tokenizer of the family as its ``tokenizer.json`` writes it
(an isolating ``Split`` regex, then ``ByteLevel`` without its regex), the ``added_tokens`` with
their ``special`` flags, ``tokenizer_config.json`` (bos/eos/pad texts, chat template,
``clean_up_tokenization_spaces``), ``generation_config.json`` and the ``post_processor`` as the
published files have them:

* ``ggml-vocab-llama-bpe.gguf`` is Meta-Llama-3-8B's (128,000 tokens + 256 special ones, all
  ``special: true``; ``TemplateProcessing`` adding ``<|begin_of_text|>``; ``ignore_merges``);
* ``ggml-vocab-qwen2.gguf`` is Qwen1.5-7B's (151,643 + 3 special tokens, padded to 151,936; an NFC
  normalizer, a ``ByteLevel`` post-processor; bos/eos from config.json).

That folder is attached to a tiny model of the family (``family_models.MODERN_BUILDERS`` with
n_embd 16, so the 128k-row embedding stays small) and converted with ``pi-convert``. The written
tokenizer keys equal the vocab GGUF's (tokens, types, merges, pre, special ids, template), plus
the add-BOS/EOS flags that today's llama.cpp converter writes from the post-processor (its
converter, run on these folders outside the repo, wrote the same; see the report of issue 26).
pi-run's tokenizer on the converted file reproduces the vocab's ``.inp``/``.out`` vectors.

The Instruct variants (Llama 3.1 with ``<|eot_id|>`` as eos and ``<|eom_id|>``, Qwen2.5/Qwen3 with
their 22 + 4 added tokens, some not ``special``) check llama.cpp's type rules by hand: an added token
is control when special or shaped ``<|...|>``, else user-defined; and the ids
``generation_config.json`` ends on are end-of-generation in pi-run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from family_models import MODERN_BUILDERS
from helpers import DATA, TOKENIZERS, need
from powerinfer.convert.cli import main as convert_main
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime.tokenizer import GGUFTokenizer

VOCAB = TOKENIZERS / "gguf-vocab"
TEMPLATES = DATA / "chat_templates"
SEP = "\n__ggml_vocab_test__\n"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def vectors(name: str) -> list[tuple[str, list[int]]]:
    texts = need(VOCAB / f"{name}.inp").read_text(encoding="utf-8").split(SEP)[:-1]
    lines = need(VOCAB / f"{name}.out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(texts) == len(lines) >= 46
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.fixture(scope="module")
def vocabs():
    """llama.cpp's vocab GGUFs, each parsed once (150k-string arrays take seconds)."""
    return {n: open_gguf(need(VOCAB / f"ggml-vocab-{n}.gguf")) for n in ("llama-bpe", "qwen2", "qwen35")}


def _added(i: int, text: str, special: bool) -> dict:
    return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": special}


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")


def hf_folder(out: Path, family: str, g, n_base: int, added: list[tuple[int, str, bool]], config: dict,
              generation: dict, merges_as_pairs: bool, regex: str | None = None) -> Path:
    """A tiny ``family`` model with an HF byte-level BPE tokenizer made of vocab GGUF ``g``'s first ``n_base``
    tokens and merges, ``added`` tokens ``(id, text, special)``, ``config`` as tokenizer_config.json and
    the family's pre-tokenizer regex (or ``regex``)."""
    tokens, merges = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.merges")
    n_vocab = len(tokens)
    llama = family.startswith("llama")
    d = MODERN_BUILDERS[family](out, vocab_size=n_vocab, bos_token_id=generation["bos_token_id"],
                                eos_token_id=generation["eos_token_id"], **TINY,
                                **({"head_dim": 8} if family == "qwen3" else {}))
    (d / "tokenizer.model").unlink()  # the builder's SentencePiece tokenizer: replaced by the BPE one
    bos = config.get("bos_token")
    model = {"type": "BPE", "dropout": None, "unk_token": None,
             "continuing_subword_prefix": None if llama else "", "end_of_word_suffix": None if llama else "",
             "fuse_unk": False, "byte_fallback": False, "ignore_merges": llama,
             "vocab": {t: i for i, t in enumerate(tokens[:n_base])},
             "merges": [m.split(" ") for m in merges] if merges_as_pairs else list(merges)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": not llama, "use_regex": False}
    post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    if llama:  # Meta's files: a ByteLevel step, then the BOS template
        post = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}}}]}
    _write_json(d / "tokenizer.json", {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(i, t, s) for i, t, s in added],
        "normalizer": None if llama else {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex or (LLAMA3_REGEX if llama else QWEN2_REGEX)},
             "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": model})
    _write_json(d / "tokenizer_config.json", {
        "added_tokens_decoder": {str(i): {k: v for k, v in _added(i, t, s).items() if k != "id"} for i, t, s in added},
        **config})
    _write_json(d / "generation_config.json", generation)
    return d


def convert(d: Path, out: Path) -> Path:
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(out), "--outtype", "f16", "--for-pi-run"])
    assert r.exit_code == 0, r.output
    return out


def tokenizer_meta(g) -> dict:
    return {k: g.get(k) for k in TOKENIZER_KEYS}


# --------------------------------------------------------------------------- the vocab GGUFs' own models
def llama3_base(tmp: Path, g) -> Path:
    """Meta-Llama-3-8B: 256 special tokens, eos <|end_of_text|>, no chat template."""
    tokens = g.get("tokenizer.ggml.tokens")
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True,
           "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    gen = {"bos_token_id": 128000, "eos_token_id": 128001, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    return hf_folder(tmp, "llama3", g, 128000, [(i, tokens[i], True) for i in range(128000, 128256)], cfg, gen,
                     merges_as_pairs=False)


def qwen15_base(tmp: Path, g, regex: str | None = None) -> Path:
    """Qwen1.5-7B: 3 special tokens, bos none in tokenizer_config (config.json's 151643), Qwen's template."""
    cfg = {"add_prefix_space": False, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
           "chat_template": g.get("tokenizer.chat_template"), "clean_up_tokenization_spaces": False,
           "eos_token": "<|endoftext|>", "errors": "replace", "model_max_length": 32768,
           "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
           "unk_token": None}
    gen = {"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}
    added = [(151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True)]
    return hf_folder(tmp, "qwen2", g, 151643, added, cfg, gen, merges_as_pairs=True, regex=regex)


# What today's llama.cpp converter writes beyond the vocab GGUF (made by its 2024 converter): the add flags
# it reads off the post-processor (and, for Llama 3's TemplateProcessing pair, add_sep_token).
CASES = {"llama-bpe": (llama3_base, {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
                                     "tokenizer.ggml.add_sep_token": False}),
         "qwen2": (qwen15_base, {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}),
         # llama.cpp's qwen35 vocab: the same Qwen vocabulary with Qwen3.5's regex (letters with their marks)
         "qwen35": (lambda tmp, g: qwen15_base(tmp, g, QWEN35_REGEX),
                    {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False})}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, vocabs, tmp_path_factory):
    name = request.param
    make, adds = CASES[name]
    tmp = tmp_path_factory.mktemp(name)
    d = make(tmp / "hf", vocabs[name])
    return name, adds, open_gguf(convert(d, tmp / "model.gguf"))


def test_vocab_metadata_equals_llamacpps_vocab_gguf(converted, vocabs):
    name, adds, g = converted
    ref = vocabs[name]
    ours, theirs = tokenizer_meta(g), tokenizer_meta(ref)
    assert ours["tokenizer.ggml.model"] == "gpt2" and ours["tokenizer.ggml.pre"] == name
    assert len(ours["tokenizer.ggml.tokens"]) == len(theirs["tokenizer.ggml.tokens"]) > 128000
    # the 2024 converter typed the [PAD{i}] fillers user-defined; today's types them unused
    pads = [i for i, t in enumerate(theirs["tokenizer.ggml.tokens"]) if t == f"[PAD{i}]"]
    assert len(pads) == (0 if name == "llama-bpe" else 290)
    assert {theirs["tokenizer.ggml.token_type"][i] for i in pads} <= {USER_DEFINED}
    theirs["tokenizer.ggml.token_type"] = list(theirs["tokenizer.ggml.token_type"])
    for i in pads:
        theirs["tokenizer.ggml.token_type"][i] = UNUSED
    for k in TOKENIZER_KEYS:
        assert ours[k] == theirs[k], k
    # every tokenizer key llama.cpp's file has, and only the add flags besides (today's converter writes them)
    keys = {k for k in g.reader.fields if k.startswith("tokenizer.")}
    assert keys == {k for k in ref.reader.fields if k.startswith("tokenizer.")} | set(adds)
    assert {k: g.get(k) for k in adds} == adds


def test_runtime_tokenizer_on_converted_file_reproduces_vectors(converted):
    name, adds, g = converted
    tok = GGUFTokenizer(g)
    bad = [(text, ids, tok.encode(text, add_bos=False)) for text, ids in vectors(f"ggml-vocab-{name}.gguf")]
    bad = [b for b in bad if b[1] != b[2]]
    assert not bad, bad[:3]
    first = tok.encode("Hello world")
    assert (first[0] == tok.bos_id) == adds["tokenizer.ggml.add_bos_token"]


# --------------------------------------------------------------------------- Instruct variants, by hand
def test_llama31_instruct_eot_eom_and_template(vocabs, tmp_path):
    g = vocabs["llama-bpe"]
    tokens = list(g.get("tokenizer.ggml.tokens"))
    named = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
    k = 0
    for i in range(128002, 128256):  # Llama 3.1's layout: three reserved slots named, the rest renumbered
        if i in named:
            tokens[i] = named[i]
        elif i not in (128006, 128007, 128009):
            tokens[i] = f"<|reserved_special_token_{k}|>"
            k += 1
    assert tokens[128011] == "<|reserved_special_token_3|>" and tokens[128255] == "<|reserved_special_token_247|>"
    template = need(TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text(encoding="utf-8")
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
           "clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast"}
    gen = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9}

    class Renamed:
        def get(self, key):
            return tokens if key == "tokenizer.ggml.tokens" else g.get(key)

    d = hf_folder(tmp_path / "hf", "llama3", Renamed(), 128000, [(i, tokens[i], True) for i in range(128000, 128256)],
                  cfg, gen, merges_as_pairs=True)
    out = open_gguf(convert(d, tmp_path / "m.gguf"))
    assert out.get("tokenizer.ggml.pre") == "llama-bpe"
    assert out.get("tokenizer.ggml.tokens") == tokens
    assert out.get("tokenizer.ggml.token_type") == [NORMAL] * 128000 + [CONTROL] * 256
    assert out.get("tokenizer.ggml.merges") == g.get("tokenizer.ggml.merges")
    assert [out.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")] == [128000, 128009, None]
    assert out.get("tokenizer.chat_template") == template
    tok = GGUFTokenizer(out)
    assert {128001, 128008, 128009} <= tok.eog_ids  # generation_config's eos ids end generation
    ids = tok.encode("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", parse_special=True)
    assert ids[:2] == [128000, 128006] and ids[-1] == 128009 and 128007 in ids


QWEN25_ADDED = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],  # special: true
                ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"])


def test_qwen3_added_tokens_types_and_eog(vocabs, tmp_path):
    g = vocabs["qwen2"]
    special, plain = QWEN25_ADDED
    added = [(151643 + i, t, True) for i, t in enumerate(special)] + \
            [(151657 + i, t, False) for i, t in enumerate(plain)]
    template = need(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    cfg = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "chat_template": template,
           "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
           "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
           "unk_token": None}
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643, "temperature": 0.6}
    d = hf_folder(tmp_path / "hf", "qwen3", g, 151643, added, cfg, gen | {"eos_token_id": 151645},
                  merges_as_pairs=False)
    _write_json(d / "generation_config.json", gen)
    out = open_gguf(convert(d, tmp_path / "m.gguf"))
    assert out.get("tokenizer.ggml.pre") == "qwen2"
    tokens, types = out.get("tokenizer.ggml.tokens"), out.get("tokenizer.ggml.token_type")
    assert tokens[:151643] == g.get("tokenizer.ggml.tokens")[:151643] and len(tokens) == 151936
    assert tokens[151643:151669] == special + plain
    # llama.cpp's rules: special -> control; not special but <|...|> -> control; else user-defined; gaps unused
    assert types[151643:151669] == [CONTROL] * 14 + [USER_DEFINED] * 2 + [CONTROL] * 6 + [USER_DEFINED] * 4
    assert types[151669:] == [UNUSED] * (151936 - 151669) and set(types[:151643]) == {NORMAL}
    assert [out.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")] == [151643, 151645, 151643]
    assert out.get("tokenizer.ggml.add_bos_token") is False and out.get("tokenizer.chat_template") == template
    tok = GGUFTokenizer(out)
    assert {151645, 151643} <= tok.eog_ids
    assert 151667 in tok.encode("a<think>b")  # user-defined: cut out even without parse_special
    assert 151644 not in tok.encode("<|im_start|>") and tok.encode("<|im_start|>", parse_special=True) == [151644]
    text, ids = vectors("ggml-vocab-qwen2.gguf")[20]
    assert tok.encode(text) == ids


# --------------------------------------------------------------------------- refused
def _small_bpe_folder(tmp: Path, regex: str) -> Path:
    """A tiny Qwen2 model whose tokenizer.json has a byte-level BPE with pre-tokenizer regex ``regex``."""
    from powerinfer.runtime.tokenizer import _BYTE_OF

    d = MODERN_BUILDERS["qwen2"](tmp, vocab_size=256, **TINY)
    (d / "tokenizer.model").unlink()
    chars = sorted(_BYTE_OF, key=_BYTE_OF.get)
    _write_json(d / "tokenizer.json", {
        "added_tokens": [], "normalizer": None, "post_processor": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}})
    _write_json(d / "tokenizer_config.json", {"eos_token": None})
    return d


TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("regex, says", [(TEKKEN_REGEX, "tekken pre-tokenizer"),
                                         (r"\p{N}{1,2}|\p{L}+|\s+|.", "is not one we can reproduce")])
def test_unknown_pre_tokenizer_is_one_line_and_no_file(tmp_path, regex, says):
    d = _small_bpe_folder(tmp_path / "hf", regex)
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(out), "--for-pi-run"])
    assert r.exit_code != 0
    msg = r.output.strip()
    assert "\n" not in msg and str(d / "tokenizer.json") in msg and says in msg and "known: llama-bpe" in msg
    assert not out.exists() and not list(tmp_path.glob("m.gguf*"))


def test_tekken_json_only_folder_is_refused(tmp_path):
    d = MODERN_BUILDERS["mistral"](tmp_path / "hf")
    (d / "tokenizer.model").unlink()
    _write_json(d / "tekken.json", {"config": {"pattern": TEKKEN_REGEX}, "vocab": []})
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(out), "--for-pi-run"])
    assert r.exit_code != 0 and "tekken vocabulary is not supported" in r.output and str(d) in r.output
    assert "\n" not in r.output.strip()
    assert not out.exists()


def test_regex_we_know_but_a_behaviour_we_do_not_is_refused(tmp_path):
    """Qwen2's regex, but a Lowercase normalizer: the check text tokenizes differently, so no file."""
    d = _small_bpe_folder(tmp_path / "hf", QWEN2_REGEX)
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    tj["normalizer"] = {"type": "Lowercase"}
    _write_json(d / "tokenizer.json", tj)
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(convert_main, [str(d), "--outfile", str(out), "--for-pi-run"])
    assert r.exit_code != 0 and "reads as 'qwen2'" in r.output and "\n" not in r.output.strip()
    assert not out.exists()


@pytest.mark.parametrize("name, wrong", [("qwen35", "qwen2"), ("qwen2", "qwen35"), ("llama-bpe", "qwen2")])
def test_check_text_tells_the_pre_tokenizers_apart(vocabs, tmp_path, name, wrong):
    """The conversion-time check is not vacuous: each folder passes under its own name and fails under a
    neighbour's (qwen2 and qwen35 differ only on marks after letters, llama-bpe and qwen2 on digit runs)."""
    from powerinfer.convert.vocab import check_pre_tokenizer
    from powerinfer.errors import PowerInferError

    d = tmp_path / "hf"
    d.mkdir()
    CASES[name][0](d, vocabs[name])
    g = vocabs[name]
    tokens, merges = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.merges")
    check_pre_tokenizer(d, name, tokens, merges)
    with pytest.raises(PowerInferError, match=f"reads as '{wrong}'.*split a check text differently"):
        check_pre_tokenizer(d, wrong, tokens, merges)

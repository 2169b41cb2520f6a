"""Calibration sources (powerinfer.data): text of any suffix, paragraphs, refusals, held-out splits."""
from __future__ import annotations

import hashlib
import itertools
import json

import pytest
from click.testing import CliRunner

import powerinfer.data as data_mod
from powerinfer.data import (MIN_SPLIT_TOKENS, calibration_batches, count_documents, iter_documents,
                             load_documents, pack_token_ids)
from powerinfer.errors import PowerInferError
from powerinfer.hf import load_hf_tokenizer

from helpers import DATA, ROOT, STORIES, TEXT, need, story_text

BUNDLED = ROOT / "powerinfer" / "assets" / "stories260K-relu"
WIKITEXT = TEXT / "wiki.test.raw"


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer(need(BUNDLED))


def _stream(batches, bos):
    """The stream tokens of packed batches: every row without its leading BOS."""
    rows = [row for b in batches for row in b.tolist()]
    assert all(row[0] == bos for row in rows)
    return [t for row in rows for t in row[1:]]


def _paragraphs(text: str) -> list[str]:
    """Hand count: groups of lines between lines that are empty or whitespace only."""
    groups = itertools.groupby(text.split("\n"), key=lambda line: line.strip() == "")
    return ["\n".join(lines).strip() for blank, lines in groups if not blank]


# --------------------------------------------------------------------------- the test data itself
def test_every_test_data_file_is_listed_with_its_sha256():
    """tests/data holds exactly the files of SHA256SUMS, byte for byte (a checkout that rewrote
    line ends, or a file added without its provenance in tests/data/README.md, fails here)."""
    listed = {}
    for line in need(DATA / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    present = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file()} - {"SHA256SUMS", "README.md"}
    assert sorted(present) == sorted(listed)
    readme = (DATA / "README.md").read_text()
    for name, digest in listed.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
        assert digest in readme, name  # each file's source and licence are given there


# --------------------------------------------------------------------------- any text suffix
def test_raw_and_other_suffixes_are_plain_text(tmp_path):
    for name in ("a.raw", "a.md", "a.text", "noext"):
        p = tmp_path / name
        p.write_text(" \n = Title = \n \n First line .\n second line .\n \n Last .\n")
        assert list(iter_documents(p)) == ["= Title =", "First line .\n second line .", "Last ."]


def test_wikitext_test_raw_has_one_document_per_paragraph():
    p = need(WIKITEXT)
    text = p.read_text(encoding="utf-8")
    hand = _paragraphs(text)
    assert len(hand) == 1320  # headings and article paragraphs of the canonical file
    parts = load_documents(p)
    assert count_documents(parts) == len(hand)
    docs = list(iter_documents(p))
    assert docs == hand
    assert docs[0] == "= Robert Boulter =" and docs[2] == "= = Career = ="
    # 1320 documents: the split is by documents, the last 132 held out
    held = list(iter_documents(p, "heldout", heldout=0.1))
    train = list(iter_documents(p, "train", heldout=0.1))
    assert held == hand[-132:] and train == hand[:-132]


def test_wikitext_splits_by_documents_with_disjoint_tokens(tok):
    p = need(WIKITEXT)
    hand = _paragraphs(p.read_text(encoding="utf-8"))
    held = _stream(calibration_batches(p, tok, None, 512, 8, split="heldout", heldout=0.1), tok.bos_token_id)
    want = tok(hand[-132:], add_special_tokens=False)["input_ids"]
    assert held == [t for ids in want for t in ids + [tok.eos_token_id]]
    train = _stream(calibration_batches(p, tok, 4096, 64, 8, split="train", heldout=0.1), tok.bos_token_id)
    first = tok(hand[0], add_special_tokens=False)["input_ids"]
    assert len(train) == 4096 - 4096 // 64 and train[: len(first) + 1] == first + [tok.eos_token_id]


# --------------------------------------------------------------------------- paragraphs
def test_whitespace_only_lines_break_paragraphs(tmp_path):
    p = tmp_path / "w.txt"
    p.write_text("one\n \ntwo a\ntwo b\n\t  \nthree\n\u3000\nfour\n\n\n \n five \n")
    assert list(iter_documents(p)) == ["one", "two a\ntwo b", "three", "four", "five"]
    assert count_documents(load_documents(p)) == 5


def test_crlf_bom_and_separator_lines(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes("\ufeffa é\r\n \r\nb\r\nc\rd\r\n<|endoftext|>\r\ne\r\n".encode())
    assert list(iter_documents(p)) == ["a é", "b\nc\nd", "e"]
    assert count_documents(load_documents(p)) == 3


def test_small_read_chunks_give_the_same_documents(tmp_path, monkeypatch):
    p = tmp_path / "s.txt"
    text = "héllo wörld\r\n\r\n€ uno\r\ndos ✓\r\n \r\n<|endoftext|>\r\nñ fin"
    p.write_bytes(text.encode())
    want = ["héllo wörld", "€ uno\ndos ✓", "ñ fin"]
    assert list(iter_documents(p)) == want
    for n in (1, 2, 3, 5):
        monkeypatch.setattr(data_mod, "_READ_BYTES", n)  # characters and \r\n split across reads
        assert list(data_mod._text_documents(p)) == want


def test_a_long_paragraph_is_cut_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "_MAX_DOC_CHARS", 10)
    p = tmp_path / "long.txt"
    p.write_text("abcd\nefgh\nijkl\nmnop\n\nq\n" + "x" * 25 + "\n")
    assert list(iter_documents(p)) == ["abcd\nefgh", "ijkl\nmnop", "q", "x" * 10, "x" * 10, "x" * 5]


# --------------------------------------------------------------------------- refusals
def test_non_utf8_file_is_refused_with_path_and_offset(tmp_path, monkeypatch):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\u00e9 ok\n".encode() + b"na\xefve\n")
    with pytest.raises(PowerInferError) as e:
        load_documents(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: not UTF-8 text") and "byte offset 11" in msg and "0xef" in msg
    monkeypatch.setattr(data_mod, "_READ_BYTES", 4)  # the same offset across chunk boundaries
    with pytest.raises(PowerInferError, match="byte offset 11"):
        list(data_mod._text_documents(p))
    nul = tmp_path / "nul.raw"
    nul.write_bytes(b"text\n\x00\x01")
    with pytest.raises(PowerInferError, match="byte offset 5: a NUL byte"):
        load_documents(nul)


def test_binary_model_files_give_one_line_errors(tmp_path):
    from powerinfer.profile.cli import main as profile_main

    for f in (need(BUNDLED / "model.safetensors"), need(STORIES / "stories260K.ggml-org.gguf")):
        with pytest.raises(PowerInferError, match="not UTF-8 text") as e:
            calibration_batches(f, None, 10, 8, 1)
        assert str(e.value).startswith(str(f)) and "\n" not in str(e.value)
    f = BUNDLED / "model.safetensors"
    r = CliRunner().invoke(profile_main, [str(BUNDLED), "--data", str(f), "--out", str(tmp_path / "a")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"{f}: not UTF-8 text (byte offset 0: byte 0xf8" in r.output
    assert not (tmp_path / "a").exists()


def test_folder_names_the_file_that_is_not_text(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("fine\n")
    (tmp_path / "d" / "b.raw").write_bytes(b"\xff\xfe")
    with pytest.raises(PowerInferError, match=r"b\.raw: not UTF-8 text \(byte offset 0"):
        load_documents(tmp_path / "d")


# --------------------------------------------------------------------------- formats as before
def test_txt_json_jsonl_and_folders_as_before(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("para one\nline two\n\npara two\n<|endoftext|>\npara three\n")
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": f"record {i}"}) for i in range(2)))
    (d / "c.json").write_text(json.dumps([{"text": "array 0"}, {"text": "x <|endoftext|> y"}]))
    (d / "sub" / "d.raw").write_text(" = Wiki = \n \n body \n")
    (d / "sub" / "e.md").write_text("# Notes\n\ntext\n")
    (d / ".hidden.txt").write_text("never\n")
    (d / "weights.bin").write_bytes(b"\x00\xff")  # not a data suffix: skipped in folders
    assert list(iter_documents(d / "a.txt")) == ["para one\nline two", "para two", "para three"]
    assert list(iter_documents(d / "b.jsonl")) == ["record 0", "record 1"]
    assert list(iter_documents(d / "c.json")) == ["array 0", "x", "y"]
    assert count_documents(load_documents(d / "c.json")) == 2  # records
    assert list(iter_documents(d)) == ["para one\nline two", "para two", "para three", "record 0", "record 1",
                                       "array 0", "x", "y", "= Wiki =", "body", "# Notes", "text"]
    assert [name.rsplit("/", 1)[-1] for _, _, name in load_documents(d)] == ["a.txt", "b.jsonl", "c.json",
                                                                             "d.raw", "e.md"]
    (d / "none").mkdir()
    (d / "none" / "w.bin").write_bytes(b"\x00")
    with pytest.raises(PowerInferError, match=r"holds no \.txt, \.raw, \.md, \.json or \.jsonl files"):
        load_documents(d / "none")


def test_twenty_documents_split_by_documents_fewer_by_tokens(tmp_path, tok):
    p = tmp_path / "twenty.txt"
    p.write_text("\n \n".join(f"Story number {i} is short." for i in range(20)) + "\n")
    assert list(iter_documents(p, "heldout")) == ["Story number 18 is short.", "Story number 19 is short."]
    assert list(iter_documents(p, "train")) == [f"Story number {i} is short." for i in range(18)]
    # 0.01 of 20 documents rounds to none: by tokens instead
    with pytest.raises(PowerInferError, match="by tokens"):
        iter_documents(p, "heldout", heldout=0.01)
    q = tmp_path / "nineteen.txt"
    q.write_text("\n\n".join(f"Story number {i} is short." for i in range(19)) + "\n")
    with pytest.raises(PowerInferError, match="19 document"):
        iter_documents(q, "train")
    full = _stream(calibration_batches(q, tok, None, 32, 4), tok.bos_token_id)
    held = _stream(calibration_batches(q, tok, None, 32, 4, split="heldout"), tok.bos_token_id)
    assert len(held) == round(len(full) * 0.1) and held == full[-len(held):]


# --------------------------------------------------------------------------- split by tokens
def test_one_paragraph_splits_by_tokens_without_sharing_a_token(tmp_path, tok):
    p = tmp_path / "one.txt"
    text = " ".join(story_text(3000).replace("<|endoftext|>", " ").split())
    p.write_text(text + "\n")  # one paragraph, one document
    assert count_documents(load_documents(p)) == 1
    bos = tok.bos_token_id
    full = _stream(calibration_batches(p, tok, None, 64, 4), bos)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert full == ids + [tok.eos_token_id]
    for heldout in (0.1, 0.25):
        train = _stream(calibration_batches(p, tok, None, 64, 4, split="train", heldout=heldout), bos)
        held = _stream(calibration_batches(p, tok, None, 64, 4, split="heldout", heldout=heldout), bos)
        assert len(held) == round(len(full) * heldout) > MIN_SPLIT_TOKENS
        assert len(train) + len(held) == len(full)
        assert train + held == full  # train is the head of the stream, held-out its tail: no shared token
    # a cap takes the first tokens of each split
    capped = list(calibration_batches(p, tok, 100, 64, 4, split="heldout"))
    assert [tuple(b.shape) for b in capped] == [(1, 64), (1, 36)]
    n_held = round(len(full) * 0.1)
    assert _stream(capped, bos) == full[len(full) - n_held:][:98]
    with pytest.raises(PowerInferError, match="by tokens"):
        iter_documents(p, "heldout")


def test_few_tokens_take_the_floor_and_too_few_are_refused(tmp_path, tok):
    p = tmp_path / "short.txt"
    p.write_text("Once upon a time there was a little girl named Lily.\nShe liked to play in the park "
                 "with her dog.\n")
    full = _stream(calibration_batches(p, tok, None, 16, 4), tok.bos_token_id)
    assert 2 * MIN_SPLIT_TOKENS <= len(full) < 10 * MIN_SPLIT_TOKENS  # 10% would be under the floor
    held = _stream(calibration_batches(p, tok, None, 16, 4, split="heldout"), tok.bos_token_id)
    train = _stream(calibration_batches(p, tok, None, 16, 4, split="train"), tok.bos_token_id)
    assert len(held) == MIN_SPLIT_TOKENS and train + held == full
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Once upon a time.\n")
    for split in ("train", "heldout"):
        with pytest.raises(PowerInferError, match=r"tiny\.txt: too little text for a held-out split: \d+ tokens "
                                                  r"in 1 document"):
            calibration_batches(tiny, tok, 10, 16, 1, split=split)  # at the call, not at the first batch
    assert _stream(calibration_batches(tiny, tok, None, 16, 1), tok.bos_token_id)  # "all" still works


def test_pack_token_ids_unchanged(tok):
    docs = ["Story number 0 is short.", "Story number 1 is short."]
    seqs = list(pack_token_ids(docs, tok, 8))
    ids = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert all(s[0] == tok.bos_token_id for s in seqs) and all(len(s) == 8 for s in seqs[:-1])
    assert [t for s in seqs for t in s[1:]] == ids
    assert sum(len(s) for s in pack_token_ids(docs, tok, 8, max_tokens=11)) == 11


def test_empty_and_whitespace_only_text(tmp_path, tok):
    p = tmp_path / "blank.raw"
    p.write_text(" \n\t\n \n")
    for split in ("all", "train", "heldout"):
        with pytest.raises(PowerInferError, match="no text"):
            calibration_batches(p, tok, 10, 8, 1, split=split)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(PowerInferError, match="no text"):
        iter_documents(tmp_path / "empty.txt")


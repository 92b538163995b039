"""data/tokenize_text.py on long documents: split at paragraphs, then lines, then tokens, into
documents of at most --max-doc-tokens (BOS included), nothing lost; --max-doc-tokens 0 and the
Shakespeare preset keep documents whole; an empty --doc-separator makes blank lines separate."""

import sys
from functools import lru_cache

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "data"))
import shards  # noqa: E402
import tokenize_text  # noqa: E402

BPE = ["--bpe-file", str(tokenize_text.BUNDLED_BPE), "--workers", "1"]  # one worker: same output, less CPU


@lru_cache(maxsize=None)
def encoding():
    return tokenize_text.load_encoding(tokenize_text.BUNDLED_BPE)


@pytest.fixture(autouse=True)
def bundled_encoding():
    tokenize_text._ENCODING = encoding()


def pieces_of(text: str, max_tokens: int) -> list[np.ndarray]:
    return tokenize_text.split_document(tokenize_text.encode_document(text), max_tokens)


def texts(pieces) -> list[str]:
    return [encoding().decode(piece[1:].tolist()) for piece in pieces]


def paragraph(word: str, lines: int, words_per_line: int = 6) -> str:
    return "\n".join(" ".join([word] * words_per_line) + "." for _ in range(lines))


def test_a_long_document_is_cut_after_blank_lines_into_the_longest_pieces_that_fit():
    paragraphs = [paragraph(w, n) for w, n in zip("one two three four five six seven eight".split(),
                                                   [3, 5, 2, 6, 4, 3, 5, 2])]
    text = "\n\n".join(paragraphs) + "\n"
    doc = tokenize_text.encode_document(text)
    limit = 60
    pieces = tokenize_text.split_document(doc, limit)
    assert len(pieces) > 2
    assert all(piece[0] == shards.BOS_ID and len(piece) <= limit for piece in pieces)
    assert np.array_equal(np.concatenate([piece[1:] for piece in pieces]), doc[1:])  # nothing lost or added
    # every cut falls after a blank line, and no piece could have taken the next paragraph too
    chunks = texts(pieces)
    assert all(chunk.endswith("\n\n") for chunk in chunks[:-1]), chunks
    for chunk, following in zip(chunks, chunks[1:]):
        next_paragraph = following.split("\n\n")[0] + "\n\n"
        assert 1 + len(encoding().encode_ordinary(chunk + next_paragraph)) > limit


def test_a_paragraph_longer_than_the_limit_is_cut_at_line_ends_and_a_line_at_any_token():
    text = paragraph("long", 30) + "\n\n" + " ".join(["word"] * 100)  # 30 lines, then one line of 100 words
    pieces = pieces_of(text, 40)
    chunks = texts(pieces)
    assert "".join(chunks) == text
    assert all(len(piece) <= 40 for piece in pieces)
    first_line_pieces = [c for c in chunks if c.startswith("long")]
    assert len(first_line_pieces) > 3 and all(c.endswith(".\n") or c.endswith(".\n\n") for c in first_line_pieces)
    last_pieces = [c for c in chunks if c.startswith(" word") or c.startswith("word")]
    assert len(last_pieces) == 3 and [len(p) for p in pieces[-3:]] == [40, 40, 23]  # 100 tokens: 39 + 39 + 22


def test_short_documents_and_a_zero_limit_are_left_whole():
    text = paragraph("short", 40)
    doc = tokenize_text.encode_document(text)
    assert len(doc) > 300
    for limit in (0, len(doc)):
        pieces = tokenize_text.split_document(doc, limit)
        assert len(pieces) == 1 and pieces[0] is doc


def test_the_default_command_splits_long_files_and_says_so(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/book.txt").write_text("\n\n".join(paragraph(f"w{i}", 8) for i in range(200)) + "\n")
    (tmp_path / "in/note.txt").write_text("A short note.\n")
    assert tokenize_text.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), *BPE]) == 0
    out = capsys.readouterr().out
    tokens = shards.read_tokens(tmp_path / "out/out_train_000001.bin")
    starts = np.flatnonzero(tokens == shards.BOS_ID)
    lengths = np.diff(np.append(starts, len(tokens)))
    assert lengths.max() <= tokenize_text.DEFAULT_MAX_DOC_TOKENS == 2048
    book_tokens = len(encoding().encode_ordinary((tmp_path / "in/book.txt").read_text()))
    assert len(tokens) == book_tokens + len(starts) + len(encoding().encode_ordinary("A short note.\n"))
    assert f"train: {len(tokens):,} tokens, {len(starts)} documents" in out
    assert f"split: 1 document(s) longer than 2,048 tokens became {len(starts) - 1}" in out
    assert "--max-doc-tokens 0 keeps documents whole" in out

    assert tokenize_text.main([str(tmp_path / "in"), "--out", str(tmp_path / "whole"), "--max-doc-tokens", "0",
                               *BPE]) == 0
    whole = shards.read_tokens(tmp_path / "whole/whole_train_000001.bin")
    assert (whole == shards.BOS_ID).sum() == 2 and "split:" not in capsys.readouterr().out


def test_val_tokens_keeps_a_split_document_in_one_split(tmp_path):
    docs = ["\n\n".join(paragraph(f"{name}{i}", 8) for i in range(60)) for name in ("a", "b")]
    result = tokenize_text.write_dataset(tmp_path / "out", "t", docs, val_tokens=10,
                                         bpe_file=tokenize_text.BUNDLED_BPE, max_doc_tokens=500)
    val = encoding().decode(shards.read_tokens(result["val"][0][0]).tolist())
    train = encoding().decode(shards.read_tokens(result["train"][0][0]).tolist())
    assert result["split_documents"] == 2 and result["val_documents"] > 1
    # validation needed 10 tokens, but takes all of the first document's pieces; training all of the second's
    assert {word[0] for word in val.replace("<|endoftext|>", " ").split()} == {"a"} and "a59" in val
    assert {word[0] for word in train.replace("<|endoftext|>", " ").split()} == {"b"} and "b0" in train


def test_a_blank_line_separator_makes_every_paragraph_a_document(tmp_path):
    (tmp_path / "chat.txt").write_text("hello there\nhow are you\n\n\nfine thanks\n  \nbye\n")
    assert tokenize_text.main([str(tmp_path / "chat.txt"), "--out", str(tmp_path / "out"), "--doc-separator=",
                               *BPE]) == 0
    tokens = shards.read_tokens(tmp_path / "out/out_train_000001.bin").tolist()
    docs = encoding().decode(tokens).split("<|endoftext|>")[1:]
    assert docs == ["hello there\nhow are you\n", "fine thanks\n", "bye\n"]


def test_bad_limits_and_separators_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    assert tokenize_text.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--max-doc-tokens", "1",
                               *BPE]) == 1
    assert capsys.readouterr().err.strip() == ("error: --max-doc-tokens 1: must be 0 (keep documents whole) or at "
                                               "least 2 (the BOS and one token)")
    assert tokenize_text.main(["--preset", "shakespeare", "--out", str(tmp_path / "s"), "--max-doc-tokens",
                               "512"]) == 1
    assert "drop --max-doc-tokens" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()

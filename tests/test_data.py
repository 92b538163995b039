"""Tests of data/: the shard format (written by data/shards.py, read by train_gpt.py), the tokenizer,
the bundled Shakespeare shards and the FineWeb downloader. CPU only, no network."""

import base64
import json
import os
import random
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import regex

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
sys.path[:0] = [str(REPO), str(DATA)]

import cached_fineweb10B  # noqa: E402
from conftest import run_command  # noqa: E402
import shakespeare_docs  # noqa: E402
import shards  # noqa: E402
import tokenize_text  # noqa: E402
import train_gpt  # noqa: E402


def run_script(script, *args, cwd=REPO, env=None, timeout=120):
    """`python data/<script> args`; past the timeout the test fails with the script's last output (run_command)."""
    return run_command([sys.executable, str(DATA / script), *map(str, args)], cwd=cwd, env=env, timeout=timeout)


def tokenize(*args, **kwargs):
    return run_script("tokenize_text.py", *args, **kwargs)


def offline_env(tmp_path):
    """Environment in which every network request fails at once: a closed local port as the endpoint/proxy."""
    env = dict(os.environ)
    env.pop("HF_HUB_OFFLINE", None)
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"),
               HTTPS_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", NO_PROXY="", no_proxy="",
               TIKTOKEN_CACHE_DIR=str(tmp_path / "tiktoken_cache"))
    return env


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("*.bin"))}


BPE = ["--bpe-file", DATA / "gpt2.tiktoken"]


@lru_cache(maxsize=None)
def bundled_encoding():
    return tokenize_text.load_encoding(tokenize_text.BUNDLED_BPE)


# -----------------------------------------------------------------------------
# The shard format: our writer, train_gpt.py's reader

def test_round_trip_through_train_gpt_reader(tmp_path):
    tokens = np.array([shards.BOS_ID, 0, 1, 65535, 50255, *range(1000, 1100), shards.BOS_ID, 7], dtype=np.int64)
    path = tmp_path / "x_train_000001.bin"
    assert shards.write_shard(path, tokens) == len(tokens)

    assert path.stat().st_size == 1024 + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, 1, len(tokens)] and not header[3:].any()
    assert shards.check_shard(path) == len(tokens)
    assert train_gpt.read_shard_header(path) == len(tokens)
    read = train_gpt.read_shard(path)
    assert read.dtype == np.uint16
    assert read.astype(np.int64).tolist() == tokens.tolist()
    assert shards.read_tokens(path).tolist() == tokens.tolist()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_constants_agree_with_train_gpt():
    assert (shards.MAGIC, shards.VERSION, shards.HEADER_INTS, shards.BOS_ID) == (
        train_gpt.SHARD_MAGIC, train_gpt.SHARD_VERSION, train_gpt.SHARD_HEADER_INTS, train_gpt.BOS_ID)
    assert (shards.PACKING_INDEX, shards.PACKINGS) == (train_gpt.SHARD_PACKING_INDEX, train_gpt.SHARD_PACKINGS)


def test_the_tokenizer_marks_its_shards_for_the_stream_packing_unless_told_otherwise(tmp_path):
    # FineWeb's shards have a zero there (documents: the record's rule); the bundled corpus keeps that rule,
    # since the smoke preset checks the speedrun's own pipeline.
    corpus = make_corpus(tmp_path / "corpus")
    for flags, packing in (([], "stream"), (["--packing", "documents"], "documents")):
        out = tmp_path / f"out_{packing}"
        done = tokenize(corpus, "--out", out, "--prefix", "c", "--val-tokens", "500", *flags, *BPE)
        assert done.returncode == 0, done.stderr
        assert f"packing: {packing} (" in done.stdout
        for path in out.glob("*.bin"):
            assert train_gpt.shard_packing(path) == packing
            assert np.fromfile(path, dtype="<i4", count=4)[3] == {"documents": 0, "stream": 1}[packing]
    for path in (DATA / "shakespeare").glob("*.bin"):
        assert train_gpt.shard_packing(path) == "documents"


def test_empty_shard_round_trips(tmp_path):
    path = tmp_path / "empty_val_000000.bin"
    shards.write_shard(path, [])
    assert shards.check_shard(path) == 0 and len(train_gpt.read_shard(path)) == 0


@pytest.mark.parametrize("bad", [[-1, 5], [65536], [1.5]])
def test_writer_rejects_tokens_outside_uint16(tmp_path, bad):
    with pytest.raises(shards.ShardError, match="bad.bin"):
        shards.write_shard(tmp_path / "bad.bin", np.array(bad))
    assert not list(tmp_path.iterdir())


def test_writer_reports_an_unwritable_folder(tmp_path):
    with pytest.raises(shards.ShardError, match="cannot write .*missing/x.bin: No such file or directory"):
        shards.write_shard(tmp_path / "missing" / "x.bin", [1, 2])


def _valid_shard(path, n=10):
    shards.write_shard(path, np.arange(n))
    return path


def _set_header(index, value):
    def corrupt(path):
        data = bytearray(path.read_bytes())
        data[4 * index:4 * index + 4] = np.int32(value).tobytes()
        path.write_bytes(bytes(data))
    return corrupt


CORRUPTIONS = {
    "wrong magic": (_set_header(0, 20240519), "magic"),
    "wrong version": (_set_header(1, 2), "version"),
    "count larger than the file": (_set_header(2, 11), "header says 11 tokens"),
    "count smaller than the file": (_set_header(2, 9), "header says 9 tokens"),
    "negative count": (_set_header(2, -1), "header says -1 tokens"),
    "empty file": (lambda p: p.write_bytes(b""), "empty"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:100]), "truncated"),
    "truncated tokens": (lambda p: p.write_bytes(p.read_bytes()[:-3]), "truncated"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_malformed_shards_are_rejected_by_both_readers(tmp_path, case):
    corrupt, words = CORRUPTIONS[case]
    path = _valid_shard(tmp_path / "s_train_000001.bin")
    corrupt(path)
    for read in (train_gpt.read_shard_header, train_gpt.read_shard):
        with pytest.raises(train_gpt.DataError) as info:
            read(path)
        assert str(path) in str(info.value) and words in str(info.value)
    with pytest.raises(shards.ShardError) as info:
        shards.check_shard(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_odd_sized_truncated_header_is_rejected_by_our_checker(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03\x04\x05")
    with pytest.raises(shards.ShardError, match="odd.bin: truncated"):
        shards.check_shard(path)


def test_odd_sized_truncated_header_is_rejected_by_train_gpt(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03\x04\x05")
    with pytest.raises(train_gpt.DataError, match="odd.bin"):
        train_gpt.read_shard_header(path)


def test_missing_shard_file(tmp_path):
    with pytest.raises(train_gpt.DataError, match="nope.bin"):
        train_gpt.read_shard(tmp_path / "nope.bin")
    with pytest.raises(shards.ShardError, match="nope.bin"):
        shards.check_shard(tmp_path / "nope.bin")


def test_find_shards_sorts_and_names_the_fetch_commands(tmp_path):
    for i in (3, 1, 2):
        _valid_shard(tmp_path / f"fineweb_train_{i:06d}.bin")
    pattern = str(tmp_path / "fineweb_train_*.bin")
    assert [p.name for p in train_gpt.find_shards(pattern, "training")] == [
        f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3)]

    missing = str(tmp_path / "nothing" / "fineweb_val_*.bin")
    with pytest.raises(train_gpt.DataError) as info:
        train_gpt.find_shards(missing, "validation")
    message = str(info.value)
    assert missing in message
    assert "python data/cached_fineweb10B.py" in message
    assert "tokenize_text.py" not in message  # the bundled corpus is there: never told to rebuild it


# -----------------------------------------------------------------------------
# The tokenizer equals GPT-2's: an independent reference implementation of the original algorithm

GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_to_char():
    """GPT-2's reversible map from bytes to printable characters (so tokens are strings, not bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + len(table) - len(printable))
    return table


class ReferenceGPT2:
    """GPT-2's encoder.py algorithm: regex pre-split, bytes to characters, then repeatedly merge every
    occurrence of the adjacent pair with the best merge rank. The merge list is recovered from the
    ranks file: the token of rank r is the merge of the two parts that the merges below r make of it."""

    def __init__(self, ranks_path):
        self.char = byte_to_char()
        tokens = []
        for line in Path(ranks_path).read_bytes().splitlines():
            b64, rank = line.split()
            tokens.append((int(rank), "".join(self.char[b] for b in base64.b64decode(b64))))
        tokens.sort()
        self.encoder = {text: rank for rank, text in tokens}
        assert all(len(text) == 1 for _, text in tokens[:256])  # the 256 single bytes come first
        self.merge_rank = {}
        for rank, text in tokens[256:]:
            parts = self.bpe(text)
            assert len(parts) == 2, f"rank {rank} ({text!r}) is not one merge of earlier tokens: {parts}"
            self.merge_rank[tuple(parts)] = rank
        self.cache = {}

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            best = min(zip(parts, parts[1:]), key=lambda pair: self.merge_rank.get(pair, float("inf")))
            if best not in self.merge_rank:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text):
        ids = []
        for piece in GPT2_SPLIT.findall(text):
            word = "".join(self.char[b] for b in piece.encode("utf-8"))
            if word not in self.cache:
                self.cache[word] = [self.encoder[part] for part in self.bpe(word)]
            ids.extend(self.cache[word])
        return ids


@lru_cache(maxsize=None)
def reference():
    return ReferenceGPT2(DATA / "gpt2.tiktoken")


HAND_PICKED = [
    "Hello world", "hello  world", "   leading", "trailing   ", "a  b   c    d", " ", "", "\n", "\n\n\n",
    "tabs\tand\t\ttabs\t", "lines\nand\r\nwindows\r\n\r\n", "mixed \t \n  whitespace   \n  runs\t\n",
    "I'm sure you'll see they're what we've said; he'd say it's 'twas, don't", "I'M DON'T THEY'RE WE'VE",
    "'s 't 're 've 'm 'll 'd ''s' '", "3.14159 1,000,000 2024-05-20 007 1e-9 0x1F ½ ² ٣",
    "Hello!!! ... ?!? --- (parens) [brackets] {braces} <tags> @user #tag $100 % ^&*_+=|\\/~`",
    "naïve café résumé Ünïcödé ß ﬁ", "日本語のテキスト、中文文本。한국어", "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "Ελληνικά русский текст العربية עברית हिन्दी ไทย", "no\u00a0break\u2003em\u200bzero-width\ufeffbom",
    "<|endoftext|>", "replacement \ufffd char", "x" * 300, " " * 50 + "y", "ab" * 100,
]


def random_strings(count=300, seed=0):
    pools = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " " * 8 + "\t\n\r",
             "'.,;:!?-()[]\"/&*#", "éüñçßøåÆŒ", "日本語中文字한국", "😀🎉👍🏽🇫🇷", "αβγδЖЗИЙ"]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 60))) for _ in range(count)]


def test_bundled_tokenizer_matches_reference_gpt2_bpe():
    encoding, ref = bundled_encoding(), reference()
    play = (DATA / "shakespeare" / "texts" / "hamlet_gut.txt").read_text()[:40_000]
    for text in HAND_PICKED + random_strings() + [play]:
        assert encoding.encode_ordinary(text) == ref.encode(text), text[:80]
        assert encoding.decode(encoding.encode_ordinary(text)) == text


def test_well_known_gpt2_ids():
    encoding = bundled_encoding()
    assert encoding.encode_ordinary("Hello world") == [15496, 995]
    assert encoding.encode_ordinary("\n") == [198]
    assert encoding.encode_ordinary(" the") == [262]
    assert encoding.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert encoding.n_vocab == 50257
    # Inside document text the special token's spelling is just text, never a document boundary.
    assert 50256 not in encoding.encode_ordinary("a <|endoftext|> b")
    tokenize_text._ENCODING = encoding
    assert tokenize_text.encode_document("Hello world").tolist() == [50256, 15496, 995]


def test_bundled_ranks_file_is_verified(tmp_path, monkeypatch):
    assert tokenize_text.sha256_of(tokenize_text.BUNDLED_BPE) == tokenize_text.BUNDLED_BPE_SHA256
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(tokenize_text.BUNDLED_BPE.read_bytes()[:-20])
    monkeypatch.setattr(tokenize_text, "BUNDLED_BPE", damaged)
    with pytest.raises(tokenize_text.TokenizeError, match="sha256"):
        tokenize_text.load_encoding(damaged)


def test_bpe_file_that_is_not_gpt2_is_rejected(tmp_path):
    short = tmp_path / "short.tiktoken"
    short.write_bytes(b"".join(tokenize_text.BUNDLED_BPE.read_bytes().splitlines(keepends=True)[:1000]))
    with pytest.raises(tokenize_text.TokenizeError, match="expected GPT-2's 50256 ranks"):
        tokenize_text.load_encoding(short)
    junk = tmp_path / "junk.tiktoken"
    junk.write_text("not a ranks file\n")
    with pytest.raises(tokenize_text.TokenizeError, match="not a .tiktoken ranks file"):
        tokenize_text.load_encoding(junk)


def test_tiktoken_gpt2_matches_bundled_file_when_available():
    """With network (or tiktoken's cache), tiktoken's own "gpt2" must give the same ids as the bundled file."""
    code = ("import json, sys, tiktoken; e = tiktoken.get_encoding('gpt2'); "
            "print(json.dumps([e.encode_ordinary(t) for t in json.load(sys.stdin)]))")
    texts = HAND_PICKED + random_strings(50, seed=1)
    try:
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("tiktoken's gpt2 files could not be fetched (timeout)")
    if done.returncode != 0:
        pytest.skip("tiktoken's gpt2 files are not cached and there is no network")
    encoding = bundled_encoding()
    assert json.loads(done.stdout) == [encoding.encode_ordinary(t) for t in texts]


def test_default_tiktoken_gpt2_offline_fails_with_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    done = tokenize(tmp_path / "a.txt", "--out", tmp_path / "out", env=offline_env(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not load tiktoken's 'gpt2' encoding")
    assert "--bpe-file" in lines[0] and "gpt2.tiktoken" in lines[0]
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# tokenize_text.py

def make_corpus(folder, n_files=12, seed=0):
    """A small mixed corpus: .txt files (some with several documents) and a .jsonl file."""
    rng = random.Random(seed)
    words = "the of and to a in that is was he for it with as his on be at by I you had not are but from".split()
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 400))) for _ in range(rng.randint(1, 3))]
        (folder / f"doc{i:02d}.txt").write_text("\n===\n".join(docs) + "\n")
    lines = [f'{{"text": "json document {i}: {" ".join(rng.choice(words) for _ in range(50))}"}}' for i in range(20)]
    (folder / "more.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_output_does_not_depend_on_worker_count(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"out{workers}"
        done = tokenize(corpus, "--out", out, "--prefix", "c", "--doc-separator====", "--val-tokens", "500",
                        "--shard-tokens", "1500", "--workers", workers, *BPE)
        assert done.returncode == 0, done.stderr
        outputs.append(shard_bytes(out))
    assert outputs[0] == outputs[1]
    names = sorted(outputs[0])
    assert "c_val_000000.bin" in names and "c_train_000001.bin" in names and len(names) > 3


def test_documents_start_with_bos_and_shards_hold_whole_documents(tmp_path):
    tokenize_text._ENCODING = bundled_encoding()
    docs = ["one two three", "four " * 30, "five six"]
    result = tokenize_text.write_dataset(tmp_path, "t", docs, bpe_file=tokenize_text.BUNDLED_BPE, shard_tokens=20)
    got = [shards.read_tokens(p).tolist() for p, _ in result["train"]]
    expected = [tokenize_text.encode_document(d).tolist() for d in docs]
    assert sum(got, []) == sum(expected, [])
    assert got[0] == expected[0]  # the long second document starts a new shard...
    assert got[1][0] == shards.BOS_ID and len(got[1]) == 20  # ...and is split only because it is longer
    assert all(len(shard) <= 20 for shard in got)
    assert result["val"] == []


def test_val_files_hold_out_whole_works(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_files=4)
    held = corpus / "doc02.txt"
    held.write_text("HELD OUT WORK " * 40)
    out = tmp_path / "out"
    done = tokenize(corpus, "--out", out, "--val-files", held, *BPE, "--workers", 1)
    assert done.returncode == 0, done.stderr
    encoding = bundled_encoding()
    val = shards.read_tokens(out / "out_val_000000.bin").tolist()
    assert val == [shards.BOS_ID] + encoding.encode_ordinary(held.read_text())
    train_text = encoding.decode(shards.read_tokens(out / "out_train_000001.bin").tolist())
    assert "HELD OUT" not in train_text and "json document 3" in train_text


def test_val_tokens_larger_than_the_text_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("only a few words here")
    done = tokenize(tmp_path / "a.txt", "--out", tmp_path / "out", "--val-tokens", "100000", *BPE)
    assert done.returncode == 1
    assert "error: --val-tokens 100000: the inputs hold only" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café naïve".encode("latin-1") + b" \xff\xfe ok \xe2\x82")  # 2 + 2 + 2 invalid bytes
    good = tmp_path / "fine.jsonl"
    good.write_bytes(b'{"text": "valid \xef\xbf\xbd stays"}\n{"text": "bad \xc3 here"}\n')
    out = tmp_path / "out"
    done = tokenize(bad, good, "--out", out, *BPE, "--workers", 1)
    assert done.returncode == 0, done.stderr
    assert f"warning: {bad}: 6 bytes are not valid UTF-8" in done.stderr
    assert f"warning: {good}: 1 bytes are not valid UTF-8" in done.stderr
    assert "7 invalid UTF-8 bytes in 2 file(s)" in done.stderr
    text = bundled_encoding().decode(shards.read_tokens(out / "out_train_000001.bin").tolist())
    assert "caf\ufffd na\ufffdve \ufffd\ufffd ok \ufffd" in text and "bad \ufffd here" in text

    raw = b"ok \xe9\xe9 \xf0\x9f\x98 \xef\xbf\xbd \xed\xa0\x80 end"
    decoded, replaced = tokenize_text.decode_utf8(raw)
    assert decoded == raw.decode("utf-8", errors="replace")
    assert replaced == 2 + 3 + 3  # a genuine U+FFFD in the input is not counted


def test_existing_shards_are_refused_unless_overwrite(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    out = tmp_path / "out"
    first = tokenize(corpus, "--out", out, "--shard-tokens", "300", "--val-tokens", "50", *BPE)
    assert first.returncode == 0, first.stderr
    before = shard_bytes(out)
    assert len(before) > 3

    again = tokenize(corpus, "--out", out, *BPE)
    assert again.returncode == 1
    assert again.stderr.startswith(f"error: --out {out} already holds {len(before)} out shard(s)")
    assert "--overwrite" in again.stderr and shard_bytes(out) == before

    replaced = tokenize(corpus, "--out", out, "--val-tokens", "50", "--overwrite", *BPE)
    assert replaced.returncode == 0, replaced.stderr
    after = shard_bytes(out)
    assert sorted(after) == ["out_train_000001.bin", "out_val_000000.bin"]  # stale shards are gone
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # nor is the staging folder left


BAD_INPUTS = {
    "empty txt": (lambda d: (d / "empty.txt").write_text(""), ["empty.txt"], "the inputs hold no text"),
    "blank jsonl": (lambda d: (d / "blank.jsonl").write_text("\n\n"), ["blank.jsonl"], "the inputs hold no text"),
    "empty folder": (lambda d: (d / "sub").mkdir(), ["sub"], "input sub: folder holds no .txt or .jsonl files"),
    "missing": (lambda d: None, ["missing.txt"], "input missing.txt: no such file or folder"),
    "csv": (lambda d: (d / "x.csv").write_text("a"), ["x.csv"], "unsupported file type"),
    "no text field": (lambda d: (d / "x.jsonl").write_text('{"body": "a"}\n'), ["x.jsonl"],
                      "x.jsonl:1: expected a JSON object"),
    "bad json": (lambda d: (d / "x.jsonl").write_text("{oops\n"), ["x.jsonl"], "x.jsonl:1: not valid JSON"),
    # issue 38 row 8: the parser's RecursionError was a traceback
    "json nested deeply": (lambda d: (d / "x.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n"), ["x.jsonl"],
                           "x.jsonl:1: not a document (JSON nested too deeply)"),
    "twice": (lambda d: (d / "a.txt").write_text("a"), ["a.txt", "a.txt"], "listed more than once"),
    "bad prefix": (lambda d: (d / "a.txt").write_text("a"), ["a.txt", "--prefix", "a/b"], "--prefix 'a/b'"),
    "all held out": (lambda d: (d / "a.txt").write_text("a"), ["a.txt", "--val-files", "a.txt"],
                     "nothing is left for training"),
    "no inputs": (lambda d: None, [], "no inputs"),
}


@pytest.mark.parametrize("setup, args, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_fail_with_one_clear_line(tmp_path, setup, args, message):
    setup(tmp_path)
    done = tokenize(*args, "--out", "out", *BPE, cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def tokenize_in_process(capsys, *args):
    """tokenize_text.main in this process: (exit code, stderr's error lines)."""
    code = tokenize_text.main([*map(str, args), "--bpe-file", str(tokenize_text.BUNDLED_BPE), "--workers", "1"])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def unwritable_folder(tmp_path) -> Path:
    """An existing folder this process cannot create files in (root may write anywhere chmod allows)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o555)
        return folder
    if not Path("/sys").is_dir():
        pytest.skip("no unwritable folder for root here")
    return Path("/sys")  # sysfs refuses new folders, even root's


@pytest.mark.parametrize("case", ["under a file", "unwritable folder"])
def test_an_out_that_cannot_be_made_or_written_is_one_line(tmp_path, capsys, case):
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "a.txt/out" if case == "under a file" else unwritable_folder(tmp_path)
    code, errors = tokenize_in_process(capsys, tmp_path / "a.txt", "--out", out)
    why = "Not a directory" if case == "under a file" else ""
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: --out {out}: cannot write there ({why}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"] + (["read-only"] if out.parent == tmp_path else [])


def test_a_failed_run_removes_every_folder_it_made(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    code, errors = tokenize_in_process(capsys, tmp_path / "empty.txt", "--out", tmp_path / "new/deeper/out")
    assert code == 1 and errors == ["error: the inputs hold no text (every file is empty or blank)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_a_prefix_taken_from_out_is_blamed_on_out(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "my corpus"
    code, errors = tokenize_in_process(capsys, tmp_path / "a.txt", "--out", out)
    assert code == 1 and errors == [f"error: --out {out}: the shards are named after its folder, 'my corpus', "
                                    f"which is not a plain name (letters, digits, '.', '_' and '-'); pass --prefix"]
    assert not out.exists()


def test_the_preset_does_not_blame_a_bpe_file_flag_it_was_not_given(tmp_path, capsys, monkeypatch):
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(tokenize_text.BUNDLED_BPE.read_bytes()[:-20])
    monkeypatch.setattr(tokenize_text, "BUNDLED_BPE", damaged)
    assert tokenize_text.main(["--preset", "shakespeare", "--out", str(tmp_path / "s")]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {damaged}: sha256 "), errors
    assert not (tmp_path / "s").exists()


def test_a_jsonl_file_with_a_byte_order_mark_is_read_like_a_txt_file(tmp_path, capsys):
    lines = b'{"text": "first document"}\n{"text": "second"}\n'
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines)
    (tmp_path / "plain.jsonl").write_bytes(lines)
    for name in ("bom", "plain"):
        code, errors = tokenize_in_process(capsys, tmp_path / f"{name}.jsonl", "--out", tmp_path / f"out_{name}")
        assert code == 0 and errors == []
    bom, plain = (tmp_path / f"out_{name}/out_{name}_train_000001.bin" for name in ("bom", "plain"))
    assert bom.read_bytes() == plain.read_bytes()


# -----------------------------------------------------------------------------
# The bundled Shakespeare corpus

def test_shakespeare_rebuilds_byte_for_byte(tmp_path):
    done = tokenize("--preset", "shakespeare", "--out", tmp_path, "--workers", 2)
    assert done.returncode == 0, done.stderr
    committed = shard_bytes(DATA / "shakespeare")
    assert sorted(committed) == ["shakespeare_train_000001.bin", "shakespeare_val_000000.bin"]
    assert shard_bytes(tmp_path) == committed


def test_shakespeare_shards_are_big_enough_and_split_by_work():
    train = shards.read_tokens(DATA / "shakespeare" / "shakespeare_train_000001.bin")
    val = shards.read_tokens(DATA / "shakespeare" / "shakespeare_val_000000.bin")
    assert len(train) >= 1_300_000 and len(val) >= 65_536
    assert train[0] == val[0] == shards.BOS_ID
    train_docs, val_docs = shakespeare_docs.documents()
    assert (train == shards.BOS_ID).sum() == len(train_docs) and (val == shards.BOS_ID).sum() == len(val_docs)
    assert not set(train_docs) & set(val_docs)
    assert 0.07 < len(val) / (len(train) + len(val)) < 0.11


def test_shakespeare_documents_are_scenes_and_poem_pieces():
    works = shakespeare_docs.read_works(shakespeare_docs.TEXTS_DIR)
    assert len(works) == 42
    for name, text in works.items():
        docs = shakespeare_docs.split_work(text)
        assert "".join(docs) == text, name  # nothing lost, nothing added
        assert len(docs) >= (1 if len(text) < 2 * shakespeare_docs.TARGET_CHARS else 2), name
    hamlet = shakespeare_docs.split_work(works["hamlet_gut.txt"])
    assert len(hamlet) == 20  # Hamlet's 20 scenes; act headings go with their first scene
    assert hamlet[0].startswith("HAMLET, PRINCE OF DENMARK") and "Scene I. Elsinore." in hamlet[0]
    assert hamlet[5].startswith("Act II.\n\nScene I.") and hamlet[6].startswith("Scene II.")
    henry_v = shakespeare_docs.split_work(works["henry_v_gut.txt"])
    assert henry_v[2].startswith("ACT II.\n\nPROLOGUE.")  # a prologue is a document of its own
    sonnets = shakespeare_docs.split_work(works["sonnets_gut.txt"])
    assert all(regex.match(r"[IVXLC]+\n", d) for d in sonnets[1:])  # cut between sonnets, never inside


# -----------------------------------------------------------------------------
# cached_fineweb10B.py

def test_default_shard_count_covers_the_speedrun():
    # the public repository's 9 and a spare; train_gpt.py counts what they supply (tests/test_supply.py)
    assert cached_fineweb10B.DEFAULT_TRAIN_SHARDS == 10
    assert cached_fineweb10B.SPEEDRUN_STEPS == train_gpt.Hyperparameters().num_iterations
    assert cached_fineweb10B.shard_names(2) == [
        "fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]


def test_offline_download_fails_fast_with_one_line(tmp_path):
    out = tmp_path / "fineweb10B"
    done = run_script("cached_fineweb10B.py", "2", "--out", out, env=offline_env(tmp_path), timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: could not download fineweb_val_000000.bin from the Hugging Face hub "
                               "(kjj0/fineweb10B-gpt2)")
    assert not list(tmp_path.rglob("*.bin"))


def test_bad_shard_count_is_a_usage_error(tmp_path):
    done = run_script("cached_fineweb10B.py", "104", "--out", tmp_path / "x")
    assert done.returncode == 2 and "between 0 and 103" in done.stderr


class FakeHub:
    """Stands in for huggingface_hub's two calls; writes what a (possibly broken) download would leave."""

    def __init__(self, monkeypatch, write):
        import huggingface_hub
        self.write, self.calls = write, []
        for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):  # main() sets these; restore them after
            monkeypatch.setenv(name, "10")
        monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", self.metadata)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.download)

    def metadata(self, url, timeout=None):
        return type("Meta", (), {"size": None})()

    def download(self, repo_id, filename, repo_type=None, local_dir=None, etag_timeout=None):
        self.calls.append(filename)
        path = Path(local_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write(path)
        return str(path)


def test_download_checks_each_shard_and_skips_valid_ones(tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch, lambda p: shards.write_shard(p, np.arange(100)))
    assert cached_fineweb10B.main(["1", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert hub.calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]

    (tmp_path / "fineweb_train_000001.bin").write_bytes(b"junk")  # a damaged copy is fetched again
    hub.calls.clear()
    assert cached_fineweb10B.main(["1", "--out", str(tmp_path)]) == 0
    assert hub.calls == ["fineweb_train_000001.bin"]
    assert shards.check_shard(tmp_path / "fineweb_train_000001.bin") == 100


def test_damaged_download_never_looks_complete(tmp_path, monkeypatch, capsys):
    FakeHub(monkeypatch, lambda p: p.write_bytes(shards.MAGIC.to_bytes(4, "little") + b"\0" * 500))
    assert cached_fineweb10B.main(["0", "--out", str(tmp_path / "fw")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: downloaded fineweb_val_000000.bin is damaged") and "\n" not in err
    assert not list(tmp_path.rglob("*.bin"))


def test_interrupted_download_leaves_no_complete_looking_file(tmp_path, monkeypatch, capsys):
    def interrupted(path):
        partial = path.parent / ".cache" / (path.name + ".incomplete")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"\0" * 2048)
        raise KeyboardInterrupt

    FakeHub(monkeypatch, interrupted)
    assert cached_fineweb10B.main(["0", "--out", str(tmp_path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.bin"))  # nothing under a final name
    assert list(tmp_path.rglob("*.incomplete"))  # the partial data stays hidden, for the hub to resume

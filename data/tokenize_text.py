"""Tokenize text with GPT-2's BPE into token shards that train_gpt.py reads.

Inputs are .txt files (one document per file, or several split by --doc-separator lines), .jsonl files
(one JSON object per line with a "text" field), and folders of both (searched recursively, in sorted
order; links are followed, each said in a note; a link to nothing or a loop is an error naming it). Every
document is written as <|endoftext|> (id 50256, the BOS token) followed by its tokens.
A document longer than --max-doc-tokens (default 2,048, the tokens train_gpt.py trains on per document)
is written as several, cut at paragraphs, else at line ends, else anywhere, so that none of it is skipped.

  python data/tokenize_text.py my_corpus/ --out data/my_corpus --prefix my_corpus --val-tokens 100000
  python data/tokenize_text.py books/ --val-files books/held_out.txt --bpe-file data/gpt2.tiktoken
  python data/tokenize_text.py chats.txt --doc-separator= --out data/chats   # every paragraph a document
  python data/tokenize_text.py --preset shakespeare --overwrite   # rebuild the bundled sample corpus

Output: PREFIX_val_000000.bin (more val shards count up) and PREFIX_train_000001.bin, ... in --out.
Shards hold whole documents; only a document longer than --shard-tokens is split across shards.
The output depends only on the inputs and their order, never on --workers.
A run claims --out for itself (safe_write.FolderLock): a second run into the same folder is refused in
one line while the first lasts, and a finished run leaves exactly its own PREFIX shards there.
"""

import argparse
import codecs
import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

import safe_write
import shakespeare_docs
import shards

DATA_DIR = Path(__file__).resolve().parent
BUNDLED_BPE = DATA_DIR / "gpt2.tiktoken"
BUNDLED_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer regex, as in tiktoken's "gpt2" encoding.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
GPT2_RANKS = 50256  # byte-level merges' ranks 0..50255; <|endoftext|> takes 50256
DEFAULT_SHARD_TOKENS = 100_000_000  # same as the FineWeb shards
# The speedrun's train_max_seq_len: train_gpt.py trains on a document's first 2,048 tokens (BOS included)
# and skips the rest, so longer documents are cut into pieces no longer than that.
DEFAULT_MAX_DOC_TOKENS = 2048
SUFFIXES = (".txt", ".jsonl")
BATCH_CHARS = 8_000_000  # text handed to the worker pool at a time: bounds memory, keeps workers busy
SHARD_NAME_RE = r"_(?:train|val)_\d{6}\.bin"
PREFIX_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"


class TokenizeError(Exception):
    """An expected failure (bad input, bad flag, no network); main() prints it as one line and exits
    with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# -----------------------------------------------------------------------------
# The encoding

def display(path) -> str:
    """path relative to the working directory when it lies below it (shorter messages), else absolute."""
    relative = os.path.relpath(path)
    return str(Path(path).resolve()) if relative.startswith("..") else relative


def sha256_of(path: Path, where: str | None = None) -> str:
    """The file's sha256, read through the one reader; `where` names it in an error (else path)."""
    digest = hashlib.sha256()
    try:
        with safe_write.open_regular(path, "a .tiktoken ranks file") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except safe_write.FileRefused as e:
        raise TokenizeError(f"{where or path}: {e.why}") from None
    return digest.hexdigest()


def load_encoding(bpe_file=None, flag: str | None = "--bpe-file"):
    """GPT-2's tiktoken Encoding: from a .tiktoken ranks file if given, else tiktoken's own "gpt2".
    Errors name the file after `flag`, or alone when the caller chose the file (None)."""
    import tiktoken
    import tiktoken.load

    if bpe_file is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except (OSError, ValueError) as e:  # requests' connection errors are OSErrors
            raise TokenizeError(
                f"could not load tiktoken's 'gpt2' encoding, which is downloaded on first use "
                f"({type(e).__name__}: no network?); use the bundled copy offline: --bpe-file {display(BUNDLED_BPE)}"
            ) from None

    path = Path(bpe_file)
    where = f"{flag} {path}" if flag else str(path)
    if not os.path.lexists(path):
        raise TokenizeError(f"{where}: no such file")
    digest = sha256_of(path, where)
    if path.resolve() == BUNDLED_BPE and digest != BUNDLED_BPE_SHA256:
        raise TokenizeError(f"{where}: sha256 {digest} is not the bundled GPT-2 file's "
                            f"{BUNDLED_BPE_SHA256}; restore it with `git checkout -- data/gpt2.tiktoken`")
    try:
        # tiktoken caches files by path; passing the hash makes it reread a file that has changed.
        ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=digest)
    except ValueError:
        raise TokenizeError(f"{where}: not a .tiktoken ranks file "
                            f"(expected lines of 'base64-token rank')") from None
    if sorted(ranks.values()) != list(range(GPT2_RANKS)):
        raise TokenizeError(f"{where}: expected GPT-2's {GPT2_RANKS} ranks 0..{GPT2_RANKS - 1}, "
                            f"found {len(ranks)} entries")
    return tiktoken.Encoding(name=f"gpt2 ({path.name})", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: shards.BOS_ID}, explicit_n_vocab=GPT2_RANKS + 1)


_ENCODING = None  # per process: set in the main process, or by _init_worker in pool workers


def _init_worker(bpe_file):
    global _ENCODING
    # Ctrl-C and SIGTERM reach the whole process group: the parent alone handles them, and ends the pool with
    # close() and join() once the batch in flight is encoded. A worker that died mid-task would leave the
    # pool waiting for that task forever, and Pool.terminate() can deadlock (python/cpython#78178, #96995).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _ENCODING is None:  # forked workers inherit the parent's; spawned ones load their own
        _ENCODING = load_encoding(bpe_file)


def encode_document(text: str) -> np.ndarray:
    """BOS followed by the text's tokens. A literal "<|endoftext|>" in the text is encoded as plain text."""
    ids = _ENCODING.encode_ordinary(text)
    out = np.empty(len(ids) + 1, dtype=np.uint16)
    out[0] = shards.BOS_ID
    out[1:] = ids
    return out


_TOKEN_TABLES = {}  # encoding name -> per token id: whitespace only?, newlines in it, ends with a newline?


def token_tables(encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token id: whether it is whitespace only, how many newlines it holds, whether it ends with
    one. GPT-2's pre-tokenizer keeps whitespace runs apart from words, so newlines are only ever in
    whitespace-only tokens."""
    if encoding.name not in _TOKEN_TABLES:
        raw = [encoding.decode_single_token_bytes(i) for i in range(shards.BOS_ID)] + [b"<|endoftext|>"]
        space = np.array([not b.strip(b" \t\r\n\x0b\x0c") for b in raw])
        newlines = np.array([b.count(b"\n") for b in raw], dtype=np.int64)
        line_end = np.array([b.endswith(b"\n") for b in raw])
        _TOKEN_TABLES[encoding.name] = space, newlines, line_end
    return _TOKEN_TABLES[encoding.name]


def split_document(doc: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """A document (BOS + tokens) as pieces of at most max_tokens tokens, each starting with BOS, that
    together hold its tokens exactly, in order. Each piece is as long as it can be: it ends after a
    blank line (a paragraph) if one lies within reach, else after a line end, else at max_tokens.
    max_tokens 0 keeps every document whole."""
    if not max_tokens or len(doc) <= max_tokens:
        return [doc]
    ids = doc[1:].astype(np.int64)
    space, newlines, line_end = token_tables(_ENCODING)
    # A cut at position i falls between tokens i-1 and i. After a token that ends a line, a cut starts
    # the next piece at a line's start; when the whitespace run up to that token (the tokens since
    # the last word) holds two newlines or more, the line was blank: a paragraph ends there.
    counted = np.cumsum(newlines[ids])
    last_word = np.maximum.accumulate(np.where(space[ids], -1, np.arange(len(ids))))
    run_newlines = counted - np.where(last_word >= 0, counted[np.maximum(last_word, 0)], 0)
    after = np.arange(1, len(ids) + 1)  # the cut after each token
    line_cuts = after[line_end[ids]]
    paragraph_cuts = after[line_end[ids] & (run_newlines >= 2)]

    def last_cut(cuts: np.ndarray, start: int, reach: int) -> int | None:
        index = int(np.searchsorted(cuts, reach, side="right")) - 1
        return int(cuts[index]) if index >= 0 and cuts[index] > start else None

    pieces, start, room = [], 0, max_tokens - 1  # room: tokens after the BOS
    while len(ids) - start > room:
        reach = start + room
        end = last_cut(paragraph_cuts, start, reach) or last_cut(line_cuts, start, reach) or reach
        pieces.append(ids[start:end])
        start = end
    pieces.append(ids[start:])
    return [np.concatenate([[shards.BOS_ID], piece]).astype(np.uint16) for piece in pieces]


# -----------------------------------------------------------------------------
# Reading inputs

_replaced_bytes = 0


def _count_and_replace(err):
    # Same substitution as errors="replace" (one U+FFFD per invalid sequence), but counts the bytes.
    global _replaced_bytes
    _replaced_bytes += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("tokenize_text.replace", _count_and_replace)


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """Decode UTF-8 like errors="replace"; also return how many bytes were not valid UTF-8."""
    global _replaced_bytes
    _replaced_bytes = 0
    return raw.decode("utf-8", errors="tokenize_text.replace"), _replaced_bytes


FILE_KINDS = [(stat.S_ISFIFO, "a FIFO (a named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
              (stat.S_ISBLK, "a device")]


def kind_of(mode: int) -> str:
    return next((name for test, name in FILE_KINDS if test(mode)), "an odd kind of file")


def link_target(path: Path) -> str:
    try:
        return safe_write.visible(os.readlink(path))
    except OSError:
        return "?"


def input_stat(path: Path, prefix: str) -> os.stat_result:
    """os.stat of an input (links followed); an error starting with prefix says why there is none: a link to
    nothing, a loop of links, nothing there, or no permission."""
    try:
        return os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOENT and path.is_symlink():
            raise TokenizeError(f"{prefix}: a link to {link_target(path)}, which does not exist; remove the link or "
                                f"restore what it names") from None
        if e.errno == errno.ENOENT:
            raise TokenizeError(f"{prefix}: no such file or folder") from None
        if e.errno == errno.ELOOP:
            raise TokenizeError(f"{prefix}: a loop of links (this one names {link_target(path)})") from None
        raise TokenizeError(f"{prefix}: cannot read it ({e.strerror})", code=2) from None


def files_below(folder: Path, flag: str, notes: list[str] | None = None) -> list[Path]:
    """Every .txt/.jsonl file below folder, recursively. Links are followed to the files and folders they name, each
    said in a line added to `notes`; a link to nothing, a loop of links, a link to a folder already read (one it lies
    in: a loop; another: its files twice) and a .txt/.jsonl that is not a regular file (a FIFO blocks the read
    forever) are errors naming them, and so is a folder that cannot be read. Before, rglob left links and unreadable
    folders out without a word: the data set lacked their files while the tool exited 0."""
    where = f"{flag} {folder}"
    top = input_stat(folder, where)
    read = {(top.st_dev, top.st_ino): folder}  # each folder read (device, inode) -> the path it was read through
    found, pending = [], [(folder, frozenset(read))]  # folders to read, each with its own and its parents' keys
    while pending:  # a stack, not recursion: a legal tree can be thousands of folders deep
        directory, ancestors = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = sorted(Path(entry.path) for entry in listing)
        except OSError as e:
            raise TokenizeError(f"{where}: cannot read the folder {safe_write.visible(str(directory))} "
                                f"({e.strerror}), so its files would be left out", code=2) from None
        for path in entries:
            prefix = f"{where}: {safe_write.visible(str(path))}"
            info = input_stat(path, prefix)
            link = path.is_symlink()
            if stat.S_ISDIR(info.st_mode):
                key = (info.st_dev, info.st_ino)
                what = f"a link to {link_target(path)}, " if link else ""
                if key in ancestors:  # only a link leads to a folder it lies in
                    raise TokenizeError(f"{prefix}: {what}a folder it lies in: following it would never end")
                if key in read:
                    raise TokenizeError(f"{prefix}: {what}a folder already read as "
                                        f"{safe_write.visible(str(read[key]))}: its files would be read twice")
                read[key] = path
                if link and notes is not None:
                    notes.append(f"note: {prefix}: a link, followed to the folder {link_target(path)}")
                pending.append((path, ancestors | {key}))
            elif path.suffix.lower() in SUFFIXES:
                if not stat.S_ISREG(info.st_mode):
                    raise TokenizeError(f"{prefix}: {kind_of(info.st_mode)}, not a text file")
                if link and notes is not None:
                    notes.append(f"note: {prefix}: a link, followed to the file {link_target(path)}")
                found.append(path)
    return found


def collect_files(paths, flag: str, note=None) -> list[Path]:
    """Expand files and folders (recursively, sorted) into the .txt/.jsonl files they name (files_below). The links
    followed are said through `note`, once every input is known good: an error stays the only line."""
    files, notes = [], []
    for p in map(Path, paths):
        info = input_stat(p, f"{flag} {p}")
        if stat.S_ISDIR(info.st_mode):
            found = sorted(files_below(p, flag, notes), key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise TokenizeError(f"{flag} {p}: folder holds no .txt or .jsonl files")
            files.extend(found)
        elif not stat.S_ISREG(info.st_mode):
            raise TokenizeError(f"{flag} {p}: {kind_of(info.st_mode)}, not a text file or a folder")
        elif p.suffix.lower() not in SUFFIXES:
            raise TokenizeError(f"{flag} {p}: unsupported file type (expected .txt or .jsonl)")
        else:
            files.append(p)
    seen = set()
    for f in files:
        key = f.resolve()
        if key in seen:
            raise TokenizeError(f"{flag} {f}: listed more than once (directly or through a folder)")
        seen.add(key)
    for line in notes if note else ():
        note(line)
    return files


def open_regular(path: Path):
    """path opened for reading through the one reader (safe_write.open_regular: a regular file, opened without
    blocking): one swapped for a FIFO since collect_files would block the read forever."""
    try:
        return safe_write.open_regular(path, "a text file")
    except safe_write.FileRefused as e:
        raise TokenizeError(str(e)) from None


class DocumentReader:
    """Yields the documents of a list of files in order; counts bytes read and invalid UTF-8 bytes."""

    def __init__(self, files, doc_separator=None, text_field="text", warn=print):
        self.files = list(files)
        self.text_field = text_field
        self.warn = warn
        self.bytes_read = 0
        self.replaced = {}  # file -> invalid UTF-8 bytes replaced with U+FFFD
        self._separator = None
        if doc_separator is not None:
            if "\n" in doc_separator or "\r" in doc_separator:
                raise TokenizeError("--doc-separator must be a single line (an empty one: blank lines separate)")
            # A separator is a whole line (surrounding spaces/tabs allowed), so it cannot clip words;
            # an empty separator makes every blank line one.
            self._separator = re.compile(r"^[ \t]*" + re.escape(doc_separator.strip()) + r"[ \t]*(?:\r?\n|\Z)",
                                         re.MULTILINE)

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def __iter__(self):
        for path in self.files:
            self._replaced = 0
            found = 0
            read = self._read_jsonl if path.suffix.lower() == ".jsonl" else self._read_txt
            for doc in read(path):
                if doc.strip():
                    found += 1
                    yield doc
            if not found:
                self.warn(f"warning: {safe_write.visible(str(path))}: no text, skipped")
            if self._replaced:
                self.replaced[path] = self._replaced
                self.warn(f"warning: {safe_write.visible(str(path))}: {self._replaced} bytes are not valid UTF-8 "
                          f"and were replaced with U+FFFD")

    def _read_txt(self, path):
        with open_regular(path) as f:
            try:
                raw = f.read()
            except OSError as e:
                raise TokenizeError(f"{path}: cannot read ({e.strerror})") from None
        self.bytes_read += len(raw)
        text, self._replaced = decode_utf8(raw)
        text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark is not part of the text
        return self._separator.split(text) if self._separator else [text]

    def _read_jsonl(self, path):
        with open_regular(path) as f:
            for lineno, raw in enumerate(f, 1):
                self.bytes_read += len(raw)
                line, bad = decode_utf8(raw)
                self._replaced += bad
                if lineno == 1:
                    line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark, as in .txt files
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TokenizeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                except RecursionError:  # nested thousands deep: the parser's own limit, a traceback otherwise
                    raise TokenizeError(f"{path}:{lineno}: not a document (JSON nested too deeply)") from None
                if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
                    raise TokenizeError(f"{path}:{lineno}: expected a JSON object with a string "
                                        f"{self.text_field!r} field")
                yield record[self.text_field]


# -----------------------------------------------------------------------------
# Writing shards

class ShardSequence:
    """Packs documents into numbered shards of at most shard_tokens tokens each, written into folder (a staging
    folder) and named in errors as the shard of shown_folder (--out) it becomes: on a full disk the error named
    the hidden staging file, not the output asked for."""

    def __init__(self, folder: Path, prefix: str, split: str, first_index: int, shard_tokens: int,
                 packing: str = "stream", shown_folder: Path | None = None):
        self.folder, self.prefix, self.split, self.packing = folder, prefix, split, packing
        self.shown_folder = shown_folder or folder
        self.index, self.shard_tokens = first_index, shard_tokens
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)  # untouched pages cost no memory
        self.fill = 0
        self.written = []  # (path, tokens)
        self.tokens = 0
        self.documents = 0

    def add(self, doc: np.ndarray):
        self.documents += 1
        self.tokens += len(doc)
        if self.fill and self.fill + len(doc) > self.shard_tokens:
            self.flush()  # start the document in a fresh shard rather than splitting it
        pos = 0
        while pos < len(doc):
            n = min(self.shard_tokens - self.fill, len(doc) - pos)
            self.buffer[self.fill:self.fill + n] = doc[pos:pos + n]
            self.fill += n
            pos += n
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self):
        if not self.fill:
            return
        path = self.folder / f"{self.prefix}_{self.split}_{self.index:06d}.bin"
        shards.write_shard(path, self.buffer[:self.fill], self.packing, shown=self.shown_folder / path.name)
        self.written.append((path, self.fill))
        self.index += 1
        self.fill = 0


def existing_shards(out_dir: Path, prefix: str) -> list[Path]:
    pattern = re.compile(re.escape(prefix) + SHARD_NAME_RE)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if pattern.fullmatch(p.name))


def remove_empty(folders):
    """Removes these folders, deepest first, while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or not made): the folders above it stay too
            return


@contextlib.contextmanager
def claimed_staging(out_dir: Path, prefix: str, overwrite: bool):
    """A staging folder in out_dir, which is made if missing and claimed for this run until the block ends
    (safe_write.FolderLock): a second run into the same folder is refused in one line while this one lasts, so
    two runs never mix their shards. Old PREFIX shards there are refused unless overwrite; the check runs under
    the claim. The staging folder is removed at the end; if the block fails, so are the folders made for it."""
    created = list(itertools.takewhile(lambda folder: not folder.exists(), [out_dir, *out_dir.parents]))
    lock = safe_write.FolderLock(out_dir, f"--out {out_dir}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock.__enter__()
    except OSError as e:
        remove_empty(created)
        raise TokenizeError(f"--out {out_dir}: cannot write there ({e.strerror or e})", code=2) from None
    except safe_write.LockError as e:  # busy, or a lock file no run made (a planted link)
        raise TokenizeError(str(e)) from None
    stage, finished = None, False
    try:
        try:
            old = existing_shards(out_dir, prefix)
        except OSError as e:
            raise TokenizeError(f"--out {out_dir}: cannot read it ({e.strerror or e})", code=2) from None
        if old and not overwrite:
            raise TokenizeError(f"--out {out_dir} already holds {len(old)} {prefix} shard(s) (e.g. {old[0].name}); "
                                f"pass --overwrite to replace them")
        remove_leftover_staging(out_dir)
        try:
            stage = Path(tempfile.mkdtemp(prefix=f"{safe_write.temporary_prefix(prefix)[:-1]}-staging-", dir=out_dir))
        except OSError as e:
            raise TokenizeError(f"--out {out_dir}: cannot write there ({e.strerror or e})", code=2) from None
        yield stage
        finished = True
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        lock.__exit__(None, None, None)  # after the staging folder, before the folders: its file is in out_dir
        if not finished:
            remove_empty(created)


def remove_leftover_staging(out_dir: Path):
    """Staging folders exist only while a run holds out_dir's lock; one found by the holder was left by a run
    that was killed (kill -9, a power cut). They can hold gigabytes: removed, and said so."""
    leftovers = [p for p in out_dir.glob(".*-staging-*") if p.is_dir()]
    for folder in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
    if leftovers:
        print(f"note: --out {out_dir}: removed {len(leftovers)} staging folder(s) left by a run that was killed",
              file=sys.stderr)


def swap_in(out_dir: Path, prefix: str, written: list[Path]):
    """Moves the finished shards from the staging folder into out_dir, then removes out_dir's other PREFIX
    shards, so that it holds exactly this set. Ctrl-C and SIGTERM wait for these few renames to end."""
    names = {path.name for path in written}
    with safe_write.signals_deferred():
        for path in written:
            os.replace(path, out_dir / path.name)
        for path in existing_shards(out_dir, prefix):
            if path.name not in names:
                path.unlink()
    safe_write.fsync_folder(out_dir)


def _batches(docs, max_chars=BATCH_CHARS):
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def check_settings(prefix: str, shard_tokens: int, val_tokens: int, has_val_docs: bool, workers: int,
                   max_doc_tokens: int):
    """write_dataset's settings, each refused in one line that names its flag."""
    if not re.fullmatch(PREFIX_PATTERN, prefix):
        raise TokenizeError(f"--prefix {prefix!r}: use letters, digits, '.', '_' and '-' only")
    if not 1 <= shard_tokens <= shards.MAX_TOKENS:
        raise TokenizeError(f"--shard-tokens {shard_tokens}: must be between 1 and {shards.MAX_TOKENS}")
    if val_tokens < 0:
        raise TokenizeError(f"--val-tokens {val_tokens}: must not be negative")
    if has_val_docs and val_tokens:
        raise TokenizeError("use either held-out validation documents (--val-files) or --val-tokens, not both")
    if workers < 1:
        raise TokenizeError(f"--workers {workers}: must be at least 1")
    if max_doc_tokens < 0 or max_doc_tokens == 1:
        raise TokenizeError(f"--max-doc-tokens {max_doc_tokens}: must be 0 (keep documents whole) or at least 2 "
                            f"(the BOS and one token)")


def write_dataset(out_dir, prefix, train_docs, val_docs=None, val_tokens=0, *, bpe_file=None,
                  shard_tokens=DEFAULT_SHARD_TOKENS, max_doc_tokens=DEFAULT_MAX_DOC_TOKENS, workers=1,
                  overwrite=False, progress=None, bpe_flag: str | None = "--bpe-file", packing="stream") -> dict:
    """Tokenize documents into PREFIX_val_*.bin and PREFIX_train_*.bin shards in out_dir.

    The validation set is either val_docs (whole held-out documents), or, with val_tokens > 0, the
    first documents of train_docs until they hold at least val_tokens tokens. A document longer than
    max_doc_tokens is written as several (split_document; 0 keeps it whole), all in the same split.
    The shards' headers ask train_gpt.py for `packing` (shards.PACKINGS).
    The run claims out_dir for itself from the check for old shards to the end (claimed_staging). All shards are
    written into a staging folder and moved into out_dir only once everything succeeded; then out_dir holds
    exactly this run's PREFIX shards. progress, if given, is called after each batch of documents.
    """
    out_dir = Path(out_dir)
    check_settings(prefix, shard_tokens, val_tokens, val_docs is not None, workers, max_doc_tokens)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise TokenizeError(f"--out {out_dir}: exists and is not a folder", code=2)
    except OSError as e:
        raise TokenizeError(f"--out {out_dir}: cannot read it ({e.strerror or e})", code=2) from None

    global _ENCODING
    _ENCODING = load_encoding(bpe_file, bpe_flag)  # loads here first so that a bad --bpe-file fails before any work
    with claimed_staging(out_dir, prefix, overwrite) as stage:
        pool = None
        try:
            val = ShardSequence(stage, prefix, "val", 0, shard_tokens, packing, out_dir)
            train = ShardSequence(stage, prefix, "train", 1, shard_tokens, packing, out_dir)
            split = {"documents": 0, "pieces": 0}  # documents longer than max_doc_tokens, and what they became
            if workers > 1:
                import multiprocessing
                pool = multiprocessing.get_context().Pool(workers, initializer=_init_worker,
                                                          initargs=(bpe_file,))

            def encode_all(docs):
                """Each document's pieces (one list per document, usually of one)."""
                for batch in _batches(docs):
                    if pool is None:
                        encoded = [encode_document(d) for d in batch]
                    else:  # map keeps the input order, so the result does not depend on the worker count
                        encoded = pool.map(encode_document, batch, chunksize=max(1, len(batch) // (4 * workers)))
                    for doc in encoded:
                        pieces = split_document(doc, max_doc_tokens)
                        if len(pieces) > 1:
                            split["documents"] += 1
                            split["pieces"] += len(pieces)
                        yield pieces
                    if progress:
                        progress()

            if val_docs is not None:
                for pieces in encode_all(val_docs):
                    for piece in pieces:
                        val.add(piece)
                if not val.documents:
                    raise TokenizeError("the validation inputs hold no text")
            for pieces in encode_all(train_docs):
                sequence = val if val.tokens < val_tokens else train  # a split document stays in one split
                for piece in pieces:
                    sequence.add(piece)
            if val.tokens < val_tokens:
                raise TokenizeError(f"--val-tokens {val_tokens}: the inputs hold only {val.tokens} tokens "
                                    f"({val.documents} documents); ask for fewer")
            if not train.documents:
                if not val.documents:
                    raise TokenizeError("the inputs hold no text (every file is empty or blank)")
                raise TokenizeError("no text left for training" + (f" after the {val_tokens} validation tokens"
                                                                     if val_tokens else ""))
            val.flush()
            train.flush()
            try:
                swap_in(out_dir, prefix, [path for path, _ in val.written + train.written])
            except OSError as e:
                raise TokenizeError(f"--out {out_dir}: cannot move the new shards in ({e.strerror or e})",
                                    code=2) from None
        finally:
            if pool is not None:  # not terminate(): see _init_worker
                pool.close()
                pool.join()

    def listing(seq):
        return [(out_dir / p.name, n) for p, n in seq.written]

    return {"val": listing(val), "train": listing(train), "val_documents": val.documents,
            "train_documents": train.documents, "split_documents": split["documents"],
            "split_pieces": split["pieces"], "max_doc_tokens": max_doc_tokens, "packing": packing}


def print_summary(result: dict):
    for split in ("val", "train"):
        files = result[split]
        if not files:
            continue
        total = sum(n for _, n in files)
        print(f"{split}: {total:,} tokens, {result[split + '_documents']:,} documents, {len(files)} shard(s)")
        for path, n in files:
            print(f"  {display(path)}  {n:,} tokens, {path.stat().st_size:,} bytes")
    print(f"packing: {result['packing']} ("
          + ("train_gpt.py trains on every token, micro-batches running on across documents" if result["packing"] == "stream"
             else "record #85's rule: micro-batches start at documents, each giving its first max_seq_len tokens")
          + "; train_gpt.py --packing overrides it)")
    if result["split_documents"]:
        print(f"split: {result['split_documents']:,} document(s) longer than {result['max_doc_tokens']:,} tokens "
              f"became {result['split_pieces']:,} (cut at paragraphs, else at line ends; --max-doc-tokens 0 keeps "
              f"documents whole)")


# -----------------------------------------------------------------------------
# Command line

def whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Tokenize .txt/.jsonl text with GPT-2's BPE into token shards for train_gpt.py.",
        epilog="Arguments can also be read from a file, one per line: @list.txt",
        fromfile_prefix_chars="@")
    parser.add_argument("inputs", nargs="*", help=".txt or .jsonl files, or folders of them (searched recursively)")
    parser.add_argument("--preset", choices=["shakespeare"],
                        help="rebuild a bundled data set (shakespeare: data/shakespeare/ from its texts/)")
    parser.add_argument("--out", help="output folder (created if missing)")
    parser.add_argument("--prefix",
                        help="shard name prefix: PREFIX_train_000001.bin (default: the --out folder's name)")
    parser.add_argument("--shard-tokens", type=positive_int,
                        help=f"most tokens per shard (default {DEFAULT_SHARD_TOKENS:,})")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--val-tokens", type=positive_int,
                       help="validation = the first whole documents, until they hold at least this many tokens")
    split.add_argument("--val-files", nargs="+", metavar="PATH",
                       help="hold these files/folders out whole as validation (they are removed from the inputs)")
    parser.add_argument("--doc-separator", metavar="LINE",
                        help="in .txt files, a line equal to LINE separates documents, e.g. "
                             "--doc-separator='<|endoftext|>' or --doc-separator=---; --doc-separator= (empty): "
                             "blank lines do (default: one document per file)")
    parser.add_argument("--max-doc-tokens", type=non_negative_int, default=DEFAULT_MAX_DOC_TOKENS, metavar="N",
                        help=f"write a longer document as several of at most N tokens, cut at paragraphs, else at "
                             f"line ends (default {DEFAULT_MAX_DOC_TOKENS:,}: train_gpt.py trains on a document's "
                             f"first {DEFAULT_MAX_DOC_TOKENS:,} tokens only); 0 keeps documents whole")
    parser.add_argument("--packing", choices=list(shards.PACKINGS), default="stream",
                        help="how train_gpt.py packs these shards, written in their headers: stream (default: "
                             "micro-batches are consecutive runs of tokens, every token trained on) or documents "
                             "(record #85's FineWeb rule: each micro-batch starts at a document, which gives its "
                             "first max_seq_len tokens, and the rest of the one it ends in is skipped)")
    parser.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl files")
    parser.add_argument("--bpe-file", metavar="PATH",
                        help="GPT-2 ranks in tiktoken's format, e.g. data/gpt2.tiktoken (works offline); "
                             "default: tiktoken's own 'gpt2', downloaded once")
    parser.add_argument("--workers", type=positive_int, default=default_workers(),
                        help="tokenizer processes (default: one per CPU core; the output does not depend on it)")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    return parser.parse_args(argv)


def run_preset(args):
    given = [flag for flag, value in [("inputs", args.inputs), ("--prefix", args.prefix),
                                      ("--shard-tokens", args.shard_tokens), ("--val-tokens", args.val_tokens),
                                      ("--val-files", args.val_files),
                                      ("--doc-separator", args.doc_separator is not None),
                                      ("--max-doc-tokens", args.max_doc_tokens != DEFAULT_MAX_DOC_TOKENS),
                                      ("--bpe-file", args.bpe_file),
                                      ("--packing", args.packing != "stream")] if value]
    if given:
        raise TokenizeError(f"--preset {args.preset} fixes the inputs and settings; drop {', '.join(given)} "
                            f"(it accepts only --out, --workers and --overwrite)")
    train, val = shakespeare_docs.documents(shakespeare_docs.TEXTS_DIR)
    # Its documents are scenes and runs of poems, cut by shakespeare_docs itself: kept whole. Packed by the
    # record's rule: the smoke preset is a check of the speedrun's own pipeline.
    return write_dataset(args.out or shakespeare_docs.OUT_DIR, shakespeare_docs.PREFIX, train, val,
                         bpe_file=BUNDLED_BPE, max_doc_tokens=0, workers=args.workers, overwrite=args.overwrite,
                         bpe_flag=None, packing="documents")


def run(args):
    if args.preset:
        return run_preset(args)
    if not args.inputs:
        raise TokenizeError("no inputs: name .txt/.jsonl files or folders (or use --preset shakespeare)")
    if not args.out:
        raise TokenizeError("--out is required: the folder for the shards")
    prefix = args.prefix or Path(args.out).resolve().name
    if not args.prefix and not re.fullmatch(PREFIX_PATTERN, prefix):
        raise TokenizeError(f"--out {args.out}: the shards are named after its folder, {prefix!r}, which is not a "
                            f"plain name (letters, digits, '.', '_' and '-'); pass --prefix")
    from tqdm import tqdm

    def warn(message):  # through tqdm, so that warnings do not garble the progress bar
        tqdm.write(safe_write.visible(message), file=sys.stderr)

    val_files = collect_files(args.val_files, "--val-files", warn) if args.val_files else []
    held_out = {f.resolve() for f in val_files}
    train_files = [f for f in collect_files(args.inputs, "input", warn) if f.resolve() not in held_out]
    if not train_files:
        raise TokenizeError("every input is held out by --val-files; nothing is left for training")

    val_reader = DocumentReader(val_files, args.doc_separator, args.text_field, warn) if val_files else None
    train_reader = DocumentReader(train_files, args.doc_separator, args.text_field, warn)
    readers = [r for r in (val_reader, train_reader) if r]
    total = sum(r.total_bytes() for r in readers)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, disable=None) as bar:
        def progress():
            bar.update(sum(r.bytes_read for r in readers) - bar.n)

        result = write_dataset(args.out, prefix, train_reader, val_reader, args.val_tokens or 0,
                               bpe_file=args.bpe_file, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                               max_doc_tokens=args.max_doc_tokens, workers=args.workers, overwrite=args.overwrite,
                               progress=progress, packing=args.packing)
    replaced = {f: n for r in readers for f, n in r.replaced.items()}
    if replaced:
        print(f"note: {sum(replaced.values())} invalid UTF-8 bytes in {len(replaced)} file(s) were replaced "
              f"with U+FFFD", file=sys.stderr)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (TokenizeError, shards.ShardError, shakespeare_docs.CorpusError) as e:
        print(safe_write.visible(f"error: {e}"), file=sys.stderr)  # it names files and folders the user's tree holds
        return getattr(e, "code", 1)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Token shard files shared by the scripts in data/ (kept separate from train_gpt.py on purpose).

A shard is a header of 256 little-endian int32 values -- [0] magic 20240520, [1] version 1,
[2] number of tokens, [3] how train_gpt.py packs it (0: documents, 1: stream; see PACKINGS), the rest
zero -- followed by that many little-endian uint16 token ids. This is the layout of the public FineWeb
GPT-2 shards (whose [3] is 0), so both kinds of data read the same way.
"""

import os
from pathlib import Path

import numpy as np

import safe_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_BYTES = 2
BOS_ID = 50256  # <|endoftext|>: starts every document
MAX_TOKENS = 2**31 - 1  # the count is stored in an int32
PACKING_INDEX = 3
# How train_gpt.py's `--packing=auto` packs a shard's tokens into micro-batches. documents: record #85's rule,
# each micro-batch starts at a document and a document gives its first max_seq_len tokens (FineWeb's shards,
# whose header has 0 here). stream: micro-batches are consecutive runs of the tokens, every token trained on
# (data/tokenize_text.py's default: a few books would otherwise lose most of their text).
PACKINGS = {"documents": 0, "stream": 1}


class ShardError(ValueError):
    """A shard file that is missing, malformed, or cannot be written."""


def write_shard(path, tokens, packing: str = "documents", shown=None) -> int:
    """Write tokens (ints in 0..65535) as a shard at path, atomically, marked for `packing` (PACKINGS);
    returns the token count.

    Written with safe_write.atomic_file: a temporary file in the same folder, fsynced, then renamed over
    path, so a crash, a full disk or a signal never leaves a half-written file, nor the temporary. An error
    names `shown`, the name the user asked for, where path is a staging folder's (tokenize_text.py's), else path.
    """
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ShardError(f"{path}: tokens must be a flat sequence, got shape {array.shape}")
    if array.size > MAX_TOKENS:
        raise ShardError(f"{path}: {array.size} tokens do not fit in one shard (at most {MAX_TOKENS})")
    if array.size and array.dtype != np.uint16:
        if not np.issubdtype(array.dtype, np.integer):
            raise ShardError(f"{path}: tokens must be integers, got {array.dtype}")
        if array.min() < 0 or array.max() > 65535:
            raise ShardError(f"{path}: token ids must be in 0..65535 to fit uint16, "
                             f"got {array.min()}..{array.max()}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[PACKING_INDEX] = MAGIC, VERSION, array.size, PACKINGS[packing]
    body = array.astype("<u2", copy=False)

    try:
        with safe_write.atomic_file(path, shown) as f:
            f.write(header.tobytes())
            f.write(body.tobytes())
    except safe_write.FileRefused as e:  # a FIFO, a device or a link where the shard goes
        raise ShardError(str(e)) from None
    except OSError as e:  # disk full, permissions: an expected failure, not a bug
        raise ShardError(safe_write.write_error(shown or path, e)) from None
    return int(array.size)


def check_shard(path) -> int:
    """Validate path's header against its size and return its token count; raise ShardError if bad."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ShardError(f"{path}: no such shard file")
    try:
        with safe_write.open_regular(path, "a token shard") as f:  # the one reader: a FIFO is refused, not waited on
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_BYTES)
    except safe_write.FileRefused as e:
        raise ShardError(str(e)) from None
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard: {e.strerror or e}") from None
    if size == 0:
        raise ShardError(f"{path}: empty file, not a shard")
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); not a token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + TOKEN_BYTES * count
    if count < 0 or size != expected:
        raise ShardError(f"{path}: header says {count} tokens ({expected} bytes) but the file has {size} bytes"
                         f"{' (truncated?)' if size < expected else ''}")
    return count


def read_tokens(path) -> np.ndarray:
    """Return a validated shard's tokens as a uint16 array (for tools and tests; the trainer has its own)."""
    count = check_shard(path)
    try:
        with safe_write.open_regular(path, "a token shard", HEADER_BYTES + TOKEN_BYTES * count) as f:
            f.seek(HEADER_BYTES)
            return np.fromfile(f, dtype="<u2", count=count).astype(np.uint16, copy=False)
    except safe_write.FileRefused as e:  # swapped since it was checked
        raise ShardError(str(e)) from None

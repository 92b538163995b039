#!/usr/bin/env python3
"""Check, summarize and file NanoGPT speedrun records from their training logs.

A speedrun record is a claim backed by logs: several runs of one train_gpt.py whose
mean final validation loss is below the target at p < 0.01, timed on named hardware.
This tool reads those logs and does the arithmetic a reviewer would otherwise do by hand.

    python records/records.py summarize LOG...           table of runs + statistics
    python records/records.py compare --baseline LOG... --candidate LOG...
    python records/records.py verify LOG...              exit 0 only if the claim holds
    python records/records.py extract LOG -o FILE        the exact train_gpt.py of a run
    python records/records.py plot LOG... -o FILE.png    val loss curves (needs matplotlib)
    python records/records.py new NAME LOG...            file a record folder, regenerate the table
    python records/records.py table                      regenerate the record table

Only the standard library is required; scipy is used for the t distribution when it is
installed, and an exact-to-rounding fallback is used when it is not. See records/README.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as dt
import errno
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# The stdlib-only reader and writer the torch-free scripts share (data/safe_write.py, train_gpt.py's twin): every
# file this tool reads or writes goes through it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
import safe_write  # noqa: E402



# =============================================================================
# Constants
# =============================================================================

RULE = "=" * 100                 # separates embedded source, header and step lines
DEFAULT_TARGET = 3.28            # the speedrun's val-loss target
ALPHA = 0.01                     # significance level of every claim the tool checks
RECORDS_DIR = Path(__file__).resolve().parent
# Read (never imported) for the names of its Hyperparameters when a log's own source is stripped.
TRAINER = RECORDS_DIR.parent / "train_gpt.py"
# A trainer writes header and step lines of at most a few hundred characters (the longest are nvidia-smi's
# rows and hyperparameters holding file globs). A longer line after the RULE that starts the header is refused,
# with its file and line number, rather than truncated: a log that holds one was not written by a trainer, and no
# part of it is then parsed. The embedded source before that RULE is only hashed and read with ast, so its lines
# are not bounded.
MAX_LINE_CHARS = 10_000
# A log is a regular file of at most MAX_LOG_BYTES (a speedrun's is a few hundred KB with its source, a CPU smoke
# run's 70 KB): a FIFO would block the read and /dev/zero never end it.
MAX_LOG_BYTES = 256 << 20
MAX_RECORD_JSON_BYTES = 1 << 20   # `new` writes a few hundred bytes
# A count a log states (a step, a total, a world size, num_iterations) has at most MAX_COUNT_DIGITS digits: far past
# any run, and no int of thousands of digits (Python refuses 4,300 and more with a ValueError traceback).
MAX_COUNT_DIGITS = 18
# Above these no run's numbers lie, and the statistics' sums of a few such values overflow (three final val losses
# of 1.7e308 once stopped verify and summarize with an OverflowError traceback): a train time of 10**12 ms is 31
# years; a final val loss of 1e6 is far above a uniform guess's (ln 50257 = 10.8).
MAX_TIME_MS = 1e12
MAX_FINAL_LOSS = 1e6
RECORD_DIR_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})_(.+)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
BEGIN_MARK = "<!-- records:begin -->"
END_MARK = "<!-- records:end -->"


class ToolError(Exception):
    """An expected failure: printed as one `error: ...` line, exit status 1."""


# =============================================================================
# Log text in the files this tool writes, and on the terminal
# =============================================================================
# Text from a log (run ids, file names, versions, GPU names, notes, presets and other hyperparameter values)
# reaches the files this tool writes only through these, each at the point of output: a log cannot add
# markdown, HTML, shell or plot syntax to a record. What the tool prints passes through visible() (TerminalText,
# set up by main()): a log cannot send the terminal escape sequences either. Hyperparameter names and code_sha256
# are not escaped but checked when the log is read (read_log): a log with a bad one is refused.
MD_SPECIAL_RE = re.compile(r"([\\`*_\[\]<>|&~$])")


class TerminalText(io.TextIOBase):
    """stdout or stderr as main() hands them to a command: every line written shows its log text through visible(),
    as the files do. A run id, an `error:` line or a file name could otherwise clear the screen, move the cursor
    and print a green "OK" over the tool's own FAIL. Nothing this tool prints is exempt."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write("\n".join(map(visible, text.split("\n"))))
        return len(text)

    def flush(self):
        self.stream.flush()


def visible(text: str) -> str:
    """text with each character that is not printable (control characters, line and bidi marks) written as
    a Python string literal writes it (`\\x1b`, `\\u202e`): one line that shows what it holds."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def md_text(text: str) -> str:
    """text as literal markdown inline text: `|` cannot end a table cell, nor `<` start HTML, `[` a link,
    a backtick code, `$` math, `*`, `_` or `~` emphasis; unprintable characters are shown (visible)."""
    return MD_SPECIAL_RE.sub(r"\\\1", visible(text))


def sh_quote(word: str) -> str:
    """One bash word that reads back as `word`: shlex.quote's single quotes, or for a word holding characters
    that are not printable, bash's $'...' with those escaped (raw, a carriage return would end the README's
    line, and so the code block the command is in)."""
    if word.isprintable():
        return shlex.quote(word)

    def escaped(c: str) -> str:
        if c in "\\'":
            return "\\" + c
        if c.isprintable():
            return c
        code = ord(c)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return "$'" + "".join(map(escaped, word)) + "'"


def plot_text(text: str) -> str:
    """text as literal matplotlib text: a `$` would start mathtext (and a malformed formula fail the plot)."""
    return visible(text).replace("$", r"\$")


# =============================================================================
# Reading logs
# =============================================================================
# A log is: [embedded source] RULE header RULE step lines [end-of-run lines].
# The public logs have the source stripped and end with `peak memory ...`;
# this repo's logs add explicit header fields and end with a `summary:` line.

# Every pattern over log text runs in time linear in the line: none can restart inside a run of characters
# it has already scanned (a lookbehind pins each start to the run's beginning) or rescan a run of blanks once
# per character before it (no lazy `.*?` followed by blanks). tests/test_records.py times each on 1 MB lines.
RULE_RE = re.compile(r"^={100}[ \t\r]*$", re.MULTILINE)
# The step line's groups are split one way only: blanks, then a key up to its ':', then a value up to blanks.
STEP_RE = re.compile(r"^step:(\d+)/(\d+)((?:[ \t]+[^\s:]+:\S*)*)[ \t]*$")
FIELD_RE = re.compile(r"(?<![^\s:])([^\s:]+):(\S*)")
HEADER_FIELD_RE = re.compile(r"(code_sha256|run_id|note):[ \t]*(.*)")   # the value less its trailing blanks
BUS_ID_RE = re.compile(r"\s+[0-9A-Fa-f]+:[0-9A-Fa-f:.]+\s")   # `   00000000:61:00.0 ` of an nvidia-smi row
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# `Sat Nov 15 15:50:24 2025` (nvidia-smi's clock line)
SMI_DATE_RE = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) \d\d:\d\d:\d\d (\d{4})\s*$")
# `device: cpu  world_size: 2  backend: gloo  date: 2026-11-22 03:40:12 UTC`: fields are split at two or more
# blanks before a `name:`, so a value may hold single blanks.
DEVICE_SPLIT_RE = re.compile(r"(?<![ \t])[ \t]{2,}(?=\w+:)")
DEVICE_KEYS = ("device", "world_size", "backend", "date")
# `attention: sdpa  lm_head: fp32  mlp up-projection: bf16 (...)  compile: off`: what the trainer resolved its
# `auto` settings to on the run's device, under the names of the hyperparameters they settle.
RESOLVED_KEYS = {"attention": "attention", "lm_head": "lm_head_precision", "mlp up-projection": "mlp_precision"}
BLANKS_RE = re.compile(r"[ \t]{2,}")
# Lines only a header holds: after the last RULE, they show a log whose second RULE is missing.
HEADER_ONLY_RE = re.compile(r"^(?:Running PyTorch |hyperparameters:|code_sha256:|run_id:)", re.MULTILINE)


@dataclass
class Log:
    path: Path
    run_id: str
    source: str | None              # embedded train_gpt.py; None when stripped
    code_hash: str | None           # sha256 of the source, else the declared one
    declared_hash: str | None       # `code_sha256:` header line
    python: str | None
    torch: str | None
    device: str                     # 'cuda', 'cpu' or 'unknown'
    gpu: str | None                 # GPU name from nvidia-smi
    world_size: int | None
    date: dt.date | None
    preset: str | None
    note: str | None                # e.g. "smoke preset ... NOT a record run"
    hyperparameters: dict[str, str]
    total_steps: int | None         # N of `step:i/N`
    last_step: int                  # highest step seen
    vals: list[tuple[int, float, float | None]]   # (step, val_loss, train_time_ms)
    final_val_loss: float | None    # val loss at step N: 0 to MAX_FINAL_LOSS
    train_time_ms: float | None     # of the whole run (or up to the last line if cut short): 0 to MAX_TIME_MS
    problems: list[str] = field(default_factory=list)   # empty for a complete, self-consistent log
    file_id: tuple[int, int] | None = None   # (device, inode): one file under two names is still one run
    steps_digest: str | None = None          # sha256 of the step lines: a renamed copy keeps them
    resolved: dict[str, str] = field(default_factory=dict)   # hyperparameter -> what the run resolved it to
    losses: tuple = ()              # (step, val_loss, train_loss) of each timed step line: what no header edit changes
    step_times: tuple = ()          # the train_time_ms of each of those lines, in order

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def complete(self) -> bool:
        return not self.problems


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# Every number is read from log text by one of these, once, in read_log: the Log holds only values they accept.

def parse_number(value: str) -> float | None:
    """`137554ms` -> 137554.0, `3.2754` -> 3.2754, `nan` -> nan; anything else -> None."""
    try:
        return float(value[:-2] if value.endswith("ms") else value)
    except ValueError:
        return None


def read_count(value: str | None) -> int | None:
    """A count the log states: ASCII digits, at most MAX_COUNT_DIGITS of them; anything else (a sign, `4_000`,
    5,000 digits) -> None."""
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdecimal()) or len(value) > MAX_COUNT_DIGITS:
        return None
    return int(value)


def read_time_ms(value: str) -> float | None:
    """A train time as logged (`5400ms`): from 0 to MAX_TIME_MS, else None. (A negative or infinite time once filed
    a record of -100.00 s; a NaN one passed verify, then stopped summarize with a traceback.)"""
    t = parse_number(value)
    return t if t is not None and 0 <= t <= MAX_TIME_MS else None


def is_time(value: str) -> bool:
    return read_time_ms(value) is not None


def parse_fields(text: str) -> dict[str, str]:
    """`key:value` pairs of a step or summary line, in any order, unknown keys kept."""
    return dict(FIELD_RE.findall(text))


@dataclass(frozen=True)
class StepLine:
    """One `step:i/N key:value ...` line, its numbers read: losses are numbers (nan and inf included, which a
    diverging run logs; find_problems refuses negative ones), train_time_ms is None unless it is a time."""
    step: int
    total: int
    fields: dict[str, str]
    val_loss: float | None
    train_loss: float | None
    train_time_ms: float | None


def parse_step_line(line: str) -> StepLine | str:
    """The StepLine of a `step:i/N key:value ...` line, or why it is malformed (a short phrase)."""
    m = STEP_RE.match(line)
    if not m:
        return "not step:i/N key:value ..."
    numbers = [read_count(m.group(i)) for i in (1, 2)]
    if None in numbers:
        digits = max(len(m.group(1)), len(m.group(2)))
        return f"a step number of {digits:,} digits (at most {MAX_COUNT_DIGITS})"
    fields = parse_fields(m.group(3))
    for key in ("val_loss", "train_loss", "train_time"):
        if key in fields and parse_number(fields[key]) is None:
            return f"{key} {shorten(fields[key], 20)} is not a number"
    losses = [parse_number(fields[key]) if key in fields else None for key in ("val_loss", "train_loss")]
    time = read_time_ms(fields["train_time"]) if "train_time" in fields else None
    return StepLine(*numbers, fields, *losses, time)


def parse_device_fields(line: str) -> dict[str, str]:
    """The known fields of a `device: cpu  world_size: 2  backend: gloo  date: ...` line; others are ignored."""
    fields = {}
    for part in DEVICE_SPLIT_RE.split(line):
        key, _, value = part.partition(":")
        if key in DEVICE_KEYS:
            fields[key] = value.strip(" \t")
    return fields


def parse_resolved(line: str) -> dict[str, str]:
    """`attention: sdpa  lm_head: fp32  mlp up-projection: bf16 (...)  compile: off` -> {"attention": "sdpa",
    "lm_head_precision": "fp32", "mlp_precision": "bf16"}: each value's first word, under its hyperparameter's name."""
    resolved = {}
    for part in BLANKS_RE.split(line.strip()):
        key, _, value = part.partition(":")
        if key in RESOLVED_KEYS and value.split():
            resolved[RESOLVED_KEYS[key]] = value.split()[0]
    return resolved


def parse_gpu_row(line: str) -> str | None:
    """The GPU name of an nvidia-smi GPU row, else None:
    `|   0  NVIDIA H100 80GB HBM3          On  |   00000000:61:00.0 Off |` -> `NVIDIA H100 80GB HBM3`."""
    cells = line.split("|", 2)
    if len(cells) < 3 or cells[0] or not cells[1][-1:].isspace() or not BUS_ID_RE.match(cells[2]):
        return None
    words = cells[1].split()   # index, name, persistence mode
    if len(words) < 3 or not words[0].isdecimal() or words[-1] not in ("On", "Off"):
        return None
    return " ".join(words[1:-1])


def parse_header(lines: list[str]) -> dict:
    """Fields of the lines between the two RULE lines (both formats). Hyperparameter names are kept as
    written: read_log checks them."""
    h: dict = {"hyperparameters": {}, "gpus": []}
    in_hparams = False
    for line in lines:
        if in_hparams and line.startswith("  ") and "=" in line:
            key, _, value = line.strip().partition("=")
            h["hyperparameters"][key.strip()] = value.strip()
            continue
        in_hparams = False
        if m := re.match(r"Running Python (\S+)", line):
            h["python"] = m.group(1)
        elif m := re.match(r"Running PyTorch (\S+)", line):
            h["torch"] = m.group(1)
        elif line.startswith("hyperparameters:"):
            in_hparams = True
        elif m := HEADER_FIELD_RE.match(line):
            h[m.group(1)] = m.group(2).rstrip()
        elif line.startswith("device:"):
            h.update(parse_device_fields(line))
        elif line.startswith("attention:"):
            h["resolved"] = parse_resolved(line)
        elif gpu := parse_gpu_row(line):
            h["gpus"].append(gpu)
        elif m := SMI_DATE_RE.match(line):
            h.setdefault("smi_date", dt.datetime.strptime(" ".join(m.groups()), "%b %d %Y").date())
    return h


def parse_body(lines: list[str], steps: int | None = None) -> dict:
    """Step lines and end-of-run lines after the second RULE line. A step line is kept only within its run: its
    step at most its total, and that total the header's num_iterations (`steps`) where the header has one; the
    others are listed in "beyond" (see missing_from)."""
    b: dict = {"steps": [], "malformed": [], "beyond": [], "summary": None, "peak": None, "error": None,
               "resumed": None, "step_lines": []}
    for line in lines:
        if line.startswith("step:"):
            b["step_lines"].append(line.rstrip())
            parsed = parse_step_line(line)
            if isinstance(parsed, str):
                b["malformed"].append((line, parsed))
            elif parsed.step > parsed.total or (steps is not None and parsed.total != steps):
                b["beyond"].append(line)
            else:
                b["steps"].append(parsed)
        elif line.startswith("summary:"):
            b["summary"] = parse_fields(line[len("summary:"):])
        elif line.startswith("peak memory"):
            b["peak"] = line
        elif line.startswith("error:") and b["error"] is None:
            b["error"] = line
        elif m := re.match(r"resumed from .* at step (\d+)", line):
            b["resumed"] = read_count(m.group(1))
            if b["resumed"] is None:
                b["malformed"].append((line, f"a step number of {len(m.group(1)):,} digits (at most "
                                             f"{MAX_COUNT_DIGITS})"))
    return b


def header_rule(text: str) -> re.Match | None:
    """The RULE line that starts a log's header and ends its embedded source, or None when the log has none.

    Found from the log's structure, from its end, where a source cannot reach: the header lies between the last two
    RULE lines, or after the last when header lines follow it (a log whose second RULE is missing). Never from a
    hash the log declares: its author writes that too. (Three lines prepended to a log, a docstring, a RULE and
    `code_sha256:` with the docstring's hash, once made those 7 bytes the "source" of logs with edited code.) A
    source may hold RULE lines of its own, a docstring's underline: they stay in the source, whose hash then
    decides whether the log is as its trainer wrote it (find_problems)."""
    rules = list(RULE_RE.finditer(text))
    if not rules:
        return None
    if len(rules) == 1 or HEADER_ONLY_RE.search(text, rules[-1].end()):
        return rules[-1]
    return rules[-2]


def read_log(path: str | Path) -> Log:
    """The one reader of a log file, for every subcommand: its source, header, step lines and summary, each number
    read once (read_count, read_time_ms, parse_step_line), so that the Log holds only values in range (counts of at
    most MAX_COUNT_DIGITS digits, times from 0 to MAX_TIME_MS, a final val loss from 0 to MAX_FINAL_LOSS); what a
    log states beyond that is one of its problems.
    Raises ToolError, one line, when the file is not a speedrun log at all."""
    path = Path(path)
    try:   # the one reader: a regular file (a FIFO blocked the read, /dev/zero never ended it), of a bounded size
        with safe_write.open_regular(path, "a speedrun log", MAX_LOG_BYTES) as f:
            st = os.fstat(f.fileno())
            data = f.read(MAX_LOG_BYTES + 1)
    except safe_write.FileRefused as e:
        raise ToolError(str(e)) from None
    except OSError as e:
        raise ToolError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_LOG_BYTES:   # grew since its size was read
        raise ToolError(f"{path}: not a speedrun log (over {MAX_LOG_BYTES >> 20} MiB; a log is at most that)")
    if not data.strip():
        raise ToolError(f"{path}: not a speedrun log (empty file)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path}: not a speedrun log (not UTF-8 text)") from None
    rule = header_rule(text)
    if rule is None:
        raise ToolError(f"{path}: not a speedrun log (no line of 100 '=')")

    # Everything after the text's last newline is a line the writer never finished.
    lines = [ln.rstrip("\r") for ln in text[rule.end():].split("\n")[1:]]
    if lines and max(map(len, lines)) > MAX_LINE_CHARS:
        at = next(i for i, ln in enumerate(lines) if len(ln) > MAX_LINE_CHARS)
        number = text.count("\n", 0, rule.start()) + 2 + at   # in the file, the RULE line's number + 1 + at
        raise ToolError(f"{path}: not a speedrun log (line {number} has {len(lines[at]):,} characters; a log's "
                        f"lines have at most {MAX_LINE_CHARS:,})")
    cut = lines.pop() if lines else ""
    second = next((i for i, ln in enumerate(lines) if ln.rstrip() == RULE), None)
    if second is None:  # tolerate a missing second RULE: the header ends at the first step line
        second = next((i for i, ln in enumerate(lines) if ln.startswith("step:")), len(lines))
        header, body_lines = lines[:second], lines[second:]
    else:
        header, body_lines = lines[:second], lines[second + 1:]
    h = parse_header(header)
    body = parse_body(body_lines, read_count(h["hyperparameters"].get("num_iterations")))
    if not (body["steps"] or body["malformed"] or body["beyond"]) and "torch" not in h and "code_sha256" not in h:
        raise ToolError(f"{path}: not a speedrun log (no 'step:N/M' lines and no 'Running PyTorch' header)")

    source = text[:rule.start()] or None
    declared = h.get("code_sha256")
    early = []   # problems found before the Log exists
    if declared is not None and not SHA256_RE.fullmatch(declared):
        early.append(f"code_sha256 line holds {shorten(declared)}, not a sha256 (64 hex digits)")
        declared = None
    # A writer that print()s a source ending in a newline adds one more: the hash says only whether that newline
    # ends the source, never where the source ends (header_rule).
    if source and declared and sha256_text(source) != declared and source.endswith("\n") \
            and sha256_text(source[:-1]) == declared:
        source = source[:-1]
    hparams = h["hyperparameters"]
    early += hyperparameter_name_problems(hparams, source)   # and drops the names it refuses
    summary = body["summary"] or {}
    extended = bool(body["summary"] or hparams or {"device", "run_id", "code_sha256"} & h.keys())

    # Hardware: explicit fields (`device: cuda (NVIDIA H100 80GB HBM3)`) win over what nvidia-smi shows.
    m = re.match(r"([a-z]+)(?::\d+)?\s*(?:\((.*)\))?", h.get("device") or summary.get("device") or "")
    device = m.group(1) if m else ("cuda" if h["gpus"] else "unknown")
    world_size = read_count(summary.get("world_size")) or read_count(h.get("world_size")) or (len(h["gpus"]) or None)
    gpus = sorted(set(h["gpus"]))
    gpu = None
    if device == "cuda":
        gpu = (m and m.group(2)) or ", ".join(gpus) or "unknown GPU"
    date = h.get("smi_date")
    if h.get("date"):
        try:
            date = dt.date.fromisoformat(h["date"][:10])
        except ValueError:
            pass

    steps = body["steps"]
    totals = sorted({line.total for line in steps})
    total = totals[-1] if totals else None
    vals = [(line.step, line.val_loss, line.train_time_ms) for line in steps if line.val_loss is not None]
    final = next((v for s, v, _ in vals if s == total), None)
    times = [line.train_time_ms for line in steps if line.train_time_ms is not None]
    train_time = next((t for s, _, t in vals if s == total), None)
    if "train_time" in summary:   # find_problems refuses one that is no time
        train_time = read_time_ms(summary["train_time"])
    elif train_time is None and times:
        train_time = times[-1]
    timed = [line for line in steps if line.step > 0]   # step 0's val loss is the same whatever the seed

    log = Log(path=path, run_id=h.get("run_id") or path.stem, source=source,
              code_hash=sha256_text(source) if source else declared, declared_hash=declared,
              python=h.get("python"), torch=h.get("torch"), device=device, gpu=gpu,
              world_size=world_size, date=date, preset=hparams.get("preset"), note=h.get("note"),
              hyperparameters=hparams, total_steps=total, last_step=max((line.step for line in steps), default=0),
              vals=vals, final_val_loss=final, train_time_ms=train_time, resolved=h.get("resolved", {}),
              losses=tuple((line.step, loss_key(line.val_loss), loss_key(line.train_loss)) for line in timed),
              step_times=tuple(line.train_time_ms for line in timed))
    log.problems = early + find_problems(log, body, cut, extended, totals)
    if log.final_val_loss is not None and not 0 <= log.final_val_loss <= MAX_FINAL_LOSS:
        log.final_val_loss = None   # a problem says why: no statistic reads it
    log.file_id = (st.st_dev, st.st_ino)
    # Only timed steps identify a run: two runs that stopped after step 0 can print the same line.
    if log.last_step > 0:
        log.steps_digest = sha256_text("\n".join(body["step_lines"]))
    return log


def loss_key(value: float | None):
    """A loss as duplicates are compared: nan equal to nan (a float nan is equal to nothing)."""
    return "nan" if value is not None and math.isnan(value) else value


def shorten(text: str, limit: int = 60) -> str:
    """repr of text, cut to about `limit` characters: names a value in a one-line message."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text):,} characters)"


_fields_of: dict[str, frozenset[str] | None] = {}   # sha256 of a source -> hyperparameter_fields(source)


def hyperparameter_fields(source: str) -> frozenset[str] | None:
    """The fields of the `Hyperparameters` dataclass of a train_gpt.py source: the names its log header
    lists (the trainer logs dataclasses.asdict). Read with ast, so nothing is imported or run; None when
    the source does not parse or defines no such class."""
    key = sha256_text(source)
    if key not in _fields_of:
        _fields_of[key] = None
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        for node in tree.body:   # the last definition is the one Python keeps
            if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
                _fields_of[key] = frozenset(
                    stmt.target.id for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and not names_class_or_init_var(stmt.annotation))
    return _fields_of[key]


def names_class_or_init_var(annotation: ast.AST) -> bool:
    """Whether an annotation names ClassVar or InitVar (no dataclass field), also inside a string. Walked with
    ast.walk, which keeps no stack: ast.unparse recursed, and a log's deeply nested annotation (a.a.a...) raised
    RecursionError in every subcommand that read it, `table` included."""
    words = re.compile(r"\b(?:ClassVar|InitVar)\b")
    return any(isinstance(node, ast.Name) and words.fullmatch(node.id)
               or isinstance(node, ast.Attribute) and words.fullmatch(node.attr)
               or isinstance(node, ast.Constant) and isinstance(node.value, str) and words.search(node.value)
               for node in ast.walk(annotation))


def defined_hyperparameters(source: str | None) -> tuple[frozenset[str] | None, str]:
    """(the hyperparameter names the code behind a log defines, which code that is, in words): the log's
    embedded source, else (stripped, or a stand-in without the class) the repository's train_gpt.py.
    Without names, the words say why."""
    if source is not None and (fields := hyperparameter_fields(source)) is not None:
        return fields, "its embedded train_gpt.py"
    why = "its source is stripped" if source is None else "its embedded source has no Hyperparameters"
    code = f"{TRAINER} ({why})"
    try:
        fields = hyperparameter_fields(safe_write.read_regular(TRAINER, "train_gpt.py", MAX_LOG_BYTES).decode("utf-8"))
    except safe_write.FileRefused as e:
        return None, f"{code}: {e.why}"
    except UnicodeDecodeError:
        return None, f"{code}: not UTF-8 text"
    return fields, code if fields is not None else f"{code} defines no Hyperparameters"


def hyperparameter_name_problems(hparams: dict[str, str], source: str | None) -> list[str]:
    """A problem for header names that are not identifiers, and one for names the log's code does not
    define; both kinds are removed from hparams, so that no later step (the README's rerun command above
    all) sees them."""
    if not hparams:
        return []
    fields, code = defined_hyperparameters(source)
    if fields is None:
        return [f"cannot check the header's hyperparameter names: {code}"]
    problems = []
    for kind, bad in (("which is not an identifier", [k for k in hparams if not k.isidentifier()]),
                      (f"which {code} does not define", [k for k in hparams if k.isidentifier() and k not in fields])):
        if bad:
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            problems.append(f"header names hyperparameter {shorten(bad[0])}{more}, {kind}")
        for k in bad:
            del hparams[k]
    return problems


# =============================================================================
# Completeness and integrity
# =============================================================================

# Step numbers come from the log: a forged `step:10000000000/30` once made every subcommand build a set of 10**10
# integers. Step lines are bounded by the header's num_iterations where it has one (read_log), and what is missing
# is counted with arithmetic over the numbers present, never by listing every step from 0 to N.

def missing_from(present: list[int], start: int, stop: int, every: int = 1, limit: int = 5) -> tuple[int, list[int]]:
    """(how many of the multiples of `every` in [start, stop) are not in present, the first `limit` of them), in
    time linear in len(present) whatever stop is."""
    if every <= 0 or stop <= start:
        return 0, []
    first = -(-start // every) * every
    expected = max(0, -(-(stop - first) // every))
    found = sorted({s for s in present if start <= s < stop and s % every == 0})
    shown, index, step = [], 0, first
    while len(shown) < limit and step < stop:
        while index < len(found) and found[index] < step:
            index += 1
        if index < len(found) and found[index] == step:
            index += 1
        else:
            shown.append(step)
        step += every
    return expected - len(found), shown


def val_every(total: int, every: int | None, seen: list[int]) -> int:
    """The validation period: `val_loss_every`, or without it (public logs) the gcd of the inner steps seen;
    0 when only step 0 and the last are validated."""
    if every is None:
        inner = [s for s in seen if 0 < s < total]
        every = math.gcd(*inner) if inner else 0
    return every


def _some(count: int, shown: list[int]) -> str:
    return ", ".join(map(str, shown)) + (f", ... ({count} in all)" if count > len(shown) else "")


def is_cross_entropy(value: float | None) -> bool:
    """A number a cross-entropy can be: >= 0, or nan or inf, which a diverging run logs before it stops."""
    return value is not None and not value < 0


NO_TIME = f"cannot be a train time (one is from 0 to {MAX_TIME_MS:.0e} ms)"


def find_problems(log: Log, body: dict, cut: str, extended: bool, totals: list[int]) -> list[str]:
    """One short reason per way the log is incomplete or edited; [] when it is sound."""
    problems = []
    if cut.strip():
        problems.append(f"last line is cut off (no newline at the end): {cut[:40]!r}")
    if body["malformed"]:
        line, why = body["malformed"][0]
        problems.append(f"malformed step line {shorten(line, 60)}: {why}"
                        + (f" (+{len(body['malformed']) - 1} more)" if len(body["malformed"]) > 1 else ""))
    if body["beyond"]:
        bound = f"the header's num_iterations, {log.hyperparameters['num_iterations']}" \
            if "num_iterations" in log.hyperparameters else "its own total"
        problems.append(f"step line outside the run ({bound}): {shorten(body['beyond'][0], 60)}"
                        + (f" (+{len(body['beyond']) - 1} more)" if len(body["beyond"]) > 1 else ""))
    if len(totals) > 1:
        problems.append(f"step lines disagree on the number of steps: {totals}")
    if log.total_steps is None:
        problems.append("no step lines")
        return problems

    # A cross-entropy is >= 0 (nothing bounds it above: a diverging run's grows). A log with a negative loss was
    # edited (three logs at -5.1, -5.2 and -5.3 once passed at p = 2.3e-5), or written by something that computes
    # no cross-entropy: it fails, and no number in it is used.
    impossible = [(line.step, key, line.fields[key]) for line in body["steps"] for key in ("val_loss", "train_loss")
                  if key in line.fields and not is_cross_entropy(parse_number(line.fields[key]))]
    if impossible:
        step, key, value = impossible[0]
        problems.append(f"{key} {shorten(value, 20)} at step {step} cannot be a cross-entropy (one is >= 0)"
                        + (f" (+{len(impossible) - 1} more)" if len(impossible) > 1 else ""))
    # Nor can a time be negative, infinite or NaN: the same rule, for the numbers the speed claims rest on.
    untimed = [(line.step, line.fields["train_time"]) for line in body["steps"]
               if "train_time" in line.fields and not is_time(line.fields["train_time"])]
    if untimed:
        step, value = untimed[0]
        problems.append(f"train_time {shorten(value, 20)} at step {step} {NO_TIME}"
                        + (f" (+{len(untimed) - 1} more)" if len(untimed) > 1 else ""))
    summary = body["summary"] or {}
    total, last = log.total_steps, log.last_step
    numbers = [line.step for line in body["steps"]]
    if any(b < a for a, b in zip(numbers, numbers[1:])):
        problems.append("step lines out of order (two runs appended to one file?)")
    # A failed or cut-short run lacks its final val loss and end line: one reason says it all.
    ended_early = body["error"] is not None or last < total
    if body["error"]:
        problems.append(f"run failed after step {last} of {total}: {body['error']}")
    elif last < total:
        problems.append(f"truncated: last step {last} of {total}")
    first = 1   # first step whose train line this log must hold
    if body["resumed"] is not None:   # this log cannot show the steps before the checkpoint
        first = body["resumed"] + 1
        problems.append(f"resumed from a checkpoint at step {body['resumed']}: steps 1..{body['resumed']} "
                        "are not in this log")
    count, shown = missing_from(numbers, first, last + 1)
    if count:
        problems.append(f"missing step lines: {_some(count, shown)}")
    val_steps = [s for s, _, _ in log.vals]
    val_from = 0 if body["resumed"] is None else first   # step 0 is validated too; the last step is checked below
    count, shown = missing_from(val_steps, val_from, last, val_every(total, read_count(log.hyperparameters.get(
        "val_loss_every")), val_steps))
    if count:
        problems.append(f"missing val_loss at steps {_some(count, shown)}")
    if not ended_early:
        if log.final_val_loss is None:
            problems.append(f"no final val_loss at step {total}")
        elif not math.isfinite(log.final_val_loss):
            problems.append(f"final val_loss at step {total} is {log.final_val_loss}")
        elif log.final_val_loss > MAX_FINAL_LOSS:
            problems.append(f"final val_loss at step {total} is {log.final_val_loss:g}, which no run ends at (at "
                            f"most {MAX_FINAL_LOSS:g})")
        if log.train_time_ms is None and not untimed and "train_time" not in summary:
            problems.append("no train_time for the run")
        if extended and body["summary"] is None:
            problems.append("no end-of-run 'summary:' line")
        elif not extended and body["peak"] is None:
            problems.append("no end-of-run 'peak memory' line")

    # The summary repeats numbers from the step lines: a disagreement means the log was edited.
    s_loss, s_steps = parse_number(summary.get("final_val_loss", "")), read_count(summary.get("steps"))
    if s_loss is not None and log.final_val_loss is not None and not abs(s_loss - log.final_val_loss) <= 1e-4:
        problems.append(f"summary final_val_loss {s_loss} disagrees with step {total} val_loss {log.final_val_loss}")
    if "steps" in summary and s_steps is None:
        problems.append(f"summary steps {shorten(summary['steps'], 20)} is not a step count")
    elif s_steps is not None and s_steps != total:
        problems.append(f"summary steps {s_steps} disagrees with the step lines ({total})")
    if "train_time" in summary and not is_time(summary["train_time"]):
        problems.append(f"summary train_time {shorten(summary['train_time'], 20)} {NO_TIME}")
    for name in ("num_iterations", "val_loss_every"):
        if name in log.hyperparameters and read_count(log.hyperparameters[name]) is None:
            problems.append(f"header's {name} {shorten(log.hyperparameters[name], 20)} is not a count (at most "
                            f"{MAX_COUNT_DIGITS} digits)")
    if log.hyperparameters.get("synthetic", "False").lower() in ("true", "1", "yes", "on"):
        problems.append("trained on synthetic tokens (a benchmark run): its val loss is not a FineWeb result")
    if log.source and log.declared_hash and sha256_text(log.source) != log.declared_hash:
        problems.append(f"edited: embedded source hashes to {sha256_text(log.source)[:12]}..., "
                        f"header says code_sha256 {log.declared_hash[:12]}...")
    return problems


# =============================================================================
# Several logs: distinct runs of one experiment
# =============================================================================
# n copies of one run are not n runs: they shrink the spread and fake a p-value.

# What a run computed identifies it: no header edit changes its losses. Two distinct runs tie at one logged loss now
# and then (4 decimals: for the speedrun's spread of final losses, about 0.0015, one tie in about 50 pairs), so a
# rule on losses alone needs several: at MIN_SAME_LOSSES values that all tie, distinct runs are about 1 in 100,000.
MIN_SAME_LOSSES = 3


def duplicate_reason(first: Log, later: Log) -> str | None:
    """Why `later` is the same run as `first`, or None. In order: the same file; the same run id; identical step
    lines (a renamed copy); the same seed and config (a rerun: one sample of the seeds, whatever its losses, which
    repeat up to the hardware's nondeterminism); the same losses at every validation and step line (same_losses: a
    copy whose seed, run id and times were edited, however its times drift); and for logs with too few losses to
    tell, the same losses with step times shifted by one constant (time_shift)."""
    if first.file_id is not None and first.file_id == later.file_id:
        return "the same file"
    why = []
    if first.run_id == later.run_id:
        why.append(f"same run id {first.run_id}")
    if first.steps_digest is not None and first.steps_digest == later.steps_digest:
        why.append("identical step lines")
    elif same_seed_and_config(first, later):
        why.append(f"same seed {first.hyperparameters['seed'].strip()} and config: one sample")
    elif count := same_losses(first, later):
        why.append(f"identical losses at all {count} logged values: one computation, whatever its times, seed and "
                   f"run id say")
    elif (shift := time_shift(first, later)) is not None:
        why.append("identical losses and step times" + (f", shifted by {shift:+g} ms" if shift else ""))
    return " and ".join(why) or None


def same_losses(first: Log, later: Log) -> int | None:
    """How many losses two logs hold, where they hold the same at every validation and step line (the same steps,
    each the same val and train loss or none) and at least MIN_SAME_LOSSES of them; else None. The rule for a copy:
    what a run computed, not what its header or times say (a copy of one run under another seed and run id, its
    times drifting by a growing 1-4 ms, was once a third sample: p 0.0024 -> 1.3e-5). Logs of other code (both
    hashes known, and different) are exempt: a change that keeps the math computes the same losses at other step
    times, and compare takes such runs as samples of time."""
    if first.code_hash and later.code_hash and first.code_hash != later.code_hash:
        return None
    if not first.losses or first.losses != later.losses:
        return None
    count = sum(loss is not None for _, val, train in first.losses for loss in (val, train))
    return count if count >= MIN_SAME_LOSSES else None


def time_shift(first: Log, later: Log) -> float | None:
    """How many ms later's step times lie after first's, where the two logs hold the same losses at the same timed
    steps and step times that differ by that one constant; else None. For logs with fewer than MIN_SAME_LOSSES
    losses (a run that logs only its final validation), where the losses alone cannot tell a copy from a tie, the
    times add what they can: a copy shifted by a constant is found, one whose times drift is not."""
    if not first.losses or first.losses != later.losses or len(first.step_times) != len(later.step_times):
        return None
    shifts = [b - a for a, b in zip(first.step_times, later.step_times) if a is not None and b is not None]
    if not shifts or any(abs(d - shifts[0]) > 1e-6 * max(1.0, abs(d)) for d in shifts):
        return None
    return shifts[0]


def same_seed_and_config(first: Log, later: Log) -> bool:
    """Whether two complete logs ran one code and config with one seed: a rerun of one sample (its losses repeat
    up to the hardware's nondeterminism), not another sample of the seeds. (An unfinished run is no sample.)"""
    seed = first.hyperparameters.get("seed")
    if seed is None or not (first.complete and later.complete):
        return False
    if later.hyperparameters.get("seed", "").strip() != seed.strip():
        return False
    return first.code_hash == later.code_hash and all(
        len(set(values)) == 1 for values in experiment_fields([first, later]).values())


def duplicates_line(logs: list[Log], labels: list[str] | None = None) -> str | None:
    """`duplicate runs: B duplicates A (why); ...`, one clause per log that repeats an earlier one; None if none."""
    labels = labels or [lg.name for lg in logs]
    clauses = []
    for j, later in enumerate(logs):
        for i in range(j):
            if why := duplicate_reason(logs[i], later):
                clauses.append(f"{labels[j]} is given twice" if labels[j] == labels[i]
                               else f"{labels[j]} duplicates {labels[i]} ({why})")
                break
    return "duplicate runs: " + "; ".join(clauses) if clauses else None


def distinct_runs(logs: list[Log]) -> list[Log]:
    """The logs less those that repeat an earlier one."""
    return [lg for j, lg in enumerate(logs) if not any(duplicate_reason(logs[i], lg) for i in range(j))]


# Hyperparameters a rerun of one experiment may change: the seed (what repeats vary), where files go,
# checkpointing and the device flag (the hardware is compared on its own).
FREE_FIELDS = {"seed", "run_id", "logs_dir", "checkpoint_dir", "resume", "force_resume", "save_every",
               "save_final", "pg_timeout_s", "device"}
# Shown first: the fields that most change what a run computes.
KEY_FIELDS = ["num_iterations", "world_size", "train_files", "val_files", "val_tokens", "val_seq_len",
              "repeat_data", "stage_batch_tokens", "micro_batches", "stage_max_seq_len",
              "batch_tokens", "micro_batch_tokens", "train_max_seq_len"]   # the last three: older trainers'


def canonical_micro_batches(value: str) -> str:
    """--micro_batches in one spelling per meaning, as train_gpt.py now logs it (this mirrors
    train_gpt.micro_batches_flag applied to the counts stage_micro_batches reads): one count when every
    stage has the same ("4,4,4" and " 4" -> "4"), else one per stage ("8,8,16"); "auto" and what the trainer
    would refuse are only stripped. Older logs wrote the setting as typed."""
    text = value.strip()
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        return text
    return str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))


# The list flags of train_gpt.py, each read into its values by the grammar of train_gpt.list_value (this is a copy:
# records.py does not import the trainer, which needs torch; tests/test_records_properties.py runs the same spellings
# through both). Two spellings of one value are one setting: "0.25,0.25>0.0,0" is "0.25,0.25>0,0", "1>1" is "1", a
# role's layers are a set. (The trainer refuses what this refuses, so a log it wrote holds only values this reads.)
LIST_FLAGS = {"stage_batch_tokens": "integers", "stage_max_seq_len": "integers", "stage_lr": "numbers",
              "stage_fractions": "numbers", "stage_windows": "windows", "extension_windows": "window",
              "stage_mtp_weights": "ramp lists", "stage_prefix_weights": "ramps",
              "stage_softmax_candidates": "counts", "skip_layers": "layer pair", "value_embed_layers": "integers",
              **{name: "layer set" for name in (
                  "no_attention_layers", "removed_layers", "paired_layers", "long_window_layers", "xsa_layers",
                  "attn_gate_layers", "dc_layers", "narrow_qk_layers", "narrow_value_layers", "parallel_mlp_layers",
                  "no_x0_layers", "no_bigram_layers")}}


def list_value(name: str, text: str) -> tuple:
    """The value of the list flag `name` (LIST_FLAGS) spelled `text`, as train_gpt.list_value reads it; a ValueError
    where the trainer refuses the spelling."""
    kind = LIST_FLAGS[name]

    def integers(part: str) -> tuple[int, ...]:
        return tuple(int(item) for item in part.split(",")) if part.strip() else ()

    def numbers(part: str) -> tuple[float, ...]:
        values = tuple(float(item) for item in part.split(","))
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("expected finite numbers >= 0")
        return values

    def pair(part: str, windows: bool) -> tuple[int, int]:
        first, colon, second = part.partition(":")
        values = (int(first), int(second))
        if not colon or windows and not 0 < values[0] <= values[1]:
            raise ValueError("expected short:long window blocks, positive and short <= long" if windows else
                             "expected source:target")
        return values

    def ramp(part: str) -> tuple[str, str]:
        start, arrow, end = part.partition(">")
        if arrow and not (start.strip() and end.strip()) or ">" in end:
            raise ValueError("a stage with nothing before or after its '>', or more than one")
        return start, end if arrow else start

    if kind in ("integers", "layer set"):
        values = integers(text)
        return tuple(sorted(set(values))) if kind == "layer set" else values
    if kind == "numbers":
        return numbers(text)
    if kind == "windows":
        return tuple(pair(part, windows=True) for part in text.split(","))
    if kind in ("window", "layer pair"):
        return pair(text, windows=kind == "window")
    if kind == "counts":
        counts = tuple(tuple(int(item) for item in part.split("|")) for part in text.split(","))
        if min(min(entry) for entry in counts) < 0:
            raise ValueError("counts must be 0 or positive")
        return counts
    if kind == "ramps":  # a stage: one number, start>end, or a|b|c (one number an equal part)
        return tuple((tuple(numbers(item)[0] for item in part.split("|")), True) if "|" in part else
                     (tuple(numbers(side)[0] for side in ramp(part)), False) for part in text.split(","))
    stages = tuple(tuple(numbers(side) for side in ramp(part)) for part in text.split("/"))
    if any(len(start) != len(end) for start, end in stages):
        raise ValueError("each stage needs as many weights after '>' as before it")
    return stages


def number_text(value: float) -> str:
    """A number as list_text spells it: 1.0 as 1, 0.25 as 0.25 (repr: every float reads back as itself)."""
    return str(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)


def list_text(name: str, value: tuple) -> str:
    """One spelling of each value of the list flag `name` (list_value's inverse): what experiments are compared
    and shown by. A stage's weight that does not move is one number ("1", not "1>1")."""
    kind = LIST_FLAGS[name]

    def ramp(start: tuple, end: tuple) -> str:
        both = [",".join(map(number_text, side)) for side in (start, end)]
        return both[0] if start == end else ">".join(both)

    if kind in ("integers", "layer set"):
        return ",".join(map(str, value))
    if kind == "numbers":
        return ",".join(map(number_text, value))
    if kind == "windows":
        return ",".join(f"{a}:{b}" for a, b in value)
    if kind in ("window", "layer pair"):
        return f"{value[0]}:{value[1]}"
    if kind == "counts":
        return ",".join("|".join(map(str, entry)) for entry in value)
    if kind == "ramps":
        return ",".join("|".join(map(number_text, weights)) if parts else ramp((weights[0],), (weights[1],))
                        for weights, parts in value)
    return "/".join(ramp(start, end) for start, end in value)


def experiment_value(name: str, log: Log) -> str | None:
    """A hyperparameter's value in a log as experiments are compared: settings that train identically are equal,
    each as the trainer settled it. --attention, --lm_head_precision and --mlp_precision are what the header's
    `attention:` line says the run used (train_gpt.resolve_attention and resolve_precision; records.py reads the
    log rather than importing the trainer, which needs torch); where a log has no such line, an "auto" is resolved
    on the device the log ran on where that device alone decides it: --device, --attention (flex on a GPU, sdpa on
    a CPU) and the precisions on a CPU (fp32; on a GPU, auto is fp8 or bf16 by the card). --micro_batches and the
    list flags (LIST_FLAGS: the stage schedule, the layer roles) are compared in one spelling of their values. So on
    a CPU, --mlp_precision=fp32 and auto are one setting, and --stage_prefix_weights=0.25,0.25>0.0,0 is the default."""
    value = log.hyperparameters.get(name)
    if value is None:
        return None
    if name in log.resolved:
        return log.resolved[name]
    if name == "micro_batches":
        return canonical_micro_batches(value)
    if name in LIST_FLAGS:
        try:
            return list_text(name, list_value(name, value))
        except ValueError:   # not a spelling the trainer takes: compared as written
            return value.strip()
    if value.strip() == "auto" and log.device in ("cpu", "cuda"):
        if name == "device":
            return log.device
        if name == "attention":
            return "flex" if log.device == "cuda" else "sdpa"
        if name in ("lm_head_precision", "mlp_precision") and log.device == "cpu":
            return "fp32"
    return value


def experiment_fields(logs: list[Log]) -> dict[str, list[str | None]]:
    """Field -> its value in each log (None: not logged), for every field that defines the experiment.
    num_iterations is the N of the step lines. Logs without a hyperparameters section (the public
    logs) show no batch size, and the code behind them may scale it with the world size: for them
    the world size is part of the experiment."""
    fields: dict[str, list[str | None]] = {
        "num_iterations": [None if lg.total_steps is None else str(lg.total_steps) for lg in logs]}
    if any(not lg.hyperparameters for lg in logs):
        fields["world_size"] = [None if lg.world_size is None else str(lg.world_size) for lg in logs]
    names = set().union(*(lg.hyperparameters for lg in logs)) - FREE_FIELDS - fields.keys()
    for name in sorted(names, key=lambda n: (KEY_FIELDS.index(n) if n in KEY_FIELDS else len(KEY_FIELDS), n)):
        fields[name] = [experiment_value(name, lg) for lg in logs]
    return fields


def experiment_differences(logs: list[Log]) -> dict[str, dict[str | None, list[Log]]]:
    """Field -> {value: logs with it}, for the experiment fields whose value is not the same in every log."""
    out = {}
    for name, values in experiment_fields(logs).items():
        if len(set(values)) > 1:
            groups: dict[str | None, list[Log]] = {}
            for value, lg in zip(values, logs):
                groups.setdefault(value, []).append(lg)
            out[name] = groups
    return out


def differs_text(name: str, groups: dict[str | None, list[Log]], name_of=lambda lg: lg.name, text=visible) -> str:
    """`batch_tokens is 2048 in a.txt, b.txt; 4096 in c.txt`; `text` renders each name and value (md_text
    for a README)."""
    def shown(v):
        return "not logged" if v is None else text(repr(v) if v == "" else v)
    return f"{text(name)} is " + "; ".join(f"{shown(v)} in {', '.join(text(name_of(lg)) for lg in lgs)}"
                                         for v, lgs in groups.items())


def parse_allowed(values: list[str] | None, logs: list[Log]) -> set[str]:
    """The fields of --allow-differences (repeatable, comma-separated); a name no log records is a typo."""
    allowed = {name.strip() for value in values or [] for name in value.split(",") if name.strip()}
    known = {"num_iterations", "world_size"}.union(*(lg.hyperparameters for lg in logs))
    unknown = sorted(allowed - known)
    if unknown:
        raise ToolError(f"--allow-differences: no log records a field {unknown[0]!r} (the fields are the "
                        "hyperparameter names in the logs' headers, num_iterations and world_size)")
    return allowed


def experiment_fails(logs: list[Log], allowed: set[str], limit: int = 5) -> list[str]:
    """One FAIL line per experiment field that differs and is not allowed to (the rest named in one more)."""
    shown = [(name, groups) for name, groups in experiment_differences(logs).items() if name not in allowed]
    fails = [f"FAIL not the same experiment: {differs_text(name, groups)} "
             f"(--allow-differences={name} if that is intended)" for name, groups in shown[:limit]]
    if len(shown) > limit:
        fails.append(f"FAIL not the same experiment: {len(shown) - limit} more fields differ: "
                     + ", ".join(name for name, _ in shown[limit:]))
    return fails


# =============================================================================
# Hardware and tracks
# =============================================================================
# Results are only comparable on the same hardware, so every table is split by it,
# and the labels come from the logs, never from what a submitter types.

def hardware_key(log: Log) -> tuple:
    return (log.device, log.gpu if log.device == "cuda" else None, log.world_size)


def hardware_label(log: Log) -> str:
    """Short label: `8×H100`, `2×CPU`."""
    n = log.world_size if log.world_size is not None else "?"
    if log.device == "cpu":
        return f"{n}×CPU"
    if log.device == "cuda":
        m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", log.gpu or "")
        return f"{n}×{m.group(1) if m else (log.gpu or 'GPU').replace('NVIDIA ', '')}"
    return f"{n}×unknown device"


def hardware_long(log: Log) -> str:
    """`8×H100 (NVIDIA H100 80GB HBM3, world size 8)`, `2×CPU (world size 2)`."""
    gpu = f"{log.gpu}, " if log.device == "cuda" else ""
    return f"{hardware_label(log)} ({gpu}world size {log.world_size})"


def default_track(log: Log) -> str:
    """The hardware label, plus the preset when the log itself says it is not a record run."""
    return hardware_label(log) + (f" {log.preset}" if log.note and log.preset else "")


COUNT_RE = re.compile(r"(?<!\d)(\d+)\s*[x×]")   # `8x`, `8 ×`; a run of digits is tried once, from its start


def track_conflict(track: str, log: Log) -> str | None:
    """Why a track name claims hardware the logs did not run on, or None."""
    words = track.lower()
    counts = COUNT_RE.findall(words)
    rest = COUNT_RE.sub(" ", words)
    where = f"the logs ran on {hardware_label(log)}"
    if re.search(r"\bcpu\b", rest) and log.device != "cpu":
        return f"track {track!r} names CPU but {where}"
    if re.search(r"\bgpus?\b", rest) and log.device != "cuda":
        return f"track {track!r} names a GPU but {where}"
    for model in re.findall(r"[a-z]{1,2}\d{2,4}[a-z]?", rest):
        if log.device != "cuda" or model not in (log.gpu or "").lower():
            return f"track {track!r} names {model.upper()} but {where}"
    for n in counts:
        if int(n) != log.world_size:
            return f"track {track!r} names {n} devices but {where}"
    return None


# =============================================================================
# Statistics: Student's t without scipy
# =============================================================================
# P(T > t) = I_x(df/2, 1/2) / 2 with x = df / (df + t^2), where I is the regularized
# incomplete beta function, evaluated by its continued fraction (modified Lentz).
# Quantiles invert the tail by bisection, which cannot diverge.

def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction 1/(1+ d1/(1+ d2/(1+ ...))) of I_x(a, b)."""
    tiny = 1e-300
    f, c, d = tiny, tiny, 0.0
    for j in range(1, 100_000):
        if j == 1:
            aj = 1.0
        else:
            k = j - 1
            m = k // 2
            if k % 2:   # d_{2m+1}
                aj = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
            else:       # d_{2m}
                aj = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + aj * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aj / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1.0) < 1e-16:
            return f
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularized incomplete beta I_x(a, b); y = 1 - x is passed in to keep its precision."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(a * math.log(x) + b * math.log(y) - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):   # the fraction converges fast on this side
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, y) / b


def _t_sf_pure(t: float, df: float) -> float:
    """P(T > t) for Student's t with df degrees of freedom."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return math.nan
    t2 = t * t
    if math.isinf(t2):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))
    return tail if t >= 0 else 1.0 - tail


def _t_ppf_pure(p: float, df: float) -> float:
    """t with P(T <= t) = p."""
    if not 0.0 < p < 1.0:
        return {0.0: -math.inf, 1.0: math.inf}.get(p, math.nan)
    q = min(p, 1.0 - p)             # solve in the upper tail, then mirror
    if q == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while _t_sf_pure(hi, df) > q:
        lo, hi = hi, hi * 2.0
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if _t_sf_pure(mid, df) > q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    t = 0.5 * (lo + hi)
    return t if p > 0.5 else -t


_stats = ...   # scipy.stats once looked up, None without scipy (tests set None to force the fallback)


def _scipy_stats():
    """scipy is optional and slow to import: look it up on first use only."""
    global _stats
    if _stats is ...:
        try:
            from scipy import stats as _stats
        except ImportError:
            _stats = None
    return _stats


def t_sf(t: float, df: float) -> float:
    if _scipy_stats() is not None:
        return float(_stats.t.sf(t, df))
    return _t_sf_pure(t, df)


def t_cdf(t: float, df: float) -> float:
    return t_sf(-t, df)


def t_ppf(p: float, df: float) -> float:
    if _scipy_stats() is not None:
        return float(_stats.t.ppf(p, df))
    return _t_ppf_pure(p, df)


# A t-test needs a spread it can measure. Logs print losses to 4 decimals, so runs whose losses tie there (or
# one run filed under several seeds' names) show a spread of 0, and t = -inf made p = 0 and "met" out of no
# evidence. Without a spread there is no test: the target is not met (target_rule says why), and compare says
# it cannot tell. Runs of one seed and config are one sample (duplicate_reason), not several.

def one_sample_less(xs: list[float], target: float) -> tuple[float, int, float] | None:
    """One-sided one-sample t-test, H1: mean < target. (t, df, p); None for n < 2 and for values without spread."""
    n = len(xs)
    if n < 2:
        return None
    mean, sd = statistics.fmean(xs), statistics.stdev(xs)
    if sd == 0.0:
        return None
    t = (mean - target) / (sd / math.sqrt(n))
    return t, n - 1, t_cdf(t, n - 1)


@dataclass
class Welch:
    diff: float     # mean(b) - mean(a)
    lo: float       # confidence interval of diff
    hi: float
    t: float
    df: float
    p_less: float   # one-sided p for H1: mean(b) < mean(a)


def welch(a: list[float], b: list[float], confidence: float = 1 - ALPHA) -> Welch:
    """Welch's unequal-variance t-test of mean(b) - mean(a), Welch-Satterthwaite df."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(b) - statistics.fmean(a)
    se = math.sqrt(va + vb)
    if se == 0.0:   # both groups without spread: no test (see one_sample_less)
        return Welch(diff, math.nan, math.nan, math.nan, math.nan, math.nan)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_ppf(1 - (1 - confidence) / 2, df) * se
    t = diff / se
    return Welch(diff, diff - half, diff + half, t, df, t_cdf(t, df))


# =============================================================================
# Group statistics and formatting
# =============================================================================

@dataclass
class Stats:
    n: int
    val_mean: float
    val_std: float          # sample std (ddof=1); nan for one run
    test: tuple | None      # one_sample_less(...)
    target: float
    met: bool               # the target rule (see target_rule)
    times: list[float]      # seconds


def group_stats(logs: list[Log], target: float) -> Stats:
    vals = [lg.final_val_loss for lg in logs]
    test = one_sample_less(vals, target)
    mean = statistics.fmean(vals)
    met = test[2] < ALPHA if test else len(vals) == 1 and mean <= target
    return Stats(len(vals), mean, statistics.stdev(vals) if len(vals) > 1 else math.nan,
                 test, target, met, [lg.train_time_ms / 1000 for lg in logs])


def target_rule(st: Stats) -> str:
    """One line: is the val-loss target met, and by which rule."""
    if st.test is None and st.n > 1:
        return (f"target {st.target:g}: no t-test: the {st.n} runs' final val losses have no spread (all "
                f"{st.val_mean:.4f}), so nothing says their mean is below {st.target:g} -> NOT met (runs whose "
                f"losses differ are needed)")
    if st.test is None:
        verdict = "met" if st.met else "NOT met"
        return (f"target {st.target:g}: single run, final val loss {st.val_mean:.4f} "
                f"{'<=' if st.met else '>'} {st.target:g} -> {verdict} (no t-test with one run)")
    t, df, p = st.test
    verdict = f"met at p < {ALPHA:g}" if st.met else f"NOT met at p < {ALPHA:g}"
    return (f"target {st.target:g}: one-sided t-test, H1 mean < {st.target:g}: "
            f"t = {t:.3f}, df = {df}, p = {fmt_p(p)} -> {verdict}")


def time_line(st: Stats) -> str:
    ts = st.times
    sd = f" ± {statistics.stdev(ts):.3f} s" if len(ts) > 1 else ""
    return (f"train time: mean {statistics.fmean(ts):.3f} s{sd}, median {statistics.median(ts):.3f} s, "
            f"min {min(ts):.3f} s, max {max(ts):.3f} s")


def val_line(st: Stats) -> str:
    sd = f" ± {st.val_std:.5f} (sample std, n = {st.n})" if st.n > 1 else " (n = 1)"
    return f"final val loss: mean {st.val_mean:.5f}{sd}"


def code_line(logs: list[Log]) -> str:
    hashes = Counter(lg.code_hash for lg in logs)
    parts = []
    for h, n in hashes.most_common():
        if h is None:
            parts.append(f"not embedded (source stripped) in {n} log(s)")
        else:
            verified = all(lg.source is not None for lg in logs if lg.code_hash == h)
            parts.append(f"sha256 {h} in {n} log(s)" + ("" if verified else " (declared, source stripped)"))
    return "code: " + "; ".join(parts)


def fmt_p(p: float) -> str:
    return f"{p:.2e}" if p < 1e-4 else f"{p:.4f}"


def fmt_opt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def run_rows(logs: list[Log]) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "steps", "final val loss", "train time (s)", "step avg (ms)", "world size", "GPU", "PyTorch"]
    rows = []
    for lg in logs:
        steps = str(lg.total_steps) if lg.last_step == lg.total_steps else f"{lg.last_step}/{lg.total_steps}"
        seconds = lg.train_time_ms / 1000 if lg.train_time_ms is not None else None
        step_avg = lg.train_time_ms / max(lg.last_step, 1) if lg.train_time_ms is not None else None
        rows.append([lg.run_id, steps, fmt_opt(lg.final_val_loss, ".4f"), fmt_opt(seconds, ".3f"),
                     fmt_opt(step_avg, ".2f"), fmt_opt(lg.world_size, "d"),
                     lg.gpu if lg.device == "cuda" else lg.device, lg.torch or "-"])
    return headers, rows


def text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def load_logs(paths: list[str]) -> list[Log]:
    return [read_log(p) for p in paths]


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def why_not_written(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full: {error.strerror}"
    return error.strerror or str(error)


def read_input(path: Path, what: str, limit: int) -> bytes:
    """A file this tool reads whole, through the one reader (safe_write.read_regular: a regular file of at most
    limit bytes, opened without blocking); a ToolError says why not."""
    try:
        return safe_write.read_regular(path, what, limit)
    except safe_write.FileRefused as e:
        raise ToolError(str(e)) from None


def write_output(path: Path, data: bytes, shown: Path | None = None) -> None:
    """Writes data to path through the one writer (safe_write.write_file: a regular file or nothing there, a
    temporary unique to the call renamed over it); a refusal or a failed write (a full disk) is a ToolError naming
    `shown`, the name the user knows the file by, else path."""
    try:
        safe_write.write_file(path, data, shown)
    except (safe_write.FileRefused, safe_write.WriteError) as e:
        raise ToolError(str(e)) from None


def make_dirs(path: Path) -> None:
    """mkdir -p, each new folder 0755 whatever the umask."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(exist_ok=True)
            os.chmod(folder, 0o755)
        except OSError as e:
            raise ToolError(f"{folder}: cannot create ({why_not_written(e)})") from None


# =============================================================================
# summarize
# =============================================================================

def cmd_summarize(args) -> int:
    logs = load_logs(args.logs)
    if dup := duplicates_line(logs):
        raise ToolError(dup)
    headers, rows = run_rows(logs)
    print(text_table(headers, rows, right={1, 2, 3, 4, 5}))
    print()
    good = [lg for lg in logs if lg.complete]
    for lg in logs:
        if not lg.complete:
            warn(f"{lg.name}: left out of the statistics: {'; '.join(lg.problems)}")
    if len({hardware_key(lg) for lg in good}) > 1:
        warn("the runs ran on different hardware: the statistics below mix them")
    print(f"runs: {len(logs)} ({len(good)} complete)")
    if not good:
        print("no complete run: no statistics")
        return 0
    st = group_stats(good, args.target)
    print(val_line(st))
    print(target_rule(st))
    print(time_line(st))
    print("hardware: " + "; ".join(sorted({hardware_long(lg) for lg in good})))
    print(code_line(good))
    return 0


# =============================================================================
# compare
# =============================================================================

def cmd_compare(args) -> int:
    groups = {"baseline": load_logs(args.baseline), "candidate": load_logs(args.candidate)}
    for role, logs in groups.items():
        bad = [lg for lg in logs if not lg.complete]
        if bad:
            raise ToolError(f"{bad[0].name}: incomplete log ({bad[0].problems[0]}); compare needs complete runs")
        if len(logs) < 2:
            raise ToolError(f"{role} has {len(logs)} run: Welch's t-test needs at least 2 runs per group")
    # A run in both groups, or twice in one, would make the groups look alike or tighter than they are.
    both = [(f"{role} {lg.name}", lg) for role, logs in groups.items() for lg in logs]
    if dup := duplicates_line([lg for _, lg in both], [label for label, _ in both]):
        raise ToolError(dup)
    kinds = {role: sorted({hardware_long(lg) for lg in logs}) for role, logs in groups.items()}
    if kinds["baseline"] != kinds["candidate"] or len(kinds["baseline"]) > 1:
        message = (f"different hardware: baseline {'; '.join(kinds['baseline'])} vs "
                   f"candidate {'; '.join(kinds['candidate'])}")
        if not args.allow_different_hardware:
            raise ToolError(message + " (timings are not comparable; --allow-different-hardware to compare anyway)")
        warn(message + ": timings are not comparable")

    base, cand = groups["baseline"], groups["candidate"]
    for role, logs in groups.items():
        ts = [lg.train_time_ms / 1000 for lg in logs]
        vs = [lg.final_val_loss for lg in logs]
        print(f"{role}: {len(logs)} runs on {kinds[role][0]}: train time {statistics.fmean(ts):.3f} s "
              f"± {statistics.stdev(ts):.3f}, final val loss {statistics.fmean(vs):.5f} ± {statistics.stdev(vs):.5f}")
    level = f"{100 * (1 - ALPHA):g}%"
    w = welch([lg.train_time_ms / 1000 for lg in base], [lg.train_time_ms / 1000 for lg in cand])
    print(f"train time difference (candidate - baseline): {w.diff:+.3f} s, {level} CI [{w.lo:+.3f}, {w.hi:+.3f}] s "
          f"(Welch t = {w.t:.3f}, df = {w.df:.2f})")
    if math.isnan(w.p_less):
        print(f"candidate faster at p < {ALPHA:g} (one-sided Welch): cannot tell (no train time varies within a "
              f"group: no t-test)")
    else:
        faster = w.p_less < ALPHA
        print(f"candidate faster at p < {ALPHA:g} (one-sided Welch): {'yes' if faster else 'no'} "
              f"(p = {fmt_p(w.p_less)})")
    v = welch([lg.final_val_loss for lg in base], [lg.final_val_loss for lg in cand])
    print(f"final val loss difference (candidate - baseline): {v.diff:+.5f}, {level} CI [{v.lo:+.5f}, {v.hi:+.5f}]")
    return 0


# =============================================================================
# verify
# =============================================================================

def verify_logs(logs: list[Log], target: float, require_source: bool,
                allowed: set[str] = frozenset()) -> tuple[list[str], list[str], Stats | None]:
    """(failures as 'FAIL file: reason', warnings, target statistics) for a set of logs; `allowed`:
    experiment fields that may differ between them."""
    fails = [f"FAIL {lg.name}: {p}" for lg in logs for p in lg.problems]
    warnings = []
    if dup := duplicates_line(logs):
        fails.append(f"FAIL {dup}")
    fails += experiment_fails(logs, allowed)

    stripped = [lg for lg in logs if lg.source is None]
    if stripped and require_source:
        fails += [f"FAIL {lg.name}: no embedded source (stripped): cannot show which code ran" for lg in stripped]
    elif stripped:
        warnings.append(f"{len(stripped)} of {len(logs)} logs have no embedded source (stripped): "
                        "cannot check which code they ran (--require-source makes this a failure)")

    for what, key in (("code", lambda lg: lg.code_hash), ("preset", lambda lg: lg.preset)):
        values = Counter(key(lg) for lg in logs if key(lg) is not None)
        if len(values) > 1:
            ref, n_ref = values.most_common(1)[0]
            shown = ref[:12] if what == "code" else ref
            for lg in logs:
                if key(lg) not in (None, ref):
                    mine = key(lg)[:12] if what == "code" else key(lg)
                    fails.append(f"FAIL {lg.name}: ran different {what} ({mine}) than {n_ref} other log(s) ({shown})")
    bare = [lg for lg in logs if not lg.hyperparameters]
    if bare:
        warnings.append(f"{len(bare)} of {len(logs)} logs record no hyperparameters: of their settings only the "
                        "number of steps and the world size can be compared")
    if len({hardware_key(lg) for lg in logs}) > 1:
        warnings.append("the logs ran on different hardware: " + "; ".join(sorted({hardware_long(lg) for lg in logs})))

    scored = [lg for lg in distinct_runs(logs) if lg.final_val_loss is not None and lg.train_time_ms is not None]
    st = group_stats(scored, target) if scored else None
    if st and not st.met:
        who = scored[0].name if len(scored) == 1 else f"all {len(scored)} logs"
        fails.append(f"FAIL {who}: {target_rule(st)}")
    return fails, warnings, st


def cmd_verify(args) -> int:
    logs, fails = [], []
    for path in args.logs:
        try:
            logs.append(read_log(path))
        except ToolError as e:
            fails.append(f"FAIL {e}")
    allowed = parse_allowed(args.allow_differences, logs)
    more, warnings, st = verify_logs(logs, args.target, args.require_source, allowed)
    for w in warnings:
        warn(w)
    fails += more
    for f in fails:
        print(f)
    if fails:
        return 1
    same = "no embedded source to compare" if logs[0].code_hash is None else f"same code {logs[0].code_hash[:12]}"
    differ = experiment_differences(logs)
    allowed_text = f"runs differ in {', '.join(differ)} (allowed); " if differ else ""
    print(f"OK {len(logs)} log(s): complete; {same}; {allowed_text}{target_rule(st)}")
    return 0


# =============================================================================
# extract
# =============================================================================

def output_file(output: str, what: str, inputs: list[str]) -> Path:
    """-o as the file a command writes, checked before anything is read or written: an empty name (an unset variable
    in `-o $OUT`) names none, a folder is no file (bench.py words its --out alike), a file the command reads is no
    output (refuse_an_input), and what is there must be a regular file for the writer to replace: a FIFO, a device,
    a socket or a link (to /proc/self/fd/1, to /dev/null) is refused, where it was replaced by a file (exit 0)."""
    if not output.strip():
        raise ToolError(f"-o {output!r}: names no file or folder; give the file for {what}")
    if os.path.isdir(output):
        raise ToolError(f"-o {output}: is a folder; give the file for {what} (a name in that folder)")
    refuse_an_input(output, inputs)
    if problem := safe_write.output_problem(output):
        raise ToolError(f"-o {output}: {problem}")
    return Path(output)


def refuse_an_input(output: str, inputs: list[str]) -> None:
    """`-o` names the file a command writes, and never one it reads: `extract run.txt -o run.txt` once replaced
    the log with its source. The same file by any name (./x, a link) counts."""
    for path in inputs:
        try:
            same = os.path.samefile(output, path)
        except OSError:   # the output does not exist yet (or the input cannot be read: read_log says so)
            continue
        if same:
            raise ToolError(f"-o {output}: that is {path}, which this command reads; choose another output file")


def cmd_extract(args) -> int:
    out = output_file(args.output, "the source", [args.log])
    log = read_log(args.log)
    if log.source is None:
        raise ToolError(f"{log.name}: no embedded source (the log starts at the '=' line: it was stripped)")
    if log.declared_hash and sha256_text(log.source) != log.declared_hash:
        raise ToolError(f"{log.name}: embedded source does not match its code_sha256 line (the log was edited)")
    write_output(out, log.source.encode("utf-8"))
    print(f"wrote {out} ({len(log.source.encode('utf-8'))} bytes, sha256 {log.code_hash})")
    return 0


# =============================================================================
# plot
# =============================================================================

def cmd_plot(args) -> int:
    out = output_file(args.output, "the plot (FILE.png)", args.logs)
    try:
        import matplotlib
        matplotlib.use("Agg")   # files only, never a window
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    logs = load_logs(args.logs)
    for lg in logs:
        if not lg.complete:
            warn(f"{lg.name}: plotted as far as it goes: {'; '.join(lg.problems)}")
    groups = list(dict.fromkeys(lg.code_hash for lg in logs))   # one colour per code version
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_time, ax_step) = plt.subplots(1, 2, figsize=(13, 5))
    labelled = set()
    for lg in logs:
        points = [(s, v, t) for s, v, t in lg.vals if t is not None]
        if not points:
            continue
        g = groups.index(lg.code_hash)
        n = sum(1 for other in logs if other.code_hash == lg.code_hash)
        code = lg.code_hash[:8] if lg.code_hash else "not embedded"
        label = None if g in labelled else plot_text(f"code {code} ({n} run{'s' * (n != 1)})")
        labelled.add(g)
        style = dict(color=colours[g % len(colours)], marker=".", linewidth=1, alpha=0.8)
        ax_time.plot([t / 1000 for _, _, t in points], [v for _, v, _ in points], label=label, **style)
        ax_step.plot([s for s, _, _ in points], [v for _, v, _ in points], **style)
    for ax, xlabel in ((ax_time, "train time (s)"), (ax_step, "step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.set_yscale("log")   # the first evals (~10) would flatten the end of the curves
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend()
    fig.suptitle(plot_text("val loss, " + "; ".join(sorted({hardware_label(lg) for lg in logs}))))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_output(out, png.getvalue())
    print(f"wrote {out} ({len(logs)} runs, {len(groups)} code version(s))")
    return 0


# =============================================================================
# Record folders: new and table
# =============================================================================
# records/<date>_<name>/ holds the logs, record.json (name, date, track, target: what the
# logs cannot say) and a README. Every number in the table is recomputed from the logs.

def record_readme(name: str, date: str, track: str, target: float, logs: list[Log], folder: str) -> str:
    st = group_stats(logs, target)
    first = logs[0]
    headers, rows = run_rows(logs)
    rows = [[md_text(cell) for cell in row] for row in rows]
    lines = [f"# {md_text(name)} ({md_text(date)})", "",
             f"Track: **{md_text(track)}**. Hardware, from the logs: {md_text(hardware_long(first))}; "
             f"PyTorch {md_text(first.torch or 'unknown')}, Python {md_text(first.python or 'unknown')}.", ""]
    if differ := experiment_differences(logs):
        lines += [f"**Not one experiment**: filed with `--allow-differences={','.join(differ)}`; the statistics "
                  "below pool runs whose settings differ:", ""]
        lines += [f"- {differs_text(k, g, lambda lg: lg.path.name, md_text)}" for k, g in differ.items()] + [""]
    if first.note:   # after a word of ours: a note cannot start a heading or a list
        lines += [f"> Note: {md_text(first.note)}", ""]
    lines += ["## Runs", "", md_table(headers, rows), "",
              "## Statistics", "",
              f"- {val_line(st)}", f"- {target_rule(st)}", f"- {time_line(st)}",
              f"- {code_line(logs)}", "",
              "Final val loss is the val_loss at the last step; train time is the train_time the log "
              "reports for the whole run (its summary line, else the last step). The p-value is a one-sided "
              f"one-sample t-test (df = n - 1) of H1: mean < target; the target counts as met at p < {ALPHA:g} "
              "(for a single run: its final val loss <= target).", "",
              "## Reproduce", ""]
    log_path = sh_quote(f"{folder}/{first.path.name}")
    if first.source is None:
        lines += ["These logs carry no embedded source (it was stripped before they were published), "
                  "so this record cannot be re-run from this folder.", ""]
    else:
        script = f"train_gpt_{first.code_hash[:8]}.py"
        # Every word is quoted (sh_quote): names and values come from the log. The names are ones its
        # train_gpt.py defines (read_log refuses others), and the folder and script name are ours.
        lines += ["Every log embeds the exact train_gpt.py that produced it. From the repository root:", "",
                  "```bash", f"python records/records.py verify {sh_quote(folder)}/*.txt --target {target:g}",
                  f"python records/records.py extract {log_path} -o {script} && \\",
                  f"  torchrun --standalone --nproc_per_node={first.world_size or 1} {script}"
                  + "".join(f" \\\n    {sh_quote(f'--{k}={v}')}" for k, v in run_flags(first)), "```", ""]
        differ = sorted(k for k in first.hyperparameters
                        if len({experiment_value(k, lg) for lg in logs}) > 1)
        if first.hyperparameters:
            lines += ["The flags are the hyperparameters in the first run's log header, less those that only "
                      "name where a run writes its files."
                      + (f" These differ between the runs: {md_text(', '.join(differ))} (see each log's header)."
                         if differ else ""), ""]
    lines += [f"Regenerate the numbers: `python records/records.py summarize {sh_quote(folder)}/*.txt "
              f"--target {target:g}`", ""]
    return "\n".join(lines)


# Hyperparameters that name a run's files, not what it computes: a rerun gets its own.
RUN_FILE_FIELDS = {"run_id", "logs_dir", "checkpoint_dir", "resume", "force_resume"}


def run_flags(log: Log) -> list[tuple[str, str]]:
    """`--name=value` pairs that rerun a log's configuration: preset first, then every field it printed.
    read_log has dropped the names its train_gpt.py does not define; one that is no identifier is left out."""
    hp = {k: v for k, v in log.hyperparameters.items()
          if k not in RUN_FILE_FIELDS and v != "" and k.isidentifier()}
    return sorted(hp.items(), key=lambda kv: kv[0] != "preset")


# A record folder holds README.md, record.json and its logs, each as NAME.txt: scan_records reads the logs back
# by that pattern (record_logs), and new files each log under a name it matches (filed_name). A log filed under its
# own name once replaced the README (a log named README.md) or was never read again (run.log, .hidden.txt).

def record_logs(folder: Path) -> list[Path]:
    """The logs of a record folder, in order."""
    return sorted(p for p in folder.glob("*.txt") if p.is_file())


def filed_name(path: Path) -> str:
    """The name `new` files a log under: its stem in letters, digits and `._-` (a name's other characters and
    leading dots as `_`), at most 200 characters, then `.txt`; README.md becomes README.md.txt, run.log run.log.txt."""
    stem = path.stem if path.suffix == ".txt" else path.name
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem)[:200]
    return re.sub(r"^\.", "_", stem or "log") + ".txt"


@dataclass
class Record:
    folder: Path
    name: str
    date: str
    track: str
    target: float
    logs: list[Log]


def scan_records(records_dir: Path) -> list[Record]:
    """Every records/<date>_<name>/ folder with sound logs; the rest are left out with a warning."""
    found = []
    for folder in sorted(p for p in records_dir.iterdir() if p.is_dir() and RECORD_DIR_RE.match(p.name)):
        date, name = RECORD_DIR_RE.match(folder.name).groups()
        meta = {}
        if os.path.lexists(folder / "record.json"):
            try:   # nested thousands deep, a FIFO or /dev/zero: one line from the reader, no traceback or hang
                meta = safe_write.read_json(folder / "record.json", "a record's record.json", MAX_RECORD_JSON_BYTES)
            except safe_write.FileRefused as e:
                warn(f"{folder}/record.json: unreadable ({e.why}): left out of the table")
                continue
            texts = ("name", "date", "track")
            if not isinstance(meta, dict) or any(not isinstance(meta.get(k, ""), str) for k in texts):
                warn(f"{folder}/record.json: not an object whose name, date and track are text: left out of the table")
                continue
        logs = []
        for path in record_logs(folder):
            try:
                logs.append(read_log(path))
            except ToolError as e:
                warn(f"{e}: ignored")
        bad = [lg for lg in logs if not lg.complete]
        if not logs or bad:
            why = "no logs" if not logs else f"{bad[0].name}: {bad[0].problems[0]}"
            warn(f"{folder}: left out of the table ({why})")
            continue
        if len({hardware_key(lg) for lg in logs}) > 1:
            warn(f"{folder}: left out of the table (its logs ran on different hardware)")
            continue
        if dup := duplicates_line(logs):
            warn(f"{folder}: left out of the table ({dup})")
            continue
        declared = meta.get("allowed_differences")
        declared = {k for k in declared if isinstance(k, str)} if isinstance(declared, list) else set()
        undeclared = [k for k in experiment_differences(logs) if k not in declared]
        if undeclared:
            warn(f"{folder}: left out of the table (its runs differ in {', '.join(undeclared)}, "
                 "which record.json does not allow)")
            continue
        track = meta.get("track") or default_track(logs[0])
        if conflict := track_conflict(track, logs[0]):
            warn(f"{folder}: left out of the table ({conflict})")
            continue
        try:
            target = check_target(meta.get("target", DEFAULT_TARGET))
        except ValueError as e:
            warn(f"{folder}/record.json: {e}: left out of the table")
            continue
        found.append(Record(folder, meta.get("name", name), meta.get("date", date), track, target, logs))
    return found


def records_markdown(records: list[Record], link_base: Path, level: str) -> str:
    """Tables of records, one per hardware (tracks never mix), links relative to link_base."""
    if not records:
        return "No records yet."
    by_hw: dict[tuple, list[Record]] = {}   # GPU tracks first, then by label
    for r in records:
        lg = r.logs[0]
        by_hw.setdefault((lg.device != "cuda", hardware_long(lg)), []).append(r)
    out = []
    headers = ["date", "record", "track", "runs", "final val loss (mean ± std)", "target", "p (H1: mean < target)",
               "train time (mean ± std)", "code sha256"]
    for hw in sorted(by_hw):
        rows = []
        for r in sorted(by_hw[hw], key=lambda r: (r.date, r.name)):
            st = group_stats(r.logs, r.target)
            link = urllib.parse.quote(Path(os.path.relpath(r.folder / "README.md", link_base)).as_posix())
            sd = f" ± {st.val_std:.4f}" if st.n > 1 else ""
            tsd = f" ± {statistics.stdev(st.times):.2f}" if st.n > 1 else ""
            p = fmt_p(st.test[2]) if st.test else "n/a (1 run)" if st.n == 1 else "n/a (no spread)"
            code = Counter(lg.code_hash for lg in r.logs).most_common(1)[0][0]
            rows.append([md_text(r.date), f"[{md_text(r.name)}]({link})", md_text(r.track), str(st.n),
                         f"{st.val_mean:.4f}{sd}", f"{st.target:g}", p + ("" if st.met else " (not met)"),
                         f"{statistics.fmean(st.times):.2f} s{tsd}", f"`{code[:12]}`" if code else "not embedded"])
        out += [f"{level} {md_text(hw[1])}", "", md_table(headers, rows), ""]
    return "\n".join(out).rstrip()


def write_table(records_dir: Path) -> list[Path]:
    """Regenerate records/RECORDS.md and the marked block of the repository README."""
    records = scan_records(records_dir)
    written = []
    body = ("# Speedrun records\n\n"
            "Generated by `python records/records.py table` from the logs in each record folder; "
            "do not edit by hand. Records are grouped by the hardware their logs show: "
            "timings are only comparable within one group.\n\n"
            + records_markdown(records, records_dir, "##") + "\n")
    write_output(records_dir / "RECORDS.md", body.encode("utf-8"))
    written.append(records_dir / "RECORDS.md")

    readme = records_dir.parent / "README.md"
    if readme.exists():
        try:
            text = read_input(readme, "the repository's README", MAX_LOG_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{readme}: not UTF-8 text; the table is not written into it") from None
        begin, end = text.find(BEGIN_MARK), text.find(END_MARK)
        if begin >= 0 and end > begin:
            block = "\n" + records_markdown(records, readme.parent, "###") + "\n"
            new = text[:begin + len(BEGIN_MARK)] + block + text[end:]
            if new != text:
                write_output(readme, new.encode("utf-8"))
            written.append(readme)
        elif begin >= 0 or end >= 0:
            warn(f"{readme}: records markers missing or out of order: left untouched")
    return written


def cmd_new(args) -> int:
    if not NAME_RE.match(args.name):
        raise ToolError(f"record name {args.name!r}: use letters, digits, '_', '.', '-' only")
    records_dir = Path(args.records_dir)
    logs = load_logs(args.logs)
    allowed = parse_allowed(args.allow_differences, logs)
    fails, warnings, _ = verify_logs(logs, args.target, args.require_source, allowed)
    for w in warnings:
        warn(w)
    if fails:
        for f in fails:
            print(f)
        raise ToolError("no record filed: the logs fail verify (reasons above)")
    if len({hardware_key(lg) for lg in logs}) > 1:
        raise ToolError("no record filed: the logs ran on different hardware")
    track = args.track or default_track(logs[0])
    if "|" in track or not track.isprintable():
        origin = "" if args.track else f" (from {logs[0].name}'s preset: --track to name one)"
        raise ToolError(f"track {shorten(track)}{origin}: no '|' or control characters")
    if conflict := track_conflict(track, logs[0]):
        raise ToolError(conflict)
    names = [filed_name(lg.path) for lg in logs]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ToolError(f"two logs would be filed as {twice}: rename one (a record folder keeps each log as "
                        f"NAME.txt)")
    date = args.date or (logs[0].date or dt.date.today()).isoformat()
    folder = records_dir / f"{date}_{args.name}"
    if folder.exists():
        raise ToolError(f"{folder}: already exists")

    # Build the folder beside its final place and rename it: no half-made record on failure.
    make_dirs(records_dir)
    tmp = Path(tempfile.mkdtemp(dir=records_dir, prefix=".new-"))
    try:
        os.chmod(tmp, 0o755)   # mkdtemp makes it private; a record is for everyone to read
        for lg, name in zip(logs, names):
            write_output(tmp / name, read_input(lg.path, "a speedrun log", MAX_LOG_BYTES), shown=folder / name)
        meta = {"name": args.name, "date": date, "track": track, "target": args.target}
        if differ := experiment_differences(logs):
            meta["allowed_differences"] = list(differ)
        write_output(tmp / "record.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"),
                    shown=folder / "record.json")
        rel = folder.resolve().relative_to(records_dir.resolve().parent).as_posix()
        if sorted(path.name for path in record_logs(tmp)) != sorted(names):   # what scan_records will read
            raise ToolError(f"{folder}: the logs would not read back as the record's ({', '.join(names)})")
        copies = [read_log(tmp / name) for name in names]
        for copy, name in zip(copies, names):
            copy.path = folder / name
        write_output(tmp / "README.md", record_readme(args.name, date, track, args.target, copies, rel).encode("utf-8"),
                    shown=folder / "README.md")
        publish_record(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"created {folder} ({len(logs)} logs, track {track})")
    try:
        for path in write_table(records_dir):
            print(f"updated {path}")
    except (ToolError, OSError) as e:   # the record is filed: say what is left to do, not only what failed
        why = str(e) if isinstance(e, ToolError) else f"{e.filename}: {why_not_written(e)}"
        raise ToolError(f"{why}; the record {folder} is filed, but the tables do not show it yet: run "
                        f"`python records/records.py table` once this is fixed") from None
    return 0


def publish_record(tmp: Path, folder: Path) -> None:
    """Renames the finished folder into place; errors name the record, never the temporary (.new-XXXX)."""
    try:
        os.rename(tmp, folder)
    except OSError as e:
        if os.path.lexists(folder):   # another `new` filed the same name while this one wrote
            raise ToolError(f"{folder}: already exists (made while this record was written: another "
                            f"`records.py new`?); nothing of this one was kept") from None
        raise ToolError(f"{folder}: cannot create ({why_not_written(e)})") from None


def cmd_table(args) -> int:
    records_dir = Path(args.records_dir)
    if not records_dir.is_dir():
        raise ToolError(f"{records_dir}: no such records folder")
    for path in write_table(records_dir):
        print(f"updated {path}")
    return 0


# =============================================================================
# Command line
# =============================================================================

def check_target(value) -> float:
    """A val-loss target is a finite number > 0: an infinite one is met by any run, nan or <= 0 by none."""
    try:
        target = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"target {value!r} is not a number") from None
    if not math.isfinite(target) or target <= 0:
        raise ValueError(f"target {value!r} must be a finite number > 0")
    return target


def valid_target(text: str) -> float:
    try:
        return check_target(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def valid_date(text: str) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a YYYY-MM-DD date: {text!r}") from None


STATS_HELP = f"""\
statistics:
  final val loss  the val_loss at the last step; mean ± sample std (ddof = 1)
  target          one-sided one-sample t-test, H1: mean < target, df = n - 1;
                  met when p < {ALPHA:g}. With a single run there is no spread to
                  test: the rule is final val loss <= target.
  compare         Welch's t-test (Welch-Satterthwaite df) of candidate - baseline
                  train time: {100 * (1 - ALPHA):g}% confidence interval and one-sided p
                  for H1: candidate faster.
  scipy.stats is used when installed, else a built-in t distribution."""


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="records.py", formatter_class=fmt, description=__doc__.split("\n\n")[1],
                                epilog=STATS_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    def add(name, help_, description=""):
        sp = sub.add_parser(name, help=help_, description=f"{help_}. {description}".strip(),
                            formatter_class=fmt, epilog=STATS_HELP)
        return sp

    def target(sp):
        sp.add_argument("--target", type=valid_target, default=DEFAULT_TARGET,
                        help=f"val-loss target, a finite number > 0 (default {DEFAULT_TARGET})")

    def allow_differences(sp):
        sp.add_argument("--allow-differences", action="append", metavar="FIELD[,FIELD]",
                        help="experiment fields the runs may differ in (hyperparameter names, num_iterations, "
                             "world_size); without it runs that differ in any but seed and where files go fail")

    def records_dir(sp):
        sp.add_argument("--records-dir", default=str(RECORDS_DIR), metavar="DIR",
                        help="records root (default: the folder records.py is in); the README.md beside "
                             "it gets the table between its records markers")

    sp = add("summarize", "one row per run, then val-loss and train-time statistics",
             "Incomplete logs are shown but left out of the statistics. Refuses a run given twice.")
    sp.add_argument("logs", nargs="+", metavar="LOG")
    target(sp)
    sp.set_defaults(func=cmd_summarize)

    sp = add("compare", "train-time difference of a candidate against a baseline, with a confidence interval",
             "Refuses groups that ran on different hardware (GPU, device or world size) "
             "unless --allow-different-hardware, and a run given twice (in one group or both).")
    sp.add_argument("--baseline", nargs="+", required=True, metavar="LOG")
    sp.add_argument("--candidate", nargs="+", required=True, metavar="LOG")
    sp.add_argument("--allow-different-hardware", action="store_true",
                    help="compare anyway, with a warning")
    sp.set_defaults(func=cmd_compare)

    sp = add("verify", "exit 0 only if the logs back a record",
             "Checks: each log is complete (step lines 1..N, val lines every val_loss_every steps, "
             "final val loss at step N, end-of-run line, no error line, last line not cut) and consistent with "
             "itself (its embedded source, all the text before its header, hashes to its code_sha256 line, its "
             "summary repeats its step lines, every loss is >= 0 as a cross-entropy is and every train time finite "
             "and >= 0; nothing signs a log, so numbers edited consistently pass); "
             "no run is given twice (same file, run id, step lines, losses and step times, or seed and config); "
             "all ran the same code, preset and experiment (steps, data, validation and batch settings: every "
             "logged hyperparameter but the seed and where files go, each as the run resolved it); the target is met. "
             "Prints 'FAIL <file>: <reason>' per failure. Logs without embedded source only warn.")
    sp.add_argument("logs", nargs="+", metavar="LOG")
    target(sp)
    allow_differences(sp)
    sp.add_argument("--require-source", action="store_true",
                    help="fail logs whose embedded source was stripped instead of warning")
    sp.set_defaults(func=cmd_verify)

    sp = add("extract", "write the train_gpt.py embedded in a log (the text before its header, which lies between "
             "its last two '='*100 lines)",
             "Refuses logs without source or whose source does not match their code_sha256, and an -o that names "
             "the log.")
    sp.add_argument("log", metavar="LOG")
    sp.add_argument("-o", "--output", required=True, metavar="FILE")
    sp.set_defaults(func=cmd_extract)

    sp = add("plot", "val loss against train time and against step, one line per run, coloured by code hash",
             "Needs matplotlib (pip install matplotlib).")
    sp.add_argument("logs", nargs="+", metavar="LOG")
    sp.add_argument("-o", "--output", required=True, metavar="FILE.png")
    sp.set_defaults(func=cmd_plot)

    sp = add("new", "file a record: records/<date>_<NAME>/ with the logs, record.json and a README, "
             "then regenerate the table",
             "The logs must pass verify (with the same --allow-differences, which the record's README and "
             "record.json then list) and share one hardware. The date is the first log's "
             "(else today); the track defaults to the logs' hardware and preset, e.g. '8×H100' or '2×CPU smoke'.")
    sp.add_argument("name", metavar="NAME")
    sp.add_argument("logs", nargs="+", metavar="LOG")
    sp.add_argument("--track", help="track name; refused if it names hardware the logs did not run on")
    sp.add_argument("--date", type=valid_date, help="YYYY-MM-DD instead of the first log's date")
    target(sp)
    allow_differences(sp)
    sp.add_argument("--require-source", action="store_true", help="as for verify")
    records_dir(sp)
    sp.set_defaults(func=cmd_new)

    sp = add("table", "regenerate records/RECORDS.md (and the README block) from every record folder")
    records_dir(sp)
    sp.set_defaults(func=cmd_table)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        with contextlib.redirect_stdout(TerminalText(sys.stdout)), contextlib.redirect_stderr(TerminalText(sys.stderr)):
            args = build_parser().parse_args(argv)   # its errors quote the command line: shown escaped too
            return args.func(args)
    except ToolError as e:
        print(visible(f"error: {e}"), file=sys.stderr)
        return 1
    except OSError as e:   # a folder or file the command had to write
        print(visible(f"error: {str(e.filename) + ': ' if e.filename else ''}{why_not_written(e)}"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Property tests of records.py's log reader (issue 46): generated neighbours of the bad inputs the tables in
tests/test_records.py name. Every number a log states is read once (read_count, read_time_ms, parse_step_line,
read_log), and whatever the text, the reader returns values valid by construction or refuses in one line."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re

import pytest
from hypothesis import given, settings, strategies as st

from test_records import RULE, SAME_CODE, rec, with_hparams

FAST = settings(max_examples=60)   # the file's ~10 tests run in a few seconds on one core

LOG = SAME_CODE[0].read_text()
SOURCE = LOG[:LOG.index(RULE)]
BODY = LOG[LOG.index(RULE):]

# Number text of every size and sign: integers and floats, NaN and infinities in any case, exponents, long digit
# strings, and text that only starts like a number.
number_text = st.one_of(
    st.integers(min_value=-10 ** 30, max_value=10 ** 30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "1_000", "0x10", "+5",
                     "", "-0", "1e-400", "٣"]),
    st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
    st.text(alphabet="0123456789.-+eE", max_size=30),
)
# Outside text: escapes, line and bidi marks, blanks, colons and the characters step lines are split at.
odd_text = st.text(alphabet=st.sampled_from(list("ab:/ =\t\x1b[2J\u202e\r\x00é9")) | st.characters(), max_size=40)


def one_line(text: str) -> bool:
    return "\n" not in text and "\r" not in text


@FAST
@given(number_text | odd_text)
def test_a_count_is_a_bounded_int_or_nothing(text):
    count = rec.read_count(text)
    assert count is None or (type(count) is int and 0 <= count < 10 ** rec.MAX_COUNT_DIGITS)
    if count is not None:
        assert count == int(text)


@FAST
@given(number_text | odd_text, st.booleans())
def test_a_time_is_finite_and_not_negative_or_nothing(text, ms):
    time = rec.read_time_ms(text + "ms" * ms)
    assert time is None or 0 <= time <= rec.MAX_TIME_MS
    assert rec.is_time(text + "ms" * ms) == (time is not None)


@FAST
@given(number_text, number_text, number_text, number_text, odd_text)
def test_a_step_line_is_read_or_named_malformed(step, total, loss, time, extra):
    line = f"step:{step}/{total} val_loss:{loss} train_time:{time}ms {extra}"
    parsed = rec.parse_step_line(line)
    if isinstance(parsed, str):
        assert parsed and one_line(parsed) and len(parsed) < 200
        return
    for count in (parsed.step, parsed.total):
        assert type(count) is int and 0 <= count < 10 ** rec.MAX_COUNT_DIGITS
    assert parsed.train_time_ms is None or 0 <= parsed.train_time_ms <= rec.MAX_TIME_MS
    assert parsed.val_loss is None or isinstance(parsed.val_loss, float)


def write(folder, name: str, text: str):
    path = folder / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


def assert_valid(lg) -> None:
    """The Log read_log returns: each number in range, each problem one line."""
    assert lg.train_time_ms is None or 0 <= lg.train_time_ms <= rec.MAX_TIME_MS
    assert all(t is None or 0 <= t <= rec.MAX_TIME_MS for _, _, t in lg.vals)
    assert all(t is None or 0 <= t <= rec.MAX_TIME_MS for t in lg.step_times)
    assert lg.final_val_loss is None or 0 <= lg.final_val_loss <= rec.MAX_FINAL_LOSS
    for count in (lg.total_steps, lg.last_step, lg.world_size):
        assert count is None or 0 <= count < 10 ** rec.MAX_COUNT_DIGITS
    assert lg.final_val_loss is None or isinstance(lg.final_val_loss, float)
    assert all(isinstance(p, str) and one_line(p) for p in lg.problems)
    if lg.complete:
        assert math.isfinite(lg.final_val_loss) and lg.final_val_loss >= 0 and lg.train_time_ms is not None


FIELDS = {   # where a generated number goes in the log: a pattern whose group 2 is replaced
    "step number": r"^(step:)(6)(/6 val_loss)",
    "total": r"^(step:6/)(6)( val_loss)",
    "val loss": r"^(step:4/6 val_loss:)(\S+)()",
    "final val loss": r"^(step:6/6 val_loss:)(\S+)()",
    "train loss": r"^(step:3/6 train_loss:)(\S+)()",
    "step time": r"^(step:5/6 .*train_time:)(\d+)(ms)",
    "final time": r"^(step:6/6 val.*train_time:)(\d+)(ms)",
    "summary time": r"^(summary: .*train_time:)(\d+)(ms)",
    "summary steps": r"^(summary: .*steps:)(\d+)()",
    "summary loss": r"^(summary: final_val_loss:)(\S+)()",
    "world size": r"^(summary: .*world_size:)(\d+)()",
    "num_iterations": r"^(  num_iterations = )(\d+)()",
    "val_loss_every": r"^(  val_loss_every = )(\d+)()",
}


@FAST
@given(st.sampled_from(sorted(FIELDS)), number_text | odd_text.filter(one_line))
def test_any_number_anywhere_gives_a_valid_log_or_one_line(tmp_path_factory, field, value):
    """The rows' inputs (a time of -100,000 ms, inf or nan, a step of 5,000 digits) and their neighbours, in every
    place a log states a number: read_log returns a Log whose numbers are in range, or a one-line ToolError."""
    text = re.sub(FIELDS[field], lambda m: m[1] + value + m[3], LOG, count=1, flags=re.M)
    path = write(tmp_path_factory.getbasetemp(), "generated.txt", text)
    try:
        lg = rec.read_log(path)
    except rec.ToolError as e:
        assert one_line(str(e))
        return
    assert_valid(lg)
    if field in ("step time", "final time", "summary time") and not rec.is_time(value):
        assert not lg.complete   # "cannot be a time", or a malformed line where it is no number at all


@settings(max_examples=25)
@given(st.lists(number_text, min_size=3, max_size=3), st.lists(number_text, min_size=3, max_size=3))
def test_statistics_of_any_final_losses_and_times_end_in_a_verdict(tmp_path_factory, losses, times):
    """Rows 2 and 3 at the command level: three runs whose final val losses and train times are any numbers
    (1.7e308 three times overflowed a sum; nan stopped stdev) get a verdict or FAIL lines from verify and
    summarize, exit 0 or 1, and never a traceback."""
    folder = tmp_path_factory.getbasetemp()
    paths = []
    for i, (source, loss, time) in enumerate(zip(SAME_CODE, losses, times)):
        text = source.read_text()
        text = re.sub(r"^(step:6/6 val_loss:)\S+", lambda m: m[1] + loss, text, flags=re.M)
        text = re.sub(r"^(summary: final_val_loss:)\S+", lambda m: m[1] + loss, text, flags=re.M)
        text = re.sub(r"^((?:step:6/6 val|summary:).*train_time:)\d+ms", lambda m: m[1] + time + "ms", text,
                      flags=re.M)
        paths.append(str(write(folder, f"final{i}.txt", text)))
    for command in ("verify", "summarize"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = rec.main([command, *paths, "--target", "7.5"])
        assert code in (0, 1), (command, out.getvalue(), err.getvalue())
        assert "Traceback" not in out.getvalue() + err.getvalue()


@FAST
@given(st.lists(st.sampled_from([RULE, f"code_sha256: {'0' * 64}", "hyperparameters:", "  seed = 9", "run_id: x",
                                 "step:1/6 val_loss:1.0 train_time:1ms", '"""x"""', "Running PyTorch 9"]),
                max_size=8), st.booleans())
def test_text_before_a_log_is_source_whatever_it_declares(tmp_path_factory, lines, hashed):
    """Row 1's neighbours: lines prepended to a log (rules, code_sha256 lines, fake headers and step lines, with the
    hash of what comes before them or not) are part of its source; the header read is the log's own."""
    prefix = "".join(line + "\n" for line in lines)
    if hashed:   # a code_sha256 line declaring the hash of the text before its rule (row 1's attack)
        prefix = f'"""x"""\n{RULE}\ncode_sha256: {rec.sha256_text(chr(34) * 3 + "x" + chr(34) * 3)}\n' + prefix
    base = rec.read_log(SAME_CODE[0])
    lg = rec.read_log(write(tmp_path_factory.getbasetemp(), "prefixed.txt", prefix + LOG))
    assert (lg.run_id, lg.hyperparameters, lg.declared_hash, lg.vals) == (base.run_id, base.hyperparameters,
                                                                          base.declared_hash, base.vals)
    assert lg.source == prefix + SOURCE
    if prefix:
        assert lg.code_hash != lg.declared_hash and any(p.startswith("edited: ") for p in lg.problems)


@FAST
@given(st.integers(min_value=-10 ** 6, max_value=10 ** 6), st.integers(min_value=0, max_value=10 ** 9),
       st.text(alphabet="abcdefgh0123456789-", min_size=1, max_size=20), st.booleans())
def test_a_copy_under_any_seed_run_id_and_time_shift_is_one_run(tmp_path_factory, shift, seed, run_id, from_step_1):
    """Row 14's neighbours: whatever seed and run id the header of a copy says, and whatever constant its times
    are shifted by (from step 0 or from step 1 on), its losses and step times make it the run it copies."""
    def shifted(m):
        return f"{m[1]}{max(0, int(m[3]) + shift)}ms" if int(m[2]) >= from_step_1 else m[0]
    text = re.sub(r"^(step:(\d+)/.*train_time:)(\d+)ms", shifted, LOG, flags=re.M)
    text = with_hparams(text, seed=seed).replace("run_id: handmade-cpu-run1", f"run_id: {run_id}")
    copy = rec.read_log(write(tmp_path_factory.getbasetemp(), "copy.txt", text))
    original = rec.read_log(SAME_CODE[0])
    if all(int(t) + shift >= 0 for t in re.findall(r"^step:[1-9]\d*/.*train_time:(\d+)ms", LOG, flags=re.M)):
        assert rec.duplicate_reason(original, copy) is not None
    for other in SAME_CODE[1:]:   # other runs, whatever the shift, stay other runs (but for a seed they share)
        reason = rec.duplicate_reason(rec.read_log(other), copy)
        assert reason is None or reason.startswith(f"same seed {seed} and config"), reason


@settings(max_examples=30)
@given(st.lists(st.integers(min_value=-900, max_value=10 ** 6), min_size=9, max_size=9),
       st.integers(min_value=0, max_value=10 ** 9), st.text(alphabet="abcdefgh0123456789-", min_size=1, max_size=20),
       st.integers(min_value=0, max_value=8), st.sampled_from([-1e-4, 1e-4, 0.5]))
def test_a_copy_under_any_times_is_one_run_and_one_other_loss_another(tmp_path_factory, moves, seed, run_id, line,
                                                                       change):
    """Issue 53 row 3's neighbours: a copy of seed 1's log under any seed and run id, each timed step's time moved by
    its own amount (drifting, jumping, never one constant), is the run it copies: the losses at every validation
    and step line decide, not the times. Its neighbour, the same copy with one loss another (by 1e-4, the logs'
    last decimal), is another run."""
    moved = iter(moves)
    text = re.sub(r"^(step:[1-9]\d*/.*train_time:)(\d+)ms", lambda m: f"{m[1]}{int(m[2]) + next(moved)}ms", LOG,
                  flags=re.M)
    text = with_hparams(text, seed=seed + 2).replace("run_id: handmade-cpu-run1", f"run_id: {run_id}")
    folder = tmp_path_factory.getbasetemp()
    original = rec.read_log(SAME_CODE[0])
    assert rec.duplicate_reason(original, rec.read_log(write(folder, "moved.txt", text))) is not None
    losses = list(re.finditer(r"^step:[1-9]\d*/\S* (?:val|train)_loss:(\S+)", text, flags=re.M))
    at = losses[line]
    other = text[:at.start(1)] + f"{float(at[1]) + change:.4f}" + text[at.end(1):]
    assert rec.duplicate_reason(original, rec.read_log(write(folder, "other.txt", other))) is None


@FAST
@given(st.sampled_from(["auto", "fp32", " auto", "auto "]), st.sampled_from(["auto", "fp32"]),
       st.sampled_from(["", "attention: sdpa  lm_head: fp32  mlp up-projection: fp32  compile: off\n"]))
def test_precisions_on_a_cpu_compare_as_fp32(tmp_path_factory, head, mlp, line):
    """Row 5's neighbours: on a CPU every spelling of auto and fp32 is fp32, the header line or not."""
    text = with_hparams(LOG, lm_head_precision=head, mlp_precision=mlp)
    text = re.sub(r"^(device: .*\n)", lambda m: m[1] + line, text, count=1, flags=re.M)
    lg = rec.read_log(write(tmp_path_factory.getbasetemp(), "precision.txt", text))
    assert rec.experiment_value("lm_head_precision", lg) == rec.experiment_value("mlp_precision", lg) == "fp32"


@pytest.mark.parametrize("make", ["fifo", "folder", "device"])
def test_a_log_that_is_no_regular_file_is_refused_at_once(tmp_path, make):
    """Odd file types: a FIFO blocked the read, /dev/zero never ended it."""
    path = {"fifo": tmp_path / "fifo", "folder": tmp_path, "device": "/dev/zero"}[make]
    if make == "fifo":
        os.mkfifo(path)
    with pytest.raises(rec.ToolError) as e:
        rec.read_log(path)
    assert one_line(str(e.value)) and str(path) in str(e.value)


# -----------------------------------------------------------------------------
# Issue 53 rows 2 and 5: the list flags read by one grammar, train_gpt.list_value and its copy in records.py
# (records.py does not import the trainer). Generated spellings of one value are that value in both; a truncated
# spelling is refused by both; and on any text the two agree, value for value or refusal for refusal.

import train_gpt as T  # noqa: E402

LIST_KINDS = {kind: [name for name, k in T.LIST_FLAGS.items() if k == kind] for kind in set(T.LIST_FLAGS.values())}


def outcome(parse, name: str, text: str):
    """What a parser makes of text: its value, or "refused"."""
    try:
        return parse(name, text)
    except ValueError:   # (train_gpt's ConfigError is one)
        return "refused"


def number_spellings(value: float) -> st.SearchStrategy[str]:
    """Texts float() reads as value: repr, 17 significant digits, trailing zeros, a sign, blanks, an exponent."""
    r = repr(value)
    spelled = [r, format(value, ".17e"), f"+{r}", f" {r} ", format(value, ".17g")]
    if "e" not in r and "." in r:
        spelled += [r + "00", r.lstrip("0") or "0"]
    if value.is_integer() and value < 1e15:
        spelled += [str(int(value)), f"{int(value)}e0", f"{int(value)}.0"]
    return st.sampled_from([s for s in spelled if float(s) == value])


def int_spellings(value: int) -> st.SearchStrategy[str]:
    return st.sampled_from([str(value), f" {value}", f"{value} ", f"+{value}" if value >= 0 else str(value),
                            f"0{value}" if value > 0 else str(value)])


weights = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.52, 1e-05, 3.0]) | st.floats(min_value=0, max_value=1e6)


@st.composite
def spelled_value(draw):
    """(flag, a value of it, a spelling of that value)."""
    kind = draw(st.sampled_from(sorted(LIST_KINDS)))
    name = draw(st.sampled_from(LIST_KINDS[kind]))
    join = lambda parts, sep=",": sep.join(parts)  # noqa: E731
    if kind in ("integers", "layer set"):
        ints = draw(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=5))
        text = join([draw(int_spellings(i)) for i in ints])
        if kind == "layer set":   # any order, repeats
            text = join([draw(int_spellings(i)) for i in draw(st.permutations(ints + ints[:1]))])
        return name, (tuple(sorted(set(ints))) if kind == "layer set" else tuple(ints)), text
    if kind == "numbers":
        values = draw(st.lists(weights, min_size=1, max_size=5))
        return name, tuple(values), join([draw(number_spellings(v)) for v in values])
    if kind == "counts":  # per stage, counts of its equal parts joined by '|'
        entries = draw(st.lists(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=3), min_size=1, max_size=4))
        return name, tuple(map(tuple, entries)), join([join([draw(int_spellings(c)) for c in e], "|") for e in entries])
    if kind in ("windows", "window", "layer pair"):
        pairs = draw(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 100)).map(lambda p: (p[0], p[0] + p[1])),
                              min_size=1, max_size=1 if kind != "windows" else 4))
        text = join([f"{draw(int_spellings(a))}:{draw(int_spellings(b))}" for a, b in pairs])
        return name, (pairs[0] if kind != "windows" else tuple(pairs)), text
    width = 1 if kind == "ramps" else draw(st.integers(1, 4))
    stages = draw(st.lists(st.tuples(st.lists(weights, min_size=width, max_size=width),
                                     st.lists(weights, min_size=width, max_size=width), st.booleans()),
                           min_size=1, max_size=4))
    parts, value = [], []
    for start, end, constant in stages:
        if kind == "ramps" and draw(st.booleans()):  # a weight for each equal part of the stage: a|b|c
            weights_ = draw(st.lists(weights, min_size=2, max_size=4))
            parts.append(join([draw(number_spellings(v)) for v in weights_], "|"))
            value.append((tuple(weights_), True))
            continue
        if constant:   # a weight that does not move: "A" or "A>A"
            end = start
        sides = [join([draw(number_spellings(v)) for v in side]) for side in (start, end)]
        parts.append(sides[0] if constant and draw(st.booleans()) else ">".join(sides))
        value.append(((start[0], end[0]), False) if kind == "ramps" else (tuple(start), tuple(end)))
    return name, tuple(value), join(parts, "," if kind == "ramps" else "/")


def truncations(text: str) -> list[str]:
    """Neighbours of a spelling that lack a part: nothing after or before a '>', a doubled '>', an empty item, a
    trailing separator."""
    cut = []
    for i, c in enumerate(text):
        if c == ">":
            cut += [text[:i + 1], text[i:], text[:i] + ">>" + text[i + 1:]]
        if c in ",/|":
            cut += [text[:i + 1], text[:i] + c + c + text[i + 1:]]
    return cut + [text + ",", text + "/", "," + text]


@settings(max_examples=40)
@given(spelled_value())
def test_a_list_flag_is_its_value_in_both_parsers_and_a_truncation_is_refused(case):
    """Rows 2 and 5 and their neighbours. Every spelling of a value (numbers as 0.0 or 0 or 0e0, blanks, a constant
    weight as A or A>A, a role's layers in any order) is that value to the trainer and to records.py, which compares
    it in one spelling (list_text) that reads back as the value. "A>" was read as the constant A; it, ">A", "A>>B",
    empty items and trailing separators are each refused by both parsers (or, a trailing ',' of a list of layers
    being none, read alike by both)."""
    name, value, text = case
    assert T.list_value(name, text) == value == rec.list_value(name, text), text
    canonical = rec.list_text(name, value)
    assert T.list_value(name, canonical) == value and rec.list_text(name, rec.list_value(name, canonical)) == canonical
    for cut in truncations(text):
        ours, theirs = outcome(T.list_value, name, cut), outcome(rec.list_value, name, cut)
        assert ours == theirs, (name, cut, ours, theirs)
        if ">" in text and cut.endswith(">") or cut.startswith(">") or ">>" in cut:
            assert ours == "refused", (name, cut, ours)


@settings(max_examples=100)
@given(st.sampled_from(sorted(T.LIST_FLAGS)), st.text(alphabet="0123456789.,>/|:-+e nai", max_size=24))
def test_the_two_parsers_agree_on_any_text(name, text):
    """One grammar: on any text of the lists' characters the trainer and records.py read the same value, or both
    refuse it (the trainer in one line naming the flag)."""
    ours, theirs = outcome(T.list_value, name, text), outcome(rec.list_value, name, text)
    assert ours == theirs, (name, text, ours, theirs)
    if ours == "refused":
        with pytest.raises(T.ConfigError) as e:
            T.list_value(name, text)
        assert str(e.value).startswith(f"--{name}=") and "\n" not in str(e.value)

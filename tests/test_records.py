"""Tests of records/records.py: log parsing, statistics, and every subcommand.

Fixtures (see tests/fixtures/README.md): five real public 8xH100 logs with the source
stripped, real CPU logs of this repo's train_gpt.py, and a few hand-made logs in this
repo's format for parser-level cases. Broken variants are made from them in tmp_path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from conftest import run_command

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "records" / "records.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PUBLIC = sorted((FIXTURES / "speedrun-logs").glob("*.txt"))
HANDMADE = FIXTURES / "handmade"
SAME_CODE = sorted(HANDMADE.glob("b-cpu-run*.txt"))
REAL = FIXTURES / "real-cpu-logs"
REAL_SAME = [REAL / "20261122-032557-94b5fbfc.txt", REAL / "20261122-032910-b1c557b4.txt"]   # seeds 1 and 2
REAL_OLDER = REAL / "20261122-032122-6153e2e5.txt"   # an earlier train_gpt.py
RULE = "=" * 100


def _load_tool():
    spec = importlib.util.spec_from_file_location("records_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["records_tool"] = module   # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


rec = _load_tool()


def run(capsys, *argv):
    """Run the tool in-process: (exit code, stdout, stderr)."""
    code = rec.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def pure(monkeypatch):
    """Force the built-in t distribution, as on a machine without scipy."""
    monkeypatch.setattr(rec, "_stats", None)


# ---------------------------------------------------------------------------------------
# Independent reading of the public logs (plain regex over the files, not records.py)

def public_finals():
    out = []
    for path in PUBLIC:
        text = path.read_text()
        m = re.findall(r"^step:(\d+)/\1 val_loss:([\d.]+) train_time:(\d+)ms", text, re.M)
        assert len(m) == 1, path
        out.append((float(m[0][1]), int(m[0][2])))
    return out


def t4_cdf(t):
    """Closed form of Student's t CDF for 4 degrees of freedom."""
    u = t * t / 4
    return 0.5 + 3 / 8 * t / math.sqrt(1 + u) * (1 - u / (3 * (1 + u)))


# ---------------------------------------------------------------------------------------
# Statistics

T_TABLE = [  # (p, df, t_p) from printed t tables
    (0.995, 9, 3.2498), (0.99, 4, 3.7469), (0.975, 1, 12.7062), (0.95, 30, 1.6973),
    (0.975, 10, 2.2281), (0.995, 2, 9.9248), (0.9, 5, 1.4759), (0.999, 20, 3.5518),
]


@pytest.mark.parametrize("p,df,expected", T_TABLE)
def test_pure_t_quantiles_match_t_tables(pure, p, df, expected):
    assert rec.t_ppf(p, df) == pytest.approx(expected, abs=6e-5)
    assert rec.t_ppf(1 - p, df) == pytest.approx(-expected, abs=6e-5)


def test_pure_t_cdf_matches_closed_forms(pure):
    for t in [-30.0, -2.5, -0.3, 0.0, 0.7, 4.0, 1e3]:
        assert rec.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
        assert rec.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-15)
        assert rec.t_cdf(t, 4) == pytest.approx(t4_cdf(t), rel=1e-11, abs=1e-15)
    # far tails keep their relative precision (df = 1: P(T > t) ~ 1 / (pi t))
    assert rec.t_sf(1e8, 1) == pytest.approx(1 / (math.pi * 1e8), rel=1e-9)
    assert rec.t_ppf(0.5, 7) == 0.0


def test_pure_t_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in [1, 2.5, 4, 7.3, 30, 250]:
        for t in [-12.0, -1.7, -0.2, 0.4, 2.2, 9.0]:
            assert rec._t_sf_pure(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-10)
        for p in [1e-6, 0.005, 0.2, 0.8, 0.99, 0.995]:
            assert rec._t_ppf_pure(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)


def test_one_sample_and_welch_match_scipy_and_the_fallback(monkeypatch):
    a = [137.554, 137.514, 137.542, 137.635, 137.898]
    b = [136.1, 136.4, 135.9, 136.8]
    with_scipy = (rec.one_sample_less(a, 137.7), rec.welch(a, b))
    monkeypatch.setattr(rec, "_stats", None)
    t, df, p = rec.one_sample_less(a, 137.7)
    w = rec.welch(a, b)
    # by hand: t = (mean - target) / (s / sqrt(n)); Welch-Satterthwaite df
    va, vb = statistics.variance(a) / 5, statistics.variance(b) / 4
    assert t == pytest.approx((statistics.fmean(a) - 137.7) / math.sqrt(statistics.variance(a) / 5))
    assert df == 4
    assert w.df == pytest.approx((va + vb) ** 2 / (va ** 2 / 4 + vb ** 2 / 3))
    assert w.diff == pytest.approx(statistics.fmean(b) - statistics.fmean(a))
    assert (w.hi - w.lo) / 2 == pytest.approx(rec._t_ppf_pure(0.995, w.df) * math.sqrt(va + vb))
    assert with_scipy[0][2] == pytest.approx(p, rel=1e-9)
    assert with_scipy[1].lo == pytest.approx(w.lo, rel=1e-9) and with_scipy[1].p_less == pytest.approx(w.p_less)
    stats = pytest.importorskip("scipy.stats")
    assert p == pytest.approx(stats.ttest_1samp(a, 137.7, alternative="less").pvalue, rel=1e-9)
    ref = stats.ttest_ind(b, a, equal_var=False, alternative="less")
    assert w.p_less == pytest.approx(ref.pvalue, rel=1e-9)
    assert w.t == pytest.approx(ref.statistic)


def test_degenerate_spread():
    # no spread, no test (issue 38 row 3): p = 0 from a spread of 0 once "met" a target
    assert rec.one_sample_less([3.0], 3.28) is None
    assert rec.one_sample_less([3.0, 3.0], 3.28) is None
    assert rec.one_sample_less([3.5, 3.5], 3.28) is None
    w = rec.welch([2.0, 2.0], [1.0, 1.0])
    assert w.diff == -1.0 and math.isnan(w.p_less)


# ---------------------------------------------------------------------------------------
# Parsing

def test_public_log_fields():
    lg = rec.read_log(PUBLIC[0])
    assert lg.run_id == "0c17cdfd-772c-4906-8d11-141b370599a0"
    assert (lg.total_steps, lg.final_val_loss, lg.train_time_ms) == (2245, 3.2754, 137554)
    assert (lg.device, lg.gpu, lg.world_size) == ("cuda", "NVIDIA H100 80GB HBM3", 8)
    assert lg.torch == "2.10.0.dev20251115+cu126" and lg.python == "3.12.7"
    assert str(lg.date) == "2025-11-15"
    assert lg.source is None and lg.code_hash is None
    assert lg.complete, lg.problems
    assert [s for s, _, _ in lg.vals] == list(range(0, 2245, 250)) + [2245]
    assert rec.hardware_label(lg) == "8×H100"


def test_handmade_log_fields():
    lg = rec.read_log(SAME_CODE[0])
    text = SAME_CODE[0].read_text()
    source = text[:text.index(RULE)]
    assert lg.source == source
    assert lg.code_hash == hashlib.sha256(source.encode()).hexdigest() == lg.declared_hash
    assert (lg.device, lg.gpu, lg.world_size, lg.preset) == ("cpu", None, 2, "smoke")
    assert (lg.run_id, lg.total_steps, lg.final_val_loss, lg.train_time_ms) == ("handmade-cpu-run1", 6, 7.1, 5400)
    assert lg.hyperparameters["val_loss_every"] == "2" and "NOT a record run" in lg.note
    assert str(lg.date) == "2026-11-22" and lg.complete
    assert rec.hardware_label(lg) == "2×CPU" and rec.default_track(lg) == "2×CPU smoke"


def test_step_lines_are_parsed_tolerantly():
    assert rec.parse_step_line("step:5/10 train_loss:3.1 foo:bar train_time:50ms step_avg:10.00ms") == rec.StepLine(
        5, 10, {"train_loss": "3.1", "foo": "bar", "train_time": "50ms", "step_avg": "10.00ms"}, None, 3.1, 50.0)
    assert rec.parse_step_line("step:5/10 val_loss:oops train_time:50ms") == "val_loss 'oops' is not a number"
    assert rec.parse_step_line("step:5/1") == rec.StepLine(5, 1, {}, None, None, None)
    assert rec.parse_step_line("step:5/10 train_ti") == "not step:i/N key:value ..."
    assert rec.parse_step_line("step:5/10 train_time:-1ms") == rec.StepLine(5, 10, {"train_time": "-1ms"}, None,
                                                                            None, None)   # find_problems says why


def test_print_added_newline_after_the_source_is_tolerated(tmp_path):
    # print(source) adds a newline after a source that already ends in one; code_sha256 decides.
    text = SAME_CODE[0].read_text().replace("\n" + RULE, "\n\n" + RULE, 1)
    path = tmp_path / "printed.txt"
    path.write_text(text)
    lg = rec.read_log(path)
    assert lg.complete and lg.code_hash == lg.declared_hash == rec.read_log(SAME_CODE[0]).code_hash


def test_cuda_device_line_names_the_gpu(tmp_path):
    text = SAME_CODE[0].read_text().replace("device: cpu ", "device: cuda (NVIDIA A100-SXM4-80GB) ")
    text = text.replace("device:cpu", "device:cuda")
    path = tmp_path / "a100.txt"
    path.write_text(text)
    lg = rec.read_log(path)
    assert (lg.device, lg.gpu, rec.hardware_label(lg)) == ("cuda", "NVIDIA A100-SXM4-80GB", "2×A100")


# ---------------------------------------------------------------------------------------
# summarize

def test_summarize_public_numbers_checked_independently(capsys, pure):
    finals = public_finals()
    vals = [v for v, _ in finals]
    secs = [t / 1000 for _, t in finals]
    assert statistics.fmean(vals) == pytest.approx((3.2754 + 3.2781 + 3.2805 + 3.2781 + 3.2779) / 5)
    mean = sum(vals) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4)
    t = (mean - 3.28) / (sd / math.sqrt(5))
    p = t4_cdf(t)   # closed form, df = 4

    code, out, err = run(capsys, "summarize", *PUBLIC)
    assert code == 0 and err == ""
    assert f"mean {mean:.5f} ± {sd:.5f} (sample std, n = 5)" in out
    assert f"t = {t:.3f}, df = 4, p = {p:.4f} -> NOT met at p < 0.01" in out
    tsd = math.sqrt(sum((s - sum(secs) / 5) ** 2 for s in secs) / 4)
    assert (f"train time: mean {sum(secs) / 5:.3f} s ± {tsd:.3f} s, median {sorted(secs)[2]:.3f} s, "
            f"min {min(secs):.3f} s, max {max(secs):.3f} s") in out
    assert "8×H100 (NVIDIA H100 80GB HBM3, world size 8)" in out
    assert "not embedded (source stripped) in 5 log(s)" in out
    rows = [ln for ln in out.splitlines() if re.match(r"[0-9a-f]{8}-", ln)]
    assert len(rows) == 5
    for path, (v, ms), row in zip(PUBLIC, finals, rows):
        assert row.split() == [path.stem, "2245", f"{v:.4f}", f"{ms / 1000:.3f}", f"{ms / 2245:.2f}", "8",
                               "NVIDIA", "H100", "80GB", "HBM3", "2.10.0.dev20251115+cu126"]
    # the columns line up: every row has its numbers at the same offsets
    assert len({ln.index(" 2245 ") for ln in rows}) == 1


def test_summarize_format_b_and_incomplete_logs(capsys):
    code, out, err = run(capsys, "summarize", *SAME_CODE, HANDMADE / "b-cuda-failed.txt", "--target", "7.5")
    assert code == 0
    assert "runs: 4 (3 complete)" in out
    assert "final val loss: mean 7.10000 ± 0.02000 (sample std, n = 3)" in out
    assert re.search(r"handmade-cuda-failed\s+4/6\s+-", out)
    assert "b-cuda-failed.txt: left out of the statistics: run failed after step 4 of 6: " \
           "error: non-finite loss at step 5" in err


@pytest.mark.parametrize("content,reason", [
    (b"", "empty file"),
    (b"hello\nworld\n", "no line of 100 '='"),
    (b"iter 0: loss 10.98, time 120.3ms\niter 1: loss 10.2, time 99.1ms\n", "no line of 100 '='"),
    (("=" * 100 + "\nsome notes\n" + "=" * 100 + "\nnothing else\n").encode(), "no 'step:N/M' lines"),
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
])
def test_not_a_speedrun_log(capsys, tmp_path, content, reason):
    path = tmp_path / "other.txt"
    path.write_bytes(content)
    for argv in (["summarize", path], ["verify", path], ["extract", path, "-o", tmp_path / "x.py"]):
        code, out, err = run(capsys, *argv)
        assert code == 1
        assert f"{path}: not a speedrun log ({reason}" in out + err


def test_missing_file_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "summarize", tmp_path / "nope.txt")
    assert code == 1 and err == f"error: {tmp_path / 'nope.txt'}: cannot read (No such file or directory)\n"


# ---------------------------------------------------------------------------------------
# verify

def test_verify_public_logs(capsys):
    # The five runs average 3.2780 but p = 0.034 against 3.28: not a p < 0.01 claim on their own.
    code, out, err = run(capsys, "verify", *PUBLIC)
    assert code == 1
    assert out.startswith("FAIL all 5 logs: target 3.28: one-sided t-test") and "NOT met" in out
    assert "5 of 5 logs have no embedded source (stripped)" in err
    code, out, err = run(capsys, "verify", *PUBLIC, "--target", "3.285")
    assert code == 0 and out.startswith("OK 5 log(s): complete; no embedded source to compare")
    code, out, _ = run(capsys, "verify", *PUBLIC, "--target", "3.285", "--require-source")
    assert code == 1
    assert out.count("no embedded source (stripped): cannot show which code ran") == 5


def test_verify_single_log_rule(capsys):
    code, out, _ = run(capsys, "verify", PUBLIC[0])
    assert code == 0 and "single run, final val loss 3.2754 <= 3.28 -> met" in out
    code, out, _ = run(capsys, "verify", PUBLIC[0], "--target", "3.27")
    assert code == 1 and out.startswith(f"FAIL {PUBLIC[0]}: target 3.27: single run")


def edited(tmp_path, source: Path, name: str, edit) -> Path:
    path = tmp_path / name
    path.write_text(edit(source.read_text()))
    return path


@pytest.mark.parametrize("edit,reason", [
    (lambda t: t[:t.index("step:1100/")], "truncated: last step 1099 of 2245"),
    (lambda t: t[:t.index("step:1100/") + 20], "last line is cut off (no newline at the end): 'step:1100/2245 train'"),
    (lambda t: t[:t.index("val_loss:3.2754") + 12], "last line is cut off"),
    (lambda t: re.sub(r"^step:17/2245 .*\n", "", t, flags=re.M), "missing step lines: 17"),
    (lambda t: re.sub(r"^step:500/2245 val.*\n", "", t, flags=re.M), "missing val_loss at steps 500"),
    (lambda t: re.sub(r"^step:0/2245 val.*\n", "", t, flags=re.M), "missing val_loss at steps 0"),
    (lambda t: re.sub(r"^step:2245/2245 val.*\n", "", t, flags=re.M), "no final val_loss at step 2245"),
    (lambda t: re.sub(r"^peak memory.*\n", "", t, flags=re.M), "no end-of-run 'peak memory' line"),
    (lambda t: t + t[t.index("step:0/"):], "step lines out of order"),
])
def test_verify_broken_public_logs(capsys, tmp_path, edit, reason):
    bad = edited(tmp_path, PUBLIC[0], "bad.txt", edit)
    code, out, _ = run(capsys, "verify", bad, *PUBLIC[1:], "--target", "3.285")
    assert code == 1
    assert f"FAIL {bad}: {reason}" in out
    assert all(ln.startswith("FAIL ") for ln in out.splitlines())


def test_verify_format_b(capsys, tmp_path):
    code, out, _ = run(capsys, "verify", *SAME_CODE, "--target", "7.5", "--require-source")
    assert code == 0, out
    assert f"same code {rec.read_log(SAME_CODE[0]).code_hash[:12]}" in out

    code, out, _ = run(capsys, "verify", *SAME_CODE, HANDMADE / "b-cpu-other-code.txt", "--target", "7.5")
    assert code == 1
    assert out.strip() == (f"FAIL {HANDMADE / 'b-cpu-other-code.txt'}: ran different code (e3301353b72a) "
                           "than 3 other log(s) (968e941688b2)")

    code, out, _ = run(capsys, "verify", HANDMADE / "b-cuda-failed.txt", "--target", "7.5")
    assert code == 1 and "run failed after step 4 of 6: error: non-finite loss at step 5" in out

    tampered = edited(tmp_path, SAME_CODE[0], "tampered.txt", lambda t: t.replace("trainer A", "trainer Z", 1))
    code, out, _ = run(capsys, "verify", tampered, "--target", "7.5")
    assert code == 1 and f"FAIL {tampered}: edited: embedded source hashes to" in out

    fudged = edited(tmp_path, SAME_CODE[0], "fudged.txt",
                    lambda t: t.replace("step:6/6 val_loss:7.1000", "step:6/6 val_loss:3.1000"))
    code, out, _ = run(capsys, "verify", fudged, "--target", "7.5")
    assert code == 1 and "summary final_val_loss 7.1 disagrees with step 6 val_loss 3.1" in out

    no_summary = edited(tmp_path, SAME_CODE[0], "nosum.txt", lambda t: t[:t.index("summary:")])
    code, out, _ = run(capsys, "verify", no_summary, "--target", "7.5")
    assert code == 1 and "no end-of-run 'summary:' line" in out

    no_val = edited(tmp_path, SAME_CODE[0], "noval.txt", lambda t: re.sub(r"^step:4/6 val.*\n", "", t, flags=re.M))
    code, out, _ = run(capsys, "verify", no_val, "--target", "7.5")
    assert code == 1 and "missing val_loss at steps 4" in out

    resumed = edited(tmp_path, SAME_CODE[0], "resumed.txt", lambda t: re.sub(
        r"^step:0/6 val.*\n(step:1/6.*\n)(step:2/6.*\n){2}", "resumed from checkpoints/x/step_000002 at step 2\n",
        t, flags=re.M))
    code, out, _ = run(capsys, "verify", resumed, "--target", "7.5")
    assert code == 1 and out.strip() == (f"FAIL {resumed}: resumed from a checkpoint at step 2: "
                                         "steps 1..2 are not in this log")

    def synthetic_header(text):
        at = text.rindex("hyperparameters:\n") + len("hyperparameters:\n")
        return text[:at] + "  synthetic = True\n" + text[at:]

    synthetic = edited(tmp_path, SAME_CODE[0], "synthetic.txt", synthetic_header)
    code, out, _ = run(capsys, "verify", synthetic, "--target", "7.5")
    assert code == 1 and "trained on synthetic tokens" in out


def test_verify_never_prints_a_traceback(tmp_path):
    bad = tmp_path / "empty.txt"
    bad.write_text("")
    proc = run_command([sys.executable, str(TOOL), "verify", str(bad), str(PUBLIC[0])], timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.strip() == f"FAIL {bad}: not a speedrun log (empty file)"
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------
# extract

def test_extract_writes_the_exact_source(capsys, tmp_path):
    out_file = tmp_path / "train_gpt.py"
    out_file.write_text("old content")
    code, out, _ = run(capsys, "extract", SAME_CODE[0], "-o", out_file)
    assert code == 0
    text = SAME_CODE[0].read_text()
    assert out_file.read_text() == text[:text.index(RULE)]
    assert hashlib.sha256(out_file.read_bytes()).hexdigest() in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_gpt.py"]   # no temp file left


def test_extract_refuses_stripped_and_edited_logs(capsys, tmp_path):
    code, _, err = run(capsys, "extract", PUBLIC[0], "-o", tmp_path / "x.py")
    assert code == 1 and err == (f"error: {PUBLIC[0]}: no embedded source (the log starts at the '=' line: "
                                 "it was stripped)\n")
    tampered = edited(tmp_path, SAME_CODE[0], "tampered.txt", lambda t: t.replace("trainer A", "trainer Z", 1))
    code, _, err = run(capsys, "extract", tampered, "-o", tmp_path / "x.py")
    assert code == 1 and "does not match its code_sha256 line (the log was edited)" in err
    assert not (tmp_path / "x.py").exists()


# ---------------------------------------------------------------------------------------
# compare

def faster_copies(tmp_path, delta_ms: int) -> list[Path]:
    """The public logs with each step's train_time shifted by delta_ms * step / steps and their first validation
    after step 0 0.0001 higher: a stand-in for a candidate that reaches the same final losses at other step times.
    (A log whose losses equal another's at every line is a copy of it, whatever its times, which compare refuses:
    issue 53 row 3. The public logs name no code, so nothing says the candidate's is another.)"""
    paths = []
    for src in PUBLIC:
        def shift(m):
            return f"{m[1]}{int(m[4]) + round(delta_ms * int(m[2]) / int(m[3]))}ms"
        text = re.sub(r"^(step:(\d+)/(\d+) .*train_time:)(\d+)ms", shift, src.read_text(), flags=re.M)
        text = re.sub(r"^(step:[1-9]\d*/\d+ val_loss:)(\S+)", lambda m: f"{m[1]}{float(m[2]) + 0.0001:.4f}", text,
                      count=1, flags=re.M)
        path = tmp_path / f"cand-{src.name}"
        path.write_text(text)
        paths.append(path)
    return paths


def test_compare_public_baseline_with_a_faster_candidate(capsys, tmp_path, pure):
    cand = faster_copies(tmp_path, -1500)
    code, out, err = run(capsys, "compare", "--baseline", *PUBLIC, "--candidate", *cand)
    assert code == 0 and err == ""
    base = [t / 1000 for _, t in public_finals()]
    new = [t - 1.5 for t in base]
    w = rec.welch(base, new)
    assert w.diff == pytest.approx(-1.5)
    assert f"{w.diff:+.3f} s, 99% CI [{w.lo:+.3f}, {w.hi:+.3f}] s" in out
    assert "candidate faster at p < 0.01 (one-sided Welch): yes" in out
    assert "final val loss difference (candidate - baseline): +0.00000" in out
    stats = pytest.importorskip("scipy.stats")
    ref = stats.ttest_ind(new, base, equal_var=False, alternative="less").pvalue
    assert f"(p = {rec.fmt_p(ref)})" in out


def test_compare_not_faster(capsys, tmp_path):
    cand = faster_copies(tmp_path, -50)   # 0.05 s against a 0.16 s spread
    code, out, _ = run(capsys, "compare", "--baseline", *PUBLIC, "--candidate", *cand)
    assert code == 0 and "candidate faster at p < 0.01 (one-sided Welch): no" in out


def test_compare_refuses_different_hardware(capsys):
    code, out, err = run(capsys, "compare", "--baseline", *PUBLIC, "--candidate", *SAME_CODE)
    assert code == 1 and out == ""
    assert err.startswith("error: different hardware: baseline 8×H100 (NVIDIA H100 80GB HBM3, world size 8) "
                          "vs candidate 2×CPU (world size 2)")
    code, out, err = run(capsys, "compare", "--baseline", *PUBLIC, "--candidate", *SAME_CODE,
                         "--allow-different-hardware")
    assert code == 0 and "warning: different hardware" in err and "train time difference" in out


def test_compare_needs_complete_runs(capsys):
    code, _, err = run(capsys, "compare", "--baseline", *SAME_CODE, "--candidate", *SAME_CODE[:1])
    assert code == 1 and "candidate has 1 run: Welch's t-test needs at least 2 runs per group" in err
    code, _, err = run(capsys, "compare", "--baseline", *SAME_CODE,
                       "--candidate", SAME_CODE[0], HANDMADE / "b-cuda-failed.txt")
    assert code == 1 and "b-cuda-failed.txt: incomplete log (run failed" in err


# ---------------------------------------------------------------------------------------
# plot

def test_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    code, out, err = run(capsys, "plot", *PUBLIC, "-o", tmp_path / "p.png")
    assert code == 1 and out == ""
    assert err == "error: plotting needs matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "p.png").exists()


def test_plot_with_matplotlib(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    code, out, _ = run(capsys, "plot", *PUBLIC, *SAME_CODE, HANDMADE / "b-cpu-other-code.txt", "-o", png)
    assert code == 0 and "9 runs, 3 code version(s)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]


# ---------------------------------------------------------------------------------------
# new and table

README = "# Repo\n\nintro\n\n<!-- records:begin -->\nstale\n<!-- records:end -->\n\nclosing words\n"


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "README.md").write_text(README)
    return tmp_path / "records"


def test_new_files_a_record_and_the_table(capsys, repo):
    code, out, _ = run(capsys, "new", "adamsync", *PUBLIC, "--records-dir", repo, "--target", "3.285")
    assert code == 0, out
    folder = repo / "2025-11-15_adamsync"
    assert out.splitlines()[0] == f"created {folder} (5 logs, track 8×H100)"
    for src in PUBLIC:
        assert (folder / src.name).read_bytes() == src.read_bytes()
    readme = (folder / "README.md").read_text()
    assert "Track: **8×H100**. Hardware, from the logs: 8×H100 (NVIDIA H100 80GB HBM3, world size 8)" in readme
    assert "final val loss: mean 3.27800 ± 0.00181 (sample std, n = 5)" in readme
    assert "t = -8.669, df = 4" in readme and "met at p < 0.01" in readme
    assert "train time: mean 137.629 s ± 0.157 s, median 137.554 s" in readme
    assert "cannot be re-run from this folder" in readme

    code, out, _ = run(capsys, "new", "smoke", *SAME_CODE, "--records-dir", repo, "--target", "7.5",
                       "--track", "CPU smoke")
    assert code == 0, out
    smoke = (repo / "2026-11-22_smoke" / "README.md").read_text()
    assert "NOT a record run" in smoke
    h = rec.read_log(SAME_CODE[0]).code_hash
    assert (f"python records/records.py extract records/2026-11-22_smoke/b-cpu-run1.txt -o train_gpt_{h[:8]}.py"
            f" && \\\n  torchrun --standalone --nproc_per_node=2 train_gpt_{h[:8]}.py \\\n    --preset=smoke") in smoke
    assert "These differ between the runs: seed" in smoke

    table = (repo / "RECORDS.md").read_text()
    h100 = table.index("## 8×H100 (NVIDIA H100 80GB HBM3, world size 8)")
    cpu = table.index("## 2×CPU (world size 2)")
    assert h100 < table.index("[adamsync](2025-11-15_adamsync/README.md) | 8×H100 | 5 | 3.2780 ± 0.0018") < cpu
    assert cpu < table.index(f"[smoke](2026-11-22_smoke/README.md) | CPU smoke | 3 | 7.1000 ± 0.0200 | 7.5 | "
                             f"0.0004 | 5.43 s ± 0.03 | `{h[:12]}`")
    root = (repo.parent / "README.md").read_text()
    assert root.startswith("# Repo\n\nintro\n\n<!-- records:begin -->\n### 8×H100")
    assert root.endswith("<!-- records:end -->\n\nclosing words\n") and "stale" not in root
    assert "(records/2026-11-22_smoke/README.md)" in root

    # The table is recomputed from the logs: a record folder that loses its logs leaves it.
    for path in (repo / "2026-11-22_smoke").glob("*.txt"):
        path.unlink()
    code, out, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and "2026-11-22_smoke: left out of the table (no logs)" in err
    assert "smoke" not in (repo / "RECORDS.md").read_text() and "2×CPU" not in (repo / "RECORDS.md").read_text()


def test_new_refuses_bad_claims(capsys, repo, tmp_path):
    code, out, err = run(capsys, "new", "x", *PUBLIC, "--records-dir", repo)   # p = 0.034 at 3.28
    assert code == 1 and "FAIL all 5 logs" in out and "no record filed: the logs fail verify" in err
    code, _, err = run(capsys, "new", "x", *SAME_CODE, "--records-dir", repo, "--target", "7.5", "--track", "8xH100")
    assert code == 1 and err == "error: track '8xH100' names H100 but the logs ran on 2×CPU\n"
    code, _, err = run(capsys, "new", "x", *PUBLIC, "--records-dir", repo, "--target", "3.285", "--track", "CPU")
    assert code == 1 and "names CPU but the logs ran on 8×H100" in err
    code, _, err = run(capsys, "new", "x", *SAME_CODE, HANDMADE / "b-cpu-other-code.txt", "--records-dir", repo,
                       "--target", "7.5")
    assert code == 1
    code, _, err = run(capsys, "new", "../x", *SAME_CODE, "--records-dir", repo, "--target", "7.5")
    assert code == 1 and "record name '../x'" in err
    assert not repo.exists() or not any(p for p in repo.iterdir() if p.name != "RECORDS.md")

    code, _, _ = run(capsys, "new", "x", *SAME_CODE, "--records-dir", repo, "--target", "7.5", "--date", "2030-01-02")
    assert code == 0 and (repo / "2030-01-02_x" / "record.json").exists()
    code, _, err = run(capsys, "new", "x", *SAME_CODE, "--records-dir", repo, "--target", "7.5", "--date", "2030-01-02")
    assert code == 1 and err.endswith("2030-01-02_x: already exists\n")
    assert [p.name for p in repo.iterdir() if p.name.startswith(".")] == []   # no half-made folder


def test_table_without_records_or_markers(capsys, tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "README.md").write_text("no markers here\n")
    (records / "__pycache__").mkdir()
    code, out, err = run(capsys, "table", "--records-dir", records)
    assert code == 0 and err == ""
    assert "No records yet." in (records / "RECORDS.md").read_text()
    assert (tmp_path / "README.md").read_text() == "no markers here\n"


def test_track_conflicts():
    cpu, h100 = rec.read_log(SAME_CODE[0]), rec.read_log(PUBLIC[0])
    assert rec.track_conflict("CPU smoke", cpu) is None
    assert rec.track_conflict("8×H100", h100) is None and rec.track_conflict("8xH100 main", h100) is None
    assert rec.track_conflict("4xH100", h100) == "track '4xH100' names 4 devices but the logs ran on 8×H100"
    assert rec.track_conflict("8xA100", h100) and rec.track_conflict("GPU smoke", cpu)


# ---------------------------------------------------------------------------------------
# Real CPU logs of this repo's train_gpt.py (smoke preset, 3 steps)

def test_real_logs_parse(capsys):
    for path in REAL_SAME + [REAL_OLDER]:
        lg = rec.read_log(path)
        assert lg.complete, lg.problems
        assert (lg.device, lg.gpu, lg.world_size, lg.preset, lg.total_steps) == ("cpu", None, 1, "smoke", 3)
        assert [s for s, _, _ in lg.vals] == [0, 1, 2, 3]
        assert lg.run_id == path.stem and lg.code_hash == lg.declared_hash
        text = path.read_text()
        summary = re.search(r"^summary: final_val_loss:([\d.]+) train_time:(\d+)ms", text, re.M)
        assert (lg.final_val_loss, lg.train_time_ms) == (float(summary.group(1)), int(summary.group(2)))
        assert rec.default_track(lg) == "1×CPU smoke"


def test_real_logs_summarize_verify_extract(capsys, tmp_path):
    code, out, _ = run(capsys, "summarize", *REAL_SAME)
    finals = [rec.read_log(p).final_val_loss for p in REAL_SAME]
    assert code == 0 and f"final val loss: mean {statistics.fmean(finals):.5f}" in out
    assert "1×CPU (world size 1)" in out

    code, out, _ = run(capsys, "verify", *REAL_SAME, "--target", "8", "--require-source")
    assert code == 0, out
    code, out, _ = run(capsys, "verify", *REAL_SAME, REAL_OLDER, "--target", "8")
    assert code == 1 and f"FAIL {REAL_OLDER}: ran different code (b18d4efad72e) than 2 other log(s)" in out

    target = tmp_path / "train_gpt_rerun.py"
    code, out, _ = run(capsys, "extract", REAL_SAME[0], "-o", target)
    assert code == 0
    declared = re.search(r"^code_sha256: (\w+)$", REAL_SAME[0].read_text(), re.M).group(1)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == declared
    text = REAL_SAME[0].read_text()
    assert target.read_text() == text[:text.index(RULE) - 1]   # less the newline the trainer's print added


def test_real_logs_new_record(capsys, repo):
    code, out, _ = run(capsys, "new", "smoke", *REAL_SAME, "--records-dir", repo, "--target", "8")
    assert code == 0, out
    readme = (repo / "2026-11-22_smoke" / "README.md").read_text()
    assert "Track: **1×CPU smoke**" in readme and "NOT a record run" in readme
    flags = readme[readme.index("torchrun"):readme.index("```", readme.index("torchrun"))]
    assert "--nproc_per_node=1" in flags and "--preset=smoke" in flags and "--num_iterations=3" in flags
    assert "--train_files=" in flags and "logs_dir" not in flags and "run_id" not in flags
    assert "These differ between the runs: seed" in readme
    assert "| 1×CPU smoke | 2 |" in (repo / "RECORDS.md").read_text()


# ---------------------------------------------------------------------------------------
# command line

def test_help_documents_every_subcommand(capsys):
    for argv in [["--help"]] + [[sub, "--help"] for sub in ["summarize", "compare", "verify", "extract", "plot",
                                                             "new", "table"]]:
        with pytest.raises(SystemExit) as exit_:
            rec.build_parser().parse_args(argv)
        assert exit_.value.code == 0
        assert "usage: records.py" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rec.build_parser().parse_args(["--help"])
    top = capsys.readouterr().out
    for sub in ["summarize", "compare", "verify", "extract", "plot", "new", "table", "one-sided one-sample t-test"]:
        assert sub in top


# ---------------------------------------------------------------------------------------
# Records integrity: distinct runs of one experiment, finite targets, readable files

def md(text: str) -> str:
    """text as the record files write log text: markdown's inline syntax characters backslash-escaped."""
    return re.sub(r"([\\`*_\[\]<>|&~$])", r"\\\1", text)


def with_hparams(text: str, **fields) -> str:
    """The log text with these `  name = value` hyperparameter lines set (replaced, or added to the section)."""
    for name, value in fields.items():
        line = f"  {name} = {value}\n"
        text, n = re.subn(rf"^  {name} = .*\n", line, text, flags=re.M)
        if not n:
            at = text.index("hyperparameters:\n") + len("hyperparameters:\n")
            text = text[:at] + line + text[at:]
    return text


def dup_case(how, tmp_path, monkeypatch):
    """(paths to pass, the expected 'duplicate runs: ...' text, target) for one way of giving a run twice."""
    a = tmp_path / "a.txt"
    if how in ("same path twice", "./x and x", "symlink", "hard link", "renamed copies"):
        a.write_bytes(PUBLIC[0].read_bytes())
        if how == "same path twice":
            return [a, a], f"{a} is given twice", "3.285"
        if how == "./x and x":
            monkeypatch.chdir(tmp_path)
            return ["a.txt", "./a.txt"], "a.txt is given twice", "3.285"
        b = tmp_path / "b.txt"
        if how == "symlink":
            b.symlink_to(a)
            return [a, b], f"{b} duplicates {a} (the same file)", "3.285"
        if how == "hard link":
            b.hardlink_to(a)
            return [a, b], f"{b} duplicates {a} (the same file)", "3.285"
        # the review's case: three copies of one public log, each under its own name
        c = tmp_path / "c.txt"
        b.write_bytes(a.read_bytes())
        c.write_bytes(a.read_bytes())
        return [a, b, c], f"{b} duplicates {a} (identical step lines); {c} duplicates {a} (identical step lines)", \
            "3.285"
    if how == "copy with an edited run id":
        b = edited(tmp_path, SAME_CODE[0], "b.txt", lambda t: t.replace("run_id: handmade-cpu-run1", "run_id: zzz"))
        return [SAME_CODE[0], SAME_CODE[1], b], f"{b} duplicates {SAME_CODE[0]} (identical step lines)", "7.5"
    assert how == "same run id"   # other step lines, the run id of another log
    b = edited(tmp_path, SAME_CODE[1], "b.txt",
               lambda t: t.replace("run_id: handmade-cpu-run2", "run_id: handmade-cpu-run1"))
    return [SAME_CODE[0], b, SAME_CODE[2]], f"{b} duplicates {SAME_CODE[0]} (same run id handmade-cpu-run1)", "7.5"


DUP_CASES = ["same path twice", "./x and x", "symlink", "hard link", "renamed copies", "copy with an edited run id",
             "same run id"]


@pytest.mark.parametrize("how", DUP_CASES)
def test_verify_summarize_new_refuse_duplicate_runs(capsys, tmp_path, monkeypatch, repo, how):
    paths, dup, target = dup_case(how, tmp_path, monkeypatch)
    code, out, _ = run(capsys, "verify", *paths, "--target", target)
    assert code == 1 and f"FAIL duplicate runs: {dup}" in out.splitlines()
    code, out, err = run(capsys, "summarize", *paths, "--target", target)
    assert (code, out, err) == (1, "", f"error: duplicate runs: {dup}\n")
    code, out, err = run(capsys, "new", "dup", *paths, "--target", target, "--records-dir", repo)
    assert code == 1 and f"FAIL duplicate runs: {dup}" in out.splitlines()
    assert err.endswith("error: no record filed: the logs fail verify (reasons above)\n")
    assert not repo.exists()


def test_compare_refuses_duplicate_runs(capsys, tmp_path):
    code, out, err = run(capsys, "compare", "--baseline", *PUBLIC, "--candidate", *PUBLIC)   # identical groups
    assert code == 1 and out == ""
    assert err.startswith(f"error: duplicate runs: candidate {PUBLIC[0]} duplicates baseline {PUBLIC[0]} (the same "
                          f"file); candidate {PUBLIC[1]} duplicates") and err.count("\n") == 1
    code, _, err = run(capsys, "compare", "--baseline", *PUBLIC[:3], "--candidate", PUBLIC[2], *PUBLIC[3:])
    assert code == 1 and err == f"error: duplicate runs: candidate {PUBLIC[2]} duplicates baseline {PUBLIC[2]} " \
                                "(the same file)\n"
    copy = tmp_path / "renamed.txt"
    copy.write_bytes(PUBLIC[1].read_bytes())
    code, _, err = run(capsys, "compare", "--baseline", *PUBLIC[:3], "--candidate", copy, *PUBLIC[3:])
    assert code == 1 and err == f"error: duplicate runs: candidate {copy} duplicates baseline {PUBLIC[1]} " \
                                "(identical step lines)\n"


def test_runs_that_stopped_at_step_0_are_not_duplicates(capsys, tmp_path):
    # Same seed, same step-0 val line: nothing timed tells them apart, and nothing says they are one run.
    cut = [edited(tmp_path, SAME_CODE[0], f"cut{i}.txt", lambda t, i=i: t[:t.index("step:1/")].replace(
        "run_id: handmade-cpu-run1", f"run_id: cut{i}")) for i in (1, 2)]
    code, out, _ = run(capsys, "summarize", *cut)
    assert code == 0 and "runs: 2 (0 complete)" in out


EXPERIMENT_CASES = [   # (field, its value in two logs, in the third)
    ("train_files", "data/fineweb10B/fineweb_train_*.bin", "data/other/train_*.bin"),
    ("val_files", "data/fineweb10B/fineweb_val_*.bin", "data/fineweb10B/fineweb_train_000001.bin"),
    ("val_tokens", "10485760", "1048576"),
    ("val_seq_len", "262144", "65536"),
    ("repeat_data", "False", "True"),
    ("stage_batch_tokens", "131072,262144,393216", "131072,262144,524288"),
    ("micro_batches", "8", "8,8,16"),
]


def experiment_logs(tmp_path, field, same, other):
    return [edited(tmp_path, src, src.name, lambda t, v=v: with_hparams(t, **{field: v}))
            for src, v in zip(SAME_CODE, [same, same, other])]


@pytest.mark.parametrize("field,same,other", EXPERIMENT_CASES)
def test_verify_and_new_refuse_runs_of_different_experiments(capsys, tmp_path, repo, field, same, other):
    logs = experiment_logs(tmp_path, field, same, other)
    line = (f"FAIL not the same experiment: {field} is {same} in {logs[0]}, {logs[1]}; {other} in {logs[2]} "
            f"(--allow-differences={field} if that is intended)")
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert (code, out) == (1, line + "\n")
    code, out, err = run(capsys, "new", "mixed", *logs, "--target", "7.5", "--records-dir", repo)
    assert (code, out) == (1, line + "\n") and not repo.exists()

    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5", "--allow-differences", f"seed,{field}")
    assert code == 0 and f"; runs differ in {field} (allowed); target 7.5" in out
    code, out, _ = run(capsys, "new", "mixed", *logs, "--target", "7.5", "--records-dir", repo,
                       "--allow-differences", field)
    assert code == 0, out
    folder = repo / "2026-11-22_mixed"
    readme = (folder / "README.md").read_text()
    assert f"**Not one experiment**: filed with `--allow-differences={field}`" in readme
    assert f"- {md(field)} is {md(same)} in b-cpu-run1.txt, b-cpu-run2.txt; {md(other)} in b-cpu-run3.txt\n" in readme
    assert rec.json.loads((folder / "record.json").read_text())["allowed_differences"] == [field]
    assert "[mixed](" in (repo / "RECORDS.md").read_text()   # the table keeps a record that declares it

    # ... and leaves out one whose record.json does not
    meta = rec.json.loads((folder / "record.json").read_text())
    del meta["allowed_differences"]
    (folder / "record.json").write_text(rec.json.dumps(meta))
    code, _, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and f"left out of the table (its runs differ in {field}, which record.json does not allow)" in err


def test_experiment_differences_steps_missing_fields_and_free_fields(capsys, tmp_path):
    def shorter(t):   # a complete 4-step run of the same code
        t = t[:t.index("step:5/")].replace("/6 ", "/4 ").replace("num_iterations = 6", "num_iterations = 4")
        return t + "summary: final_val_loss:8.1000 train_time:3600ms steps:4 world_size:2 device:cpu\n"
    short = edited(tmp_path, SAME_CODE[2], "short.txt", shorter)
    assert rec.read_log(short).complete
    code, out, _ = run(capsys, "verify", *SAME_CODE[:2], short, "--target", "8.5")
    assert code == 1 and (f"FAIL not the same experiment: num_iterations is 6 in {SAME_CODE[0]}, {SAME_CODE[1]}; 4 "
                          f"in {short} (--allow-differences=num_iterations if that is intended)" in out.splitlines())

    logged = [edited(tmp_path, src, src.name, lambda t: with_hparams(t, repeat_data="False")) for src in SAME_CODE[:2]]
    code, out, _ = run(capsys, "verify", *logged, SAME_CODE[2], "--target", "7.5")
    assert code == 1 and f"repeat_data is False in {logged[0]}, {logged[1]}; not logged in {SAME_CODE[2]}" in out

    # The seed, where files go and the device flag may differ between repeats of one experiment.
    free = edited(tmp_path, SAME_CODE[2], "free.txt", lambda t: with_hparams(
        t, logs_dir="/elsewhere", checkpoint_dir="ck", save_every="2", pg_timeout_s="60", device="cpu"))
    code, out, _ = run(capsys, "verify", *SAME_CODE[:2], free, "--target", "7.5")
    assert code == 0 and "runs differ" not in out

    code, _, err = run(capsys, "verify", *SAME_CODE, "--target", "7.5", "--allow-differences", "bach_tokens")
    assert code == 1 and err == ("error: --allow-differences: no log records a field 'bach_tokens' (the fields are "
                                 "the hyperparameter names in the logs' headers, num_iterations and world_size)\n")


def test_experiment_differences_of_public_logs(capsys, tmp_path):
    # Public logs record no hyperparameters: the number of steps and the world size are all that can be
    # compared (their code may scale the global batch with the world size).
    def four_gpus(t):
        return re.sub(r"^\|   [4-7]  NVIDIA H100.*\n", "", t, flags=re.M)
    four = edited(tmp_path, PUBLIC[3], "four.txt", four_gpus)
    assert rec.read_log(four).world_size == 4
    code, out, err = run(capsys, "verify", *PUBLIC[:3], four, "--target", "3.285")
    assert code == 1 and out == (f"FAIL not the same experiment: world_size is 8 in {PUBLIC[0]}, {PUBLIC[1]}, "
                                 f"{PUBLIC[2]}; 4 in {four} (--allow-differences=world_size if that is intended)\n")
    assert "4 of 4 logs record no hyperparameters: of their settings only the number of steps and the world " \
           "size can be compared" in err

    def shorter(t):
        t = t[:t.index("step:2001/")].replace("/2245 ", "/2000 ")
        return t + "peak memory allocated: 29244 MiB reserved: 44256 MiB\n"
    short = edited(tmp_path, PUBLIC[3], "short.txt", shorter)
    assert rec.read_log(short).complete
    code, out, _ = run(capsys, "verify", *PUBLIC[:3], short, "--target", "3.285")
    assert code == 1 and (f"FAIL not the same experiment: num_iterations is 2245 in {PUBLIC[0]}, {PUBLIC[1]}, "
                          f"{PUBLIC[2]}; 2000 in {short} (--allow-differences=num_iterations if that is intended)"
                          in out.splitlines())


def test_many_differences_are_capped(capsys):
    # Two trainers' logs differ in most fields: five lines, then one naming the rest.
    code, out, _ = run(capsys, "verify", *REAL_SAME, *SAME_CODE[:2], "--target", "8")
    lines = [ln for ln in out.splitlines() if "not the same experiment" in ln]
    assert code == 1 and len(lines) == 6
    assert lines[0].startswith("FAIL not the same experiment: num_iterations is 3 in")
    assert lines[1].startswith("FAIL not the same experiment: train_files is data/shakespeare/shakespeare_train_*.bin"
                               f" in {REAL_SAME[0]}, {REAL_SAME[1]}; not logged in {SAME_CODE[0]}, {SAME_CODE[1]}")
    assert re.fullmatch(r"FAIL not the same experiment: \d+ more fields differ: [\w, ]+", lines[5])


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-3.28"])
@pytest.mark.parametrize("command", ["verify", "summarize", "new"])
def test_targets_must_be_finite_and_positive(capsys, repo, command, value):
    args = [command] + (["x"] if command == "new" else []) + [*PUBLIC, f"--target={value}"]
    args += ["--records-dir", repo] if command == "new" else []
    with pytest.raises(SystemExit) as exit_:
        rec.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines()[-1] == (f"records.py {command}: error: argument --target: target '{value}' must be a "
                                    "finite number > 0")
    assert not repo.exists()


def test_table_leaves_out_a_record_holding_a_run_twice(capsys, repo):
    code, _, _ = run(capsys, "new", "smoke", *SAME_CODE, "--target", "7.5", "--records-dir", repo)
    folder = repo / "2026-11-22_smoke"
    (folder / "b-cpu-run4.txt").write_bytes(SAME_CODE[2].read_bytes())   # a fourth "run"
    code, _, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and (f"left out of the table (duplicate runs: {folder / 'b-cpu-run4.txt'} duplicates "
                          f"{folder / 'b-cpu-run3.txt'} (same run id handmade-cpu-run3 and identical step lines))") in err
    assert "[smoke](" not in (repo / "RECORDS.md").read_text()


def test_table_leaves_out_a_record_with_an_unusable_target(capsys, repo):
    code, _, _ = run(capsys, "new", "smoke", *SAME_CODE, "--target", "7.5", "--records-dir", repo)
    folder = repo / "2026-11-22_smoke"
    meta = rec.json.loads((folder / "record.json").read_text())
    (folder / "record.json").write_text(rec.json.dumps({**meta, "target": math.inf}))   # `Infinity`: met by anything
    code, _, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and f"{folder}/record.json: target inf must be a finite number > 0: left out" in err
    assert "[smoke](" not in (repo / "RECORDS.md").read_text()
    (folder / "record.json").write_text(rec.json.dumps({**meta, "target": "low"}))
    code, _, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and f"{folder}/record.json: target 'low' is not a number: left out" in err


@pytest.fixture
def private_umask():
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_written_files_are_readable_whatever_the_umask(capsys, repo, tmp_path, private_umask):
    code, out, _ = run(capsys, "new", "smoke", *SAME_CODE, "--target", "7.5", "--records-dir", repo)
    assert code == 0, out
    folder = repo / "2026-11-22_smoke"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "b-cpu-run1.txt", "b-cpu-run2.txt",
                                                       "b-cpu-run3.txt", "record.json"]
    for path in [repo, folder]:
        assert oct(path.stat().st_mode & 0o777) == "0o755", path
    for path in [*folder.iterdir(), repo / "RECORDS.md", repo.parent / "README.md"]:
        assert oct(path.stat().st_mode & 0o777) == "0o644", path
    code, _, _ = run(capsys, "extract", SAME_CODE[0], "-o", tmp_path / "train.py")
    assert code == 0 and oct((tmp_path / "train.py").stat().st_mode & 0o777) == "0o644"


# ---------------------------------------------------------------------------------------
# Hostile logs: hyperparameter names, text that reaches the record's files, long lines

def header_lines(text: str, *lines: str) -> str:
    """The log text with these lines first in its hyperparameters section (added before the second RULE
    line when it has none). Plain string edits: the lines may hold anything."""
    block = "".join(line + "\n" for line in lines)
    if "hyperparameters:\n" in text:
        at = text.index("hyperparameters:\n") + len("hyperparameters:\n")
        return text[:at] + block + text[at:]
    at = text.index(RULE, text.index(RULE) + len(RULE))
    return text[:at] + "hyperparameters:\n" + block + text[at:]


def copies(tmp_path, sources, edit, names=None) -> list[Path]:
    """Edited copies of the source logs in tmp_path/in/: edit(text, i) for the i-th (1-based)."""
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    paths = []
    for i, (src, name) in enumerate(zip(sources, names or [src.name for src in sources]), 1):
        path = folder / name
        path.write_text(edit(src.read_text(), i))
        paths.append(path)
    return paths


def written_files(repo: Path) -> list[Path]:
    return sorted(p for p in repo.parent.rglob("*") if p.is_file() and p.parent.name != "in")


REFUSED_HEADERS = [   # (case, logs, header line or edit, the reason after `FAIL <log>: `); cwd is tmp_path
    ("shell command in a name (the issue's)", SAME_CODE, "  x $(touch pwned) y = 1",
     "header names hyperparameter 'x $(touch pwned) y', which is not an identifier"),
    ("semicolon in a name", SAME_CODE, "  a;touch pwned = 1",
     "header names hyperparameter 'a;touch pwned', which is not an identifier"),
    ("space in a name", SAME_CODE, "  num iterations = 6",
     "header names hyperparameter 'num iterations', which is not an identifier"),
    ("backticks in a name", SAME_CODE, "  `touch pwned` = 1",
     "header names hyperparameter '`touch pwned`', which is not an identifier"),
    ("an identifier that is no field", SAME_CODE, "  not_a_field = 1",
     "header names hyperparameter 'not_a_field', which {trainer} (its embedded source has no Hyperparameters) "
     "does not define"),
    ("a field only an older trainer had", SAME_CODE, "  batch_tokens = 4096",
     "header names hyperparameter 'batch_tokens', which {trainer} (its embedded source has no Hyperparameters) "
     "does not define"),
    ("a field its own embedded train_gpt.py lacks", REAL_SAME, "  stage_batch_tokens = 4096",
     "header names hyperparameter 'stage_batch_tokens', which its embedded train_gpt.py does not define"),
    ("stripped source: a name", PUBLIC[:3], "  x;y = 1",
     "header names hyperparameter 'x;y', which is not an identifier"),
    ("stripped source: no field", PUBLIC[:3], "  not_a_field = 1",
     "header names hyperparameter 'not_a_field', which {trainer} (its source is stripped) does not define"),
    ("code_sha256 that is no sha256", SAME_CODE,
     lambda t, i: re.sub(r"^code_sha256: .*$", "code_sha256: `x`|<script>", t, flags=re.M),
     "code_sha256 line holds '`x`|<script>', not a sha256 (64 hex digits)"),
]


@pytest.mark.parametrize("case,sources,line,reason", REFUSED_HEADERS, ids=[c[0] for c in REFUSED_HEADERS])
def test_verify_and_new_refuse_bad_header_names(capsys, tmp_path, repo, monkeypatch, case, sources, line, reason):
    monkeypatch.chdir(tmp_path)
    edit = line if callable(line) else (lambda t, i: header_lines(t, line))
    logs = copies(tmp_path, sources, edit)
    reason = reason.format(trainer=rec.TRAINER)
    target = "3.29" if sources is not SAME_CODE else "7.5"
    code, out, _ = run(capsys, "verify", *logs, "--target", target)
    assert code == 1 and "OK" not in out
    for lg in logs:
        assert f"FAIL {lg}: {reason}" in out.splitlines()
    code, out, err = run(capsys, "new", "x", *logs, "--target", target, "--records-dir", repo)
    assert code == 1 and f"FAIL {logs[0]}: {reason}" in out.splitlines()
    assert err.endswith("error: no record filed: the logs fail verify (reasons above)\n")
    assert not repo.exists() and written_files(repo) == [tmp_path / "README.md"]
    code, _, err = run(capsys, "summarize", *logs, "--target", target)
    assert code == 0 and f"warning: {logs[0]}: left out of the statistics: {reason}" in err
    assert not (tmp_path / "pwned").exists()


def test_hyperparameter_names_unchecked_without_a_trainer_are_refused(capsys, tmp_path, monkeypatch):
    # A stand-in source and no train_gpt.py to fall back on: no name can be checked, so none is trusted.
    monkeypatch.setattr(rec, "TRAINER", tmp_path / "train_gpt.py")
    code, out, _ = run(capsys, "verify", SAME_CODE[0], "--target", "7.5")
    assert (code, out) == (1, f"FAIL {SAME_CODE[0]}: cannot check the header's hyperparameter names: "
                              f"{tmp_path / 'train_gpt.py'} (its embedded source has no Hyperparameters): cannot "
                              "read (No such file or directory)\n")
    (tmp_path / "train_gpt.py").write_text("class Other:\n    seed: int = 1\n")
    code, out, _ = run(capsys, "verify", SAME_CODE[0], "--target", "7.5")
    assert code == 1 and out.endswith("(its embedded source has no Hyperparameters) defines no Hyperparameters\n")
    # Its own embedded source decides for a real log, whatever the repository's trainer holds.
    code, out, _ = run(capsys, "verify", *REAL_SAME, "--target", "8")
    assert code == 0, out


EVIL_VALUE = "x $(touch pwned) `touch pwned`; touch pwned | cat 'q\" \\ \x1b[31m\r```"
EVIL_NAME = "run $(touch pwned) 'q`1.txt"


def test_reproduce_block_pasted_into_bash_runs_only_its_commands(capsys, tmp_path, repo, monkeypatch):
    bash = shutil.which("bash") or pytest.skip("no bash")
    monkeypatch.chdir(tmp_path)
    logs = copies(tmp_path, SAME_CODE, lambda t, i: header_lines(t, f"  train_files = {EVIL_VALUE}"),
                  names=[EVIL_NAME, "run2.txt", "run3.txt"])
    code, out, _ = run(capsys, "new", "x", *logs, "--target", "7.5", "--records-dir", repo)
    assert code == 0, out
    readme = (repo / "2026-11-22_x" / "README.md").read_text()
    assert "\r" not in readme and "\x1b" not in readme
    block = readme[readme.index("```bash\n") + len("```bash\n"):readme.index("\n```\n", readme.index("```bash\n"))]
    assert not any(line.startswith("```") for line in block.splitlines())
    # python and torchrun print their arguments, one per line; anything else the block ran would show.
    stubs = 'python() { printf "<%s>\\n" "$@"; }\ntorchrun() { printf "<%s>\\n" "$@"; }\n'
    proc = subprocess.run([bash, "-c", stubs + block], cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b""
    assert not (tmp_path / "pwned").exists()
    args = proc.stdout.split(b">\n")
    filed = rec.filed_name(Path(EVIL_NAME))   # (issue 38 row 6: a log is filed as NAME.txt, in plain characters)
    assert f"<records/2026-11-22_x/{filed}".encode() in args            # verify's glob and extract's log
    assert args.count(f"<records/2026-11-22_x/{filed}".encode()) == 2
    assert f"<--train_files={EVIL_VALUE}".encode() in args
    assert b"<--preset=smoke" in args and b"<--seed=1" in args


def no_unescaped_markup(text: str, raw: list[str]) -> None:
    """The record file text holds none of `raw`, nor an unprintable character, outside its bash block and
    the records markers, and every row of each table has as many cell borders as its header."""
    text = text.replace(rec.BEGIN_MARK, "").replace(rec.END_MARK, "")
    if "```bash\n" in text:
        start = text.index("```bash\n")
        text = text[:start] + text[text.index("\n```\n", start):]
    for bad in raw:
        assert bad not in text
    assert all(c.isprintable() or c == "\n" for c in text)
    tables = re.findall(r"(?:^\|.*\n)+", text, flags=re.M)
    for table in tables:
        borders = [len(re.findall(r"(?<!\\)\|", row)) for row in table.splitlines()]
        assert len(set(borders)) == 1, table


INJECTIONS = [   # (case, edit(text, i), file names, extra args, raw text that must not appear, escaped text that must)
    ("run id: pipe, backticks, <script>, link",
     lambda t, i: t.replace(f"run_id: handmade-cpu-run{i}", f"run_id: r{i}|`x`<script>alert(1)</script>[a](http://e)"),
     None, [], ["<script>", "`x`", "[a](", "r1|"], md("r1|`x`<script>alert(1)</script>[a](http://e)")),
    ("run id: control characters",
     lambda t, i: t.replace(f"run_id: handmade-cpu-run{i}", f"run_id: r{i}\x1b[2J\rx"),
     None, [], ["\x1b", "\r"], md("r1\\x1b[2J\\rx")),
    ("GPU name: the records end marker, a pipe, math, HTML",
     lambda t, i: t.replace("device: cpu ", "device: cuda (NVIDIA H100 <!-- records:end --> | `x` $x$ <b>) "),
     None, [], ["<b>", "<!-- records:end -->", "`x`", "$x$"], md("NVIDIA H100 <!-- records:end --> | `x` $x$ <b>")),
    ("preset (so the default track): HTML and emphasis",
     lambda t, i: t.replace("  preset = smoke", "  preset = smoke<img src=x onerror=alert(1)>*b*_i_~s~"),
     None, [], ["<img src=x onerror=alert(1)>", "*b*", "_i_", "~s~"],
     md("2×CPU smoke<img src=x onerror=alert(1)>*b*_i_~s~")),
    ("note: a heading, a link and HTML",
     lambda t, i: re.sub(r"^note: .*$", "note: # big [x](javascript:alert(1)) <u>u</u>", t, flags=re.M),
     None, [], ["[x](", "<u>"], "> Note: # big " + md("[x](javascript:alert(1)) <u>u</u>")),
    ("Python and PyTorch versions: HTML",
     lambda t, i: t.replace("Running Python 3.11.7", "Running Python 3.11.7<i>x</i>").replace(
         "Running PyTorch 2.13.0+cpu", "Running PyTorch 2.13.0|<br>"),
     None, [], ["<i>", "<br>"], "PyTorch " + md("2.13.0|<br>") + ", Python " + md("3.11.7<i>x</i>")),
    ("hyperparameter values and file names: pipes, backticks, HTML (runs that differ)",
     lambda t, i: header_lines(t, f"  train_files = data/a|`b`<s>{i}"),
     ["a|`b`<i>[c](d).txt", "b.txt", "c.txt"], ["--allow-differences", "train_files"], ["`b`", "<s>", "<i>", "[c]("],
     "- train\\_files is " + md("data/a|`b`<s>1") + " in " + md("a__b__i__c__d_.txt")),   # filed as NAME.txt
]


@pytest.mark.parametrize("case,edit,names,args,raw,escaped", INJECTIONS, ids=[c[0] for c in INJECTIONS])
def test_log_text_reaches_record_files_escaped(capsys, tmp_path, repo, case, edit, names, args, raw, escaped):
    logs = copies(tmp_path, SAME_CODE, edit, names)
    code, out, err = run(capsys, "new", "rec", *logs, "--target", "7.5", "--records-dir", repo, *args)
    assert code == 0, out + err
    readme = (repo / "2026-11-22_rec" / "README.md").read_text()
    assert escaped in readme
    root = repo.parent / "README.md"
    for text in [readme, (repo / "RECORDS.md").read_text(), root.read_text()]:
        no_unescaped_markup(text, raw)
    # The root README keeps one block between its markers, also when the table is made again.
    for _ in range(2):
        text = root.read_text()
        assert text.count(rec.BEGIN_MARK) == 1 and text.count(rec.END_MARK) == 1
        assert text.startswith("# Repo\n\nintro\n\n<!-- records:begin -->\n###")
        assert text.endswith("<!-- records:end -->\n\nclosing words\n") and "stale" not in text
        code, _, _ = run(capsys, "table", "--records-dir", repo)
        assert code == 0 and root.read_text() == text
    meta = rec.json.loads((repo / "2026-11-22_rec" / "record.json").read_text())
    assert set(meta) <= {"name", "date", "track", "target", "allowed_differences"}


@pytest.mark.parametrize("gpu", ["Acme $\\frac{$ x", "$x^$", "Acme \x1b[1m $x_{$"])
def test_plot_shows_dollars_in_names_as_text(capsys, tmp_path, gpu):
    pytest.importorskip("matplotlib")
    logs = copies(tmp_path, SAME_CODE, lambda t, i: t.replace("device: cpu ", f"device: cuda ({gpu}) "))
    png = tmp_path / "p.png"
    code, out, err = run(capsys, "plot", *logs, "-o", png)   # mathtext failed on these before
    assert code == 0 and out == f"wrote {png} (3 runs, 1 code version(s))\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_escaping_helpers():
    assert rec.md_text("a|b`c`<d>[e](f)*g*_h_~i~$j$&k\\l") == \
        "a\\|b\\`c\\`\\<d\\>\\[e\\](f)\\*g\\*\\_h\\_\\~i\\~\\$j\\$\\&k\\\\l"
    assert rec.md_text("NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    assert rec.visible("a\x1b\r\u202eb") == "a\\x1b\\r\\u202eb"
    assert rec.sh_quote("--x=1") == "--x=1" and rec.sh_quote("a b'c") == "'a b'\"'\"'c'"
    assert rec.sh_quote("a\rb'\\") == "$'a\\x0db\\'\\\\'"
    assert rec.plot_text("$x$") == "\\$x\\$"


def test_device_line_fields_other_than_its_own_are_ignored(capsys, tmp_path):
    # `hyperparameters:` or `gpus:` on the device line once replaced the parsed sections: a traceback.
    logs = copies(tmp_path, SAME_CODE, lambda t, i: t.replace(
        "device: cpu  world_size: 2", "device: cpu  hyperparameters: x  gpus: y  world_size: 2"))
    lg = rec.read_log(logs[0])
    assert (lg.device, lg.world_size, lg.hyperparameters["seed"]) == ("cpu", 2, "1") and lg.complete
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 0 and out.startswith("OK 3 log(s)")


@pytest.mark.parametrize("meta", ["[1, 2]", '{"name": ["x"]}', '{"track": 8}', '"text"'])
def test_table_leaves_out_a_record_json_of_the_wrong_shape(capsys, repo, meta):
    code, _, _ = run(capsys, "new", "smoke", *SAME_CODE, "--target", "7.5", "--records-dir", repo)
    folder = repo / "2026-11-22_smoke"
    (folder / "record.json").write_text(meta)
    code, out, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and err == (f"warning: {folder}/record.json: not an object whose name, date and track are "
                                 "text: left out of the table\n")
    assert "[smoke](" not in (repo / "RECORDS.md").read_text()


# Long lines. Before the fix the device line's pattern was quadratic: 40,000 blanks took 23 s.

MB = 1_000_000
MIX = (" \t0123456789" * (MB // 12 + 1))[:MB]   # blanks, tabs and digits
LONG_LINES = {
    "blanks, tabs and digits": MIX,
    "step line of blanks, tabs and digits": "step:3/6" + MIX + "x",
    "step line, 'a:' then blanks": "step:3/6 a:" + " " * MB + "b",
    "step line of many fields, then no field": "step:3/6" + " a:b" * (MB // 4) + " x",
    "summary line of letters": "summary: " + "a" * MB,
    "device line of blanks": "device: cpu a" + " " * MB + "b",
    "device line of tabs": "device:" + "\t" * MB + "cpu",
    "device line of many fields": "device: " + "  a:" * (MB // 4),
    "nvidia-smi row of blanks": "|   0  NVIDIA" + " " * MB + "x  On  |   00000000:61:00.0 Off |",
    "nvidia-smi row of words": "| 0 " + " a" * (MB // 2) + " On | 0:0 x",
    "note, then blanks": "note: a" + " " * MB + "b",
    "code_sha256 of words": "code_sha256: " + "a " * (MB // 2),
    "'a:' then blanks": "a:" + " " * MB,
    "clock line, then blanks": "Sat Nov 15 15:50:24 2025" + " " * MB + "x",
    "resumed line": "resumed from " + " at step " * (MB // 9) + "x",
    "RULE, then blanks": "=" * 100 + " " * MB + "x",
    "colons": ":" * MB,
    "digits": "1" * MB,
}
LINE_READERS = {
    "parse_header": lambda line: rec.parse_header([line]),
    "parse_body": lambda line: rec.parse_body([line]),
    "parse_step_line": rec.parse_step_line,
    "parse_fields": rec.parse_fields,
    "parse_device_fields": rec.parse_device_fields,
    "parse_gpu_row": rec.parse_gpu_row,
    "RULE_RE": lambda line: rec.RULE_RE.search(line),
    "hyperparameter line": lambda line: rec.parse_header(["hyperparameters:", "  " + line + " = 1"]),
}


@pytest.mark.parametrize("kind", LONG_LINES)
def test_every_line_reader_is_linear_on_a_1mb_line(kind):
    line = LONG_LINES[kind]
    for name, reader in LINE_READERS.items():
        start = time.perf_counter()
        reader(line)
        took = time.perf_counter() - start
        assert took < 1.0, f"{name} took {took:.2f} s on a 1 MB {kind} line"
    preset = line[:rec.MAX_LINE_CHARS]   # the longest preset, so track, a log can hold
    start = time.perf_counter()
    rec.track_conflict(preset, rec.read_log(SAME_CODE[0]))
    assert time.perf_counter() - start < 1.0


LONG_LINE_PLACES = {   # where a 1 MB line goes in a complete log
    "step line": lambda t: t.replace("step:3/6 train_loss:9.2000", "step:3/6" + MIX + " train_loss:9.2000"),
    "step line, 'a:' then blanks": lambda t: t.replace("step:3/6 ", "step:3/6 a:" + " " * MB + " "),
    "summary line": lambda t: t.replace("summary: ", "summary: " + "a" * MB + " "),
    "device line": lambda t: t.replace("device: cpu ", "device: cpu a" + " " * MB + "b "),
    "device line of tabs": lambda t: t.replace("device: cpu ", "device:" + "\t" * MB + "cpu "),
    "nvidia-smi row": lambda t: header_lines(t).replace(
        "hyperparameters:", "|   0  NVIDIA" + " " * MB + "x  On  |   00000000:61:00.0 Off |\nhyperparameters:"),
    "note": lambda t: re.sub(r"^note: .*$", lambda m: "note: a" + " " * MB + "b", t, flags=re.M),
    "header line 'a:' then blanks": lambda t: t.replace("hyperparameters:", "a:" + " " * MB + "\nhyperparameters:"),
    "hyperparameter value": lambda t: header_lines(t, "  seed = " + MIX),
    "hyperparameter name": lambda t: header_lines(t, "  " + "a" * MB + " = 1"),
    "resumed line": lambda t: t.replace("step:1/6", "resumed from" + " at step x" * (MB // 10) + "\nstep:1/6"),
    "unfinished last line": lambda t: t + "step:7/6" + " " * MB,
}


def long_line_log(tmp_path, place) -> tuple[Path, int, int]:
    """(a log with a 1 MB line, that line's number, its length)"""
    path = copies(tmp_path, SAME_CODE[:1], lambda t, i: LONG_LINE_PLACES[place](t))[0]
    lines = path.read_text().split("\n")
    number = next(n for n, line in enumerate(lines, 1) if len(line) > 10_000)
    return path, number, len(lines[number - 1])


def timed(capsys, *argv):
    start = time.perf_counter()
    result = run(capsys, *argv)
    return (*result, time.perf_counter() - start)


@pytest.mark.parametrize("place", LONG_LINE_PLACES)
def test_every_subcommand_refuses_a_1mb_line_at_once(capsys, tmp_path, repo, pure, place):
    bad, number, length = long_line_log(tmp_path, place)
    why = f"{bad}: not a speedrun log (line {number} has {length:,} characters; a log's lines have at most 10,000)"
    rec.read_log(SAME_CODE[0])   # the trainer's fields, once per process: not part of what is timed
    out_png, out_py = tmp_path / "p.png", tmp_path / "x.py"
    for argv, expected in [
            (["summarize", bad], ("", f"error: {why}\n")),
            (["verify", bad], (f"FAIL {why}\n", "")),
            (["compare", "--baseline", bad, SAME_CODE[1], "--candidate", SAME_CODE[2], SAME_CODE[0]],
             ("", f"error: {why}\n")),
            (["extract", bad, "-o", out_py], ("", f"error: {why}\n")),
            (["new", "x", bad, "--target", "7.5", "--records-dir", repo], ("", f"error: {why}\n"))]:
        code, out, err, took = timed(capsys, *argv)
        assert (code, out, err) == (1, *expected), argv[0]
        assert took < 1.0, f"{argv[0]} took {took:.2f} s"
    if importlib.util.find_spec("matplotlib"):
        import matplotlib.pyplot  # noqa: F401  (its import is not what is timed)
        code, out, err, took = timed(capsys, "plot", bad, "-o", out_png)
        assert (code, out, err) == (1, "", f"error: {why}\n") and took < 1.0
    assert not repo.exists() and not out_png.exists() and not out_py.exists()

    # A record folder holding it leaves the table, with the reason.
    folder = repo / "2026-11-22_x"
    folder.mkdir(parents=True)
    (folder / bad.name).write_bytes(bad.read_bytes())
    why = why.replace(str(bad), str(folder / bad.name))
    code, out, err, took = timed(capsys, "table", "--records-dir", repo)
    assert code == 0 and err == f"warning: {why}: ignored\nwarning: {folder}: left out of the table (no logs)\n"
    assert took < 1.0 and "No records yet." in (repo / "RECORDS.md").read_text()


@pytest.mark.parametrize("place", LONG_LINE_PLACES)
def test_log_readers_are_linear_without_the_line_bound(capsys, tmp_path, monkeypatch, pure, place):
    monkeypatch.setattr(rec, "MAX_LINE_CHARS", 10 * MB)   # the parsers themselves, on the whole log
    bad, _, _ = long_line_log(tmp_path, place)
    rec.read_log(SAME_CODE[0])
    for command in ["summarize", "verify"]:
        code, _, _, took = timed(capsys, command, bad, "--target", "7.5")
        assert code in (0, 1) and took < 1.0, f"{command} took {took:.2f} s"


MICRO_BATCHES = [   # (values in three logs, None if one experiment, else the FAIL line's difference)
    (["4,4,4", "4", " 4"], None),
    (["8,8,16", "8, 8, 16", "8,8,16"], None),
    (["auto", "auto ", "auto"], None),
    (["4,4,4", "4", "8"], "micro_batches is 4 in {0}, {1}; 8 in {2}"),
    (["4,4,8", "4", "4"], "micro_batches is 4,4,8 in {0}; 4 in {1}, {2}"),
]


@pytest.mark.parametrize("values,differ", MICRO_BATCHES, ids=["/".join(v) for v, _ in MICRO_BATCHES])
def test_micro_batches_compare_in_canonical_form(capsys, tmp_path, repo, values, differ):
    logs = copies(tmp_path, SAME_CODE, lambda t, i: with_hparams(t, micro_batches=values[i - 1]))
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    if differ is None:
        assert code == 0 and "runs differ" not in out
        code, out, _ = run(capsys, "new", "x", *logs, "--target", "7.5", "--records-dir", repo)
        assert code == 0, out
        readme = (repo / "2026-11-22_x" / "README.md").read_text()
        assert "These differ between the runs: seed (see" in readme and "micro" not in readme.split("## Reproduce")[0]
    else:
        assert (code, out) == (1, f"FAIL not the same experiment: {differ.format(*logs)} "
                                  "(--allow-differences=micro_batches if that is intended)\n")


@pytest.mark.parametrize("value,canonical", [("4,4,4", "4"), (" 4", "4"), ("4", "4"), ("8,8,16", "8,8,16"),
                                             ("8, 8,16 ", "8,8,16"), ("auto", "auto"), (" auto", "auto"),
                                             ("4,x", "4,x")])
def test_canonical_micro_batches(value, canonical):
    assert rec.canonical_micro_batches(value) == canonical


# ---------------------------------------------------------------------------------------
# Issue 38: what a log can prove

def with_source(text: str, source: str) -> str:
    """The log text with `source` as its embedded train_gpt.py, written as the trainer writes it (the source, a
    newline, the RULE) and its code_sha256 line set to the source's hash."""
    body = text[text.index(RULE):]
    body = re.sub(r"^code_sha256: .*$", f"code_sha256: {hashlib.sha256(source.encode()).hexdigest()}", body,
                  flags=re.M)
    return source + "\n" + body


DOCSTRING_RULE = f'"""A trainer.\n\nSettings\n{RULE}\n"""\nprint("trainer")\n'   # an underline of 100 '='
TWO_RULES = f'"""\n{RULE}\nstep:1/6 val_loss:1.0\ncode_sha256: {"0" * 64}\n{RULE}\n"""\nprint("trainer")\n'


@pytest.mark.parametrize("source", [DOCSTRING_RULE, TWO_RULES], ids=["docstring underline", "two rules, a fake header"])
def test_a_rule_line_inside_the_source_does_not_end_it(capsys, tmp_path, source):
    """Row 2: the first line of 100 '=' was taken as the source's end: verify said OK with the hash of a 4-byte
    "source" for logs whose code was edited after it, and extract wrote those 4 bytes."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: with_source(t, source))
    code, out, _ = run(capsys, "extract", logs[0], "-o", tmp_path / "x.py")
    assert code == 0 and (tmp_path / "x.py").read_text() == source
    assert hashlib.sha256(source.encode()).hexdigest() in out
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 0 and f"same code {hashlib.sha256(source.encode()).hexdigest()[:12]}" in out, out
    # the code edited below the rule in two of the three logs (their code_sha256 lines as they were), and a setting
    tampered = [logs[0]] + [edited(tmp_path, path, f"t{i}.txt", lambda t: with_hparams(
        t.replace('print("trainer")', 'print(1)'), val_tokens=4096)) for i, path in enumerate(logs[1:])]
    code, out, _ = run(capsys, "verify", *tampered, "--target", "7.5")
    assert code == 1 and "FAIL not the same experiment: val_tokens is not logged in" in out, out
    for path in tampered[1:]:
        assert f"FAIL {path}: edited: embedded source hashes to " in out, out
    code, _, err = run(capsys, "extract", tampered[1], "-o", tmp_path / "y.py")
    assert code == 1 and "the log was edited" in err and not (tmp_path / "y.py").exists()


@pytest.mark.parametrize("source, forged", [(SAME_CODE[0], "step:10000000000/6 val_loss:7.0 train_time:1ms"),
                                            (PUBLIC[0], "step:10000000000/10000000000 train_time:1ms")],
                         ids=["bounded by the header", "no header: a total of its own"])
def test_a_forged_step_number_allocates_nothing(capsys, tmp_path, repo, source, forged):
    """Row 4: one line `step:10000000000/30` made every subcommand build a set of 10**10 integers (MemoryError, or
    the OOM killer). A log with num_iterations in its header refuses step lines past it; one without (the public
    logs) is counted with arithmetic."""
    text = source.read_text()
    at = text.index("\nstep:1/") + 1
    log = tmp_path / "forged.txt"
    log.write_text(text[:at] + forged + "\n" + text[at:])
    tracemalloc.start()  # what the subcommands allocate, not how long they take (a loaded machine is slow)
    code, out, _ = run(capsys, "verify", log, "--target", "8")
    assert code == 1
    if "hyperparameters:" in text:
        assert f"FAIL {log}: step line outside the run (the header's num_iterations, 6): 'step:10000000000/6" in out
    else:
        assert "step lines disagree on the number of steps: [2245, 10000000000]" in out, out
        assert "missing step lines: 2246, 2247, 2248, 2249, 2250, ... (9999997754 in all)" in out, out
    assert run(capsys, "summarize", log, "--target", "8")[0] == 0
    assert run(capsys, "new", "forged", log, "--target", "8", "--records-dir", repo)[0] == 1 and not repo.exists()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 30, peak  # a set of the 10**10 step numbers would take hundreds of GB (measured: 0.27 GB)


def rerun(text: str, i: int, seed=None, final=None) -> str:
    """Another run in this log's image: its own run id, times shifted by i ms, and the seed and final val loss given."""
    text = re.sub(r"^run_id: .*$", f"run_id: rerun-{i}", text, flags=re.M)
    text = re.sub(r"train_time:(\d+)ms", lambda m: f"train_time:{int(m[1]) + i}ms", text)
    if seed is not None:
        text = with_hparams(text, seed=seed)
    if final is not None:
        text = re.sub(r"^(step:6/6 val_loss:)\S+", rf"\g<1>{final}", text, flags=re.M)
        text = re.sub(r"final_val_loss:\S+", f"final_val_loss:{final}", text)
    return text


def test_runs_of_one_seed_and_config_are_one_sample(capsys, tmp_path, repo):
    """Row 3: runs with the same seed (identical losses, other run ids and times) counted as several samples: their
    spread of 0 gave p = 0, "met at p < 0.01", and `new` filed the record."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: rerun(SAME_CODE[0].read_text(), i))   # seed 1, three times
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1
    assert f"FAIL duplicate runs: {logs[1]} duplicates {logs[0]} (same seed 1 and config: one sample); {logs[2]} " \
           f"duplicates {logs[0]} (same seed 1 and config: one sample)" in out.splitlines(), out
    assert run(capsys, "new", "same-seed", *logs, "--target", "7.5", "--records-dir", repo)[0] == 1
    assert not repo.exists()
    # the seed spelled with a blank, and the runs split between compare's groups
    spelled = copies(tmp_path, SAME_CODE[:1], lambda t, i: rerun(t, 9, seed=" 1"), names=["spelled.txt"])
    code, _, err = run(capsys, "compare", "--baseline", logs[0], SAME_CODE[1], "--candidate", spelled[0],
                       SAME_CODE[2])
    assert code == 1 and f"candidate {spelled[0]} duplicates baseline {logs[0]} (same seed 1 and config" in err, err


def test_no_t_test_without_a_spread(capsys, tmp_path, repo):
    """Row 3, its second half: different seeds whose 4-decimal final losses tie had a spread of 0, and p = 0."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: rerun(t, i, final="7.1000"))   # seeds 1, 2 and 3
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1 and "FAIL all 3 logs: target 7.5: no t-test: the 3 runs' final val losses have no spread (all " \
                         "7.1000), so nothing says their mean is below 7.5 -> NOT met" in out, out
    assert run(capsys, "new", "ties", *logs, "--target", "7.5", "--records-dir", repo)[0] == 1 and not repo.exists()
    code, out, _ = run(capsys, "summarize", *logs, "--target", "7.5")
    assert code == 0 and "no t-test" in out and "met at p" not in out
    # compare: two groups whose train times do not vary within either (every run's summary says 5400 ms or 5300 ms)
    def timed(ms, seeds):
        return lambda t, i: re.sub(r"^(summary: .*train_time:)\d+ms", rf"\g<1>{ms}ms",
                                   rerun(t, 10 * i + ms, seed=seeds[i - 1]), flags=re.M)
    base = copies(tmp_path, SAME_CODE[:2], timed(5400, [1, 2]), names=["b1.txt", "b2.txt"])
    faster = copies(tmp_path, [SAME_CODE[2], HANDMADE / "b-cpu-other-code.txt"], timed(5300, [3, 4]),
                    names=["f1.txt", "f2.txt"])
    code, out, _ = run(capsys, "compare", "--baseline", *base, "--candidate", *faster)
    assert code == 0 and "candidate faster at p < 0.01 (one-sided Welch): cannot tell" in out, out


def test_losses_that_cannot_be_cross_entropies_are_refused(capsys, tmp_path, repo):
    """Row 17: three logs edited to final losses of -5.1, -5.2 and -5.3 passed verify at p = 2.3e-5."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: rerun(t, i, final=f"-5.{i}"))
    code, out, _ = run(capsys, "verify", *logs)
    assert code == 1, out
    for i, path in enumerate(logs, 1):
        assert f"FAIL {path}: val_loss '-5.{i}' at step 6 cannot be a cross-entropy (one is >= 0)" in out, out
    assert run(capsys, "new", "negative", *logs, "--records-dir", repo)[0] == 1 and not repo.exists()
    code, out, err = run(capsys, "summarize", *logs)
    assert "runs: 3 (0 complete)" in out and "cannot be a cross-entropy" in err
    # a train loss, in one log of three that are otherwise sound
    train = copies(tmp_path, SAME_CODE, lambda t, i: t.replace("train_loss:9.8000", "train_loss:-0.0001") if i == 2
                   else t, names=["t1.txt", "t2.txt", "t3.txt"])
    code, out, _ = run(capsys, "verify", *train, "--target", "7.5")
    assert code == 1 and f"FAIL {train[1]}: train_loss '-0.0001' at step 2 cannot be a cross-entropy" in out, out


def test_the_readmes_say_what_verify_checks_and_what_it_cannot():
    """Row 17, the claim: "checks that the runs are complete and unedited" promised what no check of a log can."""
    for readme in (ROOT / "README.md", ROOT / "records" / "README.md"):
        text = " ".join(readme.read_text().split())
        assert "unedited" not in text, readme
        assert "consistent with itself" in text and "nothing signs a log" in text.lower(), readme


ESC = "\x1b[2J\x1b[H\x1b[32mOK\x1b[0m"   # clear the screen, home, a green OK


def test_log_text_reaches_the_terminal_escaped(capsys, tmp_path):
    """Row 5: log text (run id, error line, versions, file names) was escaped in files but printed raw: a log could
    clear the screen and show a green OK over its own FAIL."""
    def hostile(t, i):
        t = t.replace("run_id: handmade-cpu-run", f"run_id: {ESC}-")
        return t.replace("Running PyTorch 2.13.0+cpu", f"Running PyTorch 2.13.0{ESC}")
    logs = copies(tmp_path, SAME_CODE, hostile, names=["a.txt", "b.txt", f"c{ESC}.txt"])
    failed = edited(tmp_path, HANDMADE / "b-cuda-failed.txt", "failed.txt",
                    lambda t: t.replace("error: non-finite loss", f"error: {ESC} non-finite loss"))
    for argv in (["summarize", *logs, failed], ["verify", *logs, failed],
                 ["plot", *logs, failed, "-o", tmp_path / "p.png"],
                 ["compare", "--baseline", *logs[:2], "--candidate", logs[2], failed]):
        code, out, err = run(capsys, *argv, *(["--target", "7.5"] if argv[0] in ("summarize", "verify") else []))
        assert "\x1b" not in out + err, (argv[0], out, err)
        assert "\\x1b[2J" in out + err, (argv[0], out, err)


@pytest.mark.parametrize("names, filed", [
    (["b-cpu-run1.txt", "b-cpu-run2.txt", "README.md"], ["README.md.txt", "b-cpu-run1.txt", "b-cpu-run2.txt"]),
    (["run1.log", "run2.log", "run3.log"], ["run1.log.txt", "run2.log.txt", "run3.log.txt"]),
    (["record.json", "a b.txt", ".hidden.txt"], ["_hidden.txt", "a_b.txt", "record.json.txt"]),
], ids=["a log named README.md", "*.log names", "record.json, a blank, a dot"])
def test_logs_are_filed_under_names_the_folder_reads_back(capsys, tmp_path, repo, names, filed):
    """Row 6: logs were filed under their own names: one named README.md was overwritten by the record's README
    (the record kept 2 of 3 logs, and its p changed), and *.log names were filed but then read as "no logs"."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: t, names=names)
    code, out, err = run(capsys, "new", "names", *logs, "--records-dir", repo, "--target", "7.5")
    assert code == 0, (out, err)
    folder = repo / "2026-11-22_names"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*filed, "README.md", "record.json"])
    assert sorted(p.read_bytes() for p in folder.glob("*.txt")) == sorted(p.read_bytes() for p in logs)
    assert "left out" not in err
    table = (repo / "RECORDS.md").read_text()
    assert "[names](2026-11-22_names/README.md) | 2×CPU smoke | 3 | 7.1000 ± 0.0200 | 7.5 | 0.0004" in table, table


def test_two_logs_that_would_be_filed_under_one_name_are_refused(capsys, tmp_path, repo):
    logs = copies(tmp_path, SAME_CODE[:2], lambda t, i: t, names=["a b.txt", "a_b.txt"])
    code, _, err = run(capsys, "new", "clash", *logs, "--records-dir", repo, "--target", "7.5")
    assert code == 1 and "error: two logs would be filed as a_b.txt: rename one" in err and not repo.exists()


def test_deep_nesting_in_a_record_or_a_log_is_left_out_not_a_traceback(capsys, tmp_path, repo):
    """Row 8: a deeply nested record.json, or an annotation in a log's embedded source, raised an uncaught
    RecursionError: one such record stopped `table` for every record."""
    assert run(capsys, "new", "good", *SAME_CODE, "--records-dir", repo, "--target", "7.5")[0] == 0
    nested = repo / "2026-11-23_nested"
    nested.mkdir()
    for path in SAME_CODE:
        shutil.copy(path, nested / path.name)
    (nested / "record.json").write_text("[" * 100_000 + "]" * 100_000)
    deep = "class Hyperparameters:\n    seed: " + "a." * 1500 + "b = 1\n"   # ast parses it; ast.unparse recursed
    annotated = repo / "2026-11-24_annotated"
    annotated.mkdir()
    for i, path in enumerate(SAME_CODE):
        (annotated / path.name).write_text(with_source(path.read_text(), deep))
    code, out, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0, err
    assert f"{nested}/record.json: unreadable (nested too deeply): left out of the table" in err
    table = (repo / "RECORDS.md").read_text()
    assert "[good](2026-11-22_good/README.md)" in table and "nested" not in table
    # the annotated logs read: their own Hyperparameters class defines seed, and nothing else they name
    code, out, _ = run(capsys, "verify", *sorted(annotated.glob("*.txt")), "--target", "7.5")
    assert code == 1 and "header names hyperparameter 'preset' (+2 more), which its embedded train_gpt.py does not" \
        in out, out
    assert "[annotated]" not in table and "annotated: left out of the table" in err


@pytest.mark.parametrize("winner", ["a record folder", "a file"])
def test_a_record_filed_meanwhile_is_named_not_the_temporary(capsys, tmp_path, repo, monkeypatch, winner):
    """Row 18: when another `new` won the race, the error named the tool's temporary: `.new-XXXX: Directory not
    empty`."""
    folder = repo / "2026-11-22_race"
    readme = rec.record_readme

    def meanwhile(*args):   # the other `new` publishes its folder while this one writes its README
        if winner == "a file":
            folder.write_text("x")
        else:
            folder.mkdir()
            (folder / "b-cpu-run1.txt").write_text("theirs")
        return readme(*args)

    monkeypatch.setattr(rec, "record_readme", meanwhile)
    code, _, err = run(capsys, "new", "race", *SAME_CODE, "--records-dir", repo, "--target", "7.5")
    assert code == 1 and err == (f"error: {folder}: already exists (made while this record was written: another "
                                 f"`records.py new`?); nothing of this one was kept\n"), err
    assert sorted(p.name for p in repo.iterdir()) == ["2026-11-22_race"]   # no .new-XXXX left


@pytest.mark.parametrize("how", ["same name", "./name", "hard link", "symlink"])
@pytest.mark.parametrize("command", ["extract", "plot"])
def test_the_output_is_never_an_input(capsys, tmp_path, monkeypatch, command, how):
    """Row 21: `extract run.txt -o run.txt` left only the source."""
    monkeypatch.chdir(tmp_path)
    log = Path("run.txt")
    log.write_bytes(SAME_CODE[0].read_bytes())
    out = {"same name": "run.txt", "./name": "./run.txt", "hard link": "link.txt", "symlink": "sym.txt"}[how]
    if how == "hard link":
        os.link(log, out)
    elif how == "symlink":
        os.symlink(log, out)
    argv = ["extract", log, "-o", out] if command == "extract" else ["plot", SAME_CODE[1], log, "-o", out]
    code, _, err = run(capsys, *argv)
    assert code == 1 and err == f"error: -o {out}: that is {log}, which this command reads; choose another output " \
                                f"file\n", err
    assert log.read_bytes() == SAME_CODE[0].read_bytes()


@pytest.mark.parametrize("values", [("auto", "auto", "sdpa"), ("sdpa", " auto", "auto")])
def test_attention_is_compared_as_resolved_on_the_logs_device(capsys, tmp_path, values):
    """Row 16: --attention=sdpa trains exactly as auto on a CPU, yet verify called such runs different experiments."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: with_hparams(t, attention=values[i - 1], device="auto"))
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 0, out
    # on a GPU, auto is flex: sdpa there is another setting
    def on_a_gpu(t, i):
        return with_hparams(t.replace("device: cpu ", "device: cuda (NVIDIA H100) "), attention=values[i - 1])
    gpu = copies(tmp_path, SAME_CODE, on_a_gpu, names=["g1.txt", "g2.txt", "g3.txt"])
    code, out, _ = run(capsys, "verify", *gpu, "--target", "7.5")
    assert code == 1 and "FAIL not the same experiment: attention is " in out, out


@pytest.mark.parametrize("name", ["x" * 250 + ".py", "\U0001F600" * 62 + ".py", "\u00e9" * 126 + ".py",
                                  "\u20ac" * 84 + ".py"])
def test_a_long_legal_output_name_is_written(capsys, tmp_path, name):
    """Row 18: `extract -o` a legal 253-character name failed with "File name too long" (its temporary's); issue 46
    row 13: cut by characters, a legal 251-byte name of 4-byte characters still did. Names of 250-256 bytes of 1 to
    4-byte characters, the cut falling inside a character for the others."""
    out = tmp_path / name
    assert len(os.fsencode(name)) <= 255
    code, _, err = run(capsys, "extract", SAME_CODE[0], "-o", out)
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


# ---------------------------------------------------------------------------------------
# Issue 46: one reader of a log, whose numbers are valid by construction; what a log cannot prove

def prepend_a_fake_source(text: str, docstring: str = '"""x"""', newline: bool = False) -> str:
    """The log with three lines before it: a docstring, a RULE, and a code_sha256 line with that docstring's hash
    (`newline`: of the docstring and the newline the trainer's writer adds)."""
    digest = hashlib.sha256((docstring + "\n" * newline).encode()).hexdigest()
    return f"{docstring}\n{RULE}\ncode_sha256: {digest}\n" + text


FAKE_SOURCES = [   # (id, how each log is edited)
    ("the issue's: a docstring, a rule, its hash", lambda t: prepend_a_fake_source(t)),
    ("its hash with the writer's newline", lambda t: prepend_a_fake_source(t, newline=True)),
    ("step lines after the fake rule", lambda t: prepend_a_fake_source(t).replace(
        "code_sha256:", "step:1/3 val_loss:1.0 train_time:1ms\ncode_sha256:", 1)),
    ("two fake blocks", lambda t: prepend_a_fake_source(prepend_a_fake_source(t), docstring='"""y"""')),
]


@pytest.mark.parametrize("edit", [e for _, e in FAKE_SOURCES], ids=[i for i, _ in FAKE_SOURCES])
def test_the_source_ends_where_the_header_begins_not_where_a_declared_hash_says(capsys, tmp_path, edit):
    """Row 1: three lines prepended to each log made a 7-byte "source" that hashed to a code_sha256 the log itself
    declared: verify said OK at p = 0.0010 for logs with edited code and other val_tokens, and extract wrote the 7
    bytes. The header is found from the log's structure (the last two rules): the prepended lines are source."""
    def hostile(t, i):
        t = edit(t)
        return t if i == 1 else with_hparams(t.replace("def main(", "def main_edited(", 1), val_tokens=4096)
    logs = copies(tmp_path, REAL_SAME + [REAL_OLDER], hostile)
    code, out, _ = run(capsys, "verify", *logs, "--target", "8")
    assert code == 1 and "OK" not in out, out
    for path in logs:
        assert f"FAIL {path}: edited: embedded source hashes to " in out, out
    code, _, err = run(capsys, "extract", logs[0], "-o", tmp_path / "x.py")
    assert code == 1 and "does not match its code_sha256 line (the log was edited)" in err, err
    assert not (tmp_path / "x.py").exists()
    # the source is all the text before the header: the prepended lines and the trainer's source
    text = logs[0].read_text()
    assert rec.read_log(logs[0]).source == text[:text.index(RULE + "\nRunning Python")]


def with_times(text: str, value: str, where: str) -> str:
    """The log with its last step's train_time (`where`: "steps", "summary" or "both") written as `value` (ms)."""
    last = re.findall(r"^step:(\d+)/\1 ", text, flags=re.M)[-1]
    if where in ("steps", "both"):
        text = re.sub(rf"^(step:{last}/{last} .*train_time:)\S+ms", rf"\g<1>{value}ms", text, flags=re.M)
    if where in ("summary", "both"):
        text = re.sub(r"^(summary: .*train_time:)\S+ms", rf"\g<1>{value}ms", text, flags=re.M)
    return text


IMPOSSIBLE_TIMES = [("-100000", "both"), ("inf", "both"), ("nan", "both"), ("-0.5", "steps"), ("1e400", "summary"),
                    ("-inf", "summary"), ("NaN", "steps"), ("1.7e308", "both"), ("1000000000001", "summary")]


@pytest.mark.parametrize("value,where", IMPOSSIBLE_TIMES, ids=[f"{v} in {w}" for v, w in IMPOSSIBLE_TIMES])
def test_train_times_must_be_finite_and_not_negative(capsys, tmp_path, repo, value, where):
    """Rows 2 and 3: a train time of -100,000 ms or inf passed verify, and `new` filed a record whose time read
    -100.00 s; `train_time:nanms` passed verify, then summarize and new failed with an AttributeError traceback."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: with_times(t, value, where) if i == 2 else t)
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1 and "OK" not in out
    assert re.search(rf"^FAIL {re.escape(str(logs[1]))}: (summary )?train_time '{re.escape(value)}ms' (at step 6 )?"
                     r"cannot be a train time \(one is from 0 to 1e\+12 ms\)", out, flags=re.M), out
    code, out, err = run(capsys, "summarize", *logs, "--target", "7.5")
    assert code == 0 and "runs: 3 (2 complete)" in out and f"warning: {logs[1]}: left out of the statistics" in err
    assert "-100.00" not in out
    code, out, err = run(capsys, "new", "t", *logs, "--target", "7.5", "--records-dir", repo)
    assert code == 1 and err.endswith("error: no record filed: the logs fail verify (reasons above)\n")
    assert not repo.exists()
    lg = rec.read_log(logs[1])
    assert lg.train_time_ms is None or math.isfinite(lg.train_time_ms) and lg.train_time_ms >= 0
    assert all(t is None or math.isfinite(t) and t >= 0 for _, _, t in lg.vals)


HUGE_NUMBERS = [   # (id, the edit of each log's step 6 line)
    ("the issue's: a step of 5,000 digits",
     lambda t: t.replace("step:6/6 val_loss", "step:" + "6" * 5000 + "/6 val_loss")),
    ("a total of 5,000 digits", lambda t: t.replace("step:6/6 val_loss", "step:6/" + "9" * 5000 + " val_loss")),
    ("19 digits", lambda t: t.replace("step:6/6 val_loss", "step:" + "1" * 19 + "/6 val_loss")),
    ("num_iterations of 5,000 digits", lambda t: with_hparams(t, num_iterations="7" * 5000)),
    ("summary steps of 5,000 digits", lambda t: t.replace("steps:6", "steps:" + "6" * 5000)),
]


@pytest.mark.parametrize("edit", [e for _, e in HUGE_NUMBERS], ids=[i for i, _ in HUGE_NUMBERS])
def test_numbers_of_thousands_of_digits_are_refused_in_one_line(capsys, tmp_path, repo, edit):
    """Row 4: a step number of 5,000 digits hit Python's 4,300-digit int limit (a ValueError traceback); one such
    log in any record folder stopped `table` for every record."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: edit(t) if i == 3 else t)
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1 and f"FAIL {logs[2]}: " in out and "OK" not in out, out
    assert all(len(line) < 400 for line in out.splitlines()), out
    code, out, err = run(capsys, "summarize", *logs, "--target", "7.5")
    assert code == 0 and "runs: 3 (2 complete)" in out, (out, err)
    assert run(capsys, "new", "good", *SAME_CODE, "--records-dir", repo, "--target", "7.5")[0] == 0
    bad = repo / "2026-11-23_bad"
    bad.mkdir()
    for path in logs:
        shutil.copy(path, bad / path.name)
    code, _, err = run(capsys, "table", "--records-dir", repo)
    assert code == 0 and f"{bad}: left out of the table ({bad / logs[2].name}: " in err, err
    assert "[good](2026-11-22_good/README.md)" in (repo / "RECORDS.md").read_text()


ATTENTION_LINE = "attention: sdpa  lm_head: fp32  mlp up-projection: fp32  compile: off"


def with_line_after_device(text: str, line: str) -> str:
    return re.sub(r"^(device: .*\n)", rf"\g<1>{line}\n", text, count=1, flags=re.M)


PRECISIONS = [   # (id, the three logs' lm_head_precision and mlp_precision, the header line the trainer wrote)
    ("the issue's: fp32 spelled on a CPU", ["auto", "fp32", "fp32"], None),
    ("auto spelled with a blank", ["auto", " auto", "fp32"], None),
    ("as the header says the run used", ["auto", "fp32", "auto"], ATTENTION_LINE),
]


@pytest.mark.parametrize("values,line", [c[1:] for c in PRECISIONS], ids=[c[0] for c in PRECISIONS])
def test_precisions_are_compared_as_resolved(capsys, tmp_path, values, line):
    """Row 5 (records.py): on a CPU, --lm_head_precision=fp32 --mlp_precision=fp32 is what auto resolves to, yet
    verify called the runs different experiments; a same-seed rerun that spelled it out counted as a second sample
    (p 0.057 -> 0.008)."""
    def spelled(t, i):
        t = with_hparams(t, lm_head_precision=values[i - 1], mlp_precision=values[i - 1])
        return with_line_after_device(t, line) if line else t
    logs = copies(tmp_path, SAME_CODE, spelled)
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 0, out
    # a rerun of seed 1 that only spells the precision differently is the same sample
    rerun1 = copies(tmp_path, SAME_CODE[:1], lambda t, i: rerun(spelled(t, 2), 7), names=["rerun1.txt"])
    code, out, _ = run(capsys, "verify", *logs, *rerun1, "--target", "7.5")
    assert code == 1 and f"{rerun1[0]} duplicates {logs[0]} (same seed 1 and config: one sample)" in out, out


SPELLINGS = [   # (id, a list flag, its value in the first two logs, another spelling of it in the third, another value)
    ("the issue's: a weight of 0 written 0.0", "stage_prefix_weights", "0.25,0.25>0,0", "0.25,0.25>0.0,0",
     "0.25,0.25>0.1,0"),
    ("a weight that does not move written A>A", "stage_prefix_weights", "0.25,0.25>0,0", "0.25>0.25,0.25>0,0>0",
     "0.25>0,0.25>0,0"),
    ("multi-token weights", "stage_mtp_weights", "1,0.5>1,0/1>1/1>1", "1,.5>1,0.0/1/1e0", "1,0.5>1,0/1>1/1>0.5"),
    ("stage lrs", "stage_lr", "1.0,1.52,1.73", "1,1.520, 1.73", "1.0,1.52,1.74"),
    ("windows with blanks", "stage_windows", "1:2,2:4,3:6", "1:2, 2:4 ,3:6", "1:2,2:4,3:7"),
    ("a role's layers in another order", "paired_layers", "0,4", "4,0", "0,3"),
]


@pytest.mark.parametrize("flag,value,spelled,another", [c[1:] for c in SPELLINGS], ids=[c[0] for c in SPELLINGS])
def test_list_flags_are_compared_as_their_values(capsys, tmp_path, flag, value, spelled, another):
    """Issue 53 row 2: the stage lists were compared as text. --stage_prefix_weights=0.25,0.25>0.0,0 is the default
    written another way, yet verify called the runs different experiments; with --allow-differences a same-seed
    rerun spelling it so became a second sample (p 0.096 -> 0.025). Each list is read into its values by the
    trainer's grammar (records.list_value) and compared in one spelling of them."""
    logs = copies(tmp_path, SAME_CODE, lambda t, i: with_hparams(t, **{flag: (value, value, spelled)[i - 1]}))
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 0, out
    rerun1 = copies(tmp_path, SAME_CODE[:1], lambda t, i: rerun(with_hparams(t, **{flag: spelled}), 7),
                    names=["rerun1.txt"])
    code, out, _ = run(capsys, "verify", *logs, *rerun1, "--target", "7.5", f"--allow-differences={flag}")
    assert code == 1 and f"{rerun1[0]} duplicates {logs[0]} (same seed 1 and config: one sample)" in out, out
    # another value is another experiment, named in its one spelling
    other = copies(tmp_path, SAME_CODE[2:], lambda t, i: with_hparams(t, **{flag: another}), names=["other.txt"])
    code, out, _ = run(capsys, "verify", *logs[:2], *other, "--target", "7.5")
    assert code == 1 and f"FAIL not the same experiment: {flag} is " in out, out


def test_precisions_that_may_differ_on_a_gpu_are_other_experiments(capsys, tmp_path):
    """On a GPU, auto is fp8 or bf16 by the card: without the header's line saying which, auto is not bf16; with it,
    the run's own resolved value is compared."""
    def on_a_gpu(t, i, line=None):
        t = with_hparams(t.replace("device: cpu ", "device: cuda (NVIDIA H100) "), lm_head_precision=["auto", "bf16",
                                                                                                      "bf16"][i - 1])
        return with_line_after_device(t, line) if line else t
    logs = copies(tmp_path, SAME_CODE, on_a_gpu)
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1 and "FAIL not the same experiment: lm_head_precision is auto in " in out, out
    said = copies(tmp_path, SAME_CODE, lambda t, i: on_a_gpu(t, i, "attention: flex  lm_head: bf16 (this GPU has no "
                                                                "FP8 tensor cores)  mlp up-projection: bf16"),
                  names=["s1.txt", "s2.txt", "s3.txt"])
    code, out, _ = run(capsys, "verify", *said, "--target", "7.5")
    assert code == 0, out
    fp8 = copies(tmp_path, SAME_CODE, lambda t, i: on_a_gpu(t, i, f"attention: flex  lm_head: {('fp8', 'bf16')[i > 1]}"
                                                                   "  mlp up-projection: bf16"),
                 names=["f1.txt", "f2.txt", "f3.txt"])
    code, out, _ = run(capsys, "verify", *fp8, "--target", "7.5")
    assert code == 1 and "FAIL not the same experiment: lm_head_precision is fp8 in " in out, out


def drifting(text: str, ms) -> str:
    """The log text with the train_time of its n-th timed step line (from 1) moved by ms(n) ms."""
    lines = iter(range(1, 10 ** 6))
    return re.sub(r"^(step:[1-9]\d*/.*train_time:)(\d+)ms", lambda m: f"{m[1]}{int(m[2]) + ms(next(lines))}ms", text,
                  flags=re.M)


COPIES = [   # (id, the edit that makes seed 1's log another "run")
    # issue 53 row 3: the times drift (a growing 1-4 ms, never one constant): a third sample, p 0.0024 -> 1.3e-5
    ("issue 53's: seed 77, another run id, times drifting by a growing 1-4 ms",
     lambda t: drifting(rerun(t, 0, seed=77), lambda n: 1 + (3 * n) // 9)),
    ("times drifting both ways, seed 5", lambda t: drifting(rerun(t, 0, seed=5), lambda n: (-1) ** n * n)),
    ("seed 2's step times on seed 1's losses", lambda t: with_hparams(re.sub(
        r"train_time:\d+ms", lambda m, times=iter(re.findall(r"train_time:\d+ms", SAME_CODE[1].read_text())):
        next(times), t), seed=2).replace("run_id: handmade-cpu-run1", "run_id: handmade-cpu-run9")),
    ("every time 3% longer, seed 8", lambda t: rerun(re.sub(
        r"train_time:(\d+)ms", lambda m: f"train_time:{int(m[1]) * 103 // 100}ms", t), 0, seed=8)),
    # issue 46 row 14: times shifted by one constant
    ("the issue's: seed 77, another run id, times +2 ms", lambda t: rerun(t, 2, seed=77)),
    ("times +2 ms from step 1 on", lambda t: re.sub(r"^(step:[1-9]\d*/.*train_time:)(\d+)ms",
                                                    lambda m: f"{m[1]}{int(m[2]) + 2}ms",
                                                    with_hparams(t, seed=5), flags=re.M).replace(
        "run_id: handmade-cpu-run1", "run_id: x")),
    ("no seed in the header, losses written 7.1 for 7.1000", lambda t: re.sub(r"^  seed = .*\n", "", rerun(
        t, 3).replace("val_loss:7.1000", "val_loss:7.1"), flags=re.M)),
]


@pytest.mark.parametrize("edit", [e for _, e in COPIES], ids=[i for i, _ in COPIES])
def test_a_copy_with_other_seed_run_id_and_times_is_a_duplicate(capsys, tmp_path, repo, edit):
    """Row 14 (issue 46): a copy of seed 1's log with `seed = 77` in the header, another run id and times +2 ms was
    a third sample: its losses equal seed 1's, and p fell from 0.0024 to 1.3e-5. Issue 53 row 3: the check then knew
    one constant shift of the times, and a copy whose times drift by a growing 1-4 ms passed. The losses at every
    validation and step line identify a run, whatever its times, seed or run id say: no header edit changes them."""
    copy = copies(tmp_path, SAME_CODE[:1], lambda t, i: edit(t), names=["copy.txt"])[0]
    logs = [SAME_CODE[0], SAME_CODE[1], copy]
    code, out, _ = run(capsys, "verify", *logs, "--target", "7.5")
    assert code == 1 and re.search(rf"^FAIL duplicate runs: {re.escape(str(copy))} duplicates "
                                   rf"{re.escape(str(SAME_CODE[0]))} \(identical losses at all 9 logged values: one "
                                   rf"computation, whatever its times, seed and run id say\)$", out, flags=re.M), out
    code, _, err = run(capsys, "summarize", *logs, "--target", "7.5")
    assert code == 1 and "identical losses at all 9 logged values" in err
    code, _, err = run(capsys, "compare", "--baseline", *SAME_CODE[:2], "--candidate", copy, SAME_CODE[2])
    assert code == 1 and f"candidate {copy} duplicates baseline {SAME_CODE[0]}" in err, err
    assert run(capsys, "new", "dup", *logs, "--target", "7.5", "--records-dir", repo)[0] == 1 and not repo.exists()


def test_no_two_real_runs_are_duplicates():
    """Issue 53 row 3, what the rule on losses must not do: every pair of distinct runs among the fixtures (the public
    8xH100 logs, the real CPU logs, the hand-made ones and the filed CPU record's) is two runs."""
    paths = sorted(FIXTURES.glob("*/*.txt")) + sorted((ROOT / "records").glob("*_*/*.txt"))
    logs = [rec.read_log(path) for path in paths]
    assert len(logs) >= 16
    assert [(a.name, b.name, why) for i, a in enumerate(logs) for b in logs[i + 1:]
            if (why := rec.duplicate_reason(a, b))] == []


def test_runs_with_the_same_losses_at_other_step_times_are_distinct(capsys, tmp_path):
    """Two runs of a math-identical change (the same losses) at other speeds are two samples of time: compare
    takes them."""
    def faster(t, i):
        t = with_source(t, t[:t.index(RULE)].replace("trainer A", "trainer B"))
        t = re.sub(r"train_time:(\d+)ms", lambda m: f"train_time:{int(m[1]) * 9 // 10}ms", t)
        return t.replace("run_id: ", "run_id: faster-")
    faster = copies(tmp_path, SAME_CODE, faster)
    code, out, err = run(capsys, "compare", "--baseline", *SAME_CODE, "--candidate", *faster)
    assert code == 0 and "candidate faster at p < 0.01 (one-sided Welch): yes" in out, (out, err)


@pytest.mark.parametrize("output", ["", " "])
@pytest.mark.parametrize("command", ["extract", "plot"])
def test_an_empty_output_names_no_file(capsys, tmp_path, monkeypatch, command, output):
    """Row 17: `-o ''` said "Device or resource busy"; bench.py words the same mistake as "names no folder"."""
    monkeypatch.chdir(tmp_path)
    argv = ["extract", SAME_CODE[0]] if command == "extract" else ["plot", *SAME_CODE]
    code, out, err = run(capsys, *argv, "-o", output)
    assert code == 1 and err.startswith(f"error: -o {output!r}: names no file or folder; give the file ") \
        and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []

"""The writers in data/ (data/safe_write.py): one run per output folder, never a mix of two runs' shards; no
temporary or half-written file after a full disk, an error, Ctrl-C or SIGTERM; a lock left by a killed run is
taken over in one line. Real processes where two runs meet; tiny inputs, so the file takes a few seconds."""

import errno
import os
import re
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, communicate_or_fail, run_command

DATA = REPO / "data"
sys.path.insert(0, str(DATA))
import cached_fineweb10B  # noqa: E402
import hellaswag  # noqa: E402
import safe_write  # noqa: E402
import shards  # noqa: E402
import tokenize_text  # noqa: E402

BPE = ["--bpe-file", str(tokenize_text.BUNDLED_BPE), "--workers", "1"]
DEADLINE_S = 60  # for a subprocess to reach its gate or to finish; each takes about a second
# tokenize_text.py's command line, in a process that stops after its first shard until the file GATE.go
# exists (it creates GATE.ready when it gets there): the moment at which a second run used to slip in.
GATED = f"""
import os, sys, time
sys.path.insert(0, {str(DATA)!r})
import shards, tokenize_text
gate, sys.argv = sys.argv[1], [tokenize_text.__file__, *sys.argv[2:]]
write = shards.write_shard
def gated(*args, **kwargs):
    count = write(*args, **kwargs)
    if not os.path.exists(gate + ".ready"):
        open(gate + ".ready", "w").close()
        deadline = time.monotonic() + {DEADLINE_S}
        while not os.path.exists(gate + ".go"):
            if time.monotonic() > deadline:  # the test failed before releasing it
                sys.exit(3)
            time.sleep(0.01)
    return count
shards.write_shard = gated
sys.exit(tokenize_text.main(sys.argv[1:]))
"""


def corpus(folder, word: str, documents: int):
    """documents .txt files of about 40 tokens each, all made of word."""
    folder.mkdir()
    for i in range(documents):
        (folder / f"{i:02d}.txt").write_text(f"{word} {i}. " * 12 + "\n")
    return folder


def tokenize(*args, cwd):
    return run_command([sys.executable, str(DATA / "tokenize_text.py"), *map(str, args), *BPE], cwd=cwd,
                       timeout=DEADLINE_S)


_STARTED = []  # the gated runs of the current test, stopped at its end if it failed before they finished


@pytest.fixture(autouse=True)
def stop_gated_runs():
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            process.kill()
        process.communicate()


def start_gated(gate, *args, cwd):
    """tokenize_text.py with args, stopped after its first shard: returns the process once it is there."""
    process = subprocess.Popen([sys.executable, "-c", GATED, str(gate), *map(str, args), *BPE], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _STARTED.append(process)
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(f"{gate}.ready"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"the gated run did not reach its gate (exit {process.returncode}): {err}")
        time.sleep(0.01)
    return process


def finish(process, gate) -> tuple[int, str, str]:
    open(f"{gate}.go", "w").close()
    out, err = communicate_or_fail(process, DEADLINE_S)
    return process.returncode, out, err


def printed_shards(stdout: str, cwd) -> dict:
    """{file name: token count} from tokenize_text.py's summary lines ("  PATH  1,234 tokens, 3,492 bytes")."""
    found = re.findall(r"^  (\S+)  ([\d,]+) tokens, [\d,]+ bytes$", stdout, re.MULTILINE)
    return {(cwd / path).name: int(count.replace(",", "")) for path, count in found}


def folder_shards(folder) -> dict:
    return {p.name: shards.check_shard(p) for p in sorted(folder.glob("*.bin"))}


def hidden(folder) -> list[str]:
    """What a run must not leave behind: its lock file, staging folder, temporaries."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def text_of(folder) -> str:
    encoding = tokenize_text.load_encoding(tokenize_text.BUNDLED_BPE)
    return "".join(encoding.decode(shards.read_tokens(p).tolist()) for p in sorted(folder.glob("*.bin")))


def enospc_on_file_fsync(number: int):
    """An os.fsync that fails with a full disk on the number-th fsync of a file (folders' fsyncs pass)."""
    real, files = os.fsync, []

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files.append(fd)
            if len(files) == number:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    return fsync


# -----------------------------------------------------------------------------
# Two runs into one folder

@pytest.mark.parametrize("overwrite", [False, True], ids=["new folder", "--overwrite"])
def test_a_second_run_into_the_same_out_is_refused_while_the_first_writes(tmp_path, overwrite):
    """The issue's case: run A stops after its first shard; run B, with the same --out and --prefix (and more
    shards than A), used to pass the check for old shards and exit 0, leaving A's shards 1-2 and B's 3-4."""
    first, second = corpus(tmp_path / "a", "apple", 2), corpus(tmp_path / "b", "berry", 4)
    out, flags = tmp_path / "out", ["--shard-tokens", "60", "--prefix", "set"]
    if overwrite:  # an old set of 5 shards, which A must replace as a whole
        old = tokenize(corpus(tmp_path / "old", "cherry", 5), "--out", out, *flags, cwd=tmp_path)
        assert old.returncode == 0 and len(folder_shards(out)) == 5, old.stderr
        flags.append("--overwrite")
    gate = tmp_path / "gate"
    run_a = start_gated(gate, first, "--out", out, *flags, cwd=tmp_path)

    run_b = tokenize(second, "--out", out, *flags, cwd=tmp_path)
    assert run_b.returncode == 1, run_b.stdout
    assert run_b.stderr.splitlines() == [f"error: --out {out} is being written by another run (pid {run_a.pid}, "
                                         f"tokenize_text.py); wait for it to finish (its lock file: "
                                         f"{out / safe_write.LOCK_NAME})"]
    code, stdout, stderr = finish(run_a, gate)
    assert code == 0, stderr
    printed = printed_shards(stdout, tmp_path)
    assert sorted(printed) == ["set_train_000001.bin", "set_train_000002.bin"]
    assert folder_shards(out) == printed  # exactly A's shards, with the counts A printed
    assert "apple" in text_of(out) and "berry" not in text_of(out) and "cherry" not in text_of(out)
    assert hidden(out) == []


def test_a_lock_held_elsewhere_refuses_the_tokenizer_and_the_downloader(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert tokenize_text.main([str(corpus(tmp_path / "a", "apple", 3)), "--out", str(out), "--shard-tokens", "60",
                               *BPE]) == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    (out / cached_fineweb10B.STAGING).mkdir()
    (out / cached_fineweb10B.STAGING / "partial.incomplete").write_bytes(b"\0" * 10)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("downloaded anyway"))
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):  # cached_fineweb10B.main sets these
        monkeypatch.setenv(name, "10")
    capsys.readouterr()
    busy = f"is being written by another run (pid {os.getpid()}, "
    with safe_write.FolderLock(out, "held by the test"):
        assert tokenize_text.main([str(tmp_path / "a"), "--out", str(out), "--overwrite", *BPE]) == 1
        assert capsys.readouterr().err.startswith(f"error: --out {out} {busy}")
        assert cached_fineweb10B.main(["0", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out} {busy}") and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == before
    assert (out / cached_fineweb10B.STAGING / "partial.incomplete").exists()  # the holder's files are its own
    assert hidden(out) == [cached_fineweb10B.STAGING]


# -----------------------------------------------------------------------------
# Stale locks

def test_a_stale_lock_and_staging_folder_of_a_killed_run_are_taken_over_in_one_line_each(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    gone = run_command([sys.executable, "-c", "import os; print(os.getpid())"], timeout=DEADLINE_S)
    dead_pid = int(gone.stdout)
    (out / safe_write.LOCK_NAME).write_text(f"{dead_pid} tokenize_text.py\n")
    (out / ".out-staging-x1y2").mkdir()
    shards.write_shard(out / ".out-staging-x1y2" / "out_train_000001.bin", np.arange(10))
    assert tokenize_text.main([str(corpus(tmp_path / "a", "apple", 1)), "--out", str(out), *BPE]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line]
    assert notes == [f"note: --out {out}: the run that claimed it (pid {dead_pid}, tokenize_text.py) is no longer "
                     f"running; taking over its stale lock file {out / safe_write.LOCK_NAME}",
                     f"note: --out {out}: removed 1 staging folder(s) left by a run that was killed"]
    assert list(folder_shards(out)) == ["out_train_000001.bin"] and hidden(out) == []


# -----------------------------------------------------------------------------
# Lock files that no run made (issue 38, rows 1 and 19): never followed, truncated or printed raw

SECRET = "keep me \x1b[2J\x1b[32mOK\x1b[0m\n"  # a file of the user's, with escape sequences in it


def planted_symlink(lock, victim):
    lock.symlink_to(victim)


def planted_hard_link(lock, victim):
    os.link(victim, lock)


def fineweb_offline(monkeypatch):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("downloaded anyway"))
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):  # cached_fineweb10B.main sets these
        monkeypatch.setenv(name, "10")


def run_tool(tool, tmp_path, out) -> int:
    if tool == "tokenize_text.py":
        return tokenize_text.main([str(corpus(tmp_path / "a", "apple", 2)), "--out", str(out), *BPE])
    return cached_fineweb10B.main(["0", "--out", str(out)])


@pytest.mark.parametrize("plant, kind", [(planted_symlink, "a symbolic link (to "),
                                         (planted_hard_link, "a file with 2 names (a hard link")],
                         ids=["symlink", "hard link"])
@pytest.mark.parametrize("tool", ["tokenize_text.py", "cached_fineweb10B.py"])
def test_a_planted_lock_file_is_refused_untouched_and_never_printed(tmp_path, capsys, monkeypatch, tool, plant, kind):
    """Row 1: a .writing.lock that was a symlink was followed: the file it named was truncated and overwritten,
    and its first 256 bytes were printed raw in the "stale lock" note."""
    fineweb_offline(monkeypatch)
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text(SECRET)
    plant(out / safe_write.LOCK_NAME, victim)
    capsys.readouterr()
    assert run_tool(tool, tmp_path, out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "keep me" not in err, err
    assert err.startswith(f"error: --out {out}: its lock file {out / safe_write.LOCK_NAME} is {kind}"), err
    assert victim.read_text() == SECRET
    assert not list(out.glob("*.bin"))


def test_a_stale_lock_file_s_content_is_shown_escaped(tmp_path, capsys):
    """Row 1, its note: what a lock file holds was printed as it is."""
    out = tmp_path / "out"
    out.mkdir()
    (out / safe_write.LOCK_NAME).write_text("99999999 \x1b[2J\x1b[32mOK\n")
    assert tokenize_text.main([str(corpus(tmp_path / "a", "apple", 1)), "--out", str(out), *BPE]) == 0
    note = capsys.readouterr().err
    assert "\x1b" not in note and "(pid 99999999, \\x1b[2J\\x1b[32mOK)" in note, note


def test_file_names_reach_the_terminal_escaped(tmp_path, capsys):
    """Row 5, the data tools: the names of the user's files were printed raw (a warning, an error)."""
    inputs = corpus(tmp_path / "a", "apple", 1)
    (inputs / f"e{SECRET.strip()}.txt").write_text("   \n")  # no text: a warning names it
    assert tokenize_text.main([str(inputs), "--out", str(tmp_path / "out"), *BPE]) == 0
    (inputs / f"bad{SECRET.strip()}.jsonl").write_text("{not json\n")
    assert tokenize_text.main([str(inputs), "--out", str(tmp_path / "out2"), *BPE]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\\x1b[2J") == 2, err


def unreadable(monkeypatch, folder):
    """os.scandir of folder fails as it does for another user's private folder (the tests run as root, whom
    permissions do not stop)."""
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == os.fspath(folder):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("where", ["input", "--val-files"])
def test_an_unreadable_input_folder_is_an_error_not_a_smaller_data_set(tmp_path, capsys, monkeypatch, where):
    """Row 7: an unreadable input subfolder was skipped without a word: the data set lacked its files and the tool
    exited 0."""
    books = corpus(tmp_path / "books", "apple", 2)
    args = [str(books), "--out", str(tmp_path / "out"), *BPE]
    if where == "input":
        private = corpus(books / "private", "pear", 2)
    else:  # held out, one folder further down
        (books / "held").mkdir()
        private = corpus(books / "held" / "private", "pear", 2)
        args += ["--val-files", str(books / "held")]
    unreadable(monkeypatch, private)
    flag, top = ("input", books) if where == "input" else ("--val-files", books / "held")
    assert tokenize_text.main(args) == 2
    assert capsys.readouterr().err == (f"error: {flag} {top}: cannot read the folder {private} (Permission denied), "
                                       f"so its files would be left out\n")
    assert not (tmp_path / "out").exists()


def test_long_legal_names_are_written(tmp_path, capsys):
    """Row 18: a temporary took its file's whole name: a legal 253-character one failed with "File name too long"
    (the shard of a 236-character --prefix, a file atomic_file writes)."""
    prefix = "p" * 236  # its shards' names are 253 characters long
    out = tmp_path / "out"
    assert tokenize_text.main([str(corpus(tmp_path / "a", "apple", 1)), "--out", str(out), "--prefix", prefix,
                               *BPE]) == 0, capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [f"{prefix}_train_000001.bin"]
    with safe_write.atomic_file(tmp_path / ("f" * 253)) as f:
        f.write(b"x")
    assert (tmp_path / ("f" * 253)).read_bytes() == b"x"


def make_fifo(path):
    os.mkfifo(path)


@pytest.mark.parametrize("make, kind", [(os.mkdir, "a folder"), (make_fifo, "a FIFO")], ids=["folder", "FIFO"])
@pytest.mark.parametrize("tool", ["tokenize_text.py", "cached_fineweb10B.py"])
def test_a_lock_that_is_not_a_file_is_named_not_the_output_folder(tmp_path, capsys, monkeypatch, tool, make, kind):
    """Row 19: a lock that was a folder or a FIFO was reported as `--out DIR: cannot write there (...)`."""
    fineweb_offline(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    make(out / safe_write.LOCK_NAME)
    capsys.readouterr()
    assert run_tool(tool, tmp_path, out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write there" not in err, err
    assert err.startswith(f"error: --out {out}: its lock file {out / safe_write.LOCK_NAME} is {kind}, not one a "
                          f"run of data/ made"), err
    assert os.path.lexists(out / safe_write.LOCK_NAME) and not list(out.glob("*.bin"))


KEEP_LOCK_IN_A_CHILD = f"""
import os, sys, time
sys.path.insert(0, {str(DATA)!r})
import safe_write
safe_write.FolderLock(sys.argv[1]).__enter__()
if os.fork() == 0:
    print(os.getpid(), flush=True)  # once fork() has returned here, the child has run its at-fork hooks
    time.sleep({DEADLINE_S})
    os._exit(0)
time.sleep({DEADLINE_S})
"""


def test_a_forked_child_does_not_keep_a_killed_parents_claim(tmp_path, capsys):
    """A tokenizer's pool workers are forked while it holds the lock; kill -9 the parent and they can live on.
    They must not keep the folder claimed: the next run takes the lock over."""
    parent = subprocess.Popen([sys.executable, "-c", KEEP_LOCK_IN_A_CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    try:
        parent.kill()
        parent.wait(timeout=DEADLINE_S)
        os.kill(child, 0)  # still alive, with a copy of the parent's descriptors
        with safe_write.FolderLock(tmp_path, "folder") as lock:
            assert lock.stale_holder == f"pid {parent.pid}, python"
        assert "is no longer running; taking over its stale lock file" in capsys.readouterr().err
    finally:
        os.kill(child, signal.SIGKILL)
        parent.stdout.close()
    assert not (tmp_path / safe_write.LOCK_NAME).exists()


# -----------------------------------------------------------------------------
# Failures and signals midway

def test_a_full_disk_midway_leaves_the_old_set_and_no_temporary(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert tokenize_text.main([str(corpus(tmp_path / "old", "cherry", 3)), "--out", str(out), "--shard-tokens",
                               "60", *BPE]) == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    capsys.readouterr()
    monkeypatch.setattr(os, "fsync", enospc_on_file_fsync(2))  # the second shard's
    code = tokenize_text.main([str(corpus(tmp_path / "new", "apple", 4)), "--out", str(out), "--shard-tokens",
                               "60", "--overwrite", *BPE])
    errors = capsys.readouterr().err.splitlines()
    assert code == 1 and len(errors) == 1, errors
    # the shard of --out it was to become, never the hidden staging file (issue 53 row 13)
    shard = out / "out_train_000002.bin"
    assert errors[0] == f"error: cannot write {shard}: the disk is full (No space left on device)"
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == before and hidden(out) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_midway_leaves_no_trace(tmp_path, signum, code):
    """Without a handler, SIGTERM used to end the run on the spot: its staging folder, half the data set, and
    the folders it made stayed."""
    gate, out = tmp_path / "gate", tmp_path / "new" / "out"
    run = start_gated(gate, corpus(tmp_path / "a", "apple", 3), "--out", out, "--shard-tokens", "60", cwd=tmp_path)
    run.send_signal(signum)
    _, err = communicate_or_fail(run, DEADLINE_S)
    assert run.returncode == code, err
    assert "Traceback" not in err and not (tmp_path / "new").exists()


def test_ctrl_c_during_the_swap_waits_until_the_folder_holds_the_whole_new_set(tmp_path, monkeypatch):
    out, stage = tmp_path / "out", tmp_path / "out" / ".set-staging-1"
    stage.mkdir(parents=True)
    for i in (1, 2, 3):  # the old set
        shards.write_shard(out / f"set_train_{i:06d}.bin", [0] * 5)
    new = [stage / f"set_train_{i:06d}.bin" for i in (1, 2)]
    for path in new:
        shards.write_shard(path, [1] * 7)
    real_replace = os.replace

    def replace(source, target):  # Ctrl-C as the first shard moves in
        os.kill(os.getpid(), signal.SIGINT)
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        tokenize_text.swap_in(out, "set", new)
    assert folder_shards(out) == {"set_train_000001.bin": 7, "set_train_000002.bin": 7}


def test_atomic_file_keeps_the_old_file_after_any_failure(tmp_path, monkeypatch):
    target = tmp_path / "meta.json"
    target.write_text("old")
    with pytest.raises(ValueError, match="bad data"):
        with safe_write.atomic_file(target) as f:
            f.write(b"half")
            raise ValueError("bad data")
    monkeypatch.setattr(os, "fsync", enospc_on_file_fsync(1))
    with pytest.raises(OSError, match="No space left"):
        with safe_write.atomic_file(target) as f:
            f.write(b"new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["meta.json"]
    monkeypatch.undo()
    with safe_write.atomic_file(target) as f:
        f.write(b"new")
        assert f.name != str(target) and os.path.dirname(f.name) == str(tmp_path)
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == safe_write.FILE_MODE
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_the_downloads_leave_nothing_when_the_disk_is_full(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "fsync", enospc_on_file_fsync(1))
    out = tmp_path / "hellaswag" / "val.jsonl"
    fixture = REPO / "tests/fixtures/hellaswag/tiny_val.jsonl"
    with pytest.raises(hellaswag.HellaSwagError, match=r"^--out .*val.jsonl: cannot write there \(No space left"):
        hellaswag.download(out, url=fixture.as_uri(), expected_examples=5)
    assert list(tmp_path.iterdir()) == []

    import huggingface_hub

    def download(repo_id, filename, repo_type=None, local_dir=None, etag_timeout=None):
        os.makedirs(local_dir, exist_ok=True)
        path = os.path.join(local_dir, filename)
        shards.write_shard(path, np.arange(100))  # its fsync is the first: let it pass
        return path

    monkeypatch.setattr(os, "fsync", enospc_on_file_fsync(2))
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url, timeout=None: type("Meta", (), {"size": None}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.setenv(name, "10")
    assert cached_fineweb10B.main(["0", "--out", str(tmp_path / "fineweb")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot write {tmp_path / 'fineweb' / 'fineweb_val_000000.bin'}: No space left on device; "
        f"run again to retry"]
    assert list(tmp_path.iterdir()) == []

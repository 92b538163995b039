"""Checkpoint safety (refused resumes, unsafe pickles, a crash mid-save), non-finite loss, a dead rank,
durable logs. Exact resume at several world sizes and two nodes: test_world_sizes.py."""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_gpt as T
from conftest import (REPO, SHORT, TRAIN, communicate_or_fail, cpu_env, in_process, kill_and_fail, kill_tree, train_at,
                      val_losses)


def refused(proc, *fragments):
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def saved_untrained(argv: list[str], folder: Path) -> Path:
    """The checkpoint a run of argv would save at step 2, saved from its untrained model, optimizers and loader:
    what a refusal that reads only meta.json and the folder needs, without training the SHORT run (15 s)."""
    args = T.parse_args([*argv, f"--checkpoint_dir={folder}"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    loader = T.TrainLoader(args, env)
    return T.save_checkpoint(2, 1.0, model, T.build_optimizers(model, args), loader, args, env, TRAIN.read_text(),
                             "untrained")


def test_mismatched_checkpoints_are_refused(tmp_path):
    checkpoint = saved_untrained(SHORT, tmp_path / "ck")
    common = [*SHORT, f"--logs_dir={tmp_path}/logs"]
    # another config
    refused(train_at(1, *common, "--adam_lr=0.5", f"--resume={checkpoint}", check=False),
            "config differs in adam_lr", "--force_resume")
    # not a checkpoint at all
    refused(train_at(1, *common, f"--resume={tmp_path}", check=False), "not a complete checkpoint")


@pytest.mark.slow
def test_checkpoints_of_another_world_size_are_refused_by_every_rank(short_run, tmp_path):
    checkpoint = short_run(1).checkpoint(2)
    proc = train_at(2, *SHORT, f"--logs_dir={tmp_path}/logs", f"--resume={checkpoint}", check=False)
    assert proc.returncode != 0
    for rank in (0, 1):  # every rank says so, and all stop
        assert f"error [rank {rank}]: --resume={checkpoint}: written at world size 1" in proc.stderr


@pytest.mark.slow  # resumes the SHORT run and trains two steps
def test_checkpoints_of_other_code_are_refused_unless_forced(short_run, tmp_path):
    common = [*SHORT, f"--logs_dir={tmp_path}/logs"]
    checkpoint = short_run(1).checkpoint(2)
    # A copy of train_gpt.py with a comment added, loaded in this process.
    edited_path = tmp_path / "train_gpt.py"
    edited_path.write_text(TRAIN.read_text() + "\n# an edit\n")
    (tmp_path / "data").mkdir()  # with the GPT-2 ranks the smoke preset's prefix-token loss reads next to it
    shutil.copy(TRAIN.parent / "data/gpt2.tiktoken", tmp_path / "data/gpt2.tiktoken")
    spec = importlib.util.spec_from_file_location("edited_train_gpt", edited_path)
    edited = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = edited  # dataclasses look their module up there
    try:
        spec.loader.exec_module(edited)
        refused(in_process(edited.main, *common, f"--resume={checkpoint}"), "different train_gpt.py")
        # ... unless forced (from the last checkpoint before the end: the shortest run that resumes)
        proc = in_process(edited.main, *common, f"--resume={short_run(1).checkpoint(6)}", "--force_resume=true",
                          "--warmup_steps=0", "--run_id=forced")
    finally:
        del sys.modules[spec.name]
    assert proc.returncode == 0, proc.stderr
    forced = (tmp_path / "logs/forced.txt").read_text()
    assert "at step 6" in forced and sorted(val_losses(forced)) == [8]


@pytest.mark.slow  # resumes the SHORT run for its final validation
def test_resume_latest_and_unsafe_pickles(short_run, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(short_run(1).checkpoint_dir, ck)
    run_dir = ck / short_run(1).run_id
    assert (run_dir / "latest").read_text().strip() == "step_000008"
    # No warmup (a run-control field): what is checked here does not need the kernels warm.
    common = [*SHORT, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={ck}", "--warmup_steps=0"]
    train_at(1, *common, "--resume=latest", "--run_id=latest")  # at the last step: only the final validation runs
    latest = (tmp_path / "logs/latest.txt").read_text()
    assert "at step 8" in latest and val_losses(latest) == {8: short_run(1).val_losses[8]}

    # A checkpoint whose pickle would run code is refused by safe loading.
    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    checkpoint = run_dir / "step_000006"
    torch.save({"optimizers": Exploit()}, checkpoint / "rank_0.pt")
    meta = json.loads((checkpoint / "meta.json").read_text())  # past the size and sha256 checks, to the loader
    data = (checkpoint / "rank_0.pt").read_bytes()
    meta["files"]["rank_0.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    refused(train_at(1, *common, f"--resume={checkpoint}", "--run_id=unsafe", check=False), "cannot load")
    assert not (tmp_path / "pwned").exists()


def test_a_crash_during_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    args = T.parse_args(["--preset=smoke", f"--checkpoint_dir={tmp_path}"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    optimizers = T.build_optimizers(model, args)
    loader = T.SyntheticLoader(args, env)
    source = TRAIN.read_text()
    good = T.save_checkpoint(2, 1.0, model, optimizers, loader, args, env, source, "run")

    real_save = torch.save

    def crash_on_model(obj, path, *a, **k):
        if "embed.weight" in obj:  # the model's state dict
            raise OSError("disk full")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", crash_on_model)
    with pytest.raises(T.TrainingError, match="disk full"):
        T.save_checkpoint(4, 2.0, model, optimizers, loader, args, env, source, "run")
    assert not (tmp_path / "run/step_000004").exists()
    assert (tmp_path / "run/latest").read_text().strip() == good.name
    assert T.resolve_checkpoint("latest", args) == good
    assert (good / "meta.json").is_file()


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_with_the_log_intact(tmp_path):
    # A huge learning rate makes the weights non-finite in ANVIL's first steps, then the train loss; it is
    # checked every 4 steps (no validation comes first).
    proc = train_at(2, *SHORT, "--val_loss_every=0", "--train_loss_every=4", "--anvil_lr=1e30",
                    f"--logs_dir={tmp_path}", "--run_id=nan", check=False)
    assert proc.returncode != 0
    assert "non-finite train loss (nan) at step 4" in proc.stderr
    log = (tmp_path / "nan.txt").read_text()
    steps = [int(s) for s in re.findall(r"^step:(\d+)/8 (?:train_loss:\S+ )?train_time", log, re.M)]
    assert steps == [1, 2, 3, 4]
    assert log.rstrip().splitlines()[-1] == "error: non-finite train loss (nan) at step 4: stopping the run"
    assert "\nsummary:" not in log.split("=" * 100)[-1]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def rank_of(pid: int) -> int | None:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


# Small steps, and enough of them that the run is still going when a test kills it.
LONG_SHORT = [*SHORT, "--num_iterations=100", "--val_loss_every=0", "--repeat_data=true"]  # longer than the shard


def wait_for(path, pattern, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and re.search(pattern, path.read_text(), re.M):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {communicate_or_fail(proc, 30)}")
        time.sleep(0.2)
    kill_and_fail(proc, f"{pattern!r} never appeared in {path} within {timeout} s")


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_within_the_timeout(tmp_path):
    timeout_s = 30
    log = tmp_path / "kill.txt"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(TRAIN), *LONG_SHORT, f"--logs_dir={tmp_path}", "--run_id=kill",
                             f"--pg_timeout_s={timeout_s}"],
                            cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(log, r"^step:3/", proc)
        victim = next(pid for pid in children(proc.pid) if rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        try:
            proc.wait(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            kill_and_fail(proc, f"still running {timeout_s + 60} s after rank 1 was killed")
        took = time.time() - killed_at
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun and its ranks, which run in sessions of their own
    print(f"the job exited {took:.1f}s after rank 1 was killed")
    assert proc.returncode != 0
    assert took < timeout_s + 30
    last = log.read_text().rstrip().splitlines()[-1]
    assert last.startswith("error: "), last


@pytest.mark.slow
def test_a_killed_run_keeps_every_completed_step_in_its_log(tmp_path):
    log = tmp_path / "durable.txt"
    proc = subprocess.Popen([sys.executable, str(TRAIN), *LONG_SHORT, f"--logs_dir={tmp_path}", "--run_id=durable"],
                            cwd=REPO,
                            env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(log, r"^step:4/", proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    steps = [int(s) for s in re.findall(r"^step:(\d+)/100 (?:train_loss:\S+ )?train_time", log.read_text(), re.M)]
    assert steps[:4] == [1, 2, 3, 4] and steps == list(range(1, len(steps) + 1))


# -----------------------------------------------------------------------------
# Ctrl-C and SIGTERM: one line, exit 128 + the signal, no unfinished checkpoint, the last good one kept

@pytest.mark.slow  # trains four steps
def test_ctrl_c_during_a_save_keeps_the_last_checkpoint_and_ends_in_one_line(tmp_path, monkeypatch):
    real_write = T._RecordingWriter.write

    def write(self, data):  # Ctrl-C once model.pt of the step-4 checkpoint is half-way out
        if self.size and ".step_000004.partial/.model.pt." in os.readlink(f"/proc/self/fd/{self.fd}"):  # its temporary
            os.kill(os.getpid(), signal.SIGINT)
        return real_write(self, data)

    monkeypatch.setattr(T._RecordingWriter, "write", write)
    proc = in_process(T.main, *SHORT, "--num_iterations=4", "--save_every=2", f"--logs_dir={tmp_path}",
                      f"--checkpoint_dir={tmp_path}/ck", "--run_id=ctrlc")
    line = "interrupted by SIGINT at step 4, while saving its checkpoint"
    assert (proc.returncode, proc.stderr) == (130, f"error [rank 0]: {line}\n")
    assert (tmp_path / "ctrlc.txt").read_text().endswith(f"\nerror: {line}\n")
    run_dir = tmp_path / "ck/ctrlc"
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step_000002"]
    assert (run_dir / "latest").read_text() == "step_000002\n"
    args = T.parse_args([*SHORT, "--num_iterations=4"], False)
    T.check_checkpoint(run_dir / "step_000002", args, T.DistEnv(0, 0, 1, torch.device("cpu")), TRAIN.read_text())


@pytest.mark.slow  # runs the trainer to its second step
def test_sigterm_outside_torchrun_says_so_and_leaves_no_empty_folders(tmp_path, monkeypatch):
    real_step = T.train_step

    def train_step(*args, **kwargs):
        if args[3] == 1:  # the step counter: SIGTERM once step 1 is done
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(T, "train_step", train_step)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    proc = in_process(T.main, *SHORT, "--save_every=2", "--save_final=true", f"--logs_dir={tmp_path}/logs",
                      f"--checkpoint_dir={tmp_path}/ck/deeper", "--run_id=term")
    assert (proc.returncode, proc.stderr) == (143, "error [rank 0]: stopped by SIGTERM at step 1\n")
    assert (tmp_path / "logs/term.txt").read_text().endswith("\nerror: stopped by SIGTERM at step 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # the checkpoint folders it made, empty, are gone


@pytest.mark.slow  # two ranks under torchrun
def test_ctrl_c_under_torchrun_ends_every_rank_in_one_line(tmp_path):
    # Ctrl-C in a terminal signals the whole foreground process group: torchrun and both ranks (and torchrun
    # then sends SIGINT to the ranks again). It comes as soon as a checkpoint after the first has started to be
    # written, so during that save or in the step after it.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(TRAIN), *LONG_SHORT, "--save_every=4", f"--logs_dir={tmp_path}",
                             f"--checkpoint_dir={tmp_path}/ck", "--run_id=ctrlc"],
                            cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    run_dir = tmp_path / "ck/ctrlc"
    try:
        deadline = time.time() + 300
        while not ((run_dir / "latest").exists() and list(run_dir.glob(".step_*.partial/*"))):
            if proc.poll() is not None or time.time() > deadline:
                kill_and_fail(proc, f"no checkpoint was being written (exit {proc.poll()})")
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = communicate_or_fail(proc, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun and its ranks, which run in sessions of their own
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    pattern = r"error \[rank ([01])\]: (interrupted by SIGINT at step \d+(?:, while saving its checkpoint)?)"
    matches = [re.fullmatch(pattern, line) for line in errors]
    assert all(matches) and sorted(m[1] for m in matches) == ["0", "1"], stderr[-3000:]
    rank_0 = next(m[2] for m in matches if m[1] == "0")
    assert (tmp_path / "ctrlc.txt").read_text().endswith(f"\nerror: {rank_0}\n")
    names = sorted(p.name for p in run_dir.iterdir())
    assert not [name for name in names if name.startswith(".")], names  # nothing unfinished
    latest = run_dir / (run_dir / "latest").read_text().strip()
    assert names == ["latest", *sorted(p.name for p in run_dir.glob("step_*"))] and latest.name == names[-1]
    args = T.parse_args([*LONG_SHORT, "--save_every=4"], False)
    T.check_checkpoint(latest, args, T.DistEnv(0, 0, 2, torch.device("cpu")), TRAIN.read_text())


class WriteRecorder:
    """A console stream that keeps each write: unbuffered (PYTHONUNBUFFERED), each is one write(2) to a pipe the
    ranks under torchrun share."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass


def test_each_console_line_goes_out_in_one_write(tmp_path, monkeypatch):
    # Two ranks' error lines, each printed as its text and then its newline, came out of torchrun as
    # "error [rank 0]: ...error [rank 1]: ...\n\n": a line and its newline must be one write.
    stdout, stderr = WriteRecorder(), WriteRecorder()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert T.report_error("error [rank 1]: interrupted by SIGINT at step 4", 130) == 130
    log = T.Logger(tmp_path / "run.txt")
    log("step:1/2 train_loss:10.8")
    log.close()
    assert stderr.writes == ["error [rank 1]: interrupted by SIGINT at step 4\n"]
    assert stdout.writes == ["step:1/2 train_loss:10.8\n"]

"""End-to-end runs of train_gpt.py on CPU: the smoke preset, world-size invariance, bad input."""

import contextlib
import dataclasses
import errno
import io
import os
import re
import sys

import pytest
import torch

import train_gpt as T
from conftest import SMOKE89, REPO, TRAIN, one_line_error, python, run_command, run_main, val_losses


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The README's main command on a machine without a GPU: the smoke preset, one process."""
    logs = tmp_path_factory.mktemp("logs")
    proc = python(TRAIN, f"--logs_dir={logs}", "--run_id=smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, (logs / "smoke.txt").read_text()


@pytest.mark.slow
def test_smoke_run_learns_and_writes_a_complete_log(smoke_run):
    proc, log = smoke_run
    args = T.parse_args([], cuda_available=False)
    steps_total = args.num_iterations
    losses = val_losses(log)
    assert sorted(losses) == [*range(0, steps_total, args.val_loss_every), steps_total]
    assert losses[0] - losses[steps_total] >= 3.0, losses
    source, header, steps = log.split("=" * 100 + "\n")
    assert source == TRAIN.read_text() + "\n"
    assert f"code_sha256: {T.code_hash(TRAIN.read_text())}" in header
    assert "NOT a record run" in header and "world_size: 1" in header
    assert f"  num_iterations = {steps_total}" in header
    # record #92's paths, at the smoke size
    for line in ("matrix optimizer: ANVIL", "training loss: sampled softmax (record #92)",
                 "n-gram table: 50,400 rows x 64 (bigram and trigram channels)", "terminal ships (record #92)"):
        assert f"\n{line}" in header, line
    step_lines = re.findall(rf"^step:(\d+)/{steps_total} (?:train_loss:\S+ )?train_time:\d+ms step_avg:\S+ms$", steps,
                            re.M)
    assert [int(s) for s in step_lines] == list(range(1, steps_total + 1))
    summary = steps.strip().splitlines()[-1]
    assert re.fullmatch(rf"summary: final_val_loss:\S+ train_time:\d+ms steps:{steps_total} tokens_per_s:\d+ "
                        rf"mfu:[\d.]+% world_size:1 device:cpu", summary), summary
    assert f"final_val_loss:{losses[steps_total]:.4f}" in summary
    assert "val_loss:" in proc.stdout and "summary:" in proc.stdout  # rank 0 prints the same lines


def test_missing_shards(tmp_path):
    proc = run_main( "--train_files=nowhere/fineweb_train_*.bin", f"--logs_dir={tmp_path}")
    one_line_error(proc, "nowhere/fineweb_train_*.bin", "python data/cached_fineweb10B.py")
    assert "tokenize_text.py" not in proc.stderr  # the bundled corpus is there: never told to rebuild it
    assert not list(tmp_path.iterdir()), "bad input must not leave a log behind"


def main_in(folder, *argv):
    """train_gpt.main(argv) in this process, with `folder` as the working directory."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = T.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow  # trains two steps
def test_the_smoke_preset_finds_its_bundled_corpus_from_another_directory(tmp_path):
    code, _, err = main_in(tmp_path, *SMOKE89, "--num_iterations=2", "--extension_steps=1",
                           "--val_loss_every=0", "--stage_batch_tokens=256,256,256", "--micro_batches=1", "--val_tokens=1024",
                           "--warmup_steps=0", "--logs_dir=logs", "--run_id=elsewhere")
    assert code == 0, err
    log = (tmp_path / "logs/elsewhere.txt").read_text()
    assert (f"data: --train_files=data/shakespeare/shakespeare_train_*.bin and --val_files=data/shakespeare/"
            f"shakespeare_val_*.bin matched nothing under the working directory; read relative to {REPO}\n") in log


def test_missing_shards_from_another_directory_say_where_they_were_looked_for(tmp_path):
    code, _, err = main_in(tmp_path, "--train_files=data/fineweb10B/fineweb_train_*.bin", "--logs_dir=logs")
    assert code == 2 and err.count("\n") == 1, err
    assert (f"no training shards match 'data/fineweb10B/fineweb_train_*.bin' (looked under the working directory "
            f"{tmp_path.resolve()} and under {REPO}): fetch FineWeb with `python data/cached_fineweb10B.py` in {REPO}; "
            f"the smoke preset (--preset=smoke) trains on the bundled corpus in {REPO}/data/shakespeare") in err
    assert list(tmp_path.iterdir()) == []


def test_corrupt_shard(tmp_path):
    bad = tmp_path / "bad_train_000001.bin"
    bad.write_bytes(b"\0" * 2048)
    proc = run_main(f"--train_files={tmp_path}/bad_train_*.bin", f"--logs_dir={tmp_path}/logs")
    one_line_error(proc, "bad_train_000001.bin", "not a token shard")
    assert not (tmp_path / "logs").exists()


def test_val_set_smaller_than_asked(tmp_path):
    proc = run_main("--val_tokens=1048576", f"--logs_dir={tmp_path}")
    one_line_error(proc, "fewer than --val_tokens=1048576")


def test_unknown_flag_and_wrong_type():
    one_line_error(run_main("--num_iteration=3"), "unknown flag --num_iteration", "--num_iterations")
    one_line_error(run_main("--num_iterations=three"), "--num_iterations=three: expected int")


def test_a_log_that_cannot_be_created_leaves_no_folders_behind(tmp_path, monkeypatch):
    real_open = os.open

    def full_disk(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk)
    proc = run_main(f"--logs_dir={tmp_path}/new/logs")
    one_line_error(proc, "--logs_dir", "cannot write the log (No space left on device)")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_logs_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_main(f"--logs_dir={blocker}/logs")
    one_line_error(proc, "--logs_dir", "cannot write the log")


@pytest.mark.slow
def test_init_from_starts_from_a_final_weights_folder(final_folder, short_run, tmp_path):
    # the SHORT run's trained weights, two more steps: no worse than its final val loss (by more than 0.3), far
    # below an untrained 10.8
    proc = run_main("--num_iterations=2", "--extension_steps=1", "--val_loss_every=0", "--warmup_steps=0",
                    "--val_tokens=2048", "--val_seq_len=512", f"--init_from={final_folder}",
                    f"--logs_dir={tmp_path}", "--run_id=init")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = val_losses((tmp_path / "init.txt").read_text())[2]
    trained = short_run(1).val_losses[8]
    assert trained < 10.3 and first < trained + 0.3, (first, trained)
    other = run_main("--model_dim=128", "--head_dim=32", f"--init_from={final_folder}", f"--logs_dir={tmp_path}")
    one_line_error(other, f"--init_from={final_folder}: its weights do not fit this config's model")


def test_init_from_takes_final_weights_of_either_record_preset(tmp_path):
    # record #89's FP8 scales are run state: --init_from starts them over (exact scales of the loaded weights), so
    # final weights with them start a run without them (record85), and the other way round
    with_scales = T.parse_args([*SMOKE89], False)
    without = T.parse_args([*SMOKE89, "--mlp_down_fp8=false"], False)
    for saved, loaded in ((with_scales, without), (without, with_scales)):
        folder = tmp_path / f"from_{saved.mlp_down_fp8}"
        folder.mkdir()
        torch.manual_seed(0)
        state = T.GPT(saved).state_dict()
        assert any(".mlp.down_" in k for k in state) == saved.mlp_down_fp8
        torch.save(state, folder / "model.pt")
        taken = T.read_init_weights(dataclasses.replace(loaded, init_from=str(folder)))
        assert taken.keys() == {k for k in state if ".mlp.down_" not in k and not k.startswith("rotary.")}
        model = T.build_model(loaded, T.DistEnv(0, 0, 1, torch.device("cpu")), taken)
        assert torch.equal(model.embed.weight, state["embed.weight"])


def test_run_sh_without_torch_says_so_in_one_line(tmp_path):
    # An interpreter that cannot import torch (-S: no site-packages), as on a machine where the install was skipped.
    no_torch = tmp_path / "python"
    no_torch.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_torch.chmod(0o755)
    proc = run_command([str(REPO / "run.sh")], env={**os.environ, "PYTHON": str(no_torch)}, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {no_torch} cannot import torch; install it first "
                                                f"(README, Quick start), or set PYTHON to an interpreter that has it"]

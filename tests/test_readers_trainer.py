"""Issue 46, the trainer's rows (5, 6, 7, 9, 10, 13, 15, 16): one reader per kind of input, where it enters.
Each row has a table, the reported input first, then neighbours of it; every first row fails on d25563f. Each
reader also has Hypothesis properties, called in-process on generated inputs: meta.json (parse_checkpoint_meta),
token shards (read_shard, used at every open), temporary names (temporary_path, safe_write.temporary_prefix).

A FIFO is only ever opened by the code under test through a helper (unblocked_fifo) that keeps opening it for
writing, so that a reader which waits on it (the old code did) gets end-of-file instead of hanging the suite."""

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import train_gpt as T
from conftest import REPO, run_main

sys.path.insert(0, str(REPO / "data"))
import safe_write  # noqa: E402
import shards  # noqa: E402

TRAIN = REPO / "train_gpt.py"
# test_bad_input.py's TINY: the smoke model, one 256-token micro-batch a step, two steps
TINY = ["--preset=smoke", "--num_iterations=2", "--extension_steps=1", "--val_loss_every=0",
        "--stage_batch_tokens=256,256,256", "--micro_batches=1", "--val_tokens=1024", "--warmup_steps=0"]
CPU = T.DistEnv(0, 0, 1, torch.device("cpu"))
BUNDLED_TRAIN = REPO / "data/shakespeare/shakespeare_train_000001.bin"
PROPERTY = settings(max_examples=150, deadline=None, database=None)


def one_error_line(proc, code: int, *fragments) -> str:
    """The run failed with this code and one printable `error` line holding every fragment."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error"), proc.stderr
    assert lines[0].isprintable(), lines[0]  # no escape sequence, carriage return or bidi mark reaches a terminal
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@contextlib.contextmanager
def unblocked_fifo(path):
    """A FIFO at path, opened for writing (and closed at once) over and over while the block runs: a reader that
    opens it waits a moment and then reads end-of-file, where it would otherwise wait forever."""
    os.mkfifo(path)
    done = threading.Event()

    def writer():
        while not done.wait(0.02):
            with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join()


# -----------------------------------------------------------------------------
# Checkpoints: one untrained checkpoint at the TINY run's last step (a resume of it runs only the final validation)

@pytest.fixture(scope="module")
def at_end(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    args = T.parse_args([*TINY, f"--checkpoint_dir={root}"], False)
    model = T.build_model(args, CPU)
    return T.save_checkpoint(2, 1234.0, model, T.build_optimizers(model, args), T.TrainLoader(args, CPU), args,
                             CPU, TRAIN.read_text(), "base")


def copy_with(checkpoint, folder, change=None):
    """The checkpoint's files as hard links in folder, meta.json rewritten by change(meta) (in place)."""
    folder.mkdir(parents=True)
    for f in checkpoint.iterdir():
        os.link(f, folder / f.name)
    if change is not None:
        meta = json.loads((folder / "meta.json").read_text())
        change(meta)
        (folder / "meta.json").unlink()
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def resume(folder, tmp_path, *flags):
    return run_main(*TINY, *flags, f"--resume={folder}", f"--logs_dir={tmp_path}/logs", "--run_id=again")


# Row 5: --lm_head_precision and --mlp_precision compared as resolve_precision settles them (fp32 on a CPU)
PRECISION_CASES = [
    # (what, the checkpoint config's values, flags of the resume, None if accepted, else the settings named)
    ("auto saved, fp32 spelled out (the issue's)", {}, ["--lm_head_precision=fp32", "--mlp_precision=fp32"], None),
    ("fp32 saved, auto resumed", {"lm_head_precision": "fp32", "mlp_precision": "fp32"}, [], None),
    ("one of them spelled out", {}, ["--mlp_precision=fp32"], None),
    ("bf16 is not what auto is on a CPU", {}, ["--lm_head_precision=bf16"], "lm_head_precision"),
    ("bf16 saved", {"mlp_precision": "bf16"}, ["--mlp_precision=fp32"], "mlp_precision"),
]


@pytest.mark.parametrize("what, saved, flags, differ", PRECISION_CASES, ids=[c[0] for c in PRECISION_CASES])
def test_precisions_are_compared_as_resolved(what, saved, flags, differ):
    args = T.parse_args([*TINY, *flags], False)
    theirs = {**T.config_for_checkpoint(T.parse_args(TINY, False)), **saved}
    ours, theirs = T.comparable_config(T.config_for_checkpoint(args), args), T.comparable_config(theirs, args)
    assert sorted(k for k in ours if ours[k] != theirs[k]) == ([differ] if differ else [])


@pytest.mark.parametrize("what, saved, flags, differ", PRECISION_CASES[:1] + PRECISION_CASES[3:4],
                         ids=[c[0] for c in PRECISION_CASES[:1] + PRECISION_CASES[3:4]])
def test_a_resume_spelling_out_the_resolved_precisions_runs(at_end, tmp_path, what, saved, flags, differ):
    folder = copy_with(at_end, tmp_path / "step_000002", lambda meta: meta["config"].update(saved))
    proc = resume(folder, tmp_path, *flags)
    if differ is None:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"resumed from {folder} at step 2" in (tmp_path / "logs/again.txt").read_text()
    else:
        one_error_line(proc, 1, f"config differs in {differ} (use --force_resume=true")

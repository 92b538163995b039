"""Bad inputs and faults (the fuzzing pass of issue 17), kept as tables: each row is an input or a fault
and what it must give (exit code, one `error: ...` line holding these fragments, nothing left behind).
The next fuzzing pass starts here: add a row.

Disk full is simulated in-process: `small_disk` replaces os.write, for files under one folder only, with
a write that stores what fits and then fails with ENOSPC, as a real full disk does; train_gpt.py and
records.py write every byte through os.write, so their real error paths run. One test also uses a real
kernel limit (RLIMIT_FSIZE, no privileges needed) for the same paths."""

import contextlib
import dataclasses
import errno
import importlib.util
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

import sample
import train_gpt as T
from conftest import (SMOKE89, REPO, fill_random, in_process, one_line_error, random_final_weights, random_model, run_main,
                      torchrun)

TRAIN = REPO / "train_gpt.py"
# The smoke model, one micro-batch of 256 tokens a step and one 1,024-token validation sequence: the
# smallest run that still trains, validates and checkpoints through the real code.
TINY = [*SMOKE89, "--num_iterations=2", "--extension_steps=1", "--val_loss_every=0",
        "--stage_batch_tokens=256,256,256", "--micro_batches=1", "--val_tokens=1024", "--warmup_steps=0"]


def one_line(proc, code: int, *fragments) -> str:
    """The command failed with this exit code and one error line holding every fragment."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error"), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# -----------------------------------------------------------------------------
# train_gpt.py: values that cannot be meant (exit 2, before anything is created)

FLAG_CASES = [
    # (flags, fragments of the error line)
    (["--adam_lr=-0.1"], ["--adam_lr=-0.1: must be a finite number >= 0"]),
    (["--muon_lr=nan"], ["--muon_lr=nan"]),
    (["--adam_weight_decay=inf"], ["--adam_weight_decay=inf"]),
    (["--muon_weight_decay=-1"], ["--muon_weight_decay=-1.0"]),
    (["--final_lr_frac=-0.5"], ["--final_lr_frac=-0.5"]),
    (["--muon_momentum_start=1"], ["--muon_momentum_start=1.0: must be in [0, 1)"]),
    (["--stage_lr=1,nan,2"], ["--stage_lr=1,nan,2: expected finite numbers >= 0"]),
    (["--muon_beta2=-0.1"], ["--muon_beta2=-0.1"]),
    (["--muon_momentum_end=1"], ["--muon_momentum_end=1.0"]),
    (["--adam_eps=0"], ["--adam_eps=0.0: must be a finite number > 0"]),
    (["--logit_cap=0"], ["--logit_cap=0.0"]),
    (["--logit_cap_width=0"], ["--logit_cap_width=0.0"]),
    (["--cooldown_frac=nan"], ["--cooldown_frac=nan"]),
    (["--pg_timeout_s=100000000000000"], ["--pg_timeout_s=100000000000000: must be in 1..604800"]),
    (["--pg_timeout_s=1e14"], ["--pg_timeout_s=1e14: expected int"]),
    (["--seed=-1"], ["--seed=-1: must be in 0..2**64-1"]),
    (["--run_id=../../escape"], ["--run_id=../../escape: must be a plain name"]),
    (["--run_id=a/b"], ["--run_id=a/b"]),
    (["--run_id=.."], ["--run_id=..: must be a plain name"]),
    (["--run_id=" + "x" * 201], ["must be a plain name of at most 200"]),
    (["--num_iterations=0"], ["--num_iterations=0: must be positive"]),
    (["--stage_batch_tokens=1000,2048,3072"], ["--stage_batch_tokens=1000,2048,3072: each batch must split into "
                                               "--micro_batches=1 micro-batches of a multiple of --window_block=64"]),
    (["--micro_batches=0"], ["--micro_batches=0: must be positive"]),
    (["--micro_batches=2,2"], ["--micro_batches=2,2: one count for every stage, or one per stage (3), or auto"]),
    (["--micro_batches=many"], ["--micro_batches=many: expected auto, a count, or one count per stage"]),
    (["--micro_batches=auto", "--stage_batch_tokens=1000,2048,3072"], ["--stage_batch_tokens=1000,2048,3072: each "
                                                                       "batch must split into --micro_batches=auto"]),
    (["--memory_limit_gib=-1"], ["--memory_limit_gib=-1.0: must be a number of GiB from 0 (the device's memory) "
                                 "to 1,048,576"]),
    (["--memory_limit_gib=inf"], ["--memory_limit_gib=inf"]),
    (["--memory_limit_gib=1e300"], ["--memory_limit_gib=1e+300: must be a number of GiB from 0"]),  # was an OverflowError
    (["--memory_limit_gib=1e299"], ["--memory_limit_gib=1e+299: must be a number of GiB from 0"]),  # was accepted
    (["--memory_limit_gib=nan"], ["--memory_limit_gib=nan"]),
    (["--preset=nope"], ["--preset=nope: unknown preset"]),
    (["--packing=bos"], ["--packing=bos: choose auto, documents, stream"]),
    (["--matrix_optimizer=adamw"], ["--matrix_optimizer=adamw: choose normuon, anvil"]),
    (["--anvil_beta_end=1"], ["--anvil_beta_end=1.0: must be in [0, 1)"]),
    (["--anvil_weight_decay=-1"], ["--anvil_weight_decay=-1.0: must be a finite number >= 0"]),
    (["--anvil_engage_step=-1"], ["--anvil_engage_step=-1: must be zero or positive"]),
    (["--val_seq_len=1048576", "--val_tokens=1048576"], ["--attention=sdpa: the dense attention mask of a "
                                                         "2,097,152-position sequence takes at least 36,864 GiB to "
                                                         "build"]),
    (["--synthetic=true", "--vocab_size=1000"], ["--vocab_size=1000: --synthetic=true documents start with "
                                                 "<|endoftext|>, token 50256"]),
    # a training shard that is also a validation shard, named directly, by a glob, or by another spelling
    (["--val_files=data/shakespeare/shakespeare_train_000001.bin"],
     ["data/shakespeare/shakespeare_train_000001.bin: both a training shard (--train_files=data/shakespeare/"
      "shakespeare_train_*.bin) and a validation shard (--val_files=data/shakespeare/shakespeare_train_000001.bin)"]),
    (["--val_files=data/shakespeare/*.bin"], ["shakespeare_train_000001.bin: both a training shard"]),
    (["--val_files=data/../data/shakespeare/./shakespeare_train_*.bin"], ["both a training shard"]),
    # issue 53 row 5: "A>" with nothing after the '>' was read as the constant A; its neighbours, each list flag
    (["--stage_prefix_weights=0.25,0.25>,0"], ["--stage_prefix_weights=0.25,0.25>,0: stage 2 ('0.25>') has nothing "
                                               "after the '>'; write start>end, or one value"]),
    (["--stage_mtp_weights=1,0.5>/1>1/1"], ["--stage_mtp_weights=1,0.5>/1>1/1: stage 1 ('1,0.5>') has nothing after "
                                            "the '>'"]),
    (["--stage_mtp_weights=1,0.5>1, 0/1> /1"], ["stage 2 ('1>') has nothing after the '>'"]),
    (["--stage_prefix_weights=>0.25,0,0"], ["--stage_prefix_weights=>0.25,0,0: stage 1 ('>0.25') has nothing before "
                                            "the '>'"]),
    (["--stage_prefix_weights=0.25>>0,0,0"], ["stage 1 ('0.25>>0') has more than one '>'"]),
    (["--stage_mtp_weights=1>1>0/1/1"], ["--stage_mtp_weights=1>1>0/1/1: stage 1 ('1>1>0') has more than one '>'"]),
    (["--stage_mtp_weights=1/1/1/"], ["--stage_mtp_weights=1/1/1/: expected comma-separated numbers"]),
    (["--stage_lr=1,,2"], ["--stage_lr=1,,2: expected comma-separated numbers"]),
    (["--stage_lr=1,2,3,"], ["--stage_lr=1,2,3,: expected comma-separated numbers"]),
    (["--stage_windows=1:2,2:4,3:"], ["--stage_windows=1:2,2:4,3:: expected short:long window blocks"]),
    (["--extension_windows=:7"], ["--extension_windows=:7: expected short:long window blocks"]),
    (["--stage_batch_tokens=256,256,"], ["--stage_batch_tokens=256,256,: expected comma-separated integers"]),
    (["--paired_layers=0,"], ["--paired_layers=0,: expected comma-separated integers"]),
    (["--skip_layers=1:"], ["--skip_layers=1:: expected source:target"]),
]


@pytest.mark.parametrize("flags, fragments", FLAG_CASES, ids=[" ".join(f) for f, _ in FLAG_CASES])
def test_values_that_cannot_be_meant_are_refused(tmp_path, flags, fragments):
    proc = run_main(*TINY, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck", *flags)
    one_line_error(proc, *fragments)
    assert list(tmp_path.iterdir()) == []  # no log, no folder


ENV_CASES = [
    # (what torchrun would set, set by hand instead; fragments of the error line)
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0 in the environment: a world size is at least 1"]),
    ({"WORLD_SIZE": "-8"}, ["WORLD_SIZE=-8 in the environment: a world size is at least 1"]),
    ({"WORLD_SIZE": "x"}, ["WORLD_SIZE='x' in the environment is not an integer"]),
    ({"WORLD_SIZE": "2", "RANK": "2"}, ["RANK=2 in the environment is outside 0..1 (WORLD_SIZE=2)"]),
    ({"RANK": "-1"}, ["RANK=-1 in the environment is outside 0..0 (WORLD_SIZE=1)"]),
    ({"LOCAL_RANK": "1"}, ["LOCAL_RANK=1 in the environment is outside 0..0"]),
    # a world size without the rendezvous torchrun sets up (was a ValueError traceback from init_process_group)
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
     ["WORLD_SIZE=2 in the environment, but MASTER_ADDR and MASTER_PORT are not set: start the ranks with torchrun "
      "(torchrun --standalone --nproc_per_node=2 train_gpt.py), which sets them"]),
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
     ["WORLD_SIZE=4 in the environment, but MASTER_PORT is not set"]),
    # issue 38 row 12: a port that is none (was torch's ValueError traceback from the rendezvous)
    *[({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
       [f"MASTER_PORT={port!r} in the environment is not a port (an integer from 1 to 65535; torchrun sets it)"])
      for port in ("abc", "99999", "-1", "1e4")],
]


@pytest.mark.parametrize("env, fragments", ENV_CASES, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in ENV_CASES])
def test_launch_variables_that_cannot_be_meant_are_refused(tmp_path, monkeypatch, env, fragments):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = run_main(*TINY, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck")
    one_line_error(proc, *fragments)
    assert list(tmp_path.iterdir()) == []


# -----------------------------------------------------------------------------
# Resuming: meta.json is checked against what it describes (exit 1, no log, the run id stays free)

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint at step 2 of the TINY run, made in-process: two training steps, then
    save_checkpoint (what the trainer does at --save_every=2)."""
    root = tmp_path_factory.mktemp("resume")
    args = T.parse_args([*TINY, f"--checkpoint_dir={root}"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    optimizers = T.build_optimizers(model, args)
    loader = T.TrainLoader(args, env)
    schedule = T.Schedule(args)
    for step in range(2):
        T.set_schedules(step, optimizers, schedule, args)
        T.train_step(model, optimizers, loader.next_batch(step), step, schedule, args, use_flex=False)
    return T.save_checkpoint(2, 1234.0, model, optimizers, loader, args, env, TRAIN.read_text(), "base")


def copy_of(checkpoint, tmp_path):
    """The checkpoint's files as hard links in a new folder: a case replaces a file, never edits one in place."""
    copy = tmp_path / checkpoint.name
    copy.mkdir()
    for f in checkpoint.iterdir():
        os.link(f, copy / f.name)
    return copy


def replace(path, data: bytes):
    path.unlink()
    path.write_bytes(data)


def edit_meta(change):
    def edit(folder):
        meta = json.loads((folder / "meta.json").read_text())
        meta = change(meta)
        replace(folder / "meta.json", json.dumps(meta).encode())
    return edit


def flip_a_byte(name):
    def edit(folder):
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        replace(folder / name, bytes(data))
    return edit


def truncate(name):
    def edit(folder):
        replace(folder / name, (folder / name).read_bytes()[:1000])
    return edit


def with_key(key, value):
    def change(meta):
        meta[key] = value
        return meta
    return change


def without_key(key):
    def change(meta):
        del meta[key]
        return meta
    return change


def edit_first_shard(key, value):
    def change(meta):
        meta["shards"][0][key] = value
        return meta
    return change


RESUME_CASES = [
    # (what is wrong, how the checkpoint is changed, fragments of the error line, flags of the resume)
    ("meta.json is {}", edit_meta(lambda meta: {}), ["meta.json has no valid 'step'"], []),
    ("meta.json is a list", edit_meta(lambda meta: [1, 2]), ["meta.json is not a checkpoint's (a JSON list"], []),
    ("step edited", edit_meta(with_key("step", 4)), ["meta.json says step 4, but rank_0.pt was saved at step 2"], []),
    ("step is text", edit_meta(with_key("step", "2")), ["meta.json has no valid 'step'"], []),
    ("loader is a list", edit_meta(with_key("loader", [])), ["meta.json has no valid 'loader'"], []),
    ("no file list (older format)", edit_meta(without_key("files")), ["meta.json has no valid 'files'"], []),
    ("file not listed", edit_meta(with_key("files", {})), ["meta.json does not list model.pt"], []),
    ("model.pt replaced", flip_a_byte("model.pt"), ["model.pt is not the file saved with this meta.json"], []),
    ("rank file truncated", truncate("rank_0.pt"), ["rank_0.pt has 1000 bytes, meta.json recorded"], []),
    ("rank file missing", lambda folder: (folder / "rank_0.pt").unlink(),
     ["rank_0.pt: cannot read (No such file or directory)"], []),
    # the training shards the checkpoint's run read, recorded in meta.json, are not this run's
    ("no shard list (older format)", edit_meta(without_key("shards")), ["meta.json has no valid 'shards'"], []),
    ("shard record not a list of records", edit_meta(with_key("shards", [5])), ["meta.json has no valid 'shards'"], []),
    ("another shard's fingerprint", edit_meta(edit_first_shard("fingerprint", "0" * 64)),
     ["training shard 1, data/shakespeare/shakespeare_train_000001.bin (2,846,636 bytes), is not the one the "
      "checkpoint's run read (data/shakespeare/shakespeare_train_000001.bin, 2,846,636 bytes, another fingerprint); "
      "use --force_resume=true"], []),
    ("another shard's size", edit_meta(edit_first_shard("bytes", 1000)), ["shakespeare_train_000001.bin, 1,000 bytes)"],
     []),
    # issue 38 rows 13 and 14: meta.json's numbers (no hash covers it) in range, before the log exists: the loader
    # past its shard was an IndexError after the log, -1 or 1.9 resumed elsewhere in silence, a NaN or -1e12 ms
    # train time was logged as such
    *[(f"loader at {value!r}", edit_meta(lambda meta, v=value: {**meta, "loader": {**meta["loader"], "piece": v}}),
       [f"meta.json puts the loader at {value!r} in training shard 1, data/shakespeare/shakespeare_train_000001.bin, "
        f"which has 709 pieces (documents): not a position in it"], []) for value in (10 ** 9, 710, -1, 1.9)],
    # issue 38 row 8: JSON nested thousands deep raised the parser's RecursionError, a traceback
    ("meta.json nested deeply", lambda folder: replace(folder / "meta.json", b"[" * 100_000 + b"]" * 100_000),
     ["unreadable meta.json (nested too deeply)"], []),
    ("meta.json's loader nested deeply", lambda folder: replace(folder / "meta.json", (
        (folder / "meta.json").read_text().replace('"loader": {', '"loader": {"x": ' + "[" * 100_000 + "]" * 100_000
                                                   + ", ", 1)).encode()),
     ["unreadable meta.json (nested too deeply"], []),
    *[(f"train_time_ms {value!r}", edit_meta(with_key("train_time_ms", value)),
       [f"meta.json's train_time_ms is {value!r}, not a time (a finite number of ms, 0 or more"], [])
      for value in (float("nan"), -1e12, float("inf"))],
    # --force_resume from a step with nothing left to train
    ("forced at the last step", None, ["the checkpoint is at step 2, at or past --num_iterations=2: nothing is left "
                                       "to train"], ["--force_resume=true"]),
    ("forced past the end", None, ["at step 2, at or past --num_iterations=1"],
     ["--force_resume=true", "--num_iterations=1", "--extension_steps=0"]),
    # --force_resume into another architecture: once load_state_dict's "(Error(s) in loading state_dict for GPT:)",
    # after the log was made
    ("forced into a wider model", None, ["its model.pt does not fit the model this config builds (",
                                         "shape mismatch(es): lm_head: checkpoint (64, 50304), model (128, 50304)",
                                         "; --force_resume cannot change the architecture"],
     ["--force_resume=true", "--model_dim=128"]),
    ("forced into narrower MLPs", None, ["blocks.0.mlp.fc: checkpoint (256, 64), model (128, 64)"],
     ["--force_resume=true", "--mlp_ratio=2"]),
]


@pytest.mark.slow  # the fixture trains two steps
@pytest.mark.parametrize("what, edit, fragments, flags", RESUME_CASES, ids=[case[0] for case in RESUME_CASES])
def test_a_checkpoint_that_does_not_match_its_meta_json_is_refused(checkpoint, tmp_path, what, edit, fragments,
                                                                   flags):
    folder = copy_of(checkpoint, tmp_path)
    if edit is not None:
        edit(folder)
    proc = run_main(*TINY, f"--resume={folder}", f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck",
                    "--run_id=again", *flags)
    one_line(proc, 1, f"error [rank 0]: --resume={folder}: ", *fragments)
    # nothing was created, so the run id is still free for the corrected resume
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ck").exists()


def untrained_checkpoint(flags: list[str]):
    """A checkpoint at step 1 of a run with these flags, saved without training: what a case checks is the
    data it was made on."""
    args = T.parse_args(flags, False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    return T.save_checkpoint(1, 10.0, model, T.build_optimizers(model, args), T.TrainLoader(args, env), args, env,
                             TRAIN.read_text(), "before")


def test_a_resume_on_changed_training_shards_is_refused(tmp_path):
    # A checkpoint of a run on a copy of the bundled shard.
    shard = tmp_path / "data/copy_train_000001.bin"
    shard.parent.mkdir()
    shard.write_bytes((REPO / "data/shakespeare/shakespeare_train_000001.bin").read_bytes())
    flags = [*TINY, f"--train_files={tmp_path}/data/copy_train_*.bin", f"--checkpoint_dir={tmp_path}/ck"]
    saved = untrained_checkpoint(flags)
    # The shard is then rewritten: the same size, one token of its first document another.
    data = bytearray(shard.read_bytes())
    data[1024 + 2 * 100] ^= 1
    shard.unlink()
    shard.write_bytes(bytes(data))
    proc = run_main(*flags, f"--resume={saved}", f"--logs_dir={tmp_path}/logs", "--run_id=after")
    one_line(proc, 1, f"--resume={saved}: training shard 1, {shard} (2,846,636 bytes), is not the one the "
                      f"checkpoint's run read", "another fingerprint")
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow  # the fixture trains two steps
def test_init_from_beside_resume_is_checked_and_said_not_to_be_read(checkpoint, tmp_path):
    # it was ignored without a word, even for a folder that does not exist
    flags = [*TINY, f"--resume={checkpoint}", f"--logs_dir={tmp_path}/logs"]
    proc = run_main(*flags, f"--init_from={tmp_path}/nowhere", "--run_id=a")
    one_line_error(proc, f"--init_from={tmp_path}/nowhere: not a final-weights folder (no model.pt); a resumed run "
                         f"continues from its checkpoint's weights and does not read it: drop --init_from")
    assert not (tmp_path / "logs").exists()
    (tmp_path / "final").mkdir()
    (tmp_path / "final/model.pt").write_bytes(b"")  # only its presence is checked: it is not read
    proc = run_main(*flags, f"--init_from={tmp_path}/final", "--run_id=b")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"note: --init_from={tmp_path}/final is not read: a resumed run continues from its checkpoint's weights" \
        in (tmp_path / "logs/b.txt").read_text()


@pytest.mark.slow  # the fixture trains two steps
def test_micro_batches_is_one_setting_however_it_is_spelled(checkpoint, tmp_path):
    # "1,1,1" and " 1" mean what "1" means: stored, logged, checkpointed and compared as "1" (a resume across the
    # spellings was refused with "config differs in micro_batches")
    for text in ("1,1,1", " 1", "1"):
        assert T.parse_args([*TINY, f"--micro_batches={text}"], False).micro_batches == "1"
    assert T.parse_args([*TINY, "--micro_batches=1,1,2", "--stage_batch_tokens=256,256,512"], False).micro_batches \
        == "1,1,2"
    assert T.parse_args([*SMOKE89, "--micro_batches= auto"], False).micro_batches == "auto"
    older = {"micro_batches": "1,1,1", "packing": "auto", "seed": 1337}  # a checkpoint of before: packing recorded too
    assert T.comparable_config(older, T.parse_args(TINY, False)) == {"micro_batches": "1", "seed": 1337}
    proc = run_main(*TINY, "--micro_batches=1,1,1", f"--resume={checkpoint}", f"--logs_dir={tmp_path}/logs",
                    "--run_id=spelled")
    assert proc.returncode == 0, proc.stderr[-2000:]  # (at its last step: only the final validation runs)
    assert "  micro_batches = 1\n" in (tmp_path / "logs/spelled.txt").read_text()


@pytest.mark.slow  # the fixture trains two steps
@pytest.mark.parametrize("saved, flags", [
    ({"attention": "auto", "device": "auto"}, ["--attention=sdpa", "--device=cpu"]),  # the issue's
    ({"attention": "sdpa", "device": "cpu"}, []),  # a checkpoint of now (settled), resumed with the defaults
    ({"attention": "auto", "device": "cpu"}, ["--attention=sdpa"]),
], ids=["auto saved, spelled out", "settled saved, auto", "device spelled, attention auto"])
def test_attention_and_device_are_compared_as_resolved(checkpoint, tmp_path, saved, flags):
    """Issue 38 row 16: --attention=sdpa and --device=cpu train exactly as auto on a CPU, yet a resume that spelled
    them out was refused ("config differs in attention, device")."""
    folder = copy_of(checkpoint, tmp_path)
    edit_meta(lambda meta: {**meta, "config": {**meta["config"], **saved}})(folder)
    proc = run_main(*TINY, *flags, f"--resume={folder}", f"--logs_dir={tmp_path}/logs", "--run_id=spelled")
    assert proc.returncode == 0, proc.stderr[-2000:]  # (at its last step: only the final validation runs)
    log = (tmp_path / "logs/spelled.txt").read_text()
    assert "  attention = sdpa\n" in log and "  device = cpu\n" in log  # logged as settled


def killed_run(checkpoint, root, leftovers=(".step_000004.partial",)):
    """checkpoint_dir/dead/ as a run killed with kill -9 while saving leaves it: its last checkpoint (step 2), its
    latest pointer, and an unfinished save (a folder of junk)."""
    run = root / "ck" / "dead"
    (run / "step_000002").mkdir(parents=True)
    for f in checkpoint.iterdir():
        os.link(f, run / "step_000002" / f.name)
    (run / "latest").write_text("step_000002\n")
    for name in leftovers:
        (run / name).mkdir()
        (run / name / "model.pt").write_bytes(b"\0" * 4096)
    return run


@pytest.mark.slow  # the fixture trains two steps
@pytest.mark.parametrize("how", ["--resume", "--resume=latest", "the same run id"])
def test_an_unfinished_save_of_a_dead_run_is_removed_with_a_note(checkpoint, tmp_path, how):
    """Issue 38 row 23: a kill -9 mid-save left a .step_N.partial/ (GBs at the speedrun's size) that nothing
    removed."""
    run = killed_run(checkpoint, tmp_path, [".step_000004.partial", ".final.partial"])
    flags = [*TINY, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck"]
    notes = [f"note: removed {run / name}, which a run that is gone (killed while saving) left unfinished"
             for name in (".final.partial", ".step_000004.partial")]
    if how == "the same run id":  # refused (the id is taken), but what the dead run left is removed
        proc = run_main(*flags, "--run_id=dead", "--save_every=2")
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            *notes, f"error: --run_id=dead: {run} already exists (another run's checkpoint folder); choose another "
                    f"run id"], proc.stderr
    else:
        resume = f"--resume={run / 'step_000002'}" if how == "--resume" else "--resume=latest"
        proc = run_main(*flags, resume, "--run_id=next")
        assert proc.returncode == 0, proc.stderr[-2000:]
        log = (tmp_path / "logs/next.txt").read_text()
        assert all(f"{note}\n" in log for note in notes), log
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_000002"]


def test_a_run_that_saves_holds_its_folder_until_it_ends(tmp_path):
    """What makes row 23's sweep safe: from claim_run_folder to release_folders, a sweep leaves the folder alone."""
    run = tmp_path / "ck" / "live"
    made = T.claim_run_folder(run, T.parse_args([*TINY, f"--checkpoint_dir={tmp_path}/ck"], False))
    (run / ".step_000002.partial").mkdir()
    try:
        assert T.sweep_unfinished_saves(run) == [] and (run / ".step_000002.partial").exists()
    finally:
        T.release_folders(made)
    assert T.sweep_unfinished_saves(run) == [f"note: removed {run / '.step_000002.partial'}, which a run that is "
                                             f"gone (killed while saving) left unfinished"]


@pytest.mark.slow  # the fixture trains two steps
def test_a_live_run_s_unfinished_save_is_left_alone(checkpoint, tmp_path):
    """Row 23's other side: a run that is alive holds its folder (an flock): a resume from its checkpoints leaves its
    save in progress as it is."""
    import fcntl
    run = killed_run(checkpoint, tmp_path)
    held = os.open(run, os.O_RDONLY)  # the flock claim_run_folder takes for a live run
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        proc = run_main(*TINY, f"--resume={run / 'step_000002'}", f"--logs_dir={tmp_path}/logs", "--run_id=next")
    finally:
        os.close(held)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / ".step_000004.partial" / "model.pt").exists() and "note: removed" not in proc.stdout


@pytest.mark.slow  # resumes a run and trains
def test_a_resume_across_a_packing_change_gets_advice_that_works(tmp_path):
    # The same tokens with another packing in the shard header: auto packs them otherwise, so the checkpoint's
    # position would mean other tokens. The advice once named no value, and following it was refused again
    # ("config differs in packing": the checkpoint had recorded the flag, auto, not what it resolved to).
    sys.path.insert(0, str(REPO / "data"))
    import shards
    tokens = T.read_shard(REPO / "data/shakespeare/shakespeare_train_000001.bin")
    shard = tmp_path / "t_train_000001.bin"
    shards.write_shard(shard, tokens, packing="documents")
    flags = [*TINY, f"--train_files={tmp_path}/t_train_*.bin", f"--checkpoint_dir={tmp_path}/ck"]
    saved = untrained_checkpoint(flags)
    shards.write_shard(shard, tokens, packing="stream")  # retokenized for the stream packing
    stream = [*flags, f"--resume={saved}", f"--logs_dir={tmp_path}/logs"]
    proc = run_main(*stream, "--run_id=refused")
    one_line(proc, 1, f"--resume={saved}: the checkpoint packed its training shards as documents, this run would pack "
                      f"them as stream: its position in them would mean other tokens; resume with --packing=documents")
    proc = run_main(*stream, "--packing=documents", "--run_id=advised")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in (tmp_path / "logs/advised.txt").read_text()


@pytest.mark.slow  # the fixture trains two steps
def test_an_untouched_checkpoint_passes_every_check(checkpoint):
    args = T.parse_args(TINY, False)
    resume = T.check_checkpoint(checkpoint, args, T.DistEnv(0, 0, 1, torch.device("cpu")), TRAIN.read_text())
    assert resume.meta.step == resume.rank_state["step"] == 2
    assert sorted(resume.meta.files) == ["model.pt", "rank_0.pt"]
    for name, listed in resume.meta.files.items():
        assert listed.bytes == (checkpoint / name).stat().st_size


# -----------------------------------------------------------------------------
# A run id names one run: its log and its checkpoint folder are never another run's (exit 2, nothing written)

def an_earlier_runs_checkpoints(tmp_path):
    """checkpoints of an earlier run named `taken`, whose log is elsewhere or deleted"""
    (tmp_path / "ck/taken/step_000002").mkdir(parents=True)
    (tmp_path / "ck/taken/latest").write_text("step_000002\n")
    return ["--run_id=taken"]


def a_file(name):
    def make(tmp_path):
        (tmp_path / "a_file").write_text("")
        return [f"--checkpoint_dir={tmp_path}/{name}", "--run_id=r"]
    return make


RUN_CASES = [
    # (what, what is made beforehand (returns the run's flags), further flags, fragments of the error line)
    ("the checkpoint folder of an earlier run", an_earlier_runs_checkpoints, [],
     ["--run_id=taken: ", "ck/taken already exists (another run's checkpoint folder); choose another run id"]),
    ("--checkpoint_dir a file, --save_final", a_file("a_file"), ["--save_final=true"],
     ["--checkpoint_dir=", "/a_file: cannot write checkpoints in ", "/a_file/r (Not a directory)"]),
    ("--checkpoint_dir a file, --save_every", a_file("a_file"), ["--save_every=2"], ["(Not a directory)"]),
    ("--checkpoint_dir under a file", a_file("a_file/ck"), ["--save_final=true"], ["/a_file/ck/r (Not a directory)"]),
]


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("what, make, flags, fragments", RUN_CASES, ids=[case[0] for case in RUN_CASES])
def test_a_run_that_could_not_keep_its_checkpoints_is_refused_before_it_starts(tmp_path, what, make, flags,
                                                                                fragments):
    run_flags = make(tmp_path)
    before = tree(tmp_path)
    proc = run_main(*TINY, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck", *run_flags, *flags)
    one_line_error(proc, *fragments)
    assert tree(tmp_path) == before  # no log, and nothing of the earlier run's replaced


@pytest.mark.slow  # the fixture trains two steps
def test_a_resume_takes_a_new_run_id(checkpoint, tmp_path):
    # the run the checkpoint belongs to, resumed under its own id: it would write into that run's folder
    proc = run_main(*TINY, f"--resume={checkpoint}", f"--checkpoint_dir={checkpoint.parent.parent}", "--run_id=base",
                    f"--logs_dir={tmp_path}/logs", "--save_every=2")
    one_line_error(proc, f"--run_id=base: {checkpoint.parent} already exists (another run's checkpoint folder); "
                         f"choose another run id (a resumed run takes a new one)")
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["latest", "step_000002"]
    assert not (tmp_path / "logs").exists()


def test_final_weights_that_cannot_start_claim_no_removal(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args, env, model, optimizers, loader = tiny_model(blocker)
    source = TRAIN.read_text()
    with pytest.raises(T.TrainingError) as failure:
        T.save_final_weights(model, args, source, "run", 30, 5.0)
    # nothing was made; the folder named is the user's, not its temporary (issue 38 row 18)
    assert str(failure.value) == f"cannot write {blocker}/run/final: Not a directory"
    with pytest.raises(T.TrainingError) as failure:
        T.save_checkpoint(2, 1.0, model, optimizers, loader, args, env, source, "run")
    assert str(failure.value) == f"cannot write {blocker}/run/step_000002: Not a directory"


# -----------------------------------------------------------------------------
# --resume=latest: a damaged pointer is one line naming it (exit 1, no log)

LATEST_CASES = [
    # (what, how `latest` is made, fragments of the error line)
    ("binary garbage", lambda latest: latest.write_bytes(bytes(range(255, 0, -1))), ["is damaged (not text)"]),
    ("a folder", lambda latest: latest.mkdir(), ["is damaged (not a file, a folder)"]),
    ("a link to nowhere", lambda latest: latest.symlink_to("nowhere"), ["is damaged (not a file)"]),
    ("a folder that does not exist", lambda latest: latest.write_text("step_000099\n"),
     ["is damaged: it names ", "/ck/run/step_000099, which does not exist"]),
    ("not a checkpoint's name", lambda latest: latest.write_text("../../elsewhere\n"),
     ["is damaged (it should name a checkpoint folder beside it, e.g. step_000100, not '../../elsewhere')"]),
]


@pytest.mark.parametrize("what, make, fragments", LATEST_CASES, ids=[case[0] for case in LATEST_CASES])
def test_a_damaged_latest_pointer_is_one_line(tmp_path, what, make, fragments):
    latest = tmp_path / "ck/run/latest"
    latest.parent.mkdir(parents=True)
    make(latest)
    proc = run_main(*TINY, "--resume=latest", f"--checkpoint_dir={tmp_path}/ck", f"--logs_dir={tmp_path}/logs")
    one_line(proc, 1, f"--resume=latest: {latest} ", *fragments, "pass the checkpoint folder itself")
    assert not (tmp_path / "logs").exists()


# -----------------------------------------------------------------------------
# A full disk: one line naming the file, nothing half-written

class SmallDisk:
    """Files under `root` live on a simulated disk with `room` bytes (the sizes of the files under root
    count against it, so a truncated or removed file gives its room back)."""

    def __init__(self, root, room: int):
        self.root, self.room = root, room

    def free(self) -> int:
        used = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
        return self.room - used


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    disk = SmallDisk(tmp_path / "disk", room=0)
    disk.root.mkdir()
    real_write = os.write

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(f"{disk.root}{os.sep}"):
            return real_write(fd, data)
        view = memoryview(data).cast("B")
        fits = min(len(view), disk.free())
        if fits <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, view[:fits])  # a short write, then ENOSPC on the next call

    monkeypatch.setattr(os, "write", write)
    return disk


def test_a_full_disk_under_the_log_is_one_line_and_the_log_says_so(small_disk):
    small_disk.room = 20_000  # less than the source of train_gpt.py, the log's first line
    proc = run_main(*TINY, f"--logs_dir={small_disk.root}", "--run_id=full")
    log = small_disk.root / "full.txt"
    line = one_line(proc, 1, f"cannot write {log}: the disk is full (No space left on device)")
    # the half-written source was taken back, which left room for the line saying why the run ended
    assert log.read_text() == line.replace("error [rank 0]: ", "error: ") + "\n"


def test_a_log_that_fills_the_disk_keeps_every_complete_line(small_disk):
    source = TRAIN.read_bytes()
    small_disk.room = len(source) + 1 + 300  # the disk fills a few lines after the source
    proc = run_main(*TINY, f"--logs_dir={small_disk.root}", "--run_id=full")
    one_line(proc, 1, "the disk is full")
    text = (small_disk.root / "full.txt").read_bytes()
    assert text.startswith(source) and text.endswith(b"\n")  # no half line at the end
    header = text[len(source) + 1:].decode().splitlines()
    assert header[0] == "=" * 100 and header[1].startswith("Running Python ")


def tiny_model(checkpoint_dir):
    """The smoke model with a 512-token vocabulary: a checkpoint of a few MB (the files' size does not
    matter to what these tests check)."""
    args = T.parse_args([*SMOKE89, "--vocab_size=512", f"--checkpoint_dir={checkpoint_dir}"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    return args, env, model, T.build_optimizers(model, args), T.SyntheticLoader(args, env)


def test_a_checkpoint_that_fills_the_disk_is_removed_and_the_last_good_one_stays(small_disk):
    small_disk.room = 10 ** 9
    args, env, model, optimizers, loader = tiny_model(small_disk.root)
    source = TRAIN.read_text()
    good = T.save_checkpoint(2, 1.0, model, optimizers, loader, args, env, source, "run")
    model_bytes = (good / "model.pt").stat().st_size
    small_disk.room = small_disk.room - small_disk.free() + model_bytes // 2  # the next model.pt fits half-way
    with pytest.raises(T.TrainingError) as failure:
        T.save_checkpoint(4, 2.0, model, optimizers, loader, args, env, source, "run")
    # the checkpoint's name, not its temporary folder's (issue 38 row 18)
    assert str(failure.value) == (f"cannot write {small_disk.root}/run/step_000004/model.pt: the disk is full (No "
                                  f"space left on device); nothing of the unfinished checkpoint was kept")
    assert sorted(p.name for p in (small_disk.root / "run").iterdir()) == ["latest", "step_000002"]
    assert (small_disk.root / "run/latest").read_text() == "step_000002\n"
    T.check_checkpoint(good, args, env, source)  # the last good checkpoint is intact


def test_final_weights_that_fill_the_disk_are_removed(small_disk):
    small_disk.room = 100_000  # less than model.pt
    args, _, model, _, _ = tiny_model(small_disk.root)
    with pytest.raises(T.TrainingError, match=r"cannot write .*/run/final/model\.pt: the disk is full .*; nothing of "
                                              r"the unfinished final-weights folder was kept$"):
        T.save_final_weights(model, args, TRAIN.read_text(), "run", 30, 5.0)
    assert list((small_disk.root / "run").iterdir()) == []


@contextlib.contextmanager
def file_size_limit(limit: int):
    """RLIMIT_FSIZE for this process: the kernel refuses to grow any file past `limit` bytes (EFBIG,
    with SIGXFSZ ignored). Lowering it and restoring it needs no privileges."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.slow  # two training steps
def test_a_real_write_error_during_a_checkpoint_ends_the_run_in_one_line(tmp_path):
    # 1 MB: room for the log (~110 kB), not for a checkpoint's files (50-100 MB).
    with file_size_limit(1 << 20):
        proc = run_main(*TINY, "--save_every=2", f"--logs_dir={tmp_path}", f"--checkpoint_dir={tmp_path}/ck",
                        "--run_id=limited")
    line = one_line(proc, 1, f"cannot write {tmp_path}/ck/limited/step_000002/rank_0.pt: File too large",
                    "nothing of the unfinished checkpoint was kept")
    assert not (tmp_path / "ck").exists()  # nor the folders made for it, left empty
    log = (tmp_path / "limited.txt").read_text()
    assert log.endswith(line.replace("error [rank 0]: ", "error: ") + "\n")


# -----------------------------------------------------------------------------
# Start-up cost does not grow with num_iterations

def test_the_schedule_is_derived_without_visiting_every_step(monkeypatch):
    budget = CallBudget(T.Schedule.stage, 10_000)
    monkeypatch.setattr(T.Schedule, "stage", lambda self, step: budget(self, step))
    schedule = T.Schedule(T.parse_args(["--preset=record89", "--num_iterations=1000000000000"], True))
    assert [stage.start for stage in schedule.stages] == [0, 333333333328, 666666666657, 999999999985]
    assert schedule.untie_step == 666666666657


class CallBudget:
    """Fails a test that calls the wrapped function more than `limit` times."""

    def __init__(self, fn, limit: int):
        self.fn, self.limit, self.calls = fn, limit, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        assert self.calls <= self.limit, "a loop over every step"
        return self.fn(*args, **kwargs)


def test_the_flops_average_does_not_visit_every_step(monkeypatch):
    args = T.parse_args([*SMOKE89, "--num_iterations=1000000000000", "--vocab_size=512"], False)
    model = T.GPT(args)
    tokens = torch.randint(0, 512, (256,))
    budget = CallBudget(T.Schedule.stage, 10_000)
    monkeypatch.setattr(T.Schedule, "stage", lambda self, step: budget(self, step))
    flops = T.schedule_flops_per_token(args, model, tokens)
    # the extension's 3 of 10^12 steps do not move the average: it is the three stages', weighted by their
    # tokens (equal lengths; batches of 1, 2 and 3 thousand tokens)
    per_stage = [T.model_flops_per_token(args, model, tokens, w) for w in ((1, 2), (2, 4), (3, 6))]
    assert flops == pytest.approx((1 * per_stage[0] + 2 * per_stage[1] + 3 * per_stage[2]) / 6, rel=1e-9)


def test_a_run_of_10_to_the_8_steps_starts_at_once(tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise T.TrainingError("stopped by the test at the first step")

    monkeypatch.setattr(T, "train_step", stop)
    budget = CallBudget(T.Schedule.stage, 10_000)
    monkeypatch.setattr(T.Schedule, "stage", lambda self, step: budget(self, step))
    # (--repeat_data: the bundled shard supplies 680 of these steps; the run would start over from it)
    proc = run_main(*TINY, "--num_iterations=100000000", "--repeat_data=true", f"--logs_dir={tmp_path}",
                    "--run_id=long")
    one_line(proc, 1, "stopped by the test at the first step")
    assert (tmp_path / "long.txt").read_text().endswith("\nerror: stopped by the test at the first step\n")


# -----------------------------------------------------------------------------
# Under torchrun: a config error is exit 2 on every rank, and torchrun's summary shows its line

@pytest.mark.slow  # three processes under torchrun
def test_a_config_error_under_torchrun(tmp_path):
    proc = torchrun(TRAIN, 3, f"--logs_dir={tmp_path}", check=False, timeout=300)
    message = "error: world size 3 cannot split the batch"
    assert [line for line in proc.stderr.splitlines() if line.startswith("error")] == [
        message + ": a step is --micro_batches=4 micro-batches, not a multiple of 3 (a larger --micro_batches "
                  "makes more, each smaller)"], proc.stderr[-3000:]
    # torchrun itself always exits 1 when a rank fails, and stops the others (SIGTERM, exit code -15)
    # as soon as the first has exited: its summary has each rank's own exit code, and the first
    # failure's error file, our line
    assert proc.returncode == 1
    assert sorted(set(re.findall(r"exitcode\s*: (-?\d+) ", proc.stderr))) in (["2"], ["-15", "2"]), proc.stderr
    root_cause = proc.stderr[proc.stderr.index("Root Cause"):]
    assert re.search(r"exitcode\s*: 2 ", root_cause) and re.search(rf"traceback\s*: {message}", root_cause), root_cause
    assert list(tmp_path.iterdir()) == []


# -----------------------------------------------------------------------------
# sample.py: bad values and configs, the context, HellaSwag batches of any size

@pytest.fixture(scope="module")
def final_folder_in_process(tmp_path_factory):
    """Final weights of the smoke preset's model, untrained (conftest.random_final_weights)."""
    return random_final_weights(tmp_path_factory.mktemp("final"))


def sample_main(*argv):
    """sample.main(argv) in this process: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = sample.main([str(a) for a in argv])
    return subprocess.CompletedProcess(["sample.py", *argv], code, out.getvalue(), err.getvalue())


def edit_config(change):
    def edit(folder):
        info = json.loads((folder / "config.json").read_text())
        replace(folder / "config.json", json.dumps(change(info)).encode())
    return edit


def without_config_fields(*names):
    def change(info):
        for name in names:
            del info["config"][name]
        return info
    return change


def with_config_field(name, value):
    def change(info):
        info["config"][name] = value
        return info
    return change


def edit_weights(drop=(), add=None):
    """model.pt without the weights named in `drop`, and with those in `add` (added or replaced)."""
    def edit(folder):
        state = torch.load(folder / "model.pt", weights_only=True)
        for name in drop:
            del state[name]
        state.update(add or {})
        (folder / "model.pt").unlink()
        torch.save(state, folder / "model.pt")
    return edit


SAMPLE_CASES = [
    # (what, how the final folder is changed, sample.py flags, fragments)
    ("temperature nan", None, ["--prompt=x", "--temperature=nan"], ["--temperature=nan: must be zero (greedy) or a"]),
    ("temperature inf", None, ["--prompt=x", "--temperature=inf"], ["--temperature=inf"]),
    ("no windows", edit_config(without_key("windows")), ["--prompt=x"],
     ["config.json: not train_gpt.py's final-weights config", '"windows" must be']),
    ("windows of 0 blocks", edit_config(with_key("windows", [0, 10])), ["--prompt=x"], ['"windows" must be']),
    ("windows not a list", edit_config(with_key("windows", "3,10")), ["--prompt=x"], ['"windows" must be']),
    ("config not an object", edit_config(with_key("config", 5)), ["--prompt=x"], ["config.json: not train_gpt.py's"]),
    ("config.json a list", edit_config(lambda info: [1]), ["--prompt=x"], ["config.json: not train_gpt.py's"]),
    # issue 38 row 8: a RecursionError traceback from the JSON parser
    ("config.json nested deeply",
     lambda folder: replace(folder / "config.json", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
     ["--prompt=x"], ["config.json: not train_gpt.py's final-weights config (nested too deeply"]),
    ("seed negative", None, ["--prompt=x", "--seed=-1"], ["--seed=-1: must be in 0..2**64-1"]),
    ("seed 2**64", None, ["--prompt=x", f"--seed={2 ** 64}"], [f"--seed={2 ** 64}: must be in 0..2**64-1"]),
    # both equal the speedrun's defaults here: filled in, the model would load as if nothing were missing
    ("config lacks model fields", edit_config(without_config_fields("logit_cap", "vocab_size")), ["--prompt=x"],
     ['config.json: not train_gpt.py\'s final-weights config ("config" lacks logit_cap, vocab_size, needed to '
      'rebuild the model)']),
    ("weights of another width", edit_config(with_config_field("model_dim", 32)), ["--prompt=x"],
     ["model.pt: cannot load these weights into the model of config.json (", "shape mismatch(es): lm_head: "
      "checkpoint (64, 50304), model (32, 50304); value_embeds: checkpoint (201216, 64), model (201216, 32)"]),
    ("a weight of another shape", edit_weights(add={"blocks.1.attn.qk": torch.zeros(4, 32, 32)}), ["--prompt=x"],
     ["(1 shape mismatch(es): blocks.1.attn.qk: checkpoint (4, 32, 32), model (4, 32, 64))"]),
    ("a weight missing, one extra",
     edit_weights(drop=["blocks.1.attn.qk"], add={"blocks.19.mlp.fc": torch.zeros(1)}), ["--prompt=x"],
     ["(1 missing key(s): blocks.1.attn.qk; 1 unexpected key(s): blocks.19.mlp.fc)"]),
    ("hellaswag data a directory", None, ["--eval=hellaswag", f"--data={REPO / 'data'}"],
     [f"{REPO / 'data'}: a directory, not a HellaSwag .jsonl file"]),
]


@pytest.mark.parametrize("what, edit, flags, fragments", SAMPLE_CASES, ids=[case[0] for case in SAMPLE_CASES])
def test_sample_refuses_bad_values_and_configs(final_folder_in_process, tmp_path, what, edit, flags, fragments):
    folder = final_folder_in_process
    if edit is not None:
        folder = copy_of(final_folder_in_process, tmp_path)
        edit(folder)
    one_line_error(sample_main(folder, *flags), *fragments)


def test_final_weights_load_without_the_run_control_fields(final_folder_in_process, tmp_path):
    # they steer a run, never the model: a config.json may leave them out
    folder = copy_of(final_folder_in_process, tmp_path)
    edit_config(without_config_fields(*T.RUN_CONTROL_FIELDS))(folder)
    model, args, _ = T.load_final_weights(folder, torch.device("cpu"))
    saved = json.loads((final_folder_in_process / "config.json").read_text())["config"]
    assert all(getattr(args, name) == value for name, value in saved.items() if name not in T.RUN_CONTROL_FIELDS)
    reference, _, _ = T.load_final_weights(final_folder_in_process, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_hellaswag_data_from_a_pipe_is_read(final_folder_in_process, tmp_path):
    data = hellaswag_file(tmp_path / "val.jsonl", examples=3, context_words=14)
    from_file = sample_main(final_folder_in_process, "--eval=hellaswag", f"--data={data}")
    assert from_file.returncode == 0, from_file.stderr
    read, write = os.pipe()  # what `--data=<(...)` or `--data=/dev/stdin` with a pipe gives
    try:
        os.write(write, data.read_bytes())  # a few hundred bytes: within the pipe's buffer
        os.close(write)
        piped = sample_main(final_folder_in_process, "--eval=hellaswag", f"--data=/dev/fd/{read}")
    finally:
        os.close(read)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == from_file.stdout and piped.stdout.startswith("hellaswag: 3 examples")


def test_a_tiny_temperature_samples_greedily():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, float("-inf")])
    for temperature in (1e-300, 1e-30, 5e-324):
        for top_k in (0, 2):
            picks = {sample.choose(logits, temperature, top_k, torch.Generator().manual_seed(s)) for s in range(20)}
            assert picks == {1}


def positions_model(train_max_seq_len: int, positions: int):
    """A random smoke model whose rotary tables hold `positions` (its micro-batch and validation length)."""
    batch, cap = ",".join([str(4 * positions)] * 3), ",".join([str(train_max_seq_len)] * 3)
    args = T.parse_args([*SMOKE89, "--window_block=16", "--stage_windows=1:1,1:2,1:2", "--extension_windows=1:3",
                         "--final_val_window=4", f"--stage_batch_tokens={batch}", f"--val_seq_len={positions}",
                         f"--val_tokens={4 * positions}", f"--stage_max_seq_len={cap}", "--dc_window=16"], False)
    torch.manual_seed(0)
    model = T.GPT(args)
    fill_random(model)
    with torch.no_grad():
        model.lm_head[:, T.BOS_ID] = 0  # a middling logit: generation never ends on <|endoftext|>
    model.rotary.set_window(3)
    return model.eval(), args, {"windows": [1, 4]}


def test_generation_stops_at_the_rotary_tables_when_training_documents_were_longer():
    # trained with documents of up to 4,096 tokens, but the rotary tables hold 128 positions
    model, args, info = positions_model(train_max_seq_len=4096, positions=128)
    assert T.context_length(args) == 128
    tokens, why = sample.generate(model, args, info, [464], 1000, 0.0, 0, 0)
    assert why == "the context is full (128 tokens)"
    assert 2 + len(tokens) - 1 == 128  # BOS, the prompt, and each token but the last was read


def test_hellaswag_batches_of_any_size_fit_the_model():
    model, args, info = random_model()  # its rotary tables hold 1,024 positions
    token_losses = sample.token_losses_fn(model, args, info)
    generator = torch.Generator().manual_seed(0)
    # 16 examples x 4 endings of 55 tokens: 3,584 positions packed, as HellaSwag's real lengths give
    sequences = [torch.randint(0, 50_000, (55,), generator=generator).tolist() for _ in range(64)]
    losses = token_losses(sequences)
    assert [len(x) for x in losses] == [54] * 64
    for i in (0, 17, 18, 35, 36, 63):  # sequences at both ends of the packed groups of 18
        assert_close(losses[i], token_losses([sequences[i]])[0], rtol=1e-6, atol=1e-6)


def hellaswag_file(path, examples: int, context_words: int):
    lines = [json.dumps({"ctx": " ".join(["The man keeps walking down the road"] * (context_words // 7)),
                         "endings": [f"and then he sees {w} ahead of him on the long and winding road" for w in
                                     ("a dog", "a cat", "the sea", "a house")],
                         "label": i % 4}) for i in range(examples)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hellaswag_scores_real_length_examples_at_the_default_batch_size(final_folder_in_process, tmp_path):
    data = hellaswag_file(tmp_path / "val.jsonl", examples=16, context_words=35)
    batched = sample_main(final_folder_in_process, "--eval=hellaswag", f"--data={data}", "--batch_size=16")
    assert batched.returncode == 0, batched.stderr[-2000:]
    alone = sample_main(final_folder_in_process, "--eval=hellaswag", f"--data={data}", "--batch_size=1")
    assert batched.stdout.startswith("hellaswag: 16 examples") and batched.stdout == alone.stdout


def test_hellaswag_example_longer_than_the_model_is_one_line(final_folder_in_process, tmp_path):
    data = hellaswag_file(tmp_path / "val.jsonl", examples=1, context_words=1400)
    one_line_error(sample_main(final_folder_in_process, "--eval=hellaswag", f"--data={data}"),
                   "example 1: its context and longest ending are 1415 tokens, more than the model reads (1023)")


# -----------------------------------------------------------------------------
# Issue 38 rows 9-11 and 15: one reader for every weights file (train_gpt.read_weights / check_weights)

SMOKE = T.parse_args([*SMOKE89], False)


def meta_state(args=SMOKE) -> dict:
    with torch.device("meta"):
        return T.GPT(args).state_dict()


def tiny_final_folder(folder, args=SMOKE, edit=None, dense=False):
    """A final-weights folder of `args`'s model whose tensors are one value broadcast to their shapes (stride 0: a
    file of a few kB), with model.pt edited by edit(state) first. The readers refuse such a view (issue 53 row 8)
    after the checks of dtype, layout, names and shapes, and before the values are read: where those are what a
    case checks (the control too), `dense` stores every tensor whole, in bf16 (45 MB at the smoke size)."""
    folder.mkdir()
    def stored(v):
        return torch.zeros(v.shape, dtype=torch.bfloat16) if dense else torch.zeros((), dtype=v.dtype).expand(v.shape)
    state = {k: stored(v) if isinstance(v, torch.Tensor) else v for k, v in meta_state(args).items()}
    if edit is not None:
        edit(state)
    torch.save(state, folder / "model.pt")
    info = {"format": T.FINAL_WEIGHTS_FORMAT, "config": dataclasses.asdict(args), "step": 0, "val_loss": None,
            "windows": [1, 3], "code_sha256": None}
    (folder / "config.json").write_text(json.dumps(info))
    return folder


def set_value(key, value):
    def edit(state):
        state[key] = value() if callable(value) else value
    return edit


def shape_of(key):
    return tuple(meta_state()[key].shape)


def with_one(key, value):
    """A zero tensor of key's shape with one element set to value; the rest of the file must be dense (the values
    are read last)."""
    def make():
        t = torch.zeros(shape_of(key))
        t.view(-1)[7] = value
        return t
    edit = set_value(key, make)
    edit.dense = True
    return edit


WEIGHT_CASES = [  # (case, edit of model.pt, fragments of the error line)
    # row 9: an int64 copy was cast into the parameters in silence (all zeros, had it been the record's)
    ("int64 weight", set_value("blocks.0.mlp.fc", lambda: torch.zeros(shape_of("blocks.0.mlp.fc"), dtype=torch.int64)),
     ["'blocks.0.mlp.fc' has dtype int64, expected a floating one (bfloat16, float16, float32 or float64)"]),
    ("bool sign table", set_value("bigram_signs", lambda: torch.ones(shape_of("bigram_signs"), dtype=torch.bool)),
     ["'bigram_signs' has dtype bool, expected a floating one"]),
    # row 10: tracebacks
    ("non-string key", set_value(3, torch.zeros(1)), ["key 3 (int) is not a parameter name"]),
    ("non-tensor value", set_value("scalars", [0.0] * 14), ["'scalars' is a list, not a tensor"]),
    ("meta tensor", set_value("lm_head", lambda: torch.empty(shape_of("lm_head"), device="meta")),
     ["'lm_head' holds no values (a tensor of the meta device)"]),
    # row 11: passed, then a traceback or nonsense later
    ("sparse tensor", set_value("lm_head", lambda: torch.zeros(shape_of("lm_head")).to_sparse()),
     ["'lm_head' is a sparse_coo tensor, not a dense one"]),
    ("NaN weight", with_one("embed.weight", float("nan")), ["'embed.weight' holds 1 non-finite value(s) (NaN or inf)"]),
    ("inf weight", with_one("blocks.2.attn.qk", float("-inf")), ["'blocks.2.attn.qk' holds 1 non-finite value(s)"]),
]


@pytest.mark.parametrize("reader", ["--init_from", "sample.py", "to-record"])
@pytest.mark.parametrize("case, edit, fragments", WEIGHT_CASES, ids=[case[0] for case in WEIGHT_CASES])
def test_every_weights_reader_refuses_what_is_not_the_model(tmp_path, reader, case, edit, fragments):
    """Rows 9-11: the third pass's weight checks went into to-ours only."""
    folder = tiny_final_folder(tmp_path / "final", edit=edit, dense=getattr(edit, "dense", False))
    if reader == "--init_from":
        proc = run_main(*TINY, f"--init_from={folder}", f"--logs_dir={tmp_path}/logs")
        one_line_error(proc, f"--init_from={folder}: its weights do not fit this config's model (", *fragments)
        assert not (tmp_path / "logs").exists()
    elif reader == "sample.py":
        one_line_error(sample_main(folder, "--prompt=x", "--temperature=0"),
                       f"{folder / 'model.pt'}: cannot load these weights into the model of config.json (", *fragments)
    else:
        sys.path.insert(0, str(REPO / "tools"))
        import record_weights
        proc = in_process(record_weights.main, "to-record", folder, tmp_path / "out.pt")
        one_line_error(proc, f"{folder / 'model.pt'}: cannot load these weights", *fragments)
        assert not (tmp_path / "out.pt").exists()


def test_the_tiny_final_folder_passes_every_reader(tmp_path):
    """The control for WEIGHT_CASES: unedited, the folder loads (its model built and filled)."""
    folder = tiny_final_folder(tmp_path / "final", dense=True)
    model, args, _ = T.load_final_weights(folder, torch.device("cpu"))
    assert args == SMOKE and float(model.lm_head.detach().abs().sum()) == 0
    assert set(T.read_init_weights(dataclasses.replace(SMOKE, init_from=str(folder)))) == {
        k for k in meta_state() if not T.init_run_state(k)}  # the rotary state and the FP8 scales start over


@pytest.mark.slow  # the fixture trains two steps
@pytest.mark.parametrize("case, edit, fragments", [WEIGHT_CASES[0], WEIGHT_CASES[6]], ids=["int64", "NaN"])
def test_a_resumed_checkpoint_s_weights_are_read_by_the_same_checks(checkpoint, tmp_path, case, edit, fragments):
    """Rows 9-11, --resume: a model.pt that meta.json describes (its size and sha256 updated) but holds an int64 or
    a NaN weight."""
    folder = copy_of(checkpoint, tmp_path)
    state = torch.load(folder / "model.pt", weights_only=True)
    edit(state)
    replace(folder / "model.pt", b"")
    torch.save(state, folder / "model.pt")
    data = (folder / "model.pt").read_bytes()
    edit_meta(lambda meta: {**meta, "files": {**meta["files"], "model.pt": {
        "bytes": len(data), "sha256": __import__("hashlib").sha256(data).hexdigest()}}})(folder)
    proc = run_main(*TINY, f"--resume={folder}", f"--logs_dir={tmp_path}/logs", "--run_id=again")
    one_line(proc, 1, f"--resume={folder}: its model.pt does not fit the model this config builds (", *fragments)
    assert not (tmp_path / "logs").exists()


HUGE = ["--model_dim=4194304", "--head_dim=64"]  # 65,536 heads: tens of TiB of weights


@pytest.mark.parametrize("reader", ["sample.py", "to-record", "--init_from"])
def test_a_model_larger_than_the_host_is_refused_before_it_is_built(tmp_path, reader):
    """Row 15: a config.json describing a model larger than the host was built before model.pt was read: an
    allocation traceback."""
    folder = tiny_final_folder(tmp_path / "final")
    edit_config(lambda info: {**info, "config": {**info["config"], "model_dim": 4194304}})(folder)
    fragments = ["of host memory, more than this machine's"]
    if reader == "sample.py":
        one_line_error(sample_main(folder, "--prompt=x"), f"{folder / 'model.pt'}: cannot load", *fragments)
    elif reader == "to-record":
        sys.path.insert(0, str(REPO / "tools"))
        import record_weights
        one_line_error(in_process(record_weights.main, "to-record", folder, tmp_path / "out.pt"), *fragments)
    else:  # the trainer's start-up memory check refuses the config first, on every device (issue 53 row 10)
        proc = run_main(*TINY, *HUGE, f"--init_from={folder}", f"--logs_dir={tmp_path}/logs")
        one_line_error(proc, "the weights, gradients and optimizer state alone take ", "of this host")


# -----------------------------------------------------------------------------
# records.py: a full disk is one line naming the file

def records_tool():
    if "records_tool" not in sys.modules:  # test_records.py loads it under this name too
        spec = importlib.util.spec_from_file_location("records_tool", REPO / "records/records.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["records_tool"] = module
        spec.loader.exec_module(module)
    return sys.modules["records_tool"]


HANDMADE = sorted((REPO / "tests/fixtures/handmade").glob("b-cpu-run*.txt"))


def records_main(capsys, *argv):
    code = records_tool().main([str(a) for a in argv])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["records.py", *argv], code, captured.out, captured.err)


def test_records_table_on_a_full_disk(small_disk, capsys):
    proc = records_main(capsys, "table", "--records-dir", small_disk.root)
    one_line(proc, 1, f"error: cannot write {small_disk.root}/RECORDS.md: the disk is full (No space left on device)")
    assert list(small_disk.root.iterdir()) == []  # no temporary file left


def test_records_new_on_a_full_disk(small_disk, capsys):
    small_disk.room = sum(p.stat().st_size for p in HANDMADE) + 10  # the logs fit, record.json does not
    proc = records_main(capsys, "new", "x", *HANDMADE, "--records-dir", small_disk.root, "--target", "7.5",
                        "--track", "CPU smoke")
    one_line(proc, 1, "x/record.json: the disk is full (")
    assert list(small_disk.root.iterdir()) == []  # neither the record nor its temporary folder


def test_records_new_says_that_table_completes_a_record_the_disk_left_out(small_disk, capsys, tmp_path):
    """Issue 38 row 20: a full disk after the record folder was made gave no hint that `records.py table` completes
    it."""
    assert records_main(capsys, "new", "x", *HANDMADE, "--records-dir", tmp_path / "scratch", "--target", "7.5",
                        "--date", "2026-01-01").returncode == 0
    small_disk.room = sum(p.stat().st_size for p in (tmp_path / "scratch/2026-01-01_x").iterdir()) + 10
    proc = records_main(capsys, "new", "x", *HANDMADE, "--records-dir", small_disk.root, "--target", "7.5",
                        "--date", "2026-01-01")
    one_line(proc, 1, f"error: cannot write {small_disk.root}/RECORDS.md: the disk is full (",
             f"; the record {small_disk.root}/2026-01-01_x is filed, but the tables do not show it yet: run "
             f"`python records/records.py table` once this is fixed")
    assert sorted(p.name for p in small_disk.root.iterdir()) == ["2026-01-01_x"]  # the record, whole; no temporary
    small_disk.room = 10 ** 6
    assert records_main(capsys, "table", "--records-dir", small_disk.root).returncode == 0
    assert "[x](2026-01-01_x/README.md)" in (small_disk.root / "RECORDS.md").read_text()


def test_records_plot_on_a_full_disk(small_disk, capsys):
    pytest.importorskip("matplotlib")
    png = small_disk.root / "curves.png"
    proc = records_main(capsys, "plot", *HANDMADE, "-o", png)
    one_line(proc, 1, f"error: cannot write {png}: the disk is full (")
    assert list(small_disk.root.iterdir()) == []

"""Issue 46, the trainer's rows (5, 6, 7, 9, 10, 13, 15, 16): one reader per kind of input, where it enters.
Each row has a table, the reported input first, then neighbours of it; every first row fails on d25563f. Each
reader also has Hypothesis properties, called in-process on generated inputs: meta.json (parse_checkpoint_meta),
token shards (read_shard, used at every open), temporary names (temporary_path, safe_write.temporary_prefix).

A FIFO is only ever opened by the code under test through a helper (unblocked_fifo) that keeps opening it for
writing, so that a reader which waits on it (the old code did) gets end-of-file instead of hanging the suite."""

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import train_gpt as T
from conftest import SMOKE89, REPO, run_main

sys.path.insert(0, str(REPO / "data"))
import safe_write  # noqa: E402
import shards  # noqa: E402

TRAIN = REPO / "train_gpt.py"
# test_bad_input.py's TINY: the smoke model, one 256-token micro-batch a step, two steps
TINY = [*SMOKE89, "--num_iterations=2", "--extension_steps=1", "--val_loss_every=0",
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


# Issue 53 row 4: record #89's FP8 scales are run state a resume takes over: a weight scale of 0 in model.pt was
# accepted (the run ended at 8.7606 instead of 8.7249, exit 0); NaN activation scales in rank_0.pt were never
# checked (the run "diverged"); a wrong shape in rank_0.pt was refused only after the log existed. Both files' scales
# are checked by check_checkpoint, before anything is made: exactly the model's keys and shapes, finite, positive.
# The cases run check_checkpoint on a checkpoint of the smoke model with a 256-token vocabulary (1.6 MB; no run
# reads it), the three also the trainer on the TINY run's.
SCALES = [*TINY, "--vocab_size=256", "--bigram_vocab_size=64", "--bigram_sign_rows=64"]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    args = T.parse_args([*SCALES, f"--checkpoint_dir={tmp_path_factory.mktemp('scales')}"], False)
    model = T.build_model(args, CPU)
    loader = type("Loader", (), {"state_dict": lambda self: {"step": 0}})()  # synthetic data's position
    return T.save_checkpoint(1, 10.0, model, T.build_optimizers(model, args), loader, args, CPU, TRAIN.read_text(),
                             "scales")


def resaved(checkpoint, folder, name: str, change):
    """The checkpoint in folder with its file `name` loaded, changed by change(state) and saved again, and meta.json
    listing the new file's size and sha256 (what a checkpoint written so would hold)."""
    copy_with(checkpoint, folder)
    state = torch.load(folder / name, weights_only=True)
    change(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (folder / name).unlink()
    (folder / name).write_bytes(buffer.getvalue())
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][name] = {"bytes": len(buffer.getvalue()), "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}
    (folder / "meta.json").unlink()
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def setting(key, value):
    return lambda state: state.update({key: value})


def rank_setting(key, value):
    return lambda state: state["rank_buffers"].update({key: value})


MODEL_PT = "its model.pt does not fit the model this config builds ("
RANK_PT = "its rank_0.pt's activation scales do not fit the model this config builds ("
W0, A1, N0 = "blocks.0.mlp.down_weight_scale", "blocks.1.mlp.down_act_scale", "blocks.0.mlp.down_weight_next_scale"
SCALE_CASES = [
    # (what, the file changed, how, fragments of the refusal)
    ("the issue's: a weight scale of 0 in model.pt", "model.pt", setting(W0, torch.tensor(0.0)),
     [MODEL_PT, f"'{W0}' holds 0, not an FP8 scale (a positive number"]),
    ("the issue's: a NaN activation scale in rank_0.pt", "rank_0.pt", rank_setting(A1, torch.tensor(float("nan"))),
     [RANK_PT, f"'{A1}' holds 1 non-finite value(s) (NaN or inf)"]),
    ("the issue's: an activation scale of another shape in rank_0.pt", "rank_0.pt", rank_setting(A1, torch.ones(2)),
     [RANK_PT, f"shape mismatch(es): {A1}: checkpoint (2,), model ()"]),
    ("a negative next scale in model.pt", "model.pt", setting(N0, torch.tensor(-1.0)), [f"'{N0}' holds -1, not an"]),
    ("an activation scale of 0 in rank_0.pt", "rank_0.pt", rank_setting(A1, torch.tensor(0.0)),
     [RANK_PT, f"'{A1}' holds 0, not an FP8 scale"]),
    ("an infinite activation scale in model.pt", "model.pt", setting(A1, torch.tensor(float("inf"))),
     [MODEL_PT, f"'{A1}' holds 1 non-finite value(s)"]),
    ("an activation scale missing from rank_0.pt", "rank_0.pt", lambda state: state["rank_buffers"].pop(A1),
     [RANK_PT, f"missing key(s): {A1}"]),
    ("no activation scales in rank_0.pt", "rank_0.pt", lambda state: state.pop("rank_buffers"),
     [RANK_PT, "6 missing key(s): blocks.0.mlp.down_act_scale"]),
    ("a scale rank_0.pt should not hold", "rank_0.pt", rank_setting(W0, torch.tensor(1.0)),
     [RANK_PT, f"unexpected key(s): {W0}"]),
    ("activation scales that are no state dict", "rank_0.pt", setting("rank_buffers", [1.0]),
     [RANK_PT, "not a state dict but a list"]),
    ("an integer activation scale in rank_0.pt", "rank_0.pt", rank_setting(A1, torch.tensor(1)),
     [RANK_PT, f"'{A1}' has dtype int64, expected a floating one"]),
    ("a weight scale missing from model.pt", "model.pt", lambda state: state.pop(W0), [MODEL_PT, f"key(s): {W0}"]),
]


@pytest.mark.parametrize("what, name, change, fragments", SCALE_CASES, ids=[c[0] for c in SCALE_CASES])
def test_fp8_scales_are_checked_as_run_state(scaled, tmp_path, what, name, change, fragments):
    folder = resaved(scaled, tmp_path / "step_000001", name, change)
    args = T.parse_args(SCALES, False)
    with pytest.raises(T.TrainingError) as refusal:
        T.check_checkpoint(folder, args, CPU, TRAIN.read_text())
    assert str(refusal.value).startswith(f"--resume={folder}: ") and "\n" not in str(refusal.value)
    for fragment in fragments:
        assert fragment in str(refusal.value), (fragment, str(refusal.value))


@pytest.mark.slow  # three refused resumes of the TINY run's checkpoint (92 MB each read and hashed)
def test_a_resume_with_bad_fp8_scales_creates_nothing(at_end, tmp_path):
    for i, (what, name, change, fragments) in enumerate(SCALE_CASES[:3]):
        folder = resaved(at_end, tmp_path / f"{i}/step_000002", name, change)
        proc = run_main(*TINY, f"--resume={folder}", f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck",
                        "--run_id=again", "--save_every=2")
        one_error_line(proc, 1, f"error [rank 0]: --resume={folder}: ", *fragments)
        assert not (tmp_path / "logs").exists() and not (tmp_path / "ck").exists()


# The FP8 scales of the SCALES model, on the meta device: their names, shapes and dtypes.
SCALE_STATE = {k: v for k, v in T.model_state_shapes(T.parse_args(SCALES, False)).items()
               if k.rpartition(".")[2] in T.FP8_SCALES}
scale_values = st.sampled_from([0.0, -0.0, -1.0, 5e-324, 1e-45, 1.0, 448.0, 3e38, float("nan"), float("inf"),
                                float("-inf")]) | st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=60, deadline=None, database=None)
@given(st.sampled_from(sorted(SCALE_STATE)), st.booleans(), scale_values,
       st.sampled_from([(), (1,), (2,), (1, 1)]), st.sampled_from([torch.float32, torch.bfloat16, torch.float64,
                                                                   torch.int32]))
def test_a_scale_is_run_state_only_when_positive_finite_and_of_its_shape(name, rank_file, value, shape, dtype):
    """Row 4's neighbours, in-process: any value, shape and dtype under any FP8 scale's name, in model.pt's state or
    (an activation scale) in a rank's file. check_run_state keeps exactly the positive finite floating scales of
    the model's shape and refuses the rest in one line naming the key."""
    rank_file = rank_file and T.is_rank_buffer(name)
    expected = {k: v for k, v in SCALE_STATE.items() if T.is_rank_buffer(k) or not rank_file}
    state = {k: torch.ones(v.shape, dtype=v.dtype) for k, v in expected.items()}
    state[name] = (torch.full(shape, value, dtype=torch.float64).to(dtype) if dtype.is_floating_point
                   else torch.ones(shape, dtype=dtype))
    stored = state[name].double()
    fine = (dtype.is_floating_point and shape == () and bool(torch.isfinite(stored).all())
            and bool((stored > 0).all()) and float(stored.abs().max()) <= T.MAX_WEIGHT)
    try:
        T.check_run_state(state, expected)
    except T.WeightsError as e:
        assert not fine and name in str(e) and "\n" not in str(e), str(e)
        return
    assert fine, (name, value, shape, dtype)


# Issue 53 row 2: the stage lists compared as text. --stage_prefix_weights=0.25,0.25>0.0,0 is the smoke preset's
# 0.25,0.25>0,0 written another way (the same losses at every validation), yet a resume was refused.
LIST_CASES = [
    # (what, the checkpoint config's values, flags of the resume, None if accepted, else the settings named)
    ("the issue's: 0 written 0.0", {}, ["--stage_prefix_weights=0.25,0.25>0.0,0"], None),
    ("a weight that does not move written A>A", {"stage_prefix_weights": "0.25>0.25,0.25>0,0>0"}, [], None),
    ("multi-token weights with blanks and exponents", {}, ["--stage_mtp_weights=1, 0.5>1,0e0/1>1/1>1.0"], None),
    ("windows and a role's layers", {"stage_windows": " 1:2,2:4, 3:6", "xsa_layers": "2,1,1"}, [], None),
    ("an older checkpoint's truncated spelling", {"stage_prefix_weights": "0.25,0.25>,0"}, [],
     "stage_prefix_weights"),
    ("another value", {}, ["--stage_prefix_weights=0.25,0.25>0.1,0"], "stage_prefix_weights"),
]


@pytest.mark.parametrize("what, saved, flags, differ", LIST_CASES, ids=[c[0] for c in LIST_CASES])
def test_list_flags_are_compared_as_their_values(what, saved, flags, differ):
    args = T.parse_args([*TINY, *flags], False)
    theirs = {**T.config_for_checkpoint(T.parse_args(TINY, False)), **saved}
    ours, theirs = T.comparable_config(T.config_for_checkpoint(args), args), T.comparable_config(theirs, args)
    assert sorted(k for k in ours if ours[k] != theirs[k]) == ([differ] if differ else [])


@pytest.mark.slow  # resumes the untrained checkpoint: its final validation
def test_a_resume_spelling_a_stage_list_otherwise_runs(at_end, tmp_path):
    proc = resume(at_end, tmp_path, "--stage_prefix_weights=0.25,0.25>0.0,0", "--stage_lr=1,1.520,1.73e0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {at_end} at step 2" in (tmp_path / "logs/again.txt").read_text()


# -----------------------------------------------------------------------------
# Rows 9 and 10: a shard is checked at every open (regular file, header, ids); a FIFO is never opened

def replace_shard(path, make):
    path.unlink()
    make(path)


def with_tokens(change):
    def make(path):
        tokens = T.read_shard(BUNDLED_TRAIN).copy()
        shards.write_shard(path, change(tokens))
    return make


def set_token(position, value):
    def change(tokens):
        tokens[position] = value
        return tokens
    return change


REPLACED_CASES = [
    # (what replaces the shard after the start-up scan, fragment of the DataError)
    ("ids past the vocabulary (the issue's)", with_tokens(set_token(5000, 60000)),
     "token id 60000 at position 5000 is outside the vocabulary (--vocab_size=50257)"),
    ("valid ids, other text (the issue's)", with_tokens(lambda t: np.roll(t, 1000)),
     "changed since the run scanned it"),
    ("one token more", with_tokens(lambda t: np.append(t, 1)), "(1,422,807 tokens now, 1,422,806 then"),
    ("a document split in two", with_tokens(set_token(70, T.BOS_ID)), "changed since the run scanned it"),
    ("a header that says more tokens", lambda p: p.write_bytes(BUNDLED_TRAIN.read_bytes()[:-2]), "(truncated?)"),
    ("not a shard", lambda p: p.write_bytes(b"\0" * 4096), "not a token shard (magic 0"),
    ("a folder", lambda p: p.mkdir(), "a folder, not a token shard (a shard is a regular file)"),
]


@pytest.mark.parametrize("what, make, fragment", REPLACED_CASES, ids=[c[0] for c in REPLACED_CASES])
def test_a_shard_replaced_during_a_run_is_refused_when_it_is_opened(tmp_path, what, make, fragment):
    shard = tmp_path / "t_train_000001.bin"
    shutil.copyfile(BUNDLED_TRAIN, shard)
    loader = T.TrainLoader(T.parse_args([*TINY, f"--train_files={tmp_path}/t_train_*.bin"], False), CPU)
    replace_shard(shard, make)
    with pytest.raises(T.DataError) as refused:
        loader.next_batch(0)
    assert str(refused.value).startswith(f"{shard}: ") and fragment in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_shard_replaced_by_a_fifo_is_refused_without_waiting(tmp_path):
    shard = tmp_path / "t_train_000001.bin"
    shutil.copyfile(BUNDLED_TRAIN, shard)
    loader = T.TrainLoader(T.parse_args([*TINY, f"--train_files={tmp_path}/t_train_*.bin"], False), CPU)
    shard.unlink()
    with unblocked_fifo(shard), pytest.raises(T.DataError, match="t_train_000001.bin: a FIFO, not a token shard"):
        loader.next_batch(0)


def test_an_unchanged_shard_opens_as_it_was_scanned(tmp_path):
    shard = tmp_path / "t_train_000001.bin"
    shutil.copyfile(BUNDLED_TRAIN, shard)
    loader = T.TrainLoader(T.parse_args([*TINY, f"--train_files={tmp_path}/t_train_*.bin"], False), CPU)
    os.utime(shard, (0, 0))  # touched, not changed
    inputs, targets = loader.next_batch(0)[0]
    assert torch.equal(inputs[1:], targets[:-1]) and len(inputs) == 256


NOT_A_FILE_CASES = [
    # (what --val_files or --train_files matches, the flag, how it is made)
    ("a FIFO for --val_files (the issue's)", "val_files", "fifo"),
    ("a FIFO for --train_files", "train_files", "fifo"),
    ("a folder for --val_files", "val_files", "folder"),
    ("a link to /dev/null for --train_files", "train_files", "device"),
]


@pytest.mark.parametrize("what, flag, kind", NOT_A_FILE_CASES, ids=[c[0] for c in NOT_A_FILE_CASES])
def test_a_shard_glob_matching_what_is_not_a_file_is_one_line(tmp_path, what, flag, kind):
    path = tmp_path / ("v_000000.bin" if flag == "val_files" else "t_train_000001.bin")
    shown = {"fifo": "a FIFO", "folder": "a folder", "device": "a device"}[kind]
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            stack.enter_context(unblocked_fifo(path))
        elif kind == "folder":
            path.mkdir()
        else:
            path.symlink_to("/dev/null")
        proc = run_main(*TINY, f"--{flag}={tmp_path}/{path.name[0]}_*.bin", f"--logs_dir={tmp_path}/logs")
    one_error_line(proc, 2, f"error: {path}: {shown}, not a token shard (a shard is a regular file)")
    assert not (tmp_path / "logs").exists()


def header(magic=T.SHARD_MAGIC, version=T.SHARD_VERSION, count=0, packing=0) -> bytes:
    values = np.zeros(T.SHARD_HEADER_INTS, dtype="<i4")
    values[:4] = magic, version, count, packing
    return values.tobytes()


INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)


@pytest.fixture(scope="module")
def shard_file(tmp_path_factory):
    return tmp_path_factory.mktemp("shard") / "s_000000.bin"


@PROPERTY
@given(magic=st.just(T.SHARD_MAGIC) | INT32, version=st.just(T.SHARD_VERSION) | INT32,
       count=st.integers(0, 40) | INT32, packing=st.sampled_from([0, 1]) | INT32,
       tokens=st.lists(st.integers(0, 2 ** 16 - 1), max_size=40), cut=st.none() | st.integers(0, 1200),
       vocab=st.none() | st.integers(1, 2 ** 16 + 5))
def test_property_shard_reader_gives_the_tokens_or_one_line_naming_the_file(shard_file, magic, version, count,
                                                                           packing, tokens, cut, vocab):
    data = header(magic, version, count, packing) + np.array(tokens, dtype="<u2").tobytes()
    data = data if cut is None else data[:cut]
    shard_file.write_bytes(data)
    valid = (len(data) >= T.SHARD_HEADER_BYTES and magic == T.SHARD_MAGIC and version == T.SHARD_VERSION
             and count >= 0 and len(data) == T.SHARD_HEADER_BYTES + 2 * count)
    in_vocab = vocab is None or all(t < vocab for t in tokens[:count])
    try:
        read = T.read_shard(shard_file, vocab)
    except T.DataError as e:
        assert not (valid and in_vocab), e
        assert str(e).startswith(f"{shard_file}: ") and "\n" not in str(e) and len(str(e)) < 300
        return
    assert valid and in_vocab
    assert read.dtype == np.uint16 and read.tolist() == tokens[:count]
    assert T.read_shard_header(shard_file) == count


@PROPERTY
@given(count=st.integers(0, 3000), vocab=st.integers(1, 2 ** 16), seed=st.integers(0, 2 ** 32 - 1))
def test_property_the_vocabulary_check_finds_the_first_id_past_it(shard_file, count, vocab, seed):
    tokens = np.random.default_rng(seed).integers(0, 2 ** 16, count).astype(np.uint16)
    shards.write_shard(shard_file, tokens)
    past = np.flatnonzero(tokens >= vocab)
    if not len(past):
        assert np.array_equal(T.read_shard(shard_file, vocab), tokens)
        return
    with pytest.raises(T.DataError, match=f"token id {tokens[past[0]]} at position {past[0]} is outside"):
        T.read_shard(shard_file, vocab)


# -----------------------------------------------------------------------------
# Row 7: the sweep of unfinished saves never follows a link, nor touches anything outside the run's folder

def outside_folder(root):
    """A user's folder that holds what a sweep would remove in a run folder: a partial save, a write test."""
    outside = root / "outside"
    (outside / ".step_000004.partial").mkdir(parents=True)
    (outside / ".step_000004.partial/mine.txt").write_text("a user's file")
    (outside / ".write_test").write_text("a user's file")
    return outside


def outside_contents(outside):
    return sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))


SWEEP_CASES = ["the run folder is a link (the issue's)", "a partial save inside is a link to a folder outside",
               ".write_test inside is a link to a file outside", "the run folder is a link to a link"]


@pytest.mark.parametrize("case", SWEEP_CASES)
def test_the_sweep_touches_nothing_outside_the_run_folder(tmp_path, case):
    outside = outside_folder(tmp_path)
    before = outside_contents(outside)
    run = tmp_path / "ck/dead"
    run.parent.mkdir()
    if case == SWEEP_CASES[0]:
        run.symlink_to(outside)
        expected = []
    elif case == SWEEP_CASES[3]:
        (tmp_path / "ck/hop").symlink_to(outside)
        run.symlink_to(tmp_path / "ck/hop")
        expected = []
    else:
        run.mkdir()
        name = ".step_000006.partial" if case == SWEEP_CASES[1] else ".write_test"
        (run / name).symlink_to(outside / (".step_000004.partial" if name != ".write_test" else ".write_test"))
        (run / ".final.partial").mkdir()  # a real leftover beside it, removed
        expected = [f"note: removed {run / n}, which a run that is gone (killed while saving) left unfinished"
                    for n in sorted([".final.partial", name])]
    assert T.sweep_unfinished_saves(run) == expected
    assert outside_contents(outside) == before
    if expected:
        assert list(run.iterdir()) == []


def test_a_run_given_the_id_of_a_linked_run_folder_leaves_its_target_alone(tmp_path):
    outside = outside_folder(tmp_path)
    before = outside_contents(outside)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck/dead").symlink_to(outside)
    proc = run_main(*TINY, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck", "--run_id=dead",
                    "--save_every=2")
    one_error_line(proc, 2, f"--run_id=dead: {tmp_path}/ck/dead already exists")
    assert outside_contents(outside) == before


# -----------------------------------------------------------------------------
# Row 13: temporary names are cut by bytes: a legal name (255 bytes or fewer) always has a legal temporary

def named(bytes_: bytes) -> str:
    return os.fsdecode(bytes_)


NAME_CASES = [
    ("251 bytes of 4-byte characters (the issue's)", "𝄞" * 62 + "abc"),
    ("255 bytes of 4-byte characters", "𝄞" * 63 + "abc"),
    ("255 bytes of 3-byte characters", "€" * 85),
    ("255 bytes of 2-byte characters", "é" * 127 + "a"),
    ("255 ASCII bytes", "a" * 255),
    ("255 bytes that are not UTF-8", named(b"\xff" * 255)),
    ("101 bytes, a 4-byte character across the cut", "a" * 98 + "𝄞"),
]


@pytest.mark.parametrize("what, name", NAME_CASES, ids=[c[0] for c in NAME_CASES])
def test_every_writer_writes_a_legal_name_of_up_to_255_bytes(tmp_path, what, name):
    assert len(os.fsencode(name)) <= 255
    T.write_file(tmp_path / name, b"trainer")  # checkpoints, final weights, tools/bench.py, tools/record_weights.py
    folder = tempfile.mkdtemp(prefix=T.temporary_prefix(f"{name[:-1]}_"), suffix=".partial", dir=tmp_path)
    os.rmdir(folder)  # a folder written whole (to-ours)
    (tmp_path / "data").mkdir()
    with safe_write.atomic_file(tmp_path / "data" / name) as f:  # shards and downloads (data/)
        f.write(b"data")
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [name]
    assert (tmp_path / name).read_bytes() == b"trainer" and os.listdir(tmp_path / "data") == [name]


def utf8_char(size: int):
    """A character of `size` bytes in UTF-8 (and surrogate escapes: a byte that is not UTF-8, os.fsdecode's way)."""
    ranges = {1: (0x21, 0x7e), 2: (0xa1, 0x7ff), 3: (0x800, 0xd7ff), 4: (0x10000, 0x10ffff)}
    low, high = ranges[size]
    chars = st.integers(low, high).map(chr).filter(lambda c: c != "/")
    return chars | st.integers(0x80, 0xff).map(lambda b: named(bytes([b]))) if size == 1 else chars


NAMES = st.lists(st.integers(1, 4).flatmap(utf8_char), min_size=1, max_size=255).map("".join).map(
    lambda name: T.cut_to_bytes(name, 255)).filter(lambda name: name not in ("", ".", ".."))


@PROPERTY
@given(name=NAMES)
def test_property_temporary_names_fit_in_255_bytes(name):
    """Both writers name a temporary `.NAME.` + what mkstemp or mkdtemp add (8 random characters, unique to the call,
    and the suffix): within 255 bytes for any legal name, the same in both."""
    prefix = T.temporary_prefix(name)
    assert prefix == safe_write.temporary_prefix(name) and prefix.startswith(".") and prefix.endswith(".")
    for suffix in (".tmp", ".partial"):  # a file's (write_file, atomic_file) and a folder's (to-ours)
        assert len(os.fsencode(prefix + "abcdefgh" + suffix)) <= 255
    assert len(os.fsencode(prefix[:-1] + "-staging-abcdefgh")) <= 255  # the tokenizer's staging folder


@PROPERTY
@given(name=st.lists(st.integers(1, 4).flatmap(utf8_char), max_size=300).map("".join), limit=st.integers(0, 260))
def test_property_a_name_is_cut_by_bytes_at_a_character_boundary(name, limit):
    for cut_to_bytes in (T.cut_to_bytes, safe_write.cut_to_bytes):
        whole, cut = os.fsencode(name), os.fsencode(cut_to_bytes(name, limit))
        assert whole.startswith(cut) and len(cut) <= limit
        if len(whole) <= limit:
            assert cut == whole
            continue
        assert len(cut) >= limit - 3  # never more than one character short
        try:
            whole.decode()
        except UnicodeDecodeError:
            continue
        cut.decode()  # a name that is UTF-8 is cut between characters


# -----------------------------------------------------------------------------
# Row 15: meta.json's every field checked for type and range by one reader, before the log exists
def set_in(*keys, value):
    def change(meta):
        target = meta
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


META_CASES = [
    # (what, change to meta.json, fragment of the error line)
    ("train_time_ms 1e308 (the issue's)", set_in("train_time_ms", value=1e308),
     "meta.json's train_time_ms is 1e+308, not a time (a finite number of ms, 0 or more, at most 31,536,000,000"),
    ("train_time_ms a year and 1 ms", set_in("train_time_ms", value=T.MAX_TRAIN_TIME_MS + 1),
     "meta.json's train_time_ms is 31536000001, not a time"),
    ("train_time_ms an int of 400 digits", set_in("train_time_ms", value=10 ** 400),
     f"meta.json's train_time_ms is {str(10 ** 400)[:30]}... (401 characters), not a time"),
    ("train_time_ms true", set_in("train_time_ms", value=True), "meta.json has no valid 'train_time_ms'"),
    ("step 10**30", set_in("step", value=10 ** 30), "meta.json's step is 1000000000000000000000000000000, not one"),
    ("world_size 0", set_in("world_size", value=0), "meta.json's world_size is 0, not one a run saves"),
    ("world_size 2**63", set_in("world_size", value=2 ** 63), "meta.json's world_size is 9223372036854775808"),
    ("code_sha256 not hex", set_in("code_sha256", value="x" * 64), "meta.json has no valid 'code_sha256'"),
    ("a shard named by 5,000 characters", set_in("shards", 0, "file", value="x" * 5000),
     "meta.json has no valid 'shards'"),
    ("a shard's fingerprint a number", set_in("shards", 0, "fingerprint", value=7), "meta.json has no valid 'shards'"),
    ("a file of -1 bytes", set_in("files", "model.pt", "bytes", value=-1), "meta.json has no valid 'files'"),
    ("a file's sha256 short", set_in("files", "rank_0.pt", "sha256", value="ab"), "meta.json has no valid 'files'"),
    ("a setting named by an escape", set_in("config", "\x1b[2J", value=1), "meta.json has no valid 'config'"),
    ("a setting's value a list", set_in("config", "seed", value=[1]), "meta.json has no valid 'config'"),
    ("the loader's packing a number (a TypeError traceback)", set_in("loader", "packing", value=5),
     "meta.json has no valid 'loader' (its packing is not a list of documents or stream)"),
]


@pytest.mark.parametrize("what, change, fragment", META_CASES, ids=[c[0] for c in META_CASES])
def test_meta_json_fields_out_of_type_or_range_are_refused(at_end, tmp_path, what, change, fragment):
    folder = copy_with(at_end, tmp_path / "step_000002", change)
    with pytest.raises(T.TrainingError) as refused:
        T.check_checkpoint(folder, T.parse_args(TINY, False), CPU, TRAIN.read_text())
    assert str(refused.value).startswith(f"--resume={folder}: ") and fragment in str(refused.value)
    assert len(str(refused.value)) < 400


def test_a_train_time_of_1e308_ms_is_refused_before_the_log(at_end, tmp_path):
    folder = copy_with(at_end, tmp_path / "step_000002", set_in("train_time_ms", value=1e308))
    one_error_line(resume(folder, tmp_path), 1, f"error [rank 0]: --resume={folder}: meta.json's train_time_ms is "
                                                f"1e+308, not a time")
    assert not (tmp_path / "logs").exists()


def test_a_meta_json_of_5000_digits_or_64_mib_is_unreadable_in_one_line(at_end, tmp_path):
    folder = copy_with(at_end, tmp_path / "a/step_000002")
    text = (folder / "meta.json").read_text()
    (folder / "meta.json").unlink()
    (folder / "meta.json").write_text(text.replace('"step": 2', '"step": ' + "9" * 5000, 1))
    with pytest.raises(T.TrainingError, match=r"unreadable meta.json \(Exceeds the limit"):
        T.read_checkpoint_meta(folder)
    with open(folder / "meta.json", "r+b") as f:
        f.truncate(T.MAX_META_BYTES + 1)  # sparse: no 64 MiB written
    with pytest.raises(T.TrainingError, match=r"unreadable meta.json \(67,108,865 bytes, more than a train_gpt"):
        T.read_checkpoint_meta(folder)


# A meta.json save_checkpoint could have written, for the properties (no checkpoint files are read)
VALID_META = {"step": 2, "train_time_ms": 1234.5, "world_size": 1,
              "loader": {"file_index": 0, "piece": 9, "packing": ["documents"]},
              "config": T.config_for_checkpoint(T.parse_args(TINY, False)), "code_sha256": "a" * 64,
              "shards": [{"file": "data/x_train_000001.bin", "bytes": 2048, "fingerprint": "b" * 64}],
              "files": {"model.pt": {"bytes": 10, "sha256": "c" * 64}, "rank_0.pt": {"bytes": 0, "sha256": "d" * 64}}}
PLACES = [("step",), ("train_time_ms",), ("world_size",), ("loader",), ("loader", "packing"), ("config",),
          ("config", "seed"), ("config", "model_dim"), ("code_sha256",), ("shards",), ("shards", 0),
          ("shards", 0, "file"), ("shards", 0, "bytes"), ("shards", 0, "fingerprint"), ("files",),
          ("files", "model.pt"), ("files", "model.pt", "bytes"), ("files", "rank_0.pt", "sha256")]
NUMBERS = (st.integers() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.integers(10 ** 30, 10 ** 60)
           | st.sampled_from([0, -0.0, T.MAX_TRAIN_TIME_MS, T.MAX_COUNT, T.MAX_COUNT + 1, 1e308, -1e-300]))
TEXT = st.text() | st.text(alphabet="\x1b\n\r\u202e\x00[2J0123456789abcdef", max_size=80)
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)


@PROPERTY
@given(place=st.sampled_from(PLACES), value=JSON, drop=st.booleans())
def test_property_meta_json_reader_gives_a_valid_meta_or_one_short_line(place, value, drop):
    meta = json.loads(json.dumps(VALID_META))
    target = meta
    for key in place[:-1]:
        target = target[key]
    if drop:
        del target[place[-1]]
    else:
        target[place[-1]] = value
    try:
        read = T.parse_checkpoint_meta(json.loads(json.dumps(meta)))  # as json.loads reads it from a file
    except T.MetaError as e:
        assert "\n" not in str(e) and len(str(e)) < 200, str(e)
        return
    assert type(read.step) is int and 0 <= read.step <= T.MAX_COUNT
    assert type(read.world_size) is int and 1 <= read.world_size <= T.MAX_COUNT
    assert type(read.train_time_ms) is float and math.isfinite(read.train_time_ms)
    assert 0 <= read.train_time_ms <= T.MAX_TRAIN_TIME_MS
    assert all(p in T.SHARD_PACKINGS for p in read.loader.get("packing", []))
    assert all(k.isidentifier() and not isinstance(v, (list, dict)) for k, v in read.config.items())
    assert T.SHA256_PATTERN.fullmatch(read.code_sha256)
    for shard in read.shards:
        assert 0 < len(shard.file) <= T.MAX_PATH_CHARS and 0 <= shard.bytes <= T.MAX_COUNT
        assert type(shard.bytes) is int and T.SHA256_PATTERN.fullmatch(shard.fingerprint)
    for listed in read.files.values():
        assert type(listed.bytes) is int and 0 <= listed.bytes <= T.MAX_COUNT and T.SHA256_PATTERN.fullmatch(
            listed.sha256)


def test_the_valid_meta_json_reads_as_it_was_written():
    read = T.parse_checkpoint_meta(json.loads(json.dumps(VALID_META)))
    assert (read.step, read.train_time_ms, read.world_size, read.code_sha256) == (2, 1234.5, 1, "a" * 64)
    assert read.shards == (T.ShardRecord("data/x_train_000001.bin", 2048, "b" * 64),)
    assert read.files["model.pt"] == T.FileRecord(10, "c" * 64) and read.loader == VALID_META["loader"]


# -----------------------------------------------------------------------------
# Row 6: outside text (meta.json's shard names, file names, flags) is printed and logged escaped
ESCAPE_CASES = [
    # (what, a shard name recorded in meta.json)
    ("clears the screen, prints a green OK (the issue's)", "\x1b[2J\x1b[32mOK\x1b[0m"),
    ("starts a line of its own", "x.bin\nerror: nothing is wrong"),
    ("a carriage return and a bell", "x.bin\r\x07"),
    ("a bidi override", "\u202enib.exe"),
]


@pytest.mark.parametrize("what, name", ESCAPE_CASES, ids=[c[0] for c in ESCAPE_CASES])
def test_a_shard_name_in_meta_json_is_printed_escaped(at_end, tmp_path, what, name):
    def change(meta):
        meta["shards"][0].update(file=name, fingerprint="0" * 64)
    folder = copy_with(at_end, tmp_path / "step_000002", change)
    line = one_error_line(resume(folder, tmp_path), 1, "is not the one the checkpoint's run read (")
    assert f"({T.visible(name)}, 2,846,636 bytes, another fingerprint)" in line


@pytest.mark.parametrize("text, shown", [
    ("\x1b[2J", "\\x1b[2J"), ("a\nb", "a\\nb"), ("\u202eab", "\\u202eab"), ("tab\there", "tab\\there"),
    ("\udcff.bin", "\\udcff.bin"), ("été 東京 𝄞", "été 東京 𝄞"), ("a\\x1b", "a\\x1b"),
], ids=["escape", "newline", "bidi", "tab", "not UTF-8", "printable, any script", "a backslash as it is"])
def test_one_escape_for_every_line_logged_or_printed(tmp_path, capsys, text, shown):
    log = T.Logger(tmp_path / "log.txt")
    log(f"data: {text}")
    log("source\n  code", console=False, verbatim=True)  # the source and nvidia-smi's table, ours, as they are
    log.close()
    T.report_error(f"error: {text}", 2)
    assert (tmp_path / "log.txt").read_text() == f"data: {shown}\nsource\n  code\n"
    out, err = capsys.readouterr()
    assert (out, err) == (f"data: {shown}\n", f"error: {shown}\n")
    assert T.visible(T.visible(text)) == T.visible(text)


# -----------------------------------------------------------------------------
# Row 16: a lock file this user may not open is named, not blamed on the folder

@pytest.fixture
def denied_lock(tmp_path, monkeypatch):
    """A folder whose .writing.lock this user may not open: as root, permissions deny nothing, so os.open answers
    for the lock file what the kernel answers a user to whom it is not readable (EACCES)."""
    out = tmp_path / "out"
    out.mkdir()
    lock = out / safe_write.LOCK_NAME
    lock.write_text("123 tokenize_text.py\n")
    lock.chmod(0)
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == str(lock) and os.geteuid() == 0:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(safe_write.os, "open", open_)
    return out


def test_an_unreadable_lock_file_is_named(denied_lock):
    with pytest.raises(safe_write.LockError) as refused:
        with safe_write.FolderLock(denied_lock, f"--out {denied_lock}"):
            pass
    assert str(refused.value) == (
        f"--out {denied_lock}: its lock file {denied_lock}/.writing.lock cannot be opened (Permission denied): "
        f"another user's, or its permissions were changed; remove it if no run is writing there, and run again")
    assert (denied_lock / safe_write.LOCK_NAME).exists()  # left as it is


def test_the_downloader_names_an_unreadable_lock_file(denied_lock, capsys, monkeypatch):
    import cached_fineweb10B
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("downloaded anyway"))
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):  # cached_fineweb10B.main sets these
        monkeypatch.setenv(name, "10")
    assert cached_fineweb10B.main(["0", "--out", str(denied_lock)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write there" not in err
    assert err.startswith(f"error: --out {denied_lock}: its lock file {denied_lock}/.writing.lock cannot be opened")


def test_a_folder_that_cannot_be_written_is_still_said_so(tmp_path, monkeypatch):
    real_open = os.open

    def open_(path, flags, *args, **kwargs):  # no lock file, and the folder refuses one (a read-only folder)
        if os.fspath(path).endswith(safe_write.LOCK_NAME):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(safe_write.os, "open", open_)
    with pytest.raises(PermissionError):
        with safe_write.FolderLock(tmp_path, "--out x"):
            pass

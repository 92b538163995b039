"""The records' recipes: the record85 preset's values and stage schedule (learning rate, momentum, windows,
batch sizes, sequence lengths, multi-token weights, the untie step) against record #85 v3's numbers written out
by hand; the speedrun preset's (record #89's) where they differ; and the loader's BOS-aligned packing across
stages and world sizes."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import train_gpt as T
from conftest import SMOKE89, run_main

RECORD85 = T.parse_args(["--preset=record85"], True)
SCHEDULE = T.Schedule(RECORD85)


def test_record85_preset_holds_record_85s_values():
    a = RECORD85
    assert (a.num_iterations, a.extension_steps, a.micro_batches) == (1290, 15, "8")
    assert [(s.start, s.end) for s in SCHEDULE.stages] == [(0, 425), (425, 850), (850, 1275), (1275, 1290)]
    assert [s.batch_tokens for s in SCHEDULE.stages] == [131_072, 262_144, 393_216, 393_216]
    assert [s.max_seq_len for s in SCHEDULE.stages] == [896, 2048, 2048, 2048]
    assert [s.windows for s in SCHEDULE.stages] == [(1, 3), (3, 7), (5, 11), (6, 13)]
    assert SCHEDULE.final_val_windows == (6, 20) and a.window_block == 128
    assert (a.val_tokens, a.val_seq_len, a.val_loss_every) == (10_485_760, 262_144, 250)
    assert (a.adam_lr, a.adam_eps, a.adam_weight_decay, a.adam_every) == (0.008, 1e-10, 0.005, 2)
    assert (a.muon_lr, a.muon_beta2, a.muon_weight_decay) == (0.023, 0.9, 1.2)
    assert (a.muon_momentum_start, a.muon_momentum_end, a.muon_momentum_warmup, a.muon_momentum_cooldown) == (
        0.85, 0.95, 300, 50)
    assert (a.num_layers, a.model_dim, a.head_dim, a.vocab_size, a.bigram_vocab_size, a.bigram_sign_rows) == (
        11, 768, 128, 50257, 377_280, 8192)
    assert (a.logit_cap, a.logit_cap_shift, a.logit_cap_width, a.dc_window) == (23, 5, 7.5, 112)
    # 425 * 131,072 + 425 * 262,144 + (425 + 15) * 393,216 training tokens
    assert sum(SCHEDULE.stage(s).batch_tokens for s in range(a.num_iterations)) == 340_131_840


# Record #89 as merged upstream (its root train_gpt.py at f411b3d3: notes/record89.md): record #85 v3's recipe on
# 1,270 scheduled steps, stage ends round(1270 * i / 3), the split (untie) step 847 | 1 = 847, the cooldown from
# int(1270 * 0.4) = 508; record #88's prefix weight 0.25 through stage 1, 0.25 -> 0 over stage 2, 0 after; #89's
# FP8 down-projection.
SPEEDRUN = T.parse_args(["--preset=record89"], True)


def test_record89_preset_is_record_89s_schedule_on_record_85s_values():
    schedule = T.Schedule(SPEEDRUN)
    assert (SPEEDRUN.num_iterations, SPEEDRUN.extension_steps, SPEEDRUN.mlp_down_fp8) == (1285, 15, True)
    assert [(s.start, s.end) for s in schedule.stages] == [(0, 423), (423, 847), (847, 1270), (1270, 1285)]
    assert schedule.untie_step == 847 and schedule.cooldown_start == 508
    assert [schedule.lr(s) for s in (0, 423, 508)] == [1.0, 1.52, 1.52]
    assert schedule.lr(846) == pytest.approx(1.52 * (1 - 338 / 762) + 0.15 * 338 / 762, rel=1e-12)
    assert schedule.lr(847) == pytest.approx(1.73 * (1 - 339 / 762) + 0.15 * 339 / 762, rel=1e-12)
    assert [schedule.lr(s) for s in (1270, 1284)] == [0.15, 0.15]
    assert schedule.momentum(1235) == 0.95 and schedule.momentum(1284) == pytest.approx(0.95 - 0.1 * 49 / 50)
    weights = [schedule.prefix_weight(s) for s in (0, 422, 423, 635, 846)]
    assert weights == pytest.approx([0.25, 0.25, 0.25, 0.25 * (1 - 212 / 424), 0.25 * (1 - 423 / 424)], rel=1e-12)
    assert all(schedule.prefix_weight(s) is None for s in (847, 1269, 1270, 1285))
    assert [schedule.mtp_weights(s) for s in (422, 846)] == [pytest.approx((1, 0.5, 0.25 / 423)),
                                                           pytest.approx((1, 0.5 / 424))]
    assert [s for s in range(1286) if schedule.validates(s)] == [0, 250, 500, 750, 1000, 1250, 1285]
    # everything else is record #85 v3's
    same = {f.name for f in T.dataclasses.fields(T.Hyperparameters)} - {
        "preset", "num_iterations", "stage_prefix_weights", "mlp_down_fp8"}
    assert all(getattr(SPEEDRUN, name) == getattr(RECORD85, name) for name in same)
    assert (RECORD85.stage_prefix_weights, RECORD85.mlp_down_fp8) == ("0,0,0", False)
    # 423 * 131,072 + 424 * 262,144 + (423 + 15) * 393,216 training tokens
    assert sum(schedule.stage(s).batch_tokens for s in range(1285)) == 338_821_120


# The record's learning-rate multiplier: its stage's (1, 1.52, 1.73), then from step int(1275 * 0.4) = 510 a
# linear move to 0.15 at step 1275; the extension stays at 0.15.
@pytest.mark.parametrize("step, expected", [
    (0, 1.0), (424, 1.0), (425, 1.52), (509, 1.52), (510, 1.52),
    (511, 1.52 * (1 - 1 / 765) + 0.15 / 765),
    (849, 1.52 * (1 - 339 / 765) + 0.15 * 339 / 765),
    (850, 1.73 * (1 - 340 / 765) + 0.15 * 340 / 765),  # the stage's multiplier jumps inside the cooldown
    (1274, 1.73 * (1 - 764 / 765) + 0.15 * 764 / 765),
    (1275, 0.15), (1289, 0.15), (1290, 0.15),
])
def test_lr_schedule(step, expected):
    assert SCHEDULE.lr(step) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step, expected", [(0, 0.85), (150, 0.9), (299, 0.85 + 0.1 * 299 / 300), (300, 0.95),
                                            (1240, 0.95), (1241, 0.95 - 0.1 / 50), (1265, 0.9), (1289, 0.95 - 0.1 * 49 / 50)])
def test_muon_momentum_schedule(step, expected):
    assert T.Schedule(RECORD85).momentum(step) == pytest.approx(expected, rel=1e-12)


# Multi-token weights move linearly over each stage: [1, .5, .25 -> 0], then [1, .5 -> 0], then [1].
@pytest.mark.parametrize("step, expected", [
    (0, (1.0, 0.5, 0.25)), (1, (1.0, 0.5, 0.25 * 424 / 425)), (424, (1.0, 0.5, 0.25 / 425)),
    (425, (1.0, 0.5)), (637, (1.0, 0.5 * 213 / 425)), (849, (1.0, 0.5 / 425)),
    (850, (1.0,)), (1289, (1.0,)), (1290, (1.0,)),
])
def test_multi_token_weights(step, expected):
    assert SCHEDULE.mtp_weights(step) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step, windows, batch, length", [
    (0, (1, 3), 131_072, 896), (424, (1, 3), 131_072, 896), (425, (3, 7), 262_144, 2048),
    (849, (3, 7), 262_144, 2048), (850, (5, 11), 393_216, 2048), (1274, (5, 11), 393_216, 2048),
    (1275, (6, 13), 393_216, 2048), (1289, (6, 13), 393_216, 2048)])
def test_stage_boundaries(step, windows, batch, length):
    stage = SCHEDULE.stage(step)
    assert (stage.windows, stage.batch_tokens, stage.max_seq_len) == (windows, batch, length)
    assert SCHEDULE.micro_tokens(step) == batch // 8


def test_untie_adam_and_validation_steps():
    assert SCHEDULE.untie_step == 851  # the record's split step: 850 | 1, an odd step, so that Adam steps
    schedule = T.Schedule(RECORD85)
    assert [s for s in range(6) if schedule.adam_steps(s)] == [1, 3, 5]
    assert [s for s in range(1291) if schedule.validates(s)] == [0, 250, 500, 750, 1000, 1250, 1290]
    assert SCHEDULE.windows(1290, final_validation=True) == (6, 20)
    # the untie stage counts the extension as stage 3; past it, never
    assert T.Schedule(T.parse_args(["--preset=record85", "--untie_stage=3"], True)).untie_step == 1275
    assert T.Schedule(T.parse_args(["--preset=record85", "--untie_stage=4"], True)).untie_step is None


def test_yarn_follows_the_window_changes_and_stays_for_the_final_validation():
    rotary = T.Rotary(128, 16, 128, SCHEDULE.windows(0)[1])
    base = rotary.angular_freq.clone()
    scale = 0.1
    for step in range(1291):
        rotary.set_window(SCHEDULE.windows(step)[1])
    for old, new in ((3, 7), (7, 11), (11, 13)):
        turns = 128 * old * base / (2 * np.pi)
        keep = ((turns - 1) / 31).clamp(0, 1)
        base = base * (old / new + keep * (1 - old / new))
        scale *= 0.2 * np.log(new / old) + 1
    torch.testing.assert_close(rotary.angular_freq, base, rtol=1e-6, atol=0)
    assert rotary.window == 13 and rotary.scale == pytest.approx(scale, rel=1e-12)


def corpus(doc_lengths, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[T.BOS_ID], rng.integers(0, T.BOS_ID, n - 1)]) for n in doc_lengths]
    return np.concatenate(docs).astype(np.uint16)


def test_every_training_sequence_starts_with_bos_and_none_is_longer_than_the_cap():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 5000, 400)  # many longer than 2,048, some of one token
    lengths[:3] = [1, 7000, 1]
    tokens = corpus(lengths)
    pieces = T.DocumentPieces(tokens)
    first, taken = 0, 0
    doc_starts = np.flatnonzero(tokens == T.BOS_ID)
    for cap, micro in ((896, 4096), (2048, 8192)):  # two stages, one after the other, as the loader walks them
        step, first = pieces.take_step(first, num_micro=4, micro_tokens=micro, max_len=cap)
        for chunk in step:
            assert len(chunk) == micro + 1 and chunk[0] == T.BOS_ID
            bos = np.flatnonzero(chunk == T.BOS_ID)
            sequences = np.diff(np.append(bos, len(chunk)))
            assert sequences.max() <= cap
            # each piece is the first tokens of the next document, in order
            for start, n in zip(bos, sequences):
                doc = doc_starts[taken]
                assert np.array_equal(chunk[start:start + n], tokens[doc:doc + n])
                assert n == min(cap, lengths[taken]) or start + n == len(chunk)  # only the last piece is cut short
                taken += 1
        assert first == taken  # the next step starts at the next document: a cut document's rest is skipped


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [T.SHARD_MAGIC, T.SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def loader_args(tmp_path, **overrides):
    # repeat_data: these tiny shards supply fewer steps than the smoke preset's 30, which is refused otherwise.
    # Three stages of 2 steps (micro-batches of 128, 192, 256 tokens), then the extension.
    values = dict(train_files=f"{tmp_path}/t_train_*.bin", stage_batch_tokens="1024,1536,2048", micro_batches=8,
                  stage_max_seq_len="100,300,300", num_iterations=8, extension_steps=2, repeat_data="true",
                  window_block=64, dc_window=56)
    values.update(overrides)
    return T.parse_args(["--preset=smoke", *(f"--{k}={v}" for k, v in values.items())], False)


def test_world_sizes_see_the_same_micro_batches_and_steps_never_straddle_shards(tmp_path):
    rng = np.random.default_rng(2)
    write_shard(tmp_path / "t_train_000001.bin", corpus(rng.integers(1, 400, 60), seed=3))
    write_shard(tmp_path / "t_train_000002.bin", corpus(rng.integers(1, 400, 80), seed=4))
    args = loader_args(tmp_path)
    schedule = T.Schedule(args)

    def steps(world_size, count=8):
        loaders = [T.TrainLoader(args, T.DistEnv(r, r, world_size, torch.device("cpu"))) for r in range(world_size)]
        out = []
        for step in range(count):
            per_rank = [loader.next_batch(step) for loader in loaders]
            # rank r holds micro-batches r, r + world_size, ...
            micro = [per_rank[m % world_size][m // world_size] for m in range(8)]
            assert all(len(x) == schedule.micro_tokens(step) for x, _ in micro)
            out.append([torch.cat([x, y[-1:]]) for x, y in micro])
        return out, loaders[0]

    reference, loader = steps(1)
    for world_size in (2, 4, 8):
        other, _ = steps(world_size)
        assert all(torch.equal(a, b) for sa, sb in zip(reference, other) for a, b in zip(sa, sb)), world_size
    # each step's documents are cut at its stage's length
    for step, micro_batches in enumerate(reference):
        cap = schedule.stage(step).max_seq_len
        for chunk in micro_batches:
            bos = torch.nonzero(chunk == T.BOS_ID).flatten().tolist() + [len(chunk)]
            assert max(b - a for a, b in zip(bos, bos[1:])) <= cap
    # shard 1 could not fill all the steps: a later step starts at shard 2's first document
    shard2 = T.read_shard(tmp_path / "t_train_000002.bin")
    starts = [i for i, s in enumerate(reference) if torch.equal(s[0][:20], torch.from_numpy(shard2[:20].astype(np.int64)))]
    assert starts and starts[0] > 0


def test_the_supply_count_follows_the_stages(tmp_path):
    rng = np.random.default_rng(7)
    write_shard(tmp_path / "t_train_000001.bin", corpus(rng.integers(1, 400, 150), seed=8))
    args = loader_args(tmp_path, num_iterations=30)  # more steps than the shard supplies: all of them are counted
    loader = T.TrainLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu")))
    delivered, step = 0, 0
    while True:
        loader.next_batch(step)
        if loader.started_over:
            break
        delivered, step = delivered + 1, step + 1
    assert delivered == loader.scans[0].steps and 2 < delivered < 30  # steps of more than one stage


def test_train_loader_resumes_where_it_stopped(tmp_path):
    rng = np.random.default_rng(5)
    write_shard(tmp_path / "t_train_000001.bin", corpus(rng.integers(1, 900, 60), seed=6))
    args = loader_args(tmp_path)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    loader = T.TrainLoader(args, env)
    loader.next_batch(0)
    loader.next_batch(1)
    state = loader.state_dict()
    expected = loader.next_batch(2)  # the first step of the second stage
    resumed = T.TrainLoader(args, env)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed.next_batch(2), expected))


def test_a_shard_too_small_for_one_step_is_a_clear_error(tmp_path):
    write_shard(tmp_path / "t_train_000001.bin", corpus([100] * 10))
    with pytest.raises(T.DataError, match="t_train_000001.bin: holds fewer tokens than one step needs"):
        T.TrainLoader(loader_args(tmp_path), T.DistEnv(0, 0, 1, torch.device("cpu")))


def test_synthetic_batches_are_packed_like_real_ones():
    args = T.parse_args(["--preset=smoke", "--synthetic=true"], False)
    schedule = T.Schedule(args)
    loader = T.SyntheticLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu")))
    for step in (0, 20):
        batch = loader.next_batch(step)
        assert len(batch) == schedule.micro_batches(step) == 4
        for inputs, targets in batch:
            assert inputs[0] == T.BOS_ID and len(inputs) == schedule.micro_tokens(step)
            bos = torch.nonzero(inputs == T.BOS_ID).flatten().tolist() + [len(inputs)]
            assert max(b - a for a, b in zip(bos, bos[1:])) <= schedule.stage(step).max_seq_len


# Record #92's schedule (its TrainingSchedule, TRAINING_STAGES and _ptp_w_at, read from its run log's source), written
# out by hand: stage ends 0, 320, 681, 1107 (1055 + 52 grown), 1174 and 1194; the split (untie) step 1174 | 1; the
# cooldown from int(1174 * 0.2) = 234 to 0.3; the prefix weight by stage 1's quarters of 361 steps.
RECORD92 = T.parse_args([f"--{k}={v}" for k, v in T.RECORD92_SCHEDULE.items()], True)


def test_record_92s_schedule():
    schedule = T.Schedule(RECORD92)
    assert [(s.start, s.end) for s in schedule.stages] == [(0, 320), (320, 681), (681, 1107), (1107, 1174),
                                                           (1174, 1194)]
    assert [s.batch_tokens for s in schedule.stages] == [131_072, 262_144, 393_216, 327_680, 131_072]
    assert [s.max_seq_len for s in schedule.stages] == [896, 2048, 3072, 3072, 3072]
    assert [s.windows for s in schedule.stages] == [(1, 3), (3, 7), (5, 11), (5, 11), (6, 13)]
    assert schedule.final_val_windows == (6, 20)
    assert schedule.untie_step == 1175 and schedule.cooldown_start == 234
    taper = 1.73 * (20 / 24) ** 0.5
    assert [schedule.lr(s) for s in (0, 234)] == [1.0, 1.0]
    assert schedule.lr(319) == pytest.approx(1.0 * (1 - 85 / 940) + 0.3 * 85 / 940, rel=1e-15)
    assert schedule.lr(320) == pytest.approx(1.52 * (1 - 86 / 940) + 0.3 * 86 / 940, rel=1e-15)
    assert schedule.lr(700) == pytest.approx(1.73 * (1 - 466 / 940) + 0.3 * 466 / 940, rel=1e-15)
    assert schedule.lr(1107) == pytest.approx(taper * (1 - 873 / 940) + 0.3 * 873 / 940, rel=1e-15)
    assert [schedule.lr(s) for s in (1174, 1193)] == [0.3, 0.3]
    # 0.25 through stage 0; stage 1's quarters: steps 320-410, 411-500, 501-590, 591-680
    quarters = {0: 0.25, 319: 0.25, 320: 0.2, 410: 0.2, 411: 0.15, 500: 0.15, 501: 0.1, 590: 0.1, 591: 0.05, 680: 0.05}
    assert {s: schedule.prefix_weight(s) for s in quarters} == quarters
    assert all(schedule.prefix_weight(s) is None for s in (681, 1107, 1174, 1194))
    assert [schedule.mtp_weights(s) for s in (0, 320, 681, 1107, 1193)] == [
        (1, 0.5, 0.25), (1, 0.5), (1,), (1,), (1,)]
    assert sum(schedule.stage(s).batch_tokens for s in range(1194)) == 328_663_040


@pytest.mark.parametrize("flag", ["--stage_fractions=0.5,0.5", "--stage_fractions=0.5,0.25,0.2",
                                  "--stage_fractions=1,0,0", "--grown_stage=3", "--grown_steps=1270",
                                  "--stage_prefix_weights=0.25,0.2|x,0", "--stage_prefix_weights=0.25,0.2|0.1>0,0"])
def test_bad_stage_shares_growth_and_parts_are_refused(flag):
    with pytest.raises(T.ConfigError, match=flag.split("=")[0]):
        T.validate_config(T.parse_args(["--preset=record89", flag], True))


def test_the_speedrun_preset_is_record_92s_algorithm():
    speedrun = T.parse_args(["--preset=speedrun"], True)
    assert {name: getattr(speedrun, name) for name in T.RECORD92} == T.RECORD92
    assert T.Schedule(speedrun).total == 1194 and T.RECIPES["speedrun"].startswith("record #92")
    assert T.dataclasses.replace(T.parse_args(["--preset=record89"], True), preset="speedrun") == \
        T.parse_args(["--preset=speedrun", *T.flags_of({f.name: f.default for f in T.dataclasses.fields(T.Hyperparameters)
                                                         if f.name in T.RECORD92})], True)
    assert T.RECIPES["record89"].startswith("record #89")


# -----------------------------------------------------------------------------
# Issue 53 row 9: --cooldown_frac=0 passed validation, then divided by zero at the first step of the extension
# (the log ended ZeroDivisionError). Every value a schedule flag's check admits gives a finite value at every step,
# or the check refuses it; the edges of the fractions and stages, each against its value written out.

def smoke_schedule(*flags: str) -> T.Schedule:
    return T.Schedule(T.parse_args([*SMOKE89, *flags], False))


def every_step_is_finite(schedule: T.Schedule):
    """Every number a step uses, at every step and at the final validation, is finite."""
    for step in range(schedule.total + 1):
        values = [schedule.lr(step), schedule.momentum(step), *schedule.mtp_weights(step),
                  schedule.prefix_weight(step) or 0.0, schedule.stage_fraction(step), schedule.micro_tokens(step),
                  *schedule.windows(step), *schedule.windows(step, final_validation=True)]
        assert all(math.isfinite(v) for v in values), (step, values)


# The smoke preset: 27 scheduled steps (stages 0-9, 9-18, 18-27), 3 extension steps, lr 1, 1.52, 1.73, cooldown from
# int(27 * 0.7) = 18 to 0.15.
EDGES = [
    # (id, flags, {step: the lr multiplier there})
    ("the issue's: no cooldown", ["--cooldown_frac=0"], {0: 1.0, 17: 1.52, 18: 1.73, 26: 1.73, 27: 0.15, 29: 0.15}),
    ("a cooldown that rounds to no steps", ["--cooldown_frac=1e-20"], {26: 1.73, 27: 0.15}),
    ("a cooldown of one step", ["--cooldown_frac=0.03"], {25: 1.73, 26: 1.73, 27: 0.15}),
    ("the whole schedule", ["--cooldown_frac=1"], {0: 1.0, 9: 1.52 * (1 - 9 / 27) + 0.15 * 9 / 27, 27: 0.15}),
    ("to zero", ["--final_lr_frac=0", "--cooldown_frac=0"], {26: 1.73, 27: 0.0}),
    ("above the stages", ["--final_lr_frac=1e6", "--cooldown_frac=1"], {0: 1.0, 27: 1e6}),
    ("one-step stages, no extension", ["--num_iterations=3", "--extension_steps=0", "--cooldown_frac=0"],
     {0: 1.0, 1: 1.52, 2: 1.73}),
    ("fewer steps than stages", ["--num_iterations=2", "--extension_steps=1", "--cooldown_frac=0"], {0: 1.52, 1: 0.15}),
    ("no momentum warmup or cooldown", ["--muon_momentum_warmup=0", "--muon_momentum_cooldown=0"], {}),
]


@pytest.mark.parametrize("flags, lrs", [c[1:] for c in EDGES], ids=[c[0] for c in EDGES])
def test_the_schedule_s_edges_give_finite_values_at_every_step(flags, lrs):
    schedule = smoke_schedule(*flags)
    every_step_is_finite(schedule)
    assert {step: schedule.lr(step) for step in lrs} == pytest.approx(lrs, rel=1e-12)


fractions = st.sampled_from([0.0, 1.0, 5e-324, 1e-20, 1 - 1e-16, 0.5]) | st.floats(min_value=0, max_value=1)
multipliers = st.sampled_from([0.0, 1.0, 1e-300, 1e300]) | st.floats(min_value=0, max_value=1e6)


@settings(max_examples=60)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(1, 4), fractions, multipliers,
       st.lists(multipliers, min_size=8, max_size=8), st.tuples(*[st.integers(0, 50)] * 3), st.integers(1, 4),
       st.integers(0, 5))
def test_every_admitted_schedule_gives_finite_values_at_every_step(iterations, extension, stages, cooldown, final,
                                                                   weights, steps, adam_every, untie):
    """Schedules of any length, stage count, cooldown and final fraction (the edges 0, 1 and the smallest floats
    among them), multipliers and moving weights from 0 to 1e300, momentum ramps of any length: parse_args refuses
    the schedule, or every step's numbers are finite."""
    flags = [f"--num_iterations={iterations}", f"--extension_steps={extension}", f"--cooldown_frac={cooldown!r}",
             f"--final_lr_frac={final!r}", f"--muon_momentum_warmup={steps[0]}",
             f"--muon_momentum_cooldown={steps[1]}", f"--val_loss_every={steps[2]}", f"--adam_every={adam_every}",
             f"--untie_stage={untie}", "--micro_batches=1", "--stage_batch_tokens=" + ",".join(["256"] * stages),
             "--stage_max_seq_len=" + ",".join(["64"] * stages), "--stage_windows=" + ",".join(["1:2"] * stages),
             "--stage_lr=" + ",".join(map(repr, weights[:stages])),
             "--stage_mtp_weights=" + "/".join(f"{weights[i]!r},1>{weights[i + 4]!r},0" for i in range(stages)),
             "--stage_prefix_weights=" + ",".join(f"{weights[i + 4]!r}>{weights[i]!r}" for i in range(stages))]
    try:
        schedule = smoke_schedule(*flags)
    except T.ConfigError:
        return
    every_step_is_finite(schedule)
    T.warmup_steps(T.parse_args([*SMOKE89, *flags], False), schedule)


@pytest.mark.slow  # trains the two steps of test_bad_input.py's TINY run
def test_a_run_without_a_cooldown_runs_to_the_end(tmp_path):
    """The issue's input end to end: step 1 is the extension's, where --cooldown_frac=0 divided 0 by 0."""
    proc = run_main("--preset=smoke", "--num_iterations=2", "--extension_steps=1", "--val_loss_every=0",
                    "--stage_batch_tokens=256,256,256", "--micro_batches=1", "--val_tokens=1024", "--warmup_steps=0",
                    "--cooldown_frac=0", f"--logs_dir={tmp_path}", "--run_id=flat")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "flat.txt").read_text().splitlines()[-1].startswith("summary: final_val_loss:")

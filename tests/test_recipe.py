"""Record #44's schedules and data packing, checked against the record's values and definitions."""

import numpy as np
import pytest
import torch

import train_gpt as T

SPEEDRUN = T.parse_args(["--preset=speedrun"], True)


# --- schedules: the record's values at the listed steps ---------------------------------------

@pytest.mark.parametrize("step,expected", [
    (0, 1.0), (1102, 1.0),  # flat until half of the 2,205 scheduled steps
    (1103, 0.9995918367346939),  # x = 1103/2205 >= 0.5: w = (1 - x) / 0.5, lr = w + (1 - w) * 0.1
    (1654, 0.5497959183673469),
    (2204, 0.10081632653061224),
    (2205, 0.10018), (2244, 0.10018),  # the extension: x capped at 0.9999
])
def test_lr_schedule(step, expected):
    assert T.lr_multiplier(step, SPEEDRUN) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step,expected", [
    (0, 0.85), (150, 0.90), (299, 0.95 - 0.1 / 300), (300, 0.95), (2195, 0.95),  # warmup over 300 steps
    (2220, 0.90), (2244, 0.852),  # back down over the last 50 of 2,245
])
def test_muon_momentum_schedule(step, expected):
    assert T.muon_momentum(step, SPEEDRUN) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("step,expected", [
    (0, (1, 3)), (734, (1, 3)), (735, (3, 7)), (1469, (3, 7)), (1470, (5, 11)), (2204, (5, 11)),
    (2205, (6, 13)), (2244, (6, 13)),
])
def test_window_schedule(step, expected):
    assert T.attention_windows(step, SPEEDRUN) == expected


def test_final_validation_windows_and_window_sizes_in_tokens():
    assert T.attention_windows(2245, SPEEDRUN, final_validation=True) == (6, 20)
    windows = T.layer_windows(SPEEDRUN, (6, 20))
    assert windows[4] == windows[11] == 20 * 128 and windows[1] == 6 * 128 and windows[0] is windows[7] is None
    # every window size the run uses, and nothing else
    used = {T.attention_windows(s, SPEEDRUN) for s in range(SPEEDRUN.num_iterations)}
    assert used == {(1, 3), (3, 7), (5, 11), (6, 13)}


def test_adam_steps_every_second_step():
    assert [T.adam_steps_at(s, SPEEDRUN) for s in range(6)] == [False, True, False, True, False, True]


# --- data packing -----------------------------------------------------------------------------

def corpus(doc_lengths, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[T.BOS_ID], rng.integers(0, T.BOS_ID, n - 1)]) for n in doc_lengths]
    return np.concatenate(docs).astype(np.uint16)


def test_every_training_sequence_starts_with_bos_and_none_is_longer_than_the_cap():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 5000, 400)  # many longer than 2,048, some of one token
    lengths[:3] = [1, 7000, 1]
    tokens = corpus(lengths)
    pieces = T.DocumentPieces(tokens, max_len=2048)
    step, first = pieces.take_step(0, num_micro=4, micro_tokens=8192)
    doc_starts = np.flatnonzero(tokens == T.BOS_ID)
    taken = 0
    for chunk in step:
        assert len(chunk) == 8193 and chunk[0] == T.BOS_ID
        bos = np.flatnonzero(chunk == T.BOS_ID)
        sequences = np.diff(np.append(bos, len(chunk)))
        assert sequences.max() <= 2048
        # each piece is the first tokens of the next document, in order
        for start, n in zip(bos, sequences):
            doc = doc_starts[taken]
            assert np.array_equal(chunk[start:start + n], tokens[doc:doc + n])
            assert n == min(2048, lengths[taken]) or start + n == len(chunk)  # only the last piece is cut short
            taken += 1
    assert first == taken  # the next step starts at the next document: a cut document's rest is skipped


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [T.SHARD_MAGIC, T.SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def loader_args(tmp_path, **overrides):
    # repeat_data: these tiny shards supply fewer steps than the smoke preset's 30, which is refused otherwise
    values = dict(train_files=f"{tmp_path}/t_train_*.bin", batch_tokens=2048, micro_batch_tokens=256,
                  train_max_seq_len=300, repeat_data="true")
    values.update(overrides)
    return T.parse_args(["--preset=smoke", *(f"--{k}={v}" for k, v in values.items())], False)


def test_world_sizes_see_the_same_micro_batches_and_steps_never_straddle_shards(tmp_path):
    rng = np.random.default_rng(2)
    write_shard(tmp_path / "t_train_000001.bin", corpus(rng.integers(1, 900, 30), seed=3))
    write_shard(tmp_path / "t_train_000002.bin", corpus(rng.integers(1, 900, 40), seed=4))
    args = loader_args(tmp_path)

    def steps(world_size, count=5):
        loaders = [T.TrainLoader(args, T.DistEnv(r, r, world_size, torch.device("cpu"))) for r in range(world_size)]
        out = []
        for _ in range(count):
            per_rank = [loader.next_batch() for loader in loaders]
            # rank r holds micro-batches r, r + world_size, ...
            micro = [per_rank[m % world_size][m // world_size] for m in range(8)]
            out.append([torch.cat([x, y[-1:]]) for x, y in micro])
        return out, loaders[0]

    reference, loader = steps(1)
    for world_size in (2, 4, 8):
        other, _ = steps(world_size)
        assert all(torch.equal(a, b) for sa, sb in zip(reference, other) for a, b in zip(sa, sb)), world_size
    # shard 1 (about 13k tokens) holds 5 steps of 8 x 257 tokens at most: the loader moved on to shard 2,
    # and started that step at shard 2's first document
    assert loader.file_index == 1
    shard2 = T.read_shard(tmp_path / "t_train_000002.bin")
    step_in_shard2 = next(i for i, s in enumerate(reference) if torch.equal(s[0][:50], torch.from_numpy(
        shard2[:50].astype(np.int64))))
    assert step_in_shard2 > 0


def test_train_loader_resumes_where_it_stopped(tmp_path):
    rng = np.random.default_rng(5)
    write_shard(tmp_path / "t_train_000001.bin", corpus(rng.integers(1, 900, 60), seed=6))
    args = loader_args(tmp_path)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    loader = T.TrainLoader(args, env)
    loader.next_batch()
    state = loader.state_dict()
    expected = loader.next_batch()
    resumed = T.TrainLoader(args, env)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed.next_batch(), expected))


def test_a_shard_too_small_for_one_step_is_a_clear_error(tmp_path):
    write_shard(tmp_path / "t_train_000001.bin", corpus([100] * 10))
    with pytest.raises(T.DataError, match="t_train_000001.bin: holds fewer tokens than one step needs"):
        T.TrainLoader(loader_args(tmp_path), T.DistEnv(0, 0, 1, torch.device("cpu")))


def test_synthetic_batches_are_packed_like_real_ones():
    args = T.parse_args(["--preset=smoke", "--synthetic=true"], False)
    batch = T.SyntheticLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu"))).next_batch()
    assert len(batch) == args.batch_tokens // args.micro_batch_tokens
    for inputs, targets in batch:
        assert inputs[0] == T.BOS_ID and len(inputs) == args.micro_batch_tokens
        bos = torch.nonzero(inputs == T.BOS_ID).flatten().tolist() + [len(inputs)]
        assert max(b - a for a, b in zip(bos, bos[1:])) <= args.train_max_seq_len


def test_speedrun_preset_holds_record_44s_values():
    a = SPEEDRUN
    assert (a.batch_tokens, a.micro_batch_tokens, a.train_max_seq_len) == (262_144, 32_768, 2048)
    assert (a.val_tokens, a.val_seq_len) == (10_485_760, 262_144)
    assert (a.num_iterations, a.extension_steps, a.cooldown_frac, a.final_lr_frac) == (2245, 40, 0.5, 0.1)
    assert (a.embed_lr, a.scalar_lr, a.head_lr) == (0.008 * 75, 0.008 * 5, 0.008)
    assert (a.adam_beta1, a.adam_beta2, a.adam_eps, a.adam_every) == (0.65, 0.95, 1e-8, 2)
    assert (a.muon_lr, a.muon_beta2, a.muon_weight_decay) == (0.03, 0.95, 1.2)
    assert (a.muon_momentum_start, a.muon_momentum_end, a.muon_momentum_warmup, a.muon_momentum_cooldown) == (
        0.85, 0.95, 300, 50)
    assert (a.window_block, a.window_schedule, a.window_extension, a.window_final_val) == (128, "3,7,11", 13, 20)
    assert (a.logit_cap, a.logit_cap_width, T.ATTN_SCALE, T.SKIP_GATE_INIT, T.BACKOUT_INIT) == (30, 7.5, 0.1, -1.5, 0.5)

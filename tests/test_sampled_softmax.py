"""Record #92's sampled softmax (--stage_softmax_candidates): the candidate sets against hand-worked ones, the
full-candidate limit against the full softmax (model and FP8 head), the lm_head's gradient outside the set, the
count per step, the flag's refusals, the streams of micro-batches at world sizes 1 and 2, and the streams'
offsets across a checkpoint resume and the untimed warmup's restore."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import train_gpt as T
from conftest import SMOKE89  # noqa: E402

CPU = T.DistEnv(0, 0, 1, torch.device("cpu"))
# The smoke model on steps of 4 micro-batches of 64 tokens, sampling 512 of the 50,304 classes
SAMPLED = [*SMOKE89, "--num_iterations=6", "--extension_steps=1", "--val_loss_every=0", "--val_tokens=1024",
           "--stage_batch_tokens=256,256,256", "--micro_batches=4", "--warmup_steps=0",
           "--stage_softmax_candidates=512,256|512,1024"]


def sweep(vocab: int) -> np.ndarray:
    return np.tile(T.CANDIDATE_STRIDE * np.arange(vocab, dtype=np.int64) % vocab, 2)


# --- the candidate sets ---------------------------------------------------------------------------------------------

def test_a_small_candidate_set_worked_by_hand():
    # V = 512: the sweep steps by 20011 mod 512 = 43: 0, 43, 86, 129, 172, 215, 258, 301, 344, 387, 430, 473, 4, 47,
    # 90, ... The targets 86 (three times), 301 and 7 are U = 3 classes; P = 16 needs 13 negatives, from a window of
    # floor(13 * 1.7) + 256 = 278 classes: the first 13 of it that are no target. 7's prefix target 4 is among them,
    # 86's prefix 5 is not (its term is dropped), 301 has none.
    targets = np.array([86, 86, 301, 7, 86], dtype=np.uint16)
    prefix = np.array([5, 5, -1, 4, 5])
    columns, positions, prefix_positions, offset = T.candidate_set(targets, 16, sweep(512), 0, prefix)
    negatives = [0, 43, 129, 172, 215, 258, 344, 387, 430, 473, 4, 47, 90]
    assert columns.tolist() == sorted([7, 86, 301, *negatives])
    assert columns.tolist() == [0, 4, 7, 43, 47, 86, 90, 129, 172, 215, 258, 301, 344, 387, 430, 473]
    assert positions.tolist() == [5, 5, 11, 2, 5] and prefix_positions.tolist() == [-1, -1, -1, 1, -1]
    assert offset == 278
    # the next set of the stream starts where this window ended: at sweep[278] = 278 * 43 mod 512 = 178
    columns, _, none, offset = T.candidate_set(targets, 16, sweep(512), offset)
    assert columns[columns != 86].tolist()[:3] != negatives[:3] and none is None and offset == 556 % 512
    assert 178 in columns
    # U = P: no negatives, and the stream stays
    columns, positions, _, offset = T.candidate_set(np.arange(16, dtype=np.uint16)[::-1].copy(), 16, sweep(512), 9)
    assert columns.tolist() == list(range(16)) and positions.tolist() == list(range(15, -1, -1)) and offset == 9
    with pytest.raises(T.TrainingError, match="17 distinct targets, more than the 16 candidates"):
        T.candidate_set(np.arange(17), 16, sweep(512), 0)


def test_targets_that_crowd_the_window_take_negatives_at_an_even_step_over_the_free_classes():
    # The targets are the whole window of P - U = 10 negatives: the first 273 classes of the sweep (floor(17) + 256).
    # None of the window is free, so the 10 negatives are every 23rd class (239 free // 10) of the 239 free ones.
    window = sweep(512)[:273]
    targets = np.concatenate([window, window[:50]]).astype(np.uint16)
    columns, positions, _, offset = T.candidate_set(targets, 283, sweep(512), 0)
    free = sorted(set(range(512)) - set(window.tolist()))
    assert len(free) == 239
    assert columns.tolist() == sorted([*window.tolist(), *free[0:230:23]])
    assert offset == 273 and (columns[positions] == targets).all()
    # a window partly taken by targets (fewer than 10 free in it) also falls back
    crowded = np.concatenate([window[:268], sweep(512)[300:305]]).astype(np.uint16)
    columns, *_ = T.candidate_set(crowded, 283, sweep(512), 0)
    free = sorted(set(range(512)) - set(crowded.tolist()))
    assert columns.tolist() == sorted([*crowded.tolist(), *free[::len(free) // 10][:10]])


# --- the loss -------------------------------------------------------------------------------------------------------

def smoke_model():
    args = T.parse_args([*SMOKE89, "--stage_batch_tokens=256,256,256"], False)
    torch.manual_seed(0)
    return T.GPT(args), args


def losses_and_gradients(model, inputs, targets, masks, candidates):
    model.zero_grad(set_to_none=True)
    mtp, prefix = torch.tensor([1.0, 0.5]), torch.tensor([0.25])
    loss = model(inputs, targets, masks, mtp, loss_scale=0.5, prefix_weight=prefix, candidates=candidates)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_whole_vocabulary_as_candidates_is_the_full_softmax_exactly_and_a_subset_trains_its_columns_only():
    model, args = smoke_model()
    tokens = torch.from_numpy(T.read_shard(T.REPO_DIR / "data/shakespeare/shakespeare_train_000001.bin")[:65]
                              .astype(np.int64))
    inputs, targets = tokens[:-1], tokens[1:]
    masks = T.build_masks(inputs, model.plans, (1, 2), args.window_block, False, model.mask_parts)
    vocab, prefix_table = model.vocab, model.prefix_table.numpy()
    full = losses_and_gradients(model, inputs, targets, masks, None)
    found = T.candidate_set(targets.numpy(), vocab, sweep(vocab), 123, prefix_table[targets.numpy()])
    assert found[0].tolist() == list(range(vocab))
    whole = losses_and_gradients(model, inputs, targets, masks, T.Candidates(*found[:3]).to_device(CPU.device))
    assert torch.equal(whole[0], full[0]) and whole[1].keys() == full[1].keys()
    assert all(torch.equal(whole[1][name], g) for name, g in full[1].items())
    # 512 candidates: the lm_head's gradient lives in their columns, every one of which has one
    found = T.candidate_set(targets.numpy(), 512, sweep(vocab), 123, prefix_table[targets.numpy()])
    some = losses_and_gradients(model, inputs, targets, masks, T.Candidates(*found[:3]).to_device(CPU.device))
    outside = np.setdiff1d(np.arange(vocab), found[0])
    assert not some[1]["lm_head"][:, outside].any() and some[1]["lm_head"][:, found[0]].abs().sum(0).min() > 0
    assert some[0] < full[0]  # fewer classes share the softmax


def test_fp8_head_over_every_column_equals_the_full_fp8_head():
    # the FP8 copies' candidate columns, taken as bytes, are the copies of the columns: over all of them, the
    # sampled head is the full one bit for bit
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(32, 16, generator=g), torch.randn(16, 128, generator=g) * 0.3
    targets, prefix = torch.randint(0, 128, (32,), generator=g), torch.randint(-1, 128, (32,), generator=g)
    mtp, pw = torch.tensor([1.0, 0.5, 0.25]), torch.tensor([0.25])
    fp8 = T.head_fp8(w)

    def head(weight_and_copies):
        weight = weight_and_copies[0]
        return T.head_loss(x, weight, targets, mtp, (23.0, 5.0, 7.5), 0.5, 16, weight_and_copies[1], (prefix, pw))
    full = head((w, fp8))
    every = head(T.candidate_columns(w, fp8, torch.arange(128)))
    assert all(torch.equal(a, b) for a, b in zip(full, every))
    some = torch.tensor([3, 9, 40, 127])
    weight, copies = T.candidate_columns(w, fp8, some)
    assert torch.equal(copies[0].view(torch.uint8), T.head_fp8(weight)[0].view(torch.uint8))
    assert torch.equal(copies[1].view(torch.uint8), T.head_fp8(weight)[1].view(torch.uint8))


# --- the schedule and the flag --------------------------------------------------------------------------------------

def test_candidate_counts_follow_their_stages_in_equal_parts_and_the_warmup_compiles_each():
    args = T.parse_args([*SMOKE89, "--num_iterations=33", "--extension_steps=3",
                         "--stage_softmax_candidates=10240,10240,14336|14336|24576"], False)
    schedule = T.Schedule(args)
    assert [(s.start, s.end) for s in schedule.stages] == [(0, 10), (10, 20), (20, 30), (30, 33)]
    counts = [schedule.candidates(step) for step in range(34)]
    assert counts == [10240] * 20 + [14336] * 7 + [24576] * 7  # floor(3 (step - 20) / 10): 20..26, then 27..
    assert schedule.sampled and not T.Schedule(T.parse_args(["--preset=record89"], False)).sampled
    assert T.warmup_steps(dataclasses.replace(args, warmup_steps=2), schedule) == [0, 1, 10, 11, 20, 21, 27, 28, 30,
                                                                                     31]
    one = T.Schedule(T.parse_args([*SMOKE89, "--num_iterations=33", "--stage_softmax_candidates=2048"], False))
    assert {one.candidates(step) for step in range(34)} == {2048}
    for flag, message in (("1024,1024", "one entry for every stage, or one per stage"),
                          ("1024|,0,0", "expected counts"), ("1024>0,0,0", "expected counts"),
                          ("-16,0,0", "must be 0"), ("1000,0,0", "a multiple of 16")):
        with pytest.raises(T.ConfigError, match=message):
            T.parse_args([f"--stage_softmax_candidates={flag}"], False)
    # a count of the whole padded vocabulary or more is the full softmax
    whole = T.Schedule(T.parse_args([*SMOKE89, "--stage_softmax_candidates=50304,50432,2048"], False))
    assert [whole.candidates(s) for s in (0, 10, 20)] == [0, 0, 2048]


def test_the_memory_model_counts_the_candidates_logits(monkeypatch):
    args = T.parse_args([*SAMPLED, "--stage_softmax_candidates=0,512,0"], False)
    counted, forward = [], T.MemoryModel._saved_by_forward
    monkeypatch.setattr(T.MemoryModel, "_saved_by_forward", lambda self, micro_tokens, windows, columns: counted.append(
        (micro_tokens, columns)) or forward(self, micro_tokens, windows, columns))
    rows = T.MemoryModel(args, 1, torch.device("cpu"), T.Numerics(), "sdpa").phases({1}, validation=False)
    assert counted == [(64, 512)]  # the forward ran over 512 candidates: it keeps the lm_head's (dim, P) gradient
    assert rows["stage 2"]["loss chunk"] == 64 * 512 * 3 * 4
    assert T.loss_chunk_bytes(args, 64, "cpu", "fp32") == 64 * 50304 * 3 * 4
    gpu = dataclasses.replace(args, compile=True)
    assert T.loss_chunk_bytes(gpu, 8192, "cuda", "fp8", 10240) * 50304 == T.loss_chunk_bytes(gpu, 8192, "cuda", "fp8") \
        * 10240


# --- the streams ----------------------------------------------------------------------------------------------------

def sets_of(batch) -> list:
    return [tuple(None if t is None else t.tolist() for t in c) for c in batch.candidates]


def test_micro_batch_g_gets_the_same_candidates_at_world_sizes_1_and_2():
    args = T.parse_args(SAMPLED, False)
    one = T.TrainLoader(args, CPU)
    two = [T.TrainLoader(args, T.DistEnv(rank, rank, 2, torch.device("cpu"))) for rank in (0, 1)]
    assert one.sampler.offsets == [50304 * g // 4 for g in range(4)] == two[0].sampler.offsets
    for step in range(args.num_iterations):
        alone = sets_of(one.next_batch(step))
        halves = [sets_of(loader.next_batch(step)) for loader in two]
        assert alone == [halves[g % 2][g // 2] for g in range(4)], step
        assert len({tuple(c[0]) for c in alone}) == 4  # each stream its own negatives
        assert all(len(c[0]) == one.schedule.candidates(step) for c in alone)
    merged = T.loader_state_of_ranks([loader.state_dict() for loader in two])
    assert merged == one.state_dict() != two[0].state_dict()


def test_the_candidate_streams_continue_across_a_checkpoint_resume_and_the_warmups_restore(tmp_path):
    args = T.parse_args([*SAMPLED, f"--checkpoint_dir={tmp_path}"], False)
    model = T.build_model(args, CPU)
    loader = T.TrainLoader(args, CPU)
    before = loader.state_dict()
    for step in range(3):
        loader.next_batch(step)
    loader.load_state_dict(before)  # what untimed_warmup and Performance.measure do
    assert loader.state_dict() == before
    for step in range(3):
        loader.next_batch(step)
    path = T.save_checkpoint(3, 1.0, model, T.build_optimizers(model, args), loader, args, CPU,
                             (T.REPO_DIR / "train_gpt.py").read_text(), "sampled")
    assert json.loads((path / "meta.json").read_text())["loader"]["candidate_offsets"] == loader.sampler.offsets
    expected = sets_of(loader.next_batch(3))

    resumed = T.TrainLoader(args, CPU)
    resume = T.check_checkpoint(path, args, CPU, (T.REPO_DIR / "train_gpt.py").read_text())
    T.check_resume_shards(resume, resumed, args)
    T.load_checkpoint(resume, model, T.build_optimizers(model, args), resumed, CPU)
    assert sets_of(resumed.next_batch(3)) == expected
    # offsets that are no positions in the vocabulary are refused before anything is made
    bad = dataclasses.replace(resume, meta=dataclasses.replace(resume.meta, loader={
        **resume.meta.loader, "candidate_offsets": [0, 1, 2, 50304]}))
    with pytest.raises(T.TrainingError, match="candidate streams' offsets are .* not 4 positions"):
        T.check_resume_shards(bad, T.TrainLoader(args, CPU), args)


def test_synthetic_tokens_leave_record_92s_candidate_sets_web_like_headroom():
    """The synthetic loader's tokens (benchmarks, the preflight) hold as many distinct ids per micro-batch as web
    text: record #92's candidate counts keep 30-70% of their room, where uniform ids would overflow them."""
    rng = np.random.default_rng(1)
    for tokens, candidates in ((16_384, 10_240), (32_768, 10_240), (49_152, 14_336)):
        distinct = len(np.unique(T.synthetic_tokens(rng, tokens)))
        assert 0.3 <= 1 - distinct / candidates <= 0.7, (tokens, distinct)
    assert T.synthetic_tokens(rng, 100_000).max() < T.BOS_ID

"""The memory model (train_gpt.py's MemoryModel, tools/estimate_memory.py's table): the parts of its table
that can be counted by hand from record #85's shapes, its predictions against real steps on this CPU, and
--micro_batches=auto and the start-up refusal under a memory limit the tests set."""

import sys
import zlib

import pytest
import torch

import train_gpt as T
from conftest import SMOKE89, REPO, in_process, one_line_error

sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402
import fake_cuda  # noqa: E402  (its table of GPUs; nothing is loaded)

GIB = 2 ** 30
D, VOCAB, BIGRAM = 768, 50304, 377280


@pytest.fixture(scope="module")
def tables():
    return {w: estimate_memory.estimate(["--preset=record89"], w) for w in (1, 8)}


def test_weights_gradients_and_optimizer_state_are_counted_right(tables):
    attention, mlp = 10 * 4 * D * D, 11 * 2 * 4 * D * D  # no attention in layer 6; qk+vo, fc+proj
    tables_bf16 = VOCAB * D * (1 + 1 + 5) + BIGRAM * D  # embed, lm_head, 5 value embeddings, bigram
    small_bf16 = 5 * 6 * 12 + 12 + 2 * 64 * D * 2 + 2 * 14 * 64 + 2 * 14 + 2 * 41 * 64 + 2 * 41  # gates, MUDD
    small_fp32 = 24 + 2 * 11 * 2 + 1  # scalars, residual and post lambdas, the MUDD gate's scale
    weights = 2 * (attention + mlp + tables_bf16 + small_bf16) + 4 * small_fp32
    adam_elements = tables_bf16 + small_bf16 + small_fp32
    # NorMuon per matrix: fp32 momentum, the bf16 weight's low mantissa (2 bytes), fp32 second moment per
    # index of the longer side. qk is 6 heads of (256, 768) in each of 10 layers, vo two (768, 768), fc and proj (3072, 768).
    units = [(256, D)] * 60 + [(D, D)] * 20 + [(4 * D, D)] * 22
    muon_state = sum(6 * r * c + 4 * max(r, c) for r, c in units)
    for world_size, table in tables.items():
        assert list(table) == ["stage 1", "stage 2", "stage 3", "extension", "validation"]
        for phase, row in table.items():
            assert row["weights"] == weights
            assert row["gradients"] == (0 if phase == "validation" else weights)
        stage = table["stage 1"]
        # DistAdam: two fp32 moments of this rank's shard of every bucket (rounded up to the world size)
        assert 8 * adam_elements // world_size <= stage["DistAdam state"] <= 8 * adam_elements // world_size + 8 * 64 * world_size
        if world_size == 1:
            assert stage["matrix optimizer state"] == muon_state
            # no collectives at world size 1, but each shape's bf16 gradients stacked, and the largest stack's
            # update in flight (six fp32 copies of each matrix, its bf16 weights in and out)
            stacked = sum(2 * r * c for r, c in units)
            assert stage["optimizer-step buffers"] == stacked + 22 * 4 * D * D * (6 * 4 + 2 * 2)
    one, eight = tables[1]["stage 1"], tables[8]["stage 1"]
    matrices = "matrix optimizer state"
    assert 7 * eight[matrices] < one[matrices] < 9 * eight[matrices]  # each rank its share
    assert eight["optimizer-step buffers"] > 0


def test_activations_grow_with_each_stage_micro_batch(tables):
    # 16,384, 32,768 and 49,152 tokens per micro-batch: the saved tensors grow in proportion (to within the
    # masks' and the windows' share), and the extension trains at stage 3's size.
    for table in tables.values():
        saved = [table[f"stage {i}"]["saved activations"] for i in (1, 2, 3)]
        assert 1.9 < saved[1] / saved[0] < 2.1 and 1.45 < saved[2] / saved[1] < 1.55
        assert table["extension"]["saved activations"] == saved[2]
        # one chunk of 8,192 rows of logits, never the full (49,152 x 50,304) logits: bf16 logits, the FP8
        # gradient and three fp32 passes of the compiled chunk (the preflight's measure on the fake H100); and
        # the e5m2 gradient of all 49,152 rows, transposed, for the lm_head's one weight-gradient matmul
        assert table["stage 3"]["loss chunk"] == 8192 * VOCAB * (2 + 1 + 3 * 4) + 49152 * VOCAB
        assert table["validation"]["forward's largest live tensors"] > GIB  # one 262,144-token sequence


def test_the_command_prints_a_table_that_fits_an_h100():
    proc = in_process(estimate_memory.main, "--world_sizes", "8")  # record #92's speedrun: 4 stages, a taper
    assert proc.returncode == 0, proc.stderr
    peak = next(line for line in proc.stdout.splitlines() if line.startswith("| peak |"))
    values = [float(v) for v in peak.strip("|").split("|")[1:]]
    assert len(values) == 6 and all(1 < v < 79.6 for v in values)


def test_estimate_memory_and_the_trainer_fit_the_same_budget():
    # tools/estimate_memory.py (and so the preflight's advice) once fitted the card and ignored
    # --memory_limit_gib after `--`: auto "chose" 2,4,4 where the trainer chooses 32,64,96. Both now ask
    # train_gpt.card_memory.
    limited = T.parse_args(["--preset=record89", "--memory_limit_gib=20"], True)
    assert estimate_memory.card_budget(limited, fake_cuda.H100) == T.within_margin(*T.memory_budget(limited, CPU)) \
        == (int(17 * GIB), "17.00 GiB per rank (85% of the 20.00 GiB of --memory_limit_gib=20)")
    plain = T.parse_args(["--preset=record89"], True)
    assert estimate_memory.card_budget(plain, fake_cuda.GPUS['rtx4090'])[1] == \
        "20.39 GiB per rank (85% of the 23.99 GiB of an RTX 4090)"
    # a limit can only lower what a run may use: above the card it cannot be meant
    with pytest.raises(T.ConfigError, match=r"--memory_limit_gib=40: more than the 23.99 GiB of an RTX 4090; the "
                                            r"limit can only lower what a run may use"):
        estimate_memory.card_budget(T.parse_args(["--memory_limit_gib=40"], True), fake_cuda.GPUS['rtx4090'])


@pytest.mark.parametrize("flags, message", [
    (["--", "--memory_limit_gib=1e300"], "error: --memory_limit_gib=1e+300: must be a number of GiB from 0"),
    (["--gpu=rtx4090", "--", "--memory_limit_gib=30"], "error: --memory_limit_gib=30: more than the 23.99 GiB of an "
                                                       "RTX 4090"),
    (["--world_sizes", "3"], "error: world size 3 cannot split"),
    (["--world_sizes", "0"], "error: --world_sizes: 0 is not a world size (at least 1)"),
    (["--world_sizes", "-8"], "error: --world_sizes: -8 is not a world size (at least 1)"),
])
def test_world_sizes_that_cannot_run_are_one_line(flags, message):
    bad = in_process(estimate_memory.main, *flags)
    assert bad.returncode == 2 and bad.stderr.startswith(message) and bad.stderr.count("\n") == 1, bad.stderr


# -----------------------------------------------------------------------------
# The trainer's memory model (train_gpt.MemoryModel) against real steps, and --micro_batches=auto, on CPU

CPU = torch.device("cpu")


def smoke_args(*flags):
    return T.parse_args([*SMOKE89, *flags], False)


@pytest.mark.slow  # real forward and backward passes of the smoke model (7 s)
def test_the_memory_model_predicts_real_cpu_steps_and_validation():
    # Real tensors on this CPU, followed op by op: a micro-batch's forward and backward from the second one
    # of a step on (the gradients of the first exist), at sizes where the loss chunk, the saved activations
    # or the value embeddings' backward make the peak; and a validation forward pass.
    args = smoke_args()
    model = T.build_model(args, T.DistEnv(0, 0, 1, CPU))
    schedule = T.Schedule(args)
    memory = T.MemoryModel(args, 1, CPU, T.Numerics(), "sdpa")
    seen = []
    for micro_tokens, stage in ((768, 2), (64, 0)):
        windows = schedule.stages[stage].windows
        x = torch.randint(0, T.BOS_ID, (micro_tokens + 1,), generator=torch.Generator().manual_seed(micro_tokens))
        x[::300] = T.BOS_ID
        masks = T.build_masks(x[:-1], model.plans, windows, args.window_block, False)
        mtp = torch.tensor(schedule.stages[stage].mtp_start)
        prefix = schedule.prefix_weight(schedule.stages[stage].start)  # the smoke preset's first stage has one
        prefix = torch.tensor([prefix]) if prefix is not None else None
        model.zero_grad(set_to_none=True)
        model(x[:-1], x[1:], masks, mtp, loss_scale=1.0, prefix_weight=prefix).backward()
        live = T.LiveMemory("cpu")
        live.track([*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
        with live:
            live.start()
            base = live.live
            model(x[:-1], x[1:], masks, mtp, loss_scale=1.0, prefix_weight=prefix).backward()
        row = memory.training(micro_tokens, windows, 1)
        predicted = max(row["saved activations"] + row["loss chunk"] + row["block masks"], row["embedding backward"])
        seen.append((micro_tokens, live.peak - base, predicted))
    model.eval()
    x = torch.randint(0, T.BOS_ID, (args.val_seq_len + 1,), generator=torch.Generator().manual_seed(1))
    windows = schedule.final_val_windows
    live = T.LiveMemory("cpu")
    live.track([*model.parameters(), *model.buffers()])
    with torch.no_grad(), live:
        live.start()
        base = live.live
        model(x[:-1], x[1:], T.build_masks(x[:-1], model.plans, windows, args.window_block, False))
    row = memory.validation(args.val_seq_len, windows)
    seen.append(("validation", live.peak - base, row["forward's largest live tensors"] + row["block masks"]))
    print("memory model against this CPU (what, measured MiB, predicted MiB):",
          [(what, round(m / 2 ** 20, 1), round(p / 2 ** 20, 1)) for what, m, p in seen])
    for what, measured, predicted in seen:
        assert abs(predicted / measured - 1) < 0.05, seen
    # each kind of peak was met: the loss chunk, and the value embeddings' backward (two copies of the table)
    assert seen[0][1] > 4 * seen[1][1] and seen[1][2] == 2 * T.tensor_bytes([model.value_embeds])


@pytest.mark.slow  # real forward and backward passes (15 s)
def test_the_memory_model_predicts_record_92s_model_on_this_cpu():
    # Record #92's plan (narrow heads, MLP-only and removed layers, the parallel MLP, the grouped head mix) at a
    # test's size: a micro-batch's forward and backward, and a validation forward, against the count.
    args = T.parse_args(["--preset=record89", *T.flags_of(T.RECORD92_MODEL), "--model_dim=96", "--head_dim=16",
                         "--narrow_dim=8", "--rotary_dims=8", "--mlp_hidden=352", "--vocab_size=8000",
                         "--bigram_vocab_size=4000", "--val_seq_len=512", "--stage_batch_tokens=2048,2048,2048",
                         "--window_block=32", "--virtual_seq_cap=96", "--micro_batches=4"], False)
    model = T.build_model(args, T.DistEnv(0, 0, 1, CPU))
    memory = T.MemoryModel(args, 1, CPU, T.Numerics(), "sdpa")
    assert memory.weights == T.tensor_bytes(model.parameters())
    x = torch.randint(0, 7999, (513,), generator=torch.Generator().manual_seed(2))
    x[::200] = 7999
    windows, mtp, prefix = (1, 3), torch.tensor([1.0, 0.5, 0.25]), torch.tensor([0.25])
    masks = T.build_masks(x[:-1], model.plans, windows, args.window_block, False, cap=args.virtual_seq_cap)
    model(x[:-1], x[1:], masks, mtp, prefix_weight=prefix).backward()
    live = T.LiveMemory("cpu")
    live.track([*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
    with live:
        live.start()
        base = live.live
        model(x[:-1], x[1:], masks, mtp, prefix_weight=prefix).backward()
    row = memory.training(512, windows, 1)
    predicted = max(row["saved activations"] + row["loss chunk"] + row["block masks"], row["embedding backward"])
    assert abs(predicted / (live.peak - base) - 1) < 0.05, (predicted, live.peak - base)
    model.eval()
    live = T.LiveMemory("cpu")
    live.track([*model.parameters(), *model.buffers()])
    with torch.no_grad(), live:
        live.start()
        base = live.live
        model(x[:-1], x[1:], T.build_masks(x[:-1], model.plans, (6, 20), args.window_block, False))
    row = memory.validation(512, (6, 20))
    predicted = row["forward's largest live tensors"] + row["block masks"]
    assert abs(predicted / (live.peak - base) - 1) < 0.05, (predicted, live.peak - base)


def test_auto_choices_are_multiples_of_the_world_size_that_split_the_batch_into_blocks():
    assert T.micro_batch_choices(3072, 1, 64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert T.micro_batch_choices(3072, 2, 64) == [2, 4, 6, 8, 12, 16, 24, 48]
    # record #85's last stage: 3,072 blocks of 128 tokens, 2**10 * 3, over 8 ranks
    assert T.micro_batch_choices(393216, 8, 128) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                                     1536, 3072]
    assert T.micro_batch_choices(1024, 32, 64) == []
    with pytest.raises(T.ConfigError, match="stage 1's batch of 1,024 tokens cannot split over 32 ranks into "
                                            "micro-batches of a multiple of --window_block=64 tokens"):
        T.fit_micro_batches(smoke_args("--micro_batches=auto"), 32, CPU, T.Numerics(), "sdpa", 2 ** 40, "")


def test_the_last_stage_s_choices_also_split_the_extension_s_own_batch():
    # the smoke preset's third stage of 3,072 tokens and its extension of 1,024 (record #92's extension has a batch
    # of its own) at the third stage's count: 3 micro-batches would cut the extension into 341.3 tokens each
    args = T.parse_args(["--preset=smoke", "--micro_batches=auto"], False)
    assert T.stage_micro_batch_choices(args, 1) == [T.micro_batch_choices(1024, 1, 64),
                                                    T.micro_batch_choices(2048, 1, 64), [1, 2, 4, 8, 16]]
    # the speedrun's taper of 2,560 blocks of 128 tokens and its extension of 1,024: the multiples of 8 ranks that
    # divide both, gcd 512
    speedrun = T.parse_args(["--preset=speedrun"], False)
    assert T.stage_micro_batch_choices(speedrun, 8)[-1] == [8, 16, 32, 64, 128, 256, 512]
    # an extension of 17 blocks splits over no even count: the refusal names it beside the stage it trains with
    odd = T.parse_args(["--preset=smoke", "--micro_batches=auto", "--extension_batch_tokens=1088"], False)
    with pytest.raises(T.ConfigError, match=r"stage 3's batch of 3,072 tokens \(with the extension's batch of 1,088, "
                                            r"which trains at its count\) cannot split over 2 ranks"):
        T.fit_micro_batches(odd, 2, CPU, T.Numerics(), "sdpa", 2 ** 40, "")


def test_memory_models_of_one_configuration_share_their_forward_passes(monkeypatch):
    # World sizes and micro-batch counts change only what the optimizers hold and what a step sends: one forward
    # pass per micro-batch size serves every memory model of a configuration (tools/estimate_memory.py's world
    # sizes, the counts --micro_batches=auto tries), and its rows are those of a model counted on its own.
    args = smoke_args()

    def counted_alone(world_size):
        T.FORWARD_COUNTS.clear()
        return T.MemoryModel(args, world_size, CPU, T.Numerics(), "sdpa").phases({0})  # stage 1, the validation

    alone = {world_size: counted_alone(world_size) for world_size in (1, 2)}
    assert alone[1] != alone[2]  # the optimizer state and buffers differ
    T.FORWARD_COUNTS.clear()
    passes, forward = [], T.MemoryModel._saved_by_forward
    monkeypatch.setattr(T.MemoryModel, "_saved_by_forward",
                        lambda self, micro_tokens, windows, columns: passes.append(micro_tokens)
                        or forward(self, micro_tokens, windows, columns))
    shared = {world_size: T.MemoryModel(args, world_size, CPU, T.Numerics(), "sdpa").phases({0}) for world_size in (1, 2)}
    assert shared == alone
    assert passes == [T.Schedule(args).stages[0].micro_tokens]  # once for both


def stage_peak(micro_tokens: int, world_size: int = 1) -> int:
    """The smoke model's predicted training peak at a micro-batch of micro_tokens (stage 3's windows)."""
    args = smoke_args(f"--micro_batches={world_size},{world_size},{3072 // micro_tokens}")
    stage = T.Schedule(args).stages[2]
    model = T.MemoryModel(args, world_size, CPU, T.Numerics(), "sdpa")
    return model.training(micro_tokens, stage.windows, stage.micro_batches // world_size)["peak"]


@pytest.fixture(scope="module")
def limit_gib() -> float:
    """A limit whose budget (85%) admits the smoke model's micro-batches of 1,024 tokens and not 1,536."""
    fits, too_big = stage_peak(1024), stage_peak(1536)
    assert too_big > 1.2 * fits  # room on both sides of the budget for the other stages' windows
    return round((fits + too_big) / 2 / (1 - T.MEMORY_MARGIN) / GIB, 4)


def test_auto_takes_the_fewest_micro_batches_that_fit_at_any_world_size(limit_gib):
    # Micro-batches of at most 1,024 tokens fit: the fewest for batches of 1,024, 2,048 and 3,072 tokens are
    # 1, 2 and 3 at world size 1 (the run below); at world size 2 the counts are even (2, 2, 4), and 2 for
    # stage 3 would not fit.
    budget = int(limit_gib * GIB * (1 - T.MEMORY_MARGIN))
    counts, rows = T.fit_micro_batches(smoke_args("--micro_batches=auto"), 2, CPU, T.Numerics(), "sdpa", budget, "")
    assert counts == (2, 2, 4) and all(row["peak"] <= budget for row in rows.values())
    assert stage_peak(1536, world_size=2) > budget  # stage 3 at 2 micro-batches of 1,536 tokens


@pytest.mark.slow  # trains the smoke model four steps
def test_auto_micro_batches_under_a_memory_limit_train_and_an_explicit_count_over_it_is_refused(tmp_path, limit_gib):
    flags = [*SMOKE89, "--num_iterations=4", "--extension_steps=1", "--val_loss_every=0", "--val_tokens=1024",
             f"--memory_limit_gib={limit_gib}", f"--logs_dir={tmp_path}/logs"]
    proc = in_process(T.main, *flags, "--micro_batches=auto", "--run_id=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "logs/auto.txt").read_text()
    lines = [line for line in log.splitlines() if line.startswith("memory: ")]
    budget = limit_gib * (1 - T.MEMORY_MARGIN)
    assert lines[0] == (f"memory: the predicted peaks must fit {budget:.2f} GiB per rank (85% of the {limit_gib:.2f} "
                        f"GiB of --memory_limit_gib={limit_gib:g}); --micro_batches=auto chose 1,2,3")
    expected = ["stage 1, micro-batches of 1,024 tokens, 1 a step (1 per rank)",
                "stage 2, micro-batches of 1,024 tokens, 2 a step (2 per rank)",
                "stage 3, micro-batches of 1,024 tokens, 3 a step (3 per rank)",
                "extension, micro-batches of 1,024 tokens, 3 a step (3 per rank)", "validation, sequences of 1,024 tokens"]
    assert [line.removeprefix("memory: ").split(":")[0] for line in lines[1:]] == expected
    assert all(float(line.split("predicted peak ")[1].split()[0]) <= budget for line in lines[1:])
    assert "  micro_batches = 1,2,3" in log  # the choice, as a resume or a rerun would give it
    # the same limit with one micro-batch a step: stage 2's 2,048 tokens do not fit; refused before the log
    proc = in_process(T.main, *flags, "--micro_batches=1", "--run_id=one")
    one_line_error(proc, "error: --micro_batches=1: stage 2's micro-batches of 2,048 tokens need ", " GiB per rank "
                   f"(predicted), over {budget:.2f} GiB per rank", "; --micro_batches=1,2,3 fits (what "
                   "--micro_batches=auto chooses)")
    assert not (tmp_path / "logs/one.txt").exists()
    # validation sequences of 2,048 tokens do not fit: auto never shortens them, the line names the length that fits
    proc = in_process(T.main, *flags, "--micro_batches=auto", "--val_seq_len=2048", "--val_tokens=4096", "--run_id=val")
    one_line_error(proc, "error: --val_seq_len=2048: a validation sequence needs ", f" GiB per rank (predicted), over "
                   f"{budget:.2f} GiB per rank", "; --val_seq_len=1024 fits (the same validation tokens)")
    # a limit below the weights, gradients and optimizer state: no micro-batch helps
    proc = in_process(T.main, *flags, "--micro_batches=auto", "--memory_limit_gib=0.2", "--run_id=small")
    one_line_error(proc, "the weights, gradients and optimizer state alone take 0.34 GiB per rank, over 0.17 GiB per "
                   "rank (85% of the 0.20 GiB of --memory_limit_gib=0.2); more GPUs share the optimizer state")


def test_ranks_that_chose_different_counts_are_refused_before_training(monkeypatch, tmp_path):
    # Two ranks on devices of different memory could choose different counts under auto; they would then
    # wait on each other's collectives until the timeout. One all-reduce of the choice's CRC finds it. Here the
    # other rank is simulated: its all-reduce contribution is the CRC of "8,16,16".
    other = zlib.crc32(b"8,16,16")
    monkeypatch.setattr(T, "distributed", lambda: True)
    monkeypatch.setattr(T.dist, "all_reduce", lambda t, op: t.copy_(torch.maximum(t, torch.tensor([other, -other]))))
    # this rank is rank 0 of the world it reports: what the start-up's memory model (its DistAdam) asks of the group
    monkeypatch.setattr(T.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(T.dist, "get_rank", lambda group=None: 0)
    assert T.same_on_every_rank("8,16,16", CPU) and not T.same_on_every_rank("8,16,24", CPU)
    proc = in_process(T.main, *SMOKE89, "--micro_batches=4,4,8", f"--logs_dir={tmp_path}")
    one_line_error(proc, "--micro_batches: rank 0 trains 4,4,8 micro-batches a step and another rank other counts")
    assert not list(tmp_path.iterdir())


def test_auto_on_cpu_without_a_limit_shares_the_host_among_its_ranks(monkeypatch):
    host = T.device_memory_bytes(CPU)
    args = smoke_args("--micro_batches=auto")
    assert T.memory_budget(args, CPU) == (host, "this host")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert T.memory_budget(args, CPU) == (host // 4, "this host shared by 4 ranks")
    # explicit counts on CPU: their state checked against the host too (issue 53 row 10: nothing was, without a
    # limit), their phases only with a limit or auto
    assert T.memory_budget(smoke_args(), CPU) == (host // 4, "this host shared by 4 ranks")
    assert not T.counts_phases(smoke_args(), CPU) and T.counts_phases(args, CPU)
    assert T.counts_phases(smoke_args("--memory_limit_gib=2"), CPU)
    assert T.memory_budget(smoke_args("--memory_limit_gib=2"), CPU) == (2 * GIB, "--memory_limit_gib=2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(T.ConfigError, match="LOCAL_WORLD_SIZE='x' in the environment"):
        T.memory_budget(args, CPU)


# Issue 53 row 10: on CPU, sizes within check_sizes' bounds were built with no memory check unless
# --memory_limit_gib (or --micro_batches=auto) asked for one: an allocation traceback, or the OOM killer. Every run's
# weights, gradients and optimizer state are now checked against the host's memory, before anything is built. The
# host here has 16 GiB (device_memory_bytes is set so, for every check that reads it): the verdicts are the same on
# every machine.
TINY = [*SMOKE89, "--num_iterations=2", "--extension_steps=1", "--val_loss_every=0",
        "--stage_batch_tokens=256,256,256", "--micro_batches=1", "--val_tokens=1024", "--warmup_steps=0"]
HOST = "over 13.60 GiB per rank (85% of the 16.00 GiB of this host)"
HOST_CASES = [
    # (flags, fragments of the error line)
    (["--bigram_vocab_size=33554432"], ["the weights, gradients and optimizer state alone take 32.29 GiB per rank, "
                                        f"{HOST}"]),  # the issue's
    (["--model_dim=65536"], [f"the weights, gradients and optimizer state alone take 3613.13 GiB per rank, {HOST}"]),
    (["--model_dim=65536", "--micro_batches=auto"], ["3613.13 GiB per rank", HOST]),
    (["--bigram_vocab_size=33554432", "--memory_limit_gib=8"], ["32.29 GiB per rank, over 6.80 GiB per rank (85% of "
                                                                "the 8.00 GiB of --memory_limit_gib=8)"]),
    (["--bigram_vocab_size=8388608"], ["8.29 GiB per rank", "over 6.80 GiB per rank (85% of the 8.00 GiB of this "
                                                            "host shared by 2 ranks)"]),
]


@pytest.mark.parametrize("flags, fragments", HOST_CASES, ids=[" ".join(f) for f, _ in HOST_CASES])
def test_a_config_that_cannot_fit_the_host_is_refused_before_it_is_built(monkeypatch, tmp_path, flags, fragments):
    monkeypatch.setattr(T, "device_memory_bytes", lambda device: 16 * GIB)
    if "--bigram_vocab_size=8388608" in flags:  # two ranks started by torchrun on this host share it
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(T, "build_model", lambda *args: pytest.fail("built"))
    proc = in_process(T.main, *TINY, *flags, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck",
                      "--save_every=2")
    one_line_error(proc, *fragments)
    assert list(tmp_path.iterdir()) == []

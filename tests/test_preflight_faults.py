"""tools/preflight.py's other scenarios, beside tests/test_preflight.py's speedrun run (pytest-xdist runs the
two files in parallel), all on the speedrun preset (record #92) at reduced width: world size 1 with the n-gram
table that fits, --compile=false and the checkpoint writers, the failures it must report (a table that cannot
fit, an injected host sync, CPU tensor and FP8 layout mistake), a recipe larger than the host, and inductor's
kernels for FlexAttention."""

import re

import pytest

from test_preflight import GIB, HAS_TRITON, PHASES, failed, fake_cuda, line_of, passed, run_scenarios


@pytest.fixture(scope="module")
def preflight_runs(tmp_path_factory):
    # huge first: the worker's peak memory is read right after it
    return run_scenarios(tmp_path_factory, "huge", "host_sync", "blocking_copy", "cpu_tensor", "fp8_layout", "rtx3090_too_big", "cards", "inductor",
                         "inductor_rtx4090")


def passed_on_second_run(run) -> dict:
    """The summary of the preflight's second run, with the flags it found to fit, after the first failed."""
    assert run["returncode"] == 1 and "it fits with" in run["stderr"], run["stderr"][-3000:]
    summary = run["stdout"].strip().splitlines()[-1]
    assert summary.startswith("summary: preflight passed "), run["stdout"]
    return dict(field.split(":", 1) for field in summary.split()[3:])


@pytest.mark.slow
def test_world_size_1_passes_every_phase_without_collectives(preflight_runs):
    run = preflight_runs["rtx3090_too_big"]  # record #92 with the table that fits, --compile=false, checkpoints
    summary = passed_on_second_run(run)
    assert summary["world_size"] == "1" and list(run["phases"]) == PHASES + ["checkpoint"]
    assert all(phase["collectives"] == {} for phase in run["phases"].values())
    assert "--bigram_vocab_size=2097152" in run["stderr"]


@pytest.mark.slow
def test_a_recipe_larger_than_the_host_is_never_built_on_it_and_cannot_fit(preflight_runs):
    # Width 8,192 with MLPs of 32,768: billions of parameters, tens of GB in fp32 if built for real (an early
    # preflight was killed by the host's OOM killer, exit 137, with no output). No micro-batch and no smaller
    # n-gram table can help: its weights, gradients and optimizer state alone, without the table, are more than
    # 85% of an H100, which the trainer's start-up check tells from fake tensors before anything is built; the
    # process stays small.
    run = preflight_runs["huge"]
    line = failed(run, "error: the weights, gradients and optimizer state alone take ", " GiB per rank, over 67.70 GiB "
                  "per rank (85% of the 79.65 GiB of cuda:0 (NVIDIA H100 80GB HBM3)); more GPUs share the optimizer "
                  "state; or a smaller --bigram_vocab_size: the n-gram table's 84,602,880 rows take ")
    assert line.endswith(" GiB per rank; cannot fit on 8 H100")
    state, table = (float(line.split(before)[1].split(" GiB")[0]) for before in ("take ", "rows take "))
    assert state - table > 67.70  # without the table
    assert run["max_rss_bytes"] < 6 * GIB, run["max_rss_bytes"] / GIB


@pytest.mark.slow
def test_a_card_that_cannot_hold_the_ngram_table_gets_the_size_that_fits_checked_by_a_second_run(preflight_runs):
    # Record #92's table of 84,602,880 rows at width 128 is 20.17 GiB in bf16 on one RTX 3090 (24 GiB, no FP8): its
    # state alone is over the card's 85%. The trainer's start-up check refuses it; tools/estimate_memory.py, from
    # the same budget, bisects the table in whole 2**20 rows for the largest with which the given micro-batch (one
    # of 262,144 tokens, which fits beside a small table) fits every training phase: 2 x 2**20 rows (not 3). The
    # preflight runs again with it and passes; its report is printed, the error line gives the command and says
    # the table is not the flags'.
    run = preflight_runs["rtx3090_too_big"]
    failed(run, "error: the weights, gradients and optimizer state alone take ", " GiB per rank, over 20.40 GiB per "
           "rank (85% of the 24.00 GiB of cuda:0 (NVIDIA GeForce RTX 3090)); more GPUs share the optimizer state; "
           "or a smaller --bigram_vocab_size: the n-gram table's 84,602,880 rows take 20.17 GiB per rank; it fits "
           "with --bigram_vocab_size=2097152 (the same batches and validation tokens, an n-gram table of 2,097,152 "
           "rows, not 84,602,880; the report above): python tools/preflight.py --gpu=rtx3090 --world_size=1 -- ",
           " --bigram_vocab_size=2097152")
    assert passed_on_second_run(run)["gpu"] == "rtx-3090"
    report = run["stdout"].splitlines()
    peaks = [float(m) for m in re.findall(r": memory (\S+) GiB", run["stdout"])]
    assert len(peaks) == len(PHASES) + 1 and max(peaks) <= 24.0, peaks  # and the checkpoint
    assert "262,144 tokens per micro-batch" in run["stdout"]
    # the card has no FP8 matmuls: the trainer's auto precision falls back, one line each
    fallbacks = [line for line in report if line.startswith("falls back: ")]
    assert fallbacks == ["falls back: lm_head in bf16, not FP8: the RTX 3090 has compute capability 8.6, FP8 matmuls need 8.9",
                         "falls back: MLP up-projections in bf16, not FP8: the RTX 3090 has compute capability 8.6, FP8 "
                         "matmuls need 8.9"]
    assert "decisions: attention flex, lm_head bf16, MLP bf16" in run["stdout"]


# The table of cards: compute capability, FP8 matmuls, and memory in GB as the card is sold.
CARDS = {"h100": ((9, 0), True, 80), "h200": ((9, 0), True, 141), "a100-80gb": ((8, 0), False, 80),
         "a100-40gb": ((8, 0), False, 40), "l40s": ((8, 9), True, 48), "l4": ((8, 9), True, 24),
         "rtx4090": ((8, 9), True, 24), "rtx3090": ((8, 6), False, 24)}


@pytest.mark.slow
def test_every_card_is_what_the_trainer_sees_on_the_fake_device(preflight_runs):
    cards = preflight_runs["cards"]["cards"]
    assert sorted(cards) == sorted(CARDS) == sorted(fake_cuda.GPUS)
    for name, ((major, minor), fp8, gigabytes) in CARDS.items():
        seen, card = cards[name], fake_cuda.GPUS[name]
        assert seen["name"] == card.name and seen["capability"] == [major, minor], name
        assert seen["memory"] == card.total_memory and 0.93 < card.total_memory / (gigabytes * 1e9) < 1.08, name
        assert seen["auto"] == (["fp8", "fp8"] if fp8 else ["bf16", "bf16"]), name
        if fp8:
            assert seen["fp8"] == "fp8", name
        else:
            assert seen["fp8"] == (f"error: --mlp_precision=fp8: {card.name} has no FP8 tensor cores (compute capability "
                                   f"8.9 or later); use bf16"), name
        # the trainer's own memory refusal names the card's memory
        assert f"more than the {card.total_memory / GIB:.0f} GiB cuda:0 has" in seen["sdpa"], name
        # its start-up plan on the card (reduced width, 8 ranks, auto): within 85% of the card's memory, one
        # micro-batch per rank (the fewest there can be), a line per phase
        plan, budget = seen["plan"], 0.85 * card.total_memory
        assert plan["lines"][0] == (f"memory: the predicted peaks must fit {int(budget) / GIB:.2f} GiB per rank (85% "
                                    f"of the {card.total_memory / GIB:.2f} GiB of cuda:0 ({card.name})); "
                                    f"--micro_batches=auto chose 8"), name
        assert len(plan["lines"]) == 7 and plan["micro_batches"] == "8", name  # 4 stages, extension, validation
        assert all(0 < peak <= budget for peak in plan["peaks"].values()), name


@pytest.mark.slow
def test_a_host_sync_injected_into_train_step_fails_the_preflight(preflight_runs):
    failed(preflight_runs["host_sync"], "training step 0: host sync (aten::_local_scalar_dense)",
           f"in train_step at train_gpt.py:{line_of('loss_sum += loss.detach()')}")


@pytest.mark.slow
def test_a_blocking_copy_from_the_host_inside_train_step_fails_the_preflight(preflight_runs):
    # torch.tensor(...).to(device) copies from pageable memory: on CUDA the host waits for the device there
    # (torch.cuda.set_sync_debug_mode flags it). The step's multi-token weights once went that way.
    failed(preflight_runs["blocking_copy"], "training step 0: host sync (a blocking copy from the host)",
           f"in train_step at train_gpt.py:{line_of('mtp = host_to_device(')}")


@pytest.mark.slow
def test_a_cpu_tensor_created_inside_the_step_fails_the_preflight(preflight_runs):
    failed(preflight_runs["cpu_tensor"], "training step 0:", "cuda:0", "cpu",
           f"in block_mask_parts at train_gpt.py:{line_of('some = (kv <= q)')}")


@pytest.mark.slow
def test_an_fp8_operand_in_the_wrong_layout_fails_the_preflight(preflight_runs):
    failed(preflight_runs["fp8_layout"], "training step 0:", "mat2 must be col_major",
           f"at train_gpt.py:{line_of('return torch._scaled_mm(a, b')}")


@pytest.mark.slow
def test_compile_false_on_cuda_compiles_flex_attention_alone(preflight_runs):
    # Uncompiled, FlexAttention materialises the whole score matrix: the preflight refuses that, and
    # --compile=false compiles the attention call alone instead.
    run = preflight_runs["rtx3090_too_big"]
    assert run["decisions"] == "attention flex, lm_head bf16, MLP bf16, compile FlexAttention only"  # no FP8 here
    assert list(run["graphs"]) == ["attention calls"]


@pytest.mark.slow
def test_checkpoints_are_written_on_the_cuda_path(preflight_runs):
    run = preflight_runs["rtx3090_too_big"]  # with --save_every=4 --save_final=true
    passed_on_second_run(run)
    assert "checkpoint written without tensor data" in run["stdout"] and run["checkpoint_bytes"] > 0


@pytest.mark.slow
def test_inductor_compiles_every_triton_kernel_for_sm90(preflight_runs):
    run = preflight_runs["inductor"]
    if not HAS_TRITON:  # the mode needs triton and says so
        assert run["returncode"] == 2 and run["stderr"].startswith("error: --backend=inductor needs triton")
        return
    passed(run)
    names = {name for name, _ in run["kernels"]}
    assert any("flex_attention_backward" in name for name in names)  # FlexAttention's fused templates
    assert any("flex_attention" in name and "backward" not in name for name in names)
    assert all(0 <= shared <= fake_cuda.H100.shared_memory_per_block_optin for _, shared in run["kernels"])


@pytest.mark.slow
def test_inductor_compiles_for_another_card_in_the_same_process(preflight_runs):
    # The same flags as the H100 run above, in the same process, for an RTX 4090: inductor's caches would have
    # served that run's graphs, loaded no kernel and counted none (as they did before the preflight turned
    # them off); now every kernel is compiled for sm_89 within its 99 KiB.
    run = preflight_runs["inductor_rtx4090"]
    if not HAS_TRITON:
        assert run["returncode"] == 2
        return
    assert passed(run)["kernels"] != "-"
    assert "Triton kernels compiled for sm_89: " in run["stdout"] and "of 99 KiB" in run["stdout"]
    card = fake_cuda.GPUS["rtx4090"]
    assert run["kernels"] and all(0 <= shared <= card.shared_memory_per_block_optin for _, shared in run["kernels"])
    assert any("flex_attention_backward" in name for name, _ in run["kernels"])

"""tools/preflight.py's other scenarios, beside tests/test_preflight.py's speedrun run (pytest-xdist runs the
two files in parallel): world size 1 with --compile=false and the checkpoint writers, the failures it must
report (a phase that cannot fit, an injected host sync, CPU tensor and FP8 layout mistake), a recipe larger
than the host, and inductor's kernels for FlexAttention."""

import pytest

from test_preflight import GIB, HAS_TRITON, PHASES, failed, fake_cuda, line_of, passed, run_scenarios


@pytest.fixture(scope="module")
def preflight_runs():
    # huge first: the worker's peak memory is read right after it
    return run_scenarios("huge", "world_size_1", "host_sync", "cpu_tensor", "fp8_layout", "too_big", "inductor")


@pytest.mark.slow
def test_world_size_1_passes_every_phase_without_collectives(preflight_runs):
    run = preflight_runs["world_size_1"]  # with --compile=false and the checkpoint writers
    summary = passed(run)
    assert summary["world_size"] == "1" and list(run["phases"]) == PHASES + ["checkpoint"]
    assert all(phase["collectives"] == {} for phase in run["phases"].values())


@pytest.mark.slow
def test_a_step_that_cannot_fit_an_h100_fails_the_preflight(preflight_runs):
    # 262,144 tokens per micro-batch at full width: the peak of the first step is above 79.65 GiB.
    line = failed(preflight_runs["too_big"], "training step 0: does not fit an H100: peak ",
                  "GiB per rank (live tensors) > 79.65 GiB")
    assert float(line.split("peak ")[1].split(" GiB")[0]) > 79.65


@pytest.mark.slow
def test_a_recipe_larger_than_the_host_is_never_built_on_it(preflight_runs):
    # Width 8,192: 8.9 billion parameters, 36 GB in fp32 if built for real (the old preflight was killed by
    # the host's OOM killer, exit 137, with no output). Built on the meta device and moved to the fake GPU,
    # it fails at its first step with one line, and the process stays small.
    run = preflight_runs["huge"]
    failed(run, "training step 0: does not fit an H100: peak ")
    assert run["max_rss_bytes"] < 6 * GIB, run["max_rss_bytes"] / GIB


@pytest.mark.slow
def test_a_host_sync_injected_into_train_step_fails_the_preflight(preflight_runs):
    failed(preflight_runs["host_sync"], "training step 0: host sync (aten::_local_scalar_dense)",
           f"in train_step at train_gpt.py:{line_of('loss_sum += loss.detach()')}")


@pytest.mark.slow
def test_a_cpu_tensor_created_inside_the_step_fails_the_preflight(preflight_runs):
    failed(preflight_runs["cpu_tensor"], "training step 0:", "cuda:0", "cpu",
           f"in flex_block_mask at train_gpt.py:{line_of('some = (kv <= q)')}")


@pytest.mark.slow
def test_an_fp8_operand_in_the_wrong_layout_fails_the_preflight(preflight_runs):
    failed(preflight_runs["fp8_layout"], "training step 0:", "mat2 must be col_major",
           f"at train_gpt.py:{line_of('return torch._scaled_mm(a, b')}")


@pytest.mark.slow
def test_compile_false_on_cuda_compiles_flex_attention_alone(preflight_runs):
    # Uncompiled, FlexAttention materialises the whole score matrix: the preflight refuses that, and
    # --compile=false compiles the attention call alone instead.
    run = preflight_runs["world_size_1"]
    assert run["decisions"] == "attention flex, lm_head fp8, MLP fp8, compile FlexAttention only"
    assert list(run["graphs"]) == ["attention calls"]


@pytest.mark.slow
def test_checkpoints_are_written_on_the_cuda_path(preflight_runs):
    run = preflight_runs["world_size_1"]  # with --save_every=2 --save_final=true
    passed(run)
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

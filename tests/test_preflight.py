"""tools/preflight.py: the CUDA path on fake H100 tensors; and the CUDA-only bugs it found, each
checked on CPU: FP8 widths, FlexAttention with --compile=false, the fp32 head, FP8Linear's weight
gradient, and the timed loop's device syncs."""

import importlib.util
import json
import os
import re
import sys
import warnings

import pytest
import torch

import train_gpt as T
from conftest import REPO, one_line_error, python, run_main

sys.path.insert(0, str(REPO / "tools"))
import fake_cuda  # noqa: E402  (stdlib only: importing it loads nothing)

GIB = 2 ** 30
HAS_TRITON = importlib.util.find_spec("triton") is not None
# RMSNorm's fused kernel exists in CUDA builds of PyTorch only; elsewhere rms_norm runs its composite form.
FUSED_RMS_NORM_ON_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")


# --- the preflight, in one worker process -----------------------------------------------------

@pytest.fixture(scope="session")
def preflight_runs():
    """Every scenario of tests/workers/preflight_worker.py, run once in one process (one start-up, one
    build of the fake CUDA device): about 40 s on an idle 2-core machine."""
    names = ["world_size_1", "world_size_8", "compile_false", "host_sync", "cpu_tensor", "fp8_layout", "inductor"]
    proc = python(REPO / "tests/workers/preflight_worker.py", *names, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {run["scenario"]: run for run in map(json.loads, proc.stdout.splitlines())}
    assert sorted(runs) == sorted(names)
    return runs


def passed(run) -> dict:
    assert run["returncode"] == 0 and run["stderr"] == "", run["stderr"][-3000:]
    summary = run["stdout"].strip().splitlines()[-1]
    assert summary.startswith("summary: preflight passed "), run["stdout"]
    return dict(field.split(":", 1) for field in summary.split()[3:])


def failed(run, *fragments) -> str:
    """The run failed as the preflight should: exit 1, one `error:` line naming the fragments."""
    assert run["returncode"] == 1, run["stdout"][-2000:]
    lines = run["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run["stderr"]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def line_of(text: str) -> int:
    """The line of train_gpt.py that holds `text` (once)."""
    lines = [i for i, line in enumerate((REPO / "train_gpt.py").read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


@pytest.mark.slow
def test_speedrun_structure_passes_the_preflight_at_world_size_1(preflight_runs):
    run = preflight_runs["world_size_1"]
    summary = passed(run)
    assert summary["world_size"] == "1" and summary["steps"] == "4" and summary["host_syncs_in_steps"] == "0"
    assert run["decisions"] == "attention flex, lm_head fp8, compile per block"
    # 3 block structures (attention with and without value embeddings, MLP only) x 2 sequence lengths,
    # and the head's 2: the compiled structure of the full model, at any width.
    assert run["graphs"] == {"blocks": 6, "head": 2}
    assert run["collectives"] == {}  # world size 1: nothing to send
    assert run["host_syncs"] == {"validation": [f"aten::_local_scalar_dense in evaluate at train_gpt.py:"
                                                f"{line_of('return loss_sum.item() / (num_seqs')}"]}
    # The record's dtypes: bf16 embeddings, head and gates (16.1M at width 64), the rest fp32.
    assert run["parameters"]["bfloat16"] == 5 * 50304 * 64 + 11 * 12


@pytest.mark.slow
def test_world_size_8_issues_the_collectives_of_rank_0_with_their_real_shapes(preflight_runs):
    run = preflight_runs["world_size_8"]
    summary = passed(run)
    assert summary["world_size"] == "8" and run["graphs"] == {"blocks": 6, "head": 2}
    # Counted by hand for width 64 at world size 8. NorMuon deals same-shape matrices out in chunks of
    # 8, each chunk a full stack of 8 (short chunks padded): 10 attention qkvo (4, 64, 64), 11 MLP fc
    # and 11 proj (4 * 64 * 64 each), 11 gates (1, 12) in bf16; fp32 gradients in, parameters out.
    d, world, chunks = 64, 8, lambda n: -(-n // 8)
    matrices = chunks(10) * 4 * d * d + 2 * chunks(11) * 4 * d * d
    muon_reduce = 4 * world * (matrices + chunks(11) * 12)
    muon_gather = 4 * world * matrices + 2 * world * chunks(11) * 12
    # DistAdam every second step: the 4 embedding tables and the head in bf16 (50,304 x 64, a multiple of
    # 8), and the 44 scalars in fp32, padded to 48, both ways.
    adam = 5 * 2 * 50304 * d + 4 * 48
    assert run["collectives"]["training step 2"] == {"reduce-scatter": muon_reduce, "all-gather": muon_gather}
    assert run["collectives"]["training step 3"] == {"reduce-scatter": muon_reduce + adam,
                                                     "all-gather": muon_gather + adam}
    assert int(summary["collectives_per_step"].removesuffix("MB")) == round(
        (muon_reduce + muon_gather + (muon_reduce + muon_gather + 2 * adam)) / 2 / 1e6)
    assert run["collectives"]["setup"] == {"broadcast": sum(run["parameters"][t] * (2 if t == "bfloat16" else 4)
                                                            for t in run["parameters"])}


@pytest.mark.slow
def test_preflight_memory_is_estimate_memorys_count(preflight_runs):
    # --compile=false: every row is what tools/estimate_memory.py counts, except that the compiled
    # FlexAttention also keeps its inputs for backward: both windows' block masks (key and query block
    # indices, 256 x 256 int32 each, and their counts, 256 int32; full and partial blocks), the document
    # ids (32,768 int64) and the two windows (int64).
    eager = preflight_runs["compile_false"]
    passed(eager)
    differ = {row for row in eager["memory"] if eager["memory"][row] != eager["estimate"][row]}
    assert differ == {"saved activations", "peak"}
    kept_by_flex = 2 * 4 * (256 * 256 * 4 + 256 * 4) + 32768 * 8 + 2 * 8
    kept_beyond_the_estimate = eager["memory"]["saved activations"] - eager["estimate"]["saved activations"]
    if FUSED_RMS_NORM_ON_CUDA:
        # A CUDA build's fused RMSNorm keeps the bf16 input where the composite form that
        # estimate_memory counts keeps fp32 copies (measured with 2.11.0+cu130: 264,241,152 bytes less).
        assert kept_beyond_the_estimate < kept_by_flex
    else:  # a CPU build: the fake CUDA device runs the composite form too
        assert kept_beyond_the_estimate == kept_by_flex
    # Compiled: the same count with the saved activations measured on the compiled graphs, which keep
    # less than eager (the estimate is an upper bound) but more than nothing.
    compiled = preflight_runs["world_size_8"]
    differ = {row for row in compiled["memory"] if compiled["memory"][row] != compiled["estimate"][row]}
    assert differ == {"saved activations", "peak"}
    assert 0.5 * compiled["estimate"]["saved activations"] < compiled["memory"]["saved activations"] \
        < compiled["estimate"]["saved activations"]


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
    # Uncompiled, FlexAttention materialises the whole score matrix (24 GiB per micro-batch): the
    # preflight refuses that, and --compile=false compiles the attention call alone instead.
    run = preflight_runs["compile_false"]
    passed(run)
    assert run["decisions"] == "attention flex, lm_head fp8, compile FlexAttention only"
    assert run["graphs"] == {"attention calls": 2}  # training and validation lengths


@pytest.mark.slow
def test_checkpoints_are_written_on_the_cuda_path(preflight_runs):
    run = preflight_runs["compile_false"]  # with --save_every=2 --save_final=true
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


@pytest.mark.slow
def test_the_command_refuses_a_world_size_that_cannot_split_the_batch():
    proc = python(REPO / "tools/preflight.py", "--world_size=3")
    one_line_error(proc, "world size 3 cannot split")


def test_the_fake_device_is_built_once_per_source_and_pytorch(tmp_path):
    name = fake_cuda.library_name(b"source", "2.13.0", tmp_path)
    assert fake_cuda.library_name(b"source", "2.13.0", tmp_path) == name
    assert len({name, fake_cuda.library_name(b"source 2", "2.13.0", tmp_path),
                fake_cuda.library_name(b"source", "2.11.0", tmp_path),
                fake_cuda.library_name(b"source", "2.13.0", tmp_path / "other")}) == 4


def test_the_fake_device_explains_what_it_lacks_in_one_line(tmp_path):
    with pytest.raises(fake_cuda.ShimError) as error:
        fake_cuda.build(tmp_path, compiler="no-such-g++")
    assert str(error.value).startswith("no-such-g++ not found") and "\n" not in str(error.value)
    with pytest.raises(fake_cuda.ShimError) as error:
        fake_cuda.build(tmp_path, torch_path=tmp_path)
    assert "C++ headers are missing" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(fake_cuda.ShimError, match="before torch is imported"):
        fake_cuda.load(tmp_path)  # this process has imported torch
    assert not list(tmp_path.iterdir())  # nothing half-built left behind


def test_the_registry_notice_of_a_cuda_build_is_dropped_and_other_output_kept(capfd):
    # On a CUDA build of PyTorch the shim's hooks take priority over the build's own, and c10 prints a
    # notice for the registration it skips, straight to file descriptor 2.
    notice = "Higher priority item already registered, skipping registration of CUDAHooks"
    with fake_cuda.stderr_without(notice):
        os.write(2, f"before\n{notice}\nafter\n".encode())
    assert capfd.readouterr().err == "before\nafter\n"


# --- the bugs, on CPU -------------------------------------------------------------------------

def test_fp8_head_refuses_widths_fp8_matmuls_cannot_take(monkeypatch):
    one_line_error(run_main("--preset=speedrun", "--model_dim=840", "--head_dim=120", "--lm_head_precision=fp8"),
                   "--lm_head_precision=fp8", "--model_dim (here 840)", "multiples of 16")
    one_line_error(run_main("--preset=speedrun", "--window_block=8", "--micro_batch_tokens=8200",
                            "--batch_tokens=65600", "--lm_head_precision=fp8"), "--micro_batch_tokens (here 8200)")
    # auto picks bf16 on an H100 for such widths (and the log header says why), fp8 otherwise
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    h100 = torch.device("cuda", 0)
    odd = T.parse_args(["--preset=speedrun", "--model_dim=840", "--head_dim=120"], True)
    assert T.resolve_head_precision(odd, h100) == "bf16"
    assert T.resolve_head_precision(T.parse_args(["--preset=speedrun"], True), h100) == "fp8"


@pytest.mark.slow
def test_compile_false_compiles_flex_attention_alone_and_flex_then_runs_fused():
    args = T.parse_args(["--preset=smoke", "--attention=flex", "--compile=false"], False)
    model = T.GPT(args).eval()
    graphs = []
    T.compile_model(model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward, attention_only=True)
    tokens = torch.randint(0, T.BOS_ID, (args.micro_batch_tokens,), generator=torch.Generator().manual_seed(0))
    masks = T.build_masks(tokens, T.layer_windows(args, (1, 3)), True, args.window_block)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
            model(tokens, tokens, masks)
    finally:
        torch._dynamo.reset()  # dynamo keeps compiled graphs for the whole process
    assert len(graphs) == 1 and "flex_attention" in graphs[0].code  # one graph, shared by every layer
    # the trainer's decision: on CUDA, --compile=false still compiles the attention alone
    assert T.resolve_attention(args, torch.device("cuda")) == "flex"


def test_sdpa_is_refused_where_its_dense_validation_mask_cannot_fit_an_h100(monkeypatch):
    # The speedrun's 262,144-token validation sequence as one dense mask: 64 GiB of booleans, built
    # from 512 GiB of int64 distances. Uncounted by the preflight's step, it would end the run at its
    # first validation; the trainer refuses it up front instead.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: fake_cuda.H100)
    h100 = torch.device("cuda", 0)
    with pytest.raises(T.ConfigError, match="262,144-token sequence takes at least 576 GiB to build, more than "
                                            "the 80 GiB cuda:0 has"):
        T.resolve_attention(T.parse_args(["--preset=speedrun", "--attention=sdpa"], True), h100)
    fits = T.parse_args(["--preset=speedrun", "--attention=sdpa", "--val_seq_len=65536"], True)  # 36 GiB
    assert T.resolve_attention(fits, h100) == "sdpa"
    assert T.resolve_attention(T.parse_args(["--preset=speedrun"], True), h100) == "flex"


def test_fp32_head_computes_in_fp32_on_gpus():
    args = T.parse_args(["--preset=smoke", "--lm_head_precision=fp32"], False)
    model = T.cast_for_device(T.GPT(args, "fp32"), torch.device("cuda"))  # GPU dtypes; nothing moves
    assert model.embed.weight.dtype == torch.bfloat16  # so the residual stream is bf16 on GPUs
    assert model.head.lm_head.weight.dtype == torch.float32
    stream = torch.randn(1, 8, args.model_dim, dtype=torch.bfloat16)
    assert model.head.logits(stream).dtype == torch.float32


def test_fp8_linear_weight_gradient_has_the_weights_dtype_as_documented():
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 64, dtype=torch.bfloat16) * 0.05)
    T.FP8Linear.apply(x, w, 64 ** 0.5 / T.FP8_E4M3_MAX).float().square().sum().backward()
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    doc = " ".join(T.FP8Linear.__doc__.split())
    assert "fp32 weight gradients" not in doc and "the weight's own dtype" in doc


# --- the timed loop ---------------------------------------------------------------------------

TINY_RUN = ["--synthetic=true", "--val_loss_every=0", "--train_loss_every=0", "--warmup_steps=0", "--extension_steps=0",
            "--batch_tokens=512", "--micro_batch_tokens=512", "--val_tokens=512", "--val_seq_len=512"]


@pytest.mark.slow
def test_the_timed_loop_synchronises_the_device_only_where_the_clock_stops(tmp_path, monkeypatch):
    # How often the loop asks for a device sync must not grow with the number of steps: runs of 1 and 2
    # steps of a small model (on CPU the sync is a no-op, but the loop's calls are the same as on CUDA).
    calls = []
    real_sync = T.sync
    monkeypatch.setattr(T, "sync", lambda device: (calls.append(device), real_sync(device)))
    counts = []
    for steps in (1, 2):
        calls.clear()
        proc = run_main(*TINY_RUN, f"--num_iterations={steps}", f"--logs_dir={tmp_path}", f"--run_id=sync{steps}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        counts.append(len(calls))
    assert counts[0] == counts[1], counts
    log = (tmp_path / "sync2.txt").read_text()
    assert re.search(r"^perf: step_median:[\d.]+ms ", log, re.M)  # step times still reach the perf line


def test_step_times_come_from_cuda_events_read_after_the_sync(monkeypatch):
    clock = iter(range(0, 1000, 10))
    read_early = []

    class Event:  # a CUDA event on a device clock that advances 10 ms per event
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.ms = None

        def record(self):
            self.ms = next(clock)

        def elapsed_time(self, end):
            read_early.append(not timer.synced)
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = T.StepTimer(torch.device("cuda"))
    timer.synced = True
    timer.start()
    timer.synced = False  # steps run; nothing may read an event now
    for _ in range(3):
        timer.step_done()
    timer.synced = True
    timer.read()
    assert timer.step_ms == [10, 10, 10] and read_early == [False] * 3

"""What the CPU can check of the speed work: no host syncs in the step or the mask building, FLOP
counting, and the synthetic benchmark (hook timing under per-block compile: test_compile.py)."""

import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T
from conftest import SMOKE89, python, run_main

# Ops that make the host wait for the device: reading a value, or shapes that depend on data.
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
               "aten::_unique2", "aten::item", "aten::repeat_interleave"}


class NoHostSync(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNCING_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def smoke_setup():
    # Short micro-batches: a host sync is the same whatever their length.
    args = T.parse_args([*SMOKE89, "--stage_batch_tokens=256,256,256"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    return args, env, model, T.build_optimizers(model, args)


def test_training_step_has_no_host_sync():
    args, env, model, optimizers = smoke_setup()
    loader = T.SyntheticLoader(args, env)
    schedule = T.Schedule(args)
    # a step without Adam, one with it, one with optimizer state present, and the untie step
    for step in (0, 1, 2, schedule.untie_step):
        batch = loader.next_batch(step)
        T.set_schedules(step, optimizers, schedule, args)
        with NoHostSync() as mode:
            T.train_step(model, optimizers, batch, step, schedule, args, use_flex=False)
        assert mode.seen == [], f"host syncs in the training step {step}: {mode.seen}"
    with NoHostSync() as mode:  # the check itself can fail
        torch.ones(3).sum().item()
    assert mode.seen == ["aten::_local_scalar_dense"]


def test_flex_block_masks_are_built_without_host_sync():
    args = T.parse_args(["--preset=record89"], True)
    tokens = T.SyntheticLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu"))).next_batch(0)[0][0]
    with torch.device("meta"):
        plans = T.GPT(args).plans
    with NoHostSync() as mode:
        masks = T.build_masks(tokens, plans, (6, 13), args.window_block, use_flex=True)
    assert mode.seen == []
    # one per kind of layer, shared: short and long windows, and the paired layers' doubled sequence
    assert set(masks.by_kind) == {(False, True), (False, False), (True, False)}  # (long window, paired)


def test_model_flops_per_token_counts_matmuls_and_windowed_attention():
    args = T.parse_args(["--preset=record89"], True)
    with torch.device("meta"):
        model = T.GPT(args)
    # 10 attention layers of 4 d^2, 11 MLPs of 8 d^2, the lm_head, and the four MUDD nets' first layers
    # (64 x d each; their second layers and the gates are small and not counted)
    matmul_params = 10 * 4 * 768 ** 2 + 11 * 8 * 768 ** 2 + 50304 * 768 + 4 * 64 * 768
    # One document of 4096 tokens: position i attends to min(i + 1, window + 1) keys in a plain layer; a paired
    # layer's token sits at positions 2i and 2i + 1 of the doubled document (half the heads each); DC adds
    # its 112-key window on layer 10.
    tokens = torch.full((4096,), 7)
    tokens[0] = T.BOS_ID
    flops = T.model_flops_per_token(args, model, tokens, (3, 7))
    n = 4096
    plain = lambda w: sum(min(i + 1, w + 1) for i in range(n)) / n
    paired = lambda w: sum(min(2 * i + 1, w + 1) + min(2 * i + 2, w + 1) for i in range(n)) / (2 * n)
    contexts = [paired(384)] * 4 + [plain(384)] * 4 + [plain(896)] * 2 + [sum(min(i + 1, 112) for i in range(n)) / n]
    expected = 6 * matmul_params + sum(12 * 768 * c for c in contexts)
    assert flops == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_synthetic_benchmark_runs_on_cpu(tmp_path):
    # One step per stage and the extension give the perf line its median; no warmup: nothing here compiles.
    # Steps of one 256-token micro-batch: the perf line is the same code at any size (18.5 CPU-s at the smoke
    # preset's 1,024 to 3,072 tokens in 4 micro-batches, 6.5 at this size).
    proc = run_main("--synthetic=true", "--num_iterations=4", "--extension_steps=1", "--warmup_steps=0",
                    "--val_loss_every=0", "--stage_batch_tokens=256,256,256", "--micro_batches=1",
                    "--stage_max_seq_len=256,256,256", "--val_tokens=1024", f"--logs_dir={tmp_path}", "--run_id=bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "bench.txt").read_text()
    perf = re.search(r"^perf: step_median:([\d.]+)ms tokens_per_s:(\d+) model_flops_per_token:(\d+) "
                     r"matmul_peak_tflops:([\d.]+) \(float32\) mfu:([\d.]+)% peak_memory:(\d+)MiB$", log, re.M)
    assert perf, log[-2000:]
    assert float(perf[1]) > 0 and int(perf[2]) > 0 and 0 < float(perf[5]) < 100
    assert re.search(r"^summary: .* mfu:[\d.]+% ", log, re.M)


def test_only_the_rank_that_logs_measures_the_matmul_peak(monkeypatch):
    # Ranks sharing a CPU's cores (gloo) would slow each other's measurement and understate the peak; the other
    # ranks' figures are never logged.
    measured = []
    monkeypatch.setattr(T, "matmul_peak_flops", lambda device, dtype: measured.append(device) or 1e12)
    args = T.parse_args([*SMOKE89, "--synthetic=true", "--stage_batch_tokens=256,256,256"], False)
    model = T.GPT(args)
    perfs = []
    for rank in (0, 1):
        env = T.DistEnv(rank, rank, 2, torch.device("cpu"))
        run = T.Run(args, env, T.Schedule(args), T.Logger(None), "", "peak")
        perfs.append(T.Performance.measure(run, model, T.SyntheticLoader(args, env)))
    assert measured == [torch.device("cpu")]
    assert perfs[0].peak_flops == 1e12 and math.isnan(perfs[1].peak_flops)
    assert perfs[0].flops_per_token > 0 and perfs[1].flops_per_token > 0


@pytest.mark.parametrize("micro_batches", [8, 32, 256])
def test_synthetic_steps_fill_any_number_of_micro_batches(micro_batches):
    # Each micro-batch's cut document is skipped, as the loader does with shards: 32 micro-batches of 4,097
    # tokens, documents cut at 896, used to run out of drawn documents (what the preflight suggests for one
    # RTX 4090 is 32).
    args = T.parse_args(["--preset=record89", f"--micro_batches={micro_batches}"], True)
    loader = T.SyntheticLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu")))
    for step in (0, 850):
        batch = loader.next_batch(step)
        micro = T.Schedule(args).micro_tokens(step)
        assert len(batch) == micro_batches
        assert all(inputs.shape == targets.shape == (micro,) and inputs[0] == T.BOS_ID for inputs, targets in batch)


@pytest.mark.slow  # a process of its own, which trains
def test_a_run_that_compiles_nothing_never_imports_dynamo(tmp_path):
    # Importing torch._dynamo costs a process 2 s on 2 cores, and torch.optim's add_param_group and zero_grad
    # import it on their first call: a CPU run with its checkpoints, which compiles nothing, must not pay for it
    # (the trainer's optimizers bypass those wrappers). Broken, it fails: dynamo is imported. The one exception is
    # the start-up memory check (plan_memory), whose memory model runs in a FakeTensorMode, which imports dynamo's
    # config: since issue 53 row 10 every CPU run pays that, and the check is left out here.
    script = f"""
import sys
import train_gpt as T
T.plan_memory = lambda *args: None
assert T.main(["--num_iterations=2", "--extension_steps=1", "--val_loss_every=0", "--stage_batch_tokens=256,256,256",
               "--val_tokens=512", "--val_seq_len=512", "--save_every=2", "--save_final=true", "--logs_dir={tmp_path}",
               "--checkpoint_dir={tmp_path}/ck", "--run_id=plain"]) == 0
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""
    proc = python("-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "dynamo imported: False", proc.stdout[-2000:]

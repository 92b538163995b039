"""What the CPU can check of the speed work: no host syncs in the step or the mask building, FLOP
counting, and the synthetic benchmark (hook timing under per-block compile: test_compile.py)."""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T
from conftest import run_main

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
    args = T.parse_args(["--preset=smoke", "--batch_tokens=1024", "--micro_batch_tokens=256"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    return args, env, model, T.build_optimizers(model, args)


def test_training_step_has_no_host_sync():
    args, env, model, optimizers = smoke_setup()
    loader = T.SyntheticLoader(args, env)
    windows = T.layer_windows(args, T.attention_windows(0, args))
    for step in range(3):  # a step without Adam, one with it, and one with optimizer state present
        batch = loader.next_batch()
        T.set_schedules(step, optimizers, args)
        with NoHostSync() as mode:
            T.train_step(model, optimizers, batch, windows, step, args, use_flex=False)
        assert mode.seen == [], f"host syncs in the training step: {mode.seen}"
    with NoHostSync() as mode:  # the check itself can fail
        torch.ones(3).sum().item()
    assert mode.seen == ["aten::_local_scalar_dense"]


def test_flex_block_masks_are_built_without_host_sync():
    args = T.parse_args(["--preset=speedrun"], True)
    tokens = T.SyntheticLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu"))).next_batch()[0][0]
    with NoHostSync() as mode:
        masks = T.build_masks(tokens, T.layer_windows(args, (6, 13)), True, args.window_block)
    assert mode.seen == []
    assert len({id(m) for m in masks if m is not None}) == 2  # one per window size, shared by the layers


def test_model_flops_per_token_counts_matmuls_and_windowed_attention():
    args = T.parse_args(["--preset=speedrun"], True)
    with torch.device("meta"):
        model = T.GPT(args)
    # 10 attention layers of 4 d^2, 11 MLPs of 8 d^2, 10 attention gates (6 x 12), the smear gate, the lm_head
    matmul_params = 10 * 4 * 768 ** 2 + 11 * 8 * 768 ** 2 + 10 * 6 * 12 + 12 + 50304 * 768
    # One document of 4096 tokens: position i attends to min(i + 1, window + 1) keys.
    tokens = torch.full((4096,), 7)
    tokens[0] = T.BOS_ID
    windows = T.layer_windows(args, (3, 7))
    flops = T.model_flops_per_token(args, model, tokens, windows)
    contexts = [sum(min(i + 1, w + 1) for i in range(4096)) / 4096 for w in windows if w is not None]
    assert len(contexts) == 10
    expected = 6 * matmul_params + sum(12 * 768 * c for c in contexts)
    assert flops == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_synthetic_benchmark_runs_on_cpu(tmp_path):
    # Two steps give the perf line its median; no warmup: nothing here compiles.
    proc = run_main("--synthetic=true", "--num_iterations=2", "--extension_steps=1", "--warmup_steps=0",
                    "--val_loss_every=0", f"--logs_dir={tmp_path}", "--run_id=bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "bench.txt").read_text()
    perf = re.search(r"^perf: step_median:([\d.]+)ms tokens_per_s:(\d+) model_flops_per_token:(\d+) "
                     r"matmul_peak_tflops:([\d.]+) \(float32\) mfu:([\d.]+)% peak_memory:(\d+)MiB$", log, re.M)
    assert perf, log[-2000:]
    assert float(perf[1]) > 0 and int(perf[2]) > 0 and 0 < float(perf[5]) < 100
    assert re.search(r"^summary: .* mfu:[\d.]+% ", log, re.M)

"""What the CPU can check of the speed work: no host syncs in the step, hook timing under
per-block compilation, FLOP counting, and the synthetic benchmark."""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T
from conftest import REPO, python

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
    args = T.parse_args(["--preset=smoke"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    return args, env, model, T.build_optimizers(model, args)


def test_training_step_has_no_host_sync():
    args, env, model, optimizers = smoke_setup()
    loader = T.SyntheticLoader(args.batch_tokens, args.micro_batch_tokens, env, seed=0)
    windows = T.layer_windows(args, args.window_max)
    for step in range(2):  # the second step runs with optimizer state present
        batch = loader.next_batch()
        T.set_schedules(step, optimizers, args)
        with NoHostSync() as mode:
            T.train_step(model, optimizers, batch, windows, args)
        assert mode.seen == [], f"host syncs in the training step: {mode.seen}"
    with NoHostSync() as mode:  # the check itself can fail
        torch.ones(3).sum().item()
    assert mode.seen == ["aten::_local_scalar_dense"]


def test_gradient_hooks_fire_during_backward_with_per_block_compile():
    args, env, model, _ = smoke_setup()
    T.compile_model(model, backend="aot_eager")  # the CUDA structure, without generating kernels
    events = []

    class Marked(torch.nn.Module):  # eager wrapper: its hook fires when the block's backward is done
        def __init__(self, block, index):
            super().__init__()
            self.block, self.index = block, index

        def forward(self, x, *rest):
            x.register_hook(lambda g: events.append(f"block {self.index} backward done"))
            return self.block(x, *rest)

    model.blocks = torch.nn.ModuleList(Marked(b, i) for i, b in enumerate(model.blocks))
    watched = {"lm_head": model.head.lm_head.weight, "embed": model.embed.weight,
               **{f"block {i} fc": b.block.mlp.fc.weight for i, b in enumerate(model.blocks)}}
    for name, p in watched.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"{name} grad ready"))
    with torch.no_grad():  # non-zero projections so every block gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    loader = T.SyntheticLoader(args.batch_tokens, args.micro_batch_tokens, env, seed=0)
    inputs, targets = loader.next_batch()[0]
    model(inputs, targets, T.build_masks(inputs, T.layer_windows(args, 256), args)).backward()

    last = len(model.blocks) - 1
    order = {e: i for i, e in enumerate(events)}
    # The lm_head's reduce-scatter could start before any block has run its backward ...
    assert order["lm_head grad ready"] < order[f"block {last} backward done"], events
    # ... and each block's parameters are ready before the earlier blocks' backward is done.
    for i in range(1, last + 1):
        assert order[f"block {i} fc grad ready"] < order[f"block {i - 1} backward done"], events
    assert events[-1] == "embed grad ready", events


def test_model_flops_per_token_counts_matmuls_and_windowed_attention():
    args = T.parse_args(["--preset=speedrun"], True)
    with torch.device("meta"):
        model = T.GPT(args)
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)
    assert matmul_params == 12 * 12 * 768 * 768 + 50304 * 768  # 4 attention + 8 MLP d^2 per layer, lm_head
    # One document of 4096 tokens: position i attends to min(i + 1, window) keys.
    tokens = torch.full((4096,), 7)
    tokens[0] = T.BOS_ID
    flops = T.model_flops_per_token(args, model, tokens, long_window=1024)
    contexts = [sum(min(i + 1, w) for i in range(4096)) / 4096 for w in T.layer_windows(args, 1024)]
    expected = 6 * matmul_params + sum(12 * 768 * c for c in contexts)
    assert flops == pytest.approx(expected, rel=1e-9)


def test_synthetic_benchmark_runs_on_cpu(tmp_path):
    proc = python(REPO / "train_gpt.py", "--synthetic=true", "--num_iterations=4", "--val_loss_every=0",
                  f"--logs_dir={tmp_path}", "--run_id=bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "bench.txt").read_text()
    perf = re.search(r"^perf: step_median:([\d.]+)ms tokens_per_s:(\d+) model_flops_per_token:(\d+) "
                     r"matmul_peak_tflops:([\d.]+) \(float32\) mfu:([\d.]+)% peak_memory:(\d+)MiB$", log, re.M)
    assert perf, log[-2000:]
    assert float(perf[1]) > 0 and int(perf[2]) > 0 and 0 < float(perf[5]) < 100
    assert re.search(r"^summary: .* mfu:[\d.]+% ", log, re.M)

"""Peak GPU memory per rank of a speedrun step, computed with fake tensors: no GPU, and no memory
beyond the bookkeeping (FakeTensorMode allocates nothing).

    python tools/estimate_memory.py                      # the speedrun preset at world sizes 1 and 8
    python tools/estimate_memory.py --world_sizes 1 2 4 8 -- --micro_batch_tokens=16384

Arguments after `--` are train_gpt.py flags. Per rank it counts:
  - weights and their gradients, in record #44's GPU dtypes (bf16 embeddings, lm_head and gates);
  - NorMuon's fp32 momentum and second moment for the matrices this rank owns (round robin);
  - DistAdam's fp32 exp_avg and exp_avg_sq for this rank's 1/world_size shard of every bucket;
  - the tensors one micro-batch's forward keeps for backward, recorded by saved_tensors_hooks while
    the eager model runs on fake tensors. FlexAttention has no backward on CPU, so attention is
    stood in for by a function that keeps what FlexAttention's backward keeps (q, k, v, the output
    and the fp32 log-sum-exp); torch.compile may keep less (it can recompute cheap element-wise
    results), so this is an upper bound for the compiled step;
  - the largest transient of backward: the bf16 logits and their gradient (tokens x vocab each);
  - the two block masks of a micro-batch;
  - the step's communication buffers (NorMuon's stacked fp32 gradients and gathered parameters for
    every chunk in flight at once, DistAdam's flat copies of coalesced buckets), at world size > 1.
Peak = max(end of the last micro-batch's forward + the backward transient, optimizer step), over
the state that persists (weights, gradients, optimizer state). Allocator fragmentation, CUDA/NCCL
context and compiled-kernel workspaces are not counted. tools/preflight.py makes the same count
(breakdown below) with the saved activations measured on the compiled step on a fake H100.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as T  # noqa: E402

GIB = 2 ** 30
H100_BYTES = 81_559 * 2 ** 20  # what nvidia-smi reports for an H100 80GB HBM3 (the public record logs)


class FlexStandIn(torch.autograd.Function):
    """Keeps for backward what FlexAttention keeps: q, k, v, the output and the fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def gpu_dtypes(model: T.GPT):
    """cast_for_device's bf16 modules, without Module.bfloat16 (which cannot swap fake parameters)."""
    gates = [block.attn.gate for block in model.blocks if block.attn is not None]
    for module in [model.embed, *model.value_embeds, model.head.lm_head, model.smear_gate, *gates]:
        module.weight = torch.nn.Parameter(module.weight.detach().bfloat16())


def normuon_bytes(model: T.GPT, world_size: int, rank: int) -> tuple[int, int]:
    """(state bytes this rank keeps, communication buffer bytes of one step) for NorMuon."""
    muon, _ = T.build_optimizers(model, T.Hyperparameters())
    state = buffers = 0
    for _, params in muon._chunks(world_size):
        ref = params[0]
        if rank < len(params):
            moment = ref.numel() // ref.size(T.neuron_dim(ref.shape))
            state += 4 * (ref.numel() + moment)  # fp32 momentum + per-neuron second moment
        if world_size > 1:  # stacked fp32 gradients, the owned fp32 mean, gathered parameters
            buffers += 4 * world_size * ref.numel() + 4 * ref.numel() + ref.element_size() * world_size * ref.numel()
    return state, buffers


def dist_adam_bytes(model: T.GPT, world_size: int) -> tuple[int, int]:
    """(state bytes per rank, communication buffer bytes of one step) for DistAdam."""
    _, adam = T.build_optimizers(model, T.Hyperparameters())
    state = buffers = 0
    for bucket in adam.buckets:
        size = bucket.params[0].element_size()
        shard = math.ceil(bucket.numel / world_size)
        state += 2 * 4 * shard  # fp32 exp_avg, exp_avg_sq
        if world_size > 1:
            in_place = len(bucket.params) == 1 and bucket.numel == shard * world_size
            buffers += (0 if in_place else 2 * size * shard * world_size) + size * shard  # flat grad/param, shard
    return state, buffers


def mask_bytes(masks: list) -> int:
    """Bytes of the distinct block masks of one micro-batch (layers with the same window share one)."""
    return sum(t.nbytes for m in {id(m): m for m in masks if m is not None}.values()
               for t in m.as_tuple()[2:] if isinstance(t, torch.Tensor))


def breakdown(model: T.GPT, args: T.Hyperparameters, world_size: int, saved_activations: int,
              block_masks: int) -> dict[str, float]:
    """The peak of a training step on rank 0 of world_size, in bytes, from the model in its GPU dtypes,
    the bytes one micro-batch's forward keeps for backward and those of its block masks. Shared with
    tools/preflight.py, which measures the saved activations on the compiled step."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    muon_state, muon_buffers = normuon_bytes(model, world_size, rank=0)
    adam_state, adam_buffers = dist_adam_bytes(model, world_size)
    logits = args.micro_batch_tokens * T.padded_vocab(args.vocab_size) * 2  # bf16
    persistent = 2 * weights + muon_state + adam_state  # weights + gradients + optimizer state
    backward = persistent + saved_activations + 2 * logits + block_masks
    step = persistent + muon_buffers + adam_buffers
    return {"weights": weights, "gradients": weights, "NorMuon state": muon_state, "DistAdam state": adam_state,
            "saved activations": saved_activations, "logits + their gradient": 2 * logits,
            "block masks": block_masks, "optimizer-step buffers": muon_buffers + adam_buffers,
            "peak": max(backward, step)}


def estimate(argv: list[str], world_size: int) -> dict[str, float]:
    args = T.parse_args(["--preset=speedrun", *argv], True)
    T.check_world_size(args, world_size)
    saved: dict = {}

    def keep(t):
        saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    real_attention = T.attention
    T.attention = lambda q, k, v, mask: FlexStandIn.apply(q, k, v)
    try:
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = T.GPT(args, "fp8")
            gpu_dtypes(model)
            tokens = torch.randint(0, T.BOS_ID, (args.micro_batch_tokens + 1,))
            tokens[::1000] = T.BOS_ID
            masks = T.build_masks(tokens[:-1], T.layer_windows(args, (6, 13)), True, args.window_block)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                model(tokens[:-1], tokens[1:], masks)
            return breakdown(model, args, world_size, sum(saved.values()), mask_bytes(masks))
    finally:
        T.attention = real_attention


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 8])
    options = parser.parse_args(ours)
    try:
        rows = {w: estimate(flags, w) for w in options.world_sizes}
    except (T.ConfigError, T.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| per rank (GiB) | " + " | ".join(f"world size {w}" for w in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for key in next(iter(rows.values())):
        print(f"| {key} | " + " | ".join(f"{r[key] / GIB:.2f}" for r in rows.values()) + " |")
    print("| room left on an H100 (81,559 MiB) | " +
          " | ".join(f"{(H100_BYTES - r['peak']) / GIB:.2f}" for r in rows.values()) + " |")
    print(f"block masks: {next(iter(rows.values()))['block masks'] / 2 ** 20:.2f} MiB per micro-batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())

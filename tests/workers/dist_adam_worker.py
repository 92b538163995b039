"""DistAdam in a gloo group, stepping every ADAM_EVERY training steps as the trainer does, against
torch.optim.Adam on the summed (over those steps) mean-over-ranks gradients."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

STEPS, ADAM_EVERY, MICRO = 4, 2, 2  # Adam steps; training steps per Adam step; micro-batches per step
SMALL = 16  # parameters below this many elements are coalesced
# Shapes chosen so that some split evenly over 2 and 3 ranks and some don't, in both kinds of bucket.
GROUPS = [dict(shapes=[(6, 4), (7, 5), (3,), (1,)], lr=0.01), dict(shapes=[(40,), (2, 2), (9, 3)], lr=0.003)]
BETAS, EPS = (0.8, 0.95), 1e-8


def batch(step: int, micro: int, rank: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(training step, micro-batch, rank) data; the loss 0.5*e*p^2 + d*p has gradient d + e*p."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + 10 * rank + len(shape) + sum(shape))
    return torch.randn(shape, generator=g), torch.rand(shape, generator=g)


def loss_fn(params, step, micro, rank):
    total = 0.0
    for p in params:
        d, e = batch(step, micro, rank, tuple(p.shape))
        total = total + (d * p).sum() + 0.5 * (e * p * p).sum()
    return total / MICRO


def check_dist_adam(rank: int, world: int):
    """Asserts every reduced gradient shard, Adam state shard and parameter; inside an initialised group."""
    torch.manual_seed(0)
    init = [[torch.randn(s) for s in g["shapes"]] for g in GROUPS]
    params = [[torch.nn.Parameter(t.clone()) for t in ts] for ts in init]
    refs = [[torch.nn.Parameter(t.clone()) for t in ts] for ts in init]
    flat_params, flat_refs = [p for ps in params for p in ps], [p for ps in refs for p in ps]

    opt = T.DistAdam([dict(params=ps, lr=g["lr"]) for ps, g in zip(params, GROUPS)], betas=BETAS, eps=EPS,
                     small_numel=SMALL)
    ref_opt = torch.optim.Adam([dict(params=ps, lr=g["lr"]) for ps, g in zip(refs, GROUPS)], betas=BETAS, eps=EPS,
                               foreach=False)
    assert len(opt.buckets) == 6, [len(b.params) for b in opt.buckets]  # 4 large + one small bucket per group

    launched = []
    original = T.reduce_scatter_async
    T.reduce_scatter_async = lambda out, inp: (launched.append(inp.numel()), original(out, inp))[1]
    try:
        run_steps(rank, world, opt, ref_opt, flat_params, flat_refs, launched)
    finally:
        T.reduce_scatter_async = original
    print(f"rank {rank}: DistAdam matched torch.optim.Adam for {STEPS} steps of {ADAM_EVERY} at world size {world}")


def run_steps(rank, world, opt, ref_opt, flat_params, flat_refs, launched):
    for step in range(STEPS):
        launched.clear()
        passes = [(ADAM_EVERY * step + sub, micro) for sub in range(ADAM_EVERY) for micro in range(MICRO)]
        for n, (train_step, micro) in enumerate(passes):
            if n < len(passes) - 1:
                with opt.no_sync():
                    loss_fn(flat_params, train_step, micro, rank).backward()
                assert not launched, f"a reduce-scatter was launched inside no_sync: {launched}"
            else:
                loss_fn(flat_params, train_step, micro, rank).backward()
        # All launched by hooks during the last backward, one per bucket, before step() runs.
        assert len(launched) == len(opt.buckets), (len(launched), len(opt.buckets))

        # Reference: plain Adam on the gradients summed over the training steps, averaged over ranks.
        for ref in flat_refs:
            ref.grad = torch.zeros_like(ref)
        for r in range(world):
            for train_step, micro in passes:
                grads = torch.autograd.grad(loss_fn(flat_refs, train_step, micro, r), flat_refs)
                for ref, g in zip(flat_refs, grads):
                    ref.grad += g / world
        ref_of = dict(zip(map(id, flat_params), flat_refs))

        for bucket in opt.buckets:
            bucket.work.wait()
            expected = torch.cat([ref_of[id(p)].grad.reshape(-1) for p in bucket.params])
            expected = torch.nn.functional.pad(expected, (0, bucket.padded_numel - bucket.numel))
            lo = rank * bucket.shard_numel
            assert_close(bucket.grad_shard / world, expected[lo:lo + bucket.shard_numel])

        opt.step()
        # torch.optim.Adam divides by sqrt(v / (1 - beta2^t)) + eps, record #44 (and DistAdam) by
        # (sqrt(v) + eps) / sqrt(1 - beta2^t): the same with torch's eps set to eps / sqrt(1 - beta2^t).
        for group in ref_opt.param_groups:
            group["eps"] = EPS / (1 - BETAS[1] ** (step + 1)) ** 0.5
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        assert len(launched) == len(opt.buckets), "step() launched extra reduce-scatters"

        for bucket in opt.buckets:
            state = opt.state[bucket.params[0]]
            lo = rank * bucket.shard_numel
            for key in ("exp_avg", "exp_avg_sq"):
                expected = torch.cat([ref_opt.state[ref_of[id(p)]][key].reshape(-1) for p in bucket.params])
                expected = torch.nn.functional.pad(expected, (0, bucket.padded_numel - bucket.numel))
                assert_close(state[key], expected[lo:lo + bucket.shard_numel], msg=f"{key} step {step}")
        for p, ref in zip(flat_params, flat_refs):
            assert_close(p.data, ref.data, msg=f"parameter {tuple(p.shape)} step {step}")

        # Every rank holds exactly the same parameters.
        flat = torch.cat([p.data.reshape(-1) for p in flat_params])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        for other in gathered:
            assert torch.equal(other, flat), "parameters differ across ranks"

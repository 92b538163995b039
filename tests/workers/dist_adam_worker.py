"""DistAdam in a gloo group, stepping every ADAM_EVERY training steps as the trainer does, against record
#85's Adam written out here (per element: bias-corrected moments, eps added to sqrt(v), cautious weight decay
lr^2 * wd * p where the update and the weight agree) on the summed (over those steps) mean-over-ranks
gradients; with a tied pair (an embedding that is the lm_head's transpose) untied after TIED_STEPS."""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

STEPS, ADAM_EVERY, MICRO = 4, 2, 2  # Adam steps; training steps per Adam step; micro-batches per step
TIED_STEPS = 2  # Adam steps before the untie
SMALL = 16  # parameters below this many elements are coalesced
# Shapes chosen so that some split evenly over 2 and 3 ranks and some don't, in both kinds of bucket; the
# last two groups are the tied pair (source, target).
GROUPS = [dict(shapes=[(6, 4), (7, 5), (3,), (1,)], lr=0.01, betas=(0.8, 0.95), weight_decay=30.0),
          dict(shapes=[(40,), (2, 2), (9, 3)], lr=0.003, betas=(0.9, 0.99), weight_decay=0.0),
          dict(shapes=[(7, 4)], lr=0.02, betas=(0.5, 0.95), weight_decay=50.0),
          dict(shapes=[(4, 7)], lr=0.02, betas=(0.5, 0.95), weight_decay=50.0)]
EPS = 1e-10


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


class RecordAdam:
    """Record #85's Adam on plain tensors, one parameter at a time, and its tie: the source's gradient is
    added (transposed) to the target's, the source is the target's transpose after each step, and the
    untie gives the source the target's moments and step count, transposed."""

    def __init__(self, params, settings):
        self.params, self.settings = params, settings
        self.state = [dict(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p)) for p in params]
        self.tied = (len(params) - 2, len(params) - 1)

    def step(self, grads):
        grads = list(grads)
        if self.tied:
            source, target = self.tied
            grads[target] = grads[target] + grads[source].T
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if self.tied and i == self.tied[0]:
                continue
            (b1, b2), lr, wd = self.settings[i]
            s = self.state[i]
            s["t"] += 1
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            update = s["m"] / (s["v"].sqrt() + EPS) * (lr * math.sqrt(1 - b2 ** s["t"]) / (1 - b1 ** s["t"]))
            update = update + (update * p > 0) * p * (lr * lr * wd)
            p -= update
        if self.tied:
            self.params[self.tied[0]].copy_(self.params[self.tied[1]].T)

    def untie(self):
        source, target = self.tied
        t = self.state[target]
        self.state[source] = dict(t=t["t"], m=t["m"].T.clone(), v=t["v"].T.clone())
        self.tied = None


def check_dist_adam(rank: int, world: int):
    """Asserts every reduced gradient shard and parameter; inside an initialised group."""
    torch.manual_seed(0)
    init = [[torch.randn(s) for s in g["shapes"]] for g in GROUPS]
    init[-2][0] = init[-1][0].T.contiguous()  # tied: the source starts as the target's transpose
    params = [[torch.nn.Parameter(t.clone()) for t in ts] for ts in init]
    flat_params = [p for ps in params for p in ps]
    refs = [t.clone() for ts in init for t in ts]
    settings = [(g["betas"], g["lr"], g["weight_decay"]) for g in GROUPS for _ in g["shapes"]]

    opt = T.DistAdam([dict(params=ps, lr=g["lr"], betas=g["betas"], weight_decay=g["weight_decay"])
                      for ps, g in zip(params, GROUPS)], eps=EPS, small_numel=SMALL)
    opt.tie(params[-2][0], params[-1][0])
    reference = RecordAdam(refs, settings)
    assert len(opt.buckets) == 8, [len(b.params) for b in opt.buckets]  # 6 large + one small bucket per group

    launched = []
    original = T.reduce_scatter_async
    T.reduce_scatter_async = lambda out, inp: (launched.append(inp.numel()), original(out, inp))[1]
    try:
        run_steps(rank, world, opt, reference, flat_params, launched)
    finally:
        T.reduce_scatter_async = original
    print(f"rank {rank}: DistAdam matched record #85's Adam for {STEPS} steps of {ADAM_EVERY} at world size {world}")


def run_steps(rank, world, opt, reference, flat_params, launched):
    for step in range(STEPS):
        launched.clear()
        tied = opt.tied is not None
        passes = [(ADAM_EVERY * step + sub, micro) for sub in range(ADAM_EVERY) for micro in range(MICRO)]
        for n, (train_step, micro) in enumerate(passes):
            if n < len(passes) - 1:
                with opt.no_sync():
                    loss_fn(flat_params, train_step, micro, rank).backward()
                assert not launched, f"a reduce-scatter was launched inside no_sync: {launched}"
            else:
                loss_fn(flat_params, train_step, micro, rank).backward()
        # All launched by hooks during the last backward, one per bucket (the tied source's joins its
        # target's), before step() runs.
        assert len(launched) == len(opt.buckets) - tied, (len(launched), len(opt.buckets), tied)

        # Reference: the gradients summed over the training steps, averaged over ranks.
        refs = reference.params
        grads = [torch.zeros_like(r) for r in refs]
        for r in range(world):
            for train_step, micro in passes:
                leaves = [t.clone().requires_grad_() for t in refs]
                for g, new in zip(grads, torch.autograd.grad(loss_fn(leaves, train_step, micro, r), leaves)):
                    g += new / world
        for bucket in opt.buckets:
            if bucket.work is None:
                continue  # the tied source
            bucket.work.wait()
            index = [next(i for i, q in enumerate(flat_params) if q is p) for p in bucket.params]
            expected = torch.cat([(grads[i] + (grads[i - 1].T if tied and i == len(grads) - 1 else 0)).reshape(-1)
                                  for i in index])
            expected = torch.nn.functional.pad(expected, (0, bucket.padded_numel - bucket.numel))
            lo = rank * bucket.shard_numel
            assert_close(bucket.grad_shard / world, expected[lo:lo + bucket.shard_numel])

        opt.step()
        reference.step(grads)
        opt.zero_grad(set_to_none=True)
        if step + 1 == TIED_STEPS:
            opt.untie()
            reference.untie()
        assert len(launched) == len(opt.buckets) - tied, "step() launched extra reduce-scatters"
        for p, ref in zip(flat_params, refs):
            assert_close(p.data, ref, msg=f"parameter {tuple(p.shape)} step {step}")
        if tied:
            assert torch.equal(flat_params[-2].data, flat_params[-1].data.T)

        # Every rank holds exactly the same parameters.
        flat = torch.cat([p.data.reshape(-1) for p in flat_params])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        for other in gathered:
            assert torch.equal(other, flat), "parameters differ across ranks"
    assert opt.tied is None


def check_sparse_rows(rank: int, world: int):
    """An embedding table whose gradient touches few rows: DistAdam's sparse exchange (all-to-alls of the
    touched rows, counts over a host group) must give the parameters the dense reduce-scatter gives, for
    rows each rank touches, rows only others touch, and rows nobody touches in a step (Adam's momentum moves
    them)."""
    rows, width, steps = 12 * world, 5, 3
    torch.manual_seed(0)
    init = torch.randn(rows, width)
    table = torch.nn.Parameter(init.clone())
    dense = torch.nn.Parameter(init.clone())
    settings = dict(lr=0.05, betas=(0.75, 0.95), eps=1e-10, weight_decay=5.0)
    sparse_opt = T.DistAdam([dict(params=[table], **settings)], small_numel=1, sparse=table)
    dense_opt = T.DistAdam([dict(params=[dense], **settings)], small_numel=1)
    assert sparse_opt.sparse_bucket is not None
    launched = []
    original = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (launched.append(a[1].numel()), original(*a, **k))[1]
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            # rows 0..rows/2 + 3: each step others, so momentum moves rows untouched in that step; the rest never
            ids = torch.randint(step * 2, step * 2 + rows // 2 - 3, (7,), generator=g)
            for optimizer, param in ((sparse_opt, table), (dense_opt, dense)):
                optimizer.touch_rows(ids.unique().numpy())
                optimizer.start_sparse_exchange()
                (torch.nn.functional.embedding(ids, param) * torch.arange(1.0, width + 1)).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            assert_close(table.data, dense.data, msg=f"step {step}")
    finally:
        dist.all_to_all_single = original
    assert len(launched) == 3 * steps, launched  # counts, rows and values per step; none for the dense table
    assert torch.equal(table.data[rows // 2 + 3:], init[rows // 2 + 3:])  # never touched: never moved
    print(f"rank {rank}: the sparse row exchange matched the dense reduce-scatter at world size {world}")

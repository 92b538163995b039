"""In a gloo group: the smoke model's training steps, recording when every DistAdam reduce-scatter
starts. Each must start from a gradient hook during the backward that completes an Adam step, never
from step(). A second optimizer with a parameter that gets no gradient shows the check can fail: its
bucket is reduced late, from step()."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import train_gpt as T  # noqa: E402
from conftest import SMOKE89  # noqa: E402


def check_hooks(rank: int, world: int):
    """Asserts where every reduce-scatter started; inside an initialised group of a size that splits the batch."""
    # Record #89's smoke-sized model (DistAdam's every bucket on Adam's cadence), steps of 4 micro-batches of 64
    # tokens: what is checked does not depend on their length, and the step's time is mostly the loss head's, in
    # proportion to the tokens (256-token micro-batches: 7.4 s at world size 2).
    args = T.parse_args([*SMOKE89, "--stage_batch_tokens=256,256,256"], False)
    env = T.DistEnv(rank, rank, world, torch.device("cpu"))
    model = T.build_model(args, env)
    muon, adam = T.build_optimizers(model, args)
    loader = T.TrainLoader(args, env)

    launches = []  # (where, bucket size) of every reduce-scatter
    where = ["backward"]
    original = T.reduce_scatter_async
    T.reduce_scatter_async = lambda out, inp: (launches.append((where[0], inp.numel())), original(out, inp))[1]
    try:
        run_steps(args, env, model, muon, adam, loader, launches, where)
    finally:
        T.reduce_scatter_async = original
    print(f"rank {rank}: every DistAdam bucket was reduced from its hook during backward")


def run_steps(args, env, model, muon, adam, loader, launches, where):
    def marked(optimizer, name):
        real_step = optimizer.step

        def step():
            where[0] = name
            try:
                real_step()
            finally:
                where[0] = "backward"
        optimizer.step = step

    marked(adam, "step")
    marked(muon, "muon")  # NorMuon's own reduce-scatters, launched from its step(), are not DistAdam's

    schedule = T.Schedule(args)
    # the first steps, and steps around the untie step: tied, the embedding's gradient joins the lm_head's
    # single reduce-scatter (one launch fewer than buckets); untied, every bucket has its own
    for step in [0, 1, 2, 3, schedule.untie_step - 1, schedule.untie_step, schedule.untie_step + 1,
                 schedule.untie_step + 2]:
        launches.clear()
        tied = adam.tied is not None
        T.set_schedules(step, (muon, adam), schedule, args)
        T.train_step(model, (muon, adam), loader.next_batch(step), step, schedule, args, use_flex=False)
        launches[:] = [launch for launch in launches if launch[0] != "muon"]
        if schedule.adam_steps(step):
            late = [size for w, size in launches if w == "step"]
            assert late == [], f"step {step}: buckets of {late} elements were reduced from step(), not their hooks"
            # the bigram table's rows travel in all-to-alls (DistAdam's sparse exchange), not a reduce-scatter
            assert len(launches) == len(adam.buckets) - tied - 1, (step, launches, len(adam.buckets))
            assert adam.sparse_bucket is not None and adam.sparse_bucket.work is None
            assert torch.equal(model.embed.weight, model.lm_head.T) == tied
        else:
            assert launches == [], f"step {step}: no Adam step, but reduce-scatters {launches}"
    assert adam.tied is None and adam.late_reductions == 0

    # The control: a parameter without a gradient keeps its bucket from completing during backward.
    used, unused = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.zeros(3))
    control = T.DistAdam([dict(params=[used, unused])])
    (used.sum() * 2).backward()
    control.step()
    assert control.late_reductions == 1, control.late_reductions

"""Bench: what rank 0 of the 8xH100 record computes in each stage, measured on one CUDA device.

    python tools/bench.py --out=out/bench                     # one H100 or H200: every part, about 6 minutes
    python tools/bench.py --out=out/bench --parts=stage3,validation
    python tools/bench.py --out=out/bench-cpu --small         # any CPU: every part at a toy size, about a minute
    python tools/bench.py --out=out/bench -- --attention=flex # train_gpt.py flags after --

One GPU cannot run the 8-GPU record, but it can run rank 0's share of each step: one micro-batch of the
stage's tokens per rank (the record deals its 8 micro-batches a step one to each rank), the matrix optimizer's
update of the matrices rank 0 owns (ANVIL, or NorMuon under --preset=record89) and DistAdam's update of rank 0's
shard. The trainer's own code runs it (GPT, compile_model, build_masks, train_step, the optimizers) on real tokens
of the bundled corpus, repeated where a stage needs more. For the optimizers a fake process group of --world_size
ranks makes the trainer take rank 0's path; its collectives are loopback copies (rank 0's own part, so that every
buffer holds real values), whose bytes are counted and whose time is left to the estimate. The model holds record
#92's n-gram table whole (world size 1), so NgramAdam sends no row here; --counts shards it as the run does.

Parts, in the order they run (the most valuable first, so that a run cut short keeps them):
  stage3, optimizer, profile, stage2, stage1, attention, taper, extension, validation, training, fp8, memory_model

  stage3, stage2, stage1, taper, extension  rank 0's micro-batch (its candidate set where the stage samples):
      the first call's compile time and the graphs it made (none after it), forward+backward over --timed
      repetitions after --untimed ones (CUDA events), the block masks' build, and train_step as rank 0 of 8
      runs it, one step of each kind the stage has (without Adam, with Adam, and under record #92's cadence of
      the embeddings with Adam but the embeddings parked); the loss finite at every repetition; the host syncs
      in those steps. The taper is record #92's fourth stage; a schedule without one skips it
  optimizer   the matrix optimizer's step (ANVIL, or NorMuon: --matrix_optimizer) for rank 0's share,
      DistAdam's for its shard (record #85's bigram rows by the sparse exchange) and NgramAdam's (record #92's
      n-gram table), tied (stage 1) and untied (the untie stage)
  profile     torch.profiler over a stage-3 step without Adam and one with it: the top 15 kernels, and the
      shares of attention, matmuls, element-wise work, the loss, the optimizers and idle gaps
  validation  one validation sequence at the final windows, forward only
  attention   per kind of layer, FlexAttention as the trainer compiles it against PyTorch's FlashAttention
      (torch.nn.attention.varlen.varlen_attn, window (W, 0)) on the same q, k, v and documents
  training    30 optimizer steps at world size 1 on stage 1's shapes: the training loss must fall
  fp8         the training loss with FP8 matmuls (MLP up-projection, head) against bf16, same batch and weights
  memory_model  the trainer's memory model for the same shapes at --world_size, beside the measured peaks

DIR/bench.json and DIR/bench.md are rewritten as soon as anything is measured: a run cut short keeps what
it measured. The profile keeps every kernel's row in bench.json (the markdown shows the top 15), so that a CPU
count can be joined to a measurement kernel by kernel.

--counts needs no GPU: the CPU mode (tools/op_counts.py) runs rank 0's steps on a fake H100 and counts what
makes a step slow there: eager kernel-launching ops by source, compiled-graph calls, gradient-accumulation
adds, and with --kernels every compiled kernel's bytes and the loss head's bytes per logit. The markdown ends with an estimated 8xH100 time (see estimate()). At the speedrun's sizes the
bench needs CUDA and refuses in one line without it; --small runs every part on a CPU at a toy size.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import sys
import time
import traceback
import unittest.mock
import warnings
from pathlib import Path


def wants_counts(argv: list[str]) -> bool:
    return "--counts" in (argv[:argv.index("--")] if "--" in argv else argv)


if __name__ == "__main__" and wants_counts(sys.argv[1:]):
    # The CPU mode holds its tensors on a fake H100, whose CUDA hooks PyTorch reads once, when it is imported.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fake_cuda
    try:
        fake_cuda.load()
    except fake_cuda.ShimError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_gpt as T  # noqa: E402
import cost_model  # noqa: E402  (tools/ is on the path: this script's folder)
import op_counts  # noqa: E402
from cost_model import RECORD_MS, RECORD_TOTAL_S  # noqa: E402

PARTS = ("stage3", "optimizer", "profile", "stage2", "stage1", "attention", "taper", "extension", "validation",
         "training", "fp8", "memory_model")
STAGE_PARTS = ("stage1", "stage2", "stage3", "taper", "extension")
# Each stage part's stage, by op_counts.stage_names's name (the taper: record #92's fourth stage)
PART_STAGE = {"stage1": "stage 1", "stage2": "stage 2", "stage3": "stage 3", "taper": "taper", "extension": "extension"}
# --small: the smoke preset (the speedrun's structure at width 64), eight micro-batches a step so that rank 0
# of 8 gets one, compiled (aot_eager on CPU) so that the graph counting runs too.
SMALL_FLAGS = ["--preset=smoke", "--micro_batches=8", "--compile=true"]
CORPUS = REPO / "data" / "shakespeare" / "shakespeare_train_000001.bin"
VAL_CORPUS = REPO / "data" / "shakespeare" / "shakespeare_val_000000.bin"
TRAINING_STEPS = 30
SMALL_TRAINING_STEPS = 6  # on a CPU the toy model's 50,304-way head makes a step of 8 micro-batches take ~1.5 s
PROFILE_TOP = 15
GIB = 2 ** 30


class BenchError(RuntimeError):
    """The bench cannot run as asked; the message names the flag or file."""


# -----------------------------------------------------------------------------
# Measuring: device clocks, host syncs, graphs, memory

class DeviceTimer:
    """Times regions on the device's own clock: CUDA events, read after one sync at the end, so the host
    runs ahead as in training; on CPU, where the host computes, its clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    @contextlib.contextmanager
    def region(self):
        start = T.clock_mark(self.cuda)
        yield
        self.marks.append((start, T.clock_mark(self.cuda)))

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [a.elapsed_time(b) if self.cuda else 1000 * (b - a) for a, b in self.marks]


def stats(ms: list[float]) -> dict:
    return {"median_ms": float(np.median(ms)), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)} if ms else {}


@contextlib.contextmanager
def host_syncs(device: torch.device, found: list[str]):
    """torch.cuda.set_sync_debug_mode over the region, at "warn" so that one run lists every synchronizing
    CUDA call (where in Python it came from) instead of stopping at the first; an empty list is what
    "error" would pass. Nothing to watch on CPU."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if is_sync_warning(str(w.message)):
            found.append(f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:120]}")


def is_sync_warning(message: str) -> bool:
    """A warning of torch.cuda.set_sync_debug_mode("warn") about a synchronizing call; the mode's own notice,
    given once, that it is a prototype is not one (it counted as a sync in the first run on an H200)."""
    return "synchroniz" in message.lower() and "prototype feature" not in message


class GraphCounter:
    """A torch.compile backend that counts the graphs it is handed, then compiles them with inductor (CUDA)
    or runs them as traced (CPU: the same graphs, nothing to build)."""

    def __init__(self, backend: str):
        self.backend, self.graphs = backend, 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(graph_module, example_inputs)
        return graph_module.forward


def memory_now(device: torch.device) -> dict:
    """Peak allocated and reserved since the last reset_peak(), in GiB (CUDA's allocator; None on CPU)."""
    if device.type != "cuda":
        return {"max_allocated_gib": None, "max_reserved_gib": None}
    return {"max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB}


def reset_peak(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


# -----------------------------------------------------------------------------
# Rank 0 of W on one device: a fake process group and loopback collectives

class Done:
    """The handle of a loopback collective: its copy is queued on the stream already."""

    def wait(self):
        return True


class RankOfMany:
    """The trainer's optimizers as rank 0 of world_size builds and steps them. torch's fake process group
    answers get_rank/get_world_size; the collectives the optimizers issue become copies of rank 0's own
    part (a reduce-scatter hands rank 0 its own shard of the input, an all-gather fills every slot with
    rank 0's part unless the slots are the parameter itself, an all-to-all sends rank 0's rows back to it,
    onto rows it owns, with as many rows received as sent: the bigram table's sparse exchange, record #92's n-gram
    rows, pulled and sent to their owners), and their buffers' bytes are counted as the preflight counts them: a
    reduce-scatter's input, an all-gather's output, an all-to-all's send buffer (host count and id exchanges
    included)."""

    def __init__(self, model: T.GPT, args: T.Hyperparameters, world_size: int, backend):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        self.world_size = world_size
        self.bytes: collections.Counter = collections.Counter()
        self.patches = [unittest.mock.patch.object(T, "reduce_scatter_async", self.reduce_scatter),
                        unittest.mock.patch.object(T, "all_gather_async", self.all_gather),
                        unittest.mock.patch.object(dist, "all_to_all_single", self.all_to_all_single)]
        for patch in self.patches:
            patch.start()
        self.optimizers = T.build_optimizers(model, args)
        if args.compile:  # as the trainer's prepare_training
            T.compile_optimizers(self.optimizers, backend)
        self.matrix, self.adam = self.optimizers
        self.tie_pair = self.adam.tie_pair
        # rank 0's rows of the table whose rows travel by all-to-all: record #92's n-gram shard, or record #85's bigram
        self.rows_per_rank = model.ngram.weight.size(0) if model.ngram is not None else \
            getattr(self.adam, "rows_per_rank", None)

    def reduce_scatter(self, output, input):
        self.bytes["reduce-scatter"] += input.nbytes
        output.copy_(input.view(self.world_size, -1)[0])
        return Done()

    def all_gather(self, output, input):
        self.bytes["all-gather"] += output.nbytes
        if input.untyped_storage().data_ptr() != output.untyped_storage().data_ptr():
            output.view(self.world_size, -1).copy_(input.reshape(1, -1).expand(self.world_size, -1))
        return Done()

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        self.bytes["all-to-all"] += input.nbytes
        if output_split_sizes is not None and output.dtype == torch.int64:  # row indices: onto rank 0's rows
            output.copy_(input.remainder(self.rows_per_rank))
        else:
            output.copy_(input)
        return Done() if async_op else None

    def set_tied(self, tied: bool):
        """The embedding tied to the lm_head (stages before --untie_stage) or not, as a step of that stage."""
        source, target = self.tie_pair
        if tied and self.adam.tied is None:
            self.adam.tie(source, target)
        elif not tied and self.adam.tied is not None and self.adam.state.get(target):
            self.adam.untie()

    def close(self):
        for hook in self.adam._hooks:
            hook.remove()
        for patch in self.patches:
            patch.stop()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The bench's state: model, data, report

class Corpus:
    """Steps of micro-batches from one bundled shard, packed as the loader packs FineWeb (DocumentPieces);
    when the shard runs out it starts over (the timings need real tokens, not new ones)."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise BenchError(f"{path}: the bundled corpus is missing (it ships with the repository)")
        self.path, self.pieces, self.next = path, T.DocumentPieces(T.read_shard(path)), 0

    def step(self, num_micro: int, micro_tokens: int, max_len: int) -> list[np.ndarray]:
        taken = self.pieces.take_step(self.next, num_micro, micro_tokens, max_len)
        if taken is None:
            self.next = 0
            taken = self.pieces.take_step(0, num_micro, micro_tokens, max_len)
        if taken is None:
            raise BenchError(f"{self.path}: too short for one step of {num_micro} x {micro_tokens + 1} tokens")
        micro_batches, self.next = taken
        return micro_batches


class Report:
    """What was measured, rewritten to DIR/bench.json and DIR/bench.md at every flush (each file replaced
    whole, so a reader never sees half of one)."""

    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"header": {}, "parts": {}}

    def part(self, name: str) -> dict:
        return self.data["parts"].setdefault(name, {})

    def flush(self):
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BenchError(f"--out={self.out}: cannot make the folder ({e.strerror})") from None
        for name, text in (("bench.json", json.dumps(self.data, indent=1, default=str)),
                           ("bench.md", render_markdown(self.data))):
            T.write_file(self.out / name, text.encode())  # atomic: a temporary beside it, renamed


class Bench:
    """The model (compiled as the trainer compiles it), its initial weights on the host, the schedule, the
    corpus, and rank 0's optimizers once a part needs them."""

    def __init__(self, args: T.Hyperparameters, options: argparse.Namespace, report: Report):
        self.args, self.options, self.report = args, options, report
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.world_size = options.world_size
        self.schedule = T.Schedule(args)
        self.sampler = T.candidate_sampler(args, self.schedule)  # record #92's sampled softmax, where on
        self.env1 = T.DistEnv(0, 0, 1, self.device)
        self.env_rank0 = T.DistEnv(0, 0, self.world_size, self.device)
        self.counter = GraphCounter("inductor" if self.device.type == "cuda" else "eager")
        if self.device.type == "cpu":
            T.keep_freed_cpu_memory()  # as the trainer on CPU: large freed blocks stay in the heap
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # dynamo's limit hit: an error, not a slow run
        self.model = T.build_model(args, self.env1)
        self.initial = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                        for k, v in self.model.state_dict().items()}  # on the host: no GPU memory of its own
        # compiled as the run compiles it; the world-size-1 optimizers it also builds are not used
        _, self.use_flex = T.prepare_training(self.model, args, self.env1, backend=self.counter)
        self.corpus = Corpus(CORPUS)
        self.rank: RankOfMany | None = None
        self.batches: dict[int, T.Batch] = {}

    def rank0(self) -> RankOfMany:
        if self.rank is None:
            self.rank = RankOfMany(self.model, self.args, self.world_size, self.counter)
        return self.rank

    def close_rank0(self):
        if self.rank is not None:
            self.rank.close()
            self.rank = None

    def batch(self, stage_index: int) -> T.Batch:
        """Rank 0's micro-batch(es) of one step of the stage at world_size, with their table rows (the bigram
        table's sparse exchange, or the n-gram rows the step pulls) and, where the stage samples, candidate sets:
        the step's micro-batches dealt as the loader deals them."""
        if stage_index not in self.batches:
            stage = self.schedule.stages[stage_index]
            micro_batches = self.corpus.step(stage.micro_batches, stage.micro_tokens, stage.max_seq_len)
            candidates = self.sampler and self.sampler.for_step(stage.start)
            self.batches[stage_index] = T.rank_micro_batches(micro_batches, self.env_rank0, self.args.bigram_vocab_size,
                                                             self.args.ngram_channels, candidates)
        return self.batches[stage_index]

    def fit_rotary(self, step: int):
        """YaRN as the run leaves it at `step`: fitted window by window from the first stage's windows."""
        for rotary in (self.model.rotary, self.model.narrow_rotary):
            if rotary is not None:
                rotary.reset()
        for stage in self.schedule.stages[:self.schedule.stage_index(step) + 1]:
            self.model.set_windows(stage.windows)

    def restore_initial(self):
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        T.refresh_fp8(self.model)

    def masks(self, inputs: torch.Tensor, windows: tuple[int, int], training: bool = True) -> T.Masks:
        """The block masks as train_step builds them (the model's mask_parts: compiled on CUDA; record #92's cap on
        attention segments, --virtual_seq_cap), or as evaluate builds them (no cap)."""
        return T.build_masks(inputs, self.model.plans, windows, self.args.window_block, self.use_flex,
                             self.model.mask_parts, self.args.virtual_seq_cap if training else 0)

    def mtp(self, step: int) -> torch.Tensor:
        return T.host_to_device(torch.tensor(self.schedule.mtp_weights(step)), self.device)

    def no_sync(self):
        """Backward without DistAdam's reduce-scatter hooks (a forward+backward alone, as in a step without Adam)."""
        return self.rank.adam.no_sync() if self.rank is not None else contextlib.nullcontext()


# -----------------------------------------------------------------------------
# Parts

def forward_backward(bench: Bench, inputs, targets, masks, mtp, loss_scale: float, rows=None,
                     **loss_terms) -> torch.Tensor:
    """loss_terms: the step's prefix weight and candidate set, as train_step passes them; rows: the n-gram rows the
    micro-batch reads, pulled with a gradient as every training step pulls them (the compiled graphs differ without)."""
    bench.model.zero_grad(set_to_none=True)
    if rows is not None:
        T.ngram_pull(bench.model.ngram, rows, grad=True)
    with bench.no_sync():
        loss = bench.model(inputs, targets, masks, mtp, loss_scale=loss_scale, **loss_terms)
        loss.backward()
    if rows is not None:
        bench.model.ngram.view = None
    return loss.detach()


def loss_terms(bench: Bench, batch: T.Batch, step: int) -> dict:
    """What train_step passes the loss of the batch's first micro-batch at `step` beside the targets: the prefix
    weight (record #88) and the candidate set (record #92's sampled softmax), each None where the step has none."""
    prefix = bench.schedule.prefix_weight(step)
    return dict(candidates=batch.candidates[0],
                prefix_weight=T.host_to_device(torch.tensor([prefix]), bench.device) if prefix is not None else None)


def stage_of_part(part: str, schedule: T.Schedule) -> int:
    """The index into Schedule.stages of a stage part (PART_STAGE: its stage's name, op_counts.stage_names)."""
    names = op_counts.stage_names(schedule)
    if PART_STAGE[part] not in names or schedule.stages[names.index(PART_STAGE[part])].end <= \
            schedule.stages[names.index(PART_STAGE[part])].start:
        raise BenchError(f"--parts={part}: this schedule has no such stage, or it has no steps")
    return names.index(PART_STAGE[part])


def longest_stage(schedule: T.Schedule) -> int:
    """The stage of the longest steps (the most tokens; the first of equals): what the profile and the attention
    part measure (stage 3 in every record)."""
    scheduled = schedule.stages[:-1]
    return max(range(len(scheduled)), key=lambda i: (scheduled[i].batch_tokens, -i))


def untie_stage(schedule: T.Schedule) -> int | None:
    return schedule.stage_index(schedule.untie_step) if schedule.untie_step is not None else None


def kind_key(kind: str) -> str:
    """A kind of step (op_counts.STEP_KINDS) as a part of a JSON key: "with Adam, embeddings parked" ->
    "with_Adam_embeddings_parked"."""
    return re.sub(r"\W+", "_", kind)


def run_stage(bench: Bench, name: str, stage_index: int, row: dict, flush):
    """One stage: compile, forward+backward, masks, and train_step as rank 0 of W."""
    options, device, schedule = bench.options, bench.device, bench.schedule
    stage = schedule.stages[stage_index]
    step = stage.start
    bench.fit_rotary(step)
    batch = bench.batch(stage_index)
    inputs, targets = batch[0]
    windows, mtp = schedule.windows(step), bench.mtp(step)
    loss_scale = 1 / len(batch)
    terms = dict(loss_terms(bench, batch, step), rows=batch.ngram_rows[0] if batch.ngram_rows else None)
    row.update(candidates=schedule.candidates(step), stage=name, steps=stage.end - stage.start, micro_tokens=stage.micro_tokens,
               micro_batches_per_rank=len(batch), windows=list(windows), max_seq_len=stage.max_seq_len,
               mtp_weights=list(schedule.mtp_weights(step)), attn_scale=float(bench.model.rotary.attn_scale),
               documents=int((inputs == T.BOS_ID).sum()))
    masks = bench.masks(inputs, windows)

    graphs = bench.counter.graphs
    start = time.perf_counter()
    first = forward_backward(bench, inputs, targets, masks, mtp, loss_scale, **terms)
    T.sync(device)
    row["compile_s"] = time.perf_counter() - start
    row["graphs_compiled"] = bench.counter.graphs - graphs
    flush()

    for _ in range(options.untimed):
        forward_backward(bench, inputs, targets, masks, mtp, loss_scale, **terms)
    reset_peak(device)
    timer, losses, syncs = DeviceTimer(device), [first], []
    with host_syncs(device, syncs):
        for _ in range(options.timed):
            with timer.region():
                losses.append(forward_backward(bench, inputs, targets, masks, mtp, loss_scale, **terms))
    row["forward_backward"] = stats(timer.ms())
    row["forward_backward_memory"] = memory_now(device)
    values = torch.stack(losses).float().cpu()
    row["loss_per_token"] = float(values[-1]) / stage.micro_tokens / loss_scale
    row["losses_finite"] = bool(torch.isfinite(values).all())
    row["host_syncs_forward_backward"] = syncs
    flush()

    timer = DeviceTimer(device)
    for repetition in range(options.untimed + options.timed):
        with timer.region():
            bench.masks(inputs, windows)
    row["masks"] = stats(timer.ms()[options.untimed:])
    flush()

    recompiled = bench.counter.graphs - graphs - row["graphs_compiled"]  # in the timed forward+backward, masks
    compiled, recompiled_in_steps = rank_steps(bench, stage_index, row)
    row["graphs_compiled"] += compiled  # the optimizers' and the FP8 refresh's, in the untimed cycle
    row["recompiles_after_first_call"] = recompiled + recompiled_in_steps
    flush()


def rank_steps(bench: Bench, stage_index: int, row: dict) -> tuple[int, int]:
    """train_step as rank 0 of W runs it on the stage's steps: a warm cycle (untimed: it compiles the optimizers'
    graphs, makes their state, unties the embedding in the untie stage), then one step of each kind the stage has
    (op_counts.count_plan: without Adam, with Adam, and under record #92's cadence of the embeddings an Adam step
    that leaves them parked), repeated. Each kind's device time, the bytes its collectives move, its peak memory
    and any host sync; kind_steps, how many of the stage's steps are of each kind. Returns the graphs compiled in
    the untimed cycle and in the timed steps (none should be)."""
    args, device, schedule = bench.args, bench.device, bench.schedule
    rank = bench.rank0()
    batch = bench.batch(stage_index)
    warm, counted = op_counts.count_plan(schedule, stage_index)
    rank.set_tied(tied_at(schedule, warm[0]))
    timers = {kind: DeviceTimer(device) for kind in counted}
    bytes_by_kind: dict = {}
    syncs: list[str] = []
    graphs, start = bench.counter.graphs, time.perf_counter()
    for s in warm:
        T.set_schedules(s, rank.optimizers, schedule, args)
        T.train_step(bench.model, rank.optimizers, batch, s, schedule, args, bench.use_flex)
    T.sync(device)
    row["untimed_cycle_s"] = time.perf_counter() - start
    compiled = bench.counter.graphs - graphs
    rank.set_tied(tied_at(schedule, min(counted.values())))
    reset_peak(device)
    with host_syncs(device, syncs):
        for repetition in range(bench.options.timed // 2 + 1):
            for kind, s in sorted(counted.items(), key=lambda item: item[1]):
                T.set_schedules(s, rank.optimizers, schedule, args)
                rank.bytes.clear()
                with timers[kind].region():
                    T.train_step(bench.model, rank.optimizers, batch, s, schedule, args, bench.use_flex)
                bytes_by_kind[kind] = dict(rank.bytes)
    for kind, timer in timers.items():
        row[f"rank_step_{kind_key(kind)}"] = stats(timer.ms()[1:])  # the first of each kind warms the state
    row["kind_steps"] = op_counts.kind_steps(schedule, stage_index)
    row["rank_step_bytes"] = bytes_by_kind
    row["rank_step_memory"] = memory_now(device)
    row["host_syncs_rank_step"] = syncs
    row["embedding_tied"] = rank.adam.tied is not None
    return compiled, bench.counter.graphs - graphs - compiled


def tied_at(schedule: T.Schedule, step: int) -> bool:
    """Whether the embedding is still tied to the lm_head when `step` starts (the untie step unties it after
    its Adam step)."""
    return schedule.untie_step is None or step <= schedule.untie_step


MATRIX_NAMES = {"normuon": "NorMuon", "anvil": "ANVIL"}  # --matrix_optimizer's, as the bench names its timings


@contextlib.contextmanager
def table_apart(adam: T.DistAdam):
    """DistAdam without its NgramAdam (record #92's n-gram table), which its step() would call at the end: the
    buckets' step and the table's are timed apart."""
    table, adam.table = adam.table, None
    try:
        yield table
    finally:
        adam.table = table


def run_optimizer(bench: Bench, row: dict, flush):
    """The matrix optimizer's step (NorMuon or ANVIL, --matrix_optimizer), DistAdam's and, with record #92's n-gram
    table, NgramAdam's (the rows' gradients to their owners by all-to-all, then its row-sparse update), each alone,
    as rank 0 of W: gradients from one backward of a stage's micro-batch with DistAdam's hooks on (their
    reduce-scatters start during it, as in an Adam step), on an Adam step of the embeddings too."""
    args, options, device, schedule = bench.args, bench.options, bench.device, bench.schedule
    rank = bench.rank0()
    matrix, adam = rank.optimizers
    name = MATRIX_NAMES[args.matrix_optimizer]
    W = bench.world_size
    owned = [m for stack in matrix.stacks for m in stack.mine if m is not None]
    weights = sum(matrix._view(matrix.matrices[m][0], m).numel() for m in owned)
    rows = (f"NgramAdam: the n-gram table's {adam.table.table.weight.size(0):,} rows on rank 0 (the bench's model holds "
            f"the whole table: no row travels), the rows with a gradient stepped" if adam.table is not None else
            "the bigram table's gradient rows travel by the sparse exchange")
    row["share"] = (f"{name}: the {len(matrix.matrices)} matrices in {len(matrix.stacks)} stacks of one shape, dealt "
                    f"round robin; rank 0 updates {len(owned)} of them ({weights:,} weights), one batched update per "
                    f"stack, and stacks and copies back all of them. DistAdam: {len(adam.buckets)} buckets, rank 0 "
                    f"updates elements [0, ceil(numel / {W})) of each "
                    f"({sum(b.shard_numel for b in adam.buckets):,} in all); {rows}")
    row["timed"] = [name, "DistAdam"] + (["NgramAdam"] if adam.table is not None else [])
    untied = untie_stage(schedule)
    for label, stage_index in (("tied", 0), ("untied", untied)):
        if stage_index is None:
            continue
        stage = schedule.stages[stage_index]
        # an Adam step of every Adam parameter, the embeddings included
        step = next(s for s in range(stage.start, stage.end + schedule.embed_period + args.adam_every)
                    if op_counts.step_kind(schedule, s) == op_counts.WITH_ADAM)
        bench.fit_rotary(step)
        batch = bench.batch(stage_index)
        inputs, targets = batch[0]
        windows, mtp = schedule.windows(step), bench.mtp(step)
        masks = bench.masks(inputs, windows)
        T.set_schedules(step, rank.optimizers, schedule, args)
        timers = {timed: DeviceTimer(device) for timed in row["timed"]}
        for repetition in range(options.untimed + options.timed):
            rank.set_tied(label == "tied")
            adam.set_embedding_step(True)
            bench.model.zero_grad(set_to_none=True)
            adam.touch_rows(batch.bigram_rows[0] if batch.bigram_rows else None)
            if adam.table is not None:
                adam.table.begin_step(batch.ngram_rows)
            adam.start_sparse_exchange()
            loss = bench.model(inputs, targets, masks, mtp, loss_scale=1 / len(batch), **loss_terms(bench, batch, step))
            loss.backward()  # DistAdam's hooks start its reduce-scatters (and the sparse exchange)
            if adam.table is not None:
                adam.table.end_step()
            with timers[name].region():
                matrix.step()
            with table_apart(adam) as table:
                with timers["DistAdam"].region():
                    adam.step()
            if table is not None:
                with timers["NgramAdam"].region():
                    table.step()
        for timed, timer in timers.items():
            row[f"{timed}_{label}"] = stats(timer.ms()[options.untimed:])
        row[f"late_reductions_{label}"] = adam.late_reductions
        flush()
    bench.model.zero_grad(set_to_none=True)


def kernel_kind(name: str) -> str:
    """Which kind of work a CUDA kernel does, by its name: inductor's templates (no max-autotune: FlexAttention
    alone) and FlashAttention's kernels are attention; cuBLAS's and CUTLASS's are matmuls."""
    lowered = name.lower()
    if "triton_tem" in lowered or "flash" in lowered or "fmha" in lowered or "flex" in lowered:
        return "attention"
    if any(word in lowered for word in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "gemv", "wgmma")):
        return "matmul"
    if "memcpy" in lowered or "memset" in lowered:
        return "copies"
    return "element-wise and reductions"


def summarize_kernels(kernels: list[tuple[str, float, float]], top: int = PROFILE_TOP) -> dict:
    """kernels: (name, start_us, end_us) on one stream. The top kernels by total time; each kind's share of
    the span from the first kernel's start to the last one's end, and the idle gaps' share (the span less
    the union of the kernels' intervals)."""
    if not kernels:
        return {}
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    for name, start, end in kernels:
        totals[name][0] += end - start
        totals[name][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    span = max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)
    busy, covered_to = 0.0, -math.inf
    for _, start, end in sorted(kernels, key=lambda k: k[1]):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    by_kind: dict = collections.Counter()
    for name, (total, _) in totals.items():
        by_kind[kernel_kind(name)] += total
    shares = {kind: total / span for kind, total in sorted(by_kind.items())}
    shares["idle gaps"] = (span - busy) / span
    rows = [{"name": name[:160], "ms": total / 1000, "calls": calls, "kind": kernel_kind(name)}
            for name, (total, calls) in ranked]
    return {"span_ms": span / 1000, "busy_ms": busy / 1000, "kernel_count": len(kernels),
            "top": rows[:top], "every_kernel": rows,
            "shares_by_kind": shares}


@contextlib.contextmanager
def labelled(bench: Bench, rank: RankOfMany):
    """record_function ranges around the phases of a step, for the profile: the masks, the forward (the
    loss within it), the optimizers' steps. Backward runs on autograd's thread: what no range holds."""
    from torch.profiler import record_function

    def wrap(label, fn):
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call

    muon, adam = rank.optimizers
    with unittest.mock.patch.object(T, "build_masks", wrap("bench:masks", T.build_masks)), \
            unittest.mock.patch.object(T.SoftcappedMTPLoss, "apply", wrap("bench:loss", T.SoftcappedMTPLoss.apply)), \
            unittest.mock.patch.object(bench.model, "forward", wrap("bench:forward", bench.model.forward)), \
            unittest.mock.patch.object(muon, "step", wrap("bench:optimizer", muon.step)), \
            unittest.mock.patch.object(adam, "step", wrap("bench:optimizer", adam.step)):
        yield


def run_profile(bench: Bench, row: dict, flush):
    """torch.profiler over one Adam cycle (a step without Adam, one with it) as rank 0 of W, in stage 3 (the
    longest steps) and in stage 1 (the shortest, where the host's work shows most)."""
    schedule = bench.schedule
    for stage_index in (longest_stage(schedule), 0):
        name = op_counts.stage_names(schedule)[stage_index]
        row.setdefault("by_stage", {})[name] = profile_cycle(bench, stage_index)
        flush()


def kernel_intervals(events) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the kernels among the profiler's events. The GPU spans of record_function
    ranges (ours, and torch.optim's "Optimizer.step#NorMuon.step") are device events too, user annotations
    that cover kernels: counted as kernels in the first run on an H200, they hid 24 ms of a 286 ms span."""
    from torch.autograd import DeviceType
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith(("bench:", "ProfilerStep"))]


def kernels_under(event) -> list:
    """The kernels an op and the ops it called launched (FunctionEvent.kernels, down its CPU children)."""
    found = list(event.kernels)
    for child in event.cpu_children:
        found += kernels_under(child)
    return found


def profile_cycle(bench: Bench, stage_index: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    args, device, schedule = bench.args, bench.device, bench.schedule
    rank = bench.rank0()
    stage = schedule.stages[stage_index]
    steps = list(range(stage.start + args.adam_every, stage.start + 2 * args.adam_every))
    bench.fit_rotary(steps[0])
    batch = bench.batch(stage_index)
    rank.set_tied(tied_at(schedule, stage.start))
    for s in range(stage.start, stage.start + args.adam_every):  # warm: the optimizers' state, the untie
        T.set_schedules(s, rank.optimizers, schedule, args)
        T.train_step(bench.model, rank.optimizers, batch, s, schedule, args, bench.use_flex)
    rank.set_tied(tied_at(schedule, steps[0]))
    T.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, labelled(bench, rank):
        for s in steps:
            T.set_schedules(s, rank.optimizers, schedule, args)
            T.train_step(bench.model, rank.optimizers, batch, s, schedule, args, bench.use_flex)
        T.sync(device)
    row: dict = {"steps": steps}
    events = prof.events()
    kernels = kernel_intervals(events)
    if kernels:
        row.update(summarize_kernels(kernels))
        device_total = lambda e: getattr(e, "device_time_total", 0.0)  # noqa: E731
        busy_us = row["busy_ms"] * 1000
    else:  # CPU: the ops' own times stand in for kernels
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        row["top"] = [{"name": e.key[:160], "ms": e.self_cpu_time_total / 1000, "calls": e.count, "kind": "cpu op"}
                      for e in ops[:PROFILE_TOP] if not e.key.startswith("bench:")]
        device_total = lambda e: e.cpu_time_total  # noqa: E731
        busy_us = sum(e.self_cpu_time_total for e in ops if not e.key.startswith("bench:"))
    phases, loss_kernels = collections.Counter(), collections.Counter()
    for e in events:
        if e.name.startswith("bench:") and e.device_type == DeviceType.CPU:
            phases[e.name.removeprefix("bench:")] += device_total(e)
            if e.name == "bench:loss":
                for k in kernels_under(e):
                    loss_kernels[k.name] += k.duration
    phases["forward"] -= phases["loss"]  # the loss runs inside the forward
    phases["backward and the rest"] = busy_us - sum(phases.values())
    row["shares_by_phase"] = {name: total / busy_us for name, total in phases.items()} if busy_us else {}
    row["loss_top"] = [{"name": name[:160], "ms": us / 1000} for name, us in loss_kernels.most_common(6)]
    row["phase_note"] = ("shares of the device's busy time: masks, forward (the loss apart), the loss (its FP8 "
                         "matmuls and element-wise chunk, gradients included), the optimizers' steps; backward "
                         "runs on autograd's thread, outside every range, with the fp8 refresh and copies")
    return row


def run_validation(bench: Bench, row: dict, flush):
    """One validation sequence (val_seq_len tokens of the bundled validation text, repeated as needed) at the
    final windows, with YaRN as the run leaves it, forward only."""
    args, options, device, schedule = bench.args, bench.options, bench.device, bench.schedule
    bench.fit_rotary(args.num_iterations)
    windows = schedule.windows(args.num_iterations, final_validation=True)
    text = T.read_shard(VAL_CORPUS)
    tokens = torch.from_numpy(np.tile(text, math.ceil((args.val_seq_len + 1) / len(text)))[:args.val_seq_len + 1])
    buf = T.to_device(tokens, device)
    inputs, targets = buf[:-1], buf[1:]
    row.update(tokens=args.val_seq_len, windows=list(windows), attn_scale=float(bench.model.rotary.attn_scale))
    bench.model.zero_grad(set_to_none=True)
    bench.model.eval()
    try:
        with torch.no_grad():
            graphs, start = bench.counter.graphs, time.perf_counter()
            masks = bench.masks(inputs, windows, training=False)
            loss = bench.model(inputs, targets, masks)
            T.sync(device)
            row["compile_s"], row["graphs_compiled"] = time.perf_counter() - start, bench.counter.graphs - graphs
            row["loss_per_token"] = float(loss) / args.val_seq_len
            flush()
            reps = max(3, options.timed // 4)
            reset_peak(device)
            timer, mask_timer = DeviceTimer(device), DeviceTimer(device)
            for _ in range(reps):
                with mask_timer.region():
                    masks = bench.masks(inputs, windows, training=False)
                with timer.region():
                    bench.model(inputs, targets, masks)
            row["forward"], row["masks"] = stats(timer.ms()), stats(mask_timer.ms())
            row["memory"] = memory_now(device)
            row["recompiles_after_first_call"] = bench.counter.graphs - graphs - row["graphs_compiled"]
    finally:
        bench.model.train()


def varlen_boundaries(docs: torch.Tensor, pad_to: int | None = None) -> tuple[torch.Tensor, int]:
    """FlashAttention's cumulative document lengths (int32) for a sequence's document ids, and the longest
    document; pad_to: that many entries, the last offset repeated (empty documents), as a fixed-shape
    version would keep them."""
    starts = torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1
    cu = torch.cat([docs.new_zeros(1), starts, docs.new_full((1,), docs.numel())]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    if pad_to is not None and pad_to > cu.numel():
        cu = torch.cat([cu, cu[-1:].expand(pad_to - cu.numel())])
    return cu, longest


def attention_backends(bench: Bench, device: torch.device) -> dict:
    """Each backend: (prepare(q, k, v, docs, window, max_len, scale) -> fn() -> output (1, H, T, D), whether it
    has a backward here). On CUDA: FlexAttention compiled as compile_model(attention_only=True) compiles it,
    and varlen_attn with exact and with fixed-shape boundaries; on CPU: the dense SDPA path and FlexAttention
    forward (no CPU backward), uncompiled."""
    block = bench.args.window_block

    def flex(compiled):
        def prepare(q, k, v, docs, window, max_len, scale):
            mask = T.flex_block_mask(docs, window, block)
            return lambda: compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale)
        return prepare

    def sdpa(q, k, v, docs, window, max_len, scale):
        mask = T.dense_attention_mask(docs, window)
        return lambda: T.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale)

    def varlen(fixed: bool):
        def prepare(q, k, v, docs, window, max_len, scale):
            from torch.nn.attention.varlen import varlen_attn
            cu, longest = varlen_boundaries(docs, docs.numel() // block + 1 if fixed else None)
            length = max_len if fixed else longest
            return lambda: varlen_attn((q[0] * scale.type_as(q)), k[0], v[0], cu, cu, length, length,
                                       window_size=(window, 0), scale=1.0)[None].transpose(1, 2)
        return prepare

    if device.type == "cuda":
        compiled = torch.compile(T.attention, backend=bench.counter, dynamic=False, fullgraph=True)
        backends = {"flex": (flex(compiled), True)}
        if importlib.util.find_spec("torch.nn.attention.varlen") is not None:  # PyTorch 2.11 and later
            backends["varlen"] = (varlen(fixed=False), True)
            backends["varlen fixed shapes"] = (varlen(fixed=True), True)
        return backends
    return {"sdpa": (sdpa, True), "flex": (flex(T.attention), False)}


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_attention(bench: Bench, row: dict, flush):
    """Per kind of layer of stage 3 (its micro-batch's documents and windows, YaRN's scale), each backend on
    the same q, k, v (bf16 on CUDA, normed as QK-norm leaves them) and output gradient: forward+backward
    time, and each output and gradient against the first backend's; every backend against an fp32 dense
    reference over the first queries."""
    args, device, schedule = bench.args, bench.device, bench.schedule
    stage_index = longest_stage(schedule)
    stage = schedule.stages[stage_index]
    bench.fit_rotary(stage.start)
    inputs = bench.batch(stage_index)[0][0]
    docs = T.document_ids(inputs)
    scale = bench.model.rotary.attn_scale
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, head_dim = bench.model.num_heads, bench.model.head_dim
    layers = collections.Counter((p.long_window, p.paired) for p in bench.model.plans if p.attention)
    backends = attention_backends(bench, device)
    row.update(stage=op_counts.stage_names(schedule)[stage_index], micro_tokens=stage.micro_tokens, backends=list(backends), kinds={})
    generator = torch.Generator(device=device).manual_seed(0)
    for (long_window, paired), count in sorted(layers.items()):
        kind = f"{'long' if long_window else 'short'} window{', paired' if paired else ''}"
        window = T.window_tokens(stage.windows, long_window, args.window_block)
        length, h = len(inputs) * (2 if paired else 1), heads // 2 if paired else heads
        layer_docs = docs.repeat_interleave(2) if paired else docs
        shape = (1, length, h, head_dim)  # (B, T, H, D), as the layer holds them before attention
        q, k = (F.rms_norm(torch.randn(shape, device=device, generator=generator), (head_dim,), eps=T.NORM_EPS)
                for _ in range(2))
        v = torch.randn(shape, device=device, generator=generator)
        grad = torch.randn(1, h, length, head_dim, device=device, generator=generator).to(dtype)
        result = {"layers": count, "window": window, "positions": length, "heads": h}
        outputs = {}
        for name, (prepare, has_backward) in backends.items():
            leaves = [t.to(dtype).requires_grad_(has_backward) for t in (q, k, v)]
            max_len = 2 * stage.max_seq_len if paired else stage.max_seq_len
            try:
                fn = prepare(*leaves, layer_docs, window, max_len, scale)
                result[name], outputs[name] = time_attention(fn, leaves, grad if has_backward else None, bench)
            except Exception as e:  # one backend's failure (a kernel this device lacks) is its row
                result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        reference = attention_reference(q, k, v, layer_docs, window, scale, dtype)
        compare_attention(result, outputs, reference)
        row["kinds"][kind] = result
        flush()
    row["verdict"] = attention_verdict(row)


def time_attention(fn, leaves: list, grad: torch.Tensor | None, bench: Bench) -> tuple[dict, tuple]:
    """fn's forward (and backward with `grad`) timed; its row, and (output, input gradients) to compare."""
    def once():
        for t in leaves:
            t.grad = None
        out = fn()
        if grad is not None:
            out.backward(grad)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention uncompiled (CPU) says it is slow
        out = once().detach()
        for _ in range(bench.options.untimed):
            once()
        timer = DeviceTimer(bench.device)
        for _ in range(bench.options.timed):
            with timer.region():
                once()
    timing = {("forward_backward" if grad is not None else "forward"): stats(timer.ms())}
    return timing, (out, [t.grad for t in leaves] if grad is not None else None)


def attention_reference(q, k, v, docs, window: int, scale, dtype, queries: int = 2048) -> torch.Tensor:
    """The attention of the first `queries` positions in fp32 from the inputs as the backends see them (dtype),
    with the dense mask: they see no later key, so the slice is exact. (1, H, queries, D)."""
    queries = min(queries, q.size(1))
    mask = T.dense_attention_mask(docs[:queries], window)
    qr, kr, vr = (t[:, :queries].transpose(1, 2).to(dtype).float() for t in (q, k, v))
    return F.scaled_dot_product_attention(qr * scale.float(), kr, vr, attn_mask=mask, scale=1.0)


def compare_attention(result: dict, outputs: dict, reference: torch.Tensor):
    """Each backend's output against the reference, and (output, gradients) against the first backend's."""
    first = next(iter(outputs), None)
    for name, (out, grads) in outputs.items():
        result[name]["vs_fp32_reference_rel_l2"] = relative_l2(out[:, :, :reference.size(2)], reference)
        if name != first:
            base, base_grads = outputs[first]
            result[name][f"vs_{first}"] = {
                "max_abs_diff": float((out.float() - base.float()).abs().max()), "rel_l2": relative_l2(out, base),
                "grads_rel_l2": ([relative_l2(g, b) for g, b in zip(grads, base_grads)]
                                 if grads is not None and base_grads is not None else None)}


def attention_verdict(row: dict) -> dict:
    """Per backend, the attention time of one step's layers (each kind's time times its layers) and whether
    its outputs match the first backend's as closely as that one matches an fp32 reference (bf16 rounding)."""
    totals, matches = collections.Counter(), {}
    for result in row["kinds"].values():
        for name in row["backends"]:
            timing = result.get(name, {}).get("forward_backward")
            if timing:
                totals[name] += result["layers"] * timing["median_ms"]
            else:
                totals[name] = math.inf
            if name != row["backends"][0] and "vs_fp32_reference_rel_l2" in result.get(name, {}):
                base = result[row["backends"][0]]["vs_fp32_reference_rel_l2"]
                ok = result[name]["vs_fp32_reference_rel_l2"] <= max(2 * base, 1e-2)
                matches[name] = matches.get(name, True) and ok
    finite = {name: ms for name, ms in totals.items() if math.isfinite(ms)}
    fastest = min(finite, key=finite.get) if finite else None
    return {"ms_per_micro_batch": dict(totals), "matches_within_bf16": matches, "fastest": fastest}


def run_training(bench: Bench, row: dict, flush):
    """--training_steps real optimizer steps at world size 1 from the initial weights, stage 1's shapes and
    micro-batches: each step's training loss per token (the multi-token objective) and device time."""
    args, device, schedule = bench.args, bench.device, bench.schedule
    bench.close_rank0()
    bench.restore_initial()
    optimizers = T.build_optimizers(bench.model, args)
    stage = schedule.stages[0]
    steps = range(stage.start, min(stage.start + bench.options.training_steps, stage.end))
    timer, losses, syncs = DeviceTimer(device), [], []
    bench.fit_rotary(stage.start)
    with host_syncs(device, syncs):
        for step in steps:
            T.set_schedules(step, optimizers, schedule, args)
            micro_batches = bench.corpus.step(schedule.micro_batches(step), schedule.micro_tokens(step),
                                              schedule.stage(step).max_seq_len)
            batch = T.rank_micro_batches(micro_batches, bench.env1, args.bigram_vocab_size, args.ngram_channels,
                                         bench.sampler and bench.sampler.for_step(step))
            with timer.region():
                losses.append(T.train_step(bench.model, optimizers, batch, step, schedule, args, bench.use_flex))
    values = [float(loss) / schedule.stage(step).batch_tokens for loss, step in zip(losses, steps)]
    row.update(steps=len(values), micro_batches=schedule.micro_batches(stage.start), micro_tokens=stage.micro_tokens,
               losses=values, step=stats(timer.ms()), host_syncs=syncs)
    k = max(1, min(5, len(values) // 2))  # the first and last five steps (of a short run, its halves)
    head, tail = np.mean(values[:k]), np.mean(values[-k:])
    row["falls"] = bool(np.isfinite(values).all() and tail < head)
    row["compared_steps"], row["first_mean"], row["last_mean"] = k, float(head), float(tail)


def run_fp8(bench: Bench, row: dict, flush):
    """The training loss of one stage-1 micro-batch with FP8 matmuls (MLP up-projections, head) and without
    (bf16 on GPUs), the same weights (the model's now: after the training part, when it ran) and batch, on
    an uncompiled copy (FlexAttention compiled alone) whose precision is switched in place."""
    args, device, schedule = bench.args, bench.device, bench.schedule
    with torch.device(device):
        model = T.cast_parameters(T.GPT(args, T.Numerics(T.compute_dtype(device), "fp8", "fp8")))
    bench.fit_rotary(0)
    model.load_state_dict(bench.model.state_dict())  # the weights, and the rotary state of stage 1
    T.refresh_fp8(model)
    if bench.use_flex:
        T.compile_model(model, backend=bench.counter, attention_only=True)
    inputs, targets = bench.batch(0)[0]
    windows, mtp = schedule.windows(0), bench.mtp(0)
    masks = T.build_masks(inputs, model.plans, windows, args.window_block, bench.use_flex)
    losses = {}
    with torch.no_grad():
        for precision in ("fp8", "bf16"):
            model.numerics = dataclasses.replace(model.numerics, head=precision)
            for mlp in (m for block in model.blocks for m in (block.mlp, block.parallel_mlp) if m is not None):
                mlp.precision = precision
            losses[precision] = float(model(inputs, targets, masks, mtp)) / len(inputs)
    row["loss_per_token"] = losses
    row["relative_difference"] = abs(losses["fp8"] - losses["bf16"]) / abs(losses["bf16"])
    row["weights"] = "after the training part" if "training" in bench.report.data["parts"] else "initial"
    row["other_precision"] = "bf16" if device.type == "cuda" else "fp32 (the weights' dtype on CPU)"


def run_memory_model(bench: Bench, row: dict, flush):
    """train_gpt.MemoryModel's phases for the same configuration at world size W (the trainer's start-up
    check): its predicted peak per phase, and the parts of it."""
    args, device = bench.args, bench.device
    attention_kind = T.resolve_attention(args, device)
    model = T.memory_model(args, bench.world_size, device, bench.model.numerics, attention_kind)
    row["world_size"] = bench.world_size
    row["phases"] = {name: {key: value / GIB for key, value in phase.items()}
                     for name, phase in model.phases().items()}


# -----------------------------------------------------------------------------
# The estimate and the markdown

def estimate(data: dict, bus_gbps: float, world_size: int) -> dict:
    """The 8xH100 time from the measured rank steps: per stage, the mean of rank 0's steps (each kind of step,
    op_counts.STEP_KINDS, weighted by how many of the stage's steps are of that kind: kind_steps) plus their
    communication, all of it counted as not overlapped (an upper bound: the matrix optimizer's exchanges follow the
    backward, the all-gathers follow the updates, and DistAdam's largest reduce-scatters, the value and token
    embeddings', are only ready at the end of backward), at a bus bandwidth of bus_gbps GB/s: bytes * (W - 1) / W /
    bandwidth (a ring's all-gather and reduce-scatter). Beside it, the lower bound with DistAdam's reduce-scatters
    hidden. The record's figures are the preset's (cost_model.RECORD_MS; none for a preset that is no record's)."""
    preset = data["header"].get("preset")
    record, rows, total, total_hidden = RECORD_MS.get(preset, {}), {}, 0.0, 0.0
    ring_ms = lambda nbytes: nbytes * (world_size - 1) / world_size / (bus_gbps * 1e9) * 1000  # noqa: E731
    for part in STAGE_PARTS:
        row = data["parts"].get(part, {})
        if "kind_steps" not in row:
            continue
        shares = {kind: n / sum(row["kind_steps"].values()) for kind, n in row["kind_steps"].items()}
        steps = {kind: row.get(f"rank_step_{kind_key(kind)}", {}).get("median_ms") for kind in shares}
        if None in steps.values():
            continue
        compute = sum(shares[kind] * ms for kind, ms in steps.items())
        byte_rows = {kind: row["rank_step_bytes"].get(kind, {}) for kind in shares}
        comm = sum(shares[kind] * ring_ms(sum(b.values())) for kind, b in byte_rows.items())
        # DistAdam's reduce-scatters: what a step with Adam reduce-scatters beyond the matrices' (the step without)
        matrices_rs = byte_rows.get(op_counts.WITHOUT_ADAM, {}).get("reduce-scatter", 0)
        adam_rs = sum(shares[kind] * (b.get("reduce-scatter", 0) - matrices_rs) for kind, b in byte_rows.items())
        comm_hidden = comm - ring_ms(adam_rs)
        per_step = compute + comm
        name = row["stage"]
        rows[name] = {"steps": row["steps"], "compute_ms": compute, "comm_ms": comm, "ms_per_step": per_step,
                      "ms_per_step_rs_hidden": compute + comm_hidden, "record_ms": record.get(name),
                      "ratio": per_step / record[name] if name in record else None,
                      "seconds": per_step * row["steps"] / 1000}
        total += per_step * row["steps"] / 1000
        total_hidden += (compute + comm_hidden) * row["steps"] / 1000
    complete = set(rows) == set(data["header"].get("stages", ()))
    return {"stages": rows, "total_s": total if complete else None,
            "total_s_rs_hidden": total_hidden if complete else None, "record_total_s": RECORD_TOTAL_S.get(preset),
            "bus_gbps": bus_gbps}


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def timing(cell: dict | None) -> str:
    if not cell:
        return "n/a"
    return f"{cell['median_ms']:.2f} ({cell['min_ms']:.2f}–{cell['max_ms']:.2f})"


def stages_markdown(parts: dict) -> list[str]:
    rows = [(part, parts[part]) for part in ("stage3", "stage2", "stage1", "taper", "extension")
            if part in parts and "skipped" not in parts[part]]
    if not rows:
        return []
    lines = ["| stage | micro-batch | compile s (graphs) | forward+backward ms, median (min–max) | masks ms | "
             "rank step without / with Adam (/ with Adam, embeddings parked) ms | peak GiB allocated (reserved) | recompiles | host syncs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for part, row in rows:
        memory = row.get("rank_step_memory") or row.get("forward_backward_memory") or {}
        syncs = len(row.get("host_syncs_forward_backward", [])) + len(row.get("host_syncs_rank_step", []))
        lines.append(f"| {row.get('stage', part)} | {fmt(row.get('micro_tokens'))} tokens | "
                     f"{fmt(row.get('compile_s'), 1)} ({fmt(row.get('graphs_compiled'))}) | "
                     f"{timing(row.get('forward_backward'))} | {timing(row.get('masks'))} | "
                     f"{rank_step_cells(row)} | "
                     f"{fmt(memory.get('max_allocated_gib'))} ({fmt(memory.get('max_reserved_gib'))}) | "
                     f"{fmt(row.get('recompiles_after_first_call'))} | {syncs} |")
    return lines + [""]


def rank_step_cells(row: dict) -> str:
    """Rank 0's step without / with Adam, and with Adam but the embeddings parked where the stage has such steps."""
    return " / ".join(timing(row.get(f"rank_step_{kind_key(kind)}")) for kind in op_counts.STEP_KINDS
                      if kind_key(kind) != "with_Adam_embeddings_parked" or f"rank_step_{kind_key(kind)}" in row)


def optimizer_markdown(parts: dict) -> list[str]:
    if "optimizer" not in parts:
        return []
    row = parts["optimizer"]
    timed = row.get("timed", ["NorMuon", "DistAdam"])
    lines = ["## Optimizers, rank 0's share", "", row.get("share", ""), "",
             "| | " + " | ".join(f"{name} ms" for name in timed) + " |", "| --- |" + " --- |" * len(timed)]
    for label in ("tied", "untied"):
        if f"{timed[0]}_{label}" in row:
            lines.append(f"| {label} | " + " | ".join(timing(row.get(f"{name}_{label}")) for name in timed) + " |")
    return lines + [""]


def validation_markdown(parts: dict) -> list[str]:
    if "validation" not in parts:
        return []
    row = parts["validation"]
    return ["## Validation", "", f"One sequence of {fmt(row.get('tokens'))} tokens, windows {row.get('windows')}: "
            f"forward {timing(row.get('forward'))} ms, masks {timing(row.get('masks'))} ms, compile "
            f"{fmt(row.get('compile_s'), 1)} s ({fmt(row.get('graphs_compiled'))} graphs), peak "
            f"{fmt((row.get('memory') or {}).get('max_allocated_gib'))} GiB.", ""]


def memory_markdown(parts: dict) -> list[str]:
    if "phases" not in parts.get("memory_model", {}):
        return []
    lines = [f"## Memory: measured against the memory model (world size {parts['memory_model'].get('world_size')})",
             "", "| phase | measured peak GiB (allocated) | model's predicted peak GiB |", "| --- | --- | --- |"]
    measured = {"stage 1": "stage1", "stage 2": "stage2", "stage 3": "stage3", "stage 4": "taper",
                "extension": "extension", "validation": "validation"}
    for name, phase in parts["memory_model"]["phases"].items():
        row = parts.get(measured.get(name, ""), {})
        memory = row.get("rank_step_memory") or row.get("memory") or {}
        lines.append(f"| {name} | {fmt(memory.get('max_allocated_gib'))} | {fmt(phase.get('peak'))} |")
    return lines + [""]


def attention_markdown(parts: dict) -> list[str]:
    if "attention" not in parts:
        return []
    row = parts["attention"]
    backends = row.get("backends", [])
    lines = [f"## Attention backends ({row.get('stage')}, {fmt(row.get('micro_tokens'))} tokens)", "",
             "| kind (layers) | " + " | ".join(f"{b} ms" for b in backends) + " | largest difference to the first | "
             "rel. L2 to an fp32 reference (each backend) |",
             "| --- | " + " | ".join("---" for _ in backends) + " | --- | --- |"]
    for kind, result in row.get("kinds", {}).items():
        cells = [result.get(b, {}).get("error") or timing(result.get(b, {}).get("forward_backward")
                                                          or result.get(b, {}).get("forward")) for b in backends]
        diffs = [f"{b}: {result[b][k]['max_abs_diff']:.2e}" for b in backends for k in result.get(b, {})
                 if k.startswith("vs_") and isinstance(result[b][k], dict)]
        refs = [f"{result[b]['vs_fp32_reference_rel_l2']:.1e}" for b in backends
                if "vs_fp32_reference_rel_l2" in result.get(b, {})]
        lines.append(f"| {kind} ({result['layers']}) | " + " | ".join(cells) + f" | {', '.join(diffs) or 'n/a'} | "
                     f"{', '.join(refs)} |")
    if "verdict" in row:
        verdict = row["verdict"]
        lines += ["", "Per micro-batch (each kind times its layers): "
                  + ", ".join(f"{b} {fmt(ms)} ms" for b, ms in verdict["ms_per_micro_batch"].items())
                  + f"; fastest: {verdict['fastest']}; matches within bf16: {verdict['matches_within_bf16']}."]
    return lines + [""]


def numerics_markdown(parts: dict) -> list[str]:
    lines = []
    if "losses" in parts.get("training", {}):
        row = parts["training"]
        lines += [f"## Training: {row['steps']} steps at world size 1 ({row['micro_batches']} micro-batches of "
                  f"{fmt(row['micro_tokens'])} tokens)", "",
                  "Loss per token: " + ", ".join(f"{x:.3f}" for x in row["losses"]),
                  f"First {row['compared_steps']} {row['first_mean']:.3f}, last {row['compared_steps']} "
                  f"{row['last_mean']:.3f}: "
                  f"{'falls' if row['falls'] else 'DOES NOT FALL'}; step {timing(row.get('step'))} ms; host syncs: "
                  f"{len(row.get('host_syncs', []))}.", ""]
    if "loss_per_token" in parts.get("fp8", {}):
        row = parts["fp8"]
        lines += ["## FP8 against " + row["other_precision"], "",
                  f"Loss per token {row['loss_per_token']['fp8']:.5f} (FP8) and {row['loss_per_token']['bf16']:.5f}: "
                  f"relative difference {row['relative_difference']:.2e} ({row['weights']} weights).", ""]
    return lines


def profile_markdown(parts: dict) -> list[str]:
    lines = []
    for stage, row in parts.get("profile", {}).get("by_stage", {}).items():
        lines += [f"## Profile: steps {row.get('steps')} of {stage} (one without Adam, one with it)", "",
                  f"Span {fmt(row.get('span_ms'))} ms, kernels busy {fmt(row.get('busy_ms'))} ms.", "",
                  "| kernel | kind | ms | calls |", "| --- | --- | --- | --- |"]
        for k in row.get("top", []):
            lines.append(f"| `{k['name'][:90]}` | {k['kind']} | {k['ms']:.3f} | {k['calls']} |")
        for key in ("shares_by_kind", "shares_by_phase"):
            if row.get(key):
                lines += ["", f"{key.replace('_', ' ')}: " + ", ".join(f"{k} {v:.1%}" for k, v in row[key].items())]
        if row.get("loss_top"):
            lines += ["", "the loss's kernels: " + ", ".join(f"`{k['name'][:60]}` {k['ms']:.2f} ms"
                                                           for k in row["loss_top"])]
        lines.append("")
    return lines


def estimate_markdown(est: dict | None) -> list[str]:
    if not est or not est["stages"]:
        return []
    lines = ["## Estimated 8×H100 time (an estimate from one GPU, not a measurement)", "",
             f"Per stage: rank 0's measured step (the mean of a step without Adam and one with it) plus its "
             f"communication, all of it counted as not overlapped, at {est['bus_gbps']:.0f} GB/s bus bandwidth "
             f"(assumed, not measured); beside it the same with DistAdam's reduce-scatters hidden.", "",
             "| stage | steps | compute ms | communication ms | ours ms per step | record's ms | ours / record | "
             "seconds |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    record_total = f"{est['record_total_s']} s" if est["record_total_s"] is not None else "n/a (not a record's preset)"
    for name, r in est["stages"].items():
        lines.append(f"| {name} | {r['steps']} | {r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {r['ms_per_step']:.1f} "
                     f"({r['ms_per_step_rs_hidden']:.1f}) | {fmt(r['record_ms'], 1)} | {fmt(r['ratio'])} | "
                     f"{r['seconds']:.1f} |")
    lines.append(f"| **total** | | | | | | | **{fmt(est['total_s'], 1)} s** ({fmt(est['total_s_rs_hidden'], 1)} s); "
                 f"the record: {record_total} |")
    return lines + [""]


def render_markdown(data: dict) -> str:
    h, parts = data["header"], data["parts"]
    lines = ["# Bench: rank 0's share of each stage", "",
             f"Device: {h.get('device')}; torch {h.get('torch')}, Triton {h.get('triton')}, CUDA {h.get('cuda')}; "
             f"{h.get('when')}.", f"Command: `{h.get('command')}`", ""]
    for section in (stages_markdown, optimizer_markdown, validation_markdown, memory_markdown, attention_markdown,
                    numerics_markdown, profile_markdown):
        lines += section(parts)
    lines += estimate_markdown(data.get("estimate"))
    if data.get("counts"):
        import op_counts
        lines += op_counts.markdown(data["counts"])
    if data.get("model"):
        lines += cost_model.markdown(data["model"])
    errors = [(name, row["error"]) for name, row in parts.items() if row.get("error")]
    if errors:
        lines += ["## Errors", ""] + [f"- {name}: {error}" for name, error in errors] + [""]
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# main

def parse_options(argv: list[str]) -> argparse.Namespace:
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__.splitlines()[0],
                                     usage="python tools/bench.py --out=DIR [--parts=...] [--small] "
                                           "[-- train_gpt.py flags]")
    parser.add_argument("--out", required=True, help="folder for bench.json and bench.md")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--small", action="store_true", help="the smoke preset's toy size: every part on a CPU")
    parser.add_argument("--world_size", type=int, default=8, help="rank 0 of how many (default 8, the record's)")
    parser.add_argument("--timed", type=int, help="timed repetitions (default 20; --small: 3)")
    parser.add_argument("--untimed", type=int, help="untimed repetitions before them (default 3; --small: 1)")
    parser.add_argument("--training_steps", type=int, help=f"steps of the training part (default {TRAINING_STEPS}; "
                                                            f"--small: {SMALL_TRAINING_STEPS})")
    parser.add_argument("--counts", action="store_true",
                        help="the CPU mode: no GPU needed; count rank 0's eager ops, graph calls and gradient adds per "
                             "step on a fake H100 (tools/op_counts.py) instead of timing anything")
    parser.add_argument("--kernels", action="store_true",
                        help="with --counts: also compile with inductor (fake Triton, sm_90) and count every kernel's "
                             "launches and bytes")
    parser.add_argument("--card", choices=("h100", "h200"), default="h100",
                        help="with --counts: the GPU machine the cost model prices the counts for "
                             "(tools/cost_model.py)")
    parser.add_argument("--bus_gbps", type=float, default=360.0,
                        help="NVLink bus bandwidth the estimate assumes, GB/s (default 360: nccl-tests' large-message "
                             "all-gather on 8xH100 SXM; not measured here)")

    def one_line_error(message: str):
        raise BenchError(message)  # main() prints it in one line, without argparse's usage

    parser.error = one_line_error
    options = parser.parse_args(ours)
    if not options.out.strip():  # (an unset variable in `--out=$DIR`): Path("") is the working directory
        parser.error(f"--out={options.out}: names no folder; give the folder for bench.json and bench.md")
    options.flags = flags
    defaults = {"timed": (20, 3), "untimed": (3, 1), "training_steps": (TRAINING_STEPS, SMALL_TRAINING_STEPS)}
    for name, (real, small) in defaults.items():  # (the speedrun's, --small's)
        if getattr(options, name) is None:
            setattr(options, name, small if options.small else real)
    options.parts_given = any(arg.startswith("--parts") for arg in ours)
    options.parts = [p.strip() for p in options.parts.split(",") if p.strip()]
    unknown = [p for p in options.parts if p not in PARTS]
    if unknown or not options.parts:
        parser.error(f"--parts={','.join(options.parts)}: choose among {', '.join(PARTS)}")
    for name in ("world_size", "timed", "untimed", "training_steps"):
        if getattr(options, name) < (1 if name != "untimed" else 0):
            parser.error(f"--{name}={getattr(options, name)}: too small")
    if options.timed < 2:
        parser.error(f"--timed={options.timed}: at least 2 (the rank steps time one of each kind past the first)")
    if not options.bus_gbps > 0:
        parser.error(f"--bus_gbps={options.bus_gbps}: must be positive")
    if options.kernels and not options.counts:
        parser.error("--kernels counts compiled kernels in the CPU mode: add --counts")
    if options.counts and options.parts_given and not set(options.parts) & set(STAGE_PARTS):
        parser.error(f"--counts counts the stages' steps: --parts takes {', '.join(STAGE_PARTS)} there")
    return options


def header(options: argparse.Namespace, argv: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": (f"{props.name}, compute capability {props.major}.{props.minor}, "
                       f"{props.total_memory / GIB:.1f} GiB, {props.multi_processor_count} SMs") if cuda
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "command": " ".join(["python tools/bench.py", *argv]), "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "world_size": options.world_size, "timed": options.timed, "untimed": options.untimed}


def run_counts(options: argparse.Namespace, argv: list[str]) -> Report:
    """The CPU mode: tools/op_counts.py's counts of rank 0's steps on a fake H100, in bench.json and bench.md."""
    import logging

    import fake_cuda
    import preflight
    if fake_cuda.loaded is None:
        raise BenchError("--counts: run tools/bench.py as a script (the fake H100 goes in before torch is imported)")
    if options.kernels and importlib.util.find_spec("triton") is None:
        raise BenchError("--kernels needs triton, the version your PyTorch's CUDA wheel pins (PyTorch 2.13: "
                         "pip install triton==3.7.1)")
    fake_cuda.pretend_gpu()
    torch._logging.set_logs(all=logging.CRITICAL)
    fake_cuda.set_in_every_thread(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    report = Report(Path(options.out))
    report.data["header"] = header(options, argv)
    flags = (SMALL_FLAGS if options.small else []) + options.flags
    report.data["header"].update(flags=flags, device=f"fake {fake_cuda.gpu.name} on this CPU ({platform.machine()})")
    report.flush()
    start = time.perf_counter()
    stages = [PART_STAGE[part] for part in options.parts if part in STAGE_PARTS]

    def flush(result: dict):
        report.data["counts"] = result
        report.flush()

    report.data["counts"] = preflight.count_stages(flags, options.world_size, options.kernels,
                                                   stages if options.parts_given else None,
                                                   progress=lambda line: print(line, flush=True), flush=flush)
    report.data["header"]["total_s"] = time.perf_counter() - start
    report.data["model"] = cost_model.model_counts(report.data["counts"], options.card)
    report.flush()
    return report


def run(options: argparse.Namespace, argv: list[str]) -> Report:
    if options.counts:
        return run_counts(options, argv)
    cuda = torch.cuda.is_available()
    if not options.small and not cuda:
        raise BenchError("the speedrun's sizes need a CUDA device (none here); --small runs every part at a toy size "
                         "on this CPU")
    flags = (SMALL_FLAGS if options.small else []) + options.flags
    args = T.parse_args(flags, cuda)
    T.check_world_size(args, options.world_size)
    if T.Schedule(args).stages[0].micro_batches is None:
        raise BenchError("--micro_batches=auto: give the bench explicit counts (what auto chose, from the log)")
    report = Report(Path(options.out))
    report.data["header"] = header(options, argv)
    report.data["header"].update(flags=flags, preset=args.preset, stages=op_counts.stage_names(T.Schedule(args)))
    if cuda:
        import torch._inductor.config as inductor_config
        inductor_config.fx_graph_cache = True  # on this machine's disk: a rerun compiles little
        inductor_config.autotune_local_cache = True
        report.data["header"]["compile_threads"] = inductor_config.compile_threads  # parallel Triton builds
    report.flush()
    start = time.perf_counter()
    bench = Bench(args, options, report)
    report.data["header"]["setup_s"] = time.perf_counter() - start
    report.data["header"]["precisions"] = [bench.model.numerics.head, bench.model.numerics.mlp]
    report.data["header"]["attention"] = "flex" if bench.use_flex else "sdpa"
    report.flush()
    runners = {"optimizer": run_optimizer, "profile": run_profile, "validation": run_validation,
               "attention": run_attention, "training": run_training, "fp8": run_fp8, "memory_model": run_memory_model}
    try:
        names = op_counts.stage_names(bench.schedule)
        for part in [p for p in PARTS if p in options.parts]:
            row = report.part(part)
            if part in STAGE_PARTS and PART_STAGE[part] not in names and not options.parts_given:
                row["skipped"] = f"this schedule has no {PART_STAGE[part]}"  # (the taper: record #92's alone)
                report.flush()
                continue
            print(f"bench: {part} ...", flush=True)
            part_start = time.perf_counter()
            try:
                if part in STAGE_PARTS:
                    run_stage(bench, PART_STAGE[part], stage_of_part(part, bench.schedule), row, report.flush)
                else:
                    runners[part](bench, row, report.flush)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                row["traceback"] = traceback.format_exc()[-4000:]
                print(f"bench: {part} failed: {row['error']}", file=sys.stderr, flush=True)
            row["seconds"] = time.perf_counter() - part_start
            report.data["estimate"] = estimate(report.data, options.bus_gbps, options.world_size)
            report.flush()
            print(f"bench: {part} done in {row['seconds']:.1f} s", flush=True)
    finally:
        bench.close_rank0()
    report.data["header"]["total_s"] = time.perf_counter() - start
    report.flush()
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        options = parse_options(argv)
        report = run(options, argv)
    except (BenchError, T.ConfigError, T.DataError, T.TrainingError) as e:
        T.console_line(f"error: {e}", sys.stderr)  # (the flags and names it quotes, escaped)
        return 2
    print(render_markdown(report.data))
    failed = [name for name, row in report.data["parts"].items() if row.get("error")]
    if failed:
        print(f"error: parts failed: {', '.join(failed)} (see {Path(options.out) / 'bench.json'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

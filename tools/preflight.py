"""Preflight: the 8xH100 training step, run on this CPU before anyone rents a GPU.

    python tools/preflight.py                                  # the speedrun preset, as rank 0 of 8
    python tools/preflight.py --world_size=1 -- --model_dim=1024
    python tools/preflight.py --backend=inductor               # also every Triton kernel for sm_90
    python tools/preflight.py --gpu=rtx4090 --world_size=1     # another card: fits? if not, with which flags?

Arguments after `--` are train_gpt.py flags. The trainer's own functions run as they would on an
H100, on fake tensors (shapes, dtypes, strides and devices, but no data; tools/fake_cuda.py makes
this CPU-only PyTorch hold them on device "cuda"): setup_distributed with the resolve_* decisions,
build_model with its dtypes, prepare_training (torch.compile, the optimizers), the block masks, the
warmup's two training steps (the first without Adam, the second with it, which is where compilation
happens), a validation at the final windows, a checkpoint when --save_every or --save_final ask for
one, and two more training steps with every optimizer state in place, which are measured. The
batches are synthetic tokens with web-like documents, packed as the loader packs shards. World
size W is torch's fake process group: DistAdam's hooks and NorMuon's chunks issue the collectives of
rank 0 of W, with their real shapes, and nothing is sent.

It reports the graphs compiled for the blocks and the head; the memory of a training step per rank
(the most live tensors of this compiled step, next to the trainer's memory model, whose start-up
check tools/estimate_memory.py prints in full); the bytes each kind of collective moves per step; with
--backend=inductor the Triton kernels compiled for sm_90 and their shared memory. It fails on any
host sync inside a training step (a value read back such as .item() or bool(t), a shape that depends
on data such as nonzero, a copy to the host, a blocking copy from it, torch.cuda.synchronize), naming the function and line
of train_gpt.py, and on any error the CUDA path would raise (devices, dtypes, layouts, shapes). One
summary line and exit 0 when all is well; otherwise one `error:` line naming what failed and where,
exit 1 (2 for bad flags, or when the fake device cannot be built).

--gpu=NAME stands the fake device in for another card (fake_cuda.GPUS: its name, compute capability,
memory, SMs and shared memory), which the trainer's own decisions then see: `auto` precision falls back
from FP8 to bf16 without FP8 matmuls (one line says so), and inductor compiles for that architecture.
The trainer checks at start-up, by its memory model, that every phase fits the card (and chooses the
counts of --micro_batches=auto); the preflight shows those lines. When a phase does not fit, by that check
or by the preflight's own measure, tools/estimate_memory.py finds the flags that would (more, smaller
micro-batches per step: the same global batch and tokens; shorter validation sequences), the preflight
runs again with them, and the `error:` line gives the flags that passed, or why nothing fits.

It cannot tell kernel speed, what NCCL does, or the numbers of a real run: fake tensors hold no values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS), str(TOOLS.parent)]
import fake_cuda  # noqa: E402


def parse_options(argv: list[str]) -> argparse.Namespace:
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="tools/preflight.py", description=__doc__.splitlines()[0],
                                     usage="python tools/preflight.py [--world_size=8] [--gpu=h100] "
                                           "[--backend=aot_eager|inductor] [-- train_gpt.py flags]")
    parser.add_argument("--world_size", type=int, default=8, help="ranks of the simulated job (default 8)")
    parser.add_argument("--gpu", choices=list(fake_cuda.GPUS), default="h100",
                        help="the card each rank has (default h100, the record's)")
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager",
                        help="torch.compile backend: aot_eager (graphs and autograd, no kernels; the default) or "
                             "inductor (also generates and compiles every Triton kernel for the card's architecture, "
                             "sm_90 on an H100; needs triton)")
    def one_line_error(message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # argparse's own adds the usage: bad input gets one line
    options = parser.parse_args(ours)
    if options.world_size < 1:
        parser.error(f"--world_size={options.world_size}: must be positive")
    options.flags = flags
    return options


if __name__ == "__main__":
    # PyTorch reads its CUDA hooks once, when it is imported: the fake device goes in first. --help
    # and bad options are answered before anything is built.
    parse_options(sys.argv[1:])
    try:
        fake_cuda.load()
    except fake_cuda.ShimError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import unittest.mock  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,  # noqa: E402
                                           FakeTensor, FakeTensorMode)
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import estimate_memory  # noqa: E402
import op_counts  # noqa: E402
import train_gpt as T  # noqa: E402

GIB = 2 ** 30
TRAINER = Path(T.__file__).resolve()
OUTSIDE = "outside train_gpt.py"

# Ops that make the host wait for the device: a value read back, or an output shape that depends on data.
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
               "aten::masked_select", "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive",
               "aten::repeat_interleave"}
COLLECTIVES = {"reduce_scatter": "reduce-scatter", "allgather": "all-gather", "all_gather": "all-gather",
               "allreduce": "all-reduce", "all_reduce": "all-reduce", "broadcast": "broadcast",
               "alltoall": "all-to-all"}


class PreflightFailure(RuntimeError):
    """What would have failed on the GPUs; the message names the phase, the cause and where."""


class DoesNotFit(PreflightFailure):
    """A phase needs more memory than the card has."""


def check_fits(phase: str, peak: int):
    """More memory than the device has is an out-of-memory on the GPUs, however well the rest went."""
    card = fake_cuda.gpu
    if peak > card.total_memory:
        raise DoesNotFit(f"{phase}: does not fit an {card.short_name}: peak {peak / GIB:.2f} GiB per rank (live "
                         f"tensors) > {card.total_memory / GIB:.2f} GiB")


# -----------------------------------------------------------------------------
# Where a failure happened, in one line

def where_in_trainer(frames) -> str:
    """The innermost frame of train_gpt.py in a stack or traceback, as 'function at train_gpt.py:line'."""
    for frame in reversed(list(frames)):
        if Path(frame.filename).resolve() == TRAINER:
            return f"{frame.name} at {TRAINER.name}:{frame.lineno}"
    return OUTSIDE


def causes(e: BaseException) -> list[BaseException]:
    """e and what caused it, outermost first: torch.compile wraps the error that matters."""
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    return chain


def where_raised(e: BaseException) -> str:
    """Where in train_gpt.py an error comes from: torch.compile's errors carry the frames of the code
    they traced (real_stack), the others their traceback."""
    for error in reversed(causes(e)):
        for frames in (getattr(error, "real_stack", None) or [], traceback.extract_tb(error.__traceback__)):
            where = where_in_trainer(frames)
            if where != OUTSIDE:
                return where
    return OUTSIDE


def describe(e: BaseException) -> str:
    innermost = causes(e)[-1]
    lines = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {lines[0]}" if lines else type(innermost).__name__


@contextlib.contextmanager
def phase_failures(phase: str):
    """Any error of the trainer's code in this phase becomes a PreflightFailure of one line."""
    try:
        yield
    except (PreflightFailure, T.ConfigError, T.DataError):
        raise
    except Exception as e:
        innermost = causes(e)[-1]
        if isinstance(innermost, (DataDependentOutputException, DynamicOutputShapeException)):
            raise PreflightFailure(f"{phase}: host sync ({innermost.func}) in {where_raised(e)}") from e
        raise PreflightFailure(f"{phase}: {describe(e)} (in {where_raised(e)})") from e


# -----------------------------------------------------------------------------
# The fake GPU: what the trainer dispatches, watched

def tensors_in(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from tensors_in(value)


class FakeGPU(TorchDispatchMode):
    """Sits above FakeTensorMode and sees every op the trainer dispatches. A host tensor copied to CUDA
    becomes a fake CUDA tensor (pinning is skipped); collectives are counted, in bytes per kind and
    phase; a host sync raises during a training step and is counted elsewhere (a validation ends
    with one, its loss, which reads back as NaN here); the live fake-CUDA storages are followed, with
    their peak per phase (train_gpt.LiveMemory).

    The sparse exchange of the bigram table's rows starts with a count exchange between the hosts: the
    counts this rank sends are real; what it receives is answered as if the traffic were symmetric (each
    rank receives as many rows from the others as it sends them), since the fake process group carries
    no data. Record #92's n-gram table exchanges counts so too, then row ids into a host array, which the
    fake group leaves zero (every row asked of this rank is its first: the shapes are a real step's).

    torch.compile compiles as if the mode were absent, and the mode watches the compiled code run
    (ignore_compile_internals), so the ops of the compiled graphs are seen too."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self.phase, self.in_training_step = "setup", False
        self.collective_bytes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.host_syncs: dict[str, list[str]] = collections.defaultdict(list)
        self.memory = T.LiveMemory("cuda")
        self.peaks: dict[str, int] = {}
        self.host_counts: dict[StorageWeakRef, list[int]] = {}  # received counts of the host exchange

    @contextlib.contextmanager
    def running(self, phase: str, training_step: bool = False):
        self.phase, self.in_training_step = phase, training_step
        self.memory.start()
        try:
            with phase_failures(phase):
                yield
            self.peaks[phase] = max(self.peaks.get(phase, 0), self.memory.peak)
            check_fits(phase, self.peaks[phase])
        finally:
            self.phase, self.in_training_step = "setup", False

    def host_sync(self, what: str):
        where = where_in_trainer(traceback.extract_stack())
        if self.in_training_step:
            raise PreflightFailure(f"{self.phase}: host sync ({what}) in {where}: a training step must let the "
                                   f"host run ahead of the GPU")
        self.host_syncs[self.phase].append(f"{what} in {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = self.dispatch(func, args, kwargs or {})
        self.memory.track(tensors_in([result]))
        return result

    def dispatch(self, func, args, kwargs):
        if isinstance(func, torch._ops.HigherOrderOperator):  # flex_attention: its parts come through one by one
            return func(*args, **kwargs)
        name = func._schema.name
        if name == "aten::_pin_memory":  # pinned memory needs a driver; the copy that follows is what counts
            return args[0]
        if name == "aten::_to_copy":
            source, target = args[0], torch.device(kwargs.get("device") or args[0].device)
            if source.device.type == "cuda" and target.type == "cpu":
                self.host_sync("a copy to the host")
            if source.device.type == "cpu" and target.type == "cuda" and not kwargs.get("non_blocking"):
                # CUDA copies from pageable host memory synchronously: the host waits for the queued work
                # (torch.cuda.set_sync_debug_mode flags it). Set-up moves the model that way, once.
                if self.in_training_step:
                    self.host_sync("a blocking copy from the host")
            if target.type == "cuda" and (not isinstance(source, FakeTensor) or source.constant is not None):
                # A host tensor (or a small one fake mode keeps the value of, which it would copy for real)
                # becomes a fake GPU tensor of its shape and dtype.
                with self.fake_mode:
                    return torch.empty(source.shape, dtype=kwargs.get("dtype") or source.dtype, device=target)
        if name == "aten::copy_" and args[1].device.type == "cuda" and args[0].device.type == "cpu":
            self.host_sync("a copy to the host")
        if name == "aten::_local_scalar_dense" and args[0].device.type == "cpu":
            counts = self.host_counts.get(StorageWeakRef(args[0].untyped_storage()))
            if counts is not None:  # a host value: no sync
                return counts[args[0].storage_offset()]
            value = args[0].constant if isinstance(args[0], FakeTensor) else args[0]
            if value is not None:
                # a value the host holds, read on the host, waits for nothing: a Python number that a compiled
                # graph takes as a tensor (dynamo's unspecialised floats, which inductor's launcher reads with
                # .item(): DistAdam's betas and eps, which differ between buckets)
                with _disable_current_modes():
                    return value.item()
        if name in SYNCING_OPS:
            self.host_sync(name)
            if name == "aten::_local_scalar_dense":
                # A fake tensor has no value: a float reads as nan (a loss), an int as 1 (the flag with
                # which all_ranks_ok lets every rank agree: the ranks this process stands for agree).
                return float("nan") if args[0].is_floating_point() else 1
        if name.startswith("c10d::"):
            kind = next((k for key, k in COLLECTIVES.items() if key in name), None)
            if kind is not None:  # the whole buffer: a reduce-scatter's input, an all-gather's output
                self.collective_bytes[self.phase][kind] += max(t.nbytes for t in tensors_in(args))
        return func(*args, **kwargs)

    def all_to_all_single(self, output, input, *args, **kwargs):
        """torch.distributed.all_to_all_single, noting the values of a host count exchange (real tensors,
        before they reach the fake process group) as what the output receives."""
        if input.device.type == "cpu" and not isinstance(input, FakeTensor) and output.device.type == "cpu":
            with _disable_current_modes():
                self.host_counts[StorageWeakRef(output.untyped_storage())] = input.tolist()
        return ALL_TO_ALL_SINGLE(output, input, *args, **kwargs)


class GraphCounter:
    """A torch.compile backend that counts the graphs compiled for each part of the model, then hands
    them to aot_eager or inductor."""

    def __init__(self, backend: str):
        self.backend = backend
        self.part = None
        self.graphs = collections.Counter()
        self.seconds = collections.Counter()  # the backend's time per part: what a compile cliff shows in

    def watch(self, model: T.GPT, optimizers, compiled: bool):
        """Names the part of the step that compiles: each layer (one code object, Block.forward, for all of
        them), the stem, the final mix, the loss head, the FP8 refresh, the block masks and the optimizers'
        updates; with --compile=false the attention calls."""
        layers = "layers" if compiled else "attention calls"
        for block in model.blocks:
            block.register_forward_pre_hook(lambda module, inputs: setattr(self, "part", layers))
        if compiled:
            for attribute, part in (("stem", "stem"), ("head_mix", "final mix"), ("head_loss", "loss head"),
                                    ("fp8_copies", "FP8 refresh"), ("mask_parts", "block masks")):
                setattr(model, attribute, self.naming(part, getattr(model, attribute)))
            muon, adam = optimizers
            muon.update = self.naming("NorMuon", muon.update)
            for attribute in ("update", "add_transposed", "copy_transposed"):
                setattr(adam, attribute, self.naming("DistAdam", getattr(adam, attribute)))

    def naming(self, part: str, fn):
        def call(*args, **kwargs):
            self.part = part
            return fn(*args, **kwargs)
        return call

    @property
    def total(self) -> int:
        return sum(self.graphs.values())

    def __call__(self, graph_module, example_inputs):
        self.graphs[self.part] += 1
        start = time.perf_counter()
        try:
            if self.backend == "inductor":
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(graph_module, example_inputs)
            from torch._dynamo.backends.debugging import aot_eager
            return aot_eager(graph_module, example_inputs)
        finally:
            self.seconds[self.part] += time.perf_counter() - start


# -----------------------------------------------------------------------------
# The run

@dataclasses.dataclass
class Phase:
    """One phase of the run: a training step, the validation or the checkpoint."""
    name: str
    what: str  # its stage, batch and optimizer steps, in words
    stage: str | None = None  # estimate_memory's phase of the same shapes
    peak: int = 0  # bytes of live tensors per rank, at most
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> bytes
    host_syncs: list = dataclasses.field(default_factory=list)
    graphs: int = 0  # compiled in this phase
    counts: dict | None = None  # a training step's eager ops and gradient adds (tools/op_counts.py)


@dataclasses.dataclass
class Report:
    args: T.Hyperparameters
    world_size: int
    backend: str
    decisions: str = ""
    memory_plan: list = dataclasses.field(default_factory=list)  # the trainer's start-up lines (plan_memory)
    fallbacks: list = dataclasses.field(default_factory=list)  # what this card runs otherwise than an H100, in words
    parameters: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # dtype -> elements
    phases: dict = dataclasses.field(default_factory=dict)  # name -> Phase, in run order
    graphs: dict = dataclasses.field(default_factory=dict)  # part of the model -> graphs
    compile_seconds: dict = dataclasses.field(default_factory=dict)  # part -> seconds in the compile backend
    estimate: dict = dataclasses.field(default_factory=dict)  # estimate_memory's phase -> row -> bytes
    kernels: list = dataclasses.field(default_factory=list)  # inductor: (name, shared memory bytes)
    checkpoint_bytes: int | None = None
    seconds: dict = dataclasses.field(default_factory=dict)

    def steps(self) -> list[Phase]:
        return [p for p in self.phases.values() if p.name.startswith("training step")]

    def collectives_per_step(self) -> dict[str, float]:
        """Per stage, the bytes of an average step of one Adam cycle: (adam_every - 1) steps without Adam
        and one with it."""
        out = {}
        for stage in dict.fromkeys(p.stage for p in self.steps()):
            steps = [p for p in self.steps() if p.stage == stage]
            # an Adam step that does not untie, or else the untie (then the stage's only Adam step here)
            adam_steps = [p for p in steps if "Adam" in p.what]
            with_adam = [sum(p.collectives.values()) for p in
                         ([p for p in adam_steps if "untie" not in p.what] or adam_steps)]
            without = [sum(p.collectives.values()) for p in steps if "Adam" not in p.what]
            every = self.args.adam_every
            if with_adam and (without or every == 1):
                out[stage] = ((every - 1) * (without[0] if without else 0) + with_adam[0]) / every
        return out


def preflight_steps(args: T.Hyperparameters, schedule: T.Schedule) -> list[int]:
    """The trainer's warmup steps (at least one Adam cycle at the start of every stage), the untie, and the
    next Adam step, the first with the embedding on its own."""
    steps = T.warmup_steps(dataclasses.replace(args, warmup_steps=max(args.warmup_steps, args.adam_every)), schedule)
    untie = schedule.untie_step
    if untie is not None:
        steps = sorted({*steps, untie, *[s for s in (untie + args.adam_every,) if s < args.num_iterations]})
    return steps


def on_host(*args):
    """T.host_bigram_rows with real tensors: the loader's host-side work (which bigram rows a micro-batch
    reads) needs values, which fake tensors do not have."""
    with _disable_current_modes():
        return HOST_BIGRAM_ROWS(*args)


def real_from_numpy(array):
    """torch.from_numpy keeping the host array's values (under FakeTensorMode it would make a fake tensor
    without them): the counts of the bigram rows' exchange are host values the trainer reads back."""
    with _disable_current_modes():
        return FROM_NUMPY(array)


def ngram_on_host(*args):
    """T.host_ngram_rows with real tensors (see on_host): the rows of record #92's n-gram table a micro-batch reads."""
    with _disable_current_modes():
        return HOST_NGRAM_ROWS(*args)


def array_on_host(tokens):
    """T.host_array outside the fake modes: under them even reading a host tensor's values makes a fake tensor."""
    with _disable_current_modes():
        return HOST_ARRAY(tokens)


HOST_BIGRAM_ROWS = T.host_bigram_rows
HOST_NGRAM_ROWS = T.host_ngram_rows
HOST_ARRAY = T.host_array
ALL_TO_ALL_SINGLE = dist.all_to_all_single
FROM_NUMPY = torch.from_numpy


def stage_name(schedule: T.Schedule, step: int) -> str:
    index = schedule.stage_index(step)
    return "extension" if index == len(schedule.stages) - 1 else f"stage {index + 1}"


def run_preflight(flags: list[str], world_size: int = 8, backend: str = "aot_eager") -> Report:
    """Runs the configuration as rank 0 of world_size H100s would; raises PreflightFailure on the first
    thing that would fail there."""
    args = T.parse_args(flags, True)
    if args.device == "cpu":
        raise T.ConfigError("--device=cpu: the preflight runs the CUDA path; leave --device at auto or cuda")
    T.check_world_size(args, world_size)
    kernels = fake_cuda.fake_triton() if backend == "inductor" else []
    torch._dynamo.reset()  # graphs compiled by an earlier run in this process would not be counted
    if world_size > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))  # what torchrun tells rank 0
    try:
        report = run_steps(args, world_size, backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    report.kernels = list(kernels)
    return report


def run_steps(args: T.Hyperparameters, world_size: int, backend: str) -> Report:
    report = Report(args, world_size, backend)
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    gpu = FakeGPU(fake_mode)
    torch.cuda.synchronize = lambda device=None: gpu.host_sync("torch.cuda.synchronize")
    counter = GraphCounter(backend)

    ops = None  # the OpCounter, once the model exists

    @contextlib.contextmanager
    def phase(name: str, what: str, stage: str | None = None, training_step: bool = False):
        graphs = counter.total
        if training_step:
            ops.counts = op_counts.StepCounts()
        with gpu.running(name, training_step):
            yield
        counts = ops.counts.as_dict() if training_step else None
        if ops is not None:
            ops.counts = None
        report.phases[name] = Phase(name, what, stage, gpu.peaks[name], dict(gpu.collective_bytes[name]),
                                    list(gpu.host_syncs[name]), counter.total - graphs, counts)

    with phase("setup", "the model built and moved to the GPU, compiled, its optimizers"), gpu:
        env, args = T.setup_distributed(args)  # (auto's counts chosen)
        report.args, schedule = args, T.Schedule(args)
        # Built on the meta device, which holds no data: its move to the GPU makes it fake. Built for real,
        # a large recipe's weights would fill the host's memory before anything is checked.
        with torch.device("meta"):
            model = T.build_model(args, env)
    report.memory_plan = env.memory.lines
    for p in model.parameters():
        report.parameters[str(p.dtype).removeprefix("torch.")] += p.numel()
    ops = op_counts.OpCounter(model)

    with fake_mode, gpu, ops, warnings.catch_warnings(), unittest.mock.patch.object(T, "host_bigram_rows", on_host), \
            unittest.mock.patch.object(T, "host_ngram_rows", ngram_on_host), \
            unittest.mock.patch.object(T, "host_array", array_on_host), \
            unittest.mock.patch.object(dist, "all_to_all_single", gpu.all_to_all_single), \
            unittest.mock.patch.object(torch, "from_numpy", real_from_numpy):
        # FlexAttention run uncompiled materialises the whole score matrix: on the GPUs, an out-of-memory.
        warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
        with gpu.running("setup"):
            optimizers, use_flex = T.prepare_training(model, args, env, backend=counter)
            counter.watch(model, optimizers, compiled=args.compile)
            loader = T.SyntheticLoader(args, env)
            with _disable_current_modes():  # host tokens, as the trainer's: record #92's table pulls by their values
                val_tokens = torch.randint(0, T.BOS_ID, (args.val_seq_len * world_size + 1,))
        attention = "flex" if use_flex else "sdpa"
        compiled = "per layer" if args.compile else ("FlexAttention only" if use_flex else "off")
        report.decisions = (f"attention {attention}, lm_head {model.numerics.head}, MLP {model.numerics.mlp}, "
                            f"compile {compiled}")
        card = fake_cuda.gpu
        for flag, part, chosen in (("lm_head_precision", "lm_head", model.numerics.head),
                                   ("mlp_precision", "MLP up-projections", model.numerics.mlp)):
            if getattr(args, flag) == "auto" and T.fp8_fits(args) and chosen != "fp8":
                report.fallbacks.append(f"{part} in {chosen}, not FP8: the {card.short_name} has compute capability "
                                        f"{card.major}.{card.minor}, FP8 matmuls need 8.9")
        report.seconds["setup"] = time.perf_counter() - start

        for step in preflight_steps(args, schedule):
            stage = stage_name(schedule, step)
            parts = [stage, f"{schedule.micro_tokens(step):,} tokens per micro-batch"]
            if schedule.adam_steps(step):
                parts.append("Adam")
            if step == schedule.untie_step:
                parts.append("untie")
            model.set_windows(schedule.windows(step))
            T.set_schedules(step, optimizers, schedule, args)
            batch = loader.next_batch(step)
            with phase(f"training step {step}", ", ".join(parts), stage, training_step=True):
                T.train_step(model, optimizers, batch, step, schedule, args, use_flex)
        report.seconds["training steps"] = time.perf_counter() - start - sum(report.seconds.values())
        windows = schedule.windows(args.num_iterations, final_validation=True)
        model.set_windows(windows)  # YaRN, as the trainer leaves it for the last validation
        with phase("validation", f"final windows {windows}, {args.val_seq_len:,}-token sequences", "validation"):
            T.evaluate(model, val_tokens, windows, args, env, use_flex)
        if args.save_every or args.save_final:
            with phase("checkpoint", "the checkpoint and final weights, written without tensor data"):
                report.checkpoint_bytes = save_checkpoints(model, optimizers, loader, args, env)
        report.seconds["validation and checkpoint"] = time.perf_counter() - start - sum(report.seconds.values())

    report.graphs = dict(counter.graphs)
    report.compile_seconds = dict(counter.seconds)
    report.estimate = env.memory.rows  # the trainer's start-up check: tools/estimate_memory.py's table
    return report


def write_file_seekable(path: Path, content, shown: Path | None = None) -> dict:
    """T.write_file (the same arguments) for fake tensors: torch.save without tensor data (skip_data) seeks in
    its file, which the trainer's streaming writer cannot, so the file is written plainly and hashed afterwards."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_checkpoints(model, optimizers, loader, args: T.Hyperparameters, env: T.DistEnv) -> int:
    """The trainer's checkpoint and final-weights writers, into a temporary folder, without tensor data;
    returns the bytes they wrote. Two host-side helpers are swapped: the writing of one file's bytes (see
    write_file_seekable), and the gathering of Python objects from the ranks, which the fake process
    group cannot carry (every rank is taken to report what rank 0 reports)."""
    source = TRAINER.read_text(encoding="utf-8")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    with tempfile.TemporaryDirectory() as folder, torch.serialization.skip_data(materialize_fake_tensors=True), \
            unittest.mock.patch.object(T, "write_file", write_file_seekable), \
            unittest.mock.patch.object(T, "gather_from_ranks", lambda obj: [obj] * world_size):
        here = dataclasses.replace(args, checkpoint_dir=folder)
        if args.save_every:
            T.save_checkpoint(args.save_every, 0.0, model, optimizers, loader, here, env, source, "preflight")
        if args.save_final and env.is_main:
            T.save_final_weights(model, here, source, "preflight", args.num_iterations, float("nan"))
        return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


# -----------------------------------------------------------------------------
# The bench's CPU mode (tools/bench.py --counts): rank 0's steps of each stage counted by tools/op_counts.py

def count_stages(flags: list[str], world_size: int, kernels: bool, stages: list[str] | None = None,
                 progress=print, flush=lambda result: None) -> dict:
    """Per stage ("stage 1", ..., "taper", "extension": op_counts.stage_names; None: all), the counts of one step of
    each kind the stage has (op_counts.count_plan), rank 0 of world_size on a fake H100; flush(result) after each
    stage."""
    args = T.parse_args(flags, True)
    T.check_world_size(args, world_size)
    if kernels:
        fake_cuda.fake_triton()  # inductor compiles every kernel for sm_90, without a GPU
        import torch._inductor.config as inductor_config
        # kernel_num_gb in each kernel's metadata
        fake_cuda.set_in_every_thread(inductor_config, "benchmark_kernel", True)
    torch._dynamo.reset()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))  # what torchrun tells rank 0
    if world_size > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return _count_stages(args, world_size, kernels, stages, progress, flush)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _count_stages(args: T.Hyperparameters, world_size: int, kernels: bool, stages, progress, flush) -> dict:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    gpu = FakeGPU(fake_mode)
    with gpu:
        env, args = T.setup_distributed(args)
        schedule = T.Schedule(args)
        with torch.device("meta"):
            model = T.build_model(args, env)
    counter = op_counts.OpCounter(model)
    backend = op_counts.CountingBackend(counter, kernels)
    result = {"stages": {}, "world_size": world_size, "preset": args.preset, "kernels": kernels, "graphs_compiled": 0}
    with fake_mode, gpu, warnings.catch_warnings(), \
            unittest.mock.patch.object(T, "host_bigram_rows", on_host), \
            unittest.mock.patch.object(T, "host_ngram_rows", ngram_on_host), \
            unittest.mock.patch.object(T, "host_array", array_on_host), \
            unittest.mock.patch.object(dist, "all_to_all_single", gpu.all_to_all_single), \
            unittest.mock.patch.object(torch, "from_numpy", real_from_numpy), \
            op_counts.kernel_launches(counter) if kernels else contextlib.nullcontext(), counter:
        warnings.filterwarnings("ignore")
        optimizers, use_flex = T.prepare_training(model, args, env, backend=backend)
        loader = T.SyntheticLoader(args, env, schedule)
        names = op_counts.stage_names(schedule)
        for index, stage in enumerate(schedule.stages):
            name = names[index]
            if (stages is not None and name not in stages) or stage.end <= stage.start:
                continue
            start = time.perf_counter()
            warm, counted = op_counts.count_plan(schedule, index)
            row = {"micro_tokens": stage.micro_tokens, "micro_batches_per_rank": stage.micro_batches // world_size,
                   "logits_per_micro_batch": stage.micro_tokens * model.vocab,
                   "steps_in_stage": stage.end - stage.start, "kind_steps": op_counts.kind_steps(schedule, index),
                   "counted_steps": counted, "steps": {}}
            kind_of = {step: kind for kind, step in counted.items()}
            for step in warm + sorted(kind_of):
                model.set_windows(schedule.windows(step))
                T.set_schedules(step, optimizers, schedule, args)
                batch = loader.next_batch(step)
                counter.counts = op_counts.StepCounts() if step in kind_of else None
                sent = collections.Counter(gpu.collective_bytes[gpu.phase])
                T.train_step(model, optimizers, batch, step, schedule, args, use_flex)
                if step in kind_of:
                    kind = kind_of[step]
                    row["steps"][kind] = counter.counts.as_dict()
                    # each collective's whole buffer, by kind (a reduce-scatter's input, an all-gather's output)
                    row["steps"][kind]["collective_bytes"] = dict(gpu.collective_bytes[gpu.phase] - sent)
                counter.counts = None
            for kind, counts in row["steps"].items():
                head = counts["eager_bytes_by_source"].get("loss head", 0) + \
                    counts["kernel_bytes_by_source"].get("loss head", 0)
                counts["loss_head_bytes_per_logit"] = head / (row["logits_per_micro_batch"] *
                                                              row["micro_batches_per_rank"])
            row["seconds"] = time.perf_counter() - start
            result["stages"][name] = row
            result["graphs_compiled"] = backend.graphs
            flush(result)
            progress(f"counts: {name} done in {row['seconds']:.1f} s")
    return result


# -----------------------------------------------------------------------------
# Output

def eager_ops(counts: dict) -> str:
    """A training step's tools/op_counts.py counts in words (the first step of a stage also makes state)."""
    sources = ", ".join(f"{source.split(' (')[0]} {n}" for source, n in counts["eager_ops_by_source"].items())
    return f"eager ops {counts['eager_ops']} ({sources}); gradient adds {counts['gradient_adds']}"


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,.0f} bytes"


def kinds(counts: dict) -> str:
    return ", ".join(f"{kind} {megabytes(n)}" for kind, n in counts.items()) or "none"


def print_report(report: Report):
    args, world_size = report.args, report.world_size
    card = fake_cuda.gpu
    print(f"preflight: the {args.preset} preset as rank 0 of {world_size} {card.short_name} (fake tensors, PyTorch "
          f"{torch.__version__}), torch.compile backend {report.backend}")
    parameters = ", ".join(f"{n / 1e6:.1f}M in {dtype}" for dtype, n in sorted(report.parameters.items()))
    print(f"decisions: {report.decisions}; parameters {parameters}")
    for fallback in report.fallbacks:
        print(f"falls back: {fallback}")
    for line in report.memory_plan:
        print(f"trainer's {line}")
    print("phases (memory: the most live tensors per rank | the trainer's memory model for the same shapes; "
          "collectives: bytes of each whole buffer rank 0 sends or receives):")
    for p in report.phases.values():
        estimate = report.estimate.get(p.stage, {}).get("peak")
        memory = f"{p.peak / GIB:.2f} GiB" + (f" | {estimate / GIB:.2f}" if estimate is not None else "")
        syncs = ", ".join(sorted(set(p.host_syncs))) or "none"
        print(f"  {p.name} ({p.what}): memory {memory}; collectives {kinds(p.collectives)}; "
              f"host syncs {syncs}; graphs compiled {p.graphs}" + (f"; {eager_ops(p.counts)}" if p.counts else ""))
    print(f"  an {card.short_name} has {card.total_memory / GIB:.2f} GiB")
    print("graphs compiled: " + (", ".join(f"{n} for the {part}" for part, n in report.graphs.items()) or "none") +
          f"; dynamo's limit per code object is {torch._dynamo.config.recompile_limit}")
    if report.compile_seconds:  # under inductor, on this CPU: a part far above the others will be on the GPU too
        print(f"compile seconds ({report.backend}, this CPU): " +
              ", ".join(f"{seconds:.1f} for the {part}" for part, seconds in report.compile_seconds.items()))
    per_step = report.collectives_per_step()
    if world_size > 1:
        print("collectives per step, averaged over an Adam cycle: " +
              ", ".join(f"{stage} {megabytes(n)}" for stage, n in per_step.items()))
    if report.checkpoint_bytes is not None:
        print(f"checkpoint written without tensor data: {megabytes(report.checkpoint_bytes)}")
    if report.kernels:
        name, shared = max(report.kernels, key=lambda kernel: kernel[1])
        print(f"Triton kernels compiled for sm_{card.major}{card.minor}: {len({n for n, _ in report.kernels})} "
              f"({len(report.kernels)} configurations); the most shared memory: {shared / 1024:.1f} KiB of "
              f"{card.shared_memory_per_block_optin / 1024:.0f} KiB ({name})")
    print("time: " + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in report.seconds.items()))
    steps = report.steps()
    print(f"summary: preflight passed  gpu:{card.short_name.lower().replace(' ', '-')} world_size:{world_size} "
          f"backend:{report.backend} phases:{len(report.phases)} "
          f"steps:{len(steps)} host_syncs_in_steps:0 graphs:{sum(report.graphs.values())} "
          f"kernels:{len({n for n, _ in report.kernels}) if report.kernels else '-'} "
          f"peak_memory:{max(p.peak for p in report.phases.values()) / GIB:.2f}GiB "
          f"collectives_per_step:{max(per_step.values(), default=0) / 1e6:.0f}MB "
          f"seconds:{sum(report.seconds.values()):.0f}")


def main(argv: list[str] | None = None) -> int:
    options = parse_options(sys.argv[1:] if argv is None else argv)
    if fake_cuda.loaded is None:
        print("error: tools/fake_cuda.py's load() must run before torch is imported", file=sys.stderr)
        return 2
    if options.backend == "inductor" and importlib.util.find_spec("triton") is None:
        print("error: --backend=inductor needs triton, the version your PyTorch's CUDA wheel pins (PyTorch 2.13: "
              "pip install triton==3.7.1; see the README)", file=sys.stderr)
        return 2
    card = fake_cuda.GPUS[options.gpu]
    fake_cuda.pretend_gpu(card)
    torch._logging.set_logs(all=logging.CRITICAL)  # errors come back as one line; torch's logging would bury it
    # rather than a silent fallback to uncompiled code
    fake_cuda.set_in_every_thread(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    # inductor's advice on fp32 matmuls (the record's numerics keep them fp32, as the trainer does)
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores")
    try:
        report = run_preflight(options.flags, options.world_size, options.backend)
    except (DoesNotFit, T.DoesNotFitError) as e:  # the preflight's measure, or the trainer's own start-up check
        T.console_line(f"error: {e}; {fitting_command(options, card, said=isinstance(e, T.DoesNotFitError))}",
                       sys.stderr)
        return 1
    except (T.ConfigError, T.DataError) as e:  # (console_line escapes the names and flags they quote)
        T.console_line(f"error: {e}", sys.stderr)
        return 2
    except (PreflightFailure, T.TrainingError) as e:  # (the loader's refusal of a batch, as the trainer's)
        T.console_line(f"error: {e}", sys.stderr)
        return 1
    print_report(report)
    return 0


def fitting_command(options: argparse.Namespace, card, said: bool = False) -> str:
    """The flags that fit the card, found by tools/estimate_memory.py and checked by running the preflight again
    with them (its report is printed), or why none do; in words, for the end of the error line. said: the
    trainer's own refusal came first, and gave the reason already."""
    fit = estimate_memory.fitting_flags(options.flags, options.world_size, card)
    if fit.reason:
        return f"cannot fit on {options.world_size} {card.short_name}" + ("" if said else f": {fit.reason}")
    if not fit.flags:
        return (f"tools/estimate_memory.py puts every phase within {fit.within}, so the difference is the compiled "
                f"step's; try more --micro_batches")
    try:
        report = run_preflight([*options.flags, *fit.flags], options.world_size, options.backend)
    except (PreflightFailure, T.TrainingError) as e:
        return f"with {' '.join(fit.flags)}, which tools/estimate_memory.py puts within the card, too: {e}"
    print_report(report)
    changed = tuple(flag.split("=")[0] for flag in fit.flags)
    kept = [flag for flag in options.flags if not flag.startswith(changed)]  # (the --flag=value form)
    command = ["python tools/preflight.py", f"--gpu={options.gpu}", f"--world_size={options.world_size}", "--",
               *kept, *fit.flags]
    # a smaller n-gram table is another algorithm than the flags' (the record's, by default): said so
    table = [f"{int(flag.split('=')[1]):,}" for flag in fit.flags if flag.startswith("--bigram_vocab_size=")]
    args = T.parse_args(options.flags, True)
    kept_same = "the same batches and validation tokens" + (
        f", an n-gram table of {table[0]} rows, not {args.bigram_vocab_size:,}" if table else "")
    return f"it fits with {' '.join(fit.flags)} ({kept_same}; the report above): {' '.join(command)}"


if __name__ == "__main__":
    sys.exit(main())

"""Preflight: the 8xH100 training step, run on this CPU before anyone rents a GPU.

    python tools/preflight.py                                  # the speedrun preset, as rank 0 of 8
    python tools/preflight.py --world_size=1 -- --model_dim=1024
    python tools/preflight.py --backend=inductor               # also every Triton kernel for sm_90

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
(tools/estimate_memory.py's count, with the saved activations measured on this compiled step, next
to that tool's own estimate); the bytes each kind of collective moves per step; with
--backend=inductor the Triton kernels compiled for sm_90 and their shared memory. It fails on any
host sync inside a training step (a value read back such as .item() or bool(t), a shape that depends
on data such as nonzero, a copy to the host, torch.cuda.synchronize), naming the function and line
of train_gpt.py, and on any error the CUDA path would raise (devices, dtypes, layouts, shapes). One
summary line and exit 0 when all is well; otherwise one `error:` line naming what failed and where,
exit 1 (2 for bad flags, or when the fake device cannot be built).

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
                                     usage="python tools/preflight.py [--world_size=8] "
                                           "[--backend=aot_eager|inductor] [-- train_gpt.py flags]")
    parser.add_argument("--world_size", type=int, default=8, help="ranks of the simulated job (default 8)")
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager",
                        help="torch.compile backend: aot_eager (graphs and autograd, no kernels; the default) or "
                             "inductor (also generates and compiles every Triton kernel for sm_90; needs triton)")
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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import estimate_memory  # noqa: E402
import train_gpt as T  # noqa: E402

GIB = 2 ** 30
TRAINER = Path(T.__file__).resolve()
OUTSIDE = "outside train_gpt.py"

# Ops that make the host wait for the device: a value read back, or an output shape that depends on data.
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
               "aten::masked_select", "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive",
               "aten::repeat_interleave"}
COLLECTIVES = {"reduce_scatter": "reduce-scatter", "allgather": "all-gather", "all_gather": "all-gather",
               "allreduce": "all-reduce", "all_reduce": "all-reduce", "broadcast": "broadcast"}
WARMUP_STEPS = (0, 1)  # the trainer's warmup: the second steps Adam (at the default --adam_every=2)


class PreflightFailure(RuntimeError):
    """What would have failed on the GPUs; the message names the phase, the cause and where."""


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
    with one, its loss, which reads back as NaN here).

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

    @contextlib.contextmanager
    def running(self, phase: str, training_step: bool = False):
        self.phase, self.in_training_step = phase, training_step
        try:
            with phase_failures(phase):
                yield
        finally:
            self.phase, self.in_training_step = "setup", False

    def host_sync(self, what: str):
        where = where_in_trainer(traceback.extract_stack())
        if self.in_training_step:
            raise PreflightFailure(f"{self.phase}: host sync ({what}) in {where}: a training step must let the "
                                   f"host run ahead of the GPU")
        self.host_syncs[self.phase].append(f"{what} in {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # flex_attention: its parts come through one by one
            return func(*args, **kwargs)
        name = func._schema.name
        if name == "aten::_pin_memory":  # pinned memory needs a driver; the copy that follows is what counts
            return args[0]
        if name == "aten::_to_copy":
            source, target = args[0], torch.device(kwargs.get("device") or args[0].device)
            if source.device.type == "cuda" and target.type == "cpu":
                self.host_sync("a copy to the host")
            if target.type == "cuda" and not isinstance(source, FakeTensor):  # host tensor -> fake GPU
                with self.fake_mode:
                    return func(self.fake_mode.from_tensor(source), *args[1:], **kwargs)
        if name == "aten::copy_" and args[1].device.type == "cuda" and args[0].device.type == "cpu":
            self.host_sync("a copy to the host")
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


class GraphCounter:
    """A torch.compile backend that counts the graphs compiled for each part of the model, then hands
    them to aot_eager or inductor."""

    def __init__(self, backend: str):
        self.backend = backend
        self.part = None
        self.graphs = collections.Counter()

    def watch(self, model: T.GPT, whole_blocks: bool):
        blocks = "blocks" if whole_blocks else "attention calls"
        for block in model.blocks:
            block.register_forward_pre_hook(lambda module, inputs: setattr(self, "part", blocks))
        model.head.register_forward_pre_hook(lambda module, inputs: setattr(self, "part", "head"))

    def __call__(self, graph_module, example_inputs):
        self.graphs[self.part] += 1
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(graph_module, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(graph_module, example_inputs)


@contextlib.contextmanager
def saved_activations(model: T.GPT):
    """Per forward of the model, the bytes of the tensors kept for its backward (each storage once):
    tools/estimate_memory.py's measure, taken on the step as compiled here."""
    per_forward: list[dict] = []

    def keep(t):
        if per_forward:
            per_forward[-1][StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    handle = model.register_forward_pre_hook(lambda module, inputs: per_forward.append({}))
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            yield per_forward
    finally:
        handle.remove()


# -----------------------------------------------------------------------------
# The run

@dataclasses.dataclass
class Report:
    args: T.Hyperparameters
    world_size: int
    backend: str
    decisions: str = ""
    parameters: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # dtype -> elements
    graphs: dict = dataclasses.field(default_factory=dict)
    collectives: dict = dataclasses.field(default_factory=dict)  # phase -> kind -> bytes
    host_syncs: dict = dataclasses.field(default_factory=dict)  # phase -> what and where
    memory: dict = dataclasses.field(default_factory=dict)  # row -> bytes, this run
    estimate: dict = dataclasses.field(default_factory=dict)  # row -> bytes, tools/estimate_memory.py
    kernels: list = dataclasses.field(default_factory=list)  # inductor: (name, shared memory bytes)
    checkpoint_bytes: int | None = None
    seconds: dict = dataclasses.field(default_factory=dict)

    def step_collectives(self, kind: str) -> dict:
        """Bytes per collective kind of the measured step without Adam, or with it."""
        return self.collectives.get(f"training step {measured_steps(self.args)[kind]}", {})

    def collectives_per_step(self) -> float:
        """Bytes per step on average over the steps of one Adam cycle."""
        with_adam, every = sum(self.step_collectives("with Adam").values()), self.args.adam_every
        if every == 1:
            return with_adam
        return ((every - 1) * sum(self.step_collectives("without Adam").values()) + with_adam) / every


def measured_steps(args: T.Hyperparameters) -> dict[str, int]:
    """After the warmup's steps, the first step without Adam and the first with it (each kind that occurs)."""
    steps: dict[str, int] = {}
    step = len(WARMUP_STEPS)
    while len(steps) < (1 if args.adam_every == 1 else 2):
        steps.setdefault("with Adam" if T.adam_steps_at(step, args) else "without Adam", step)
        step += 1
    return dict(sorted(steps.items(), key=lambda kind_step: kind_step[1]))


def run_preflight(flags: list[str], world_size: int = 8, backend: str = "aot_eager") -> Report:
    """Runs the configuration as rank 0 of world_size H100s would; raises PreflightFailure on the first
    thing that would fail there."""
    args = T.parse_args(flags, True)
    if args.device == "cpu":
        raise T.ConfigError("--device=cpu: the preflight runs the CUDA path; leave --device at auto or cuda")
    T.check_world_size(args, world_size)
    kernels = fake_cuda.fake_sm90_triton() if backend == "inductor" else []
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
    report.estimate = estimate_memory.estimate(flags, world_size)
    return report


def run_steps(args: T.Hyperparameters, world_size: int, backend: str) -> Report:
    report = Report(args, world_size, backend)
    start = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    gpu = FakeGPU(fake_mode)
    torch.cuda.synchronize = lambda device=None: gpu.host_sync("torch.cuda.synchronize")

    with gpu.running("setup"), gpu:  # the model is built on the host; its move to the GPU makes it fake
        env = T.setup_distributed(args)
        model = T.build_model(args, env)
    for p in model.parameters():
        report.parameters[str(p.dtype).removeprefix("torch.")] += p.numel()

    counter = GraphCounter(backend)
    with fake_mode, gpu, warnings.catch_warnings():
        # FlexAttention run uncompiled materialises the whole score matrix: on the GPUs, an out-of-memory.
        warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
        with gpu.running("setup"):
            counter.watch(model, whole_blocks=args.compile)
            optimizers, use_flex = T.prepare_training(model, args, env, backend=counter)
            loader = T.SyntheticLoader(args, env)
            val_tokens = torch.randint(0, T.BOS_ID, (args.val_seq_len * world_size + 1,))
        attention = "flex" if use_flex else "sdpa"
        compiled = "per block" if args.compile else ("FlexAttention only" if use_flex else "off")
        report.decisions = f"attention {attention}, lm_head {model.head.precision}, compile {compiled}"

        def training_steps(steps):
            for step in steps:
                windows = T.layer_windows(args, T.attention_windows(step, args))
                batch = loader.next_batch()
                with gpu.running(f"training step {step}", training_step=True):
                    T.train_step(model, optimizers, batch, windows, step, args, use_flex)

        report.seconds["setup"] = time.perf_counter() - start
        training_steps(WARMUP_STEPS)
        report.seconds["first steps, compiling"] = time.perf_counter() - start - sum(report.seconds.values())
        final_windows = T.layer_windows(args, T.attention_windows(args.num_iterations, args, final_validation=True))
        with gpu.running("validation"):
            T.evaluate(model, val_tokens, final_windows, args, env, use_flex)
        if args.save_every or args.save_final:
            with gpu.running("checkpoint"):
                report.checkpoint_bytes = save_checkpoints(model, optimizers, loader, args, env)
        report.seconds["validation"] = time.perf_counter() - start - sum(report.seconds.values())
        with saved_activations(model) as per_forward:
            training_steps(sorted(measured_steps(args).values()))
        report.seconds["measured steps"] = time.perf_counter() - start - sum(report.seconds.values())
        tokens = torch.full((args.micro_batch_tokens,), T.BOS_ID, device=env.device)
        masks = T.build_masks(tokens, T.layer_windows(args, T.attention_windows(0, args)), use_flex,
                              args.window_block)
        report.memory = estimate_memory.breakdown(model, args, world_size, max(sum(f.values()) for f in per_forward),
                                                  estimate_memory.mask_bytes(masks))

    report.graphs = dict(counter.graphs)
    report.collectives = {phase: dict(kinds) for phase, kinds in gpu.collective_bytes.items()}
    report.host_syncs = dict(gpu.host_syncs)
    return report


def write_file_seekable(path: Path, content) -> dict:
    """T.write_file for fake tensors: torch.save without tensor data (skip_data) seeks in its file, which
    the trainer's streaming writer cannot, so the file is written plainly and hashed afterwards."""
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
# Output

def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,.0f} bytes"


def kinds(counts: dict) -> str:
    return ", ".join(f"{kind} {megabytes(n)}" for kind, n in counts.items()) or "none"


def print_report(report: Report):
    args, world_size = report.args, report.world_size
    print(f"preflight: the {args.preset} preset as rank 0 of {world_size} H100 (fake tensors, PyTorch "
          f"{torch.__version__}), torch.compile backend {report.backend}")
    parameters = ", ".join(f"{n / 1e6:.1f}M in {dtype}" for dtype, n in sorted(report.parameters.items()))
    print(f"decisions: {report.decisions}; parameters {parameters}")
    print("graphs compiled: " + (", ".join(f"{n} for the {part}" for part, n in report.graphs.items()) or "none"))
    steps = len(WARMUP_STEPS) + len(measured_steps(args))
    print(f"host syncs: none in {steps} training steps" +
          "".join(f"; {phase}: {len(found)} ({', '.join(sorted(set(found)))})"
                  for phase, found in report.host_syncs.items()))
    if world_size > 1:
        steps_seen = "; ".join(f"a step {kind}: {kinds(report.step_collectives(kind))}" for kind in measured_steps(args))
        print(f"collectives, bytes of each whole buffer: {megabytes(report.collectives_per_step())} per step on "
              f"average; {steps_seen}")
        others = [f"{phase}: {kinds(c)}" for phase, c in report.collectives.items()
                  if not phase.startswith("training step")]
        print("  outside the training steps: " + "; ".join(others))
    print("memory of a training step per rank, GiB   this run | tools/estimate_memory.py (eager)")
    for row, value in report.memory.items():
        print(f"  {row:<38} {value / GIB:8.2f} | {report.estimate[row] / GIB:8.2f}")
    print(f"  {'an H100 has':<38} {fake_cuda.H100.total_memory / GIB:8.2f}")
    if report.checkpoint_bytes is not None:
        print(f"checkpoint written without tensor data: {megabytes(report.checkpoint_bytes)}")
    if report.kernels:
        name, shared = max(report.kernels, key=lambda kernel: kernel[1])
        print(f"Triton kernels compiled for sm_90: {len({n for n, _ in report.kernels})} "
              f"({len(report.kernels)} configurations); the most shared memory: {shared / 1024:.1f} KiB of "
              f"{fake_cuda.H100.shared_memory_per_block_optin / 1024:.0f} KiB ({name})")
    print("time: " + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in report.seconds.items()))
    print(f"summary: preflight passed  world_size:{world_size} backend:{report.backend} steps:{steps} "
          f"host_syncs_in_steps:0 graphs:{sum(report.graphs.values())} "
          f"kernels:{len({n for n, _ in report.kernels}) if report.kernels else '-'} "
          f"peak_memory:{report.memory['peak'] / GIB:.2f}GiB "
          f"collectives_per_step:{report.collectives_per_step() / 1e6:.0f}MB "
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
    fake_cuda.pretend_h100()
    torch._logging.set_logs(all=logging.CRITICAL)  # errors come back as one line; torch's logging would bury it
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # rather than a silent fallback to uncompiled code
    try:
        report = run_preflight(options.flags, options.world_size, options.backend)
    except (T.ConfigError, T.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PreflightFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

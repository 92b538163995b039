"""The bench's CPU mode (`python tools/bench.py --counts`): what makes rank 0's step slow on a GPU, counted on
this CPU, so that work without a GPU sees its effect.

    python tools/bench.py --counts --out=DIR                 # the speedrun preset as rank 0 of 8, a few minutes
    python tools/bench.py --counts --kernels --out=DIR       # also every compiled kernel's bytes (inductor, longer)
    python tools/bench.py --counts --small --out=DIR         # the smoke preset (the suite runs this)

The trainer's own code runs as tools/preflight.py runs it: on fake tensors held on a fake H100 (tools/fake_cuda.py),
as rank 0 of a fake process group of --world_size ranks, on synthetic tokens. For each stage it runs a first Adam
cycle (compiling the stage's graphs), then counts a second one, a step without Adam and a step with it:

- eager ops: the aten operations dispatched outside compiled graphs that launch a kernel on a GPU (views, shape
  queries and allocations launch none), by where in train_gpt.py they come from (the loss head, the block masks,
  the FP8 refresh, NorMuon or ANVIL, NgramAdam and the n-gram table's row traffic, DistAdam, the model's code between
  its graphs, train_step, and the autograd engine,
  which runs the backward of eager code and adds gradients together); each costs the host ~20 us on the GPU
  machine (notes/speed.md);
- compiled-graph calls, forward and backward (torch.compile's aot_eager backend: the same graphs inductor gets);
- gradient-accumulation adds: the adds the autograd engine makes where a tensor's gradient arrives from several
  consumers, or into a parameter's .grad, with their shapes;
- with --kernels: inductor's kernels for sm_90 (fake Triton: compiled, never run), each launch with the bytes its
  inductor metadata says it moves (`kernel_num_gb`, torch._inductor.config.benchmark_kernel), the matmuls and
  other extern kernels with the bytes of their operands, and the loss head's bytes per logit: everything the
  loss moves outside its matmuls, eager passes included, over the logits it computes (rows x padded vocabulary).

Byte counts are inductor's own (in-place buffers once, a looped reduction's re-read once) and operand sizes for
the rest: a lower bound on what a kernel moves, never a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import unittest.mock
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T  # (the repository root is on the path: preflight.py, which drives the counting, puts it there)

TRAINER = Path(T.__file__).resolve()

# Aten operations that launch no kernel on a GPU: views, metadata and allocation.
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::detach",
    "aten::alias", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow",
    "aten::diagonal", "aten::view_as", "aten::unflatten", "aten::_reshape_alias", "aten::empty",
    "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided", "aten::lift_fresh",
    "aten::_local_scalar_dense", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::is_same_size",
    "aten::set_", "aten::resize_", "aten::record_stream", "aten::_pin_memory", "aten::is_pinned",
    "aten::_has_compatible_shallow_copy_type", "aten::real", "aten::view_as_real", "aten::view_as_complex",
    "aten::_nested_tensor_from_mask_left_aligned", "aten::result_type", "aten::_to_copy_meta",
    "aten::expand_as", "aten::reshape", "aten::flatten", "aten::movedim", "aten::mT", "aten::numpy_T",
}
COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul"}
# Indexed reads and writes of a table (their first argument): each moves the rows it touches, not the table. Counted
# whole, record #92's n-gram shard (16 GB a rank) made each row pull look like two 16 GB passes.
INDEXED = {"aten::index_select", "aten::index", "aten::gather", "aten::embedding", "aten::index_put_",
           "aten::index_put", "aten::_index_put_impl_", "aten::index_add_", "aten::index_add", "aten::index_copy_",
           "aten::index_copy", "aten::scatter_", "aten::scatter_add_", "aten::scatter_add"}
# Which argument of a matmul is its first operand (the others take it first): K is that operand's last dimension.
FIRST_OPERAND = {"aten::addmm": 1, "aten::baddbmm": 1}
# The kinds of device work a step is counted in (tools/cost_model.py prices each): an inductor Triton kernel, one of
# inductor's FlexAttention templates, a bf16/fp32 matmul, an FP8 matmul, an eager element-wise op, and an eager op
# with an operand out of order (a transposing copy runs in PyTorch's strided kernel, not its vectorized one).
WORK_KINDS = ("triton", "attention", "matmul", "fp8 matmul", "eager", "eager strided")

# Where an eager op comes from: the first category any of its train_gpt.py frames belongs to, by the frame's
# qualified name. The more specific categories come first (a loss computed inside GPT.forward is the loss head's).
CATEGORIES = (
    ("loss head", ("SoftcappedMTPLoss", "mtp_chunk", "head_loss")),
    ("block masks", ("build_masks", "flex_block_mask", "_ordered_blocks", "block_mask")),
    ("FP8 refresh", ("refresh_fp8", "MLP.refresh_fp8", "fp8_copies", "mlp_fp8", "head_fp8", "mlp_full_fp8",
                     "mlp_weight_fp8", "delayed_scale")),
    # the matrix optimizer: NorMuon, or ANVIL (its subclass; record #92's), under NorMuon's name as in the stored counts
    ("NorMuon", ("NorMuon", "polar_express", "normalize_neurons", "bf16_with_mantissa", "split_mantissa",
                 "normuon", "Anvil", "anvil", "equalize_lanes")),
    # record #92's n-gram table: its Adam and its rows' traffic (ahead of DistAdam, whose step calls NgramAdam.step)
    ("NgramAdam", ("NgramAdam", "ngram_pull", "route_rows", "exchange_rows", "ngram_adam_rows")),
    ("DistAdam", ("DistAdam", "_Bucket", "adam_update", "add_transposed", "copy_transposed")),
    ("model, between its graphs", ("GPT.", "Block.", "CausalSelfAttention.", "MLP.", "Fp8ReluSquaredMLP.", "Rotary.",
                                   "mudd_net", "norm", "bigram_hash", "positions_in_sequence", "apply_rotary",
                                   "attention")),
)
ENGINE = "autograd engine (backward of eager code, gradient adds)"
STEP = "train_step and the rest"
GENERATED = ("<eval_with_key",)  # FX's generated code (aot_eager); inductor's modules live in its cache folder


# The kinds of training step, by which optimizers step (step_kind). Record #92's embeddings (the value embeddings and
# the n-gram table) take an Adam step every embed_adam_period steps from embed_adam_period_start: between two of
# theirs, an Adam step leaves them parked.
WITHOUT_ADAM, WITH_ADAM, EMBEDDINGS_PARKED = "without Adam", "with Adam", "with Adam, embeddings parked"
STEP_KINDS = (WITHOUT_ADAM, WITH_ADAM, EMBEDDINGS_PARKED)


def step_kind(schedule: T.Schedule, step: int) -> str:
    if not schedule.adam_steps(step):
        return WITHOUT_ADAM
    return WITH_ADAM if schedule.embed_adam_steps(step) else EMBEDDINGS_PARKED


def stage_names(schedule: T.Schedule) -> list[str]:
    """Each of Schedule.stages by name: "stage N", record #92's fourth (a schedule of four before the extension) its
    "taper", the last "extension"."""
    scheduled = len(schedule.stages) - 1
    return [f"stage {i + 1}" if not (scheduled == 4 and i == 3) else "taper" for i in range(scheduled)] + ["extension"]


def kind_steps(schedule: T.Schedule, index: int) -> dict[str, int]:
    """How many of a stage's steps are of each kind: the weights of its mean step."""
    stage = schedule.stages[index]
    return dict(collections.Counter(step_kind(schedule, s) for s in range(stage.start, stage.end)))


def count_plan(schedule: T.Schedule, index: int) -> tuple[list[int], dict[str, int]]:
    """The steps that measure a stage: a warm cycle (it compiles the stage's graphs, makes every state, unties the
    embedding in the untie stage) of the stage's longest cadence, from where that cadence holds in the stage, then
    the first step of each kind the stage has after it, {kind: step}, in step order. A short stage's steps may run
    past its end (the schedule's answers there are its last step's)."""
    stage = schedule.stages[index]
    kinds = kind_steps(schedule, index)
    slow = EMBEDDINGS_PARKED in kinds
    first = max(stage.start, schedule.embed_period_start) if slow else stage.start
    cycle = schedule.embed_period if slow else schedule.adam_every
    warm = list(range(first, first + cycle))
    counted: dict[str, int] = {}
    step = first + cycle
    while len(counted) < len(kinds):
        kind = step_kind(schedule, step)
        if kind in kinds and kind not in counted:
            counted[kind] = step
        step += 1
    return warm, counted


def category(frame) -> str | None:
    """The category of the op being dispatched, from the Python frames above it; None inside a compiled graph
    (FX's generated code for aot_eager, inductor's generated module), whose ops are the graph's, not eager."""
    trainer_frames = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(GENERATED) or "torchinductor" in code.co_filename:  # a compiled graph
            return None
        if code.co_filename == str(TRAINER):
            trainer_frames.append(getattr(code, "co_qualname", code.co_name))
        frame = frame.f_back
    if not trainer_frames:
        return ENGINE
    for name, prefixes in CATEGORIES:
        if any(q.startswith(prefixes) for q in trainer_frames):
            return name
    return STEP


def tensor_bytes(values) -> int:
    seen, total = set(), 0
    for t in values:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def flat_tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from flat_tensors(v)


@dataclasses.dataclass
class StepCounts:
    """What one training step dispatched."""
    eager_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # category -> ops
    eager_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # category -> bytes
    collectives: int = 0
    graph_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # forward/backward
    graph_calls_by_source: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    adds: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (shape, dtype, into) -> n
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (category, name) -> n
    kernel_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # category -> bytes
    extern_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # category -> bytes
    matmul_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # category -> bytes
    # Every piece of device work, for tools/cost_model.py: (source, kind, bytes, flops) -> launches. Kinds: WORK_KINDS.
    work: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        adds = [{"shape": list(shape), "dtype": dtype, "into": into, "count": n}
                for (shape, dtype, into), n in self.adds.most_common()]
        return {"eager_ops": sum(self.eager_ops.values()), "eager_ops_by_source": dict(self.eager_ops.most_common()),
                "eager_bytes_by_source": dict(self.eager_bytes), "collectives": self.collectives,
                "graph_calls": dict(self.graph_calls), "graph_calls_by_source": dict(self.graph_calls_by_source),
                "gradient_adds": sum(self.adds.values()), "adds": adds,
                "kernel_launches": sum(self.kernels.values()),
                "kernel_launches_by_source": dict(self._launches_by_source()),
                "kernel_bytes_by_source": dict(self.kernel_bytes), "extern_bytes_by_source": dict(self.extern_bytes),
                "matmul_bytes_by_source": dict(self.matmul_bytes),
                "work": [{"source": source, "kind": kind, "bytes": nbytes, "flops": flops, "count": n}
                         for (source, kind, nbytes, flops), n in sorted(self.work.items())]}

    def _launches_by_source(self) -> collections.Counter:
        counts = collections.Counter()
        for (source, _), n in self.kernels.items():
            counts[source] += n
        return counts


class OpCounter(TorchDispatchMode):
    """Counts every op the trainer dispatches (it sits below tools/preflight.py's FakeGPU, which makes them fake),
    into `counts` while a step is counted (`counts` set), nothing otherwise."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, model: T.GPT):
        super().__init__()
        self.model = model
        self.counts: StepCounts | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.counts is not None and not isinstance(func, torch._ops.HigherOrderOperator):
            self.count(func._schema.name, args, kwargs, result)
        return result

    def count(self, name: str, args, kwargs, result):
        counts = self.counts
        if name.startswith(COLLECTIVE_PREFIXES):
            counts.collectives += 1
            return
        if name in NO_KERNEL or name.startswith("prim::"):  # prim::device and the like: attribute reads
            return
        where = category(sys._getframe(2))
        tensors = [*flat_tensors(args), *flat_tensors(kwargs.values()), *flat_tensors([result])]
        moved = indexed_bytes(args[0], tensors) if name in INDEXED else tensor_bytes(tensors)
        kind, flops = work_kind(name, args, result, tensors)
        if where is None:  # an extern kernel of a compiled graph (inductor calls aten for matmuls)
            source = self.graph_source()
            (counts.matmul_bytes if name in MATMULS else counts.extern_bytes)[source] += moved
            counts.work[(source, kind, moved, flops)] += 1
            return
        counts.eager_ops[where] += 1
        (counts.matmul_bytes if name in MATMULS else counts.eager_bytes)[where] += moved
        counts.work[(where, kind, moved, flops)] += 1
        if where == ENGINE and name in ("aten::add", "aten::add_"):
            target = args[0]
            into = "a parameter's .grad" if any(p.grad is target for p in self.model.parameters()) else "an activation"
            counts.adds[(tuple(target.shape), str(target.dtype).removeprefix("torch."), into)] += 1

    @staticmethod
    def graph_source() -> str:
        """Which part of the step a compiled graph's kernel belongs to: the train_gpt.py frames above it, or the
        backward's (run by the autograd engine, with no frame of ours)."""
        frame = sys._getframe(2)
        trainer_frames = []
        while frame is not None:
            if frame.f_code.co_filename == str(TRAINER):
                trainer_frames.append(getattr(frame.f_code, "co_qualname", frame.f_code.co_name))
            frame = frame.f_back
        if not trainer_frames:
            return "backward graphs"
        for name, prefixes in CATEGORIES:
            if any(q.startswith(prefixes) for q in trainer_frames):
                return name if name != "model, between its graphs" else "forward graphs"
        return STEP


def indexed_bytes(table: torch.Tensor, tensors: list) -> int:
    """An indexed op's bytes: its indices and values (the rows read out, or written in), and the table's rows it
    touches, as many bytes as those values."""
    others = [t for t in tensors if t is not table]
    return tensor_bytes(others) + max((t.numel() * t.element_size() for t in others if t.is_floating_point()),
                                      default=0)


def work_kind(name: str, args, result, tensors: list) -> tuple[str, int]:
    """The kind of device work an aten op is (WORK_KINDS) and its FLOPs: 2 x the output's elements x K for a matmul,
    none for the rest."""
    if name in MATMULS:
        first = args[FIRST_OPERAND.get(name, 0)]
        out = result[0] if isinstance(result, (tuple, list)) else result
        kind = "fp8 matmul" if first.element_size() == 1 else "matmul"
        return kind, 2 * out.numel() * first.shape[-1]
    strided = any(t.dim() > 1 and t.numel() > 1 and not t.is_contiguous() for t in tensors)
    return ("eager strided" if strided else "eager"), 0


class CountingBackend:
    """A torch.compile backend: aot_eager (the graphs and their backward, run op by op, which OpCounter leaves out
    as compiled) with a count of the calls of each forward and backward graph; with kernels=True, inductor."""

    def __init__(self, counter: OpCounter, kernels: bool):
        self.counter, self.kernels, self.graphs = counter, kernels, 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        if self.kernels:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(graph_module, example_inputs)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def counted(kind):
            def compiler(fx_graph, inputs):
                run = fx_graph.forward

                def call(*args):
                    if self.counter.counts is not None:
                        self.counter.counts.graph_calls[kind] += 1
                        self.counter.counts.graph_calls_by_source[OpCounter.graph_source()] += 1
                    return run(*args)
                return make_boxed_func(call)
            return compiler
        return aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward"))(graph_module,
                                                                                            example_inputs)


@contextlib.contextmanager
def kernel_launches(counter: OpCounter):
    """Each launch of an inductor-generated Triton kernel (fake Triton launches nothing) noted with the bytes and
    FLOPs its metadata gives, and each call of a compiled graph."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    run = CachingAutotuner.run

    def counted_run(self, *args, **kwargs):
        counts = counter.counts
        if counts is not None:
            source = OpCounter.graph_source()
            name = self.inductor_meta.get("kernel_name") or getattr(self.fn, "__name__", "kernel")
            counts.kernels[(source, name)] += 1
            moved = int(round(1e9 * (self.inductor_meta.get("kernel_num_gb") or 0.0)))
            counts.kernel_bytes[source] += moved
            kind = "attention" if "flex_attention" in name else "triton"
            counts.work[(source, kind, moved, int(self.inductor_meta.get("kernel_flop") or 0))] += 1
        return run(self, *args, **kwargs)

    from torch._inductor.output_code import CompiledFxGraph
    call = CompiledFxGraph.__call__

    def counted_call(self, inputs):  # a compiled graph's call: the backward's run on autograd's side, no frame of ours
        counts = counter.counts
        if counts is not None:
            source = OpCounter.graph_source()
            counts.graph_calls["backward" if source == "backward graphs" else "forward"] += 1
            counts.graph_calls_by_source[source] += 1
        return call(self, inputs)

    with unittest.mock.patch.object(CachingAutotuner, "run", counted_run), \
            unittest.mock.patch.object(CompiledFxGraph, "__call__", counted_call):
        yield


def markdown(result: dict) -> list[str]:
    """The counts as tables for bench.md."""
    lines = [f"## CPU counts: rank 0 of {result['world_size']}, fake H100, the {result['preset']} preset", "",
             "Per step (one of each kind a stage has, after a warm cycle). Eager ops: aten operations outside compiled graphs "
             "that launch a kernel; gradient adds: the autograd engine's; loss head B/logit: every byte the loss "
             "moves outside its matmuls" + (" (inductor's kernel_num_gb and eager operand bytes)" if result["kernels"]
                                            else " (eager operand bytes only: run with --kernels for the compiled "
                                                 "kernels' bytes)") + " per logit.", "",
             "| stage | step | eager ops | graph calls fwd / bwd | collectives | gradient adds | kernel launches | "
             "loss head B/logit |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in result["stages"].items():
        for kind, c in row["steps"].items():
            calls = c["graph_calls"]
            lines.append(f"| {name} | {kind} | {c['eager_ops']:,} | {calls.get('forward', 0)} / "
                         f"{calls.get('backward', 0)} | {c['collectives']} | {c['gradient_adds']} | "
                         f"{c['kernel_launches'] or '-'} | {c['loss_head_bytes_per_logit']:.2f} |")
    lines.append("")
    sources = sorted({s for row in result["stages"].values() for c in row["steps"].values()
                      for s in c["eager_ops_by_source"]})
    lines += ["Eager ops by source:", "", "| stage | step | " + " | ".join(sources) + " |",
              "| --- | --- | " + " | ".join("---" for _ in sources) + " |"]
    for name, row in result["stages"].items():
        for kind, c in row["steps"].items():
            lines.append(f"| {name} | {kind} | " + " | ".join(str(c["eager_ops_by_source"].get(s, 0))
                                                                 for s in sources) + " |")
    lines.append("")
    return lines

"""Peak GPU memory per rank of the speedrun's phases, computed with fake tensors: no GPU, and no memory
beyond the bookkeeping (FakeTensorMode allocates nothing).

    python tools/estimate_memory.py                      # the speedrun preset at world sizes 1 and 8
    python tools/estimate_memory.py --world_sizes 1 2 4 8 -- --micro_batches=16

Arguments after `--` are train_gpt.py flags. For each stage's micro-batch (record #85: 16,384, 32,768 and
49,152 tokens) and for the validation, per rank it counts:
  - weights, buffers (rotary tables, the bigram signs, the FP8 copies of the MLP up-projections) and the
    weights' gradients, in the GPU dtypes (bf16 but for the scalars and lambdas);
  - NorMuon's fp32 momentum and per-neuron second moment, and the bf16 weights' mantissas, for the matrices
    this rank owns (round robin, in chunks of the world size);
  - DistAdam's fp32 exp_avg and exp_avg_sq for this rank's 1/world_size shard of every bucket;
  - the tensors one micro-batch's forward keeps for backward, recorded by saved_tensors_hooks while the
    eager model runs on fake tensors. FlexAttention has no backward on CPU, so attention is stood in for
    by a function that keeps what FlexAttention's backward keeps (q, k, v, the output and the fp32
    log-sum-exp); torch.compile may keep less, so this is an upper bound for the compiled step;
  - the loss's transient: one chunk of LOSS_CHUNK rows of logits (bf16) and its fp32 squashed logits,
    exponentials and FP8 gradient (the full logits are never held);
  - the block masks of a micro-batch;
  - the step's communication buffers at world size > 1 (NorMuon's stacked gradients and gathered matrices
    of every chunk in flight at once, DistAdam's flat copies, the bigram rows of the sparse exchange);
  - the validation's largest moment: the model and optimizer state, and the most live tensors of a
    forward pass over one validation sequence (no gradients), followed op by op.
A training stage's peak = persistent state + max(its forward's saved tensors + masks + loss transient,
optimizer-step buffers). Allocator fragmentation, CUDA/NCCL context and compiled-kernel workspaces are not
counted. tools/preflight.py follows the live tensors of the compiled steps on a fake H100 and prints its
measure beside this one.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import fake_cuda  # noqa: E402  (its table of GPUs; nothing is loaded)
import train_gpt as T  # noqa: E402

GIB = 2 ** 30


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


class LiveMemory(TorchDispatchMode):
    """The bytes of the live storages its ops make, and their peak: what torch.cuda.max_memory_allocated
    would say, less the allocator's rounding, cache and fragmentation. A storage is counted once, however
    many tensors view it, until it is freed. `start()` begins a new peak from what is live now."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.storages: dict = {}
        self.live = self.peak = 0

    def sweep(self):
        for key, (ref, nbytes) in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
                self.live -= nbytes

    def start(self):
        gc.collect()  # torch.compile leaves its inputs in reference cycles: count what is reachable
        self.sweep()
        self.peak = self.live

    def track(self, tensors):
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            known = self.storages.get(ref)
            if known is not None and not known[0].expired():
                continue
            if known is not None:  # a freed storage's address, taken by a new one
                self.live -= known[1]
            self.storages[ref] = (ref, storage.nbytes())
            self.live += storage.nbytes()
            if self.live > self.peak:
                self.sweep()  # only when a new peak is possible: sweeping at every op would be slow
                self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out if isinstance(out, (tuple, list)) else [out])
        return out


def gpu_precisions(args: T.Hyperparameters, fp8: bool = True) -> tuple[str, str]:
    """The lm_head and MLP precisions `auto` resolves to on a GPU with FP8 matmuls (an H100) or without."""
    pick = lambda flag: (("fp8" if fp8 and T.fp8_fits(args) else "bf16") if getattr(args, flag) == "auto"
                         else getattr(args, flag))
    return pick("lm_head_precision"), pick("mlp_precision")


def gpu_model(args: T.Hyperparameters, fp8: bool = True) -> T.GPT:
    """The model in its GPU dtypes, built under the caller's FakeTensorMode."""
    return T.cast_for_device(T.GPT(args, *gpu_precisions(args, fp8)), torch.device("cuda"))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def normuon_bytes(muon: T.NorMuon, world_size: int, rank: int = 0) -> tuple[int, int]:
    """(state bytes this rank keeps, communication buffer bytes of one step) for NorMuon."""
    state = buffers = 0
    for chunk in muon.chunks(world_size):
        p, j, _ = muon.matrices[chunk[0]]
        matrix = p if j is None else p[j]
        n, size = matrix.numel(), matrix.element_size()
        if rank < len(chunk):
            state += 4 * (n + max(matrix.shape))  # fp32 momentum + per-neuron second moment
            state += 2 * n if matrix.dtype == torch.bfloat16 else 0  # the mantissas of the fp32 master
        if world_size > 1:  # stacked gradients, the owned mean (and its fp32 copy), gathered matrices
            buffers += 2 * size * world_size * n + (size + 4) * n
    return state, buffers


def dist_adam_bytes(adam: T.DistAdam, world_size: int, sparse_table: torch.Tensor,
                    touched_rows: int) -> tuple[int, int]:
    """(state bytes per rank, communication buffer bytes of one step) for DistAdam at world_size, whatever
    the world size it was built with (its buckets are the same). The bigram table's rows go by a sparse
    exchange, at most `touched_rows` of them each way, when its rows split evenly over the ranks."""
    state = buffers = 0
    sparse = adam._bucket_of[sparse_table] if sparse_table.size(0) % world_size == 0 else None
    for bucket in adam.buckets:
        p = bucket.params[0]
        shard = math.ceil(bucket.numel / world_size)
        state += 2 * 4 * shard  # fp32 exp_avg, exp_avg_sq (the tied embedding's too, from the untie on)
        if world_size > 1:
            in_place = len(bucket.params) == 1 and bucket.numel == shard * world_size
            buffers += (0 if in_place else 2 * p.element_size() * shard * world_size) + p.element_size() * shard
            if bucket is sparse:
                buffers += 2 * touched_rows * (p.size(1) * p.element_size() + 8)  # rows out and in, indices
    return state, buffers


def mask_bytes(masks: T.Masks) -> int:
    """Bytes of the distinct attention masks of one micro-batch (layers of one kind share one)."""
    total = 0
    for m in masks.by_kind.values():
        tensors = [m] if isinstance(m, torch.Tensor) else [t for t in m.as_tuple()[2:] if isinstance(t, torch.Tensor)]
        total += nbytes(tensors)
    return total


def loss_chunk_bytes(args: T.Hyperparameters, tokens: int) -> int:
    """The loss's transient: one chunk of logits (bf16), its fp32 squashed logits and exponentials, and its
    FP8 gradient."""
    rows = min(T.LOSS_CHUNK, tokens)
    return rows * T.padded_vocab(args.vocab_size) * (2 + 4 + 4 + 1)


def phases(args: T.Hyperparameters) -> list[tuple[str, int, tuple[int, int]]]:
    """(name, tokens of one sequence, windows) of each phase whose memory differs: each stage's micro-batch
    (the extension's is the last stage's) and the validation at the final windows."""
    schedule = T.Schedule(args)
    out, seen = [], set()
    for i, stage in enumerate(schedule.stages):
        micro = stage.batch_tokens // args.micro_batches
        if (micro, stage.windows) in seen or stage.end <= stage.start:
            continue
        seen.add((micro, stage.windows))
        name = f"stage {i + 1}" if i < len(schedule.stages) - 1 else "extension"
        out.append((name, micro, stage.windows))
    out.append(("validation", args.val_seq_len, schedule.final_val_windows))
    return out


def synthetic_tokens(length: int) -> torch.Tensor:
    tokens = torch.randint(0, T.BOS_ID, (length,))
    tokens[::1000] = T.BOS_ID  # documents of a thousand tokens: the masks' blocks are the data's
    return tokens


def estimate(argv: list[str], world_size: int, fp8: bool = True) -> dict[str, dict[str, float]]:
    """{phase: {row: bytes}} on rank 0 of world_size, for train_gpt.py's flags argv."""
    return estimate_args(T.parse_args(["--preset=speedrun", *argv], True), world_size, fp8)


def state_bytes(args: T.Hyperparameters, world_size: int, fp8: bool = True) -> int:
    """What a rank holds whatever the phase: weights, buffers, gradients and optimizer state (estimate_args's
    first rows, without running a forward pass)."""
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gpu_model(args, fp8)
        muon, adam = T.build_optimizers(model, args)
        return (2 * nbytes(model.parameters()) + nbytes(model.buffers()) + normuon_bytes(muon, world_size)[0]
                + dist_adam_bytes(adam, world_size, model.bigram_embed.weight, 0)[0])


def estimate_args(args: T.Hyperparameters, world_size: int, fp8: bool = True) -> dict[str, dict[str, float]]:
    T.check_world_size(args, world_size)
    real_attention = T.attention
    T.attention = lambda q, k, v, mask, scale: FlexStandIn.apply(q, k, v)
    try:
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = gpu_model(args, fp8)
            muon, adam = T.build_optimizers(model, args)
            weights = nbytes(model.parameters())
            buffers = nbytes(model.buffers())
            muon_state, muon_buffers = normuon_bytes(muon, world_size)
            rows = {}
            for name, tokens, windows in phases(args):
                x = synthetic_tokens(tokens + 1)
                masks = T.build_masks(x[:-1], model.plans, windows, args.window_block, use_flex=True)
                touched = min(model.bigram_embed.num_embeddings,
                              args.adam_every * tokens * (args.micro_batches // world_size))
                adam_state, adam_buffers = dist_adam_bytes(adam, world_size, model.bigram_embed.weight, touched)
                persistent = weights + buffers + muon_state + adam_state
                if name == "validation":
                    model.eval()
                    live = LiveMemory(device_type="cpu")  # fake tensors on the host; cast, not moved
                    with torch.no_grad(), live:
                        live.start()
                        base = live.live
                        model(x[:-1], x[1:], masks, windows)
                    model.train()
                    rows[name] = {"weights": weights, "buffers": buffers, "gradients": 0,
                                  "NorMuon state": muon_state, "DistAdam state": adam_state,
                                  "forward's largest live tensors": live.peak - base, "block masks": mask_bytes(masks),
                                  "peak": persistent + live.peak - base + mask_bytes(masks)}
                    continue
                saved: dict = {}

                def keep(t):
                    saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
                    return t

                mtp = torch.ones(len(T.Schedule(args).mtp_weights(0)))
                with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                    model(x[:-1], x[1:], masks, windows, mtp, loss_scale=1.0)
                activations, chunk, mask = sum(saved.values()), loss_chunk_bytes(args, tokens), mask_bytes(masks)
                rows[name] = {"weights": weights, "buffers": buffers, "gradients": weights,
                              "NorMuon state": muon_state, "DistAdam state": adam_state,
                              "saved activations": activations, "loss chunk": chunk, "block masks": mask,
                              "optimizer-step buffers": muon_buffers + adam_buffers,
                              "peak": persistent + weights + max(activations + chunk + mask, muon_buffers + adam_buffers)}
            return rows
    finally:
        T.attention = real_attention


# -----------------------------------------------------------------------------
# Flags that fit a card

# The share of a card's memory the counted tensors may take. The rest is for what neither this count nor the
# preflight's sees (the CUDA context, NCCL's buffers, the allocator's fragmentation, cuBLAS workspaces) and
# for the compiled step's own choices: the preflight measured up to 13% above this estimate (record #85's
# first Adam step, 17.61 against 15.55 GiB).
FIT_MARGIN = 0.15


@dataclass
class Fit:
    """What makes a recipe fit a card: the extra train_gpt.py flags (none if it fits as given), the estimated
    peak per phase with them, and, when nothing this tool may change helps, why."""
    flags: list[str]
    peaks: dict[str, float]
    budget: float
    reason: str = ""


def fitting_flags(flags: list[str], world_size: int, memory: int, fp8: bool = True) -> Fit:
    """More micro-batches per step (the same global batch, each micro-batch smaller) until every training
    phase's estimate fits (1 - FIT_MARGIN) of `memory`, then shorter validation sequences (the same
    validation tokens) until the validation fits. Each candidate must pass the trainer's own checks."""
    budget = memory * (1 - FIT_MARGIN)
    args = T.parse_args(flags, True)
    T.check_world_size(args, world_size)
    state = state_bytes(args, world_size, fp8)
    if state > budget:  # no micro-batch helps; known without the forward passes, which are slow at such sizes
        return Fit([], {}, budget, f"the weights, gradients and optimizer state alone take {state / GIB:.2f} GiB per "
                                   f"rank, over {budget / GIB:.2f} GiB ({1 - FIT_MARGIN:.0%} of the card); more GPUs "
                                   f"share the optimizer state")
    rows = estimate_args(args, world_size, fp8)
    extra: list[str] = []

    def fits(names) -> bool:
        return all(rows[n]["peak"] <= budget for n in names)

    def first_fitting(flag: str, values, names) -> bool:
        nonlocal rows
        for value in values:
            try:
                trial = T.parse_args([*flags, *extra, f"--{flag}={value}"], True)
                T.check_world_size(trial, world_size)
            except T.ConfigError:
                return False
            rows = estimate_args(trial, world_size, fp8)
            if fits(names):
                extra.append(f"--{flag}={value}")
                return True
        return False

    training = [n for n in rows if n != "validation"]
    if not fits(training) and not first_fitting("micro_batches", [args.micro_batches << j for j in range(1, 11)],
                                                training):
        return Fit([], {n: r["peak"] for n, r in rows.items()}, budget,
                   f"no micro-batch the batch divides into is small enough for {budget / GIB:.2f} GiB "
                   f"({1 - FIT_MARGIN:.0%} of the card); more GPUs share the micro-batches and the optimizer state")
    if not fits(["validation"]) and not first_fitting("val_seq_len", [args.val_seq_len >> j for j in range(1, 11)],
                                                      ["validation"]):
        return Fit([], {n: r["peak"] for n, r in rows.items()}, budget,
                   f"no validation sequence length fits {budget / GIB:.2f} GiB ({1 - FIT_MARGIN:.0%} of the card)")
    return Fit(extra, {n: r["peak"] for n, r in rows.items()}, budget)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gpu", choices=list(fake_cuda.GPUS), default="h100",
                        help="the card to fit (default h100); its memory, and FP8 or not")
    parser.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(2))
    options = parser.parse_args(ours)
    bad = [w for w in options.world_sizes if w < 1]
    if bad:
        print(f"error: --world_sizes: {bad[0]} is not a world size (at least 1)", file=sys.stderr)
        return 2
    card = fake_cuda.GPUS[options.gpu]
    fp8 = fake_cuda.has_fp8(card)
    try:
        tables = {w: estimate(flags, w, fp8) for w in options.world_sizes}
        fits = {w: fitting_flags(["--preset=speedrun", *flags], w, card.total_memory, fp8) for w in options.world_sizes}
    except (T.ConfigError, T.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for world_size, table in tables.items():
        print(f"\nworld size {world_size}, per rank (GiB)")
        names = list(table)
        print("| | " + " | ".join(names) + " |")
        print("| --- |" + " --- |" * len(names))
        keys = [k for k in dict.fromkeys(k for row in table.values() for k in row) if k != "peak"] + ["peak"]
        for key in keys:
            print(f"| {key} | " + " | ".join(f"{table[n][key] / GIB:.2f}" if key in table[n] else "" for n in names)
                  + " |")
        print(f"| room left on an {card.short_name} ({card.total_memory // 2 ** 20:,} MiB) | " +
              " | ".join(f"{(card.total_memory - table[n]['peak']) / GIB:.2f}" for n in names) + " |")
        fit = fits[world_size]
        print(f"{card.short_name} x {world_size}: " + (
            f"cannot fit: {fit.reason}" if fit.reason else
            f"fits within {1 - FIT_MARGIN:.0%} of its memory as given" if not fit.flags else
            f"fits within {1 - FIT_MARGIN:.0%} of its memory with {' '.join(fit.flags)} (peak "
            f"{max(fit.peaks.values()) / GIB:.2f} GiB)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

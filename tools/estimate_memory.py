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
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

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


def h100_precisions(args: T.Hyperparameters) -> tuple[str, str]:
    """The lm_head and MLP precisions `auto` resolves to on an H100 (compute capability 9.0)."""
    pick = lambda flag: ("fp8" if T.fp8_fits(args) else "bf16") if getattr(args, flag) == "auto" else getattr(args, flag)
    return pick("lm_head_precision"), pick("mlp_precision")


def gpu_model(args: T.Hyperparameters) -> T.GPT:
    """The model in its GPU dtypes, built under the caller's FakeTensorMode."""
    return T.cast_for_device(T.GPT(args, *h100_precisions(args)), torch.device("cuda"))


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


def estimate(argv: list[str], world_size: int) -> dict[str, dict[str, float]]:
    """{phase: {row: bytes}} on rank 0 of world_size, for train_gpt.py's flags argv."""
    return estimate_args(T.parse_args(["--preset=speedrun", *argv], True), world_size)


def estimate_args(args: T.Hyperparameters, world_size: int) -> dict[str, dict[str, float]]:
    T.check_world_size(args, world_size)
    real_attention = T.attention
    T.attention = lambda q, k, v, mask, scale: FlexStandIn.apply(q, k, v)
    try:
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = gpu_model(args)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 8])
    parser.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(2))
    options = parser.parse_args(ours)
    bad = [w for w in options.world_sizes if w < 1]
    if bad:
        print(f"error: --world_sizes: {bad[0]} is not a world size (at least 1)", file=sys.stderr)
        return 2
    try:
        tables = {w: estimate(flags, w) for w in options.world_sizes}
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
        print("| room left on an H100 (81,559 MiB) | " +
              " | ".join(f"{(H100_BYTES - table[n]['peak']) / GIB:.2f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

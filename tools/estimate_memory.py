"""Peak GPU memory per rank of the speedrun's phases, by the trainer's own memory model (train_gpt.py,
section "Memory model", which --micro_batches=auto and the start-up check use): fake tensors, so no GPU and
no memory beyond the bookkeeping.

    python tools/estimate_memory.py                      # the speedrun preset at world sizes 1 and 8
    python tools/estimate_memory.py --world_sizes 1 2 4 8 -- --micro_batches=16
    python tools/estimate_memory.py --gpu=rtx4090 -- --micro_batches=auto   # what auto chooses on that card

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
counted: the trainer keeps 15% of the memory for them (MEMORY_MARGIN). tools/preflight.py follows the live
tensors of the compiled steps on a fake GPU and prints its measure beside this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import fake_cuda  # noqa: E402  (its table of GPUs; nothing is loaded)
import train_gpt as T  # noqa: E402

GIB = T.GIB
CUDA = torch.device("cuda")  # the memory model casts for it; nothing is moved, fake tensors stay on the host


def gpu_numerics(args: T.Hyperparameters, fp8: bool = True) -> T.Numerics:
    """The precisions the trainer resolves on a GPU with FP8 matmuls (an H100) or without: bf16, and the
    lm_head's and MLP's that `auto` chooses there."""
    pick = lambda flag: (("fp8" if fp8 and T.fp8_fits(args) else "bf16") if getattr(args, flag) == "auto"
                         else getattr(args, flag))
    return T.Numerics(torch.bfloat16, pick("lm_head_precision"), pick("mlp_precision"))


def estimate(argv: list[str], world_size: int, card=fake_cuda.H100) -> dict[str, dict[str, float]]:
    """{phase: {row: bytes}} on rank 0 of world_size cards, for train_gpt.py's flags argv."""
    return estimate_args(T.parse_args(["--preset=speedrun", *argv], True), world_size, card)


def estimate_args(args: T.Hyperparameters, world_size: int, card=fake_cuda.H100) -> dict[str, dict[str, float]]:
    """The trainer's memory model (train_gpt.MemoryModel) on the card, with FlexAttention; under
    --micro_batches=auto, at the counts the trainer would choose there (auto_counts)."""
    T.check_world_size(args, world_size)
    numerics = gpu_numerics(args, fake_cuda.has_fp8(card))
    if args.micro_batches.strip() == "auto":
        return auto_counts(args, world_size, card)[1]
    return T.memory_model(args, world_size, CUDA, numerics, "flex").phases()


def card_budget(args: T.Hyperparameters, card) -> tuple[int, str]:
    """What the trainer would fit on the card, in bytes and in words: (1 - MEMORY_MARGIN) of its memory, or of
    --memory_limit_gib when the flags give it (train_gpt.card_memory decides which, for both)."""
    return T.within_margin(*T.card_memory(args, card.total_memory, f"an {card.short_name}"))


def auto_counts(args: T.Hyperparameters, world_size: int, card=fake_cuda.H100):
    """(counts per stage, rows) that --micro_batches=auto chooses on world_size of the card."""
    budget, within = card_budget(args, card)
    return T.fit_micro_batches(dataclasses.replace(args, micro_batches="auto"), world_size, CUDA,
                               gpu_numerics(args, fake_cuda.has_fp8(card)), "flex", budget, within)


# -----------------------------------------------------------------------------
# Flags that fit a card

@dataclass
class Fit:
    """What makes a recipe fit a card: the extra train_gpt.py flags (none if it fits as given), the estimated
    peak per phase with them, and, when nothing this tool may change helps, why."""
    flags: list[str]
    peaks: dict[str, float]
    budget: float
    within: str  # the budget in words: of the card, or of --memory_limit_gib
    reason: str = ""


def fitting_flags(flags: list[str], world_size: int, card=fake_cuda.H100) -> Fit:
    """The trainer's own choice (train_gpt.fit_micro_batches, as --micro_batches=auto makes it) when a
    training phase does not fit (1 - MEMORY_MARGIN) of the card's memory (of --memory_limit_gib, when the
    flags give it): per stage, the fewest micro-batches (the same global batch) that fit; then, if the
    validation does not fit, the longest --val_seq_len that does (the same validation tokens). When no
    micro-batch helps and the recipe has record #92's n-gram table, first the largest table that fits
    (fitting_ngram_rows): another algorithm than the flags', which tools/preflight.py's advice says."""
    args = T.parse_args(flags, True)
    budget, within = card_budget(args, card)
    T.check_world_size(args, world_size)
    numerics = gpu_numerics(args, fake_cuda.has_fp8(card))
    extra = []
    try:
        try:
            counts, rows = T.fit_micro_batches(args, world_size, CUDA, numerics, "flex", budget, within)
        except T.DoesNotFitError:
            table = fitting_ngram_rows(args, world_size, numerics, budget, within)
            if table is None:
                raise
            extra.append(f"--bigram_vocab_size={table}")
            args = dataclasses.replace(args, bigram_vocab_size=table)
            counts, rows = T.fit_micro_batches(args, world_size, CUDA, numerics, "flex", budget, within)
        if any(row["peak"] > budget for name, row in rows.items() if name != "validation"):
            counts, rows = T.fit_micro_batches(dataclasses.replace(args, micro_batches="auto"), world_size, CUDA,
                                               numerics, "flex", budget, within)
            extra.append(f"--micro_batches={T.micro_batches_flag(counts)}")
    except T.DoesNotFitError as e:
        return Fit([], {}, budget, within, str(e).removeprefix("--micro_batches=auto: "))
    peaks = {name: row["peak"] for name, row in rows.items()}
    if peaks["validation"] > budget:
        fitted = dataclasses.replace(args, micro_batches=T.micro_batches_flag(counts))
        length = T.fitting_val_seq_len(fitted, world_size, CUDA, numerics, "flex", budget)
        if length is None:
            return Fit([], peaks, budget, within, f"no validation sequence length fits {within}")
        extra.append(f"--val_seq_len={length}")
        peaks = estimate_args(T.parse_args([*flags, *extra], True), world_size, card)
        peaks = {name: row["peak"] for name, row in peaks.items()}
    return Fit(extra, peaks, budget, within)


# Sizes tried for a smaller n-gram table: whole multiples of 2**20 rows (even, and split by every world size that
# is a power of two up to 2**20), so that the flag reads as a round size.
NGRAM_ROWS_UNIT = 2 ** 20


def fitting_ngram_rows(args: T.Hyperparameters, world_size: int, numerics: T.Numerics, budget: int,
                       within: str) -> int | None:
    """The largest n-gram table (--bigram_vocab_size, record #92's --ngram_channels=2), smaller than the flags',
    with which the training phases fit at the micro-batches the flags give, or else at the fewest that fit with the
    smallest table (a step keeps its speed; the table takes what memory is left); None without the table, or when
    none fits. A rank's state only grows with the table, so the sizes that fit lie below a bound: bisected."""
    unit = math.lcm(NGRAM_ROWS_UNIT, world_size)
    if args.ngram_channels != 2 or args.bigram_vocab_size <= unit:
        return None

    def training_fits(trial: T.Hyperparameters) -> tuple[int, ...] | None:
        try:
            counts, rows = T.fit_micro_batches(trial, world_size, CUDA, numerics, "flex", budget, within)
        except T.DoesNotFitError:
            return None
        return counts if all(row["peak"] <= budget for name, row in rows.items() if name != "validation") else None

    smallest = dataclasses.replace(args, bigram_vocab_size=unit)
    counts = training_fits(smallest) or training_fits(dataclasses.replace(smallest, micro_batches="auto"))
    if counts is None:
        return None
    micro_batches = T.micro_batches_flag(counts)
    low, high = 1, (args.bigram_vocab_size - 1) // unit  # low: the most units known to fit
    while low < high:
        middle = (low + high + 1) // 2
        trial = dataclasses.replace(args, bigram_vocab_size=middle * unit, micro_batches=micro_batches)
        low, high = (middle, high) if training_fits(trial) else (low, middle - 1)
    return low * unit


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gpu", choices=list(fake_cuda.GPUS), default="h100",
                        help="the card to fit (default h100); its memory, and FP8 or not")
    parser.error = lambda message: (T.console_line(f"error: {message}", sys.stderr), sys.exit(2))
    options = parser.parse_args(ours)
    bad = [w for w in options.world_sizes if w < 1]
    if bad:
        print(f"error: --world_sizes: {bad[0]} is not a world size (at least 1)", file=sys.stderr)
        return 2
    bad = [w for w in options.world_sizes if w > T.MAX_BATCH_TOKENS]
    if bad:  # every rank trains on a token of each step at least
        print(f"error: --world_sizes: {bad[0]} ranks, more than a step's tokens can be (at most "
              f"{T.MAX_BATCH_TOKENS:,}, train_gpt.MAX_BATCH_TOKENS)", file=sys.stderr)
        return 2
    card = fake_cuda.GPUS[options.gpu]
    try:
        tables = {w: estimate(flags, w, card) for w in options.world_sizes}
        fits = {w: fitting_flags(["--preset=speedrun", *flags], w, card) for w in options.world_sizes}
    except (T.ConfigError, T.DataError) as e:
        T.console_line(f"error: {e}", sys.stderr)
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
        args = T.parse_args(["--preset=speedrun", *flags], True)
        if args.micro_batches.strip() == "auto" and not fit.reason:
            print(f"--micro_batches=auto chooses {T.micro_batches_flag(auto_counts(args, world_size, card)[0])} "
                  f"(micro-batches a step, per stage)")
        print(f"{card.short_name} x {world_size}: " + (
            f"cannot fit: {fit.reason}" if fit.reason else
            f"fits within {fit.within} as given" if not fit.flags else
            f"fits within {fit.within} with {' '.join(fit.flags)} (peak {max(fit.peaks.values()) / GIB:.2f} GiB)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""train_gpt.py: the NanoGPT speedrun trainer in one file.

Trains a GPT-2-small-class model on FineWeb10B to 3.28 val loss as fast as 8xH100 allow, with the
learning algorithm of public modded-nanogpt record #44 (2025-10-31, "AdamSyncGradientHook")
rewritten in plain PyTorch: FlexAttention instead of FlashAttention-3, matmuls instead of Triton
kernels. notes/recipe.md lists every component next to the record's value. The same file runs on
one GPU (gradient accumulation keeps the global batch), on several nodes (torchrun rendezvous) and
on CPU (gloo, the `smoke` preset on the bundled corpus).

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # the record run
    python train_gpt.py --preset=smoke                                # CPU, ~2 minutes

Read top to bottom: config, distributed setup, model, optimizers, data, schedules, training step,
checkpoints, evaluation and logging, main(). Importing this file has no side effects.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import glob
import hashlib
import io
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

if dist.is_available():
    # torch.distributed.nn.functional binds group.WORLD as a default argument when it is first imported,
    # which torch.compile and torch.optim do lazily. Imported after init_process_group, it keeps the group
    # alive past destroy_process_group, so the group's gloo threads outlive Python: one that drops the last
    # reference to a collective's tensor while the interpreter shuts down aborts the process ("terminate
    # called without an active exception"). Imported now, before any group exists, it binds None.
    import torch.distributed.nn.functional  # noqa: F401


class ConfigError(ValueError):
    """Bad command line or configuration; the message names the flag."""


class DataError(ValueError):
    """Missing or malformed token shards; the message names the file or glob."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, a dead rank, a bad checkpoint)."""


# -----------------------------------------------------------------------------
# Config: one dataclass, named presets, `--field=value` overrides

def _help(text: str, default):
    return field(default=default, metadata={"help": text})


@dataclass
class Hyperparameters:
    preset: str = _help("named set of values: speedrun (8xH100 record) or smoke (CPU, bundled corpus)", "speedrun")
    # data
    train_files: str = _help("glob of training shards", "data/fineweb10B/fineweb_train_*.bin")
    val_files: str = _help("glob of validation shards", "data/fineweb10B/fineweb_val_*.bin")
    val_tokens: int = _help("tokens per validation, exactly; the standard speedrun uses 10M", 10_485_760)
    val_seq_len: int = _help("tokens per validation sequence (record #44: 262,144)", 262_144)
    batch_tokens: int = _help("tokens per optimizer step, over all ranks; fixed whatever the world size", 262_144)
    micro_batch_tokens: int = _help("tokens one rank processes in one forward/backward (one packed sequence)", 32_768)
    train_max_seq_len: int = _help("a training document contributes at most its first N tokens", 2048)
    synthetic: bool = _help("feed synthetic tokens with web-like document lengths instead of shards (benchmarks)", False)
    repeat_data: bool = _help("when the training shards supply fewer steps than num_iterations, start over from "
                              "the first shard (each time logged) instead of refusing to run", False)
    # model
    vocab_size: int = _help("GPT-2 vocabulary; the embedding is padded to a multiple of 128", 50_257)
    num_layers: int = _help("transformer blocks", 12)
    model_dim: int = _help("residual stream width", 768)
    head_dim: int = _help("attention head size; heads = model_dim / head_dim", 128)
    mlp_ratio: int = _help("MLP hidden width / model_dim", 4)
    num_value_embeds: int = _help("value embeddings k: embedding i feeds layer i and layer L-k+i", 3)
    no_attention_layers: str = _help("comma-separated layers without attention", "0,7")
    no_mlp_layers: str = _help("comma-separated layers without MLP (a layer with neither is skipped)", "0")
    long_window_layers: str = _help("comma-separated layers with the long attention window; the rest use the short",
                                    "4,11")
    backout_layer: int = _help("this layer's output, times a learned weight (0.5 at init), is subtracted before "
                               "the head; -1: none", 8)
    logit_cap: float = _help("logits are squashed to (0, cap) with cap * sigmoid(x / logit_cap_width)", 30.0)
    logit_cap_width: float = _help("see logit_cap", 7.5)
    lm_head_precision: str = _help("auto (fp8 on GPUs of compute capability >= 8.9 when model_dim and "
                                   "micro_batch_tokens are multiples of 16, else bf16 on GPUs, fp32 on CPU), fp8, "
                                   "bf16 or fp32; fp8 applies to training, evaluation uses bf16", "auto")
    # attention (window sizes in blocks of window_block tokens)
    attention: str = _help("auto (flex on CUDA, sdpa elsewhere), flex (FlexAttention block masks) or sdpa "
                           "(dense boolean mask)", "auto")
    window_block: int = _help("tokens per window block; FlexAttention's block size", 128)
    window_schedule: str = _help("long windows in blocks, one per equal part of the scheduled steps; short "
                                 "windows are half as long", "3,7,11")
    window_extension: int = _help("long window during the extension steps", 13)
    window_final_val: int = _help("long window of the final validation", 20)
    # optimization
    num_iterations: int = _help("optimizer steps in all: the scheduled ones, then the extension", 2245)
    extension_steps: int = _help("last steps, run at the final lr and windows", 40)
    cooldown_frac: float = _help("fraction of the scheduled steps over which the lr decays linearly", 0.5)
    final_lr_frac: float = _help("learning-rate multiplier at the end of the cooldown", 0.1)
    embed_lr: float = _help("Adam lr for token and value embeddings", 0.6)
    head_lr: float = _help("Adam lr for the lm_head", 0.008)
    scalar_lr: float = _help("Adam lr for scalars (mixing weights, skip gates)", 0.04)
    adam_beta1: float = _help("Adam beta1", 0.65)
    adam_beta2: float = _help("Adam beta2", 0.95)
    adam_eps: float = _help("Adam epsilon", 1e-8)
    adam_every: int = _help("Adam steps every N steps, on the gradients of all N", 2)
    muon_lr: float = _help("NorMuon lr for hidden matrices and gates", 0.03)
    muon_beta2: float = _help("NorMuon's per-neuron second-moment decay", 0.95)
    muon_weight_decay: float = _help("NorMuon's cautious weight decay, scaled by lr^2", 1.2)
    muon_momentum_start: float = _help("NorMuon momentum at step 0 and at the end", 0.85)
    muon_momentum_end: float = _help("NorMuon momentum between warmup and cooldown", 0.95)
    muon_momentum_warmup: int = _help("steps over which NorMuon momentum rises", 300)
    muon_momentum_cooldown: int = _help("last steps over which NorMuon momentum falls back", 50)
    # run control
    seed: int = _help("seed for the initial weights (identical on every rank)", 1337)
    device: str = _help("auto, cuda or cpu", "auto")
    compile: bool = _help("torch.compile each block and the loss head (false: FlexAttention alone, on CUDA)", True)
    warmup_steps: int = _help("untimed steps that compile every kernel; the state is restored after them", 2)
    val_loss_every: int = _help("validate every N steps (0: only at the end)", 250)
    train_loss_every: int = _help("log the train loss every N steps (0: never); costs one host sync", 250)
    run_id: str = _help("a plain name (letters, digits, -_.) for the log logs/<run_id>.txt and the checkpoint folder "
                        "(default: a timestamp and a random suffix)", "")
    logs_dir: str = _help("where logs are written", "logs")
    pg_timeout_s: int = _help("collective timeout; after it the surviving ranks of a broken job exit", 300)
    save_every: int = _help("save a checkpoint every N steps (0: never); a multiple of adam_every", 0)
    save_final: bool = _help("write the final weights to checkpoint_dir/<run_id>/final/ (for sample.py)", False)
    checkpoint_dir: str = _help("where checkpoints are written", "checkpoints")
    resume: str = _help("checkpoint folder to resume from, or 'latest'", "")
    force_resume: bool = _help("resume even if the config or code differs from the checkpoint's", False)


PRESETS: dict[str, dict] = {
    # The 8xH100 record configuration: the dataclass defaults.
    "speedrun": {},
    # A small model on the bundled Shakespeare shards: a CPU check of the whole pipeline, with the
    # speedrun's structure scaled down (a skipped layer 0, one attention-free layer, value
    # embeddings, U-net skips, backout, three window sizes and an extension, Adam every 2 steps).
    "smoke": dict(
        train_files="data/shakespeare/shakespeare_train_*.bin",
        val_files="data/shakespeare/shakespeare_val_*.bin",
        val_tokens=8192, val_seq_len=1024,
        batch_tokens=2048, micro_batch_tokens=512, train_max_seq_len=512,
        num_layers=6, model_dim=64, head_dim=16, num_value_embeds=2,
        no_attention_layers="0,3", no_mlp_layers="0", long_window_layers="2,5", backout_layer=4,
        lm_head_precision="auto",
        window_block=64, window_schedule="2,4,6", window_extension=7, window_final_val=10,
        num_iterations=30, extension_steps=2,
        embed_lr=0.6, head_lr=0.06, scalar_lr=0.04, muon_lr=0.04,
        muon_momentum_warmup=10, muon_momentum_cooldown=4,
        compile=False, val_loss_every=10, train_loss_every=10,
    ),
}

# Fields that steer one run without changing what it computes: a checkpoint may be
# resumed with different values of these.
RUN_CONTROL_FIELDS = ("run_id", "logs_dir", "pg_timeout_s", "save_every", "save_final", "checkpoint_dir",
                      "resume", "force_resume", "val_loss_every", "train_loss_every", "warmup_steps", "compile")


def _parse_value(name: str, text: str, typ: type):
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name}={text}: expected a boolean (true/false)")
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"--{name}={text}: expected {typ.__name__}") from None


def parse_args(argv: list[str], cuda_available: bool) -> Hyperparameters:
    """`--field=value` (or `--field value`) for every Hyperparameters field; `--preset=NAME` first."""
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    types = {name: {"str": str, "int": int, "float": float, "bool": bool}[f.type] for name, f in fields.items()}
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(usage())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --field=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value: --{name}=VALUE")
            value, i = argv[i + 1], i + 1
        if name not in fields:
            raise ConfigError(f"unknown flag --{name}; valid flags: " + ", ".join(f"--{n}" for n in fields))
        pairs.append((name, value))
        i += 1
    preset = dict(pairs).get("preset", "speedrun" if cuda_available else "smoke")
    if preset not in PRESETS:
        raise ConfigError(f"--preset={preset}: unknown preset; choose one of {', '.join(PRESETS)}")
    values = {**PRESETS[preset], "preset": preset}
    for name, text in pairs:
        values[name] = _parse_value(name, text, types[name])
    args = Hyperparameters(**values)
    validate_config(args)
    return args


def usage() -> str:
    lines = ["usage: train_gpt.py [--preset=speedrun|smoke] [--field=value ...]", "", "fields (speedrun default):"]
    for f in dataclasses.fields(Hyperparameters):
        lines.append(f"  --{f.name}={f.default!s:<40} {f.metadata['help']}")
    return "\n".join(lines)


def int_list(args: Hyperparameters, name: str) -> tuple[int, ...]:
    """A comma-separated field such as --no_attention_layers=0,7 as a tuple of ints."""
    text = getattr(args, name).strip()
    try:
        return tuple(int(part) for part in text.split(",")) if text else ()
    except ValueError:
        raise ConfigError(f"--{name}={text}: expected comma-separated integers, e.g. 0,7") from None


MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective that waits longer than a week is a hang, not a slow rank
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # one file name: no separators, no way out of logs_dir


def validate_config(args: Hyperparameters):
    positive = ["val_tokens", "val_seq_len", "batch_tokens", "micro_batch_tokens", "train_max_seq_len", "vocab_size",
                "num_layers", "model_dim", "head_dim", "mlp_ratio", "window_block", "window_extension",
                "window_final_val", "num_iterations", "adam_every"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be positive")
    for name in ["val_loss_every", "train_loss_every", "save_every", "warmup_steps", "num_value_embeds",
                 "extension_steps", "muon_momentum_warmup", "muon_momentum_cooldown"]:
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be zero or positive")
    # Values outside these ranges cannot be meant: they would train (and "succeed") on nonsense, or fail
    # deep inside PyTorch. Written so that NaN fails every test.
    ranges = [
        (("embed_lr", "head_lr", "scalar_lr", "muon_lr", "muon_weight_decay", "final_lr_frac"),
         lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        (("adam_beta1", "adam_beta2", "muon_beta2", "muon_momentum_start", "muon_momentum_end"),
         lambda v: 0 <= v < 1, "in [0, 1)"),
        (("adam_eps", "logit_cap", "logit_cap_width"), lambda v: 0 < v < math.inf, "a finite number > 0"),
        (("cooldown_frac",), lambda v: 0 <= v <= 1, "in [0, 1]"),
        (("pg_timeout_s",), lambda v: 0 < v <= MAX_TIMEOUT_S, f"in 1..{MAX_TIMEOUT_S} seconds (a week)"),
        (("seed",), lambda v: 0 <= v < 2 ** 64, "in 0..2**64-1"),
    ]
    for names, in_range, expected in ranges:
        for name in names:
            if not in_range(getattr(args, name)):
                raise ConfigError(f"--{name}={getattr(args, name)}: must be {expected}")
    if args.run_id and (not RUN_ID_PATTERN.fullmatch(args.run_id) or args.run_id in (".", "..")):
        raise ConfigError(f"--run_id={args.run_id}: must be a plain name of at most 200 letters, digits, '-', '_' "
                          f"and '.' (it names the log file and the checkpoint folder)")
    if args.synthetic and args.vocab_size <= BOS_ID:  # shards say so themselves (check_token_ids)
        raise ConfigError(f"--vocab_size={args.vocab_size}: --synthetic=true documents start with <|endoftext|>, "
                          f"token {BOS_ID}; the vocabulary must hold it")
    if args.model_dim % args.head_dim:
        raise ConfigError(f"--model_dim={args.model_dim} must be a multiple of --head_dim={args.head_dim}")
    if args.head_dim % 4:
        raise ConfigError(f"--head_dim={args.head_dim} must be a multiple of 4 (rotary turns half of each head's "
                          f"dimensions, in pairs)")
    if args.model_dim < GATE_CHANNELS:
        raise ConfigError(f"--model_dim={args.model_dim}: the gates read the first {GATE_CHANNELS} channels")
    if 2 * args.num_value_embeds > args.num_layers:
        raise ConfigError(f"--num_value_embeds={args.num_value_embeds}: at most num_layers/2 = {args.num_layers // 2}")
    for name in ("no_attention_layers", "no_mlp_layers", "long_window_layers"):
        for layer in int_list(args, name):
            if not 0 <= layer < args.num_layers:
                raise ConfigError(f"--{name}: layer {layer} is not in 0..{args.num_layers - 1}")
    used = {spec.value_embed for spec in layer_specs(args)}
    for i in range(args.num_value_embeds):
        if i not in used:
            raise ConfigError(f"--num_value_embeds={args.num_value_embeds}: value embedding {i} would feed no layer "
                              f"with attention (layers {i} and {args.num_layers - args.num_value_embeds + i})")
    if not -1 <= args.backout_layer < args.num_layers:
        raise ConfigError(f"--backout_layer={args.backout_layer}: must be -1 or a layer in 0..{args.num_layers - 1}")
    schedule = int_list(args, "window_schedule")
    if not schedule or min(schedule) <= 0:
        raise ConfigError(f"--window_schedule={args.window_schedule}: expected positive block counts, e.g. 3,7,11")
    for name in ("micro_batch_tokens", "val_seq_len"):
        if getattr(args, name) % args.window_block:
            raise ConfigError(f"--{name}={getattr(args, name)} must be a multiple of --window_block={args.window_block}")
    if args.batch_tokens % args.micro_batch_tokens:
        raise ConfigError(f"--batch_tokens={args.batch_tokens} must be a multiple of "
                          f"--micro_batch_tokens={args.micro_batch_tokens}")
    if args.val_tokens % args.val_seq_len:
        raise ConfigError(f"--val_tokens={args.val_tokens} must be a multiple of --val_seq_len={args.val_seq_len}")
    if args.extension_steps >= args.num_iterations:
        raise ConfigError(f"--extension_steps={args.extension_steps} must be less than "
                          f"--num_iterations={args.num_iterations}")
    if args.save_every % args.adam_every:
        raise ConfigError(f"--save_every={args.save_every} must be a multiple of --adam_every={args.adam_every}: "
                          f"a checkpoint between two Adam steps would lose the gradients accumulated so far")
    for name, choices in (("device", ("auto", "cuda", "cpu")), ("attention", ("auto", "flex", "sdpa")),
                          ("lm_head_precision", ("auto", "fp8", "bf16", "fp32"))):
        if getattr(args, name) not in choices:
            raise ConfigError(f"--{name}={getattr(args, name)}: choose {', '.join(choices)}")
    if args.lm_head_precision == "fp8" and not fp8_head_fits(args):
        raise ConfigError(f"--lm_head_precision=fp8: FP8 matmuls need --model_dim (here {args.model_dim}) and "
                          f"--micro_batch_tokens (here {args.micro_batch_tokens}) to be multiples of 16; use bf16")


def fp8_head_fits(args: Hyperparameters) -> bool:
    """torch._scaled_mm takes only multiples of 16 for the dimensions the FP8 head multiplies over."""
    return args.model_dim % 16 == 0 and args.micro_batch_tokens % 16 == 0


def check_world_size(args: Hyperparameters, world_size: int) -> int:
    """Micro-batches per rank per step; the global batch never changes with the world size."""
    chunks = args.batch_tokens // args.micro_batch_tokens
    if chunks % world_size:
        raise ConfigError(f"world size {world_size} cannot split the batch: --batch_tokens={args.batch_tokens} is "
                          f"{chunks} micro-batches of --micro_batch_tokens={args.micro_batch_tokens}, "
                          f"not a multiple of {world_size} (a smaller --micro_batch_tokens makes more)")
    if (args.val_tokens // args.val_seq_len) % world_size:
        raise ConfigError(f"world size {world_size} cannot split validation: --val_tokens={args.val_tokens} is "
                          f"{args.val_tokens // args.val_seq_len} sequences of --val_seq_len={args.val_seq_len}")
    return chunks // world_size


def resolve_attention(args: Hyperparameters, device: torch.device, training: bool = True) -> str:
    """flex or sdpa. PyTorch has no FlexAttention backward on CPU, so CPU training takes sdpa."""
    choice = args.attention if args.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    if choice == "flex" and device.type != "cuda" and training:
        raise ConfigError("--attention=flex: PyTorch has no FlexAttention backward on CPU; train on CPU with "
                          "--attention=sdpa (flex serves forward passes there)")
    if choice == "sdpa" and training:
        longest = max_positions(args)
        need, have = dense_mask_bytes(longest), device_memory_bytes(device)
        if need > have:  # certain to run out of memory, at the first step or the first validation
            raise ConfigError(f"--attention=sdpa: the dense attention mask of a {longest:,}-token sequence takes "
                              f"at least {need / 2 ** 30:,.0f} GiB to build, more than the {have / 2 ** 30:,.0f} GiB "
                              f"{device if device.type == 'cuda' else 'this machine'} has; use --attention=flex on a "
                              f"GPU, or a shorter --val_seq_len or --micro_batch_tokens")
    return choice


def dense_mask_bytes(sequence: int) -> int:
    """A lower bound of what dense_attention_mask holds at once: int64 distances and the boolean mask."""
    return sequence * sequence * (8 + 1)


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_head_precision(args: Hyperparameters, device: torch.device) -> str:
    """fp8 needs the FP8 tensor cores of compute capability 8.9 (Ada, Hopper) and later, and widths
    FP8 matmuls take (fp8_head_fits); auto falls back to bf16 without them, and the log header says so."""
    fp8_capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if args.lm_head_precision == "auto":
        return "fp8" if fp8_capable and fp8_head_fits(args) else ("bf16" if device.type == "cuda" else "fp32")
    if args.lm_head_precision == "fp8" and device.type == "cuda" and not fp8_capable:
        raise ConfigError(f"--lm_head_precision=fp8: {torch.cuda.get_device_name(device)} has no FP8 tensor cores "
                          f"(compute capability 8.9 or later); use bf16")
    return args.lm_head_precision


# -----------------------------------------------------------------------------
# Distributed setup: torchrun's environment, or one process without it

@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(args: Hyperparameters) -> DistEnv:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA device is available")
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    resolve_attention(args, device)  # refuse what this device cannot train before any process group exists
    resolve_head_precision(args, device)
    if world_size > 1 and not dist.is_initialized():  # tools/preflight.py brings its own (fake) group
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=args.pg_timeout_s),
                                device_id=device if use_cuda else None)
    return DistEnv(rank, local_rank, world_size, device)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok: lets all ranks stop together instead of hanging."""
    if not distributed():
        return ok
    flag = torch.full((1,), int(ok), dtype=torch.int32, device=device)  # a factory: fake tensors (preflight) too
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def gather_from_ranks(obj) -> list:
    """obj from every rank, in rank order (a list of one without a process group)."""
    if not distributed():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# PyTorch 2.13 renames the tensor collectives (the old names warn); 2.11 has only the old ones.
def reduce_scatter_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, async_op=True)


# -----------------------------------------------------------------------------
# Model: record #44's GPT. Layers may drop attention or MLP; value embeddings feed the first and
# last layers; U-net skips with sigmoid gates; a smear gate on the token embedding; per-head
# attention gates; half-truncated rotary with YaRN; a "backout" of an inner layer's output;
# logits squashed as cap * sigmoid(x / width).

GATE_CHANNELS = 12  # the smear and attention gates read this many leading channels of their input
ATTN_SCALE = 0.1  # attention logit scale at the first window (record #44); YaRN raises it
ROPE_MIN_FREQ = 1 / 1024  # rotary frequencies run from 1 down to this, over a quarter of each head's dims
YARN_ALPHA, YARN_BETA = 1, 32  # frequencies turning fewer/more times than this over a window are fully/not rescaled
SKIP_GATE_INIT = -1.5  # U-net skip weights start at sigmoid(-1.5) = 0.18
BACKOUT_INIT = 0.5
BOS_ID = 50256  # <|endoftext|> starts every document


def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def uniform_init_(weight: Tensor, std: float):
    bound = 3 ** 0.5 * std  # a uniform distribution with this standard deviation
    with torch.no_grad():
        weight.uniform_(-bound, bound)


class CastedLinear(nn.Linear):
    """A bias-free linear layer that multiplies in its input's dtype (bf16 on GPUs). Zero-initialised
    unless given a std: output projections, the head and the gates start at zero (modded-nanogpt)."""

    def __init__(self, in_features: int, out_features: int, std: float = 0.0):
        super().__init__(in_features, out_features, bias=False)
        if std:
            uniform_init_(self.weight, std)
        else:
            nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x))


# FP8 lm_head (record #44): activations and weights in float8_e4m3, the logits' gradient in float8_e5m2,
# with fixed scales that map each operand's largest plausible value near the format's maximum.
FP8_E4M3_MAX = 448.0
FP8_WEIGHT_SCALE = 2 ** -9  # weights up to 448 / 512 = 0.875
FP8_GRAD_SCALE = 1 / FP8_E4M3_MAX  # the gradient of one logit of a summed cross-entropy is at most 1


def quantize_fp8(t: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    return (t / scale).to(dtype)


def scaled_mm(a: Tensor, b: Tensor, scale_a: float, scale_b: float, out_dtype: torch.dtype,
              fast_accum: bool = False) -> Tensor:
    """(a * scale_a) @ (b * scale_b) for float8 a (row-major) and b (column-major)."""
    return torch._scaled_mm(a, b, scale_a=a.new_full((), scale_a, dtype=torch.float32),
                            scale_b=a.new_full((), scale_b, dtype=torch.float32),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class FP8Linear(torch.autograd.Function):
    """x @ w.T in FP8 (bf16 out); backward in FP8. The weight gradient leaves the FP8 matmul in fp32, and
    autograd rounds it to the weight's own dtype (bf16 on GPUs) before it reaches w.grad."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, x_scale: float) -> Tensor:
        x8 = quantize_fp8(x, x_scale, torch.float8_e4m3fn)
        w8 = quantize_fp8(w, FP8_WEIGHT_SCALE, torch.float8_e4m3fn)
        ctx.save_for_backward(x8, w8)
        ctx.x_scale = x_scale
        return scaled_mm(x8, w8.T, x_scale, FP8_WEIGHT_SCALE, torch.bfloat16, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x8, w8 = ctx.saved_tensors
        g8 = quantize_fp8(grad.contiguous(), FP8_GRAD_SCALE, torch.float8_e5m2)
        grad_x = scaled_mm(g8, w8.T.contiguous().T, FP8_GRAD_SCALE, FP8_WEIGHT_SCALE, torch.bfloat16)
        grad_w = scaled_mm(x8.T.contiguous(), g8.T.contiguous().T, ctx.x_scale, FP8_GRAD_SCALE, torch.float32).T
        return grad_x, grad_w, None


class Rotary(nn.Module):
    """Rotary position embedding on half of each head's dimensions (the other half carries no
    position), with YaRN: when the attention window grows, frequencies that turn only a few times
    across the old window are slowed down in proportion, so that the new window's distances look like
    distances the model has seen, and the attention scale grows with log(new / old).

    Its state (frequencies, attention scale, the window they were fitted to) is in the state dict,
    so checkpoints resume exactly; the cos/sin tables are recomputed from it."""

    def __init__(self, head_dim: int, max_len: int, window_block: int, first_window: int):
        super().__init__()
        self.window_block, self.first_window = window_block, first_window
        self.register_buffer("angular_freq", torch.zeros(head_dim // 2))
        self.register_buffer("cos", torch.zeros(max_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.zeros(max_len, head_dim // 2), persistent=False)
        self.register_buffer("attn_scale", torch.zeros(()), persistent=False)  # a tensor: data, not a constant
        self.window, self.scale = first_window, ATTN_SCALE
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh())
        self.reset()

    @torch.no_grad()
    def reset(self):
        quarter = self.angular_freq.numel() // 2
        freq = ROPE_MIN_FREQ ** torch.linspace(0, 1, quarter, device=self.angular_freq.device)
        self.angular_freq.copy_(torch.cat([freq, freq.new_zeros(quarter)]))
        self.window, self.scale = self.first_window, ATTN_SCALE
        self.refresh()

    @torch.no_grad()
    def set_window(self, window: int):
        """Fit the frequencies to a long window of `window` blocks (YaRN); nothing if it is the current one."""
        if window == self.window:
            return
        old = self.window
        turns = self.window_block * old * self.angular_freq / (2 * math.pi)  # turns across the old window
        keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        ratio = old / window
        self.angular_freq.mul_(ratio + keep * (1 - ratio))
        self.scale *= 0.2 * math.log(window / old) + 1
        self.window = window
        self.refresh()

    @torch.no_grad()
    def refresh(self):
        positions = torch.arange(self.cos.size(0), dtype=torch.float32, device=self.cos.device)
        theta = torch.outer(positions, self.angular_freq)
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())
        self.attn_scale.fill_(self.scale)

    def get_extra_state(self) -> dict:
        return {"window": self.window, "attn_scale": self.scale}

    def set_extra_state(self, state: dict):
        self.window, self.scale = int(state["window"]), float(state["attn_scale"])


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, T, H, D); cos, sin: (T, D/2) for the positions of x."""
    cos, sin = cos.type_as(x)[None, :, None, :], sin.type_as(x)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


# Attention masks. A query sees itself and the `window` positions before it (window + 1 keys, like
# FlashAttention's window (w, 0)), within its document: a BOS token starts a new one. FlexAttention
# gets a BlockMask built from per-block document ranges, with the window and the document ids as
# tensors, so neither becomes a compile-time constant; SDPA gets the same mask as a dense tensor.

def document_ids(tokens: Tensor) -> Tensor:
    return (tokens == BOS_ID).cumsum(0)


def dense_attention_mask(docs: Tensor, window: int, num_queries: int | None = None) -> Tensor:
    """(queries, keys) boolean mask; the queries are the last num_queries positions (default: all)."""
    keys = torch.arange(docs.numel(), device=docs.device)
    queries = keys[-(num_queries or docs.numel()):]
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) & (distance <= window) & (docs[queries][:, None] == docs[None, :])


def _ordered_blocks(visible: Tensor) -> tuple[Tensor, Tensor]:
    """(q_blocks, kv_blocks) booleans -> BlockMask's counts and indices, the visible key blocks first."""
    counts = visible.sum(-1, dtype=torch.int32)
    order = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def flex_block_mask(docs: Tensor, window: int, block_size: int):
    from torch.nn.attention.flex_attention import BlockMask

    length = docs.numel()
    window_t = torch.full((), window, dtype=docs.dtype, device=docs.device)

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance <= window_t) & (docs[q_idx] == docs[kv_idx])

    # Which (query block, key block) pairs have some visible pair of positions, and which have only
    # visible ones (those skip mask_mod): from each block's first and last document id and distances.
    blocks = torch.arange(length // block_size, device=docs.device)
    first, last = docs[::block_size], docs[block_size - 1::block_size]
    q, kv = blocks[:, None], blocks[None, :]
    distance = (q - kv) * block_size
    some = (kv <= q) & (last[None, :] >= first[:, None]) & (distance - (block_size - 1) <= window_t)
    every = (kv < q) & (first[None, :] == last[:, None]) & (distance + (block_size - 1) <= window_t)
    return BlockMask.from_kv_blocks(*_ordered_blocks(some & ~every), *_ordered_blocks(every), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def build_masks(tokens: Tensor, windows: list[int | None], use_flex: bool, block_size: int) -> list:
    """One mask per layer (None for layers without attention); layers with the same window share one."""
    docs = document_ids(tokens)
    by_window = {}
    for w in windows:
        if w is not None and w not in by_window:
            by_window[w] = flex_block_mask(docs, w, block_size) if use_flex else dense_attention_mask(docs, w)
    return [by_window.get(w) for w in windows]


def attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """q (already scaled), k, v: (B, H, T, D); mask: a BlockMask (FlexAttention) or a boolean tensor (SDPA)."""
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=mask, scale=1.0)


class LayerCache:
    """Keys and values of the positions seen so far by one attention layer (generation in sample.py)."""

    def __init__(self, max_len: int, heads: int, head_dim: int, device, dtype):
        self.k = torch.zeros(1, max_len, heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.size(1)
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int, has_value_embed: bool):
        super().__init__()
        self.num_heads, self.head_dim = dim // head_dim, head_dim
        # q, k, v and output projections as one (4, dim, dim) tensor: q, k, v multiply in one matmul,
        # and NorMuon orthogonalises each of the four on its own.
        self.qkvo = nn.Parameter(torch.empty(4, dim, dim))
        uniform_init_(self.qkvo[:3], 0.5 * dim ** -0.5)
        with torch.no_grad():
            self.qkvo[3].zero_()
        self.gate = CastedLinear(GATE_CHANNELS, self.num_heads)  # per-head output gate, sigmoid(0) = 0.5 at init
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5] if has_value_embed else [0.5]))  # (v, value embed)
        self.attend = attention  # compile_model(attention_only=True) puts a compiled attention here

    def forward(self, x: Tensor, value_embed: Tensor | None, mask, cos: Tensor, sin: Tensor, scale: Tensor,
                cache: LayerCache | None = None) -> Tensor:
        B, T, dim = x.shape
        qkv = F.linear(x, self.qkvo[:3].flatten(0, 1).type_as(x)).view(B, T, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        q, k = apply_rotary(norm(q), cos, sin), apply_rotary(norm(k), cos, sin)  # QK-norm bounds the logits
        v = self.value_mix[0] * v
        if value_embed is not None:
            v = v + self.value_mix[1] * value_embed.view_as(v)
        if cache is not None:
            k, v = cache.extend(k, v)
        y = self.attend((q * scale).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)
        y = y * torch.sigmoid(self.gate(x[..., :GATE_CHANNELS])).unsqueeze(-1)  # a head can switch itself off
        return F.linear(y.reshape(B, T, dim), self.qkvo[3].type_as(y))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.fc = CastedLinear(dim, ratio * dim, std=0.5 * dim ** -0.5)
        self.proj = CastedLinear(ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())  # ReLU^2 (Primer)


@dataclass(frozen=True)
class LayerSpec:
    attention: bool
    mlp: bool
    long_window: bool
    value_embed: int | None  # which value embedding feeds this layer's attention


def layer_specs(args: Hyperparameters) -> list[LayerSpec]:
    no_attention, no_mlp = set(int_list(args, "no_attention_layers")), set(int_list(args, "no_mlp_layers"))
    long_layers, k, n = set(int_list(args, "long_window_layers")), args.num_value_embeds, args.num_layers
    specs = []
    for i in range(n):
        embed = i if i < k else (i - (n - k) if i >= n - k else None)
        has_attention = i not in no_attention
        specs.append(LayerSpec(has_attention, i not in no_mlp, i in long_layers, embed if has_attention else None))
    return specs


class Block(nn.Module):
    def __init__(self, spec: LayerSpec, dim: int, head_dim: int, mlp_ratio: int):
        super().__init__()
        self.attn = CausalSelfAttention(dim, head_dim, spec.value_embed is not None) if spec.attention else None
        self.mlp = MLP(dim, mlp_ratio) if spec.mlp else None
        # weights of (x, x0: the embedding); a layer with neither part is skipped and has none
        self.residual_mix = nn.Parameter(torch.tensor([1.0, 0.0])) if self.active else None

    @property
    def active(self) -> bool:
        return self.attn is not None or self.mlp is not None

    def forward(self, x: Tensor, x0: Tensor, value_embed: Tensor | None, mask, cos: Tensor, sin: Tensor,
                scale: Tensor, cache: LayerCache | None = None) -> Tensor:
        x = self.residual_mix[0] * x + self.residual_mix[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), value_embed, mask, cos, sin, scale, cache)
        if self.mlp is not None:
            x = x + self.mlp(norm(x))
        return x


class LossHead(nn.Module):
    """lm_head, squashed logits and cross-entropy: one compiled graph on CUDA, so the large
    (tokens x vocab) logits are produced and consumed in fused kernels."""

    def __init__(self, dim: int, vocab: int, cap: float, cap_width: float, precision: str):
        super().__init__()
        self.lm_head = CastedLinear(dim, vocab)  # untied from the embedding
        self.cap, self.cap_width, self.precision = cap, cap_width, precision
        self.x_scale = dim ** 0.5 / FP8_E4M3_MAX  # an rms-normed vector has no entry above sqrt(dim)

    def logits(self, x: Tensor) -> Tensor:
        x = norm(x)
        w = self.lm_head.weight
        if self.precision == "fp8" and self.training:
            logits = FP8Linear.apply(x.flatten(0, -2), w, self.x_scale).view(*x.shape[:-1], -1)
        elif self.precision in ("fp8", "bf16"):
            logits = F.linear(x.bfloat16(), w.bfloat16())
        else:  # fp32 whatever the stream's dtype (bf16 on GPUs)
            logits = F.linear(x.float(), w.float())
        return self.cap * torch.sigmoid(logits / self.cap_width)

    def forward(self, x: Tensor, target_ids: Tensor, reduction: str) -> Tensor:
        logits = self.logits(x)
        if not self.training:  # validation in fp32; training sums the cross-entropy in the logits' dtype
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target_ids.reshape(-1), reduction=reduction)


def padded_vocab(vocab_size: int) -> int:
    return 128 * math.ceil(vocab_size / 128)  # tensor-core friendly; the extra logits learn to stay low


# The model's position limits, derived from the config here and nowhere else: the rotary tables,
# sample.py's generation and its packing of HellaSwag sequences all ask these.
def max_positions(args: Hyperparameters) -> int:
    """The longest sequence one forward pass can take: the rotary tables cover a training micro-batch
    and a validation sequence, whichever is longer."""
    return max(args.micro_batch_tokens, args.val_seq_len)


def context_length(args: Hyperparameters) -> int:
    """The longest document the model can read: what training let a document contribute
    (train_max_seq_len), within max_positions."""
    return min(args.train_max_seq_len, max_positions(args))


class GPT(nn.Module):
    def __init__(self, args: Hyperparameters, head_precision: str = "fp32"):
        super().__init__()
        vocab, dim = padded_vocab(args.vocab_size), args.model_dim
        specs = layer_specs(args)
        self.embed = nn.Embedding(vocab, dim)
        self.smear_gate = CastedLinear(GATE_CHANNELS, 1)
        # 0-dim scalars: a 1-element vector would promote the bf16 stream to fp32 when multiplied into it
        self.smear_scale = nn.Parameter(torch.zeros(()))  # the smear starts switched off
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(args.num_value_embeds))
        self.value_embed_of = [spec.value_embed for spec in specs]
        self.blocks = nn.ModuleList(Block(spec, dim, args.head_dim, args.mlp_ratio) for spec in specs)
        # U-net: the active layers of the first half push their outputs; as many active layers of the
        # second half each add one back (last in, first out), weighted by sigmoid(gate).
        half = args.num_layers // 2
        active = [i for i, block in enumerate(self.blocks) if block.active]
        self.skip_from = [i for i in active if i < half]
        self.skip_to = [i for i in active if i >= half][:len(self.skip_from)]
        self.skip_gates = nn.Parameter(torch.full((len(self.skip_to),), SKIP_GATE_INIT))
        # Backout: the output of an inner layer helps later layers read the context but not the
        # prediction itself; a learned share of it is taken out of the final stream.
        self.backout_layer = args.backout_layer
        self.backout_scale = nn.Parameter(torch.tensor(BACKOUT_INIT)) if args.backout_layer >= 0 else None
        schedule = int_list(args, "window_schedule")
        self.rotary = Rotary(args.head_dim, max_positions(args), args.window_block, schedule[0])
        self.head = LossHead(dim, vocab, args.logit_cap, args.logit_cap_width, head_precision)
        # Validation computes the logits of this many tokens at a time: equal chunks, at most a micro-batch.
        self.eval_chunk = math.gcd(args.micro_batch_tokens, args.val_seq_len)

    def smear(self, x: Tensor, previous: Tensor | None = None, keep: Tensor | None = None) -> Tensor:
        """Adds to each token's embedding a gated share of the previous token's (x: (T, dim)). Like record
        #44, training smears across document boundaries; `keep` (T,) booleans, False at a document's
        first token, stops that, so that packed sequences score exactly as if run one by one."""
        before = x[:-1] if previous is None else torch.cat([previous, x[:-1]])
        after = x[1:] if previous is None else x
        gate = self.smear_scale * torch.sigmoid(self.smear_gate(after[:, :GATE_CHANNELS]))
        if keep is not None:
            gate = gate * (keep if previous is not None else keep[1:])[:, None]
        smeared = after + gate * before
        return smeared if previous is not None else torch.cat([x[:1], smeared])

    def hidden(self, input_ids: Tensor, masks: list, caches: list | None = None,
               separate_documents: bool = False) -> Tensor:
        """input_ids: (T,) one packed sequence; masks: one per layer. Returns the final stream (1, T, dim).
        With caches (generation), input_ids continue the cached positions. separate_documents: see smear."""
        start = next((c.length for c in caches or [] if c is not None), 0)
        if start + len(input_ids) > self.rotary.cos.size(0):
            raise ValueError(f"positions {start}..{start + len(input_ids) - 1}: the model takes at most "
                             f"{self.rotary.cos.size(0)} (max_positions)")
        embedded = self.embed(input_ids)
        previous = getattr(caches, "last_embedding", None) if start else None
        keep = input_ids != BOS_ID if separate_documents else None
        x0 = norm(self.smear(embedded, previous, keep))[None]
        x = x0.clone()  # the first block gets x and x0 as two tensors, not one: no aliasing-specific graph
        if caches is not None:
            caches.last_embedding = embedded[-1:]
        value_embeds = [ve(input_ids)[None] for ve in self.value_embeds]
        cos, sin = self.rotary.cos[start:start + len(input_ids)], self.rotary.sin[start:start + len(input_ids)]
        skips, backout = [], None
        for i, block in enumerate(self.blocks):
            if not block.active:
                continue
            if i in self.skip_to:
                x = x + torch.sigmoid(self.skip_gates[self.skip_to.index(i)]) * skips.pop()
            embed = self.value_embed_of[i]
            x = block(x, x0, None if embed is None else value_embeds[embed], masks[i], cos, sin,
                      self.rotary.attn_scale, caches[i] if caches is not None else None)
            if i in self.skip_from:
                skips.append(x)
            if i == self.backout_layer:
                backout = x
        if backout is not None:
            x = x - self.backout_scale * backout
        return x

    def forward(self, input_ids: Tensor, target_ids: Tensor, masks: list, reduction: str = "sum",
                separate_documents: bool = False) -> Tensor:
        """Summed (or, with reduction="none", per-token) cross-entropy of one packed sequence."""
        x, target_ids = self.hidden(input_ids, masks, separate_documents=separate_documents), target_ids[None]
        if self.training:
            return self.head(x, target_ids, reduction)
        # Validation sequences are long (262,144 tokens): one chunk's logits at a time fit in memory.
        parts = [self.head(xs, ts, reduction) for xs, ts in zip(x.split(self.eval_chunk, dim=1),
                                                                   target_ids.split(self.eval_chunk, dim=1))]
        return torch.stack(parts).sum() if reduction == "sum" else torch.cat(parts)


class KVCache(list):
    """One LayerCache per layer (None where a layer has no attention), plus the last token's
    embedding for the smear gate: everything generation needs to continue a sequence."""

    def __init__(self, model: GPT, max_len: int):
        p = model.embed.weight
        super().__init__(LayerCache(max_len, b.attn.num_heads, b.attn.head_dim, p.device, p.dtype)
                         if b.attn is not None else None for b in model.blocks)
        self.last_embedding = None


def compile_model(model: GPT, backend="inductor", attention_only: bool = False):
    """Compile each block's and the loss head's forward on their own, not the whole model. Backward
    then runs graph by graph, so the gradient hooks of the lm_head and of each block fire as soon as
    that part is done and DistAdam's reduce-scatters overlap the rest of backward; a whole-model graph
    would hold every gradient back until the very end.

    Windows, documents, rotary tables and the attention scale reach the graphs as tensors, so each
    block compiles once per sequence length (training, validation). Dynamo keeps compiled graphs per
    code object: the blocks share Block.forward's, and blocks of the same structure share graphs; the
    speedrun's three structures (attention with and without value embeddings, MLP only) make 6
    graphs there, under dynamo's limit of 8, and the head has LossHead.forward's 2.

    attention_only (--compile=false with FlexAttention) compiles the attention call alone: FlexAttention
    run uncompiled materialises the whole score matrix, 24 GiB for one 32,768-token micro-batch and
    about 1.5 TiB for a 262,144-token validation sequence."""
    if attention_only:
        compiled = torch.compile(attention, backend=backend, dynamic=False, fullgraph=True)
        for block in model.blocks:
            if block.attn is not None:
                block.attn.attend = compiled
        return
    for module in [block for block in model.blocks if block.active] + [model.head]:
        module.forward = torch.compile(module.forward, backend=backend, dynamic=False, fullgraph=True)


# -----------------------------------------------------------------------------
# NorMuon: momentum, Polar Express orthogonalisation, per-neuron normalisation and cautious weight
# decay, for the hidden matrices and the gates

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one odd quintic
# a*x + b*x^3 + c*x^5 per iteration, each chosen for the range the singular values can be in after
# the previous ones. These are record #44's (5 iterations, safety factor 2e-2, cushion 2).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 2e-2  # the Frobenius normalisation is divided by 1 + this, so no singular value exceeds 1


def polar_express(g: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately U V^T of g = U S V^T for each matrix of g (..., rows, cols); bf16 on GPUs."""
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * (1 + POLAR_EXPRESS_SAFETY) + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def neuron_dim(shape) -> int:
    """The axis NorMuon averages over: per row (output neuron) for tall matrices, per column otherwise
    (as record #44: MLP hidden neurons on both MLP matrices, input channels on the square attention ones)."""
    return -1 if shape[-2] > shape[-1] else -2


def normalize_neurons(v: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon (arXiv:2510.05491): divide each neuron's slice of the orthogonalised update by the root
    of its running mean square, then restore the update's overall norm."""
    norm_before = v.norm(dim=(-2, -1), keepdim=True)
    second_moment.lerp_(v.square().mean(dim=neuron_dim(v.shape), keepdim=True), 1 - beta2)
    v = v * second_moment.clamp_min(1e-10).rsqrt()
    return v * (norm_before / v.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


class NorMuon(torch.optim.Optimizer):
    """NorMuon with Polar Express and cautious weight decay, for parameters of 2 or more dims (a 3-D
    parameter is a stack of matrices, each orthogonalised on its own).

    Per matrix: Nesterov momentum, orthogonalisation, per-neuron normalisation, then
        p <- p - lr * s * (v + lr * wd * [v * p >= 0] * p),   s = sqrt(max(1, rows / cols)),
    so the decay only shrinks weights the update already pulls toward zero, and scales with lr^2.

    Distributed: parameters are dealt out round-robin in chunks of world_size same-shape matrices.
    One reduce-scatter per chunk hands each rank the mean gradient of the matrix it owns; it keeps that
    matrix's state, computes its update, and an all-gather shares the result. At world size 1 there is
    no communication. The state is fp32 whatever the parameter's dtype.
    """

    def __init__(self, params, lr: float = 0.03, momentum: float = 0.95, beta2: float = 0.95,
                 weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"NorMuon takes matrices; got a parameter of shape {tuple(p.shape)}")

    def _chunks(self, world_size: int):
        """(group, params) chunks of at most world_size same-shape matrices, in the same order on every rank."""
        for group in self.param_groups:
            by_shape: dict[tuple, list] = {}
            for p in group["params"]:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for params in by_shape.values():
                for i in range(0, len(params), world_size):
                    yield group, params[i:i + world_size]

    def _update(self, p: Tensor, grad: Tensor, group: dict):
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(grad, dtype=torch.float32)
            moment_shape = list(p.shape)
            moment_shape[neuron_dim(p.shape)] = 1
            state["second_moment"] = torch.zeros(moment_shape, dtype=torch.float32, device=p.device)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"])  # Nesterov
        v = polar_express(update, self.ns_dtype).float()
        v = normalize_neurons(v, state["second_moment"], group["beta2"])
        lr, rows, cols = group["lr"], p.size(-2), p.size(-1)
        if group["weight_decay"]:
            cautious = (v * p) >= 0
            v = v + (lr * group["weight_decay"]) * cautious * p.float()
        p.add_(v, alpha=-lr * max(1.0, rows / cols) ** 0.5)

    @torch.no_grad()
    def step(self):
        if not distributed():
            for group, params in self._chunks(1):
                for p in params:
                    if p.grad is not None:
                        self._update(p, p.grad.float(), group)
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        pending = []
        for group, params in self._chunks(world_size):  # launch every reduce-scatter, then compute while they fly
            ref = params[0]
            stacked = torch.zeros((world_size, *ref.shape), dtype=torch.float32, device=ref.device)
            for i, p in enumerate(params):
                if p.grad is not None:
                    stacked[i].copy_(p.grad)
            mine = torch.empty(ref.shape, dtype=torch.float32, device=ref.device)
            pending.append((group, params, mine, reduce_scatter_async(mine.view(-1), stacked.view(-1))))
        gathers = []
        for group, params, mine, work in pending:
            work.wait()
            ref = params[0]
            gathered = torch.empty((world_size, *ref.shape), dtype=ref.dtype, device=ref.device)
            if rank < len(params):
                owned = params[rank]
                self._update(owned, mine.div_(world_size), group)
                local = owned.detach()
            else:  # this rank owns nothing in a short chunk but still takes part in the gather
                local = torch.zeros_like(ref)
            gathers.append((params, gathered, all_gather_async(gathered.view(-1), local.reshape(-1))))
        for params, gathered, work in gathers:
            work.wait()
            for i, p in enumerate(params):
                p.copy_(gathered[i])

    # torch.optim.Optimizer.load_state_dict would cast the fp32 state to each parameter's dtype (bf16
    # for the gates on CUDA): save and restore it as it is, one entry per parameter in order.
    def state_dict(self) -> dict:
        params = [p for group in self.param_groups for p in group["params"]]
        return {"state": [dict(self.state.get(p, {})) for p in params], "param_groups": group_settings(self)}

    def load_state_dict(self, state_dict: dict):
        params = [p for group in self.param_groups for p in group["params"]]
        if len(state_dict["state"]) != len(params):
            raise ValueError(f"NorMuon state holds {len(state_dict['state'])} parameters; this one has {len(params)}")
        restore_group_settings(self, state_dict["param_groups"])
        self.state.clear()
        for p, saved in zip(params, state_dict["state"]):
            if saved:
                self.state[p] = {k: v.to(p.device, copy=True) for k, v in saved.items()}


def group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def restore_group_settings(opt: torch.optim.Optimizer, saved: list[dict]):
    for group, settings in zip(opt.param_groups, saved):
        group.update(settings)


# -----------------------------------------------------------------------------
# DistAdam: ZeRO-style sharded Adam whose reduce-scatters start during backward

class _Bucket:
    """Parameters reduced and gathered together: one large parameter, or all small ones of a group.

    The flat, padded layout lets every rank own an equal 1/world_size shard whatever the shapes.
    """

    def __init__(self, params: list[Tensor], group_index: int, world_size: int):
        self.params, self.group_index = params, group_index
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = math.ceil(self.numel / world_size)
        self.padded_numel = self.shard_numel * world_size
        self.ready = 0  # how many of the params have their gradient for this step
        self.work = None  # the in-flight reduce-scatter
        self.grad_shard: Tensor | None = None

    def _in_place(self) -> bool:  # one parameter that splits evenly: no copies needed
        return len(self.params) == 1 and self.numel == self.padded_numel and self.params[0].is_contiguous()

    def flat_grad(self) -> Tensor:
        p0 = self.params[0]
        if self._in_place() and p0.grad is not None:
            return p0.grad.reshape(-1)
        flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        return flat

    def flat_param(self) -> Tensor:
        if self._in_place():
            return self.params[0].data.view(-1)
        flat = torch.zeros(self.padded_numel, dtype=self.params[0].dtype, device=self.params[0].device)
        torch.cat([p.data.view(-1) for p in self.params], out=flat[:self.numel])
        return flat

    def write_back(self, flat: Tensor):
        if self._in_place():
            return
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class DistAdam(torch.optim.Optimizer):
    """Adam with state sharded over ranks (ZeRO-1 style) and communication overlapped with backward.

    A post-accumulate-grad hook on every parameter starts an async reduce-scatter of its gradient
    as soon as backward has produced it (parameters below `small_numel` elements are coalesced per
    group, and reduced when the last of them is ready). step() walks the buckets in reverse order,
    the order backward finishes them, waits for each gradient shard, updates this rank's shard of
    the parameter with its shard of the Adam state, and starts an all-gather of it; every gather
    completes before step() returns. Inside `no_sync()` backward only accumulates gradients
    locally, so the micro-batches of several steps cost one reduce-scatter per bucket. At world
    size 1 there are no hooks and no collectives. The update is record #44's,
    lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps), not torch.optim.Adam's
    lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps): the two differ while sqrt(v) is near eps,
    in the first steps on small gradients. Weight decay is decoupled (AdamW).

    A bucket whose gradient never completed during backward (a parameter without a gradient) is
    reduced from step() instead, and counted in `late_reductions`: that costs the overlap.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, small_numel: int = 4096):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.world_size = dist.get_world_size() if distributed() else 1
        self.rank = dist.get_rank() if distributed() else 0
        self._sync = True
        self.late_reductions = 0
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[Tensor, _Bucket] = {}
        for index, group in enumerate(self.param_groups):
            small = [p for p in group["params"] if p.numel() < small_numel]
            for p in group["params"]:
                if p.numel() >= small_numel:
                    self.buckets.append(_Bucket([p], index, self.world_size))
            if small:
                self.buckets.append(_Bucket(small, index, self.world_size))
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
        self._hooks = []
        if self.world_size > 1:
            for bucket in self.buckets:
                for p in bucket.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally; the next backward outside reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, p: Tensor):
        if not self._sync:
            return
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_reduce_scatter(bucket)

    def _launch_reduce_scatter(self, bucket: _Bucket):
        flat = bucket.flat_grad()
        bucket.grad_shard = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        bucket.work = reduce_scatter_async(bucket.grad_shard, flat)

    def _adam(self, bucket: _Bucket, param_shard: Tensor, grad_shard: Tensor):
        group = self.param_groups[bucket.group_index]
        state = self.state[bucket.params[0]]  # a bucket's state lives under its first parameter
        if not state:
            state["step"] = 0  # a Python int: reading it needs no device sync
            state["exp_avg"] = torch.zeros_like(param_shard, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param_shard, dtype=torch.float32)
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        grad = grad_shard.float()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # Record #44's placement of eps and the bias corrections: eps is added to the uncorrected sqrt(v),
        # so early steps on tiny gradients are damped more than torch.optim.Adam would damp them.
        update = state["exp_avg"] / state["exp_avg_sq"].sqrt().add_(group["eps"])
        if group["weight_decay"]:
            param_shard.mul_(1 - group["lr"] * group["weight_decay"])
        step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        param_shard.add_(update.to(param_shard.dtype), alpha=-step_size)

    @torch.no_grad()
    def step(self):
        gathers = []
        for bucket in reversed(self.buckets):
            flat_param = bucket.flat_param()
            lo = self.rank * bucket.shard_numel
            param_shard = flat_param[lo:lo + bucket.shard_numel]
            if self.world_size == 1:
                grad_shard = bucket.flat_grad()
            else:
                if bucket.work is None:  # some gradient never arrived during backward: reduce what there is
                    self.late_reductions += 1
                    self._launch_reduce_scatter(bucket)
                bucket.work.wait()  # gloo has no futures for reduce-scatter: wait on the handle
                grad_shard = bucket.grad_shard.div_(self.world_size)
            self._adam(bucket, param_shard, grad_shard)
            if self.world_size > 1:
                gathers.append((bucket, flat_param, all_gather_async(flat_param, param_shard)))
            else:
                bucket.write_back(flat_param)
            bucket.work, bucket.grad_shard, bucket.ready = None, None, 0
        for bucket, flat_param, work in gathers:
            work.wait()
            bucket.write_back(flat_param)

    # The state is this rank's shards, kept in fp32 (torch.optim.Optimizer.load_state_dict would cast
    # it to the parameters' dtype, bf16 on CUDA). Checkpoints hold one such dict per rank.
    def state_dict(self) -> dict:
        return {"world_size": self.world_size,
                "buckets": [dict(self.state.get(b.params[0], {})) for b in self.buckets],
                "param_groups": group_settings(self)}

    def load_state_dict(self, state_dict: dict):
        if state_dict["world_size"] != self.world_size or len(state_dict["buckets"]) != len(self.buckets):
            raise ValueError(f"DistAdam state was saved at world size {state_dict['world_size']} with "
                             f"{len(state_dict['buckets'])} buckets; this one has {self.world_size} and {len(self.buckets)}")
        restore_group_settings(self, state_dict["param_groups"])
        self.state.clear()
        for bucket, saved in zip(self.buckets, state_dict["buckets"]):
            if saved:
                device = bucket.params[0].device
                self.state[bucket.params[0]] = {k: v.to(device, copy=True) if isinstance(v, Tensor) else v
                                                for k, v in saved.items()}


# -----------------------------------------------------------------------------
# Data: token shards, BOS-aligned packing and the distributed loader

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
FETCH_HINT = "fetch FineWeb with `python data/cached_fineweb10B.py`"
REPO_DIR = Path(__file__).resolve().parent  # where the bundled corpus and the data tools are
BUNDLED_CORPUS = REPO_DIR / "data" / "shakespeare"


def read_shard_header(path) -> int:
    """Checks a shard's header against its size; returns its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(SHARD_HEADER_INTS * 4)
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror})") from None
    if len(raw) < SHARD_HEADER_INTS * 4:
        raise DataError(f"{path}: {'empty' if size == 0 else 'truncated'} shard ({size} bytes, "
                        f"the header alone is {SHARD_HEADER_INTS * 4})")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = SHARD_HEADER_INTS * 4 + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise DataError(f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file has {size} bytes"
                        f"{' (truncated?)' if size < expected else ''}")
    return num_tokens


def read_shard(path) -> np.ndarray:
    """All tokens of a shard as uint16, after the header checks."""
    num_tokens = read_shard_header(path)
    return np.fromfile(path, dtype="<u2", count=num_tokens, offset=SHARD_HEADER_INTS * 4).astype(np.uint16, copy=False)


def match_shards(pattern: str) -> tuple[list[Path], bool]:
    """The files a glob matches, sorted, and whether they were found under the repository: a relative glob
    that matches nothing under the working directory is looked up under train_gpt.py's folder, as sample.py
    finds its files, so that the smoke preset's data/shakespeare/... runs from any directory."""
    files = sorted(Path(p) for p in glob.glob(pattern))
    if files or Path(pattern).is_absolute():
        return files, False
    files = sorted(Path(p) for p in glob.glob(str(REPO_DIR / pattern)))
    return files, bool(files)


def find_shards(pattern: str, what: str) -> list[Path]:
    files, _ = match_shards(pattern)
    if not files:
        cwd = Path.cwd().resolve()
        where = "" if Path(pattern).is_absolute() else (
            f" (looked under the working directory {cwd})" if cwd == REPO_DIR else
            f" (looked under the working directory {cwd} and under {REPO_DIR})")
        hint = FETCH_HINT + ("" if cwd == REPO_DIR else f" in {REPO_DIR}")
        bundled = [sorted(BUNDLED_CORPUS.glob(f"shakespeare_{part}_*.bin")) for part in ("train", "val")]
        if all(bundled):  # never suggest rebuilding a corpus that is there
            hint += f"; the smoke preset (--preset=smoke) trains on the bundled corpus in {BUNDLED_CORPUS}"
        else:
            hint += (", or rebuild the bundled corpus with `python data/tokenize_text.py --preset shakespeare "
                     "--overwrite`")
        raise DataError(f"no {what} shards match {pattern!r}{where}: {hint}")
    return files


class DocumentPieces:
    """A token stream's training pieces: each document (from its BOS to the next) contributes its
    first max_len tokens; the rest of a longer document is not trained on (record #44). `starts`, the
    BOS positions, can be passed in when a scan has found them already."""

    def __init__(self, tokens: np.ndarray, max_len: int, starts: np.ndarray | None = None):
        self.tokens = tokens
        self.starts = np.flatnonzero(tokens == BOS_ID) if starts is None else starts
        ends = np.append(self.starts[1:], len(tokens))
        self.lengths = np.minimum(ends - self.starts, max_len)
        self.cumulative = np.cumsum(self.lengths)

    def _last_piece(self, first: int, num_tokens: int) -> int | None:
        """The piece in which num_tokens tokens, counted from the start of piece `first`, end; None
        when the stream has too few pieces left."""
        before = int(self.cumulative[first - 1]) if first else 0
        last = int(np.searchsorted(self.cumulative, before + num_tokens))
        return last if last < len(self.cumulative) else None

    def take(self, first: int, num_tokens: int) -> tuple[np.ndarray, int] | None:
        """Exactly num_tokens tokens: pieces first, first + 1, ..., the last one cut short, and the
        index of the piece after them; None when the stream has too few pieces left."""
        last = self._last_piece(first, num_tokens)
        if last is None:
            return None
        before = int(self.cumulative[first - 1]) if first else 0
        lengths = self.lengths[first:last + 1].copy()
        lengths[-1] -= int(self.cumulative[last]) - before - num_tokens
        chunk = np.concatenate([self.tokens[s:s + n] for s, n in zip(self.starts[first:last + 1], lengths)])
        return chunk, last + 1

    def take_step(self, first: int, num_micro: int, micro_tokens: int) -> tuple[list[np.ndarray], int] | None:
        """One step: num_micro micro-batches of micro_tokens + 1 tokens (inputs and shifted targets),
        each starting with a BOS; the same whatever the world size."""
        micro_batches = []
        for _ in range(num_micro):
            taken = self.take(first, micro_tokens + 1)
            if taken is None:
                return None
            chunk, first = taken
            micro_batches.append(chunk)
        return micro_batches, first

    def count_steps(self, num_micro: int, micro_tokens: int) -> int:
        """How many steps take_step gives, from the first piece until it returns None: the same walk
        over the pieces, without copying tokens."""
        steps, first = 0, 0
        while True:
            for _ in range(num_micro):
                last = self._last_piece(first, micro_tokens + 1)
                if last is None:
                    return steps
                first = last + 1
            steps += 1


def rank_micro_batches(micro_batches: list[np.ndarray], env: DistEnv) -> list[tuple[Tensor, Tensor]]:
    """This rank's (inputs, targets): micro-batch m goes to rank m % world_size."""
    batch = []
    for chunk in micro_batches[env.rank::env.world_size]:
        buf = to_device(torch.from_numpy(chunk), env.device)
        batch.append((buf[:-1], buf[1:]))
    return batch


def to_device(tokens: Tensor, device: torch.device) -> Tensor:
    """uint16 host tokens to int64 on the device; pinned memory lets the copy overlap compute."""
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True).long()
    return tokens.long()


def check_token_ids(tokens: np.ndarray, path, vocab_size: int):
    """Every id must index the embedding: past the vocabulary, a CPU run raises deep inside the model
    and a GPU run dies of a device-side assert."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {tokens[position]} at position {position} is outside the vocabulary "
                        f"(--vocab_size={vocab_size})")


@dataclass
class ShardScan:
    """What one pass over a training shard found before training starts."""
    path: Path
    num_tokens: int
    starts: np.ndarray  # BOS positions: the loader reuses them when it opens the shard
    steps: int  # steps the loader takes from it (DocumentPieces.count_steps)


SCAN_THREADS = 4  # shards scanned at once; numpy releases the GIL while it reads and compares
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_TOKENS = 16, 4096


def shard_fingerprint(scan: ShardScan) -> str:
    """sha256 of what tells a scanned shard from another cheaply: its token count, 16 evenly spaced blocks
    of 4,096 tokens (the first and the last included; 128 KiB read) and every document's start (found by
    the scan). Another shard, or this text tokenized or shuffled differently, changes it; one token edited
    between the blocks, inside a document, would not."""
    h = hashlib.sha256(np.int64(scan.num_tokens).tobytes())
    last = max(scan.num_tokens - FINGERPRINT_BLOCK_TOKENS, 0)
    try:
        with open(scan.path, "rb") as f:
            for offset in np.linspace(0, last, FINGERPRINT_BLOCKS).astype(np.int64):
                f.seek(SHARD_HEADER_INTS * 4 + 2 * int(offset))
                h.update(f.read(2 * FINGERPRINT_BLOCK_TOKENS))
    except OSError as e:
        raise DataError(f"{scan.path}: cannot read shard ({e.strerror})") from None
    h.update(scan.starts.astype("<i8").tobytes())
    return h.hexdigest()


def scan_shard(path: Path, args: Hyperparameters) -> ShardScan:
    """One pass over a training shard: its token ids, its BOS positions, the steps it supplies."""
    tokens = read_shard(path)
    check_token_ids(tokens, path, args.vocab_size)
    starts = np.flatnonzero(tokens == BOS_ID)
    if not len(starts):
        raise DataError(f"{path}: no document starts in it (no <|endoftext|>, id {BOS_ID}, the token every "
                        f"training piece starts with); tokenize text with `python data/tokenize_text.py`")
    num_micro, micro_tokens = args.batch_tokens // args.micro_batch_tokens, args.micro_batch_tokens
    steps = DocumentPieces(tokens, args.train_max_seq_len, starts).count_steps(num_micro, micro_tokens)
    if not steps:
        raise DataError(f"{path}: its documents cannot fill one step of {num_micro} x {micro_tokens + 1} tokens: "
                        f"a document gives its first {args.train_max_seq_len} tokens at most (--train_max_seq_len) "
                        f"and a micro-batch skips the rest of the one it ends in; split long documents "
                        f"(`python data/tokenize_text.py` does, see --max-doc-tokens) or add text")
    return ShardScan(path, len(tokens), starts, steps)


def scan_training_shards(files: list[Path], args: Hyperparameters) -> list[ShardScan]:
    """Scans shards in order, a few at a time, until they supply args.num_iterations steps (all of
    them when they cannot): a long list of shards costs only the ones the run will read."""
    scans: list[ShardScan] = []
    running: collections.deque[concurrent.futures.Future] = collections.deque()
    queued, supplied = 0, 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(SCAN_THREADS, len(files))) as pool:
        try:
            while supplied < args.num_iterations:
                # Once a shard is counted, queue no further than the shards that the steps so far say the run needs.
                wanted = math.ceil(args.num_iterations * len(scans) / supplied) if supplied else len(files)
                while queued < min(wanted, len(files)) and len(running) < SCAN_THREADS:
                    running.append(pool.submit(scan_shard, files[queued], args))
                    queued += 1
                if not running:
                    break
                scans.append(running.popleft().result())
                supplied += scans[-1].steps
        finally:  # enough steps, or a bad shard: scans not yet started are dropped
            for future in running:
                future.cancel()
    return scans


class TrainLoader:
    """Walks the training shards: each step takes the next pieces of the current shard (see
    DocumentPieces), packed into micro-batches whatever the world size. A step never straddles two
    shards: when a shard cannot fill one, the next shard starts the step. The shards are scanned first
    (scan_training_shards), so the run knows how many steps they supply: fewer than it needs is
    refused unless --repeat_data, which starts over from the first shard. The next shard is read in a
    background thread while this one is used."""

    def __init__(self, args: Hyperparameters, env: DistEnv):
        files = find_shards(args.train_files, "training")
        self.num_micro, self.micro_tokens = args.batch_tokens // args.micro_batch_tokens, args.micro_batch_tokens
        for f in files:
            if read_shard_header(f) < self.num_micro * (self.micro_tokens + 1):
                raise DataError(f"{f}: holds fewer tokens than one step needs ({self.num_micro * (self.micro_tokens + 1)})")
        self.scans = scan_training_shards(files, args)
        self.supplied, self.needed = sum(scan.steps for scan in self.scans), args.num_iterations
        self.unread = len(files) - len(self.scans)
        val_files, val_under_repo = match_shards(args.val_files)
        validation = {f.resolve() for f in val_files}
        for f in files:  # resolved: the same file named by two globs, or through a link, is one file
            if f.resolve() in validation:
                raise DataError(f"{f}: both a training shard (--train_files={args.train_files}) and a validation "
                                f"shard (--val_files={args.val_files}); the val loss must come from text the run "
                                f"does not train on")
        self.fingerprints = [shard_fingerprint(scan) for scan in self.scans]  # what a checkpoint records
        found = [f"--{name}={pattern}" for name, pattern, under_repo in (
            ("train_files", args.train_files, match_shards(args.train_files)[1]),
            ("val_files", args.val_files, val_under_repo)) if under_repo]
        self.located = ([f"data: {' and '.join(found)} matched nothing under the working directory; read "
                         f"relative to {REPO_DIR}"] if found else [])  # train() logs it, after report()
        if self.supplied < self.needed and not args.repeat_data:
            per_shard = self.supplied / len(self.scans)
            enough = math.ceil(self.needed / per_shard)
            raise DataError(f"--train_files={args.train_files}: its {len(files)} shard(s) supply {self.supplied:,} "
                            f"steps ({per_shard:,.0f} per shard) but the run needs {self.needed:,}: about {enough} "
                            f"shards like these would (FineWeb: `python data/cached_fineweb10B.py {enough + 1}`, one "
                            f"spare), or --repeat_data=true starts over from the first shard")
        self.max_len, self.env = args.train_max_seq_len, env
        self.file_index, self.piece = 0, 0
        self.pieces: DocumentPieces | None = None
        self.started_over = False  # whether the last batch was the first of another pass over the shards
        self._prefetch = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._next: tuple[int, concurrent.futures.Future] | None = None

    def report(self) -> list[str]:
        """The log's account of the data: one line, and notes where the run repeats or skips much."""
        step_tokens = self.num_micro * (self.micro_tokens + 1)
        tokens = sum(scan.num_tokens for scan in self.scans)
        lines = [f"data: {len(self.scans)} training shard(s) supply {self.supplied:,} steps, the run needs "
                 f"{self.needed:,}; the steps use {self.supplied * step_tokens / tokens:.1%} of their "
                 f"{tokens:,} tokens" + (f" ({self.unread} more shard(s) are not needed)" if self.unread else "")]
        if self.supplied < self.needed:
            lines.append(f"data: --repeat_data=true: after {self.supplied:,} steps the data starts over from the "
                         f"first shard (logged each time)")
        sparse = [scan for scan in self.scans if scan.steps * step_tokens < scan.num_tokens / 2]
        if sparse:
            worst = min(sparse, key=lambda scan: scan.steps / scan.num_tokens)
            # Pieces of a quarter micro-batch lose about an eighth of it where a micro-batch ends.
            shorter = min(self.max_len, self.micro_tokens // 4)
            lines.append(f"note: the steps use less than half of the tokens of {len(sparse)} shard(s) ({worst.path}: "
                         f"{worst.steps * step_tokens / worst.num_tokens:.0%}): a document gives its first "
                         f"{self.max_len} tokens at most (--train_max_seq_len) and a micro-batch of "
                         f"{self.micro_tokens + 1} skips the rest of the one it ends in; documents of at most "
                         f"{shorter} tokens (data/tokenize_text.py --max-doc-tokens={shorter}) would use most of them")
        return lines

    def shard_record(self) -> list[dict]:
        """The shards the run reads, in order, as a checkpoint records them (see check_resume_shards)."""
        return [{"file": str(scan.path), "bytes": SHARD_HEADER_INTS * 4 + 2 * scan.num_tokens,
                 "fingerprint": fingerprint} for scan, fingerprint in zip(self.scans, self.fingerprints)]

    def state_dict(self) -> dict:
        return {"file_index": self.file_index, "piece": self.piece}

    def load_state_dict(self, state: dict):
        self.file_index, self.piece, self.pieces = int(state["file_index"]), int(state["piece"]), None

    def _index(self, file_index: int) -> DocumentPieces:
        scan = self.scans[file_index]
        return DocumentPieces(read_shard(scan.path), self.max_len, scan.starts)

    def _open(self, file_index: int) -> DocumentPieces:
        if self._next is not None and self._next[0] == file_index:
            pieces = self._next[1].result()
        else:
            pieces = self._index(file_index)
        following = (file_index + 1) % len(self.scans)
        self._next = following, self._prefetch.submit(self._index, following)
        return pieces

    def next_batch(self) -> list[tuple[Tensor, Tensor]]:
        self.started_over = False
        while True:
            if self.pieces is None:
                self.pieces = self._open(self.file_index)
            step = self.pieces.take_step(self.piece, self.num_micro, self.micro_tokens)
            if step is not None:
                break
            if self.piece == 0:  # the scan counted at least one step in every shard
                raise DataError(f"{self.scans[self.file_index].path}: changed since the start-up scan")
            self.file_index, self.piece, self.pieces = (self.file_index + 1) % len(self.scans), 0, None
            self.started_over = self.file_index == 0
        micro_batches, self.piece = step
        return rank_micro_batches(micro_batches, self.env)


class SyntheticLoader:
    """Random tokens with BOS at web-like document lengths, packed like the real data; for benchmarks
    that need no download."""

    started_over = False  # an endless supply

    def __init__(self, args: Hyperparameters, env: DistEnv):
        self.num_micro, self.micro_tokens = args.batch_tokens // args.micro_batch_tokens, args.micro_batch_tokens
        self.max_len, self.env, self.seed = args.train_max_seq_len, env, args.seed
        self.step = 0

    def report(self) -> list[str]:
        return ["data: synthetic tokens (--synthetic=true), new ones every step; no shards are read"]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict):
        self.step = int(state.get("step", 0))

    def next_batch(self) -> list[tuple[Tensor, Tensor]]:
        rng = np.random.default_rng([self.seed, self.step])
        self.step += 1
        # FineWeb documents average roughly a thousand GPT-2 tokens with a long tail: exponential lengths,
        # of which training sees the first max_len; draw pieces until they fill the step.
        lengths = np.zeros(0, dtype=np.int64)
        while lengths.sum() <= self.num_micro * (self.micro_tokens + 1):
            drawn = rng.exponential(1000, 256).astype(np.int64) + 1
            lengths = np.append(lengths, np.minimum(drawn, self.max_len))
        tokens = rng.integers(0, BOS_ID, int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - lengths] = BOS_ID
        micro_batches, _ = DocumentPieces(tokens, self.max_len).take_step(0, self.num_micro, self.micro_tokens)
        return rank_micro_batches(micro_batches, self.env)


def load_val_tokens(args: Hyperparameters) -> Tensor:
    """Exactly val_tokens (+1 for the last target) from the start of the validation shards."""
    needed = args.val_tokens + 1
    parts, total = [], 0
    files = find_shards(args.val_files, "validation")
    for f in files:
        if total >= needed:
            break
        parts.append(read_shard(f)[:needed - total])
        check_token_ids(parts[-1], f, args.vocab_size)
        total += len(parts[-1])
    if total < needed:
        raise DataError(f"validation shards {args.val_files!r} hold {total} tokens, fewer than "
                        f"--val_tokens={args.val_tokens} (+1)")
    return torch.from_numpy(np.concatenate(parts))


# -----------------------------------------------------------------------------
# Schedules: learning rate, NorMuon momentum, attention windows

def scheduled_steps(args: Hyperparameters) -> int:
    return args.num_iterations - args.extension_steps


def lr_multiplier(step: int, args: Hyperparameters) -> float:
    """Flat, then a linear decay to final_lr_frac over the last cooldown_frac of the scheduled steps;
    the extension keeps the last value (progress is capped at 0.9999 as in record #44)."""
    progress = min(step / scheduled_steps(args), 0.9999)
    if progress < 1 - args.cooldown_frac:
        return 1.0
    decay = (1 - progress) / args.cooldown_frac
    return decay + (1 - decay) * args.final_lr_frac


def muon_momentum(step: int, args: Hyperparameters) -> float:
    """Rises linearly from start to end over the warmup, falls back to start over the last cooldown steps."""
    lo, hi = args.muon_momentum_start, args.muon_momentum_end
    cooldown_start = args.num_iterations - args.muon_momentum_cooldown
    if step < args.muon_momentum_warmup:
        return lo + step / args.muon_momentum_warmup * (hi - lo)
    if step > cooldown_start:
        return hi - (step - cooldown_start) / args.muon_momentum_cooldown * (hi - lo)
    return hi


def window_stage(step: int, args: Hyperparameters) -> int:
    """Which part of the window schedule a step is in: i for the schedule's i-th long window (equal parts
    of the scheduled steps), len(schedule) for the extension. Never decreases with the step."""
    stages = len(int_list(args, "window_schedule"))
    scheduled = scheduled_steps(args)
    return stages if step >= scheduled else int(stages * (step / scheduled))


def attention_windows(step: int, args: Hyperparameters, final_validation: bool = False) -> tuple[int, int]:
    """(short, long) windows in blocks: the schedule's long window by equal parts of the scheduled
    steps, the extension's after them, a longer one for the final validation; short = long // 2."""
    schedule = int_list(args, "window_schedule")
    stage = window_stage(step, args)
    long = args.window_extension if stage == len(schedule) else schedule[stage]
    short = long // 2
    return short, (args.window_final_val if final_validation else long)


def window_spans(args: Hyperparameters) -> list[tuple[int, int]]:
    """(first step, number of steps) of each window stage; a stage the run never reaches has 0 steps. The
    stage boundaries are found by bisection: the cost does not grow with num_iterations."""
    steps = range(args.num_iterations)
    stages = len(int_list(args, "window_schedule")) + 1
    starts = [bisect.bisect_left(steps, stage, key=lambda s: window_stage(s, args)) for stage in range(stages)]
    return [(start, end - start) for start, end in zip(starts, starts[1:] + [args.num_iterations])]


def is_validation_step(step: int, args: Hyperparameters) -> bool:
    return step == args.num_iterations or bool(args.val_loss_every and step % args.val_loss_every == 0)


def layer_windows(args: Hyperparameters, windows: tuple[int, int]) -> list[int | None]:
    """Per layer, its window in tokens (None without attention)."""
    short, long = windows
    return [None if not spec.attention else args.window_block * (long if spec.long_window else short)
            for spec in layer_specs(args)]


# -----------------------------------------------------------------------------
# Optimizer setup, one training step, evaluation

def build_optimizers(model: GPT, args: Hyperparameters) -> tuple[NorMuon, DistAdam]:
    """NorMuon for every matrix in the blocks and the gates; Adam for embeddings, head and scalars."""
    matrices = [p for block in model.blocks for p in block.parameters() if p.ndim >= 2] + [model.smear_gate.weight]
    scalars = [p for p in model.parameters() if p.ndim < 2]
    embeddings = [model.embed.weight] + [ve.weight for ve in model.value_embeds]
    head = [model.head.lm_head.weight]
    # Bucket order follows the forward; step() walks it backwards, the order backward completes it.
    adam = DistAdam([dict(params=embeddings, lr=args.embed_lr), dict(params=scalars, lr=args.scalar_lr),
                     dict(params=head, lr=args.head_lr)], betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    # CPUs have no bf16 matrix units for this; there fp32 also keeps runs at different world sizes in
    # step (bf16 rounding would amplify the last-bit differences of reduction order).
    ns_dtype = torch.bfloat16 if model.embed.weight.is_cuda else torch.float32
    muon = NorMuon(matrices, lr=args.muon_lr, momentum=args.muon_momentum_start, beta2=args.muon_beta2,
                   weight_decay=args.muon_weight_decay, ns_dtype=ns_dtype)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    covered = {id(p) for p in matrices + scalars + embeddings + head}
    if len(covered) != len(matrices + scalars + embeddings + head) or covered != {id(p) for p in model.parameters()}:
        raise RuntimeError("every parameter must belong to exactly one optimizer")
    return muon, adam


def set_schedules(step: int, optimizers, args: Hyperparameters):
    multiplier = lr_multiplier(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    for group in optimizers[0].param_groups:
        group["momentum"] = muon_momentum(step, args)


def adam_steps_at(step: int, args: Hyperparameters) -> bool:
    """Adam steps at the last of every adam_every steps (record #44: the odd ones)."""
    return (step + 1) % args.adam_every == 0


def train_step(model: GPT, optimizers, batch, windows: list[int | None], step: int, args: Hyperparameters,
               use_flex: bool) -> Tensor:
    """Forward/backward over this rank's micro-batches, NorMuon's step, and Adam's every adam_every
    steps on the gradients of all of them (its reduce-scatters start in the backward that completes
    them). Returns the summed token losses. No host sync."""
    muon, adam = optimizers
    adam_now = adam_steps_at(step, args)
    loss_sum = torch.zeros((), device=batch[0][0].device)
    for i, (inputs, targets) in enumerate(batch):
        reduce_now = adam_now and i == len(batch) - 1
        with contextlib.nullcontext() if reduce_now else adam.no_sync():
            # Summed over tokens, averaged over micro-batches and ranks (record #44's gradient scale).
            loss = model(inputs, targets, build_masks(inputs, windows, use_flex, args.window_block))
            (loss / len(batch)).backward()
        loss_sum += loss.detach()
    muon.step()
    muon.zero_grad(set_to_none=True)
    if adam_now:
        adam.step()
        adam.zero_grad(set_to_none=True)
    return loss_sum


@torch.no_grad()
def evaluate(model: GPT, tokens: Tensor, windows: list[int | None], args: Hyperparameters, env: DistEnv,
             use_flex: bool) -> float:
    """Mean loss over the len(tokens) - 1 predictions of `tokens` (val_tokens + 1 of them in a real
    validation), in sequences of val_seq_len dealt out over the ranks."""
    model.eval()
    num_seqs = (len(tokens) - 1) // args.val_seq_len
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    for seq in range(env.rank, num_seqs, env.world_size):
        buf = to_device(tokens[seq * args.val_seq_len:(seq + 1) * args.val_seq_len + 1], env.device)
        inputs, targets = buf[:-1], buf[1:]
        loss_sum += model(inputs, targets, build_masks(inputs, windows, use_flex, args.window_block)).double()
    if env.world_size > 1:
        dist.all_reduce(loss_sum)
    model.train()
    return loss_sum.item() / (num_seqs * args.val_seq_len)


# -----------------------------------------------------------------------------
# Performance accounting: model FLOPs per token, the device's measured matmul peak, MFU

def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The best rate of large square matmuls on this device, measured rather than taken from a datasheet."""
    n, repeats = (8192, 10) if device.type == "cuda" else (1024, 2)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for trial in range(8):  # the first trial warms up; the best of the rest resists noise
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync(device)
        if trial:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 * repeats / best


def model_flops_per_token(args: Hyperparameters, model: GPT, tokens: Tensor, windows: list[int | None]) -> float:
    """6 FLOPs per matmul weight (forward 2, backward 4) plus attention: per attention layer, 12 * width
    FLOPs for each key a token attends to, min(position in its document + 1, the layer's window + 1)."""
    matmul_params = sum(p.numel() for p in model.blocks.parameters() if p.ndim >= 2)
    matmul_params += model.head.lm_head.weight.numel() + model.smear_gate.weight.numel()
    index = np.arange(len(tokens))
    doc_start = np.maximum.accumulate(np.where(tokens.cpu().numpy() == BOS_ID, index, 0))
    keys_in_doc = index - doc_start + 1
    attention_flops = sum(12 * args.model_dim * np.minimum(keys_in_doc, w + 1).mean() for w in windows if w is not None)
    return 6 * matmul_params + float(attention_flops)


def schedule_flops_per_token(args: Hyperparameters, model: GPT, tokens: Tensor) -> float:
    """model_flops_per_token averaged over the training steps' windows."""
    return sum(count * model_flops_per_token(args, model, tokens, layer_windows(args, attention_windows(first, args)))
               for first, count in window_spans(args) if count) / args.num_iterations


# -----------------------------------------------------------------------------
# Checkpoints: atomic, per-rank optimizer shards, every file's size and sha256 in meta.json, refused
# when anything doesn't match

def code_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def config_for_checkpoint(args: Hyperparameters) -> dict:
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in RUN_CONTROL_FIELDS}


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type where it has no message: what a one-line error quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def write_error(path, error: OSError) -> TrainingError:
    """One line for a write that failed: which file, and why in plain words."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = f"the disk is full ({error.strerror})" if full else (error.strerror or str(error))
    return TrainingError(f"cannot write {path}: {why}")


def write_all(fd: int, data) -> None:
    """os.write until every byte is out: a short write is continued, and the write that cannot go on
    raises the OSError that says why (ENOSPC: the disk is full)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


class _RecordingWriter:
    """The file object torch.save writes through. Every byte goes out with write_all, so a full disk
    raises ENOSPC here (torch.save to a path reports it as a zip-format error), and the file's size
    and sha256 are known as soon as it is complete."""

    def __init__(self, fd: int):
        self.fd, self.size, self.sha256, self.error = fd, 0, hashlib.sha256(), None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            write_all(self.fd, view)
        except OSError as e:
            self.error = e
            raise
        self.sha256.update(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self):
        pass


def write_file(path: Path, content) -> dict:
    """Writes a new file: bytes as they are, anything else with torch.save. Returns its size and sha256
    (for meta.json); a failed write raises a TrainingError that names the file and the cause."""
    writer = None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            writer = _RecordingWriter(fd)
            if isinstance(content, bytes):
                writer.write(content)
            else:
                torch.save(content, writer)
        finally:
            os.close(fd)
    except Exception as e:
        cause = writer.error if writer is not None and writer.error is not None else e
        if not isinstance(cause, OSError):
            raise
        raise write_error(path, cause) from None
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def remove_unfinished(tmp: Path, what: str = "") -> str:
    """Removes a folder a save left unfinished and says so truthfully, for the error line. Tried a few times:
    under torchrun another rank may still be adding its file while the folder is emptied."""
    for _ in range(20):
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.lexists(tmp):
            return f"the unfinished {what}{tmp} was removed"
        time.sleep(0.05)
    return f"the unfinished {what}{tmp} could not be removed: delete it"


def save_checkpoint(step: int, train_time_ms: float, model: GPT, optimizers, loader, args: Hyperparameters,
                    env: DistEnv, source: str, run_id: str) -> Path:
    """checkpoint_dir/<run_id>/step_NNNNNN/: model.pt (rank 0), rank_R.pt (each rank's optimizer shards
    and RNG states, and the step), meta.json written last with every file's size and sha256 and the
    training shards' fingerprints. Everything goes to a temporary folder renamed at the end, so a crash
    mid-save never leaves a checkpoint that looks complete; a write that fails (a full disk), or a signal
    (Ctrl-C), removes that folder and stops every rank."""
    run_dir = Path(args.checkpoint_dir) / run_id
    final, tmp = run_dir / f"step_{step:06d}", run_dir / f".step_{step:06d}.partial"
    latest_tmp = run_dir / ".latest.tmp"
    error, made = None, False
    try:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
                made = True
            except OSError as e:
                error = write_error(tmp, e)
        if not all_ranks_ok(error is None, env.device):
            raise error or TrainingError(f"rank 0 could not create {tmp}")
        files = {}
        try:
            rank_state = {"step": step, "optimizers": [opt.state_dict() for opt in optimizers],
                          "cpu_rng": torch.get_rng_state(),
                          "cuda_rng": torch.cuda.get_rng_state() if env.device.type == "cuda" else torch.empty(0)}
            files[f"rank_{env.rank}.pt"] = write_file(tmp / f"rank_{env.rank}.pt", rank_state)
            if env.is_main:
                files["model.pt"] = write_file(tmp / "model.pt", model.state_dict())
        except TrainingError as e:
            error = e
        every_rank = gather_from_ranks(None if error else files)
        failed = [rank for rank, written in enumerate(every_rank) if written is None]
        if env.is_main and not failed:
            shard_record = loader.shard_record() if hasattr(loader, "shard_record") else []  # none: synthetic data
            meta = {"step": step, "train_time_ms": train_time_ms, "world_size": env.world_size,
                    "loader": loader.state_dict(), "config": config_for_checkpoint(args),
                    "code_sha256": code_hash(source), "shards": shard_record,
                    "files": {name: written[name] for written in every_rank for name in sorted(written)}}
            try:
                write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
                publish_folder(tmp, final)
                write_file(latest_tmp, (final.name + "\n").encode())
                os.replace(latest_tmp, run_dir / "latest")
            except TrainingError as e:
                error = e
            except OSError as e:
                error = write_error(final, e)
            latest_tmp.unlink(missing_ok=True)
        if env.is_main and os.path.lexists(tmp):  # the save failed before the rename: leave nothing half-written
            reason = error or f"rank {failed[0]} could not write its part of the checkpoint"
            error = TrainingError(f"{reason}; {remove_unfinished(tmp, 'checkpoint ')}")
    except BaseException:  # a signal (Ctrl-C) or a failed collective mid-save: take the unfinished folder back
        if env.is_main and made:
            remove_unfinished(tmp)
            latest_tmp.unlink(missing_ok=True)
        raise
    if not all_ranks_ok(error is None, env.device):
        raise error or TrainingError(f"checkpoint {final} could not be written (rank 0 says why)")
    return final


def publish_folder(tmp: Path, final: Path):
    """Puts a completely written folder in place with one rename, replacing an older one."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def claim_run_folder(run_dir: Path, args: Hyperparameters) -> list[Path]:
    """Creates checkpoint_dir/<run_id>/ for a run that saves (checkpoints or final weights), and writes a file
    in it, so that an unwritable --checkpoint_dir stops the run before step 0, not after it has trained.
    The folder is made exclusively: a run that took this id since it was checked cannot be written over.
    Returns the folders made, innermost first, for release_folders."""
    made = [folder for folder in (run_dir, *run_dir.parents) if not os.path.lexists(folder)]
    probe = run_dir / ".write_test"
    try:
        os.makedirs(run_dir)  # exist_ok=False; a file on the way is ENOTDIR
        write_file(probe, b"probe")
        probe.unlink()
    except BaseException as e:  # a Ctrl-C here too leaves nothing behind
        with contextlib.suppress(OSError):
            probe.unlink()
        release_folders(made)
        if not isinstance(e, (OSError, TrainingError)):
            raise
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise ConfigError(f"--checkpoint_dir={args.checkpoint_dir}: cannot write checkpoints in {run_dir} ({why})") \
            from None
    return made


def release_folders(made: list[Path]):
    """Removes the folders a run made that stayed empty (innermost first); one holding a checkpoint stays."""
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


FINAL_WEIGHTS_FORMAT = "train_gpt.py final weights, version 1"


def save_final_weights(model: GPT, args: Hyperparameters, source: str, run_id: str, step: int,
                       val_loss: float) -> Path:
    """checkpoint_dir/<run_id>/final/ (rank 0): model.pt, every weight and the rotary state but no
    optimizer state, and config.json, what rebuilds the model; written like a checkpoint, into a
    temporary folder renamed at the end and removed if a write fails."""
    final = Path(args.checkpoint_dir) / run_id / "final"
    tmp = final.with_name(".final.partial")
    info = {"format": FINAL_WEIGHTS_FORMAT, "config": dataclasses.asdict(args), "step": step, "val_loss": val_loss,
            "windows": attention_windows(args.num_iterations, args, final_validation=True),
            "code_sha256": code_hash(source)}
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # nothing was made, so nothing is said to be removed
        raise write_error(tmp, e) from None
    try:
        try:
            write_file(tmp / "model.pt", model.state_dict())
            write_file(tmp / "config.json", json.dumps(info, indent=1).encode())
            publish_folder(tmp, final)
        except OSError as e:
            raise write_error(tmp, e) from None
    except TrainingError as e:
        raise TrainingError(f"{e}; {remove_unfinished(tmp)}") from None
    except BaseException:  # a signal (Ctrl-C) mid-write
        remove_unfinished(tmp)
        raise
    return final


def load_final_weights(path, device: torch.device) -> tuple[GPT, Hyperparameters, dict]:
    """The model saved by save_final_weights, in eval mode on `device`, its config and config.json."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such folder (train with --save_final=true to write <checkpoint_dir>/<run_id>/final)")
    if not (path / "config.json").is_file() or not (path / "model.pt").is_file():
        raise DataError(f"{path}: not a final-weights folder of train_gpt.py (it needs config.json and model.pt)")
    try:
        info = json.loads((path / "config.json").read_text())
        if info.get("format") != FINAL_WEIGHTS_FORMAT:
            raise ValueError(f"format {info.get('format')!r}")
        names = {f.name for f in dataclasses.fields(Hyperparameters)}
        # Every field a run's config records (run control aside) must be there: a default would
        # silently rebuild another model, e.g. the speedrun's.
        missing = [n for n in names if n not in RUN_CONTROL_FIELDS and n not in info["config"]]
        if missing:
            raise ValueError(f"\"config\" lacks {', '.join(sorted(missing))}, needed to rebuild the model")
        args = Hyperparameters(**{k: v for k, v in info["config"].items() if k in names})
        validate_config(args)
        windows = info.get("windows")
        if not (isinstance(windows, list) and len(windows) == 2
                and all(type(w) is int and w > 0 for w in windows)):  # type(): a bool is no block count
            raise ValueError(f'"windows" must be the final (short, long) windows in blocks, got {windows!r}')
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path / 'config.json'}: not train_gpt.py's final-weights config ({e})") from None
    model = cast_for_device(GPT(args, "bf16" if device.type == "cuda" else "fp32").to(device), device)
    try:
        saved = torch.load(path / "model.pt", map_location=device, weights_only=True)
        mismatch = state_dict_mismatch(saved, model.state_dict())
        if mismatch:
            raise ValueError(mismatch)
        model.load_state_dict(saved)
    except Exception as e:
        raise DataError(f"{path / 'model.pt'}: cannot load these weights into the model of config.json "
                        f"({first_line(e)})") from None
    return model.eval(), args, info


def state_dict_mismatch(saved, expected: dict, shown: int = 3) -> str:
    """What keeps `saved` from loading into a model whose state_dict is `expected`, in one line, the
    first few keys of each kind named ('' when nothing does): load_state_dict's own message spans lines."""
    if not isinstance(saved, dict):
        return f"not a state dict but a {type(saved).__name__}"

    def shape(value) -> str:
        return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"

    def listed(what: str, items: list) -> str:
        more = f"; and {len(items) - shown} more" if len(items) > shown else ""
        return f"{len(items)} {what}: {'; '.join(items[:shown])}{more}"

    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [f"{k}: checkpoint {shape(saved[k])}, model {shape(v)}" for k, v in expected.items()
              if k in saved and shape(saved[k]) != shape(v)]
    parts = [listed(what, items) for what, items in (("shape mismatch(es)", shapes), ("missing key(s)", missing),
                                                      ("unexpected key(s)", unexpected)) if items]
    return "; ".join(parts)


def resolve_checkpoint(resume: str, args: Hyperparameters) -> Path:
    """--resume as a folder: 'latest' is the newest `latest` pointer under --checkpoint_dir (that of the run
    that saved last). A damaged newest pointer is refused rather than passed over: an older run's would
    resume the wrong run."""
    if resume != "latest":
        return Path(resume)
    pointers = []
    for run in Path(args.checkpoint_dir).glob("*/"):
        with contextlib.suppress(OSError):  # lstat: a pointer that is a link to nowhere is found, and refused
            pointers.append((os.lstat(run / "latest").st_mtime, str(run / "latest"), run / "latest"))
    if not pointers:
        raise TrainingError(f"--resume=latest: no checkpoint under {args.checkpoint_dir}/")
    pointer = max(pointers)[2]
    damaged = f"--resume=latest: {pointer} is damaged"
    remedy = "; pass the checkpoint folder itself, --resume=DIR/<run_id>/step_NNNNNN"
    if not pointer.is_file():
        raise TrainingError(f"{damaged} (not a file{', a folder' if pointer.is_dir() else ''}){remedy}")
    try:
        name = pointer.read_bytes()[:100].decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not text"
        raise TrainingError(f"{damaged} ({why}){remedy}") from None
    if not re.fullmatch(r"step_\d{6,}", name):  # what save_checkpoint writes
        raise TrainingError(f"{damaged} (it should name a checkpoint folder beside it, e.g. step_000100, "
                            f"not {name[:40]!r}){remedy}")
    if not (pointer.parent / name).is_dir():
        raise TrainingError(f"{damaged}: it names {pointer.parent / name}, which does not exist{remedy}")
    return pointer.parent / name


# What meta.json must hold, and of which JSON types (a bool is never a number here).
CHECKPOINT_META = {"step": int, "train_time_ms": (int, float), "world_size": int, "loader": dict, "config": dict,
                   "code_sha256": str, "shards": list, "files": dict}


@dataclass
class Resume:
    """A checked checkpoint: its meta.json, and this rank's files, loaded to the CPU."""
    path: Path
    meta: dict
    model_state: dict
    rank_state: dict


def read_checkpoint_file(path: Path, name: str, meta: dict):
    """One of a checkpoint's files, checked against the size and sha256 meta.json recorded for it, then
    loaded with weights_only (a checkpoint can hold tensors and plain containers, never code)."""
    listed = meta["files"].get(name)
    if not (isinstance(listed, dict) and type(listed.get("bytes")) is int and isinstance(listed.get("sha256"), str)):
        raise TrainingError(f"--resume={path}: meta.json does not list {name} with its size and sha256")
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise TrainingError(f"--resume={path}: cannot read {name} ({e.strerror})") from None
    if len(data) != listed["bytes"]:
        raise TrainingError(f"--resume={path}: {name} has {len(data)} bytes, meta.json recorded {listed['bytes']} "
                            f"(truncated, or not this checkpoint's file)")
    if hashlib.sha256(data).hexdigest() != listed["sha256"]:
        raise TrainingError(f"--resume={path}: {name} is not the file saved with this meta.json (its sha256 differs)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise TrainingError(f"--resume={path}: cannot load {name} safely ({first_line(e)})") from None


def check_checkpoint(path: Path, args: Hyperparameters, env: DistEnv, source: str) -> Resume:
    """Everything about a checkpoint that can be wrong, checked before the run creates anything:
    meta.json's shape; that the checkpoint belongs to this run (world size, config, code); and that
    meta.json describes the files beside it (their sizes and sha256, and the step this rank's
    optimizer file was saved at)."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise TrainingError(f"--resume={path}: not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise TrainingError(f"--resume={path}: unreadable meta.json ({e})") from None
    if not isinstance(meta, dict):
        raise TrainingError(f"--resume={path}: meta.json is not a checkpoint's (a JSON {type(meta).__name__}, "
                            f"not an object)")
    for key, kind in CHECKPOINT_META.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise TrainingError(f"--resume={path}: meta.json has no valid {key!r} (edited, or written by an older "
                                f"train_gpt.py?)")
    for shard in meta["shards"]:
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and type(shard.get("bytes")) is int
                and isinstance(shard.get("fingerprint"), str)):
            raise TrainingError(f"--resume={path}: meta.json has no valid 'shards' (edited, or written by an older "
                                f"train_gpt.py?)")
    if meta["world_size"] != env.world_size:
        raise TrainingError(f"--resume={path}: written at world size {meta['world_size']}, this run has "
                            f"{env.world_size}; DistAdam and NorMuon state are sharded per rank, so resume with "
                            f"{meta['world_size']} ranks")
    if not args.force_resume:
        ours = config_for_checkpoint(args)
        differ = sorted(k for k in set(ours) | set(meta["config"]) if ours.get(k) != meta["config"].get(k))
        if differ:
            raise TrainingError(f"--resume={path}: config differs in {', '.join(differ)} "
                                f"(use --force_resume=true to resume anyway)")
        if meta["code_sha256"] != code_hash(source):
            raise TrainingError(f"--resume={path}: written by a different train_gpt.py "
                                f"(use --force_resume=true to resume anyway)")
    model_state = read_checkpoint_file(path, "model.pt", meta)
    rank_state = read_checkpoint_file(path, f"rank_{env.rank}.pt", meta)
    saved_at = rank_state.get("step") if isinstance(rank_state, dict) else None
    if saved_at != meta["step"]:
        raise TrainingError(f"--resume={path}: meta.json says step {meta['step']}, but rank_{env.rank}.pt was "
                            f"saved at step {saved_at}")
    if meta["step"] > args.num_iterations or (args.force_resume and meta["step"] == args.num_iterations):
        # (unforced, num_iterations matched: the same run's last checkpoint runs only its final validation)
        raise TrainingError(f"--resume={path}: the checkpoint is at step {meta['step']}, at or past "
                            f"--num_iterations={args.num_iterations}: nothing is left to train (a longer run needs a "
                            f"larger --num_iterations)")
    return Resume(path, meta, model_state, rank_state)


def check_resume_shards(resume: Resume, loader, args: Hyperparameters):
    """The training shards this run reads must be the ones the checkpoint's run read, where both read them
    (in order, by size and fingerprint; a folder moved elsewhere is the same data): other data would not
    continue that run. --force_resume=true goes on anyway, from the same shard index and position."""
    recorded = resume.meta["shards"]
    scans = getattr(loader, "scans", [])
    if bool(recorded) != bool(scans):
        raise TrainingError(f"--resume={resume.path}: the checkpoint was trained on "
                            f"{'shards' if recorded else 'synthetic tokens'}, this run reads "
                            f"{'shards' if scans else 'synthetic tokens'}")
    if not scans:
        return
    position = resume.meta["loader"].get("file_index")
    if type(position) is not int or not 0 <= position < len(scans):
        raise TrainingError(f"--resume={resume.path}: the checkpoint stopped in training shard {position!r}, but "
                            f"--train_files={args.train_files} gives this run {len(scans)} shard(s)")
    if args.force_resume:
        return
    for i, (saved, scan, fingerprint) in enumerate(zip(recorded, scans, loader.fingerprints)):
        size = SHARD_HEADER_INTS * 4 + 2 * scan.num_tokens
        if saved["bytes"] != size or saved["fingerprint"] != fingerprint:
            other = ", another fingerprint" if saved["bytes"] == size else ""
            raise TrainingError(f"--resume={resume.path}: training shard {i + 1}, {scan.path} ({size:,} bytes), is "
                                f"not the one the checkpoint's run read ({saved['file']}, {saved['bytes']:,} bytes"
                                f"{other}); use --force_resume=true to go on with these shards anyway")


def load_checkpoint(resume: Resume, model: GPT, optimizers, loader, env: DistEnv) -> tuple[int, float]:
    try:
        model.load_state_dict(resume.model_state)
        for opt, state in zip(optimizers, resume.rank_state["optimizers"], strict=True):
            opt.load_state_dict(state)
        loader.load_state_dict(resume.meta["loader"])
        torch.set_rng_state(resume.rank_state["cpu_rng"].cpu())
        if env.device.type == "cuda" and resume.rank_state["cuda_rng"].numel():
            torch.cuda.set_rng_state(resume.rank_state["cuda_rng"].cpu())
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise TrainingError(f"--resume={resume.path}: the checkpoint does not fit this run "
                            f"({first_line(e)})") from None
    return resume.meta["step"], float(resume.meta["train_time_ms"])


# -----------------------------------------------------------------------------
# Logging: the log file starts with this file's source, then versions, hardware and config

class Logger:
    """Rank 0 writes logs/<run_id>.txt and the console. Each line reaches the file as it is logged, so
    a killed run keeps every step it finished. A write that fails (a full disk) is taken back to the
    last complete line and raises a TrainingError naming the file."""

    def __init__(self, path: Path | None):
        self.path, self.fd, self.size = path, None, 0
        if path is not None:
            made = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # never overwrite another run's log
            except BaseException:  # an OSError, or a Ctrl-C
                for folder in made:  # innermost first: a run that never started leaves no empty folders
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                raise

    def __call__(self, line: str = "", console: bool = True):
        if self.fd is None:
            return
        data = (line + "\n").encode("utf-8", "backslashreplace")
        try:
            write_all(self.fd, data)
        except OSError as e:
            with contextlib.suppress(OSError):  # no half line: the log keeps every complete one
                os.ftruncate(self.fd, self.size)
                os.lseek(self.fd, self.size, os.SEEK_SET)
            raise write_error(self.path, e) from None
        self.size += len(data)
        if console:
            print(line, flush=True)

    def last_line(self, line: str):
        """The line that says how a run ended, if the disk still has room for it."""
        with contextlib.suppress(TrainingError):
            self(line, console=False)

    def close(self):
        """Puts the log on the disk; a failure here (some file systems report a full disk only now) is an
        error of the run too."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.fsync(fd)
        except OSError as e:
            raise write_error(self.path, e) from None
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def log_header(log: Logger, source: str, args: Hyperparameters, env: DistEnv, run_id: str, model: GPT):
    log(source, console=False)
    log("=" * 100, console=False)
    log(f"Running Python {sys.version}")
    log(f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda or 'none'}")
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.machine()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    log(f"device: {env.device.type} ({device_name})  world_size: {env.world_size}  "
        f"backend: {dist.get_backend() if distributed() else 'none'}  date: {now}")
    attention_kind = resolve_attention(args, env.device)
    head = model.head.precision
    if head == "bf16" and args.lm_head_precision == "auto" and not fp8_head_fits(args):
        head += " (fp8 needs --model_dim and --micro_batch_tokens multiples of 16)"
    compiled = "per block" if args.compile else ("FlexAttention only" if attention_kind == "flex" else "off")
    log(f"attention: {attention_kind}  lm_head: {head}  compile: {compiled}")
    smi = nvidia_smi()
    if smi:
        log(smi, console=False)
    if args.preset != "speedrun":
        log(f"note: {args.preset} preset (small model, not the record configuration) - NOT a record run")
    log("hyperparameters:", console=False)
    for name, value in dataclasses.asdict(args).items():
        log(f"  {name} = {value}", console=False)
    log(f"code_sha256: {code_hash(source)}")
    log(f"run_id: {run_id}")
    log("=" * 100, console=False)


def format_step(step: int, args: Hyperparameters, train_time_ms: float, **values) -> str:
    fields = " ".join(f"{k}:{v:.4f}" for k, v in values.items())
    return (f"step:{step}/{args.num_iterations} {fields + ' ' if fields else ''}"
            f"train_time:{train_time_ms:.0f}ms step_avg:{train_time_ms / max(step, 1):.2f}ms")


# -----------------------------------------------------------------------------
# main: setup, untimed warmup, timed training with validation, summary

def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_freed_cpu_memory():
    """glibc hands every freed block above its mmap threshold (32 MiB at most by default) back to the
    OS, so each step's large CPU tensors (a micro-batch's tokens x vocab logits and their gradients) are
    mapped and zero-filled again page by page: on the smoke preset that kernel work cost more than the
    arithmetic (3.1 s vs 1.2 s per step on a 2-core machine). Blocks below 1 GiB stay in the heap for the
    next step instead. Nothing happens where the C library has no mallopt (macOS, musl)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        mallopt(M_MMAP_THRESHOLD, 1 << 30)
        mallopt(M_TRIM_THRESHOLD, 1 << 30)


def cast_for_device(model: GPT, device: torch.device) -> GPT:
    """On GPUs, record #44's parameter dtypes: bf16 embeddings, lm_head and gates; the hidden matrices
    and scalars stay fp32 (Muon's small updates survive; CastedLinear multiplies in bf16). An fp32 head
    (--lm_head_precision=fp32) keeps its weight in fp32. On CPU all fp32."""
    if device.type == "cuda":
        gates = [block.attn.gate for block in model.blocks if block.attn is not None]
        head = [model.head.lm_head] if model.head.precision != "fp32" else []
        for module in [model.embed, *model.value_embeds, *head, model.smear_gate, *gates]:
            module.bfloat16()
    return model


def build_model(args: Hyperparameters, env: DistEnv) -> GPT:
    """Built and cast on the host, then moved to the device in one go (tools/preflight.py moves it to a
    fake H100 there)."""
    torch.manual_seed(args.seed)
    model = cast_for_device(GPT(args, resolve_head_precision(args, env.device)), env.device).to(env.device)
    if env.world_size > 1:  # identical weights on every rank whatever the device's RNG does
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    return model


def check_finite(value: float, what: str, step: int):
    if not math.isfinite(value):
        raise TrainingError(f"non-finite {what} ({value}) at step {step}: stopping the run")


def train(args: Hyperparameters, env: DistEnv):
    source = Path(__file__).read_text(encoding="utf-8")
    run_id = args.run_id or f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:8]}"
    check_world_size(args, env.world_size)

    # Every input check (data, checkpoint, run id) runs before anything is created, so bad input leaves
    # no log and no folder behind and takes no run id. All ranks agree on the outcome before the log is
    # created and again after, so one rank's error never leaves the others waiting in a collective.
    log, error, resume, made = Logger(None), None, None, []
    log_path = Path(args.logs_dir) / f"{run_id}.txt"
    run_dir = Path(args.checkpoint_dir) / run_id
    try:
        loader = SyntheticLoader(args, env) if args.synthetic else TrainLoader(args, env)
        val_tokens = (torch.randint(0, BOS_ID, (args.val_tokens + 1,), generator=torch.Generator().manual_seed(0))
                      if args.synthetic else load_val_tokens(args))
        if args.resume:
            resume = check_checkpoint(resolve_checkpoint(args.resume, args), args, env, source)
        if env.is_main and log_path.exists():
            raise ConfigError(f"--run_id={run_id}: {log_path} already exists; choose another run id")
        # A run id names one run, its log and its checkpoint folder, whichever --logs_dir and --checkpoint_dir
        # are given: another run's are never written over. A resumed run is a new run with its own id.
        if env.is_main and os.path.lexists(run_dir):
            raise ConfigError(f"--run_id={run_id}: {run_dir} already exists (another run's checkpoint folder); "
                              f"choose another run id" + (" (a resumed run takes a new one)" if args.resume else ""))
        if resume is not None:
            check_resume_shards(resume, loader, args)
    except (ConfigError, DataError, TrainingError) as e:
        error = e
    if all_ranks_ok(error is None, env.device) and env.is_main:
        try:
            if args.save_every or args.save_final:  # the folder is written before step 0, not after training
                made = claim_run_folder(run_dir, args)
            log = Logger(log_path)
        except ConfigError as e:
            error = e
        except OSError as e:
            release_folders(made)
            error = ConfigError(f"--logs_dir={args.logs_dir}: cannot write the log ({e.strerror})")
    if not all_ranks_ok(error is None, env.device):
        release_folders(made)
        raise error or TrainingError("another rank failed during setup")

    try:
        model = build_model(args, env)
        log_header(log, source, args, env, run_id, model)
        for line in loader.report():
            log(line)
        for line in getattr(loader, "located", []):
            log(line)
        run_training(args, env, log, model, loader, val_tokens, source, run_id, resume)
        log.close()  # a log that cannot reach the disk is a failed run too
    except BaseException as e:  # the log says how the run ended, whatever ended it (Ctrl-C included)
        STOP.armed = False  # ending now: a later signal (torchrun stopping the other ranks) must not cut this short
        log.last_line(f"error: {failure_line(e)}")
        raise
    finally:
        with contextlib.suppress(TrainingError):
            log.close()
        if env.is_main:  # a run that saved nothing leaves no empty folders
            release_folders(made)


class StepTimer:
    """Per-step times without a per-step device sync. On CUDA an event is recorded after each step and
    the events are read only where the loop synchronises anyway (validation, checkpoints, the end), so
    the host keeps running ahead; a step's time is the device's, from one event to the next. On CPU,
    where the host computes the step itself, its clock is read instead."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.step_ms: list[float] = []
        self.marks: list = []  # since start(): CUDA events, or host times on CPU

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self):
        """Call after a device sync: the next step starts now."""
        self.marks = [self._mark()]

    def step_done(self):
        self.marks.append(self._mark())

    def read(self):
        """Call after a device sync: adds the times of the steps since start() to step_ms."""
        pairs = zip(self.marks, self.marks[1:])
        self.step_ms += [a.elapsed_time(b) if self.cuda else 1000 * (b - a) for a, b in pairs]
        self.marks = []


def snapshot(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, Tensor) else dict(v) for k, v in state.items()}


def prepare_training(model: GPT, args: Hyperparameters, env: DistEnv, backend="inductor") -> tuple[tuple, bool]:
    """Compiles what the run compiles and builds its optimizers: (optimizers, whether attention is flex)."""
    use_flex = resolve_attention(args, env.device) == "flex"
    if args.compile or use_flex:
        compile_model(model, backend, attention_only=not args.compile)
    return build_optimizers(model, args), use_flex


def run_training(args: Hyperparameters, env: DistEnv, log: Logger, model: GPT, loader, val_tokens: Tensor,
                 source: str, run_id: str, resume: Resume | None):
    optimizers, use_flex = prepare_training(model, args, env)
    initial_loader = loader.state_dict()

    # Untimed warmup: training steps (from the second on, one that steps Adam) and a validation
    # compile and run every kernel. Windows, documents, rotary tables and the attention scale are
    # tensors, so these are all the graphs the run builds. Then model (rotary state included),
    # optimizers and data go back to where they started.
    if args.warmup_steps:
        initial_model = snapshot(model.state_dict())
        initial_optimizers = [opt.state_dict() for opt in optimizers]
        for step in range(args.warmup_steps):
            windows = layer_windows(args, attention_windows(step, args))
            train_step(model, optimizers, loader.next_batch(), windows, step, args, use_flex)
        final_windows = layer_windows(args, attention_windows(args.num_iterations, args, final_validation=True))
        evaluate(model, val_tokens[:args.val_seq_len * env.world_size + 1], final_windows, args, env, use_flex)
        model.load_state_dict(initial_model)
        model.zero_grad(set_to_none=True)
        for opt, state in zip(optimizers, initial_optimizers):
            opt.load_state_dict(state)
        loader.load_state_dict(initial_loader)

    # Performance accounting, set up before the clock starts.
    matmul_dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    peak_flops = matmul_peak_flops(env.device, matmul_dtype)
    flops_per_token = schedule_flops_per_token(args, model, loader.next_batch()[0][0])
    loader.load_state_dict(initial_loader)
    timer = StepTimer(env.device)

    start_step, train_time_ms = 0, 0.0
    if resume:
        error = None
        try:
            start_step, train_time_ms = load_checkpoint(resume, model, optimizers, loader, env)
        except TrainingError as e:
            error = e
        if not all_ranks_ok(error is None, env.device):  # one rank's bad file stops them all
            raise error or TrainingError("another rank could not load the checkpoint")
        log(f"resumed from {resume.path} at step {start_step}")

    # The host runs ahead of the device: the loop synchronises only where the clock stops (validation,
    # checkpoints, the end) and where the train loss is logged (every train_loss_every steps).
    sync(env.device)
    t0 = time.perf_counter()
    timer.start()
    train_loss_sum, train_loss_steps = torch.zeros((), device=env.device), 0
    final_val_loss = float("nan")
    for step in range(start_step, args.num_iterations + 1):
        last_step = step == args.num_iterations
        windows = attention_windows(step, args)
        model.rotary.set_window(windows[1])  # YaRN, when the long window grows
        if is_validation_step(step, args):
            sync(env.device)
            train_time_ms += 1000 * (time.perf_counter() - t0)  # the clock stops for validation
            timer.read()
            val_windows = layer_windows(args, attention_windows(step, args, final_validation=last_step))
            final_val_loss = evaluate(model, val_tokens, val_windows, args, env, use_flex)
            log(format_step(step, args, train_time_ms, val_loss=final_val_loss))
            check_finite(final_val_loss, "val loss", step)
            sync(env.device)
            t0 = time.perf_counter()
            timer.start()
        if args.save_every and step > start_step and step % args.save_every == 0:
            sync(env.device)
            train_time_ms += 1000 * (time.perf_counter() - t0)  # nor for saving
            timer.read()
            path = save_checkpoint(step, train_time_ms, model, optimizers, loader, args, env, source, run_id)
            log(f"checkpoint: {path}", console=False)
            sync(env.device)
            t0 = time.perf_counter()
            timer.start()
        if last_step:
            break

        set_schedules(step, optimizers, args)
        batch = loader.next_batch()
        if loader.started_over:  # only with --repeat_data=true: the set-up refuses a run that would repeat
            log(f"data: the training shards are used up after {step} steps; step {step + 1} starts over from the "
                f"first shard (--repeat_data=true)")
        loss = train_step(model, optimizers, batch, layer_windows(args, windows), step, args, use_flex)
        train_loss_sum += loss
        train_loss_steps += 1
        timer.step_done()
        # On CUDA the host's clock, which runs ahead of the device; exact at validation and at the end.
        now_ms = train_time_ms + 1000 * (time.perf_counter() - t0)
        if args.train_loss_every and (step + 1) % args.train_loss_every == 0:
            if env.world_size > 1:  # every rank sees the same value, so all stop together on a NaN
                dist.all_reduce(train_loss_sum)
            train_loss = train_loss_sum.item() / (train_loss_steps * args.batch_tokens)  # mean per token
            train_loss_sum.zero_()
            train_loss_steps = 0
            log(format_step(step + 1, args, now_ms, train_loss=train_loss))
            check_finite(train_loss, "train loss", step + 1)
        else:
            log(format_step(step + 1, args, now_ms))

    error = None
    if args.save_final and env.is_main:  # after the clock has stopped
        try:
            log(f"final weights: {save_final_weights(model, args, source, run_id, args.num_iterations, final_val_loss)}")
        except TrainingError as e:
            error = e
    if not all_ranks_ok(error is None, env.device):
        raise error or TrainingError("rank 0 could not write the final weights")
    if optimizers[1].late_reductions:
        log(f"note: {optimizers[1].late_reductions} DistAdam bucket reductions started in step(), not during "
            f"backward (a parameter without a gradient)")
    if env.device.type == "cuda":
        peak_memory = torch.cuda.max_memory_allocated() // 2**20
        log(f"peak memory allocated: {peak_memory} MiB reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    else:
        peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux

    def mfu(tokens_per_s: float) -> float:
        return 100 * flops_per_token * tokens_per_s / (peak_flops * env.world_size)

    if timer.step_ms:  # the median step: what a benchmark compares
        median_ms = float(np.median(timer.step_ms))
        median_tokens_per_s = args.batch_tokens / (median_ms / 1000)
        log(f"perf: step_median:{median_ms:.2f}ms tokens_per_s:{median_tokens_per_s:.0f} "
            f"model_flops_per_token:{flops_per_token:.0f} matmul_peak_tflops:{peak_flops / 1e12:.2f} "
            f"({str(matmul_dtype).removeprefix('torch.')}) mfu:{mfu(median_tokens_per_s):.2f}% "
            f"peak_memory:{peak_memory}MiB")
    steps_run = args.num_iterations - start_step
    tokens_per_s = steps_run * args.batch_tokens / max(train_time_ms / 1000, 1e-9)
    log(f"summary: final_val_loss:{final_val_loss:.4f} train_time:{train_time_ms:.0f}ms "
        f"steps:{args.num_iterations} tokens_per_s:{tokens_per_s:.0f} mfu:{mfu(tokens_per_s):.2f}% "
        f"world_size:{env.world_size} device:{env.device.type}")


class Stopped(BaseException):
    """Raised by stop_on_signal. A BaseException, so that no `except Exception` on the way takes it for an
    error it can handle; torch.save, though, turns it into a RuntimeError, so STOP is what says a signal
    ended the run."""


class StopState:
    """What stop_on_signal saw: main() arms it; the first signal disarms it and records which signal came
    and where the run was."""

    def __init__(self):
        self.armed, self.signal, self.where = False, None, ""

    def message(self) -> str:
        name = self.signal.name
        verb = "interrupted" if self.signal == signal.SIGINT else "stopped"
        if self.signal == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ:
            return f"{verb} by {name} {self.where} (torchrun stops every rank when one fails or when it is stopped)"
        return f"{verb} by {name} {self.where}"


STOP = StopState()


def training_position(frame) -> str:
    """Where the main thread was when a signal came, from run_training's locals: its step counter (the
    steps done), and whether a checkpoint or the final weights were being written."""
    names = []
    while frame is not None and frame.f_code is not run_training.__code__:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    if frame is None:
        return "before training started"
    local = frame.f_locals
    if "t0" not in local:  # the clock starts just before the first step
        return "before step 0 (setting up, or in the untimed warmup)"
    step = max(local.get("step", 0), local["start_step"])
    saving = (", while saving its checkpoint" if "save_checkpoint" in names else
              ", while writing the final weights" if "save_final_weights" in names else "")
    return f"at step {step}{saving}"


def stop_on_signal(signum, frame):
    # SIGINT (Ctrl-C) or SIGTERM (kill, or torchrun stopping the ranks): end through the normal error path,
    # so that an unfinished checkpoint is removed and the log says how the run ended. Only the first signal
    # counts: torchrun forwards a Ctrl-C to its ranks, which then get it twice, and the cleanup must finish.
    if not STOP.armed:
        return
    STOP.armed, STOP.signal, STOP.where = False, signal.Signals(signum), training_position(frame)
    raise Stopped(STOP.message())


def failure_line(error: BaseException) -> str:
    """The text of the `error:` line that ends a failed run's log."""
    if STOP.signal is not None:  # whatever surfaced: a signal mid-save surfaces as torch.save's RuntimeError
        return STOP.message()
    return f"{type(error).__name__ + ': ' if not isinstance(error, TrainingError) else ''}{error}"


def report_error(line: str, exit_code: int, print_it: bool = True) -> int:
    """Prints a failed run's one line and returns its exit code. Under torchrun the line also goes to the
    rank's error file (TORCHELASTIC_ERROR_FILE, which torchrun sets), so that torchrun's own summary of
    the failure shows it instead of a pointer to its documentation."""
    if print_it:
        print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps(record))
    return exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    STOP.signal, STOP.where, env = None, "", None
    previous = {signum: signal.signal(signum, stop_on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    STOP.armed = True
    try:
        try:
            args = parse_args(argv, torch.cuda.is_available())
            env = setup_distributed(args)
        except ConfigError as e:
            return report_error(f"error: {e}", 2, print_it=rank == 0)
        rank = env.rank
        if env.device.type == "cpu":
            keep_freed_cpu_memory()
        train(args, env)
        return 0
    except BaseException as e:
        STOP.armed = False
        if STOP.signal is not None:  # one line per rank, and the shell's code for a signal: 128 + its number
            return report_error(f"error [rank {rank}]: {STOP.message()}", 128 + STOP.signal)
        if isinstance(e, (ConfigError, DataError)):  # the same on every rank: rank 0 speaks for all
            return report_error(f"error: {e}", 2, print_it=env is None or env.is_main)
        if isinstance(e, TrainingError):
            return report_error(f"error [rank {rank}]: {e}", 1)
        if isinstance(e, dist.DistError):  # a peer died or a collective timed out
            return report_error(f"error [rank {rank}]: a collective failed, another rank probably died: "
                                f"{first_line(e)}", 1)
        raise
    finally:
        STOP.armed = False
        if dist.is_initialized():
            dist.destroy_process_group()
        for signum, handler in previous.items():  # main() may run in a process that goes on (the tests)
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())

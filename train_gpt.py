"""train_gpt.py: the NanoGPT speedrun trainer in one file.

Trains a GPT-2-small-class model on FineWeb10B to 3.28 val loss as fast as 8xH100 allow.
The same file runs on one GPU (gradient accumulation keeps the global batch), on several
nodes (torchrun rendezvous) and on CPU (gloo, the `smoke` preset on the bundled corpus).

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # the record run
    python train_gpt.py --preset=smoke                                # CPU, ~2 minutes

Read top to bottom: config, distributed setup, model, optimizers, data, schedules,
checkpoints, evaluation and logging, main(). Importing this file has no side effects.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import glob
import hashlib
import json
import math
import os
import platform
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
    val_seq_len: int = _help("tokens per validation sequence", 65_536)
    batch_tokens: int = _help("tokens per optimizer step, over all ranks; fixed whatever the world size", 262_144)
    micro_batch_tokens: int = _help("tokens one rank processes in one forward/backward (one packed sequence)", 32_768)
    synthetic: bool = _help("feed synthetic tokens with web-like document lengths instead of shards (benchmarks)", False)
    # model
    vocab_size: int = _help("GPT-2 vocabulary; the embedding is padded to a multiple of 128", 50_257)
    num_layers: int = _help("transformer blocks", 12)
    model_dim: int = _help("residual stream width", 768)
    head_dim: int = _help("attention head size; heads = model_dim / head_dim", 128)
    mlp_ratio: int = _help("MLP hidden width / model_dim", 4)
    num_value_embeds: int = _help("value embeddings, each used by one early and one late layer", 3)
    logit_softcap: float = _help("logits are squashed to (-cap, cap) with cap * tanh(x / cap)", 30.0)
    rope_base: float = _help("rotary embedding base", 10_000.0)
    # attention windows (in tokens; a multiple of window_block)
    window_block: int = _help("granularity of window sizes; FlexAttention's block size", 128)
    window_min: int = _help("long-window size at step 0", 384)
    window_max: int = _help("long-window size at the last step; short windows are half of it", 1792)
    long_window_every: int = _help("every k-th layer (and the last) uses the long window", 4)
    # optimization
    num_iterations: int = _help("optimizer steps", 2245)
    cooldown_frac: float = _help("fraction of steps over which the learning rate decays linearly", 0.45)
    final_lr_frac: float = _help("learning-rate multiplier at the last step", 0.1)
    embed_lr: float = _help("DistAdam lr for token and value embeddings", 0.3)
    head_lr: float = _help("DistAdam lr for the lm_head", 0.008)
    scalar_lr: float = _help("DistAdam lr for scalars and gates", 0.04)
    adam_beta1: float = _help("DistAdam beta1", 0.8)
    adam_beta2: float = _help("DistAdam beta2", 0.95)
    adam_eps: float = _help("DistAdam epsilon", 1e-10)
    muon_lr: float = _help("Muon lr for hidden matrices", 0.05)
    muon_momentum_start: float = _help("Muon momentum at step 0", 0.85)
    muon_momentum_end: float = _help("Muon momentum after the warmup", 0.95)
    muon_momentum_warmup: int = _help("steps over which Muon momentum rises", 300)
    # run control
    seed: int = _help("seed for the initial weights (identical on every rank)", 1337)
    device: str = _help("auto, cuda or cpu", "auto")
    compile: bool = _help("torch.compile the model", True)
    warmup_steps: int = _help("untimed steps that compile every kernel; the state is restored after them", 1)
    val_loss_every: int = _help("validate every N steps (0: only at the end)", 250)
    train_loss_every: int = _help("log the train loss every N steps (0: never); costs one host sync", 250)
    run_id: str = _help("name of the log file logs/<run_id>.txt (default: a fresh uuid)", "")
    logs_dir: str = _help("where logs are written", "logs")
    pg_timeout_s: int = _help("collective timeout; after it the surviving ranks of a broken job exit", 300)
    save_every: int = _help("save a checkpoint every N steps (0: never)", 0)
    checkpoint_dir: str = _help("where checkpoints are written", "checkpoints")
    resume: str = _help("checkpoint folder to resume from, or 'latest'", "")
    force_resume: bool = _help("resume even if the config or code differs from the checkpoint's", False)


PRESETS: dict[str, dict] = {
    # The 8xH100 record configuration: the dataclass defaults.
    "speedrun": {},
    # A small model on the bundled Shakespeare shards: a CPU check of the whole pipeline.
    "smoke": dict(
        train_files="data/shakespeare/shakespeare_train_*.bin",
        val_files="data/shakespeare/shakespeare_val_*.bin",
        val_tokens=8192, val_seq_len=256,
        batch_tokens=2048, micro_batch_tokens=256,
        num_layers=4, model_dim=64, head_dim=16, num_value_embeds=1,
        window_min=128, window_max=256, long_window_every=2,
        num_iterations=30, cooldown_frac=0.3, muon_momentum_warmup=10,
        embed_lr=0.3, head_lr=0.02, scalar_lr=0.02, muon_lr=0.05,
        compile=False, warmup_steps=1, val_loss_every=10, train_loss_every=10,
    ),
}

# Fields that steer one run without changing what it computes: a checkpoint may be
# resumed with different values of these.
RUN_CONTROL_FIELDS = ("run_id", "logs_dir", "pg_timeout_s", "save_every", "checkpoint_dir",
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


def validate_config(args: Hyperparameters):
    positive = ["val_tokens", "val_seq_len", "batch_tokens", "micro_batch_tokens", "vocab_size", "num_layers",
                "model_dim", "head_dim", "mlp_ratio", "window_block", "window_min", "window_max",
                "long_window_every", "num_iterations", "pg_timeout_s"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be positive")
    for name in ["val_loss_every", "train_loss_every", "save_every", "warmup_steps", "num_value_embeds"]:
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be zero or positive")
    if args.model_dim % args.head_dim:
        raise ConfigError(f"--model_dim={args.model_dim} must be a multiple of --head_dim={args.head_dim}")
    if args.head_dim % 2:
        raise ConfigError(f"--head_dim={args.head_dim} must be even (rotary embeddings rotate pairs)")
    if 2 * args.num_value_embeds > args.num_layers:
        raise ConfigError(f"--num_value_embeds={args.num_value_embeds}: at most num_layers/2 = {args.num_layers // 2}")
    if args.window_min % args.window_block or args.window_max % args.window_block:
        raise ConfigError(f"--window_min and --window_max must be multiples of --window_block={args.window_block}")
    if not args.window_block <= args.window_min <= args.window_max:
        raise ConfigError(f"need window_block <= window_min <= window_max, got {args.window_block}, "
                          f"{args.window_min}, {args.window_max}")
    if args.batch_tokens % args.micro_batch_tokens:
        raise ConfigError(f"--batch_tokens={args.batch_tokens} must be a multiple of "
                          f"--micro_batch_tokens={args.micro_batch_tokens}")
    if args.val_tokens % args.val_seq_len:
        raise ConfigError(f"--val_tokens={args.val_tokens} must be a multiple of --val_seq_len={args.val_seq_len}")
    if not 0.0 <= args.cooldown_frac <= 1.0:
        raise ConfigError(f"--cooldown_frac={args.cooldown_frac}: must lie in [0, 1]")
    if args.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"--device={args.device}: choose auto, cuda or cpu")


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
    if world_size > 1:
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
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# PyTorch 2.13 renames the tensor collectives (the old names warn); 2.11 has only the old ones.
def reduce_scatter_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, async_op=True)


# -----------------------------------------------------------------------------
# Model: rotary, QK-norm, ReLU^2 MLP, value embeddings, U-net skips, soft-capped logits

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    """Keeps an fp32 master weight (Muon's small updates survive) and multiplies in the input's dtype."""

    def __init__(self, in_features: int, out_features: int, zero_init: bool = False):
        super().__init__(in_features, out_features, bias=False)
        if zero_init:
            nn.init.zeros_(self.weight)  # residual branches start as identity (modded-nanogpt, muP-style)
        else:
            bound = 3 ** 0.5 * in_features ** -0.5  # uniform with std 1/sqrt(fan_in)
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, H, D)
        t = torch.arange(x.size(1), device=x.device, dtype=torch.float32)
        angles = torch.outer(t, self.inv_freq)[None, :, None, :]
        cos, sin = angles.cos().type_as(x), angles.sin().type_as(x)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


# Attention masks. A position attends to itself and earlier positions of the same document
# (a BOS token starts a new one) that lie within its sliding window. CUDA builds FlexAttention
# block masks, which skip empty blocks; elsewhere an explicit boolean mask feeds SDPA.

def document_ids(tokens: Tensor, bos_id: int) -> Tensor:
    return (tokens == bos_id).cumsum(0)


def dense_attention_mask(docs: Tensor, window: int) -> Tensor:
    pos = torch.arange(docs.numel(), device=docs.device)
    causal = pos[:, None] >= pos[None, :]
    same_doc = docs[:, None] == docs[None, :]
    in_window = pos[:, None] - pos[None, :] < window
    return causal & same_doc & in_window


def flex_block_mask(docs: Tensor, window: int, block_size: int):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx]) & (q_idx - kv_idx < window)

    length = docs.numel()
    return create_block_mask(mask_mod, None, None, length, length, device=docs.device,
                             BLOCK_SIZE=block_size, _compile=docs.is_cuda)


def attention(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
    """q, k, v: (B, H, T, D). `mask` is a FlexAttention BlockMask or a boolean (T, T) tensor."""
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=mask, scale=scale)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int, rope_base: float):
        super().__init__()
        self.num_heads, self.head_dim = dim // head_dim, head_dim
        self.q = CastedLinear(dim, dim)
        self.k = CastedLinear(dim, dim)
        self.v = CastedLinear(dim, dim)
        self.proj = CastedLinear(dim, dim, zero_init=True)
        self.rotary = Rotary(head_dim, rope_base)
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5]))  # weights of (v, value embedding)

    def forward(self, x: Tensor, value_embed: Tensor | None, mask) -> Tensor:
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))  # QK-norm keeps attention logits bounded
        if value_embed is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * value_embed.view(shape)
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=self.head_dim ** -0.5)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.fc = CastedLinear(dim, ratio * dim)
        self.proj = CastedLinear(ratio * dim, dim, zero_init=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())  # ReLU^2 (Primer)


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int, mlp_ratio: int, rope_base: float):
        super().__init__()
        self.attn = CausalSelfAttention(dim, head_dim, rope_base)
        self.mlp = MLP(dim, mlp_ratio)
        self.residual_mix = nn.Parameter(torch.tensor([1.0, 0.0]))  # weights of (x, x0: the embedding)

    def forward(self, x: Tensor, x0: Tensor, value_embed: Tensor | None, mask) -> Tensor:
        x = self.residual_mix[0] * x + self.residual_mix[1] * x0
        x = x + self.attn(norm(x), value_embed, mask)
        return x + self.mlp(norm(x))


class LossHead(nn.Module):
    """lm_head, soft-capped logits and cross-entropy: one compiled graph on CUDA, so the large
    (tokens x vocab) logits are produced and consumed in fused kernels."""

    def __init__(self, dim: int, vocab: int, softcap: float):
        super().__init__()
        self.lm_head = CastedLinear(dim, vocab, zero_init=True)  # untied from the embedding
        self.softcap = softcap

    def forward(self, x: Tensor, target_ids: Tensor, reduction: str) -> Tensor:
        logits = self.lm_head(norm(x)).float()
        logits = self.softcap * torch.tanh(logits / self.softcap)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target_ids.view(-1), reduction=reduction)


def padded_vocab(vocab_size: int) -> int:
    return 128 * math.ceil(vocab_size / 128)  # tensor-core friendly; the extra logits learn to stay low


class GPT(nn.Module):
    def __init__(self, args: Hyperparameters):
        super().__init__()
        vocab, dim = padded_vocab(args.vocab_size), args.model_dim
        self.embed = nn.Embedding(vocab, dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(args.num_value_embeds))
        self.blocks = nn.ModuleList(Block(dim, args.head_dim, args.mlp_ratio, args.rope_base)
                                    for _ in range(args.num_layers))
        self.num_encoder_layers = args.num_layers // 2
        self.skip_weights = nn.Parameter(torch.ones(args.num_layers - self.num_encoder_layers))
        self.head = LossHead(dim, vocab, args.logit_softcap)

    def value_embed_for_layers(self, input_ids: Tensor) -> list[Tensor | None]:
        """Value embedding i feeds layer i and layer L-k+i: the first and last k layers get one each."""
        embeds = [ve(input_ids) for ve in self.value_embeds]
        k, layers = len(embeds), len(self.blocks)
        return embeds + [None] * (layers - 2 * k) + embeds

    def forward(self, input_ids: Tensor, target_ids: Tensor, masks: list, reduction: str = "mean") -> Tensor:
        """input_ids, target_ids: (T,) one packed sequence; masks: one attention mask per layer."""
        input_ids, target_ids = input_ids[None], target_ids[None]
        x = x0 = norm(self.embed(input_ids))
        value_embeds = self.value_embed_for_layers(input_ids)
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= self.num_encoder_layers and skips:  # U-net: decoder layers take encoder outputs back
                x = x + self.skip_weights[i - self.num_encoder_layers] * skips.pop()
            x = block(x, x0, value_embeds[i], masks[i])
            if i < self.num_encoder_layers:
                skips.append(x)
        return self.head(x, target_ids, reduction)


def compile_model(model: GPT, backend: str = "inductor"):
    """Compile each block and the loss head on their own, not the whole model. Backward then runs
    graph by graph, so the gradient hooks of the lm_head and of each block fire as soon as that part
    is done and DistAdam's reduce-scatters overlap the rest of backward; a whole-model graph would
    hold every gradient back until the very end."""
    for block in model.blocks:
        block.compile(backend=backend, dynamic=False)
    model.head.compile(backend=backend, dynamic=False)


def layer_windows(args: Hyperparameters, long_window: int) -> list[int]:
    short = max(args.window_block, long_window // 2 // args.window_block * args.window_block)
    return [long_window if (i % args.long_window_every == 0 or i == args.num_layers - 1) else short
            for i in range(args.num_layers)]


def build_masks(tokens: Tensor, windows: list[int], args: Hyperparameters) -> list:
    """One mask per layer; layers with the same window share one."""
    docs = document_ids(tokens, BOS_ID)
    by_window = {}
    for w in set(windows):
        by_window[w] = (flex_block_mask(docs, w, args.window_block) if tokens.is_cuda
                        else dense_attention_mask(docs, w))
    return [by_window[w] for w in windows]


# -----------------------------------------------------------------------------
# Muon: momentum, then Newton-Schulz orthogonalisation, for the hidden matrices

# Quintic Newton-Schulz coefficients published with Muon (Keller Jordan, 2024): they push every
# singular value of the normalised matrix into roughly [0.7, 1.2] in five steps.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately U V^T of g = U S V^T; bf16 on GPUs, where it runs on tensor cores."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    transposed = x.size(0) > x.size(1)
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum + orthogonalised update for 2-D hidden matrices.

    Distributed: parameters are dealt out round-robin in chunks of world_size same-shape matrices.
    One reduce-scatter per chunk hands each rank the mean gradient of the matrix it owns; it
    keeps that matrix's momentum, orthogonalises and updates it, and an all-gather shares the
    result. At world size 1 there is no communication.
    """

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices; got a parameter of shape {tuple(p.shape)}")

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
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        update = orthogonalize(update, group["ns_steps"], self.ns_dtype).to(p.dtype)
        scale = max(1.0, p.size(0) / p.size(1)) ** 0.5  # tall matrices: keep the per-entry RMS comparable
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * scale)

    @torch.no_grad()
    def step(self):
        if not distributed():
            for group, params in self._chunks(1):
                for p in params:
                    if p.grad is not None:
                        self._update(p, p.grad.float(), group)
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        chunks = list(self._chunks(world_size))
        pending = []
        for group, params in chunks:  # launch every reduce-scatter first, then compute while they fly
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
    locally, so k micro-batches cost one reduce-scatter per bucket per step. At world size 1 there
    are no hooks and no collectives. Weight decay is decoupled (AdamW).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, small_numel: int = 4096):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.world_size = dist.get_world_size() if distributed() else 1
        self.rank = dist.get_rank() if distributed() else 0
        self._sync = True
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
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        update = state["exp_avg"] / denom
        if group["weight_decay"]:
            param_shard.mul_(1 - group["lr"] * group["weight_decay"])
        param_shard.add_(update.to(param_shard.dtype), alpha=-group["lr"] / (1 - beta1 ** step))

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
                if bucket.work is None:  # some gradient never arrived (an unused parameter): reduce zeros
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
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict):
        if state_dict["world_size"] != self.world_size or len(state_dict["buckets"]) != len(self.buckets):
            raise ValueError(f"DistAdam state was saved at world size {state_dict['world_size']} with "
                             f"{len(state_dict['buckets'])} buckets; this one has {self.world_size} and {len(self.buckets)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.state.clear()
        for bucket, saved in zip(self.buckets, state_dict["buckets"]):
            if saved:
                device = bucket.params[0].device
                self.state[bucket.params[0]] = {k: v.to(device, copy=True) if isinstance(v, Tensor) else v
                                                for k, v in saved.items()}


# -----------------------------------------------------------------------------
# Data: token shards and the distributed loader

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
BOS_ID = 50256  # <|endoftext|> starts every document
FETCH_HINT = ("fetch FineWeb with `python data/cached_fineweb10B.py`, or rebuild the bundled corpus with "
              "`python data/tokenize_text.py --preset shakespeare --overwrite`")


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


def read_shard(path) -> Tensor:
    """All tokens of a shard as a uint16 tensor, after the header checks."""
    num_tokens = read_shard_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=num_tokens, offset=SHARD_HEADER_INTS * 4)
    return torch.from_numpy(tokens.astype(np.uint16, copy=False))


def find_shards(pattern: str, what: str) -> list[Path]:
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise DataError(f"no {what} shards match {pattern!r}: {FETCH_HINT}")
    return files


class TrainLoader:
    """Walks the training shards as one token stream.

    Step s consumes batch_tokens consecutive tokens, cut into micro-batches of micro_batch_tokens;
    micro-batch m of rank r is chunk m * world_size + r. Every step therefore sees the same tokens
    whatever the world size. At the end of the last shard it wraps to the first.
    """

    def __init__(self, pattern: str, batch_tokens: int, micro_tokens: int, env: DistEnv):
        self.files = find_shards(pattern, "training")
        for f in self.files:
            if read_shard_header(f) < batch_tokens + 1:
                raise DataError(f"{f}: holds fewer tokens than one step needs ({batch_tokens + 1})")
        self.batch_tokens, self.micro_tokens, self.env = batch_tokens, micro_tokens, env
        self.file_index, self.position = 0, 0
        self.tokens = None

    def state_dict(self) -> dict:
        return {"file_index": self.file_index, "position": self.position}

    def load_state_dict(self, state: dict):
        self.file_index, self.position, self.tokens = int(state["file_index"]), int(state["position"]), None

    def next_batch(self) -> list[tuple[Tensor, Tensor]]:
        if self.tokens is None:
            self.tokens = read_shard(self.files[self.file_index])
        if self.position + self.batch_tokens + 1 > len(self.tokens):
            self.file_index = (self.file_index + 1) % len(self.files)
            self.position, self.tokens = 0, read_shard(self.files[self.file_index])
        batch = rank_micro_batches(self.tokens, self.position, self.micro_tokens, self.batch_tokens, self.env)
        self.position += self.batch_tokens
        return batch


class SyntheticLoader:
    """Random tokens with BOS at web-like document lengths, for benchmarks that need no download."""

    def __init__(self, batch_tokens: int, micro_tokens: int, env: DistEnv, seed: int):
        self.batch_tokens, self.micro_tokens, self.env, self.seed = batch_tokens, micro_tokens, env, seed
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict):
        self.step = int(state.get("step", 0))

    def next_batch(self) -> list[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        self.step += 1
        tokens = torch.randint(0, BOS_ID, (self.batch_tokens + 1,), generator=generator)
        # FineWeb documents average roughly a thousand GPT-2 tokens with a long tail: exponential lengths.
        lengths = torch.empty(self.batch_tokens // 64).exponential_(1 / 1000, generator=generator).long() + 1
        starts = lengths.cumsum(0)
        tokens[starts[starts < self.batch_tokens]] = BOS_ID
        return rank_micro_batches(tokens, 0, self.micro_tokens, self.batch_tokens, self.env)


def rank_micro_batches(tokens: Tensor, start: int, micro_tokens: int, batch_tokens: int,
                       env: DistEnv) -> list[tuple[Tensor, Tensor]]:
    """This rank's (inputs, targets) micro-batches of the step whose tokens begin at `start`."""
    batch = []
    for chunk in range(env.rank, batch_tokens // micro_tokens, env.world_size):
        lo = start + chunk * micro_tokens
        buf = to_device(tokens[lo:lo + micro_tokens + 1], env.device)
        batch.append((buf[:-1], buf[1:]))
    return batch


def to_device(tokens: Tensor, device: torch.device) -> Tensor:
    """uint16 host tokens to int64 on the device; pinned memory lets the copy overlap compute."""
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True).long()
    return tokens.long()


def load_val_tokens(args: Hyperparameters) -> Tensor:
    """Exactly val_tokens (+1 for the last target) from the start of the validation shards."""
    needed = args.val_tokens + 1
    parts, total = [], 0
    files = find_shards(args.val_files, "validation")
    for f in files:
        if total >= needed:
            break
        tokens = read_shard(f)
        parts.append(tokens[:needed - total])
        total += len(parts[-1])
    if total < needed:
        raise DataError(f"validation shards {args.val_files!r} hold {total} tokens, fewer than "
                        f"--val_tokens={args.val_tokens} (+1)")
    return torch.cat(parts)


# -----------------------------------------------------------------------------
# Schedules: learning rate, Muon momentum, attention windows

def lr_multiplier(step: int, args: Hyperparameters) -> float:
    """Flat, then a linear decay to final_lr_frac over the last cooldown_frac of the steps."""
    progress = step / args.num_iterations
    if progress < 1 - args.cooldown_frac:
        return 1.0
    decay = (1 - progress) / args.cooldown_frac
    return decay + (1 - decay) * args.final_lr_frac


def muon_momentum(step: int, args: Hyperparameters) -> float:
    frac = min(step / args.muon_momentum_warmup, 1.0) if args.muon_momentum_warmup else 1.0
    return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum_end


def long_window(step: int, args: Hyperparameters) -> int:
    """Grows linearly from window_min to window_max in multiples of window_block."""
    frac = step / args.num_iterations
    blocks_min, blocks_max = args.window_min // args.window_block, args.window_max // args.window_block
    return args.window_block * round(blocks_min + frac * (blocks_max - blocks_min))


# -----------------------------------------------------------------------------
# Optimizer setup and one training step

def build_optimizers(model: GPT, args: Hyperparameters) -> tuple[Muon, DistAdam]:
    matrices = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
    scalars = [p for block in model.blocks for p in block.parameters() if p.ndim < 2] + [model.skip_weights]
    embeddings = [model.embed.weight] + [ve.weight for ve in model.value_embeds]
    betas, eps = (args.adam_beta1, args.adam_beta2), args.adam_eps
    adam = DistAdam([dict(params=embeddings, lr=args.embed_lr), dict(params=[model.head.lm_head.weight], lr=args.head_lr),
                     dict(params=scalars, lr=args.scalar_lr)], betas=betas, eps=eps)
    # CPUs have no bf16 matrix units; there fp32 also keeps runs at different world sizes in step
    # (bf16 rounding would amplify the last-bit differences of reduction order).
    ns_dtype = torch.bfloat16 if model.embed.weight.is_cuda else torch.float32
    muon = Muon(matrices, lr=args.muon_lr, momentum=args.muon_momentum_start, ns_dtype=ns_dtype)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    covered = sum(p.numel() for p in matrices + scalars + embeddings) + model.head.lm_head.weight.numel()
    if covered != sum(p.numel() for p in model.parameters()):
        raise RuntimeError("every parameter must belong to exactly one optimizer")
    return muon, adam


def set_schedules(step: int, optimizers, args: Hyperparameters):
    multiplier = lr_multiplier(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    for group in optimizers[0].param_groups:
        group["momentum"] = muon_momentum(step, args)


def train_step(model: GPT, optimizers, batch, windows: list[int], args: Hyperparameters) -> Tensor:
    """Forward/backward over this rank's micro-batches, then both optimizer steps. No host sync."""
    muon, adam = optimizers
    total_loss = torch.zeros((), device=batch[0][0].device)
    for i, (inputs, targets) in enumerate(batch):
        last = i == len(batch) - 1
        with contextlib.nullcontext() if last else adam.no_sync():
            loss = model(inputs, targets, build_masks(inputs, windows, args)) / len(batch)
            loss.backward()
        total_loss += loss.detach()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return total_loss


@torch.no_grad()
def evaluate(model, tokens: Tensor, windows: list[int], args: Hyperparameters, env: DistEnv) -> float:
    """Mean loss over the len(tokens) - 1 predictions of `tokens` (val_tokens + 1 of them in a real
    validation), in sequences of val_seq_len dealt out over the ranks."""
    model.eval()
    num_seqs = (len(tokens) - 1) // args.val_seq_len
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    for seq in range(env.rank, num_seqs, env.world_size):
        buf = to_device(tokens[seq * args.val_seq_len:(seq + 1) * args.val_seq_len + 1], env.device)
        inputs, targets = buf[:-1], buf[1:]
        loss_sum += model(inputs, targets, build_masks(inputs, windows, args), reduction="sum").double()
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


def model_flops_per_token(args: Hyperparameters, model: GPT, tokens: Tensor, long_window: int) -> float:
    """6 FLOPs per matmul weight (forward 2, backward 4) plus attention: per layer, 12 * width FLOPs for
    each key a token attends to, which is min(position in its document + 1, the layer's window)."""
    matmul_params = sum(p.numel() for p in model.blocks.parameters() if p.ndim == 2)
    matmul_params += model.head.lm_head.weight.numel()
    index = np.arange(len(tokens))
    doc_start = np.maximum.accumulate(np.where(tokens.cpu().numpy() == BOS_ID, index, 0))
    keys_in_doc = index - doc_start + 1
    attention = sum(12 * args.model_dim * np.minimum(keys_in_doc, w).mean() for w in layer_windows(args, long_window))
    return 6 * matmul_params + float(attention)


# -----------------------------------------------------------------------------
# Checkpoints: atomic, per-rank optimizer shards, refused when they don't match

def code_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def config_for_checkpoint(args: Hyperparameters) -> dict:
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in RUN_CONTROL_FIELDS}


def save_checkpoint(step: int, train_time_ms: float, model: GPT, optimizers, loader, args: Hyperparameters,
                    env: DistEnv, source: str, run_id: str) -> Path:
    """checkpoint_dir/<run_id>/step_NNNNNN/: model.pt (rank 0), rank_R.pt (each rank's optimizer shards),
    meta.json written last. Everything goes to a temporary folder renamed at the end, so a crash
    mid-save never leaves a checkpoint that looks complete."""
    run_dir = Path(args.checkpoint_dir) / run_id
    final = run_dir / f"step_{step:06d}"
    tmp = run_dir / f".step_{step:06d}.partial"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if env.world_size > 1:
        dist.barrier()
    rank_state = {"optimizers": [opt.state_dict() for opt in optimizers],
                  "cpu_rng": torch.get_rng_state(),
                  "cuda_rng": torch.cuda.get_rng_state() if env.device.type == "cuda" else torch.empty(0)}
    torch.save(rank_state, tmp / f"rank_{env.rank}.pt")
    if env.is_main:
        torch.save(model.state_dict(), tmp / "model.pt")
    if env.world_size > 1:
        dist.barrier()
    if env.is_main:
        meta = {"step": step, "train_time_ms": train_time_ms, "world_size": env.world_size,
                "loader": loader.state_dict(), "config": config_for_checkpoint(args), "code_sha256": code_hash(source)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = run_dir / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, run_dir / "latest")
    if env.world_size > 1:
        dist.barrier()
    return final


def resolve_checkpoint(resume: str, args: Hyperparameters) -> Path:
    if resume == "latest":
        pointers = sorted(Path(args.checkpoint_dir).glob("*/latest"), key=lambda p: p.stat().st_mtime)
        if not pointers:
            raise TrainingError(f"--resume=latest: no checkpoint under {args.checkpoint_dir}/")
        return pointers[-1].parent / pointers[-1].read_text().strip()
    return Path(resume)


def check_checkpoint(path: Path, args: Hyperparameters, env: DistEnv, source: str) -> dict:
    """The checkpoint's meta.json, if it belongs to this run; runs before any training work."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise TrainingError(f"--resume={path}: not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise TrainingError(f"--resume={path}: unreadable meta.json ({e})") from None
    if meta["world_size"] != env.world_size:
        raise TrainingError(f"--resume={path}: written at world size {meta['world_size']}, this run has "
                            f"{env.world_size}; DistAdam and Muon state are sharded per rank, so resume with "
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
    return meta


def load_checkpoint(path: Path, meta: dict, model: GPT, optimizers, loader, env: DistEnv) -> tuple[int, float]:
    try:  # weights_only: a checkpoint can hold tensors and plain containers, never code
        model_state = torch.load(path / "model.pt", map_location=env.device, weights_only=True)
        rank_state = torch.load(path / f"rank_{env.rank}.pt", map_location=env.device, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(f"--resume={path}: cannot load the checkpoint safely ({first})") from None
    model.load_state_dict(model_state)
    for opt, state in zip(optimizers, rank_state["optimizers"]):
        opt.load_state_dict(state)
    torch.set_rng_state(rank_state["cpu_rng"].cpu())
    if env.device.type == "cuda" and rank_state["cuda_rng"].numel():
        torch.cuda.set_rng_state(rank_state["cuda_rng"].cpu())
    loader.load_state_dict(meta["loader"])
    return meta["step"], meta["train_time_ms"]


# -----------------------------------------------------------------------------
# Logging: the log file starts with this file's source, then versions, hardware and config

class Logger:
    """Rank 0 writes logs/<run_id>.txt and the console; every line is flushed as written."""

    def __init__(self, path: Path | None):
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "x", encoding="utf-8")  # never overwrite another run's log

    def __call__(self, line: str = "", console: bool = True):
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
            if console:
                print(line, flush=True)

    def close(self):
        if self.file is not None:
            os.fsync(self.file.fileno())
            self.file.close()


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def log_header(log: Logger, source: str, args: Hyperparameters, env: DistEnv, run_id: str):
    log(source, console=False)
    log("=" * 100, console=False)
    log(f"Running Python {sys.version}")
    log(f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda or 'none'}")
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.machine()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    log(f"device: {env.device.type} ({device_name})  world_size: {env.world_size}  "
        f"backend: {dist.get_backend() if distributed() else 'none'}  date: {now}")
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


def build_model(args: Hyperparameters, env: DistEnv) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(args).to(env.device)
    if env.device.type == "cuda":
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.bfloat16()  # bf16 tables; CastedLinear multiplies in bf16 from fp32 masters
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

    # Everything that can fail on bad input happens before the first collective of training,
    # and all ranks agree on it, so one rank's error never leaves the others waiting.
    log, error = Logger(None), None
    try:
        loader = (SyntheticLoader(args.batch_tokens, args.micro_batch_tokens, env, args.seed)
                  if args.synthetic else TrainLoader(args.train_files, args.batch_tokens, args.micro_batch_tokens, env))
        val_tokens = (torch.randint(0, BOS_ID, (args.val_tokens + 1,), generator=torch.Generator().manual_seed(0))
                      if args.synthetic else load_val_tokens(args))
        if env.is_main:  # the log is created last: bad input never leaves one behind
            log_path = Path(args.logs_dir) / f"{run_id}.txt"
            if log_path.exists():
                raise ConfigError(f"--run_id={run_id}: {log_path} already exists; choose another run id")
            try:
                log = Logger(log_path)
            except OSError as e:
                raise ConfigError(f"--logs_dir={args.logs_dir}: cannot write the log ({e.strerror})") from None
        resume = None
        if args.resume:
            path = resolve_checkpoint(args.resume, args)
            resume = path, check_checkpoint(path, args, env, source)
    except (ConfigError, DataError, TrainingError) as e:
        error = e
    if not all_ranks_ok(error is None, env.device):
        if error is None:
            error = TrainingError("another rank failed during setup")
        log.close()
        raise error

    try:
        log_header(log, source, args, env, run_id)
        run_training(args, env, log, loader, val_tokens, source, run_id, resume)
    except Exception as e:  # the log says how the run ended, whatever ended it
        log(f"error: {type(e).__name__ + ': ' if not isinstance(e, TrainingError) else ''}{e}", console=False)
        raise
    finally:
        log.close()


def run_training(args: Hyperparameters, env: DistEnv, log: Logger, loader, val_tokens: Tensor, source: str,
                 run_id: str, resume: tuple[Path, dict] | None):
    model = build_model(args, env)
    if args.compile:
        compile_model(model)
    optimizers = build_optimizers(model, args)
    initial_loader = loader.state_dict()
    val_steps = [s for s in range(args.num_iterations + 1)
                 if s == args.num_iterations or (args.val_loss_every and s % args.val_loss_every == 0)]

    # Untimed warmup. Compiled on CUDA, every attention-window size is its own kernel: run one train
    # step per window the schedule reaches and one validation per window a validation sees. Then
    # put model, optimizers and data back where they started.
    if args.warmup_steps:
        initial_model = {k: v.clone() for k, v in model.state_dict().items()}
        initial_optimizers = [opt.state_dict() for opt in optimizers]
        compiled_on_cuda = args.compile and env.device.type == "cuda"
        train_windows = sorted({long_window(s, args) for s in range(args.num_iterations)})
        val_windows = sorted({long_window(s, args) for s in val_steps})
        if not compiled_on_cuda:
            train_windows, val_windows = train_windows[:1] * args.warmup_steps, val_windows[-1:]
        for window in train_windows:
            train_step(model, optimizers, loader.next_batch(), layer_windows(args, window), args)
        for window in val_windows:
            evaluate(model, val_tokens[:args.val_seq_len * env.world_size + 1], layer_windows(args, window), args, env)
        model.load_state_dict(initial_model)
        for opt, state in zip(optimizers, initial_optimizers):
            opt.load_state_dict(state)
        loader.load_state_dict(initial_loader)

    # Performance accounting, set up before the clock starts.
    matmul_dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    peak_flops = matmul_peak_flops(env.device, matmul_dtype)
    sample = loader.next_batch()[0][0]
    loader.load_state_dict(initial_loader)
    steps_per_window = collections.Counter(long_window(s, args) for s in range(args.num_iterations))
    flops_per_token = sum(n * model_flops_per_token(args, model, sample, w)  # averaged over the schedule
                          for w, n in steps_per_window.items()) / args.num_iterations
    step_ms: list[float] = []

    start_step, train_time_ms = 0, 0.0
    if resume:
        path, meta = resume
        error = None
        try:
            start_step, train_time_ms = load_checkpoint(path, meta, model, optimizers, loader, env)
        except TrainingError as e:
            error = e
        if not all_ranks_ok(error is None, env.device):  # one rank's bad file stops them all
            raise error or TrainingError("another rank could not load the checkpoint")
        log(f"resumed from {path} at step {start_step}")

    sync(env.device)
    t0 = time.perf_counter()
    train_loss_sum, train_loss_steps = torch.zeros((), device=env.device), 0
    final_val_loss = float("nan")
    for step in range(start_step, args.num_iterations + 1):
        last_step = step == args.num_iterations
        if step in val_steps:
            sync(env.device)
            train_time_ms += 1000 * (time.perf_counter() - t0)  # the clock stops for validation
            final_val_loss = evaluate(model, val_tokens, layer_windows(args, long_window(step, args)), args, env)
            log(format_step(step, args, train_time_ms, val_loss=final_val_loss))
            check_finite(final_val_loss, "val loss", step)
            sync(env.device)
            t0 = time.perf_counter()
        if args.save_every and step > start_step and step % args.save_every == 0:
            sync(env.device)
            train_time_ms += 1000 * (time.perf_counter() - t0)  # nor for saving
            path = save_checkpoint(step, train_time_ms, model, optimizers, loader, args, env, source, run_id)
            log(f"checkpoint: {path}", console=False)
            sync(env.device)
            t0 = time.perf_counter()
        if last_step:
            break

        step_start = time.perf_counter()
        set_schedules(step, optimizers, args)
        loss = train_step(model, optimizers, loader.next_batch(), layer_windows(args, long_window(step, args)), args)
        train_loss_sum += loss
        train_loss_steps += 1

        sync(env.device)
        step_end = time.perf_counter()
        step_ms.append(1000 * (step_end - step_start))
        now_ms = train_time_ms + 1000 * (step_end - t0)
        if args.train_loss_every and (step + 1) % args.train_loss_every == 0:
            if env.world_size > 1:  # every rank sees the same value, so all stop together on a NaN
                dist.all_reduce(train_loss_sum)
                train_loss_sum /= env.world_size
            train_loss = train_loss_sum.item() / train_loss_steps
            train_loss_sum.zero_()
            train_loss_steps = 0
            log(format_step(step + 1, args, now_ms, train_loss=train_loss))
            check_finite(train_loss, "train loss", step + 1)
        else:
            log(format_step(step + 1, args, now_ms))

    if env.device.type == "cuda":
        peak_memory = torch.cuda.max_memory_allocated() // 2**20
        log(f"peak memory allocated: {peak_memory} MiB reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    else:
        peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux

    def mfu(tokens_per_s: float) -> float:
        return 100 * flops_per_token * tokens_per_s / (peak_flops * env.world_size)

    if step_ms:  # the median step: what a benchmark compares
        median_ms = float(np.median(step_ms))
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


def stop_on_sigterm(signum, frame):
    # torchrun sends SIGTERM to the surviving ranks when one fails: end through the normal error
    # path so the log says how the run ended.
    raise TrainingError(f"stopped by {signal.Signals(signum).name} (torchrun stops every rank when one fails)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        args = parse_args(argv, torch.cuda.is_available())
        env = setup_distributed(args)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        train(args, env)
        return 0
    except (ConfigError, DataError) as e:  # the same on every rank: rank 0 speaks for all
        if env.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error [rank {env.rank}]: {e}", file=sys.stderr)
        return 1
    except dist.DistError as e:  # a peer died or a collective timed out
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error [rank {env.rank}]: a collective failed, another rank probably died: {first_line}",
              file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""train_gpt.py: the NanoGPT speedrun trainer in one file.

Trains a GPT-2-small-class model on FineWeb10B to 3.28 val loss as fast as 8xH100 allow, with the
learning algorithm of public modded-nanogpt record #89 (2026-07-17, "FP8 down projection", as merged upstream:
record #85 v3's "MUDD gates and lightweight DC" with #88's prefix-token loss and #89's FP8 down-projection,
1,285 steps; --preset=record85 keeps #85 v3's) rewritten in plain PyTorch: FlexAttention instead of
FlashAttention-3, torch._scaled_mm and PyTorch ops instead of Triton and CUDA kernels. notes/recipe.md lists
every component next to the record's value. The same file runs on
one GPU (gradient accumulation keeps the global batch), on several nodes (torchrun rendezvous) and
on CPU (gloo, the `smoke` preset on the bundled corpus).

    torchrun --standalone --nproc_per_node=8 train_gpt.py            # the record run
    python train_gpt.py --preset=smoke                                # CPU, ~2 minutes

Read top to bottom. The math first: the settings and what they derive (the stage schedule, the layer plan);
the model; the optimizers (NorMuon or ANVIL, DistAdam; NgramAdam and the traffic of record #92's sharded n-gram
table); one training step and evaluation. Then what keeps a run safe and measured: command-line and config
checks, distributed setup, files (one reader and one writer), data, performance accounting, the memory model,
checkpoints, logging, main(). Importing this file has no side effects.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import fnmatch
import functools
import gc
import glob
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import platform
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

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
# Settings: one dataclass and named presets; what they derive, each in one place: the stage schedule
# (Schedule) and the layer plan (layer_plan)

def _help(text: str, default):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)  # the config never changes after parsing: a resolved one is a copy (dataclasses.replace)
class Hyperparameters:
    preset: str = _help("named set of values: speedrun (record #92's algorithm, 8xH100), record89 (record #89's: "
                        "these defaults), record85 (record #85 v3's) or smoke (CPU, bundled corpus)", "speedrun")
    # data
    train_files: str = _help("glob of training shards", "data/fineweb10B/fineweb_train_*.bin")
    val_files: str = _help("glob of validation shards", "data/fineweb10B/fineweb_val_*.bin")
    val_tokens: int = _help("tokens per validation, exactly; the standard speedrun uses 10M", 10_485_760)
    val_seq_len: int = _help("tokens per validation sequence (record #85: 262,144)", 262_144)
    synthetic: bool = _help("feed synthetic tokens with web-like document lengths instead of shards (benchmarks)", False)
    repeat_data: bool = _help("when the training shards supply fewer steps than num_iterations, start over from "
                              "the first shard (each time logged) instead of refusing to run", False)
    packing: str = _help("how a training shard becomes micro-batches: auto (what its header asks: documents for "
                         "FineWeb's, stream for data/tokenize_text.py's), documents (record #85's rule: each "
                         "micro-batch starts at a document, which gives its first max_seq_len tokens) or stream "
                         "(consecutive runs of tokens: every token trained on)", "auto")
    # the schedule: three stages of equal length, then the extension (lists hold one value per stage)
    num_iterations: int = _help("optimizer steps in all: the scheduled ones, then the extension", 1285)
    extension_steps: int = _help("last steps, run at the final lr and windows of the extension", 15)
    stage_fractions: str = _help("per stage: its share of the scheduled steps less --grown_steps, the shares "
                                 "summing to 1 and used as written (a stage ends at round(sum of the shares so "
                                 "far * steps)); empty: stages of equal length", "")
    grown_steps: int = _help("scheduled steps added to stage --grown_stage after the shares have cut the rest "
                             "(record #92 grows stage 2 by 52); the cooldown spans all scheduled steps", 0)
    grown_stage: int = _help("the stage --grown_steps lengthens (0-based)", 0)
    stage_batch_tokens: str = _help("tokens per optimizer step in each stage, over all ranks (the extension keeps "
                                    "the last, unless --extension_batch_tokens)", "131072,262144,393216")
    extension_batch_tokens: int = _help("tokens per optimizer step in the extension (0: the last stage's)", 0)
    micro_batches: str = _help("micro-batches per step, dealt out over the ranks; each holds batch/micro_batches "
                               "tokens, so every world size trains on the same tokens. One count, one per stage "
                               "(the extension keeps the last), or auto: per stage, the fewest (the largest "
                               "micro-batches) that the memory model fits into the device (--memory_limit_gib)", "8")
    memory_limit_gib: float = _help("per-rank memory the run must fit, in GiB, of which the memory model's "
                                    "predicted peaks may take 85%; 0: the GPU's own memory (on CPU, the host's "
                                    "physical memory shared by its ranks). Every run's weights, gradients and "
                                    "optimizer state are checked; each phase's peak on a GPU, and on CPU with this "
                                    "flag or --micro_batches=auto", 0.0)
    stage_max_seq_len: str = _help("per stage: a training document contributes at most its first N tokens",
                                   "896,2048,2048")
    stage_windows: str = _help("per stage: short:long attention windows in blocks of window_block tokens",
                               "1:3,3:7,5:11")
    extension_windows: str = _help("short:long windows of the extension", "6:13")
    final_val_window: int = _help("long window of the final validation (YaRN stays fitted to the extension's)", 20)
    stage_lr: str = _help("per stage: learning-rate multiplier before the cooldown", "1.0,1.52,1.73")
    stage_mtp_weights: str = _help("per stage ('/' between stages): weights of the losses of the next 1, 2, 3... "
                                   "tokens, moving linearly from the values before '>' to those after it over the "
                                   "stage; the extension keeps the last", "1,0.5,0.25>1,0.5,0/1,0.5>1,0/1>1")
    stage_prefix_weights: str = _help("per stage: weight of the prefix-token loss (record #88: each row also "
                                      "predicts the longest proper byte prefix of its next token that is a token), "
                                      "moving linearly from the value before '>' to the one after it over the stage, "
                                      "or a|b|c...: a over the stage's first equal part, b over the next (record "
                                      "#92); the extension keeps the last; all 0: no prefix term", "0.25,0.25>0,0")
    stage_softmax_candidates: str = _help("per stage: the training loss's softmax over this many candidate classes "
                                          "(record #92's sampled softmax: each micro-batch's targets, then "
                                          "deterministic negatives; the lm_head learns on those columns only), a "
                                          "multiple of 16; 0 (or the padded vocabulary or more): the whole "
                                          "vocabulary. A stage of several counts joined "
                                          "by '|' runs them in equal parts of it (record #92's third stage: "
                                          "14336|14336|24576); one entry for every stage or one per stage; the "
                                          "extension keeps the last. Validation always uses the whole vocabulary",
                                          "0")
    cooldown_frac: float = _help("the lr multiplier moves linearly to final_lr_frac over this last fraction of the "
                                 "scheduled steps", 0.6)
    final_lr_frac: float = _help("lr multiplier at the end of the cooldown and in the extension", 0.15)
    tail_ships: bool = _help("record #92's terminal ships: the run ends with blends of averages of its weights over "
                             "its last steps (TailShips)", False)
    untie_stage: int = _help("the embedding is tied to the lm_head until the first Adam step of this stage "
                             "(0-based; the number of stages: the extension; more: never untied)", 2)
    # model
    vocab_size: int = _help("GPT-2 vocabulary; the embedding is padded to a multiple of 128", 50_257)
    num_layers: int = _help("transformer layers", 11)
    model_dim: int = _help("residual stream width", 768)
    head_dim: int = _help("attention head size; heads = model_dim / head_dim (an even number)", 128)
    mlp_ratio: int = _help("MLP hidden width / model_dim (see --mlp_hidden)", 4)
    mlp_hidden: int = _help("MLP hidden width; 0: mlp_ratio * model_dim (record #92: 2816, which no integer ratio "
                            "of 768 gives)", 0)
    bigram_vocab_size: int = _help("rows of the hashed n-gram embedding table: with --ngram_channels=1 the bigram "
                                   "table's (the last row is a sequence's first token's); with 2 the whole table's, "
                                   "bigram rows in its first half, trigram rows in its second (record #92: "
                                   "84,602,880)", 50_304 * 15 // 2)
    bigram_sign_rows: int = _help("rows of the n-gram embedding's random +-1 sign table (a power of two with "
                                  "--ngram_channels=2)", 8192)
    ngram_channels: int = _help("1: record #85's bigram embedding (one table replicated on every rank, Adam like "
                                "the other embeddings); 2: record #92's n-gram table (bigram and trigram channels "
                                "hashed into one table of --bigram_vocab_size rows, sharded over the ranks, the rows "
                                "a step reads pulled from their owners, trained by a row-sparse Adam: beta1 = 0, one "
                                "second moment per row)", 1)
    no_attention_layers: str = _help("layers without attention: the skip target, where the gated skip replaces it, "
                                     "and any others, whose MLP still runs after the residual lambda and the "
                                     "injections (record #92: 4,6,9)", "6")
    removed_layers: str = _help("layers removed whole, attention and MLP: the stream only takes their residual "
                                "lambdas and injections (record #92: 7)", "")
    paired_layers: str = _help("layers whose heads attend in pairs over a doubled, interleaved sequence", "0,2,5,9")
    long_window_layers: str = _help("layers with the long window and the partial key offset", "3,10")
    xsa_layers: str = _help("layers that subtract a learned share of each head's output along its value", "1,3,4,7")
    attn_gate_layers: str = _help("layers whose head outputs are scaled by gates from the MUDD gate network", "3,10")
    dc_layers: str = _help("layers with the lightweight dynamically composable (DC) correction", "10")
    dc_window: int = _help("keys a DC query looks at, itself included", 112)
    value_embed_layers: str = _help("layers fed by a value embedding, one table each; the last is the MUDD layer, "
                                    "the first table also feeds the head", "1,2,8,9,10")
    skip_layers: str = _help("source:target of the gated skip (the target is a layer without attention)", "3:6")
    narrow_qk_layers: str = _help("layers whose queries and keys have --narrow_dim dims a head (record #92: "
                                  "0,1,2,5,8, its short-window layers): QK-norm and the dot products over those dims "
                                  "alone, at --narrow_attn_scale, with a rotary of their own", "")
    narrow_value_layers: str = _help("layers whose values, and the output projection's inputs, have --narrow_dim dims "
                                     "a head (record #92: 1,8)", "")
    narrow_dim: int = _help("the narrow heads' dims (--narrow_qk_layers, --narrow_value_layers): each reads the "
                            "first narrow_dim rows of its head's weights, the rest of which stay unread", 64)
    attn_scale: float = _help("attention logit scale of full-width heads at the first window; YaRN raises it "
                              "(record #92: 0.085)", 0.1)
    narrow_attn_scale: float = _help("attention logit scale of narrow heads at the first window (record #92: 0.13)",
                                     0.13)
    rotary_dims: int = _help("leading dims of each head that rotary turns, in pairs; the rest carry no position "
                             "(record #92: 64, all of a narrow head, half a full one); 0: half of --head_dim", 0)
    parallel_mlp_layers: str = _help("layers with a second MLP beside the first, reading the same normed input, "
                                     "added with the same post lambda (record #92: 8)", "")
    no_x0_layers: str = _help("layers without the x0 injection (record #92: 3,8,9)", "")
    no_bigram_layers: str = _help("layers without the bigram injection; layer 0's comes before the first layer "
                                  "(record #92: 2,3,7,8)", "")
    retired_gates: str = _help("gates kept though no layer reads them, as role:layer with role xsa, attn, dc (outputs "
                               "of the gate networks) or ve (a row of ve_gates): record #92 took layers 4, 7 and 9's "
                               "attention and layer 10's DC and kept their gates: xsa:4,xsa:7,dc:10,ve:9; they take "
                               "no gradient", "")
    head_mix: str = _help("states the stream adds before the final norm, each weighted by the second MUDD net, in "
                          "the order of its outputs: x0 (the stream's start), shared (the shared-input layer's "
                          "output), last (the last layer's input), skip (the skip source's output), ve<N> (value "
                          "embedding N's rows), mlp_in (the last layer's normed MLP input), shared_in (the normed "
                          "shared input the layers after it attend from) (record #92: x0,shared,last,ve0,skip,ve1,"
                          "ve3,ve2,mlp_in,shared_in)", "x0,shared,last,ve0,skip")
    head_mix_groups: int = _help("per-channel-group deltas of the head mix's weights: the model dim in this many "
                                 "groups, each weight plus a delta of its own per group (record #92: 12); 0: none",
                                 0)
    virtual_seq_cap: int = _help("training attention does not cross a boundary every N tokens of a document "
                                 "(record #92: 2560); everything else, rotary positions included, sees the whole "
                                 "document; validation has none; 0: none", 0)
    norm_eps: float = _help("eps of every RMS norm: the blocks', QK-norm, x0's and the final one (the records': "
                            "PyTorch's default, fp32's epsilon 2**-23, for their bf16 activations too)", 2 ** -23)
    shared_input_layer: int = _help("the layers after this one read their attention input from its output", 7)
    mudd_gate_layer: int = _help("the second MUDD gate network runs at the start of this layer", 4)
    logit_cap: float = _help("logits are squashed to (0, cap) with cap * sigmoid((x + shift) / width)", 23.0)
    logit_cap_width: float = _help("see logit_cap", 7.5)
    logit_cap_shift: float = _help("see logit_cap", 5.0)
    lm_head_precision: str = _help("auto (fp8 on GPUs of compute capability >= 8.9, else bf16 on GPUs, fp32 on CPU), "
                                   "fp8, bf16 or fp32; fp8 applies to training, evaluation uses bf16", "auto")
    mlp_precision: str = _help("the MLP up-projection's forward: auto (as lm_head_precision), fp8, bf16 or fp32; "
                               "its backward is in the weights' dtype", "auto")
    mlp_down_fp8: bool = _help("record #89: where the up-projection runs in FP8, the down-projection's forward does "
                               "too, with delayed scales (the activation's from the previous forward, the weight's "
                               "from the previous step); its backward is in the weights' dtype", True)
    mlp_full_fp8: bool = _help("record #92: where the up-projection runs in FP8, all of the MLP does, forward and "
                               "backward (the gradients in e5m2), at static scales for its input and its output's "
                               "gradient and delayed ones for the weights, relu^2's output and its gradient "
                               "(Fp8ReluSquaredMLP); in place of --mlp_down_fp8's", False)
    lm_head_fp8_logits: bool = _help("record #92's FP8 head, where the lm_head runs in FP8: the logits kept as e4m3 "
                                     "and their squashed values in fp16, the lm_head's copy at 2.0/448 and the "
                                     "logits' gradient at a scale 8 times smaller (HEAD_FP8_92)", False)
    # attention (windows in blocks of window_block tokens)
    attention: str = _help("auto (flex on CUDA, sdpa elsewhere), flex (FlexAttention block masks) or sdpa "
                           "(dense boolean mask)", "auto")
    window_block: int = _help("tokens per window block; FlexAttention's block size", 128)
    # optimization
    adam_lr: float = _help("Adam lr, times each parameter's multiplier (see ADAM_TABLE)", 0.008)
    adam_eps: float = _help("Adam epsilon", 1e-10)
    adam_weight_decay: float = _help("Adam's cautious weight decay, times lr^2 and each parameter's multiplier", 0.005)
    value_embed_lr_mul: float = _help("the value embeddings' Adam lr multiplier (record #92: 70)", 75.0)
    adam_every: int = _help("Adam steps every N steps, on the gradients of all N", 2)
    embed_adam_period: int = _help("from --embed_adam_period_start on, the value embeddings and the n-gram table "
                                   "take their Adam step every N steps instead (on the gradients of all N), with "
                                   "their betas raised to the power N / adam_every and their weight decay times "
                                   "N / adam_every (record #92: 4 from step 336); 0: at every Adam step throughout",
                                   0)
    embed_adam_period_start: int = _help("the step from which --embed_adam_period holds", 336)
    muon_lr: float = _help("NorMuon lr for the attention and MLP matrices", 0.023)
    muon_beta2: float = _help("NorMuon's per-neuron second-moment decay", 0.9)
    muon_weight_decay: float = _help("NorMuon's cautious weight decay, scaled by lr^2", 1.2)
    muon_momentum_start: float = _help("NorMuon momentum at step 0 and at the end", 0.85)
    muon_momentum_end: float = _help("NorMuon momentum between warmup and cooldown", 0.95)
    muon_momentum_warmup: int = _help("steps over which NorMuon momentum rises", 300)
    muon_momentum_cooldown: int = _help("last steps over which NorMuon momentum falls back", 50)
    matrix_optimizer: str = _help("the attention and MLP matrices' optimizer: normuon (record #89; the muon_* "
                                  "flags) or anvil (record #92: twin-rail velocity, six quintic maps, per-lane "
                                  "equalizer; the anvil_* flags)", "normuon")
    anvil_lr: float = _help("ANVIL lr for the attention and MLP matrices", 0.023)
    anvil_beta2: float = _help("ANVIL's per-lane energy decay", 0.9)
    anvil_weight_decay: float = _help("ANVIL's cautious weight decay (gated on the slow rail), scaled by lr^2", 2.25)
    anvil_beta_start: float = _help("ANVIL's rail beta (its Nesterov lookahead, and its fast rail's beta until "
                                    "--anvil_engage_step) at step 0 and at the end", 0.85)
    anvil_beta_end: float = _help("ANVIL's rail beta between warmup and cooldown", 0.93)
    anvil_beta_warmup: int = _help("steps over which ANVIL's rail beta rises", 240)
    anvil_beta_cooldown: int = _help("last steps over which ANVIL's rail beta falls back", 50)
    anvil_engage_step: int = _help("from this step ANVIL's fast rail runs at ANVIL_FAST_BETA and its velocity blends "
                                   "in the slow rail (ANVIL_BLEND); before it, the fast rail alone, on the rail beta",
                                   514)
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
    init_from: str = _help("start from the weights of a final-weights folder (--save_final=true, or "
                           "tools/record_weights.py to-ours); optimizer state, data and schedule start fresh", "")
    force_resume: bool = _help("resume even if the config or code differs from the checkpoint's", False)

    def __post_init__(self):
        # the config.json of older final weights holds an int
        object.__setattr__(self, "micro_batches", str(self.micro_batches))


# Record #92's schedule (modded-nanogpt 2026-09-28, "ANVIL2"; notes/recipe.md): three stages of batch 8, 16 and 24
# x 128Ki tokens over shares 0.2854 : 0.3209 : 0.3931 of 1,122 steps (normalised, the third less the taper's 0.06;
# written out as the record's floats, which the stage ends depend on), the third grown by 52 steps, a batch-20
# taper at the third's lr times sqrt(20 / 24), then 20 extension steps at batch 8; the cooldown over the last 80%
# of the 1,174 scheduled steps to 0.3; the prefix-token weight 0.25, then 0.2, 0.15, 0.1, 0.05 over stage 1's
# quarters; the embedding untied at the extension's first Adam step; the value embeddings' and the n-gram table's
# Adam every 4th step from step 336.
RECORD92_SCHEDULE = dict(
    num_iterations=1194, extension_steps=20, grown_steps=52, grown_stage=2,
    stage_fractions="0.28557134280568336,0.32109265559335604,0.33333600160096055,0.06",
    stage_batch_tokens="131072,262144,393216,327680", extension_batch_tokens=131072,
    stage_max_seq_len="896,2048,3072,3072", stage_windows="1:3,3:7,5:11,5:11", extension_windows="6:13",
    final_val_window=20, stage_lr=f"1.0,1.52,1.73,{1.73 * (20 / 24) ** 0.5!r}",
    stage_mtp_weights="1,0.5,0.25>1,0.5,0/1,0.5>1,0/1>1/1>1", stage_prefix_weights="0.25,0.2|0.15|0.1|0.05,0,0",
    cooldown_frac=0.8, final_lr_frac=0.3, untie_stage=4, embed_adam_period=4, embed_adam_period_start=336,
)

# Record #92's model (modded-nanogpt PR #360, "ANVIL2", 2026-09-28) as flag values. Its layer 7 is removed whole,
# layers 4 and 9 run their MLP alone, and seven layers attend: narrow queries and keys on the five short-window ones, narrow values on two of them, full
# width on the long-window 3 and 10; layer 8 has a second MLP; four value embeddings; the gate networks keep #89's
# layout (the retired gates); the head mix adds ten states with per-group deltas; attention segments of 2,560 tokens
# at most in training; every RMS norm with fp32's eps (record #92's PyTorch's default for bf16 too).
RECORD92_MODEL = dict(
    no_attention_layers="4,6,9", removed_layers="7", paired_layers="0,2,5", long_window_layers="3,10",
    xsa_layers="1,3", attn_gate_layers="3,10", dc_layers="", retired_gates="xsa:4,xsa:7,dc:10,ve:9",
    value_embed_layers="1,2,8,10", skip_layers="3:6", shared_input_layer=7, mudd_gate_layer=4,
    narrow_qk_layers="0,1,2,5,8", narrow_value_layers="1,8", narrow_dim=64, attn_scale=0.085, narrow_attn_scale=0.13,
    rotary_dims=64, mlp_hidden=2816, parallel_mlp_layers="8", no_x0_layers="3,8,9", no_bigram_layers="2,3,7,8",
    head_mix="x0,shared,last,ve0,skip,ve1,ve3,ve2,mlp_in,shared_in", head_mix_groups=12, virtual_seq_cap=2560,
    norm_eps=2 ** -23,
)


def flags_of(values: dict) -> list[str]:
    """A dict of field values (a preset's, RECORD92_MODEL) as command-line flags."""
    return [f"--{name}={value}" for name, value in values.items()]


# The rest of record #92's algorithm as flag values: the sampled softmax (10,240 candidates, then 14,336 and 24,576
# over thirds of its third stage, the full softmax from the taper), ANVIL, the hashed n-gram table at its size, the
# terminal ships, FP8 in the MLP's forward and backward and in the head's logits, the value embeddings' lr 70.
RECORD92_TRAINING = dict(
    stage_softmax_candidates="10240,10240,14336|14336|24576,0", matrix_optimizer="anvil", ngram_channels=2,
    bigram_vocab_size=84_602_880, tail_ships=True, mlp_full_fp8=True, lm_head_fp8_logits=True,
    value_embed_lr_mul=70.0,
)
RECORD92 = {**RECORD92_SCHEDULE, **RECORD92_MODEL, **RECORD92_TRAINING}

PRESETS: dict[str, dict] = {
    # The 8xH100 record configuration: record #92's algorithm (notes/recipe.md).
    "speedrun": RECORD92,
    # Record #89's algorithm (the dataclass defaults), the prior record, which a record claim runs on the same machine:
    # record #85 v3's, with #88's prefix-token loss, #89's FP8 down-projection and 1,270 + 15 steps.
    "record89": {},
    # Record #85 v3's algorithm, as its logs ran it: 1,275 + 15 steps, no prefix term, the down-projection in bf16.
    "record85": dict(num_iterations=1290, stage_prefix_weights="0,0,0", mlp_down_fp8=False),
    # A small model on the bundled Shakespeare shards: a CPU check of the whole pipeline with the speedrun's (record
    # #92's) structure scaled down: its 11-layer plan at width 64 (narrow heads of 8, MLPs of 240), three stages (no
    # growth, no taper) and an extension with growing batches, sequences, windows and candidate sets, the virtual
    # attention cap, multi-token and prefix-token losses, the sampled softmax, ANVIL, the sharded n-gram table on the
    # embeddings' 4-step cadence, tied then untied embeddings, the ships over the whole run.
    "smoke": {
        **RECORD92,
        **dict(
            train_files="data/shakespeare/shakespeare_train_*.bin",
            val_files="data/shakespeare/shakespeare_val_*.bin",
            val_tokens=8192, val_seq_len=1024,
            num_iterations=33, extension_steps=3, grown_steps=0, stage_fractions="",
            stage_batch_tokens="1024,2048,3072", extension_batch_tokens=1024, micro_batches="4",
            stage_max_seq_len="256,512,768", virtual_seq_cap=640, stage_windows="1:2,2:4,3:6",
            extension_windows="3:7", final_val_window=10, window_block=64, stage_lr="1.0,1.52,1.73",
            stage_mtp_weights="1,0.5,0.25>1,0.5,0/1,0.5>1,0/1>1", stage_prefix_weights="0.25,0.2|0.15|0.1|0.05,0",
            stage_softmax_candidates="2048,2048,2048|2048|3072",
            adam_lr=0.04, anvil_lr=0.06, anvil_beta_warmup=8, anvil_beta_cooldown=4, anvil_engage_step=15,
            embed_adam_period_start=12,
            model_dim=64, head_dim=16, narrow_dim=8, rotary_dims=8, mlp_hidden=240, head_mix_groups=4,
            bigram_vocab_size=50_400, bigram_sign_rows=1024,  # (rows: even, and split by every world size to 8)
            compile=False, warmup_steps=0, val_loss_every=10, train_loss_every=10,  # on CPU nothing compiles
        ),
    },
}


# Fields that steer one run without changing what it computes: a checkpoint may be
# resumed with different values of these.
RUN_CONTROL_FIELDS = ("run_id", "logs_dir", "pg_timeout_s", "save_every", "save_final", "checkpoint_dir",
                      "resume", "force_resume", "val_loss_every", "train_loss_every", "warmup_steps", "compile",
                      "init_from", "memory_limit_gib")


# The list flags, each read by one grammar (list_value) into the values the run uses, once per spelling: two spellings
# of one value are one setting. "0.25,0.25>0.0,0" is the default "0.25,0.25>0,0"; "1>1", a weight that does not move
# over its stage, is "1"; " 3, 10" is "3,10"; a role's layers are a set ("10,3" is "3,10"). The resume check compares
# these values (comparable_config), and records/records.py, which does not import this file, holds a copy of this
# grammar; tests/test_records_properties.py runs the same spellings through both. A truncated spelling ("1>", ">1",
# "1,,2", "1,") is refused, naming the flag. Kinds:
#   integers     comma-separated ints, in order ("" is none)         -> (int, ...)
#   layer set    comma-separated ints, as a set ("" is none)         -> (int, ...) sorted, each once
#   numbers      comma-separated finite numbers >= 0                 -> (float, ...)
#   windows      comma-separated short:long, 0 < short <= long       -> ((int, int), ...)
#   window       one short:long                                      -> (int, int)
#   layer pair   source:target                                       -> (int, int)
#   ramps        per stage, a number >= 0, start>end, or a|b|c      -> (((start, end), False) or ((a, b, c), True), ...)
#                (a|b|c: one weight for each equal part of the stage)
#   ramp lists   per stage ('/' between), numbers or start>end lists -> (((start, ...), (end, ...)), ...)
#   counts       per stage, an int >= 0, or a|b|c for equal parts     -> ((count, ...), ...)
LIST_FLAGS = {"stage_batch_tokens": "integers", "stage_max_seq_len": "integers", "stage_lr": "numbers",
              "stage_fractions": "numbers", "stage_windows": "windows", "extension_windows": "window",
              "stage_mtp_weights": "ramp lists", "stage_prefix_weights": "ramps",
              "stage_softmax_candidates": "counts", "skip_layers": "layer pair", "value_embed_layers": "integers",
              **{name: "layer set" for name in (
                  "no_attention_layers", "removed_layers", "paired_layers", "long_window_layers", "xsa_layers",
                  "attn_gate_layers", "dc_layers", "narrow_qk_layers", "narrow_value_layers", "parallel_mlp_layers",
                  "no_x0_layers", "no_bigram_layers")}}


def flag_list(args: Hyperparameters, name: str) -> tuple:
    """The value of the list flag `name` of args (list_value)."""
    return list_value(name, getattr(args, name))


@functools.lru_cache(maxsize=1024)
def list_value(name: str, text: str) -> tuple:
    """The value of the list flag `name` (LIST_FLAGS) spelled `text`, or a ConfigError naming the flag."""
    kind = LIST_FLAGS[name]

    def refuse(expected: str):
        raise ConfigError(f"--{name}={text}: {expected}")

    def integers(part: str) -> tuple[int, ...]:
        try:
            return tuple(int(item) for item in part.split(",")) if part.strip() else ()
        except ValueError:
            refuse("expected comma-separated integers, e.g. 0,7")

    def numbers(part: str) -> tuple[float, ...]:
        try:
            values = tuple(float(item) for item in part.split(","))
        except ValueError:
            refuse("expected comma-separated numbers")
        if not all(math.isfinite(v) and v >= 0 for v in values):
            refuse("expected finite numbers >= 0")
        return values

    def pair(part: str, windows: bool) -> tuple[int, int]:
        """short:long window blocks, or the skip's source:target (validate_layer_plan checks those layers)."""
        first, colon, second = part.partition(":")
        try:
            values = (int(first), int(second))
        except ValueError:
            values = None
        if not colon or values is None or windows and not 0 < values[0] <= values[1]:
            refuse("expected short:long window blocks, positive and short <= long, e.g. 1:3" if windows else
                   "expected source:target, e.g. 3:6")
        return values

    def ramp(stage: int, part: str) -> tuple[str, str]:
        """A stage's start>end, or its one value for both."""
        start, arrow, end = part.partition(">")
        if arrow and not (start.strip() and end.strip()) or ">" in end:
            what = "more than one" if ">" in end else f"nothing {'after' if start.strip() else 'before'} the"
            refuse(f"stage {stage + 1} ({part.strip()!r}) has {what} '>'; write start>end, or one value for a weight "
                   f"that does not move")
        return start, end if arrow else start

    if kind in ("integers", "layer set"):
        values = integers(text)
        return tuple(sorted(set(values))) if kind == "layer set" else values
    if kind == "numbers":
        return numbers(text)
    if kind == "windows":
        return tuple(pair(part, windows=True) for part in text.split(","))
    if kind in ("window", "layer pair"):
        return pair(text, windows=kind == "window")
    if kind == "counts":
        try:
            counts = tuple(tuple(int(item) for item in part.split("|")) for part in text.split(","))
        except ValueError:
            refuse("expected counts, one per stage, a stage's equal parts joined by '|', e.g. 10240,14336|24576")
        if min(min(entry) for entry in counts) < 0:
            refuse("counts must be 0 (the whole vocabulary) or positive")
        return counts
    if kind == "ramps":  # stages split at ',' (so each item below holds one number)
        return tuple((tuple(numbers(item)[0] for item in part.split("|")), True) if "|" in part else
                     (tuple(numbers(side)[0] for side in ramp(i, part)), False)
                     for i, part in enumerate(text.split(",")))
    # ramp lists: stages split at '/', each side a list
    stages = tuple(tuple(numbers(side) for side in ramp(i, part)) for i, part in enumerate(text.split("/")))
    if any(len(start) != len(end) for start, end in stages):
        refuse("each stage needs as many weights after '>' as before it")
    return stages


@dataclass(frozen=True)
class Stage:
    """One part of the schedule: its steps [start, end) and what they use."""
    start: int
    end: int
    batch_tokens: int
    max_seq_len: int
    windows: tuple[int, int]  # (short, long) in blocks
    lr: float
    mtp_start: tuple[float, ...]
    mtp_end: tuple[float, ...]
    prefix: tuple[float, ...]  # the prefix-token weight: (start, end), linear over the stage, or its equal parts'
    prefix_parts: bool  # prefix holds one weight per equal part of the stage, not (start, end)
    micro_batches: int | None  # None: --micro_batches=auto, not yet chosen (plan_memory)

    @property
    def micro_tokens(self) -> int:
        if self.micro_batches is None:
            raise ConfigError("--micro_batches=auto: the counts are chosen at start-up (plan_memory), not before")
        return self.batch_tokens // self.micro_batches


class Schedule:
    """The records' schedule, derived from the config in one place: stages over the scheduled steps (record
    #85's three of (nearly) equal length; record #92's three of given shares, the third grown by 52 steps, and a
    taper), then the extension, which keeps the last stage's sequence length and multi-token weights, and its batch
    unless --extension_batch_tokens, with its own windows. Everything a step uses comes from here."""

    def __init__(self, args: Hyperparameters):
        batches, lengths = flag_list(args, "stage_batch_tokens"), flag_list(args, "stage_max_seq_len")
        windows, lrs = flag_list(args, "stage_windows"), flag_list(args, "stage_lr")
        mtp, prefix = flag_list(args, "stage_mtp_weights"), flag_list(args, "stage_prefix_weights")
        counts = {len(batches), len(lengths), len(windows), len(lrs), len(mtp), len(prefix)}
        if len(counts) != 1:
            raise ConfigError(f"--stage_batch_tokens, --stage_max_seq_len, --stage_windows, --stage_lr, "
                              f"--stage_mtp_weights and --stage_prefix_weights must list one value per stage (got "
                              f"{len(batches)}, {len(lengths)}, {len(windows)}, {len(lrs)}, {len(mtp)}, {len(prefix)})")
        self.scheduled = args.num_iterations - args.extension_steps
        self.total = args.num_iterations
        n = len(batches)
        ends = stage_ends(args, n, self.scheduled)
        starts = [0, *ends[:-1]]
        counts = stage_micro_batches(args, n)
        self.stages = [Stage(s, e, batches[i], lengths[i], windows[i], lrs[i], *mtp[i], *prefix[i], counts[i])
                       for i, (s, e) in enumerate(zip(starts, ends))]
        last_prefix = prefix[-1][0][-1]
        self.stages.append(Stage(self.scheduled, self.total, args.extension_batch_tokens or batches[-1], lengths[-1],
                                 flag_list(args, "extension_windows"), lrs[-1],
                                 mtp[-1][1], mtp[-1][1], (last_prefix, last_prefix), False, counts[-1]))
        self.prefix_term = any(w > 0 for weights, _ in prefix for w in weights)
        # a count of the whole padded vocabulary or more is the whole vocabulary: the full softmax (0)
        vocab = padded_vocab(args.vocab_size)
        parts = [tuple(0 if count >= vocab else count for count in entry) for entry in stage_candidates(args, n)]
        self.candidate_parts = [*parts, parts[-1][-1:]]  # the extension keeps the last stage's last count
        self.sampled = any(any(p) for p in parts)
        self.final_val_windows = (self.stages[-1].windows[0], args.final_val_window)
        self.cooldown_start = int(self.scheduled * (1 - args.cooldown_frac))
        self.final_lr_frac = args.final_lr_frac
        if args.matrix_optimizer == "anvil":
            self.momentum_range = (args.anvil_beta_start, args.anvil_beta_end)
            self.momentum_warmup, self.momentum_cooldown = args.anvil_beta_warmup, args.anvil_beta_cooldown
        else:
            self.momentum_range = (args.muon_momentum_start, args.muon_momentum_end)
            self.momentum_warmup, self.momentum_cooldown = args.muon_momentum_warmup, args.muon_momentum_cooldown
        self.engage_step = args.anvil_engage_step
        self.adam_every, self.val_loss_every = args.adam_every, args.val_loss_every
        self.embed_period, self.embed_period_start = args.embed_adam_period, args.embed_adam_period_start
        # the first Adam step (the record: an odd step) of the untie stage (n: the extension); None: never
        untie_start = self.stages[args.untie_stage].start if args.untie_stage <= n else None
        self.untie_step = None
        if untie_start is not None:
            self.untie_step = next(s for s in range(untie_start, untie_start + args.adam_every) if self.adam_steps(s))

    def stage_index(self, step: int) -> int:
        for i, stage in enumerate(self.stages):
            if step < stage.end:
                return i
        return len(self.stages) - 1

    def stage(self, step: int) -> Stage:
        return self.stages[self.stage_index(step)]

    def lr(self, step: int) -> float:
        """The stage's multiplier, then (from cooldown_start) a linear move to final_lr_frac at the last
        scheduled step; across a stage boundary in the cooldown the multiplier it moves from jumps. A cooldown of no
        steps (--cooldown_frac=0, or a fraction of the scheduled steps that rounds to none) has ended where the
        extension starts: t is 1 there, the limit of the move as the cooldown shrinks (it divided 0 by 0)."""
        lr = self.stage(step).lr
        if step >= self.cooldown_start:
            steps = self.scheduled - self.cooldown_start
            t = min(1.0, (step - self.cooldown_start) / steps) if steps else 1.0
            lr = lr * (1 - t) + self.final_lr_frac * t
        return lr

    def stage_fraction(self, step: int) -> float:
        """How far into its stage a step is, 0 at its first step: the weights move linearly with it."""
        stage = self.stage(step)
        return (step - stage.start) / (stage.end - stage.start) if step < stage.end else 1.0

    def mtp_weights(self, step: int) -> tuple[float, ...]:
        stage, t = self.stage(step), self.stage_fraction(step)
        return tuple(a + (b - a) * t for a, b in zip(stage.mtp_start, stage.mtp_end))

    def prefix_weight(self, step: int) -> float | None:
        """The prefix-token loss's weight at a step: linear over its stage, or the weight of the stage's equal part
        it is in (part k of n holds the steps whose (step - start) * n // length is k); None where its stage has
        none (the loss then has no prefix column at all)."""
        stage = self.stage(step)
        if not any(stage.prefix):
            return None
        if stage.prefix_parts:
            parts = len(stage.prefix)
            return stage.prefix[min(parts - 1, (step - stage.start) * parts // (stage.end - stage.start))]
        start, end = stage.prefix
        return start + (end - start) * self.stage_fraction(step)

    def candidates(self, step: int) -> int:
        """Record #92's sampled softmax: how many candidate classes the training loss's softmax runs over at a
        step (0: the whole vocabulary). A stage of n counts runs count floor(n (step - start) / (end - start)),
        in equal parts of it, as the record's ramp."""
        i = self.stage_index(step)
        stage, parts = self.stages[i], self.candidate_parts[i]
        if step >= stage.end:  # the end of the run
            return parts[-1]
        return parts[(step - stage.start) * len(parts) // (stage.end - stage.start)]

    def momentum(self, step: int) -> float:
        """The matrix optimizer's momentum (NorMuon's; ANVIL's rail beta, from the anvil_beta_* flags): rises
        linearly from start to end over the warmup, falls back to start over the last cooldown steps of the run."""
        lo, hi = self.momentum_range
        cooldown_start = self.total - self.momentum_cooldown
        if step < self.momentum_warmup:
            return lo + step / self.momentum_warmup * (hi - lo)
        if step > cooldown_start:
            return hi - (step - cooldown_start) / self.momentum_cooldown * (hi - lo)
        return hi

    def rails(self, step: int) -> tuple[float, float]:
        """ANVIL's (fast-rail beta, blend: the fast rail's share of the velocity) at a step: (the rail beta, 1), the
        fast rail alone, before the engage step; (ANVIL_FAST_BETA, ANVIL_BLEND) from it."""
        if step < self.engage_step:
            return self.momentum(step), 1.0
        return ANVIL_FAST_BETA, ANVIL_BLEND

    def adam_steps(self, step: int) -> bool:
        """Adam steps at the last of every adam_every steps (the record: the odd ones)."""
        return (step + 1) % self.adam_every == 0

    def embed_slow(self, step: int) -> bool:
        """Whether the embeddings' slower Adam cadence (--embed_adam_period) holds at a step."""
        return bool(self.embed_period) and step >= self.embed_period_start

    def embed_adam_steps(self, step: int) -> bool:
        """The Adam steps of the value embeddings and the n-gram table (record #92's cadence): Adam's own until
        embed_adam_period_start, then the last of every embed_adam_period steps (the record: the odd steps until
        336, then the steps = 3 mod 4). Between two of them their gradients accumulate."""
        if self.embed_slow(step):
            return (step + 1) % self.embed_period == 0
        return self.adam_steps(step)

    def embed_adam_power(self, step: int) -> int:
        """How many adam_every-step cycles one Adam step of the embeddings covers at a step: 1, then embed_adam_period
        / adam_every. Their betas are raised to this power and their weight decay multiplied by it (the record: betas
        squared, wd_mul 5 -> 10), so that what their moments forget and their weights decay per step stays the same."""
        return self.embed_period // self.adam_every if self.embed_slow(step) else 1

    def validates(self, step: int) -> bool:
        """A validation before `step` (and after the last step)."""
        return step == self.total or bool(self.val_loss_every and step % self.val_loss_every == 0)

    def windows(self, step: int, final_validation: bool = False) -> tuple[int, int]:
        return self.final_val_windows if final_validation else self.stage(step).windows

    def micro_batches(self, step: int) -> int:
        stage = self.stage(step)
        return stage.batch_tokens // stage.micro_tokens  # (micro_tokens refuses before auto has chosen)

    def micro_tokens(self, step: int) -> int:
        return self.stage(step).micro_tokens

    def max_micro_tokens(self) -> int:
        return max(stage.micro_tokens for stage in self.stages)


def stage_ends(args: Hyperparameters, stages: int, scheduled: int) -> list[int]:
    """Where each stage ends. The scheduled steps less the grown ones are cut at round(s * steps), s the shares
    summed so far (record #92's rule; record #85's: equal thirds, round(steps * (i + 1) / n)); then the grown stage
    and every stage after it end --grown_steps later."""
    base = scheduled - args.grown_steps
    shares = flag_list(args, "stage_fractions") if args.stage_fractions.strip() else None
    if shares is None:
        ends = [round(base * (i + 1) / stages) for i in range(stages)]
    else:
        if len(shares) != stages or min(shares) <= 0 or abs(sum(shares) - 1) > 1e-9:
            raise ConfigError(f"--stage_fractions={args.stage_fractions}: one share per stage ({stages}), each "
                              f"positive, summing to 1")
        ends = [round(total * base) for total in itertools.accumulate(shares)]
        ends[-1] = base  # the record's shares sum to 1 in floating point; others within 1e-9 end where they must
    return [end + (args.grown_steps if i >= args.grown_stage else 0) for i, end in enumerate(ends)]


def stage_micro_batches(args: Hyperparameters, stages: int) -> tuple[int | None, ...]:
    """--micro_batches for each of the stages: one count for all, one count per stage, or auto (None each:
    plan_memory chooses them at start-up)."""
    text = args.micro_batches.strip()
    if text == "auto":
        return (None,) * stages
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--micro_batches={text}: expected auto, a count, or one count per stage, e.g. 8,8,16") from None
    if len(counts) == 1:
        counts *= stages
    if len(counts) != stages:
        raise ConfigError(f"--micro_batches={text}: one count for every stage, or one per stage ({stages}), or auto")
    if min(counts) <= 0:
        raise ConfigError(f"--micro_batches={text}: must be positive")
    return counts


def stage_candidates(args: Hyperparameters, stages: int) -> tuple[tuple[int, ...], ...]:
    """--stage_softmax_candidates for each of the stages: its candidate counts, run in equal parts of the stage
    (one count: the whole stage; 0: the whole vocabulary). One entry for all stages, or one per stage."""
    entries = flag_list(args, "stage_softmax_candidates")
    if len(entries) == 1:
        entries *= stages
    if len(entries) != stages:
        raise ConfigError(f"--stage_softmax_candidates={args.stage_softmax_candidates}: one entry for every stage, or "
                          f"one per stage ({stages})")
    return entries


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does: the record's layer roles, derived from the config in one place (layer_plan)."""
    index: int
    attention: bool
    paired: bool
    long_window: bool  # also: the partial key offset (non-paired layers)
    xsa: bool
    attn_gate: bool
    dc: bool
    value_embed: int | None  # which value-embedding table feeds this layer's values
    ve_gate: int | None  # which row of ve_gates mixes it (None on the MUDD layer, whose MUDD net does; ve_gate_layers)
    shared_input: bool  # reads its attention input from the shared_input_layer's output
    skip_target: bool  # the gated skip replaces its attention
    mudd: bool  # the last layer: MUDD mixing around its attention and MLP
    removed: bool = False  # no attention and no MLP: residual lambdas and injections only
    narrow_qk: bool = False  # queries and keys of narrow_dim dims a head
    narrow_value: bool = False  # values (and the output projection's inputs) of narrow_dim dims a head
    parallel_mlp: bool = False  # a second MLP on the same normed input
    x0_inject: bool = False  # adds the x0 injection after its attention (or its place)
    bigram_inject: bool = False  # adds the bigram injection there (layer 0: before the first layer)
    injects: bool = False  # owns an x0 and a bigram gate (every layer but the skip target and the MUDD layer)
    retired: tuple = ()  # roles whose gates it keeps though it reads none (--retired_gates)


def layer_plan(args: Hyperparameters) -> list[LayerPlan]:
    n = args.num_layers
    sets = {name: set(flag_list(args, name)) for name in (
        "no_attention_layers", "removed_layers", "paired_layers", "long_window_layers", "xsa_layers",
        "attn_gate_layers", "dc_layers", "narrow_qk_layers", "narrow_value_layers", "parallel_mlp_layers",
        "no_x0_layers", "no_bigram_layers")}
    retired = retired_gates(args)
    ve_layers = flag_list(args, "value_embed_layers")
    gate_rows = ve_gate_layers(args)
    skip_from, skip_to = skip_pair(args)
    plans = []
    for i in range(n):
        attention = i not in sets["no_attention_layers"] | sets["removed_layers"]
        ve = ve_layers.index(i) if i in ve_layers else None
        mudd = i == n - 1
        injects = i != skip_to and not mudd
        plans.append(LayerPlan(
            i, attention, i in sets["paired_layers"], i in sets["long_window_layers"], i in sets["xsa_layers"],
            i in sets["attn_gate_layers"], i in sets["dc_layers"], ve,
            None if ve is None or mudd else gate_rows.index(i),
            i > args.shared_input_layer, i == skip_to, mudd, removed=i in sets["removed_layers"],
            narrow_qk=i in sets["narrow_qk_layers"], narrow_value=i in sets["narrow_value_layers"],
            parallel_mlp=i in sets["parallel_mlp_layers"], x0_inject=injects and i not in sets["no_x0_layers"],
            bigram_inject=injects and i not in sets["no_bigram_layers"], injects=injects,
            retired=tuple(role for role, layer in retired if layer == i)))
    return plans


# The per-head gates a layer's role gives it, which --retired_gates names: from the gate networks (GateLayout: XSA,
# attention gates, DC) or a row of ve_gates (a value embedding's).
GATE_ROLES = ("xsa", "attn", "dc", "ve")


def ve_gate_layers(args: Hyperparameters) -> tuple[int, ...]:
    """The layers whose value-embedding gates ve_gates holds, a row each in layer order: those with a value embedding
    and those that keep a retired one's (--retired_gates=ve:N)."""
    retired = {layer for role, layer in retired_gates(args) if role == "ve"}
    return tuple(sorted(set(flag_list(args, "value_embed_layers")) | retired))


def retired_gates(args: Hyperparameters) -> tuple[tuple[str, int], ...]:
    """--retired_gates=xsa:4,dc:10 as ((role, layer), ...)."""
    pairs = []
    for part in filter(None, (p.strip() for p in args.retired_gates.split(","))):
        role, colon, layer = part.partition(":")
        if not colon or role not in GATE_ROLES or not layer.strip().lstrip("-").isdigit():
            raise ConfigError(f"--retired_gates={args.retired_gates}: expected role:layer pairs with role "
                              f"{', '.join(GATE_ROLES)}, e.g. xsa:4,dc:10")
        pairs.append((role, int(layer)))
    return tuple(pairs)


def skip_pair(args: Hyperparameters) -> tuple[int, int]:
    return flag_list(args, "skip_layers")


def mlp_width(args: Hyperparameters) -> int:
    """The MLPs' hidden width: --mlp_hidden, or --mlp_ratio times the model dim."""
    return args.mlp_hidden or args.mlp_ratio * args.model_dim


def rotary_dims(args: Hyperparameters) -> int:
    """The leading dims of every head that rotary turns (--rotary_dims; default half the full head)."""
    return args.rotary_dims or args.head_dim // 2


def head_mix_states(args: Hyperparameters) -> tuple[str, ...]:
    """--head_mix's states, in the order of the second MUDD net's outputs."""
    states = tuple(part.strip() for part in args.head_mix.split(",") if part.strip())
    tables = len(flag_list(args, "value_embed_layers"))
    for state in states:
        table = state[2:] if state.startswith("ve") else None
        if state not in HEAD_MIX_STATES and not (table and table.isdigit() and int(table) < tables):
            raise ConfigError(f"--head_mix={args.head_mix}: {state!r} is not one of {', '.join(HEAD_MIX_STATES)} or "
                              f"ve0..ve{tables - 1} (a value embedding's rows)")
    if not states or len(set(states)) != len(states) or len(states) > MUDD_LAYER_COEFS:
        raise ConfigError(f"--head_mix={args.head_mix}: expected 1 to {MUDD_LAYER_COEFS} different states")
    return states


# -----------------------------------------------------------------------------
# Model: record #85's GPT. Paired-head attention on some layers, XSA, a DC correction, the partial key
# offset, value embeddings with per-head gates, a bigram hash embedding, a gated skip, MUDD gate networks
# that produce per-token gates, MUDD mixing of earlier states at the last layer and before the head, FP8
# up-projections, and a multi-token-prediction loss under a softcap. Which layer does what is
# configuration (layer_plan), never indices in the code.

GATE_CHANNELS = 12  # the smear gate reads this many leading channels of the token embedding
VE_GATE_CHANNELS = 6  # a value-embedding gate reads this many channels of the attention input and of the embedding
ROPE_MIN_FREQ = 1 / 1024  # rotary frequencies run from 1 down to this, one for each pair of rotating dims
YARN_ALPHA, YARN_BETA = 1, 32  # frequencies turning fewer/more times than this over a window are fully/not rescaled
# F.rms_norm's default eps, which the records leave it at: since PyTorch 2.7 (pytorch#142848) fp32's machine epsilon
# for fp32, bf16 and fp16 inputs alike (the epsilon of the type it computes in); --norm_eps's default. (Until
# 2026-11-29 this was bf16's epsilon, 2**-7: a misreading that the comparisons with records #85 and #89's code
# shared, patched into their side; their PyTorch 2.10 bf16 runs never used it.)
NORM_EPS = torch.finfo(torch.float32).eps
XSA_EPS = 1e-4  # the record's F.normalize eps for the value direction XSA subtracts along
DC_NORM_EPS = 1e-6  # the DC query-side weights are RMS-normalised over heads with this eps
SKIP_GATE_INIT = -1.5  # the skip weight starts at sigmoid(-1.5) = 0.18
RESIDUAL_INIT = 1.1 ** 0.5  # each sublayer scales the stream by this at init: 1.1 per layer
MUDD_SCALE = 0.1  # the MUDD nets' outputs are MUDD_SCALE * (W2 h + b2); their biases are stored divided by it
MUDD_HIDDEN = 64
MUDD_LAYER_COEFS = 14  # the last layer's MUDD net: LayerMix names them
BIGRAM_MULTIPLIERS = (36313, 27191)  # the record's hash of (current, previous) token, in int32 arithmetic
# Record #92's n-gram table (--ngram_channels=2): its trigram rows hash (x[t], x[t-1], x[t-2]) with these, and the
# sign rows of the two channels hash (x[t], x[t-1]) and (x[t], x[t-1], x[t-2]) with multipliers of their own, so that
# two n-grams sharing a row rarely share its signs too. All in int32 arithmetic, products wrapping around.
TRIGRAM_MULTIPLIERS = (17351, 60961, 45259)
NGRAM_SIGN_MULTIPLIERS = ((48271, 30011), (58699, 39779, 26801))
NGRAM_RECORD_ROWS = 84_602_880  # record #92's table: 224.24x record #85's 377,280 rows, half bigram, half trigram
NGRAM_MIN_ROWS = 6  # each channel needs two rows (one for its hashes, one for a sequence's first tokens) and more
BOS_ID = 50256  # <|endoftext|> starts every document


def norm(x: Tensor, eps: float = NORM_EPS) -> Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def uniform_init_(weight: Tensor, std: float):
    bound = 3 ** 0.5 * std  # a uniform distribution with this standard deviation
    with torch.no_grad():
        weight.uniform_(-bound, bound)


def bigram_hash(ids: Tensor, previous: Tensor, position: Tensor, buckets: int) -> Tensor:
    """Record #85's bigram rows: a sequence's first token takes the last row (buckets - 1); every other
    token hashes (36313 * token) xor (27191 * previous) mod (buckets - 1) in int32 arithmetic (products wrap
    around), except that the second token hashes with buckets - 1 in place of the first token (the record
    overwrites position 0 before reading it). `position`: each token's position in its sequence."""
    mod = buckets - 1
    x, previous = ids.to(torch.int32), previous.to(torch.int32)
    previous = torch.where(position == 1, torch.full_like(previous, mod), previous)
    hashed = torch.remainder(torch.bitwise_xor(BIGRAM_MULTIPLIERS[0] * x, BIGRAM_MULTIPLIERS[1] * previous), mod)
    return torch.where(position == 0, torch.full_like(x, mod), hashed)


def ngram_rows(ids: Tensor, previous: Tensor, before_previous: Tensor, position: Tensor, rows: int) -> Tensor:
    """Record #92's table rows of each token, (2, T) int64: its bigram row in [0, half) and its trigram row in
    [half, rows), half = rows // 2. The bigram channel is record #85's bigram hash with half buckets
    (bigram_hash: a sequence's first token takes row half - 1, its second hashes with half - 1 in place of the
    first); the trigram channel, with mod = rows - half - 1, in int32 arithmetic (products wrap around):

        trigram(t) = ((17351 x[t]) xor (60961 x[t-1]) xor (45259 x[t-2])) mod mod + half,  position >= 2
                   = rows - 1,                                                           position 0 and 1

    where mod is Python's (the result is in [0, mod) for a negative xor too). previous, before_previous: x[t-1] and
    x[t-2] (read only from positions 1 and 2 on)."""
    half = rows // 2
    bigram = bigram_hash(ids, previous, position, half)
    x, p1, p2 = ids.to(torch.int32), previous.to(torch.int32), before_previous.to(torch.int32)
    a, b, c = TRIGRAM_MULTIPLIERS
    mixed = torch.bitwise_xor(torch.bitwise_xor(a * x, b * p1), c * p2)
    trigram = torch.where(position >= 2, torch.remainder(mixed, rows - half - 1) + half, rows - 1)
    return torch.stack([bigram.long(), trigram.long()])


def ngram_sign_rows(ids: Tensor, previous: Tensor, before_previous: Tensor, position: Tensor, sign_rows: int) -> Tensor:
    """Record #92's sign rows of each token's two table rows, (2, T) int64, with R = sign_rows (a power of two) and &
    on int32 two's complement (the low bits: Python's mod R):

        bigram sign(t)  = ((30011 x[t-1]) xor (48271 x[t])) & (R - 1)                          position >= 1, else 0
        trigram sign(t) = ((26801 x[t-2]) xor (39779 x[t-1]) xor (58699 x[t])) & (R - 1)   position >= 2, else 0

    Unlike the rows, these read the true previous token at position 1."""
    x, p1, p2 = ids.to(torch.int32), previous.to(torch.int32), before_previous.to(torch.int32)
    (b0, b1), (t0, t1, t2) = NGRAM_SIGN_MULTIPLIERS
    mask = sign_rows - 1
    bigram = torch.bitwise_and(torch.bitwise_xor(b1 * p1, b0 * x), mask)
    trigram = torch.bitwise_and(torch.bitwise_xor(torch.bitwise_xor(t2 * p2, t1 * p1), t0 * x), mask)
    zero = torch.zeros_like(bigram)
    return torch.stack([torch.where(position >= 1, bigram, zero).long(),
                        torch.where(position >= 2, trigram, zero).long()])


class NgramCombine(torch.autograd.Function):
    """x0_bigram of record #92's table, from the rows a step reads (`rows`, (n, dim), whichever rows of the table
    they are) and each token's two slots in them (`slots`, (2, T)): in fp32, rounded once to `dtype`,

        x0_bigram[t] = rows[slots[0, t]] * signs[sign_rows[0, t]] + rows[slots[1, t]] * signs[sign_rows[1, t]]

    The gradient is the rows' alone, (n, dim) in rows' dtype, summed over the tokens in fp32:
    d rows[i] = sum over (c, t) with slots[c, t] = i of g[t] * signs[sign_rows[c, t]]. Never one of the whole table's
    size: with the rows a step reads as an autograd leaf (ngram_pull), that is the table's compact gradient."""

    @staticmethod
    def forward(ctx, rows: Tensor, slots: Tensor, signs: Tensor, sign_rows: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(slots, signs, sign_rows)
        ctx.shape, ctx.dtype = rows.shape, rows.dtype
        out = rows[slots[0]].float() * signs[sign_rows[0]].float()
        out += rows[slots[1]].float() * signs[sign_rows[1]].float()
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        slots, signs, sign_rows = ctx.saved_tensors
        g = grad.float()
        out = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device)
        for c in range(2):
            out.index_add_(0, slots[c], g * signs[sign_rows[c]].float())
        return out.to(ctx.dtype), None, None, None, None


@dataclass
class NgramView:
    """The rows of record #92's table that the next forward passes read (ngram_pull): `cache` (n, dim), the rows
    `ids` (n,) hold, ascending (global row ids, on the device)."""
    cache: Tensor
    ids: Tensor


class NgramEmbedding(nn.Module):
    """Record #92's hashed n-gram table (--ngram_channels=2), as one rank holds it: rows [lo, lo + rows / world) of
    its `rows` (the rank's shard; the whole table at world size 1), zeros at the start. The shard is run state of
    this rank (rank_buffers), not in the state dict: it differs between ranks. A forward pass reads the rows its
    tokens hash to (ngram_rows) from `view`, the rows the step pulled from their owners beforehand; without a view,
    at world size 1, it reads the shard itself (evaluation and generation: no gradient reaches the table then)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, shard: tuple[int, int] = (0, 1)):
        super().__init__()
        self.rank, self.world = shard
        self.rows, self.lo = rows, self.rank * (rows // self.world)
        self.register_buffer("weight", torch.zeros(rows // self.world, dim, dtype=dtype), persistent=False)
        self.view: NgramView | None = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Final weights (save_final_weights) carry the whole table as `weight`: this rank takes its rows of it."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "weight"
        if key in state_dict:
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            with torch.no_grad():
                self.weight.copy_(state_dict[key][self.lo:self.lo + self.weight.size(0)])

    def forward(self, ids: Tensor, previous: Tensor, before_previous: Tensor, position: Tensor, signs: Tensor,
                dtype: torch.dtype) -> Tensor:
        """x0_bigram (T, dim) of the tokens `ids` (NgramCombine)."""
        rows = ngram_rows(ids, previous, before_previous, position, self.rows)
        sign_rows = ngram_sign_rows(ids, previous, before_previous, position, signs.size(0))
        if self.view is not None:
            source, slots = self.view.cache, torch.searchsorted(self.view.ids, rows)
        elif self.world == 1:
            source, slots = self.weight, rows
        else:
            raise RuntimeError("the n-gram table is sharded over the ranks: pull the rows a forward reads first "
                               "(ngram_pull)")
        return NgramCombine.apply(source, slots, signs, sign_rows, dtype)


def shifted(ids: Tensor, k: int, length: int) -> Tensor:
    """x[t-k] for the last `length` of `ids` (the tokens before them first), the first token standing in where
    there is none (what reads it is masked by position there)."""
    start = len(ids) - length - k  # where x[t-k] of the first is
    return ids[torch.arange(start, start + length, device=ids.device).clamp(min=0)]


def positions_in_sequence(length: int, device, starts: Tensor | None = None, offset: int = 0) -> Tensor:
    """0, 1, 2, ... from the sequence start (offset: positions already cached); with `starts` (booleans),
    counted from the last start at or before each position."""
    index = torch.arange(offset, offset + length, device=device)
    if starts is None:
        return index
    last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    return index - last_start


class Rotary(nn.Module):
    """Rotary position embedding on adjacent pairs of the first rotary_dims of each head's dimensions (the rest
    carry no position; default: half the head), with YaRN: when the attention window grows, frequencies that turn
    only a few times across the old window are slowed down in proportion, and the attention scale grows with
    log(new / old). The cos/sin tables hold bf16 values (as the record's) for twice the longest sequence:
    paired layers place each token at two positions. `scale`: the attention scale at the first window.

    Its state (frequencies, attention scale, the window they were fitted to) is in the state dict, so
    checkpoints resume exactly; the tables are recomputed from it."""

    def __init__(self, head_dim: int, max_len: int, window_block: int, first_window: int,
                 rotary_dims: int | None = None, scale: float = 0.1):
        super().__init__()
        self.window_block, self.first_window = window_block, first_window
        self.rotary_dims, self.initial_scale = rotary_dims or head_dim // 2, scale
        self.register_buffer("angular_freq", torch.zeros(head_dim))
        # bf16, the record's tables; sin holds -sin at odd indices (see apply_rotary)
        self.register_buffer("cos", torch.zeros(2 * max_len, head_dim, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("sin", torch.zeros(2 * max_len, head_dim, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("attn_scale", torch.zeros(()), persistent=False)  # a tensor: data, not a constant
        self.window, self.scale = first_window, scale
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.refresh())
        self.reset()

    @torch.no_grad()
    def reset(self):
        turning = self.rotary_dims // 2  # frequencies, each turning one pair of dims
        freq = ROPE_MIN_FREQ ** torch.linspace(0, 1, turning, device=self.angular_freq.device)
        still = freq.new_zeros(self.angular_freq.numel() - 2 * turning)
        self.angular_freq.copy_(torch.cat([freq.repeat_interleave(2), still]))
        self.window, self.scale = self.first_window, self.initial_scale
        self.refresh()

    @torch.no_grad()
    def set_window(self, window: int):
        """Fit the frequencies to a window of `window` blocks (YaRN); nothing if it is the current one."""
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
        self.sin[:, 1::2] *= -1
        self.attn_scale.fill_(self.scale)

    def get_extra_state(self) -> dict:
        return {"window": self.window, "attn_scale": self.scale}

    def set_extra_state(self, state: dict):
        self.window, self.scale = int(state["window"]), float(state["attn_scale"])


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., D) turned pair by pair: (x0, x1) -> (x0 cos + x1 sin, x1 cos - x0 sin), with cos and sin
    (..., D) broadcast over x (sin holds -sin at odd indices)."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (..., D/2, 2) pairs, each swapped: (x1, x0)
    return x * cos.type_as(x) + swapped * sin.type_as(x)


# Attention masks. A query sees itself and the `window` positions before it (window + 1 keys, like
# FlashAttention's window (w, 0)), within its document: a BOS token starts a new one. FlexAttention
# gets a BlockMask built from per-block document ranges, with the window and the document ids as
# tensors, so neither becomes a compile-time constant; SDPA gets the same mask as a dense tensor.
# Paired layers attend over a sequence of twice the length (each token at two positions), with each
# document's positions doubled.

def window_tokens(windows: tuple[int, int], long_window: bool, window_block: int) -> int:
    """A layer's attention window in tokens: the count of window blocks of its kind (short or long)."""
    return window_block * windows[1 if long_window else 0]


def document_ids(tokens: Tensor, cap: int = 0) -> Tensor:
    """Each position's document: a BOS token starts a new one. With cap (record #92's virtual attention segments,
    --virtual_seq_cap), so does every cap-th token after a document's start: attention then stays within pieces of
    at most cap tokens of a document."""
    starts = tokens == BOS_ID
    if cap:
        position = positions_in_sequence(len(tokens), tokens.device, starts)
        starts = starts | ((position % cap == 0) & (position > 0))
    return starts.cumsum(0)


def dense_attention_mask(docs: Tensor, window: int, num_queries: int | None = None) -> Tensor:
    """(queries, keys) boolean mask; the queries are the last num_queries positions (default: all)."""
    keys = torch.arange(docs.numel(), device=docs.device)
    queries = keys[-(num_queries or docs.numel()):]
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) & (distance <= window) & (docs[queries][:, None] == docs[None, :])


def _ordered_blocks(visible: Tensor) -> tuple[Tensor, Tensor]:
    """(q_blocks, kv_blocks) booleans -> BlockMask's counts and indices: each row's visible key blocks in
    ascending order, then the others (the stable argsort create_block_mask uses). Computed by counting, not
    sorting: a block's slot is the number of visible blocks before it, or, for a hidden one, the row's count
    plus the hidden blocks before it. Inductor's Triton sort takes minutes to compile at these widths (475 s
    for stage 1's masks on a fake H100, where this takes seconds)."""
    shown = visible.to(torch.int32)
    counts = shown.sum(-1, dtype=torch.int32)
    shown_before = shown.cumsum(-1, dtype=torch.int32) - shown
    blocks = torch.arange(visible.size(-1), dtype=torch.int32, device=visible.device)
    slot = torch.where(visible, shown_before, counts[:, None] + blocks - shown_before)
    order = torch.zeros_like(slot).scatter_(-1, slot.long(), blocks.expand_as(slot))
    return counts[None, None], order[None, None]


def block_mask_parts(docs: Tensor, window: Tensor, block_size: int) -> tuple[Tensor, ...]:
    """The index tensors of a BlockMask for documents `docs` and a window (a 0-dim tensor): which (query block,
    key block) pairs have some visible pair of positions, and which have only visible ones (those skip the
    mask_mod), from each block's first and last document id and distances; as counts and indices per query
    block (the key side), then per key block (the query side, which the backward reads)."""
    blocks = torch.arange(docs.numel() // block_size, device=docs.device)
    first, last = docs[::block_size], docs[block_size - 1::block_size]
    q, kv = blocks[:, None], blocks[None, :]
    distance = (q - kv) * block_size
    some = (kv <= q) & (last[None, :] >= first[:, None]) & (distance - (block_size - 1) <= window)
    every = (kv < q) & (first[None, :] == last[:, None]) & (distance + (block_size - 1) <= window)
    partial = some & ~every
    return (*_ordered_blocks(partial), *_ordered_blocks(every), *_ordered_blocks(partial.mT),
            *_ordered_blocks(every.mT))


def mask_parts(tokens: Tensor, kinds: tuple, windows: Tensor, block_size: int, cap: int = 0) -> tuple[Tensor, dict]:
    """The document ids of a packed sequence (cut every `cap` tokens: document_ids) and, for each kind of layer
    (long window, paired), its documents (a paired layer's doubled), its window (a 0-dim tensor of `windows`:
    short, long, in tokens) and its block mask's index tensors: everything build_masks computes on the device,
    one compiled call on CUDA."""
    docs = document_ids(tokens, cap)
    parts = {}
    for long_window, paired in kinds:
        layer_docs = docs.repeat_interleave(2) if paired else docs
        window = windows[int(long_window)]
        parts[(long_window, paired)] = (layer_docs, window, block_mask_parts(layer_docs, window, block_size))
    return docs, parts


def flex_block_mask(docs: Tensor, window: int | Tensor, block_size: int, parts: tuple[Tensor, ...] | None = None):
    """The BlockMask of documents `docs` and a window (tokens; an int or a 0-dim tensor), with the mask_mod its
    partial blocks apply; parts: its index tensors, when block_mask_parts has computed them already."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(window, Tensor):
        window = torch.full((), window, dtype=docs.dtype, device=docs.device)
    if parts is None:
        parts = block_mask_parts(docs, window, block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance <= window) & (docs[q_idx] == docs[kv_idx])

    kv, kv_index, full_kv, full_kv_index, q, q_index, full_q, full_q_index = parts
    return BlockMask(seq_lengths=(docs.numel(), docs.numel()), kv_num_blocks=kv, kv_indices=kv_index,
                     full_kv_num_blocks=full_kv, full_kv_indices=full_kv_index, q_num_blocks=q, q_indices=q_index,
                     full_q_num_blocks=full_q, full_q_indices=full_q_index, BLOCK_SIZE=(block_size, block_size),
                     mask_mod=mask_mod)


@dataclass
class Masks:
    """The attention masks of one packed sequence, by (long window, paired), and its document ids. Keyed by
    the kind of layer, not by the window's length: the windows live in the masks as tensors, so a compiled
    layer's graph does not depend on them (a key per length would recompile every layer at each new window).
    windows: the (short, long) windows in blocks that the masks were built for (generation reads them)."""
    by_kind: dict
    docs: Tensor
    windows: tuple[int, int]
    fresh: Tensor | None = None  # (T,) booleans: positions that start a sequence of their own (separate_documents)
    positions: Tensor | None = None  # (T,) each token's rotary position, counted from its own sequence's start

    def get(self, long_window: bool, paired: bool):
        return self.by_kind[(long_window, paired)]


def build_masks(tokens: Tensor, plans: list[LayerPlan], windows: tuple[int, int], window_block: int,
                use_flex: bool, parts: Callable = mask_parts, cap: int = 0) -> Masks:
    """One mask per kind of layer: (short or long window) x (paired or not); layers of a kind share it. With
    FlexAttention, `parts` computes the block masks' tensors (the model's mask_parts: compiled on CUDA). cap:
    training's --virtual_seq_cap (document_ids)."""
    kinds = tuple(dict.fromkeys((plan.long_window, plan.paired) for plan in plans if plan.attention))
    tokens_of = lambda long_window: window_tokens(windows, long_window, window_block)
    if not use_flex:
        docs = document_ids(tokens, cap)
        return Masks({(long_window, paired): dense_attention_mask(docs.repeat_interleave(2) if paired else docs,
                                                                  tokens_of(long_window))
                      for long_window, paired in kinds}, docs, windows)
    window_t = host_to_device(torch.tensor([tokens_of(False), tokens_of(True)]), tokens.device)
    docs, by_kind = parts(tokens, kinds, window_t, window_block, cap)
    return Masks({kind: flex_block_mask(kind_docs, window, window_block, parts)
                  for kind, (kind_docs, window, parts) in by_kind.items()}, docs, windows)


def attention(q: Tensor, k: Tensor, v: Tensor, mask, scale: Tensor) -> Tensor:
    """q, k, v: (B, H, T, D); mask: a BlockMask (FlexAttention) or a boolean tensor (SDPA). The scale is
    applied to q, so that it is a tensor in the graph and not a compile-time constant."""
    q = q * scale.type_as(q)
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=mask, scale=1.0)


def along(y: Tensor, v: Tensor) -> Tensor:
    """y's component along v, per head: (y.v) v / max(|v|^2, eps^2). Record #85 writes it with v's unit vector,
    (y.u) u with u = F.normalize(v, eps); record #86's rewrite, the same math, takes no square root and makes no
    normalized copy of v (compiled, inductor fuses either form into one pass over y and v). y, v: (B, T, H, D)."""
    return (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp(min=XSA_EPS ** 2) * v


def dc_visible(docs: Tensor, window: int, block: int) -> Tensor:
    """dc_correction's mask, (T / block, block, 2 block): which keys of its own block and the block before
    (those columns first) each query of a block sees: 0 <= t - s < window, in t's document. docs: (T,)."""
    n = docs.numel() // block
    docs_p = torch.cat([docs.new_full((block,), -1), docs]).view(n + 1, block)  # a block of no document first
    key_docs = torch.cat([docs_p[:-1], docs_p[1:]], dim=1)  # (n, 2 block)
    query_pos = torch.arange(block, device=docs.device)[:, None] + block
    distance = query_pos - torch.arange(2 * block, device=docs.device)[None, :]
    return (distance >= 0) & (distance < window) & (docs.view(n, block)[:, :, None] == key_docs[:, None, :])


def dc_correction(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, dc_w: tuple[Tensor, Tensor],
                  scale: Tensor) -> Tensor:
    """Record #85's post-only dynamically composable correction, in plain PyTorch. For each query t and
    head h, P_h(t, .) is the softmax of scale * q_h(t).k_h(s) over the keys s that t sees (dc_visible: its
    window in its document); the heads' maps are mixed with per-token weights, A(t, s) = sum_h w1(t, h) P_h(t, s),
    and each head adds w2(t, h) * sum_s A(t, s) v_h(s) to its output. Returned: that correction, (B, T, H, D).

    Computed block by block: queries in blocks (>= window) see the keys of their block and the one before,
    so nothing grows with T^2. q, k, v: (B, T, H, D); dc_w = (w1, w2), each (B, T, H)."""
    B, T, H, D = q.shape
    n, block = visible.shape[:2]
    w1, w2 = dc_w
    qb = q.view(B, n, block, H, D)
    # keys and values with a zero block in front, (B, n + 1, block, H, D): block i's keys are padded blocks i, i + 1
    pad = lambda t: torch.cat([t.new_zeros(B, block, *t.shape[2:]), t], dim=1).view(B, n + 1, block, *t.shape[2:])
    kp, vp = pad(k), pad(v)
    kb, vb = torch.cat([kp[:, :-1], kp[:, 1:]], dim=2), torch.cat([vp[:, :-1], vp[:, 1:]], dim=2)  # (B, n, 2blk, H, D)
    scores = torch.einsum("bnqhd,bnkhd->bnhqk", qb.float(), kb.float()) * scale.float()
    scores = scores.masked_fill(~visible[None, :, None], float("-inf"))
    probs = scores.softmax(dim=-1)  # every query sees itself, so no row is empty
    mixed = torch.einsum("bnhqk,bnqh->bnqk", probs, w1.float().view(B, n, block, H))
    out = torch.einsum("bnqk,bnkhd->bnqhd", mixed.type_as(v), vb) * w2.view(B, n, block, H, 1).type_as(v)
    return out.reshape(B, T, H, D)


class AttentionCache:
    """The keys and values one attention layer has seen (generation in sample.py), as the layer attends
    over them: after rotary and the key offset, interleaved for a paired layer; and the last token's
    unshifted stationary key dimensions, which the key offset moves to the next token."""

    def __init__(self, max_len: int, heads: int, qk_dim: int, v_dim: int, device, dtype):
        self.k = torch.zeros(1, max_len, heads, qk_dim, device=device, dtype=dtype)
        self.v = torch.zeros(1, max_len, heads, v_dim, device=device, dtype=dtype)
        self.length = 0
        self.last_key_half: Tensor | None = None

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.size(1)
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


def paired_view(t: Tensor) -> Tensor:
    """(B, T, H, D) -> (B, 2T, H/2, D): the record's view of a paired layer's heads. Position 2t holds
    heads 0..H/2-1 of token t and position 2t+1 heads H/2..H-1, so head slot j pairs heads j and j + H/2."""
    B, T, H, D = t.shape
    return t.reshape(B, 2 * T, H // 2, D)


class CausalSelfAttention(nn.Module):
    """One layer's attention. qk holds the query and key weights in blocks of two heads (the record's
    NorMuon units: each head pair's queries, then each pair's keys), vo the value and output weights;
    both are scaled by the layer's two attention lambdas.

    Narrow heads (record #92): a narrow-QK layer's queries and keys have qk_dim < head_dim dims a head, from the
    first qk_dim rows of each head's block of qk; a narrow-value layer's values have v_dim < head_dim dims, from
    the first v_dim rows of each head's value weights, and its output projection reads the matching v_dim
    columns of each head's block. The parameters keep the full shapes (the record's matrices, which its
    optimizer updates whole: the rows no head reads take no gradient)."""

    def __init__(self, plan: LayerPlan, args: Hyperparameters):
        super().__init__()
        dim, head_dim = args.model_dim, args.head_dim
        self.plan, self.num_heads, self.head_dim = plan, dim // head_dim, head_dim
        self.qk_dim = args.narrow_dim if plan.narrow_qk else head_dim
        self.v_dim = args.narrow_dim if plan.narrow_value else head_dim
        self.rotary_dims = rotary_dims(args)  # the key offset moves the dims past these (no position)
        self.norm_eps = args.norm_eps
        self.dc_window, self.window_block = args.dc_window, args.window_block
        self.qk = nn.Parameter(torch.empty(self.num_heads, 2 * head_dim, dim))
        self.vo = nn.Parameter(torch.empty(2, dim, dim))
        uniform_init_(self.qk, 0.5 * dim ** -0.5)
        uniform_init_(self.vo, 0.5 * dim ** -0.5)
        # the attention kernel's seam: compile_model(attention_only=True) puts a compiled attention here, the
        # memory model a stand-in that only keeps what FlexAttention would
        self.attend = attention

    def qkv_weight(self) -> Tensor:
        """The Q, K and V rows the layer reads, (H (2 qk_dim + v_dim), dim): each head's first qk_dim rows of qk
        and first v_dim rows of V."""
        H, D, dim = self.num_heads, self.head_dim, self.vo.size(-1)
        qk, v = self.qk.flatten(0, 1), self.vo[0]
        if self.qk_dim != D:  # (H head pairs, 2 heads, D rows, dim): the first qk_dim rows of each head
            qk = self.qk.view(H, 2, D, dim)[:, :, :self.qk_dim].reshape(2 * H * self.qk_dim, dim)
        if self.v_dim != D:
            v = v.view(H, D, dim)[:, :self.v_dim].reshape(H * self.v_dim, dim)
        return torch.cat([qk, v])

    def out_weight(self) -> Tensor:
        """The output projection as the layer reads it, (dim, H v_dim): the columns of each head's values."""
        o = self.vo[1]
        if self.v_dim != self.head_dim:
            o = o.unflatten(1, (self.num_heads, self.head_dim))[..., :self.v_dim].flatten(1)
        return o

    def live_weights(self) -> int:
        """The weights the layer reads (the matmul FLOPs count these): Q, K, V and O."""
        return self.num_heads * (2 * self.qk_dim + 2 * self.v_dim) * self.vo.size(-1)

    def forward(self, x: Tensor, lambdas: Tensor, extras: AttentionExtras, inputs: LayerInputs,
                cache: AttentionCache | None = None) -> Tensor:
        B, T, dim = x.shape
        H, Dq, Dv, plan = self.num_heads, self.qk_dim, self.v_dim, self.plan
        masks, rotary, aux_v = inputs.masks, inputs.rotary_of(plan), extras.aux_v
        qkv = F.linear(x, lambdas[0] * self.qkv_weight().type_as(x))
        q, k, v = (t.view(B, T, H, -1) for t in qkv.split([H * Dq, H * Dq, H * Dv], dim=-1))  # (B, T, H, D) each
        q, k = norm(q, self.norm_eps), norm(k, self.norm_eps)  # QK-norm bounds the logits
        start = cache.length // (2 if plan.paired else 1) if cache is not None else 0
        # rotary positions: the packed sequence's (the record's), or each document's own (separate_documents)
        rows = torch.arange(start, start + T, device=x.device) if masks.positions is None else masks.positions
        if plan.paired:
            # each head pair's 2D dims turn at positions 2t (first head) and 2t+1 (second head)
            rows2 = (2 * rows[:, None] + torch.arange(2, device=x.device)).flatten()
            cos, sin = rotary.cos[rows2].view(T, 1, 2 * Dq), rotary.sin[rows2].view(T, 1, 2 * Dq)
            # (B, T, H/2, 2D): heads j and j + H/2 side by side, turned at their two positions
            q = apply_rotary(q.reshape(B, T, H // 2, 2 * Dq), cos, sin)
            k = apply_rotary(k.reshape(B, T, H // 2, 2 * Dq), cos, sin)
            q, k, v = paired_view(q.view(B, T, H, Dq)), paired_view(k.view(B, T, H, Dq)), paired_view(v)
            if aux_v is not None:
                v = v + self.value_part(aux_v).view_as(v)
        else:
            cos, sin = rotary.cos[rows, None], rotary.sin[rows, None]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if plan.long_window:
                k = self.key_offset(k, masks, cache)
            if aux_v is not None:
                v = v + self.value_part(aux_v).view_as(v)
        scale = rotary.attn_scale
        if cache is None:  # the kernels take (B, H, T, D)
            y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            masks.get(plan.long_window, plan.paired), scale).transpose(1, 2)
            keys, values, docs = k, v, masks.docs
        else:
            y, keys, values, docs = self.attend_cached(q, k, v, inputs, cache)
        if extras.dc_w is not None:
            y = y + self.dc(q, keys, values, docs, extras.dc_w, scale)
        y = y.reshape(B, T, H, Dv)  # a paired layer's interleaved heads back in order
        xsa_alpha, gate = extras.xsa_alpha, extras.gate
        if xsa_alpha is not None:  # XSA: take out a learned share of the output along the value's direction
            y = y - torch.tanh(xsa_alpha).type_as(y).view(B, T, H, 1) * along(y, v)
        if gate is not None:
            y = y * gate.type_as(y).view(B, T, H, 1)
        return F.linear(y.reshape(B, T, H * Dv), lambdas[1] * self.out_weight().type_as(y))

    def value_part(self, aux_v: Tensor) -> Tensor:
        """What the values take of an addition made at full width, (B, T, dim): each head's first v_dim dims."""
        if self.v_dim == self.head_dim:
            return aux_v
        return aux_v.unflatten(-1, (self.num_heads, self.head_dim))[..., :self.v_dim].contiguous()

    def key_offset(self, k: Tensor, masks: Masks, cache: AttentionCache | None) -> Tensor:
        """Each key's stationary dims (those rotary does not turn) are the previous token's: one layer can then
        match a token to what followed its earlier occurrences (induction). Position 0 keeps its own."""
        still = self.rotary_dims
        first = k[:, :1, :, still:] if cache is None or cache.last_key_half is None else cache.last_key_half
        if cache is not None:
            cache.last_key_half = k[:, -1:, :, still:]
        shifted = torch.cat([first, k[:, :-1, :, still:]], dim=1)
        if masks.fresh is not None:
            shifted = torch.where(masks.fresh[None, :, None, None], k[..., still:], shifted)
        return torch.cat([k[..., :still], shifted], dim=-1)

    def dc(self, q: Tensor, keys: Tensor, values: Tensor, docs: Tensor, dc_w: tuple, scale: Tensor) -> Tensor:
        w1, w2 = dc_w
        w1 = F.rms_norm(w1.float(), (w1.size(-1),), eps=DC_NORM_EPS)
        T = q.size(1)
        if T != keys.size(1):
            return self.dc_cached(q, keys, values, docs, (w1, w2), scale)
        # training and validation: the whole sequence at once
        block = self.window_block
        pad = -T % block
        if pad:  # only generation-length sequences fall here
            q, keys, values = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, keys, values))
            docs = F.pad(docs, (0, pad), value=-2)
            w1, w2 = F.pad(w1, (0, 0, 0, pad)), F.pad(w2, (0, 0, 0, pad))
        out = dc_correction(q, keys, values, dc_visible(docs, self.dc_window, block), (w1, w2), scale)
        return out[:, :T]

    # Generation (sample.py): new positions against the keys and values cached so far

    def attend_cached(self, q: Tensor, k: Tensor, v: Tensor, inputs: LayerInputs,
                      cache: AttentionCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The new queries against every cached key (the new ones added to the cache first), with a dense
        mask of their window: (output, keys, values, document ids of the keys)."""
        keys, values = cache.extend(k, v)
        docs = inputs.masks.docs.repeat_interleave(2) if self.plan.paired else inputs.masks.docs
        window = window_tokens(inputs.masks.windows, self.plan.long_window, self.window_block)
        mask = dense_attention_mask(docs, window, num_queries=q.size(1))
        y = attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask,
                      inputs.rotary_of(self.plan).attn_scale).transpose(1, 2)
        return y, keys, values, docs

    def dc_cached(self, q: Tensor, keys: Tensor, values: Tensor, docs: Tensor, dc_w: tuple, scale: Tensor) -> Tensor:
        """DC's correction of the new queries against the cached keys, densely (a few positions); w1 normed."""
        w1, w2 = dc_w
        T = q.size(1)
        start = keys.size(1) - T
        pos = torch.arange(start, start + T, device=q.device)
        distance = pos[:, None] - torch.arange(keys.size(1), device=q.device)[None, :]
        visible = (distance >= 0) & (distance < self.dc_window) & (docs[start:][:, None] == docs[None, :])
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys.float()) * scale.float()
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        mixed = torch.einsum("bhqk,bqh->bqk", probs, w1)
        return torch.einsum("bqk,bkhd->bqhd", mixed.type_as(values), values) * w2.unsqueeze(-1).type_as(values)


# FP8 matmuls (record #85): e4m3 operands with per-tensor scales, bf16 out, through torch._scaled_mm, whose
# first operand must be row-major and second column-major. Gradients go in e5m2 (record #92's MLP, the heads).
FP8_E4M3_MAX, FP8_E5M2_MAX = 448.0, 57344.0
HEAD_X_SCALE, HEAD_W_SCALE, HEAD_GRAD_SCALE = 100 / FP8_E4M3_MAX, 1.6 / FP8_E4M3_MAX, 0.75 / FP8_E4M3_MAX


class HeadFp8(NamedTuple):
    """How the FP8 head computes (head_loss): x / x_scale and the lm_head W / w_scale in e4m3, the logits' gradient
    divided by loss_scale * grad_scale in e5m2. `record`: whose kernel's roundings it keeps besides. 85 (records #85
    to #89): bf16 logits, squashed in bf16; W's copy W / w_scale, rounded once. 92 (record #92): the logits
    rounded to e4m3 (its matmul writes them as e4m3 bytes), squashed in fp16; W's copy W times the fp32 reciprocal
    of w_scale, rounded to W's dtype (its kernel matches the eager W.div(w_s) in bf16), clipped at e4m3's largest."""
    x_scale: float
    w_scale: float
    grad_scale: float
    record: int

    @property
    def w_reciprocal(self) -> float:
        """1 / w_scale in fp32 (record #92's copy multiplies by it: 223.99998 for 2.0/448, not 224)."""
        return FP32_RECIPROCALS[self.w_scale]

    @property
    def logits(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.record == 92 else torch.bfloat16


HEAD_FP8_85 = HeadFp8(HEAD_X_SCALE, HEAD_W_SCALE, HEAD_GRAD_SCALE, 85)
# Record #92 (--lm_head_fp8_logits): the lm_head's copy holds entries up to 2.0 (its weights' range); the gradient's
# scale is 8 times smaller, an exact binade shift that moves e5m2's flush-to-zero floor three octaves down (the
# largest quotient, (cap / width) S_w / 4 / grad_scale < 3,700 S_w for the multi-token weights' sum S_w, stays far
# below e5m2's 57,344).
HEAD_FP8_92 = HeadFp8(HEAD_X_SCALE, 2.0 / FP8_E4M3_MAX, 0.75 / 8 / FP8_E4M3_MAX, 92)
FP32_RECIPROCALS = {s: float(np.float32(1) / np.float32(s)) for s in (HEAD_FP8_85.w_scale, HEAD_FP8_92.w_scale)}


def scaled_mm(a: Tensor, b: Tensor, scale_a, scale_b, out_dtype: torch.dtype, fast_accum: bool = False) -> Tensor:
    """(a * scale_a) @ (b * scale_b) for float8 a (row-major) and b (column-major); scales: floats or fp32
    0-dim tensors."""
    as_tensor = lambda s: s if isinstance(s, Tensor) else a.new_full((), s, dtype=torch.float32)
    return torch._scaled_mm(a, b, scale_a=as_tensor(scale_a), scale_b=as_tensor(scale_b), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def round_to_bf16(x: Tensor) -> Tensor:
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: x.to(bf16).float() for finite x, written
    as integer arithmetic on its bits. Inductor drops a cast down and back up as a no-op in a fused kernel unless
    a config flag (emulate_precision_casts) is set, which the public record rules forbid; it keeps this."""
    bits = x.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # add half an ulp of bf16 (ties to even), cut 16 bits
    return bits.view(torch.float32)


def round_to_fp16(x: Tensor) -> Tensor:
    """fp32 x rounded to the nearest fp16 (ties to even), kept in fp32: x.to(fp16).float() for |x| < 65504, written
    so that inductor keeps it (as round_to_bf16). fp16's normal numbers keep 10 of fp32's 23 mantissa bits; below
    2^-14 its subnormals are the multiples of 2^-24, which rounding x * 2^24 to an integer (ties to even) finds."""
    bits = x.view(torch.int32)
    normal = ((bits + (0xFFF + ((bits >> 13) & 1))) & -8192).view(torch.float32)
    return torch.where(x.abs() < 2.0 ** -14, torch.round(x * 2.0 ** 24) * 2.0 ** -24, normal)


def relu_square_grad(out: Tensor, grad: Tensor) -> Tensor:
    """The gradient of relu(h)^2 from its output, 2 relu(h) grad. The root of a rounded square is exact in
    fp32, and in bf16 once rounded back to bf16 (compiled, the root is taken in fp32), so this is bit for bit
    the gradient h gives (short of underflow)."""
    root = out.float().sqrt()
    if out.dtype == torch.bfloat16:
        root = round_to_bf16(root)
    return 2 * root.type_as(grad) * grad


class ReluSquare(torch.autograd.Function):
    """relu(h)^2 keeping only its output for the backward, which takes relu(h) from its root (record #87): no
    copy of h is kept or read again."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        out = F.relu(h).square()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        out, = ctx.saved_tensors
        return relu_square_grad(out, grad)


class ReluSquaredMLP(torch.autograd.Function):
    """relu(x @ fc.T)^2 @ proj with the up-projection's forward in FP8 (record #85): x is scaled by its own
    absolute maximum (per tensor, each call), fc by a per-layer scale refreshed after each optimizer step
    (refresh_fp8). Given proj's e4m3 copy (proj_f8_t: (dim, hidden)) with its scale and the activation's scale,
    the down-projection's forward is FP8 too (record #89): relu^2's bf16 output divided by the activation's
    scale, clipped at e4m3's largest value; it then also returns that output's absolute maximum, from which
    the next forward's scale is set (MLP.forward). The backward uses the weights and x in their own dtype
    (bf16), as the records', and takes relu from the square it keeps (ReluSquare)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc: Tensor, proj: Tensor, fc_f8: Tensor, fc_scale: Tensor,
                proj_f8_t: Tensor | None = None, proj_scale: Tensor | None = None, act_scale: Tensor | None = None):
        x2 = x.flatten(0, -2)  # (tokens, dim): _scaled_mm takes 2-D operands
        x8, x_scale = fp8_activation(x2.detach())
        post = F.relu(scaled_mm(x8, fc_f8.T, x_scale, fc_scale, x.dtype, fast_accum=True)).square()
        ctx.save_for_backward(x2, fc, proj, post)
        if proj_f8_t is None:
            return (post @ proj.type_as(post)).view(*x.shape[:-1], -1)
        post8 = (post.float() * (1 / act_scale)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # post >= 0
        out = scaled_mm(post8, proj_f8_t.T, act_scale, proj_scale, x.dtype, fast_accum=True)
        post_amax = post.detach().amax().float()
        ctx.mark_non_differentiable(post_amax)
        return out.view(*x.shape[:-1], -1), post_amax

    @staticmethod
    def backward(ctx, grad: Tensor, *_):
        x2, fc, proj, post = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.size(-1))
        grad_proj = post.T @ grad2
        grad_pre = relu_square_grad(post, grad2 @ proj.T.type_as(grad2))
        grad_fc = grad_pre.T @ x2
        grad_x = grad_pre @ fc.type_as(grad_pre)
        return grad_x.view(grad.shape), grad_fc, grad_proj, None, None, None, None, None


def in_dtype_of(like: Tensor, x: Tensor) -> Tensor:
    """fp32 x as `like`'s dtype would hold it: rounded to bf16 for bf16, kept in fp32. Written with round_to_bf16,
    which inductor keeps, where the record computes in bf16 eagerly (a cast inductor drops)."""
    return round_to_bf16(x) if like.dtype == torch.bfloat16 else x


def fp8_activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """The up-projection's input in e4m3 at its own absolute maximum, and the scale back (fp32). The record
    computes the factor `448.0 / max` and the product in x's dtype (bf16), then casts; PyTorch divides a number by
    a tensor as the tensor's reciprocal times the number, each rounded."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    factor = in_dtype_of(x, in_dtype_of(x, 1 / amax) * FP8_E4M3_MAX)
    scaled = in_dtype_of(x, x.float() * factor)
    return scaled.to(torch.float8_e4m3fn), amax / FP8_E4M3_MAX


def mlp_fp8(fc: Tensor) -> tuple[Tensor, Tensor]:
    """An MLP up-projection's e4m3 copy and its scale (fp32), by the weight's absolute maximum: the scale and
    the division in fc's dtype (bf16 on GPUs), as the record's."""
    scale = in_dtype_of(fc, fc.abs().amax().float().clamp(min=1e-12) / FP8_E4M3_MAX)
    return in_dtype_of(fc, fc.float() / scale).to(torch.float8_e4m3fn), scale


# Record #89's delayed scaling of the down-projection. Its input's scale is 1.8x the absolute maximum of the
# layer's previous training forward on this rank (no all-reduce), over e4m3's largest value; its weight's is
# 1.12x the weight's absolute maximum after the previous step, but the exact maximum (no headroom) for the
# first 16 steps and at the start. Both maxima come from passes that run anyway; values past a scale clip.
DOWN_ACT_HEADROOM, DOWN_WEIGHT_HEADROOM, DOWN_EXACT_STEPS = 1.8, 1.12, 16
# Those scales, each an MLP's buffer (run state, saved with the weights; the activation's differs between ranks):
# a resume checks that a checkpoint holds positive ones (check_run_state).
FP8_SCALES = ("down_act_scale", "down_weight_scale", "down_weight_next_scale")


def mlp_down_fp8(proj: Tensor, used: Tensor, upcoming: Tensor, scales: str) -> tuple[Tensor, Tensor, Tensor]:
    """A down-projection's e4m3 copy, (dim, hidden) so that its transpose is the column-major operand
    _scaled_mm takes, with the scale it was quantised at and the scale for the next refresh. `scales`: "exact"
    (the weight's own maximum, in its dtype as the record's), "delayed" (`upcoming`, set by the previous refresh)
    or "stored" (`used` as loaded: the copy of a checkpoint's weights, its scales unchanged)."""
    amax = proj.abs().amax()
    if scales == "exact":
        used = in_dtype_of(proj, amax.float().clamp(min=1e-12) / FP8_E4M3_MAX)
    elif scales == "delayed":
        used = upcoming
    w8_t = (proj.float() / used).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).T.contiguous()
    if scales != "stored":
        upcoming = amax.float().clamp(min=1e-12) * (DOWN_WEIGHT_HEADROOM / FP8_E4M3_MAX)
    return w8_t, used, upcoming


# Record #92's full-stack FP8 MLP (--mlp_full_fp8). Static scales where a bound is known: the input, normed rows
# whose entries are at most sqrt(dim) (27.7 at 768) and so under 448 * 2^-4 = 28 up to dim 784: none clips; the
# gradient reaching the output, in e5m2, whose range (2^-16 to 57,344 times the scale) holds it. Delayed ones
# elsewhere, set by refresh_fp8 after each step from maxima the passes take anyway: relu^2's output, 1.03 x the
# largest of the step's forwards on this rank (fresh each step: a small headroom); the gradient of the
# up-projection's output (dpre), 1.25 x the largest of the step's backwards; both kept where a step saw nothing
# (no forward: the start's 1.0 and 2^-6 stay), and floored. The weights: exact at the first FULL_EXACT_REFRESHES
# refreshes (the start's and after steps 0 to 14), then 1.12x (DOWN_WEIGHT_HEADROOM) the previous refresh's
# maximum, which the quantising pass reads, so that no reduction precedes it. Values past a scale clip.
MLP_X_SCALE, MLP_GRAD_SCALE = 2.0 ** -4, 2.0 ** -6
POST_HEADROOM, POST_FLOOR = 1.03, 1e-6
DPRE_HEADROOM, DPRE_FLOOR = 1.25, 1e-12
FULL_EXACT_REFRESHES = 16


class Fp8Mlp(NamedTuple):
    """One MLP's state under record #92's FP8 (MLP's buffers, renewed by refresh_fp8): the up-projection's e4m3 copy
    in both layouts, fc8 (hidden, dim) and fc8_t (dim, hidden), at fc_scale, and the scale its next delayed refresh
    takes; the down-projection's likewise; relu^2's output's scale and the largest output since the last refresh;
    dpre's scale and largest magnitude. The scales and maxima are fp32 0-dim tensors."""
    fc8: Tensor
    fc8_t: Tensor
    fc_scale: Tensor
    fc_next: Tensor
    proj8: Tensor
    proj8_t: Tensor
    proj_scale: Tensor
    proj_next: Tensor
    post_scale: Tensor
    post_amax: Tensor
    dpre_scale: Tensor
    dpre_amax: Tensor


# Which of Fp8Mlp's fields are checkpointed: the scales (model.pt; relu^2's and dpre's also per rank, rank_R.pt, as
# each rank's own passes set them); the copies and maxima are remade (the maxima are 0 between steps).
FP8_MLP_SAVED = ("fc_scale", "fc_next", "proj_scale", "proj_next", "post_scale", "dpre_scale")
FP8_MLP_START = {"dpre_scale": MLP_GRAD_SCALE, "post_amax": 0.0, "dpre_amax": 0.0}  # the record's start; others 1
FP8_MLP_PER_RANK = ("post_scale", "dpre_scale")


def fp8_transpose(t: Tensor) -> Tensor:
    """A float8 matrix's transpose, contiguous (moved as bytes: no float8 arithmetic)."""
    return t.view(torch.uint8).T.contiguous().view(t.dtype)


def quantise(x: Tensor, scale, dtype: torch.dtype) -> Tensor:
    """x / scale (as x times the fp32 reciprocal of scale), clipped at dtype's largest value, in e4m3 or e5m2."""
    largest = FP8_E4M3_MAX if dtype == torch.float8_e4m3fn else FP8_E5M2_MAX
    return (x.float() * (1 / scale)).clamp(-largest, largest).to(dtype)


def mlp_weight_fp8(w: Tensor, used: Tensor, upcoming: Tensor, scales: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Record #92's e4m3 copy of an MLP weight (rows, dim) in both layouts, (rows, dim) and (dim, rows), with the scale
    it was taken at and the next refresh's. `scales`: "exact" (max|w| / 448, floored at 1e-12, in w's dtype as the
    record's), "delayed" (`upcoming`: 1.12 max|w| / 448 of the previous refresh, in fp32, floored at 1e-12) or
    "stored" (`used` as loaded)."""
    amax = w.abs().amax().float()
    if scales == "exact":
        used = in_dtype_of(w, in_dtype_of(w, amax.clamp(min=1e-12)) / FP8_E4M3_MAX)
    elif scales == "delayed":
        used = upcoming
    w8 = (w.float() / used).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    if scales != "stored":
        upcoming = (amax * (DOWN_WEIGHT_HEADROOM / FP8_E4M3_MAX)).clamp(min=1e-12)
    return w8, fp8_transpose(w8), used, upcoming


def delayed_scale(amax: Tensor, scale: Tensor, headroom: float, largest: float, floor: float) -> Tensor:
    """The next delayed scale from the largest value `amax` the passes saw: headroom * amax / largest, floored; the
    current `scale` where they saw none (0, or not finite)."""
    a = torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0).clamp(max=1e12)
    return torch.where(a > 0, (a * (headroom / largest)).clamp(min=floor), scale)


def mlp_full_fp8(fc: Tensor, proj: Tensor, state: Fp8Mlp, scales: str) -> Fp8Mlp:
    """An MLP's record #92 FP8 state after its weights changed: both weights' copies (mlp_weight_fp8, `scales` as
    there), and, after a training step ("exact" or "delayed"), relu^2's and dpre's scales from the step's maxima,
    which start over at 0."""
    fc8, fc8_t, fc_scale, fc_next = mlp_weight_fp8(fc, state.fc_scale, state.fc_next, scales)
    proj8, proj8_t, proj_scale, proj_next = mlp_weight_fp8(proj, state.proj_scale, state.proj_next, scales)
    post_scale, dpre_scale = state.post_scale, state.dpre_scale
    if scales != "stored":
        post_scale = delayed_scale(state.post_amax, post_scale, POST_HEADROOM, FP8_E4M3_MAX, POST_FLOOR)
        dpre_scale = delayed_scale(state.dpre_amax, dpre_scale, DPRE_HEADROOM, FP8_E5M2_MAX, DPRE_FLOOR)
    return Fp8Mlp(fc8, fc8_t, fc_scale, fc_next, proj8, proj8_t, proj_scale, proj_next,
                  post_scale, torch.zeros_like(state.post_amax), dpre_scale, torch.zeros_like(state.dpre_amax))


def full_scales(step: int) -> str:
    """How the refresh after an optimizer step moves record #92's weight scales: the start's refresh is its first."""
    return "exact" if step + 1 < FULL_EXACT_REFRESHES else "delayed"


class Fp8ReluSquaredMLP(torch.autograd.Function):
    """relu(x @ fc.T)^2 @ proj with both projections in FP8, forward and backward (record #92), from the state's
    copies and scales s (Fp8Mlp). With q4, q5 rounding to e4m3 and e5m2 (clipped at their largest values) and r
    rounding to x's dtype (bf16 on GPUs, where the record's kernels store or round):
        forward:   x8 = q4(x / 2^-4)   pre = r(x8 fc8^T 2^-4 s_fc)   post = r(relu(pre)^2)   post8 = q4(post / s_post)
                   out = post8 proj8 s_post s_proj
        backward:  g8 = q5(g / 2^-6)   grad_proj = post8^T g8 s_post 2^-6
                   dpre = r(2 (g8 proj8^T 2^-6 s_proj) sqrt(post8 s_post))   dpre8 = q5(dpre / s_dpre)
                   grad_fc = dpre8^T x8 s_dpre 2^-4   grad_x = dpre8 fc8 s_dpre s_fc
    relu(pre) is post's root, taken from the e4m3 post8 kept for the backward (with x8: one byte each); dpre's
    product stays in fp32 until its one rounding, as in the record's epilogue. Fast accumulation in the forward's
    matmuls only. Each forward raises s.post_amax to max(post), each backward s.dpre_amax to max |dpre|: the next
    step's scales (mlp_full_fp8)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc: Tensor, proj: Tensor, s: Fp8Mlp) -> Tensor:
        x8 = quantise(x.flatten(0, -2), MLP_X_SCALE, torch.float8_e4m3fn)  # (tokens, dim): _scaled_mm's 2-D operand
        pre = scaled_mm(x8, s.fc8.T, MLP_X_SCALE, s.fc_scale, x.dtype, fast_accum=True)
        post = in_dtype_of(x, F.relu(pre.float()).square())
        s.post_amax.copy_(torch.maximum(s.post_amax, post.amax()))
        post8 = quantise(post, s.post_scale, torch.float8_e4m3fn)
        out = scaled_mm(post8, s.proj8_t.T, s.post_scale, s.proj_scale, x.dtype, fast_accum=True)
        ctx.save_for_backward(x8, post8)
        ctx.state, ctx.dtypes = s, (x.dtype, fc.dtype, proj.dtype)
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x8, post8 = ctx.saved_tensors
        s, (x_dtype, fc_dtype, proj_dtype) = ctx.state, ctx.dtypes
        g8 = quantise(grad.reshape(-1, grad.size(-1)), MLP_GRAD_SCALE, torch.float8_e5m2)
        grad_proj = scaled_mm(fp8_transpose(post8), fp8_transpose(g8).T, s.post_scale, MLP_GRAD_SCALE, proj_dtype)
        product = scaled_mm(g8, s.proj8.T, MLP_GRAD_SCALE, s.proj_scale, torch.float32)
        dpre = 2 * product * (post8.float() * s.post_scale).sqrt()
        if x_dtype == torch.bfloat16:
            dpre = round_to_bf16(dpre)
        s.dpre_amax.copy_(torch.maximum(s.dpre_amax, dpre.abs().amax()))
        dpre8 = quantise(dpre, s.dpre_scale, torch.float8_e5m2)
        grad_fc = scaled_mm(fp8_transpose(dpre8), fp8_transpose(x8).T, s.dpre_scale, MLP_X_SCALE, fc_dtype)
        grad_x = scaled_mm(dpre8, s.fc8_t.T, s.dpre_scale, s.fc_scale, x_dtype)
        return grad_x.view(grad.shape), grad_fc, grad_proj, None


def record89_down_scales(args: Hyperparameters) -> bool:
    """Whether the MLPs carry record #89's down-projection scales: --mlp_down_fp8, unless --mlp_full_fp8 takes its
    place (tools/record_weights.py asks too)."""
    return args.mlp_down_fp8 and not args.mlp_full_fp8


class MLP(nn.Module):
    """ReLU^2 MLP. fc is (hidden, dim), proj (hidden, dim): the record's layouts, x @ proj for the
    down-projection. scaled_down (--mlp_down_fp8): the down-projection's delayed scales are run state (buffers
    saved with the weights; the activation's is per rank), used where the up-projection runs in FP8. full
    (--mlp_full_fp8, in place of scaled_down): record #92's FP8 forward and backward (Fp8ReluSquaredMLP), its state
    (Fp8Mlp) in buffers fp8_<field>, the scales saved with the weights (FP8_MLP_SAVED; some per rank)."""

    def __init__(self, dim: int, hidden: int, precision: str, scaled_down: bool = False, full: bool = False):
        super().__init__()
        self.precision = precision
        self.fc = nn.Parameter(torch.empty(hidden, dim))
        self.proj = nn.Parameter(torch.zeros(hidden, dim))  # zero init: each layer starts as the identity
        uniform_init_(self.fc, 0.5 * dim ** -0.5)
        self.full_fp8 = full and precision == "fp8"
        self.down_fp8 = scaled_down and not full and precision == "fp8"
        if scaled_down and not full:
            for name in FP8_SCALES:
                self.register_buffer(name, torch.ones((), dtype=torch.float32))
        if full:
            self.register_fp8_state(hidden, dim)
        elif precision == "fp8":
            self.register_buffer("fc_f8", torch.zeros(hidden, dim, dtype=torch.float8_e4m3fn), persistent=False)
            self.register_buffer("fc_scale", torch.ones((), dtype=torch.float32), persistent=False)
        if self.down_fp8:
            self.register_buffer("proj_f8_t", torch.zeros(dim, hidden, dtype=torch.float8_e4m3fn),
                                 persistent=False)
        self.refresh_fp8("exact")

    def register_fp8_state(self, hidden: int, dim: int):
        """Record #92's FP8 state at its start: scales 1, dpre's 2^-6 (the record's), maxima 0; the copies (only
        where the MLP runs in FP8) are made by refresh_fp8."""
        shapes = {"fc8": (hidden, dim), "fc8_t": (dim, hidden), "proj8": (hidden, dim), "proj8_t": (dim, hidden)}
        for name in Fp8Mlp._fields:
            if name in shapes:
                if self.full_fp8:
                    self.register_buffer("fp8_" + name, torch.zeros(shapes[name], dtype=torch.float8_e4m3fn),
                                         persistent=False)
            else:
                self.register_buffer("fp8_" + name, torch.tensor(FP8_MLP_START.get(name, 1.0), dtype=torch.float32),
                                     persistent=name in FP8_MLP_SAVED)

    def fp8_state(self) -> Fp8Mlp:
        return Fp8Mlp(*(getattr(self, "fp8_" + name) for name in Fp8Mlp._fields))

    def set_fp8_state(self, state: Fp8Mlp):
        for name, t in zip(Fp8Mlp._fields, state):  # assigned, not copied into: see refresh_fp8
            setattr(self, "fp8_" + name, t)

    @torch.no_grad()
    def refresh_fp8(self, scales: str = "stored"):
        """The FP8 copies the forward reads: after every change of fc and proj (the model's refresh_fp8 does all
        layers at once; `scales` as mlp_down_fp8's, or under --mlp_full_fp8 as mlp_full_fp8's)."""
        if self.full_fp8:
            self.set_fp8_state(mlp_full_fp8(self.fc, self.proj, self.fp8_state(), scales))
        elif self.precision == "fp8":
            # assigned, not copied into: a module-wide cast such as .bfloat16() must not change their dtypes
            self.fc_f8, self.fc_scale = mlp_fp8(self.fc)
        if self.down_fp8:
            self.proj_f8_t, self.down_weight_scale, self.down_weight_next_scale = mlp_down_fp8(
                self.proj, self.down_weight_scale.float(), self.down_weight_next_scale.float(), scales)

    def forward(self, x: Tensor) -> Tensor:
        if self.precision == "fp8" and self.training:
            if self.full_fp8:
                return Fp8ReluSquaredMLP.apply(x, self.fc, self.proj, self.fp8_state())
            if not self.down_fp8:
                return ReluSquaredMLP.apply(x, self.fc, self.proj, self.fc_f8, self.fc_scale)
            out, post_amax = ReluSquaredMLP.apply(x, self.fc, self.proj, self.fc_f8, self.fc_scale, self.proj_f8_t,
                                                  self.down_weight_scale, self.down_act_scale)
            self.down_act_scale.copy_(post_amax.clamp(min=1e-12) * (DOWN_ACT_HEADROOM / FP8_E4M3_MAX))
            return out
        return ReluSquare.apply(F.linear(x, self.fc.type_as(x))) @ self.proj.type_as(x)


@dataclass
class LayerInputs:
    """What every layer reads besides the stream: the embedding's normed state x0, the bigram injection,
    the value-embedding rows of each table (a (T, dim) tensor each), the per-token gates by name (GateLayout), the
    states MUDD and the skip read (0: the stream's start; the skip source; the shared-input layer; "last":
    the MUDD layer's input; "mlp_in": its normed MLP input, where the head mix reads it), the masks (with their
    windows) and the rotary modules (full-width heads', and narrow heads' where some layer has them)."""
    x0: Tensor
    x0_bigram: Tensor
    ve: tuple
    gates: dict
    saved: dict
    masks: Masks
    rotary: Rotary
    narrow_rotary: Rotary | None = None

    def rotary_of(self, plan: LayerPlan) -> Rotary:
        return self.narrow_rotary if plan.narrow_qk else self.rotary


class LayerMix(NamedTuple):
    """The MUDD layer's 14 coefficients, each (1, T, 1), in the order its MUDD net gives them (record #85's):
    what its attention's values and input take of the stream's start (x0), the shared-input layer's output
    and the stream itself (whose own weight is 1 + input_stream); the value-embedding gates of the first and
    second half of the heads; the weights of the sums after the attention and after the MLP."""
    value_x0: Tensor
    value_shared: Tensor
    value_stream: Tensor
    input_x0: Tensor
    input_shared: Tensor
    input_stream: Tensor
    ve_gate_first: Tensor
    ve_gate_second: Tensor
    attn_stream: Tensor
    attn_out: Tensor
    attn_x0: Tensor
    attn_bigram: Tensor
    mlp_stream: Tensor
    mlp_out: Tensor


# The states the head mix can add (--head_mix), besides the value embeddings' rows ("ve<N>"): the stream's start,
# the shared-input layer's output, the last layer's input, the skip source's output, the last layer's normed MLP
# input, and the normed shared input (the attention input of the layers after the shared-input layer).
HEAD_MIX_STATES = ("x0", "shared", "last", "skip", "mlp_in", "shared_in")


@dataclass
class LayerWeights:
    """What GPT.hidden hands one layer of the model's shared tensors: its attention lambdas (qkv, output),
    residual and post lambdas (attention, MLP; bf16), its value-embedding gate weights, the skip weight (at
    the skip target) and the MUDD coefficients (at the MUDD layer)."""
    lambdas: Tensor
    resid: Tensor
    post: Tensor
    ve_gate: Tensor | None
    skip: Tensor | None
    mix: LayerMix | None


@dataclass
class AttentionExtras:
    """What a layer adds to its attention: the values' additions (value embeddings, MUDD), the XSA strengths,
    the attention gates and the DC weights (w1, w2), each None where the layer has none."""
    aux_v: Tensor | None
    xsa_alpha: Tensor | None
    gate: Tensor | None
    dc_w: tuple | None


class Block(nn.Module):
    """One layer: attention (or, at the skip target, the gated skip) then the MLP, each added to the
    stream with the layer's residual and post lambdas, with the x0 and bigram injections; the MUDD layer
    (LayerMix: its MUDD net's 14 coefficients) mixes earlier states around both. A layer without attention
    takes its residual lambda and injections alone before its MLP; a removed layer (record #92) takes them
    alone, and its MLP's residual lambda, with no MLP. A parallel MLP (record #92) reads the MLP's input and
    adds its output with the same post lambda. On CUDA each block is compiled on its own: one graph per kind of
    layer and sequence length, and the gradient hooks of its parameters fire as soon as its backward is done."""

    def __init__(self, plan: LayerPlan, args: Hyperparameters, mlp_precision: str, saves_mlp_input: bool = False):
        super().__init__()
        self.plan = plan
        self.skip_from, self.shared_layer = skip_pair(args)[0], args.shared_input_layer  # the states it may read
        self.norm_eps, self.saves_mlp_input = args.norm_eps, saves_mlp_input
        self.attn = CausalSelfAttention(plan, args) if plan.attention else None
        make_mlp = lambda: MLP(args.model_dim, mlp_width(args), mlp_precision, args.mlp_down_fp8,
                               args.mlp_full_fp8)
        self.mlp = None if plan.removed else make_mlp()
        self.parallel_mlp = make_mlp() if plan.parallel_mlp else None

    def inject(self, x: Tensor, inputs: LayerInputs) -> Tensor:
        """The x0 and bigram injections after a layer's attention (layer 0's bigram one came before the first
        layer)."""
        plan, gates = self.plan, inputs.gates
        if plan.x0_inject:
            x = x + inputs.x0 * gates[("x0", plan.index)]
        if plan.bigram_inject and plan.index != 0:
            x = x + inputs.x0_bigram * gates[("bigram", plan.index)]
        return x

    def forward(self, x: Tensor, inputs: LayerInputs, weights: LayerWeights,
                cache: AttentionCache | None = None) -> Tensor:
        plan, saved = self.plan, inputs.saved
        mu, resid, post = weights.mix, weights.resid, weights.post
        if plan.removed:
            return resid[1] * self.inject(resid[0] * x, inputs)
        if plan.skip_target:
            x = x + torch.sigmoid(weights.skip) * inputs.gates[("skip",)] * saved[self.skip_from]
        elif not plan.attention:
            x = self.inject(resid[0] * x, inputs)
        else:
            x = self.attention(x, inputs, weights, cache)
        h = norm(x, self.norm_eps)
        if self.saves_mlp_input:
            saved["mlp_in"] = h
        stream, out = (mu.mlp_stream, mu.mlp_out) if mu is not None else (resid[1], post[1])
        x = stream * x + out * self.mlp(h)
        if self.parallel_mlp is not None:
            x = x + out * self.parallel_mlp(h)
        return x

    def attention(self, x: Tensor, inputs: LayerInputs, weights: LayerWeights, cache: AttentionCache | None) -> Tensor:
        """The attention sublayer and what the stream takes of it (the MUDD layer: its MUDD coefficients')."""
        plan, i, saved, gates = self.plan, self.plan.index, inputs.saved, inputs.gates
        mu, resid, post = weights.mix, weights.resid, weights.post
        B, T, dim = x.shape
        attn_in = norm(saved[self.shared_layer] if plan.shared_input else x, self.norm_eps)
        H = self.attn.num_heads
        # this layer's value-embedding rows, per head: (1, T, H, D), like the values
        table = inputs.ve[plan.value_embed].view(1, T, H, -1) if plan.value_embed is not None else None
        if mu is not None:  # the MUDD layer
            shared = saved[self.shared_layer]
            v_mudd = (mu.value_x0 * saved[0] + mu.value_shared * shared + mu.value_stream * x).view(1, T, H, -1)
            x = (1 + mu.input_stream) * x + mu.input_x0 * saved[0] + mu.input_shared * shared
            gate = torch.cat([mu.ve_gate_first, mu.ve_gate_second], dim=-1).repeat_interleave(H // 2, dim=-1)
            gate = gate.unsqueeze(-1)
            aux_v = (gate * table + v_mudd).view(1, T, -1)
        elif table is not None:
            gate_in = torch.cat([attn_in[..., :VE_GATE_CHANNELS], table.view(1, T, -1)[..., :VE_GATE_CHANNELS]],
                                dim=-1)
            aux_v = (2 * torch.sigmoid(F.linear(gate_in, weights.ve_gate)).view(1, T, H, 1) * table).view(1, T, -1)
        else:
            aux_v = None
        dc_w = (gates[("dc_w1", i)], gates[("dc_w2", i)]) if plan.dc else None
        extras = AttentionExtras(aux_v, gates.get(("xsa", i)) if plan.xsa else None,
                                 gates.get(("attn", i)) if plan.attn_gate else None, dc_w)
        attn_out = self.attn(attn_in, weights.lambdas, extras, inputs, cache)
        if mu is not None:
            return (mu.attn_stream * x + mu.attn_out * attn_out + saved[0] * mu.attn_x0
                    + inputs.x0_bigram * mu.attn_bigram)
        return self.inject(resid[0] * x + post[0] * attn_out, inputs)


class HeadLoss(NamedTuple):
    """How SoftcappedMTPLoss computes: the softcap (A, shift, width), the rows of logits per chunk, the lm_head's
    FP8 copies ((dim, vocab) and (vocab, dim) in e4m3, refreshed by refresh_fp8; None: no FP8), and the function
    that computes the loss and both gradients (head_loss, compiled on CUDA)."""
    cap: tuple
    chunk: int
    fp8_weights: tuple | None
    fn: Callable


class Candidates(NamedTuple):
    """Record #92's sampled softmax, one micro-batch's: the candidate classes C, ascending (P,), and the position
    in C of each row's target (T,) and of its prefix target (T,; -1 where the row has none or C does not hold
    it; None where the step has no prefix term). CandidateSampler makes them on the host (numpy), to_device
    copies them (int64 tensors)."""
    columns: Tensor
    target_positions: Tensor
    prefix_positions: Tensor | None

    def to_device(self, device: torch.device) -> "Candidates":
        """The host's numpy arrays as int64 tensors on the device, copied without a host sync."""
        return Candidates(*(None if a is None else host_to_device(torch.from_numpy(a), device) for a in self))


class SoftcappedMTPLoss(torch.autograd.Function):
    """Record #85's training loss and its gradient, without a full logits tensor. Logits u = x @ W (FP8 or
    not), z = cap * sigmoid((u + shift) / width); the loss is sum_t sum_k w_k (lse_t - z_t[y_{t+k}]) over the
    k with t + k inside the sequence, times loss_scale. The forward (head_loss) computes the loss and both
    gradients, chunk by chunk of rows, as the record's fused kernel does, and keeps them for backward, which
    scales them by its incoming gradient; and with the kernel's gradient: on the last rows of a sequence, where
    some of the k have no target, the softmax term still carries the sum of all the weights (autograd of the
    loss above would carry only the valid ones').

    prefix = (targets, weight (1,)): record #88's term, pw (lse_t - z_t[p_t]) for the rows t whose next token has
    a prefix target p_t (-1: none), whose weight the softmax term carries on those rows only.

    With FP8 (the record's head): x / x_s and W / w_s in e4m3, the gradient of u divided by g_s in e5m2,
    g_s = loss_scale * 0.75/448; the backward matmuls in FP8 too. Otherwise the logits are computed in the
    dtype of x (bf16 on GPUs, rounding the sigmoid to bf16 as the kernel does) or fp32."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, mtp_weights: Tensor, loss_scale: float,
                head: HeadLoss, prefix: tuple | None = None) -> Tensor:
        loss, grad_x, grad_w = head.fn(x, weight, targets, mtp_weights, head.cap, loss_scale, head.chunk,
                                       head.fp8_weights, prefix)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad.to(grad_x.dtype), (grad_w * grad).to(ctx.weight_dtype), None, None, None, None, None


def head_loss(x: Tensor, weight: Tensor, targets: Tensor, mtp_weights: Tensor, cap: tuple, loss_scale: float,
              chunk: int, fp8_weights: tuple | None = None,
              prefix: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """SoftcappedMTPLoss's forward: the summed loss times loss_scale and the gradients of x (T, dim) and of the
    lm_head (dim, vocab, fp32), `chunk` rows of logits at a time. With FP8 (fp8_weights: the lm_head's e4m3
    copies in both layouts, since _scaled_mm takes its first operand row-major and its second column-major),
    each chunk's logit gradient is kept transposed, in e5m2, and the lm_head's gradient is one matmul over all
    the rows, accumulated once. Compiled on CUDA (compile_model), a chunk's element-wise work fuses into a few
    passes over its logits, with no fp32 copy of them."""
    T, n = x.size(0), mtp_weights.numel()
    weights = mtp_weights.float()
    # targets for offsets k = 0..n-1, padded with -1 past the sequence's end: (T, n)
    shifted = torch.stack([F.pad(targets[k:], (0, k), value=-1) for k in range(n)], dim=1)
    if prefix is not None:  # record #88: each row's prefix target (-1: none) is one more target, with its weight
        prefix_targets, prefix_weight = prefix
        shifted = torch.cat([shifted, prefix_targets[:, None]], dim=1)
        weights = torch.cat([weights, prefix_weight.float().view(1)])
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x)
    if fp8_weights is None:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, T, chunk):
            xc = x[lo:lo + chunk]
            chunk_loss, g_u = mtp_chunk(xc @ weight.type_as(xc), shifted[lo:lo + chunk], weights, cap, loss_scale,
                                        every_row=n)
            total += chunk_loss
            grad_x[lo:lo + chunk] = g_u.to(x.dtype) @ weight.T.type_as(xc)
            grad_w += xc.float().T @ g_u
        return total * loss_scale, grad_x, grad_w
    w8, w8_t, scales = fp8_weights
    grad_s = loss_scale * scales.grad_scale
    x8 = (x.float() / scales.x_scale).to(torch.float8_e4m3fn)
    # The logits' e5m2 gradient, transposed: (vocab, T), assembled as bytes (inductor's kernels that copy chunks
    # into it would otherwise need float8 constants, which Triton 3.6 cannot make)
    g8_t = torch.empty((w8.size(1), T), dtype=torch.uint8, device=x.device)
    for lo in range(0, T, chunk):
        u = scaled_mm(x8[lo:lo + chunk], w8_t.T, scales.x_scale, scales.w_scale, scales.logits, fast_accum=True)
        chunk_loss, g8 = mtp_chunk(u, shifted[lo:lo + chunk], weights, cap, loss_scale, grad_s, every_row=n)
        total += chunk_loss
        grad_x[lo:lo + chunk] = scaled_mm(g8, w8.T, grad_s, scales.w_scale, x.dtype)
        g8_t[:, lo:lo + chunk] = g8.view(torch.uint8).T
    grad_w = scaled_mm(x8.T.contiguous(), g8_t.view(torch.float8_e5m2).T, scales.x_scale, grad_s, torch.float32)
    return total * loss_scale, grad_x, grad_w


def candidate_columns(lm_head: Tensor, fp8_weights: tuple | None, columns: Tensor) -> tuple[Tensor, tuple | None]:
    """The lm_head's candidate columns (dim, P), taken with index_select, whose backward puts their gradient in
    those columns of the lm_head's and 0 in every other; and the same columns of its FP8 copies ((dim, P) and
    (P, dim)), taken as bytes: at one fixed scale per tensor they are the e4m3 copies of the columns taken."""
    if fp8_weights is not None:
        w8, w8_t, scales = fp8_weights
        fp8_weights = (w8.view(torch.uint8).index_select(1, columns).view(w8.dtype),
                       w8_t.view(torch.uint8).index_select(0, columns).view(w8_t.dtype), scales)
    return lm_head.index_select(1, columns), fp8_weights


def head_fp8(lm_head: Tensor, scales: HeadFp8 = HEAD_FP8_85) -> tuple[Tensor, Tensor, HeadFp8]:
    """The lm_head's e4m3 copies at its fixed scale, (dim, vocab) and (vocab, dim), with the scales (head_loss's
    fp8_weights). Record #85's: W / w_scale in fp32 (as its compiled code divides); record #92's: W times w_scale's
    fp32 reciprocal (the one ATen's division by a host number takes), rounded to W's dtype as the eager W.div(w_s)
    in bf16 that its kernel reproduces, clipped, then to e4m3."""
    if scales.record == 92:
        w8 = in_dtype_of(lm_head, lm_head.float() * scales.w_reciprocal).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    else:
        w8 = lm_head.float() / scales.w_scale
    w8 = w8.to(torch.float8_e4m3fn)
    return w8, w8.T.contiguous(), scales


def fp8_copies(fcs: list[Tensor], downs: list[tuple[Tensor, Tensor, Tensor]], fulls: list[tuple],
               head: tuple[Tensor, HeadFp8] | None, scales: tuple[str, str]) -> tuple[list, list, list, tuple | None]:
    """Every FP8 copy the forward reads, from the current weights (refresh_fp8): one compiled call on CUDA.
    downs: each FP8 down-projection's (proj, used scale, next scale); fulls: each record #92 MLP's (fc, proj,
    Fp8Mlp state); head: the lm_head and its scales. scales: the downs' as mlp_down_fp8's, the fulls' as
    mlp_full_fp8's."""
    return ([mlp_fp8(fc) for fc in fcs], [mlp_down_fp8(*down, scales[0]) for down in downs],
            [mlp_full_fp8(*full, scales[1]) for full in fulls], head_fp8(*head) if head is not None else None)


def mtp_chunk(u: Tensor, targets: Tensor, weights: Tensor, cap: tuple, loss_scale: float,
              grad_s: float | None = None, every_row: int | None = None) -> tuple[Tensor, Tensor]:
    """One chunk of SoftcappedMTPLoss: its summed loss and the gradient of its logits u (rows, vocab), given
    each row's targets (-1: none) and their weights, and the softcap (A, shift, width); with grad_s, that
    gradient divided by grad_s, in e5m2. The first every_row weights (all by default: the k offsets') count in
    the softmax term of every row; the rest (the prefix target's) only where the row has that target. Every column's gradient is first computed as if it were no row's
    target, in one element-wise pass (compiled, it never holds the gradient in fp32); then the few target
    columns of each row are computed apart, from their gathered values, and written over it. Eager, the
    passes over rows x vocab work in place."""
    A, shift, width = cap
    s = u.float() if u.dtype != torch.float32 else u.clone()
    s.mul_(1 / width).add_(shift / width).sigmoid_()  # the kernel's u / C + B / C
    if u.dtype == torch.bfloat16:
        s = round_to_bf16(s)  # record #85's kernel keeps the squashed logits in bf16
    elif u.dtype == torch.float8_e4m3fn:
        s = round_to_fp16(s)  # record #92's, from e4m3 logits, in fp16, where bf16 would round s (1 - s) to 0 sooner
    elif u.dtype != torch.float32:
        s = s.to(u.dtype).float()
    valid, columns = targets >= 0, targets.clamp(min=0)
    e = s.mul(A).exp_()  # z = A * s is below 23: exp(z) cannot overflow, no max to subtract
    sum_exp = e.sum(dim=-1, keepdim=True)
    s_target, e_target = torch.gather(s, 1, columns), torch.gather(e, 1, columns)
    loss = (weights * valid * (sum_exp.log() - A * s_target)).sum()
    # dL/du = (S_w softmax(z) - the weights of the targets that are this column) * dz/du,
    # dz/du = A / width * s (1 - s): S_w keeps every offset's weight, also where a row has fewer targets (the
    # kernel's), and the prefix target's only where the row has one (record #88's kernel)
    scale = A / width * loss_scale
    every_row = weights.numel() if every_row is None else every_row
    weight_sum = weights[:every_row].sum()
    if every_row < weights.numel():
        weight_sum = weight_sum + (weights[every_row:] * valid[:, every_row:]).sum(dim=-1, keepdim=True)
    softmax_scale = (weight_sum * scale) / sum_exp
    g_u = e.mul_(softmax_scale).mul_(s.addcmul_(s, s, value=-1))
    # The target columns: each target's weight taken from its column, in order (as the kernel adds them; a
    # column several targets name loses each of their weights; a missing target's weight is 0).
    target_grad, target_weights = e_target * softmax_scale, weights * valid * scale
    for k in range(targets.size(1)):
        target_grad = target_grad - torch.where(columns == columns[:, k:k + 1], target_weights[:, k:k + 1], 0.0)
    target_grad = target_grad * s_target.addcmul(s_target, s_target, value=-1)
    if grad_s is None:
        return loss, g_u.scatter_(1, columns, target_grad)
    g8 = (g_u / grad_s).to(torch.float8_e5m2)
    # (scattered as bytes: the float8 types have no scatter kernel of their own)
    g8.view(torch.uint8).scatter_(1, columns, (target_grad / grad_s).to(torch.float8_e5m2).view(torch.uint8))
    return loss, g8


def padded_vocab(vocab_size: int) -> int:
    return 128 * math.ceil(vocab_size / 128)  # tensor-core friendly; the extra logits learn to stay low


# Record #88's prefix-token targets, from the bundled GPT-2 ranks (the file data/tokenize_text.py checks too)
GPT2_VOCAB = BOS_ID + 1
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_BPE_BYTES = 835_554  # that file's size: a larger one is not it, and is not read


def prefix_token_table(vocab: int) -> Tensor:
    """(vocab,) int64: for each GPT-2 token id below vocab, the id of the longest proper (shorter, non-empty) prefix
    of its bytes that is itself such a token; -1 for the 256 single bytes, <|endoftext|> and the padded ids. (A
    vocabulary cut below GPT-2's, as small test runs use, keeps only the prefixes it has.)"""
    return torch.tensor(prefix_token_ids(vocab), dtype=torch.int64)


def prefix_token_ids(vocab: int) -> list[int]:
    """prefix_token_table's entries (the host's copy: CandidateSampler's)."""
    return gpt2_prefixes(min(vocab, GPT2_VOCAB)) + [-1] * max(vocab - GPT2_VOCAB, 0)


@functools.lru_cache(maxsize=4)
def gpt2_prefixes(vocab: int) -> list[int]:
    path = REPO_DIR / "data" / "gpt2.tiktoken"  # lines of "base64 bytes, rank"
    try:
        raw = read_regular(path, "the bundled GPT-2 ranks", GPT2_BPE_BYTES)
    except FileRefused as e:
        raise ConfigError(f"{path}: cannot read the GPT-2 ranks the prefix-token loss needs ({e.why})") from None
    if hashlib.sha256(raw).hexdigest() != GPT2_BPE_SHA256:
        raise ConfigError(f"{path}: not the bundled GPT-2 ranks (its sha256 differs); restore it with "
                          f"`git checkout -- data/gpt2.tiktoken`")
    ids = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in raw.splitlines())}
    ids = {token: i for token, i in ids.items() if i < vocab}
    table = [-1] * vocab
    for token, i in ids.items():
        table[i] = next((ids[token[:end]] for end in range(len(token) - 1, 0, -1) if token[:end] in ids), -1)
    return table


# The model's position limits, derived from the config here and nowhere else: the rotary tables,
# sample.py's generation and its packing of HellaSwag sequences all ask these.
def max_positions(args: Hyperparameters) -> int:
    """The longest sequence one forward pass can take: a training micro-batch or a validation sequence,
    whichever is longer (paired layers place each token at two positions of the rotary tables)."""
    return max(Schedule(args).max_micro_tokens(), args.val_seq_len)


def context_length(args: Hyperparameters) -> int:
    """The longest document the model can read: what training let a document contribute (the longest
    stage_max_seq_len), within max_positions."""
    return min(max(flag_list(args, "stage_max_seq_len")), max_positions(args))


@dataclass(frozen=True)
class GateLayout:
    """Where each per-token gate sits in the outputs of the two MUDD gate networks (record #85's order): the
    first network (on x0) serves the layers before mudd_gate_layer, the second (on the stream entering that
    layer) the rest. In each: XSA strengths (one per head) of its XSA layers, attention gates (one per head),
    the x0 and bigram injection weights of every layer but the skip target and the MUDD layer (which has its
    own), then, in the second, the skip weight and each DC layer's two per-head weight vectors. A role a layer
    keeps retired (record #92's, --retired_gates) keeps its slots, which nothing reads. `slots[net]` maps a name
    such as ("xsa", 3) to its slice; `bias[net]` holds the initial biases (stored divided by MUDD_SCALE)."""
    slots: tuple
    bias: tuple
    widths: tuple

    @staticmethod
    def build(plans: list[LayerPlan], heads: int, split: int) -> "GateLayout":
        slots, biases = [], []
        for net in (0, 1):
            layers = [p for p in plans if (p.index < split) == (net == 0)]
            names: list[tuple] = [(("xsa", p.index), heads) for p in layers if p.xsa or "xsa" in p.retired]
            names += [(("attn", p.index), heads) for p in layers if p.attn_gate or "attn" in p.retired]
            for p in layers:
                if p.injects:
                    names += [(("x0", p.index), 1), (("bigram", p.index), 1)]
            if net == 1:
                names += [(("skip",), 1)]
                for p in layers:
                    if p.dc or "dc" in p.retired:
                        names += [(("dc_w1", p.index), heads), (("dc_w2", p.index), heads)]
            table, offset = {}, 0
            bias = []
            initial = {"attn": 0.25, "bigram": 0.05, "skip": 0.5, "dc_w1": 1.0}  # record #85's starting gates
            for name, width in names:
                table[name] = slice(offset, offset + width)
                bias += [initial.get(name[0], 0.0) / MUDD_SCALE] * width
                offset += width
            slots.append(table)
            biases.append(bias)
        return GateLayout(tuple(slots), tuple(biases), tuple(len(b) for b in biases))


def mudd_net(x: Tensor, w1: Tensor, w2: Tensor, b2: Tensor, scale) -> Tensor:
    """A MUDD network: (W2 gelu(W1 x) + b2) * scale, per token: (1, T, n) coefficients."""
    return (F.linear(F.gelu(F.linear(x, w1)), w2) + b2) * scale


class GPT(nn.Module):
    """Record #85's model. Parameter names and layouts follow the record's where they are not per layer
    (tools/record_weights.py converts between the two): lm_head is (dim, vocab), x @ lm_head; the small
    tensors (scalars, lambdas, gates, MUDD nets) keep the record's shapes."""

    def __init__(self, args: Hyperparameters, numerics: Numerics | None = None, table_shard: tuple[int, int] = (0, 1)):
        """table_shard: (rank, world size), which rows of record #92's n-gram table (--ngram_channels=2) this process
        holds (NgramEmbedding); every other tensor is the same at every world size."""
        super().__init__()
        self.numerics = numerics or Numerics()
        vocab, dim, L = padded_vocab(args.vocab_size), args.model_dim, args.num_layers
        self.plans = layer_plan(args)
        self.num_heads, self.head_dim, self.vocab = dim // args.head_dim, args.head_dim, vocab
        heads = self.num_heads
        self.skip_from, _ = flag_list(args, "skip_layers")
        self.shared_input_layer, self.mudd_gate_layer = args.shared_input_layer, args.mudd_gate_layer
        self.cap = (args.logit_cap, args.logit_cap_shift, args.logit_cap_width)
        self.norm_eps = args.norm_eps
        self.head_states, self.head_groups = head_mix_states(args), args.head_mix_groups
        # embeddings: the token embedding starts as (and, until the untie step, stays) the lm_head's transpose
        self.lm_head = nn.Parameter(torch.empty(dim, vocab))
        nn.init.normal_(self.lm_head, std=0.005)
        self.embed = nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.embed.weight.copy_(self.lm_head.T)
        tables = sum(p.value_embed is not None for p in self.plans)
        self.value_embeds = nn.Parameter(0.01 * torch.randn(tables * vocab, dim))
        self.ve_gates = nn.Parameter(torch.zeros(len(ve_gate_layers(args)), heads, 2 * VE_GATE_CHANNELS))
        self.bigram_embed, self.ngram = None, None
        if args.ngram_channels == 1:
            self.bigram_embed = nn.Embedding(args.bigram_vocab_size, dim)
            nn.init.zeros_(self.bigram_embed.weight)
        else:  # in the table's dtype from the start: a shard of the record's size in fp32 first takes twice as much
            self.ngram = NgramEmbedding(args.bigram_vocab_size, dim, self.numerics.compute, table_shard)
        self.register_buffer("bigram_signs", torch.randn(args.bigram_sign_rows, dim).sign())
        self.smear_gate = nn.Linear(GATE_CHANNELS, 1, bias=False)
        nn.init.zeros_(self.smear_gate.weight)
        # per layer: (qkv, output) attention lambdas; then the smear and skip weights
        self.scalars = nn.Parameter(torch.tensor([0.5, 1.0] * L + [0.0, SKIP_GATE_INIT]))
        self.resid_lambdas = nn.Parameter(torch.full((L, 2), RESIDUAL_INIT))  # (attention, MLP) per layer
        self.post_lambdas = nn.Parameter(torch.ones(L, 2))
        # MUDD: net 0 at the last layer, net 1 before the head
        self.mudd_w1 = nn.Parameter(torch.empty(2, MUDD_HIDDEN, dim))
        self.mudd_w2 = nn.Parameter(torch.zeros(2, MUDD_LAYER_COEFS, MUDD_HIDDEN))
        self.mudd_b2 = nn.Parameter(self._mudd_bias())
        if self.head_groups:  # record #92: each head-mix weight's per-group deltas, from the same hidden layer
            self.mudd_w2g = nn.Parameter(torch.zeros(MUDD_LAYER_COEFS, self.head_groups, MUDD_HIDDEN))
        self.gate_layout = GateLayout.build(self.plans, heads, args.mudd_gate_layer)
        widest = max(self.gate_layout.widths)
        self.mudd_gate_scale = nn.Parameter(torch.tensor(MUDD_SCALE))
        self.mudd_gate_w1 = nn.Parameter(torch.empty(2, MUDD_HIDDEN, dim))
        self.mudd_gate_w2 = nn.Parameter(torch.zeros(2, widest, MUDD_HIDDEN))
        self.mudd_gate_b2 = nn.Parameter(torch.tensor([bias + [0.0] * (widest - len(bias))
                                                       for bias in self.gate_layout.bias]))
        for w in (self.mudd_w1, self.mudd_gate_w1):
            for j in range(2):
                nn.init.kaiming_uniform_(w.data[j], a=math.sqrt(5))
        self.blocks = nn.ModuleList(Block(plan, args, self.numerics.mlp, plan.mudd and "mlp_in" in self.head_states)
                                    for plan in self.plans)
        if any(plan.removed for plan in self.plans):
            # Record #92 keeps a removed layer's MLP in its bank, at its init and never moved (lr 0): nothing reads
            # it, but the decontraction ship's MLP norm counts it (TailShips). Its squared norm: the init's expected
            # one (hidden * dim * std^2, std = 0.5 dim^-0.5 per up-projection; the down-projection is zero), or the
            # record's own, which tools/record_weights.py carries over.
            removed = sum(plan.removed for plan in self.plans)
            self.register_buffer("removed_mlp_sq", torch.tensor(removed * mlp_width(args) * 0.25))
        schedule = Schedule(args)
        # Full-width heads turn with a rotary fitted to the long window (record #85's); narrow heads (record #92's,
        # all on short-window layers) with one of their own, fitted to the short window
        first, positions, turned = schedule.stages[0].windows, max_positions(args), rotary_dims(args)
        self.rotary = Rotary(args.head_dim, positions, args.window_block, first[1], turned, args.attn_scale)
        self.narrow_rotary = (Rotary(args.narrow_dim, positions, args.window_block, first[0], turned,
                                     args.narrow_attn_scale) if any(plan.narrow_qk for plan in self.plans) else None)
        if schedule.prefix_term:  # a row's prefix target is prefix_table[its next token]
            self.register_buffer("prefix_table", prefix_token_table(vocab), persistent=False)
        # compile_model puts compiled ones here
        self.head_loss, self.mask_parts = head_loss, mask_parts
        self.head_scales = HEAD_FP8_92 if args.lm_head_fp8_logits else HEAD_FP8_85
        if self.numerics.head == "fp8":  # the lm_head's e4m3 copies in both layouts (refresh_fp8)
            self.register_buffer("lm_head_f8", torch.zeros(dim, vocab, dtype=torch.float8_e4m3fn), persistent=False)
            self.register_buffer("lm_head_f8_t", torch.zeros(vocab, dim, dtype=torch.float8_e4m3fn), persistent=False)
        self.fp8_copies = fp8_copies  # compile_model puts a compiled one here
        # loaded weights come with their FP8 copies (as the rotary tables come with their state)
        self.register_load_state_dict_post_hook(lambda module, incompatible: refresh_fp8(module))

    def _mudd_bias(self) -> Tensor:
        """The last layer's coefficients start where the per-layer values would (the value-embedding gates at
        2, the residual and post lambdas at sqrt(1.1) and 1, the bigram injection at 0.05); before the head,
        the state of the shared-input layer starts at -0.5 (the record's former "backout")."""
        bias = torch.zeros(2, MUDD_LAYER_COEFS)
        layer = LayerMix._fields.index
        bias[0, layer("ve_gate_first")] = bias[0, layer("ve_gate_second")] = 2.0
        bias[0, layer("attn_stream")] = bias[0, layer("mlp_stream")] = RESIDUAL_INIT
        bias[0, layer("attn_out")] = bias[0, layer("mlp_out")] = 1.0
        bias[0, layer("attn_bigram")] = 0.05
        if "shared" in self.head_states:
            bias[1, self.head_states.index("shared")] = -0.5
        return bias / MUDD_SCALE

    def gates(self, x: Tensor, net: int) -> dict:
        """The per-token gates one MUDD gate network gives, by name (see GateLayout)."""
        width = self.gate_layout.widths[net]
        if not width:
            return {}
        out = mudd_net(x, self.mudd_gate_w1[net], self.mudd_gate_w2[net, :width], self.mudd_gate_b2[net, :width],
                       self.mudd_gate_scale.type_as(x))
        slots = self.gate_layout.slots[net]
        # Separate tensors, not views of `out`: a compiled graph returns views of its result by rebuilding them
        # outside, and each one's gradient then arrives as a zero-padded copy of the whole (1, T, width) (an add
        # per gate); split's backward joins the pieces' gradients in one copy.
        pieces = out.split([where.stop - where.start for where in slots.values()], dim=-1)
        return {name: piece.clone() for name, piece in zip(slots, pieces)}

    def mudd(self, x: Tensor, net: int, count: int) -> tuple[Tensor, ...]:
        return mudd_net(x, self.mudd_w1[net], self.mudd_w2[net, :count], self.mudd_b2[net, :count],
                        MUDD_SCALE).split(1, dim=-1)

    def hidden(self, input_ids: Tensor, masks: Masks, caches: "KVCache | None" = None,
               separate_documents: bool = False) -> Tensor:
        """input_ids: (T,) one packed sequence. Returns the normed final stream (1, T, dim). With caches
        (generation), input_ids continue the cached positions. separate_documents: a BOS starts a fresh
        sequence for the smear, the bigram hash and its signs (which, like the record, otherwise run across
        document boundaries), so that packed sequences score exactly as if run one by one."""
        T = len(input_ids)
        start = caches.length if caches is not None else 0
        if start + T > self.rotary.cos.size(0) // 2:
            raise ValueError(f"positions {start}..{start + T - 1}: the model takes at most "
                             f"{self.rotary.cos.size(0) // 2} (max_positions)")
        starts = input_ids == BOS_ID if separate_documents else None
        position = positions_in_sequence(T, input_ids.device, starts, offset=start)
        if separate_documents:
            masks = dataclasses.replace(masks, fresh=position == 0, positions=position)
        before = caches.last_ids if caches is not None and start else None  # the (up to two) tokens before these
        last_embedding = caches.last_embedding if caches is not None and start else None
        if caches is not None:
            caches.last_embedding = self.embed(input_ids[-1:])
            caches.last_ids = (input_ids if before is None else torch.cat([before, input_ids]))[-2:]
        x0_ngram = None
        if self.ngram is not None:  # eager: the rows a step reads vary in number, which a compiled stem would not
            ids = input_ids if before is None else torch.cat([before, input_ids])
            x0_ngram = self.ngram(input_ids, shifted(ids, 1, T), shifted(ids, 2, T), position, self.bigram_signs,
                                  self.embed.weight.dtype)
        x0, x0_bigram, ve, gates = self.stem(input_ids, position, before, last_embedding, x0_ngram)
        # Per layer, unbound rather than indexed: each layer's gradient then joins the others' in one stack
        # (unbind's backward), where an index would pad it with zeros to the whole tensor and add.
        sa_lambdas = self.scalars[:2 * len(self.plans)].view(-1, 2).unbind(0)  # (qkv, output) lambdas per layer
        resid = self.resid_lambdas.bfloat16().unbind(0)  # as the record, rounded to bf16
        post = self.post_lambdas.bfloat16().unbind(0)
        ve_gates = self.ve_gates.unbind(0)
        x = x0 + x0_bigram * gates[("bigram", 0)] if self.plans[0].bigram_inject else x0
        saved = {0: x}  # states MUDD mixes in: the stream's start, the skip source, the shared input
        inputs = LayerInputs(x0, x0_bigram, ve, gates, saved, masks, self.rotary, self.narrow_rotary)
        for plan, block in zip(self.plans, self.blocks):
            i = plan.index
            if i == self.mudd_gate_layer:
                gates.update(self.gates(x, 1))
            mix = None
            if plan.mudd:
                saved["last"] = x
                mix = LayerMix(*self.mudd(x, 0, MUDD_LAYER_COEFS))
            weights = LayerWeights(sa_lambdas[i], resid[i], post[i],
                                   ve_gates[plan.ve_gate] if plan.ve_gate is not None else None,
                                   self.scalars[-1] if plan.skip_target else None, mix)
            x = block(x, inputs, weights, caches.layers[i] if caches is not None else None)
            if i in (self.skip_from, self.shared_input_layer):
                saved[i] = x
        if caches is not None:
            caches.length += T
        return self.head_mix(x, saved, ve)

    def stem(self, input_ids: Tensor, position: Tensor, before: Tensor | None, last_embedding: Tensor | None,
             x0_ngram: Tensor | None = None):
        """Embedding, smear and x0; the bigram injection (record #92's n-gram table's x0_ngram where given); the
        value-embedding rows; the first gate network's gates. before, last_embedding: the tokens before input_ids[0]
        (up to two) and the embedding of the last, when cached."""
        previous = torch.cat([input_ids[:1] if before is None else before[-1:], input_ids[:-1]])
        has_previous = position > 0
        x = self.embed(input_ids)
        # smear: each token's embedding takes a gated share of the previous token's
        previous_x = torch.cat([x[:1] if last_embedding is None else last_embedding, x[:-1]])
        smear = self.scalars[-2] * torch.sigmoid(self.smear_gate(x[:, :GATE_CHANNELS]))
        x = torch.where(has_previous[:, None], x + smear * previous_x, x)
        x0 = norm(x, self.norm_eps)[None]
        if x0_ngram is not None:
            x0_bigram = x0_ngram[None]
        else:  # bigram hash embedding, each row's sign flipped by a random table indexed by the bigram
            signs = self.bigram_signs[torch.where(has_previous, torch.remainder(torch.bitwise_xor(previous, input_ids),
                                                                                self.bigram_signs.size(0)), 0)]
            hashed = bigram_hash(input_ids, previous, position, self.bigram_embed.num_embeddings)
            x0_bigram = (self.bigram_embed(hashed) * signs.type_as(x))[None]
        rows = self.value_embeds.view(-1, self.vocab, self.value_embeds.size(-1))[:, input_ids]  # (tables, T, dim)
        # one tensor per table, not views (see gates): a layer's gradient then covers its own table's rows alone
        ve = tuple(table.clone() for table in rows.unbind(0))
        return x0, x0_bigram, ve, self.gates(x0, 0)

    def head_mix(self, x: Tensor, saved: dict, ve: tuple) -> Tensor:
        """Before the head, the stream adds earlier states (--head_mix), each weighted by one of the second MUDD
        net's outputs c_k: x + sum_k c_k s_k; then the final norm. With G head_mix_groups (record #92), the weight
        is c_k + g_k[j] on channel group j of the model dim, g_k from the same hidden layer with weights of its own
        (mudd_w2g, no bias): x_j + sum_k (c_k + g_k[j]) s_k,j."""
        n = len(self.head_states)
        if not self.head_groups:
            for c, name in zip(self.mudd(x, 1, n), self.head_states):
                x = x + c * self.head_state(name, saved, ve).type_as(x)
            return norm(x, self.norm_eps)
        hidden = F.gelu(F.linear(x, self.mudd_w1[1]))
        c = (F.linear(hidden, self.mudd_w2[1, :n]) + self.mudd_b2[1, :n]) * MUDD_SCALE  # (1, T, n)
        g = torch.einsum("btd,kgd->btkg", hidden, self.mudd_w2g[:n]) * MUDD_SCALE  # (1, T, n, G)
        weights = (c[..., None] + g).unsqueeze(-1)  # (1, T, n, G, 1)
        grouped = lambda t: t.unflatten(-1, (self.head_groups, -1))  # (1, T, G, dim / G)
        x = grouped(x)
        for k, name in enumerate(self.head_states):
            x = x + weights[:, :, k] * grouped(self.head_state(name, saved, ve).type_as(x))
        return norm(x.flatten(-2), self.norm_eps)

    def head_state(self, name: str, saved: dict, ve: tuple) -> Tensor:
        """One of --head_mix's states (HEAD_MIX_STATES, or "ve<N>"), (1, T, dim)."""
        if name.startswith("ve"):
            return ve[int(name[2:])][None]
        where = {"x0": 0, "shared": self.shared_input_layer, "last": "last", "skip": self.skip_from,
                 "mlp_in": "mlp_in"}
        if name == "shared_in":
            return norm(saved[self.shared_input_layer], self.norm_eps)
        return saved[where[name]]

    def set_windows(self, windows: tuple[int, int]):
        """Fit the rotaries to a step's (short, long) windows (YaRN): the full-width heads' to the long, the narrow
        heads' to the short."""
        self.rotary.set_window(windows[1])
        if self.narrow_rotary is not None:
            self.narrow_rotary.set_window(windows[0])

    def logits(self, x: Tensor) -> Tensor:
        """Evaluation logits, squashed: bf16 (fp32 on CPU) as the record's evaluation."""
        dtype = self.numerics.logits
        u = x.to(dtype) @ self.lm_head.to(dtype)
        A, shift, width = self.cap
        return A * torch.sigmoid((u + shift) / width)

    def forward(self, input_ids: Tensor, target_ids: Tensor, masks: Masks, mtp_weights: Tensor | None = None,
                loss_scale: float = 1.0, prefix_weight: Tensor | None = None,
                candidates: Candidates | None = None) -> Tensor:
        """Training: record #85's multi-token loss of one packed sequence (with prefix_weight, a (1,) tensor, record
        #88's prefix-token term too), summed over tokens and times loss_scale; with candidates, record #92's
        sampled softmax: the same loss over the lm_head's columns C alone, each target its position in C.
        Evaluation: the next-token cross-entropy over the whole vocabulary, summed over tokens."""
        x = self.hidden(input_ids, masks)[0]
        if self.training:
            weight = self.lm_head
            fp8 = (self.lm_head_f8, self.lm_head_f8_t, self.head_scales) if self.numerics.head == "fp8" else None
            prefix_targets = None
            if candidates is not None:
                weight, fp8 = candidate_columns(weight, fp8, candidates.columns)
                target_ids, prefix_targets = candidates.target_positions, candidates.prefix_positions
            elif prefix_weight is not None:
                prefix_targets = torch.where(target_ids >= 0, self.prefix_table[target_ids.clamp(min=0)], -1)
            head = HeadLoss(self.cap, LOSS_CHUNK, fp8, self.head_loss)
            prefix = (prefix_targets, prefix_weight) if prefix_weight is not None else None
            return SoftcappedMTPLoss.apply(x, weight, target_ids, mtp_weights, loss_scale, head, prefix)
        return torch.stack(self.cross_entropy_chunks(x, target_ids, "sum")).sum()

    def token_losses(self, input_ids: Tensor, target_ids: Tensor, masks: Masks,
                     separate_documents: bool = False) -> Tensor:
        """Evaluation, each token's next-token cross-entropy (T,); separate_documents as in hidden()."""
        x = self.hidden(input_ids, masks, separate_documents=separate_documents)[0]
        return torch.cat(self.cross_entropy_chunks(x, target_ids, "none"))

    def cross_entropy_chunks(self, x: Tensor, target_ids: Tensor, reduction: str) -> list[Tensor]:
        # Validation sequences are long (262,144 tokens): one chunk's logits at a time fit in memory.
        return [F.cross_entropy(self.logits(xs).float(), ts, reduction=reduction)
                for xs, ts in zip(x.split(LOSS_CHUNK), target_ids.split(LOSS_CHUNK))]


LOSS_CHUNK = 8192  # rows of logits the loss computes at once: 8,192 x 50,304 fp32 is 1.6 GB


class KVCache:
    """What generation needs to continue a sequence: one AttentionCache per attention layer (paired layers
    hold two positions per token), the last token and its embedding (smear, bigram hash), and the tokens so
    far (their document ids)."""

    def __init__(self, model: GPT, max_len: int):
        p = model.embed.weight
        self.layers = [AttentionCache(max_len * (2 if plan.paired else 1), model.num_heads // (2 if plan.paired else 1),
                                      block.attn.qk_dim, block.attn.v_dim, p.device, p.dtype)
                       if plan.attention else None for plan, block in zip(model.plans, model.blocks)]
        self.length = 0
        self.last_embedding = self.last_ids = None

def compile_model(model: GPT, backend="inductor", attention_only: bool = False):
    """Compile each layer (Block.forward), the stem, the final mixing, the loss head (head_loss: its matmuls and
    element-wise passes) and the FP8 refresh on their own, not the whole model: backward then runs graph by graph, so the gradient hooks of each
    layer's parameters fire as soon as its backward is done and DistAdam's reduce-scatters overlap the
    rest of backward; a whole-model graph would hold every gradient back until the very end.

    Windows, documents, rotary tables and the attention scale reach the graphs as tensors, so each kind of
    layer compiles once per sequence length and mode (the stages' three micro-batch sizes, validation):
    record #85's 11 kinds of layer make 44 graphs, so dynamo's recompile limit per code object is raised
    to 64, the record's own (the preflight counts them, and fails if the limit were hit).

    attention_only (--compile=false with FlexAttention) compiles the attention call alone: FlexAttention
    run uncompiled materialises the whole score matrix."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if attention_only:
        compiled = torch.compile(attention, backend=backend, dynamic=False, fullgraph=True)
        for block in model.blocks:
            if block.attn is not None:
                block.attn.attend = compiled
        return
    options = dict(backend=backend, dynamic=False, fullgraph=True)
    for block in model.blocks:
        block.forward = torch.compile(block.forward, **options)
    model.stem = torch.compile(model.stem, **options)
    model.head_mix = torch.compile(model.head_mix, **options)
    model.head_loss = torch.compile(head_loss, **options)
    model.mask_parts = torch.compile(mask_parts, **options)
    model.fp8_copies = torch.compile(fp8_copies, **options)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the model computes in on a device, decided here and nowhere else: bf16 on GPUs (the record's
    parameters, Polar Express's matmuls, evaluation's logits, the matmul peak MFU is counted against); fp32 on
    CPUs, which have no bf16 matrix units, and where fp32 also keeps runs at different world sizes in step
    (bf16 rounding would amplify the last-bit differences of reduction order)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class Numerics:
    """The precisions a run computes in, decided once (resolve_numerics, at start-up) and handed to the model,
    which the optimizers and the performance count ask. compute: the parameters' and activations' dtype
    (compute_dtype: bf16 on GPUs, fp32 on CPUs; FP32_PARAMETERS stay fp32), also Polar Express's in NorMuon
    and the one MFU counts the matmul peak in. head, mlp: the training matmuls of the lm_head and of the MLP's
    up-projection, "fp8", "bf16" or "fp32". Evaluation never uses FP8: its logits are fp32 under an fp32
    head, else bf16. The default is a CPU's."""
    compute: torch.dtype = torch.float32
    head: str = "fp32"
    mlp: str = "fp32"

    @property
    def logits(self) -> torch.dtype:
        return torch.float32 if self.head == "fp32" else torch.bfloat16

    @staticmethod
    def for_evaluation(device: torch.device) -> "Numerics":
        """No FP8 anywhere: the compute dtype for both matmuls (final weights' evaluation, sample.py)."""
        dtype = compute_dtype(device)
        return Numerics(dtype, PRECISION_NAMES[dtype], PRECISION_NAMES[dtype])


PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # --lm_head_precision's and --mlp_precision's


# Parameters that stay fp32 on GPUs (the record's): the scalars and lambdas, whose small Adam updates bf16
# would round away. Everything else is bf16 there; NorMuon keeps fp32 masters of its matrices (mantissas).
FP32_PARAMETERS = ("scalars", "resid_lambdas", "post_lambdas", "mudd_gate_scale")


def cast_parameters(model: GPT) -> GPT:
    """Record #85's parameter dtypes: the model's compute dtype (bf16 on GPUs) except FP32_PARAMETERS (and the
    lm_head under --lm_head_precision=fp32); on CPU all fp32."""
    dtype = model.numerics.compute
    if dtype != torch.float32:
        keep = set(FP32_PARAMETERS) | ({"lm_head"} if model.numerics.head == "fp32" else set())
        for name, p in model.named_parameters():
            if name not in keep:
                p.data = p.data.to(dtype)
        model.bigram_signs.data = model.bigram_signs.data.to(dtype)
    return model


# -----------------------------------------------------------------------------
# Collectives the optimizers use: at world size 1 there are none

def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# PyTorch 2.13 renames the tensor collectives (the old names warn); 2.11 has only the old ones.
def reduce_scatter_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather_async(output: Tensor, input: Tensor):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, async_op=True)


# -----------------------------------------------------------------------------
# NorMuon: momentum, Polar Express orthogonalisation, per-neuron normalisation and cautious weight
# decay, for the attention and MLP matrices

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one odd quintic
# a*x + b*x^3 + c*x^5 per iteration, each chosen for the range the singular values can be in after
# the previous ones. These are the record's (5 iterations, safety factor 2e-2, cushion 2).
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
    """The axis NorMuon averages over (record #85): the last for tall and square matrices (one second moment
    per row), the first for wide ones (one per column): always one per index of the longer side."""
    return -1 if shape[-2] >= shape[-1] else -2


def normalize_neurons(v: Tensor, second_moment: Tensor, one_minus_beta2) -> Tensor:
    """NorMuon (arXiv:2510.05491): divide each neuron's slice of the orthogonalised update by the root
    of its running mean square, then restore the update's overall norm."""
    norm_before = v.norm(dim=(-2, -1), keepdim=True)
    second_moment.lerp_(v.square().mean(dim=neuron_dim(v.shape), keepdim=True), one_minus_beta2)
    v = v * second_moment.clamp_min(1e-10).rsqrt()
    return v * (norm_before / v.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


def bf16_with_mantissa(weight: Tensor, mantissa: Tensor) -> Tensor:
    """The fp32 value whose upper 16 bits are the bf16 weight and lower 16 the saved mantissa."""
    high = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    return ((high << 16) | (mantissa.to(torch.int32) & 0xFFFF)).view(torch.float32)


def split_mantissa(precise: Tensor, mantissa: Tensor) -> Tensor:
    """fp32 `precise` as the bf16 weight of its upper 16 bits (truncated, as the record), returned, and its
    lower 16 bits, stored in the mantissa."""
    raw = precise.view(torch.int32)
    mantissa.copy_(raw.to(torch.int16))
    return (raw >> 16).to(torch.int16).view(torch.bfloat16)


class EagerOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer less the torch._dynamo.disable wrappers on add_param_group and zero_grad, whose first
    call imports torch._dynamo: 2 s of every process's start-up, which a run that compiles nothing (on CPU) never
    needs otherwise. The wrappers keep dynamo from tracing into these methods from compiled code; this file's
    optimizers are only ever called eagerly (their compiled parts are the update functions they call)."""
    add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__


class NorMuonHyper(NamedTuple):
    """One NorMuon step's settings for a stack of k matrices, each (k, 1, 1) fp32 on the device: a tensor,
    not a constant, so that a compiled update never recompiles as the schedule moves them."""
    momentum: Tensor
    one_minus_momentum: Tensor
    one_minus_beta2: Tensor
    step: Tensor  # lr * sqrt(max(1, rows / cols)) * lr_mul
    decay: Tensor  # weight_decay * lr


def normuon_update(grad: Tensor, weight: Tensor, state: dict, hyper: NorMuonHyper, world_size: int,
                   ns_dtype: torch.dtype) -> Tensor:
    """NorMuon's step for a stack of same-shape matrices (k, rows, cols): their summed gradients over
    world_size ranks and their weights in, their new weights out (the weights' dtype); the state (momentum,
    second moment, and for bf16 weights the mantissas) is updated in place. One compiled call per shape on
    CUDA (compile_optimizers)."""
    grad = grad.float().div_(world_size)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, hyper.one_minus_momentum)
    update = grad.lerp(buf, hyper.momentum)  # Nesterov
    v = polar_express(update, ns_dtype).float()
    v = normalize_neurons(v, state["second_moment"], hyper.one_minus_beta2)
    mantissa = state.get("mantissa")
    precise = bf16_with_mantissa(weight, mantissa) if mantissa is not None else weight
    cautious = (v * precise) >= 0
    new = precise - precise * cautious * hyper.decay * hyper.step - v * hyper.step
    return split_mantissa(new, mantissa) if mantissa is not None else new


class _MatrixStack:
    """NorMuon's matrices of one shape, updated as one stack. Matrix q of the shape belongs to rank q mod W
    (round robin, as in chunks of W); the stack for the reduce-scatter and the all-gather lists rank 0's
    matrices, then rank 1's, and so on, each rank's padded with zero matrices to `per_rank` slots, so that
    every rank receives the same count. `mine`: this rank's matrices (None: a padding slot)."""

    def __init__(self, members: list[int], world_size: int, rank: int):
        self.members = members
        self.per_rank = math.ceil(len(members) / world_size)
        position = lambda r, j: j * world_size + r  # slot j of rank r holds matrix q = j * W + r of the shape
        self.order = [members[q] if (q := position(r, j)) < len(members) else None
                      for r in range(world_size) for j in range(self.per_rank)]
        self.mine = self.order[rank * self.per_rank:(rank + 1) * self.per_rank]
        self.state: dict[str, Tensor] = {}  # stacked: (per_rank, ...) each


class NorMuon(EagerOptimizer):
    """NorMuon with Polar Express and cautious weight decay. A 3-D parameter is a stack of matrices, each its
    own unit (the record's units: a head pair's queries or keys, the value, output, up- and
    down-projection matrices).

    Per matrix: Nesterov momentum, orthogonalisation, per-neuron normalisation, then
        p <- p - lr * s * (v + lr * wd * [v * p >= 0] * p),   s = sqrt(max(1, rows / cols)) * lr_mul,
    so the decay only shrinks weights the update already pulls toward zero, and scales with lr^2.

    bf16 parameters keep an fp32 master for the matrices this rank updates: the lower 16 bits of each
    value live in the optimizer state (the record's "mantissa"), so updates far below bf16's resolution
    accumulate, and the other ranks receive (and compute with) the bf16 upper half, the value truncated.

    The matrices of one shape are updated together, as one stack (normuon_update: a few batched operations,
    one compiled call on CUDA, whatever the number of matrices). Distributed: same-shape matrices are dealt out
    round robin (_MatrixStack). One reduce-scatter per shape hands each rank the summed gradients of the
    matrices it owns; it keeps their state, computes their update, and one all-gather shares the results. At
    world size 1 there is no communication. The state is fp32 whatever the parameter's dtype; a matrix
    without a gradient is updated as if its gradient were zero."""

    rule = staticmethod(normuon_update)  # the update of one stack; a subclass brings its own, with its Hyper
    Hyper = NorMuonHyper

    def __init__(self, params, lr: float = 0.023, momentum: float = 0.95, beta2: float = 0.9,
                 weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay, lr_mul=1.0))
        self.ns_dtype = ns_dtype
        self.matrices: list[tuple[Tensor, int | None, dict]] = []  # (parameter, index in its stack, group)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"NorMuon takes matrices or stacks of them; got a shape {tuple(p.shape)}")
                self.matrices += [(p, None, group)] if p.ndim == 2 else [(p, j, group) for j in range(p.size(0))]
        self.world_size = dist.get_world_size() if distributed() else 1
        rank = dist.get_rank() if distributed() else 0
        by_shape: dict[tuple, list[int]] = {}
        for m, (p, _, _) in enumerate(self.matrices):
            by_shape.setdefault((tuple(p.shape[-2:]), p.dtype), []).append(m)
        self.stacks = [_MatrixStack(members, self.world_size, rank) for members in by_shape.values()]
        # each matrix's state, as views of its stack's (empty: not this rank's, or no step yet)
        self.matrix_state: list[dict] = [{} for _ in self.matrices]
        self.update = self.rule  # compile_optimizers puts a compiled one here

    def _view(self, t: Tensor, m: int) -> Tensor:
        _, j, _ = self.matrices[m]
        return t if j is None else t[j]

    def _stacked(self, stack: _MatrixStack, slots: list, of) -> Tensor:
        """One tensor (len(slots), rows, cols) of of(matrix) for each slot; zeros for padding slots and for
        matrices without a gradient."""
        values = [of(m) if m is not None else None for m in slots]
        if any(v is None for v in values):
            p = self.matrices[stack.members[0]][0]
            zero = p.new_zeros(p.shape[-2:])
            values = [zero if v is None else v for v in values]
        return torch.stack(values)

    def _grad(self, m: int) -> Tensor | None:
        p = self.matrices[m][0]
        return self._view(p.grad, m) if p.grad is not None else None

    @staticmethod
    def _moments(shape: tuple, device) -> dict[str, Tensor]:
        """The update rule's fp32 state for a stack of `shape` (k, rows, cols), zero."""
        moment_shape = list(shape)
        moment_shape[neuron_dim(shape)] = 1
        return {"momentum_buffer": torch.zeros(shape, dtype=torch.float32, device=device),
                "second_moment": torch.zeros(moment_shape, dtype=torch.float32, device=device)}

    def _make_state(self, stack: _MatrixStack):
        p = self.matrices[stack.members[0]][0]
        shape = (stack.per_rank, *p.shape[-2:])
        state = self._moments(shape, p.device)
        if p.dtype == torch.bfloat16:
            state["mantissa"] = torch.zeros(shape, dtype=torch.int16, device=p.device)
        stack.state = state
        for j, m in enumerate(stack.mine):
            if m is not None:
                self.matrix_state[m] = {key: t[j] for key, t in state.items()}

    @staticmethod
    def _settings(group: dict, rows: int, cols: int) -> tuple[float, ...]:
        """One matrix's NorMuonHyper values from its group."""
        lr = group["lr"]
        return (group["momentum"], 1 - group["momentum"], 1 - group["beta2"],
                lr * max(1.0, rows / cols) ** 0.5 * group["lr_mul"], group["weight_decay"] * lr)

    def _hyper(self) -> list[NamedTuple]:
        """Every stack's settings for this step from its matrices' groups, in one copy to the device."""
        rows = []
        for stack in self.stacks:
            for m in stack.mine:
                p, _, group = self.matrices[m if m is not None else stack.members[0]]
                rows.append(self._settings(group, *p.shape[-2:]))
        device = self.matrices[0][0].device
        fields = len(self.Hyper._fields)
        values = host_to_device(torch.tensor(rows, dtype=torch.float32), device).view(-1, fields, 1, 1)
        out, start = [], 0
        for stack in self.stacks:
            part = values[start:start + stack.per_rank]
            out.append(self.Hyper(*part.unbind(1)))
            start += stack.per_rank
        return out

    @torch.no_grad()
    def step(self):
        W = self.world_size
        hypers = self._hyper()
        pending = []  # launch every reduce-scatter, then compute while they fly
        for stack in self.stacks:
            if not stack.state:
                self._make_state(stack)
            grads = self._stacked(stack, stack.order, self._grad)
            if W > 1:
                mine = grads.new_empty((stack.per_rank, *grads.shape[1:]))
                pending.append((stack, mine, reduce_scatter_async(mine.view(-1), grads.view(-1))))
            else:
                pending.append((stack, grads, None))
        gathers = []
        for (stack, grad, work), hyper in zip(pending, hypers):
            if work is not None:
                work.wait()
            weights = self._stacked(stack, stack.mine, lambda m: self._view(self.matrices[m][0], m))
            new = self.update(grad, weights, stack.state, hyper, W, self.ns_dtype)
            if W > 1:
                gathered = new.new_empty((W * stack.per_rank, *new.shape[1:]))
                gathers.append((stack, gathered, all_gather_async(gathered.view(-1), new.reshape(-1))))
            else:
                gathers.append((stack, new, None))
        for stack, gathered, work in gathers:
            if work is not None:
                work.wait()
            slots = [(i, m) for i, m in enumerate(stack.order) if m is not None]
            torch._foreach_copy_([self._view(self.matrices[m][0].data, m) for _, m in slots],
                                 [gathered[i] for i, _ in slots])

    # torch.optim.Optimizer.load_state_dict would cast the fp32 state to each parameter's dtype (bf16 on
    # CUDA): save and restore it as it is, one entry per matrix in order (this rank's; the others' empty).
    def state_dict(self) -> dict:
        return {"state": [dict(s) for s in self.matrix_state], "param_groups": group_settings(self)}

    def load_state_dict(self, state_dict: dict):
        if len(state_dict["state"]) != len(self.matrices):
            raise ValueError(f"NorMuon state holds {len(state_dict['state'])} matrices; this one has "
                             f"{len(self.matrices)}")
        restore_group_settings(self, state_dict["param_groups"])
        self.matrix_state = [{} for _ in self.matrices]
        for stack in self.stacks:
            stack.state = {}
            saved = [state_dict["state"][m] for m in stack.mine if m is not None]
            if not any(saved):
                continue  # made at the next step, as at the first
            self._make_state(stack)
            for m in stack.mine:
                saved = state_dict["state"][m] if m is not None else {}
                if unknown := set(saved) - set(self.matrix_state[m]):
                    raise ValueError(f"{type(self).__name__} keeps no {', '.join(sorted(unknown))}: the state is "
                                     f"another matrix optimizer's (--matrix_optimizer) or another weight dtype's")
                for key, value in saved.items():
                    self.matrix_state[m][key].copy_(value)


# -----------------------------------------------------------------------------
# ANVIL (record #92): NorMuon's machinery with another update rule: a twin-rail velocity, six quintic maps, a
# per-lane energy equalizer and cautious weight decay gated on the slow rail

# Six odd quintics a*x + b*x^3 + c*x^5 of the singular values, record #92's (its own fit for the velocity it feeds
# them, not Polar Express's): each takes the singular values the previous ones leave and pushes them toward 1.
ANVIL_MAPS = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
# The cascade's input is divided by this times its Frobenius norm (the root of its Gram matrix's trace, an upper
# bound of its largest singular value): the maps start from singular values of at most 1 / 1.05 (record #92's margin).
ANVIL_GRAM_SCALE = 1.05
ANVIL_SLOW_BETA = 0.98  # the slow rail's beta, from step 0: a ~50-step mean of the gradient, the decay gate's sign
ANVIL_FAST_BETA = 0.85  # the fast rail's beta from the engage step (--anvil_engage_step): record #92's tuned value
ANVIL_BLEND = 0.4385  # the fast rail's share of the velocity from the engage step: record #92's tuned value


def anvil_maps(g: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """About U V^T of g = U S V^T for each matrix of g (k, rows, cols), by record #92's cascade, in `dtype`
    (bf16 on GPUs: each product accumulates in fp32 and is stored in bf16, as the record's kernels do). On the
    wide side (a tall g is iterated as its transpose, so that A is the smaller Gram matrix):
        x = g / d,   d = 1.05 sqrt(tr(g g^T)) + 1e-6   (1.05 ||g||_F)
        x <- a x + (b A + c A^2) x,   A = x x^T,   for (a, b, c) in ANVIL_MAPS,
    each map taking every singular value s to a s + b s^3 + c s^5. The first A is not recomputed: it is g's Gram
    matrix divided by d^2 and rounded to `dtype` once more, as the record computes it."""
    x = g.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    gram = x @ x.mT
    d = gram.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None].sqrt() * ANVIL_GRAM_SCALE + 1e-6
    x = (x.float() / d).to(dtype)
    gram = (gram.float() / d.square()).to(dtype)
    for k, (a, b, c) in enumerate(ANVIL_MAPS):
        if k:
            gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if transposed else x


def equalize_lanes(v: Tensor, lane_energy: Tensor, one_minus_beta2) -> Tensor:
    """ANVIL's per-lane equalizer, on v (..., rows, cols) in its dtype with fp32 statistics. A lane is an index of
    the longer side (neuron_dim: the record's lanes are the rows of a tall or square matrix, the columns of a wide
    one); p_i is its mean square over the n entries of the shorter side, E_i its running mean, and each lane is
    scaled by E_i^(-1/2), the whole matrix then by what restores its Frobenius norm:
        E_i <- E_i + (1 - beta2) (p_i - E_i),   g_i = max(E_i, 1e-10)^(-1/2)
        v_i <- v_i g_i sqrt(n sum_j p_j) / max(sqrt(n sum_j p_j g_j^2), 1e-10).
    Both norms come from the lane powers (the record's), not from v. NorMuon's normalize_neurons is the same map,
    its norms computed from the matrices."""
    dim = neuron_dim(v.shape)
    power = v.float().square().mean(dim=dim, keepdim=True)
    n = v.size(dim)
    norm_before = (power.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    lane_energy.lerp_(power, one_minus_beta2)
    gain = lane_energy.clamp_min(1e-10).rsqrt()
    norm_after = (power * n * gain.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return v * (gain * (norm_before / norm_after.clamp_min(1e-10))).to(v.dtype)


class AnvilHyper(NamedTuple):
    """One ANVIL step's settings for a stack of k matrices, each (k, 1, 1) fp32 on the device (as NorMuonHyper)."""
    momentum: Tensor  # the Nesterov lookahead: the rail beta
    fast_beta: Tensor
    blend: Tensor  # the fast rail's share of the velocity
    one_minus_beta2: Tensor
    step: Tensor  # lr * sqrt(max(1, rows / cols)) * lr_mul
    decay: Tensor  # weight_decay * lr


def anvil_update(grad: Tensor, weight: Tensor, state: dict, hyper: AnvilHyper, world_size: int,
                 ns_dtype: torch.dtype) -> Tensor:
    """ANVIL's step for a stack of same-shape matrices (k, rows, cols), as normuon_update's: summed gradients over
    world_size ranks and the weights in, the new weights out; the state ("rails" (k, 2, rows, cols): the fast and
    the slow rail, "lane_energy", and for bf16 weights "mantissa") updated in place. With G the mean gradient:
        f <- f + (1 - beta_f) (G - f),   s <- s + (1 - 0.98) (G - s)      the rails, both zero at step 0
        u = G + mu (w f + (1 - w) s - G)                                    the blend, Nesterov's lookahead
        v = equalize_lanes(anvil_maps(u))
        p <- p - lr * r * (v + lr * wd * [s * p >= 0] * p),   r = sqrt(max(1, rows / cols)) * lr_mul,
    mu the rail beta; beta_f and w the schedule's (Schedule.rails). The decay's gate reads the slow rail, the
    denoised gradient, where NorMuon's reads the update. bf16 weights: p is the fp32 master (bf16_with_mantissa),
    stored truncated (split_mantissa)."""
    grad = grad.float().div_(world_size)
    rails = state["rails"]
    fast, slow = rails[:, 0], rails[:, 1]
    fast.lerp_(grad, 1 - hyper.fast_beta)
    slow.lerp_(grad, 1 - ANVIL_SLOW_BETA)
    velocity = hyper.blend * fast + (1 - hyper.blend) * slow
    v = anvil_maps(grad.lerp(velocity, hyper.momentum), ns_dtype)
    v = equalize_lanes(v, state["lane_energy"], hyper.one_minus_beta2).float()
    mantissa = state.get("mantissa")
    precise = bf16_with_mantissa(weight, mantissa) if mantissa is not None else weight
    cautious = (slow * precise) >= 0
    new = precise - precise * cautious * hyper.decay * hyper.step - v * hyper.step
    return split_mantissa(new, mantissa) if mantissa is not None else new


class Anvil(NorMuon):
    """ANVIL (record #92: "Averaged, Normalized Velocity with Isotropic Lanes") on NorMuon's machinery: the same
    stacks dealt out round robin, reduce-scatter and all-gather, mantissas, state_dict and compiled update; its
    own rule (anvil_update) and state. Each matrix keeps "rails" [2, rows, cols] fp32 (the fast rail, then the
    slow one), "lane_energy" (one fp32 value per lane) and, for bf16 weights, "mantissa".

    A group's settings: lr, lr_mul, weight_decay, beta2 (the lane energies'), momentum (the rail beta, the
    Nesterov lookahead), fast_beta and blend; set_schedules moves the last three each step (Schedule.momentum,
    Schedule.rails)."""

    rule = staticmethod(anvil_update)
    Hyper = AnvilHyper

    def __init__(self, params, lr: float = 0.023, momentum: float = 0.85, beta2: float = 0.9,
                 weight_decay: float = 0.0, ns_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay, ns_dtype=ns_dtype)
        self.defaults.update(fast_beta=momentum, blend=1.0)
        for group in self.param_groups:
            group.setdefault("fast_beta", momentum)
            group.setdefault("blend", 1.0)

    @staticmethod
    def _moments(shape: tuple, device) -> dict[str, Tensor]:
        lane_shape = list(shape)
        lane_shape[neuron_dim(shape)] = 1
        return {"rails": torch.zeros((shape[0], 2, *shape[1:]), dtype=torch.float32, device=device),
                "lane_energy": torch.zeros(lane_shape, dtype=torch.float32, device=device)}

    @staticmethod
    def _settings(group: dict, rows: int, cols: int) -> tuple[float, ...]:
        lr = group["lr"]
        return (group["momentum"], group["fast_beta"], group["blend"], 1 - group["beta2"],
                max(1.0, rows / cols) ** 0.5 * group["lr_mul"] * lr, group["weight_decay"] * lr)


MATRIX_OPTIMIZERS = {  # --matrix_optimizer's choices, as the log header names them
    "normuon": "NorMuon (record #89's: momentum, Polar Express, per-neuron normalisation, cautious decay)",
    "anvil": "ANVIL (record #92's: twin-rail velocity, six quintic maps, per-lane equalizer, decay gated on the "
             "slow rail)",
}


def group_settings(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def restore_group_settings(opt: torch.optim.Optimizer, saved: list[dict]):
    for group, settings in zip(opt.param_groups, saved):
        group.update(settings)


# -----------------------------------------------------------------------------
# DistAdam: ZeRO-style sharded Adam whose reduce-scatters start during backward

def adam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, betas: tuple[float, float],
                eps: float, step_size: Tensor, decay: Tensor):
    """Record #85's Adam step on one shard, in place: m / (sqrt(v) + eps) * step_size, then cautious weight
    decay: where the update and the weight agree in sign, the update also takes decay * p (decay = lr^2 * wd).
    betas and eps are the group's constants; step_size and decay 0-dim tensors, so that a compiled update
    (compile_optimizers: one graph per kind of bucket, any size) never recompiles as the schedule moves them."""
    beta1, beta2 = betas
    grad = grad.float()
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = exp_avg.div(exp_avg_sq.sqrt().add_(eps)).mul_(step_size)
    update.add_(param.float() * ((update * param) > 0) * decay)  # (adds zeros where the decay is 0)
    param.sub_(update.to(param.dtype))


def add_transposed(target: Tensor, source: Tensor):
    target.add_(source.T)


def copy_transposed(target: Tensor, source: Tensor):
    target.copy_(source.T)


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
        self.needed = len(params)  # and how many must (a tied parameter's bucket also waits for its source)
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
        torch.cat([p.data.reshape(-1) for p in self.params], out=flat[:self.numel])
        return flat

    def write_back(self, flat: Tensor):
        if self._in_place():
            return
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


@dataclass
class _SparseWork:
    """A sparse exchange in flight: the two all-to-alls, what they receive, and what they send (kept alive)."""
    works: tuple
    rows: Tensor
    values: Tensor
    sent: tuple


class DistAdam(EagerOptimizer):
    """Adam with state sharded over ranks (ZeRO-1 style) and communication overlapped with backward.

    A post-accumulate-grad hook on every parameter starts an async reduce-scatter of its gradient
    as soon as backward has produced it (parameters below `small_numel` elements are coalesced per
    group, and reduced when the last of them is ready). step() walks the buckets in reverse order,
    the order backward finishes them, waits for each gradient shard, updates this rank's shard of
    the parameter with its shard of the Adam state, and starts an all-gather of it; every gather
    completes before step() returns. Inside `no_sync()` backward only accumulates gradients
    locally, so the micro-batches of several steps cost one reduce-scatter per bucket. At world
    size 1 there are no hooks and no collectives.

    The update is record #85's: m / (sqrt(v) + eps) * lr * sqrt(1 - beta2^t) / (1 - beta1^t), then
    cautious weight decay: where the update and the weight agree in sign, the update also takes
    lr^2 * wd * p. Each group has its own betas, lr and weight decay (the record's parameter table).

    tie(source, target): until untie(), `source` is `target` transposed (the record's embedding and
    lm_head): the source's gradient is added, transposed, into the target's before the target's single
    reduce-scatter (launched when both are ready), the source is not updated on its own, and after each
    step it is the target's transpose again. untie() gives the source the target's Adam state.

    sparse: an embedding table whose gradient touches few rows a step (the bigram table). Its rows are
    exchanged sparsely, as the record does: the caller names the rows each micro-batch touches
    (touch_rows, from the host's copy of the tokens), start_sparse_exchange() sends the per-rank counts
    over a CPU group before the backward that completes an Adam step, and the table's hook sends each
    touched row not its own to the rank that owns it (two all-to-alls: row indices, row gradients); the
    owner adds them to its own rows. The sum is the dense reduce-scatter's, for a fraction of the bytes.

    table: record #92's sharded n-gram table (NgramEmbedding), whose group (the one holding its shard) is stepped by
    NgramAdam, not by a bucket.

    The groups marked embedding_cadence (the value embeddings, the n-gram table) take their Adam step only at the
    Adam steps set_embedding_step(True) says are theirs (Schedule.embed_adam_steps); at the others their buckets
    are parked: their hooks start nothing, step() and zero_grad() leave them, and their gradients accumulate.

    A bucket whose gradient never completed during backward (a parameter without a gradient) is
    reduced from step() instead, and counted in `late_reductions`: that costs the overlap.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, small_numel: int = 4096, sparse: Tensor | None = None,
                 table: NgramEmbedding | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.world_size = dist.get_world_size() if distributed() else 1
        self.rank = dist.get_rank() if distributed() else 0
        self._sync = True
        self.late_reductions = 0
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[Tensor, _Bucket] = {}
        self.tied: tuple[Tensor, Tensor] | None = None  # (source, target) while tied
        self.tie_pair: tuple[Tensor, Tensor] | None = None
        self.embedding_step = True
        self.table = None
        for index, group in enumerate(self.param_groups):
            if table is not None and any(p is table.weight for p in group["params"]):
                self.table = NgramAdam(table, group)
                continue
            small = [p for p in group["params"] if p.numel() < small_numel]
            for p in group["params"]:
                if p.numel() >= small_numel:
                    self.buckets.append(_Bucket([p], index, self.world_size))
            if small:
                self.buckets.append(_Bucket(small, index, self.world_size))
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
        self.sparse_bucket, self._touched, self._exchange = None, None, None
        if sparse is not None and self.world_size > 1:
            bucket = self._bucket_of[sparse]
            rows, width = sparse.shape
            if bucket._in_place() and rows % self.world_size == 0:  # each rank owns whole rows
                self.sparse_bucket, self.rows_per_rank = bucket, rows // self.world_size
                self._touched, self._rows_known = np.zeros(rows, dtype=bool), True
                # the counts travel between host memories: a CPU group beside NCCL (a CPU run's group is one)
                self._host_group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        # compile_optimizers puts compiled ones here
        self.update, self.add_transposed, self.copy_transposed = adam_update, add_transposed, copy_transposed
        self._hooks = []
        if self.world_size > 1:
            for bucket in self.buckets:
                for p in bucket.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def tie(self, source: Tensor, target: Tensor):
        if len(self._bucket_of[source].params) != 1 or len(self._bucket_of[target].params) != 1:
            raise ValueError("tied parameters must each have a bucket of their own")
        self.tied = self.tie_pair = (source, target)
        self._bucket_of[target].needed = 2

    @torch.no_grad()
    def untie(self):
        """The source gets the target's Adam state, transposed (the record's copy at the untie step)."""
        source, target = self.tied
        target_bucket, source_bucket = self._bucket_of[target], self._bucket_of[source]
        target_state = self.state[target]
        state = {"step": target_state["step"]}
        for key in ("exp_avg", "exp_avg_sq"):
            shard = target_state[key]
            if self.world_size > 1:
                full = torch.empty(target_bucket.padded_numel, dtype=shard.dtype, device=shard.device)
                all_gather_async(full, shard).wait()
            else:
                full = shard
            transposed = full[:target.numel()].view(target.shape).T.reshape(-1)
            lo = self.rank * source_bucket.shard_numel
            mine = torch.zeros(source_bucket.shard_numel, dtype=shard.dtype, device=shard.device)
            part = transposed[lo:lo + source_bucket.shard_numel]
            mine[:part.numel()].copy_(part)
            state[key] = mine
        self.state[source] = state
        self._bucket_of[target].needed = 1
        self.tied = None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally; the next backward outside reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def set_embedding_step(self, steps: bool):
        """Whether the next step() is one of the Adam steps of the embedding_cadence groups; set before the
        backward that completes it (their hooks ask)."""
        self.embedding_step = steps

    def _parked(self, bucket: _Bucket) -> bool:
        return not self.embedding_step and self.param_groups[bucket.group_index].get("embedding_cadence", False)

    def zero_grad(self, set_to_none: bool = True):
        """Clears the gradients step() used: a parked bucket's accumulate on."""
        for bucket in self.buckets:
            if not self._parked(bucket):
                for p in bucket.params:
                    p.grad = None

    def _grad_ready(self, p: Tensor):
        if not self._sync or self._parked(self._bucket_of[p]):
            return
        if self.tied is not None and p is self.tied[0]:
            bucket = self._bucket_of[self.tied[1]]  # the source's gradient completes the target's bucket
        else:
            bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready == bucket.needed:
            self._launch_reduce_scatter(bucket)

    def _add_tied_gradient(self, bucket: _Bucket):
        if self.tied is not None and bucket.params[0] is self.tied[1]:
            source, target = self.tied
            if source.grad is not None:
                if target.grad is None:
                    target.grad = source.grad.T.contiguous()
                else:
                    self.add_transposed(target.grad, source.grad)

    def touch_rows(self, rows: np.ndarray | None):
        """Rows of the sparse table a micro-batch's forward reads (host indices): their gradients may be
        nonzero, every other row's is zero on every rank. None: not known; this Adam step reduces densely."""
        if self._touched is None:
            return
        if rows is None:
            self._rows_known = False
        else:
            self._touched[rows] = True

    def start_sparse_exchange(self):
        """Before the backward that completes an Adam step: which touched rows go to which rank, and the
        count exchange (host to host, so nothing waits on the device)."""
        if self._touched is None:
            return
        rows, known = np.flatnonzero(self._touched), self._rows_known
        self._touched[:], self._rows_known = False, True
        if not known:
            return
        owners = rows // self.rows_per_rank
        rows = rows[owners != self.rank]  # this rank's own rows are already in its gradient
        counts = np.bincount(owners[owners != self.rank], minlength=self.world_size)
        received = torch.empty(self.world_size, dtype=torch.int64)
        work = dist.all_to_all_single(received, torch.from_numpy(counts), group=self._host_group, async_op=True)
        self._exchange = {"rows": rows, "counts": counts.tolist(), "received": received, "work": work}

    def _launch_sparse(self, bucket: _Bucket):
        exchange, self._exchange = self._exchange, None
        exchange["work"].wait()
        received = exchange["received"].tolist()
        grad = bucket.params[0].grad
        width = grad.size(1)
        rows = torch.from_numpy(exchange["rows"])
        rows = (rows.pin_memory().to(grad.device, non_blocking=True) if grad.is_cuda else rows)
        values = grad.index_select(0, rows)
        in_rows = torch.empty(sum(received), dtype=torch.int64, device=grad.device)
        in_values = torch.empty(sum(received) * width, dtype=grad.dtype, device=grad.device)
        works = (dist.all_to_all_single(in_rows, rows, received, exchange["counts"], async_op=True),
                 dist.all_to_all_single(in_values, values.view(-1), [n * width for n in received],
                                        [n * width for n in exchange["counts"]], async_op=True))
        bucket.work = _SparseWork(works, in_rows, in_values.view(-1, width), (rows, values))

    def _merge_sparse(self, bucket: _Bucket) -> Tensor:
        """The mean gradient of this rank's rows: its own plus the rows the others sent."""
        work = bucket.work
        for w in work.works:
            w.wait()
        grad = bucket.params[0].grad
        lo = self.rank * self.rows_per_rank
        mine = grad[lo:lo + self.rows_per_rank]
        mine.index_add_(0, work.rows - lo, work.values)
        return mine.reshape(-1).div_(self.world_size)

    def _launch_reduce_scatter(self, bucket: _Bucket):
        if bucket is self.sparse_bucket and self._exchange is not None:
            return self._launch_sparse(bucket)
        self._add_tied_gradient(bucket)
        flat = bucket.flat_grad()
        bucket.grad_shard = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        bucket.work = reduce_scatter_async(bucket.grad_shard, flat)

    def _adam(self, bucket: _Bucket, param_shard: Tensor, grad_shard: Tensor, hyper: Tensor):
        group = self.param_groups[bucket.group_index]
        state = self.state[bucket.params[0]]  # a bucket's state lives under its first parameter
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param_shard, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param_shard, dtype=torch.float32)
        self.update(param_shard, grad_shard, state["exp_avg"], state["exp_avg_sq"], group["betas"], group["eps"],
                    hyper[0], hyper[1])

    def _hyper(self, buckets: list[_Bucket]) -> Tensor:
        """Each bucket's step size (bias corrections included) and cautious decay for this step, counting the
        step (a Python int: reading it needs no device sync), in one copy to the device: (buckets, 2)."""
        rows = []
        for bucket in buckets:
            group, state = self.param_groups[bucket.group_index], self.state[bucket.params[0]]
            state["step"] = step = state.get("step", 0) + 1
            (beta1, beta2), lr = group["betas"], group["lr"]
            rows.append((lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step), lr * lr * group["weight_decay"]))
        return host_to_device(torch.tensor(rows, dtype=torch.float32), buckets[0].params[0].device)

    @torch.no_grad()
    def step(self):
        gathers = []
        tied_source = self.tied[0] if self.tied is not None else None
        buckets = [b for b in reversed(self.buckets)
                   if (tied_source is None or b.params[0] is not tied_source) and not self._parked(b)]
        hypers = self._hyper(buckets)
        position = {id(b): i for i, b in enumerate(buckets)}
        for bucket in reversed(self.buckets):
            if self._parked(bucket):
                continue
            if tied_source is not None and bucket.params[0] is tied_source:
                bucket.work, bucket.grad_shard, bucket.ready = None, None, 0
                continue  # a tied source follows its target (below)
            flat_param = bucket.flat_param()
            lo = self.rank * bucket.shard_numel
            param_shard = flat_param[lo:lo + bucket.shard_numel]
            if self.world_size == 1:
                self._add_tied_gradient(bucket)
                grad_shard = bucket.flat_grad()
            else:
                if bucket.work is None:  # some gradient never arrived during backward: reduce what there is
                    self.late_reductions += 1
                    self._launch_reduce_scatter(bucket)
                if isinstance(bucket.work, _SparseWork):
                    grad_shard = self._merge_sparse(bucket)
                else:
                    bucket.work.wait()  # gloo has no futures for reduce-scatter: wait on the handle
                    grad_shard = bucket.grad_shard.div_(self.world_size)
            self._adam(bucket, param_shard, grad_shard, hypers[position[id(bucket)]])
            if self.world_size > 1:
                gathers.append((bucket, flat_param, all_gather_async(flat_param, param_shard)))
            else:
                bucket.write_back(flat_param)
            bucket.work, bucket.grad_shard, bucket.ready = None, None, 0
        for bucket, flat_param, work in gathers:
            work.wait()
            bucket.write_back(flat_param)
        if self.tied is not None:
            source, target = self.tied
            self.copy_transposed(source.data, target.data)
        if self.table is not None and self.embedding_step:
            self.table.step()

    # The state is this rank's shards, kept in fp32 (torch.optim.Optimizer.load_state_dict would cast
    # it to the parameters' dtype, bf16 on CUDA). Checkpoints hold one such dict per rank.
    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "tied": self.tied is not None,
                "buckets": [dict(self.state.get(b.params[0], {})) for b in self.buckets],
                "param_groups": group_settings(self),
                **({"ngram": self.table.state_dict()} if self.table is not None else {})}

    def load_state_dict(self, state_dict: dict):
        if self._touched is not None:  # rows touched since the last Adam step (the warmup's) are forgotten
            self._touched[:], self._rows_known, self._exchange = False, True, None
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
        if self.tie_pair is not None:  # tied or not, as when the state was saved
            self.tied = self.tie_pair if state_dict["tied"] else None
            self._bucket_of[self.tie_pair[1]].needed = 2 if state_dict["tied"] else 1
        if self.table is not None:
            self.table.load_state_dict(state_dict["ngram"])


# -----------------------------------------------------------------------------
# Record #92's n-gram table, sharded: each rank holds its slice of the rows (NgramEmbedding); a step pulls the
# rows its micro-batches read from their owners (ngram_pull), the gradients of those rows collect over the
# steps up to the table's next Adam step, then go to their owners, who step them (NgramAdam)

_HOST_GROUP: list = []  # [the default group it was made for, the gloo group beside it]


def host_group():
    """The group for collectives of host (CPU) tensors: the default group of a CPU run, or beside NCCL a gloo group,
    made once per default group at its first use (every rank's first n-gram pull, at the same point of the run)."""
    if dist.get_backend() != "nccl":
        return None
    if not _HOST_GROUP or _HOST_GROUP[0] is not dist.group.WORLD:
        _HOST_GROUP[:] = [dist.group.WORLD, dist.new_group(backend="gloo")]
    return _HOST_GROUP[1]


@dataclass
class RowRoute:
    """Where the rows of an ascending list of global row ids live: `own` is this rank's block of the list (rank j
    owns rows [j R, (j + 1) R), R rows a rank, so the list is cut into one block per rank, in rank order); `send[j]`
    of the ids outside it go to rank j (0 to itself), in order; `receive[j]` ids came from rank j, `received` them
    (global ids, host int64, in rank order)."""
    own: slice
    send: list[int]
    receive: list[int]
    received: np.ndarray


def route_rows(ids: np.ndarray, table: NgramEmbedding) -> RowRoute:
    """The count and id exchange for ascending global ids of the table (host to host, through host_group: nothing
    waits on the device). At world size 1 every row is this rank's, and nothing is sent."""
    world, rank, rows_per_rank = table.world, table.rank, table.weight.size(0)
    cut = np.searchsorted(ids, np.arange(world + 1, dtype=np.int64) * rows_per_rank)
    own = slice(int(cut[rank]), int(cut[rank + 1]))
    if world == 1:
        return RowRoute(own, [0], [0], np.empty(0, dtype=np.int64))
    send = np.diff(cut)
    send[rank] = 0
    group, counts = host_group(), torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(counts, torch.from_numpy(send.astype(np.int64)), group=group)
    receive, send = counts.tolist(), send.tolist()
    received = np.zeros(sum(receive), dtype=np.int64)  # (a host array the collective fills)
    others = np.concatenate([ids[:own.start], ids[own.stop:]]).astype(np.int64)
    dist.all_to_all_single(torch.from_numpy(received), torch.from_numpy(others), receive, send, group=group)
    return RowRoute(own, send, receive, received)


def exchange_rows(values: Tensor, send: list[int], receive: list[int]) -> Tensor:
    """One all-to-all of rows (k, width) on the device: send[j] of them, in order, to rank j; the sum(receive) rows
    received, in rank order."""
    width = values.size(1)
    out = torch.empty(sum(receive), width, dtype=values.dtype, device=values.device)
    dist.all_to_all_single(out.view(-1), values.reshape(-1), [n * width for n in receive], [n * width for n in send])
    return out


def device_ids(ids: np.ndarray, device: torch.device) -> Tensor:
    return host_to_device(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), device)


@torch.no_grad()
def ngram_pull(table: NgramEmbedding, ids: np.ndarray, grad: bool):
    """table.view := the rows `ids` (ascending global row ids, host) as the table holds them now, each from the
    rank that owns it: the ids go host to host (route_rows), the rows in one all-to-all on the device, and this
    rank's own from its shard. The rows are kept in fp32 (the shard's values, exactly), with `grad` as an autograd
    leaf: their gradient (NgramCombine's) sums over the forwards until NgramAdam.end_step takes it. No host sync;
    at world size 1 the rows are copied from the shard."""
    shard = table.weight
    route = route_rows(ids, table)
    own = shard.index_select(0, device_ids(ids[route.own] - table.lo, shard.device))
    if table.world == 1:
        cache = own
    else:
        served = shard.index_select(0, device_ids(route.received - table.lo, shard.device))
        pulled = exchange_rows(served, send=route.receive, receive=route.send)  # serve what was asked, get ours
        cache = torch.cat([pulled[:route.own.start], own, pulled[route.own.start:]])
    table.view = NgramView(cache.float().requires_grad_(grad), device_ids(ids, shard.device))


def gathered_ngram_table(model: GPT) -> Tensor | None:
    """Record #92's whole table on rank 0's host, gathered from every rank's shard (a collective: every rank calls it;
    the others get None), for the final weights."""
    if model.ngram is None:
        return None
    shard = model.ngram.weight.detach().to("cpu", copy=True)
    if model.ngram.world == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(model.ngram.world)] if dist.get_rank() == 0 else None
    dist.gather(shard, parts, dst=0, group=host_group())
    return torch.cat(parts) if parts is not None else None


def host_array(tokens: Tensor) -> np.ndarray:
    """A host tensor's values (tools/preflight.py reads them beside its fake tensors)."""
    return tokens.numpy()


def host_ngram_rows(chunk: np.ndarray, rows: int) -> np.ndarray:
    """The table rows of record #92's n-gram table that a micro-batch's inputs (chunk[:-1]) read, ascending, as
    GPT.hidden hashes them (ngram_rows)."""
    ids = torch.from_numpy(chunk[:-1].astype(np.int64))
    return np.unique(ngram_rows(ids, shifted(ids, 1, len(ids)), shifted(ids, 2, len(ids)), torch.arange(len(ids)),
                                rows).numpy())


def ngram_adam_rows(p: Tensor, v: Tensor, g: Tensor, missed_decay: Tensor, hyper: "NgramHyper"
                    ) -> tuple[Tensor, Tensor]:
    """Record #92's Adam step of the table's rows that have a gradient at this event (its row kernel with beta1 = 0):
    p (k, dim) the rows, v (k,) their fp32 second moments as of their last event, g (k, dim) the gradients summed
    over the W ranks (fp32), missed_decay (k,) the product of beta2 over the events each row missed since (fp64).
    In fp32, with s = lr sqrt(1 - beta2^t) (beta1 = 0: no first bias correction) and w = lr^2 wd:

        v' = v missed_decay beta2 + mean_d(g^2) (1 - beta2) / W^2      (one second moment per row)
        u  = (g / W) / (sqrt(v') + eps) * s
        u += p w  where u p > 0                                         (cautious weight decay)
        p' = p - u

    Returns (p' in p's dtype, v'). With beta1 = 0 this is dense per-row Adam restricted to these rows: a row without
    gradient at an event has u = 0 exactly (0 / (sqrt(v) + eps), eps > 0), so its weights stay and no decay fires
    (u p = 0), and its v only decays by beta2, which missed_decay replays when it next has one."""
    width, world = g.size(-1), hyper.world
    v = (v.double() * missed_decay).float()
    m = g * (1 / world)
    v = v * hyper.beta2 + (g * g).sum(-1) / width * ((1 - hyper.beta2) / world ** 2)
    u = (m / (v.sqrt() + hyper.eps)[:, None]) * hyper.step_size
    pf = p.float()
    u = u + torch.where(u * pf > 0, pf * hyper.decay, 0.0)
    return (pf - u).to(p.dtype), v


class NgramHyper(NamedTuple):
    """One event of the table's Adam: beta2, eps, s = lr sqrt(1 - beta2^t), w = lr^2 wd, the world size W."""
    beta2: float
    eps: float
    step_size: float
    decay: float
    world: int


class NgramAdam:
    """The sharded n-gram table's Adam (record #92's), and the traffic of its rows. DistAdam holds one when the model
    has the table (--ngram_channels=2), beside its buckets, not as one: the table has no dense gradient to
    reduce-scatter, so it has no hook either (the rows' gradient is complete only at the end of the last backward,
    x0_bigram being the stem's output); its group in DistAdam's param_groups carries its lr, betas and weight decay.

    A training step: begin_step pulls the rows this rank's micro-batches read (ngram_pull: a row's value as of the
    table's last Adam step, since p moves only there), the forwards read them, the backwards sum their gradient;
    end_step adds it to the gradient of the rows read since the last Adam step (ascending ids and an (n, dim) fp32
    tensor: rows, never the table). At the table's Adam step (DistAdam.step on one of the embeddings' steps,
    Schedule.embed_adam_steps), step() sends each row's gradient to its owner (ids host to host, values in one
    all-to-all in the table's dtype), the owner sums each row's over the ranks and steps those rows (ngram_adam_rows).

    The state: one fp32 second moment per row, the event at which each row last had a gradient, and the event
    count t with the log of every event's beta2 summed so far: a row's missed decay of v is replayed from them when it
    next has a gradient (the record's replay, as the exponential of a difference of fp64 sums rather than a product in
    fp32, which differs in v by about an fp32 rounding per missed event). t counts every Adam step of the table for
    the bias correction, with the current beta2 (record #92)."""

    def __init__(self, table: NgramEmbedding, group: dict):
        self.table, self.group = table, group
        rows, device = table.weight.size(0), table.weight.device
        self.world = table.world
        self.v = torch.zeros(rows, dtype=torch.float32, device=device)
        self.last_event = torch.zeros(rows, dtype=torch.int32, device=device)
        self.events, self.log_decay = 0, [0.0]  # log_decay[j]: sum of log beta2 over events 1..j
        self._log_decay = torch.zeros(1, dtype=torch.float64, device=device)
        self.step_ids: np.ndarray | None = None
        self.ids: np.ndarray | None = None  # the rows read since the last Adam step, ascending
        self.grad: Tensor | None = None  # and their gradient, (len(ids), dim) fp32

    def begin_step(self, rows: list[np.ndarray]):
        """Pulls the rows a step's micro-batches read (each micro-batch's ascending row ids, host_ngram_rows)."""
        self.step_ids = np.unique(np.concatenate(rows)) if rows else np.empty(0, dtype=np.int64)
        ngram_pull(self.table, self.step_ids, grad=True)

    @torch.no_grad()
    def end_step(self):
        """After the step's backwards: its rows' gradient joins those since the last Adam step."""
        view, self.table.view = self.table.view, None
        ids, grad = self.step_ids, view.cache.grad
        if grad is None:
            return
        if self.ids is None:
            self.ids, self.grad = ids, grad
            return
        union = np.union1d(self.ids, ids)
        merged = torch.zeros(len(union), grad.size(1), dtype=torch.float32, device=grad.device)
        merged.index_copy_(0, device_ids(np.searchsorted(union, self.ids), grad.device), self.grad)
        merged.index_add_(0, device_ids(np.searchsorted(union, ids), grad.device), grad)
        self.ids, self.grad = union, merged

    def _owned_gradient(self) -> tuple[np.ndarray, Tensor]:
        """(this shard's rows with a gradient on any rank, ascending local ids; their gradients summed over the
        ranks), from every rank's rows since the last Adam step."""
        weight = self.table.weight
        ids, grad = self.ids, self.grad
        self.ids = self.grad = None
        if ids is None:
            ids, grad = np.empty(0, dtype=np.int64), weight.new_zeros(0, weight.size(1), dtype=torch.float32)
        route = route_rows(ids, self.table)
        own_ids, own = ids[route.own] - self.table.lo, grad[route.own]
        if self.world == 1:
            return own_ids, own
        theirs = torch.cat([grad[:route.own.start], grad[route.own.stop:]]).to(weight.dtype)
        received = exchange_rows(theirs, route.send, route.receive)
        rows, where = np.unique(np.concatenate([own_ids, route.received - self.table.lo]), return_inverse=True)
        summed = torch.zeros(len(rows), weight.size(1), dtype=torch.float32, device=weight.device)
        summed.index_add_(0, device_ids(where, weight.device), torch.cat([own, received.float()]))
        return rows, summed

    @torch.no_grad()
    def step(self):
        """One Adam step of the table (an event): the gradients to their owners, the owned rows with one stepped."""
        group = self.group
        beta2, lr = group["betas"][1], group["lr"]
        self.events += 1
        t, device = self.events, self.v.device
        self.log_decay.append(self.log_decay[-1] + math.log(beta2))
        self._log_decay = torch.cat([self._log_decay, host_to_device(torch.tensor(self.log_decay[-1:],
                                                                                   dtype=torch.float64), device)])
        rows, g = self._owned_gradient()
        if len(rows) == 0:
            return
        index = device_ids(rows, device)
        missed = torch.exp(self._log_decay[t - 1] - self._log_decay[self.last_event[index].long()])
        hyper = NgramHyper(beta2, group["eps"], lr * (1 - beta2 ** t) ** 0.5, lr * lr * group["weight_decay"],
                           self.world)
        p, v = ngram_adam_rows(self.table.weight[index], self.v[index], g, missed, hyper)
        self.table.weight[index] = p
        self.v[index] = v
        self.last_event[index] = t

    def current_v(self) -> Tensor:
        """Every row's second moment as of the last event (its missed decay replayed; the state keeps it lazy)."""
        missed = torch.exp(self._log_decay[self.events] - self._log_decay[self.last_event.long()])
        return (self.v.double() * missed).float()

    def state_dict(self) -> dict:
        return {"v": self.v.clone(), "last_event": self.last_event.clone(), "events": self.events,
                "log_decay": list(self.log_decay)}

    def load_state_dict(self, state: dict):
        """The saved moments and clock; the rows read and the gradients collected since the last Adam step are
        dropped (a checkpoint is saved at one of the table's Adam steps: --save_every)."""
        self.v.copy_(state["v"])
        self.last_event.copy_(state["last_event"])
        self.events, self.log_decay = int(state["events"]), [float(x) for x in state["log_decay"]]
        self._log_decay = host_to_device(torch.tensor(self.log_decay, dtype=torch.float64), self.v.device)
        self.ids = self.grad = self.step_ids = None
        self.table.view = None


# -----------------------------------------------------------------------------
# One training step: the optimizers' tables and set-up, the schedules a step follows, train_step and
# evaluate. Everything after this keeps a run safe and measured

# Record #85's Adam parameter table: (betas, lr multiplier, weight-decay multiplier) by parameter name (a name the
# model does not have, such as mudd_w2g without --head_mix_groups, has no group).
ADAM_TABLE = {
    "embed.weight": ((0.5, 0.95), 1.0, 150.0),
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "value_embeds": ((0.75, 0.95), 75.0, 5.0),
    "bigram_embed.weight": ((0.75, 0.95), 75.0, 5.0),
    "scalars": ((0.9, 0.99), 5.0, 0.0),
    "smear_gate.weight": ((0.9, 0.99), 0.01, 0.0),
    "ve_gates": ((0.9, 0.99), 1.0, 1.0),
    "post_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": ((0.9, 0.95), 5.0, 0.0),
    "mudd_w1": ((0.9, 0.99), 0.25, 1.0),
    "mudd_w2": ((0.9, 0.99), 0.25, 1.0),
    "mudd_b2": ((0.9, 0.99), 0.25, 0.0),
    "mudd_w2g": ((0.9, 0.99), 0.25, 1.0),  # record #92's head-mix deltas (--head_mix_groups), as its mudd_w2's
    "mudd_gate_w1": ((0.9, 0.99), 0.1, 1.0),
    "mudd_gate_w2": ((0.9, 0.99), 0.1, 1.0),
    "mudd_gate_b2": ((0.9, 0.99), 0.1, 0.0),
    "mudd_gate_scale": ((0.9, 0.99), 0.1, 0.0),
    # record #92's n-gram table (--ngram_channels=2; NgramAdam): beta1 = 0 (no first moment is kept), its lr_mul
    "ngram.weight": ((0.0, 0.95), 70.0, 5.0),
}
def adam_table(args: Hyperparameters) -> dict:
    """ADAM_TABLE with the multipliers the config sets: the value embeddings' lr (--value_embed_lr_mul)."""
    betas, _, wd_mul = ADAM_TABLE["value_embeds"]
    return {**ADAM_TABLE, "value_embeds": (betas, args.value_embed_lr_mul, wd_mul)}


# The parameters on the embeddings' Adam cadence (Schedule.embed_adam_steps, --embed_adam_period; record #92): their
# betas and weight decay follow Schedule.embed_adam_power. (Record #85's bigram table keeps Adam's own cadence.)
EMBEDDING_CADENCE = ("value_embeds", "ngram.weight")
# NorMuon's lr multiplier per matrix kind, on top of sqrt(max(1, rows / cols)): the record's c_proj x2.
MUON_TABLE = {"attn.qk": 1.0, "attn.vo": 1.0, "mlp.fc": 1.0, "mlp.proj": 2.0}


def build_optimizers(model: GPT, args: Hyperparameters) -> tuple[NorMuon, DistAdam]:
    """NorMuon (or ANVIL, --matrix_optimizer) for the attention and MLP matrices; Adam, with the record's table,
    for the rest. The embedding starts tied to the lm_head (untie_step unties it)."""
    named = dict(model.named_parameters())
    anvil = args.matrix_optimizer == "anvil"
    matrix_lr = args.anvil_lr if anvil else args.muon_lr
    muon_groups = [dict(params=[p for name, p in named.items() if name.endswith(kind)], lr=matrix_lr, lr_mul=mul)
                   for kind, mul in MUON_TABLE.items()]
    table = model.ngram
    if table is not None:  # the n-gram table's shard: not a parameter (no gradient), stepped by NgramAdam
        named["ngram.weight"] = table.weight
    adam_groups = [dict(params=[named[name]], lr=args.adam_lr * lr_mul, betas=betas,
                        weight_decay=args.adam_weight_decay * wd_mul, embedding_cadence=name in EMBEDDING_CADENCE,
                        initial_betas=betas, initial_weight_decay=args.adam_weight_decay * wd_mul)
                   for name, (betas, lr_mul, wd_mul) in adam_table(args).items() if name in named]
    # Bucket order follows the forward; step() walks it backwards, the order backward completes it.
    sparse = model.bigram_embed.weight if model.bigram_embed is not None else None
    adam = DistAdam(adam_groups, eps=args.adam_eps, sparse=sparse, table=table)
    # Tied until the untie step; the weights of --init_from may come untied (data is only read for those:
    # tools/preflight.py builds the model with no data).
    if not args.init_from or torch.equal(model.embed.weight, model.lm_head.T):
        adam.tie(model.embed.weight, model.lm_head)
    ns_dtype = model.numerics.compute
    if anvil:
        muon = Anvil(muon_groups, lr=args.anvil_lr, momentum=args.anvil_beta_start, beta2=args.anvil_beta2,
                     weight_decay=args.anvil_weight_decay, ns_dtype=ns_dtype)
    else:
        muon = NorMuon(muon_groups, lr=args.muon_lr, momentum=args.muon_momentum_start, beta2=args.muon_beta2,
                       weight_decay=args.muon_weight_decay, ns_dtype=ns_dtype)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    covered = [id(p) for opt in (adam, muon) for g in opt.param_groups for p in g["params"]]
    optimized = [*model.parameters(), *([table.weight] if table is not None else [])]
    if len(covered) != len(set(covered)) or set(covered) != {id(p) for p in optimized}:
        raise RuntimeError("every parameter must belong to exactly one optimizer")
    return muon, adam


def compile_optimizers(optimizers, backend="inductor"):
    """The optimizers' arithmetic compiled, so that a step is a few graph calls rather than thousands of small
    kernels launched one by one from Python: the matrices' update (NorMuon's or ANVIL's rule) once per shape of
    stack, DistAdam's once per kind of bucket (betas, eps and dtype; any size) and the tied embedding's transposes
    (tiled kernels). Their settings reach them as tensors, so nothing recompiles as the schedule moves."""
    muon, adam = optimizers
    options = dict(backend=backend, fullgraph=True)
    muon.update = torch.compile(muon.rule, dynamic=False, **options)
    adam.update = torch.compile(adam_update, dynamic=True, **options)
    adam.add_transposed = torch.compile(add_transposed, dynamic=False, **options)
    adam.copy_transposed = torch.compile(copy_transposed, dynamic=False, **options)


def set_schedules(step: int, optimizers, schedule: Schedule, args: Hyperparameters):
    multiplier, power = schedule.lr(step), schedule.embed_adam_power(step)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
            if group.get("embedding_cadence"):  # (power 1: the table's own betas and weight decay, exactly)
                group["betas"] = tuple(beta ** power for beta in group["initial_betas"])
                group["weight_decay"] = group["initial_weight_decay"] * power
    matrix = {"momentum": schedule.momentum(step)}
    if args.matrix_optimizer == "anvil":
        matrix["fast_beta"], matrix["blend"] = schedule.rails(step)
    for group in optimizers[0].param_groups:
        group.update(matrix)


@torch.no_grad()
def refresh_fp8(model: GPT, scales: str = "stored", full: str | None = None):
    """The FP8 copies of the MLPs' projections and of the lm_head, after every change of those weights (each
    step, loading): all of them in one call, compiled on CUDA. `scales`, for the down-projections' delayed
    scaling (mlp_down_fp8): "exact" at the start, then after each step "exact" or "delayed" (down_scales),
    "stored" after loading weights with their scales; `full`, for record #92's MLPs (mlp_full_fp8), likewise
    (full_scales; by default `scales`)."""
    mlps = [mlp for block in model.blocks for mlp in (block.mlp, block.parallel_mlp)
            if mlp is not None and mlp.precision == "fp8" and not mlp.full_fp8]
    downs = [mlp for mlp in mlps if mlp.down_fp8]
    fulls = [mlp for block in model.blocks for mlp in (block.mlp, block.parallel_mlp)
             if mlp is not None and mlp.full_fp8]
    head = (model.lm_head, model.head_scales) if model.numerics.head == "fp8" else None
    if not mlps and not fulls and head is None:
        return
    mlp_copies, down_copies, full_states, head_copies = model.fp8_copies(
        [mlp.fc for mlp in mlps], [(m.proj, m.down_weight_scale, m.down_weight_next_scale) for m in downs],
        [(m.fc, m.proj, m.fp8_state()) for m in fulls], head,
        (scales if downs else "stored", (full or scales) if fulls else "stored"))  # one graph where no scale moves
    for mlp, (fc_f8, fc_scale) in zip(mlps, mlp_copies):
        mlp.fc_f8, mlp.fc_scale = fc_f8, fc_scale
    for mlp, (proj_f8_t, used, upcoming) in zip(downs, down_copies):
        mlp.proj_f8_t, mlp.down_weight_scale, mlp.down_weight_next_scale = proj_f8_t, used, upcoming
    for mlp, state in zip(fulls, full_states):
        mlp.set_fp8_state(state)
    if head_copies is not None:
        model.lm_head_f8, model.lm_head_f8_t, _ = head_copies


def down_scales(step: int) -> str:
    """How the refresh after an optimizer step moves the down-projections' weight scales (record #89)."""
    return "exact" if step < DOWN_EXACT_STEPS else "delayed"


def train_step(model: GPT, optimizers, batch, step: int, schedule: Schedule, args: Hyperparameters,
               use_flex: bool) -> Tensor:
    """Forward/backward over this rank's micro-batches, NorMuon's step, and Adam's every adam_every
    steps on the gradients of all of them (its reduce-scatters start in the backward that completes
    them); at the untie step the embedding leaves the lm_head. Where the step samples, each micro-batch's
    loss runs over its candidates (the batch's, from the loader). Returns the summed training loss (the
    multi-token objective) of this rank's tokens. No host sync."""
    muon, adam = optimizers
    adam_now = schedule.adam_steps(step)
    adam.set_embedding_step(schedule.embed_adam_steps(step))
    windows = schedule.windows(step)
    device = batch[0][0].device
    mtp = host_to_device(torch.tensor(schedule.mtp_weights(step)), device)
    prefix = schedule.prefix_weight(step)
    prefix = host_to_device(torch.tensor([prefix]), device) if prefix is not None else None
    loss_sum = torch.zeros((), device=device)
    if adam.table is not None:
        adam.table.begin_step(batch.ngram_rows)
    for i, (inputs, targets) in enumerate(batch):
        reduce_now = adam_now and i == len(batch) - 1
        adam.touch_rows(rows[i] if (rows := getattr(batch, "bigram_rows", None)) else None)
        if reduce_now:
            adam.start_sparse_exchange()
        with contextlib.nullcontext() if reduce_now else adam.no_sync():
            # Summed over tokens, averaged over micro-batches and ranks (the record's gradient scale).
            masks = build_masks(inputs, model.plans, windows, args.window_block, use_flex, model.mask_parts,
                                args.virtual_seq_cap)
            loss = model(inputs, targets, masks, mtp, loss_scale=1 / len(batch), prefix_weight=prefix,
                         candidates=batch.candidates[i] if isinstance(batch, Batch) else None)
            loss.backward()
        loss_sum += loss.detach() * len(batch)
    if adam.table is not None:
        adam.table.end_step()
    muon.step()
    muon.zero_grad(set_to_none=True)
    if adam_now:
        adam.step()
        adam.zero_grad(set_to_none=True)
        if step == schedule.untie_step and adam.tied is not None:
            adam.untie()
    refresh_fp8(model, down_scales(step), full_scales(step))
    return loss_sum


@torch.no_grad()
def evaluate(model: GPT, tokens: Tensor, windows: tuple[int, int], args: Hyperparameters, env: DistEnv,
             use_flex: bool) -> float:
    """Mean next-token loss over the len(tokens) - 1 predictions of `tokens` (val_tokens + 1 of them in a
    real validation), in sequences of val_seq_len dealt out over the ranks."""
    model.eval()
    num_seqs = (len(tokens) - 1) // args.val_seq_len
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    host = host_array(tokens) if model.ngram is not None else None
    for seq in range(env.rank, num_seqs, env.world_size):
        where = slice(seq * args.val_seq_len, (seq + 1) * args.val_seq_len + 1)
        if host is not None:  # record #92's table: every rank pulls in step (each has as many sequences)
            ngram_pull(model.ngram, host_ngram_rows(host[where], model.ngram.rows), grad=False)
        buf = to_device(tokens[where], env.device)
        inputs, targets = buf[:-1], buf[1:]
        masks = build_masks(inputs, model.plans, windows, args.window_block, use_flex, model.mask_parts)
        loss_sum += model(inputs, targets, masks).double()
    if model.ngram is not None:
        model.ngram.view = None
    if env.world_size > 1:
        dist.all_reduce(loss_sum)
    model.train()
    return loss_sum.item() / (num_seqs * args.val_seq_len)


# -----------------------------------------------------------------------------
# Record #92's terminal ships: a run ends with blends of its weights' averages over the last steps, not with the last
# iterate. Each ship keeps an fp32 accumulator of some weights over a window of the last steps; after the last step
# (on the clock, before the final validation) the weights take it. Every rank keeps the same 1/world slice of each
# accumulated tensor's elements (the math is element-wise), and one all-gather per tensor reassembles the shipped
# weights. The last step is the run's (num_iterations), so a shorter test run ships over its own tail.

TAIL_EMA_WINDOW, TAIL_EMA_BLEND = 298, 0.65  # the embedding and lm_head: an EMA at 2 / (298 + 1) per step
TAIL_AVG_WINDOW, TAIL_AVG_PERIOD, TAIL_AVG_RATE = 250, 4, 4 / 53  # V/O and MLP matrices: every 4th step to the last
VE_AVG_RATE = 4 / 53  # the value embeddings: at each of their Adam steps in the last TAIL_AVG_WINDOW steps
BANK_BLEND_WINDOW, BANK_BLEND_PERIOD = 298, 4  # every matrix, at steps 1 mod 4 and the last two, 2 / (298 // 4 + 1)
RICHARDSON = 0.2007  # the V/O and MLP blends correct their averages' lag: (1-B) A + B X + w (A - X) = lerp(A, X, B - w)
BANK_BLEND = {"qk": 0.55, "vo": 0.55 - RICHARDSON, "mlp": 0.55 - RICHARDSON}
DECONTRACTED = ("embed", "lm_head", "mlp", "qk", "vo")  # renormed after the ships to their norms before them
# Which parameters each kind names (by name, or the end of it).
SHIP_KINDS = {"embed": ("embed.weight",), "lm_head": ("lm_head",), "value_embeds": ("value_embeds",),
              "qk": (".attn.qk",), "vo": (".attn.vo",),
              "mlp": (".mlp.fc", ".mlp.proj", ".parallel_mlp.fc", ".parallel_mlp.proj")}


def ship_kinds(model: nn.Module) -> dict[str, list[Tensor]]:
    return {kind: [p for name, p in model.named_parameters() if any(name == e or name.endswith(e) for e in ends)]
            for kind, ends in SHIP_KINDS.items()}


class Ship(NamedTuple):
    """One accumulator over `kinds`: at each of the last `window` steps where rate(step) is not None,
    acc <- lerp(acc, weights, rate) (its first such step copies the weights); shipped, the weights become
    lerp(weights, acc, blend[kind]), or acc where blend is None."""
    name: str
    kinds: tuple[str, ...]
    window: int
    rate: Callable[[int], float | None]
    blend: dict | None


def record92_ships(schedule: Schedule) -> list[Ship]:
    """Record #92's four ships, in the order they ship (the bank blend last: it blends into what the tail average
    shipped). The EMA of the embedding and lm_head, which change only at Adam steps, takes each run of steps over
    which they stay as one tick of the compounded rate 1 - (1 - r)^k (the record folds pairs of steps)."""
    last = schedule.total - 1
    r = 2 / (TAIL_EMA_WINDOW + 1)

    def ema_rate(step: int) -> float | None:
        if step != schedule.total - TAIL_EMA_WINDOW and not schedule.adam_steps(step):
            return None  # the weights have not moved since the last tick
        k = next((s for s in range(step + 1, last + 1) if schedule.adam_steps(s)), schedule.total) - step
        return r if k == 1 else -math.expm1(k * math.log1p(-r))

    return [
        Ship("tail-ema", ("lm_head", "embed"), TAIL_EMA_WINDOW, ema_rate, {"lm_head": TAIL_EMA_BLEND,
                                                                            "embed": TAIL_EMA_BLEND}),
        Ship("tail-avg", ("vo", "mlp"), TAIL_AVG_WINDOW,
             lambda step: TAIL_AVG_RATE if (last - step) % TAIL_AVG_PERIOD == 0 else None, None),
        Ship("value-embed", ("value_embeds",), TAIL_AVG_WINDOW,
             lambda step: VE_AVG_RATE if schedule.embed_adam_steps(step) else None, None),
        Ship("bank-blend", ("qk", "vo", "mlp"), BANK_BLEND_WINDOW,
             lambda step: 2 / (BANK_BLEND_WINDOW // BANK_BLEND_PERIOD + 1)
             if step % BANK_BLEND_PERIOD == 1 or step >= last - 1 else None, BANK_BLEND),
    ]


class TailShips:
    """The ships' accumulators (this rank's slices) and their two moments: tick() after each optimizer step, ship()
    after the last. Their state is run state: a checkpoint inside a window holds each rank's slices."""

    def __init__(self, model: nn.Module, ships: list[Ship], total_steps: int, world_size: int, rank: int):
        self.kinds, self.ships, self.total = ship_kinds(model), ships, total_steps
        # what the record's banks hold beyond our tensors, for the decontraction's norms (GPT.removed_mlp_sq)
        self.frozen_sq = {"mlp": model.removed_mlp_sq} if hasattr(model, "removed_mlp_sq") else {}
        self.world_size, self.rank = world_size, rank
        self.acc: list[dict[int, Tensor]] = [{} for _ in ships]  # per ship: index in its tensors -> accumulator

    def tensors(self, ship: Ship) -> list[tuple[str, Tensor]]:
        return [(kind, p) for kind in ship.kinds for p in self.kinds[kind]]

    def own(self, p: Tensor) -> Tensor:
        """This rank's slice of p's elements, a view."""
        chunk = -(-p.numel() // self.world_size)
        return p.data.view(-1)[self.rank * chunk:(self.rank + 1) * chunk]

    @torch.no_grad()
    def tick(self, step: int):
        for ship, acc in zip(self.ships, self.acc):
            rate = ship.rate(step) if step >= self.total - ship.window else None
            if rate is None:
                continue
            for i, (_, p) in enumerate(self.tensors(ship)):
                mine = self.own(p).float()
                if i in acc:
                    acc[i].lerp_(mine, rate)
                else:
                    acc[i] = mine.clone()

    @torch.no_grad()
    def ship(self):
        """Every ship in order into this rank's slices, one all-gather per shipped tensor, then the decontraction:
        each kind of DECONTRACTED back to the Frobenius norm it had before the ships (one ratio per kind, a Python
        float, so that the product rounds once)."""
        kinds = [kind for kind in DECONTRACTED if self.kinds[kind]]
        reference = torch.stack([kind_norm(self.kinds[kind], self.frozen_sq.get(kind)) for kind in kinds])
        shipped = {}
        for ship, acc in zip(self.ships, self.acc):
            for i, (kind, p) in enumerate(self.tensors(ship)):
                if i in acc:
                    mine = self.own(p)
                    blend = ship.blend[kind] if ship.blend is not None else None
                    mine.copy_(acc[i] if blend is None else torch.lerp(mine.float(), acc[i], blend))
                    shipped[id(p)] = p
            acc.clear()
        for p in shipped.values():
            gather_slices(p, self.world_size)
        current = torch.stack([kind_norm(self.kinds[kind], self.frozen_sq.get(kind)) for kind in kinds])
        ratios = torch.where(current > 0, reference / current, torch.ones_like(current)).tolist()  # one sync
        for kind, ratio in zip(kinds, ratios):
            for p in self.kinds[kind]:
                p.data.mul_(ratio)

    def empty_at(self, step: int) -> bool:
        """Whether the accumulators are empty at `step` (a checkpoint there holds nothing of the ships): none has
        ticked yet, or the run's end, where they have shipped."""
        return step >= self.total or all(step <= self.total - ship.window for ship in self.ships)

    def state_dict(self) -> list[dict[int, Tensor]]:
        return [{i: t.clone() for i, t in acc.items()} for acc in self.acc]

    def load_state_dict(self, state: list):
        if len(state) != len(self.ships):
            raise ValueError(f"{len(state)} ship accumulators saved, {len(self.ships)} ships")
        device = next(iter(self.kinds.values()))[0].device
        self.acc = [{int(i): t.to(device, torch.float32, copy=True) for i, t in saved.items()} for saved in state]


def ship_bytes(model: nn.Module, ships: list[Ship], world_size: int) -> int:
    """The ships' fp32 accumulators one rank holds: its slice of each shipped tensor, once per ship."""
    kinds = ship_kinds(model)
    return sum(4 * -(-p.numel() // world_size) for ship in ships for kind in ship.kinds for p in kinds[kind])


def kind_norm(tensors: list[Tensor], frozen_sq: Tensor | None = None) -> Tensor:
    """The Frobenius norm of the tensors as one (the record's banks, with frozen_sq: the squared norm of what its
    bank holds beside them that never moves), in fp32."""
    norm = torch.stack([t.float().norm() for t in tensors]).norm()
    return norm if frozen_sq is None else (norm.square() + frozen_sq.float()).sqrt()


def gather_slices(p: Tensor, world_size: int):
    """Each rank's slice of p's elements (TailShips.own) to every rank."""
    if world_size == 1:
        return
    chunk = -(-p.numel() // world_size)
    flat = torch.zeros(chunk * world_size, dtype=p.dtype, device=p.device)
    mine = p.data.view(-1)[dist.get_rank() * chunk:][:chunk]
    padded = flat[:chunk].clone()
    padded[:mine.numel()] = mine
    all_gather_async(flat, padded).wait()
    p.data.view(-1).copy_(flat[:p.numel()])


# -----------------------------------------------------------------------------
# Command line and config checks: every flag parsed and checked once, before anything is created

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
            chosen = [a.partition("=")[2] for a in argv if a.startswith("--preset=")]
            print(usage(chosen[-1] if chosen else "speedrun"))
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
    return dataclasses.replace(args, micro_batches=canonical_micro_batches(args))


def usage(preset: str = "speedrun") -> str:
    values = PRESETS.get(preset, PRESETS["speedrun"])
    lines = [f"usage: train_gpt.py [--preset={'|'.join(PRESETS)}] [--field=value ...]", "",
             f"fields (the {preset if preset in PRESETS else 'speedrun'} preset's values):"]
    for f in dataclasses.fields(Hyperparameters):
        lines.append(f"  --{f.name}={values.get(f.name, f.default)!s:<40} {f.metadata['help']}")
    return "\n".join(lines)


def canonical_micro_batches(args: Hyperparameters) -> str:
    """--micro_batches in one spelling per meaning: auto, one count when every stage has it ("4,4,4" and " 4"
    are "4"), else one per stage. parse_args stores it so, and logs, checkpoints and records compare the
    setting, not how it was typed."""
    counts = stage_micro_batches(args, len(flag_list(args, "stage_batch_tokens")))
    return "auto" if counts[0] is None else micro_batches_flag(counts)


MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective that waits longer than a week is a hang, not a slow rank
MAX_MEMORY_GIB = 2 ** 20  # a pebibyte per rank: more is a typo (and 1e300 GiB would overflow a byte count)
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # one file name: no separators, no way out of logs_dir

# Upper bounds of the sizes, checked first (check_sizes): --num_layers=100000000 once built a hundred million layer
# plans, tens of GB, before a later check refused it. Each bound lies past what any GPU can hold (the largest hold
# 288 GB) or any run needs, so no real recipe is refused; the memory model refuses what fits below them and not the
# device.
MAX_LAYERS = 1024  # a module and a compiled block each; 8x the deepest trained transformers (Llama 3 405B: 126)
MAX_WIDTH = 2 ** 22  # --model_dim, --head_dim: one d x d matrix is then 2**44 weights, 32 TiB in bf16
MAX_MLP_RATIO = 64  # 16x the usual 4: the MLP's two matrices are then 128 d^2 weights a layer
# --vocab_size and the bigram tables: a bf16 weight, its gradient and Adam's two fp32 moments are 12 bytes, so a table
# of 2**25 rows at the speedrun's width 768 takes 288 GiB; and the loss's chunk of logits then takes 1 TiB in fp32.
MAX_TABLE_ROWS = 2 ** 25
# --bigram_vocab_size of record #92's n-gram table (--ngram_channels=2), sharded over the ranks: its row ids are int32
# (the record's, < 2**31); 2**30 rows at 768 wide are 1.6 TB in bf16 with their moments, past the GPU memory of a
# whole 8xH200 node (1.1 TB), 12.7x the record's table.
MAX_NGRAM_ROWS = 2 ** 30
# --val_seq_len, --stage_max_seq_len, --window_block, the windows (in blocks) and --dc_window: FlexAttention's block
# mask of a sequence holds (positions / window_block)^2 int32 entries, 64 GiB for 2**24 positions in blocks of 128.
MAX_POSITIONS = 2 ** 24
# A step's tokens over all ranks: past the largest published pretraining batches (about 60M tokens, DeepSeek-V3);
# also what --micro_batches=auto searches through (micro_batch_choices), counts up to batch / --window_block.
MAX_BATCH_TOKENS = 2 ** 26
MAX_VAL_TOKENS = 2 ** 34  # more than FineWeb10B holds (10B tokens); 32 GiB of uint16 read onto the host at start-up
MAX_STAGES = 64  # each stage is a shape torch.compile specialises on (the record has 3)


def size_bounds(args: Hyperparameters) -> list[tuple[str, tuple[int, ...], int]]:
    """(flag, its values, the most each may be) for every size the config gives, lists parsed (ConfigError if
    malformed) but nothing derived from them: check_sizes runs before anything is built."""
    return [
        ("num_layers", (args.num_layers,), MAX_LAYERS),
        ("model_dim", (args.model_dim,), MAX_WIDTH),
        ("head_dim", (args.head_dim,), MAX_WIDTH),
        ("mlp_ratio", (args.mlp_ratio,), MAX_MLP_RATIO),
        ("narrow_dim", (args.narrow_dim,), MAX_WIDTH),
        # 0 means a default for these: the bound is on what is given
        ("mlp_hidden", (args.mlp_hidden,) if args.mlp_hidden else (), MAX_WIDTH),
        ("rotary_dims", (args.rotary_dims,) if args.rotary_dims else (), MAX_WIDTH),
        ("head_mix_groups", (args.head_mix_groups,) if args.head_mix_groups else (), MAX_WIDTH),
        ("virtual_seq_cap", (args.virtual_seq_cap,) if args.virtual_seq_cap else (), MAX_POSITIONS),
        ("vocab_size", (args.vocab_size,), MAX_TABLE_ROWS),
        ("bigram_vocab_size", (args.bigram_vocab_size,), MAX_NGRAM_ROWS if args.ngram_channels == 2 else MAX_TABLE_ROWS),
        ("bigram_sign_rows", (args.bigram_sign_rows,), MAX_TABLE_ROWS),
        ("val_seq_len", (args.val_seq_len,), MAX_POSITIONS),
        ("window_block", (args.window_block,), MAX_POSITIONS),
        ("dc_window", (args.dc_window,), MAX_POSITIONS),
        ("final_val_window", (args.final_val_window,), MAX_POSITIONS),
        ("stage_windows", tuple(n for pair in flag_list(args, "stage_windows") for n in pair), MAX_POSITIONS),
        ("extension_windows", flag_list(args, "extension_windows"), MAX_POSITIONS),
        ("stage_max_seq_len", flag_list(args, "stage_max_seq_len"), MAX_POSITIONS),
        ("stage_batch_tokens", flag_list(args, "stage_batch_tokens"), MAX_BATCH_TOKENS),
        ("val_tokens", (args.val_tokens,), MAX_VAL_TOKENS),
    ]


def check_sizes(args: Hyperparameters):
    """Every size of the config from 1 to its bound (the MAX_ constants above), and at most MAX_STAGES stages; a
    ConfigError names the flag."""
    stages = len(flag_list(args, "stage_batch_tokens"))
    if stages > MAX_STAGES:
        raise ConfigError(f"--stage_batch_tokens: {stages:,} stages, at most {MAX_STAGES}")
    for name in ("mlp_hidden", "rotary_dims", "head_mix_groups", "virtual_seq_cap"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be zero (its default) or positive")
    for name, values, most in size_bounds(args):
        if min(values, default=1) <= 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be positive")
        if max(values, default=1) > most:
            raise ConfigError(f"--{name}={getattr(args, name)}: at most {most:,}, past what any GPU holds or any run "
                              f"needs")


def validate_config(args: Hyperparameters):
    positive = ["val_tokens", "val_seq_len", "vocab_size", "num_layers", "model_dim", "head_dim",
                "mlp_ratio", "window_block", "final_val_window", "num_iterations", "adam_every", "bigram_vocab_size",
                "bigram_sign_rows", "dc_window"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be positive")
    check_sizes(args)
    for name in ["val_loss_every", "train_loss_every", "save_every", "warmup_steps", "extension_steps",
                 "muon_momentum_warmup", "muon_momentum_cooldown", "anvil_beta_warmup", "anvil_beta_cooldown",
                 "anvil_engage_step", "untie_stage", "grown_steps", "grown_stage", "extension_batch_tokens"]:
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name}={getattr(args, name)}: must be zero or positive")
    # Values outside these ranges cannot be meant: they would train (and "succeed") on nonsense, or fail
    # deep inside PyTorch. Written so that NaN fails every test.
    ranges = [
        (("adam_lr", "muon_lr", "muon_weight_decay", "adam_weight_decay", "final_lr_frac", "anvil_lr",
          "anvil_weight_decay"), lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        (("muon_beta2", "muon_momentum_start", "muon_momentum_end", "anvil_beta2", "anvil_beta_start",
          "anvil_beta_end"), lambda v: 0 <= v < 1, "in [0, 1)"),
        (("adam_eps", "logit_cap", "logit_cap_width", "attn_scale", "narrow_attn_scale", "norm_eps"),
         lambda v: 0 < v < math.inf, "a finite number > 0"),
        (("logit_cap_shift",), lambda v: -math.inf < v < math.inf, "a finite number"),
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
    if args.model_dim % args.head_dim or (args.model_dim // args.head_dim) % 2:
        raise ConfigError(f"--model_dim={args.model_dim} must be an even number of --head_dim={args.head_dim} heads "
                          f"(paired layers pair them)")
    if args.head_dim % 4:
        raise ConfigError(f"--head_dim={args.head_dim} must be a multiple of 4 (rotary turns half of each head's "
                          f"dimensions, in pairs)")
    if args.model_dim < GATE_CHANNELS:
        raise ConfigError(f"--model_dim={args.model_dim}: the gates read the first {GATE_CHANNELS} channels")
    if args.extension_steps >= args.num_iterations:
        raise ConfigError(f"--extension_steps={args.extension_steps} must be less than "
                          f"--num_iterations={args.num_iterations}")
    stages = len(flag_list(args, "stage_batch_tokens"))
    if args.grown_stage >= stages:
        raise ConfigError(f"--grown_stage={args.grown_stage}: a stage, 0..{stages - 1}")
    if args.grown_steps >= args.num_iterations - args.extension_steps:
        raise ConfigError(f"--grown_steps={args.grown_steps} must be less than the scheduled steps "
                          f"({args.num_iterations - args.extension_steps})")
    schedule = Schedule(args)  # a run shorter than the stages skips some of them (tests, quick checks)
    for stage in schedule.stages:
        count = stage.micro_batches or 1  # auto chooses among the counts that split the batch
        if stage.batch_tokens % count or (stage.batch_tokens // count) % args.window_block:
            raise ConfigError(f"--stage_batch_tokens={args.stage_batch_tokens}: each batch must split into "
                              f"--micro_batches={args.micro_batches} micro-batches of a multiple of "
                              f"--window_block={args.window_block} tokens")
        if stage.max_seq_len <= 0:
            raise ConfigError(f"--stage_max_seq_len={args.stage_max_seq_len}: must be positive")
    vocab, counts = padded_vocab(args.vocab_size), {c for parts in schedule.candidate_parts for c in parts if c}
    if any(c % CANDIDATE_MULTIPLE for c in counts):
        raise ConfigError(f"--stage_softmax_candidates={args.stage_softmax_candidates}: each count must be a multiple "
                          f"of {CANDIDATE_MULTIPLE}")
    if counts and math.gcd(CANDIDATE_STRIDE, vocab) != 1:
        raise ConfigError(f"--vocab_size={args.vocab_size}: --stage_softmax_candidates sweeps the padded vocabulary "
                          f"({vocab}) in steps of {CANDIDATE_STRIDE}, which must not divide it")
    if args.val_seq_len % args.window_block:
        raise ConfigError(f"--val_seq_len={args.val_seq_len} must be a multiple of --window_block={args.window_block}")
    if args.val_tokens % args.val_seq_len:
        raise ConfigError(f"--val_tokens={args.val_tokens} must be a multiple of --val_seq_len={args.val_seq_len}")
    if not 0 <= args.memory_limit_gib <= MAX_MEMORY_GIB:
        raise ConfigError(f"--memory_limit_gib={args.memory_limit_gib}: must be a number of GiB from 0 (the device's "
                          f"memory) to {MAX_MEMORY_GIB:,}")
    if args.save_every % args.adam_every:
        raise ConfigError(f"--save_every={args.save_every} must be a multiple of --adam_every={args.adam_every}: "
                          f"a checkpoint between two Adam steps would lose the gradients accumulated so far")
    if args.embed_adam_period < 0 or args.embed_adam_period % args.adam_every:
        raise ConfigError(f"--embed_adam_period={args.embed_adam_period}: must be 0 (off) or a positive multiple of "
                          f"--adam_every={args.adam_every}")
    if args.embed_adam_period_start < 0:
        raise ConfigError(f"--embed_adam_period_start={args.embed_adam_period_start}: must be zero or positive")
    if args.save_every and args.embed_adam_period:  # a checkpoint after step N - 1 holds no pending gradient
        between = next((n for n in range(args.save_every, schedule.total, args.save_every)
                        if not schedule.embed_adam_steps(n - 1)), None)
        if between is not None:
            raise ConfigError(f"--save_every={args.save_every}: the checkpoint at step {between} falls between two of "
                              f"the embeddings' Adam steps (every {args.embed_adam_period} from step "
                              f"{args.embed_adam_period_start}) and would lose their gradients accumulated so far; "
                              f"a multiple of {args.embed_adam_period} is always safe")
    if args.ngram_channels not in (1, 2):
        raise ConfigError(f"--ngram_channels={args.ngram_channels}: choose 1 (record #85's bigram table) or 2 "
                          f"(record #92's bigram and trigram table)")
    if args.ngram_channels == 2:
        if args.bigram_vocab_size % 2 or args.bigram_vocab_size < NGRAM_MIN_ROWS:
            raise ConfigError(f"--bigram_vocab_size={args.bigram_vocab_size}: with --ngram_channels=2 an even number "
                              f"of at least {NGRAM_MIN_ROWS} (the bigram channel takes the first half, the trigram "
                              f"channel the second, each with one row kept for a sequence's first tokens)")
        if args.bigram_sign_rows & (args.bigram_sign_rows - 1):
            raise ConfigError(f"--bigram_sign_rows={args.bigram_sign_rows}: with --ngram_channels=2 a power of two "
                              f"(record #92's sign rows are the hash masked to its low bits)")
    for name, choices in (("device", ("auto", "cuda", "cpu")), ("attention", ("auto", "flex", "sdpa")),
                          ("packing", ("auto", *SHARD_PACKINGS)),
                          ("lm_head_precision", ("auto", "fp8", "bf16", "fp32")),
                          ("mlp_precision", ("auto", "fp8", "bf16", "fp32")),
                          ("matrix_optimizer", tuple(MATRIX_OPTIMIZERS))):
        if getattr(args, name) not in choices:
            raise ConfigError(f"--{name}={getattr(args, name)}: choose {', '.join(choices)}")
    validate_layer_plan(args)
    if "fp8" in (args.lm_head_precision, args.mlp_precision) and not fp8_fits(args):
        raise ConfigError(f"--lm_head_precision/--mlp_precision=fp8: FP8 matmuls need --model_dim (here "
                          f"{args.model_dim}) and every micro-batch (here {min_micro_tokens(args)} tokens at the "
                          f"least; with --micro_batches=auto, --window_block) to be multiples of 16; use bf16")


LAYER_LISTS = ("no_attention_layers", "removed_layers", "paired_layers", "long_window_layers", "xsa_layers",
               "attn_gate_layers", "dc_layers", "value_embed_layers", "narrow_qk_layers", "narrow_value_layers",
               "parallel_mlp_layers", "no_x0_layers", "no_bigram_layers")


def validate_layer_plan(args: Hyperparameters):
    """Layer roles that the record's forward cannot combine are refused here, naming the flag."""
    n = args.num_layers
    for name in LAYER_LISTS:
        for layer in flag_list(args, name):
            if not 0 <= layer < n:
                raise ConfigError(f"--{name}: layer {layer} is not in 0..{n - 1}")
    for role, layer in retired_gates(args):
        if not 0 <= layer < n:
            raise ConfigError(f"--retired_gates: layer {layer} is not in 0..{n - 1}")
    skip_from, skip_to = skip_pair(args)
    if not 0 <= skip_from < skip_to < n:
        raise ConfigError(f"--skip_layers={args.skip_layers}: needs 0 <= source < target < {n}")
    if skip_to not in flag_list(args, "no_attention_layers"):
        raise ConfigError(f"--no_attention_layers={args.no_attention_layers}: must hold the skip target ({skip_to}, "
                          f"--skip_layers): the skip takes the place of its attention")
    if not 1 <= args.mudd_gate_layer <= skip_to:
        raise ConfigError(f"--mudd_gate_layer={args.mudd_gate_layer}: must be in 1..{skip_to} (the first gate "
                          f"network serves the layers before it, the second the skip)")
    if not 0 <= args.shared_input_layer < n - 1:
        raise ConfigError(f"--shared_input_layer={args.shared_input_layer}: must be in 0..{n - 2}")
    narrow_qk = bool(flag_list(args, "narrow_qk_layers"))
    narrow = narrow_qk or bool(flag_list(args, "narrow_value_layers"))
    if narrow and (args.narrow_dim > args.head_dim or args.narrow_dim % 2):
        raise ConfigError(f"--narrow_dim={args.narrow_dim}: must be even and at most --head_dim={args.head_dim}")
    turned = rotary_dims(args)
    if turned % 2 or turned > args.head_dim or (narrow_qk and turned > args.narrow_dim):
        raise ConfigError(f"--rotary_dims={args.rotary_dims}: must be even and at most --head_dim={args.head_dim}"
                          + (f" and --narrow_dim={args.narrow_dim} (narrow heads turn too)" if narrow_qk else ""))
    if args.head_mix_groups and args.model_dim % args.head_mix_groups:
        raise ConfigError(f"--head_mix_groups={args.head_mix_groups}: must divide --model_dim={args.model_dim}")
    head_mix_states(args)
    plans = layer_plan(args)
    for plan in plans:
        check_plan(plan, args)
    last = plans[-1]
    if not last.attention or last.paired or last.value_embed is None:
        raise ConfigError(f"layer {n - 1} (the last, where MUDD mixes) needs attention, no pairing and a value "
                          f"embedding (--value_embed_layers)")
    if not plans[skip_from].attention and skip_from != 0:
        raise ConfigError(f"--skip_layers={args.skip_layers}: the source must be a layer with attention")
    if flag_list(args, "dc_layers") and args.dc_window > args.window_block:  # a DC block sees itself and the one before
        raise ConfigError(f"--dc_window={args.dc_window}: at most --window_block={args.window_block}")
    if args.untie_stage > len(flag_list(args, "stage_batch_tokens")) + 1:
        raise ConfigError(f"--untie_stage={args.untie_stage}: at most the number of stages + 1 (never)")


def check_plan(plan: LayerPlan, args: Hyperparameters):
    """One layer's roles, each of which needs another (validate_layer_plan)."""
    where = f"layer {plan.index}"
    if not plan.attention and (plan.paired or plan.long_window or plan.xsa or plan.attn_gate or plan.dc
                               or plan.value_embed is not None or plan.narrow_qk or plan.narrow_value):
        raise ConfigError(f"{where} has no attention (--no_attention_layers, --removed_layers) but another "
                          f"attention role")
    if plan.removed and (plan.skip_target or plan.mudd or plan.parallel_mlp):
        raise ConfigError(f"{where} is removed (--removed_layers): it cannot be the skip target, the last layer "
                          f"or have a parallel MLP")
    if plan.paired and (plan.long_window or plan.xsa or plan.dc):
        raise ConfigError(f"{where} is paired (--paired_layers): paired layers have the short window and no "
                          f"XSA or DC")
    if plan.dc and plan.index < args.mudd_gate_layer:
        raise ConfigError(f"{where}: DC layers must be at or after --mudd_gate_layer={args.mudd_gate_layer}")
    if plan.narrow_qk and plan.long_window:
        raise ConfigError(f"{where}: narrow queries and keys (--narrow_qk_layers) turn with the rotary fitted to "
                          f"the short window; the layer has the long one (--long_window_layers)")
    for role in plan.retired:
        active = {"xsa": plan.xsa, "attn": plan.attn_gate, "dc": plan.dc, "ve": plan.value_embed is not None}[role]
        if active or (role == "dc" and plan.index < args.mudd_gate_layer):
            raise ConfigError(f"--retired_gates={args.retired_gates}: {role}:{plan.index} is "
                              + ("the layer's live role" if active else
                                 f"before --mudd_gate_layer={args.mudd_gate_layer}, where no DC gate is"))


def min_micro_tokens(args: Hyperparameters) -> int | None:
    """The smallest micro-batch of the stages; None before --micro_batches=auto has chosen."""
    stages = Schedule(args).stages
    return None if stages[0].micro_batches is None else min(stage.micro_tokens for stage in stages)


def fp8_fits(args: Hyperparameters) -> bool:
    """torch._scaled_mm takes only multiples of 16 for the dimensions the FP8 matmuls multiply over (the MLP's
    hidden width among them, in its FP8 backward). Every micro-batch auto may choose is a multiple of
    --window_block."""
    smallest = min_micro_tokens(args)
    return (args.model_dim % 16 == 0 and mlp_width(args) % 16 == 0
            and (args.window_block if smallest is None else smallest) % 16 == 0)


def check_world_size(args: Hyperparameters, world_size: int) -> tuple[int | None, ...]:
    """Micro-batches per rank per step in each stage (None each for auto, which chooses multiples of the
    world size); the global batch never changes with the world size."""
    counts = [stage.micro_batches for stage in Schedule(args).stages[:-1]]
    if any(count is not None and count % world_size for count in counts):
        raise ConfigError(f"world size {world_size} cannot split the batch: a step is --micro_batches="
                          f"{args.micro_batches} micro-batches, not a multiple of {world_size} (a larger --micro_batches "
                          f"makes more, each smaller)")
    if (args.val_tokens // args.val_seq_len) % world_size:
        raise ConfigError(f"world size {world_size} cannot split validation: --val_tokens={args.val_tokens} is "
                          f"{args.val_tokens // args.val_seq_len} sequences of --val_seq_len={args.val_seq_len}")
    if args.ngram_channels == 2 and args.bigram_vocab_size % world_size:
        raise ConfigError(f"world size {world_size} cannot shard the n-gram table: --bigram_vocab_size="
                          f"{args.bigram_vocab_size} rows must split evenly over the ranks (a multiple of 8 suits 1, "
                          f"2, 4 and 8)")
    return tuple(None if count is None else count // world_size for count in counts)


def resolve_attention(args: Hyperparameters, device: torch.device, training: bool = True) -> str:
    """flex or sdpa. PyTorch has no FlexAttention backward on CPU, so CPU training takes sdpa."""
    choice = args.attention if args.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    if choice == "flex" and device.type != "cuda" and training:
        raise ConfigError("--attention=flex: PyTorch has no FlexAttention backward on CPU; train on CPU with "
                          "--attention=sdpa (flex serves forward passes there)")
    if choice == "sdpa" and training:
        # paired layers attend over twice the positions; before --micro_batches=auto has chosen, the
        # validation's (plan_memory counts the micro-batches' masks, and this check runs again after it)
        longest = 2 * (max_positions(args) if min_micro_tokens(args) is not None else args.val_seq_len)
        need, have = dense_mask_bytes(longest), device_memory_bytes(device)
        if need > have:  # certain to run out of memory, at the first step or the first validation
            raise ConfigError(f"--attention=sdpa: the dense attention mask of a {longest:,}-position sequence takes "
                              f"at least {need / 2 ** 30:,.0f} GiB to build, more than the {have / 2 ** 30:,.0f} GiB "
                              f"{device if device.type == 'cuda' else 'this machine'} has; use --attention=flex on a "
                              f"GPU, or a shorter --val_seq_len or --stage_batch_tokens")
    return choice


def dense_mask_bytes(sequence: int) -> int:
    """A lower bound of what dense_attention_mask holds at once: int64 distances and the boolean mask."""
    return sequence * sequence * (8 + 1)


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_precision(args: Hyperparameters, device: torch.device, flag: str) -> str:
    """fp8 needs the FP8 tensor cores of compute capability 8.9 (Ada, Hopper) and later, and widths
    FP8 matmuls take (fp8_fits); auto falls back to bf16 without them, and the log header says so."""
    fp8_capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    choice = getattr(args, flag)
    if choice == "auto":
        return "fp8" if fp8_capable and fp8_fits(args) else PRECISION_NAMES[compute_dtype(device)]
    if choice == "fp8" and device.type == "cuda" and not fp8_capable:
        raise ConfigError(f"--{flag}=fp8: {torch.cuda.get_device_name(device)} has no FP8 tensor cores "
                          f"(compute capability 8.9 or later); use bf16")
    return choice


def resolve_numerics(args: Hyperparameters, device: torch.device) -> Numerics:
    """The run's precisions on this device (Numerics), from --lm_head_precision and --mlp_precision."""
    return Numerics(compute_dtype(device), resolve_precision(args, device, "lm_head_precision"),
                    resolve_precision(args, device, "mlp_precision"))


# -----------------------------------------------------------------------------
# Distributed setup: torchrun's environment, or one process without it

@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    memory: MemoryPlan | None = None  # plan_memory's, where the memory was checked
    numerics: Numerics | None = None  # resolve_numerics' for this device (None: tools and tests that build their own)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_ranks() -> tuple[int, int, int]:
    """RANK, LOCAL_RANK and WORLD_SIZE as torchrun sets them (0, 0 and 1 without it), checked: a bad
    value set by hand would otherwise divide by zero, train as rank 1 of 1 in silence, or hang."""
    values = []
    for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        text = os.environ.get(name, default)
        try:
            values.append(int(text))
        except ValueError:
            raise ConfigError(f"{name}={text!r} in the environment is not an integer (torchrun sets it; "
                              f"unset it for one process)") from None
    rank, local_rank, world_size = values
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE={world_size} in the environment: a world size is at least 1")
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if not 0 <= value < world_size:
            raise ConfigError(f"{name}={value} in the environment is outside 0..{world_size - 1} "
                              f"(WORLD_SIZE={world_size})")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if world_size > 1 and missing and not dist.is_initialized():  # (tools/preflight.py brings its own group)
        raise ConfigError(f"WORLD_SIZE={world_size} in the environment, but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: start the ranks with torchrun "
                          f"(torchrun --standalone --nproc_per_node={world_size} train_gpt.py), which sets them")
    if world_size > 1 and not dist.is_initialized():  # the rendezvous's port: torch's ValueError was a traceback
        port = os.environ["MASTER_PORT"]
        if not (port.isdecimal() and 1 <= int(port) <= 65535):
            raise ConfigError(f"MASTER_PORT={port!r} in the environment is not a port (an integer from 1 to 65535; "
                              f"torchrun sets it)")
    return rank, local_rank, world_size


def setup_distributed(args: Hyperparameters) -> tuple[DistEnv, Hyperparameters]:
    """This rank's device and process group, and the config the run trains by: args with its open choices
    settled (--micro_batches=auto's counts, chosen from this device's memory), a copy; args is not changed."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA device is available")
    rank, local_rank, world_size = launch_ranks()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # Refuse what this device cannot train, and choose --micro_batches=auto, before any process group exists
    # (every rank decides the same).
    check_world_size(args, world_size)
    attention_kind = resolve_attention(args, device)
    numerics = resolve_numerics(args, device)
    memory_plan = plan_memory(args, world_size, device, numerics, attention_kind)
    if world_size > 1 and not dist.is_initialized():  # tools/preflight.py brings its own (fake) group
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=args.pg_timeout_s),
                                device_id=device if use_cuda else None)
    env = DistEnv(rank, local_rank, world_size, device, memory_plan, numerics)
    # --device and --attention settled as --micro_batches=auto is: the run logs, checkpoints and compares what it
    # trains with, so that spelling out what auto chose (--attention=sdpa on a CPU) is the same setting.
    config = memory_plan.config if memory_plan else args
    return env, dataclasses.replace(config, device=device.type, attention=attention_kind)


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok: lets all ranks stop together instead of hanging."""
    if not distributed():
        return ok
    flag = torch.full((1,), int(ok), dtype=torch.int32, device=device)  # a factory: fake tensors (preflight) too
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def same_on_every_rank(text: str, device: torch.device) -> bool:
    """True if every rank passes the same text (compared by CRC-32, in one all-reduce)."""
    if not distributed():
        return True
    code = zlib.crc32(text.encode())
    codes = torch.tensor([code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX)  # (the largest, minus the smallest)
    return codes.tolist() == [code, -code]


def gather_from_ranks(obj) -> list:
    """obj from every rank, in rank order (a list of one without a process group)."""
    if not distributed():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# -----------------------------------------------------------------------------
# Files: one reader and one writer for every file the trainer, sample.py and tools/ open or write

# The reader (open_regular, read_regular, read_json) opens without blocking and checks with fstat what it opened: a
# regular file, its size bounded before it is read. A FIFO once blocked a resume forever, a model.pt linked to
# /dev/zero was read until memory ran out. The writer (write_file) writes only where output_problem finds nothing
# or a regular file, through a temporary unique to the call (mkstemp), and names the output asked for when it fails.
# data/safe_write.py is their stdlib-only twin for the scripts that do without torch (records.py, data/, the cost
# model); tests/test_readers_io.py runs the same properties against both.

class FileRefused(DataError):
    """A path that is not what a reader or writer takes: one line, `PATH: why` (why alone in .why, for a caller that
    names the file its own way)."""

    def __init__(self, path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    kinds = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
             stat.S_IFBLK: "a device", stat.S_IFLNK: "a symbolic link"}
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path, what: str = "a regular file", limit: int | None = None) -> io.BufferedReader:
    """path opened for reading (binary), refused (FileRefused) unless it is a regular file of at most `limit` bytes;
    a link is followed. stat first, so that a device is never opened (opening one can act: a tape rewinds); then an
    open that does not wait (a FIFO swapped in meanwhile opens at once) and fstat, so that what is read is what
    was checked."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(path, f"{file_kind(mode)}, not {what}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise FileRefused(path, f"cannot read ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"{file_kind(st.st_mode)}, not {what}")
        if limit is not None and st.st_size > limit:
            raise FileRefused(path, f"{st.st_size:,} bytes, more than {what} holds (at most {limit:,})")
        os.set_blocking(fd, True)
    except BaseException:
        f.close()
        raise
    return f


def read_regular(path, what: str = "a regular file", limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular), read through the one checked open; a
    file that grew past the limit since its size was read is refused too."""
    with open_regular(path, what, limit) as f:
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise FileRefused(path, f"cannot read ({e.strerror or e})") from None
    if limit is not None and len(data) > limit:
        raise FileRefused(path, f"more than {what} holds (at most {limit:,} bytes)")
    return data


def read_json(path, what: str = "a JSON file", limit: int | None = None):
    """The JSON value a regular file of at most `limit` bytes holds (read_regular); FileRefused says why it is not
    one: not UTF-8, not JSON, or nested too deeply for the parser (its RecursionError was a traceback)."""
    data = read_regular(path, what, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise FileRefused(path, "not UTF-8 text") from None
    except RecursionError:
        raise FileRefused(path, "nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and ints of thousands of digits
        raise FileRefused(path, first_line(e)) from None


def output_problem(path) -> str | None:
    """Why path cannot be an output, or None: an output is absent or a regular file. A FIFO, a device, a socket or
    a folder there would be replaced by the rename (as root, `-o /dev/null` replaced the system's device); a
    symbolic link would be replaced by a file too, the file it names left as it was, so a link is refused
    whatever it names (name the file itself)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a component that is not a folder: the write fails with the same words
        return f"cannot write there ({e.strerror or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        return f"a symbolic link (to {visible(target[:200])}{'...' if len(target) > 200 else ''}), not a regular " \
               f"file: refused, nothing written (name the file itself, or a new one)"
    return f"{file_kind(st.st_mode)}, not a regular file: refused, nothing written (name a new file)"


def check_output(path, shown=None) -> None:
    """FileRefused naming `shown` (or path) unless path can be an output (output_problem)."""
    problem = output_problem(path)
    if problem is not None:
        raise FileRefused(shown or path, problem)


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


# A file name may have 255 bytes, and a temporary adds to its name: NAME is kept whole in a temporary's name only up
# to this many bytes (mkstemp and mkdtemp add their random part). Cut by characters, a legal 251-byte name of 4-byte
# characters once got a 265-byte temporary ("File name too long"); bytes are what the file system counts.
TEMPORARY_NAME_BYTES = 100


def cut_to_bytes(name: str, limit: int) -> str:
    """name's longest start that takes at most limit bytes as the file system stores it (UTF-8; bytes that are not
    UTF-8 stay as they are, os.fsencode's way), never ending in part of a character."""
    raw = os.fsencode(name)
    if len(raw) <= limit:
        return name
    cut = limit
    while cut > max(limit - 3, 0) and raw[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: inside a character
        cut -= 1
    return os.fsdecode(raw[:cut])


def temporary_prefix(name: str) -> str:
    """`.NAME.`, how a hidden temporary beside the file or folder NAME starts (mkstemp and mkdtemp add a random part
    unique to the call), NAME cut to TEMPORARY_NAME_BYTES bytes."""
    return f".{cut_to_bytes(name, TEMPORARY_NAME_BYTES)}."


def write_file(path: Path, content, shown: Path | None = None) -> dict:
    """Writes a file atomically: into a temporary file beside it (mkstemp: unique to the call), fsynced, then
    renamed over `path`, so that no reader ever sees part of one and a failure (a full disk, an error, a signal)
    leaves no temporary behind. A path that cannot be an output (output_problem: a FIFO, a device, a link) is
    refused first (FileRefused), before anything is made. Bytes as they are, anything else with torch.save.
    Returns its size and sha256 (for meta.json); a failed write raises a TrainingError that names the file and the
    cause: `shown`, the name the user knows it by, for a file written into a folder renamed whole later (a
    checkpoint's), never a temporary. Every file the trainer, sample.py and tools/ write goes through here (the
    log, written line by line, excepted)."""
    path = Path(path)
    check_output(path, shown)
    writer, tmp = None, None
    try:
        with terminate_as_exception():
            fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path.name), suffix=".tmp", dir=path.parent)
            try:
                os.fchmod(fd, 0o644)  # mkstemp makes it private; what the trainer writes is ordinary data
                writer = _RecordingWriter(fd)
                if isinstance(content, bytes):
                    writer.write(content)
                else:
                    torch.save(content, writer)
                os.fsync(fd)
            finally:
                os.close(fd)
            check_output(path, shown)  # again, just before the rename: made since the first check
            os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        cause = writer.error if writer is not None and writer.error is not None else e
        if isinstance(cause, OSError):
            raise write_error(shown or path, cause) from None
        stop = e
        while stop is not None and not isinstance(stop, (SystemExit, KeyboardInterrupt)):
            stop = stop.__context__  # torch.save's zip writer reports an exit raised inside it as a RuntimeError
        raise stop or e
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


@contextlib.contextmanager
def terminate_as_exception():
    """SIGTERM raised as SystemExit(143) for the duration, where nothing else handles it (a tool, not the
    trainer, whose main() turns signals into exceptions itself): its default would end the process on the
    spot, before a write could remove its temporary file."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -----------------------------------------------------------------------------
# Data: token shards, BOS-aligned packing and the distributed loader

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
SHARD_PACKING_INDEX, SHARD_PACKINGS = 3, {"documents": 0, "stream": 1}  # header[3]; data/shards.py writes it
FETCH_HINT = "fetch FineWeb with `python data/cached_fineweb10B.py`"
REPO_DIR = Path(__file__).resolve().parent  # where the bundled corpus and the data tools are
BUNDLED_CORPUS = REPO_DIR / "data" / "shakespeare"


# One reader for token shards, used at every open: the start-up scan, the loader's (and its prefetch's) open of
# each shard, and the validation tokens. A shard replaced during a run was once read unchecked by the loader: ids past
# the vocabulary ended in a 40-line IndexError, valid ids in training on data no scan had seen. The checks cost a
# header, an fstat and a vectorised max over the tokens read, on the host before they reach the device (the
# loader's next shard is read in its prefetch thread): nothing is added to a training step.

class ShardHeader(NamedTuple):
    num_tokens: int  # the token count, which the file's size matches
    packing: int  # header[SHARD_PACKING_INDEX], as stored (shard_packing names it)


def open_shard(path) -> tuple[io.BufferedReader, ShardHeader]:
    """A shard opened for reading and its checked header. Only a regular file is opened (open_regular): a FIFO
    matched by a glob once blocked the run forever before its log. The header must be ours and agree with the
    file's size, which bounds what is read (the count is an int32)."""
    path = Path(path)
    f = open_regular(path, "a token shard (a shard is a regular file)")
    try:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(SHARD_HEADER_BYTES)
        if len(raw) < SHARD_HEADER_BYTES:
            raise DataError(f"{path}: {'empty' if size == 0 else 'truncated'} shard ({size} bytes, "
                            f"the header alone is {SHARD_HEADER_BYTES})")
        header = np.frombuffer(raw, dtype="<i4")
        if header[0] != SHARD_MAGIC:
            raise DataError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
        if header[1] != SHARD_VERSION:
            raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
        num_tokens = int(header[2])
        expected = SHARD_HEADER_BYTES + 2 * num_tokens
        if num_tokens < 0 or size != expected:
            raise DataError(f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file has "
                            f"{size} bytes{' (truncated?)' if size < expected else ''}")
    except OSError as e:
        f.close()
        raise DataError(f"{path}: cannot read shard ({e.strerror})") from None
    except BaseException:
        f.close()
        raise
    return f, ShardHeader(num_tokens, int(header[SHARD_PACKING_INDEX]))


def read_shard_header(path) -> int:
    """Checks a shard's header against its size; returns its token count."""
    f, header = open_shard(path)
    f.close()
    return header.num_tokens


def shard_packing(path) -> str:
    """The packing a shard's header asks for (data/shards.py's PACKINGS: FineWeb's shards say documents)."""
    f, header = open_shard(path)
    f.close()
    names = {v: k for k, v in SHARD_PACKINGS.items()}
    if header.packing not in names:
        raise DataError(f"{path}: unknown packing {header.packing} in its header (known: "
                        f"{', '.join(f'{v} {k}' for k, v in SHARD_PACKINGS.items())}); pass --packing")
    return names[header.packing]


def read_shard(path, vocab_size: int | None = None) -> np.ndarray:
    """All tokens of a shard as uint16, read from the one open whose header was checked (open_shard); with
    vocab_size, every id must be below it (check_token_ids)."""
    f, header = open_shard(path)
    with f:
        stored = np.empty(header.num_tokens, dtype="<u2")
        try:
            got = f.readinto(memoryview(stored).cast("B"))
        except OSError as e:
            raise DataError(f"{path}: cannot read shard ({e.strerror})") from None
    if got != stored.nbytes:  # shortened since its size was read
        raise DataError(f"{path}: truncated while it was read ({SHARD_HEADER_BYTES + got} of "
                        f"{SHARD_HEADER_BYTES + stored.nbytes} bytes)")
    tokens = stored.astype(np.uint16, copy=False)
    if vocab_size is not None:
        check_token_ids(tokens, path, vocab_size)
    return tokens


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
    first max_len tokens, the stage's max_seq_len; the rest of a longer document is not trained on
    (record #85). `starts`, the BOS positions, can be passed in when a scan has found them already."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray | None = None):
        self.tokens = tokens
        self.starts = np.flatnonzero(tokens == BOS_ID) if starts is None else starts
        self.doc_lengths = np.append(self.starts[1:], len(tokens)) - self.starts
        self._cumulative: dict[int, np.ndarray] = {}

    def cumulative(self, max_len: int) -> np.ndarray:
        if max_len not in self._cumulative:
            self._cumulative[max_len] = np.cumsum(np.minimum(self.doc_lengths, max_len))
        return self._cumulative[max_len]

    def _last_piece(self, first: int, num_tokens: int, max_len: int) -> int | None:
        """The piece in which num_tokens tokens, counted from the start of piece `first`, end; None
        when the stream has too few pieces left."""
        cumulative = self.cumulative(max_len)
        before = int(cumulative[first - 1]) if first else 0
        last = int(np.searchsorted(cumulative, before + num_tokens))
        return last if last < len(cumulative) else None

    def take(self, first: int, num_tokens: int, max_len: int) -> tuple[np.ndarray, int] | None:
        """Exactly num_tokens tokens: pieces first, first + 1, ..., the last one cut short, and the
        index of the piece after them; None when the stream has too few pieces left."""
        last = self._last_piece(first, num_tokens, max_len)
        if last is None:
            return None
        cumulative = self.cumulative(max_len)
        before = int(cumulative[first - 1]) if first else 0
        lengths = np.minimum(self.doc_lengths[first:last + 1], max_len)
        lengths[-1] -= int(cumulative[last]) - before - num_tokens
        chunk = np.concatenate([self.tokens[s:s + n] for s, n in zip(self.starts[first:last + 1], lengths)])
        return chunk, last + 1

    def take_step(self, first: int, num_micro: int, micro_tokens: int, max_len: int
                  ) -> tuple[list[np.ndarray], int] | None:
        """One step: num_micro micro-batches of micro_tokens + 1 tokens (inputs and shifted targets),
        each starting with a BOS; the same whatever the world size."""
        micro_batches = []
        for _ in range(num_micro):
            taken = self.take(first, micro_tokens + 1, max_len)
            if taken is None:
                return None
            chunk, first = taken
            micro_batches.append(chunk)
        return micro_batches, first

    def count_steps(self, first_step: int, schedule: Schedule) -> int:
        """How many steps take_step gives from the first piece, the first being step first_step of the
        schedule (each step's micro-batch size and max_seq_len are its stage's; steps past the end of the
        run, the extension's): the same walk over the pieces, without copying tokens."""
        steps, first = 0, 0
        while True:
            step = first_step + steps
            for _ in range(schedule.micro_batches(step)):
                last = self._last_piece(first, schedule.micro_tokens(step) + 1, schedule.stage(step).max_seq_len)
                if last is None:
                    return steps
                first = last + 1
            steps += 1


class TokenStream:
    """The `stream` packing, for text that is not FineWeb (data/tokenize_text.py's shards): a step's
    micro-batches are the next consecutive runs of micro_tokens + 1 tokens, wherever documents begin, and
    no document is cut at max_seq_len. Documents stay apart in attention by their BOS, as everywhere;
    every token is trained on. Positions are token offsets where DocumentPieces's are piece indices."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def take_step(self, first: int, num_micro: int, micro_tokens: int, max_len: int
                  ) -> tuple[list[np.ndarray], int] | None:
        end = first + num_micro * (micro_tokens + 1)
        if end > len(self.tokens):
            return None
        return [self.tokens[i:i + micro_tokens + 1] for i in range(first, end, micro_tokens + 1)], end

    def count_steps(self, first_step: int, schedule: Schedule) -> int:
        steps, left = 0, len(self.tokens)
        while (need := step_tokens(first_step + steps, schedule)) <= left:
            left -= need
            steps += 1
        return steps


def packed(packing: str, tokens: np.ndarray, starts: np.ndarray) -> DocumentPieces | TokenStream:
    return TokenStream(tokens) if packing == "stream" else DocumentPieces(tokens, starts)


class Batch(list):
    """This rank's micro-batches of a step, (inputs, targets) each, and what the host finds in each: the table rows
    it reads, record #85's bigram table's (for DistAdam's sparse exchange of its gradient; None at world size 1) or
    record #92's n-gram table's (the rows the step pulls, NgramAdam.begin_step), and its candidate set (record
    #92's sampled softmax: Candidates on the device, or None where the step uses the whole vocabulary)."""

    def __init__(self, micro_batches, bigram_rows, ngram_rows=None, candidates=None):
        super().__init__(micro_batches)
        self.bigram_rows, self.ngram_rows = bigram_rows, ngram_rows
        self.candidates = candidates or [None] * len(micro_batches)


def host_bigram_rows(chunk: np.ndarray, buckets: int) -> np.ndarray:
    """The bigram rows a micro-batch's inputs (chunk[:-1]) read, as GPT.stem hashes them."""
    ids = torch.from_numpy(chunk[:-1].astype(np.int64))
    return np.unique(bigram_hash(ids, torch.cat([ids[:1], ids[:-1]]), torch.arange(len(ids)), buckets).numpy())


# Record #92's negatives: a sweep through the vocabulary in steps of this prime (so that, coprime with the padded
# vocabulary V, which validate_config checks, the sweep k * stride mod V visits every class once in V draws),
# drawn in windows of floor(1.7 * need) + 256 classes, for `need` of them that are not targets: wide enough that
# the targets in a window rarely leave too few.
CANDIDATE_STRIDE = 20011
CANDIDATE_WINDOW = (1.7, 256)
CANDIDATE_MULTIPLE = 16  # candidate counts are widths of the FP8 head's matmuls, which torch._scaled_mm takes in 16s


def candidate_set(targets: np.ndarray, count: int, sweep: np.ndarray, offset: int,
                  prefix_targets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Record #92's candidate set C of one micro-batch, from the host's copy of its targets (T,), for P = count:
    C holds its U distinct targets and P - U negatives, the classes of the window w = sweep[offset : offset + d],
    d = min(V, floor(1.7 (P - U)) + 256), that are not targets, in the sweep's order; where w holds fewer than
    P - U of them, every class that is not a target at an even step instead: free[::max(1, |free| // (P - U))]
    (free ascending), the first P - U. C is ascending. Prefix targets are not put in C: a row whose prefix target
    C lacks drops that term. (sweep: k * CANDIDATE_STRIDE mod V for k < V, twice, so a window is one slice.)

    Returns C (P,), each target's position in C (T,), each prefix target's (T,; -1 where it is -1 or not in C),
    and the stream's next offset, (offset + d) mod V (the offset stays where U = P). Raises TrainingError where
    U > P."""
    vocab = len(sweep) // 2
    taken = np.zeros(vocab + 1, dtype=bool)  # (entry V stays False: the position map's -1 for a prefix of -1)
    taken[targets] = True
    distinct = int(np.count_nonzero(taken))
    if distinct > count:
        raise TrainingError(f"{distinct} distinct targets, more than the {count} candidates")
    need = count - distinct
    if need:
        drawn = min(vocab, int(need * CANDIDATE_WINDOW[0]) + CANDIDATE_WINDOW[1])
        window = sweep[offset:offset + drawn]
        offset = (offset + drawn) % vocab
        negatives = window[~taken[window]]
        if negatives.size < need:
            free = np.flatnonzero(~taken[:vocab])
            negatives = free[::max(1, free.size // need)]
        taken[negatives[:need]] = True
    columns = np.flatnonzero(taken[:vocab])
    position = np.full(vocab + 1, -1, dtype=np.int64)  # position[-1] = position[V] = -1
    position[columns] = np.arange(count)
    return columns, position[targets], None if prefix_targets is None else position[prefix_targets], offset


class CandidateSampler:
    """The host's half of record #92's sampled softmax: each micro-batch's candidate set (candidate_set) on the
    steps that sample (Schedule.candidates), each micro-batch with a stream of negatives of its own. Micro-batch
    g of a step (0..M-1 over all ranks, M the most micro-batches a step has) draws from stream g, which starts at
    offset floor(V g / M) of the sweep and moves on with every set it gives. At 8 GPUs with 8 micro-batches these
    are the record's streams (rank r starts at floor(V r / 8)); at any world size the sets are the same, since
    micro-batch g holds the same tokens wherever it runs. Only the rank that trains micro-batch g (rank g mod
    world_size) moves stream g: the offsets are run state, which the loader's state holds and a checkpoint
    takes from every rank (loader_state_of_ranks)."""

    def __init__(self, schedule: Schedule, vocab: int, prefix_table: np.ndarray | None):
        self.schedule, self.prefix_table = schedule, prefix_table
        self.sweep = np.tile(CANDIDATE_STRIDE * np.arange(vocab, dtype=np.int64) % vocab, 2)
        streams = max(stage.batch_tokens // stage.micro_tokens for stage in schedule.stages)
        self.offsets = [vocab * g // streams for g in range(streams)]

    def micro_batch(self, step: int, g: int, targets: np.ndarray) -> Candidates | None:
        """Micro-batch g's candidate set at `step` (numpy arrays), or None where the step uses the whole
        vocabulary; stream g moves on."""
        count = self.schedule.candidates(step)
        if not count:
            return None
        prefix = self.prefix_table[targets] if self.schedule.prefix_weight(step) is not None else None
        try:
            *found, self.offsets[g] = candidate_set(targets, count, self.sweep, self.offsets[g], prefix)
        except TrainingError as e:
            raise TrainingError(f"step {step}, micro-batch {g}: {e}; give the stage more "
                                f"(--stage_softmax_candidates)") from None
        return Candidates(*found)

    def for_step(self, step: int) -> Callable:
        """micro_batch at `step`: what rank_micro_batches asks for each micro-batch's set."""
        return functools.partial(self.micro_batch, step)

    def offsets_problem(self, offsets) -> str | None:
        """What is wrong with offsets read from a checkpoint, or None: one int in [0, V) per stream."""
        if not (isinstance(offsets, list) and len(offsets) == len(self.offsets)
                and all(type(o) is int and 0 <= o < len(self.sweep) // 2 for o in offsets)):
            return (f"its candidate streams' offsets are {brief(offsets)}, not {len(self.offsets)} positions in a "
                    f"vocabulary of {len(self.sweep) // 2}")
        return None


def candidate_sampler(args: Hyperparameters, schedule: Schedule) -> CandidateSampler | None:
    """The loaders' CandidateSampler, where a stage samples (--stage_softmax_candidates)."""
    if not schedule.sampled:
        return None
    vocab = padded_vocab(args.vocab_size)
    return CandidateSampler(schedule, vocab, np.array(prefix_token_ids(vocab)) if schedule.prefix_term else None)


def with_candidate_offsets(state: dict, sampler: CandidateSampler | None) -> dict:
    """A loader's state with its candidate streams' offsets (none without sampling: as before it existed)."""
    return state if sampler is None else {**state, "candidate_offsets": list(sampler.offsets)}


def load_candidate_offsets(state: dict, sampler: CandidateSampler | None):
    """The offsets of with_candidate_offsets back (a state without them, from a run that did not sample, leaves
    the streams as they are)."""
    if sampler is not None and "candidate_offsets" in state:
        sampler.offsets = list(state["candidate_offsets"])


def loader_state_of_ranks(states: list[dict]) -> dict:
    """The loader's state as a checkpoint keeps it, from every rank's (in rank order): the position, the same on
    every rank, and each candidate stream's offset from the rank that moves it (stream g: rank g mod world_size)."""
    state = dict(states[0])
    if "candidate_offsets" in state:
        world = len(states)
        state["candidate_offsets"] = [states[g % world]["candidate_offsets"][g]
                                      for g in range(len(state["candidate_offsets"]))]
    return state


def rank_micro_batches(micro_batches: list[np.ndarray], env: DistEnv, bigram_buckets: int, channels: int = 1,
                       candidates: Callable | None = None) -> Batch:
    """This rank's (inputs, targets): micro-batch g goes to rank g % world_size (the record's dealing). channels:
    --ngram_channels, which table's rows to find (bigram_buckets: its rows); with candidates(g, targets on the
    host), each one's candidate set (CandidateSampler.micro_batch)."""
    batch, rows, sets = [], [], []
    for g in range(env.rank, len(micro_batches), env.world_size):
        chunk = micro_batches[g]
        buf = to_device(torch.from_numpy(chunk), env.device)
        batch.append((buf[:-1], buf[1:]))
        if channels == 1:
            rows.append(host_bigram_rows(chunk, bigram_buckets) if env.world_size > 1 else None)
        else:
            rows.append(host_ngram_rows(chunk, bigram_buckets))
        found = candidates(g, chunk[1:]) if candidates is not None else None
        sets.append(found.to_device(env.device) if found is not None else None)
    return Batch(batch, rows, None, sets) if channels == 1 else Batch(batch, None, rows, sets)


def to_device(tokens: Tensor, device: torch.device) -> Tensor:
    """uint16 host tokens to int64 on the device."""
    return host_to_device(tokens, device).long()


def host_to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on the device without a host sync: a copy from pinned memory runs behind the queued
    compute, where one from pageable memory (a plain .to(device)) makes the host wait for the device."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


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
    packing: str = "documents"  # SHARD_PACKINGS: --packing, or the shard's header under auto
    fingerprint: str = ""  # shard_fingerprint's: what a checkpoint records, and what every later open must find
    first_step: int = 0  # the step of the schedule the run reaches this shard at
    steps: int = 0  # steps the loader takes from it (DocumentPieces.count_steps)


SCAN_THREADS = 4  # shards scanned at once; numpy releases the GIL while it reads and compares
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_TOKENS = 16, 4096


def shard_fingerprint(tokens: np.ndarray, starts: np.ndarray) -> str:
    """sha256 of what tells a shard's tokens from another's cheaply: their count, 16 evenly spaced blocks
    of 4,096 tokens (the first and the last included; 128 KiB) and every document's start. Another shard,
    or this text tokenized or shuffled differently, changes it; one token edited between the blocks, inside
    a document, would not."""
    h = hashlib.sha256(np.int64(len(tokens)).tobytes())
    last = max(len(tokens) - FINGERPRINT_BLOCK_TOKENS, 0)
    for offset in np.linspace(0, last, FINGERPRINT_BLOCKS).astype(np.int64):
        h.update(tokens[offset:offset + FINGERPRINT_BLOCK_TOKENS].astype("<u2", copy=False).tobytes())
    h.update(starts.astype("<i8").tobytes())
    return h.hexdigest()


def read_scanned_shard(scan: ShardScan, vocab_size: int) -> np.ndarray:
    """A scanned shard's tokens, read again (read_shard's checks) and refused unless they are still the ones the
    scan counted: a shard replaced during a run would otherwise be trained on unseen, its documents cut at the
    old shard's starts."""
    tokens = read_shard(scan.path, vocab_size)
    if shard_fingerprint(tokens, np.flatnonzero(tokens == BOS_ID)) != scan.fingerprint:
        raise DataError(f"{scan.path}: changed since the run scanned it at start-up ({len(tokens):,} tokens now, "
                        f"{scan.num_tokens:,} then, or other tokens): a run's shards must not be replaced while it "
                        f"trains; start it again (or resume it) on the new shards")
    return tokens


def scan_shard(path: Path, args: Hyperparameters) -> ShardScan:
    """One pass over a training shard: its token ids and its BOS positions."""
    tokens = read_shard(path, args.vocab_size)
    starts = np.flatnonzero(tokens == BOS_ID)
    if not len(starts):
        raise DataError(f"{path}: no document starts in it (no <|endoftext|>, id {BOS_ID}, the token every "
                        f"training piece starts with); tokenize text with `python data/tokenize_text.py`")
    packing = shard_packing(path) if args.packing == "auto" else args.packing
    return ShardScan(path, len(tokens), starts, packing, shard_fingerprint(tokens, starts))


def count_shard_steps(scan: ShardScan, first_step: int, args: Hyperparameters, schedule: Schedule) -> ShardScan:
    scan.first_step = first_step
    tokens = read_scanned_shard(scan, args.vocab_size)
    scan.steps = packed(scan.packing, tokens, scan.starts).count_steps(first_step, schedule)
    if not scan.steps and scan.packing == "stream":
        raise DataError(f"{scan.path}: its {scan.num_tokens:,} tokens cannot fill one step of "
                        f"{step_tokens(first_step, schedule):,} (step {first_step}); add text")
    if not scan.steps:
        stage = schedule.stage(first_step)
        raise DataError(f"{scan.path}: its documents cannot fill one step of {schedule.micro_batches(first_step)} x "
                        f"{schedule.micro_tokens(first_step) + 1} tokens (step {first_step}): a document gives its "
                        f"first {stage.max_seq_len} tokens at most (--stage_max_seq_len) and a micro-batch skips "
                        f"the rest of the one it ends in; split long documents (`python data/tokenize_text.py` "
                        f"does, see --max-doc-tokens) or add text")
    return scan


def scan_training_shards(files: list[Path], args: Hyperparameters, schedule: Schedule) -> list[ShardScan]:
    """Scans shards in order, a few at a time, until they supply args.num_iterations steps under the
    schedule (all of them when they cannot): a long list of shards costs only the ones the run will read.
    A shard's steps depend on the step the run reaches it at (the stages' batch sizes and lengths), so
    they are counted in order as the scans arrive."""
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
                scans.append(count_shard_steps(running.popleft().result(), supplied, args, schedule))
                supplied += scans[-1].steps
        finally:  # enough steps, or a bad shard: scans not yet started are dropped
            for future in running:
                future.cancel()
    return scans


def step_tokens(step: int, schedule: Schedule) -> int:
    """Tokens a step reads: its micro-batches, each with one more token for the last target."""
    return schedule.micro_batches(step) * (schedule.micro_tokens(step) + 1)


class TrainLoader:
    """Walks the training shards: each step takes the next pieces of the current shard (see
    DocumentPieces), packed into micro-batches of its stage's size whatever the world size. A step never
    straddles two shards: when a shard cannot fill one, the next shard starts the step. The shards are
    scanned first (scan_training_shards), so the run knows how many steps they supply: fewer than it
    needs is refused unless --repeat_data, which starts over from the first shard. The next shard is read
    in a background thread while this one is used."""

    def __init__(self, args: Hyperparameters, env: DistEnv, schedule: Schedule | None = None):
        files = find_shards(args.train_files, "training")
        self.schedule = schedule or Schedule(args)
        first_step_tokens = step_tokens(0, self.schedule)
        for f in files:
            if read_shard_header(f) < first_step_tokens:
                raise DataError(f"{f}: holds fewer tokens than one step needs ({first_step_tokens})")
        self.scans = scan_training_shards(files, args, self.schedule)
        self.supplied, self.needed = sum(scan.steps for scan in self.scans), args.num_iterations
        self.unread = len(files) - len(self.scans)
        val_files, val_under_repo = match_shards(args.val_files)
        validation = {f.resolve() for f in val_files}
        for f in files:  # resolved: the same file named by two globs, or through a link, is one file
            if f.resolve() in validation:
                raise DataError(f"{f}: both a training shard (--train_files={args.train_files}) and a validation "
                                f"shard (--val_files={args.val_files}); the val loss must come from text the run "
                                f"does not train on")
        self.fingerprints = [scan.fingerprint for scan in self.scans]  # what a checkpoint records
        found = [f"--{name}={pattern}" for name, pattern, under_repo in (
            ("train_files", args.train_files, match_shards(args.train_files)[1]),
            ("val_files", args.val_files, val_under_repo)) if under_repo]
        self.located = ([f"data: {' and '.join(found)} matched nothing under the working directory; read "
                         f"relative to {REPO_DIR}"] if found else [])  # train() logs it, after report()
        if self.supplied < self.needed and not args.repeat_data:
            per_shard = self.supplied / len(self.scans)
            enough = math.ceil(self.needed / per_shard)
            short = (f"--train_files={args.train_files}: its {len(files)} shard(s) supply {self.supplied:,} steps "
                     f"({per_shard:,.0f} per shard) but the run needs {self.needed:,}")
            if all(scan.packing == "stream" for scan in self.scans):  # own text: every token is used already
                raise DataError(f"{short}: add text (about {math.ceil(self.needed / self.supplied)} times as much), "
                                f"run fewer steps (--num_iterations={self.supplied}), or --repeat_data=true starts "
                                f"over from the first shard")
            raise DataError(f"{short}: about {enough} shards like these would (FineWeb: `python "
                            f"data/cached_fineweb10B.py {enough + 1}`, one spare), or --repeat_data=true starts over "
                            f"from the first shard; for your own text, --packing=stream trains on every token (what "
                            f"data/tokenize_text.py's shards ask for)")
        self.env, self.bigram_buckets, self.packing_flag = env, args.bigram_vocab_size, args.packing
        self.ngram_channels = args.ngram_channels
        self.vocab_size = args.vocab_size
        self.sampler = candidate_sampler(args, self.schedule)
        self.file_index, self.piece = 0, 0
        self.pieces: DocumentPieces | TokenStream | None = None
        self.started_over = False  # whether the last batch was the first of another pass over the shards
        self._prefetch = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._next: tuple[int, concurrent.futures.Future] | None = None

    def report(self) -> list[str]:
        """The log's account of the data: one line, and notes where the run repeats or skips much."""
        tokens = sum(scan.num_tokens for scan in self.scans)
        used = sum(step_tokens(step, self.schedule) for step in range(self.supplied))
        packings = dict.fromkeys(scan.packing for scan in self.scans)
        lines = [f"data: {len(self.scans)} training shard(s) supply {self.supplied:,} steps, the run needs "
                 f"{self.needed:,}; the steps use {used / tokens:.1%} of their {tokens:,} tokens"
                 + (f" ({self.unread} more shard(s) are not needed)" if self.unread else "")
                 + f"; packed as {' and '.join(packings)} (--packing={self.packing_flag})"]
        if self.supplied < self.needed:
            lines.append(f"data: --repeat_data=true: after {self.supplied:,} steps the data starts over from the "
                         f"first shard (logged each time)")
        def share(scan):
            return sum(step_tokens(s, self.schedule) for s in range(scan.first_step, scan.first_step + scan.steps)) \
                / scan.num_tokens
        sparse = [scan for scan in self.scans if scan.packing == "documents" and share(scan) < 0.5]
        if sparse:
            worst = min(sparse, key=share)
            stage = self.schedule.stage(worst.first_step)
            micro = self.schedule.micro_tokens(worst.first_step)
            shorter = min(stage.max_seq_len, micro // 4)  # pieces of a quarter micro-batch lose about an eighth
            lines.append(f"note: the steps use less than half of the tokens of {len(sparse)} shard(s) ({worst.path}: "
                         f"{share(worst):.0%}): a document gives its first {stage.max_seq_len} tokens at most "
                         f"(--stage_max_seq_len) and a micro-batch of {micro + 1} skips the rest of the one it ends "
                         f"in; --packing=stream would use every token, documents of at most {shorter} tokens "
                         f"(data/tokenize_text.py --max-doc-tokens={shorter}) most of them")
        return lines

    def shard_record(self) -> list[dict]:
        """The shards the run reads, in order, as a checkpoint records them (see check_resume_shards)."""
        return [{"file": str(scan.path), "bytes": SHARD_HEADER_BYTES + 2 * scan.num_tokens,
                 "fingerprint": fingerprint} for scan, fingerprint in zip(self.scans, self.fingerprints)]

    def state_dict(self) -> dict:
        # piece: the next piece of the shard (documents) or its next token (stream)
        state = {"file_index": self.file_index, "piece": self.piece, "packing": [scan.packing for scan in self.scans]}
        return with_candidate_offsets(state, self.sampler)

    def check_packing(self, state: dict):
        packing = state.get("packing", ["documents"] * len(self.scans))  # checkpoints from before --packing
        if packing != [scan.packing for scan in self.scans][:len(packing)]:
            theirs = list(dict.fromkeys(map(str, packing)))
            advice = (f"resume with --packing={theirs[0]}" if len(theirs) == 1 and theirs[0] in SHARD_PACKINGS else
                      "resume on the checkpoint's shards")
            raise DataError(f"the checkpoint packed its training shards as {', '.join(theirs)}, this run would pack "
                            f"them as {', '.join(dict.fromkeys(s.packing for s in self.scans))}: its position in them "
                            f"would mean other tokens; {advice}")

    def load_state_dict(self, state: dict):
        self.check_packing(state)
        self.file_index, self.piece, self.pieces = int(state["file_index"]), int(state["piece"]), None
        load_candidate_offsets(state, self.sampler)

    def _index(self, file_index: int) -> DocumentPieces | TokenStream:
        scan = self.scans[file_index]
        return packed(scan.packing, read_scanned_shard(scan, self.vocab_size), scan.starts)

    def _open(self, file_index: int) -> DocumentPieces | TokenStream:
        if self._next is not None and self._next[0] == file_index:
            pieces = self._next[1].result()
        else:
            pieces = self._index(file_index)
        following = (file_index + 1) % len(self.scans)
        self._next = following, self._prefetch.submit(self._index, following)
        return pieces

    def next_batch(self, step: int) -> list[tuple[Tensor, Tensor]]:
        """This rank's micro-batches of step `step` (its stage decides their size and max_seq_len)."""
        self.started_over = False
        micro, max_len = self.schedule.micro_tokens(step), self.schedule.stage(step).max_seq_len
        while True:
            if self.pieces is None:
                self.pieces = self._open(self.file_index)
            taken = self.pieces.take_step(self.piece, self.schedule.micro_batches(step), micro, max_len)
            if taken is not None:
                break
            if self.piece == 0:  # the scan counted at least one step in every shard it reached
                raise DataError(f"{self.scans[self.file_index].path}: its documents cannot fill step {step} "
                                f"({self.schedule.micro_batches(step)} x {micro + 1} tokens), or it changed since the "
                                f"start-up scan")
            self.file_index, self.piece, self.pieces = (self.file_index + 1) % len(self.scans), 0, None
            self.started_over = self.file_index == 0
        micro_batches, self.piece = taken
        return rank_micro_batches(micro_batches, self.env, self.bigram_buckets, self.ngram_channels,
                                  self.sampler and self.sampler.for_step(step))


# Synthetic tokens follow a Zipf law, p(rank k) ~ 1 / (k + 1 + 2.7)^1.2 over the ids below BOS (ranks dealt to ids by a
# fixed permutation): like web text, a micro-batch of 16K, 32K or 48K tokens holds about 3.8K, 6.0K or 8.0K distinct
# ones, which leaves record #92's sampled softmax (10,240, 10,240 and 14,336 candidates) the 41-63% headroom its
# FineWeb logs report 34-61% of. Uniform ids (16K distinct in 16K) would overflow its candidate sets.
SYNTHETIC_ZIPF = (1.2, 2.7)


@functools.lru_cache(maxsize=1)
def synthetic_token_law() -> tuple[np.ndarray, np.ndarray]:
    """(ids by rank, cumulative probabilities) of the synthetic tokens' Zipf law."""
    exponent, shift = SYNTHETIC_ZIPF
    weights = 1.0 / (np.arange(BOS_ID) + 1 + shift) ** exponent
    return np.random.default_rng(0).permutation(BOS_ID).astype(np.uint16), np.cumsum(weights / weights.sum())


def synthetic_tokens(rng: np.random.Generator, count: int) -> np.ndarray:
    ids, cdf = synthetic_token_law()
    return ids[np.minimum(np.searchsorted(cdf, rng.random(count)), BOS_ID - 1)]


class SyntheticLoader:
    """Zipf-distributed tokens (synthetic_tokens) with BOS at web-like document lengths, packed like the real
    data; for benchmarks that need no download."""

    started_over = False  # an endless supply

    def __init__(self, args: Hyperparameters, env: DistEnv, schedule: Schedule | None = None):
        self.schedule, self.env, self.seed = schedule or Schedule(args), env, args.seed
        self.bigram_buckets, self.ngram_channels = args.bigram_vocab_size, args.ngram_channels
        self.step = 0
        self.sampler = candidate_sampler(args, self.schedule)

    def report(self) -> list[str]:
        return ["data: synthetic tokens (--synthetic=true), new ones every step; no shards are read"]

    def state_dict(self) -> dict:
        return with_candidate_offsets({"step": self.step}, self.sampler)

    def load_state_dict(self, state: dict):
        self.step = int(state.get("step", 0))
        load_candidate_offsets(state, self.sampler)

    def next_batch(self, step: int) -> list[tuple[Tensor, Tensor]]:
        rng = np.random.default_rng([self.seed, self.step])
        self.step += 1
        micro, max_len = self.schedule.micro_tokens(step), self.schedule.stage(step).max_seq_len
        # FineWeb documents average roughly a thousand GPT-2 tokens with a long tail: exponential lengths,
        # of which training sees the first max_len; draw pieces until they fill the step.
        lengths = np.zeros(0, dtype=np.int64)
        while np.minimum(lengths, max_len).sum() <= self.schedule.micro_batches(step) * (micro + 1):
            lengths = np.append(lengths, rng.exponential(1000, 256).astype(np.int64) + 1)
        while True:  # the remainders cut at micro-batch edges are skipped: many small micro-batches need more
            tokens = synthetic_tokens(rng, int(lengths.sum()))
            tokens[np.cumsum(lengths) - lengths] = BOS_ID
            taken = DocumentPieces(tokens).take_step(0, self.schedule.micro_batches(step), micro, max_len)
            if taken is not None:
                return rank_micro_batches(taken[0], self.env, self.bigram_buckets, self.ngram_channels,
                                          self.sampler and self.sampler.for_step(step))
            lengths = np.append(lengths, rng.exponential(1000, 256).astype(np.int64) + 1)


def load_val_tokens(args: Hyperparameters) -> Tensor:
    """Exactly val_tokens (+1 for the last target) from the start of the validation shards."""
    needed = args.val_tokens + 1
    parts, total = [], 0
    files = find_shards(args.val_files, "validation")
    for f in files:
        if total >= needed:
            break
        parts.append(read_shard(f, args.vocab_size)[:needed - total])
        total += len(parts[-1])
    if total < needed:
        raise DataError(f"validation shards {args.val_files!r} hold {total} tokens, fewer than "
                        f"--val_tokens={args.val_tokens} (+1)")
    return torch.from_numpy(np.concatenate(parts))


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


def model_flops_per_token(args: Hyperparameters, model: GPT, tokens: Tensor, windows: tuple[int, int]) -> float:
    """6 FLOPs per matmul weight a token passes (forward 2, backward 4; an attention layer's narrow heads pass only
    the rows they read), plus attention: per attention layer, 6 * (heads * (qk_dim + v_dim)) FLOPs for each key a
    token attends to (12 * width at full width; min(position in its document + 1, window + 1); a paired layer's
    token is two positions with half the heads each, so the same count over its doubled document), plus DC's per
    key of its window."""
    matmul_params = sum(p.numel() for block in model.blocks for mlp in (block.mlp, block.parallel_mlp)
                        if mlp is not None for p in mlp.parameters())
    matmul_params += sum(block.attn.live_weights() for block in model.blocks if block.attn is not None)
    matmul_params += model.lm_head.numel() + 2 * (model.mudd_w1.numel() + model.mudd_gate_w1.numel()) // 2
    index = np.arange(len(tokens))
    doc_start = np.maximum.accumulate(np.where(tokens.cpu().numpy() == BOS_ID, index, 0))
    keys_in_doc = index - doc_start + 1
    attention_flops = 0.0
    for plan, block in zip(model.plans, model.blocks):
        if not plan.attention:
            continue
        width = block.attn.num_heads * (block.attn.qk_dim + block.attn.v_dim) / 2  # model_dim at full width
        window = window_tokens(windows, plan.long_window, args.window_block)
        if plan.paired:  # positions 2p and 2p+1 of the doubled document: about twice the keys, half the heads
            keys = (np.minimum(2 * keys_in_doc - 1, window + 1) + np.minimum(2 * keys_in_doc, window + 1)) / 2
        else:
            keys = np.minimum(keys_in_doc, window + 1)
        attention_flops += 12 * width * keys.mean()
        if plan.dc:
            attention_flops += 12 * width * np.minimum(keys_in_doc, args.dc_window).mean()
    return 6 * matmul_params + float(attention_flops)


def schedule_flops_per_token(args: Hyperparameters, model: GPT, tokens: Tensor,
                             schedule: Schedule | None = None) -> float:
    """model_flops_per_token averaged over the training tokens of the schedule's stages."""
    schedule = schedule or Schedule(args)
    total_tokens = sum(stage.batch_tokens * (stage.end - stage.start) for stage in schedule.stages)
    return sum(stage.batch_tokens * (stage.end - stage.start) * model_flops_per_token(args, model, tokens, stage.windows)
               for stage in schedule.stages if stage.end > stage.start) / total_tokens


# -----------------------------------------------------------------------------
# Memory model: each phase's peak per rank, counted on fake tensors (no memory, no device), so that
# --micro_batches=auto can choose and an explicit count that cannot fit is refused before step 0

# The share of the device's memory the counted tensors may take. The rest is for what this count does not
# see: the CUDA context, NCCL's buffers, the allocator's fragmentation, cuBLAS workspaces. tools/preflight.py
# measures the compiled steps at 82% to 102% of this count (the most: stage 3 at world size 1, 40.62 against
# 39.70 GiB; before the count took in the compiled loss chunk, up to 118%); on one H200, tools/bench.py
# measured rank 0 of 8's steps at 75-76% of it (max_memory_allocated) and the validation at 62%.
MEMORY_MARGIN = 0.15
GIB = 2 ** 30


class FlexStandIn(torch.autograd.Function):
    """Keeps for backward what FlexAttention keeps (q, k, v, the output, the fp32 log-sum-exp): FlexAttention
    has no backward on CPU, where the memory model runs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.size(-1))  # the values' width (narrow heads: not the queries')
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def flex_stand_in(q: Tensor, k: Tensor, v: Tensor, mask, scale: Tensor) -> Tensor:
    """The memory model's attention (CausalSelfAttention.attend, for FlexAttention runs): what FlexAttention
    would keep, and no arithmetic."""
    return FlexStandIn.apply(q, k, v)


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
            if not isinstance(t, Tensor) or t.device.type != self.device_type:
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


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def normuon_bytes(muon: NorMuon, world_size: int) -> tuple[int, int]:
    """(state bytes rank 0 keeps, buffer bytes of one step) for NorMuon (or ANVIL) at world_size. Each shape's
    matrices are one stack (_MatrixStack), ceil(n / world_size) of them rank 0's; ANVIL keeps two fp32 rails
    where NorMuon keeps one momentum. The step holds every shape's stacked gradients at once (the
    reduce-scatters fly together) with, at world size > 1, the owned sums and the gathered weights, and the
    largest stack's update in flight: its fp32 gradient, momentum lerp, Polar Express iterates and normalised
    update, about six fp32 copies (seven for ANVIL: the rails' blend), and its weights in and out."""
    rails, copies = (2, 7) if isinstance(muon, Anvil) else (1, 6)
    shapes = collections.Counter((tuple(p.shape[-2:]), p.dtype) for p, _, _ in muon.matrices)
    state = buffers = largest = 0
    for ((rows, cols), dtype), count in shapes.items():
        n, size, per_rank = rows * cols, dtype.itemsize, math.ceil(count / world_size)
        state += per_rank * (4 * (rails * n + max(rows, cols)) + (2 * n if dtype == torch.bfloat16 else 0))
        buffers += world_size * per_rank * n * size * (2 if world_size > 1 else 1) + \
            (per_rank * n * size if world_size > 1 else 0)
        largest = max(largest, per_rank * n * (copies * 4 + 2 * size))
    return state, buffers + largest


def dist_adam_bytes(adam: DistAdam, world_size: int, sparse_table: Tensor | None, touched_rows: int
                    ) -> tuple[int, int]:
    """(state bytes per rank, communication buffer bytes of one step) for DistAdam's buckets at world_size, whatever
    the world size it was built with (its buckets are the same). Record #85's bigram table's rows go by a sparse
    exchange, at most `touched_rows` of them each way, when its rows split evenly over the ranks. (Record #92's
    n-gram table has no bucket: ngram_bytes.)"""
    state = buffers = 0
    sparse = (adam._bucket_of[sparse_table] if sparse_table is not None and sparse_table.size(0) % world_size == 0
              else None)
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


def ngram_bytes(table: NgramEmbedding, step_rows: int, cycle_rows: int) -> tuple[int, int, int]:
    """(state, held through a step's forwards and backwards, held at the table's Adam step) in bytes per rank for
    record #92's table (NgramAdam), whose shard the model's buffers count. step_rows: the rows a step pulls (at most
    two a token); cycle_rows: those read since the table's last Adam step, whose gradients wait for it.
      - state: one fp32 second moment and one int32 last event per row of the shard;
      - a step: the pulled rows and their gradient (fp32 each), and the gradient waiting since the last Adam step
        (fp32), which at the step's end is merged into a new one beside it;
      - the table's Adam step: that gradient; at world size > 1 its part for the other ranks and what they send (in
        the table's dtype: the hash spreads rows evenly, so about as many as it holds) and the fp32 sums of the owned
        rows' gradients over the ranks; for the rows stepped their weights, moments and update in fp32 (about
        three copies)."""
    width, size = table.weight.size(1), table.weight.element_size()
    state = table.weight.size(0) * (4 + 4)
    held = 2 * step_rows * width * 4 + cycle_rows * width * 4
    merge = 2 * step_rows * width * 4 + 2 * cycle_rows * width * 4
    exchange = 2 * size + 4 + 4 if table.world > 1 else 0
    event = cycle_rows * width * (4 + exchange + 3 * 4)
    return state, held, max(merge, event)


def mask_bytes(masks: Masks) -> int:
    """Bytes of the distinct attention masks of one micro-batch (layers of one kind share one)."""
    total = 0
    for m in masks.by_kind.values():
        total += tensor_bytes([m] if isinstance(m, Tensor) else
                              [t for t in m.as_tuple()[2:] if isinstance(t, Tensor)])
    return total


def loss_chunk_bytes(args: Hyperparameters, tokens: int, device_type: str, head: str,
                     columns: int | None = None) -> int:
    """The loss's transient: one chunk of LOSS_CHUNK rows of logits at a time (the full logits are never
    held), each row `columns` wide (the padded vocabulary, or record #92's sampled softmax's candidates), and
    with the FP8 head (head: the lm_head's precision) the e5m2 gradient of every row's logits, transposed, for
    the lm_head's one weight-gradient matmul (head_loss). On GPUs a chunk holds its bf16 logits (e4m3 with
    --lm_head_fp8_logits) and fp32 passes of mtp_chunk: the compiled head three at once as tools/preflight.py
    measures it (aot_eager keeps every pass; inductor fuses most: fewer), the eager one (--compile=false) two, working in
    place, and its FP8 gradient in fp32 and e5m2 besides. On CPU: fp32 logits and two passes (tests/test_memory.py
    measures it)."""
    columns = columns or padded_vocab(args.vocab_size)
    elements = min(LOSS_CHUNK, tokens) * columns
    if device_type != "cuda":
        return elements * 3 * 4
    fp8 = head == "fp8"
    logits = 1 if fp8 and args.lm_head_fp8_logits else 2
    per_logit = logits + 4 * (3 if args.compile else 2) + (1 + (0 if args.compile else 4) if fp8 else 0)
    return elements * per_logit + (tokens * columns if fp8 else 0)


class MemoryModel:
    """What rank 0 of world_size holds at each phase's peak, for one configuration (explicit micro-batch
    counts) on one kind of device, with the precisions and attention the run resolved. Per phase:
      - weights, buffers (rotary tables, the bigram signs, FP8 copies) and, in training, their gradients;
      - NorMuon's fp32 momentum and per-neuron second moment, and the bf16 weights' mantissas, for the
        matrices this rank owns; DistAdam's fp32 moments of this rank's shard of every bucket;
      - training, the largest of: the tensors one micro-batch's forward keeps for backward (recorded by
        saved-tensor hooks while the eager model runs on fake tensors; torch.compile may keep less, so an
        upper bound there) with the loss's transient chunk and the block masks; the end of backward, where
        the dense gradient of the largest gathered table (the value embeddings) is built beside the one it
        is added to (two copies, eager); the optimizer step's communication buffers at world size > 1;
      - validation: the most live tensors of a forward pass over one validation sequence, op by op.
    Not counted (MEMORY_MARGIN is for them): allocator fragmentation, CUDA and NCCL contexts, kernel
    workspaces."""

    def __init__(self, args: Hyperparameters, world_size: int, device: torch.device, numerics: Numerics,
                 attention_kind: str):
        self.args, self.world_size, self.device_type = args, world_size, device.type
        self.use_flex = attention_kind == "flex"
        self.fake = FakeTensorMode()
        with self.fake, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = cast_parameters(GPT(args, numerics, table_shard=(0, world_size)))
            # shapes only: --init_from's weights are not read (tied or not, the schedule's untie is counted)
            self.muon, self.adam = build_optimizers(self.model, dataclasses.replace(args, init_from=""))
        if self.use_flex:  # through the layers' seam: the model itself knows nothing of this count
            for block in self.model.blocks:
                if block.attn is not None:
                    block.attn.attend = flex_stand_in
        self.weights = tensor_bytes(self.model.parameters())
        self.buffers = tensor_bytes(self.model.buffers())
        self.muon_state, self.muon_buffers = normuon_bytes(self.muon, world_size)
        bigram = self.model.bigram_embed.weight if self.model.bigram_embed is not None else None
        self.adam_state = dist_adam_bytes(self.adam, world_size, bigram, 0)[0]
        if self.model.ngram is not None:
            self.adam_state += ngram_bytes(self.model.ngram, 0, 0)[0]
        self.ship_state = ship_bytes(self.model, record92_ships(Schedule(args)), world_size) if args.tail_ships else 0
        # (micro_tokens, micro-batches per rank, candidates or None), or the validation's length -> its rows
        self.counted: dict = {}
        # what a forward pass keeps depends on none of the world size, the micro-batch counts or the run's controls
        self.forward_key = (config_fields(args, ignored=("micro_batches", *NOT_COUNTED)), device.type, numerics,
                            attention_kind)

    def state(self) -> int:
        """What a training rank holds whatever the phase: weights, buffers, gradients, optimizer state, the ships'
        accumulators (held from the first tick to the end: counted throughout)."""
        return 2 * self.weights + self.buffers + self.muon_state + self.adam_state + self.ship_state

    def _tokens(self, length: int) -> Tensor:
        tokens = torch.randint(0, BOS_ID, (length,))
        tokens[::1000] = BOS_ID  # documents of a thousand tokens: the masks' blocks are the data's
        return tokens

    def _masks(self, inputs: Tensor, windows: tuple[int, int]) -> tuple[Masks, int]:
        masks = build_masks(inputs, self.model.plans, windows, self.args.window_block, self.use_flex)
        return masks, mask_bytes(masks)

    def _shared_count(self, what: tuple, count) -> tuple[int, int]:
        """count() of a forward pass, made once for every memory model of the same configuration (world sizes
        and micro-batch counts differ only in what the optimizers hold): tools/estimate_memory.py's world sizes
        and the counts --micro_batches=auto tries share them."""
        return kept(FORWARD_COUNTS, (self.forward_key, what), count, 256)

    def _ngram_view(self, tokens: int, grad: bool):
        """For record #92's table, the pulled rows a forward over `tokens` tokens reads (ngram_pull's, at most two a
        token; counted by ngram_bytes); made under the fake mode."""
        if self.model.ngram is not None:
            rows = min(self.args.bigram_vocab_size, 2 * tokens)
            cache = torch.zeros(rows, self.args.model_dim, dtype=torch.float32).requires_grad_(grad)
            self.model.ngram.view = NgramView(cache, torch.arange(rows))

    def _saved_by_forward(self, micro_tokens: int, windows: tuple[int, int],
                          columns: int | None = None) -> tuple[int, int]:
        """(bytes the forward keeps for backward, bytes of the block masks) for one micro-batch; with columns,
        its loss over that many candidates (record #92's sampled softmax)."""
        with self.fake, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._ngram_view(micro_tokens, grad=True)
            x = self._tokens(micro_tokens + 1)
            masks, masks_size = self._masks(x[:-1], windows)
            saved: dict = {}

            def keep(t):
                saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
                return t

            schedule = Schedule(self.args)
            mtp = torch.ones(len(schedule.mtp_weights(0)))
            prefix = torch.ones(1) if schedule.prefix_weight(0) is not None else None
            candidates = None
            if columns:
                positions = torch.zeros(micro_tokens, dtype=torch.int64)
                candidates = Candidates(torch.arange(columns), positions, positions if prefix is not None else None)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                self.model(x[:-1], x[1:], masks, mtp, loss_scale=1.0, prefix_weight=prefix, candidates=candidates)
            if self.model.ngram is not None:
                self.model.ngram.view = None
        return sum(saved.values()), masks_size

    def _live_in_forward(self, seq_len: int, windows: tuple[int, int]) -> tuple[int, int]:
        """(the most bytes a validation forward pass holds beyond the model, bytes of its block masks)."""
        with self.fake, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = self._tokens(seq_len + 1)
            masks, masks_size = self._masks(x[:-1], windows)
            self.model.eval()
            self._ngram_view(seq_len, grad=False)
            live = LiveMemory(device_type="cpu")  # fake tensors live on the host: cast, never moved
            live.track([*self.model.parameters(), *self.model.buffers()])  # views of them are not new memory
            if self.model.ngram is not None:  # (counted on its own: ngram_rows_row)
                live.track([self.model.ngram.view.cache, self.model.ngram.view.ids])
            with torch.no_grad(), live:
                live.start()
                base = live.live
                self.model(x[:-1], x[1:], masks)
            self.model.train()
            if self.model.ngram is not None:
                self.model.ngram.view = None
        return live.peak - base, masks_size

    def training(self, micro_tokens: int, windows: tuple[int, int], micro_per_rank: int,
                 columns: int | None = None) -> dict[str, int]:
        """The rows of a training phase whose micro-batches hold micro_tokens tokens (and whose loss runs over
        `columns` candidates: record #92's sampled softmax; None: the whole vocabulary)."""
        args = self.args
        activations, masks_size = self._shared_count(
            ("training", micro_tokens, columns),
            lambda: self._saved_by_forward(micro_tokens, windows, columns))
        bigram = self.model.bigram_embed.weight if self.model.bigram_embed is not None else None
        touched = min(args.bigram_vocab_size, args.adam_every * micro_tokens * micro_per_rank)
        adam_buffers = dist_adam_bytes(self.adam, self.world_size, bigram, touched if bigram is not None else 0)[1]
        chunk = loss_chunk_bytes(args, micro_tokens, self.device_type, self.model.numerics.head, columns)
        tables = [self.model.value_embeds, self.model.embed.weight, *([bigram] if bigram is not None else [])]
        embedding_backward = 2 * max(tensor_bytes([table]) for table in tables)
        ngram_held = ngram_event = 0
        if self.model.ngram is not None:  # two rows a token; the table's gradients wait over its Adam cycle
            step_rows = min(args.bigram_vocab_size, 2 * micro_tokens * micro_per_rank)
            cycle = max(args.adam_every, args.embed_adam_period)
            _, ngram_held, ngram_event = ngram_bytes(self.model.ngram, step_rows,
                                                     min(args.bigram_vocab_size, cycle * step_rows))
        step_buffers = self.muon_buffers + adam_buffers + ngram_event
        return {"weights": self.weights, "buffers": self.buffers, "gradients": self.weights,
                "matrix optimizer state": self.muon_state, "DistAdam state": self.adam_state,
                "ships' averages": self.ship_state, "saved activations": activations, "loss chunk": chunk,
                "block masks": masks_size,
                "n-gram rows": ngram_held, "embedding backward": embedding_backward,
                "optimizer-step buffers": step_buffers,
                "peak": self.state() + max(activations + chunk + masks_size + ngram_held,
                                           embedding_backward + ngram_held, step_buffers)}

    def validation(self, seq_len: int, windows: tuple[int, int]) -> dict[str, int]:
        """The rows of a validation forward pass over one seq_len-token sequence (no gradients)."""
        forward, masks_size = self._shared_count(("validation", seq_len), lambda: self._live_in_forward(seq_len, windows))
        persistent = self.weights + self.buffers + self.muon_state + self.adam_state + self.ship_state
        ngram_rows_row = 0
        if self.model.ngram is not None:  # the sequence's pulled rows (fp32) and the pull's copies in the table's dtype
            rows = min(self.args.bigram_vocab_size, 2 * seq_len)
            ngram_rows_row = rows * self.args.model_dim * (4 + 2 * self.model.ngram.weight.element_size())
        return {"weights": self.weights, "buffers": self.buffers, "gradients": 0,
                "matrix optimizer state": self.muon_state, "DistAdam state": self.adam_state,
                "ships' averages": self.ship_state, "forward's largest live tensors": forward,
                "block masks": masks_size, "n-gram rows": ngram_rows_row,
                "peak": persistent + forward + masks_size + ngram_rows_row}

    def phases(self, stages: set[int] | None = None, validation: bool = True) -> dict[str, dict[str, int]]:
        """Every phase whose memory differs: each stage the run reaches (the extension's windows are its
        own; it trains at the last stage's count), then the validation at the final windows. `stages`: only
        the phases of these --micro_batches entries."""
        schedule, rows = Schedule(self.args), {}
        for i, stage in enumerate(schedule.stages):
            if stage.end <= stage.start or (stages is not None and min(i, len(schedule.stages) - 2) not in stages):
                continue
            name = f"stage {i + 1}" if i < len(schedule.stages) - 1 else "extension"
            # The windows change no tensor's size (block masks hold every block pair; attention keeps q, k, v,
            # its output and log-sum-exp): phases of the same micro-batches share one count.
            # A stage that samples (--stage_softmax_candidates) holds the logits of its most candidates.
            parts = schedule.candidate_parts[i]
            columns = None if 0 in parts else max(parts)
            key = (stage.micro_tokens, stage.micro_batches // self.world_size, columns)
            if key not in self.counted:
                self.counted[key] = self.training(stage.micro_tokens, stage.windows, key[1], columns)
            rows[name] = self.counted[key]
        if validation:
            if self.args.val_seq_len not in self.counted:
                self.counted[self.args.val_seq_len] = self.validation(self.args.val_seq_len, schedule.final_val_windows)
            rows["validation"] = self.counted[self.args.val_seq_len]
        return rows


# The memory models made in this process, by everything their counts depend on: tools/preflight.py and
# tools/estimate_memory.py ask about the same configuration again (the trainer's start-up, the fitting flags,
# another card), and a model's counts are kept with it.
MEMORY_MODELS: dict[tuple, MemoryModel] = {}
FORWARD_COUNTS: dict[tuple, tuple[int, int]] = {}  # MemoryModel._shared_count's
# Fields no count depends on (which tokens are read, the seed of the weights; a model's tensors are fake): left out
# of those keys, so that runs of one model on other data share one count (every run on CPU is counted).
NOT_COUNTED = ("train_files", "val_files", "val_tokens", "synthetic", "repeat_data", "packing", "seed")


def memory_model(args: Hyperparameters, world_size: int, device: torch.device, numerics: Numerics,
                 attention_kind: str) -> MemoryModel:
    key = (config_fields(args, ignored=NOT_COUNTED), world_size, device.type, numerics, attention_kind)
    return kept(MEMORY_MODELS, key, lambda: MemoryModel(args, world_size, device, numerics, attention_kind), 64)


def config_fields(args: Hyperparameters, ignored: tuple[str, ...] = ()) -> tuple:
    """The fields of args that decide a count, as a key: all but the run's controls and `ignored`."""
    return tuple((k, v) for k, v in dataclasses.asdict(args).items() if k not in (*RUN_CONTROL_FIELDS, *ignored))


def kept(table: dict, key, make, most: int):
    """table[key], made by make() the first time; a long-lived process (the tests) keeps the newest `most`."""
    if key not in table:
        if len(table) >= most:
            table.pop(next(iter(table)))
        table[key] = make()
    return table[key]


class DoesNotFitError(ConfigError):
    """The memory model puts a phase over the device's memory (less MEMORY_MARGIN); the message says which
    and what would fit."""


def memory_budget(args: Hyperparameters, device: torch.device) -> tuple[int, str]:
    """(bytes, whose) that the predicted peaks must fit, before the margin: the GPU's memory, or --memory_limit_gib;
    on CPU, the host's physical memory (device_memory_bytes) shared by the ranks torchrun started on it. Every run
    is checked (plan_memory): on CPU a config of sizes within check_sizes' bounds (--model_dim=65536,
    --bigram_vocab_size=2**25) was built unchecked and failed in an allocation traceback. Physical memory, not what
    is free now (/proc/meminfo's MemAvailable): the verdict is the same for the same config on the same machine, a
    refusal means the run cannot fit here at all (not that other processes hold memory now), and it is the count
    that check_fits_host and the dense-mask check (resolve_attention) use."""
    if device.type == "cuda":
        return card_memory(args, device_memory_bytes(device), f"{device} ({torch.cuda.get_device_name(device)})")
    if args.memory_limit_gib:
        return card_memory(args, 0, "")
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={text!r} in the environment is not a number of ranks (torchrun sets it)")
    ranks = int(text)
    return device_memory_bytes(device) // ranks, "this host" + (f" shared by {ranks} ranks" if ranks > 1 else "")


def card_memory(args: Hyperparameters, memory: int, whose: str) -> tuple[int, str]:
    """(bytes, whose) of a card with `memory` bytes: --memory_limit_gib replaces them when it is given. The one
    place that decides it, for the trainer on its device and for tools/estimate_memory.py and tools/preflight.py
    on the cards they stand in for."""
    if not args.memory_limit_gib:
        return memory, whose
    limit = int(args.memory_limit_gib * GIB)
    if memory and limit > memory:  # (memory 0: the host's, which a limit may exceed, for tests of large recipes)
        raise ConfigError(f"--memory_limit_gib={args.memory_limit_gib:g}: more than the {memory / GIB:.2f} GiB of "
                          f"{whose}; the limit can only lower what a run may use")
    return limit, f"--memory_limit_gib={args.memory_limit_gib:g}"


def within_margin(memory: int, whose: str) -> tuple[int, str]:
    """The bytes the predicted peaks may take of `memory` (all but MEMORY_MARGIN), and that in words."""
    budget = int(memory * (1 - MEMORY_MARGIN))
    return budget, f"{budget / GIB:.2f} GiB per rank ({1 - MEMORY_MARGIN:.0%} of the {memory / GIB:.2f} GiB of {whose})"


def micro_batch_choices(batch_tokens: int, world_size: int, window_block: int) -> list[int]:
    """The counts a stage's batch can split into, fewest (the largest micro-batches) first: multiples of the
    world size, each micro-batch a multiple of window_block."""
    return [count for count in range(world_size, batch_tokens // window_block + 1, world_size)
            if batch_tokens % count == 0 and (batch_tokens // count) % window_block == 0]


def stage_micro_batch_choices(args: Hyperparameters, world_size: int) -> list[list[int]]:
    """micro_batch_choices of each --micro_batches stage; the last one's also split the extension's batch, which
    trains at its count (record #92's extension has a batch of its own)."""
    *stages, extension = Schedule(args).stages
    choices = [micro_batch_choices(stage.batch_tokens, world_size, args.window_block) for stage in stages]
    splits_extension = micro_batch_choices(extension.batch_tokens, world_size, args.window_block)
    choices[-1] = [count for count in choices[-1] if count in splits_extension]
    return choices


def micro_batches_flag(counts) -> str:
    """--micro_batches's value for these per-stage counts: one count when they are all the same."""
    return str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))


def phase_stage(name: str, stages: int) -> int | None:
    """The index of the --micro_batches entry a phase of MemoryModel.phases trains with (None: validation)."""
    return stages - 1 if name == "extension" else None if name == "validation" else int(name.split()[1]) - 1


def check_state(model: MemoryModel, budget: int, within: str, args: Hyperparameters, world_size: int) -> int:
    """What a rank holds in every phase (MemoryModel.state: weights, buffers, gradients, optimizer state), or
    DoesNotFitError when it is over `budget`: no micro-batch helps then (a smaller n-gram table may). Known without
    the forward passes, which are slow at such sizes."""
    state = model.state()
    if state > budget:
        table = (f"; or a smaller --bigram_vocab_size: the n-gram table's {args.bigram_vocab_size:,} rows take "
                 f"{args.bigram_vocab_size // world_size * args.model_dim * model.model.numerics.compute.itemsize / GIB:.2f}"
                 f" GiB per rank" if args.ngram_channels == 2 else "")
        raise DoesNotFitError(f"the weights, gradients and optimizer state alone take {state / GIB:.2f} GiB per rank, "
                              f"over {within}; more GPUs share the optimizer state{table}")
    return state


def fit_micro_batches(args: Hyperparameters, world_size: int, device: torch.device, numerics: Numerics,
                      attention_kind: str, budget: int, within: str) -> tuple[tuple[int, ...], dict[str, dict[str, int]]]:
    """The micro-batch count of each stage, and every phase's rows with them: --micro_batches as given, or
    for auto the fewest per stage whose phases fit `budget` (`within` says it in words). Counts only grow
    during the search, and with them nothing a phase holds does, so each stage's first fit stays a fit."""
    *stages, extension = Schedule(args).stages  # the flag's stages; the extension trains at the last one's count
    given = stage_micro_batches(args, len(stages))
    choices = stage_micro_batch_choices(args, world_size)
    for i, (stage, options) in enumerate(zip(stages, choices)):
        if given[i] is None and not options:
            also = (f" (with the extension's batch of {extension.batch_tokens:,}, which trains at its count)"
                    if i == len(stages) - 1 and extension.batch_tokens != stage.batch_tokens else "")
            raise ConfigError(f"--micro_batches=auto: stage {i + 1}'s batch of {stage.batch_tokens:,} tokens{also} "
                              f"cannot split over {world_size} ranks into micro-batches of a multiple of "
                              f"--window_block={args.window_block} tokens")
    most = [options[-1] if count is None else count for count, options in zip(given, choices)]
    state = check_state(memory_model(dataclasses.replace(args, micro_batches=micro_batches_flag(most)), world_size,
                                     device, numerics, attention_kind), budget, within, args, world_size)
    counts = [options[0] if count is None else count for count, options in zip(given, choices)]
    searching = {i for i, count in enumerate(given) if count is None}

    def model_of(counts) -> MemoryModel:
        return memory_model(dataclasses.replace(args, micro_batches=micro_batches_flag(counts)), world_size, device,
                            numerics, attention_kind)

    while searching:
        rows = model_of(counts).phases(searching, validation=False)
        over: dict[int, int] = {}
        for name, row in rows.items():
            i = phase_stage(name, len(stages))
            if row["peak"] > budget:
                over[i] = max(over.get(i, 0), row["peak"] - state)
        searching = set(over)
        for i, varying in over.items():
            larger = [count for count in choices[i] if count > counts[i]]
            if not larger:
                raise DoesNotFitError(f"--micro_batches=auto: no micro-batch of stage {i + 1}'s batch fits {within}; "
                                      f"more GPUs share the micro-batches and the optimizer state")
            # Skip the counts that cannot fit: what a phase holds beyond the state shrinks at most with the
            # square of the micro-batch (dense masks; the rest linearly or not at all), so this bound never
            # skips a count that fits. The next round checks the first one it leaves.
            guess = [count for count in larger if state + varying * (counts[i] / count) ** 2 <= budget]
            counts[i] = guess[0] if guess else larger[-1]
    return tuple(counts), model_of(counts).phases()


def fitting_val_seq_len(args: Hyperparameters, world_size: int, device: torch.device, numerics: Numerics,
                        attention_kind: str, budget: int) -> int | None:
    """The longest validation sequence, halving --val_seq_len, that splits the same validation tokens over
    the ranks and fits `budget`; None if none does."""
    length = args.val_seq_len // 2
    while length >= args.window_block:
        if (length % args.window_block == 0 and args.val_tokens % length == 0
                and (args.val_tokens // length) % world_size == 0):
            trial = dataclasses.replace(args, val_seq_len=length)
            model = memory_model(trial, world_size, device, numerics, attention_kind)
            if model.validation(length, Schedule(trial).final_val_windows)["peak"] <= budget:
                return length
        length //= 2
    return None


@dataclass
class MemoryPlan:
    rows: dict[str, dict[str, int]]  # MemoryModel.phases of the run as it will train
    lines: list[str]  # for the log: the budget, then each phase's predicted peak
    config: Hyperparameters  # the config with --micro_batches=auto's counts chosen (a copy: nothing is mutated)


def counts_phases(args: Hyperparameters, device: torch.device) -> bool:
    """Whether the start-up check counts every phase (a forward pass on fake tensors for each micro-batch size, and a
    validation pass) or only the state, which no phase goes below (check_state): every phase on a GPU, and on a CPU
    where --micro_batches=auto chooses by them or --memory_limit_gib asks. A CPU run without either is checked
    for its state alone: what a config too large for the host is refused by before its model is built, in
    0.04-0.12 s of CPU time. Counting its phases too took 1.3-2.1 s for each of the tests' small configs (TINY,
    SHORT, the smoke preset), most of the 17% more CPU time the quick tests, which start many CPU runs, took so.
    Either way the memory model's FakeTensorMode imports torch._dynamo's config, 1.6 s of a CPU process's start-up
    (test_bad_input.py's TINY run: 4.1 s, now 5.6 s), which no other part of a CPU run pays (tests/test_speed.py)."""
    return device.type == "cuda" or bool(args.memory_limit_gib) or args.micro_batches.strip() == "auto"


def plan_memory(args: Hyperparameters, world_size: int, device: torch.device, numerics: Numerics,
                attention_kind: str) -> MemoryPlan | None:
    """Checks, before anything is built, that every phase fits this device's memory (memory_budget) by the
    memory model, and chooses the counts of --micro_batches=auto (in the plan's copy of the config, which the
    run then logs, checkpoints and trains by). Raises DoesNotFitError, naming what would fit. Where it counts only
    the state (counts_phases), that is checked and the plan is None."""
    budget, within = within_margin(*memory_budget(args, device))
    auto = args.micro_batches.strip() == "auto"
    if not counts_phases(args, device):  # (the counts are explicit: auto counts the phases)
        check_state(memory_model(args, world_size, device, numerics, attention_kind), budget, within, args, world_size)
        return None
    counts, rows = fit_micro_batches(args, world_size, device, numerics, attention_kind, budget, within)
    stages = len(counts)
    validation = rows["validation"]["peak"]
    if validation > budget:  # auto never shortens it: the measured loss would change
        length = fitting_val_seq_len(dataclasses.replace(args, micro_batches=micro_batches_flag(counts)), world_size,
                                     device, numerics, attention_kind, budget)
        validation_need = (f"--val_seq_len={args.val_seq_len}: a validation sequence needs {validation / GIB:.2f} GiB "
                           f"per rank (predicted)")
        validation_fix = (f"--val_seq_len={length} fits (the same validation tokens)" if length else
                          "no shorter --val_seq_len fits")
    for name, row in rows.items():
        if name == "validation" or row["peak"] <= budget:
            continue
        try:
            fits, _ = fit_micro_batches(dataclasses.replace(args, micro_batches="auto"), world_size, device,
                                        numerics, attention_kind, budget, within)
            remedy = f"--micro_batches={micro_batches_flag(fits)} fits (what --micro_batches=auto chooses)"
        except DoesNotFitError:
            remedy = "no micro-batch count fits; more GPUs share the micro-batches and the optimizer state"
        micro = Schedule(args).stages[phase_stage(name, stages)].micro_tokens
        raise DoesNotFitError(f"--micro_batches={args.micro_batches}: {name}'s micro-batches of {micro:,} tokens need "
                              f"{row['peak'] / GIB:.2f} GiB per rank (predicted), over {within}; {remedy}"
                              + (f"; and {validation_need}: {validation_fix}" if validation > budget else ""))
    if validation > budget:
        raise DoesNotFitError(f"{validation_need}, over {within}; {validation_fix}")
    chosen = micro_batches_flag(counts)
    lines = [f"memory: the predicted peaks must fit {within}; "
             + (f"--micro_batches=auto chose {chosen}" if auto else f"--micro_batches={args.micro_batches} fits")]
    resolved = dataclasses.replace(args, micro_batches=chosen)
    schedule = Schedule(resolved)
    for name, row in rows.items():
        if name == "validation":
            lines.append(f"memory: validation, sequences of {resolved.val_seq_len:,} tokens: predicted peak "
                         f"{row['peak'] / GIB:.2f} GiB")
            continue
        stage = schedule.stages[phase_stage(name, stages) if name != "extension" else -1]
        lines.append(f"memory: {name}, micro-batches of {stage.micro_tokens:,} tokens, {stage.micro_batches} a step "
                     f"({stage.micro_batches // world_size} per rank): predicted peak {row['peak'] / GIB:.2f} GiB")
    return MemoryPlan(rows, lines, resolved)


# -----------------------------------------------------------------------------
# Checkpoints: atomic, per-rank optimizer shards, every file's size and sha256 in meta.json, refused
# when anything doesn't match

def code_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def config_for_checkpoint(args: Hyperparameters) -> dict:
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in RUN_CONTROL_FIELDS and k != "packing"}


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type where it has no message: what a one-line error quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def remove_unfinished(tmp: Path, what: str = "folder") -> str:
    """Removes a folder a save left unfinished and says so truthfully, for the error line, which names the
    temporary only when the user must delete it. Tried a few times: under torchrun another rank may still be adding
    its file while the folder is emptied."""
    for _ in range(20):
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.lexists(tmp):
            return f"nothing of the unfinished {what} was kept"
        time.sleep(0.05)
    return f"the unfinished {what} ({tmp}) could not be removed: delete it"


def save_checkpoint(step: int, train_time_ms: float, model: GPT, optimizers, loader, args: Hyperparameters,
                    env: DistEnv, source: str, run_id: str, extra_state: dict | None = None) -> Path:
    """checkpoint_dir/<run_id>/step_NNNNNN/: model.pt (rank 0), rank_R.pt (each rank's optimizer shards,
    RNG states, the step, and the state_dict() of each object of extra_state: run state beside the optimizers,
    such as the ships' accumulators), meta.json written last with every file's size and sha256 and the
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
                error = write_error(final, e)
        if not all_ranks_ok(error is None, env.device):
            raise error or TrainingError(f"rank 0 could not create {tmp}")
        files = {}
        try:
            rank_state = {"step": step, "optimizers": [opt.state_dict() for opt in optimizers],
                          "rank_buffers": host_copies(rank_buffers(model)),
                          "extra_state": {name: part.state_dict() for name, part in (extra_state or {}).items()},
                          "cpu_rng": torch.get_rng_state(),
                          "cuda_rng": torch.cuda.get_rng_state() if env.device.type == "cuda" else torch.empty(0)}
            files[f"rank_{env.rank}.pt"] = write_file(tmp / f"rank_{env.rank}.pt", rank_state,
                                                      shown=final / f"rank_{env.rank}.pt")
            if env.is_main:
                files["model.pt"] = write_file(tmp / "model.pt", model.state_dict(), shown=final / "model.pt")
        except (TrainingError, FileRefused) as e:
            error = e
        every_rank = gather_from_ranks(None if error else files)
        loader_state = loader_state_of_ranks(gather_from_ranks(loader.state_dict()))
        failed = [rank for rank, written in enumerate(every_rank) if written is None]
        if env.is_main and not failed:
            shard_record = loader.shard_record() if hasattr(loader, "shard_record") else []  # none: synthetic data
            meta = {"step": step, "train_time_ms": train_time_ms, "world_size": env.world_size,
                    "loader": loader_state, "config": config_for_checkpoint(args),
                    "code_sha256": code_hash(source), "shards": shard_record,
                    "files": {name: written[name] for written in every_rank for name in sorted(written)}}
            try:
                write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode(), shown=final / "meta.json")
                publish_folder(tmp, final)
                write_file(latest_tmp, (final.name + "\n").encode())
                os.replace(latest_tmp, run_dir / "latest")
            except (TrainingError, FileRefused) as e:
                error = e
            except OSError as e:
                error = write_error(final, e)
            latest_tmp.unlink(missing_ok=True)
        if env.is_main and os.path.lexists(tmp):  # the save failed before the rename: leave nothing half-written
            reason = error or f"rank {failed[0]} could not write its part of the checkpoint"
            error = TrainingError(f"{reason}; {remove_unfinished(tmp, 'checkpoint')}")
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


# A run that saves holds an flock on its checkpoint_dir/<run_id>/ for as long as it lives (claim_run_folder, released
# by release_folders). The kernel drops an flock when its holder dies, however it dies (kill -9 too), so a folder
# whose flock is free belongs to no live run, and what a save left unfinished in it (a `.step_NNNNNN.partial/` of
# GBs at the speedrun's size) is removed, with a `note:` line, by the next run that meets it: a resume from one of
# its checkpoints, or a run given its run id (which is refused: the id is taken). Before, nothing removed it.
HELD_RUN_FOLDERS: dict[Path, int] = {}  # run folder -> the descriptor of this process's flock on it
UNFINISHED_SAVES = (".step_*.partial", ".final.partial", ".latest.tmp", ".write_test")


def sweep_unfinished_saves(run_dir: Path) -> list[str]:
    """Removes what a run that is gone left unfinished in its checkpoint folder (UNFINISHED_SAVES); a folder a live
    run holds is left alone. Returns a `note:` line per removal. Nothing outside run_dir is touched: run_dir itself
    is opened without following a link (a symlinked <checkpoint_dir>/<run_id> once had the sweep delete a
    `.step_*.partial/` and `.write_test` of the folder it pointed to), and what is inside is listed and removed
    through that descriptor, links as links."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # missing, not a folder, or a link: nothing of a run's to sweep
        return []
    notes = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries if any(fnmatch.fnmatchcase(e.name, p) for p in UNFINISHED_SAVES))
        for name in names:
            with contextlib.suppress(OSError):  # what cannot be removed stays, and is not said to be removed
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
                notes.append(f"note: removed {run_dir / name}, which a run that is gone (killed while saving) left "
                             f"unfinished")
    except OSError:  # BlockingIOError: a live run's folder, its saves are its own (or a file system without flock)
        pass
    finally:
        os.close(fd)
    return notes


def claim_run_folder(run_dir: Path, args: Hyperparameters) -> list[Path]:
    """Creates checkpoint_dir/<run_id>/ for a run that saves (checkpoints or final weights), and writes a file
    in it, so that an unwritable --checkpoint_dir stops the run before step 0, not after it has trained.
    The folder is made exclusively: a run that took this id since it was checked cannot be written over; the run
    holds it (HELD_RUN_FOLDERS) until release_folders. Returns the folders made, innermost first."""
    made = [folder for folder in (run_dir, *run_dir.parents) if not os.path.lexists(folder)]
    probe = run_dir / ".write_test"
    try:
        os.makedirs(run_dir)  # exist_ok=False; a file on the way is ENOTDIR
        HELD_RUN_FOLDERS[run_dir] = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        with contextlib.suppress(OSError):  # a file system without flock: its leftovers are then never swept
            fcntl.flock(HELD_RUN_FOLDERS[run_dir], fcntl.LOCK_EX | fcntl.LOCK_NB)
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
    """Lets go of the run folders among `made` this process holds, and removes the folders that stayed empty
    (innermost first); one holding a checkpoint stays."""
    for folder in made:
        if folder in HELD_RUN_FOLDERS:
            os.close(HELD_RUN_FOLDERS.pop(folder))
        with contextlib.suppress(OSError):
            folder.rmdir()


# One reader for every weights file: a final-weights folder's model.pt (sample.py, load_final_weights, to-record),
# --init_from's, a checkpoint's model.pt and rank files (--resume), and the record's state dict (tools/record_weights.py
# to-ours): load_weights, then, for the tensors, check_weights (to-ours: the same tensor_problem, storage_problem and
# nonfinite_problem). Each file is checked before any model is built from it, in this order: it is a regular file
# (open_regular) and a zip archive holding data.pkl, as torch.save writes; the model of the config (built on the meta
# device, so without memory) and what the archive's entries hold once inflated, read from its directory before
# anything is unpickled, fit this host's memory (torch.load inflates compressed entries: an 85 MB model.pt of 3 GB of
# zeros took 3.4 GB before a check of its size on disk); the file loads with weights_only, to the CPU; it is a dict
# whose keys are strings, whose tensors are dense and strided, on the CPU (a tensor saved from the meta device holds
# no values), of a floating dtype, whose names and shapes are the model's, each stored in a storage that holds its
# every element once (no zero strides, no overlapping views: a bank of 2**24 rows broadcast from one fitted in 92 MB,
# and the finiteness check then asked for 2.2 TB), and last finite and at most MAX_WEIGHT in magnitude. What runs a
# final-weights folder's model (sample.py) first checks its logits on a probe document (check_forward_finite);
# to-record only converts the weights. Before, only to-ours checked: --init_from cast int64 weights in silence and
# tracebacked on a non-string key, a non-tensor value or a meta tensor, and NaN weights (and finite ones x1e30)
# reached sample.py's multinomial.

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # cast into our parameters exactly
# The forward multiplies weights by weights (an embedding row by a lambda by a matrix): two above 2**64 overflow fp32
# and bf16 (whose largest is 2**128) in one product. Trained weights are O(1); smaller weights can overflow too (the
# smoke model's random N(0, 0.3^2) weights times 10 give NaN logits), which the probe forward finds.
MAX_WEIGHT = 2.0 ** 64
PROBE_TOKENS = 64  # the probe document's length (check_forward_finite): within every model's context, cheap


class WeightsError(ValueError):
    """A weights file that is not the model it should hold: one line, naming the key (the caller names the file)."""


def tensor_problem(name: str, value) -> str | None:
    """Why a stored value cannot be one of a model's tensors, or None: the cheap checks (check_weights adds the
    shapes and, last, finiteness)."""
    if type(value) not in (torch.Tensor, nn.Parameter):
        return f"{name!r} is a {type(value).__name__}, not a tensor"
    if value.layout != torch.strided or value.is_quantized:
        return f"{name!r} is a {str(value.layout).removeprefix('torch.')}{' quantized' * value.is_quantized} tensor, " \
               f"not a dense one"
    if value.device.type != "cpu":
        return f"{name!r} holds no values (a tensor of the {value.device.type} device)"
    if value.dtype not in WEIGHT_DTYPES:
        return f"{name!r} has dtype {str(value.dtype).removeprefix('torch.')}, expected a floating one (bfloat16, " \
               f"float16, float32 or float64)"
    return None


def storage_problem(name: str, value: Tensor) -> str | None:
    """Why a tensor's storage does not hold each of its elements once, or None: a view whose strides make elements
    overlap (a zero stride: one value broadcast; a stride shorter than the span below it) or reach past its storage.
    Read from its sizes and strides alone, before anything computes on it (the finiteness check makes a tensor of
    its shape)."""
    reach = 1  # elements spanned by the dimensions of smaller stride
    for stride, size in sorted((st, sz) for st, sz in zip(value.stride(), value.shape) if sz > 1):
        if stride < reach:
            return f"{name!r} has shape {tuple(value.shape)} and strides {tuple(value.stride())}: a view whose " \
                   f"{value.numel():,} elements overlap in a storage of {value.untyped_storage().nbytes():,} bytes " \
                   f"(stride {stride}{': one value broadcast' if stride == 0 else ''}); save it with .contiguous()"
        reach = stride * size
    end = (value.storage_offset() + sum((sz - 1) * st for sz, st in zip(value.shape, value.stride())) + 1) \
        * value.element_size() if value.numel() else 0
    if end > value.untyped_storage().nbytes():
        return f"{name!r} reaches past its storage ({end:,} bytes of {value.untyped_storage().nbytes():,})"
    return None


def nonfinite_problem(name: str, value: Tensor) -> str | None:
    bad = int(value.numel() - torch.isfinite(value).sum())
    if bad:
        return f"{name!r} holds {bad:,} non-finite value(s) (NaN or inf)"
    largest = float(value.abs().max()) if value.numel() else 0.0
    if largest > MAX_WEIGHT:
        return f"{name!r} holds a weight of magnitude {largest:.3g}, over {MAX_WEIGHT:.3g} (2**64): the forward " \
               f"would overflow"
    return None


def scale_problem(name: str, value: Tensor) -> str | None:
    """Why a value stored under an FP8 scale's name (FP8_SCALES) is not one, or None: the down-projection's weight
    is divided by its scale and its product multiplied by it, so 0 divides by zero and a negative one flips a sign (a
    weight scale of 0 resumed and ended at 8.7606 instead of 8.7249, exit 0). Finiteness is nonfinite_problem's."""
    if name.rpartition(".")[2] in FP8_SCALES and value.numel() and not bool((value > 0).all()):
        return f"{name!r} holds {float(value.min()):g}, not an FP8 scale (a positive number: record #89's " \
               f"down-projection divides its weight by it)"
    return None


def extra_state_problem(name: str, value, like) -> str | None:
    """A module's extra state (the rotary's window and attention scale): the keys the model's has, each a positive
    finite number of the same kind."""
    if type(value) is not type(like) or not isinstance(like, dict) or value.keys() != like.keys():
        return f"{name!r} is not the model's {type(like).__name__} of {', '.join(map(str, like))}"
    for key, number in value.items():
        if type(number) is not type(like[key]) or not 0 < number < math.inf:
            return f"{name!r} holds {key}={number!r}, expected a positive finite {type(like[key]).__name__}"
    return None


def check_weights(state, expected: dict) -> dict:
    """`state` once it is the model whose state dict (on the meta device) is `expected`, with the checks the block
    above lists; else a WeightsError naming the first key that is wrong and how many more are."""
    if not isinstance(state, dict):
        raise WeightsError(f"not a state dict but a {type(state).__name__}")
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        more = f"; and {len(odd) - 1} more such key(s)" if len(odd) > 1 else ""
        raise WeightsError(f"key {odd[0]!r} ({type(odd[0]).__name__}) is not a parameter name (the keys of a state "
                           f"dict are strings){more}")

    def refuse_first(problems: list[str | None]):
        problems = [p for p in problems if p is not None]
        if problems:
            more = f"; and {len(problems) - 1} more key(s) wrong" if len(problems) > 1 else ""
            raise WeightsError(problems[0] + more)

    refuse_first([tensor_problem(k, v) if isinstance(expected[k], Tensor) else extra_state_problem(k, v, expected[k])
                  for k, v in state.items() if k in expected])
    mismatch = state_dict_mismatch(state, expected)  # names and shapes
    if mismatch:
        raise WeightsError(mismatch)
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    refuse_first([storage_problem(k, v) for k, v in tensors.items()])  # from strides: before any value is read
    refuse_first([nonfinite_problem(k, v) for k, v in tensors.items()])  # reads every value: finite and within
    # MAX_WEIGHT
    return state


def check_run_state(state, expected: dict) -> dict:
    """check_weights, and then what a resumed run continues with: the FP8 scales among them positive (scale_problem).
    (--init_from starts them over, and sample.py's evaluation does not read them.)"""
    problems = [p for k, v in check_weights(state, expected).items() if (p := scale_problem(k, v)) is not None]
    if problems:
        more = f"; and {len(problems) - 1} more scale(s) wrong" if len(problems) > 1 else ""
        raise WeightsError(problems[0] + more)
    return state


def size_text(nbytes: int) -> str:
    """A size in GiB, or in MiB below a tenth of one (a small file is not "0.0 GiB")."""
    return f"{nbytes / 2 ** 30:,.1f} GiB" if nbytes >= 2 ** 30 / 10 else f"{nbytes / 2 ** 20:,.1f} MiB"


def check_fits_host(expected: dict, loaded_bytes: int, on_disk: int | None = None):
    """The model of `expected` built on the host and loaded_bytes beside it (what a file holds once loaded) must fit
    the host's memory: a config describing a larger model was built, and failed in an allocation traceback, before
    its model.pt was read. on_disk: the file's size, said where its entries inflate past it."""
    model = tensor_bytes(v for v in expected.values() if isinstance(v, Tensor))
    have = device_memory_bytes(torch.device("cpu"))
    if model + loaded_bytes > have:
        inflated = f" once loaded ({size_text(on_disk)} on disk: its entries are compressed)" \
            if on_disk is not None and loaded_bytes > on_disk else ""
        raise WeightsError(f"the model takes {size_text(model)} and the file {size_text(loaded_bytes)} of host memory"
                           f"{inflated}, more than this machine's {size_text(have)}")


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6
# The legacy format (a pickle) starts with torch's magic number, pickled (LONG1 of 10 bytes) after the protocol and,
# from protocol 4, a frame header.
LEGACY_MAGIC = b"\x8a\x0a" + torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")


def archive_bytes(f) -> int:
    """What a torch.save file (a file object, at its start) holds once loaded: the sum of its zip entries'
    uncompressed sizes, from the archive's directory, without inflating or unpickling anything. Refuses, in words,
    a file that is not such an archive (torch.load's own message for a text file is `(101)`) and torch's legacy
    format, a pickle whose sizes are known only as it is loaded."""
    head = f.read(32)
    f.seek(0)
    if not head:
        raise WeightsError("not a PyTorch file (it is empty)")
    if not head.startswith(ZIP_MAGIC):
        if head.startswith(b"\x80") and LEGACY_MAGIC in head:
            raise WeightsError("a PyTorch file of the legacy format (before PyTorch 1.6), whose sizes are known only "
                               "as it is loaded: load and save it again with torch.save")
        raise WeightsError("not a PyTorch file (neither a zip archive, torch.save's format, nor its legacy pickle)")
    try:
        with zipfile.ZipFile(f) as archive:  # (a file object passed in stays open)
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):  # most often a copy cut short: its directory is at
        # the end
        raise WeightsError("a truncated or damaged zip archive, not a complete PyTorch file; copy it again") from None
    finally:
        f.seek(0)
    if not any(entry.filename.split("/")[-1] == "data.pkl" for entry in entries):
        raise WeightsError("not a PyTorch file (a zip archive without data.pkl)")
    return sum(entry.file_size for entry in entries)


def load_weights(source, expected: dict | None = None, held_bytes: int = 0, weights_only: bool = True) -> object:
    """A weights file, a path (opened with open_regular) or a file object (a checkpoint's bytes, read and hashed),
    loaded to the CPU: first its archive checked and what it holds once loaded, with held_bytes already in memory
    beside it and the model of `expected`, fitted to the host's memory (check_fits_host); then torch.load, by
    torch's safe loader unless weights_only=False (tools/record_weights.py --trust): tensors and plain
    containers, never code. torch's warnings (sparse layouts, old formats) are not passed on. Raises WeightsError
    (FileRefused for a path that is no regular file), one line that the caller prefixes with the file's name."""
    with contextlib.ExitStack() as stack:
        f = source if hasattr(source, "read") else stack.enter_context(open_regular(source, "a weights file (.pt)"))
        on_disk = f.seek(0, os.SEEK_END)
        f.seek(0)
        check_fits_host(expected or {}, held_bytes + archive_bytes(f), on_disk)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(f, map_location="cpu", weights_only=weights_only)
        except Exception as e:
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            if isinstance(e, pickle.UnpicklingError) and refused:
                raise UnsafeObject(refused[1]) from None
            why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))  # the cause, below torch's paragraph
            raise WeightsError(f"cannot load it safely ({why[1] if why else first_line(e)})") from None


class UnsafeObject(WeightsError):
    """A weights file that holds a Python object beside its tensors, which the safe loader refuses to build."""

    def __init__(self, name: str):
        super().__init__(f"the safe loader refused {name}, a Python object beside the tensors")
        self.name = name


def model_state_shapes(args: Hyperparameters) -> dict:
    """The state dict of the model this config builds, on the meta device: its names, shapes and dtypes, no memory."""
    with torch.device("meta"):
        return GPT(args).state_dict()


def final_weights_shapes(args: Hyperparameters) -> dict:
    """model_state_shapes and, for record #92's n-gram table, the whole table (in no state dict: save_final_weights
    adds it)."""
    expected = model_state_shapes(args)
    if args.ngram_channels == 2:
        expected["ngram.weight"] = torch.empty(args.bigram_vocab_size, args.model_dim, device="meta")
    return expected


def read_weights(path: Path, args: Hyperparameters, skip=None) -> dict:
    """A final-weights file of ours, checked against the model of `args` (see the block above); keys for which
    `skip(key)` holds are left out first (--init_from's run state: see init_run_state). Raises WeightsError."""
    expected = {k: v for k, v in final_weights_shapes(args).items() if not (skip and skip(k))}
    state = load_weights(path, expected)
    if isinstance(state, dict) and skip:
        state = {k: v for k, v in state.items() if not (isinstance(k, str) and skip(k))}
    return check_weights(state, expected)


def init_run_state(key: str) -> bool:
    """What --init_from does not take from its weights: the rotary state, which follows this run's schedule, and
    the MLPs' FP8 scales (record #89's down-projections', record #92's FP8_MLP_SAVED), which start over (so final
    weights of any preset start the others)."""
    return key.startswith(("rotary.", "narrow_rotary.")) or ".mlp.down_" in key or key.endswith(tuple(".fp8_" + n for n in FP8_MLP_SAVED))


FINAL_WEIGHTS_FORMAT = "train_gpt.py final weights, version 1"
# Fields added to Hyperparameters since that format, with the value a config.json written before them meant: the
# model such a file's run trained (record #85's bigram table, Adam's own cadence for the embeddings).
ADDED_FIELDS = {"ngram_channels": 1, "embed_adam_period": 0, "embed_adam_period_start": 336, "mlp_full_fp8": False,
                "lm_head_fp8_logits": False}


def save_final_weights(model: GPT, args: Hyperparameters, source: str, run_id: str, step: int,
                       val_loss: float, table: Tensor | None = None) -> Path:
    """checkpoint_dir/<run_id>/final/ (rank 0): model.pt, every weight and the rotary state but no
    optimizer state, and config.json, what rebuilds the model; written like a checkpoint, into a
    temporary folder renamed at the end and removed if a write fails. table: record #92's whole n-gram table
    (gathered_ngram_table; at world size 1 the model's own when not given)."""
    if model.ngram is not None and table is None:
        if model.ngram.world > 1:
            raise ValueError("save_final_weights: gather the sharded n-gram table first (gathered_ngram_table)")
        table = model.ngram.weight
    final = Path(args.checkpoint_dir) / run_id / "final"
    tmp = final.with_name(".final.partial")
    info = {"format": FINAL_WEIGHTS_FORMAT, "config": dataclasses.asdict(args), "step": step, "val_loss": val_loss,
            "windows": list(Schedule(args).windows(args.num_iterations, final_validation=True)),
            "code_sha256": code_hash(source)}
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # nothing was made, so nothing is said to be removed
        raise write_error(final, e) from None
    try:
        try:
            state = model.state_dict()
            if table is not None:
                state["ngram.weight"] = table
            write_file(tmp / "model.pt", state, shown=final / "model.pt")
            write_file(tmp / "config.json", json.dumps(info, indent=1).encode(), shown=final / "config.json")
            publish_folder(tmp, final)
        except OSError as e:
            raise write_error(final, e) from None
    except (TrainingError, FileRefused) as e:
        raise TrainingError(f"{e}; {remove_unfinished(tmp, 'final-weights folder')}") from None
    except BaseException:  # a signal (Ctrl-C) mid-write
        remove_unfinished(tmp)
        raise
    return final


def load_final_weights(path, device: torch.device) -> tuple[GPT, Hyperparameters, dict]:
    """The model saved by save_final_weights, in eval mode on `device`, its config and config.json. The config and
    then model.pt are checked (read_weights) before the model is built."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such folder (train with --save_final=true to write <checkpoint_dir>/<run_id>/final)")
    if not os.path.lexists(path / "config.json") or not os.path.lexists(path / "model.pt"):
        raise DataError(f"{path}: not a final-weights folder of train_gpt.py (it needs config.json and model.pt)")
    try:
        info = read_json(path / "config.json", "train_gpt.py's final-weights config.json", MAX_META_BYTES)
        if info.get("format") != FINAL_WEIGHTS_FORMAT:
            raise ValueError(f"format {info.get('format')!r}")
        names = {f.name for f in dataclasses.fields(Hyperparameters)}
        # Every field a run's config records (run control aside) must be there: a default would
        # silently rebuild another model, e.g. the speedrun's. (A field added since has the value a config
        # without it meant: ADDED_FIELDS.)
        config = {**ADDED_FIELDS, **info["config"]} if isinstance(info["config"], dict) else info["config"]
        missing = [n for n in names if n not in RUN_CONTROL_FIELDS and n not in config]
        if missing:
            raise ValueError(f"\"config\" lacks {', '.join(sorted(missing))}, needed to rebuild the model")
        args = Hyperparameters(**{k: v for k, v in config.items() if k in names})
        validate_config(args)
        windows = info.get("windows")
        if not (isinstance(windows, list) and len(windows) == 2
                and all(type(w) is int and 0 < w <= MAX_POSITIONS for w in windows)):  # type(): a bool is no count
            raise ValueError(f'"windows" must be the final (short, long) windows in blocks (1 to {MAX_POSITIONS:,}), '
                             f'got {windows!r}')
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.why if isinstance(e, FileRefused) else e
        raise DataError(f"{path / 'config.json'}: not train_gpt.py's final-weights config ({why})") from None
    try:
        saved = read_weights(path / "model.pt", args)
    except WeightsError as e:
        raise DataError(f"{path / 'model.pt'}: cannot load these weights into the model of config.json "
                        f"({first_line(e)})") from None
    model = cast_parameters(GPT(args, Numerics.for_evaluation(device)).to(device))
    model.load_state_dict(saved)
    return model.eval(), args, info


@torch.no_grad()
def check_forward_finite(model: GPT, args: Hyperparameters, windows: tuple[int, int]) -> str | None:
    """Why the model's logits on a probe document (BOS, then PROBE_TOKENS - 1 ids spread over the vocabulary) are not
    all finite, naming the largest weight; None when they are. Weights within MAX_WEIGHT can still overflow: they
    multiply, layer after layer. sample.py, which checks this after load_final_weights, failed in multinomial then,
    or printed token 0 ("!") at temperature 0."""
    length = min(PROBE_TOKENS, context_length(args))
    ids = torch.arange(length, device=model.embed.weight.device) * 7919 % args.vocab_size  # 7919: a prime, ids apart
    if BOS_ID < args.vocab_size:  # (a test's small vocabulary has no <|endoftext|>)
        ids[0] = BOS_ID
    masks = build_masks(ids, model.plans, windows, args.window_block, use_flex=False)
    if bool(torch.isfinite(model.logits(model.hidden(ids, masks))).all()):
        return None
    name, value = max(((n, float(t.abs().max())) for n, t in model.state_dict().items()
                       if isinstance(t, Tensor) and t.numel()), key=lambda pair: pair[1])
    return f"a forward pass on a probe document gives non-finite logits: they overflow (the largest weight is " \
           f"{value:.3g}, in {name!r})"


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


MAX_POINTER_BYTES = 4096  # a `latest` pointer holds a folder's name, step_NNNNNN: more is not one a run wrote


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
        name = read_regular(pointer, "a `latest` pointer", MAX_POINTER_BYTES).decode("ascii").strip()
    except (FileRefused, UnicodeDecodeError) as e:
        why = e.why if isinstance(e, FileRefused) else "not text"
        raise TrainingError(f"{damaged} ({why}){remedy}") from None
    if not re.fullmatch(r"step_\d{6,}", name):  # what save_checkpoint writes
        raise TrainingError(f"{damaged} (it should name a checkpoint folder beside it, e.g. step_000100, "
                            f"not {name[:40]!r}){remedy}")
    if not (pointer.parent / name).is_dir():
        raise TrainingError(f"{damaged}: it names {pointer.parent / name}, which does not exist{remedy}")
    return pointer.parent / name


# meta.json is read once, by read_checkpoint_meta, into a CheckpointMeta whose every field has its type and range
# checked: no hash covers meta.json, so its numbers and names are anyone's (a train time of 1e308 ms resumed and was
# logged as a 309-digit time). The loader's positions are checked against this run's shards (check_resume_shards).
MAX_META_BYTES = 64 * 2 ** 20  # far above a meta.json of thousands of shards and ranks: more is not one we wrote
MAX_COUNT = 2 ** 63 - 1  # steps, sizes, world sizes: what an int64 holds
MAX_TRAIN_TIME_MS = 365 * 24 * 3600 * 1000  # a year of timed training: more is an edit, not a run
MAX_PATH_CHARS = 4096  # PATH_MAX: a shard's recorded name, which a refusal quotes
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
OLDER = "(edited, or written by an older train_gpt.py?)"


class FileRecord(NamedTuple):
    bytes: int
    sha256: str


class ShardRecord(NamedTuple):
    file: str  # as the saving run named it: shown, never opened
    bytes: int
    fingerprint: str  # shard_fingerprint's


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    train_time_ms: float
    world_size: int
    loader: dict  # the loader's state_dict (packing checked here; positions in check_resume_shards)
    config: dict  # setting name -> a JSON scalar, as config_for_checkpoint wrote it
    code_sha256: str
    shards: tuple[ShardRecord, ...]
    files: dict[str, FileRecord]


class MetaError(ValueError):
    """A field of meta.json that save_checkpoint would not have written; the message names it."""


def brief(value) -> str:
    """repr(value), cut where it is long: a refusal quotes a bad value, not 4,000 digits of it."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


def meta_field(meta: dict, key: str, kind):
    """meta[key] of a JSON type in kind (a bool is never a number here)."""
    value = meta.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MetaError(f"meta.json has no valid {key!r} {OLDER}")
    return value


def meta_count(meta: dict, key: str, least: int) -> int:
    value = meta_field(meta, key, int)
    if not least <= value <= MAX_COUNT:
        raise MetaError(f"meta.json's {key} is {brief(value)}, not one a run saves (edited?)")
    return value


def parse_checkpoint_meta(meta) -> CheckpointMeta:
    """meta.json's parsed JSON as a CheckpointMeta, or a MetaError naming the first field that is wrong."""
    if not isinstance(meta, dict):
        raise MetaError(f"meta.json is not a checkpoint's (a JSON {type(meta).__name__}, not an object)")
    step, world_size = meta_count(meta, "step", 0), meta_count(meta, "world_size", 1)
    train_time_ms = meta_field(meta, "train_time_ms", (int, float))
    if not 0 <= train_time_ms <= MAX_TRAIN_TIME_MS:  # NaN fails too; an int of any size compares exactly
        raise MetaError(f"meta.json's train_time_ms is {brief(train_time_ms)}, not a time (a finite number of ms, 0 "
                        f"or more, at most {MAX_TRAIN_TIME_MS:,}: a year; edited?)")
    loader = meta_field(meta, "loader", dict)
    packing = loader.get("packing", [])
    if not (isinstance(packing, list) and all(isinstance(p, str) and p in SHARD_PACKINGS for p in packing)):
        raise MetaError(f"meta.json has no valid 'loader' (its packing is not a list of "
                        f"{' or '.join(SHARD_PACKINGS)}) {OLDER}")
    config = meta_field(meta, "config", dict)
    if not all(k.isidentifier() and len(k) <= 100 and isinstance(v, (str, int, float, type(None)))
               for k, v in config.items()):
        raise MetaError(f"meta.json has no valid 'config' (settings map names to values) {OLDER}")
    code = meta_field(meta, "code_sha256", str)
    if not SHA256_PATTERN.fullmatch(code):
        raise MetaError(f"meta.json has no valid 'code_sha256' (a sha256 in hex) {OLDER}")
    shards = []
    for shard in meta_field(meta, "shards", list):
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                and 0 < len(shard["file"]) <= MAX_PATH_CHARS and type(shard.get("bytes")) is int
                and 0 <= shard["bytes"] <= MAX_COUNT and isinstance(shard.get("fingerprint"), str)
                and SHA256_PATTERN.fullmatch(shard["fingerprint"])):
            raise MetaError(f"meta.json has no valid 'shards' {OLDER}")
        shards.append(ShardRecord(shard["file"], shard["bytes"], shard["fingerprint"]))
    files = {}
    for name, listed in meta_field(meta, "files", dict).items():
        if not (isinstance(listed, dict) and type(listed.get("bytes")) is int and 0 <= listed["bytes"] <= MAX_COUNT
                and isinstance(listed.get("sha256"), str) and SHA256_PATTERN.fullmatch(listed["sha256"])):
            raise MetaError(f"meta.json has no valid 'files' (each with its size and sha256) {OLDER}")
        files[name] = FileRecord(listed["bytes"], listed["sha256"])
    return CheckpointMeta(step, float(train_time_ms), world_size, loader, config, code, tuple(shards), files)


def read_checkpoint_meta(path: Path) -> CheckpointMeta:
    """The checkpoint folder path's meta.json (parse_checkpoint_meta); a TrainingError names what is wrong."""
    meta_path = path / "meta.json"
    if not os.path.lexists(meta_path):
        raise TrainingError(f"--resume={path}: not a complete checkpoint (no meta.json)")
    try:
        return parse_checkpoint_meta(read_json(meta_path, "a train_gpt.py checkpoint's meta.json", MAX_META_BYTES))
    except MetaError as e:
        raise TrainingError(f"--resume={path}: {e}") from None
    except FileRefused as e:
        raise TrainingError(f"--resume={path}: unreadable meta.json ({e.why})") from None


@dataclass
class Resume:
    """A checked checkpoint: its meta.json, and this rank's files, loaded to the CPU."""
    path: Path
    meta: CheckpointMeta
    model_state: dict
    rank_state: dict


def read_checkpoint_file(path: Path, name: str, meta: CheckpointMeta, expected: dict):
    """One of a checkpoint's files, checked against the size and sha256 meta.json recorded for it, then loaded
    with weights_only (a checkpoint can hold tensors and plain containers, never code). It is read once, through
    the one reader: a regular file (a FIFO blocked the resume forever, a link to /dev/zero was read until memory ran
    out), of the size listed, which with the model of `expected` must fit the host before it is read; then its
    archive is bounded by what it holds once loaded (load_weights)."""
    listed = meta.files.get(name)
    if listed is None:
        raise TrainingError(f"--resume={path}: meta.json does not list {name} with its size and sha256")
    try:
        check_fits_host(expected, listed.bytes)
        with open_regular(path / name, "a checkpoint's file") as f:
            size = os.fstat(f.fileno()).st_size
            if size != listed.bytes:
                raise TrainingError(f"--resume={path}: {name} has {size} bytes, meta.json recorded {listed.bytes} "
                                    f"(truncated, or not this checkpoint's file)")
            data = f.read(listed.bytes + 1)
    except FileRefused as e:
        raise TrainingError(f"--resume={path}: {name}: {e.why}") from None
    except WeightsError as e:
        raise TrainingError(f"--resume={path}: {name}: {e}") from None
    except OSError as e:
        raise TrainingError(f"--resume={path}: cannot read {name} ({e.strerror})") from None
    if len(data) != listed.bytes:  # changed since its size was read
        raise TrainingError(f"--resume={path}: {name} has {len(data)} bytes, meta.json recorded {listed.bytes} "
                            f"(truncated, or not this checkpoint's file)")
    if hashlib.sha256(data).hexdigest() != listed.sha256:
        raise TrainingError(f"--resume={path}: {name} is not the file saved with this meta.json (its sha256 differs)")
    try:
        return load_weights(io.BytesIO(data), expected, held_bytes=len(data))
    except WeightsError as e:
        raise TrainingError(f"--resume={path}: {name}: {e}") from None


def comparable_config(saved: dict, args: Hyperparameters) -> dict:
    """A checkpoint's config (or this run's) as the two are compared: every setting as a run settles it, so that
    two spellings of one setting are equal. --micro_batches in its canonical spelling (older checkpoints may hold
    "4,4,4" for "4"); --device and --attention as resolved on this run's device (setup_distributed settles them;
    older checkpoints hold "auto", which resolves here as it would have in this run); --lm_head_precision and
    --mlp_precision as resolve_precision settles auto on this run's device (fp32 on a CPU: a resume that spelled
    that out was refused); --packing left to check_resume_shards, which compares what it resolved to for each
    shard (auto on a shard of documents is documents); the list flags as their values (list_value: "1>1" is "1"; a
    spelling this grammar refuses stays text, and differs)."""
    saved = {k: v for k, v in saved.items() if k != "packing"}
    for name in LIST_FLAGS:
        if isinstance(saved.get(name), str):
            with contextlib.suppress(ConfigError):
                saved[name] = list_value(name, saved[name])
    if isinstance(saved.get("micro_batches"), (str, int)):
        with contextlib.suppress(ConfigError):
            saved["micro_batches"] = canonical_micro_batches(dataclasses.replace(args, micro_batches=str(
                saved["micro_batches"])))
    here = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if saved.get("device") == "auto":
        saved["device"] = here
    if saved.get("attention") == "auto":
        saved["attention"] = "flex" if saved.get("device", here) == "cuda" else "sdpa"
    for flag in ("lm_head_precision", "mlp_precision"):
        if saved.get(flag) == "auto":  # by this run's widths: where the checkpoint's differ, they differ too
            saved[flag] = resolve_precision(dataclasses.replace(args, **{flag: "auto"}), torch.device(here), flag)
    return saved


def check_checkpoint(path: Path, args: Hyperparameters, env: DistEnv, source: str) -> Resume:
    """Everything about a checkpoint that can be wrong, checked before the run creates anything:
    meta.json's shape; that the checkpoint belongs to this run (world size, config, code); that
    meta.json describes the files beside it (their sizes and sha256, and the step this rank's
    optimizer file was saved at); and the run state the weights carry: model.pt's and this rank's FP8 scales,
    exactly the model's keys and shapes, finite and positive (check_run_state)."""
    meta = read_checkpoint_meta(path)  # before the log exists: every field in range
    if meta.world_size != env.world_size:
        raise TrainingError(f"--resume={path}: written at world size {meta.world_size}, this run has "
                            f"{env.world_size}; DistAdam and NorMuon state are sharded per rank, so resume with "
                            f"{meta.world_size} ranks")
    if not args.force_resume:
        ours, theirs = comparable_config(config_for_checkpoint(args), args), comparable_config(meta.config, args)
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            raise TrainingError(f"--resume={path}: config differs in {', '.join(differ)} "
                                f"(use --force_resume=true to resume anyway)")
        if meta.code_sha256 != code_hash(source):
            raise TrainingError(f"--resume={path}: written by a different train_gpt.py "
                                f"(use --force_resume=true to resume anyway)")
    expected = model_state_shapes(args)
    model_state = read_checkpoint_file(path, "model.pt", meta, expected)
    try:
        model_state = check_run_state(model_state, expected)
    except WeightsError as e:
        forced = "; --force_resume cannot change the architecture" if args.force_resume else ""
        raise TrainingError(f"--resume={path}: its model.pt does not fit the model this config builds ({e}){forced}") \
            from None
    rank_state = read_checkpoint_file(path, f"rank_{env.rank}.pt", meta, expected)  # beside the model it fills
    saved_at = rank_state.get("step") if isinstance(rank_state, dict) else None
    if saved_at != meta.step:
        raise TrainingError(f"--resume={path}: meta.json says step {meta.step}, but rank_{env.rank}.pt was "
                            f"saved at step {brief(saved_at)}")
    own = {k: v for k, v in expected.items() if is_rank_buffer(k)}
    if args.ngram_channels == 2:  # this rank's shard of record #92's n-gram table (in no state dict)
        own["ngram.weight"] = torch.empty(args.bigram_vocab_size // env.world_size, args.model_dim, device="meta")
    try:  # this rank's FP8 activation scales, which replace model.pt's (rank 0's): checked as model.pt's are
        check_run_state(rank_state.get("rank_buffers", {}), own)
    except WeightsError as e:
        raise TrainingError(f"--resume={path}: its rank_{env.rank}.pt's activation scales do not fit the model this "
                            f"config builds ({e})") from None
    if meta.step > args.num_iterations or (args.force_resume and meta.step == args.num_iterations):
        # (unforced, num_iterations matched: the same run's last checkpoint runs only its final validation)
        raise TrainingError(f"--resume={path}: the checkpoint is at step {meta.step}, at or past "
                            f"--num_iterations={args.num_iterations}: nothing is left to train (a longer run needs a "
                            f"larger --num_iterations)")
    return Resume(path, meta, model_state, rank_state)


def check_resume_shards(resume: Resume, loader, args: Hyperparameters):
    """The training shards this run reads must be the ones the checkpoint's run read, where both read them
    (in order, by size and fingerprint; a folder moved elsewhere is the same data): other data would not
    continue that run. --force_resume=true goes on anyway, from the same shard index and position. The
    candidate streams' offsets (record #92's sampled softmax) must be positions in the vocabulary."""
    recorded = resume.meta.shards
    scans = getattr(loader, "scans", [])
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and "candidate_offsets" in resume.meta.loader:
        problem = sampler.offsets_problem(resume.meta.loader["candidate_offsets"])
        if problem:
            raise TrainingError(f"--resume={resume.path}: meta.json's loader: {problem} (edited?)")
    if bool(recorded) != bool(scans):
        raise TrainingError(f"--resume={resume.path}: the checkpoint was trained on "
                            f"{'shards' if recorded else 'synthetic tokens'}, this run reads "
                            f"{'shards' if scans else 'synthetic tokens'}")
    state = resume.meta.loader
    if not scans:  # synthetic tokens: the position is a count of batches drawn
        if type(state.get("step", 0)) is not int or not 0 <= state.get("step", 0) <= MAX_COUNT:
            raise TrainingError(f"--resume={resume.path}: meta.json's loader step is {brief(state.get('step'))}, not "
                                f"a count of batches (edited?)")
        return
    try:  # a resume that would read the position with another meaning, before anything is written
        loader.check_packing(state)
    except DataError as e:
        raise TrainingError(f"--resume={resume.path}: {e}") from None
    position = state.get("file_index")
    if type(position) is not int or not 0 <= position < len(scans):
        raise TrainingError(f"--resume={resume.path}: the checkpoint stopped in training shard {brief(position)}, but "
                            f"--train_files={args.train_files} gives this run {len(scans)} shard(s)")
    # the next piece (documents) or token (stream) of that shard: at most its end, where the next shard starts.
    # (-1 or 1.9 once resumed elsewhere in the data without a word, a position past the end in an IndexError.)
    scan, piece = scans[position], state.get("piece")
    end = len(scan.starts) if scan.packing == "documents" else scan.num_tokens
    if type(piece) is not int or not 0 <= piece <= end:
        unit = "pieces (documents)" if scan.packing == "documents" else "tokens"
        raise TrainingError(f"--resume={resume.path}: meta.json puts the loader at {brief(piece)} in training shard "
                            f"{position + 1}, {scan.path}, which has {end:,} {unit}: not a position in it (edited, or "
                            f"another shard?)")
    if args.force_resume:
        return
    for i, (saved, scan, fingerprint) in enumerate(zip(recorded, scans, loader.fingerprints)):
        size = SHARD_HEADER_BYTES + 2 * scan.num_tokens
        if saved.bytes != size or saved.fingerprint != fingerprint:
            other = ", another fingerprint" if saved.bytes == size else ""
            raise TrainingError(f"--resume={resume.path}: training shard {i + 1}, {scan.path} ({size:,} bytes), is "
                                f"not the one the checkpoint's run read ({saved.file}, {saved.bytes:,} bytes"
                                f"{other}); use --force_resume=true to go on with these shards anyway")


def is_rank_buffer(name: str) -> bool:
    """Whether a model's buffer differs between ranks: the down-projections' activation scales (record #89: from
    each rank's own forwards; model.pt holds rank 0's too), record #92's FP8 MLPs' scales of relu^2's output and
    of its gradient (FP8_MLP_PER_RANK: from each rank's own passes; model.pt holds rank 0's too) and the shard of
    record #92's n-gram table (in no state dict). rank_R.pt holds each rank's own."""
    return name.endswith((".down_act_scale", *(".fp8_" + n for n in FP8_MLP_PER_RANK))) or name == "ngram.weight"


def rank_buffers(model: GPT) -> dict[str, Tensor]:
    """The model's state that differs between ranks (is_rank_buffer)."""
    return {name: t for name, t in model.named_buffers() if is_rank_buffer(name)}


def host_copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Copies on the host: a table shard copied on its device would need as much free memory again."""
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


def load_checkpoint(resume: Resume, model: GPT, optimizers, loader, env: DistEnv,
                    extra_state: dict | None = None) -> tuple[int, float]:
    try:
        model.load_state_dict(resume.model_state)
        own, saved = rank_buffers(model), resume.rank_state.get("rank_buffers", {})
        if set(saved) != set(own):
            what = "activation scales" + (" and n-gram table shard" if "ngram.weight" in own else "")
            raise ValueError(f"rank {env.rank}'s {what}: the checkpoint holds {len(saved)}, the model {len(own)}")
        for name, t in own.items():
            t.copy_(saved[name])
        for opt, state in zip(optimizers, resume.rank_state["optimizers"], strict=True):
            opt.load_state_dict(state)
        saved_extra = resume.rank_state.get("extra_state", {})
        for name, part in (extra_state or {}).items():
            if name in saved_extra:
                part.load_state_dict(saved_extra[name])
            elif not part.empty_at(resume.meta.step):  # (state that is empty at that step needs no saving)
                raise ValueError(f"no saved {name} state at step {resume.meta.step}")
        loader.load_state_dict(resume.meta.loader)
        torch.set_rng_state(resume.rank_state["cpu_rng"].cpu())
        if env.device.type == "cuda" and resume.rank_state["cuda_rng"].numel():
            torch.cuda.set_rng_state(resume.rank_state["cuda_rng"].cpu())
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise TrainingError(f"--resume={resume.path}: the checkpoint does not fit this run "
                            f"({first_line(e)})") from None
    return resume.meta.step, resume.meta.train_time_ms


# -----------------------------------------------------------------------------
# Logging: the log file starts with this file's source, then versions, hardware and config

def visible(text: str) -> str:
    """text with each character that is not printable (escape sequences, line breaks, bidi marks) written as a
    Python string literal writes it (`\\x1b`, `\\n`). Every line the trainer logs or prints passes through it
    (Logger, console_line, report_error), because lines quote what others wrote: file and folder names, meta.json's
    fields (a shard name in a shared checkpoint once cleared the screen and printed a green "OK"), flags. Printable
    text, any script's, is left as it is; so is a line already shown through it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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

    def __call__(self, line: str = "", console: bool = True, verbatim: bool = False):
        """One line, through visible(): outside text in it cannot start a line of its own, in the log or on the
        terminal. verbatim: a block of our own lines, kept as it is (the source, nvidia-smi's table)."""
        if self.fd is None:
            return
        data = ((line if verbatim else visible(line)) + "\n").encode("utf-8", "backslashreplace")
        try:
            write_all(self.fd, data)
        except OSError as e:
            with contextlib.suppress(OSError):  # no half line: the log keeps every complete one
                os.ftruncate(self.fd, self.size)
                os.lseek(self.fd, self.size, os.SEEK_SET)
            raise write_error(self.path, e) from None
        self.size += len(data)
        if console:
            console_line(line)

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


# What each preset's algorithm is (the log header's recipe line); the smoke preset is the speedrun's scaled down.
RECIPES = {
    "speedrun": "record #92 (modded-nanogpt 2026-09-28, ANVIL2: record #89 with a sampled-softmax training loss, a "
                "hashed n-gram table, the ANVIL optimizer and its terminal ships, FP8 in the MLP's backward and "
                "mixed-width attention)",
    "record89": "record #89 (modded-nanogpt 2026-07-17, FP8 down-projection, as merged upstream: record #85 v3 with "
                "#88's prefix-token loss and #89's FP8 down-projection)",
    "record85": "record #85 v3 (modded-nanogpt, 2026-05-27, MUDD gates and lightweight DC)",
}
RECORD_PRESETS = tuple(RECIPES)


def log_header(run: Run, model: GPT):
    args, env, log = run.args, run.env, run.log
    log(run.source, console=False, verbatim=True)
    log("=" * 100, console=False)
    log(f"Running Python {sys.version}")
    log(f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda or 'none'}")
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.machine()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    log(f"device: {env.device.type} ({device_name})  world_size: {env.world_size}  "
        f"backend: {dist.get_backend() if distributed() else 'none'}  date: {now}")
    attention_kind = resolve_attention(args, env.device)
    precisions = {"lm_head": model.numerics.head, "mlp": model.numerics.mlp}
    for name, flag in (("lm_head", "lm_head_precision"), ("mlp", "mlp_precision")):
        if precisions[name] == "bf16" and getattr(args, flag) == "auto" and not fp8_fits(args):
            precisions[name] += " (fp8 needs --model_dim and every micro-batch to be multiples of 16)"
        elif precisions[name] == "bf16" and getattr(args, flag) == "auto":
            precisions[name] += " (this GPU has no FP8 tensor cores)"
    compiled = "per layer" if args.compile else ("FlexAttention only" if attention_kind == "flex" else "off")
    down_fp8 = any(block.mlp.down_fp8 for block in model.blocks if block.mlp is not None)
    down = "fp8 (delayed scaling)" if down_fp8 else PRECISION_NAMES[model.numerics.compute]
    if any(block.mlp is not None and block.mlp.full_fp8 for block in model.blocks):
        precisions["mlp"] += " (record #92: forward and backward, static and delayed scaling)"
        down = "fp8 (record #92: forward and backward, delayed scaling)"
    if model.numerics.head == "fp8" and model.head_scales.record == 92:
        precisions["lm_head"] += " (record #92: e4m3 logits, fp16 squashed, its scales)"
    log(f"attention: {attention_kind}  lm_head: {precisions['lm_head']}  mlp up-projection: {precisions['mlp']}  "
        f"mlp down-projection: {down}  compile: {compiled}")
    log(f"matrix optimizer: {MATRIX_OPTIMIZERS[args.matrix_optimizer]}")
    log(f"recipe: {RECIPES.get(args.preset, RECIPES['speedrun'])}: {args.num_iterations} steps in "
        f"{len(run.schedule.stages) - 1} stages and an extension", console=False)
    if run.schedule.sampled:
        log(f"training loss: sampled softmax (record #92) over --stage_softmax_candidates="
            f"{args.stage_softmax_candidates} candidate classes a stage (0: the whole vocabulary); validation over "
            f"the whole vocabulary")
    if model.ngram is not None:
        rows = args.bigram_vocab_size
        same = rows == NGRAM_RECORD_ROWS
        size = ("record #92's size" if same else
                f"NOT record #92's {NGRAM_RECORD_ROWS:,} rows (--bigram_vocab_size={rows}): a departure from the record")
        log(f"n-gram table: {rows:,} rows x {args.model_dim} (bigram and trigram channels), {rows // env.world_size:,} "
            f"a rank: {size}")
    if args.tail_ships:
        log("terminal ships (record #92): tail EMA of embed and lm_head, tail averages of V/O, the MLPs and the value "
            "embeddings, the bank blend, each bank renormed; after the last step, on the clock")
    smi = nvidia_smi()
    if smi:
        log(smi, console=False, verbatim=True)
    if args.preset not in RECORD_PRESETS:
        log(f"note: {args.preset} preset (small model, not the record configuration) - NOT a record run")
    log("hyperparameters:", console=False)
    for name, value in dataclasses.asdict(args).items():
        log(f"  {name} = {value}", console=False)
    log(f"code_sha256: {code_hash(run.source)}")
    log(f"run_id: {run.run_id}")
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


def read_init_weights(args: Hyperparameters) -> dict:
    """--init_from's weights, checked against the model this config builds (read_weights) before the run creates
    anything, without the run state of init_run_state."""
    path = Path(args.init_from)
    if not os.path.lexists(path / "model.pt"):
        raise DataError(f"--init_from={path}: not a final-weights folder (no model.pt; train with "
                        f"--save_final=true, or convert the record's weights with tools/record_weights.py)")
    try:
        return read_weights(path / "model.pt", args, skip=init_run_state)
    except FileRefused as e:
        raise DataError(f"--init_from={path}: {e}") from None
    except WeightsError as e:
        raise DataError(f"--init_from={path}: its weights do not fit this config's model ({first_line(e)})") from None


def build_model(args: Hyperparameters, env: DistEnv, init_state: dict | None = None) -> GPT:
    """Built and cast on the host, then moved to the device in one go (tools/preflight.py moves it to a
    fake H100 there); init_state (--init_from) replaces the initial weights. The precisions are the run's
    (setup_distributed resolved them), or resolved here for an env built by hand (tools, tests)."""
    torch.manual_seed(args.seed)
    model = GPT(args, env.numerics or resolve_numerics(args, env.device), table_shard=(env.rank, env.world_size))
    if init_state is not None:
        model.load_state_dict(init_state, strict=False)
    model = cast_parameters(model).to(env.device)
    if env.world_size > 1:  # identical weights on every rank whatever the device's RNG does
        for t in [*model.parameters(), model.bigram_signs]:
            dist.broadcast(t.data, src=0)
    refresh_fp8(model, "exact")  # of the cast weights (record #89's scales of its bf16 weights)
    return model


def check_finite(value: float, what: str, step: int):
    if not math.isfinite(value):
        raise TrainingError(f"non-finite {what} ({value}) at step {step}: stopping the run")


def train(args: Hyperparameters, env: DistEnv):
    source = Path(__file__).read_text(encoding="utf-8")
    run_id = args.run_id or f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:8]}"
    check_world_size(args, env.world_size)
    # Each rank chose its --micro_batches=auto counts from its own device's memory: different GPUs would train
    # different micro-batches and wait for each other's collectives until the timeout.
    if not same_on_every_rank(args.micro_batches, env.device):
        raise ConfigError(f"--micro_batches: rank {env.rank} trains {args.micro_batches} micro-batches a step and "
                          f"another rank other counts (auto chooses from each device's memory); give the counts "
                          f"explicitly")

    # Every input check (data, checkpoint, run id) runs before anything is created, so bad input leaves
    # no log and no folder behind and takes no run id. All ranks agree on the outcome before the log is
    # created and again after, so one rank's error never leaves the others waiting in a collective.
    log, error, resume, made = Logger(None), None, None, []
    log_path = Path(args.logs_dir) / f"{run_id}.txt"
    run_dir = Path(args.checkpoint_dir) / run_id
    schedule = Schedule(args)  # the run's one schedule: the loader and the training loop follow it
    try:
        loader = SyntheticLoader(args, env, schedule) if args.synthetic else TrainLoader(args, env, schedule)
        val_tokens = (torch.randint(0, BOS_ID, (args.val_tokens + 1,), generator=torch.Generator().manual_seed(0))
                      if args.synthetic else load_val_tokens(args))
        if args.resume:
            resume = check_checkpoint(resolve_checkpoint(args.resume, args), args, env, source)
        init_state = read_init_weights(args) if args.init_from and not args.resume else None
        if schedule.prefix_term:  # the model's prefix-token table, from a bundled file: read before anything is made
            prefix_token_table(padded_vocab(args.vocab_size))
        if args.init_from and args.resume and not os.path.lexists(Path(args.init_from) / "model.pt"):
            raise DataError(f"--init_from={args.init_from}: not a final-weights folder (no model.pt); a resumed run "
                            f"continues from its checkpoint's weights and does not read it: drop --init_from")
        for line in sweep_unfinished_saves(run_dir) if env.is_main else []:  # the id's run is refused below
            console_line(line, sys.stderr)
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
        run = Run(args, env, schedule, log, source, run_id)
        model = build_model(args, env, init_state)
        log_header(run, model)
        for line in env.memory.lines if env.memory else []:
            log(line)
        for line in loader.report():
            log(line)
        for line in getattr(loader, "located", []):
            log(line)
        run_training(run, model, loader, val_tokens, resume)
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


def clock_mark(cuda: bool):
    """Now, on the clock that times device work: a CUDA event recorded on the stream (its time is read after a
    sync, so the host runs ahead meanwhile), or on CPU, where the host computes, the host's clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimer:
    """Per-step times without a per-step device sync. On CUDA an event is recorded after each step and
    the events are read only where the loop synchronises anyway (validation, checkpoints, the end), so
    the host keeps running ahead; a step's time is the device's, from one event to the next. On CPU,
    where the host computes the step itself, its clock is read instead."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.step_ms: list[float] = []
        self.step_tokens: list[int] = []  # each timed step's tokens (the stages' batches differ)
        self.marks: list = []  # since start(): CUDA events, or host times on CPU
        self._tokens: list[int] = []

    def _mark(self):
        return clock_mark(self.cuda)

    def start(self):
        """Call after a device sync: the next step starts now."""
        self.marks = [self._mark()]

    def step_done(self, tokens: int):
        self.marks.append(self._mark())
        self._tokens.append(tokens)

    def read(self):
        """Call after a device sync: adds the times of the steps since start() to step_ms."""
        pairs = zip(self.marks, self.marks[1:])
        self.step_ms += [a.elapsed_time(b) if self.cuda else 1000 * (b - a) for a, b in pairs]
        self.step_tokens += self._tokens
        self.marks, self._tokens = [], []


def snapshot(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, Tensor) else dict(v) for k, v in state.items()}


def prepare_training(model: GPT, args: Hyperparameters, env: DistEnv, backend="inductor") -> tuple[tuple, bool]:
    """Compiles what the run compiles and builds its optimizers: (optimizers, whether attention is flex)."""
    use_flex = resolve_attention(args, env.device) == "flex"
    if args.compile or use_flex:
        compile_model(model, backend, attention_only=not args.compile)
    optimizers = build_optimizers(model, args)
    if args.compile:
        compile_optimizers(optimizers, backend)
    return optimizers, use_flex


def warmup_steps(args: Hyperparameters, schedule: Schedule) -> list[int]:
    """The steps the untimed warmup runs: the first warmup_steps of every stage and of every part of a stage
    with another candidate count (--stage_softmax_candidates: the loss's width is a shape), an Adam step among
    them when warmup_steps >= adam_every, so that every shape is compiled, the untie step included when it is
    one of them; and with --embed_adam_period the embeddings' first Adam step on it, whose new betas compile
    DistAdam's update for their bucket once more."""
    starts = {stage.start for stage in schedule.stages}
    starts |= {s for s in range(1, schedule.total) if schedule.candidates(s) != schedule.candidates(s - 1)}
    bounds = sorted(starts | {schedule.total})
    steps = {s for start, end in zip(bounds, bounds[1:]) for s in range(start, min(start + args.warmup_steps, end))}
    if args.warmup_steps and schedule.embed_period:
        start = schedule.embed_period_start
        first = start + (-(start + 1)) % schedule.embed_period  # (first + 1) % embed_period == 0
        steps.update([first] if first < schedule.total else [])
    return sorted(steps)


@dataclass
class Run:
    """One run as its parts see it: the config (resolved: --micro_batches=auto's counts chosen), this rank's
    environment, the one Schedule built from that config, the log, the source the log embeds and checkpoints
    are checked by, and the run id."""
    args: Hyperparameters
    env: DistEnv
    schedule: Schedule
    log: Logger
    source: str
    run_id: str


def run_training(run: Run, model: GPT, loader, val_tokens: Tensor, resume: Resume | None):
    args, env, schedule, log = run.args, run.env, run.schedule, run.log
    optimizers, use_flex = prepare_training(model, args, env)
    if args.warmup_steps:
        untimed_warmup(run, model, optimizers, loader, val_tokens, use_flex)
    perf = Performance.measure(run, model, loader)  # before the clock starts
    ships = TailShips(model, record92_ships(schedule), schedule.total, env.world_size, env.rank) \
        if args.tail_ships else None
    extra_state = {"ships": ships} if ships is not None else {}
    start_step, train_time_ms = resume_run(run, resume, model, optimizers, loader, extra_state) if resume \
        else (0, 0.0)

    # The host runs ahead of the device: the loop synchronises only where the clock stops (validation,
    # checkpoints, the end) and where the train loss is logged (every train_loss_every steps).
    clock, train_loss, final_val_loss = Clock(env.device, train_time_ms), TrainLoss(env.device), float("nan")
    clock.start()
    for step in range(start_step, args.num_iterations + 1):
        last_step = step == args.num_iterations
        model.set_windows(schedule.windows(step))  # YaRN, when the windows grow
        if last_step and ships is not None:
            ships.ship()  # on the clock, as the record's

        # VALIDATION (and checkpoints): the clock stops
        if schedule.validates(step):
            with clock.paused():
                val_windows = schedule.windows(step, final_validation=last_step)  # YaRN stays fitted to the last
                final_val_loss = evaluate(model, val_tokens, val_windows, args, env, use_flex)
                log(format_step(step, args, clock.elapsed_ms, val_loss=final_val_loss))
                check_finite(final_val_loss, "val loss", step)
        if args.save_every and step > start_step and step % args.save_every == 0:
            with clock.paused():
                path = save_checkpoint(step, clock.elapsed_ms, model, optimizers, loader, args, env, run.source,
                                       run.run_id, extra_state)
                log(f"checkpoint: {path}", console=False)
        if last_step:
            break

        # TRAINING
        set_schedules(step, optimizers, schedule, args)
        batch = loader.next_batch(step)
        if loader.started_over:  # only with --repeat_data=true: the set-up refuses a run that would repeat
            log(f"data: the training shards are used up after {step} steps; step {step + 1} starts over from the "
                f"first shard (--repeat_data=true)")
        loss = train_step(model, optimizers, batch, step, schedule, args, use_flex)
        if ships is not None:
            ships.tick(step)
        train_loss.add(loss, schedule.stage(step).batch_tokens)
        clock.step_done(schedule.stage(step).batch_tokens)
        now_ms = clock.host_ms()  # on CUDA the host's clock, which runs ahead of the device
        if args.train_loss_every and (step + 1) % args.train_loss_every == 0:
            mean = train_loss.read(env.world_size)
            log(format_step(step + 1, args, now_ms, train_loss=mean))
            check_finite(mean, "train loss", step + 1)
        else:
            log(format_step(step + 1, args, now_ms))

    error = None
    table = gathered_ngram_table(model) if args.save_final else None  # (every rank sends its shard)
    if args.save_final and env.is_main:  # after the clock has stopped
        try:
            path = save_final_weights(model, args, run.source, run.run_id, args.num_iterations, final_val_loss, table)
            log(f"final weights: {path}")
        except TrainingError as e:
            error = e
    if not all_ranks_ok(error is None, env.device):
        raise error or TrainingError("rank 0 could not write the final weights")
    if optimizers[1].late_reductions:
        log(f"note: {optimizers[1].late_reductions} DistAdam bucket reductions started in step(), not during "
            f"backward (a parameter without a gradient)")
    log_summary(run, clock, perf, final_val_loss)


def untimed_warmup(run: Run, model: GPT, optimizers, loader, val_tokens: Tensor, use_flex: bool):
    """The first steps of every stage (their batch sizes and sequence lengths) and a validation at the final
    windows compile and run every kernel. Windows, documents, rotary tables and the attention scale are
    tensors, so these are all the graphs the run builds. Then model (rotary state included), optimizers (the
    tie included) and data go back to where they started."""
    args, env, schedule = run.args, run.env, run.schedule
    initial_loader = loader.state_dict()
    initial_model = snapshot(model.state_dict())
    initial_rank = host_copies(rank_buffers(model))  # (the n-gram table's shard is in no state dict)
    initial_optimizers = [opt.state_dict() for opt in optimizers]
    for step in warmup_steps(args, schedule):
        model.set_windows(schedule.windows(step))
        set_schedules(step, optimizers, schedule, args)
        train_step(model, optimizers, loader.next_batch(step), step, schedule, args, use_flex)
    evaluate(model, val_tokens[:args.val_seq_len * env.world_size + 1],
             schedule.windows(args.num_iterations, final_validation=True), args, env, use_flex)
    model.load_state_dict(initial_model)
    for name, t in rank_buffers(model).items():
        t.copy_(initial_rank[name])
    model.zero_grad(set_to_none=True)
    for opt, state in zip(optimizers, initial_optimizers):
        opt.load_state_dict(state)
    refresh_fp8(model)
    loader.load_state_dict(initial_loader)


def resume_run(run: Run, resume: Resume, model: GPT, optimizers, loader, extra_state: dict) -> tuple[int, float]:
    """The checkpoint's weights, optimizer state, data position and RNG: (its step, its train time so far).
    One rank's bad file stops them all."""
    error, start_step, train_time_ms = None, 0, 0.0
    try:
        start_step, train_time_ms = load_checkpoint(resume, model, optimizers, loader, run.env, extra_state)
        refresh_fp8(model)
    except TrainingError as e:
        error = e
    if not all_ranks_ok(error is None, run.env.device):
        raise error or TrainingError("another rank could not load the checkpoint")
    run.log(f"resumed from {resume.path} at step {start_step}")
    for line in sweep_unfinished_saves(resume.path.parent) if run.env.is_main else []:
        run.log(line)
    if run.args.init_from:
        run.log(f"note: --init_from={run.args.init_from} is not read: a resumed run continues from its checkpoint's "
                f"weights")
    return start_step, train_time_ms


class Clock:
    """The run's clock: the training time, stopped while validating and saving, and each step's device time
    (StepTimer). Every stop and start waits for the device, so what it counts is the device's work."""

    def __init__(self, device: torch.device, elapsed_ms: float = 0.0):
        self.device, self.elapsed_ms, self.tokens = device, elapsed_ms, 0
        self.timer = StepTimer(device)
        self.started_at: float | None = None  # None until the first start: the untimed part of the run

    def start(self):
        sync(self.device)
        self.started_at = time.perf_counter()
        self.timer.start()

    def stop(self):
        sync(self.device)
        self.elapsed_ms += 1000 * (time.perf_counter() - self.started_at)
        self.timer.read()

    @contextlib.contextmanager
    def paused(self):
        self.stop()
        yield
        self.start()

    def host_ms(self) -> float:
        """The training time by the host's clock, without a sync: exact only where the clock stops."""
        return self.elapsed_ms + 1000 * (time.perf_counter() - self.started_at)

    def step_done(self, tokens: int):
        self.tokens += tokens
        self.timer.step_done(tokens)


class TrainLoss:
    """The training loss summed since it was last read, on the device: adding needs no host sync."""

    def __init__(self, device: torch.device):
        self.sum, self.tokens = torch.zeros((), device=device), 0

    def add(self, loss: Tensor, tokens: int):
        self.sum += loss
        self.tokens += tokens

    def read(self, world_size: int) -> float:
        """The multi-token objective per token, over every rank (each sees the same value, so all stop
        together on a NaN); one host sync."""
        if world_size > 1:
            dist.all_reduce(self.sum)
        mean = self.sum.item() / self.tokens
        self.sum.zero_()
        self.tokens = 0
        return mean


@dataclass
class Performance:
    """What MFU is counted from: the device's measured matmul peak and the model's FLOPs per token."""
    peak_flops: float
    matmul_dtype: torch.dtype
    flops_per_token: float

    @staticmethod
    def measure(run: Run, model: GPT, loader) -> "Performance":
        # The peak is measured by the rank that logs, alone: ranks that share a CPU's cores would slow each
        # other's matmuls and so understate it (the other ranks wait for rank 0 at their first collective).
        peak = matmul_peak_flops(run.env.device, model.numerics.compute) if run.env.is_main else float("nan")
        position = loader.state_dict()
        tokens = loader.next_batch(0)[0][0]  # the first batch's documents
        flops = schedule_flops_per_token(run.args, model, tokens, run.schedule)
        loader.load_state_dict(position)
        return Performance(peak, model.numerics.compute, flops)

    def mfu(self, tokens_per_s: float, world_size: int) -> float:
        return 100 * self.flops_per_token * tokens_per_s / (self.peak_flops * world_size)


def log_summary(run: Run, clock: Clock, perf: Performance, final_val_loss: float):
    """The run's last lines: peak memory, the median step (what a benchmark compares), the summary."""
    args, env, log = run.args, run.env, run.log
    if env.device.type == "cuda":
        peak_memory = torch.cuda.max_memory_allocated() // 2**20
        log(f"peak memory allocated: {peak_memory} MiB reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    else:
        peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
    timer = clock.timer
    if timer.step_ms:
        median_ms = float(np.median(timer.step_ms))
        median_tokens_per_s = float(np.median([n / (ms / 1000) for n, ms in zip(timer.step_tokens, timer.step_ms)]))
        mfu = perf.mfu(median_tokens_per_s, env.world_size)
        log(f"perf: step_median:{median_ms:.2f}ms tokens_per_s:{median_tokens_per_s:.0f} "
            f"model_flops_per_token:{perf.flops_per_token:.0f} matmul_peak_tflops:{perf.peak_flops / 1e12:.2f} "
            f"({str(perf.matmul_dtype).removeprefix('torch.')}) mfu:{mfu:.2f}% peak_memory:{peak_memory}MiB")
    tokens_per_s = clock.tokens / max(clock.elapsed_ms / 1000, 1e-9)
    log(f"summary: final_val_loss:{final_val_loss:.4f} train_time:{clock.elapsed_ms:.0f}ms "
        f"steps:{args.num_iterations} tokens_per_s:{tokens_per_s:.0f} "
        f"mfu:{perf.mfu(tokens_per_s, env.world_size):.2f}% world_size:{env.world_size} device:{env.device.type}")


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
    if "clock" not in local or local["clock"].started_at is None:  # it starts just before the first step
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


def console_line(line: str, stream=None):
    """Prints one line, through visible(), to stdout (or `stream`) in a single write. print() writes the text and
    its newline separately, and unbuffered (PYTHONUNBUFFERED) they are two writes: under torchrun the ranks share
    one stderr, and two ranks' lines came out run together with the newlines after them."""
    stream = sys.stdout if stream is None else stream
    stream.write(visible(line) + "\n")
    stream.flush()


def report_error(line: str, exit_code: int, print_it: bool = True) -> int:
    """Prints a failed run's one line and returns its exit code. Under torchrun the line also goes to the
    rank's error file (TORCHELASTIC_ERROR_FILE, which torchrun sets), so that torchrun's own summary of
    the failure shows it instead of a pointer to its documentation."""
    line = visible(line)  # torchrun prints the error file's message too
    if print_it:
        console_line(line, sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError, TrainingError):
            write_file(Path(error_file), json.dumps(record).encode())
    return exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = 0  # until the environment is read: a process with a bad RANK reports it itself
    STOP.signal, STOP.where, env = None, "", None
    previous = {signum: signal.signal(signum, stop_on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    STOP.armed = True
    try:
        try:
            rank = launch_ranks()[0]
            args = parse_args(argv, torch.cuda.is_available())
            env, args = setup_distributed(args)
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

"""Weights interop with public modded-nanogpt records #89 (its root train_gpt.py at f411b3d3, the speedrun preset),
#85 v3 (--preset=record85) and #92's model (train_gpt.RECORD92_MODEL, its log's train_gpt.py): their GPT's
state_dict <-> this repository's.

    python tools/record_weights.py to-ours state_step001285.pt ck/record89/final   # sample.py / --init_from
    python tools/record_weights.py to-record ck/run/final record_state.pt           # load into the record's GPT
    python tools/record_weights.py to-ours state_step001290.pt ck/record85/final -- --preset=record85

to-ours builds the speedrun preset's model; train_gpt.py flags after `--` change that (record #85 v3's model, record
#92's model flags, or the same architecture at another size, e.g. in the tests).

In Python, record_to_ours(state) and ours_to_record(state) convert state dicts (tensors are shared, not
copied). The records keep their attention and MLP matrices in banks padded for 8 ranks; this repository keeps them
per layer, without the padding:
  - qk_bank: per attention layer, its head pairs' query blocks then their key blocks (6 matrices of (256, dim));
    vo_bank: per attention layer, the value then the output matrix. The layers in the record's bank order:
    record #92's compacted banks hold its narrow layers first, then those with narrow values, then the full-width
    ones, each in layer order (record #89's: every attention layer in layer order, which is the same rule). A
    narrow layer's matrices keep their full shapes in both (the rows it does not read included).
  - mlp_bank: fc and proj of layer i at slot i, then the parallel MLPs (record #92's layer 8's at slot 11); a
    removed layer's slot is the record's alone (never read).
  - record #89's three FP8 scale vectors of its down-projections, one entry per MLP of mlp_bank (the activation's,
    per rank: the file holds its rank 0's; the weight's used and next). Record #92's GPT (the one with mudd_w2g,
    --head_mix_groups) has none of these: its FP8 buffers (_attn_*) are the FP8 port's; our scales take their
    initial values. Its full-FP8 MLP's delayed scales (--mlp_full_fp8) are run state outside its state dict:
    record_to_ours gives ours their start values (train_gpt.FP8_MLP_START), ours_to_record leaves them out.
The two functions are exact inverses on everything either model reads (those scales aside):
record_to_ours(ours_to_record(s)) == s, and ours_to_record(record_to_ours(r), like=r) == r, where `like` supplies
what only the record has (zeros, and the unused MLP slots' initial fc and their scales, otherwise). The rotary
state, which the record does not save, is the one after the schedule's window changes up to `step` (default: the
end of training).

The n-gram table (record #92's bigram_embed.weight) converts as a whole table of our shape (a world-size-1 file); a
rank's shard of record #92's sharded table is refused with a pointer to the hook, convert_ngram_table, which the
n-gram port fills.

Before converting, record_to_ours checks that the state dict is the record's GPT for the config: string keys,
every tensor there, each dense, on the CPU, of a floating dtype, of its shape (a bank's rank and matrix shape, and
at least the rows in use), stored with each element once (no zero strides, no overlapping views), and finite
(train_gpt.py's checks of a stored tensor, tensor_problem, storage_problem and nonfinite_problem, which --init_from,
--resume and sample.py apply too). The file is read by train_gpt.py's one weights loader (load_weights), which
bounds what its entries hold once inflated before anything is unpickled. The command line refuses, with one
`error:` line and exit code 2 and before writing anything, a file that is not a PyTorch file, a --step the
schedule does not have, and an output that exists; what it writes goes through train_gpt.write_file (atomic), into
a temporary folder unique to the call, so a full disk leaves nothing behind and two conversions into one output
never touch each other's.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as T  # noqa: E402

COMPILED_PREFIX = "_orig_mod."  # the record's model is torch.compile'd: its state_dict keys carry this
RECORD_MLP_LAYERS = 12  # the record's mlp_bank always has 12 (11 used)
RECORD_WORLD_SIZE = 8
# Record #89's FP8 scales of the down-projections (--mlp_down_fp8): record name -> our per-layer buffer
DOWN_SCALES = {"_mlp_down_act_scales": "down_act_scale", "_mlp_down_proj_scales": "down_weight_scale",
               "_mlp_down_proj_next_scales": "down_weight_next_scale"}
# their first size is the record's padded row count: at least ours
BANKS = ("qk_bank", "vo_bank", "mlp_bank", *DOWN_SCALES)
# Tensors with the same shape and meaning on both sides: record name -> ours.
SAME = {
    "embed.weight": "embed.weight",
    "lm_head.weight": "lm_head",
    "value_embeds": "value_embeds",
    "ve_gate_bank": "ve_gates",
    "bigram_embed.weight": "bigram_embed.weight",
    "bigram_sign_table": "bigram_signs",
    "smear_gate.weight": "smear_gate.weight",
    "scalars": "scalars",
    "resid_lambdas": "resid_lambdas",
    "post_lambdas": "post_lambdas",
    "mudd_w1": "mudd_w1",
    "mudd_w2": "mudd_w2",
    "mudd_b2": "mudd_b2",
    "mudd_gate_w1": "mudd_gate_w1",
    "mudd_gate_w2": "mudd_gate_w2",
    "mudd_gate_b2": "mudd_gate_b2",
    "_mudd_gate_scale": "mudd_gate_scale",
}
HEAD_GROUP_DELTAS = {"mudd_w2g": "mudd_w2g"}  # record #92's head-mix deltas (--head_mix_groups)


class WeightsError(ValueError):
    """A state dict that is not the model it claims to be; the message names the key."""


def speedrun_args() -> T.Hyperparameters:
    return T.parse_args(["--preset=speedrun"], cuda_available=True)


def same(args: T.Hyperparameters) -> dict[str, str]:
    """The tensors with the same shape and meaning on both sides for this config: record name -> ours. The n-gram
    table is not among them: it converts on its own (convert_ngram_table, under our_table_key's name)."""
    return {k: v for k, v in {**SAME, **(HEAD_GROUP_DELTAS if args.head_mix_groups else {})}.items()
            if k != NGRAM_TABLE}


def takes_down_scales(args: T.Hyperparameters) -> bool:
    """Whether the record's state dict holds record #89's FP8 down-projection scales: --mlp_down_fp8 on #89's GPT,
    not #92's (the one with the head mix's group deltas, --head_mix_groups)."""
    return T.record89_down_scales(args) and not args.head_mix_groups


def _attention_layers(args: T.Hyperparameters) -> list[int]:
    """The attention layers in the record's bank order: narrow QK only, then narrow values, then full width, each
    in layer order (record #92's compaction; record #89's banks, all full width, are in layer order)."""
    plans = [plan for plan in T.layer_plan(args) if plan.attention]
    kind = lambda plan: 1 if plan.narrow_value else 0 if plan.narrow_qk else 2
    return [plan.index for plan in sorted(plans, key=lambda plan: (kind(plan), plan.index))]


def _mlp_slots(args: T.Hyperparameters) -> list[str | None]:
    """Our MLP (a key prefix) at each slot of the record's mlp_bank that some layer has: layer i's at slot i (None for
    a removed layer: the record's alone), then the parallel MLPs in layer order."""
    plans = T.layer_plan(args)
    return ([None if plan.removed else f"blocks.{plan.index}.mlp" for plan in plans]
            + [f"blocks.{plan.index}.parallel_mlp" for plan in plans if plan.parallel_mlp])


def rotary_state(args: T.Hyperparameters, step: int) -> dict:
    """Our rotaries' state after the schedule's window changes up to `step` (what the record's Yarn tables hold),
    named as in our state dict: the full-width heads' fitted to the long window, the narrow heads' (where some
    layer has them) to the short one."""
    schedule = T.Schedule(args)
    first = schedule.stages[0].windows
    kinds = [("rotary", 1, args.head_dim, args.attn_scale)]
    if any(plan.narrow_qk for plan in T.layer_plan(args)):
        kinds.append(("narrow_rotary", 0, args.narrow_dim, args.narrow_attn_scale))
    state = {}
    for name, which, dims, scale in kinds:
        rotary = T.Rotary(dims, 1, args.window_block, first[which], T.rotary_dims(args), scale)
        for s in range(min(step, args.num_iterations) + 1):
            rotary.set_window(schedule.windows(s)[which])
        state.update({f"{name}.{k}": v for k, v in rotary.state_dict().items()})
    return state


def _take(state: dict, name: str):
    if name not in state:
        raise WeightsError(f"missing {name!r}")
    return state[name]


def _banks(state: dict, args: T.Hyperparameters) -> dict[str, torch.Tensor]:
    """Our per-layer matrices gathered into the record's banks, without its padding: qk_bank
    (heads * attention layers, ...), vo_bank (2 * attention layers, ...) in the record's bank order, mlp_bank
    (slots, 2, ...) with zeros at a removed layer's slot; and record #89's scale vectors (slots,)."""
    layers, slots = _attention_layers(args), _mlp_slots(args)
    scale = lambda mlp, mine: _take(state, f"{mlp}.{mine}") if mlp is not None else torch.ones(())
    scales = {theirs: torch.stack([scale(mlp, mine) for mlp in slots])
              for theirs, mine in DOWN_SCALES.items()} if takes_down_scales(args) else {}
    some = next(prefix for prefix in slots if prefix is not None)
    pair = lambda prefix: torch.stack([_take(state, f"{prefix}.fc"), _take(state, f"{prefix}.proj")])
    empty = torch.zeros_like(pair(some))
    return {**scales,
        "qk_bank": torch.cat([_take(state, f"blocks.{layer}.attn.qk") for layer in layers]),
        "vo_bank": torch.cat([_take(state, f"blocks.{layer}.attn.vo") for layer in layers]),
        "mlp_bank": torch.stack([empty if prefix is None else pair(prefix) for prefix in slots]),
    }


def record_shapes(args: T.Hyperparameters) -> dict[str, tuple[int, ...]]:
    """The shape of each of the record's tensors (named without '_orig_mod.') for this architecture. A bank's
    first size is the rows in use; the record's file holds at least as many (the rest is its padding)."""
    with torch.device("meta"):  # shapes only: no memory, even for the speedrun's model
        ours = T.GPT(args).state_dict()
    shapes = {theirs: tuple(ours[mine].shape) for theirs, mine in same(args).items()}
    shapes[NGRAM_TABLE] = (args.bigram_vocab_size, args.model_dim)  # whole (ours: see our_table_key)
    shapes.update({name: tuple(bank.shape) for name, bank in _banks(ours, args).items()})
    return shapes


def _shape_problem(name: str, found: tuple, expected: tuple) -> str | None:
    if name in BANKS:
        fits = len(found) == len(expected) and found[1:] == expected[1:] and found[0] >= expected[0]
        wanted = "(" + ", ".join([f"{expected[0]} or more", *map(str, expected[1:])]) + ")"
    else:
        fits, wanted = found == expected, str(expected)
    return None if fits else f"{name!r} has shape {found}, expected {wanted}"


def check_record_state(state: dict, args: T.Hyperparameters) -> dict:
    """The record's state dict without the '_orig_mod.' prefix, once it is the record's GPT for this config:
    string keys; every tensor there; floating dtypes; the shapes of record_shapes. Otherwise a WeightsError,
    one line naming the first key that is wrong and how many more are. Tensors the conversion does not use (a
    buffer the record's file may hold) are left out, and unused_keys names them."""
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        more = f"; and {len(odd) - 1} more such key(s)" if len(odd) > 1 else ""
        raise WeightsError(f"key {odd[0]!r} ({type(odd[0]).__name__}) is not a parameter name (the keys of a state "
                           f"dict are strings){more}")
    plain = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    if len(plain) != len(state):
        twice = next(k for k in state if k.startswith(COMPILED_PREFIX) and k.removeprefix(COMPILED_PREFIX) in state)
        raise WeightsError(f"{twice.removeprefix(COMPILED_PREFIX)!r} is there twice, with and without "
                           f"{COMPILED_PREFIX!r}")
    expected = record_shapes(args)
    problems = []
    for name, shape in expected.items():
        value = plain.get(name)
        if value is None:
            hint = (" (record #89's FP8 scales: a record #85 v3 state dict converts with `-- --preset=record85`)"
                    if name in DOWN_SCALES else "")
            problems.append(f"missing {name!r} (expected shape {shape}){hint}")
        elif name == NGRAM_TABLE and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            problems.append(f"{name!r} has shape {tuple(value.shape)}, expected {shape}: one rank's shard of a sharded "
                            f"n-gram table? (convert_ngram_table is where those will convert)")
        else:  # train_gpt.py's one check of a stored tensor: dense, on the CPU, floating (see T.check_weights)
            problems.append(T.tensor_problem(name, value) or _shape_problem(name, tuple(value.shape), shape))
    if not any(problems):  # each tensor's storage, from its strides: a bank of 2**24 rows broadcast from one passed
        # the shape check, then the finiteness check asked for 2.2 TB
        problems = [T.storage_problem(name, plain[name]) for name in expected]
    if not any(problems):  # last, as the trainer's reader does: it reads every value
        problems = [T.nonfinite_problem(name, plain[name]) for name in expected]
    problems = [p for p in problems if p is not None]
    if problems:
        more = f"; and {len(problems) - 1} more key(s) wrong" if len(problems) > 1 else ""
        raise WeightsError(problems[0] + more)
    return plain


def unused_keys(state: dict, args: T.Hyperparameters) -> list[str]:
    """The record's tensors (named without '_orig_mod.') that the conversion does not read."""
    expected = record_shapes(args)
    return [k for k in (str(k).removeprefix(COMPILED_PREFIX) for k in state) if k not in expected]


NGRAM_TABLE = "bigram_embed.weight"  # the record's n-gram (bigram) table, ours of the same name


def our_table_key(args: T.Hyperparameters) -> str:
    """Where our weights hold the record's table: the bigram table's parameter, or (--ngram_channels=2) the whole
    n-gram table that final weights carry (T.final_weights_shapes)."""
    return "ngram.weight" if args.ngram_channels == 2 else "bigram_embed.weight"


def convert_ngram_table(table: torch.Tensor, args: T.Hyperparameters) -> torch.Tensor:
    """The n-gram table either way: the hook where the n-gram port converts record #92's table (its rows in two
    hashed channels, sharded one slice per rank). Today the table is taken as it is, a whole table of our shape
    (record #89's, or #92's at world size 1); record_shapes refuses a rank's shard."""
    return table


def record_to_ours(state: dict, args: T.Hyperparameters | None = None, step: int | None = None) -> dict:
    """Our model's state dict from the record's (compiled or not: the '_orig_mod.' prefix is optional),
    checked first (check_record_state)."""
    args = args or speedrun_args()
    state = check_record_state(state, args)
    heads = args.model_dim // args.head_dim
    ours = {mine: state[theirs] for theirs, mine in same(args).items()}
    ours[our_table_key(args)] = convert_ngram_table(state[NGRAM_TABLE], args)
    qk, vo, mlp = state["qk_bank"], state["vo_bank"], state["mlp_bank"]
    removed = [slot for slot, prefix in enumerate(_mlp_slots(args)) if prefix is None]
    if removed:  # what the decontraction ship counts of the removed layers' slots (GPT.removed_mlp_sq)
        ours["removed_mlp_sq"] = sum(mlp[slot].float().square().sum() for slot in removed)
    for a, layer in enumerate(_attention_layers(args)):
        ours[f"blocks.{layer}.attn.qk"] = qk[heads * a:heads * (a + 1)]
        ours[f"blocks.{layer}.attn.vo"] = vo[2 * a:2 * a + 2]
    for slot, prefix in enumerate(_mlp_slots(args)):
        if prefix is not None:
            ours[f"{prefix}.fc"], ours[f"{prefix}.proj"] = mlp[slot, 0], mlp[slot, 1]
    if args.mlp_full_fp8:  # record #92's FP8 scales live outside its state dict: ours start where its run starts
        for prefix in filter(None, _mlp_slots(args)):
            for name in T.FP8_MLP_SAVED:
                ours[f"{prefix}.fp8_{name}"] = torch.tensor(T.FP8_MLP_START.get(name, 1.0))
    if T.record89_down_scales(args):  # record #89's scales, by MLP slot; record #92's GPT has none: their initial values
        for slot, mlp in enumerate(_mlp_slots(args)):
            for theirs, mine in DOWN_SCALES.items() if mlp is not None else ():
                ours[f"{mlp}.{mine}"] = state[theirs][slot] if takes_down_scales(args) else torch.ones(())
    ours.update(rotary_state(args, args.num_iterations if step is None else step))
    return ours


def ours_to_record(state: dict, args: T.Hyperparameters | None = None, like: dict | None = None,
                   prefix: str | None = None) -> dict:
    """The record's state dict (as its compiled model's state_dict() names it, unless prefix says
    otherwise) from ours. What only the record has (its padding, a removed layer's MLP slot) comes from `like` (a
    record state dict) when given, else zeros (ones for record #89's scales, their initial values), laid out for 8
    ranks."""
    args = args or speedrun_args()
    if like is not None:
        prefix = COMPILED_PREFIX if any(k.startswith(COMPILED_PREFIX) for k in like) else ""
        like = {k.removeprefix(COMPILED_PREFIX): v for k, v in like.items()}
    prefix = COMPILED_PREFIX if prefix is None else prefix
    record = {theirs: _take(state, mine) for theirs, mine in same(args).items()}
    record[NGRAM_TABLE] = convert_ngram_table(_take(state, our_table_key(args)), args)
    banks = _banks(state, args)
    slots = _mlp_slots(args)
    theirs_only = [slot for slot, mine in enumerate(slots) if mine is None]  # removed layers' MLP slots

    def padded(used: torch.Tensor, name: str, rows: int, fill: float = 0.0, holes: list[int] = ()) -> torch.Tensor:
        if like is not None:
            full = _take(like, name).clone()
            if full.shape[1:] != used.shape[1:] or full.size(0) < used.size(0):
                raise WeightsError(f"like[{name!r}] has shape {tuple(full.shape)}, not a padded {tuple(used.shape)}")
        else:
            full = used.new_full((rows, *used.shape[1:]), fill)
        kept = full[list(holes)].clone()
        full[:used.size(0)] = used
        full[list(holes)] = kept
        return full

    rows = lambda bank: -(-bank.size(0) // RECORD_WORLD_SIZE) * RECORD_WORLD_SIZE
    record["qk_bank"] = padded(banks["qk_bank"], "qk_bank", rows(banks["qk_bank"]))
    record["vo_bank"] = padded(banks["vo_bank"], "vo_bank", rows(banks["vo_bank"]))
    mlp_rows = max(RECORD_MLP_LAYERS, len(slots))
    record["mlp_bank"] = padded(banks["mlp_bank"], "mlp_bank", mlp_rows, holes=theirs_only)
    if theirs_only:  # a removed layer's slot: what decontraction counts of it, an up-projection of that norm
        frozen = _take(state, "removed_mlp_sq").float() / len(theirs_only)
        if like is None:
            for slot in theirs_only:
                up = torch.empty_like(record["mlp_bank"][slot, 0], dtype=torch.float32).uniform_(
                    -1, 1, generator=torch.Generator().manual_seed(slot))
                record["mlp_bank"][slot, 0] = up * (frozen / up.square().sum()).sqrt()
    for name in DOWN_SCALES if takes_down_scales(args) else ():  # the record's initial scales: ones
        record[name] = padded(banks[name], name, mlp_rows, fill=1.0, holes=theirs_only)
    return {prefix + k: v for k, v in record.items()}


def load_state(path: Path, trust: bool, args: T.Hyperparameters) -> dict:
    """A state dict from a file: the record's model.state_dict(), or its checkpoint (key "model"), read by the
    trainer's one weights loader (T.load_weights: a regular file, a zip archive holding data.pkl whose entries, once
    inflated, fit the host's memory beside the model this conversion builds). The safe loader (weights_only) unless
    `trust`; --trust is suggested only where it refused a Python object."""
    try:
        data = T.load_weights(path, T.model_state_shapes(args), weights_only=not trust)
    except T.UnsafeObject as e:
        raise WeightsError(f"{path}: {e} (the record's checkpoints hold its optimizer's): --trust loads it, if you "
                           f"trust the file") from None
    except T.WeightsError as e:
        raise WeightsError(f"{path}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsError(f"{path}: not a state dict of tensors")
    return data


def schedule_step(step: int | None, args: T.Hyperparameters) -> int:
    """--step, or the end of training where it is not given; a step the schedule does not have is refused."""
    last = T.Schedule(args).total
    if step is None:
        return last
    if not 0 <= step <= last:
        raise WeightsError(f"--step={step}: the schedule's steps are 0 to --num_iterations={last}; leave --step out "
                           f"for the end of training")
    return step


def refuse_existing(out: Path, what: str):
    """An output is never written over (publish_folder would replace a folder): checked before anything is loaded."""
    if out.exists() or out.is_symlink():
        raise WeightsError(f"{out}: already exists; choose a new {what}")


def write_final_folder(state: dict, args: T.Hyperparameters, out: Path, step: int, source: str):
    """A final-weights folder (model.pt, config.json) as train_gpt.py --save_final=true writes one: into a
    temporary folder beside it, renamed at the end, and removed if a write fails or SIGTERM comes."""
    refuse_existing(out, "folder")
    model = T.GPT(args)
    mismatch = T.state_dict_mismatch(state, model.state_dict())
    if mismatch:
        raise WeightsError(f"the converted weights do not fit train_gpt.py's model: {mismatch}")
    model.load_state_dict(state)
    info = {"format": T.FINAL_WEIGHTS_FORMAT, "config": dataclasses.asdict(args), "step": step, "val_loss": None,
            "windows": list(T.Schedule(args).windows(args.num_iterations, final_validation=True)),
            "code_sha256": None, "converted_from": source}
    # the folders above `out` that this conversion makes: a failure takes them back with the rest (a full disk once
    # left them behind)
    made = [folder for folder in (out.parent, *out.parent.parents) if not os.path.lexists(folder)]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # unique to this call: two conversions into one output once shared `.out.partial`, the second deleting the
        # first's
        tmp = Path(tempfile.mkdtemp(prefix=T.temporary_prefix(out.name), suffix=".partial", dir=out.parent))
    except OSError as e:  # nothing of ours is left, so nothing is said to be removed
        T.release_folders(made)
        raise WeightsError(str(T.write_error(out, e))) from None
    try:
        with T.terminate_as_exception():
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; weights are for others to read
            T.write_file(tmp / "model.pt", model.state_dict(), shown=out / "model.pt")
            T.write_file(tmp / "config.json", json.dumps(info, indent=1).encode(), shown=out / "config.json")
            publish_new_folder(tmp, out)
    except (OSError, T.TrainingError, WeightsError) as e:
        why = T.write_error(out, e) if isinstance(e, OSError) else e
        removed = T.remove_unfinished(tmp, "folder")
        T.release_folders(made)
        raise WeightsError(f"{why}; {removed}") from None
    except BaseException:  # SIGTERM (as SystemExit) or Ctrl-C mid-write
        T.remove_unfinished(tmp)
        T.release_folders(made)
        raise


def publish_new_folder(tmp: Path, out: Path):
    """Renames the finished folder to `out`, which must still not exist: another conversion into the same output
    may have finished meanwhile, and its folder is not replaced (T.publish_folder would remove it first). A rename
    onto a folder that holds files fails (ENOTEMPTY), onto a file too (ENOTDIR)."""
    if os.path.lexists(out):
        raise WeightsError(f"{out}: already exists (written while this conversion ran: another to-ours into it?)")
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise WeightsError(f"{out}: already exists (written while this conversion ran: another to-ours into "
                               f"it?)") from None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert weights between record #85 v3's GPT and train_gpt.py's.")
    sub = parser.add_subparsers(dest="command", required=True)
    to_ours = sub.add_parser("to-ours", help="a record state dict (or its checkpoint) -> a final-weights folder")
    to_ours.add_argument("state")
    to_ours.add_argument("out", help="the final-weights folder to create")
    to_ours.add_argument("--step", type=int, default=None, help="schedule step of the weights, 0 to --num_iterations "
                                                                  "(default: the end): fixes the rotary state")
    to_ours.add_argument("--trust", action="store_true", help="load a full pickle (the record's checkpoints)")
    to_record = sub.add_parser("to-record", help="a final-weights folder -> the record's state dict (.pt)")
    to_record.add_argument("folder")
    to_record.add_argument("out")
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    options = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        out = Path(options.out)
        if options.command == "to-ours":
            args = T.parse_args(["--preset=speedrun", *flags], cuda_available=True)
            step = schedule_step(options.step, args)
            refuse_existing(out, "folder")
            record = load_state(Path(options.state), options.trust, args)
            try:
                state = record_to_ours(record, args, step)
            except WeightsError as e:
                raise WeightsError(f"{options.state}: {e}") from None
            write_final_folder(state, args, out, step, str(options.state))
            unused = unused_keys(record, args)
            if unused:
                print(f"note: {len(unused)} tensor(s) of {options.state} are not weights of train_gpt.py's model and "
                      f"were left out: {', '.join(map(repr, unused[:5]))}{' ...' if len(unused) > 5 else ''}")
            print(f"wrote {out} (sample.py {out}; train_gpt.py --init_from={out})")
        else:
            refuse_existing(out, "file")
            model, args, _ = T.load_final_weights(options.folder, torch.device("cpu"))
            state = ours_to_record({k: v for k, v in model.state_dict().items()}, args)
            T.write_file(out, state)
            print(f"wrote {out}: load it with the record's GPT (compiled) load_state_dict")
    except (WeightsError, T.DataError, T.ConfigError, T.TrainingError) as e:
        T.console_line(f"error: {e}", sys.stderr)  # (file names it did not choose, escaped)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Weights interop with public modded-nanogpt record #85 v3: its GPT's state_dict <-> this repository's.

    python tools/record_weights.py to-ours state_step001290.pt ck/record85/final   # sample.py / --init_from
    python tools/record_weights.py to-record ck/run/final record_state.pt           # load into the record's GPT

to-ours builds the speedrun preset's model; train_gpt.py flags after `--` change that (the same architecture
at another size, e.g. in the tests).

In Python, record_to_ours(state) and ours_to_record(state) convert state dicts (tensors are shared, not
copied). The record keeps its attention and MLP matrices in banks padded for 8 ranks (qk_bank: 6 head-pair
blocks per attention layer, 60 used of 64; vo_bank: value and output per attention layer, 20 of 24;
mlp_bank: fc and proj of 11 layers plus an unused 12th); this repository keeps them per layer, without the
padding. The two functions are exact inverses on everything either model reads:
record_to_ours(ours_to_record(s)) == s, and ours_to_record(record_to_ours(r), like=r) == r, where `like`
supplies the record's padding (zeros, and the unused 12th MLP's initial fc, otherwise). The rotary state,
which the record does not save, is the one after the schedule's window changes up to `step` (default: the
end of training).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as T  # noqa: E402

COMPILED_PREFIX = "_orig_mod."  # the record's model is torch.compile'd: its state_dict keys carry this
RECORD_MLP_LAYERS = 12  # the record's mlp_bank always has 12 (11 used)
RECORD_WORLD_SIZE = 8

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


class WeightsError(ValueError):
    """A state dict that is not the model it claims to be; the message names the key."""


def speedrun_args() -> T.Hyperparameters:
    return T.parse_args(["--preset=speedrun"], cuda_available=True)


def _attention_layers(args: T.Hyperparameters) -> list[int]:
    return [plan.index for plan in T.layer_plan(args) if plan.attention]


def rotary_state(args: T.Hyperparameters, step: int) -> dict:
    """Our rotary's state after the schedule's window changes up to `step` (what the record's Yarn holds)."""
    schedule = T.Schedule(args)
    rotary = T.Rotary(args.head_dim, 1, args.window_block, schedule.stages[0].windows[1])
    for s in range(min(step, args.num_iterations) + 1):
        rotary.set_window(schedule.windows(s)[1])
    return {k: v for k, v in rotary.state_dict().items()}


def _take(state: dict, name: str):
    if name not in state:
        raise WeightsError(f"missing {name!r}")
    return state[name]


def record_to_ours(state: dict, args: T.Hyperparameters | None = None, step: int | None = None) -> dict:
    """Our model's state dict from the record's (compiled or not: the '_orig_mod.' prefix is optional)."""
    args = args or speedrun_args()
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    heads = args.model_dim // args.head_dim
    ours = {mine: _take(state, theirs) for theirs, mine in SAME.items()}
    qk, vo, mlp = _take(state, "qk_bank"), _take(state, "vo_bank"), _take(state, "mlp_bank")
    layers = _attention_layers(args)
    if qk.size(0) < heads * len(layers) or vo.size(0) < 2 * len(layers) or mlp.size(0) < args.num_layers:
        raise WeightsError(f"banks too small for {len(layers)} attention layers of {heads} heads and "
                           f"{args.num_layers} MLPs: qk_bank {tuple(qk.shape)}, vo_bank {tuple(vo.shape)}, "
                           f"mlp_bank {tuple(mlp.shape)}")
    for a, layer in enumerate(layers):
        ours[f"blocks.{layer}.attn.qk"] = qk[heads * a:heads * (a + 1)]
        ours[f"blocks.{layer}.attn.vo"] = vo[2 * a:2 * a + 2]
    for layer in range(args.num_layers):
        ours[f"blocks.{layer}.mlp.fc"] = mlp[layer, 0]
        ours[f"blocks.{layer}.mlp.proj"] = mlp[layer, 1]
    for name, value in rotary_state(args, args.num_iterations if step is None else step).items():
        ours[f"rotary.{name}"] = value
    return ours


def ours_to_record(state: dict, args: T.Hyperparameters | None = None, like: dict | None = None,
                   prefix: str | None = None) -> dict:
    """The record's state dict (as its compiled model's state_dict() names it, unless prefix says
    otherwise) from ours. The record's padding comes from `like` (a record state dict) when given, else
    zeros, laid out for 8 ranks."""
    args = args or speedrun_args()
    if like is not None:
        prefix = COMPILED_PREFIX if any(k.startswith(COMPILED_PREFIX) for k in like) else ""
        like = {k.removeprefix(COMPILED_PREFIX): v for k, v in like.items()}
    prefix = COMPILED_PREFIX if prefix is None else prefix
    heads = args.model_dim // args.head_dim
    record = {theirs: _take(state, mine) for theirs, mine in SAME.items()}
    layers = _attention_layers(args)
    qk = torch.cat([_take(state, f"blocks.{layer}.attn.qk") for layer in layers])
    vo = torch.cat([_take(state, f"blocks.{layer}.attn.vo") for layer in layers])
    mlp = torch.stack([torch.stack([_take(state, f"blocks.{layer}.mlp.fc"), _take(state, f"blocks.{layer}.mlp.proj")])
                       for layer in range(args.num_layers)])

    def padded(used: torch.Tensor, name: str, rows: int) -> torch.Tensor:
        if like is not None:
            full = _take(like, name).clone()
            if full.shape[1:] != used.shape[1:] or full.size(0) < used.size(0):
                raise WeightsError(f"like[{name!r}] has shape {tuple(full.shape)}, not a padded {tuple(used.shape)}")
        else:
            full = used.new_zeros((rows, *used.shape[1:]))
        full[:used.size(0)] = used
        return full

    record["qk_bank"] = padded(qk, "qk_bank", -(-qk.size(0) // RECORD_WORLD_SIZE) * RECORD_WORLD_SIZE)
    record["vo_bank"] = padded(vo, "vo_bank", -(-vo.size(0) // RECORD_WORLD_SIZE) * RECORD_WORLD_SIZE)
    record["mlp_bank"] = padded(mlp, "mlp_bank", max(RECORD_MLP_LAYERS, args.num_layers))
    return {prefix + k: v for k, v in record.items()}


def load_state(path: Path, trust: bool) -> dict:
    """A state dict from a file: the record's model.state_dict(), or its checkpoint (key "model")."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=not trust)
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except Exception as e:
        hint = " (the record's checkpoints hold its optimizer's Python objects: --trust loads them, if you " \
               "trust the file)" if not trust else ""
        raise WeightsError(f"{path}: cannot load ({T.first_line(e)}){hint}") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsError(f"{path}: not a state dict of tensors")
    return data


def write_final_folder(state: dict, args: T.Hyperparameters, out: Path, step: int, source: str):
    """A final-weights folder (model.pt, config.json) as train_gpt.py --save_final=true writes one."""
    if out.exists():
        raise WeightsError(f"{out}: already exists; choose a new folder")
    model = T.GPT(args)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise WeightsError(f"the converted weights do not fit train_gpt.py's model ({T.first_line(e)})") from None
    info = {"format": T.FINAL_WEIGHTS_FORMAT, "config": dataclasses.asdict(args), "step": step, "val_loss": None,
            "windows": list(T.Schedule(args).windows(args.num_iterations, final_validation=True)),
            "code_sha256": None, "converted_from": source}
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        T.write_file(tmp / "model.pt", model.state_dict())
        T.write_file(tmp / "config.json", json.dumps(info, indent=1).encode())
        T.publish_folder(tmp, out)
    except (OSError, T.TrainingError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightsError(f"cannot write {out}: {T.first_line(e)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert weights between record #85 v3's GPT and train_gpt.py's.")
    sub = parser.add_subparsers(dest="command", required=True)
    to_ours = sub.add_parser("to-ours", help="a record state dict (or its checkpoint) -> a final-weights folder")
    to_ours.add_argument("state")
    to_ours.add_argument("out", help="the final-weights folder to create")
    to_ours.add_argument("--step", type=int, default=None, help="schedule step of the weights (default: the end): "
                                                                  "fixes the rotary state")
    to_ours.add_argument("--trust", action="store_true", help="load a full pickle (the record's checkpoints)")
    to_record = sub.add_parser("to-record", help="a final-weights folder -> the record's state dict (.pt)")
    to_record.add_argument("folder")
    to_record.add_argument("out")
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    options = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        if options.command == "to-ours":
            args = T.parse_args(["--preset=speedrun", *flags], cuda_available=True)
            state = record_to_ours(load_state(Path(options.state), options.trust), args, options.step)
            step = args.num_iterations if options.step is None else options.step
            write_final_folder(state, args, Path(options.out), step, str(options.state))
            print(f"wrote {options.out} (sample.py {options.out}; train_gpt.py --init_from={options.out})")
        else:
            out = Path(options.out)
            if out.exists():
                raise WeightsError(f"{out}: already exists; choose a new file")
            model, args, _ = T.load_final_weights(options.folder, torch.device("cpu"))
            state = ours_to_record({k: v for k, v in model.state_dict().items()}, args)
            T.write_file(out, state)
            print(f"wrote {out}: load it with the record's GPT (compiled) load_state_dict")
    except (WeightsError, T.DataError, T.ConfigError, T.TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

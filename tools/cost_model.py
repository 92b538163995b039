"""Cost model: rank 0's milliseconds per training step on a named GPU machine, from the CPU counts.

    python tools/bench.py --counts --kernels --out=DIR                 # the counts, then this model's table
    python tools/cost_model.py notes/bench/FILE.json [--card=h200]     # the model of counts made before
    python tools/cost_model.py --validate                              # the model against every stored run

Every figure it gives is MODELED, never measured. The counts (tools/op_counts.py, on fake tensors on this CPU) list
every piece of device work a step launches, with its bytes and FLOPs, and what the host does to launch it. The
model prices them:

    device work    each launch costs max(LAUNCH_FLOOR_US, its own time) + KERNEL_GAP_US before the next one:
                   a Triton kernel or an eager element-wise op  bytes / (copy bandwidth x ELEMENTWISE_EFFICIENCY)
                   an eager op with an operand out of order     bytes / (copy bandwidth x STRIDED_EFFICIENCY)
                   a bf16 matmul                                FLOPs / (bf16 peak x MATMUL_EFFICIENCY)
                   an FP8 matmul                                the same at FP8_SPEEDUP x the bf16 rate
                   a FlexAttention template                     dense FLOPs / (bf16 peak x ATTENTION_EFFICIENCY)
                   the bench's loopback collectives             2 x (rank 0's share of each buffer) / bandwidth
    host           (eager ops + kernels a compiled graph launches x LAUNCH_SHARE + graph calls x GRAPH_CALL_SHARE)
                   x HOST_US_PER_EAGER_OP, divided by the machine's host speed
    a step         (device^p + host^p)^(1/p), p = OVERLAP_POWER: no step syncs, so the host runs ahead and the
                   slower of the two sets the pace, less so the closer they are; no kernel runs in
                   1 - (device - gaps) / step of it, the idle share a profile would show

The constants are fitted once (fit()) to the one H100 run there is, 40c201b's stage 3
(notes/bench/2026-11-26-h100-40c201b-stage3-profile.json), from 40c201b's counts
(notes/bench/2026-11-28-cpu-counts-40c201b.json): each kind of kernel's share of the profile, the block masks'
time, which is host work (177 eager ops of a few hundred bytes), and the rank steps' time. With the same
constants, the H200's copy bandwidth and the H200 machine's host speed, validate() predicts the H200 runs of the
same code, which the fit never saw. Without --kernels the counts hold the compiled graphs' aten ops one by one,
so the model prices them unfused: an upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The stdlib-only reader and escape the torch-free scripts share (data/safe_write.py, train_gpt.py's twin): this
# model runs without torch.
sys.path.insert(0, str(REPO / "data"))
import safe_write  # noqa: E402

BENCH_NOTES = REPO / "notes" / "bench"
H100_RUN = BENCH_NOTES / "2026-11-26-h100-40c201b-stage3-profile.json"
H200_RUNS = (BENCH_NOTES / "2026-11-26-h200-all-parts.json", BENCH_NOTES / "2026-11-26-h200-stage3-profile-stage1.json")
COUNTS_40C201B = BENCH_NOTES / "2026-11-28-cpu-counts-40c201b.json"

# The record each preset runs, its logged 8xH100 ms per step in each stage and whole run. Record #85's ten public
# logs (they agree to 0.1 ms) stand for record89 and record85: no public log ran record #89 as that preset has it
# (notes/record89.md), and the two share the model and stages. The speedrun is record #92's (modded-nanogpt PR #360,
# "ANVIL2"): its log's ms per step in each of its five phases, rounded as the log's step times give them, and 39.9 s.
RECORD_MS_85 = {"stage 1": 32.4, "stage 2": 58.0, "stage 3": 84.0, "extension": 85.1}
RECORD_MS = {"speedrun": {"stage 1": 17.0, "stage 2": 30.0, "stage 3": 46.0, "taper": 46.0, "extension": 22.0},
             "record89": RECORD_MS_85, "record85": RECORD_MS_85}
RECORD_TOTAL_S = {"speedrun": 39.9, "record89": 75.5, "record85": 75.5}
RECORD_NAME = {"speedrun": "record #92", "record89": "record #85 v3", "record85": "record #85 v3"}
RECORD_PRESETS = tuple(RECORD_MS)
# NVLink bus bandwidth for the 8xH100 estimate's collectives: nccl-tests' large-message all-gather on 8xH100 SXM
# (assumed, not measured here), all of it counted as not overlapped, as tools/bench.py's estimate does.
BUS_GBPS = 360.0

# Which sources of the counts a bench forward+backward runs (the masks prebuilt, no optimizer, no hooks).
FORWARD_BACKWARD = ("forward graphs", "backward graphs", "loss head", "model, between its graphs",
                    "autograd engine (backward of eager code, gradient adds)")
GAPS = "gaps between kernels"  # device time no kernel runs in: a profile counts it idle
# The profile's kinds of kernel (tools/bench.py kernel_kind) for each kind of counted work (op_counts.WORK_KINDS).
PROFILE_KIND = {"triton": "element-wise and reductions", "eager": "element-wise and reductions",
                "eager strided": "element-wise and reductions", "matmul": "matmul", "fp8 matmul": "matmul",
                "attention": "attention", "loopback": "copies"}


@dataclasses.dataclass(frozen=True)
class Card:
    """A GPU machine as the model sees it."""
    name: str
    copy_gbps: float  # device-to-device copy bandwidth, measured on the machine (../shared/perf-notes.md)
    bf16_tflops: float  # an 8192^3 bf16 matmul, measured there
    host_speed: float  # its host's speed against the H100 machine's: the ratio of their block masks' ms
    source: str


# The two machines lent to this project. Both run the same matmul rate (769-798 TFLOP/s measured); the H200's
# memory is 1.43x faster. Its host is faster too: its bench built 40c201b's block masks (host work) in 4.57 and
# 4.43 ms where the H100 machine took 7.61 ms.
CARDS = {
    "h100": Card("NVIDIA H100 80GB HBM3", 3000.0, 798.0, 1.0,
                 "copy 3.0 TB/s, bf16 798 TFLOP/s; host: the fit's reference"),
    "h200": Card("NVIDIA H200", 4300.0, 798.0, 7.61 / 4.50,
                 "copy 4.3 TB/s, bf16 769-798 TFLOP/s; host: block masks 4.57 and 4.43 ms against the H100's 7.61"),
}

# Fitted by fit() to the H100 run of 40c201b (stage 3, steps 852-853; see the module docstring). Rerun
# `python tools/cost_model.py --fit` after new device runs; tests/test_bench.py checks these are fit()'s answer.
LAUNCH_FLOOR_US = 2.0  # assumed: the shortest kernel a Hopper GPU runs (not fitted)
KERNEL_GAP_US = 1.0  # assumed: the device's idle time between two queued kernels, which a profile counts idle
FP8_SPEEDUP = 2.0  # assumed: Hopper's FP8 tensor-core rate over bf16 (the datasheet's ratio)
ELEMENTWISE_EFFICIENCY = 0.8548  # of the copy bandwidth: inductor's byte counts omit re-reads, so this is high
STRIDED_EFFICIENCY = 0.1216  # the FP8 transposed copy's 12 launches, 34.35 ms in the profile
MATMUL_EFFICIENCY = 0.8281
# Inductor's kernel_flop for a FlexAttention template counts every block, visible or not: the rate is per dense
# FLOP, so it is far above the card's (the windows keep 2-20% of the blocks).
ATTENTION_EFFICIENCY = 29.9388
HOST_US_PER_EAGER_OP = 43.0  # the block masks: 7.61 ms for 177 eager ops on the H100 machine's host
OVERLAP_POWER = 3.3456  # the H100's rank steps, 153.40 and 159.24 ms
# assumed as fractions of an eager op's host cost (not separable on a device-bound run): a kernel launched by
# inductor's generated code, and a compiled graph's call (guards, AOT autograd's wrapper)
LAUNCH_SHARE, GRAPH_CALL_SHARE = 0.2, 3.0
VALIDATION_TOLERANCE = 0.15  # the bar for every prediction the fit did not see


@dataclasses.dataclass(frozen=True)
class Constants:
    floor_us: float = LAUNCH_FLOOR_US
    fp8_speedup: float = FP8_SPEEDUP
    elementwise: float = ELEMENTWISE_EFFICIENCY
    strided: float = STRIDED_EFFICIENCY
    matmul: float = MATMUL_EFFICIENCY
    attention: float = ATTENTION_EFFICIENCY
    host_op_us: float = HOST_US_PER_EAGER_OP
    gap_us: float = KERNEL_GAP_US
    overlap: float = OVERLAP_POWER

    def rate(self, kind: str, card: Card) -> tuple[str, float]:
        """Whether `kind` is priced by bytes or FLOPs, and its rate in units per microsecond."""
        bandwidth = card.copy_gbps * 1e3  # bytes per us
        flops = card.bf16_tflops * 1e6  # FLOPs per us
        return {"triton": ("bytes", bandwidth * self.elementwise), "eager": ("bytes", bandwidth * self.elementwise),
                "eager strided": ("bytes", bandwidth * self.strided), "matmul": ("flops", flops * self.matmul),
                "fp8 matmul": ("flops", flops * self.matmul * self.fp8_speedup),
                "attention": ("flops", flops * self.attention), "loopback": ("bytes", bandwidth)}[kind]


def launch_us(item: dict, card: Card, constants: Constants, gaps: bool = True) -> float:
    """One launch of a counted piece of work on the device: the kernel, and the gap before the next one starts."""
    unit, rate = constants.rate(item["kind"], card)
    return max(constants.floor_us, item[unit] / rate) + (constants.gap_us if gaps else 0.0)


def loopback_items(step: dict, world_size: int) -> list[dict]:
    """The bench's fake process group copies rank 0's share of each collective's buffer (read and written)."""
    return [{"source": "collectives", "kind": "loopback", "bytes": 2 * nbytes // world_size, "flops": 0, "count": 1}
            for nbytes in step.get("collective_bytes", {}).values()]


def device_part(step: dict, card: Card, constants: Constants, world_size: int, sources=None) -> dict:
    """The device's microseconds for a counted step (or the sources named), by kind of profile kernel."""
    by_kind: dict[str, float] = {}
    items = step["work"] + ([] if sources is not None else loopback_items(step, world_size))
    for item in items:
        if sources is None or item["source"] in sources:
            kind = PROFILE_KIND[item["kind"]]
            by_kind[kind] = by_kind.get(kind, 0.0) + item["count"] * launch_us(item, card, constants, gaps=False)
            by_kind[GAPS] = by_kind.get(GAPS, 0.0) + item["count"] * constants.gap_us
    return by_kind


def host_us(step: dict, card: Card, constants: Constants, sources=None) -> float:
    """The host's microseconds to dispatch a counted step (or the sources named)."""
    def wanted(source):
        return sources is None or source in sources
    eager = sum(n for source, n in step["eager_ops_by_source"].items() if wanted(source))
    # every eager op is one piece of work; the rest were launched by compiled graphs' generated code
    launches = sum(item["count"] for item in step["work"] if wanted(item["source"])) - eager
    calls = sum(n for source, n in step.get("graph_calls_by_source", {}).items() if wanted(source))
    op = constants.host_op_us
    return (eager * op + launches * op * LAUNCH_SHARE + calls * op * GRAPH_CALL_SHARE) / card.host_speed


def combined(device_ms: float, host_ms: float, constants: Constants) -> float:
    """A step's time from its device's and its host's: a smooth maximum, (d^p + h^p)^(1/p). The slower sets the
    pace, and the closer the two are the less of the faster one hides behind it (a launch queue of bounded depth,
    phases that wait on each other); p -> infinity would be perfect overlap, p = 1 none."""
    p = constants.overlap
    return (device_ms ** p + host_ms ** p) ** (1 / p)


def device_by_source(step: dict, card: Card, constants: Constants) -> dict:
    """The device's ms for each source of work and kind of kernel ("loss head: element-wise and reductions"), the
    gaps after each launch included: where a step's time goes."""
    parts: dict[str, float] = {}
    for item in step["work"]:
        key = f"{item['source']}: {PROFILE_KIND[item['kind']]}"
        parts[key] = parts.get(key, 0.0) + item["count"] * launch_us(item, card, constants) / 1e3
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def model_step(step: dict, card: Card, constants: Constants, world_size: int) -> dict:
    """A counted step's modeled ms: the device's by kind and by source, the host's, the step's, and a
    forward+backward's."""
    kinds = device_part(step, card, constants, world_size)
    device = sum(kinds.values()) / 1e3
    host = host_us(step, card, constants) / 1e3
    fb_device = sum(device_part(step, card, constants, world_size, FORWARD_BACKWARD).values()) / 1e3
    fb_host = host_us(step, card, constants, FORWARD_BACKWARD) / 1e3
    step_ms = combined(device, host, constants)
    busy = device - kinds.get(GAPS, 0.0) / 1e3  # what a profile counts busy: kernels running
    return {"device_ms": device, "host_ms": host, "step_ms": step_ms, "idle_share": 1 - busy / step_ms,
            "device_ms_by_kind": {k: v / 1e3 for k, v in sorted(kinds.items())},
            "device_ms_by_source": device_by_source(step, card, constants),
            "forward_backward_ms": combined(fb_device, fb_host, constants), "forward_backward_device_ms": fb_device,
            "forward_backward_host_ms": fb_host}


def communication_ms(step: dict, world_size: int) -> float:
    """A ring's collectives at BUS_GBPS, not overlapped: bytes x (W - 1) / W / bandwidth."""
    total = sum(step.get("collective_bytes", {}).values())
    return total * (world_size - 1) / world_size / (BUS_GBPS * 1e9) * 1e3


def model_counts(counts: dict, card_name: str = "h100", constants: Constants = Constants()) -> dict:
    """The bench JSON's `model` object for tools/op_counts.py's counts: per stage its mean step (each kind of step
    weighted by how many of the stage's steps are of that kind), and the whole run on 8 GPUs against the record's
    (the preset's: RECORD_MS)."""
    world_size, preset = counts["world_size"], record_preset(counts)
    record = RECORD_MS.get(preset, {})
    stages, total = {}, 0.0
    for name, stage in model_stages(counts, card_name, constants).items():
        row = counts["stages"][name]
        weights = step_weights(row)
        comm = sum(weights[kind] * communication_ms(step, world_size) for kind, step in row["steps"].items())
        stage.update(communication_ms=comm, ms_per_step_8_gpus=stage["step_ms"] + comm, record_ms=record.get(name),
                     steps_in_stage=row.get("steps_in_stage"))
        if row.get("steps_in_stage") is not None:
            stage["seconds"] = stage["ms_per_step_8_gpus"] * row["steps_in_stage"] / 1e3
            total += stage["seconds"]
        stages[name] = stage
    complete = bool(record) and set(stages) == set(record) and all("seconds" in s for s in stages.values())
    return {"card": CARDS[card_name].name, "card_profile": card_name, "modeled": True, "preset": preset,
            "record": RECORD_NAME.get(preset), "kernels": counts.get("kernels", False),
            "constants": dataclasses.asdict(constants), "stages": stages,
            "total_s": total if complete else None, "record_total_s": RECORD_TOTAL_S.get(preset),
            "validation": validate() if COUNTS_40C201B.exists() else []}


def record_preset(counts: dict) -> str | None:
    """The preset whose record the counts are compared with. The speedrun preset ran record #89's algorithm until it
    became record #92's; counts made before then (no stage has kind_steps: the stored ones in notes/bench/) are
    compared with record #85 v3's logs, as they were."""
    preset = counts.get("preset")
    if preset == "speedrun" and not any("kind_steps" in row for row in counts["stages"].values()):
        return "record89"
    return preset


def step_weights(row: dict) -> dict[str, float]:
    """Each counted kind of step's share of the stage's steps (kind_steps, tools/op_counts.py); counts made before
    there were kinds to weigh (40c201b's: one step without Adam, one with it, as their stages alternate) weigh
    them equally."""
    shares = {kind: row.get("kind_steps", {}).get(kind, 0) for kind in row["steps"]}
    if not sum(shares.values()):
        return {kind: 1 / len(row["steps"]) for kind in row["steps"]}
    return {kind: n / sum(shares.values()) for kind, n in shares.items()}


def model_stages(counts: dict, card_name: str, constants: Constants) -> dict:
    """Per stage: each counted step modeled, and the stage's mean step (step_weights)."""
    card, world_size, out = CARDS[card_name], counts["world_size"], {}
    for name, row in counts["stages"].items():
        steps = {kind: model_step(step, card, constants, world_size) for kind, step in row["steps"].items()}
        weights = step_weights(row)
        mean = lambda key: sum(weights[kind] * s[key] for kind, s in steps.items())  # noqa: E731
        kinds: dict[str, float] = {}
        for kind_of_step, s in steps.items():
            for kind, ms in s["device_ms_by_kind"].items():
                kinds[kind] = kinds.get(kind, 0.0) + weights[kind_of_step] * ms
        out[name] = {"device_ms": mean("device_ms"), "host_ms": mean("host_ms"), "step_ms": mean("step_ms"),
                     "idle_share": 1 - (mean("device_ms") - kinds.get(GAPS, 0.0)) / mean("step_ms"),
                     "device_ms_by_kind": kinds, "step_weights": weights,
                     "forward_backward_ms": mean("forward_backward_ms"), "steps": steps}
    return out


# -----------------------------------------------------------------------------
# Fit and validation against the stored device runs

MAX_BENCH_BYTES = 256 << 20  # a bench.json with counts is a few MB
# A figure of the counts (bytes, FLOPs, a count) is an integer in practice, and at most this: sums and products of
# such figures over a step stay finite in a float, so every modeled ms is finite.
MAX_FIGURE = 2 ** 63


class CountsError(ValueError):
    """A bench.json that is not one with CPU counts: one line, naming the field (a path like stages['stage 1'])."""


def load(path: Path) -> dict:
    """A bench.json (or a stored run's JSON) through the one reader: a regular file of at most MAX_BENCH_BYTES, opened
    without blocking (a FIFO blocked this tool), JSON nested thousands deep refused in a line (a RecursionError
    traceback before); a JSON object."""
    data = safe_write.read_json(path, "a bench.json", MAX_BENCH_BYTES)
    if not isinstance(data, dict):
        raise CountsError(f"a JSON {type(data).__name__}, not an object")
    return data


def _field(value, kind, where: str):
    """value, of the JSON type `kind` (a bool is no number), or a CountsError naming where it is."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        found = "missing" if value is None else f"a {type(value).__name__}"
        wanted = {dict: "an object", list: "a list", str: "text", int: "an integer", bool: "true or false"}.get(
            kind, "a number")
        raise CountsError(f"{where} is {found}, not {wanted}")
    return value


def _figure(value, where: str) -> float:
    """A count, byte or FLOP figure: a finite number from 0 to MAX_FIGURE (NaN counts once printed "nan s")."""
    number = _field(value, (int, float), where)
    if not 0 <= number <= MAX_FIGURE:  # NaN fails too
        raise CountsError(f"{where} is {number!r}, not a figure (a finite number from 0 to 2**63)")
    return number


def _figures(value, where: str) -> dict:
    return {k: _figure(v, f"{where}[{k!r}]") for k, v in _field(value, dict, where).items()}  # (JSON keys are text)


def read_counts(bench: dict) -> dict:
    """bench["counts"] once it is what tools/op_counts.py writes, every field this model reads of its type and
    range: the world size a count of ranks, stages and steps objects (a list where an object belongs was an
    AttributeError traceback), each piece of work of a known kind, every figure finite and bounded. Else a
    CountsError naming the first field that is not."""
    counts = _field(bench.get("counts"), dict, "counts")
    world_size = _field(counts.get("world_size"), int, "counts.world_size")
    if not 1 <= world_size <= MAX_FIGURE:
        raise CountsError(f"counts.world_size is {world_size}, not a count of ranks")
    for key, kind in (("preset", str), ("kernels", bool)):
        if counts.get(key) is not None:
            _field(counts[key], kind, f"counts.{key}")
    stages = _field(counts.get("stages"), dict, "counts.stages")
    if not stages:
        raise CountsError("counts.stages is empty")
    for name, stage in stages.items():
        where = f"counts.stages[{name!r}]"
        _field(stage, dict, where)
        if stage.get("steps_in_stage") is not None:
            _field(stage["steps_in_stage"], int, f"{where}.steps_in_stage")
            _figure(stage["steps_in_stage"], f"{where}.steps_in_stage")
        if stage.get("kind_steps") is not None:
            _figures(stage["kind_steps"], f"{where}.kind_steps")
        steps = _field(stage.get("steps"), dict, f"{where}.steps")
        if not steps:
            raise CountsError(f"{where}.steps is empty")
        for kind, step in steps.items():
            at = f"{where}.steps[{kind!r}]"
            _field(step, dict, at)
            for i, item in enumerate(_field(step.get("work"), list, f"{at}.work")):
                item_at = f"{at}.work[{i}]"
                _field(item, dict, item_at)
                _field(item.get("source"), str, f"{item_at}.source")
                if _field(item.get("kind"), str, f"{item_at}.kind") not in PROFILE_KIND:
                    raise CountsError(f"{item_at}.kind is {item['kind'][:40]!r}, not one this model prices "
                                      f"({', '.join(PROFILE_KIND)})")
                for figure in ("bytes", "flops", "count"):
                    _figure(item.get(figure), f"{item_at}.{figure}")
            _figures(step.get("eager_ops_by_source"), f"{at}.eager_ops_by_source")
            for optional in ("graph_calls_by_source", "collective_bytes"):
                if step.get(optional) is not None:
                    _figures(step[optional], f"{at}.{optional}")
    return counts


def profile_ms_by_kind(profile: dict) -> dict:
    """A profile's ms per step for each kind of kernel (its shares are of the span of its two steps)."""
    span = profile["span_ms"]
    return {kind: share * span / len(profile["steps"]) for kind, share in profile["shares_by_kind"].items()
            if kind != "idle gaps"}


def solve(target: float, price, low: float = 1e-4, high: float = 100.0) -> float:
    """The e at which price(e), a decreasing function, is target: bisection (on a log scale for rates)."""
    middle = (lambda a, b: math.sqrt(a * b)) if low > 0 else (lambda a, b: (a + b) / 2)
    for _ in range(100):
        mid = middle(low, high)
        low, high = (mid, high) if price(mid) > target else (low, mid)
    return middle(low, high)


def fit(counts: dict | None = None, run: dict | None = None) -> Constants:
    """The constants from 40c201b's stage 3 on the H100: each kind's efficiency so that the modeled kind matches
    the profile's ms for that kind (the strided copies matched to the profile's strided-copy kernel, the FP8
    transposed copy), and the host's cost per eager op from the block masks' time (host work)."""
    counts = counts or load(COUNTS_40C201B)["counts"]
    run = run or load(H100_RUN)
    card = CARDS["h100"]
    profile = run["parts"]["profile"]["by_stage"]["stage 3"]
    measured = profile_ms_by_kind(profile)
    steps = list(counts["stages"]["stage 3"]["steps"].values())
    items = [dict(item, count=item["count"] / len(steps)) for step in steps for item in step["work"]]
    c = Constants()

    def kind_us(kinds, **change):
        trial = dataclasses.replace(c, **change)
        return sum(i["count"] * launch_us(i, card, trial, gaps=False) for i in items if i["kind"] in kinds)

    strided_ms = sum(k["ms"] for k in profile["top"] if "elementwise_kernel<" in k["name"]
                     and "vectorized" not in k["name"]) / len(profile["steps"])
    c = dataclasses.replace(c, strided=solve(strided_ms * 1e3, lambda e: kind_us({"eager strided"}, strided=e)))
    rest = (measured["element-wise and reductions"] - strided_ms) * 1e3
    c = dataclasses.replace(c, elementwise=solve(rest, lambda e: kind_us({"triton", "eager"}, elementwise=e)))
    c = dataclasses.replace(c, matmul=solve(measured["matmul"] * 1e3,
                                            lambda e: kind_us({"matmul", "fp8 matmul"}, matmul=e)))
    c = dataclasses.replace(c, attention=solve(measured["attention"] * 1e3,
                                               lambda e: kind_us({"attention"}, attention=e)))
    masks_ops = sum(step["eager_ops_by_source"].get("block masks", 0) for step in steps) / len(steps)
    masks_ms = run["parts"]["stage3"]["masks"]["median_ms"]
    c = dataclasses.replace(c, host_op_us=round(masks_ms * 1e3 / masks_ops, 2))
    fitted = ("elementwise", "strided", "matmul", "attention")
    c = dataclasses.replace(c, **{f: round(getattr(c, f), 4) for f in fitted})
    # how much of the faster side hides behind the slower: the H100's rank steps, the mean of the two kinds
    rank_steps = [run["parts"]["stage3"][f"rank_step_{kind}"]["median_ms"] for kind in ("without_Adam", "with_Adam")]

    def steps_ms(overlap):
        trial = dataclasses.replace(c, overlap=overlap)
        return sum(model_step(step, card, trial, counts["world_size"])["step_ms"] for step in steps) / len(steps)
    return dataclasses.replace(c, overlap=round(solve(sum(rank_steps) / len(rank_steps), steps_ms, 1.0, 64.0), 4))


BENCH_PART = {"stage 1": "stage1", "stage 2": "stage2", "stage 3": "stage3", "extension": "extension"}


def validate(constants: Constants = Constants()) -> list[dict]:
    """Rows of {what, measured_ms, predicted_ms, error, fitted, quantity}: every stored measurement of 40c201b's
    code that the model predicts: forward+backward and the rank steps per stage, on the H100 (fitted: in sample)
    and in each H200 run (out of sample), with the mean of the runs where a quantity was measured more than once;
    and the H100 profile's shares by kind (percentage points, in sample)."""
    counts = load(COUNTS_40C201B)["counts"]
    rows = []
    for card_name, paths, fitted in (("h100", (H100_RUN,), True), ("h200", H200_RUNS, False)):
        modeled = model_stages(counts, card_name, constants)
        for path in paths:
            run = load(path)
            for stage, part in BENCH_PART.items():
                row, model = run["parts"].get(part), modeled.get(stage)
                if not row or model is None or "forward_backward" not in row:
                    continue
                checks = [("forward+backward", row["forward_backward"], model["forward_backward_ms"])]
                for kind in ("without Adam", "with Adam"):
                    key = f"rank_step_{kind.replace(' ', '_')}"
                    if key in row and kind in model["steps"]:
                        checks.append((f"rank step {kind}", row[key], model["steps"][kind]["step_ms"]))
                for what, cell, predicted in checks:
                    rows.append({"what": f"{card_name} {path.name}: {stage} {what}", "measured_ms": cell["median_ms"],
                                 "predicted_ms": predicted, "error": predicted / cell["median_ms"] - 1,
                                 "fitted": fitted, "quantity": f"{card_name}: {stage} {what}"})
    for quantity in dict.fromkeys(r["quantity"] for r in rows):  # measured in several runs: their mean too
        runs = [r for r in rows if r["quantity"] == quantity]
        if len(runs) > 1:
            measured = sum(r["measured_ms"] for r in runs) / len(runs)
            rows.append({"what": f"{quantity}, the mean of {len(runs)} runs", "measured_ms": measured,
                         "predicted_ms": runs[0]["predicted_ms"], "error": runs[0]["predicted_ms"] / measured - 1,
                         "fitted": runs[0]["fitted"], "quantity": quantity, "runs": len(runs)})
    run = load(H100_RUN)
    profile = run["parts"]["profile"]["by_stage"]["stage 3"]
    stage = model_stages(counts, "h100", constants)["stage 3"]
    busy = sum(ms for kind, ms in stage["device_ms_by_kind"].items() if kind != GAPS)
    measured_busy = sum(profile_ms_by_kind(profile).values())
    for kind, ms in profile_ms_by_kind(profile).items():
        rows.append({"what": f"h100 profile: share of busy time, {kind}", "measured_share": ms / measured_busy,
                     "predicted_share": stage["device_ms_by_kind"].get(kind, 0.0) / busy,
                     "error_points": 100 * (stage["device_ms_by_kind"].get(kind, 0.0) / busy - ms / measured_busy),
                     "fitted": True})
    return rows


# -----------------------------------------------------------------------------
# Tables

def markdown(model: dict) -> list[str]:
    lines = [f"## Modeled step on one {model['card']} (a model of the CPU counts, not a measurement)", "",
             "Rank 0 of 8, per step (each counted kind of step weighted by its share of the stage's steps); the 8-GPU "
             "step adds the "
             f"collectives at {BUS_GBPS:.0f} GB/s, not overlapped." + ("" if model["kernels"] else
                                                                        " Counted without --kernels: the compiled "
                                                                        "graphs' ops priced unfused (an upper "
                                                                        "bound)."), "",
             "| stage | device ms (modeled) | host ms (modeled) | step ms (modeled) | idle | forward+backward ms "
             f"(modeled) | 8-GPU ms per step (modeled) | {model.get('record') or 'the record'}'s ms | seconds "
             "(modeled) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in model["stages"].items():
        record = s["record_ms"]
        lines.append(f"| {name} | {s['device_ms']:.1f} | {s['host_ms']:.1f} | {s['step_ms']:.1f} | "
                     f"{s['idle_share']:.0%} | {s['forward_backward_ms']:.1f} | {s['ms_per_step_8_gpus']:.1f} | "
                     f"{record if record is not None else 'n/a'} | "
                     f"{s['seconds']:.1f} |" if "seconds" in s else
                     f"| {name} | {s['device_ms']:.1f} | {s['host_ms']:.1f} | {s['step_ms']:.1f} | "
                     f"{s['idle_share']:.0%} | {s['forward_backward_ms']:.1f} | {s['ms_per_step_8_gpus']:.1f} | "
                     f"{record if record is not None else 'n/a'} | n/a |")
    if model["total_s"] is not None:
        lines.append(f"| **8xH100 run (modeled)** | | | | | | | {model['record_total_s']} s | "
                     f"**{model['total_s']:.1f} s** |")
    lines += ["", "Where the device's time goes, per stage (modeled ms per step; each source's kernels with the gaps "
              "after them):", ""]
    for name, s in model["stages"].items():
        parts: dict[str, float] = {}
        for step in s["steps"].values():
            for part, ms in step["device_ms_by_source"].items():
                parts[part] = parts.get(part, 0.0) + ms / len(s["steps"])
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"- {name}: " + ", ".join(f"{part} {ms:.1f}" for part, ms in top))
    lines.append("")
    if model["validation"]:
        lines += validation_markdown(model["validation"])
    return lines


def validation_markdown(rows: list[dict]) -> list[str]:
    lines = ["Validation: the model of 40c201b's counts against the stored device runs (fitted: the H100 run the "
             "constants come from; the H200 rows are out of sample).", "",
             "| what | measured | modeled | error | fitted |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "measured_ms" in r:
            lines.append(f"| {r['what']} | {r['measured_ms']:.1f} ms | {r['predicted_ms']:.1f} ms | "
                         f"{r['error']:+.1%} | {'yes' if r['fitted'] else 'no'} |")
        else:
            lines.append(f"| {r['what']} | {r['measured_share']:.1%} | {r['predicted_share']:.1%} | "
                         f"{r['error_points']:+.1f} points | {'yes' if r['fitted'] else 'no'} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/cost_model.py", description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", nargs="?", help="a bench.json with CPU counts (tools/bench.py --counts)")
    parser.add_argument("--card", choices=sorted(CARDS), default="h100")
    parser.add_argument("--fit", action="store_true", help="refit the constants to the stored H100 run and print them")
    parser.add_argument("--validate", action="store_true", help="the model against every stored device run")

    def one_line_error(message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # argparse's own adds the usage: bad input gets one line
    options = parser.parse_args(argv)
    if options.fit:
        print(json.dumps(dataclasses.asdict(fit()), indent=2))
        return 0
    if options.validate:
        show(validation_markdown(validate()))
        return 0
    if not options.bench_json:
        parser.error("give a bench.json, --fit or --validate")
    try:
        counts = read_counts(load(Path(options.bench_json)))
        table = markdown(model_counts(counts, options.card))
    except (safe_write.FileRefused, CountsError, ZeroDivisionError) as e:  # (ZeroDivisionError: no work counted)
        why = e.why if isinstance(e, safe_write.FileRefused) else e if isinstance(e, CountsError) else \
            "a step that counts no work"
        show([f"error: {options.bench_json}: not a bench.json with CPU counts ({why})"], sys.stderr)
        return 2
    show(table)
    return 0


def show(lines: list[str], stream=None):
    """Lines to the terminal through the one escape (safe_write.visible): stage and source names come from the
    counts' file, and reached the terminal raw."""
    print("\n".join(map(safe_write.visible, lines)), file=stream or sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

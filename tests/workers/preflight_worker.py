"""Runs tools/preflight.py on several scenarios in one process and prints one JSON line per scenario.

The fake CUDA device must be loaded before torch is imported, and once per process, so the
preflight tests share this process (one start-up instead of one per scenario). A scenario may
inject a mistake into a copy of one of train_gpt.py's functions, compiled under train_gpt.py's name
and line numbers, so that the preflight names it as it would name the real mistake.

    python tests/workers/preflight_worker.py SCENARIO [SCENARIO ...]
"""

import contextlib
import dataclasses
import inspect
import io
import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tools"), str(REPO)]
import fake_cuda  # noqa: E402

fake_cuda.load()
import preflight  # noqa: E402
import torch  # noqa: E402
import train_gpt as T  # noqa: E402

# Reduced width (128, four heads of 32, narrow heads of 16, MLPs of 512) with the speedrun's (record #92's)
# structure, windows, schedule, sequence lengths and batches: fake tensors cost about the same at any size, but the
# host-side bookkeeping shrinks. ONE_LENGTH gives the four stages one batch and sequence length: the same phases and
# code, with one training graph per layer to compile instead of four (the full schedule's graphs are world_size_8's).
SMALL = ["--model_dim=128", "--head_dim=32", "--narrow_dim=16", "--rotary_dims=16", "--head_mix_groups=8",
         "--mlp_hidden=512"]
ONE_LENGTH = [*SMALL, "--stage_batch_tokens=131072,131072,131072,131072", "--stage_max_seq_len=2048,2048,2048,2048"]
TINY = [*ONE_LENGTH, "--micro_batches=1", "--compile=false"]
# Two steps, the first without Adam and the second with it: every kernel compiles in the first (four steps, one a
# stage, compiled the same 42 configurations of the same 8 kernels for sm_90, and took 9 s longer). No stage grows.
TWO_STEPS = ["--num_iterations=2", "--extension_steps=1", "--grown_steps=0"]
SCENARIOS = {
    # the speedrun preset itself: its memory per phase and collectives as they will be
    "world_size_8": (["--world_size=8"], None),
    # inductor on FlexAttention's kernels (forward and backward, each kind of mask, and validation's) for sm_90, in
    # two steps (the kernels are the same at every step); the whole compiled step takes about 8 minutes on 2 cores
    # (`python tools/preflight.py --backend=inductor`)
    "inductor": (["--world_size=8", "--backend=inductor", "--", *ONE_LENGTH, "--compile=false", *TWO_STEPS], None),
    # the same flags after it in this process, on an RTX 4090 (sm_89, 99 KiB per block): compiled and counted afresh
    "inductor_rtx4090": (["--gpu=rtx4090", "--world_size=8", "--backend=inductor", "--", *ONE_LENGTH, "--compile=false",
                          *TWO_STEPS], None),
    # A host sync: logging each micro-batch's loss as a Python number.
    "host_sync": (["--world_size=8", "--", *ONE_LENGTH, "--compile=false"],
                  ("train_step", "loss_sum += loss.detach()", "loss_sum += loss.item()")),
    # A blocking copy from the host (pageable memory): CUDA makes the host wait for the device.
    "blocking_copy": (["--world_size=8", "--", *ONE_LENGTH, "--compile=false"],
                      ("train_step", "mtp = host_to_device(torch.tensor(schedule.mtp_weights(step)), device)",
                       "mtp = torch.tensor(schedule.mtp_weights(step)).to(device)")),
    # A CPU tensor created inside the step: harmless on CPU, a device mismatch on CUDA.
    "cpu_tensor": (["--world_size=8", "--", *ONE_LENGTH, "--compile=false"],
                   ("block_mask_parts", "blocks = torch.arange(docs.numel() // block_size, device=docs.device)",
                    "blocks = torch.arange(docs.numel() // block_size)")),
    # Record #92's full-FP8 MLP with its up-projection's weight operand made row-major: CPU's _scaled_mm takes it,
    # CUDA's refuses it.
    "fp8_layout": (["--world_size=8", "--", *ONE_LENGTH, "--compile=false"],
                   ("Fp8ReluSquaredMLP", "scaled_mm(x8, s.fc8.T, MLP_X_SCALE",
                    "scaled_mm(x8, s.fc8.T.contiguous(), MLP_X_SCALE")),
    # A recipe far larger than this host's memory (billions of parameters at width 8,192): the trainer's start-up
    # check refuses it, before anything is built, since no micro-batch and no n-gram table can make it fit an H100.
    "huge": (["--world_size=8", "--", "--model_dim=8192", "--head_dim=128", "--head_mix_groups=8", "--mlp_hidden=32768",
              "--compile=false"], None),
    # World size 1 on a card without FP8 matmuls, which cannot hold record #92's n-gram table (84,602,880 rows, 20.2
    # GiB at width 128): the fallback to bf16, and the table size the preflight finds and checks in a second run,
    # which passes every phase of the schedule with --compile=false and the checkpoint writers (asked for by
    # --save_every and --save_final). A step is one micro-batch of 262,144 tokens, which leaves the table little
    # room (a small table: the checkpoint writers materialise it on the host), with 40,960 candidates (more than its
    # distinct targets), then 49,152 over stage 3's last third (a new shape, as the speedrun's). The trainer's own
    # start-up check refuses the first run, before anything is built. The compiled step at world size 1 on an H100
    # is `python tools/preflight.py --world_size=1 -- --bigram_vocab_size=16777216`, about 10 minutes.
    "rtx3090_too_big": (["--gpu=rtx3090", "--world_size=1", "--", *TINY,
                         "--stage_batch_tokens=262144,262144,262144,262144",
                         "--stage_softmax_candidates=40960,40960,40960|40960|49152,0", "--val_seq_len=16384",
                         "--save_every=4", "--save_final=true"], None),
}


@contextlib.contextmanager
def replaced_in_trainer(name: str, old: str, new: str):
    """train_gpt.<name> replaced by a copy of its source with `old` changed to `new`, for the duration."""
    original = getattr(T, name)
    lines, first = inspect.getsourcelines(original)
    source = "".join(lines)
    assert source.count(old) == 1, (name, old)
    exec(compile("\n" * (first - 1) + source.replace(old, new), T.__file__, "exec"), T.__dict__)
    try:
        yield
    finally:
        setattr(T, name, original)


def card_decisions() -> dict:
    """What the trainer decides on each card of fake_cuda.GPUS for the speedrun preset: the name, capability
    and memory it is told, the precision `auto` picks, its refusal of FP8 where there is none, and its
    refusal of SDPA's dense mask, which names the card's memory; and its start-up memory plan there for the
    reduced-width recipe under --micro_batches=auto at world size 8 (the counts, the log lines)."""
    cuda, cards = torch.device("cuda", 0), {}
    for name, card in fake_cuda.GPUS.items():
        fake_cuda.pretend_gpu(card)
        args = T.parse_args(["--preset=speedrun"], True)
        seen = {"name": torch.cuda.get_device_name(cuda), "capability": list(torch.cuda.get_device_capability(cuda)),
                "memory": torch.cuda.get_device_properties(cuda).total_memory,
                "auto": [T.resolve_precision(args, cuda, flag) for flag in ("lm_head_precision", "mlp_precision")]}
        for key, flags, resolve in (("fp8", ["--mlp_precision=fp8"], lambda a: T.resolve_precision(a, cuda, "mlp_precision")),
                                    ("sdpa", ["--attention=sdpa"], lambda a: T.resolve_attention(a, cuda))):
            try:
                seen[key] = resolve(T.parse_args(["--preset=speedrun", *flags], True))
            except T.ConfigError as e:
                seen[key] = f"error: {e}"
        args = T.parse_args(["--preset=speedrun", *ONE_LENGTH, "--micro_batches=auto"], True)
        plan = T.plan_memory(args, 8, cuda, T.resolve_numerics(args, cuda), T.resolve_attention(args, cuda))
        seen["plan"] = {"micro_batches": plan.config.micro_batches, "lines": plan.lines,
                        "peaks": {phase: row["peak"] for phase, row in plan.rows.items()}}
        cards[name] = seen
    fake_cuda.pretend_gpu(fake_cuda.H100)
    return {"scenario": "cards", "cards": cards}


def run(scenario: str) -> dict:
    argv, injection = SCENARIOS[scenario]
    reports = []
    print_report = preflight.print_report
    preflight.print_report = lambda report: (reports.append(report), print_report(report))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if injection:
            stack.enter_context(replaced_in_trainer(*injection))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        code = preflight.main(argv)
    preflight.print_report = print_report
    result = {"scenario": scenario, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
    if reports:
        report = reports[0]
        result.update({field.name: getattr(report, field.name) for field in dataclasses.fields(report)
                       if field.name != "args"})
    return result


if __name__ == "__main__":
    for name in sys.argv[1:]:
        started = time.perf_counter()
        result = card_decisions() if name == "cards" else run(name)
        result["seconds"] = time.perf_counter() - started
        result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # so far, this process
        print(json.dumps(result, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)),
              flush=True)

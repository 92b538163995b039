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
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tools"), str(REPO)]
import fake_cuda  # noqa: E402

fake_cuda.load()
import preflight  # noqa: E402
import train_gpt as T  # noqa: E402

# Reduced width (64, one head of 64) with the speedrun's structure, windows, schedule, sequence lengths
# and batch: fake tensors cost the same at any size, but building the model for real on the host and
# the FLOP-free bookkeeping shrink with it. At world size 1 the batch is 2 micro-batches instead of 8:
# gradient accumulation and Adam's no_sync are the same code for 2 as for 8, at a quarter of the time.
SMALL = ["--model_dim=64", "--head_dim=64"]
SCENARIOS = {
    "world_size_1": (["--world_size=1", "--", *SMALL, "--batch_tokens=65536"], None),
    "world_size_8": (["--world_size=8", "--", *SMALL], None),
    # --compile=false, and the checkpoint writers (asked for by --save_every and --save_final)
    "compile_false": (["--world_size=8", "--", *SMALL, "--compile=false", "--save_every=2", "--save_final=true"],
                      None),
    "inductor": (["--world_size=8", "--backend=inductor", "--", *SMALL], None),
    # A host sync: logging each micro-batch's loss as a Python number.
    "host_sync": (["--world_size=8", "--", *SMALL, "--compile=false"],
                  ("train_step", "loss_sum += loss.detach()", "loss_sum += loss.item()")),
    # A CPU tensor created inside the step: harmless on CPU, a device mismatch on CUDA.
    "cpu_tensor": (["--world_size=8", "--", *SMALL, "--compile=false"],
                   ("flex_block_mask", "blocks = torch.arange(length // block_size, device=docs.device)",
                    "blocks = torch.arange(length // block_size)")),
    # The FP8 head's weight operand made row-major: CPU's _scaled_mm takes it, CUDA's refuses it.
    "fp8_layout": (["--world_size=8", "--", *SMALL, "--compile=false"],
                   ("FP8Linear", "scaled_mm(x8, w8.T, x_scale", "scaled_mm(x8, w8.T.contiguous(), x_scale")),
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
        print(json.dumps(run(name)), flush=True)

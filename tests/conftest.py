"""Shared helpers: run train_gpt.py or a worker script under torchrun (gloo, CPU)."""

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_gpt  # noqa: E402

train_gpt.keep_freed_cpu_memory()  # the in-process tests allocate like the trainer does


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs the trainer or a tool as a whole, or several processes; "
                                       "the inner loop `python -m pytest tests -m \"not slow\"` leaves these out")


def cpu_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    # The allocator setting train_gpt.main makes on CPU (keep_freed_cpu_memory), for the worker scripts too.
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(1 << 30), **extra)
    return env


def torchrun(script, nproc: int, *args, timeout: float = 600, check: bool = True, extra_env=None):
    """`torchrun --standalone --nproc_per_node=N script args` from the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(**(extra_env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[2:])} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def python(*args, timeout: float = 600, extra_env=None):
    """`python args` from the repo root, as a user would run it."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=cpu_env(**(extra_env or {})),
                          capture_output=True, text=True, timeout=timeout)


def run_main(*argv) -> subprocess.CompletedProcess:
    """train_gpt.main(argv) in this process, from the repo root, without an interpreter's start-up: what
    `python train_gpt.py argv` would return and print, for the checks that need no separate process."""
    out, err = io.StringIO(), io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train_gpt.main([str(a) for a in argv])
    finally:
        signal.signal(signal.SIGTERM, handler)
    return subprocess.CompletedProcess(["train_gpt.py", *map(str, argv)], code, out.getvalue(), err.getvalue())


def one_line_error(proc, *fragments) -> str:
    """Asserts that a command failed as bad input should: exit 2, one `error: ...` line naming the fragments."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture(scope="session")
def final_folder(tmp_path_factory):
    """The final weights of a short smoke run (train_gpt.py --save_final=true), shared by the sample
    and HellaSwag tests."""
    root = tmp_path_factory.mktemp("final")
    proc = python(REPO / "train_gpt.py", "--num_iterations=4", "--val_loss_every=0", "--batch_tokens=1024",
                  "--val_tokens=2048", "--save_final=true", f"--checkpoint_dir={root}/ck", "--run_id=s",
                  f"--logs_dir={root}/logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (root / "logs/s.txt").read_text()
    assert f"final weights: {root}/ck/s/final" in log
    return root / "ck/s/final"


def random_model(seed=0):
    """The smoke model with random weights (a trained smoke model repeats itself) and short windows,
    so that generation runs past every window."""
    import train_gpt as T

    args = T.parse_args(["--preset=smoke", "--window_block=16", "--window_schedule=1,2", "--window_extension=3",
                         "--window_final_val=4", "--micro_batch_tokens=256", "--batch_tokens=1024",
                         "--train_max_seq_len=160"], False)
    torch.manual_seed(seed)
    model = T.GPT(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model.rotary.set_window(3)
    return model.eval(), args, {"windows": [1, 4]}

"""Shared helpers (run train_gpt.py in this process, as a process or under torchrun; gloo, CPU) and the
training runs that many tests read, made once per test session."""

import contextlib
import fcntl
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train_gpt.py"
sys.path.insert(0, str(REPO))
import train_gpt  # noqa: E402
from process_tree import descendants  # noqa: E402

# The property tests draw the same examples in every run (derandomize): a suite that passes passes again, and a
# failure is a defect to find, not luck. `pytest --hypothesis-profile=explore` draws new ones each run, to search.
# No example database is written into the repository, and no deadline fails an example that a loaded 2-core
# machine made slow (each test bounds its max_examples).
settings.register_profile("repo", database=None, deadline=None, derandomize=True)
settings.register_profile("explore", database=None, deadline=None)


train_gpt.keep_freed_cpu_memory()  # the in-process tests allocate like the trainer does
# One intra-op thread, as the processes the tests start have (OMP_NUM_THREADS=1 in cpu_env): the tests' tensors
# are small, and on a 2-core machine with another process busy, a second thread that spins waiting for the
# first made in-process work 5x slower (measured: 150 generated tokens, 1.9 s with one thread, 10.2 s with two).
torch.set_num_threads(1)
# A suite started in the background of a script or under nohup inherits SIGINT ignored, and so would every process
# it starts: the tests of what Ctrl-C does would then wait for an interrupt that never comes (the data writers'
# SIGINT tests timed out so). Python's own handler here; the processes the tests start get the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs the trainer or a tool as a whole, or several processes; "
                                       "the inner loop `python -m pytest tests -m \"not slow\"` leaves these out")
    if config.getoption("hypothesis_profile", None) is None:  # (hypothesis's own plugin loads one given)
        settings.load_profile("repo")


# Every phase of a test (setup, call, teardown) ends within TEST_LIMIT_S of its own time, even one that waits in
# this process on something that never comes (a pool's workers, a lock, a queue): SIGALRM then fails it with the
# traceback of where it waited. The time it waits on a process it started does not count: those have timeouts
# of their own (communicate_or_fail), which fail with the process's output. Far above any test's own time.
TEST_LIMIT_S = 1800


def _expired(signum, frame):
    pytest.fail(f"still running after {TEST_LIMIT_S} s (tests/conftest.py's TEST_LIMIT_S): stopped where it waited")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _time_limit():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _time_limit():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _time_limit():
        yield


@contextlib.contextmanager
def _time_limit():
    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# pytest.ini runs the suite on two pytest-xdist workers, one test file at a time (--dist=loadfile): the tests
# that share an expensive module fixture (the smoke run, the preflight scenarios, the gloo launches, the bench)
# are in one file, so each is made once; the SHORT runs, which several files read, are shared by made_once. The
# files that took longest (measured on a 2-core machine) start first, so that neither worker is left with a long
# file at the end while the other is idle; the rest follow in order.
# CPU-s per file in a run of the suite on 2026-11-26: 251, 231, 191, 119, 91, 69, 48, 46, 42; the rest 18 or less.
LONGEST_FILES_FIRST = ("test_preflight_faults.py", "test_preflight.py", "test_equivalence.py", "test_train.py",
                       "test_reliability.py", "test_bench.py", "test_optimizers.py", "test_memory.py",
                       "test_bad_input.py")


def pytest_collection_modifyitems(items):
    def position(item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)
    items.sort(key=position)  # stable: each file's tests stay together and in order


def cpu_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    # The allocator setting train_gpt.main makes on CPU (keep_freed_cpu_memory), for the worker scripts too.
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(1 << 30), **extra)
    return env


# -----------------------------------------------------------------------------
# Processes the tests start: none may outlive its timeout. torchrun starts its ranks in sessions of their own
# (a signal to torchrun's process group misses them), so the whole tree is found by /proc's parent links
# (process_tree.descendants).

def kill_tree(pid: int):
    """SIGKILL to pid and every process below it. Stopped first, so that none starts another meanwhile or leaves
    the tree (a child whose parent dies is adopted elsewhere)."""
    stopped = [pid]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    while new := [p for p in descendants(pid) if p not in stopped]:
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        stopped += new
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def tail(text, chars: int) -> str:
    if isinstance(text, bytes):  # a TimeoutExpired's partial output
        text = text.decode(errors="replace")
    return (text or "")[-chars:]


def kill_and_fail(proc: subprocess.Popen, why: str, out=None, err=None):
    """Kills proc (started with stdout and stderr piped) and every process it started, and fails the test with
    `why` and the end of what they printed."""
    kill_tree(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a pipe still held by a process outside the tree
        out, err = proc.communicate(timeout=30)
    shown = " ".join(str(c) for c in proc.args) if isinstance(proc.args, (list, tuple)) else str(proc.args)
    pytest.fail(f"{shown[:500]}: {why}; killed with every process it started\n"
                f"--- stdout (its end)\n{tail(out, 4000)}\n--- stderr (its end)\n{tail(err, 6000)}", pytrace=False)


def tree_cpu_seconds(pid: int) -> float:
    """The CPU time pid and every process below it have used, those they have waited for included."""
    ticks = 0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{p}/stat") as f:
                ticks += sum(int(field) for field in f.read().rsplit(")", 1)[1].split()[11:15])  # utime .. cstime
    return ticks / os.sysconf("SC_CLK_TCK")


# A timeout is for a process that waits on something that never comes, not for one that a loaded machine slows
# down: past its timeout, a process that used CPU in the last PROGRESS_WINDOW_S gets another window, up to
# TIMEOUT_FACTOR times its timeout. (A run of the suite on 2 cores at a load average of 11 to 14 lost both
# preflights at their 1,200 s and the smoke run at its 600 s, each still computing.)
PROGRESS_WINDOW_S = 60
TIMEOUT_FACTOR = 4


@contextlib.contextmanager
def _alarm_paused():
    """TEST_LIMIT_S's alarm stopped meanwhile: a wait on a process has its own timeout."""
    left = signal.alarm(0)
    try:
        yield
    finally:
        if left:
            signal.alarm(left)


def communicate_or_fail(proc: subprocess.Popen, timeout: float, input=None) -> tuple[str, str]:
    """proc.communicate(input) within timeout seconds, or while proc's processes use CPU (above), up to
    TIMEOUT_FACTOR times that. Past it, or when they use none for PROGRESS_WINDOW_S, proc and every process it
    started are killed and the test fails with the end of their output; an interrupted test kills them too."""
    started = time.monotonic()
    with _alarm_paused():
        try:
            try:
                return proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                expired = e
            while time.monotonic() - started < TIMEOUT_FACTOR * timeout:
                before = tree_cpu_seconds(proc.pid)
                try:
                    return proc.communicate(timeout=PROGRESS_WINDOW_S)
                except subprocess.TimeoutExpired as e:
                    expired = e
                if tree_cpu_seconds(proc.pid) - before < 1.0:
                    kill_and_fail(proc, f"still running after {time.monotonic() - started:.0f} s (timeout {timeout:g} "
                                        f"s) and idle for the last {PROGRESS_WINDOW_S} s: waiting on something that "
                                        f"does not come", expired.stdout, expired.stderr)
        except BaseException as e:
            if not isinstance(e, pytest.fail.Exception):
                kill_tree(proc.pid)
                proc.wait()
            raise
        kill_and_fail(proc, f"still running after {time.monotonic() - started:.0f} s, past {TIMEOUT_FACTOR} times its "
                            f"timeout of {timeout:g} s", expired.stdout, expired.stderr)


def run_command(cmd, *, timeout: float, cwd=REPO, env=None, input=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) that cannot hang the suite (see
    communicate_or_fail). stdin is empty unless input is given."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE)
    out, err = communicate_or_fail(proc, timeout, input)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(script, nproc: int, *args, timeout: float = 600, check: bool = True, extra_env=None):
    """`torchrun --standalone --nproc_per_node=N script args` from the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    proc = run_command(cmd, timeout=timeout, env=cpu_env(**(extra_env or {})))
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[2:])} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def python(*args, timeout: float = 600, extra_env=None):
    """`python args` from the repo root, as a user would run it."""
    return run_command([sys.executable, *map(str, args)], timeout=timeout, env=cpu_env(**(extra_env or {})))


def in_process(main, *argv) -> subprocess.CompletedProcess:
    """main(argv) of one of the project's scripts in this process, from the repo root, without an
    interpreter's start-up: what `python script argv` would return and print, for the checks that need
    no separate process."""
    out, err = io.StringIO(), io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        signal.signal(signal.SIGTERM, handler)
    return subprocess.CompletedProcess([main.__module__, *map(str, argv)], code, out.getvalue(), err.getvalue())


def run_main(*argv) -> subprocess.CompletedProcess:
    """`python train_gpt.py argv`, in this process (see in_process)."""
    return in_process(train_gpt.main, *argv)


def train_at(world_size: int, *args, check=True, timeout=600):
    """train_gpt.py at world size 1 in this process, or under torchrun."""
    if world_size == 1:
        proc = run_main(*args)
        if check:
            assert proc.returncode == 0, proc.stderr[-3000:]
        return proc
    return torchrun(TRAIN, world_size, *args, check=check, timeout=timeout)


def one_line_error(proc, *fragments) -> str:
    """Asserts that a command failed as bad input should: exit 2, one `error: ...` line naming the fragments."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def val_losses(log_text: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step:(\d+)/\d+ val_loss:(\S+) ", log_text, re.M)}


# The smoke model trained for 8 steps: three stages of 256, 512 and 768 tokens (2, 3 and 2 steps), each in 4
# micro-batches so that world sizes 1, 2 and 4 all split them, and a 1-step extension; validating every 4 steps
# on 4 sequences of 512 tokens. Small (its cost is mostly the 50,304-way head, and each process's start-up), but
# it passes through every phase of the smoke schedule: the stages' batch sizes, sequence lengths, windows and
# multi-token weights with YaRN between them, the untie step (5), the extension, Adam every second step,
# momentum warmup, and the longer final validation window. No untimed warmup: on CPU nothing compiles, and
# test_equivalence.py shows that it changes nothing.
SHORT = ["--num_iterations=8", "--extension_steps=1", "--val_loss_every=4", "--stage_batch_tokens=256,512,768",
         "--stage_max_seq_len=64,128,128", "--val_tokens=2048", "--val_seq_len=512", "--warmup_steps=0"]


# -----------------------------------------------------------------------------
# What several tests read, made once per test session for every pytest-xdist worker. The workers are separate
# processes, each with its own session fixtures: the first to ask makes the thing in the folder they share (the
# session's base temporary folder) under a file lock, the others wait for it there and read it.

def shared_folder(tmp_path_factory) -> Path:
    """The session's folder that every pytest-xdist worker sees: the parent of each worker's basetemp (xdist
    gives them <basetemp>/popen-gwN), or the basetemp itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder `name` of shared_folder(), made by make(folder) in this session's first process to ask; a
    process that asks meanwhile waits until it is made. A failure is not retried: every process that asks
    fails with its message."""
    root = shared_folder(tmp_path_factory)
    folder, done, failed = root / name, root / f".{name}.made", root / f".{name}.failed"
    with open(root / f".{name}.lock", "w") as lock:
        with _alarm_paused():  # the maker's own time limits apply to it
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if failed.exists():
            pytest.fail(f"{name}, made for several tests, failed in another test of this session:\n"
                        f"{failed.read_text()}", pytrace=False)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-8000:])
                raise
            done.touch()
    return folder


@pytest.fixture(scope="session", autouse=True)
def compile_caches_in_the_session_folder(tmp_path_factory):
    """torch.compile's on-disk caches (inductor's, and Triton's inside it) in the session's shared folder, for
    this process and the processes the tests start: a run never reads what an earlier session or another
    checkout compiled, and leaves nothing in /tmp/torchinductor_$USER (the preflight's inductor scenarios, which
    compile every kernel afresh for each card, left 18 folders, 25 MB, there per run). Nothing else compiles
    with inductor: the other compiled tests use aot_eager or a counting backend, which keep no cache."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(shared_folder(tmp_path_factory) / "torchinductor")


class ShortRun:
    def __init__(self, root: Path, world_size: int):
        self.world_size, self.logs_dir, self.checkpoint_dir = world_size, root / "logs", root / "ck"
        self.run_id = f"short{world_size}"
        self.log = (self.logs_dir / f"{self.run_id}.txt").read_text()
        self.val_losses = val_losses(self.log)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoint_dir / self.run_id / f"step_{step:06d}"


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """short_run(world_size): the SHORT run at that world size, trained once per test session for all pytest-xdist
    workers (made_once). World size 1 runs in the process that makes it and keeps checkpoints every 2 steps and its
    final weights; others run under torchrun and keep checkpoints every 4 steps. Tests must not write into its
    folders: copy first."""
    runs = {}

    def train(world_size: int, root: Path):
        argv = [*SHORT, f"--logs_dir={root}/logs", f"--checkpoint_dir={root}/ck", f"--run_id=short{world_size}"]
        if world_size == 1:
            proc = run_main(*argv, "--save_every=2", "--save_final=true")
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            torchrun(TRAIN, world_size, *argv, "--save_every=4")

    def get(world_size: int) -> ShortRun:
        if world_size not in runs:
            root = made_once(tmp_path_factory, f"short{world_size}", lambda folder: train(world_size, folder))
            runs[world_size] = ShortRun(root, world_size)
        return runs[world_size]
    return get


@pytest.fixture(scope="session")
def final_folder(short_run):
    """The final weights of the world-size-1 SHORT run (--save_final=true), for the sample and HellaSwag tests."""
    run = short_run(1)
    folder = run.checkpoint_dir / run.run_id / "final"
    assert f"final weights: {folder}" in run.log
    return folder


def fill_random(model: torch.nn.Module):
    """Every parameter drawn from N(0, 0.3^2) with torch's global generator (the caller seeds it): weights large
    enough that a model's outputs differ from position to position and ending to ending."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def random_final_weights(root: Path, *flags: str) -> Path:
    """The final-weights folder (save_final_weights) of the smoke model with flags, untrained: random weights, so
    that generated text varies and HellaSwag's endings score differently. For the tests of what reads such a
    folder (sample.py), which need no training run (the SHORT run's takes 15 s)."""
    args = train_gpt.parse_args(["--preset=smoke", *flags, f"--checkpoint_dir={root}"], False)
    model = train_gpt.build_model(args, train_gpt.DistEnv(0, 0, 1, torch.device("cpu")))
    torch.manual_seed(0)
    fill_random(model)
    return train_gpt.save_final_weights(model, args, TRAIN.read_text(), "untrained", args.num_iterations, 10.8)


@pytest.fixture(scope="session")
def untrained_final_folder(tmp_path_factory):
    """random_final_weights of the SHORT run's config (its context of 128 positions), once per process."""
    return random_final_weights(tmp_path_factory.mktemp("untrained"), *SHORT)


def random_model(seed=0):
    """The smoke model with random weights (a trained smoke model repeats itself) and short windows,
    so that generation runs past every window. In float64: weights this large amplify fp32 rounding, which
    differs between CPUs (up to 9e-5 relative in a loss was seen between packed and lone sequences), and the
    tests that compare two ways of computing the same thing must see only a real difference."""
    import train_gpt as T

    args = T.parse_args(["--preset=smoke", "--window_block=16", "--stage_windows=1:1,1:2,1:2", "--extension_windows=1:3",
                         "--final_val_window=4", "--stage_batch_tokens=1024,1024,1024", "--stage_max_seq_len=160,160,160",
                         "--dc_window=16"], False)
    torch.manual_seed(seed)
    model = T.GPT(args)
    fill_random(model)
    model.rotary.set_window(3)
    return model.double().eval(), args, {"windows": [1, 4]}


# The smoke preset as it was on record #89's structure, before the speedrun and smoke presets took record #92's
# (issue 52): record #89's paths (the presets record89 and record85) are tested on it.
SMOKE89 = ["--preset=record89", "--train_files=data/shakespeare/shakespeare_train_*.bin",
           "--val_files=data/shakespeare/shakespeare_val_*.bin", "--val_tokens=8192", "--val_seq_len=1024",
           "--num_iterations=30", "--extension_steps=3", "--stage_batch_tokens=1024,2048,3072", "--micro_batches=4",
           "--stage_max_seq_len=256,512,512", "--stage_windows=1:2,2:4,3:6", "--extension_windows=3:7",
           "--final_val_window=10", "--window_block=64", "--stage_mtp_weights=1,0.5>1,0/1>1/1>1",
           "--stage_prefix_weights=0.25,0.25>0,0", "--cooldown_frac=0.3", "--adam_lr=0.04", "--muon_lr=0.06",
           "--num_layers=6", "--model_dim=64", "--head_dim=16", "--bigram_vocab_size=50000", "--bigram_sign_rows=1024",
           "--no_attention_layers=3", "--paired_layers=0,4", "--long_window_layers=1,5", "--xsa_layers=1,2",
           "--attn_gate_layers=1,5", "--dc_layers=5", "--dc_window=56", "--value_embed_layers=1,2,4,5",
           "--skip_layers=1:3", "--shared_input_layer=2", "--mudd_gate_layer=2", "--muon_momentum_warmup=10",
           "--muon_momentum_cooldown=4", "--compile=false", "--warmup_steps=0", "--val_loss_every=10",
           "--train_loss_every=10"]

"""A stress test of data/tokenize_text.py's worker-pool shutdown, under the conditions of the hang a suite run
once met (issue 39): a run whose first batch fails right after the pool is made, on a loaded machine, many times
in a row. Not part of the suite (it takes minutes); run it by hand:

    python tests/workers/pool_shutdown_stress.py                    # 50 repetitions of each case, 2 burners a core
    python tests/workers/pool_shutdown_stress.py --old-shutdown     # the same with the pool ended as before 81a3a3e

Each repetition is tokenize_text.py's command line in a process of its own with a pool (--workers, default 4),
in one of these cases:

  no-text-field  a JSONL file whose first line has no text field: the parent fails on the first document, just
                 after the pool is made (the input the suite's run hung on)
  worker-raises  a pool worker raises on the first document of the first batch (an exception injected into
                 encode_document): pool.map re-raises it in the parent
  sigterm        a pool worker sends SIGTERM to the parent during the first batch: the parent stops after it

while --burners processes spin on the CPU. A repetition passes when the process ends within --timeout seconds
with the case's exit code and error line; one that does not end has its stacks printed (faulthandler, SIGUSR1)
and is killed with its workers. --old-shutdown runs the code as it was before 81a3a3e: Pool.terminate() at the
end, and workers that die on SIGTERM. Exit 0 when every repetition passed.
"""

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
sys.path.insert(0, str(REPO / "tests"))
from process_tree import descendants  # noqa: E402

# The command line of data/tokenize_text.py with the case's injection; SIGUSR1 prints every thread's stack.
WRAPPER = f"""
import faulthandler, multiprocessing.pool, os, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.path.insert(0, {str(DATA)!r})
import tokenize_text
case, old, sys.argv = sys.argv[1], sys.argv[2] == "old", [tokenize_text.__file__, *sys.argv[3:]]
real_encode = tokenize_text.encode_document

def encode_document(text):  # runs in the pool's (forked) workers
    if text.startswith("FIRST"):
        if case == "worker-raises":
            raise ValueError("injected failure in a pool worker")
        if case == "sigterm":
            os.kill(os.getppid(), signal.SIGTERM)
    return real_encode(text)

encode_document.__module__, encode_document.__qualname__ = "tokenize_text", "encode_document"
tokenize_text.encode_document = encode_document
if old:  # before 81a3a3e: workers died on SIGTERM, and the pool was ended with terminate()
    def _init_worker(bpe_file):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if tokenize_text._ENCODING is None:
            tokenize_text._ENCODING = tokenize_text.load_encoding(bpe_file)
    tokenize_text._init_worker = _init_worker
    multiprocessing.pool.Pool.close = multiprocessing.pool.Pool.terminate
sys.exit(tokenize_text.main(sys.argv[1:]))
"""

# case: (exit codes that pass, a fragment of the error output that must be there)
EXPECTED = {"no-text-field": ({1}, "expected a JSON object with a string 'text' field"),
            "worker-raises": (None, "injected failure in a pool worker"),  # any failing exit
            "sigterm": ({143}, "")}  # tokenize_text.py ends quietly on SIGTERM


def inputs(folder: Path, case: str) -> list[str]:
    """The case's input files: enough documents for several batches of the pool."""
    rest = "".join(f'{{"text": "document {i}: ' + "some words to encode " * 40 + '"}\n' for i in range(400))
    if case == "no-text-field":
        (folder / "in.jsonl").write_text('{"body": "no text here"}\n' + rest)
    else:
        (folder / "in.jsonl").write_text('{"text": "FIRST document"}\n' + rest)
    return [str(folder / "in.jsonl")]


def running_with(text: str) -> list[int]:
    """The processes whose command line holds text."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def kill_tree(pid: int):
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def one_run(case: str, old: bool, workers: int, timeout: float, folder: Path) -> dict:
    out = folder / "out"
    cmd = [sys.executable, "-c", WRAPPER, case, "old" if old else "new", *inputs(folder, case), "--out", str(out),
           "--workers", str(workers), "--bpe-file", str(DATA / "gpt2.tiktoken")]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # the parent's stacks, where it waits
        time.sleep(2)
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        return {"outcome": "hung", "seconds": time.perf_counter() - started, "stderr": stderr}
    seconds = time.perf_counter() - started
    codes, fragment = EXPECTED[case]
    good = (proc.returncode != 0 if codes is None else proc.returncode in codes) and fragment in stderr
    left = running_with(str(folder))  # none: the pool's workers (forks, with the same command line) are gone too
    return {"outcome": "ok" if good else "wrong", "seconds": seconds, "code": proc.returncode,
            "stderr": stderr[-2000:], "left": left}


def burn():
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=50)
    parser.add_argument("--cases", default=",".join(EXPECTED), help=f"comma-separated, of {', '.join(EXPECTED)}")
    parser.add_argument("--workers", type=int, default=4, help="tokenize_text.py --workers (a pool when over 1)")
    parser.add_argument("--burners", type=int, default=2 * os.cpu_count(), help="processes spinning meanwhile")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a repetition may take")
    parser.add_argument("--old-shutdown", action="store_true", help="the pool ended as before 81a3a3e")
    options = parser.parse_args()
    cases = options.cases.split(",")
    for case in cases:
        if case not in EXPECTED:
            parser.error(f"--cases: unknown case {case}")

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(options.burners)]
    failures = 0
    try:
        print(f"{options.repetitions} repetitions of {', '.join(cases)}; --workers {options.workers}, "
              f"{options.burners} burners on {os.cpu_count()} CPUs, timeout {options.timeout:g} s, "
              f"{'old shutdown (terminate)' if options.old_shutdown else 'close() and join()'}", flush=True)
        for case in cases:
            results = []
            for i in range(options.repetitions):
                with tempfile.TemporaryDirectory() as folder:
                    result = one_run(case, options.old_shutdown, options.workers, options.timeout, Path(folder))
                results.append(result)
                if result["outcome"] != "ok" or result.get("left"):
                    failures += 1
                    print(f"  {case} #{i + 1}: {result['outcome']} after {result['seconds']:.1f} s "
                          f"(exit {result.get('code')}, processes left {result.get('left')})\n"
                          + "\n".join("    " + line for line in result["stderr"].splitlines()[-60:]), flush=True)
            seconds = [r["seconds"] for r in results]
            counts = {o: sum(r["outcome"] == o for r in results) for o in ("ok", "wrong", "hung")}
            print(f"{case}: {counts['ok']} ok, {counts['wrong']} wrong outcome, {counts['hung']} hung; seconds "
                  f"min {min(seconds):.1f} median {statistics.median(seconds):.1f} max {max(seconds):.1f}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run under torchrun (gloo): every optimizer check that needs real collectives, the tail ships' and the sampled
softmax's candidate sets' at this world size, in one process group per launch (starting torchrun and its processes
costs more than the checks). Rank 0 saves NorMuon's and ANVIL's final parameters to the path given, for the test to
compare with a single-process run.

    torchrun --standalone --nproc_per_node=N tests/workers/gloo_worker.py OUT
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidates_worker import check_candidates  # noqa: E402
from dist_adam_worker import check_dist_adam, check_sparse_rows  # noqa: E402
from hook_worker import check_hooks  # noqa: E402
from muon_worker import run_anvil, run_normuon  # noqa: E402
from ngram_worker import check_ngram_table  # noqa: E402
from ships_worker import check_ships  # noqa: E402

SMOKE_MICRO_BATCHES = 4  # the hook check trains the smoke preset, whose step is 4 micro-batches


def live_gloo_threads() -> int:
    """Threads of this process whose name mentions gloo (Linux); 0 where /proc is missing."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    count = 0
    for task in tasks.iterdir():
        try:
            count += "gloo" in (task / "comm").read_text()
        except FileNotFoundError:  # a thread that ended while it was listed
            pass
    return count


def gloo_threads_after(seconds: float) -> int:
    """live_gloo_threads() once it is 0, or after `seconds`. destroy_process_group does not wait for the group's
    threads to end: on a loaded machine (or under strace) one was seen still ending right after it returned. A
    group kept alive by a reference keeps its threads for good, and still fails."""
    deadline = time.monotonic() + seconds
    while (count := live_gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def main(out_path: str):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    final = {"normuon": run_normuon(rank, world), "anvil": run_anvil(rank, world)}
    check_dist_adam(rank, world)
    check_sparse_rows(rank, world)
    check_ships(rank, world)
    check_candidates(rank, world)
    check_ngram_table(rank, world)
    if SMOKE_MICRO_BATCHES % world == 0:
        check_hooks(rank, world)
    dist.destroy_process_group()
    # The group must really be gone now: gloo threads still alive when Python shuts down can abort the
    # process at exit (see the torch.distributed.nn import in train_gpt.py).
    left = gloo_threads_after(10.0)
    assert left == 0, f"{left} gloo threads outlive destroy_process_group by 10 s"
    if rank == 0:
        torch.save(final, out_path)


if __name__ == "__main__":
    main(sys.argv[1])

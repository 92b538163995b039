"""Run under torchrun: NorMuon on 1 rank or several (gloo); rank 0 saves the final parameters.

Rank r's gradient is G + (r - (world-1)/2) * H with entries on a 1/16 grid, so the mean over
ranks is exactly G whatever the world size: every run should end with the same parameters.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

# Includes chunks shorter than the world size, a stack of matrices (like the attention's q, k, v, o)
# and a gate-like 1 x 12 matrix.
SHAPES = [(8, 16)] * 3 + [(16, 8)] * 2 + [(5, 7), (4, 8, 8), (1, 12)]
STEPS = 3


def live_gloo_threads() -> int:
    """Threads of this process whose name mentions gloo (Linux); 0 where /proc is missing."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    return sum("gloo" in (task / "comm").read_text() for task in tasks.iterdir())


def main(out_path: str):
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = T.NorMuon(params, lr=0.05, momentum=0.9, beta2=0.95, weight_decay=1.2, ns_dtype=torch.float32)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        for p in params:
            mean = torch.randint(-64, 64, p.shape, generator=g) / 16
            spread = torch.randint(-64, 64, p.shape, generator=g) / 16
            p.grad = mean + (rank - (world - 1) / 2) * spread
        opt.step()
    flat = torch.cat([p.data.reshape(-1) for p in params])
    if world > 1:
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(x, flat) for x in gathered), "parameters differ across ranks"
        owned = sum(len(opt.state[p]) > 0 for p in params)
        counts = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([float(owned)]))
        # Each matrix's momentum lives on exactly one rank: the work is split, not repeated.
        assert sum(int(c) for c in counts) == len(params), counts
        assert owned < len(params), "one rank orthogonalised every matrix"
        dist.destroy_process_group()
        # The group must really be gone now: gloo threads still alive when Python shuts down can abort the
        # process at exit (see the torch.distributed.nn import in train_gpt.py).
        assert live_gloo_threads() == 0, f"{live_gloo_threads()} gloo threads outlive destroy_process_group"
    if rank == 0:
        torch.save(flat, out_path)


if __name__ == "__main__":
    main(sys.argv[1])

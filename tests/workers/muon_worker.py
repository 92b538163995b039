"""NorMuon on 1 rank or several (gloo): run_normuon returns the parameters after STEPS steps.

Rank r's gradient is G + (r - (world-1)/2) * H with entries on a 1/16 grid, so the mean over
ranks is exactly G whatever the world size: every run should end with the same parameters.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

# Includes chunks shorter than the world size, stacks of matrices (like the attention's head-pair blocks)
# whose matrices share chunks with lone ones of their shape, and a 1 x 12 matrix.
SHAPES = [(8, 16)] * 3 + [(16, 8)] * 2 + [(5, 7), (4, 8, 8), (1, 12), (3, 16, 8)]
STEPS = 3


def run_normuon(rank: int, world: int) -> torch.Tensor:
    """The parameters after STEPS steps, flattened; at world size > 1 inside an initialised gloo group."""
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
        owned = sum(len(state) > 0 for state in opt.matrix_state)
        counts = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([float(owned)]))
        # Each matrix's momentum lives on exactly one rank (a stack's matrices are units of their own): the
        # work is split, not repeated.
        assert sum(int(c) for c in counts) == len(opt.matrices), counts
        assert owned < len(opt.matrices), "one rank orthogonalised every matrix"
    return flat

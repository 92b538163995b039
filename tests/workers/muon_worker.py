"""NorMuon and ANVIL on 1 rank or several (gloo): run_normuon and run_anvil return the parameters after STEPS
steps.

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


# ANVIL's rail settings (momentum, fast-rail beta, blend) each step: the fast rail alone, then engaged.
ANVIL_RAILS = [(0.85, 0.85, 1.0), (0.9, 0.9, 1.0), (0.93, 0.85, 0.4385)]


def run_normuon(rank: int, world: int) -> torch.Tensor:
    """NorMuon's parameters after STEPS steps, flattened; at world size > 1 inside an initialised gloo group."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = T.NorMuon(params, lr=0.05, momentum=0.9, beta2=0.95, weight_decay=1.2, ns_dtype=torch.float32)
    return run(opt, params, rank, world)


def run_anvil(rank: int, world: int) -> torch.Tensor:
    """The same for ANVIL, bf16 weights (the mantissas travel with the state), the rails engaging at the last
    step; returned as fp32 weights with their mantissas, the masters."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in SHAPES]
    opt = T.Anvil(params, lr=0.05, momentum=0.85, beta2=0.95, weight_decay=2.25, ns_dtype=torch.float32)
    settings = iter(ANVIL_RAILS)

    def schedule():
        momentum, fast_beta, blend = next(settings)
        for group in opt.param_groups:
            group.update(momentum=momentum, fast_beta=fast_beta, blend=blend)

    run(opt, params, rank, world, schedule)
    masters = torch.cat([T.bf16_with_mantissa(p.data, torch.zeros_like(p.data, dtype=torch.int16)).reshape(-1)
                         for p in params])
    # each matrix's master lives with its mantissa on the rank that updates it: gather the masters there
    own = torch.zeros_like(masters)
    offset = 0
    for p in params:
        for j in range(p.size(0) if p.ndim == 3 else 1):
            m = next(i for i, (q, jj, _) in enumerate(opt.matrices) if q is p and (jj is None or jj == j))
            n = p[0].numel() if p.ndim == 3 else p.numel()
            state = opt.matrix_state[m]
            if state:
                w = p.data[j] if p.ndim == 3 else p.data
                own[offset:offset + n] = T.bf16_with_mantissa(w, state["mantissa"]).reshape(-1)
            offset += n
    if world > 1:
        dist.all_reduce(own)  # one owner per matrix, zeros elsewhere
    assert torch.equal(own.view(torch.int32) >> 16, masters.view(torch.int32) >> 16), "bf16 weights disagree"
    return own


def run(opt, params, rank: int, world: int, schedule=lambda: None) -> torch.Tensor:
    for step in range(STEPS):
        schedule()
        g = torch.Generator().manual_seed(step)
        for p in params:
            mean = torch.randint(-64, 64, p.shape, generator=g) / 16
            spread = torch.randint(-64, 64, p.shape, generator=g) / 16
            p.grad = (mean + (rank - (world - 1) / 2) * spread).to(p.dtype)
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

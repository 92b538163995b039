"""TailShips at world size > 1 (each rank a slice of every accumulator, one all-gather per shipped tensor) against
world size 1 in the same process: the same shipped weights, bit for bit (the ships are element-wise)."""

import torch

import train_gpt as T


def shipped(world: int, rank: int) -> torch.Tensor:
    args = T.parse_args(["--preset=smoke", "--num_iterations=40", "--extension_steps=3", "--vocab_size=300",
                         "--bigram_vocab_size=300"], False)
    torch.manual_seed(0)
    model, schedule = T.GPT(args), T.Schedule(args)
    ships = T.TailShips(model, T.record92_ships(schedule), schedule.total, world, rank)
    for step in range(schedule.total):
        g = torch.Generator().manual_seed(step)  # the same walk on every rank, as all-gathered weights are
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        ships.tick(step)
    ships.ship()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_ships(rank: int, world: int):
    assert torch.equal(shipped(world, rank), shipped(1, 0)), f"rank {rank}: shipped weights differ from world size 1"
    print(f"rank {rank}: TailShips matched world size 1", flush=True)

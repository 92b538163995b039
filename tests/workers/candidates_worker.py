"""In a gloo group: record #92's sampled softmax at this world size builds micro-batch g's candidate set as world
size 1 does (every rank's sets gathered with real collectives), and the loader's state a checkpoint keeps (each
stream's offset gathered from the rank that moves it, as save_checkpoint gathers it) is world size 1's."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

# Steps of 6 micro-batches of 64 tokens (6 splits over 2 and 3 ranks), the count ramping within the second stage
FLAGS = ["--preset=smoke", "--num_iterations=6", "--extension_steps=1", "--stage_batch_tokens=384,384,384",
         "--extension_batch_tokens=384", "--micro_batches=6", "--stage_softmax_candidates=512,256|512,1024"]


def sets_of(batch) -> list:
    return [tuple(None if t is None else t.tolist() for t in c) for c in batch.candidates]


def check_candidates(rank: int, world: int):
    args = T.parse_args(FLAGS, False)
    loader = T.TrainLoader(args, T.DistEnv(rank, rank, world, torch.device("cpu")))
    alone = T.TrainLoader(args, T.DistEnv(0, 0, 1, torch.device("cpu"))) if rank == 0 else None
    for step in range(args.num_iterations):
        every_rank = T.gather_from_ranks(sets_of(loader.next_batch(step)))
        if alone is not None:
            expected = sets_of(alone.next_batch(step))
            assert [every_rank[g % world][g // world] for g in range(6)] == expected, step
    kept = T.loader_state_of_ranks(T.gather_from_ranks(loader.state_dict()))
    if alone is not None:
        assert kept == alone.state_dict(), (kept, alone.state_dict())
        assert loader.state_dict() != kept  # rank 0 alone does not hold the other ranks' streams
    print(f"rank {rank}: micro-batch g's candidate sets and the streams' offsets are world size 1's")

"""Record #92's sharded n-gram table in a gloo group against the same table in one process (world size 1) on the
same micro-batches: the rows each step pulls from their owners (x0_bigram of every micro-batch), the gradients sent
to the owners at the table's Adam steps, NgramAdam's row-sparse steps on the embeddings' cadence (betas squared from
PERIOD_START), and a resume from the table's state mid-run."""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as T  # noqa: E402

ROWS, WIDTH, TOKENS, MICRO = 6000, 16, 40, 6  # table rows (a multiple of 2 and 3), width, tokens a micro-batch,
STEPS, PERIOD_START = 8, 4  # micro-batches a step; Adam steps at 1 and 3, then every 4th (7), betas squared from 4
EDGE = (0, 1, 50255, 50256)


def micro_batch(step: int, m: int) -> tuple[np.ndarray, torch.Tensor]:
    """(tokens + 1 as the loader gives them, the loss's target (TOKENS, WIDTH)) of micro-batch m of a step: few
    distinct ids, so that the ranks read many of the same rows."""
    g = np.random.default_rng([step, m])
    ids = g.integers(0, 60, TOKENS + 1).astype(np.uint16)
    ids[g.integers(0, TOKENS, 4)] = g.choice(EDGE, 4)
    return ids, torch.from_numpy(g.standard_normal((TOKENS, WIDTH)).astype(np.float32))


def adam_step(step: int) -> bool:
    return (step + 1) % (4 if step >= PERIOD_START else 2) == 0


class Table:
    """A shard (or the whole table) and its NgramAdam, stepped as the trainer does."""

    def __init__(self, rank: int, world: int):
        self.world = world
        self.table = T.NgramEmbedding(ROWS, WIDTH, torch.float32, (rank, world))
        self.group = {"betas": (0.0, 0.95), "lr": 0.05, "weight_decay": 4.0, "eps": 1e-10}
        self.adam = T.NgramAdam(self.table, self.group)
        self.signs = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0)).sign()

    def step(self, step: int, micro: list[int]) -> dict[int, torch.Tensor]:
        """Forwards and backwards of the micro-batches `micro` (this rank's), the Adam step when it is one;
        x0_bigram of each micro-batch."""
        batches = [micro_batch(step, m) for m in micro]
        self.adam.begin_step([T.host_ngram_rows(ids, ROWS) for ids, _ in batches])
        out = {}
        for m, (ids, target) in zip(micro, batches):
            x = torch.from_numpy(ids[:-1].astype(np.int64))
            x0 = self.table(x, T.shifted(x, 1, TOKENS), T.shifted(x, 2, TOKENS), torch.arange(TOKENS), self.signs,
                            torch.float32)
            ((x0 * target).sum() / len(micro)).backward()  # the trainer's loss scale: 1 / this rank's micro-batches
            out[m] = x0.detach()
        self.adam.end_step()
        if adam_step(step):
            power = 2 if step >= PERIOD_START else 1
            self.group.update(betas=(0.0, 0.95 ** power), weight_decay=4.0 * power)
            self.adam.step()
        return out


def check_ngram_table(rank: int, world: int):
    sharded, whole = Table(rank, world), Table(0, 1)
    saved = None
    for step in range(STEPS):
        if step == PERIOD_START:  # after an Adam step: what a checkpoint holds
            saved = (sharded.table.weight.clone(), sharded.adam.state_dict())
        mine = sharded.step(step, list(range(rank, MICRO, world)))
        reference = whole.step(step, list(range(MICRO)))
        for m, x0 in mine.items():
            assert_close(x0, reference[m], rtol=1e-5, atol=1e-6, msg=f"x0_bigram of step {step} micro-batch {m}")
    lo, rows = sharded.table.lo, sharded.table.weight.size(0)
    moved = int((whole.table.weight != 0).any(1).sum())
    assert moved > 100 and sharded.adam.events == whole.adam.events == 3, (moved, sharded.adam.events)
    assert_close(sharded.table.weight, whole.table.weight[lo:lo + rows], rtol=1e-5, atol=1e-7)
    assert_close(sharded.adam.current_v(), whole.adam.current_v()[lo:lo + rows], rtol=1e-5, atol=1e-12)
    # resume: the shard and the table's state as saved after the Adam step at 3, then the same steps again
    resumed = Table(rank, world)
    resumed.table.weight.copy_(saved[0])
    resumed.adam.load_state_dict(saved[1])
    for step in range(PERIOD_START, STEPS):
        resumed.step(step, list(range(rank, MICRO, world)))
    assert torch.equal(resumed.table.weight, sharded.table.weight)
    assert torch.equal(resumed.adam.current_v(), sharded.adam.current_v())
    print(f"rank {rank}: the sharded n-gram table matched world size 1 ({moved} rows moved, 3 Adam steps) and "
          f"resumed exactly", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    check_ngram_table(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

"""tools/estimate_memory.py: the parts of its table that can be counted by hand."""

import sys

from conftest import REPO, in_process

sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402

GIB = 2 ** 30


def test_weights_gradients_and_optimizer_state_are_counted_right():
    d, vocab = 768, 50304
    matrices = 10 * 4 * d * d + 11 * 2 * 4 * d * d  # attention and MLP, fp32
    gates = 10 * 6 * 12 + 12  # bf16
    scalars = 11 * 2 + 5 * 2 + 5 * 1 + 5 + 2  # residual mixes, value mixes, skip gates, smear, backout: fp32
    bf16_tables = 5 * vocab * d  # token embedding, 3 value embeddings, lm_head
    weights = 4 * (matrices + scalars) + 2 * (gates + bf16_tables)
    for world_size in (1, 8):
        row = estimate_memory.estimate([], world_size)
        assert row["weights"] == row["gradients"] == weights
        # DistAdam: two fp32 moments of this rank's shard of every bucket
        buckets = [vocab * d] * 4 + [scalars] + [vocab * d]
        assert row["DistAdam state"] == sum(2 * 4 * -(-n // world_size) for n in buckets)
        assert row["peak"] > row["saved activations"] > 10 * GIB
    one, eight = estimate_memory.estimate([], 1), estimate_memory.estimate([], 8)
    # each rank keeps the state of its share only (rank 0 owns one matrix of every chunk, short ones included)
    assert one["NorMuon state"] > 5 * eight["NorMuon state"]
    assert one["optimizer-step buffers"] == 0 < eight["optimizer-step buffers"]  # no collectives at world size 1


def test_the_command_prints_a_table_that_fits_an_h100():
    proc = in_process(estimate_memory.main, "--world_sizes", "1", "2")
    assert proc.returncode == 0, proc.stderr
    peak = next(line for line in proc.stdout.splitlines() if line.startswith("| peak |"))
    assert all(0 < float(v) < 79.6 for v in peak.strip("|").split("|")[1:])
    bad = in_process(estimate_memory.main, "--world_sizes", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: world size 3 cannot split")

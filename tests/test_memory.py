"""tools/estimate_memory.py: the parts of its table that can be counted by hand from record #85's shapes."""

import sys

import pytest

from conftest import REPO, in_process

sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402

GIB = 2 ** 30
D, VOCAB, BIGRAM = 768, 50304, 377280


@pytest.fixture(scope="module")
def tables():
    return {w: estimate_memory.estimate([], w) for w in (1, 8)}


def test_weights_gradients_and_optimizer_state_are_counted_right(tables):
    attention, mlp = 10 * 4 * D * D, 11 * 2 * 4 * D * D  # no attention in layer 6; qk+vo, fc+proj
    tables_bf16 = VOCAB * D * (1 + 1 + 5) + BIGRAM * D  # embed, lm_head, 5 value embeddings, bigram
    small_bf16 = 5 * 6 * 12 + 12 + 2 * 64 * D * 2 + 2 * 14 * 64 + 2 * 14 + 2 * 41 * 64 + 2 * 41  # gates, MUDD
    small_fp32 = 24 + 2 * 11 * 2 + 1  # scalars, residual and post lambdas, the MUDD gate's scale
    weights = 2 * (attention + mlp + tables_bf16 + small_bf16) + 4 * small_fp32
    adam_elements = tables_bf16 + small_bf16 + small_fp32
    # NorMuon per matrix: fp32 momentum, the bf16 weight's low mantissa (2 bytes), fp32 second moment per
    # index of the longer side. qk is 6 heads of (256, 768) in each of 10 layers, vo two (768, 768), fc and proj (3072, 768).
    units = [(256, D)] * 60 + [(D, D)] * 20 + [(4 * D, D)] * 22
    muon_state = sum(6 * r * c + 4 * max(r, c) for r, c in units)
    for world_size, table in tables.items():
        assert list(table) == ["stage 1", "stage 2", "stage 3", "extension", "validation"]
        for phase, row in table.items():
            assert row["weights"] == weights
            assert row["gradients"] == (0 if phase == "validation" else weights)
        stage = table["stage 1"]
        # DistAdam: two fp32 moments of this rank's shard of every bucket (rounded up to the world size)
        assert 8 * adam_elements // world_size <= stage["DistAdam state"] <= 8 * adam_elements // world_size + 8 * 64 * world_size
        if world_size == 1:
            assert stage["NorMuon state"] == muon_state
            assert stage["optimizer-step buffers"] == 0  # no collectives at world size 1
    one, eight = tables[1]["stage 1"], tables[8]["stage 1"]
    assert 7 * eight["NorMuon state"] < one["NorMuon state"] < 9 * eight["NorMuon state"]  # each rank its share
    assert eight["optimizer-step buffers"] > 0


def test_activations_grow_with_each_stage_micro_batch(tables):
    # 16,384, 32,768 and 49,152 tokens per micro-batch: the saved tensors grow in proportion (to within the
    # masks' and the windows' share), and the extension trains at stage 3's size.
    for table in tables.values():
        saved = [table[f"stage {i}"]["saved activations"] for i in (1, 2, 3)]
        assert 1.9 < saved[1] / saved[0] < 2.1 and 1.45 < saved[2] / saved[1] < 1.55
        assert table["extension"]["saved activations"] == saved[2]
        # one chunk of 8,192 rows of logits, never the full (49,152 x 50,304) logits
        assert table["stage 3"]["loss chunk"] == 8192 * VOCAB * 11
        assert table["validation"]["forward's largest live tensors"] > GIB  # one 262,144-token sequence


def test_the_command_prints_a_table_that_fits_an_h100():
    proc = in_process(estimate_memory.main, "--world_sizes", "8")
    assert proc.returncode == 0, proc.stderr
    peak = next(line for line in proc.stdout.splitlines() if line.startswith("| peak |"))
    values = [float(v) for v in peak.strip("|").split("|")[1:]]
    assert len(values) == 5 and all(1 < v < 79.6 for v in values)


@pytest.mark.parametrize("flags, message", [
    (["--world_sizes", "3"], "error: world size 3 cannot split"),
    (["--world_sizes", "0"], "error: --world_sizes: 0 is not a world size (at least 1)"),
    (["--world_sizes", "-8"], "error: --world_sizes: -8 is not a world size (at least 1)"),
])
def test_world_sizes_that_cannot_run_are_one_line(flags, message):
    bad = in_process(estimate_memory.main, *flags)
    assert bad.returncode == 2 and bad.stderr.startswith(message) and bad.stderr.count("\n") == 1, bad.stderr

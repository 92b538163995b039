"""Record #92's hashed n-gram table (--ngram_channels=2): its row and sign hashes against the record's int32
arithmetic written out here, its gradient against autograd of the dense formula, its row-sparse Adam against dense
per-row-RMS Adam, the embeddings' Adam cadence, checkpoints, final weights and the memory model's count. The sharded
table at world sizes 2 and 3 against one process: tests/workers/ngram_worker.py (test_optimizers.py)."""

import json
import math
import os

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import train_gpt as T
from conftest import SMOKE89, random_final_weights, TRAIN

CPU = T.DistEnv(0, 0, 1, torch.device("cpu"))
# the smoke model, one 256-token micro-batch a step, the table on the embeddings' cadence from step 2
TINY = [*SMOKE89, "--num_iterations=6", "--extension_steps=1", "--val_loss_every=0", "--warmup_steps=0",
        "--stage_batch_tokens=128,128,128", "--micro_batches=1", "--val_tokens=1024", "--ngram_channels=2",
        "--bigram_vocab_size=50000", "--embed_adam_period=4", "--embed_adam_period_start=2", "--value_embed_layers=5"]


# --- independent definitions, written from the record's code (get_sgsame_hash, the bgx kernels) ----------------

def int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2 ** 32 if v >= 2 ** 31 else v


def reference_rows(ids: list[int], rows: int) -> tuple[list[int], list[int]]:
    """get_sgsame_hash in Python ints: b[0] = mod_b is written before b[:-1] is read (position 1 pairs with mod_b),
    s[0] = s[1] = half + mod_s; products wrap in int32, xor, then Python's %."""
    half = rows // 2
    mod_b, mod_s = half - 1, rows - half - 1
    bigram, trigram = [mod_b], [half + mod_s, half + mod_s][:len(ids)]
    for t in range(1, len(ids)):
        previous = mod_b if t == 1 else ids[t - 1]
        bigram.append((int32(36313 * ids[t]) ^ int32(27191 * previous)) % mod_b)
    for t in range(2, len(ids)):
        trigram.append((int32(17351 * ids[t]) ^ int32(60961 * ids[t - 1]) ^ int32(45259 * ids[t - 2])) % mod_s + half)
    return bigram, trigram


def reference_signs(ids: list[int], sign_rows: int) -> tuple[list[int], list[int]]:
    """The kernels' si and ss, one token at a time: & on int32 two's complement, 0 where the n-gram is cut off."""
    mask = sign_rows - 1
    si = [0] + [(int32(30011 * ids[t - 1]) ^ int32(48271 * ids[t])) & mask for t in range(1, len(ids))]
    ss = [0, 0][:len(ids)] + [(int32(26801 * ids[t - 2]) ^ int32(39779 * ids[t - 1]) ^ int32(58699 * ids[t])) & mask
                              for t in range(2, len(ids))]
    return si, ss


def ours(ids: list[int], rows: int, sign_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(ids)
    n = len(ids)
    args = (x, T.shifted(x, 1, n), T.shifted(x, 2, n), torch.arange(n))
    return T.ngram_rows(*args, rows), T.ngram_sign_rows(*args, sign_rows)


def test_ngram_rows_and_signs_follow_the_records_int32_arithmetic():
    # by hand, V = 100 (half 50, both moduli 49), 8 sign rows, ids 5, 7, 11: the products written out
    rows, signs = ours([5, 7, 11], 100, 8)
    assert rows.tolist() == [[49, (254191 ^ 1332359) % 49, (399443 ^ 190337) % 49],
                             [99, 99, (190861 ^ 426727 ^ 226295) % 49 + 50]]
    assert signs.tolist() == [[0, (150055 ^ 337897) & 7, (210077 ^ 530981) & 7], [0, 0, (134005 ^ 278453 ^ 645689) & 7]]
    assert rows.tolist() == [[49, 16, 20], [99, 99, 93]] and signs.tolist() == [[0, 6, 0], [0, 0, 1]]
    rng = np.random.default_rng(0)
    ids = [int(v) for v in rng.integers(0, 50257, 400)] + [50256, 50256, 50256, 0, 1, 50255, 0, 0, 50256]
    for table_rows in (T.NGRAM_RECORD_ROWS, 50_000, 8):
        got, got_signs = ours(ids, table_rows)
        assert got.tolist() == [list(r) for r in reference_rows(ids, table_rows)], table_rows
        assert got_signs.tolist() == [list(r) for r in reference_signs(ids, 8192)]
        assert got[0].max() < table_rows // 2 <= got[1].min() and got[1].max() < table_rows
    # the wrap-around and the negative xor are real at these ids
    assert 60961 * 50256 > 2 ** 31 and int32(17351 * 0) ^ int32(60961 * 50255) ^ int32(45259 * 1) < 0  # (1, 50255, 0)
    for short in ([3], [3, 4]):  # a sequence of one or two tokens: no trigram, and no bigram at position 0
        assert ours(short, 100)[0].tolist() == [list(r) for r in reference_rows(short, 100)]
    chunk = np.array(ids + [0], dtype=np.uint16)  # the loader's micro-batch: inputs and the last target
    assert T.host_ngram_rows(chunk, 50_000).tolist() == sorted(set(sum(reference_rows(ids, 50_000), [])))


def test_the_table_s_gradient_reaches_only_the_rows_read_as_autograd_of_the_dense_formula():
    rows, width = 5000, 8
    torch.manual_seed(0)
    table = T.NgramEmbedding(rows, width, torch.float32)
    table.weight.normal_()
    signs = torch.randn(64, width).sign()
    ids = torch.randint(0, 30, (50,))  # few distinct ids: rows read twice or more
    n = len(ids)
    read = T.host_ngram_rows(np.append(ids.numpy(), 0).astype(np.uint16), rows)
    T.ngram_pull(table, read, grad=True)
    x0 = table(ids, T.shifted(ids, 1, n), T.shifted(ids, 2, n), torch.arange(n), signs, torch.float32)
    target = torch.randn(n, width)
    (x0 * target).sum().backward()
    dense = table.weight.clone().requires_grad_(True)
    r, s = ours(ids.tolist(), rows, 64)
    x0_dense = dense[r[0]] * signs[s[0]] + dense[r[1]] * signs[s[1]]
    (x0_dense * target).sum().backward()
    assert_close(x0.detach(), x0_dense.detach(), rtol=0, atol=0)
    assert len(read) < 2 * n and table.view.cache.grad.shape == (len(read), width)
    assert_close(table.view.cache.grad, dense.grad[torch.from_numpy(read)], rtol=1e-6, atol=1e-6)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[torch.from_numpy(read)] = False
    assert dense.grad[untouched].abs().max() == 0


def dense_rms_adam(p, v, g, beta2, lr, wd, t, eps=1e-10):
    """Adam with beta1 = 0 and one second moment per row (the mean over the row of g^2), every row at every event
    (an untouched row's g is 0), cautious weight decay; in fp64."""
    v = v * beta2 + (g * g).mean(1) * (1 - beta2)
    u = g / (v.sqrt() + eps)[:, None] * (lr * math.sqrt(1 - beta2 ** t))
    u = u + torch.where(u * p > 0, p * (lr * lr * wd), 0.0)
    return p - u, v


def test_the_row_sparse_adam_is_dense_per_row_rms_adam():
    # Rows touched at some events and not others: the untouched ones must keep their weights exactly and owe only
    # their v's decay, which the next event that touches them replays (beta2 changes halfway, as at step 336).
    rows, width = 200, 16
    g = torch.Generator().manual_seed(0)
    table = T.NgramEmbedding(rows, width, torch.float32)
    table.weight.copy_(torch.randn(rows, width, generator=g) * 0.1)
    group = {"betas": (0.0, 0.95), "lr": 0.05, "weight_decay": 3.0, "eps": 1e-10}
    adam = T.NgramAdam(table, group)
    p, v = table.weight.double().clone(), torch.zeros(rows, dtype=torch.float64)
    for t in range(1, 13):
        beta2, wd = (0.95, 3.0) if t <= 6 else (0.95 ** 2, 6.0)
        group.update(betas=(0.0, beta2), weight_decay=wd)
        touched = torch.nonzero(torch.rand(rows, generator=g) < 0.3).flatten()
        grad = torch.zeros(rows, width)
        grad[touched] = torch.randn(len(touched), width, generator=g) * 0.01
        before = table.weight.clone()
        adam.ids, adam.grad = touched.numpy(), grad[touched].clone()  # what end_step collected
        adam.step()
        p, v = dense_rms_adam(p, v, grad.double(), beta2, 0.05, wd, t)
        idle = torch.ones(rows, dtype=torch.bool)
        idle[touched] = False
        assert torch.equal(table.weight[idle], before[idle])
        assert_close(table.weight.double(), p, rtol=1e-5, atol=1e-7)  # (fp32 weights of about 0.1)
        assert float((table.weight.double() - p).norm() / p.norm()) < 1e-6
        assert_close(adam.current_v().double(), v, rtol=1e-5, atol=1e-16)
    assert (adam.last_event < adam.events).sum() > 100  # rows whose v is still owed some decay: the replay is lazy
    assert (p * table.weight.double() < 0).sum() == 0 and (table.weight != 0).all()


def test_the_embeddings_take_adam_steps_on_record_92s_cadence():
    args = T.parse_args([*SMOKE89, "--num_iterations=1194", "--extension_steps=20", "--embed_adam_period=4",
                         "--embed_adam_period_start=336"], False)
    schedule = T.Schedule(args)
    events = [s for s in range(1194) if schedule.embed_adam_steps(s)]
    assert events == [s for s in range(336) if s % 2 == 1] + [s for s in range(336, 1194) if s % 4 == 3]
    assert all(schedule.adam_steps(s) for s in events)
    assert [schedule.embed_adam_power(s) for s in (0, 335, 336, 1193)] == [1, 1, 2, 2]
    model = T.build_model(args, CPU)
    muon, adam = T.build_optimizers(model, args)
    ve = next(group for group in adam.param_groups if group["params"][0] is model.value_embeds)
    other = next(group for group in adam.param_groups if group["params"][0] is model.lm_head)
    T.set_schedules(335, (muon, adam), schedule, args)
    assert ve["betas"] == (0.75, 0.95) and ve["weight_decay"] == args.adam_weight_decay * 5.0
    T.set_schedules(336, (muon, adam), schedule, args)
    assert ve["betas"] == (0.75 ** 2, 0.95 ** 2) and ve["weight_decay"] == args.adam_weight_decay * 5.0 * 2
    assert other["betas"] == (0.5, 0.95) and other["weight_decay"] == args.adam_weight_decay * 150.0
    off = T.Schedule(T.parse_args([*SMOKE89], False))  # the default: today's cadence, unchanged
    assert all(off.embed_adam_steps(s) == off.adam_steps(s) and off.embed_adam_power(s) == 1 for s in range(100))


def test_dist_adam_parks_the_embeddings_between_their_adam_steps():
    torch.manual_seed(0)
    ve, other = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))

    def make(params):
        return T.DistAdam([dict(params=[params[0]], lr=0.1, betas=(0.75, 0.95), embedding_cadence=True),
                           dict(params=[params[1]], lr=0.1, betas=(0.9, 0.99))], eps=1e-10)
    opt = make([ve, other])
    g1, g2, h1, h2 = torch.randn(6, 4), torch.randn(6, 4), torch.randn(5), torch.randn(5)
    ve.grad, other.grad = g1.clone(), h1.clone()
    start, other_start = ve.detach().clone(), other.detach().clone()
    opt.set_embedding_step(False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert torch.equal(ve.data, start) and torch.equal(ve.grad, g1) and other.grad is None
    assert not torch.equal(other.data, other_start) and opt.state[ve] == {}
    ve.grad = ve.grad + g2  # the next step's backward accumulates into it
    other.grad = h2.clone()
    opt.set_embedding_step(True)
    opt.step()
    # one Adam step on the summed gradient, the first of its own
    ve2, other2 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(other_start.clone())
    ref = make([ve2, other2])
    ve2.grad = g1 + g2
    ref.step()
    assert_close(ve.data, ve2.data, rtol=0, atol=0)
    assert opt.state[ve]["step"] == 1 and opt.state[other]["step"] == 2


def test_a_checkpoint_resumes_the_table_exactly(tmp_path):
    # Two steps (an Adam step of the table at 1), a checkpoint at 2, two more (the table's next at 3, on the slow
    # cadence): the same from the checkpoint. The shard travels in rank_0.pt, its moments and clock in DistAdam's.
    # (check_checkpoint's reading is the other tests'; its hashing and scans of every weight are left out here.)
    args = T.parse_args([*TINY, f"--checkpoint_dir={tmp_path}"], False)
    schedule = T.Schedule(args)

    def steps(model, optimizers, loader, which):
        for step in which:
            T.set_schedules(step, optimizers, schedule, args)
            T.train_step(model, optimizers, loader.next_batch(step), step, schedule, args, use_flex=False)

    model = T.build_model(args, CPU)
    optimizers, loader = T.build_optimizers(model, args), T.TrainLoader(args, CPU, schedule)
    steps(model, optimizers, loader, range(2))
    path = T.save_checkpoint(2, 1.0, model, optimizers, loader, args, CPU, TRAIN.read_text(), "run")
    steps(model, optimizers, loader, range(2, 4))
    resumed = T.build_model(args, CPU)
    again = T.build_optimizers(resumed, args)
    loader2 = T.TrainLoader(args, CPU, schedule)
    files = [torch.load(path / name, weights_only=True) for name in ("model.pt", "rank_0.pt")]
    T.load_checkpoint(T.Resume(path, T.read_checkpoint_meta(path), *files), resumed, again, loader2, CPU)
    assert optimizers[1].table.events == 2 and again[1].table.events == 1 and "ngram.weight" in files[1]["rank_buffers"]
    steps(resumed, again, loader2, range(2, 4))
    assert again[1].table.events == 2 and (model.ngram.weight != 0).any(1).sum() > 100
    assert torch.equal(resumed.ngram.weight, model.ngram.weight)
    assert torch.equal(again[1].table.current_v(), optimizers[1].table.current_v())
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    final = T.save_final_weights(model, args, TRAIN.read_text(), "run", 4, 1.0)
    loaded, _, _ = T.load_final_weights(final, torch.device("cpu"))
    assert torch.equal(loaded.ngram.weight, model.ngram.weight)


def test_the_memory_model_counts_record_92s_table_sharded():
    args = T.parse_args(["--preset=speedrun", "--ngram_channels=2", f"--bigram_vocab_size={T.NGRAM_RECORD_ROWS}",
                         "--micro_batches=8"], True)
    bf16 = T.Numerics(torch.bfloat16, "bf16", "bf16")
    memory = T.MemoryModel(args, 8, torch.device("cuda"), bf16, "flex")
    per_rank = T.NGRAM_RECORD_ROWS // 8
    others = T.tensor_bytes(t for name, t in memory.model.named_buffers() if name != "ngram.weight")
    assert memory.buffers - others == per_rank * 768 * 2  # the shard, bf16: 16.2 GB (15.1 GiB)
    assert memory.model.ngram.weight.shape == (per_rank, 768) and memory.weights < 2 ** 30  # not a parameter
    state, held, event = T.ngram_bytes(memory.model.ngram, 2 * 49152, 4 * 2 * 49152)
    assert state == per_rank * 8  # an fp32 second moment and an int32 clock per row
    assert held == (2 * 98304 + 393216) * 768 * 4  # the pulled rows, their gradient, the cycle's gradient (fp32)
    assert event == 393216 * 768 * (4 + 2 * 2 + 4 + 4 + 12)
    # one card cannot hold the record's table: the state alone refuses it, naming the flag that shrinks it
    with pytest.raises(T.DoesNotFitError, match="smaller --bigram_vocab_size"):
        T.fit_micro_batches(args, 1, torch.device("cuda"), bf16, "flex", 70 * 2 ** 30, "a card")
    assert T.MAX_NGRAM_ROWS >= T.NGRAM_RECORD_ROWS > T.MAX_TABLE_ROWS


@pytest.mark.parametrize("flags, fragment", [
    (["--bigram_vocab_size=50001"], "an even number"),
    (["--bigram_sign_rows=1000"], "a power of two"),
    (["--bigram_vocab_size=4"], "at least 6"),
    ([f"--bigram_vocab_size={2 ** 31}"], "at most"),
    (["--embed_adam_period=3"], "multiple of --adam_every"),
    (["--embed_adam_period=4", "--embed_adam_period_start=0", "--save_every=2"],
     "checkpoint at step 2 falls between two of the embeddings' Adam"),
    (["--embed_adam_period=4", "--embed_adam_period_start=12", "--save_every=6"], "checkpoint at step 18 falls"),
])
def test_the_config_refuses_what_the_table_cannot_be(flags, fragment):
    with pytest.raises(T.ConfigError, match=fragment):
        T.parse_args([*SMOKE89, "--ngram_channels=2", *flags], False)


def test_checkpoints_at_the_embeddings_adam_steps_are_allowed_before_the_slow_cadence():
    # every 2 steps while the embeddings step with Adam's own cadence (until 12), then every 4: no checkpoint
    # holds a gradient between two of their Adam steps
    T.parse_args([*SMOKE89, "--ngram_channels=2", "--embed_adam_period=4", "--embed_adam_period_start=12",
                  "--num_iterations=12", "--extension_steps=1", "--save_every=2"], False)


def test_the_table_must_split_evenly_over_the_ranks():
    args = T.parse_args([*SMOKE89, "--ngram_channels=2", "--bigram_vocab_size=50002"], False)
    with pytest.raises(T.ConfigError, match="split evenly over the ranks"):
        T.check_world_size(args, 4)
    T.check_world_size(args, 2)


def test_final_weights_written_before_the_table_s_flags_still_load(tmp_path):
    untrained_final_folder = random_final_weights(tmp_path / "old", *SMOKE89)  # a model of before the table
    info = json.loads((untrained_final_folder / "config.json").read_text())
    for name in T.ADDED_FIELDS:
        del info["config"][name]
    (tmp_path / "config.json").write_text(json.dumps(info))
    os.link(untrained_final_folder / "model.pt", tmp_path / "model.pt")
    model, args, _ = T.load_final_weights(tmp_path, torch.device("cpu"))
    assert (args.ngram_channels, args.embed_adam_period) == (1, 0) and model.bigram_embed is not None

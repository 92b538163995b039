"""Record #92's terminal ships (TailShips): which steps each accumulator ticks at and at what rate, the shipped
weights against the formulas in fp64, and the accumulators' run state across a checkpoint. At world sizes 2 and 3
(real gloo collectives, each rank a slice) against world size 1: tests/workers/ships_worker.py, run by
test_optimizers.py's gloo launches."""

import math

import pytest
import torch

import train_gpt as T
from conftest import SMOKE89  # noqa: E402

RECORD92 = T.Schedule(T.parse_args([f"--{k}={v}" for k, v in T.RECORD92_SCHEDULE.items()], True))


def ticks(ship, schedule):
    return {step: ship.rate(step) for step in range(schedule.total - ship.window, schedule.total)
            if ship.rate(step) is not None}


def test_record_92s_ships_tick_where_the_records_do():
    ema, avg, ve, blend = T.record92_ships(RECORD92)
    r = 2 / 299
    # tail EMA (the record's _tema_rate): seeded at 1194 - 298 = 896, then each odd step for itself and the even
    # step after it, folded; the last step 1193 alone
    expected = {896: r} | {s: -math.expm1(2 * math.log1p(-r)) for s in range(897, 1193, 2)} | {1193: r}
    assert ticks(ema, RECORD92) == expected
    # tail average: every 4th step counted back from the last, in the last 250 steps
    assert ticks(avg, RECORD92) == {s: 4 / 53 for s in range(945, 1194, 4)}
    # value embeddings: at their Adam steps in the last 250 (the record's cadence: every 4th step from 336, 3 mod 4)
    assert ticks(ve, RECORD92) == {s: 4 / 53 for s in range(947, 1194, 4)}
    # bank blend: steps 1 mod 4 and the last two, in the last 298, at 2 / (298 // 4 + 1)
    assert ticks(blend, RECORD92) == {s: 2 / 75 for s in sorted({*range(897, 1194, 4), 1192, 1193})}
    assert [ship.name for ship in (ema, avg, ve, blend)] == ["tail-ema", "tail-avg", "value-embed", "bank-blend"]


def test_the_folded_ema_is_the_ema_of_every_step():
    """The weights move only at Adam steps (odd): one tick of the compounded rate per run of steps over which they
    stay equals an EMA tick at every step of the window, in fp64."""
    schedule = RECORD92
    ema = T.record92_ships(schedule)[0]
    start, r = schedule.total - ema.window, 2 / (ema.window + 1)
    weights = {s: math.sin(s) for s in range(schedule.total)}  # the value after step s's update
    held = lambda s: weights[s if schedule.adam_steps(s) else s - 1]
    every = folded = None
    for step in range(start, schedule.total):
        every = held(step) if every is None else every + r * (held(step) - every)
        rate = ema.rate(step)
        if rate is not None:
            folded = held(step) if folded is None else folded + rate * (held(step) - folded)
    assert folded == pytest.approx(every, rel=1e-13)


def small_model(seed=0):
    args = T.parse_args([*SMOKE89, "--num_iterations=40", "--extension_steps=3", "--vocab_size=300",
                         "--bigram_vocab_size=300"], False)
    torch.manual_seed(seed)
    return T.GPT(args), T.Schedule(args)


def walk(model, step):
    """The weights after step `step`: a random walk that every rank takes alike."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def test_shipped_weights_follow_the_formulas():
    model, schedule = small_model()
    ships = T.TailShips(model, T.record92_ships(schedule), schedule.total, 1, 0)
    kinds = T.ship_kinds(model)
    acc = {}  # fp64 replay: (ship name, parameter id) -> accumulator
    for step in range(schedule.total):
        walk(model, step)
        ships.tick(step)
        for ship in ships.ships:
            rate = ship.rate(step) if step >= schedule.total - ship.window else None
            for kind in ship.kinds if rate is not None else ():
                for p in kinds[kind]:
                    key, w = (ship.name, id(p)), p.detach().double()
                    acc[key] = w.clone() if key not in acc else acc[key] + rate * (w - acc[key])
    before = {id(p): p.detach().double().clone() for p in model.parameters()}
    norm = lambda kind, values: torch.stack([values[id(p)].norm() for p in kinds[kind]]).norm()
    expected = dict(before)
    for p in kinds["lm_head"] + kinds["embed"]:
        expected[id(p)] = torch.lerp(before[id(p)], acc[("tail-ema", id(p))], 0.65)
    for p in kinds["vo"] + kinds["mlp"]:
        expected[id(p)] = acc[("tail-avg", id(p))]
    for p in kinds["value_embeds"]:
        expected[id(p)] = acc[("value-embed", id(p))]
    for kind, blend in (("qk", 0.55), ("vo", 0.55 - 0.2007), ("mlp", 0.55 - 0.2007)):
        for p in kinds[kind]:
            expected[id(p)] = torch.lerp(expected[id(p)], acc[("bank-blend", id(p))], blend)
    ratios = {kind: norm(kind, before) / norm(kind, expected) for kind in ("embed", "lm_head", "mlp", "qk", "vo")}
    for kind, ratio in ratios.items():
        for p in kinds[kind]:
            expected[id(p)] = expected[id(p)] * ratio
    ships.ship()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), expected[id(p)], rtol=2e-6, atol=2e-7, msg=name)
    assert any(abs(r - 1) > 1e-4 for r in ratios.values())  # the decontraction did something to check


def test_the_accumulators_resume_exactly():
    def run(stop_at=None):
        model, schedule = small_model()
        ships = T.TailShips(model, T.record92_ships(schedule), schedule.total, 1, 0)
        for step in range(schedule.total):
            walk(model, step)
            ships.tick(step)
            if step == stop_at:
                saved = ships.state_dict()
                ships = T.TailShips(model, T.record92_ships(schedule), schedule.total, 1, 0)
                ships.load_state_dict(saved)
        ships.ship()
        return [p.detach().clone() for p in model.parameters()]
    uninterrupted, resumed = run(), run(stop_at=25)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    with pytest.raises(ValueError, match="ship accumulators"):
        T.TailShips(*small_model()[:1], [], 40, 1, 0).load_state_dict([{}])


def test_the_memory_model_counts_each_ranks_slices_of_the_accumulators():
    model, schedule = small_model()
    numel = {name: p.numel() for name, p in model.named_parameters()}
    of = lambda end: sum(n for name, n in numel.items() if name == end or name.endswith(end))
    # EMA: lm_head, embedding; average: V/O, MLP; value embeddings; blend: QK, V/O, MLP
    held = of("lm_head") + of("embed.weight") + 2 * (of(".attn.vo") + of(".mlp.fc") + of(".mlp.proj")) \
        + of("value_embeds") + of(".attn.qk")
    assert T.ship_bytes(model, T.record92_ships(schedule), 1) == 4 * held
    per_tensor = [n for name, n in numel.items() for _ in range(2 if ".attn.vo" in name or ".mlp." in name else 1)
                  if any(name == e or name.endswith(e) for e in ("lm_head", "embed.weight", "value_embeds", ".attn.qk",
                                                                 ".attn.vo", ".mlp.fc", ".mlp.proj"))]
    assert T.ship_bytes(model, T.record92_ships(schedule), 3) == 4 * sum(-(-n // 3) for n in per_tensor)


def test_the_mlp_decontraction_counts_what_the_record_keeps_of_a_removed_layer():
    """Record #92's MLP bank keeps its removed layer's matrices, frozen at init: its decontraction norm counts them.
    Ours holds their squared norm (GPT.removed_mlp_sq), which the MLP kind's norm takes in."""
    t = torch.randn(5, 7)
    assert T.kind_norm([t], torch.tensor(3.0)).item() == pytest.approx(math.sqrt(t.square().sum().item() + 3), 1e-6)
    args = T.parse_args([*SMOKE89, "--vocab_size=300", "--bigram_vocab_size=300", "--removed_layers=4",
                         "--no_attention_layers=3,4", "--paired_layers=0", "--value_embed_layers=1,2,5"], False)
    model = T.GPT(args)
    assert model.removed_mlp_sq.item() == 4 * 64 * 0.25  # hidden * dim * (0.5 dim^-0.5)^2: the init's expectation
    ships = T.TailShips(model, T.record92_ships(T.Schedule(args)), 40, 1, 0)
    assert ships.frozen_sq == {"mlp": model.removed_mlp_sq}

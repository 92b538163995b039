"""NorMuon, ANVIL and DistAdam: distributed runs (gloo, several processes) against single-process references,
and each part of NorMuon and ANVIL against its definition."""

import io
import math
import sys

import pytest
import torch
from torch.testing import assert_close

import train_gpt as T
from conftest import REPO, torchrun

sys.path.insert(0, str(REPO / "tests" / "workers"))
from muon_worker import run_anvil, run_normuon  # noqa: E402

WORKERS = REPO / "tests" / "workers"
NO_FUTURE_WARNINGS = {"PYTHONWARNINGS": "error::FutureWarning"}  # 2.13 deprecates the old collective names


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """tests/workers/gloo_worker.py under torchrun at world sizes 2 and 3: {world size: (stdout, {"normuon",
    "anvil": the final parameters})}. One launch per world size runs every check; a failed check fails the launch."""
    runs = {}
    for world_size in (2, 3):
        out = tmp_path_factory.mktemp("gloo") / f"normuon_{world_size}.pt"
        proc = torchrun(WORKERS / "gloo_worker.py", world_size, out, extra_env=NO_FUTURE_WARNINGS)
        runs[world_size] = proc.stdout, torch.load(out, weights_only=True)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_dist_adam_matches_record_85s_adam(gloo_runs, world_size):
    # The worker steps DistAdam every 2 training steps of 2 micro-batches, as the trainer does, and asserts
    # reduced gradient shards and parameters against record #85's Adam (written out there) on the summed
    # mean-over-ranks gradients, with per-group betas and cautious weight decay, and a tied pair untied
    # halfway; one reduce-scatter per bucket launched during the last backward (the tied source's joins its
    # target's) and none under no_sync(), and identical parameters on every rank.
    assert gloo_runs[world_size][0].count("DistAdam matched record #85's Adam") == world_size


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_tail_ships_at_several_ranks_ship_what_one_rank_ships(gloo_runs, world_size):
    # tests/workers/ships_worker.py: each rank keeps a slice of every accumulator and the shipped weights are
    # all-gathered; bit for bit the weights one process ships (test_ships.py checks those against the formulas)
    assert gloo_runs[world_size][0].count("TailShips matched world size 1") == world_size


def test_a_tied_pair_sums_gradients_moves_together_and_unties_with_the_targets_state():
    torch.manual_seed(0)
    target = torch.nn.Parameter(torch.randn(3, 5))
    source = torch.nn.Parameter(target.detach().T.contiguous())
    opt = T.DistAdam([dict(params=[source]), dict(params=[target])], lr=0.1, betas=(0.5, 0.95), eps=1e-10)
    opt.tie(source, target)
    g_source, g_target = torch.randn(5, 3), torch.randn(3, 5)
    source.grad, target.grad = g_source.clone(), g_target.clone()
    opt.step()
    # one Adam step on the summed gradient: -lr * sign(g) per element (first step, eps negligible)
    assert_close(target.data, target.data.new_tensor(0) + (source.data.T), rtol=0, atol=0)
    expected = torch.sign(g_target + g_source.T)
    assert torch.equal(opt.state[target]["exp_avg"].view(3, 5).sign(), expected)
    opt.untie()
    assert opt.tied is None and opt.state[source]["step"] == 1
    assert torch.equal(opt.state[source]["exp_avg"].view(5, 3), opt.state[target]["exp_avg"].view(3, 5).T)
    assert torch.equal(opt.state[source]["exp_avg_sq"].view(5, 3), opt.state[target]["exp_avg_sq"].view(3, 5).T)
    before = source.data.clone()
    source.grad, target.grad = torch.randn(5, 3), torch.randn(3, 5)
    opt.step()  # now each moves on its own
    assert not torch.equal(source.data, before) and not torch.equal(source.data, target.data.T)


def test_dist_adam_state_dict_round_trip_keeps_fp32_state():
    params = [torch.nn.Parameter(torch.randn(40, 4, dtype=torch.bfloat16))]
    opt = T.DistAdam(params, lr=0.01)
    params[0].grad = torch.randn(40, 4, dtype=torch.bfloat16)
    opt.step()
    saved = opt.state_dict()
    fresh = T.DistAdam(params, lr=0.5)
    fresh.load_state_dict(saved)
    state = fresh.state[params[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["step"] == 1
    assert_close(state["exp_avg_sq"], opt.state[params[0]]["exp_avg_sq"], rtol=0, atol=0)
    assert fresh.param_groups[0]["lr"] == 0.01


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_row_exchange_equals_the_dense_reduce_scatter(gloo_runs, world_size):
    # The worker's table: rows each rank touches, rows only others touch, rows nobody touches; three Adam
    # steps with the sparse exchange against the same with a dense reduce-scatter, and the all-to-alls counted.
    assert gloo_runs[world_size][0].count("the sparse row exchange matched") == world_size


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_world_size_builds_the_candidate_sets_of_world_size_1(gloo_runs, world_size):
    # Record #92's sampled softmax: each rank's sets of its micro-batches, gathered, are world size 1's sets of the
    # same micro-batches, and the streams' offsets a checkpoint keeps (gathered from their ranks) are world size 1's.
    assert gloo_runs[world_size][0].count("candidate sets and the streams' offsets are world size 1's") == world_size


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sharded_ngram_table_trains_as_one_table(gloo_runs, world_size):
    # tests/workers/ngram_worker.py: record #92's table sharded over the ranks against the whole table in one
    # process on the same micro-batches (each rank's x0_bigram from the rows it pulled, every Adam step's weights and
    # second moments after the gradients went to their owners, on the embeddings' cadence), and a resume from the
    # table's saved state reaching the same weights bit for bit.
    assert gloo_runs[world_size][0].count("the sharded n-gram table matched world size 1") == world_size


@pytest.mark.slow
def test_every_dist_adam_bucket_is_reduced_from_its_hook_during_backward(gloo_runs):
    # The smoke model at world size 2: no bucket may be reduced late, from step(); the worker also shows,
    # with a parameter that gets no gradient, that such a late reduction is detected.
    assert gloo_runs[2][0].count("every DistAdam bucket was reduced from its hook during backward") == 2


@pytest.mark.slow
def test_distributed_normuon_equals_single_process(gloo_runs):
    # Rank gradients average exactly to the single-process gradient (see the worker), so the parameters
    # after three steps must be bit-identical at world sizes 1 (here, no process group), 2 and 3.
    single = run_normuon(rank=0, world=1)
    assert not torch.equal(single, torch.zeros_like(single))
    for world_size in (2, 3):
        assert torch.equal(gloo_runs[world_size][1]["normuon"], single), world_size


@pytest.mark.slow
def test_distributed_anvil_equals_single_process(gloo_runs):
    # The same for ANVIL on bf16 weights, its rails engaging at the last step: the fp32 masters (bf16 weights
    # and the mantissas their owning ranks keep) bit-identical at world sizes 1, 2 and 3.
    single = run_anvil(rank=0, world=1)
    assert (single.view(torch.int32) & 0xFFFF).any()  # the masters carry mantissas: bf16 alone would not show them
    for world_size in (2, 3):
        assert torch.equal(gloo_runs[world_size][1]["anvil"], single), world_size


def spread_matrix(rows, cols, decades, seed=0, dtype=torch.float32):
    """A matrix with singular values log-spaced over `decades` decades (a badly conditioned gradient)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    k = min(rows, cols)
    return (u[:, :k] @ torch.diag(torch.logspace(0, -decades, k, dtype=torch.float64)) @ v[:k]).to(dtype)


PUBLISHED_POLAR_EXPRESS = [  # record #85 (num_iters=5, safety_factor=2e-2, cushion=2)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def test_polar_express_iterates_its_published_polynomials_on_the_singular_values():
    # An odd matrix polynomial acts on each singular value alone: sigma -> a s + b s^3 + c s^5.
    assert T.POLAR_EXPRESS_COEFFS == tuple(PUBLISHED_POLAR_EXPRESS)
    g = spread_matrix(48, 80, decades=2, dtype=torch.float64)
    sv = torch.linalg.svdvals(g)
    s = sv / (g.norm() * 1.02 + 1e-6)
    for a, b, c in PUBLISHED_POLAR_EXPRESS:
        s = a * s + b * s ** 3 + c * s ** 5
    out = T.polar_express(g, dtype=torch.float64)
    assert_close(torch.linalg.svdvals(out), s.sort(descending=True).values, rtol=1e-9, atol=1e-12)
    # and it keeps the singular vectors: out = U f(S) V^T
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert_close(out, u @ torch.diag(s) @ vh, rtol=1e-9, atol=1e-12)
    assert_close(T.polar_express(g.T, dtype=torch.float64), out.T, rtol=1e-9, atol=1e-12)  # tall: via the transpose


def quintic_newton_schulz(g, steps=5):
    """Muon's fixed quintic (Keller Jordan, 2024), for comparison."""
    x = g / (g.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 128)])
def test_polar_express_maps_singular_values_into_a_tighter_band_than_the_quintic(shape):
    g = spread_matrix(*shape, decades=2)
    raw = torch.linalg.svdvals(g / g.norm())
    assert raw.max() / raw.min() > 90  # the input is far from orthogonal
    pe = torch.linalg.svdvals(T.polar_express(g, dtype=torch.float32))
    quintic = torch.linalg.svdvals(quintic_newton_schulz(g if shape[0] <= shape[1] else g.T))
    # measured here: Polar Express [0.859, 1.141], the quintic [0.682, 1.201]
    assert (pe.max() - pe.min()) < 0.6 * (quintic.max() - quintic.min()), (pe, quintic)
    assert pe.min() > quintic.min() + 0.1 and 0.85 < pe.min() and pe.max() < 1.15, (pe.min(), pe.max())


def normuon_step(p, grad, **kwargs):
    p.grad = grad.clone()
    opt = T.NorMuon([p], ns_dtype=torch.float32, **kwargs)
    opt.step()
    return opt


@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (48, 48), (3, 24, 24), (2, 16, 48)])
def test_normuon_normalises_each_neuron_and_keeps_the_update_norm(shape):
    # From zero state, one step: the update is the orthogonalised Nesterov gradient with each neuron's
    # slice divided by its root mean square, rescaled to the orthogonalised update's norm. So every
    # neuron of the update has the same RMS: per row for tall and square matrices (the record's
    # rows >= cols), per column for wide ones; each matrix of a stack on its own.
    torch.manual_seed(0)
    grad = torch.randn(shape) * torch.rand(shape[-1])  # columns of very different scales
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = normuon_step(p, grad, lr=0.1, momentum=0.9, beta2=0.95)
    rows, cols = shape[-2:]
    update = -p.data / (0.1 * max(1, rows / cols) ** 0.5)
    axis = -1 if rows >= cols else -2
    rms = update.square().mean(dim=axis).sqrt()
    assert_close(rms, rms.mean(dim=-1, keepdim=True).expand_as(rms), rtol=1e-4, atol=0)
    orthogonal = T.polar_express(grad.lerp(0.1 * grad, 0.9), dtype=torch.float32)
    assert_close(update.norm(dim=(-2, -1)), orthogonal.norm(dim=(-2, -1)), rtol=1e-5, atol=0)
    moments = torch.stack([s["second_moment"] for s in opt.matrix_state]).view_as(
        orthogonal.square().mean(dim=axis, keepdim=True))
    assert_close(moments, 0.05 * orthogonal.square().mean(dim=axis, keepdim=True), rtol=1e-5, atol=0)


def test_cautious_weight_decay_touches_only_coordinates_where_update_and_weight_agree():
    torch.manual_seed(1)
    weights, grad, lr, wd = torch.randn(40, 24), torch.randn(40, 24), 0.05, 1.2
    plain, decayed = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    normuon_step(plain, grad, lr=lr, momentum=0.9, weight_decay=0.0)
    normuon_step(decayed, grad, lr=lr, momentum=0.9, weight_decay=wd)
    scale = max(1, 40 / 24) ** 0.5
    update = (weights - plain.data) / (lr * scale)  # v, the normalised update
    agree = update * weights >= 0
    assert 0.3 < agree.float().mean() < 0.7  # both kinds of coordinate occur
    difference = plain.data - decayed.data
    assert torch.equal(difference[~agree], torch.zeros_like(difference[~agree]))
    # where they agree: an extra lr * scale * (lr * wd) * p, a decay scheduled with lr^2
    assert_close(difference[agree], (lr * scale * lr * wd * weights)[agree], rtol=1e-4, atol=1e-7)


def test_lr_multiplier_and_shape_scale_the_update():
    torch.manual_seed(2)
    grad, weights = torch.randn(48, 16), torch.randn(48, 16)
    plain, doubled = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    normuon_step(plain, grad, lr=0.01, momentum=0.9)
    doubled.grad = grad.clone()
    T.NorMuon([dict(params=[doubled], lr_mul=2.0)], lr=0.01, momentum=0.9, ns_dtype=torch.float32).step()
    # sqrt(48 / 16) for the shape, times 2 for the group (the record's c_proj: 2 * 2 = 4)
    assert_close(weights - doubled.data, 2 * (weights - plain.data), rtol=1e-5, atol=5e-7)  # fp32 ulps of weights ~1
    v = (weights - plain.data) / (0.01 * 3 ** 0.5)
    assert_close(v.square().mean(-1).sqrt(), torch.ones(48) * v.square().mean().sqrt(), rtol=1e-4, atol=0)


def test_bf16_weights_keep_an_fp32_master_in_their_mantissas():
    # The record's "mantissa": a bf16 weight and its 16 saved low bits are the fp32 value an fp32 weight would
    # hold after the same steps, bit for bit; the bf16 weight is that value truncated.
    torch.manual_seed(3)
    start = torch.randn(32, 64).bfloat16()
    half, full = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.float())
    opt_half = T.NorMuon([half], lr=0.002, momentum=0.9, weight_decay=1.2, ns_dtype=torch.float32)
    opt_full = T.NorMuon([full], lr=0.002, momentum=0.9, weight_decay=1.2, ns_dtype=torch.float32)
    for _ in range(5):
        grad = torch.randn(32, 64).bfloat16()
        half.grad, full.grad = grad.clone(), grad.float()
        opt_half.step()
        opt_full.step()
    precise = T.bf16_with_mantissa(half.data, opt_half.matrix_state[0]["mantissa"])
    assert torch.equal(precise, full.data)
    truncated = (full.data.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(half.data, truncated)
    assert not torch.equal(half.data, start)  # updates of 0.002 moved bf16 weights too


def test_normuon_state_round_trips_in_fp32_for_bf16_parameters():
    p = torch.nn.Parameter(torch.randn(8, 24, dtype=torch.bfloat16))
    opt = normuon_step(p, torch.randn(8, 24, dtype=torch.bfloat16), lr=0.1)
    saved = opt.state_dict()
    fresh = T.NorMuon([p], lr=0.5)
    fresh.load_state_dict(saved)
    state = fresh.matrix_state[0]
    assert state["momentum_buffer"].dtype == torch.float32 and state["second_moment"].shape == (1, 24)
    assert torch.equal(state["momentum_buffer"], opt.matrix_state[0]["momentum_buffer"])
    assert torch.equal(state["mantissa"], opt.matrix_state[0]["mantissa"])
    assert fresh.param_groups[0]["lr"] == 0.1


def test_normuon_rejects_vectors():
    with pytest.raises(ValueError, match="matrices or stacks"):
        T.NorMuon([torch.nn.Parameter(torch.zeros(3))])


# -----------------------------------------------------------------------------
# ANVIL (record #92), against an fp64 evaluation of its formulas written out here from the singular values

ANVIL_PUBLISHED_MAPS = [  # record #92's ANVIL_MAPS
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
]


class AnvilReference:
    """One matrix's ANVIL in fp64, from the formulas: rails f, s (zero at the start), lane energies E.
        f <- f + (1 - beta_f)(G - f),  s <- s + 0.02 (G - s),  u = G + mu (w f + (1 - w) s - G)
        u = U S V^T:  v = U p6(...p1(S / (1.05 ||u||_F + 1e-6))) V^T,   p(x) = a x + b x^3 + c x^5
        lanes: the indices of the longer side (rows when rows >= cols), P_i their mean squares over the other side,
        E <- E + (1 - beta2)(P - E),  v_i <- v_i E_i^(-1/2), then v rescaled to its norm before
        W <- W - lr r (v + lr wd [s W >= 0] W),   r = sqrt(max(1, rows / cols)) lr_mul"""

    def __init__(self, weight: torch.Tensor, lr_mul: float, beta2: float, weight_decay: float):
        self.w = weight.double().clone()
        self.f, self.s = torch.zeros_like(self.w), torch.zeros_like(self.w)
        rows, cols = weight.shape
        self.lane_dim = 1 if rows >= cols else 0  # the dimension a lane's mean runs over
        self.energy = torch.zeros(rows if rows >= cols else cols, dtype=torch.float64)
        self.r = max(1.0, rows / cols) ** 0.5 * lr_mul
        self.beta2, self.wd = beta2, weight_decay

    def step(self, grad, lr, momentum, fast_beta, blend):
        g = grad.double()
        self.f += (1 - fast_beta) * (g - self.f)
        self.s += (1 - 0.98) * (g - self.s)
        u = g + momentum * (blend * self.f + (1 - blend) * self.s - g)
        U, S, Vh = torch.linalg.svd(u, full_matrices=False)
        x = S / (1.05 * u.norm() + 1e-6)
        for a, b, c in ANVIL_PUBLISHED_MAPS:
            x = a * x + b * x ** 3 + c * x ** 5
        v = U @ torch.diag(x) @ Vh
        power = v.square().mean(dim=self.lane_dim)
        self.energy += (1 - self.beta2) * (power - self.energy)
        gain = self.energy.rsqrt()
        scaled = v * (gain[:, None] if self.lane_dim == 1 else gain[None, :])
        v = scaled * v.norm() / scaled.norm()
        self.w -= lr * self.r * (v + lr * self.wd * ((self.s * self.w) >= 0) * self.w)


# (lr, momentum = the rail beta, fast-rail beta, blend): the fast rail alone, then engaged, then cooling down
ANVIL_STEPS = [(0.05, 0.85, 0.85, 1.0), (0.05, 0.9, 0.9, 1.0), (0.04, 0.93, 0.85, 0.4385), (0.03, 0.91, 0.85, 0.4385)]


def test_anvil_steps_equal_an_fp64_evaluation_of_their_formulas():
    # Wide, tall and square matrices (lanes along the longer side), a stack of two and a lone one of its shape
    # sharing a stack with different lr multipliers (MUON_TABLE's kinds), badly conditioned gradients (the maps
    # matter over a range of singular values), weights large enough that the gated decay moves them visibly.
    assert T.ANVIL_MAPS == tuple(ANVIL_PUBLISHED_MAPS)
    torch.manual_seed(4)
    stacked, lone, tall, square = (torch.randn(2, 16, 40), torch.randn(16, 40), torch.randn(48, 16),
                                   torch.randn(24, 24))
    params = [torch.nn.Parameter(t.clone()) for t in (stacked, lone, tall, square)]
    lr_muls = [1.0, 2.0, 2.0, 1.0]
    opt = T.Anvil([dict(params=[p], lr_mul=m) for p, m in zip(params, lr_muls)], lr=0.05, momentum=0.85,
                  beta2=0.9, weight_decay=2.25, ns_dtype=torch.float32)
    matrices = [stacked[0], stacked[1], lone, tall, square]
    refs = [AnvilReference(w, m, 0.9, 2.25) for w, m in zip(matrices, [1.0, 1.0, 2.0, 2.0, 1.0])]
    for step, (lr, momentum, fast_beta, blend) in enumerate(ANVIL_STEPS):
        grads = [spread_matrix(*w.shape, decades=2, seed=10 * step + i) for i, w in enumerate(matrices)]
        params[0].grad = torch.stack(grads[:2])
        for p, g in zip(params[1:], grads[2:]):
            p.grad = g.clone()
        for group in opt.param_groups:
            group.update(lr=lr, momentum=momentum, fast_beta=fast_beta, blend=blend)
        opt.step()
        for ref, g in zip(refs, grads):
            ref.step(g, lr, momentum, fast_beta, blend)
    ours = [params[0].data[0], params[0].data[1], *[p.data for p in params[1:]]]
    for i, (w, ref, start) in enumerate(zip(ours, refs, matrices)):
        moved, expected = w.double() - start.double(), ref.w - start.double()
        assert (moved - expected).norm() < 1e-5 * expected.norm(), i
        state = opt.matrix_state[i]
        assert_close(state["rails"][0].double(), ref.f, rtol=1e-6, atol=1e-7)
        assert_close(state["rails"][1].double(), ref.s, rtol=1e-6, atol=1e-7)
        assert_close(state["lane_energy"].double().flatten(), ref.energy, rtol=1e-4, atol=0)


def test_anvil_maps_iterate_record_92s_polynomials_on_the_singular_values():
    # The cascade alone, in fp64 (its trace and scale run in fp32, as the record's): U p(S / d) V^T, wide and tall.
    g = spread_matrix(24, 64, decades=3, dtype=torch.float64)
    u, sv, vh = torch.linalg.svd(g, full_matrices=False)
    s = sv / (1.05 * g.norm() + 1e-6)
    for a, b, c in ANVIL_PUBLISHED_MAPS:
        s = a * s + b * s ** 3 + c * s ** 5
    expected = u @ torch.diag(s) @ vh
    assert_close(T.anvil_maps(g[None], torch.float64)[0], expected, rtol=0, atol=1e-6)
    assert_close(T.anvil_maps(g.T[None], torch.float64)[0], expected.T, rtol=0, atol=1e-6)
    assert 0.99 < s[0] < 1.01 and s[-1] < 0.5  # the largest near 1; a singular value 1e-3 down is not yet


def test_anvil_decay_is_gated_on_the_slow_rail_not_on_the_update():
    # Weights equal to minus the slow rail's sign where the update's sign agrees with them: NorMuon's gate would
    # decay there, ANVIL's (the slow rail's sign) must not. One step from zero state: s = 0.02 G, u = G.
    torch.manual_seed(5)
    grad = torch.randn(20, 30)
    weights = torch.randn(20, 30).abs() * -grad.sign()  # s * W < 0 everywhere: no decay
    a, b = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    for p, wd in ((a, 0.0), (b, 5.0)):
        p.grad = grad.clone()
        T.Anvil([p], lr=0.05, momentum=0.9, weight_decay=wd, ns_dtype=torch.float32).step()
    assert torch.equal(a.data, b.data)
    c = torch.nn.Parameter(-weights)  # s * W > 0 everywhere: decay on every weight
    c.grad = grad.clone()
    T.Anvil([c], lr=0.05, momentum=0.9, weight_decay=5.0, ns_dtype=torch.float32).step()
    d = torch.nn.Parameter(-weights)
    d.grad = grad.clone()
    T.Anvil([d], lr=0.05, momentum=0.9, weight_decay=0.0, ns_dtype=torch.float32).step()
    assert_close(d.data - c.data, 0.05 * 1.0 * 0.05 * 5.0 * -weights, rtol=1e-4, atol=1e-7)


def anvil_run(params, steps, opt=None):
    """ANVIL_STEPS[steps] on bf16 params with fixed gradients; the optimizer (made if None)."""
    opt = opt or T.Anvil(params, lr=0.05, momentum=0.85, beta2=0.9, weight_decay=2.25, ns_dtype=torch.float32)
    for step in steps:
        lr, momentum, fast_beta, blend = ANVIL_STEPS[step]
        for group in opt.param_groups:
            group.update(lr=lr, momentum=momentum, fast_beta=fast_beta, blend=blend)
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return opt


def test_anvil_state_resumes_exactly_and_a_restored_initial_state_starts_over():
    # Both rails, the lane energies and the mantissas are run state: four steps straight equal two, a save
    # (through torch.save, as a checkpoint), a fresh optimizer that loads it, and two more: bit for bit.
    start = [torch.randn(2, 8, 24).bfloat16(), torch.randn(24, 8).bfloat16()]
    straight = [torch.nn.Parameter(t.clone()) for t in start]
    opt = anvil_run(straight, range(4))
    first = [torch.nn.Parameter(t.clone()) for t in start]
    buffer = io.BytesIO()
    torch.save(anvil_run(first, range(2)).state_dict(), buffer)
    buffer.seek(0)
    resumed = [torch.nn.Parameter(p.data.clone()) for p in first]
    fresh = T.Anvil(resumed, lr=0.5, momentum=0.5, ns_dtype=torch.float32)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.param_groups[0]["blend"] == 1.0 and fresh.param_groups[0]["weight_decay"] == 2.25
    anvil_run(resumed, range(2, 4), fresh)
    for a, b in zip(straight, resumed):
        assert torch.equal(a.data, b.data)
    for a, b in zip(opt.matrix_state, fresh.matrix_state):
        assert a.keys() == b.keys() == {"rails", "lane_energy", "mantissa"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The untimed warmup restores the state it saved before its steps (none yet): rails, lane energies and
    # mantissas start from zero again, as the record's reset() zeroes them.
    again = [torch.nn.Parameter(t.clone()) for t in start]
    warm = T.Anvil(again, lr=0.05, momentum=0.85, beta2=0.9, weight_decay=2.25, ns_dtype=torch.float32)
    initial = warm.state_dict()
    anvil_run(again, range(3), warm)
    for p, t in zip(again, start):
        p.data.copy_(t)
    warm.load_state_dict(initial)
    anvil_run(again, range(4), warm)
    for a, b in zip(straight, again):
        assert torch.equal(a.data, b.data)


def test_anvil_and_normuon_refuse_each_others_state():
    p = torch.nn.Parameter(torch.randn(8, 24))
    normuon = normuon_step(p, torch.randn(8, 24), lr=0.1)
    with pytest.raises(ValueError, match="matrix_optimizer"):
        T.Anvil([p]).load_state_dict(normuon.state_dict())
    anvil = anvil_run([p], range(1))
    with pytest.raises(ValueError, match="matrix_optimizer"):
        T.NorMuon([p]).load_state_dict(anvil.state_dict())


def test_the_memory_model_counts_anvils_second_rail():
    params = [torch.nn.Parameter(torch.zeros(3, 16, 40, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(48, 16))]
    for world_size in (1, 2):
        normuon, _ = T.normuon_bytes(T.NorMuon(params), world_size)
        anvil, _ = T.normuon_bytes(T.Anvil(params), world_size)
        assert anvil - normuon == 4 * (math.ceil(3 / world_size) * 16 * 40 + 48 * 16)  # one more fp32 rail a matrix


RECORD92 = T.parse_args(["--preset=speedrun", "--matrix_optimizer=anvil", "--num_iterations=1194"], True)


# Record #92's rail beta (get_rail_beta: 0.85 -> 0.93 over 240 steps, back over the last 50 of 1,194), the
# Nesterov lookahead at every step; the fast rail runs on it until step 514, then at 0.85 blended 0.4385 : 0.5615
# with the slow rail.
@pytest.mark.parametrize("step, momentum, fast_beta, blend", [
    (0, 0.85, 0.85, 1.0), (120, 0.89, 0.89, 1.0), (239, 0.85 + 0.08 * 239 / 240, 0.85 + 0.08 * 239 / 240, 1.0),
    (240, 0.93, 0.93, 1.0), (513, 0.93, 0.93, 1.0), (514, 0.93, 0.85, 0.4385), (1144, 0.93, 0.85, 0.4385),
    (1145, 0.93 - 0.08 / 50, 0.85, 0.4385), (1193, 0.93 - 0.08 * 49 / 50, 0.85, 0.4385)])
def test_anvil_rail_schedule(step, momentum, fast_beta, blend):
    schedule = T.Schedule(RECORD92)
    assert schedule.momentum(step) == pytest.approx(momentum, rel=1e-12)
    assert schedule.rails(step) == (pytest.approx(fast_beta, rel=1e-12), blend)
    # set_schedules hands them to the optimizer's groups
    opt = T.Anvil([torch.nn.Parameter(torch.zeros(4, 8))])
    opt.param_groups[0]["initial_lr"] = 0.023
    T.set_schedules(step, (opt,), schedule, RECORD92)
    group = opt.param_groups[0]
    assert (group["momentum"], group["fast_beta"], group["blend"]) == (schedule.momentum(step), *schedule.rails(step))

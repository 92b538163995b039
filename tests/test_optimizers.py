"""NorMuon and DistAdam: distributed runs (gloo, several processes) against single-process references,
and each part of NorMuon against its definition."""

import sys

import pytest
import torch
from torch.testing import assert_close

import train_gpt as T
from conftest import REPO, torchrun

sys.path.insert(0, str(REPO / "tests" / "workers"))
from muon_worker import run_normuon  # noqa: E402

WORKERS = REPO / "tests" / "workers"
NO_FUTURE_WARNINGS = {"PYTHONWARNINGS": "error::FutureWarning"}  # 2.13 deprecates the old collective names


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """tests/workers/gloo_worker.py under torchrun at world sizes 2 and 3: {world size: (stdout, NorMuon's
    final parameters)}. One launch per world size runs every check; a failed check fails the launch."""
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
        assert torch.equal(gloo_runs[world_size][1], single), world_size


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

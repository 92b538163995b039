"""Muon and DistAdam: distributed runs (gloo, several processes) against single-process references."""

import math

import pytest
import torch
from torch.testing import assert_close

import train_gpt as T
from conftest import REPO, torchrun

WORKERS = REPO / "tests" / "workers"
NO_FUTURE_WARNINGS = {"PYTHONWARNINGS": "error::FutureWarning"}  # 2.13 deprecates the old collective names


@pytest.mark.parametrize("world_size", [2, 3])
def test_dist_adam_matches_torch_adam(world_size):
    # The worker asserts reduced gradient shards, exp_avg/exp_avg_sq shards and parameters against
    # torch.optim.Adam on the mean gradient, one reduce-scatter per bucket launched during the last
    # backward and none under no_sync(), and identical parameters on every rank.
    proc = torchrun(WORKERS / "dist_adam_worker.py", world_size, extra_env=NO_FUTURE_WARNINGS)
    assert proc.stdout.count("DistAdam matched torch.optim.Adam") == world_size


def test_dist_adam_single_process_equals_torch_adam():
    torch.manual_seed(0)
    shapes = [(50, 3), (7,), (1,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = T.DistAdam(params, lr=0.01, betas=(0.8, 0.95), eps=1e-10, small_numel=16)
    ref = torch.optim.Adam(refs, lr=0.01, betas=(0.8, 0.95), eps=1e-10, foreach=False)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, r, g in zip(params, refs, grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, refs):
        assert_close(p.data, r.data)


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


def test_distributed_muon_equals_single_process(tmp_path):
    # Rank gradients average exactly to the single-process gradient (see the worker), so the
    # parameters after three steps must be bit-identical at world sizes 1, 2 and 3.
    results = {}
    for world_size in (1, 2, 3):
        out = tmp_path / f"muon_{world_size}.pt"
        torchrun(WORKERS / "muon_worker.py", world_size, out, extra_env=NO_FUTURE_WARNINGS)
        results[world_size] = torch.load(out, weights_only=True)
    assert torch.equal(results[1], results[2])
    assert torch.equal(results[1], results[3])
    assert not torch.equal(results[1], torch.zeros_like(results[1]))


def spread_matrix(rows, cols, decades, seed=0):
    """A matrix with singular values log-spaced over `decades` decades (a badly conditioned gradient)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    k = min(rows, cols)
    return u[:, :k] @ torch.diag(torch.logspace(0, -decades, k)) @ v[:k]


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 128)])
def test_orthogonalized_update_has_singular_values_near_one(shape):
    g = spread_matrix(*shape, decades=1)
    raw = torch.linalg.svdvals(g / g.norm())
    assert raw.max() / raw.min() > 9  # the input is far from orthogonal
    sv = torch.linalg.svdvals(T.orthogonalize(g).float())
    # The published quintic coefficients trade exactness for speed: values land in about [0.7, 1.2].
    assert sv.min() > 0.65 and sv.max() < 1.25, (sv.min().item(), sv.max().item())
    assert T.orthogonalize(g).shape == g.shape


def test_muon_update_scale_and_momentum():
    # One step from zero momentum with nesterov: update = orthogonalize(lerp(g, (1-m) g, m)) * scale.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(32, 8))
    g = torch.randn(32, 8)
    p.grad = g.clone()
    T.Muon([p], lr=0.1, momentum=0.9).step()
    expected = -0.1 * math.sqrt(32 / 8) * T.orthogonalize(g.lerp(0.1 * g, 0.9)).float()
    assert_close(p.data, expected)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        T.Muon([torch.nn.Parameter(torch.zeros(3))])

"""DistAdam against record #85's Adam, written out here independently in Python floats: bias-corrected
moments with eps added to the uncorrected sqrt(v) (torch.optim.Adam puts it elsewhere, which matters on
gradients near eps), then cautious weight decay lr^2 * wd * p where the update and the weight agree in sign."""

import math

import torch
from torch.testing import assert_close

import train_gpt as T

# An Adam setting of the record's table (the embeddings'); lr is arbitrary (the update is linear in it).
LR, BETA1, BETA2, EPS, WD = 0.01, 0.5, 0.95, 1e-10, 0.75
# Gradient magnitudes from far below eps to far above it, with both signs: near eps and below, where eps sits
# changes the update; above, it does not.
MAGNITUDES = [1e-12, -3e-12, 1e-11, -4e-11, 1e-10, -2e-10, 5e-10, -1e-9, 1e-8, -1e-3, 1.0]


def record_adam(p0: list[float], gradients: list[list[float]], wd: float = 0.0) -> list[list[float]]:
    """Record #85's _adam_update_step, element by element, from zero moments:
    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  u = m / (sqrt(v) + eps) * lr sqrt(1 - b2^t) / (1 - b1^t);
    u <- u + [u p > 0] lr^2 wd p;  p <- p - u. Returns the parameters after each step."""
    n = len(p0)
    m, v, p = [0.0] * n, [0.0] * n, list(p0)
    history = []
    for t, grads in enumerate(gradients, 1):
        for i, g in enumerate(grads):
            m[i] = BETA1 * m[i] + (1 - BETA1) * g
            v[i] = BETA2 * v[i] + (1 - BETA2) * g * g
            u = m[i] / (math.sqrt(v[i]) + EPS) * (LR * math.sqrt(1 - BETA2 ** t) / (1 - BETA1 ** t))
            if u * p[i] > 0:
                u += LR * LR * wd * p[i]
            p[i] -= u
        history.append(list(p))
    return history


def test_one_adam_step_on_tiny_gradients_is_the_records():
    grads = torch.tensor(MAGNITUDES, dtype=torch.float32)
    param = torch.nn.Parameter(torch.zeros(len(MAGNITUDES)))
    opt = T.DistAdam([param], lr=LR, betas=(BETA1, BETA2), eps=EPS)
    param.grad = grads.clone()
    opt.step()
    expected = torch.tensor(record_adam([0.0] * len(MAGNITUDES), [grads.tolist()])[0], dtype=torch.float32)
    # E.g. g = 1e-10: the record moves lr * sqrt(0.05) * g / (sqrt(0.05) * g + eps) = 0.18 lr, while
    # torch.optim.Adam's placement of eps moves lr * g / (g + eps) = 0.5 lr.
    assert_close(param.data, expected, rtol=1e-5, atol=0)


def test_several_adam_steps_with_cautious_weight_decay_are_the_records():
    # Gradients that change sign and size from step to step, weights of both signs: the decay applies where
    # the update agrees with the weight, and only there.
    rng = torch.Generator().manual_seed(0)
    scales = torch.tensor(MAGNITUDES).abs()
    p0 = (torch.randn(len(MAGNITUDES), generator=rng) * 50).tolist()  # large weights: the decay is visible
    steps = [(torch.randn(len(MAGNITUDES), generator=rng) * scales).tolist() for _ in range(4)]
    param = torch.nn.Parameter(torch.tensor(p0))
    opt = T.DistAdam([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    without = record_adam(p0, steps)
    for grads, expected, plain in zip(steps, record_adam(p0, steps, WD), without):
        param.grad = torch.tensor(grads, dtype=torch.float32)
        opt.step()
        assert_close(param.data, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-7)
    assert expected != plain  # the weight decay did something

"""Record #92's FP8 numerics (--mlp_full_fp8, --lm_head_fp8_logits) against independently written definitions: the
MLP's forward and backward in FP8 step by step from the record's kernel epilogues (every e4m3 and e5m2 byte it
emits), within FP8's error of the exact MLP; the delayed scales' rules over 20 steps; the state saved, per rank
where it is, and continued bit for bit; the head's copies, e4m3 logits, fp16 squashed logits and e5m2 gradient.

CPU torch._scaled_mm is a slow loop (25 ms a call even at these sizes), so most tests replace train_gpt's
scaled_mm by ExactScaledMM: the dequantised operands' fp32 product times both scales, rounded once (one test keeps
the real kernel)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import train_gpt as T
from conftest import SMOKE89  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DIM, HIDDEN, TOKENS = 32, 128, 48


class ExactScaledMM:
    """scaled_mm's stand-in: (a * scale_a) @ (b * scale_b) as an fp32 product of the dequantised operands times
    scale_a * scale_b, one rounding to out_dtype; it keeps each call's operands (the tensors the MLP emits)."""

    def __init__(self):
        self.calls, self.outputs = [], []

    def __call__(self, a, b, scale_a, scale_b, out_dtype, fast_accum=False):
        self.calls.append((a, b))
        self.outputs.append(product(a, b, scale_a, scale_b).to(out_dtype))
        return self.outputs[-1]


def product(a, b, scale_a, scale_b):
    scale = torch.as_tensor(scale_a, dtype=torch.float32) * torch.as_tensor(scale_b, dtype=torch.float32)
    return (a.float().contiguous() @ b.float().contiguous()) * scale


def full_mlp(seed=7, dtype=torch.bfloat16):
    """An MLP under record #92's FP8 (both flags' model: bf16 weights, fp32 scales), at its start."""
    g = torch.Generator().manual_seed(seed)
    mlp = T.MLP(DIM, HIDDEN, "fp8", scaled_down=True, full=True)
    with torch.no_grad():
        mlp.fc.copy_(torch.randn(HIDDEN, DIM, generator=g) * 0.1)
        mlp.proj.copy_(torch.randn(HIDDEN, DIM, generator=g) * 0.05)
    for p in mlp.parameters():
        p.data = p.data.to(dtype)
    mlp.refresh_fp8("exact")
    return mlp.train(), g


def q4(t):
    return t.float().clamp(-448, 448).to(E4)


def q5(t):
    return t.float().clamp(-57344, 57344).to(E5)


def bf(t):
    return t.bfloat16().float()


def record92_mlp(x, fc, proj, s, g):
    """Record #92's MLP in FP8 (FusedLinearReLUSquareFunction with linear_relu_square's epilogues), written out:
    e4m3 x at 2^-4; pre = the accumulator times x_s * w1_s, stored in bf16; post = relu(pre)^2 in bf16, divided by
    its scale (times the reciprocal), clipped, e4m3; the e5m2 gradient at 2^-6; dpre = 2 (g W2^T, times its dequant
    scale, in fp32) sqrt(post8 * s_post), rounded to bf16 once, then e5m2 at its scale; each weight w / s clipped to
    e4m3. Returns every emitted tensor and the outputs."""
    x8 = q4(x.float() * 16)
    fc8, proj8 = q4(fc.float() / s.fc_scale), q4(proj.float() / s.proj_scale)
    pre = bf(product(x8, fc8.T, 2 ** -4, s.fc_scale))
    post = bf(pre.clamp(min=0) ** 2)
    post8 = q4(post * (1 / s.post_scale))
    out = product(post8, proj8, s.post_scale, s.proj_scale).bfloat16()
    g8 = q5(g.float() * 64)
    dpre = bf(2 * product(g8, proj8.T, 2 ** -6, s.proj_scale) * (post8.float() * s.post_scale).sqrt())
    dpre8 = q5(dpre * (1 / s.dpre_scale))
    return dict(x8=x8, fc8=fc8, proj8=proj8, post=post, post8=post8, out=out, g8=g8, dpre=dpre, dpre8=dpre8,
                grad_proj=product(post8.T, g8, s.post_scale, 2 ** -6).bfloat16(),
                grad_fc=product(dpre8.T, x8, s.dpre_scale, 2 ** -4).bfloat16(),
                grad_x=product(dpre8, fc8, s.dpre_scale, s.fc_scale).bfloat16())


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def train_pass(mlp, x, g):
    """One forward and backward of the MLP; the (tokens, dim) and (tokens, hidden) tensors the forward kept."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = mlp(x)
    out.backward(g)
    return out, kept


def test_full_fp8_mlp_is_record_92s_quantised_forward_and_backward(monkeypatch):
    mm = ExactScaledMM()
    monkeypatch.setattr(T, "scaled_mm", mm)
    mlp, g = full_mlp()
    x = T.norm(torch.randn(TOKENS, DIM, generator=g)).bfloat16().requires_grad_()
    grad = (torch.randn(TOKENS, DIM, generator=g) * 0.02).bfloat16()
    train_pass(mlp, x, grad)
    mlp.refresh_fp8("exact")  # scales from this pass; then made smaller, so that some of relu^2's output and of
    with torch.no_grad():  # dpre clip, and the up-projection's largest weights past its delayed scale too
        for name, factor in (("post_scale", 0.6), ("dpre_scale", 0.5), ("fc_next", 0.8)):
            getattr(mlp, "fp8_" + name).mul_(factor)
    mlp.refresh_fp8("delayed")
    mm.calls.clear()
    x.grad = mlp.fc.grad = mlp.proj.grad = None
    s = mlp.fp8_state()
    out, kept = train_pass(mlp, x, grad)
    ref = record92_mlp(x.detach(), mlp.fc.detach(), mlp.proj.detach(), s, grad)
    # the copies in both layouts, and the forward keeps e4m3 x and post alone (one byte each)
    for ours, theirs in ((s.fc8, ref["fc8"]), (s.fc8_t, ref["fc8"].T), (s.proj8, ref["proj8"]),
                         (s.proj8_t, ref["proj8"].T)):
        assert same_bytes(ours, theirs)
    assert [(t.dtype, tuple(t.shape)) for t in kept] == [(E4, (TOKENS, DIM)), (E4, (TOKENS, HIDDEN))]
    assert same_bytes(kept[0], ref["x8"]) and same_bytes(kept[1], ref["post8"])
    # the backward's e5m2 operands: the gradient (dW2's, dpre's), dpre (dW1's transposed, dx's)
    operands = [a for a, _ in mm.calls]
    assert same_bytes(operands[2], ref["post8"].T) and same_bytes(mm.calls[2][1], ref["g8"])
    assert same_bytes(operands[3], ref["g8"])
    assert same_bytes(operands[4], ref["dpre8"].T) and same_bytes(operands[5], ref["dpre8"])
    assert torch.equal(out, ref["out"])
    for ours, name in ((x.grad, "grad_x"), (mlp.fc.grad, "grad_fc"), (mlp.proj.grad, "grad_proj")):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref[name]), name
    # each pass raised its maximum; the clips happened (448: relu^2's output, 57,344: dpre; weights at 448)
    assert mlp.fp8_post_amax == ref["post"].max() and mlp.fp8_dpre_amax == ref["dpre"].abs().max()
    assert (ref["post8"].float() == 448).any() and (ref["dpre8"].float().abs() == 57344).any()
    assert (ref["fc8"].float().abs() == 448).any() and (ref["dpre8"].float() != 0).float().mean() > 0.5


def test_full_fp8_mlp_is_within_fp8_error_of_the_exact_mlp_with_the_real_kernel(monkeypatch):
    # torch._scaled_mm itself, at the scales a first step set: every output within FP8's error of the fp32 MLP
    # (e4m3 keeps 3 mantissa bits, e5m2 2: 6-9% here), far from a wrong operand's 100%, and within its fp32
    # accumulation order's rounding (some bf16 and FP8 roundings fall the other way) of the stand-in's
    mlp, g = full_mlp()
    x = T.norm(torch.randn(TOKENS, DIM, generator=g)).bfloat16().requires_grad_()
    grad = (torch.randn(TOKENS, DIM, generator=g) * 0.02).bfloat16()
    train_pass(mlp, x, grad)
    mlp.refresh_fp8("exact")  # the scales of relu^2's output and dpre from this pass
    for p in (x, *mlp.parameters()):
        p.grad = None
    stand_in = copy.deepcopy(mlp)
    out, _ = train_pass(mlp, x, grad)
    real = [out, x.grad, mlp.fc.grad, mlp.proj.grad]
    x.grad = None
    x32, fc, proj = (t.detach().float().requires_grad_() for t in (x, mlp.fc, mlp.proj))
    ref = F.relu(x32 @ fc.T).square() @ proj
    ref.backward(grad.float())
    monkeypatch.setattr(T, "scaled_mm", ExactScaledMM())
    out, _ = train_pass(stand_in, x, grad)
    exact_mm = [out, x.grad, stand_in.fc.grad, stand_in.proj.grad]
    relative = lambda a, b: float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())
    exact = (ref, x32.grad, fc.grad, proj.grad)
    for ours, emulated, exact, bound in zip(real, exact_mm, exact, (0.1, 0.15, 0.15, 0.1)):
        assert 0.01 < relative(ours, exact) < bound and relative(ours, emulated) < 0.01


def test_full_fp8_scales_follow_record_92s_delayed_scaling_over_20_steps(monkeypatch):
    monkeypatch.setattr(T, "scaled_mm", ExactScaledMM())
    assert T.FULL_EXACT_REFRESHES == 16
    assert [T.full_scales(s) for s in (0, 14, 15, 19)] == ["exact"] * 2 + ["delayed"] * 2  # the start's is the 1st
    mlp, g = full_mlp()
    assert mlp.fp8_post_scale == 1.0 and mlp.fp8_dpre_scale == 2 ** -6  # the record's start
    # weights whose largest entries move both ways, past the 12% headroom at the delayed steps 16 and 17; inputs
    # and gradients that grow past relu^2's 3% and dpre's 25% headroom within steps 8, 12 and 17
    growth = [1.0, 0.9, 1.1, 1.05, 0.95, 1.2, 1.0, 0.8, 1.0, 1.3, 1.0, 1.0, 0.9, 1.1, 1.0, 1.0, 1.3, 1.25, 0.9, 1.0]
    loud = {8: 1.5, 12: 1.3, 17: 2.0}
    previous_amax, clipped = {}, {"post": set(), "dpre": set(), "fc": set(), "proj": set()}
    for step, k in enumerate(growth):
        expected = {name: getattr(mlp, f"fp8_{name}_scale").clone() for name in ("post", "dpre")}
        s = mlp.fp8_state()
        post_max = dpre_max = torch.zeros(())
        for micro in range(2 if step != 5 else 0):  # step 5: no pass on this rank: its scales stay
            x = (T.norm(torch.randn(TOKENS, DIM, generator=g)) * loud.get(step, 1.0) ** micro).bfloat16()
            grad = (torch.randn(TOKENS, DIM, generator=g) * 0.02 * loud.get(step, 1.0) ** micro).bfloat16()
            ref = record92_mlp(x, mlp.fc.detach(), mlp.proj.detach(), s, grad)
            out, _ = train_pass(mlp, x.requires_grad_(), grad)
            assert torch.equal(out, ref["out"]) and torch.equal(mlp.fc.grad, ref["grad_fc"]), (step, micro)
            mlp.proj.grad = mlp.fc.grad = None
            post_max = torch.maximum(post_max, ref["post"].max())
            dpre_max = torch.maximum(dpre_max, ref["dpre"].abs().max())
            clipped["post"] |= {step} if (ref["post8"].float() == 448).any() else set()
            clipped["dpre"] |= {step} if (ref["dpre8"].float().abs() == 57344).any() else set()
        if step != 5:  # 1.03 x the step's largest relu^2 output / 448; 1.25 x its largest |dpre| / 57,344
            expected["post"] = (post_max * torch.tensor(1.03 / 448)).clamp(min=1e-6)
            expected["dpre"] = (dpre_max * torch.tensor(1.25 / 57344)).clamp(min=1e-12)
        with torch.no_grad():
            for w in mlp.parameters():
                w.copy_(w.float() * k + 0.003 * torch.randn(w.shape, generator=g))
        mlp.refresh_fp8(T.full_scales(step))
        assert mlp.fp8_post_scale == expected["post"] and mlp.fp8_dpre_scale == expected["dpre"], step
        assert mlp.fp8_post_amax == 0 and mlp.fp8_dpre_amax == 0
        for name, w in (("fc", mlp.fc), ("proj", mlp.proj)):
            amax = w.detach().abs().max()
            if step + 1 < 16:  # exact: the weights' own maximum / 448, in their bf16
                used = (amax / 448).float()
            else:  # 1.12 x the previous refresh's maximum / 448, in fp32
                used = previous_amax[name] * torch.tensor(1.12 / 448)
            assert getattr(mlp, f"fp8_{name}_scale") == used, (step, name)
            copy8 = q4(w.detach().float() / used)
            assert same_bytes(getattr(mlp, f"fp8_{name}8"), copy8), (step, name)
            assert same_bytes(getattr(mlp, f"fp8_{name}8_t"), copy8.T), (step, name)
            clipped[name] |= {step} if (w.detach().float() / used).abs().max() > 448 * 1.01 else set()  # (not
            # by the bf16 rounding of an exact scale)
            previous_amax[name] = amax.float()
    # what clipped: the weights after their growth at the delayed steps alone; relu^2's output and dpre in the
    # louder passes (and in others too: a fresh batch's largest value often passes the last one's by 3%)
    assert clipped["fc"] == clipped["proj"] == {16, 17}, clipped
    assert clipped["post"] >= {8, 12, 17} and clipped["dpre"] >= {8, 12, 17}, clipped


def states_equal(a: T.Fp8Mlp, b: T.Fp8Mlp) -> bool:
    return all(same_bytes(x, y) if x.element_size() == 1 else torch.equal(x, y) for x, y in zip(a, b))


def test_full_fp8_state_is_saved_per_rank_where_it_is_and_continues_bit_for_bit(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "scaled_mm", ExactScaledMM())
    mlp, g = full_mlp()
    scales = {"fp8_" + name for name in T.FP8_MLP_SAVED}
    assert mlp.state_dict().keys() == {"fc", "proj", *scales}  # not #89's scales, not the copies or maxima

    def step(m, s, x, grad):
        train_pass(m, x.clone().requires_grad_(), grad)
        with torch.no_grad():
            for w in m.parameters():
                w -= 0.01 * w.grad.sign()
                w.grad = None
        m.refresh_fp8(T.full_scales(s))

    batches = [(T.norm(torch.randn(TOKENS, DIM, generator=g)).bfloat16(),
                (torch.randn(TOKENS, DIM, generator=g) * 0.02).bfloat16()) for _ in range(4)]
    for s in (13, 14, 15):  # the last exact refreshes, and the first delayed one
        step(mlp, s, *batches[s - 13])
    again = T.MLP(DIM, HIDDEN, "fp8", scaled_down=True, full=True).train()
    for p in again.parameters():
        p.data = p.data.bfloat16()
    again.load_state_dict(mlp.state_dict())
    again.refresh_fp8()  # "stored": the loaded scales, the maxima at 0
    assert states_equal(mlp.fp8_state(), again.fp8_state())
    for m in (mlp, again):
        step(m, 16, *batches[3])
    assert states_equal(mlp.fp8_state(), again.fp8_state())
    assert all(torch.equal(a, b) for a, b in zip(mlp.state_dict().values(), again.state_dict().values()))
    # a pass left its maxima behind (as the warmup's last steps, or any before a reload): "stored" starts them
    # over and moves no scale (the record's reset after its warmup)
    before = copy.deepcopy(mlp.fp8_state())
    train_pass(mlp, batches[0][0].clone().requires_grad_(), batches[0][1])
    assert mlp.fp8_post_amax > 0 and mlp.fp8_dpre_amax > 0
    mlp.refresh_fp8()
    assert states_equal(mlp.fp8_state(), before)
    # --init_from starts the six scales over; each rank keeps its own scales of relu^2's output and dpre
    assert all(T.init_run_state(f"blocks.3.mlp.{name}") for name in scales)
    assert not T.init_run_state("blocks.3.mlp.fc")
    args = T.parse_args([*SMOKE89, "--mlp_full_fp8=true"], False)
    model = T.GPT(args, T.Numerics(torch.float32, "fp32", "fp8"))
    own = T.rank_buffers(model)
    assert sorted(own) == sorted(f"blocks.{i}.mlp.fp8_{name}" for i in range(args.num_layers)
                                 for name in ("post_scale", "dpre_scale"))
    rank_1 = {name: torch.tensor(2.0 + i) for i, name in enumerate(own)}
    loader = type("Loader", (), {"load_state_dict": lambda self, state: None})()
    state = {"step": 4, "optimizers": [], "rank_buffers": rank_1, "cpu_rng": torch.get_rng_state()}
    meta = type("Meta", (), {"loader": {}, "step": 4, "train_time_ms": 1.0})()
    T.load_checkpoint(T.Resume(tmp_path, meta, copy.deepcopy(model.state_dict()), state), model, [], loader,
                      T.DistEnv(1, 1, 2, torch.device("cpu")))
    assert all(T.rank_buffers(model)[name] == value for name, value in rank_1.items())


def test_the_flags_off_keep_record_89s_mlp_and_head():
    # defaults: #89's state and copies, its head's scales; --mlp_full_fp8 takes --mlp_down_fp8's place
    args = T.parse_args(["--preset=record89"], False)
    assert not args.mlp_full_fp8 and not args.lm_head_fp8_logits and args.mlp_down_fp8
    mlp = T.MLP(DIM, 4 * DIM, "fp8", scaled_down=True)
    assert not mlp.full_fp8 and mlp.down_fp8 and not any(n.startswith("fp8_") for n, _ in mlp.named_buffers())
    full = T.MLP(DIM, 4 * DIM, "fp8", scaled_down=True, full=True)
    assert full.full_fp8 and not full.down_fp8 and not hasattr(full, "down_act_scale")
    assert T.head_fp8(torch.zeros(4, 16))[2] is T.HEAD_FP8_85 == (100 / 448, 1.6 / 448, 0.75 / 448, 85)
    model = T.GPT(T.parse_args([*SMOKE89], False), T.Numerics(torch.float32, "fp8", "fp32"))
    assert model.head_scales is T.HEAD_FP8_85
    # the memory model's loss chunk: e4m3 logits are one byte where bf16 ones are two (the rest as before)
    logits = T.parse_args(["--lm_head_fp8_logits=true"], False)
    assert T.loss_chunk_bytes(args, 8192, "cuda", "fp8") - T.loss_chunk_bytes(logits, 8192, "cuda", "fp8") == \
        8192 * T.padded_vocab(args.vocab_size)


# --- the head ----------------------------------------------------------------------------------------------------

def test_round_to_fp16_is_the_cast_down_and_back_up_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    spread = (torch.randn(1 << 16, generator=g) * torch.logspace(-12, 4.8, 1 << 16)).clamp(-65504, 65504)
    grid = torch.arange(-4096, 4096, dtype=torch.float32) * 2 ** -10  # fp16 ties at every binade near 1
    ties = (grid.view(torch.int32) | 0x1000).view(torch.float32)
    subnormal = torch.arange(-4096, 4096, dtype=torch.float32) * 2 ** -25  # fp16 subnormal ties
    near = torch.cat([(ties.view(torch.int32) + d).view(torch.float32) for d in (-1, 1)])
    special = torch.tensor([0.0, -0.0, 2 ** -14, 2 ** -14 - 2 ** -38, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 65504.0])
    x = torch.cat([spread, grid, ties, subnormal, near, special])
    assert torch.equal(T.round_to_fp16(x).view(torch.int32), x.half().float().view(torch.int32))


def record92_head(x, w, targets, weights, loss_scale, chunk):
    """Record #92's FP8 head, from its kernel (bf16 x and lm_head w): the lm_head's copy w * fp32(1 / (2/448)) in
    bf16, clipped, e4m3; the logits rounded to e4m3; sigmoid((u + 5) / 7.5) kept in fp16; the gradient of the
    logits at loss_scale * (0.75 / 8) / 448 in e5m2, then both matmuls (the logits a chunk of rows at a time)."""
    x8 = (x.float() / (100 / 448)).to(E4)
    w8 = (w.float() * float(torch.tensor(1.0) / torch.tensor(2.0 / 448))).bfloat16().float().clamp(-448, 448).to(E4)
    u = torch.cat([product(x8[lo:lo + chunk], w8, 100 / 448, 2.0 / 448).to(E4) for lo in range(0, len(x), chunk)])
    s = torch.sigmoid((u.float() + 5) / 7.5).half().float()
    z = 23 * s
    lse = torch.logsumexp(z, -1)
    rows = x.size(0)
    loss = sum(wk * (lse[:rows - k] - z[torch.arange(rows - k), targets[k:]]).sum() for k, wk in enumerate(weights))
    target_weights = torch.zeros_like(z)
    for k, wk in enumerate(weights.tolist()):
        target_weights[torch.arange(rows - k), targets[k:]] += wk
    g_u = loss_scale * (weights.sum() * torch.softmax(z, -1) - target_weights) * 23 / 7.5 * s * (1 - s)
    grad_s = loss_scale * 0.75 / 8 / 448
    g8 = (g_u / grad_s).to(E5)
    return dict(w8=w8, u=u, loss=loss * loss_scale, g8=g8, grad_x=product(g8, w8.T, grad_s, 2.0 / 448).bfloat16(),
                grad_w=product(x8.T, g8, 100 / 448, grad_s).bfloat16())


def test_record_92s_fp8_head_is_its_kernels_arithmetic(monkeypatch):
    mm = ExactScaledMM()
    monkeypatch.setattr(T, "scaled_mm", mm)
    assert T.HEAD_FP8_92 == (100 / 448, 2.0 / 448, 0.75 / 8 / 448, 92) and T.HEAD_FP8_92.w_reciprocal != 224
    g = torch.Generator().manual_seed(9)
    rows, dim, vocab, scale, chunk = 40, 64, 256, 0.25, 16
    x = T.norm(torch.randn(rows, dim, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(dim, vocab, generator=g) * 0.6).bfloat16().requires_grad_()  # some past 2.0: clipped
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[10] = targets[11] = targets[12]
    weights = torch.tensor([1.0, 0.5, 0.25])
    copies = T.head_fp8(w.detach(), T.HEAD_FP8_92)
    head = T.HeadLoss((23.0, 5.0, 7.5), chunk, copies, T.head_loss)
    loss = T.SoftcappedMTPLoss.apply(x, w, targets, weights, scale, head)
    loss.backward()
    ref = record92_head(x.detach(), w.detach(), targets, weights, scale, chunk)
    assert same_bytes(copies[0], ref["w8"]) and same_bytes(copies[1], ref["w8"].T)
    assert (ref["w8"].float().abs() == 448).any()
    logits = [out for (a, b), out in zip(mm.calls, mm.outputs) if out.dtype == E4]
    assert same_bytes(torch.cat(logits), ref["u"])  # three chunks, rounded to e4m3 by the matmul
    assert_close(loss, ref["loss"], rtol=1e-6, atol=0)
    g8 = mm.calls[-1][1]  # the lm_head gradient's second operand: every chunk's e5m2 logit gradient
    assert same_bytes(g8, ref["g8"]) and (ref["g8"].float() != 0).float().mean() > 0.9
    assert torch.equal(x.grad, ref["grad_x"]) and torch.equal(w.grad, ref["grad_w"])

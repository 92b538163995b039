"""Model pieces against independently written definitions (record #85's semantics): attention masks and
the two attention paths, one attention layer of each kind (plain, long window with the key offset, XSA,
gates, DC; paired heads) against a per-head reference, the bigram hash, the DC correction, the stream and
MUDD mixing, the multi-token loss and its gradient, the FP8 MLP and head, rotary, causality and document
isolation, the layer plan, initial values, parameter dtypes, config parsing."""


import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import train_gpt as T
from conftest import SMOKE89  # noqa: E402


def tokens_with_documents(length: int, bos_positions, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, T.BOS_ID, (length,), generator=g)
    tokens[list(bos_positions)] = T.BOS_ID
    return tokens


# --- masks and the two attention paths ---------------------------------------------------------

def test_dense_mask_is_causal_windowed_and_document_local():
    docs = T.document_ids(tokens_with_documents(12, [0, 5]))
    mask = T.dense_attention_mask(docs, window=3)
    for q in range(12):
        for k in range(12):
            same_doc = (q < 5) == (k < 5)
            # window 3 covers 4 keys: the query itself and the 3 before it (FlashAttention's (3, 0))
            assert mask[q, k] == (k <= q and q - k <= 3 and same_doc), (q, k)
    assert torch.equal(T.dense_attention_mask(docs, 3, num_queries=4), mask[-4:])


# (length, BOS positions, window): documents shorter than the window; a document boundary exactly
# on a block boundary (128, 256); one-token documents (300, and the last position); a window
# longer than the sequence; a window below one block; many short documents.
ATTENTION_CASES = [
    (512, [0, 100, 101, 300], 384),
    (512, [0, 128, 256, 257], 200),
    (384, [0, 300, 301, 383], 64),
    (256, [0], 1000),
    (512, list(range(0, 512, 37)), 129),
    (384, [0, 127, 128, 129], 127),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("length,bos,window", ATTENTION_CASES)
def test_flex_and_sdpa_paths_give_equal_outputs(length, bos, window):
    docs = T.document_ids(tokens_with_documents(length, bos))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, length, 32, generator=g) for _ in range(3))
    one = torch.ones(())
    dense = T.attention(q, k, v, T.dense_attention_mask(docs, window), one)
    flex = T.attention(q, k, v, T.flex_block_mask(docs, window, 128), one)
    assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    # the dense path itself, against attention written out
    scores = (q @ k.mT).masked_fill(~T.dense_attention_mask(docs, window), float("-inf"))
    assert_close(dense, scores.softmax(-1) @ v, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_marks_exactly_the_all_visible_blocks_as_full():
    # Full blocks skip mask_mod, so a block wrongly marked full would leak; one wrongly marked
    # partial only costs time. Check both against the dense mask, block by block.
    docs = T.document_ids(tokens_with_documents(1024, [0, 128, 300, 301, 700]))
    for window in (100, 256, 400, 2000):
        mask = T.flex_block_mask(docs, window, 128)
        dense = T.dense_attention_mask(docs, window).view(8, 128, 8, 128).transpose(1, 2)
        full = torch.zeros(8, 8, dtype=torch.bool)
        some = torch.zeros(8, 8, dtype=torch.bool)
        for q in range(8):
            full[q, mask.full_kv_indices[0, 0, q, :mask.full_kv_num_blocks[0, 0, q]].long()] = True
            some[q, mask.kv_indices[0, 0, q, :mask.kv_num_blocks[0, 0, q]].long()] = True
        assert torch.equal(full, dense.all(-1).all(-1)), window
        assert torch.equal(some | full, dense.any(-1).any(-1)), window
        assert not (some & full).any()


# --- the model --------------------------------------------------------------------------------

def small_args(**overrides):
    return T.parse_args([*SMOKE89, *(f"--{k}={v}" for k, v in overrides.items())], False)


def randomized_model(args, seed=0, scale=0.2, numerics=None):
    torch.manual_seed(seed)
    model = T.GPT(args, numerics)
    with torch.no_grad():  # zero-initialised parts would hide any leak: give every weight a value
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return model.eval()


def per_token_losses(model, args, tokens, windows=(1, 2), use_flex=False, separate_documents=False):
    inputs, targets = tokens[:-1], tokens[1:]
    masks = T.build_masks(inputs, model.plans, windows, args.window_block, use_flex)
    with torch.no_grad():
        return model.token_losses(inputs, targets, masks, separate_documents=separate_documents)


# --- independent definitions, written from the record's code, not from ours -----------------------

def int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2 ** 32 if v >= 2 ** 31 else v


def reference_bigram_hash(ids: list[int], buckets: int) -> list[int]:
    """The record's get_bigram_hash in Python ints: out[0] = mod is written before out[:-1] is read, so
    position 1 pairs with mod; products wrap around in int32; % is Python's (non-negative)."""
    mod = buckets - 1
    out = [mod]
    for t in range(1, len(ids)):
        previous = mod if t == 1 else ids[t - 1]
        out.append((int32(36313 * ids[t]) ^ int32(27191 * previous)) % mod)
    return out


def rope(x, positions, freq):
    """Turns adjacent pairs (x0, x1) of x (..., D) by angle position * freq[pair], with the record's bf16
    cos and sin tables."""
    theta = positions[:, None].double() * freq.double()[None, 0::2]
    cos, sin = theta.float().cos().bfloat16().float(), theta.float().sin().bfloat16().float()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * cos + x1 * sin, x1 * cos - x0 * sin], dim=-1).flatten(-2)


def reference_attention_layer(layer, plan, x, lambdas, aux_v, docs, freq, scale, window, dc_window,
                              xsa=None, gate=None, dc=None):
    """One attention layer of the record, head by head: QKV from the lambda-scaled weights, QK-norm,
    rotary; a paired layer puts head h of token t at position 2t + h // (H/2) in slot h % (H/2), rotated
    at 2t + h % 2 (the record's views), and attends over those positions with the window and doubled
    documents; a long-window layer shifts the stationary half of each key to the next token; then DC,
    XSA, the gate and the output projection."""
    T_, dim = x.shape
    H, D = layer.num_heads, layer.head_dim
    w = torch.cat([layer.qk.flatten(0, 1), layer.vo[0]])
    q, k, v = (lambdas[0] * (x @ w.T)).view(T_, 3, H, D).unbind(1)
    q, k = (F.rms_norm(t, (D,)) for t in (q, k))  # PyTorch's default eps, as the record's
    t_idx = torch.arange(T_)
    if aux_v is not None:
        v = v + aux_v.view(T_, H, D)
    out = torch.zeros(T_, H, D)
    if plan.paired:
        for h in range(H):
            q[:, h] = rope(q[:, h:h + 1], 2 * t_idx + h % 2, freq)[:, 0]
            k[:, h] = rope(k[:, h:h + 1], 2 * t_idx + h % 2, freq)[:, 0]
        pos = 2 * t_idx[:, None] + torch.arange(H)[None, :] // (H // 2)  # (T, H)
        for h in range(H):
            mates = [g for g in range(H) if g % (H // 2) == h % (H // 2)]
            keys = torch.cat([k[:, g] for g in mates]), torch.cat([v[:, g] for g in mates])
            key_pos = torch.cat([pos[:, g] for g in mates])
            key_doc = torch.cat([docs for _ in mates])
            d = pos[:, h][:, None] - key_pos[None, :]
            visible = (d >= 0) & (d <= window) & (docs[:, None] == key_doc[None, :])
            scores = (scale * q[:, h] @ keys[0].T).masked_fill(~visible, float("-inf"))
            out[:, h] = scores.softmax(-1) @ keys[1]
    else:
        q, k = rope(q, t_idx, freq), rope(k, t_idx, freq)
        if plan.long_window:
            k = torch.cat([k[:, :, :D // 2], torch.cat([k[:1, :, D // 2:], k[:-1, :, D // 2:]])], dim=-1)
        d = t_idx[:, None] - t_idx[None, :]
        visible = (d >= 0) & (d <= window) & (docs[:, None] == docs[None, :])
        probs = []
        for h in range(H):
            scores = (scale * q[:, h] @ k[:, h].T).masked_fill(~visible, float("-inf"))
            out[:, h] = scores.softmax(-1) @ v[:, h]
            probs.append(scores.masked_fill(d >= dc_window, float("-inf")).softmax(-1))
        if dc is not None:
            w1 = F.rms_norm(dc[0], (H,), eps=1e-6)
            mixed = sum(w1[:, h:h + 1] * probs[h] for h in range(H))
            for h in range(H):
                out[:, h] = out[:, h] + dc[1][:, h:h + 1] * (mixed @ v[:, h])
        if xsa is not None:
            direction = F.normalize(v, dim=-1, eps=1e-4)
            out = out - torch.tanh(xsa)[:, :, None] * (out * direction).sum(-1, keepdim=True) * direction
    if gate is not None:
        out = out * gate[:, :, None]
    return lambdas[1] * (out.reshape(T_, dim) @ layer.vo[1].T)


def layer_inputs(args, plan, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = randomized_model(args, seed)
    layer = model.blocks[plan.index].attn
    T_, H, dim = 192, model.num_heads, args.model_dim
    tokens = tokens_with_documents(T_, [0, 50, 51, 130], seed)
    x = T.norm(torch.randn(1, T_, dim, generator=g))
    lambdas = torch.tensor([0.7, 1.3])
    aux_v = torch.randn(1, T_, dim, generator=g) * 0.5
    per_head = lambda: torch.randn(1, T_, H, generator=g)
    return model, layer, tokens, x, lambdas, aux_v, per_head


@pytest.mark.parametrize("layer_index", [0, 1, 2, 5])  # paired; long+xsa+gate; xsa; long+gate+DC (smoke plan)
def test_each_kind_of_attention_layer_matches_the_records_definition(layer_index):
    args = small_args()
    plan = T.layer_plan(args)[layer_index]
    model, layer, tokens, x, lambdas, aux_v, per_head = layer_inputs(args, plan)
    model.rotary.set_window(4)  # YaRN once: frequencies and scale off their initial values
    windows = (2, 4)
    masks = T.build_masks(tokens, model.plans, windows, args.window_block, use_flex=False)
    xsa = per_head() if plan.xsa else None
    gate = per_head() if plan.attn_gate else None
    dc = (per_head(), per_head()) if plan.dc else None
    with torch.no_grad():
        inputs = T.LayerInputs(None, None, None, {}, {}, masks, model.rotary)  # what attention reads of it
        ours = layer(x, lambdas, T.AttentionExtras(aux_v, xsa, gate, dc), inputs)[0]
        window = args.window_block * windows[1 if plan.long_window else 0]
        ref = reference_attention_layer(layer, plan, x[0], lambdas, aux_v[0], T.document_ids(tokens),
                                        model.rotary.angular_freq, model.rotary.scale, window, args.dc_window,
                                        None if xsa is None else xsa[0], None if gate is None else gate[0],
                                        None if dc is None else (dc[0][0], dc[1][0]))
    assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_the_smoke_plan_has_every_kind_of_layer():
    plans = T.layer_plan(small_args())
    assert plans[0].paired and plans[1].long_window and plans[1].xsa and plans[1].attn_gate
    assert plans[5].dc and plans[5].long_window and plans[5].attn_gate and plans[5].mudd
    assert plans[3].skip_target and not plans[3].attention


def test_bigram_hash_follows_the_records_int32_arithmetic():
    rng = np.random.default_rng(0)
    ids = [int(v) for v in rng.integers(0, 50304, 300)] + [50303, 50255, 0, 1]
    for buckets in (377_280, 20_000):
        t = torch.tensor(ids)
        ours = T.bigram_hash(t, torch.cat([t[:1], t[:-1]]), torch.arange(len(ids)), buckets)
        assert ours.tolist() == reference_bigram_hash(ids, buckets)
    # the wrap-around is real: position 1's product with the modulus overflows int32
    assert 27191 * 377_279 > 2 ** 31


def dense_dc(q, k, v, docs, w1, w2, scale, window):
    T_, H, D = q.shape
    w1 = F.rms_norm(w1, (H,), eps=1e-6)
    out = torch.zeros_like(v)
    for t in range(T_):
        keys = [s for s in range(max(0, t - window + 1), t + 1) if docs[s] == docs[t]]
        mixed = torch.zeros(len(keys))
        for h in range(H):
            mixed += w1[t, h] * torch.softmax(torch.stack([scale * q[t, h] @ k[s, h] for s in keys]), 0)
        for h in range(H):
            out[t, h] = w2[t, h] * sum(m * v[s, h] for m, s in zip(mixed, keys))
    return out


def test_dc_correction_matches_its_definition_query_by_query():
    g = torch.Generator().manual_seed(3)
    T_, H, D, block, window = 96, 4, 8, 32, 20
    q, k, v = (torch.randn(1, T_, H, D, generator=g) for _ in range(3))
    w1, w2 = (torch.randn(1, T_, H, generator=g) for _ in range(2))
    docs = T.document_ids(tokens_with_documents(T_, [0, 31, 32, 70]))
    scale = torch.tensor(0.3)
    ours = T.dc_correction(q, k, v, T.dc_visible(docs, window, block), (F.rms_norm(w1, (H,), eps=1e-6), w2), scale)
    assert_close(ours[0], dense_dc(q[0], k[0], v[0], docs, w1[0], w2[0], 0.3, window), rtol=1e-5, atol=1e-6)


def reference_mtp_loss(u, targets, weights, cap=(23.0, 5.0, 7.5)):
    A, shift, width = cap
    z = A * torch.sigmoid((u + shift) / width)
    lse = torch.logsumexp(z, -1)
    total = 0
    for k, w in enumerate(weights):
        rows = torch.arange(len(targets) - k)
        total = total + w * (lse[rows] - z[rows, targets[k:]]).sum()
    return total


@pytest.mark.parametrize("chunk", [5, 1000])
def test_multi_token_loss_and_its_gradient_are_the_records(chunk):
    g = torch.Generator().manual_seed(4)
    T_, D, V = 23, 16, 40
    x = torch.randn(T_, D, generator=g, requires_grad=True)
    w = (torch.randn(D, V, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (T_,), generator=g)
    targets[5] = targets[6] = targets[7]  # repeated targets: one column gets several weights
    weights = torch.tensor([1.0, 0.5, 0.2])
    loss = T.SoftcappedMTPLoss.apply(x, w, targets, weights, 0.25, T.HeadLoss((23.0, 5.0, 7.5), chunk, None, T.head_loss))
    (loss * 3).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = reference_mtp_loss(xr @ wr, targets, weights.tolist())
    assert_close(loss, 0.25 * ref)
    # Rows whose every offset has a target: the gradient of the loss above. The last two rows (targets beyond
    # the sequence for k = 1, 2): the record's kernel keeps all the weights (1.7) in the softmax term.
    u = (xr @ wr).detach().requires_grad_()
    reference_mtp_loss(u, targets, weights.tolist()).backward()
    z_grad = u.grad.clone()
    s = torch.sigmoid((u.detach() + 5) / 7.5)
    p = torch.softmax(23 * s, -1)
    for row, valid in ((T_ - 2, 0.5 + 1.0), (T_ - 1, 1.0)):
        z_grad[row] += (1.7 - valid) * p[row] * 23 / 7.5 * s[row] * (1 - s[row])
    assert_close(x.grad, 3 * 0.25 * z_grad @ wr.detach().T, rtol=1e-5, atol=1e-6)
    assert_close(w.grad, 3 * 0.25 * xr.detach().T @ z_grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(z_grad, u.grad)  # the quirk changes the last rows


def prefix_loss_case(seed=8):
    """A loss head's inputs with the prefix term's cases: rows without a prefix target, a prefix target equal to
    the row's offset-1 and offset-2 targets (their weights add up), and the last rows without some offsets."""
    g = torch.Generator().manual_seed(seed)
    T_, D, V = 40, 64, 64
    x = T.norm(torch.randn(T_, D, generator=g))
    w = torch.randn(D, V, generator=g) * 0.05
    targets = torch.randint(0, V, (T_,), generator=g)
    prefix = torch.randint(0, V, (T_,), generator=g)
    prefix[::5] = -1
    prefix[3], prefix[8] = targets[4], targets[10]
    targets[12] = targets[13] = prefix[11] = 7
    prefix[T_ - 1] = 9  # the last row has a prefix target and only its offset-0 target
    return x, w, targets, prefix, torch.tensor([1.0, 0.5, 0.25]), 0.3


def prefix_logit_gradient(u_s, targets, prefix, weights, pw, scale):
    """Record #88's kernel: dL/du = scale (S_w softmax(z) - every weight whose target is the column) dz/du, where
    S_w = the sum of every offset's weight, plus pw on rows that have a prefix target."""
    T_, V = u_s.shape
    p = torch.softmax(23 * u_s, -1)
    has_prefix = (prefix >= 0).float()
    target_weights = torch.zeros(T_, V)
    for k, wk in enumerate(weights.tolist()):
        target_weights[torch.arange(T_ - k), targets[k:]] += wk
    rows = torch.nonzero(prefix >= 0)[:, 0]
    target_weights[rows, prefix[rows]] += pw
    weight_sum = weights.sum() + pw * has_prefix[:, None]
    return scale * (weight_sum * p - target_weights) * 23 / 7.5 * u_s * (1 - u_s)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefix_token_loss_and_its_gradient_are_record_88s(fp8):
    x, w, targets, prefix, weights, pw = prefix_loss_case()
    T_, scale = len(targets), 0.25
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    head = T.HeadLoss((23.0, 5.0, 7.5), 16, T.head_fp8(w.detach()) if fp8 else None, T.head_loss)
    loss = T.SoftcappedMTPLoss.apply(x, w, targets, weights, scale, head, (prefix, torch.tensor([pw])))
    loss.backward()
    if fp8:  # the FP8 head's operands, logits and bf16 squashed logits (test_fp8_head_matches...)
        x_used = (x.detach() / (100 / 448)).to(torch.float8_e4m3fn).float() * (100 / 448)
        w_used = (w.detach() / (1.6 / 448)).to(torch.float8_e4m3fn).float() * (1.6 / 448)
        s = torch.sigmoid(((x_used @ w_used).bfloat16().float() + 5) / 7.5).bfloat16().float()
    else:
        x_used, w_used = x.detach(), w.detach()
        s = torch.sigmoid((x_used @ w_used + 5) / 7.5)
    z = 23 * s
    lse = torch.logsumexp(z, -1)
    ref = sum(wk * (lse[:T_ - k] - z[torch.arange(T_ - k), targets[k:]]).sum() for k, wk in enumerate(weights.tolist()))
    rows = torch.nonzero(prefix >= 0)[:, 0]
    ref = ref + pw * (lse[rows] - z[rows, prefix[rows]]).sum()
    assert_close(loss, scale * ref, rtol=1e-5, atol=1e-4)
    g_u = prefix_logit_gradient(s, targets, prefix, weights, pw, scale)
    if fp8:  # the gradient in e5m2 at its scale, then both FP8 matmuls
        grad_s = scale * 0.75 / 448
        g_u = (g_u / grad_s).to(torch.float8_e5m2).float() * grad_s
        # e5m2 keeps 2 mantissa bits: an element on a rounding boundary may round the other way
        tol = dict(rtol=0.05, atol=0.05 * (g_u @ w_used.T).abs().max().item())
    else:
        tol = dict(rtol=1e-5, atol=1e-6)
    assert_close(x.grad, g_u @ w_used.T, **tol)
    assert_close(w.grad, x_used.T @ g_u, **tol)


def test_a_zero_prefix_weight_changes_no_gradient():
    # the prefix column with weight 0 adds 0 to S_w and takes 0 from its column: the gradients are the loss's
    # without it, bit for bit (the loss itself sums one more zero, in another order)
    x, w, targets, prefix, weights, _ = prefix_loss_case(9)
    with_zero = T.head_loss(x, w, targets, weights, (23.0, 5.0, 7.5), 0.5, 16, None, (prefix, torch.tensor([0.0])))
    without = T.head_loss(x, w, targets, weights, (23.0, 5.0, 7.5), 0.5, 16)
    assert torch.equal(with_zero[1], without[1]) and torch.equal(with_zero[2], without[2])
    assert_close(with_zero[0], without[0], rtol=1e-6, atol=0)


def test_prefix_table_holds_each_tokens_longest_proper_prefix_that_is_a_token():
    import base64
    ranks = {base64.b64decode(token): int(rank) for token, rank in
             (line.split() for line in (T.REPO_DIR / "data" / "gpt2.tiktoken").read_text().splitlines())}
    pieces = {i: b for b, i in ranks.items()}
    table = T.prefix_token_table(50304)
    assert table.shape == (50304,) and table.dtype == torch.int64
    assert (table == -1).sum() == 256 + 1 + 47 and (table[50256:] == -1).all()  # single bytes, <|endoftext|>, pads
    assert (table[464], table[262], table[318]) == (817, 294, 1312)  # 'The' -> 'Th', ' the' -> ' th', ' is' -> ' i'
    for i, piece in pieces.items():
        if len(piece) == 1:
            assert table[i] == -1
            continue
        prefix = pieces[int(table[i])]
        assert len(prefix) < len(piece) and piece.startswith(prefix), i
        assert not any(piece[:end] in ranks for end in range(len(prefix) + 1, len(piece))), i  # none longer
    # a vocabulary cut below GPT-2's (small test runs) keeps the prefixes it has
    small = T.prefix_token_table(280)
    assert small.shape == (280,) and (small < 280).all()
    assert small[262] == ranks[b" t"]  # ' the' -> ' t': ' th' (294) is cut
    assert all(small[i] == table[i] for i in range(280) if table[i] < 280)


def test_prefix_weights_follow_their_stage_schedule():
    args = T.parse_args(["--num_iterations=33", "--extension_steps=3", "--stage_prefix_weights=0.25,0.25>0,0"], False)
    schedule = T.Schedule(args)
    assert [(s.start, s.end) for s in schedule.stages] == [(0, 10), (10, 20), (20, 30), (30, 33)]
    assert [schedule.prefix_weight(step) for step in (0, 9, 10, 15, 19)] == pytest.approx([0.25, 0.25, 0.25, 0.125, 0.025])
    assert all(schedule.prefix_weight(step) is None for step in (20, 29, 30, 33))  # no prefix column at all
    assert schedule.prefix_term and not T.Schedule(T.parse_args(["--preset=record85"], True)).prefix_term
    for flags, message in ((["--stage_prefix_weights=0.25,0"], "must list one value per stage"),
                           (["--stage_prefix_weights=0.1>0.2>0.3,0,0"], "stage 1 .* has more than one '>'"),
                           (["--stage_prefix_weights=-1,0,0"], "expected finite numbers >= 0")):
        with pytest.raises(T.ConfigError, match=message):
            T.Schedule(T.parse_args([*SMOKE89, *flags], False))


def test_fp8_head_matches_its_quantised_definition():
    g = torch.Generator().manual_seed(5)
    T_, D, V = 32, 64, 128
    x = T.norm(torch.randn(T_, D, generator=g))
    w = torch.randn(D, V, generator=g) * 0.01
    targets = torch.randint(0, V, (T_,), generator=g)
    weights = torch.tensor([1.0, 0.5])
    loss = T.SoftcappedMTPLoss.apply(x, w, targets, weights, 1.0, T.HeadLoss((23.0, 5.0, 7.5), 16, T.head_fp8(w), T.head_loss))
    x8 = (x / (100 / 448)).to(torch.float8_e4m3fn).float() * (100 / 448)
    w8 = (w / (1.6 / 448)).to(torch.float8_e4m3fn).float() * (1.6 / 448)
    u = (x8 @ w8).bfloat16().float()
    s = torch.sigmoid((u + 5) / 7.5).bfloat16().float()  # the kernel keeps the squashed logits in bf16
    z = 23 * s
    lse = torch.logsumexp(z, -1)
    ref = sum(wk * (lse[:T_ - k] - z[torch.arange(T_ - k), targets[k:]]).sum() for k, wk in enumerate([1.0, 0.5]))
    assert_close(loss, ref, rtol=1e-5, atol=1e-4)


def test_fp8_head_gradients_are_the_e5m2_gradient_times_the_e4m3_operands():
    # The logits' gradient (the record's kernel's, from the bf16-rounded squashed logits), divided by
    # g_s = loss_scale * 0.75/448 and rounded to e5m2, then both FP8 matmuls: grad_x = g8 W8^T and the
    # lm_head's grad_w = x8^T g8, the latter one matmul over every chunk's rows (several chunks here, a repeated
    # target, and the last rows' missing targets).
    g = torch.Generator().manual_seed(7)
    T_, D, V, scale = 40, 64, 256, 0.25
    x = T.norm(torch.randn(T_, D, generator=g)).requires_grad_()
    w = (torch.randn(D, V, generator=g) * 0.01).requires_grad_()
    targets = torch.randint(0, V, (T_,), generator=g)
    targets[10] = targets[11] = targets[12]
    weights = torch.tensor([1.0, 0.5, 0.25])
    head = T.HeadLoss((23.0, 5.0, 7.5), 16, T.head_fp8(w.detach()), T.head_loss)
    T.SoftcappedMTPLoss.apply(x, w, targets, weights, scale, head).backward()
    x8 = (x.detach() / (100 / 448)).to(torch.float8_e4m3fn).float() * (100 / 448)
    w8 = (w.detach() / (1.6 / 448)).to(torch.float8_e4m3fn).float() * (1.6 / 448)
    u = (x8 @ w8).bfloat16().float()
    s = torch.sigmoid((u + 5) / 7.5).bfloat16().float()
    p = torch.softmax(23 * s, -1)
    target_weights = torch.zeros(T_, V)
    for k, wk in enumerate(weights.tolist()):
        target_weights[torch.arange(T_ - k), targets[k:]] += wk
    g_u = scale * (weights.sum() * p - target_weights) * 23 / 7.5 * s * (1 - s)
    grad_s = scale * 0.75 / 448
    g8 = (g_u / grad_s).to(torch.float8_e5m2).float() * grad_s
    assert_close(x.grad, (g8 @ w8.T).to(x.dtype), rtol=1e-5, atol=1e-6)
    assert_close(w.grad, x8.T @ g8, rtol=1e-5, atol=1e-6)
    assert (g8 != 0).float().mean() > 0.9  # a gradient, not mostly zeros that would pass any comparison


def test_block_masks_query_side_is_what_flex_attention_derives_from_the_key_side():
    # block_mask_parts computes the query side (which the backward reads) itself, in the same call; PyTorch's
    # BlockMask.from_kv_blocks derives it from the key side: they must agree, for every kind of layer.
    from torch.nn.attention.flex_attention import BlockMask
    args = T.parse_args(["--preset=record89"], True)
    tokens = tokens_with_documents(2048, [0, 100, 101, 700, 1500, 1501], seed=3)
    masks = T.build_masks(tokens, T.layer_plan(args), (3, 7), 128, use_flex=True)
    assert len(masks.by_kind) == 3
    for kind, mask in masks.by_kind.items():
        derived = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                           mask.full_kv_indices, BLOCK_SIZE=128, mask_mod=mask.mask_mod,
                                           seq_lengths=mask.seq_lengths)
        for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(mask, name), getattr(derived, name)), (kind, name)
        assert mask.full_q_num_blocks.sum() > 0 and mask.q_num_blocks.sum() > 0, kind  # both kinds of block


def test_block_masks_are_create_block_mask_s_for_their_mask_mod():
    # block_mask_parts orders each row's key blocks by counting, not by the stable argsort create_block_mask
    # uses (inductor's Triton sort took 475 s to compile for stage 1's masks): every index tensor must still be
    # PyTorch's own, the hidden blocks' order included, for documents that start on and off block boundaries.
    from torch.nn.attention.flex_attention import create_block_mask
    args = T.parse_args(["--preset=record89"], True)
    tokens = tokens_with_documents(2048, [0, 100, 101, 256, 700, 1500, 1501], seed=4)
    for windows in ((1, 3), (3, 7), (16, 16)):
        masks = T.build_masks(tokens, T.layer_plan(args), windows, 128, use_flex=True)
        for kind, mask in masks.by_kind.items():
            n = mask.seq_lengths[0]
            reference = create_block_mask(mask.mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=128)
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                         "q_indices", "full_q_num_blocks", "full_q_indices"):
                assert torch.equal(getattr(mask, name), getattr(reference, name)), (windows, kind, name)


def records_xsa(y, v, alpha):
    """Record #85's XSA, as its source writes it (F.normalize's unit vector of v)."""
    vn = F.normalize(v, dim=-1, eps=1e-4)
    proj = (y * vn).sum(-1, keepdim=True)
    return y - torch.tanh(alpha)[..., None] * proj * vn


def xsa_inputs(dtype):
    g = torch.Generator().manual_seed(11)
    y, v = torch.randn(2, 64, 3, 16, generator=g, dtype=dtype), torch.randn(2, 64, 3, 16, generator=g, dtype=dtype)
    # values whose norm is below the eps (the clamp decides), between eps^2 and eps (a clamp of |v| at eps^2, not
    # |v|^2, would differ there), and zero
    v[0, :8] *= 1e-6
    v[0, 8:16] *= 3e-5
    v[1, :4] = 0
    alpha = torch.randn(2, 64, 3, generator=g, dtype=dtype)
    return y, v, alpha


def test_xsa_is_the_records_normalized_projection_written_as_record_86():
    # in fp64 the two forms are the same function: values and every gradient agree to rounding
    y, v, alpha = (t.requires_grad_() for t in xsa_inputs(torch.float64))
    ours = y - torch.tanh(alpha)[..., None] * T.along(y, v)
    ref = records_xsa(y, v, alpha)
    assert_close(ours, ref, rtol=1e-12, atol=1e-14)
    grads = torch.autograd.grad(ours, (y, v, alpha), torch.ones_like(ours))
    ref_grads = torch.autograd.grad(ref, (y, v, alpha), torch.ones_like(ref))
    for name, a, b in zip("y v alpha".split(), grads, ref_grads):
        assert_close(a, b, rtol=1e-10, atol=1e-10 * b.abs().max().item(), msg=name)
    # in fp32, a few roundings apart
    y32, v32, a32 = (t.detach().float() for t in (y, v, alpha))
    assert_close(y32 - torch.tanh(a32)[..., None] * T.along(y32, v32), records_xsa(y32, v32, a32),
                 rtol=1e-5, atol=1e-6)


def test_relu_square_keeps_only_its_output_and_its_gradient_is_autograds_bit_for_bit():
    g = torch.Generator().manual_seed(12)
    values = torch.cat([torch.randn(4096, generator=g) * torch.logspace(-15, 15, 4096),
                        torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e18, 2.0 ** -60])])
    for dtype in (torch.float32, torch.bfloat16):
        h = values.to(dtype).clone().requires_grad_()
        grad = torch.randn(values.shape, generator=g).to(dtype)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = T.ReluSquare.apply(h)
        assert len(saved) == 1 and saved[0] is out, "relu^2 keeps more than its output"
        out.backward(grad)
        h_ref = values.to(dtype).clone().requires_grad_()
        ref = F.relu(h_ref).square()
        ref.backward(grad)
        assert torch.equal(out, ref) and torch.equal(h.grad, h_ref.grad), dtype


def test_fp8_mlp_matches_its_quantised_definition_and_backward_is_bf16():
    g = torch.Generator().manual_seed(6)
    mlp = T.MLP(64, 4 * 64, "fp8")
    with torch.no_grad():
        mlp.fc.copy_(torch.randn(256, 64, generator=g) * 0.05)
        mlp.proj.copy_(torch.randn(256, 64, generator=g) * 0.05)
    mlp.bfloat16()
    mlp.refresh_fp8()
    x = T.norm(torch.randn(48, 64, generator=g)).bfloat16().requires_grad_()
    out = mlp.train()(x)
    amax = x.detach().abs().max()  # the record scales x in bf16 (test_fp8_copies_are_the_records_bf16_arithmetic...)
    x8 = (x.detach() * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax.float() / 448)
    w_scale = mlp.fc.abs().max() / 448  # the record divides in the weights' dtype (bf16), then quantises
    w8 = (mlp.fc / w_scale).to(torch.float8_e4m3fn).float() * w_scale.float()
    pre = (x8 @ w8.T).bfloat16()
    assert_close(out.float(), (F.relu(pre).square() @ mlp.proj).float(), rtol=2 ** -7, atol=1e-4)
    grad = torch.randn_like(out)
    hidden = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: hidden.append(t.shape[-1] == 256) or t, lambda t: t):
        out = mlp.train()(x)
    assert sum(hidden) == 1, "the FP8 MLP keeps more than relu^2's output of its (tokens, hidden) tensors"
    out.backward(grad)
    grad_pre = 2 * F.relu(pre) * (grad @ mlp.proj.T)
    # bf16 sums in another order: the differences are bf16 roundings of the largest terms, whatever an entry's size
    for ours, ref in ((mlp.fc.grad, grad_pre.T @ x.detach()), (x.grad, grad_pre @ mlp.fc)):
        assert_close(ours.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6 * ref.float().abs().max().item())
    assert mlp.fc.grad.dtype == torch.bfloat16


def fp8_copies_of(w, x):
    return T.mlp_fp8(w), T.fp8_activation(x)


def check_fp8_copies_against_the_records_bf16_arithmetic(copies, draws=4):
    # The record quantises in bf16, eagerly: the weight's scale max / 448 and the quotient w / scale rounded to bf16
    # (up-projection; the down-projection's exact scale likewise), the activation's factor `448.0 / max` (PyTorch:
    # a reciprocal, then a product, each rounded) and the product.
    g = torch.Generator().manual_seed(3)
    for i in range(draws):
        w = (torch.randn(256, 64, generator=g) * (0.01 + 0.05 * torch.rand((), generator=g))).bfloat16()
        x = (torch.randn(128, 64, generator=g) * (1 + 5 * torch.rand((), generator=g))).bfloat16()
        w_scale = w.abs().amax().clamp(min=1e-12) / 448
        w8 = (w / w_scale).to(torch.float8_e4m3fn)
        x_max = x.abs().max().clamp(min=1e-12)
        x8 = (x * (448.0 / x_max)).to(torch.float8_e4m3fn)
        (ours_w8, ours_w_scale), (ours_x8, ours_x_scale) = copies(w, x)
        assert torch.equal(ours_w8.view(torch.uint8), w8.view(torch.uint8)) and ours_w_scale == w_scale.float()
        assert torch.equal(ours_x8.view(torch.uint8), x8.view(torch.uint8)) and ours_x_scale == x_max.float() / 448
        assert T.mlp_down_fp8(w, torch.ones(()), torch.ones(()), "exact")[1] == w_scale.float()


def test_fp8_copies_are_the_records_bf16_arithmetic():
    # Compiled, the same holds as long as inductor keeps round_to_bf16 (test_inductor_keeps_the_bf16_rounding_...):
    # without it, 14 of 20 up-projection scales of 3072 x 768 weights differed from the record's, and 3% of their
    # e4m3 bytes (measured once with torch.compile(mlp_fp8, backend="inductor"); 33 s of compile, not in the suite).
    check_fp8_copies_against_the_records_bf16_arithmetic(fp8_copies_of)


# --- record #89's FP8 down-projection and its delayed scales ---------------------------------------------------

def fp8_down_mlp(seed=7, dim=64):
    """An MLP with both projections' forwards in FP8 (record #89), its weights in bf16 and its scales in fp32 (as
    cast_parameters leaves them), at the scales of its start."""
    g = torch.Generator().manual_seed(seed)
    mlp = T.MLP(dim, 4 * dim, "fp8", scaled_down=True)
    with torch.no_grad():
        mlp.fc.copy_(torch.randn(4 * dim, dim, generator=g) * 0.05)
        mlp.proj.copy_(torch.randn(4 * dim, dim, generator=g) * 0.05)
    for p in mlp.parameters():
        p.data = p.data.bfloat16()
    mlp.refresh_fp8("exact")
    return mlp.train(), g


def e4m3(t):
    return t.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def hidden_saved(mlp, x):
    """mlp(x), and the (tokens, hidden) tensors its forward keeps for the backward."""
    kept = []
    hook = lambda t: kept.append(t) or t
    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        out = mlp(x)
    return out, [t for t in kept if t.dim() == 2 and t.shape[-1] == mlp.fc.shape[0]]


def test_fp8_down_projection_is_record_89s_quantised_matmul_and_its_backward_is_bf16s():
    mlp, g = fp8_down_mlp()
    up_only = copy.deepcopy(mlp)
    up_only.down_fp8 = False  # the same FP8 up-projection, the down-projection in bf16
    w_scale = (mlp.proj.abs().max() / 448).float()  # the record's exact scale: divided in the weights' bf16
    assert mlp.down_weight_scale == w_scale and mlp.down_act_scale == 1.0  # no activation's maximum yet
    assert mlp.down_weight_next_scale == mlp.proj.abs().max().float() * (1.12 / 448)
    assert mlp.state_dict().keys() == {"fc", "proj", "down_act_scale", "down_weight_scale", "down_weight_next_scale"}
    for clip in (False, True):  # the start's 1.0 (nothing clips), then an eighth of the set scale: the largest clip
        x = T.norm(torch.randn(48, 64, generator=g)).bfloat16().requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        if clip:
            mlp.down_act_scale.div_(8)
        scale = mlp.down_act_scale.clone()
        out, saved = hidden_saved(mlp, x)
        ref, saved_ref = hidden_saved(up_only, x_ref)
        assert len(saved) == 1 and torch.equal(saved[0], saved_ref[0]), "the FP8 forward keeps more, or another post"
        post = saved[0].float()  # relu^2's bf16 output, the same in both
        clipped = int((post / scale > 448).sum())
        assert (clipped > 0) == clip, clipped
        expected = (e4m3((post / scale).clamp(max=448)) @ e4m3(mlp.proj.float() / w_scale)) * scale * w_scale
        assert_close(out.float(), expected.bfloat16().float(), rtol=2 ** -7, atol=1e-5)
        assert mlp.down_act_scale == post.max() * (1.8 / 448)  # the next forward's
        assert not torch.equal(out, ref)  # FP8 rounding: a check that the FP8 path ran
        grad = torch.randn(out.shape, generator=g).bfloat16()
        out.backward(grad)
        ref.backward(grad)
        assert torch.equal(x.grad, x_ref.grad), "the backward is not the bf16 one"
    for p, p_ref in zip(mlp.parameters(), up_only.parameters()):
        assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, p_ref.grad)
    before = mlp.down_act_scale.clone()
    assert torch.equal(mlp.eval()(x), up_only.eval()(x)) and mlp.down_act_scale == before  # evaluation: no FP8


def test_fp8_down_scales_follow_record_89s_delayed_scaling_over_20_steps():
    mlp, g = fp8_down_mlp()
    assert T.DOWN_EXACT_STEPS == 16 and [T.down_scales(s) for s in (0, 15, 16, 19)] == ["exact"] * 2 + ["delayed"] * 2
    # 20 steps of weights whose largest entry moves both ways, by more than the 12% headroom at steps 17 and 18
    growth = [1.0, 0.9, 1.1, 1.05, 0.95, 1.2, 1.0, 0.8, 1.0, 1.3, 1.0, 1.0, 0.9, 1.1, 1.0, 1.0, 1.05, 1.3, 1.25, 0.9]
    weights, w = [], mlp.proj.detach().float()
    for k in growth:
        w = (w * k + 0.002 * torch.randn(w.shape, generator=g)).bfloat16().float()
        weights.append(w)
    previous_amax, reach = None, []
    for step, w in enumerate(weights):
        mlp.proj.data = w.bfloat16()
        mlp.refresh_fp8(T.down_scales(step))
        amax = w.abs().max()
        if step < 16:  # exact: the weights' own maximum / 448, in bf16
            used = (amax.bfloat16() / 448).float()
        else:  # 1.12 x the previous step's maximum / 448, in fp32
            used = previous_amax * torch.tensor(1.12 / 448)
        assert mlp.down_weight_scale == used, step
        assert torch.equal(mlp.proj_f8_t.T.float(), e4m3(w / used)), step
        reach.append(float(amax / used / 448))  # past 1: the largest weights clip at 448
        previous_amax = amax
    # exact steps reach 448 within the bf16 rounding of their scale; delayed ones 1/1.12 of it, unless they grew
    assert all(abs(r - 1) <= 2 ** -8 for r in reach[:16]), reach
    assert reach[17] > 1.1 and reach[18] > 1.05 and all(r < 1 for r in (reach[16], reach[19])), reach
    # the activation's scale: 1.8 x the previous forward's maximum of relu^2's output, 1.0 before the first
    fresh, _ = fp8_down_mlp()
    expected_next = torch.tensor(1.0)
    for i in range(4):
        x = T.norm(torch.randn(32, 64, generator=g)).bfloat16()
        before = fresh.down_act_scale.clone()
        _, saved = hidden_saved(fresh, x)
        assert before == expected_next, i
        expected_next = saved[0].float().max() * torch.tensor(1.8 / 448)
        assert fresh.down_act_scale == expected_next


@pytest.mark.slow  # 12 s: CPU _scaled_mm is a slow loop
def test_fp8_down_state_loads_back_and_continues_bit_for_bit():
    args = T.parse_args([*SMOKE89], False)
    numerics = T.Numerics(torch.float32, "fp32", "fp8")
    torch.manual_seed(0)
    model = T.GPT(args, numerics).train()
    T.refresh_fp8(model, "exact")
    tokens = torch.randint(0, 50000, (65,))  # few: CPU _scaled_mm is a slow loop
    tokens[0] = T.BOS_ID
    masks = T.build_masks(tokens[:-1], model.plans, (1, 2), args.window_block, False)
    mtp = torch.tensor([1.0, 0.5])

    def step(m, s):
        m(tokens[:-1], tokens[1:], masks, mtp, loss_scale=1.0).backward()
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad.sign()
                p.grad = None
        T.refresh_fp8(m, T.down_scales(s))

    for s in range(2):
        step(model, s)
    again = T.GPT(args, numerics).train()
    again.load_state_dict(model.state_dict())  # the post-load refresh quantises at the loaded scales
    scaled = [b.mlp for b in model.blocks]
    assert all(m.down_fp8 for m in scaled)
    for m, m2 in zip(scaled, [b.mlp for b in again.blocks]):
        for name in ("proj_f8_t", "fc_f8", "down_weight_scale", "down_weight_next_scale", "down_act_scale"):
            assert torch.equal(getattr(m, name).float(), getattr(m2, name).float()), name
    assert len({float(m.down_act_scale) for m in scaled}) == len(scaled)  # set by the forwards, one per layer
    for s in (3, 20):  # an exact step, a delayed one
        step(model, s)
        step(again, s)
    pairs = zip(model.state_dict().values(), again.state_dict().values())
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs)


def test_each_rank_resumes_with_its_own_activation_scales(tmp_path):
    args = T.parse_args([*SMOKE89], False)
    model = T.GPT(args, T.Numerics(torch.float32, "fp32", "fp8"))
    own = T.rank_buffers(model)
    assert sorted(own) == [f"blocks.{i}.mlp.down_act_scale" for i in range(args.num_layers)]
    rank_0 = copy.deepcopy(model.state_dict())  # model.pt: rank 0's scales
    rank_1 = {name: torch.tensor(2.0 + i) for i, name in enumerate(own)}
    loader = type("Loader", (), {"load_state_dict": lambda self, state: None})()
    env = T.DistEnv(1, 1, 2, torch.device("cpu"))
    state = {"step": 4, "optimizers": [], "rank_buffers": rank_1, "cpu_rng": torch.get_rng_state()}
    meta = type("Meta", (), {"loader": {}, "step": 4, "train_time_ms": 1.0})()
    T.load_checkpoint(T.Resume(tmp_path, meta, rank_0, state), model, [], loader, env)
    assert all(own[name] == value for name, value in rank_1.items())
    del state["rank_buffers"]  # a checkpoint of the same config without them: refused, in one line
    with pytest.raises(T.TrainingError, match=r"does not fit this run \(rank 1's activation scales: the "
                                              r"checkpoint holds 0, the model 6\)"):
        T.load_checkpoint(T.Resume(tmp_path, meta, rank_0, state), model, [], loader, env)


class StubAttention(torch.nn.Module):
    """Stands in for a layer's attention: returns a fixed tensor and records what it was given."""

    def __init__(self, out, heads):
        super().__init__()
        self.out, self.calls, self.num_heads = out, [], heads

    def forward(self, x, lambdas, extras, inputs, cache=None):
        self.calls.append((x, extras.aux_v, (extras.xsa_alpha, extras.gate, extras.dc_w)))
        return self.out


class StubMLP(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out, self.calls = out, []

    def forward(self, x):
        self.calls.append(x)
        return self.out


def test_the_stream_skip_and_mudd_mixing_follow_the_record():
    # Attention and MLP replaced by fixed outputs: what remains is the record's stream arithmetic, recomputed
    # here from its definition, layer by layer.
    args = small_args()
    model = randomized_model(args, seed=1, scale=0.3)
    g = torch.Generator().manual_seed(2)
    T_, dim, H = 64, args.model_dim, model.num_heads
    tokens = tokens_with_documents(T_, [0, 20])
    outs = [(torch.randn(1, T_, dim, generator=g), torch.randn(1, T_, dim, generator=g)) for _ in model.plans]
    for block, (a, m) in zip(model.blocks, outs):
        if block.attn is not None:
            block.attn = StubAttention(a, H)
        block.mlp = StubMLP(m)
    masks = T.build_masks(tokens, model.plans, (1, 2), args.window_block, use_flex=False)
    with torch.no_grad():
        ours = model.hidden(tokens, masks)

        # embedding, smear (from position 1), norm; the bigram row times its sign
        e = model.embed.weight[tokens]
        lam, gw = model.scalars[-2], model.smear_gate.weight
        smeared = torch.cat([e[:1], e[1:] + lam * torch.sigmoid(e[1:, :12] @ gw.T) * e[:-1]])
        x0 = T.norm(smeared)
        ids = tokens.tolist()
        rows = torch.tensor(reference_bigram_hash(ids, args.bigram_vocab_size))
        sign_rows = torch.tensor([0] + [(a ^ b) % args.bigram_sign_rows for a, b in zip(ids, ids[1:])])
        bigram = model.bigram_embed.weight[rows] * model.bigram_signs[sign_rows]
        layout = T.GateLayout.build(model.plans, H, args.mudd_gate_layer)

        def gate_net(x, net):
            width = layout.widths[net]
            h = F.gelu(x @ model.mudd_gate_w1[net].T)
            return (h @ model.mudd_gate_w2[net, :width].T + model.mudd_gate_b2[net, :width]) * model.mudd_gate_scale

        def mudd(x, net, n):
            h = F.gelu(x @ model.mudd_w1[net].T)
            return ((h @ model.mudd_w2[net, :n].T + model.mudd_b2[net, :n]) * 0.1).unbind(-1)

        gates = {name: gate_net(x0, 0)[:, where] for name, where in layout.slots[0].items()}
        x = x0 + bigram * gates[("bigram", 0)]
        saved = {0: x}
        ve = model.value_embeds.view(-1, model.vocab, dim)[:, tokens]
        resid, post = model.resid_lambdas.bfloat16().float(), model.post_lambdas.bfloat16().float()
        for plan, (a, m) in zip(model.plans, outs):
            i, a, m = plan.index, a[0], m[0]
            if i == args.mudd_gate_layer:
                gates.update({name: gate_net(x, 1)[:, where] for name, where in layout.slots[1].items()})
            if plan.skip_target:
                x = x + torch.sigmoid(model.scalars[-1]) * gates[("skip",)] * saved[1]
            elif plan.mudd:
                mu = mudd(x, 0, 14)
                col = lambda j: mu[j][:, None]
                stub = model.blocks[i].attn
                v_expected = (col(0) * saved[0] + col(1) * saved[2] + col(2) * x).view(T_, H, -1)
                ve_gate = torch.cat([col(6).expand(T_, H // 2), col(7).expand(T_, H // 2)], -1)[:, :, None]
                aux_v = (ve_gate * ve[plan.value_embed].view(T_, H, -1) + v_expected).view(T_, dim)
                assert_close(stub.calls[0][1][0], aux_v)
                assert_close(stub.calls[0][0][0], T.norm(saved[2]))  # the shared input: layer 2's output
                last = x
                x = (1 + col(5)) * x + col(3) * saved[0] + col(4) * saved[2]
                x = col(8) * x + col(9) * a + saved[0] * col(10) + bigram * col(11)
            else:
                stub = model.blocks[i].attn
                assert_close(stub.calls[0][0][0], T.norm(saved[2] if i > 2 else x))
                x = resid[i, 0] * x + post[i, 0] * a + x0 * gates[("x0", i)]
                if i:
                    x = x + bigram * gates[("bigram", i)]
            x = (col(12) * x + col(13) * m) if plan.mudd else resid[i, 1] * x + post[i, 1] * m
            if i in (1, 2):  # the skip source and the shared input layer
                saved[i] = x
        mu = [c[:, None] for c in mudd(x, 1, 5)]
        x = x + mu[0] * saved[0] + mu[1] * saved[2] + mu[2] * last + mu[3] * ve[0] + mu[4] * saved[1]
    assert_close(ours[0], T.norm(x), rtol=1e-5, atol=1e-5)
    # each gated layer received its gates from the right slots
    assert_close(model.blocks[1].attn.calls[0][2][0][0], gates[("xsa", 1)])
    assert_close(model.blocks[5].attn.calls[0][2][2][1][0], gates[("dc_w2", 5)])


def test_no_position_sees_the_future():
    args = small_args()
    model = randomized_model(args)
    tokens = tokens_with_documents(513, [0, 150])
    base = per_token_losses(model, args, tokens)
    changed = tokens.clone()
    changed[200] = (changed[200] + 1) % T.BOS_ID
    after = per_token_losses(model, args, changed)
    # loss i predicts token i+1 from tokens <= i: positions before 199 must not move
    assert torch.equal(after[:199], base[:199])
    assert not torch.equal(after[199:], base[199:])


def test_packed_documents_score_as_if_alone_when_kept_separate():
    # Like the record, training lets the smear, the bigram hash and the key offset read across a BOS; with
    # separate_documents (sample.py's HellaSwag packing) each document scores exactly as it would alone.
    args = small_args()
    model = randomized_model(args)
    tokens = tokens_with_documents(385, [0, 150, 300])
    packed = per_token_losses(model, args, tokens, separate_documents=True)
    for start, end in ((0, 150), (150, 300), (300, 384)):
        alone = per_token_losses(model, args, tokens[start:end + 1])
        assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)
    leaky = per_token_losses(model, args, tokens)
    assert not torch.allclose(leaky[150:300], packed[150:300])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_model_forward_is_the_same_with_flex_and_sdpa():
    args = small_args()
    model = randomized_model(args, scale=0.1)
    tokens = tokens_with_documents(1025, [0, 64, 65, 500, 1000])
    windows = T.Schedule(args).windows(args.num_iterations, final_validation=True)
    sdpa = per_token_losses(model, args, tokens, windows, use_flex=False)
    flex = per_token_losses(model, args, tokens, windows, use_flex=True)
    assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)


def test_speedrun_layer_plan_is_record_85s():
    plans = T.layer_plan(T.parse_args(["--preset=record89"], True))
    roles = {
        "attention": [i for i in range(11) if i != 6], "paired": [0, 2, 5, 9], "long_window": [3, 10],
        "xsa": [1, 3, 4, 7], "attn_gate": [3, 10], "dc": [10], "shared_input": [8, 9, 10], "skip_target": [6],
        "mudd": [10],
    }
    for role, layers in roles.items():
        assert [p.index for p in plans if getattr(p, role)] == layers, role
    assert [p.value_embed for p in plans] == [None, 0, 1, None, None, None, None, None, 2, 3, 4]
    assert [p.ve_gate for p in plans] == [None, 0, 1, None, None, None, None, None, 2, 3, None]


def test_gate_layout_is_record_85s():
    args = T.parse_args(["--preset=record89"], True)
    layout = T.GateLayout.build(T.layer_plan(args), 6, args.mudd_gate_layer)
    pre, post = layout.slots
    assert layout.widths == (26, 41)
    assert (pre[("xsa", 1)], pre[("xsa", 3)], pre[("attn", 3)]) == (slice(0, 6), slice(6, 12), slice(12, 18))
    assert [pre[("bigram", layer)].start for layer in range(4)] == [19, 21, 23, 25]
    assert (post[("xsa", 4)], post[("xsa", 7)], post[("attn", 10)]) == (slice(0, 6), slice(6, 12), slice(12, 18))
    assert [post[("x0", layer)].start for layer in (4, 5, 7, 8, 9)] == [18, 20, 22, 24, 26]
    assert (post[("skip",)], post[("dc_w1", 10)], post[("dc_w2", 10)]) == (slice(28, 29), slice(29, 35), slice(35, 41))
    bias = [0.0] * 41
    bias[12:18] = [2.5] * 6
    bias[19:28:2] = [0.5] * 5
    bias[28], bias[29:35] = 5.0, [10.0] * 6
    assert layout.bias[1] == pytest.approx(bias)
    pre_bias = [0.0] * 26
    pre_bias[12:18], pre_bias[19:26:2] = [2.5] * 6, [0.5] * 4
    assert layout.bias[0] == pytest.approx(pre_bias)


def test_initial_values_follow_record_85():
    args = T.parse_args(["--preset=record89", "--bigram_vocab_size=1000", "--vocab_size=1000"], True)
    torch.manual_seed(0)
    model = T.GPT(args)
    assert torch.equal(model.embed.weight, model.lm_head.T)
    assert model.lm_head.std().item() == pytest.approx(0.005, rel=0.02)
    assert model.value_embeds.std().item() == pytest.approx(0.01, rel=0.02)
    bound = 3 ** 0.5 * 0.5 * 768 ** -0.5
    for block in model.blocks:
        assert torch.equal(block.mlp.proj, torch.zeros_like(block.mlp.proj))
        tensors = [block.mlp.fc] + ([block.attn.qk, block.attn.vo] if block.attn is not None else [])
        for t in tensors:
            assert t.abs().max() <= bound and t.abs().max() > 0.99 * bound
    for zero in (model.bigram_embed.weight, model.smear_gate.weight, model.ve_gates, model.mudd_w2, model.mudd_gate_w2):
        assert not zero.any()
    assert set(model.bigram_signs.unique().tolist()) == {-1.0, 1.0}
    assert model.scalars.tolist() == [0.5, 1.0] * 11 + [0.0, -1.5]
    assert_close(model.resid_lambdas, torch.full((11, 2), 1.1 ** 0.5))
    assert torch.equal(model.post_lambdas, torch.ones(11, 2))
    expected = torch.zeros(2, 14)
    expected[0, 6:14] = torch.tensor([2, 2, 1.1 ** 0.5, 1, 0, 0.05, 1.1 ** 0.5, 1]) / 0.1
    expected[1, 1] = -5
    assert_close(model.mudd_b2, expected)
    assert model.mudd_gate_scale.item() == pytest.approx(0.1)
    assert model.mudd_w1.abs().max() <= 768 ** -0.5  # kaiming_uniform(a=sqrt(5)): bound 1/sqrt(fan_in)


def test_every_parameter_gets_a_gradient():
    args = small_args()
    model = T.GPT(args).train()
    tokens = tokens_with_documents(257, [0, 100])
    masks = T.build_masks(tokens[:-1], model.plans, (1, 2), args.window_block, use_flex=False)
    model(tokens[:-1], tokens[1:], masks, torch.tensor([1.0, 0.5, 0.25])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_logits_are_softcapped_with_the_records_shifted_sigmoid():
    args = small_args()
    model = randomized_model(args)
    x = torch.randn(5, args.model_dim)
    assert_close(model.logits(x), 23 * torch.sigmoid((x @ model.lm_head + 5) / 7.5))


def test_rotary_turns_adjacent_pairs_of_the_first_half_with_bf16_tables():
    rotary = T.Rotary(16, 32, 64, 2)
    freq = (1 / 1024) ** torch.linspace(0, 1, 4)
    assert torch.equal(rotary.angular_freq, torch.cat([freq.repeat_interleave(2), torch.zeros(8)]))
    assert rotary.cos.dtype == torch.bfloat16 and rotary.cos.size(0) == 64  # twice the positions (paired layers)
    x = torch.randn(10, 1, 16)
    positions = torch.arange(10)
    ours = T.apply_rotary(x, rotary.cos[:10, None], rotary.sin[:10, None])
    assert_close(ours, rope(x, positions, rotary.angular_freq), rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., 8:], x[..., 8:])  # the stationary half


def test_rotary_state_round_trips_through_the_state_dict():
    args = small_args()
    model = T.GPT(args)
    model.rotary.set_window(6)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    fresh = T.GPT(args)
    fresh.load_state_dict(state)
    assert fresh.rotary.window == 6 and fresh.rotary.scale == model.rotary.scale
    assert torch.equal(fresh.rotary.cos, model.rotary.cos) and torch.equal(fresh.rotary.attn_scale, model.rotary.attn_scale)


def test_the_residual_stream_stays_in_bf16_with_gpu_dtypes():
    # Every scalar multiplied into the stream must be 0-dim (or bf16): a 1-element fp32 vector would
    # promote the whole stream, and with it every matmul, to fp32.
    args = small_args()
    model = T.cast_parameters(randomized_model(args, numerics=T.Numerics(torch.bfloat16, "bf16", "bf16")))
    tokens = tokens_with_documents(512, [0, 100])
    masks = T.build_masks(tokens, model.plans, (1, 2), args.window_block, use_flex=False)
    seen = set()
    for block in model.blocks:
        for module in (block.attn, block.mlp):
            if module is not None:
                module.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    with torch.no_grad():
        assert model.hidden(tokens, masks).dtype == torch.bfloat16
    assert seen == {torch.bfloat16}


def test_gpu_parameter_dtypes_are_record_85s():
    args = T.parse_args(["--preset=record89"], True)
    with torch.device("meta"):
        model = T.cast_parameters(T.GPT(args, T.Numerics(torch.bfloat16, "fp8", "fp8")))
    fp32 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)
    assert fp32 == sorted(["scalars", "resid_lambdas", "post_lambdas", "mudd_gate_scale"])
    assert all(p.dtype in (torch.float32, torch.bfloat16) for p in model.parameters())
    assert model.bigram_signs.dtype == torch.bfloat16


# --- the loss head's bf16 rounding, compiled without inductor flags (the public record rule 3) ---------------

def rounding_inputs() -> torch.Tensor:
    """fp32 values of every magnitude and sign, bf16's halfway points (ties to even both ways, and one ulp of fp32
    either side), subnormals, zeros and the largest finite values that stay finite in bf16."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(1 << 16, generator=g) * torch.logspace(-30, 30, 1 << 16)
    grid = torch.arange(-1024, 1024, dtype=torch.float32) * 2 ** -8 + 0.5
    ties = (grid.view(torch.int32) | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    near = torch.cat([(ties.view(torch.int32) + d).view(torch.float32) for d in (-1, 1)])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2 ** -126, 3.38e38, -3.38e38, 1.0 - 2 ** -24])
    return torch.cat([spread, grid, ties, near, special])


def test_round_to_bf16_is_the_cast_down_and_back_up_bit_for_bit():
    x = rounding_inputs()
    expected = x.to(torch.bfloat16).float()
    assert torch.equal(T.round_to_bf16(x).view(torch.int32), expected.view(torch.int32))


@pytest.mark.slow  # inductor's C++ compile on this CPU: about 15 s
def test_inductor_keeps_the_bf16_rounding_without_a_config_flag():
    """The squashed logits are rounded to bf16 in the compiled loss head, as the record's kernel rounds them, with
    no torch._inductor.config setting: inductor's generated code has the rounding's integer constants and computes
    the cast's values exactly. (Inductor drops a plain x.to(bf16).float() in a fused kernel: on this CPU, for the
    same function, most values differed.)"""
    from torch._inductor.utils import run_and_get_code

    def squash(u):  # record #85's kernel's bf16 rounding, and record #92's fp16 one (round_to_fp16: a plain
        # .half().float() compiled here left 65,492 of 65,536 values unrounded)
        s = torch.sigmoid(u * 0.25 + 0.5)
        return T.round_to_bf16(s) * 3.0, T.round_to_fp16(s) * 3.0

    u = rounding_inputs().clamp(-80, 80)
    (out, out16), code = run_and_get_code(torch.compile(squash, backend="inductor", fullgraph=True), u)
    source = "\n".join(code)
    assert "32767" in source and "-65536" in source, "the rounding is not in inductor's generated code"
    assert "4095" in source and "-8192" in source, "the fp16 rounding is not in inductor's generated code"
    expected = torch.sigmoid(u * 0.25 + 0.5).to(torch.bfloat16).float() * 3.0
    assert torch.equal(out, expected)
    assert torch.equal(out16, torch.sigmoid(u * 0.25 + 0.5).half().float() * 3.0)
    # relu^2's gradient from its bf16 output: compiled, the root is taken in fp32 and rounded back, so it is
    # 2 relu(h) g of the bf16 h, bit for bit (unrounded, 4,143 of these 32,750 positive values differ)
    g = torch.Generator().manual_seed(13)
    h = (torch.randn(1 << 16, generator=g) * torch.logspace(-8, 8, 1 << 16)).bfloat16()
    grad = torch.randn(1 << 16, generator=g).bfloat16()
    compiled = torch.compile(T.relu_square_grad, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(F.relu(h).square(), grad), 2 * F.relu(h) * grad)
    assert not torch._inductor.config.emulate_precision_casts


# --- config -----------------------------------------------------------------------------------

def test_config_overrides_and_errors():
    args = T.parse_args(["--preset=smoke", "--num_iterations=7", "--compile", "false", "--adam_lr=0.5"], False)
    assert (args.num_iterations, args.compile, args.adam_lr, args.preset) == (7, False, 0.5, "smoke")
    assert T.parse_args([], cuda_available=True).preset == "speedrun"
    assert T.parse_args([], cuda_available=False).preset == "smoke"
    errors = [
        (["--num_iteration=3"], "unknown flag --num_iteration;.*--num_iterations"),
        (["--num_iterations=abc"], "--num_iterations=abc: expected int"),
        (["--compile=maybe"], "--compile=maybe: expected a boolean"),
        (["--preset=fast"], "unknown preset"),
        (["--stage_batch_tokens=1000,2048,3072"], "each batch must split into --micro_batches=4 micro-batches"),
        (["--stage_lr=1,2"], "must list one value per stage"),
        (["--stage_windows=1:2,4:2,3:6"], "short <= long"),
        (["--stage_mtp_weights=1,0.5>1/1>1/1>1"], "as many weights after '>'"),
        (["--paired_layers=0,x"], "--paired_layers=0,x: expected comma-separated integers"),
        (["--long_window_layers=3,6"], "--long_window_layers: layer 6 is not in 0..5"),
        (["--no_attention_layers=2"], "must hold the skip target"),
        (["--paired_layers=0,1"], "layer 1 is paired"),
        (["--dc_layers=1"], "DC layers must be at or after --mudd_gate_layer=2"),
        (["--value_embed_layers=1,2,4"], "needs attention, no pairing and a value embedding"),
        (["--dc_window=100"], "--dc_window=100: at most --window_block=64"),
        (["--extension_steps=30"], "--extension_steps=30 must be less than --num_iterations=30"),
        (["--save_every=3"], "--save_every=3 must be a multiple of --adam_every=2"),
        (["--attention=fast"], "--attention=fast: choose auto, flex, sdpa"),
        (["--head_dim=32", "--model_dim=96"], "even number of --head_dim=32 heads"),
    ]
    for argv, message in errors:
        with pytest.raises(T.ConfigError, match=message):
            T.parse_args([*SMOKE89, *argv], False)


def test_training_with_flex_on_cpu_is_refused_and_evaluation_allowed():
    args = T.parse_args([*SMOKE89, "--attention=flex"], False)
    with pytest.raises(T.ConfigError, match="no FlexAttention backward on CPU"):
        T.resolve_attention(args, torch.device("cpu"))
    assert T.resolve_attention(args, torch.device("cpu"), training=False) == "flex"
    assert T.resolve_attention(small_args(), torch.device("cpu")) == "sdpa"
    assert T.resolve_attention(small_args(), torch.device("cuda")) == "flex"


def test_world_size_that_cannot_split_the_batch_is_an_error():
    args = small_args()
    assert T.check_world_size(args, 1) == (4, 4, 4) and T.check_world_size(args, 2) == (2, 2, 2)
    with pytest.raises(T.ConfigError, match="world size 3 cannot split the batch"):
        T.check_world_size(args, 3)
    speedrun = T.parse_args(["--preset=record89"], True)
    assert [T.check_world_size(speedrun, w) for w in (1, 2, 4, 8)] == [(8,) * 3, (4,) * 3, (2,) * 3, (1,) * 3]
    with pytest.raises(T.ConfigError, match="a larger --micro_batches makes more"):
        T.check_world_size(speedrun, 16)
    two_nodes = T.parse_args(["--preset=record89", "--micro_batches=16", "--val_seq_len=65536"], True)
    assert T.check_world_size(two_nodes, 16) == (1, 1, 1)
    # one count per stage: each must split over the ranks
    per_stage = T.parse_args(["--preset=record89", "--micro_batches=2,8,8"], True)
    assert T.check_world_size(per_stage, 2) == (1, 4, 4)
    with pytest.raises(T.ConfigError, match="--micro_batches=2,8,8 micro-batches, not a multiple of 4"):
        T.check_world_size(per_stage, 4)
    # auto chooses at start-up, among multiples of the world size
    assert T.check_world_size(T.parse_args(["--preset=record89", "--micro_batches=auto"], True), 8) == (None,) * 3


def test_norm_is_pytorchs_default_rms_norm_in_every_dtype():
    """The records call F.rms_norm with no eps; since PyTorch 2.7 that is fp32's epsilon for bf16 inputs too (it
    once read as 2**-7 here). Small activations (the embedding's, std 0.005 at init) show the difference."""
    x = torch.randn(8, 64) * 5e-3
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(T.norm(x.to(dtype)), F.rms_norm(x.to(dtype), (64,)))
    assert T.norm(x).pow(2).mean().item() == pytest.approx(1, rel=1e-2)  # 2**-7 made it 3e-3

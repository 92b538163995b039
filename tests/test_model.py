"""Model pieces against their definitions: attention masks and the two attention paths, causality and
document isolation, record #44's layer layout, rotary with YaRN, gates, backout, the logit cap, the
FP8 head, parameter dtypes, config parsing."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import train_gpt as T


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
    dense = T.attention(q, k, v, T.dense_attention_mask(docs, window))
    flex = T.attention(q, k, v, T.flex_block_mask(docs, window, 128))
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
    return T.parse_args(["--preset=smoke", *(f"--{k}={v}" for k, v in overrides.items())], False)


def randomized_model(args, seed=0):
    torch.manual_seed(seed)
    model = T.GPT(args)
    with torch.no_grad():  # zero-initialised projections would hide any leak: give every weight a value
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def per_token_losses(model, args, tokens, windows=None, use_flex=False):
    inputs, targets = tokens[:-1], tokens[1:]
    layer_windows = T.layer_windows(args, windows or T.attention_windows(0, args))
    with torch.no_grad():
        return model(inputs, targets, T.build_masks(inputs, layer_windows, use_flex, args.window_block),
                     reduction="none")


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


def test_no_position_sees_another_document_except_through_the_smear():
    args = small_args()
    model = randomized_model(args)
    tokens = tokens_with_documents(513, [0, 150])
    base = per_token_losses(model, args, tokens)
    changed = tokens.clone()
    changed[20:140] = (changed[20:140] + 7) % T.BOS_ID  # rewrite most of the first document, not its end
    after = per_token_losses(model, args, changed)
    # From the second document's BOS (input 150) on, attention sees only that document. The smear
    # gate mixes each token's embedding with its predecessor's (as in record #44, also across a
    # document boundary), so the BOS at 150 reads token 149, which did not change.
    assert torch.equal(after[150:], base[150:])
    assert not torch.equal(after[:149], base[:149])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_model_forward_is_the_same_with_flex_and_sdpa():
    args = small_args()
    model = randomized_model(args)
    tokens = tokens_with_documents(1025, [0, 64, 65, 500, 1000])
    windows = T.attention_windows(args.num_iterations, args, final_validation=True)
    sdpa = per_token_losses(model, args, tokens, windows, use_flex=False)
    flex = per_token_losses(model, args, tokens, windows, use_flex=True)
    assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_speedrun_layer_layout_is_record_44s():
    args = T.parse_args(["--preset=speedrun"], True)
    specs = T.layer_specs(args)
    assert [i for i, s in enumerate(specs) if s.attention] == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]  # 10 layers
    assert [i for i, s in enumerate(specs) if s.mlp] == list(range(1, 12))  # 11 layers
    assert {i: s.value_embed for i, s in enumerate(specs) if s.value_embed is not None} == {
        1: 1, 2: 2, 9: 0, 10: 1, 11: 2}
    assert [i for i, s in enumerate(specs) if s.long_window] == [4, 11]
    with torch.device("meta"):
        model = T.GPT(args)
    assert not model.blocks[0].active and list(model.blocks[0].parameters()) == []
    assert model.blocks[7].attn is None and model.blocks[7].mlp is not None
    assert (model.skip_from, model.skip_to) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # 5 U-net skips
    assert model.backout_layer == 8
    assert T.padded_vocab(args.vocab_size) == 50304
    assert model.head.lm_head.weight.shape == (50304, 768)
    assert model.blocks[1].attn.num_heads == 6 and model.blocks[1].attn.head_dim == 128
    assert model.blocks[1].attn.qkvo.shape == (4, 768, 768) and model.blocks[1].attn.gate.weight.shape == (6, 12)
    assert model.blocks[1].mlp.fc.weight.shape == (3072, 768)
    windows = T.layer_windows(args, (1, 3))
    assert windows == [None, 128, 128, 128, 384, 128, 128, None, 128, 128, 128, 384]


def test_initial_values_follow_record_44():
    args = T.parse_args(["--preset=smoke", "--model_dim=256", "--head_dim=64"], False)
    torch.manual_seed(0)
    model = T.GPT(args)
    attn, mlp = model.blocks[1].attn, model.blocks[1].mlp
    # 0.5 / sqrt(fan_in), uniform (the std of 3 * 256 * 256 samples is within 2% of it)
    assert attn.qkvo[:3].std().item() == pytest.approx(0.5 / 16, rel=0.02)
    assert attn.qkvo[:3].abs().max().item() <= 3 ** 0.5 * 0.5 / 16
    assert mlp.fc.weight.std().item() == pytest.approx(0.5 / 16, rel=0.02)
    for zero in (attn.qkvo[3], mlp.proj.weight, attn.gate.weight, model.smear_gate.weight,
                 model.head.lm_head.weight, model.smear_scale):
        assert not zero.any()
    assert torch.equal(model.skip_gates, torch.full((len(model.skip_to),), -1.5))
    assert model.backout_scale.item() == 0.5
    assert attn.value_mix.tolist() == [0.5, 0.5] and model.blocks[2].attn.value_mix.tolist() == [0.5]
    assert model.blocks[1].residual_mix.tolist() == [1.0, 0.0]


def test_every_parameter_gets_a_gradient():
    args = small_args()
    model = randomized_model(args).train()
    tokens = tokens_with_documents(513, [0, 200])
    inputs, targets = tokens[:-1], tokens[1:]
    masks = T.build_masks(inputs, T.layer_windows(args, (1, 3)), False, args.window_block)
    model(inputs, targets, masks).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_smear_gate_mixes_in_the_previous_token():
    args = small_args()
    model = randomized_model(args)
    x = torch.randn(6, args.model_dim)
    gate = torch.sigmoid(x[:, :T.GATE_CHANNELS] @ model.smear_gate.weight[0])
    expected = x.clone()
    expected[1:] += model.smear_scale * gate[1:, None] * x[:-1]
    assert_close(model.smear(x), expected)
    # generation continues from a previous token's embedding
    assert_close(model.smear(x[3:], previous=x[2:3]), expected[3:])


def test_attention_gate_scales_each_head():
    torch.manual_seed(0)
    attn = T.CausalSelfAttention(64, 16, has_value_embed=False)
    with torch.no_grad():
        attn.qkvo.normal_()
    x = torch.randn(1, 8, 64)
    docs = torch.zeros(8, dtype=torch.long)
    rot = T.Rotary(16, 8, 64, 3)
    args = (None, T.dense_attention_mask(docs, 8), rot.cos[:8], rot.sin[:8], rot.attn_scale)
    open_gate = attn(x, *args)
    with torch.no_grad():
        attn.gate.weight[2, 0] = 50.0  # head 2 gated by sigmoid(50 * x[..., 0])
    gated = attn(x, *args)
    g = torch.sigmoid(50 * x[0, :, 0])
    # undo the output projection to compare per head
    heads_open = torch.linalg.solve(attn.qkvo[3], open_gate[0].T).T.view(8, 4, 16)
    heads_gated = torch.linalg.solve(attn.qkvo[3], gated[0].T).T.view(8, 4, 16)
    assert_close(heads_gated[:, 2], heads_open[:, 2] * (g / 0.5)[:, None], rtol=1e-4, atol=1e-4)
    assert_close(heads_gated[:, [0, 1, 3]], heads_open[:, [0, 1, 3]], rtol=1e-4, atol=1e-4)


def test_backout_subtracts_a_share_of_its_layers_output():
    args = small_args()
    model = randomized_model(args)
    tokens = tokens_with_documents(256, [0])
    masks = T.build_masks(tokens, T.layer_windows(args, (1, 3)), False, args.window_block)
    captured = {}
    model.blocks[args.backout_layer].register_forward_hook(lambda m, i, out: captured.update(out=out))
    with torch.no_grad():
        model.backout_scale.fill_(0.0)
        plain = model.hidden(tokens, masks)
        model.backout_scale.fill_(0.5)
        backed_out = model.hidden(tokens, masks)
    assert_close(backed_out, plain - 0.5 * captured["out"])


def test_logits_are_capped_with_a_sigmoid():
    head = T.LossHead(16, 128, cap=30.0, cap_width=7.5, precision="fp32")
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 3)
    x = torch.randn(5, 16)
    raw = T.norm(x) @ head.lm_head.weight.T
    assert_close(head.logits(x), 30 * torch.sigmoid(raw / 7.5))
    assert head.logits(x * 100).max() < 30 and head.logits(x).min() > 0


# --- rotary and YaRN --------------------------------------------------------------------------

def test_rotary_is_half_truncated_with_base_frequencies():
    rot = T.Rotary(head_dim=128, max_len=16, window_block=128, first_window=3)
    expected = np.concatenate([(1 / 1024) ** np.linspace(0, 1, 32), np.zeros(32)])
    assert_close(rot.angular_freq.double(), torch.from_numpy(expected), rtol=1e-6, atol=0)
    positions = torch.arange(16.0)[:, None]
    assert_close(rot.cos, torch.cos(positions * rot.angular_freq))
    assert rot.attn_scale.item() == pytest.approx(0.1)
    x = torch.randn(1, 16, 2, 128)
    y = T.apply_rotary(x, rot.cos, rot.sin)
    assert torch.equal(y[..., 32:64], x[..., 32:64]) and torch.equal(y[..., 96:], x[..., 96:])  # no position
    assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_yarn_follows_its_formula_over_the_window_schedule():
    rot = T.Rotary(head_dim=128, max_len=64, window_block=128, first_window=3)
    freq = np.concatenate([(1 / 1024) ** np.linspace(0, 1, 32), np.zeros(32)])
    scale, old = 0.1, 3
    for new in (7, 11, 13):
        rot.set_window(new)
        turns = 128 * old * freq / (2 * math.pi)
        ramp = np.clip((turns - 1) / (32 - 1), 0, 1)
        freq = freq * (old / new + ramp * (1 - old / new))
        scale *= 0.2 * math.log(new / old) + 1
        old = new
        assert_close(rot.angular_freq.double(), torch.from_numpy(freq), rtol=1e-5, atol=0)
        assert rot.attn_scale.item() == pytest.approx(scale, rel=1e-6)
        assert_close(rot.sin, torch.sin(torch.arange(64.0)[:, None] * rot.angular_freq))
    # high frequencies (many turns per window) are kept, the lowest ones scaled by the full ratio
    base = (1 / 1024) ** np.linspace(0, 1, 32)
    assert rot.angular_freq[0].item() == pytest.approx(1.0)
    assert rot.angular_freq[31].item() == pytest.approx(base[31] * 3 / 13, rel=1e-5)
    rot.set_window(13)  # the same window again: nothing changes
    assert rot.attn_scale.item() == pytest.approx(scale, rel=1e-6)


def test_rotary_state_round_trips_through_the_state_dict():
    args = small_args()
    model = T.GPT(args)
    model.rotary.set_window(6)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    fresh = T.GPT(args)
    fresh.load_state_dict(state)
    assert fresh.rotary.window == 6 and fresh.rotary.scale == model.rotary.scale
    assert torch.equal(fresh.rotary.cos, model.rotary.cos) and torch.equal(fresh.rotary.attn_scale, model.rotary.attn_scale)


# --- the FP8 head -----------------------------------------------------------------------------

def fp8_emulated(x, w, grad):
    """The FP8 head's math in fp32: quantise, multiply, dequantise (the definition, not the kernel)."""
    x_scale = x.size(-1) ** 0.5 / 448
    x8 = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    w8 = (w / 2 ** -9).to(torch.float8_e4m3fn).float() * 2 ** -9
    g8 = (grad.bfloat16() * 448).to(torch.float8_e5m2).float() / 448  # backward receives the bf16 output's gradient
    return x8 @ w8.T, g8 @ w8, g8.T @ x8


def test_fp8_head_matches_its_quantised_definition_and_a_bf16_reference():
    torch.manual_seed(0)
    x = T.norm(torch.randn(64, 128))
    w = (torch.randn(256, 128) * 0.05).requires_grad_()
    xr = x.clone().requires_grad_()
    out = T.FP8Linear.apply(xr, w, 128 ** 0.5 / 448)
    grad = torch.rand(64, 256) * 2 - 1  # a summed cross-entropy's logit gradients lie in [-1, 1]
    out.backward(grad)
    ref_out, ref_gx, ref_gw = fp8_emulated(x, w.detach(), grad)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref_out, rtol=2 ** -8, atol=1e-3)  # bf16 rounding of the same products
    assert_close(xr.grad.float(), ref_gx, rtol=2 ** -8, atol=1e-3)
    assert_close(w.grad, ref_gw, rtol=1e-5, atol=1e-5)
    # against plain bf16: FP8's 3 mantissa bits cost a few percent on each operand
    bf16 = (x.bfloat16() @ w.detach().bfloat16().T).float()
    rel = ((out.float() - bf16).norm() / bf16.norm()).item()
    assert 1e-3 < rel < 0.06, rel


def test_fp8_head_is_used_for_training_and_bf16_for_evaluation():
    torch.manual_seed(0)
    head = T.LossHead(128, 256, 30.0, 7.5, precision="fp8")
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.05)
    x = torch.randn(1, 32, 128)
    emulated, _, _ = fp8_emulated(T.norm(x[0]), head.lm_head.weight, torch.zeros(32, 256))
    assert_close(head.train().logits(x)[0].float(), 30 * torch.sigmoid(emulated / 7.5), rtol=2 ** -7, atol=2e-2)
    bf16 = (T.norm(x).bfloat16() @ head.lm_head.weight.bfloat16().T)
    assert torch.equal(head.eval().logits(x), 30 * torch.sigmoid(bf16 / 7.5))


def test_the_residual_stream_stays_in_bf16_with_gpu_dtypes():
    # Every scalar multiplied into the stream must be 0-dim (or bf16): a 1-element fp32 vector would
    # promote the whole stream, and with it every matmul, to fp32.
    args = small_args()
    model = T.cast_for_device(randomized_model(args), torch.device("cuda"))
    tokens = tokens_with_documents(512, [0, 100])
    masks = T.build_masks(tokens, T.layer_windows(args, (1, 3)), False, args.window_block)
    seen = set()
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    with torch.no_grad():
        assert model.hidden(tokens, masks).dtype == torch.bfloat16
    assert seen == {torch.bfloat16}


def test_gpu_parameter_dtypes_are_record_44s():
    args = T.parse_args(["--preset=speedrun", "--num_layers=4", "--no_attention_layers=0",
                         "--long_window_layers=3", "--backout_layer=2", "--num_value_embeds=1"], True)
    with torch.device("meta"):
        model = T.cast_for_device(T.GPT(args, "fp8"), torch.device("cuda"))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    bf16 = sorted(n for n, d in dtypes.items() if d == torch.bfloat16)
    assert bf16 == sorted(["embed.weight", "value_embeds.0.weight", "head.lm_head.weight", "smear_gate.weight",
                           "blocks.1.attn.gate.weight", "blocks.2.attn.gate.weight", "blocks.3.attn.gate.weight"])
    assert dtypes["blocks.1.attn.qkvo"] == dtypes["blocks.1.mlp.fc.weight"] == dtypes["skip_gates"] == torch.float32


# --- config -----------------------------------------------------------------------------------

def test_config_overrides_and_errors():
    args = T.parse_args(["--preset=smoke", "--num_iterations=7", "--compile", "false", "--embed_lr=0.5"], False)
    assert (args.num_iterations, args.compile, args.embed_lr, args.preset) == (7, False, 0.5, "smoke")
    assert T.parse_args([], cuda_available=True).preset == "speedrun"
    assert T.parse_args([], cuda_available=False).preset == "smoke"
    errors = [
        (["--num_iteration=3"], "unknown flag --num_iteration;.*--num_iterations"),
        (["--num_iterations=abc"], "--num_iterations=abc: expected int"),
        (["--compile=maybe"], "--compile=maybe: expected a boolean"),
        (["--preset=fast"], "unknown preset"),
        (["--batch_tokens=1000", "--micro_batch_tokens=512"], "multiple of --micro_batch_tokens"),
        (["--no_attention_layers=0,x"], "--no_attention_layers=0,x: expected comma-separated integers"),
        (["--long_window_layers=3,6"], "--long_window_layers: layer 6 is not in 0..5"),
        (["--no_attention_layers=0,4"], "value embedding 0 would feed no layer with attention"),
        (["--window_schedule="], "--window_schedule=: expected positive block counts"),
        (["--extension_steps=30"], "--extension_steps=30 must be less than --num_iterations=30"),
        (["--save_every=3"], "--save_every=3 must be a multiple of --adam_every=2"),
        (["--attention=fast"], "--attention=fast: choose auto, flex, sdpa"),
        (["--micro_batch_tokens=500", "--batch_tokens=2000"], "--micro_batch_tokens=500 must be a multiple of "
                                                              "--window_block=64"),
        (["--head_dim=18", "--model_dim=72"], "--head_dim=18 must be a multiple of 4"),
    ]
    for argv, message in errors:
        with pytest.raises(T.ConfigError, match=message):
            T.parse_args(["--preset=smoke", *argv], False)


def test_training_with_flex_on_cpu_is_refused_and_evaluation_allowed():
    args = T.parse_args(["--preset=smoke", "--attention=flex"], False)
    with pytest.raises(T.ConfigError, match="no FlexAttention backward on CPU"):
        T.resolve_attention(args, torch.device("cpu"))
    assert T.resolve_attention(args, torch.device("cpu"), training=False) == "flex"
    assert T.resolve_attention(small_args(), torch.device("cpu")) == "sdpa"
    assert T.resolve_attention(small_args(), torch.device("cuda")) == "flex"


def test_world_size_that_cannot_split_the_batch_is_an_error():
    args = small_args()
    chunks = args.batch_tokens // args.micro_batch_tokens
    assert T.check_world_size(args, 1) == chunks
    assert T.check_world_size(args, 2) == chunks // 2
    with pytest.raises(T.ConfigError, match="world size 3 cannot split the batch"):
        T.check_world_size(args, 3)
    speedrun = T.Hyperparameters()
    for world_size in (1, 2, 4, 8):
        assert T.check_world_size(speedrun, world_size) * world_size * speedrun.micro_batch_tokens \
            == speedrun.batch_tokens
    with pytest.raises(T.ConfigError, match="a smaller --micro_batch_tokens makes more"):
        T.check_world_size(speedrun, 16)
    two_nodes = T.parse_args(["--preset=speedrun", f"--micro_batch_tokens={speedrun.micro_batch_tokens // 2}",
                              "--val_seq_len=65536"], True)
    assert T.check_world_size(two_nodes, 16) == 1

"""Model pieces: the two attention paths, causality within documents, config parsing, schedules."""

import pytest
import torch
from torch.testing import assert_close

import train_gpt as T


def tokens_with_documents(length: int, bos_positions, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, T.BOS_ID, (length,), generator=g)
    tokens[list(bos_positions)] = T.BOS_ID
    return tokens


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [128, 256, 384])
def test_flex_attention_and_sdpa_paths_agree(window):
    length, heads, dim = 512, 2, 32
    docs = T.document_ids(tokens_with_documents(length, [0, 100, 101, 300]), T.BOS_ID)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, length, dim, generator=g) for _ in range(3))
    dense = T.attention(q, k, v, T.dense_attention_mask(docs, window), scale=dim ** -0.5)
    flex = T.attention(q, k, v, T.flex_block_mask(docs, window, 128), scale=dim ** -0.5)
    assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_dense_mask_is_causal_windowed_and_document_local():
    docs = T.document_ids(tokens_with_documents(12, [0, 5]), T.BOS_ID)
    mask = T.dense_attention_mask(docs, window=3)
    for q in range(12):
        for k in range(12):
            same_doc = (q < 5) == (k < 5)
            assert mask[q, k] == (k <= q and q - k < 3 and same_doc), (q, k)


def small_model(num_layers=4):
    args = T.Hyperparameters(**{**T.PRESETS["smoke"], "num_layers": num_layers, "model_dim": 64, "head_dim": 16,
                                 "window_min": 128, "window_max": 256})
    torch.manual_seed(0)
    model = T.GPT(args)
    with torch.no_grad():  # zero-initialised projections would hide any leak: give every weight a value
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval(), args


def per_token_losses(model, args, tokens, window):
    inputs, targets = tokens[:-1], tokens[1:]
    masks = T.build_masks(inputs, T.layer_windows(args, window), args)
    with torch.no_grad():
        return model(inputs, targets, masks, reduction="none")


def test_no_position_sees_the_future():
    model, args = small_model()
    tokens = tokens_with_documents(301, [0, 150])
    base = per_token_losses(model, args, tokens, 256)
    changed = tokens.clone()
    changed[200] = (changed[200] + 1) % T.BOS_ID
    after = per_token_losses(model, args, changed, 256)
    # loss i predicts token i+1 from tokens <= i: positions before 199 must not move
    assert torch.equal(after[:199], base[:199])
    assert not torch.equal(after[199:], base[199:])


def test_no_position_sees_another_document():
    model, args = small_model()
    tokens = tokens_with_documents(301, [0, 150])
    base = per_token_losses(model, args, tokens, 256)
    changed = tokens.clone()
    changed[20:140] = (changed[20:140] + 7) % T.BOS_ID  # rewrite most of the first document
    after = per_token_losses(model, args, changed, 256)
    # losses from the second document's BOS (input 150) on depend only on that document
    assert torch.equal(after[150:], base[150:])
    assert not torch.equal(after[:149], base[:149])


def test_layer_windows_and_schedule():
    args = T.Hyperparameters()
    assert T.long_window(0, args) == args.window_min
    assert T.long_window(args.num_iterations, args) == args.window_max
    windows = [T.long_window(s, args) for s in range(args.num_iterations + 1)]
    assert windows == sorted(windows) and all(w % args.window_block == 0 for w in windows)
    layers = T.layer_windows(args, 1024)
    assert layers[0] == 1024 and layers[-1] == 1024 and layers[1] == 512
    assert T.lr_multiplier(0, args) == 1.0
    assert T.lr_multiplier(args.num_iterations, args) == pytest.approx(args.final_lr_frac)
    assert T.muon_momentum(0, args) == args.muon_momentum_start
    assert T.muon_momentum(10_000, args) == args.muon_momentum_end


def test_speedrun_model_shape():
    args = T.Hyperparameters()
    assert T.padded_vocab(args.vocab_size) == 50304
    with torch.device("meta"):
        model = T.GPT(args)
    assert model.head.lm_head.weight.shape == (50304, 768)
    assert model.blocks[0].attn.num_heads == 6 and model.blocks[0].attn.head_dim == 128


def test_config_overrides_and_errors():
    args = T.parse_args(["--preset=smoke", "--num_iterations=7", "--compile", "false", "--embed_lr=0.5"], False)
    assert (args.num_iterations, args.compile, args.embed_lr, args.preset) == (7, False, 0.5, "smoke")
    assert T.parse_args([], cuda_available=True).preset == "speedrun"
    assert T.parse_args([], cuda_available=False).preset == "smoke"
    with pytest.raises(T.ConfigError, match="unknown flag --num_iteration;.*--num_iterations"):
        T.parse_args(["--num_iteration=3"], False)
    with pytest.raises(T.ConfigError, match="--num_iterations=abc: expected int"):
        T.parse_args(["--num_iterations=abc"], False)
    with pytest.raises(T.ConfigError, match="--compile=maybe: expected a boolean"):
        T.parse_args(["--compile=maybe"], False)
    with pytest.raises(T.ConfigError, match="unknown preset"):
        T.parse_args(["--preset=fast"], False)
    with pytest.raises(T.ConfigError, match="multiple of --micro_batch_tokens"):
        T.parse_args(["--batch_tokens=1000", "--micro_batch_tokens=512"], False)


def test_world_size_that_cannot_split_the_batch_is_an_error():
    args = T.parse_args(["--preset=smoke"], False)
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
    two_nodes = T.parse_args(["--preset=speedrun", f"--micro_batch_tokens={speedrun.micro_batch_tokens // 2}"], True)
    assert T.check_world_size(two_nodes, 16) == 1

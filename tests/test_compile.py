"""The compiled structure of the CUDA path, checked on CPU: graphs per block over the whole window
schedule, and gradient hooks firing during backward under per-block compilation."""

import logging
import warnings

import pytest
import torch

import train_gpt as T


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo keeps compiled graphs per code object for the whole process: start and end each test clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphCounter:
    """A dynamo backend that runs graphs eagerly and records which block ran which graph."""

    def __init__(self):
        self.graphs = 0
        self.current = None
        self.used: dict = {}

    def __call__(self, gm, example_inputs):
        graph = self.graphs
        self.graphs += 1

        def run(*args):
            self.used.setdefault(self.current, set()).add(graph)
            return gm.forward(*args)
        return run


@pytest.mark.slow
def test_each_block_and_the_head_compile_once_per_sequence_length_over_the_whole_schedule():
    # The speedrun's layout, windows, YaRN and schedule at reduced width and sequence lengths. Windows and
    # documents are tensors, so graphs depend only on the structure and the two sequence lengths: short
    # sequences (CPU FlexAttention materialises every score) show the same graphs as the real ones.
    args = T.parse_args(["--preset=speedrun", "--model_dim=32", "--head_dim=32", "--micro_batch_tokens=1024",
                         "--batch_tokens=1024", "--val_seq_len=1536", "--val_tokens=1536"], True)
    torch.manual_seed(0)
    model = T.GPT(args)
    counter = GraphCounter()
    T.compile_model(model, backend=counter)
    for i, module in enumerate(model.blocks):
        module.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "current", f"block {i}"))
    model.head.register_forward_pre_hook(lambda m, a: setattr(counter, "current", "head"))

    # Every window pair training and validation use, in schedule order, with YaRN applied on the way.
    val_steps = [s for s in range(0, args.num_iterations, args.val_loss_every)] + [args.num_iterations]
    calls = []
    for step in range(args.num_iterations + 1):
        if step in val_steps:
            calls.append((step, "val", T.attention_windows(step, args, step == args.num_iterations)))
        if step < args.num_iterations:
            calls.append((step, "train", T.attention_windows(step, args)))
    distinct = [c for k, c in enumerate(calls) if c[1:] not in [d[1:] for d in calls[:k]]]
    assert {w for _, mode, w in distinct if mode == "train"} == {(1, 3), (3, 7), (5, 11), (6, 13)}
    assert {w for _, mode, w in distinct if mode == "val"} == {(1, 3), (3, 7), (5, 11), (6, 20)}

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n, (step, mode, windows) in enumerate(distinct):
                model.rotary.set_window(T.attention_windows(step, args)[1])
                length = args.val_seq_len if mode == "val" else args.micro_batch_tokens
                tokens = torch.randint(0, T.BOS_ID, (length + 1,), generator=torch.Generator().manual_seed(n))
                tokens[torch.randint(0, length, (length // 400,), generator=torch.Generator().manual_seed(n))] = T.BOS_ID
                tokens[0] = T.BOS_ID  # a different document layout every call
                model.train(mode == "train")
                masks = T.build_masks(tokens[:-1], T.layer_windows(args, windows), True, args.window_block)
                loss = model(tokens[:-1], tokens[1:], masks)
                assert torch.isfinite(loss)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)

    limit = [m for m in messages if "recompile_limit" in m or "cache_size_limit" in m]
    assert limit == [], limit
    unfused = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert unfused == [], unfused
    # Each block and the head ran exactly two graphs: one for training, one for validation length.
    active = [f"block {i}" for i, b in enumerate(model.blocks) if b.active]
    assert sorted(counter.used) == sorted(active + ["head"])
    assert {name: len(graphs) for name, graphs in counter.used.items()} == {name: 2 for name in active + ["head"]}
    # Blocks of the same structure share graphs: attention with or without value embeddings, MLP only.
    assert counter.graphs == 3 * 2 + 2, counter.graphs


@pytest.mark.slow
def test_gradient_hooks_fire_during_backward_with_per_block_compile():
    args = T.parse_args(["--preset=smoke"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    T.compile_model(model, backend="aot_eager")  # the CUDA structure, without generating kernels
    events = []
    active = [i for i, b in enumerate(model.blocks) if b.active]
    def mark_input(i):  # fires when the gradient of the block's input is complete: its backward is done
        def hook(module, inputs):
            inputs[0].register_hook(lambda g: events.append(f"block {i} backward done"))
        return hook

    for i in active:
        model.blocks[i].register_forward_pre_hook(mark_input(i))
    watched = {"lm_head": model.head.lm_head.weight, "embed": model.embed.weight,
               **{f"block {i} fc": model.blocks[i].mlp.fc.weight for i in active}}
    for name, p in watched.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"{name} grad ready"))
    with torch.no_grad():  # non-zero projections so every block gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    inputs, targets = T.SyntheticLoader(args, env).next_batch()[0]
    masks = T.build_masks(inputs, T.layer_windows(args, (1, 3)), False, args.window_block)
    model(inputs, targets, masks).backward()

    order = {e: i for i, e in enumerate(events)}
    # The lm_head's reduce-scatter could start before any block has run its backward ...
    assert order["lm_head grad ready"] < order[f"block {active[-1]} backward done"], events
    # ... and each block's parameters are ready before the earlier blocks' backward is done.
    for earlier, later in zip(active, active[1:]):
        assert order[f"block {later} fc grad ready"] < order[f"block {earlier} backward done"], events
    assert events[-1] == "embed grad ready", events

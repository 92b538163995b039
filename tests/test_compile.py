"""The compiled structure of the CUDA path, checked on CPU: graphs per layer, stem, final mix and loss chunk
over the whole stage schedule, and gradient hooks firing during backward under per-layer compilation."""

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
    """A dynamo backend that runs graphs eagerly and records which part of the model ran which graph."""

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

    def naming(self, name: str, fn):
        """fn, telling the counter that `name` runs the graphs it calls."""
        def call(*args, **kwargs):
            self.current = name
            return fn(*args, **kwargs)
        return call


def speedrun_calls(args: T.Hyperparameters) -> list[tuple[str, int, tuple[int, int], torch.Tensor | None]]:
    """(mode, sequence length, windows, MTP weights) of every distinct call the run makes: each step's
    training micro-batches in schedule order, and the validations, with the final one's longer window. The
    MTP weights change every step, but reach the graphs as a tensor: calls differ by their count only."""
    schedule = T.Schedule(args)
    calls = []
    for step in range(args.num_iterations + 1):
        if step % args.val_loss_every == 0 or step == args.num_iterations:
            calls.append(("val", args.val_seq_len, schedule.windows(step, step == args.num_iterations), None))
        if step < args.num_iterations:
            stage = schedule.stage(step)
            calls.append(("train", stage.batch_tokens // args.micro_batches, schedule.windows(step),
                          schedule.mtp_weights(step)))
    kinds = [(mode, length, windows, None if mtp is None else len(mtp)) for mode, length, windows, mtp in calls]
    return [c for k, c in enumerate(calls) if kinds[k] not in kinds[:k]]


@pytest.mark.slow
def test_each_layer_compiles_once_per_sequence_length_over_the_whole_schedule():
    # The speedrun's layout, stages, windows, YaRN and multi-token weights at reduced width and sequence
    # lengths. Windows, documents, rotary tables and the attention scale are tensors, so graphs depend on the
    # structure and the sequence lengths only: short sequences show the same graphs as the real ones.
    args = T.parse_args(["--preset=speedrun", "--model_dim=64", "--head_dim=32", "--micro_batches=1",
                         "--stage_batch_tokens=512,1024,1536", "--stage_max_seq_len=512,1024,1536",
                         "--val_seq_len=2048", "--val_tokens=2048", "--bigram_vocab_size=4096"], True)
    torch.manual_seed(0)
    model = T.GPT(args)
    counter = GraphCounter()
    T.compile_model(model, backend=counter)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "current", f"layer {i}"))
    model.stem = counter.naming("stem", model.stem)
    model.head_mix = counter.naming("head mix", model.head_mix)
    model.mtp_chunk = counter.naming("loss chunk", model.mtp_chunk)

    calls = speedrun_calls(args)
    train_windows = {w for mode, _, w, _ in calls if mode == "train"}
    assert train_windows == {(1, 3), (3, 7), (5, 11), (6, 13)}
    assert {w for mode, _, w, _ in calls if mode == "val"} == train_windows - {(6, 13)} | {(6, 20)}
    assert {len(m) for mode, _, _, m in calls if mode == "train"} == {1, 2, 3}  # the MTP weights shrink

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        # no_grad: FlexAttention has no backward on CPU (the graphs' inputs are the same with gradients)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n, (mode, length, windows, mtp) in enumerate(calls):
                model.rotary.set_window(windows[1])
                tokens = torch.randint(0, T.BOS_ID, (length + 1,), generator=torch.Generator().manual_seed(n))
                tokens[torch.randint(0, length, (length // 200,), generator=torch.Generator().manual_seed(n))] = T.BOS_ID
                tokens[0] = T.BOS_ID  # a different document layout every call
                model.train(mode == "train")
                masks = T.build_masks(tokens[:-1], model.plans, windows, args.window_block, True)
                if mode == "train":
                    loss = model(tokens[:-1], tokens[1:], masks, windows, torch.tensor(mtp), loss_scale=1.0)
                else:
                    loss = model(tokens[:-1], tokens[1:], masks, windows)
                assert torch.isfinite(loss)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)

    limit = [m for m in messages if "recompile_limit" in m or "cache_size_limit" in m]
    assert limit == [], limit
    unfused = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert unfused == [], unfused
    print({name: len(graphs) for name, graphs in counter.used.items()}, counter.graphs)
    # Every layer, the stem and the final mix ran one graph per sequence length: the three stages' and the
    # validation's.
    layers = [f"layer {i}" for i in range(len(model.blocks))]
    assert {name: len(graphs) for name, graphs in counter.used.items() if name != "loss chunk"} == \
        {name: 4 for name in layers + ["stem", "head mix"]}
    assert counter.graphs == 4 * (len(layers) + 2) + len(counter.used["loss chunk"])


@pytest.mark.slow
def test_gradient_hooks_fire_during_backward_with_per_layer_compile():
    args = T.parse_args(["--preset=smoke"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    T.compile_model(model, backend="aot_eager")  # the CUDA structure, without generating kernels
    events = []
    layers = range(len(model.blocks))

    def mark_input(i):  # fires when the gradient of the layer's input is complete: its backward is done
        def hook(module, inputs):
            inputs[0].register_hook(lambda g: events.append(f"layer {i} backward done"))
        return hook

    for i in layers:
        model.blocks[i].register_forward_pre_hook(mark_input(i))
    watched = {"lm_head": model.lm_head, "embed": model.embed.weight,
               **{f"layer {i} fc": model.blocks[i].mlp.fc for i in layers}}
    for name, p in watched.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"{name} grad ready"))
    with torch.no_grad():  # non-zero projections so every layer gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    schedule = T.Schedule(args)
    inputs, targets = T.SyntheticLoader(args, env).next_batch(0)[0]
    masks = T.build_masks(inputs, model.plans, schedule.windows(0), args.window_block, False)
    model(inputs, targets, masks, schedule.windows(0), torch.tensor(schedule.mtp_weights(0)), loss_scale=1.0).backward()

    order = {e: i for i, e in enumerate(events)}
    # The lm_head's reduce-scatter could start before any layer has run its backward ...
    assert order["lm_head grad ready"] < order[f"layer {layers[-1]} backward done"], events
    # ... and each layer's parameters are ready before the earlier layers' backward is done (MUDD mixes
    # earlier states into later layers, so a layer's backward completes only after its consumers').
    for earlier, later in zip(layers, layers[1:]):
        assert order[f"layer {later} fc grad ready"] < order[f"layer {earlier} backward done"], events
    assert events[-1] == "embed grad ready", events

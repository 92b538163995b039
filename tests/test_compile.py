"""The compiled structure of the CUDA path, checked on CPU: gradient hooks firing during backward under
per-layer compilation. The graphs compiled over the whole schedule (4 per layer, stem and final mix, 3 for
the loss chunk, under dynamo's limit) are counted by tests/test_preflight.py on the speedrun preset."""

import pytest
import torch

import train_gpt as T


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo keeps compiled graphs per code object for the whole process: start and end each test clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_gradient_hooks_fire_during_backward_with_per_layer_compile():
    args = T.parse_args(["--preset=smoke"], False)
    env = T.DistEnv(0, 0, 1, torch.device("cpu"))
    model = T.build_model(args, env)
    T.compile_model(model, backend="aot_eager")  # the CUDA structure, without generating kernels
    events = []
    # the layers that run an MLP, from the model's own plan: record #92's removed layer (7) runs none
    layers = [plan.index for plan in model.plans if not plan.removed]
    assert 0 < len(layers) < len(model.blocks)
    assert all((model.blocks[i].mlp is not None) == (i in layers) for i in range(len(model.blocks)))

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
    model(inputs, targets, masks, torch.tensor(schedule.mtp_weights(0)), loss_scale=1.0).backward()

    order = {e: i for i, e in enumerate(events)}
    # The lm_head's reduce-scatter could start before any layer has run its backward ...
    assert order["lm_head grad ready"] < order[f"layer {layers[-1]} backward done"], events
    # ... and each layer's parameters are ready before the earlier layers' backward is done (MUDD mixes
    # earlier states into later layers, so a layer's backward completes only after its consumers').
    for earlier, later in zip(layers, layers[1:]):
        assert order[f"layer {later} fc grad ready"] < order[f"layer {earlier} backward done"], events
    assert events[-1] == "embed grad ready", events

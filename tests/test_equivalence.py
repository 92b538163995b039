"""Runs that must train the same model: at world sizes 1, 2 and 4, resumed from a checkpoint, across two
nodes, and with or without the untimed warmup. All read the session's SHORT runs (under pytest-xdist this
file runs on one worker, which makes each of them once)."""

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt as T

from conftest import REPO, SHORT, SMOKE89, TRAIN, communicate_or_fail, cpu_env, kill_tree, train_at, val_losses


@pytest.mark.slow
def test_the_untimed_warmup_leaves_model_optimizers_and_data_as_they_were(short_run, tmp_path):
    # The warmup trains two steps (the second steps Adam) and validates, then restores everything: the
    # run must then be the same run as one without warmup, to the last bit of every final weight.
    run = short_run(1)
    train_at(1, *SHORT, "--warmup_steps=2", "--save_final=true", f"--logs_dir={tmp_path}",
             f"--checkpoint_dir={tmp_path}", "--run_id=warm")
    warm = (tmp_path / "warm.txt").read_text()
    assert val_losses(warm) == run.val_losses
    weights = torch.load(tmp_path / "warm/final/model.pt", weights_only=True)
    reference = torch.load(run.checkpoint_dir / run.run_id / "final/model.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for name, value in reference.items():  # tensors, and the rotary's window state
        assert torch.equal(weights[name], value) if isinstance(value, torch.Tensor) else weights[name] == value, name


@pytest.mark.slow
def test_world_sizes_1_2_4_reach_the_same_val_loss(short_run):
    # Same tokens per step at every world size; only the order of floating-point sums differs. In the
    # first steps some gradients are zero in exact arithmetic (the zero-initialised blocks make the stream
    # a multiple of the embedding, and the final norm ignores scale), and Adam can turn their rounding
    # noise into full-size steps, so runs at different world sizes agree closely but not to the last bit.
    # A wrong share of the data moves the loss by far more (checked: every rank training on the step's first
    # micro-batches). Gradient scale is no such check: Adam and NorMuon's updates do not depend on it.
    reference = short_run(1).val_losses
    assert sorted(reference) == [0, 4, 8]
    for world_size in (2, 4):
        run = short_run(world_size)
        assert f"world_size: {world_size}" in run.log
        assert run.val_losses.keys() == reference.keys()
        assert run.val_losses[0] == reference[0]
        for step in reference:
            assert run.val_losses[step] == pytest.approx(reference[step], rel=1e-3), (world_size, run.val_losses,
                                                                                      reference)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_reaches_the_val_losses_of_an_uninterrupted_run(short_run, tmp_path, world_size):
    full_run = short_run(world_size)
    full = full_run.val_losses
    assert sorted(full) == [0, 4, 8]
    checkpoint = full_run.checkpoint(4)
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(
        ["meta.json", "model.pt"] + [f"rank_{r}.pt" for r in range(world_size)])

    train_at(world_size, *SHORT, f"--logs_dir={tmp_path}", f"--resume={checkpoint}", "--run_id=resumed")
    resumed_log = (tmp_path / "resumed.txt").read_text()
    assert f"resumed from {checkpoint} at step 4" in resumed_log
    resumed = val_losses(resumed_log)
    assert sorted(resumed) == [4, 8]
    print(f"world size {world_size}: uninterrupted {full}, resumed {resumed}")
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=0), (step, full, resumed)
    assert full[8] < full[4]  # the runs really trained after the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["record89", "smoke"])
def test_a_resumed_fp8_run_ends_with_the_same_weights_and_scales(tmp_path, monkeypatch, recipe):
    # FP8's delayed scales are run state: record #89's down-projection scales (the activation's, set by each
    # forward, and the weight's, moved after each step) and record #92's MLP scales (the weights', the relu^2
    # output's and the pre-activation gradient's) must come back from the checkpoint, or the FP8 copies the forward
    # reads differ. Their exact refreshes are shortened here so that the resumed steps are delayed ones. FP8 runs on
    # a CPU through torch._scaled_mm when asked for, whose CPU kernel is slow: one micro-batch of 64 tokens a step.
    monkeypatch.setattr(T, "DOWN_EXACT_STEPS", 2)
    monkeypatch.setattr(T, "FULL_EXACT_REFRESHES", 2)
    flags = ["--num_iterations=6", "--extension_steps=1", "--micro_batches=1", "--stage_batch_tokens=64,64,64",
             "--extension_batch_tokens=64", "--stage_max_seq_len=64,64,64", "--val_loss_every=0", "--val_tokens=512",
             "--val_seq_len=512", "--warmup_steps=0", "--mlp_precision=fp8", f"--logs_dir={tmp_path}",
             f"--checkpoint_dir={tmp_path}", "--save_final=true"]
    if recipe == "record89":  # the record89 preset's smoke-sized model, without the extension's own batch
        flags = [*SMOKE89, *(flag for flag in flags if not flag.startswith("--extension_batch_tokens"))]
    train_at(1, *flags, "--save_every=4", "--run_id=full")
    log = (tmp_path / "full.txt").read_text()
    full = torch.load(tmp_path / "full/final/model.pt", weights_only=True)
    if recipe == "record89":
        assert "mlp down-projection: fp8 (delayed scaling)" in log
        scales = [k for k in full if ".down_" in k]
        expected = 3 * 6  # activation, weight and next weight scale in each of the 6 layers
    else:
        assert "mlp down-projection: fp8 (record #92: forward and backward, delayed scaling)" in log
        scales = [k for k in full if ".fp8_" in k]
        mlps = 10 + 1  # record #92's plan: ten layers' MLPs (layer 7 removed) and layer 8's parallel MLP
        expected = 6 * mlps  # up and down weights' (each the scale and the next), relu^2 output's, dpre's
    assert len(scales) == expected and len({float(full[k]) for k in scales}) > expected // 3  # moved, per layer
    train_at(1, *flags, f"--resume={tmp_path / 'full/step_000004'}", "--run_id=resumed")
    resumed = torch.load(tmp_path / "resumed/final/model.pt", weights_only=True)
    assert full.keys() == resumed.keys()
    for name, value in full.items():
        assert torch.equal(resumed[name], value) if isinstance(value, torch.Tensor) else resumed[name] == value, name


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a rendezvous that binds it after this socket lets it
    go. A port from the range (bind to port 0) could meanwhile become the local end of any connection: other
    tests' gloo ranks make many. Below the range only a server that asks for that very port can take it."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    for port in random.Random().sample(range(max(1024, first_ephemeral // 2), first_ephemeral), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port among 100 tried below the ephemeral range (from {first_ephemeral})")


@pytest.mark.slow
def test_two_nodes_match_one_node_with_two_ranks(short_run, tmp_path):
    args = [str(TRAIN), *SHORT, f"--logs_dir={tmp_path}"]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=two-nodes",
                               *args, "--run_id=two_nodes"], cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [communicate_or_fail(node, timeout=600) for node in nodes]
    finally:  # a node that failed or ran past its timeout leaves no process behind
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    two_nodes = (tmp_path / "two_nodes.txt").read_text()
    assert "world_size: 2" in two_nodes
    assert val_losses(two_nodes) == short_run(2).val_losses

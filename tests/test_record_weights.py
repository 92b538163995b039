"""tools/record_weights.py: record #85's state_dict <-> ours, both ways, exactly; and its command line. The
record's layout is written out here from its code: qk_bank holds, per attention layer in order, the head
pairs' query blocks then their key blocks; vo_bank the value then the output matrix; mlp_bank[layer] the
up-projection (fc) and the down-projection (proj); each bank padded (qk and vo to multiples of 8 matrices, mlp
to 12 layers)."""

import json
import sys

import pytest
import torch

import train_gpt as T
from conftest import REPO, in_process

sys.path.insert(0, str(REPO / "tools"))
import record_weights as W  # noqa: E402

SMOKE = T.parse_args(["--preset=smoke"], False)
SMOKE_FLAGS = ["--", "--preset=smoke"]


def random_state(args, seed=0):
    torch.manual_seed(seed)
    model = T.GPT(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.state_dict()


def record_like(args, seed=1):
    """A record-layout state dict for this architecture, with values everywhere (the padding included)."""
    record = W.ours_to_record(random_state(args, seed), args)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) if k.endswith("bank") else v for k, v in record.items()}


def test_the_record_layout_maps_to_our_layers():
    heads = SMOKE.model_dim // SMOKE.head_dim  # 4
    record = record_like(SMOKE)
    ours = W.record_to_ours(record, SMOKE)
    attention_layers = [0, 1, 2, 4, 5]  # the smoke plan: layer 3 has no attention
    for a, layer in enumerate(attention_layers):
        for j in range(heads):
            assert torch.equal(ours[f"blocks.{layer}.attn.qk"][j], record["_orig_mod.qk_bank"][heads * a + j])
        assert torch.equal(ours[f"blocks.{layer}.attn.vo"][0], record["_orig_mod.vo_bank"][2 * a])
        assert torch.equal(ours[f"blocks.{layer}.attn.vo"][1], record["_orig_mod.vo_bank"][2 * a + 1])
    for layer in range(6):
        assert torch.equal(ours[f"blocks.{layer}.mlp.fc"], record["_orig_mod.mlp_bank"][layer, 0])
        assert torch.equal(ours[f"blocks.{layer}.mlp.proj"], record["_orig_mod.mlp_bank"][layer, 1])
    assert torch.equal(ours["lm_head"], record["_orig_mod.lm_head.weight"])
    assert torch.equal(ours["mudd_gate_scale"], record["_orig_mod._mudd_gate_scale"])
    assert torch.equal(ours["bigram_signs"], record["_orig_mod.bigram_sign_table"])
    assert record["_orig_mod.qk_bank"].shape[0] == 24 and record["_orig_mod.vo_bank"].shape[0] == 16  # 20, 10 used
    assert record["_orig_mod.mlp_bank"].shape[0] == 12


def test_conversions_are_exact_inverses():
    ours = random_state(SMOKE)
    again = W.record_to_ours(W.ours_to_record(ours, SMOKE), SMOKE, step=SMOKE.num_iterations)
    for name, tensor in ours.items():
        if name.startswith("rotary."):
            continue
        assert torch.equal(again[name], tensor), name
    record = record_like(SMOKE)
    back = W.ours_to_record(W.record_to_ours(record, SMOKE), SMOKE, like=record)
    assert back.keys() == record.keys()
    assert all(torch.equal(back[k], record[k]) for k in record)
    # without `like`, only the padding is lost (zeros)
    plain = W.ours_to_record(W.record_to_ours(record, SMOKE), SMOKE)
    assert [k for k in record if not torch.equal(plain[k], record[k])] == [
        "_orig_mod.qk_bank", "_orig_mod.vo_bank", "_orig_mod.mlp_bank"]
    assert not plain["_orig_mod.qk_bank"][20:].any() and not plain["_orig_mod.mlp_bank"][6:].any()


def test_the_speedrun_model_has_the_records_parameters_in_use():
    # record #85 as rank 0 of 8: 643,751,335 parameters, 7,864,320 of them padding (4 of 64 qk blocks, 4 of 24
    # vo matrices, the 12th MLP): 635,887,015 in use, which is ours
    with torch.device("meta"):
        model = T.GPT(T.parse_args(["--preset=speedrun"], True))
    assert sum(p.numel() for p in model.parameters()) == 643_751_335 - 7_864_320 == 635_887_015
    padding = 4 * 256 * 768 + 4 * 768 * 768 + 2 * 3072 * 768
    assert padding == 7_864_320


def test_the_rotary_state_follows_the_schedule():
    state = W.rotary_state(SMOKE, SMOKE.num_iterations)
    assert state["_extra_state"]["window"] == 7  # the smoke extension's long window
    assert W.rotary_state(SMOKE, 0)["_extra_state"]["window"] == 2


def test_command_line_both_ways(tmp_path):
    record = record_like(SMOKE)
    torch.save({"model": record, "step": 30}, tmp_path / "state_step000030.pt")  # the record's checkpoint layout
    out = tmp_path / "final"
    proc = in_process(W.main, "to-ours", tmp_path / "state_step000030.pt", out, *SMOKE_FLAGS)
    assert proc.returncode == 0, proc.stderr
    model, args, info = T.load_final_weights(out, torch.device("cpu"))
    assert info["converted_from"].endswith("state_step000030.pt") and args.num_layers == 6
    ours = W.record_to_ours(record, SMOKE)
    for name, tensor in model.state_dict().items():
        if not name.startswith("rotary."):
            assert torch.equal(tensor, ours[name]), name
    back = in_process(W.main, "to-record", out, tmp_path / "back.pt")
    assert back.returncode == 0, back.stderr
    saved = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in W.ours_to_record(ours, SMOKE).items())
    # refusals, one line each
    again = in_process(W.main, "to-ours", tmp_path / "state_step000030.pt", out, *SMOKE_FLAGS)
    assert again.returncode == 2 and again.stderr.strip() == f"error: {out}: already exists; choose a new folder"
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    junk = in_process(W.main, "to-ours", tmp_path / "junk.pt", tmp_path / "f2", *SMOKE_FLAGS)
    assert junk.returncode == 2 and junk.stderr.startswith("error: ") and len(junk.stderr.strip().splitlines()) == 1
    partial = {k: v for k, v in record.items() if "mudd_w1" not in k}
    torch.save(partial, tmp_path / "partial.pt")
    missing = in_process(W.main, "to-ours", tmp_path / "partial.pt", tmp_path / "f3", *SMOKE_FLAGS)
    assert missing.returncode == 2 and "missing 'mudd_w1'" in missing.stderr
    assert not (tmp_path / "f2").exists() and not (tmp_path / "f3").exists()

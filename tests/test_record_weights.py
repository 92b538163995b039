"""tools/record_weights.py: record #89's (and #85's) state_dict <-> ours, both ways, exactly; and its command
line. The record's layout is written out here from its code: qk_bank holds, per attention layer in order, the
head pairs' query blocks then their key blocks; vo_bank the value then the output matrix; mlp_bank[layer] the
up-projection (fc) and the down-projection (proj); each bank padded (qk and vo to multiples of 8 matrices, mlp
to 12 layers); record #89's three FP8 scale vectors of the down-projections, one entry per MLP of mlp_bank."""

import datetime
import errno
import io
import os
import pickle
import sys
import zipfile

import pytest
import torch

import train_gpt as T
from conftest import SMOKE89, REPO, in_process, one_line_error

sys.path.insert(0, str(REPO / "tools"))
import record_weights as W  # noqa: E402

SMOKE = T.parse_args([*SMOKE89], False)
SMOKE_FLAGS = ["--", *SMOKE89]


def random_state(args, seed=0):
    torch.manual_seed(seed)
    model = T.GPT(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if ".down_" in name:  # the FP8 scales (record #89)
                b.copy_(torch.rand(()) + 0.5)
    return model.state_dict()


def padded_tensor(name: str) -> bool:
    return name.endswith("bank") or name.removeprefix(W.COMPILED_PREFIX) in W.DOWN_SCALES


def record_like(args, seed=1):
    """A record-layout state dict for this architecture, with values everywhere (the padding included)."""
    record = W.ours_to_record(random_state(args, seed), args)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) if padded_tensor(k) else v for k, v in record.items()}


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
    for theirs, mine in W.DOWN_SCALES.items():
        assert record[f"_orig_mod.{theirs}"].shape == (12,)
        assert all(ours[f"blocks.{layer}.mlp.{mine}"] == record[f"_orig_mod.{theirs}"][layer] for layer in range(6))


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
    # without `like`, only the padding is lost (zeros; ones for the scales, the record's initial values)
    plain = W.ours_to_record(W.record_to_ours(record, SMOKE), SMOKE)
    assert [k for k in record if not torch.equal(plain[k], record[k])] == [
        "_orig_mod.qk_bank", "_orig_mod.vo_bank", "_orig_mod.mlp_bank",
        *(f"_orig_mod.{name}" for name in W.DOWN_SCALES)]
    assert not plain["_orig_mod.qk_bank"][20:].any() and not plain["_orig_mod.mlp_bank"][6:].any()
    assert all((plain[f"_orig_mod.{name}"][6:] == 1).all() for name in W.DOWN_SCALES)


def test_record_85s_state_dict_converts_under_its_preset_and_is_named_under_the_speedrun_s():
    record85 = T.parse_args([*SMOKE89, "--mlp_down_fp8=false"], False)
    record = record_like(record85)
    assert not any(k.removeprefix(W.COMPILED_PREFIX) in W.DOWN_SCALES for k in record)
    ours = W.record_to_ours(record, record85)
    assert not any(".down_" in k for k in ours) and ours.keys() == T.GPT(record85).state_dict().keys()
    assert W.ours_to_record(ours, record85, like=record).keys() == record.keys()
    with pytest.raises(W.WeightsError, match=r"missing '_mlp_down_act_scales' \(expected shape \(6,\)\) \(record "
                                             r"#89's FP8 scales: a record #85 v3 state dict converts with `-- "
                                             r"--preset=record85`\); and 2 more key\(s\) wrong"):
        W.record_to_ours(record, SMOKE)


def test_the_speedrun_model_has_the_records_parameters_in_use():
    # record #85 as rank 0 of 8: 643,751,335 parameters, 7,864,320 of them padding (4 of 64 qk blocks, 4 of 24
    # vo matrices, the 12th MLP): 635,887,015 in use, which is ours
    with torch.device("meta"):
        model = T.GPT(T.parse_args(["--preset=record89"], True))
    assert sum(p.numel() for p in model.parameters()) == 643_751_335 - 7_864_320 == 635_887_015
    padding = 4 * 256 * 768 + 4 * 768 * 768 + 2 * 3072 * 768
    assert padding == 7_864_320


def test_the_rotary_state_follows_the_schedule():
    state = W.rotary_state(SMOKE, SMOKE.num_iterations)
    assert state["rotary._extra_state"]["window"] == 7  # the smoke extension's long window
    assert W.rotary_state(SMOKE, 0)["rotary._extra_state"]["window"] == 2


# Record #92's model at a test's size (its flags, narrow heads of 8 of 16 dims, the MLP as 2816 / 768 of the width).
RECORD92 = T.parse_args(["--preset=record89", *T.flags_of(T.RECORD92_MODEL), "--model_dim=96", "--head_dim=16",
                         "--narrow_dim=8", "--rotary_dims=8", "--mlp_hidden=352", "--vocab_size=2000",
                         "--bigram_vocab_size=4000", "--val_seq_len=256", "--stage_batch_tokens=2048,2048,2048",
                         "--window_block=32"], False)


def test_record_92s_compacted_banks_map_to_our_layers():
    # From record #92's code: _BANKC2_ORDER = narrow (attention-bank slots 0, 2, 5: layers 0, 2, 5) ++ dv64 (1, 7:
    # layers 1, 8) ++ wide (3, 9: layers 3, 10), 6 qk blocks and 2 vo matrices each, padded to 48 and 16; mlp_bank
    # slot i is layer i's MLP (7's never read), slot 11 layer 8's parallel MLP; ve_gate_bank's rows are the gates of
    # layers 1, 2, 8, 9, 10; every other tensor, mudd_w2g included, as it is. No record #89 FP8 scales.
    record = record_like(RECORD92)
    ours = W.record_to_ours(record, RECORD92)
    for slot, layer in enumerate((0, 2, 5, 1, 8, 3, 10)):
        assert torch.equal(ours[f"blocks.{layer}.attn.qk"], record[K + "qk_bank"][6 * slot:6 * slot + 6])
        assert torch.equal(ours[f"blocks.{layer}.attn.vo"], record[K + "vo_bank"][2 * slot:2 * slot + 2])
    assert record[K + "qk_bank"].shape == (48, 32, 96) and record[K + "vo_bank"].shape == (16, 96, 96)
    assert record[K + "mlp_bank"].shape == (12, 2, 352, 96)
    for layer in (*range(7), 8, 9, 10):
        assert torch.equal(ours[f"blocks.{layer}.mlp.fc"], record[K + "mlp_bank"][layer, 0])
        assert torch.equal(ours[f"blocks.{layer}.mlp.proj"], record[K + "mlp_bank"][layer, 1])
    assert torch.equal(ours["blocks.8.parallel_mlp.fc"], record[K + "mlp_bank"][11, 0])
    assert torch.equal(ours["blocks.8.parallel_mlp.proj"], record[K + "mlp_bank"][11, 1])
    assert not any(k.startswith("blocks.7.mlp") for k in ours)
    for theirs, mine in (("ve_gate_bank", "ve_gates"), ("value_embeds", "value_embeds"), ("mudd_w2g", "mudd_w2g"),
                         ("mudd_gate_w2", "mudd_gate_w2"), ("bigram_embed.weight", "bigram_embed.weight")):
        assert torch.equal(ours[mine], record[K + theirs]), theirs
    assert ours["ve_gates"].shape == (5, 6, 12) and ours["mudd_gate_w2"].shape == (2, 41, 64)
    assert not any(k.removeprefix(K) in W.DOWN_SCALES for k in record)
    assert all(ours[f"blocks.8.parallel_mlp.{mine}"] == 1 for mine in W.DOWN_SCALES.values())  # initial values
    assert {"rotary.angular_freq", "narrow_rotary.angular_freq"} <= set(ours)
    model = T.GPT(RECORD92)
    model.load_state_dict(ours)  # every key, every shape


def test_record_92s_conversions_are_exact_inverses():
    ours = random_state(RECORD92)
    again = W.record_to_ours(W.ours_to_record(ours, RECORD92), RECORD92, step=RECORD92.num_iterations)
    for name, tensor in ours.items():
        if name == "removed_mlp_sq":  # carried as a matrix of that squared norm: one rounding of the sum
            torch.testing.assert_close(again[name], tensor, rtol=1e-6, atol=0)
        elif not name.startswith(("rotary.", "narrow_rotary.")) and ".down_" not in name:
            assert torch.equal(again[name], tensor), name
    record = record_like(RECORD92)
    back = W.ours_to_record(W.record_to_ours(record, RECORD92), RECORD92, like=record)
    assert back.keys() == record.keys() and all(torch.equal(back[k], record[k]) for k in record)
    # without `like`, what only the record has is zero (the banks' padding), but for the removed layer's MLP slot: an
    # up-projection of the squared norm ours keeps of it (GPT.removed_mlp_sq, which the decontraction ship counts)
    plain = W.ours_to_record(W.record_to_ours(record, RECORD92), RECORD92)
    assert [k for k in record if not torch.equal(plain[k], record[k])] == [K + "qk_bank", K + "vo_bank", K + "mlp_bank"]
    removed = plain[K + "mlp_bank"][7].float()
    torch.testing.assert_close(removed[0].square().sum(), record[K + "mlp_bank"][7].float().square().sum(),
                               rtol=1e-5, atol=0)
    assert not removed[1].any() and torch.equal(plain[K + "mlp_bank"][8], record[K + "mlp_bank"][8])
    assert not plain[K + "qk_bank"][42:].any() and not plain[K + "vo_bank"][14:].any()


def test_the_narrow_rotary_state_follows_the_short_window():
    state = W.rotary_state(RECORD92, RECORD92.num_iterations)
    assert state["rotary._extra_state"]["window"] == 13 and state["narrow_rotary._extra_state"]["window"] == 6
    model = T.GPT(RECORD92)
    for s in range(RECORD92.num_iterations + 1):
        model.set_windows(T.Schedule(RECORD92).windows(s))
    for name, value in state.items():
        if name.endswith("_extra_state"):
            assert model.state_dict()[name] == value, name
        else:
            assert torch.equal(model.state_dict()[name], value), name


def test_a_rank_shard_of_a_sharded_ngram_table_is_refused_with_a_pointer_to_its_hook():
    record = record_like(RECORD92)
    record[K + "bigram_embed.weight"] = record[K + "bigram_embed.weight"][:500]
    with pytest.raises(W.WeightsError, match=r"'bigram_embed.weight' has shape \(500, 96\), expected \(4000, 96\): one "
                                             r"rank's shard of a sharded n-gram table\? \(convert_ngram_table"):
        W.record_to_ours(record, RECORD92)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A record-like state, its checkpoint file (the record's layout: key "model") and the final-weights
    folder that to-ours made of it."""
    folder = tmp_path_factory.mktemp("converted")
    record = record_like(SMOKE)
    torch.save({"model": record, "step": 30}, folder / "state_step000030.pt")
    out = folder / "final"
    proc = in_process(W.main, "to-ours", folder / "state_step000030.pt", out, *SMOKE_FLAGS)
    assert proc.returncode == 0, proc.stderr
    return record, folder / "state_step000030.pt", out


def test_command_line_both_ways(converted, tmp_path):
    record, source, out = converted
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
    again = in_process(W.main, "to-ours", source, out, *SMOKE_FLAGS)
    assert one_line_error(again) == f"error: {out}: already exists; choose a new folder"
    again = in_process(W.main, "to-record", out, tmp_path / "back.pt")
    assert one_line_error(again) == f"error: {tmp_path / 'back.pt'}: already exists; choose a new file"


LONG = "w" * 250  # a legal file name (255 bytes at most) once its suffix is on


@pytest.mark.parametrize("command", ["to-ours", "to-record"])
def test_a_long_legal_output_name_is_written(converted, tmp_path, command):
    """Issue 38 row 18: the writers' temporaries took the output's whole name: a legal 253-character one failed with
    "File name too long", naming the temporary."""
    _, source, folder = converted
    out = tmp_path / (LONG + (".pt" if command == "to-record" else ".fin"))
    proc = in_process(W.main, command, *((source, out, *SMOKE_FLAGS) if command == "to-ours" else (folder, out)))
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    T.write_file(tmp_path / (LONG + ".txt"), b"x")  # the trainer's writer itself, beside it
    assert (tmp_path / (LONG + ".txt")).read_bytes() == b"x" and len(list(tmp_path.iterdir())) == 2


# Files that to-ours refuses. Most are the record's state for the smoke model at a vocabulary of 512 (SMALL), edited:
# 1.2 MB in bf16. (Every tensor one value broadcast to its shape, stride 0, made smoke-sized files of a few kB; such a
# view is refused now, issue 53 row 8.)
K = W.COMPILED_PREFIX
SMALL = T.parse_args([*SMOKE89, "--vocab_size=512", "--bigram_vocab_size=512"], False)
SMALL_FLAGS = ["--", *SMOKE89, "--vocab_size=512", "--bigram_vocab_size=512"]


def tiny_record(dtype=torch.bfloat16) -> dict:
    return {K + name: torch.zeros(shape, dtype=dtype) for name, shape in W.record_shapes(SMALL).items()}


def saved(*edits, dtype=torch.bfloat16, wrap=None):
    """Writes tiny_record, edited in order (a key -> a value; None deletes it); `wrap` puts it in a checkpoint."""
    def make(path):
        state = tiny_record(dtype)
        for key, value in edits:
            if value is None:
                del state[key]
            else:
                state[key] = value
        torch.save(state if wrap is None else wrap(state), path)
    return make


def cast(name: str, dtype) -> tuple:
    return K + name, torch.zeros(W.record_shapes(SMALL)[name], dtype=dtype)


def shaped(name: str, *shape) -> tuple:
    return K + name, torch.zeros(shape)


def raw(data: bytes):
    return lambda path: path.write_bytes(data)


def truncated_zip(path):
    buffer = io.BytesIO()
    torch.save(tiny_record(), buffer)
    path.write_bytes(buffer.getvalue()[:len(buffer.getvalue()) // 2])


def zip_without_data_pkl(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("weights/notes.txt", "hello")


REFUSED = [  # id, the input file, to-ours's own flags, the fragments of its error line
    # #7: an integer or complex copy of a state was converted (into zeros, or real parts)
    ("int64_state", saved(dtype=torch.int64), [],
     ["'embed.weight' has dtype int64, expected a floating one (bfloat16, float16, float32 or float64)",
      "; and 22 more key(s) wrong"]),
    ("complex_state", saved(dtype=torch.complex64), [], ["'embed.weight' has dtype complex64, expected a floating"]),
    ("bf16_state_with_an_int32_tensor", saved(cast("scalars", torch.int32)), [],
     ["'scalars' has dtype int32, expected a floating one"]),
    ("bool_sign_table", saved(cast("bigram_sign_table", torch.bool)), [], ["'bigram_sign_table' has dtype bool"]),
    # #9: a key that is not a string
    ("int_key", saved((3, torch.zeros(1))), [], ["key 3 (int) is not a parameter name"]),
    ("bytes_key", saved((b"qk_bank", torch.zeros(1))), [], ["key b'qk_bank' (bytes) is not a parameter name"]),
    # #10 and #13: banks of the wrong rank or shape, named with both shapes
    ("mlp_bank_one_matrix_per_layer", saved(shaped("mlp_bank", 12, 1, 256, 64)), [],
     ["'mlp_bank' has shape (12, 1, 256, 64), expected (6 or more, 2, 256, 64)"]),
    ("qk_bank_0d", saved((K + "qk_bank", torch.tensor(1.0))), [],
     ["'qk_bank' has shape (), expected (20 or more, 32, 64)"]),
    ("qk_bank_wrong_head_dim", saved(shaped("qk_bank", 24, 24, 64)), [],
     ["'qk_bank' has shape (24, 24, 64), expected (20 or more, 32, 64)"]),
    ("qk_bank_too_few_rows", saved(shaped("qk_bank", 16, 32, 64)), [],
     ["'qk_bank' has shape (16, 32, 64), expected (20 or more, 32, 64)"]),
    ("vo_bank_wrong_shape", saved(shaped("vo_bank", 16, 64, 63)), [],
     ["'vo_bank' has shape (16, 64, 63), expected (10 or more, 64, 64)"]),
    ("lm_head_transposed", saved(shaped("lm_head.weight", 512, 64)), [],
     ["'lm_head.weight' has shape (512, 64), expected (64, 512)"]),
    # every tensor, and no other
    ("missing_key", saved((K + "mudd_w1", None), wrap=lambda state: {"model": state, "step": 30}), [],
     ["missing 'mudd_w1' (expected shape (2, 64, 64))"]),
    ("key_with_and_without_prefix", saved(("scalars", torch.zeros(14))), [],
     ["'scalars' is there twice, with and without '_orig_mod.'"]),
    # #14: not a PyTorch file (and no advice to use --trust), or a damaged one
    ("text_file", raw(b"hello, world\n"), [],
     ["not a PyTorch file (neither a zip archive, torch.save's format, nor its legacy pickle)"]),
    ("empty_file", raw(b""), [], ["not a PyTorch file (it is empty)"]),
    ("plain_pickle", raw(pickle.dumps({"embed.weight": 1.0}, protocol=4)), [],
     ["not a PyTorch file (neither a zip archive, torch.save's format, nor its legacy pickle)"]),
    ("zip_without_data_pkl", zip_without_data_pkl, [], ["not a PyTorch file (a zip archive without data.pkl)"]),
    ("truncated_zip", truncated_zip, [], ["a truncated or damaged zip archive, not a complete PyTorch file"]),
    # --trust is advised where the safe loader refused a Python object, and only there
    ("python_object", saved(wrap=lambda state: {"model": state, "saved": datetime.date(2025, 1, 1)}), [],
     ["the safe loader refused datetime.date", "--trust loads it, if you trust the file"]),
    # issue 38 row 11: sparse and meta tensors passed (a traceback later), NaN and inf weights too (then sample.py
    # tracebacked in multinomial, or printed "!!!!!" at temperature 0)
    ("sparse_tensor", saved((K + "lm_head.weight", torch.zeros(64, 512).to_sparse())), [],
     ["'lm_head.weight' is a sparse_coo tensor, not a dense one"]),
    ("meta_tensor", saved((K + "scalars", torch.empty(14, device="meta"))), [],
     ["'scalars' holds no values (a tensor of the meta device)"]),
    ("nan_weight", saved((K + "scalars", torch.tensor([float("nan")] + [0.0] * 13))), [],
     ["'scalars' holds 1 non-finite value(s) (NaN or inf)"]),
    ("inf_in_a_bank", saved((K + "qk_bank", torch.zeros(20, 32, 64).index_fill_(0, torch.tensor([3]), float("inf")))),
     [], ["'qk_bank' holds 2,048 non-finite value(s) (NaN or inf)"]),
    # #17: a step the schedule does not have
    ("negative_step", saved(), ["--step=-1"],
     ["error: --step=-1: the schedule's steps are 0 to --num_iterations=30"]),
    ("step_past_the_end", saved(), [f"--step={SMOKE.num_iterations + 1}"],
     ["error: --step=31: the schedule's steps are 0 to --num_iterations=30"]),
]


@pytest.mark.parametrize("make, flags, fragments", [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED])
def test_to_ours_refuses_in_one_line_and_writes_nothing(tmp_path, make, flags, fragments):
    make(tmp_path / "state.pt")
    proc = in_process(W.main, "to-ours", tmp_path / "state.pt", tmp_path / "out", *flags, *SMALL_FLAGS)
    line = one_line_error(proc, *fragments)
    assert line.startswith(f"error: {tmp_path / 'state.pt'}: ") or line.startswith("error: --step=")
    assert ("--trust" in line) == ("datetime" in line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_the_unedited_state_passes_the_checks():
    # the control for REFUSED: unedited, the file that those rows edit is the record's GPT for the SMALL config
    assert W.check_record_state(tiny_record(), SMALL).keys() == W.record_shapes(SMALL).keys()
    assert W.schedule_step(None, SMALL) == W.schedule_step(30, SMALL) == 30 and W.schedule_step(0, SMALL) == 0


def test_a_tensor_the_conversion_does_not_use_is_left_out_and_named(tmp_path):
    # (a buffer the record's file may hold: refusing it would refuse a real file for nothing)
    state = {**tiny_record(), K + "unknown": torch.zeros(2)}
    torch.save(state, tmp_path / "state.pt")
    proc = in_process(W.main, "to-ours", tmp_path / "state.pt", tmp_path / "out", *SMALL_FLAGS)
    assert proc.returncode == 0, proc.stderr
    assert f"note: 1 tensor(s) of {tmp_path / 'state.pt'} are not weights of train_gpt.py's model and were left " \
           f"out: 'unknown'" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.pt"]


def test_a_converted_state_that_does_not_fit_is_named(tmp_path):
    ours = W.record_to_ours(tiny_record(dtype=torch.float32), SMALL)
    ours["blocks.2.mlp.fc"] = torch.zeros(256, 63)
    with pytest.raises(W.WeightsError, match=r"1 shape mismatch\(es\): blocks.2.mlp.fc: checkpoint \(256, 63\), "
                                             r"model \(256, 64\)"):
        W.write_final_folder(ours, SMALL, tmp_path / "out", 30, "test")
    assert not any(tmp_path.iterdir())


class FullDisk:
    """os.write on a disk with `free` bytes left, then ENOSPC; or os.fsync failing (a file system that reports
    a lost write only then); or SIGTERM while the file is synced, as terminate_as_exception raises it (not
    mid-torch.save: there torch's zip writer replaces the SystemExit with its own RuntimeError). The tests' own
    output (file descriptors 0-2) is let through."""

    def __init__(self, monkeypatch, how: str, free: int = 1 << 16):
        self.real_write, self.free, self.how = os.write, free, how
        if how == "write":
            monkeypatch.setattr(os, "write", self.write)
        else:
            monkeypatch.setattr(os, "fsync", self.fail)

    def fail(self, fd):
        if self.how == "sigterm":
            raise SystemExit(143)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, fd, data):
        if fd <= 2:
            return self.real_write(fd, data)
        if self.free <= 0:
            self.fail(fd)
        n = self.real_write(fd, memoryview(data).cast("B")[:self.free])
        self.free -= n
        return n


@pytest.mark.parametrize("how", ["write", "fsync", "sigterm"])
def test_a_failed_to_ours_takes_back_the_folders_it_made(converted, tmp_path, monkeypatch, how):
    """Issue 38 row 22: on a full disk, to-ours left the parent folders it had made for its output."""
    _, source, _ = converted
    out = tmp_path / "new" / "deeper" / "out"
    FullDisk(monkeypatch, how)
    if how == "sigterm":
        with pytest.raises(SystemExit):
            in_process(W.main, "to-ours", source, out, *SMOKE_FLAGS)
    else:
        assert in_process(W.main, "to-ours", source, out, *SMOKE_FLAGS).returncode == 2
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("how", ["write", "fsync", "sigterm"])
@pytest.mark.parametrize("command", ["to-ours", "to-record"])
def test_a_failed_write_leaves_nothing(converted, tmp_path, monkeypatch, command, how):
    """#3: to-record wrote its .pt in place, and a full disk left a truncated one that blocked the rerun."""
    _, source, folder = converted
    out = tmp_path / ("out" if command == "to-ours" else "out.pt")
    argv = (source, out, *SMOKE_FLAGS) if command == "to-ours" else (folder, out)
    FullDisk(monkeypatch, how)
    if how == "sigterm":
        with pytest.raises(SystemExit) as stopped:
            in_process(W.main, command, *argv)
        assert stopped.value.code == 143
    else:
        written = out / "model.pt" if command == "to-ours" else out  # never the temporary (issue 38 row 18)
        one_line_error(in_process(W.main, command, *argv),
                       f"cannot write {written}: the disk is full ({os.strerror(errno.ENOSPC)})")
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.undo()
    assert in_process(W.main, command, *argv).returncode == 0  # and the rerun goes through


# The speedrun preset itself (record #92 whole: the two-channel n-gram table, the full-FP8 MLP) at a test's size
SPEEDRUN92 = T.parse_args(["--preset=speedrun", "--model_dim=96", "--head_dim=16", "--narrow_dim=8", "--rotary_dims=8",
                           "--mlp_hidden=352", "--head_mix_groups=4", "--vocab_size=2000", "--bigram_vocab_size=4000",
                           "--val_seq_len=256", "--window_block=32"], False)


def test_the_speedrun_s_weights_convert_to_a_complete_final_weights_file_and_back():
    # Before: to-ours failed on the table (our two-channel model has ngram.weight, no bigram_embed.weight), and its
    # result lacked the full-FP8 MLPs' scales, which a final-weights file holds (sample.py checks every key)
    ours = random_state(SPEEDRUN92)
    ours["ngram.weight"] = torch.randn(SPEEDRUN92.bigram_vocab_size, SPEEDRUN92.model_dim)
    record = W.ours_to_record(ours, SPEEDRUN92)
    assert not any(".fp8_" in k for k in record)  # run state outside the record's state dict
    again = W.record_to_ours(record, SPEEDRUN92, step=SPEEDRUN92.num_iterations)
    expected = T.final_weights_shapes(SPEEDRUN92)
    assert again.keys() == expected.keys()
    T.check_weights(again, expected)  # every shape and dtype, as sample.py's load checks them
    for name, tensor in ours.items():
        if ".fp8_" in name:  # their start: scale 1, the pre-activation gradient's 2^-6
            assert float(again[name]) == (2.0 ** -6 if name.endswith("dpre_scale") else 1.0), name
        elif name == "removed_mlp_sq":
            torch.testing.assert_close(again[name], tensor, rtol=1e-6, atol=0)
        elif not name.startswith(("rotary.", "narrow_rotary.")):
            assert torch.equal(again[name], tensor), name

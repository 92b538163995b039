"""Issue 46, rows 8, 11 and 12: the readers of three kinds of input, each checked by a table of the reported cases
and by Hypothesis over generated neighbours of them.

- the command line and config: every size bounded before anything is built (train_gpt.check_sizes), for the trainer
  and tools/estimate_memory.py;
- a weights file: finite, at most train_gpt.MAX_WEIGHT, and giving finite logits on a probe document
  (train_gpt.check_weights, check_forward_finite);
- a user's input folder for data/tokenize_text.py, links included (tokenize_text.collect_files).

The property tests call the readers in this process, on small examples, so that together they take seconds."""

import functools
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sample
import train_gpt as T
from conftest import SMOKE89, REPO, SHORT, in_process, one_line_error, random_final_weights, run_main

sys.path[:0] = [str(REPO / "tools"), str(REPO / "data")]
import estimate_memory  # noqa: E402
import tokenize_text  # noqa: E402

# Small enough that Hypothesis adds well under a second a test; no database written into the repository.
PROPERTY = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# -----------------------------------------------------------------------------
# Row 11: sizes bounded before anything is built

# (flag, a value past its bound): each once built or searched through before a later check refused it
HUGE_SIZES = [
    ("--num_layers=100000000", "--num_layers=100000000: at most 1,024"),  # the report: tens of GB of layer plans
    ("--model_dim=8388608", "--model_dim=8388608: at most 4,194,304"),
    ("--mlp_ratio=1000000", "--mlp_ratio=1000000: at most 64"),
    ("--vocab_size=1000000000000", "--vocab_size=1000000000000: at most 33,554,432"),
    ("--bigram_vocab_size=1000000000000", "--bigram_vocab_size=1000000000000: at most"),
    ("--bigram_sign_rows=1000000000000", "--bigram_sign_rows=1000000000000: at most"),
    ("--val_seq_len=1099511627776", "--val_seq_len=1099511627776: at most 16,777,216"),
    ("--final_val_window=10000000000000000000", "--final_val_window=10000000000000000000: at most"),
    ("--stage_windows=1:2,2:4,3:100000000000000", "--stage_windows=1:2,2:4,3:100000000000000: at most"),
    ("--stage_max_seq_len=256,512,100000000000", "--stage_max_seq_len=256,512,100000000000: at most"),
    ("--stage_batch_tokens=1024,2048,1099511627776", "--stage_batch_tokens=1024,2048,1099511627776: at most"),
    ("--val_tokens=100000000000000000", "--val_tokens=100000000000000000: at most"),
    ("--stage_batch_tokens=-1024,2048,3072", "--stage_batch_tokens=-1024,2048,3072: must be positive"),
]


@pytest.mark.parametrize("flag, fragment", HUGE_SIZES, ids=[flag for flag, _ in HUGE_SIZES])
def test_a_size_past_any_gpu_is_refused_before_anything_is_built(tmp_path, flag, fragment):
    """Row 11: --num_layers=100000000 grew to gigabytes of layer plans before a later check refused it."""
    proc = run_main(*SMOKE89, f"--logs_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/ck", flag)
    one_line_error(proc, fragment)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, fragment", [
    (["--", "--num_layers=100000000"], "--num_layers=100000000: at most 1,024"),  # had not ended after 180 s
    (["--", "--model_dim=8388608", "--head_dim=64"], "--model_dim=8388608: at most"),
    (["--world_sizes", "1", str(10 ** 21)], f"--world_sizes: {10 ** 21} ranks, more than a step's tokens can be"),
], ids=["num_layers", "model_dim", "world_sizes"])
def test_estimate_memory_refuses_a_size_past_any_gpu_at_once(argv, fragment):
    one_line_error(in_process(estimate_memory.main, *argv), fragment)


def test_the_presets_and_the_tests_configs_stay_within_the_bounds():
    for preset in T.PRESETS:
        T.check_sizes(T.parse_args([f"--preset={preset}"], False))
    T.parse_args([*SMOKE89, *SHORT], False)
    T.parse_args([*SMOKE89, "--model_dim=4194304", "--head_dim=64"], False)  # test_bad_input.py's HUGE


SCALAR_SIZES = {"num_layers": T.MAX_LAYERS, "model_dim": T.MAX_WIDTH, "head_dim": T.MAX_WIDTH,
                "mlp_ratio": T.MAX_MLP_RATIO, "vocab_size": T.MAX_TABLE_ROWS, "bigram_vocab_size": T.MAX_TABLE_ROWS,
                "bigram_sign_rows": T.MAX_TABLE_ROWS, "val_seq_len": T.MAX_POSITIONS, "window_block": T.MAX_POSITIONS,
                "dc_window": T.MAX_POSITIONS, "final_val_window": T.MAX_POSITIONS, "val_tokens": T.MAX_VAL_TOKENS}
# list flags: (the smoke preset's value with {} for the generated entry, the bound)
LIST_SIZES = {"stage_batch_tokens": ("1024,2048,{}", T.MAX_BATCH_TOKENS),
              "stage_max_seq_len": ("256,{},512", T.MAX_POSITIONS),
              "stage_windows": ("1:2,2:{},3:6", T.MAX_POSITIONS), "extension_windows": ("3:{}", T.MAX_POSITIONS)}
SIZE_FLAGS = [*SCALAR_SIZES, *LIST_SIZES]
# every size and sign, with most of the weight near the bounds and 0
INTEGERS = st.one_of(st.integers(), st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 3),
                     st.sampled_from([2 ** 10, 2 ** 22, 2 ** 24, 2 ** 25, 2 ** 26, 2 ** 34]).flatmap(
                         lambda bound: st.integers(bound - 2, bound + 2)),
                     st.integers(0, 60).map(lambda digits: int("9" * digits or "0")))


@PROPERTY
@given(name=st.sampled_from(SIZE_FLAGS), value=INTEGERS)
def test_every_size_flag_is_bounded_by_the_parser_the_command_line_uses(name, value):
    """Any integer in any size flag: parse_args (what main() and estimate_memory.py call) accepts it within the
    flag's bound, or refuses it with a ConfigError; past the bound, one naming the flag and the bound. It never
    builds anything first (a hundred million layers took minutes and tens of GB)."""
    if name in SCALAR_SIZES:
        flag, bound = f"--{name}={value}", SCALAR_SIZES[name]
    else:
        pattern, bound = LIST_SIZES[name]
        flag = f"--{name}={pattern.format(value)}"
    try:
        args = T.parse_args([*SMOKE89, flag], False)
    except T.ConfigError as e:
        message = str(e)
        assert "\n" not in message
        if value > bound:
            assert message == f"{flag}: at most {bound:,}, past what any GPU holds or any run needs"
        return
    assert 1 <= value <= bound, (flag, args)


# -----------------------------------------------------------------------------
# Row 12: weights finite, bounded, and giving finite logits

@pytest.fixture(scope="module")
def final_folder(tmp_path_factory):
    """random_final_weights of the SHORT run's config: untrained N(0, 0.3^2) weights, whose logits are finite."""
    return random_final_weights(tmp_path_factory.mktemp("final"), *SHORT)


def scaled_copy(folder: Path, into: Path, scale: float) -> Path:
    """A copy of a final-weights folder whose every stored tensor is multiplied by scale."""
    into.mkdir()
    (into / "config.json").write_bytes((folder / "config.json").read_bytes())
    state = torch.load(folder / "model.pt", weights_only=True)
    torch.save({k: v * scale if isinstance(v, torch.Tensor) else v for k, v in state.items()}, into / "model.pt")
    return into


OVERFLOW = "(2**64): the forward would overflow"
PROBE = "these weights are finite, but a forward pass on a probe document gives non-finite logits: they overflow"
SCALED_WEIGHTS = [
    # (scale, sample.py's flags, fragment): the report, finite weights x1e30 at both temperatures
    (1e30, ["--temperature=0"], OVERFLOW),  # printed `!!!!!`: token 0 of NaN logits
    (1e30, [], OVERFLOW),  # multinomial's RuntimeError traceback
    (10.0, ["--temperature=0"], PROBE),  # within MAX_WEIGHT, yet NaN logits: found by the probe forward
    (1e10, [], PROBE),
]


@pytest.mark.parametrize("scale, flags, fragment", SCALED_WEIGHTS,
                         ids=[f"x{scale:g} {' '.join(flags)}" for scale, flags, _ in SCALED_WEIGHTS])
def test_finite_weights_that_overflow_are_refused_naming_the_file(final_folder, tmp_path, scale, flags, fragment):
    """Row 12: finite weights x1e30 passed the finiteness check; sample.py then failed in multinomial, or printed
    `!!!` at temperature 0."""
    folder = scaled_copy(final_folder, tmp_path / "final", scale)
    proc = in_process(sample.main, folder, "--prompt=Hi", "--max_new_tokens=3", *flags)
    one_line_error(proc, f"error: {folder / 'model.pt'}: ", fragment)


def test_weights_whose_forward_is_finite_still_sample(final_folder, tmp_path):
    folder = scaled_copy(final_folder, tmp_path / "final", 1e-30)
    proc = in_process(sample.main, folder, "--prompt=Hi", "--max_new_tokens=3", "--temperature=0")
    assert proc.returncode == 0, proc.stderr


def test_init_from_refuses_weights_past_max_weight_before_the_run_starts(final_folder, tmp_path):
    """--init_from reads weights through the same check_weights."""
    folder = scaled_copy(final_folder, tmp_path / "final", 1e30)
    proc = run_main(*SHORT, f"--init_from={folder}", f"--logs_dir={tmp_path}/logs")
    one_line_error(proc, f"--init_from={folder}: its weights do not fit this config's model (", OVERFLOW)
    assert not (tmp_path / "logs").exists()


def test_logits_that_overflow_during_generation_are_one_line_not_a_traceback(final_folder):
    """The probe is one document: sample.py checks every step's logits, and HellaSwag's losses, too (before,
    multinomial's traceback; HellaSwag's losses were not checked)."""
    model, args, info = T.load_final_weights(final_folder, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)
    for temperature in (0.0, 1.0):
        with pytest.raises(sample.OverflowingWeights, match="logits after 3 tokens are not finite"):
            sample.generate(model, args, info, [40, 50], 3, temperature, 200, 0)
    with pytest.raises(sample.OverflowingWeights, match="losses on HellaSwag are not finite"):
        sample.token_losses_fn(model, args, info)([[40, 50, 60]])


@functools.lru_cache(maxsize=None)
def small_model():
    """(args, model, its state dict, the expected state (model_state_shapes), final windows) of the SHORT config at a
    vocabulary of 512 (fast to scale and check) with random N(0, 0.3^2) weights, made once for the property test."""
    args = T.parse_args([*SMOKE89, *SHORT, "--vocab_size=512", "--bigram_vocab_size=512"], False)
    torch.manual_seed(0)
    model = T.GPT(args, T.Numerics.for_evaluation(torch.device("cpu"))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    windows = T.Schedule(args).windows(args.num_iterations, final_validation=True)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    return args, model, state, T.model_state_shapes(args), windows


SCALES = st.one_of(st.floats(min_value=1e-45, max_value=1e38), st.floats(min_value=-1e38, max_value=-1e-45),
                   st.sampled_from([0.0, 10.0, 2.0 ** 64, 2.0 ** 65, float("inf"), float("-inf"), float("nan")]))


@PROPERTY
@given(scale=SCALES, only=st.one_of(st.none(), st.sampled_from(["lm_head", "scalars", "embed.weight",
                                                                 "blocks.1.mlp.fc", "resid_lambdas"])))
def test_weights_are_refused_or_give_finite_logits_at_every_scale(scale, only):
    """Weights at any scale, all or one tensor: check_weights refuses exactly the non-finite ones and those past
    MAX_WEIGHT, in one line; of what it accepts, check_forward_finite passes exactly the weights whose probe logits
    are finite, and otherwise says so in one line (load_final_weights refuses them naming the file)."""
    args, model, base, expected, windows = small_model()
    state = {k: v * scale if isinstance(v, torch.Tensor) and only in (None, k) else v for k, v in base.items()}
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    good = all(bool(torch.isfinite(v).all()) and float(v.abs().max()) <= T.MAX_WEIGHT for v in tensors)
    try:
        T.check_weights(state, expected)
    except T.WeightsError as e:
        assert not good and "\n" not in str(e)
        return
    assert good
    model.load_state_dict(state)
    problem = T.check_forward_finite(model, args, windows)
    ids = torch.arange(min(T.PROBE_TOKENS, T.context_length(args))) * 7919 % args.vocab_size
    with torch.no_grad():
        finite = bool(torch.isfinite(model.logits(model.hidden(ids, T.build_masks(
            ids, model.plans, windows, args.window_block, use_flex=False)))).all())
    assert (problem is None) == finite
    assert problem is None or ("\n" not in problem and "non-finite logits" in problem)


# -----------------------------------------------------------------------------
# Row 8: a user's input folder, links included

TEXT = "The quick brown fox jumps over the lazy dog. " * 20


def corpus(root: Path) -> Path:
    """root/corpus/ with a text file, and root/elsewhere/ (a folder of two texts, and one text file) for links."""
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("first " + TEXT)
    (root / "elsewhere" / "folder").mkdir(parents=True)
    (root / "elsewhere" / "folder" / "b.txt").write_text("second " + TEXT)
    (root / "elsewhere" / "folder" / "c.jsonl").write_text('{"text": "third ' + TEXT + '"}\n')
    (root / "elsewhere" / "d.txt").write_text("fourth " + TEXT)
    return root / "corpus"


def tokenize(capsys, *argv):
    """tokenize_text.main in this process: (exit code, stderr's lines)."""
    code = tokenize_text.main([*map(str, argv), "--bpe-file", str(tokenize_text.BUNDLED_BPE), "--workers", "1"])
    return code, capsys.readouterr().err.strip().splitlines()


def train_documents(out: Path) -> int:
    return sum(int((T.read_shard(p) == T.BOS_ID).sum()) for p in out.glob("*_train_*.bin"))


FOLLOWED = {
    # (what, made in the corpus, documents in the data set, the note): the report, 32k of 85k tokens missing, exit 0
    "a linked folder": (lambda c: (c / "more").symlink_to(c.parent / "elsewhere" / "folder"), 3,
                        "a link, followed to the folder "),
    "a linked .txt file": (lambda c: (c / "d.txt").symlink_to(c.parent / "elsewhere" / "d.txt"), 2,
                           "a link, followed to the file "),
    "a relative link in a subfolder": (lambda c: ((c / "sub").mkdir(), (c / "sub" / "f").symlink_to("../../elsewhere"
                                                                                                     "/folder")),
                                       3, "a link, followed to the folder ../../elsewhere/folder"),
}


@pytest.mark.parametrize("make, documents, note", FOLLOWED.values(), ids=FOLLOWED.keys())
def test_a_link_under_an_input_folder_is_followed_and_said(tmp_path, capsys, make, documents, note):
    """Row 8: a linked folder or file under an input was left out without a word (exit 0)."""
    folder = corpus(tmp_path)
    make(folder)
    code, err = tokenize(capsys, folder, "--out", tmp_path / "out")
    assert code == 0, err
    assert train_documents(tmp_path / "out") == documents
    assert [line for line in err if line.startswith("note:")] == [
        line for line in err if line.startswith("note:") and note in line] != []


def fifo(path: Path):
    os.mkfifo(path)


REFUSED = {
    # (what, made in the corpus, fragments of the one error line)
    "a dangling .txt link": (lambda c: (c / "gone.txt").symlink_to("nowhere.txt"),
                             ["gone.txt: a link to nowhere.txt, which does not exist"]),
    "a dangling link to a folder": (lambda c: (c / "chapters").symlink_to("../moved"),
                                    ["chapters: a link to ../moved, which does not exist"]),
    "a link to a folder it lies in": (lambda c: ((c / "sub").mkdir(), (c / "sub" / "up").symlink_to("..")),
                                      ["sub/up: a link to .., a folder it lies in: following it would never end"]),
    "a link to itself": (lambda c: (c / "self").symlink_to("self"), ["self: a loop of links"]),
    "two links to one folder": (lambda c: ((c / "x").symlink_to("../elsewhere/folder"),
                                           (c / "y").symlink_to("../elsewhere/folder")),
                                ["y: a link to ../elsewhere/folder, a folder already read as ", "read twice"]),
    "a FIFO named .txt": (lambda c: fifo(c / "pipe.txt"), ["pipe.txt: a FIFO (a named pipe), not a text file"]),
    "a linked file twice": (lambda c: ((c / "x.txt").symlink_to("a.txt"),), ["listed more than once"]),
}


@pytest.mark.parametrize("make, fragments", REFUSED.values(), ids=REFUSED.keys())
def test_a_link_or_file_that_cannot_be_read_as_text_is_one_line_naming_it(tmp_path, capsys, make, fragments):
    """Row 8: a dangling .txt link (or a FIFO) under an input was skipped without a word; a loop is refused rather
    than followed forever."""
    folder = corpus(tmp_path)
    make(folder)
    code, err = tokenize(capsys, folder, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: input {folder}"), err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    assert not (tmp_path / "out").exists()


def test_a_fifo_named_as_an_input_is_said_to_be_one(tmp_path, capsys):
    """It was 'no such file or folder'."""
    fifo(tmp_path / "pipe.txt")
    code, err = tokenize(capsys, tmp_path / "pipe.txt", "--out", tmp_path / "out")
    assert code == 1 and err == [f"error: input {tmp_path / 'pipe.txt'}: a FIFO (a named pipe), not a text file "
                                 f"or a folder"]


def test_a_file_swapped_for_a_fifo_after_the_listing_is_refused_not_waited_on(tmp_path):
    """The reader opens without blocking and checks what it opened: a FIFO with no writer never ends a read."""
    fifo(tmp_path / "late.txt")
    for reader in (tokenize_text.DocumentReader([tmp_path / "late.txt"]),
                   tokenize_text.DocumentReader([tmp_path / "late.txt"], doc_separator="---")):
        with pytest.raises(tokenize_text.TokenizeError, match="late.txt: a FIFO"):
            list(reader)
    os.rename(tmp_path / "late.txt", tmp_path / "late.jsonl")
    with pytest.raises(tokenize_text.TokenizeError, match="late.jsonl: a FIFO"):
        list(tokenize_text.DocumentReader([tmp_path / "late.jsonl"]))


# What a generated entry of an input folder is; "outside" names lie beside the input folder.
KINDS = ["text", "other file", "link to an outside file", "link to an outside folder", "link to the input folder",
         "link to sub", "dangling link", "link to itself", "fifo"]
NAMES = ["a.txt", "b.TXT", "c.jsonl", "d.md", "e", "f.txt", "g"]


def build(root: Path, entries) -> tuple[Path, set[Path] | None]:
    """The input folder root/in (with a subfolder sub/) holding the entries, and the files collect_files must return
    (resolved), or None where it must refuse."""
    top, outside = root / "in", root / "outside"
    (top / "sub").mkdir(parents=True)
    (outside / "folder").mkdir(parents=True)
    (outside / "o.txt").write_text("o")
    (outside / "folder" / "x.txt").write_text("x")
    expected, refused, links_to = set(), False, {"file": 0, "folder": 0}
    for parent, name, kind in entries:
        path = top / parent / name
        if path.exists() or path.is_symlink():
            continue
        texty = path.suffix.lower() in (".txt", ".jsonl")
        if kind == "text" or kind == "other file":
            path.write_text("t")
            if texty:
                expected.add(path.resolve())
        elif kind == "link to an outside file":
            path.symlink_to(outside / "o.txt")
            if texty:
                links_to["file"] += 1
                expected.add((outside / "o.txt").resolve())
        elif kind == "link to an outside folder":
            path.symlink_to(outside / "folder")
            links_to["folder"] += 1
            expected.add((outside / "folder" / "x.txt").resolve())
        elif kind in ("link to the input folder", "link to sub"):  # a loop, or sub's files read twice
            path.symlink_to(top if kind == "link to the input folder" else top / "sub")
            refused = True
        elif kind == "dangling link":
            path.symlink_to(root / "nowhere")
            refused = True
        elif kind == "link to itself":
            path.symlink_to(path.name)
            refused = True
        else:
            os.mkfifo(path)
            refused |= texty
    refused |= links_to["file"] > 1 or links_to["folder"] > 1 or not expected
    return top, None if refused else expected


# The first four kinds (which a folder may hold any number of) weighted up, so that many trees are read whole.
ENTRIES = st.lists(st.tuples(st.sampled_from(["", "sub"]), st.sampled_from(NAMES),
                             st.sampled_from(KINDS[:4] * 4 + KINDS)), max_size=6)


@PROPERTY
@given(entries=ENTRIES)
def test_an_input_folder_gives_every_text_file_once_or_one_error(entries):
    """Any tree of files, links (to files, to folders, to nothing, to themselves, back up) and FIFOs: collect_files
    returns exactly the text files reachable, each once, or refuses in one line naming the input; it never leaves a
    file out in silence, never follows a loop and never opens a FIFO."""
    with tempfile.TemporaryDirectory() as root:
        top, expected = build(Path(root), entries)
        notes = []
        try:
            files = tokenize_text.collect_files([top], "input", notes.append)
        except tokenize_text.TokenizeError as e:
            assert expected is None, (entries, str(e))
            assert "\n" not in str(e) and str(e).startswith(f"input {top}")
            return
        assert expected is not None, entries
        assert sorted(f.resolve() for f in files) == sorted(expected)
        assert bool(notes) == any(through_a_link(f, top) for f in files)


def through_a_link(path: Path, top: Path) -> bool:
    """Whether path, below top, is reached through a link (itself or a folder between)."""
    parts = path.relative_to(top).parts
    return any((top.joinpath(*parts[:n])).is_symlink() for n in range(1, len(parts) + 1))


# --- one escape for the text the tools print (issue 46, deliver 3) ----------------------------------------------

def test_every_tool_prints_a_name_it_did_not_choose_escaped(tmp_path):
    """A folder or flag named with a terminal escape (clear the screen) reaches the terminal as `\\x1b`, never as
    the escape: sample.py, tools/record_weights.py and tools/bench.py printed it raw."""
    import bench
    import record_weights
    name = str(tmp_path / "run\x1b[2J\x1b[32mOK")
    cases = [(sample.main, [name, "--prompt", "hi"]), (record_weights.main, ["to-record", name, tmp_path / "x.pt"]),
             (bench.main, ["--out", tmp_path / "b", "--parts", "stage1\x1b[2J"]),
             (estimate_memory.main, ["--", "--preset=smoke\x1b[2J"])]
    for main, argv in cases:
        proc = in_process(main, *argv)
        line = one_line_error(proc, "\\x1b[2J")
        assert "\x1b" not in proc.stderr + proc.stdout, (main.__module__, line)


def test_the_memory_model_counts_a_run_that_starts_from_init_from():
    """The memory model builds the optimizers on fake tensors, where build_optimizers compared --init_from's embedding
    and lm_head with torch.equal, a value fake tensors do not have: estimate_memory.py, and on a GPU every run's
    start-up memory check, failed with a DataDependentOutputException traceback for any --init_from."""
    proc = in_process(estimate_memory.main, "--world_sizes", "1", "--", *SMOKE89, "--init_from=/no/weights")
    assert proc.returncode == 0 and "fits within" in proc.stdout, proc.stderr[-2000:]

"""Issue 53, the I/O rows (1, 6, 7, 8, 11, 12, 13): one reader and one writer for every file, loads bounded by what
they hold, storages that match their shapes. Each row has a table, the reported input first, then neighbours of it
(a control that must go through last); each table fails on 3bbb0af. The reader and the writer have Hypothesis
properties over the neighbours of a path (another kind of file: a FIFO, a link to /dev/null or /dev/zero, a socket,
a folder, a link to a regular file or to nothing; another size), run against both implementations, train_gpt.py's
and its stdlib twin data/safe_write.py's, which must agree to the word: neither can drift from the other.

No test writes to a device: /dev/null and /dev/zero are reached only through links made here, and a refused write
is checked by the link being left as it was. A FIFO that a reader might open is kept unblocked (unblocked_fifo), so
that a reader which waits on it (the old ones did) reads end-of-file instead of hanging the suite. Everything runs
in this process, on the smoke model at a vocabulary of 512 (SMALL: 2.4 MB of weights)."""

import contextlib
import dataclasses
import errno
import itertools
import hashlib
import io
import json
import math
import os
import socket
import stat
import sys
import tempfile
import unittest.mock
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sample
import train_gpt as T
from conftest import SMOKE89, REPO, in_process, one_line_error, random_final_weights
from test_readers_trainer import unblocked_fifo

sys.path[:0] = [str(REPO / "tools"), str(REPO / "data")]
import cost_model  # noqa: E402
import record_weights as W  # noqa: E402
import safe_write  # noqa: E402
import tokenize_text  # noqa: E402

PROPERTY = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SMALL_FLAGS = [*SMOKE89, "--vocab_size=512", "--bigram_vocab_size=512"]
SMALL = T.parse_args(SMALL_FLAGS, False)
CPU = T.DistEnv(0, 0, 1, torch.device("cpu"))
SOURCE = (REPO / "train_gpt.py").read_text()
HANDMADE = sorted((REPO / "tests/fixtures/handmade").glob("b-cpu-run*.txt"))  # three logs records.py reads
# The two implementations of the reader and the writer
IMPLS = [pytest.param(T, id="train_gpt"), pytest.param(safe_write, id="safe_write")]


def write_failed(impl) -> type:
    """The error each writer raises for a failed write."""
    return T.TrainingError if impl is T else safe_write.WriteError


def records_tool():
    if "records_tool" not in sys.modules:  # test_records.py loads it under this name too
        import importlib.util
        spec = importlib.util.spec_from_file_location("records_tool", REPO / "records/records.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["records_tool"] = module
        spec.loader.exec_module(module)
    return sys.modules["records_tool"]


def listen_socket(path: Path) -> socket.socket:
    """A Unix socket bound at path (the caller closes it)."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return server


@pytest.fixture
def short_tmp():
    """A folder with a short path: a Unix socket's path holds at most 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="io") as folder:
        yield Path(folder)


def lstat_of(path: Path) -> tuple:
    """What a refused write must leave as it was: the kind, inode and (for a link) the target."""
    st_ = os.lstat(path)
    return stat.S_IFMT(st_.st_mode), st_.st_ino, os.readlink(path) if stat.S_ISLNK(st_.st_mode) else None


def hidden(folder: Path) -> list[str]:
    """Temporaries left behind (every writer's start with a dot)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -----------------------------------------------------------------------------
# Row 1: records.py's -o (and every output it writes) is a regular file or nothing: refused before anything is written

def fifo_at(path):
    os.mkfifo(path)


def link_to(target):
    return lambda path: path.symlink_to(target)


OUTPUT_CASES = [
    # (what -o names, how it is made, the command, the kind the one line says)
    ("a FIFO, extract (the issue's)", fifo_at, "extract", "a FIFO, not a regular file: refused, nothing written"),
    ("a link to /proc/self/fd/1, extract (the issue's)", link_to("/proc/self/fd/1"), "extract",
     "a symbolic link (to /proc/self/fd/1), not a regular file: refused, nothing written"),
    ("a link to /dev/null, extract (the issue's: a character device)", link_to("/dev/null"), "extract",
     "a symbolic link (to /dev/null), not a regular file"),
    ("a FIFO, plot (the issue's)", fifo_at, "plot", "a FIFO, not a regular file"),
    ("a link to /dev/null, plot", link_to("/dev/null"), "plot", "a symbolic link (to /dev/null)"),
    ("a link to a regular file, extract", link_to("elsewhere.py"), "extract", "a symbolic link (to elsewhere.py)"),
    ("a socket, extract", "socket", "extract", "a socket, not a regular file"),
]


@pytest.mark.parametrize("what, make, command, kind", OUTPUT_CASES, ids=[c[0] for c in OUTPUT_CASES])
def test_records_output_that_is_no_regular_file_is_refused_and_left_as_it_was(short_tmp, capsys, what, make, command,
                                                                            kind):
    if command == "plot":
        pytest.importorskip("matplotlib")
    out = short_tmp / "out"
    (short_tmp / "elsewhere.py").write_text("a user's file")
    server = listen_socket(out) if make == "socket" else make(out)
    try:
        before = lstat_of(out)
        argv = ["extract", HANDMADE[0], "-o", out] if command == "extract" else ["plot", *HANDMADE, "-o", out]
        code = records_tool().main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 1 and err.startswith(f"error: -o {out}: ") and err.count("\n") == 1 and kind in err, err
        assert lstat_of(out) == before and hidden(short_tmp) == []
        assert (short_tmp / "elsewhere.py").read_text() == "a user's file"
        if "/dev/null" in what:
            assert stat.S_ISCHR(os.stat(out).st_mode)  # still a link to the device
    finally:
        if server is not None:
            server.close()


def test_records_table_refuses_a_records_md_that_is_a_fifo(tmp_path, capsys):
    """The same writer under `table`: RECORDS.md a FIFO was replaced by a file (exit 0)."""
    (tmp_path / "RECORDS.md").unlink(missing_ok=True)
    with unblocked_fifo(tmp_path / "RECORDS.md"):
        code = records_tool().main(["table", "--records-dir", str(tmp_path)])
        assert stat.S_ISFIFO(os.lstat(tmp_path / "RECORDS.md").st_mode)
    err = capsys.readouterr().err
    assert code == 1 and err == f"error: {tmp_path / 'RECORDS.md'}: a FIFO, not a regular file: refused, nothing " \
                                f"written (name a new file)\n", err


def test_records_output_that_is_a_regular_file_is_replaced(tmp_path, capsys):
    """The control: an output that exists as a file is written over, atomically."""
    out = tmp_path / "train_gpt.py"
    out.write_text("old")
    assert records_tool().main(["extract", str(HANDMADE[0]), "-o", str(out)]) == 0, capsys.readouterr().err
    assert out.read_text().startswith("# Hand-made stand-in for train_gpt.py") and hidden(tmp_path) == []


# -----------------------------------------------------------------------------
# Row 6: the checkpoint's files through the one reader: a FIFO, a device, a socket, a folder is one line

class NoData:
    """The loader a checkpoint of no data records (check_checkpoint reads no shards)."""

    def state_dict(self):
        return {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of the SMALL model at step 2 (check_checkpoint is called with SMALL's config)."""
    root = tmp_path_factory.mktemp("checkpoint")
    args = T.parse_args([*SMALL_FLAGS, f"--checkpoint_dir={root}"], False)
    torch.manual_seed(0)
    model = T.build_model(args, CPU)
    return T.save_checkpoint(2, 1.0, model, T.build_optimizers(model, args), NoData(), args, CPU, SOURCE, "base")


def copy_checkpoint(checkpoint: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for f in checkpoint.iterdir():
        os.link(f, folder / f.name)
    return folder


def relist(folder: Path, name: str):
    """meta.json rewritten to list `name` as it is now (its size and sha256): past those checks, to the loader."""
    meta = json.loads((folder / "meta.json").read_text())
    data = (folder / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").unlink()
    (folder / "meta.json").write_text(json.dumps(meta))


def check(folder: Path, args=SMALL):
    return T.check_checkpoint(folder, args, CPU, SOURCE)


CHECKPOINT_FILES = [
    # (what replaces one of the checkpoint's files, the file, the kind the one line says)
    ("model.pt a FIFO (the issue's)", "model.pt", "fifo", "model.pt: a FIFO, not a checkpoint's file"),
    ("rank_0.pt a link to /dev/zero (the issue's)", "rank_0.pt", "/dev/zero", "rank_0.pt: a device, not a checkpoint"),
    ("model.pt a link to /dev/null", "model.pt", "/dev/null", "model.pt: a device, not a checkpoint's file"),
    ("rank_0.pt a folder", "rank_0.pt", "folder", "rank_0.pt: a folder, not a checkpoint's file"),
    ("model.pt a socket", "model.pt", "socket", "model.pt: a socket, not a checkpoint's file"),
    ("meta.json a FIFO", "meta.json", "fifo", "unreadable meta.json (a FIFO, not a train_gpt.py checkpoint's meta"),
]


@pytest.mark.parametrize("what, name, kind, fragment", CHECKPOINT_FILES, ids=[c[0] for c in CHECKPOINT_FILES])
def test_a_checkpoint_file_that_is_no_regular_file_is_one_line(checkpoint, short_tmp, what, name, kind, fragment):
    """Row 6: model.pt as a FIFO blocked the resume forever; rank_0.pt linked to /dev/zero was read until memory ran
    out (a MemoryError traceback at 4.4 GB). Refused by check_checkpoint, before the log exists."""
    folder = copy_checkpoint(checkpoint, short_tmp / "step_000002")
    (folder / name).unlink()
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            stack.enter_context(unblocked_fifo(folder / name))
        elif kind == "folder":
            (folder / name).mkdir()
        elif kind == "socket":
            stack.callback(listen_socket(folder / name).close)
        else:
            (folder / name).symlink_to(kind)
        with pytest.raises(T.TrainingError) as refused:
            check(folder)
    assert str(refused.value).startswith(f"--resume={folder}: {fragment}"), str(refused.value)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 300


def test_a_checkpoint_file_linked_to_a_regular_file_resumes(checkpoint, tmp_path):
    """The control: a link to the file itself (a copied checkpoint) is followed."""
    folder = tmp_path / "step_000002"
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).symlink_to(f)
    assert check(folder).meta.step == 2


# -----------------------------------------------------------------------------
# Row 7: what a .pt holds once loaded (its zip directory) is bounded before anything is unpickled

ZEROS = 4 << 20  # float32 zeros a compressed entry adds: 16 MiB once loaded, 16 kB compressed


def deflated(state) -> bytes:
    """state saved by torch.save, its zip entries then compressed (torch.load inflates them)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    out = io.BytesIO()
    with zipfile.ZipFile(buffer) as stored, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as packed:
        for entry in stored.infolist():
            packed.writestr(entry.filename, stored.read(entry), compresslevel=1)
    return out.getvalue()


@pytest.fixture
def host_of(monkeypatch):
    """host_of(extra): the host's memory made the model of SMALL and `extra` bytes (the budget check_fits_host
    fits): a file holding 16 MiB once loaded is too much for 8 MiB to spare, one on disk as 16 kB is not."""
    def set_budget(extra: int):
        model = T.tensor_bytes(v for v in T.model_state_shapes(SMALL).values() if isinstance(v, torch.Tensor))
        monkeypatch.setattr(T, "device_memory_bytes", lambda device: model + extra)
    return set_budget


@pytest.fixture(scope="module")
def small_final(tmp_path_factory):
    return random_final_weights(tmp_path_factory.mktemp("final"), *SMALL_FLAGS)


def final_copy(small_final: Path, into: Path, state=None) -> Path:
    into.mkdir()
    (into / "config.json").write_bytes((small_final / "config.json").read_bytes())
    (into / "model.pt").write_bytes(deflated(state) if state is not None else (small_final / "model.pt").read_bytes())
    return into


def with_zeros(state: dict) -> dict:
    return {**state, "zeros": torch.zeros(ZEROS)}


def run_reader(reader: str, small_final: Path, tmp_path: Path, state):
    """The weights reader named, on a copy of small_final whose model.pt is `state` deflated (the record's layout for
    to-ours; for --resume, state is a checkpoint folder, copied): (exit code 0 or 2, the one error line or ''). In
    this process, so that the budget host_of sets applies."""
    if reader == "to-ours":
        (tmp_path / "record.pt").write_bytes(deflated(state))
        proc = in_process(W.main, "to-ours", tmp_path / "record.pt", tmp_path / "out", "--", *SMALL_FLAGS)
    elif reader == "--resume":
        folder = copy_checkpoint(state, tmp_path / "step_000002")
        try:
            check(folder)
        except T.TrainingError as e:
            return 2, f"error: {e}"
        return 0, ""
    else:
        folder = final_copy(small_final, tmp_path / "final", state)
        if reader == "--init_from":
            try:
                T.read_init_weights(dataclasses.replace(SMALL, init_from=str(folder)))
            except T.DataError as e:
                return 2, f"error: {e}"
            return 0, ""
        if reader == "sample.py":
            proc = in_process(sample.main, folder, "--prompt=x", "--max_new_tokens=2")
        else:
            proc = in_process(W.main, "to-record", folder, tmp_path / "o.pt")
    lines = proc.stderr.strip().splitlines()
    return proc.returncode, lines[0] if len(lines) == 1 else proc.stderr


def resume_state(checkpoint: Path, tmp_path: Path, edit) -> Path:
    """The checkpoint's files in tmp_path/base, model.pt rewritten as edit(state) deflated and listed in meta.json."""
    base = copy_checkpoint(checkpoint, tmp_path / "base")
    state = torch.load(base / "model.pt", weights_only=True)
    (base / "model.pt").unlink()
    (base / "model.pt").write_bytes(deflated(edit(state)))
    relist(base, "model.pt")
    return base


INFLATING = ["--resume", "sample.py", "--init_from", "to-ours", "to-record"]


@pytest.mark.parametrize("reader", INFLATING)
def test_a_file_that_inflates_past_the_host_is_refused_before_it_is_loaded(small_final, checkpoint, tmp_path, host_of,
                                                                          reader):
    """Row 7: torch.load inflates compressed zip entries while the host check bounded the size on disk (an 85 MB
    model.pt of 3 GB of zeros took 3.4 GB before the refusal). Here 16 MiB of zeros, 16 kB on disk, and 8 MiB to
    spare: every reader refuses it from the archive's directory, before anything is unpickled."""
    host_of(8 << 20)
    if reader == "--resume":
        state = resume_state(checkpoint, tmp_path, with_zeros)
    elif reader == "to-ours":
        state = with_zeros(W.ours_to_record(torch.load(small_final / "model.pt", weights_only=True), SMALL))
    else:
        state = with_zeros(torch.load(small_final / "model.pt", weights_only=True))
    (tmp_path / "run").mkdir()
    with unittest.mock.patch.object(torch, "load", side_effect=AssertionError("unpickled before the check")):
        code, line = run_reader(reader, small_final, tmp_path / "run", state)
    assert code == 2 and "\n" not in line, line
    assert "MiB of host memory once loaded (" in line and "on disk: its entries are compressed)" in line, line
    assert not (tmp_path / "run/out").exists() and not (tmp_path / "run/o.pt").exists()


@pytest.mark.parametrize("reader", INFLATING)
def test_a_compressed_file_within_the_host_loads(small_final, checkpoint, tmp_path, host_of, reader):
    """The control: a deflated file whose entries fit is read as a stored one is."""
    host_of(64 << 20)
    if reader == "--resume":
        state = resume_state(checkpoint, tmp_path, lambda state: state)
    elif reader == "to-ours":
        state = W.ours_to_record(torch.load(small_final / "model.pt", weights_only=True), SMALL)
    else:
        state = torch.load(small_final / "model.pt", weights_only=True)
    (tmp_path / "run").mkdir()
    if reader == "sample.py":  # what it reads the folder with (its prompt's BOS is past a vocabulary of 512)
        T.load_final_weights(final_copy(small_final, tmp_path / "run" / "final", state), torch.device("cpu"))
        return
    code, line = run_reader(reader, small_final, tmp_path / "run", state)
    assert code == 0, line


@settings(PROPERTY, max_examples=25)  # each saves, and may compress, a file
@given(sizes=st.lists(st.integers(0, 3000), max_size=4), compress=st.booleans(), spare=st.integers(0, 40_000))
def test_property_a_load_is_bounded_by_what_its_archive_holds(sizes, compress, spare):
    """Any tensors, stored or deflated: archive_bytes is the sum of the entries' sizes once inflated, and load_weights
    refuses, in one line and without unpickling, exactly the files whose entries do not fit the host beside the
    model."""
    state = {f"t{i}": torch.arange(n, dtype=torch.float32) for i, n in enumerate(sizes)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = deflated(state) if compress else buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        held = sum(len(archive.read(entry)) for entry in archive.infolist())
    assert T.archive_bytes(io.BytesIO(data)) == held
    with unittest.mock.patch.object(T, "device_memory_bytes", lambda device: held + spare - 20_000):
        try:
            loaded = T.load_weights(io.BytesIO(data))
        except T.WeightsError as e:
            assert held > held + spare - 20_000 and "\n" not in str(e) and "of host memory" in str(e)
            return
    assert held <= held + spare - 20_000
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


# -----------------------------------------------------------------------------
# Row 8: every tensor's storage holds each of its elements once, checked before any computation on it

def record_of(small_final: Path) -> dict:
    return W.ours_to_record(torch.load(small_final / "model.pt", weights_only=True), SMALL)


def bank_view(rows: int, strides=None):
    """qk_bank (rows, 32, 64) as a view: one row broadcast (stride 0), or the strides given over a small storage."""
    if strides is None:
        return torch.zeros(1, 32, 64).expand(rows, 32, 64)
    return torch.zeros(rows + 2048).as_strided((rows, 32, 64), strides)


STORAGE_CASES = [
    # (what, the reader, the tensor stored, its name as the refusal quotes it)
    ("to-ours: a bank of 2**24 rows broadcast from one (the issue's)", "to-ours", lambda: bank_view(2 ** 24),
     "'qk_bank' has shape (16777216, 32, 64) and strides (0, 64, 1): a view whose 34,359,738,368 elements overlap in "
     "a storage of 8,192 bytes (stride 0: one value broadcast); save it with .contiguous()"),
    ("to-ours: a bank of its own rows, one broadcast", "to-ours", lambda: bank_view(24), "'qk_bank' has shape (24, "),
    ("to-ours: a bank whose rows start one element apart", "to-ours", lambda: bank_view(24, (1, 64, 1)),
     "'qk_bank' has shape (24, 32, 64) and strides (1, 64, 1): a view whose 49,152 elements overlap"),
    ("sample.py: lm_head broadcast", "sample.py", lambda: torch.zeros(64, 1).expand(64, 512),
     "'lm_head' has shape (64, 512) and strides (1, 0)"),
    ("--init_from: embed.weight broadcast", "--init_from", lambda: torch.zeros(1, 64).expand(512, 64),
     "'embed.weight' has shape (512, 64) and strides (0, 1)"),
    ("--resume: lm_head broadcast", "--resume", lambda: torch.zeros(64, 1).expand(64, 512), "'lm_head' has shape"),
    ("to-record: lm_head rows overlapping", "to-record", lambda: torch.zeros(600).as_strided((64, 512), (1, 1)),
     "'lm_head' has shape (64, 512) and strides (1, 1)"),
]


@pytest.mark.parametrize("what, reader, tensor, fragment", STORAGE_CASES, ids=[c[0] for c in STORAGE_CASES])
def test_a_view_whose_elements_overlap_is_refused_before_it_is_read(small_final, checkpoint, tmp_path, what, reader,
                                                                  tensor, fragment):
    """Row 8: a bank of 2**24 rows stored as a zero-stride view fitted in 92 MB, passed the shape check, and the
    finiteness check then asked for 2.2 TB; broadcast weights read by sample.py or --init_from were taken as
    they were."""
    (tmp_path / "run").mkdir()
    if reader == "to-ours":
        code, line = run_reader(reader, small_final, tmp_path / "run", {**record_of(small_final),
                                                                       "_orig_mod.qk_bank": tensor()})
    elif reader == "--resume":
        code, line = run_reader(reader, small_final, tmp_path / "run", resume_state(
            checkpoint, tmp_path, lambda state: {**state, "lm_head": tensor()}))
    else:
        key = "embed.weight" if reader == "--init_from" else "lm_head"
        code, line = run_reader(reader, small_final, tmp_path / "run", {
            **torch.load(small_final / "model.pt", weights_only=True), key: tensor()})
    assert code == 2 and "\n" not in line and fragment in line, line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) in ([], ["final"], ["record.pt"], ["step_000002"])


STRIDED = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 24)), min_size=1, max_size=3)


@PROPERTY
@given(dims=STRIDED, offset=st.integers(0, 3), spare=st.integers(0, 5))
def test_property_storage_problem_finds_exactly_the_views_that_repeat_an_element(dims, offset, spare):
    """Any sizes and strides over a storage they fit in: storage_problem passes exactly the views that reach each
    stored element at most once (counted here element by element)."""
    sizes, strides = [size for size, _ in dims], [stride for _, stride in dims]
    positions = [offset + sum(i * s for i, s in zip(index, strides))
                 for index in itertools.product(*(range(n) for n in sizes))]
    view = torch.zeros(max(positions) + 1 + spare).as_strided(sizes, strides, offset)
    problem = T.storage_problem("w", view)
    assert (problem is None) == (len(set(positions)) == len(positions)), (sizes, strides, problem)
    assert problem is None or ("\n" not in problem and problem.startswith("'w' has shape "))


# -----------------------------------------------------------------------------
# Row 11: tools/cost_model.py reads through the one reader, checks every figure, prints names escaped

def counts_json(place: tuple = (), value=None) -> dict:
    """A bench.json with CPU counts the model prices (one stage, one step of two pieces of work), with the field at
    `place` (keys and indices from the top) set to value."""
    step = {"work": [{"source": "forward graphs", "kind": "matmul", "bytes": 4096, "flops": 1e9, "count": 2},
                     {"source": "loss head", "kind": "eager", "bytes": 512, "flops": 0, "count": 3}],
            "eager_ops_by_source": {"loss head": 3}, "graph_calls_by_source": {"forward graphs": 1},
            "collective_bytes": {"all-gather": 1 << 20}}
    bench = {"counts": {"world_size": 8, "preset": "smoke", "kernels": True,
                        "stages": {"stage 1": {"steps_in_stage": 10, "steps": {"without Adam": step}}}}}
    if place:
        target = bench
        for key in place[:-1]:
            target = target[key]
        target[place[-1]] = value
    return bench


STEP = ("counts", "stages", "stage 1", "steps", "without Adam")


def cost(path) -> tuple[int, str, str]:
    """cost_model.main on path, in this process, without the stored runs' validation (0.1 s a call)."""
    with unittest.mock.patch.object(cost_model, "COUNTS_40C201B", Path("/nonexistent")):
        proc = in_process(cost_model.main, path)
    return proc.returncode, proc.stdout, proc.stderr


WORK = "counts.stages['stage 1'].steps['without Adam'].work"
COST_CASES = [
    # (what, the file's text (or how the path is made), fragment of the one error line)
    ("stages a list (the issue's)", json.dumps({"counts": {"world_size": 8, "stages": [1, 2]}}),
     "counts.stages is a list, not an object"),
    ("nested 100,000 deep (the issue's)", '{"counts": ' + "[" * 100_000 + "]" * 100_000 + "}", "(nested too deeply)"),
    ("a FIFO (the issue's)", "fifo", "(a FIFO, not a bench.json)"),
    ("NaN counts (the issue's)", json.dumps(counts_json((*STEP, "work", 0, "count"), float("nan"))),
     f"{WORK}[0].count is nan, not a figure"),
    ("a count of 1e400", json.dumps(counts_json()).replace('"count": 2', '"count": 1e400'),
     f"{WORK}[0].count is inf, not a figure"),
    ("a negative byte count", json.dumps(counts_json()).replace('"bytes": 4096', '"bytes": -4096'),
     f"{WORK}[0].bytes is -4096, not a figure"),
    ("work an object", json.dumps(counts_json((*STEP, "work"), {})),
     f"{WORK} is a dict, not a list"),
    ("a kind it does not price", json.dumps(counts_json()).replace('"eager"', '"\\u001b[2Jnew"'),
     f"{WORK}[1].kind is '\\x1b[2Jnew', not one this model prices"),
    ("a link to /dev/null", "/dev/null", "(a device, not a bench.json)"),
    ("a folder", "folder", "(a folder, not a bench.json)"),
]


@pytest.mark.parametrize("what, content, fragment", COST_CASES, ids=[c[0] for c in COST_CASES])
def test_cost_model_refuses_what_it_cannot_price_in_one_line(tmp_path, what, content, fragment):
    """Row 11: a list where an object belongs, or JSON nested 100,000 deep, gave a traceback; a FIFO blocked; NaN
    counts printed "nan s" with exit 0."""
    path = tmp_path / "bench.json"
    with contextlib.ExitStack() as stack:
        if content == "fifo":
            stack.enter_context(unblocked_fifo(path))
        elif content == "folder":
            path.mkdir()
        elif content.startswith("/dev/"):
            path.symlink_to(content)
        else:
            path.write_text(content)
        code, out, err = cost(path)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith(f"error: {path}: not a bench.json with CPU counts (") and err.count("\n") == 1, err
    assert fragment in err and "\x1b" not in err, err


def test_cost_model_prints_stage_and_source_names_escaped(tmp_path):
    """Row 11: a stage named with a terminal escape reached the terminal raw. The control too: the model is printed."""
    bench = counts_json()
    stages = bench["counts"]["stages"]
    stages["\x1b[2J\x1b[32mstage OK"] = stages.pop("stage 1")
    stages["\x1b[2J\x1b[32mstage OK"]["steps"]["without Adam"]["work"][0]["source"] = "forward\x1b[31m"
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    code, out, err = cost(tmp_path / "bench.json")
    assert code == 0 and err == "", err
    assert "| \\x1b[2J\\x1b[32mstage OK |" in out and "forward\\x1b[31m: matmul" in out and "\x1b" not in out


FIGURES = st.one_of(st.integers(-3, 2 ** 64), st.floats(), st.sampled_from([0, 2 ** 63, 2 ** 63 + 1, -0.0, 1e308]))
JSON = st.recursive(st.none() | st.booleans() | FIGURES | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
                    max_leaves=4)
COST_PLACES = [("counts", "world_size"), ("counts", "stages"), ("counts", "kernels"),
               ("counts", "stages", "stage 1", "steps_in_stage"), ("counts", "stages", "stage 1", "steps"),
               (*STEP, "work"), (*STEP, "work", 0, "bytes"), (*STEP, "work", 0, "count"), (*STEP, "work", 1, "flops"),
               (*STEP, "work", 1, "kind"), (*STEP, "eager_ops_by_source"), (*STEP, "collective_bytes")]


@PROPERTY
@given(place=st.sampled_from(COST_PLACES), value=JSON | FIGURES)
def test_property_the_cost_model_prices_valid_counts_or_refuses_in_one_line(place, value):
    """Any JSON value in any field the model reads: read_counts refuses it in one line naming the field, or every
    figure of the model is finite (no "nan s")."""
    bench = json.loads(json.dumps(counts_json(place, value)))  # as json.loads reads it from a file
    try:
        counts = cost_model.read_counts(bench)
    except cost_model.CountsError as e:
        assert "\n" not in str(e) and str(e).startswith("counts"), str(e)
        return
    with unittest.mock.patch.object(cost_model, "COUNTS_40C201B", Path("/nonexistent")):
        try:
            model = cost_model.model_counts(counts)
        except ZeroDivisionError:  # no work at all: main says so in one line
            return

    def finite(value) -> bool:
        if isinstance(value, dict):
            return all(map(finite, value.values()))
        if isinstance(value, list):
            return all(map(finite, value))
        return not isinstance(value, float) or math.isfinite(value)
    assert finite(model["stages"]), model["stages"]


# -----------------------------------------------------------------------------
# Row 12: record_weights.py to-ours: temporaries unique to the call; a finished output is never replaced

def nested_conversions(monkeypatch, tmp_path, second_fails: bool):
    """to-ours A into tmp_path/out, and while A writes its model.pt, to-ours B into the same output, to its end (or,
    second_fails, to a SIGTERM in its own write). Returns (A's process, B's process or None, B's exit)."""
    real_write = T.write_file
    calls, second = [], {}

    def write_file(path, content, shown=None):
        calls.append(Path(path))
        if len(calls) == 1:  # A's model.pt: B runs now, whole
            try:
                second["proc"] = in_process(W.main, "to-ours", tmp_path / "record.pt", tmp_path / "out", "--",
                                            *SMALL_FLAGS)
            except SystemExit as e:
                second["exit"] = e.code
        elif len(calls) == 2 and second_fails:  # B's model.pt
            raise SystemExit(143)
        return real_write(path, content, shown)
    monkeypatch.setattr(T, "write_file", write_file)
    first = in_process(W.main, "to-ours", tmp_path / "record.pt", tmp_path / "out", "--", *SMALL_FLAGS)
    monkeypatch.undo()
    return first, second.get("proc"), second.get("exit")


def test_two_conversions_into_one_output_never_touch_each_other(small_final, tmp_path, monkeypatch):
    """Row 12 (the issue's): two conversions shared the temporary folder `.out.partial`; the second deleted the
    first's. Now the second, finished first, keeps its output; the first is refused in one line and leaves
    nothing."""
    torch.save(record_of(small_final), tmp_path / "record.pt")
    first, second, _ = nested_conversions(monkeypatch, tmp_path, second_fails=False)
    assert second.returncode == 0, second.stderr
    one_line_error(first, f"error: {tmp_path / 'out'}: already exists (written while this conversion ran: another "
                          f"to-ours into it?); nothing of the unfinished folder was kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "record.pt"]
    T.load_final_weights(tmp_path / "out", torch.device("cpu"))  # whole


def test_a_conversion_stopped_beside_another_leaves_the_other_whole(small_final, tmp_path, monkeypatch):
    """Row 12's neighbour: the second conversion stopped (SIGTERM) mid-write removed the shared folder the first was
    writing into; the first failed naming its own output."""
    torch.save(record_of(small_final), tmp_path / "record.pt")
    first, second, stopped = nested_conversions(monkeypatch, tmp_path, second_fails=True)
    assert stopped == 143 and first.returncode == 0, first.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "record.pt"]
    T.load_final_weights(tmp_path / "out", torch.device("cpu"))


# -----------------------------------------------------------------------------
# Row 13: data/tokenize_text.py's errors name the output asked for, never the hidden staging file

def corpus(folder: Path, documents: int) -> Path:
    folder.mkdir()
    for i in range(documents):
        (folder / f"{i:02d}.txt").write_text(f"apple {i}. " * 12 + "\n")
    return folder


def enospc_on_shard(number: int):
    """os.fsync failing with a full disk on the number-th fsync of a regular file (a shard's)."""
    real, files = os.fsync, []

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files.append(fd)
            if len(files) == number:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    return fsync


FULL_DISK_CASES = [
    # (what, the shard on whose fsync the disk is full, --val-tokens, the shard the line names)
    ("the second training shard (the issue's)", 2, [], "out_train_000002.bin"),
    ("the first training shard", 1, [], "out_train_000001.bin"),
    ("the validation shard", 1, ["--val-tokens", "100"], "out_val_000000.bin"),
]


@pytest.mark.parametrize("what, number, flags, shard", FULL_DISK_CASES, ids=[c[0] for c in FULL_DISK_CASES])
def test_a_full_disk_names_the_shard_asked_for(tmp_path, capsys, monkeypatch, what, number, flags, shard):
    """Row 13: on a full disk the error named the hidden staging file, not the output asked for."""
    out = tmp_path / "out"
    monkeypatch.setattr(os, "fsync", enospc_on_shard(number))
    code = tokenize_text.main([str(corpus(tmp_path / "text", 4)), "--out", str(out), "--shard-tokens", "60", *flags,
                               "--bpe-file", str(tokenize_text.BUNDLED_BPE), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"error: cannot write {out / shard}: the disk is full (No space left on device)"], err
    assert not out.exists()  # the folder it made, with nothing in it, taken back


# -----------------------------------------------------------------------------
# Deliver 1 and 2: the one reader and the one writer, the same in train_gpt.py and data/safe_write.py

KINDS = ["regular", "link to a regular file", "missing", "dangling link", "FIFO", "link to /dev/null",
         "link to /dev/zero", "socket", "folder", "link to a folder"]


def neighbour(root: Path, kind: str) -> Path:
    return root / kind.replace("/", "_")


@pytest.fixture(scope="module")
def neighbours():
    """One path of each kind in KINDS (but the regular file, written per example), in a folder with a short path;
    the FIFO kept unblocked for the module's tests."""
    with tempfile.TemporaryDirectory(prefix="io") as folder, unblocked_fifo(neighbour(Path(folder), "FIFO")):
        root = Path(folder)
        (root / "real").mkdir()
        neighbour(root, "link to a regular file").symlink_to(root / "real" / "file")
        neighbour(root, "dangling link").symlink_to(root / "nowhere")
        neighbour(root, "link to /dev/null").symlink_to("/dev/null")
        neighbour(root, "link to /dev/zero").symlink_to("/dev/zero")
        server = listen_socket(neighbour(root, "socket"))
        neighbour(root, "folder").mkdir()
        neighbour(root, "link to a folder").symlink_to(root / "folder")
        try:
            yield root
        finally:
            server.close()


def refused_text(impl, call):
    """(the FileRefused's message, or None if call returned) and what it returned."""
    try:
        return None, call()
    except impl.FileRefused as e:
        return str(e), None


READ_KIND = {"FIFO": "a FIFO", "link to /dev/null": "a device", "link to /dev/zero": "a device",
             "socket": "a socket", "folder": "a folder", "link to a folder": "a folder"}


@PROPERTY
@given(kind=st.sampled_from(KINDS), size=st.integers(0, 40), limit=st.none() | st.integers(0, 40),
       json_text=st.booleans())
def test_property_the_reader_gives_a_regular_file_s_bytes_or_one_line(neighbours, kind, size, limit, json_text):
    """Any kind of path, any size and limit: read_regular (and read_json) give the bytes of a regular file within the
    limit, a link to one followed; anything else is one line `PATH: why` naming its kind, never a wait on a FIFO or
    a read of a device; train_gpt.py's and safe_write's say the same words."""
    real = neighbours / "real" / "file"
    content = (json.dumps("x" * max(size - 2, 0)) if json_text else "y" * size).encode()
    real.write_bytes(content)
    path = real if kind == "regular" else neighbour(neighbours, kind)
    answers = [refused_text(impl, lambda: impl.read_regular(path, "a test file", limit)) for impl in (T, safe_write)]
    assert answers[0] == answers[1], answers
    message, data = answers[0]
    if kind in ("regular", "link to a regular file") and (limit is None or len(content) <= limit):
        assert message is None and data == content
        read = [refused_text(impl, lambda: impl.read_json(path, "a test file", limit)) for impl in (T, safe_write)]
        assert read[0] == read[1] and (read[0][1] == json.loads(content) if json_text else read[0][0] is not None)
        return
    assert message is not None and message.startswith(f"{path}: ") and "\n" not in message, message
    if kind in READ_KIND:
        assert message == f"{path}: {READ_KIND[kind]}, not a test file"
    elif kind in ("missing", "dangling link"):
        assert message == f"{path}: cannot read (No such file or directory)"
    else:
        assert message == f"{path}: {len(content):,} bytes, more than a test file holds (at most {limit:,})"


@PROPERTY
@given(kind=st.sampled_from(KINDS), data=st.binary(max_size=40), shown=st.booleans())
def test_property_the_writer_writes_a_regular_file_or_refuses_before_writing(neighbours, kind, data, shown):
    """Any kind of path as an output: write_file replaces a regular file or makes a new one, through a temporary it
    leaves nowhere; anything else (a link to a regular file too: a rename would replace the link, not the file) is
    refused in one line naming the output asked for, and left exactly as it was, with no temporary beside it. Both
    writers say the same words."""
    real = neighbours / "real" / "file"
    real.write_bytes(b"before")
    path = neighbours / "real" / "new" if kind == "missing" else real if kind == "regular" else neighbour(neighbours,
                                                                                                          kind)
    name = neighbours / "asked-for" if shown else None
    answers = []
    for impl in (T, safe_write):
        before = lstat_of(path) if os.path.lexists(path) else None
        message, _ = refused_text(impl, lambda: impl.write_file(path, data, name))
        answers.append(message)
        if message is None:
            assert kind in ("regular", "missing") and path.read_bytes() == data and stat.S_ISREG(os.lstat(path).st_mode)
        else:
            assert kind not in ("regular", "missing") and lstat_of(path) == before
            assert message.startswith(f"{name or path}: ") and "refused, nothing written" in message
            assert real.read_bytes() == b"before"  # what a link names is not written either
        assert hidden(neighbours) == [] and hidden(neighbours / "real") == []
        (neighbours / "real" / "new").unlink(missing_ok=True)
        real.write_bytes(b"before")
    assert answers[0] == answers[1], answers


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shown", [False, True], ids=["its own name", "the name asked for"])
def test_a_failed_write_names_the_output_asked_for_and_leaves_nothing(tmp_path, impl, shown):
    """A full disk mid-write: one line naming the output the user asked for (`shown` for a file written into a
    folder renamed later), never the temporary; no temporary is left, the old file is untouched."""
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    name = tmp_path / "final" / "out.bin" if shown else None
    with unittest.mock.patch.object(os, "fsync", side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), \
            pytest.raises(write_failed(impl)) as failed:
        impl.write_file(out, b"new" * 1000, name)
    assert str(failed.value) == f"cannot write {name or out}: the disk is full (No space left on device)"
    assert out.read_bytes() == b"old" and hidden(tmp_path) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_two_writes_into_one_output_each_use_their_own_temporary(tmp_path, impl):
    """A write into the output while another is between its temporary and its rename: each has a temporary of its
    own (mkstemp), both complete, the last rename wins, and nothing is left beside the output."""
    out = tmp_path / "out"
    real_fsync, temporaries = os.fsync, []

    def fsync(fd):
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # the folder's, after a rename
            return real_fsync(fd)
        temporaries.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(temporaries) == 1:
            impl.write_file(out, b"second")  # the second write runs whole inside the first
        return real_fsync(fd)
    with unittest.mock.patch.object(os, "fsync", fsync):
        impl.write_file(out, b"first")
    assert len(set(temporaries)) == 2 and out.read_bytes() == b"first" and hidden(tmp_path) == []

"""How every torch-free script reads and writes files: data/, records/records.py and tools/cost_model.py. The
stdlib-only twin of train_gpt.py's reader and writer (open_regular, read_regular, read_json, output_problem,
write_file, temporary_prefix): train_gpt.py is one self-contained file and imports nothing of the project, and
these scripts must run without torch, so the two are kept apart and held equal by the same tests
(tests/test_readers_io.py runs each property against both). The module keeps its first name, safe_write, which
data/'s scripts import.

Reading. open_regular(path, what, limit) opens without blocking (O_NONBLOCK: a FIFO opens at once, without a
    writer), then checks with fstat what it opened: a regular file, of at most `limit` bytes. A FIFO, a device, a
    socket, a folder, or a link to one, is refused in one line naming the path (FileRefused), before a byte is
    read: a FIFO once blocked a tool forever, /dev/zero was read until memory ran out. read_regular reads such a
    file whole, read_json parses it (JSON nested thousands deep is refused, not a RecursionError traceback).
Writing. An output is absent or a regular file (output_problem): a FIFO, a device, a socket, a folder or a
    symbolic link there is refused before anything is written (a rename over `-o /dev/null` would have replaced
    the device). Then:
  atomic_file(path): the data goes to a temporary file in path's folder (mkstemp: a name unique to the call), is
      fsynced, and only then renamed over path (and the folder fsynced, so that the rename survives a power cut).
      Any error or signal removes the temporary instead: a full disk, a crash or Ctrl-C never leaves a
      half-written file, under the final name or beside it. commit(tmp, path) does the last two steps for a file
      someone else wrote (a download). write_file(path, data, shown) writes bytes so, and words a failure as
      WriteError naming `shown` (the name the user asked for), never the temporary.
  FolderLock(folder): a folder that one run fills with several files (a tokenized data set, downloaded shards)
      is claimed for the whole write, so that two runs never interleave their files. The claim is an flock on
      FOLDER/.writing.lock, which holds the holder's pid; a second writer is refused in one line (FolderBusy).
      The kernel drops an flock when its holder dies, however it dies (kill -9 too), so a lock file whose flock
      is free was left by a run that is gone: the next writer says so in one line and takes the folder over.
      Forked children (a tokenizer's worker pool) do not keep the claim alive after their parent is gone.
      The lock is opened with O_NOFOLLOW and must be a regular file with one name: a symbolic link, a hard link
      to another file, a folder, a FIFO or a device there is refused in one line naming it (NotALockFile),
      never followed, truncated or written (a planted link once made the tokenizer overwrite the file it named).
      A lock file this user may not open is refused naming it too (LockFileDenied), not as an unwritable folder.
      What a lock file holds is written by whoever made it: it reaches the terminal only through visible().

SIGTERM's default action ends Python without running finally blocks or except clauses. While either helper is
in use, a process that has no SIGTERM handler of its own gets one that raises SystemExit(143) (sigterm_exits),
so that the cleanup runs and the process still exits with the code a shell gives a SIGTERM.
"""

import contextlib
import errno
import fcntl
import json
import os
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path

LOCK_NAME = ".writing.lock"
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM
FILE_MODE = 0o644  # mkstemp makes files private; what data/ writes is ordinary data


class LockError(Exception):
    """A folder that cannot be claimed; the message is one line naming the folder and its lock file."""


class FolderBusy(LockError):
    """Another live run holds the folder's lock."""


class NotALockFile(LockError):
    """FOLDER/.writing.lock is something no run of data/ made (a link, a folder, a FIFO): it is not touched."""


class LockFileDenied(LockError):
    """FOLDER/.writing.lock exists but this user may not open it (another user's, or its permissions changed)."""


TEMPORARY_NAME_BYTES = 100  # of NAME kept in a temporary's name; train_gpt.py's temporary_prefix keeps as many


def cut_to_bytes(name: str, limit: int) -> str:
    """name's longest start that takes at most limit bytes as the file system stores it (UTF-8; bytes that are not
    UTF-8 stay as they are, os.fsencode's way), never ending in part of a character."""
    raw = os.fsencode(name)
    if len(raw) <= limit:
        return name
    cut = limit
    while cut > max(limit - 3, 0) and raw[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: inside a character
        cut -= 1
    return os.fsdecode(raw[:cut])


def temporary_prefix(name: str) -> str:
    """`.NAME.`, how a hidden temporary beside the file NAME starts, with NAME cut to TEMPORARY_NAME_BYTES bytes: a
    file name may have 255 bytes, and NAME cut to 100 characters could still take 400 (a legal name of 4-byte
    characters then failed with "File name too long", naming the temporary). Every temporary data/ makes is named
    through this (mkstemp and mkdtemp add their random part)."""
    return f".{cut_to_bytes(name, TEMPORARY_NAME_BYTES)}."


def visible(text: str) -> str:
    """text with each character that is not printable (escape sequences, line and bidi marks) written as a Python
    string literal writes it (`\\x1b`): file names and lock contents on a terminal cannot move the cursor, clear
    the screen or hide a line. Every data/ tool prints names it did not choose through this."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class FileRefused(ValueError):
    """A path that is not what a reader or writer takes: one line, `PATH: why` (why alone in .why, for a caller that
    names the file its own way)."""

    def __init__(self, path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


class WriteError(Exception):
    """A write that failed (a full disk): one line naming the output the user asked for, never its temporary."""


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words (train_gpt.file_kind's)."""
    kinds = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
             stat.S_IFBLK: "a device", stat.S_IFLNK: "a symbolic link"}
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path, what: str = "a regular file", limit: int | None = None):
    """path opened for reading (binary), refused (FileRefused) unless it is a regular file of at most `limit` bytes;
    a link is followed. stat first, so that a device is never opened (opening one can act: a tape rewinds); then an
    open that does not wait (a FIFO swapped in meanwhile opens at once) and fstat, so that what is read is what
    was checked."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(path, f"{file_kind(mode)}, not {what}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise FileRefused(path, f"cannot read ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"{file_kind(st.st_mode)}, not {what}")
        if limit is not None and st.st_size > limit:
            raise FileRefused(path, f"{st.st_size:,} bytes, more than {what} holds (at most {limit:,})")
        os.set_blocking(fd, True)
    except BaseException:
        f.close()
        raise
    return f


def read_regular(path, what: str = "a regular file", limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular), read through the one checked open; a
    file that grew past the limit since its size was read is refused too."""
    with open_regular(path, what, limit) as f:
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise FileRefused(path, f"cannot read ({e.strerror or e})") from None
    if limit is not None and len(data) > limit:
        raise FileRefused(path, f"more than {what} holds (at most {limit:,} bytes)")
    return data


def read_json(path, what: str = "a JSON file", limit: int | None = None):
    """The JSON value a regular file of at most `limit` bytes holds (read_regular); FileRefused says why it is not
    one: not UTF-8, not JSON, or nested too deeply for the parser (its RecursionError was a traceback)."""
    data = read_regular(path, what, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise FileRefused(path, "not UTF-8 text") from None
    except RecursionError:
        raise FileRefused(path, "nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and ints of thousands of digits
        raise FileRefused(path, first_line(e)) from None


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type where it has no message."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def output_problem(path) -> str | None:
    """Why path cannot be an output, or None: an output is absent or a regular file. A FIFO, a device, a socket or
    a folder there would be replaced by the rename (as root, `-o /dev/null` replaced the system's device); a
    symbolic link would be replaced by a file too, the file it names left as it was, so a link is refused
    whatever it names (name the file itself)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a component that is not a folder: the write fails with the same words
        return f"cannot write there ({e.strerror or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        return f"a symbolic link (to {visible(target[:200])}{'...' if len(target) > 200 else ''}), not a regular " \
               f"file: refused, nothing written (name the file itself, or a new one)"
    return f"{file_kind(st.st_mode)}, not a regular file: refused, nothing written (name a new file)"


def check_output(path, shown=None) -> None:
    """FileRefused naming `shown` (or path) unless path can be an output (output_problem)."""
    problem = output_problem(path)
    if problem is not None:
        raise FileRefused(shown or path, problem)


def write_error(path, error: OSError) -> str:
    """One line for a write that failed: which file (the one the user asked for), and why in plain words."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = f"the disk is full ({error.strerror})" if full else (error.strerror or str(error))
    return f"cannot write {path}: {why}"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # only the main thread may set handlers


@contextlib.contextmanager
def sigterm_exits():
    """For the block, SIGTERM raises SystemExit(143) instead of ending the process on the spot, so that the
    block's cleanup runs. A process with its own SIGTERM handler (or one that ignores SIGTERM) keeps it."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_143(signum, frame):
        raise SystemExit(SIGTERM_EXIT)

    signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred():
    """For a block that must happen whole or not at all (a few renames): SIGINT and SIGTERM that arrive during
    it take effect when it ends, through the handlers that were there before."""
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in watched}
    if not _in_main_thread() or None in previous.values():  # None: a handler Python cannot restore
        yield
        return
    caught = []
    for signum in watched:
        signal.signal(signum, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def fsync_folder(folder) -> None:
    """Makes the renames and removals in folder durable. A file system that cannot fsync a folder is let be."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _remove(path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def commit(tmp, path) -> None:
    """Renames tmp, a finished file written by someone else (a download) on path's file system, over path,
    after fsyncing it; a path that cannot be an output (output_problem) is refused (FileRefused). On any failure,
    or a signal, tmp is removed and the error goes on."""
    with sigterm_exits():
        try:
            check_output(path)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        fsync_folder(Path(path).parent)


@contextlib.contextmanager
def atomic_file(path, shown=None):
    """Yields a binary file, open for writing, that becomes path when the block ends without an error (see the
    module docstring). Its name, for a check of what was written before it is kept: Path(f.name). A path that
    cannot be an output (output_problem) is refused first, naming `shown` (or path), before anything is made. An
    error inside the block, or in the fsync and rename, removes the temporary and goes on; OSErrors are the
    caller's to word (write_error)."""
    path = Path(path)
    check_output(path, shown)
    with sigterm_exits():
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path.name), suffix=".tmp", dir=path.parent)
        try:
            try:
                os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)
            with open(tmp, "wb") as f:  # by name, so that f.name is the path
                yield f
                f.flush()
                os.fsync(f.fileno())
            check_output(path, shown)  # again, just before the rename: made since the first check
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        fsync_folder(path.parent)


def write_file(path, data: bytes, shown=None) -> None:
    """Writes data to path with atomic_file: an output that is not a regular file is refused (FileRefused), a
    failed write (a full disk) is a WriteError naming `shown`, the name the user knows the file by (a file written
    into a folder renamed whole later), else path; never the temporary."""
    try:
        with atomic_file(path, shown) as f:
            view = memoryview(data).cast("B")
            while view:  # os.write until every byte is out, as train_gpt.write_all: the one that cannot go on says
                view = view[os.write(f.fileno(), view):]  # why (ENOSPC)
    except OSError as e:
        raise WriteError(write_error(shown or path, e)) from None


# The descriptors of the locks this process holds, closed in forked children: an flock lives as long as any
# descriptor of it is open, and a worker left behind by a killed parent must not keep the folder claimed.
_HELD = set()
_AT_FORK = []


def _close_held_in_child():
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _program() -> str:
    """This process's script, for the lock file's second word (a refused run names it)."""
    script = sys.argv[0] if sys.argv else ""
    return Path(script).name if script not in ("", "-c", "-m") else "python"


class FolderLock:
    """`with FolderLock(folder, name):` claims folder (which must exist) for this run; see the module docstring.
    name is how messages call the folder, e.g. "--out data/mine". Raises FolderBusy if a live run holds it.
    After entering, stale_holder is the pid line of a gone run whose lock file was found, else None."""

    def __init__(self, folder, name: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.name = name or str(self.folder)
        self.stale_holder = None
        self._fd = None
        self._owner = None
        self._signals = None

    def __enter__(self):
        self._signals = sigterm_exits()
        self._signals.__enter__()
        try:
            self._acquire()
        except BaseException:
            self._signals.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._release()
        finally:
            self._signals.__exit__(None, None, None)

    def _acquire(self):
        if not _AT_FORK:
            os.register_at_fork(after_in_child=_close_held_in_child)
            _AT_FORK.append(True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # The holder removes the file before it lets go: if we locked a removed file, lock the new one.
                current = os.lstat(self.path)
                locked = os.fstat(fd)
                if (current.st_dev, current.st_ino) == (locked.st_dev, locked.st_ino):
                    break
            except BlockingIOError:
                holder = self._describe(os.pread(fd, 256, 0))
                os.close(fd)
                raise FolderBusy(f"{self.name} is being written by another run ({holder}); wait for it to finish "
                                 f"(its lock file: {visible(str(self.path))})") from None
            except FileNotFoundError:
                pass  # removed between our flock and stat: try again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self._fd, self._owner = fd, os.getpid()
        _HELD.add(fd)
        left = os.pread(fd, 256, 0)
        if left.strip():
            self.stale_holder = self._describe(left)
            print(f"note: {self.name}: the run that claimed it ({self.stale_holder}) {self._fate(left)}; "
                  f"taking over its stale lock file {visible(str(self.path))}", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {_program()}\n".encode(), 0)

    def _open(self) -> int:
        """The lock file, opened (and made, if missing) without following a link, and without waiting on a FIFO;
        refused (NotALockFile) unless it is a regular file with no other name."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, FILE_MODE)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
                raise self._not_a_lock(os.lstat(self.path)) from None
            if e.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(self.path):
                # the lock file refused us, not the folder: "cannot write" the folder was untrue, and named no file
                raise LockFileDenied(f"{self.name}: its lock file {visible(str(self.path))} cannot be opened "
                                     f"({e.strerror}): another user's, or its permissions were changed; remove it "
                                     f"if no run is writing there, and run again") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise self._not_a_lock(st)
        os.set_blocking(fd, True)
        return fd

    def _not_a_lock(self, st: os.stat_result) -> NotALockFile:
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(self.path)
            kind = f"a symbolic link (to {visible(target[:200])}{'...' if len(target) > 200 else ''})"
        elif stat.S_ISREG(st.st_mode):
            kind = f"a file with {st.st_nlink} names (a hard link: truncating it would change the others)"
        else:
            kind = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}.get(
                stat.S_IFMT(st.st_mode), "a device")
        return NotALockFile(f"{self.name}: its lock file {visible(str(self.path))} is {kind}, not one a run of "
                            f"data/ made; it was left as it is: remove it if no run is writing there, and run again")

    def _release(self):
        if self._fd is None or os.getpid() != self._owner:  # a forked child never removes its parent's lock
            return
        try:
            _remove(self.path)  # before letting go, so that a waiting open() sees the file gone (see _acquire)
        finally:
            _HELD.discard(self._fd)
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _describe(raw: bytes) -> str:
        """The holder a lock file names ("pid 123, tokenize_text.py"), shown with visible(): anyone could have
        written the file."""
        words = raw.decode(errors="replace").split()
        if not words:
            return "pid not written yet"
        return visible(f"pid {words[0]}" + (f", {' '.join(words[1:])}" if len(words) > 1 else ""))

    @staticmethod
    def _fate(raw: bytes) -> str:
        """What became of a stale lock's holder (the free flock already says it is gone)."""
        try:
            os.kill(int(raw.split()[0]), 0)
        except ProcessLookupError:
            return "is no longer running"
        except (ValueError, OverflowError):
            return "is gone"
        except PermissionError:  # a process of another user took its pid
            pass
        return "no longer holds it"

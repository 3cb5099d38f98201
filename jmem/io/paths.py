"""Output paths checked before the work that fills them.

A run that writes its results at the end (a sweep, an evaluation, a quantized
model, a checkpoint after the first steps) should fail on a path it cannot
write before it starts, not after it has done the work. `prepare_output`
creates the directory a flag writes into, or raises one clear error;
`undo_on_failure` also removes what a failed run created there;
`new_dirs_removed_if_left_empty` only the directories it created and left empty.

Example:
    >>> out = prepare_output("results/run1/sweep.json", "--out")   # creates results/run1/
    >>> ckpt = prepare_output("~/ckpt/run1", "--ckpt-dir", directory=True)
    >>> with undo_on_failure("models/student", "--save-student", directory=True):
    ...     train_and_save()   # an exception leaves no (empty or partial) models/student behind
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import pathlib
import shutil
import sys
import threading
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None


_CREATED_DIRS: list[pathlib.Path] = []  # made by `prepare_output`, deepest first per call (`remove_unused_dirs`)


LOCK_FILE = ".lock"  # held (a POSIX record lock) by the process writing the directory

# POSIX record locks belong to the process, and closing any descriptor of the file drops them: one
# open file per directory, shared by this process's holders, closed when the last one lets go.
_HELD: dict[str, list] = {}  # resolved directory -> [open lock file, holders]
_HELD_LOCK = threading.Lock()


class DirectoryLock:
    """This process's hold on a directory's lock (`lock_directory`); `release` (or garbage
    collection) lets go, and the lock itself goes with the process's last holder."""

    def __init__(self, key: str):
        self.key = key

    def release(self) -> None:
        with _HELD_LOCK:
            if self.key is None:
                return
            entry = _HELD[self.key]
            entry[1] -= 1
            if entry[1] == 0:
                entry[0].close()
                del _HELD[self.key]
            self.key = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the module's globals may be gone
            pass


def lock_directory(path: pathlib.Path) -> DirectoryLock | None:
    """A hold on directory `path`'s lock for this process; None where the platform, a read-only
    directory or the file system allows no lock (the writes there then fail or go on unlocked, as
    before locks); raises BlockingIOError when another process holds it."""
    if fcntl is None:
        return None
    key = str(pathlib.Path(path).resolve())
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1] += 1
            return DirectoryLock(key)
        try:
            f = open(pathlib.Path(key) / LOCK_FILE, "a+")
        except OSError:  # read-only: whatever writes there fails with its own message
            return None
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise BlockingIOError(f"{path} is locked by another process") from None
            return None  # e.g. NFS without a lock daemon: no lock, not "in use"
        _HELD[key] = [f, 1]
        return DirectoryLock(key)


def quiet_closed_stdout() -> None:
    """After a reader of stdout went away (`| head`): point stdout at /dev/null, so that the flush at
    exit raises no second BrokenPipeError (the command then ends quietly, as SIGPIPE would end it)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a file descriptor
        pass


def remove_unused_dirs() -> None:
    """Remove the directories `prepare_output` created that are still empty (a run that failed before it
    wrote its outputs leaves nothing behind), and forget them all."""
    for p in _CREATED_DIRS:
        with contextlib.suppress(OSError):
            p.rmdir()
    forget_created_dirs()


def forget_created_dirs() -> None:
    """Keep the directories `prepare_output` created so far (a run that succeeded)."""
    _CREATED_DIRS.clear()


def check_separate(outputs: dict[str, str | os.PathLike | None]) -> dict[str, pathlib.Path]:
    """No two of the `{flag: path}` outputs (None: not given) at one path, `~` and `..` resolved: a ValueError
    naming both, since one output would overwrite the other. Returns the given ones resolved, by flag."""
    given = {flag: value for flag, value in outputs.items() if value}
    resolved = {flag: pathlib.Path(value).expanduser().resolve() for flag, value in given.items()}
    for a, b in itertools.combinations(given, 2):
        if resolved[a] == resolved[b]:
            raise ValueError(f"{a} {str(given[a])!r} and {b} {str(given[b])!r} are one path; accepted: separate "
                             "paths (one output would overwrite the other)")
    return resolved


def prepare_output(value: str | os.PathLike, flag: str, *, directory: bool = False) -> pathlib.Path:
    """Create the directory that the output `value` of `flag` goes into; return the path.

    Args:
        value: a file path, or (with `directory`) a directory path; `~` is expanded.
        flag: the flag's name for the error message (e.g. "--out").
        directory: `value` is itself a directory (created) rather than a file (its parent is).

    Raises:
        ValueError: one line naming the flag and the path when the directory cannot be
            created or written into, when a file path names an existing directory, or an
            existing file that cannot be written.
    """
    if not str(value).strip():
        raise ValueError(f"{flag} {str(value)!r} is empty; accepted: a {'directory' if directory else 'file'} path")
    path = pathlib.Path(value).expanduser()
    # pathlib drops a trailing separator: "res/" named a file "res" and the write failed at the run's end.
    if not directory and (path.is_dir() or str(value).endswith(("/", os.sep))):
        raise ValueError(f"{flag} {str(value)!r} is a directory; accepted: a file path")
    target = path if directory else path.parent
    new = [p for p in (target, *target.parents) if not p.exists()]  # deepest first
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        in_the_way = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{str(in_the_way)!r} is a file" if in_the_way is not None else (e.strerror or str(e))
        raise ValueError(f"{flag} {str(value)!r}: cannot create directory {str(target)!r} ({reason}); "
                         "accepted: a writable path") from None
    _CREATED_DIRS.extend(new)
    # Permissions (or a read-only file system) would otherwise surface only at the write.
    if not directory and path.exists():
        where, mode = path, os.W_OK  # an existing file is overwritten
    else:
        where, mode = target, os.W_OK | os.X_OK  # new entries are made in the directory
    if not os.access(where, mode):
        raise ValueError(f"{flag} {str(value)!r}: {str(where)!r} is not writable; accepted: a writable path")
    if not directory:
        _try_opening(path, flag, value)
    return path


def _try_opening(path: pathlib.Path, flag: str, value) -> None:
    """Open the file for writing as the run will (os.access answers yes to root everywhere, /proc included):
    an existing file for appending (its content kept), a new one created and taken away again."""
    target = pathlib.Path(os.path.realpath(path))  # a link's target, which the write creates
    existed = target.exists()
    try:
        fd = os.open(target, os.O_WRONLY | (os.O_APPEND if existed else os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # made meanwhile by someone else: writable as far as this check goes
        return
    except OSError as e:
        raise ValueError(f"{flag} {str(value)!r}: cannot {'write' if existed else 'create'} the file "
                         f"({e.strerror or e}); accepted: a writable path") from None
    os.close(fd)
    if not existed:
        os.unlink(target)


@contextlib.contextmanager
def new_dirs_removed_if_left_empty(*values: str | os.PathLike | None) -> Iterator[None]:
    """Run the block; if it raises, remove the directories on the way to the outputs `values`
    (directories or files; None skipped) that did not exist before it and are empty after it.
    Nothing else is touched: a failed run's checkpoints or logs stay."""
    new = {p for v in values if v for path in [pathlib.Path(v).expanduser()] for p in (path, *path.parents)
           if not p.exists()}
    try:
        yield
    except BaseException:
        for p in sorted(new, key=lambda p: len(p.parts), reverse=True):  # deepest first
            with contextlib.suppress(OSError):  # not empty, not a directory, or gone
                if [e.name for e in p.iterdir()] == [LOCK_FILE]:  # the failed run's own lock: empty
                    (p / LOCK_FILE).unlink()
                p.rmdir()
        raise


@contextlib.contextmanager
def undo_on_failure(value: str | os.PathLike, flag: str, *, directory: bool = False) -> Iterator[pathlib.Path]:
    """`prepare_output`, then run the block; if it raises, remove what the run created.

    For a directory output (which the caller has checked is new or empty) its whole content goes
    and the directory too if this call created it; a file output goes if it did not exist before.
    The directories created on the way are removed when left empty. A file output that existed
    before (overwritten on purpose) is left as the block left it.
    """
    path = pathlib.Path(value).expanduser()
    new = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    prepare_output(value, flag, directory=directory)
    try:
        yield path
    except BaseException:
        if directory and path.is_dir():
            for child in path.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        elif path in new and path.is_file():
            path.unlink(missing_ok=True)
        for p in new:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise

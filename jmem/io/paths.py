"""Output paths checked before the work that fills them.

A run that writes its results at the end (a sweep, an evaluation, a quantized
model, a checkpoint after the first steps) should fail on a path it cannot
write before it starts, not after it has done the work. `prepare_output`
creates the directory a flag writes into, or raises one clear error.

Example:
    >>> out = prepare_output("results/run1/sweep.json", "--out")   # creates results/run1/
    >>> ckpt = prepare_output("~/ckpt/run1", "--ckpt-dir", directory=True)
"""

from __future__ import annotations

import os
import pathlib


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
    path = pathlib.Path(value).expanduser()
    if not directory and path.is_dir():
        raise ValueError(f"{flag} {str(value)!r} is a directory; accepted: a file path")
    target = path if directory else path.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        in_the_way = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{str(in_the_way)!r} is a file" if in_the_way is not None else (e.strerror or str(e))
        raise ValueError(f"{flag} {str(value)!r}: cannot create directory {str(target)!r} ({reason}); "
                         "accepted: a writable path") from None
    # Permissions (or a read-only file system) would otherwise surface only at the write.
    if not directory and path.exists():
        where, mode = path, os.W_OK  # an existing file is overwritten
    else:
        where, mode = target, os.W_OK | os.X_OK  # new entries are made in the directory
    if not os.access(where, mode):
        raise ValueError(f"{flag} {str(value)!r}: {str(where)!r} is not writable; accepted: a writable path")
    return path

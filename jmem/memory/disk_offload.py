"""ZeRO-Infinity style optimizer state on disk, updated one chunk at a time on the host.

The optimizer state of every trainable leaf lives in `.npy` files (numpy memmaps) under a
directory the user names. A chunk is one trainable leaf, or one layer slice `[i:i+1]` of a
stacked leaf under `layers`; the update reads a chunk's state, runs the optimizer on the
chunk alone (a jitted program on the CPU backend), writes the new state back and moves on,
so host memory holds the state of one chunk at a time (plus the gradients and parameters,
which the step brings to the host anyway).

Chunking is exact for optimizers whose update of a leaf depends only on that leaf: adamw,
sgd, `jmem.optim.adafactor` (its statistics, update clipping and parameter scale are per
layer for stacked leaves; a `[1, ...]` slice keeps the `layers` axis, so the same rule
applies) and the f32 master weights of `with_master_weights`. Global-norm clipping is the
one cross-leaf step; it runs over the whole gradient (in f32) before the chunks
(`clip=`), so build the optimizer without it. Non-finite step skipping (fp16 loss
scaling) is cross-leaf too and is refused (`jmem.train` checks it).

Files, not tensorstore or Orbax: a chunk is a contiguous slice of one array, which a
memmap reads and writes in place with no extra dependency, and the page cache it goes
through is memory the kernel can reclaim.

Example:
    >>> disk = DiskOptimizer(optax.adamw(1e-3), train_params, "/scratch/opt", clip=1.0)
    >>> handle = disk.place(train_params)      # writes tx.init of every chunk
    >>> new_params, handle = disk.update(grads, handle, train_params)
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import pathlib
import re
import shutil
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem.checks import is_number
from jmem.io.paths import lock_directory
from jmem.memory.offload import LAYERS_KEY, OffloadError
from jmem.memory.precision import cast_floating
from jmem.pytree import key_name

_META = "chunks.json"
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # resolved directory -> its DiskOptimizer
_CHUNK_FILE = re.compile(r"chunk\d{5,}_\d+\.npy")  # every name `_chunk_file` makes


def _storage_dtype(dtype) -> np.dtype:
    """The dtype a state leaf's file holds: its own, or an unsigned integer of its size for a dtype `.npy`
    cannot name (bfloat16 and the float8 types, which it would write as raw bytes and read back as void)."""
    dtype = np.dtype(dtype)
    return np.dtype(f"u{dtype.itemsize}") if dtype.kind == "V" else dtype


def _chunk_file(c: int, j: int) -> str:
    """The file of chunk `c`'s `j`-th state array."""
    return f"chunk{c:05d}_{j}.npy"


class OffloadWriteError(OSError):
    """The state files could not be written (e.g. the disk is full). A failed update may have written
    some chunks: the live state is then of no single step, and only a snapshot restores it."""


class DiskState(NamedTuple):
    """What a train state holds of an optimizer kept on disk: its update count."""

    updates: jax.Array  # i32[]


def placeholder_transform() -> optax.GradientTransformation:
    """The transformation a train state built for disk offload carries: `init` gives a
    `DiskState` (no arrays of parameter size), `update` is done by `DiskOptimizer`."""

    def init(params):
        del params
        return DiskState(jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        raise OffloadError("this optimizer state is on disk: run the step through jmem.memory.offload")

    return optax.GradientTransformation(init, update)


def check_snapshot(source) -> None:
    """OffloadError unless `source` holds a complete optimizer-state snapshot (`DiskOptimizer.snapshot`):
    its chunks.json, and every file it lists with the shape and dtype it lists."""
    src = pathlib.Path(source)
    per_chunk = _snapshot_meta(src).get("state_per_chunk", [])  # none in snapshots of earlier versions
    try:
        shapes = [[(tuple(s), np.dtype(d)) for s, d in chunk] for chunk in per_chunk]
    except (ValueError, AttributeError, TypeError) as e:
        raise _damaged(src, f"{_META}: {e}") from None
    _check_files(src, shapes)


def _snapshot_meta(src: pathlib.Path) -> dict:
    """A snapshot's chunks.json; OffloadError when there is none."""
    if not (src / _META).is_file():
        raise OffloadError(f"no optimizer-state snapshot in {src} (disk offload needs the files saved "
                           f"with the checkpoint)")
    try:
        return json.loads((src / _META).read_text())
    except (OSError, ValueError) as e:
        raise _damaged(src, f"{_META}: {e}") from None


def _check_files(src: pathlib.Path, shapes) -> None:
    """OffloadError naming the first file of chunk c's state leaves (`shapes[c]`: [(shape, dtype), ...]) in
    `src` that is missing, unreadable, shorter than its header says (a truncated copy) or of another shape."""
    for c, chunk in enumerate(shapes):
        for j, want in enumerate(chunk):
            f = src / _chunk_file(c, j)
            try:
                a = np.load(f, mmap_mode="r")  # the header only; a file shorter than it says is a ValueError
            except FileNotFoundError:
                raise _damaged(src, f"{f.name} is missing") from None
            except (OSError, ValueError) as e:
                raise _damaged(src, f"{f.name}: {e}") from None
            if (a.shape, a.dtype) != (want[0], _storage_dtype(want[1])):
                raise _damaged(src, f"{f.name} holds {a.dtype}{list(a.shape)}; expected "
                                    f"{_storage_dtype(want[1])}{list(want[0])} ({want[1]})")


def _damaged(src: pathlib.Path, why: str) -> OffloadError:
    step = src.parent.parent / src.name  # <ckpt-dir>/offload_optimizer/<step> beside <ckpt-dir>/<step>
    return OffloadError(f"optimizer-state snapshot {src} is damaged ({why}); accepted: a complete snapshot: delete "
                        f"the checkpoint {step} to resume from the step before it")


def _lock_directory(path: pathlib.Path):
    """An open lock file on `path`, or OffloadError when another process holds it."""
    try:
        return lock_directory(path)
    except BlockingIOError:
        raise OffloadError(f"offload directory {path} is in use by another running process's optimizer state "
                           "(two runs would overwrite each other's files); accepted: a directory of its own for "
                           "each run") from None


def _write_error(f: pathlib.Path, e: OSError) -> OffloadWriteError:
    return OffloadWriteError(e.errno, f"cannot write the optimizer state file {f} ({e.strerror or e}); the state "
                             "files may now be partly updated (free space, then resume from the latest checkpoint)")


def _reserve(f: pathlib.Path) -> None:
    """Allocate the whole file now (a memmap's file is sparse until its pages are written)."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        with open(f, "r+b") as fh:
            os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: written as before
            raise


def _chunk_update(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


class DiskOptimizer:
    """An optax transformation whose state lives in files, updated chunk by chunk.

    Args:
        tx: the optimizer (a per-leaf one; see the module docstring), without global-norm clipping.
        train: the trainable parameter tree (arrays or ShapeDtypeStructs; `None` leaves are frozen).
        directory: where the state files go (created; files of an earlier run are replaced by `place`).
        clip: global gradient-norm clipping applied before the chunks (0: none).
        layer_chunks: split stacked `layers` leaves into one chunk per layer (else one per leaf).

    Raises:
        OffloadError: `directory` is empty or exists and is not a directory, another optimizer (of
            another process, or an open one of this process) uses it (two runs rewriting one set of
            files would corrupt each other's state), or `clip` is not a finite number >= 0.
    """

    def __init__(self, tx: optax.GradientTransformation, train, directory: str, *, clip: float = 0.0,
                 layer_chunks: bool = True):
        if not (is_number(clip) and math.isfinite(clip) and clip >= 0):
            raise OffloadError(f"clip={clip!r}; accepted: a finite number >= 0 (0: no clipping)")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise OffloadError(f"offload directory {directory!r}; accepted: a non-empty path")
        self.tx, self.clip = tx, float(clip)
        self.directory = str(pathlib.Path(directory).expanduser())
        path = pathlib.Path(self.directory)
        if path.exists() and not path.is_dir():
            raise OffloadError(f"offload directory {self.directory} exists and is not a directory")
        path.mkdir(parents=True, exist_ok=True)
        self._key = str(path.resolve())
        if self._key in _OPEN:
            raise OffloadError(f"offload directory {self.directory} is in use by another DiskOptimizer of this "
                               "process (its place() would delete that one's files); accepted: close() the other "
                               "first, or a directory of its own")
        self._lock = _lock_directory(path)
        _OPEN[self._key] = self
        self._treedef = jax.tree.structure(train, is_leaf=lambda x: x is None)
        leaves = jax.tree.leaves(train, is_leaf=lambda x: x is None)
        paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(train, is_leaf=lambda x: x is None)]
        self._shapes = [None if x is None else (tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
        self.chunks: list[tuple[int, int | None]] = []  # (leaf index, layer or None)
        for i, (p, x) in enumerate(zip(paths, leaves)):
            if x is None:
                continue
            stacked = layer_chunks and x.ndim >= 1 and any(key_name(k) == LAYERS_KEY for k in p)
            self.chunks += [(i, l) for l in range(x.shape[0])] if stacked else [(i, None)]
        self._state_treedefs: list = []
        self._state_shapes = [self._chunk_state_shapes(c) for c in self.chunks]
        self.total_bytes = sum(sum(int(np.prod(s)) * d.itemsize for s, d in shapes) for shapes in self._state_shapes)
        self.chunk_bytes = max((sum(int(np.prod(s)) * d.itemsize for s, d in shapes)
                                for shapes in self._state_shapes), default=0)
        self._cpu = jax.devices("cpu")[0]
        # Over the optimizer alone, not a bound method: no reference cycle keeps a dropped optimizer (and its
        # hold on the directory) alive until a garbage collection.
        self._update_jit = jax.jit(functools.partial(_chunk_update, tx), donate_argnums=(1,))

    def close(self) -> None:
        """Let go of the directory (another run may use it); the files stay."""
        if _OPEN.get(self._key) is self:
            del _OPEN[self._key]
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- chunks -------------------------------------------------------------------------------

    def _chunk_tree(self, chunk, value):
        """The full tree structure with `value` at the chunk's leaf and None elsewhere."""
        i, _ = chunk
        leaves = [None] * self._treedef.num_leaves
        leaves[i] = value
        return jax.tree.unflatten(self._treedef, leaves)

    def _chunk_shape(self, chunk):
        i, layer = chunk
        shape, dtype = self._shapes[i]
        return ((1,) + shape[1:] if layer is not None else shape), dtype

    def _chunk_state_shapes(self, chunk):
        shape, dtype = self._chunk_shape(chunk)
        st = jax.eval_shape(self.tx.init, self._chunk_tree(chunk, jax.ShapeDtypeStruct(shape, dtype)))
        self._state_treedefs.append(jax.tree.structure(st))
        return [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(st)]

    def _files(self, c: int) -> list[pathlib.Path]:
        return [pathlib.Path(self.directory) / _chunk_file(c, j) for j in range(len(self._state_shapes[c]))]

    # --- the state ----------------------------------------------------------------------------

    def place(self, train, count: int = 0) -> DiskState:
        """Write a fresh state (`tx.init` of every chunk of the trainable params `train`) to the
        files; returns the handle with update count `count`."""
        leaves = jax.tree.leaves(train, is_leaf=lambda x: x is None)
        for stale in pathlib.Path(self.directory).iterdir():  # an earlier run's, maybe more chunks
            if _CHUNK_FILE.fullmatch(stale.name):
                stale.unlink()
        for c, chunk in enumerate(self.chunks):
            i, layer = chunk
            x = np.asarray(leaves[i])
            x = x if layer is None else x[layer:layer + 1]
            # Eagerly on the committed host array: one compile per chunk would cost more than the zeros.
            init = self.tx.init(self._chunk_tree(chunk, jax.device_put(x, self._cpu)))
            self._write(c, jax.tree.leaves(init))
        self._write_meta()
        return DiskState(jnp.asarray(count, jnp.int32))

    def _meta(self) -> dict:
        return {"chunks": [list(map(lambda v: -1 if v is None else v, c)) for c in self.chunks],
                "state": [[list(s), str(d)] for shapes in self._state_shapes for s, d in shapes],
                "state_per_chunk": [[[list(s), str(d)] for s, d in shapes] for shapes in self._state_shapes]}

    def _write_meta(self):
        f = pathlib.Path(self.directory) / _META
        try:
            f.write_text(json.dumps(self._meta()))
        except OSError as e:
            raise _write_error(f, e) from None

    def _write(self, c: int, leaves):
        for f, x in zip(self._files(c), leaves):
            try:
                stored = _storage_dtype(x.dtype)
                mm = np.lib.format.open_memmap(f, mode="w+", dtype=stored, shape=x.shape)
                _reserve(f)  # a full disk is an error here, not a SIGBUS when the mapped pages are written
                mm[...] = np.asarray(x).view(stored)
                mm.flush()
                del mm
            except OSError as e:  # e.g. no space for the file, or for the header of a new one
                raise _write_error(f, e) from None

    def _read(self, c: int):
        # A copy in RAM of this chunk only; the memmap is closed before the next chunk.
        return [np.array(np.load(f, mmap_mode="r")).view(dtype)
                for f, (_, dtype) in zip(self._files(c), self._state_shapes[c])]

    def read_state(self) -> list[list[np.ndarray]]:
        """Every chunk's state leaves (tests and inspection; loads the whole state)."""
        return [self._read(c) for c in range(len(self.chunks))]

    def update(self, grads, state: DiskState, train):
        """One optimizer step from the files: `(new trainable params, new handle)`.

        `grads`, `train`: trees like the `train` given at construction (host arrays).
        """
        if self.clip:
            # In f32, as `with_master_weights(chain(clip, ...))` clips the gradients it has cast.
            grads = jax.device_put(cast_floating(grads, jnp.float32), self._cpu)
            grads = optax.clip_by_global_norm(self.clip).update(grads, optax.EmptyState())[0]
        g_leaves = jax.tree.leaves(grads, is_leaf=lambda x: x is None)
        p_leaves = jax.tree.leaves(train, is_leaf=lambda x: x is None)
        out: list[Any] = [None if p is None else np.array(p) for p in p_leaves]
        g_np = {i: np.asarray(g) for i, g in enumerate(g_leaves) if g is not None}
        for c, chunk in enumerate(self.chunks):
            i, layer = chunk
            sl = slice(None) if layer is None else slice(layer, layer + 1)
            g = self._chunk_tree(chunk, jax.device_put(g_np[i][sl], self._cpu))
            p = self._chunk_tree(chunk, jax.device_put(out[i][sl], self._cpu))
            st = jax.tree.unflatten(self._state_treedefs[c], [jax.device_put(x, self._cpu) for x in self._read(c)])
            new_p, new_st = self._update_jit(g, st, p)
            out[i][sl] = np.asarray(jax.tree.leaves(new_p)[0])
            self._write(c, jax.tree.leaves(new_st))
        new_train = jax.tree.unflatten(self._treedef, out)
        return new_train, DiskState(jnp.asarray(int(np.asarray(state.updates)) + 1, jnp.int32))

    # --- checkpoints ----------------------------------------------------------------------------

    def snapshot(self, target: str) -> None:
        """Copy the state files to `target` (beside a train checkpoint of the same step).

        `target` is created, or holds only an earlier snapshot's files (replaced); nothing else
        in it is touched.

        Raises:
            OffloadError: `target` is the state directory, is not a directory, or holds other files.
        """
        dst, live = pathlib.Path(target).expanduser().resolve(), pathlib.Path(self.directory).resolve()
        if dst == live:  # a folder inside it is fine: the state files are its top-level files
            raise OffloadError(f"optimizer-state snapshot target {target} is the live state directory "
                               f"{self.directory}; accepted: another directory")
        if dst.exists() and not dst.is_dir():
            raise OffloadError(f"optimizer-state snapshot target {target} exists and is not a directory")
        ours = False  # whether dst holds nothing but this snapshot's files (removed when a write fails)
        try:
            dst.mkdir(parents=True, exist_ok=True)
            entries = list(dst.iterdir())
            own = [f for f in entries if f.name == _META or _CHUNK_FILE.fullmatch(f.name)]
            others = sorted(f.name for f in entries if f not in own)
            if others:
                raise OffloadError(f"optimizer-state snapshot target {target} holds other files "
                                   f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); accepted: a new "
                                   "or empty directory, or an earlier snapshot's")
            ours = True
            for f in own:  # an earlier snapshot's, maybe of more chunks; its chunks.json first
                f.unlink()
            for c in range(len(self.chunks)):
                for f in self._files(c):
                    shutil.copyfile(f, dst / f.name)
            shutil.copyfile(pathlib.Path(self.directory) / _META, dst / _META)  # last: marks it complete
        except OSError as e:  # e.g. a full disk: no partial snapshot is left to fill it
            if ours:
                shutil.rmtree(dst, ignore_errors=True)
            raise OffloadWriteError(e.errno, f"cannot write the optimizer-state snapshot {target} "
                                    f"({e.strerror or e}); the checkpoint was not saved (free space, then resume "
                                    "from the latest checkpoint)") from None

    def restore(self, source: str) -> None:
        """Replace the state files with a snapshot's.

        Raises:
            OffloadError: the snapshot is missing or was written for other chunks or shapes.
        """
        src = pathlib.Path(source)
        if src.expanduser().resolve() == pathlib.Path(self.directory).resolve():
            raise OffloadError(f"optimizer-state snapshot {source} is the live state directory; accepted: an "
                               f"--offload-dir outside the checkpoint directory")
        saved, mine = _snapshot_meta(src), self._meta()
        if any(saved.get(k) != mine[k] for k in ("chunks", "state")):
            raise OffloadError(f"the optimizer-state snapshot in {src} was written for another model or optimizer")
        _check_files(src, self._state_shapes)  # this optimizer's shapes: a snapshot without state_per_chunk too
        for c in range(len(self.chunks)):
            for f in self._files(c):
                shutil.copyfile(src / f.name, f)

"""Orbax checkpoints of a train state, with a metadata check before any write.

A checkpoint step holds two items: ``state`` (every array of the train state,
stored flat under dotted path names such as ``params.layers.wq.kernel``) and
``meta`` (JSON: the model config, optimizer, precision, and a fingerprint of
the state's tree structure). Restoring fills a template state built by the
same code, so any pytree (NamedTuple optimizer states, loss-scale
dataclasses) round-trips without Orbax knowing its node types.

`Checkpointer.check` compares a directory's metadata with the run's before
anything is written: a directory that holds another model's checkpoints is
refused with one line naming the fields that differ, and nothing in it is
touched.

Numbered folders that are not jmem checkpoints (no ``meta`` item) are never
read, overwritten or deleted: `check` and `save` refuse such a directory.

Example:
    >>> ckpt = Checkpointer("/tmp/run1")
    >>> start = ckpt.check(meta, resume=True)  # raises CheckpointMismatchError for another run's dir
    >>> ckpt.save(step, state, meta)
    >>> state = ckpt.restore(template_state)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmem.checks import check_bool, check_int
from jmem.io.paths import lock_directory

# Meta fields that must agree between a checkpoint and the run restoring it.
MUST_MATCH = ("model", "optimizer", "precision", "structure")


class CheckpointMismatchError(ValueError):
    """The checkpoint directory belongs to a different model or setup."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the earlier steps are intact."""


def flatten_state(state: Any) -> dict[str, Any]:
    """`{dotted.path: leaf}` for every leaf of `state`."""
    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        key = jax.tree_util.keystr(path, simple=True, separator=".") or "root"
        if key in flat:
            raise ValueError(f"checkpoint: two leaves share the path {key!r}")
        flat[key] = leaf
    return flat


def structure_fingerprint(state: Any) -> str:
    """Hash of the state's paths, shapes and dtypes (not its values)."""
    items = [(k, tuple(np.shape(v)), str(getattr(v, "dtype", type(v).__name__))) for k, v in flatten_state(state).items()]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


class Checkpointer:
    """Numbered checkpoints in one directory (Orbax `CheckpointManager`).

    Leaves are arrays or Python/numpy scalars (a scalar comes back as the template's type).
    `restore` refuses a template whose paths, shapes or dtypes differ from the checkpoint's
    (no silent casts): build the template with the dtypes that were saved.

    Args:
        directory: where step folders go (created on the first save).
        max_to_keep: older jmem steps are deleted beyond this many, an integer >= 1 or None to
            keep all (folders jmem did not write are never deleted: `save` refuses a directory
            that holds any).
        read_only: only read (a shared or read-only model directory): nothing is created, cleaned
            up or saved there.
        this_process_only: the calling process reads or writes host arrays alone, without the
            other processes of a multi-process run (by default every process takes part, as
            sharded arrays need).
    """

    def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int | None = 3, read_only: bool = False,
                 this_process_only: bool = False):
        if max_to_keep is not None:
            check_int("max_to_keep", max_to_keep, 1)
        check_bool("read_only", read_only)
        check_bool("this_process_only", this_process_only)
        self.directory = pathlib.Path(directory).expanduser().resolve()
        if self.directory.exists() and not self.directory.is_dir():  # check() read it as empty, save() failed raw
            raise ValueError(f"checkpoint directory {str(directory)!r} is a file; accepted: a directory path")
        self.read_only = read_only
        extra = {}
        if this_process_only and jax.process_count() > 1:
            me = jax.process_index()
            extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"process{me}")
        with _quiet_read_only_notes():
            self._options = ocp.CheckpointManagerOptions(
                max_to_keep=None if max_to_keep is None else int(max_to_keep), create=False,
                enable_async_checkpointing=False, cleanup_tmp_directories=not read_only, read_only=read_only, **extra,
            )
        self._manager: ocp.CheckpointManager | None = None
        # One writer per directory: process 0 of a run holds its lock from `check` or the first `save` until
        # `close` (a this_process_only directory is a new one, written once: `jmem.quant.saved`).
        self._locks = not read_only and not this_process_only
        self._lock = None
        self._lock_tried = False  # the same on every process: each takes part in one agreement on the lock

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            if not self.read_only:
                self.directory.mkdir(parents=True, exist_ok=True)
            # Handlers named up front so the stored array metadata is readable before any restore.
            handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
            with _quiet_read_only_notes():
                self._manager = ocp.CheckpointManager(self.directory, options=self._options, item_handlers=handlers)
        return self._manager

    def _steps(self) -> tuple[list[int], list[int]]:
        """(jmem steps, numbered folders that are not jmem checkpoints), each ascending."""
        if not self.directory.is_dir():
            return [], []
        ours, foreign = [], []
        for step in sorted(self.manager.all_steps()):
            (ours if (self.directory / str(step) / "meta").exists() else foreign).append(step)
        return ours, foreign

    def foreign_steps(self) -> list[int]:
        """Numbered folders in the directory that jmem did not write (no `meta` item)."""
        return self._steps()[1]

    def _refuse_foreign(self) -> None:
        foreign = self.foreign_steps()
        # A jmem step whose meta item was lost: its only item is `state` (another program's Orbax steps
        # may hold a `state` item too, beside items of their own).
        damaged = [s for s in foreign if {p.name for p in (self.directory / str(s)).iterdir() if p.is_dir()}
                   == {"state"}]
        if damaged:
            raise self._damaged(damaged[0], FileNotFoundError("its meta item is missing"))
        if foreign:
            names = ", ".join(map(str, foreign[:5])) + (", ..." if len(foreign) > 5 else "")
            raise CheckpointMismatchError(
                f"checkpoint dir {self.directory} holds numbered folders that are not jmem checkpoints ({names}); "
                f"choose another --ckpt-dir (nothing was written)")

    def steps(self) -> list[int]:
        """The complete jmem steps in the directory, ascending (empty when absent)."""
        return self._steps()[0]

    def latest_step(self) -> int | None:
        """The newest complete jmem step in the directory, or None (also when absent)."""
        ours = self.steps()
        return ours[-1] if ours else None

    def read_meta(self, step: int | None = None) -> dict | None:
        if step is not None:
            check_int("step", step, 0)
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        if not (self.directory / str(step) / "meta").exists():
            raise CheckpointMismatchError(f"{self.directory / str(step)} is not a jmem checkpoint (no meta item)")
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise self._damaged(step, e) from e

    def _damaged(self, step: int, e: Exception) -> CheckpointMismatchError:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        for tail in (" See full TensorStore details", " [tensorstore_spec="):  # then a Python object's or a spec's repr
            why = why.split(tail)[0]
        why = why[:200]
        where = self.directory / str(step)
        return CheckpointMismatchError(f"checkpoint {where} is damaged or unreadable ({why}); accepted: a complete "
                                       f"checkpoint: delete {where} to resume from the step before it, or choose "
                                       f"another --ckpt-dir")

    def check(self, meta: dict, *, resume: bool, upgrade=None) -> int | None:
        """Validate the directory for this run; returns the step to resume from.

        `upgrade(old_meta) -> meta` reads the metadata of an older version (e.g. fills the
        fields it did not record yet with the values that reproduce its behaviour).

        Raises:
            CheckpointMismatchError: the directory holds checkpoints of another
                model/optimizer/precision, or holds checkpoints while `resume`
                is False (starting over would overwrite them).
        """
        self._refuse_foreign()
        self._hold_lock()
        step = self.latest_step()
        if step is None:
            return None  # nothing there (the caller decides: the train loop refuses --resume then)
        old = self.read_meta(step) or {}
        old = upgrade(old) if upgrade is not None else old
        # As stored (JSON: tuples come back as lists); no structure given: `save` fills it in, `restore` checks it.
        run = {k: json.loads(json.dumps(meta[k])) for k in MUST_MATCH if k in meta and meta[k] is not None}
        diff = [k for k in MUST_MATCH if old.get(k) != run.get(k) and (k != "structure" or k in run)]
        if diff:
            detail = "; ".join(_describe(k, old.get(k), run.get(k)) for k in diff)
            raise CheckpointMismatchError(
                f"checkpoint dir {self.directory} holds a different run ({detail}); "
                f"choose another --ckpt-dir (nothing was written)"
            )
        if not resume:
            raise CheckpointMismatchError(
                f"checkpoint dir {self.directory} already holds step {step}; pass --resume to continue it "
                f"or choose another --ckpt-dir (nothing was written)"
            )
        return step

    def save(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Write `state` and `meta` as step `step` (blocking until on disk).

        Raises:
            ValueError: `step` is not an integer >= 0 or `state` holds no leaves.
            CheckpointMismatchError: the directory holds numbered folders jmem did not write
                (pruning old steps would delete them); nothing is written.
            CheckpointWriteError: the write failed (e.g. no space left); its partial folder is
                removed and the earlier steps are intact.
        """
        if self.read_only:
            raise CheckpointWriteError(f"checkpoint step {step} was not written: {self.directory} was opened "
                                       "read_only; accepted: Checkpointer(directory) to save")
        check_int("step", step, 0)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise ValueError(f"checkpoint meta is a {type(meta).__name__}; accepted: None or a dict of JSON values")
        flat = flatten_state(state)
        if not flat:
            raise ValueError(f"checkpoint: the state {type(state).__name__} holds no arrays; "
                             f"accepted: a pytree with at least one leaf")
        empty = [k for k, v in flat.items() if np.size(v) == 0]
        if empty:  # orbax refuses them, and its reason was cut from a "could not be written" error
            raise ValueError(f"checkpoint: leaf {empty[0]} has no elements (shape {list(np.shape(flat[empty[0]]))}); "
                             "accepted: arrays with at least one element")
        self._refuse_foreign()
        # Typed PRNG keys go to disk as their key data, their implementation named in the meta.
        keys = {k: str(jax.random.key_impl(v)) for k, v in flat.items() if _is_key(v)}
        flat = {k: jax.random.key_data(v) if k in keys else v for k, v in flat.items()}
        meta = {**meta, "structure": meta.get("structure") or structure_fingerprint(state), "step": int(step),
                **({"prng_impls": keys} if keys else {})}
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta is not JSON ({e}); accepted: a dict of JSON values") from None
        self.manager  # noqa: B018 - creates the directory, which the lock is taken on
        self._hold_lock()
        try:
            with _quiet_orbax_threads():
                self.manager.save(
                    int(step),
                    args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)),
                    force=True,
                )
                self.manager.wait_until_finished()
        except Exception as e:
            # Read with the manager in hand: a new one (after _abandon) starts a clean-up thread, whose
            # traceback an exit right after this error would print.
            latest = self.latest_step()  # the failed step's folder has no meta item: not counted
            self._abandon(int(step))
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            why = ": ".join(line.split(": ")[-2:])[:200]  # the cause, without the storage layer's file path
            kept = f"the latest complete checkpoint is step {latest}" if latest is not None else "no step is saved"
            raise CheckpointWriteError(f"checkpoint step {step} could not be written to {self.directory} "
                                       f"({why}); {kept}") from e

    def _hold_lock(self) -> None:
        """Lock the directory for this run's writes; CheckpointMismatchError when another running
        process holds it (both would save, and prune, each other's steps). In a multi-process run
        process 0 takes the lock and every process raises when it was refused (the others would
        otherwise wait on collectives of a process that stopped)."""
        if not self._locks or self._lock_tried or not self.directory.is_dir():
            return
        self._lock_tried = True
        refused = False
        if jax.process_index() == 0:
            try:
                self._lock = lock_directory(self.directory)
            except BlockingIOError:
                refused = True
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            refused = bool(np.asarray(multihost_utils.broadcast_one_to_all(np.array(refused))))
        if refused:
            raise CheckpointMismatchError(
                f"checkpoint dir {self.directory} is in use by another running process (two runs would overwrite "
                "each other's steps); choose another --ckpt-dir (nothing was written)")

    def _abandon(self, step: int) -> None:
        """Remove a failed save's partial folder and drop the manager (its step cache knows the step)."""
        shutil.rmtree(self.directory / f"{step}.orbax-checkpoint-tmp", ignore_errors=True)
        self._drop_manager()

    def restore(self, template: Any, step: int | None = None) -> Any:
        """The state saved at `step` (latest when None), in `template`'s structure.

        Leaves come back with the template's shardings, so a state saved on one
        mesh restores onto another.
        """
        if step is not None:
            check_int("step", step, 0)
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self._steps()[0]:
            raise CheckpointMismatchError(f"{self.directory} holds no jmem checkpoint of step {step}")
        flat_t = flatten_state(template)
        keys = {k: v for k, v in flat_t.items() if _is_key(v)}
        impls = (self.read_meta(step) or {}).get("prng_impls", {}) if keys else {}
        for k, v in keys.items():
            if k not in impls:
                raise CheckpointMismatchError(f"checkpoint {self.directory / str(step)} does not match the template: "
                                              f"{k} is a PRNG key in the template, not in the checkpoint")
            stored = jax.eval_shape(lambda: jax.random.key(0, impl=impls[k])).dtype
            if stored != v.dtype:
                raise CheckpointMismatchError(f"checkpoint {self.directory / str(step)} does not match the template: "
                                              f"{k} is a {stored} ({impls[k]}) key in the checkpoint, {v.dtype} in "
                                              "the template")
        stored_t = {k: jax.eval_shape(jax.random.key_data, v) if k in keys else v for k, v in flat_t.items()}
        self._check_template(step, stored_t)

        def abstract(x):
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x), sharding=sharding)

        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore({k: abstract(v) for k, v in stored_t.items()})))["state"]
        except Exception as e:
            raise self._damaged(step, e) from e
        restored = {k: jax.random.wrap_key_data(v, impl=impls[k]) if k in keys else v for k, v in restored.items()}
        leaves = [_like(flat_t[k], restored[k]) for k in flat_t]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)

    def _check_template(self, step: int, flat_t: dict[str, Any]) -> None:
        """One CheckpointMismatchError naming the first leaves whose path, shape or dtype differ."""
        try:
            stored = dict(self.manager.item_metadata(step)["state"].items())
        except Exception as e:  # no state item (None) or unreadable metadata
            raise self._damaged(step, e) from e
        problems = [f"{k} is in the template but not in the checkpoint" for k in flat_t if k not in stored]
        problems += [f"{k} is in the checkpoint but not in the template" for k in stored if k not in flat_t]
        for k, v in flat_t.items():
            if k not in stored:
                continue
            meta = stored[k]
            want_shape, want_dtype = tuple(np.shape(v)), np.dtype(_dtype_of(v))
            got_shape = tuple(getattr(meta, "shape", ()) or ())
            got_dtype = getattr(meta, "dtype", None)
            if got_shape != want_shape or (got_dtype is not None and np.dtype(got_dtype) != want_dtype):
                problems.append(f"{k}: checkpoint {np.dtype(got_dtype) if got_dtype is not None else '?'}"
                                f"{list(got_shape)} vs template {want_dtype}{list(want_shape)}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointMismatchError(f"checkpoint {self.directory / str(step)} does not match the template: "
                                          f"{'; '.join(problems[:3])}{more}")

    def _drop_manager(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def close(self) -> None:
        """Close the Orbax manager and release the directory for other runs."""
        self._drop_manager()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._lock_tried = False


@contextlib.contextmanager
def _holding_back(level: int, *fragments: str):
    """Drop Orbax's log records (absl logger) at `level` and above whose message holds one of `fragments`."""
    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno >= level and any(f in record.getMessage() for f in fragments))

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _quiet_orbax_threads():
    """Hold back the tracebacks Orbax's writer threads log for a failed write: `save` raises one error."""
    return _holding_back(logging.ERROR, "raised an exception")


def _quiet_read_only_notes():
    """Hold back the warnings Orbax logs for a manager opened read-only (that it will not save or clean up):
    every `jmem.load(DIR)` opens one, and what it notes is what was asked for."""
    return _holding_back(logging.WARNING, "read_only=True, setting", "Given directory is read only")


def _is_key(x: Any) -> bool:
    """A typed PRNG key array (`jax.random.key`), or its ShapeDtypeStruct."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _dtype_of(x: Any):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # Python scalars have none


def _like(template_leaf: Any, value: Any) -> Any:
    """A restored leaf in the template's form: Python and numpy scalars come back as their type."""
    if isinstance(template_leaf, (bool, int, float, complex)):
        return type(template_leaf)(np.asarray(value).item())
    if isinstance(template_leaf, np.generic):
        return template_leaf.dtype.type(np.asarray(value))
    return value


def _describe(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)][:4]
        return ", ".join(f"{key}.{k}: checkpoint {_short(old.get(k))} vs run {_short(new.get(k))}" for k in keys)
    return f"{key}: checkpoint {_short(old)} vs run {_short(new)}"


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= 80 else s[:77] + "..."

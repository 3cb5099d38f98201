"""The training loop: memory table, progress bar, eval, JSON logs, checkpoints.

`train(cfg)` is what `experiments/train.py` calls. It compiles the step once
(through `jmem.memory.measure`, whose compile the jitted step then reuses),
prints the measured and estimated memory, then runs the steps.

Checkpoints: every `ckpt_every` steps, at the end, after `stop_after` steps,
and when SIGINT/SIGTERM arrives (the signal only sets a flag; the loop saves
after the step in flight, so a checkpoint is never half a step; all processes of
a job stop after the same step; a second signal ends the process at once). Batches are a
function of the step number, so a resumed run repeats the uninterrupted run's
losses exactly.

Example:
    >>> from jmem.train import TrainConfig, train
    >>> result = train(TrainConfig(model="tiny", steps=20))
    >>> result.losses[max(result.losses)] < result.losses[min(result.losses)]  # losses by step
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jmem.io.checkpoint import CheckpointMismatchError, Checkpointer
from jmem.io.paths import new_dirs_removed_if_left_empty
from jmem.memory.measure import MemoryReport, measure_and_compile, memory_limit
from jmem.train.checks import check_steps_left, rules_for
from jmem.train.config import OFFLOAD_SNAPSHOTS, ROUTER_SETTINGS, TrainConfig
from jmem.train.report import count_text, estimate_bytes, memory_table, step_matmul_flops
from jmem.train.setup import MEANING_SETTINGS, Run, build, state_settings_diff, upgrade_meta


@dataclasses.dataclass
class TrainResult:
    """What a run did: train losses, eval losses, memory.

    `losses[k]` is the loss of the step that starts from k steps done (0-based: the log's
    `"step": k + 1` line); `eval_losses[n]` is evaluated after n steps (as the log's `"step"`)."""

    losses: dict[int, float]
    eval_losses: dict[int, float]
    memory: MemoryReport
    estimate: dict[str, int]
    final_step: int
    interrupted: bool
    skipped_steps: int


FORCE_EXIT_AFTER_S = 5.0  # a second signal's grace before the process ends itself


@contextlib.contextmanager
def _stop_on_signals():
    """Yields a one-item list that becomes [True] on SIGINT/SIGTERM.

    A second signal stops at once: Ctrl-C raises KeyboardInterrupt; and when the main thread
    cannot run Python (a step waiting forever on a collective), a watcher thread, woken through
    `signal.set_wakeup_fd`, ends the process FORCE_EXIT_AFTER_S later with status 128 + signal."""
    flag = [False]

    def handler(signum, frame):
        if flag[0] and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        flag[0] = True

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: no signal handling
            pass
    watcher = _SecondSignalWatcher() if old else None
    try:
        yield flag
    finally:
        if watcher is not None:
            watcher.close()
        for sig, h in old.items():
            signal.signal(sig, h)


class _SecondSignalWatcher:
    """Counts SIGINT/SIGTERM from a thread (the wakeup fd carries each signal's number) and ends the
    process when a second one is not acted on within FORCE_EXIT_AFTER_S."""

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="jmem-second-signal", daemon=True).start()

    def _watch(self):
        seen = 0
        try:
            while not self._done.is_set():
                data = os.read(self._read, 64)
                if not data:  # close(): the write end is gone
                    return
                seen += sum(b in (signal.SIGINT, signal.SIGTERM) for b in data)
                if seen >= 2:
                    if not self._done.wait(FORCE_EXIT_AFTER_S):
                        print(f"second {signal.Signals(data[-1]).name}: the step in flight did not finish; exiting "
                              "without a checkpoint", file=sys.stderr, flush=True)
                        os._exit(128 + data[-1])
                    return
        finally:
            os.close(self._read)

    def close(self):
        self._done.set()
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)  # the thread's read returns empty


RESUME_DATA_FLAGS = ("data", "seq", "batch")
"""Flags a resumed run may change (the train state does not depend on them) that change its batches."""

RESUME_UPDATE_FLAGS = ("steps", "lr", "warmup", "precision", "weight_decay", "clip", "galore_gap", "galore_scale",
                       "lora_dropout", "layerwise_period", "layerwise_schedule", "accum") + ROUTER_SETTINGS
"""Flags a resumed run may change that change its updates (the learning-rate schedule spans --steps; the
layer-wise flags choose which layers train; --accum sums in another order, and an MoE model routes each
microbatch on its own; the router's capacity and loss weights)."""

RESUME_CHANGES = ((RESUME_DATA_FLAGS, "batches"), (("seed",), "batches, layer-wise draws and dropout masks"),
                  (RESUME_UPDATE_FLAGS, "updates"))
"""What each group of flags changes when a resumed run sets it differently from its checkpoint."""


def resume_notes(old_config: dict, cfg: TrainConfig, data_changed: bool | None = None) -> list[str]:
    """`note: ...` lines for the flags a resumed run changes from its checkpointed run's config.

    `data_changed`: whether the dataset's tokens differ from the checkpointed run's (None: unknown). A
    text edited under the same --data path is noted; the same text at another path is not."""
    notes = []
    for names, what in RESUME_CHANGES:
        changed = _changed_flags(old_config, cfg, names)
        if names == RESUME_DATA_FLAGS:
            if data_changed is False:  # the same tokens: a moved or copied file changes no batch
                changed = [c for c in changed if not c.startswith("--data ")]
            elif data_changed and not any(c.startswith(("--data ", "--seq ")) for c in changed):
                changed.insert(0, f"--data {cfg.data} (its text changed since the checkpoint)")
        if changed:
            notes.append(f"note: {', '.join(changed)}: the {what} differ from an uninterrupted run's")
    return notes


def _changed_flags(old_config: dict, cfg: TrainConfig, names: tuple[str, ...]) -> list[str]:
    """`--flag X (checkpoint: Y)` for each of `names` that differs from the checkpointed run's."""
    return [f"--{name.replace('_', '-')} {getattr(cfg, name)} (checkpoint: {old_config[name]})" for name in names
            if name in old_config and old_config[name] != getattr(cfg, name)]


def _json_line(record: dict) -> str:
    """One line of strict JSON: NaN and infinities (a skipped fp16 step's) as null, which every parser reads."""
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        return {k: finite(v) for k, v in x.items()} if isinstance(x, dict) else x

    return json.dumps(finite(record), allow_nan=False) + "\n"


class TrainingDiverged(RuntimeError):
    """A step's loss or gradients were not finite (and no loss scale was left to back off): the run stops
    before any checkpoint of the poisoned state is written."""


DIVERGED_ADVICE = "accepted: a lower --lr, --clip, or another --precision"


class LogWriteError(OSError):
    """--log could not be written (a full disk): the run stops with one line naming the latest checkpoint."""


class _Logger:
    """JSON lines, `first` (the memory event) on top. A resumed run continues its log, cut back
    to the resumed step (rewritten atomically), so it reads as one uninterrupted run's; a fresh
    run starts a new one. A failed write is a `LogWriteError` (`where` says what the run has kept)."""

    def __init__(self, path: str | None, first: dict, resume_step: int = 0, where: Callable[[], str] = str):
        self.f: TextIO | None = None
        self.path, self.where = path, where
        if not path:
            return
        tmp = f"{path}.tmp"
        try:
            lines = []
            if resume_step and os.path.isfile(path):
                with open(path) as f:
                    lines = [ln if ln.endswith("\n") else ln + "\n" for ln in f if _keep_logged(ln, resume_step)]
            with open(tmp, "w") as f:
                f.writelines([_json_line(first), *lines])
            os.replace(tmp, path)
            self.f = open(path, "a")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            self._fail(e)

    def _fail(self, e: OSError):
        raise LogWriteError(f"--log {self.path!r} could not be written ({e.strerror or e}){self.where()}") from None

    def write(self, record: dict):
        if self.f:
            try:
                self.f.write(_json_line(record))
                self.f.flush()
            except OSError as e:
                self._fail(e)

    def close(self):
        if self.f:
            self.f.close()


def _diverged(rec: dict, loss_scale) -> bool:
    """A step whose loss or gradients are not finite, where loss scaling does not skip it: without a
    dynamic loss scale (one NaN would stay in the weights) or at its smallest (every later step would be
    skipped)."""
    if rec["finite"] and math.isfinite(rec["loss"]):
        return False
    smallest = getattr(loss_scale, "min_scale", None)
    return smallest is None or rec["loss_scale"] <= smallest


def _check_log_is_the_runs(path: str, run_id: str, ckpt_dir: str) -> None:
    """A resumed run's log is its own: the id its memory events name is the checkpoint's (logs and
    checkpoints of earlier versions name none); a non-empty file without a memory event (which a run
    writes before its first step) is no run's log, and resuming would rewrite it to the run's lines."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    found = False
    with open(path, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "memory":
                found = True
                if rec.get("run_id") not in (None, run_id):
                    raise ValueError(f"--log {path!r} is the log of run {rec['run_id']}, not of the run of "
                                     f"--ckpt-dir {ckpt_dir} ({run_id}); nothing is overwritten; accepted: that run's "
                                     "log, or a new path")
    if not found:
        raise ValueError(f"--log {path!r} is no train run's log (it has no memory event); nothing is overwritten; "
                         "accepted: the resumed run's log, or a new path")


def _keep_logged(line: str, resume_step: int) -> bool:
    """A log line a run resumed at `resume_step` keeps: records up to that step and events other
    than the memory one (the resumed run writes its own); not a line cut short by a kill."""
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    if not isinstance(rec, dict):
        return False
    return rec["step"] <= resume_step if isinstance(rec.get("step"), int) else rec.get("event") != "memory"


def _evaluate(eval_fn, params, run: Run) -> float | None:
    """Mean loss over the validation batches of `--batch` windows (fewer when the split is smaller).
    Each batch runs in the train step's microbatches (`--batch / --accum` windows: the memory the
    run was sized for), split over the mesh's data axes as the train batch is."""
    bs = min(run.cfg.batch, len(run.data.valid))
    micro = bs // run.cfg.accum if bs % run.cfg.accum == 0 else bs
    place = _eval_placement(run, micro)
    total = count = 0.0
    for b in run.data.eval_batches(bs, run.cfg.eval_batches):
        for i in range(0, bs, micro):
            s, c = eval_fn(params, place({k: v[i : i + micro] for k, v in b.items()}))
            total, count = total + float(_host(s)), count + float(_host(c))
    return total / count if count else None


def _eval_placement(run: Run, rows: int) -> Callable[[dict], Any]:
    """How an eval batch of `rows` windows goes onto the run's devices: split over the data axes when
    they divide it, else whole on every device (a global array in every process)."""
    if run.mesh is None:
        return lambda b: b
    from jax.sharding import NamedSharding, PartitionSpec

    from jmem import parallel as par
    from jmem.parallel.mesh import data_parallel_size
    from jmem.parallel.step import batch_axes, batch_spec

    rules = rules_for(run.cfg)
    split = rows % data_parallel_size(run.mesh, batch_axes(run.mesh, rules)) == 0
    sharding = NamedSharding(run.mesh, batch_spec(run.mesh, rules) if split else PartitionSpec())
    return lambda b: par.to_global(b, jax.tree.map(lambda _: sharding, b))


def train(cfg: TrainConfig, *, out: TextIO | None = None, on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Run training as configured; see the module docstring.

    Args:
        cfg: the run.
        out: where the table, bar and messages go (stdout by default).
        on_step: called with each step's log record (after the step).

    Raises:
        ValueError: bad configuration or a checkpoint dir of another run
            (before anything is compiled or written).
    """
    # A run refused after its output directories were made (e.g. a sharding error found when the
    # step is traced) leaves none of them behind empty.
    # The directories' locks go when the run ends, however it ends (another run may then use them).
    with new_dirs_removed_if_left_empty(cfg.ckpt_dir, cfg.log, cfg.plot, cfg.offload_dir, cfg.save), \
            contextlib.ExitStack() as closing:
        return _train(cfg, out or sys.stdout, on_step, closing)


def _train(cfg: TrainConfig, out: TextIO, on_step: Callable[[dict], None] | None,
           closing: contextlib.ExitStack) -> TrainResult:
    run = build(cfg)
    fns = run.fns
    state = fns.init_state(run.model)
    ckpt = Checkpointer(cfg.ckpt_dir) if cfg.ckpt_dir else None
    if ckpt is not None:
        closing.callback(ckpt.close)
    start, checked_id = 0, None
    if ckpt is not None:
        _check_state_settings(ckpt, run)
        resume_step = ckpt.check(run.meta, resume=cfg.resume, upgrade=upgrade_meta)
        if cfg.resume and resume_step is None:
            raise ValueError(f"--resume: nothing to resume in {cfg.ckpt_dir} (no checkpoint there); "
                             f"drop --resume to start a new run")
        if resume_step is not None:
            check_steps_left(cfg, resume_step)
            if cfg.offload_optimizer == "disk":  # before anything is restored or reported
                from jmem.memory.disk_offload import check_snapshot

                check_snapshot(_snapshot_dir(ckpt, resume_step))
            state = ckpt.restore(state, resume_step)
            start = int(state.step)
            print(f"resumed from {ckpt.directory} at step {start}", file=out)
            old = ckpt.read_meta(resume_step) or {}
            # The run continues under its checkpoint's id (one of an earlier version names none: its log
            # is not checked, and the run takes the new id at its next checkpoint).
            checked_id = old.get("run_id")
            run.meta["run_id"] = checked_id or run.meta["run_id"]
            changed = None if "data_digest" not in old else old["data_digest"] != run.meta.get("data_digest")
            for line in resume_notes(old.get("config", {}), cfg, changed):
                print(line, file=out)

    offload = None
    if cfg.offload_optimizer != "none":  # ZeRO-Offload / -Infinity: two programs (jmem.memory.offload)
        step_fn, place, state, offload = _offloaded(run, state, ckpt, start, closing)
        batch0 = place(batch=run.data.batch(start, cfg.batch, cfg.seed))
        offload_report = step_fn.measure(state, batch0)  # compiles; the loop reuses the device program
        report, compiled = offload_report.device_memory, None  # as the table: host layers are no device bytes
    else:
        step_fn, place = _jitted(run, state)
        state = place(state=state)
        batch0 = place(batch=run.data.batch(start, cfg.batch, cfg.seed))
        report, compiled = measure_and_compile(step_fn, state, batch0)  # compiles; the loop reuses it
    if run.mesh is not None and cfg.pipeline_stages > 1 and cfg.pipeline_schedule == "1f1b":
        from jmem import parallel as par

        par.check_tick_collectives(compiled.as_text(), run.mesh)  # a collective stages cannot join: refuse, not hang
    matmul = step_matmul_flops(cfg, report, compiled)
    estimate = estimate_bytes(run)
    n_params = run.model_config.num_params  # the model's, whatever its leaves store (packed quantized bases, adapters)
    trained = state.params
    if run.fns.trainable is not None:  # adapters, or layer-wise training's slice of the layers
        trained = jax.eval_shape(lambda p: run.fns.trainable(p)[0], state.params)
    n_trained = n_params if trained is state.params else sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained))
    shown = f"{count_text(n_params)} params" + (f" ({count_text(n_trained)} trained)" if n_trained != n_params else "")
    print(f"model {cfg.model}: {shown}, remat={cfg.remat}, precision={run.policy}, "
          f"optimizer={cfg.optimizer}, batch={cfg.batch}x{cfg.seq} (accum {cfg.accum}), "
          f"{run.data.num_tokens / 1e3:.0f}k tokens", file=out)
    if cfg.optimizer == "galore":  # a rank at or above every matrix's smaller side projects nothing: plain Adam
        from jmem.optim.galore import galore_plan

        plans, _ = galore_plan(trained, cfg.galore_rank)
        print(f"galore: {sum(p.side is not None for p in plans)} of {len(plans)} leaves projected at rank "
              f"{cfg.galore_rank} (matrices with both sides above it, not the embeddings or head; the others run "
              "Adam)", file=out)
    if run.mesh is not None:
        from jmem import parallel as par

        pipe = f", pipeline {cfg.pipeline_stages} stages x {cfg.microbatches} microbatches" \
            if cfg.pipeline_stages > 1 else ""
        if offload is None:
            where = "per-device MiB: " + ", ".join(
                f"{k.split('_')[0]} {v / 2**20:.2f}" for k, v in par.model_state_bytes(
                    state, run.mesh, stage=cfg.zero, rules=rules_for(run.cfg), trainable=run.fns.trainable).items())
        else:  # the ZeRO layout's per-device bytes would count the offloaded state as on the device
            where = "device, host and disk bytes in the table below"
        print(f"mesh {par.mesh_summary(run.mesh)} ({jax.process_count()} process(es)), zero={cfg.zero}{pipe}; "
              f"{where}", file=out)
    print(memory_table(report, estimate, matmul, offload=offload_report if offload is not None else None,
                       devices=run.mesh.size if run.mesh is not None else 1, compute_dtype=run.policy.compute),
          file=out)
    limit, holder = memory_limit()
    if report.total_bytes > limit:
        raise ValueError(_out_of_memory(report, f"{holder} {limit / 2**20:.0f} MiB", cfg))

    # One log and one plot per job, by process 0 (the others hold the same replicated values).
    log_path = cfg.log if jax.process_index() == 0 else None
    if checked_id and log_path:
        _check_log_is_the_runs(log_path, checked_id, cfg.ckpt_dir)
    kept = functools.partial(_kept, ckpt)
    log = _Logger(log_path, {"event": "memory", "run_id": run.meta["run_id"], **report.as_dict(),
               "estimate": estimate, "params": n_params,
               "trained_params": n_trained, "matmul_flops_per_step": matmul[1], "matmul_flops_of": matmul[0],
               **({"offload": {f"{w}: {n.strip()}": b for w, n, b in offload_report.rows()}} if offload else {})},
                  start, kept)
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    tokens = cfg.batch * cfg.seq
    interrupted = False
    bar = _progress(cfg, start, end, out)
    with _stop_on_signals() as stop:  # also through the final save: a signal then lets it finish
        try:
            for step in range(start, end):
                batch = batch0 if step == start else place(batch=run.data.batch(step, cfg.batch, cfg.seed))
                t0 = time.perf_counter()
                state, m = step_fn(state, batch)
                m = {k: _host(v) for k, v in m.items()}  # waits for the step
                loss = float(m["loss"])
                dt = time.perf_counter() - t0
                losses[step] = loss
                rec = {"step": step + 1, "loss": loss, "grad_norm": float(m["grad_norm"]),
                       "step_time_s": dt, "tokens_per_s": tokens / dt, "loss_scale": float(m["loss_scale"]),
                       "finite": bool(m["finite"])}
                rec.update({k: float(v) for k, v in m.items() if k.startswith("moe_")})
                log.write(rec)
                bar.update(rec)
                if on_step is not None:
                    on_step(rec)
                done = step + 1
                if _diverged(rec, state.loss_scale):  # before any checkpoint of this state replaces a good one
                    raise TrainingDiverged(
                        f"step {done}: the loss is {loss:g} (grad_norm {rec['grad_norm']:g})"
                        + (f" at the smallest loss scale {rec['loss_scale']:g}" if run.policy.needs_loss_scale
                           else "") + f"; the run stops{kept()}; {DIVERGED_ADVICE}")
                # Also at a --stop-after boundary, so a split run logs the evals of an uninterrupted one;
                # the last step's eval is the final one below.
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                    ev = _evaluate(_jitted_eval(fns), state.params, run)
                    if ev is not None:
                        evals[done] = ev
                        log.write({"step": done, "eval_loss": ev})
                        bar.note(f"step {done}: eval loss {ev:.4f}")
                stopping = _agreed(stop[0])
                if ckpt is not None and (done % cfg.ckpt_every == 0 or stopping):
                    _save(ckpt, done, state, run.meta, offload)
                if stopping:
                    interrupted = True
                    break
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e):
                raise ValueError(_out_of_memory(report, f"step {step + 1} ran out of memory", cfg)) from None
            if jax.process_count() > 1:  # the others wait for this one, or this one for a stopped one
                from jmem.parallel.distributed import DistributedRunError

                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise DistributedRunError(
                    f"process {jax.process_index()}: step {step + 1} failed ({first}); in a run of "
                    f"{jax.process_count()} processes this most often means another one stopped. This one stops "
                    f"too; start them all again with --resume to continue from the latest checkpoint") from None
            raise
        finally:
            bar.close()
        final = int(state.step)
        if ckpt is not None and (final == end or interrupted) and ckpt.latest_step() != final:
            _save(ckpt, final, state, run.meta, offload)
        # A signal in or after the last step stops nothing: --save and the final eval still run (a resume
        # would find no step left to train, and they would be lost).
        signalled_at_end = stop[0] and final == cfg.steps
        interrupted = (interrupted or stop[0]) and final < cfg.steps
    if interrupted:
        print(f"interrupted at step {final}" + (f"; checkpoint in {ckpt.directory}" if ckpt else ""), file=out)
    elif final < cfg.steps:  # --stop-after
        print(f"stopped at step {final} of {cfg.steps} (--stop-after {cfg.stop_after})"
              + (f"; checkpoint in {ckpt.directory}, --resume continues it" if ckpt else ""), file=out)
    if not interrupted and final == cfg.steps:
        if signalled_at_end:
            print(f"signal after the last step: the run is complete; {'--save, then ' if cfg.save else ''}the final "
                  "eval (a second Ctrl-C stops at once)", file=out)
        if cfg.save:  # before the eval: a preempted job's grace period goes to the export first
            _save_result(run, state, out)
        ev = _evaluate(_jitted_eval(fns), state.params, run)
        if ev is not None:
            evals[final] = ev
            log.write({"step": final, "eval_loss": ev})
            trained = f" (train loss {losses[final - 1]:.4f})" if final - 1 in losses else ""  # none: a --save export
            print(f"final eval loss {ev:.4f}{trained}", file=out)
    skipped = _skipped(state.opt_state)
    if skipped:
        print(f"{skipped} non-finite steps skipped (loss scale {float(state.loss_scale.scale_value):g})", file=out)
    log.close()
    result = TrainResult(losses, evals, report, estimate, final, interrupted, skipped)
    if cfg.plot and jax.process_index() == 0:
        from jmem.train.plot import plot_run

        plot_run(result, cfg.plot, title=f"{cfg.model} remat={cfg.remat} {run.policy} {cfg.optimizer}")
        print(f"wrote {cfg.plot}", file=out)
    return result


def _out_of_memory(report, what: str, cfg: TrainConfig) -> str:
    advice = ["a smaller --batch or --seq", "--remat full" if cfg.remat != "full" else "",
              "--accum" if cfg.accum < cfg.batch else "",
              "--zero 3 with a --mesh over more devices" if cfg.zero < 3 else "a --mesh over more devices",
              "--offload-optimizer host" if cfg.offload_optimizer == "none" else ""]
    return (f"the train step needs {report.total_bytes / 2**20:.0f} MiB per device (compiler-measured, the "
            f"memory table above) and {what}; accepted: settings that fit, e.g. {', '.join(filter(None, advice))}")


def _save_result(run: Run, state, out: TextIO) -> None:
    """--save: the adapters (with --lora-rank) or the whole trained model (its leaves in the run's
    parameter dtype), readable by `jmem serve` / `jmem.load`. With several processes every one
    gathers the parameters (a collective) and process 0 writes them."""
    if _multiprocess():
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(state.params, tiled=True)
        if jax.process_index() != 0:
            return
    else:
        params = jax.tree.map(np.asarray, state.params)
    model = run.fns.merge(params)
    if run.cfg.lora_rank > 0 and run.cfg.save.endswith(".npz"):
        from jmem.lora import save_adapters

        save_adapters(model, run.cfg.save)
        print(f"wrote the adapters to {run.cfg.save}", file=out)
    else:
        from jmem.lm import DEFAULT_DTYPES
        from jmem.quant.saved import save_quantized

        what = "trained model"
        if run.cfg.lora_rank > 0:  # a model that serves without --lora-modules (adapters on experts too)
            from jmem.lora import merge

            model, what = merge(model), "model with its adapters merged into its weights"
        # Computed as every model file loads (f32, XLA attention) whatever this run trained with.
        model.config = model.config.replace(**{k: DEFAULT_DTYPES[k] for k in ("compute_dtype", "attention_impl")})
        save_quantized(run.cfg.save, model, tokenizer=run.tokenizer, general_metadata=run.general_metadata)
        print(f"wrote the {what} to {run.cfg.save}", file=out)


def _skipped(opt_state) -> int:
    n = 0
    for leaf_state in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "skipped_steps")):
        if hasattr(leaf_state, "skipped_steps"):
            n += int(_host(leaf_state.skipped_steps))
    return n


def _host(x):
    """A metric as a host value (any process of a multi-host run)."""
    if _multiprocess():
        from jmem import parallel as par

        return par.local_value(x)
    return np.asarray(x)


def _multiprocess() -> bool:
    return jax.process_count() > 1


def _agreed(flag: bool) -> bool:
    """`flag` of any process: a signal that reached one process stops all of them after the same
    step (one stopping alone would leave the others waiting on its collectives)."""
    if not _multiprocess():
        return flag
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array(flag))).any())


# Jitted (step, eval, state shardings, batch sharding) per live TrainFns: an entry goes with
# its TrainFns (dropped by `setup._cached_fns`'s LRU and by every Run), so the cache stays as
# small as that LRU and a new TrainFns never finds an old one's step.
_JIT_CACHE: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _jitted(run: Run, state):
    """`(jitted step, place)`; `place(state=..)` / `place(batch=..)` puts a host value
    on the run's devices (its shardings on a mesh; unchanged on one device).

    One jitted callable per TrainFns so a cached build reuses its compile.
    """
    fns, mesh = run.fns, run.mesh
    key = fns
    if key not in _JIT_CACHE:
        if mesh is None:
            _JIT_CACHE[key] = (jax.jit(fns.step, donate_argnums=0), jax.jit(fns.eval_loss), None, None)
        else:
            from jmem import parallel as par

            step, sh, batch_sh = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh,
                                                    zero=run.cfg.zero, rules=rules_for(run.cfg))
            _JIT_CACHE[key] = (step, jax.jit(fns.eval_loss), sh, batch_sh)
    step, _, sh, batch_sh = _JIT_CACHE[key]

    def place(state=None, batch=None):
        if sh is None:
            return state if batch is None else batch
        from jmem import parallel as par

        if batch is None:
            return par.to_global(state, sh)
        return par.to_global(batch, jax.tree.map(lambda _: batch_sh, batch))

    return step, place


def _jitted_eval(fns):
    if fns not in _JIT_CACHE:  # an offloaded run jits its own step, and only the eval here
        _JIT_CACHE[fns] = (None, jax.jit(fns.eval_loss), None, None)
    return _JIT_CACHE[fns][1]


# --- optimizer / parameter offload (jmem.memory.offload) ------------------------------------------


def _offloaded(run: Run, state, ckpt, start: int, closing: contextlib.ExitStack):
    """`(step, place, placed state, step again)` of a run with --offload-optimizer host|disk: the step is a
    `jmem.memory.offload.OffloadedTrainStep`; with disk, the state files are written fresh, or
    copied from the checkpoint being resumed."""
    from jmem.memory.offload import OffloadedTrainStep

    cfg, fns = run.cfg, run.fns
    abstract_state = jax.eval_shape(lambda: state)
    disk = None
    if cfg.offload_optimizer == "disk":
        from jmem.memory.disk_offload import DiskOptimizer

        disk = DiskOptimizer(run.tx, fns.trainable(abstract_state.params)[0], cfg.offload_dir, clip=cfg.clip)
        closing.callback(disk.close)
    trainer = OffloadedTrainStep(fns, abstract_state, mesh=run.mesh, zero=cfg.zero,
                                 rules=rules_for(run.cfg) if run.mesh is not None else None,
                                 params=cfg.offload_params, disk=disk)
    state = trainer.place(state)
    if disk is not None and start > 0:
        disk.restore(_snapshot_dir(ckpt, start))

    def place(state=None, batch=None):
        return trainer.place(state) if batch is None else trainer.place_batch(batch)

    return trainer, place, state, trainer


def _snapshot_dir(ckpt: Checkpointer, step: int) -> str:
    return str(ckpt.directory / OFFLOAD_SNAPSHOTS / str(step))


@jax.jit
def _all_finite(leaves) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _kept(ckpt: Checkpointer | None) -> str:
    """What a stopped run keeps, for its last line: `; the latest checkpoint is step N`."""
    latest = ckpt.latest_step() if ckpt is not None else None
    return "; no checkpoint was written" if latest is None else f"; the latest checkpoint is step {latest}"


def _check_weights_finite(step: int, params, ckpt: Checkpointer) -> None:
    """TrainingDiverged when a weight is NaN or inf: an update can overflow while its step's loss was still
    finite, and its checkpoint would replace a good one. Weights offloaded to host memory are not read."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)
              and getattr(getattr(x, "sharding", None), "memory_kind", None) in (None, "device")]
    if leaves and not bool(_all_finite(leaves)):
        raise TrainingDiverged(f"step {step}: the weights hold NaN or inf; the run stops without writing them"
                               f"{_kept(ckpt)}; {DIVERGED_ADVICE}")


def _save(ckpt: Checkpointer, step: int, state, meta: dict, offload) -> None:
    """A checkpoint of weights that are finite (`_check_weights_finite`); with disk offload, a copy of
    the optimizer-state files beside it, written before the step becomes the latest checkpoint. Copies
    are kept for the steps the checkpointer keeps, so any kept step can be resumed."""
    _check_weights_finite(step, state.params, ckpt)
    disk = getattr(offload, "disk", None)
    if disk is not None:
        disk.snapshot(_snapshot_dir(ckpt, step))
    ckpt.save(step, state, meta)
    if disk is not None:
        import shutil

        kept = set(map(str, ckpt.steps()))
        for old in (ckpt.directory / OFFLOAD_SNAPSHOTS).iterdir():
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)


def _check_state_settings(ckpt: Checkpointer, run: Run) -> None:
    """Name the flags behind a state structure that differs from the checkpoint's (before
    `Checkpointer.check`, whose last resort is the structure hash), and those of `MEANING_SETTINGS`
    that differ under the same structure."""
    if ckpt.latest_step() is None:
        return
    old = upgrade_meta(ckpt.read_meta() or {})
    if any(old.get(k) != run.meta.get(k) for k in ("model", "optimizer", "precision")):
        return  # Checkpointer.check names those
    if old.get("adam8bit_nu") != run.meta.get("adam8bit_nu"):
        raise CheckpointMismatchError(
            f"checkpoint dir {ckpt.directory} holds adam8bit second moments as v (an earlier version); this "
            f"version stores and reads sqrt(v); resume it with the version that wrote it, or choose another "
            f"--ckpt-dir (nothing was written)")
    if run.cfg.quantize_base == "rtn" and old.get("config", {}).get("quantize_base") == "rtn" \
            and old.get("base_group_size") != run.meta.get("base_group_size"):
        raise CheckpointMismatchError(
            f"checkpoint dir {ckpt.directory} holds a --quantize-base rtn run of an earlier version, whose base "
            f"was quantized per channel; this version quantizes it in groups of {run.meta['base_group_size']} rows "
            "(as jmem quantize writes it); resume it with the version that wrote it, or choose another --ckpt-dir "
            "(nothing was written)")
    same = old.get("structure") == run.meta["structure"]
    diff = state_settings_diff(old, run.cfg, MEANING_SETTINGS if same else None)
    if diff:
        raise CheckpointMismatchError(
            f"checkpoint dir {ckpt.directory} holds a run with a different train state ({'; '.join(diff)}); "
            f"use the checkpoint's settings or choose another --ckpt-dir (nothing was written)")


class _progress:
    """tqdm bar with loss, tokens/s and step time; plain lines when disabled."""

    def __init__(self, cfg: TrainConfig, start: int, end: int, out: TextIO):
        self.out, self.plain = out, not cfg.progress
        self.bar = None
        if not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=end, initial=start, file=out, dynamic_ncols=True, desc="train")

    def update(self, rec: dict):
        txt = dict(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", step_ms=f"{rec['step_time_s'] * 1e3:.0f}")
        if "moe_aux_loss" in rec:
            txt.update(moe_aux=f"{rec['moe_aux_loss']:.3f}", moe_dropped=f"{rec['moe_dropped']:.0f}")
        if self.bar is not None:
            self.bar.set_postfix(txt, refresh=False)
            self.bar.update(1)
        elif rec["step"] % 10 == 0 or rec["step"] == 1:
            print(f"step {rec['step']}: " + " ".join(f"{k}={v}" for k, v in txt.items()), file=self.out)

    def note(self, msg: str):
        if self.bar is not None:
            self.bar.write(msg, file=self.out)
        else:
            print(msg, file=self.out)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def losses_array(result: TrainResult) -> jnp.ndarray:
    """Train losses in step order (for tests and plots)."""
    return jnp.asarray([result.losses[k] for k in sorted(result.losses)])

"""Multi-host start-up: a thin, checked wrapper of `jax.distributed.initialize`.

JAX's multi-controller runtime is the distributed engine: every host runs the
same program, `jax.devices()` then lists the devices of all hosts, and a mesh
from `make_mesh` spans them. On TPU pods and SLURM clusters JAX finds the
coordinator, process count and index by itself (`initialize()` with no
arguments); elsewhere pass them explicitly (the same on every host except
`process_id`).

Example:
    >>> from jmem.parallel import initialize, make_mesh
    >>> initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # on host 0; process_id=1 on host 1
    >>> mesh = make_mesh("fsdp=-1")                                  # all devices of both hosts
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import threading

import jax
import numpy as np

from jmem.checks import check_int, is_int


class DistributedError(ValueError):
    """Missing or inconsistent multi-host settings."""


class DistributedRunError(RuntimeError):
    """A step of a multi-process run failed (most often: another process stopped); this process stops too.
    JAX's exit-time shutdown would wait for the stopped process, so a command ends with `os._exit`."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits after `initialize`."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Validate explicit settings (all three together, or none for auto-detection).

    A lone `process_id` is refused rather than ignored: without a coordinator JAX detects
    the process index itself (or runs one process) and would not use it.

    Raises:
        DistributedError: an incomplete or inconsistent set (one line naming what is missing or bad).
    """
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for name in ("num_processes", "process_id"):
        if given[name] is not None and not is_int(given[name]):
            raise DistributedError(f"{name}={given[name]!r}; accepted: an integer, or None")
    if coordinator is not None and not isinstance(coordinator, str):
        raise DistributedError(f"coordinator={coordinator!r}; accepted: a HOST:PORT string, or None")
    if coordinator is None and process_id is not None:
        raise DistributedError(f"process_id={process_id} needs coordinator and num_processes as well "
                               f"(give coordinator, num_processes and process_id, or none of them)")
    if any(v is not None for v in given.values()) and coordinator is not None:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise DistributedError(f"explicit multi-host start needs {', '.join(missing)} as well "
                                   f"(give coordinator, num_processes and process_id, or none of them)")
    if coordinator is None and num_processes not in (None, 1) and not _auto_env():
        raise DistributedError(f"num_processes={num_processes} needs coordinator and process_id as well, or a "
                               "cluster JAX detects them on (SLURM, a TPU pod, Open MPI)")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DistributedError(f"coordinator {coordinator!r} is not HOST:PORT (e.g. 10.0.0.1:1234)")
    if num_processes is not None and num_processes < 1:
        raise DistributedError(f"num_processes={num_processes} must be >= 1")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id={process_id} must be in 0..{num_processes - 1}")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids=None, cpu_collectives: str | None = "gloo",
               initialization_timeout: int = 300, heartbeat_timeout: int = 100) -> ProcessInfo:
    """Join (or start) a multi-process JAX job.

    Args:
        coordinator: `HOST:PORT` of process 0's coordinator service; None to let JAX detect it
            (TPU pods, SLURM, Open MPI) or, with `num_processes` 1/None, to run single-process.
        num_processes: total processes.
        process_id: this process's index in `0..num_processes-1`.
        local_device_ids: restrict this process to some local devices (e.g. one GPU per process).
        cpu_collectives: collectives backend for CPU devices (`"gloo"`, `"mpi"` or None to keep
            JAX's setting); CPU-only multi-process runs need one.
        initialization_timeout: seconds to wait for all processes. When they have not all
            joined by then, this process prints one line naming the job and exits with
            status 2 (JAX's runtime would abort it a little later with a stack dump).
        heartbeat_timeout: seconds without a heartbeat after which JAX's coordination service
            declares a process dead and ends the job (JAX's default: 100). A survivor that does
            not meet the failure in a step first is then ended by JAX, with its own message.

    Returns:
        `ProcessInfo(process_id, num_processes, local_devices, global_devices)`.

    Raises:
        DistributedError: an incomplete or inconsistent set of arguments, or (on process 0)
            a coordinator port that is already in use on this host.
    """
    check_args(coordinator, num_processes, process_id)
    is_init = getattr(jax.distributed, "is_initialized", lambda: False)
    if is_init():
        return _info()  # already joined (a second call in the same process)
    if coordinator is None and num_processes in (None, 1) and process_id in (None, 0) and not _auto_env():
        return _info()  # single process: nothing to join
    check_int("initialization_timeout", initialization_timeout, 1)
    check_int("heartbeat_timeout", heartbeat_timeout, 1)
    if coordinator is not None and process_id == 0:
        _check_port_free(coordinator)  # else the coordinator service fails to bind and the process crashes
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    # JAX's own deadline is later than the watchdog's, so the watchdog speaks first.
    kwargs = {"initialization_timeout": initialization_timeout + 60, "heartbeat_timeout_seconds": heartbeat_timeout}
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    who = f"process {process_id} of {num_processes}" if coordinator is not None else "this process"
    with _watchdog(initialization_timeout,
                   f"error: {who} waited {initialization_timeout} s for the multi-process job at "
                   f"{coordinator or 'the detected coordinator'} and not every process joined; accepted: the "
                   f"same coordinator and process count on every process, each with its own process id"):
        if coordinator is None:  # detected from the cluster; a count given explicitly wins
            jax.distributed.initialize(**kwargs, **({} if num_processes is None else {"num_processes": num_processes}))
        else:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id, **kwargs)
    return _info()


def _check_port_free(coordinator: str) -> None:
    """DistributedError when process 0 could not listen on the coordinator's port (any address,
    as the coordinator service does); a port left in TIME_WAIT by an earlier run is free."""
    import socket

    port = int(coordinator.rpartition(":")[2])
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("::" if family == socket.AF_INET6 else "", port))
    except OSError as e:
        raise DistributedError(f"coordinator {coordinator!r}: port {port} cannot be used on this host, where "
                               f"process 0 runs the coordinator service ({e.strerror}); accepted: a free "
                               f"port") from None


@contextlib.contextmanager
def _watchdog(seconds: int, message: str):
    """Run the block; if it has not finished within `seconds`, print `message` and exit with status 2
    (a process blocked inside the runtime's connect cannot be interrupted otherwise)."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            print(message, file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watch, daemon=True, name="jmem-initialize-watchdog").start()
    try:
        yield
    finally:
        done.set()


def check_same_settings(settings: dict[str, object], what: str = "settings") -> None:
    """Raise DistributedError naming each of `settings` whose value differs between the processes
    (compared by a digest of its repr, gathered from every process); a no-op with one process.

    Processes that run with different flags would otherwise compile different programs and wait
    on each other's collectives forever, or train silently on different batches.

    Example:
        >>> check_same_settings({"--seed": 0, "--zero": 3})  # the same call on every process
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(settings)
    digests = np.array([int.from_bytes(hashlib.sha256(repr(settings[n]).encode()).digest()[:4], "little")
                        for n in names], np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(digests)).reshape(jax.process_count(), len(names))
    differ = [n for j, n in enumerate(names) if (gathered[:, j] != gathered[0, j]).any()]
    if differ:
        raise DistributedError(f"{what} differ between processes: {', '.join(differ)}; accepted: the same on every "
                               f"process (this is process {jax.process_index()}: "
                               + ", ".join(f"{n} {settings[n]!r}" for n in differ) + ")")


# What JAX's cluster auto-detection needs in the environment: a SLURM job step (`srun`: an `salloc`
# shell or a batch script's own process has SLURM_JOB_ID alone), an Open MPI launch, a TPU pod.
_CLUSTER_ENVS = (("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
                 ("OMPI_MCA_orte_hnp_uri",), ("TPU_WORKER_HOSTNAMES",), ("MEGASCALE_COORDINATOR_ADDRESS",))


def _auto_env() -> bool:
    """True where JAX's cluster auto-detection has something to find (`_CLUSTER_ENVS`)."""
    import os

    return any(all(k in os.environ for k in keys) for keys in _CLUSTER_ENVS)


def _info() -> ProcessInfo:
    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def to_global(tree, shardings):
    """Make global arrays from values every process holds in full (same seed, same data order).

    Single-process: `jax.device_put`. Multi-process: each process fills its own
    shards from its full host copy (`jax.make_array_from_callback`); an array that
    already spans the processes is resharded where its sharding differs.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding.is_equivalent_to(s, x.ndim) else jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


def local_value(x):
    """A replicated (e.g. metric) array as a host numpy value, in any process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)

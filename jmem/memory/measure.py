"""Compiler-measured memory and FLOPs: compile a function without running it.

`measure(fn, *args)` lowers and compiles `fn` for the arguments' shapes and
reads XLA's buffer assignment (`memory_analysis()`) and cost model
(`cost_analysis()`), and counts the matmul FLOPs of every loop iteration from
the optimized HLO (`jmem.memory.hlo_flops`; the cost model counts a loop body
once). Nothing is executed and no argument buffer is touched, so
it works on `jax.ShapeDtypeStruct`s for models that do not fit on the machine.

With `target="tpu:v5e:2x2"` the function is compiled ahead of time for that
TPU topology (through `jax.experimental.topologies` and `libtpu`, the `tpu`
extra), so a TPU run's HBM use is known on a CPU machine. The numbers are per
device. Tracing happens inside `jmem.kernels.dispatch.compiling_for("tpu")`, so
`jmem.kernels.attention` and the Pallas kernels lower for the TPU (Mosaic),
not for the CPU host (the Pallas interpreter). Note the CPU backend computes
bf16 in f32, so bf16 savings show only on a TPU/GPU target.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jmem.kernels.dispatch import compiling_for
from jmem.memory.hlo_flops import matmul_flops

_FIELDS = ("argument", "output", "temp", "alias", "generated_code")
_TARGET_RE = re.compile(r"^tpu:(?P<chip>[a-z0-9]+):(?P<topo>\d+(x\d+){1,2})$")


class TargetError(ValueError):
    """A `target` string that does not parse, or a missing `libtpu`."""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes from XLA's buffer assignment, and the cost model's FLOPs.

    Attributes:
        argument_bytes, output_bytes, temp_bytes, alias_bytes,
        generated_code_bytes: device memory by kind; `alias_bytes` is the part
            of the outputs that reuses (donated) argument buffers.
        host_*_bytes: the same for host memory (offloaded buffers).
        flops: floating-point operations of one call from XLA's cost model
            (`cost_analysis()`), which counts the body of a `while` loop (a layer
            scan, an accumulation or loss-chunk scan) once.
        matmul_flops: FLOPs of every dot and convolution, each loop body counted
            as many times as it runs (`jmem.memory.hlo_flops.matmul_flops`); nan
            for TPU targets (whose executables pad and rewrite matmuls), loops of
            unknown trip count and conditionals whose branches differ.
        peak_bytes: XLA's own peak figure where the backend reports one, else None. On a TPU
            target it can far exceed `total_bytes` for a small program, whose activations the
            temp figure misses (the tiny preset's step: 47.1 MiB peak, 4.9 total; bench-8l's
            within 5%; docs/benchmarks.md); on CPU it is no peak (about arguments and outputs).
        target: the platform compiled for ("cpu", "gpu", "tpu:v5e:2x2", ...).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_temp_bytes: int
    host_alias_bytes: int
    host_generated_code_bytes: int
    flops: float
    matmul_flops: float
    peak_bytes: int | None
    target: str

    @property
    def total_bytes(self) -> int:
        """Device bytes live at once: arguments + outputs - aliased + temp + code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.generated_code_bytes)

    @property
    def host_total_bytes(self) -> int:
        return (self.host_argument_bytes + self.host_output_bytes - self.host_alias_bytes
                + self.host_temp_bytes + self.host_generated_code_bytes)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        d["host_total_bytes"] = self.host_total_bytes
        return d

    def table(self, title: str | None = None) -> str:
        """A fixed-width table (MiB) with device and host columns."""
        rows = [(name.replace("_", " "), getattr(self, f"{name}_bytes"), getattr(self, f"host_{name}_bytes"))
                for name in _FIELDS]
        rows.append(("total", self.total_bytes, self.host_total_bytes))
        head = f"{title or 'memory'} [{self.target}]"
        lines = [head, f"{'':16s}{'device MiB':>14s}{'host MiB':>12s}"]
        lines += [f"{n:16s}{d / 2**20:14.2f}{h / 2**20:12.2f}" for n, d, h in rows]
        lines.append(f"{'GFLOPs':16s}{self.flops / 1e9:14.3f}  (cost model: loop bodies once)")
        lines.append(f"{'matmul GFLOPs':16s}{self.matmul_flops / 1e9:14.3f}  (every loop iteration)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def format_bytes(n: float) -> str:
    """`1536 -> '1.50 KiB'`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parse_target(target: str) -> tuple[str, str]:
    """`"tpu:v5e:2x2" -> ("v5e", "2x2")`; raises `TargetError` naming the form."""
    m = _TARGET_RE.match(target.strip().lower()) if isinstance(target, str) else None
    if m is None:
        raise TargetError(f"target {target!r}: expected 'tpu:CHIP:TOPOLOGY' such as 'tpu:v5e:2x2' or 'tpu:v4:2x2x1'")
    if any(int(d) < 1 for d in m["topo"].split("x")):  # libtpu ends the process (SIGFPE) on a zero
        raise TargetError(f"target {target!r}: a topology dimension of 0; accepted: dimensions >= 1 such as "
                          "'tpu:v5e:2x2'")
    return m["chip"], m["topo"]


@functools.lru_cache(maxsize=8)
def target_devices(target: str) -> tuple:
    """The (virtual) devices of a TPU topology, for building a `Mesh` to shard against.

    Raises:
        TargetError: bad target string, or `libtpu` is not installed.
    """
    chip, topo = parse_target(target)
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            f"target {target!r} needs libtpu to compile for TPU ahead of time: pip install 'jmem[tpu]' (or libtpu)"
        )
    from jax.experimental import topologies

    # Compiling ahead of time touches no TPU hardware, so several processes
    # may load libtpu at once; without this, libtpu's lockfile refuses all but one.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(f"{chip}:{topo}", "tpu")
    except Exception as e:  # libtpu reports unknown chips/topologies in many ways
        raise TargetError(f"target {target!r}: libtpu cannot describe this topology ({e})".splitlines()[0]) from None
    return tuple(desc.devices)


def target_mesh(target: str, axis_names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> Mesh:
    """A `Mesh` over a TPU topology's devices (default: one axis over all chips)."""
    devices = np.array(target_devices(target))
    return Mesh(devices.reshape(shape or (devices.size,)), axis_names)


def _on_mesh(x, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and set(sharding.mesh.devices.flat) == set(mesh.devices.flat)


def _to_target_struct(x, mesh: Mesh):
    """An abstract value on `mesh`: keeps a NamedSharding already on that mesh,
    else replicates (numbers are per device either way)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
    sharding = x.sharding if _on_mesh(x, mesh) else NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _cost_flops(compiled) -> float:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement a cost model
        return float("nan")
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", float("nan")))


def compile_for(fn, *args, target: str | None = None, **kwargs):
    """Lowers and compiles `fn(*args, **kwargs)` without running it.

    `fn` may be a plain function (jitted here) or already `jax.jit`-ted (its
    static arguments and shardings are kept). Arguments may be arrays or
    `jax.ShapeDtypeStruct`s.

    Raises:
        ValueError: `fn` is not callable.
    """
    if not callable(fn):  # a str has a `.lower` too
        raise ValueError(f"fn={fn!r} ({type(fn).__name__}); accepted: a function or a jax.jit-ted function")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)  # tracing waits for `lower`
    if target is None:
        return jitted.lower(*args, **kwargs).compile()
    mesh = target_mesh(target)
    if not any(_on_mesh(x, mesh) for x in jax.tree.leaves((args, kwargs))):
        # Nothing is sharded, so every chip would run the same replicated
        # program: compile it for one chip. The per-device numbers are the
        # same, and Pallas (Mosaic) kernels, which XLA's SPMD partitioner
        # cannot split even when replicated, compile without a shard_map.
        mesh = Mesh(np.array(target_devices(target)[:1]), ("data",))
    args, kwargs = jax.tree.map(lambda x: _to_target_struct(x, mesh), (args, kwargs))
    with compiling_for("tpu"):
        return jitted.lower(*args, **kwargs).compile()


def measure(fn, *args, target: str | None = None, **kwargs) -> MemoryReport:
    """Compiles `fn(*args, **kwargs)` (does not run it) and reports its memory and FLOPs.

    Args:
        fn: a function of arrays, or a `jax.jit`-ted one (e.g. with `donate_argnums`).
        *args, **kwargs: arrays or `jax.ShapeDtypeStruct`s (any pytree).
        target: None for the local backend, or a TPU topology `"tpu:CHIP:AxB"`
            (e.g. `"tpu:v5e:2x2"`) to compile ahead of time with libtpu;
            arguments not already sharded on that topology are replicated
            (when none is sharded, the program is compiled for one chip,
            which gives the same per-device numbers). Kernels traced for it
            lower for TPU (`jmem.kernels.dispatch.compiling_for`).

    Returns:
        A `MemoryReport` (per-device bytes; `.total_bytes`, `.table()`).

    Example:
        >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
        >>> r = measure(lambda x: jnp.tanh(x @ x), x)
        >>> r.argument_bytes, r.flops   # 4194304, ~2.1e9
    """
    return measure_and_compile(fn, *args, target=target, **kwargs)[0]


def measure_and_compile(fn, *args, target: str | None = None, **kwargs):
    """`measure`, also returning the compiled executable.

    On the local backend `compiled(*args)` runs it directly on concrete
    arrays of the measured shapes, without another compile.

    Returns:
        (MemoryReport, jax.stages.Compiled)
    """
    if target is not None:  # fail on a bad string before any tracing; the report names the target as parsed
        target = "tpu:{}:{}".format(*parse_target(target))
    compiled = compile_for(fn, *args, target=target, **kwargs)
    return report_from_compiled(compiled, target or jax.default_backend()), compiled


def report_from_compiled(compiled, target: str) -> MemoryReport:
    """A `MemoryReport` from a `jax.stages.Compiled` (e.g. `jit(f).lower(x).compile()`)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {jax.default_backend()} backend does not report memory_analysis()")
    get = lambda name: int(getattr(stats, name, 0) or 0)  # noqa: E731
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return MemoryReport(
        argument_bytes=get("argument_size_in_bytes"),
        output_bytes=get("output_size_in_bytes"),
        temp_bytes=get("temp_size_in_bytes"),
        alias_bytes=get("alias_size_in_bytes"),
        generated_code_bytes=get("generated_code_size_in_bytes"),
        host_argument_bytes=get("host_argument_size_in_bytes"),
        host_output_bytes=get("host_output_size_in_bytes"),
        host_temp_bytes=get("host_temp_size_in_bytes"),
        host_alias_bytes=get("host_alias_size_in_bytes"),
        host_generated_code_bytes=get("host_generated_code_size_in_bytes"),
        flops=_cost_flops(compiled),
        matmul_flops=math.nan if target.startswith("tpu") else matmul_flops(compiled.as_text()),
        peak_bytes=int(peak) if peak else None,
        target=target,
    )


def tree_bytes(tree) -> int:
    """Bytes of all array leaves (arrays or ShapeDtypeStructs) in `tree`."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype")))


def bytes_per_device(tree, shardings=None) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs).

    Each leaf counts its shard shape under `shardings` (a matching tree of
    `jax.sharding.Sharding`s), or under the leaf's own `.sharding` when
    `shardings` is None; a leaf with neither counts whole. Exact for what a
    compiled step's inputs/outputs occupy (padding aside: jmem only shards
    divisible dimensions).
    """
    leaves = jax.tree.leaves(tree)
    for x in leaves:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise ValueError(f"bytes_per_device: tree has a leaf {x!r} ({type(x).__name__}); accepted: a tree of "
                             "arrays or jax.ShapeDtypeStructs")
    if shardings is None:
        flat = [getattr(x, "sharding", None) for x in leaves]
    else:
        flat = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        accepted = "accepted: a tree of jax.sharding.Sharding with the same structure as tree"
        if len(flat) != len(leaves):
            raise ValueError(f"bytes_per_device: shardings has {len(flat)} leaves for the {len(leaves)} of tree; "
                             + accepted)
        for s in flat:
            if not isinstance(s, jax.sharding.Sharding):
                raise ValueError(f"bytes_per_device: shardings has a leaf {s!r} ({type(s).__name__}); " + accepted)
    total = 0
    for x, s in zip(leaves, flat, strict=True):
        shape = s.shard_shape(tuple(x.shape)) if s is not None else tuple(x.shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return int(total)


# Elements of one array beyond which XLA's compiler aborts the process (its byte counts overflow int64);
# arguments of compile-only measurements are checked against it first.
MAX_COMPILE_ELEMENTS = 2**56


def device_memory_stats() -> dict:
    """The first local device's allocator statistics (`bytes_limit`, `bytes_in_use`); empty on a CPU."""
    return jax.local_devices()[0].memory_stats() or {}


def memory_limit() -> tuple[int, str]:
    """(bytes, what they are) the first local device can hold: its allocator's limit, or on a CPU the
    machine's physical memory."""
    limit = device_memory_stats().get("bytes_limit")
    if limit:
        return int(limit), "the device holds"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"

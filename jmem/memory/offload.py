"""ZeRO-Offload for train steps: optimizer state in host memory (or on disk), the update on the
host, and the stacked layer parameters in host memory, fetched one layer at a time.

A step with an offloaded optimizer is two programs, as in DeepSpeed's ZeRO-Offload:

    device program  (step, params, loss scale, batch) -> (loss-scaled grads, loss)
                    forward + backward only; the optimizer state and the f32 master
                    weights are not among its arguments, so they cost no device memory.
    host update     (grads, opt state, params, loss scale) -> (params, opt state,
                    loss scale, grad norm / finite), jitted on the host (XLA:CPU) over
                    arrays in host RAM; grads go down (D2H), the new params come back (H2D).

The host update is a plain `jax.jit` on the CPU backend (`jax.devices("cpu")`), not
`compute_on("device_host")` inside the device program: under this JAX an optax chain
traced in host compute mixes host and device memory spaces (its constants are device
values) and is refused, and the CPU backend runs on every installation. On a mesh each
device's ZeRO shard of the state stays a shard of a host mesh with the mesh's shape
when the CPU backend has as many devices (always on a CPU machine; `jax_num_cpu_devices`
elsewhere), else the process's one CPU device holds the whole state.

Parameter offload (`params="host"`) keeps every leaf under the model's `layers` key in
the device's host memory kind (`pinned_host`); `fetch_layer`, called by the layer scan of
`jmem.models.llama`, moves one layer's slice to device memory inside the (rematerialised)
loop body, so the forward pass and, through remat, the backward pass hold about one
layer's weights on device. Their gradients leave the scan in host memory, where the host
update wants them.

Example:
    >>> fns = make_train_fns(model, tx)
    >>> trainer = OffloadedTrainStep(fns, jax.eval_shape(lambda: fns.init_state(model)), params="host")
    >>> state = trainer.place(fns.init_state(model))
    >>> state, metrics = trainer(state, batch)
    >>> print(trainer.measure(state, batch).table())
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jmem.memory.measure import MemoryReport, bytes_per_device, measure_and_compile

OPTIMIZER_OFFLOADS = ("none", "host", "disk")
PARAM_OFFLOADS = ("none", "host")
LAYERS_KEY = "layers"
HOST_KINDS = ("pinned_host", "unpinned_host")


class OffloadError(ValueError):
    """An offload setting that is unknown or cannot be combined with the others."""


def check_offload(optimizer: str = "none", params: str = "none", directory: str | None = None) -> None:
    """Check offload settings before anything is built.

    Raises:
        OffloadError: one line naming the bad value and what is accepted.
    """
    if optimizer not in OPTIMIZER_OFFLOADS:
        raise OffloadError(f"offload optimizer {optimizer!r}; accepted: {', '.join(OPTIMIZER_OFFLOADS)}")
    if params not in PARAM_OFFLOADS:
        raise OffloadError(f"offload params {params!r}; accepted: {', '.join(PARAM_OFFLOADS)}")
    if optimizer == "disk" and not directory:
        raise OffloadError("offload optimizer 'disk' needs a directory for its state files (--offload-dir PATH)")
    if directory and optimizer != "disk":
        raise OffloadError(f"an offload directory ({directory}) is only used with offload optimizer 'disk', "
                           f"not {optimizer!r}")
    if params == "host" and optimizer == "none":
        raise OffloadError("offload params 'host' needs offload optimizer 'host' or 'disk': the layer gradients "
                           "leave the layer scan in host memory, where the update runs")


def host_memory_kind(device=None) -> str:
    """The host memory kind of `device` (`pinned_host`, else `unpinned_host`).

    Raises:
        OffloadError: the device has neither (it cannot hold arrays in host memory).
    """
    device = jax.devices()[0] if device is None else device
    kinds = [m.kind for m in device.addressable_memories()]
    for kind in HOST_KINDS:
        if kind in kinds:
            return kind
    raise OffloadError(f"device {device} has memories {kinds}; parameter offload needs one of {', '.join(HOST_KINDS)}")


# Memory spaces of traced values (`jax.memory.Space`); a JAX without them cannot offload parameters.
_SPACE = getattr(getattr(jax, "memory", None), "Space", None)


def _in_host_space(x) -> bool:
    try:
        space = getattr(jax.typeof(x), "memory_space", None)
    except TypeError:  # not an array
        return False
    return space is not None and space == _SPACE.Host


def any_in_host_memory(tree) -> bool:
    """Whether a leaf of `tree` (traced code) lives in host memory (an offloaded parameter)."""
    return _SPACE is not None and hasattr(jax, "typeof") and any(map(_in_host_space, jax.tree.leaves(tree)))


def in_memory_space_of(x, like):
    """`x` moved to the memory space of `like` (traced code): host memory when `like` is in host
    memory (an offloaded parameter, or its gradient), else `x` as it is."""
    if _SPACE is None or not hasattr(jax, "typeof") or not _in_host_space(like):
        return x
    return jax.device_put(x, _SPACE.Host)


def add_into(total, x):
    """`total + x` in `total`'s dtype, computed where `total` lives: a sum in host memory (the
    accumulated gradient of an offloaded parameter) is added on the host (`compute_on`)."""
    if _SPACE is None or not hasattr(jax, "typeof") or not _in_host_space(total):
        return total + x.astype(total.dtype)
    from jax.experimental.compute_on import compute_on

    with compute_on("device_host"):
        return _add(total, x)


@jax.jit
def _add(total, x):
    return total + x.astype(total.dtype)


def fetch_layer(tree):
    """Move the leaves of one layer's weights that are in host memory to device memory.

    Called on each layer's slice inside the model's layer scan (traced code); leaves
    already in device memory pass through, so it is free when nothing is offloaded.
    Its transpose moves the layer's gradient back to host memory.

    Example:
        >>> def body(x, w):
        ...     w = fetch_layer(w)          # w: one layer's slice of host-resident stacked weights
        ...     return block(x, w), None
    """
    if _SPACE is None or not hasattr(jax, "typeof"):
        return tree
    return jax.tree.map(lambda x: jax.device_put(x, _SPACE.Device) if _in_host_space(x) else x, tree)


def _is_layer_path(path) -> bool:
    return any(getattr(k, "key", None) == LAYERS_KEY for k in path)


def _with_kind(sharding, kind: str):
    return sharding.with_memory_kind(kind)


def layer_host_shardings(shardings, kind: str):
    """`shardings` (a tree matching params) with the leaves under `layers` in memory `kind`."""
    return jax.tree_util.tree_map_with_path(
        lambda p, s: _with_kind(s, kind) if _is_layer_path(p) else s, shardings,
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def offload_layers(params, kind: str | None = None):
    """`params` with every array under `layers` placed in host memory (same devices and layout).

    Example:
        >>> params = offload_layers(params)          # params["layers"] now in pinned_host
    """
    kind = kind or host_memory_kind()
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, _with_kind(x.sharding, kind)) if _is_layer_path(p) else x, params)


# --- where the host update keeps its arrays -------------------------------------------------


def host_mesh(mesh: Mesh | None) -> Mesh | None:
    """The CPU-backend mesh that mirrors `mesh` (device i's shard on host device i), or None
    when the CPU backend has fewer devices (the whole state then sits on one CPU device)."""
    if mesh is None:
        return None
    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return mesh
    cpus = jax.devices("cpu")
    if len(cpus) < mesh.devices.size:
        return None
    return Mesh(np.array(cpus[:mesh.devices.size]).reshape(mesh.devices.shape), mesh.axis_names)


def host_shardings(device_shardings, mesh: Mesh | None):
    """Host-side shardings for a tree of device shardings (see `host_mesh`)."""
    hmesh = host_mesh(mesh)
    cpu0 = jax.devices("cpu")[0]

    def one(s):
        if hmesh is not None and isinstance(s, NamedSharding):
            return NamedSharding(hmesh, s.spec)
        return SingleDeviceSharding(cpu0)

    return jax.tree.map(one, device_shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


# --- measuring ---------------------------------------------------------------------------------

_LAYOUT_RE = re.compile(r"entry_computation_layout=\{\((.*?)\)->(.*?)\}(?:,\s*\w+=|$)", re.M)
_SHAPE_RE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)"
                       r"\[([0-9,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
          "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def _split_bytes(shapes: str) -> tuple[int, int]:
    device = host = 0
    for dtype, dims, layout in _SHAPE_RE.findall(shapes):
        n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        b = int(n * _BYTES[dtype])
        if layout and "S(5)" in layout:
            host += b
        else:
            device += b
    return device, host


def argument_bytes_by_space(hlo_text: str, outputs: bool = False) -> tuple[int, int]:
    """(device, host) bytes of a compiled program's arguments (or `outputs`), from its entry layout.

    Arguments placed in host memory carry memory space `S(5)` in the compiled module's
    `entry_computation_layout` on every backend, while the CPU backend's
    `memory_analysis()` counts them as device bytes; this reads the layout instead.
    Shapes are per device (after SPMD partitioning).

    Example:
        >>> argument_bytes_by_space(jax.jit(f).lower(x).compile().as_text())
        (4096, 1048576)
    """
    m = _LAYOUT_RE.search(hlo_text)
    if m is None:
        raise ValueError("no entry_computation_layout in the compiled module text")
    return _split_bytes(m.group(2) if outputs else m.group(1))


@dataclasses.dataclass(frozen=True)
class OffloadReport:
    """Memory of an offloaded step, per device.

    Attributes:
        device: the device program (forward + backward) as the compiler reports it.
        update: the host update program (compiled for the CPU backend).
        device_argument_bytes, host_argument_bytes: the device program's arguments split by
            memory space (`argument_bytes_by_space`; offloaded layer params are host bytes).
        host_output_bytes: its outputs in host memory (the offloaded layers' gradients).
        host_state_bytes: optimizer state (with any f32 master weights) kept in host memory,
            per device shard.
        disk_state_bytes: optimizer state kept in files (disk offload), total.
        host_chunk_bytes: the most optimizer state in host memory at once (disk offload).
    """

    device: MemoryReport
    update: MemoryReport | None
    device_argument_bytes: int
    host_argument_bytes: int
    host_state_bytes: int
    disk_state_bytes: int = 0
    host_chunk_bytes: int = 0
    host_output_bytes: int = 0

    @property
    def device_total_bytes(self) -> int:
        """Device bytes live at once in the device program. Backends that separate memory
        spaces (GPU, TPU) already leave host arguments out of `device.argument_bytes`; the CPU
        backend counts them, so they are taken out here."""
        if self.device.host_argument_bytes or self.device.host_output_bytes:
            return self.device.total_bytes
        return self.device.total_bytes - self.host_argument_bytes - self.host_output_bytes

    @property
    def device_memory(self) -> MemoryReport:
        """`device` with device-memory argument and output bytes: the host parts a backend that does not
        separate memory spaces (CPU) counts in them taken out (the train log and plot show this one)."""
        return dataclasses.replace(self.device, argument_bytes=self.device_argument_bytes,
                                   output_bytes=self.device_output_bytes)

    @property
    def device_output_bytes(self) -> int:
        separated = self.device.host_argument_bytes or self.device.host_output_bytes
        return self.device.output_bytes - (0 if separated else self.host_output_bytes)

    def rows(self) -> list[tuple[str, str, int]]:
        """(where, what, bytes) rows for a memory table."""
        out = [("device", "arguments (params on device, batch)", self.device_argument_bytes),
               ("device", "temp (activations, grads)", self.device.temp_bytes),
               ("device", "outputs (grads, metrics)", self.device_output_bytes),
               ("device", "total live (device program)", self.device_total_bytes),
               ("host", "offloaded layer params", self.host_argument_bytes),
               ("host", "layer gradients (device outputs)", self.host_output_bytes),
               ("host", "optimizer state + master weights", self.host_state_bytes)]
        if self.update is not None:
            out.append(("host", "update program total live", self.update.total_bytes + self.update.host_total_bytes))
        if self.disk_state_bytes:
            out += [("disk", "optimizer state files", self.disk_state_bytes),
                    ("host", "  largest chunk in memory", self.host_chunk_bytes)]
        return out

    def table(self) -> str:
        lines = [f"memory of one offloaded train step [{self.device.target}]" + " " * 12 + "MiB"]
        lines += [f"  {where:<8s}{what:<42s}{b / 2**20:10.2f}" for where, what, b in self.rows()]
        return "\n".join(lines)


def abstract(tree):
    """ShapeDtypeStructs (with shardings) of a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


# --- the two-program step ----------------------------------------------------------------------


class OffloadedTrainStep:
    """A `jmem.train` step with the optimizer in host memory (or on disk) and, optionally,
    the layer parameters in host memory.

    Args:
        fns: `jmem.train.make_train_fns(...)` of the model (its `grads`/`update` halves are used;
            build its optimizer without `jmem.parallel.constrain_gradients`, whose device
            shardings do not apply to the host update).
        abstract_state: `jax.eval_shape(lambda: fns.init_state(model))`.
        mesh, zero, rules: as for `jmem.parallel.jit_train_step` (None: one device). ZeRO-1/2
            keep their sharded optimizer state and gradients; each device's shard of the state
            is a shard of the host mesh (`host_mesh`).
        params: "none" or "host" (layer parameters in host memory, fetched per layer).
        disk: a `jmem.memory.disk_offload.DiskOptimizer` to run the update from files
            instead of host arrays (ZeRO-Infinity); then `state.opt_state` is its small handle, so `fns`
            must be built with `jmem.memory.disk_offload.placeholder_transform()` as its optimizer.

    Raises:
        OffloadError: a multi-process run, ZeRO-3 (its parameters are gathered per layer on
            device; offload them with params="host" instead), or a bad `params` value.
    """

    def __init__(self, fns, abstract_state, *, mesh: Mesh | None = None, zero: int = 0, rules=None,
                 params: str = "none", disk=None):
        check_offload("disk" if disk is not None else "host", params, getattr(disk, "directory", None))
        if jax.process_count() > 1:
            raise OffloadError("optimizer offload runs in one process; got "
                               f"{jax.process_count()} processes (drop the offload flags or run one process)")
        from jmem.parallel.zero import check_stage

        zero = check_stage(zero)
        if mesh is not None:
            from jmem.parallel.mesh import check_mesh

            check_mesh(mesh)
        if mesh is None and zero:
            raise OffloadError(f"zero={zero} without a mesh; accepted: zero=0, or a mesh (jmem.parallel.make_mesh) "
                               "whose data-parallel axes the stage partitions over")
        if mesh is not None and zero >= 3:
            raise OffloadError("optimizer offload with ZeRO-3 (zero=3, --zero 3) is not supported (the step gathers "
                               "sharded parameters per layer on device); accepted: zero 0, 1 or 2, with "
                               "params='host' (--offload-params host) to keep the layer parameters in host memory")
        if disk is not None and not hasattr(abstract_state.opt_state, "updates"):
            raise OffloadError("disk offload needs train functions built with the optimizer "
                               "jmem.memory.disk_offload.placeholder_transform() (the state then holds a small "
                               "handle; DiskOptimizer holds the real optimizer); got an optimizer state of type "
                               f"{type(abstract_state.opt_state).__name__}")
        if fns.grads is None or fns.update is None:
            raise OffloadError("these train functions have no grads/update halves (build them with "
                               "jmem.train.make_train_fns)")
        self.fns, self.mesh, self.zero, self.rules = fns, mesh, zero, rules
        self.params_offload, self.disk = params, disk
        self.kind = host_memory_kind() if params == "host" else None
        train = fns.trainable(abstract_state.params)[0]
        if mesh is None:
            dev = SingleDeviceSharding(jax.devices()[0])
            param_sh = jax.tree.map(lambda _: dev, abstract_state.params)
            grad_sh = jax.tree.map(lambda _: dev, train)
            opt_sh = jax.tree.map(lambda _: dev, abstract_state.opt_state)
            self._rep = dev
        else:
            from jmem.parallel.zero import zero_shardings

            zs = zero_shardings(abstract_state.params, abstract_state.opt_state, mesh, stage=zero, rules=rules)
            grad_sh = zero_shardings(train, abstract_state.opt_state, mesh, stage=zero, rules=rules).grads
            param_sh, opt_sh = zs.params, zs.opt_state
            self._rep = NamedSharding(mesh, PartitionSpec())
        if self.kind is not None:
            param_sh = layer_host_shardings(param_sh, self.kind)
            grad_sh = layer_host_shardings(grad_sh, self.kind)
        self.param_shardings = param_sh
        self.train_shardings = fns.trainable(param_sh)[0]
        self.host_train_shardings = host_shardings(self.train_shardings, mesh)
        self.host_grad_shardings = host_shardings(grad_sh, mesh)
        self.host_opt_shardings = host_shardings(opt_sh, mesh)
        self._grad_shardings = grad_sh
        self._grads = self._jit_grads()
        self._host = host_shardings(self._rep, mesh)  # the loss scale, beside the host gradients
        self._prepare = jax.jit(fns.prepare)
        self._update = None if disk is not None else jax.jit(
            self._host_update, out_shardings=(self.host_train_shardings, self.host_opt_shardings, None, None),
            donate_argnums=(1,))
        self._compiled: dict = {}

    def _jit_grads(self):
        fn = self.fns.grads
        if self.mesh is None:
            return jax.jit(fn)
        from jmem.parallel.rules import Rules, activation_sharding
        from jmem.parallel.step import batch_spec

        rules, mesh = Rules.parse(self.rules), self.mesh

        def traced(state, batch):
            with activation_sharding(rules, mesh):
                return fn(state, batch)

        self.batch_sharding = NamedSharding(mesh, batch_spec(mesh, rules))
        return jax.jit(traced, out_shardings=(self._grad_shardings, self._rep))

    def _host_update(self, grads, opt_state, train, loss_scale):
        """Unscale, check and measure the gradients, then the optimizer update (all on the host)."""
        grads, metrics, loss_scale = self.fns.prepare(grads, loss_scale)
        train, opt_state = self.fns.update(grads, opt_state, train)
        return train, opt_state, loss_scale, metrics

    def _device_state(self, state):
        return state._replace(opt_state=None)

    def place(self, state):
        """Put a (host numpy or device) `TrainState` where this step keeps it: params on the
        devices (layers in host memory with params="host"), optimizer state on the host (or,
        with disk offload, written to its files)."""
        params = jax.device_put(state.params, self.param_shardings)
        rep = lambda x: jax.device_put(x, self._rep)  # noqa: E731
        if self.disk is not None:
            opt = self.disk.place(self.fns.trainable(state.params)[0], int(np.asarray(state.opt_state.updates)))
        else:
            opt = jax.device_put(state.opt_state, self.host_opt_shardings)
        return state._replace(step=rep(state.step), params=params, opt_state=opt,
                              loss_scale=jax.tree.map(rep, state.loss_scale))

    def place_batch(self, batch):
        if self.mesh is None:
            return batch
        return jax.device_put(batch, jax.tree.map(lambda _: self.batch_sharding, batch))

    def __call__(self, state, batch):
        """One step: device forward/backward, then the update on the host."""
        from jmem.train.step import join_metrics

        dev_state = self._device_state(state)
        grads_fn = self._compiled.get("grads", self._grads)
        grads, metrics = grads_fn(dev_state, batch)
        train, frozen = self.fns.trainable(state.params)
        host_grads = jax.device_put(grads, self.host_grad_shardings)
        host_train = jax.device_put(train, self.host_train_shardings)
        host_ls = jax.device_put(state.loss_scale, self._host)
        del grads
        if self.disk is not None:
            grads, more, loss_scale = self._prepare(host_grads, host_ls)
            new_train, opt_state = self.disk.update(grads, state.opt_state, host_train)
        else:
            new_train, opt_state, loss_scale, more = self._update(host_grads, state.opt_state, host_train, host_ls)
        new_train = jax.device_put(new_train, self.train_shardings)
        loss_scale = jax.device_put(loss_scale, self._rep)
        params = self.fns.combine(new_train, frozen)
        return (state._replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale),
                join_metrics(metrics, more))

    def measure(self, state, batch) -> OffloadReport:
        """Compile both programs for `state`'s and `batch`'s shapes (without running them) and
        report device and host bytes; later calls reuse the device program's compile."""
        dev_state = self._device_state(state)
        report, compiled = measure_and_compile(self._grads, dev_state, batch)
        self._compiled["grads"] = compiled
        hlo = compiled.as_text()
        dev_args, host_args = argument_bytes_by_space(hlo)
        host_out = argument_bytes_by_space(hlo, outputs=True)[1]
        train = self.fns.trainable(abstract(state.params))[0]
        h_train = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               train, self.host_train_shardings)
        h_grads = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               train, self.host_grad_shardings)
        if self.disk is not None:
            return OffloadReport(report, None, dev_args, host_args, 0, self.disk.total_bytes, self.disk.chunk_bytes,
                                 host_out)
        h_opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             abstract(state.opt_state), self.host_opt_shardings)
        h_ls = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._host),
                            abstract(state.loss_scale))
        update_report, compiled_update = measure_and_compile(self._update, h_grads, h_opt, h_train, h_ls)
        host_state = bytes_per_device(state.opt_state, self.host_opt_shardings)
        return OffloadReport(report, update_report, dev_args, host_args, host_state, host_output_bytes=host_out)

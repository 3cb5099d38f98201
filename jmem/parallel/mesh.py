"""Device meshes with jmem's five named axes.

Every mesh jmem builds has all five axes, in this order (outermost first):

    stage   pipeline stages (layers on different devices)
    data    pure data parallelism (replicas; ZeRO shards over it too)
    fsdp    data parallelism whose group also shards parameters (ZeRO-3 / FSDP)
    expert  MoE experts
    tensor  Megatron tensor parallelism (innermost: the fastest links)

Axes not named in the spec have size 1, so sharding rules may always name any
of them. One axis may be given as -1 to take the remaining devices.

Example:
    >>> mesh = make_mesh("data=2,fsdp=2,tensor=2")   # 8 devices
    >>> dict(mesh.shape)
    {'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'tensor': 2}
"""

from __future__ import annotations

import collections
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jmem.checks import is_int

AXES: tuple[str, ...] = ("stage", "data", "fsdp", "expert", "tensor")
"""Mesh axis names, outermost first."""

DATA_AXES: tuple[str, ...] = ("data", "fsdp")
"""The data-parallel axes: the batch is split over them and no parameter is split over them by rule."""

ZERO_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
"""The axes ZeRO shards model state over: those the batch is split over (under the default rules),
`expert` included (as DeepSpeed-MoE shards dense weights over its expert-parallel group too). A leaf
already split over one of them by rule (an expert weight over `expert`) is not split over it again."""


class MeshError(ValueError):
    """A mesh spec that does not parse or does not match the devices."""


def check_mesh(mesh, name: str = "mesh") -> Mesh:
    """`mesh` itself when it is a `jax.sharding.Mesh`, else one MeshError naming what was passed."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"{name}={mesh!r:.80}; accepted: a jax.sharding.Mesh, e.g. jmem.parallel.make_mesh('data=8') "
                        "(make_mesh turns a spec string into one)")
    return mesh


def parse_mesh(spec: "str | Mapping[str, int] | None") -> dict[str, int]:
    """`"data=2,fsdp=-1"` or `{"data": 2, "fsdp": -1}` -> `{"data": 2, "fsdp": -1}` (validated names).

    Raises:
        MeshError: unknown axis, repeated axis, non-integer (a bool too) or size < 1 (other than one -1).
    """
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise MeshError(f"mesh entry {part!r} is not 'axis=size'; example: 'data=2,fsdp=2,tensor=2'")
            name, size = (s.strip() for s in part.split("=", 1))
            try:
                items.append((name, int(size)))
            except ValueError:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; accepted: a positive integer or -1") from None
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise MeshError(f"mesh spec {spec!r} must be a string like 'data=2,tensor=2' or a dict")
    out: dict[str, int] = {}
    for name, size in items:
        if name not in AXES:
            raise MeshError(f"unknown mesh axis {name!r}; accepted: {', '.join(AXES)}")
        if name in out:
            raise MeshError(f"mesh axis {name!r} is given twice")
        if not is_int(size) or (size < 1 and size != -1):
            raise MeshError(f"mesh axis {name}={size!r}: accepted sizes are positive integers or -1 (fill)")
        out[name] = int(size)
    if sum(1 for s in out.values() if s == -1) > 1:
        raise MeshError(f"mesh {format_mesh(out)}: at most one axis may be -1")
    return out


def resolve_shape(spec: "str | Mapping[str, int] | None", n_devices: int) -> dict[str, int]:
    """Sizes of all five axes for `n_devices` (fills -1; data takes all devices when nothing is given).

    Raises:
        MeshError: the product does not equal the device count.
    """
    sizes = parse_mesh(spec)
    if not sizes:
        sizes = {"data": -1}
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if n_devices % known:
            raise MeshError(f"mesh {format_mesh(sizes)}: the fixed axes ({known} devices) do not divide "
                            f"the {n_devices} devices")
        sizes = {k: (n_devices // known if v == -1 else v) for k, v in sizes.items()}
    total = math.prod(sizes.values())
    if total != n_devices:
        raise MeshError(f"mesh {format_mesh(sizes)} needs {total} devices but there are {n_devices}; "
                        f"make the sizes multiply to {n_devices} or use -1 for one axis")
    return {a: sizes.get(a, 1) for a in AXES}


def format_mesh(sizes: Mapping[str, int]) -> str:
    """`{"data": 2, "tensor": 2}` -> `"data=2,tensor=2"` (size-1 axes dropped, canonical order)."""
    order = [a for a in AXES if a in sizes] + [a for a in sizes if a not in AXES]
    parts = [f"{a}={sizes[a]}" for a in order if sizes[a] != 1]
    return ",".join(parts) or "data=1"


def make_mesh(spec: "str | Mapping[str, int] | None" = None, devices: Sequence | None = None) -> Mesh:
    """A `jax.sharding.Mesh` with axes `stage, data, fsdp, expert, tensor`.

    Args:
        spec: `"data=2,fsdp=2,tensor=2"`, a dict of the same, or None (all devices on `data`).
            One axis may be -1 to take the remaining devices.
        devices: the devices to use (default: `jax.devices()`, all processes).

    Returns:
        A mesh of all five axes (the ones not named have size 1).

    Raises:
        MeshError: unknown axis name, bad size, sizes whose product is not the device count, or a
            device given twice.

    Example:
        >>> mesh = make_mesh("fsdp=-1,tensor=2")
    """
    if devices is not None and not isinstance(devices, (list, tuple, np.ndarray)):
        raise MeshError(f"devices={devices!r:.80}; accepted: a list of devices (e.g. jax.devices()[:4]), or None "
                        "for all")
    devices = list(jax.devices() if devices is None else np.ravel(np.asarray(devices, dtype=object)))
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise MeshError(f"devices={devices!r:.80}; accepted: a non-empty list of jax devices (e.g. "
                        "jax.devices()[:4]), or None for all")
    for d, n in collections.Counter(devices).items():
        if n > 1:
            raise MeshError(f"device {d} is given {n} times; accepted: each device at most once")
    sizes = resolve_shape(spec, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    if devices[0].platform in ("tpu", "gpu"):
        # Topology-aware placement (tensor on the nearest devices); plain order if it cannot.
        from jax.experimental import mesh_utils

        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return Mesh(grid, AXES)


def data_parallel_size(mesh: Mesh, axes: Sequence[str] = DATA_AXES) -> int:
    """Product of the sizes of `axes` (one name or a sequence of them) in `mesh` (1 for axes it lacks)."""
    check_mesh(mesh)
    axes = (axes,) if isinstance(axes, str) else axes  # not its letters
    return math.prod(mesh.shape.get(a, 1) for a in axes)


def mesh_summary(mesh: Mesh) -> str:
    """`"data=2,fsdp=2,tensor=2"` for a mesh (the inverse of `make_mesh`'s spec)."""
    check_mesh(mesh)
    return format_mesh(dict(mesh.shape))

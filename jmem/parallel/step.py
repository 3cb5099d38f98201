"""A sharded train step: `jax.jit` with ZeRO in/out shardings, one gradient reduction per step.

Two ways in:

* `make_sharded_train_step(loss_fn, optimizer, params, mesh, zero=..)`: a
  self-contained step for any pure loss `loss_fn(params, batch) -> (loss_sum, count)`.
* `jit_train_step(step_fn, abstract_state, mesh, zero=..)`: shardings for an
  existing `(state, batch) -> (state, metrics)` function such as
  `jmem.train.make_train_fns(...).step` (wrap its optimizer with
  `constrain_gradients` and its accumulation with `dp_accumulate_value_and_grad`).

Gradient accumulation under plain `jit` reduces the gradient inside the
microbatch loop, once per microbatch. With `accum > 1`,
`dp_accumulate_value_and_grad` instead gives every data-parallel group its own
gradient accumulator (a leading axis of size D, sharded over the mesh axes the
batch is split over, `expert` included when no parameter is split over it;
computed by `vmap` over the groups), so no collective runs inside the loop and
the one reduction (an explicit all-reduce, or reduce-scatter at ZeRO 2-3)
happens after it; the price is one full local f32 gradient per device. With
`accum == 1` the step is a plain `value_and_grad` and XLA reduces each layer's
gradient inside the backward layer scan as it is produced, which needs less
temporary memory than a whole local gradient. At ZeRO 2-3 that reduction is
the compiler's choice: the CPU compiler all-reduces and slices; the TPU
compiler (v5e, ahead of time) reduce-scatters some leaves and all-reduces then
slices others (the layers' kernels among them); the explicit reduce-scatter is
the `accum > 1` path's. A loss that is not additive
over the batch (an MoE model's routing) keeps the global microbatches of one
device instead (see `dp_accumulate_value_and_grad`).

Example:
    >>> mesh = make_mesh("data=2,fsdp=2,tensor=2")
    >>> trainer = make_sharded_train_step(loss_fn, optax.adamw(1e-3), params, mesh, zero=3, accum=2)
    >>> state = trainer.init(params)
    >>> state, metrics = trainer.step(state, batch)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
    from jax import shard_map
except ImportError:  # older JAX
    from jax.experimental.shard_map import shard_map

from jmem.checks import check_int, check_optimizer, loss_pair
from jmem.memory.measure import bytes_per_device
from jmem.parallel.distributed import to_global
from jmem.parallel.gather import gather_on_use, is_weight_leaf
from jmem.parallel.mesh import DATA_AXES, check_mesh
from jmem.parallel.rules import (Rules, ShardingError, activation_sharding, active_activation_sharding, check_heads,
                                 without_axes)
from jmem.parallel.zero import (ZeroShardings, check_stage, constrain_gradients, state_shardings, tree_shardings,
                                zero_shardings)


class ParallelState(NamedTuple):
    """Train state of `make_sharded_train_step`."""

    step: jax.Array  # i32[]
    params: Any
    opt_state: Any


def batch_axes(mesh: Mesh, rules=None) -> tuple[str, ...]:
    """The mesh axes (size > 1) the batch is split over, from the rules' `batch` entry."""
    return tuple(a for a in Rules.parse(rules).mesh_axes("batch") if mesh.shape.get(a, 1) > 1)


def batch_spec(mesh: Mesh, rules=None) -> P:
    axes = batch_axes(mesh, rules)
    return P(axes if len(axes) > 1 else (axes[0] if axes else None))


def check_not_donated(state) -> None:
    """Raise a clear error when a leaf of `state` was donated to an earlier step (its buffers deleted): on a
    multi-device CPU backend the jitted step would otherwise crash the process rather than raise."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ValueError("the state was donated to an earlier step (its buffers are deleted); accepted: the state "
                         "that step returned (or a step built with donate=False)")


def check_batch(batch, mesh: Mesh, rules=None, accum: int = 1) -> None:
    """Raise a clear error unless every leaf has a leading batch dimension that divides into data groups
    x microbatches."""
    d = math.prod(mesh.shape[a] for a in batch_axes(mesh, rules))
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        shape = getattr(x, "shape", None) or np.shape(x)  # arrays and ShapeDtypeStructs
        if not shape:
            raise ShardingError(f"batch{jax.tree_util.keystr(path)} is a scalar; accepted: every batch leaf an "
                                "array with a leading batch dimension (pass constants through the loss function)")
        if shape[0] % (d * accum):
            raise ShardingError(
                f"batch size {shape[0]} is not divisible by data-parallel size {d} x accum {accum} = {d * accum} "
                f"(mesh axes {'+'.join(batch_axes(mesh, rules)) or 'none'})")


def group_axes(mesh: Mesh, rules=None, params=None, logical_axes: Mapping | None = None) -> tuple[str, ...]:
    """Mesh axes whose groups keep separate gradient accumulators.

    Every axis the batch is split over (`data`, `fsdp`, and `expert` under the default
    rules), except a non-data axis that the model-parallel rules also split a
    parameter of `params` over (`expert` in an MoE model: those weights' gradients are
    not summed over it). A gradient is then reduced over all of them once, after the
    microbatch loop. Without `params` every batch axis counts.
    """
    axes = batch_axes(mesh, rules)
    if params is None:
        return axes
    used = {a for sh in jax.tree.leaves(tree_shardings(params, mesh, rules, logical_axes, zero=False))
            for e in sh.spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    return tuple(a for a in axes if a in DATA_AXES or a not in used)


def reduce_groups(grads_G, target_shardings, mesh: Mesh, axes: tuple[str, ...]):
    """Sum per-group gradients `[D, ...]` (dim 0 on `axes`) into `target_shardings`.

    An explicit collective per leaf: `psum_scatter` (reduce-scatter) when the target
    shards a dim over `axes` (ZeRO 2-3), else `psum` (all-reduce).
    """
    ax = _axis(axes)

    def one(g, target):
        out_spec = target.spec
        entries = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in out_spec]
        entries += [()] * (g.ndim - 1 - len(entries))
        local = [tuple(a for a in e if a not in axes) or None for e in entries]
        local = [e[0] if e is not None and len(e) == 1 else e for e in local]
        dims = [i for i, e in enumerate(entries) if any(a in axes for a in e)]
        on_dim = tuple(a for a in entries[dims[0]] if a in axes) if len(dims) == 1 else ()
        # Fast path: the group axes that split one dim (the ZeRO data axes), in order, are the minor part of
        # its split: reduce-scatter over them, after an all-reduce over the other group axes (e.g. `expert`).
        scatter = len(dims) == 1 and entries[dims[0]][-len(on_dim):] == on_dim
        others = tuple(a for a in axes if a not in on_dim)

        def body(x):
            x = x[0]
            if scatter:
                if others:
                    x = jax.lax.psum(x, _axis(others))
                return jax.lax.psum_scatter(x, _axis(on_dim), scatter_dimension=dims[0], tiled=True)
            return jax.lax.psum(x, ax)

        if scatter or not dims:
            return shard_map(body, mesh=mesh, in_specs=P(ax, *local), out_specs=out_spec)(g)
        # Other layouts (a rule that puts a data axis on another dim): all-reduce, then slice.
        whole = shard_map(body, mesh=mesh, in_specs=P(ax, *local), out_specs=P(*local))(g)
        return jax.lax.with_sharding_constraint(whole, target)

    return jax.tree.map(one, grads_G, target_shardings)


def _axis(axes: tuple[str, ...]):
    """One mesh axis name, or a tuple of several, as the collectives take them."""
    return axes if len(axes) > 1 else axes[0]


def dp_accumulate_value_and_grad(fn: Callable, params, batch, num_microbatches: int, *, mesh: Mesh, zero: int = 0,
                                 rules=None, logical_axes: Mapping | None = None, has_aux: bool = False,
                                 accum_dtype=jnp.float32, group_accumulators: bool | None = None):
    """`jmem.memory.accumulate.accumulate_value_and_grad` with one explicit gradient reduction per step.

    Same arguments and result (`(value, grads)`, or `((value, aux), grads)` with
    `has_aux`), plus the mesh and ZeRO stage; `fn` must be additive over the
    batch. Each data-parallel group (the batch axes of `group_axes`: `data`,
    `fsdp`, and `expert` when no parameter is split over it) accumulates its own
    gradient over the `num_microbatches` microbatches of its batch shard
    (`vmap` over the groups: no collective inside the microbatch loop); the
    groups are then summed once: an all-reduce at ZeRO 0-1, a reduce-scatter
    into the sharded gradient layout at ZeRO 2-3.

    Memory: one `accum_dtype` gradient copy per device (its group's accumulator).

    `group_accumulators=False` (the default when `num_microbatches == 1`) falls back to
    `accumulate_value_and_grad` under the step's shardings: XLA then places the
    reduction itself (per layer in the backward scan, and per microbatch), and every
    microbatch is a contiguous slice of the global batch, as on one device. A loss that
    is not additive over the batch needs that: an MoE model's routing (expert capacity,
    load-balancing statistics) depends on which rows one call sees, so per-group
    accumulators would route each group's rows apart, not the single-device microbatch
    (`jmem.train.make_train_fns` and `make_sharded_train_step` pass False for MoE models).
    Parameters offloaded to host memory take that path too: their gradients are summed in
    host memory, where they arrive (`jmem.memory.offload.add_into`).
    """
    from jmem.memory.accumulate import accumulate_value_and_grad
    from jmem.memory.offload import any_in_host_memory
    from jmem.optim.checks import float_dtype

    float_dtype("dp_accumulate_value_and_grad", "accum_dtype", accum_dtype)
    axes = group_axes(mesh, rules, params, logical_axes)
    d = math.prod(mesh.shape[a] for a in axes)
    if group_accumulators is None:
        group_accumulators = num_microbatches > 1 and not any_in_host_memory(params)
    if d == 1 or not group_accumulators:
        return accumulate_value_and_grad(fn, params, batch, num_microbatches, has_aux=has_aux,
                                         accum_dtype=accum_dtype)
    k = num_microbatches
    check_int("accum", k, 1)
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % (d * k):
        raise ShardingError(f"batch size {size} is not divisible by data-parallel groups {d} x microbatches {k}")
    ax = _axis(axes)
    active = active_activation_sharding()
    if active is not None:  # the vmap over groups owns the group axes: activations split the rest
        inner_rules = without_axes(active[0], axes)
        fn = _in_activation_sharding(fn, inner_rules, active[1])

    # [B, ...] -> [k, D, B/(D k), ...]: group g keeps its contiguous rows (no data movement).
    def split(x):
        x = x.reshape((d, k, size // (d * k)) + x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, ax)))

    micro = jax.tree.map(split, batch)
    grad_fn = jax.vmap(jax.value_and_grad(fn, has_aux=has_aux), in_axes=(None, 0))
    first = jax.tree.map(lambda x: x[0], micro)
    out_shape = jax.eval_shape(grad_fn, params, first)

    # Accumulator leaves [D, ...]: the group axis on the data axes, the rest as the params' model-parallel spec.
    param_sh = tree_shardings(params, mesh, rules, logical_axes, zero=False)

    def group_sharding(s):
        rest = [None if e is None else tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in axes) or None
                for e in s.spec]
        return NamedSharding(mesh, P(ax, *rest))

    acc_sh = (jax.tree.map(lambda _: NamedSharding(mesh, P(ax)), out_shape[0]),
              jax.tree.map(group_sharding, param_sh))

    def zeros(s):
        dt = accum_dtype if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype
        return jnp.zeros(s.shape, dt)

    if k == 1:
        total = jax.lax.with_sharding_constraint(grad_fn(params, first), acc_sh)
    else:
        carry0 = jax.lax.with_sharding_constraint(jax.tree.map(zeros, out_shape), acc_sh)

        def body(carry, mb):
            out = grad_fn(params, mb)
            carry = jax.tree.map(lambda c, o: c + o.astype(c.dtype), carry, out)
            return jax.lax.with_sharding_constraint(carry, acc_sh), None

        total, _ = jax.lax.scan(body, carry0, micro)
    value_aux = jax.tree.map(lambda v, s: jnp.sum(v, axis=0).astype(s.dtype), total[0], out_shape[0])
    target = tree_shardings(params, mesh, rules, logical_axes, zero=check_stage(zero) >= 2)
    grads = reduce_groups(total[1], target, mesh, axes)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return value_aux, grads


def _in_activation_sharding(fn: Callable, rules, mesh: Mesh) -> Callable:
    """`fn` traced inside `activation_sharding(rules, mesh)` (activations constrained by `rules`)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with activation_sharding(rules, mesh):
            return fn(*args, **kwargs)

    return wrapped


def _norm(tree):
    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def check_like(tree, abstract, what: str) -> None:
    """Raise a ShardingError unless `tree` has the structure, shapes and dtypes of `abstract`
    (those a step was built and sharded for), naming the first path that differs."""
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree)]
    want = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(abstract)]
    if paths != want:
        extra, missing = sorted(set(paths) - set(want)), sorted(set(want) - set(paths))
        raise ShardingError(f"{what} have other leaves than the step was built for: unexpected {extra[:3]}, "
                            f"missing {missing[:3]}" if extra or missing else
                            f"{what} have the step's leaves in another tree structure")
    for path, x, a in zip(paths, jax.tree.leaves(tree), jax.tree.leaves(abstract)):
        dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
        if tuple(np.shape(x)) != tuple(a.shape) or dtype != a.dtype:
            raise ShardingError(f"{what}{path} is {dtype}{list(np.shape(x))}; the step was built for "
                                f"{a.dtype}{list(a.shape)}")


@dataclasses.dataclass
class ShardedTrainStep:
    """What `make_sharded_train_step` returns.

    Attributes:
        init: `params -> ParallelState` (jitted; the optimizer state is created sharded).
        step: `(state, batch) -> (state, metrics)` (jitted with ZeRO in/out shardings; donates state).
        shardings: `ParallelState` of NamedSharding trees.
        zero: the `ZeroShardings` (params, grads, opt_state) of the stage.
        batch_sharding: NamedSharding of every batch leaf (dim 0 on the data axes).
    """

    init: Callable
    step: Callable
    shardings: ParallelState
    zero: ZeroShardings
    batch_sharding: NamedSharding
    abstract_state: ParallelState
    mesh: Mesh
    accum: int
    rules: Rules
    _jitted: Callable = dataclasses.field(default=None, repr=False)
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    def bytes_per_device(self) -> dict[str, int]:
        """Model-state bytes one device holds: params, grads (their ZeRO sharding) and optimizer state."""
        a = self.abstract_state
        return {
            "params": bytes_per_device(a.params, self.zero.params),
            "grads": bytes_per_device(a.params, self.zero.grads),
            "opt_state": bytes_per_device(a.opt_state, self.zero.opt_state),
        }

    def lower(self, state, batch):
        """The lowered step (`.compile().as_text()` for the HLO, `.memory_analysis()`)."""
        return self._jitted.lower(state, batch)

    def compile(self, state, batch):
        """Compile the step for these shapes; `step` then runs this executable (no second compile).

        Returns the compiled object (`.as_text()`, `.memory_analysis()`, `.input_shardings`).
        """
        self._compiled["step"] = self.lower(state, batch).compile()
        return self._compiled["step"]


def make_sharded_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, params, mesh: Mesh, *,
                            zero: int = 0, rules=None, logical_axes: Mapping | None = None, accum: int = 1,
                            donate: bool = True, group_accumulators: bool | None = None,
                            constrain_activations: bool = True) -> ShardedTrainStep:
    """A jitted, sharded train step for a pure loss.

    Args:
        loss_fn: `(params, batch) -> (loss_sum f32[], count f32[])`, additive over the batch
            (e.g. summed token cross-entropy and the token count); the step minimises sum/count.
        optimizer: any optax transformation (clipping etc. already chained in).
        params: the parameter tree (arrays or ShapeDtypeStructs) whose paths match `logical_axes`.
        mesh: from `make_mesh`; the batch goes on the rules' `batch` axes.
        zero: ZeRO stage 0-3 over the data axes.
        rules: `Rules`, a rules string (e.g. `"embed=fsdp"`) or None for the defaults.
        logical_axes: path -> logical axes (default: the Llama and MoE tables).
        accum: microbatches per step, reduced once per step (`dp_accumulate_value_and_grad`).
        donate: donate the input state's buffers to the output.
        group_accumulators: see `dp_accumulate_value_and_grad` (default: on when `accum` > 1,
            unless `loss_fn.jmem_batch_additive` is False, as `model_loss_fn` sets for MoE models).
        constrain_activations: trace the loss inside `activation_sharding(rules, mesh)`, so a
            model that calls `jmem.parallel.constrain` (jmem's Llama between blocks) puts its
            activations' batch on the data axes and, with a rule such as `length=tensor`,
            shards the residual stream over the sequence.

    Returns:
        A `ShardedTrainStep`; its `step` returns metrics `{"loss", "grad_norm"}`.

    Raises:
        ZeroStageError, ShardingError, MeshError: bad stage, indivisible dims or batch, or a
            mesh that splits attention heads (`loss_fn.jmem_heads`, set by `model_loss_fn`).
        ValueError (from `step`): token ids outside `loss_fn.jmem_vocab_size`, where set.

    Example:
        >>> trainer = make_sharded_train_step(loss_fn, optax.adam(1e-3), params, make_mesh("fsdp=8"), zero=3)
        >>> state = trainer.init(params); state, m = trainer.step(state, batch)
    """
    check_mesh(mesh)
    check_optimizer(optimizer)
    stage = check_stage(zero)
    check_int("accum", accum, 1)
    rules = Rules.parse(rules)
    heads = getattr(loss_fn, "jmem_heads", None)
    if heads is not None:
        check_heads(*heads, rules, mesh, logical_axes=logical_axes)
    vocab_size = getattr(loss_fn, "jmem_vocab_size", None)
    from jmem.parallel.pipeline_1f1b import check_zero_fits_schedule
    from jmem.train.loss import check_batch_ids, check_lm_batch

    check_zero_fits_schedule(loss_fn, stage, mesh)
    if group_accumulators is None and not getattr(loss_fn, "jmem_batch_additive", True):
        group_accumulators = False  # e.g. MoE routing: accumulate the single-device microbatches
    tx = constrain_gradients(optimizer, mesh, stage=stage, rules=rules, logical_axes=logical_axes)
    abs_params = _abstract(params)
    abs_state = ParallelState(jax.ShapeDtypeStruct((), jnp.int32), abs_params, jax.eval_shape(tx.init, abs_params))
    zs = zero_shardings(abs_params, abs_state.opt_state, mesh, stage=stage, rules=rules, logical_axes=logical_axes)
    rep = NamedSharding(mesh, P())
    state_sh = ParallelState(rep, zs.params, zs.opt_state)
    batch_sh = NamedSharding(mesh, batch_spec(mesh, rules))

    def init_fn(p):
        return ParallelState(jnp.zeros((), jnp.int32), p, tx.init(p))

    init_jit = jax.jit(init_fn, in_shardings=(zs.params,), out_shardings=state_sh)

    # Params split over a data axis (a rule such as embed=fsdp), or split beyond their model-parallel
    # layout (ZeRO-3, `expert` included): gather them where used.
    model_sh = tree_shardings(abs_params, mesh, rules, logical_axes, zero=False)
    dp_split = any(a in DATA_AXES and mesh.shape[a] > 1 for sh in jax.tree.leaves(zs.params)
                   for e in sh.spec if e is not None for a in ((e,) if isinstance(e, str) else e)) or any(
        z.spec != m.spec for z, m in zip(jax.tree.leaves(zs.params), jax.tree.leaves(model_sh)))
    gather = dp_split and getattr(loss_fn, "jmem_weight_leaves", False)

    def objective(p, mb):
        if gather:  # all-gather each layer's kernels right before their matmul
            p = gather_on_use(p, mesh, rules, logical_axes)
        s, c = loss_pair(loss_fn(p, mb))
        return s, (s, c)

    def step_fn(state: ParallelState, batch):
        (_, (loss_sum, count)), grads = dp_accumulate_value_and_grad(
            objective, state.params, batch, accum,
            mesh=mesh, zero=stage, rules=rules, logical_axes=logical_axes, has_aux=True,
            group_accumulators=group_accumulators)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss_sum / count, "grad_norm": _norm(grads)}
        return ParallelState(state.step + 1, params, opt_state), metrics

    if constrain_activations:
        step_fn = _in_activation_sharding(step_fn, rules, mesh)
    step_jit = jax.jit(step_fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                       donate_argnums=(0,) if donate else ())

    def init(p):
        check_like(p, abs_params, "params")
        return init_jit(to_global(p, zs.params))

    compiled: dict = {}

    def step(state, batch):
        check_not_donated(state)
        check_batch(batch, mesh, rules, accum)
        if vocab_size is not None:  # a model's own loss: its batch layout first, then the ids
            check_lm_batch(batch)
            check_batch_ids(batch, vocab_size)
        # Every process holds the full global batch; an array placed otherwise is resharded (the jitted
        # step refuses a committed argument of another sharding).
        batch = to_global(batch, jax.tree.map(lambda _: batch_sh, batch))
        try:
            return compiled.get("step", step_jit)(state, batch)
        except ValueError:  # jit's message dumps whole shardings: name the leaf instead (nothing ran yet)
            _check_state_placement(state, state_sh)
            raise

    return ShardedTrainStep(init=init, step=step, shardings=state_sh, zero=zs, batch_sharding=batch_sh,
                            abstract_state=abs_state, mesh=mesh, accum=accum, rules=rules, _jitted=step_jit,
                            _compiled=compiled)


def _check_state_placement(state, state_sh) -> None:
    """ShardingError naming the first state leaf placed otherwise than this step takes it (a state of
    another trainer: another ZeRO stage, mesh or rules)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    for (path, leaf), want in zip(leaves, jax.tree.leaves(state_sh)):
        got = getattr(leaf, "sharding", None)
        if got is not None and not got.is_equivalent_to(want, np.ndim(leaf)):
            shown = getattr(got, "spec", got)
            raise ShardingError(f"state{jax.tree_util.keystr(path)} is placed as {shown}, this step takes it as "
                                f"{want.spec} on mesh {dict(want.mesh.shape)}; accepted: a state from this "
                                "trainer's init or step (not another ZeRO stage's, mesh's or rules')") from None


def jit_train_step(step_fn: Callable, abstract_state, mesh: Mesh, *, zero: int = 0, rules=None,
                   logical_axes: Mapping | None = None, donate: bool = True, constrain_activations: bool = True):
    """Jit an existing `(state, batch) -> (state, metrics)` with ZeRO shardings.

    `abstract_state` is a NamedTuple with `params` and `opt_state` fields (e.g.
    `jax.eval_shape(lambda: fns.init_state(model))` for `jmem.train`). With
    `constrain_activations` the step is traced inside `activation_sharding(rules, mesh)`:
    the model's residual stream gets its batch on the data axes and, with
    `rules="length=tensor"`, is sharded over the sequence between blocks.

    Returns:
        `(jitted_step, state_shardings, batch_sharding)`; place the initial state with
        `jax.device_put(state, state_shardings)`. `jitted_step(state, batch)` and its
        `.lower(state, batch)` first check that the batch divides into the data axes.
    """
    check_mesh(mesh)
    zero = check_stage(zero)
    if not (hasattr(abstract_state, "params") and hasattr(abstract_state, "opt_state")):
        raise ValueError(f"abstract_state of type {type(abstract_state).__name__}; accepted: a state with params and "
                         "opt_state fields, e.g. jax.eval_shape(lambda: fns.init_state(model))")
    sh = state_shardings(abstract_state, mesh, stage=zero, rules=rules, logical_axes=logical_axes)
    batch_sh = NamedSharding(mesh, batch_spec(mesh, rules))
    rep = NamedSharding(mesh, P())
    if constrain_activations:
        step_fn = _in_activation_sharding(step_fn, Rules.parse(rules), mesh)
    jitted = jax.jit(step_fn, in_shardings=(sh, batch_sh), out_shardings=(sh, rep),
                     donate_argnums=(0,) if donate else ())
    return BatchCheckedStep(jitted, mesh, rules), sh, batch_sh


@dataclasses.dataclass(frozen=True)
class BatchCheckedStep:
    """A jitted `(state, batch)` step that first checks the batch against the mesh's data axes
    (one ShardingError naming the sizes, where jit would raise its IndivisibleError). Calling,
    `lower` and `trace` check; other attributes are the jitted function's."""

    jitted: Callable
    mesh: Mesh
    rules: Any = None

    def __call__(self, state, batch):
        check_not_donated(state)
        check_batch(batch, self.mesh, self.rules)
        return self.jitted(state, batch)

    def lower(self, state, batch):
        check_batch(batch, self.mesh, self.rules)
        return self.jitted.lower(state, batch)

    def trace(self, state, batch):
        check_batch(batch, self.mesh, self.rules)
        return self.jitted.trace(state, batch)

    def __getattr__(self, name):
        if name.startswith("__") or name == "jitted":  # copy/pickle probe these before `jitted` is set
            raise AttributeError(name)
        return getattr(self.jitted, name)


def model_loss_fn(model, *, chunk: int | None = None):
    """`(loss_fn, params)` for an NNX language model (`jmem.models.Llama` or any model with
    `hidden`/`logits_from_hidden`): `loss_fn(params, batch) -> (loss_sum, token_count)` on
    `{"inputs", "targets", "mask"}` batches, `params` the model's `nnx.Param` state as a pure dict.

    `loss_fn` carries what `make_sharded_train_step` checks: `jmem_heads` (the head counts,
    refused when the mesh would split a head), `jmem_batch_additive` (False for an MoE
    model, whose gradient is then accumulated over the single-device microbatches) and
    `jmem_vocab_size` (each step's token ids are checked against it)."""
    from flax import nnx

    from jmem.train.loss import lm_loss_sum

    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)
    treedef = jax.tree.structure(param_state, is_leaf=is_weight_leaf)

    def loss_fn(p, batch):
        leaves = jax.tree.leaves(p, is_leaf=is_weight_leaf)
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
        return lm_loss_sum(m, batch, chunk=chunk)

    loss_fn.jmem_weight_leaves = True  # params may carry weight leaves (GatheredWeight) for `dot`
    mark_model_loss(loss_fn, model)
    return loss_fn, params


def mark_model_loss(loss_fn: Callable, model) -> Callable:
    """Set `loss_fn.jmem_heads`, `loss_fn.jmem_batch_additive` and `loss_fn.jmem_vocab_size` from a jmem
    model's config."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "n_heads"):
        loss_fn.jmem_heads = (cfg.n_heads, cfg.n_kv_heads)
    loss_fn.jmem_batch_additive = not getattr(cfg, "moe_experts", 0)
    loss_fn.jmem_vocab_size = getattr(cfg, "vocab_size", None)  # the step checks the batch's ids against it
    return loss_fn

"""Pipeline parallelism (GPipe) over the `stage` mesh axis, in plain `jit`.

The layer stack `[L, ...]` is reshaped to `[S, L/S, ...]` with the stage axis
on the `stage` mesh axis: stage `s` holds layers `s*L/S .. (s+1)*L/S - 1`. A
buffer `[S, micro, ...]` holds the activation each stage works on. At every
tick all stages run at once (`vmap` over the stage axis, which XLA splits over
the `stage` devices), then the buffer shifts by one stage (`jnp.roll`, which
XLA lowers to a `collective-permute` between neighbouring stages) and the next
microbatch enters stage 0. With M microbatches the forward pass takes
M + S - 1 ticks; the backward pass is the reverse (autodiff of the same scan),
so this is the GPipe schedule with its (S - 1)/(M + S - 1) bubble. Bubble ticks
run their stage on the microbatch entering stage 0 (a real input, where zeros could
give a NaN Jacobian, e.g. `x / ||x||`), pass no gradient back and never reach an output.

Example:
    >>> y_MBTE = pipeline(stage_fn, stage_weights, x_MBTE, mesh=mesh)
    >>> loss_fn, params = pipeline_lm_loss_fn(model, n_stages=2, n_microbatches=4, mesh=mesh)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.checks import is_int


class PipelineError(ValueError):
    """Stages or microbatches that do not divide the layers or the batch."""


def split_stages(stacked, n_stages: int, *, name: str = "layers"):
    """`[L, ...]` leaves -> `[S, L/S, ...]` (stage s gets a contiguous run of layers)."""
    check_stages(n_stages)

    def one(x):
        if x.shape[0] % n_stages:
            raise PipelineError(f"{name}: {x.shape[0]} layers do not split into {n_stages} pipeline stages; "
                                f"accepted stage counts divide {x.shape[0]}")
        return x.reshape((n_stages, x.shape[0] // n_stages) + x.shape[1:])

    return jax.tree.map(one, stacked)


def check_stages(n_stages) -> None:
    if not is_int(n_stages) or n_stages < 1:
        raise PipelineError(f"n_stages={n_stages!r}; accepted: an integer >= 1")


def check_dense(model, schedule: str) -> None:
    """PipelineError for an MoE model: a stage's blocks would drop their router statistics (the aux and
    z losses) and route per microbatch, a different objective than the model's."""
    experts = getattr(getattr(model, "config", None), "moe_experts", 0)
    if experts:
        raise PipelineError(f"the {schedule} pipeline schedule supports dense models only (this one's MLP is a "
                            f"mixture of {experts} experts); accepted: dense models")


def check_stage_axis(n_stages: int, mesh: Mesh | None, stage_axis: str) -> None:
    """Stages and the stage axis agree (as `pipeline_1f1b` requires): fewer stages leave stage devices idle,
    more run several stages per device one after another, only lengthening the bubble."""
    size = n_stages if mesh is None else mesh.shape.get(stage_axis, 1)
    if size != n_stages:
        raise PipelineError(f"n_stages={n_stages} does not match mesh axis {stage_axis!r} of size {size}; "
                            f"accepted: n_stages={size}")


def split_microbatches(x, n_microbatches: int):
    """`[B, ...]` -> `[M, B/M, ...]`, microbatch m holding rows m, m + M, m + 2M, ...

    Strided, not contiguous: a batch sharded over data-parallel devices in contiguous
    blocks keeps every microbatch spread over all of them (each device's block gives
    each microbatch the same number of rows), so picking a microbatch moves no data.
    A contiguous split puts microbatch m on a few devices, and the compiler's
    resharding when a pipeline tick picks it runs inside that tick's branch
    (a collective only some devices reach). The inverse is `merge_microbatches`.
    """
    B = x.shape[0]
    if not is_int(n_microbatches) or n_microbatches < 1 or B % n_microbatches:
        raise PipelineError(f"microbatches={n_microbatches!r} must be an integer >= 1 dividing the batch {B}")
    return x.reshape((B // n_microbatches, n_microbatches) + x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x_M):
    """The inverse of `split_microbatches`: `[M, B/M, ...]` -> `[B, ...]`."""
    return x_M.swapaxes(0, 1).reshape((x_M.shape[0] * x_M.shape[1],) + x_M.shape[2:])


def _constrain(tree, mesh: Mesh | None, axis: str):
    if mesh is None or mesh.shape.get(axis, 1) == 1:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axis))), tree)


def pipeline(stage_fn: Callable[[Any, jax.Array], jax.Array], stage_params, x_M, *, mesh: Mesh | None = None,
             stage_axis: str = "stage", remat: bool = True):
    """Run `S` stages over `M` microbatches with the GPipe schedule.

    Args:
        stage_fn: `(params of one stage, x[micro, ...]) -> y` of the same shape and dtype.
        stage_params: pytree with leading stage axis `[S, ...]` (e.g. from `split_stages`).
        x_M: microbatched input `[M, micro, ...]`.
        mesh: puts the stage axis of params and buffer on `stage_axis`, of size S (None: no constraint).
        stage_axis: the mesh axis of the stages.
        remat: recompute each tick's stage activations in the backward pass
            (keeps one buffer per tick instead of every layer's activations). Leave it
            off when `stage_fn` already checkpoints its layers: the recompute would
            itself keep each layer's input, and each layer would then run forward three
            times (`pipeline_hidden` turns it on only without a remat policy).

    Returns:
        `[M, micro, ...]`: the last stage's output for every microbatch.
    """
    n_stages = jax.tree.leaves(stage_params)[0].shape[0]
    n_micro = x_M.shape[0]
    if n_micro < 1:
        raise PipelineError(f"x_M of shape {x_M.shape} holds no microbatch; accepted: [M, micro, ...] with M >= 1")
    check_stage_axis(n_stages, mesh, stage_axis)
    out = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], stage_params), x_M[0])
    if getattr(out, "shape", None) != x_M.shape[1:] or getattr(out, "dtype", None) != x_M.dtype:
        raise PipelineError(f"stage_fn maps a microbatch {x_M.dtype}{list(x_M.shape[1:])} to {out}; accepted: a "
                            "stage_fn returning one array of its input's shape and dtype (it feeds the next stage)")
    stage_params = _constrain(stage_params, mesh, stage_axis)
    run = jax.vmap(stage_fn)
    if remat:
        run = jax.checkpoint(run, prevent_cse=False)

    def tick(carry, t):
        buf_S, out_M = carry
        x_in = x_M[jnp.minimum(t, n_micro - 1)]
        # Stage s works on microbatch t - s; outside 0..M-1 (a bubble) it gets the microbatch entering
        # stage 0 instead, and no gradient: a zero cotangent times a stage Jacobian that is not finite on
        # the bubble's own input (zeros, or a stage's output of zeros) would be NaN.
        m_S = t - jnp.arange(n_stages)
        real_S = ((m_S >= 0) & (m_S < n_micro)).reshape((-1,) + (1,) * (x_M.ndim - 1))
        x_S = _constrain(jnp.where(real_S, buf_S.at[0].set(x_in), jax.lax.stop_gradient(x_in)), mesh, stage_axis)
        y_S = _constrain(run(stage_params, x_S), mesh, stage_axis)
        done = jnp.maximum(t - (n_stages - 1), 0)
        out_M = jax.lax.dynamic_update_index_in_dim(out_M, y_S[n_stages - 1], done, 0)
        return (jnp.roll(y_S, 1, axis=0), out_M), None

    buf0 = _constrain(jnp.zeros((n_stages,) + x_M.shape[1:], x_M.dtype), mesh, stage_axis)
    (_, out_M), _ = jax.lax.scan(tick, (buf0, jnp.zeros_like(x_M)), jnp.arange(n_micro + n_stages - 1))
    return out_M


def check_micro_rows(batch: int, n_microbatches: int) -> None:
    """Under `activation_sharding`, each microbatch's rows split over the `batch` rule's mesh axes."""
    from jmem.parallel.rules import active_activation_sharding

    active = active_activation_sharding()
    if active is None:
        return
    rules, mesh = active
    axes = [a for a in rules.mesh_axes("batch") if mesh.shape.get(a, 1) > 1]
    d, rows = math.prod(mesh.shape[a] for a in axes), batch // n_microbatches
    if rows % d:
        raise PipelineError(f"n_microbatches={n_microbatches} splits the batch {batch} into {rows} row(s) per "
                            f"microbatch, not divisible by the data-parallel size {d} ({'+'.join(axes)}); "
                            f"accepted: n_microbatches dividing {batch} into a multiple of {d} rows each")


def pipeline_hidden(model, ids_BT, *, n_stages: int, n_microbatches: int, mesh: Mesh | None = None):
    """`model.hidden(ids)` of a `jmem.models.Llama` with its blocks pipelined over `n_stages`.

    Returns final-normed hidden states `[batch, seq, dim]`, equal to `model.hidden(ids_BT)[0]`.
    """
    from jmem.models.config import as_dtype
    from jmem.models.llama import block, rms_norm

    cfg = model.config
    B, T = ids_BT.shape
    check_dense(model, "gpipe")
    check_stages(n_stages)
    check_stage_axis(n_stages, mesh, "stage")
    if not is_int(n_microbatches) or n_microbatches < 1 or B % n_microbatches:
        raise PipelineError(f"microbatches={n_microbatches} must be >= 1 and divide the batch {B}")
    check_micro_rows(B, n_microbatches)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B // n_microbatches, T))
    x = jnp.take(model.embed.embedding.get_value(), ids_BT, axis=0).astype(as_dtype(cfg.compute_dtype))
    weights = split_stages(model.layers.weights(), n_stages)

    def layer(x, w):
        return block(cfg, w, x, positions)[0], None

    if cfg.remat != "none":
        from jmem.memory.remat import get_policy

        layer = jax.checkpoint(layer, policy=get_policy(cfg.remat), prevent_cse=False)

    def stage_fn(w_stage, x_BTE):
        return jax.lax.scan(layer, x_BTE, w_stage)[0]

    # A remat policy already decides what each layer keeps; recomputing the stage on top of it would run
    # every layer's forward three times. Without one the stage is recomputed from its input (GPipe's own remat).
    y_M = pipeline(stage_fn, weights, split_microbatches(x, n_microbatches), mesh=mesh, remat=cfg.remat == "none")
    y = merge_microbatches(y_M)
    return rms_norm(y, model.norm.scale.get_value(), cfg.norm_eps)


def pipeline_lm_loss_fn(model, *, n_stages: int, n_microbatches: int, mesh: Mesh | None = None,
                        chunk: int | None = None):
    """`(loss_fn, params)` like `jmem.parallel.model_loss_fn`, with the blocks pipelined.

    Use with `make_sharded_train_step(..., rules="layers=stage")` so each stage's
    devices hold only their layers.
    """
    from flax import nnx

    from jmem.train.loss import chunked_cross_entropy

    check_dense(model, "gpipe")
    check_stages(n_stages)
    check_stage_axis(n_stages, mesh, "stage")
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)
    treedef = jax.tree.structure(param_state)
    chunk = model.config.loss_chunk if chunk is None else chunk

    def loss_fn(p, batch):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(p)), rest)
        h = pipeline_hidden(m, batch["inputs"], n_stages=n_stages, n_microbatches=n_microbatches, mesh=mesh)
        return chunked_cross_entropy(h, batch["targets"], batch["mask"], m.logits_from_hidden, chunk)

    from jmem.parallel.step import mark_model_loss

    return mark_model_loss(loss_fn, model), params

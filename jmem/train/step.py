"""The train state and the jitted train step (pure functions over pytrees).

`TrainState` holds plain pytrees only: params as a nested dict of arrays (the
model's `nnx.Param` state as a pure dict), the optax state, the step counter
and the loss scale. The step rebuilds the NNX model from the graph definition
inside the traced function, so it is one pure function
`(state, batch) -> (state, metrics)` that `jax.jit` compiles once, Orbax
saves, and `jmem.memory.measure` can compile without running.

Composition inside one step:
    precision (model dtypes + loss scale) -> accumulation over `accum`
    microbatches (`lax.scan`) -> remat per layer (inside the model's layer
    scan) -> chunked cross-entropy -> one optimizer update.

Example:
    >>> model = Llama(LlamaConfig.tiny(remat="full"), rngs=nnx.Rngs(0))
    >>> fns = make_train_fns(model, optax.adam(1e-3), accum=2)
    >>> state = fns.init_state(model)
    >>> state, metrics = jax.jit(fns.step)(state, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmem.checks import check_bool, check_optimizer, check_seed, loss_pair
from jmem.lora import combine, has_dropout, trainable_split
from jmem.memory.accumulate import accumulate_value_and_grad
from jmem.memory.precision import NoOpLossScale, all_finite, global_norm
from jmem.sampling import seed_key
from jmem.train.loss import check_lm_batch, lm_loss_terms, router_loss


class TrainState(NamedTuple):
    """Everything a resumed run needs (the data order is a function of `step`)."""

    step: jax.Array  # i32[]
    params: Any  # nested dict of arrays
    opt_state: Any
    loss_scale: Any  # DynamicLossScale or NoOpLossScale


@dataclasses.dataclass(frozen=True)
class TrainFns:
    """The pure functions of a run; `step` and `eval_loss` are jit-able."""

    init_state: Callable[[Any], TrainState]
    step: Callable[[TrainState, dict], tuple[TrainState, dict]]
    eval_loss: Callable[[Any, dict], tuple[jax.Array, jax.Array]]
    merge: Callable[[Any], nnx.Module]
    # `step` in parts, for a step whose optimizer runs elsewhere (`jmem.memory.offload`):
    # `grads(state, batch) -> (loss-scaled grads of the trainable params, metrics)`,
    # `prepare(grads, loss_scale) -> (grads, metrics, next loss scale)` (unscale, finiteness, norm),
    # `update(grads, opt_state, trainable params) -> (trainable params, opt_state)`;
    # `trainable(params) -> (trainable, frozen)` and `combine(trainable, frozen) -> params`.
    grads: Callable | None = None
    prepare: Callable | None = None
    update: Callable | None = None
    trainable: Callable | None = None
    combine: Callable | None = None


def split_params(model: nnx.Module, is_leaf=None):
    """`(graphdef, params pure dict, rest state, params treedef)` of an NNX model; the treedef's leaves
    are those `is_leaf` names (as `jax.tree.structure` takes it), so a params tree flattened with the same
    `is_leaf` rebuilds the model."""
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(param_state)
    treedef = jax.tree.structure(param_state, is_leaf=is_leaf)
    # The NNX state and the pure dict must flatten in the same order for the
    # leaf-wise rebuild in `merge`; check it once here rather than trust it.
    def names(tree, drop_value):
        out = []
        for path, _ in jax.tree_util.tree_leaves_with_path(tree):
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            # A Variable contributes a "value" key (last for arrays, mid-path for weight-leaf pytrees).
            out.append(tuple(k for k in keys if not (drop_value and k == "value")))
        return out

    if names(param_state, True) != names(pure, False):
        raise RuntimeError("nnx.State and its pure dict flatten in different orders")
    return graphdef, pure, rest, treedef


def make_train_fns(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    accum: int = 1,
    loss_chunk: int | None = None,
    loss_scale: Any = None,
    mesh: Any = None,
    zero: int = 0,
    rules: Any = None,
    loss_fn: Callable | None = None,
    adapters_only: bool = False,
    dropout_seed: int = 0,
) -> TrainFns:
    """Build the pure train/eval functions for `model` and optimizer `tx`.

    Args:
        model: an NNX language model with `hidden` and `logits_from_hidden`
            (`jmem.models.llama.Llama`); its config fixes dtypes and remat.
        tx: the optax transformation (clipping, master weights and non-finite
            skipping already chained in by the caller).
        accum: microbatches per step; must divide the batch (checked at trace).
        loss_chunk: cross-entropy chunk along the sequence (model default when None).
        loss_scale: initial `DynamicLossScale` for fp16; `NoOpLossScale` when None.
        mesh: a `jmem.parallel.make_mesh` mesh: the gradient is then accumulated per
            data-parallel group and reduced once per step
            (`jmem.parallel.dp_accumulate_value_and_grad`); None: plain accumulation.
            An MoE model accumulates over the single-device microbatches instead (its
            routing depends on the rows one call sees), so its losses equal one device's
            at the same `accum`. A mesh whose tensor axis would split an attention head
            is refused (`jmem.parallel.rules.check_heads`).
        zero: ZeRO stage (with `mesh`); at 3 each layer's kernels are all-gathered
            where they are used (`jmem.parallel.gather_on_use`).
        rules: sharding rules (`jmem.parallel.Rules`, a string or None for the defaults).
        loss_fn: `(params, batch) -> (loss_sum, count)` replacing the model's own loss
            (e.g. `jmem.parallel.pipeline_lm_loss_fn`); the step minimises the loss sums
            over the counts, both summed over microbatches and devices, and the batch is
            any pytree of arrays with a leading batch dimension. A batch dict's 'mask' sum
            divides the sums before the gradient is rescaled to the counts (without one, 1
            does: under fp16 loss scaling, large sums may then overflow until the scale backs
            off). No router statistics or LoRA dropout then (a model with adapter dropout is
            refused).
        adapters_only: differentiate and update only LoRA adapter arrays (`jmem.lora`);
            the base (possibly quantized) gets neither gradients nor optimizer state.
        dropout_seed: adapters with dropout > 0 (`apply_lora(dropout=p)`) drop in `step`
            with a key of (dropout_seed, step, microbatch); `eval_loss` never drops.

    Metrics of `step`: `loss` (mean cross-entropy; for an MoE model without the router
    losses, which are reported as `moe_aux_loss`, `moe_z_loss` and `moe_dropped` and
    added to the minimised objective), `grad_norm`, `finite`, `loss_scale`.

    Returns:
        `TrainFns(init_state, step, eval_loss, merge)`.
    """
    from jmem.parallel.zero import check_stage

    check_optimizer(tx, "tx")
    check_bool("adapters_only", adapters_only)
    check_seed("dropout_seed", dropout_seed)
    zero = check_stage(zero)
    if zero and mesh is None:
        raise ValueError(f"zero={zero} without a mesh; accepted: zero=0, or a mesh (jmem.parallel.make_mesh) whose "
                         "data-parallel axes the stage partitions over")
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    config = getattr(model, "config", None)
    if mesh is not None:
        from jmem import parallel as par

        par.check_mesh(mesh)
        if hasattr(config, "n_heads"):  # before any trace: a mesh that cuts a head is refused here
            par.check_heads(config.n_heads, config.n_kv_heads, rules, mesh)
        from jmem.parallel.pipeline_1f1b import check_zero_fits_schedule

        check_zero_fits_schedule(loss_fn, zero, mesh)
        is_leaf = par.gather.is_weight_leaf
    else:
        is_leaf = None
    graphdef, _, rest, treedef = split_params(model, is_leaf)
    gather = mesh is not None and zero >= 3 and loss_fn is None
    moe = bool(getattr(config, "moe_experts", 0)) and loss_fn is None
    lora_dropout = has_dropout(model)
    if lora_dropout and loss_fn is not None:
        raise ValueError("LoRA dropout with a loss_fn is not supported (the loss function runs the layers "
                         "itself and draws no dropout mask); accepted: adapters with dropout=0, or no loss_fn")

    def merge(params):
        # Weight leaves (`GatheredWeight`) stay whole: `dot` gathers them where they are used.
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(params, is_leaf=is_leaf)), rest)

    def loss_terms(params, mb, dropout_key=None):
        """(objective sum, cross-entropy sum, router stats x count or {}, count)."""
        if loss_fn is not None:
            s, c = loss_pair(loss_fn(params, mb))
            return s, s, {}, c
        if gather:  # ZeRO-3: all-gather each layer's kernels right before their matmul
            params = par.gather_on_use(params, mesh, rules)
        m = merge(params)
        if dropout_key is not None:  # LoRA dropout: a key per step and microbatch (its first row)
            from jmem.lora import set_dropout_key

            set_dropout_key(m, jax.random.fold_in(dropout_key, mb["lora_row"][0]))
        s, c, stats = lm_loss_terms(m, mb, chunk=loss_chunk)
        if stats is None:
            return s, s, {}, c
        # Router stats weighted by the microbatch's tokens: sums over microbatches / n_tokens
        # give the token-weighted mean, like the cross-entropy.
        extra = {"moe_aux_loss": stats.aux_loss * c, "moe_z_loss": stats.z_loss * c,
                 "moe_dropped": stats.dropped.astype(jnp.float32)}
        return s + router_loss(m, stats) * c, s, extra, c

    def init_state(m: nnx.Module) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
        train = trainable_split(params, adapters_only)[0]
        state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(train), loss_scale)
        # Fresh buffers: the step donates its input state, and optimizer inits
        # may share one zeros array between leaves or alias the model's params.
        return jax.tree.map(lambda x: jnp.array(x, copy=True), state)

    def grads_fn(state: TrainState, batch: dict):
        if loss_fn is None:  # the model's own loss reads this batch layout (a custom loss_fn reads its own)
            check_lm_batch(batch)
        # What the objective divides by: the batch's tokens (the model's loss counts them; a loss_fn's
        # own counts rescale the gradient below). Known before the microbatches run, so each adds its
        # share of the mean, which keeps fp16 gradients in range.
        if isinstance(batch, dict) and "mask" in batch:
            n_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
        else:
            n_tokens = jnp.float32(1.0)
        ls = state.loss_scale
        dropout_key = None
        if lora_dropout:  # a pure function of (seed, step, row): a resumed run draws the same masks
            dropout_key = jax.random.fold_in(seed_key(dropout_seed), state.step)
            batch = {**batch, "lora_row": jnp.arange(batch["inputs"].shape[0], dtype=jnp.int32)}

        def objective(params, mb):
            total, ce, extra, count = loss_terms(params, mb, dropout_key)
            # Divide by the *global* token count so microbatch sums add up to
            # the full-batch mean loss (and its gradient).
            return ls.scale(total / n_tokens), (ce, extra, count)

        train, frozen = trainable_split(state.params, adapters_only)

        def objective_of_trainable(t, mb):
            return objective(combine(t, frozen), mb)

        if mesh is None:
            (_, (loss_sum, extra, count)), grads = accumulate_value_and_grad(objective_of_trainable, train, batch,
                                                                             accum, has_aux=True)
        else:
            # MoE routing is not additive over the batch (capacity, balancing statistics), and LoRA
            # dropout draws a microbatch's masks from its first row and shape: their microbatches
            # stay the single-device ones, not each data-parallel group's rows.
            (_, (loss_sum, extra, count)), grads = par.dp_accumulate_value_and_grad(
                objective_of_trainable, train, batch, accum, mesh=mesh, zero=zero, rules=rules, has_aux=True,
                group_accumulators=False if moe or lora_dropout else None)
        if loss_fn is not None:  # the mean over what the loss function counted
            count = jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)
            grads = jax.tree.map(lambda g: (g * (n_tokens / count)).astype(g.dtype), grads)
            n_tokens = count
        metrics = {"loss": loss_sum / n_tokens}
        if moe:
            metrics.update({k: v / n_tokens for k, v in extra.items() if k != "moe_dropped"},
                           moe_dropped=extra["moe_dropped"])
        return grads, metrics

    def prepare_fn(grads, ls):
        grads = ls.unscale(grads)
        finite = all_finite(grads)
        metrics = {"grad_norm": global_norm(grads), "finite": finite, "loss_scale": ls.scale_value}
        return grads, metrics, ls.adjust(finite)

    def update_fn(grads, opt_state, train):
        updates, opt_state = tx.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state

    def step(state: TrainState, batch: dict):
        grads, metrics = grads_fn(state, batch)
        grads, more, loss_scale_next = prepare_fn(grads, state.loss_scale)
        train, frozen = trainable_split(state.params, adapters_only)
        train, opt_state = update_fn(grads, state.opt_state, train)
        new_state = TrainState(state.step + 1, combine(train, frozen), opt_state, loss_scale_next)
        return new_state, join_metrics(metrics, more)

    def eval_loss(params, batch: dict):
        # Held-out cross-entropy only (no router losses), comparable to a dense model's.
        s, c, _ = lm_loss_terms(merge(params), batch, chunk=loss_chunk)
        return s, c

    return TrainFns(init_state=init_state, step=step, eval_loss=eval_loss, merge=merge, grads=grads_fn,
                    prepare=prepare_fn, update=update_fn, trainable=lambda p: trainable_split(p, adapters_only),
                    combine=combine)


def join_metrics(loss_metrics: dict, grad_metrics: dict) -> dict:
    """The step's metrics in their order: loss, grad_norm, finite, loss_scale, then the router's."""
    return {"loss": loss_metrics["loss"], **grad_metrics, **{k: v for k, v in loss_metrics.items() if k != "loss"}}

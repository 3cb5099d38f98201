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

from jmem.memory.accumulate import accumulate_value_and_grad
from jmem.memory.precision import NoOpLossScale, all_finite
from jmem.train.loss import lm_loss_sum


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


def split_params(model: nnx.Module):
    """`(graphdef, params pure dict, rest state, params treedef)` of an NNX model."""
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(param_state)
    treedef = jax.tree.structure(param_state)
    # The NNX state and the pure dict must flatten in the same order for the
    # leaf-wise rebuild in `merge`; check it once here rather than trust it.
    def names(tree, drop_value):
        out = []
        for path, _ in jax.tree_util.tree_leaves_with_path(tree):
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            out.append(tuple(keys[:-1] if drop_value and keys and keys[-1] == "value" else keys))
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

    Returns:
        `TrainFns(init_state, step, eval_loss, merge)`.
    """
    graphdef, _, rest, treedef = split_params(model)
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale

    def merge(params):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(params)), rest)

    def init_state(m: nnx.Module) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
        state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), loss_scale)
        # Fresh buffers: the step donates its input state, and optimizer inits
        # may share one zeros array between leaves or alias the model's params.
        return jax.tree.map(lambda x: jnp.array(x, copy=True), state)

    def step(state: TrainState, batch: dict):
        n_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
        ls = state.loss_scale

        def objective(params, mb):
            s, _ = lm_loss_sum(merge(params), mb, chunk=loss_chunk)
            # Divide by the *global* token count so microbatch sums add up to
            # the full-batch mean loss (and its gradient).
            return ls.scale(s / n_tokens), s

        (_, loss_sum), grads = accumulate_value_and_grad(objective, state.params, batch, accum, has_aux=True)
        grads = ls.unscale(grads)
        finite = all_finite(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / n_tokens,
            "grad_norm": optax.tree.norm(grads),
            "finite": finite,
            "loss_scale": ls.scale_value,
        }
        return TrainState(state.step + 1, params, opt_state, ls.adjust(finite)), metrics

    def eval_loss(params, batch: dict):
        s, c = lm_loss_sum(merge(params), batch, chunk=loss_chunk)
        return s, c

    return TrainFns(init_state=init_state, step=step, eval_loss=eval_loss, merge=merge)

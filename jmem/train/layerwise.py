"""Layer-wise training: LISA layer sampling and cycling block schedules.

LISA (Pan et al. 2024, "Layerwise Importance Sampling for Memory-Efficient Large
Language Model Fine-Tuning") trains, in each
period of `period` steps, only `n_active` of the model's `L` decoder layers,
plus the always-trained embedding, final norm and LM head; the other layers
are frozen for that period. Gradients and optimizer state then exist only for
the active layers, so their memory is `n_active / L` of full training's for
the layer part. When the period ends, a new set is drawn and the optimizer
state of the layer part is reset (the leaving layers' state is dropped, the
arriving layers' moments start from zero). The optimizer's step counter is
shared and carries on, so bias correction does not restart with them: with
Adam an arriving layer's first updates late in a run are several times a fresh
Adam's (docs/design.md, "Layer-wise training").

How it stays one compiled program: the active layer indices are a traced
`i32[n_active]` computed in the step from the step counter, so a new draw
never recompiles, and the period switch (the optimizer reset) happens in the
step too, so `init_state`/`step`/`eval_loss` keep `make_train_fns`'s contract
and the loop, checkpoints and resumption need nothing new. The step runs the
layer scan over the stored stack; an active layer i uses `stored[i] +
delta[slot(i)]`, where `delta` is a zero `[n_active, ...]` tensor that is
differentiated: its gradient is the active slices' weight gradient. `delta` is
a constant of the scan, so the backward pass accumulates it in an
`[n_active, ...]` buffer, never a full `[L, ...]` one, and being zero it is
never stored. The active slices (`params[idx]`) are gathered only for the
optimizer update, after the backward pass, and scattered back into the
(donated) stored stack.

Compute: the frozen layers' weight-gradient matmuls still run (masked to zero);
a `lax.cond` per layer would skip them, but XLA then keeps both branches'
buffers and the step's temporary memory grew by about 30%, which is what
this mode exists to save.

Schedules (`schedule=`):
    ``"random"``     LISA: `n_active` distinct layers drawn uniformly per period,
                     a pure function of `(seed, period)`, so a resumed run draws
                     the same layers.
    ``"bottom-up"``  blocks of `n_active` consecutive layers from the input side,
                     cycling: period p trains layers `(p * n + i) % L`.
    ``"top-down"``   the same from the output side: `L - 1 - (p * n + i) % L`.

With LoRA adapters (`adapters_only=True`) only the adapters of the active
layers train (and adapters outside the layer stack, e.g. on the head).

Example:
    >>> model = Llama(LlamaConfig.tiny(n_layers=8), rngs=nnx.Rngs(0))
    >>> fns = make_layerwise_fns(model, optax.adamw(1e-3), n_active=2, period=20)
    >>> state = fns.init_state(model)
    >>> step = jax.jit(fns.step, donate_argnums=0)
    >>> state, metrics = step(state, batch)
    >>> fns.active_layers(0)    # the layers step 0 trains, e.g. array([1, 6])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmem.checks import as_python_scalar, check_bool, check_int, check_optimizer, check_seed, is_int
from jmem.lora import LoRA, combine, set_dropout_key, trainable_split, with_dropout
from jmem.memory.accumulate import accumulate_value_and_grad
from jmem.memory.measure import tree_bytes
from jmem.memory.precision import NoOpLossScale, all_finite, global_norm
from jmem.memory.remat import get_policy
from jmem.models.config import as_dtype
from jmem.models.llama import block_and_stats, rms_norm
from jmem.models.moe import MoEStats
from jmem.parallel.rules import ACTIVATION_AXES, constrain
from jmem.sampling import seed_key
from jmem.train.loss import check_lm_batch, chunked_cross_entropy, lm_loss_terms, router_loss
from jmem.train.step import TrainFns, TrainState, split_params

SCHEDULES = ("random", "bottom-up", "top-down")
LAYERS = "layers"  # the params key of the stacked decoder blocks


class LayerwiseError(ValueError):
    """A layer-wise setting outside its accepted range, or a model it cannot train."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerwiseFns(TrainFns):
    """`TrainFns` plus the schedule: `active_layers(step)` gives the layers a step trains.

    `trainable(params) -> (trained, frozen)` splits at step 0's layers: the trained part has
    the same shapes in every period (which layers it holds changes with `active_layers`).
    """

    active_layers: Callable[[int], np.ndarray]
    n_layers: int
    n_active: int
    period: int
    schedule: str


def active_layers(step, *, n_layers: int, n_active: int, period: int, schedule: str = "random",
                  seed: int = 0) -> jax.Array:
    """The sorted layer indices `i32[n_active]` that train at `step` (traceable in `step`).

    Args:
        step: the step counter (a Python int or a traced `i32[]`).
        n_layers, n_active, period, schedule, seed: as for `make_layerwise_fns`.

    Example:
        >>> active_layers(40, n_layers=8, n_active=2, period=20, schedule="bottom-up")
        Array([4, 5], dtype=int32)
    """
    _check_schedule(n_layers, n_active, period, schedule)
    step = as_python_scalar(step)  # a concrete 0-d array (a state's step counter) as its value
    if not isinstance(step, jax.core.Tracer):
        check_int("step", step, 0)  # -1, 2.5 or "3" drew some period's layers
    elif step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise ValueError(f"step is traced {step.dtype}{list(step.shape)}; accepted: an integer >= 0 or a traced "
                         "integer scalar")
    p = jnp.asarray(step, jnp.int32) // period
    if schedule == "random":
        key = jax.random.fold_in(seed_key(seed), p)
        idx = jax.random.permutation(key, n_layers)[:n_active]
    else:
        idx = (p * n_active + jnp.arange(n_active, dtype=jnp.int32)) % n_layers
        if schedule == "top-down":
            idx = n_layers - 1 - idx
    # Sorted: the slot order of the optimizer state follows the layer order.
    return jnp.sort(idx).astype(jnp.int32)


def _check_schedule(n_layers: int, n_active, period, schedule) -> None:
    if not is_int(n_active) or not 1 <= n_active <= n_layers:
        raise LayerwiseError(f"n_active={n_active!r}: the number of trained layers must be an integer in 1..{n_layers} "
                             f"(the model has {n_layers} layers)")
    if not is_int(period) or period < 1:
        raise LayerwiseError(f"period={period!r}: steps per layer draw must be an integer >= 1")
    if schedule not in SCHEDULES:
        raise LayerwiseError(f"schedule={schedule!r}; accepted: {', '.join(SCHEDULES)}")


def _per_layer_state_flags(tx, trainable) -> Any:
    """A bool per optimizer-state leaf: True where the leaf belongs to the layer part.

    Found by path: optax states mirror the params tree (`mu['layers']['wq']['kernel']`,
    adafactor's `v_row['layers'][...]`, a master copy's `['layers'][...]`), so a leaf under
    a `layers` key holds per-layer state; counters and the always-trained groups' state do
    not. An optimizer whose state grows with the active layers without such a path
    (a flattened buffer) is refused: its layer part could not be reset.
    """
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
    s0 = jax.eval_shape(tx.init, spec)
    flags = jax.tree_util.tree_map_with_path(
        lambda path, _: any(isinstance(k, jax.tree_util.DictKey) and k.key == LAYERS for k in path), s0)
    if not any(jax.tree.leaves(flags)):
        more = {**spec, LAYERS: jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]), a.dtype),
                                             spec[LAYERS])}
        if tree_bytes(jax.eval_shape(tx.init, more)) != tree_bytes(s0):
            raise LayerwiseError("the optimizer keeps per-layer state outside a 'layers' subtree, so it cannot be "
                                 "reset when the active layers change; accepted: optax-style states that mirror "
                                 "the params tree (adamw, adafactor, adam8bit, galore, sgd)")
    return flags


def make_layerwise_fns(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    n_active: int,
    *,
    period: int = 20,
    schedule: str = "random",
    seed: int = 0,
    always_train: tuple[str, ...] | None = None,
    accum: int = 1,
    loss_chunk: int | None = None,
    loss_scale: Any = None,
    adapters_only: bool = False,
    dropout_seed: int = 0,
) -> LayerwiseFns:
    """Train functions (as `jmem.train.step.make_train_fns`) that train `n_active` layers at a time.

    Args:
        model: a `jmem.models.Llama` (dense or MoE; weight leaves may be quantized or
            LoRA-wrapped); its blocks are stacked on a leading `layers` axis of size L.
        tx: the optax transformation (clipping, master weights and non-finite skipping
            already chained in). Its state covers only the trained parameters; the
            per-layer part is reset whenever a new period starts (when `n_active < L`).
        n_active: layers trained at once, 1..L. At L every layer trains every step and
            the step equals `make_train_fns`'s (but for LoRA dropout masks, which the two
            draw from their keys differently).
        period: steps between layer draws (LISA's K).
        schedule: "random" (LISA), "bottom-up" or "top-down" (cycling blocks).
        seed: seeds the random draws; the draw of period p is a function of (seed, p).
        always_train: top-level parameter groups trained every step (default: all of
            them besides the layers: embed, norm and head, as LISA does); () freezes them.
        accum, loss_chunk, loss_scale, adapters_only, dropout_seed: as for `make_train_fns`.

    Returns:
        `LayerwiseFns(init_state, step, eval_loss, merge, active_layers, ...)`: the state is
        a `TrainState` whose `opt_state` has the shapes of the trained part only.

    Raises:
        LayerwiseError: `n_active`, `period`, `schedule` or `always_train` out of range, or
            a model without stacked layers.

    Example:
        >>> fns = make_layerwise_fns(model, optax.adamw(1e-3), n_active=1, period=10)
        >>> state = fns.init_state(model)
        >>> state, metrics = jax.jit(fns.step, donate_argnums=0)(state, batch)
    """
    config = getattr(model, "config", None)
    if not hasattr(config, "n_layers") or not isinstance(getattr(model, LAYERS, None), nnx.Module):
        raise LayerwiseError(f"layer-wise training needs a jmem.models.Llama (stacked `layers`), got "
                             f"{type(model).__name__}")
    n_layers = int(config.n_layers)
    _check_schedule(n_layers, n_active, period, schedule)
    check_optimizer(tx, "tx")
    check_bool("adapters_only", adapters_only)
    check_seed("seed", seed)
    check_seed("dropout_seed", dropout_seed)
    n_active, period = int(n_active), int(period)
    graphdef, _, rest, treedef = split_params(model)
    groups = tuple(k for k in nnx.to_pure_dict(nnx.state(model, nnx.Param)) if k != LAYERS)
    if always_train is None:
        always_train = groups
    elif isinstance(always_train, str):
        always_train = (always_train,)
    elif not (isinstance(always_train, (tuple, list)) and all(isinstance(g, str) for g in always_train)):
        raise LayerwiseError(f"always_train={always_train!r}; accepted: a group name or a tuple of them among "
                             f"{', '.join(groups)} (or () for none)")
    bad = [g for g in always_train if g not in groups]
    if bad:
        raise LayerwiseError(f"always_train={tuple(always_train)!r}: {', '.join(map(repr, bad))} is not a parameter "
                             f"group of this model; accepted: {', '.join(groups)} (or () for none)")
    always_train = tuple(always_train)
    blocks_def, _, blocks_rest, blocks_treedef = split_params(model.layers)
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    moe = bool(getattr(config, "moe_experts", 0))
    lora_dropout = any(isinstance(x, LoRA) and x.dropout > 0 for x in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, LoRA)))
    resets = n_active < n_layers  # all layers active: nothing ever leaves or arrives
    cfg = config

    def layers_at(step):
        return active_layers(step, n_layers=n_layers, n_active=n_active, period=period, schedule=schedule, seed=seed)

    def merge(params):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(params)), rest)

    def block_weights(layer_params):
        """One layer's params (pure-dict form) -> the weight dict `block_and_stats` reads."""
        return nnx.merge(blocks_def, jax.tree.unflatten(blocks_treedef, jax.tree.leaves(layer_params)),
                         blocks_rest).weights()

    def split(params, idx):
        """(trainable: the always-trained groups and the active slices under `layers`, frozen)."""
        train, frozen = trainable_split(params, adapters_only)
        out = {k: train[k] for k in always_train}
        out[LAYERS] = jax.tree.map(lambda x: x[idx], train[LAYERS])
        return out, frozen

    def hidden(m, stored_layers, delta, slot_L, ids_BT, dropout_key=None, token_mask_BT=None):
        """`Llama.hidden_and_router_stats` with `delta[slot_L[i]]` added to each active layer i;
        adapters with dropout drop with a key per layer from `dropout_key`."""
        B, T = ids_BT.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = jnp.take(m.embed.embedding.get_value(), ids_BT, axis=0).astype(as_dtype(cfg.compute_dtype))
        x = constrain(x, ACTIVATION_AXES)

        def body(x, xs):
            stored, slot, layer = xs
            on = slot >= 0
            live = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.maximum(slot, 0), keepdims=False), delta)
            # An active layer's trainable leaves are `stored + delta` (delta is zero: its gradient is
            # the weight gradient); a frozen layer's are the stored constants.
            mixed = jax.tree.map(lambda d, s: s if d is None else jnp.where(on, s + d, s), live, stored,
                                 is_leaf=lambda a: a is None)
            w = block_weights(mixed)
            if dropout_key is not None:
                w = with_dropout(w, jax.random.fold_in(dropout_key, layer))
            x, _, stats = block_and_stats(cfg, w, x, positions, token_mask_BT=token_mask_BT)
            return constrain(x, ACTIVATION_AXES), stats

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=get_policy(cfg.remat), prevent_cse=False)
        x, stats_L = jax.lax.scan(body, x, (stored_layers, slot_L, jnp.arange(n_layers, dtype=jnp.int32)))
        h = constrain(rms_norm(x, m.norm.scale.get_value(), cfg.norm_eps), ACTIVATION_AXES)
        if stats_L is None:
            return h, None
        return h, MoEStats(jnp.mean(stats_L.aux_loss), jnp.mean(stats_L.z_loss), jnp.sum(stats_L.dropped),
                           jnp.mean(stats_L.load, axis=0))

    def init_state(m: nnx.Module) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
        train, _ = split(params, layers_at(0))
        state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(train), loss_scale)
        # Fresh buffers: the step donates its input state (see `make_train_fns`).
        return jax.tree.map(lambda x: jnp.array(x, copy=True), state)

    # Shapes only (the model may be abstract, from `nnx.eval_shape`).
    flags = _per_layer_state_flags(tx, jax.eval_shape(lambda p: split(p, jnp.arange(n_active))[0],
                                                      nnx.to_pure_dict(nnx.state(model, nnx.Param))))

    def step(state: TrainState, batch: dict):
        check_lm_batch(batch)
        n_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
        ls = state.loss_scale
        idx = layers_at(state.step)
        slot_L = jnp.full((n_layers,), -1, jnp.int32).at[idx].set(jnp.arange(n_active, dtype=jnp.int32))
        train, frozen = split(state.params, idx)
        stored = state.params  # closed over below: never differentiated
        dropout_key = jax.random.fold_in(seed_key(dropout_seed), state.step) if lora_dropout else None
        if lora_dropout:
            batch = {**batch, "lora_row": jnp.arange(batch["inputs"].shape[0], dtype=jnp.int32)}

        opt_state = state.opt_state
        if resets:
            # A new period: the arriving layers' optimizer state starts fresh (LISA); the
            # always-trained groups and the counters (schedules, bias correction) carry on.
            boundary = state.step % period == 0
            fresh = tx.init(train)
            opt_state = jax.tree.map(lambda f, new, old: jnp.where(boundary, new, old) if f else old,
                                     flags, fresh, opt_state)  # fused into the update: no extra buffer

        def objective(t, mb):
            params = dict(stored)
            for k in always_train:
                params[k] = combine(t[k], None if frozen is None else frozen[k])
            m = merge(params)
            key = None
            if dropout_key is not None:  # LoRA dropout: a key per step and microbatch (its first row)
                key = jax.random.fold_in(dropout_key, mb["lora_row"][0])
                set_dropout_key(m, key)  # adapters outside the layer stack (the head)
            h, stats = hidden(m, stored[LAYERS], t[LAYERS], slot_L, mb["inputs"], key, mb.get("input_mask"))
            s, c = chunked_cross_entropy(h, mb["targets"], mb["mask"], m.logits_from_hidden,
                                         cfg.loss_chunk if loss_chunk is None else loss_chunk)
            extra, total = {}, s
            if moe and stats is not None:
                extra = {"moe_aux_loss": stats.aux_loss * c, "moe_z_loss": stats.z_loss * c,
                         "moe_dropped": stats.dropped.astype(jnp.float32)}
                total = s + router_loss(m, stats) * c
            return ls.scale(total / n_tokens), (s, extra)

        # Differentiated: the always-trained groups and a zero delta per active slice. The delta
        # (a broadcast zero XLA never stores) stands for the gathered slices, so their copy
        # exists only for the optimizer update, after the backward pass has freed its activations.
        probe = {**train, LAYERS: jax.tree.map(jnp.zeros_like, train[LAYERS])}
        (_, (loss_sum, extra)), grads = accumulate_value_and_grad(objective, probe, batch, accum, has_aux=True)
        grads = ls.unscale(grads)
        finite = all_finite(grads)
        updates, opt_state = tx.update(grads, opt_state, train)
        new = optax.apply_updates(train, updates)
        params = dict(state.params)
        for k in always_train:
            params[k] = combine(new[k], None if frozen is None else frozen[k])
        # Scatter the updated slices back into the stored stack (in place when donated).
        params[LAYERS] = jax.tree.map(lambda part, full: full if part is None else full.at[idx].set(part),
                                      new[LAYERS], state.params[LAYERS], is_leaf=lambda a: a is None)
        metrics = {
            "loss": loss_sum / n_tokens,
            "grad_norm": global_norm(grads),
            "finite": finite,
            "loss_scale": ls.scale_value,
        }
        if moe:
            metrics.update({k: v / n_tokens for k, v in extra.items() if k != "moe_dropped"},
                           moe_dropped=extra["moe_dropped"])
        return TrainState(state.step + 1, params, opt_state, ls.adjust(finite)), metrics

    def eval_loss(params, batch: dict):
        s, c, _ = lm_loss_terms(merge(params), batch, chunk=loss_chunk)
        return s, c

    return LayerwiseFns(init_state=init_state, step=step, eval_loss=eval_loss, merge=merge,
                        trainable=lambda params: split(params, layers_at(0)),
                        active_layers=lambda step_: np.asarray(layers_at(int(step_))), n_layers=n_layers,
                        n_active=n_active, period=period, schedule=schedule)

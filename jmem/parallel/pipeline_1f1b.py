"""Pipeline parallelism with the 1F1B (one-forward-one-backward, PipeDream-flush) schedule.

GPipe (`jmem.parallel.pipeline`) runs every microbatch's forward pass, then
every backward pass, so each stage keeps the activations of all M microbatches
until the backward pass reaches them. 1F1B starts a microbatch's backward pass
as soon as the last stage has its loss, so a stage never holds more than S
microbatches' activations (S = number of stages), whatever M is. The flush at
the end of every step keeps the update synchronous: the gradients equal plain
`jax.value_and_grad` of the unpipelined model (to f32 rounding; under bf16
compute the separate forward and backward programs round their bf16 values at
other points, so loss and gradients differ by bf16 rounding, as bf16 differs
from f32, not bit for bit).

Because forward and backward passes interleave, the schedule is not the
autodiff of a forward function: `pipeline_1f1b` computes the loss *and* the
gradients in one `jax.shard_map` over the `stage` axis. A `lax.scan` walks the
2(M + S - 1) ticks of a fixed timetable; at tick t stage s runs

    forward  of microbatch m  when t = s + 2m,
    backward of microbatch m  when t = 2S - 1 - s + 2m,

or waits. Forward and backward ticks of a stage have opposite parity, so they
never collide, an activation sent at tick t is used by the next stage at t + 1,
and a cotangent sent at t is used by the previous stage at t + 1: both travel by
`lax.ppermute` at the end of every tick. A stage's forward tick runs `jax.vjp`
of the stage and stores the pullback's residuals until the backward tick calls
it (`jmem.parallel.residuals`): the activations in a ring of S slots (one per
microbatch in flight), the parameter-only residuals once. So nothing is
recomputed beyond what a remat policy asks: under the LM loss each layer is
wrapped in the model's policy, and
the stored residuals are what the policy saves (all of a layer's activations
without a policy, its input under `full`), the backward tick recomputing the
rest as it would without a pipeline. Parameter gradients
accumulate in f32 in the loop. Stage 0 also embeds the token ids, and the last
stage runs the loss head (final norm + chunked cross-entropy), whose backward
starts the backward chain.

`pipeline_1f1b_lm_loss_fn` wraps this for the train step as a loss with a
`jax.custom_vjp`: its forward rule runs the whole schedule and keeps the
gradients, its backward rule scales them by the incoming cotangent. So
`jax.value_and_grad` of it (and of any scalar multiple, as the train step's
loss scaling and 1/token-count do) runs the 1F1B schedule, and the train step
needs no change. Evaluating the loss without a gradient runs the GPipe forward.

Collectives inside a tick: the stages take different branches of the tick's
`lax.switch` at the same tick, so a collective inside a branch completes only
when its whole device group lies within one stage (tensor or data parallelism
inside a stage: all-reduces, all-gathers, reduce-scatters, all-to-alls), and
never for a collective-permute (the CPU runtime joins all devices in one). An
attention head split over the tensor axis makes XLA reshard inside the tick with
collective-permutes, which would hang the program: the LM
value-and-grad refuses head counts that do not divide their mesh axes
(`check_heads`), and `check_tick_collectives` refuses any compiled program whose
tick branches hold such a collective (train.py runs it after compiling).

Bubble: every stage is busy 2M of the 2(M + S - 1) ticks, the same
(S - 1)/(M + S - 1) fraction as GPipe, but an idle tick computes nothing (GPipe's
bubble ticks run their stage on a real microbatch and discard the result). Any M >= 1 works; M >= S is where the memory
bound (S microbatches' stored activations instead of M) pays off. Matmul FLOPs
of the schedule: `busiest_stage_matmul_flops`.

Example:
    >>> loss_fn, params = pipeline_1f1b_lm_loss_fn(model, n_stages=2, n_microbatches=4, mesh=mesh)
    >>> (loss_sum, count), grads = pipeline_1f1b_lm_value_and_grad(model, n_stages=2, n_microbatches=4,
    ...                                                            mesh=mesh)(params, batch)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from jmem.checks import is_int
from jmem.parallel.pipeline import (PipelineError, check_dense, check_micro_rows, check_stage_axis, check_stages,
                                    pipeline_lm_loss_fn, split_microbatches, split_stages)
from jmem.parallel.residuals import split_residuals
from jmem.parallel.rules import active_activation_sharding, check_heads

SCHEDULES = ("gpipe", "1f1b")
TICK_SCOPE = "jmem_1f1b_tick"
"""`jax.named_scope` of the tick's `lax.switch`: its branches are found by this name in compiled HLO."""


def check_schedule(schedule: str) -> str:
    """Return `schedule` if it names a pipeline schedule, else raise one clear `PipelineError`."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    return schedule


def timetable(n_stages: int, n_microbatches: int) -> np.ndarray:
    """The 1F1B timetable: `i32[ticks, S, 2]` of (action, microbatch) per tick and stage.

    Action 0 waits, 1 runs a forward, 2 a backward (microbatch -1 when waiting).
    `ticks = 2 (M + S - 1)`. Used by the tests and docs; the schedule computes the same
    thing from the tick and stage index on the device.
    """
    S, M = n_stages, n_microbatches
    out = np.zeros((2 * (M + S - 1), S, 2), np.int32)
    out[..., 1] = -1
    for s in range(S):
        for m in range(M):
            out[s + 2 * m, s] = (1, m)
            out[2 * S - 1 - s + 2 * m, s] = (2, m)
    return out


def _zeros_f32(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _add(acc, g):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)


def pipeline_1f1b(first_fn: Callable, stage_fn: Callable, last_fn: Callable, stage_params, shared_params,
                  inputs_M, targets_M, *, mesh: Mesh, stage_axis: str = "stage"):
    """Loss and gradients of `last_fn(stage_S-1(... stage_0(first_fn(inputs))))` under the 1F1B schedule.

    A stage's forward tick runs `jax.vjp` of `stage_fn` and stores the pullback's residuals
    until the microbatch's backward tick (`jmem.parallel.residuals`): the activation residuals
    in a ring of S slots, the parameter-only ones (casts, constants) once. No forward runs
    twice unless `stage_fn` asks for it: put `jax.checkpoint` inside it (per layer, with a
    policy) and its residuals shrink to what the policy saves, and the backward tick
    recomputes the rest, as without a pipeline.

    Args:
        first_fn: `(shared_params, inputs[micro, ...]) -> x[micro, ...]` (e.g. the embedding); run on stage 0.
        stage_fn: `(params of one stage, x) -> y` of the same shape and dtype as `x`.
        last_fn: `(shared_params, y, targets[micro, ...]) -> (loss_sum f32[], count f32[])`; run on the
            last stage. The loss must be a sum over the microbatch (the result adds microbatches).
        stage_params: pytree with leading stage axis `[S, ...]` (e.g. from `split_stages`).
        shared_params: pytree used by `first_fn` and `last_fn` (embedding, final norm, head),
            replicated over the stages; its gradient is summed over them.
        inputs_M: pytree of `[M, micro, ...]` arrays (e.g. token ids).
        targets_M: pytree of `[M, micro, ...]` arrays passed to `last_fn` (targets, mask).
        mesh: a mesh with `stage_axis` of size S; other axes stay automatic (data parallelism
            inside each stage is left to the compiler).
        stage_axis: the mesh axis of the stages.

    Returns:
        `((loss_sum, count), (grad of stage_params, grad of shared_params))`, gradients
        in the parameters' dtypes (accumulated in f32), `loss_sum` and `count` summed over
        the microbatches.

    Example:
        >>> (s, c), (g_stages, g_shared) = pipeline_1f1b(embed_fn, stage_fn, head_fn, w_S, shared,
        ...                                              ids_M, (tgt_M, mask_M), mesh=mesh)
    """
    S = jax.tree.leaves(stage_params)[0].shape[0]
    M = jax.tree.leaves(inputs_M)[0].shape[0]
    if mesh.shape.get(stage_axis, 1) != S:
        raise PipelineError(f"stage params have {S} stages but mesh axis {stage_axis!r} has size "
                            f"{mesh.shape.get(stage_axis, 1)}; accepted: equal sizes")
    x_shape = jax.eval_shape(first_fn, shared_params, jax.tree.map(lambda a: a[0], inputs_M))
    fwd_perm = [(i, i + 1) for i in range(S - 1)]
    bwd_perm = [(i + 1, i) for i in range(S - 1)]

    def stage(w_, x_):
        return stage_fn(w_, x_).astype(x_.dtype)

    def body(w_1, shared, ins_M, tgts_M):
        w = jax.tree.map(lambda a: a[0], w_1)  # this stage's params (local stage dim of size 1)
        s = jax.lax.axis_index(stage_axis)
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        at = lambda tree, m: jax.tree.map(lambda a: a[m], tree)  # noqa: E731
        first = lambda sh, m: first_fn(sh, at(ins_M, m)).astype(x_shape.dtype)  # noqa: E731
        res = split_residuals(stage, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w), x_shape)

        def backward(role_first: bool, role_last: bool):
            """`(micro residuals, shared residuals, stage output, m, cotangent in)
            -> (g_w, g_shared, cotangent out, loss_sum, count)`."""
            def run(micro, kept, y, m, ct_y):
                g_sh = jax.tree.map(jnp.zeros_like, shared)
                loss = count = jnp.zeros((), jnp.float32)
                if role_last:  # the loss head runs here, on the stored stage output
                    out, vjp = jax.vjp(lambda sh_, y_: last_fn(sh_, y_, at(tgts_M, m)), shared, y)
                    g_sh, ct_y = vjp((jnp.ones((), out[0].dtype), jnp.zeros((), out[1].dtype)))
                    loss, count = out[0].astype(jnp.float32), out[1].astype(jnp.float32)
                g_w, ct_x = res.pullback(w, micro, kept)(ct_y.astype(x_shape.dtype))
                if role_first:  # the embedding's gradient; nothing upstream to send a cotangent to
                    _, vjp = jax.vjp(lambda sh_: first(sh_, m), shared)
                    g_sh = _add(g_sh, vjp(ct_x.astype(x_shape.dtype))[0])
                    ct_x = jnp.zeros_like(ct_x)
                return g_w, g_sh, ct_x.astype(x_shape.dtype), loss, count
            return run

        roles = [backward(i & 1 == 1, i & 2 == 2) for i in range(4)]
        role = (s == 0).astype(jnp.int32) + 2 * (s == S - 1).astype(jnp.int32)
        put = lambda ring, v, m: jax.lax.dynamic_update_index_in_dim(ring, v, m % S, 0)  # noqa: E731
        get = lambda ring, m: jax.lax.dynamic_index_in_dim(ring, m % S, 0, keepdims=False)  # noqa: E731

        def tick(carry, t):
            recv_f, recv_b, ring, g_w, g_sh, loss, count = carry
            df, db = t - s, t - (2 * S - 1 - s)
            is_f = (df >= 0) & (df % 2 == 0) & (df // 2 < M)
            is_b = (db >= 0) & (db % 2 == 0) & (db // 2 < M)
            m = jnp.clip(jnp.where(is_f, df // 2, db // 2), 0, M - 1)
            action = jnp.where(is_f, 1, jnp.where(is_b, 2, 0))

            def idle(c):
                return (zeros_x, zeros_x) + c

            def forward(c):
                (micro_S, kept, _), g_w, g_sh, loss, count = c
                x = jax.lax.cond(s == 0, lambda: first(shared, m), lambda: recv_f)
                y, micro, kept = res.forward(w, x)
                # The last stage's backward of m is its next tick: one slot holds the stage output it reads.
                ring = (tuple(put(r, v, m) for r, v in zip(micro_S, micro)), kept, y)
                return y, zeros_x, ring, g_w, g_sh, loss, count

            def backward_tick(c):
                (micro_S, kept, y), g_w, g_sh, loss, count = c
                micro = tuple(get(r, m) for r in micro_S)
                dw, dsh, dx, l, n = jax.lax.switch(role, roles, micro, kept, y, m, recv_b)
                return zeros_x, dx, c[0], _add(g_w, dw), _add(g_sh, dsh), loss + l, count + n

            with jax.named_scope(TICK_SCOPE):  # marks the tick's branches for `check_tick_collectives`
                send_f, send_b, *rest = jax.lax.switch(action, [idle, forward, backward_tick],
                                                       (ring, g_w, g_sh, loss, count))
            recv_f = jax.lax.ppermute(send_f, stage_axis, fwd_perm)
            recv_b = jax.lax.ppermute(send_b, stage_axis, bwd_perm)
            return (recv_f, recv_b, *rest), None

        # The ring: each micro residual for S microbatches in flight; the parameter-only residuals, the
        # same for every microbatch, once; the latest stage output (read by the last stage's loss head).
        zeros = lambda shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
        ring0 = (tuple(zeros((S,) + a.shape, a.dtype) for a in res.micro),
                 tuple(zeros(a.shape, a.dtype) for a in res.shared), zeros(x_shape.shape, x_shape.dtype))
        zero = jnp.zeros((), jnp.float32)
        carry0 = (zeros_x, zeros_x, ring0, _zeros_f32(w), _zeros_f32(shared), zero, zero)
        (_, _, _, g_w, g_sh, loss, count), _ = jax.lax.scan(tick, carry0, jnp.arange(2 * (M + S - 1)))
        g_sh = jax.lax.psum(g_sh, stage_axis)  # embedding from stage 0, head from the last stage
        loss, count = jax.lax.psum((loss, count), stage_axis)
        g_w = jax.tree.map(lambda g, p: g.astype(p.dtype)[None], g_w, w)
        g_sh = jax.tree.map(lambda g, p: g.astype(p.dtype), g_sh, shared)
        return (loss, count), (g_w, g_sh)

    spec_S = jax.tree.map(lambda _: P(stage_axis), stage_params)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    fn = shard_map(body, mesh=mesh, in_specs=(spec_S, rep(shared_params), rep(inputs_M), rep(targets_M)),
                   out_specs=((P(), P()), (spec_S, rep(shared_params))), axis_names=frozenset({stage_axis}),
                   check_vma=False)
    # Under jit (eagerly, a shard_map manual over the stage axis alone is refused).
    return jax.jit(fn)(stage_params, shared_params, inputs_M, targets_M)


def check_tick_collectives(hlo_text: str, mesh: Mesh, *, stage_axis: str = "stage") -> None:
    """Refuse a compiled program whose 1F1B tick branches hold a collective other stages cannot join.

    At one tick, different stages take different branches of the tick's `lax.switch`
    (forward, backward, idle). A collective inside a branch completes only if every
    device of its group takes that branch: an all-reduce, all-gather, reduce-scatter or
    all-to-all within one stage's devices (tensor or data parallelism inside the stage,
    ZeRO-3's resharding) does; one whose group spans stages would wait forever, and so
    would a collective-permute (the CPU runtime joins every device of the program in
    one, whatever its pairs; XLA emits them when it reshards something it cannot compute
    on in place, such as an attention head cut in half by the tensor axis). Call this on
    the compiled program before running it (`experiments/train.py` does).

    Args:
        hlo_text: `compiled.as_text()` of a program that runs `pipeline_1f1b`.
        mesh: the mesh it was compiled for (logical device ids follow `mesh.devices`).
        stage_axis: the mesh axis of the stages.

    Raises:
        PipelineError: names the collectives found and what is accepted.

    Example:
        >>> compiled = jax.jit(step).lower(state, batch).compile()
        >>> check_tick_collectives(compiled.as_text(), mesh)
    """
    from jmem.parallel.hlo import branch_collectives, device_groups

    names = list(mesh.axis_names)
    if stage_axis not in names or mesh.shape[stage_axis] == 1:
        return
    stage_of = np.indices(mesh.devices.shape)[names.index(stage_axis)].reshape(-1)
    bad: dict[str, int] = {}
    for kind, line in branch_collectives(hlo_text, TICK_SCOPE):
        groups = device_groups(line, mesh.size)
        crosses = any(len({int(stage_of[i]) for i in g if i < mesh.size}) > 1 for g in groups)
        if kind == "collective-permute" or crosses:
            bad[kind] = bad.get(kind, 0) + 1
    if bad:
        found = ", ".join(f"{n} {k}" for k, n in sorted(bad.items()))
        raise PipelineError(
            f"the 1f1b pipeline schedule cannot run this sharding on mesh "
            f"{','.join(f'{a}={n}' for a, n in mesh.shape.items() if n > 1)}: the compiled tick holds {found} "
            f"inside its run-time branches, which the stages take at different ticks (the program would hang); "
            f"usually a tensor axis that splits attention heads or a rule that reshards inside a stage; "
            f"accepted: shardings that keep whole heads per device, or --pipeline-schedule gpipe")


def busiest_stage_matmul_flops(hlo_text: str, n_microbatches: int) -> float:
    """Matmul FLOPs per device of a compiled program that runs `pipeline_1f1b` once.

    `jmem.memory.hlo_flops.matmul_flops` cannot total the schedule: every tick's `lax.switch`
    runs a forward, a backward or nothing, chosen at run time. Every stage runs M
    forward and M backward ticks, so this counts M x (costliest forward tick +
    costliest backward tick) plus the matmuls outside the schedule: the work of the
    busiest stage, exact when one stage has both costliest ticks (for the LM
    loss, the last stage: its backward tick adds the loss head), else an upper
    bound. nan if the program does not hold exactly one tick switch.

    Example:
        >>> text = jax.jit(value_and_grad).lower(params, batch).compile().as_text()
        >>> busiest_stage_matmul_flops(text, n_microbatches=4)
    """
    from jmem.memory.hlo_flops import branch_flops, matmul_flops

    ticks = [b for b in branch_flops(hlo_text) if len(b) == 3 and b[0] == 0.0]  # idle, forward, backward
    if len(ticks) != 1:
        return float("nan")
    _, forward, backward = ticks[0]
    return matmul_flops(hlo_text, differing="zero") + n_microbatches * (forward + backward)


def _block_weights(layers: dict) -> dict:
    """The `jmem.models.llama.block` weight dict from the params' `layers` subtree
    (`{name: {"kernel" | "scale": leaf}}`), as `Blocks.weights` builds it from the module."""
    return {n: (v["scale"] if "scale" in v else v["kernel"]) for n, v in layers.items()}


def pipeline_1f1b_lm_value_and_grad(model, *, n_stages: int, n_microbatches: int, mesh: Mesh,
                                    chunk: int | None = None, stage_axis: str = "stage"):
    """`(params, batch) -> ((loss_sum, count), grads)` of a `jmem.models.Llama` under the 1F1B schedule.

    `params` is the model's `nnx.Param` state as a pure dict (as from `pipeline_lm_loss_fn`);
    `batch` is `{"inputs", "targets", "mask"}` of `[batch, seq]`. The result equals
    `jax.value_and_grad` of the unpipelined summed cross-entropy.

    Raises:
        PipelineError: an MoE model, stages or microbatches not a positive integer, no mesh or
            one whose stage axis is not `n_stages` long, or a remat policy that offloads residuals
            to host memory.
        ShardingError (at trace time): the mesh would split an attention head
            (`jmem.parallel.rules.check_heads`, under the rules of the enclosing
            `activation_sharding`, else the defaults).
    """
    from flax import nnx

    from jmem.models.config import as_dtype
    from jmem.memory.remat import remat
    from jmem.models.llama import block, rms_norm
    from jmem.train.loss import chunked_cross_entropy

    cfg = model.config
    check_dense(model, "1f1b")
    check_stages(n_stages)
    if not isinstance(mesh, Mesh):
        raise PipelineError(f"mesh={mesh!r:.80}; accepted: a jax.sharding.Mesh (the 1f1b schedule places its "
                            f"stages on its {stage_axis!r} axis), e.g. jmem.parallel.make_mesh('stage=2')")
    check_stage_axis(n_stages, mesh, stage_axis)
    if not is_int(n_microbatches) or n_microbatches < 1:
        raise PipelineError(f"microbatches={n_microbatches!r} must be an integer >= 1")
    if "offload" in str(cfg.remat):
        # Each microbatch's residuals wait in a device ring buffer between its forward and backward
        # ticks; one offloaded to host memory cannot be written into it (JAX fails on the memory space).
        raise PipelineError(f"the 1f1b pipeline schedule keeps residuals on the device, so remat={cfg.remat!r} "
                            "cannot offload them; accepted: a remat policy without offload, or the gpipe schedule")
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    treedef = jax.tree.structure(param_state)
    chunk = cfg.loss_chunk if chunk is None else chunk
    compute = as_dtype(cfg.compute_dtype)

    def first_fn(shared, ids_BT):
        return jnp.take(shared["embed"]["embedding"], ids_BT, axis=0).astype(compute)

    def layer_fn(x_BTE, w_layer):
        B, T = x_BTE.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return block(cfg, _block_weights(w_layer), x_BTE, positions)[0].astype(x_BTE.dtype), None

    def stage_fn(w_stage, x_BTE):
        # The model's remat policy per layer, as without a pipeline: the forward tick stores what it
        # saves (everything under "none", each layer's input under "full") and the backward tick
        # recomputes the rest.
        return jax.lax.scan(remat(layer_fn, cfg.remat, prevent_cse=False), x_BTE, w_stage)[0]

    def last_fn(shared, y_BTE, tgt):
        # The model's own head code on the shared params; the layer leaves are never read by the head,
        # so any arrays of the right tree structure stand in for them.
        layers_stub = jax.tree.map(lambda a: jnp.zeros((), a.dtype), layers_abstract)
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves({**shared, "layers": layers_stub})),
                      rest)
        h = rms_norm(y_BTE, m.norm.scale.get_value(), cfg.norm_eps)
        targets_BT, mask_BT = tgt
        return chunked_cross_entropy(h, targets_BT, mask_BT, m.logits_from_hidden, chunk)

    layers_abstract = jax.eval_shape(lambda: nnx.to_pure_dict(param_state)["layers"])

    def value_and_grad(p, batch):
        # A head cut over devices would put resharding collectives inside the tick's branches (a hang):
        # checked against the rules the step is traced under (`activation_sharding`), else the defaults.
        active = active_activation_sharding()
        check_heads(cfg.n_heads, cfg.n_kv_heads, active[0] if active else None, mesh)
        check_micro_rows(batch["inputs"].shape[0], n_microbatches)
        micro = lambda x: split_microbatches(x, n_microbatches)  # noqa: E731
        shared = {k: v for k, v in p.items() if k != "layers"}
        w_S = split_stages(p["layers"], n_stages)
        (s, c), (g_S, g_sh) = pipeline_1f1b(
            first_fn, stage_fn, last_fn, w_S, shared, micro(batch["inputs"]),
            (micro(batch["targets"]), micro(batch["mask"])), mesh=mesh, stage_axis=stage_axis)
        g_layers = jax.tree.map(lambda g: g.reshape((g.shape[0] * g.shape[1],) + g.shape[2:]), g_S)
        return (s, c), {**g_sh, "layers": g_layers}

    return value_and_grad


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def pipeline_1f1b_lm_loss_fn(model, *, n_stages: int, n_microbatches: int, mesh: Mesh, chunk: int | None = None,
                             stage_axis: str = "stage"):
    """`(loss_fn, params)` like `pipeline_lm_loss_fn`, whose gradient runs the 1F1B schedule.

    `loss_fn(params, batch) -> (loss_sum, count)` carries a `jax.custom_vjp`: under
    `jax.value_and_grad` (or `jmem.parallel.make_sharded_train_step`, or
    `jmem.train.make_train_fns(loss_fn=...)`) its forward rule runs
    `pipeline_1f1b_lm_value_and_grad` and its backward rule scales the stored gradients
    by the loss cotangent; without a gradient it is the GPipe forward. Use with
    `rules="layers=stage"` so each stage's devices hold only their layers.

    Example:
        >>> loss_fn, params = pipeline_1f1b_lm_loss_fn(model, n_stages=2, n_microbatches=4, mesh=mesh)
        >>> trainer = make_sharded_train_step(loss_fn, optax.adam(1e-3), params, mesh, rules="layers=stage")
        >>> grads = jax.grad(lambda p: loss_fn(p, batch)[0])(params)   # runs the 1F1B schedule
    """
    vg = pipeline_1f1b_lm_value_and_grad(model, n_stages=n_stages, n_microbatches=n_microbatches, mesh=mesh,
                                         chunk=chunk, stage_axis=stage_axis)
    forward_only, params = pipeline_lm_loss_fn(model, n_stages=n_stages, n_microbatches=n_microbatches, mesh=mesh,
                                               chunk=chunk)

    @jax.custom_vjp
    def loss_fn(p, batch):
        return forward_only(p, batch)

    def fwd(p, batch):
        out, grads = vg(p, batch)
        return out, (grads, batch)

    def bwd(res, ct):
        grads, batch = res
        ct_sum = ct[0]  # the token count does not depend on the params
        return jax.tree.map(lambda g: (g * ct_sum).astype(g.dtype), grads), jax.tree.map(_zero_cotangent, batch)

    loss_fn.defvjp(fwd, bwd)
    from jmem.parallel.step import mark_model_loss

    loss_fn.jmem_schedule = "1f1b"  # read by `check_zero_fits_schedule`
    return mark_model_loss(loss_fn, model), params


def check_zero_fits_schedule(loss_fn, zero: int, mesh: Mesh) -> None:
    """PipelineError for a 1F1B `loss_fn` under ZeRO-2/3 on a mesh with a tensor axis.

    ZeRO-2/3 reshard gradients (and gather parameters) inside the schedule's per-tick branches;
    with a tensor axis XLA emits collective-permutes there (ZeRO-2, which stages cannot join) or
    aborts the process in its partitioner (ZeRO-3). Other losses pass.
    """
    tensor = mesh.shape.get("tensor", 1)
    if getattr(loss_fn, "jmem_schedule", None) == "1f1b" and zero >= 2 and tensor > 1:
        from jmem.parallel.mesh import format_mesh

        raise PipelineError(f"the 1f1b pipeline schedule with ZeRO stage {zero} on a mesh with tensor={tensor} "
                            f"({format_mesh(dict(mesh.shape))}) is not supported; accepted: ZeRO 0 or 1 with a "
                            f"tensor axis, ZeRO 2 or 3 without one, or the gpipe schedule")


def schedule_lm_loss_fn(schedule: str, model, **kw) -> tuple[Callable, Any]:
    """`pipeline_lm_loss_fn` (schedule "gpipe") or `pipeline_1f1b_lm_loss_fn` ("1f1b")."""
    if check_schedule(schedule) == "1f1b":
        return pipeline_1f1b_lm_loss_fn(model, **kw)
    return pipeline_lm_loss_fn(model, **kw)

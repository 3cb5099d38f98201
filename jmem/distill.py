"""Knowledge distillation: a student trained on a teacher's softened distribution.

The objective (Hinton et al. 2015), per unmasked position:

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
        + (1 - alpha) * CE(student, target)

`kind="reverse"` uses KL(student || teacher) instead (mode-seeking, as in MiniLLM).
The T^2 factor keeps the soft term's gradient scale independent of T.

Memory: both models' logits are `f32[batch, seq, vocab]`; for SmolLM2 (vocab
49152) at batch 8 x 2048 that is 3.2 GB per model, more than either model.
`distill_loss_sum` therefore runs the two heads one sequence chunk at a time
under `lax.scan`, each chunk under `jax.checkpoint`, from the two final hidden
states: only one chunk of each model's logits is alive, forward and backward.
The teacher runs under `stop_gradient` (its parameters and hidden states), so
autodiff keeps none of its activations; the backward pass recomputes one
chunk of teacher logits from its hidden states when it needs the soft targets.

`student_from_teacher` initialises a shallower student from a subset of the
teacher's layers (DistilBERT; "layer dropping"), copying embedding, final norm
and head. `make_distill_fns` gives the pure, jit-able train step with the teacher
state as an argument (not a compile-time constant).

Example:
    >>> student = student_from_teacher(teacher, layers=range(0, 30, 2))
    >>> total, count = distill_loss_sum(student, teacher, batch, temperature=2.0, alpha=0.5)
    >>> loss = total / count
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmem.checks import as_python_scalar, check_bool, check_optimizer, is_int, is_number
from jmem.lora import combine, has_dropout, trainable_split
from jmem.models.llama import Llama
from jmem.train.loss import check_batch_ids, check_token_ids, masked_nll, router_loss, vocab_size_of

KINDS = ("forward", "reverse")
BATCH_KEYS = ("inputs", "targets", "mask")


def check_distill_args(temperature: float, alpha: float, kind: str) -> tuple[float, float]:
    """Validate the loss hyperparameters; returns them as floats.

    Raises:
        ValueError: temperature not a finite number > 0, alpha not a number in [0, 1] (a
            bool or a string is not a number), or an unknown `kind`. 0-d arrays count as their numbers.
    """
    temperature, alpha = as_python_scalar(temperature), as_python_scalar(alpha)
    if not (is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"distillation temperature={temperature!r}; accepted: a finite number > 0")
    if not (is_number(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"distillation alpha={alpha!r}; accepted: a number in [0, 1] (weight of the KL term)")
    if kind not in KINDS:
        raise ValueError(f"distillation kind={kind!r}; accepted: {', '.join(KINDS)}")
    return float(temperature), float(alpha)


def check_batch(batch) -> tuple[int, int]:
    """The (B, T) of a distillation batch: one ValueError unless it holds "inputs", "targets" and
    "mask", each [B, T] (shapes only: fine under jit)."""
    accepted = "accepted: a dict with keys inputs, targets, mask, each [B, T] (one B, T)"
    if not isinstance(batch, Mapping) or any(k not in batch for k in BATCH_KEYS):
        what = f"keys={sorted(map(str, batch))}" if isinstance(batch, Mapping) else f"={type(batch).__name__}"
        raise ValueError(f"distillation batch {what}; {accepted}")
    shapes = {k: tuple(np.shape(batch[k])) for k in BATCH_KEYS}
    if len(shapes["inputs"]) != 2 or len(set(shapes.values())) != 1:
        got = ", ".join(f"{k}={list(v)}" for k, v in shapes.items())
        raise ValueError(f"distillation batch shapes {got}; {accepted}")
    check_token_ids(batch)
    return shapes["inputs"]


def distill_terms_from_logits(s_BTV, t_BTV, targets_BT, mask_BT, *, temperature: float, kind: str = "forward",
                              need_kl: bool = True):
    """Masked sums of the KL and cross-entropy terms from full logits (one chunk).

    Args:
        s_BTV: student logits [batch, seq, vocab] (any float dtype; computed in f32).
        t_BTV: teacher logits of the same shape, or None when `need_kl` is False.
        targets_BT: i32[batch, seq] next-token ids.
        mask_BT: [batch, seq] weights (1 = counted).
        temperature: softmax temperature T of the KL term.
        kind: "forward" KL(teacher || student) or "reverse" KL(student || teacher).

    Returns:
        (kl_sum f32[] (not yet times T^2; 0 without `need_kl`), ce_sum f32[]).
    """
    s_BTV = s_BTV.astype(jnp.float32)
    mask_BT = mask_BT.astype(jnp.float32)
    kl = jnp.zeros((), jnp.float32)
    ce = jnp.sum(masked_nll(jax.nn.logsumexp(s_BTV, axis=-1), s_BTV, targets_BT, mask_BT))
    if need_kl:
        logp_s = jax.nn.log_softmax(s_BTV / temperature, axis=-1)
        logp_t = jax.nn.log_softmax(t_BTV.astype(jnp.float32) / temperature, axis=-1)
        logp_a, logp_b = (logp_t, logp_s) if kind == "forward" else (logp_s, logp_t)
        p_a = jnp.exp(logp_a)  # KL(a || b): an entry `a` rules out (-inf logit) adds 0, not 0 * -inf, in the
        kl_BT = jnp.sum(p_a * jnp.where(p_a > 0, logp_a - logp_b, 0.0), axis=-1)  # value and in the gradient
        kl = jnp.sum(jnp.where(mask_BT != 0, kl_BT * mask_BT, 0.0))
    return kl, ce


def _resolve_chunk(chunk: int | None, T: int, default: int) -> int:
    """Positions per chunk (at most T): `chunk`, or the model's `loss_chunk` for None. When it does
    not divide T, the tail is a smaller last chunk (as `chunked_cross_entropy`)."""
    if chunk is None:
        return min(int(default), T)
    if not is_int(chunk) or chunk <= 0:
        raise ValueError(f"distillation chunk={chunk!r}; accepted: a positive integer, or None")
    return min(int(chunk), T)


def _frozen(teacher):
    """The teacher with `stop_gradient` on every state leaf (a new module, same graph)."""
    graphdef, state = nnx.split(teacher)
    return nnx.merge(graphdef, jax.tree.map(jax.lax.stop_gradient, state))


def distill_loss_terms(student, teacher, batch: dict, *, temperature: float = 2.0, alpha: float = 0.5,
                       kind: str = "forward", chunk: int | None = None):
    """The separate sums of `distill_loss_sum` (for logging).

    Returns:
        (kl_sum f32[] (times T^2, before alpha), ce_sum f32[], count f32[], MoE router
        statistics of the student or None)
    """
    temperature, alpha = check_distill_args(temperature, alpha, kind)
    vs, vt = vocab_size_of(student), vocab_size_of(teacher)
    if alpha > 0 and vs is not None and vt is not None and vs != vt:
        raise ValueError(f"student vocab_size={vs} differs from teacher vocab_size={vt}; distillation compares "
                         "distributions over the same token ids: accepted: equal vocabularies")
    B, T = check_batch(batch)
    check_batch_ids(batch, vocab_size_of(student))
    inputs, targets_BT, mask_BT = batch["inputs"], batch["targets"], batch["mask"]
    chunk = _resolve_chunk(chunk, T, getattr(getattr(student, "config", None), "loss_chunk", 1024))
    need_kl = alpha > 0  # the cross-entropy is always computed: it is logged (`_weighted` leaves it out at alpha=1)
    if need_kl and teacher is None:
        raise ValueError(f"alpha={alpha} needs a teacher; accepted: a teacher model, or alpha=0 (plain cross-entropy)")

    if getattr(getattr(student, "config", None), "moe_experts", 0) and hasattr(student, "hidden_and_router_stats"):
        hs_BTE, stats = student.hidden_and_router_stats(inputs, token_mask_BT=batch.get("input_mask"))
    else:
        (hs_BTE, _), stats = student.hidden(inputs), None
    if need_kl:
        teacher = _frozen(teacher)
        # An MoE teacher routes every token (inference), so its targets do not depend on the batch.
        moe = getattr(getattr(teacher, "config", None), "moe_experts", 0)
        ht_BTE = jax.lax.stop_gradient((teacher.hidden(inputs, dropless=True) if moe else teacher.hidden(inputs))[0])
    else:
        ht_BTE = None

    def piece(hs, ht, tgt, m):
        s = student.logits_from_hidden(hs)
        t = teacher.logits_from_hidden(ht) if need_kl else None
        if t is not None and t.shape[-1] != s.shape[-1]:
            raise ValueError(f"student logits have {s.shape[-1]} classes, teacher logits {t.shape[-1]}; "
                             "accepted: equal vocabularies")
        return distill_terms_from_logits(s, t, tgt, m, temperature=temperature, kind=kind, need_kl=need_kl)

    xs = (hs_BTE, ht_BTE, targets_BT, mask_BT)
    if chunk >= T:  # one piece: the plain computation, nothing to scan
        kl, ce = piece(*xs)
    else:
        n = T // chunk
        main = n * chunk

        def to_chunks(x):  # [B, n*c, ...] -> [n, B, c, ...]
            return None if x is None else jnp.moveaxis(x[:, :main].reshape((B, n, chunk) + x.shape[2:]), 1, 0)

        # Recompute both heads' logits in the backward pass instead of keeping them per chunk.
        remat_piece = jax.checkpoint(piece)

        def body(carry, chunk_xs):
            kl, ce = remat_piece(*chunk_xs)
            return (carry[0] + kl, carry[1] + ce), None

        zero = jnp.zeros((), jnp.float32)
        (kl, ce), _ = jax.lax.scan(body, (zero, zero), tuple(to_chunks(x) for x in xs))
        if main < T:  # the tail: a smaller last chunk
            tail_kl, tail_ce = remat_piece(*(None if x is None else x[:, main:] for x in xs))
            kl, ce = kl + tail_kl, ce + tail_ce
    count = jnp.sum(mask_BT.astype(jnp.float32))
    return kl * temperature**2, ce, count, stats


def _weighted(kl, ce, alpha: float):
    """`alpha * kl + (1 - alpha) * ce`, leaving out a term of weight 0 (no backward pass through it)."""
    if alpha == 1.0:
        return kl
    return ce if alpha == 0.0 else alpha * kl + (1.0 - alpha) * ce


def distill_loss_sum(student, teacher, batch: dict, *, temperature: float = 2.0, alpha: float = 0.5,
                     kind: str = "forward", chunk: int | None = None):
    """Distillation loss sum and token count, in the shape of `jmem.train.loss.lm_loss_sum`.

    `alpha * T^2 * KL + (1 - alpha) * CE` summed over unmasked positions; the two heads
    run one sequence chunk at a time (see the module docstring), so neither model's
    full logits exist. alpha=0 never runs the teacher; alpha=1 takes no gradient of the cross-entropy.
    For an MoE student its weighted router losses are added as `router_loss x count`.

    Args:
        student: a model with `hidden(ids) -> (h, cache)` and `logits_from_hidden(h)`
            (`jmem.models.Llama`; any weight leaves: float, quantized, LoRA).
        teacher: the same interface and vocabulary; it gets no gradient.
        batch: {"inputs": i32[B, T], "targets": i32[B, T], "mask": [B, T]}.
        temperature: softmax temperature T (> 0) of the KL term.
        alpha: weight of the KL term in [0, 1].
        kind: "forward" = KL(teacher || student) (Hinton), "reverse" = KL(student || teacher).
        chunk: sequence positions per chunk (>= T: one piece; a tail shorter than it is one
            more piece). None: `student.config.loss_chunk`.

    Returns:
        (loss_sum f32[], count f32[])

    Raises:
        ValueError: vocab sizes differ, temperature <= 0, alpha outside [0, 1], unknown
            kind, a chunk that is not a positive integer, or a batch without inputs, targets
            and mask of one [B, T] shape; before any computation.

    Example:
        >>> total, count = distill_loss_sum(student, teacher, batch, temperature=2.0, alpha=0.5, chunk=256)
        >>> loss = total / count
    """
    kl, ce, count, stats = distill_loss_terms(student, teacher, batch, temperature=temperature, alpha=alpha,
                                              kind=kind, chunk=chunk)
    total = _weighted(kl, ce, alpha)
    if stats is not None:
        total = total + router_loss(student, stats) * count
    return total, count


def student_from_teacher(teacher: Llama, layers: Sequence[int]) -> Llama:
    """A new `Llama` made of the teacher's chosen blocks (layer-dropping initialisation).

    Same width, heads, vocabulary and settings; `len(layers)` blocks, block i a copy of
    teacher block `layers[i]`; embedding, final norm and head copied. Weight leaves keep
    their type (a quantized or LoRA teacher gives a quantized or LoRA student).

    Args:
        teacher: a `jmem.models.Llama`.
        layers: distinct teacher block indices in [0, teacher.config.n_layers).

    Returns:
        A new `Llama` with `config.n_layers == len(layers)` and its own arrays.

    Raises:
        ValueError: not a sequence; empty, out-of-range, non-integer or repeated indices.

    Example:
        >>> student = student_from_teacher(teacher, range(0, teacher.config.n_layers, 2))
    """
    if not isinstance(teacher, Llama):
        raise ValueError(f"teacher={teacher!r:.80}; accepted: a jmem.models.Llama")
    n = teacher.config.n_layers
    try:
        layers = list(layers)
    except TypeError:
        raise ValueError(f"student layers={layers!r}; accepted: a sequence of distinct indices in [0, {n})") from None
    if not layers:
        raise ValueError(f"student layers is empty; accepted: distinct indices in [0, {n})")
    for i in layers:
        if not is_int(i):
            raise ValueError(f"student layer {i!r} is not an integer; accepted: indices in [0, {n})")
        if not 0 <= i < n:
            raise ValueError(f"student layer {i} is out of range for a teacher of {n} layers; accepted: [0, {n})")
    if len(set(layers)) != len(layers):
        dup = sorted({i for i in layers if layers.count(i) > 1})
        raise ValueError(f"student layers repeat {dup}; accepted: distinct indices in [0, {n})")

    config = teacher.config.replace(n_layers=len(layers))
    student = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    idx = np.asarray(layers, np.int32)
    src = dict(nnx.to_flat_state(nnx.state(teacher)))
    dst = nnx.to_flat_state(nnx.state(student))
    for path, var in dst:
        if path not in src:
            raise ValueError(f"student variable {'.'.join(map(str, path))} has no teacher counterpart")
        value = src[path].get_value()
        # Every array of a stacked block leaf (also inside a quantized/LoRA leaf) has the
        # leading layers axis that the layer scan slices, so one take covers them all.
        take = (lambda a: jnp.take(a, idx, axis=0)) if path[0] == "layers" else (lambda a: jnp.array(a, copy=True))
        _set(student, path, jax.tree.map(take, value))
    return student


def _set(module, path: tuple, value) -> None:
    node = module
    for key in path[:-1]:
        node = getattr(node, key)
    getattr(node, path[-1]).set_value(value)


@dataclasses.dataclass(frozen=True)
class DistillFns:
    """Pure functions of a distillation run (`step` and `eval_ce` are jit-able).

    init(student) -> (params, opt_state): fresh copies of the student's parameters.
    step(params, opt_state, teacher_state, batch) -> (params, opt_state, metrics);
        metrics: loss (objective per token), kl (T^2 KL per token), ce (per token), grad_norm.
    eval_ce(params, batch) -> (ce_sum, count): the student's held-out cross-entropy.
    merge(params) -> the student module.
    """

    init: Callable[[nnx.Module], tuple[Any, Any]]
    step: Callable[..., tuple[Any, Any, dict]]
    eval_ce: Callable[[Any, dict], tuple[jax.Array, jax.Array]]
    merge: Callable[[Any], nnx.Module]


def make_distill_fns(student: nnx.Module, teacher: nnx.Module | None, tx: optax.GradientTransformation, *,
                     temperature: float = 2.0, alpha: float = 0.5, kind: str = "forward",
                     chunk: int | None = None, adapters_only: bool = False) -> DistillFns:
    """The train step of `student` on `distill_loss_sum` against `teacher`, as pure functions.

    The teacher's state is a step argument (`nnx.state(teacher)`), so a jitted step does
    not embed its weights as constants, and a sharded or quantized teacher passes as is.
    alpha=0 gives plain cross-entropy training of the same student (the teacher unused: it
    may be None, and then the step's teacher_state is ignored). With `adapters_only` only the
    student's LoRA arrays (`jmem.lora`) get gradients and optimizer state: a quantized student
    base with adapters (QLoRA) distils as is.

    Example:
        >>> fns = make_distill_fns(student, teacher, optax.adamw(3e-4), temperature=2.0, alpha=0.5)
        >>> params, opt = fns.init(student)
        >>> step = jax.jit(fns.step, donate_argnums=(0, 1))
        >>> params, opt, metrics = step(params, opt, nnx.state(teacher), batch)
    """
    temperature, alpha = check_distill_args(temperature, alpha, kind)
    check_optimizer(tx, "tx")
    check_bool("adapters_only", adapters_only)
    if chunk is not None and (not is_int(chunk) or chunk <= 0):
        raise ValueError(f"distillation chunk={chunk!r}; accepted: a positive integer, or None")
    vs, vt = vocab_size_of(student), vocab_size_of(teacher)
    if alpha > 0 and vs is not None and vt is not None and vs != vt:
        raise ValueError(f"student vocab_size={vs} differs from teacher vocab_size={vt}; accepted: equal vocabularies")
    if teacher is None and alpha > 0:
        raise ValueError(f"alpha={alpha} needs a teacher; accepted: a teacher model, or alpha=0 (plain cross-entropy)")
    graphdef, _, rest = nnx.split(student, nnx.Param, ...)
    teacher_graphdef = None if teacher is None else nnx.split(teacher)[0]

    def merge(params):
        return nnx.merge(graphdef, params, rest)

    if adapters_only and not jax.tree.leaves(trainable_split(nnx.state(student, nnx.Param), True)[0]):
        raise ValueError("adapters_only=True but the student has no LoRA adapters; apply jmem.lora.apply_lora first")
    if has_dropout(student):  # the step draws no dropout masks: the adapters would train without it
        raise ValueError("the student's LoRA adapters have dropout > 0, which a distillation step does not apply; "
                         "accepted: adapters with dropout=0 (jmem.lora.apply_lora(..., dropout=0.0))")

    def init(model):
        params = nnx.state(model, nnx.Param)
        params = jax.tree.map(lambda a: jnp.array(a, copy=True), params)  # the step may donate them
        return params, tx.init(trainable_split(params, adapters_only)[0])

    def step(params, opt_state, teacher_state, batch):
        check_batch(batch)
        t = None if teacher_graphdef is None else nnx.merge(teacher_graphdef, teacher_state)
        n_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
        train, frozen = trainable_split(params, adapters_only)

        def objective(tr):
            s = merge(combine(tr, frozen))
            kl, ce, count, stats = distill_loss_terms(s, t, batch, temperature=temperature, alpha=alpha,
                                                      kind=kind, chunk=chunk)
            total = _weighted(kl, ce, alpha)
            if stats is not None:
                total = total + router_loss(s, stats) * count
            return total / n_tokens, (kl / n_tokens, ce / n_tokens)

        (loss, (kl, ce)), grads = jax.value_and_grad(objective, has_aux=True)(train)
        updates, opt_state = tx.update(grads, opt_state, train)
        params = combine(optax.apply_updates(train, updates), frozen)
        return params, opt_state, {"loss": loss, "kl": kl, "ce": ce, "grad_norm": optax.tree.norm(grads)}

    def eval_ce(params, batch):
        _, ce, count, _ = distill_loss_terms(merge(params), None, batch, alpha=0.0, chunk=chunk)
        return ce, count

    return DistillFns(init=init, step=step, eval_ce=eval_ce, merge=merge)

"""Language-model loss with a chunked cross-entropy.

Full logits are `f32[batch, seq, vocab]`: for SmolLM2 at batch 8 x 2048 that
is 3.2 GB, more than the whole model. `chunked_cross_entropy` scans over
sequence chunks and wraps each chunk in ``jax.checkpoint``, so only one
chunk's logits exist at a time, forward and backward; the backward pass
recomputes a chunk's logits from its hidden states.

The loss is returned as a *sum* plus a token count so that gradient
accumulation (`jmem.memory.accumulate`) and data parallelism can divide by
the global count once.

Example:
    >>> total, count = lm_loss_sum(model, batch, chunk=256)
    >>> loss = total / count
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmem.checks import check_arrays, check_int


def cross_entropy_sum(logits_BTV, targets_BT, mask_BT):
    """Masked token cross-entropy, summed (f32), without chunking.

    Jittable: the target values are not checked. Where the mask is nonzero a target must lie in
    [0, vocab), else the loss is NaN (`lm_loss_sum` checks concrete batches); where it is 0 any id
    counts nothing (e.g. Hugging Face's ignore index -100).

    Args:
        logits_BTV: f32[batch, seq, vocab].
        targets_BT: i32[batch, seq]; in [0, vocab) where the mask is nonzero, any value where it is 0.
        mask_BT: f32[batch, seq], 1 where the token counts.

    Returns:
        (loss_sum f32[], count f32[])
    """
    check_arrays("cross_entropy_sum", logits_BTV=logits_BTV, targets_BT=targets_BT, mask_BT=mask_BT)
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    mask_BT = mask_BT.astype(jnp.float32)
    return jnp.sum(masked_nll(lse_BT, logits_BTV, targets_BT, mask_BT)), jnp.sum(mask_BT)


def masked_nll(lse_BT, logits_BTV, targets_BT, mask_BT):
    """`(lse - logit of the target) * mask` per position, 0 where the mask is 0 whatever the target
    there (out of range, it would read NaN, and NaN * 0 is NaN)."""
    counted_BT = mask_BT != 0
    # A counted negative target reads NaN as one past the vocabulary does, never a wrapped-around id.
    safe_BT = jnp.where(counted_BT, jnp.where(targets_BT < 0, logits_BTV.shape[-1], targets_BT), 0)
    tgt_BT = jnp.take_along_axis(logits_BTV, safe_BT[..., None], axis=-1)[..., 0]
    return jnp.where(counted_BT, (lse_BT - tgt_BT) * mask_BT, 0.0)


def chunked_cross_entropy(
    h_BTE: jax.Array,
    targets_BT: jax.Array,
    mask_BT: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    chunk: int | None,
):
    """Cross-entropy sum over sequence chunks; full logits never materialise.

    Jittable: the target values are not checked. Where the mask is nonzero a target must lie in
    [0, vocab), else the loss is NaN; where it is 0 any id counts nothing (e.g. -100).

    Args:
        h_BTE: final hidden states [batch, seq, embed] (any float dtype).
        targets_BT: i32[batch, seq] next-token ids; in [0, vocab) where the mask is nonzero, any
            value where it is 0.
        mask_BT: [batch, seq] weights (1 = counted).
        logits_fn: `h[batch, c, embed] -> f32 logits[batch, c, vocab]`; may
            close over parameters (gradients flow through the closure).
        chunk: sequence positions per chunk, an integer >= 1, or None for the whole
            sequence at once. When it does not divide `seq`, the tail is a smaller
            last chunk (one more trace of the body).

    Returns:
        (loss_sum f32[], count f32[])

    Example:
        >>> s, n = chunked_cross_entropy(h, tgt, mask, model.logits_from_hidden, 256)
    """
    check_arrays("chunked_cross_entropy", h_BTE=h_BTE, targets_BT=targets_BT, mask_BT=mask_BT)
    B, T, E = h_BTE.shape
    if chunk is not None:
        check_int("loss chunk", chunk, 1)
    if chunk is None or chunk >= T:
        return cross_entropy_sum(logits_fn(h_BTE), targets_BT, mask_BT)

    # Recompute logits in the backward pass instead of keeping them per chunk.
    @jax.checkpoint
    def piece(h_BCE, t_BC, m_BC):
        return cross_entropy_sum(logits_fn(h_BCE), t_BC, m_BC)

    n = T // chunk
    main = n * chunk

    def to_chunks(x):
        # [B, n*c, ...] -> [n, B, c, ...]
        return jnp.moveaxis(x[:, :main].reshape((B, n, chunk) + x.shape[2:]), 1, 0)

    def body(carry, xs):
        s, c = piece(*xs)
        return (carry[0] + s, carry[1] + c), None

    zero = jnp.zeros((), jnp.float32)
    (total, count), _ = jax.lax.scan(body, (zero, zero), (to_chunks(h_BTE), to_chunks(targets_BT), to_chunks(mask_BT)))
    if main < T:
        s, c = piece(h_BTE[:, main:], targets_BT[:, main:], mask_BT[:, main:])
        total, count = total + s, count + c
    return total, count


def lm_loss_terms(model, batch: dict, *, chunk: int | None = None):
    """Cross-entropy sum, token count and router statistics of a language model on a batch.

    Args:
        model: as for `lm_loss_sum`; a model with `hidden_and_router_stats`
            (`jmem.models.llama.Llama`) also reports its MoE router statistics.
        batch: {"inputs": i32[B, T], "targets": i32[B, T], "mask": [B, T]}, and optionally
            "input_mask" [B, T] (0 for padding inputs) for an MoE model's routing.
        chunk: sequence chunk for the cross-entropy (`model.config.loss_chunk` when None).

    Returns:
        (ce_sum f32[], count f32[], `jmem.models.moe.MoEStats` averaged over layers, or None
        for a dense model)
    """
    check_lm_batch(batch)
    check_batch_ids(batch, vocab_size_of(model))
    if chunk is None:
        chunk = getattr(getattr(model, "config", None), "loss_chunk", 1024)
    if getattr(getattr(model, "config", None), "moe_experts", 0) and hasattr(model, "hidden_and_router_stats"):
        # Padding inputs (the optional "input_mask"; the loss mask may also zero real tokens, such as
        # a prompt's) take no expert place and count in no router statistic.
        h_BTE, stats = model.hidden_and_router_stats(batch["inputs"], token_mask_BT=batch.get("input_mask"))
    else:
        (h_BTE, _), stats = model.hidden(batch["inputs"]), None
    s, c = chunked_cross_entropy(h_BTE, batch["targets"], batch["mask"], model.logits_from_hidden, chunk)
    return s, c, stats


def check_batch_ids(batch: dict, vocab_size: int | None) -> None:
    """Ids outside the vocabulary read NaN (an input's embedding, a counted target's logit): one ValueError
    naming one. Inputs are checked everywhere (a NaN embedding reaches every later position), targets only
    where the mask counts them (any value elsewhere, e.g. an ignore index of -100). Checked on concrete
    arrays only (not while tracing, nor a multi-process array this process sees part of)."""
    if vocab_size is None:
        return
    for key, where in (("inputs", None), ("targets", "mask")):
        if not all(_readable(batch[k]) for k in (key, where) if k):
            continue
        ids = np.asarray(batch[key])
        ids = ids if where is None else ids[np.asarray(batch[where]) != 0]
        if ids.size and not 0 <= ids.min() <= ids.max() < vocab_size:
            bad = ids.min() if ids.min() < 0 else ids.max()
            counted = "" if where is None else " where the mask counts it"
            ignore = "" if where is None else ", or a mask of 0 there (e.g. for an ignore index of -100)"
            raise ValueError(f"batch[{key!r}] holds {bad}{counted}; accepted: 0..{vocab_size - 1} (the model's "
                             f"vocabulary){ignore}")


def vocab_size_of(model) -> int | None:
    return getattr(getattr(model, "config", None), "vocab_size", None)


def _readable(x) -> bool:
    return not isinstance(x, jax.core.Tracer) and (not isinstance(x, jax.Array) or x.is_fully_addressable)


def check_lm_batch(batch) -> None:
    """ValueError unless `batch` is {"inputs", "targets", "mask"} of one [B, T] shape with integer ids
    (checked on shapes and dtypes, so also while tracing)."""
    keys = ("inputs", "targets", "mask")
    if not isinstance(batch, dict) or any(k not in batch for k in keys):
        got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"language-model batch {got}; accepted: a dict with 'inputs', 'targets' and 'mask' "
                         "arrays of shape [batch, seq] (jmem.data.PackedDataset.batch makes them)")
    shapes = {k: tuple(jnp.shape(batch[k])) for k in keys}
    if len(shapes["inputs"]) != 2 or len(set(shapes.values())) != 1:
        raise ValueError(f"language-model batch shapes {shapes}; accepted: 'inputs', 'targets' and 'mask' all "
                         "of one shape [batch, seq]")
    check_token_ids(batch)


def check_token_ids(batch) -> None:
    """ValueError for a batch of no token ([0, T] or [B, 0]) or non-integer "inputs"/"targets" (shapes and
    dtypes, so also while tracing)."""
    shape = tuple(jnp.shape(batch["inputs"]))
    if 0 in shape:
        raise ValueError(f"batch of shape {list(shape)}; accepted: at least one row of at least one token")
    for k in ("inputs", "targets"):
        if not jnp.issubdtype(jnp.result_type(batch[k]), jnp.integer):
            raise ValueError(f"batch[{k!r}] of dtype {jnp.result_type(batch[k])}; accepted: integer token ids")


def router_loss(model, stats) -> jax.Array:
    """The weighted MoE router losses (`moe_aux_weight` x balancing + `moe_z_weight` x z-loss)."""
    if stats is None:
        return jnp.zeros((), jnp.float32)
    cfg = model.config
    return cfg.moe_aux_weight * stats.aux_loss + cfg.moe_z_weight * stats.z_loss


def lm_loss_sum(model, batch: dict, *, chunk: int | None = None):
    """Next-token loss sum and token count of a Llama-family `model` on a batch.

    For an MoE model the weighted router losses are added as `router_loss x count`,
    so that `loss_sum / count` is the mean cross-entropy plus the router losses
    (and sums over microbatches or data shards stay additive).

    Args:
        model: anything with `hidden(ids) -> (h, cache)` and
            `logits_from_hidden(h) -> f32 logits` (`jmem.models.llama.Llama`).
        batch: {"inputs": i32[B, T], "targets": i32[B, T], "mask": [B, T]}, and optionally
            "input_mask" [B, T] (0 for padding inputs) for an MoE model's routing.
        chunk: sequence chunk for the cross-entropy; `model.config.loss_chunk`
            when None.

    Returns:
        (loss_sum f32[], count f32[])
    """
    s, c, stats = lm_loss_terms(model, batch, chunk=chunk)
    if stats is not None:
        s = s + router_loss(model, stats) * c
    return s, c


def check_windows(windows_NT: np.ndarray, vocab_size: int | None) -> None:
    """ValueError unless `windows_NT` is an integer [n >= 1, T >= 2] array of ids in the vocabulary."""
    if windows_NT.ndim != 2 or windows_NT.shape[0] < 1 or windows_NT.shape[1] < 2:
        raise ValueError(f"windows of shape {windows_NT.shape}; accepted: [n >= 1, T >= 2] token ids (each window's "
                         "first token is context only)")
    if not np.issubdtype(windows_NT.dtype, np.integer):
        raise ValueError(f"windows of dtype {windows_NT.dtype}; accepted: integer token ids")
    if vocab_size is not None and (windows_NT.min() < 0 or windows_NT.max() >= vocab_size):
        bad = windows_NT[(windows_NT < 0) | (windows_NT >= vocab_size)].ravel()[0]
        raise ValueError(f"windows hold token id {int(bad)}; accepted: ids in 0..{vocab_size - 1}")


def window_perplexity(model, windows_NT, batch: int) -> float:
    """exp(mean next-token cross-entropy) over token windows `[n, T]`, `batch` windows per forward.

    Each window's first token is context only; the cross-entropy is chunked over the sequence (no
    full f32 logits; no MoE router losses). An MoE model routes dropless (every token to its
    experts, as in generation): with a capacity, a window's score would depend on the windows
    batched with it.

    Example:
        >>> window_perplexity(model, np.asarray(ids_NT), batch=4)
    """
    import math

    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, ids):
        ids = ids.astype(jnp.int32)
        m = nnx.merge(graphdef, state)
        cfg = getattr(m, "config", None)
        moe = {"dropless": True} if getattr(cfg, "moe_experts", 0) else {}
        h_BTE = m.hidden(ids[:, :-1], **moe)[0]
        chunk = getattr(cfg, "loss_chunk", 1024)
        s, _ = chunked_cross_entropy(h_BTE, ids[:, 1:], jnp.ones(ids[:, 1:].shape, jnp.float32),
                                     m.logits_from_hidden, chunk)
        return s

    windows_NT = np.asarray(windows_NT)
    check_windows(windows_NT, getattr(model.config, "vocab_size", None))
    check_int("batch", batch, 1)
    total = sum(float(nll_sum(state, jnp.asarray(windows_NT[i:i + batch]))) for i in range(0, len(windows_NT), batch))
    return math.exp(total / (windows_NT.shape[0] * (windows_NT.shape[1] - 1)))

"""Mixture-of-experts SwiGLU MLP: top-k router, expert capacity, load-balancing losses.

Tokens pick their `top_k` experts by router probability. Each expert takes at
most `capacity = ceil(capacity_factor * tokens * top_k / n_experts)` tokens;
places are given in position order (every row's token at position 0, then
position 1, ...; a token's choices in rank order), and the assignments past
capacity are dropped (their share of the output is zero, the residual stream
carries the token on). Position order keeps a causal LM causal: whether a
token keeps its place depends only on tokens at its position or before.
(GShard's order, all first choices before any second choice, lets a later
token's first choice take the place of an earlier token's second choice.) Tokens
are scattered to their places in an `[experts, capacity, embed]` buffer and the
expert outputs gathered back, so memory is linear in the tokens (GShard's one-hot
dispatch and combine einsums over `[tokens, experts, capacity]` grow with its
square); the buffer can sit on the `expert` mesh axis (`expert_constraint`).

Dropless routing (`dropless=True`, and every forward with a KV cache in
`jmem.models.llama`): no capacity; the assignments are sorted by expert and
each expert's rows go through one grouped matmul (`jax.lax.ragged_dot`), so
every token gets all of its `top_k` experts whatever the batch holds. That is
what inference needs: a token's output must not depend on how many other
tokens one call routes (a cached decode step routes one token per row, the
prompt's forward all of them).

Losses (returned in `MoEStats`, to be weighted by the caller):
    aux_loss  Switch/GShard load balancing: n_experts * sum_e f_e * P_e, with f_e
              the fraction of routed assignments that chose expert e and P_e the
              mean router probability of e. 1.0 at uniform load.
    z_loss    router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.

Example:
    >>> moe = MoEMLP(64, 128, n_experts=4, top_k=2, rngs=nnx.Rngs(0))
    >>> y, stats = moe(x_BTE)          # stats.aux_loss, stats.z_loss, stats.dropped, stats.load
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from jmem.checks import check_int, is_int, is_number
from jmem.models.config import normal_init
from jmem.models.dot import dot, recompute_weight_in_backward

# Logical axes of the MoE parameters, standalone (`MoEMLP`) and inside a stacked block (`layers.moe`).
MOE_LOGICAL_AXES: dict[str, tuple] = {
    "router.kernel": ("embed", None),
    "expert_gate": ("exp", "embed", "mlp"),
    "expert_up": ("exp", "embed", "mlp"),
    "expert_down": ("exp", "mlp", "embed"),
    "layers.moe.router.kernel": ("layers", "embed", None),
    "layers.moe.expert_gate": ("layers", "exp", "embed", "mlp"),
    "layers.moe.expert_up": ("layers", "exp", "embed", "mlp"),
    "layers.moe.expert_down": ("layers", "exp", "mlp", "embed"),
}


class MoEStats(NamedTuple):
    """Per-call router statistics (scalars f32 unless noted)."""

    aux_loss: jax.Array  # load-balancing loss (1.0 when uniform)
    z_loss: jax.Array  # router z-loss
    dropped: jax.Array  # i32[]: (token, choice) assignments past capacity
    load: jax.Array  # f32[n_experts]: fraction of assignments per expert (before dropping)


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Places per expert: ceil(capacity_factor * n_tokens * top_k / n_experts), at least 1 and at most
    n_tokens (an expert is chosen once per token at most: a larger factor drops nothing more)."""
    check_moe(n_experts, top_k, capacity_factor)
    check_int("moe n_tokens", n_tokens, 1)
    return max(1, min(n_tokens, math.ceil(capacity_factor * n_tokens * top_k / n_experts)))


def check_moe(n_experts: int, top_k: int, capacity_factor: float) -> None:
    """One ValueError naming the first bad MoE setting: n_experts an integer >= 1, top_k an
    integer in 1..n_experts, capacity_factor a finite number > 0 (a bool is neither)."""
    check_int("moe n_experts", n_experts, 1)
    if not (is_int(top_k) and 1 <= top_k <= n_experts):
        raise ValueError(f"moe top_k={top_k!r}; accepted: an integer in 1..n_experts={n_experts}")
    if not (is_number(capacity_factor) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"moe capacity_factor={capacity_factor!r}; accepted: a finite number > 0")


def route(logits_NX, top_k: int, cap: int, *, normalize: bool = True, valid_N=None):
    """Top-k routing with capacity: each (token, choice) gets a place in an `[experts * cap]` buffer.

    Args:
        logits_NX: f32[tokens, experts] router logits, tokens in priority order.
        top_k: experts per token.
        cap: places per expert.
        normalize: rescale the k gates of a token to sum to 1 (top-k > 1).
        valid_N: optional bool[tokens]; a token marked False (padding) takes no place and
            counts in no statistic (its choices are neither placed nor "dropped").

    Returns:
        (slot_NK i32[tokens, top_k]: expert * cap + place, or experts * cap for a choice past
         capacity (dropped); gate_NK f32[tokens, top_k]; MoEStats)
    """
    N, X = logits_NX.shape
    check_moe(X, top_k, 1.0)
    if not (is_int(cap) and cap >= 1):
        raise ValueError(f"moe route cap={cap!r}; accepted: an integer >= 1 (places per expert)")
    probs_NX, gate_NK, idx_NK = _top_k_gates(logits_NX, top_k, normalize)
    valid_Q = jnp.ones((N * top_k,), bool) if valid_N is None else jnp.repeat(valid_N.astype(bool), top_k)
    # Priority: token order, each token's choices in rank order.
    flat_QX = jax.nn.one_hot(idx_NK, X, dtype=jnp.float32).reshape(N * top_k, X) * valid_Q[:, None]
    pos_Q = jnp.sum((jnp.cumsum(flat_QX, axis=0) - 1.0) * flat_QX, axis=-1).astype(jnp.int32)
    keep_Q = (pos_Q < cap) & valid_Q
    slot_NK = jnp.where(keep_Q, idx_NK.reshape(-1) * cap + pos_Q, X * cap).reshape(N, top_k)
    dropped = (jnp.sum(valid_Q) - jnp.sum(keep_Q)).astype(jnp.int32)
    return slot_NK, gate_NK, _stats(logits_NX, probs_NX, flat_QX, dropped, valid_N)


def _stats(logits_NX, probs_NX, flat_QX, dropped, valid_N=None) -> MoEStats:
    """Statistics over the valid tokens (all when `valid_N` is None; `flat_QX` has the invalid
    tokens' rows zeroed already)."""
    w_N = jnp.ones(logits_NX.shape[:1], jnp.float32) if valid_N is None else valid_N.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_N), 1.0)
    load_X = jnp.sum(flat_QX, axis=0) / (n * (flat_QX.shape[0] // logits_NX.shape[0]))
    aux = logits_NX.shape[-1] * jnp.sum(load_X * (jnp.sum(probs_NX * w_N[:, None], axis=0) / n))
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_NX, axis=-1)) * w_N) / n
    return MoEStats(aux, z, dropped, load_X)


def router_logits(x_NE, router_EX):
    """f32 router logits from an f32 copy of the input, whatever the compute dtype: bf16 inputs or logits
    flip near-tied top-k choices (ST-MoE's selective precision; llama.cpp routes in f32 too)."""
    return dot(x_NE.astype(jnp.float32), router_EX)


def _top_k_gates(logits_NX, top_k: int, normalize: bool):
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    gate_NK, idx_NK = jax.lax.top_k(probs_NX, top_k)
    if normalize and top_k > 1:
        gate_NK = gate_NK / jnp.sum(gate_NK, axis=-1, keepdims=True)
    return probs_NX, gate_NK, idx_NK


def _check_shapes(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, token_mask_BT=None) -> tuple[int, int, int]:
    """(B, T, E), or one ValueError naming the first shape that does not fit the others."""
    if token_mask_BT is not None and len(x_BTE.shape) == 3 and tuple(token_mask_BT.shape) != tuple(x_BTE.shape[:2]):
        raise ValueError(f"token_mask_BT of shape {tuple(token_mask_BT.shape)}; accepted: [batch, seq] = "
                         f"{list(x_BTE.shape[:2])}, the input's")
    if len(x_BTE.shape) != 3:
        raise ValueError(f"moe input of shape {tuple(x_BTE.shape)}; accepted: [batch, seq, embed]")
    B, T, E = x_BTE.shape
    if B * T == 0:
        raise ValueError(f"moe input of shape {tuple(x_BTE.shape)}; accepted: at least one token")
    X = router_EX.shape[-1]
    want = {"router": (router_EX.shape, (E, X)), "gate": (gate_XEF.shape, (X, E, None)),
            "up": (up_XEF.shape, (X, E, None)), "down": (down_XFE.shape, (X, None, E))}
    F = gate_XEF.shape[-1] if len(gate_XEF.shape) == 3 else None
    for name, (shape, expected) in want.items():
        expected = tuple(F if d is None else d for d in expected)
        if tuple(shape) != expected:
            raise ValueError(f"moe {name} weight of shape {tuple(shape)}; accepted: {list(expected)} for "
                             f"{X} experts (the router's), embed {E} (the input's) and ffn {F} (gate's)")
    return B, T, E


def expert_array(w):
    """An expert weight as an array. A weight leaf that is not one (ZeRO-3's
    `jmem.parallel.GatheredWeight`, a quantized or GGUF-packed leaf) gives it through
    `__jmem_array__`, so it is gathered or decoded here, inside the layer scan, one layer
    at a time."""
    get = getattr(w, "__jmem_array__", None)
    return w if get is None else get()


def expert_matmul(x, w, matmul, tokens=None):
    """`matmul(x, W)`, `matmul` multiplying rows by each expert's `[in, out]` (batched or grouped), for an
    expert weight leaf `w`. A leaf with `__jmem_expert_dot__(x, matmul, tokens)` (a LoRA adapter, the serving
    engine's per-request adapters) computes its own product from `matmul`, so an adapter runs as two thin
    matmuls, never as a merged weight; `tokens` (i32, one per row of x: the index in [batch * seq] of the
    input row it was routed from, -1 for an empty place) tells it whose row is whose. Any other leaf that is
    not an array (quantized, packed, a ZeRO-3 shard gathered on use) gives its float value again in the
    backward pass (`recompute_weight_in_backward`), not kept."""
    own = getattr(w, "__jmem_expert_dot__", None)
    if own is not None:
        return own(x, matmul, tokens)
    if not isinstance(w, jax.Array):
        return recompute_weight_in_backward(lambda x, w: matmul(x, expert_array(w)))(x, w)
    return matmul(x, expert_array(w))


def moe_mlp(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, *, top_k: int = 2, capacity_factor: float = 1.25,
            normalize: bool = True, expert_constraint=None, dropless: bool = False, token_mask_BT=None):
    """The MoE SwiGLU MLP as a pure function (usable inside a layer scan on one layer's weights).

    Args:
        x_BTE: [batch, seq, embed] activations.
        router_EX: [embed, experts] router kernel (any `dot` weight leaf).
        gate_XEF, up_XEF: [experts, embed, ffn]; down_XFE: [experts, ffn, embed]: arrays, or
            leaves with `__jmem_array__()` (`jmem.parallel.GatheredWeight`, quantized leaves) or
            `__jmem_expert_dot__` (`jmem.lora.LoRA`).
        top_k: experts per token; capacity_factor: see `capacity`.
        normalize: renormalise the top-k gates of each token to sum to 1.
        expert_constraint: optional `f(x[experts, cap, ...]) -> x` applied to the expert
            inputs/outputs (e.g. `jmem.parallel.constrain(x, ("exp", None, None), rules, mesh)`).
        dropless: no capacity (`capacity_factor` and `expert_constraint` unused): grouped
            matmuls over the assignments sorted by expert (`moe_mlp_dropless`).
        token_mask_BT: optional [batch, seq], 0 for padding: padding takes no expert place
            (real tokens of other rows are not dropped for it) and counts in no statistic.

    Returns:
        (y [batch, seq, embed] in x's dtype, MoEStats)
    """
    X = router_EX.shape[-1]
    check_moe(X, top_k, capacity_factor)
    B, T, E = _check_shapes(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, token_mask_BT)
    if dropless:
        return moe_mlp_dropless(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, top_k=top_k, normalize=normalize,
                                token_mask_BT=token_mask_BT)
    cap = capacity(B * T, X, top_k, capacity_factor)
    x_NE = x_BTE.swapaxes(0, 1).reshape(T * B, E)  # position-major: the routing priority
    valid_N = None if token_mask_BT is None else (token_mask_BT.swapaxes(0, 1).reshape(T * B) != 0)
    logits_NX = router_logits(x_NE, router_EX)
    dt = x_NE.dtype
    slot_NK, gate_NK, stats = route(logits_NX, top_k, cap, normalize=normalize, valid_N=valid_N)
    fix = expert_constraint or (lambda v: v)
    # Tokens scattered to their places and gathered back: no [tokens, experts, capacity] one-hot
    # dispatch, whose size grows with the square of the tokens.
    in_XCE = fix(jnp.zeros((X * cap, E), dt).at[slot_NK.reshape(-1)].add(
        jnp.repeat(x_NE, top_k, axis=0), mode="drop").reshape(X, cap, E))

    def matmul(a, w):  # [experts, cap, in] @ [experts, in, out]
        return jnp.einsum("xci,xio->xco", a, w.astype(a.dtype))

    # The input row ([batch * seq] order) of each place; -1 for an empty one.
    n_N = jnp.arange(T * B, dtype=jnp.int32)
    tok_XC = jnp.full((X * cap,), -1, jnp.int32).at[slot_NK.reshape(-1)].set(
        jnp.repeat(n_N % B * T + n_N // B, top_k), mode="drop").reshape(X, cap)
    g_XCF = checkpoint_name(expert_matmul(in_XCE, gate_XEF, matmul, tok_XC), "mlp_gate")
    u_XCF = checkpoint_name(expert_matmul(in_XCE, up_XEF, matmul, tok_XC), "mlp_up")
    h_XCF = checkpoint_name(jax.nn.silu(g_XCF) * u_XCF, "mlp_hidden")
    out_XCE = fix(expert_matmul(h_XCF, down_XFE, matmul, tok_XC))
    out_NKE = jnp.take(out_XCE.reshape(X * cap, E), slot_NK, axis=0, mode="fill", fill_value=0)
    y_NE = jnp.einsum("nke,nk->ne", out_NKE, gate_NK.astype(dt))
    return y_NE.reshape(T, B, E).swapaxes(0, 1), stats


def moe_mlp_dropless(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, *, top_k: int = 2, normalize: bool = True,
                     token_mask_BT=None):
    """`moe_mlp` without capacity: every token gets its `top_k` experts (`token_mask_BT`: as for
    `moe_mlp`, padding counts in no statistic).

    The `tokens * top_k` assignments are sorted by expert; `jax.lax.ragged_dot` runs each
    expert's contiguous rows through its weights (one grouped matmul per projection, FLOPs
    of exactly the routed rows), and the outputs go back to their tokens weighted by the
    gates. `MoEStats.dropped` is 0.

    Example:
        >>> y, stats = moe_mlp_dropless(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, top_k=2)
    """
    X = router_EX.shape[-1]
    check_moe(X, top_k, 1.0)
    B, T, E = _check_shapes(x_BTE, router_EX, gate_XEF, up_XEF, down_XFE, token_mask_BT)
    x_NE = x_BTE.reshape(B * T, E)
    logits_NX = router_logits(x_NE, router_EX)
    probs_NX, gate_NK, idx_NK = _top_k_gates(logits_NX, top_k, normalize)
    expert_Q = idx_NK.reshape(-1)
    order_Q = jnp.argsort(expert_Q, stable=True)  # assignment ids grouped by expert
    sizes_X = jnp.bincount(expert_Q, length=X).astype(jnp.int32)
    in_QE = jnp.take(x_NE, order_Q // top_k, axis=0)

    def matmul(a, w):  # each expert's rows of [assignments, in] @ its [in, out]
        return jax.lax.ragged_dot(a, w.astype(a.dtype), sizes_X)

    tok_Q = (order_Q // top_k).astype(jnp.int32)  # each row's input row
    g_QF = checkpoint_name(expert_matmul(in_QE, gate_XEF, matmul, tok_Q), "mlp_gate")
    u_QF = checkpoint_name(expert_matmul(in_QE, up_XEF, matmul, tok_Q), "mlp_up")
    h_QF = checkpoint_name(jax.nn.silu(g_QF) * u_QF, "mlp_hidden")
    out_QE = expert_matmul(h_QF, down_XFE, matmul, tok_Q)
    out_NKE = jnp.zeros_like(out_QE).at[order_Q].set(out_QE).reshape(B * T, top_k, E)
    y_NE = jnp.einsum("nke,nk->ne", out_NKE, gate_NK.astype(out_NKE.dtype))
    valid_N = None if token_mask_BT is None else token_mask_BT.reshape(B * T) != 0
    flat_QX = jax.nn.one_hot(expert_Q, X, dtype=jnp.float32)
    if valid_N is not None:
        flat_QX = flat_QX * jnp.repeat(valid_N, top_k)[:, None]
    return y_NE.reshape(B, T, E), _stats(logits_NX, probs_NX, flat_QX, jnp.zeros((), jnp.int32), valid_N)


def moe_loss(stats: MoEStats, aux_weight: float = 0.01, z_weight: float = 1e-3):
    """The weighted router losses to add to the training loss."""
    return aux_weight * stats.aux_loss + z_weight * stats.z_loss


class Router(nnx.Module):
    """Holds the router kernel `[*stack, embed, experts]`."""

    def __init__(self, kernel):
        self.kernel = nnx.Param(kernel)


class MoEMLP(nnx.Module):
    """Standalone MoE SwiGLU block: `moe(x [batch, seq, embed]) -> (y, MoEStats)`.

    Parameters: `router.kernel [embed, experts]`, `expert_gate`/`expert_up [experts, embed, ffn]`,
    `expert_down [experts, ffn, embed]` (logical axes in `MOE_LOGICAL_AXES`; `stack=(L,)`
    adds a leading `layers` axis for use in a stacked block).

    Example:
        >>> moe = MoEMLP(64, 128, n_experts=4, top_k=2, rngs=nnx.Rngs(0))
        >>> y, stats = moe(jnp.ones((2, 8, 64)))
    """

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, *, top_k: int = 2, capacity_factor: float = 1.25,
                 stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        check_int("MoEMLP dim", dim, 1)
        check_int("MoEMLP ffn_dim", ffn_dim, 1)
        check_moe(n_experts, top_k, capacity_factor)
        self.top_k, self.capacity_factor = top_k, capacity_factor
        init_in, init_out = normal_init(dim**-0.5), normal_init(ffn_dim**-0.5)
        self.router = Router(init_in(rngs.params(), (*stack, dim, n_experts), dtype))
        self.expert_gate = nnx.Param(init_in(rngs.params(), (*stack, n_experts, dim, ffn_dim), dtype))
        self.expert_up = nnx.Param(init_in(rngs.params(), (*stack, n_experts, dim, ffn_dim), dtype))
        self.expert_down = nnx.Param(init_out(rngs.params(), (*stack, n_experts, ffn_dim, dim), dtype))

    def weights(self) -> dict:
        """The weight arrays by role (stacked when built with `stack`)."""
        return {"router": self.router.kernel.get_value(), "gate": self.expert_gate.get_value(),
                "up": self.expert_up.get_value(), "down": self.expert_down.get_value()}

    def __call__(self, x_BTE, *, expert_constraint=None):
        w = self.weights()
        return moe_mlp(x_BTE, w["router"], w["gate"], w["up"], w["down"], top_k=self.top_k,
                       capacity_factor=self.capacity_factor, expert_constraint=expert_constraint)

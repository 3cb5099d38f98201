"""8-bit Adam: AdamW with block-wise quantized first and second moments.

Each moment of a large parameter is flattened, cut into blocks of
`block_size` values, and stored as one uint8 code per value plus one f32
scale (the block's absolute maximum) per block: about 2 bytes per parameter
for both moments instead of 8, i.e. ~25% of AdamW's state (the idea of
Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization").
Parameters with fewer than `min_8bit_size` elements (norm scales, biases)
keep f32 moments: they are a negligible share of memory and the most
sensitive to error. The size is the leaf's: a layer stack's norm scales
(`[layers, dim]`, 17,280 values in SmolLM2-135M) reach the default and are
quantized, in blocks that may span two layers.

Codes (`code=`):

    ``"dynamic"`` (default)  a 256-entry non-uniform code that spends more
                             values near zero: seven decades below the block
                             maximum, with 2^i linearly spaced values in the
                             i-th decade from the bottom (larger decades get
                             finer steps). Signed for the first moment
                             (with both -1 and +1, so a block's largest value
                             is exact whatever its sign), unsigned for the
                             second.
    ``"linear"``             absmax-linear int8 (255 levels for the first
                             moment, 256 for the second).

With either code the second moment is stored as sqrt(v), whose dynamic range
is the gradients' own, as the first moment's is: v itself spans twice the
decades, so a code that keeps an element's first moment would round its v to
zero, and the next update `m / (sqrt(v) + eps)` would be thousands of times
AdamW's. (Earlier versions stored v with the dynamic code: the train loop
refuses to resume such a checkpoint, whose arrays have the same shapes.)

The update uses the freshly computed (unquantized) moments of this step; only
what is carried to the next step is quantized.

The second moment is requantized with stochastic rounding: sqrt(v) goes to the
code value above it with probability `(y - lo) / (hi - lo)`, else to the one
below, so that it is stored unbiased. Rounded to the nearest code, an element
whose block scale is a neighbour's slowly decaying sqrt(v) (one large gradient
long ago) lost every per-step increment `(1 - b2) * g^2` smaller than half a
code step, and its v stayed far below AdamW's: with one spike of 1 in each
block and a steady 1e-4 beside it, the neighbour's update was 4.9x AdamW's
after 100 steps and 7.0x after 300 (dynamic code; linear: 9.8x, 16x). At
those steps it is 0.66x to 1.31x now, 1.07x and 0.99x averaged over 16 blocks
(linear: 0.13x to 0.48x, smaller than AdamW's: sqrt(v) sits below the code's first step and
is stored as 0 or that step, which overstates v). Each element keeps one of
the two code values bracketing its sqrt(v) for long stretches, so its update
may be off by the gap between them (up to ~35% where the dynamic code passes
from one decade to the next); the noise is a hash of the step count, the leaf
and the element's position (`uniform_noise`): no state, the same on a rerun.
The first moment decays ten times faster and is dominated by recent
gradients: it keeps round-to-nearest (stochastic rounding did not change the
numbers above).

Example:
    >>> tx = adam8bit(1e-3, weight_decay=0.01)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem.checks import check_bool
from jmem.optim import checks

CODES = ("dynamic", "linear")


def dynamic_code(signed: bool) -> np.ndarray:
    """The sorted 256-entry dynamic code in [-1, 1] (signed) or [0, 1] (unsigned).

    Signed: 0, +-1, and +-(2^i midpoints of [0.1, 1] scaled by 10^(i-6)), i=0..6
    (127 magnitudes; the smallest positive one gives way to -1). Unsigned: 0, 1,
    and 2^i midpoints scaled by 10^(i-7), i=1..7 (254 magnitudes).
    """
    check_bool("signed", signed)  # 0 or "x" picked a code silently
    return _dynamic_code(bool(signed))


@functools.lru_cache(maxsize=None)
def _dynamic_code(signed: bool) -> np.ndarray:
    decades = range(0, 7) if signed else range(1, 8)
    top = 6 if signed else 7
    mags = []
    for i in decades:
        edges = np.linspace(0.1, 1.0, 2**i + 1)
        mags.append((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - top))
    mags = np.concatenate(mags)
    values = np.concatenate([[0.0, 1.0, -1.0], mags[1:], -mags] if signed else [[0.0, 1.0], mags])
    values = np.sort(values).astype(np.float32)
    assert values.size == 256, values.size
    return values


class QuantizedMoment(NamedTuple):
    """One block-quantized tensor.

    Attributes:
        codes: u8[n_blocks, block_size] indices into the code (zero-padded tail).
        scales: f32[n_blocks] absolute maximum of each block.
    """

    codes: jax.Array
    scales: jax.Array


def _blocks(x, block_size: int):
    flat = x.reshape(-1).astype(jnp.float32)
    n_blocks = -(-flat.size // block_size)
    if n_blocks * block_size != flat.size:  # a pad copies; a whole number of blocks is a free reshape
        flat = jnp.pad(flat, (0, n_blocks * block_size - flat.size))
    return flat.reshape(n_blocks, block_size)


F32_MAX = float(np.finfo(np.float32).max)
CHUNK_ELEMENTS = 1 << 20
"""Moment values an 8-bit update dequantizes at once (8 MiB of f32 per moment)."""


def quantize(x, *, signed: bool, code: str = "dynamic", block_size: int = 256, noise=None) -> QuantizedMoment:
    """Block-wise quantizes `x` (any shape) to uint8 codes and f32 block scales; `signed=False`
    codes cover [0, max] only (Adam's second moment).

    Each value is divided by its block's absolute maximum and rounded to the nearest code value.
    With `noise` (uniform values in [0, 1), `x`'s shape) it is rounded stochastically instead: to
    the code value above it with probability `(y - lo) / (hi - lo)`, else to the one below (`lo`,
    `hi` the code values bracketing it), which stores `x` unbiased in expectation. A value exactly
    on a code value (the block maximum among them) stays there either way.

    Raises:
        ValueError: `code` not in CODES, `block_size` not an integer >= 1, or (for a concrete `x`)
            negative values with `signed=False`, which the unsigned code would turn into 0.
    """
    checks.one_of("quantize", "code", code, CODES)
    block_size = checks.integer("quantize", "block_size", block_size, 1, shapes=True)
    if not signed and not isinstance(x, jax.core.Tracer) and bool(jnp.any(jnp.asarray(x) < 0)):
        raise ValueError("quantize: x holds negative values with signed=False (its code covers [0, max]); "
                         "accepted: signed=True, or x >= 0")
    x_NB = _blocks(x, block_size)
    scale_N = jnp.max(jnp.abs(x_NB), axis=1)
    y_NB = x_NB / jnp.where(scale_N == 0, 1.0, scale_N)[:, None]  # in [-1, 1]
    if noise is not None:
        idx = _round_stochastically(y_NB, _blocks(noise, block_size), signed=signed, code=code)
    elif code == "linear":
        idx = jnp.round(y_NB * 127.0) + 127.0 if signed else jnp.round(y_NB * 255.0)
    else:
        table = dynamic_code(signed)
        idx = _count_below(y_NB, jnp.asarray((table[1:] + table[:-1]) / 2))
    return QuantizedMoment(idx.astype(jnp.uint8), scale_N.astype(jnp.float32))


def _round_stochastically(y, u, *, signed: bool, code: str):
    """The code index of each `y` in [-1, 1] (or [0, 1]), rounded down or up to the code values
    `lo <= y <= hi` bracketing it: up where `u < (y - lo) / (hi - lo)`, for `u` uniform in [0, 1)."""
    if code == "linear":
        z = y * 127.0 + 127.0 if signed else y * 255.0  # the code index as a real number
        lo = jnp.clip(jnp.floor(z), 0.0, 253.0 if signed else 254.0)
        return lo + (u < z - lo).astype(jnp.float32)
    table = dynamic_code(signed)
    lo = jnp.minimum(_count_below(y, jnp.asarray(table[1:]), inclusive=True), 254)  # table[lo] <= y
    lo_value, hi_value = jnp.asarray(table)[lo], jnp.asarray(table)[lo + 1]
    return lo + (u * (hi_value - lo_value) < y - lo_value).astype(jnp.uint8)


def _count_below(y, midpoints, *, inclusive: bool = False):
    """`jnp.searchsorted(midpoints, y, side="left")` (`side="right"` with `inclusive`: the count of
    values <= y) for 255 sorted values: a branchless binary search, eight elementwise steps that XLA
    fuses into one pass. (searchsorted's "scan" method held six times the input in temporaries: an
    8-bit optimizer's update needed more memory than AdamW's.)"""
    idx = jnp.zeros(y.shape, jnp.uint8)  # 0..255: the code itself
    step = (midpoints.shape[0] + 1) // 2
    while step:
        below = midpoints[idx + step - 1] <= y if inclusive else midpoints[idx + step - 1] < y
        idx = jnp.where(below, idx + step, idx)
        step //= 2
    return idx


def dequantize(q: QuantizedMoment, shape, *, signed: bool, code: str = "dynamic") -> jax.Array:
    """Inverse of `quantize`: f32 array of `shape`.

    Raises:
        ValueError: `code` not in CODES, or `shape`'s element count does not fit the quantized
            blocks (`(n_blocks - 1) * block_size < size <= n_blocks * block_size`).
    """
    checks.one_of("dequantize", "code", code, CODES)
    n_blocks, block_size = q.codes.shape
    size = int(np.prod(shape, dtype=np.int64))
    if not (n_blocks - 1) * block_size < size <= n_blocks * block_size:
        checks.fail("dequantize", "shape", shape,
                    f"a shape of {(n_blocks - 1) * block_size + 1} to {n_blocks * block_size} elements (got {size}): "
                    f"the codes hold {n_blocks} blocks of {block_size}")
    idx = q.codes.astype(jnp.int32)
    if code == "linear":
        y_NB = (idx.astype(jnp.float32) - 127.0) / 127.0 if signed else idx.astype(jnp.float32) / 255.0
    else:
        y_NB = jnp.asarray(dynamic_code(signed))[idx]
    x_NB = y_NB * q.scales[:, None]
    return x_NB.reshape(-1)[:size].reshape(shape)


def quantize_second_moment(v, *, code: str = "dynamic", block_size: int = 256, noise=None) -> QuantizedMoment:
    """Adam's second moment `v` (>= 0) in 8 bits, stored as sqrt(v) (see the module docstring);
    `noise` as `quantize`'s (sqrt(v) rounded stochastically; to the nearest code value without it).

    `v` is clamped to f32's largest value first: a finite gradient above ~1.8e19 squares to inf, and
    an inf block scale would make every other moment of the block 0 * inf = NaN.
    """
    return quantize(jnp.sqrt(jnp.minimum(v, F32_MAX)), signed=False, code=code, block_size=block_size, noise=noise)


def uniform_noise(count, leaf, index) -> jax.Array:
    """Uniform values in [0, 1) (multiples of 2^-24), a fixed function of the step `count`, the leaf
    number `leaf` and each element's flat `index` (integer arrays; the result has `index`'s shape):
    a murmur3 finalizer over uint32 arithmetic, chained through the three inputs, so that different
    steps, leaves and elements draw independent-looking values and a rerun draws the same ones."""
    def mix(h):
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        return h ^ (h >> 16)

    u32 = lambda a: jnp.asarray(a).astype(jnp.uint32)  # noqa: E731 (int32 wraps: the bits are kept)
    key = mix(mix(u32(count) * jnp.uint32(0x9E3779B9) + u32(leaf)) ^ jnp.uint32(0x5BD1E995))
    h = mix(mix(u32(index) * jnp.uint32(0x9E3779B9) ^ key) + key)
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def dequantize_second_moment(q: QuantizedMoment, shape, *, code: str = "dynamic") -> jax.Array:
    """Inverse of `quantize_second_moment`: f32 `v` of `shape`."""
    return jnp.square(dequantize(q, shape, signed=False, code=code))


class ScaleByAdam8bitState(NamedTuple):
    """Adam moments; per leaf a `QuantizedMoment` (large leaves) or an f32 array.

    A quantized second moment holds sqrt(v) (`quantize_second_moment`).
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, block_size: int = 256,
                      min_8bit_size: int = 4096, code: str = "dynamic") -> optax.GradientTransformation:
    """Adam's scaling (`m_hat / (sqrt(v_hat) + eps)`) with 8-bit block-wise moments.

    Raises:
        ValueError: a bad setting (b1 or b2 outside [0, 1), eps < 0, block_size < 1, ...).
    """
    checks.one_of("adam8bit", "code", code, CODES)
    checks.decay("adam8bit", "b1", b1)
    checks.decay("adam8bit", "b2", b2)
    checks.non_negative("adam8bit", "eps", eps)
    block_size = checks.integer("adam8bit", "block_size", block_size, 1, shapes=True)
    min_8bit_size = checks.integer("adam8bit", "min_8bit_size", min_8bit_size, 0, shapes=True)

    def big(x) -> bool:
        return x.size >= min_8bit_size

    def init(params):
        def init_leaf(p, signed):
            if big(p):
                n_blocks = -(-p.size // block_size)
                zero = int(np.argmin(np.abs(dynamic_code(signed)))) if code == "dynamic" else (127 if signed else 0)
                return QuantizedMoment(jnp.full((n_blocks, block_size), zero, jnp.uint8),
                                       jnp.zeros((n_blocks,), jnp.float32))
            return jnp.zeros(p.shape, jnp.float32)

        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), jax.tree.map(lambda p: init_leaf(p, True), params),
                                    jax.tree.map(lambda p: init_leaf(p, False), params))

    def update(updates, state, params=None):
        del params
        treedef = jax.tree.structure(updates)
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        outs, mus, nus = [], [], []

        def moments(g32, m, v):
            return b1 * m + (1 - b1) * g32, b2 * v + (1 - b2) * g32 * g32

        def step(m, v):
            return (m / c1) / (jnp.sqrt(v / c2) + eps)

        def block_update(leaf, args):
            """One block: dequantize its moments, update them, requantize (under `lax.map`). The second
            moment is rounded stochastically, with noise drawn from (count, leaf, block, element)."""
            g_B, mu_B, mu_s, nu_B, nu_s, n = args
            m = dequantize(QuantizedMoment(mu_B[None], mu_s[None]), g_B.shape, signed=True, code=code)
            v = dequantize_second_moment(QuantizedMoment(nu_B[None], nu_s[None]), g_B.shape, code=code)
            m, v = moments(g_B, m, v)
            v = jnp.minimum(v, F32_MAX)  # as stored (a gradient above ~1.8e19 squares to inf)
            noise = uniform_noise(count, leaf, n * block_size + jnp.arange(block_size, dtype=jnp.int32))
            qm = quantize(m, signed=True, code=code, block_size=block_size)
            qv = quantize_second_moment(v, code=code, block_size=block_size, noise=noise)
            return step(m, v), qm.codes[0], qm.scales[0], qv.codes[0], qv.scales[0]

        for leaf, (g, mu, nu) in enumerate(zip(treedef.flatten_up_to(updates), treedef.flatten_up_to(state.mu),
                                               treedef.flatten_up_to(state.nu))):
            if big(g):
                # Block by block, CHUNK_ELEMENTS values at a time: the f32 moments exist for one chunk,
                # not for the whole leaf (XLA kept them for several leaves together: 8x the parameters).
                n_blocks = mu.codes.shape[0]
                u_NB, mu_codes, mu_scales, nu_codes, nu_scales = jax.lax.map(
                    functools.partial(block_update, leaf),
                    (_blocks(g, block_size), mu.codes, mu.scales, nu.codes, nu.scales,
                     jnp.arange(n_blocks, dtype=jnp.int32)),
                    batch_size=max(1, CHUNK_ELEMENTS // block_size))
                outs.append(u_NB.reshape(-1)[: g.size].reshape(g.shape).astype(g.dtype))
                mus.append(QuantizedMoment(mu_codes, mu_scales)), nus.append(QuantizedMoment(nu_codes, nu_scales))
            else:
                m, v = moments(g.astype(jnp.float32), mu, nu)
                outs.append(step(m, v).astype(g.dtype))
                mus.append(m), nus.append(v)
        un = treedef.unflatten
        return un(outs), ScaleByAdam8bitState(count, un(mus), un(nus))

    return optax.GradientTransformation(init, update)


def adam8bit(learning_rate: "float | optax.Schedule", b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
             weight_decay: float = 1e-4, *, mask=None, block_size: int = 256, min_8bit_size: int = 4096,
             code: str = "dynamic") -> optax.GradientTransformation:
    """AdamW with 8-bit block-wise quantized moments (same arguments as `optax.adamw`).

    Args:
        learning_rate: a number >= 0 or a schedule.
        b1, b2, eps: Adam's decays and epsilon.
        weight_decay, mask: decoupled weight decay (as `optax.adamw`).
        block_size: values per quantization block (one f32 scale each).
        min_8bit_size: leaves with fewer elements keep f32 moments.
        code: "dynamic" (default) or "linear"; see the module docstring.

    Returns:
        An `optax.GradientTransformation`:
        `chain(scale_by_adam8bit, add_decayed_weights, scale_by_learning_rate)`.

    Raises:
        ValueError: a bad setting, before anything is built: learning_rate or weight_decay not a
            finite number >= 0 or a schedule (None is refused), b1 or b2 outside [0, 1), eps not a
            finite number >= 0, block_size not an integer >= 1, min_8bit_size not an integer >= 0,
            an unknown code.
    """
    checks.learning_rate("adam8bit", learning_rate)
    checks.rate("adam8bit", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_adam8bit(b1, b2, eps, block_size=block_size, min_8bit_size=min_8bit_size, code=code),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )

"""Pallas dequantize-matmul for 4-bit weights (group-wise int4 and NF4).

`y[M, N] = x[M, K] @ dequant(W)[K, N]` without materialising the float weight:
each program owns one `[block_m, block_n]` output tile and walks the K axis one
quantization group at a time, unpacking nibbles, scaling and accumulating in
f32. The packed layout (`qtensor.pack_bits` with 4 bits) puts rows 2r and 2r+1
in the low and high nibble of byte row r, so instead of interleaving unpacked
rows in the kernel (a reshape Triton does not like) the wrapper splits `x` into
its even and odd columns and the kernel does two dots per group.

The plain path (dequantize then matmul, fused by XLA) is the reference and the
fallback; tests compare the two in interpret mode.

Dispatch (`quantized_dot`, what `IntTensor.__jmem_dot__` and
`NF4Tensor.__jmem_dot__` call): the implementation is chosen when the matmul
is traced, from `matmul_impl(...)` (a context manager over a contextvar):

* "auto" (default): the kernel, compiled, when compiling for a GPU
  (`jmem.kernels.dispatch.target_platform`);
  the XLA path elsewhere (on CPU the interpreter would only be slower; on TPU
  the kernel's tiling has not been checked against Mosaic's rules).
* "pallas": the kernel wherever it can tile the weight (interpreted on CPU).
* "xla": always dequantize-then-dot.

Weights the kernel cannot tile take the XLA path explicitly in every mode: bits
other than 4, a group size that is not a multiple of 32, an output width that
is not a multiple of 8, or a weight with leading (stacked-layers) axes outside
a scan. Leading batch/sequence axes of `x` are folded into rows and the rows
padded to the tile. The backward pass of the kernel path is the XLA path's
(`jax.custom_vjp`), so QLoRA training can run on it.

The choice is read when the matmul is traced, and JAX caches traces per Python
function: a function traced under one choice keeps it. Enter `matmul_impl`
before a function is first traced; to run both paths in one process, trace
two distinct function objects (not the same function jitted twice).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jmem.kernels.dispatch import target_platform
from jmem.kernels.flash_attention import kernel as fk
from jmem.quant.nf4 import NF4_BLOCK, NF4_CODE, NF4Tensor
from jmem.models.dot import decoded_dot, float_input
from jmem.quant.qtensor import IntTensor

MATMUL_IMPLS = ("auto", "pallas", "xla")
# Backends where "auto" picks the compiled kernel.
AUTO_KERNEL_BACKENDS = ("gpu",)
KERNEL_GROUP_MULTIPLE = 32
MIN_BLOCK_M = 16  # smallest tile a GPU dot accepts
MAX_BLOCK_M = 64
MAX_BLOCK_N = 128
MAX_CHUNK = 64  # packed rows (128 weight rows) the kernel dequantizes per loop step


def chunk_rows(half_group: int) -> int:
    """Packed rows per loop step for groups of 2 * half_group rows: the largest power of two that
    divides half_group, at most MAX_CHUNK. Triton loads only power-of-two tiles, so a group of
    576 rows (per-channel scales of a 576-wide input) runs as 9 steps of 32 packed rows, each
    with the group's scale."""
    return min(half_group & -half_group, MAX_CHUNK)  # the lowest set bit


def _nf4_values(c):
    """Code -> NF4 value by a select chain (no gathers inside the kernel)."""
    v = jnp.zeros(c.shape, jnp.float32)
    for i, value in enumerate(NF4_CODE.tolist()):
        v = jnp.where(c == i, jnp.float32(value), v)
    return v


def _kernel(xe_ref, xo_ref, p_ref, s_ref, *rest, group: int, n_chunks: int, nf4: bool, zero_const):
    # xe_ref, xo_ref: [block_m, K/2] even / odd input columns
    # p_ref: u8[K/2, block_n] packed nibbles; s_ref: [K/group, block_n] scales (NF4: absmax)
    # rest: (z_ref u8[K/group, block_n],) when the format has zero points, then o_ref [block_m, block_n]
    z_ref = rest[0] if len(rest) == 2 else None
    o_ref = rest[-1]
    half = group // 2
    step = chunk_rows(half)

    def body(c, acc):
        k = jax.lax.div(c * jnp.int32(step), jnp.int32(half))  # the chunk's group
        rows = pl.ds(pl.multiple_of(c * step, step), step)
        p = p_ref[rows, :].astype(jnp.int32)
        lo, hi = p & 15, p >> 4
        s = s_ref[pl.ds(k, 1), :].astype(jnp.float32)
        if nf4:
            w_lo, w_hi = _nf4_values(lo) * s, _nf4_values(hi) * s
        else:
            z = z_ref[pl.ds(k, 1), :].astype(jnp.float32) if z_ref is not None else jnp.float32(zero_const)
            w_lo, w_hi = (lo.astype(jnp.float32) - z) * s, (hi.astype(jnp.float32) - z) * s
        xe = xe_ref[:, rows]
        xo = xo_ref[:, rows]
        acc += jnp.dot(xe, w_lo.astype(xe.dtype), preferred_element_type=jnp.float32)
        acc += jnp.dot(xo, w_hi.astype(xo.dtype), preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, n_chunks, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


_IMPL: contextvars.ContextVar[str] = contextvars.ContextVar("jmem_quant_matmul_impl", default="auto")


@contextlib.contextmanager
def matmul_impl(impl: str):
    """Choose how quantized weights multiply inside the block: "auto", "pallas" or "xla".

    Read when a matmul is traced (a contextvar, so threads and async tasks
    each keep their own choice); a function already traced keeps its path.

    Example:
        >>> with jmem.quant.matmul_impl("pallas"):     # interpreted on CPU
        ...     logits = jax.jit(lambda m, ids: m(ids)[0])(qmodel, ids)
    """
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl={impl!r}; accepted: {', '.join(MATMUL_IMPLS)}")
    token = _IMPL.set(impl)
    try:
        yield impl
    finally:
        _IMPL.reset(token)


def current_matmul_impl() -> str:
    """The implementation `matmul_impl` selects in this context ("auto" unless set)."""
    return _IMPL.get()


def kernel_unsupported(w, x_features: int | None = None) -> str | None:
    """Why the kernel cannot tile `w` (a short reason), or None when it can."""
    if isinstance(w, NF4Tensor):
        group, n_scales = NF4_BLOCK, None
    elif isinstance(w, IntTensor):
        if w.bits != 4:
            return f"bits={w.bits} (the kernel reads 4-bit codes)"
        group, n_scales = None, w.scale.shape[-2]
    else:
        return f"{type(w).__name__} is not an int4/NF4 leaf"
    if len(w.shape) != 2:
        return f"weight shape {w.shape} has leading axes"
    K, N = w.shape
    if x_features is not None and x_features != K:
        return f"x has {x_features} features, the weight {K}"
    if group is None:
        if K % n_scales:
            return f"{n_scales} groups do not split {K} rows"
        group = K // n_scales
    if group % KERNEL_GROUP_MULTIPLE:
        return f"group size {group} is not a multiple of {KERNEL_GROUP_MULTIPLE}"
    if N % 8:
        return f"output width {N} is not a multiple of 8"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kernel_dot(x, w, interpret: bool):
    return dequant_matmul(x, w, interpret=interpret)


def _kernel_dot_fwd(x, w, interpret: bool):
    return dequant_matmul(x, w, interpret=interpret), (x, w)


def _kernel_dot_bwd(interpret: bool, residuals, g):
    # Pallas calls have no transpose rule; the XLA path's gradient is the same function's.
    x, w = residuals
    _, vjp = jax.vjp(decoded_dot, x, w)
    return vjp(g)


_kernel_dot.defvjp(_kernel_dot_fwd, _kernel_dot_bwd)


def _on_a_mesh() -> bool:
    """Inside a sharded step (`activation_sharding` over several devices): GSPMD cannot split a
    Pallas call, and a weight split over `tensor` would need its partial sums reduced, so "auto"
    leaves those matmuls to XLA, which splits the dequantize and the dot."""
    from jmem.parallel.rules import active_activation_sharding

    active = active_activation_sharding()
    return active is not None and active[1].size > 1


def uses_kernel(x_features: int, w, impl: str | None = None) -> bool:
    """Whether `quantized_dot` takes the kernel for this weight under `impl` (default: the context's)."""
    impl = current_matmul_impl() if impl is None else impl
    if impl == "xla" or (impl == "auto" and (target_platform() not in AUTO_KERNEL_BACKENDS or _on_a_mesh())):
        return False
    return kernel_unsupported(w, x_features) is None


def quantized_dot(x: jax.Array, w: IntTensor | NF4Tensor) -> jax.Array:
    """`x[..., K] @ W[K, N] -> [..., N]` in x's dtype through the kernel or XLA (see `matmul_impl`).

    Example:
        >>> y = quantized_dot(x, IntTensor.quantize(w, bits=4, group_size=128))  # == dot(x, q)

    An integer `x` is promoted to the weight's float dtype first (float32 for
    a non-float one), as `jnp.matmul` promotes it against a float weight.
    """
    x = float_input(x, w.dtype)
    if not uses_kernel(x.shape[-1], w):
        return decoded_dot(x, w)
    interpret = fk.resolve_interpret(None)  # compiled for a GPU/TPU target, interpreted for CPU
    return _kernel_dot(x, w, interpret)


def _block_n(n: int) -> int:
    b = MAX_BLOCK_N
    while b > 8 and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"dequant_matmul needs the output dimension to be a multiple of 8; got {n}")
    return b


@functools.partial(jax.jit, static_argnames=("interpret",))
def dequant_matmul(x: jax.Array, w: IntTensor | NF4Tensor, *, interpret: bool = False) -> jax.Array:
    """`x[..., K] @ W[K, N] -> [..., N]` (dtype of x) for a 4-bit `IntTensor` or an `NF4Tensor`.

    Args:
      x: float[..., K].
      w: a 2-D `IntTensor` with bits=4 (symmetric or with zero points, group
        size a multiple of 32) or a 2-D `NF4Tensor`.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Example:
        >>> y = dequant_matmul(x, IntTensor.quantize(w, bits=4, group_size=128), interpret=True)
    """
    if isinstance(w, NF4Tensor):
        packed, scale, zero, group, nf4, zero_const = w.codes, w.absmax(), None, NF4_BLOCK, True, 0.0
    elif isinstance(w, IntTensor) and w.bits == 4:
        packed, scale, zero, group, nf4 = w.packed, w.scale, w.zero, w.group_size, False
        zero_const = 2.0 ** (w.bits - 1)
    else:
        raise ValueError(f"dequant_matmul accepts a 4-bit IntTensor or an NF4Tensor; got {w!r}")
    if len(w.shape) != 2:
        raise ValueError(f"dequant_matmul needs a 2-D weight [K, N]; got shape {w.shape} (slice stacked layers first)")
    K, N = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight expects {K}")
    if group % 32:
        raise ValueError(f"dequant_matmul needs a group size that is a multiple of 32; got {group}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:  # no row to tile: the grid would be empty and its blocks larger than the input
        return jnp.zeros((*lead, N), x.dtype)
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK_M, pl.next_power_of_2(M)))
    m_pad = -M % block_m
    x2 = jnp.pad(x2, ((0, m_pad), (0, 0)))
    xe, xo = x2[:, 0::2], x2[:, 1::2]
    block_n = _block_n(N)
    n_groups = K // group
    grid = (x2.shape[0] // block_m, N // block_n)

    x_spec = pl.BlockSpec(block_shape=(block_m, K // 2), index_map=lambda i, j: (i, 0))
    in_specs = [x_spec, x_spec,
                pl.BlockSpec(block_shape=(K // 2, block_n), index_map=lambda i, j: (0, j)),
                pl.BlockSpec(block_shape=(n_groups, block_n), index_map=lambda i, j: (0, j))]
    args = [xe, xo, packed, scale]
    if zero is not None:
        in_specs.append(pl.BlockSpec(block_shape=(n_groups, block_n), index_map=lambda i, j: (0, j)))
        args.append(zero)
    kernel = functools.partial(_kernel, group=group, n_chunks=K // 2 // chunk_rows(group // 2), nf4=nf4,
                               zero_const=zero_const)

    def call(platform, *args):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((x2.shape[0], N), x.dtype),
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(block_shape=(block_m, block_n), index_map=lambda i, j: (i, j)),
            compiler_params=fk.compiler_params(platform, grid_rank=2),  # Triton on GPU
            interpret=platform == "interpret",
        )(*args)

    y = fk.per_platform(call, interpret, *args)
    return y[:M].reshape(*lead, N)


def reference_matmul(x: jax.Array, w: IntTensor | NF4Tensor) -> jax.Array:
    """The plain path the kernel must match: dequantize, then matmul in f32."""
    y = jnp.matmul(x.astype(jnp.float32), w.dequantize(jnp.float32))
    return y.astype(x.dtype)

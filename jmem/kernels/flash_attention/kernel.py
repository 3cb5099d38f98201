"""Flash attention (Dao et al., 2022) in Pallas: forward, dq and dk/dv kernels.

Two bodies share the per-tile math below. The whole-row body (GPU, Triton
lowering): each program owns one block of rows and loops over the other
side's blocks with `lax.fori_loop`, so no cross-program accumulation is needed
(Triton cannot revisit outputs). The streaming body (TPU, Mosaic;
`streaming.py`) moves that loop into an "arbitrary" grid axis with the
accumulators in VMEM scratch. Both work in [batch, heads, len, head_dim]
layout because TPU tiles the last two dims; the wrapper transposes and pads
lengths up to block multiples, masking padded keys. `per_platform` picks the
body when lowering, so one traced function compiles for either backend.

Memory: the forward saves only O and the row log-sum-exp (f32[len] per head),
so activations stay O(length). The whole-row body keeps the whole K/V of one
head (forward, dq) or the whole Q/dO of one kv-head group (dk/dv) in on-chip
memory, which on GPU lives in global memory behind the caches; the streaming
body holds a few tiles per program, so on TPU no length bound comes from
VMEM (AOT-compiled for v5e at q_len 4096 with 32/8 heads and at 32768).

head_dim: the Triton lowering (GPU) builds only power-of-two arrays, so inside
the kernel call for GPU a head_dim like 80 or 96 is zero-padded to the next
power of two and the output sliced back (`pad_head_dim`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jmem.checks import check_arrays, check_bool, is_int
from jmem.kernels.scale import split_scale

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
# Smallest tile: bf16 packs 16 rows per TPU sublane tile; Triton wants powers of two.
MIN_BLOCK = 16
NEG_INF = float("-inf")
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def check_qkv(name: str, q, k, v) -> None:
    """Raise ValueError naming the shapes when q/k/v cannot be attended."""
    check_arrays(name, q=q, k=k, v=v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{name} expects q [batch, q_len, q_heads, head_dim] and k/v [batch, kv_len, kv_heads, head_dim]; "
            f"got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{name}: k {k.shape} and v {v.shape} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{name}: q {q.shape} and k {k.shape} must agree in batch (dim 0) and head_dim (dim 3)")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"{name}: q_heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]} (q {q.shape}, k {k.shape})")
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[3] == 0:
        raise ValueError(f"{name}: q_len, kv_len and head_dim must be >= 1; got q {q.shape}, k {k.shape}")
    check_float(name, q=q, k=k, v=v)
    if not q.dtype == k.dtype == v.dtype:  # the kernels' dots take one operand dtype
        raise ValueError(f"{name}: q {q.dtype}, k {k.dtype}, v {v.dtype}; accepted: one floating dtype for all three "
                         "(cast k and v to q's)")


def check_float(name: str, **arrays) -> None:
    """Raise ValueError naming the first array whose dtype is not floating (integer attention is meaningless)."""
    for what, x in arrays.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {what} has dtype {x.dtype}; accepted: a floating dtype")


def effective_block(block: int, length: int, what: str) -> int:
    """The tile size used for `length`: `block`, shrunk for short sequences."""
    if not is_int(block) or block < MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{what}={block!r}; accepted: a power of two >= {MIN_BLOCK}")
    return min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret when compiling for CPU, compile the kernel for a GPU/TPU.

    The platform is the one being compiled for (`jmem.kernels.dispatch.target_platform`),
    so an ahead-of-time compile for a TPU target on a CPU host gets the Mosaic
    kernel. Call it outside any `jax.jit` whose cache would otherwise keep the
    first answer.
    """
    from jmem.kernels.dispatch import target_platform

    if interpret is not None:
        check_bool("interpret", interpret)
    return target_platform() == "cpu" if interpret is None else bool(interpret)


TPU_DTYPES = (jnp.float32, jnp.bfloat16)  # what the Mosaic kernels load: float16 and float64 do not compile


def kernel_dtype_ok(dtype, interpret: bool) -> bool:
    """Whether the kernels compile for `dtype` on the platform being compiled for."""
    from jmem.kernels.dispatch import target_platform

    return interpret or target_platform() != "tpu" or jnp.dtype(dtype) in TPU_DTYPES


def check_kernel_dtype(name: str, dtype, interpret: bool) -> None:
    """ValueError naming `dtype` when the kernel would not compile for it (float16 on a TPU), instead of
    Mosaic's internal error at compile time."""
    if not kernel_dtype_ok(dtype, interpret):
        raise ValueError(f"{name}: dtype {jnp.dtype(dtype)} does not compile for TPU; accepted on TPU: float32, "
                         "bfloat16 (cast q, k and v first)")


def per_platform(call, interpret: bool, *args):
    """`call(platform, *args)`, with platform ("tpu", "gpu", "other") picked when lowering.

    On GPU this selects the Triton lowering explicitly: JAX 0.10's default there,
    Mosaic GPU, warns that `pallas_call` is deprecated for it (and it stages
    whole blocks in shared memory, which the full-K blocks here overflow).
    JAX 0.11 in turn deprecates the Pallas Triton backend, so on 0.11 GPU
    lowering emits that DeprecationWarning; a Mosaic GPU (`plgpu.kernel`)
    version is the way off it. On TPU the platform lets kernels put scalar index
    lists in SMEM. Tracing once and choosing at lowering keeps ahead-of-time
    compilation for another backend working.
    """
    if interpret:
        return call("interpret", *args)
    return lax.platform_dependent(
        *args,
        tpu=functools.partial(call, "tpu"),
        cuda=functools.partial(call, "gpu"),
        rocm=functools.partial(call, "gpu"),
        default=functools.partial(call, "other"),
    )


def gpu_num_warps(head_dim: int) -> int:
    """Warps per program of the flash kernels on a GPU: 8 for heads wider than 64, else 4.

    On an H200 at head_dim 128 (blocks 128 x 128, bf16, causal, 4096 tokens) 8 warps ran the
    forward 1.54x and forward + backward 2.5x faster than 4 (docs/benchmarks.md); heads of 64
    or less keep 4, where each program's tiles are half as wide.
    """
    return 8 if head_dim > 64 else 4


def compiler_params(platform: str, grid_rank: int = 3, gpu_stages: int = 2, gpu_warps: int = 4):
    if platform == "gpu":
        return pltriton.CompilerParams(num_warps=gpu_warps, num_stages=gpu_stages)
    if platform == "tpu":
        # Programs are independent (no cross-step accumulation), so every grid axis may be split.
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
    return None


# ---------------------------------------------------------------- per-tile math
# Shared with the sparse kernel. Shapes: q/do [bq, D], k/v [bk, D], m/l/lse/delta
# [bq, 1] f32, mask bool[bq, bk] or None (tile fully visible).


def fwd_tile(q, k, v, carry, mask, sm_scale):
    """One online-softmax update of (m, l, acc) with a key/value tile."""
    m_prev, l_prev, acc = carry
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # Rows with nothing visible yet keep m = -inf; shift by 0 so exp(-inf) = 0, not NaN.
    m_shift = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp(s - m_shift)
    alpha = jnp.exp(m_prev - m_shift)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l_new, acc


def fwd_init(block_q, head_dim):
    return (
        jnp.full((block_q, 1), NEG_INF, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, head_dim), jnp.float32),
    )


def fwd_finish(carry, o_ref, lse_ref):
    m, l, acc = carry
    empty = l == 0.0  # rows that saw no key: output 0, lse -inf
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))


def bwd_tile(q, k, v, do, lse, delta, mask, sm_scale):
    """Recompute probabilities p and score gradients ds [bq, bk] for one tile."""
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
    p = jnp.exp(s - lse)  # the wrapper maps lse=-inf (empty rows) to +inf, so p = 0
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta)


def dq_update(dq, ds, k, sm_scale):
    return dq + lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * sm_scale


def dkdv_update(dk, dv, p, ds, q, do, sm_scale):
    dv = dv + lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32) * sm_scale
    return dk, dv


# ---------------------------------------------------------------- flash kernels


@dataclasses.dataclass(frozen=True)
class _Cfg:
    causal: bool
    sm_scale: float
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    interpret: bool
    pad_platforms: tuple[str, ...] = ()
    stream_platforms: tuple[str, ...] = ()
    gpu_warps: int = 4


def _tile_mask(cfg: _Cfg, q_block, k_block):
    """bool[bq, bk]: causal visibility and key padding of tile (q_block, k_block)."""
    shape = (cfg.block_q, cfg.block_k)
    cols = k_block * cfg.block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = cols < cfg.kv_len
    if cfg.causal:
        rows = q_block * cfg.block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
        mask = mask & (cols <= rows)
    return mask


def _k_range(cfg: _Cfg, i):
    """For q block i: k blocks [0, n_full) need no mask, [n_full, n_total) do."""
    nk = pl.cdiv(cfg.kv_len, cfg.block_k)
    n_full = cfg.kv_len // cfg.block_k
    if not cfg.causal:
        return n_full, nk
    n_total = jnp.minimum(lax.div((i + 1) * cfg.block_q + cfg.block_k - 1, jnp.int32(cfg.block_k)), nk)
    n_full = jnp.minimum(jnp.minimum(lax.div(i * cfg.block_q + 1, jnp.int32(cfg.block_k)), n_full), n_total)
    return n_full, n_total


def _q_range(cfg: _Cfg, j):
    """For k block j: q blocks [lo, n_masked_end) need a mask, [n_masked_end, nq) do not."""
    nq = pl.cdiv(cfg.q_len, cfg.block_q)
    padded_keys = (j + 1) * cfg.block_k > cfg.kv_len
    if not cfg.causal:
        return 0, lax.select(padded_keys, jnp.int32(nq), jnp.int32(0))
    lo = jnp.minimum(lax.div(j * cfg.block_k, jnp.int32(cfg.block_q)), nq)
    full_from = jnp.minimum(lax.div((j + 1) * cfg.block_k - 1 + cfg.block_q - 1, jnp.int32(cfg.block_q)), nq)
    return lo, lax.select(padded_keys, jnp.int32(nq), full_from)


def kv_tile(ref, t, block_k):
    return ref[pl.ds(pl.multiple_of(t * block_k, block_k), block_k), :]


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Cfg):
    # q_ref [bq, D]; k_ref, v_ref [S_pad, D]; o_ref [bq, D]; lse_ref [bq, 1] f32
    i = pl.program_id(2)
    q = q_ref[...]

    def body(masked):
        def step(t, carry):
            mask = _tile_mask(cfg, i, t) if masked else None
            return fwd_tile(q, kv_tile(k_ref, t, cfg.block_k), kv_tile(v_ref, t, cfg.block_k), carry, mask, cfg.sm_scale)

        return step

    n_full, n_total = _k_range(cfg, i)
    carry = lax.fori_loop(0, n_full, body(False), fwd_init(cfg.block_q, q.shape[-1]))
    carry = lax.fori_loop(n_full, n_total, body(True), carry)
    fwd_finish(carry, o_ref, lse_ref)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Cfg):
    # q_ref, do_ref, dq_ref [bq, D]; k_ref, v_ref [S_pad, D]; lse_ref, delta_ref [bq, 1]
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(masked):
        def step(t, dq):
            k = kv_tile(k_ref, t, cfg.block_k)
            mask = _tile_mask(cfg, i, t) if masked else None
            _, ds = bwd_tile(q, k, kv_tile(v_ref, t, cfg.block_k), do, lse, delta, mask, cfg.sm_scale)
            return dq_update(dq, ds, k, cfg.sm_scale)

        return step

    n_full, n_total = _k_range(cfg, i)
    dq = lax.fori_loop(0, n_full, body(False), jnp.zeros(q.shape, jnp.float32))
    dq = lax.fori_loop(n_full, n_total, body(True), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Cfg, group: int):
    # q_ref, do_ref [G, T_pad, D] (the q heads of this kv head); lse_ref, delta_ref [G, T_pad, 1];
    # k_ref, v_ref, dk_ref, dv_ref [bk, D]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    bq = cfg.block_q

    lo, masked_end = _q_range(cfg, j)
    nq = pl.cdiv(cfg.q_len, bq)

    def per_head(g, acc):
        def body(masked):
            def step(i, acc):
                rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
                q, do = q_ref[g, rows, :], do_ref[g, rows, :]
                mask = _tile_mask(cfg, i, j) if masked else None
                p, ds = bwd_tile(q, k, v, do, lse_ref[g, rows, :], delta_ref[g, rows, :], mask, cfg.sm_scale)
                return dkdv_update(*acc, p, ds, q, do, cfg.sm_scale)

            return step

        acc = lax.fori_loop(lo, masked_end, body(True), acc)
        return lax.fori_loop(masked_end, nq, body(False), acc)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# Platforms that run the streaming bodies (`streaming.py`): K/V and Q/dO tiles pass
# through an "arbitrary" grid axis, so TPU VMEM no longer bounds the length.
STREAM_PLATFORMS = ("tpu",)
# Platforms whose kernel needs a power-of-two head_dim: the Triton lowering builds
# only power-of-two arrays. The wrappers zero-pad head_dim there (see `pad_head_dim`).
POW2_HEAD_DIM_PLATFORMS = ("gpu",)


def pad_head_dim(platform: str, pad_platforms, *arrays):
    """`arrays` with the last (head_dim) axis zero-padded to a power of two when `platform` needs it.

    Zero query/key columns add nothing to q.k, so scores are unchanged; zero
    value (and dO) columns give output (and gradient) columns that the caller
    slices off. The softmax scale stays the one of the real head_dim.
    """
    D = arrays[0].shape[-1]
    Dp = pl.next_power_of_2(D)
    if platform not in pad_platforms or Dp == D:
        return arrays
    return tuple(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Dp - D)]) for x in arrays)


def row_spec(block, D):
    return pl.BlockSpec((None, None, block, D), lambda b, h, i: (b, h, i, 0))


def _fwd_call(q, k, v, cfg: _Cfg):
    B, H, T, D0 = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K

    def call(platform, q, k, v):
        q, k, v = pad_head_dim(platform, cfg.pad_platforms, q, k, v)
        if platform in cfg.stream_platforms:
            from jmem.kernels.flash_attention import streaming

            o, lse = streaming.fwd_call(platform, q, k, v, cfg)
            return o[..., :D0], lse
        D = q.shape[3]
        kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, lax.div(h, jnp.int32(G)), 0, 0))
        o, lse = pl.pallas_call(
            functools.partial(_fwd_kernel, cfg=cfg),
            grid=(B, H, T // cfg.block_q),
            in_specs=[row_spec(cfg.block_q, D), kv_spec, kv_spec],
            out_specs=[row_spec(cfg.block_q, D), row_spec(cfg.block_q, 1)],
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32)],
            interpret=cfg.interpret,
            compiler_params=compiler_params(platform, gpu_warps=cfg.gpu_warps),
            name="flash_fwd",
        )(q, k, v)
        return o[..., :D0], lse

    return per_platform(call, cfg.interpret, q, k, v)


def _bwd_call(q, k, v, o, lse, do, cfg: _Cfg):
    B, H, T, D0 = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    lse = jnp.where(lse == NEG_INF, jnp.inf, lse)
    bq, bk = cfg.block_q, cfg.block_k
    group_spec = lambda last: pl.BlockSpec((None, G, T, last), lambda b, h, j: (b, h, 0, 0))  # noqa: E731

    def call(platform, q, k, v, do, lse, delta):
        q, k, v, do = pad_head_dim(platform, cfg.pad_platforms, q, k, v, do)
        if platform in cfg.stream_platforms:
            from jmem.kernels.flash_attention import streaming

            dq, dk, dv = streaming.bwd_call(platform, q, k, v, do, lse, delta, cfg)
            return dq[..., :D0], dk[..., :D0], dv[..., :D0]
        D = q.shape[3]
        kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, lax.div(h, jnp.int32(G)), 0, 0))
        arrays = (q, k, v, do, lse, delta)
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, cfg=cfg),
            grid=(B, H, T // bq),
            in_specs=[row_spec(bq, D), kv_spec, kv_spec, row_spec(bq, D), row_spec(bq, 1), row_spec(bq, 1)],
            out_specs=row_spec(bq, D),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            interpret=cfg.interpret,
            compiler_params=compiler_params(platform, gpu_warps=cfg.gpu_warps),
            name="flash_dq",
        )(*arrays)
        dk, dv = pl.pallas_call(
            functools.partial(_dkdv_kernel, cfg=cfg, group=G),
            grid=(B, K, S // bk),
            in_specs=[group_spec(D), row_spec(bk, D), row_spec(bk, D), group_spec(D), group_spec(1), group_spec(1)],
            out_specs=[row_spec(bk, D), row_spec(bk, D)],
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            interpret=cfg.interpret,
            compiler_params=compiler_params(platform, gpu_warps=cfg.gpu_warps),
            name="flash_dkdv",
        )(*arrays)
        return dq[..., :D0], dk[..., :D0], dv[..., :D0]

    return per_platform(call, cfg.interpret, q, k, v, do, lse, delta)


def first_order_only(name: str, reference: str, call):
    """`call` (a custom_vjp's forward or backward kernels) with one clear error, instead of Pallas's bare
    assertion, when it is differentiated (gradients of gradients: Hessian-vector products, gradient
    penalties)."""

    @jax.custom_jvp
    def guarded(*args):
        return call(*args)

    @guarded.defjvp
    def _(primals, tangents):
        raise NotImplementedError(f"{name} has first-order gradients only (its own backward kernels, which "
                                  f"have no derivative); accepted for gradients of gradients: {reference}, or "
                                  "LlamaConfig.attention_impl='xla' in a model")

    return guarded


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash_bhtd(q, k, v, cfg):
    return _fwd_call(q, k, v, cfg)[0]


_FLASH_GUARD = ("flash_attention", "jmem.kernels.flash_attention.attention_reference")


def _flash_bhtd_fwd(q, k, v, cfg):
    o, lse = first_order_only(*_FLASH_GUARD, lambda *a: _fwd_call(*a, cfg))(q, k, v)
    return o, (q, k, v, o, lse)


def _flash_bhtd_bwd(cfg, res, do):
    return first_order_only(*_FLASH_GUARD, lambda *a: _bwd_call(*a, cfg))(*res, do)


_flash_bhtd.defvjp(_flash_bhtd_fwd, _flash_bhtd_bwd)


def to_padded_bhtd(x_BTHD, block):
    """[B, T, H, D] -> [B, H, ceil(T/block)*block, D], zero padded."""
    T = x_BTHD.shape[1]
    pad = pl.cdiv(T, block) * block - T
    return jnp.pad(x_BTHD, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    sm_scale=None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    interpret: bool | None = None,
    num_warps: int | None = None,
):
    """Memory-efficient exact attention with grouped-query heads; differentiable (first order).

    Args:
        q: [batch, q_len, q_heads, head_dim], a floating dtype.
        k, v: [batch, kv_len, kv_heads, head_dim]; q_heads must be a multiple of kv_heads.
        causal: query i sees key j only when j <= i (top-left aligned, like the dispatcher).
        sm_scale: softmax scale; 1/sqrt(head_dim) when None. A Python/NumPy/JAX
            scalar, or a traced one (folded into q, see `jmem.kernels.scale`).
        block_q, block_k: tile sizes (powers of two >= 16), shrunk for short sequences.
            Lengths need not be multiples: the wrapper pads and masks.
        interpret: run the kernel in the Pallas interpreter; None picks it when
            the platform compiled for is CPU (see `jmem.kernels.dispatch.compiling_for`).
        num_warps: warps per program of the GPU (Triton) kernels, one of 1, 2, 4, 8, 16;
            None: `gpu_num_warps(head_dim)`. Other platforms ignore it.

    Returns:
        [batch, q_len, q_heads, head_dim] in q's dtype.

    Raises:
        ValueError: bad shapes or dtypes.

    Any head_dim works: lowered for GPU, a head_dim that is not a power of two
    (80, 96) is zero-padded to the next one inside the kernel call.

    Example:
        >>> o = flash_attention(q, k, v, causal=True)
        >>> dq = jax.grad(lambda q: flash_attention(q, k, v).sum())(q)
    """
    check_qkv("flash_attention", q, k, v)
    check_bool("flash_attention: causal", causal)
    T, S, D = q.shape[1], k.shape[1], q.shape[3]
    bq = effective_block(block_q, T, "flash_attention: block_q")
    bk = effective_block(block_k, S, "flash_attention: block_k")
    if num_warps is not None and (not is_int(num_warps) or num_warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"flash_attention: num_warps={num_warps!r}; accepted: None, 1, 2, 4, 8, 16")
    # Resolved here, not inside the jit: the jit cache is keyed on the static
    # value, so `None` resolved at trace time would pin the first platform seen.
    interpret = resolve_interpret(interpret)
    check_kernel_dtype("flash_attention", q.dtype, interpret)
    q, scale = split_scale("flash_attention", q, sm_scale, D)
    if q.size == 0:  # no batch rows or no heads: nothing to attend (the kernel grid would be empty)
        return jnp.zeros(q.shape, q.dtype)
    return _flash_jit(q, k, v, causal=bool(causal), sm_scale=scale, block_q=bq, block_k=bk, interpret=interpret,
                      pad_platforms=POW2_HEAD_DIM_PLATFORMS, stream_platforms=STREAM_PLATFORMS,
                      gpu_warps=int(num_warps or gpu_num_warps(D)))


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_q", "block_k", "interpret", "pad_platforms",
                                             "stream_platforms", "gpu_warps"))
def _flash_jit(q, k, v, *, causal, sm_scale, block_q, block_k, interpret: bool, pad_platforms, stream_platforms,
               gpu_warps: int):
    T, S = q.shape[1], k.shape[1]
    cfg = _Cfg(causal=causal, sm_scale=sm_scale, block_q=block_q, block_k=block_k, q_len=T, kv_len=S,
               interpret=interpret, pad_platforms=tuple(pad_platforms), stream_platforms=tuple(stream_platforms),
               gpu_warps=gpu_warps)
    o = _flash_bhtd(to_padded_bhtd(q, cfg.block_q), to_padded_bhtd(k, cfg.block_k), to_padded_bhtd(v, cfg.block_k), cfg)
    return o.transpose(0, 2, 1, 3)[:, :T]

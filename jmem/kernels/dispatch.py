"""`attention`: one entry point for every attention implementation.

`impl="xla"` is plain jnp (XLA fuses it; also the CPU path), `"reference"` a
name for that same plain path (the kernels' tests compare against it),
`"pallas"` the Pallas flash kernel, and `"auto"` picks Pallas on GPU/TPU and
XLA elsewhere.

The flash kernel knows no per-row `q_offset` or `kv_lengths` (decode against a
cache, padded batches). With either given, and not a concrete all-zero
`q_offset` without `kv_lengths`, `"pallas"` and `"auto"` run the XLA path,
whose memory is O(q_len x kv_len) per head (the score matrix). The model's
cached decode relies on this (one query row against the cache).

"Where" means the platform the traced code will be compiled for, which is not
always the default backend: `jmem.memory.measure(..., target="tpu:v5e:2x2")`
traces on a CPU host for a TPU. `compiling_for("tpu")` names that platform for
everything traced inside it; `target_platform()` reads it (the default backend
outside any such context). The Pallas kernels consult it too, so they lower
to Mosaic for a TPU target and run in the interpreter only for a CPU one.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from jmem.checks import check_arrays, check_bool
from jmem.kernels.scale import check_scale

IMPLS = ("auto", "pallas", "xla", "reference")
PLATFORMS = ("cpu", "gpu", "tpu")
_BACKEND_ALIASES = {"cuda": "gpu", "rocm": "gpu"}

# A contextvar, not a global: a compile for a target in one thread (or task)
# must not change what a concurrent local trace picks.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("jmem_target_platform", default=None)


def target_platform() -> str:
    """The platform code traced now is compiled for: "cpu", "gpu" or "tpu".

    The innermost `compiling_for` context's platform, else `jax.default_backend()`.
    """
    platform = _TARGET_PLATFORM.get()
    if platform is None:
        backend = jax.default_backend()
        platform = _BACKEND_ALIASES.get(backend, backend)
    return platform


@contextlib.contextmanager
def compiling_for(platform: str | None):
    """Trace-time context: kernels traced inside it are lowered for `platform`.

    The choice is made when tracing. JAX's trace caches are keyed on the
    function and its argument types, not on this context, so a function
    already traced outside it with the same argument types may come back
    from the cache: trace it with arguments that carry the target's shardings
    (as `jmem.memory.measure` does) or trace a fresh function.

    Args:
        platform: "cpu", "gpu" or "tpu" (also "cuda"/"rocm"); None leaves the
            current choice unchanged.

    Example:
        >>> with compiling_for("tpu"):
        ...     lowered = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",))
    """
    if platform is None:
        yield
        return
    name = _BACKEND_ALIASES.get(platform, platform) if isinstance(platform, str) else platform
    if name not in PLATFORMS:
        raise ValueError(f"compiling_for platform={platform!r}; accepted: {', '.join(PLATFORMS)}")
    token = _TARGET_PLATFORM.set(name)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def resolve_impl(impl: str, dtype=None) -> str:
    """An attention impl with "auto" resolved: the flash kernel ("pallas") when compiling for a GPU
    or TPU and the kernel compiles for `dtype` there (not float16 on a TPU), "xla" elsewhere (the CPU
    interprets Pallas kernels, only slower)."""
    if impl == "auto":
        from jmem.kernels.flash_attention.kernel import kernel_dtype_ok

        kernel = target_platform() in ("gpu", "tpu") and (dtype is None or kernel_dtype_ok(dtype, False))
        return "pallas" if kernel else "xla"
    return impl


def _check(q, k, v):
    check_arrays("attention", q=q, k=k, v=v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [batch, q_len, q_heads, head_dim] and k/v "
            f"[batch, kv_len, kv_heads, head_dim]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: k {k.shape} and v {v.shape} must match q {q.shape} in batch and head_dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: q_heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]}")
    if k.shape[1] == 0:
        raise ValueError(f"attention: kv_len is 0 (k {k.shape}); accepted: at least one key")
    if q.shape[3] == 0:
        raise ValueError(f"attention: head_dim is 0 (q {q.shape}); accepted: at least 1")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"attention: {name} has dtype {x.dtype}; accepted: a floating dtype")
    if not q.dtype == k.dtype == v.dtype:  # the kernels take one dtype: refused on every platform alike
        raise ValueError(f"attention: q {q.dtype}, k {k.dtype}, v {v.dtype}; accepted: one floating dtype for all "
                         "three (cast them first)")


def _per_row(name: str, value, batch: int, most: int, what: str):
    """`q_offset` / `kv_lengths` as i32[batch]: a scalar is broadcast; anything else must be [batch] ints.

    Concrete values must lie in [0, most] (`what` names the bound); traced ones are not checked.
    """
    if value is None:
        return None
    known = None if isinstance(value, jax.core.Tracer) else np.asarray(value)  # numpy: see `_zero`
    dtype = value.dtype if known is None else known.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"attention: {name} has dtype {dtype}; accepted: integers, one per row")
    flat = np.zeros(0) if known is None else known.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat > most))
    if bad.size:  # checked before the int32 cast below, which would wrap a larger value
        i = int(bad[0])
        raise ValueError(f"attention: {name}{f'[{i}]' if known.ndim else ''}={int(flat[i])}; accepted: integers in "
                         f"[0, {what}={most}]")
    value = jnp.asarray(value)
    if value.ndim == 0:
        return jnp.broadcast_to(value.astype(jnp.int32), (batch,))
    if value.shape != (batch,):
        raise ValueError(f"attention: {name} has shape {value.shape}; accepted: a scalar or [batch]=({batch},)")
    return value.astype(jnp.int32)


def masked_softmax(scores, visible):
    """Softmax over the last axis of f32 `scores` where `visible`; rows with no visible key give zeros, not NaN."""
    scores = jnp.where(visible, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(l == 0, 1.0, l)


def _check_call(q, k, v, causal, q_offset, kv_lengths, sm_scale, mask_TS=None):
    """The inputs every attention impl refuses alike; (q_offset, kv_lengths) as i32[batch] or None."""
    _check(q, k, v)
    check_bool("attention: causal", causal)
    check_scale("attention", sm_scale)  # as every kernel checks it
    if mask_TS is not None and (not hasattr(mask_TS, "shape") or tuple(mask_TS.shape) != (q.shape[1], k.shape[1])):
        raise ValueError(f"attention: mask_TS has shape {getattr(mask_TS, 'shape', type(mask_TS).__name__)}; "
                         f"accepted: a bool array [q_len, kv_len]=({q.shape[1]}, {k.shape[1]})")
    last = np.iinfo(np.int32).max - q.shape[1]  # int32 positions of every query row
    return (_per_row("q_offset", q_offset, q.shape[0], last, "int32 max - q_len"),
            _per_row("kv_lengths", kv_lengths, q.shape[0], k.shape[1], "kv_len"))


def xla_attention(q_BTHD, k_BSKD, v_BSKD, *, causal=True, q_offset=None, kv_lengths=None, sm_scale=None,
                  mask_TS=None):
    """Grouped-query attention in plain jnp; softmax in f32.

    Args:
        q_BTHD: queries [batch, q_len, q_heads, head_dim].
        k_BSKD, v_BSKD: keys/values [batch, kv_len, kv_heads, head_dim].
        causal: key j is visible to query i iff j <= q_offset + i.
        q_offset: i32[batch] absolute position of each row's first query (decode
            with a cache); 0 when None.
        kv_lengths: i32[batch] number of valid keys per row; all when None.
        sm_scale: softmax scale, 1/sqrt(head_dim) when None.
        mask_TS: optional bool[q_len, kv_len], True where query i may see key j
            (combined with the masks above). Rows that see no key give zeros.
    """
    q_offset, kv_lengths = _check_call(q_BTHD, k_BSKD, v_BSKD, causal, q_offset, kv_lengths, sm_scale, mask_TS)
    return _xla_attention(q_BTHD, k_BSKD, v_BSKD, causal, q_offset, kv_lengths, sm_scale, mask_TS)


def _xla_attention(q_BTHD, k_BSKD, v_BSKD, causal, q_offset, kv_lengths, sm_scale, mask_TS):
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    G = H // K
    scale = sm_scale if sm_scale is not None else D**-0.5
    q_BTKGD = q_BTHD.reshape(B, T, K, G, D)
    s_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32) * scale
    mask_BTS = jnp.ones((B, T, S), bool)
    key_pos = jnp.arange(S)
    if causal:
        off = jnp.zeros((B,), jnp.int32) if q_offset is None else q_offset
        q_pos_BT = off[:, None] + jnp.arange(T)[None, :]
        mask_BTS &= key_pos[None, None, :] <= q_pos_BT[:, :, None]
    if kv_lengths is not None:
        mask_BTS &= key_pos[None, None, :] < kv_lengths[:, None, None]
    if mask_TS is not None:
        mask_BTS &= jnp.asarray(mask_TS, bool)[None]
    p = masked_softmax(s_BKGTS, mask_BTS[:, None, None])
    if kv_lengths is not None:  # slots past a row's length may hold stale values: 0 weight times inf is NaN
        v_BSKD = jnp.where((key_pos[None, :] < kv_lengths[:, None])[:, :, None, None], v_BSKD, 0)
    o_BTKGD = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BSKD.dtype), v_BSKD, preferred_element_type=jnp.float32)
    return o_BTKGD.reshape(B, T, H, D).astype(q_BTHD.dtype)


def _zero(q_offset) -> bool:
    """True when `q_offset` is None or concretely all zeros (the flash kernel's own alignment)."""
    if q_offset is None:
        return True
    if isinstance(q_offset, jax.core.Tracer):
        return False
    return not np.any(np.asarray(q_offset))  # numpy: jnp ops would be staged into an enclosing trace


def attention(q, k, v, *, causal=True, q_offset=None, kv_lengths=None, sm_scale=None, impl="auto"):
    """Dispatch attention to an implementation; see `xla_attention` for the arguments.

    `impl="auto"` picks Pallas when the platform being compiled for
    (`target_platform()`) is a GPU or TPU, else XLA. `sm_scale` may be a
    Python/NumPy/JAX scalar or a traced one for every impl. q, k and v share
    one floating dtype, and every impl refuses the same inputs; no query rows
    give an empty output.

    The Pallas flash kernel runs only without `kv_lengths` and with `q_offset`
    None or concretely 0. Otherwise `"pallas"` and `"auto"` run the XLA path,
    which materialises the [q_len, kv_len] scores of each head: cached decode
    (one query row) is cheap there, but a long padded batch with `kv_lengths`
    costs O(T x S) memory.

    Example:
        >>> o = attention(q, k, v, causal=True, impl="xla")
    """
    checked = _check_call(q, k, v, causal, q_offset, kv_lengths, sm_scale)
    kernel_ok = _zero(q_offset) and kv_lengths is None  # the values as given: no op staged into a trace
    q_offset, kv_lengths = checked
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}; accepted: {', '.join(IMPLS)}")
    if impl == "auto":
        impl = resolve_impl(impl, q.dtype) if kernel_ok else "xla"
    if q.shape[1] == 0:  # no query rows: nothing to attend, on every impl
        return jnp.zeros(q.shape, q.dtype)
    if impl == "pallas" and kernel_ok:
        from jmem.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    # Offsets/lengths (decode against a cache, padded rows) go through XLA.
    return _xla_attention(q, k, v, causal, q_offset, kv_lengths, sm_scale, None)


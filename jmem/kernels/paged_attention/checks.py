"""Input validation for the paged kernels, run before any kernel work.

Shapes and dtypes are always checked. Values (block-table entries, lengths)
are checked only when the arrays are concrete: under `jax.jit` they are
tracers and the kernel cannot raise, so the kernels instead clamp table
entries that lie past a sequence's length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmem.checks import check_arrays, is_int

QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANT_DTYPES


def concrete(x) -> np.ndarray | None:
    """`x` as a numpy array when its value is known now, else None (a tracer)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_pages(name: str, q_heads: int, head_dim: int, k_pages, v_pages, k_scale, v_scale):
    """Checks the page pools and their scales against the queries' heads and head_dim."""
    check_arrays(name, k_pages=k_pages, v_pages=v_pages)
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{name}: k_pages and v_pages must both be [kv_heads, num_pages, page_size, head_dim]; "
            f"got k_pages {k_pages.shape}, v_pages {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{name}: k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    kv_heads, num_pages, page_size, page_head_dim = k_pages.shape
    empty = [n for n, size in zip(("kv_heads", "num_pages", "page_size", "head_dim"), k_pages.shape) if size < 1]
    if empty:
        raise ValueError(f"{name}: pages {k_pages.shape} have {', '.join(f'{n}=0' for n in empty)}; accepted: "
                         "[kv_heads, num_pages, page_size, head_dim] pools of sizes >= 1")
    if page_head_dim != head_dim:
        raise ValueError(f"{name}: q head_dim={head_dim} but pages have head_dim={page_head_dim} (pages {k_pages.shape})")
    if q_heads % kv_heads:
        raise ValueError(
            f"{name}: q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (pages {k_pages.shape})"
        )
    dtype = jnp.dtype(k_pages.dtype)
    if dtype not in QUANT_DTYPES + FLOAT_DTYPES:
        raise ValueError(f"{name}: page dtype {dtype} not supported; accepted: float32, bfloat16, float16, int8, float8_e4m3fn")
    quant = dtype in QUANT_DTYPES
    for sname, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if quant and s is None:
            raise ValueError(f"{name}: {dtype} pages need {sname} f32[kv_heads={kv_heads}, num_pages={num_pages}]")
        if not quant and s is not None:
            raise ValueError(f"{name}: {sname} is only for int8/float8_e4m3fn pages; pages are {dtype}")
        if s is not None and not hasattr(s, "shape"):
            raise ValueError(f"{name}: {sname} is a {type(s).__name__}; accepted: an f32 array "
                             f"[kv_heads={kv_heads}, num_pages={num_pages}]")
        if s is not None and tuple(s.shape) != (kv_heads, num_pages):
            raise ValueError(f"{name}: {sname} shape {s.shape} must be [kv_heads, num_pages] = {(kv_heads, num_pages)}")
        if s is not None and s.dtype != jnp.float32:
            raise ValueError(f"{name}: {sname} has dtype {s.dtype}; accepted: float32")


def check_pow2(name: str, what: str, value) -> None:
    """ValueError `name: what=value; accepted: ...` unless `value` is an integer power of two."""
    if not is_int(value) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}: {what}={value!r}; accepted: a power of two >= 1")


def as_array(x):
    """`x` itself when it is an array (NumPy, JAX, tracer), else `np.asarray(x)` (a list of lengths)."""
    return x if hasattr(x, "ndim") else np.asarray(x)


def check_tables(name: str, lengths, block_tables, num_pages: int, page_size: int, *, rows: int | None,
                 lengths_name: str = "lengths", scales: dict | None = None):
    """Checks per-sequence lengths against the block tables and the page pool.

    Args:
        lengths: i32[n] context length of each table row.
        block_tables: i32[n, pages_per_seq].
        rows: expected number of table rows (the batch), or None to skip.
        lengths_name: what the caller calls `lengths`, for error messages.
        scales: {"k_scale": f32[kv_heads, num_pages] or None, ...}: where concrete,
            the scales of every page read must be finite and >= 0 (0: an empty or all-zero page).
    """
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"{name}: block_tables must be int32[batch, pages_per_seq]; got {block_tables.dtype}{list(block_tables.shape)}")
    if block_tables.shape[1] == 0:
        raise ValueError(f"{name}: block_tables {block_tables.dtype}{list(block_tables.shape)} has no page columns; "
                         f"accepted: pages_per_seq >= 1")
    if lengths.ndim != 1 or lengths.shape[0] != block_tables.shape[0] or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name}: {lengths_name} must be int32[{block_tables.shape[0]}] (one per block-table row); "
            f"got {lengths.dtype}{list(lengths.shape)}"
        )
    if rows is not None and block_tables.shape[0] != rows:
        raise ValueError(f"{name}: block_tables has {block_tables.shape[0]} rows but the batch is {rows}")
    lens = concrete(lengths)
    table = concrete(block_tables)
    if lens is None:
        return
    capacity = block_tables.shape[1] * page_size
    if (lens < 0).any() or (lens > capacity).any():
        bad = int(np.flatnonzero((lens < 0) | (lens > capacity))[0])
        raise ValueError(
            f"{name}: {lengths_name}[{bad}]={int(lens[bad])} is outside [0, {capacity}], the "
            f"{block_tables.shape[1]} pages x page_size {page_size} one block-table row covers"
        )
    if table is None:
        return
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page_size)
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        r, c = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"{name}: block_tables[{r}, {c}]={int(table[r, c])} points outside the page pool of "
            f"{num_pages} pages (row {r} has length {int(lens[r])})"
        )
    for sname, scale in (scales or {}).items():
        scale = concrete(scale)
        if scale is None:
            continue
        pages_read = np.unique(table[used])
        read = scale[:, pages_read]
        bad = np.argwhere(~(read >= 0) | ~np.isfinite(read))
        if len(bad):
            head, page = int(bad[0][0]), int(pages_read[bad[0][1]])
            raise ValueError(f"{name}: {sname}[{head}, {page}]={scale[head, page]} on a page read; "
                             "accepted: finite scales >= 0 (as write_pages and append_pages leave them)")

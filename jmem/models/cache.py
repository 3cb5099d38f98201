"""KV caches behind one small protocol, so the model runs unchanged on a contiguous or a paged cache.

A cache is a pytree with three methods:

- `layer_arrays()`: the per-layer arrays, each with a leading `layers` axis (scanned over);
- `attend(layer_arrays, q_BTHD, k_BTKD, v_BTKD, positions_BT) -> (o_BTHD, new_layer_arrays)`:
  writes the new keys/values of one layer and attends over the cache (fields that are
  not per layer, such as block tables, are read from `self`);
- `with_layers(new_arrays) -> cache`.

A cache that counts what it holds also has `next_positions(batch, T)` (the positions a
call without them continues at) and `advanced(positions_BT)` (itself after those
positions were written); the model uses them when present.

A cache may instead be in *per-layer form*: `layer_arrays()` returns a list with one
pytree per layer, and `with_layers` takes such a list. The model runs its blocks as an
unrolled loop over per-layer weights (`jmem.models.llama.unstack_layers`) with it, so
no layer's weights or cache are sliced out of a stacked array (XLA's CPU backend copies
such slices before every matmul, which dominates batch-1 decoding).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jmem.kernels import attention


@flax.struct.dataclass
class ContiguousKVCache:
    """One contiguous slab per layer: k/v `[layers, batch, max_len, kv_heads, head_dim]`.

    Each row writes its tokens at their absolute positions; a query at position p sees
    keys 0..p of its row. `lengths` counts, per row, one past the furthest position
    written: a call without positions continues there (a prefill, then one decode
    step after another, as with Hugging Face's caches). A negative position or one
    past `max_len` is one clear error when positions are concrete; under `jit`
    (traced positions) such a token writes nothing and its output is NaN. Padding
    written past a row's end is overwritten before any query can see it, because
    queries only look backwards.

    Example:
        >>> cache = ContiguousKVCache.create(config, batch=2, max_len=128)
        >>> logits, cache = model(ids, positions=pos, cache=cache)
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    impl: str = flax.struct.field(pytree_node=False, default="xla")
    lengths: jax.Array | None = None  # i32[batch]; None: not counted (calls without positions start at 0)

    @classmethod
    def create(cls, config, batch: int, max_len: int, dtype=None, per_layer: bool = False) -> "ContiguousKVCache":
        """Zeroed cache; `per_layer=True` keeps one `[batch, max_len, kv_heads, head_dim]` array per
        layer (for the unrolled layer loop) instead of one stacked array."""
        from jmem.checks import check_int
        from jmem.models.config import as_dtype

        check_int("batch", batch, 1)
        check_int("max_len", max_len, 1)
        dtype = as_dtype(dtype or config.compute_dtype)
        shape = (batch, max_len, config.n_kv_heads, config.head_dim)
        impl = "xla" if config.attention_impl in ("auto", "pallas") else config.attention_impl
        lengths = jnp.zeros((batch,), jnp.int32)
        if per_layer:
            zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
            return cls(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)), impl, lengths)
        shape = (config.n_layers, *shape)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), impl, lengths)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1] if self.per_layer else self.k.shape[2]

    def layer_arrays(self):
        return list(zip(self.k, self.v)) if self.per_layer else (self.k, self.v)

    def with_layers(self, arrays) -> "ContiguousKVCache":
        if isinstance(arrays, list):
            return self.replace(k=tuple(k for k, _ in arrays), v=tuple(v for _, v in arrays))
        return self.replace(k=arrays[0], v=arrays[1])

    def next_positions(self, batch: int, T: int):
        """i32[batch, T]: T new tokens of each row right after the furthest position it has written."""
        new_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))
        if self.lengths is None or self.lengths.shape != (batch,):  # another batch: `attend` names the mismatch
            return new_BT
        return self.lengths[:, None] + new_BT

    def advanced(self, positions_BT) -> "ContiguousKVCache":
        """This cache after `positions_BT` were written: `lengths` past the furthest of each row."""
        if self.lengths is None or positions_BT.shape[1] == 0:
            return self
        furthest_B = jnp.clip(jnp.max(positions_BT, axis=1) + 1, 0, self.max_len).astype(jnp.int32)
        return self.replace(lengths=jnp.maximum(self.lengths, furthest_B))

    def attend(self, layer_arrays, q_BTHD, k_BTKD, v_BTKD, positions_BT):
        k_BSKD, v_BSKD = layer_arrays
        S, T = k_BSKD.shape[1], q_BTHD.shape[1]
        if k_BSKD.shape[0] != k_BTKD.shape[0] or k_BSKD.shape[2:] != k_BTKD.shape[2:]:
            held, written = [k_BSKD.shape[0], *k_BSKD.shape[2:]], [k_BTKD.shape[0], *k_BTKD.shape[2:]]
            raise ValueError(f"the KV cache holds [batch, kv_heads, head_dim] = {held}, the model writes {written}; "
                             "accepted: a cache created for this model's config and batch")
        try:  # concrete positions are checked; traced ones (under jit) only by their count
            host = np.asarray(positions_BT)
            first, last = int(host.min()), int(host.max())
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            first = last = None
        if first is not None and first < 0:
            raise ValueError(f"position {first} is negative; accepted: positions 0..{S - 1}")
        if T > S or (last is not None and last >= S):
            shown = f"positions up to {last}" if last is not None else f"{T} new tokens"
            raise ValueError(f"{shown} do not fit a KV cache of max_len={S} (writes past it would be lost); "
                             f"accepted: positions 0..{S - 1}, a larger cache")
        rows = jnp.arange(q_BTHD.shape[0])[:, None]
        inside_BT = (positions_BT >= 0) & (positions_BT < S)
        slots_BT = jnp.where(inside_BT, positions_BT, S)  # a negative index would wrap to the last slots: dropped
        k_BSKD = k_BSKD.at[rows, slots_BT].set(k_BTKD.astype(k_BSKD.dtype), mode="drop")
        v_BSKD = v_BSKD.at[rows, slots_BT].set(v_BTKD.astype(v_BSKD.dtype), mode="drop")
        o = attention(q_BTHD, k_BSKD.astype(q_BTHD.dtype), v_BSKD.astype(q_BTHD.dtype), causal=True,
                      q_offset=positions_BT[:, 0], impl=self.impl)
        if last is None:  # traced positions cannot raise: a token whose write was lost gets NaN, not a wrong value
            o = jnp.where(inside_BT[:, :, None, None], o, jnp.nan)
        return o, (k_BSKD, v_BSKD)

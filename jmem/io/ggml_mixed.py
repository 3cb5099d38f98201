"""`MixedGGMLWeight`: stacked GGUF layers whose block types differ, kept packed.

llama.cpp's `*_K_M` files store a matrix in different block types across
layers (Q6_K in some `attn_v` / `ffn_down` layers, Q4_K in the others). A
stacked `GGMLWeight` has one type, so these layers are held as one byte array
`u8[L, out, width]` (each layer's rows zero-padded to the widest type's row
bytes) plus an int32 type index per layer. Slicing the layer axis (a
`lax.scan`, or `w[i]` in the unrolled CPU path) gives one layer whose dot
decodes its own type under `lax.switch`, so only that type's decoder runs.
Padding costs at most the gap between the widest and narrowest row (Q4_K rows
in a Q6_K-width array: 6.6 instead of 4.5 bits per weight), far below float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jmem.models.dot import decoded_dot
from jmem.quant import ggml
from jmem.quant.ggml_weight import GGMLWeight, PackedRows


def _row_bytes(qtype, in_features: int) -> int:
    fmt = ggml.FORMATS[qtype]
    return in_features // fmt.block_size * fmt.type_size


@jax.tree_util.register_pytree_node_class
class MixedGGMLWeight(PackedRows):
    """Linear kernels K[L, in, out] of GGML blocks whose type varies with the layer.

    Attributes:
        raw: u8[..., out, width]: layer i's rows in their own type, zero-padded to `width`.
        kind: i32[...]: index into `qtypes` of each matrix's type (raw's leading axes).
        qtypes: the block types present (static).
        in_features: the kernels' input width (static).

    Example:
        >>> w = MixedGGMLWeight.from_layers([raw0_Q6K, raw1_Q4K], ["Q6_K", "Q4_K"], in_features=256)
        >>> y = jmem.models.dot.dot(x, w[1])  # layer 1 decodes as Q4_K
    """

    def __init__(self, raw, kind, qtypes, in_features: int):
        self.raw, self.kind = raw, kind
        self.qtypes = tuple(ggml.resolve_qtype(q) for q in qtypes)
        self.in_features = int(in_features)

    def tree_flatten(self):
        return (self.raw, self.kind), (self.qtypes, self.in_features)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.raw, obj.kind = children
        obj.qtypes, obj.in_features = aux
        return obj

    @classmethod
    def from_layers(cls, raws: list[np.ndarray], qtypes: list, in_features: int) -> "MixedGGMLWeight":
        """Stack per-layer raw blocks u8[..., out, row_bytes(type_i)] of the given types (`...`: the
        same leading axes in every layer, such as a mixture-of-experts layer's experts)."""
        raws, qtypes = list(raws), list(qtypes)
        if not raws or len(raws) != len(qtypes):
            raise ValueError(f"MixedGGMLWeight.from_layers: {len(raws)} layers and {len(qtypes)} types; accepted: "
                             "one block type per layer, at least one layer")
        types = tuple(dict.fromkeys(ggml.resolve_qtype(q) for q in qtypes))
        for r, q in zip(raws, qtypes):
            want = _row_bytes(ggml.resolve_qtype(q), in_features)
            if r.dtype != np.uint8 or r.ndim < 2 or r.shape[-1] != want:
                raise ValueError(f"MixedGGMLWeight layer of type {ggml.resolve_qtype(q).name} must be u8[..., out, "
                                 f"{want}] for {in_features} inputs; got {r.dtype}{list(r.shape)}")
        rows = [r.shape[:-1] for r in raws]
        if len(set(rows)) > 1:
            shown = ", ".join("x".join(map(str, r)) for r in rows)
            raise ValueError(f"MixedGGMLWeight.from_layers: layers of [{shown}] rows; accepted: one output size")
        width = max(r.shape[-1] for r in raws)
        raw = np.zeros((len(raws), *rows[0], width), np.uint8)
        for i, r in enumerate(raws):
            raw[i, ..., : r.shape[-1]] = r
        # One type index per decoded matrix: per layer, repeated over its leading axes.
        kind = np.array([np.full(rows[0][:-1], types.index(ggml.resolve_qtype(q))) for q in qtypes], np.int32)
        return cls(raw, kind, types, in_features)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.raw.shape)) + int(np.prod(np.shape(self.kind))) * 4

    def layer_types(self) -> list[str]:
        """The block type name of each matrix, layer by layer (and expert by expert within a layer)."""
        return [self.qtypes[int(k)].name for k in np.asarray(self.kind).reshape(-1)]

    def layer(self, i: int) -> GGMLWeight:
        """Layer i as a plain `GGMLWeight` (its own type, unpadded; all of a layer's experts share it)."""
        kinds = np.unique(np.asarray(self.kind)[i])
        if len(kinds) != 1:
            raise ValueError(f"layer {i} mixes block types {'/'.join(self.qtypes[k].name for k in kinds)} across "
                             "its experts; accepted: one block type per layer")
        qt = self.qtypes[int(kinds[0])]
        return GGMLWeight(np.asarray(self.raw[i])[..., : _row_bytes(qt, self.in_features)], qt)

    def __getitem__(self, index) -> "MixedGGMLWeight":
        """`w[...]` is `w` (as `nnx.Param` reads values); `w[i]` picks layer i."""
        if index is Ellipsis or index == (Ellipsis,):
            return self
        return MixedGGMLWeight.tree_unflatten((self.qtypes, self.in_features), (self.raw[index], self.kind[index]))

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """Output rows on `cols`. Each layer's bytes sit at offsets of its own block type, so no one cut
        of the padded width splits every layer's input rows: refused for `row_pieces` > 1."""
        if row_pieces > 1:
            raise ValueError(f"its layers mix GGML block types ({'/'.join(q.name for q in self.qtypes)}), whose "
                             f"input rows do not split at one byte offset; accepted: input rows whole (load the "
                             f"file dequantized, or re-quantize it to one block type with `jmem quantize`)")
        return MixedGGMLWeight.tree_unflatten((self.qtypes, self.in_features), (P(*lead, cols, None), P(*lead)))

    def _decode_OI(self, raw, kind) -> jax.Array:
        """f32[out, in] of one layer: its own type's decoder, picked at run time."""
        branches = [lambda r, q=q: ggml.dequantize(r[:, : _row_bytes(q, self.in_features)], q) for q in self.qtypes]
        return jax.lax.switch(kind, branches, raw)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float kernel K[..., in, out] in `dtype`."""
        lead = self.raw.shape[:-2]
        raw = self.raw.reshape(-1, *self.raw.shape[-2:])
        kind = jnp.reshape(self.kind, (-1,))
        w = jnp.stack([self._decode_OI(raw[i], kind[i]) for i in range(raw.shape[0])])
        return jnp.swapaxes(w.reshape(*lead, self.out_features, self.in_features), -1, -2).astype(dtype)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        """`x[..., in] @ K[in, out]` for one layer (slice the stacked axis first)."""
        if self.raw.ndim != 2:
            raise ValueError(f"MixedGGMLWeight dot needs one layer's weight u8[out, width], got raw shape "
                             f"{self.raw.shape}; slice the stacked layers axis first")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} input features, the weight has {self.in_features}")
        return decoded_dot(x, self)

    def __repr__(self) -> str:
        raw = getattr(self.raw, "shape", self.raw)
        return f"MixedGGMLWeight({'/'.join(q.name for q in self.qtypes)}, raw={raw})"

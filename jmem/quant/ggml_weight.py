"""`GGMLWeight`: a GGUF tensor kept packed in its llama.cpp block format.

GGUF stores a linear weight as W[out, in], each row `in` weights long, packed
into blocks (`jmem.quant.ggml`). The model computes `x[..., in] @ K[in, out]`
through `jmem.models.dot.dot`, so this leaf implements `__jmem_dot__` as
`x @ dequantize(raw).T`: the weights stay packed in memory (4.5 bits per
weight for Q4_0 instead of 32) and are decoded inside the jitted step, where
XLA fuses the decode with its consumer.

The only child is the raw byte array; the qtype is static. Every shape is
derived from `raw`, so stacking layers on a leading axis and slicing it with
`jax.lax.scan` yields per-layer `GGMLWeight`s with no extra bookkeeping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jmem.models.dot import check_row_split, decoded_dot
from jmem.quant import ggml
from jmem.quant.ggml_quantize import quantize
from jmem.quant.qtensor import check_finite


class PackedRows:
    """Shape properties shared by kernels stored as packed rows `raw: u8[..., out, bytes]` of W = K^T.

    Subclasses define `in_features`; the float kernel they stand for is K[..., in, out] in f32.
    """

    @property
    def out_features(self) -> int:
        return self.raw.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the equivalent float kernel: (..., in, out)."""
        return (*self.raw.shape[:-2], self.in_features, self.out_features)

    @property
    def ndim(self) -> int:
        return self.raw.ndim

    @property
    def dtype(self):
        """The dtype the weights decode to."""
        return jnp.dtype(jnp.float32)

    def __jmem_array__(self) -> jax.Array:
        """The float kernel K[..., in, out] (f32), for code that reads a weight whole rather than through
        `dot` (`jmem.models.moe.moe_mlp`'s expert weights, one layer at a time inside the scan)."""
        return self.dequantize()


@jax.tree_util.register_pytree_node_class
class GGMLWeight(PackedRows):
    """A linear kernel K[..., in, out] stored as GGML blocks of W = K^T.

    Attributes:
        raw: u8[..., out, row_bytes], `row_bytes = in / block_size * type_size`;
            leading axes (e.g. stacked layers) are allowed.
        qtype: the `gguf.GGMLQuantizationType` (static pytree aux data).

    Example:
        >>> w = GGMLWeight.from_float(np.random.randn(256, 64).astype(np.float32), "Q4_K")
        >>> y = jmem.models.dot.dot(jnp.ones((2, 256)), w)  # f32[2, 64]
        >>> w.nbytes  # 64 rows * 144 bytes: 4.5 bits per weight
        9216
    """

    def __init__(self, raw, qtype):
        qt = ggml.resolve_qtype(qtype)
        fmt = ggml.FORMATS[qt]
        if getattr(raw, "dtype", None) != np.uint8:
            raise ValueError(f"GGMLWeight raw must be uint8 blocks, got dtype {getattr(raw, 'dtype', type(raw))}")
        if raw.ndim < 2 or raw.shape[-1] % fmt.type_size:
            raise ValueError(
                f"GGMLWeight raw must be u8[..., out, k * {fmt.type_size}] for {qt.name}, got shape {raw.shape}"
            )
        self.raw = raw
        self.qtype = qt

    # --- pytree: the raw bytes are the only child; no validation here, since
    # transformations rebuild the node with tracers or placeholders.
    def tree_flatten(self):
        return (self.raw,), self.qtype

    @classmethod
    def tree_unflatten(cls, qtype, children):
        obj = object.__new__(cls)
        (obj.raw,) = children
        # A saved directory's manifest stores the type as its number: the enum again (its name is used).
        obj.qtype = qtype if isinstance(qtype, ggml.T) else ggml.resolve_qtype(qtype)
        return obj

    @classmethod
    def from_float(cls, w_in_out, qtype) -> "GGMLWeight":
        """Quantize a float kernel f32[..., in, out] (numpy, offline); `in` a multiple of the block size."""
        w = np.asarray(w_in_out, dtype=np.float32)
        if w.ndim < 2:
            raise ValueError(f"from_float needs a kernel [..., in, out], got shape {w.shape}")
        check_finite(w, "the weight w_in_out")
        raw = quantize(np.swapaxes(w, -1, -2), qtype)
        return cls(jnp.asarray(raw), qtype)

    @property
    def in_features(self) -> int:
        fmt = ggml.FORMATS[self.qtype]
        return self.raw.shape[-1] // fmt.type_size * fmt.block_size

    @property
    def nbytes(self) -> int:
        """Stored bytes (the packed blocks, scales included)."""
        return int(np.prod(self.raw.shape))

    @property
    def bits_per_weight(self) -> float:
        return ggml.FORMATS[self.qtype].bits_per_weight

    def __getitem__(self, index) -> "GGMLWeight":
        """`w[...]` is `w` (as `nnx.Param` reads values); `w[i]` picks layer i of a stacked weight."""
        if index is Ellipsis or index == (Ellipsis,):
            return self
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in idx) or len(idx) > self.raw.ndim - 2:
            raise IndexError(
                f"GGMLWeight only indexes its leading (stacked) axes, {self.raw.ndim - 2} here; got {index!r}"
            )
        return GGMLWeight.tree_unflatten(self.qtype, (self.raw[index],))

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """Raw rows `[..., out, bytes]`: output rows on `cols`, each row's bytes on `rows` in whole blocks."""
        fmt = ggml.FORMATS[self.qtype]
        check_row_split(self.in_features, row_pieces, fmt.block_size,
                        f"{self.qtype.name} blocks of {fmt.block_size} weights")
        return GGMLWeight.tree_unflatten(self.qtype, (P(*lead, cols, rows),))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float kernel K[..., in, out] in `dtype`."""
        return jnp.swapaxes(ggml.dequantize(self.raw, self.qtype), -1, -2).astype(dtype)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        """`x[..., in] @ K[in, out] -> [..., out]` in `x.dtype`, accumulating in f32 (as `dot`)."""
        if self.raw.ndim != 2:
            raise ValueError(
                f"GGMLWeight dot needs one layer's weight u8[out, row_bytes], got raw shape {self.raw.shape}; "
                "slice the stacked layers axis first"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} input features, the {self.qtype.name} weight has {self.in_features}")
        return decoded_dot(x, self)

    def __repr__(self) -> str:
        # Tree utilities may rebuild the node around a placeholder (a shape, None), so only
        # describe what is there.
        raw = getattr(self.raw, "shape", self.raw)
        return f"GGMLWeight({self.qtype.name}, raw={raw})"


def quantize_gguf_blocks(model, qtype, *, inplace: bool = False, log=None):
    """Store a float Llama model's linear kernels (and a mixture-of-experts block's experts, as
    `quantize` does) as packed `GGMLWeight`s of GGML type `qtype`.

    A k-quant whose 256-weight super-block does not divide a kernel's input
    dimension falls back as llama.cpp does (`ggml.fitting_qtype`: Q4_K ->
    Q5_0, Q6_K -> Q8_0, ...), with one `log` line per substitution.
    Embeddings, norms and the output head stay float.

    Args:
      model: a float `jmem.models.Llama` (layers stacked on a leading axis).
      qtype: a GGML block type name or enum (Q4_0, Q4_K, Q6_K, Q8_0, ...).
      inplace: modify `model` instead of a copy.
      log: optional callable taking each substitution line (e.g. `print`).

    Returns:
      (model, types): the quantized model and the GGML type name each linear got.

    Raises:
      ValueError: an unsupported type, an already quantized model, or a row a
        non-k-quant block does not divide; before any kernel is quantized.

    Example:
        >>> qmodel, types = quantize_gguf_blocks(smollm2, "Q4_K", log=print)
        >>> types["wq"], types["w_down"]
        ('Q5_0', 'Q4_K')
    """
    from flax import nnx

    from jmem.quant.api import check_float_model, quant_targets

    qt = ggml.resolve_qtype(qtype)
    weights = check_float_model(model)
    plan = {}
    for name in weights:
        n_in = weights[name].shape[-2]
        used = ggml.fitting_qtype(qt, n_in)
        if n_in % ggml.FORMATS[used].block_size:
            raise ValueError(f"{name}: input dimension {n_in} is not a multiple of the {used.name} block size "
                             f"{ggml.FORMATS[used].block_size}; accepted: a type whose block divides {n_in}")
        plan[name] = (n_in, used.name)
    for line in ggml.fallback_lines(qt, plan):
        if log is not None:
            log(line)
    if not inplace:
        model = nnx.clone(model)
    targets = quant_targets(model)
    for name, (_, used) in plan.items():
        targets[name].set_value(GGMLWeight.from_float(np.asarray(targets[name].get_value()), used))
    return model, {name: used for name, (_, used) in plan.items()}

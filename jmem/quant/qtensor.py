"""Quantized weight leaves: pytrees that stand in for a float `[in, out]` kernel.

Every leaf implements `__jmem_dot__(x)` (so `jmem.models.dot.dot` dispatches to
it), `dequantize(dtype)` and `nbytes`. Shapes are derived from the child
arrays only, never from static aux data, so a leaf whose children carry a
leading stacked-layers axis `L` is sliced correctly by `jax.lax.scan` and by
`leaf[i]`.

Formats (the float8 and NF4 leaves live in `fp8.py` and `nf4.py`):

* `IntTensor`: integers of 2, 3, 4 or 8 bits, bit-packed 8 values into `bits`
  bytes along the input axis, with one f16 scale (and optionally one uint8
  zero point) per group of `group_size` input rows and output column. Per
  channel is the special case of one group spanning all input rows.
* `NF4Tensor`: the 4-bit NormalFloat code book, absmax per block of 64 input
  rows, the absmax itself quantized to int8 in blocks of 256 (double
  quantization).
* `FP8Tensor`: float8 e4m3 values with one f32 scale per output column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jmem.checks import check_bool, is_int
from jmem.models.dot import check_row_split, decoded_dot

# Packing: 8 consecutive input rows form one word of `8 * bits` bits, stored
# as `bits` little-endian bytes. For 4 bits byte r then holds rows 2r (low
# nibble) and 2r + 1 (high nibble), the layout the Pallas kernel reads.
PACK_ROWS = 8
SUPPORTED_INT_BITS = (2, 3, 4, 8)
PACK_BITS = (1, 2, 3, 4, 8)
# Scales (and GGUF's F16 values and block scales) are f16: finite values up to this, subnormals down to the next.
F16_MAX = float(np.finfo(np.float16).max)
F16_TINY = float(np.finfo(np.float16).smallest_subnormal)


class QTensor:
    """Base class: shape helpers, slicing of leading axes, the dot."""

    # What a train step that would update the weight says (`jmem.lora.trainable_split`).
    UNTRAINABLE = ("a quantized base", "adapters_only=True with LoRA adapters (QLoRA), or a float model")

    def dequantize(self, dtype=None) -> jax.Array:  # pragma: no cover - abstract
        raise NotImplementedError

    def _children(self) -> tuple:
        return self.tree_flatten()[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored array (what the weight costs in memory)."""
        return int(sum(np.prod(c.shape) * jnp.dtype(c.dtype).itemsize for c in self._children()))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __getitem__(self, index):
        """Index the leading (stacked-layers) axes of every child alike."""
        return jax.tree_util.tree_map(lambda c: c[index], self)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        """`x[..., in] @ W[in, out]`, dequantizing inside the traced step (and again in the backward pass)."""
        return decoded_dot(x, self)

    def __jmem_array__(self) -> jax.Array:
        """The float weight in the leaf's dtype, for code that reads a weight whole rather than through
        `dot` (`jmem.models.moe.moe_mlp`'s expert weights, one layer at a time inside the scan)."""
        return self.dequantize()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, {self._describe()}, nbytes={self.nbytes})"

    def _describe(self) -> str:
        return ""


# --------------------------------------------------------------------------- int


def pack_bits(u: np.ndarray | jax.Array, bits: int) -> jax.Array:
    """Pack unsigned codes `[..., in, out]` (values < 2**bits) into uint8 `[..., in*bits/8, out]`."""
    check_codes(u, bits)
    u = jnp.asarray(u).astype(jnp.uint32)
    if bits == 8:
        return u.astype(jnp.uint8)
    *lead, n_in, n_out = u.shape
    u = u.reshape(*lead, n_in // PACK_ROWS, PACK_ROWS, n_out)
    word = jnp.zeros(u.shape[:-2] + (n_out,), jnp.uint32)
    for i in range(PACK_ROWS):
        word = word | (u[..., i, :] << (bits * i))
    packed = jnp.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], axis=-2)
    return packed.astype(jnp.uint8).reshape(*lead, n_in // PACK_ROWS * bits, n_out)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_bits`: uint8 `[..., in*bits/8, out]` -> int32 codes `[..., in, out]`."""
    check_pack_bits(bits)
    if bits == 8:
        return packed.astype(jnp.int32)
    *lead, n_rows, n_out = packed.shape
    n_words = n_rows // bits
    p = packed.reshape(*lead, n_words, bits, n_out).astype(jnp.uint32)
    word = p[..., 0, :]
    for j in range(1, bits):
        word = word | (p[..., j, :] << (8 * j))
    mask = (1 << bits) - 1
    vals = jnp.stack([(word >> (bits * i)) & mask for i in range(PACK_ROWS)], axis=-2)
    return vals.reshape(*lead, n_words * PACK_ROWS, n_out).astype(jnp.int32)


@jax.tree_util.register_pytree_node_class
class IntTensor(QTensor):
    """Group-wise integer weight: `W[i, o] = (u[i, o] - zero[g(i), o]) * scale[g(i), o]`.

    Children (leading axes `...` such as a stacked-layers axis are allowed):
      packed: u8[..., in*bits/8, out], codes packed 8 rows into `bits` bytes.
      scale:  f16[..., in/group_size, out].
      zero:   u8[..., in/group_size, out], or None when symmetric (the zero
              point is then the constant 2**(bits-1)).
    Static: bits, original dtype. The group size is `in / scale.shape[-2]`.

    Example:
        >>> q = IntTensor.quantize(jnp.ones((128, 8)), bits=4, group_size=32)
        >>> y = jmem.models.dot.dot(x, q)   # x: f32[..., 128]
    """

    def __init__(self, packed, scale, zero, bits: int, dtype=jnp.float32):
        self.packed, self.scale, self.zero = packed, scale, zero
        self.bits = int(bits)
        self.dtype = jnp.dtype(dtype)

    def tree_flatten(self):
        children = (self.packed, self.scale) if self.zero is None else (self.packed, self.scale, self.zero)
        return children, (self.bits, self.dtype.name, self.zero is None)

    def with_dtype(self, dtype) -> IntTensor:
        """The same codes and scales, decoding to `dtype` when no other is asked."""
        return IntTensor(self.packed, self.scale, self.zero, self.bits, dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        bits, dtype, symmetric = aux
        packed, scale = children[0], children[1]
        zero = None if symmetric else children[2]
        return cls(packed, scale, zero, bits, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, n_out = self.packed.shape
        return (*lead, rows * 8 // self.bits, n_out)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scale.shape[-2]

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def _describe(self) -> str:
        kind = "sym" if self.symmetric else "zero-point"
        return f"bits={self.bits}, group_size={self.group_size}, {kind}"

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """Codes, scales and zero points split alike; per-channel scales (one group) stay whole on rows."""
        groups = self.scale.shape[-2]
        pack = PACK_ROWS if self.bits != 8 else 1  # 8-bit codes are stored one per byte
        unit = pack if groups == 1 else int(np.lcm(pack, self.group_size))
        check_row_split(self.shape[-2], row_pieces, unit,
                        f"{self.bits}-bit pack words of {PACK_ROWS} rows" if groups == 1
                        else f"quantization groups of {self.group_size} rows")
        scale = P(*lead, rows if groups > 1 else None, cols)
        return IntTensor.tree_unflatten(self.tree_flatten()[1], (P(*lead, rows, cols), scale)
                                        + (() if self.zero is None else (scale,)))

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        """`x[..., in] @ W`: the Pallas kernel for 4-bit weights where `jmem.quant.matmul_impl` picks it."""
        from jmem.quant.kernel import quantized_dot  # the kernel module imports this one

        return quantized_dot(x, self)

    def codes(self) -> jax.Array:
        """Unsigned codes as int32 `[..., in, out]`."""
        return unpack_bits(self.packed, self.bits)

    def dequantize(self, dtype=None) -> jax.Array:
        dtype = self.dtype if dtype is None else dtype
        u = self.codes()
        n_groups = self.scale.shape[-2]
        *lead, n_in, n_out = u.shape
        u = u.reshape(*lead, n_groups, n_in // n_groups, n_out)
        if self.zero is None:
            zero = jnp.float32(2 ** (self.bits - 1))
        else:
            zero = self.zero.astype(jnp.float32)[..., None, :]
        w = (u.astype(jnp.float32) - zero) * self.scale.astype(jnp.float32)[..., None, :]
        return w.reshape(*lead, n_in, n_out).astype(dtype)

    @classmethod
    def from_codes(cls, u, scale, zero, bits: int, dtype=jnp.float32) -> "IntTensor":
        """Build from unsigned codes `[..., in, out]` and group parameters `[..., G, out]`."""
        check_codes(u, bits)
        scale = jnp.asarray(scale, jnp.float16)
        zero = None if zero is None else jnp.asarray(zero).astype(jnp.uint8)
        return cls(_pack_jit(jnp.asarray(u), bits), scale, zero, bits, dtype)

    @classmethod
    def quantize(cls, w, bits: int = 4, group_size: int | None = 128, symmetric: bool = True,
                 clip=None) -> "IntTensor":
        """Round-to-nearest quantization of a float `[..., in, out]` weight.

        Args:
          w: float[..., in, out].
          bits: 2, 3, 4 or 8.
          group_size: input rows per scale; None (or `in`) for per channel.
          symmetric: scale only (zero point 2**(bits-1)) or scale + zero point.
          clip: optional f32[..., in/group_size, out] factors in (0, 1] that
            shrink each group's range before rounding (AWQ's clip search).
        """
        check_weight_shape(w, f"{bits}-bit integer quantization")
        check_int_bits(bits)
        check_bool("symmetric", symmetric)
        check_finite(w, "the weight w")
        w = jnp.asarray(w)
        group_size = check_group_size(w.shape[-2], group_size, bits)
        check_scale_range(w, bits, group_size, symmetric, "the weight w")
        if clip is not None:
            clip = _checked_clip(clip, (*w.shape[:-2], w.shape[-2] // group_size, w.shape[-1]))
        packed, scale, zero = _rtn_arrays(w, clip, bits, group_size, symmetric)
        return cls(packed, scale, zero, bits, w.dtype)


_pack_jit = jax.jit(pack_bits, static_argnums=1)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _rtn_arrays(w, clip, bits: int, group_size: int, symmetric: bool):
    scale, zero = group_params(w, bits, group_size, symmetric, clip)
    u = encode(w, scale, zero, bits)
    zero = None if zero is None else zero.astype(jnp.uint8)
    return pack_bits(u, bits), scale.astype(jnp.float16), zero


def _checked_clip(clip, shape: tuple[int, ...]):
    """`clip` as f32 of `shape` (per group and output column), with values in (0, 1] when concrete."""
    if np.shape(clip) != shape:
        raise ValueError(f"clip has shape {np.shape(clip)}; accepted: f32{list(shape)} (the weight's leading dims, "
                         f"in/group_size, out)")
    clip = jnp.asarray(clip, jnp.float32)
    if is_concrete(clip) and not bool(jnp.all((clip > 0) & (clip <= 1))):
        raise ValueError("clip holds values outside (0, 1] (or NaN); accepted: factors in (0, 1] that shrink each "
                         "group's range")
    return clip


def check_int_bits(bits) -> None:
    if not is_int(bits) or bits not in SUPPORTED_INT_BITS:
        raise ValueError(f"bits={bits!r} is not supported for integer quantization; accepted: an int in "
                         f"{SUPPORTED_INT_BITS}")


def is_concrete(x) -> bool:
    """False for a jax Tracer (under jit/grad/vmap): checks on array values run only on concrete arrays."""
    return not isinstance(x, jax.core.Tracer)


def check_finite(x, name: str, accepted: str = "finite weights", lead: str | None = None) -> None:
    """Refuse a concrete array holding NaN or inf: one ValueError naming `name` and the count (skipped when
    `x` is a Tracer). `lead` names the leading axis (e.g. "layer") to also say which of its entries are hit.

    Quantizing a non-finite value destroys its group's scale (or, in GPTQ, spreads NaN over the column), so
    it is refused up front rather than rounded into a silently wrong weight.
    """
    if not is_concrete(x):
        return
    finite = jnp.isfinite(jnp.asarray(x))
    n_bad = int(finite.size - jnp.count_nonzero(finite))
    if not n_bad:
        return
    where = ""
    if lead is not None and finite.ndim > 2:
        hit = np.flatnonzero(~np.asarray(finite.reshape(finite.shape[0], -1).all(axis=1)))
        where = f" ({lead}{'s' if len(hit) > 1 else ''} {', '.join(map(str, hit))})"
    raise ValueError(f"{name} has {n_bad} non-finite value(s){where}; accepted: {accepted}")


def check_pack_bits(bits) -> None:
    """Code widths `pack_bits` packs: 1 to 4 bits (eight rows in one 32-bit word) or 8 (unpacked);
    quantized weights use 2, 3, 4, 8, pruning masks 1."""
    if not is_int(bits) or bits not in PACK_BITS:
        raise ValueError(f"bits={bits!r} cannot be packed; accepted: {', '.join(map(str, PACK_BITS))}")


def check_codes(u, bits) -> None:
    """Refuse bits outside PACK_BITS, an input dimension that is not whole pack words, and (on a concrete
    array) codes outside [0, 2**bits) that packing would silently wrap."""
    check_pack_bits(bits)
    shape = np.shape(u)
    if len(shape) < 2 or (bits != 8 and shape[-2] % PACK_ROWS):
        raise ValueError(f"codes of shape {shape} cannot be packed at {bits} bits; accepted: an array [..., in, out] "
                         f"with in a multiple of {PACK_ROWS if bits != 8 else 1}")
    if is_concrete(u) and np.size(u):
        lo, hi = int(jnp.min(jnp.asarray(u))), int(jnp.max(jnp.asarray(u)))
        if lo < 0 or hi >= 2 ** bits:
            raise ValueError(f"codes range over {lo}..{hi}; accepted: unsigned {bits}-bit codes, "
                             f"0..{2 ** bits - 1}")


def check_weight_shape(w, what: str = "quantize") -> None:
    """Refuse a weight that is not a non-empty float `[..., in, out]` array (one clear ValueError)."""
    shape = tuple(np.shape(w))
    if len(shape) < 2 or 0 in shape:
        raise ValueError(f"{what}: weight shape {shape} is not a weight matrix; accepted: an array with at least "
                         "2 axes [..., in, out] and no empty axis")
    dtype = getattr(w, "dtype", None)
    if dtype is None:  # a nested list of numbers
        dtype = np.asarray(w).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{what}: weight dtype {dtype}; accepted: a float array (f32, bf16, f16), whose "
                         "dequantized values are floats too")


def group_size_choices(n_in: int, bits: int, near=None) -> list[int]:
    """Up to four group sizes that work for `n_in` at `bits` (divisors of it that are whole pack words),
    nearest `near` first, in ascending order; empty when `n_in` is not whole pack words."""
    unit = 1 if bits == 8 else PACK_ROWS
    divisors = [g for g in range(unit, n_in + 1, unit) if n_in % g == 0]
    if is_int(near) and near > 0:
        divisors.sort(key=lambda g: (abs(g - near), g))
    else:
        divisors.sort(reverse=True)
    return sorted(divisors[:4])


def group_choices(n_in: int, bits: int, near=None) -> str:
    """The accepted-values text of a group size error: a few that work for `n_in`, or per channel."""
    unit = 1 if bits == 8 else PACK_ROWS
    shown = ", ".join(map(str, group_size_choices(n_in, bits, near)))
    return f"a divisor of {n_in} that is a multiple of {unit} (e.g. {shown}), or None (per channel)"


def check_group_size(n_in: int, group_size: int | None, bits: int = 4) -> int:
    """Validate and resolve a group size for an input dimension `n_in`; None means per channel.

    Codes narrower than 8 bits are packed 8 input rows at a time, so their
    groups (and per channel, `n_in` itself) must be multiples of 8; 8-bit
    codes are stored unpacked and take any divisor of `n_in`. When `n_in` is
    not a multiple of 8 no group fits narrower codes, and bits=8 is the advice.
    """
    check_int_bits(bits)
    unit = 1 if bits == 8 else PACK_ROWS
    if group_size is None or group_size == -1:
        if n_in % unit:
            raise ValueError(f"per-channel {bits}-bit codes need an input dimension that is a multiple of {unit} "
                             f"(codes are packed {unit} rows at a time); got {n_in}; accepted: bits=8 for "
                             f"this matrix, or an input dimension that is a multiple of {unit}")
        return int(n_in)
    ok_type = is_int(group_size)
    if n_in % unit:
        raise ValueError(f"group_size={group_size!r} cannot serve the input dimension {n_in}, nor can any group "
                         f"size: {bits}-bit codes are packed {unit} rows at a time and {n_in} is not a multiple of "
                         f"{unit}; accepted: bits=8 for this matrix")
    if not ok_type or group_size <= 0:
        raise ValueError(f"group_size={group_size!r} is not a positive integer; accepted: "
                         + group_choices(n_in, bits, None))
    if n_in % group_size:
        raise ValueError(f"group_size={group_size!r} does not divide the input dimension {n_in}; accepted: "
                         + group_choices(n_in, bits, group_size if ok_type else None))
    if group_size % unit:
        raise ValueError(f"group_size={group_size} must be a multiple of {unit} ({bits}-bit codes are packed "
                         f"{unit} rows at a time); accepted: " + group_choices(n_in, bits, group_size))
    return int(group_size)


def group_params(w, bits: int, group_size: int, symmetric: bool, clip=None):
    """Per-group scale (rounded up to f16) and zero point, each f32[..., in/group_size, out].

    The zero point is None when symmetric (codes then lie in [1, 2**bits - 1]
    around the fixed zero 2**(bits-1)). Scales are f16 and reach down into its
    subnormals, so small groups keep a grid of their own size (with fewer
    significant scale bits below f16's smallest normal, 6.1e-5); a group that
    needs less than the smallest subnormal, 6e-8, gets 6e-8, and each of its
    values is then off by at most half that step. `check_scale_range` (run by
    `IntTensor.quantize` and `gptq_quantize`) refuses what f16 scales cannot
    serve: a group that needs a scale above 65504 (inf, decoding to NaN), and a
    non-zero weight whose every value is below 3e-8 (it would decode to all zeros).
    """
    hi, lo = _group_range(w, group_size)
    if clip is not None:
        hi, lo = hi * clip, lo * clip
    scale = _f16_up(jnp.maximum(_exact_scale(hi, lo, bits, symmetric), F16_TINY))
    zero = None if symmetric else jnp.clip(jnp.round(-jnp.minimum(lo, 0.0) / scale), 0, 2 ** bits - 1)
    return scale, zero


def _group_range(w, group_size: int):
    """Per-group max and min over the input rows, each f32[..., in/group_size, out]."""
    *lead, n_in, n_out = w.shape
    wg = jnp.asarray(w, jnp.float32).reshape(*lead, n_in // group_size, group_size, n_out)
    return wg.max(axis=-2), wg.min(axis=-2)


def _exact_scale(hi, lo, bits: int, symmetric: bool):
    """The scale a group's range needs before f16 rounding (zero-point groups keep 0 exactly representable)."""
    if symmetric:
        return jnp.maximum(hi, -lo) / (2 ** (bits - 1) - 1)
    return (jnp.maximum(hi, 0.0) - jnp.minimum(lo, 0.0)) / (2 ** bits - 1)


def f16_overflow(x) -> tuple[int, float]:
    """(how many, largest |value|) of the finite values of `x` beyond f16's range: the one rule for
    everything stored as f16 (int-group scales, GGUF F16 tensors and block scales)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        over = (np.abs(x) > F16_MAX) & np.isfinite(x)
    n = int(np.count_nonzero(over))
    return n, float(np.abs(x[over]).max()) if n else 0.0


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _needed_scales(w, bits: int, group_size: int, symmetric: bool):
    """The f32 scale each group needs before f16 rounding, and the weight's min, max and largest |value|."""
    hi, lo = _group_range(w, group_size)
    return _exact_scale(hi, lo, bits, symmetric), lo.min(), hi.max(), jnp.maximum(hi, -lo).max()


def check_scale_range(w, bits: int, group_size: int, symmetric: bool, name: str) -> None:
    """Refuse a concrete weight its f16 group scales cannot serve (see `group_params`): a group whose
    range needs a scale above f16's largest value, or a non-zero weight too small for any code but the
    zero point. One ValueError naming the weight's range and the limit; skipped for a Tracer."""
    if not is_concrete(w):
        return
    need, lo, hi, amax = _needed_scales(w, bits, group_size, symmetric)
    lo, hi, amax = float(lo), float(hi), float(amax)
    kind = "symmetric" if symmetric else "zero-point"
    steps = 2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1
    n, _ = f16_overflow(need)
    if n:
        span = "|value|" if symmetric else "max(value, 0) - min(value, 0)"
        raise ValueError(f"{name} ranges over {lo:.6g}..{hi:.6g}: {n} group(s) of {group_size} rows need an f16 "
                         f"scale above {F16_MAX:g} and would decode to NaN; accepted: {bits}-bit {kind} groups "
                         f"with {span} <= {F16_MAX * steps:g} ({F16_MAX:g} x {steps} steps), e.g. the weight "
                         "rescaled or kept in float")
    if 0 < amax < F16_TINY / 2:
        raise ValueError(f"{name} ranges over {lo:.3g}..{hi:.3g}: below half the smallest f16 scale "
                         f"({F16_TINY:.3g}) every value rounds to the zero point and it would decode to all zeros; "
                         f"accepted: a weight with some |value| >= {F16_TINY / 2:.3g}, e.g. rescaled, or kept "
                         "in float")


def _f16_up(scale):
    """`scale` as the nearest f16 value at or above it (in f32): the grid then still spans the group's
    range, so no weight lands more than half a step from its code (rounding down clipped the extremes)."""
    s16 = scale.astype(jnp.float16)
    s16 = jnp.where(s16.astype(jnp.float32) < scale, jnp.nextafter(s16, jnp.float16(jnp.inf)), s16)
    return s16.astype(jnp.float32)


def encode(w, scale, zero, bits: int) -> jax.Array:
    """Unsigned codes `[..., in, out]` for `w` given group params `[..., G, out]`."""
    *lead, n_in, n_out = w.shape
    n_groups = scale.shape[-2]
    wg = jnp.asarray(w, jnp.float32).reshape(*lead, n_groups, n_in // n_groups, n_out)
    if zero is None:
        lo, hi, zero = 1, 2 ** bits - 1, jnp.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = 0, 2 ** bits - 1
    u = jnp.clip(jnp.round(wg / scale[..., None, :]) + zero[..., None, :], lo, hi)
    return u.reshape(*lead, n_in, n_out).astype(jnp.int32)


def is_qtensor(x) -> bool:
    return isinstance(x, QTensor)

"""`prune(model, method, sparsity, pattern)`: zero out a Llama model's least important linear weights.

Scores (a kernel is `W[in, out]`; every output column is pruned on its own,
comparing the input weights that feed it, as Wanda does):

* `magnitude`: `|W[i, o]|`.
* `wanda` (Sun et al. 2023): `|W[i, o]| * ||X[:, i]||_2`, with `X` the
  layer's calibration inputs. The calibration tokens are embedded once; each
  block's linear inputs are captured on the outputs of the already-pruned
  earlier blocks (`jmem.calibrate.calibrate_layers`), the block is
  pruned, and its pruned output feeds the next block. All linears of one block
  see that block's dense inputs, as in the paper.

Patterns:

* unstructured (`pattern=None`): the `floor(sparsity * in)` lowest scores of
  each output column become zero. Every column then keeps the same count, so
  the kernel packs into a `BitmaskSparse` leaf: the kept values `[kept, out]`
  plus a 1-bit mask (0.53x of f32 dense at 50%; a per-value index format
  would cost as much as bf16 dense). It is expanded to dense inside the jitted
  step: it saves memory, not FLOPs (no sparse matmul kernel).
* `"N:M"` (`"2:4"`: NVIDIA's semi-structured sparsity): in every group of M
  consecutive input weights of an output column the N highest scores are kept.
  The kernel becomes an `NMSparse` leaf holding only the kept values and their
  2-bit (for M=4) positions, expanded to dense inside the jitted step; an f32
  2:4 kernel takes 0.53x of its dense bytes.

Embeddings, norms and the output head stay dense. A model pruned with
`pack=False` is fine-tuned sparse by chaining `keep_pruned_zeros()` after the
optimizer: it zeroes the pruned kernels' updates where the weight is zero.

Example:
    >>> pruned = prune(model, "wanda", pattern="2:4", calibration=ids_BT)
    >>> sparsity_report(pruned)["wq"]
    {'zeros': 0.5, 'bytes': ..., 'dense_bytes': ..., 'format': 'NMSparse 2:4'}
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmem.checks import check_bool, check_targets, is_number
from jmem.calibrate import LINEARS, calibrate_layers, calibration_tokens, check_calibration_ids, linear_targets
from jmem.calibrate import run_layer, stack_records
from jmem.pytree import leaf_paths
from jmem.quant.api import describe_quantized
from jmem.quant.qtensor import PACK_ROWS, QTensor, pack_bits, unpack_bits

METHODS = ("magnitude", "wanda")
# Positions within a group are stored in uint8 codes; pack_bits packs up to 4 bits 8 rows at a time.
MAX_GROUP = 256
MAX_PACKED_BITS = 4


@dataclasses.dataclass(frozen=True)
class PruneSpec:
    """A validated request: method, fraction of zeros, and the N:M pattern (None = unstructured)."""

    method: str
    sparsity: float
    n: int | None = None
    m: int | None = None

    @property
    def pattern(self) -> str | None:
        return None if self.n is None else f"{self.n}:{self.m}"


def parse_pattern(pattern: str) -> tuple[int, int]:
    """`"2:4"` -> (2, 4): keep N of every M consecutive input weights; 1 <= N < M <= 256.

    Raises:
      ValueError: a string that is not `N:M` with integers in that range.
    """
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern) if isinstance(pattern, str) else None
    if match is None:
        raise ValueError(f"pattern={pattern!r} is not an N:M pattern; accepted: None (unstructured) or a string "
                         f"'N:M' of integers with 1 <= N < M <= {MAX_GROUP}, e.g. '2:4'")
    n, m = int(match.group(1)), int(match.group(2))
    if not 1 <= n < m <= MAX_GROUP:
        raise ValueError(f"pattern={pattern!r}: keeps N={n} of every M={m}; accepted: 1 <= N < M <= {MAX_GROUP}, "
                         "e.g. '2:4'")
    return n, m


def check_spec(method: str, sparsity, pattern) -> PruneSpec:
    """Validate `prune`'s method, sparsity and pattern (no model needed)."""
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; accepted: {', '.join(METHODS)}")
    if sparsity is not None:
        if not is_number(sparsity) or not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"sparsity={sparsity!r}; accepted: a fraction of zeros in [0, 1)")
    if pattern is None:
        return PruneSpec(method, 0.5 if sparsity is None else float(sparsity))
    n, m = parse_pattern(pattern)
    implied = 1.0 - n / m
    if sparsity is not None and not math.isclose(float(sparsity), implied):
        raise ValueError(f"sparsity={sparsity!r} contradicts pattern={pattern!r}, which zeroes {implied:g} of "
                         "every group; accepted: sparsity=None (implied by the pattern) or its value")
    return PruneSpec(method, implied, n, m)


# --------------------------------------------------------------------------- scores and masks


def wanda_scores(w_IO, x_sq_I) -> jax.Array:
    """Wanda's importance `|W[i, o]| * ||X[:, i]||_2` from the summed squares of each input channel.

    Args:
      w_IO: float[..., in, out] kernel.
      x_sq_I: f32[..., in], `sum over tokens of X[t, i]**2`.
    """
    return jnp.abs(jnp.asarray(w_IO, jnp.float32)) * jnp.sqrt(jnp.asarray(x_sq_I, jnp.float32))[..., :, None]


def _pick(scores, k: int, largest: bool):
    """bool mask, True at the `k` largest (or smallest) scores along the input axis -2 of each output column.

    `lax.top_k` on the minor axis (after a transpose) is several times faster on CPU than sorting along
    the strided input axis; among equal scores it picks the lower input index first.
    """
    s_OI = jnp.swapaxes(scores, -1, -2)
    _, idx = jax.lax.top_k(s_OI if largest else -s_OI, k)
    picked = jnp.put_along_axis(jnp.zeros(s_OI.shape, bool), idx, True, axis=-1, inplace=False)
    return jnp.swapaxes(picked, -1, -2)


def pruned_count(sparsity: float, n_in: int) -> int:
    """`floor(sparsity * n_in)`, as the decimal numbers read (0.29 * 100 is 28.999999999999996 in floats);
    a ValueError when that is every input (a sparsity within 1e-9 of 1)."""
    count = math.floor(round(sparsity * n_in, 9))
    if count >= n_in:
        raise ValueError(f"sparsity={sparsity!r} prunes all {n_in} inputs of a column; accepted: a number in [0, 1) "
                         "that keeps at least one")
    return count


def unstructured_mask(scores_IO, sparsity: float) -> jax.Array:
    """bool[..., in, out]: False for the `floor(sparsity * in)` lowest scores of each output column.

    Raises:
      ValueError: scores with fewer than 2 axes, or a sparsity outside [0, 1) (as `prune` says it).
    """
    if len(np.shape(scores_IO)) < 2:
        raise ValueError(f"scores of shape {tuple(np.shape(scores_IO))}; accepted: [..., in, out]")
    if sparsity is None:  # prune's "default" means nothing here
        raise ValueError("sparsity=None; accepted: a fraction of zeros in [0, 1)")
    check_spec("magnitude", sparsity, None)
    return _unstructured_mask(scores_IO, float(sparsity))


@functools.partial(jax.jit, static_argnums=1)
def _unstructured_mask(scores_IO, sparsity: float) -> jax.Array:
    k = pruned_count(sparsity, scores_IO.shape[-2])
    if k == 0:
        return jnp.ones(scores_IO.shape, bool)
    return ~_pick(scores_IO, k, largest=False)


@functools.partial(jax.jit, static_argnums=(1, 2))
def nm_mask(scores_IO, n: int, m: int) -> jax.Array:
    """bool[..., in, out]: True for the N highest scores of every M consecutive inputs of each output column."""
    *lead, n_in, n_out = scores_IO.shape
    if not 0 < n <= m or n_in % m:
        raise ValueError(f"nm_mask: {n}:{m} on an input dimension of {n_in}; accepted: 0 < N <= M and M dividing "
                         f"the input dimension (axis -2 of scores [..., in, out])")
    s = scores_IO.reshape(*lead, n_in // m, m, n_out)
    return _pick(s, n, largest=True).reshape(*lead, n_in, n_out)


def make_mask(scores_IO, spec: PruneSpec) -> jax.Array:
    """The keep-mask of `spec` (unstructured or N:M) for one or a stack of kernels' scores."""
    if spec.n is None:
        return unstructured_mask(scores_IO, spec.sparsity)
    return nm_mask(scores_IO, spec.n, spec.m)


# --------------------------------------------------------------------------- the packed N:M leaf


def _position_bits(m: int, kept_rows: int) -> int:
    """Bits per stored position: ceil(log2 M) packed 8 rows at a time, or a plain byte when that cannot pack."""
    bits = max(1, (m - 1).bit_length())
    return bits if bits <= MAX_PACKED_BITS and kept_rows % PACK_ROWS == 0 else 8


# What a train step that would update a packed pruned kernel says (`QTensor.UNTRAINABLE`).
_PACKED_PRUNED = ("a packed pruned kernel", "a model pruned with pack=False (chain keep_pruned_zeros() after the "
                  "optimizer to keep its zeros), or adapters_only=True with LoRA adapters")


@jax.tree_util.register_pytree_node_class
class NMSparse(QTensor):
    """An N:M sparse kernel `[..., in, out]`: the N kept values of every M inputs, and where they sit.

    Children (leading axes `...`, e.g. the stacked-layers axis, allowed):
      values: float[..., in*N/M, out], the kept weights of each group in input order.
      positions: u8[..., in*N/M*bits/8, out], each kept value's index within its
        group (0..M-1) in `bits = ceil(log2 M)` bits, packed 8 rows into `bits`
        bytes (`jmem.quant.pack_bits`); one byte each when the kept rows are not
        a multiple of 8 or M > 16.
    Static: n, m, bits. The input dimension is `values.shape[-2] * M / N`.

    The dot expands to the dense kernel inside the traced step (XLA fuses the
    select into the matmul operand); `nbytes` counts values + positions.

    Example:
        >>> s = NMSparse.from_mask(w_IO, nm_mask(jnp.abs(w_IO), 2, 4), 2, 4)
        >>> y = jmem.models.dot.dot(x, s)   # == x @ (w_IO * mask)
    """

    UNTRAINABLE = _PACKED_PRUNED

    def __init__(self, values, positions, n: int, m: int, bits: int):
        self.values, self.positions = values, positions
        self.n, self.m, self.bits = int(n), int(m), int(bits)

    def tree_flatten(self):
        return (self.values, self.positions), (self.n, self.m, self.bits)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, kept, n_out = self.values.shape
        return (*lead, kept * self.m // self.n, n_out)

    @property
    def dtype(self):
        return self.values.dtype

    def _describe(self) -> str:
        return f"{self.n}:{self.m}, {self.bits}-bit positions"

    @classmethod
    def from_mask(cls, w_IO, mask_IO, n: int, m: int) -> "NMSparse":
        """Pack a kernel whose keep-mask has exactly N True in every M consecutive inputs of each column.

        Raises:
          ValueError: an input dimension M does not divide, or a group with a count other than N.
        """
        w_IO, mask_IO = jnp.asarray(w_IO), jnp.asarray(mask_IO, bool)
        if w_IO.ndim < 2 or w_IO.shape != mask_IO.shape:
            raise ValueError(f"NMSparse: weight {w_IO.shape} and mask {mask_IO.shape} must be equal shapes "
                             "[..., in, out]")
        n_in = w_IO.shape[-2]
        if n_in % m:
            raise ValueError(f"NMSparse {n}:{m}: input dimension {n_in} is not a multiple of M={m}")
        host = np.asarray(mask_IO)  # counted on the host: no compile per shape
        counts = host.reshape(*host.shape[:-2], n_in // m, m, host.shape[-1]).sum(axis=-2)
        if not np.all(counts == n):
            raise ValueError(f"NMSparse {n}:{m}: the mask keeps {sorted(set(counts.ravel().tolist()))} of some "
                             f"groups of {m}; accepted: exactly {n} in every group")
        bits = _position_bits(m, n_in // m * n)
        values, positions = _pack_nm(w_IO, mask_IO, n, m, bits)
        return cls(values, positions, n, m, bits)

    def kept_positions(self) -> jax.Array:
        """int32[..., in*N/M, out]: each kept value's index within its group of M."""
        return unpack_bits(self.positions, self.bits)

    def mask(self) -> jax.Array:
        """bool[..., in, out]: where the kept values sit."""
        return _expand(jnp.ones_like(self.values, bool), self.kept_positions(), self.n, self.m).astype(bool)

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense kernel `[..., in, out]` with zeros at the pruned places."""
        dense = _expand(self.values, self.kept_positions(), self.n, self.m)
        return dense.astype(self.dtype if dtype is None else dtype)


def _expand(values, pos, n: int, m: int):
    *lead, kept, n_out = values.shape
    v = values.reshape(*lead, kept // n, n, 1, n_out)
    p = pos.reshape(*lead, kept // n, n, 1, n_out)
    hit = p == jnp.arange(m, dtype=p.dtype)[:, None]  # [..., G, N, M, out]
    dense = jnp.sum(jnp.where(hit, v, jnp.zeros((), values.dtype)), axis=-3)
    return dense.reshape(*lead, kept // n * m, n_out)


def _compact(x, keep, kept: int):
    """The entries of `x[..., in, out]` where `keep`, moved to the front of the input axis in order:
    `[..., kept, out]`. Each lands at its running count of kept inputs (a scatter: a sort along this
    strided axis is several times slower on CPU); pruned entries go to a spare row that is cut off."""
    idx = jnp.where(keep, jnp.cumsum(keep, axis=-2, dtype=jnp.int32) - 1, kept)
    out = jnp.zeros((*x.shape[:-2], kept + 1, x.shape[-1]), x.dtype)
    return jnp.put_along_axis(out, idx, x, axis=-2, inplace=False)[..., :kept, :]


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _pack_nm(w_IO, mask_IO, n: int, m: int, bits: int):
    *lead, n_in, n_out = w_IO.shape
    keep = mask_IO.reshape(*lead, n_in // m, m, n_out)
    where = jnp.broadcast_to(jnp.arange(m, dtype=jnp.uint8)[:, None], keep.shape)
    values = _compact(w_IO.reshape(keep.shape), keep, n)
    pos = _compact(where, keep, n)
    kept = n_in // m * n
    return values.reshape(*lead, kept, n_out), pack_bits(pos.reshape(*lead, kept, n_out), bits)


@jax.tree_util.register_pytree_node_class
class BitmaskSparse(QTensor):
    """An unstructured sparse kernel `[..., in, out]` with the same number of kept inputs in every column.

    Per-output pruning removes exactly `floor(sparsity * in)` inputs of each
    output column, so the kept values pack into a regular array.

    Children (leading axes `...` allowed):
      values: float[..., kept, out], each column's kept weights in input order.
      bitmask: u8[..., in/8, out], 1 where an input is kept, 8 rows per byte
        (`jmem.quant.pack_bits` with 1 bit).

    A 50% f32 kernel takes 0.53x of its dense bytes (bf16: 0.56x). The dot
    expands to dense inside the traced step: a cumulative sum of the mask
    indexes the values (one gather per weight), so it saves memory, not FLOPs.

    Example:
        >>> s = BitmaskSparse.from_mask(w_IO, unstructured_mask(jnp.abs(w_IO), 0.5))
        >>> y = jmem.models.dot.dot(x, s)   # == x @ (w_IO * mask)
    """

    UNTRAINABLE = _PACKED_PRUNED

    def __init__(self, values, bitmask):
        self.values, self.bitmask = values, bitmask

    def tree_flatten(self):
        return (self.values, self.bitmask), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, n_out = self.bitmask.shape
        return (*lead, rows * PACK_ROWS, n_out)

    @property
    def dtype(self):
        return self.values.dtype

    def _describe(self) -> str:
        return f"kept {self.values.shape[-2]} of {self.shape[-2]} per column"

    @classmethod
    def from_mask(cls, w_IO, mask_IO) -> "BitmaskSparse":
        """Pack a kernel whose keep-mask keeps the same number of inputs in every output column.

        Raises:
          ValueError: an input dimension that is not a multiple of 8, or unequal counts per column.
        """
        w_IO, mask_IO = jnp.asarray(w_IO), jnp.asarray(mask_IO, bool)
        if w_IO.ndim < 2 or w_IO.shape != mask_IO.shape:
            raise ValueError(f"BitmaskSparse: weight {w_IO.shape} and mask {mask_IO.shape} must be equal shapes "
                             "[..., in, out]")
        if w_IO.shape[-2] % PACK_ROWS:
            raise ValueError(f"BitmaskSparse: input dimension {w_IO.shape[-2]} is not a multiple of {PACK_ROWS} "
                             "(the mask is packed 8 rows per byte)")
        counts = np.asarray(mask_IO).sum(axis=-2)  # counted on the host: no compile per shape
        if counts.size and not np.all(counts == counts.flat[0]):
            raise ValueError(f"BitmaskSparse: columns keep {sorted(set(counts.ravel().tolist()))[:4]}... inputs; "
                             "accepted: the same count in every column (per-output pruning)")
        kept = int(counts.flat[0]) if counts.size else 0
        return cls(*_pack_bitmask(w_IO, mask_IO, kept))

    def mask(self) -> jax.Array:
        """bool[..., in, out]: where the kept values sit."""
        return unpack_bits(self.bitmask, 1).astype(bool)

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense kernel `[..., in, out]` with zeros at the pruned places."""
        mask = self.mask()
        # The k-th kept input of a column reads values[k]: its index is the running count of kept inputs.
        idx = jnp.clip(jnp.cumsum(mask, axis=-2, dtype=jnp.int32) - 1, 0, max(self.values.shape[-2] - 1, 0))
        dense = jnp.where(mask, jnp.take_along_axis(self.values, idx, axis=-2), jnp.zeros((), self.dtype))
        return dense.astype(self.dtype if dtype is None else dtype)


@functools.partial(jax.jit, static_argnums=2)
def _pack_bitmask(w_IO, mask_IO, kept: int):
    return _compact(w_IO, mask_IO, kept), pack_bits(mask_IO.astype(jnp.uint8), 1)


SPARSE_LEAVES = (NMSparse, BitmaskSparse)


# --------------------------------------------------------------------------- the model


def check_fits(model, spec: PruneSpec, targets=None) -> dict:
    """Refuse targets `prune` cannot prune in `model` (absent, quantized, or an input dimension M does
    not divide) with one ValueError; the block's weights otherwise. Cheap: no scores, no copies."""
    targets = linear_targets(model, targets)
    weights = model.layers.weights()
    for t in targets:
        kind = describe_quantized(weights[t])
        if kind is not None:
            raise ValueError(f"{t} is already a {kind} weight leaf; accepted: float kernels (prune the model "
                             "as loaded, before quantizing or adding adapters)")
    if spec.m is not None:
        for t in targets:
            n_in = weights[t].shape[-2]
            if n_in % spec.m:
                raise ValueError(f"pattern={spec.pattern!r}: {t} has input dimension {n_in}, not a multiple of "
                                 f"M={spec.m}; accepted: a pattern whose M divides every target's input dimension, "
                                 "or targets without it")
    return weights


def prune(model, method: str = "magnitude", sparsity: float | None = None, pattern: str | None = None,
          calibration=None, *, targets=None, tokenizer=None, seq_len: int = 512, max_seqs: int = 32,
          pack: bool = True, inplace: bool = False, log=None):
    """Prune the linear kernels of a jmem Llama model.

    Args:
      model: a `jmem.models.Llama` with float kernels (layers stacked on a leading axis).
      method: "magnitude" (|W|) or "wanda" (|W| x per-input-channel activation norm).
      sparsity: fraction of zeros in [0, 1) per output column; None: 0.5, or the
        fraction a pattern implies (1 - N/M).
      pattern: None (unstructured) or "N:M" ("2:4"): keep N of every M
        consecutive input weights of each output column.
      calibration: wanda only (ignored by magnitude): text(s) (with
        `tokenizer`) or token ids (int [B, T] or a list of 1-D arrays).
      targets: which block linears to prune (default None: all seven, or the four attention linears of a
        mixture-of-experts model).
      tokenizer: for text calibration; anything with `.encode(text)`.
      seq_len, max_seqs: calibration windows (tokens per window, windows used).
      pack: store kernels as `NMSparse` (a pattern whose N values and positions
        take fewer bytes than M dense values: 2:4 does, 15:16 does not) or
        `BitmaskSparse` (unstructured, where the dropped values outweigh a
        1-bit mask and the input dimension is a multiple of 8) leaves, else
        dense with zeros; False: dense arrays with
        zeros, e.g. to quantize or fine-tune them afterwards (with the
        optimizer chained before `keep_pruned_zeros`, the zeros stay zero).
      inplace: modify `model` instead of a copy.
      log: optional callable taking one progress line per calibrated layer.

    Returns:
      The pruned model: every target `layers.<linear>.kernel` holds the masked
      kernel (packed: an `NMSparse` or `BitmaskSparse` leaf).

    Raises:
      ValueError: a bad method, sparsity or pattern; a target whose input
        dimension M does not divide; an already quantized or wrapped kernel;
        wanda without calibration. All before any heavy work.

    Example:
        >>> pruned = prune(model, "wanda", pattern="2:4", calibration=ids_BT)
        >>> logits, _ = pruned(ids_BT)
    """
    spec = check_spec(method, sparsity, pattern)
    targets = linear_targets(model, targets)
    check_bool("pack", pack)
    check_bool("inplace", inplace)
    weights = check_fits(model, spec, targets)
    ids = None
    if method == "wanda":
        if calibration is None:
            raise ValueError("method='wanda' needs calibration (text(s) with tokenizer=, or token ids [B, T])")
        ids = calibration_tokens(calibration, tokenizer, seq_len, max_seqs)
        check_calibration_ids(ids, model.config.vocab_size)
    if not inplace:
        model = nnx.clone(model)
    if method == "magnitude":
        masks = {t: make_mask(jnp.abs(jnp.asarray(weights[t], jnp.float32)), spec) for t in targets}
    else:
        masks = _wanda_masks(model, weights, jnp.asarray(ids), spec, targets, log)
    for t in targets:
        getattr(model.layers, t).kernel.set_value(_store(weights[t], masks[t], spec, pack))
    return model


def _store(w, mask, spec: PruneSpec, pack: bool):
    """The pruned kernel in its storage form: packed where that saves bytes, else dense with zeros."""
    value_bits = jnp.dtype(w.dtype).itemsize * 8
    if spec.n is not None:
        # N values and N positions per M weights: 15:16 in bf16 would take 1.35x the dense bytes.
        position_bits = _position_bits(spec.m, w.shape[-2] // spec.m * spec.n)
        if pack and spec.n * (value_bits + position_bits) < spec.m * value_bits:
            return NMSparse.from_mask(w, mask, spec.n, spec.m)
        return jnp.where(mask, w, jnp.zeros((), w.dtype))
    kept = w.shape[-2] - pruned_count(spec.sparsity, w.shape[-2])
    # The bitmask costs 1 bit per weight: packing pays only when the dropped values outweigh it.
    if pack and w.shape[-2] % PACK_ROWS == 0 and (w.shape[-2] - kept) * value_bits > w.shape[-2]:
        return BitmaskSparse.from_mask(w, mask)
    return jnp.where(mask, w, jnp.zeros((), w.dtype))


def keep_pruned_zeros(targets=LINEARS) -> optax.GradientTransformation:
    """An optax transform that zeroes the updates of pruned kernels where the weight is zero, so a model
    pruned with `pack=False` keeps its sparsity while it is fine-tuned (a plain optimizer fills the zeros in
    the first step). Chain it after the optimizer; it keeps no state.

    It reads the parameters (`tx.update(updates, state, params)`, as `jmem.train` calls it) at the paths
    `layers/<target>/kernel` (None: every linear, as `prune`'s); other leaves pass unchanged. A kept
    weight that training makes exactly 0.0 stays 0 from then on.

    Example:
        >>> tx = optax.chain(optax.adamw(1e-4), keep_pruned_zeros())
        >>> fns = make_train_fns(prune(model, "wanda", pattern="2:4", calibration=ids, pack=False), tx)
    """
    pruned = {("layers", t, "kernel") for t in check_targets(LINEARS if targets is None else targets, LINEARS)}

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("keep_pruned_zeros needs the parameters: call tx.update(updates, state, params)")
        entries, treedef = leaf_paths(updates)
        kept = [jnp.where(p != 0, u, jnp.zeros((), u.dtype)) if path in pruned else u
                for (path, u), p in zip(entries, treedef.flatten_up_to(params))]
        return jax.tree.unflatten(treedef, kept), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _wanda_masks(model, weights: dict, ids_BT, spec: PruneSpec, targets: tuple, log=None) -> dict:
    def rewrite(cfg, w, x, positions):
        _, inputs = run_layer(cfg, w, x, positions)  # every linear of the block sees its dense inputs
        masks = {t: make_mask(wanda_scores(w[t], input_sq_norms(inputs[t])), spec) for t in targets}
        return {**w, **{t: jnp.where(masks[t], w[t], 0.0) for t in targets}}, masks

    return stack_records(calibrate_layers(model, ids_BT, rewrite, log=log, label="wanda"))


@jax.jit
def input_sq_norms(x) -> jax.Array:
    """f32[in]: `sum over every token of x[..., i]**2` for captured linear inputs `x[..., in]`."""
    x = x.astype(jnp.float32)
    return jnp.sum(x * x, axis=tuple(range(x.ndim - 1)))


@jax.jit
def _dense(w):
    return w.dequantize()


def sparsity_report(model, names=LINEARS) -> dict[str, dict]:
    """Per block linear: fraction of zeros, stored bytes, dense bytes and storage format.

    Also a `"total"` entry over the listed kernels. Zeros are counted in the
    dense expansion, so a packed leaf's own zero values count too.

    Example:
        >>> sparsity_report(prune(tiny_model, pattern="2:4"))["w_up"]
        {'zeros': 0.5, 'bytes': 34816, 'dense_bytes': 65536, 'format': 'NMSparse 2:4'}
    """
    weights = model.layers.weights()
    out, zeros, size, stored, dense = {}, 0, 0, 0, 0
    for n in names:
        if n not in weights:
            continue
        w = weights[n]
        numel = int(np.prod(w.shape))
        if isinstance(w, SPARSE_LEAVES):  # the pruned places, plus any kept value that is itself zero
            z = numel - int(np.prod(w.values.shape)) + int(np.sum(np.asarray(w.values) == 0))
        else:
            z = int(np.sum(np.asarray(_dense(w) if hasattr(w, "dequantize") else w) == 0))
        dense_bytes = numel * jnp.dtype(w.dtype).itemsize
        nbytes = int(w.nbytes)
        fmt = f"NMSparse {w.n}:{w.m}" if isinstance(w, NMSparse) else "BitmaskSparse" if isinstance(
            w, BitmaskSparse) else (describe_quantized(w) or "dense")
        out[n] = dict(zeros=z / numel, bytes=nbytes, dense_bytes=dense_bytes, format=fmt)
        zeros, size, stored, dense = zeros + z, size + numel, stored + nbytes, dense + dense_bytes
    out["total"] = dict(zeros=zeros / max(size, 1), bytes=stored, dense_bytes=dense, format="")
    return out

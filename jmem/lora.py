"""LoRA adapters on any weight leaf (float, quantized): QLoRA when the base is NF4.

`x @ W` becomes `x @ W + scale * (dropout(x) @ A) @ B` with `A[in, r]`,
`B[r, out]` and `scale = alpha / r` (or `alpha / sqrt(r)` with rsLoRA, Kalajdzievski
2023). B starts at zero, so a fresh adapter leaves the model unchanged. The
adapter is a pytree leaf wrapping the base leaf, so the model is unchanged and
`jax.lax.scan` slices the stacked-layers axis of base, A and B alike.

Only A and B are trainable: `split_trainable(state)` cuts a model state into
the adapter leaves and everything else, so gradients and optimizer state exist
for the adapters alone.

Dropout (`apply_lora(dropout=p)`) is a training-time transform: an adapter
drops only while it carries a key, and the stored model never needs one.
jmem's train step (`train.py --lora-dropout p`) keys the adapters of the model
it differentiates per step and microbatch; a custom jitted step calls
`with_dropout(state, step_key)`; inference (`jmem.LM.logits`, `generate`,
`merge`, `save_adapters`) never drops, since those ignore or clear the keys
(`without_dropout`).
"""

from __future__ import annotations

import json
import math
import os
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

from jmem.checks import as_python_scalar, check_bool, check_llama, check_targets, is_int, is_number
from jmem.models.config import EXPERT_TARGETS, LINEARS, as_dtype
from jmem.models.dot import dot, partition_specs
from jmem.models.moe import expert_matmul
from jmem.sampling import seed_key

# Every name `apply_lora` takes: the linears, a mixture-of-experts block's experts, the output head.
TARGETS = LINEARS + EXPERT_TARGETS + ("head",)
ADAPTER_FIELDS = ("lora_a", "lora_b")
BASE_SAMPLE = 256  # values of each adapted base weight an adapter file records (`check_base`)
BASE_MIN_CORRELATION = 0.5  # a quantized copy of the base keeps > 0.6 (NF4 0.995, 2-bit RTN 0.655); unrelated ~0


class LoRA:
    """A weight leaf `[..., in, out]` plus a low-rank adapter.

    Children: base (any weight leaf), lora_a [..., in, r], lora_b [..., r, out],
    and dropout_key (u32[..., 2] raw key data, or None: no dropout).
    Static: alpha, dropout rate, rslora.

    Example:
        >>> w = LoRA.init(NF4Tensor.quantize(w0), rank=16, alpha=32, key=jax.random.key(0))
        >>> y = jmem.models.dot.dot(x, w)
    """

    def __init__(self, base, lora_a, lora_b, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dropout_key=None):
        self.base, self.lora_a, self.lora_b = base, lora_a, lora_b
        self.alpha, self.dropout, self.rslora = float(alpha), float(dropout), bool(rslora)
        self.dropout_key = dropout_key

    @classmethod
    def init(cls, base, rank: int, alpha: float, key, dropout: float = 0.0, rslora: bool = False,
             dtype=jnp.float32) -> "LoRA":
        """A fresh adapter: A ~ N(0, 1/in), B = 0."""
        rank = check_rank(rank)
        alpha, dropout, dtype = check_settings(alpha, dropout, rslora, dtype)
        if len(base.shape) < 2:
            raise ValueError(f"LoRA base of shape {tuple(base.shape)}; accepted: a weight [..., in, out]")
        *lead, n_in, n_out = base.shape
        if rank > min(n_in, n_out):
            raise ValueError(f"LoRA rank={rank} exceeds the {n_in} x {n_out} weight's smaller side; accepted: "
                             f"1..{min(n_in, n_out)}")
        a = jax.random.normal(key, (*lead, n_in, rank), jnp.float32) * n_in ** -0.5
        b = jnp.zeros((*lead, rank, n_out), dtype)
        return cls(base, a.astype(dtype), b, alpha, dropout, rslora)

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        children = ((k("base"), self.base), (k("lora_a"), self.lora_a), (k("lora_b"), self.lora_b),
                    (k("dropout_key"), self.dropout_key))
        return children, (self.alpha, self.dropout, self.rslora)

    @classmethod
    def tree_unflatten(cls, aux, children):
        base, a, b, key = children
        return cls(base, a, b, *aux, dropout_key=key)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def nbytes(self) -> int:
        base = self.base.nbytes if hasattr(self.base, "dequantize") else self.base.size * self.base.dtype.itemsize
        return int(base + self.lora_a.nbytes + self.lora_b.nbytes)

    def __getitem__(self, index) -> "LoRA":
        """Index the leading (stacked-layers) axes of base, A, B and the dropout key alike."""
        return jax.tree_util.tree_map(lambda c: c[index], self)

    def delta(self) -> jax.Array:
        """The adapter's weight update `scale * A @ B`, f32[..., in, out]."""
        return self.scale * jnp.matmul(self.lora_a.astype(jnp.float32), self.lora_b.astype(jnp.float32))

    def dequantize(self, dtype=None) -> jax.Array:
        """The merged float weight `W + scale * A @ B`."""
        base = self.base.dequantize(jnp.float32) if hasattr(self.base, "dequantize") else self.base
        return (base.astype(jnp.float32) + self.delta()).astype(self.dtype if dtype is None else dtype)

    def __jmem_partition__(self, lead, rows, cols, row_pieces):
        """The base as it splits, A `[in, r]` on the input rows, B `[r, out]` on the output columns."""
        key = None if self.dropout_key is None else P()
        return LoRA(partition_specs(self.base, lead, rows, cols, row_pieces), P(*lead, rows, None),
                    P(*lead, None, cols), self.alpha, self.dropout, self.rslora, dropout_key=key)

    def _dropped(self, x: jax.Array) -> jax.Array:
        """The adapter's input: `x` with dropout while the adapter carries a key (one key per layer: an
        expert adapter's keys, one per expert, give their first)."""
        if not (self.dropout > 0.0 and self.dropout_key is not None):
            return x
        key = jax.random.wrap_key_data(jnp.reshape(self.dropout_key, (-1, 2))[0])
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

    def __jmem_dot__(self, x: jax.Array) -> jax.Array:
        y = dot(x, self.base)
        a, b = self.lora_a.astype(x.dtype), self.lora_b.astype(x.dtype)
        h = jnp.matmul(self._dropped(x), a, preferred_element_type=jnp.float32).astype(x.dtype)
        u = jnp.matmul(h, b, preferred_element_type=jnp.float32)
        return (y.astype(jnp.float32) + self.scale * u).astype(x.dtype)

    def __jmem_expert_dot__(self, x: jax.Array, matmul, tokens=None) -> jax.Array:
        """An adapted expert weight `[experts, in, out]` in `jmem.models.moe.moe_mlp`: `matmul(x, w)` multiplies
        rows by their expert's matrix; the adapter adds `scale * (x A) B` through it, as two thin matmuls
        (no merged `[experts, in, out]` weight, nor its gradient)."""
        y = expert_matmul(x, self.base, matmul)
        u = matmul(matmul(self._dropped(x), self.lora_a), self.lora_b)
        return (y.astype(jnp.float32) + self.scale * u.astype(jnp.float32)).astype(x.dtype)


jax.tree_util.register_pytree_with_keys_class(LoRA)


def check_rank(rank) -> int:
    """`rank` as a Python int (a 0-d NumPy/JAX integer too); ValueError unless a positive integer."""
    rank = as_python_scalar(rank)
    if not is_int(rank) or rank <= 0:
        raise ValueError(f"LoRA rank={rank!r} must be a positive integer")
    return rank


def check_settings(alpha, dropout, rslora, dtype):
    """`(alpha, dropout, dtype)` of an adapter, checked (0-d arrays taken as their numbers): alpha finite
    and > 0, dropout in [0, 1), rslora a bool, dtype floating; else one ValueError naming the field."""
    alpha, dropout = as_python_scalar(alpha), as_python_scalar(dropout)
    if not (is_number(alpha) and np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"LoRA alpha={alpha!r}; accepted: a finite number > 0")
    if not (is_number(dropout) and 0.0 <= dropout < 1.0):
        raise ValueError(f"LoRA dropout={dropout!r}; accepted: a number in [0, 1)")
    check_bool("LoRA rslora", rslora)
    return alpha, dropout, _floating_dtype(dtype)


def _floating_dtype(dtype, name: str = "LoRA dtype"):
    """`dtype` as a floating dtype; else one ValueError naming it."""
    try:
        return as_dtype(dtype)  # f32, bf16 or f16
    except ValueError:
        try:
            shown = jnp.dtype(dtype).name
        except TypeError:  # not a dtype
            shown = dtype
        raise ValueError(f"{name}={shown}; accepted: a floating dtype (float32, bfloat16, float16; or their names "
                         "f32, bf16, f16)") from None


def _kernel_var(model, name: str):
    if name == "head":
        if not hasattr(model, "head"):
            raise ValueError("target 'head' needs untied embeddings (the model ties its output to the embedding)")
        return model.head.kernel
    if name not in TARGETS:
        raise ValueError(f"unknown LoRA target {name!r}; accepted: {', '.join(TARGETS)}")
    present = model.config.weight_names()
    if name not in present:
        kind = "a mixture of experts" if model.config.moe_experts else "dense"
        raise ValueError(f"LoRA target {name!r} is not a weight of this model (its MLP is {kind}); accepted: "
                         f"{', '.join(present + (('head',) if hasattr(model, 'head') else ()))}")
    return model.layers.weight_var(name)


def apply_lora(model, rank: int = 8, alpha: float = 16.0, targets=("wq", "wv"), *, dropout: float = 0.0,
               rslora: bool = False, seed: int = 0, dtype=jnp.float32, inplace: bool = False):
    """Wrap the target kernels of a jmem Llama model in fresh LoRA adapters.

    Args:
      model: a `jmem.models.Llama` (its kernels may already be quantized).
      rank, alpha, dropout, rslora: adapter hyper-parameters (scale alpha/rank,
        or alpha/sqrt(rank) with rslora). Dropout acts only in train steps that call
        `with_dropout(state, step_key)` (or `set_dropout_key` per step); inference never drops.
      targets: names among wq, wk, wv, wo, w_gate, w_up, w_down, head; a mixture-of-experts
        model has moe.expert_gate, moe.expert_up, moe.expert_down (`[layers, experts, in, out]`:
        one adapter per expert) instead of w_gate, w_up, w_down.
      seed: initialises A; dtype: adapter dtype (e.g. jnp.bfloat16 for QLoRA).
      inplace: modify `model` instead of a copy.

    Raises:
      ValueError: a bad rank, alpha, dropout, seed or dtype; targets empty, unknown, repeated or
        already adapted.

    Example:
        >>> model = apply_lora(quantize(model, "nf4"), rank=16, alpha=32, targets=("wq", "wv"))
    """
    check_llama("model", model)
    targets = check_targets(targets, TARGETS)
    for name in targets:  # every name and setting checked before any work
        if isinstance(_kernel_var(model, name).get_value(), LoRA):
            raise ValueError(f"target {name!r} already has a LoRA adapter")
    rank = check_rank(rank)
    sides = {name: min(_kernel_var(model, name).get_value().shape[-2:]) for name in targets}
    smallest = min(sides, key=sides.get)
    if rank > sides[smallest]:  # the bound of every target at once (one target at a time named only its own)
        raise ValueError(f"LoRA rank={rank} exceeds {smallest}'s smaller side {sides[smallest]}; accepted: "
                         f"1..{sides[smallest]} for targets {', '.join(targets)}")
    check_settings(alpha, dropout, rslora, dtype)
    check_bool("inplace", inplace)
    key = seed_key(seed, "LoRA seed")
    if not inplace:
        model = nnx.clone(model)
    keys = jax.random.split(key, len(targets))
    for name, key in zip(targets, keys):
        var = _kernel_var(model, name)
        var.set_value(LoRA.init(var.get_value(), rank, alpha, key, dropout, rslora, dtype))
    return model


def _lora_vars(model) -> dict:
    check_llama("model", model)
    found = {}
    for name in TARGETS:
        try:
            var = _kernel_var(model, name)
        except ValueError:
            continue
        if isinstance(var.get_value(), LoRA):
            found[name] = var
    return found


def merge(model, *, inplace: bool = False):
    """Fold every adapter into its weight: kernels become float `W + scale * A @ B` arrays.

    A quantized base is dequantized first (re-quantize the merged model if needed). Dropout
    keys are dropped with the adapters: the merged model equals the unmerged one at inference.
    """
    if not _lora_vars(model):
        raise ValueError("the model has no LoRA adapters to merge")
    check_bool("inplace", inplace)
    if not inplace:
        model = nnx.clone(model)
    for var in _lora_vars(model).values():
        var.set_value(var.get_value().dequantize())
    return model


def remove_adapters(model, *, inplace: bool = False):
    """Take every adapter off: kernels go back to their base leaves (quantized ones stay packed).

    With `merge(model)` (a copy by default) this is how to serve the base model and an
    adapted one, or swap adapters: `load_adapters(remove_adapters(model), other_path)`.
    """
    loras = _lora_vars(model)
    if not loras:
        raise ValueError("the model has no LoRA adapters to remove")
    check_bool("inplace", inplace)
    if not inplace:
        model = nnx.clone(model)
    for var in _lora_vars(model).values():
        var.set_value(var.get_value().base)
    return model


def _keyed(lora: LoRA, key, i: int) -> LoRA:
    new_key = None
    if key is not None and lora.dropout > 0.0:
        if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
            raise ValueError(f"dropout key={key!r}; accepted: a typed PRNG key (jax.random.key(seed), not the "
                             "raw uint32 jax.random.PRNGKey) or None")
        lead = lora.lora_a.shape[:-2]
        k = jax.random.fold_in(key, i)
        new_key = jax.random.key_data(jax.random.split(k, int(np.prod(lead))).reshape(lead) if lead else k)
    return LoRA(lora.base, lora.lora_a, lora.lora_b, lora.alpha, lora.dropout, lora.rslora, new_key)


def with_dropout(tree, key):
    """`tree` (a model state, params dict, or any pytree) with every adapter that has dropout > 0
    given a key derived from `key`, so its forward drops; `key=None` is `without_dropout`.

    Pure, and traceable: call it inside the jitted train step with a per-step key.

    Example:
        >>> def loss_fn(train, frozen, batch, step_key):
        ...     state = with_dropout(combine(train, frozen), step_key)
        ...     return loss(nnx.merge(graphdef, state), batch)
    """
    counter = iter(range(1 << 30))
    return jax.tree_util.tree_map(lambda x: _keyed(x, key, next(counter)) if isinstance(x, LoRA) else x, tree,
                                  is_leaf=lambda x: isinstance(x, LoRA))


def without_dropout(tree):
    """`tree` with every adapter's dropout key removed (inference: no dropout)."""
    return with_dropout(tree, None)


def has_dropout(model) -> bool:
    """True when an adapter of `model` (an NNX module) has dropout > 0."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, LoRA))
    return any(isinstance(x, LoRA) and x.dropout > 0 for x in leaves)


def has_dropout_keys(tree) -> bool:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, LoRA))
    return any(isinstance(x, LoRA) and x.dropout_key is not None for x in leaves)


def set_dropout_key(model, key) -> None:
    """In place: give every adapter with dropout > 0 a fresh key; None turns dropout off.

    For training loops that step an NNX model statefully (call it once per step). A model
    left with keys still does not drop in `LM.logits` / `generate` / `merge` / `save_adapters`;
    jitted functional steps should prefer `with_dropout`.
    """
    for i, var in enumerate(_lora_vars(model).values()):
        var.set_value(_keyed(var.get_value(), key, i))


def is_adapter_path(path) -> bool:
    """True for the key path of a LoRA A or B array inside a model state."""
    return any(isinstance(p, jax.tree_util.GetAttrKey) and p.name in ADAPTER_FIELDS for p in path)


def split_trainable(tree):
    """`(trainable, frozen)`: the same tree twice, adapter arrays in the first and None elsewhere, and vice versa.

    Example:
        >>> graphdef, state = nnx.split(model)
        >>> train, frozen = split_trainable(state)
        >>> grads = jax.grad(lambda t: loss(nnx.merge(graphdef, combine(t, frozen))))(train)
    """
    train = jax.tree_util.tree_map_with_path(lambda p, x: x if is_adapter_path(p) else None, tree)
    frozen = jax.tree_util.tree_map_with_path(lambda p, x: None if is_adapter_path(p) else x, tree)
    return train, frozen


def combine(train, frozen):
    """Inverse of `split_trainable` (and of `trainable_split`: `frozen=None` gives `train` back)."""
    if frozen is None:
        return train
    return jax.tree_util.tree_map(lambda t, f: f if t is None else t, train, frozen, is_leaf=lambda x: x is None)


def trainable_split(tree, adapters_only: bool):
    """`(trainable, frozen)` for a train step: `split_trainable(tree)` when only adapters train,
    else `(tree, None)`; `combine` rejoins either. ValueError when nothing would train: adapters only
    of a model without any, or every weight of a model with integer (quantized) leaves."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if adapters_only:
        if not any(is_adapter_path(p) for p, _ in leaves):
            raise ValueError("adapters_only=True but the model has no LoRA adapters (nothing would train); "
                             "accepted: a model from jmem.lora.apply_lora, or adapters_only=False")
        return split_trainable(tree)
    from jmem.quant.qtensor import QTensor

    for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, QTensor)):
        what, accepted = getattr(x, "UNTRAINABLE", QTensor.UNTRAINABLE)  # a packed weight's own advice
        for leaf in jax.tree.leaves(x):
            dtype = getattr(leaf, "dtype", None)
            # An 8-bit float (an fp8 base) is no trainable weight either: its optimizer moments would be fp8 (NaN).
            if dtype is not None and (not jnp.issubdtype(dtype, jnp.inexact) or jnp.dtype(dtype).itemsize < 2):
                raise ValueError(f"weight {jax.tree_util.keystr(p)} is {jnp.dtype(dtype).name} ({what}) and cannot "
                                 f"be trained; accepted: {accepted}")
    return tree, None


def adapter_arrays(model) -> dict[str, np.ndarray]:
    """`{"wq.lora_a": ..., "wq.lora_b": ...}` for every adapted kernel."""
    out = {}
    for name, var in _lora_vars(model).items():
        out[f"{name}.lora_a"] = np.asarray(var.get_value().lora_a)
        out[f"{name}.lora_b"] = np.asarray(var.get_value().lora_b)
    return out


def save_adapters(model, path) -> None:
    """Write the adapters alone (A, B and their hyper-parameters) to the .npz file `path` (its folder must
    exist; an existing file is replaced)."""
    loras = _lora_vars(model)
    if not loras:
        raise ValueError("the model has no LoRA adapters to save (call apply_lora first)")
    path = os.path.expanduser(os.fspath(path))
    if not path.endswith(".npz"):  # numpy would write PATH.npz, which load_adapters(PATH) then misses
        raise ValueError(f"LoRA adapter path {path!r}; accepted: a file name ending in .npz")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"LoRA adapter path {path!r}: its folder does not exist; accepted: a path in an "
                         "existing folder")
    if os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is a directory; accepted: a file name ending in .npz")
    meta = {n: {"alpha": lo.alpha, "dropout": lo.dropout, "rslora": lo.rslora, "rank": lo.rank,
                "dtype": str(lo.lora_a.dtype), "dtype_b": str(lo.lora_b.dtype),
                "base_sample": base_sample(lo.base).tolist()}
            for n, lo in ((n, v.get_value()) for n, v in loras.items())}
    arrays = {k: (a.astype(np.float32) if a.dtype == jnp.bfloat16 else a) for k, a in adapter_arrays(model).items()}
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def save_peft_adapters(model, folder) -> None:
    """Write the adapters as a Hugging Face PEFT LoRA directory (`adapter_config.json` and
    `adapter_model.safetensors`) that PEFT and transformers load onto the base model in Hugging
    Face's layout (`jmem.io.peft.write_peft`); adapters on the linears and the head."""
    from jmem.io.peft import write_peft

    loras = {name: var.get_value() for name, var in _lora_vars(model).items()}
    if not loras:
        raise ValueError("the model has no LoRA adapters to save (call apply_lora first)")
    write_peft(loras, folder)


def read_adapters(path, n_layers: int | None = None) -> tuple[dict, dict]:
    """(per-target metadata, arrays) of a file written by `save_adapters` or of a Hugging Face PEFT
    LoRA directory (`jmem.io.peft`; `n_layers`, the model's layer count, pads the layers it leaves
    out), checked: one ValueError naming the file and what is wrong (missing, not such a file,
    metadata without a positive integer rank, a finite alpha and a boolean rslora, arrays absent, of
    another rank, not real floating point or not finite)."""
    from jmem.io.peft import is_peft_dir, read_peft

    path = os.path.expanduser(os.fspath(path))
    if is_peft_dir(path):
        meta, arrays = read_peft(path, n_layers)
    elif os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is a directory without adapter_config.json; accepted: an "
                         ".npz file written by jmem.lora.save_adapters or a PEFT LoRA directory")
    else:
        meta, arrays = _read_npz(path)
    return _check_adapter(path, meta, arrays)


def _read_npz(path) -> tuple[dict, dict]:
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter file {path!r} does not exist")
    try:
        with np.load(path) as f:
            meta = json.loads(bytes(f["__meta__"]).decode())
            arrays = {k: f[k] for k in f.files if k != "__meta__"}
    except Exception as e:  # noqa: BLE001 - any unreadable file is one user error
        # numpy's own text for a file that is no .npz suggests loading it as a pickle: name only its kind.
        why = f"{type(e).__name__}: {e}" if zipfile.is_zipfile(path) else "not an .npz archive"
        raise ValueError(f"{path!r} is not a LoRA adapter file written by jmem.lora.save_adapters ({why})") from None
    return meta, arrays


def _check_adapter(path, meta, arrays) -> tuple[dict, dict]:
    if not isinstance(meta, dict) or not meta:
        raise ValueError(f"adapter {path!r}: metadata {str(meta)[:60]!r} is not a map of targets; accepted: a file "
                         "written by jmem.lora.save_adapters")
    for name, m in meta.items():
        fields = m if isinstance(m, dict) else {}
        rank = fields.get("rank")
        if not (is_int(rank) and rank >= 1):
            raise ValueError(f"adapter {path!r}: metadata of {name!r} is {str(m)[:80]}; accepted: a positive "
                             "integer rank (as save_adapters writes)")
        try:  # what apply_lora accepts: a dropout of 2 would zero the adapter's input, an int8 dtype its A
            check_settings(fields.get("alpha"), fields.get("dropout", 0.0), fields.get("rslora"),
                           fields.get("dtype", "float32"))
            _floating_dtype(fields.get("dtype_b", fields.get("dtype", "float32")), "LoRA dtype_b")
        except ValueError as e:
            raise ValueError(f"adapter {path!r}: metadata of {name!r}: {e} (as save_adapters writes)") from None
        sample = fields.get("base_sample")
        if sample is not None and not (isinstance(sample, list) and len(sample) == BASE_SAMPLE
                                       and all(is_number(v) and np.isfinite(v) for v in sample)):
            raise ValueError(f"adapter {path!r}: base_sample of {name!r} is {str(sample)[:60]}; accepted: "
                             f"{BASE_SAMPLE} finite numbers (as save_adapters writes)")
        a, b = arrays.get(f"{name}.lora_a"), arrays.get(f"{name}.lora_b")
        if a is None or b is None:
            raise ValueError(f"adapter {path!r} lacks the arrays of target {name!r}")
        if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != rank or b.shape[-2] != rank:
            raise ValueError(f"adapter {path!r}: {name} A {a.shape} and B {b.shape} are not of its rank {rank}; "
                             "accepted: A [..., in, rank] and B [..., rank, out]")
        for key, x in ((f"{name}.lora_a", a), (f"{name}.lora_b", b)):
            if not np.issubdtype(x.dtype, np.floating):
                raise ValueError(f"adapter {path!r}: {key} holds {x.dtype} values; accepted: real floating-point "
                                 "arrays (as save_adapters writes)")
            if not np.isfinite(x).all():  # one NaN would reach every row of a batched MultiLoRA matmul
                raise ValueError(f"adapter {path!r}: {key} holds NaN or infinite values; accepted: finite weights")
    extra = sorted(set(arrays) - {f"{n}.{part}" for n in meta for part in ("lora_a", "lora_b")})
    if extra:  # an adapter for a target the metadata forgot would be dropped without a word
        raise ValueError(f"adapter {path!r} holds arrays {extra[:4]} of no target in its metadata "
                         f"({sorted(meta)}); accepted: a file written by jmem.lora.save_adapters")
    return meta, arrays


def base_sample(weight) -> np.ndarray:
    """`BASE_SAMPLE` values of a weight leaf (float or quantized, as stored) at fixed positions. An
    adapter file records them for each target, so that loading it onto an unrelated base (another
    model or random seed of the same shapes) is refused by `check_base`."""
    shape = tuple(weight.shape)
    where = np.unravel_index(np.random.default_rng(0).integers(0, math.prod(shape), BASE_SAMPLE), shape)
    return np.asarray(_sample_at(weight, where), np.float64)


@jax.jit
def _sample_at(weight, where):
    """The values of `weight` at indices `where`: a gather of 256 values (a quantized leaf's decoding
    fuses into it), never a float copy of the whole weight (a split base stays split)."""
    dense = weight.dequantize(jnp.float32) if hasattr(weight, "dequantize") else weight.astype(jnp.float32)
    return dense[where]


def check_base(path, target: str, meta: dict, weight) -> None:
    """Raise ValueError when the adapter file `path` was trained for `target` on a base unrelated to
    `weight` (the correlation of its recorded `base_sample` with this weight's is below
    `BASE_MIN_CORRELATION`); a quantized or rounded copy of that base passes. Files without a sample
    (older versions) are not checked."""
    if meta.get("base_sample") is None:
        return
    want, got = np.asarray(meta["base_sample"], np.float64), base_sample(weight)
    if np.array_equal(want, got):
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = float(np.corrcoef(want, got)[0, 1])
    if not corr >= BASE_MIN_CORRELATION:
        raise ValueError(f"adapter {os.fspath(path)!r} was trained on another base model: its {target} weights do "
                         f"not match this model's (correlation {corr:.2f} at {BASE_SAMPLE} sampled values, "
                         f"{BASE_MIN_CORRELATION} needed); accepted: the model it was trained on, quantized or not "
                         "(the same file, or the preset at the seed it was trained with: jmem.load(name, seed=...), "
                         "jmem generate / jmem serve --init-seed)")


def _base_of(value):
    """A kernel's weight leaf without its adapter, if it has one."""
    return value.base if isinstance(value, LoRA) else value


def load_adapters(model, path, *, inplace: bool = False):
    """Attach adapters saved by `save_adapters` (or a PEFT LoRA directory) to a model with the same base shapes.

    The model comes back with exactly the file's adapters: kernels that already carry one have it
    replaced, others are wrapped, and adapters on targets the file does not name are taken off
    (they belonged to another adapter). Every target is checked before anything changes.
    """
    check_llama("model", model)
    meta, arrays = read_adapters(path, model.config.n_layers)
    check_bool("inplace", inplace)
    for name in meta:
        base = _base_of(_kernel_var(model, name).get_value())
        a, b = arrays[f"{name}.lora_a"], arrays[f"{name}.lora_b"]
        lead, (n_in, n_out) = tuple(base.shape[:-2]), tuple(base.shape[-2:])
        if a.ndim != len(base.shape) or a.shape[:-1] != (*lead, n_in) or b.shape != (*lead, a.shape[-1], n_out):
            raise ValueError(f"adapter {name} has A {a.shape}, B {b.shape}, which do not fit the weight {base.shape}; "
                             f"accepted: A {[*lead, n_in, 'rank']} and B {[*lead, 'rank', n_out]}")
        check_base(path, name, meta[name], base)
    if not inplace:
        model = nnx.clone(model)
    for name, var in _lora_vars(model).items():
        if name not in meta:
            var.set_value(var.get_value().base)
    for name, m in meta.items():
        a_dtype = _floating_dtype(m.get("dtype", "float32"))  # as `read_adapters` checked it (f16 names float16)
        b_dtype = _floating_dtype(m.get("dtype_b", a_dtype))
        var = _kernel_var(model, name)
        var.set_value(LoRA(_base_of(var.get_value()), jnp.asarray(arrays[f"{name}.lora_a"], a_dtype),
                           jnp.asarray(arrays[f"{name}.lora_b"], b_dtype), m["alpha"], m.get("dropout", 0.0),
                           m["rslora"]))
    return model

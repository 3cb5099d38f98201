"""Tensor-parallel serving: one model's weights and paged KV cache split over a 1-D `tensor` mesh.

Megatron layout from the training rules (`jmem.parallel.rules.DEFAULT_RULES`):
wq/wk/wv and w_gate/w_up are column-parallel (their heads / mlp columns on
`tensor`), wo and w_down row-parallel (their input rows on `tensor`), the
embedding and head split over the vocabulary where it divides (else whole),
norms replicated. A mixture-of-experts MLP splits the same way inside every
expert (gate/up on their `mlp` columns, down on its `mlp` rows; the router
whole), so each device runs every expert's slice of columns on the tokens
routed to it, and the MoE block's output takes the one all-reduce a dense
MLP's does. The paged KV pool `[layers, kv_heads, pages, page_size,
head_dim]` is split on its kv-head axis, so each device holds the pages of
its own heads: for the same per-device budget the pool holds N times the
tokens.

The step is the single-device step, jitted with these input shardings: GSPMD
propagates them through the model (attention is per head, so the heads stay
where their pages are) and inserts one all-reduce after each row-parallel
matmul, two per layer. `step_collectives` reads the compiled program to check
that nothing else (no all-gather of a weight) runs inside the layer loop. The
Pallas paged-attention kernel, which GSPMD cannot split, runs per shard under
`jax.shard_map` (`PagedKVCache._attend_kernel`).

Example:
    >>> mesh = tensor_mesh(2)
    >>> check_tensor_parallel(model.config, 2)
    >>> state = shard_state(nnx.state(model), mesh)
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmem.checks import is_int
from jmem.parallel.mesh import make_mesh
from jmem.parallel.rules import ShardingError

TENSOR = "tensor"


class TensorParallelError(ValueError):
    """A tensor-parallel size the devices or the model cannot take."""


def check_tensor_parallel(config, tp: int, n_devices: int | None = None) -> None:
    """Refuse a tensor-parallel size that does not fit the local devices or the model's shapes.

    Args:
        config: the model config (n_heads, n_kv_heads, ffn_dim: every expert's too).
        tp: devices to split the model over.
        n_devices: local devices available (default: `jax.local_device_count()`).

    Raises:
        TensorParallelError: tp < 1, more than the local devices, or a head count / MLP width
            that does not divide by tp (names the numbers and what is accepted).

    Example:
        >>> check_tensor_parallel(LlamaConfig.tiny(), 2)   # 4 q heads, 2 kv heads: fine
    """
    if not is_int(tp) or tp < 1:
        raise TensorParallelError(f"tensor_parallel_size={tp!r}; accepted: an integer >= 1")
    n = jax.local_device_count() if n_devices is None else n_devices
    if tp > n:
        raise TensorParallelError(f"tensor_parallel_size={tp} exceeds the {n} local "
                                  f"{jax.default_backend()} devices; accepted: 1..{n}")
    if tp == 1:
        return
    # Whole query and key/value heads and MLP columns on every device (the serving rules shard all three).
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "ffn_dim": config.ffn_dim}
    bad = next((f"{name}={v}" for name, v in sizes.items() if v % tp), None)
    if bad is not None:
        g = math.gcd(*sizes.values())
        accepted = ", ".join(str(d) for d in range(1, min(g, n) + 1) if g % d == 0)
        raise TensorParallelError(f"tensor_parallel_size={tp}: {bad} is not divisible by {tp}; accepted: {accepted} "
                                  f"(dividing {', '.join(f'{k}={v}' for k, v in sizes.items())}, at most {n} devices)")


def tensor_mesh(tp: int, devices=None) -> Mesh:
    """A mesh over the first `tp` local devices with only the `tensor` axis larger than 1."""
    devices = list(jax.local_devices() if devices is None else devices)
    if tp > len(devices):
        raise TensorParallelError(f"tensor_parallel_size={tp} exceeds the {len(devices)} devices; "
                                  f"accepted: 1..{len(devices)}")
    return make_mesh({TENSOR: tp}, devices[:tp])


def shard_state(state, mesh: Mesh):
    """`state` (an NNX state) placed on `mesh` by `state_shardings`."""
    return jax.device_put(state, state_shardings(state, mesh))


def state_shardings(state, mesh: Mesh):
    """A tree of `NamedSharding`s shaped like `state`, from the default rules (see module doc).

    Float arrays split by their logical axes (`jmem.parallel.zero.tree_shardings` without ZeRO). A
    weight leaf implementing `__jmem_dot__` (quantized, GGUF-packed, LoRA, several LoRA adapters)
    splits its children the way its float kernel splits, as the leaf says
    (`jmem.models.dot.partition_specs`): column-parallel leaves on their output columns,
    row-parallel ones on their input rows in whole packing units.

    Raises:
        TensorParallelError: a leaf whose packing units (pack words, quantization groups, GGML
            blocks) a split of its input rows would cut; names the weight and the numbers.
    """
    from jmem.parallel.zero import tree_shardings

    try:
        return tree_shardings(state, mesh, zero=False, strict_packing=True)
    except ShardingError as e:
        raise TensorParallelError(f"tensor_parallel_size={mesh.shape[TENSOR]}: weight {e}") from None


def kv_pool_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Pages `[L, K, P, S, D]` (ndim 5) or scales `[L, K, P]` (ndim 3): kv heads on `tensor`."""
    return NamedSharding(mesh, P(None, TENSOR, *([None] * (ndim - 2))))


def step_collectives(hlo_text: str, weight_shapes) -> dict:
    """What the compiled step communicates: collectives per kind inside the layer loop and outside
    it, and the all-gathers whose result has the full shape of a weight (a stacked one or one
    layer's slice of it), which tensor parallelism must never need.

    Args:
        hlo_text: `jax.jit(step).lower(...).compile().as_text()`.
        weight_shapes: the full (unsharded) shapes of the model's weights.

    Example:
        >>> info = step_collectives(text, [x.shape for x in jax.tree.leaves(state)])
        >>> info["in_loop"]
        {'all-reduce': 2}
    """
    from jmem.parallel.hlo import collective_shapes, collectives

    full = {tuple(s) for s in weight_shapes} | {tuple(s[1:]) for s in weight_shapes if len(s) > 2}
    gathered = [s for s in collective_shapes(hlo_text, "all-gather") if s in full or s[1:] in full]
    return {"in_loop": collectives(hlo_text, in_loops=True), "outside": collectives(hlo_text, in_loops=False),
            "weight_all_gathers": gathered}

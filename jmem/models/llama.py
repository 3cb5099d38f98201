"""Llama-family decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Blocks are stacked: every block parameter has a leading `layers` axis and the forward
pass runs one block function under `jax.lax.scan`, so rematerialisation, parameter
offload and ZeRO-3 gathering happen per layer. Every linear layer goes through
`jmem.models.dot.dot`, so a weight leaf may be a plain array, a quantized tensor or a
LoRA-wrapped weight without any change here.

With `config.moe_experts > 0` the SwiGLU MLP of every block is a mixture of
experts (`jmem.models.moe`); each layer's router statistics leave the layer scan
as scan outputs, and `hidden_and_router_stats` returns them averaged over layers
so the training loss can add the load-balancing and z-losses. Forwards with a KV
cache route without capacity (`dropless`), so a token's output in generation does
not depend on how many tokens a call holds; forwards without one use the
capacity unless `config.moe_dropless`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmem.kernels import attention
from jmem.kernels.dispatch import resolve_impl
from jmem.memory.offload import fetch_layer
from jmem.models.config import EXPERT_TARGETS, LlamaConfig, as_dtype, normal_init
from jmem.models.dot import dot
from jmem.models.moe import MoEMLP, MoEStats, moe_mlp
from jmem.parallel.rules import ACTIVATION_AXES, MATMUL_INPUT_AXES, constrain, kernel_per_device

# Logical axis names of every parameter, by state path (read by the sharding rules).
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed.embedding": ("vocab", "embed"),
    "layers.attn_norm.scale": ("layers", "embed"),
    "layers.wq.kernel": ("layers", "embed", "heads"),
    "layers.wk.kernel": ("layers", "embed", "kv_heads"),
    "layers.wv.kernel": ("layers", "embed", "kv_heads"),
    "layers.wo.kernel": ("layers", "heads", "embed"),
    "layers.mlp_norm.scale": ("layers", "embed"),
    "layers.w_gate.kernel": ("layers", "embed", "mlp"),
    "layers.w_up.kernel": ("layers", "embed", "mlp"),
    "layers.w_down.kernel": ("layers", "mlp", "embed"),
    "norm.scale": ("embed",),
    "head.kernel": ("embed", "vocab"),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps):
    """RMSNorm computed in f32, returned in `x.dtype`.

    Its backward pass keeps only `x` in its own (compute) dtype and the f32 row
    scale `[..., 1]`: autodiff of the plain formula keeps an f32 copy of `x` and
    the f32 normalised `x` for every norm of every layer, which in bf16 compute
    is more than the bf16 activations themselves.
    """
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * r * scale.astype(jnp.float32)).astype(x.dtype), (x, scale, r)


def _rms_norm_bwd(eps, res, g):
    x, scale, r = res
    n = x.astype(jnp.float32) * r
    g32 = g.astype(jnp.float32)
    gn = g32 * scale.astype(jnp.float32)
    dx = r * (gn - n * jnp.mean(gn * n, axis=-1, keepdims=True))
    # Summed over the leading axes in place: flattening them first (a reshape) made XLA all-gather a
    # sequence-sharded x in sequence-parallel backward passes.
    dscale = jnp.sum(g32 * n, axis=tuple(range(n.ndim - scale.ndim)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope(x_BTHD, positions_BT, inv_freq_F, scale=1.0):
    """Rotary embedding, half-split layout (pairs dimension i with i + head_dim/2).

    Args:
        x_BTHD: queries or keys `[batch, seq, heads, head_dim]`.
        positions_BT: i32 positions `[batch, seq]`.
        inv_freq_F: f32[head_dim // 2] angle per position of each pair (`LlamaConfig.rope_frequencies`;
            0 leaves a pair unrotated), or a scalar frequency base for plain RoPE.
        scale: multiplies cos and sin of the rotated pairs (YaRN's attention temperature; 1 otherwise).
    """
    half = x_BTHD.shape[-1] // 2
    if np.ndim(inv_freq_F) == 0:  # a plain base
        inv_freq_F = 1.0 / (inv_freq_F ** (np.arange(half, dtype=np.float32) / half))
    angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F, jnp.float32)
    cos, sin = jnp.cos(angles_BTF)[:, :, None, :], jnp.sin(angles_BTF)[:, :, None, :]
    if scale != 1.0:  # only rotated pairs: partial rotary passes the rest through unchanged
        scale_F = jnp.where(jnp.asarray(inv_freq_F) != 0, jnp.float32(scale), jnp.float32(1.0))
        cos, sin = cos * scale_F, sin * scale_F
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


class Linear(nnx.Module):
    """`x @ kernel`, kernel `[*stack, in, out]` (stack = (layers,) inside the block stack)."""

    def __init__(self, din: int, dout: int, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        init = normal_init(din**-0.5)
        self.kernel = nnx.Param(init(rngs.params(), (*stack, din, dout), dtype))

    def __call__(self, x):
        return dot(x, self.kernel.get_value())


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((*stack, dim), dtype))


class Blocks(nnx.Module):
    """All decoder blocks, parameters stacked on a leading `layers` axis."""

    NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        s, d, dt = (cfg.n_layers,), cfg.dim, as_dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(d, stack=s, dtype=dt)
        self.wq = Linear(d, cfg.n_heads * cfg.head_dim, stack=s, dtype=dt, rngs=rngs)
        self.wk = Linear(d, cfg.n_kv_heads * cfg.head_dim, stack=s, dtype=dt, rngs=rngs)
        self.wv = Linear(d, cfg.n_kv_heads * cfg.head_dim, stack=s, dtype=dt, rngs=rngs)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, d, stack=s, dtype=dt, rngs=rngs)
        self.mlp_norm = RMSNorm(d, stack=s, dtype=dt)
        if cfg.moe_experts:  # the experts replace the dense MLP (params under `layers.moe`)
            self.moe = MoEMLP(d, cfg.ffn_dim, cfg.moe_experts, top_k=cfg.moe_top_k,
                              capacity_factor=cfg.moe_capacity_factor, stack=s, dtype=dt, rngs=rngs)
        else:
            self.w_gate = Linear(d, cfg.ffn_dim, stack=s, dtype=dt, rngs=rngs)
            self.w_up = Linear(d, cfg.ffn_dim, stack=s, dtype=dt, rngs=rngs)
            self.w_down = Linear(cfg.ffn_dim, d, stack=s, dtype=dt, rngs=rngs)

    def weight_var(self, name: str) -> nnx.Variable:
        """The variable of weight `name` (one of `LlamaConfig.weight_names()`): a linear's kernel, or a
        mixture of experts' stacked experts (`moe.expert_gate`, ...)."""
        return getattr(self.moe, name.removeprefix("moe.")) if name in EXPERT_TARGETS else getattr(self, name).kernel

    def weights(self) -> dict:
        """The stacked weight leaves by name (arrays or weight-leaf pytrees); MoE blocks have
        `moe` (router, gate, up, down) instead of `w_gate`, `w_up`, `w_down`."""
        names = [n for n in self.NAMES if hasattr(self, n)]
        out = {n: (m.scale if isinstance(m, RMSNorm) else m.kernel).get_value() for n in names
               for m in [getattr(self, n)]}
        if hasattr(self, "moe"):
            out["moe"] = self.moe.weights()
        return out


def block(cfg: LlamaConfig, w: dict, x_BTE, positions_BT, cache=None, cache_layer=None):
    """One decoder block on one layer's weights `w`; returns (x, new cache layer arrays)."""
    x_BTE, new_layer, _ = block_and_stats(cfg, w, x_BTE, positions_BT, cache, cache_layer)
    return x_BTE, new_layer


def _attention(q, k, v, impl: str):
    """Causal self-attention of a forward without a cache. The flash kernel runs per device on its
    batch rows and heads under an active `activation_sharding` (`kernel_per_device`)."""
    impl = resolve_impl(impl, q.dtype)
    if impl != "pallas":
        return attention(q, k, v, causal=True, impl=impl)
    q_axes, kv_axes = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
    return kernel_per_device(lambda q, k, v: attention(q, k, v, causal=True, impl="pallas"), (q, k, v),
                             (q_axes, kv_axes, kv_axes), q_axes)


def block_and_stats(cfg: LlamaConfig, w: dict, x_BTE, positions_BT, cache=None, cache_layer=None,
                    token_mask_BT=None):
    """`block` that also returns the layer's router statistics (`token_mask_BT`: 0 for padding,
    which an MoE layer neither routes into expert places nor counts; see `moe_mlp`).

    Returns:
        (x, new cache layer arrays or None, `MoEStats` of this layer or None for a dense MLP)
    """
    B, T, _ = x_BTE.shape
    x_BTE = checkpoint_name(x_BTE, "layer_input")
    # Norm outputs feed column-parallel matmuls: whole along the sequence (all-gathered
    # here when the residual stream is sequence-sharded; no-op without activation rules).
    h = checkpoint_name(constrain(rms_norm(x_BTE, w["attn_norm"], cfg.norm_eps), MATMUL_INPUT_AXES), "attn_norm")
    if "wqkv" in w:  # fused per-layer inference weights (`unstack_layers`): one matmul
        HD, KD = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = jnp.split(dot(h, w["wqkv"]), [HD, HD + KD], axis=-1)
    else:
        q, k, v = dot(h, w["wq"]), dot(h, w["wk"]), dot(h, w["wv"])
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    v = checkpoint_name(v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim), "value")
    inv_freq_F, rope_scale = cfg.rope_frequencies()
    q = checkpoint_name(rope(q, positions_BT, inv_freq_F, rope_scale), "query")
    k = checkpoint_name(rope(k, positions_BT, inv_freq_F, rope_scale), "key")
    if cache is None:
        o, new_layer = _attention(q, k, v, cfg.attention_impl), None
    else:
        o, new_layer = cache.attend(cache_layer, q, k, v, positions_BT)
    o = checkpoint_name(o, "attention")
    o = constrain(o.reshape(B, T, -1), ("batch", None, "heads"))
    x_BTE = x_BTE + checkpoint_name(dot(o, w["wo"]), "attn_out")
    h = checkpoint_name(constrain(rms_norm(x_BTE, w["mlp_norm"], cfg.norm_eps), MATMUL_INPUT_AXES), "mlp_norm")
    if "moe" in w:
        m = w["moe"]
        y, stats = moe_mlp(h, m["router"], m["gate"], m["up"], m["down"], top_k=cfg.moe_top_k,
                           capacity_factor=cfg.moe_capacity_factor, dropless=cfg.moe_dropless or cache is not None,
                           token_mask_BT=token_mask_BT)
        return x_BTE + checkpoint_name(y, "mlp_out"), new_layer, stats
    if "w_gate_up" in w:
        gate, up = jnp.split(dot(h, w["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = dot(h, w["w_gate"]), dot(h, w["w_up"])
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    hidden = checkpoint_name(constrain(jax.nn.silu(gate) * up, ("batch", None, "mlp")), "mlp_hidden")
    x_BTE = x_BTE + checkpoint_name(dot(hidden, w["w_down"]), "mlp_out")
    return x_BTE, new_layer, None


def _check_ids(ids_BT, vocab_size: int) -> None:
    ids = np.asarray(ids_BT)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids of shape {ids.shape} and dtype {ids.dtype}; accepted: integers [batch, seq]")
    if ids.shape[1] == 0:
        raise ValueError(f"token ids of shape {ids.shape}; accepted: at least one token per row")
    if ids.size and not 0 <= ids.min() <= ids.max() < vocab_size:
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"token ids hold {bad}; accepted: 0..{vocab_size - 1} (the model's vocabulary)")


def _check_weights(cfg: LlamaConfig, embedding, stacked: dict) -> None:
    """The embedding and stacked block weights have this config's shapes (a state merged from a model
    of another config ran its layer count, or failed in a reshape); weight-leaf pytrees (quantized,
    adapted) are not read."""
    hd, L = cfg.head_dim, cfg.n_layers
    want = {"embedding": (cfg.vocab_size, cfg.dim), "attn_norm": (L, cfg.dim), "wq": (L, cfg.dim, cfg.n_heads * hd),
            "wk": (L, cfg.dim, cfg.n_kv_heads * hd), "wo": (L, cfg.n_heads * hd, cfg.dim)}
    got = {"embedding": embedding, **{n: stacked[n] for n in want if n in stacked}}
    for name, w in got.items():
        if isinstance(w, (jax.Array, np.ndarray)) and tuple(w.shape) != want[name]:
            raise ValueError(f"the model's {name} weight has shape {tuple(w.shape)}, its config's is {want[name]}; "
                             "accepted: the state of a model built from this config (these are another "
                             "config's weights)")


def _remat(fn, spec: str | None):
    from jmem.memory.remat import get_policy

    policy = get_policy(spec)
    if policy is None:  # "none" or None; jax.checkpoint with policy=None would be full remat
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


class Llama(nnx.Module):
    """The decoder. `model(ids) -> (logits f32[batch, seq, vocab], cache)`.

    Example:
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> logits, _ = model(jnp.zeros((2, 8), jnp.int32))
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = as_dtype(config.param_dtype)
        self.embed = nnx.Embed(config.vocab_size, config.dim, param_dtype=dt, rngs=rngs,
                               embedding_init=normal_init(config.dim**-0.5))
        self.layers = Blocks(config, rngs=rngs)
        self.norm = RMSNorm(config.dim, dtype=dt)
        if not config.tie_embeddings:
            self.head = Linear(config.dim, config.vocab_size, dtype=dt, rngs=rngs)

    def hidden(self, ids_BT, positions=None, cache=None, layers=None, dropless: bool = False):
        """Final-normed hidden states `[batch, seq, dim]` in the compute dtype, and the cache.

        `positions`: i32[batch, seq], each token's absolute position. None continues each row where
        the cache left it (`ContiguousKVCache.lengths`: a prefill, then decode steps, need none), and
        is 0..seq-1 without a cache or with one that does not count what it holds (a paged cache's
        callers pass positions).
        `layers`: per-layer block weights from `unstack_layers(model)`; the blocks then run as
        an unrolled loop over them (inference; no remat) instead of a scan over the stacked
        weights. Pair it with a cache in per-layer form (`jmem.models.cache`).
        `dropless`: an MoE model routes every token to its experts whatever its capacity factor
        (as with a cache), so a row's output does not depend on the rows batched with it.
        """
        h, cache, _ = self._run(ids_BT, positions, cache, layers, dropless=dropless)
        return h, cache

    def hidden_and_router_stats(self, ids_BT, positions=None, token_mask_BT=None):
        """`(hidden states, MoEStats)`: the router statistics averaged over layers
        (`dropped` summed); None for a dense model. `token_mask_BT` (0 for padding inputs, a
        batch's "input_mask"; not its loss mask, which may zero real tokens) keeps padding out of
        expert places and statistics."""
        h, _, stats = self._run(ids_BT, positions, None, token_mask_BT=token_mask_BT)
        if stats is None:
            return h, None
        return h, MoEStats(jnp.mean(stats.aux_loss), jnp.mean(stats.z_loss), jnp.sum(stats.dropped),
                           jnp.mean(stats.load, axis=0))

    def _run(self, ids_BT, positions, cache, per_layer=None, token_mask_BT=None, dropless: bool = False):
        cfg = self.config.replace(moe_dropless=True) if dropless and self.config.moe_experts else self.config
        if not hasattr(ids_BT, "shape"):  # a list
            ids_BT = np.asarray(ids_BT)
        if positions is not None and not hasattr(positions, "shape"):
            positions = np.asarray(positions)
        if not isinstance(ids_BT, jax.core.Tracer):  # eager calls: the embedding lookup would clamp a bad id
            _check_ids(ids_BT, cfg.vocab_size)
        B, T = ids_BT.shape
        if positions is None and hasattr(cache, "next_positions"):
            positions = cache.next_positions(B, T)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        elif np.shape(positions) != (B, T) or not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
            raise ValueError(f"positions of {jnp.result_type(positions)}{list(np.shape(positions))}; accepted: "
                             f"integers [batch, seq] = {[B, T]}, the ids' shape")
        embedding, stacked = self.embed.embedding.get_value(), self.layers.weights()
        _check_weights(cfg, embedding, stacked)
        x = jnp.take(embedding, ids_BT, axis=0).astype(as_dtype(cfg.compute_dtype))

        # The residual stream between blocks follows the active sharding rules (sequence
        # sharding with `length=tensor`); a no-op outside `jmem.parallel.activation_sharding`.
        x = constrain(x, ACTIVATION_AXES)

        def body(x, xs):
            w, layer = xs
            w = fetch_layer(w)  # parameter offload: this layer's slice from host to device memory
            x, new_layer, stats = block_and_stats(cfg, w, x, positions, cache, layer, token_mask_BT)
            return constrain(x, ACTIVATION_AXES), (new_layer, stats)

        layers = None if cache is None else cache.layer_arrays()
        if layers is not None:
            _check_cache_layers(layers, per_layer is not None, cfg.n_layers)
        if per_layer is not None:
            x, (new_layers, stats_L) = _unrolled(body, x, per_layer, layers)
        else:
            x, (new_layers, stats_L) = jax.lax.scan(_remat(body, cfg.remat), x, (stacked, layers))
        if cache is not None:
            cache = cache.with_layers(new_layers)
            cache = cache.advanced(positions) if hasattr(cache, "advanced") else cache
        h = constrain(rms_norm(x, self.norm.scale.get_value(), cfg.norm_eps), ACTIVATION_AXES)
        return h, cache, stats_L

    def logits_from_hidden(self, h_BTE):
        """f32 logits `[batch, seq, vocab]` from hidden states."""
        if self.config.tie_embeddings:
            emb = self.embed.embedding.get_value()
            return jnp.einsum("bte,ve->btv", h_BTE, emb.astype(h_BTE.dtype), preferred_element_type=jnp.float32)
        return dot(h_BTE, self.head.kernel.get_value()).astype(jnp.float32)

    def __call__(self, ids_BT, positions=None, cache=None):
        """`(logits, cache)`; `positions` as in `hidden` (None continues where the cache left off). Without a
        cache an MoE model routes with its capacity factor, as in training
        (a row's logits may depend on the rows batched with it); `hidden(..., dropless=True)` does not."""
        h, cache = self.hidden(ids_BT, positions, cache)
        return self.logits_from_hidden(h), cache


def unstack_layers(model: Llama, fuse: bool = True) -> list[dict]:
    """The stacked block weights as one dict per layer (copies), for `model.hidden(..., layers=)`.

    With `fuse`, plain-array q/k/v kernels become one `wqkv` matrix and gate/up one
    `w_gate_up` (one matmul instead of three and two, which reads the weights faster at
    small batch; each output column is the same dot product). Quantized or wrapped
    weight leaves stay separate.

    Example:
        >>> h, cache = model.hidden(ids, cache=cache, layers=unstack_layers(model))
    """
    weights = model.layers.weights()
    out = []
    for i in range(model.config.n_layers):
        w = jax.tree.map(lambda a: a[i], weights)
        for fused, names in (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up"))):
            if fuse and all(isinstance(w.get(n), jax.Array) for n in names):
                w[fused] = jnp.concatenate([w.pop(n) for n in names], axis=-1)
        out.append(w)
    return out


def _check_cache_layers(layers, unrolled: bool, n_layers: int) -> None:
    """One ValueError for a cache of another depth or form than the layer loop that reads it."""
    listed = isinstance(layers, list)
    if listed and not unrolled:
        raise ValueError("a KV cache in per-layer form needs the per-layer weights; accepted: "
                         "model.hidden(..., layers=unstack_layers(model)) with it, or a stacked cache "
                         "(ContiguousKVCache.create(..., per_layer=False))")
    depth = len(layers) if listed else min(x.shape[0] for x in jax.tree.leaves(layers))
    if depth != n_layers:
        raise ValueError(f"the KV cache has {depth} layers, the model {n_layers}; accepted: a cache created for "
                         "this model's config")


def _unrolled(body, x, per_layer: list, cache_layers):
    """`lax.scan(body, x, (weights, cache_layers))` as a Python loop over per-layer weights.

    A cache in per-layer form (a list) is indexed and returned as a list; a stacked one is
    sliced and restacked.
    """
    listed = isinstance(cache_layers, list)
    outs = []
    for i, w in enumerate(per_layer):
        layer = None if cache_layers is None else (
            cache_layers[i] if listed else jax.tree.map(lambda a: a[i], cache_layers))
        x, out = body(x, (w, layer))
        outs.append(out)
    new_layers, stats = zip(*outs)
    stack = lambda items: None if items[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *items)
    return x, (list(new_layers) if listed else stack(new_layers), stack(stats))


def forward(graphdef, state, ids_BT, positions=None, cache=None):
    """Pure functional form: `(graphdef, state)` from `nnx.split(model)` -> (logits, cache)."""
    return nnx.merge(graphdef, state)(ids_BT, positions, cache)

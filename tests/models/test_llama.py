"""The decoder: cache consistency, functional form, dtypes, configuration errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models import ContiguousKVCache, Llama, LlamaConfig, forward, get_config, unstack_layers


@pytest.fixture(scope="module")
def tiny():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def test_prefill_then_decode_equals_full_forward(tiny):
    cfg = tiny.config
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    full, _ = tiny(ids)
    cache = ContiguousKVCache.create(cfg, 2, 16)
    first, cache = tiny(ids[:, :7], cache=cache)
    outs = [first]
    for t in range(7, 12):
        step, cache = tiny(ids[:, t:t + 1], positions=jnp.full((2, 1), t, jnp.int32), cache=cache)
        outs.append(step)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5)
    # Past the cache's end the writes used to be dropped silently (wrong logits): one clear error.
    with pytest.raises(ValueError, match="positions up to 11 do not fit a KV cache of max_len=8"):
        tiny(ids, cache=ContiguousKVCache.create(cfg, 2, 8))
    with pytest.raises(ValueError, match="positions up to 16 do not fit a KV cache of max_len=16"):
        tiny(ids[:, :1], positions=jnp.full((2, 1), 16, jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="12 new tokens do not fit a KV cache of max_len=8"):  # traced: the count
        jax.jit(lambda i, c: tiny(i, cache=c))(ids, ContiguousKVCache.create(cfg, 2, 8))
    # Traced positions cannot raise: the row whose write would be lost gets NaN, the other row is unchanged.
    pos = jnp.array([[15], [16]], jnp.int32)
    logits, _ = jax.jit(lambda i, p, c: tiny(i, positions=p, cache=c))(ids[:, 11:12], pos, cache)
    assert bool(jnp.all(jnp.isnan(logits[1]))) and not bool(jnp.any(jnp.isnan(logits[0])))
    # A negative position too (it wrote over the last slot and gave finite logits), and it writes nothing.
    logits, after = jax.jit(lambda i, p, c: tiny(i, positions=p, cache=c))(ids[:, 11:12], pos.at[1].set(-1), cache)
    assert bool(jnp.all(jnp.isnan(logits[1]))) and not bool(jnp.any(jnp.isnan(logits[0])))
    np.testing.assert_array_equal(after.k[:, 1], cache.k[:, 1])


def test_calls_without_positions_continue_where_the_cache_left_off(tiny):
    # A decode step without positions wrote over the cache's first slots and read the prompt back wrong.
    cfg = tiny.config
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
    full, _ = tiny(ids)
    step = jax.jit(lambda i, c: tiny(i, cache=c))
    for per_layer in (False, True):
        cache = ContiguousKVCache.create(cfg, 2, 16, per_layer=per_layer)
        run = (lambda i, c: tiny.hidden(i, cache=c, layers=unstack_layers(tiny))) if per_layer else step
        outs = []
        for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)):
            out, cache = run(ids[:, lo:hi], cache)
            outs.append(tiny.logits_from_hidden(out) if per_layer else out)
            np.testing.assert_array_equal(cache.lengths, [hi, hi])
        np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5)
    # Explicit positions move each row's count to one past its furthest write, never back.
    cache = ContiguousKVCache.create(cfg, 2, 16)
    _, cache = tiny(ids[:, :3], positions=jnp.array([[4, 5, 6], [0, 1, 2]], jnp.int32), cache=cache)
    _, cache = tiny(ids[:, :1], positions=jnp.array([[1], [3]], jnp.int32), cache=cache)
    np.testing.assert_array_equal(cache.lengths, [7, 4])


def test_lists_of_ids_and_positions_work_and_a_call_of_no_tokens_is_one_error(tiny):
    cfg = tiny.config
    ids = jax.random.randint(jax.random.key(3), (2, 3), 0, cfg.vocab_size)
    # Lists of ids and positions work as arrays do (an AttributeError and a TypeError before); a call of
    # no tokens is one error (NumPy's "zero-size array to reduction operation" with a cache).
    want, _ = tiny(ids, positions=jnp.array([[2, 3, 4]] * 2), cache=ContiguousKVCache.create(cfg, 2, 8))
    got, _ = tiny(ids.tolist(), positions=[[2, 3, 4]] * 2, cache=ContiguousKVCache.create(cfg, 2, 8))
    np.testing.assert_array_equal(got, want)
    for cache in (None, ContiguousKVCache.create(cfg, 2, 8)):
        with pytest.raises(ValueError, match=r"^token ids of shape \(2, 0\); accepted: at least one token per row$"):
            tiny(ids[:, :0], cache=cache)


def test_a_cache_that_does_not_fit_the_model_is_one_error(tiny):
    """A cache of another config (depth, heads, batch) or form was an error from inside JAX's scan or
    broadcasting; a negative position was written and read without a word; a dtype name was a TypeError."""
    cfg, ids = tiny.config, jnp.ones((1, 3), jnp.int32)
    for cache, message in (
            (ContiguousKVCache.create(cfg.replace(n_layers=3), 1, 16), "the KV cache has 3 layers, the model 2"),
            (ContiguousKVCache.create(cfg.replace(head_dim=8), 1, 16),
             r"the KV cache holds \[batch, kv_heads, head_dim\] = \[1, 2, 8\], the model writes \[1, 2, 16\]"),
            (ContiguousKVCache.create(cfg, 2, 16), r"holds \[batch, kv_heads, head_dim\] = \[2, 2, 16\]"),
            (ContiguousKVCache.create(cfg, 1, 16, per_layer=True), "a KV cache in per-layer form needs the per-layer "
                                                                    "weights")):
        with pytest.raises(ValueError, match=message):
            tiny(ids, cache=cache)
    with pytest.raises(ValueError, match=r"position -3 is negative; accepted: positions 0..15"):
        tiny(ids, positions=jnp.arange(-3, 0)[None], cache=ContiguousKVCache.create(cfg, 1, 16))
    # JAX's broadcasting and indexing errors before.
    for pos in (jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 3), jnp.float32)):
        with pytest.raises(ValueError, match=rf"^positions of {pos.dtype}\[1, {pos.shape[1]}\]; accepted: integers "
                                             r"\[batch, seq\] = \[1, 3\], the ids' shape$"):
            tiny(ids, positions=pos, cache=ContiguousKVCache.create(cfg, 1, 16))
    for kw, message in ((dict(batch=-1), "batch=-1"), (dict(max_len=0), "max_len=0")):
        with pytest.raises(ValueError, match=f"{message}; accepted: an integer >= 1"):
            ContiguousKVCache.create(cfg, **{"batch": 1, "max_len": 16, **kw})
    bf16 = ContiguousKVCache.create(cfg, 1, 16, dtype="bf16")
    assert bf16.k.dtype == jnp.bfloat16
    a, _ = tiny.hidden(ids, cache=ContiguousKVCache.create(cfg, 1, 16, per_layer=True), layers=unstack_layers(tiny))
    b, _ = tiny.hidden(ids, cache=ContiguousKVCache.create(cfg, 1, 16))
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("per_layer_cache", [True, False])
def test_unrolled_per_layer_path_equals_scan(tiny, per_layer_cache):
    """`hidden(..., layers=unstack_layers(model))` (the CPU decode path) equals the scanned blocks,
    with a per-layer and with a stacked cache, through prefill and decode."""
    cfg, layers = tiny.config, unstack_layers(tiny)
    assert {"wqkv", "w_gate_up"} <= set(layers[0]) and "wq" not in layers[0]  # fused projections
    ids = jax.random.randint(jax.random.key(3), (2, 9), 0, cfg.vocab_size)
    scan_cache = ContiguousKVCache.create(cfg, 2, 16)
    loop_cache = ContiguousKVCache.create(cfg, 2, 16, per_layer=per_layer_cache)
    for sl, pos in [(slice(0, 6), None), (slice(6, 7), jnp.full((2, 1), 6, jnp.int32))]:
        want, scan_cache = tiny.hidden(ids[:, sl], positions=pos, cache=scan_cache)
        got, loop_cache = tiny.hidden(ids[:, sl], positions=pos, cache=loop_cache, layers=layers)
        np.testing.assert_allclose(got, want, atol=2e-5)
    k = jnp.stack(loop_cache.k) if per_layer_cache else loop_cache.k
    np.testing.assert_allclose(k, scan_cache.k, atol=2e-5)
    assert loop_cache.per_layer == per_layer_cache and loop_cache.max_len == scan_cache.max_len == 16


def test_causality(tiny):
    ids = jax.random.randint(jax.random.key(2), (1, 10), 0, tiny.config.vocab_size)
    a, _ = tiny(ids)
    b, _ = tiny(ids.at[0, 6].set((ids[0, 6] + 1) % tiny.config.vocab_size))
    np.testing.assert_array_equal(a[0, :6], b[0, :6])
    assert not np.allclose(a[0, 6:], b[0, 6:])


def test_functional_form_matches_module(tiny):
    graphdef, state = nnx.split(tiny)
    ids = jnp.arange(8, dtype=jnp.int32)[None]
    logits, _ = jax.jit(forward, static_argnums=0)(graphdef, state, ids)
    np.testing.assert_allclose(logits, tiny(ids)[0], atol=1e-5)


def test_parameter_count_and_dtypes():
    cfg = LlamaConfig.tiny(param_dtype="bf16", compute_dtype="bf16")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params)
    assert sum(x.size for x in leaves) == cfg.num_params
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    logits, _ = model(jnp.zeros((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_bf16_model_holds_the_rounded_weights_of_the_f32_one(preset):
    """The weights were drawn in the parameter dtype: `--param-dtype bf16` built another random model, on which
    adapters trained against the f32 one were accepted without a word."""
    f32, bf16 = (nnx.state(Llama(get_config(preset, param_dtype=dt), rngs=nnx.Rngs(0)), nnx.Param)
                 for dt in ("f32", "bf16"))
    for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16), np.float32), np.asarray(b, np.float32))


def test_config_errors():
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        LlamaConfig.tiny(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="dtype 'f8' is not supported"):
        LlamaConfig.tiny(param_dtype="f8")
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_config("huge")


@pytest.mark.parametrize("overrides, expected", [
    # Each was accepted: an int8 model of zeros (zero logits), a width-1 model, NaN logits, tied embeddings
    # from a truthy string; or it failed later inside JAX or NumPy.
    (dict(param_dtype=np.int8), "dtype <class 'numpy.int8'> is not supported; accepted: f32,"),
    (dict(compute_dtype=jnp.int32), "is not supported; accepted: f32,"),
    (dict(dim=True), "LlamaConfig.dim=True must be a positive integer"),
    (dict(dim=64.0), "LlamaConfig.dim=64.0 must be a positive integer"),
    (dict(n_layers=None), "LlamaConfig.n_layers=None must be a positive integer"),
    (dict(vocab_size="259"), "LlamaConfig.vocab_size='259' must be a positive integer"),
    (dict(head_dim=15), "LlamaConfig.head_dim=15; accepted: an even number"),
    (dict(rope_dim=8.0), "LlamaConfig.rope_dim=8.0; accepted: 0"),
    (dict(rope_base=-1.0), "LlamaConfig.rope_base=-1.0; accepted: a finite number > 0"),
    (dict(rope_base=float("nan")), "LlamaConfig.rope_base=nan; accepted: a finite number > 0"),
    (dict(rope_base=None), "LlamaConfig.rope_base=None; accepted: a finite number > 0"),
    (dict(norm_eps=-1.0), "LlamaConfig.norm_eps=-1.0; accepted: a finite number >= 0"),
    (dict(tie_embeddings="no"), "LlamaConfig.tie_embeddings='no'; accepted: True or False"),
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_beta_fast=float("nan")), "rope_beta_fast=nan; accepted"),
    (dict(rope_scaling="linear", rope_factor="2"), "LlamaConfig.rope_factor='2' must be a finite number >= 1"),
    (dict(rope_original_context=8192.0), "LlamaConfig.rope_original_context=8192.0 must be a positive integer"),
    (dict(moe_experts=2.0), "LlamaConfig.moe_experts=2.0 must be >= 0"),
])
def test_bad_config_fields_are_one_clear_error(overrides, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        LlamaConfig.tiny(**overrides)


def test_config_fields_from_model_files_are_accepted():
    """NumPy scalars, as read from a model file, and jnp dtypes."""
    cfg = LlamaConfig.tiny(dim=np.int64(64), rope_base=np.float32(1e4), param_dtype=jnp.bfloat16)
    assert cfg.param_dtype == jnp.bfloat16
    assert Llama(cfg, rngs=nnx.Rngs(0))(jnp.array([[1, 2]]))[0].shape == (1, 2, 259)


@pytest.mark.parametrize("other, message", [
    (dict(n_layers=3), r"attn_norm weight has shape \(3, 64\), its config's is \(2, 64\)"),  # ran 3 layers
    (dict(n_kv_heads=4), r"wk weight has shape \(2, 64, 64\), its config's is \(2, 64, 32\)"),  # a reshape error
    (dict(vocab_size=300), r"embedding weight has shape \(300, 64\)"),  # logits 300 wide
])
def test_a_state_of_another_config_is_one_error(tiny, other, message):
    from jmem.generate import generate_ids

    graphdef, _ = nnx.split(tiny)
    _, state = nnx.split(Llama(LlamaConfig.tiny(**other), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=message + ".*accepted: the state of a model built from this config"):
        forward(graphdef, state, jnp.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match=message):
        generate_ids(nnx.merge(graphdef, state), [[1, 2, 3]], 4)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_rms_norm_custom_gradient_equals_autodiff(dtype, tol):
    """`rms_norm`'s hand-written backward pass (it keeps x in the compute dtype) equals autodiff of the formula."""
    from jmem.models.llama import rms_norm

    def plain(x, scale, eps=1e-5):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)

    kx, ks, kg = jax.random.split(jax.random.key(7), 3)
    x = (jax.random.normal(kx, (3, 5, 64)) * 3).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(ks, (64,))).astype(dtype)
    g = jax.random.normal(kg, (3, 5, 64)).astype(dtype)
    want = jax.vjp(plain, x, scale)[1](g)
    got = jax.vjp(lambda x, s: rms_norm(x, s, 1e-5), x, scale)[1](g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                                   atol=tol * float(jnp.abs(b.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(rms_norm(x, scale, 1e-5), np.float32), np.asarray(plain(x, scale), np.float32),
                               rtol=tol, atol=tol)

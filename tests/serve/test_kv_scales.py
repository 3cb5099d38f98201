"""Per-page-per-head scales of int8/fp8 KV pages: writes, attention over wide-range keys, the engine, the budget."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer
from jmem.kernels import xla_attention
from jmem.kernels.paged_attention import paged_attention_reference, ragged_paged_attention_reference, write_pages
from jmem.kernels.paged_attention.write import append_pages
from jmem.models import Llama, LlamaConfig
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.paged_cache import PagedKVCache, kv_bytes_per_token
from jmem.serve.request import SamplingParams
import jmem.serve.runner as runner_module
from jmem.serve.runner import ModelRunner
from jmem.serve.step_layout import build_layout, tiles_needed

QDTYPES = {"int8": (jnp.int8, np.int8, 127.0), "fp8_e4m3": (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0)}
f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


# ---------------------------------------------------------------- numpy reference of append_pages


def np_quantize(x, s, np_dtype, m):
    y = np.clip(np.float32(x) / np.float32(s if s > 0 else 1.0), -m, m).astype(np.float32)
    return (np.round(y) if np_dtype == np.int8 else y).astype(np_dtype)


def np_append(pages, scales, new_TKD, slots, np_dtype, m):
    """One `append_pages` call, page by page and head by head in numpy."""
    pages, scales = pages.copy(), scales.copy()
    K, N, P, D = pages.shape
    valid = slots >= 0
    for page in np.unique(slots[valid] // P):
        sel = valid & (slots // P == page)
        offs = slots[sel] % P
        first = offs.min()
        for h in range(K):
            old_s = np.float32(scales[h, page])
            amax = np.float32(np.abs(new_TKD[sel, h]).max())
            s = max(old_s if first > 0 else np.float32(0), amax * np.float32(1.0 / m))
            row = np.zeros((P, D), np_dtype)
            row[:first] = pages[h, page, :first]
            if s > old_s:  # the scale grew: earlier tokens are requantized to it
                row[:first] = np_quantize(pages[h, page, :first].astype(np.float32) * old_s, s, np_dtype, m)
            row[offs] = np_quantize(new_TKD[sel, h], s, np_dtype, m)
            pages[h, page], scales[h, page] = row, s
    return pages, scales


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_append_pages_matches_numpy_and_grows_scales(name):
    _, np_dtype, m = QDTYPES[name]
    rng = np.random.default_rng(0)
    K, N, P, D = 2, 6, 8, 16
    # Stale pools: garbage values and large scales that no fresh page may inherit.
    k8 = rng.integers(-100, 100, (K, N, P, D)).astype(np.float32).astype(np_dtype)
    v8 = rng.integers(-100, 100, (K, N, P, D)).astype(np.float32).astype(np_dtype)
    ks = rng.uniform(4.0, 5.0, (K, N)).astype(np.float32)
    vs = rng.uniform(4.0, 5.0, (K, N)).astype(np.float32)
    table_a, table_b = [4, 1], [2]
    slot = lambda table, pos: table[pos // P] * P + pos % P  # noqa: E731
    # (slots, magnitude of the new keys/values): A prefills small tokens, then large ones (page 4's
    # scale grows and its tokens are requantized, page 1 starts), then a small decode; B alongside;
    # finally page 4 is reused from slot 0 by another sequence with small values.
    steps = [
        ([slot(table_a, p) for p in range(5)] + [slot(table_b, p) for p in range(3)] + [-1, -1], 0.05),
        ([slot(table_a, p) for p in range(5, 11)] + [slot(table_b, 3), -1], 3.0),
        ([slot(table_a, 11), slot(table_b, 4)], 0.01),
        ([4 * P + p for p in range(3)], 0.02),
    ]
    jk, jv, jks, jvs = (jnp.asarray(x) for x in (k8, v8, ks, vs))
    truth = {}
    for i, (slots, mag) in enumerate(steps):
        slots = np.asarray(slots + [-1] * (10 - len(slots)), np.int32)  # one shape: one compile
        k_new = (mag * rng.standard_normal((len(slots), K, D))).astype(np.float32)
        v_new = (mag * rng.standard_normal((len(slots), K, D))).astype(np.float32)
        jk, jv, jks, jvs = append_pages(jk, jv, jks, jvs, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
        k8, ks = np_append(k8, ks, k_new, slots, np_dtype, m)
        v8, vs = np_append(v8, vs, v_new, slots, np_dtype, m)
        np.testing.assert_array_equal(np.asarray(jk).view(np.int8), k8.view(np.int8), err_msg=f"step {i}")
        np.testing.assert_array_equal(np.asarray(jv).view(np.int8), v8.view(np.int8), err_msg=f"step {i}")
        np.testing.assert_array_equal(np.asarray(jks), ks)
        np.testing.assert_array_equal(np.asarray(jvs), vs)
        if i == 0:
            scale_page4_small = ks[:, 4].copy()
        if i == 1:
            assert (ks[:, 4] > 10 * scale_page4_small).all(), "a larger token must grow the page's scale"
        for s in slots[(slots >= 0) & (slots % P == 0)]:  # a page restarted: its old tokens are gone
            truth = {t: x for t, x in truth.items() if t // P != s // P}
        for t, s in enumerate(slots):
            if s >= 0:
                truth[int(s)] = k_new[t]
    # Page 4 restarted from slot 0: its scale follows the new small values, not the old ones.
    assert (ks[:, 4] < 0.02 * 5 / m * 2).all()
    # Every live token reads back close to what was written, scales regrown or not.
    for s, x in truth.items():
        page, off = divmod(s, P)
        got = k8[:, page, off].astype(np.float32) * ks[:, page, None]
        bound = ks[:, page, None] if name == "int8" else 2**-3 * np.abs(x) + 2**-8 * ks[:, page, None]
        assert (np.abs(got - x) <= bound + 1e-7).all(), (s, np.abs(got - x).max())
    # Page 4's slots past the new sequence's tokens are cleared, not left with the old owner's.
    assert not k8[:, 4, 3:].astype(np.float32).any()
    # Pages never written keep their bits and scales.
    for page in (0, 3, 5):
        np.testing.assert_array_equal(np.asarray(jk)[:, page].view(np.int8), np.asarray(k8)[:, page].view(np.int8))


def test_append_pages_float_pools_are_plain_writes():
    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    slots = jnp.asarray([3, 4, 17, -1, 30], jnp.int32)
    k, v, ks, vs = append_pages(pool, pool, None, None, new, new, slots)
    want, _ = write_pages(pool, pool, new, new, slots)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want))
    assert ks is None and vs is None
    with pytest.raises(ValueError, match="need k_scale"):
        append_pages(pool.astype(jnp.int8), pool.astype(jnp.int8), None, None, new, new, slots)
    with pytest.raises(ValueError, match="k_scale is only for int8/float8_e4m3fn pages"):
        append_pages(pool, pool, jnp.ones((2, 4)), jnp.ones((2, 4)), new, new, slots)


# ---------------------------------------------------------------- attention over wide-range keys


def wide_range_case(rng, B=2, S=40, H=4, K=2, D=16, P=8):
    """Keys of head 0 ~ 1000 and of head 1 ~ 0.01, values the other way round, 2x swings
    between pages; queries scaled so every head's scores are of order 1."""
    head_k = np.array([1000.0, 0.01], np.float32)
    head_v = np.array([0.01, 1000.0], np.float32)
    swing = np.exp2(rng.uniform(-1, 1, (B, S // P, 1, K, 1))).repeat(P, 1).reshape(B, S, 1, K, 1)[:, :, 0]
    k = rng.standard_normal((B, S, K, D)).astype(np.float32) * head_k[:, None] * swing
    v = rng.standard_normal((B, S, K, D)).astype(np.float32) * head_v[:, None] * swing
    q = rng.standard_normal((B, H, D)).astype(np.float32) / np.repeat(head_k, H // K)[:, None]
    lengths = np.array([S, S - 11], np.int32)
    N = B * (S // P) + 3
    table = rng.permutation(N)[: B * (S // P)].reshape(B, S // P).astype(np.int32)
    return q, k, v, lengths, table, N, P


def write_in_steps(k, v, lengths, table, N, P, jdtype, scaled):
    """Prefill chunks then decode steps, as serving writes them; `scaled=False` is the unit-scale cast."""
    B, S, K, D = k.shape
    kp = jnp.zeros((K, N, P, D), jdtype)
    vp = jnp.zeros((K, N, P, D), jdtype)
    zeros = jnp.zeros((K, N), jnp.float32)
    ks, vs = (zeros, zeros) if scaled else (zeros + 1, zeros + 1)
    bounds = [0, 13, 30, 31, 32, 33, S]
    for lo, hi in zip(bounds, bounds[1:]):
        pos = np.arange(lo, hi)
        slots = np.concatenate([np.where(pos < lengths[b], table[b, pos // P] * P + pos % P, -1) for b in range(B)])
        # Padded to one shape (padding slots -1) so each write compiles once.
        pad = B * max(np.diff(bounds)) - len(slots)
        slots = np.concatenate([slots, np.full(pad, -1)])
        kn = jnp.asarray(np.concatenate([k[:, lo:hi].reshape(-1, K, D), np.zeros((pad, K, D), np.float32)]))
        vn = jnp.asarray(np.concatenate([v[:, lo:hi].reshape(-1, K, D), np.zeros((pad, K, D), np.float32)]))
        if scaled:
            kp, vp, ks, vs = append_pages(kp, vp, ks, vs, kn, vn, jnp.asarray(slots.astype(np.int32)))
        else:
            kp, vp = write_pages(kp, vp, kn, vn, jnp.asarray(slots.astype(np.int32)), k_scale=ks, v_scale=vs)
    return kp, vp, ks, vs


@pytest.mark.parametrize("name, tol", [("int8", 0.02), ("fp8_e4m3", 0.08)])
def test_wide_range_attention_needs_page_scales(name, tol):
    """Per-page scales keep attention over keys of 1000 and 0.01 near f32; the unit scale does not."""
    jdtype = QDTYPES[name][0]
    q, k, v, lengths, table, N, P = wide_range_case(np.random.default_rng(2))
    want = xla_attention(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v), causal=False,
                         kv_lengths=jnp.asarray(lengths))[:, 0]
    H, K = q.shape[1], k.shape[2]
    # Error relative to each head's output magnitude (heads differ by 1e5).
    head_mag = np.abs(f32(want)).reshape(-1, K, H // K, q.shape[2]).max(axis=(0, 2, 3)).repeat(H // K)

    def rel_err(scaled):
        kp, vp, ks, vs = write_in_steps(k, v, lengths, table, N, P, jdtype, scaled)
        got = paged_attention_reference(jnp.asarray(q), kp, vp, jnp.asarray(lengths), jnp.asarray(table),
                                        k_scale=ks, v_scale=vs)
        return float((np.abs(f32(got) - f32(want)).max(axis=(0, 2)) / head_mag).max())

    err_page, err_unit = rel_err(True), rel_err(False)
    assert err_page < tol, f"per-page scales: relative error {err_page:.4f} >= {tol}"
    assert err_unit > tol, f"unit scale unexpectedly within {tol}: {err_unit:.4f}"
    assert err_unit > 5 * err_page


# ---------------------------------------------------------------- the serving cache's per-step writes


def cache_steps(P):
    """Three steps of three sequences: prefill chunks, then decodes that cross page boundaries."""
    pages = {0: [9, 2, 6], 1: [4, 11, 0], 2: [7, 1, 5]}
    return [
        [(0, 6, pages[0]), (0, 9, pages[1]), (0, 3, pages[2])],
        [(6, 5, pages[0]), (9, 1, pages[1]), (3, 5, pages[2])],
        [(11, 1, pages[0]), (10, 1, pages[1]), (8, 1, pages[2])],
    ]


@pytest.mark.parametrize("name, impl", [("int8", "tiled"), ("fp8_e4m3", "tiled"), ("int8", "kernel")])
def test_cache_step_equals_append_pages_and_reads_what_it_wrote(name, impl):
    """`PagedKVCache.attend` + `with_layers` leave the pool `append_pages` leaves, and the step's
    attention (plain jnp, or the Pallas ragged kernel interpreted on CPU) reads exactly the
    stored (requantized) pages."""
    cfg = LlamaConfig.tiny(n_layers=1)
    K, D, H, P, N = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads, 4, 13
    spare, T, R = N - 1, 24, 4
    cache = PagedKVCache.create(cfg, N, P, name, impl)
    # Stale content everywhere: fresh pages must not inherit it.
    cache = cache.replace(k_pages=jnp.full_like(cache.k_pages, 7), k_scale=cache.k_scale + 3.0)

    @jax.jit
    def step(cache, q, k, v):
        o, new = cache.attend(jax.tree.map(lambda x: x[0], cache.layer_arrays()), q[None], k[None], v[None], None)
        return o[0], cache.with_layers(jax.tree.map(lambda x: x[None], new))

    rng = np.random.default_rng(3)
    kp, vp, ks, vs = cache.k_pages[0], cache.v_pages[0], cache.k_scale[0], cache.v_scale[0]
    for i, seqs in enumerate(cache_steps(P)):
        n = sum(s[1] for s in seqs)
        mag = [0.05, 4.0, 0.5][i]  # later steps grow some pages' scales
        q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
        k = jnp.asarray(mag * rng.standard_normal((T, K, D)), jnp.float32)
        v = jnp.asarray(mag * rng.standard_normal((T, K, D)), jnp.float32)
        assert tiles_needed([s[1] for s in seqs]) <= 6
        lay = build_layout(seqs, T, 6, 3, P, spare, max_seqs=R)
        o, cache = step(cache.replace(layout=lay), q, k, v)
        kp, vp, ks, vs = append_pages(kp, vp, ks, vs, k, v, lay.slot_mapping)
        # Every page but the spare (the layout's padding rows write there) is bit-identical.
        for got, want in ((cache.k_pages[0], kp), (cache.v_pages[0], vp)):
            np.testing.assert_array_equal(np.asarray(got)[:, :spare].view(np.int8), np.asarray(want)[:, :spare].view(np.int8))
        np.testing.assert_array_equal(np.asarray(cache.k_scale[0])[:, :spare], np.asarray(ks)[:, :spare])
        np.testing.assert_array_equal(np.asarray(cache.v_scale[0])[:, :spare], np.asarray(vs)[:, :spare])
        want_o = ragged_paged_attention_reference(q, kp, vp, lay.seq_kv_lens, lay.seq_pages, lay.cu_q_lens,
                                                  lay.num_seqs, k_scale=ks, v_scale=vs)
        tol = 1e-5 if impl == "tiled" else 2e-5
        np.testing.assert_allclose(f32(o)[:n], f32(want_o)[:n], rtol=tol, atol=tol)
        cache = cache.replace(layout=None)


# ---------------------------------------------------------------- the engine on the tiny model

SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_engine_quantized_kv_greedy_equals_full_precision(model):
    """fp8 and int8 pages with per-page scales give the f32 cache's greedy tokens.

    Their logprobs stay within 0.25 (fp8: 3 mantissa bits, the bound test_runner uses) and
    0.1 (int8: steps of 1/127 of each page's absmax); measured: 0.10 and 0.05.
    """
    rng = np.random.default_rng(4)
    ps = [[int(x) for x in rng.integers(0, 256, size=n)] for n in (21, 5, 13)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for name in ("auto", "fp8_e4m3", "int8"):
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=24, kv_cache_dtype=name, **SMALL))
        assert engine.runner.cache.k_pages.dtype == {"auto": jnp.float32, "fp8_e4m3": jnp.float8_e4m3fn,
                                                      "int8": jnp.int8}[name]
        outs[name] = engine.generate(ps, params)
        assert engine.metrics()["kv_cache_blocks_in_use"] == 0
    for name in ("fp8_e4m3", "int8"):
        for ref, got in zip(outs["auto"], outs[name], strict=True):
            assert got.token_ids == ref.token_ids, name
            lp_ref = np.array([lp for lp, _ in ref.logprobs])
            lp_got = np.array([lp for lp, _ in got.logprobs])
            np.testing.assert_allclose(lp_got, lp_ref, atol={"fp8_e4m3": 0.25, "int8": 0.1}[name], err_msg=name)


# ---------------------------------------------------------------- the budget


def test_scales_count_in_budget_and_fp8_holds_about_twice_bf16():
    cfg = LlamaConfig.smollm2_135m()
    L, K, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    for page in (8, 16, 32):
        assert kv_bytes_per_token(cfg, "bf16", page) == 2 * L * K * D * 2
        assert kv_bytes_per_token(cfg, "fp8_e4m3", page) == 2 * L * K * D + -(-2 * L * K * 4 // page)
        assert kv_bytes_per_token(cfg, "int8", page) == kv_bytes_per_token(cfg, "fp8_e4m3", page)
    budget = 64 << 20
    tokens = {d: (ModelRunner.num_blocks_for_budget(cfg, budget, 16, d) + 1) * 16 for d in ("bf16", "fp8_e4m3")}
    ratio = tokens["fp8_e4m3"] / tokens["bf16"]
    assert 1.98 <= ratio <= 2.0, ratio
    # The accounting is what the cache allocates: pages and scales of N pages.
    tiny = LlamaConfig.tiny()
    for name in ("fp8_e4m3", "int8", "bf16"):
        cache = PagedKVCache.create(tiny, 10, 8, name, "tiled")
        nbytes = sum(x.nbytes for x in cache.layer_arrays() if x is not None)
        assert nbytes == 10 * 8 * kv_bytes_per_token(tiny, name, 8)


@pytest.mark.parametrize("name", ["fp8_e4m3", "bf16"])
def test_step_never_converts_the_whole_pool(model, name):
    """The compiled engine step reads and writes fp8/bf16 pages without widening the whole pool
    (XLA's CPU backend did, around the layer scan and the write, when the pool crossed them as
    floats): no array of the pool's [layers, kv_heads, pages] shape in another float dtype."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=40, kv_cache_dtype=name, **SMALL))
    runner = engine.runner
    compiled = []
    step = runner_module._step_fn

    def spy(*args):
        compiled.append(step.lower(*args).compile().as_text())
        return step(*args)

    runner_module._step_fn = spy
    try:
        engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6]], SamplingParams(max_tokens=3, temperature=0.0))
    finally:
        runner_module._step_fn = step
    L, K, P = runner.cache.k_pages.shape[:3]
    pool = f"[{L},{K},{P},"
    assert compiled and all(pool in hlo for hlo in compiled)  # the pool is in the program...
    own = {"bf16": "bf16", "fp8_e4m3": "f8e4m3fn"}[name]
    wider = [t for t in ("f16", "bf16", "f32") if t != own]
    for hlo in compiled:  # ...only in its own width (as bits or as itself)
        widened = [t for t in wider if re.search(rf"(?<![a-z0-9]){t}{re.escape(pool)}", hlo)]
        assert not widened, widened

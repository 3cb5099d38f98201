"""Paged decode attention and write_pages: Pallas kernels (interpreted on CPU) against the jnp references."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.kernels import xla_attention
from jmem.kernels.paged_attention import (
    append_pages,
    dequantize_pages,
    paged_attention,
    paged_attention_reference,
    quantize_pages,
    ragged_paged_attention,
    slots_for,
    write_pages,
    write_pages_reference,
)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # bf16: a few ulps of outputs of order 1
f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


def paginate(xs_BSKD, page, rng, spare=3):
    """Scatters contiguous [B, S, K, D] arrays into shuffled pages of one shared table.

    Pages no sequence uses hold large garbage, so a kernel reading the wrong
    page fails loudly.
    """
    B, S, K, D = xs_BSKD[0].shape
    npg = S // page
    N = B * npg + spare
    table = rng.permutation(N)[: B * npg].reshape(B, npg).astype(np.int32)
    out = []
    for x in xs_BSKD:
        pages = 100 * rng.standard_normal((K, N, page, D)).astype(np.float32)
        pages[:, table] = f32(x).reshape(B, npg, page, K, D).transpose(3, 0, 1, 2, 4)
        out.append(jnp.asarray(pages, x.dtype))
    return out, table


def decode_case(seed, B, S, H, K, D, page, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    (k_pages, v_pages), table = paginate([k, v], page, rng)
    lengths = rng.integers(1, S + 1, B).astype(np.int32)
    lengths[0] = 0  # an empty row gives zeros
    lengths[-1] = S  # a full row
    used = np.arange(S // page)[None, :] < -(-lengths[:, None] // page)
    table = np.where(used, table, -1)  # entries past a length are never read
    return q, k, v, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(table)


@pytest.mark.parametrize(
    "backend,page,ratio,dtype,splits",
    [
        ("mosaic", 8, 1, jnp.float32, 1),
        ("triton", 16, 3, jnp.bfloat16, 2),
        ("mosaic", 32, 8, jnp.bfloat16, 2),
        ("triton", 8, 8, jnp.float32, 3),
    ],
)
def test_decode_matches_reference(backend, page, ratio, dtype, splits):
    K, D = 2, 32
    q, k, v, kp, vp, lengths, table = decode_case(page + ratio, 3, 6 * page, K * ratio, K, D, page, dtype)
    out = paged_attention(q, kp, vp, lengths, table, backend=backend, num_splits=splits, pages_per_compute_block=2, interpret=True)
    ref = paged_attention_reference(q, kp, vp, lengths, jnp.maximum(table, 0))
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(f32(out)[0])  # length 0
    # The reference itself against dense attention on the contiguous K/V.
    dense = xla_attention(q[:, None].astype(jnp.float32), f32(k), f32(v), causal=False, kv_lengths=lengths)[:, 0]
    np.testing.assert_allclose(f32(ref), f32(dense), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_stale_non_finite_slots_past_the_length_are_never_read(backend):
    """A reused page keeps an earlier request's values past the new length (write_pages leaves them): an inf
    there met a softmax weight of 0 in p @ v, and 0 * inf made the whole row NaN, in the kernels, their
    reference and the dispatcher's XLA path. The rows equal those over finite slots."""
    page, K, D = 8, 2, 32
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 4, D)), jnp.float32)
    k, v = (rng.standard_normal((2, 3 * page, K, D)).astype(np.float32) for _ in range(2))
    lengths = np.array([13, 3 * page - 1], np.int32)  # each row's last page holds stale slots
    stale = np.arange(3 * page)[None, :] >= lengths[:, None]
    k_bad, v_bad = np.where(stale[..., None, None], np.nan, k), np.where(stale[..., None, None], np.inf, v)
    table = jnp.asarray(np.arange(6, dtype=np.int32).reshape(2, 3))

    def pages(x):
        return jnp.asarray(x.reshape(2, 3, page, K, D).transpose(3, 0, 1, 2, 4).reshape(K, 6, page, D))

    lengths = jnp.asarray(lengths)
    want = paged_attention_reference(q, pages(k), pages(v), lengths, table)
    for fn in (lambda *a: paged_attention(*a, backend=backend, interpret=True), paged_attention_reference):
        got = fn(q, pages(k_bad), pages(v_bad), lengths, table)
        np.testing.assert_allclose(f32(got), f32(want), atol=2e-5, rtol=2e-5)
    dense = xla_attention(q[:, None], jnp.asarray(k_bad), jnp.asarray(v_bad), causal=False, kv_lengths=lengths)
    np.testing.assert_allclose(f32(dense[:, 0]), f32(want), atol=2e-5, rtol=2e-5)
    cu = jnp.asarray([0, 1, 2], jnp.int32)  # the same decode rows through the ragged kernel
    got = ragged_paged_attention(q, pages(k_bad), pages(v_bad), lengths, table, cu, 2, backend=backend,
                                 block_q=4, interpret=True)
    np.testing.assert_allclose(f32(got), f32(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend,qdtype,pdtype", [("mosaic", jnp.float32, jnp.int8), ("triton", jnp.bfloat16, jnp.float8_e4m3fn)])
def test_quantized_pages(backend, qdtype, pdtype):
    K, D, page = 2, 32, 16
    q, k, v, kp, vp, lengths, table = decode_case(7, 3, 4 * page, 2 * K, K, D, page, jnp.float32)
    q = q.astype(qdtype)
    kq, ks = quantize_pages(kp, pdtype)
    vq, vs = quantize_pages(vp, pdtype)
    out = paged_attention(q, kq, vq, lengths, table, k_scale=ks, v_scale=vs, backend=backend, interpret=True)
    ref = paged_attention_reference(q, kq, vq, lengths, jnp.maximum(table, 0), k_scale=ks, v_scale=vs)
    tol = TOL[qdtype] if qdtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(f32(out), f32(ref), atol=tol, rtol=tol)
    # Dequantized pages stay near the float ones (per-page absmax scales).
    step = float(jnp.max(ks)) * (1.0 if pdtype == jnp.int8 else 32.0)
    assert float(jnp.max(jnp.abs(dequantize_pages(kq, ks) - kp))) <= step


def test_write_pages_round_trip_and_reference():
    rng = np.random.default_rng(3)
    K, N, P, D, B, S = 2, 12, 8, 16, 2, 20
    table = jnp.asarray(rng.permutation(N)[: B * 3].reshape(B, 3), jnp.int32)
    pos = np.tile(np.arange(S), (B, 1)).astype(np.int32)
    pos[1, 15:] = -1  # padding tokens
    slots = slots_for(table, jnp.asarray(pos), P).reshape(-1)
    k_new = jnp.asarray(rng.standard_normal((B * S, K, D)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((B * S, K, D)), jnp.float32)
    empty = jnp.zeros((K, N, P, D), jnp.float32)
    kp, vp = write_pages(empty, empty, k_new, v_new, slots)
    kr, vr = write_pages_reference(empty, empty, k_new, v_new, slots)
    np.testing.assert_array_equal(f32(kp), f32(kr))
    np.testing.assert_array_equal(f32(vp), f32(vr))
    # Read back through the table: exactly the written tokens; padding never written.
    back = f32(kp)[:, np.asarray(table)].reshape(K, B, 3 * P, D).transpose(1, 2, 0, 3)
    np.testing.assert_array_equal(back[0, :S], f32(k_new)[:S])
    np.testing.assert_array_equal(back[1, :15], f32(k_new)[S : S + 15])
    assert not back[1, 15:].any()
    # Quantized pools: same bytes as the reference loop, and close to the input.
    ks = jnp.asarray(rng.uniform(0.02, 0.04, (K, N)), jnp.float32)
    k8, v8 = write_pages(jnp.zeros((K, N, P, D), jnp.int8), jnp.zeros((K, N, P, D), jnp.int8), k_new, v_new, slots, k_scale=ks, v_scale=ks)
    k8r, _ = write_pages_reference(jnp.zeros((K, N, P, D), jnp.int8), jnp.zeros((K, N, P, D), jnp.int8), k_new, v_new, slots, k_scale=ks, v_scale=ks)
    np.testing.assert_array_equal(np.asarray(k8), np.asarray(k8r))
    deq = f32(dequantize_pages(k8, ks))[:, np.asarray(table)].reshape(K, B, 3 * P, D).transpose(1, 2, 0, 3)
    in_range = np.abs(f32(k_new)[:S]) < 127 * 0.02
    err = np.abs(deq[0, :S] - f32(k_new)[:S])[in_range]
    assert err.max() <= 0.5 * 0.04 + 1e-6


def test_bad_inputs_name_the_problem():
    q, _, _, kp, vp, lengths, table = decode_case(0, 2, 32, 4, 2, 16, 8, jnp.float32)
    table = jnp.maximum(table, 0)
    with pytest.raises(ValueError, match="q_heads=3 must be a multiple of kv_heads=2"):
        paged_attention(q[:, :3], kp, vp, lengths, table)
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]=999 points outside the page pool"):
        paged_attention(q, kp, vp, lengths, table.at[1, 0].set(999))
    with pytest.raises(ValueError, match="lengths\\[1\\]=33 is outside \\[0, 32\\]"):
        paged_attention(q, kp, vp, lengths.at[1].set(33), table)
    with pytest.raises(ValueError, match=r"block_tables int32\[2, 0\] has no page columns; accepted: pages_per_seq >= 1"):
        paged_attention(q, kp, vp, lengths * 0, table[:, :0])
    for kw, message in [(dict(num_splits=0), r"num_splits=0; accepted: an integer in \[1, "),
                        (dict(pages_per_compute_block=0), "pages_per_compute_block=0; accepted: a power of two")]:
        with pytest.raises(ValueError, match=message):
            paged_attention(q, kp, vp, lengths, table, **kw)
    with pytest.raises(ValueError, match="need k_scale"):
        paged_attention(q, kp.astype(jnp.int8), vp.astype(jnp.int8), lengths, table)
    # An empty pool dimension (a ZeroDivisionError, or a gather from page -1, before).
    for cut, name in ((np.s_[:0], "kv_heads"), (np.s_[:, :0], "num_pages"), (np.s_[:, :, :0], "page_size")):
        with pytest.raises(ValueError, match=rf"pages \(.*\) have {name}=0; accepted: \[kv_heads, num_pages"):
            paged_attention(q, kp[cut], vp[cut], lengths * 0, table)
    with pytest.raises(ValueError, match=r"have head_dim=0; accepted"):
        paged_attention(q[..., :0], kp[..., :0], vp[..., :0], lengths, table)
    with pytest.raises(ValueError, match="interpret='False'; accepted: True or False"):  # ran the interpreter
        paged_attention(q, kp, vp, lengths, table, interpret="False")
    with pytest.raises(ValueError, match="head_dim=16 but pages have head_dim=8"):
        paged_attention(q, kp[..., :8], vp[..., :8], lengths, table)
    k8, v8 = kp.astype(jnp.int8), vp.astype(jnp.int8)
    with pytest.raises(ValueError, match="k_scale is a list; accepted: an f32 array"):
        paged_attention(q, k8, v8, lengths, table, k_scale=[[1.0] * 8] * 2, v_scale=jnp.ones((2, 8)))
    # Slots may be a list, as lengths and tables may (refused before).
    new = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 16)), jnp.float32)
    for write in (write_pages, lambda *a: append_pages(*a[:2], None, None, *a[2:])[:2]):
        for got, want in zip(write(kp, vp, new, new, [5, 9]), write(kp, vp, new, new, jnp.array([5, 9])), strict=True):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got[:, 1, 1], new[1])
    # A list for q or a pool was an AttributeError ('list' object has no attribute 'ndim').
    with pytest.raises(ValueError, match="^paged_attention: q is a list; accepted: an array$"):
        paged_attention(q.tolist(), kp, vp, lengths, table)
    with pytest.raises(ValueError, match="^write_pages: k_pages is a list; accepted: an array$"):
        write_pages(kp.tolist(), vp, jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)), jnp.array([0]))
    # A page written under a zero scale stored 127 and read back 0: every value lost.
    ones = jnp.ones(k8.shape[:2])
    scale = ones.at[1, 3].set(0.0)
    with pytest.raises(ValueError, match=r"k_scale\[1, 3\]=0.0 on a page written; accepted: finite scales > 0"):
        write_pages(k8, v8, jnp.ones((2, 2, 16)), jnp.ones((2, 2, 16)), jnp.array([0, 3 * 8 + 1]),
                    k_scale=scale, v_scale=ones)
    write_pages(k8, v8, jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)), jnp.array([0]), k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="^quantize_pages: dtype=int16; accepted: int8, float8_e4m3fn$"):
        quantize_pages(kp, jnp.int16)
    with pytest.raises(ValueError, match="k_new/v_new dtypes int32/int32; accepted: float arrays"):
        write_pages(kp, vp, jnp.zeros((1, 2, 16), jnp.int32), jnp.zeros((1, 2, 16), jnp.int32), jnp.array([0]))
    with pytest.raises(ValueError, match="slot_mapping\\[0\\]=9999 is past"):
        write_pages(kp, vp, jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)), jnp.array([9999]))
    with pytest.raises(ValueError, match="Triton \\(GPU\\) kernel needs a power-of-two head_dim; got 12"):
        paged_attention(q[..., :12], kp[..., :12], vp[..., :12], lengths, table, backend="triton", interpret=False)
    with pytest.raises(ValueError, match=r"^paged_attention: backend='cuda'; accepted: None \(the platform's\), "
                                         r"'triton', 'mosaic' \(GPU: 'triton'"):
        paged_attention(q, kp, vp, lengths, table, backend="cuda")
    # Under jit values are unknown, but shapes are still checked before the kernel.
    with pytest.raises(ValueError, match="block_tables has 1 rows but the batch is 2"):
        jax.jit(lambda l, t: paged_attention(q, kp, vp, l, t))(lengths[:1], table[:1])


def test_lowers_for_gpu_from_cpu():
    """The Triton bodies lower for CUDA without a GPU (Triton IR; PTX is made on the GPU)."""
    sd = jax.ShapeDtypeStruct
    B, H, K, D, N, P, npg = 4, 32, 8, 128, 64, 16, 8
    for dt in (jnp.bfloat16, jnp.float8_e4m3fn):
        quant = dt == jnp.float8_e4m3fn
        pages = [sd((K, N, P, D), dt)] * 2
        scales = [sd((K, N), jnp.float32)] * 2 if quant else [None, None]

        def decode(q, k, v, l, t, ks=None, vs=None):
            return paged_attention(q, k, v, l, t, k_scale=ks, v_scale=vs, backend="triton", interpret=False)

        def ragged(q, k, v, l, t, cu, n, ks=None, vs=None):
            return ragged_paged_attention(q, k, v, l, t, cu, n, k_scale=ks, v_scale=vs, backend="triton", interpret=False)

        i32 = jnp.int32
        extra = scales if quant else []
        jax.jit(decode).trace(sd((B, H, D), jnp.bfloat16), *pages, sd((B,), i32), sd((B, npg), i32), *extra).lower(lowering_platforms=("cuda",))
        jax.jit(ragged).trace(
            sd((24, H, D), jnp.bfloat16), *pages, sd((B,), i32), sd((B, npg), i32), sd((B + 1,), i32), sd((), i32), *extra
        ).lower(lowering_platforms=("cuda",))


def _tpu_aot_compile(topology, variants):
    """Compiles decode and ragged kernels ahead of time for a TPU topology through libtpu."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jmem[tpu]')")
    from jax.experimental import topologies
    from jax.sharding import Mesh, SingleDeviceSharding

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu's lock
    try:
        topo = topologies.get_topology_desc(topology, platform="tpu")
    except Exception as e:  # a libtpu that cannot describe this chip is not a kernel failure
        pytest.skip(f"libtpu cannot describe topology {topology}: {str(e)[:200]}")
    B, H, K, D, N, npg = 4, 32, 8, 128, 64, 8
    i32 = jnp.int32
    dev = topo.devices[0]
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))  # noqa: E731

    def decode(q, k, v, l, t, ks=None, vs=None):
        return paged_attention(q, k, v, l, t, k_scale=ks, v_scale=vs, backend="mosaic", interpret=False)

    def ragged(q, k, v, l, t, cu, n, ks=None, vs=None):
        return ragged_paged_attention(q, k, v, l, t, cu, n, k_scale=ks, v_scale=vs, backend="mosaic", interpret=False)

    with jax.set_mesh(Mesh(np.array(topo.devices[:1]), ("x",))):
        for kind, dt, page in variants:
            pages = [sd((K, N, page, D), dt)] * 2
            extra = [sd((K, N), jnp.float32)] * 2 if dt in (jnp.int8, jnp.float8_e4m3fn) else []
            qdt = jnp.float32 if dt == jnp.float32 else jnp.bfloat16
            if kind == "decode":
                args = [sd((B, H, D), qdt), *pages, sd((B,), i32), sd((B, npg), i32), *extra]
                compiled = jax.jit(decode).trace(*args).lower().compile()
            else:
                args = [sd((24, H, D), qdt), *pages, sd((B,), i32), sd((B, npg), i32), sd((B + 1,), i32), sd((), i32), *extra]
                compiled = jax.jit(ragged).trace(*args).lower().compile()
            assert compiled.as_text() is not None


def test_compiles_for_tpu_topology():
    """Mosaic compile for a TPU v5e ahead of time, no TPU needed (skips without libtpu)."""
    _tpu_aot_compile("v5e:2x2", [("decode", jnp.bfloat16, 16), ("ragged", jnp.bfloat16, 16), ("decode", jnp.int8, 8)])


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:2x2", "v6e:2x2"])
def test_compiles_for_tpu_topology_all_dtypes(topology):
    variants = [(kind, dt, page) for kind in ("decode", "ragged") for dt in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn) for page in (8, 32)]
    _tpu_aot_compile(topology, variants)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn])
def test_compiled_kernels_on_accelerator(dtype):
    """Compiled (not interpreted) kernels on the real device against the references."""
    K, D, page, B, S = 8, 128, 16, 8, 1024
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    q, k, v, kp, vp, lengths, table = decode_case(11, B, S, 4 * K, K, D, page, jnp.float32)
    q = q.astype(qdt)
    ks = vs = None
    if dtype in (jnp.int8, jnp.float8_e4m3fn):
        kp, ks = quantize_pages(kp, dtype)
        vp, vs = quantize_pages(vp, dtype)
    else:
        kp, vp = kp.astype(dtype), vp.astype(dtype)
    tol = 2e-3 if dtype == jnp.float32 else TOL[jnp.bfloat16]
    for splits in (1, 4):
        out = paged_attention(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs, num_splits=splits)
        ref = paged_attention_reference(q, kp, vp, lengths, jnp.maximum(table, 0), k_scale=ks, v_scale=vs)
        np.testing.assert_allclose(f32(out), f32(ref), atol=tol, rtol=tol, err_msg=f"splits={splits}")
    # Ragged: one 100-token prefill chunk at the end of sequence 1, decode tokens for the rest.
    kv_lens = jnp.maximum(lengths, 1).at[1].set(max(int(lengths[1]), 100))
    q_lens = np.ones(B, np.int32)
    q_lens[1] = 100
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    rng = np.random.default_rng(1)
    tab = jnp.asarray(rng.permutation(kp.shape[1])[: B * (S // page)].reshape(B, S // page), jnp.int32)
    qr = jnp.asarray(rng.standard_normal((int(cu[-1]) + 5, 4 * K, D)), qdt)
    # Fresh unit-scale pools: the decode pools' unused pages hold large garbage that this table would read.
    kp, vp = (jnp.asarray(rng.standard_normal(kp.shape), jnp.float32) for _ in range(2))
    if ks is not None:
        kp, ks = quantize_pages(kp, dtype)
        vp, vs = quantize_pages(vp, dtype)
    else:
        kp, vp = kp.astype(dtype), vp.astype(dtype)
    out = ragged_paged_attention(qr, kp, vp, kv_lens, tab, cu, B, k_scale=ks, v_scale=vs)
    from jmem.kernels.paged_attention import ragged_paged_attention_reference

    ref = ragged_paged_attention_reference(qr, kp, vp, kv_lens, tab, cu, B, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(f32(out), f32(ref), atol=tol, rtol=tol)


@pytest.mark.slow
def test_bench_quick_runs(tmp_path):
    """The benchmark's CPU smoke run completes and writes a row per measurement."""
    import json

    from tests.helpers import experiment

    bench = experiment("bench_attention")
    out = tmp_path / "bench.json"
    bench.main(bench.Config(quick=True, out=str(out), flash_tiles="32x16x8"))
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("jmem paged_attention bf16", "jmem paged_attention int8", "jmem ragged_paged_attention (all decode)"):
        assert rows[name]["ms"] > 0 and rows[name]["GB/s"] > 0, rows[name]
    for name in ("jmem flash_attention fwd+bwd", "jmem flash_attention (block 32x16, 8 warps) fwd",
                 "jmem flash_attention (block 32x16, 8 warps) fwd+bwd"):
        assert rows[name]["ms"] > 0 and rows[name]["TFLOP/s"] > 0, rows[name]


def test_kernel_body_follows_the_compile_target():
    """An ahead-of-time compile for a GPU/TPU from this CPU host gets the compiled body, not the interpreter."""
    from jmem.kernels.dispatch import compiling_for
    from jmem.kernels.paged_attention import core

    assert core.resolve("paged_attention", None, None) == ("mosaic", True)  # this CPU machine
    with compiling_for("tpu"):
        assert core.resolve("paged_attention", None, None) == ("mosaic", False)
    with compiling_for("gpu"):
        assert core.resolve("paged_attention", None, None) == ("triton", False)
    assert core.resolve("paged_attention", None, None) == ("mosaic", True)


def test_slots_for_drops_positions_past_the_table():
    """A position at or past pages_per_seq * page_size never maps into another sequence's page."""
    P = 8
    table = jnp.asarray([[3, 5], [1, 0]], jnp.int32)  # row 1's second page is page 0, row 0 owns page 3
    pos = jnp.asarray([[0, 15, 16, -1], [7, 8, 15, 40]], jnp.int32)
    want = np.asarray([[24, 47, -1, -1], [15, 0, 7, -1]])
    # Traced positions (the serving path): out-of-range ones give -1, which write_pages drops.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t, p: slots_for(t, p, P))(table, pos)), want)
    # Concrete positions: one clear error naming the position and the table's capacity.
    with pytest.raises(ValueError, match=r"positions\[0, 2\]=16 is past the block table's 2 pages x page_size 8 = 16"):
        slots_for(table, pos, P)
    in_range = jnp.where(pos >= 16, -1, pos)
    np.testing.assert_array_equal(np.asarray(slots_for(table, in_range, P)), np.where(want >= 0, want, -1))
    # End to end: writing a token past row 0's table changes no page.
    empty = jnp.zeros((1, 6, P, 4), jnp.float32)
    slots = jax.jit(lambda t, p: slots_for(t, p, P))(table, jnp.asarray([[17], [-1]], jnp.int32)).reshape(-1)
    kp, _ = write_pages(empty, empty, jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)), slots)
    assert not np.asarray(kp).any()


def test_slots_for_refuses_unallocated_table_entries():
    """A position whose table entry is -1 (no page yet) is an error when concrete and padding (-1) when traced."""
    table = jnp.asarray([[0, -1]], jnp.int32)
    pos = jnp.asarray([[3, 4, 5, 7]], jnp.int32)
    with pytest.raises(ValueError, match=r"positions\[0, 1\]=4 falls in block_tables\[0, 1\]=-1, an unallocated page"):
        slots_for(table, pos, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t, p: slots_for(t, p, 4))(table, pos)), [[3, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(slots_for(table, jnp.asarray([[2, -1]], jnp.int32), 4)), [[2, -1]])


def test_quantized_scales_must_be_float32():
    q, _, _, kp, vp, lengths, table = decode_case(1, 2, 16, 4, 2, 16, 8, jnp.float32)
    (k8, ks), (v8, vs) = quantize_pages(kp, jnp.int8), quantize_pages(vp, jnp.int8)
    with pytest.raises(ValueError, match="paged_attention: k_scale has dtype int32; accepted: float32"):
        paged_attention(q, k8, v8, lengths, table, k_scale=ks.astype(jnp.int32), v_scale=vs)
    new = jnp.zeros((1, 2, 16))
    with pytest.raises(ValueError, match="write_pages: v_scale has dtype bfloat16; accepted: float32"):
        write_pages(k8, v8, new, new, jnp.zeros((1,), jnp.int32), k_scale=ks, v_scale=vs.astype(jnp.bfloat16))


def test_a_page_read_under_a_negative_or_non_finite_scale_is_refused():
    # Such a scale flipped or poisoned every value of its page without a word; a page no
    # sequence reads may hold anything, and a zero scale (an empty or all-zero page) is valid.
    q, _, _, kp, vp, lengths, table = decode_case(2, 2, 16, 4, 2, 16, 8, jnp.float32)
    (k8, ks), (v8, vs) = quantize_pages(kp, jnp.int8), quantize_pages(vp, jnp.int8)
    read, unread = int(table[1, 0]), int(np.setdiff1d(np.arange(ks.shape[1]), np.asarray(table))[0])
    ragged = dict(kv_lens=lengths, block_tables=table, cu_q_lens=jnp.array([0, 0, 1], jnp.int32), num_seqs=2)
    for bad in (np.nan, -0.5, np.inf):
        with pytest.raises(ValueError, match=rf"^paged_attention: v_scale\[1, {read}\]={bad} on a page read; "
                                             r"accepted: finite scales >= 0"):
            paged_attention(q, k8, v8, lengths, table, k_scale=ks, v_scale=vs.at[1, read].set(bad))
        with pytest.raises(ValueError, match=rf"^ragged_paged_attention: k_scale\[0, {read}\]={bad} on a page read"):
            ragged_paged_attention(q, k8, v8, k_scale=ks.at[0, read].set(bad), v_scale=vs, **ragged)
    for scale in (ks.at[:, unread].set(np.nan), ks.at[:, read].set(0.0)):
        out = paged_attention(q, k8, v8, lengths, table, k_scale=scale, v_scale=vs)
        np.testing.assert_allclose(out, paged_attention_reference(q, k8, v8, lengths, table, k_scale=scale,
                                                                  v_scale=vs), atol=2e-5)
        assert np.isfinite(np.asarray(ragged_paged_attention(q, k8, v8, k_scale=scale, v_scale=vs, **ragged))).all()

"""Low-rank factorization: the factors against numpy's SVD, the whitened factors against the
calibration loss they minimise, a factorized model under jit, bytes, and errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.lowrank import LowRank, factorize, rank_for
from jmem.memory import measure
from jmem.models import Llama, LlamaConfig
from jmem.models.dot import dot
from jmem.quant import quantize
from jmem.quant.api import weight_bytes


def _rng(seed):
    return np.random.default_rng(seed)


def test_plain_factors_are_the_truncated_svd_and_batched_over_layers():
    w = _rng(0).normal(size=(3, 24, 16)).astype(np.float32)
    lr = LowRank.from_svd(jnp.asarray(w), rank=5)
    assert lr.shape == (3, 24, 16) and lr.u.shape == (3, 24, 5) and lr.v.shape == (3, 5, 16)
    for i in range(3):
        u, s, vt = np.linalg.svd(w[i].astype(np.float64))
        best = (u[:, :5] * s[:5]) @ vt[:5]
        np.testing.assert_allclose(np.asarray(lr[i].dequantize()), best, rtol=1e-4, atol=1e-5)
        # Eckart-Young: the error is the tail of the spectrum.
        err = np.linalg.norm(w[i] - np.asarray(lr[i].dequantize()))
        assert err == pytest.approx(np.sqrt(np.sum(s[5:] ** 2)), rel=1e-4)
    full = LowRank.from_svd(jnp.asarray(w), rank=16)
    np.testing.assert_allclose(np.asarray(full.dequantize()), w, atol=1e-5)


def test_whitened_factors_minimise_the_error_on_the_calibration_inputs():
    """With inputs whose channels differ in scale, the whitened rank-r factors give the smallest
    possible `||X (W - W_r)||_F` (the tail of the spectrum of L^T W), below plain SVD's."""
    rng = _rng(1)
    x = rng.normal(size=(400, 32)) * np.exp(rng.normal(size=32) * 1.5)  # a few loud channels
    w = rng.normal(size=(32, 20)).astype(np.float32)
    gram = x.T @ x / len(x)
    whitened = LowRank.from_svd(jnp.asarray(w), 6, gram=gram, damp=0.0)
    plain = LowRank.from_svd(jnp.asarray(w), 6)
    err = lambda lr: np.linalg.norm(x @ (w - np.asarray(lr.dequantize(), np.float64)))  # noqa: E731
    chol = np.linalg.cholesky(gram)
    s = np.linalg.svd(chol.T @ w.astype(np.float64), compute_uv=False)
    optimum = np.sqrt(np.sum(s[6:] ** 2) * len(x))
    assert err(whitened) == pytest.approx(optimum, rel=1e-3)
    assert err(whitened) < 0.8 * err(plain)


def test_dot_and_bytes():
    w = jnp.asarray(_rng(2).normal(size=(64, 48)), jnp.float32)
    lr = LowRank.from_svd(w, rank=rank_for(0.5, 64, 48))
    assert lr.rank == 13 and lr.nbytes == 13 * (64 + 48) * 4 and lr.nbytes <= 0.5 * w.nbytes
    x = jax.random.normal(jax.random.key(3), (5, 64), jnp.float32)
    y = jax.jit(dot)(x, lr)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(lr.dequantize()), rtol=1e-4, atol=1e-4)
    # bf16 compute: two bf16 matmuls (f32 accumulation), the rank-r intermediate rounded to bf16.
    xb = x.astype(jnp.bfloat16)
    yb = jax.jit(dot)(xb, lr)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    h = f32(f32(xb) @ f32(lr.u.astype(jnp.bfloat16))).astype(jnp.bfloat16)
    ref = f32(h) @ f32(lr.v.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(yb), ref, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def tiny():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def test_factorized_model_runs_under_jit_and_halves_its_bytes(tiny):
    ids = jax.random.randint(jax.random.key(4), (2, 16), 0, tiny.config.vocab_size)
    small = factorize(tiny, keep=0.5, calibration=np.asarray(ids), seq_len=16)
    assert not isinstance(tiny.layers.weights()["wq"], LowRank)  # the input model is untouched
    assert weight_bytes(small) <= 0.5 * weight_bytes(tiny)
    # Inside the layer scan the factor pairs are sliced per layer: the same logits as the dense
    # model holding each pair's product.
    dense = nnx.clone(small)
    for name, leaf in small.layers.weights().items():
        if isinstance(leaf, LowRank):
            getattr(dense.layers, name).kernel.set_value(leaf.dequantize())
    run = jax.jit(lambda g, s, i: nnx.merge(g, s)(i)[0])
    got, want = run(*nnx.split(small), ids), run(*nnx.split(dense), ids)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # Compiler-measured: the forward's matmul FLOPs drop by exactly the linears' difference,
    # 2 * tokens * (in * out - r * (in + out)) per matrix per layer.
    flops = lambda m: measure(lambda s, i: nnx.merge(nnx.graphdef(m), s)(i)[0], nnx.state(m), ids).matmul_flops  # noqa: E731
    saved = sum(2 * ids.size * (w.shape[-2] * w.shape[-1] - w.rank * sum(w.shape[-2:])) * tiny.config.n_layers
                for w in small.layers.weights().values() if isinstance(w, LowRank))
    assert flops(tiny) - flops(small) == pytest.approx(saved, rel=1e-9)
    # Whitened by the model's own activations, the calibration batch's logits move less than
    # with plain SVD at the same rank.
    plain = factorize(tiny, keep=0.5, targets=("w_gate", "w_up", "w_down"))
    whitened = factorize(tiny, keep=0.5, targets=("w_gate", "w_up", "w_down"), calibration=np.asarray(ids))
    base = run(*nnx.split(tiny), ids)
    gap = lambda m: float(jnp.linalg.norm(run(*nnx.split(m), ids) - base))  # noqa: E731
    assert gap(whitened) < gap(plain)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), "give exactly one of rank=None or keep=None"),
    (dict(rank=4, keep=0.5), "give exactly one"),
    (dict(keep=1.0), "keep=1.0; accepted: the fraction"),
    (dict(keep=0.0), "keep=0.0; accepted"),
    (dict(rank=0), "rank=0 for a"),
    (dict(rank=2.5), "rank=2.5 for a"),
    (dict(rank=31), "rank=31 for wk [64, 32] stores 2976 numbers, not fewer than the 2048 of the dense weight; "
                    "accepted: an integer in 1..21 (for every target)"),
    (dict(rank=100), "rank=100 for wq [64, 64] stores 12800 numbers, not fewer than the 4096 of the dense weight; "
                     "accepted: an integer in 1..21"),  # 1..64 before, then 1..31 at rank=64, then 1..21
    (dict(rank=4, targets=("wz",)), "unknown target 'wz'"),
    (dict(rank=4, targets=()), "targets is empty"),
    (dict(rank=4, targets=5), "targets=5; accepted: a name or a list of names among wq"),
    (dict(rank=4, targets=("wq", "wq")), "target 'wq' is listed twice"),
    (dict(rank=4, inplace="false"), "inplace='false'; accepted: True or False"),
    (dict(keep=0.5, calibration=np.zeros((1, 8), np.int32), damp=-1.0), "damp=-1.0; accepted: a finite number >= 0"),
    (dict(keep=0.5, calibration=np.zeros((1, 8), np.int32), damp=float("nan")), "damp=nan; accepted"),
    (dict(rank=4, damp=True), "damp=True; accepted"),
])
def test_bad_settings_are_one_clear_error(tiny, kwargs, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        factorize(tiny, **kwargs)


def test_quantized_or_out_of_vocabulary_input_is_refused(tiny):
    with pytest.raises(ValueError, match="target 'wq' holds a"):
        factorize(quantize(tiny, "int8"), keep=0.5)
    with pytest.raises(ValueError, match="out of range|vocab"):
        factorize(tiny, keep=0.5, calibration=np.full((1, 8), tiny.config.vocab_size, np.int32))


def test_bad_factor_inputs_are_one_clear_error():
    w = jnp.ones((8, 6), jnp.float32)
    for bad in (jnp.ones(8), [[1.0, 2.0]], jnp.ones((8, 6), jnp.int32)):
        with pytest.raises(ValueError, match=r"^w of .*; accepted: a float \[\.\.\., in, out\] matrix"):
            LowRank.from_svd(bad, 1)
    stacked = np.ones((3, 8, 6), np.float32)
    stacked[1, 2, 3] = np.nan  # numpy's SVD raised LinAlgError("SVD did not converge")
    with pytest.raises(ValueError, match=r"^the weight w has 1 non-finite value\(s\) \(layer 1\); accepted: finite"):
        LowRank.from_svd(jnp.asarray(stacked), 2)
    for damp in (-1.0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match=r"^damp=.*; accepted: a finite number >= 0"):
            LowRank.from_svd(w, 2, gram=jnp.eye(8), damp=damp)
    for keep in (0, -1, 2, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"^keep=.*; accepted: .* in \(0, 1\]"):
            rank_for(keep, 64, 48)
    assert rank_for(1, 64, 48) == rank_for(1.0, 64, 48) == 27 and rank_for(1e-9, 64, 48) == 1


def test_bad_gram_is_one_clear_error():
    """A gram of the wrong shape, all zero, negative or not positive definite: one ValueError naming what is
    accepted (was a NumPy broadcasting error or LinAlgError)."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=(20, 12)), jnp.float32)
    accepted = r"; accepted: a positive semi-definite input Gram X\^T X of shape \[20, 20\], with a positive mean"
    for gram, what in [(np.eye(5), r"gram of shape \(5, 5\) for a w of shape \(20, 12\)"),
                       (np.ones(20), r"gram of shape \(20,\)"),
                       (np.ones((3, 20, 20)), r"gram of shape \(3, 20, 20\)"),
                       ("eye", "gram of type str"),
                       (np.zeros((20, 20)), "gram with mean diagonal 0"), (-np.eye(20), "gram with mean diagonal -1"),
                       (np.full((20, 20), np.nan), "gram with 400 non-finite entries")]:
        with pytest.raises(ValueError, match="^" + what + ".*" + accepted):
            LowRank.from_svd(w, 3, gram=gram)
    indefinite = np.eye(20)
    indefinite[0, 0] = -5.0
    with pytest.raises(ValueError, match=r"^gram not positive definite after damp=0\.01" + accepted):
        LowRank.from_svd(w, 3, gram=indefinite)
    with pytest.raises(ValueError, match=r"after damp=0; .*\(or a larger damp\)$"):
        LowRank.from_svd(w, 3, gram=np.diag([1.0] * 19 + [0.0]), damp=0)
    stacked = jnp.stack([w, w])
    with pytest.raises(ValueError, match=r"shape \[20, 20\] or \[2, 20, 20\] \(w's leading axes\)"):
        LowRank.from_svd(stacked, 3, gram=np.ones((3, 20, 20)))
    x = np.random.default_rng(1).normal(size=(64, 20))
    one = LowRank.from_svd(stacked, 3, gram=x.T @ x)
    per_layer = LowRank.from_svd(stacked, 3, gram=np.stack([x.T @ x] * 2))
    np.testing.assert_allclose(one.dequantize(), per_layer.dequantize(), rtol=1e-5, atol=1e-5)


def test_default_targets_of_a_mixture_of_experts_model_are_its_attention_linears():
    """The default was all seven linears, which an MoE block lacks: factorize(moe) was an error by default."""
    moe = Llama(LlamaConfig.tiny_moe(), rngs=nnx.Rngs(0))
    low = factorize(moe, rank=8)
    assert [n for n in moe.config.weight_names() if isinstance(low.layers.weight_var(n).get_value(), LowRank)] == [
        "wq", "wk", "wv", "wo"]
    with pytest.raises(ValueError, match=r"^targets \['w_down'\] are not linear kernels of this model's blocks"):
        factorize(moe, rank=8, targets="w_down")

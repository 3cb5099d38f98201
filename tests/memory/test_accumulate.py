"""Gradient accumulation: k microbatches give the full-batch gradient."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.memory.accumulate import accumulate_value_and_grad, check_divisible, split_microbatches
from jmem.models.config import LlamaConfig
from jmem.models.llama import Llama
from jmem.train.loss import lm_loss_sum
from jmem.train.step import split_params


def test_matches_full_batch_on_a_regression():
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(24, 8)), jnp.float32), "y": jnp.asarray(rng.normal(size=(24, 3)), jnp.float32)}
    n = batch["x"].shape[0]

    def f(p, b):  # additive over the batch: sum / global count
        r = jnp.tanh(b["x"] @ p["w"] + p["b"]) - b["y"]
        return jnp.sum(r * r) / n, jnp.sum(jnp.abs(r))

    (v1, a1), g1 = jax.value_and_grad(f, has_aux=True)(params, batch)
    for k in (2, 3, 4, 8):
        (vk, ak), gk = jax.jit(lambda p, b: accumulate_value_and_grad(f, p, b, k, has_aux=True))(params, batch)
        np.testing.assert_allclose(vk, v1, rtol=1e-5)
        np.testing.assert_allclose(ak, a1, rtol=1e-5)
        for x, y in zip(jax.tree.leaves(gk), jax.tree.leaves(g1)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
            assert x.dtype == y.dtype
    # An aux that holds Python numbers (as `jax.value_and_grad` allows) is summed like the arrays.
    (_, aux), _ = accumulate_value_and_grad(lambda p, b: (f(p, b)[0], {"rows": b["x"].shape[0], "one": 1.0}),
                                            params, batch, 4, has_aux=True)
    assert int(aux["rows"]) == 24 and float(aux["one"]) == 4.0


def test_lm_gradient_with_masked_tokens_equals_full_batch():
    """The LM objective divided by the *global* token count: microbatches with
    different numbers of unmasked tokens still add up to the full-batch gradient."""
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(3))
    graphdef, params, rest, treedef = split_params(model)
    rng = np.random.default_rng(2)
    B, T = 4, 32
    ids = rng.integers(0, 259, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)
    mask[0] = 0.0  # one microbatch row contributes nothing
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": mask}

    def both(p, b):
        n = jnp.sum(b["mask"])

        def f(p, mb):
            m = nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(p)), rest)
            return lm_loss_sum(m, mb, chunk=8)[0] / n

        return jax.value_and_grad(f)(p, b), accumulate_value_and_grad(f, p, b, 2)

    (v1, g1), (v2, g2) = jax.jit(both)(params, batch)
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bad_accum_is_one_clear_error():
    with pytest.raises(ValueError, match=r"accum=3 does not divide batch=8; accepted values: 1, 2, 4, 8"):
        check_divisible(8, 3)
    with pytest.raises(ValueError, match="accum=0"):
        check_divisible(8, 0)
    with pytest.raises(ValueError, match="does not divide batch=6"):
        split_microbatches({"x": np.zeros((6, 2))}, 4)
    with pytest.raises(ValueError, match="does not divide"):
        accumulate_value_and_grad(lambda p, b: jnp.sum(b["x"]) * p, 1.0, {"x": jnp.zeros((5, 2))}, 2)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.int32, "bf16", None])
def test_a_bad_accumulator_dtype_is_one_clear_error(dtype, k):
    """int32 truncated the float gradients to zero; "bf16" was numpy's TypeError; k=1 ignored it."""
    with pytest.raises(ValueError, match=r"^accumulate_value_and_grad accum_dtype=.*; accepted: a floating dtype"):
        accumulate_value_and_grad(lambda p, b: jnp.sum(b["x"]) * p, 1.0, {"x": jnp.ones((4, 2))}, k, accum_dtype=dtype)


@pytest.mark.parametrize("batch, leaf", [
    ({"x": jnp.ones((4, 2)), "n": 3}, "batch['n'] is 3 (int, no shape)"),
    ({"x": jnp.ones(())}, "batch['x'] has shape ()"),
    ((jnp.ones(4), [1.5]), "batch[1][0] is 1.5 (float, no shape)"),
])
def test_a_leaf_without_a_batch_dimension_is_one_clear_error(batch, leaf):
    message = "^" + re.escape(f"split_microbatches: leaf {leaf}; accepted: every leaf an array with a leading batch")
    with pytest.raises(ValueError, match=message):
        split_microbatches(batch, 2)
    with pytest.raises(ValueError, match=message):
        accumulate_value_and_grad(lambda p, b: p * jnp.sum(jax.tree.leaves(b)[0]), 1.0, batch, 2)


def test_split_is_contiguous_rows():
    x = np.arange(12).reshape(6, 2)
    s = split_microbatches({"x": x}, 3)["x"]
    assert s.shape == (3, 2, 2)
    np.testing.assert_array_equal(s[1], x[2:4])


def test_accum_is_an_integer_numpy_ones_included_bools_not():
    f = lambda p, b: jnp.sum(b["x"]) * p  # noqa: E731
    batch = {"x": jnp.arange(8.0).reshape(4, 2)}
    np.testing.assert_allclose(accumulate_value_and_grad(f, 2.0, batch, np.int64(2)),
                               accumulate_value_and_grad(f, 2.0, batch, 2))
    check_divisible(8, np.int32(4))
    for bad in (True, False, 2.0, "2", None):
        with pytest.raises(ValueError, match=rf"^accum={bad!r}; accepted: an integer >= 1"):
            check_divisible(8, bad)
        with pytest.raises(ValueError, match=rf"^accum={bad!r}; accepted: an integer >= 1"):
            accumulate_value_and_grad(f, 2.0, batch, bad)


def test_train_step_takes_a_numpy_accum():
    """make_train_fns(accum=np.int64(2)) traces (it was refused as 'not an integer')."""
    import optax

    from jmem.train.step import make_train_fns

    model = Llama(LlamaConfig.tiny(n_layers=1), rngs=nnx.Rngs(0))
    fns = make_train_fns(model, optax.sgd(1e-3), accum=np.int64(2))
    ids = jnp.zeros((4, 9), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": jnp.ones((4, 8), jnp.float32)}
    state = jax.eval_shape(lambda: fns.init_state(model))
    _, metrics = jax.eval_shape(fns.step, state, batch)
    assert metrics["loss"].shape == ()

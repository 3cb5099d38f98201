"""Pallas attention inside a sharded train step runs per device (`kernel_per_device`): GSPMD has no
rule to split a Pallas call, so without the shard_map its operands would be replicated onto every
device (every batch row's q/k/v), and a TPU compile of one inside a sharded program fails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem import parallel as par
from jmem.models import Llama, LlamaConfig
from jmem.parallel.rules import activation_sharding, kernel_per_device
from tests.helpers import counting_batches, train_sharded

STEPS, B, T = 3, 8, 16


def _model(impl, **kw):
    return Llama(LlamaConfig.tiny(n_layers=2, loss_chunk=T, attention_impl=impl, **kw), rngs=nnx.Rngs(0))


def _jaxpr_text(model, mesh, rules=None):
    loss_fn, params = par.model_loss_fn(model)
    batch = counting_batches(model.config.vocab_size, 1, B, T, seed=0)[0]
    with activation_sharding(rules, mesh):
        return str(jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, batch)[0]))(params))


def test_flash_attention_runs_per_device_under_a_mesh():
    mesh = par.make_mesh("data=2,fsdp=2,tensor=2")
    assert "shard_map" in _jaxpr_text(_model("pallas"), mesh)
    assert "shard_map" not in _jaxpr_text(_model("xla"), mesh)  # XLA attention: GSPMD splits it
    assert "shard_map" not in _jaxpr_text(_model("pallas"), None)  # no mesh, nothing to split


def test_sharded_training_with_flash_attention_matches_one_device():
    model = _model("pallas")
    loss_fn, params = par.model_loss_fn(model)
    batches = counting_batches(model.config.vocab_size, STEPS, B, T, seed=0)
    ref, *_ = train_sharded(loss_fn, params, par.make_mesh(devices=jax.devices()[:1]), batches)
    losses, *_ = train_sharded(loss_fn, params, par.make_mesh("data=2,fsdp=2,tensor=2"), batches, zero=3)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert losses[-1] < losses[0]


def test_an_axis_that_does_not_divide_is_left_out():
    """tensor=4 does not divide 2 kv heads: heads stay whole on every device (q and kv alike), the
    batch still splits; the result equals the unsplit call."""
    mesh = par.make_mesh("data=2,tensor=4")  # all 8 devices
    seen = []

    def fn(q, k):
        seen.append((q.shape, k.shape))
        return q * k.sum(axis=(1, 2, 3), keepdims=True)  # row by row, as attention is

    q, k = jnp.ones((4, 8, 4, 2)), jnp.ones((4, 8, 2, 2))
    with activation_sharding(None, mesh):
        out = jax.jit(lambda q, k: kernel_per_device(fn, (q, k), (("batch", None, "heads", None),
                                                                  ("batch", None, "kv_heads", None)),
                                                     ("batch", None, "heads", None)))(q, k)
    assert seen == [((2, 8, 4, 2), (2, 8, 2, 2))]
    np.testing.assert_array_equal(out, fn(q, k))


@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_cpu_auto_and_xla_take_no_shard_map(impl):
    assert "shard_map" not in _jaxpr_text(_model(impl), par.make_mesh("data=4,tensor=2"))


def test_lowered_for_gpu_the_triton_calls_sit_in_per_device_regions():
    """What a GPU compiles: 'auto' picks the Triton flash kernel, inside shard_map's manual regions."""
    from jmem.kernels.dispatch import compiling_for

    model = _model("auto")
    loss_fn, params = par.model_loss_fn(model)
    batch = counting_batches(model.config.vocab_size, 1, B, T, seed=0)[0]
    mesh = par.make_mesh("data=4,tensor=2")

    def grads(p, b):
        with activation_sharding(None, mesh):
            return jax.grad(lambda p: loss_fn(p, b)[0])(p)

    with compiling_for("gpu"):
        try:
            text = jax.jit(grads).trace(params, batch).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001 - this JAX cannot lower for CUDA here at all
            pytest.skip(f"cannot lower for cuda here: {e}")
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv
    regions = text.count("sdy.manual_computation") + text.count("SPMDFullToShardShape")
    assert regions >= 1, "the Triton calls are not inside per-device regions"

"""`jmem.train`'s own step, sharded by `jit_train_step` + `constrain_gradients`, equals one device."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jmem import parallel as par
from jmem.models import Llama, LlamaConfig


@pytest.mark.slow
def test_train_fns_step_with_zero2_matches_single_device():
    from jmem.train import make_train_fns

    cfg = LlamaConfig.tiny(n_layers=2, loss_chunk=16)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (3, 16, 17)).astype(np.int32)
    batches = [{"inputs": i[:, :-1], "targets": i[:, 1:], "mask": np.ones((16, 16), np.float32)} for i in ids]

    def run(mesh, stage):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        tx = optax.adam(1e-2)
        if mesh is not None:
            tx = par.constrain_gradients(tx, mesh, stage=stage)
        fns = make_train_fns(model, tx)
        state = fns.init_state(model)
        if mesh is None:
            step = jax.jit(fns.step)
        else:
            step, sh, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh, zero=stage)
            state = jax.device_put(state, sh)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return np.array(losses), state

    ref, _ = run(None, 0)
    mesh = par.make_mesh("data=4,fsdp=2")
    got, state = run(mesh, 2)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert "data" in str(jax.tree.leaves(state.opt_state)[1].sharding.spec)

"""Sequence parallelism: the residual stream between blocks sharded over `length` on the tensor axis."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmem import parallel as par
from jmem.models import Llama, LlamaConfig
from tests.helpers import counting_batches, train_sharded

STEPS, B, T = 3, 8, 32
MESH = "data=2,tensor=4"


def _batches(cfg):
    return counting_batches(cfg.vocab_size, STEPS, B, T, seed=1)


def _train(loss_fn, params, mesh, batches, **kw):
    return train_sharded(loss_fn, params, mesh, batches, **kw)[:2]


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig.tiny(n_layers=2, n_kv_heads=4, loss_chunk=T)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    loss_fn, params = par.model_loss_fn(model)
    return cfg, model, loss_fn, params, _batches(cfg)


@pytest.fixture(scope="module")
def sequence_parallel(tiny):
    cfg, _, loss_fn, params, batches = tiny
    one = par.make_mesh(devices=jax.devices()[:1])
    ref, _ = _train(loss_fn, params, one, batches)
    losses, text = _train(loss_fn, params, par.make_mesh(MESH), batches, rules="length=tensor")
    return ref, losses, text


def _constraint_specs(jaxpr):
    """PartitionSpecs (as tuples) of every sharding constraint in a jaxpr and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            out.append(tuple(eqn.params["sharding"].spec))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                sub = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    out += _constraint_specs(sub)
    return out


def _while_shapes(text):
    """The tuple type of every `while` instruction in compiled HLO text."""
    return [ln.split("while(")[0] for ln in text.splitlines() if re.search(r"\bwhile\(", ln)]


def test_losses_match_single_device(sequence_parallel):
    ref, losses, _ = sequence_parallel
    assert ref[-1] < ref[0]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_with_zero3_and_per_group_accumulators(tiny, sequence_parallel):
    """Inside the vmap over data-parallel groups, activations leave the group axes to the vmap."""
    _, _, loss_fn, params, batches = tiny
    ref, _, _ = sequence_parallel
    losses, text = _train(loss_fn, params, par.make_mesh("data=2,fsdp=2,tensor=2"), batches, zero=3, accum=2,
                          rules="length=tensor")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert "all-to-all" not in par.collectives(text)


def test_residual_stream_is_sequence_sharded_in_hlo(tiny, sequence_parallel):
    cfg, _, loss_fn, params, batches = tiny
    _, _, text = sequence_parallel
    local = f"f32[{B // 2},{T // 4},{cfg.dim}]"  # batch over data=2, sequence over tensor=4
    whole = f"f32[{B // 2},{T},{cfg.dim}]"
    loops = _while_shapes(text)
    assert loops and all(local in s and whole not in s for s in loops)  # forward and backward layer scans
    # Megatron sequence parallelism: the residual is all-gathered along the sequence before the
    # column-parallel matmuls, forward (attention, MLP) and backward (wo, w_down transposed).
    gathers = [ln for ln in text.splitlines() if re.search(r"all-gather(-start)?\(", ln)]
    assert sum(whole in ln and "dimensions={1}" in ln for ln in gathers) == 4
    assert par.collectives(text, in_loops=True).get("all-gather", 0) == 4

    # Plain tensor parallelism (same mesh, default rules): whole sequences, all-reduce only.
    mesh = par.make_mesh(MESH)

    def loss(p, b):
        with par.activation_sharding(None, mesh):
            return loss_fn(p, b)

    plain = jax.jit(loss, in_shardings=(par.shardings(params, None, mesh), par.batch_sharding(mesh))) \
        .lower(params, batches[0]).compile().as_text()
    plain_loops = _while_shapes(plain)
    assert plain_loops and all(whole in s and local not in s for s in plain_loops)
    assert "all-gather" not in par.collectives(plain, in_loops=True)
    assert par.collectives(plain, in_loops=True).get("all-reduce", 0) == 2  # wo, w_down


def test_no_rules_no_constraints(tiny):
    _, model, _, _, _ = tiny
    ids = jnp.zeros((B, T), jnp.int32)
    graphdef, state = nnx.split(model)

    def fwd(s, x):
        return nnx.merge(graphdef, s)(x)[0]

    def fwd2(s, x):  # a second function: jax caches traces by function, not by the context
        return fwd(s, x)

    assert par.active_activation_sharding() is None
    plain_jaxpr = jax.make_jaxpr(fwd)(state, ids)
    plain = str(plain_jaxpr)
    assert _constraint_specs(plain_jaxpr.jaxpr) == []
    x = jnp.ones((B, T, 4))
    assert par.constrain(x, par.ACTIVATION_AXES) is x  # identity: nothing is traced

    mesh = par.make_mesh(MESH)
    with par.activation_sharding("length=tensor", mesh):
        assert par.active_activation_sharding()[1] is mesh
        specs = _constraint_specs(jax.make_jaxpr(fwd2)(state, ids).jaxpr)
    # Embedding output, block end and final hidden: sequence-sharded; the two norm outputs
    # whole along the sequence; the inputs of wo and w_down split on heads / mlp.
    assert sorted(specs, key=str) == sorted([("data", "tensor", None)] * 3 + [("data", None, None)] * 2
                                            + [("data", None, "tensor")] * 2, key=str)
    assert par.active_activation_sharding() is None  # the block ends with the context
    with pytest.raises(RuntimeError), par.activation_sharding("length=tensor", mesh):
        raise RuntimeError
    assert par.active_activation_sharding() is None
    assert str(jax.make_jaxpr(lambda s, x: fwd(s, x))(state, ids)) == plain  # a fresh trace, unchanged


def test_jit_train_step_traces_under_rules(tiny):
    """The `jmem.train` path (`experiments/train.py --rules length=tensor`) constrains activations."""
    from jmem.train.step import make_train_fns

    _, model, _, _, batches = tiny
    mesh = par.make_mesh(MESH)
    fns = make_train_fns(model, optax.adam(1e-2), loss_chunk=T, mesh=mesh, rules="length=tensor")
    abstract = jax.eval_shape(lambda: fns.init_state(model))
    on, _, _ = par.jit_train_step(fns.step, abstract, mesh, rules="length=tensor")
    off, _, _ = par.jit_train_step(fns.step, abstract, mesh, rules="length=tensor", constrain_activations=False)
    residual = ("data", "tensor", None)  # [batch, length, embed]
    on_specs = _constraint_specs(on.trace(abstract, batches[0]).jaxpr.jaxpr)
    assert on_specs.count(residual) >= 3  # embedding output, block end, final hidden
    assert residual not in _constraint_specs(off.trace(abstract, batches[0]).jaxpr.jaxpr)


def test_length_not_divisible_is_one_clear_error(tiny):
    _, model, _, _, _ = tiny
    mesh = par.make_mesh(MESH)
    with par.activation_sharding("length=tensor", mesh), pytest.raises(par.ShardingError) as err:
        jax.eval_shape(lambda x: model(x)[0], jnp.zeros((B, 6), jnp.int32))
    msg = str(err.value)
    assert "length" in msg and "size 6" in msg and "tensor of size 4" in msg
    with pytest.raises(par.ShardingError, match="rules given without a mesh"):
        par.constrain(jnp.zeros((2, 4, 4)), par.ACTIVATION_AXES, "length=tensor")


def test_inside_shard_map_the_manual_axes_are_left_alone():
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map

    mesh = par.make_mesh("stage=2,data=4")

    def body(x):
        with par.activation_sharding("length=stage", mesh):
            return par.constrain(x * 2.0, par.ACTIVATION_AXES)

    x = jnp.ones((8, 4, 4))
    partial = shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"),
                        axis_names=frozenset({"stage"}), check_vma=False)
    assert _constraint_specs(jax.make_jaxpr(partial)(x).jaxpr) == [("data", None, None)]
    full = shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), check_vma=False)
    assert _constraint_specs(jax.make_jaxpr(full)(x).jaxpr) == []

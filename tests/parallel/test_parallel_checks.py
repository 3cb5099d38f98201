"""Checks that refuse a parallel setup before it runs: whole attention heads per device, rules
that name a mesh axis twice, bool mesh sizes, and collectives inside the 1F1B tick's branches
(small programs compiled, never run)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import shard_map
from jax.sharding import PartitionSpec as P

from jmem import parallel as par
from jmem.models import Llama, LlamaConfig
from jmem.parallel.hlo import collective_shapes, device_groups
from jmem.parallel.pipeline_1f1b import TICK_SCOPE
from jmem.train import make_train_fns


def test_rule_naming_a_mesh_axis_twice_is_one_sharding_error():
    with pytest.raises(par.ShardingError, match=r"rule embed=fsdp\+fsdp names mesh axis 'fsdp' twice"):
        par.Rules.parse("embed=fsdp+fsdp")
    with pytest.raises(par.ShardingError, match="names mesh axis 'tensor' twice"):
        par.Rules.parse({"mlp": ("tensor", "fsdp", "tensor")})
    assert par.Rules.parse("embed=fsdp+data").mesh_axes("embed") == ("fsdp", "data")


def test_rule_that_is_not_mesh_axes_is_one_sharding_error():
    for bad in (3, 2.5, ("fsdp", 1)):
        with pytest.raises(par.ShardingError, match=re.escape(
                f"rule embed={bad!r}: accepted: a string of mesh axes like 'fsdp' or 'data+fsdp', a tuple of mesh "
                f"axis names, or None")):
            par.Rules.parse({"embed": bad})
    assert par.Rules.parse({"embed": ["fsdp"], "mlp": None}).mesh_axes("embed") == ("fsdp",)


def test_make_mesh_refuses_a_repeated_device():
    d = jax.devices()
    with pytest.raises(par.MeshError, match=rf"device {d[0]} is given 2 times; accepted: each device at most once"):
        par.make_mesh("data=4", devices=[d[0], d[1], d[0], d[2]])


def test_make_mesh_refuses_bool_sizes():
    for spec in ({"data": True, "fsdp": -1}, {"data": np.bool_(True), "fsdp": -1}):
        with pytest.raises(par.MeshError, match=r"data=(np\.)?True_?: accepted sizes are positive integers or -1"):
            par.make_mesh(spec)
    assert dict(par.make_mesh({"data": 1, "fsdp": -1}).shape)["fsdp"] == 8


def test_check_heads_counts_heads_not_flattened_columns():
    # tiny: 4 query heads, 2 KV heads of 16 dims. The flattened wk columns (2 x 16 = 32) divide by 4, the heads do not.
    mesh = par.make_mesh("data=2,tensor=4")
    assert par.Rules.parse().spec(("layers", "embed", "kv_heads"), (2, 64, 32), mesh) == P(None, None, "tensor")
    with pytest.raises(par.ShardingError, match=r"n_kv_heads=2 is not divisible by mesh axes tensor of size 4 "
                                                r"\(rule kv_heads=tensor\).*accepted: tensor sizes dividing 2, or "
                                                r"the rule 'kv_heads=none'"):
        par.check_heads(4, 2, None, mesh)
    with pytest.raises(par.ShardingError, match="n_heads=4 is not divisible by mesh axes tensor of size 8"):
        par.check_heads(4, 2, None, {"tensor": 8})
    par.check_heads(4, 2, None, {"data": 4, "tensor": 2})
    par.check_heads(4, 2, "kv_heads=none", mesh)  # replicated KV projection: whole heads again
    par.check_heads(4, 2, None, {"data": 2, "tensor": -1})  # unresolved size: checked once the mesh exists
    # The dim's axes are those `Rules.spec` gives it: under embed=tensor, wq's heads dim gets nothing,
    # but wo's (heads first) still takes tensor.
    with pytest.raises(par.ShardingError, match="n_heads=4"):
        par.check_heads(4, 4, "embed=tensor", {"tensor": 8})
    with pytest.raises(par.ShardingError, match=r"^--mesh x: n_kv_heads=1"):
        par.check_heads(2, 1, "heads=none", {"tensor": 2}, what="--mesh x: ")


def test_model_paths_refuse_split_heads_before_tracing():
    model = Llama(LlamaConfig.tiny(n_layers=2), rngs=nnx.Rngs(0))
    mesh = par.make_mesh("data=2,tensor=4")
    loss_fn, params = par.model_loss_fn(model)
    with pytest.raises(par.ShardingError, match="n_kv_heads=2 is not divisible by mesh axes tensor of size 4"):
        par.make_sharded_train_step(loss_fn, optax.adam(1e-3), params, mesh)
    with pytest.raises(par.ShardingError, match="n_kv_heads=2"):
        make_train_fns(model, optax.adam(1e-3), mesh=mesh)
    make_train_fns(model, optax.adam(1e-3), mesh=mesh, rules="kv_heads=none")
    # The 1F1B value-and-grad checks at trace time (abstract evaluation only here).
    stages = par.make_mesh("stage=2,tensor=4")
    vg = par.pipeline_1f1b_lm_value_and_grad(model, n_stages=2, n_microbatches=2, mesh=stages)
    batch = {k: jax.ShapeDtypeStruct((4, 8), jnp.int32) for k in ("inputs", "targets")}
    batch["mask"] = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(par.ShardingError, match="n_kv_heads=2"):
        jax.eval_shape(vg, params, batch)


def test_device_groups_of_hlo_collectives():
    assert device_groups("x replica_groups=[4,2]<=[8], y", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert device_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert device_groups("replica_groups={{0,4},{1,5}}, use", 8) == [[0, 4], [1, 5]]
    assert device_groups("source_target_pairs={{0,1},{2,3}}, m", 8) == [[0, 1], [2, 3]]
    assert device_groups("replica_groups={}, x", 4) == [[0, 1, 2, 3]]


def _tick_program(branch, mesh, scope=TICK_SCOPE):
    """Compiled HLO of a shard_map whose stages take different branches of a named switch."""
    def body(x):
        with jax.named_scope(scope):
            return jax.lax.switch(jax.lax.axis_index("stage"), [lambda v: v * 2.0, branch], x)

    f = shard_map(body, mesh=mesh, in_specs=P(("stage", "data")), out_specs=P(("stage", "data")), check_vma=False)
    return jax.jit(f).lower(jnp.ones((8, 4), jnp.float32)).compile().as_text()


def test_tick_collectives_that_other_stages_cannot_join_are_refused():
    mesh = par.make_mesh("stage=2,data=4")
    # Within one stage's devices: every device of the group takes the same branch.
    par.check_tick_collectives(_tick_program(lambda v: jax.lax.psum(v, "data"), mesh), mesh)
    par.check_tick_collectives(_tick_program(lambda v: jax.lax.all_gather(v, "data", tiled=True)[:1], mesh), mesh)
    within = _tick_program(lambda v: jax.lax.all_to_all(v.reshape(4, 1), "data", 0, 0, tiled=True).reshape(1, 4), mesh)
    assert "all-to-all" in par.collectives(within)
    par.check_tick_collectives(within, mesh)  # ZeRO-3 under 1F1B reshards like this inside a stage
    across = _tick_program(lambda v: jax.lax.psum(v, "stage"), mesh)
    with pytest.raises(par.PipelineError, match=r"the compiled tick holds 1 all-reduce inside its run-time "
                                                r"branches.*accepted: shardings that keep whole heads"):
        par.check_tick_collectives(across, mesh)
    # A collective-permute never (the CPU runtime joins every device of the program in one).
    permute = _tick_program(lambda v: jax.lax.ppermute(v, "data", [(0, 1), (1, 0), (2, 3), (3, 2)]), mesh)
    with pytest.raises(par.PipelineError, match="1 collective-permute"):
        par.check_tick_collectives(permute, mesh)
    # Only the tick's own switch is inspected.
    par.check_tick_collectives(_tick_program(lambda v: jax.lax.psum(v, "stage"), mesh, scope="other"), mesh)


@pytest.mark.slow
def test_tick_check_refuses_the_1f1b_step_that_splits_kv_heads(monkeypatch):
    """With the head check bypassed, tensor=4 on 2 KV heads compiles a tick whose branches
    reshard (collective-permutes, all-to-alls): refused before anything runs. 4 KV heads pass."""
    import importlib

    schedule = importlib.import_module("jmem.parallel.pipeline_1f1b")  # the module, not the function
    monkeypatch.setattr(schedule, "check_heads", lambda *a, **k: None)
    mesh = par.make_mesh("stage=2,tensor=4")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 259, (8, 17)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((8, 16), np.float32)}
    for kv in (2, 4):
        model = Llama(LlamaConfig.tiny(n_layers=2, n_kv_heads=kv, loss_chunk=16, remat="full"), rngs=nnx.Rngs(0))
        vg = par.pipeline_1f1b_lm_value_and_grad(model, n_stages=2, n_microbatches=2, mesh=mesh)
        params = par.model_loss_fn(model)[1]
        params = jax.device_put(params, par.shardings(params, "layers=stage", mesh))

        def f(p, b):
            with par.activation_sharding("layers=stage", mesh):
                return vg(p, b)

        text = jax.jit(f).lower(params, batch).compile().as_text()
        if kv == 2:
            with pytest.raises(par.PipelineError, match="collective-permute"):
                par.check_tick_collectives(text, mesh)
        else:
            par.check_tick_collectives(text, mesh)


@pytest.mark.slow
def test_train_script_1f1b_with_zero3_passes_the_tick_check_and_matches_one_device(tmp_path, capsys):
    """ZeRO-3 inside the stages puts all-gathers and all-to-alls (within a stage) into the tick."""
    import json

    from tests.helpers import run_train_script

    def losses(extra):
        log = tmp_path / f"{len(extra)}.jsonl"
        rc, err = run_train_script(["--model", "tiny", "--steps", "3", "--seq", "16", "--batch", "8", "--precision",
                                    "f32", "--no-progress", "--eval-batches", "1", "--lr", "1e-2", "--warmup", "0",
                                    "--log", str(log)] + extra, capsys)
        assert rc == 0, err[-3000:]
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    got = losses(["--mesh", "stage=2,fsdp=4", "--zero", "3", "--pipeline-stages", "2", "--microbatches", "2",
                  "--pipeline-schedule", "1f1b"])
    np.testing.assert_allclose(got, losses([]), rtol=1e-5)


def test_library_entry_points_refuse_bad_arguments_in_one_error(tmp_path):
    """What a user's own code may pass wrongly: a mesh spec string or None for a mesh, a ZeRO stage out of
    range (make_train_fns ran such a step before), no optimizer, a params dict for a train state, a single
    device for a device list, a bad remat policy in the config, disk offload without its placeholder
    optimizer, and a malformed language-model batch; each is one error naming the value."""
    from jmem.memory.disk_offload import DiskOptimizer
    from jmem.memory.offload import OffloadedTrainStep, OffloadError

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    loss_fn, params = par.model_loss_fn(model)
    mesh = par.make_mesh("data=8")
    for bad in ("data=8", None):
        with pytest.raises(par.MeshError, match=re.escape(f"mesh={bad!r}; accepted: a jax.sharding.Mesh, e.g. "
                                                          "jmem.parallel.make_mesh('data=8')")):
            par.make_sharded_train_step(loss_fn, optax.sgd(0.1), params, bad)
    with pytest.raises(par.MeshError, match="mesh='data=8'; accepted: a jax.sharding.Mesh"):
        make_train_fns(model, optax.sgd(0.1), mesh="data=8")
    for bad in (5, -1, 2.5, "3", None):
        with pytest.raises(par.ZeroStageError, match=re.escape(f"zero={bad!r} is not a ZeRO stage; accepted: 0, 1, 2")):
            make_train_fns(model, optax.sgd(0.1), mesh=mesh, zero=bad)
    with pytest.raises(ValueError, match=r"^zero=3 without a mesh; accepted: zero=0, or a mesh"):
        make_train_fns(model, optax.sgd(0.1), zero=3)  # was accepted, and the stage had no effect
    with pytest.raises(ValueError, match=r"optimizer=None; accepted: an optax.GradientTransformation"):
        par.make_sharded_train_step(loss_fn, None, params, mesh)
    with pytest.raises(ValueError, match=r"tx=None; accepted: an optax.GradientTransformation"):
        make_train_fns(model, None)
    fns = make_train_fns(model, optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match="abstract_state of type dict; accepted: a state with params and opt_state"):
        par.jit_train_step(fns.step, params, mesh)
    with pytest.raises(par.ZeroStageError, match="zero=4 is not a ZeRO stage"):
        par.jit_train_step(fns.step, jax.eval_shape(lambda: fns.init_state(model)), mesh, zero=4)
    with pytest.raises(par.MeshError, match="devices=CpuDevice.*; accepted: a list of devices"):
        par.make_mesh("data=1", devices=jax.devices()[0])
    with pytest.raises(ValueError, match="n=0; accepted: an integer >= 1"):
        par.zero_model_bytes(100, stage=1, n=0)
    with pytest.raises(ValueError, match="LlamaConfig.remat: unknown remat policy 'bogus'; accepted: none, full"):
        LlamaConfig.tiny(remat="bogus")

    plain = make_train_fns(model, optax.adamw(1e-2))
    abstract = jax.eval_shape(lambda: plain.init_state(model))
    with pytest.raises(par.ZeroStageError, match="zero=4 is not a ZeRO stage"):
        OffloadedTrainStep(plain, abstract, mesh=mesh, zero=4)
    with pytest.raises(OffloadError, match=r"disk offload needs train functions built with the optimizer "
                                           r"jmem.memory.disk_offload.placeholder_transform\(\)"):
        OffloadedTrainStep(plain, abstract, disk=DiskOptimizer(optax.adamw(1e-2), abstract.params,
                                                               str(tmp_path / "opt")))

    ids = jnp.zeros((8, 16), jnp.int32)
    good = {"inputs": ids, "targets": ids, "mask": jnp.ones((8, 16))}
    trainer = par.make_sharded_train_step(loss_fn, optax.sgd(0.1), params, mesh)
    state = trainer.init(params)
    for batch, message in (
            ({k: v for k, v in good.items() if k != "mask"}, r"language-model batch \['inputs', 'targets'\]; accepted: "
                                                              "a dict with 'inputs', 'targets' and 'mask'"),
            ({**good, "targets": ids[:, :8]}, r"batch shapes \{'inputs': \(8, 16\), 'targets': \(8, 8\), 'mask': "
                                               r"\(8, 16\)\}; accepted: .* all of one shape \[batch, seq\]"),
            ({k: v[:, 0] for k, v in good.items()}, r"batch shapes \{'inputs': \(8,\)"),
            ({**good, "inputs": ids.astype(jnp.float32)}, r"batch\['inputs'\] of dtype float32; accepted: integer")):
        with pytest.raises(ValueError, match=message):
            trainer.step(state, batch)
    trainer.step(state, good)
    # The step donated `state`: using it again crashed the process on 8 CPU devices (SIGSEGV), now one error.
    with pytest.raises(ValueError, match="the state was donated to an earlier step"):
        trainer.step(state, good)


def test_steps_refuse_params_and_batches_they_were_not_built_for():
    """`ShardedTrainStep.init` took params of another shape or dtype and built a state the step was not
    compiled or sharded for; `jit_train_step`'s step met an indivisible batch with JAX's IndivisibleError."""
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    loss_fn, params = par.model_loss_fn(model)
    mesh = par.make_mesh("data=8")
    trainer = par.make_sharded_train_step(loss_fn, optax.sgd(0.1), params, mesh)
    w = params["embed"]["embedding"]
    for bad, message in (
            ({**params, "embed": {"embedding": w.T}}, re.escape(
                f"params['embed']['embedding'] is float32{list(w.T.shape)}; the step was built for "
                f"float32{list(w.shape)}")),
            ({**params, "embed": {"embedding": w.astype(jnp.bfloat16)}}, r"is bfloat16\[.*built for float32"),
            ({**params, "extra": w}, r"params have other leaves than the step was built for: unexpected "
                                     r"\[\"\['extra'\]\"\], missing \[\]")):
        with pytest.raises(par.ShardingError, match=message):
            trainer.init(bad)

    fns = make_train_fns(model, optax.sgd(0.1), mesh=mesh)
    state = fns.init_state(model)
    step, sh, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh)
    ids = jnp.zeros((6, 16), jnp.int32)
    batch = {"inputs": ids, "targets": ids, "mask": jnp.ones((6, 16))}
    message = re.escape("batch size 6 is not divisible by data-parallel size 8 x accum 1 = 8")
    with pytest.raises(par.ShardingError, match=message):
        step(jax.device_put(state, sh), batch)
    with pytest.raises(par.ShardingError, match=message):
        step.lower(jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch))


def test_a_logical_axis_typo_or_count_is_one_sharding_error():
    """A typo in a logical name left that dim whole without a word; one name too many was XLA's error."""
    mesh = par.make_mesh("data=8")
    with pytest.raises(par.ShardingError, match="activation: unknown logical axis 'batchh'; accepted: None, one of "
                                                "batch, embed, .*extra_names"):
        par.constrain(jnp.ones((8, 4)), ("batchh", "embed"), None, mesh)
    with pytest.raises(par.ShardingError, match=r"activation: 3 logical axes \('batch', 'length', 'embed'\) for an "
                                                r"array of shape \(8, 4\); accepted: one name \(or None\) per dim"):
        par.constrain(jnp.ones((8, 4)), ("batch", "length", "embed"), None, mesh)
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    _, params = par.model_loss_fn(model)
    with pytest.raises(par.ShardingError, match="unknown logical axis 'embedd'"):
        par.shardings(params, None, mesh, logical_axes={"layers.wq.kernel": ("layers", "embedd", "heads")})
    # A name of one's own, declared: replicated without a rule, split with one.
    rules = par.Rules.parse("ffn=data", extra_names=("ffn", "own"))
    assert par.Rules.parse(None, extra_names=("own",)).spec(("own", None)) == P(None, None)
    assert rules.spec(("ffn", "own"), (8, 4), mesh) == P("data", None)


def test_mesh_helpers_refuse_what_is_not_a_mesh():
    """`data_parallel_size(None)` and `mesh_summary(None)` were AttributeErrors; axes="data" counted its letters."""
    for fn in (par.data_parallel_size, par.mesh_summary):
        for bad in (None, "data=8"):
            with pytest.raises(par.MeshError, match=re.escape(f"mesh={bad!r}; accepted: a jax.sharding.Mesh")):
                fn(bad)
    mesh = par.make_mesh("data=2,fsdp=4")
    assert par.data_parallel_size(mesh, "data") == 2 and par.data_parallel_size(mesh) == 8


def test_shard_refuses_a_mesh_spec_string():
    """`shard(state, rules, "data=8")` was an AttributeError inside the sharding lookup."""
    for fn in (par.shard, par.shardings):
        with pytest.raises(par.MeshError, match=re.escape("mesh='data=8'; accepted: a jax.sharding.Mesh, e.g. "
                                                          "jmem.parallel.make_mesh('data=8')")):
            fn({"w": jnp.ones((8, 4))}, None, "data=8")


def test_collectives_refuse_what_is_not_hlo_text():
    """`collectives(None)` was an AttributeError ('NoneType' has no splitlines)."""
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
    for bad, shown in ((None, "=None"), (compiled, " is a Compiled"), (b"HloModule", " is a bytes")):
        for fn in (par.collectives, lambda t: collective_shapes(t, "all-gather")):
            with pytest.raises(ValueError, match=rf"^hlo_text{shown}; accepted: HLO text \(a str\), e.g. "):
                fn(bad)
    assert par.collectives(compiled.as_text()) == {}


def test_zero_model_bytes_refuses_negative_counts():
    """`zero_model_bytes(-5, ...)` and `param_bytes=-1` returned negative byte counts."""
    for kwargs in ({"n_params": -5}, {"n_params": True}, {"n_params": "5"}, {"n_params": 5, "param_bytes": -1},
                   {"n_params": 5, "opt_bytes": float("inf")}):
        name, value = [(k, v) for k, v in kwargs.items() if k != "n_params" or len(kwargs) == 1][0]
        with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))}; accepted: a finite number >= 0$"):
            par.zero_model_bytes(stage=1, n=2, **kwargs)
    assert par.zero_model_bytes(10, stage=3, n=2, param_bytes=0.5)["params"] == 2.5

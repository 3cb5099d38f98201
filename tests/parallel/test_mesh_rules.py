"""Meshes, rules and ZeRO shardings (no compilation: shardings and abstract shapes only)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmem import parallel as par
from jmem.models import LOGICAL_AXES, Llama, LlamaConfig


def test_make_mesh_string_dict_and_fill():
    m = par.make_mesh("data=2,fsdp=2,tensor=2")
    assert dict(m.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert dict(par.make_mesh({"fsdp": -1, "tensor": 2}).shape)["fsdp"] == 4
    assert dict(par.make_mesh().shape)["data"] == 8
    assert par.mesh_summary(m) == "data=2,fsdp=2,tensor=2"


@pytest.mark.parametrize("spec,match", [
    ("data=3", "needs 3 devices but there are 8"),
    ("data=2,model=4", "unknown mesh axis 'model'; accepted: stage, data, fsdp, expert, tensor"),
    ("data=-1,fsdp=-1", "at most one axis may be -1"),
    ("data=3,fsdp=-1", "do not divide the 8 devices"),
    ("data=x", "data"),
    ("data", "not 'axis=size'"),
    ("data=0", "positive integers or -1"),
])
def test_make_mesh_errors(spec, match):
    with pytest.raises(par.MeshError, match=match):
        par.make_mesh(spec)


@pytest.mark.parametrize("devices", [[], [0, 1]])
def test_make_mesh_refuses_devices_that_are_not_devices(devices):
    with pytest.raises(par.MeshError, match="accepted: a non-empty list of jax devices"):
        par.make_mesh("data=2", devices=devices)


def test_rules_defaults_overrides_and_specs():
    mesh = par.make_mesh("fsdp=4,tensor=2")
    rules = par.Rules.parse("embed=fsdp,vocab=tensor")
    assert rules.spec(("layers", "embed", "mlp"), (2, 64, 128), mesh) == P(None, "fsdp", "tensor")
    assert rules.spec(("layers", "heads", "embed"), (2, 64, 64), mesh) == P(None, "tensor", "fsdp")
    # A mesh axis is used once per array; size-1 axes are dropped.
    assert par.Rules.parse("embed=tensor").spec(("embed", "mlp"), (8, 8), mesh) == P("tensor", None)
    assert par.Rules.parse().spec(("batch", "length"), None, par.make_mesh("data=8")) == P("data", None)
    assert "mlp=tensor" in str(par.Rules.parse())
    with pytest.raises(par.ShardingError, match="unknown mesh axis 'model'"):
        par.Rules.parse("mlp=model")
    with pytest.raises(par.ShardingError, match="unknown logical axis 'emebd'; accepted: batch, length, embed, "
                                                "heads, kv_heads, mlp, vocab, layers, exp, stage"):
        par.Rules.parse("emebd=fsdp")
    with pytest.raises(par.ShardingError, match="unknown logical axis 'ffn'"):
        par.Rules.parse({"ffn": "tensor"})
    with pytest.raises(par.ShardingError, match="rule for 'embed' is given twice"):
        par.Rules.parse("embed=fsdp,embed=tensor")
    # A user's own logical names are accepted when declared.
    assert par.Rules.parse("ffn=tensor", extra_names=("ffn",)).mesh_axes("ffn") == ("tensor",)
    with pytest.raises(par.ShardingError, match=r"layers.w_up.kernel: dim 2 \(mlp\) has size 7, not divisible by "
                                                r"mesh axes tensor of size 2"):
        rules.spec(("layers", "embed", "mlp"), (2, 64, 7), mesh, name="layers.w_up.kernel")


def test_shard_a_users_own_nnx_model():
    class Mine(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

    table = {"up.kernel": ("embed", "mlp"), "up.bias": ("mlp",), "down.kernel": ("mlp", "embed")}
    mesh = par.make_mesh("fsdp=4,tensor=2")
    state = nnx.state(Mine(nnx.Rngs(0)), nnx.Param)
    placed = par.shard(nnx.to_pure_dict(state), "embed=fsdp", mesh, logical_axes=table)
    assert placed["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert placed["down"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert placed["up"]["bias"].sharding.spec == P("tensor")
    assert placed["down"]["bias"].sharding.spec == P()  # not in the table: replicated
    # nnx.State (Variable leaves) resolves the same paths.
    sh = par.shardings(state, "embed=fsdp", mesh, logical_axes=table)
    specs = {par.rules.path_str(k): v.spec for k, v in jax.tree_util.tree_leaves_with_path(sh)}
    assert specs == {"up.kernel": P("fsdp", "tensor"), "up.bias": P("tensor"), "down.kernel": P("tensor", "fsdp"),
                     "down.bias": P()}
    np.testing.assert_array_equal(np.asarray(placed["up"]["kernel"]), np.asarray(state["up"]["kernel"].get_value()))


def test_llama_table_covers_every_parameter():
    model = nnx.eval_shape(lambda: Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    tree = par.logical_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)), LOGICAL_AXES)
    assert all(axes is not None for axes in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple) or x is None))


@pytest.mark.parametrize("bad", [4, -1, "1", True, 1.0])
def test_zero_stage_errors(bad):
    with pytest.raises(par.ZeroStageError, match="accepted: 0, 1, 2, 3"):
        par.check_stage(bad)


def _bench_state(param_dtype):
    from jmem.memory.precision import with_master_weights

    model = nnx.eval_shape(lambda: Llama(LlamaConfig.bench_8l(param_dtype=param_dtype), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tx = optax.adam(1e-3) if param_dtype == "f32" else with_master_weights(optax.adam(1e-3))
    return params, jax.eval_shape(tx.init, params)


@pytest.mark.parametrize("layout,pbytes,kbytes", [("f32", 4, 8), ("bf16", 2, 12)])
@pytest.mark.parametrize("mesh_spec", ["data=8", "fsdp=8", "data=2,fsdp=4"])
def test_zero_bytes_follow_paper_model(layout, pbytes, kbytes, mesh_spec):
    params, opt = _bench_state(layout)
    mesh = par.make_mesh(mesh_spec)
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    for stage in range(4):
        sh = par.zero_shardings(params, opt, mesh, stage=stage)
        got = {"params": par.bytes_per_device(params, sh.params), "grads": par.bytes_per_device(params, sh.grads),
               "opt_state": par.bytes_per_device(opt, sh.opt_state)}
        want = par.zero_model_bytes(psi, stage=stage, n=8, param_bytes=pbytes, grad_bytes=pbytes, opt_bytes=kbytes)
        for k in want:
            assert abs(got[k] - want[k]) <= 0.05 * want[k], (stage, k, got[k], want[k])
        assert abs(sum(got.values()) - sum(want.values())) <= 0.05 * sum(want.values())


def test_stage3_never_splits_the_scanned_layers_axis():
    params, opt = _bench_state("f32")
    sh = par.zero_shardings(params, opt, par.make_mesh("data=2,fsdp=2,tensor=2"), stage=3)
    assert sh.params["layers"]["wq"]["kernel"].spec == P(None, ("data", "fsdp"), "tensor")
    # the largest per-shard dim takes the data axes, after the tensor split of the same dim
    assert sh.params["layers"]["w_down"]["kernel"].spec == P(None, ("tensor", "data", "fsdp"), None)
    assert sh.params["layers"]["attn_norm"]["scale"].spec == P(None, ("data", "fsdp"))
    assert sh.opt_state[0].mu["embed"]["embedding"].spec == sh.params["embed"]["embedding"].spec
    assert par.zero_shardings(params, opt, par.make_mesh("data=8"), stage=2).params["norm"]["scale"].spec == P(None)


def test_collective_counter_on_handwritten_hlo():
    from jmem.parallel.hlo import collective_shapes

    text = """HloModule m

%all-reduce-scatter.3 (input.1: f32[8]) -> f32[2] {
  %input.1 = f32[8]{0} parameter(0)
  %all-reduce.56 = f32[8]{0} all-reduce(%input.1), channel_id=22, replica_groups={{0,1,2,3}}, to_apply=%add
  %i = u32[] partition-id()
  ROOT %dynamic-slice.201 = f32[2]{0} dynamic-slice(%all-reduce.56, %i), dynamic_slice_sizes={2}
}

%body (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  %ag = f32[8]{0} all-gather(f32[4]{0} %p), dimensions={0}
  %f = f32[2]{0} fusion(%ag), kind=kCustom, calls=%all-reduce-scatter.3
  ROOT %r = f32[4] slice(%ag), slice={[0:4]}
}

%cond (p: f32[4]) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  %w = f32[4] while(%a), condition=%cond, body=%body
  %rs = f32[2]{0} reduce-scatter(f32[4]{0} %w), dimensions={0}, to_apply=%add
  ROOT %ar = f32[4]{0} all-reduce-start(f32[4]{0} %a), to_apply=%add
}
"""
    # TPU's compiler writes a reduce-scatter as a custom fusion `all-reduce-scatter` (all-reduce, then the
    # device's slice): counted as the reduce-scatter it runs, with the slice's shape (it was an all-reduce).
    assert par.collectives(text) == {"all-gather": 1, "reduce-scatter": 2, "all-reduce": 1}
    assert par.collectives(text, in_loops=True) == {"all-gather": 1, "reduce-scatter": 1}
    assert par.collectives(text, in_loops=False) == {"reduce-scatter": 1, "all-reduce": 1}
    assert collective_shapes(text, "reduce-scatter", in_loops=True) == [(2,)]


def test_sequence_sharding_constraint_between_blocks():
    mesh = par.make_mesh("data=2,fsdp=2,tensor=2")
    rules = par.Rules.parse("length=tensor")
    x = jnp.arange(4 * 8 * 4, dtype=jnp.float32).reshape(4, 8, 4)
    y = jax.jit(lambda v: par.constrain(v * 2.0, ("batch", "length", "embed"), rules, mesh))(x)
    from jax.sharding import NamedSharding

    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), "tensor", None)), 3)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2.0)
    with pytest.raises(par.ShardingError, match=r"activation: dim 1 \(length\) has size 7"):
        par.constrain(jnp.zeros((4, 7, 4)), ("batch", "length", "embed"), rules, mesh)


def test_initialize_checks_and_single_process(monkeypatch):
    from jmem.parallel.distributed import _CLUSTER_ENVS

    for key in sum(_CLUSTER_ENVS, ()):
        monkeypatch.delenv(key, raising=False)
    # An `salloc` shell (or a batch script's own process) has SLURM_JOB_ID but no job step, and an
    # Open MPI environment without its launcher URI: JAX detects no cluster there, so neither do we
    # (a single process ran into JAX's "coordinator_address should be defined").
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(par.DistributedError, match="needs num_processes, process_id as well"):
        par.initialize("127.0.0.1:1234")
    with pytest.raises(par.DistributedError, match="not HOST:PORT"):
        par.initialize("localhost", 2, 0)
    with pytest.raises(par.DistributedError, match="process_id=2 must be in 0..1"):
        par.initialize("127.0.0.1:1234", 2, 2)
    for args, message in ((("h:1234", "2", 0), "num_processes='2'; accepted: an integer"),  # a TypeError before
                          (("h:1234", 2, 0.0), "process_id=0.0; accepted: an integer"),
                          ((1234, 2, 0), "coordinator=1234; accepted: a HOST:PORT string")):
        with pytest.raises(par.DistributedError, match=message):
            par.initialize(*args)
    with pytest.raises(par.DistributedError, match="process_id=1 needs coordinator and num_processes as well"):
        par.initialize(None, None, 1)  # refused, not ignored
    with pytest.raises(par.DistributedError, match="num_processes=2 needs coordinator and process_id as well, or a "
                       "cluster JAX detects them on"):
        par.initialize(None, 2)  # refused, not left to JAX's "coordinator_address should be defined"
    with pytest.raises(ValueError, match="initialization_timeout=0; accepted: an integer >= 1"):
        par.initialize("127.0.0.1:1234", 2, 0, initialization_timeout=0)
    with pytest.raises(ValueError, match="heartbeat_timeout=0; accepted: an integer >= 1"):
        par.initialize("127.0.0.1:1234", 2, 0, heartbeat_timeout=0)
    import socket

    with socket.socket() as taken:  # another program listens on the port: refused before JAX's runtime starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(par.DistributedError, match=f"^coordinator '127.0.0.1:{port}': port {port} cannot be used "
                                                       f"on this host, where process 0 runs the coordinator service"):
            par.initialize(f"127.0.0.1:{port}", 2, 0)
    par.check_same_settings({"--seed": 0})  # one process: nothing to compare
    info = par.initialize()  # no cluster in the environment: single process, nothing joined
    assert (info.process_id, info.num_processes, info.global_devices) == (0, 1, 8)


def test_initialize_passes_its_timeouts_to_jax(monkeypatch):
    """The heartbeat timeout reaches JAX's runtime, and JAX's own join deadline is later than the watchdog's."""
    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(par.distributed, "_check_port_free", lambda coordinator: None)
    monkeypatch.setattr(par.distributed, "_info", lambda: None)
    par.initialize("127.0.0.1:1234", 2, 1, cpu_collectives=None, initialization_timeout=30, heartbeat_timeout=7)
    assert seen == {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 1,
                    "initialization_timeout": 90, "heartbeat_timeout_seconds": 7}


def test_a_process_whose_peers_never_join_stops_with_one_line():
    """Process 0 of 2 alone: at the timeout it says what it waited for and exits with status 2
    (JAX's runtime would abort later with a stack dump)."""
    import subprocess
    import sys

    from tests.helpers import free_port

    coord = f"127.0.0.1:{free_port()}"
    code = f"from jmem.parallel import initialize; initialize({coord!r}, 2, 0, initialization_timeout=3)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: process 0 of 2 waited 3 s for the multi-process job at {coord} and not every process joined; "
        "accepted: the same coordinator and process count on every process, each with its own process id")

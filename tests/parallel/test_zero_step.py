"""Sharded train steps: same losses as one device, and the collectives XLA emits for each ZeRO stage."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmem import parallel as par
from jmem.memory.hlo_flops import matmul_flops
from jmem.models import Llama, LlamaConfig
from jmem.parallel.pipeline import split_microbatches
from tests.helpers import counting_batches, train_sharded

STEPS, B, T = 5, 16, 16


def _batches(cfg):
    return counting_batches(cfg.vocab_size, STEPS, B, T, seed=0)


def _train(loss_fn, params, mesh, batches, **kw):
    return train_sharded(loss_fn, params, mesh, batches, **kw)


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig.tiny(n_layers=2, loss_chunk=T)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    loss_fn, params = par.model_loss_fn(model)
    batches = _batches(cfg)
    one = par.make_mesh(devices=jax.devices()[:1])
    ref, _, _, _ = _train(loss_fn, params, one, batches)
    assert ref[-1] < ref[0]
    return model, loss_fn, params, batches, ref


def test_zero3_data_fsdp_tensor_accum_matches_single_device(tiny):
    _, loss_fn, params, batches, ref = tiny
    mesh = par.make_mesh("data=2,fsdp=2,tensor=2")
    losses, text, trainer, state = _train(loss_fn, params, mesh, batches, zero=3, accum=2)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    n_leaves = len(jax.tree.leaves(params))
    # Gradients: one reduce-scatter per parameter, after the microbatch loop (never inside a loop).
    assert par.collectives(text, in_loops=False).get("reduce-scatter", 0) == n_leaves
    assert par.collectives(text, in_loops=True).get("reduce-scatter", 0) == 0
    # Parameters: all-gathered inside the layer scan, one layer at a time (7 kernels per layer).
    assert par.collectives(text, in_loops=True).get("all-gather", 0) >= 7
    # What the compiled step really takes per device equals the ZeRO-3 bookkeeping.
    in_state = trainer.compiled.input_shardings[0][0]
    a = trainer.abstract_state
    assert par.bytes_per_device(a.params, in_state.params) == trainer.bytes_per_device()["params"]
    assert par.bytes_per_device(a.opt_state, in_state.opt_state) == trainer.bytes_per_device()["opt_state"]
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(a.params))
    assert trainer.bytes_per_device()["params"] < full / 4  # data x fsdp = 4, plus tensor on heads/mlp


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_galore_on_a_tensor_parallel_mesh_matches_single_device(tiny, zero):
    """GaLore's SVD refresh runs in a multi-device program (it deadlocked on the CPU), and its rank-3
    basis and moments keep their parameter's axes only on the dims they share with it (the rank dim
    took the kernel's `mlp` axis: 3 is not divisible by tensor=2)."""
    from jmem.optim import galore

    _, loss_fn, params, batches, _ = tiny
    tx = lambda: galore(1e-2, rank=3, update_proj_gap=2, weight_decay=0.0)  # noqa: E731
    one, _, _, one_state = _train(loss_fn, params, par.make_mesh(devices=jax.devices()[:1]), batches, tx=tx())
    losses, _, trainer, state = _train(loss_fn, params, par.make_mesh("data=4,tensor=2"), batches, tx=tx(),
                                       zero=zero)
    np.testing.assert_allclose(losses, one, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(one_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    in_state = trainer.compiled.input_shardings[0][0]
    basis = in_state.opt_state[0].basis["layers"]["w_gate"]["kernel"]  # [L, E, r]: E takes embed's axes, r none
    mu = in_state.opt_state[0].mu["layers"]["w_gate"]["kernel"]  # [L, r, F]: F keeps mlp=tensor
    assert basis.spec[2] is None and "tensor" in str(mu.spec[2])


def test_expert_axis_carrying_the_batch_gets_its_own_accumulators(tiny):
    """The default rules split the batch over `expert` too: with accumulation, a dense model's gradient
    is still reduced once per step (never inside the microbatch or layer loops); at ZeRO 2 an all-reduce
    over `expert` and a reduce-scatter over `data` per leaf, after the loop."""
    _, loss_fn, params, batches, ref = tiny
    losses, text, _, _ = _train(loss_fn, params, par.make_mesh("data=4,expert=2"), batches, zero=2, accum=2)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    looped = par.collectives(text, in_loops=True)
    assert looped.get("all-reduce", 0) == looped.get("reduce-scatter", 0) == 0, looped
    outside = par.collectives(text, in_loops=False)
    assert outside.get("reduce-scatter", 0) == len(jax.tree.leaves(params)), outside


def test_pipeline_two_stages_matches_single_device(tiny):
    model, _, params, batches, ref = tiny
    mesh = par.make_mesh("stage=2,data=4")
    loss_fn, p = par.pipeline_lm_loss_fn(model, n_stages=2, n_microbatches=2, mesh=mesh, chunk=T)
    losses, text, trainer, _ = _train(loss_fn, p, mesh, batches, zero=1, rules="layers=stage")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert par.collectives(text, in_loops=True).get("collective-permute", 0) > 0  # stage -> stage sends
    assert trainer.zero.params["layers"]["wq"]["kernel"].spec[0] == "stage"


def test_pipeline_errors(tiny):
    model = tiny[0]
    with pytest.raises(par.PipelineError, match="2 layers do not split into 3 pipeline stages"):
        par.pipeline_hidden(model, np.zeros((4, 8), np.int32), n_stages=3, n_microbatches=2)
    with pytest.raises(par.PipelineError, match="microbatches=3"):
        par.pipeline_hidden(model, np.zeros((4, 8), np.int32), n_stages=2, n_microbatches=3)
    for bad in (0, -1, 2.0):
        with pytest.raises(par.PipelineError, match=rf"n_stages={bad}; accepted: an integer >= 1"):
            par.pipeline_hidden(model, np.zeros((4, 8), np.int32), n_stages=bad, n_microbatches=2)
        with pytest.raises(par.PipelineError, match=rf"n_stages={bad}; accepted: an integer >= 1"):
            par.split_stages({"w": np.zeros((4, 3))}, bad)
    for bad in (2.0, "2"):
        with pytest.raises(par.PipelineError, match=rf"microbatches={bad!r} must be an integer >= 1"):
            split_microbatches(np.zeros((4, 3)), bad)


def test_pipeline_refuses_what_it_cannot_schedule():
    w = {"w": jnp.ones((2, 3, 3))}
    with pytest.raises(par.PipelineError, match=r"x_M of shape \(0, 2, 3\) holds no microbatch"):
        par.pipeline(lambda p, x: x @ p["w"], w, jnp.zeros((0, 2, 3)))
    with pytest.raises(par.PipelineError, match=r"stage_fn maps a microbatch float32\[2, 3\] to .*accepted: a "
                                                r"stage_fn returning one array of its input's shape and dtype"):
        par.pipeline(lambda p, x: x[:, :2], w, jnp.zeros((4, 2, 3)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelines_refuse_mixture_of_experts_models(schedule):
    """A stage's blocks would drop the router losses and route per microbatch: another objective."""
    moe = Llama(LlamaConfig.tiny_moe(), rngs=nnx.Rngs(0))
    mesh = par.make_mesh("stage=2,data=4")
    with pytest.raises(par.PipelineError, match=rf"the {schedule} pipeline schedule supports dense models only "
                                                r"\(this one's MLP is a mixture of 4 experts\)"):
        par.schedule_lm_loss_fn(schedule, moe, n_stages=2, n_microbatches=2, mesh=mesh)
    if schedule == "gpipe":
        with pytest.raises(par.PipelineError, match="supports dense models only"):
            par.pipeline_hidden(moe, np.zeros((4, 8), np.int32), n_stages=2, n_microbatches=2)


def test_1f1b_checks_stages_and_mesh_when_built(tiny):
    model = tiny[0]
    with pytest.raises(par.PipelineError, match=r"mesh=None; accepted: a jax.sharding.Mesh \(the 1f1b schedule "
                                                r"places its stages on its 'stage' axis\)"):
        par.pipeline_1f1b_lm_loss_fn(model, n_stages=2, n_microbatches=2, mesh=None)
    with pytest.raises(par.PipelineError, match=r"n_stages=0; accepted: an integer >= 1"):
        par.pipeline_1f1b_lm_value_and_grad(model, n_stages=0, n_microbatches=2,
                                            mesh=par.make_mesh("stage=2,data=4"))


@pytest.mark.parametrize("spec,n_stages", [("stage=4,data=2", 2), ("stage=2,data=4", 4), ("data=8", 2)])
def test_gpipe_refuses_stages_that_differ_from_the_stage_axis(tiny, spec, n_stages):
    """Fewer stages than stage devices leave some idle, more run one after another on each: refused, as by 1F1B."""
    size = dict(par.make_mesh(spec).shape)["stage"]
    model = Llama(LlamaConfig.tiny(n_layers=4), rngs=nnx.Rngs(0))
    with pytest.raises(par.PipelineError, match=rf"n_stages={n_stages} does not match mesh axis 'stage' of size "
                                                rf"{size}; accepted: n_stages={size}"):
        par.pipeline_lm_loss_fn(model, n_stages=n_stages, n_microbatches=2, mesh=par.make_mesh(spec))
    with pytest.raises(par.PipelineError, match=rf"n_stages={n_stages} does not match"):
        par.pipeline(lambda w, x: x * w, np.ones((n_stages, 1)), np.ones((2, 8, 1)), mesh=par.make_mesh(spec))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_smaller_than_the_data_axis_are_one_pipeline_error(tiny, schedule):
    """1F1B raised a ShardingError about an activation's dim 0, suggesting a rule change, not naming
    n_microbatches."""
    model, _, _, batches, _ = tiny
    mesh = par.make_mesh("stage=2,data=4")
    build = par.pipeline_lm_loss_fn if schedule == "gpipe" else par.pipeline_1f1b_lm_loss_fn
    loss_fn, p = build(model, n_stages=2, n_microbatches=8, mesh=mesh, chunk=T)

    def traced(p, b):  # the gradient: 1F1B's loss alone is GPipe's forward
        with par.activation_sharding(None, mesh):
            return jax.grad(lambda p: loss_fn(p, b)[0])(p)

    with pytest.raises(par.PipelineError, match=r"n_microbatches=8 splits the batch 16 into 2 row\(s\) per "
                                                r"microbatch, not divisible by the data-parallel size 4 \(data\)"):
        jax.eval_shape(traced, p, batches[0])


def test_gpipe_gradient_is_finite_where_the_stage_is_not_finite_at_zero():
    """A stage that unit-normalises rows has a NaN Jacobian at zero: bubble ticks must not run it there."""
    S, M, D = 2, 4, 8
    mesh = par.make_mesh("stage=2,data=4")

    def stage_fn(w, x_BD):
        x_BD = x_BD @ w[0]
        return x_BD / jnp.sqrt(jnp.sum(x_BD * x_BD, -1, keepdims=True))

    def reference(w, x_M):
        for s in range(S):
            x_M = jax.vmap(lambda x, s=s: stage_fn(w[s], x))(x_M)
        return jnp.sum(x_M ** 3)

    w = jax.random.normal(jax.random.PRNGKey(0), (S, 1, D, D))
    x = jax.random.normal(jax.random.PRNGKey(1), (M, 4, D))
    (l, g), (l_ref, g_ref) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(w, x) for f in (
        lambda w, x: jnp.sum(par.pipeline(stage_fn, w, x, mesh=mesh) ** 3), reference))
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_batch_and_stage(tiny):
    _, loss_fn, params, batches, _ = tiny
    with pytest.raises(par.ZeroStageError, match="zero=4"):
        par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=8"), zero=4)
    with pytest.raises(par.ShardingError, match=r"\(vocab\) has size 259, not divisible by mesh axes tensor"):
        par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=4,tensor=2"),
                                    rules="vocab=tensor")
    with pytest.raises(ValueError, match=r"accum=2\.0; accepted: an integer >= 1"):
        par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=8"), accum=2.0)
    par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=8"), accum=np.int64(2))
    trainer = par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=8"))
    small = jax.tree.map(lambda x: x[:4], batches[0])
    with pytest.raises(par.ShardingError, match="batch size 4 is not divisible by data-parallel size 8"):
        trainer.step(None, small)
    state = trainer.init(params)
    for key, bad, message in [("targets", -100, r"batch\['targets'\] holds -100 where the mask counts it"),
                              ("targets", 300, r"batch\['targets'\] holds 300 where the mask"),
                              ("inputs", 259, r"batch\['inputs'\] holds 259; accepted: 0..258")]:
        ids = np.array(batches[0][key])
        ids[3, 5] = bad
        for placed in (np.asarray, jnp.asarray):  # host data, or already on a device
            with pytest.raises(ValueError, match=message):  # a NaN loss, or training toward a wrapped id
                trainer.step(state, {**batches[0], key: placed(ids)})


def test_zero_on_a_device_count_that_divides_nothing_warns(tiny):
    """On 3 devices no dimension of the tiny model divides: ZeRO-3 kept every byte on every device
    without a word (bytes as stage 0); a power of two shards it and says nothing."""
    import warnings

    _, loss_fn, params, _, _ = tiny
    with pytest.warns(UserWarning, match=r"^ZeRO-3 over data \(3 devices\) keeps 100% of the optimizer state whole "
                                         r"on every device: no dimension of those arrays divides by 3"):
        odd = par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params,
                                          par.make_mesh("data=3", devices=jax.devices()[:3]), zero=3)
    full = par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=3",
                                       devices=jax.devices()[:3]), zero=0).bytes_per_device()
    assert odd.bytes_per_device() == full
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, par.make_mesh("data=4",
                                    devices=jax.devices()[:4]), zero=3)


def test_a_batch_placed_on_another_sharding_is_resharded():
    """A batch already committed to one device (or to any other sharding) trains as the host batch
    (the jitted step refused it with JAX's 'Sharding passed to jit does not match')."""
    params, mesh = {"w": jnp.eye(8)}, par.make_mesh("data=8")
    trainer = par.make_sharded_train_step(lambda p, b: (jnp.sum((b["x"] @ p["w"]) ** 2), jnp.float32(8.0)),
                                          optax.sgd(0.1), params, mesh, donate=False)
    state, x = trainer.init(params), np.arange(64.0, dtype=np.float32).reshape(8, 8) / 64
    want = trainer.step(state, {"x": x})[1]["loss"]
    placed = jax.device_put(x, jax.devices()[3])
    np.testing.assert_array_equal(trainer.step(state, {"x": placed})[1]["loss"], want)


def test_user_loss_and_batch_contract_errors():
    """A plain-dict model: a scalar batch leaf and a loss that returns a mean (or a 3-tuple) each get one
    error naming what is wrong (were IndexError and 'iteration over a 0-d array')."""
    def loss(p, b):
        return jnp.sum((b["x"] @ p["w"]) ** 2), jnp.float32(b["x"].shape[0])

    params, mesh = {"w": jnp.ones((8, 8))}, par.make_mesh("data=8")
    trainer = par.make_sharded_train_step(loss, optax.sgd(0.1), params, mesh)
    with pytest.raises(par.ShardingError, match=r"batch\['t'\] is a scalar; accepted: every batch leaf an array "
                                                 "with a leading batch dimension"):
        trainer.step(trainer.init(params), {"x": jnp.ones((8, 8)), "t": jnp.float32(1.0)})
    # A count per example, or an unsummed loss: JAX's broadcasting or "Gradient only defined for scalar-output
    # functions" before.
    for bad, got in ((lambda p, b: loss(p, b)[0], r"one array of shape \(\)"),
                     (lambda p, b: (*loss(p, b), 0), "a 3-tuple"),
                     (lambda p, b: (loss(p, b)[0], jnp.ones(b["x"].shape[0])), r"a count of shape \(8,\)"),
                     (lambda p, b: ((b["x"] @ p["w"]) ** 2, 1.0), r"a loss sum of shape \(8, 8\)")):
        trainer = par.make_sharded_train_step(bad, optax.sgd(0.1), params, mesh)
        with pytest.raises(ValueError, match=rf"loss_fn returned ({got}).*accepted: a pair"):
            trainer.step(trainer.init(params), {"x": jnp.ones((8, 8))})
    # A state of another trainer (another ZeRO stage) is one error naming the leaf (jit's message dumped whole
    # shardings), and the state is still usable by its own trainer.
    zero0, zero3 = (par.make_sharded_train_step(loss, optax.adam(0.1), params, mesh, zero=z) for z in (0, 3))
    state = zero0.init(params)
    with pytest.raises(par.ShardingError, match=r"^state.params\['w'\] is placed as P.*\(None.*\), this step "
                                                 r"takes it as P.*\('data'.*\) on mesh .*; accepted: a state "
                                                 "from this trainer's init or step"):
        zero3.step(state, {"x": jnp.ones((8, 8))})
    assert np.isfinite(zero0.step(state, {"x": jnp.ones((8, 8))})[1]["loss"])
    # jmem's model-level entry points name the model a non-jmem model is (an AttributeError 'config' before).
    from jmem.lora import apply_lora, load_adapters, merge
    from jmem.quant import quantize

    for fn in (lambda m: apply_lora(m, 4), lambda m: quantize(m, "rtn"), merge,
               lambda m: load_adapters(m, "adapters.npz")):
        with pytest.raises(ValueError, match=r"^model is a Linear; accepted: a jmem.models.Llama model$"):
            fn(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))


@pytest.mark.slow
@pytest.mark.parametrize("spec,zero,accum,rules", [
    ("data=8", 0, 1, None), ("data=8", 1, 1, None), ("data=4,fsdp=2", 2, 2, None), ("fsdp=8", 3, 1, None),
    ("fsdp=8", 3, 2, None), ("data=4,tensor=2", 0, 1, None), ("fsdp=4,tensor=2", 1, 2, None),
    ("data=4,fsdp=2", 2, 2, "embed=fsdp")])
def test_stages_and_tensor_parallel_match_single_device(tiny, spec, zero, accum, rules):
    _, loss_fn, params, batches, ref = tiny
    losses, text, _, _ = _train(loss_fn, params, par.make_mesh(spec), batches, zero=zero, accum=accum, rules=rules)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    counts, looped = par.collectives(text), par.collectives(text, in_loops=True)
    if zero == 1:
        assert counts.get("all-gather", 0) > 0  # updated shards gathered back into whole params
    if zero == 3:
        assert looped.get("all-gather", 0) >= 7  # each layer's 7 kernels, gathered inside the layer scan
    if accum > 1:  # per-group accumulators: the gradient is reduced once, after the microbatch loop
        assert looped.get("reduce-scatter", 0) == 0
        if "tensor" not in spec:  # pure data parallelism: only per-layer gathers of data-split params in loops
            split = zero == 3 or (rules is not None and "fsdp" in rules)
            assert set(looped) <= ({"all-gather"} if split else set()), looped
        if zero >= 2 and rules is None:
            assert counts.get("reduce-scatter", 0) == len(jax.tree.leaves(params))
        if zero < 2:
            assert counts.get("reduce-scatter", 0) == 0 and counts.get("all-reduce", 0) > 0


@pytest.mark.slow
def test_plain_jit_accumulation_reduces_per_microbatch(tiny):
    """The contrast: plain `jit` of scan-accumulation communicates inside the microbatch loop."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jmem.memory.accumulate import accumulate_value_and_grad

    _, loss_fn, params, batches, _ = tiny
    mesh = par.make_mesh("data=8")
    f = jax.jit(lambda p, b: accumulate_value_and_grad(lambda q, mb: loss_fn(q, mb)[0], p, b, 2),
                in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
    looped = par.collectives(f.lower(params, batches[0]).compile().as_text(), in_loops=True)
    assert looped.get("all-reduce", 0) + looped.get("reduce-scatter", 0) > 0


def test_vocabulary_parallel_head_by_default_where_the_vocabulary_divides():
    """A vocabulary that divides by `tensor` is split by default (embedding and head): the
    losses are the single-device ones and each device computes a quarter of the logits;
    the 259-token byte vocabulary stays whole."""
    cfg = LlamaConfig.tiny(n_layers=2, loss_chunk=T, vocab_size=256)
    loss_fn, params = par.model_loss_fn(Llama(cfg, rngs=nnx.Rngs(0)))
    batches = _batches(cfg)
    ref, _, _, _ = _train(loss_fn, params, par.make_mesh(devices=jax.devices()[:1]), batches)
    # 2 KV heads: tensor=4 keeps whole heads only with the KV projection replicated.
    losses, text, trainer, _ = _train(loss_fn, params, par.make_mesh("data=2,tensor=4"), batches,
                                      rules="kv_heads=none")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert trainer.zero.params["head"]["kernel"].spec == P(None, "tensor")
    assert trainer.zero.params["embed"]["embedding"].spec == P("tensor", None)
    # Per device, the head's forward and two backward matmuls shrink to a quarter.
    _, text_whole, _, _ = _train(loss_fn, params, par.make_mesh("data=2,tensor=4"), batches[:1],
                                 rules="vocab=none,kv_heads=none")
    head = 3 * 2 * (B // 2 * T) * cfg.dim * cfg.vocab_size  # per data-parallel group
    assert matmul_flops(text_whole) - matmul_flops(text) >= 0.75 * head

    whole = par.Rules.parse().spec(("embed", "vocab"), (64, 259), par.make_mesh("data=2,tensor=4"))
    assert whole == P(None, None)
    with pytest.raises(par.ShardingError, match="not divisible"):
        par.Rules.parse("vocab=tensor").spec(("embed", "vocab"), (64, 259), par.make_mesh("data=2,tensor=4"))


def test_zero3_gathers_again_for_the_backward_pass_rather_than_keeping_every_layer():
    """Without remat the layer scan kept each layer's all-gathered kernels as residuals, so a ZeRO-3 step's
    temporaries held the whole model (bench-8l: docs/benchmarks.md, ZeRO stages). Now `GatheredWeight`
    gathers again in the backward pass, as FSDP does: its temporaries stay within one layer's weights of
    ZeRO-2's, while its parameters take an eighth of the bytes."""
    from jmem.train import make_train_fns

    cfg = LlamaConfig.tiny(n_layers=6, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=4, head_dim=64, loss_chunk=T)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = par.make_mesh("fsdp=8")
    layer_bytes = 4 * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim)
    mem = {}
    for zero in (2, 3):
        fns = make_train_fns(model, par.constrain_gradients(optax.sgd(1e-2), mesh, stage=zero), mesh=mesh, zero=zero)
        abstract = jax.eval_shape(lambda: fns.init_state(model))
        jitted, _, _ = par.jit_train_step(fns.step, abstract, mesh, zero=zero)
        mem[zero] = jitted.lower(abstract, _batches(cfg)[0]).compile().memory_analysis()
    assert mem[3].temp_size_in_bytes < mem[2].temp_size_in_bytes + layer_bytes, (mem[2], mem[3], layer_bytes)
    assert mem[3].argument_size_in_bytes < mem[2].argument_size_in_bytes / 2

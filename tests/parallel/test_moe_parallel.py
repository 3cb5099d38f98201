"""An MoE model trained on a data- and expert-parallel mesh the way `experiments/train.py` builds
the step (`make_train_fns` + `jit_train_step`): with gradient accumulation it equals one device at
the same `accum`, and under ZeRO-3 the expert weights are all-gathered one layer at a time, inside
the layer scan, like the dense kernels."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jmem import parallel as par
from jmem.models import Llama, LlamaConfig
from jmem.parallel.hlo import collective_shapes
from jmem.train import make_train_fns

B, T, ACCUM, STEPS = 16, 16, 2, 2


def _batches(cfg):
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
        mask = (rng.random((B, T)) > 0.3).astype(np.float32)  # uneven masks: token-weighted router statistics
        out.append({"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": mask})
    return out


def _run(cfg, batches, mesh=None, zero=0):
    """(loss, grad_norm, moe_aux_loss) per step, and the compiled step (None on one device)."""
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-2)
    if mesh is not None:
        tx = par.constrain_gradients(tx, mesh, stage=zero)
    fns = make_train_fns(model, tx, accum=ACCUM, mesh=mesh, zero=zero)
    state = fns.init_state(model)
    if mesh is None:
        compiled = None
        step = jax.jit(fns.step)
    else:
        jitted, sh, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh, zero=zero)
        state = jax.device_put(state, sh)
        step = compiled = jitted.lower(state, batches[0]).compile()
    out = []
    for b in batches:
        state, m = step(state, b)
        out.append([float(m["loss"]), float(m["grad_norm"]), float(m["moe_aux_loss"])])
    return np.array(out), compiled, state


def test_moe_accumulation_on_a_mesh_equals_one_device_and_zero3_gathers_experts_per_layer():
    cfg = LlamaConfig.tiny_moe(n_layers=2, loss_chunk=T)
    batches = _batches(cfg)
    ref, _, _ = _run(cfg, batches)
    mesh = par.make_mesh("fsdp=4,expert=2")
    got, compiled, state = _run(cfg, batches, mesh, zero=3)
    # Routing (capacity, dropping, balancing statistics) sees the single-device microbatches.
    np.testing.assert_allclose(got, ref, rtol=1e-5)

    X, E, F, L = cfg.moe_experts, cfg.dim, cfg.ffn_dim, cfg.n_layers
    text = compiled.as_text()
    inside = collective_shapes(text, "all-gather", in_loops=True)
    outside = collective_shapes(text, "all-gather", in_loops=False)
    # Expert weights [L, X, E, F]: one layer's slice (experts still split over `expert`) is gathered
    # per layer inside the scan, never the whole stack outside it.
    assert not [s for s in outside if len(s) == 4 and s[2:] in ((E, F), (F, E))], outside
    per_layer = sorted(s for s in inside if len(s) == 4 and s[0] == 1)
    assert per_layer == sorted([(1, X // 2, E, F), (1, X // 2, E, F), (1, X // 2, F, E)]), inside
    # The state holds 1/8 of every expert weight per device (fsdp x expert).
    sh = compiled.input_shardings[0][0].params["layers"]["moe"]
    for name in ("expert_gate", "expert_up", "expert_down"):
        leaf = state.params["layers"]["moe"][name]
        assert sh[name].shard_shape(leaf.shape) == (L, X // 2) + tuple(
            n // 4 if i == int(np.argmax(leaf.shape[2:])) else n for i, n in enumerate(leaf.shape[2:])), name
    experts = sum(state.params["layers"]["moe"][n].size * 4 for n in ("expert_gate", "expert_up", "expert_down"))
    held = sum(par.bytes_per_device([state.params["layers"]["moe"][n]], [sh[n]])
               for n in ("expert_gate", "expert_up", "expert_down"))
    assert held == experts // 8
    # The dense weights too: over fsdp and expert, the whole data-parallel group (as DeepSpeed-MoE);
    # they were split over fsdp alone, four copies of each shard.
    dense = compiled.input_shardings[0][0].params["layers"]
    for name in ("wq", "wk", "wv", "wo"):
        leaf, leaf_sh = state.params["layers"][name]["kernel"], dense[name]["kernel"]
        assert par.bytes_per_device([leaf], [leaf_sh]) * 8 == leaf.size * 4, (name, leaf_sh.spec)


@pytest.mark.slow
def test_moe_accumulation_on_data_expert_tensor_mesh_equals_one_device():
    cfg = LlamaConfig.tiny_moe(n_layers=2, loss_chunk=T)
    batches = _batches(cfg)
    ref, _, _ = _run(cfg, batches)
    got, _, _ = _run(cfg, batches, par.make_mesh("data=2,expert=2,tensor=2"), zero=0)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.slow
def test_sharded_train_step_accumulates_moe_over_single_device_microbatches():
    """`make_sharded_train_step` with `model_loss_fn` of an MoE model: `jmem_batch_additive` is
    False, so accumulation keeps one device's microbatches on a data x expert mesh."""
    from tests.helpers import train_sharded

    cfg = LlamaConfig.tiny_moe(n_layers=2, loss_chunk=T)
    loss_fn, params = par.model_loss_fn(Llama(cfg, rngs=nnx.Rngs(0)))
    assert loss_fn.jmem_batch_additive is False
    batches = _batches(cfg)
    one = par.make_mesh(devices=jax.devices()[:1])
    ref = train_sharded(loss_fn, params, one, batches, accum=ACCUM)[0]
    got = train_sharded(loss_fn, params, par.make_mesh("data=4,expert=2"), batches, accum=ACCUM)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_zero3_gathers_the_bases_of_lora_wrapped_weights_per_layer():
    """A LoRA leaf's base (an expert weight or a kernel) is all-gathered one layer at a time inside the scan,
    as the weight unwrapped is; it was gathered whole, every layer at once, before the scan."""
    from jmem.lora import apply_lora

    cfg = LlamaConfig.tiny_moe(n_layers=2, loss_chunk=T)
    model = apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0, targets=("wq", "moe.expert_up"))
    mesh = par.make_mesh("fsdp=4,expert=2")
    tx = par.constrain_gradients(optax.adamw(1e-2), mesh, stage=3)
    fns = make_train_fns(model, tx, mesh=mesh, zero=3, adapters_only=True)
    state = fns.init_state(model)
    jitted, _, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh, zero=3)
    text = jitted.lower(jax.eval_shape(lambda: state), _batches(cfg)[0]).compile().as_text()
    X, E, F, L = cfg.moe_experts, cfg.dim, cfg.ffn_dim, cfg.n_layers
    HD = cfg.n_heads * cfg.head_dim
    outside = collective_shapes(text, "all-gather", in_loops=False)
    assert not [s for s in outside if s[-2:] in ((E, F), (E, HD)) and s[0] == L], outside
    inside = collective_shapes(text, "all-gather", in_loops=True)
    assert (1, X // 2, E, F) in inside and (1, E, HD) in inside, inside


@pytest.mark.parametrize("moe", [False, True])
def test_zero3_gathers_quantized_bases_per_layer_and_trains_as_one_device(moe):
    """QLoRA under ZeRO-3: each NF4 base (a dense kernel's, the experts') is all-gathered child by child
    one layer at a time inside the scan; its packed codes and scales were gathered whole, every layer at
    once, before the scan. The adapters train as on one device."""
    from jmem.lora import apply_lora
    from jmem.quant import quantize

    cfg = (LlamaConfig.tiny_moe if moe else LlamaConfig.tiny)(n_layers=2, loss_chunk=T)
    model = apply_lora(quantize(Llama(cfg, rngs=nnx.Rngs(0)), "nf4"), rank=2, alpha=4.0,
                       targets=("wq", "moe.expert_up") if moe else ("wq", "w_up"))
    mesh = par.make_mesh("fsdp=4,expert=2" if moe else "fsdp=8")
    batches = _batches(cfg)
    losses = {}
    for where in ("one", "zero3"):
        m = mesh if where == "zero3" else None
        tx = par.constrain_gradients(optax.adamw(1e-2), mesh, stage=3) if m else optax.adamw(1e-2)
        fns = make_train_fns(model, tx, mesh=m, zero=3 if m else 0, adapters_only=True)
        state = fns.init_state(model)
        if m is None:
            step = jax.jit(fns.step)
        else:
            jitted, sh, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh, zero=3)
            state = jax.device_put(state, sh)
            step = jitted.lower(state, batches[0]).compile()
            text = step.as_text()
        losses[where] = []
        for b in batches:
            state, metrics = step(state, b)
            losses[where].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["zero3"], losses["one"], rtol=1e-5)
    leaves = [model.layers.weight_var(n).get_value() for n in cfg.weight_names()]  # adapted or not
    children = {tuple(x.shape) for w in leaves for x in jax.tree.leaves(getattr(w, "base", w)) if x.ndim >= 3}
    assert children and all(s[0] == cfg.n_layers for s in children), children  # the packed codes [L, ...]
    outside = set(collective_shapes(text, "all-gather", in_loops=False))
    assert not outside & children, (outside, children)
    inside = set(collective_shapes(text, "all-gather", in_loops=True))
    assert any(s[0] == 1 and len(s) >= 2 for s in inside), inside

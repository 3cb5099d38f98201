"""The Llama decoder with MoE MLPs (`moe_experts > 0`): parameters, router statistics
out of the layer scan, and the router losses in the training loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models import ContiguousKVCache, Llama, LlamaConfig, get_config
from jmem.models.llama import block_and_stats, rms_norm
from jmem.parallel.rules import default_logical_axes, lookup_axes, path_str
from jmem.train.loss import lm_loss_sum, lm_loss_terms

CFG = LlamaConfig.tiny_moe(n_layers=3, loss_chunk=16)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


def _batch(seed, B=2, T=16):
    ids = np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]), "mask": jnp.ones((B, T))}


def test_params_paths_counts_and_preset(model):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params
    assert get_config("tiny-moe").moe_experts == 4
    layers = params["layers"]
    assert "moe" in layers and not {"w_gate", "w_up", "w_down"} & set(layers)
    assert layers["moe"]["expert_gate"].shape == (3, 4, CFG.dim, CFG.ffn_dim)
    table = default_logical_axes()
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        axes = lookup_axes(path_str(path), table)
        assert axes is not None and len(axes) == x.ndim, path_str(path)
    dense = nnx.to_pure_dict(nnx.state(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), nnx.Param))
    assert "moe" not in dense["layers"] and {"w_gate", "w_up", "w_down"} <= set(dense["layers"])


def test_router_stats_leave_the_scan_and_match_a_layer_loop(model):
    b = _batch(1)
    h, stats = jax.jit(lambda ids: model.hidden_and_router_stats(ids))(b["inputs"])
    # The same blocks in two compiled programs: equal up to the order XLA sums in.
    np.testing.assert_allclose(h, model.hidden(b["inputs"])[0], rtol=1e-6, atol=1e-6)
    # Reference: the same blocks applied one layer at a time in Python.
    @jax.jit
    def layer_loop(ids, weights):
        x = jnp.take(model.embed.embedding.get_value(), ids, axis=0)
        pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
        per_layer = []
        for i in range(CFG.n_layers):
            x, _, s = block_and_stats(CFG, jax.tree.map(lambda a: a[i], weights), x, pos)
            per_layer.append(s)
        return x, per_layer

    x, per_layer = layer_loop(b["inputs"], model.layers.weights())
    np.testing.assert_allclose(h, rms_norm(x, model.norm.scale.get_value(), CFG.norm_eps), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.aux_loss, np.mean([s.aux_loss for s in per_layer]), rtol=1e-5)
    np.testing.assert_allclose(stats.z_loss, np.mean([s.z_loss for s in per_layer]), rtol=1e-5)
    assert int(stats.dropped) == sum(int(s.dropped) for s in per_layer)
    np.testing.assert_allclose(stats.load, np.mean([s.load for s in per_layer], axis=0), rtol=1e-6)


def test_router_losses_are_added_to_the_training_loss(model):
    b = _batch(2)
    ce, count, stats = jax.jit(lambda b: lm_loss_terms(model, b))(b)
    total, count2 = jax.jit(lambda b: lm_loss_sum(model, b))(b)
    expected = ce + (CFG.moe_aux_weight * stats.aux_loss + CFG.moe_z_weight * stats.z_loss) * count
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert float(count2) == float(count) == 32.0

    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def router_grads(p):
        def f(p, aux_weight):
            m = nnx.merge(graphdef, p)
            m.config = CFG.replace(moe_aux_weight=aux_weight)
            return lm_loss_sum(m, b)[0]

        return [jax.grad(f)(p, w)["layers"]["moe"]["router"]["kernel"].get_value() for w in (0.0, 1.0)]

    # The balancing loss reaches the router: its gradient changes with the weight.
    g0, g1 = router_grads(params)
    assert float(jnp.max(jnp.abs(g1 - g0))) > 1e-4


@pytest.mark.parametrize("dropless", [False, True])
def test_padding_inputs_change_no_loss_term_with_an_input_mask(dropless):
    """A batch's "input_mask" keeps padding out of routing: what the padding holds changes neither the
    cross-entropy of the real tokens (it took expert places and dropped other rows' tokens) nor the
    router losses (it was averaged in). The loss mask alone is not used for it: it may zero real tokens."""
    model = Llama(LlamaConfig.tiny_moe(moe_dropless=dropless, moe_capacity_factor=0.5), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 259, size=(4, 17))
    lengths = [5, 9, 17, 17]  # rows 0 and 1 right-padded
    input_mask = np.array([[t < n for t in range(16)] for n in lengths], np.float32)
    mask = np.array([[t + 1 < n for t in range(16)] for n in lengths], np.float32)
    other = ids.copy()
    other[0, 5:], other[1, 9:] = rng.integers(0, 259, size=12), rng.integers(0, 259, size=8)
    terms = []
    for x in (ids, other):
        batch = {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:]), "mask": jnp.asarray(mask),
                 "input_mask": jnp.asarray(input_mask)}
        ce, count, stats = lm_loss_terms(model, batch)
        terms.append((float(ce), float(count), float(stats.aux_loss), float(stats.z_loss), int(stats.dropped)))
    np.testing.assert_allclose(terms[1], terms[0], rtol=1e-6)
    if not dropless:
        assert terms[0][4] > 0  # places are short: which tokens take them matters


def test_cached_generation_routes_without_dropping():
    """With places short, the full forward drops tokens; generation with a KV cache must not
    (a token's output would depend on how many tokens one call routes): prefill + one-token
    steps equal the full forward of the same weights routed dropless."""
    cfg = CFG.replace(moe_capacity_factor=0.5)
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(4)))
    dropless_def, _ = nnx.split(Llama(cfg.replace(moe_dropless=True), rngs=nnx.Rngs(4)))

    @jax.jit
    def full(ids):
        outs = []
        for gd in (graphdef, dropless_def):
            m = nnx.merge(gd, state)
            outs.append((m(ids)[0], m.hidden_and_router_stats(ids)[1].dropped))
        return outs

    step = jax.jit(lambda ids, pos, cache: nnx.merge(graphdef, state)(ids, positions=pos, cache=cache))
    ids = jax.random.randint(jax.random.key(5), (2, 10), 0, cfg.vocab_size)
    (capped, dropped_capped), (dropless, dropped) = full(ids)
    assert int(dropped_capped) > 0 and int(dropped) == 0
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    first, cache = step(ids[:, :6], pos[:, :6], ContiguousKVCache.create(cfg, 2, 10))
    outs = [first]
    for t in range(6, 10):
        logits, cache = step(ids[:, t:t + 1], pos[:, t:t + 1], cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), dropless, atol=3e-5)
    assert float(jnp.max(jnp.abs(capped - dropless))) > 1e-3  # the capacity did drop something that matters


def test_dense_model_reports_no_router_stats():
    m = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    _, stats = m.hidden_and_router_stats(_batch(3)["inputs"])
    assert stats is None and lm_loss_terms(m, _batch(3))[2] is None


@pytest.mark.parametrize("overrides, expected", [
    (dict(moe_experts=4, moe_top_k=5), "top_k=5; accepted: an integer in 1..n_experts=4"),
    (dict(moe_experts=-1), "moe_experts=-1 must be >= 0"),
    (dict(moe_experts=2, moe_capacity_factor=0.0), "capacity_factor=0.0; accepted: a finite number > 0"),
    (dict(moe_experts=2, moe_capacity_factor=float("inf")), "capacity_factor=inf; accepted: a finite number > 0"),
    (dict(moe_experts=4, moe_top_k=True), "top_k=True; accepted: an integer in 1..n_experts=4"),
    (dict(moe_experts=4, moe_aux_weight=float("nan")), "LlamaConfig.moe_aux_weight=nan; accepted: a finite number"),
    (dict(moe_experts=4, moe_z_weight=-1.0), "LlamaConfig.moe_z_weight=-1.0; accepted: a finite number >= 0"),
    (dict(moe_experts=4, moe_z_weight="0"), "LlamaConfig.moe_z_weight='0'; accepted: a finite number >= 0"),
    (dict(loss_chunk=None), "LlamaConfig.loss_chunk=None must be a positive integer"),  # failed in the train step
])
def test_bad_moe_config_is_one_clear_error(overrides, expected):
    with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
        LlamaConfig.tiny(**overrides)


def test_eager_calls_refuse_ids_outside_the_vocabulary():
    """The embedding lookup clamped them (an id of 300 read row 258, -5 row 0): a wrong forward."""
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    for ids, message in [(np.array([[1, 300]]), r"token ids hold 300; accepted: 0..258 \(the model's vocabulary\)"),
                         (np.array([[-5, 1]]), "token ids hold -5; accepted: 0..258"),
                         (np.array([[1.0, 2.0]]), r"token ids of shape \(1, 2\) and dtype float64; accepted: integers"),
                         (np.array([1, 2]), r"token ids of shape \(2,\) and dtype int64; accepted: integers")]:
        with pytest.raises(ValueError, match=message):
            model(ids)
    assert model(jnp.array([[0, 258]]))[0].shape == (1, 2, 259)


def test_lm_logits_of_a_row_do_not_depend_on_the_rows_beside_it():
    """`LM.logits` scores as generation and the server do (dropless): a capacity-routed forward gave row 0
    other logits beside another row (places fill from both)."""
    from jmem.io.tokenizer import ByteTokenizer
    from jmem.lm import LM

    lm = LM(Llama(CFG.replace(moe_capacity_factor=0.5), rngs=nnx.Rngs(4)), ByteTokenizer())
    ids = np.random.default_rng(6).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    alone, beside = np.asarray(lm.logits(ids[:1])), np.asarray(lm.logits(ids))
    np.testing.assert_allclose(beside[:1], alone, atol=2e-5)
    prefix = np.asarray(lm.logits(ids[:1, :5]))  # nor on the positions after it
    np.testing.assert_allclose(alone[:, :5], prefix, atol=2e-5)


def test_calibrated_compression_of_attention_weights_runs_on_an_moe_model():
    """Wanda pruning and whitened low-rank factorization of the attention linears read the blocks' weights
    layer by layer; an MoE block's `moe` weights (a dict) raised KeyError: 0."""
    from jmem.lowrank import factorize
    from jmem.models.config import LINEARS
    from jmem.prune import prune, sparsity_report

    model = Llama(CFG, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)
    pruned = prune(model, "wanda", sparsity=0.5, targets=("wq", "wk", "wv", "wo"), calibration=ids)
    assert abs(sparsity_report(pruned, ("wq",))["wq"]["zeros"] - 0.5) < 1e-6
    with pytest.raises(ValueError, match=r"targets \['w_gate', 'w_up', 'w_down'\] are not linear kernels of this "
                                         r"model's blocks \(its MLP is a mixture of experts\); accepted: wq, wk"):
        factorize(model, rank=8, targets=LINEARS)  # (was "holds a NoneType ... factorize before quantizing")
    low = factorize(model, rank=8, targets=("wq", "wo"), calibration=ids)
    assert type(low.layers.wq.kernel.get_value()).__name__ == "LowRank"
    assert np.isfinite(np.asarray(low(jnp.asarray(ids))[0])).all()

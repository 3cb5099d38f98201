"""Chunked cross-entropy equals the plain one (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.train.loss import chunked_cross_entropy, cross_entropy_sum, window_perplexity


@pytest.mark.parametrize("chunk", [4, 5, 32, None])  # divides T, leaves a tail, larger than T, the whole
def test_chunked_matches_full(chunk):
    rng = np.random.default_rng(chunk)
    B, T, E, V = 2, 12, 16, 40
    h = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, V)) * 0.3, jnp.float32)
    tgt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8, jnp.float32)

    def full(h, w):
        s, c = cross_entropy_sum(h @ w, tgt, mask)
        return s / c

    def chunked(h, w):
        s, c = chunked_cross_entropy(h, tgt, mask, lambda x: x @ w, chunk)
        return s / c

    v1, g1 = jax.value_and_grad(full, argnums=(0, 1))(h, w)
    v2, g2 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(v2, v1, rtol=1e-6)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Reference by hand: log-softmax at the target.
    logp = jax.nn.log_softmax(h @ w, axis=-1)
    ref = -jnp.sum(jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0] * mask) / jnp.sum(mask)
    np.testing.assert_allclose(v1, ref, rtol=1e-6)


def test_a_chunk_that_is_not_a_positive_integer_is_one_error():
    # None and 2.5 were TypeErrors from a comparison or a range deep inside.
    h, tgt = jnp.zeros((1, 4, 2)), jnp.zeros((1, 4), jnp.int32)
    for chunk in (0, 2.5, "2", True):
        with pytest.raises(ValueError, match=rf"^loss chunk={chunk!r}; accepted: an integer >= 1$"):
            chunked_cross_entropy(h, tgt, jnp.ones((1, 4)), lambda x: x @ jnp.zeros((2, 3)), chunk)


@pytest.mark.parametrize("ignored", [0, -100, 40])  # in range, the usual ignore index, the vocabulary size
def test_masked_positions_count_nothing_whatever_their_target(ignored):
    """A target outside the vocabulary where the mask is 0 read NaN (and NaN * 0 is NaN): the loss and
    its gradient are those of the counted positions, as with an in-range target there."""
    rng = np.random.default_rng(3)
    B, T, E, V = 2, 8, 16, 40
    h = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, V)) * 0.3, jnp.float32)
    tgt = rng.integers(0, V, (B, T))
    mask = np.ones((B, T), np.float32)
    mask[1, 3:] = 0
    ref = jax.value_and_grad(lambda w: cross_entropy_sum(h @ w, jnp.asarray(tgt), jnp.asarray(mask))[0])(w)
    tgt[1, 3:] = ignored
    for fn in (lambda w: cross_entropy_sum(h @ w, jnp.asarray(tgt), jnp.asarray(mask))[0],
               lambda w: chunked_cross_entropy(h, jnp.asarray(tgt), jnp.asarray(mask), lambda x: x @ w, 4)[0]):
        value, grad = jax.value_and_grad(fn)(w)
        np.testing.assert_allclose(value, ref[0], rtol=1e-6)
        np.testing.assert_allclose(grad, ref[1], rtol=1e-5, atol=1e-7)


def test_a_list_for_an_array_is_one_error_and_masked_ignore_ids_stay_finite_under_jit():
    """`cross_entropy_sum(list, ...)` was an AttributeError ('list' has no astype). The targets are not
    checked (jittable): a masked -100 counts nothing under jit too."""
    logits, tgt, mask = jnp.zeros((1, 4, 3)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4))
    for args, arg in (((logits.tolist(), tgt, mask), "logits_BTV is a list"),
                      ((logits, None, mask), "targets_BT=None"), ((logits, tgt, 1.0), "mask_BT is a float")):
        with pytest.raises(ValueError, match=rf"^cross_entropy_sum: {arg}; accepted: an array$"):
            cross_entropy_sum(*args)
    with pytest.raises(ValueError, match=r"^chunked_cross_entropy: h_BTE is a list; accepted: an array$"):
        chunked_cross_entropy([[[0.0]]], tgt, mask, lambda x: x, 2)
    ignored = jnp.asarray([[1, 2, -100, -100]])
    half = jnp.asarray([[1.0, 1.0, 0.0, 0.0]])
    for fn in (jax.jit(cross_entropy_sum),
               jax.jit(lambda h, t, m: chunked_cross_entropy(h, t, m, lambda x: x @ jnp.eye(3), 2))):
        total, count = fn(logits, ignored, half)
        np.testing.assert_allclose([total, count], [2 * np.log(3), 2], rtol=1e-6)


def test_chunking_bounds_logits_memory():
    """Full logits f32[B, T, V] are never materialised: temp memory of the
    chunked gradient is far below one copy of the logits."""
    B, T, E, V = 2, 512, 32, 4096
    h = jax.ShapeDtypeStruct((B, T, E), jnp.float32)
    w = jax.ShapeDtypeStruct((E, V), jnp.float32)
    tgt = jax.ShapeDtypeStruct((B, T), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, T), jnp.float32)

    def loss(h, w, t, m, chunk):
        return chunked_cross_entropy(h, t, m, lambda x: x @ w, chunk)[0]

    logits_bytes = B * T * V * 4
    temp = {}
    for chunk in (T, 64):
        g = jax.jit(jax.grad(lambda h, w, t, m: loss(h, w, t, m, chunk), argnums=(0, 1)))
        temp[chunk] = g.lower(h, w, tgt, mask).compile().memory_analysis().temp_size_in_bytes
    assert temp[T] >= logits_bytes
    # A few chunk-sized buffers (logits, softmax, cotangent) at most.
    assert temp[64] <= 3 * B * 64 * V * 4 < logits_bytes, temp


def test_window_perplexity_is_the_full_logits_perplexity():
    import math

    from flax import nnx

    from jmem.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(loss_chunk=8), rngs=nnx.Rngs(0))
    windows = np.random.default_rng(0).integers(0, model.config.vocab_size, (5, 17)).astype(np.int32)
    logits = np.asarray(model(jnp.asarray(windows[:, :-1]))[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, windows[:, 1:, None], axis=-1).mean()
    assert window_perplexity(model, windows, batch=2) == pytest.approx(math.exp(nll), rel=1e-5)
    # Bad windows or batch: one line each (batch=-1 scored nothing and returned a perfect 1.0).
    V = model.config.vocab_size
    for bad_windows, bad_batch, message in [
            (windows, -1, "batch=-1; accepted: an integer >= 1"), (windows, 0, "batch=0; accepted"),
            (windows + 0.7, 2, "windows of dtype float64; accepted: integer token ids"),
            (np.where(np.arange(17) == 3, V, windows), 2, f"windows hold token id {V}; accepted: ids in 0..{V - 1}"),
            (windows[:, :1], 2, r"windows of shape \(5, 1\); accepted: \[n >= 1, T >= 2\]"),
            (windows[0], 2, r"windows of shape \(17,\)"), (windows[:0], 2, r"windows of shape \(0, 17\)")]:
        with pytest.raises(ValueError, match=message):
            window_perplexity(model, bad_windows, batch=bad_batch)


def test_window_perplexity_of_an_moe_model_does_not_depend_on_the_batch():
    """Capacity routing made a window's score depend on the windows batched with it; scoring routes
    dropless, as generation does, and equals the dropless model's."""
    from flax import nnx

    from jmem.models import Llama, LlamaConfig

    cfg = LlamaConfig.tiny_moe(moe_capacity_factor=0.5)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    dropless = Llama(cfg.replace(moe_dropless=True), rngs=nnx.Rngs(0))
    windows = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 33)).astype(np.int32)
    ppl = [window_perplexity(model, windows, batch=b) for b in (1, 2, 4)]
    assert ppl == pytest.approx([ppl[0]] * 3, rel=1e-5)
    assert ppl[0] == pytest.approx(window_perplexity(dropless, windows, batch=4), rel=1e-6)


@pytest.mark.parametrize("bad", [-100, 259])
def test_a_counted_target_outside_the_vocabulary_is_named(bad):
    """It read a NaN logit, so the loss was NaN without a word; where the mask is 0 it stays accepted."""
    from flax import nnx

    from jmem.models import Llama, LlamaConfig
    from jmem.train.loss import lm_loss_sum

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, 259, (2, 8)).astype(np.int32)
    targets, mask = ids.copy(), np.ones((2, 8), np.float32)
    targets[1, 5] = bad
    with pytest.raises(ValueError, match=rf"batch\['targets'\] holds {bad} where the mask counts it; accepted: "
                                         r"0..258 \(the model's vocabulary\)"):
        lm_loss_sum(model, {"inputs": ids, "targets": targets, "mask": mask})
    # Traced, where nothing can be refused: NaN, never the loss of a wrapped-around id.
    total, _ = jax.jit(lm_loss_sum)(model, {"inputs": ids, "targets": targets, "mask": mask})
    assert np.isnan(float(total))
    mask[1, 5] = 0
    total, count = lm_loss_sum(model, {"inputs": ids, "targets": targets, "mask": mask})
    assert np.isfinite(float(total)) and float(count) == 15
    ids[0, 2] = bad
    with pytest.raises(ValueError, match=rf"batch\['inputs'\] holds {bad}; accepted: 0..258"):
        lm_loss_sum(model, {"inputs": ids, "targets": targets, "mask": mask})  # its NaN reaches later positions


@pytest.mark.parametrize("accum, mesh", [(1, None), (4, None), (1, "data=8"), (2, "data=4,tensor=2")])
def test_train_fns_with_a_loss_fn_minimise_its_sum_over_its_own_count(accum, mesh):
    """A loss_fn's count was thrown away: the step divided by batch['mask'].sum() (a KeyError without a
    'mask'; a wrong loss and gradient where the two differ)."""
    import optax
    from flax import nnx

    from jmem import parallel as par
    from jmem.train import make_train_fns

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(6, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(4)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), "y": jnp.asarray(rng.normal(size=(8, 3)),
                                                                                      jnp.float32),
             "w": jnp.asarray([1, 1, 0, 1, 0, 1, 1, 1], jnp.float32)}  # rows counted: 6, unevenly per microbatch

    def loss_fn(p, b):
        err = (nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2
        return jnp.sum(b["w"][:, None] * err), 3 * jnp.sum(b["w"]).astype(jnp.int32)

    def mean(p):
        s, c = loss_fn(p, batch)
        return s / c

    want_loss, want_grads = jax.value_and_grad(mean)(params)
    fns = make_train_fns(model, optax.sgd(1.0), accum=accum, loss_fn=loss_fn,
                         mesh=None if mesh is None else par.make_mesh(mesh))
    state = fns.init_state(model)
    new, metrics = jax.jit(fns.step)(state, batch)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
    for old, now, g in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params),
                           jax.tree.leaves(nnx.to_pure_dict(want_grads)), strict=True):
        np.testing.assert_allclose(old - now, g, rtol=1e-5, atol=1e-7)

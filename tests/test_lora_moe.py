"""LoRA adapters on a mixture-of-experts model's experts: one adapter per expert, run as (x A) B."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.tokenizer import ByteTokenizer
from jmem.lora import LoRA, apply_lora, combine, load_adapters, merge, save_adapters, split_trainable, with_dropout
from jmem.models import Llama, LlamaConfig
from jmem.quant import quantize

EXPERTS = ("moe.expert_gate", "moe.expert_up", "moe.expert_down")


def _with_random_b(model, seed=1):
    """Adapters whose B is not zero (a fresh adapter changes nothing)."""
    model = nnx.clone(model)
    for i, name in enumerate(EXPERTS + ("wq",)):
        holder = model.layers.moe if name.startswith("moe.") else model.layers.wq
        var = getattr(holder, name.removeprefix("moe.")) if name.startswith("moe.") else holder.kernel
        lo = var.get_value()
        b = 0.1 * jax.random.normal(jax.random.key(seed + i), lo.lora_b.shape)
        var.set_value(LoRA(lo.base, lo.lora_a, b, lo.alpha, lo.dropout, lo.rslora))
    return model


def _ids(cfg, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)


@pytest.mark.parametrize("dropless, quantized", [(False, None), pytest.param(True, None, marks=pytest.mark.slow),
                                                 (True, "nf4")])
def test_expert_adapters_compute_the_merged_model_and_its_gradients(dropless, quantized):
    """Capacity and dropless routing, float and NF4 experts (QLoRA): the adapted model's logits are those of
    the merged model, and the adapters' gradients those taken through the merged weights."""
    cfg = LlamaConfig.tiny_moe(moe_dropless=dropless)
    base = Llama(cfg, rngs=nnx.Rngs(0))
    if quantized:
        base = quantize(base, quantized)
    fresh = apply_lora(base, rank=4, alpha=8.0, targets=("wq",) + EXPERTS)
    ids = _ids(cfg)
    logits = lambda m: m(ids)[0]  # noqa: E731
    np.testing.assert_array_equal(logits(fresh), logits(base))  # B = 0
    model = _with_random_b(fresh)
    assert float(jnp.abs(logits(model) - logits(base)).max()) > 0.1
    np.testing.assert_allclose(logits(model), logits(merge(model)), rtol=1e-4, atol=1e-4)

    graph, state = nnx.split(model)
    train, frozen = split_trainable(state)

    def loss(train, merged):
        m = nnx.merge(graph, combine(train, frozen))
        m = merge(m) if merged else m
        return jnp.mean(jax.nn.log_softmax(m(ids)[0])[..., 7])

    got, want = jax.grad(loss)(train, False), jax.grad(loss)(train, True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=1e-6)
    up = got["layers"]["moe"]["expert_up"]
    assert up.lora_a.shape == (cfg.n_layers, cfg.moe_experts, cfg.dim, 4) and float(jnp.abs(up.lora_b).max()) > 0


def test_expert_adapters_need_no_merged_weight():
    """The forward and backward keep no [experts, in, out] float weight per adapter: the compiled gradient's
    temporaries are below those of the same step through merged weights by more than the experts' size."""
    from jmem.memory import measure

    cfg = LlamaConfig.tiny_moe(moe_dropless=True, moe_experts=16, ffn_dim=256)
    model = apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=2, alpha=4.0, targets=EXPERTS)
    graph, state = nnx.split(model)
    train, frozen = split_trainable(state)
    ids = _ids(cfg)

    def step(merged):
        def loss(train):
            m = nnx.merge(graph, combine(train, frozen))
            return jnp.mean((merge(m) if merged else m)(ids)[0])
        return lambda t: jax.grad(loss)(t)

    lora, merged = measure(step(False), train), measure(step(True), train)
    expert_bytes = sum(getattr(model.layers.moe, n.removeprefix("moe.")).get_value().base.nbytes for n in EXPERTS)
    assert merged.temp_bytes - lora.temp_bytes > expert_bytes, (lora.temp_bytes, merged.temp_bytes, expert_bytes)


def test_expert_adapter_dropout_acts_in_training_only():
    cfg = LlamaConfig.tiny_moe(moe_dropless=True)
    model = _with_random_b(apply_lora(Llama(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8.0, targets=("wq",) + EXPERTS,
                                      dropout=0.5))
    graph, state = nnx.split(model)
    ids = _ids(cfg)
    plain = model(ids)[0]
    dropped = nnx.merge(graph, with_dropout(state, jax.random.key(3)))(ids)[0]
    assert float(jnp.abs(dropped - plain).max()) > 1e-3
    np.testing.assert_array_equal(nnx.merge(graph, with_dropout(state, None))(ids)[0], plain)


def test_expert_adapters_save_load_and_generate(tmp_path):
    """save_adapters / load_adapters round trip (base sample checked); `LM.generate` matches the merged model."""
    cfg = LlamaConfig.tiny_moe(moe_dropless=True)
    base = Llama(cfg, rngs=nnx.Rngs(0))
    model = _with_random_b(apply_lora(base, rank=4, alpha=8.0, targets=("wq",) + EXPERTS))
    path = tmp_path / "experts.npz"
    save_adapters(model, path)
    loaded = load_adapters(base, path)
    ids = _ids(cfg, 1)
    np.testing.assert_array_equal(loaded(ids)[0], model(ids)[0])
    other = nnx.clone(base)  # the same model but for one expert weight
    other.layers.moe.expert_gate.set_value(Llama(cfg, rngs=nnx.Rngs(5)).layers.moe.expert_gate.get_value())
    with pytest.raises(ValueError, match="was trained on another base model: its moe.expert_gate weights"):
        load_adapters(other, path)
    tok = ByteTokenizer()
    assert jmem.LM(loaded, tok).generate(["ab"], max_new_tokens=5) == \
        jmem.LM(merge(loaded), tok).generate(["ab"], max_new_tokens=5)

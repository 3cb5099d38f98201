"""QLoRA through the training loop: NF4 base frozen, only adapters get gradients and optimizer state."""

import dataclasses
import io

import jax
import numpy as np
import pytest

from jmem.lora import split_trainable
from jmem.train import TrainConfig, train
from jmem.train.setup import build

QLORA = TrainConfig(model="tiny", steps=12, batch=8, seq=64, lr=1e-2, optimizer="adamw", lora_rank=4, lora_targets="wq,wv",
                    quantize_base="nf4", progress=False, eval_every=0, remat="none", warmup=0)


def _bytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_only_adapters_have_optimizer_state_and_change():
    run = build(QLORA)
    state = run.fns.init_state(run.model)
    adapters, frozen = split_trainable(state.params)
    adapter_bytes = _bytes(adapters)
    assert 0 < adapter_bytes < 0.05 * _bytes(frozen)
    # AdamW: two moments per adapter array plus a step count, nothing for the base.
    assert _bytes(state.opt_state) <= 2 * adapter_bytes + 64
    batch = run.data.batch(0, QLORA.batch, QLORA.seed)
    new, metrics = jax.jit(run.fns.step)(jax.tree.map(np.array, state), batch)
    new_adapters, new_frozen = split_trainable(new.params)
    assert np.isfinite(float(metrics["loss"]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(new_frozen)))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(new_adapters)))


def test_qlora_loss_goes_down():
    result = train(QLORA, out=io.StringIO())
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


@pytest.mark.parametrize("change, expected", [
    (dict(quantize_base="nf4", lora_rank=0), "--quantize-base needs --lora-rank"),
    (dict(quantize_base="q3"), "--quantize-base 'q3'; accepted"),
    (dict(lora_targets="wq,attn"), "--lora-targets attn; accepted"),
])
def test_bad_lora_flags(change, expected):
    with pytest.raises(ValueError, match=expected):
        train(dataclasses.replace(QLORA, **change), out=io.StringIO())


def test_lora_dropout_acts_in_train_steps_only():
    """--lora-dropout: the step's loss is computed with dropped adapter inputs (a key of seed, step
    and microbatch: the same state and step give the same loss), evaluation never drops."""
    cfg = dataclasses.replace(QLORA, lora_dropout=0.5, accum=2)
    run = build(cfg)
    step = jax.jit(run.fns.step)
    batch = run.data.batch(0, cfg.batch, cfg.seed)
    state, _ = step(jax.tree.map(np.array, run.fns.init_state(run.model)), batch)  # B leaves zero
    batch = run.data.batch(1, cfg.batch, cfg.seed)
    copy = lambda s: jax.tree.map(np.array, s)  # noqa: E731 - the step donates nothing here, but be safe
    _, m1 = step(copy(state), batch)
    _, m2 = step(copy(state), batch)
    _, m3 = step(copy(state._replace(step=state.step + 7)), batch)
    s, c = jax.jit(run.fns.eval_loss)(state.params, batch)
    assert float(m1["loss"]) == float(m2["loss"])  # deterministic for (seed, step)
    assert float(m1["loss"]) != float(m3["loss"])  # another step draws other masks
    assert abs(float(m1["loss"]) - float(s / c)) > 1e-4  # training dropped, evaluation did not
    with pytest.raises(ValueError, match="--lora-dropout 1.0; accepted: 0 <= p < 1"):
        build(dataclasses.replace(QLORA, lora_dropout=1.0))
    with pytest.raises(ValueError, match="--lora-dropout needs --lora-rank"):
        build(dataclasses.replace(QLORA, lora_dropout=0.1, lora_rank=0, quantize_base=None))

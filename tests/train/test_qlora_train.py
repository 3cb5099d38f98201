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

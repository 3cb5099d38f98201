"""QLoRA through the training loop: NF4 base frozen, only adapters get gradients and optimizer state."""

import dataclasses
import io
import json
import re

import jax
import numpy as np
import pytest

from jmem.lora import split_trainable
from jmem.train import TrainConfig, train
from jmem.train.checks import validate
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


def test_qlora_loss_goes_down(tmp_path):
    out = io.StringIO()
    result = train(dataclasses.replace(QLORA, log=str(tmp_path / "log.jsonl")), out=out)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    # The model's parameters (not the packed NF4 codes), and the adapters trained: rank 4 on wq and wv.
    cfg = build(QLORA).model_config
    adapters = cfg.n_layers * 4 * (cfg.dim + cfg.n_heads * cfg.head_dim + cfg.dim + cfg.n_kv_heads * cfg.head_dim)
    memory = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert (memory["params"], memory["trained_params"]) == (cfg.num_params, adapters)
    assert f"{cfg.num_params / 1e6:.2f}M params ({adapters / 1e3:.1f}k trained)" in out.getvalue()


def test_lora_trains_with_the_default_optimizer():
    """Adafactor (the default) with LoRA: steps relative to the parameter RMS would leave the
    zero-initialised B at 1e-3 of the rate, and the loss flat (it rose over these 16 steps)."""
    cfg = TrainConfig(model="tiny", steps=16, batch=8, seq=64, lora_rank=4, progress=False, eval_every=0, remat="none")
    assert cfg.optimizer == "adafactor"
    result = train(cfg, out=io.StringIO())
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses


@pytest.mark.parametrize("change, expected", [
    (dict(quantize_base="nf4", lora_rank=0), "--quantize-base needs --lora-rank"),
    (dict(quantize_base="q3"), "--quantize-base 'q3'; accepted"),
    (dict(lora_targets="wq,attn"), "--lora-targets attn; accepted: distinct names among wq, "),
    (dict(lora_targets=""), "--lora-targets ''; accepted: distinct names among wq, "),
    (dict(lora_targets="wq,wq"), "--lora-targets 'wq,wq'; accepted: distinct names among wq, "),
    (dict(lora_alpha=float("nan")), "--lora-alpha=nan must be a finite number > 0"),
    (dict(lora_alpha=-1.0), "--lora-alpha=-1.0 must be a finite number > 0"),
])
def test_bad_lora_flags(change, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
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
    with pytest.raises(ValueError, match="--lora-alpha needs --lora-rank > 0 .* does nothing"):
        validate(TrainConfig(model="tiny", lora_alpha=8.0))


MESH_REF = dataclasses.replace(QLORA, steps=3, seq=32, lora_targets="wq,wo,w_up,w_down", precision="f32",
                               eval_batches=1)


@pytest.mark.parametrize("quantize_base", ["nf4", pytest.param(None, marks=pytest.mark.slow)])
def test_lora_on_a_zero3_tensor_mesh_matches_one_device(quantize_base):
    """(Q)LoRA on data=2,fsdp=2,tensor=2 with ZeRO-3: the losses of one device."""
    cfg = dataclasses.replace(MESH_REF, quantize_base=quantize_base)
    ref = train(cfg, out=io.StringIO()).losses
    got = train(dataclasses.replace(cfg, mesh="data=2,fsdp=2,tensor=2", zero=3), out=io.StringIO()).losses
    np.testing.assert_allclose([got[k] for k in range(3)], [ref[k] for k in range(3)], rtol=1e-5)


def test_lora_dropout_with_accumulation_on_a_mesh_matches_one_device():
    """Dropout masks come from a microbatch's first row and shape: on a data-parallel mesh the
    microbatches are the single-device ones, so the run is the one-device run."""
    cfg = dataclasses.replace(MESH_REF, lora_dropout=0.1, accum=2)
    ref = train(cfg, out=io.StringIO()).losses
    got = train(dataclasses.replace(cfg, mesh="data=4,tensor=2"), out=io.StringIO()).losses
    np.testing.assert_allclose([got[k] for k in range(3)], [ref[k] for k in range(3)], rtol=1e-6)


def test_adapters_and_packed_base_split_with_their_weight():
    """Shardings of a QLoRA train state on a tensor mesh with ZeRO-3: A splits with its kernel's
    input rows, B with its output columns (parameters, gradients and optimizer moments alike, found
    by path); the NF4 codes split on the kernel's tensor axis, and a row split that would cut an
    absmax block (wo: 64 rows over tensor=2) leaves the rows whole."""
    from jmem.parallel import make_mesh
    from jmem.parallel.zero import model_state_bytes, state_shardings

    run = build(dataclasses.replace(MESH_REF, mesh="data=2,fsdp=2,tensor=2", zero=3))
    state = jax.eval_shape(lambda: run.fns.init_state(run.model))
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    sh = state_shardings(state, mesh, stage=3)
    per_device = model_state_bytes(state, mesh, stage=3, trainable=run.fns.trainable)
    assert per_device["grad_bytes_per_device"] < 0.2 * per_device["param_bytes_per_device"]  # adapters only
    layers = sh.params["layers"]
    wq, w_up, wo, w_down = (layers[k]["kernel"] for k in ("wq", "w_up", "wo", "w_down"))
    def on(sharding, dim):  # mesh axes of one dim (the specs name every dim)
        entry = sharding.spec[dim]
        return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)

    assert "tensor" in on(wq.lora_b, -1) and "tensor" not in on(wq.lora_a, -2)  # column-parallel: B on out
    assert "tensor" in on(w_down.lora_a, -2) and "tensor" not in on(w_down.lora_b, -1)  # row-parallel: A on in
    assert "tensor" in on(wq.base.codes, -1) and "tensor" in on(w_up.base.codes, -1)
    assert "tensor" not in str(wo.base.codes.spec)  # 32 rows per shard would cut a 64-row absmax block
    mu = sh.opt_state[1][0].mu["layers"]["w_down"]["kernel"]  # adamw's first moment
    assert mu.lora_a.spec == w_down.lora_a.spec and jax.tree.leaves(mu.base) == []  # no state for the base


def test_the_rtn_base_is_the_one_jmem_quantize_writes():
    """--quantize-base rtn trained on 4-bit per-channel weights, `jmem quantize --method rtn` (groups of 128)
    wrote others: adapters were served on another base than they were trained on."""
    from flax import nnx

    from jmem.models import Llama, get_config
    from jmem.quant import quantize
    from jmem.train.setup import _with_adapters

    model = Llama(get_config("small"), rngs=nnx.Rngs(0))  # width 256: per channel and groups of 128 differ
    trained = _with_adapters(dataclasses.replace(QLORA, model="small", quantize_base="rtn", lora_rank=0),
                             nnx.clone(model))
    served = quantize(model, "rtn")  # the defaults of `jmem quantize --method rtn`
    for name in ("wq", "w_down"):
        a, b = (getattr(m.layers, name).kernel.get_value() for m in (trained, served))
        np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()))


def test_qlora_on_a_mixture_of_experts_adapts_every_expert(tmp_path):
    """`--model tiny-moe --lora-rank 4 --quantize-base nf4`: the default targets mean the attention linears and
    the experts (one adapter per expert) over an NF4 base, experts included; the loss goes down and the memory
    table's estimate counts the same trained parameters."""
    cfg = dataclasses.replace(QLORA, model="tiny-moe", lora_targets=TrainConfig().lora_targets, steps=16,
                              log=str(tmp_path / "log.jsonl"))
    result = train(cfg, out=io.StringIO())
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    run = build(dataclasses.replace(cfg, log=None))
    mc = run.model_config
    attention = mc.dim + mc.n_heads * mc.head_dim + 2 * (mc.dim + mc.n_kv_heads * mc.head_dim) + \
        mc.n_heads * mc.head_dim + mc.dim
    experts = mc.moe_experts * 3 * (mc.dim + mc.ffn_dim)
    memory = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert memory["trained_params"] == mc.n_layers * 4 * (attention + experts)
    assert memory["estimate"]["trainable"] == 4 * memory["trained_params"]  # f32 adapters
    assert type(run.model.layers.moe.expert_up.get_value().base).__name__ == "NF4Tensor"

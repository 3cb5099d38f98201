"""The analytic estimate against the compiler's measurement of a real train step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmem.memory.estimate import estimate, format_estimate, layer_grad_bytes, layer_param_bytes, param_shapes
from jmem.memory.measure import measure, tree_bytes
from jmem.models import Llama, LlamaConfig
from jmem.models.config import EXPERT_TARGETS
from jmem.optim import make_optimizer

CFG = LlamaConfig.tiny(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=512)


def _abstract_params(cfg):
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


@pytest.mark.parametrize("cfg", [CFG, LlamaConfig.tiny(moe_experts=4, moe_top_k=2)], ids=["dense", "moe"])
def test_param_shapes_match_the_model(cfg):
    _, params = _abstract_params(cfg)
    ours = param_shapes(cfg)
    model_shapes = {jax.tree_util.keystr(p): (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    est_shapes = {jax.tree_util.keystr(p): (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(ours)}
    # Same leaves (the model's paths end in `.value`), same shapes, path by path.
    assert {k.removesuffix(".value"): v for k, v in model_shapes.items()} == est_shapes
    assert tree_bytes(params) == estimate(cfg, 2, 16)["params"] == 4 * cfg.num_params


@pytest.mark.parametrize("name", ["adamw", "adafactor", "adam8bit", "sgd"])
def test_optimizer_bytes_equal_the_real_state(name):
    _, params = _abstract_params(CFG)
    real = tree_bytes(jax.eval_shape(make_optimizer(name, 1e-3).init, params))
    assert estimate(CFG, 2, 16, optimizer=name)["optimizer"] == real


def test_no_remat_estimate_within_15_percent_of_measured_train_step():
    graphdef, params = _abstract_params(CFG)
    tx = optax.adamw(1e-3)
    opt_state = jax.eval_shape(tx.init, params)
    B, T = 8, 65
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss_fn(params, ids):
        logits, _ = nnx.merge(graphdef, params)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    def train_step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    measured = measure(jax.jit(train_step, donate_argnums=(0, 1)), params, opt_state, ids)
    est = estimate(CFG, B, T - 1, remat="none", optimizer="adamw")
    ratio = est["total"] / measured.total_bytes
    print(measured.table("measured"), format_estimate(est), f"ratio {ratio:.3f}", sep="\n")
    assert 0.85 <= ratio <= 1.15
    # The activations are a large share here, so the check is not carried by params alone.
    assert est["activations"] > 0.5 * est["total"]


def _train_step_estimate_ratio(**flags):
    """(estimate, estimate total / compiled total) of `experiments/train.py`'s step, f32, no remat unless
    `flags` name one."""
    from jmem.train import TrainConfig
    from jmem.train.loop import estimate_bytes
    from jmem.train.setup import build

    flags = {"remat": "none", **flags}
    cfg = TrainConfig(steps=1, optimizer="adamw", progress=False, eval_every=0, precision="f32", **flags)
    run = build(cfg)
    state = jax.eval_shape(lambda: run.fns.init_state(run.model))
    measured = measure(jax.jit(run.fns.step, donate_argnums=0), state, run.data.batch(0, cfg.batch, cfg.seed))
    est = estimate_bytes(run)
    ratio = est["total"] / measured.total_bytes
    print(measured.table("measured"), format_estimate(est), f"ratio {ratio:.3f}", sep="\n")
    return est, ratio


def test_moe_estimate_within_15_percent_of_measured_train_step():
    """tiny-moe's train step (router, 4 experts, top-2, capacity 1.25), no remat: experts' rows per token
    and the router's parameters counted."""
    est, ratio = _train_step_estimate_ratio(model="tiny-moe", batch=8, seq=256)
    assert 0.85 <= ratio <= 1.15
    dense = estimate(LlamaConfig.tiny_moe().replace(moe_experts=0), 8, 256, remat="none")
    assert est["activations"] > 1.3 * dense["activations"]
    # A capacity beyond every token per expert (4 experts, top-2: factor 2) adds no rows (it read 2e30 MiB).
    full, huge = (estimate(LlamaConfig.tiny_moe(moe_capacity_factor=f), 8, 256, remat="none") for f in (2.0, 1e30))
    assert huge == full


@pytest.mark.parametrize("targets", ["wq,wv", "wq,wk,wv,wo,w_gate,w_up,w_down"])
def test_lora_estimate_within_15_percent_of_measured_train_step(targets):
    """A LoRA step saves only the matmul inputs an adapted weight reads: with wq, wv adapted the
    norms' outputs, the attention output and the MLP hidden state are not kept across layers."""
    _, ratio = _train_step_estimate_ratio(model="small", batch=4, seq=128, lora_rank=8, lora_targets=targets)
    assert 0.85 <= ratio <= 1.15


@pytest.mark.parametrize("lora", [{}, dict(lora_rank=4, lora_targets="wq,wv"), dict(lora_rank=4, quantize_base="nf4")])
def test_layer_param_bytes_are_the_runs_layers(lora):
    """What --offload-params host moves off the device, as the memory table subtracts it: the float layers'
    size was subtracted whatever the run held, and a QLoRA run's estimated params came out negative; the
    layers' gradients (and their accumulator) stayed on the device."""
    from jmem.train import TrainConfig
    from jmem.train.report import estimate_bytes
    from jmem.train.setup import build

    cfg = TrainConfig(model="tiny", steps=1, progress=False, eval_every=0, precision="f32", optimizer="adamw",
                      offload_optimizer="host", offload_params="host", accum=2, **lora)
    run = build(cfg)
    state = jax.eval_shape(lambda: run.fns.init_state(run.model))
    layers = tree_bytes(state.params["layers"])
    targets = tuple(lora.get("lora_targets", "wq,wk,wv,wo,w_gate,w_up,w_down").split(","))
    assert layer_param_bytes(LlamaConfig.tiny(), jnp.float32, **{**lora, "lora_targets": targets}) == layers
    est = estimate_bytes(run)
    assert est["params"] == tree_bytes(state.params) - layers > 0
    device_trained = 0 if lora else tree_bytes(state.params) - layers  # LoRA: every adapter sits in a layer
    assert est["grads"] == 2 * device_trained  # the f32 gradients and their f32 accumulator


@pytest.mark.parametrize("policy", ["layer_input=device", "mlp_out=device", "layer_input=offload,mlp_out=offload"])
def test_names_xla_keeps_anyway_or_never_add_nothing(policy):
    """The layer's input is kept by every policy, and nothing in the backward pass reads mlp_out: saving
    either compiles to what `full` does (measured), so the estimate adds nothing for them."""
    full = estimate(CFG, 8, 128, remat="full")
    assert estimate(CFG, 8, 128, remat=policy) == full


def test_moe_minimal_remat_estimate_within_15_percent_of_measured_train_step():
    """The experts' gate, up and hidden activations carry the MLP's remat names (they were untagged: every
    MLP name did nothing on an MoE model while the estimate counted them)."""
    _, ratio = _train_step_estimate_ratio(model="tiny-moe", batch=4, seq=64, remat="minimal")
    assert 0.85 <= ratio <= 1.15


def test_remat_and_accumulation_order_and_bad_input():
    none = estimate(CFG, 8, 128, remat="none")
    full = estimate(CFG, 8, 128, remat="full")
    minimal = estimate(CFG, 8, 128, remat="minimal")
    acc4 = estimate(CFG, 8, 128, remat="none", accum=4)
    assert full["activations"] < minimal["activations"] < none["activations"]
    assert acc4["activations"] < none["activations"] / 3.5
    assert acc4["grads"] == none["grads"] + 4 * CFG.num_params  # f32 accumulator
    off = estimate(CFG, 8, 128, remat="offload")
    assert off["activations"] == full["activations"] and off["activations_host"] > 0
    flash = estimate(CFG, 8, 128, attention="pallas")
    assert flash["activations"] < none["activations"]
    bf16 = estimate(CFG, 8, 128, compute_dtype="bf16")
    assert bf16["activations"] < none["activations"]
    with pytest.raises(ValueError, match="does not divide|divides"):
        estimate(CFG, 8, 128, accum=3)
    with pytest.raises(ValueError, match="adamw, adafactor"):
        estimate(CFG, 8, 128, optimizer="adam9")
    with pytest.raises(ValueError, match="remat"):
        estimate(CFG, 8, 128, remat="everything")
    with pytest.raises(ValueError, match="estimate: config='tiny'; accepted: a jmem.models.LlamaConfig"):
        estimate("tiny", 8, 128)
    # The optimizer name as make_optimizer reads it (case and spaces); dtypes as names or dtype objects.
    assert estimate(CFG, 8, 128, optimizer=" Adam8bit") == estimate(CFG, 8, 128, optimizer="adam8bit")
    assert estimate(CFG, 8, 128, compute_dtype=jnp.bfloat16) == bf16
    for bad in ("int8", jnp.int8, "fp8", None.__class__):
        with pytest.raises(ValueError, match=r"^dtype .*; accepted: f32, float32, bf16, bfloat16, f16, float16 or "
                                             "one of those dtypes$"):
            estimate(CFG, 8, 128, compute_dtype=bad)


def test_auto_attention_estimate_follows_the_compile_target():
    """"auto" runs flash attention when compiling for a GPU/TPU (no T^2 scores), XLA attention elsewhere."""
    from jmem.kernels.dispatch import compiling_for

    xla, flash = (estimate(CFG, 8, 128, remat="none", attention=a) for a in ("xla", "pallas"))
    assert flash["activations"] < xla["activations"]
    assert estimate(CFG, 8, 128, remat="none", attention="auto") == xla  # this CPU machine
    for platform in ("gpu", "tpu"):
        with compiling_for(platform):
            assert estimate(CFG, 8, 128, remat="none", attention="auto") == flash


@pytest.mark.parametrize("kw, message", [
    (dict(loss_chunk=-5), "loss_chunk=-5; accepted: an integer >= 1, or None"),
    (dict(loss_chunk=0), "loss_chunk=0; accepted"),
    (dict(batch=True), "batch=True; accepted: an integer >= 1"),
    (dict(batch=2.5), "batch=2.5; accepted: an integer >= 1"),
    (dict(seq=0), "seq=0; accepted: an integer >= 1"),
    (dict(accum=0), "accum=0; accepted: an integer >= 1"),
    (dict(lora_rank=-1), "lora_rank=-1; accepted: an integer >= 0"),
    (dict(lora_rank=4, quantize_base="rtn", base_group_size=7), "base_group_size: group_size=7"),
    (dict(trained_layers=1.0), "trained_layers=1.0; accepted: an integer >= 1, or None (every layer)"),
    (dict(trained_layers=True), "trained_layers=True; accepted: an integer >= 1, or None (every layer)"),
    (dict(trained_layers=0), "trained_layers=0; accepted: an integer >= 1, or None (every layer)"),
    (dict(trained_layers=5), "trained_layers=5; accepted: 1..4 (the model's layers)"),
    (dict(optimizer_kw=[1]), "optimizer_kw=[1]; accepted: a dict of the optimizer's keywords, or None"),
    (dict(lora_rank=4, lora_targets="wx"), "lora_targets ['wx']; accepted: wq, wk"),
    (dict(lora_rank=4, lora_targets=()), "lora_rank=4 with no lora_targets; accepted: one or more of wq, wk"),
    (dict(lora_rank=4, lora_targets=None), "lora_targets=None; accepted: one or more of wq, wk"),
    (dict(lora_rank=4, lora_targets=[1]), "lora_targets=[1]; accepted: one or more of wq, wk"),
    (dict(master_weights="no"), "master_weights='no'; accepted: True or False"),
    (dict(lora_rank=4, quantize_base="nf4", base_group_size=7),
     "base_group_size=7 with quantize_base='nf4', which has no group size; accepted: None, or quantize_base='rtn'"),
])
def test_bad_arguments_name_themselves(kw, message):
    args = {"batch": 8, "seq": 128, **kw}
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate(CFG, args.pop("batch"), args.pop("seq"), **args)


@pytest.mark.parametrize("kw, message", [
    (dict(lora_rank=-1), "lora_rank=-1; accepted: an integer >= 0"),  # it gave negative adapter bytes
    (dict(lora_rank="a"), "lora_rank='a'; accepted: an integer >= 0"),
    (dict(lora_rank=4, quantize_base="xx"), "quantize_base='xx'; accepted: nf4, int8, fp8, rtn"),  # a KeyError
    (dict(lora_rank=4, lora_targets=None), "lora_targets=None; accepted: one or more of wq"),
])
def test_layer_bytes_check_their_arguments_as_estimate(kw, message):
    for layer_bytes in (layer_param_bytes, layer_grad_bytes):
        with pytest.raises(ValueError, match=re.escape(message)):
            layer_bytes(CFG, **kw)
    with pytest.raises(ValueError, match=re.escape("accum=0; accepted: an integer >= 1")):
        layer_grad_bytes(CFG, accum=0)


def test_one_lora_target_as_a_string_and_numpy_trained_layers():
    assert estimate(CFG, 8, 128, lora_rank=4, lora_targets=("wq", "wq")) == estimate(CFG, 8, 128, lora_rank=4,
                                                                                      lora_targets="wq")
    assert estimate(CFG, 8, 128, lora_rank=4, lora_targets="wq") == estimate(CFG, 8, 128, lora_rank=4,
                                                                             lora_targets=("wq",))
    assert estimate(CFG, 8, 128, trained_layers=np.int64(2)) == estimate(CFG, 8, 128, trained_layers=2)


def test_qlora_estimate_within_15_percent_of_measured_arguments():
    """NF4 base + adapters with their optimizer state: the train step's argument bytes."""
    from jmem.lora import split_trainable
    from jmem.train import TrainConfig
    from jmem.train.loop import estimate_bytes
    from jmem.train.setup import build

    cfg = TrainConfig(model="tiny", steps=1, batch=4, seq=32, optimizer="adamw", lora_rank=8,
                      lora_targets="wq,wv,w_down", quantize_base="nf4", progress=False, eval_every=0, remat="none")
    run = build(cfg)
    state = run.fns.init_state(run.model)
    batch = run.data.batch(0, cfg.batch, cfg.seed)
    measured = measure(jax.jit(run.fns.step, donate_argnums=0), state, batch).argument_bytes
    est = estimate_bytes(run)
    ratio = (est["params"] + est["optimizer"] + est["batch"]) / measured
    print(format_estimate(est), f"measured arguments {measured}, ratio {ratio:.3f}", sep="\n")
    assert 0.85 <= ratio <= 1.15
    # The parts are exact: adapters (the only gradients), the NF4 base as stored, AdamW on adapters.
    train, frozen = split_trainable(state.params)
    assert est["trainable"] == est["grads"] == tree_bytes(train)
    assert est["frozen"] == tree_bytes(frozen)
    assert abs(est["optimizer"] - tree_bytes(state.opt_state)) <= 16  # a schedule's step count
    full = estimate(run.model_config, cfg.batch, cfg.seq, remat="none")
    assert est["params"] < 0.5 * full["params"] and est["optimizer"] < 0.1 * full["optimizer"]


@pytest.mark.parametrize("fmt", ["int8", "fp8", "rtn"])
def test_frozen_base_bytes_equal_the_quantized_model(fmt):
    from jmem.lora import apply_lora, split_trainable
    from jmem.quant import quantize

    cfg = LlamaConfig.tiny()
    model = quantize(Llama(cfg, rngs=nnx.Rngs(0)), fmt, group_size=None)
    model = apply_lora(model, rank=4, targets=("wq", "wo"), inplace=True)
    train, frozen = split_trainable(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    est = estimate(cfg, 2, 16, lora_rank=4, lora_targets=("wq", "wo"), quantize_base=fmt)
    assert est["frozen"] == tree_bytes(frozen) and est["trainable"] == tree_bytes(train)
    with pytest.raises(ValueError, match="quantize_base needs lora_rank"):
        estimate(cfg, 2, 16, quantize_base=fmt)


def test_lora_targets_are_checked_against_the_model_and_the_full_list_means_every_weight():
    moe, dense = LlamaConfig.tiny_moe(), LlamaConfig.tiny()
    for fn in (lambda c, t: estimate(c, 2, 32, lora_rank=4, lora_targets=t),
               lambda c, t: layer_param_bytes(c, lora_rank=4, lora_targets=t)):  # was a KeyError
        with pytest.raises(ValueError, match=r"lora_targets \['w_up'\]; accepted: wq, wk, wv, wo, moe.expert_gate"):
            fn(moe, ("w_up",))
        with pytest.raises(ValueError, match=r"lora_targets \['moe.expert_up'\]; accepted: wq, wk, wv, wo, w_gate"):
            fn(dense, ("moe.expert_up",))
        # The linears' full list in any order is the default: on an MoE model, the attention and the experts.
        shuffled = ("w_down", "wq", "wk", "wv", "wo", "w_gate", "w_up")
        assert fn(moe, shuffled) == fn(moe, ("wq", "wk", "wv", "wo") + EXPERT_TARGETS)

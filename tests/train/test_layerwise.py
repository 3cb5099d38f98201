"""Layer-wise (LISA) training: schedules, frozen layers, optimizer resets, equality with the
plain step at n_active = L, LoRA, and the compiler-measured memory of the step."""

import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmem.data import PackedDataset, default_text
from jmem.io.tokenizer import ByteTokenizer
from jmem.lora import apply_lora
from jmem.memory.estimate import estimate
from jmem.memory.measure import measure_and_compile, tree_bytes
from jmem.models.config import LlamaConfig
from jmem.models.llama import Llama
from jmem.train.layerwise import LayerwiseError, active_layers, make_layerwise_fns
from jmem.train import TrainConfig, train
from jmem.train.report import count_text
from jmem.train.step import make_train_fns
from tests.helpers import experiment

L, B, T = 4, 2, 16
TX = optax.adam(1e-2)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(n_layers=L, remat="full"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def data():
    return PackedDataset.from_text(default_text(), ByteTokenizer(), T)


def _batch(data, step):
    return {k: jnp.asarray(v) for k, v in data.batch(step, B, seed=0).items()}


@pytest.fixture(scope="module")
def compiled(model, data):
    """`compiled(name) -> (fns, memory report, compiled donated step)` for full training ("full") and
    n_active = 1, 2 and L ("n1", "n2", "nL"), each compiled once on first use, for both its measurement
    and its runs. The runs call the compiled executable, which cannot retrace: a new layer draw at a
    period boundary needs no new program."""
    makers = {"full": lambda: make_train_fns(model, TX), "n1": lambda: make_layerwise_fns(model, TX, 1, period=2),
              "n2": lambda: make_layerwise_fns(model, TX, 2, period=2), "nL": lambda: make_layerwise_fns(model, TX, L)}
    cache = {}

    def get(name):
        if name not in cache:
            fns = makers[name]()
            state = jax.eval_shape(lambda: fns.init_state(model))
            report, step = measure_and_compile(jax.jit(fns.step, donate_argnums=0), state, _batch(data, 0))
            cache[name] = (fns, report, step)
        return cache[name]

    return get


def _run(fns, step, model, data, steps, state=None):
    state = fns.init_state(model) if state is None else state
    losses = []
    for i in range(int(state.step), int(state.step) + steps):
        state, m = step(state, _batch(data, i))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("schedule", ["random", "bottom-up", "top-down"])
def test_schedules_are_deterministic_distinct_and_cover_every_layer(schedule):
    kw = dict(n_layers=8, n_active=3, period=5, schedule=schedule, seed=7)
    traced = jax.jit(jax.vmap(lambda s: active_layers(s, **kw)))  # as inside the step: a traced counter
    draws = np.asarray(traced(jnp.arange(40)))
    np.testing.assert_array_equal(np.asarray(active_layers(17, **kw)), draws[17])  # eager = traced
    # Constant within a period, and the same for a resumed run (a function of (seed, period)).
    np.testing.assert_array_equal(draws, np.repeat(draws[::5], 5, axis=0))
    draws = draws[::5]
    for d in draws:
        assert d.dtype == np.int32 and len(set(d.tolist())) == 3 and d.min() >= 0 and d.max() < 8
        assert list(d) == sorted(d)
    assert set(np.concatenate(draws).tolist()) == set(range(8))
    if schedule == "bottom-up":
        assert [d.tolist() for d in draws[:3]] == [[0, 1, 2], [3, 4, 5], [0, 6, 7]]
    elif schedule == "top-down":
        assert [d.tolist() for d in draws[:3]] == [[5, 6, 7], [2, 3, 4], [0, 1, 7]]
    else:  # the draws change with the period and with the seed
        assert len({tuple(d) for d in draws}) > 2
        other = jax.vmap(lambda s: active_layers(s, **{**kw, "seed": 8}))(jnp.arange(0, 40, 5))
        assert not np.array_equal(np.asarray(other), draws)


def test_active_layers_takes_a_step_counter_only():
    """`active_layers(-1)`, `(2.5)` and `("3")` drew some period's layers; a traced float step ran too."""
    kw = dict(n_layers=8, n_active=3, period=5, schedule="bottom-up")
    for step in (-1, 2.5, "3", True, None):
        with pytest.raises(ValueError, match=rf"^step={re.escape(repr(step))}; accepted: an integer >= 0$"):
            active_layers(step, **kw)
    with pytest.raises(ValueError, match=r"^step is traced float32\[\]; accepted: an integer >= 0 or a traced"):
        jax.jit(lambda s: active_layers(s, **kw))(jnp.float32(3))
    want = np.asarray(active_layers(7, **kw))
    for step in (np.int64(7), jnp.asarray(7), jnp.asarray(7, jnp.uint32)):  # a state's counter, concrete or traced
        np.testing.assert_array_equal(np.asarray(active_layers(step, **kw)), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda s: active_layers(s, **kw))(step)), want)


def test_bad_settings_are_refused_before_any_work(model):
    with pytest.raises(LayerwiseError, match=r"n_active=0: .* integer in 1..4 \(the model has 4 layers\)"):
        make_layerwise_fns(model, TX, 0)
    with pytest.raises(LayerwiseError, match=r"n_active=5"):
        make_layerwise_fns(model, TX, 5)
    with pytest.raises(LayerwiseError, match=r"period=0: .* integer >= 1"):
        make_layerwise_fns(model, TX, 1, period=0)
    with pytest.raises(LayerwiseError, match=r"schedule='greedy'; accepted: random, bottom-up, top-down"):
        make_layerwise_fns(model, TX, 1, schedule="greedy")
    with pytest.raises(LayerwiseError, match=r"'lm_head' is not a parameter group .* accepted: embed, head, norm"):
        make_layerwise_fns(model, TX, 1, always_train=("embed", "lm_head"))
    with pytest.raises(LayerwiseError, match="needs a jmem.models.Llama"):
        make_layerwise_fns(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), TX, 1)
    # An AttributeError, a TypeError from JAX at the first draw, "'int' object is not iterable", or a
    # string taken as true, before:
    for kwargs, message in [({"tx": None}, r"^tx=None; accepted: an optax.GradientTransformation"),
                            ({"seed": "a"}, r"^seed='a'; accepted: an integer"),
                            ({"seed": 1.5}, r"^seed=1.5; accepted: an integer"),
                            ({"dropout_seed": 2**64}, r"^dropout_seed=18446744073709551616; accepted: an integer"),
                            ({"always_train": 5}, r"^always_train=5; accepted: a group name or a tuple of them"),
                            ({"adapters_only": "yes"}, r"^adapters_only='yes'; accepted: True or False$")]:
        with pytest.raises(ValueError, match=message):
            make_layerwise_fns(model, **{"tx": TX, "n_active": 1, **kwargs})
    with pytest.raises(ValueError, match=r"^adapters_only='False'; accepted: True or False$"):
        make_train_fns(model, TX, adapters_only="False")


def test_a_malformed_batch_is_one_error_naming_it(model, data):
    """A 1-D batch was 'not enough values to unpack'; one without a mask a KeyError."""
    fns = make_layerwise_fns(model, TX, 1)
    state = fns.init_state(model)
    good = _batch(data, 0)
    with pytest.raises(ValueError, match=r"^language-model batch shapes"):
        fns.step(state, {k: v[0] for k, v in good.items()})
    with pytest.raises(ValueError, match=r"^language-model batch \['inputs', 'targets'\]; accepted"):
        fns.step(state, {k: v for k, v in good.items() if k != "mask"})


def test_all_layers_active_equals_the_plain_train_step(compiled, model, data):
    fns_full, _, step_full = compiled("full")
    fns_l, _, step_l = compiled("nL")
    a, la = _run(fns_full, step_full, model, data, 3)
    b, lb = _run(fns_l, step_l, model, data, 3)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-6)
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(a.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
    assert jax.tree.structure(b.opt_state) == jax.tree.structure(a.opt_state)


def test_frozen_layers_stay_bit_identical_and_the_state_resets_at_a_new_period(compiled, model, data):
    fns, _, step = compiled("n1")
    s0 = fns.init_state(model)
    before = jax.tree.map(np.asarray, s0.params)
    # The step's forward (stored layers + a zero delta on the active one) is the model's own.
    s, c = jax.jit(fns.eval_loss)(s0.params, _batch(data, 0))
    s2, losses = _run(fns, step, model, data, 2, s0)  # one period (period=2): the layers of step 0
    np.testing.assert_allclose(losses[0], float(s / c), rtol=1e-6)
    act = fns.active_layers(0)
    assert len(act) == 1 and np.array_equal(fns.active_layers(1), act)
    frozen = [i for i in range(L) if i not in act]
    for (path, x0), x2 in zip(jax.tree_util.tree_leaves_with_path(before["layers"]),
                              jax.tree.leaves(s2.params["layers"])):
        x2 = np.asarray(x2)
        np.testing.assert_array_equal(x2[frozen], x0[frozen], err_msg=str(path))
        assert not np.array_equal(x2[act], x0[act]), path  # the active layer did train
    for group in ("embed", "norm", "head"):  # always trained (LISA)
        assert not np.array_equal(np.asarray(s2.params[group][next(iter(s2.params[group]))]),
                                  next(iter(before[group].values())))
    # Optimizer state: one layer's slices (plus embed, norm and head).
    assert jax.tree.leaves(s2.opt_state[0].mu["layers"])[0].shape[0] == 1

    # Step 2 opens period 1: its result equals a step from a state whose layer-part moments are
    # fresh zeros (the counter and the embed/norm/head moments carry on).
    s2_copy = jax.tree.map(lambda x: jnp.array(x, copy=True), s2)
    adam = s2.opt_state[0]
    zeroed = adam._replace(mu={**adam.mu, "layers": jax.tree.map(jnp.zeros_like, adam.mu["layers"])},
                           nu={**adam.nu, "layers": jax.tree.map(jnp.zeros_like, adam.nu["layers"])})
    reset = s2._replace(opt_state=(zeroed, *s2.opt_state[1:]))
    s3, _ = step(s2_copy, _batch(data, 2))
    r3, _ = step(reset, _batch(data, 2))
    for x, y in zip(jax.tree.leaves(s3), jax.tree.leaves(r3)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Without the reset the layer moments would carry over: the reset is what made them equal.
    assert float(jnp.max(jnp.abs(jax.tree.leaves(adam.nu["layers"])[0]))) > 0


def test_loss_goes_down_on_the_default_text(compiled, model, data):
    fns, _, step = compiled("n1")
    _, losses = _run(fns, step, model, data, 30)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses


def test_memory_of_the_layer_part_scales_with_the_active_layers(compiled, model):
    """Compiler-measured: optimizer state and the step's temporaries for 1 of 4 layers vs full training."""
    layer_bytes = tree_bytes(nnx.state(model.layers, nnx.Param))
    outer_bytes = tree_bytes(nnx.state(model, nnx.Param)) - layer_bytes
    one_layer = layer_bytes // L
    (fns_full, full, _), (fns_1, n1, _) = compiled("full"), compiled("n1")
    opt = {k: tree_bytes(jax.eval_shape(lambda f=f: f.init_state(model)).opt_state)
           for k, f in (("full", fns_full), ("n1", fns_1))}
    # Adam: two moments per trained parameter (+ a 4-byte counter): layers at 1/4, embed/norm/head whole.
    assert opt["full"] == 2 * (layer_bytes + outer_bytes) + 4
    assert opt["n1"] == 2 * (one_layer + outer_bytes) + 4
    # The compiler sees the same: the arguments shrink by the frozen layers' moments.
    assert full.argument_bytes - n1.argument_bytes == opt["full"] - opt["n1"]
    # And the analytic estimate: gradients and moments of one layer plus embed/norm/head.
    est = estimate(model.config, B, T, optimizer="adamw", trained_layers=1)
    assert (est["grads"], est["optimizer"], est["frozen"]) == (one_layer + outer_bytes, opt["n1"], (L - 1) * one_layer)
    # Temporaries: one active layer of four saves at least the gradients of the three frozen ones.
    assert full.temp_bytes - n1.temp_bytes >= 0.95 * (L - 1) * one_layer
    # With LoRA the trainable tree is the adapters, each stacked over the layers: 1 of L layers of them train.
    lora = {n: estimate(model.config, B, T, optimizer="adamw", lora_rank=4, trained_layers=n) for n in (1, L)}
    assert lora[L]["grads"] == L * lora[1]["grads"] and lora[1]["frozen"] - lora[L]["frozen"] == (L - 1) * lora[1]["grads"]


@pytest.mark.slow
def test_each_further_active_layer_costs_one_layer_of_state_and_gradient(compiled, model):
    one_layer = tree_bytes(nnx.state(model.layers, nnx.Param)) // L
    (fns_1, n1, _), (fns_2, n2, _) = compiled("n1"), compiled("n2")
    opt = [tree_bytes(jax.eval_shape(lambda f=f: f.init_state(model)).opt_state) for f in (fns_1, fns_2)]
    assert opt[1] - opt[0] == 2 * one_layer
    assert 0.9 * one_layer <= n2.temp_bytes - n1.temp_bytes <= 1.25 * one_layer


def test_lora_trains_only_the_adapters_of_the_active_layers(data):
    """With adapter dropout (keyed per step in the step, never in evaluation)."""
    base = Llama(LlamaConfig.tiny(n_layers=L, remat="full"), rngs=nnx.Rngs(1))
    model = apply_lora(base, rank=4, alpha=8.0, targets=("wq", "wv", "head"), dropout=0.1)
    fns = make_layerwise_fns(model, optax.adam(2e-2), 1, period=3, schedule="top-down", adapters_only=True)
    state = fns.init_state(model)
    before = jax.tree.map(np.asarray, state.params)
    step = jax.jit(fns.step, donate_argnums=0)
    state, losses = _run(fns, step, model, data, 2, state)
    # Adapter dropout acts in the step (B is non-zero now) and not in evaluation.
    s, c = jax.jit(fns.eval_loss)(state.params, _batch(data, 2))
    state, m = step(state, _batch(data, 2))
    assert abs(float(m["loss"]) - float(s / c)) > 1e-4
    losses.append(float(m["loss"]))
    assert fns.active_layers(0).tolist() == [L - 1]
    # Optimizer state: only A and B of the active layer's wq/wv and the head adapter.
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state[0].mu)}
    assert shapes["['layers']['wq']['kernel'].lora_a"] == (1, 64, 4) and len(shapes) == 6
    after = jax.tree.map(np.asarray, state.params)
    for name in ("wq", "wv"):
        lo0, lo1 = before["layers"][name]["kernel"], after["layers"][name]["kernel"]
        np.testing.assert_array_equal(lo1.base, lo0.base)
        np.testing.assert_array_equal(lo1.lora_a[:L - 1], lo0.lora_a[:L - 1])
        np.testing.assert_array_equal(lo1.lora_b[:L - 1], lo0.lora_b[:L - 1])
        assert not np.array_equal(lo1.lora_b[L - 1], lo0.lora_b[L - 1])
    for path in (("embed", "embedding"), ("norm", "scale"), ("layers", "attn_norm", "scale")):
        x0, x1 = before, after
        for k in path:
            x0, x1 = x0[k], x1[k]
        np.testing.assert_array_equal(x1, x0)
    assert not np.array_equal(after["head"]["kernel"].lora_b, before["head"]["kernel"].lora_b)
    assert np.all(np.isfinite(losses))


@pytest.mark.slow
def test_moe_model_all_layers_active_equals_the_plain_step(data):
    model = Llama(LlamaConfig.tiny_moe(n_layers=2, remat="full"), rngs=nnx.Rngs(2))
    full, lw = make_train_fns(model, TX), make_layerwise_fns(model, TX, 2)
    a, la = _run(full, jax.jit(full.step), model, data, 2)
    b, lb = _run(lw, jax.jit(lw.step), model, data, 2)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-6)
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(a.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_qlora_nf4_base_with_one_active_layer(data):
    from jmem.quant import quantize

    base = quantize(Llama(LlamaConfig.tiny(n_layers=L, remat="full"), rngs=nnx.Rngs(3)), "nf4")
    model = apply_lora(base, rank=4, alpha=8.0, targets=("wq", "wv", "w_down"))
    fns = make_layerwise_fns(model, optax.adam(1e-2), 1, period=1, seed=3, adapters_only=True)
    state = fns.init_state(model)
    before = jax.tree.map(np.asarray, state.params)
    state, losses = _run(fns, jax.jit(fns.step, donate_argnums=0), model, data, 3, state)
    trained = sorted({int(fns.active_layers(i)[0]) for i in range(3)})
    after = jax.tree.map(np.asarray, state.params)
    lo0, lo1 = before["layers"]["w_down"]["kernel"], after["layers"]["w_down"]["kernel"]
    for x0, x1 in zip(jax.tree.leaves(lo0.base), jax.tree.leaves(lo1.base)):  # the packed NF4 base
        np.testing.assert_array_equal(x1, x0)
    untouched = [i for i in range(L) if i not in trained]
    np.testing.assert_array_equal(lo1.lora_b[untouched], lo0.lora_b[untouched])
    assert all(not np.array_equal(lo1.lora_b[i], lo0.lora_b[i]) for i in trained)
    assert np.all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adafactor", "adam8bit"])
def test_other_optimizers_with_bf16_master_weights_reset_each_period(name, data):
    from jmem.memory.precision import with_master_weights
    from jmem.optim.factory import make_optimizer

    model = Llama(LlamaConfig.tiny(n_layers=L, param_dtype="bfloat16", remat="full"), rngs=nnx.Rngs(4))
    tx = with_master_weights(optax.chain(optax.clip_by_global_norm(1.0), make_optimizer(name, 1e-2)))
    fns = make_layerwise_fns(model, tx, 2, period=1, schedule="bottom-up")
    state = fns.init_state(model)
    before = jax.tree.map(np.asarray, state.params)
    state, losses = _run(fns, jax.jit(fns.step, donate_argnums=0), model, data, 2, state)
    # Period 1 trains layers 2, 3: the master copy of its state was taken from their stored values.
    assert [fns.active_layers(i).tolist() for i in range(2)] == [[0, 1], [2, 3]]
    master = state.opt_state.master["layers"]["wq"]["kernel"]
    assert master.dtype == jnp.float32 and master.shape[0] == 2
    np.testing.assert_array_equal(np.asarray(master.astype(jnp.bfloat16)), np.asarray(state.params["layers"]["wq"]["kernel"][2:]))
    for i in range(L):  # each layer trained in exactly one of the two periods
        assert not np.array_equal(np.asarray(state.params["layers"]["wq"]["kernel"][i]), before["layers"]["wq"]["kernel"][i])
    assert np.all(np.isfinite(losses))


def _script():
    return experiment("layerwise")


@pytest.mark.parametrize("argv, expected", [
    (["--n-active", "0"], "--n-active '0'; accepted: comma-separated distinct integers in 1..4"),
    (["--n-active", "2,x"], "--n-active '2,x'; accepted"),
    (["--n-active", "1,1"], "--n-active '1,1'; accepted: comma-separated distinct integers"),
    (["--schedule", "greedy"], "--schedule 'greedy'; accepted: random, bottom-up, top-down"),
    (["--model", "gpt2"], "--model 'gpt2'; accepted: tiny, small"),
    (["--optimizer", "lion"], "--optimizer 'lion'; accepted: adamw"),
    (["--period", "0"], "--period 0; accepted: a positive integer"),
    (["--lr", "nan"], "--lr nan; accepted: a finite number > 0"),
    (["--data", "/nonexistent/file.txt"], "--data '/nonexistent/file.txt'"),
])
def test_script_refuses_bad_flags_with_one_line(argv, expected, capsys):
    assert _script().cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err


def test_script_refuses_a_text_with_fewer_held_out_windows_than_batch(capsys, tmp_path):
    """2,000 bytes in 16-token windows leave 6 held-out windows: fewer than one --batch of 8, refused with the
    flags (was a ZeroDivisionError after the memory table and every training run)."""
    text = tmp_path / "short.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog\n" * 50)[:2000])
    argv = ["--model", "tiny", "--train-model", "tiny", "--n-active", "1", "--train-steps", "1", "--batch", "8",
            "--seq", "16", "--train-seq", "16", "--data", str(text)]
    assert _script().cli(argv) == 2
    cap = capsys.readouterr()
    assert cap.err == (f"error: the text (--data {text}) has 6 held-out windows of --train-seq 16 tokens, fewer than "
                       "--batch 8; accepted: a longer text, a smaller --batch or --train-seq, or --train-steps 0\n")
    assert cap.out == "" and list(tmp_path.iterdir()) == [text]  # no memory table compiled, nothing written


@pytest.mark.slow
def test_script_runs_end_to_end(capsys):
    assert _script().cli(["--model", "tiny", "--n-active", "1", "--train-model", "tiny", "--train-steps", "3",
                          "--seq", "16", "--train-seq", "16", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1/2 layers | " in out and "| 1/2 layers, embed/norm/head frozen | " in out and "held-out loss" in out


def test_on_a_zero3_tensor_mesh_matches_one_device():
    """Layer-wise steps on data=2,fsdp=2,tensor=2 with ZeRO-3: the losses of one device, across a
    period change (a new draw of the active layer and a reset of its optimizer state)."""
    cfg = TrainConfig(model="tiny", steps=4, batch=8, seq=32, lr=1e-2, warmup=0, precision="f32", progress=False,
                      eval_batches=1, layerwise=1, layerwise_period=2)
    ref = train(cfg, out=io.StringIO()).losses
    got = train(dataclasses.replace(cfg, mesh="data=2,fsdp=2,tensor=2", zero=3), out=io.StringIO()).losses
    np.testing.assert_allclose([got[k] for k in range(4)], [ref[k] for k in range(4)], rtol=1e-5)


def test_the_run_header_counts_the_active_layers_gradients_only():
    """One active layer of tiny's two on a replicated data mesh: the header's trained parameters and
    per-device gradient MiB are embed, norm, head and one layer (were every parameter)."""
    cfg = TrainConfig(model="tiny", steps=1, batch=8, seq=32, precision="f32", progress=False, eval_every=0,
                      layerwise=1, mesh="data=-1")
    out = io.StringIO()
    train(cfg, out=out)
    mc = LlamaConfig.tiny()
    layer = jax.tree.leaves(nnx.state(Llama(mc, rngs=nnx.Rngs(0)).layers, nnx.Param))
    per_layer = sum(x.size for x in layer) // mc.n_layers
    trained = mc.num_params - (mc.n_layers - 1) * per_layer
    text = out.getvalue()
    assert f"{count_text(mc.num_params)} params ({count_text(trained)} trained)" in text, text
    assert f"param {mc.num_params * 4 / 2**20:.2f}, grad {trained * 4 / 2**20:.2f}," in text, text

"""LoRA adapters: the leaf, QLoRA on an NF4 base, trainable filter, merge, save/load."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmem.lora import (LoRA, apply_lora, combine, load_adapters, merge, remove_adapters, save_adapters,
                       set_dropout_key, split_trainable)
from jmem.memory.measure import measure_and_compile, tree_bytes
from jmem.models.dot import dot
from jmem.models.llama import Llama, LlamaConfig
from jmem.quant import NF4Tensor, quantize

CFG = LlamaConfig.tiny()


@nnx.jit
def _forward(m, ids):
    return m(ids)[0]


_dot = jax.jit(dot)


@pytest.mark.parametrize("rslora", [False, True])
def test_leaf_dot_on_quantized_base(rslora):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    base = NF4Tensor.quantize(jax.random.normal(k1, (2, 128, 32)) * 0.05)
    lora = LoRA.init(base, rank=4, alpha=8.0, key=k2, rslora=rslora)
    x = jax.random.normal(k3, (3, 128))
    np.testing.assert_array_equal(_dot(x, lora[0]), _dot(x, base[0]))  # B = 0: no change
    lora.lora_b = jax.random.normal(k3, lora.lora_b.shape)
    assert lora.scale == (8.0 / 2.0 if rslora else 8.0 / 4)
    w1 = jax.jit(lambda q: q.dequantize())(base[1])
    expect = x @ (w1 + lora.scale * lora.lora_a[1] @ lora.lora_b[1])
    np.testing.assert_allclose(_dot(x, lora[1]), expect, rtol=1e-4, atol=1e-4)
    merged = jax.jit(lambda q: q.dequantize())(lora)
    np.testing.assert_allclose(merged[1], w1 + lora.delta()[1], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def trained():
    """QLoRA: NF4 base, adapters on wq/wv, a few Adam steps on a fixed batch (one compile)."""
    model = apply_lora(quantize(Llama(CFG, rngs=nnx.Rngs(0)), "nf4"), rank=4, alpha=8, targets=("wq", "wv"))
    graphdef, state = nnx.split(model)
    train, frozen = split_trainable(state)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 33)), jnp.int32)

    def loss(train, frozen):
        logits, _ = nnx.merge(graphdef, combine(train, frozen))(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    opt = optax.adam(1e-2)
    opt_state = opt.init(train)

    @jax.jit
    def step(train, opt_state, frozen):
        value, grads = jax.value_and_grad(loss)(train, frozen)
        updates, opt_state = opt.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, value

    report, compiled = measure_and_compile(step, train, opt_state, frozen)
    losses = []
    for _ in range(4):
        train, opt_state, value = compiled(train, opt_state, frozen)
        losses.append(float(value))
    return dict(model=nnx.merge(graphdef, combine(train, frozen)), state=state, train=train, frozen=frozen,
                opt_state=opt_state, losses=losses, report=report, ids=ids)


def test_only_adapters_train(trained):
    train_leaves = jax.tree_util.tree_leaves(trained["train"])
    assert len(train_leaves) == 4  # A and B for two stacked targets
    adapter_bytes = tree_bytes(trained["train"])
    full_float_bytes = 4 * CFG.num_params
    assert adapter_bytes <= 0.03 * full_float_bytes
    # Adam keeps two moments per adapter parameter (plus a step count), nothing for the base.
    opt_bytes = tree_bytes(trained["opt_state"])
    assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 16
    # Compiler-measured: the whole step writes only new adapters, their optimizer state and the loss
    # (plus XLA's small table of output buffers), far less than the frozen base.
    n_out = len(jax.tree_util.tree_leaves((trained["train"], trained["opt_state"]))) + 1
    out_bytes = trained["report"].output_bytes
    assert adapter_bytes + opt_bytes + 4 <= out_bytes <= adapter_bytes + opt_bytes + 4 + 8 * n_out
    assert out_bytes < tree_bytes(trained["frozen"]) / 4
    assert trained["losses"][-1] < trained["losses"][0]
    # The trained model's NF4 base is the one quantized (split_trainable/combine give it back whole).
    fresh = apply_lora(quantize(Llama(CFG, rngs=nnx.Rngs(0)), "nf4"), rank=4, alpha=8, targets=("wq", "wv"))
    def leaves(m):
        return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(m))}

    want = leaves(fresh)
    base = {path: x for path, x in leaves(trained["model"]).items() if "lora_a" not in path and "lora_b" not in path}
    assert any(x.dtype == np.uint8 for x in base.values())  # the packed NF4 codes are among them
    assert all(np.array_equal(x, want[path]) for path, x in base.items())


def test_adapter_paths_expand_the_home_directory(trained, tmp_path, monkeypatch):
    """`train.py --save '~/a.npz'` trained the whole run, then lost the adapters: the checks expanded `~`,
    `save_adapters` did not."""
    monkeypatch.setenv("HOME", str(tmp_path))
    save_adapters(trained["model"], "~/a.npz")
    assert (tmp_path / "a.npz").is_file()
    load_adapters(trained["model"], "~/a.npz")


def test_merge_and_save_load(trained, tmp_path):
    model, ids = trained["model"], trained["ids"]
    out = np.asarray(_forward(model, ids))
    merged = merge(model)
    assert isinstance(merged.layers.wq.kernel.get_value(), jax.Array)
    np.testing.assert_allclose(_forward(merged, ids), out, rtol=1e-4, atol=1e-4)
    for bad, message in ((tmp_path / "adapters", "; accepted: a file name ending in .npz"),
                         (tmp_path / "missing" / "a.npz", ": its folder does not exist"),
                         (tmp_path, "; accepted: a file name ending in .npz")):
        with pytest.raises(ValueError, match=re.escape(f"LoRA adapter path {str(bad)!r}{message}")):
            save_adapters(model, bad)
    assert list(tmp_path.iterdir()) == []  # numpy wrote PATH.npz for a path without the suffix
    path = tmp_path / "adapters.npz"
    save_adapters(model, path)
    fresh = quantize(Llama(CFG, rngs=nnx.Rngs(0)), "nf4")
    np.testing.assert_array_equal(_forward(load_adapters(fresh, path), ids), out)
    with pytest.raises(ValueError, match="do not fit"):
        load_adapters(Llama(CFG.replace(dim=32, head_dim=8), rngs=nnx.Rngs(0)), path)
    # Taking the adapters off gives the base model back (its NF4 leaves untouched), and the model
    # keeps them unless inplace.
    base = remove_adapters(model)
    assert isinstance(base.layers.wq.kernel.get_value(), NF4Tensor)
    assert isinstance(model.layers.wq.kernel.get_value(), LoRA)
    np.testing.assert_array_equal(_forward(base, ids), _forward(fresh, ids))
    with pytest.raises(ValueError, match="no LoRA adapters to remove"):
        remove_adapters(base)


def test_load_gives_exactly_the_files_adapters(tmp_path):
    """A loaded file replaces the adapter set (others taken off), keeps A's and B's own dtypes, and
    a target that does not fit refuses before anything changes, even in place."""
    ids = jnp.arange(1, 9, dtype=jnp.int32)[None]
    src = apply_lora(Llama(CFG, rngs=nnx.Rngs(0)), rank=2, alpha=4, targets=("wq",), seed=1)
    lo = src.layers.wq.kernel.get_value()
    src.layers.wq.kernel.set_value(LoRA(lo.base, lo.lora_a.astype(jnp.bfloat16),
                                        jax.random.normal(jax.random.key(2), lo.lora_b.shape), lo.alpha))
    path = tmp_path / "wq.npz"
    save_adapters(src, path)

    other = apply_lora(Llama(CFG, rngs=nnx.Rngs(0)), rank=3, alpha=6, targets=("wq", "wv"), seed=5)
    other.layers.wv.kernel.set_value(LoRA(*(lambda v: (v.base, v.lora_a, jnp.ones_like(v.lora_b), v.alpha))(
        other.layers.wv.kernel.get_value())))
    loaded = load_adapters(other, path)
    assert not isinstance(loaded.layers.wv.kernel.get_value(), LoRA)  # the other adapter's target is bare
    got = loaded.layers.wq.kernel.get_value()
    assert (got.lora_a.dtype, got.lora_b.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(got.lora_b, src.layers.wq.kernel.get_value().lora_b)
    np.testing.assert_array_equal(_forward(loaded, ids), _forward(src, ids))
    assert isinstance(other.layers.wv.kernel.get_value(), LoRA)  # not in place: the argument is unchanged

    small = apply_lora(Llama(CFG.replace(dim=32, head_dim=8), rngs=nnx.Rngs(0)), rank=2, alpha=4, targets=("wv",))
    with pytest.raises(ValueError, match="do not fit"):
        load_adapters(small, path, inplace=True)
    assert isinstance(small.layers.wv.kernel.get_value(), LoRA)  # refused before taking wv's adapter off
    with pytest.raises(ValueError, match="no LoRA adapters to merge"):
        merge(Llama(CFG, rngs=nnx.Rngs(0)))


def test_adapters_load_only_onto_their_base_or_a_copy_of_it(tmp_path):
    """An adapter file records sampled values of each base weight: its base in another dtype or
    quantized (QLoRA trained, float served) takes it; a model of the same shapes but other weights
    (another preset --seed) is refused by name; a damaged sample in the file is refused when read."""
    import json

    base = Llama(CFG, rngs=nnx.Rngs(0))
    path = tmp_path / "a.npz"
    save_adapters(apply_lora(quantize(base, "nf4"), rank=2, targets=("wq", "w_down"), seed=1), path)
    load_adapters(base, path)
    load_adapters(quantize(base, "int8"), path)
    load_adapters(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base), path)
    with pytest.raises(ValueError, match=re.escape(f"adapter {str(path)!r} was trained on another base model: its wq "
                                                   "weights do not match this model's (correlation ") +
                       r"-?0\.\d\d at 256 sampled values, 0.5 needed\); accepted: the model it was trained on"):
        load_adapters(Llama(CFG, rngs=nnx.Rngs(1)), path)
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(bytes(arrays.pop("__meta__")).decode())
    meta["wq"]["base_sample"] = meta["wq"]["base_sample"][:3]
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    with pytest.raises(ValueError, match=r"base_sample of 'wq' is .*; accepted: 256 finite numbers"):
        load_adapters(base, path)


def test_dropout_and_bad_inputs():
    model = apply_lora(Llama(CFG, rngs=nnx.Rngs(0)), rank=2, alpha=4, targets=("wq",), dropout=0.5)
    lora = model.layers.wq.kernel.get_value()
    lora = LoRA(lora.base, lora.lora_a, jnp.ones_like(lora.lora_b), lora.alpha, lora.dropout, lora.rslora)
    model.layers.wq.kernel.set_value(lora)
    x = jax.random.normal(jax.random.key(1), (8, CFG.dim))
    eval_y = dot(x, lora[0])
    set_dropout_key(model, jax.random.key(3))
    train_lora = model.layers.wq.kernel.get_value()
    assert train_lora.dropout_key.shape == (CFG.n_layers, 2)
    assert not np.allclose(dot(x, train_lora[0]), eval_y)
    set_dropout_key(model, None)
    np.testing.assert_array_equal(dot(x, model.layers.wq.kernel.get_value()[0]), eval_y)
    with pytest.raises(ValueError, match="unknown target 'wz'; accepted: names among wq, wk"):
        apply_lora(model, targets=("wz",))
    from jmem.models.config import PRESETS

    moe = Llama(PRESETS["tiny-moe"](), rngs=nnx.Rngs(0))  # not an AttributeError from inside the model
    with pytest.raises(ValueError, match="LoRA target 'w_up' is not a weight of this model .*mixture of experts"
                                         r"\); accepted: wq, wk, wv, wo, moe.expert_gate, moe.expert_up, "
                                         "moe.expert_down"):
        apply_lora(moe, targets=("wq", "w_up"))
    with pytest.raises(ValueError, match="LoRA target 'moe.expert_up' is not a weight of this model .*dense"):
        apply_lora(model, targets=("moe.expert_up",))
    with pytest.raises(ValueError, match="rank=0"):
        apply_lora(Llama(CFG, rngs=nnx.Rngs(0)), rank=0)
    base = Llama(CFG, rngs=nnx.Rngs(0))
    side = min(base.layers.wv.kernel.get_value().shape[-2:])
    with pytest.raises(ValueError, match=f"rank={side + 1} exceeds .* smaller side {side}; accepted: 1..{side}"):
        apply_lora(base, rank=side + 1, targets=("wv",))
    # The bound of every target at once: one target at a time named only the first one's, then the next.
    sides = {t: min(getattr(base.layers, t).kernel.get_value().shape[-2:]) for t in ("wq", "wv")}
    with pytest.raises(ValueError, match=f"accepted: 1..{min(sides.values())} for targets wq, wv$"):
        apply_lora(base, rank=max(sides.values()), targets=("wq", "wv"))
    for alpha in (-1.0, 0.0, float("nan"), float("inf"), "16", None, True):
        with pytest.raises(ValueError, match=f"^LoRA alpha={alpha!r}; accepted: a finite number > 0$"):
            apply_lora(base, alpha=alpha)
    for dropout in ("0.1", -0.1, 1.0, True, None):
        with pytest.raises(ValueError, match=rf"^LoRA dropout={dropout!r}; accepted: a number in \[0, 1\)$"):
            apply_lora(base, dropout=dropout)
    for seed in (1.5, "0", True, None):
        with pytest.raises(ValueError, match=rf"^LoRA seed={seed!r}; accepted: an integer in \[-2\*\*63, 2\*\*64\)$"):
            apply_lora(base, seed=seed)
    with pytest.raises(ValueError, match="^targets is empty; accepted: names among wq, wk, wv, wo, w_gate, w_up, "
                                         "w_down, moe.expert_gate, moe.expert_up, moe.expert_down, head$"):
        apply_lora(base, targets=())
    with pytest.raises(ValueError, match=r"^target 'wq' is listed twice in targets=\('wq', 'wv', 'wq'\); "
                                         "accepted: distinct names among wq"):
        apply_lora(base, targets=("wq", "wv", "wq"))
    adapted = apply_lora(base, alpha=np.float32(8), seed=np.int64(3), targets=["wq"])
    assert adapted.layers.wq.kernel.get_value().alpha == 8
    with pytest.raises(ValueError, match="rank=True must be a positive integer"):
        apply_lora(base, rank=True)
    with pytest.raises(ValueError, match="LoRA dtype=int8; accepted: a floating dtype"):
        apply_lora(base, dtype=jnp.int8)
    with pytest.raises(ValueError, match="LoRA dtype=int8; accepted: a floating dtype"):
        apply_lora(base, dtype="int8")
    assert apply_lora(base, dtype="bf16").layers.wq.kernel.get_value().lora_a.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dropout key=0; accepted: a typed PRNG key"):
        set_dropout_key(model, 0)
    from jmem.train import make_train_fns

    with pytest.raises(ValueError, match="^LoRA dropout with a loss_fn is not supported"):  # it would never drop
        make_train_fns(model, optax.adam(1e-3), loss_fn=lambda params, batch: (0.0, 1), adapters_only=True)


def test_settings_are_checked_wherever_adapters_come_from(tmp_path):
    """A file's settings as apply_lora's (dropout 2 zeroed the adapter's input, an int8 dtype its A);
    flags that must be bools; nothing changed by a refused call; nothing-to-train refused."""
    import json

    base = Llama(CFG, rngs=nnx.Rngs(0))
    for kw, message in [(dict(rslora="no"), "LoRA rslora='no'; accepted: True or False"),
                        (dict(inplace="no"), "inplace='no'; accepted: True or False"),
                        (dict(targets=None), "targets=None; accepted: a name or a list of names among wq"),
                        (dict(targets=3), "targets=3; accepted")]:
        with pytest.raises(ValueError, match=message):
            apply_lora(base, **kw)
    assert not isinstance(base.layers.wq.kernel.get_value(), LoRA)
    assert apply_lora(base, alpha=jnp.float32(16.0), dropout=jnp.float32(0.1)).layers.wq.kernel.get_value().alpha == 16
    adapted = apply_lora(base, targets=("wq",))
    with pytest.raises(ValueError, match="target 'wq' already has a LoRA adapter"):
        apply_lora(adapted, targets=("wv", "wq"), inplace=True)
    assert not isinstance(adapted.layers.wv.kernel.get_value(), LoRA)  # refused before any change
    path = tmp_path / "a.npz"
    save_adapters(adapted, path)
    with np.load(path) as f:
        arrays = dict(f)
    meta = json.loads(bytes(arrays.pop("__meta__")).decode())
    for field, value, message in [("dropout", 2.0, r"LoRA dropout=2.0; accepted: a number in \[0, 1\)"),
                                  ("dtype", "int8", "LoRA dtype=int8; accepted: a floating dtype"),
                                  ("dtype_b", "int8", "LoRA dtype_b=int8; accepted: a floating dtype"),
                                  ("alpha", -8, "LoRA alpha=-8; accepted: a finite number > 0")]:
        bad = tmp_path / f"{field}.npz"
        edited = {"wq": {**meta["wq"], field: value}}
        np.savez(bad, __meta__=np.frombuffer(json.dumps(edited).encode(), np.uint8), **arrays)
        with pytest.raises(ValueError, match=f"adapter '{bad}': metadata of 'wq': {message}"):
            load_adapters(base, bad)
    # B's leading (layers) axes were not checked: the forward failed in the layer scan.
    bad = tmp_path / "b_lead.npz"
    np.savez(bad, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **{**arrays, "wq.lora_b": arrays["wq.lora_b"][0]})
    lead_in, out = list(arrays["wq.lora_a"].shape[:-1]), arrays["wq.lora_b"].shape[-1]
    with pytest.raises(ValueError, match=re.escape(
            f"adapter wq has A {arrays['wq.lora_a'].shape}, B {arrays['wq.lora_b'][0].shape}, which do not fit the "
            f"weight {base.layers.wq.kernel.get_value().shape}; accepted: A {[*lead_in, 'rank']} and B "
            f"{[*lead_in[:-1], 'rank', out]}")):
        load_adapters(base, bad)
    from jmem.train import make_train_fns

    loss_fn = lambda params, batch: (0.0, 1)  # noqa: E731 - never reached
    with pytest.raises(ValueError, match="adapters_only=True but the model has no LoRA adapters"):
        make_train_fns(base, optax.adam(1e-3), loss_fn=loss_fn, adapters_only=True).init_state(base)
    qlora = apply_lora(quantize(base, "nf4"), targets=("wq",))
    with pytest.raises(ValueError, match=r"weight .* is uint8 \(a quantized base\) and cannot be trained; accepted: "
                                         "adapters_only=True"):
        make_train_fns(qlora, optax.adam(1e-3), loss_fn=loss_fn).init_state(qlora)
    fp8 = quantize(base, "fp8")  # float8 codes: Adam's float8 moments made every weight NaN in one step
    with pytest.raises(ValueError, match=r"weight .* is float8_e4m3fn \(a quantized base\) and cannot be trained"):
        make_train_fns(fp8, optax.adam(1e-3), loss_fn=loss_fn).init_state(fp8)


def test_a_jax_integer_rank_and_a_files_short_dtype_names(tmp_path):
    """A 0-d JAX integer rank is a rank (it was "must be a positive integer", while JAX alpha and
    dropout passed); a file whose dtype reads "f16", "bf16" or "f32", which `read_adapters` accepts,
    loads in that dtype (jnp.dtype("f16") is float128, "bf16" not understood)."""
    import json

    base = Llama(CFG, rngs=nnx.Rngs(0))
    adapted = apply_lora(base, rank=jnp.int32(4), targets=("wq",))
    assert adapted.layers.wq.kernel.get_value().lora_a.shape[-1] == 4
    assert LoRA.init(jnp.zeros((8, 6)), np.int64(2), 4.0, jax.random.key(0)).lora_a.shape == (8, 2)
    path = tmp_path / "a.npz"
    save_adapters(adapted, path)
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(bytes(arrays.pop("__meta__")).decode())
    for short, dtype in (("f16", jnp.float16), ("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        meta["wq"]["dtype"] = meta["wq"]["dtype_b"] = short
        np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        lora = load_adapters(base, path).layers.wq.kernel.get_value()
        assert lora.lora_a.dtype == dtype and lora.lora_b.dtype == dtype, short


def test_dropout_only_in_train_steps_never_at_inference():
    """`with_dropout(tree, key)` (pure, jit-able) drops with a per-step key; a model left with keys
    by `set_dropout_key` still does not drop in LM.logits / generate, and merges as without keys
    (test_merge_and_save_load checks merged == unmerged logits)."""
    from jmem.generate import generate_ids
    from jmem.io.tokenizer import ByteTokenizer
    from jmem.lm import LM
    from jmem.lora import with_dropout, without_dropout

    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=1)
    model = apply_lora(random_model(cfg, 0), rank=2, alpha=4, targets=("wq", "wv"), dropout=0.5, inplace=True)
    for name in ("wq", "wv"):  # a trained adapter: B != 0
        var = getattr(model.layers, name).kernel
        lo = var.get_value()
        var.set_value(LoRA(lo.base, lo.lora_a, jnp.ones_like(lo.lora_b), lo.alpha, lo.dropout, lo.rslora))
    x = jax.random.normal(jax.random.key(1), (8, cfg.dim))
    leaf = {"w": model.layers.wq.kernel.get_value()[0]}
    eval_y = dot(x, leaf["w"])
    drop = jax.jit(lambda t, k: dot(x, with_dropout(t, k)["w"]))
    y1, y2 = drop(leaf, jax.random.key(1)), drop(leaf, jax.random.key(2))
    assert not np.allclose(y1, eval_y) and not np.allclose(y1, y2)  # dropped, and a fresh mask per key
    np.testing.assert_array_equal(dot(x, without_dropout(with_dropout(leaf, jax.random.key(1)))["w"]), eval_y)

    lm = LM(model, ByteTokenizer())
    ids = np.arange(1, 12, dtype=np.int32)[None]
    want, want_ids = lm.logits(ids), generate_ids(model, [list(ids[0])], 6)
    merged = merge(model)
    set_dropout_key(model, jax.random.key(3))
    lora_keyed = model.layers.wq.kernel.get_value()
    assert lora_keyed.dropout_key is not None and not np.allclose(dot(x, lora_keyed[0]), eval_y)  # would drop
    np.testing.assert_array_equal(lm.logits(ids), want)
    assert generate_ids(model, [list(ids[0])], 6) == want_ids
    np.testing.assert_array_equal(merge(model).layers.wq.kernel.get_value(), merged.layers.wq.kernel.get_value())


def test_an_adapter_needs_a_weight_matrix():
    with pytest.raises(ValueError, match=r"LoRA base of shape \(8,\); accepted: a weight \[..., in, out\]"):
        LoRA.init(jnp.ones(8), 2, 4.0, jax.random.key(0))


def test_a_qlora_step_keeps_no_decoded_weights():
    """Without remat, the layer scan kept every layer's decoded NF4 weights for the backward pass (a QLoRA step
    held more temporaries than LoRA on the float base); the backward decodes them again instead."""
    from jmem.memory import measure
    from jmem.quant import quantize

    cfg = LlamaConfig.tiny(n_layers=4, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=512, remat="none")
    temps = {}
    for base in ("f32", "nf4"):
        def make():
            model = Llama(cfg, rngs=nnx.Rngs(0))
            return apply_lora(quantize(model, base) if base != "f32" else model, rank=4, alpha=8.0,
                              targets=("wq", "wv", "w_up"))

        graph, state = nnx.split(nnx.eval_shape(make))
        train, frozen = split_trainable(state)
        ids = jax.ShapeDtypeStruct((2, 64), jnp.int32)
        def grad(train, frozen, ids):
            return jax.grad(lambda t: jnp.mean(nnx.merge(graph, combine(t, frozen))(ids)[0]))(train)

        temps[base] = measure(grad, train, frozen, ids).temp_bytes
    decoded = cfg.n_layers * 4 * (2 * cfg.dim * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim // 2 + cfg.dim * 512)
    assert temps["nf4"] <= temps["f32"] + decoded // 8, (temps, decoded)

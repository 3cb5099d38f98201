"""`jmem.prune`: masks as defined, Wanda's activation norms, the packed N:M leaf, and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.lora import LoRA
from jmem.models.dot import dot
from jmem.models.llama import Llama, LlamaConfig, forward
from jmem.prune import BitmaskSparse, NMSparse, nm_mask, prune, sparsity_report, unstructured_mask
from jmem.quant import quantize, weight_bytes
from jmem.calibrate import LINEARS, run_layer
from tests.helpers import experiment, smollm2

CFG = LlamaConfig.tiny()
OUTLIERS = (3, 17, 40)  # residual channels made large (activations x OUTLIER_GAIN, matching weight rows / it)
FFN_OUTLIERS = (5, 77)
OUTLIER_GAIN = 16.0
WEIGHT_SHRINK = 4.0


@nnx.jit
def _forward(m, ids):
    return m(ids)[0]


@jax.jit
def _dequantize_all(leaves: dict):
    return {n: w.dequantize() for n, w in leaves.items()}


def _logits(m, ids):
    return np.asarray(_forward(m, ids))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    calib = rng.integers(0, CFG.vocab_size, (4, 32)).astype(np.int32)
    evals = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 32)), jnp.int32)
    return calib, evals


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def outlier_model():
    """A tiny model whose norm outputs (and MLP hidden) have a few large channels fed by small weight rows.

    As in LLMs with outlier features: the channels' activations are OUTLIER_GAIN times larger and the
    weight rows reading them WEIGHT_SHRINK times smaller, so they matter more (product x GAIN/SHRINK)
    while |W| alone ranks them lowest.
    """
    model = Llama(CFG, rngs=nnx.Rngs(1))
    w = dict(model.layers.weights())
    big = np.ones(CFG.dim, np.float32)
    big[list(OUTLIERS)] = OUTLIER_GAIN
    big_ffn = np.ones(CFG.ffn_dim, np.float32)
    big_ffn[list(FFN_OUTLIERS)] = OUTLIER_GAIN
    for norm in ("attn_norm", "mlp_norm"):
        w[norm] = w[norm] * big
    for n in ("wq", "wk", "wv", "w_gate", "w_up"):
        w[n] = w[n] * np.where(big > 1, 1 / WEIGHT_SHRINK, 1.0).astype(np.float32)[:, None]
    w["w_up"] = w["w_up"] * big_ffn  # up's output columns feed down's input rows
    w["w_down"] = w["w_down"] * np.where(big_ffn > 1, 1 / WEIGHT_SHRINK, 1.0).astype(np.float32)[:, None]
    for n, v in w.items():
        mod = getattr(model.layers, n)
        (mod.scale if n.endswith("norm") else mod.kernel).set_value(jnp.asarray(v))
    return model


def _np_mask_unstructured(s, sparsity):
    k = int(sparsity * s.shape[-2])
    order = np.argsort(s, axis=-2, kind="stable")
    keep = np.ones(s.shape, bool)
    np.put_along_axis(keep, order[..., :k, :], False, axis=-2)
    return keep


def test_unstructured_mask_removes_the_smallest_of_each_column():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 24, 8)).astype(np.float32)
    for sparsity in (0.5, 0.3):
        mask = np.asarray(unstructured_mask(jnp.abs(jnp.asarray(w)), sparsity))
        k = int(sparsity * 24)
        assert np.all((~mask).sum(axis=-2) == k)
        # Every removed |w| is below every kept |w| of the same column.
        a = np.abs(w)
        removed_max = np.where(mask, -np.inf, a).max(axis=-2)
        kept_min = np.where(mask, a, np.inf).min(axis=-2)
        assert np.all(removed_max < kept_min)
        np.testing.assert_array_equal(mask, _np_mask_unstructured(a, sparsity))


@pytest.mark.parametrize("sparsity, n_in, removed", [(0.29, 100, 29), (0.7, 700, 490), (0.57, 1400, 798),
                                                     (0.5, 24, 12), (0.3, 24, 7)])
def test_unstructured_mask_removes_floor_of_sparsity_times_inputs(sparsity, n_in, removed):
    """floor(0.29 * 100) is 29, though 0.29 * 100 is 28.999999999999996 in floats (the mask kept one more)."""
    s = jnp.asarray(np.abs(np.random.default_rng(0).standard_normal((n_in, 3))), jnp.float32)
    assert np.all((~np.asarray(unstructured_mask(s, sparsity))).sum(axis=0) == removed)


def test_a_sparsity_that_rounds_to_every_input_is_refused():
    """1 - 1e-12 is below 1, yet floor(round(s * in, 9)) is every input: all-zero columns."""
    s = jnp.ones((64, 3))
    with pytest.raises(ValueError, match=r"^sparsity=0.999999999999 prunes all 64 inputs of a column; accepted"):
        unstructured_mask(s, 1 - 1e-12)


def test_nm_mask_refuses_a_group_size_not_dividing_the_inputs():
    with pytest.raises(ValueError, match=r"nm_mask: 2:4 on an input dimension of 6; accepted: 0 < N <= M and M "
                                         r"dividing the input dimension"):
        nm_mask(jnp.ones((6, 2)), 2, 4)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 8)])
def test_nm_mask_keeps_top_n_of_every_group(n, m):
    rng = np.random.default_rng(2)
    s = np.abs(rng.standard_normal((2, 32, 6))).astype(np.float32)
    mask = np.asarray(nm_mask(jnp.asarray(s), n, m))
    g = s.reshape(2, 32 // m, m, 6)
    mg = mask.reshape(g.shape)
    assert np.all(mg.sum(axis=-2) == n)
    top = np.sort(g, axis=-2)[..., m - n:, :]  # the N highest of each group
    np.testing.assert_array_equal(np.sort(np.where(mg, g, -np.inf), axis=-2)[..., m - n:, :], top)


@pytest.mark.parametrize("shape,n,m,bits", [((2, 32, 8), 2, 4, 2), ((64, 8), 1, 8, 3), ((12, 5), 2, 4, 8)])
def test_nmsparse_dot_equals_masked_matmul(shape, n, m, bits):
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    mask = nm_mask(jnp.abs(w), n, m)
    s = NMSparse.from_mask(w, mask, n, m)
    assert s.shape == w.shape and s.bits == bits
    dense = jnp.where(mask, w, 0.0)
    np.testing.assert_array_equal(np.asarray(s.dequantize()), np.asarray(dense))
    np.testing.assert_array_equal(np.asarray(s.mask()), np.asarray(mask))
    kept = shape[-2] // m * n
    lead = int(np.prod(shape[:-2]))
    assert s.nbytes == lead * kept * shape[-1] * 4 + int(np.prod(s.positions.shape))
    assert s.positions.shape[-2] == (kept * bits // 8 if bits < 8 else kept)
    x = jnp.asarray(rng.standard_normal((3, shape[-2])).astype(np.float32))
    if len(shape) == 3:  # the stacked-layers axis slices like an array
        s, dense = s[1], dense[1]
    ref = np.asarray(x @ dense)
    np.testing.assert_allclose(np.asarray(jax.jit(dot)(x, s)), ref, rtol=1e-5, atol=1e-5)
    # A LoRA adapter wraps the packed leaf like any other base.
    lora = LoRA.init(s, rank=2, alpha=4.0, key=jax.random.key(0))
    lora.lora_b = jnp.asarray(rng.standard_normal(lora.lora_b.shape).astype(np.float32))
    np.testing.assert_allclose(np.asarray(dot(x, lora)), ref + np.asarray(x @ lora.delta()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,sparsity", [((2, 32, 8), 0.5), ((24, 5), 0.3)])
def test_bitmask_sparse_dot_equals_masked_matmul(shape, sparsity):
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    mask = unstructured_mask(jnp.abs(w), sparsity)
    s = BitmaskSparse.from_mask(w, mask)
    assert s.shape == w.shape
    dense = jnp.where(mask, w, 0.0)
    np.testing.assert_array_equal(np.asarray(s.dequantize()), np.asarray(dense))
    np.testing.assert_array_equal(np.asarray(s.mask()), np.asarray(mask))
    kept = shape[-2] - int(sparsity * shape[-2])
    lead = int(np.prod(shape[:-2]))
    assert s.nbytes == lead * (kept * shape[-1] * 4 + shape[-2] // 8 * shape[-1])
    x = jnp.asarray(rng.standard_normal((3, shape[-2])).astype(np.float32))
    if len(shape) == 3:
        s, dense = s[0], dense[0]
    np.testing.assert_allclose(np.asarray(jax.jit(dot)(x, s)), np.asarray(x @ dense), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"the same count in every column"):
        BitmaskSparse.from_mask(w, mask.at[..., 0, 0].set(~mask[..., 0, 0]))


def test_packed_model_equals_masked_dense_and_halves_bytes(model, data):
    _, ids = data
    before = {n: np.asarray(v) for n, v in model.layers.weights().items()}
    packed = prune(model, "magnitude", pattern="2:4")
    dense = prune(model, "magnitude", pattern="2:4", pack=False)
    for n, v in model.layers.weights().items():  # the input model is untouched
        np.testing.assert_array_equal(np.asarray(v), before[n])
    pw, dw = packed.layers.weights(), dense.layers.weights()
    expanded = _dequantize_all({n: pw[n] for n in LINEARS})
    for n in LINEARS:
        assert isinstance(pw[n], NMSparse) and pw[n].shape == before[n].shape
        np.testing.assert_array_equal(np.asarray(expanded[n]), np.asarray(dw[n]))
    # Logits through the layer scan (which slices the packed leaves per layer) under jit, on the
    # (graphdef, state) split.
    graphdef, state = nnx.split(packed)
    packed_logits = np.asarray(jax.jit(forward, static_argnums=0)(graphdef, state, ids)[0])
    np.testing.assert_allclose(packed_logits, _logits(dense, ids), rtol=1e-5, atol=1e-5)
    assert not np.allclose(_logits(dense, ids), _logits(model, ids), atol=1e-3)
    # f32 2:4: half the values plus 2 bits per kept value = 0.5 + 0.5 * 2 / 32.
    assert weight_bytes(packed) / weight_bytes(model) == pytest.approx(0.5 + 0.5 * 2 / 32, abs=1e-9)
    report = sparsity_report(packed)
    assert all(report[n]["zeros"] == 0.5 and report[n]["format"] == "NMSparse 2:4" for n in LINEARS)
    assert report["total"]["bytes"] == weight_bytes(packed)
    assert sparsity_report(dense)["total"]["bytes"] == weight_bytes(model)
    # Unstructured 50%: half the values plus a 1-bit mask per weight, the same 0.53x.
    bitmask = prune(model, "magnitude", 0.5)
    assert all(isinstance(v, BitmaskSparse) for n, v in bitmask.layers.weights().items() if n in LINEARS)
    assert weight_bytes(bitmask) / weight_bytes(model) == pytest.approx(0.5 + 1 / 32, abs=1e-9)
    np.testing.assert_allclose(_logits(bitmask, ids), _logits(prune(model, "magnitude", 0.5, pack=False), ids),
                               rtol=1e-5, atol=1e-5)
    # 15:16 in f32: 15 values and 15 4-bit positions per 16 weights is more than 16 values: kept dense.
    wide = prune(model, "magnitude", pattern="15:16")
    assert weight_bytes(wide) == weight_bytes(model)
    assert not any(isinstance(v, NMSparse) for v in wide.layers.weights().values())
    # Pruned-then-quantized: symmetric int8 codes represent 0 exactly, so the zeros survive.
    assert sparsity_report(quantize(dense, "int8"))["total"]["zeros"] >= 0.5


def test_wanda_scores_use_captured_activation_norms(outlier_model, data):
    calib, _ = data
    model = outlier_model
    pruned = prune(model, "wanda", 0.5, calibration=calib, pack=False)
    magnitude = prune(model, "magnitude", 0.5, pack=False)
    w0, wp, wm = model.layers.weights(), pruned.layers.weights(), magnitude.layers.weights()
    cfg = CFG.replace(compute_dtype="f32")
    ids = jnp.asarray(calib)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    x = jnp.take(model.embed.embedding.get_value(), ids, axis=0)
    for layer in range(CFG.n_layers):
        dense = {n: v[layer] for n, v in w0.items()}
        _, inputs = run_layer(cfg, dense, x, pos)
        for n in LINEARS:
            xs = np.asarray(inputs[n], np.float64).reshape(-1, inputs[n].shape[-1])
            score = np.abs(np.asarray(dense[n], np.float64)) * np.linalg.norm(xs, axis=0)[:, None]
            np.testing.assert_array_equal(np.asarray(wp[n][layer]) != 0, _np_mask_unstructured(score, 0.5),
                                          err_msg=f"layer {layer} {n}")
            assert np.any((np.asarray(wm[n][layer]) != 0) != (np.asarray(wp[n][layer]) != 0))
        # The next layer's inputs come from this layer as pruned.
        x, _ = run_layer(cfg, {n: v[layer] for n, v in wp.items()}, x, pos)


def _kl(p_logits, q_logits):
    p = jax.nn.log_softmax(jnp.asarray(p_logits), -1)
    q = jax.nn.log_softmax(jnp.asarray(q_logits), -1)
    return float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))


def test_wanda_beats_magnitude_with_outlier_channels(outlier_model, data):
    calib, ids = data
    model = outlier_model
    ref = _logits(model, ids)
    for pattern in (None, "2:4"):
        kl = {}
        for method in ("magnitude", "wanda"):
            pruned = prune(model, method, pattern=pattern, calibration=calib, pack=False)
            kl[method] = _kl(ref, _logits(pruned, ids))
            assert np.isfinite(kl[method]) and kl[method] > 0
        assert kl["wanda"] < 0.75 * kl["magnitude"], (pattern, kl)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sparsity=1.0), r"sparsity=1\.0.*\[0, 1\)"),
    (dict(sparsity=-0.1), r"sparsity=-0\.1"),
    (dict(sparsity=True), r"sparsity=True"),
    (dict(pattern="3:2"), r"'3:2'.*1 <= N < M"),
    (dict(pattern="2:x"), r"'2:x' is not an N:M pattern"),
    (dict(pattern="4:4"), r"'4:4'"),
    (dict(pattern=24), r"pattern=24"),
    (dict(pattern="2:3"), r"input dimension 64, not a multiple of M=3"),
    (dict(pattern="2:4", sparsity=0.7), r"contradicts"),
    (dict(method="sparsegpt"), r"unknown pruning method 'sparsegpt'"),
    (dict(method="wanda"), r"needs calibration"),
    (dict(targets=("head",)), r"unknown target 'head'; accepted: names among wq, wk, wv, wo, w_gate, w_up, w_down"),
    (dict(targets=5), r"targets=5; accepted: a name or a list of names among wq"),
    (dict(targets=("wq", "wq")), r"target 'wq' is listed twice"),
    (dict(inplace="false"), r"inplace='false'; accepted: True or False"),
    (dict(pack="no"), r"pack='no'; accepted: True or False"),
])
def test_errors(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prune(model, **kwargs)


def test_refuses_quantized_and_repacking(model):
    with pytest.raises(ValueError, match=r"wq is already a int8.* weight leaf"):
        prune(quantize(model, "int8"), "magnitude")
    with pytest.raises(ValueError, match=r"already a NMSparse"):
        prune(prune(model, pattern="2:4"), pattern="2:4")
    with pytest.raises(ValueError, match=r"already a BitmaskSparse"):
        prune(prune(model), "magnitude")
    w = jnp.ones((8, 2))
    with pytest.raises(ValueError, match=r"exactly 2 in every group"):
        NMSparse.from_mask(w, jnp.ones((8, 2), bool), 2, 4)


def _eval_script():
    return experiment("eval_prune")


@pytest.mark.parametrize("argv,match", [
    (["--methods", "wanda-3:2"], "error: --methods 'wanda-3:2'"),
    (["--methods", "sparsegpt"], "error: --methods: unknown method 'sparsegpt'"),
    (["--methods", "magnitude-"], "error: --methods: unknown method 'magnitude-'; accepted: float, "),
    (["--windows", "0"], "error: --windows 0"),
    (["--sparsity", "1.0"], "error: --sparsity 1.0"),
    (["--methods", "wanda", "--calibration-windows", "0"], "error: --calibration-windows 0"),
    # Flags no chosen method reads were ignored without a word.
    (["--methods", "float,magnitude", "--calibration-windows", "4"],
     "error: --calibration-windows 4 is read by none of --methods float,magnitude; accepted: --calibration-windows "
     "with wanda"),
    (["--methods", "wanda-2:4", "--sparsity", "0.7"], "error: --sparsity 0.7 is read by none of --methods wanda-2:4; "
                                                      "accepted: --sparsity with magnitude or wanda (N:M patterns"),
])
def test_eval_script_checks_flags_before_loading(argv, match, capsys):
    assert _eval_script().cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(match), err


def test_eval_script_checks_patterns_against_the_model_before_any_method_runs(tmp_path, capsys):
    """tiny's 64-wide inputs hold no 2:3 groups: refused after the model loads, before float and magnitude
    run (it failed after evaluating them), naming --methods; nothing written."""
    out = tmp_path / "p.json"
    argv = ["--model", "tiny", "--windows", "1", "--methods", "float,magnitude,magnitude-2:3", "--out", str(out)]
    assert _eval_script().cli(argv) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == ("error: --methods 'magnitude-2:3': pattern='2:3': wq has input dimension 64, not a "
                               "multiple of M=3; accepted: a pattern whose M divides every target's input "
                               "dimension, or targets without it")
    assert "ppl" not in cap.out and not out.exists()


@pytest.mark.slow
def test_smollm2_2_4_bytes_and_finite_loss():
    lm = smollm2()
    pruned = prune(lm.model, "magnitude", pattern="2:4")
    assert weight_bytes(pruned) / weight_bytes(lm.model) == pytest.approx(0.5 + 0.5 * 2 / 32, abs=1e-9)
    ids = jnp.asarray(lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")[:16], jnp.int32)[None]
    assert np.all(np.isfinite(_logits(pruned, ids)))


@pytest.mark.parametrize("scores, sparsity, message", [
    (np.ones((8, 4)), 1.5, r"sparsity=1.5; accepted: a fraction of zeros in \[0, 1\)"),
    (np.ones((8, 4)), -0.5, r"sparsity=-0.5; accepted"),
    (np.ones((8, 4)), 1.0, r"sparsity=1.0; accepted"),  # was an all-False mask
    (np.ones((8, 4)), None, r"sparsity=None; accepted: a fraction of zeros in \[0, 1\)"),
    (np.arange(8.0), 0.5, r"scores of shape \(8,\); accepted: \[..., in, out\]"),
])
def test_unstructured_mask_refuses_what_prune_refuses(scores, sparsity, message):
    with pytest.raises(ValueError, match=message):
        unstructured_mask(jnp.asarray(scores), sparsity)


def test_default_targets_of_a_mixture_of_experts_model_are_its_attention_linears():
    """The default was all seven linears, which an MoE block lacks: prune(moe) was an error by default."""
    moe = Llama(LlamaConfig.tiny_moe(), rngs=nnx.Rngs(0))
    pruned = prune(moe, "magnitude", 0.5)
    kernels = {n: moe.layers.weight_var(n).get_value() for n in moe.config.weight_names()}
    assert {n for n in kernels if isinstance(pruned.layers.weight_var(n).get_value(), BitmaskSparse)} == set(
        LINEARS[:4])
    with pytest.raises(ValueError, match=r"^targets \['w_up'\] are not linear kernels of this model's blocks"):
        prune(moe, "magnitude", 0.5, targets=("wq", "w_up"))


def test_fine_tuning_with_keep_pruned_zeros_keeps_the_sparsity():
    """A plain optimizer fills a pack=False model's zeros in its first step; chained with keep_pruned_zeros
    the pruned kernels keep exactly their zeros while their kept weights and every other leaf train."""
    import optax

    from jmem.prune import keep_pruned_zeros
    from jmem.train import make_train_fns

    cfg = LlamaConfig.tiny(n_layers=2)
    pruned = prune(Llama(cfg, rngs=nnx.Rngs(0)), pattern="2:4", pack=False, targets=("wq", "w_up"))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": jnp.ones((2, 16))}
    zeros = {t: np.asarray(pruned.layers.weight_var(t).get_value()) == 0 for t in LINEARS}
    assert zeros["wq"].mean() == 0.5 and zeros["wk"].mean() == 0.0
    for tx, keeps in ((optax.adamw(1e-2), False), (optax.chain(optax.adamw(1e-2), keep_pruned_zeros(["wq", "w_up"])),
                                                   True)):
        fns = make_train_fns(pruned, tx)
        state = fns.init_state(pruned)
        for _ in range(2):
            state, _ = jax.jit(fns.step)(state, batch)
        trained = fns.merge(state.params).layers
        for t in ("wq", "w_up"):
            w, w0 = np.asarray(trained.weight_var(t).get_value()), np.asarray(pruned.layers.weight_var(t).get_value())
            assert np.array_equal(w == 0, zeros[t]) == keeps, t
            assert not np.allclose(w[~zeros[t]], w0[~zeros[t]])  # the kept weights train
        assert not np.allclose(trained.wk.kernel.get_value(), pruned.layers.wk.kernel.get_value())
    with pytest.raises(ValueError, match="needs the parameters"):
        keep_pruned_zeros().update({"a": jnp.ones(2)}, optax.EmptyState())
    keep_pruned_zeros(None)  # every linear, as prune's targets=None (refused before)
    # A packed model is refused with the way to fine-tune it (the QLoRA advice for a quantized base before).
    packed = prune(Llama(cfg, rngs=nnx.Rngs(0)), pattern="2:4", targets=("wq",))
    with pytest.raises(ValueError, match=r"\['wq'\]\['kernel'\] is uint8 \(a packed pruned kernel\) and cannot be "
                                         r"trained; accepted: a model pruned with pack=False"):
        make_train_fns(packed, optax.adamw(1e-2)).init_state(packed)

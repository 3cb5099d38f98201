"""`jmem.quant.quantize` on the tiny Llama model."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models.llama import Llama, LlamaConfig
from jmem.quant import (FP8Tensor, IntTensor, NF4Tensor, awq_scale, calibration_tokens, gptq_quantize, group_sizes,
                        quantize, weight_bytes)
from jmem.models.config import EXPERT_WEIGHTS
from jmem.quant.api import LINEARS, resolve_group_size

CFG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    calib = rng.integers(0, CFG.vocab_size, (8, 64)).astype(np.int32)
    evals = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 32)), jnp.int32)
    return calib, evals


@nnx.jit
def _forward(m, ids):
    return m(ids)[0]


def _logits(m, ids):
    # One jitted forward: models whose leaves share a structure share a compile.
    return np.asarray(_forward(m, ids))


def _rel(a, b):
    return float(np.mean((a - b) ** 2) / np.mean(b**2))


def test_plain_methods(model, data):
    _, ids = data
    ref = _logits(model, ids)
    float_bytes = weight_bytes(model)
    expect = {"rtn": (IntTensor, 0.16), "int8": (IntTensor, 0.27), "nf4": (NF4Tensor, 0.16), "fp8": (FP8Tensor, 0.27)}
    errs = {}
    for method, (cls, max_ratio) in expect.items():
        q = quantize(model, method, **({"group_size": 32} if method == "rtn" else {}))
        w = q.layers.weights()
        assert all(isinstance(w[n], cls) and w[n].shape == model.layers.weights()[n].shape for n in LINEARS)
        assert weight_bytes(q) / float_bytes <= max_ratio, method
        if method == "nf4":
            assert set(group_sizes(q).values()) == {64}
        errs[method] = _rel(_logits(q, ids), ref)
    # Step sizes set the order: int8 (1/127 of the column max) < fp8 (2**-4
    # relative) < 4-bit grids. The last bound only rules out garbage: the error
    # of a random-init model depends on its init, not on the format alone.
    assert errs["int8"] < errs["fp8"] < errs["rtn"] and errs["fp8"] < errs["nf4"], errs
    assert errs["int8"] < 1e-2 and max(errs.values()) < 0.5, errs
    # The source model is untouched (quantize works on a copy by default).
    assert not isinstance(model.layers.wq.kernel.get_value(), IntTensor)


@pytest.mark.slow
def test_awq_folds_scales_exactly(model, data):
    """At 8 bits the quantization error is tiny, so the output can stay close to float
    only if every folded scale (norms, v->o across grouped-query heads, up->down) is exact."""
    calib, ids = data
    q = quantize(model, "awq", bits=8, group_size=32, calibration=calib)
    assert not np.allclose(q.layers.attn_norm.scale[...], model.layers.attn_norm.scale[...])
    assert all(isinstance(q.layers.weights()[n], IntTensor) for n in LINEARS)
    rtn = quantize(model, "rtn", bits=8, group_size=32)
    ref = _logits(model, ids)
    assert _rel(_logits(q, ids), ref) < 2 * _rel(_logits(rtn, ids), ref)


def test_awq_fold_preserves_the_layer(model):
    """Folding random scales leaves a float block's output unchanged, when o's scale is
    tied across the query heads of each kv head (and only then)."""
    from jmem.calibrate import run_layer
    from jmem.quant.api import fold_awq_scales

    w = {n: jnp.asarray(v[0], jnp.float32) for n, v in model.layers.weights().items()}
    rng = np.random.default_rng(1)
    scale = lambda n: jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.float32)  # noqa: E731
    rep = CFG.n_heads // CFG.n_kv_heads
    s_o_kv = rng.uniform(0.5, 2.0, (CFG.n_kv_heads, 1, CFG.head_dim))
    s_o = jnp.asarray(np.repeat(s_o_kv, rep, axis=1).reshape(-1), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 16, CFG.dim)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    cfg = CFG.replace(remat="none")
    ref = np.asarray(run_layer(cfg, w, x, pos)[0])
    folded = fold_awq_scales(cfg, w, scale(CFG.dim), s_o, scale(CFG.dim), scale(CFG.ffn_dim))
    np.testing.assert_allclose(run_layer(cfg, folded, x, pos)[0], ref, rtol=1e-4, atol=1e-4)
    untied = fold_awq_scales(cfg, w, scale(CFG.dim), scale(CFG.n_heads * CFG.head_dim), scale(CFG.dim),
                             scale(CFG.ffn_dim))
    assert not np.allclose(run_layer(cfg, untied, x, pos)[0], ref, rtol=1e-2, atol=1e-2)


def test_gptq_runs_layer_by_layer(model, data):
    calib, ids = data
    q = quantize(model, "gptq", bits=4, group_size=32, calibration=calib, act_order=True)
    w = q.layers.weights()
    assert all(isinstance(w[n], IntTensor) and w[n].bits == 4 and w[n].group_size == 32 for n in LINEARS)
    # On random-init weights and random tokens GPTQ gains little over RTN (measured 0.9x-1.07x);
    # a pipeline fault (wrong Hessian, permutation or stage input) gives errors of order 1.
    ref = _logits(model, ids)
    rtn = _rel(_logits(quantize(model, "rtn", bits=4, group_size=32), ids), ref)
    assert _rel(_logits(q, ids), ref) < 1.5 * rtn
    # The first layer's q/k/v equal `gptq_quantize` on the Hessian of their input (the normed embeddings of
    # the calibration tokens), act-order included: the logits bound alone passed with RTN in GPTQ's place.
    from jmem.calibrate import _layer_of, run_layer
    from jmem.quant.gptq import hessian

    cfg = model.config.replace(remat="none", compute_dtype="f32")
    B, T = calib.shape
    x = jnp.take(model.embed.embedding.get_value(), jnp.asarray(calib), axis=0).astype(jnp.float32)
    wf = {n: _layer_of(v, 0) for n, v in model.layers.weights().items()}
    _, inputs = run_layer(cfg, wf, x, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    h = hessian(np.asarray(inputs["wq"]).reshape(-1, CFG.dim))
    for n in ("wq", "wk", "wv"):
        want = gptq_quantize(np.asarray(wf[n]), h, 4, 32, act_order=True)
        np.testing.assert_array_equal(np.asarray(_layer_of(w[n], 0).packed), np.asarray(want.packed), err_msg=n)


class _ByteTokenizer:
    def encode(self, text):
        return [b + 3 for b in text.encode()]


def test_calibration_from_texts():
    ids = calibration_tokens(["hello world " * 20, "more text"], _ByteTokenizer(), seq_len=64)
    assert ids.shape == (3, 64) and ids.dtype == np.int32  # 249 tokens -> 3 full windows
    np.testing.assert_array_equal(ids[0, :5], [b + 3 for b in b"hello"])
    assert calibration_tokens("short", _ByteTokenizer(), seq_len=64).shape == (1, 5)
    windows = np.arange(1000, dtype=np.int32).reshape(2, 500)
    assert calibration_tokens(windows, seq_len=128).shape == (2, 500)  # [B, T] are windows already
    assert calibration_tokens([windows[0], windows[1]], seq_len=128, max_seqs=4).shape == (4, 128)
    for ids in (np.ones((2, 8)), [np.ones(8, np.int32), np.ones(4)]):
        with pytest.raises(ValueError, match="calibration token ids of dtype float64; accepted: integer ids"):
            calibration_tokens(ids)


def test_bad_inputs(model, data):
    calib, _ = data
    with pytest.raises(ValueError, match="bits=3 is not supported by method 'nf4'"):
        quantize(model, "nf4", bits=3)
    with pytest.raises(ValueError, match="bits=5 is not supported by method 'gptq'"):
        quantize(model, "gptq", bits=5, calibration=calib)
    # No multiple of 32 below 24 divides 64; 50 is not a multiple of 8: both refused before any work.
    with pytest.raises(ValueError, match="group_size=24 does not divide the input dimension 64, nor does any"):
        quantize(model, "rtn", bits=4, group_size=24)
    with pytest.raises(ValueError, match="group_size=24 does not divide the input dimension 64, nor does any"):
        quantize(model, "awq", bits=4, group_size=24, calibration=calib)
    with pytest.raises(ValueError, match="group_size=50 does not divide the input dimension 64"):
        quantize(model, "gptq", bits=4, group_size=50, calibration=calib)
    with pytest.raises(ValueError, match="calibration is empty"):
        quantize(model, "gptq", bits=4, group_size=32, calibration=[])
    with pytest.raises(ValueError, match="calibration is empty"):
        quantize(model, "awq", bits=4, group_size=32, calibration="", tokenizer=_ByteTokenizer())
    with pytest.raises(ValueError, match="unknown quantization method 'hqq'"):
        quantize(model, "hqq")
    logged = []
    with pytest.raises(ValueError, match=r"^method 'gptq' needs calibration= \(texts with tokenizer=, or token ids"):
        quantize(model, "gptq", group_size=128, log=logged.append)  # "calibration is empty" before
    assert logged == []  # a refused call logged its group-size substitution first


@pytest.mark.parametrize("method", ["rtn", "int8", "nf4", "fp8"])
def test_calibration_is_refused_by_methods_that_do_not_calibrate(model, data, method):
    """As `jmem quantize --calibration` with such a method: refused, not silently dropped; one rule for both."""
    from jmem.quant.api import CALIBRATED
    from jmem.quant.cli import METHOD_FLAGS

    calib, _ = data
    with pytest.raises(ValueError, match=rf"^calibration= does not apply to method '{method}' \(it does not "
                                         r"calibrate\); accepted: calibration only with method gptq / awq, else None$"):
        quantize(model, method, calibration=calib)
    assert METHOD_FLAGS["--calibration"][1] == CALIBRATED


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="nf4", group_size=32), "group_size=32 does not apply to method 'nf4' (its block or channel layout "
                                        "is fixed); accepted: group_size only with method rtn / gptq / awq, else 128"),
    (dict(method="int8", group_size=64), "group_size=64 does not apply to method 'int8'"),
    (dict(method="fp8", symmetric=False), "symmetric=False does not apply to method 'fp8' (its format fixes its "
                                          "scaling)"),
    (dict(method="rtn", act_order=True), "act_order=True does not apply to method 'rtn' (only gptq orders columns)"),
    (dict(method="nf4", tokenizer=_ByteTokenizer()), "tokenizer= does not apply to method 'nf4'"),
    (dict(method="rtn", max_seqs=8), "max_seqs=8 does not apply to method 'rtn' (it does not calibrate)"),
    (dict(method="gptq", symmetric="no"), "symmetric='no'; accepted: True (scale only), False (scale and zero "
                                          "point) or None (True)"),
    (dict(method="gptq", act_order=1), "act_order=1; accepted: True or False"),
])
def test_arguments_the_method_does_not_read_are_refused(model, kwargs, message):
    """As `jmem quantize` refuses the flag: nothing set away from its default is silently dropped."""
    with pytest.raises(ValueError, match=re.escape(message)):
        quantize(model, **kwargs)


def test_method_arguments_agree_with_the_command_line_flags():
    from jmem.quant.api import METHOD_ARGS
    from jmem.quant.cli import METHOD_FLAGS

    for flag, (field, methods, why) in METHOD_FLAGS.items():
        if field in METHOD_ARGS:
            assert METHOD_ARGS[field][:2] == (methods, why), flag
    assert {"group_size", "symmetric", "act_order", "calibration"} <= {f for f, _, _ in METHOD_FLAGS.values()}


def test_a_calibration_text_shorter_than_max_seqs_is_said(model, data):
    """max_seqs (jmem quantize --calibration-windows) above the windows a text holds: one line saying how
    many are used; [B, T] windows given as such are the caller's choice and pass without a word."""
    lines = []
    quantize(model, "awq", bits=4, group_size=64, calibration=[data[0][0], data[0][1]], max_seqs=5, seq_len=32,
             log=lines.append)
    assert lines[0] == "awq: the calibration holds 4 window(s) of 32 tokens, fewer than max_seqs=5: calibrating on 4"
    assert all(" layer " in line for line in lines[1:])  # then the progress lines
    lines.clear()
    quantize(model, "awq", bits=4, group_size=64, calibration=data[0], max_seqs=32, log=lines.append)
    assert all(" layer " in line for line in lines)


def test_group_size_substitution():
    """A model whose width 96 the requested group 64 does not divide (MLP width 128 it does)."""
    cfg = LlamaConfig.tiny(dim=96, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=16)
    model = Llama(cfg, rngs=nnx.Rngs(1))
    lines = []
    q = quantize(model, "rtn", bits=4, group_size=64, log=lines.append)
    got = group_sizes(q)
    # wo's input is n_heads * head_dim = 64, which 64 divides.
    assert got == {"wq": 32, "wk": 32, "wv": 32, "wo": 64, "w_gate": 32, "w_up": 32, "w_down": 64}
    assert lines == ["rtn: group_size=64 does not divide input dimension 96 (wq, wk, wv, w_gate, w_up): "
                     "using group size 32"]
    w = q.layers.weights()
    assert all(w[n].scale.shape[-2] == w[n].shape[-2] // got[n] for n in LINEARS)
    # Same codes as quantizing the matrix alone with the substituted size.
    np.testing.assert_array_equal(w["wq"].packed, IntTensor.quantize(model.layers.weights()["wq"], 4, 32).packed)
    assert group_sizes(quantize(model, "int8"))["wq"] == 96 and group_sizes(model)["wq"] is None  # per channel
    # SmolLM2's widths: 576 takes 96 for 128; 1536 keeps 128.
    assert resolve_group_size(576, 128) == 96 and resolve_group_size(1536, 128) == 128
    assert resolve_group_size(576, None) == 576
    # A matrix of fewer rows than one group is one group, whatever its width (48 at 128 was refused, 64 not).
    assert resolve_group_size(48, 128) == 48 and resolve_group_size(64, 128) == 64 and resolve_group_size(16, 32) == 16
    small = Llama(LlamaConfig.tiny(n_heads=2, n_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))  # wo: 16 rows
    q = quantize(small, "rtn", group_size=32)
    assert group_sizes(q)["wo"] == 16
    np.testing.assert_array_equal(q.layers.weights()["wo"].packed, quantize(small, "rtn").layers.weights()["wo"].packed)
    # 8 bits take any group size, so one that is no multiple of 8 is substituted too (100 was refused, 104 not).
    assert resolve_group_size(64, 100, 8) == resolve_group_size(64, 104, 8) == 64


def test_tensor_level_group_size_is_strict():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 16)).astype(np.float32)
    x = rng.standard_normal((32, 96)).astype(np.float32)
    msg = "group_size=64 does not divide the input dimension 96"
    with pytest.raises(ValueError, match=msg):
        IntTensor.quantize(w, 4, 64)
    with pytest.raises(ValueError, match=msg):
        gptq_quantize(w, x.T @ x, 4, 64)
    with pytest.raises(ValueError, match=msg):
        awq_scale(jnp.asarray(x), [jnp.asarray(w)], 4, 64)
    with pytest.raises(ValueError, match="ws is empty; accepted: one or more weights"):  # an IndexError before
        awq_scale(jnp.asarray(x), [], 4, 32)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantized_leaves_keep_the_model_dtype(data, method):
    """A bf16 model's quantized kernels decode to bf16 whatever the method (the calibrated layers run in f32)."""
    calib, ids = data
    model = Llama(CFG.replace(param_dtype="bf16"), rngs=nnx.Rngs(0))
    kwargs = dict(calibration=calib[:2, :32]) if method != "rtn" else {}
    q = quantize(model, method, bits=4, group_size=32, **kwargs)
    w = q.layers.weights()
    assert {w[n].dtype for n in LINEARS} == {jnp.dtype(jnp.bfloat16)}, method
    assert w["attn_norm"].dtype == jnp.bfloat16


MOE = LlamaConfig.tiny_moe(moe_dropless=True)


@pytest.fixture(scope="module")
def moe():
    return Llama(MOE, rngs=nnx.Rngs(0))


def _decoded(model, qmodel):
    """`model` with every weight `qmodel` quantized replaced by its decoded float value."""
    from jmem.quant.api import quant_targets

    ref = nnx.clone(model)
    for name, var in quant_targets(ref).items():
        var.set_value(quant_targets(qmodel)[name].get_value().__jmem_array__().astype(var.get_value().dtype))
    return ref


@pytest.mark.parametrize("method, leaf", [("rtn", IntTensor), ("int8", IntTensor), ("nf4", NF4Tensor),
                                          ("fp8", FP8Tensor), ("Q8_0", None)])
def test_mixture_of_experts_models_quantize_their_experts(moe, data, method, leaf):
    """Attention linears and experts quantized ([layers, experts, in, out]; the router float): the model computes
    what the float model holding the decoded weights computes, in a fraction of the bytes."""
    from jmem.quant.ggml_weight import GGMLWeight, quantize_gguf_blocks

    _, ids = data
    if leaf is None:
        q, types = quantize_gguf_blocks(moe, method)
        leaf = GGMLWeight
        assert set(types) == {"wq", "wk", "wv", "wo", "moe.expert_gate", "moe.expert_up", "moe.expert_down"}
    else:
        q = quantize(moe, method, **({"group_size": 32} if method == "rtn" else {}))
    experts = q.layers.moe
    for name in ("expert_gate", "expert_up", "expert_down"):
        value = getattr(experts, name).get_value()
        assert isinstance(value, leaf) and value.shape == getattr(moe.layers.moe, name).get_value().shape
    assert isinstance(experts.router.kernel.get_value(), jnp.ndarray)
    assert weight_bytes(q) / weight_bytes(moe) < 0.3
    np.testing.assert_allclose(_logits(q, ids), _logits(_decoded(moe, q), ids), rtol=1e-5, atol=1e-5)
    # 8-bit grids stay close to the float model; the bound on 4-bit ones only rules out garbage (a flipped
    # expert choice moves a token's output far).
    assert _rel(_logits(q, ids), _logits(moe, ids)) < (1e-2 if method in ("int8", "Q8_0") else 0.5)
    if method == "rtn":
        assert group_sizes(q, ["moe.expert_down"]) == {"moe.expert_down": 32}


def test_quantized_experts_are_decoded_one_layer_at_a_time():
    """The compiled forward's temporaries hold about one layer's float experts, not all layers' (8 here)."""
    from jmem.memory import measure

    cfg = LlamaConfig.tiny_moe(n_layers=8, moe_experts=8, ffn_dim=256, moe_dropless=True)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graph, state = nnx.split(quantize(model, "int8"))
    report = measure(lambda st, ids: nnx.merge(graph, st)(ids)[0], state, jnp.zeros((1, 8), jnp.int32))
    one_layer = sum(getattr(model.layers.moe, n).get_value()[0].nbytes for n in ("expert_gate", "expert_up",
                                                                                 "expert_down"))
    assert report.temp_bytes < 2 * one_layer, (report.temp_bytes, one_layer)
    if jax.default_backend() == "cpu":  # decoded apart from the matmul (an accelerator fuses it: less)
        assert report.temp_bytes >= one_layer, (report.temp_bytes, one_layer)


def _layer0_router_input(model, qmodel, calib):
    """The MoE input of layer 0 (its normed hidden state) for `calib`, after `qmodel`'s attention, and
    layer 0's weights of both models."""
    from jmem.calibrate import _layer_of, run_layer

    cfg = model.config.replace(remat="none", compute_dtype="f32")
    B, T = calib.shape
    x = jnp.take(model.embed.embedding.get_value(), jnp.asarray(calib), axis=0).astype(jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    wq = {n: _layer_of(v, 0) for n, v in qmodel.layers.weights().items()}
    wf = {n: _layer_of(v, 0) for n, v in model.layers.weights().items()}
    _, inputs = run_layer(cfg, {**wq, "moe": wf["moe"]}, x, pos)
    return np.asarray(inputs["moe.router"]), wf, wq


def _expert(leaf, e):
    return jax.tree_util.tree_map(lambda a: a[e], leaf)


def test_gptq_quantizes_each_expert_on_the_rows_routed_to_it(moe, data):
    """Each expert's matrices equal `gptq_quantize` on the Hessian of the tokens routed to it (routed here
    with NumPy from the router's logits), gate/up on the normed input, down on silu(gate) * up computed with
    the already-quantized gate and up; the router stays float."""
    from jmem.quant.gptq import hessian

    calib = data[0][:2, :32]
    q = quantize(moe, "gptq", bits=4, group_size=32, calibration=calib)
    assert isinstance(q.layers.moe.router.kernel.get_value(), jnp.ndarray)
    h, wf, wq = _layer0_router_input(moe, q, calib)
    top = np.argsort(-(h @ np.asarray(wf["moe"]["router"])), axis=-1, kind="stable")[:, :MOE.moe_top_k]
    for e in range(MOE.moe_experts):
        rows = h[(top == e).any(-1)]
        assert len(rows), e
        for role in ("gate", "up"):
            ref = gptq_quantize(np.asarray(wf["moe"][role][e]), hessian(rows), 4, 32)
            np.testing.assert_array_equal(_expert(wq["moe"][role], e).packed, ref.packed)
        gate, up = (rows @ np.asarray(_expert(wq["moe"][r], e).__jmem_array__()) for r in ("gate", "up"))
        ref = gptq_quantize(np.asarray(wf["moe"]["down"][e]), hessian(gate / (1 + np.exp(-gate)) * up), 4, 32)
        # down's input is computed by the model's grouped matmul here and by NumPy above: a code may round apart
        assert np.mean(np.asarray(_expert(wq["moe"]["down"], e).packed) == np.asarray(ref.packed)) > 0.99, e


def test_awq_fold_preserves_a_mixture_of_experts_layer(moe):
    """Random scales folded into a MoE block (router and every expert's gate/up rows, each expert's own down
    scale through its up columns) leave its output, routing included, unchanged."""
    from jmem.calibrate import _layer_of, run_layer
    from jmem.quant.api import fold_awq_scales

    cfg = MOE.replace(remat="none", compute_dtype="f32")
    w = {n: _layer_of(v, 0) for n, v in moe.layers.weights().items()}
    rng = np.random.default_rng(1)
    scale = lambda *shape: jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)  # noqa: E731
    rep = MOE.n_heads // MOE.n_kv_heads
    s_o = jnp.repeat(scale(MOE.n_kv_heads, 1, MOE.head_dim), rep, axis=1).reshape(-1)
    x = jnp.asarray(rng.standard_normal((2, 16, MOE.dim)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    ref = np.asarray(run_layer(cfg, w, x, pos)[0])
    folded = fold_awq_scales(cfg, w, scale(MOE.dim), s_o, scale(MOE.dim), scale(MOE.moe_experts, MOE.ffn_dim))
    assert not np.allclose(folded["moe"]["router"], w["moe"]["router"])
    np.testing.assert_allclose(run_layer(cfg, folded, x, pos)[0], ref, rtol=1e-4, atol=1e-4)


def test_awq_quantizes_a_mixture_of_experts_model(moe, data):
    """At 8 bits the output stays as close to float as round-to-nearest's (a wrong fold would move it far)."""
    calib, ids = data
    q = quantize(moe, "awq", bits=8, group_size=32, calibration=calib)
    assert all(isinstance(getattr(q.layers.moe, n).get_value(), IntTensor) for n in EXPERT_WEIGHTS)
    assert not np.allclose(q.layers.moe.router.kernel.get_value(), moe.layers.moe.router.kernel.get_value())
    ref = _logits(moe, ids)
    assert _rel(_logits(q, ids), ref) < 2 * _rel(_logits(quantize(moe, "rtn", bits=8, group_size=32), ids), ref)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_expert_no_calibration_token_reaches_is_rounded_to_nearest(moe, data, method):
    """One calibration token reaches top_k=2 of the 4 experts of each layer: the other two are said and
    rounded to nearest (GPTQ on an empty Hessian would zero them), unclipped and unscaled under AWQ."""
    lines = []
    q = quantize(moe, method, bits=4, group_size=32, calibration=data[0][:1, :1], log=lines.append)
    notes = [line for line in lines if "no calibration token" in line]
    assert len(notes) == 3 * 2 * MOE.n_layers, lines  # gate, up and down of two experts per layer
    assert re.fullmatch(rf"{method}: layer 1: moe.expert_gate expert \d: no calibration token was routed to it; "
                        rf"{'rounded to nearest' if method == 'gptq' else 'not clipped'}", notes[0]), notes[0]
    e = int(notes[0].split("expert ")[1][0])
    h, wf, wq = _layer0_router_input(moe, q, data[0][:1, :1])
    # AWQ scales every expert's gate/up rows by one shared scale; down's scale is the expert's own (1 here)
    for role in ("gate", "up", "down") if method == "gptq" else ("down",):
        rtn = IntTensor.quantize(wf["moe"][role][e], 4, 32)
        np.testing.assert_array_equal(_expert(wq["moe"][role], e).packed, rtn.packed)

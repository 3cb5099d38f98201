"""Knowledge distillation: chunked loss equals a plain full-logits reference (values and
gradients), the teacher gets no gradient and keeps no activations, logits memory is
bounded by the chunk, and layer-dropped students equal hand-built ones."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmem.distill import distill_loss_sum, distill_terms_from_logits, make_distill_fns, student_from_teacher
from jmem.memory.measure import measure
from jmem.models.config import LlamaConfig
from jmem.models.llama import Llama, unstack_layers
from jmem.train.loss import lm_loss_sum

CFG = LlamaConfig.tiny(vocab_size=96, dim=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64)


def _batch(rng, B, T, V, masked=True):
    mask = (rng.random((B, T)) < 0.7) if masked else np.ones((B, T))
    return {"inputs": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
            "mask": jnp.asarray(mask, jnp.float32)}


def _np_reference(s, t, targets, mask, temperature, alpha, kind):
    """float64 numpy: alpha T^2 KL + (1 - alpha) CE, summed over the mask."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ce = -np.take_along_axis(log_softmax(s), np.asarray(targets)[..., None], -1)[..., 0]
    ls, lt = log_softmax(s / temperature), log_softmax(t / temperature)
    kl = (np.exp(lt) * (lt - ls)).sum(-1) if kind == "forward" else (np.exp(ls) * (ls - lt)).sum(-1)
    per = alpha * temperature**2 * kl + (1 - alpha) * ce
    m = np.asarray(mask, np.float64)
    return (per * m).sum(), m.sum()


@pytest.mark.parametrize("kind, chunk", [("forward", 4), ("reverse", 4), ("forward", 5)])  # 5: a tail of 1
def test_chunked_loss_and_grads_match_full_logits_reference(kind, chunk):
    rng = np.random.default_rng(1 if kind == "forward" else 2)
    temp, alpha = 1.7, 0.3
    student = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    teacher = Llama(CFG.replace(n_layers=2), rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    batch = _batch(rng, 2, 16, CFG.vocab_size)
    gs, ss = nnx.split(student)
    gt, st = nnx.split(teacher)

    def chunked(ss, st, batch):
        return distill_loss_sum(nnx.merge(gs, ss), nnx.merge(gt, st), batch, temperature=temp, alpha=alpha,
                                kind=kind, chunk=chunk)

    def plain(ss, st, batch):  # both models' full logits, then the loss in one piece
        s = nnx.merge(gs, ss)(batch["inputs"])[0]
        t = jax.lax.stop_gradient(nnx.merge(gt, st)(batch["inputs"])[0])
        kl, ce = distill_terms_from_logits(s, t, batch["targets"], batch["mask"], temperature=temp, kind=kind)
        return alpha * temp**2 * kl + (1 - alpha) * ce, (s, t)

    @jax.jit  # one compile for everything compared
    def run(ss, st, batch):
        out = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(ss, st, batch)
        (_, logits), g_ref = jax.value_and_grad(plain, has_aux=True)(ss, st, batch)
        return out, g_ref, logits

    ((total, count), (g_s, g_t)), g_ref, (s_logits, t_logits) = run(ss, st, batch)
    ref_total, ref_count = _np_reference(s_logits, t_logits, batch["targets"], batch["mask"], temp, alpha, kind)
    assert float(count) == ref_count
    np.testing.assert_allclose(float(total), ref_total, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g_s))
    # The teacher is under stop_gradient: exactly zero gradient for every teacher leaf.
    for a in jax.tree.leaves(g_t):
        assert float(jnp.abs(a).max()) == 0.0


@pytest.mark.parametrize("kind, ruled_out", [("forward", "teacher"), ("forward", "both"), ("reverse", "student"),
                                              ("reverse", "both")])
def test_ruled_out_tokens_and_ignored_targets_keep_the_loss_finite(kind, ruled_out):
    """A vocabulary entry that the distribution KL weighs by rules out (-inf logit: the teacher's in forward KL,
    the student's in reverse) adds 0 to the loss and to its gradient (was 0 * -inf = NaN), and a masked
    position's out-of-range target (-100) counts nothing; both equal a float64 reference."""
    rng = np.random.default_rng(4)
    B, T, V = 2, 6, 12
    s = rng.normal(size=(B, T, V)).astype(np.float32)
    t = rng.normal(size=(B, T, V)).astype(np.float32)
    targets = rng.integers(0, V - 1, (B, T))
    targets[targets >= 7] += 1  # never the ruled-out entry
    mask = np.ones((B, T), np.float32)
    mask[0, 4:] = 0
    ref_targets = targets.copy()
    targets[0, 4:] = -100
    for name, logits in (("teacher", t), ("student", s)):
        if ruled_out in (name, "both"):
            logits[:, :, 7] = -np.inf

    def terms(s_):
        return distill_terms_from_logits(s_, jnp.asarray(t), jnp.asarray(targets), jnp.asarray(mask),
                                         temperature=1.5, kind=kind)

    kl, ce = terms(jnp.asarray(s))
    grad = np.asarray(jax.grad(lambda s_: sum(terms(s_)))(jnp.asarray(s)))
    assert np.isfinite(grad).all() and np.abs(grad).max() > 0

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    la, lb = (log_softmax(t / 1.5), log_softmax(s / 1.5))[::1 if kind == "forward" else -1]
    with np.errstate(invalid="ignore"):
        ref_kl = (np.where(np.exp(la) > 0, np.exp(la) * (la - lb), 0.0).sum(-1) * mask).sum()
    ref_ce = -(np.take_along_axis(log_softmax(s), ref_targets[..., None], -1)[..., 0] * mask).sum()
    np.testing.assert_allclose(float(kl), ref_kl, rtol=2e-5)
    np.testing.assert_allclose(float(ce), ref_ce, rtol=2e-5)


def test_alpha_ends_are_plain_terms():
    """alpha=0 is the model's own chunked cross-entropy; alpha=1 is T^2 KL alone."""
    rng = np.random.default_rng(3)
    student = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(3))
    teacher = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(4))
    batch = _batch(rng, 2, 8, CFG.vocab_size)

    @jax.jit
    def run(ss, st, batch):
        s, t = nnx.merge(gs, ss), nnx.merge(gt, st)
        return (distill_loss_sum(s, None, batch, alpha=0.0, chunk=4),  # alpha=0 never touches the teacher
                lm_loss_sum(s, batch, chunk=8),
                distill_loss_sum(s, t, batch, alpha=1.0, temperature=3.0, chunk=8),
                distill_loss_sum(s, s, batch, alpha=1.0, chunk=8),
                s(batch["inputs"])[0], t(batch["inputs"])[0])

    gs, ss = nnx.split(student)
    gt, st = nnx.split(teacher)
    (ce, n), (ref_ce, ref_n), (kl, _), (same, _), s_logits, t_logits = run(ss, st, batch)
    np.testing.assert_allclose(float(ce), float(ref_ce), rtol=1e-6)
    assert float(n) == float(ref_n)
    ref_kl, _ = _np_reference(s_logits, t_logits, batch["targets"], batch["mask"], 3.0, 1.0, "forward")
    np.testing.assert_allclose(float(kl), ref_kl, rtol=2e-5)
    assert abs(float(same)) < 1e-4  # a student distilled against itself has zero KL


def _gradient_temp_bytes(student_cfg, teacher_cfg, batch, chunk):
    student = nnx.eval_shape(lambda: Llama(student_cfg, rngs=nnx.Rngs(0)))
    teacher = nnx.eval_shape(lambda: Llama(teacher_cfg, rngs=nnx.Rngs(1)))
    gs, ss = nnx.split(student)
    gt, st = nnx.split(teacher)

    def loss(ss, st, batch):
        return distill_loss_sum(nnx.merge(gs, ss), nnx.merge(gt, st), batch, chunk=chunk)[0]

    # Differentiated with respect to both models: only stop_gradient keeps the teacher out.
    return measure(jax.value_and_grad(loss, argnums=(0, 1)), ss, st, batch).temp_bytes


def test_chunking_bounds_logits_memory():
    """value_and_grad temp bytes, chunked vs plain (full logits of both models), at a shape
    where logits dominate: vocab 4096, seq 256, width 32. Each f32 [2, 256, 4096] logits
    tensor is 8 MiB and the plain backward holds several (student and teacher logits,
    their log-softmaxes, the softmax-difference gradient): 52 MiB measured. Chunk 32 holds
    1/8 of each, so the ideal ratio is 1/8 plus the small models' own activations: 0.16
    measured on CPU (jax 0.10.2); asserted <= 0.25."""
    V, B, T = 4096, 2, 256
    cfg = CFG.replace(vocab_size=V, n_layers=1, max_seq_len=T)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         _batch(np.random.default_rng(0), B, T, V, masked=False))
    student = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    teacher = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(1)))
    gs, ss = nnx.split(student)
    gt, st = nnx.split(teacher)

    def plain(ss, st, batch):
        s = nnx.merge(gs, ss)(batch["inputs"])[0]
        t = jax.lax.stop_gradient(nnx.merge(gt, st)(batch["inputs"])[0])
        kl, ce = distill_terms_from_logits(s, t, batch["targets"], batch["mask"], temperature=2.0)
        return 0.5 * 4.0 * kl + 0.5 * ce

    def chunked(ss, st, batch):
        return distill_loss_sum(nnx.merge(gs, ss), nnx.merge(gt, st), batch, chunk=32)[0]

    full = measure(jax.value_and_grad(plain), ss, st, batch).temp_bytes
    part = measure(jax.value_and_grad(chunked), ss, st, batch).temp_bytes
    logits_bytes = B * T * V * 4
    assert full >= 4 * logits_bytes  # the baseline really holds several full logits tensors
    assert part <= 0.25 * full, (part, full)


def test_teacher_keeps_no_activations_for_the_backward():
    """Seven more teacher layers cost (almost) no gradient memory; seven more student layers
    do (their activations are saved for the backward pass). Vocab small, so activations
    dominate."""
    B, T = 2, 64
    cfg = CFG.replace(vocab_size=64, dim=64, ffn_dim=256, n_heads=4, n_kv_heads=2, max_seq_len=T)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         _batch(np.random.default_rng(0), B, T, 64, masked=False))
    one, eight = cfg.replace(n_layers=1), cfg.replace(n_layers=8)
    base = _gradient_temp_bytes(one, one, batch, 32)
    deep_teacher = _gradient_temp_bytes(one, eight, batch, 32)
    deep_student = _gradient_temp_bytes(eight, one, batch, 32)
    student_cost = deep_student - base
    assert student_cost > 0
    assert deep_teacher - base <= 0.1 * student_cost, (base, deep_teacher, deep_student)


def _logits_and_hand_built(model, subset, ids):
    """Jitted: `model`'s logits, and the hand-built reference: the teacher's own embedding,
    final norm and head around its chosen per-layer weights (unrolled, not scanned)."""
    @jax.jit
    def run(state, ids):
        m = nnx.merge(graphdef, state)
        per_layer = unstack_layers(m, fuse=False)
        h, _ = m.hidden(ids, layers=[per_layer[i] for i in subset])
        return m(ids)[0], m.logits_from_hidden(h)

    graphdef, state = nnx.split(model)
    return run(state, ids)


def test_student_from_teacher_copies_layers():
    rng = np.random.default_rng(5)
    teacher = Llama(CFG.replace(n_layers=4), rngs=nnx.Rngs(5))
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 8)), jnp.int32)
    subset = [3, 0, 2]  # any order: block i of the student is teacher block subset[i]
    teacher_logits, hand_built = _logits_and_hand_built(teacher, subset, ids)

    full = student_from_teacher(teacher, range(4))
    assert full.config == teacher.config
    g, s = nnx.split(full)
    np.testing.assert_array_equal(jax.jit(lambda s, x: nnx.merge(g, s)(x)[0])(s, ids), teacher_logits)

    student = student_from_teacher(teacher, subset)
    assert student.config.n_layers == 3 and student.config.dim == teacher.config.dim
    g, s = nnx.split(student)
    np.testing.assert_allclose(jax.jit(lambda s, x: nnx.merge(g, s)(x)[0])(s, ids), hand_built, rtol=1e-5, atol=1e-5)
    # Own arrays: training the student cannot change the teacher.
    assert student.embed.embedding.get_value() is not teacher.embed.embedding.get_value()


@pytest.mark.slow
def test_student_from_quantized_teacher_keeps_leaf_type():
    from jmem.quant import quantize

    teacher = quantize(Llama(CFG.replace(n_layers=3), rngs=nnx.Rngs(6)), "int8")
    student = student_from_teacher(teacher, [2, 0])
    assert type(student.layers.wq.kernel.get_value()) is type(teacher.layers.wq.kernel.get_value())
    ids = jnp.asarray(np.random.default_rng(6).integers(0, CFG.vocab_size, (1, 8)), jnp.int32)
    _, hand_built = _logits_and_hand_built(teacher, [2, 0], ids)
    g, s = nnx.split(student)
    np.testing.assert_allclose(jax.jit(lambda s, x: nnx.merge(g, s)(x)[0])(s, ids), hand_built, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_a_step_at_an_alpha_end_logs_both_terms(alpha):
    """alpha=1 trains on the KL alone but logs the student's real cross-entropy (it was 0); alpha=0
    logs a KL of 0 (no teacher runs). The logged terms equal those of an alpha=0.5 step."""
    import optax

    rng = np.random.default_rng(11)
    student = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(11))
    teacher = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(12))
    batch = _batch(rng, 2, 8, CFG.vocab_size)
    metrics = {}
    for a in (alpha, 0.5):
        fns = make_distill_fns(student, teacher, optax.sgd(0.0), temperature=2.0, alpha=a, chunk=4)
        params, opt = fns.init(student)
        metrics[a] = jax.jit(fns.step)(params, opt, nnx.state(teacher), batch)[2]
    np.testing.assert_allclose(float(metrics[alpha]["ce"]), float(metrics[0.5]["ce"]), rtol=1e-6)
    assert float(metrics[alpha]["ce"]) > 1.0
    want_kl = 0.0 if alpha == 0.0 else float(metrics[0.5]["kl"])
    np.testing.assert_allclose(float(metrics[alpha]["kl"]), want_kl, rtol=1e-6)
    np.testing.assert_allclose(float(metrics[alpha]["loss"]), float(metrics[alpha]["kl" if alpha else "ce"]),
                               rtol=1e-6)


def test_default_chunk_is_the_models_loss_chunk_with_a_tail():
    """chunk=None takes loss_chunk positions per piece and a shorter tail (at a prime length it took
    the largest divisor, 1: a scan of one position per step); the value is the one-piece value."""
    student = Llama(CFG.replace(n_layers=1, loss_chunk=4), rngs=nnx.Rngs(3))
    batch = _batch(np.random.default_rng(3), 2, 13, CFG.vocab_size)
    jaxpr = jax.make_jaxpr(lambda b: distill_loss_sum(student, student, b, alpha=0.5))(batch)
    assert 3 in [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"], jaxpr
    got = distill_loss_sum(student, student, batch, alpha=0.5)
    want = distill_loss_sum(student, student, batch, alpha=0.5, chunk=13)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)


def test_plain_ce_steps_take_no_teacher():
    """alpha=0 leaves the teacher unused, so None is one; alpha > 0 without one is refused when built
    (both failed at the first step inside flax's merge)."""
    student = Llama(CFG.replace(n_layers=1), rngs=nnx.Rngs(4))
    batch = _batch(np.random.default_rng(4), 2, 8, CFG.vocab_size)
    fns = make_distill_fns(student, None, optax.sgd(0.0), alpha=0.0, chunk=4)
    params, opt = fns.init(student)
    metrics = jax.jit(fns.step)(params, opt, None, batch)[2]
    want, count = distill_loss_sum(student, None, batch, alpha=0.0)
    np.testing.assert_allclose(float(metrics["ce"]), float(want / count), rtol=1e-6)
    with pytest.raises(ValueError, match=r"^alpha=0.5 needs a teacher; accepted: a teacher model, or alpha=0"):
        make_distill_fns(student, None, optax.sgd(0.0), alpha=0.5)


def test_distill_step_trains_lora_on_a_quantized_student():
    """QLoRA-style distillation: int8 student base (dropped layers of the int8-quantized
    teacher, leaf type kept) plus adapters against the float teacher; only the adapters
    change and the objective falls."""
    import optax

    from jmem.lora import adapter_arrays, apply_lora, split_trainable
    from jmem.quant import quantize

    rng = np.random.default_rng(7)
    teacher = Llama(CFG.replace(n_layers=2), rngs=nnx.Rngs(7))
    q_teacher = quantize(teacher, "int8")
    student = apply_lora(student_from_teacher(q_teacher, [1]), rank=4, targets=("wq", "wv", "w_up"))
    assert type(student.layers.w_down.kernel.get_value()) is type(q_teacher.layers.w_down.kernel.get_value())
    fns = make_distill_fns(student, teacher, optax.adam(1e-2), temperature=2.0, alpha=0.5, chunk=4,
                           adapters_only=True)
    params, opt = fns.init(student)
    before = jax.tree.map(np.asarray, params)
    step = jax.jit(fns.step, donate_argnums=(0, 1))
    batch = _batch(rng, 2, 8, CFG.vocab_size, masked=False)
    losses = []
    for _ in range(6):
        params, opt, m = step(params, opt, nnx.state(teacher), batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    assert float(m["kl"]) > 0 and np.isfinite(float(m["ce"]))
    trained = fns.merge(params)
    assert any(np.abs(v).max() > 0 for k, v in adapter_arrays(trained).items() if k.endswith("lora_b"))
    frozen_before, frozen_after = split_trainable(before)[1], split_trainable(params)[1]
    same = jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), frozen_before, frozen_after)
    assert len(jax.tree.leaves(same)) > 10 and all(jax.tree.leaves(same))  # base, norms, embedding, head
    with pytest.raises(ValueError, match="no LoRA adapters"):
        make_distill_fns(teacher, teacher, optax.adam(1e-2), adapters_only=True)
    dropped = apply_lora(student_from_teacher(q_teacher, [1]), rank=4, targets=("wq",), dropout=0.5)
    with pytest.raises(ValueError, match="LoRA adapters have dropout > 0, which a distillation step does not apply"):
        make_distill_fns(dropped, teacher, optax.adam(1e-2), adapters_only=True)  # trained without it before


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(alpha=1.5), "alpha=1.5"),
    (dict(alpha=-0.1), "alpha=-0.1"),
    (dict(kind="jsd"), "kind='jsd'"),
    (dict(chunk=2.5), r"^distillation chunk=2.5; accepted: a positive integer, or None$"),
    (dict(chunk=0), "chunk=0"),
    (dict(temperature="2"), r"^distillation temperature='2'; accepted: a finite number > 0$"),
    (dict(temperature=True), r"^distillation temperature=True; accepted"),
    (dict(temperature=float("inf")), r"^distillation temperature=inf; accepted"),
    (dict(alpha=True), r"^distillation alpha=True; accepted: a number in \[0, 1\]"),
    (dict(alpha=float("nan")), r"^distillation alpha=nan; accepted"),
    (dict(alpha=None), r"^distillation alpha=None; accepted"),
])
def test_errors(kwargs, match):
    student = nnx.eval_shape(lambda: Llama(CFG, rngs=nnx.Rngs(0)))
    batch = _batch(np.random.default_rng(0), 1, 8, CFG.vocab_size)
    with pytest.raises(ValueError, match=match):
        distill_loss_sum(student, student, batch, **kwargs)


def test_vocab_mismatch_and_layer_errors():
    student = nnx.eval_shape(lambda: Llama(CFG, rngs=nnx.Rngs(0)))
    teacher = nnx.eval_shape(lambda: Llama(CFG.replace(vocab_size=128), rngs=nnx.Rngs(0)))
    batch = _batch(np.random.default_rng(0), 1, 8, CFG.vocab_size)
    with pytest.raises(ValueError, match="vocab_size=96 differs from teacher vocab_size=128"):
        distill_loss_sum(student, teacher, batch)
    with pytest.raises(ValueError, match="vocab_size=96 differs"):
        make_distill_fns(student, teacher, optax.sgd(0.1))
    for chunk in (-3, 0, 2.5):  # refused when built, not at the first step
        with pytest.raises(ValueError, match=rf"^distillation chunk={chunk}; accepted: a positive integer, or None$"):
            make_distill_fns(student, student, optax.sgd(0.1), chunk=chunk)
    for layers, match in [([0, 2], r"out of range .* \[0, 2\)"), ([-1], "out of range"), ([1, 1], r"repeat \[1\]"),
                          ([], "empty"), ([0.5], "not an integer"),
                          (1, r"^student layers=1; accepted: a sequence of distinct indices in \[0, 2\)$")]:
        with pytest.raises(ValueError, match=match):
            student_from_teacher(student, layers)


def test_bad_batch_is_one_clear_error():
    """A batch without one of its keys, of mismatched or non-[B, T] shapes: one ValueError naming the keys
    and shapes (was a KeyError, a broadcasting error or 'not enough values to unpack'), also under jit."""
    student = nnx.eval_shape(lambda: Llama(CFG, rngs=nnx.Rngs(0)))
    good = _batch(np.random.default_rng(0), 2, 8, CFG.vocab_size)
    accepted = r"; accepted: a dict with keys inputs, targets, mask, each \[B, T\] \(one B, T\)"
    no_mask = {k: v for k, v in good.items() if k != "mask"}
    with pytest.raises(ValueError, match=r"^distillation batch keys=\['inputs', 'targets'\]" + accepted):
        distill_loss_sum(student, student, no_mask)
    with pytest.raises(ValueError, match=r"^distillation batch =list" + accepted):
        distill_loss_sum(student, student, [good["inputs"]])
    bad_targets = {**good, "targets": good["targets"][:, :4]}
    with pytest.raises(ValueError, match=r"^distillation batch shapes inputs=\[2, 8\], targets=\[2, 4\], "
                                         r"mask=\[2, 8\]" + accepted):
        jax.jit(lambda b: distill_loss_sum(student, student, b))(bad_targets)
    flat = {k: v[0] for k, v in good.items()}
    with pytest.raises(ValueError, match=r"^distillation batch shapes inputs=\[8\], targets=\[8\]"):
        distill_loss_sum(student, student, flat)
    fns = make_distill_fns(student, student, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"^distillation batch keys="):
        fns.step(None, None, None, no_mask)


def test_targets_empty_batches_and_arguments_are_checked_as_for_the_plain_loss():
    """A counted target outside the vocabulary gave a NaN (or a wrong finite) loss, float targets a
    TypeError, an empty batch a ZeroDivisionError; a 0-d array temperature was refused, a teacher that
    is no model an AttributeError, and tx=None or adapters_only="False" passed until the step."""
    student = Llama(CFG, rngs=nnx.Rngs(0))
    good = _batch(np.random.default_rng(0), 2, 8, CFG.vocab_size, masked=False)
    for bad in (CFG.vocab_size + 5, -1):
        batch = {**good, "targets": good["targets"].at[0, 3].set(bad)}
        with pytest.raises(ValueError, match=rf"^batch\['targets'\] holds {bad} where the mask counts it"):
            distill_loss_sum(student, student, batch)
    with pytest.raises(ValueError, match=r"^batch\['targets'\] of dtype float32; accepted: integer token ids$"):
        distill_loss_sum(student, student, {**good, "targets": good["targets"].astype(jnp.float32)})
    for shape in ((1, 0), (0, 4)):
        empty = {k: jnp.zeros(shape, jnp.int32) for k in good}
        with pytest.raises(ValueError, match=rf"^batch of shape {list(shape)}; accepted: at least one row of at least "
                                             "one token$".replace("[", r"\[").replace("]", r"\]")):
            distill_loss_sum(student, student, empty)
        with pytest.raises(ValueError, match=r"^batch of shape"):
            lm_loss_sum(student, empty)
    distill_loss_sum(student, student, good, temperature=jnp.float32(2.0), alpha=np.float32(0.5))
    with pytest.raises(ValueError, match=r"^teacher=<object object at .*>; accepted: a jmem.models.Llama$"):
        student_from_teacher(object(), [0])
    with pytest.raises(ValueError, match=r"^tx=None; accepted: an optax.GradientTransformation"):
        make_distill_fns(student, student, None)
    with pytest.raises(ValueError, match=r"^adapters_only='False'; accepted: True or False$"):
        make_distill_fns(student, student, optax.sgd(0.1), adapters_only="False")


def test_script_refuses_a_save_student_path_through_a_file_before_loading(tmp_path, capsys):
    """A file where a directory of --save-student would have to be: one line before the teacher loads (was a
    NotADirectoryError after both training runs, the trained student lost)."""
    from tests.helpers import experiment

    blocker = tmp_path / "short.txt"
    blocker.write_text("keep")
    out = blocker / "sub"
    argv = ["--teacher", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--save-student", str(out)]
    assert experiment("distill").cli(argv) == 2
    cap = capsys.readouterr()
    assert cap.err == (f"error: --save-student '{out}': cannot create directory '{out}' ('{blocker}' is a file); "
                       "accepted: a writable path\n")
    assert cap.out == "" and list(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "keep"


def test_script_table_reports_no_step_time_for_one_step():
    """The first step compiles: --steps 1 measured nothing and printed s/step 0.00."""
    from tests.helpers import experiment

    script = experiment("distill")
    run = {"eval_ce": 4.0, "first_ce": 5.0, "last_ce": 4.5}
    r = {"teacher_ce": 3.0, "student_init_ce": 5.5, "distill": {**run, "step_s": None},
         "plain CE": {**run, "step_s": 0.25}}
    table = script.markdown(script.Config(steps=1), 1, r).splitlines()
    assert table[3].endswith("| 5.000 -> 4.500 | n/a (one step: compile) |") and table[4].endswith("| 0.25 |")


def test_script_failing_after_validation_leaves_no_save_student_directory(tmp_path, capsys):
    from tests.helpers import experiment

    out = tmp_path / "models" / "student"
    argv = ["--teacher", "tiny", "--steps", "2", "--batch", "2", "--seq", "4096", "--save-student", str(out)]
    assert experiment("distill").cli(argv) == 2
    assert "--seq 4096 exceeds the teacher's context" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_script_keeps_a_written_student_when_the_plain_ce_run_fails(tmp_path, monkeypatch, capsys):
    """The student is written after the distilled run; a Ctrl-C in the plain-CE run after it removed it."""
    from tests.helpers import experiment

    script = experiment("distill")
    real = script.train_student

    def train_student(student, teacher, data, eval_fn, cfg, alpha):
        if alpha == 0.0:
            raise KeyboardInterrupt
        return real(student, teacher, data, eval_fn, cfg, alpha)

    monkeypatch.setattr(script, "train_student", train_student)
    out = tmp_path / "student"
    argv = ["--teacher", "tiny", "--steps", "1", "--batch", "2", "--seq", "16", "--eval-batches", "1",
            "--save-student", str(out)]
    assert script.cli(argv) == 130
    assert "wrote the distilled student" in capsys.readouterr().out
    assert (out / "jmem_model.json").is_file()


@pytest.mark.slow
def test_script_saves_a_student_that_serves_as_the_teachers_draft(tmp_path, capsys):
    """`experiments/distill.py --save-student DIR` writes a model `jmem.load` reads; served as the teacher's
    draft, the engine gives the teacher's greedy tokens. A non-empty directory is refused before loading."""
    import jmem
    from jmem.serve.engine import Engine, EngineConfig
    from jmem.serve.request import SamplingParams
    from tests.helpers import experiment

    script = experiment("distill")
    out = tmp_path / "student"
    argv = ["--teacher", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--eval-batches", "1",
            "--save-student", str(out)]
    assert script.cli(argv) == 0, capsys.readouterr().err
    assert "note: preset 'tiny' is randomly initialised" in capsys.readouterr().out
    teacher, student = jmem.load("tiny"), jmem.load(str(out))
    assert student.config.n_layers == 1 and student.config.vocab_size == teacher.config.vocab_size
    prompts = [[5, 6, 7, 8], [100, 3]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cfg = dict(num_blocks=16, max_model_len=64, block_size=8)
    want = Engine(teacher.model, teacher.tokenizer, EngineConfig(**cfg)).generate(prompts, greedy)
    engine = Engine(teacher.model, teacher.tokenizer, EngineConfig(num_speculative_tokens=2, **cfg),
                    draft_model=student.model)
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == [o.token_ids for o in want]
    assert engine.metrics()["spec_decode_num_draft_tokens_total"] > 0
    capsys.readouterr()
    assert script.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --save-student {str(out)!r} is a non-empty directory; accepted: a new or empty directory " \
                  "(nothing is overwritten)", err


def test_an_moe_teacher_gives_each_row_the_targets_it_gives_it_alone():
    """The teacher runs dropless (inference): with capacity routing its targets depended on the batch."""
    teacher = Llama(LlamaConfig.tiny_moe(vocab_size=CFG.vocab_size, moe_capacity_factor=0.5), rngs=nnx.Rngs(1))
    student = Llama(CFG, rngs=nnx.Rngs(2))
    batch = _batch(np.random.default_rng(0), 2, 16, CFG.vocab_size, masked=False)
    both, _ = distill_loss_sum(student, teacher, batch, alpha=1.0)
    alone = [distill_loss_sum(student, teacher, {k: v[i:i + 1] for k, v in batch.items()}, alpha=1.0)[0]
             for i in range(2)]
    np.testing.assert_allclose(float(both), float(sum(alone)), rtol=1e-5)


def test_script_checks_the_seed_before_loading(capsys):
    """A negative --seed failed after the teacher had loaded and been evaluated, naming `seed`."""
    from tests.helpers import experiment

    assert experiment("distill").cli(["--teacher", "tiny", "--steps", "2", "--seed", "-1"]) == 2
    cap = capsys.readouterr()
    assert cap.err == "error: --seed -1; accepted: an integer >= 0\n" and cap.out == ""


def test_script_held_out_ce_of_an_moe_teacher_leaves_out_its_router_losses(capsys):
    """The held-out column is cross-entropy (as the train CE beside it): an MoE teacher's router losses were
    added to it."""
    import jax
    import jax.numpy as jnp

    import jmem
    from jmem.data import PackedDataset, load_documents
    from jmem.train.loss import lm_loss_sum, lm_loss_terms
    from tests.helpers import experiment

    script = experiment("distill")
    cfg = script.Config(teacher="tiny-moe", steps=1, batch=2, seq=16, eval_batches=1)
    result = script.main(cfg)
    lm = jmem.load("tiny-moe")
    data = PackedDataset.from_text(load_documents(None), lm.tokenizer, 16)
    [batch] = [jax.tree.map(jnp.asarray, b) for b in data.eval_batches(2, 1)]
    s, c, _ = lm_loss_terms(lm.model, batch)
    with_router = lm_loss_sum(lm.model, batch)
    assert abs(result["teacher_ce"] - float(s / c)) < 1e-4
    assert abs(float(with_router[0] / with_router[1]) - float(s / c)) > 1e-4  # the two differ for this teacher


def test_the_saved_student_keeps_the_teachers_general_fields(tmp_path):
    """--save-student writes the teacher's general.* fields (its license) with its tokenizer, as train.py --save
    and jmem quantize keep their source's."""
    import jmem
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from tests.helpers import experiment

    tiny = jmem.load("tiny")
    general = {"general.name": "Teacher", "general.license": "apache-2.0"}
    write_gguf(tmp_path / "t.gguf", tiny.config, tiny.model, tokenizer_metadata=byte_tokenizer_metadata(),
               general_metadata=general)
    teacher = jmem.load(str(tmp_path / "t.gguf"))
    experiment("distill").save_student(str(tmp_path / "s"), teacher.model, teacher)
    assert jmem.load(str(tmp_path / "s")).source.metadata == general

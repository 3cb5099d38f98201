"""Remat policies: names resolve, bad names fail clearly, and the compiler sees
the memory/FLOPs trade-off on a tiny model's gradient (full < minimal, dots < none)."""

import jax
import numpy as np
import pytest
from flax import nnx

from jmem.memory.measure import measure
from jmem.memory.names import ACTIVATIONS
from jmem.memory.remat import MINIMAL_NAMES, POLICIES, get_policy, parse_spec, remat
from jmem.models.config import LlamaConfig
from jmem.models.llama import Llama
from jmem.train.loss import lm_loss_sum
from jmem.train.step import split_params


def test_every_named_policy_resolves():
    assert get_policy("none") is None and get_policy(None) is None
    for name in POLICIES[1:]:
        assert callable(get_policy(name)), name


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_policy("everything")
    msg = str(e.value)
    assert "'everything'" in msg and all(p in msg for p in POLICIES)


def test_empty_policy_is_refused_not_read_as_none():
    """The model wraps every policy but the exact string "none" in jax.checkpoint, so "" meant full
    remat there and no remat in the estimate; only None (unset) means none."""
    from jmem.memory.remat import validate

    for call in (get_policy, validate):
        with pytest.raises(ValueError) as e:
            call("")
        assert str(e.value).startswith("unknown remat policy ''; accepted: ") and all(p in str(e.value) for p in POLICIES)
    assert validate(None) == "none"
    # The model reads None as "none" too (it wrapped the layer in jax.checkpoint(policy=None): full remat).
    fn, params = _grad_fn(None)
    hlo = fn.lower(params, _batch(B=1, T=16)).as_text()
    assert "checkpoint" not in hlo and hlo == _grad_fn("none")[0].lower(params, _batch(B=1, T=16)).as_text()


def test_spec_parsing_and_errors():
    assert parse_spec("query=device, mlp_up=offload,key=remat") == {"query": "device", "mlp_up": "offload", "key": "remat"}
    assert callable(get_policy("query=device,mlp_up=offload"))
    with pytest.raises(ValueError, match="unknown activation name 'qkv'"):
        get_policy("qkv=device")
    with pytest.raises(ValueError, match="remat, device, offload"):
        get_policy("query=disk")
    with pytest.raises(ValueError, match="given twice"):
        get_policy("query=device,query=remat")
    assert set(MINIMAL_NAMES) <= set(ACTIVATIONS)


@pytest.mark.parametrize("bad", [3, True, ["full"], b"full"])
def test_non_string_policy_is_one_clear_error(bad):
    from jmem.memory.remat import validate

    for call in (get_policy, validate, parse_spec, lambda p: remat(lambda x: x, p)):
        with pytest.raises(ValueError, match=r"^remat (policy|spec) .*; accepted: .*string"):
            call(bad)


def test_remat_refuses_a_non_callable():
    for name in ("full", "none"):
        with pytest.raises(ValueError, match=r"^remat: fn=3 \(int\); accepted: a callable"):
            remat(3, name)


def test_remat_wrapper_is_identity_for_none():
    f = lambda x: x * 2  # noqa: E731
    assert remat(f, "none") is f
    assert remat(f, "full") is not f


def _batch(B=4, T=128, seed=0):
    ids = np.random.default_rng(seed).integers(0, 259, (B, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((B, T), np.float32)}


def _grad_fn(policy):
    model = Llama(LlamaConfig.tiny(remat=policy), rngs=nnx.Rngs(0))
    graphdef, params, rest, treedef = split_params(model)

    def loss(p, b):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(p)), rest)
        s, c = lm_loss_sum(m, b)
        return s / c

    return jax.jit(jax.grad(loss)), params


def test_compiled_temp_bytes_order_and_same_gradients():
    batch = _batch()
    reports, grads = {}, {}
    for policy in ("none", "full", "minimal", "dots"):
        fn, params = _grad_fn(policy)
        reports[policy] = measure(fn, params, batch)
        grads[policy] = fn(params, batch)  # reuses the compile
    temp = {k: r.temp_bytes for k, r in reports.items()}
    flops = {k: r.flops for k, r in reports.items()}
    assert temp["full"] < temp["minimal"] < temp["none"], temp
    assert temp["full"] < temp["dots"] < temp["none"], temp
    # Recomputation costs FLOPs: full recomputes the most.
    assert flops["none"] < flops["dots"] < flops["full"], flops
    assert flops["minimal"] < flops["full"], flops
    # Remat changes what is stored, never the math.
    for policy in ("full", "minimal", "dots"):
        for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_offload_policy_moves_residuals_to_host():
    """`offload` puts the saved names in host memory. The CPU backend elides the
    transfers when lowering, so check the differentiated program itself."""
    batch = _batch(2, 32)
    fn, params = _grad_fn("offload")
    assert "MemorySpace.Host" in str(jax.make_jaxpr(fn)(params, batch))
    fn_min, _ = _grad_fn("minimal")
    assert "MemorySpace.Host" not in str(jax.make_jaxpr(fn_min)(params, batch))
    fn_spec, _ = _grad_fn("query=device,mlp_up=offload")
    assert "MemorySpace.Host" in str(jax.make_jaxpr(fn_spec)(params, batch))


def test_matmul_flops_count_every_layer_and_exactly_the_recompute():
    """Whole-step matmul FLOPs of the tiny model (2 layers, 4 x 128 tokens), against the
    formula: the backward pass costs two forward passes, `full` adds each layer's forward
    matmuls but `w_down` (its output feeds nothing the backward needs), `dots` adds none."""
    cfg = LlamaConfig.tiny()
    B, T = 4, 128
    tokens = B * T
    hq, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    projections = cfg.dim * (2 * hq + 2 * hkv)  # wq, wk, wv, wo: multiply-adds per token
    mlp = 3 * cfg.dim * cfg.ffn_dim  # gate, up, down
    attention = 2 * (2 * B * cfg.n_heads * T * T * cfg.head_dim)  # QK^T and PV, FLOPs per layer
    head = 2 * tokens * cfg.dim * cfg.vocab_size
    forward = cfg.n_layers * (2 * tokens * (projections + mlp) + attention) + head
    recompute = cfg.n_layers * (2 * tokens * (projections + mlp - cfg.dim * cfg.ffn_dim) + attention)
    batch = _batch(B, T)
    mm = {}
    for policy in ("none", "full", "dots"):
        fn, params = _grad_fn(policy)
        mm[policy] = measure(fn, params, batch).matmul_flops
    assert mm["none"] == 3 * forward
    assert mm["full"] - mm["none"] == recompute
    assert mm["dots"] == mm["none"]

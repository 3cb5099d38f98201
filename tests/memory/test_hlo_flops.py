"""Matmul FLOPs from the optimized HLO: loop bodies times their trip counts, against formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.memory.hlo_flops import branch_flops, matmul_flops
from jmem.memory.measure import measure

M, K, N, L = 64, 256, 128, 8


def _hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _scan(x, w):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]


def test_a_scan_counts_every_iteration_the_cost_model_one():
    x, w = jnp.ones((M, K)), jnp.ones((L, K, K))
    one = 2 * M * K * K
    assert matmul_flops(_hlo(_scan, x, w)) == L * one
    r = measure(_scan, x, w)
    assert r.matmul_flops == L * one
    assert r.flops < 1.1 * one  # XLA's cost model: the loop body once


def test_gradient_and_nested_loops():
    x, w = jnp.ones((M, K)), jnp.ones((L, K, K))
    one = 2 * M * K * K
    grad = jax.grad(lambda x, w: _scan(x, w).sum(), argnums=(0, 1))
    assert matmul_flops(_hlo(grad, x, w)) == 3 * L * one  # forward, dx, dw
    nested = lambda x, w: jax.lax.scan(lambda h, _: (_scan(h, w), None), x, None, length=3)[0]  # noqa: E731
    assert matmul_flops(_hlo(nested, x, w)) == 3 * L * one


def test_batched_dot_and_convolution():
    a, b = jnp.ones((4, M, K)), jnp.ones((4, K, N))
    assert matmul_flops(_hlo(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b)) == 2 * 4 * M * K * N

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    x, k = jnp.ones((2, 16, 16, 8)), jnp.ones((3, 3, 8, 32))
    assert matmul_flops(_hlo(conv, x, k)) == 2 * (2 * 16 * 16 * 32) * (3 * 3 * 8)
    grouped = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
    assert matmul_flops(_hlo(grouped, x, jnp.ones((3, 3, 4, 32)))) == 2 * (2 * 16 * 16 * 32) * (3 * 3 * 4)


def test_conditional_branches_of_equal_cost_count_once_unequal_ones_are_unknown():
    x, w = jnp.ones((M, K)), jnp.ones((K, K))

    def unequal(p, x, w):
        return jax.lax.cond(p, lambda x: jnp.tanh(x @ w) @ w, lambda x: jnp.tanh(x @ w), x)

    def equal(p, x, w):
        return jax.lax.cond(p, lambda x: jnp.tanh(x @ w), lambda x: jnp.sin(x @ w.T), x)

    def no_matmul(p, x, w):
        return jax.lax.cond(p, lambda x: jnp.tanh(x), lambda x: jnp.sin(x), x) @ w

    assert math.isnan(matmul_flops(_hlo(unequal, True, x, w)))
    assert matmul_flops(_hlo(equal, True, x, w)) == 2 * M * K * K
    assert matmul_flops(_hlo(no_matmul, True, x, w)) == 2 * M * K * K


def test_branch_flops_of_a_switch_with_a_nested_conditional():
    x, w = jnp.ones((M, K)), jnp.ones((L, K, K))
    one = 2 * M * K * K

    def f(i, p, x, w):
        nested = lambda x: jax.lax.cond(p, lambda x: x @ w[0] @ w[1], lambda x: x, x)  # noqa: E731
        return jax.lax.switch(i, [lambda x: x, lambda x: _scan(x, w), nested], x)

    # Branch 1 is a scan of L matmuls (every iteration counted); branch 2 holds a cond whose
    # branches differ, counted as its costliest (two matmuls).
    text = _hlo(lambda i, p, x, w: f(i, p, x, w) @ w[0], 0, True, x, w)
    assert sorted(branch_flops(text)) == [(0.0, 2 * one), (0.0, L * one, 2 * one)]
    assert math.isnan(matmul_flops(text))
    assert matmul_flops(text, differing="zero") == one  # the matmul after the switch
    with pytest.raises(ValueError, match="differing='max'; accepted: 'nan', 'zero'"):
        matmul_flops(text, differing="max")


def test_a_loop_of_unknown_trip_count_is_nan_not_an_undercount():
    x, w = jnp.ones((M, K)), jnp.ones((K, K))

    def until_small(x, w):
        return jax.lax.while_loop(lambda h: jnp.abs(h).sum() > 1.0, lambda h: 0.5 * jnp.tanh(h @ w), x)

    assert math.isnan(matmul_flops(_hlo(until_small, x, w)))

    def no_matmul_inside(x, w):
        return jax.lax.while_loop(lambda h: jnp.abs(h).sum() > 1.0, lambda h: 0.5 * h, x) @ w

    assert matmul_flops(_hlo(no_matmul_inside, x, w)) == 2 * M * K * K


def test_gpu_gemm_custom_calls_in_a_counted_loop():
    """GPU executables replace dots by GEMM custom calls carrying their dot dimensions."""
    text = """HloModule m

%body (t: (s32[], f32[64,256])) -> (s32[], f32[64,256]) {
  %t = (s32[], f32[64,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[64,256]{1,0} get-tuple-element(%t), index=1
  %w = f32[256,256]{1,0} constant({...})
  %gemm = (f32[64,256]{1,0}, s8[4194304]{0}) custom-call(f32[64,256]{1,0} %h, f32[256,256]{1,0} %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = f32[64,256]{1,0} get-tuple-element(%gemm), index=0
  ROOT %r = (s32[], f32[64,256]{1,0}) tuple(%i, %out)
}

%cond (t: (s32[], f32[64,256])) -> pred[] {
  %t = (s32[], f32[64,256]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[64,256]) -> f32[64,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[64,256]{1,0}) tuple(%z, %x)
  %loop = (s32[], f32[64,256]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %y = f32[64,256]{1,0} get-tuple-element(%loop), index=1
}
"""
    assert matmul_flops(text) == 5 * 2 * 64 * 256 * 256
    assert math.isnan(matmul_flops("not hlo"))


@pytest.mark.parametrize("seed", [0, 1])
def test_random_matmul_chains_match_their_formula(seed):
    """Fresh random shapes: a loop of a chain of matmuls with random sizes and trip count."""
    rng = np.random.default_rng(seed)
    m, k, n = (int(v) for v in rng.integers(8, 96, 3))
    trips = int(rng.integers(2, 9))
    x, a, b = jnp.ones((m, k)), jnp.ones((trips, k, n)), jnp.ones((trips, n, k))

    def f(x, a, b):
        return jax.lax.scan(lambda h, ab: (jnp.tanh(h @ ab[0]) @ ab[1], None), x, (a, b))[0]

    assert matmul_flops(_hlo(f, x, a, b)) == trips * 2 * (2 * m * k * n)

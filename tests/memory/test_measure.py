"""Compiler-measured memory: exact bytes on small programs, donation, FLOPs, TPU targets."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.memory.measure import MemoryReport, TargetError, bytes_per_device, measure, parse_target, tree_bytes

N = 256


def _mm(x, w):
    return jnp.tanh(x @ w)


def test_argument_output_and_flops_of_a_matmul():
    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    w = jax.ShapeDtypeStruct((N, 2 * N), jnp.float32)
    r = measure(_mm, x, w)
    assert isinstance(r, MemoryReport)
    assert r.argument_bytes == 4 * (N * N + N * 2 * N)
    assert r.output_bytes == 4 * N * 2 * N
    assert r.alias_bytes == 0
    # One matmul: 2*M*K*N FLOPs (tanh adds a few per element at most).
    assert 2 * N * N * 2 * N <= r.flops <= 2 * N * N * 2 * N * 1.05
    assert r.total_bytes == r.argument_bytes + r.output_bytes + r.temp_bytes + r.generated_code_bytes
    assert "total" in r.table() and "GFLOPs" in r.table()
    assert r.as_dict()["total_bytes"] == r.total_bytes


def test_concrete_arrays_and_jitted_functions_with_donation():
    x = jnp.ones((N, N))
    jitted = jax.jit(lambda x, s: x * s, donate_argnums=0, static_argnums=1)
    r = measure(jitted, x, 2.0)
    assert r.alias_bytes == 4 * N * N  # output reuses the donated input
    assert r.total_bytes == r.argument_bytes + r.temp_bytes + r.generated_code_bytes
    plain = measure(lambda x: x * 2.0, x)
    assert plain.alias_bytes == 0 and plain.total_bytes > r.total_bytes


def test_temp_bytes_track_an_intermediate():
    """A [N, 8N] f32 intermediate that must be materialised (it is reduced twice
    over different axes) shows up in temp bytes; a scalar-output sum of a
    fused elementwise chain does not."""
    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    w = jax.ShapeDtypeStruct((N, 8 * N), jnp.float32)

    def two_reductions(x, w):
        h = x @ w
        return h.sum(0), h.max(1)

    r = measure(two_reductions, x, w)
    assert r.temp_bytes >= 4 * N * 8 * N


def test_tree_bytes():
    tree = {"a": jnp.zeros((3, 4), jnp.bfloat16), "b": jax.ShapeDtypeStruct((5,), jnp.int32), "c": 1.0}
    assert tree_bytes(tree) == 3 * 4 * 2 + 5 * 4


def test_bytes_per_device_bad_input_is_one_clear_error():
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"a": jnp.ones(4), "b": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    assert bytes_per_device(tree) == bytes_per_device(tree, {"a": s, "b": s}) == 40
    with pytest.raises(ValueError, match=r"^bytes_per_device: tree has a leaf 1 \(int\); accepted: a tree of arrays"):
        bytes_per_device([1, 2])
    with pytest.raises(ValueError, match=r"^bytes_per_device: shardings has 1 leaves for the 2 of tree; accepted"):
        bytes_per_device(tree, {"a": s})
    with pytest.raises(ValueError, match=r"^bytes_per_device: shardings has a leaf 'x' \(str\); accepted"):
        bytes_per_device(tree, {"a": s, "b": "x"})


@pytest.mark.parametrize("bad, shown", [("abc", "'abc' (str)"), (None, "None (NoneType)"), (3, "3 (int)")])
def test_fn_that_is_not_callable_is_one_clear_error(bad, shown):
    x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    with pytest.raises(ValueError, match="^" + re.escape(f"fn={shown}; accepted: a function or a jax.jit-ted")):
        measure(bad, x)


@pytest.mark.parametrize("bad", ["tpu", "gpu:a100", "tpu:v5e", "tpu:v5e:2y2", "v5e:2x2"])
def test_bad_target_is_one_clear_error(bad):
    with pytest.raises(TargetError, match="tpu:CHIP:TOPOLOGY"):
        measure(_mm, jnp.ones((2, 2)), jnp.ones((2, 2)), target=bad)
    with pytest.raises(TargetError):
        parse_target(bad)


@pytest.mark.parametrize("bad", ["tpu:v5e:0x2", "tpu:v4:2x0x2"])
def test_a_zero_topology_dimension_is_refused(bad):
    """libtpu ended the process (SIGFPE) describing such a topology."""
    with pytest.raises(TargetError, match="a topology dimension of 0; accepted: dimensions >= 1"):
        measure(_mm, jnp.ones((2, 2)), jnp.ones((2, 2)), target=bad)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the tpu extra) is not installed")
def test_tpu_target_compiles_ahead_of_time_and_shows_bf16_savings():
    x32 = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    x16 = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)

    def f(x):
        h = jnp.tanh(x @ x)
        return h.sum(0), h.max(1)

    r32 = measure(f, x32, target="tpu:v5e:2x2")
    r16 = measure(f, x16, target=" TPU:v5e:2x2")  # named as parsed: TPU-only readings key on "tpu"
    assert r32.target == r16.target == "tpu:v5e:2x2" and np.isnan(r16.matmul_flops)
    assert r32.argument_bytes == 4 * 1024 * 1024 and r16.argument_bytes == 2 * 1024 * 1024
    assert r32.flops >= 2 * 1024**3
    assert r16.total_bytes < r32.total_bytes
    with pytest.raises(TargetError, match="cannot describe"):
        measure(f, x32, target="tpu:v99:2x2")


def test_missing_libtpu_is_one_clear_error(monkeypatch):
    m = importlib.import_module("jmem.memory.measure")  # the module: `jmem.memory.measure` is the function

    real = importlib.util.find_spec
    monkeypatch.setattr(m.importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    m.target_devices.cache_clear()
    with pytest.raises(TargetError, match="needs libtpu"):
        measure(_mm, jnp.ones((2, 2)), jnp.ones((2, 2)), target="tpu:v5e:2x2")
    m.target_devices.cache_clear()


def test_measure_and_compile_returns_a_runnable_executable():
    from jmem.memory.measure import measure_and_compile

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
    report, compiled = measure_and_compile(_mm, x, x)
    assert report.argument_bytes == 2 * 4 * 64
    np.testing.assert_allclose(compiled(x, x), jnp.tanh(x @ x), rtol=1e-6)


def _attention_grad(impl):
    from jmem.kernels import attention

    def loss(q, k, v):
        return attention(q, k, v, causal=True, impl=impl).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def test_compiling_for_names_the_platform_for_the_dispatcher_only_inside():
    from jmem.kernels.dispatch import compiling_for, target_platform

    local = target_platform()
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
    # A fresh function per trace: JAX's trace cache is keyed on the function and
    # argument types, not on this context (`measure` differs in the shardings).
    fwd = lambda: (lambda q: _attention_grad("auto")(q, q, q))  # noqa: E731
    with compiling_for("tpu"):
        assert target_platform() == "tpu"
        assert "pallas_call" in str(jax.make_jaxpr(fwd())(q))
        with compiling_for("cuda"):
            assert target_platform() == "gpu"
        assert target_platform() == "tpu"
    assert target_platform() == local
    if local == "cpu":
        assert "pallas_call" not in str(jax.make_jaxpr(fwd())(q))
    with pytest.raises(ValueError, match="compiling_for platform='tpu:v5e'"):
        with compiling_for("tpu:v5e"):
            pass


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the tpu extra) is not installed")
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU interpreter path after a TPU compile")
def test_tpu_target_compiles_the_mosaic_flash_kernel_and_does_not_leak():
    from jmem.kernels.dispatch import target_platform, xla_attention
    from jmem.memory.measure import measure_and_compile

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 2, 16)), jnp.float32) for _ in range(3))
    grad = jax.jit(_attention_grad("pallas"))
    ref = jax.grad(lambda q, k, v: xla_attention(q, k, v, causal=True).sum(), argnums=(0, 1, 2))(q, k, v)

    def check_cpu_interpreter():
        text = grad.lower(q, k, v).compile().as_text()
        assert "tpu_custom_call" not in text and "while" in text  # the interpreter's grid loop
        for got, want in zip(grad(q, k, v), ref):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    check_cpu_interpreter()  # traced for CPU first: the TPU compile below must not reuse it
    x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    report, compiled = measure_and_compile(grad, x, x, x, target="tpu:v5e:2x2")
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, dq and dk/dv kernels
    assert " while(" not in text  # no interpreter loop
    assert report.target == "tpu:v5e:2x2" and report.argument_bytes == 3 * 128 * 2 * 64 * 2
    assert target_platform() == "cpu"
    check_cpu_interpreter()  # and the CPU path is still the interpreter after it

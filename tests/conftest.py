"""Test setup: 8 simulated CPU devices, set before JAX is imported.

XLA:CPU compiles the tests' programs with LLVM's optimizations off (`--xla_backend_optimization_level=0`):
their models are tiny, so compiling, not running, took most of the suite's time, most of it in those passes.
The flag changes only the machine code: the HLO passes, buffer assignment (`memory_analysis`) and
`cost_analysis` FLOPs the memory tests assert are the same with it as without. Subprocesses the tests start
inherit it through the environment."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """`../shared` beside the checkout; tests that need it skip when it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared is absent (only present in the project's own checkouts)")
    return SHARED


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every XLA:CPU executable keeps its own
    memory mappings; the whole suite compiles thousands of programs, which would otherwise reach
    the kernel's per-process mapping limit (vm.max_map_count) and crash the compiler."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()

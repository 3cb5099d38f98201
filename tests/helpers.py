"""Shared test fixtures' building blocks."""

import functools

import pytest


@functools.lru_cache(maxsize=1)
def smollm2():
    """The real SmolLM2-135M (float32), loaded once per test session; skips when not installed."""
    import jmem
    from jmem.lm import packaged_model_path

    try:
        packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return jmem.load("smollm2-135m")

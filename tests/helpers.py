"""Shared test fixtures' building blocks."""

import functools
import pathlib
import sys

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


def run_train_script(argv, capsys):
    """`experiments/train.py`'s main(argv) in this process: (exit status, stderr)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    try:
        import train as script
    finally:
        sys.path.pop(0)
    rc = script.main(argv)
    return rc, capsys.readouterr().err

"""The serving benchmark runs end to end on the tiny model (slow: it runs every mode twice)."""

import importlib.util
import pathlib
import sys

import pytest


@pytest.mark.slow
def test_bench_serve_smoke(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    mod.main(mod.Config(model="tiny", num_requests=6, prompt_len=(4, 20), output_len=(2, 6), max_num_seqs=4,
                        hf_requests=0))
    out = capsys.readouterr().out
    assert "| (a) jmem continuous batching |" in out and "| (b) jmem static batching |" in out

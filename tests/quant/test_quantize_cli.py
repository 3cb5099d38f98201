"""`jmem quantize`, run as a user would, on the tiny model."""

import subprocess
import sys

import numpy as np

import jmem


def _quantize(*args):
    code = "import sys; from jmem.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, "quantize", *args], capture_output=True, text=True,
                          timeout=600)


def test_gguf_method_and_rtn_written_and_loadable(tmp_path):
    ids = np.arange(1, 17, dtype=np.int32)[None]
    float_logits = np.asarray(jmem.load("tiny").logits(ids))
    errors = {}
    for method, bits in (("q8_0", "8"), ("rtn", "8"), ("rtn", "2")):
        out = tmp_path / f"{method}{bits}.gguf"
        r = _quantize("--model", "tiny", "--method", method, "--bits", bits, "--group-size", "32", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert f"wrote {out}" in r.stdout
        logits = np.asarray(jmem.load(str(out)).logits(ids))
        errors[method + bits] = np.abs(logits - float_logits).mean() / float_logits.std()
    assert 0 < errors["q8_08"] < 0.05 and 0 < errors["rtn8"] < 0.05, errors
    assert errors["rtn2"] > 3 * max(errors["q8_08"], errors["rtn8"]), errors


def test_bad_input_one_line(tmp_path):
    for args in (["--method", "q9_9", "--out", str(tmp_path / "a.gguf")],
                 ["--method", "rtn", "--out", str(tmp_path / "a.bin")],
                 ["--method", "rtn", "--bits", "5", "--out", str(tmp_path / "a.gguf")]):
        r = _quantize("--model", "tiny", *args)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert not list(tmp_path.iterdir())

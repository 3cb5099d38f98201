"""The `jmem` command, run as a user would."""

import subprocess
import sys

import pytest

from jmem.lm import packaged_model_path


def _jmem(*args):
    return subprocess.run([sys.executable, "-m", "jmem.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_tiny():
    r = _jmem("generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


def test_help_names_every_subcommand():
    r = _jmem("--help")
    assert r.returncode == 0, r.stderr
    assert all(c in r.stdout for c in ("generate", "info", "jmem serve --help", "jmem quantize --help")), r.stdout


def test_info_smollm2():
    try:
        path = packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    r = _jmem("info", path)
    assert r.returncode == 0, r.stderr
    assert "architecture:  llama" in r.stdout and "Q4_1 x210" in r.stdout and "134.5M" in r.stdout


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    for args in (["info", str(bad)], ["generate", "--model", "nope"]):
        r = _jmem(*args)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr

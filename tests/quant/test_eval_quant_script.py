"""`experiments/eval_quant.py`: bad flags are one `error:` line and exit status 2, before the model loads."""

import pytest

import jmem
from tests.helpers import experiment, refuse_load


@pytest.fixture(scope="module")
def script():
    return experiment("eval_quant")


@pytest.mark.parametrize("argv, expected", [
    (["--text", "/nonexist"], "--text '/nonexist': no such file"),
    (["--windows", "0", "--calibration-windows", "0"], "--windows 0; accepted: a positive integer"),
    (["--windows", "-1"], "--windows -1; accepted: a positive integer"),
    (["--batch", "0"], "--batch 0; accepted: a positive integer"),
    (["--methods", "gptq4", "--calibration-windows", "0"], "--calibration-windows 0; accepted: a positive integer"),
    (["--methods", "rtn4,q9"], "unknown methods ['q9']"),
    (["--group-size", "0"], "--group-size 0; accepted: a positive integer"),
])
def test_bad_flags_before_the_model_loads(script, argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jmem, "load", refuse_load)
    rc = script.cli([*argv, "--out", str(tmp_path / "q.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err
    assert not (tmp_path / "q.json").exists()


def test_empty_text_file(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jmem, "load", refuse_load)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert script.cli(["--text", str(empty), "--out", str(tmp_path / "q.json")]) == 2
    assert "the file is empty" in capsys.readouterr().err


def test_float_only_needs_no_calibration_windows(script, tmp_path):
    """`--calibration-windows 0` is fine when no method calibrates: validation passes (no model is loaded here)."""
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    methods, got = script.validate(script.Config(text=str(text), methods="float,rtn4,q4_k", calibration_windows=0,
                                                 out=str(tmp_path / "q.json")))
    assert methods == ["float", "rtn4", "q4_k"] and got == "hello world\n"


def test_methods_without_calibration_need_no_calibration_text(script, tmp_path):
    """float and int8 on a text of one evaluation window run with the default --calibration-windows (only gptq and
    awq reserve calibration windows)."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 14)  # 630 bytes: one 512-token window
    out = tmp_path / "q.json"
    assert script.cli(["--model", "tiny", "--text", str(text), "--windows", "1", "--batch", "1",
                       "--methods", "float,int8", "--out", str(out)]) == 0
    assert out.exists()

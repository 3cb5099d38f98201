"""Output paths are prepared (or refused in one line) before the work that fills them."""

import pytest

from jmem.io.paths import prepare_output


def test_creates_the_parent_of_a_file_and_a_directory_itself(tmp_path):
    f = prepare_output(tmp_path / "a" / "b" / "out.json", "--out")
    assert f == tmp_path / "a" / "b" / "out.json" and f.parent.is_dir() and not f.exists()
    d = prepare_output(tmp_path / "ck" / "run1", "--ckpt-dir", directory=True)
    assert d.is_dir() and not any(d.iterdir())
    assert prepare_output(tmp_path / "ck" / "run1", "--ckpt-dir", directory=True) == d  # exists: fine


def test_refusals_name_the_flag_and_the_path(tmp_path):
    (tmp_path / "file").write_text("keep")
    with pytest.raises(ValueError, match=r"--out '.*/file/x/out.json': cannot create directory .*"
                                         r"\('.*/file' is a file\); accepted: a writable path"):
        prepare_output(tmp_path / "file" / "x" / "out.json", "--out")
    with pytest.raises(ValueError, match="--ckpt-dir .* cannot create directory .*'.*/file' is a file"):
        prepare_output(tmp_path / "file", "--ckpt-dir", directory=True)
    with pytest.raises(ValueError, match="--log '.*' is a directory; accepted: a file path"):
        prepare_output(tmp_path, "--log")
    assert (tmp_path / "file").read_text() == "keep"

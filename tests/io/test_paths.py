"""Output paths are prepared (or refused in one line) before the work that fills them."""

import pathlib

import pytest

from jmem.io.paths import prepare_output, undo_on_failure
from tests.helpers import locked_elsewhere


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
    with pytest.raises(ValueError, match="--out '.*/res/' is a directory; accepted: a file path"):
        prepare_output(f"{tmp_path}/res/", "--out")  # named a file "res" before, and the write failed at the end
    for directory, kind in ((False, "file"), (True, "directory")):
        with pytest.raises(ValueError, match=f"^--out '' is empty; accepted: a {kind} path$"):
            prepare_output("", "--out", directory=directory)
    assert (tmp_path / "file").read_text() == "keep" and not (tmp_path / "res").exists()


@pytest.mark.skipif(not pathlib.Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_file_that_cannot_be_made_is_refused_before_the_run():
    """Permission bits say yes to root everywhere: a benchmark ran to its end, then failed to write /proc/x.json."""
    with pytest.raises(ValueError, match=r"^--out '/proc/x.json': cannot create the file \(.*\); accepted: a "
                                         r"writable path$"):
        prepare_output("/proc/x.json", "--out")


def test_the_opening_check_leaves_files_and_links_as_they_were(tmp_path):
    """An existing file keeps its content; a link to a file not yet written is accepted (the write creates its
    target) and left dangling; a new path is not left behind."""
    (tmp_path / "kept.json").write_text("keep")
    (tmp_path / "link.json").symlink_to(tmp_path / "real" / "out.json")
    (tmp_path / "real").mkdir()
    for name in ("kept.json", "link.json", "new.json"):
        assert prepare_output(tmp_path / name, "--out") == tmp_path / name
    assert (tmp_path / "kept.json").read_text() == "keep" and not (tmp_path / "real" / "out.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "link.json", "real"]


def test_undo_on_failure_removes_only_what_the_failed_run_created(tmp_path):
    out = tmp_path / "new" / "dir"
    with pytest.raises(KeyError):
        with undo_on_failure(out, "--out", directory=True) as d:
            (d / "sub").mkdir()
            (d / "sub" / "a.bin").write_bytes(b"x")
            (d / "b.json").write_text("{}")
            raise KeyError("late failure")
    assert list(tmp_path.iterdir()) == []  # the directory and the parent made for it are gone
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KeyError):
        with undo_on_failure(empty, "--out", directory=True):
            (empty / "part").write_text("x")
            raise KeyError
    assert empty.is_dir() and not any(empty.iterdir())  # given empty, left empty
    kept = tmp_path / "kept.gguf"
    kept.write_text("old")
    with pytest.raises(KeyError):
        with undo_on_failure(kept, "--out"):
            raise KeyError
    with pytest.raises(KeyError):
        with undo_on_failure(tmp_path / "x" / "new.gguf", "--out") as f:
            f.write_text("partial")
            raise KeyError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "kept.gguf"] and kept.read_text() == "old"
    with undo_on_failure(tmp_path / "ok", "--out", directory=True) as d:
        (d / "done").write_text("1")
    assert (tmp_path / "ok" / "done").read_text() == "1"


def test_a_directory_lock_holds_until_the_last_holder_in_the_process_lets_go(tmp_path, monkeypatch):
    """POSIX record locks belong to the process and go with any of its descriptors: a second checkpointer on
    the same directory, closed, dropped the first one's lock while it still wrote."""
    import errno
    import fcntl

    from jmem.io.paths import lock_directory

    first, second = lock_directory(tmp_path), lock_directory(tmp_path)
    second.release()
    second.release()  # once only
    assert locked_elsewhere(tmp_path)
    first.release()
    assert not locked_elsewhere(tmp_path)

    def no_locks(f, op):  # e.g. NFS without a lock daemon: no lock, not "in use by another process"
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    assert lock_directory(tmp_path) is None

"""Checkpointer: folders jmem did not write are never touched, and restore names what differs."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmem.io.checkpoint import CheckpointMismatchError, Checkpointer, structure_fingerprint

META = {"model": {"dim": 4}, "optimizer": "adamw", "precision": "f32"}


def _foreign_dir(tmp_path):
    d = tmp_path / "ck"
    for n in (1, 2, 5):
        (d / str(n)).mkdir(parents=True)
        (d / str(n) / "f").write_text("user data")
    for item in ("state", "dataset"):  # another program's Orbax step: a `state` item beside its own
        (d / "5" / item).mkdir()
    return d


def test_foreign_numbered_folders_are_refused_and_kept(tmp_path):
    d = _foreign_dir(tmp_path)
    ck = Checkpointer(d, max_to_keep=2)
    assert ck.latest_step() is None and ck.foreign_steps() == [1, 2, 5]
    msg = r"holds numbered folders that are not jmem checkpoints \(1, 2, 5\); choose another --ckpt-dir"
    for resume in (False, True):
        with pytest.raises(CheckpointMismatchError, match=msg):
            ck.check(META, resume=resume)
    with pytest.raises(CheckpointMismatchError, match=msg):
        ck.save(10, {"w": jnp.ones(3)}, META)
    with pytest.raises(CheckpointMismatchError, match="not a jmem checkpoint"):
        ck.read_meta(5)
    ck.close()
    assert sorted(p.name for p in d.iterdir()) == ["1", "2", "5"]
    assert all((d / n / "f").read_text() == "user data" for n in ("1", "2", "5"))


def test_restore_names_the_leaf_and_round_trips_scalars(tmp_path):
    state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(4), "step": 7, "lr": 0.5}
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, state, META)
    assert ck.check({**META, "structure": structure_fingerprint(state)}, resume=True) == 1
    back = ck.restore({"w": jnp.zeros((3, 4)), "b": jnp.zeros(4), "step": 0, "lr": 0.0})
    assert back["step"] == 7 and type(back["step"]) is int and back["lr"] == 0.5 and type(back["lr"]) is float
    np.testing.assert_array_equal(back["w"], state["w"])
    for template, message in [
        ({"w": jnp.zeros((3, 8)), "b": jnp.zeros(4), "step": 0, "lr": 0.0},
         r"w: checkpoint float32\[3, 4\] vs template float32\[3, 8\]"),
        ({"w": jnp.zeros((3, 4), jnp.bfloat16), "b": jnp.zeros(4), "step": 0, "lr": 0.0},
         r"w: checkpoint float32\[3, 4\] vs template bfloat16\[3, 4\]"),
        ({"w": jnp.zeros((3, 4)), "step": 0, "lr": 0.0}, "b is in the checkpoint but not in the template"),
        ({**state, "c": jnp.zeros(2)}, "c is in the template but not in the checkpoint"),
    ]:
        with pytest.raises(CheckpointMismatchError, match=message):
            ck.restore(template)
    ck.close()


def test_check_accepts_its_own_checkpoint_without_a_structure_or_with_tuples(tmp_path):
    """The module docstring's flow: `save` fills in the structure the caller's meta lacks, and a
    tuple comes back from JSON as a list; a new Checkpointer's check still resumes the step."""
    meta = {"model": {"dims": (1, 2)}, "optimizer": "o", "precision": "p"}
    state = {"w": np.ones(3, np.float32)}
    ckpt = Checkpointer(tmp_path)
    assert ckpt.check(meta, resume=True) is None
    ckpt.save(1, state, meta)
    assert Checkpointer(tmp_path).check(meta, resume=True) == 1
    with pytest.raises(CheckpointMismatchError, match=r"model.dims: checkpoint \[1, 2\] vs run \[1, 3\]"):
        Checkpointer(tmp_path).check({**meta, "model": {"dims": (1, 3)}}, resume=True)


@pytest.mark.parametrize("damage", ["state emptied", "array file truncated", "meta not JSON", "manifest removed",
                                    "meta removed"])
def test_damaged_checkpoint_is_one_error_naming_its_step(damage, tmp_path):
    import shutil

    state = {"w": np.arange(20000, dtype=np.float32), "count": np.zeros((), np.int32)}
    Checkpointer(tmp_path).save(2, state, META)
    step = tmp_path / "2"
    if damage == "state emptied":
        for p in (step / "state").iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    elif damage == "array file truncated":
        big = max((p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        with big.open("r+b") as f:
            f.truncate(100)
    elif damage == "manifest removed":
        for p in step.rglob("manifest.ocdbt"):
            p.unlink()
    elif damage == "meta removed":
        shutil.rmtree(step / "meta")
    else:
        (step / "meta" / "metadata").write_text("{bad json")
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=f"checkpoint {step} is damaged or unreadable .*; accepted: "
                                                      f"a complete checkpoint: delete {step} to resume from the "
                                                      f"step before it") as info:
        ckpt.check(META, resume=True)
        ckpt.restore(state)
    assert "bound method" not in str(info.value) and "\n" not in str(info.value), info.value
    if damage == "meta removed":  # not called a folder of another program
        assert "its meta item is missing); accepted" in str(info.value), info.value
    if damage == "manifest removed":  # not followed by TensorStore's spec, cut in the middle
        assert "does not exist); accepted" in str(info.value), info.value


@pytest.mark.parametrize("kwargs, match", [({"max_to_keep": 0}, "max_to_keep=0; accepted: an integer >= 1"),
                                           ({"max_to_keep": 2.0}, "max_to_keep=2.0; accepted: an integer >= 1")])
def test_bad_max_to_keep_is_refused(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        Checkpointer(tmp_path / "ck", **kwargs)


def test_bad_step_or_empty_state_is_refused_before_any_write(tmp_path):
    ck = Checkpointer(tmp_path / "ck", max_to_keep=None)
    with pytest.raises(ValueError, match=r"step=-1; accepted: an integer >= 0"):
        ck.save(-1, {"w": jnp.ones(3)}, META)
    with pytest.raises(ValueError, match=r"holds no arrays; accepted: a pytree with at least one leaf"):
        ck.save(1, {}, META)
    with pytest.raises(ValueError, match=r"leaf .*w.* has no elements \(shape \[0, 3\]\); accepted: arrays with"):
        ck.save(1, {"w": jnp.zeros((0, 3)), "v": jnp.ones(2)}, META)  # "could not be written" before
    for meta in ({**META, "lr": np.float32(1e-3)}, {**META, "lr": float("nan")}):  # refused once the write began
        with pytest.raises(ValueError, match=r"^checkpoint meta is not JSON \(.*\); accepted: a dict of JSON values$"):
            ck.save(1, {"w": jnp.ones(3)}, meta)
    assert ck.latest_step() is None and not (tmp_path / "ck").exists()
    (tmp_path / "file").write_text("keep")
    with pytest.raises(ValueError, match=r"^checkpoint directory '.*file' is a file; accepted: a directory path$"):
        Checkpointer(tmp_path / "file")
    for step in range(5):  # None keeps every step
        ck.save(np.int64(step), {"w": jnp.ones(3)}, META)
    assert ck.latest_step() == 4 and ck._steps()[0] == [0, 1, 2, 3, 4]
    ck.close()


_FAILED_WRITE = """
import resource, signal, sys
import numpy as np
from jmem.io.checkpoint import Checkpointer, CheckpointWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
ck = Checkpointer(sys.argv[1])
ck.save(1, {"w": np.ones(4, np.float32)}, {"model": "m"})
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    ck.save(2, {"w": np.random.default_rng(0).random(1 << 19)}, {"model": "m"})
except CheckpointWriteError as e:
    print("ERROR:", e)
"""


def test_a_failed_write_is_one_error_and_leaves_the_earlier_steps(tmp_path):
    import subprocess
    import sys

    d = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _FAILED_WRITE, str(d)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"ERROR: checkpoint step 2 could not be written to {d} (" in out.stdout
    assert "; the latest complete checkpoint is step 1" in out.stdout
    assert "Traceback" not in out.stderr, out.stderr[-2000:]  # the writer threads' logs are held back
    assert sorted(p.name for p in d.iterdir()) == [".lock", "1"]  # the partial step is removed (the lock is kept)
    ck = Checkpointer(d)
    assert float(ck.restore({"w": np.zeros(4, np.float32)})["w"].sum()) == 4.0
    ck.save(2, {"w": np.zeros(4, np.float32)}, {"model": "m"})  # a later save into the same directory works
    assert ck.latest_step() == 2
    ck.close()


def test_read_only_checkpointer_writes_nothing(tmp_path):
    """`read_only=True` saved a step (and created a missing directory) although it promised not to."""
    from jmem.io.checkpoint import CheckpointWriteError

    d = tmp_path / "ck"
    Checkpointer(d).save(0, {"w": jnp.ones(3)}, META)
    for where in (d, tmp_path / "absent"):
        with pytest.raises(CheckpointWriteError, match=rf"^checkpoint step 1 was not written: {where} was opened "
                                                       r"read_only; accepted: Checkpointer\(directory\) to save$"):
            Checkpointer(where, read_only=True).save(1, {"w": jnp.zeros(3)}, META)
    assert Checkpointer(d).steps() == [0] and not (tmp_path / "absent").exists()
    np.testing.assert_array_equal(Checkpointer(d, read_only=True).restore({"w": jnp.zeros(3)})["w"], np.ones(3))


def test_typed_prng_keys_round_trip(tmp_path):
    """A `jax.random.key` leaf saved, then failed to restore inside numpy's dtype parsing."""
    import jax

    state = {"w": jnp.ones(3), "key": jax.random.key(3), "rbg": jax.random.key(4, impl="rbg")}
    ck = Checkpointer(tmp_path / "ck")
    ck.save(0, state, META)
    for template in (state, jax.eval_shape(lambda: state)):
        back = ck.restore(template)
        for name in ("key", "rbg"):
            assert back[name].dtype == state[name].dtype
            np.testing.assert_array_equal(jax.random.key_data(back[name]), jax.random.key_data(state[name]))
    with pytest.raises(CheckpointMismatchError, match=r"rbg is a key<rbg> \(rbg\) key in the checkpoint, key<urbg> "
                                                      "in the template"):
        ck.restore({**state, "rbg": jax.random.key(0, impl="unsafe_rbg")})
    ck.save(1, {"w": jnp.ones(3), "key": jnp.zeros(2, jnp.uint32), "rbg": jnp.zeros(4, jnp.uint32)}, META)
    with pytest.raises(CheckpointMismatchError, match="key is a PRNG key in the template, not in the checkpoint"):
        ck.restore(state, step=1)


def test_a_directory_another_running_process_writes_is_refused(tmp_path):
    """Two runs on one --ckpt-dir overwrote and pruned each other's steps; the second is refused at `check`
    (and at a first `save`) while the first runs, and the directory is free once it has ended."""
    import subprocess
    import sys

    d = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jmem.io.checkpoint import Checkpointer; "
         "c = Checkpointer(sys.argv[1]); c.save(1, {'w': [1.0]}, {'model': 'm'}); print('held', flush=True); "
         "time.sleep(120)", str(d)], stdout=subprocess.PIPE, text=True)
    msg = f"checkpoint dir {d} is in use by another running process .*; choose another --ckpt-dir"
    try:
        assert holder.stdout.readline().strip() == "held"
        for write in (lambda c: c.check({"model": "m"}, resume=True), lambda c: c.save(2, {"w": jnp.ones(1)}, {})):
            ck = Checkpointer(d)
            with pytest.raises(CheckpointMismatchError, match=msg):
                write(ck)
            ck.close()
        assert Checkpointer(d).steps() == [1]  # nothing written; reading needs no lock
    finally:
        holder.kill()
        holder.wait()
    ck = Checkpointer(d)
    assert ck.check({"model": "m"}, resume=True) == 1
    ck.save(2, {"w": jnp.ones(1)}, {"model": "m"})
    ck.close()


def test_bad_restore_step_read_only_or_meta_is_one_clear_error(tmp_path):
    """`restore(state, True)` passed the step check (True in [1]) and orbax called folder "True" damaged;
    `read_only="no"` opened read-only; `save(step, state, None)` failed inside on None.get."""
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, {"w": jnp.ones(3)}, None)  # None is no metadata
    assert ck.read_meta(1)["step"] == 1
    for step in (True, 1.0, "1", -1):
        with pytest.raises(ValueError, match=rf"^step={step!r}; accepted: an integer >= 0$"):
            ck.restore({"w": jnp.zeros(3)}, step)
        with pytest.raises(ValueError, match=rf"^step={step!r}; accepted: an integer >= 0$"):
            ck.read_meta(step)
    with pytest.raises(ValueError, match=r"^checkpoint meta is a list; accepted: None or a dict of JSON values$"):
        ck.save(2, {"w": jnp.ones(3)}, [1])
    np.testing.assert_array_equal(ck.restore({"w": jnp.zeros(3)}, np.int64(1))["w"], np.ones(3))
    ck.close()
    for kwargs in ({"read_only": "no"}, {"read_only": 0}, {"this_process_only": "yes"}):
        name, value = next(iter(kwargs.items()))
        with pytest.raises(ValueError, match=rf"^{name}={value!r}; accepted: True or False$"):
            Checkpointer(tmp_path / "ck", **kwargs)

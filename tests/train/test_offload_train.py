"""`experiments/train.py --offload-optimizer host|disk --offload-params host`: flags checked before
any work, the memory table shows device, host and disk bytes, and a disk-offloaded run resumed
from its checkpoint repeats the uninterrupted run's losses."""

import io
import json
import shutil

import numpy as np

import pytest

from jmem.train import TrainConfig, train
from tests.helpers import run_train_script

TINY = ["--model", "tiny", "--steps", "3", "--batch", "4", "--seq", "16", "--no-progress", "--eval-batches", "1"]


@pytest.mark.parametrize("flags,words", [
    (["--offload-optimizer", "nvme"], "accepted: none, host, disk"),
    (["--offload-params", "disk"], "accepted: none, host"),
    (["--offload-optimizer", "disk"], "--offload-dir"),
    (["--offload-params", "host"], "needs offload optimizer 'host' or 'disk'"),
    (["--offload-optimizer", "host", "--zero", "3"], "--zero 3 is not supported"),
    (["--offload-optimizer", "disk", "--offload-dir", "D", "--precision", "f16"], "--precision f16"),
    # Refused only at the first checkpoint, after the training, or not at all (live files over a checkpoint's
    # copies of them).
    (["--offload-optimizer", "disk", "--offload-dir", "D", "--ckpt-dir", "D"], "overlap"),
    (["--offload-optimizer", "disk", "--offload-dir", "D/ck/offload_optimizer/2", "--ckpt-dir", "D/ck"], "overlap"),
])
def test_bad_offload_flags_fail_before_any_work(flags, words, capsys, tmp_path):
    flags = [f.replace("D", str(tmp_path / "off"), 1) if f.startswith("D") else f for f in flags]
    rc, err = run_train_script(TINY + flags, capsys)
    assert rc == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1
    assert not (tmp_path / "off").exists()  # nothing written


def test_offloaded_run_prints_device_host_and_disk_bytes(tmp_path):
    out = io.StringIO()
    log = tmp_path / "log.jsonl"
    result = train(TrainConfig(model="tiny", steps=1, batch=4, seq=16, progress=False, eval_batches=1,
                               offload_optimizer="disk", offload_dir=str(tmp_path / "state"),
                               offload_params="host", log=str(log)), out=out)
    text = out.getvalue()
    for row in ("arguments (params, batch)", "host offloaded layer params", "disk optimizer state files",
                "host largest chunk in memory"):
        assert row in text
    assert result.final_step == 1
    event = json.loads(log.read_text().splitlines()[0])
    # The estimate's device rows leave out what is offloaded (they kept the optimizer state and layers).
    est = event["estimate"]
    assert est["optimizer"] == 0 and est["off device"] > 0
    assert est["total"] == sum(v for k, v in est.items() if k not in ("total", "off device", "activations_host"))
    memory = event["offload"]
    # The disk row is the bytes stored in the state files; none of the state is in host memory.
    stored = sum(np.load(f, mmap_mode="r").nbytes for f in (tmp_path / "state").glob("*.npy"))
    assert memory["disk: optimizer state files"] == stored > 0
    assert memory["host: optimizer state + master weights"] == 0
    assert 0 < memory["host: largest chunk in memory"] < stored / 4
    assert memory["host: offloaded layer params"] > memory["device: arguments (params on device, batch)"] / 2
    # The event's (and the plot's) device figures are the table's: the host layers and their gradients,
    # which the CPU backend counts in its argument and output bytes, were device bytes there.
    assert event["argument_bytes"] == memory["device: arguments (params on device, batch)"]
    assert event["output_bytes"] == memory["device: outputs (grads, metrics)"]
    assert event["total_bytes"] == memory["device: total live (device program)"]
    assert result.memory.total_bytes == event["total_bytes"]


def test_disk_row_under_a_per_device_header_says_it_is_the_whole_state(tmp_path):
    """On a mesh the table's header reads "per device"; the state files hold every device's state."""
    out = io.StringIO()
    train(TrainConfig(model="tiny", steps=1, batch=8, seq=16, progress=False, eval_batches=1, mesh="data=-1", zero=1,
                      offload_optimizer="disk", offload_dir=str(tmp_path / "state")), out=out)
    text = out.getvalue()
    assert ", per device of " in text and "disk optimizer state, all devices" in text, text
    # The mesh line's per-device bytes counted the offloaded optimizer state as on the device.
    assert "zero=1; device, host and disk bytes in the table below" in text and "per-device MiB" not in text, text


@pytest.mark.slow
def test_host_offloaded_run_repeats_the_on_device_losses():
    base = TrainConfig(model="tiny", steps=2, batch=4, seq=16, progress=False, eval_batches=1)
    off = train(TrainConfig(**{**base.__dict__, "offload_optimizer": "host", "offload_params": "host"}),
                out=io.StringIO())
    assert off.losses == train(base, out=io.StringIO()).losses


@pytest.mark.slow
def test_disk_offload_resumes_from_its_checkpoint(tmp_path):
    kw = dict(model="tiny", steps=4, batch=4, seq=16, progress=False, eval_batches=1,
              offload_optimizer="disk", offload_dir=str(tmp_path / "state"))
    whole = train(TrainConfig(**kw), out=io.StringIO())
    ck = str(tmp_path / "ckpt")
    kw["offload_dir"] = str(tmp_path / "state2")
    first = train(TrainConfig(**kw, ckpt_dir=ck, stop_after=2), out=io.StringIO())
    assert (tmp_path / "ckpt" / "offload_optimizer" / "2" / "chunks.json").is_file()
    shutil.rmtree(tmp_path / "state2")  # the resumed run must take the state files from the checkpoint
    out = io.StringIO()
    second = train(TrainConfig(**kw, ckpt_dir=ck, resume=True), out=out)
    assert "disk optimizer state files" in out.getvalue()
    assert {**first.losses, **second.losses} == whole.losses
    # An older kept step resumes too (its own optimizer-state files), to the same losses.
    shutil.rmtree(tmp_path / "ckpt" / "4")
    third = train(TrainConfig(**kw, ckpt_dir=ck, resume=True), out=io.StringIO())
    assert {**first.losses, **third.losses} == whole.losses


def test_disk_offload_keeps_a_snapshot_per_kept_checkpoint(tmp_path):
    """Every step the checkpointer keeps has its optimizer-state files, so an older step resumes
    too; a step without them is refused before anything is restored or reported."""
    from jmem.io.checkpoint import Checkpointer

    ck = tmp_path / "ck"
    kw = dict(model="tiny", steps=4, batch=4, seq=16, progress=False, eval_batches=1, ckpt_every=1,
              offload_optimizer="disk", offload_dir=str(tmp_path / "state"), ckpt_dir=str(ck))
    train(TrainConfig(**kw), out=io.StringIO())
    kept = Checkpointer(ck).steps()
    assert kept == [2, 3, 4] and sorted(int(p.name) for p in (ck / "offload_optimizer").iterdir()) == kept
    shutil.rmtree(ck / "4")
    shutil.rmtree(ck / "offload_optimizer" / "3")
    out = io.StringIO()
    from jmem.memory.offload import OffloadError

    with pytest.raises(OffloadError, match=f"^no optimizer-state snapshot in {ck}/offload_optimizer/3 "):
        train(TrainConfig(**{**kw, "steps": 5}, resume=True), out=out)
    assert "resumed" not in out.getvalue()


def test_disk_offload_snapshot_is_written_before_its_checkpoint(tmp_path, monkeypatch):
    """A crash while the optimizer-state files are copied leaves the previous checkpoint the latest,
    with its own copy, so --resume still works."""
    from jmem.io.checkpoint import Checkpointer
    from jmem.memory import disk_offload

    orig = disk_offload.DiskOptimizer.snapshot

    def snapshot(self, target):
        if target.endswith("/2"):
            raise RuntimeError("crash while copying")
        return orig(self, target)

    monkeypatch.setattr(disk_offload.DiskOptimizer, "snapshot", snapshot)
    ck = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="crash while copying"):
        train(TrainConfig(model="tiny", steps=2, batch=4, seq=16, progress=False, eval_batches=1, ckpt_every=1,
                          offload_optimizer="disk", offload_dir=str(tmp_path / "state"), ckpt_dir=str(ck)),
              out=io.StringIO())
    assert Checkpointer(ck).latest_step() == 1 and (ck / "offload_optimizer" / "1" / "chunks.json").is_file()


def test_a_full_disk_under_disk_offload_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    rc, err = run_train_script(["--model", "tiny", "--steps", "2", "--batch", "4", "--seq", "16", "--no-progress",
                                "--offload-optimizer", "disk", "--offload-dir", str(tmp_path / "opt")], capsys)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "cannot write the optimizer state file" in lines[0], err

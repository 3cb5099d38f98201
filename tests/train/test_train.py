"""The training loop and `experiments/train.py`: resume exactness, signals,
checkpoint-dir safety, bad input, and the script end to end."""

import dataclasses
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from jmem.train import TrainConfig, train
from tests.helpers import run_train_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
# One program for every in-process run below, so the step compiles once.
BASE = TrainConfig(model="tiny", steps=10, batch=4, seq=32, lr=1e-2, warmup=2, progress=False, eval_batches=1)


def _files(d: pathlib.Path) -> dict:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}


def test_resume_after_signal_and_stop_equals_uninterrupted(tmp_path):
    ev = dataclasses.replace(BASE, eval_every=5)  # the program of BASE: no new compile
    straight = train(ev, out=io.StringIO())
    assert sorted(straight.losses) == list(range(10))
    ck = dataclasses.replace(ev, ckpt_dir=str(tmp_path / "ck"), ckpt_every=100)

    def sigterm_after_3(rec):
        if rec["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    out = io.StringIO()
    a = train(ck, out=out, on_step=sigterm_after_3)
    assert a.interrupted and a.final_step == 3 and "interrupted at step 3" in out.getvalue()
    out = io.StringIO()
    b = train(dataclasses.replace(ck, resume=True, stop_after=2), out=out)
    assert not b.interrupted and b.final_step == 5 and sorted(b.losses) == [3, 4]
    assert f"stopped at step 5 of 10 (--stop-after 2); checkpoint in {tmp_path / 'ck'}, --resume continues it" \
        in out.getvalue() and "note:" not in out.getvalue()  # same data flags: no note
    c = train(dataclasses.replace(ck, resume=True), out=io.StringIO())
    assert c.final_step == 10 and sorted(c.losses) == [5, 6, 7, 8, 9]
    resumed = {**a.losses, **b.losses, **c.losses}
    np.testing.assert_allclose([resumed[k] for k in range(10)], [straight.losses[k] for k in range(10)],
                               rtol=0, atol=1e-6)
    # The split run logs the evals of the uninterrupted one, also the one where --stop-after ended.
    assert sorted(straight.eval_losses) == [5, 10] and not a.eval_losses
    assert sorted(b.eval_losses) == [5] and sorted(c.eval_losses) == [10]
    np.testing.assert_allclose([b.eval_losses[5], c.eval_losses[10]], [straight.eval_losses[k] for k in (5, 10)],
                               rtol=0, atol=1e-6)
    # The loss goes down on the default text.
    assert np.mean([straight.losses[k] for k in (7, 8, 9)]) < np.mean([straight.losses[k] for k in (0, 1, 2)])


def test_the_log_is_strict_json(tmp_path):
    """A skipped fp16 step's gradient norm was written as NaN or Infinity, which strict JSON parsers refuse."""
    from jmem.train.loop import _Logger

    log = _Logger(str(tmp_path / "log.jsonl"), {"event": "memory", "flops": {"x": float("inf")}})
    log.write({"step": 1, "loss": 1.5, "grad_norm": float("nan"), "finite": False})
    log.close()

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    recs = [json.loads(x, parse_constant=refuse) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert recs == [{"event": "memory", "flops": {"x": None}}, {"step": 1, "loss": 1.5, "grad_norm": None,
                                                                 "finite": False}]


def test_a_resumed_run_continues_only_its_own_log(tmp_path):
    """The log names the run's id (kept in its checkpoints): resuming with another run's log is refused before
    anything is written; it appended one run's steps to another's."""
    short = dataclasses.replace(BASE, steps=2)
    mine, other, ck = tmp_path / "mine.jsonl", tmp_path / "other.jsonl", str(tmp_path / "ck")
    train(dataclasses.replace(short, ckpt_dir=ck, log=str(mine)), out=io.StringIO())
    train(dataclasses.replace(short, log=str(other)), out=io.StringIO())
    before = other.read_text()
    with pytest.raises(ValueError, match=rf"--log '{other}' is the log of run [0-9a-f]+, not of the run of --ckpt-dir"):
        train(dataclasses.replace(short, steps=3, ckpt_dir=ck, resume=True, log=str(other)), out=io.StringIO())
    assert other.read_text() == before
    # A file that is no run's log was rewritten to the run's lines, its own lines dropped.
    notes = tmp_path / "notes.txt"
    notes.write_text('my notes\n{"step": 1, "x": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"^--log '{notes}' is no train run's log \(it has no memory event\); "
                                         "nothing is overwritten"):
        train(dataclasses.replace(short, steps=3, ckpt_dir=ck, resume=True, log=str(notes)), out=io.StringIO())
    assert notes.read_text() == 'my notes\n{"step": 1, "x": 1}\n[1, 2]\n'
    train(dataclasses.replace(short, steps=3, ckpt_dir=ck, resume=True, log=str(mine)), out=io.StringIO())
    recs = [json.loads(line) for line in mine.read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3]
    assert [r["event"] for r in recs if "event" in r] == ["memory"] and recs[0]["run_id"] != json.loads(
        before.splitlines()[0])["run_id"]
    # A checkpoint of an earlier version names no run: its log is not checked, also after a resumed run
    # that died before its next checkpoint (its log then names an id no checkpoint holds).
    for meta in pathlib.Path(ck).rglob("metadata"):
        if meta.parent.name == "meta":
            meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "run_id"}))

    def killed(rec):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(dataclasses.replace(short, steps=5, ckpt_dir=ck, resume=True, log=str(mine)), out=io.StringIO(),
              on_step=killed)
    train(dataclasses.replace(short, steps=5, ckpt_dir=ck, resume=True, log=str(mine)), out=io.StringIO())
    assert [json.loads(line)["step"] for line in mine.read_text().splitlines() if '"loss"' in line] == [1, 2, 3, 4, 5]


def test_resume_names_the_flags_it_changes():
    """A changed --layerwise-schedule or --layerwise-period (which layers train) resumed without a word."""
    from jmem.train.loop import resume_notes

    saved = dataclasses.asdict(dataclasses.replace(BASE, data="a.txt"))
    assert resume_notes(saved, dataclasses.replace(BASE, data="a.txt")) == []
    assert resume_notes(saved, dataclasses.replace(BASE, data="b.txt", seed=BASE.seed + 1)) == [
        "note: --data b.txt (checkpoint: a.txt): the batches differ from an uninterrupted run's",
        f"note: --seed {BASE.seed + 1} (checkpoint: {BASE.seed}): the batches, layer-wise draws and dropout masks "
        "differ from an uninterrupted run's"]
    # The text under a path edited since the checkpoint is noted; the same text at another path is not.
    assert resume_notes(saved, dataclasses.replace(BASE, data="a.txt"), data_changed=True) == [
        "note: --data a.txt (its text changed since the checkpoint): the batches differ from an uninterrupted run's"]
    assert resume_notes(saved, dataclasses.replace(BASE, data="b.txt"), data_changed=False) == []
    assert resume_notes(saved, dataclasses.replace(BASE, data="a.txt", seq=BASE.seq * 2), data_changed=True) == [
        f"note: --seq {BASE.seq * 2} (checkpoint: {BASE.seq}): the batches differ from an uninterrupted run's"]
    other = dataclasses.replace(BASE, data="a.txt", precision="f32", weight_decay=0.5, layerwise_period=3,
                                layerwise_schedule="top-down")
    assert resume_notes(saved, other) == [
        f"note: --precision f32 (checkpoint: {BASE.precision}), --weight-decay 0.5 (checkpoint: {BASE.weight_decay}), "
        f"--layerwise-period 3 (checkpoint: {BASE.layerwise_period}), --layerwise-schedule top-down (checkpoint: "
        f"{BASE.layerwise_schedule}): the updates differ from an uninterrupted run's"]
    assert resume_notes(saved, dataclasses.replace(BASE, data="a.txt", accum=BASE.accum * 2)) == [
        f"note: --accum {BASE.accum * 2} (checkpoint: {BASE.accum}): the updates differ from an uninterrupted run's"]


def test_an_adam8bit_checkpoint_of_the_earlier_moment_format_is_refused(tmp_path):
    """Earlier versions stored 8-bit Adam's second moment as v, now as sqrt(v), in arrays of the same shapes:
    such a checkpoint would resume with wrong moments. Its metadata lacks the format field: refused."""
    import json

    d = tmp_path / "ck"
    cfg = dataclasses.replace(BASE, optimizer="adam8bit", ckpt_dir=str(d))
    train(dataclasses.replace(cfg, stop_after=2), out=io.StringIO())
    meta_file = next((d / "2" / "meta").rglob("metadata"))
    meta = json.loads(meta_file.read_text())
    assert meta.pop("adam8bit_nu") == "sqrt"
    meta_file.write_text(json.dumps(meta))
    before = _files(d)
    with pytest.raises(ValueError, match="holds adam8bit second moments as v .*; this version stores and reads "
                                         r"sqrt\(v\)"):
        train(dataclasses.replace(cfg, resume=True), out=io.StringIO())
    assert _files(d) == before


def test_a_qlora_rtn_checkpoint_of_the_per_channel_base_is_refused_with_its_cause(tmp_path):
    """Earlier versions quantized a --quantize-base rtn base per channel: its checkpoint was refused as "a
    different run (structure ...)", which named no cause. Its metadata lacks the group size."""
    import json

    d = tmp_path / "ck"
    cfg = dataclasses.replace(BASE, lora_rank=2, lora_targets="wq", quantize_base="rtn", ckpt_dir=str(d))
    train(dataclasses.replace(cfg, stop_after=1), out=io.StringIO())
    meta_file = next((d / "1" / "meta").rglob("metadata"))
    meta = json.loads(meta_file.read_text())
    assert meta.pop("base_group_size") == 128
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds a --quantize-base rtn run of an earlier version, whose base was "
                                         "quantized per channel; this version quantizes it in groups of 128 rows"):
        train(dataclasses.replace(cfg, resume=True), out=io.StringIO())


def test_checkpoint_dir_of_another_run_is_refused_untouched(tmp_path):
    d = tmp_path / "ck"
    train(dataclasses.replace(BASE, stop_after=2, ckpt_dir=str(d)), out=io.StringIO())  # same program as BASE
    before = _files(d)
    assert before
    other = dataclasses.replace(BASE, ckpt_dir=str(d), resume=True, precision="f32", optimizer="adamw")
    with pytest.raises(ValueError, match="holds a different run.*optimizer: checkpoint adafactor vs run adamw"):
        train(other, out=io.StringIO())
    with pytest.raises(ValueError, match="already holds step 2; pass --resume"):
        train(dataclasses.replace(BASE, ckpt_dir=str(d)), out=io.StringIO())
    # Settings that shape the optimizer state are named, not hashed.
    with pytest.raises(ValueError, match=r"different train state \(--clip: checkpoint 1.0 vs run 0.0\)"):
        train(dataclasses.replace(BASE, ckpt_dir=str(d), resume=True, clip=0.0), out=io.StringIO())
    # A resume with no steps left is an error naming both steps, not an empty run.
    with pytest.raises(ValueError, match=r"--steps=2 is not beyond the checkpoint's step 2 in .*accepted: --steps > 2, "
                                         "or --steps 2 with --save"):
        train(dataclasses.replace(BASE, ckpt_dir=str(d), resume=True, steps=2), out=io.StringIO())
    assert _files(d) == before


def test_a_finished_runs_checkpoint_is_exported_with_save_at_its_step(tmp_path):
    """--resume --save with --steps at the checkpoint's step writes its model and evaluates it, training
    nothing (it was "nothing to train": a finished run's model could not be written without more steps)."""
    from flax import nnx

    import jmem
    from jmem.io.checkpoint import Checkpointer
    from jmem.train.setup import build

    d = tmp_path / "ck"
    cfg = dataclasses.replace(BASE, steps=2, ckpt_dir=str(d))
    train(cfg, out=io.StringIO())
    out = io.StringIO()
    result = train(dataclasses.replace(cfg, resume=True, save=str(tmp_path / "model")), out=out)
    assert result.losses == {} and result.final_step == 2 and 2 in result.eval_losses
    assert "wrote the trained model to" in out.getvalue() and "final eval loss" in out.getvalue()
    assert "train loss" not in out.getvalue()
    run = build(cfg)
    ckpt = Checkpointer(str(d))
    state = ckpt.restore(run.fns.init_state(run.model), 2)
    ckpt.close()
    want = nnx.state(run.fns.merge(state.params), nnx.Param)
    got = nnx.state(jmem.load(str(tmp_path / "model")).model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_with_another_lora_alpha_is_refused(tmp_path):
    """The saved adapters mean another update under another scale (the structure is the same)."""
    from jmem.io.checkpoint import CheckpointMismatchError, Checkpointer
    from jmem.train.setup import build

    cfg = dataclasses.replace(BASE, optimizer="adamw", lora_rank=4, lora_alpha=16.0, ckpt_dir=str(tmp_path / "ck"))
    run = build(cfg)
    Checkpointer(cfg.ckpt_dir).save(2, run.fns.init_state(run.model), run.meta)
    with pytest.raises(CheckpointMismatchError, match="--lora-alpha: checkpoint 16.0 vs run 32.0"):
        train(dataclasses.replace(cfg, resume=True, lora_alpha=32.0), out=io.StringIO())


def test_resume_may_change_the_routers_capacity_and_loss_weights(tmp_path):
    """They add no state; the checkpoint was refused as "a different run" (model.moe_aux_weight ...)."""
    from jmem.io.checkpoint import Checkpointer
    from jmem.train.setup import build

    cfg = dataclasses.replace(BASE, model="tiny-moe", steps=3, ckpt_dir=str(tmp_path / "ck"))
    run = build(cfg)
    Checkpointer(cfg.ckpt_dir).save(2, run.fns.init_state(run.model), run.meta)
    out = io.StringIO()
    result = train(dataclasses.replace(cfg, resume=True, moe_aux_weight=0.5, moe_capacity_factor=2.0), out=out)
    assert result.final_step == 3
    assert ("note: --moe-capacity-factor 2.0 (checkpoint: None), --moe-aux-weight 0.5 (checkpoint: None): the "
            "updates differ from an uninterrupted run's") in out.getvalue()


@pytest.mark.parametrize("argv, expected", [
    (["--remat", "everything"], "unknown remat policy 'everything'; accepted: none, full"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'; accepted: adamw, adafactor, adam8bit, galore, sgd"),
    (["--accum", "3", "--batch", "4"], "accum=3 does not divide batch=4"),
    (["--precision", "p=f33"], "precision 'p=f33'"),
    (["--model", "no-such-model"], "not a preset"),
    (["--plot", "/"], "--plot '/' is a directory; accepted: a file path"),
    # An empty policy is refused (the model would remat fully while the estimate counted none).
    (["--remat", ""], "unknown remat policy ''; accepted: none, full"),
])
def test_bad_input_is_one_line_exit_2(argv, expected, capsys):
    rc, err = run_train_script(argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_a_text_too_short_for_the_windows_names_data_and_seq(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("hello world")
    rc, err = run_train_script(["--steps", "2", "--batch", "2", "--seq", "32", "--data", str(text)], capsys)
    assert rc == 2 and err.strip() == f"error: --data {str(text)!r} has 13 tokens: too short for two windows of " \
        "--seq 32; accepted: a text of at least 65 tokens, or a smaller --seq", err


@pytest.mark.parametrize("name, expected", [
    ("p.txt", "--plot '{}': matplotlib cannot write '.txt' files; accepted: a file name ending in .eps,"),
    ("p", "--plot '{}': the file name has no extension; accepted: a file name ending in .eps,"),
    ("p.pgf", "--plot '{}': matplotlib cannot write '.pgf' files; accepted: a file name ending in .eps,"),
])
def test_plot_format_matplotlib_cannot_write_is_one_line_before_any_work(name, expected, tmp_path, capsys,
                                                                         monkeypatch):
    """Checked with the flags, not by matplotlib after the last step; no directory is created. (.pgf
    needs a LaTeX program, here absent.)"""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    plot = tmp_path / "p" / name
    rc, err = run_train_script(["--model", "tiny", "--steps", "4", "--seq", "64", "--batch", "4", "--plot", str(plot),
                                "--log", str(tmp_path / "p" / "log.jsonl")], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: " + expected.format(plot)), err
    assert ".png" in lines[0] and ".pdf" in lines[0] and ".txt" not in lines[0].split("accepted:")[1]
    assert list(tmp_path.iterdir()) == []


def test_signal_during_the_final_save_lets_it_finish_then_stops(tmp_path, monkeypatch):
    from jmem.io.checkpoint import Checkpointer

    orig = Checkpointer.save

    def save(self, step, state, meta):
        if step == 3:  # lands while the final checkpoint is written
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(self, step, state, meta)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the default handler (the process would die)")

    monkeypatch.setattr(Checkpointer, "save", save)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        out = io.StringIO()
        r = train(dataclasses.replace(BASE, ckpt_dir=str(tmp_path / "ck"), ckpt_every=100, stop_after=3), out=out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert r.interrupted and r.final_step == 3 and "interrupted at step 3" in out.getvalue()
    assert Checkpointer(tmp_path / "ck").latest_step() == 3


STUCK_STEP = """
import os, sys
from jmem.train import loop
loop.FORCE_EXIT_AFTER_S = 1.0
r, w = os.pipe()
with loop._stop_on_signals() as stop:
    print("ready", flush=True)
    os.read(r, 1)  # a step that never returns to Python (as one waiting on a lost collective)
"""


def test_a_second_signal_ends_a_step_that_never_finishes():
    """The first SIGTERM only asks the loop to stop after the step in flight; when that step never
    ends, a second one still ends the process (status 128 + 15) rather than being ignored."""
    p = subprocess.Popen([sys.executable, "-c", STUCK_STEP], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=2)  # the first one waits for the step
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM and "second SIGTERM: the step in flight did not finish" in out, out


def test_resumed_log_is_cut_back_to_the_checkpoint_step(tmp_path):
    """A run killed between checkpoints logged steps past its last one; the resumed run's log
    reads as one uninterrupted run's: one memory event, each step once."""
    log = tmp_path / "log.jsonl"
    ck = dataclasses.replace(BASE, ckpt_dir=str(tmp_path / "ck"), ckpt_every=2, log=str(log))

    def kill_after_5(rec):
        if rec["step"] == 5:
            raise KeyboardInterrupt  # the process dies: no save after step 4's

    with pytest.raises(KeyboardInterrupt):
        train(ck, out=io.StringIO(), on_step=kill_after_5)
    with log.open("a") as f:
        f.write('{"step": 6, "lo')  # a record cut short by the kill
    train(dataclasses.replace(ck, resume=True), out=io.StringIO())
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r.get("event") for r in recs].count("memory") == 1 and recs[0]["event"] == "memory"
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 11))
    assert [r["step"] for r in recs if "eval_loss" in r] == [10]


def test_a_failed_run_lets_go_of_its_checkpoint_directory(tmp_path):
    """The lock taken at the directory's check stayed held after a refusal (while its traceback lived, as
    in a notebook): another process found the directory in use."""
    from jmem.io.checkpoint import CheckpointMismatchError
    from tests.helpers import locked_elsewhere

    ck = dataclasses.replace(BASE, ckpt_dir=str(tmp_path / "ck"), stop_after=1)
    train(ck, out=io.StringIO())
    with pytest.raises(CheckpointMismatchError, match="pass --resume") as refused:
        train(ck, out=io.StringIO())
    assert refused.value is not None and not locked_elsewhere(tmp_path / "ck")


def test_a_text_edited_since_the_checkpoint_is_noted_on_resume(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    ck = dataclasses.replace(BASE, data=str(text), ckpt_dir=str(tmp_path / "ck"), stop_after=2)
    train(ck, out=io.StringIO())
    moved = tmp_path / "moved.txt"
    moved.write_text(text.read_text())
    out = io.StringIO()
    train(dataclasses.replace(ck, data=str(moved), resume=True, stop_after=4), out=out)
    assert "note:" not in out.getvalue()  # the same tokens at another path
    moved.write_text(text.read_text().upper())
    out = io.StringIO()
    train(dataclasses.replace(ck, data=str(moved), resume=True, stop_after=6), out=out)
    assert (f"note: --data {moved} (its text changed since the checkpoint): the batches differ from an "
            "uninterrupted run's") in out.getvalue()


@pytest.mark.parametrize("flag, sub", [("--ckpt-dir", "ck"), ("--log", "logs/log.jsonl"), ("--plot", "p/loss.png")])
def test_unwritable_output_path_is_one_line_before_any_work(flag, sub, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where a directory would have to be
    rc, err = run_train_script([flag, str(blocker / sub)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"{flag} '{blocker / sub}': cannot create directory" in lines[0], err


def test_script_end_to_end(tmp_path):
    log, plot = tmp_path / "log.jsonl", tmp_path / "loss.png"
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--model", "tiny", "--steps", "3", "--batch", "4",
           "--seq", "32", "--remat", "minimal", "--accum", "2", "--optimizer", "adamw", "--log", str(log),
           "--plot", str(plot), "--ckpt-dir", str(tmp_path / "ck")]
    env = {**os.environ, "JMEM_CACHE": str(tmp_path / "cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "measured  temp" in p.stdout and "estimated total" in p.stdout and "final eval loss" in p.stdout
    assert "Traceback" not in p.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs[0]["event"] == "memory" and recs[0]["temp_bytes"] > 0
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in steps)
    assert plot.stat().st_size > 1000 and (tmp_path / "ck" / "3").is_dir()
    # A second run with the same log, then with the same checkpoint dir, and no --resume: one line, exit 2,
    # nothing overwritten.
    before, logged = _files(tmp_path / "ck"), log.read_text()
    for again, expected in ((cmd, "already holds another run's log"),
                            ([*cmd[:-5], str(tmp_path / "log2.jsonl"), *cmd[-4:]], "already holds step 3; pass --resume")):
        p2 = subprocess.run(again, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert p2.returncode == 2 and "Traceback" not in p2.stderr
        errors = [ln for ln in p2.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and expected in errors[0], p2.stderr
    assert _files(tmp_path / "ck") == before and log.read_text() == logged


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr", [("adamw", 3e-3), ("adafactor", 1e-2), ("adam8bit", 3e-3), ("sgd", 0.3)])
def test_loss_goes_down_for_every_optimizer(optimizer, lr):
    """The issue's target: mean of the last 10 losses below the first 10."""
    cfg = dataclasses.replace(BASE, steps=40, optimizer=optimizer, lr=lr, warmup=5)
    losses = train(cfg, out=io.StringIO()).losses
    first, last = np.mean([losses[k] for k in range(10)]), np.mean([losses[k] for k in range(30, 40)])
    assert last < first, (optimizer, first, last)


@pytest.mark.slow
def test_f16_with_dynamic_loss_scale_and_bf16_params_train(tmp_path):
    """fp16 compute runs with a dynamic loss scale (logged per step); bf16
    params train through the f32 master copy."""
    log = tmp_path / "log.jsonl"
    r = train(dataclasses.replace(BASE, steps=12, precision="f16", log=str(log)), out=io.StringIO())
    recs = [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]
    assert all("loss_scale" in x for x in recs) and recs[0]["loss_scale"] == 2.0**15
    assert np.isfinite([r.losses[k] for k in r.losses if recs[k]["finite"]]).all()
    assert r.skipped_steps == sum(not x["finite"] for x in recs)
    applied = [r.losses[k] for k in sorted(r.losses) if recs[k]["finite"]]
    assert len(applied) >= 6 and np.mean(applied[-3:]) < np.mean(applied[:3])  # the f16 steps train
    p = train(dataclasses.replace(BASE, steps=12, precision="bf16-pure"), out=io.StringIO())
    assert np.mean([p.losses[k] for k in (9, 10, 11)]) < np.mean([p.losses[k] for k in (0, 1, 2)])


@pytest.mark.slow
def test_1f1b_run_prints_the_busiest_stage_matmul_flops():
    cfg = TrainConfig(model="tiny", steps=1, batch=16, seq=32, warmup=0, precision="f32", pipeline_stages=2,
                      microbatches=2, pipeline_schedule="1f1b", remat="none", progress=False, eval_batches=1)
    out = io.StringIO()
    train(cfg, out=out)
    line = [ln for ln in out.getvalue().splitlines() if "matmul GFLOPs" in ln]
    assert len(line) == 1 and "(busiest pipeline stage)" in line[0], out.getvalue()
    gflops = float(line[0].split()[-1])
    # tiny (dim 64, 1 layer of 2 per stage, MLP 128, vocab 259): the last stage's layer and head,
    # forward and backward (3x), on 16 x 32 tokens over data=4.
    per_token = 2 * 64 * (64 + 32 + 32 + 64 + 3 * 128) + 2 * 2 * 32 * 64 + 2 * 64 * 259
    assert abs(gflops * 1e9 - 3 * per_token * 16 * 32 / 4) <= 0.1 * 3 * per_token * 16 * 32 / 4, line


def test_checkpoint_of_a_version_without_a_newer_model_field_resumes(tmp_path):
    """A checkpoint written before a model config field existed matches a run that keeps
    the field's default (which reproduces the older model), and only such a run."""
    from jmem.io.checkpoint import CheckpointMismatchError, Checkpointer
    from jmem.models.config import LlamaConfig
    from jmem.train.checks import validate
    from jmem.train.setup import meta_for, upgrade_meta

    cfg = dataclasses.replace(BASE, ckpt_dir=str(tmp_path / "ck"))
    policy = validate(cfg)
    state = {"w": np.zeros((2, 3), np.float32)}
    meta = meta_for(cfg, LlamaConfig.tiny(), policy, state)
    assert meta["model"]["rope_dim"] == 0
    older = {**meta, "model": {k: v for k, v in meta["model"].items() if k != "rope_dim"}}
    ckpt = Checkpointer(cfg.ckpt_dir)
    ckpt.save(3, state, older)
    with pytest.raises(CheckpointMismatchError, match="model.rope_dim: checkpoint null vs run 0"):
        ckpt.check(meta, resume=True)  # compared as written
    assert ckpt.check(meta, resume=True, upgrade=upgrade_meta) == 3
    other = meta_for(cfg, LlamaConfig.tiny(rope_dim=8), policy, state)
    with pytest.raises(CheckpointMismatchError, match="model.rope_dim: checkpoint 0 vs run 8"):
        ckpt.check(other, resume=True, upgrade=upgrade_meta)
    # Fields an older version recorded and this one does not (the router's loss weights and capacity, which
    # add no state) are dropped: such a checkpoint was refused as another run.
    recorded = {"moe_capacity_factor": 1.25, "moe_dropless": False, "moe_aux_weight": 0.01, "moe_z_weight": 1e-3}
    assert not set(recorded) & set(meta["model"])
    ckpt.save(4, state, {**meta, "model": {**meta["model"], **recorded}})
    assert ckpt.check(meta, resume=True, upgrade=upgrade_meta) == 4


def test_layerwise_run_resumes_with_the_same_layer_draws(tmp_path):
    """`--layerwise`: the loop runs `make_layerwise_fns`' step; a resumed run draws the same
    layers and resets the same optimizer state, so its losses equal an uninterrupted run's;
    a resume with another --layerwise is refused by name."""
    lw = dataclasses.replace(BASE, steps=6, layerwise=1, layerwise_period=2)
    straight = train(lw, out=io.StringIO())
    ck = dataclasses.replace(lw, ckpt_dir=str(tmp_path / "ck"))
    a = train(dataclasses.replace(ck, stop_after=3), out=io.StringIO())
    b = train(dataclasses.replace(ck, resume=True), out=io.StringIO())
    resumed = {**a.losses, **b.losses}
    np.testing.assert_allclose([resumed[k] for k in range(6)], [straight.losses[k] for k in range(6)],
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"--layerwise: checkpoint 1 vs run 2"):
        train(dataclasses.replace(ck, resume=True, steps=8, layerwise=2), out=io.StringIO())


def test_galore_run_trains_and_its_memory_table_estimates_the_rank():
    """`--optimizer galore --galore-rank 4`: the loss goes down, and the memory table's analytic
    optimizer row is the rank-4 state the step holds (the compiler's argument bytes hold it)."""
    from jmem.optim.galore import galore, galore_plan
    from jmem.train.setup import build

    cfg = dataclasses.replace(BASE, steps=12, optimizer="galore", galore_rank=4, galore_gap=5)
    out = io.StringIO()
    result = train(cfg, out=out)
    losses = [result.losses[k] for k in range(12)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    run = build(cfg)
    params = run.fns.init_state(run.model).params
    state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize
                      for x in jax.tree.leaves(jax.eval_shape(galore(1e-3, rank=4).init, params)))
    row = next(line for line in out.getvalue().splitlines() if "estimated optimizer" in line)
    assert abs(float(row.split()[-1]) - state_bytes / 2**20) < 0.006
    # The run says how many leaves the rank projects (a rank above every matrix's side projects none: plain Adam).
    projected = sum(p.side is not None for p in galore_plan(params, 4)[0])
    assert 0 < projected < len(jax.tree.leaves(params))
    assert f"galore: {projected} of {len(jax.tree.leaves(params))} leaves projected at rank 4" in out.getvalue()


def test_lora_under_a_bf16_policy_keeps_no_master_copy_of_its_f32_adapters():
    """The adapters are f32 whatever the policy: an f32 master copy of them only repeated them, and the table's
    estimate follows the state."""
    from jmem.memory.precision import MasterWeightsState
    from jmem.train.report import estimate_bytes
    from jmem.train.setup import build

    for lora_rank, master in ((4, False), (0, True)):
        run = build(dataclasses.replace(BASE, lora_rank=lora_rank, precision="bf16-pure", optimizer="adamw"))
        state = run.fns.init_state(run.model)
        kinds = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
        assert any(isinstance(x, MasterWeightsState) for x in kinds) == master
        opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
        assert abs(estimate_bytes(run)["optimizer"] - opt_bytes) <= 64, (estimate_bytes(run), opt_bytes)


def test_a_step_that_does_not_fit_is_one_line_exit_2(monkeypatch, capsys):
    """A device that reports its size, or a CPU machine's memory, refuses a step the compiler measured
    larger, before running it; a step that runs out of memory all the same ends with one line naming
    the measured need, not a traceback."""
    from jmem.train import loop

    tiny = ["--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "32", "--no-progress"]
    with monkeypatch.context() as m:
        m.setattr(loop, "memory_limit", lambda: (2**20, "the device holds"))
        rc, err = run_train_script(tiny, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "per device (compiler-measured, the memory table above) and the device holds 1 MiB" in lines[0]
    # Advice the run already follows is left out: remat is full by default.
    assert "--remat full" not in lines[0] and "--accum, " in lines[0] and "--offload-optimizer host" in lines[0]
    huge = tiny[:-3] + ["--seq", "100000", "--no-progress"]  # a 100k-token sequence: terabytes
    rc, err = run_train_script(huge, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "per device (compiler-measured, the memory table above) and this machine has " in lines[0]
    with monkeypatch.context() as m:  # a limit the allocator does not keep to
        m.setattr(loop, "memory_limit", lambda: (2**62, "the device holds"))
        rc, err = run_train_script(huge, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "and step 1 ran out of memory; accepted: settings that fit, e.g. a smaller --batch or --seq" in lines[0]
    assert "--zero 3 with a --mesh over more devices" in lines[0]
    # A run at ZeRO-3 already shards all it can over its devices (--zero was offered there too).
    at_zero3 = loop._out_of_memory(types.SimpleNamespace(total_bytes=2**30), "x", TrainConfig(mesh="data=8", zero=3))
    assert "--zero" not in at_zero3 and "a --mesh over more devices" in at_zero3


def test_moe_flags_make_and_shape_the_experts(tmp_path):
    """--moe-experts builds a preset's experts; --moe-top-k, --moe-dropless and the loss weights reach the model."""
    from jmem.models.config import LlamaConfig
    from jmem.train.checks import preset_config, validate

    cfg = dataclasses.replace(BASE, steps=2, moe_experts=4, moe_top_k=1, moe_dropless=True, moe_aux_weight=0.05,
                              log=str(tmp_path / "log.jsonl"))
    validate(cfg)
    mc = preset_config(cfg)
    assert (mc.moe_experts, mc.moe_top_k, mc.moe_dropless, mc.moe_aux_weight) == (4, 1, True, 0.05)
    assert mc.moe_capacity_factor == LlamaConfig().moe_capacity_factor  # unset: the model's own
    train(cfg, out=io.StringIO())
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "moe_aux_loss" in r]
    assert len(steps) == 2 and all(r["moe_dropped"] == 0 for r in steps)  # dropless: nothing dropped
    with pytest.raises(ValueError, match="--moe-experts 4 would replace the trained MLP of --model smollm2-135m"):
        validate(dataclasses.replace(BASE, model="smollm2-135m", moe_experts=4))
    for n in (0, -2):  # 0 said the MLP of tiny-moe is dense, -2 that 0 (dense) is accepted
        with pytest.raises(ValueError, match=rf"^--moe-experts {n}; accepted: an integer >= 1"):
            validate(dataclasses.replace(BASE, model="tiny-moe", moe_experts=n))


def test_a_capacity_factor_for_a_model_that_routes_dropless_is_refused():
    """A GGUF MoE routes dropless (as llama.cpp): --moe-capacity-factor was accepted and ignored."""
    from jmem.models.config import LlamaConfig
    from jmem.train.checks import check_moe_flags

    cfg = dataclasses.replace(BASE, model="mixtral.gguf", moe_capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"--moe-capacity-factor 1.0 with --model mixtral.gguf, which routes dropless "
                                         r"\(its config has no capacity\), does nothing"):
        check_moe_flags(cfg, LlamaConfig.tiny_moe(moe_dropless=True))
    check_moe_flags(cfg, LlamaConfig.tiny_moe())  # a capacity-routed model takes it


def test_a_loss_that_turns_nan_stops_the_run_before_its_checkpoint(tmp_path, capsys):
    """The run went on to its end with NaN losses, its NaN checkpoints rotated the good ones out and --save
    wrote a NaN model, exit 0; now the first non-finite step stops it (exit 1, one line) before any write."""
    from jmem.train.loop import TrainingDiverged

    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cfg = dataclasses.replace(BASE, optimizer="sgd", clip=0.0, warmup=0, ckpt_dir=str(ck), ckpt_every=1, steps=6,
                              lr=1e-2, log=str(log))
    train(cfg)
    diverging = dataclasses.replace(cfg, steps=12, lr=1e30, resume=True, save=str(tmp_path / "model"))
    with pytest.raises(TrainingDiverged, match=r"^step (\d+): the loss is nan .*; the run stops; the latest checkpoint "
                                               r"is step (\d+); accepted: a lower --lr") as e:
        train(diverging, out=io.StringIO())
    failed = int(str(e.value).split(":")[0].split()[1])
    steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert steps[-1] == failed - 1 and not (tmp_path / "model").exists()  # nothing of the NaN state written
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["step"] == failed and records[-1]["finite"] is False
    rc, err = run_train_script(["--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--optimizer", "sgd",
                                "--clip", "0", "--warmup", "0", "--lr", "1e30", "--no-progress"], capsys)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: step 2: the loss is nan"), err


def test_fp16_stops_when_the_loss_scale_has_nothing_left_to_back_off():
    """Every step after the scale reached its minimum was skipped without a word (exit 0)."""
    from jmem.train.loop import TrainingDiverged

    cfg = dataclasses.replace(BASE, precision="f16", optimizer="sgd", clip=0.0, warmup=0, lr=1e6, steps=40)
    with pytest.raises(TrainingDiverged, match=r"^step \d+: the loss is .* at the smallest loss scale 1; the run "
                                               "stops; no checkpoint was written"):
        train(cfg, out=io.StringIO())


def test_weights_that_overflowed_are_not_checkpointed(tmp_path):
    import jax.numpy as jnp

    from jmem.io.checkpoint import Checkpointer
    from jmem.train.loop import TrainingDiverged, _check_weights_finite

    ck = Checkpointer(tmp_path / "ck")
    _check_weights_finite(3, {"w": jnp.ones(4), "ids": jnp.zeros(2, jnp.int32)}, ck)
    with pytest.raises(TrainingDiverged, match=r"^step 3: the weights hold NaN or inf; the run stops without writing"):
        _check_weights_finite(3, {"w": jnp.array([1.0, jnp.inf])}, ck)


def test_a_log_that_cannot_be_written_is_one_error_naming_what_is_kept(tmp_path, monkeypatch):
    """A full disk under --log was an OSError traceback (and a .tmp file left behind at the start)."""
    import errno

    from jmem.train.loop import LogWriteError, _Logger

    log = _Logger(str(tmp_path / "log.jsonl"), {"event": "memory"}, where=lambda: "; the latest checkpoint is step 4")

    def full(_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log.f, "write", full)
    with pytest.raises(LogWriteError, match=r"^--log '.*log.jsonl' could not be written \(No space left on device\); "
                                            "the latest checkpoint is step 4$"):
        log.write({"step": 5})
    monkeypatch.setattr("builtins.open", lambda *a, **k: full(None))
    with pytest.raises(LogWriteError, match="could not be written"):
        _Logger(str(tmp_path / "new.jsonl"), {"event": "memory"})
    assert not (tmp_path / "new.jsonl.tmp").exists()

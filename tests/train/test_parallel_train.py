"""`experiments/train.py` on a device mesh: ZeRO-3 end to end, pipeline stages,
an MoE model, bad mesh flags, and `memory_sweep.py --mesh/--zero` records."""

import dataclasses
import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.train import TrainConfig, train
from tests.helpers import experiment, run_train_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
# f32 so the sharded runs can be compared with one device at a tight tolerance.
REF = TrainConfig(model="tiny", steps=3, batch=8, seq=32, lr=1e-2, warmup=0, precision="f32", progress=False,
                  eval_batches=1)


@pytest.fixture(scope="module")
def single_device_losses():
    result = train(REF, out=io.StringIO())
    return np.array([result.losses[k] for k in range(3)])


def test_script_mesh_zero3_matches_one_device(tmp_path, single_device_losses):
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--model", "tiny", "--steps", "3", "--batch", "8",
           "--seq", "32", "--lr", "1e-2", "--warmup", "0", "--precision", "f32", "--eval-batches", "1",
           "--mesh", "data=2,fsdp=2,tensor=2", "--zero", "3", "--no-progress", "--log", str(log)]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mesh data=2,fsdp=2,tensor=2" in p.stdout and "zero=3" in p.stdout and "final eval loss" in p.stdout
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in steps], single_device_losses, rtol=1e-5)


def test_pipeline_stages_match_one_device(single_device_losses, tmp_path):
    cfg = dataclasses.replace(REF, pipeline_stages=2, microbatches=2, mesh="stage=2,data=4", zero=1,
                              log=str(tmp_path / "log.jsonl"))
    out = io.StringIO()
    result = train(cfg, out=out)
    assert "pipeline 2 stages x 2 microbatches" in out.getvalue()
    np.testing.assert_allclose([result.losses[k] for k in range(3)], single_device_losses, rtol=1e-5)
    # memory_sweep compiles the step train.py runs (it held the whole layer stack on every device).
    from jmem.models.config import PRESETS
    from jmem.train.sweep import compile_record

    [memory] = [r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())
                if r.get("event") == "memory"]
    # Given without its stage axis, the mesh is train.py's all the same (the sweep refused it).
    record = compile_record(PRESETS["tiny"](), batch=cfg.batch, seq=cfg.seq, remat=cfg.remat, precision=cfg.precision,
                            accum=cfg.accum, optimizer=cfg.optimizer, mesh="data=4", zero=cfg.zero,
                            pipeline_stages=2, microbatches=2, schedule=cfg.pipeline_schedule)
    assert record["mesh"] == "stage=2,data=4"
    for key in ("argument_bytes", "temp_bytes", "total_bytes"):
        assert record[key] == memory[key], key


def test_eval_runs_in_the_train_microbatches_split_over_the_data_axes(monkeypatch):
    """Each eval batch ran whole (--batch windows, not the --batch / --accum the run was sized for) and on a
    mesh whole on every device; the loss is the one-device loss."""
    from jax.sharding import PartitionSpec as P

    from jmem.train import loop

    seen, real = [], loop._jitted_eval

    def spy(fns):
        f = real(fns)

        def call(params, b):
            seen.append((b["inputs"].shape, getattr(getattr(b["inputs"], "sharding", None), "spec", None)))
            return f(params, b)
        return call

    monkeypatch.setattr(loop, "_jitted_eval", spy)
    cfg = dataclasses.replace(REF, steps=1, accum=2, eval_batches=2)
    meshed = train(dataclasses.replace(cfg, mesh="data=4,tensor=2"), out=io.StringIO())
    assert seen == [((4, 32), P("data"))] * 4
    one = train(cfg, out=io.StringIO())
    assert seen[4:] == [((4, 32), None)] * 4
    np.testing.assert_allclose(meshed.eval_losses[1], one.eval_losses[1], rtol=1e-5)



@pytest.mark.parametrize("argv, expected", [
    (["--zero", "4"], "zero=4 is not a ZeRO stage; accepted: 0, 1, 2, 3"),
    (["--mesh", "data=3"], "mesh data=3 needs 3 devices but there are 8"),
    (["--mesh", "data=2,model=4"], "unknown mesh axis 'model'; accepted: stage, data, fsdp, expert, tensor"),
    (["--rules", "embed=gpu"], "gpu"),
    (["--mesh", "data=8", "--batch", "4"], "--batch=4 must be divisible by the data-parallel size 8"),
    (["--pipeline-stages", "3"], "--pipeline-stages=3 must divide the 2 layers"),
    (["--coordinator", "localhost:1234"], "needs num_processes, process_id as well"),
])
def test_bad_mesh_flags_are_one_line_exit_2(argv, expected, capsys):
    rc, err = run_train_script(["--model", "tiny"] + argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_tiny_moe_trains_and_logs_router_losses(tmp_path):
    cfg = dataclasses.replace(REF, model="tiny-moe", steps=8, batch=4, log=str(tmp_path / "log.jsonl"))
    result = train(cfg, out=io.StringIO())
    losses = [result.losses[k] for k in range(8)]
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])
    steps = [r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "loss" in r]
    for r in steps:
        # Balancing loss is 1 at uniform load, at most n_experts; z-loss is >= 0.
        assert 0 < r["moe_aux_loss"] <= 4.0 and r["moe_z_loss"] >= 0 and r["moe_dropped"] >= 0
    assert any(r["moe_dropped"] > 0 for r in steps)  # capacity 1.25 drops some of a skewed router's tokens


@pytest.mark.slow
def test_tiny_moe_on_an_expert_mesh_matches_one_device():
    cfg = dataclasses.replace(REF, model="tiny-moe", steps=2, batch=4)
    ref = train(cfg, out=io.StringIO())
    got = train(dataclasses.replace(cfg, mesh="data=2,expert=2,tensor=2", zero=3), out=io.StringIO())
    np.testing.assert_allclose([got.losses[k] for k in range(2)], [ref.losses[k] for k in range(2)], rtol=1e-5)


def test_memory_sweep_mesh_and_zero_lists_write_per_device_bytes(tmp_path, capsys):
    memory_sweep = experiment("memory_sweep")
    out, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    rc = memory_sweep.main(["--preset", "tiny", "--batch", "8", "--seq", "32", "--remat", "full", "--precision",
                            "f32", "--accum", "1", "--optimizer", "adamw", "--mesh", "data=8", "--zero", "0,3",
                            "--out", str(out), "--md", str(md), "--png", str(png)])
    assert rc == 0, capsys.readouterr().err
    z0, z3 = json.loads(out.read_text())
    assert (z0["mesh"], z0["zero"], z3["mesh"], z3["zero"]) == ("data=8", 0, "data=8", 3)
    # Stage 0 keeps every tree whole; stage 3 divides all three by the 8 data-parallel devices
    # (up to the optimizer's replicated scalars).
    assert z0["param_bytes_per_device"] == z0["grad_bytes_per_device"] == z0["param_bytes"]
    assert z0["opt_bytes_per_device"] == z0["opt_state_bytes"]
    for k in ("param_bytes_per_device", "grad_bytes_per_device", "opt_bytes_per_device"):
        assert z3[k] == pytest.approx(z0[k] / 8, rel=0.01), k
    assert z3["argument_bytes"] < z0["argument_bytes"] / 4
    assert "| data=8 | 3 | - | full | f32 | 1 | adamw |" in md.read_text()


def test_memory_sweep_zero_without_a_mesh_compiles_train_py_mesh(tmp_path, capsys):
    """--zero > 0 without --mesh: all devices on 'data', as train.py runs it (the sweep refused it)."""
    memory_sweep = experiment("memory_sweep")
    out = tmp_path / "s.json"
    rc = memory_sweep.main(["--preset", "tiny", "--batch", "8", "--seq", "32", "--remat", "full", "--precision",
                            "f32", "--accum", "1", "--optimizer", "adamw", "--zero", "0,1", "--out", str(out),
                            "--md", str(tmp_path / "s.md"), "--png", str(tmp_path / "s.png")])
    assert rc == 0, capsys.readouterr().err
    one, z1 = json.loads(out.read_text())
    assert (one["mesh"], z1["mesh"], z1["zero"]) == (None, "data=8", 1)
    assert z1["opt_bytes_per_device"] == pytest.approx(one["opt_bytes_per_device"] / 8, rel=0.01)


TWO_PROCESS_BASE = [sys.executable, str(ROOT / "experiments" / "train.py"), "--model", "tiny", "--steps", "3",
                    "--batch", "8", "--seq", "32", "--lr", "1e-2", "--warmup", "0", "--precision", "f32",
                    "--eval-batches", "1", "--mesh", "fsdp=-1", "--zero", "3", "--no-progress"]


def _device_env(n):
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def _two_processes(per_process) -> tuple[list[int], list[str]]:
    """Run train.py as 2 processes x 2 CPU devices (gloo); `per_process(i)` are process i's extra flags."""
    from tests.helpers import free_port

    port = free_port()  # each process names process 0's host its own way: not a difference between them
    hosts = ("127.0.0.1", "localhost")
    procs = [subprocess.Popen(TWO_PROCESS_BASE + [*per_process(i), "--coordinator", f"{hosts[i]}:{port}",
                                                  "--num-processes", "2", "--process-id", str(i)],
                              env=_device_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


@pytest.mark.slow
def test_script_two_processes_zero3_match_one_process(tmp_path):
    """`--coordinator/--num-processes/--process-id`: 2 CPU processes x 2 devices (gloo) train
    like one process with 4 devices and the same global batch; process 0 alone writes --log, and
    --save's model (gathered from both processes' shards) equals the one-process run's."""
    codes, outs = _two_processes(lambda i: ["--log", str(tmp_path / f"p{i}.jsonl"), "--save", str(tmp_path / "two")])
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    one = subprocess.run(TWO_PROCESS_BASE + ["--log", str(tmp_path / "one.jsonl"), "--save", str(tmp_path / "one")],
                         env=_device_env(4), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    saved = [nnx.to_pure_dict(nnx.state(jmem.load(str(tmp_path / d)).model, nnx.Param)) for d in ("two", "one")]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *saved)
    assert f"wrote the trained model to {tmp_path / 'two'}" in outs[0] and "wrote the trained model" not in outs[1]

    def losses(name):
        return [r["loss"] for r in map(json.loads, (tmp_path / name).read_text().splitlines()) if "loss" in r]

    ref = losses("one.jsonl")
    assert len(ref) == 3 and "mesh fsdp=4 (2 process(es))" in outs[0]
    np.testing.assert_allclose(losses("p0.jsonl"), ref, rtol=1e-5)
    assert not (tmp_path / "p1.jsonl").exists()


@pytest.mark.slow
def test_script_two_processes_on_different_flags_stop_with_one_error():
    """Processes started with different flags (here --seed) would train on different batches, or wait
    on each other forever (--zero): each stops before its first step with one error naming the flag."""
    codes, outs = _two_processes(lambda i: ["--seed", str(i)])
    assert codes == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    for i, out in enumerate(outs):
        assert f"error: flags differ between processes: --seed; accepted: the same on every process (this is " \
               f"process {i}: --seed {i})" in out, out[-3000:]


@pytest.mark.slow
def test_two_processes_on_a_checkpoint_dir_in_use_both_stop_with_one_error(tmp_path):
    """A --ckpt-dir locked by another running job: process 0 is refused the lock, and process 1
    stops with the same error at once (it would otherwise wait on process 0's collectives)."""
    from jmem.io.paths import lock_directory

    ck = tmp_path / "ck"
    ck.mkdir()
    held = lock_directory(ck)  # the other job
    try:
        codes, outs = _two_processes(lambda i: ["--ckpt-dir", str(ck)])
    finally:
        held.release()
    assert codes == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    for out in outs:
        assert f"checkpoint dir {ck} is in use by another running process" in out, out[-3000:]
        assert "Traceback" not in out


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_after_the_same_step(tmp_path):
    """SIGTERM reaching process 1 alone: both processes save one checkpoint of the same step and
    stop (one stopping alone would leave the other waiting on its collectives)."""
    import signal
    import time

    from jmem.io.checkpoint import Checkpointer
    from tests.helpers import free_port

    coord, log = f"127.0.0.1:{free_port()}", tmp_path / "log.jsonl"
    args = TWO_PROCESS_BASE + ["--steps", "5000"]  # the last --steps wins: still running when signalled
    procs = [subprocess.Popen(args + ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "10000", "--log", str(log),
                                      "--coordinator", coord, "--num-processes", "2", "--process-id", str(i)],
                              env=_device_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and (not log.exists() or log.read_text().count('"loss"') < 3):
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    steps = [int(o.split("interrupted at step ")[1].split(";")[0]) for o in outs if "interrupted at step " in o]
    assert len(steps) == 2 and steps[0] == steps[1], outs[0][-2000:] + outs[1][-2000:]
    assert Checkpointer(tmp_path / "ck").latest_step() == steps[0]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_killed_mid_run_stops_the_other_with_one_line(tmp_path, victim):
    """SIGKILL of one process: the other ends with one error line and exit status 1, instead of printing a
    traceback and waiting about 70 s in JAX's shutdown barrier for the dead peer. JAX's runtime may end it
    first with its own message: at once when the dead one is process 0, which runs the coordination service,
    else when the service misses the dead one's heartbeats (--heartbeat-timeout, here 10 s; seen in about 1 run
    of 6)."""
    import signal
    import time

    from tests.helpers import free_port

    coord, log = f"127.0.0.1:{free_port()}", tmp_path / "log.jsonl"
    args = TWO_PROCESS_BASE + ["--steps", "5000", "--log", str(log), "--heartbeat-timeout", "10"]
    procs = [subprocess.Popen(args + ["--coordinator", coord, "--num-processes", "2", "--process-id", str(i)],
                              env=_device_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    survivor = procs[1 - victim]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and (not log.exists() or log.read_text().count('"loss"') < 3):
            time.sleep(0.5)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = survivor.communicate(timeout=200)
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if "Terminating process because the JAX distributed service detected fatal errors" in err:
        assert survivor.returncode != 0 and waited < 60, (waited, err[-3000:])
        return
    assert waited < 60, waited
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert survivor.returncode == 1 and len(errors) == 1, err[-3000:]
    assert f"error: process {1 - victim}: step " in errors[0] and "start them all again with --resume" in errors[0]

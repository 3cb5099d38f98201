"""Two local CPU processes (2 devices each, gloo collectives) train with ZeRO-3 like one process."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import free_port

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
STEPS = 3


def _env(n_devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"worker printed no result:\n{out[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.slow
def test_two_processes_match_one_process():
    coord = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), coord, "2", str(i), str(STEPS)], env=_env(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    single = subprocess.run([sys.executable, str(WORKER), "-", "1", "0", str(STEPS)], env=_env(4),
                            capture_output=True, text=True, timeout=400)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [_result(o) for o in outs]
    for r in results:
        if "skip" in r:
            pytest.skip(r["skip"])
    ref = _result(single.stdout + single.stderr)
    assert ref["devices"] == 4 and all(r["devices"] == 4 for r in results)
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]

"""Worker for test_multihost.py: train the tiny model a few steps with ZeRO-3 on a `fsdp` mesh.

Run as `python multihost_worker.py COORD NPROC PID STEPS` (COORD '-' for a single process);
prints one JSON line {"losses": [...], "devices": N, "process": I}.
"""

import json
import os
import sys


def main():
    coord, nproc, pid, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from jmem import parallel as par
    from jmem.models import Llama, LlamaConfig
    from jmem.parallel.distributed import local_value

    if coord != "-":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception as e:  # noqa: BLE001 - reported to the test as a skip
            print(json.dumps({"skip": f"gloo collectives unavailable: {e}"}), flush=True)
            return
        par.initialize(coord, nproc, pid, initialization_timeout=120)
    cfg = LlamaConfig.tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    loss_fn, params = par.model_loss_fn(model)
    mesh = par.make_mesh("fsdp=-1")
    trainer = par.make_sharded_train_step(loss_fn, optax.adam(1e-2), params, mesh, zero=3)
    state = trainer.init(params)
    rng = np.random.default_rng(0)
    B, T = 8, 16
    losses = []
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for i in range(steps):
        ids = ((rng.integers(0, cfg.vocab_size, (B, 1)) + np.arange(T + 1)) % cfg.vocab_size).astype(np.int32)
        batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((B, T), np.float32)}
        if i == 1:  # a batch already global, on another sharding than the step's: resharded
            batch = par.to_global(batch, {k: replicated for k in batch})
        state, metrics = trainer.step(state, batch)
        losses.append(float(local_value(metrics["loss"])))
    print(json.dumps({"losses": losses, "devices": jax.device_count(), "process": jax.process_index()}), flush=True)


if __name__ == "__main__":
    main()

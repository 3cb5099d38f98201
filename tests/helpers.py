"""Shared test fixtures' building blocks."""

import functools
import importlib.util
import pathlib
import socket
import sys

import pytest


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=1)
def smollm2():
    """The real SmolLM2-135M (float32), loaded once per test session; skips when not installed."""
    import jmem
    from jmem.lm import packaged_model_path

    try:
        packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return jmem.load("smollm2-135m")


def refuse_load(*args, **kwargs):
    """Stands in for `jmem.load` in tests of flag checks that must fail before any model loads."""
    raise AssertionError("the model was loaded before the flags were checked")


def experiment(name: str):
    """The module of `experiments/{name}.py`, imported once per test session (as `experiments_{name}`)."""
    key = f"experiments_{name}"
    if key not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[key]


def run_train_script(argv, capsys):
    """`experiments/train.py`'s main(argv) in this process: (exit status, stderr)."""
    rc = experiment("train").main(argv)
    return rc, capsys.readouterr().err


def counting_batches(vocab_size: int, steps: int, batch: int, seq: int, seed: int):
    """`steps` batches of counting sequences from random starts: learnable, so a loss falls in a few steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = ((rng.integers(0, vocab_size, (batch, 1)) + np.arange(seq + 1)) % vocab_size).astype(np.int32)
        out.append({"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": np.ones((batch, seq), np.float32)})
    return out


def train_sharded(loss_fn, params, mesh, batches, tx=None, **kw):
    """Steps of `jmem.parallel.make_sharded_train_step` with `tx` (default Adam) over `batches`:
    (losses, compiled HLO text, trainer with its `compiled` step, final state)."""
    import numpy as np
    import optax

    from jmem import parallel as par

    trainer = par.make_sharded_train_step(loss_fn, optax.adam(1e-2) if tx is None else tx, params, mesh, **kw)
    state = trainer.init(params)
    trainer.compiled = trainer.compile(state, batches[0])
    losses = []
    for b in batches:
        state, m = trainer.step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), trainer.compiled.as_text(), trainer, state


@functools.lru_cache(maxsize=1)
def _jitted_forward():
    # One jitted forward: models with equal graphdefs and state structure (an in-memory model and
    # what jmem.load builds from its file) share one compile.
    import jax

    from jmem.models import forward

    return jax.jit(forward, static_argnums=0)


def logits_of(model, ids):
    """f32 logits of `model` on `ids` as numpy, through the shared jitted forward."""
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(model)
    return np.asarray(_jitted_forward()(graphdef, state, ids)[0])


def random_model(cfg, seed):
    """A model with random numpy weights, built the way jmem.load builds one (no init compile)."""
    import numpy as np
    from flax import nnx

    from jmem.lm import set_weights
    from jmem.models import Llama

    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    weights = {".".join(map(str, path)): (rng.normal(size=v.shape) * 0.2 + (path[-1] == "scale")).astype(np.float32)
               for path, v in nnx.to_flat_state(nnx.state(model))}
    set_weights(model, weights)
    return model


def train_optimizer(tx, params, loss, steps: int):
    """`steps` jitted updates of `tx` on `loss(params)`: (params, optimizer state, losses)."""
    import jax
    import numpy as np
    import optax

    state = tx.init(params)

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    losses = []
    for _ in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return params, state, np.array(losses)


def random_adapter(model, path, seed, rank, targets, alpha=16.0, rslora=False):
    """An adapter with random (nonzero) A and B, written by `save_adapters` (numpy draws: no compilation)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jmem.lora import LoRA, save_adapters

    m = nnx.clone(model)
    rng = np.random.default_rng(seed)
    for t in targets:
        var = m.layers.weight_var(t)
        *lead, n_in, n_out = var.get_value().shape
        a = rng.normal(size=(*lead, n_in, rank)) * n_in ** -0.5
        b = rng.normal(size=(*lead, rank, n_out)) * 0.5
        var.set_value(LoRA(var.get_value(), jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), alpha,
                           rslora=rslora))
    save_adapters(m, path)
    return path


def locked_elsewhere(path) -> bool:
    """Whether another process finds directory `path` locked (`jmem.io.paths.lock_directory`)."""
    import subprocess
    import sys

    probe = ("import sys; from jmem.io.paths import lock_directory\n"
             "try:\n    lock_directory(sys.argv[1])\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", probe, str(path)], timeout=120).returncode == 3

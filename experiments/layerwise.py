"""Layer-wise (LISA) training: compiled step memory against full training, then a short training run.

    python experiments/layerwise.py
    python experiments/layerwise.py --model bench-8l --n-active 1,2,4 --optimizer adafactor
    python experiments/layerwise.py --train-steps 0            # the memory table only

Part 1 compiles (does not run) one train step of `--model` (random init, nothing
loaded) for full training, for each `--n-active` (embeddings, final norm and head
always trained, as in LISA) and for the smallest `--n-active` with those frozen
too, and reports the optimizer state bytes and XLA's argument/temp/total bytes of
the step (donated state).
Part 2 trains `--train-model` from scratch on `--data` (default: the standard
library's help text) for `--train-steps` steps, full and with each `--n-active`
and `--schedule`, and reports the final train and held-out losses.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx

from jmem.data import PackedDataset, data_name, load_documents
from jmem.experiment import run_experiment
from jmem.io.tokenizer import ByteTokenizer
from jmem.memory.measure import measure, tree_bytes
from jmem.models.config import PRESETS
from jmem.models.llama import Llama
from jmem.optim.factory import OPTIMIZERS, make_optimizer
from jmem.train.layerwise import SCHEDULES, make_layerwise_fns
from jmem.train.step import make_train_fns

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Config:
    """Layer-wise training memory and loss table."""

    model: Annotated[str, tyro.conf.arg(help="Preset whose step memory is measured (random init, never loaded): "
                                             + ", ".join(PRESETS))] = "smollm2-135m"
    n_active: str = "1,2,4"
    """Comma-separated numbers of layers trained at once (each in 1..the model's layers)."""
    schedule: Annotated[str, tyro.conf.arg(help="Layer schedule: " + ", ".join(SCHEDULES))] = "random"
    period: int = 10
    """Steps between layer draws."""
    optimizer: Annotated[str, tyro.conf.arg(help="Optimizer: " + ", ".join(OPTIMIZERS))] = "adamw"
    lr: float = 3e-3
    """Learning rate of the training runs."""
    batch: int = 4
    """Sequences per step."""
    seq: int = 256
    """Tokens per sequence of the measured step (the training runs use --train-seq)."""
    remat: str = "full"
    """Remat policy of both parts (see experiments/train.py)."""
    train_model: str = "small"
    """Preset trained from scratch in part 2 (byte-level vocabulary): tiny, small, bench-8l."""
    train_steps: int = 150
    """Steps of each training run (0: skip part 2)."""
    train_seq: int = 128
    """Tokens per sequence of the training runs."""
    data: str = "default"
    """Training text: 'default' (pydoc_data.topics) or a UTF-8 file."""


def _counts(text: str, layers: int) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 1 <= n <= layers for n in out) or len(set(out)) < len(out):
        raise ValueError(f"--n-active {text!r}; accepted: comma-separated distinct integers in 1..{layers} "
                         f"(the layers of --model and --train-model)")
    return out


def validate(cfg: Config) -> tuple[list[int], PackedDataset | None]:
    """(n_active values, the training text packed in --train-seq windows, or None without part 2) after
    checking every flag; nothing is compiled or trained."""
    for flag, name, accepted in (("--model", cfg.model, PRESETS), ("--train-model", cfg.train_model,
                                                                    ("tiny", "small", "bench-8l"))):
        if name not in accepted:
            raise ValueError(f"{flag} {name!r}; accepted: {', '.join(accepted)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule {cfg.schedule!r}; accepted: {', '.join(SCHEDULES)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {cfg.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    for flag, v in (("--period", cfg.period), ("--batch", cfg.batch), ("--seq", cfg.seq),
                    ("--train-seq", cfg.train_seq)):
        if v < 1:
            raise ValueError(f"{flag} {v}; accepted: a positive integer")
    if cfg.train_steps < 0:
        raise ValueError(f"--train-steps {cfg.train_steps}; accepted: an integer >= 0")
    if not (np.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"--lr {cfg.lr}; accepted: a finite number > 0")
    from jmem.memory.remat import get_policy

    try:
        get_policy(cfg.remat)
    except ValueError as e:  # it names the accepted policies
        raise ValueError(f"--remat {cfg.remat!r}: {e}") from None
    layers = min(PRESETS[cfg.model]().n_layers, PRESETS[cfg.train_model]().n_layers if cfg.train_steps else 10**9)
    counts = _counts(cfg.n_active, layers)
    if not cfg.train_steps:
        return counts, None
    data = PackedDataset.from_text(load_documents(cfg.data, "--data"), ByteTokenizer(), cfg.train_seq,
                                   names=(data_name(cfg.data), "--train-seq "))
    if len(data.valid) < cfg.batch:  # the held-out loss needs one whole batch
        raise ValueError(f"the text (--data {cfg.data}) has {len(data.valid)} held-out windows of --train-seq "
                         f"{cfg.train_seq} tokens, fewer than --batch {cfg.batch}; accepted: a longer text, a smaller "
                         f"--batch or --train-seq, or --train-steps 0")
    return counts, data


def _fns(model, tx, n, cfg, always_train=None):
    if n is None:
        return make_train_fns(model, tx)
    return make_layerwise_fns(model, tx, n, period=cfg.period, schedule=cfg.schedule, always_train=always_train)


def memory_table(cfg: Config, counts: list[int]) -> list[dict]:
    mc = PRESETS[cfg.model](remat=cfg.remat)
    model = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
    tx = make_optimizer(cfg.optimizer, 1e-3)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch, cfg.seq), dt) for k, dt in
             (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    rows = []
    # Last row: the fewest layers with embed/norm/head frozen too (`always_train=()`).
    for n, outer in [(None, None), *((n, None) for n in counts), (min(counts), ())]:
        fns = _fns(model, tx, n, cfg, outer)
        state = jax.eval_shape(lambda: fns.init_state(Llama(mc, rngs=nnx.Rngs(0))))
        r = measure(jax.jit(fns.step, donate_argnums=0), state, batch)
        mode = "full" if n is None else f"{n}/{mc.n_layers} layers" + (", embed/norm/head frozen" if outer == () else "")
        rows.append(dict(mode=mode, opt=tree_bytes(state.opt_state), arg=r.argument_bytes, temp=r.temp_bytes,
                         total=r.total_bytes))
    print(f"\n{cfg.model}: {cfg.optimizer}, batch {cfg.batch} x {cfg.seq}, remat {cfg.remat}, f32 params "
          f"(compiled step, {jax.default_backend()})\n")
    print("| training | optimizer state MiB | step arguments MiB | step temp MiB | step total MiB | total vs full |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['opt'] / MIB:.1f} | {r['arg'] / MIB:.1f} | {r['temp'] / MIB:.1f} | "
              f"{r['total'] / MIB:.1f} | {r['total'] / rows[0]['total']:.3f} |")
    return rows


def train_table(cfg: Config, counts: list[int], data: PackedDataset) -> list[dict]:
    mc = PRESETS[cfg.train_model](remat=cfg.remat)
    held_out = [{k: jnp.asarray(v) for k, v in b.items()} for b in data.eval_batches(cfg.batch, 8)]
    rows = []
    for n in [None, *counts]:
        model = Llama(mc, rngs=nnx.Rngs(0))
        fns = _fns(model, make_optimizer(cfg.optimizer, cfg.lr), n, cfg)
        state, step = fns.init_state(model), jax.jit(fns.step, donate_argnums=0)
        losses = []
        for i in range(cfg.train_steps):
            state, m = step(state, {k: jnp.asarray(v) for k, v in data.batch(i, cfg.batch, seed=0).items()})
            losses.append(float(m["loss"]))
        ev = jax.jit(fns.eval_loss)
        sums = [ev(state.params, b) for b in held_out]
        rows.append(dict(mode="full" if n is None else f"{n}/{mc.n_layers} layers", first=np.mean(losses[:10]),
                         last=np.mean(losses[-10:]), eval=float(sum(s for s, _ in sums) / sum(c for _, c in sums))))
    print(f"\n{cfg.train_model} from scratch: {cfg.train_steps} steps, {cfg.optimizer} lr {cfg.lr}, batch "
          f"{cfg.batch} x {cfg.train_seq}, schedule {cfg.schedule}, period {cfg.period}\n")
    k = min(10, cfg.train_steps)  # the steps each train-loss column averages
    span = f"{k} step" + "s" * (k != 1)
    print(f"| training | train loss, first {span} | train loss, last {span} | held-out loss |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['first']:.3f} | {r['last']:.3f} | {r['eval']:.3f} |")
    return rows


def main(cfg: Config) -> None:
    counts, data = validate(cfg)
    memory_table(cfg, counts)
    if cfg.train_steps:
        train_table(cfg, counts, data)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Config, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())

"""Compiler-measured memory of a mixture-of-experts model: quantized experts, and LoRA on the experts.

Nothing runs and no weight is allocated: every program is compiled from
abstract shapes (`jmem.memory.measure`), the quantized states from
`nnx.eval_shape` of `jmem.quant.quantize`.

    python experiments/moe_memory.py                          # bench-8l with 8 experts, top 2
    python experiments/moe_memory.py --experts 16 --seq 512 --out moe.json --target tpu:v5e:2x2

Rows:
  * serving forward (dropless, as a cached forward routes) with the experts
    and attention in f32, bf16, int8, fp8, nf4 or 4-bit RTN: argument bytes
    (the weights) and temp bytes (one layer's decoded experts, inside the
    layer scan), and on a TPU target XLA's peak (temp bytes miss part of a
    small TPU program's memory: compare those by the peak);
  * a LoRA training step (gradient of the adapters) with adapters on every
    expert, as jmem runs it (`x W + s (x A) B`, two thin grouped matmuls) and
    through merged weights `W + s A B` (what a LoRA without per-expert support
    computes), on a float and on an NF4 base.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jmem.experiment import run_experiment
from jmem.io.paths import prepare_output
from jmem.lora import apply_lora, combine, merge, split_trainable
from jmem.memory import measure
from jmem.memory.measure import parse_target
from jmem.models import Llama, LlamaConfig
from jmem.models.config import EXPERT_TARGETS
from jmem.models.moe import check_moe
from jmem.quant import quantize


@dataclasses.dataclass(frozen=True)
class MoEMemoryConfig:
    """Memory of a mixture-of-experts `bench-8l` (8 layers, width 512, MLP 1408 per expert) as compiled."""

    experts: int = 8
    """Experts per layer."""
    top_k: int = 2
    """Experts per token."""
    batch: int = 1
    """Rows of the serving forward and of the training step."""
    seq: int = 256
    """Tokens per row."""
    lora_rank: int = 16
    """Rank of the adapters on the experts."""
    target: str | None = None
    """Compile for a TPU topology (e.g. tpu:v5e:2x2, needs libtpu) instead of the local backend; adds XLA's peak."""
    out: str | None = None
    """Write the rows as JSON here."""


def validate(cfg: MoEMemoryConfig) -> LlamaConfig:
    for flag, value in (("--batch", cfg.batch), ("--seq", cfg.seq), ("--lora-rank", cfg.lora_rank)):
        if value < 1:
            raise ValueError(f"{flag} {value}; accepted: an integer >= 1")
    if cfg.batch * cfg.seq >= 2**31:  # token indices are int32
        raise ValueError(f"--batch {cfg.batch} x --seq {cfg.seq}: {cfg.batch * cfg.seq} tokens; accepted: under 2**31")
    try:
        check_moe(cfg.experts, cfg.top_k, 1.0)
    except ValueError as e:  # its names are the module's (n_experts, top_k): say the flags
        raise ValueError(f"--experts {cfg.experts} --top-k {cfg.top_k}: {e}") from None
    if cfg.target is not None:
        try:
            parse_target(cfg.target)
        except ValueError as e:  # it names the target, not the flag
            raise ValueError(f"--{e}") from None
    if cfg.out is not None:
        prepare_output(cfg.out, "--out")
    mc = LlamaConfig.bench_8l(moe_experts=cfg.experts, moe_top_k=cfg.top_k, moe_dropless=True)
    if cfg.seq > mc.max_seq_len:
        raise ValueError(f"--seq {cfg.seq}; accepted: 1..{mc.max_seq_len} (the model's context)")
    if cfg.lora_rank > min(mc.dim, mc.ffn_dim):
        raise ValueError(f"--lora-rank {cfg.lora_rank}; accepted: 1..{min(mc.dim, mc.ffn_dim)}")
    return mc


def _abstract(make):
    """(graphdef, abstract state) of the model `make()` builds, without computing it."""
    return nnx.split(nnx.eval_shape(make))


def _peak(r, cfg: MoEMemoryConfig) -> int | None:
    """XLA's peak on a TPU target; None on the local backend (the CPU's figure is no peak)."""
    return r.peak_bytes if cfg.target else None


def forward_row(mc: LlamaConfig, cfg: MoEMemoryConfig, name: str) -> dict:
    def make():
        model = Llama(mc.replace(param_dtype="bf16") if name == "bf16" else mc, rngs=nnx.Rngs(0))
        return model if name in ("f32", "bf16") else quantize(model, name, **({"group_size": 128}
                                                                                if name == "rtn" else {}))

    graph, state = _abstract(make)
    ids = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    r = measure(lambda st, ids: nnx.merge(graph, st)(ids)[0], state, ids, target=cfg.target)
    return dict(kind="serving forward", experts=name, argument_bytes=r.argument_bytes, temp_bytes=r.temp_bytes,
                peak_bytes=_peak(r, cfg))


def lora_row(mc: LlamaConfig, cfg: MoEMemoryConfig, base: str, merged: bool) -> dict:
    def make():
        model = Llama(mc, rngs=nnx.Rngs(0))
        model = quantize(model, base) if base != "f32" else model
        return apply_lora(model, rank=cfg.lora_rank, alpha=2.0 * cfg.lora_rank, targets=EXPERT_TARGETS)

    graph, state = _abstract(make)
    train, frozen = split_trainable(state)
    ids = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)

    def grad(train, frozen, ids):
        def loss(train):
            model = nnx.merge(graph, combine(train, frozen))
            logits = (merge(model) if merged else model)(ids)[0]
            return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))
        return jax.grad(loss)(train)

    r = measure(grad, train, frozen, ids, target=cfg.target)
    return dict(kind="LoRA step, merged weights" if merged else "LoRA step, (x A) B", experts=base,
                argument_bytes=r.argument_bytes, temp_bytes=r.temp_bytes, peak_bytes=_peak(r, cfg))


def run(cfg: MoEMemoryConfig) -> list[dict]:
    mc = validate(cfg)
    expert_params = mc.n_layers * cfg.experts * 3 * mc.dim * mc.ffn_dim
    print(f"bench-8l, {cfg.experts} experts (top {cfg.top_k}), {expert_params / 1e6:.0f}M expert parameters; "
          f"batch {cfg.batch} x {cfg.seq} tokens; {cfg.target or jax.default_backend()}")
    print(f"{'program':>28} {'experts':>8} {'arguments MiB':>14} {'temp MiB':>10}"
          + (f" {'XLA peak MiB':>13}" if cfg.target else ""))
    rows = []
    plans = [(forward_row, (name,)) for name in ("f32", "bf16", "int8", "fp8", "nf4", "rtn")]
    plans += [(lora_row, (base, merged)) for base in ("f32", "nf4") for merged in (False, True)]
    for fn, args in plans:
        row = fn(mc, cfg, *args)
        rows.append(row)
        peak = f" {row['peak_bytes'] / 2**20:13.1f}" if row["peak_bytes"] else ""
        print(f"{row['kind']:>28} {row['experts']:>8} {row['argument_bytes'] / 2**20:14.1f} "
              f"{row['temp_bytes'] / 2**20:10.1f}{peak}", flush=True)
        if cfg.out is not None:
            with open(os.path.expanduser(cfg.out), "w") as f:
                json.dump(dict(config=dataclasses.asdict(cfg), rows=rows), f, indent=2)
    return rows


def cli(argv: list[str] | None = None) -> int:
    """Run; bad input prints one `error: ...` line to stderr and returns 2 (`run_experiment`)."""
    return run_experiment(MoEMemoryConfig, run, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(cli())

"""Compiler-measured memory and FLOPs of the batched multi-LoRA matmul, by number of adapter slots.

    python experiments/bench_multi_lora.py --tokens 256 --rank 16 --slots 1,2,4,8,16

One `jmem.models.dot.dot` of `tokens` rows through a `jmem.serve.lora.MultiLoRA` leaf
(SmolLM2-135M's 576 x 576 attention weight by default), every row routed to a slot,
compiled (not run) for the local backend: XLA's temp bytes and the matmul FLOPs of
the program. `onehot` and `ragged` are the leaf's two formulations; `gather` is the
per-token gather of each row's A and B (what the leaf avoids), as a baseline. The
stacked adapters are arguments, not temps: `stacked MiB` lists them beside.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jmem.experiment import run_experiment
from jmem.memory.measure import MAX_COMPILE_ELEMENTS, measure
from jmem.models.config import LlamaConfig
from jmem.models.dot import dot
from jmem.serve.lora import IMPLS, MultiLoRA

BASELINES = ("gather",)


@dataclasses.dataclass(frozen=True)
class Config:
    """Batched multi-LoRA matmul: temp bytes and FLOPs by adapter slots."""

    tokens: int = 256
    """Rows in the step (prefill and decode tokens together)."""
    rank: int = 16
    """Adapter rank (every slot padded to it)."""
    slots: str = "1,2,4,8,16"
    """Comma-separated numbers of adapter slots."""
    d_in: int = 576
    """Input width of the weight."""
    d_out: int = 576
    """Output width of the weight."""
    impls: str = "onehot,ragged,gather"
    """Comma-separated formulations among: onehot, ragged, gather (baseline)."""


def validate(cfg: Config) -> tuple[list[int], list[str]]:
    """(slot counts, impls) after checking every flag; ValueError naming the first bad one."""
    for flag, v in (("--tokens", cfg.tokens), ("--rank", cfg.rank), ("--d-in", cfg.d_in), ("--d-out", cfg.d_out)):
        if not 1 <= v < 2**31:  # row and slot indices are int32
            raise ValueError(f"{flag} {v}; accepted: an integer in 1..{2**31 - 1}")
    largest = cfg.tokens * max(cfg.d_in, cfg.d_out) * cfg.rank  # the gather baseline's per-row copies of A and B
    if largest > MAX_COMPILE_ELEMENTS:
        raise ValueError(f"--tokens {cfg.tokens} x --d-in/--d-out x --rank {cfg.rank}: {largest:.3g} elements in one "
                         f"array, beyond the {MAX_COMPILE_ELEMENTS:.3g} XLA can compile; accepted: smaller sizes")
    bad_slots = ValueError(f"--slots {cfg.slots!r}; accepted: distinct comma-separated integers in 1..{2**31 - 1}")
    try:
        slots = [int(s) for s in cfg.slots.split(",") if s.strip()]
    except ValueError:
        raise bad_slots from None
    if not slots or min(slots) < 1 or max(slots) >= 2**31 or len(set(slots)) < len(slots):  # a repeat ran twice
        raise bad_slots
    stacked = max(slots) * max(cfg.d_in, cfg.d_out) * cfg.rank  # every slot's A (or B)
    if stacked > MAX_COMPILE_ELEMENTS:
        raise ValueError(f"--slots {max(slots)} x --d-in/--d-out x --rank {cfg.rank}: {stacked:.3g} elements in the "
                         f"stacked adapters, beyond the {MAX_COMPILE_ELEMENTS:.3g} XLA can compile; accepted: fewer "
                         "slots or smaller sizes")
    impls = [s.strip() for s in cfg.impls.split(",") if s.strip()]
    known = IMPLS + BASELINES
    if not impls or any(i not in known for i in impls) or len(set(impls)) < len(impls):
        raise ValueError(f"--impls {cfg.impls!r}; accepted: a comma-separated list of distinct names among "
                         f"{', '.join(known)}")
    return slots, impls


def _gather_dot(x_ND, w, a_SDR, b_SRO, slots_N):
    """Baseline: each row's own A and B gathered ([N, in, R] and [N, R, out] copies)."""
    a_NDR, b_NRO = jnp.take(a_SDR, slots_N, axis=0), jnp.take(b_SRO, slots_N, axis=0)
    h_NR = jnp.einsum("nd,ndr->nr", x_ND, a_NDR)
    return dot(x_ND, w) + jnp.einsum("nr,nro->no", h_NR, b_NRO)


def measure_one(cfg: Config, S: int, impl: str):
    f32, i32 = jnp.float32, jnp.int32
    x = jax.ShapeDtypeStruct((cfg.tokens, cfg.d_in), f32)
    w = jax.ShapeDtypeStruct((cfg.d_in, cfg.d_out), f32)
    a = jax.ShapeDtypeStruct((S, cfg.d_in, cfg.rank), f32)
    b = jax.ShapeDtypeStruct((S, cfg.rank, cfg.d_out), f32)
    slots = jax.ShapeDtypeStruct((cfg.tokens,), i32)
    if impl == "gather":
        return measure(_gather_dot, x, w, a, b, slots)
    return measure(lambda x, leaf: dot(x, leaf), x, MultiLoRA(w, a, b, slots, impl))


def main(cfg: Config) -> list[dict]:
    slots, impls = validate(cfg)
    records = []
    for S in slots:
        for impl in impls:
            r = measure_one(cfg, S, impl)
            records.append({"slots": S, "impl": impl, "temp_bytes": r.temp_bytes, "matmul_flops": r.matmul_flops,
                            "stacked_bytes": S * cfg.rank * (cfg.d_in + cfg.d_out) * 4})
    base_flops = 2 * cfg.tokens * cfg.d_in * cfg.d_out
    print(f"{cfg.tokens} tokens x [{cfg.d_in}, {cfg.d_out}] weight, rank {cfg.rank}, f32, {jax.default_backend()}; "
          f"base matmul alone {base_flops / 1e6:.1f} MFLOP")
    print("| slots | impl | temp MiB | stacked adapters MiB | matmul MFLOP | vs base matmul |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['slots']} | {r['impl']} | {r['temp_bytes'] / 2**20:.2f} | {r['stacked_bytes'] / 2**20:.2f} | "
              f"{r['matmul_flops'] / 1e6:.1f} | {r['matmul_flops'] / base_flops:.2f}x |")
    smol = LlamaConfig.smollm2_135m()
    sides = (smol.dim + smol.n_heads * smol.head_dim) * 2 + 2 * (smol.dim + smol.n_kv_heads * smol.head_dim) \
        + 3 * (smol.dim + smol.ffn_dim)
    print(f"one rank-{cfg.rank} adapter on all 7 SmolLM2-135M projections: "
          f"{smol.n_layers * sides * cfg.rank * 4 / 2**20:.2f} MiB f32 per slot")
    return records


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Config, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())

"""SmolLM2 perplexity under sparse attention masks, with the compiler-measured attention memory.

Every layer of the model attends under one mask: dense causal, causal local
window, the strided pattern of Child et al. (local window | stride), and
BigBird (global + window + random blocks), all `& Causal()`. The mask reaches
the model through its KV-cache protocol (`Llama.hidden(..., cache=...)` hands
q/k/v to `cache.attend`), so the model itself is unchanged.

    python experiments/eval_sparse_attention.py                        # pydoc_data.topics, 4 x 512 tokens
    python experiments/eval_sparse_attention.py --text FILE --seq 1024 --chunks 8 --window 256 --impl pallas

Memory is `jit(grad of one layer's attention).lower(...).compile().memory_analysis()`
for the dense-mask reference and for the sparse kernel (interpret mode on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jmem
from jmem.data import load_documents
from jmem.experiment import model_config, run_experiment
from jmem.io.paths import prepare_output
from jmem.kernels.masks import BigBird, Causal, LocalWindow, Mask, Strided
from jmem.kernels.sparse_attention import sparse_attention, sparse_attention_reference, sparse_attention_stats


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Perplexity of one model under several attention masks."""

    model: str = "smollm2-135m"
    """The packaged smollm2-135m, a random-init preset (tiny, ...) or a .gguf path."""
    text: str | None = None
    """UTF-8 text file; the standard library's pydoc_data.topics when unset."""
    seq: int = 512
    """Tokens per evaluated chunk (each chunk is scored independently)."""
    chunks: int = 4
    """Number of consecutive chunks scored."""
    window: int = 128
    """Local window (tokens) for the local, strided and BigBird masks."""
    stride: int = 128
    """Stride of the strided mask."""
    num_global: int = 16
    """BigBird global tokens."""
    num_random: int = 1
    """BigBird random key blocks per query block."""
    bigbird_block: int = 64
    """BigBird random-block size (tokens)."""
    impl: str = "auto"
    """pallas (the sparse kernel), reference (dense mask in XLA) or auto (pallas on GPU/TPU)."""
    out: str | None = None
    """Write the results as JSON here."""


@dataclasses.dataclass(frozen=True)
class MaskedAttention:
    """Stands in for a KV cache so that every layer attends under `mask`; keeps no state."""

    mask: Mask
    impl: str

    def layer_arrays(self):
        return None

    def with_layers(self, arrays):
        return self

    def attend(self, layer_arrays, q_BTHD, k_BTKD, v_BTKD, positions_BT):
        fn = sparse_attention if self.impl == "pallas" else sparse_attention_reference
        return fn(q_BTHD, k_BTKD, v_BTKD, self.mask), None


def masks(cfg: EvalConfig) -> dict[str, Mask]:
    return {
        "dense": Causal(),
        f"local({cfg.window})": Causal() & LocalWindow(cfg.window),
        f"strided({cfg.window},{cfg.stride})": Causal() & (LocalWindow(cfg.window) | Strided(cfg.stride)),
        "bigbird": Causal() & BigBird(cfg.num_global, cfg.window, cfg.num_random, seed=0, block=cfg.bigbird_block),
    }


def perplexity(lm, ids_NT: np.ndarray, hook: MaskedAttention) -> float:
    graphdef, state = nnx.split(lm.model)

    @jax.jit
    def nll(state, ids_BT):
        logits, _ = nnx.merge(graphdef, state)(ids_BT, cache=hook)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1).sum()

    total = sum(float(nll(state, jnp.asarray(row[None]))) for row in ids_NT)
    return float(np.exp(total / (ids_NT.shape[0] * (ids_NT.shape[1] - 1))))


def attention_memory(lm, seq: int, mask: Mask, impl: str) -> int:
    """Temp bytes XLA assigns to forward + backward of one layer's attention at this length."""
    c = lm.config
    q = jax.ShapeDtypeStruct((1, seq, c.n_heads, c.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, c.n_kv_heads, c.head_dim), jnp.float32)
    fn = sparse_attention if impl == "pallas" else sparse_attention_reference
    loss = lambda q, k, v: fn(q, k, v, mask).sum()  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


MAX_SEQ = 2**20  # the masks' tile maps (checked before the model is read) hold (seq / tile)**2 entries


def validate(cfg: EvalConfig) -> tuple[str, dict, str]:
    """(text, {mask name: (mask, tile stats)}, impl) after checking every flag; a ValueError naming the
    first bad one. No model is loaded."""
    if cfg.impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"--impl {cfg.impl!r}; accepted: auto, pallas, reference")
    if not 2 <= cfg.seq <= MAX_SEQ:  # a chunk scores seq - 1 next-token predictions; tile maps grow as seq**2
        raise ValueError(f"--seq {cfg.seq}; accepted: an integer in 2..{MAX_SEQ} (and within the model's context)")
    for flag, v, least in (("--chunks", cfg.chunks, 1), ("--window", cfg.window, 1), ("--stride", cfg.stride, 1),
                           ("--bigbird-block", cfg.bigbird_block, 1), ("--num-global", cfg.num_global, 0),
                           ("--num-random", cfg.num_random, 0)):
        if v < least:
            raise ValueError(f"{flag} {v}; accepted: an integer >= {least}")
    if cfg.num_global > cfg.seq:
        raise ValueError(f"--num-global {cfg.num_global} is larger than --seq {cfg.seq}; accepted: 0..{cfg.seq}")
    if cfg.bigbird_block > cfg.seq:
        raise ValueError(f"--bigbird-block {cfg.bigbird_block} is larger than --seq {cfg.seq}; accepted: 1..{cfg.seq}")
    n_blocks = -(-cfg.seq // cfg.bigbird_block)
    if cfg.num_random >= n_blocks:  # every key block: the bigbird row would be the dense one
        raise ValueError(f"--num-random {cfg.num_random} covers all {n_blocks} key blocks of --seq {cfg.seq} "
                         f"(--bigbird-block {cfg.bigbird_block}); accepted: 0..{n_blocks - 1}")
    context = model_config(cfg.model).max_seq_len  # from the header: the tile maps below grow as seq**2
    if cfg.seq > context:
        raise ValueError(f"--seq {cfg.seq} exceeds the context of {cfg.model!r} ({context} tokens); accepted: "
                         f"2..{context}")
    text = "\n\n".join(load_documents(cfg.text, "--text"))
    if cfg.out is not None:
        prepare_output(cfg.out, "--out")
    # The masks' own checks (and their tile layouts) before any model work.
    planned = {name: (mask, sparse_attention_stats(mask, cfg.seq, cfg.seq)) for name, mask in masks(cfg).items()}
    impl = cfg.impl if cfg.impl != "auto" else ("pallas" if jax.default_backend() in ("gpu", "tpu") else "reference")
    return text, planned, impl


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; bad input prints one `error: ...` line to stderr and returns 2 (`run_experiment`)."""
    return run_experiment(EvalConfig, evaluate, argv, description=__doc__)


def evaluate(cfg: EvalConfig) -> list[dict]:
    """Print a row per mask; `--out` is rewritten after each, so an interrupted run keeps the rows done."""
    text, planned, impl = validate(cfg)
    lm = jmem.load(cfg.model)
    ids = np.asarray(lm.tokenizer.encode(text), np.int32)
    if ids.size < cfg.seq * cfg.chunks:
        raise ValueError(f"the text has {ids.size} tokens; --seq {cfg.seq} x --chunks {cfg.chunks} needs "
                         f"{cfg.seq * cfg.chunks}; accepted: a longer --text or smaller --seq/--chunks")
    ids_NT = ids[: cfg.seq * cfg.chunks].reshape(cfg.chunks, cfg.seq)
    rows = []
    print(f"{cfg.model}, {cfg.chunks} x {cfg.seq} tokens, attention impl {impl} on {jax.default_backend()}")
    print(f"{'mask':>16} {'ppl':>9} {'tiles visited':>14} {'attn mem ref':>13} {'attn mem kernel':>16}")
    for name, (mask, stats) in planned.items():
        row = dict(
            mask=name,
            ppl=perplexity(lm, ids_NT, MaskedAttention(mask, impl)),
            tiles_visited=stats.visited,
            tiles_total=stats.num_blocks,
            attn_temp_bytes_reference=attention_memory(lm, cfg.seq, mask, "reference"),
            attn_temp_bytes_kernel=attention_memory(lm, cfg.seq, mask, "pallas"),
        )
        rows.append(row)
        print(
            f"{name:>16} {row['ppl']:9.3f} {stats.visited:>6}/{stats.num_blocks:<7} "
            f"{row['attn_temp_bytes_reference'] / 2**20:10.2f} MiB {row['attn_temp_bytes_kernel'] / 2**20:13.2f} MiB"
        )
        if cfg.out is not None:
            with open(os.path.expanduser(cfg.out), "w") as f:
                json.dump(dict(config=dataclasses.asdict(cfg), backend=jax.default_backend(), impl=impl, rows=rows),
                          f, indent=2)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

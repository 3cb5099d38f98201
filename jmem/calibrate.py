"""Block-by-block calibration on a model's own activations, shared by quantization, pruning and
low-rank factorization.

The calibration tokens are embedded once; then for each block in order a
`rewrite` function sees the block's f32 weights and its input (the output of
the already-rewritten earlier blocks: GPTQ's "sequential" calibration), returns
the rewritten weights, and their output becomes the next block's input.
`run_layer` gives a block's output and the input of every linear, captured by
wrapping each kernel in a recording weight leaf for one trace. In a
mixture-of-experts block it also gives the router's input and, for each expert
weight, the routed rows with the expert of each row (`expert_rows` splits them
by expert).

Example:
    >>> def rewrite(cfg, w, x, positions):
    ...     _, inputs = run_layer(cfg, w, x, positions)
    ...     return w, {n: inputs[n].shape for n in LINEARS}
    >>> records = calibrate_layers(model, calibration_tokens(ids), rewrite)
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmem.checks import check_targets, is_int
from jmem.models.config import EXPERT_TARGETS, LINEARS
from jmem.models.dot import dot
from jmem.models.llama import block
from jmem.models.moe import expert_matmul

# GPTQ's true-sequential order within a block: each stage sees the earlier stages rewritten.
STAGES = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))
# The same order in a mixture-of-experts block (its experts replace the MLP linears).
EXPERT_STAGES = STAGES[:2] + (EXPERT_TARGETS[:2], EXPERT_TARGETS[2:])
# A mixture-of-experts block's weights by name (`LlamaConfig.weight_names`, and the router), as roles of `w["moe"]`.
MOE_ROLES = {"moe.router": "router", "moe.expert_gate": "gate", "moe.expert_up": "up", "moe.expert_down": "down"}


def stages(cfg) -> tuple[tuple[str, ...], ...]:
    """The block's weights in GPTQ's sequential order (`STAGES`, or `EXPERT_STAGES` for a mixture of experts)."""
    return EXPERT_STAGES if cfg.moe_experts else STAGES


def layer_weight(w: dict, name: str):
    """Weight `name` ("wq", "moe.expert_up", "moe.router", "attn_norm", ...) of one block's weights `w`."""
    return w["moe"][MOE_ROLES[name]] if name in MOE_ROLES else w[name]


def with_weights(w: dict, new: dict) -> dict:
    """A copy of one block's weights `w` with the weights in `new` (named as `layer_weight` takes them) replaced."""
    out = {**w, **{n: v for n, v in new.items() if n not in MOE_ROLES}}
    if any(n in MOE_ROLES for n in new):
        out["moe"] = {**w["moe"], **{MOE_ROLES[n]: v for n, v in new.items() if n in MOE_ROLES}}
    return out


def linear_targets(model, targets) -> tuple[str, ...]:
    """`targets` (a name or several) as a tuple of distinct linears of `model`'s blocks (`check_targets`);
    a ValueError names those a mixture-of-experts block lacks (its experts replace the MLP linears). None:
    every linear the blocks have (the seven, or a mixture of experts' four attention linears)."""
    present = model.config.weight_names()
    if targets is None:
        return tuple(n for n in LINEARS if n in present)
    targets = check_targets(targets, LINEARS)
    absent = [t for t in targets if t not in present]
    if absent:
        raise ValueError(f"targets {absent} are not linear kernels of this model's blocks (its MLP is a mixture of "
                         f"experts); accepted: {', '.join(n for n in LINEARS if n in present)}")
    return targets


def calibration_tokens(calibration, tokenizer=None, seq_len: int = 512, max_seqs: int = 32) -> np.ndarray:
    """Token windows i32[n_seqs, seq_len] from texts (needs `tokenizer`) or token arrays.

    Accepts a string, a list of strings, an int array [B, T] or a list of 1-D
    int arrays. Texts and 1-D arrays are concatenated into one stream and cut
    into non-overlapping windows of `seq_len` (a shorter stream gives one
    shorter window); a [B, T] array already holds windows and is used as it is
    (its T, whatever `seq_len`). At most `max_seqs` windows are returned.

    Raises:
        ValueError: empty input, texts without a tokenizer, non-integer ids, or
            seq_len / max_seqs not a positive integer.
    """
    for name, n in (("seq_len", seq_len), ("max_seqs", max_seqs)):
        if not is_int(n) or n < 1:
            raise ValueError(f"{name}={n!r}; accepted: a positive integer")
    if calibration is None or (isinstance(calibration, (str, list, tuple)) and len(calibration) == 0):
        raise ValueError("calibration is empty; accepted: non-empty text(s) or token arrays")
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, (list, tuple)) and all(isinstance(t, str) for t in calibration):
        if tokenizer is None:
            raise ValueError("calibration texts need a tokenizer (pass tokenizer=...) or pass token ids")
        stream = []
        for text in calibration:
            enc = tokenizer.encode(text)
            stream.extend(enc.ids if hasattr(enc, "ids") else list(enc))
        calibration = np.asarray(stream, np.int32)
    parts = calibration if isinstance(calibration, (list, tuple)) else [calibration]
    parts = [np.asarray(c) for c in parts]
    deep = next((c.shape for c in parts if c.ndim > (1 if isinstance(calibration, (list, tuple)) else 2)), None)
    if deep is not None:
        raise ValueError(f"calibration token ids of shape {deep}; accepted: an int array [B, T] or a list of "
                         "1-D int arrays (or texts with a tokenizer)")
    bad = next((c.dtype for c in parts if c.size and not np.issubdtype(c.dtype, np.integer)), None)
    if bad is not None:
        raise ValueError(f"calibration token ids of dtype {bad}; accepted: integer ids (or texts with a tokenizer)")
    if isinstance(calibration, (list, tuple)):
        calibration = np.concatenate([c.astype(np.int32).reshape(-1) for c in parts])
    ids = np.asarray(calibration, np.int32)
    if ids.ndim == 2 and ids.size:
        return ids[:max_seqs]
    ids = ids.reshape(-1)
    if ids.size == 0:
        raise ValueError("calibration is empty after tokenization; accepted: non-empty text(s) or token arrays")
    n = max(1, ids.size // seq_len)
    if ids.size < seq_len:
        return ids[None, :]
    return ids[: n * seq_len].reshape(n, seq_len)[:max_seqs]


def check_calibration_ids(ids, vocab_size: int) -> None:
    """Token ids must index the model's embedding table: 0 <= id < vocab_size."""
    lo, hi = int(np.min(ids)), int(np.max(ids))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"calibration token ids range over {lo}..{hi}; accepted: ids of the model's vocabulary, "
                         f"0..{vocab_size - 1}")


class _Tap:
    """A weight leaf that records its input (inside one trace) and then multiplies."""

    def __init__(self, w, sink: dict, name: str):
        self.w, self.sink, self.name = w, sink, name
        self.shape = w.shape

    def __jmem_dot__(self, x):
        self.sink[self.name] = x
        return dot(x, self.w)


class _ExpertTap(_Tap):
    """An expert weight leaf `[experts, in, out]` that records its routed input rows and the expert of each
    row (inside one trace), then multiplies as `jmem.models.moe.expert_matmul` does."""

    def __jmem_expert_dot__(self, x, matmul, tokens=None):
        n_experts = self.shape[0]
        # `matmul` multiplies each row by its expert's matrix: a row of ones times one-hot matrices names it.
        one_hot = matmul(jnp.ones((*x.shape[:-1], 1), x.dtype), jnp.eye(n_experts, dtype=x.dtype)[:, None, :])
        self.sink[self.name] = (x.reshape(-1, x.shape[-1]), jnp.argmax(one_hot, axis=-1).reshape(-1))
        return expert_matmul(x, self.w, matmul, tokens)


@functools.partial(jax.jit, static_argnums=0)
def run_layer(cfg, w: dict, x, positions):
    """One block on weights `w`; returns (output, the input of every linear by name). A mixture-of-experts
    block also gives its router's input ("moe.router") and, for each expert weight ("moe.expert_gate", ...),
    (the routed rows [assignments, in], the expert of each row i32[assignments]): see `expert_rows`."""
    sink: dict = {}
    tapped = {n: (_Tap(v, sink, n) if n in LINEARS else v) for n, v in w.items()}
    if "moe" in w:
        tapped["moe"] = {MOE_ROLES[n]: (_ExpertTap if n in EXPERT_TARGETS else _Tap)(layer_weight(w, n), sink, n)
                         for n in MOE_ROLES}
    y, _ = block(cfg, tapped, x, positions)
    return y, sink


def expert_rows(recorded, n_experts: int) -> list[np.ndarray]:
    """Each expert's routed input rows (f32[rows_e, in], possibly none), from what `run_layer` recorded for
    an expert weight."""
    x, expert = np.asarray(recorded[0], np.float32), np.asarray(recorded[1])
    return [x[expert == e] for e in range(n_experts)]


def _layer_of(v, layer: int):
    """Layer `layer` of a stacked weight (float arrays as f32; other leaves as stored), or of each weight of a
    dict of them (a mixture-of-experts block's `moe`)."""
    if isinstance(v, dict):
        return {k: _layer_of(x, layer) for k, x in v.items()}
    return jnp.asarray(v[layer], jnp.float32) if isinstance(v, jax.Array) else v[layer]


def calibrate_layers(model, ids_BT, rewrite, *, log=None, label: str = "calibration") -> list:
    """Rewrite every block of `model` in order on its own activations.

    Args:
        model: a `jmem.models.Llama` (stacked blocks).
        ids_BT: i32[batch, seq] calibration tokens (`calibration_tokens`).
        rewrite: `rewrite(cfg, w, x, positions) -> (new_w, record)`: `w` is one block's
            weights (float arrays as f32; other leaves as stored), `x` its f32 input;
            `new_w` is what the next block's input is computed with.
        log: optional callable taking one progress line per block; label: its prefix.

    Returns:
        The `record` of every block, in order.
    """
    # A mixture-of-experts model routes dropless, as at inference (no token's expert depends on the batch).
    cfg = model.config.replace(remat="none", compute_dtype="f32", moe_dropless=True)
    B, T = ids_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = jnp.take(model.embed.embedding.get_value(), ids_BT, axis=0).astype(jnp.float32)
    weights = model.layers.weights()
    records = []
    t0 = time.perf_counter()
    for layer in range(cfg.n_layers):
        w = {n: _layer_of(v, layer) for n, v in weights.items()}
        w, record = rewrite(cfg, w, x, positions)
        x, _ = run_layer(cfg, w, x, positions)
        records.append(record)
        if log is not None:
            log(f"{label}: layer {layer + 1}/{cfg.n_layers} done, {time.perf_counter() - t0:.1f}s")
    return records


def stack_records(records: list[dict]) -> dict:
    """Per-block dicts of leaves -> one dict of leaves stacked on a leading layers axis."""
    return {n: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[r[n] for r in records]) for n in records[0]}

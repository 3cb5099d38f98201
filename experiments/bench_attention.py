"""Attention kernel benchmark: paged decode bandwidth and flash forward TFLOP/s vs the measured roofline.

Rows: a big device-to-device copy (bandwidth roofline) and a big bf16 matmul
(compute roofline); jmem paged decode (bf16 and int8 pages) and ragged
attention on decode tokens; JAX's bundled Pallas paged attention; decode with
`jax.nn.dot_product_attention` on contiguous K/V; jmem flash forward, cuDNN
(or XLA) `dot_product_attention` and JAX's bundled Pallas flash at the same
shape. Each row runs in its own try/except, so one failure costs one row.

Timing: after compile and warmup, each sample dispatches the call `reps`
times back to back and blocks on the last result (amortising dispatch and
sync); the median sample / reps is reported.

    python experiments/bench_attention.py --out bench_attention.json
    python experiments/bench_attention.py --quick   # CPU smoke run, interpreted kernels
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from jmem.experiment import exit_status
from jmem.io.paths import forget_created_dirs, prepare_output, remove_unused_dirs
from jmem.kernels.flash_attention.kernel import effective_block
from jmem.kernels.paged_attention import paged_attention, quantize_pages, ragged_paged_attention


# Shape and timing flags left unset (None) take these sizes: FULL normally, QUICK with --quick.
# A flag given explicitly keeps its value either way, even when it equals one of these.
FULL = dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128, page_size=16, flash_batch=4, flash_seq=4096,
            flash_heads=32, warmup=3, samples=10, reps=5)
QUICK = dict(batch=2, context=64, q_heads=4, kv_heads=2, head_dim=32, page_size=8, flash_batch=1, flash_seq=128,
             flash_heads=2, warmup=0, samples=1, reps=1)


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool = False
    """Tiny shapes and interpreted kernels: a smoke run on CPU (unset sizes take the quick ones)."""
    out: str | None = None
    """Write the rows as JSON here."""
    batch: int | None = None
    """Decode batch (64; --quick 2)."""
    context: int | None = None
    """Decode context length, every sequence full (4096; --quick 64)."""
    q_heads: int | None = None
    """Query heads (32; --quick 4)."""
    kv_heads: int | None = None
    """KV heads (8; --quick 2)."""
    head_dim: int | None = None
    """Head dimension (128; --quick 32)."""
    page_size: int | None = None
    """Tokens per KV page (16; --quick 8)."""
    flash_batch: int | None = None
    """Flash attention batch (4; --quick 1)."""
    flash_seq: int | None = None
    """Flash attention sequence length (4096; --quick 128)."""
    flash_heads: int | None = None
    """Flash attention heads (32; --quick 2)."""
    warmup: int | None = None
    """Untimed calls after compiling (3; --quick 0)."""
    samples: int | None = None
    """Timed samples, median reported (10; --quick 1)."""
    reps: int | None = None
    """Back-to-back calls per timed sample (5; --quick 1)."""
    flash_tiles: str = ""
    """More jmem flash rows (forward, and forward + backward), comma-separated BQxBKxWARPS
    (128x128x4,128x64x4: query and key tile sizes, GPU warps per program)."""

    def tiles(self) -> list[tuple[int, int, int]]:
        """--flash-tiles as (block_q, block_k, num_warps) triples; a ValueError naming a bad one."""
        out = []
        for item in filter(None, (t.strip() for t in self.flash_tiles.split(","))):
            parts = item.lower().split("x")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                raise ValueError(f"--flash-tiles entry {item!r}; accepted: BQxBKxWARPS such as 128x64x8")
            bq, bk, w = (int(p) for p in parts)
            if min(bq, bk) < 16 or bq & (bq - 1) or bk & (bk - 1) or w not in (1, 2, 4, 8, 16):
                raise ValueError(f"--flash-tiles entry {item!r}; accepted: tile sizes powers of two >= 16, "
                                 "warps 1, 2, 4, 8 or 16")
            out.append((bq, bk, w))
        return out

    def resolved(self) -> "Config":
        """Every unset shape / timing flag at its full (or, with --quick, quick) size; flags given stay."""
        sizes = QUICK if self.quick else FULL
        return dataclasses.replace(self, **{k: v for k, v in sizes.items() if getattr(self, k) is None})

    def validate(self) -> None:
        """A ValueError naming the first flag no benchmark row could run with (call on a resolved config)."""
        for name in ("batch", "context", "q_heads", "kv_heads", "head_dim", "page_size", "flash_batch", "flash_seq",
                     "flash_heads", "samples", "reps"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"--{name.replace('_', '-')} {v}; accepted: a positive integer")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}; accepted: a non-negative integer")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"--q-heads {self.q_heads} is not a multiple of --kv-heads {self.kv_heads}; accepted: "
                             "q_heads = k * kv_heads (grouped-query attention)")
        if self.context % self.page_size:
            raise ValueError(f"--context {self.context} is not a multiple of --page-size {self.page_size}; "
                             "accepted: a context of whole pages")
        self.tiles()
        # Before any row runs (a failed allocation ended the run midway, with a traceback): the paged rows'
        # bf16 and int8 K/V pages; the flash rows' q, k, v and output (an XLA row whose score matrix does
        # not fit fails alone, as its row's error).
        from jmem.memory.measure import memory_limit

        limit, holder = memory_limit()
        paged = 6 * self.batch * self.context * self.kv_heads * self.head_dim
        flash = 8 * self.flash_batch * self.flash_seq * self.flash_heads * self.head_dim
        for flags, need in (("--batch x --context x --kv-heads x --head-dim", paged),
                            ("--flash-batch x --flash-seq x --flash-heads", flash)):
            if need > limit:
                raise ValueError(f"{flags}: the inputs need {need / 2**20:.0f} MiB and {holder} "
                                 f"{limit / 2**20:.0f} MiB; accepted: smaller sizes")


def log(msg: str) -> None:
    print(f"[bench_attention {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def time_call(cfg: Config, f, *args) -> float:
    """Median seconds per call of jitted `f(*args)`."""
    jax.block_until_ready(f(*args))  # compile
    for _ in range(cfg.warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(cfg.samples):
        t0 = time.perf_counter()
        for _ in range(cfg.reps):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / cfg.reps)
    return statistics.median(times)


def decode_inputs(cfg: Config, key, dtype=jnp.bfloat16):
    B, S, H, K, D, P = cfg.batch, cfg.context, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.page_size
    npg = S // P
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, H, D), dtype)
    k_pages = jax.random.normal(kk, (K, B * npg, P, D), dtype)
    v_pages = jax.random.normal(kv, (K, B * npg, P, D), dtype)
    tables = jax.random.permutation(kp, B * npg).reshape(B, npg).astype(jnp.int32)
    lengths = jnp.full((B,), S, jnp.int32)
    return q, k_pages, v_pages, lengths, tables


class Unavailable(RuntimeError):
    """A row with nothing to run on this platform (a bundled kernel it has no version of)."""


def run(cfg: Config) -> list[dict]:
    interpret = True if cfg.quick and jax.default_backend() == "cpu" else None
    platform = jax.default_backend()
    rows: list[dict] = []
    roof = {}

    def row(name, fn, *, bytes_=None, flops=None, note=""):
        log(f"start {name}")
        try:
            t = fn()
        except Exception as e:  # one failing row must not lose the others
            log(f"FAILED {name}: {type(e).__name__}: {str(e)[:400]}")
            if not isinstance(e, Unavailable):  # a row this platform has no such kernel for: the line says it all
                traceback.print_exc()
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
            return None
        r = dict(name=name, ms=t * 1e3, note=note)
        if bytes_ is not None:
            r["GB/s"] = bytes_ / t / 1e9
            if "GB/s" in roof:
                r["% of copy"] = 100 * r["GB/s"] / roof["GB/s"]
        if flops is not None:
            r["TFLOP/s"] = flops / t / 1e12
            if "TFLOP/s" in roof:
                r["% of matmul"] = 100 * r["TFLOP/s"] / roof["TFLOP/s"]
        rows.append(r)
        log(f"done {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "name"))
        return r

    # Rooflines.
    n_copy = (1 << 16) if cfg.quick else (1 << 30)  # bf16 elements: 2 GiB
    x = jnp.ones((n_copy,), jnp.bfloat16)
    r = row("copy roofline (x + 1, bf16)", lambda: time_call(cfg, jax.jit(lambda a: a + jnp.bfloat16(1)), x), bytes_=2 * x.nbytes)
    if r:
        roof["GB/s"] = r["GB/s"]
    del x
    n = 256 if cfg.quick else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    r = row(f"matmul roofline ({n}^3 bf16)", lambda: time_call(cfg, jax.jit(lambda x, y: x @ y), a, a), flops=2 * n**3)
    if r:
        roof["TFLOP/s"] = r["TFLOP/s"]
    del a

    # Paged decode.
    q, kp, vp, lens, tables = decode_inputs(cfg, jax.random.key(0))
    B, S, K, D = cfg.batch, cfg.context, cfg.kv_heads, cfg.head_dim
    kv_bytes = 2 * B * S * K * D * kp.dtype.itemsize
    shape = f"B={B} ctx={S} H={cfg.q_heads}/{K} D={D} page={cfg.page_size}"
    pa = jax.jit(lambda *a: paged_attention(*a, interpret=interpret))
    row("jmem paged_attention bf16", lambda: time_call(cfg, pa, q, kp, vp, lens, tables), bytes_=kv_bytes, note=shape)
    k8, ks = quantize_pages(kp, jnp.int8)
    v8, vs = quantize_pages(vp, jnp.int8)
    pa8 = jax.jit(lambda q, k, v, l, t, ks, vs: paged_attention(q, k, v, l, t, k_scale=ks, v_scale=vs, interpret=interpret))
    row("jmem paged_attention int8", lambda: time_call(cfg, pa8, q, k8, v8, lens, tables, ks, vs), bytes_=kv_bytes // 2, note=shape)
    del k8, v8
    cu = jnp.arange(B + 1, dtype=jnp.int32)
    rpa = jax.jit(lambda q, k, v, l, t: ragged_paged_attention(q, k, v, l, t, cu, B, interpret=interpret))
    row("jmem ragged_paged_attention (all decode)", lambda: time_call(cfg, rpa, q, kp, vp, lens, tables), bytes_=kv_bytes, note=shape)

    def bundled_paged():
        if platform == "gpu":
            from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa

            f = jax.jit(lambda q, k, v, t, l: gpu_pa.paged_attention(q, k, v, t, l, interpret=bool(interpret)))
            return time_call(cfg, f, q, kp, vp, tables, lens)
        if platform == "tpu":
            from jax.experimental.pallas.ops.tpu import paged_attention as tpu_pa

            f = jax.jit(lambda q, k, v, l, t: tpu_pa.paged_attention(q, k, v, l, t, pages_per_compute_block=8))
            return time_call(cfg, f, q, kp, vp, lens, tables)
        raise Unavailable(f"no bundled Pallas paged attention for platform {platform}")

    row("jax bundled Pallas paged_attention", bundled_paged, bytes_=kv_bytes, note=shape)
    k_c = kp[:, tables].reshape(K, B, S, D).transpose(1, 2, 0, 3)
    v_c = vp[:, tables].reshape(K, B, S, D).transpose(1, 2, 0, 3)
    del kp, vp
    impl = "cudnn" if platform == "gpu" else "xla"
    for im in dict.fromkeys((impl, "xla")):
        dpa = jax.jit(lambda q, k, v, im=im: jax.nn.dot_product_attention(q[:, None], k, v, implementation=im)[:, 0])
        row(f"jax.nn.dot_product_attention decode ({im}, contiguous K/V)", lambda: time_call(cfg, dpa, q, k_c, v_c), bytes_=kv_bytes, note=shape)
    del k_c, v_c

    # Flash forward, causal; FLOPs count the visible half of the score matrix.
    Bf, T, Hf = cfg.flash_batch, cfg.flash_seq, cfg.flash_heads
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    fq, fk, fv = (jax.random.normal(k_, (Bf, T, Hf, D), jnp.bfloat16) for k_ in (kq, kk, kv))
    flops = 4 * Bf * Hf * T * T * D / 2
    fshape = f"B={Bf} T={T} H={Hf} D={D} causal"

    def jmem_flash(backward=False, **tiles):
        from jmem.kernels.flash_attention import flash_attention

        f = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=interpret, **tiles)  # noqa: E731
        if backward:  # d<o, do>/d(q, k, v) with a fixed random do: forward, then the three gradients
            do = jax.random.normal(jax.random.key(2), fq.shape, jnp.float32)
            fwd = f
            f = jax.grad(lambda q, k, v: jnp.vdot(fwd(q, k, v).astype(jnp.float32), do), argnums=(0, 1, 2))
        return time_call(cfg, jax.jit(f), fq, fk, fv)

    row("jmem flash_attention fwd", jmem_flash, flops=flops, note=fshape)
    # Backward FLOPs: 2.5x the forward's (five T x T matmuls against two).
    row("jmem flash_attention fwd+bwd", lambda: jmem_flash(True), flops=3.5 * flops, note=fshape)
    for bq, bk, w in cfg.tiles():
        tiles = dict(block_q=bq, block_k=bk, num_warps=w)
        # The kernel shrinks a tile longer than the sequence: the row names the tile it runs.
        run_q, run_k = effective_block(bq, T, "block_q"), effective_block(bk, T, "block_k")
        asked = "" if (run_q, run_k) == (bq, bk) else f", asked {bq}x{bk}"
        name = f"jmem flash_attention (block {run_q}x{run_k}{asked}, {w} warps)"
        row(f"{name} fwd", lambda t=tiles: jmem_flash(**t), flops=flops, note=fshape)
        row(f"{name} fwd+bwd", lambda t=tiles: jmem_flash(True, **t), flops=3.5 * flops, note=fshape)
    for im in dict.fromkeys((impl, "xla")):
        f = jax.jit(lambda q, k, v, im=im: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=im))
        row(f"jax.nn.dot_product_attention fwd ({im})", lambda f=f: time_call(cfg, f, fq, fk, fv), flops=flops, note=fshape)

    def bundled_flash():
        scale = D**-0.5
        if platform == "gpu":
            from jax.experimental.pallas.ops.gpu import attention as gpu_att

            f = jax.jit(lambda q, k, v: gpu_att.mha(q, k, v, None, sm_scale=scale, causal=True, interpret=bool(interpret)))
            return time_call(cfg, f, fq, fk, fv)
        if platform == "tpu":
            from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa

            f = jax.jit(lambda q, k, v: tpu_fa.flash_attention(q, k, v, causal=True, sm_scale=scale))
            return time_call(cfg, f, *(a.transpose(0, 2, 1, 3) for a in (fq, fk, fv)))
        raise Unavailable(f"no bundled Pallas flash attention for platform {platform}")

    row("jax bundled Pallas flash fwd", bundled_flash, flops=flops, note=fshape)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ["ms", "GB/s", "% of copy", "TFLOP/s", "% of matmul"]
    lines = ["| row | " + " | ".join(cols) + " | shape / error |", "|---" * (len(cols) + 2) + "|"]
    for r in rows:
        cells = [f"{r[c]:.3g}" if c in r else "" for c in cols]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r.get('error', r.get('note', ''))} |")
    return "\n".join(lines)


def main(cfg: Config) -> list[dict]:
    """Run every row; a ValueError for bad flags before any benchmark (after unset sizes are filled in)."""
    cfg = cfg.resolved()
    cfg.validate()
    if cfg.out is not None:
        prepare_output(cfg.out, "--out")  # before the benchmarks, not after them
    dev = jax.devices()[0]
    log(f"jax {jax.__version__} on {dev.platform} ({getattr(dev, 'device_kind', '?')}); config {cfg}")
    rows = run(cfg)
    print(markdown(rows), flush=True)
    if cfg.out is not None:
        with open(os.path.expanduser(cfg.out), "w") as f:
            json.dump(dict(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev.platform)), config=dataclasses.asdict(cfg), rows=rows), f, indent=1)
        log(f"wrote {cfg.out}")
    return rows


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags from `Config` via tyro; on a machine without tyro, the same flags via argparse."""
    try:
        import tyro
    except ImportError:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        for f in dataclasses.fields(Config):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                typ = int if "int" in str(f.type) else str
                parser.add_argument(flag, type=typ, default=f.default)
        return Config(**vars(parser.parse_args(argv)))
    return tyro.cli(Config, args=argv, description=__doc__)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 with one `error: ...` line for bad flags."""
    try:
        main(parse_args(argv))
    except BaseException as e:  # one line and the status of every experiment script (an OSError at --out, ^C)
        remove_unused_dirs()
        return exit_status(e)
    forget_created_dirs()
    return 0


if __name__ == "__main__":
    sys.exit(cli())

"""Compile the train step for every combination of memory settings; tabulate.

Nothing is run: each combination is lowered and compiled, and XLA's buffer
assignment (argument / temp / output bytes) and cost model (FLOPs) are
recorded. With `--target tpu:v5e:2x2` the step is compiled ahead of time for
that TPU topology with libtpu (bf16 savings show only on a TPU/GPU target:
the CPU backend computes bf16 in f32).

    python experiments/memory_sweep.py                      # bench-8l, the full grid
    python experiments/memory_sweep.py --remat none,full,minimal,dots --precision f32 \
        --accum 1 --optimizer adamw --out docs/sweep_remat.json
    python experiments/memory_sweep.py --precision f32,bf16 --remat none --target tpu:v5e:2x2
    python experiments/memory_sweep.py --precision f32,bf16 --remat none,full --accum 1 --optimizer adamw \
        --target tpu:v5e:2x2 --attention pallas
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/memory_sweep.py \
        --mesh data=8 --zero 0,1,2,3 --remat full --precision f32 --accum 1 --optimizer adamw
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/memory_sweep.py --mesh stage=2,data=4 \
        --pipeline-stages 2 --microbatches 2,8 --pipeline-schedule gpipe,1f1b --batch 32 --seq 256 \
        --remat full --precision f32 --accum 1 --optimizer adamw

Writes `--out` (JSON list of records) and `--md` (markdown table) after each compilation, so a
sweep stopped midway keeps what it compiled, and `--png` at the end. The default grid is 84
compilations of bench-8l (each line shows its compile time).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import tyro

from jmem.io.paths import check_separate, prepare_output, remove_unused_dirs
from jmem.models.config import PRESETS
from jmem.memory.remat import POLICIES
from jmem.train.plot import check_image_path
from jmem.train.sweep import markdown_table, parse_list, plot_records, sweep, validate_grid


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A grid of train-step compilations."""

    preset: str = "bench-8l"
    """Model preset (bench-8l: 8 layers, width 512, 8 heads, MLP 1408, vocab 8192, f32 params)."""
    batch: int = 8
    """Global batch size."""
    seq: int = 1024
    """Sequence length."""
    remat: str = ",".join(POLICIES)
    """Comma-separated remat policies; a per-name spec (query=device,mlp_up=offload) is one of them, and ';'
    separates two such specs."""
    precision: str = "f32,bf16"
    """Comma-separated precision policies; a p=..,c=..,o=.. spec is one of them, and ';' separates two such specs."""
    accum: str = "1,4"
    """Comma-separated accumulation counts."""
    optimizer: str = "adamw,adafactor,adam8bit"
    """Comma-separated optimizers."""
    target: str | None = None
    """Compile for a TPU topology such as tpu:v5e:2x2 (needs libtpu); the local backend when unset."""
    mesh: str | None = None
    """Semicolon-separated device meshes, e.g. 'data=8' or 'data=8;data=2,fsdp=2,tensor=2' (per-device bytes).
    As in train.py: one device when unset (all devices on 'data' with --zero > 0), and a pipeline adds a 'stage'
    axis to a mesh without one."""
    zero: str = "0"
    """Comma-separated ZeRO stages (0-3) compiled on each --mesh (without one, on all devices on 'data')."""
    rules: str = ""
    """Sharding-rule overrides 'logical=mesh_axes,...' (with --mesh)."""
    pipeline_stages: int = 1
    """Pipeline stages over the --mesh's 'stage' axis (1: no pipeline)."""
    microbatches: str = "1"
    """Comma-separated pipeline microbatch counts (with --pipeline-stages > 1)."""
    pipeline_schedule: str = "gpipe"
    """Comma-separated pipeline schedules: gpipe, 1f1b."""
    attention: str | None = None
    """Attention implementation: auto, pallas, xla, reference (the preset's, xla, when unset). With a TPU
    --target, pallas compiles the Mosaic flash kernel."""
    out: str = "docs/memory_sweep.json"
    """JSON records."""
    md: str = "docs/memory_sweep.md"
    """Markdown table."""
    png: str = "docs/memory_sweep.png"
    """Bar chart."""


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(SweepConfig, args=argv, description=__doc__.split("\n\n")[0])
    try:
        if cfg.preset not in PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; accepted: {', '.join(PRESETS)}")
        if cfg.pipeline_stages < 1:
            raise ValueError(f"--pipeline-stages {cfg.pipeline_stages}; accepted: a positive integer")
        check_image_path(cfg.png, "--png")
        accums = []
        for a in parse_list(cfg.accum, "accum"):
            if not a.isdigit():
                raise ValueError(f"--accum {a!r} is not a positive integer")
            accums.append(int(a))
        zeros = []
        for z in parse_list(cfg.zero, "zero"):
            if not z.isdigit():
                raise ValueError(f"--zero {z!r} is not a ZeRO stage; accepted: 0, 1, 2, 3")
            zeros.append(int(z))
        meshes = [m.strip() for m in cfg.mesh.split(";") if m.strip()] if cfg.mesh else [None]
        if cfg.mesh is not None and not meshes:
            raise ValueError("--mesh is empty; give a mesh such as 'data=8'")
        micros = []
        for m in parse_list(cfg.microbatches, "microbatches"):
            if not m.isdigit() or int(m) < 1:
                raise ValueError(f"--microbatches {m!r} is not a positive integer")
            micros.append(int(m))
        grid = dict(microbatches=micros, schedules=parse_list(cfg.pipeline_schedule, "pipeline-schedule"),
                    remats=parse_list(cfg.remat, "remat"), precisions=parse_list(cfg.precision, "precision"),
                    accums=accums, optimizers=parse_list(cfg.optimizer, "optimizer"), meshes=meshes, zeros=zeros)
        # Every value of every list, in every combination, before the first compile: one line naming the
        # flag, not a failure midway through the sweep.
        validate_grid(cfg.batch, seq=cfg.seq, target=cfg.target, rules=cfg.rules, attention=cfg.attention,
                      pipeline_stages=cfg.pipeline_stages, mc=PRESETS[cfg.preset](), **grid)
        # Outputs after the flags, before compiling: a path that cannot be written fails now, not after the sweep.
        check_separate({"--out": cfg.out, "--md": cfg.md, "--png": cfg.png})
        out, md, png = (prepare_output(p, f) for f, p in (("--out", cfg.out), ("--md", cfg.md), ("--png", cfg.png)))
        n = 1
        for v in grid.values():
            n *= len(v)
        print(f"{cfg.preset} batch={cfg.batch} seq={cfg.seq} target={cfg.target or 'local'} "
              f"attention={cfg.attention or 'preset'}: {n} compilations")

        done: list[dict] = []

        def show(r):
            done.append(r)
            write_tables(done, out, md, cfg.preset, cfg.batch, cfg.seq, cfg.rules)
            where = f"{r['mesh']} zero={r['zero']} " if r["mesh"] else ""
            where += f"[{r['pipeline']}] " if r["pipeline"] else ""
            print(f"  {where}{r['remat']:>20s} {r['precision']:>5s} accum={r['accum']} {r['optimizer']:>9s}  "
                  f"temp {r['temp_bytes'] / 2**20:9.1f} MiB  total {r['total_bytes'] / 2**20:9.1f} MiB  "
                  f"{r['flops'] / 1e9:8.1f} GFLOPs (cost model)  {(r['matmul_flops'] or float('nan')) / 1e9:8.1f} "
                  f"matmul GFLOPs  ({r['compile_s']:.0f}s)", flush=True)

        records = sweep(PRESETS[cfg.preset](), batch=cfg.batch, seq=cfg.seq, target=cfg.target, on_record=show,
                        rules=cfg.rules, attention=cfg.attention, pipeline_stages=cfg.pipeline_stages, **grid)
    except ValueError as e:
        remove_unused_dirs()
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot_records(records, png, write_tables(records, out, md, cfg.preset, cfg.batch, cfg.seq, cfg.rules))
    print(f"wrote {cfg.out}, {cfg.md}, {cfg.png}")
    return 0


def write_tables(records: list[dict], out, md, preset: str, batch: int, seq: int, rules: str) -> str:
    """Write the records so far to the JSON and markdown files; returns the table's title."""
    rules = f", rules {rules}" if rules else ""
    title = f"{preset} batch {batch} x {seq} [{records[0]['target']}, attention {records[0]['attention']}{rules}]"
    out.write_text(json.dumps(records, indent=1))
    md.write_text(f"# Memory sweep: {title}\n\n{markdown_table(records)}\n")
    return title


if __name__ == "__main__":
    sys.exit(main())

"""The memory table a training run prints first: the compiler's measurement of one step beside
the analytic estimate, and the step's FLOPs.

Example:
    >>> print(memory_table(report, estimate_bytes(run), step_matmul_flops(cfg, report, compiled)))
"""

from __future__ import annotations

import numpy as np

from jmem.memory.estimate import PARAM_PARTS
from jmem.memory.measure import MemoryReport
from jmem.train.config import TrainConfig
from jmem.train.setup import Run


def estimate_bytes(run: Run) -> dict[str, int]:
    """Analytic bytes of one step (`jmem.memory.estimate`) beside the measurement."""
    from jmem.memory.estimate import estimate
    from jmem.train.checks import lora_targets
    from jmem.train.setup import BASE_GROUP_SIZE, needs_master_weights

    cfg, mc = run.cfg, run.model_config
    lora = {}
    if cfg.lora_rank:
        # Adapters are f32 and `--quantize-base rtn` is 4-bit in groups of BASE_GROUP_SIZE rows (jmem.train.setup).
        lora = dict(lora_rank=cfg.lora_rank, lora_targets=lora_targets(cfg, mc), quantize_base=cfg.quantize_base,
                    base_group_size=BASE_GROUP_SIZE if cfg.quantize_base == "rtn" else None, lora_dtype="f32")
    kw = {"rank": cfg.galore_rank} if cfg.optimizer == "galore" else None
    est = estimate(mc, cfg.batch, cfg.seq, remat=cfg.remat, optimizer=cfg.optimizer, optimizer_kw=kw, accum=cfg.accum,
                   loss_chunk=mc.loss_chunk, master_weights=needs_master_weights(cfg, run.policy),
                   trained_layers=cfg.layerwise or None, **lora)
    # Offloaded parts leave the device total (the measured rows show where they went).
    off = {}
    if cfg.offload_optimizer != "none":
        off["optimizer"], off["update"] = est["optimizer"], est["update"]
    if cfg.offload_params != "none":
        from jmem.memory.estimate import layer_grad_bytes, layer_param_bytes

        off["params"] = layer_param_bytes(mc, run.policy.param, **lora)
        off["grads"] = layer_grad_bytes(mc, run.policy.param, accum=cfg.accum, **lora)
    for key, b in off.items():
        est[key] -= b
        est["total"] -= b
    if off:
        est["off device"] = sum(off.values())
    return est


def step_matmul_flops(cfg: TrainConfig, report: MemoryReport, compiled) -> tuple[str, float]:
    """(what is counted, matmul FLOPs per step) for the memory table.

    Every loop iteration's matmuls (`MemoryReport.matmul_flops`), except under the 1F1B
    schedule, whose ticks pick forward, backward or idle work at run time: there the
    busiest stage's (`jmem.parallel.busiest_stage_matmul_flops`, per device), each
    stage running --microbatches forward and backward ticks per accumulation step.
    """
    if cfg.pipeline_stages > 1 and cfg.pipeline_schedule == "1f1b" and not report.target.startswith("tpu"):
        from jmem import parallel as par

        return ("busiest pipeline stage",
                par.busiest_stage_matmul_flops(compiled.as_text(), cfg.microbatches * cfg.accum))
    return "every loop iteration", report.matmul_flops


def memory_table(report: MemoryReport, estimate: dict[str, int],
                 matmul: tuple[str, float] | None = None, *, offload=None, devices: int = 1,
                 compute_dtype=None) -> str:
    """Measured (compiler) and estimated (analytic) memory of one step, MiB; `matmul` is
    `step_matmul_flops`'s (label, FLOPs), the report's own count when None. `offload`: the
    `jmem.memory.offload.OffloadReport` of an offloaded step (`report` is its device program).
    `devices` > 1: the step runs on a mesh; the measured rows and FLOPs are one device's, the
    estimate is the unsharded model's (the header and a last line say so). `compute_dtype` of 2 bytes
    measured on the CPU backend: a last line says the backend computes it in f32 (the estimate does not)."""
    matmul = ("every loop iteration", report.matmul_flops) if matmul is None else matmul
    if offload is None:
        args = ("arguments (params, opt state, batch)", report.argument_bytes)
        total = report.total_bytes
    else:
        args = ("arguments (params, batch)", offload.device_argument_bytes)
        total = offload.device_total_bytes
    rows = [("measured", *args),
            ("measured", "temp (activations, grads, logits)", report.temp_bytes),
            ("measured", "outputs", report.output_bytes if offload is None else offload.device_output_bytes),
            ("measured", "  of which aliased to arguments", report.alias_bytes),
            ("measured", "total live", total)]
    if report.peak_bytes and report.target != "cpu":  # a TPU target's temp misses a small program's activations
        rows.append(("measured", "XLA's peak", report.peak_bytes))
    if report.host_total_bytes:
        rows.append(("measured", "host memory (offloaded)", report.host_total_bytes))
    if offload is not None:
        # The state files hold the whole optimizer state, not one device's share.
        rows += [("measured", "disk optimizer state, all devices" if where == "disk" and devices > 1
                  else f"{where} {what.strip()}", b)
                 for where, what, b in offload.rows() if where != "device" and (b or "optimizer" in what)]
    for k, v in estimate.items():
        if k in PARAM_PARTS:  # shown under params, which holds them
            continue
        if v or k == "total":
            rows.append(("estimated", k, v))
        if k == "params":
            rows += [("estimated", f"  of which {p}", estimate[p]) for p in PARAM_PARTS if estimate.get(p)]
    title = f"memory of one train step [{report.target}]" + (f", per device of {devices}" if devices > 1 else "")
    lines = [title + " " * max(1, 49 - len(title)) + "MiB"]
    lines += [f"  {kind:<10s}{name:<38s}{b / 2**20:10.2f}" for kind, name, b in rows]
    lines.append(f"  {'cost model GFLOPs (loop bodies once)':<48s}{report.flops / 1e9:10.3f}")
    lines.append(f"  {f'matmul GFLOPs per step ({matmul[0]})':<48s}{matmul[1] / 1e9:10.3f}")
    if devices > 1:
        lines.append("  (estimated: the whole step on one device, unsharded)")
    if report.target == "cpu" and compute_dtype is not None and np.dtype(compute_dtype).itemsize == 2:
        lines.append(f"  (estimated: {np.dtype(compute_dtype).name} activations; the CPU backend computes them in f32)")
    return "\n".join(lines)


def count_text(n: int) -> str:
    """A parameter count: millions down to 0.10M, thousands below (a tiny model's adapters are not 0.00M)."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"

"""Compile (never run) the train step over a grid of memory settings.

Each record is what XLA's buffer assignment and cost model report for one
combination of remat policy x precision x accumulation x optimizer, on the
local backend or an ahead-of-time TPU target. The model is built abstractly
(`nnx.eval_shape`), so no parameter is allocated: a sweep of a model that does
not fit on this machine still runs.

Example:
    >>> recs = sweep(LlamaConfig.bench_8l(), batch=8, seq=1024, remats=["none", "full"],
    ...              precisions=["f32"], accums=[1], optimizers=["adamw"])
    >>> recs[1]["temp_bytes"] / recs[0]["temp_bytes"]
"""

from __future__ import annotations

import itertools
import math
import time
import types
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem.checks import is_int
from jmem.kernels.dispatch import IMPLS
from jmem.memory.accumulate import check_divisible
from jmem.memory.measure import measure_and_compile, parse_target, tree_bytes
from jmem.memory.precision import Policy, loss_scale_for
from jmem.memory.remat import validate as validate_remat
from jmem.models.config import LlamaConfig
from jmem.train.config import OPTIMIZERS, TrainConfig
from jmem.train.report import step_matmul_flops
from jmem.train.setup import _dtype_name, make_tx
from jmem.train.step import make_train_fns

RECORD_KEYS = ("remat", "precision", "accum", "optimizer", "argument_bytes", "temp_bytes", "output_bytes",
               "total_bytes", "flops", "matmul_flops", "param_bytes", "opt_state_bytes", "mesh", "zero",
               "param_bytes_per_device", "grad_bytes_per_device", "opt_bytes_per_device", "attention", "pipeline")


def parse_list(text: str, name: str) -> list[str]:
    """`"none, full"` -> ["none", "full"]. Consecutive `key=value` parts are one spec (`"f32,p=bf16,
    c=bf16,o=f32"` -> ["f32", "p=bf16,c=bf16,o=f32"]); `;` separates two such specs. An empty list is an
    error."""
    items = []
    for group in text.split(";"):
        spec = []  # the parts of the key=value spec being read
        for part in (t.strip() for t in group.split(",")):
            if not part:
                continue
            if "=" in part:
                spec.append(part)
                continue
            if spec:
                items.append(",".join(spec))
                spec = []
            items.append(part)
        if spec:
            items.append(",".join(spec))
    if not items:
        raise ValueError(f"--{name} is empty; give a comma-separated list")
    return items


def _translate(flag: str, value, message: str, accepted: str) -> str:
    """A check's message as one line naming the flag: `--flag=value ...; accepted: ...`."""
    head, bare = f"{flag}={value}", f"{flag.lstrip('-')}={value}"
    if message.startswith((head, "--")):  # names its flag already (`check_batch_split`'s messages)
        pass
    elif message.startswith(bare):  # "accum=3 does not divide ..." -> "--accum=3 does not divide ..."
        message = "--" + message
    else:
        message = f"{head}: {message}"
    if "accepted" not in message:
        message += f"; accepted: {accepted}"
    return message


def _named(flag: str, value, check: Callable, *args, accepted: str):
    """`check(*args)`, its ValueError re-raised as one line that names `flag` and `value`."""
    try:
        return check(*args)
    except ValueError as e:
        raise ValueError(_translate(flag, value, str(e), accepted)) from None


def validate_grid(batch: int, remats, precisions, accums, optimizers, target: str | None, meshes=(None,),
                  zeros=(0,), *, seq: int, microbatches=(1,), schedules=("gpipe",), pipeline_stages: int = 1,
                  rules: str = "", attention: str | None = None, mc: LlamaConfig | None = None) -> None:
    """Every value of every list, and every combination of them, checked before the first compile
    with the checks the train step uses (`jmem.train.checks`, `jmem.parallel`).

    Raises:
        ValueError: one line `--flag=value ...; accepted: ...` naming the first bad value.
    """
    from jmem import parallel as par
    from jmem.memory.precision import ALIASES
    from jmem.memory.remat import POLICIES
    from jmem.parallel.mesh import resolve_shape
    from jmem.parallel.pipeline_1f1b import SCHEDULES, check_schedule
    from jmem.train.checks import (check_batch_split, check_parallel_flags, check_seq_split, mesh_spec, rules_for,
                                   train_policy)

    for name, value in (("batch", batch), ("seq", seq)):
        if not is_int(value) or value < 1:
            raise ValueError(f"--{name}={value!r}; accepted: an integer >= 1")
    if mc is not None:  # attention scores [batch, heads, seq, seq], logits, MLP activations
        from jmem.memory.measure import MAX_COMPILE_ELEMENTS

        largest = batch * seq * max(mc.vocab_size, mc.ffn_dim, mc.n_heads * seq)
        if largest > MAX_COMPILE_ELEMENTS:
            raise ValueError(f"--batch={batch} --seq={seq}: the step's largest array would hold {largest:.3g} "
                             f"elements, beyond the {MAX_COMPILE_ELEMENTS:.3g} XLA can compile; accepted: a smaller "
                             "--batch or --seq")
    for name, values in (("remat", remats), ("precision", precisions), ("accum", accums), ("optimizer", optimizers),
                         ("mesh", meshes), ("zero", zeros), ("microbatches", microbatches),
                         ("pipeline-schedule", schedules)):
        if not values:  # an empty product would return no records and say nothing
            raise ValueError(f"--{name}: an empty list; accepted: at least one value")
        twice = sorted({str(v) for v in values if list(values).count(v) > 1})
        if twice:  # each would compile the same step again, and the table's baseline would take the last
            raise ValueError(f"--{name}: {', '.join(twice)} given more than once; accepted: each value once")
    for r in remats:
        _named("--remat", r, validate_remat, r,
               accepted=f"{', '.join(POLICIES)}, or a spec 'name=remat|device|offload,...'")
    for p in precisions:
        _named("--precision", p, train_policy, p, accepted=f"{', '.join(ALIASES)}, or 'p=DTYPE,c=DTYPE,o=f32'")
    for a in accums:
        _named("--accum", a, check_divisible, batch, a, accepted=f"a positive integer that divides --batch={batch}")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"--optimizer={o}: unknown optimizer; accepted: {', '.join(OPTIMIZERS)}")
    for z in zeros:
        _named("--zero", z, par.check_stage, z, accepted="0, 1, 2, 3")
    for s in schedules:
        _named("--pipeline-schedule", s, check_schedule, s, accepted=", ".join(SCHEDULES))
    for k in microbatches:
        if not is_int(k) or k < 1:
            raise ValueError(f"--microbatches={k}: not a pipeline microbatch count; accepted: a positive integer")
    if attention is not None and attention not in IMPLS:
        raise ValueError(f"--attention={attention}: unknown attention; accepted: {', '.join(IMPLS)}")
    if target is not None:
        _named("--target", target, parse_target, target, accepted="'tpu:CHIP:TOPOLOGY' such as 'tpu:v5e:2x2'")
    _named("--rules", rules, par.Rules.parse, rules, accepted="'logical=mesh_axes,...'")
    off_default = [f"--{flag}={','.join(map(str, values))}" for flag, values, default in (
        ("microbatches", microbatches, [1]), ("pipeline-schedule", schedules, ["gpipe"])) if list(values) != default]
    if pipeline_stages == 1 and off_default:
        raise ValueError(f"{' and '.join(off_default)} needs --pipeline-stages > 1 (without a pipeline each value "
                         "would compile the same step again); accepted: the default (--microbatches 1, "
                         "--pipeline-schedule gpipe) with --pipeline-stages 1")
    # The train step's checks, one combination at a time, on the mesh train.py would build from the same
    # flags (`jmem.train.checks.check_parallel_flags`, `mesh_spec`, `jmem.train.setup.mesh_for`).
    for m, z in itertools.product(meshes, zeros):
        for a, k, schedule, remat in itertools.product(accums, microbatches if pipeline_stages > 1 else (1,),
                                                       schedules, remats):
            cfg = TrainConfig(batch=batch, seq=seq, accum=a, mesh=m, zero=z, rules=rules,
                              pipeline_stages=pipeline_stages, microbatches=k, pipeline_schedule=schedule, remat=remat)
            spec = mesh_spec(cfg)
            if spec is None:
                check_parallel_flags(cfg, mc)
                continue
            shape = _named("--mesh", m if spec == m else f"{m} (as {spec}, the stage axis added)", resolve_shape,
                           spec, jax.device_count(),
                           accepted=f"axis sizes that multiply to the {jax.device_count()} devices")
            if pipeline_stages > 1 and shape["stage"] != pipeline_stages:
                raise ValueError(f"--mesh={m} has stage={shape['stage']} but --pipeline-stages={pipeline_stages}; "
                                 f"accepted: a mesh with stage={pipeline_stages}")
            _named("--mesh", m, check_batch_split, cfg, shape,
                   accepted=f"a mesh whose data-parallel size x --accum {a} divides --batch={batch}")
            check_parallel_flags(cfg, mc)
            check_seq_split(cfg, types.SimpleNamespace(shape=shape))
            if mc is not None:
                _named("--mesh", m, par.check_heads, mc.n_heads, mc.n_kv_heads, rules_for(cfg), shape,
                       accepted="a tensor axis that divides the head counts")


def compile_record(mc: LlamaConfig, *, batch: int, seq: int, remat: str, precision: str, accum: int,
                   optimizer: str, target: str | None = None, mesh: str | None = None, zero: int = 0,
                   rules: str = "", attention: str | None = None, pipeline_stages: int = 1,
                   microbatches: int = 1, schedule: str = "gpipe") -> dict:
    """Memory and FLOPs of one jitted train step (donated state), compiled only.

    With `mesh` (e.g. "data=8") the step is compiled with the ZeRO-`zero` shardings of
    `jmem.parallel.jit_train_step` (byte counts are then per device), on the mesh train.py builds
    from the same flags (`jmem.train.checks.mesh_spec`: all devices on `data` for a `zero` > 0
    without a mesh, a `stage` axis added under a pipeline). `attention`
    overrides the model's attention implementation (`jmem.kernels.IMPLS`); with a TPU
    `target`, "pallas" (and "auto") compile the Mosaic flash kernel. Every record
    also has `attention`, `mesh`, `zero` and the per-device model-state bytes
    (`param_bytes_per_device`, `grad_bytes_per_device`, `opt_bytes_per_device`,
    from those shardings; the whole trees without a mesh). With `pipeline_stages` > 1 the
    loss runs the `schedule` ("gpipe" or "1f1b") over `microbatches` on the mesh's
    `stage` axis, and the record has `pipeline` = "S stages x M microbatches, schedule";
    a 1F1B record's `matmul_flops` is its busiest stage's per step, as train.py's memory
    table counts it (`jmem.train.report.step_matmul_flops`).
    """
    from jmem import parallel as par
    from jmem.models.llama import Llama
    from jmem.train.checks import mesh_spec, rules_for

    policy = Policy.parse(precision)
    mc = mc.replace(param_dtype=_dtype_name(policy.param), compute_dtype=_dtype_name(policy.compute), remat=remat,
                    max_seq_len=max(mc.max_seq_len, seq), attention_impl=attention or mc.attention_impl)
    model = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
    tcfg = TrainConfig(optimizer=optimizer, precision=precision, steps=1000, warmup=0, mesh=mesh, zero=zero,
                       rules=rules, accum=accum, pipeline_stages=pipeline_stages, microbatches=microbatches,
                       pipeline_schedule=schedule)
    # The run's rules and mesh, as train.py's: `layers=stage` and a stage axis under a pipeline, all devices
    # on `data` for ZeRO without a mesh.
    rules = rules_for(tcfg)
    spec = mesh_spec(tcfg)
    dmesh = par.make_mesh(spec) if spec is not None else None
    tx = make_tx(tcfg, policy, dmesh)
    loss_fn = None
    if pipeline_stages > 1:
        loss_fn, _ = par.schedule_lm_loss_fn(schedule, model, n_stages=pipeline_stages,
                                             n_microbatches=microbatches, mesh=dmesh, chunk=mc.loss_chunk)
    fns = make_train_fns(model, tx, accum=accum, loss_chunk=mc.loss_chunk, loss_scale=loss_scale_for(policy),
                         mesh=dmesh, zero=zero, rules=rules or None, loss_fn=loss_fn)
    # Initialise inside eval_shape: shapes only, no parameter is allocated.
    state = jax.eval_shape(lambda: fns.init_state(Llama(mc, rngs=nnx.Rngs(0))))
    batch_abs = {"inputs": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                 "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                 "mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    t0 = time.perf_counter()
    if dmesh is None:
        step = jax.jit(fns.step, donate_argnums=0)
        # One device: every tree whole (the ZeRO-0 layout on a 1-device mesh).
        state_mesh = par.make_mesh("data=1", devices=jax.devices()[:1])
    else:
        step, _, _ = par.jit_train_step(fns.step, state, dmesh, zero=zero, rules=rules or None)
        state_mesh = dmesh
    r, compiled = measure_and_compile(step, state, batch_abs, target=target)
    if pipeline_stages > 1 and schedule == "1f1b":  # a program that would hang is no record
        par.check_tick_collectives(compiled.as_text(), dmesh)
    # Under 1F1B ticks choose their work at run time; the schedule knows how often each kind runs.
    _, matmul = step_matmul_flops(tcfg, r, compiled)
    per_device = par.model_state_bytes(state, state_mesh, stage=zero if dmesh is not None else 0,
                                       rules=rules or None)
    return {
        "mesh": par.mesh_summary(dmesh) if dmesh is not None else None, "zero": zero, "rules": rules or None,
        **per_device,
        "remat": remat, "precision": precision, "accum": accum, "optimizer": optimizer,
        "attention": mc.attention_impl,
        "pipeline": f"{pipeline_stages} stages x {microbatches} microbatches, {schedule}" if pipeline_stages > 1
        else None,
        "argument_bytes": r.argument_bytes, "temp_bytes": r.temp_bytes, "output_bytes": r.output_bytes,
        "total_bytes": r.total_bytes, "peak_bytes": r.peak_bytes if r.target != "cpu" else None, "flops": r.flops,
        "matmul_flops": matmul if math.isfinite(matmul) else None,
        "param_bytes": tree_bytes(state.params), "opt_state_bytes": tree_bytes(state.opt_state),
        "alias_bytes": r.alias_bytes, "host_temp_bytes": r.host_temp_bytes, "target": r.target,
        "batch": batch, "seq": seq, "compile_s": round(time.perf_counter() - t0, 2),
    }


def sweep(mc: LlamaConfig, *, batch: int, seq: int, remats: Iterable[str], precisions: Iterable[str],
          accums: Iterable[int], optimizers: Iterable[str], target: str | None = None,
          meshes: Iterable[str | None] = (None,), zeros: Iterable[int] = (0,), rules: str = "",
          attention: str | None = None, pipeline_stages: int = 1, microbatches: Iterable[int] = (1,),
          schedules: Iterable[str] = ("gpipe",), on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """One `compile_record` per combination (mesh varies slowest, then zero, microbatches,
    schedule, remat, precision, accum; optimizer fastest)."""
    remats, precisions, accums, optimizers, meshes, zeros, microbatches, schedules = map(
        list, (remats, precisions, accums, optimizers, meshes, zeros, microbatches, schedules))
    # Every combination before the first compile: a late bad value would lose the compiles before it.
    validate_grid(batch, remats, precisions, accums, optimizers, target, meshes, zeros, seq=seq,
                  microbatches=microbatches, schedules=schedules, pipeline_stages=pipeline_stages, rules=rules,
                  attention=attention, mc=mc)
    out = []
    for mesh, zero, micro, schedule, remat, precision, accum, optimizer in itertools.product(
            meshes, zeros, microbatches, schedules, remats, precisions, accums, optimizers):
        rec = compile_record(mc, batch=batch, seq=seq, remat=remat, precision=precision, accum=accum,
                             optimizer=optimizer, target=target, mesh=mesh, zero=zero, rules=rules,
                             attention=attention, pipeline_stages=pipeline_stages, microbatches=micro,
                             schedule=schedule)
        out.append(rec)
        if on_record is not None:
            on_record(rec)
    return out


def _short_pipeline(pipeline: str) -> str:
    """'2 stages x 4 microbatches, 1f1b' as '2x4 1f1b' (a chart label)."""
    counts, schedule = pipeline.split(", ")
    stages, micro = counts.split(" stages x ")
    return f"{stages}x{micro.split()[0]} {schedule}"


def _gflops(flops) -> str:
    return "-" if flops is None else f"{flops / 1e9:.1f}"


def markdown_table(records: list[dict]) -> str:
    """One row per record: MiB columns, GFLOPs (the cost model's, which counts a loop body
    once, and the matmul FLOPs of every iteration), and temp/FLOPs relative to the matching
    baseline (remat none, same precision/accum/optimizer) when present."""
    if any(r.get("mesh") for r in records):
        return zero_table(records)
    base = {(r["precision"], r["accum"], r["optimizer"]): r for r in records if r["remat"] == "none"}
    head = ("| remat | precision | accum | optimizer | params MiB | opt state MiB | arguments MiB | temp MiB "
            "| total MiB | GFLOPs (cost model) | matmul GFLOPs | temp / none | FLOPs / none | matmul FLOPs / none |")
    lines = [head, "|" + "---|" * 14]
    for r in records:
        b = base.get((r["precision"], r["accum"], r["optimizer"]))
        rel_t = f"{r['temp_bytes'] / b['temp_bytes']:.3f}" if b else ""
        rel_f = f"{r['flops'] / b['flops']:.3f}" if b and b["flops"] else ""
        rel_m = f"{r['matmul_flops'] / b['matmul_flops']:.3f}" if b and r.get("matmul_flops") and b.get(
            "matmul_flops") else ""
        mib = lambda k: f"{r[k] / 2**20:.1f}"  # noqa: E731,B023
        lines.append(f"| {r['remat']} | {r['precision']} | {r['accum']} | {r['optimizer']} | {mib('param_bytes')} "
                     f"| {mib('opt_state_bytes')} | {mib('argument_bytes')} | {mib('temp_bytes')} | {mib('total_bytes')} "
                     f"| {r['flops'] / 1e9:.1f} | {_gflops(r.get('matmul_flops'))} | {rel_t} | {rel_f} | {rel_m} |")
    return "\n".join(lines)


def zero_table(records: list[dict]) -> str:
    """One row per record of a mesh sweep: per-device model-state MiB (from the shardings)
    beside the compiler's per-device argument / temp / total MiB."""
    head = ("| mesh | zero | pipeline | remat | precision | accum | optimizer | params MiB/dev | grads MiB/dev "
            "| opt MiB/dev | model state MiB/dev | arguments MiB | temp MiB | total MiB | GFLOPs (cost model) "
            "| matmul GFLOPs |")
    lines = [head, "|" + "---|" * 16]
    for r in records:
        mib = lambda k: f"{r[k] / 2**20:.2f}"  # noqa: E731,B023
        state = r["param_bytes_per_device"] + r["grad_bytes_per_device"] + r["opt_bytes_per_device"]
        lines.append(f"| {r.get('mesh') or '1 device'} | {r['zero']} | {r.get('pipeline') or '-'} | {r['remat']} "
                     f"| {r['precision']} | {r['accum']} "
                     f"| {r['optimizer']} | {mib('param_bytes_per_device')} | {mib('grad_bytes_per_device')} "
                     f"| {mib('opt_bytes_per_device')} | {state / 2**20:.2f} | {mib('argument_bytes')} "
                     f"| {mib('temp_bytes')} | {mib('total_bytes')} | {r['flops'] / 1e9:.1f} "
                     f"| {_gflops(r.get('matmul_flops'))} |")
    return "\n".join(lines)


def plot_records(records: list[dict], path: str, title: str = "") -> None:
    """Stacked bars (arguments + temp) per record, MiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [(f"{r['mesh']}/z{r['zero']}/" if r.get("mesh") else "")
              + (_short_pipeline(r["pipeline"]) + "/" if r.get("pipeline") else "")
              + f"{r['remat']}/{r['precision']}/a{r['accum']}/{r['optimizer']}" for r in records]
    arg = np.array([r["argument_bytes"] for r in records]) / 2**20
    tmp = np.array([r["temp_bytes"] for r in records]) / 2**20
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(records) + 2), 5))
    x = np.arange(len(records))
    ax.bar(x, arg, label="arguments (params, opt state, batch)")
    ax.bar(x, tmp, bottom=arg, label="temp (activations, grads, logits)")
    ax.set_xticks(x, labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("MiB per device")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

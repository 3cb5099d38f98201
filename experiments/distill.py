"""Distil SmolLM2-135M into a layer-dropped student, beside the same student trained on plain CE.

The student is `jmem.distill.student_from_teacher` with every other teacher block
(or `--student-layers`). Both runs start from that same student, take the same
batches for `--steps` steps with the same optimizer, and differ only in the loss:
`alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE` versus CE alone (alpha=0).
The printed table gives each student's held-out cross-entropy (nats/token on the
validation windows of the text) before and after, and the teacher's own.

    python experiments/distill.py
    python experiments/distill.py --steps 200 --batch 8 --seq 256 --temperature 4 --alpha 0.9
    python experiments/distill.py --student-layers 0,1,2,27,28,29 --kind reverse --text FILE
    python experiments/distill.py --steps 500 --save-student draft/
    jmem serve --model smollm2-135m --num-speculative-tokens 4 --speculative-model draft/   # the student as draft

Bad flags end with one `error:` line on stderr and exit status 2, before the model loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmem
from jmem.data import PackedDataset, data_name, load_documents
from jmem.distill import KINDS, check_distill_args, make_distill_fns, student_from_teacher
from jmem.experiment import run_experiment
from jmem.io.paths import undo_on_failure
from jmem.lm import PACKAGED_MODELS
from jmem.models.config import PRESETS
from jmem.quant.saved import check_new_dir, save_quantized
from jmem.train.loss import lm_loss_terms


@dataclasses.dataclass(frozen=True)
class Config:
    """Knowledge distillation versus plain cross-entropy for a layer-dropped student."""

    teacher: str = "smollm2-135m"
    """Teacher model for `jmem.load` (a name or a GGUF path)."""
    student_layers: str = ""
    """Comma-separated teacher block indices copied into the student (default: every other block, from 0)."""
    steps: int = 20
    """Optimizer steps of each run."""
    batch: int = 4
    """Sequences per step."""
    seq: int = 64
    """Tokens per sequence."""
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    temperature: float = 2.0
    """Softmax temperature T of the KL term (> 0)."""
    alpha: float = 0.5
    """Weight of the KL term in [0, 1]; the baseline run uses 0."""
    kind: str = "forward"
    """KL direction: forward = KL(teacher || student), reverse = KL(student || teacher)."""
    chunk: int | None = None
    """Sequence positions per loss chunk (--seq or more: one chunk; a shorter tail is one more chunk); default:
    the model's loss_chunk."""
    eval_batches: int = 8
    """Validation batches (of --batch sequences) for the held-out cross-entropy."""
    text: str | None = None
    """Training text file (default: the standard library's pydoc_data.topics)."""
    seed: int = 0
    """Batch order seed."""
    save_student: str | None = None
    """A new directory to write the distilled student to, with the teacher's tokenizer (`jmem.load` reads it;
    `jmem serve --model TEACHER --num-speculative-tokens 4 --speculative-model DIR` serves it as the
    teacher's draft)."""


def parse_layers(spec: str) -> list[int] | None:
    """`"0,2,4"` -> [0, 2, 4]; "" -> None (every other block). Range is checked once the teacher is known."""
    if not spec.strip():
        return None
    try:
        layers = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--student-layers {spec!r}; accepted: comma-separated block indices such as 0,2,4") from None
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise ValueError(f"--student-layers {spec!r}; accepted: distinct non-negative block indices such as 0,2,4")
    return layers


def validate(cfg: Config) -> tuple[list[int] | None, list[str]]:
    """(student layers, documents) after checking every flag; nothing is loaded. The --save-student
    directory is created, empty."""
    for flag, v, low in [("--steps", cfg.steps, 1), ("--batch", cfg.batch, 1), ("--seq", cfg.seq, 2),
                         ("--eval-batches", cfg.eval_batches, 1), ("--seed", cfg.seed, 0)]:
        if v < low:
            raise ValueError(f"{flag} {v}; accepted: an integer >= {low}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"--lr {cfg.lr}; accepted: a finite number > 0")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ValueError(f"--temperature {cfg.temperature}; accepted: a finite number > 0")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise ValueError(f"--alpha {cfg.alpha}; accepted: a number in [0, 1]")
    if cfg.kind not in KINDS:
        raise ValueError(f"--kind {cfg.kind!r}; accepted: {', '.join(KINDS)}")
    check_distill_args(cfg.temperature, cfg.alpha, cfg.kind)
    if cfg.chunk is not None and cfg.chunk < 1:
        raise ValueError(f"--chunk {cfg.chunk}; accepted: an integer >= 1, or unset")
    layers = parse_layers(cfg.student_layers)
    docs = load_documents(cfg.text, "--text")
    if cfg.save_student is not None:
        check_new_dir(cfg.save_student, "--save-student")
    return layers, docs


def train_student(student, teacher, data, eval_fn, cfg: Config, alpha: float) -> tuple[dict, nnx.State]:
    """Train a fresh copy of `student` for cfg.steps: (held-out CE after and per-step losses, trained params)."""
    fns = make_distill_fns(student, teacher, optax.adamw(cfg.lr), temperature=cfg.temperature, alpha=alpha,
                           kind=cfg.kind, chunk=cfg.chunk)
    params, opt = fns.init(student)
    step = jax.jit(fns.step, donate_argnums=(0, 1))
    teacher_state = nnx.state(teacher)
    losses, t0 = [], None
    for i in range(cfg.steps):
        batch = jax.tree.map(jnp.asarray, data.batch(i, cfg.batch, cfg.seed))
        params, opt, m = step(params, opt, teacher_state, batch)
        losses.append((float(m["loss"]), float(m["ce"])))
        if i == 0:
            t0 = time.perf_counter()  # step time without the compile
        if i == 0 or (i + 1) % 5 == 0 or i + 1 == cfg.steps:
            print(f"  step {i + 1:3d}/{cfg.steps}: objective {losses[-1][0]:.3f}  train CE {losses[-1][1]:.3f}",
                  flush=True)
    # The first step compiles: with one step there is no step time to report.
    step_s = (time.perf_counter() - t0) / (cfg.steps - 1) if cfg.steps > 1 else None
    return {"eval_ce": eval_fn(params), "first_ce": losses[0][1], "last_ce": losses[-1][1], "step_s": step_s}, params


def main(cfg: Config) -> dict:
    layers, docs = validate(cfg)
    with contextlib.ExitStack() as undo:
        if cfg.save_student is not None:
            # Created (empty) before the teacher loads, so a path that cannot be made fails now, not when
            # the trained student is saved; removed again if the run fails before the student is written.
            undo.enter_context(undo_on_failure(cfg.save_student, "--save-student", directory=True))
        return run(cfg, layers, docs, undo)


def run(cfg: Config, layers: list[int] | None, docs: list[str], undo: contextlib.ExitStack) -> dict:
    """Load the teacher, train the distilled and the plain-CE students, save the first (--save-student).
    Once the student is written, `undo` is left: a failure of the plain-CE run keeps it."""
    try:
        lm = jmem.load(cfg.teacher)
    except FileNotFoundError as e:
        raise ValueError(f"--teacher {cfg.teacher!r} is unavailable: {e}") from None
    teacher, n = lm.model, lm.config.n_layers
    if cfg.seq > lm.config.max_seq_len:
        raise ValueError(f"--seq {cfg.seq} exceeds the teacher's context {lm.config.max_seq_len}")
    layers = list(range(0, n, 2)) if layers is None else layers
    if max(layers) >= n:
        raise ValueError(f"--student-layers {cfg.student_layers!r}: the teacher has {n} blocks; accepted: 0..{n - 1}")
    student = student_from_teacher(teacher, layers)
    data = PackedDataset.from_text(docs, lm.tokenizer, cfg.seq, names=(data_name(cfg.text, "--text"), "--seq "))
    evals = [jax.tree.map(jnp.asarray, b) for b in data.eval_batches(cfg.batch, cfg.eval_batches)]
    if not evals:
        raise ValueError(f"the text has {len(data.valid)} validation windows, fewer than --batch {cfg.batch}")
    print(f"teacher {cfg.teacher}: {n} blocks; student: {len(layers)} blocks {layers}; "
          f"{len(data.train)} train windows of {cfg.seq} tokens, eval {len(evals) * cfg.batch * cfg.seq} tokens")
    if cfg.teacher in PRESETS and cfg.teacher not in PACKAGED_MODELS:
        print(f"note: preset {cfg.teacher!r} is randomly initialised (no trained weights): a test of the "
              "pipeline, not of distillation")

    graphdef, student_params, rest = nnx.split(student, nnx.Param, ...)
    # Cross-entropy alone: an MoE teacher's router losses are no part of it (as the train CE logged).
    ce_sum = jax.jit(lambda g, states, b: lm_loss_terms(nnx.merge(g, *states), b, chunk=cfg.chunk)[:2],
                     static_argnums=0)

    def eval_ce(params, g=graphdef, rest=(rest,)):
        tot = [ce_sum(g, (params, *rest), b) for b in evals]
        return float(sum(s for s, _ in tot) / sum(c for _, c in tot))

    teacher_g, teacher_state = nnx.split(teacher)
    result = {"teacher_ce": eval_ce(teacher_state, teacher_g, ()), "student_init_ce": eval_ce(student_params)}
    print(f"held-out CE: teacher {result['teacher_ce']:.3f}, student at init {result['student_init_ce']:.3f}")
    for name, alpha in (("distill", cfg.alpha), ("plain CE", 0.0)):
        print(f"{name} (alpha={alpha}" + (f", T={cfg.temperature}, {cfg.kind} KL):" if alpha else "):"), flush=True)
        result[name], params = train_student(student, teacher, data, eval_ce, cfg, alpha)
        if name == "distill" and cfg.save_student is not None:
            save_student(cfg.save_student, nnx.merge(graphdef, params, rest), lm)
            undo.pop_all().close()  # the student is written: leave the undo without removing it
            print(f"wrote the distilled student to {cfg.save_student}")
    print(markdown(cfg, len(layers), result))
    return result


def save_student(path: str, student, lm) -> None:
    """`student` with the teacher's tokenizer and general.* fields (name, license) in a new model directory
    (`jmem.quant.saved`, float leaves)."""
    save_quantized(path, student, tokenizer=lm.tokenizer, general_metadata=getattr(lm.source, "metadata", None))


def markdown(cfg: Config, student_blocks: int, r: dict) -> str:
    lines = [f"| run ({student_blocks}-block student, {cfg.steps} steps x {cfg.batch}x{cfg.seq} tokens) "
             "| eval CE before | eval CE after | train CE first -> last | s/step |",
             "|---|---|---|---|---|",
             f"| teacher ({cfg.teacher}) | {r['teacher_ce']:.3f} | | | |"]
    for name, label in (("distill", f"distill alpha={cfg.alpha} T={cfg.temperature} {cfg.kind}"),
                        ("plain CE", "plain CE (alpha=0)")):
        x = r[name]
        lines.append(f"| {label} | {r['student_init_ce']:.3f} | {x['eval_ce']:.3f} | "
                     f"{x['first_ce']:.3f} -> {x['last_ce']:.3f} | "
                     + ("n/a (one step: compile)" if x["step_s"] is None else f"{x['step_s']:.2f}") + " |")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 2 for bad input (one `error: ...` line for a bad value; tyro's
    message for a flag it cannot parse)."""
    return run_experiment(Config, main, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())

"""Every check of a `TrainConfig` before any model is built or compiled: `validate`
and the checks that need a model config or mesh (`check_seq`, `check_heads_fit`,
`check_batch_split`, `check_seq_split`, `check_layerwise_fits`, `check_steps_left`), so bad flags
cost one line and no time.
"""

from __future__ import annotations

import math
import pathlib

from jmem.checks import is_int
from jmem.data import check_text_file
from jmem.io.paths import check_separate, prepare_output
from jmem.lora import TARGETS
from jmem.memory.accumulate import check_divisible
from jmem.memory.precision import Policy
from jmem.memory.remat import validate as validate_remat
from jmem.models.config import PRESETS, LlamaConfig
from jmem.train.config import OFFLOAD_SNAPSHOTS, OPTIMIZERS, TrainConfig
from jmem.train.plot import check_image_path


def train_policy(precision: str) -> Policy:
    """The precision policy `precision` names, for the train step: its output dtype is f32 (the step's
    logits and loss are f32, as its cross-entropy reads them)."""
    policy = Policy.parse(precision)
    if policy.output != Policy.parse("f32").output:
        raise ValueError(f"--precision={precision!r} asks for {policy.output} outputs; accepted: o=f32 (the train "
                         f"step's logits and loss are f32, as its cross-entropy reads them)")
    return policy


def validate(cfg: TrainConfig) -> Policy:
    """Check every flag; returns the parsed precision policy.

    Reads no more than a checkpoint directory's listing and a model file's first
    bytes; builds, compiles and writes nothing except the output directories.

    Raises:
        ValueError: one line naming the bad value and what is accepted.
    """
    for name in ("ckpt_dir", "log", "plot", "save", "offload_dir"):  # an unset shell variable: not "no output"
        if getattr(cfg, name) is not None and not getattr(cfg, name).strip():
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: an empty path; accepted: a path, "
                             "or leave the flag out")
    for name in ("steps", "batch", "seq", "ckpt_every", "eval_batches", "init_timeout", "heartbeat_timeout"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every={cfg.eval_every} must be >= 0 (0: evaluate only at the end)")
    if not 0 <= cfg.seed < 2**32:  # the init's PRNG key holds 32 bits: seeds 2**32 apart would share it
        raise ValueError(f"--seed={cfg.seed}; accepted: an integer in 0..{2**32 - 1}")
    if cfg.loss_chunk is not None and cfg.loss_chunk < 1:
        raise ValueError(f"--loss-chunk={cfg.loss_chunk}; accepted: an integer >= 1 (positions per chunk), or unset")
    if cfg.warmup is not None and not 0 <= cfg.warmup <= cfg.steps:
        raise ValueError(f"--warmup={cfg.warmup} must be in 0..--steps={cfg.steps}")
    _validate_floats(cfg)
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    if cfg.weight_decay and cfg.optimizer not in DECAYING:
        raise ValueError(f"--weight-decay={cfg.weight_decay} is not applied by --optimizer {cfg.optimizer}; "
                         f"accepted with: {', '.join(DECAYING)}")
    _validate_galore(cfg)
    validate_remat(cfg.remat)
    policy = train_policy(cfg.precision)
    check_divisible(cfg.batch, cfg.accum)
    if cfg.model not in PRESETS and not pathlib.Path(cfg.model).expanduser().exists():
        raise ValueError(f"--model {cfg.model!r}: not a preset ({', '.join(PRESETS)}), a GGUF file or a model "
                         f"directory")
    preset_config(cfg)  # the --moe-* flags against a preset (a model file's once it loads)
    _validate_model_file(cfg)
    if cfg.stop_after is not None and cfg.stop_after < 1:
        raise ValueError(f"--stop-after={cfg.stop_after} must be >= 1")
    if cfg.stop_after is not None and not cfg.ckpt_dir:
        raise ValueError(f"--stop-after {cfg.stop_after} needs --ckpt-dir (the checkpoint --resume continues "
                         f"from; without one the stopped run's work would be lost)")
    if cfg.resume and not cfg.ckpt_dir:
        raise ValueError("--resume needs --ckpt-dir")
    if cfg.resume:
        _validate_resume(cfg)
    _validate_log(cfg)
    if cfg.data not in ("", "default"):
        check_text_file(cfg.data)
    check_parallel_flags(cfg)
    _validate_lora(cfg)
    _validate_offload(cfg, policy)
    _validate_layerwise(cfg)
    _validate_save(cfg)
    _validate_outputs_apart(cfg)
    _make_output_dirs(cfg)
    return policy


def _validate_outputs_apart(cfg: TrainConfig) -> None:
    """No two outputs at one path, and none inside --save (a new path when the run ends): either would
    overwrite one output with another, or refuse the final save after the whole run."""
    given = {f"--{n.replace('_', '-')}": getattr(cfg, n) for n in ("ckpt_dir", "offload_dir", "log", "plot", "save")
             if getattr(cfg, n)}
    paths = check_separate(given)
    ck = paths.get("--ckpt-dir")
    for flag, path in paths.items():
        # A checkpoint's step folder in --ckpt-dir replaces whatever has its name (a --log named "2").
        first = path.relative_to(ck).parts[0] if ck in path.parents else ""
        if flag != "--ckpt-dir" and first.isascii() and first.isdecimal() and str(int(first)) == first:
            raise ValueError(f"{flag} {given[flag]!r} is at a step folder's name inside --ckpt-dir "
                             f"{given['--ckpt-dir']!r}, which a checkpoint would replace; accepted: another name")
        if "--save" in paths and paths["--save"] in path.parents:
            raise ValueError(f"{flag} {given[flag]!r} is inside --save {given['--save']!r}, which must be new when the "
                             "run ends; accepted: a path outside it")


FILE_SUFFIXES = (".npz", ".safetensors", ".pt", ".pth", ".bin", ".gguf", ".ckpt", ".h5")
"""--save names ending so meant a file; the trained model is written as a directory."""


def _validate_save(cfg: TrainConfig) -> None:
    """--save: a new adapters file (with LoRA, a path ending in .npz) or a new model directory (process 0
    writes it; with LoRA, the adapters merged into the weights)."""
    if cfg.save is None:
        return
    suffix = pathlib.Path(cfg.save).suffix
    if cfg.lora_rank > 0 and suffix not in ("", ".npz"):  # a typo would write the whole merged model
        raise ValueError(f"--save {cfg.save!r} with --lora-rank; accepted: a path ending in .npz (the adapters) or "
                         "a directory name without an extension (the model with its adapters merged)")
    if cfg.lora_rank == 0 and suffix in FILE_SUFFIXES:  # a file was meant, not a model directory of that name
        raise ValueError(f"--save {cfg.save!r} names a {suffix} file, but without --lora-rank the trained model "
                         f"is saved as a directory; accepted: a directory name without {suffix} (a .npz file holds "
                         "adapters, with --lora-rank)")
    if cfg.lora_rank > 0 and suffix == ".npz":
        if pathlib.Path(cfg.save).expanduser().exists():
            raise ValueError(f"--save {cfg.save!r} exists (nothing is overwritten); accepted: a new path")
    else:
        from jmem.quant.saved import check_new_dir

        check_new_dir(cfg.save, "--save")


DECAYING = ("adamw", "adam8bit", "galore")
"""Optimizers that apply --weight-decay."""


def _validate_galore(cfg: TrainConfig) -> None:
    defaults = TrainConfig()
    given = [f"--{n.replace('_', '-')}" for n in ("galore_rank", "galore_gap", "galore_scale")
             if getattr(cfg, n) != getattr(defaults, n)]
    if cfg.optimizer != "galore":
        if given:
            raise ValueError(f"{given[0]} applies to --optimizer galore only; got --optimizer {cfg.optimizer}")
        return
    for name, least in (("galore_rank", 1), ("galore_gap", 1)):
        if getattr(cfg, name) < least:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= {least}")
    if not (math.isfinite(cfg.galore_scale) and cfg.galore_scale > 0):
        raise ValueError(f"--galore-scale={cfg.galore_scale} must be a finite number > 0")


def _validate_floats(cfg: TrainConfig) -> None:
    """NaN passes every comparison, so finiteness is checked first."""
    for flag, value, ok, accepted in (("--lr", cfg.lr, cfg.lr > 0, "> 0"),
                                      ("--clip", cfg.clip, cfg.clip >= 0, ">= 0 (0 disables clipping)"),
                                      ("--weight-decay", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0"),
                                      ("--lora-alpha", cfg.lora_alpha, cfg.lora_alpha > 0, "> 0")):
        if not math.isfinite(value) or not ok:
            raise ValueError(f"{flag}={value} must be a finite number {accepted}")


def _validate_model_file(cfg: TrainConfig) -> None:
    """A model read from disk must be a GGUF file or a directory written by `--save` / `jmem quantize --out`
    (its context length is checked once it is loaded, `check_seq`)."""
    from jmem.quant.saved import is_quantized_dir

    path = model_file(cfg.model)
    if path is None:
        return
    accepted = f"accepted: a .gguf path, a directory written by --save or `jmem quantize --out DIR`, or a preset " \
               f"({', '.join(PRESETS)})"
    if pathlib.Path(path).is_dir():
        if not is_quantized_dir(path):
            raise ValueError(f"--model {cfg.model!r} is a directory without a jmem model manifest; {accepted}")
        return
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"--model {cfg.model!r} is not a GGUF file; {accepted}")


def check_seq(cfg: TrainConfig, context: int) -> None:
    """A model read from a file keeps its context length; --seq must fit in it.
    (Presets trained from scratch raise their max_seq_len to --seq instead.)"""
    if cfg.seq > context:
        raise ValueError(f"--seq={cfg.seq} exceeds the context length {context} of --model {cfg.model}; "
                         f"accepted: 1..{context}")


def model_file(model: str) -> str | None:
    """The file a --model is read from (a packaged model's or the given path); None for presets.

    Raises:
        ValueError: a packaged model whose package is not installed (with the pip command).
    """
    from jmem.lm import PACKAGED_MODELS, packaged_model_path

    if model in PACKAGED_MODELS:
        try:
            return packaged_model_path(model)
        except FileNotFoundError as e:
            raise ValueError(f"--model {model}: {e}") from None
    if model in PRESETS:
        return None
    return str(pathlib.Path(model).expanduser())


def checkpoint_steps(directory: str) -> list[int]:
    """Step numbers of the finished jmem checkpoints in `directory` (Orbax writes a step under a
    temporary name and renames it to the bare number when complete; a jmem step holds a `meta`
    item, as `jmem.io.checkpoint.Checkpointer` counts them); [] when absent."""
    d = pathlib.Path(directory).expanduser()
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / "meta").is_dir())


def _validate_resume(cfg: TrainConfig) -> None:
    """--resume needs a checkpoint to continue and steps left to train (the directory is not created)."""
    steps = checkpoint_steps(cfg.ckpt_dir)
    path = pathlib.Path(cfg.ckpt_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--ckpt-dir {cfg.ckpt_dir!r} is a file, not a checkpoint directory; accepted: the "
                         f"directory of the run to resume")
    if not steps:
        raise ValueError(f"--resume: nothing to resume in {cfg.ckpt_dir} (no checkpoint there); "
                         f"drop --resume to start a new run")
    check_steps_left(cfg, steps[-1])


def _validate_log(cfg: TrainConfig) -> None:
    """A fresh run does not write over another run's log; a resumed run appends to its own (the loop
    checks the run id its log names against the checkpoint's)."""
    if cfg.log and not cfg.resume:
        path = pathlib.Path(cfg.log).expanduser()
        if path.is_file() and path.stat().st_size:
            raise ValueError(f"--log {cfg.log!r} already holds another run's log (nothing is overwritten); "
                             "accepted: a new path, or --resume to continue that run's log")


def check_steps_left(cfg: TrainConfig, checkpoint_step: int) -> None:
    """A resumed run must end after its checkpoint (--steps counts the steps done before), or at it
    with --save: a finished run's model is then written (and evaluated) without training."""
    if cfg.steps < checkpoint_step or (cfg.steps == checkpoint_step and not cfg.save):
        raise ValueError(f"--steps={cfg.steps} is not beyond the checkpoint's step {checkpoint_step} in "
                         f"{cfg.ckpt_dir}: nothing to train; accepted: --steps > {checkpoint_step}, or --steps "
                         f"{checkpoint_step} with --save to write the checkpoint's model")


def _make_output_dirs(cfg: TrainConfig) -> None:
    """Create the directories the run writes into, so that a path it cannot write fails now,
    not at the first checkpoint or after the last step. --plot's format is checked first (nothing
    is created for a chart matplotlib cannot write)."""
    if cfg.plot:
        check_image_path(cfg.plot, "--plot")
    for flag, value in (("--ckpt-dir", cfg.ckpt_dir), ("--log", cfg.log), ("--plot", cfg.plot),
                        ("--offload-dir", cfg.offload_dir), ("--save", cfg.save)):
        if value:
            # A new --save model directory is made when the run has finished (its parent now), so a
            # run stopped before leaves none; an existing empty one is checked like a checkpoint's.
            if flag == "--save":
                value = str(value).rstrip("/") or value  # "out/model/" names that new directory too
            saved_dir = flag == "--save" and cfg.lora_rank == 0 and pathlib.Path(value).expanduser().is_dir()
            prepare_output(value, flag, directory=flag in ("--ckpt-dir", "--offload-dir") or saved_dir)


def _validate_offload(cfg: TrainConfig, policy: Policy) -> None:
    """--offload-optimizer / --offload-params / --offload-dir and what they combine with."""
    from jmem.memory.offload import check_offload

    check_offload(cfg.offload_optimizer, cfg.offload_params, cfg.offload_dir)
    if cfg.offload_optimizer == "none":
        return
    flag = f"--offload-optimizer {cfg.offload_optimizer}"
    if cfg.zero >= 3:
        raise ValueError(f"{flag} with --zero {cfg.zero} is not supported (ZeRO-3 gathers sharded parameters per "
                         f"layer on device); accepted: --zero 0, 1 or 2, with --offload-params host for the layers")
    if cfg.pipeline_stages > 1:
        raise ValueError(f"{flag} with --pipeline-stages {cfg.pipeline_stages} is not supported; accepted: "
                         f"--pipeline-stages 1")
    if cfg.num_processes not in (None, 1):
        raise ValueError(f"{flag} runs in one process; got --num-processes {cfg.num_processes}")
    if cfg.offload_optimizer == "disk" and policy.needs_loss_scale:
        raise ValueError(f"{flag} with --precision {cfg.precision}: skipping non-finite fp16 steps needs the "
                         f"whole update at once; accepted: a bf16 or f32 precision, or --offload-optimizer host")
    if cfg.offload_dir:
        d = pathlib.Path(cfg.offload_dir).expanduser()
        if d.exists() and not d.is_dir():
            raise ValueError(f"--offload-dir {cfg.offload_dir} exists and is not a directory")
        if cfg.offload_optimizer == "disk" and cfg.ckpt_dir:
            live, ck = d.resolve(), pathlib.Path(cfg.ckpt_dir).expanduser().resolve()
            snapshots = ck / OFFLOAD_SNAPSHOTS  # the copies saved with the checkpoints
            if live in (ck, snapshots) or snapshots in live.parents:
                raise ValueError(f"--offload-dir {cfg.offload_dir} and --ckpt-dir {cfg.ckpt_dir} overlap (the live "
                                 "state files would mix with the checkpoint's, or overwrite its copies of them); "
                                 "accepted: an --offload-dir other than --ckpt-dir, outside its offload_optimizer "
                                 "folder")


def _validate_layerwise(cfg: TrainConfig) -> None:
    """--layerwise / --layerwise-period / --layerwise-schedule and what they combine with."""
    from jmem.train.layerwise import SCHEDULES

    if cfg.layerwise < 0:
        raise ValueError(f"--layerwise={cfg.layerwise} must be >= 0 (0: every layer every step)")
    if cfg.layerwise_period < 1:
        raise ValueError(f"--layerwise-period={cfg.layerwise_period} must be >= 1")
    if cfg.layerwise_schedule not in SCHEDULES:
        raise ValueError(f"--layerwise-schedule {cfg.layerwise_schedule!r}; accepted: {', '.join(SCHEDULES)}")
    if not cfg.layerwise:
        for flag, field in (("--layerwise-period", "layerwise_period"), ("--layerwise-schedule", "layerwise_schedule")):
            value = getattr(cfg, field)
            if value != getattr(TrainConfig, field):  # set away from its default
                raise ValueError(f"{flag} {value} needs --layerwise N (it sets how the active layers change); "
                                 f"accepted: {flag} with --layerwise > 0")
        return
    if cfg.pipeline_stages > 1 or cfg.num_processes not in (None, 1):
        # The layer-wise step runs its own layer scan (not the pipeline's); several processes: not verified.
        raise ValueError(f"--layerwise {cfg.layerwise} runs in one process without pipeline stages; accepted: "
                         f"--pipeline-stages 1 and one process (a --mesh of data/fsdp/tensor axes and --zero work)")
    if cfg.offload_optimizer != "none":
        raise ValueError(f"--layerwise {cfg.layerwise} with --offload-optimizer {cfg.offload_optimizer} is not "
                         f"supported (layer-wise training already keeps optimizer state for the active layers "
                         f"alone); accepted: --offload-optimizer none")
    if cfg.model in PRESETS:
        check_layerwise_fits(cfg, preset_config(cfg))


def check_layerwise_fits(cfg: TrainConfig, mc: LlamaConfig) -> None:
    if cfg.layerwise > mc.n_layers:
        raise ValueError(f"--layerwise {cfg.layerwise} exceeds the model's {mc.n_layers} layers; "
                         f"accepted: 1..{mc.n_layers}")


BASE_QUANTIZATIONS = ("nf4", "int8", "fp8", "rtn")
LORA_TARGETS = tuple(t for t in TARGETS if t != "head")  # --lora-targets: the head is not offered


def lora_targets(cfg: TrainConfig, mc: LlamaConfig) -> tuple[str, ...]:
    """The weights that get adapters: --lora-targets, whose default (the linears, in any order) means every
    weight of the model (an MoE model's experts in place of the MLP linears)."""
    from jmem.memory.estimate import resolve_lora_targets

    return resolve_lora_targets(mc, cfg.lora_targets.split(","))


def _validate_lora(cfg: TrainConfig) -> None:
    if cfg.lora_rank < 0:
        raise ValueError(f"--lora-rank={cfg.lora_rank} must be >= 0 (0 trains every parameter)")
    if cfg.quantize_base is not None:
        if cfg.quantize_base not in BASE_QUANTIZATIONS:
            raise ValueError(f"--quantize-base {cfg.quantize_base!r}; accepted: {', '.join(BASE_QUANTIZATIONS)}")
        if cfg.lora_rank == 0:
            raise ValueError("--quantize-base needs --lora-rank > 0 (a quantized base is frozen)")
    if not (0.0 <= cfg.lora_dropout < 1.0):
        raise ValueError(f"--lora-dropout {cfg.lora_dropout}; accepted: 0 <= p < 1")
    if not cfg.lora_rank:
        defaults = TrainConfig()
        for flag, field in (("--lora-dropout", "lora_dropout"), ("--lora-alpha", "lora_alpha"),
                            ("--lora-targets", "lora_targets")):
            if getattr(cfg, field) != getattr(defaults, field):
                raise ValueError(f"{flag} needs --lora-rank > 0 (without adapters every parameter trains and "
                                 f"{flag} does nothing)")
    if cfg.lora_rank:
        names = cfg.lora_targets.split(",")
        bad = [t for t in names if t not in LORA_TARGETS]
        if bad or len(set(names)) < len(names):
            shown = ",".join(bad) if bad and all(bad) else repr(cfg.lora_targets)
            raise ValueError(f"--lora-targets {shown}; accepted: distinct names among {', '.join(LORA_TARGETS)}, "
                             "comma-separated")
        mc = preset_config(cfg)  # a model file's targets are checked once it loads (jmem.lora.apply_lora)
        if mc is not None:
            try:
                lora_targets(cfg, mc)
            except ValueError:
                absent = [t for t in names if t not in mc.weight_names()]
                kind = "a mixture of experts" if mc.moe_experts else "dense"
                raise ValueError(f"--lora-targets {','.join(absent)} with --model {cfg.model}: not a weight of this "
                                 f"model (its MLP is {kind}); accepted: names among {', '.join(mc.weight_names())}") \
                    from None


def check_parallel_flags(cfg: TrainConfig, mc: LlamaConfig | None = None) -> None:
    """The mesh, ZeRO, rules, pipeline and multi-host flags (no device is touched). `mc`: the model's
    config (a preset --model's when None; a model file's is checked once loaded)."""
    from jmem import parallel as par
    from jmem.parallel.distributed import check_args

    par.check_stage(cfg.zero)
    mesh = par.parse_mesh(cfg.mesh)
    par.Rules.parse(cfg.rules)
    rules_for(cfg)
    if cfg.rules.strip() and not cfg.distributed:  # it was ignored: one device, no mesh to place axes on
        raise ValueError(f"--rules {cfg.rules} needs a mesh (rules place logical axes on a mesh's axes); accepted: "
                         "--rules with --mesh, --zero or --pipeline-stages")
    check_args(cfg.coordinator, cfg.num_processes, cfg.process_id)
    if cfg.pipeline_stages < 1 or cfg.microbatches < 1:
        raise ValueError(f"--pipeline-stages={cfg.pipeline_stages} and --microbatches={cfg.microbatches} "
                         f"must be >= 1")
    from jmem.parallel.pipeline_1f1b import check_schedule

    check_schedule(cfg.pipeline_schedule)
    if cfg.microbatches > 1 and cfg.pipeline_stages == 1:
        raise ValueError(f"--microbatches={cfg.microbatches} needs --pipeline-stages > 1 (use --accum "
                         f"for gradient accumulation)")
    if cfg.pipeline_schedule != TrainConfig.pipeline_schedule and cfg.pipeline_stages == 1:
        raise ValueError(f"--pipeline-schedule {cfg.pipeline_schedule} needs --pipeline-stages > 1; accepted: "
                         "--pipeline-schedule with a pipeline")
    if cfg.pipeline_stages == 1 and mesh.get("stage", 1) != 1:
        raise ValueError(f"--mesh {cfg.mesh!r} has a stage axis but --pipeline-stages is 1 (the stage axis would "
                         f"only replicate work); accepted: --pipeline-stages equal to its size, or a mesh "
                         "without stage")
    if cfg.pipeline_stages > 1:
        if mesh.get("stage", cfg.pipeline_stages) not in (cfg.pipeline_stages, -1):
            raise ValueError(f"--mesh {cfg.mesh!r} has stage={mesh['stage']} but --pipeline-stages="
                             f"{cfg.pipeline_stages}; give the mesh stage={cfg.pipeline_stages} or leave it out")
        if cfg.pipeline_schedule == "1f1b" and "offload" in cfg.remat:
            # 1F1B keeps each microbatch's residuals in a device ring buffer between its forward and
            # backward ticks; a residual offloaded to host memory cannot be written into it.
            raise ValueError(f"--remat {cfg.remat} with --pipeline-schedule 1f1b is not supported; accepted: "
                             "--pipeline-schedule gpipe with it, or a --remat policy that keeps residuals on the device")
        if cfg.lora_dropout > 0:
            raise ValueError(f"--lora-dropout {cfg.lora_dropout} with --pipeline-stages {cfg.pipeline_stages} is "
                             f"not supported (the pipeline schedule draws no dropout mask); accepted: "
                             f"--lora-dropout 0, or --pipeline-stages 1")
        if (cfg.batch // cfg.accum) % cfg.microbatches:
            raise ValueError(f"--microbatches={cfg.microbatches} must divide the batch per accumulation "
                             f"step ({cfg.batch // cfg.accum})")
        mc = mc if mc is not None or cfg.model not in PRESETS else preset_config(cfg)
        if mc is not None and mc.n_layers % cfg.pipeline_stages:
            raise ValueError(f"--pipeline-stages={cfg.pipeline_stages} must divide the {mc.n_layers} layers "
                             f"of the model; accepted: a divisor of {mc.n_layers}")
        if mc is not None and mc.moe_experts:
            moe = f"--moe-experts {cfg.moe_experts}" if cfg.moe_experts else "a mixture-of-experts model"
            raise ValueError(f"--pipeline-stages with {moe} is not supported; accepted: dense models")


def preset_config(cfg: TrainConfig) -> LlamaConfig | None:
    """The config of a preset --model with the --moe-* flags applied (None for a model file)."""
    if cfg.model not in PRESETS:
        return None
    base = PRESETS[cfg.model]()
    check_moe_flags(cfg, base, random_init=cfg.model != "smollm2-135m")
    return base.replace(**cfg.moe_overrides())


def check_moe_flags(cfg: TrainConfig, base: LlamaConfig, *, random_init: bool = False) -> None:
    """The --moe-* flags given against the model they change (`base`): --moe-experts builds the experts of a
    random-init preset; the others need an MoE model; every value in its range (`LlamaConfig`'s checks)."""
    given = cfg.moe_overrides()
    if not given:
        return
    shown = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in given.items())
    if cfg.moe_experts is not None and not (is_int(cfg.moe_experts) and cfg.moe_experts >= 1):
        raise ValueError(f"--moe-experts {cfg.moe_experts}; accepted: an integer >= 1 (leave the flag out for the "
                         "model's own MLP)")
    if cfg.moe_experts is not None and not random_init:
        raise ValueError(f"--moe-experts {cfg.moe_experts} would replace the trained MLP of --model {cfg.model}; "
                         f"accepted: --moe-experts with a random-init preset "
                         f"({', '.join(n for n in PRESETS if n != 'smollm2-135m')})")
    if not given.get("moe_experts", base.moe_experts):
        raise ValueError(f"{shown}: the model's MLP is dense; accepted: the --moe-* flags with an MoE model "
                         "(--model tiny-moe, or a preset with --moe-experts N)")
    if "moe_capacity_factor" in given and given.get("moe_dropless"):
        raise ValueError(f"--moe-capacity-factor {cfg.moe_capacity_factor} with --moe-dropless does nothing "
                         "(dropless routing has no capacity); accepted: one of them")
    if "moe_capacity_factor" in given and base.moe_dropless:  # e.g. a GGUF file's experts, routed as llama.cpp's
        raise ValueError(f"--moe-capacity-factor {cfg.moe_capacity_factor} with --model {cfg.model}, which routes "
                         "dropless (its config has no capacity), does nothing; accepted: no --moe-capacity-factor "
                         "with this model")
    try:
        base.replace(**given)
    except ValueError as e:
        raise ValueError(f"{shown}: {e}") from None


def check_params_fit(cfg: TrainConfig, mc: LlamaConfig) -> None:
    """A one-device run of a random-init preset: its parameters and their gradients (the parameters
    alone when adapters train) must fit the device's memory; refused before they are built (a preset
    with --moe-experts 100000 was killed while initialising its 20 GB of experts)."""
    if cfg.distributed:  # split over the mesh's devices: the compiled step's per-device bytes are checked
        return
    import numpy as np

    from jmem.memory.measure import memory_limit
    from jmem.models.config import as_dtype
    from jmem.train.report import count_text

    copies = 1 if cfg.lora_rank else 2
    need = mc.num_params * np.dtype(as_dtype(mc.param_dtype)).itemsize * copies
    limit, holder = memory_limit()
    if need > limit:
        experts = f" --moe-experts {cfg.moe_experts}" if cfg.moe_experts else ""
        grads = " with their gradients" if copies == 2 else ""
        raise ValueError(f"--model {cfg.model}{experts}: {count_text(mc.num_params)} parameters need "
                         f"{need / 2**20:.0f} MiB{grads} and {holder} {limit / 2**20:.0f} MiB; accepted: a smaller "
                         "model, or a --mesh over more devices")


def check_heads_fit(cfg: TrainConfig, sizes, model_config: LlamaConfig | None = None) -> None:
    """The model's attention heads must stay whole on the mesh's tensor axis (`sizes`: a `Mesh`,
    or axis sizes). A preset is checked from its name; a model read from a file once loaded
    (its `model_config`)."""
    if model_config is None and cfg.model not in PRESETS:
        return
    from jmem import parallel as par

    mc = model_config if model_config is not None else preset_config(cfg)
    shown = cfg.mesh if cfg.mesh else par.mesh.format_mesh(dict(getattr(sizes, "shape", sizes)))
    par.check_heads(mc.n_heads, mc.n_kv_heads, rules_for(cfg), sizes,
                    what=f"--mesh {shown} with --model {cfg.model}: ")


def check_seq_split(cfg: TrainConfig, mesh) -> None:
    """--seq must split over the mesh axes the rules give the sequence (`length`, after the batch
    took its axes): one line naming --seq now, not a sharding error when the step is traced."""
    from jmem import parallel as par

    par.Rules.parse(rules_for(cfg)).spec(("batch", "length"), (0, cfg.seq), mesh, name=f"--seq={cfg.seq}")


def check_batch_split(cfg: TrainConfig, sizes) -> None:
    """--batch must split into the data-parallel groups x --accum microbatches, and under a
    pipeline each of those into --microbatches pipeline microbatches whose rows still split
    over the data-parallel devices: --batch a multiple of D x --accum x --microbatches.
    (With --accum 1 the pipeline splits the global batch, sharded over the D devices; with
    more, each group's accumulation microbatch; the condition is the same.)

    `sizes`: a `Mesh`, or axis sizes (nothing is checked while a batch axis is -1).
    """
    from jmem import parallel as par

    shape = dict(getattr(sizes, "shape", sizes))
    axes = [a for a in par.Rules.parse(rules_for(cfg)).mesh_axes("batch") if shape.get(a, 1) != 1]
    if any(shape[a] == -1 for a in axes):
        return
    d = math.prod(shape[a] for a in axes)
    m = cfg.microbatches if cfg.pipeline_stages > 1 else 1
    if cfg.batch % (d * cfg.accum * m) == 0:
        return
    if cfg.batch % (d * cfg.accum) or m == 1:
        raise ValueError(f"--batch={cfg.batch} must be divisible by the data-parallel size {d} x --accum "
                         f"{cfg.accum} on mesh {par.mesh.format_mesh(shape)}")
    raise ValueError(f"--microbatches={cfg.microbatches}: --batch={cfg.batch} split over the data-parallel size "
                     f"{d} ({'+'.join(axes)}) and --accum {cfg.accum} leaves {cfg.batch // (d * cfg.accum)} row(s) "
                     f"per group and accumulation microbatch, which do not split into {m} pipeline microbatches; "
                     f"accepted: --batch a multiple of {d} x {cfg.accum} x {m} = {d * cfg.accum * m}")


def mesh_spec(cfg: TrainConfig) -> str | None:
    """The device-mesh spec a run builds from its flags: None on one device, --mesh as given, all
    devices on `data` for --zero without --mesh, and a `stage=--pipeline-stages` axis added to a
    pipeline mesh that has none (on top of `data=-1` without --mesh).

    Raises:
        ValueError: --pipeline-stages that does not divide the devices, where the axis is added.
    """
    if not cfg.distributed:
        return None
    import jax

    from jmem.parallel.mesh import parse_mesh

    if cfg.pipeline_stages == 1 or "stage" in parse_mesh(cfg.mesh):
        return cfg.mesh or "data=-1"
    if jax.device_count() % cfg.pipeline_stages:
        raise ValueError(f"--pipeline-stages={cfg.pipeline_stages} needs a multiple of {cfg.pipeline_stages} "
                         f"devices, one stage per device group; there are {jax.device_count()}")
    return ",".join([f"stage={cfg.pipeline_stages}", cfg.mesh or "data=-1"])


def rules_for(cfg: TrainConfig) -> str:
    """The sharding rules of a run: `layers=stage` under a pipeline (unless --rules says so itself),
    then --rules. A pipeline's layers lie on its `stage` axis: --rules placing them elsewhere is a
    ValueError."""
    from jmem import parallel as par

    if cfg.pipeline_stages == 1:
        return cfg.rules
    if "layers" not in [name for name, _ in _rule_items(cfg.rules)]:
        return ",".join(["layers=stage"] + ([cfg.rules] if cfg.rules else []))
    axes = tuple(par.Rules.parse(cfg.rules).mesh_axes("layers"))
    if axes != ("stage",):
        raise ValueError(f"--rules {cfg.rules} places 'layers' on {'+'.join(axes) or 'no axis'}, but "
                         f"--pipeline-stages={cfg.pipeline_stages} runs each stage's layers on the 'stage' axis; "
                         "accepted: layers=stage, or no 'layers' rule (it is added)")
    return cfg.rules


def _rule_items(rules: str) -> list[tuple[str, str]]:
    """(logical name, axes) of each `name=axes` entry of a --rules string."""
    return [tuple(s.strip() for s in part.split("=", 1)) for part in rules.split(",") if "=" in part]

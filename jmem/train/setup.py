"""From a `TrainConfig` to the pieces of a run: model, tokenizer, data, optimizer
chain, train functions and checkpoint metadata (`build`), once
`jmem.train.checks.validate` has checked every flag.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets

import jax
import optax
from flax import nnx

from jmem.data import BYTE_VOCAB, ByteTokenizer, PackedDataset, data_name, load_documents
from jmem.io.checkpoint import structure_fingerprint
from jmem.memory.precision import Policy, loss_scale_for, skip_nonfinite, with_master_weights
from jmem.models.config import PRESETS, LlamaConfig
from jmem.train.checks import (DECAYING, check_batch_split, check_heads_fit, check_layerwise_fits, check_moe_flags,
                               check_params_fit, check_seq, check_seq_split, mesh_spec, rules_for, validate)
from jmem.train.config import ROUTER_SETTINGS, TrainConfig
from jmem.train.step import TrainFns, make_train_fns

# Config fields that do not change the parameters (free to differ on resume; the router's settings change
# the updates, noted as `RESUME_UPDATE_FLAGS`).
_NOT_STATE = ("remat", "attention_impl", "loss_chunk", "max_seq_len", "compute_dtype") + ROUTER_SETTINGS
_SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


BASE_GROUP_SIZE = 128
"""Input rows per scale of a --quantize-base rtn base (checkpoints record it: earlier versions used one per
channel, a state of other shapes)."""


def _with_adapters(cfg: TrainConfig, model):
    """QLoRA: quantize the frozen base (--quantize-base), then wrap targets in LoRA adapters."""
    if cfg.quantize_base:
        from jmem.quant import quantize

        # rtn: 4-bit in groups of 128 input rows, the base `jmem quantize --method rtn` writes by default, so
        # the adapters are served on the base they were trained on.
        model = quantize(model, cfg.quantize_base, group_size=BASE_GROUP_SIZE)
    if cfg.lora_rank:
        from jmem.lora import apply_lora

        from jmem.train.checks import lora_targets

        model = apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                           targets=lora_targets(cfg, model.config), seed=cfg.seed)
    return model


def mesh_for(cfg: TrainConfig):
    """The run's device mesh (after `jmem.parallel.initialize`), or None on one device.

    Raises:
        MeshError: sizes that do not multiply to the device count (one line).
        ValueError: a --batch that does not split over the data-parallel devices, --accum
            and --microbatches, or a tensor axis that splits the attention heads.
    """
    if not cfg.distributed:
        return None
    from jmem import parallel as par

    spec = mesh_spec(cfg)
    try:
        mesh = par.make_mesh(spec)
    except par.MeshError as e:
        if cfg.mesh is None or spec == cfg.mesh:
            raise
        raise par.MeshError(f"--mesh {cfg.mesh!r} with --pipeline-stages={cfg.pipeline_stages} adds the stage "
                            f"axis: {e}") from None
    if cfg.pipeline_stages > 1 and mesh.shape["stage"] != cfg.pipeline_stages:
        raise ValueError(f"mesh {par.mesh_summary(mesh)} has stage={mesh.shape['stage']}, "
                         f"not --pipeline-stages={cfg.pipeline_stages}")
    check_batch_split(cfg, mesh)
    check_seq_split(cfg, mesh)
    check_heads_fit(cfg, mesh)
    return mesh


def _dtype_name(dt) -> str:
    return _SHORT_DTYPE[str(jax.numpy.dtype(dt))]


@dataclasses.dataclass
class Run:
    """The built pieces of one run (see `build`)."""

    cfg: TrainConfig
    policy: Policy
    model_config: LlamaConfig
    model: nnx.Module
    tokenizer: object
    data: PackedDataset
    tx: optax.GradientTransformation
    fns: TrainFns
    meta: dict
    mesh: object = None  # jax.sharding.Mesh of a distributed run
    general_metadata: dict = dataclasses.field(default_factory=dict)  # the source file's general.* fields


def _model_and_tokenizer(cfg: TrainConfig, policy: Policy):
    overrides = dict(
        param_dtype=_dtype_name(policy.param),
        compute_dtype=_dtype_name(policy.compute),
        remat=cfg.remat,
    )
    if cfg.loss_chunk is not None:
        overrides["loss_chunk"] = cfg.loss_chunk
    overrides.update(cfg.moe_overrides())  # checked by `validate` (a preset) or below (a model file)
    if cfg.model in PRESETS and cfg.model != "smollm2-135m":
        from jmem.models.llama import Llama

        mc = PRESETS[cfg.model]()
        overrides["max_seq_len"] = max(mc.max_seq_len, cfg.seq)
        mc = mc.replace(**overrides)
        if mc.vocab_size < BYTE_VOCAB:
            raise ValueError(f"--model {cfg.model}: vocab {mc.vocab_size} < {BYTE_VOCAB} byte-level ids")
        check_params_fit(cfg, mc)
        return mc, Llama(mc, rngs=nnx.Rngs(cfg.seed)), ByteTokenizer(), {}
    # A real model: weights and tokenizer from its GGUF file or model directory.
    import jmem

    lm = jmem.load(cfg.model, param_dtype=overrides["param_dtype"], compute_dtype=overrides["compute_dtype"])
    check_seq(cfg, lm.config.max_seq_len)
    _check_trainable(cfg, lm.model)
    check_moe_flags(cfg, lm.config)
    mc = lm.config.replace(**overrides)
    # The loaded module keeps its weights; this run's remat and loss chunk are config.
    lm.model.config = mc
    # Its general.* fields (name, license) for --save, read now: the file may be gone when the run ends.
    general = {k: v for k, v in getattr(lm.source, "metadata", {}).items() if k.startswith("general.")}
    return mc, lm.model, lm.tokenizer, general


def _check_trainable(cfg: TrainConfig, model) -> None:
    """A model directory of quantized weights trains adapters on its frozen base (QLoRA), never the codes."""
    from jmem.quant.api import first_quantized

    found = first_quantized(model)
    if found is None:
        return
    name, kind = found
    if not cfg.lora_rank:
        raise ValueError(f"--model {cfg.model}: its weights are quantized ({name}: {kind}) and cannot be trained; "
                         f"accepted: --lora-rank R (adapters on the frozen quantized base), or the float model")
    if cfg.quantize_base:
        raise ValueError(f"--quantize-base {cfg.quantize_base}: --model {cfg.model} is already quantized "
                         f"({name}: {kind}); accepted: no --quantize-base with a quantized model")


def needs_master_weights(cfg: TrainConfig, policy: Policy) -> bool:
    """An f32 master copy in the optimizer state: for params below f32, but not for LoRA runs, whose trained
    leaves (the adapters) are f32 whatever the policy (a copy would only repeat them)."""
    return policy.param != jax.numpy.dtype(jax.numpy.float32) and not cfg.lora_rank


def make_tx(cfg: TrainConfig, policy: Policy, mesh=None, *, clip: bool = True) -> optax.GradientTransformation:
    """Clipping + the named optimizer on a warmup-cosine schedule, wrapped for
    non-f32 params (f32 master copy) and fp16 (skip non-finite steps); on a
    `mesh`, the incoming gradients get their ZeRO-stage sharding (not for an
    offloaded optimizer, which runs on the host). `clip=False` leaves clipping
    out (disk offload clips the whole gradient before its chunks)."""
    from jmem.optim import decay_mask, make_optimizer

    warmup = cfg.warmup_steps
    schedule = optax.warmup_cosine_decay_schedule(
        0.0 if warmup else cfg.lr, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * 0.1
    )
    # Always passed: the constructors' own defaults (1e-4) would decay a run that asked for none.
    kw = {"weight_decay": cfg.weight_decay, "mask": decay_mask} if cfg.optimizer in DECAYING else {}
    if cfg.optimizer == "galore":
        kw.update(rank=cfg.galore_rank, update_proj_gap=cfg.galore_gap, scale=cfg.galore_scale)
    if cfg.optimizer == "adafactor" and cfg.lora_rank > 0:
        # Steps scaled by each block's parameter RMS would leave LoRA's zero-initialised B at
        # 1e-3 x the learning rate (its floor), and A at its small init's scale: adapters would not move.
        kw["multiply_by_parameter_scale"] = False
    tx = make_optimizer(cfg.optimizer, schedule, **kw)
    if cfg.clip and clip:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip), tx)
    if needs_master_weights(cfg, policy):
        tx = with_master_weights(tx)
    if policy.needs_loss_scale:
        tx = skip_nonfinite(tx)
    if mesh is not None and cfg.offload_optimizer == "none":
        from jmem import parallel as par

        tx = par.constrain_gradients(tx, mesh, stage=cfg.zero, rules=rules_for(cfg))
    return tx


def meta_for(cfg: TrainConfig, model_config: LlamaConfig, policy: Policy, abstract_state) -> dict:
    """Checkpoint metadata; `MUST_MATCH` fields decide whether a dir is this run's, and
    `settings` (see `STATE_SETTINGS`) name the flags behind a differing state structure."""
    model = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in _NOT_STATE}
    return {
        "model": model,
        "optimizer": cfg.optimizer,
        "precision": f"p={_dtype_name(policy.param)}",
        "structure": structure_fingerprint(abstract_state),
        "settings": {name: getattr(cfg, name) for name in STATE_SETTINGS},
        "config": dataclasses.asdict(cfg),
        "run_id": secrets.token_hex(6),  # a resumed run keeps its checkpoint's (its log names it too)
        **({"adam8bit_nu": ADAM8BIT_NU} if cfg.optimizer == "adam8bit" else {}),
        **({"base_group_size": BASE_GROUP_SIZE} if cfg.quantize_base == "rtn" else {}),
    }


ADAM8BIT_NU = "sqrt"
"""What an adam8bit checkpoint's quantized second moments hold: sqrt(v). Checkpoints without this
field (earlier versions) hold v itself, in arrays of the same shapes: read as sqrt(v) they would
give updates far from the run's."""


def upgrade_meta(old: dict) -> dict:
    """Checkpoint metadata of an older version as this version writes it: model config
    fields it did not record yet (added since) take their defaults, which reproduce the
    older version's model, and fields it recorded that this version does not (`_NOT_STATE`,
    such as the router's loss weights) are dropped, so such a checkpoint is not refused as
    another model."""
    model = old.get("model")
    if not isinstance(model, dict):
        return old
    defaults = {f.name: f.default for f in dataclasses.fields(LlamaConfig)
                if f.default is not dataclasses.MISSING and f.name not in _NOT_STATE}
    kept = {k: v for k, v in model.items() if k not in _NOT_STATE}
    return {**old, "model": {**{k: v for k, v in defaults.items() if k not in kept}, **kept}}


def _loss_scaling(precision) -> bool:
    return Policy.parse(precision).needs_loss_scale


STATE_SETTINGS = {
    "clip": bool,  # clipping adds a link to the optimizer chain; its value does not
    "precision": _loss_scaling,  # fp16 compute adds the non-finite-skipping wrapper and a loss scale
    "lora_rank": lambda v: v,
    "lora_targets": lambda v: v,
    "lora_alpha": lambda v: v,  # not the structure: the adapters' scale, what the saved adapters mean
    "quantize_base": lambda v: v,
    "galore_rank": lambda v: v,  # the moments' shapes
    "layerwise": lambda v: v,
    "layerwise_period": lambda v: v,
    "layerwise_schedule": lambda v: v,
    "offload_optimizer": lambda v: v == "disk",  # disk: the state holds a handle, the files a snapshot
}
"""Flags that shape the train state (beyond the model, optimizer and param dtype, which
`MUST_MATCH` compares), each with the part of its value that does."""

MEANING_SETTINGS = ("lora_alpha",)
"""`STATE_SETTINGS` that leave the structure as it is (compared also when the structure matches)."""


def state_settings_diff(old_meta: dict, cfg: TrainConfig, names=None) -> list[str]:
    """`--flag: checkpoint X vs run Y` for each `STATE_SETTINGS` flag (of `names`, all when None)
    whose state-shaping part differs between a checkpoint's metadata and `cfg` (older checkpoints:
    their `config`)."""
    old = old_meta.get("settings") or old_meta.get("config") or {}
    out = []
    for name, part in STATE_SETTINGS.items():
        if name not in old or (names is not None and name not in names):
            continue
        mine = getattr(cfg, name)
        try:
            differs = part(old[name]) != part(mine)
        except ValueError:  # a setting this version cannot parse
            differs = old[name] != mine
        if differs and (name not in ("lora_targets", "lora_alpha") or (old.get("lora_rank") and cfg.lora_rank)):
            out.append(f"--{name.replace('_', '-')}: checkpoint {old[name]} vs run {mine}")
    return out


@functools.lru_cache(maxsize=4)
def _cached_fns(cfg_key: TrainConfig, mesh=None):
    """Model config, model, tokenizer, optimizer and train fns for a config.

    Cached so that runs in one process with the same program (a resumed run in
    a test or a notebook) reuse the compiled step instead of compiling again.
    """
    policy = Policy.parse(cfg_key.precision)
    mc, model, tok, general = _model_and_tokenizer(cfg_key, policy)
    if mesh is not None:  # a model read from a file: its head counts are known now
        check_heads_fit(cfg_key, mesh, mc)
    model = _with_adapters(cfg_key, model)
    tx = make_tx(cfg_key, policy, mesh, clip=cfg_key.offload_optimizer != "disk")
    # Disk offload: the train state carries only a handle; `tx` runs on the files (jmem.train.loop).
    step_tx = tx
    if cfg_key.offload_optimizer == "disk":
        from jmem.memory.disk_offload import placeholder_transform

        step_tx = placeholder_transform()
    loss_fn = None
    if cfg_key.pipeline_stages > 1:
        from jmem.parallel.pipeline_1f1b import schedule_lm_loss_fn

        loss_fn, _ = schedule_lm_loss_fn(cfg_key.pipeline_schedule, model, n_stages=cfg_key.pipeline_stages,
                                         n_microbatches=cfg_key.microbatches, mesh=mesh, chunk=mc.loss_chunk)
    if cfg_key.layerwise:
        from jmem.train.layerwise import make_layerwise_fns

        check_layerwise_fits(cfg_key, mc)  # a model file's layer count is known now
        fns = make_layerwise_fns(model, step_tx, cfg_key.layerwise, period=cfg_key.layerwise_period,
                                 schedule=cfg_key.layerwise_schedule, seed=cfg_key.seed, accum=cfg_key.accum,
                                 loss_chunk=mc.loss_chunk, loss_scale=loss_scale_for(policy),
                                 adapters_only=cfg_key.lora_rank > 0, dropout_seed=cfg_key.seed)
    else:
        fns = make_train_fns(model, step_tx, accum=cfg_key.accum, loss_chunk=mc.loss_chunk,
                             loss_scale=loss_scale_for(policy),
                             mesh=mesh, zero=cfg_key.zero, rules=rules_for(cfg_key) if mesh is not None else None,
                             adapters_only=cfg_key.lora_rank > 0, dropout_seed=cfg_key.seed,
                             loss_fn=loss_fn)
    return mc, model, tok, tx, fns, general


def _program_key(cfg: TrainConfig) -> TrainConfig:
    """The config with the fields that do not change the compiled program reset."""
    return dataclasses.replace(cfg, warmup=cfg.warmup_steps, data="default", ckpt_dir=None, ckpt_every=1, resume=False, stop_after=None,
                               eval_every=0, eval_batches=1, log=None, plot=None, progress=True,
                               coordinator=None, process_id=None, offload_dir=None)


# Flags that may differ between the processes of one job: each process's own index, its own address
# of process 0 (the processes joined one job), its own output files and local offload folder; --data
# by the tokens it holds (below), not by its path.
_PER_PROCESS = ("process_id", "coordinator", "init_timeout", "log", "plot", "progress", "offload_dir", "data")


def shared_flags(cfg: TrainConfig) -> dict:
    """The flags every process of a job must agree on, by flag name; paths in normal form (`run/` and
    `./run` are one directory)."""
    paths = ("model", "ckpt_dir", "save")
    return {f"--{k.replace('_', '-')}": os.path.normpath(os.path.expanduser(v)) if k in paths and v else v
            for k, v in dataclasses.asdict(cfg).items() if k not in _PER_PROCESS}


def build(cfg: TrainConfig) -> Run:
    """Validate, join a multi-host job when asked, make the mesh, then build model,
    data, optimizer and the train functions."""
    policy = validate(cfg)
    if cfg.distributed:
        from jmem import parallel as par

        par.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, initialization_timeout=cfg.init_timeout,
                       heartbeat_timeout=cfg.heartbeat_timeout)
        # Before the first collective: processes on different flags would wait on each other forever.
        par.check_same_settings(shared_flags(cfg), "flags")
    mesh = mesh_for(cfg)
    mc, model, tok, tx, fns, general = _cached_fns(_program_key(cfg), mesh)
    vocab = getattr(tok, "vocab_size", None)
    if vocab is not None and vocab > mc.vocab_size:
        raise ValueError(f"tokenizer vocab {vocab} exceeds the model's {mc.vocab_size}")
    data = PackedDataset.from_text(load_documents(cfg.data), tok, cfg.seq, names=(data_name(cfg.data), "--seq "))
    digest = data.digest() if cfg.distributed or cfg.ckpt_dir else None
    if cfg.distributed:  # the same path may hold a different text on another host
        par.check_same_settings({"--data (its tokens)": digest}, "training texts")
    abstract = jax.eval_shape(lambda: fns.init_state(model))
    meta = meta_for(cfg, mc, policy, abstract)
    if digest is not None:  # a resumed run notes a text that changed under its path (jmem.train.loop.resume_notes)
        meta["data_digest"] = digest
    return Run(cfg, policy, mc, model, tok, data, tx, fns, meta, mesh, general)

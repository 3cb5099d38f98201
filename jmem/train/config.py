"""`TrainConfig`: every knob of a training run, one field per command-line flag."""

from __future__ import annotations

import dataclasses

import numpy as np

from jmem.checks import is_int, is_number

OFFLOAD_SNAPSHOTS = "offload_optimizer"
"""Disk offload: the state files of each kept checkpoint step are copied to <ckpt-dir>/offload_optimizer/<step>
(beside Orbax's numbered step folders, which it ignores)."""

OPTIMIZERS = ("adamw", "adafactor", "adam8bit", "galore", "sgd")
DEFAULT_WARMUP = 20
"""Warmup steps when --warmup is unset (capped at a fifth of --steps)."""
# The --moe-* flags that take a value (unset: the model's own); --moe-dropless is a switch.
MOE_FLAGS = ("moe_experts", "moe_top_k", "moe_capacity_factor", "moe_aux_weight", "moe_z_weight")
ROUTER_SETTINGS = ("moe_capacity_factor", "moe_dropless", "moe_aux_weight", "moe_z_weight")
"""The router's capacity and loss weights: model-config fields and flags of the same names that add no
state (a resumed run may change them; they change its updates)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. The defaults train the `small` preset (about 3.2M
    parameters, byte-level vocabulary) from scratch on the standard library's
    help text for 200 steps with remat, bf16 compute and Adafactor."""

    model: str = "small"
    """Model preset (tiny, small, bench-8l, tiny-moe), `smollm2-135m` to fine-tune the real model, a GGUF path, or a
    directory written by --save (training goes on from its weights) or `jmem quantize --out DIR` (adapters only)."""
    data: str = "default"
    """Training text: 'default' (pydoc_data.topics) or a path to a UTF-8 text file."""
    steps: int = 200
    """Optimizer steps (total, counting steps done before a --resume)."""
    batch: int = 16
    """Global batch size in sequences (split into --accum microbatches)."""
    seq: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup from 0 at the first step, then cosine decay to 10%)."""
    warmup: int | None = None
    """Warmup steps of the learning-rate schedule, 0..--steps (unset: min(20, --steps // 5), so short runs warm up for a fifth of their steps)."""
    remat: str = "full"
    """Remat policy: none, full, dots, dots_no_batch, minimal, save_dot_except_mlp, offload, or 'name=remat|device|offload,...'."""
    precision: str = "bf16"
    """Precision policy: f32, bf16, f16, bf16-pure or 'p=f32,c=bf16,o=f32'."""
    accum: int = 1
    """Gradient-accumulation microbatches per step (must divide --batch); an MoE model routes, and computes its
    router losses, per microbatch."""
    optimizer: str = "adafactor"
    """Optimizer: adamw, adafactor, adam8bit, galore, sgd."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0 (adamw, adam8bit, galore; 0: none); norm scales and biases are not decayed."""
    galore_rank: int = 128
    """GaLore projection rank, >= 1 (--optimizer galore): weight matrices with both sides > rank keep rank-sized Adam moments; other leaves, the embeddings and the head use Adam."""
    galore_gap: int = 200
    """GaLore: steps between SVD refreshes of each projection, >= 1."""
    galore_scale: float = 0.25
    """GaLore: scale of the projected updates, > 0 (0.25 pairs with about 4x AdamW's --lr)."""
    clip: float = 1.0
    """Global gradient-norm clipping, >= 0 (0 disables)."""
    seed: int = 0
    """Seed of the parameter init and the batch order."""
    ckpt_dir: str | None = None
    """Directory for Orbax checkpoints (none when unset)."""
    ckpt_every: int = 100
    """Checkpoint every N steps (and at the end, and on SIGINT/SIGTERM) when --ckpt-dir is set."""
    resume: bool = False
    """Continue from the latest checkpoint in --ckpt-dir."""
    stop_after: int | None = None
    """Stop (with a checkpoint in --ckpt-dir) after this many steps in this invocation; --resume continues."""
    eval_every: int = 0
    """Evaluate on held-out windows every N steps (0: only at the end): the first --eval-batches x --batch windows
    of the held-out split (the text's last 5%), the same at every evaluation."""
    eval_batches: int = 4
    """Held-out batches of --batch windows per evaluation (each run in --accum microbatches, as a train step)."""
    log: str | None = None
    """Write one JSON line per step (and per evaluation) to this file: a new (or empty) file, or with
    --resume the resumed run's log, which is continued (by process 0 alone in a multi-process job). Strict
    JSON: a non-finite number (a skipped fp16 step's gradient norm) is written as null. First a memory event
    (the table's bytes), then per step: loss (mean token cross-entropy in nats, before the step's update),
    grad_norm (global, before clipping), step_time_s, tokens_per_s (--batch x --seq / step_time_s), loss_scale
    (fp16's dynamic scale), finite, and an MoE model's moe_* router statistics; eval lines hold eval_loss."""
    plot: str | None = None
    """Write a PNG of the loss curve and the memory table to this file (by process 0 alone). The curve holds the
    steps this invocation trained; a resumed run's --log holds the whole run's."""
    save: str | None = None
    """When the run finishes: with --lora-rank and a path ending in .npz, the adapters (`jmem serve --lora-modules NAME=FILE`); otherwise the trained model to this new directory (`jmem generate/serve --model DIR`, `jmem.load(DIR)`), with --lora-rank its adapters merged into its weights (a quantized base comes back as float). It computes in f32 as every model file loads (`jmem.load(DIR, compute_dtype=...)` to change), and keeps a GGUF source's general.* fields (license, ...); `jmem quantize --model DIR --method f16 --out F.gguf` converts it to GGUF."""
    loss_chunk: int | None = None
    """Sequence chunk of the cross-entropy (the preset's when unset)."""

    moe_experts: int | None = None
    """Mixture of experts: this many experts replace every block's MLP of a preset model (random init; unset: the preset's own, tiny-moe has 4)."""
    moe_top_k: int | None = None
    """MoE: experts each token is routed to (unset: the model's, 2)."""
    moe_capacity_factor: float | None = None
    """MoE: places per expert in training relative to an even split of the routed tokens; the rest are dropped (unset: the model's, 1.25)."""
    moe_dropless: bool = False
    """MoE: route every token to its experts in training too (grouped matmuls, nothing dropped)."""
    moe_aux_weight: float | None = None
    """MoE: weight of the load-balancing loss (unset: the model's, 0.01)."""
    moe_z_weight: float | None = None
    """MoE: weight of the router z-loss (unset: the model's, 0.001)."""
    progress: bool = True
    """Show a progress bar (plain lines every 10 steps when off)."""
    mesh: str | None = None
    """Device mesh such as 'data=2,fsdp=2,tensor=2' (axes stage, data, fsdp, expert, tensor; one may be -1); unset: one device, or all devices on 'data' when --zero or --pipeline-stages asks for a mesh."""
    zero: int = 0
    """ZeRO stage over the data axes: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters (gathered per layer)."""
    rules: str = ""
    """Sharding-rule overrides 'logical=mesh_axes,...' on top of the defaults (e.g. 'embed=fsdp,length=tensor')."""
    pipeline_stages: int = 1
    """Pipeline stages over the mesh's 'stage' axis (schedule: --pipeline-schedule); must divide the layer count."""
    microbatches: int = 1
    """Pipeline microbatches per step (with --pipeline-stages > 1): --batch must be a multiple of the data-parallel size x --accum x --microbatches."""
    pipeline_schedule: str = "gpipe"
    """Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (PipeDream-flush: each stage holds at most --pipeline-stages microbatch inputs instead of --microbatches)."""
    coordinator: str | None = None
    """Multi-host: HOST:PORT of process 0 (with --num-processes and --process-id; unset on TPU pods / SLURM: auto-detected)."""
    num_processes: int | None = None
    """Multi-host: total number of processes."""
    process_id: int | None = None
    """Multi-host: this process's index (0..num_processes-1)."""
    init_timeout: int = 300
    """Multi-host: seconds a process waits for all the others to join before it stops with an error."""
    heartbeat_timeout: int = 100
    """Multi-host: seconds without a heartbeat after which JAX's coordination service declares a process dead
    and ends the job."""

    offload_optimizer: str = "none"
    """Optimizer state and f32 master weights: none (on device), host (host memory; the update runs on the host, ZeRO-Offload) or disk (files under --offload-dir, updated one layer slice at a time, ZeRO-Infinity)."""
    offload_params: str = "none"
    """Layer parameters: none (on device) or host (host memory, moved to the device one layer at a time inside the layer scan); needs --offload-optimizer host or disk."""
    offload_dir: str | None = None
    """Directory of the optimizer-state files of --offload-optimizer disk (required with it); state files
    an earlier run left there are replaced."""

    layerwise: int = 0
    """Layer-wise (LISA) training: train this many layers at a time, plus embeddings, final norm and head; gradients and optimizer state exist for those alone (0: every layer every step)."""
    layerwise_period: int = 20
    """Steps between layer draws of --layerwise; the layers' optimizer state is reset at each."""
    layerwise_schedule: str = "random"
    """Which layers --layerwise trains: random (LISA), bottom-up or top-down (cycling blocks)."""

    lora_rank: int = 0
    """LoRA rank; > 0 trains only adapters on --lora-targets (gradients and optimizer state for them alone)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator (alpha / rank)."""
    lora_targets: str = "wq,wk,wv,wo,w_gate,w_up,w_down"
    """Comma-separated weights that get adapters; an MoE model has moe.expert_gate, moe.expert_up,
    moe.expert_down (one adapter per expert) instead of the MLP linears, and the default means them."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input in training steps, 0 <= p < 1 (never in evaluation or inference)."""
    quantize_base: str | None = None
    """Quantize the frozen base before adding adapters (QLoRA): nf4, int8, fp8 or rtn (4-bit, groups of 128 rows);
    needs --lora-rank. Serve the adapters on the same base: `jmem quantize --method M --out DIR` (its defaults)."""

    def moe_overrides(self) -> dict:
        """The model-config fields the --moe-* flags set (those given)."""
        out = {name: getattr(self, name) for name in MOE_FLAGS if getattr(self, name) is not None}
        if self.moe_dropless:
            out["moe_dropless"] = True
        return out

    def __post_init__(self):
        """Each field of its annotated kind (NumPy scalars become Python ones, so the config stays JSON for
        checkpoints and logs); the ranges are checked by `jmem.train.checks.validate`."""
        for f in dataclasses.fields(self):
            value, kinds = getattr(self, f.name), f.type.split(" | ")
            if value is None and "None" in kinds:
                continue
            if "int" in kinds and is_int(value):
                object.__setattr__(self, f.name, int(value))
            elif "float" in kinds and is_number(value):
                object.__setattr__(self, f.name, float(value))
            elif "bool" in kinds and isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, f.name, bool(value))
            elif not ("str" in kinds and isinstance(value, str)):
                accepted = {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string"}
                raise ValueError(f"--{f.name.replace('_', '-')}={value!r}; accepted: "
                                 + " or ".join(accepted.get(k, k) for k in kinds))

    @property
    def warmup_steps(self) -> int:
        """--warmup, or min(DEFAULT_WARMUP, steps // 5) when it is unset."""
        return min(DEFAULT_WARMUP, self.steps // 5) if self.warmup is None else self.warmup

    @property
    def distributed(self) -> bool:
        """True when the step runs on a device mesh (--mesh, --zero or --pipeline-stages given)."""
        return self.mesh is not None or self.zero != 0 or self.pipeline_stages > 1 or self.num_processes not in (None, 1)

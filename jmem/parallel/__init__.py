"""Distributed memory: meshes, logical-axis sharding rules, ZeRO 0-3, tensor and pipeline
parallelism, and multi-host initialisation.

Example:
    >>> from jmem import parallel
    >>> mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
    >>> loss_fn, params = parallel.model_loss_fn(model)
    >>> trainer = parallel.make_sharded_train_step(loss_fn, optax.adamw(1e-3), params, mesh, zero=3)
    >>> # sequence parallelism: the residual stream between blocks split over `tensor`
    >>> trainer = parallel.make_sharded_train_step(loss_fn, optax.adamw(1e-3), params,
    ...                                            parallel.make_mesh("data=4,tensor=2"), rules="length=tensor")
"""

from jmem.parallel.distributed import (DistributedError, ProcessInfo, check_same_settings, initialize, local_value,
                                      to_global)
from jmem.parallel.gather import GatheredWeight, gather_on_use
from jmem.parallel.hlo import collectives
from jmem.parallel.mesh import (AXES, DATA_AXES, MeshError, check_mesh, data_parallel_size, make_mesh, mesh_summary,
                                parse_mesh)
from jmem.parallel.pipeline import PipelineError, pipeline, pipeline_hidden, pipeline_lm_loss_fn, split_stages
from jmem.parallel.pipeline_1f1b import (SCHEDULES, busiest_stage_matmul_flops, check_tick_collectives,
                                         pipeline_1f1b, pipeline_1f1b_lm_loss_fn, pipeline_1f1b_lm_value_and_grad,
                                         schedule_lm_loss_fn)
from jmem.parallel.rules import (ACTIVATION_AXES, DEFAULT_RULES, Rules, ShardingError, activation_sharding,
                                 active_activation_sharding, batch_sharding, check_heads, constrain, logical_tree,
                                 shard, shardings)
from jmem.parallel.step import (ParallelState, ShardedTrainStep, dp_accumulate_value_and_grad, jit_train_step,
                                make_sharded_train_step, model_loss_fn)
from jmem.parallel.zero import (ZERO_STAGES, ZeroShardings, ZeroStageError, bytes_per_device, check_stage,
                                constrain_gradients, model_state_bytes, state_shardings, zero_model_bytes,
                                zero_shardings)

__all__ = [
    "ACTIVATION_AXES", "activation_sharding", "active_activation_sharding", "AXES", "DATA_AXES", "GatheredWeight", "gather_on_use", "DistributedError", "PipelineError", "ProcessInfo", "initialize", "local_value",
    "pipeline", "pipeline_hidden", "pipeline_lm_loss_fn", "split_stages", "to_global", "DEFAULT_RULES", "MeshError", "ParallelState", "Rules", "ShardedTrainStep",
    "ShardingError", "ZERO_STAGES", "ZeroShardings", "ZeroStageError", "batch_sharding", "bytes_per_device",
    "check_mesh", "check_stage", "collectives", "constrain", "constrain_gradients", "data_parallel_size",
    "dp_accumulate_value_and_grad", "jit_train_step", "logical_tree", "make_mesh", "make_sharded_train_step",
    "mesh_summary", "model_loss_fn", "model_state_bytes", "parse_mesh", "shard", "shardings", "state_shardings", "zero_model_bytes",
    "zero_shardings",
]
__all__ += ["SCHEDULES", "busiest_stage_matmul_flops", "pipeline_1f1b", "pipeline_1f1b_lm_loss_fn",
            "pipeline_1f1b_lm_value_and_grad", "schedule_lm_loss_fn"]
__all__ += ["check_heads", "check_same_settings", "check_tick_collectives"]

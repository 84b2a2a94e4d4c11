"""mfsdp_core: the sharding runtime (placement plans, layouts, flat buffers, ``fully_shard``,
optimizer adapter). It never imports the checkpoint layer."""

from mfsdp_core.collectives import count_comm
from mfsdp_core.companion import Companion
from mfsdp_core.fully_shard import fully_shard, plan_of, rename_params, set_comm_stream, set_overlap
from mfsdp_core.layout import Layout, Policy, compute_layout, parse_policy
from mfsdp_core.mixed_precision import MixedPrecision
from mfsdp_core.optim import clip_grad_norm_, fully_shard_optimizer
from mfsdp_core.plan import BufferSpec, ModelPlan, Placement, plan_model
from mfsdp_core.shards import FlatShard, ParamShard, describe_shards, refresh_compute_params
from mfsdp_core.strategy import Strategy, parse_strategy

__all__ = [
    "fully_shard",
    "fully_shard_optimizer",
    "clip_grad_norm_",
    "MixedPrecision",
    "Placement",
    "Companion",
    "BufferSpec",
    "ModelPlan",
    "plan_model",
    "plan_of",
    "rename_params",
    "set_overlap",
    "set_comm_stream",
    "Strategy",
    "parse_strategy",
    "Policy",
    "parse_policy",
    "Layout",
    "compute_layout",
    "describe_shards",
    "refresh_compute_params",
    "FlatShard",
    "ParamShard",
    "count_comm",
]

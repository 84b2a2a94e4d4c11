"""mfsdp_core: the sharding runtime (layouts, flat buffers, ``fully_shard``, optimizer adapter)."""

from .collectives import count_comm
from .fully_shard import fully_shard, plan_buffers
from .layout import Layout, Policy, compute_layout, parse_policy
from .mixed_precision import MixedPrecision
from .optim import clip_grad_norm_, fully_shard_optimizer
from .shards import FlatShard, ParamShard, describe_shards, refresh_compute_params
from .strategy import Strategy, parse_strategy

__all__ = [
    "fully_shard",
    "plan_buffers",
    "fully_shard_optimizer",
    "clip_grad_norm_",
    "MixedPrecision",
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

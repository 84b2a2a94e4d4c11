"""The manifest's ``writer.groups``: every flat buffer's parameters in buffer order, with the
buffer's strategy, policy and group size. ``reshard`` computes any other layout's ranges from
them without building the model.

A sharded model reports its own buffers (:func:`groups_of`). A checkpoint that no sharded model
wrote (``import-hf``) or that predates ``writer.groups`` gets them planned from its GPT model
config (:func:`planned_groups`): the buffers ``mfsdp_core.train`` would make. Groups only decide
which file holds which range; any layout loads any checkpoint whatever its groups say.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mfsdp_core import describe_shards, plan_buffers
from mfsdp_core.models.gpt import GPTConfig, GPTModel, shard_units

__all__ = ["groups_of", "planned_groups", "DEFAULT_STRATEGY", "DEFAULT_POLICY"]

DEFAULT_STRATEGY = "optim_grads_params"  # the defaults of fully_shard and of mfsdp_core.train
DEFAULT_POLICY = "even"


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    """The flat buffers of a ``fully_shard``-ed ``model``, as this rank holds them."""
    groups: list[dict[str, Any]] = []
    last = None
    for ps in describe_shards(model):
        if ps.layout is not last:
            last = ps.layout
            groups.append({"params": [], "strategy": ps.strategy.value, "policy": str(ps.policy),
                           "group_size": ps.group_size, "is_expert": ps.is_expert})
        groups[-1]["params"].append(ps.fqn)
    return groups


def planned_groups(model_config: dict[str, Any] | None, *, strategy: str = DEFAULT_STRATEGY,
                   policy: str = DEFAULT_POLICY, group_size: int = 1) -> list[dict[str, Any]] | None:
    """The flat buffers ``mfsdp_core.train`` makes for the GPT model ``model_config`` describes
    (built on the meta device: nothing is allocated), or None when it describes no GPT model."""
    if not isinstance(model_config, dict):
        return None
    try:
        config = GPTConfig.from_dict(model_config)
        with torch.device("meta"):
            model = GPTModel(config)
    except (TypeError, ValueError):
        return None
    return [{"params": names, "strategy": strategy, "policy": policy, "group_size": group_size, "is_expert": expert}
            for names, expert in plan_buffers(model, shard_units(model))]

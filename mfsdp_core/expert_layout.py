"""Which expert-parallel rank holds which experts, as plain integer rules, and how an expert
parameter is named (its global index last). Torch-free, so that a checkpoint's index and the
launcher's pre-flight use them without importing torch; :mod:`mfsdp_core.expert_parallel` builds
the process groups and placements from them."""

from __future__ import annotations

import re

__all__ = ["EP_GROUP", "EDP_GROUP", "check_expert_parallel", "local_experts", "expert_owner", "expert_index"]

EP_GROUP = "ep"
EDP_GROUP = "edp"

_EXPERT_NAME = re.compile(r"^(?P<template>(?:.*\.)?experts\..*?)(?P<index>\d+)$")


def expert_index(name: str) -> tuple[str, int] | None:
    """``(template, global index)`` of an expert parameter name
    (``decoder.layers.0.mlp.experts.linear_fc1.weight3`` → ``("…linear_fc1.weight", 3)``), or
    None for any other parameter."""
    m = _EXPERT_NAME.match(name)
    return (m["template"], int(m["index"])) if m else None


def check_expert_parallel(world_size: int, ep_size: int, num_experts: int) -> None:
    """Raise ValueError, naming the numbers, unless ``ep_size`` can place ``num_experts`` experts
    over ``world_size`` ranks: it divides both."""
    if ep_size < 1:
        raise ValueError(f"EP size must be >= 1, got {ep_size}")
    if world_size % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide the world size {world_size}")
    if ep_size > 1 and num_experts == 0:
        raise ValueError(f"EP size {ep_size} needs a model with experts; this one has none")
    if num_experts and ep_size > num_experts:
        raise ValueError(f"EP size {ep_size} exceeds the number of experts {num_experts}")
    if num_experts % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide the number of experts {num_experts}")


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` holds."""
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def expert_owner(expert: int, num_experts: int, ep_size: int) -> int:
    """The EP rank holding global expert ``expert``."""
    return expert // (num_experts // ep_size)

"""HSDP and HFSDP: shard inside a group of ranks, replicate across the groups.

With world size W and R replicas (R divides W), the ranks form an ``R × (W / R)`` grid with the
shard dimension fastest, as PyTorch's ``DeviceMesh(("replicate", "shard"))`` orders it:

- **shard group** of rank g: the W / R consecutive ranks ``S·⌊g/S⌋ … S·⌊g/S⌋ + S - 1``
  (S = W / R); parameters are sharded over it and gathered inside it, gradients reduce-scattered
  inside it;
- **replicate group** of rank g: the R ranks ``g mod S, g mod S + S, …`` that hold the same shard;
  gradients are then all-reduced across it, once per step, on 1/S of the bytes;
- ``dp``: all W ranks, over which gradient norms are summed (a replicated shard counted once).

**HFSDP** keeps the parameters and gradients of HSDP (gathered and reduced inside the shard
group) but shards the main params and optimizer state over the whole mesh: each shard is split
again over its replicas (:func:`mfsdp_core.layout.refine_layout`), the across-replica all-reduce
becomes a reduce-scatter, and after the optimizer step one all-gather across the replicas
rebuilds the shard. Memory for optimizer state falls by R; traffic across replicas stays 1/S of
the model per step.

A checkpoint does not depend on any of this: replicas write each chunk once (PyTorch DCP's
deduplication of identical write items spreads them over the replicas) and a checkpoint saved
by an HSDP run loads into any other layout.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn

from mfsdp_core import collectives as C
from mfsdp_core.plan import DEFAULT_GROUP, Placement, PlacementFn

__all__ = ["SHARD_GROUP", "REPLICATE_GROUP", "check_replicas", "hsdp_groups", "hsdp_placement"]

SHARD_GROUP = "shard"
REPLICATE_GROUP = "replicate"


def check_replicas(world_size: int, replicas: int) -> None:
    """ValueError, naming the numbers, unless ``replicas`` groups of ranks can split ``world_size``."""
    if replicas < 1:
        raise ValueError(f"the replica count must be >= 1, got {replicas}")
    if world_size % replicas:
        raise ValueError(f"{replicas} replicas do not divide the world size {world_size}")


def hsdp_groups(replicas: int) -> dict[str, dist.ProcessGroup | None]:
    """The shard and replicate groups of this rank for ``replicas`` replica groups (collective:
    every rank calls it, in the same order as its other group creations). A group of one rank is
    None (nothing to communicate). Merge the result into the groups given to ``fully_shard``."""
    rank, world = C.rank_and_world()
    check_replicas(world, replicas)
    size = world // replicas
    return {
        SHARD_GROUP: _my_group([list(range(k * size, (k + 1) * size)) for k in range(replicas)], rank),
        REPLICATE_GROUP: _my_group([list(range(s, world, size)) for s in range(size)], rank),
    }


def _my_group(partition: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    mine = None
    for ranks in partition:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def hsdp_placement(place: PlacementFn, *, shard_optim_across_replicas: bool = False) -> PlacementFn:
    """``place`` with every buffer it puts over ``"dp"`` sharded over the shard group and
    replicated across the replicate group instead (HSDP; HFSDP with
    ``shard_optim_across_replicas``). Placements over other groups (experts over their
    expert-data-parallel group) are kept."""

    def fn(name: str, param: nn.Parameter) -> Placement:
        where = place(name, param)
        if where.group != DEFAULT_GROUP:
            return where
        return dataclasses.replace(
            where,
            group=SHARD_GROUP,
            replicate=REPLICATE_GROUP,
            shard_optim_across_replicas=shard_optim_across_replicas,
        )

    return fn

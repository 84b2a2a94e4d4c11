"""Expert parallelism: which rank holds which experts, the process groups that follows from, and
the placement that shards experts over the ranks holding the same ones.

With world size W and EP size E (E divides W and the number of experts N), the ranks form a
``(W / E) × E`` grid with the EP dimension fastest, as Megatron-Core orders it:

- **EP group** of rank g: the E consecutive ranks ``E·⌊g/E⌋ … E·⌊g/E⌋ + E - 1``; tokens travel
  between them. EP rank ``p = g mod E`` holds global experts ``p·N/E … (p+1)·N/E - 1``.
- **expert-data-parallel group** (``edp``) of rank g: the W / E ranks with the same EP rank,
  ``p, p + E, p + 2E, …``; they hold the same experts and shard them like data parallelism.
- **data-parallel group** (``dp``): all W ranks; dense parameters are sharded over it.

An expert's gradient summed over its ``edp`` group covers the tokens of all W ranks (each EP group
sent its tokens for that expert to the one member holding it), so it is divided by W, the ``dp``
size, for an update identical to the unsharded model's: :func:`expert_placement` says so with
``grad_divisor="dp"``.

Experts are named by their **global** index everywhere (``…experts.linear_fc1.weight17`` on
whichever rank holds expert 17): the trailing integer of a parameter whose path contains
``experts.`` (:func:`expert_index`). Checkpoints therefore do not depend on the EP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch.distributed as dist
from torch import nn

from mfsdp_core import collectives as C
from mfsdp_core.expert_layout import (
    EDP_GROUP,
    EP_GROUP,
    check_expert_parallel,
    expert_index,
    expert_owner,
    local_experts,
)
from mfsdp_core.layout import Policy, parse_policy
from mfsdp_core.plan import DEFAULT_GROUP, DEFAULT_POLICY, Placement, PlacementFn

__all__ = [
    "EP_GROUP",
    "EDP_GROUP",
    "ExpertMesh",
    "check_expert_parallel",
    "init_expert_mesh",
    "local_experts",
    "expert_owner",
    "expert_index",
    "expert_placement",
    "ep_rank_of",
]


@dataclass(frozen=True)
class ExpertMesh:
    """This rank's place in the ``(W / E) × E`` grid and the process groups of its row and
    column. ``groups`` is what ``fully_shard(mesh=...)`` takes; a group of one rank is None."""

    world_size: int
    ep_size: int
    rank: int
    groups: Mapping[str, dist.ProcessGroup | None]

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.groups[EP_GROUP]

    def local_experts(self, num_experts: int) -> range:
        return local_experts(num_experts, self.ep_size, self.ep_rank)


def init_expert_mesh(ep_size: int, num_experts: int | None = None) -> ExpertMesh:
    """Make the EP and expert-data-parallel groups for ``ep_size`` (collective: every rank calls
    it, in the same order as its other group creations). With ``num_experts``, first check that
    ``ep_size`` divides it (ValueError naming the numbers)."""
    rank, world = C.rank_and_world()
    check_expert_parallel(world, ep_size, num_experts if num_experts is not None else ep_size)
    groups: dict[str, dist.ProcessGroup | None] = {DEFAULT_GROUP: dist.group.WORLD if dist.is_initialized() else None}
    groups[EP_GROUP] = _my_group([list(range(k * ep_size, (k + 1) * ep_size)) for k in range(world // ep_size)], rank)
    groups[EDP_GROUP] = _my_group([list(range(p, world, ep_size)) for p in range(ep_size)], rank)
    return ExpertMesh(world, ep_size, rank, groups)


def _my_group(partition: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create every group of ``partition`` (each rank must take part in every creation) and return
    this rank's; groups of one rank are None (nothing to communicate)."""
    mine = None
    for ranks in partition:
        if len(ranks) == 1:
            if rank in ranks:
                mine = None
            continue
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def expert_placement(
    policy: str | Policy = DEFAULT_POLICY,
    is_expert: Callable[[str], bool] = lambda name: expert_index(name) is not None,
) -> PlacementFn:
    """Experts sharded over the expert-data-parallel group, their summed gradients divided by the
    data-parallel size; every other parameter over ``"dp"``. One policy for both. ``is_expert``
    tells a routed expert's parameter by its name (default: ours, :func:`expert_index`; a model
    family naming experts otherwise passes its own)."""
    pol = parse_policy(policy)
    expert = Placement(pol, group=EDP_GROUP, expert=True, grad_divisor=DEFAULT_GROUP)
    dense = Placement(pol)
    return lambda name, param: expert if is_expert(name) else dense


def ep_rank_of(module: nn.Module) -> tuple[int, int]:
    """``(EP rank, EP size)`` of this rank for a ``fully_shard``-ed module (``(0, 1)`` without
    expert parallelism): read from the ``"ep"`` group its units were given."""
    from mfsdp_core.fully_shard import units_of

    for unit in units_of(module):
        if EP_GROUP in unit.groups:
            group = unit.groups[EP_GROUP]
            return C.group_rank(group), C.group_size(group)
    return 0, 1

"""Expert parallelism on the checkpoint side: the manifest's ``writer.experts`` entry,
optimizer groups merged across ranks, expert counts per template, and the regrouping of expert
buffers for another EP size (offline ``reshard``).

Under expert parallelism each rank holds only its experts, named by their global index
(``…experts.linear_fc1.weight5``), so a checkpoint keyed by name holds every expert once whatever
the EP size. What one rank knows (its placement plan, its optimizer's groups) covers only its own
experts: a save gathers them from every rank and merges them, so that the manifest and
``optim.param_groups`` describe the whole model.

Pure functions of plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import torch

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_core.expert_layout import EDP_GROUP, EP_GROUP, expert_index, local_experts
from mfsdp_core.layout import Policy
from mfsdp_core.plan import DEFAULT_GROUP, BufferSpec, ModelPlan
from mfsdp_core.strategy import Strategy

__all__ = [
    "experts_entry",
    "merge_param_groups",
    "expert_counts",
    "expert_count_problem",
    "is_expert_buffer",
    "regroup_experts",
    "ep_owner_ranks",
]


# ---- save: what the manifest records -------------------------------------------------------------------


def _expert_indices(names: Iterable[str]) -> set[int]:
    return {parsed[1] for n in names if (parsed := expert_index(n)) is not None}


def experts_entry(ep_size: int, held: Sequence[tuple[int, Iterable[str]]]) -> dict[str, Any] | None:
    """The manifest's ``writer.experts``: the EP size and, per EP rank, the global indices of the
    experts it held, from ``(ep_rank, parameter names)`` of every rank (None: no experts)."""
    owners: list[set[int]] = [set() for _ in range(ep_size)]
    for ep_rank, names in held:
        owners[ep_rank] |= _expert_indices(names)
    if not any(owners):
        return None
    return {"ep_size": ep_size, "owners": [sorted(o) for o in owners]}


def ep_owner_ranks(ep_rank: int, ep_size: int, world_size: int) -> list[int]:
    """The global ranks holding EP rank ``ep_rank``'s experts: ``p, p + E, p + 2E, …``."""
    return list(range(ep_rank, world_size, ep_size))


# ---- save: optimizer groups of every rank ----------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    """Hyper-parameter equality (tensors compared by value, bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def merge_param_groups(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One ``optim.param_groups`` from every rank's (each naming only the parameters that rank
    holds): group ``g`` lists every rank's parameters of its group ``g``, each once, in order of
    first appearance over the ranks. Every rank must have as many groups, with the same
    hyper-parameters (:class:`CheckpointError` otherwise)."""
    first = per_rank[0]
    for rank, groups in enumerate(per_rank[1:], start=1):
        if len(groups) != len(first):
            raise CheckpointError(
                f"save: the optimizer has {len(first)} parameter group(s) on rank 0 but {len(groups)} "
                f"on rank {rank}; expert-parallel ranks need the same groups"
            )
        for g, (a, b) in enumerate(zip(first, groups)):
            keys = sorted((set(a) | set(b)) - {"params"})
            differ = [k for k in keys if not (k in a and k in b and _same(a[k], b[k]))]
            if differ:
                raise CheckpointError(
                    f"save: optimizer param_groups[{g}] differs between rank 0 and rank {rank} "
                    f"in {', '.join(differ)}; expert-parallel ranks need the same hyper-parameters"
                )
    merged = []
    for g, group in enumerate(first):
        merged.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": _model_order([groups[g]["params"] for groups in per_rank]),
            }
        )
    return merged


def _model_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """The union of ``lists`` in the order the whole model lists its parameters: first
    appearance over the lists, except that the experts of one template stand together where
    the template first appears, by global index. So the merged groups are the same whatever
    the EP size (the order one rank holding every expert has)."""
    position: dict[Any, int] = {}
    for names in lists:
        for name in names:
            parsed = expert_index(name)
            position.setdefault(parsed[0] if parsed is not None else name, len(position))

    def order(name: str) -> tuple[int, int]:
        parsed = expert_index(name)
        return (position[parsed[0]], parsed[1]) if parsed is not None else (position[name], 0)

    return sorted({name for names in lists for name in names}, key=order)


# ---- load: expert counts ---------------------------------------------------------------------


def expert_counts(names: Iterable[str]) -> dict[str, set[int]]:
    """Global expert indices per template (``…experts.linear_fc1.weight`` -> {0, 1, …}) among
    parameter names."""
    out: dict[str, set[int]] = {}
    for name in names:
        parsed = expert_index(name)
        if parsed is not None:
            out.setdefault(parsed[0], set()).add(parsed[1])
    return out


def expert_count_problem(checkpoint: Mapping[str, set[int]], model: Mapping[str, set[int]]) -> str | None:
    """Why the checkpoint's experts cannot load into the model's (None: same count for every
    template both have), naming both counts and the template."""
    for template in sorted(set(checkpoint) & set(model)):
        if len(checkpoint[template]) != len(model[template]):
            return (
                f"the checkpoint has {len(checkpoint[template])} experts in '{template}{{e}}', the model "
                f"{len(model[template])}; a checkpoint loads only into a model with as many experts"
            )
    return None


# ---- reshard: expert buffers for another EP size ---------------------------------------------


def is_expert_buffer(spec: BufferSpec) -> bool:
    """An expert buffer of expert parallelism: experts sharded over the expert-data-parallel group."""
    return spec.is_expert and spec.placement.group == EDP_GROUP


def _kind(spec: BufferSpec) -> tuple:
    """What must be equal for parameters to share a buffer (the runtime groups by placement,
    dtype and requires_grad; strategy and dtypes are a model's)."""
    return (spec.placement, spec.dtype, spec.requires_grad, spec.strategy, spec.param_dtype, spec.main_dtype)


def num_experts_of(specs: Iterable[BufferSpec]) -> int:
    """The number of experts the expert buffers hold (the same for every template, or refused)."""
    counts = expert_counts(n for spec in specs for n in spec.fqns)
    sizes = {len(v) for v in counts.values()}
    if len(sizes) > 1:
        detail = ", ".join(f"{t}{{e}}: {len(v)}" for t, v in sorted(counts.items()))
        raise CheckpointError(f"reshard: the expert templates hold different numbers of experts ({detail})")
    return sizes.pop() if sizes else 0


def regroup_experts(
    plan: ModelPlan, world_size: int, ep_size: int, *, strategy: Strategy | None = None, policy: Policy | None = None
) -> list[tuple[BufferSpec, tuple[int, ...]]]:
    """Every buffer of ``plan`` as the runtime at (``world_size``, ``ep_size``) builds it, each with
    the global rank of each of its shard ranks: dense buffers over all ranks (shard rank r is
    rank r); per unit, the expert buffers (one per source EP rank) become ``ep_size`` buffers, EP
    rank p' holding, for each expert template in the unit's order, experts
    ``p'·N/E' … (p'+1)·N/E' - 1``, over its ``world_size / ep_size`` expert-data-parallel ranks
    (shard rank k is rank ``k·E' + p'``). Expert buffers of a plan without expert parallelism
    (experts over ``dp``) take the expert placement: group ``edp``, gradients divided by ``dp``.
    ``strategy`` / ``policy`` replace the writer's. The numbers are checked by the caller."""
    edp = world_size // ep_size
    sizes = {DEFAULT_GROUP: world_size, EP_GROUP: ep_size, EDP_GROUP: edp}
    num = num_experts_of(s for s in plan.buffers if s.is_expert)
    by_unit: dict[str, list[BufferSpec]] = {}
    for spec in plan.buffers:
        by_unit.setdefault(spec.prefix, []).append(spec)
    out: list[tuple[BufferSpec, tuple[int, ...]]] = []
    for specs in by_unit.values():
        specs = _without_ep(specs)
        experts = [s for s in specs if s.is_expert and s.placement.group in (DEFAULT_GROUP, EDP_GROUP)]
        expert_ids = {id(s) for s in experts}
        placed = False
        for spec in specs:
            if id(spec) not in expert_ids:
                out.append(
                    (
                        spec.resized(world_size, strategy=strategy, policy=policy, group_sizes=sizes),
                        tuple(range(world_size)),
                    )
                )
            elif not placed:  # where the unit's expert buffers begin
                out.extend(
                    (spec.resized(edp, strategy=strategy, policy=policy, group_sizes=sizes), ranks)
                    for spec, ranks in _expert_buffers(experts, num, ep_size, edp, sizes)
                )
                placed = True
    return out


def _subset(spec: BufferSpec, keep: Sequence[int], **changes: Any) -> BufferSpec:
    """``spec`` with only the parameters at ``keep`` (and ``changes``)."""
    return dataclasses.replace(
        spec, names=tuple(spec.names[i] for i in keep), shapes=tuple(spec.shapes[i] for i in keep), **changes
    )


def _without_ep(specs: list[BufferSpec]) -> list[BufferSpec]:
    """One unit's buffers as expert parallelism places them, for a plan written without it:
    an expert buffer over ``dp`` keeps the parameters named by a global expert index (the
    routed experts); the others (a shared expert, whose name also holds ``experts.``) are dense
    under expert parallelism and join the unit's dense buffer of the same kind, after its own
    parameters (registration order: the experts come after the router and before the shared
    expert), or form one of their own. Buffers over ``edp`` are already placed so."""
    out = list(specs)
    for spec in specs:
        if not (spec.is_expert and spec.placement.group == DEFAULT_GROUP):
            continue
        routed = [i for i, n in enumerate(spec.names) if expert_index(n) is not None]
        rest = [i for i, n in enumerate(spec.names) if expert_index(n) is None]
        if not rest:
            continue
        at = out.index(spec)
        out[at : at + 1] = [_subset(spec, routed)] if routed else []
        dense = _subset(spec, rest, placement=dataclasses.replace(spec.placement, expert=False))
        same = next((i for i, s in enumerate(out) if not s.is_expert and _kind(s) == _kind(dense)), None)
        if same is None:
            out.insert(at, dense)
        else:
            out[same] = dataclasses.replace(
                out[same], names=out[same].names + dense.names, shapes=out[same].shapes + dense.shapes
            )
    return out


def _expert_buffers(
    experts: list[BufferSpec], num: int, ep_size: int, edp: int, sizes: Mapping[str, int]
) -> list[tuple[BufferSpec, tuple[int, ...]]]:
    """The ``ep_size`` (times kinds) target buffers of one unit's expert buffers."""
    kinds: dict[tuple, list[BufferSpec]] = {}
    for spec in experts:
        kinds.setdefault(_kind(spec), []).append(spec)
    out = []
    for p in range(ep_size):
        mine = set(local_experts(num, ep_size, p))
        for specs in kinds.values():
            shape_of: dict[tuple[str, int], torch.Size] = {}
            templates: dict[str, None] = {}
            for spec in specs:
                for name, shape in zip(spec.names, spec.shapes):
                    parsed = expert_index(name)
                    if parsed is None:
                        raise CheckpointError(
                            f"reshard: '{spec.prefix}{name}' is in an expert buffer but is not named "
                            "by a global expert index (…experts.<name><index>)"
                        )
                    templates.setdefault(parsed[0], None)
                    shape_of[parsed] = shape
            keys = [(t, e) for t in templates for e in sorted(mine) if (t, e) in shape_of]
            base = specs[0]
            placement = base.placement
            if placement.group != EDP_GROUP:
                placement = dataclasses.replace(placement, group=EDP_GROUP, grad_divisor=DEFAULT_GROUP)
            spec = dataclasses.replace(
                base,
                names=tuple(f"{t}{e}" for t, e in keys),
                shapes=tuple(shape_of[k] for k in keys),
                placement=placement,
                group_size=edp,
                divisor_size=sizes[DEFAULT_GROUP],
            )
            spec = spec.resized(edp, group_sizes=sizes)
            out.append((spec, tuple(k * ep_size + p for k in range(edp))))
    return out

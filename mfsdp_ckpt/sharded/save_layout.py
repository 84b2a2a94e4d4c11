"""A save's layout without gathering plans: every rank derives the whole job's plan from its own
(:func:`~mfsdp_ckpt.format.catalog.global_plan`), and the ranks agree on it in one small
collective: each sends a fingerprint of what it derived and its place in each process group.

Equal fingerprints mean every rank derived the same plan, so the writer of every chunk
(:class:`~mfsdp_ckpt.format.catalog.Catalog`) is known everywhere and each rank writes exactly its
chunks. Different fingerprints fail every rank at once, naming the first parameter whose layout
differs and the ranks on each side (a second collective, on that failure only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.catalog import (
    Catalog,
    CatalogError,
    Mesh,
    PlacedBuffer,
    expert_groups,
    global_plan,
    plan_of_placed,
)
from mfsdp_ckpt.model.experts import experts_entry, merge_param_groups
from mfsdp_ckpt.sharded.state import ParamWrites, param_groups_state
from mfsdp_core import ModelPlan, ParamShard, plan_of
from mfsdp_core.collectives import gather_objects, rank_and_world
from mfsdp_core.expert_parallel import EDP_GROUP, EP_GROUP, ep_rank_of, expert_index
from mfsdp_core.fully_shard import units_of

__all__ = [
    "SaveLayout",
    "agree_on_layout",
    "derive",
    "expand_param_groups",
    "fingerprint",
    "mesh_position",
    "layout_views",
    "disagreement",
    "writes_of",
]


@dataclass(frozen=True)
class SaveLayout:
    """What every rank agreed on: the catalog (global plan and mesh; its keys come with the
    commit), the plan the manifest records, ``writer.experts`` (None without expert
    parallelism) and the optimizer's groups naming every rank's parameters (None: no optimizer)."""

    catalog: Catalog
    plan: ModelPlan
    experts: dict[str, Any] | None
    param_groups: list[dict[str, Any]] | None


def mesh_position(model: nn.Module) -> dict[str, tuple[int, int]]:
    """This rank's place in each process group the model's units name: (the lowest global rank
    of its instance, its rank there). A group of one rank (None) is an instance of its own."""
    rank, _ = rank_and_world()
    out: dict[str, tuple[int, int]] = {}
    for unit in units_of(model):
        for name, group in unit.groups.items():
            if name in out:
                continue
            if group is None:
                out[name] = (rank, 0)
            else:
                out[name] = (min(dist.get_process_group_ranks(group)), dist.get_rank(group))
    return out


def expand_param_groups(
    groups: list[dict[str, Any]], plan: ModelPlan, ep_rank: int, ep_size: int
) -> list[dict[str, Any]]:
    """The optimizer's groups naming every EP rank's experts where this rank names its own
    (each EP rank holds as many consecutive experts per template: checked by ``global_plan``)."""
    own = [n for s in plan.buffers if s.is_expert and s.placement.group == EDP_GROUP for n in s.fqns]
    held = expert_groups(own)
    per_rank = len(set(next(iter(held.values())))) if held else 0
    own_set = set(own)

    def names(fqn: str) -> list[str]:
        parsed = expert_index(fqn)
        if parsed is None or fqn not in own_set:
            return [fqn]
        t, e = parsed
        return [f"{t}{e - ep_rank * per_rank + p * per_rank}" for p in range(ep_size)]

    return merge_param_groups([[{**g, "params": [n for f in g["params"] for n in names(f)]} for g in groups]])


def _spec_view(pb: PlacedBuffer) -> dict[str, Any]:
    return {**pb.spec.to_dict(), "ep_rank": pb.ep_rank}


def layout_views(
    placed: Sequence[PlacedBuffer],
    world: int,
    include_grads: bool,
    groups: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """What the ranks must agree on, by name: one entry per parameter (its buffer's spec and its
    index there) and the save's options. Compared as a whole by fingerprint first, then entry by
    entry to name a difference."""
    out: dict[str, Any] = {"(world size)": world, "(include_grads)": include_grads}
    out["(optimizer groups)"] = _canonical(
        [{k: v for k, v in g.items()} for g in groups] if groups is not None else None
    )
    for pb in placed:
        spec = _spec_view(pb)
        for i, fqn in enumerate(pb.spec.fqns):
            out[fqn] = {**spec, "index": i}
    return out


def _canonical(value: Any) -> Any:
    """``value`` with tensors written out (hyper-parameters may be tensors), for JSON."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def fingerprint(views: dict[str, Any]) -> str:
    """A digest of :func:`layout_views` (order-sensitive: the plan's order is part of the layout)."""
    text = json.dumps(list(views.items()), separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0-2, 5``."""
    runs: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _first_difference(a: Any, b: Any) -> str:
    """The first field where two entries differ, ``field a vs b`` (a whole value otherwise)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return f"{k} {json.dumps(a.get(k), default=repr)} vs {json.dumps(b.get(k), default=repr)}"
    return f"{json.dumps(a, default=repr)[:80]} vs {json.dumps(b, default=repr)[:80]}"


def disagreement(per_rank: Sequence[dict[str, Any]]) -> str:
    """The one-line error when ranks derived different layouts: the first entry (in rank 0's
    order, then the others') whose value is not the same on every rank, with the ranks on each
    side."""
    names: dict[str, None] = {}
    for views in per_rank:
        names.update(dict.fromkeys(views))
    missing = object()
    for name in names:
        values = [views.get(name, missing) for views in per_rank]
        if all(v == values[0] for v in values):
            continue
        sides: list[tuple[Any, list[int]]] = []
        for r, v in enumerate(values):
            for side in sides:
                if side[0] == v:
                    side[1].append(r)
                    break
            else:
                sides.append((v, [r]))
        (a, ra), (b, rb) = sides[0], sides[1]
        what = "parameter" if not name.startswith("(") else "setting"
        if a is missing or b is missing:
            held = ra if b is missing else rb
            lacking = rb if b is missing else ra
            return (
                f"save: ranks disagree on the layout: {what} '{name}' is on {_ranks_text(held)} "
                f"but not on {_ranks_text(lacking)}"
            )
        return (
            f"save: ranks disagree on the layout of {what} '{name}': {_first_difference(a, b)} "
            f"({_ranks_text(ra)} vs {_ranks_text(rb)})"
        )
    return "save: ranks disagree on the layout (no single entry differs: the order of the buffers does)"


def derive(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    shards: Sequence[ParamShard],
    world: int,
    include_grads: bool,
) -> tuple[list[PlacedBuffer], dict[str, Any], str, list[dict[str, Any]] | None]:
    """What one rank derives alone: the global plan, what the ranks must agree on
    (:func:`layout_views`) and its fingerprint, and the optimizer's groups naming every rank's
    parameters. No communication (the planning simulator runs it for virtual ranks)."""
    plan = plan_of(model)
    ep_rank, ep_size = ep_rank_of(model)
    placed = global_plan(plan, ep_rank, ep_size)
    groups = param_groups_state(shards, optimizer) if optimizer is not None else None
    if groups is not None and ep_size > 1:
        groups = expand_param_groups(groups, plan, ep_rank, ep_size)
    views = layout_views(placed, world, include_grads, groups)
    return placed, views, fingerprint(views), groups


def agree_on_layout(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, shards: Sequence[ParamShard], *, include_grads: bool
) -> SaveLayout:
    """Derive the whole job's plan from this rank's and agree on it (collective over the default
    group: one all-gather of a digest and this rank's place in each group). Raises the same
    :class:`CheckpointError` on every rank when a rank cannot derive it or the ranks derived
    different ones (then naming the first parameter that differs and the ranks)."""
    rank, world = rank_and_world()
    plan = plan_of(model)
    ep_rank, ep_size = ep_rank_of(model)
    failure: CheckpointError | None = None
    digest, views, placed, groups = "", {}, [], None
    try:
        placed, views, digest, groups = derive(model, optimizer, shards, world, include_grads)
    except (CatalogError, CheckpointError) as e:
        failure = CheckpointError(f"save: rank {rank}: {e}")
    gathered = gather_objects((digest, mesh_position(model), failure))
    failed = next((f for _, _, f in gathered if f is not None), None)
    if failed is not None:
        raise failed
    if len({d for d, _, _ in gathered}) > 1:
        raise CheckpointError(disagreement(gather_objects(views)))
    try:
        mesh = Mesh.from_positions(world, [p for _, p, _ in gathered])
        catalog = Catalog(placed, mesh)
        for b in range(len(placed)):  # refusals (a group whose instances hold different values) before writing
            catalog.copies(b)
    except CatalogError as e:
        raise CheckpointError(f"save: {e}") from None
    experts = None
    if EP_GROUP in plan.group_sizes:  # which experts each EP rank held (by the names its ranks hold)
        experts = experts_entry(
            ep_size,
            [(p, [n for pb in placed if pb.ep_rank in (None, p) for n in pb.spec.fqns]) for p in range(ep_size)],
        )
    return SaveLayout(catalog, plan_of_placed(placed, plan.group_sizes), experts, groups)


def writes_of(catalog: Catalog, rank: int) -> Callable[[ParamShard], ParamWrites]:
    """What this rank writes of each of its parameters: its pieces it is the writer of, the
    parameter's objects when it writes them, its MX planes' pieces it is the writer of."""

    def writes(ps: ParamShard) -> ParamWrites:
        at = catalog.param(ps.fqn)
        if at is None:
            raise CheckpointError(f"save: parameter '{ps.fqn}' is not in the plan the ranks agreed on")
        b, i = at
        spec = ps.spec
        k = ps.group_rank
        shard_rank = k // spec.replicate_size if spec.shards_optim_across_replicas else k
        planes = {
            name
            for name, layout in spec.companion_layouts.items()
            if layout.piece(i, shard_rank).numel and catalog.writer(b, i, shard_rank, name) == rank
        }
        owned = spec.optim_layout.piece(i, k).numel > 0 and catalog.writer(b, i, k) == rank
        return ParamWrites(owned=owned, objects=catalog.object_writer(ps.fqn) == rank, planes=frozenset(planes))

    return writes

"""Sharded model + optimizer ⇄ the canonical state.

The canonical state is a flat dict: ``model.<fqn>`` weights in the model's dtype,
``optim.<fqn>.<state>`` for every per-parameter optimizer state the optimizer keeps (plus
``optim.<fqn>.main_param`` when the main params are in another dtype than the weights),
``optim.param_groups`` (hyper-parameters, parameters named, never indexed), ``grad.<fqn>`` when
asked, ``mx.<fqn>.<plane>`` for the four planes of an MXFP8 parameter, and ``extra.*`` (spellings: :mod:`mfsdp_ckpt.format.keys`). Sharded values are
:class:`FlatEntry`: one rank's contiguous flat range of the logical tensor, read from / written to
the runtime's storage through the shard description (``mfsdp_core.describe_shards``), which the
caller computes once per save or load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mfsdp_ckpt.format.boxes import Box, box_view, flat_range_to_boxes
from mfsdp_ckpt.format.keys import MAIN_PARAM, PARAM_GROUPS, grad_key, model_key, mx_key, optim_key
from mfsdp_core import ParamShard

__all__ = [
    "FlatEntry",
    "ParamWrites",
    "ParamTargets",
    "mx_planes",
    "save_entries",
    "load_targets",
    "param_groups_state",
    "param_group_updates",
]


@dataclass
class FlatEntry:
    """Elements ``[start, end)`` of the row-major flattening of a tensor of ``shape``, held in the
    1-D ``tensor``."""

    shape: torch.Size
    start: int
    end: int
    tensor: torch.Tensor

    def boxes(self) -> list[Box]:
        return flat_range_to_boxes(self.shape, self.start, self.end)

    def view(self, box: Box) -> torch.Tensor:
        return box_view(self.tensor, self.start, box)


def _owned_slice(ps: ParamShard, shard) -> torch.Tensor:
    """The owned range of a state that holds either the owned range or the whole parameter."""
    lo, hi = ps.owned
    if shard.start == lo and shard.end == hi:
        return shard.tensor
    return shard.tensor[lo - shard.start : hi - shard.start]


@dataclass(frozen=True)
class ParamWrites:
    """What one rank writes of one parameter: its owned range of the per-element state, the
    parameter's objects (optimizer scalars), and which of its MX planes' ranges."""

    owned: bool = True
    objects: bool = True
    planes: frozenset[str] | None = None  # None: every plane


def save_entries(
    shards: Sequence[ParamShard],
    optimizer: torch.optim.Optimizer | None,
    include_grads: bool,
    writes: Callable[[ParamShard], ParamWrites] | None = None,
) -> dict[str, Any]:
    """What this rank writes, from the shard description: the range it owns of each tensor, so
    replicated state (whole weights under ZeRO-1/2) is still written once, in parallel.
    ``writes`` says, per parameter, which of it this rank writes when other ranks hold the same
    ranges (replicas, no-shard): see :func:`mfsdp_ckpt.sharded.save_layout.writes_of`. Without it
    every rank gives everything it owns (and ``optim.param_groups``)."""
    out: dict[str, Any] = {}
    for ps in shards:
        lo, hi = ps.owned
        w = writes(ps) if writes is not None else ParamWrites()
        if w.owned:
            out[model_key(ps.fqn)] = FlatEntry(ps.shape, lo, hi, _owned_slice(ps, ps.param))
            if ps.main_dtype != ps.dtype:
                out[optim_key(ps.fqn, MAIN_PARAM)] = FlatEntry(ps.shape, lo, hi, ps.main.tensor)
            if optimizer is not None:
                for name, fs in ps.optim.items():
                    out[optim_key(ps.fqn, name)] = FlatEntry(ps.shape, lo, hi, fs.tensor)
            if include_grads and ps.grad is not None:
                out[grad_key(ps.fqn)] = FlatEntry(ps.shape, lo, hi, ps.grad.tensor)
        if optimizer is not None and w.objects:
            for name, value in ps.optim_extra.items():
                out[optim_key(ps.fqn, name)] = value
        for name, (shape, plane) in mx_planes(ps).items():
            if w.planes is None or name in w.planes:
                out[mx_key(ps.fqn, name)] = FlatEntry(shape, plane.start, plane.end, plane.tensor)
    if optimizer is not None and writes is None:
        out[PARAM_GROUPS] = param_groups_state(shards, optimizer)
    return out


def mx_planes(ps: ParamShard) -> dict[str, tuple[torch.Size, Any]]:
    """An MXFP8 parameter's planes on this rank: name -> (the plane's full shape, its owned range
    (a ``FlatShard``: whole 32-row blocks of the parameter)); empty for other parameters."""
    if ps.spec.placement.mx is None:
        return {}
    return {c.name: (c.shape(ps.shape), ps.companions[c.name]) for c in ps.spec.placement.companions}


@dataclass
class ParamTargets:
    """Where a load writes one parameter's state on this rank."""

    shard: ParamShard
    weights: torch.Tensor  # main params (frozen parameters: the compute weights), owned range
    optim: dict[str, torch.Tensor]  # per-element state: owned range
    optim_extra: dict[str, Any]  # scalar state (e.g. Adam's step), replaced whole
    grad: torch.Tensor | None
    optim_state: dict[str, Any] | None  # the optimizer's state dict for this parameter's shard


def load_targets(shards: Sequence[ParamShard], optimizer: torch.optim.Optimizer | None) -> list[ParamTargets]:
    out = []
    for ps in shards:
        with_optim = optimizer is not None
        state = optimizer.state.get(ps.optim_param) if with_optim and ps.optim_param is not None else None
        out.append(
            ParamTargets(
                shard=ps,
                weights=ps.main.tensor,
                optim={k: fs.tensor for k, fs in ps.optim.items()} if with_optim else {},
                optim_extra=dict(ps.optim_extra) if with_optim else {},
                grad=ps.grad.tensor if ps.grad is not None else None,
                optim_state=state,
            )
        )
    return out


def _fqn_by_optim_param(shards: Sequence[ParamShard]) -> dict[int, str]:
    return {id(ps.optim_param): ps.fqn for ps in shards if ps.optim_param is not None}


def param_groups_state(shards: Sequence[ParamShard], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Hyper-parameters of each group, with its parameters by canonical name."""
    names = _fqn_by_optim_param(shards)
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    return groups


def param_group_updates(
    shards: Sequence[ParamShard], optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], source: str
) -> list[dict[str, Any]]:
    """For each of the optimizer's groups, the hyper-parameters of the saved group holding its
    parameters (by name); :class:`StateMismatchError` when a group's parameters are in no saved
    group or in several. A group without parameters (all of them frozen, say) takes the saved
    group at its own index when that one is empty too, else keeps its own. Changes nothing."""
    from mfsdp_ckpt.errors import StateMismatchError

    names = _fqn_by_optim_param(shards)
    group_of = {fqn: i for i, g in enumerate(saved) for fqn in g["params"]}
    updates = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        if not fqns:
            same = saved[g] if g < len(saved) and not saved[g]["params"] else group
            updates.append({k: v for k, v in same.items() if k != "params"})
            continue
        found = {group_of.get(f) for f in fqns}
        if None in found or len(found) != 1:
            missing = [f for f in fqns if f not in group_of]
            raise StateMismatchError(
                f"{source}: optimizer param_groups[{g}] does not match a saved group"
                + (
                    f" (not in any saved group: {', '.join(missing)})"
                    if missing
                    else " (its parameters are split across saved groups)"
                )
            )
        updates.append({k: v for k, v in saved[found.pop()].items() if k != "params"})
    return updates

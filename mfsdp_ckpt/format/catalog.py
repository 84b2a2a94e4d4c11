"""Where every chunk of a saved checkpoint lives, derived from the placement plan and the mesh.

A layout is a pure function of (shapes, group sizes, placements), so the whole job's save plan
follows from three small things every rank can hold: the **global plan** (every flat buffer of
the model; under expert parallelism one buffer per EP rank's experts), the **mesh** (the global
ranks of every instance of every named process group) and the **keys** (each key's dtype, shape
and kind). From them :class:`Catalog` says, for any key, which rank wrote which flat range:

- a parameter's per-element state (``model.``, ``grad.``, ``optim.<fqn>.<state>``) is cut like
  the main params: the optimizer layout's piece ``k`` is held by the ranks whose optimizer rank
  is ``k`` (one rank under ZeRO / HFSDP, every replica under HSDP, every rank of the group under
  no-shard); when several hold it, one of them writes it (:meth:`Catalog.writer`: the least
  loaded so far, in plan order, so replicas share the writing);
- an MXFP8 plane (``mx.<fqn>.<plane>``) follows its companion layout, by shard rank;
- an object (a scalar such as Adam's ``step``, ``optim.param_groups``, ``extra.*``) is written
  whole by one rank, recorded with the key.

The save derives its own write items from it (no plan is gathered); the commit checks that what
every rank wrote is what the catalog gives; a reader derives any key's chunks from it (the index
in ``mfsdp.json`` holds only these three things and where the data files' record tables are).
Pure functions of plain data; no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from mfsdp_ckpt.errors import CatalogError
from mfsdp_ckpt.format.boxes import Box, flat_range_to_boxes
from mfsdp_ckpt.format.keys import mx_plane_of
from mfsdp_core.expert_layout import EDP_GROUP, EP_GROUP, expert_index

if TYPE_CHECKING:  # plans are passed in, built by their owners: the catalog imports no torch
    from mfsdp_core.layout import Layout
    from mfsdp_core.plan import BufferSpec, ModelPlan

__all__ = [
    "Mesh",
    "PlacedBuffer",
    "Catalog",
    "KeyInfo",
    "OWNED",
    "PLANE",
    "param_of_key",
    "global_plan",
    "expert_groups",
    "plan_of_placed",
    "replace_keys",
]

OWNED = "o"  # cut like the main params (the optimizer layout)
PLANE = "p"  # an MXFP8 plane, cut by its companion layout


@dataclass(frozen=True)
class Mesh:
    """The job's ranks: ``world`` and, per named process group, its instances, each the global
    ranks of one instance in group-rank order (a group of one rank: one instance per rank)."""

    world: int
    groups: Mapping[str, tuple[tuple[int, ...], ...]]

    @cached_property
    def _positions(self) -> dict[str, tuple[list[int], list[int]]]:
        out = {}
        for name, instances in self.groups.items():
            which, rank_in = [-1] * self.world, [-1] * self.world
            for n, ranks in enumerate(instances):
                for k, g in enumerate(ranks):
                    which[g], rank_in[g] = n, k
            out[name] = (which, rank_in)
        return out

    def group_rank(self, group: str, rank: int) -> int:
        """``rank``'s rank inside its instance of ``group``."""
        return self._positions[group][1][rank]

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "groups": {n: [list(r) for r in inst] for n, inst in sorted(self.groups.items())}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Mesh":
        return cls.checked(int(d["world"]), {n: [tuple(r) for r in inst] for n, inst in d["groups"].items()})

    @classmethod
    def checked(cls, world: int, groups: Mapping[str, Sequence[Sequence[int]]]) -> "Mesh":
        """A mesh whose every group's instances split the ranks ``0 … world-1`` (CatalogError
        naming the group otherwise)."""
        out = {}
        for name, instances in groups.items():
            seen = sorted(g for ranks in instances for g in ranks)
            if seen != list(range(world)):
                raise CatalogError(f"group '{name}': its instances do not split the {world} ranks")
            out[name] = tuple(tuple(int(g) for g in ranks) for ranks in instances)
        return cls(world, out)

    @classmethod
    def from_positions(cls, world: int, positions: Sequence[Mapping[str, tuple[int, int]]]) -> "Mesh":
        """The mesh from every rank's ``{group: (lowest global rank of its instance, rank in
        the group)}`` (what each rank can say about itself)."""
        groups: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for g, pos in enumerate(positions):
            for name, (first, k) in pos.items():
                groups.setdefault(name, {}).setdefault(first, []).append((k, g))
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, instances in groups.items():
            rows = []
            for first in sorted(instances):
                members = sorted(instances[first])
                if [k for k, _ in members] != list(range(len(members))):
                    raise CatalogError(f"group '{name}': the ranks of its instance of rank {first} are not 0…n-1")
                rows.append(tuple(g for _, g in members))
            out[name] = rows
        return cls.checked(world, out)


@dataclass(frozen=True)
class PlacedBuffer:
    """One buffer of the global plan and who holds it: every rank (``ep_rank`` None) or, for an
    expert buffer under expert parallelism, the ranks of EP rank ``ep_rank``."""

    spec: BufferSpec
    ep_rank: int | None = None


@dataclass(frozen=True)
class KeyInfo:
    """One key of the checkpoint: its dtype (None: a serialized object), its shape (None for an
    object) and where it is: :data:`OWNED`, :data:`PLANE`, or the rank that wrote it whole."""

    dtype: str | None
    shape: tuple[int, ...] | None
    where: str | int

    def to_list(self) -> list[Any]:
        return [self.dtype, list(self.shape) if self.shape is not None else None, self.where]

    @classmethod
    def from_list(cls, v: Sequence[Any]) -> "KeyInfo":
        return cls(v[0], tuple(v[1]) if v[1] is not None else None, v[2])


def param_of_key(key: str) -> str | None:
    """The parameter a per-element key belongs to (``model.<p>``, ``grad.<p>``,
    ``optim.<p>.<state>``, ``mx.<p>.<plane>``), None for others. No key check: see the caller."""
    if key.startswith(("model.", "grad.")):
        return key.split(".", 1)[1]
    if key.startswith("optim.") and key.count(".") >= 2:
        return key[len("optim.") :].rsplit(".", 1)[0]
    plane = mx_plane_of(key)
    return plane[0] if plane is not None else None


class Catalog:
    """The chunks of every key of a checkpoint (see the module docstring). Built once per save
    or read; everything is computed on first use, per buffer."""

    def __init__(self, placed: Sequence[PlacedBuffer], mesh: Mesh, keys: Mapping[str, KeyInfo] | None = None) -> None:
        self.placed = tuple(placed)
        self.mesh = mesh
        self.keys: dict[str, KeyInfo] = dict(keys or {})
        self._param: dict[str, tuple[int, int]] = {}
        for b, pb in enumerate(self.placed):
            for i, fqn in enumerate(pb.spec.fqns):
                if fqn in self._param:
                    raise CatalogError(f"parameter '{fqn}' is in two buffers of the plan")
                self._param[fqn] = (b, i)
        self._holders: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self._writers: list[dict[tuple[str, int, int], int]] | None = None

    # ---- who holds what --------------------------------------------------------------------
    def param(self, fqn: str) -> tuple[int, int] | None:
        """(buffer, index there) of a parameter of the plan, or None."""
        return self._param.get(fqn)

    def holders(self, b: int) -> tuple[int, ...]:
        """The global ranks holding buffer ``b``."""
        pb = self.placed[b]
        if pb.ep_rank is None:
            return tuple(range(self.mesh.world))
        return tuple(g for g in range(self.mesh.world) if self.mesh.group_rank(EP_GROUP, g) == pb.ep_rank)

    def copies(self, b: int, plane: bool = False) -> tuple[tuple[int, ...], ...]:
        """For buffer ``b``: for each rank ``k`` of its optimizer layout (``plane``: of its
        parameter layout, which its companion planes follow), the global ranks holding piece
        ``k`` (several: replicas, or every rank under no-shard)."""
        spec = self.placed[b].spec
        p = spec.placement
        across = spec.shards_optim_across_replicas and not plane
        key = (p.group, p.replicate, spec.strategy.shards_optim, across, spec.replicate_size, self.placed[b].ep_rank)
        if key in self._holders:
            return self._holders[key]
        holders = self.holders(b)
        if len(holders) != spec.group_size * spec.replicate_size:
            raise CatalogError(
                f"'{spec.fqns[0] if spec.fqns else spec.prefix}' is placed over group '{p.group}' "
                f"({spec.group_size} of {len(holders)} ranks), whose instances are different parameters under the "
                "same names; a canonical checkpoint cannot hold them (give them distinct names)"
            )
        n = (spec.optim_layout if not plane else spec.layout).group_size
        out: list[list[int]] = [[] for _ in range(n)]
        for g in holders:
            s = self._rank_in(p.group, g) if spec.strategy.shards_optim else 0
            k = s * spec.replicate_size + self._rank_in(p.replicate, g) if across else s
            if not 0 <= k < n:
                raise CatalogError(f"rank {g} is rank {k} of buffer '{spec.prefix}', which has {n}")
            out[k].append(g)
        if any(not ranks for ranks in out):
            raise CatalogError(f"a shard of buffer '{spec.prefix or spec.fqns[0]}' is held by no rank")
        self._holders[key] = result = tuple(tuple(r) for r in out)
        return result

    def _rank_in(self, group: str | None, g: int) -> int:
        if group is None:
            return 0
        if group not in self.mesh.groups:
            raise CatalogError(f"the plan names group '{group}', which the mesh does not hold")
        return self.mesh.group_rank(group, g)

    def _assign(self) -> list[dict[tuple[str, int, int], int]]:
        """Per buffer: (layout kind, param, piece rank) -> the rank that writes it, for the
        pieces more than one rank holds; each goes to the holder written least so far (ties:
        the lowest rank), in plan order."""
        if self._writers is not None:
            return self._writers
        loads: dict[int, int] = {}
        out: list[dict[tuple[str, int, int], int]] = []
        for b in range(len(self.placed)):
            chosen: dict[tuple[str, int, int], int] = {}
            for kind, layout, copies in self._layouts(b):
                if all(len(c) == 1 for c in copies):
                    continue
                for i in range(len(layout.shapes)):
                    pieces = layout.owners(i) or [layout.piece(i, 0)]
                    for pc in pieces:
                        ranks = copies[pc.rank]
                        if len(ranks) == 1:
                            continue
                        w = min(ranks, key=lambda r: (loads.get(r, 0), r))
                        loads[w] = loads.get(w, 0) + pc.numel
                        chosen[(kind, i, pc.rank)] = w
            out.append(chosen)
        self._writers = out
        return out

    def _layouts(self, b: int) -> list[tuple[str, Layout, tuple[tuple[int, ...], ...]]]:
        spec = self.placed[b].spec
        out = [(OWNED, spec.optim_layout, self.copies(b))]
        for name, layout in spec.companion_layouts.items():
            out.append((f"{PLANE}:{name}", layout, self.copies(b, plane=True)))
        return out

    def writer(self, b: int, i: int, k: int, plane: str | None = None) -> int:
        """The rank that writes piece ``k`` of parameter ``i`` of buffer ``b`` (``plane``: of
        that companion plane)."""
        kind = OWNED if plane is None else f"{PLANE}:{plane}"
        copies = self.copies(b, plane=plane is not None)[k]
        if len(copies) == 1:
            return copies[0]
        return self._assign()[b][(kind, i, k)]

    def object_writer(self, fqn: str) -> int:
        """The rank that writes a parameter's objects (its optimizer scalars): the writer of its
        first non-empty piece (piece 0 for an empty parameter)."""
        b, i = self._param[fqn]
        first = self.placed[b].spec.optim_layout.first_owner(i)
        return self.writer(b, i, first.rank if first is not None else 0)

    # ---- what a rank writes --------------------------------------------------------------
    def locate(self, key: str) -> tuple[int, int, Layout, str | None]:
        """(buffer, parameter index, layout, companion plane or None) of a per-element key,
        checked against the plan: its parameter exists, its plane too, and its shape has as many
        elements as its layout gives the parameter (:class:`CatalogError` otherwise)."""
        info = self.keys[key]
        fqn = param_of_key(key)
        at = self._param.get(fqn) if fqn is not None else None
        if at is None:
            raise CatalogError(f"key '{key}': no parameter of the plan holds it")
        b, i = at
        spec = self.placed[b].spec
        plane = None
        if info.where == PLANE:
            parsed = mx_plane_of(key)
            plane = parsed[1] if parsed is not None else None
            if plane not in spec.companion_layouts:
                raise CatalogError(f"key '{key}': parameter '{fqn}' has no plane '{plane}'")
            layout = spec.companion_layouts[plane]
        else:
            layout = spec.optim_layout
        numel = math.prod(info.shape or ())
        if numel != layout.numels[i]:
            raise CatalogError(
                f"key '{key}': shape {list(info.shape or ())} does not fit its layout ({layout.numels[i]} elements)"
            )
        return b, i, layout, plane

    def pieces(self, key: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(writing rank, flat start, flat end) of every non-empty piece of a per-element key,
        in flat order; with ``lo``/``hi``, only the pieces overlapping elements ``[lo, hi)``."""
        b, i, layout, plane = self.locate(key)
        return [(self.writer(b, i, pc.rank, plane), pc.start, pc.end) for pc in layout.owners(i, lo, hi)]

    def chunks(self, key: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, Box]]:
        """(writing rank, box) of every chunk of ``key``: the boxes of each piece (objects and
        scalar tensors: one chunk, the whole value); with ``lo``/``hi``, only the chunks
        overlapping elements ``[lo, hi)`` (each box is a run of consecutive elements)."""
        info = self.keys[key]
        if isinstance(info.where, int):
            shape = info.shape or ()
            return [(info.where, Box(tuple(0 for _ in shape), tuple(shape), 0))]
        shape = info.shape or ()
        end = math.prod(shape) if hi is None else hi
        return [
            (r, box)
            for r, a, b in self.pieces(key, lo, hi)
            for box in flat_range_to_boxes(shape, a, b)
            if box.flat_start < end and box.flat_start + box.numel > lo
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh.to_dict(),
            "ep_ranks": [pb.ep_rank for pb in self.placed],
            "keys": {k: v.to_list() for k, v in sorted(self.keys.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], plan: ModelPlan) -> "Catalog":
        ep = list(d["ep_ranks"])
        if len(ep) != len(plan.buffers):
            raise CatalogError(f"ep_ranks lists {len(ep)} buffers, the plan has {len(plan.buffers)}")
        placed = [PlacedBuffer(spec, r) for spec, r in zip(plan.buffers, ep)]
        keys = {k: KeyInfo.from_list(v) for k, v in d["keys"].items()}
        return cls(placed, Mesh.from_dict(d["mesh"]), keys)


# ---- the global plan from one rank's ---------------------------------------------------------


def expert_groups(names: Iterable[str]) -> dict[str, list[int]]:
    """Global expert indices per template among ``names`` (``…experts.w`` -> [4, 5])."""
    out: dict[str, list[int]] = {}
    for name in names:
        parsed = expert_index(name)
        if parsed is not None:
            out.setdefault(parsed[0], []).append(parsed[1])
    return out


def _is_ep_buffer(spec: BufferSpec, ep_size: int) -> bool:
    return ep_size > 1 and spec.is_expert and spec.placement.group == EDP_GROUP


def global_plan(plan: ModelPlan, ep_rank: int, ep_size: int) -> list[PlacedBuffer]:
    """The whole job's buffers from one rank's plan: under expert parallelism (EP size > 1) each
    expert buffer of this rank stands for one buffer per EP rank ``p``, its experts renamed to
    ``p``'s global indices (each EP rank holds ``N / E`` consecutive experts); the order is the
    one gathering every rank's plan gives (per unit: this rank's buffers with its experts as EP
    rank 0's, then the other EP ranks' expert buffers in EP-rank order). CatalogError when this
    rank's experts are not the consecutive block its EP rank holds."""
    if ep_size <= 1 or not any(_is_ep_buffer(s, ep_size) for s in plan.buffers):
        return [PlacedBuffer(s) for s in plan.buffers]
    held = expert_groups(n for s in plan.buffers if _is_ep_buffer(s, ep_size) for n in s.fqns)
    counts = {len(set(v)) for v in held.values()}
    if len(counts) != 1:
        raise CatalogError("the expert templates of this rank hold different numbers of experts")
    n = counts.pop()
    mine = range(ep_rank * n, (ep_rank + 1) * n)
    for template, indices in held.items():
        if sorted(set(indices)) != list(mine):
            raise CatalogError(
                f"EP rank {ep_rank} holds experts {sorted(set(indices))} of '{template}{{e}}', not {mine.start}…{mine.stop - 1}"
            )

    def moved(spec: BufferSpec, p: int) -> BufferSpec:
        def rename(fqn: str) -> str:
            parsed = expert_index(fqn)
            if parsed is None:
                raise CatalogError(f"'{fqn}' is in an expert buffer but is not named by a global expert index")
            return f"{parsed[0]}{parsed[1] - ep_rank * n + p * n}"

        return spec.renamed(rename) if p != ep_rank else spec

    units: dict[str, list[PlacedBuffer]] = {}
    later: dict[str, list[PlacedBuffer]] = {}
    for spec in plan.buffers:
        unit = units.setdefault(spec.prefix, [])
        if _is_ep_buffer(spec, ep_size):
            unit.append(PlacedBuffer(moved(spec, 0), 0))
            later.setdefault(spec.prefix, []).extend(PlacedBuffer(moved(spec, p), p) for p in range(1, ep_size))
        else:
            unit.append(PlacedBuffer(spec))
    out: list[PlacedBuffer] = []
    for prefix, bufs in units.items():
        out.extend(bufs)
        out.extend(sorted(later.get(prefix, []), key=lambda pb: pb.ep_rank or 0))
    return out


def plan_of_placed(placed: Sequence[PlacedBuffer], group_sizes: Mapping[str, int]) -> ModelPlan:
    """The :class:`ModelPlan` (what the manifest records) of the global plan."""
    from mfsdp_core.plan import ModelPlan

    return ModelPlan(dict(group_sizes), tuple(pb.spec for pb in placed))


def replace_keys(catalog: Catalog, keys: Mapping[str, KeyInfo]) -> Catalog:
    """``catalog`` with another key table (the layouts carry over)."""
    out = Catalog.__new__(Catalog)
    out.__dict__.update(catalog.__dict__)
    out.keys = dict(keys)
    return out

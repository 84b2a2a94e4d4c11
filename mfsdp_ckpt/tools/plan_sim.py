"""The save planner for W virtual ranks in one process: what every rank of a job would plan,
without the job.

Each virtual rank builds its model on the ``meta`` device (no memory, no data) inside PyTorch's
fake process group (``rank r of W``; collectives do nothing), shards it with the real
``fully_shard`` and the real process-group layout (EP, HSDP), and then runs exactly what a save
runs on that rank: the global plan it derives, the fingerprint it would send, its place in the
mesh, and its local write plan through :class:`~mfsdp_ckpt.sharded.planner.MfsdpSavePlanner`.
From all ranks together the simulation gives both sides of the comparison the tests and
``bench/plan_scale.py`` make:

- **DCP's way**: every rank's full local plan gathered and deduplicated by DCP's own
  ``create_global_plan`` (what ``dcp.save`` does on its coordinator);
- **ours**: the catalog every rank derives alone (:mod:`mfsdp_ckpt.format.catalog`), the chunks
  it gives each rank, and the metadata and index the coordinator commits.

The ranks' RNG states and ``extra`` entries are left out: they are objects of one rank each,
the same in both.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.catalog import Catalog, Mesh, PlacedBuffer
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.format.names import dcp_data_file
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.sharded.save_layout import derive, disagreement, mesh_position, writes_of
from mfsdp_ckpt.sharded.state import save_entries
from mfsdp_ckpt.write.save_index import RankWrites, build_index, declared_keys
from mfsdp_core import ParamShard, describe_shards

__all__ = ["VirtualRank", "Simulation", "simulate", "fake_rank", "prime_adamw_state", "same_plan_as_dcp"]

Build = Callable[[int], tuple[nn.Module, "torch.optim.Optimizer | None"]]


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """Inside: this process is rank ``rank`` of ``world`` in PyTorch's fake process group
    (groups can be made; collectives do nothing). Not inside a real process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planning simulator runs outside a process group")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def prime_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """The state AdamW keeps once it has stepped (``step``, ``exp_avg``, ``exp_avg_sq``), for every
    parameter, without stepping: a meta-device optimizer holds what a trained one would."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


@dataclass
class VirtualRank:
    """What one rank of the simulated job derived and holds."""

    rank: int
    placed: list[PlacedBuffer]
    views: dict[str, Any]
    digest: str
    position: dict[str, tuple[int, int]]
    shards: list[ParamShard]
    optimizer: torch.optim.Optimizer | None
    groups: list[dict[str, Any]] | None
    planning_s: float = 0.0  # deriving the global plan and fingerprint


@dataclass
class Simulation:
    """Every virtual rank of one job (see the module docstring)."""

    world: int
    ranks: list[VirtualRank]
    include_grads: bool = False
    _catalog: Catalog | None = field(default=None, repr=False)

    def agree(self) -> None:
        """What the save's agreement does: CheckpointError naming the first difference unless
        every rank derived the same layout."""
        if len({vr.digest for vr in self.ranks}) > 1:
            raise CheckpointError(disagreement([vr.views for vr in self.ranks]))

    def catalog(self) -> Catalog:
        """The catalog every rank builds after agreeing (global plan and mesh; no keys)."""
        if self._catalog is None:
            self.agree()
            mesh = Mesh.from_positions(self.world, [vr.position for vr in self.ranks])
            self._catalog = Catalog(self.ranks[0].placed, mesh)
        return self._catalog

    def local_plan(self, rank: int, derived: bool = True) -> SavePlan:
        """Rank ``rank``'s write plan: with ``derived``, what it writes in our save (its chunks
        of the catalog); without, everything it holds (what ``dcp.save`` would be handed, with
        ``optim.param_groups`` on every rank, deduplicated by DCP)."""
        vr = self.ranks[rank]
        writes = writes_of(self.catalog(), rank) if derived else None
        entries = save_entries(vr.shards, vr.optimizer, self.include_grads, writes)
        if vr.groups is not None and (not derived or rank == 0):
            entries[PARAM_GROUPS] = vr.groups
        planner = MfsdpSavePlanner()
        planner.set_up_planner(entries, storage_meta=None, is_coordinator=rank == 0)
        return planner.create_local_plan()

    def dcp_global(self, plans: Sequence[SavePlan] | None = None) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan and metadata from every rank's full local plan."""
        plans = list(plans) if plans is not None else [self.local_plan(r, derived=False) for r in range(self.world)]
        return MfsdpSavePlanner().create_global_plan(plans)

    def commit(self, plans: Sequence[SavePlan] | None = None) -> tuple[Metadata, dict[str, Any]]:
        """What our coordinator commits from every rank's derived plan: the metadata and the
        index (the same checks as a real save: every rank wrote exactly its chunks)."""
        plans = list(plans) if plans is not None else [self.local_plan(r) for r in range(self.world)]
        per_rank = []
        for r, plan in enumerate(plans):
            results = [
                WriteResult(index=i.index, size_in_bytes=0, storage_data=_StorageInfo(dcp_data_file(r), 0, 0))
                for i in plan.items
            ]
            per_rank.append(RankWrites(results, declared_keys(plan), []))
        metadata, _, index = build_index(self.catalog(), per_rank)
        return metadata, index


def simulate(
    world: int,
    build: Build,
    *,
    include_grads: bool = False,
    diverge: Callable[[int, nn.Module], None] | None = None,
) -> Simulation:
    """Build every rank of a ``world``-rank job with ``build(rank)`` (called inside
    :func:`fake_rank`: it builds the model on ``meta``, makes the job's process groups, shards
    it and returns it with its optimizer or None), and derive what each would save.
    ``diverge(rank, model)``: a hook run after building, to make one rank differ (tests)."""
    ranks = []
    for r in range(world):
        with fake_rank(r, world):
            model, optimizer = build(r)
            if diverge is not None:
                diverge(r, model)
            shards = describe_shards(model, optimizer)
            start = time.perf_counter()
            placed, views, digest, groups = derive(model, optimizer, shards, world, include_grads)
            took = time.perf_counter() - start
            ranks.append(VirtualRank(r, placed, views, digest, mesh_position(model), shards, optimizer, groups, took))
    return Simulation(world, ranks, include_grads)


def same_plan_as_dcp(sim: Simulation) -> list[str]:
    """Where our derived save differs from DCP's gathered one (empty: nowhere): the metadata's
    keys, dtypes, shapes and chunk sets, and every chunk each rank writes being one that rank
    holds (in its full local plan)."""
    full = [sim.local_plan(r, derived=False) for r in range(sim.world)]
    ours = [sim.local_plan(r) for r in range(sim.world)]
    _, theirs = sim.dcp_global(full)
    metadata, _ = sim.commit(ours)
    problems = []
    a, b = metadata.state_dict_metadata, theirs.state_dict_metadata
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            problems.append(f"{key}: only in {'ours' if key in a else 'DCP'}")
            continue
        if _entry(a[key]) != _entry(b[key]):
            problems.append(f"{key}: {_entry(a[key])} vs DCP {_entry(b[key])}")
    held = [{(i.index.fqn, tuple(i.index.offset or ())) for i in p.items} for p in full]
    for r, plan in enumerate(ours):
        for item in plan.items:
            if (item.index.fqn, tuple(item.index.offset or ())) not in held[r]:
                problems.append(
                    f"rank {r} writes {item.index.fqn} at {list(item.index.offset or ())}, which it does not hold"
                )
    return problems


def _entry(md: Any) -> Any:
    chunks = getattr(md, "chunks", None)
    if chunks is None:
        return "object"
    return (md.properties.dtype, tuple(md.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks))

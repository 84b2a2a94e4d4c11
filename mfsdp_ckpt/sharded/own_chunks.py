"""One rank's part of writing a checkpoint: its plan and its data files (shared by a save, its base
and the memory tier's snapshots)."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_ckpt.write.save_index import RankWrites, declared_keys

__all__ = ["write_own_chunks"]


def write_own_chunks(
    writer: CommittingWriter, entries: dict[str, Any], planner: MfsdpSavePlanner, rank: int
) -> RankWrites:
    """This rank's part of a save: its plan and its data files, written by ``writer``."""
    planner.set_up_planner(entries, storage_meta=None, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    writer.set_rank(rank)
    plan = writer.prepare_local_plan(plan)
    results = writer.write_data(plan, planner).wait()
    return RankWrites(results, declared_keys(plan), list(writer.files))

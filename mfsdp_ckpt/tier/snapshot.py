"""``snapshot`` / ``async_snapshot``: a checkpoint of the training state in every node's memory
tier, with peer replicas.

Collective. The state is staged and written as :func:`mfsdp_ckpt.async_save` does (host copy,
then a background thread on the checkpoint traffic's own process group); ``snapshot`` waits for
the result. The same entries and manifest as ``save``
(:func:`~mfsdp_ckpt.sharded.save.save_contents`) and the same writer (records, crc32c per chunk),
so a node's step directory is a regular checkpoint once it holds every data file. In order, each
phase agreed on by every rank before the next (a failure anywhere: every rank raises the same
one-line error and each node's staging directory is removed; what was committed stays):

1. each node's leader opens ``step_<n>.partial`` in its node's directory (a leftover of the same
   step removed);
2. every rank writes its data files into its node's staging directory and computes their crc32c;
3. rank 0 gathers what every rank wrote, builds ``.metadata`` and ``mfsdp.json`` (the index
   checked against the plan, as a save's commit does) and sends their bytes, with the list of
   every file's size and crc32c, to every node's leader;
4. each node's files are sent to the leaders of its ``replicas`` peer nodes, checked on arrival;
5. each leader writes the shared files and ``tier.json``, renames the staging directory to
   ``step_<n>`` and removes all but the newest ``keep`` snapshots of its node.

Nothing is written through a link (:mod:`mfsdp_ckpt.tier.entries`): the run's and the node's
directories must be real directories of the tier (a link there fails the snapshot in one line,
naming it), files are created new, and the pruning removes real directories only, keeping the
newest ``keep`` whose records say the step their name says (:func:`prune_node`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.format.manifest import indexed
from mfsdp_ckpt.sharded.async_save import AsyncSaveHandle, async_write
from mfsdp_ckpt.sharded.own_chunks import write_own_chunks
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.sharded.save import SaveContents, save_contents
from mfsdp_ckpt.tier.entries import DIRECTORY, dir_problem, ensure_dir, kind_of, remove_dir, write_new
from mfsdp_ckpt.tier.files import Transfer, file_crc32c, move_files, target_dirs
from mfsdp_ckpt.tier.layout import (
    SHARED_FILES,
    TIER_INDEX_NAME,
    MemoryTier,
    TierFile,
    recorded_step_problem,
    tier_index,
    tier_steps,
)
from mfsdp_ckpt.tier.promote import promote
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_ckpt.write.manifest import write_manifest
from mfsdp_ckpt.write.save_index import build_index
from mfsdp_core.collectives import rank_and_world

__all__ = ["async_snapshot", "prune_node", "snapshot", "write_snapshot"]


def snapshot(
    tier: MemoryTier,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    model_source: dict[str, Any] | None = None,
    run_config: dict[str, Any] | None = None,
) -> str:
    """Snapshot ``model`` (and ``optimizer``) at ``step`` into ``tier`` (see the module docstring)
    and wait for it: :func:`async_snapshot`'s result. Returns this node's step directory.
    Arguments as :func:`mfsdp_ckpt.save`'s."""
    recorded = {"extra": extra, "model_config": model_config, "model_source": model_source, "run_config": run_config}
    return async_snapshot(tier, step, model, optimizer, **recorded).result()


def async_snapshot(
    tier: MemoryTier,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    model_source: dict[str, Any] | None = None,
    run_config: dict[str, Any] | None = None,
    promote_to: str | None = None,
    keep: int | None = None,
) -> AsyncSaveHandle:
    """:func:`snapshot`, in the background as :func:`mfsdp_ckpt.async_save` saves: the state
    copied to host memory while training goes on (the optimizer step waits for the copy), then
    written, replicated and committed on the checkpoint traffic's own process group. Returns
    its handle (``result()``: this node's step directory, or the one-line error of every rank).
    At most one asynchronous save or snapshot is in flight: this one first waits for the last.

    ``promote_to``: once committed, the snapshot is also copied to this durable checkpoint
    (:func:`mfsdp_ckpt.tier.promote.promote`, with ``keep``), in the same background work: a
    durable save of the step without writing the state a second time."""
    contents = save_contents(
        model,
        optimizer,
        extra=extra,
        include_grads=False,
        model_config=model_config,
        step=step,
        run_config=run_config,
        model_source=model_source,
    )

    def write(entries: dict[str, Any], planner: MfsdpSavePlanner, group: dist.ProcessGroup | None) -> None:
        job = Job.current(group, same_error=True)
        write_snapshot(tier, step, contents, entries, planner, job)
        if promote_to is not None:
            promote(tier, step, promote_to, keep=keep, job=job)

    rank = rank_and_world()[0]
    return async_write(tier.step_dir(tier.node_of(rank), step), contents.entries, model, write)


def write_snapshot(
    tier: MemoryTier, step: int, contents: SaveContents, entries: dict[str, Any], planner: MfsdpSavePlanner, job: Job
) -> str:
    """The phases of the module docstring over ``job``'s ranks: ``entries`` (``contents``' own,
    or a staged copy of them) written with ``planner``; this node's step directory."""
    rank, world = job.rank, job.world
    node, nodes = tier.node_of(rank), tier.nodes(world)
    leader = rank == tier.leader(node)
    final = tier.step_dir(node, step)
    staging = final + ".partial"
    what = f"memory tier step {step}: not snapshotted"
    committed = False
    try:
        job.run(what, _open_staging if leader else _nothing, tier, staging)
        writer = CommittingWriter(destination_for(final), staging, contents.manifest, sync_files=False)
        part = job.run(what, _write_part, writer, entries, planner, rank)
        gathered = job.gather_to_main(part)
        shared, per_rank = job.on_main(what, _shared_files, writer, contents, gathered)
        files: dict[str, TierFile] = {
            name: TierFile(size, crc, tier.node_of(r)) for r, own in enumerate(per_rank) for name, size, crc in own
        }
        files.update({name: TierFile(len(data), crc32c(data)) for name, data in shared})
        replication = _replication(tier, files, step, nodes)
        job.run(what, target_dirs, replication, rank)
        job.run(what, move_files, replication, files, rank, job.group)
        job.run(what, _commit if leader else _nothing, tier, node, step, staging, shared, files, nodes)
        committed = True
        return final
    finally:
        if not committed and leader and dir_problem(tier.node_dir(node)) is None:
            remove_dir(staging)


def _nothing(*_: Any) -> None:
    """A rank's share of a phase that only the node leaders act in (it still agrees on the outcome)."""


def _open_staging(tier: MemoryTier, staging: str) -> None:
    """A leader: its node's staging directory, new (a leftover of an earlier try at this step
    removed; the run's and node's directories real directories of the tier, else one line)."""
    ensure_dir(os.path.dirname(staging), tier.root)
    if kind_of(staging) == DIRECTORY:
        remove_dir(staging)  # a leftover of an earlier try at this step
    elif kind_of(staging) is not None:
        os.unlink(staging)  # a file or a link under the staging name: removed as itself, never followed
    os.mkdir(staging)


def _write_part(
    writer: CommittingWriter, entries: dict[str, Any], planner: MfsdpSavePlanner, rank: int
) -> tuple[Any, list[tuple[str, int, int]]]:
    """This rank's data files, and ``(name, size, crc32c)`` of each as it lies in the tier."""
    written = write_own_chunks(writer, entries, planner, rank)
    return written, [(f.name, *file_crc32c(os.path.join(writer.tmp_dir, f.name))) for f in written.files]


def _shared_files(
    writer: CommittingWriter, contents: SaveContents, gathered: list[Any]
) -> tuple[list[tuple[str, bytes]], list[list[tuple[str, int, int]]]]:
    """Rank 0: ``.metadata`` and ``mfsdp.json`` (written into its staging directory, as a save's
    commit writes them, and read back), and every rank's ``(name, size, crc32c)`` files."""
    metadata, results, index = build_index(contents.catalog, [written for written, _ in gathered])
    writer.finish(metadata, [results])
    total = sum(wr.storage_data.length for wr in results)
    write_manifest(writer.tmp_dir, indexed(contents.manifest, writer.save_id, index, total), sync=False)
    shared = [(name, _read(os.path.join(writer.tmp_dir, name))) for name in SHARED_FILES]
    return shared, [own for _, own in gathered]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:  # rank 0's own staging directory, just written
        return f.read()


def _replication(tier: MemoryTier, files: dict[str, TierFile], step: int, nodes: int) -> list[Transfer]:
    """Every node's data files to the leaders of the peers that keep its replica (staging to staging)."""
    out = []
    for name, f in sorted(files.items()):
        if f.node is None:
            continue
        for peer in tier.replica_holders(f.node, nodes):
            out.append(
                Transfer(
                    name,
                    tier.leader(f.node),
                    tier.leader(peer),
                    tier.step_dir(f.node, step) + ".partial",
                    tier.step_dir(peer, step) + ".partial",
                )
            )
    return out


def _commit(
    tier: MemoryTier,
    node: int,
    step: int,
    staging: str,
    shared: list[tuple[str, bytes]],
    files: dict[str, TierFile],
    nodes: int,
) -> None:
    """A node leader: the shared files and ``tier.json`` into the staging directory, the rename
    (replacing a snapshot of the same step: a step redone after a restart), then the pruning
    (:func:`prune_node`)."""
    for name, data in shared:
        path = os.path.join(staging, name)
        if kind_of(path) is None:  # rank 0 wrote its own already
            write_new(path, data)
    write_new(os.path.join(staging, TIER_INDEX_NAME), json.dumps(tier_index(step, nodes, files)).encode())
    final = tier.step_dir(node, step)
    kind = kind_of(final)
    if kind == DIRECTORY:
        remove_dir(final)
    elif kind is not None:
        raise CheckpointError(dir_problem(final) or f"{final}: not a directory")
    os.rename(staging, final)
    prune_node(tier.node_dir(node), tier.keep, step)


def prune_node(node_dir: str, keep: int, current: int) -> None:
    """Keep the newest ``keep`` snapshots of a node (``current``, just committed, among them)
    whose ``tier.json`` and manifest record the step their name says; remove the older ones,
    those whose records name another step (never used: kept, one renamed to a high step would
    stay forever), and what killed snapshots left (``step_<n>.partial``: one snapshot is in
    flight at a time, so any other is a leftover). Real directories only: a link (or a file)
    under such a name is left as it is and never followed."""
    kept = 0
    for step in reversed(tier_steps(node_dir)):
        path = os.path.join(node_dir, f"step_{step:06d}")
        if kept < keep and (step == current or recorded_step_problem(path, step) is None):
            kept += 1
            continue
        remove_dir(path)
    for name in os.listdir(node_dir):
        if name.startswith("step_") and name.endswith(".partial"):
            remove_dir(os.path.join(node_dir, name))

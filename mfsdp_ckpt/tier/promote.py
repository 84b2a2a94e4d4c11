"""``promote``: a durable checkpoint (a local directory or an object-store prefix) made from a
committed memory-tier snapshot, by copying its files rather than writing the state again.

A snapshot's node directory holds exactly the files a ``save`` of that step writes (the same
data files, ``.metadata`` and ``mfsdp.json``), so the durable checkpoint is those bytes, moved
through the one write path: rank 0 opens the destination (its lock, refusals and staging
place), every rank copies the data files it wrote itself from its node's tier directory, rank 0
copies ``.metadata`` and commits with ``mfsdp.json`` last, then ``latest`` moves and old
checkpoints are pruned, as after a save. Collective. The snapshot's files are read only as
regular files themselves (never through a link planted in the tier).
"""

from __future__ import annotations

import os
import shutil

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, dcp_data_file_rank
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.tier.entries import FILE, dir_problem, kind_of, open_regular_nofollow
from mfsdp_ckpt.tier.layout import MemoryTier
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.destination import Destination, destination_for
from mfsdp_ckpt.write.job import write_and_commit
from mfsdp_ckpt.write.run_dir import after_commit

__all__ = ["promote"]

_PIECE = 8 << 20  # bytes copied at a time


def promote(
    tier: MemoryTier,
    step: int,
    path: str | os.PathLike,
    *,
    keep: int | None = None,
    update_latest: bool = True,
    job: Job | None = None,
) -> str:
    """Copy the snapshot of ``step`` (committed in every node's tier) to the checkpoint ``path``,
    replacing one there; ``keep`` and ``update_latest`` as for :func:`mfsdp_ckpt.save`. Over
    ``job``'s ranks (default: the default group), every rank raising the same one-line error on
    a failure (nothing is committed then). Returns the checkpoint directory."""
    job = job or Job.current(same_error=True)
    source = tier.step_dir(tier.node_of(job.rank), step)
    final = fs.normalize(path)
    destination = destination_for(final)
    what = f"{final}: not promoted from the memory tier"
    try:
        staging = job.on_main(what, lambda: destination.open(overwrite=True, clean_parent=True))
        write_and_commit(
            job,
            what,
            staging,
            lambda place: _copy_own(source, place, job.rank, destination),
            lambda _: _commit(source, staging, destination),
            destination.abort,
        )
    finally:
        destination.close()
    job.on_main(what, after_commit, final, update_latest, keep)  # latest and keep, as after a save
    return final


def _copy_own(source: str, staging: str, rank: int, destination: Destination) -> list[str]:
    """This rank's data files (``__<rank>_<k>.distcp``) from its node's snapshot into ``staging``."""
    problem = dir_problem(source)
    if problem is not None:
        raise CheckpointError(problem)
    names = sorted(n for n in os.listdir(source) if dcp_data_file_rank(n) == rank)
    for name in names:
        _copy(os.path.join(source, name), fs.join(staging, name), destination)
    return names


def _commit(source: str, staging: str, destination: Destination) -> str:
    """Rank 0: ``.metadata``, then the commit with ``mfsdp.json`` last."""
    _copy(os.path.join(source, METADATA_NAME), fs.join(staging, METADATA_NAME), destination)
    return destination.commit(
        lambda: _copy(os.path.join(source, MANIFEST_NAME), fs.join(staging, MANIFEST_NAME), destination)
    )


def _copy(src: str, dst: str, destination: Destination) -> None:
    if kind_of(src) != FILE:
        raise CheckpointError(f"{src}: not a regular file of the memory tier (a link is never followed)")
    with os.fdopen(open_regular_nofollow(src), "rb") as f, fs.open_file(dst, "wb") as out:
        shutil.copyfileobj(f, out, _PIECE)
        destination.sync_file(out)

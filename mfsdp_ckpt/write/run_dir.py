"""Run directories after a commit: ``latest`` names the new checkpoint (the destination's
:meth:`~mfsdp_ckpt.write.destination.Destination.point_latest`), and all but the newest ``keep``
checkpoints go, each un-committed first (its ``mfsdp.json`` before anything else)."""

from __future__ import annotations

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.base_ref import is_base
from mfsdp_ckpt.format.names import LATEST_NAME, MANIFEST_NAME
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.destination import destination_for

__all__ = ["after_commit", "prune"]


def after_commit(final: str, update_latest: bool, keep: int | None) -> None:
    """What follows a commit of ``final``: ``latest`` names it (when asked), then all but the
    newest ``keep`` checkpoints of its run directory go."""
    if update_latest:
        destination_for(final).point_latest()
    if keep is not None:
        prune(fs.dirname(final), keep, protect=final)


def prune(parent: str, keep: int, protect: str) -> None:
    """Remove all but the newest ``keep`` committed mfsdp checkpoints in ``parent`` (never
    ``protect`` nor the one ``latest`` names), each manifest first; then the bases (frozen
    weights) that no remaining checkpoint references. A base does not count as one of ``keep``.

    Only what it can read about goes: a link is never followed nor removed, a checkpoint whose
    manifest cannot be read (damaged, a newer format) is kept, and keeps every base, since it may
    reference any of them, and a ``latest`` that cannot be resolved keeps everything."""
    found, bases, referenced = [], [], set()
    unreadable = False
    for name in fs.listdir(parent):
        d = fs.join(parent, name)
        if name.startswith(".") or fs.islink(d) or not fs.lexists(fs.join(d, MANIFEST_NAME)):
            continue  # the latest-checkpoint symlink is not a checkpoint of its own
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            unreadable = True  # kept: and it may reference any base
            continue
        if is_base(manifest):
            bases.append((name, d))
        else:
            found.append((manifest.get("created_unix", 0.0), d, (manifest.get("base") or {}).get("name")))
    found.sort()
    pointer = fs.join(parent, LATEST_NAME)
    try:
        latest = resolve_checkpoint(pointer) if fs.lexists(pointer) else None
    except CheckpointError:
        return  # what latest names cannot be told: nothing goes (it may be any of them)
    oldest = max(len(found) - keep, 0)
    for i, (_, d, base) in enumerate(found):
        if i < oldest and d not in (protect, latest):
            destination_for(d).uncommit()
        elif base is not None:
            referenced.add(base)
    if unreadable:
        return
    for name, d in bases:
        if name not in referenced:
            destination_for(d).uncommit()

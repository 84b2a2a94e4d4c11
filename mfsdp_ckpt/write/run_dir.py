"""Run directories: the ``latest`` pointer (and, locally, the ``latest-checkpoint`` symlink),
pruning to the newest ``keep`` checkpoints, and removing a checkpoint so that it stops looking
committed first (its ``mfsdp.json`` goes before anything else, locally and on an object store)."""

from __future__ import annotations

import contextlib
import os
import warnings

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME, MANIFEST_NAME, PARTIAL_MARK
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.staging import fsync_dir

__all__ = ["after_commit", "write_latest", "prune", "remove_checkpoint", "discard"]


def remove_checkpoint(directory: str) -> None:
    """Remove a checkpoint, its manifest first: interrupted, it leaves an uncommitted directory
    (which readers refuse and the next save removes), never a complete-looking mix."""
    fs.remove_file(fs.join(directory, MANIFEST_NAME))
    fs.remove_tree(directory)


def discard(directory: str) -> None:
    """After a failed save: remove what it wrote (a local partial directory, or the uncommitted
    prefix on an object store), best effort; what remains is left for the next save."""
    with contextlib.suppress(Exception):
        remove_checkpoint(directory)


def after_commit(final: str, update_latest: bool, keep: int | None) -> None:
    """What follows a commit of ``final``: ``latest`` names it (when asked), then all but the
    newest ``keep`` checkpoints of its run directory go."""
    parent = fs.dirname(final)
    if update_latest:
        write_latest(parent, fs.basename(final))
    if keep is not None:
        prune(parent, keep, protect=final)


def write_latest(parent: str, name: str) -> None:
    """``<parent>/latest`` names ``name`` (an atomic replace; one PUT on an object store). Locally
    also the symlink ``<parent>/latest-checkpoint`` -> ``name``, after the pointer, which is what
    our readers follow."""
    fs.write_bytes(fs.join(parent, LATEST_NAME), (name + "\n").encode())
    if fs.is_local(parent):  # an object store has no symlinks
        _link_latest(parent, name)


def _link_latest(parent: str, name: str) -> None:
    """Point the symlink ``latest-checkpoint`` at ``name``, atomically: a new link under a
    partial name renamed over the old one. A file system without symlinks gets a warning (the
    pointer file is already written)."""
    link = os.path.join(parent, LATEST_LINK_NAME)
    if os.path.lexists(link) and not os.path.islink(link):
        warnings.warn(
            f"{link}: not a symlink (a copy of the run?); left as it is; '{LATEST_NAME}' names the latest", stacklevel=2
        )
        return
    tmp = os.path.join(parent, f".{LATEST_LINK_NAME}{PARTIAL_MARK}{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, link)
        fsync_dir(parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        warnings.warn(
            f"{link}: cannot link the latest checkpoint ({e.strerror or e}); '{LATEST_NAME}' names it", stacklevel=2
        )


def prune(parent: str, keep: int, protect: str) -> None:
    """Remove all but the newest ``keep`` committed mfsdp checkpoints in ``parent`` (never
    ``protect`` nor the one ``latest`` names), each manifest first."""
    found = []
    for name in fs.listdir(parent):
        d = fs.join(parent, name)
        if name.startswith(".") or fs.islink(d) or not fs.isfile(fs.join(d, MANIFEST_NAME)):
            continue  # the latest-checkpoint symlink is not a checkpoint of its own
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            continue
        found.append((manifest.get("created_unix", 0.0), d))
    found.sort()
    pointer = fs.join(parent, LATEST_NAME)
    latest = resolve_checkpoint(pointer) if fs.exists(pointer) else None
    for _, d in found[: max(len(found) - keep, 0)]:
        if d not in (protect, latest):
            remove_checkpoint(d)

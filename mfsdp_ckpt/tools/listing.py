"""The checkpoints under a run directory: step, size, committed or not (or a stock DCP checkpoint,
which has no commit marker), which one is ``latest``; and every run under a folder of runs.
Importing this module imports no torch or numpy: ``ls`` refuses a wrong path at once
(:func:`check_root`, :func:`check_mem_tier`)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from mfsdp_ckpt.errors import CheckpointError, NotACheckpointError
from mfsdp_ckpt.format.base_ref import is_base
from mfsdp_ckpt.format.names import METADATA_NAME
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.staging import is_partial_name
from mfsdp_ckpt.write.destination import destination_for

__all__ = ["CheckpointEntry", "list_checkpoints", "list_runs", "RUN_SEARCH_DEPTH", "check_root", "check_mem_tier"]

#: how many directory levels below ``ls ROOT`` are searched for run directories
RUN_SEARCH_DEPTH = 3


@dataclass(frozen=True)
class CheckpointEntry:
    name: str
    step: int | None
    bytes: int
    committed: bool
    latest: bool
    # "mfsdp", "mfsdp base" (frozen weights that saves reference), "stock DCP" (complete, no
    # mfsdp.json) or "partial" (not committed)
    format: str = "mfsdp"

    def to_json(self) -> dict:
        """docs/cli.md's JSON vocabulary: ``step`` absent (not null) where none is recorded."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_root(root: str | os.PathLike) -> str:
    """``root`` normalized, once it is known to be a directory (NotACheckpointError otherwise)."""
    root = fs.normalize(root)
    if not fs.isdir(root):
        raise NotACheckpointError(f"{root}: no such directory")
    return root


def check_mem_tier(tier: str) -> None:
    """Refuse a memory tier (``ls --mem-tier``) that is not a local directory: an object store
    (refused as the trainer refuses it, before any of its libraries is imported) or a path where
    no directory is."""
    if not fs.is_local(tier):
        raise CheckpointError(f"--mem-tier {tier}: must be a local directory (a tmpfs such as /dev/shm/...)")
    path = fs.normalize(tier)
    if not os.path.isdir(path):
        what = "not a directory" if os.path.lexists(path) else "no such directory"
        raise NotACheckpointError(f"--mem-tier {tier}: {what}")


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointEntry]:
    """Every checkpoint directory under ``root`` (committed, stock DCP ones without
    ``mfsdp.json``, and half-written ``.partial`` ones or ones whose manifest is refused), oldest
    step first."""
    from mfsdp_ckpt.format.names import LATEST_NAME
    from mfsdp_ckpt.read.manifest import is_committed, read_manifest  # numpy: not for a refusal
    from mfsdp_ckpt.read.resolve import read_pointer

    root = check_root(root)
    latest = None
    pointer = fs.join(root, LATEST_NAME)
    if fs.isfile(pointer):
        try:
            latest = read_pointer(pointer)
        except CheckpointError:
            pass  # a damaged pointer names nothing; the checkpoints are still listed
    entries = []
    try:
        names = sorted(fs.listdir(root))
    except OSError as e:
        raise NotACheckpointError(f"{root}: cannot list ({e.strerror or e})") from None
    for name in names:
        d = fs.join(root, name)
        if not fs.isdir(d) or fs.islink(d):
            continue  # the latest-checkpoint symlink names a checkpoint listed under its own name
        committed, step, kind = False, None, "partial"
        if is_committed(d):
            try:  # the manifest reader checks every field: a damaged one marks only its own checkpoint
                manifest = read_manifest(d)
                step = manifest.get("step")
                committed, kind = True, "mfsdp base" if is_base(manifest) else "mfsdp"
            except CheckpointError:
                pass
        elif not (is_partial_name(name) or fs.isfile(fs.join(d, METADATA_NAME))):
            continue  # not a checkpoint at all
        elif not is_partial_name(name) and _stock(d):
            kind = "stock DCP"  # DCP's own save writes .metadata last: complete, but nothing to commit or checksum
        entries.append(CheckpointEntry(name, step, fs.tree_size(d), committed, name == latest, kind))
    entries.sort(key=lambda e: (e.step is None, e.step or 0, e.name))
    return entries


def list_runs(root: str | os.PathLike, depth: int = RUN_SEARCH_DEPTH) -> list[tuple[str, list[CheckpointEntry]]]:
    """(run directory, its checkpoints) for every run under ``root``: ``root`` itself when it
    holds checkpoints, and every directory holding checkpoints below it, at most ``depth`` levels
    down (so that ``ls out/`` over a huge tree ends), a run directory's own subdirectories
    included. Newest run first (by its newest checkpoint's modification time; on an object
    store, which keeps none for a directory, in path order). A checkpoint directory is not
    searched into; symlinks and hidden directories are not followed."""
    root = fs.normalize(root)
    entries = list_checkpoints(root)
    runs: list[tuple[str, list[CheckpointEntry]]] = [(root, entries)] if entries else []
    _find_runs(root, depth, runs)
    newest = {run: max(_mtime(fs.join(run, e.name)) for e in entries) for run, entries in runs}
    return sorted(runs, key=lambda r: -newest[r[0]])


def _mtime(path: str) -> float:
    """A local directory's modification time (0 where there is none to read: an object store)."""
    if not fs.is_local(path):
        return 0.0
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _find_runs(directory: str, depth: int, runs: list[tuple[str, list[CheckpointEntry]]]) -> None:
    """Append the run directories below ``directory`` (up to ``depth`` levels) to ``runs``."""
    if depth <= 0:
        return
    try:
        names = sorted(fs.listdir(directory))
    except OSError:
        return  # an unreadable directory holds no run we can list
    for name in names:
        d = fs.join(directory, name)
        if name.startswith(".") or not fs.isdir(d) or fs.islink(d) or fs.lexists(fs.join(d, METADATA_NAME)):
            continue
        try:
            entries = list_checkpoints(d)
        except CheckpointError:
            continue
        if entries:
            runs.append((d, entries))
        _find_runs(d, depth - 1, runs)


def _stock(directory: str) -> bool:
    """Whether a directory with ``.metadata`` and no ``mfsdp.json`` is a stock DCP checkpoint, not
    one of our saves that never committed (:func:`mfsdp_ckpt.read.stock.uncommitted_reason`)."""
    from mfsdp_ckpt.format.safety import safe_load_metadata
    from mfsdp_ckpt.read.metadata_check import checked_metadata
    from mfsdp_ckpt.read.stock import uncommitted_reason

    path = fs.join(directory, METADATA_NAME)
    try:
        metadata = checked_metadata(safe_load_metadata(fs.read_member(directory, METADATA_NAME), path), path)
    except (OSError, CheckpointError):
        return False  # unreadable: listed as not committed
    return uncommitted_reason(directory, metadata) is None


def clean_run_dir(root: str | os.PathLike) -> list[str]:
    """Remove what killed writers left under the run directory ``root`` (``.partial-`` and
    ``.replaced-`` siblings), holding its writer lock so that no live writer's work is taken
    (refused while another job writes there). Returns the paths removed. On an object store (no
    lock there: one writer per prefix is the user's responsibility), the prefixes that hold only
    files a save writes and no ``mfsdp.json`` (:func:`mfsdp_ckpt.storage.objstore.remove_uncommitted`)."""
    return destination_for(root, kind="run").clean()

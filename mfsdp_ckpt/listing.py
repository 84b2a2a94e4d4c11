"""The checkpoints under a run directory: step, size, committed or not, which one is ``latest``."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .errors import CheckpointError, NotACheckpointError
from .manifest import MANIFEST_NAME, read_manifest

__all__ = ["CheckpointEntry", "list_checkpoints"]


@dataclass(frozen=True)
class CheckpointEntry:
    name: str
    step: int | None
    bytes: int
    committed: bool
    latest: bool

    def to_json(self) -> dict:
        return asdict(self)


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointEntry]:
    """Every checkpoint directory under ``root`` (committed, and half-written ``.partial`` ones),
    oldest step first."""
    from .checkpoint import LATEST_NAME

    root = os.fspath(root)
    if not os.path.isdir(root):
        raise NotACheckpointError(f"{root}: no such directory")
    latest = None
    pointer = os.path.join(root, LATEST_NAME)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            latest = f.read().strip()
    entries = []
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        committed, step = False, None
        if os.path.isfile(os.path.join(d, MANIFEST_NAME)):
            try:
                step = read_manifest(d).get("step")
                committed = True
            except CheckpointError:
                pass
        elif not (".partial-" in name or os.path.isfile(os.path.join(d, ".metadata"))):
            continue  # not a checkpoint at all
        entries.append(CheckpointEntry(name, step, _size(d), committed, name == latest))
    entries.sort(key=lambda e: (e.step is None, e.step or 0, e.name))
    return entries

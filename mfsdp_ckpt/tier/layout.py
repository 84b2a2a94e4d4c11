"""Where a run's memory tier keeps its checkpoints, and the record that says what each holds.

A memory tier is a directory on each node's tmpfs (``/dev/shm/...``). A run keeps its part of it
under ``<tier>/<run id>/node<k>/``, one directory per node, so that runs sharing a tier never see
each other's files (the run id is a digest of the run's ``--ckpt-dir``), and a machine that
plays several nodes (``--node-size``) keeps them apart. In a node's directory each snapshot is
``step_<n>/``: a regular checkpoint directory (``.metadata``, ``mfsdp.json``, data files) that
holds the data files its own ranks wrote and the replicas of its peer nodes' files, plus
``tier.json``, the list of every data file of the checkpoint with its size, crc32c and the node
that wrote it. A step directory appears by one rename once all of that is in place
(``step_<n>.partial`` before): a kill mid-snapshot leaves a ``.partial`` that no reader takes.

Nothing here imports torch: ``mfsdp-ckpt ls`` lists a tier without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, is_dcp_data_file
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs

__all__ = [
    "SHARED_FILES",
    "TIER_INDEX_NAME",
    "TierFile",
    "MemoryTier",
    "TierSnapshot",
    "list_snapshots",
    "newest_snapshot",
    "node_dirs",
    "read_tier_index",
    "run_id_of",
    "tier_index",
    "tier_steps",
]

TIER_INDEX_NAME = "tier.json"
_TIER_INDEX_LIMIT = 16 << 20  # bytes: a list of data files (a million ranks' would be ~100 MiB; ours far less)
_STEP = re.compile(r"^step_(\d{6,})$")
_NODE = re.compile(r"^node(\d+)$")


def run_id_of(ckpt_dir: str) -> str:
    """The run's name in a memory tier: a digest of its ``--ckpt-dir`` (normalised), so that a
    restart of the same run finds its snapshots and another run's are never read or removed."""
    return "run-" + hashlib.sha256(fs.normalize(ckpt_dir).encode()).hexdigest()[:16]


#: the files every node's copy of a snapshot holds, byte for byte the same (rank 0 writes them)
SHARED_FILES = (METADATA_NAME, MANIFEST_NAME)


@dataclass(frozen=True)
class TierFile:
    """One file of a snapshot: its size, crc32c and the node whose ranks wrote it (None for the
    :data:`SHARED_FILES`, which every node holds)."""

    size: int
    crc32c: int
    node: int | None = None


def tier_index(step: int, nodes: int, files: dict[str, TierFile]) -> dict[str, Any]:
    """The ``tier.json`` of a snapshot of ``step`` taken on ``nodes`` nodes: every data file
    (``[size, crc32c, node]``) and shared file (``[size, crc32c]``)."""
    return {
        "format": 1,
        "step": step,
        "nodes": nodes,
        "files": {n: [f.size, f.crc32c, f.node] for n, f in sorted(files.items()) if f.node is not None},
        "shared": {n: [f.size, f.crc32c] for n, f in sorted(files.items()) if f.node is None},
    }


def read_tier_index(step_dir: str) -> tuple[int, int, dict[str, TierFile]]:
    """``(step, nodes, files)`` of a snapshot's ``tier.json`` (data and shared files), read with a
    size limit and checked field by field (a :class:`CheckpointError` naming the file otherwise)."""
    path = fs.join(step_dir, TIER_INDEX_NAME)
    try:
        raw = fs.read_member(step_dir, TIER_INDEX_NAME, limit=_TIER_INDEX_LIMIT)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise CheckpointError(f"{path}: not a memory-tier index of format 1")
    step, nodes, files, shared = (doc.get(k) for k in ("step", "nodes", "files", "shared"))
    if not _count(step, 0) or not _count(nodes, 1) or not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path}: 'step', 'nodes' or 'files' missing or of the wrong type")
    if not isinstance(shared, dict) or sorted(shared) != sorted(SHARED_FILES):
        raise CheckpointError(f"{path}: 'shared' does not list {' and '.join(SHARED_FILES)}")
    out = {}
    for name, entry in files.items():
        ok = isinstance(entry, list) and len(entry) == 3 and all(_count(v, 0) for v in entry)
        if not is_dcp_data_file(name) or not ok or entry[1] >= 1 << 32 or entry[2] >= nodes:
            raise CheckpointError(f"{path}: file entry {str(name)[:80]!r} is not [size, crc32c, node]")
        out[name] = TierFile(*entry)
    for name, entry in shared.items():
        if (
            not (isinstance(entry, list) and len(entry) == 2 and all(_count(v, 0) for v in entry))
            or entry[1] >= 1 << 32
        ):
            raise CheckpointError(f"{path}: shared entry {name!r} is not [size, crc32c]")
        out[name] = TierFile(*entry)
    return step, nodes, out


def _count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def tier_steps(node_dir: str) -> list[int]:
    """The committed snapshots in a node's directory (``step_<n>/``, no ``.partial``), oldest first."""
    try:
        names = fs.listdir(node_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)


@dataclass(frozen=True)
class MemoryTier:
    """A run's place in a memory tier, seen from one rank: the tier's ``root``, the ``run_id``,
    ``node_size`` ranks per node (node ``k`` is ranks ``k*node_size ...``), the snapshots kept
    per node (``keep``) and the peer nodes that hold a replica of each node's files
    (``replicas``)."""

    root: str
    run_id: str
    node_size: int
    keep: int = 2
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.keep < 1 or self.replicas < 0:
            raise ValueError(f"memory tier: node_size, keep >= 1 and replicas >= 0, got {self}")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.root, self.run_id)

    def nodes(self, world: int) -> int:
        """The nodes of a job of ``world`` ranks."""
        return -(-world // self.node_size)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def leader(self, node: int) -> int:
        """The rank that writes a node's shared files and moves its files between nodes."""
        return node * self.node_size

    def node_dir(self, node: int) -> str:
        return os.path.join(self.run_dir, f"node{node}")

    def step_dir(self, node: int, step: int) -> str:
        return os.path.join(self.node_dir(node), f"step_{step:06d}")

    def replica_holders(self, node: int, nodes: int) -> list[int]:
        """The peer nodes that keep a replica of ``node``'s files (the next ones, round the ring)."""
        return [(node + i) % nodes for i in range(1, min(self.replicas, nodes - 1) + 1)]


def node_dirs(run_dir: str) -> list[tuple[int, str]]:
    """``(node, directory)`` of every node directory of a run in a tier, by node."""
    try:
        names = fs.listdir(run_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(run_dir, m.group(0))) for m in map(_NODE.match, names) if m]
    return sorted(found)


@dataclass(frozen=True)
class TierSnapshot:
    """One snapshot in a node's directory, as ``mfsdp-ckpt ls --mem-tier`` shows it: the data
    files of the checkpoint this node holds (by name and size; crc32c is checked by a recovery,
    not by a listing), and why ``tier.json`` cannot be read (None: it can)."""

    node: int
    step: int
    path: str
    bytes: int
    held: int
    files: int
    problem: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "step": self.step,
            "path": self.path,
            "bytes": self.bytes,
            "data_files_held": self.held,
            "data_files": self.files,
            "problem": self.problem,
        }


def list_snapshots(tier_root: str, ckpt_dir: str) -> list[TierSnapshot]:
    """The memory-tier snapshots of the run whose ``--ckpt-dir`` is ``ckpt_dir``, by node then step."""
    out = []
    for node, directory in node_dirs(os.path.join(tier_root, run_id_of(ckpt_dir))):
        for step in tier_steps(directory):
            path = os.path.join(directory, f"step_{step:06d}")
            names = set(os.listdir(path))
            size = sum(os.path.getsize(os.path.join(path, n)) for n in names if os.path.isfile(os.path.join(path, n)))
            try:
                _, _, files = read_tier_index(path)
            except CheckpointError as e:
                out.append(TierSnapshot(node, step, path, size, 0, 0, str(e)))
                continue
            data = {n: f for n, f in files.items() if f.node is not None}
            held = sum(1 for n, f in data.items() if n in names and os.path.getsize(os.path.join(path, n)) == f.size)
            out.append(TierSnapshot(node, step, path, size, held, len(data), None))
    return out


def newest_snapshot(tier_root: str, ckpt_dir: str) -> tuple[int, str] | None:
    """``(step, directory)`` of the newest snapshot of the run whose ``--ckpt-dir`` is
    ``ckpt_dir`` that this machine holds committed (its ``tier.json`` names the step, its
    manifest reads): what a restart here resumes at best, and so whose recorded model and settings
    it takes. None: no such snapshot. Which step is recovered is the ranks' collective decision
    (:func:`mfsdp_ckpt.tier.recover`: every file whole on some node, crc32c checked); every node's
    copy of a step holds the same manifest, so any one of them speaks for it."""
    found: dict[int, str] = {}
    for _, directory in node_dirs(os.path.join(os.path.abspath(tier_root), run_id_of(ckpt_dir))):
        for step in tier_steps(directory):
            path = os.path.join(directory, f"step_{step:06d}")
            if step in found:
                continue
            try:
                if read_tier_index(path)[0] != step:
                    continue
                read_manifest(path)
            except CheckpointError:
                continue
            found[step] = path
    if not found:
        return None
    step = max(found)
    return step, found[step]

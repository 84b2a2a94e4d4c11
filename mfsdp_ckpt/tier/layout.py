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

What counts is what the snapshot records, not what its directory is called: a snapshot is
``step_<n>`` only when its ``tier.json`` and its manifest both say step ``n``
(:func:`recorded_step_problem`); one whose name disagrees is never used, and goes at the next
commit. Below the run's directory only real directories and regular files count
(:mod:`mfsdp_ckpt.tier.entries`): a link is never followed, by a reader or a writer.

Nothing here imports torch: ``mfsdp-ckpt ls`` lists a tier without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, is_dcp_data_file
from mfsdp_ckpt.format.run_identity import identity_of
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.tier.entries import DIRECTORY, dir_problem, kind_of

__all__ = [
    "ANY_IDENTITY",
    "SHARED_FILES",
    "TIER_INDEX_NAME",
    "TierFile",
    "MemoryTier",
    "TierSnapshot",
    "list_snapshots",
    "newest_snapshot",
    "node_dirs",
    "read_tier_index",
    "recorded_step_problem",
    "run_id_of",
    "tier_index",
    "tier_steps",
]

TIER_INDEX_NAME = "tier.json"
_TIER_INDEX_LIMIT = 16 << 20  # bytes: a list of data files (a million ranks' would be ~100 MiB; ours far less)
_TIER_INDEX_DEPTH = 4  # nesting of tier.json: {"files": {name: [size, crc, node]}} is 3 deep
_TOO_DEEP = object()
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
        raise CheckpointError(f"{path}: not JSON ({str(e)[:160]})") from None
    except RecursionError:
        doc = _TOO_DEEP  # nested deeper than the parser's stack: said below as any deep document is
    if doc is _TOO_DEEP or _depth_over(doc, _TIER_INDEX_DEPTH):
        raise CheckpointError(f"{path}: nested deeper than {_TIER_INDEX_DEPTH} levels: not a memory-tier index")
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


def _depth_over(value: object, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests deeper than ``limit`` (iteratively: no recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def recorded_step_problem(step_dir: str, step: int) -> str | None:
    """Why the snapshot directory ``step_dir`` (named for ``step``) is not the snapshot of that
    step: its ``tier.json`` or its manifest cannot be read, or records another step (a directory
    renamed, or relabelled by hand). None: both say ``step``. What a snapshot records decides
    which is newest, never its directory's name alone."""
    try:
        recorded, _, files = read_tier_index(step_dir)
        if recorded != step:
            return f"{step_dir}: its {TIER_INDEX_NAME} records step {recorded}"
        size = os.lstat(os.path.join(step_dir, MANIFEST_NAME)).st_size if kind_of(step_dir) == DIRECTORY else -1
        if size != files[MANIFEST_NAME].size:  # looked at before a byte of it is parsed
            return f"{step_dir}: its {MANIFEST_NAME} is not the {files[MANIFEST_NAME].size} bytes {TIER_INDEX_NAME} records"
        manifest_step = read_manifest(step_dir).get("step")
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{step_dir}: {MANIFEST_NAME} unreadable ({e.strerror or e})"
    if manifest_step != step:
        return f"{step_dir}: its {MANIFEST_NAME} records step {manifest_step}"
    return None


def _step_entries(node_dir: str) -> list[tuple[int, str, str | None]]:
    """``(step, path, kind)`` of every entry named ``step_<n>`` in a node's directory, by step."""
    if kind_of(node_dir) != DIRECTORY:
        return []
    try:
        names = os.listdir(node_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(node_dir, m.group(0))) for m in map(_STEP.match, names) if m]
    return sorted((step, path, kind_of(path)) for step, path in found)


def tier_steps(node_dir: str) -> list[int]:
    """The committed snapshots in a node's directory (``step_<n>/``, no ``.partial``), oldest
    first: real directories only (a link named so is never followed, nor a node directory that is one)."""
    return [step for step, _, kind in _step_entries(node_dir) if kind == DIRECTORY]


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

    def node_problem(self, node: int) -> str | None:
        """Why ``node``'s directory cannot be the tier's (the run's directory or its own is a
        link, a file, a FIFO...): nothing is read, written or removed through it. None: both
        are real directories, or absent (a snapshot creates them)."""
        return dir_problem(self.run_dir) or dir_problem(self.node_dir(node))


def node_dirs(run_dir: str) -> list[tuple[int, str]]:
    """``(node, directory)`` of every node directory of a run in a tier, by node: real
    directories only (a link named ``node<k>``, or a run directory that is one, is never followed)."""
    if kind_of(run_dir) != DIRECTORY:
        return []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(run_dir, m.group(0))) for m in map(_NODE.match, names) if m]
    return sorted((node, path) for node, path in found if kind_of(path) == DIRECTORY)


@dataclass(frozen=True)
class TierSnapshot:
    """One snapshot in a node's directory, as ``mfsdp-ckpt ls --mem-tier`` shows it: the data
    files of the checkpoint this node holds (by name and size; crc32c is checked by a recovery,
    not by a listing), and ``problem``: why it is no usable snapshot (its records cannot be read
    or name another step; not a directory at all), or None."""

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
    """The memory-tier snapshots of the run whose ``--ckpt-dir`` is ``ckpt_dir``, by node then
    step. Never raises on what it finds: an entry named ``step_<n>`` that is no directory (a
    stray file, a link, dangling or not), a directory whose records name another step, or an
    unreadable ``tier.json`` is listed with its ``problem``; nothing is followed through a link."""
    out = []
    for node, directory in node_dirs(os.path.join(tier_root, run_id_of(ckpt_dir))):
        for step, path, kind in _step_entries(directory):
            if kind != DIRECTORY:
                out.append(TierSnapshot(node, step, path, 0, 0, 0, f"a {kind}, not a snapshot (never followed)"))
                continue
            out.append(_listed(node, step, path))
    return out


def _listed(node: int, step: int, path: str) -> TierSnapshot:
    """One snapshot directory as :func:`list_snapshots` shows it (sizes by ``lstat``: a link
    inside counts as itself)."""
    try:
        names = os.listdir(path)
    except OSError as e:
        return TierSnapshot(node, step, path, 0, 0, 0, f"unreadable ({e.strerror or e})")
    sizes = {}
    for name in names:
        try:
            st = os.lstat(os.path.join(path, name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[name] = st.st_size
    size = sum(sizes.values())
    problem = recorded_step_problem(path, step)
    if problem is not None:
        return TierSnapshot(node, step, path, size, 0, 0, problem)
    _, _, files = read_tier_index(path)
    data = {n: f for n, f in files.items() if f.node is not None}
    held = sum(1 for n, f in data.items() if sizes.get(n) == f.size)
    return TierSnapshot(node, step, path, size, held, len(data), None)


#: :func:`newest_snapshot`'s ``identity`` when any run identity will do
ANY_IDENTITY = "*"


def newest_snapshot(tier_root: str, ckpt_dir: str, identity: str | None = ANY_IDENTITY) -> tuple[int, str] | None:
    """``(step, directory)`` of the newest snapshot of the run whose ``--ckpt-dir`` is
    ``ckpt_dir`` that this machine holds committed: a real directory whose ``tier.json`` and
    manifest both record the step its name says (:func:`recorded_step_problem`), and with
    ``identity`` (a run identity, or None: none recorded) one whose manifest records that run
    identity (:mod:`mfsdp_ckpt.format.run_identity`). What a restart here resumes at best, and so
    whose recorded model and settings it takes. None: no such snapshot. Which step is recovered
    is the ranks' collective decision (:func:`mfsdp_ckpt.tier.recover`: every file whole on some
    node, crc32c checked); every node's copy of a step holds the same manifest, so any one of them
    speaks for it."""
    found: dict[int, str] = {}
    for _, directory in node_dirs(os.path.join(os.path.abspath(tier_root), run_id_of(ckpt_dir))):
        for step in tier_steps(directory):
            path = os.path.join(directory, f"step_{step:06d}")
            if step in found or recorded_step_problem(path, step) is not None:
                continue
            if identity != ANY_IDENTITY and identity_of(read_manifest(path)) != identity:
                continue
            found[step] = path
    if not found:
        return None
    step = max(found)
    return step, found[step]

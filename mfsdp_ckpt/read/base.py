"""Following a checkpoint's reference to its base (:mod:`mfsdp_ckpt.format.base_ref`): the base
opened and checked against the reference, and the two checkpoints' tables seen as one, so every
reader (``load``, ``verify``, ``inspect``, ``diff``, ``reshard``, ``convert``, ``export-hf``) reads a
referencing checkpoint as if it held the frozen weights itself.

The base's data files appear to the readers under :func:`~mfsdp_ckpt.format.base_ref.base_file`
names, which the chunk reader resolves to the sibling directory; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

from mfsdp_ckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from mfsdp_ckpt.format.base_ref import base_file, name_problem, reference_problem
from mfsdp_ckpt.format.names import MANIFEST_NAME
from mfsdp_ckpt.read.indexed import IndexedCheckpoint, has_index
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs

__all__ = ["OpenBase", "open_base", "Either"]


@dataclass
class OpenBase:
    """The base a checkpoint references: its directory, its manifest (checked against the
    reference) and its index, whose files are named as the referencing checkpoint's readers see
    them."""

    directory: str
    manifest: dict[str, Any]
    indexed: IndexedCheckpoint


def open_base(directory: str, manifest: dict[str, Any] | None) -> OpenBase | None:
    """The base that the checkpoint in ``directory`` (its ``manifest``) references, opened and
    checked; None when it references none. One-line errors name the base: missing, a link, not
    committed, or not the base the reference pins (replaced or changed)."""
    reference = (manifest or {}).get("base")
    if reference is None:
        return None
    name = reference["name"]
    problem = name_problem(name)  # the schema checked it too: a reader never trusts one check
    where = f"{fs.join(directory, MANIFEST_NAME)}: field 'base.name'"
    if problem is not None:
        raise UnsafeCheckpointError(f"{where}: {problem}")
    base = fs.join(fs.dirname(directory), name)
    if fs.islink(base):
        raise UnsafeCheckpointError(f"{base}: the base of {directory} is a link; a base must be a directory of the run")
    if not fs.isdir(base):
        raise CorruptCheckpointError(
            f"{base}: missing: the base checkpoint (frozen weights) that {directory} references"
        )
    try:
        base_manifest = read_manifest(base)
    except CheckpointError as e:
        raise type(e)(f"{e} (the base that {directory} references)") from None
    problem = reference_problem(reference, base_manifest)
    if problem is None and not has_index(base_manifest):
        problem = "it has no index"
    if problem is not None:
        raise CorruptCheckpointError(f"{base}: {problem} (the base that {directory} references)")
    if base_manifest.get("base") is not None:
        raise CorruptCheckpointError(f"{base}: references a base itself; a base holds its weights")
    indexed = IndexedCheckpoint(base, base_manifest, file_name=lambda file: base_file(name, file))
    return OpenBase(base, base_manifest, indexed)


class Either(Mapping):
    """Two mappings with disjoint keys seen as one (a checkpoint's own table, then its base's)."""

    def __init__(self, own: Mapping, base: Mapping) -> None:
        self.own, self.base = own, base

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.own[key]
        except KeyError:
            return self.base[key]

    def __contains__(self, key: object) -> bool:
        return key in self.own or key in self.base

    def __iter__(self) -> Iterator[Any]:
        yield from self.own
        yield from self.base

    def __len__(self) -> int:
        return len(self.own) + len(self.base)

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

from mfsdp_ckpt.format.base_ref import base_file
from mfsdp_ckpt.read.base_manifest import checked_base
from mfsdp_ckpt.read.indexed import IndexedCheckpoint
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
    found = checked_base(directory, manifest)
    if found is None:
        return None
    base, base_manifest = found
    name = fs.basename(base)
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

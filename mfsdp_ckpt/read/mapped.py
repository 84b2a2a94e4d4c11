"""A :class:`~mfsdp_ckpt.read.reader.CheckpointReader` that shows any DCP checkpoint under
canonical keys: a stock one (no ``mfsdp.json``: FSDP2's, torchtitan's) through its key layout,
any one through the user's ``--key-map`` rules (:mod:`mfsdp_ckpt.read.stock`). Offline tools
(``reshard``) read through it, so that they plan and write canonical keys whatever wrote the
source."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.format.titan import TITAN_LAYOUT
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.stock import KeyRule, canonical_names, is_stock, stock_param_groups

__all__ = ["MappedReader"]


class MappedReader:
    """Entries by canonical name (``keys``, ``read``, ``read_flat``, ``shape``, ``dtype``,
    ``is_tensor``), read from the stored ones by a :class:`CheckpointReader`, which checks every
    chunk. With no rules, a committed mfsdp checkpoint reads exactly as through it. A context
    manager, like it."""

    def __init__(self, path: str | os.PathLike, key_map: Sequence[KeyRule] = ()) -> None:
        self.raw = CheckpointReader(path)
        self.directory, self.manifest, self.metadata = self.raw.directory, self.raw.manifest, self.raw.metadata
        self.key_map = tuple(key_map)
        try:
            self.names = canonical_names(
                self.metadata.state_dict_metadata, self.key_map, stock_layout=is_stock(self.manifest)
            )
        except CheckpointError as e:
            self.close()
            raise CheckpointError(f"{self.directory}: {e}") from None
        self._groups: list[dict[str, Any]] | None = None

    def __enter__(self) -> "MappedReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.raw.close()

    @property
    def stock(self) -> bool:
        return is_stock(self.manifest)

    @property
    def titan(self) -> bool:
        """Whether the entries are named in torchtitan's layout (its own checkpoint, or one we
        wrote in it), mapped to canonical names (:mod:`mfsdp_ckpt.format.titan`)."""
        return self.names.layout == TITAN_LAYOUT

    def source_key(self, key: str) -> str:
        """The stored key of canonical ``key``."""
        try:
            return self.names.sources[key]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no key '{key}'") from None

    def keys(self) -> list[str]:
        return self.names.keys()

    def is_tensor(self, key: str) -> bool:
        if key == PARAM_GROUPS and self.names.group_parts:
            return False
        return self.raw.is_tensor(self.source_key(key))

    def shape(self, key: str) -> torch.Size:
        return self.raw.shape(self.source_key(key))

    def dtype(self, key: str) -> torch.dtype:
        return self.raw.dtype(self.source_key(key))

    def read(self, key: str) -> Any:
        if key == PARAM_GROUPS and self.names.group_parts:
            if self._groups is None:
                self._groups = stock_param_groups(self.names.group_parts, self.raw.read, self.key_map)
            return self._groups
        return self.raw.read(self.source_key(key))

    def read_flat(self, key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.raw.read_flat(self.source_key(key), start, end, out=out)

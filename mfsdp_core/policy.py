"""Sharding policies: where shard boundaries may fall inside a parameter (``even``, ``row``,
``block(n)``, ``tensor``). Torch-free, so that a manifest's schema and the launcher's pre-flight
parse a policy without importing torch; :mod:`mfsdp_core.layout` computes layouts under them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Policy", "parse_policy", "POLICY_NAMES"]

POLICY_NAMES = ("even", "row", "block(n)", "tensor")
_BLOCK_RE = re.compile(r"^block\((\d+)\)$")


@dataclass(frozen=True)
class Policy:
    """Where shard boundaries may fall inside a parameter. ``kind`` is one of
    ``even``, ``row``, ``block``, ``tensor``; ``block_rows`` is set for ``block``."""

    kind: str
    block_rows: int = 0

    def __str__(self) -> str:
        return f"block({self.block_rows})" if self.kind == "block" else self.kind

    @property
    def keeps_tensors_whole(self) -> bool:
        """True when no parameter is ever split across ranks (params may be packed in any order)."""
        return self.kind == "tensor"

    def atom(self, shape: torch.Size, name: str = "<param>") -> int:
        """Number of consecutive elements of a parameter that must stay on one rank."""
        numel = math.prod(shape)
        if numel == 0:
            return 1
        row = math.prod(shape[1:]) if len(shape) >= 1 else 1
        if self.kind == "even":
            return 1
        if self.kind == "row":
            return row
        if self.kind == "tensor":
            return numel
        # block(k)
        if len(shape) < 2:
            return numel
        if shape[0] % self.block_rows:
            raise ValueError(
                f"policy {self}: parameter '{name}' of shape {tuple(shape)} has {shape[0]} rows, "
                f"not a multiple of {self.block_rows}"
            )
        return self.block_rows * row


def parse_policy(spec: str | Policy) -> Policy:
    """Parse ``even``, ``row``, ``block(32)`` or ``tensor`` (a Policy passes through)."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"unknown sharding policy {spec!r}; expected one of {', '.join(POLICY_NAMES)}")
    text = spec.strip()
    if text in ("even", "row", "tensor"):
        return Policy(text)
    match = _BLOCK_RE.match(text)
    if match and int(match.group(1)) > 0:
        return Policy("block", int(match.group(1)))
    raise ValueError(f"unknown sharding policy {spec!r}; expected one of {', '.join(POLICY_NAMES)}")

"""A plane stored next to a parameter and laid out from its rows (e.g. an MXFP8 scale plane):
what a placement carries so that the plane shards, gathers and checkpoints with its parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from mfsdp_core.dtypes import dtype_by_name, dtype_name

__all__ = ["Companion", "as_matrix"]


def as_matrix(shape: Sequence[int]) -> tuple[int, int]:
    """A parameter's shape seen as a matrix ``(rows, cols)``: ``shape[0]`` rows of the rest."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(shape[1:])


@dataclass(frozen=True)
class Companion:
    """A plane stored next to its parameter and laid out from the same rows, so that it shards,
    gathers and checkpoints with them (e.g. an MXFP8 scale plane).

    The parameter is seen as a matrix ``[rows, cols]`` (``rows = shape[0]``, ``cols`` the rest).
    Companion row ``j`` covers parameter rows ``[j·row_divisor, (j+1)·row_divisor)`` and has
    ``ceil(cols / col_divisor)`` elements. ``derive(rows_fp32) -> plane_rows`` computes a rank's
    part from the main (fp32) values of the whole row blocks it owns; it is behaviour, not data, so
    it is left out of comparisons and of the manifest."""

    name: str
    dtype: torch.dtype
    row_divisor: int = 1
    col_divisor: int = 1
    derive: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.row_divisor < 1 or self.col_divisor < 1:
            raise ValueError(f"companion '{self.name}': divisors must be >= 1")

    def shape(self, param_shape: Sequence[int]) -> torch.Size:
        rows, cols = as_matrix(param_shape)
        return torch.Size((-(-rows // self.row_divisor), -(-cols // self.col_divisor)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": dtype_name(self.dtype),
            "row_divisor": self.row_divisor,
            "col_divisor": self.col_divisor,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Companion":
        return cls(d["name"], dtype_by_name(d["dtype"]), int(d["row_divisor"]), int(d["col_divisor"]))

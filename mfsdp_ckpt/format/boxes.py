"""Flat range → boxes: a contiguous range of a row-major tensor as rectangular chunks.

A rank owns elements ``[start, end)`` of a tensor's row-major flattening. That range is the union
of at most ``2·ndim − 1`` boxes (for 2-D: a partial first row, a block of whole rows, a partial
last row), each itself contiguous in the flattening, so each box's data is a plain view of the
flat shard: no copies. DCP stores each box as one chunk (``offsets``, ``sizes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # tensors are passed in: the boxes' arithmetic imports no torch
    import torch

__all__ = ["Box", "flat_range_to_boxes", "box_view"]


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int  # where the box begins in the row-major flattening

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes covering elements ``[start, end)`` of a row-major tensor of ``shape``, in order."""
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) == 0:
        return [Box((), (), 0)]
    return [Box(o, s, f) for o, s, f in _boxes(shape, start, end)]


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    rest = shape[1:]
    row = math.prod(rest)
    if row == 0:
        return []
    full_rows = (start + row - 1) // row, end // row  # rows lying wholly inside the range

    def within_row(r: int, a: int, b: int):
        return [((r, *o), (1, *s), r * row + f) for o, s, f in _boxes(rest, a, b)]

    if full_rows[0] > full_rows[1]:  # the range lies inside one row
        r = start // row
        return within_row(r, start - r * row, end - r * row)
    out = []
    if start % row:
        out += within_row(start // row, start % row, row)
    if full_rows[1] > full_rows[0]:
        out.append(((full_rows[0], *([0] * len(rest))), (full_rows[1] - full_rows[0], *rest), full_rows[0] * row))
    if end % row:
        out += within_row(end // row, 0, end % row)
    return out


def box_view(flat: torch.Tensor, flat_start: int, box: Box) -> torch.Tensor:
    """The part of ``flat`` (a 1-D tensor holding elements from ``flat_start`` on) that ``box``
    covers, as a view shaped like the box."""
    lo = box.flat_start - flat_start
    return flat[lo : lo + box.numel].view(box.sizes)


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box ``offsets``/``lengths`` of ``tensor``, as a view (dimensions it covers whole are
    left alone)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor

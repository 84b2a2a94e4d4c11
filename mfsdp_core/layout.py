"""Shard layouts: which rank owns which flat range of each parameter.

A group of parameters is packed into one flat buffer and split into ``group_size`` shards of
equal capacity ``shard_size``. Rank ``r`` owns one contiguous segment of the packed parameters;
its shard holds that segment followed by padding. A *policy* says where a segment may end inside
a parameter (its "atom": the number of elements that must stay on one rank):

=============  ===============================================================================
``even``       any element (atom 1): ``ceil(total / n)`` elements per rank, padding at the end
``row``        whole rows (atom ``shape[1:].numel()``)
``block(k)``   whole blocks of ``k`` rows (MXFP8: k=32, so data and scales stay on one rank);
               a parameter with fewer than 2 dims (norm weight, bias) is kept whole
``tensor``     whole parameters, assigned greedily to balance bytes (Muon needs whole matrices)
=============  ===============================================================================

Everything here is a pure function of (shapes, group size, policy): every rank computes the same
layout without communication, which is what the checkpoint planners rely on.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from mfsdp_core.policy import POLICY_NAMES, Policy, parse_policy

__all__ = ["Policy", "parse_policy", "Piece", "Layout", "compute_layout", "refine_layout", "POLICY_NAMES"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of parameter ``param`` (row-major flat index) held by ``rank``,
    stored in that rank's shard from ``shard_offset``. Empty when ``start == end``."""

    param: int
    rank: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    """The result of :func:`compute_layout`.

    ``order`` is the packing order of the parameters (indices into ``shapes``); ``bounds`` has
    ``group_size + 1`` entries: rank ``r`` owns packed elements ``[bounds[r], bounds[r + 1])``.
    In the *gathered* buffer (all shards concatenated, ``group_size * shard_size`` elements)
    packed element ``x`` of rank ``r`` sits at ``r * shard_size + x - bounds[r]``.
    """

    shapes: tuple[torch.Size, ...]
    group_size: int
    policy: Policy
    order: tuple[int, ...]
    bounds: tuple[int, ...]
    shard_size: int

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def packed_offsets(self) -> tuple[int, ...]:
        """Start of each parameter (by parameter index) in the packed, unpadded order."""
        offsets = [0] * len(self.shapes)
        pos = 0
        for i in self.order:
            offsets[i] = pos
            pos += self.numels[i]
        return tuple(offsets)

    @property
    def total(self) -> int:
        """Elements of all parameters, without padding."""
        return sum(self.numels)

    @property
    def gathered_size(self) -> int:
        return self.group_size * self.shard_size

    @property
    def padding(self) -> int:
        """Elements of padding over all ranks (gathered size minus total)."""
        return self.gathered_size - self.total

    @property
    def rank_lengths(self) -> tuple[int, ...]:
        """Used (non-padding) elements in each rank's shard."""
        return tuple(self.bounds[r + 1] - self.bounds[r] for r in range(self.group_size))

    @cached_property
    def padding_ranges(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` of every run of padding in the gathered buffer (the end of each
        rank's shard past its segment), in order; everything else belongs to a parameter."""
        S = self.shard_size
        runs = ((r * S + used, (r + 1) * S) for r, used in enumerate(self.rank_lengths))
        return tuple((a, b) for a, b in runs if b > a)

    def piece(self, param: int, rank: int) -> Piece:
        """The part of ``param`` owned by ``rank`` (possibly empty)."""
        p0 = self.packed_offsets[param]
        numel = self.numels[param]
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        start = min(max(lo - p0, 0), numel)
        end = max(min(hi - p0, numel), start)
        return Piece(param, rank, start, end, max(p0 + start - lo, 0) if end > start else 0)

    def local_pieces(self, rank: int) -> list[Piece]:
        """Non-empty pieces of ``rank``'s shard, in shard order."""
        out = []
        for i in self.order:
            pc = self.piece(i, rank)
            if pc.numel:
                out.append(pc)
        return out

    @cached_property
    def pieces_by_rank(self) -> tuple[tuple[Piece, ...], ...]:
        """:meth:`local_pieces` of every rank, computed once."""
        return tuple(tuple(self.local_pieces(r)) for r in range(self.group_size))

    def owners(self, param: int, lo: int = 0, hi: int | None = None) -> list[Piece]:
        """Non-empty pieces of ``param``, ordered by flat position; with ``lo``/``hi``, only those
        overlapping its elements ``[lo, hi)``. Only the ranks whose segments overlap are visited
        (a binary search on ``bounds``): at a thousand ranks a parameter spans a few of them, and
        a load asks for the few pieces its own shard needs."""
        p0, numel = self.packed_offsets[param], self.numels[param]
        end = p0 + (numel if hi is None else min(hi, numel))
        if p0 + max(lo, 0) >= end:
            return []
        out = []
        r = bisect.bisect_right(self.bounds, p0 + max(lo, 0)) - 1
        while 0 <= r < self.group_size and self.bounds[r] < end:
            pc = self.piece(param, r)
            if pc.numel:
                out.append(pc)
            r += 1
        return out

    def first_owner(self, param: int) -> Piece | None:
        """The first non-empty piece of ``param`` (by flat position), None for an empty
        parameter: one binary search, where :meth:`owners` visits every rank the parameter
        spans (all of them, for a large tensor under ``even`` at a thousand ranks)."""
        if not self.numels[param]:
            return None
        return self.piece(param, bisect.bisect_right(self.bounds, self.packed_offsets[param]) - 1)

    @cached_property
    def gathered_offsets(self) -> tuple[int | None, ...]:
        """For each parameter, its offset in the gathered buffer if it lies there contiguously
        (so it can be a view of that buffer), else None (it spans padding between shards)."""
        out: list[int | None] = []
        for i in range(len(self.shapes)):
            pieces = self.owners(i)
            if not pieces:
                out.append(0)
                continue
            first = pieces[0].rank * self.shard_size + pieces[0].shard_offset
            pos = first
            for pc in pieces:
                if pc.rank * self.shard_size + pc.shard_offset != pos:
                    first = None
                    break
                pos += pc.numel
            out.append(first)
        return tuple(out)


def compute_layout(
    shapes: Sequence[torch.Size | Sequence[int]],
    group_size: int,
    policy: str | Policy = "even",
    names: Sequence[str] | None = None,
    first_rank: int = 0,
) -> Layout:
    """Compute which rank owns which flat range of each parameter. Pure; no communication.

    ``first_rank`` (``tensor`` only): where the greedy assignment starts when loads tie, so that
    buffers holding one parameter each do not all land on rank 0 (see ``BufferSpec.first_rank``).

    Raises ValueError (naming the parameter) when a parameter cannot be cut by ``policy``.
    """
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    pol = parse_policy(policy)
    shapes_t = tuple(torch.Size(s) for s in shapes)
    names = list(names) if names is not None else [f"param{i}" for i in range(len(shapes_t))]
    for s, n in zip(shapes_t, names):
        pol.atom(s, n)  # a parameter the policy cannot cut is refused by name
    return _layout(shapes_t, group_size, pol, first_rank % group_size if pol.keeps_tensors_whole else 0)


@functools.lru_cache(maxsize=4096)
def _layout(shapes_t: tuple[torch.Size, ...], group_size: int, pol: Policy, first_rank: int) -> Layout:
    """:func:`compute_layout`, remembered: a layout is immutable and a pure function of its
    arguments (names only name a refusal), and at a thousand ranks one costs tens of
    milliseconds; identical layers, the planning simulator's virtual ranks and the checkpoint
    readers ask for the same ones."""
    numels = [math.prod(s) for s in shapes_t]
    atoms = [pol.atom(s) for s in shapes_t]
    if pol.keeps_tensors_whole:
        order, bounds = _greedy_whole_tensors(numels, group_size, first_rank % group_size)
    else:
        order = tuple(range(len(shapes_t)))
        bounds = _partition(numels, atoms, group_size)
    shard_size = max((bounds[r + 1] - bounds[r] for r in range(group_size)), default=0)
    return Layout(shapes_t, group_size, pol, order, bounds, shard_size)


def refine_layout(layout: Layout, parts: int) -> Layout:
    """``layout`` with each rank's segment cut again into ``parts`` contiguous sub-segments on
    the same policy's cut points: a layout over ``group_size * parts`` ranks in which rank
    ``r * parts + k`` owns the k-th part of what rank ``r`` owns in ``layout``.

    HFSDP's optimizer layout: the main params and optimizer state of a shard-group rank's
    segment are split again over the replicas. Packing order and cut rules stay those of
    ``layout``, so each sub-segment is a contiguous range of the segment it refines. Pure."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1:
        return layout
    atoms_of = [layout.policy.atom(s) for s in layout.shapes]
    bounds = [0]
    for r in range(layout.group_size):
        lo = layout.bounds[r]
        pieces = layout.local_pieces(r)  # in packing order; each starts on an allowed cut
        sub = _partition([pc.numel for pc in pieces], [atoms_of[pc.param] for pc in pieces], parts)
        bounds.extend(lo + b for b in sub[1:])
    shard_size = max((bounds[w + 1] - bounds[w] for w in range(len(bounds) - 1)), default=0)
    return Layout(layout.shapes, layout.group_size * parts, layout.policy, layout.order, tuple(bounds), shard_size)


def _greedy_whole_tensors(numels: list[int], n: int, first_rank: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Largest parameter first onto the least-loaded rank (ties: the first rank from
    ``first_rank`` on, cyclically; then the lowest index); each rank's parameters are then packed
    in their original order."""
    loads = [0] * n
    assigned: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(n), key=lambda r: (loads[r], (r - first_rank) % n))
        loads[r] += numels[i]
        assigned[r].append(i)
    order: list[int] = []
    bounds = [0]
    for r in range(n):
        order.extend(sorted(assigned[r]))
        bounds.append(bounds[-1] + loads[r])
    return tuple(order), tuple(bounds)


def _partition(numels: list[int], atoms: list[int], n: int) -> tuple[int, ...]:
    """Cut the packed parameters into n contiguous segments on allowed cut points so that the
    largest segment is as small as possible (binary search on the capacity, greedy fill)."""
    total = sum(numels)
    starts = [0]
    for m in numels:
        starts.append(starts[-1] + m)

    def largest_cut_at_most(x: int) -> int:
        if x >= total:
            return total
        i = bisect.bisect_right(starts, x) - 1  # parameter containing x
        return starts[i] + (x - starts[i]) // atoms[i] * atoms[i]

    def fill(cap: int) -> list[int] | None:
        bounds = [0]
        for _ in range(n):
            bounds.append(largest_cut_at_most(bounds[-1] + cap))
        return bounds if bounds[-1] == total else None

    lo, hi = max(-(-total // n), 0), total
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = fill(lo)
    assert bounds is not None
    return tuple(bounds)

"""Property tests for :mod:`mfsdp_core.layout` (pure shard-layout computation).

Every expectation here is derived independently of the implementation: cut-point sets are built
from the policy's definition, optimal capacities come from a brute-force DP over those cut points,
the ``tensor`` assignment is re-derived with a heap-based LPT, and hand-computed numbers are used
for the concrete examples.
"""

from __future__ import annotations

import heapq
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfsdp_core.layout import Layout, Piece, Policy, compute_layout, parse_policy

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

POLICIES = ["even", "row", "tensor", "block(1)", "block(4)", "block(32)"]
CONTIGUOUS = ["even", "row", "block(1)", "block(4)", "block(32)"]


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------


def _block_rows(policy: str) -> int:
    return int(policy[len("block(") : -1]) if policy.startswith("block(") else 0


@st.composite
def shape_st(draw, policy: str = "even", max_dim: int = 70):
    """A shape with 0-3 dims, dims in [1, max_dim]; valid for ``policy`` by construction."""
    ndim = draw(st.integers(0, 3))
    dims = [draw(st.integers(1, max_dim)) for _ in range(ndim)]
    k = _block_rows(policy)
    if k and ndim >= 2:
        # rows must be a multiple of k: pick a multiple (at least k, even when k > max_dim)
        dims[0] = k * draw(st.integers(1, max(1, max_dim // k)))
    return tuple(dims)


@st.composite
def case_st(draw, policies=POLICIES, max_params: int = 8, max_dim: int = 70, max_n: int = 9):
    policy = draw(st.sampled_from(policies))
    shapes = draw(st.lists(shape_st(policy, max_dim), min_size=1, max_size=max_params))
    # make 1-element params common (norm scalars, 0-d params, (1,), (1,1) ...)
    if draw(st.booleans()):
        idx = draw(st.integers(0, len(shapes) - 1))
        shapes[idx] = draw(st.sampled_from([(), (1,), (1, 1), (1, 1, 1)]))
        if _block_rows(policy) and len(shapes[idx]) >= 2:
            shapes[idx] = (_block_rows(policy),) + shapes[idx][1:]
    n = draw(st.integers(1, max_n))
    return shapes, n, policy


# --------------------------------------------------------------------------------------------
# independent helpers (from the policy definitions, not from the implementation)
# --------------------------------------------------------------------------------------------


def numel_of(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def row_of(shape) -> int:
    out = 1
    for d in shape[1:]:
        out *= d
    return out


def atom_of(shape, policy: str) -> int:
    """Elements that must stay together, per the policy table in the brief."""
    numel = numel_of(shape)
    if policy == "even":
        return 1
    if policy == "row":
        return row_of(shape)
    if policy == "tensor":
        return numel
    k = _block_rows(policy)
    assert k
    if len(shape) < 2:
        return numel
    assert shape[0] % k == 0
    return k * row_of(shape)


def allowed_cuts(shapes, policy: str) -> list[int]:
    """Sorted packed positions (original order) where a contiguous segment may end."""
    cuts = {0}
    pos = 0
    for s in shapes:
        m, a = numel_of(s), atom_of(s, policy)
        for j in range(0, m + 1, a):
            cuts.add(pos + j)
        pos += m
        cuts.add(pos)
    return sorted(cuts)


def brute_min_capacity(shapes, n: int, policy: str) -> int:
    """min over all choices of n-1 (non-decreasing) cut points of the largest segment (DP)."""
    cuts = allowed_cuts(shapes, policy)
    total = cuts[-1]
    INF = float("inf")
    # best[c] = min possible max segment covering [0, cuts[c]] with j segments
    best = [0 if c == 0 else INF for c in cuts]
    for _ in range(n):
        new = [INF] * len(cuts)
        for b, cb in enumerate(cuts):
            for a in range(b + 1):
                new[b] = min(new[b], max(best[a], cb - cuts[a]))
        best = new
    assert cuts[-1] == total
    return int(best[-1])


def enumerate_min_capacity(shapes, n: int, policy: str) -> int:
    """Plain enumeration of all cut-point multisets (tiny cases only)."""
    cuts = allowed_cuts(shapes, policy)
    total = cuts[-1]
    best = None
    for inner in itertools.combinations_with_replacement(cuts, n - 1):
        b = (0,) + inner + (total,)
        m = max(b[i + 1] - b[i] for i in range(n))
        best = m if best is None else min(best, m)
    return best


def lpt(numels: list[int], n: int) -> list[list[int]]:
    """Independent LPT: largest first (ties: lower index) onto least-loaded rank (ties: lower rank)."""
    heap = [(0, r) for r in range(n)]
    heapq.heapify(heap)
    assigned = [[] for _ in range(n)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(heap)
        assigned[r].append(i)
        heapq.heappush(heap, (load + numels[i], r))
    return assigned


def layout_of(shapes, n, policy, **kw) -> Layout:
    return compute_layout(shapes, n, policy, **kw)


def all_pieces(lay: Layout, i: int) -> list[Piece]:
    return [lay.piece(i, r) for r in range(lay.group_size)]


def check_structural(shapes, n, policy, lay: Layout) -> None:
    """Invariants that every policy must satisfy."""
    numels = [numel_of(s) for s in shapes]
    total = sum(numels)
    S = lay.shard_size

    assert lay.group_size == n
    assert lay.total == total
    assert sorted(lay.order) == list(range(len(shapes)))
    assert len(lay.bounds) == n + 1
    assert lay.bounds[0] == 0 and lay.bounds[-1] == total
    assert all(lay.bounds[r] <= lay.bounds[r + 1] for r in range(n))

    # rank lengths / padding
    assert sum(lay.rank_lengths) == total
    assert all(0 <= L <= S for L in lay.rank_lengths)
    assert S == max(lay.rank_lengths)
    assert lay.gathered_size == n * S
    assert lay.padding == n * S - total >= 0

    used = [[] for _ in range(n)]  # (shard_offset, end) per rank
    for i, m in enumerate(numels):
        pcs = all_pieces(lay, i)
        for r, pc in enumerate(pcs):
            assert pc.param == i and pc.rank == r
            assert 0 <= pc.start <= pc.end <= m
            assert pc.numel == pc.end - pc.start
            if pc.numel:
                assert 0 <= pc.shard_offset and pc.shard_offset + pc.numel <= S
                used[r].append((pc.shard_offset, pc.shard_offset + pc.numel, i))
        # non-empty pieces cover [0, m) exactly once
        nonempty = sorted((pc.start, pc.end) for pc in pcs if pc.numel)
        pos = 0
        for a, b in nonempty:
            assert a == pos, (i, nonempty)
            pos = b
        assert pos == m
        # owners() == the non-empty pieces in flat order
        own = lay.owners(i)
        assert [(p.start, p.end) for p in own] == nonempty
        assert [p.rank for p in own] == sorted(p.rank for p in own)
        assert all(p.numel for p in own)
        # first_owner() == the first of them, None for an empty parameter
        assert lay.first_owner(i) == (own[0] if own else None)

    for r in range(n):
        # pieces within a shard don't overlap, and they fill [0, rank_length) with no gap
        segs = sorted(used[r])
        pos = 0
        for a, b, _ in segs:
            assert a == pos, (r, segs)
            pos = b
        assert pos == lay.rank_lengths[r]
        # local_pieces: the same pieces in shard order
        lp = lay.local_pieces(r)
        assert [(p.shard_offset, p.shard_offset + p.numel, p.param) for p in lp] == segs
        assert all(p.rank == r and p.numel for p in lp)

    # packing: the packed position of a piece is bounds[r] + shard_offset, and params are packed in
    # layout.order, consecutively
    pos = 0
    for i in lay.order:
        for pc in lay.owners(i):
            assert lay.bounds[pc.rank] + pc.shard_offset == pos + pc.start
        pos += numels[i]


def check_gathered(lay: Layout, shapes) -> None:
    S = lay.shard_size
    for i in range(len(shapes)):
        own = lay.owners(i)
        positions = [pc.rank * S + pc.shard_offset for pc in own]
        contiguous = all(positions[j + 1] == positions[j] + own[j].numel for j in range(len(own) - 1))
        # independently: contiguous iff every rank but the last one holding the param is full
        full_before_last = all(lay.rank_lengths[pc.rank] == S for pc in own[:-1])
        assert contiguous == full_before_last
        off = lay.gathered_offsets[i]
        if contiguous:
            assert off == positions[0]
            # the param occupies [off, off + numel) in the gathered buffer, each element once
            assert positions[-1] + own[-1].numel == off + numel_of(shapes[i])
        else:
            assert off is None


# --------------------------------------------------------------------------------------------
# structural invariants for every policy
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case_st())
def test_pieces_partition_params_and_fit_shards(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    check_structural(shapes, n, policy, lay)


@SETTINGS
@given(case_st())
def test_gathered_offsets(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    check_gathered(lay, shapes)
    if policy in ("even", "tensor"):
        assert None not in lay.gathered_offsets


@SETTINGS
@given(case_st())
def test_deterministic(case):
    shapes, n, policy = case
    a = layout_of(shapes, n, policy)
    b = layout_of([torch.Size(s) for s in shapes], n, parse_policy(policy))
    assert a == b
    assert a.bounds == b.bounds and a.order == b.order and a.shard_size == b.shard_size
    assert a.gathered_offsets == b.gathered_offsets
    for i in range(len(shapes)):
        assert a.owners(i) == b.owners(i)


# --------------------------------------------------------------------------------------------
# policy boundaries
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case_st(policies=["row"]))
def test_row_cuts_on_row_boundaries(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    assert lay.order == tuple(range(len(shapes)))
    for i, s in enumerate(shapes):
        row = row_of(s)
        for pc in lay.owners(i):
            assert pc.start % row == 0 and pc.end % row == 0, (s, pc)
        # every row lives on exactly one rank
        for rr in range(s[0] if len(s) >= 1 else 1):
            owners = {pc.rank for pc in lay.owners(i) if pc.start <= rr * row < pc.end}
            assert len(owners) == 1
            assert any(pc.start <= rr * row and (rr + 1) * row <= pc.end for pc in lay.owners(i))


@SETTINGS
@given(case_st(policies=["block(1)", "block(4)", "block(32)"]))
def test_block_cuts_on_block_boundaries(case):
    shapes, n, policy = case
    k = _block_rows(policy)
    lay = layout_of(shapes, n, policy)
    assert lay.order == tuple(range(len(shapes)))
    for i, s in enumerate(shapes):
        own = lay.owners(i)
        if len(s) < 2:
            assert len(own) == 1 and own[0].start == 0 and own[0].end == numel_of(s)
            continue
        blk = k * row_of(s)
        for pc in own:
            assert pc.start % blk == 0 and pc.end % blk == 0, (s, k, pc)
        # each k-row block (and each of its elements' first/last) maps to exactly one rank
        for b in range(s[0] // k):
            lo, hi = b * blk, (b + 1) * blk - 1
            r_lo = [pc.rank for pc in own if pc.start <= lo < pc.end]
            r_hi = [pc.rank for pc in own if pc.start <= hi < pc.end]
            assert len(r_lo) == 1 and r_lo == r_hi, (s, k, b, own)


@SETTINGS
@given(case_st(policies=["tensor"]))
def test_tensor_keeps_params_whole(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    for i, s in enumerate(shapes):
        own = lay.owners(i)
        assert len(own) == 1
        assert own[0].start == 0 and own[0].end == numel_of(s)


# --------------------------------------------------------------------------------------------
# even
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case_st(policies=["even"]))
def test_even_layout(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    total = sum(numel_of(s) for s in shapes)
    S = -(-total // n)
    assert lay.shard_size == S
    assert lay.order == tuple(range(len(shapes)))
    assert lay.bounds == tuple(min(r * S, total) for r in range(n + 1))
    # packed element x of rank r sits at packed position r*S + shard_offset; gathered == packed
    packed = 0
    for i, s in enumerate(shapes):
        for pc in lay.owners(i):
            assert pc.rank * S + pc.shard_offset == packed + pc.start
            assert pc.rank == (packed + pc.start) // S
        assert lay.gathered_offsets[i] == packed
        packed += numel_of(s)
    assert lay.padding == n * S - total
    assert lay.padding < n  # padding only at the end, less than one element per rank


# --------------------------------------------------------------------------------------------
# optimality of contiguous policies (brute force over allowed cut points)
# --------------------------------------------------------------------------------------------


@SMALL_SETTINGS
@given(case_st(policies=CONTIGUOUS, max_params=5, max_dim=6, max_n=5))
def test_contiguous_shard_size_is_optimal(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    cuts = set(allowed_cuts(shapes, policy))
    assert all(b in cuts for b in lay.bounds), (lay.bounds, sorted(cuts))
    assert lay.shard_size == brute_min_capacity(shapes, n, policy)


@SMALL_SETTINGS
@given(case_st(policies=["row", "block(1)", "block(4)"], max_params=4, max_dim=5, max_n=4))
def test_contiguous_optimality_by_enumeration(case):
    shapes, n, policy = case
    cuts = allowed_cuts(shapes, policy)
    if math.comb(len(cuts) + n - 2, max(n - 1, 0)) > 20000:
        return
    lay = layout_of(shapes, n, policy)
    assert lay.shard_size == enumerate_min_capacity(shapes, n, policy)


@SETTINGS
@given(case_st(policies=CONTIGUOUS))
def test_contiguous_lower_bounds_and_cut_points(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    total = sum(numel_of(s) for s in shapes)
    assert lay.shard_size >= -(-total // n)
    assert lay.shard_size >= max(atom_of(s, policy) for s in shapes)
    cuts = set(allowed_cuts(shapes, policy))
    assert all(b in cuts for b in lay.bounds)


# --------------------------------------------------------------------------------------------
# tensor (LPT)
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case_st(policies=["tensor"]))
def test_tensor_matches_lpt(case):
    shapes, n, policy = case
    lay = layout_of(shapes, n, policy)
    numels = [numel_of(s) for s in shapes]
    expected = lpt(numels, n)
    got = [sorted(pc.param for pc in lay.local_pieces(r)) for r in range(n)]
    assert got == [sorted(a) for a in expected]
    loads = [sum(numels[i] for i in a) for a in expected]
    assert list(lay.rank_lengths) == loads
    assert lay.shard_size == max(loads)
    assert all(L <= lay.shard_size for L in loads)
    # each rank's params are packed in their original order
    for r in range(n):
        params = [pc.param for pc in lay.local_pieces(r)]
        assert params == sorted(params)
    # LPT guarantee: max load <= average + largest param
    assert lay.shard_size <= sum(numels) / n + max(numels)


@SETTINGS
@given(
    st.lists(st.integers(1, 12), min_size=0, max_size=3).map(tuple),
    st.integers(1, 9),
    st.integers(1, 9),
)
def test_tensor_equal_sizes_balanced(shape, count, n):
    shapes = [shape] * count
    lay = layout_of(shapes, n, "tensor")
    m = numel_of(shape)
    counts = [len(lay.local_pieces(r)) for r in range(n)]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == count
    assert max(lay.rank_lengths) - min(lay.rank_lengths) <= m
    assert lay.shard_size == m * -(-count // n)
    # round robin: param i on rank i % n
    for i in range(count):
        assert lay.owners(i)[0].rank == i % n


# --------------------------------------------------------------------------------------------
# empty shards
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_single_element_over_four_ranks(policy):
    lay = compute_layout([(1,)], 4, policy)
    assert lay.shard_size == 1
    assert lay.rank_lengths == (1, 0, 0, 0)
    assert lay.padding == 3
    assert lay.owners(0) == [Piece(0, 0, 0, 1, 0)]
    for r in (1, 2, 3):
        pc = lay.piece(0, r)
        assert pc.numel == 0 and pc.start == pc.end and pc.rank == r
        assert lay.local_pieces(r) == []
    assert lay.gathered_offsets == (0,)


@pytest.mark.parametrize("policy", ["tensor", "block(4)", "row"])
def test_empty_shards_with_more_ranks_than_atoms(policy):
    # two whole-on-one-rank atoms over 5 ranks: 3 ranks get nothing
    shapes = [(4, 3), (4, 3)] if policy != "row" else [(1, 3), (1, 3)]
    lay = compute_layout(shapes, 5, policy)
    assert lay.shard_size == 12 if policy != "row" else 3
    assert sorted(lay.rank_lengths) == [0, 0, 0, lay.shard_size, lay.shard_size]
    empty = [r for r in range(5) if lay.rank_lengths[r] == 0]
    for r in empty:
        assert lay.local_pieces(r) == []
        for i in range(2):
            assert lay.piece(i, r).numel == 0


# --------------------------------------------------------------------------------------------
# concrete, hand-checked examples
# --------------------------------------------------------------------------------------------

EX = [(32, 13), (32,), (1,), (64, 32)]  # numels 416, 32, 1, 2048; total 2497


def _pieces(lay, r):
    return [(p.param, p.start, p.end, p.shard_offset) for p in lay.local_pieces(r)]


def test_example_even():
    lay = compute_layout(EX, 3, "even")
    assert lay.shard_size == 833 and lay.bounds == (0, 833, 1666, 2497)
    assert lay.padding == 2
    assert _pieces(lay, 0) == [(0, 0, 416, 0), (1, 0, 32, 416), (2, 0, 1, 448), (3, 0, 384, 449)]
    assert _pieces(lay, 1) == [(3, 384, 1217, 0)]
    assert _pieces(lay, 2) == [(3, 1217, 2048, 0)]
    assert lay.gathered_offsets == (0, 416, 448, 449)


@pytest.mark.parametrize("policy", ["row", "block(1)"])
def test_example_row(policy):
    # 833 (the even lower bound) is feasible: 449 + 12*32 = 833, then 449 + 38*32 = 1665
    lay = compute_layout(EX, 3, policy)
    assert lay.shard_size == 833 and lay.bounds == (0, 833, 1665, 2497)
    assert lay.rank_lengths == (833, 832, 832)
    assert lay.padding == 2
    assert _pieces(lay, 1) == [(3, 384, 1216, 0)]
    assert _pieces(lay, 2) == [(3, 1216, 2048, 0)]
    # param 3 spans rank 0 (full) -> rank 1 (not full) -> rank 2: not contiguous when gathered
    assert lay.gathered_offsets == (0, 416, 448, None)


def test_example_block4():
    # blocks of 4*32 = 128 in param 3; best is 449+3*128 = 833 | 7 blocks = 896 | 6 blocks = 768
    lay = compute_layout(EX, 3, "block(4)")
    assert lay.shard_size == 896 and lay.bounds == (0, 833, 1729, 2497)
    assert lay.padding == 3 * 896 - 2497 == 191
    assert _pieces(lay, 0)[-1] == (3, 0, 384, 449)
    assert _pieces(lay, 1) == [(3, 384, 1280, 0)]
    assert _pieces(lay, 2) == [(3, 1280, 2048, 0)]
    assert lay.gathered_offsets == (0, 416, 448, None)


def test_example_block32():
    # param 0 (32 rows) is one block of 416, params 1-2 are 1-d (whole), param 3 is 2 blocks of 1024
    lay = compute_layout(EX, 3, "block(32)")
    assert lay.shard_size == 1024 and lay.bounds == (0, 449, 1473, 2497)
    assert lay.padding == 3 * 1024 - 2497 == 575
    assert _pieces(lay, 0) == [(0, 0, 416, 0), (1, 0, 32, 416), (2, 0, 1, 448)]
    assert _pieces(lay, 1) == [(3, 0, 1024, 0)]
    assert _pieces(lay, 2) == [(3, 1024, 2048, 0)]
    assert lay.gathered_offsets == (0, 416, 448, 1024)


def test_example_tensor():
    # LPT: 2048 -> r0, 416 -> r1, 32 -> r2, 1 -> r2 (33 < 416)
    lay = compute_layout(EX, 3, "tensor")
    assert lay.order == (3, 0, 1, 2)
    assert lay.bounds == (0, 2048, 2464, 2497) and lay.shard_size == 2048
    assert lay.padding == 3 * 2048 - 2497
    assert _pieces(lay, 0) == [(3, 0, 2048, 0)]
    assert _pieces(lay, 1) == [(0, 0, 416, 0)]
    assert _pieces(lay, 2) == [(1, 0, 32, 0), (2, 0, 1, 32)]
    # param 3 at rank 0, param 0 at rank 1 (1*2048), params 1, 2 at rank 2 (2*2048, +32)
    assert lay.gathered_offsets == (2048, 4096, 4128, 0)


def test_example_single_rank():
    for policy in POLICIES:
        lay = compute_layout(EX, 1, policy)
        assert lay.shard_size == 2497 and lay.padding == 0 and lay.rank_lengths == (2497,)


def test_scalar_and_1d_under_block_never_split():
    # 70 + 1 + 1 elements over 3 ranks: even would split the (70,) param, block(4) must not
    lay = compute_layout([(70,), (), (1,)], 3, "block(4)")
    assert lay.shard_size == 70 and lay.bounds[1] == 70
    assert lay.owners(0) == [Piece(0, 0, 0, 70, 0)]
    lay = compute_layout([(70,), (), (1,)], 3, "even")
    assert lay.shard_size == 24


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["bogus", "block(0)", "block(x)", "block()", "block(-1)", 3, None, ""])
def test_parse_policy_rejects(spec):
    with pytest.raises(ValueError):
        parse_policy(spec)


def test_parse_policy_accepts():
    assert parse_policy("even") == Policy("even")
    assert parse_policy("row") == Policy("row")
    assert parse_policy("tensor") == Policy("tensor")
    assert parse_policy("block(32)") == Policy("block", 32)
    assert str(parse_policy("block(32)")) == "block(32)"
    p = Policy("block", 4)
    assert parse_policy(p) is p


def test_block_rows_not_multiple_names_param():
    with pytest.raises(ValueError, match="decoder.layers.0.fc1.weight"):
        compute_layout([(64, 4), (33, 4)], 2, "block(32)", names=["ok.weight", "decoder.layers.0.fc1.weight"])
    with pytest.raises(ValueError, match="param1"):
        compute_layout([(64, 4), (33, 4)], 2, "block(32)")
    # a 1-d param with 33 elements is fine (kept whole)
    compute_layout([(33,)], 2, "block(32)")


@pytest.mark.parametrize("n", [0, -1])
def test_group_size_must_be_positive(n):
    with pytest.raises(ValueError):
        compute_layout([(4, 4)], n, "even")


def test_compute_layout_rejects_bad_policy():
    with pytest.raises(ValueError):
        compute_layout([(4, 4)], 2, "bogus")

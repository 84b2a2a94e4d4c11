"""The runtime's collectives: ``rank0_decides`` (one answer, or one error, for every rank) and the
gather / reduce collectives (bitwise the rank-order result on any world and size)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mfsdp_core import collectives as C
from mfsdp_core.collectives import rank0_decides


def _pid_and_rank() -> tuple[int, int]:
    return os.getpid(), dist.get_rank()


def _fails_on_rank0(path: str) -> None:
    raise FileNotFoundError(f"{path}: rank {dist.get_rank()} looked")


def _decide() -> dict:
    decided = rank0_decides(_pid_and_rank)
    try:
        rank0_decides(_fails_on_rank0, "/somewhere")
        error = None
    except FileNotFoundError as e:
        error = str(e)
    return {"decided": decided, "mine": os.getpid(), "error": error}


def test_every_rank_gets_rank0s_result_and_rank0s_error(ranks):
    out = ranks(_decide, 3, timeout=60)
    assert [r["decided"] for r in out] == [(out[0]["mine"], 0)] * 3
    assert len({r["mine"] for r in out}) == 3  # three processes, one decision
    assert [r["error"] for r in out] == ["/somewhere: rank 0 looked"] * 3


def test_without_a_process_group_it_is_a_plain_call():
    assert rank0_decides(sum, [1, 2, 3]) == 6


# ---- the runtime's gather / reduce collectives: exact on odd and uneven sizes ------------------


def _rank_tensor(rank: int, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=gen)


def _collectives(sizes: list[int]) -> dict:
    """For each size: all_gather of a rank's shard, reduce_scatter_avg of a rank's full tensor
    and all_reduce_avg of it, two of each issued at once (async) before either is waited for."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict = {"gather": [], "scatter": [], "reduce": []}
    for size in sizes:
        shards = [_rank_tensor(rank, size, s) for s in (1, 2)]
        gathered = [torch.empty(n * size) for _ in shards]
        pending = [
            C.all_gather(g, sh, None if n == 1 else dist.group.WORLD, async_op=True) for g, sh in zip(gathered, shards)
        ]
        for p in reversed(pending):  # waiting out of order is allowed
            p.wait()
        out["gather"].append(gathered)

        fulls = [_rank_tensor(rank, n * size, s) for s in (3, 4)]
        outs = [torch.empty(size) for _ in fulls]
        scratch = [torch.empty(C.reduce_scatter_scratch_numel(f, dist.group.WORLD)) for f in fulls]
        pending = [
            C.reduce_scatter_avg(o, f, dist.group.WORLD, async_op=True, scratch=sc)
            for o, f, sc in zip(outs, fulls, scratch)
        ]
        for p in pending:
            p.wait()
        out["scatter"].append(outs)

        tensors = [_rank_tensor(rank, size * n + n - 1, s) for s in (5, 6)]  # not a multiple of n
        pending = [C.all_reduce_avg(t, dist.group.WORLD, 3, async_op=True) for t in tensors]
        for p in pending:
            p.wait()
        out["reduce"].append(tensors)
    return out


def _reference(n: int, sizes: list[int]) -> dict:
    """What every rank must hold: concatenation in rank order, sums in rank order."""

    def rank_order_sum(seed: int, numel: int) -> torch.Tensor:
        total = _rank_tensor(0, numel, seed).clone()
        for r in range(1, n):
            total = total + _rank_tensor(r, numel, seed)
        return total

    ref: dict = {"gather": [], "scatter": [], "reduce": []}
    for size in sizes:
        ref["gather"].append([torch.cat([_rank_tensor(r, size, s) for r in range(n)]) for s in (1, 2)])
        ref["scatter"].append([rank_order_sum(s, n * size) / n for s in (3, 4)])
        ref["reduce"].append([rank_order_sum(s, size * n + n - 1) / 3 for s in (5, 6)])
    return ref


@pytest.mark.parametrize("world", [2, 3, 5])
def test_gather_reduce_scatter_and_all_reduce_are_bitwise_rank_order_on_uneven_sizes(ranks, world):
    sizes = [0, 1, 7, 1000]  # 0: empty shards; 1 with n - 1 padding: empty all-reduce chunks
    out = ranks(_collectives, world, sizes, timeout=120)
    ref = _reference(world, sizes)
    for rank, got in enumerate(out):
        for k, size in enumerate(sizes):
            for a, b in zip(got["gather"][k], ref["gather"][k]):
                assert torch.equal(a, b), (rank, size, "all_gather")
            for a, b in zip(got["scatter"][k], ref["scatter"][k]):
                assert torch.equal(a, b[rank * size : (rank + 1) * size]), (rank, size, "reduce_scatter")
            for a, b in zip(got["reduce"][k], ref["reduce"][k]):
                assert torch.equal(a, b), (rank, size, "all_reduce")


def _reduce_from_parts(size: int) -> dict:
    """The reduce-scatter of a flat tensor given whole and given as parts that cross the chunk
    boundaries, with runs of zeros given as counts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    full = _rank_tensor(rank, n * size, 7)
    cuts = sorted({0, n * size, *(k * size + 1 for k in range(n)), size // 2, n * size - 3})
    cuts = [c for c in cuts if 0 <= c <= n * size]
    zeros = set(range(1, len(cuts) - 1, 3))  # every third part is zeros, the same on every rank
    for k in zeros:
        full[cuts[k] : cuts[k + 1]] = 0
    parts = [cuts[k + 1] - cuts[k] if k in zeros else full[cuts[k] : cuts[k + 1]] for k in range(len(cuts) - 1)]
    whole, from_parts = torch.empty(size), torch.full((size,), float("nan"))
    C.reduce_scatter_avg(whole, full, dist.group.WORLD)
    assert C.reduces_from_parts(whole, dist.group.WORLD)
    C.reduce_scatter_avg(from_parts, parts, dist.group.WORLD, async_op=True).wait()
    return {"whole": whole, "parts": from_parts}


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_from_parts_equals_the_whole_tensors(ranks, world):
    for r in ranks(_reduce_from_parts, world, 10, timeout=60):
        assert torch.equal(r["parts"], r["whole"])


def _reduce_from_small_parts(size: int, part: int, trailing_zeros: int) -> dict:
    """A reduce-scatter from many small parts (a small model's gradients), counting the messages
    this rank posts."""
    from mfsdp_core import p2p

    rank, n = dist.get_rank(), dist.get_world_size()
    full = _rank_tensor(rank, n * size, 11)
    used = size - trailing_zeros  # each rank's chunk: gradients, then its padding
    parts: list = []
    for k in range(n):
        full[k * size + used : (k + 1) * size] = 0
        parts += [full[k * size + a : k * size + min(a + part, used)] for a in range(0, used, part)]
        if trailing_zeros:
            parts.append(trailing_zeros)
    whole, packed = torch.empty(size), torch.full((size,), float("nan"))
    C.reduce_scatter_avg(whole, full, dist.group.WORLD)
    posted = {"send": 0, "recv": 0}
    isend, irecv = dist.isend, dist.irecv

    def count(name, fn):
        def counted(*a, **k):
            posted[name] += 1
            return fn(*a, **k)

        return counted

    dist.isend, dist.irecv = count("send", isend), count("recv", irecv)
    try:
        C.reduce_scatter_avg(packed, parts, dist.group.WORLD, async_op=True).wait()
    finally:
        dist.isend, dist.irecv = isend, irecv
    return {"whole": whole, "packed": packed, "posted": posted, "limit": p2p.PACK_BYTES}


@pytest.mark.parametrize("world", [2, 3])
def test_a_chunk_of_small_gradients_travels_as_one_message_and_sums_bitwise_the_same(ranks, world):
    """Many small parts: one message per peer each way (not one per part), and the result is
    bitwise the reduce-scatter of the whole tensor; also with padding after each chunk's parts."""
    for trailing in (0, 3):
        for r in ranks(_reduce_from_small_parts, world, 40, 4, trailing, timeout=60):
            assert torch.equal(r["packed"], r["whole"])
            assert r["posted"] == {"send": world - 1, "recv": world - 1}, r["posted"]


def test_large_chunks_and_gapped_chunks_are_not_packed():
    """Packing is decided from the chunk's lengths alone (the same on every rank): a chunk over
    ``PACK_BYTES``, a chunk with zeros between its gradients and a one-segment chunk travel as
    they lie."""
    from mfsdp_core import p2p

    big = p2p.PACK_BYTES // 4  # float32 elements in the limit
    t = torch.zeros(big + 8)
    assert p2p._packed([(0, 4, t[:4]), (4, 4, t[4:8])])
    assert not p2p._packed([(0, big, t[:big]), (big, 8, t[big : big + 8])])
    assert not p2p._packed([(0, 4, t[:4]), (4, 2, None), (6, 4, t[4:8])])
    assert not p2p._packed([(0, 4, t[:4]), (4, 2, None)])
    assert p2p._landing([(0, 4, t[:4]), (4, 4, t[4:8]), (8, 2, None)]) == [(0, 8)]
    assert [m.numel() for m in p2p._message([(0, 4, t[:4]), (4, 4, t[4:8])])] == [8]

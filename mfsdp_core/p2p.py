"""The runtime's all-gather, reduce-scatter and all-reduce as point-to-point exchanges, for CPU
tensors on gloo.

gloo's own collectives on CPU stage through temporaries: its all-gather receives into a flat
tensor and copies it out, its all-to-all copies a rank's own chunk to itself. Here every message
goes straight from where it lies to where it lands (except a reduce-scatter's chunk made of
several small gradients, which travels as one message: see :data:`PACK_BYTES`): a rank sends its
shard (or its chunk of each other rank's share) with ``isend`` and receives each other rank's
with ``irecv`` into place. The
bytes on the wire are those of the ring algorithms. Measured on the development VM (2 and 4
ranks, 17-100 MB per rank): the all-gather takes 0.27-0.35x the time of gloo's, the reduce-scatter
(exchange and sum) 0.74-0.85x that of gloo's all-to-all and the same sum.

A reduce-scatter may take its input as *parts*: the consecutive pieces of the flat tensor (the
gradients of a buffer's parameters, as autograd made them) instead of one tensor, so that the
gradients are sent from where they lie rather than first copied into one staging tensor. Every
rank must give parts of the same lengths in the same order (the layout is the same everywhere).

Messages travel on their own tag. Every rank issues its collectives in the same order and gloo
matches the messages of one tag between two ranks in the order they were posted, so several
collectives may be in flight at once. Sums are taken in rank order, whatever order the messages
arrive in: the results are bitwise those of a single-process rank-order sum.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist

from mfsdp_core.pending import DONE, AllWorks, Pending

__all__ = ["Part", "applies", "all_gather", "reduce_scatter", "all_reduce", "scratch_numel"]

#: a piece of a flat tensor: a 1-D tensor, or a number of elements that are all zero (padding)
Part = Union[torch.Tensor, int]

_TAG = 0x6D66


def applies(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``t``'s collectives over ``group`` are point-to-point exchanges (CPU and gloo)."""
    return t.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def scratch_numel(numel: int, n: int) -> int:
    """Elements a reduce-scatter of ``numel`` elements over ``n`` ranks receives into: every
    other rank's contribution to this rank's chunk."""
    return numel // n * (n - 1)


def _peers(rank: int, n: int) -> list[int]:
    """The other ranks, starting after ``rank``: rank r sends first to r+1 and receives first
    from r-1, so that the first messages of all ranks pair up."""
    return [(rank + k) % n for k in range(1, n)]


def _exchange(
    sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group: dist.ProcessGroup
) -> Pending:
    """Send each ``(group rank, tensor)`` of ``sends`` and receive each of ``recvs``, all in
    flight at once; empty tensors travel not at all (every rank's are empty alike)."""
    works = [dist.isend(t, group_dst=peer, group=group, tag=_TAG) for peer, t in sends if t.numel()]
    works += [dist.irecv(t, group_src=peer, group=group, tag=_TAG) for peer, t in recvs if t.numel()]
    return Pending(AllWorks(works))


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """Issue the all-gather of every rank's ``shard`` (equal sizes) into ``output``."""
    n, rank, size = dist.get_world_size(group), dist.get_rank(group), shard.numel()
    mine = output[rank * size : (rank + 1) * size]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)
    peers = _peers(rank, n)
    return _exchange(
        [(peer, shard) for peer in peers], [(peer, output[peer * size : (peer + 1) * size]) for peer in peers], group
    )


def _chunks(parts: Sequence[Part], n: int, size: int) -> list[list[tuple[int, int, torch.Tensor | None]]]:
    """``parts`` (together ``n * size`` elements) cut at every multiple of ``size``: per chunk,
    its segments ``(offset in the chunk, length, tensor or None for zeros)``."""
    chunks: list[list[tuple[int, int, torch.Tensor | None]]] = [[] for _ in range(n)]
    pos = 0
    for part in parts:
        length = part if isinstance(part, int) else part.numel()
        taken = 0
        while taken < length:
            k, offset = divmod(pos, size)
            step = min(length - taken, size - offset)
            chunks[k].append((offset, step, None if isinstance(part, int) else part[taken : taken + step]))
            taken += step
            pos += step
    if pos != n * size:
        raise ValueError(f"reduce-scatter: the parts hold {pos} elements, not {n} x {size}")
    return chunks


#: a chunk whose gradient segments together hold at most this many bytes travels as one message
#: (its segments copied into one tensor) instead of one message per segment. On the development
#: VM each message posted costs 0.06-0.14 ms; copying 8 segments into one tensor costs 0.003 ms
#: at 16 KiB and 0.06 ms at 1 MiB (one thread), so up to here the copy costs at most about one
#: message; beyond it the copy grows with the bytes while the messages saved do not
PACK_BYTES = 1 << 20


def _packed(chunk: list[tuple[int, int, torch.Tensor | None]]) -> bool:
    """Whether ``chunk`` travels as one message: several segments, small together, lying end to
    end from its start (zeros only after them). Decided from lengths alone, so the sender and
    the receiver decide alike (every rank cuts the same parts)."""
    segs = [(off, length, seg) for off, length, seg in chunk if seg is not None]
    if len(segs) < 2:
        return False
    end = 0
    for off, length, _ in segs:
        if off != end:
            return False
        end += length
    return end * segs[0][2].element_size() <= PACK_BYTES


def _message(chunk: list[tuple[int, int, torch.Tensor | None]]) -> list[torch.Tensor]:
    """What a sender sends of ``chunk``: its segments, or one tensor of them (:func:`_packed`)."""
    segs = [seg for _, _, seg in chunk if seg is not None]
    return [torch.cat(segs)] if _packed(chunk) else segs


def _landing(chunk: list[tuple[int, int, torch.Tensor | None]]) -> list[tuple[int, int]]:
    """Where the messages of ``chunk`` land in a receive slot: ``(offset, length)`` each."""
    segs = [(off, length) for off, length, seg in chunk if seg is not None]
    return [(0, sum(length for _, length in segs))] if _packed(chunk) else segs


def reduce_scatter(
    output: torch.Tensor,
    parts: Sequence[Part],
    group: dist.ProcessGroup,
    divisor: int,
    received: torch.Tensor | None = None,
) -> Pending:
    """Issue the exchange of a reduce-scatter whose input is the concatenation of ``parts``;
    the handle's ``wait()`` sums the chunks in rank order into ``output`` and divides them by
    ``divisor``. This rank's own chunk is read where it lies; the others' contributions arrive
    in ``received`` (:func:`scratch_numel` elements; allocated if None)."""
    n, rank, size = dist.get_world_size(group), dist.get_rank(group), output.numel()
    if size == 0:
        return DONE
    chunks = _chunks(parts, n, size)
    if received is None:
        received = output.new_empty(scratch_numel(n * size, n))
    peers = _peers(rank, n)
    slots = dict(zip(peers, received[: (n - 1) * size].view(n - 1, size)))
    mine = chunks[rank]
    sends = [(peer, seg) for peer in peers for seg in _message(chunks[peer])]
    recvs = [(peer, slots[peer][off : off + length]) for peer in peers for off, length in _landing(mine)]
    exchange = _exchange(sends, recvs, group)

    def sum_in_rank_order() -> None:
        exchange.wait()
        for off, length, seg in mine:
            out = output[off : off + length]
            if seg is None:  # zeros everywhere
                out.zero_()
                continue
            terms = [seg if r == rank else slots[r][off : off + length] for r in range(n)]
            torch.add(terms[0], terms[1], out=out)
            for term in terms[2:]:
                out.add_(term)
            if divisor != 1:
                out.div_(divisor)

    return Pending(None, sum_in_rank_order)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, divisor: int) -> Pending:
    """The all-reduce of a 1-D ``tensor``, in place: rank k sums (rank order) and divides chunk
    k of ``ceil(numel / n)`` elements (the last ones shorter, or empty), then sends it to every
    other rank. No padded copy; the reduce-scatter half is in flight on return."""
    n, rank, total = dist.get_world_size(group), dist.get_rank(group), tensor.numel()
    step = -(-total // n)
    chunks = [tensor[min(k * step, total) : min((k + 1) * step, total)] for k in range(n)]
    mine, peers = chunks[rank], _peers(rank, n)
    slots = list(tensor.new_empty((n - 1) * mine.numel()).view(n - 1, -1))
    exchange = _exchange([(peer, chunks[peer]) for peer in peers], list(zip(peers, slots)), group)
    parts = {rank: mine, **dict(zip(peers, slots))}

    def sum_then_share() -> None:
        exchange.wait()
        _sum_into(mine, rank, [parts[r] for r in range(n)])
        if divisor != 1:
            mine.div_(divisor)
        _exchange([(peer, mine) for peer in peers], [(peer, chunks[peer]) for peer in peers], group).wait()

    return Pending(None, sum_then_share)


def _sum_into(out: torch.Tensor, at: int, parts: list[torch.Tensor]) -> None:
    """``out`` := ``parts[0] + parts[1] + ...`` added in that order, where ``out`` is
    ``parts[at]`` itself (so it is read before it is written)."""
    if at <= 1:
        torch.add(parts[0], parts[1], out=out)
    else:
        acc = torch.add(parts[0], parts[1])
        for part in parts[2:at]:
            acc.add_(part)
        torch.add(acc, out, out=out)
    for part in parts[max(at, 1) + 1 :]:
        out.add_(part)

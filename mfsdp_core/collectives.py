"""The collectives the runtime uses, with a byte counter.

Reductions are **deterministic**: a reduce-scatter sends each rank its chunk of every other
rank's tensor (an all-to-all) and sums the chunks in rank order (0, 1, …, n-1), then divides by n.
It moves the same bytes as a ring reduce-scatter, but its result does not depend on the backend's
ring or tree order, so a run is bitwise reproducible and a single-process reference can reproduce
it exactly. An all-reduce is that reduce-scatter followed by an all-gather (the same volume as a
ring all-reduce).

On gloo (CPU tensors) the all-gather and the reduce-scatter's exchange are point-to-point sends
and receives straight into place (:mod:`mfsdp_core.p2p`); elsewhere the backend's
``all_gather_single`` and ``all_to_all_single``.

gloo has no fp8 collectives, so fp8 / e8m0 payloads travel as ``uint8`` views.

The counter records *logical* operations (``all_gather``, ``reduce_scatter``, ``all_reduce``) with
the bytes of the full (unsharded) tensor each one covers on this rank, and ``all_to_all`` (token
dispatch) with the bytes this rank sends, its own rows included; ``all_to_all_counts`` is the
small exchange of row counts before it. Each record names the global ranks of its group, the
buffer it serves (``label``) and when it was issued (``time.perf_counter_ns``), so that a test can
check what was launched before what.

**Asynchronous use.** ``all_gather``, ``reduce_scatter_avg`` and ``all_reduce_avg`` take
``async_op=True`` and then return a :class:`Pending`: the collective is in flight (on gloo's or
NCCL's own threads / streams) and its output may be read only after ``Pending.wait()``, which
also runs the local step that follows the exchange (the rank-order sum of a reduce-scatter). The
runtime issues them this way to overlap communication with compute (see ``fully_shard``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from mfsdp_core import p2p
from mfsdp_core.dtypes import wire_view as _wire
from mfsdp_core.pending import DONE as _DONE
from mfsdp_core.pending import Pending

__all__ = [
    "CommRecord",
    "Pending",
    "CommCounter",
    "count_comm",
    "group_size",
    "group_rank",
    "all_gather",
    "reduce_scatter_avg",
    "reduce_scatter_scratch_numel",
    "reduces_from_parts",
    "all_reduce_avg",
    "all_reduce_sum",
    "all_to_all_rows",
    "exchange_counts",
    "gather_objects",
    "rank0_decides",
    "rank_and_world",
]

T = TypeVar("T")


@dataclass(frozen=True)
class CommRecord:
    op: str
    dtype: torch.dtype
    bytes: int
    ranks: tuple[int, ...] = ()  # global ranks of the group (empty: a single rank, no group)
    label: str = ""  # what the caller says it serves (a flat buffer's first parameter)
    issued_ns: int = 0  # time.perf_counter_ns() when it was issued


@dataclass
class CommCounter:
    """Logical collectives issued while it is active (see :func:`count_comm`)."""

    records: list[CommRecord] = field(default_factory=list)

    def total_bytes(self, op: str | None = None) -> int:
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def ops(self) -> list[str]:
        return [r.op for r in self.records]


_active_counters: list[CommCounter] = []


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count the collectives issued by the runtime inside the ``with`` block."""
    counter = CommCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


def _record(op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, label: str = "") -> None:
    if not _active_counters:
        return
    ranks: tuple[int, ...] = ()
    if group is not None and dist.is_initialized():
        ranks = tuple(dist.get_process_group_ranks(group))
    record = CommRecord(op, tensor.dtype, tensor.numel() * tensor.element_size(), ranks, label, time.perf_counter_ns())
    for counter in _active_counters:
        counter.records.append(record)


def _finish(pending: Pending, async_op: bool) -> Pending:
    if not async_op:
        pending.wait()
    return pending


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 when there is no group (a single rank) or no process group at all."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
    label: str = "",
) -> Pending:
    """Concatenate every rank's ``shard`` (equal sizes) into the 1-D ``output`` (read it after
    the returned handle's ``wait()`` when ``async_op``)."""
    _record("all_gather", output, group, label)
    n = group_size(group)
    if n == 1:
        output.copy_(shard)
        return _DONE
    return _finish(_gather(_wire(output), _wire(shard), group, n), async_op)


def _gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, n: int) -> Pending:
    """Issue the all-gather of ``shard`` into ``output`` over ``group`` (n > 1 ranks)."""
    if p2p.applies(output, group):
        return p2p.all_gather(output, shard, group)
    if shard.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        shard = shard.clone()  # an input aliasing the output is not safe on every backend
    return Pending(dist.all_gather_single(output, shard, group=group, async_op=True))


def reduce_scatter_scratch_numel(output: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Elements of the ``scratch`` that :func:`reduce_scatter_avg` into ``output`` over
    ``group`` receives into (0 for a single rank)."""
    n = group_size(group)
    if n == 1:
        return 0
    full = n * output.numel()
    return p2p.scratch_numel(full, n) if p2p.applies(output, group) else full


def reduces_from_parts(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether :func:`reduce_scatter_avg` over ``group`` takes its input as parts (see
    :mod:`mfsdp_core.p2p`) for tensors like ``t``: CPU tensors on gloo, more than one rank."""
    return group_size(group) > 1 and p2p.applies(t, group)


def _reduce_scatter_avg(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    n: int,
    divisor: int,
    received: torch.Tensor | None = None,
) -> Pending:
    """Issue the exchange; the returned handle's ``wait()`` sums the received chunks."""
    if p2p.applies(full, group):
        return p2p.reduce_scatter(output, [full], group, divisor, received)
    if received is None:
        received = torch.empty_like(full)
    work = dist.all_to_all_single(received, full, group=group, async_op=True)

    def sum_in_rank_order() -> None:
        chunks = received.view(n, -1)
        torch.add(chunks[0], chunks[1], out=output)
        for chunk in chunks[2:]:  # rank order, whatever the backend's ring order
            output.add_(chunk)
        if divisor != 1:
            output.div_(divisor)

    return Pending(work, sum_in_rank_order)


def reduce_scatter_avg(
    output: torch.Tensor,
    full: torch.Tensor | list[p2p.Part],
    group: dist.ProcessGroup | None,
    divisor: int | None = None,
    *,
    async_op: bool = False,
    label: str = "",
    scratch: torch.Tensor | None = None,
) -> Pending:
    """``output`` = this rank's 1/n slice of the sum over ranks of ``full``, divided by
    ``divisor`` (default n: the average). Deterministic. With ``async_op``, ``full`` must stay
    untouched and ``output`` unread until the handle's ``wait()``. ``scratch``: a 1-D tensor of
    :func:`reduce_scatter_scratch_numel` elements to receive into (else one is allocated); free
    again after the wait. ``full`` may be given as the list of its consecutive parts (1-D
    tensors, or an int for that many zeros) where :func:`reduces_from_parts` says so."""
    if isinstance(full, list):
        numel = sum(part if isinstance(part, int) else part.numel() for part in full)
        _record("reduce_scatter", torch.empty(numel, dtype=output.dtype, device="meta"), group, label)
        if not reduces_from_parts(output, group):
            raise ValueError("reduce_scatter_avg: parts need a group of CPU tensors on gloo with more than one rank")
        return _finish(p2p.reduce_scatter(output, full, group, divisor or group_size(group), scratch), async_op)
    _record("reduce_scatter", full, group, label)
    n = group_size(group)
    divisor = divisor or n
    if n == 1:
        output.copy_(full)
        if divisor != 1:
            output.div_(divisor)
        return _DONE
    return _finish(_reduce_scatter_avg(output, full, group, n, divisor, scratch), async_op)


def all_reduce_avg(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    divisor: int | None = None,
    *,
    async_op: bool = False,
    label: str = "",
) -> Pending:
    """In place: the sum over ranks of a 1-D ``tensor`` divided by ``divisor`` (default n: the
    average). Deterministic, see module doc. With ``async_op``, the reduce-scatter half is in
    flight on return; ``wait()`` sums it and runs the all-gather half."""
    _record("all_reduce", tensor, group, label)
    n = group_size(group)
    divisor = divisor or n
    if n == 1:
        if divisor != 1:
            tensor.div_(divisor)
        return _DONE
    if p2p.applies(tensor, group):
        return _finish(p2p.all_reduce(tensor, group, divisor), async_op)
    chunk = -(-tensor.numel() // n)
    padded = tensor.new_zeros(chunk * n)
    padded[: tensor.numel()].copy_(tensor)
    mine = padded.new_empty(chunk)
    scattered = _reduce_scatter_avg(mine, padded, group, n, divisor)

    def gather_back() -> None:
        scattered.wait()
        _gather(padded, mine, group, n).wait()
        tensor.copy_(padded[: tensor.numel()])

    return _finish(Pending(None, gather_back), async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """In place sum over ``group`` of a small tensor (norms, counters); backend order.
    As everywhere here, ``group=None`` means a single rank: nothing to communicate."""
    _record("all_reduce", tensor, group)
    if dist.is_initialized() and group_size(group) > 1:
        dist.all_reduce(tensor, group=group)


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``send`` is ``[n, m]`` (n = group size): row ``j`` is what this rank will send to group
    rank ``j``. Returns ``[n, m]`` whose row ``j`` is what group rank ``j`` will send here."""
    _record("all_to_all_counts", send, group)
    if group_size(group) == 1:
        return send.clone()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=group)
    return received


def all_to_all_rows(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Send ``rows[offset_j : offset_j + send_splits[j]]`` to group rank ``j``; return the rows
    received, ``recv_splits[j]`` from each rank ``j`` in rank order. Any split may be 0."""
    _record("all_to_all", rows, group)
    if group_size(group) == 1:
        return rows.clone()
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(_wire(out), _wire(rows.contiguous()), recv_splits, send_splits, group=group)
    return out


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` outside a process group). Collective;
    between our own ranks only (pickled objects never come from a file)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def rank0_decides(fn: Callable[..., T], *args: Any, group: dist.ProcessGroup | None = None) -> T:
    """``fn(*args)`` run on rank 0 only; every rank returns its result, or raises the exception
    it raised.

    For decisions that read shared state which may change underneath (a ``latest`` pointer, whether
    a directory exists): ranks that each read it could see different answers and enter different
    collectives, and a rank that fails alone leaves the others waiting. Result and exception must
    pickle. Outside a process group, a plain call. ``group``: the group to decide over (default:
    the default group; rank 0 is global rank 0, which must belong to it).
    """
    if not dist.is_initialized():
        return fn(*args)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0, group=group)
    ok, value = box.pop()
    if ok:
        return value
    try:
        raise value
    finally:
        # the exception's traceback holds this frame: without this, frame and exception form a
        # cycle that keeps the callers' frames (and the models in their locals, with the process
        # groups those hold) alive until a garbage collection, possibly past interpreter exit
        del value

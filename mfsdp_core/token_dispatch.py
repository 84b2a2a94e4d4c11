"""Token dispatch for expert parallelism: each routed token travels to the rank holding its
expert, is processed there, and travels back; dropless (every assignment is served, however
uneven the routing).

Per MoE layer and EP group of E ranks, each holding ``N / E`` experts:

1. the ``n·k`` (token, expert) assignments of this rank are sorted by expert (stable, so by token
   within an expert, as the single-process layer visits them);
2. the per-expert counts go to every rank of the group (``exchange_counts``), so each rank knows
   how many rows it will receive, from whom, for which of its experts;
3. one ``all_to_all`` sends the rows; each local expert runs on its rows from all sources (in
   source-rank order; possibly none: an empty matmul still gives its weights a zero gradient, which
   the sharded runtime needs on every rank);
4. one ``all_to_all`` sends the outputs back, in the order they came.

The backward of each ``all_to_all`` is the ``all_to_all`` with send and receive swapped. Only
``all_to_all_single`` is used, which gloo and NCCL both have.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from mfsdp_core import collectives as C

__all__ = ["Dispatched", "dispatch_and_run"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_rows`` whose gradient goes back along the same routes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return C.all_to_all_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return C.all_to_all_rows(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


class Dispatched:
    """The result of :func:`dispatch_and_run`: each assignment's expert output, in expert order,
    with the token and top-k slot it belongs to."""

    def __init__(self, outputs: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, received: torch.Tensor) -> None:
        self.outputs = outputs  # [n·k, hidden]
        self.token = token  # [n·k]
        self.slot = slot  # [n·k]
        self.received = received  # [E, N/E]: rows each source sent for each local expert


def dispatch_and_run(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None,
    ep_rank: int,
    run_expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> Dispatched:
    """Route ``x [n, hidden]`` by ``top_idx [n, k]`` (global expert indices) to the ranks of
    ``group`` holding them, run ``run_expert(global_index, rows)`` there, and bring the outputs
    back. ``group`` is the EP group (None: one rank holds every expert)."""
    n, k = top_idx.shape
    ep = C.group_size(group)
    per_rank = num_experts // ep
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token, slot = order // k, order % k
    counts = torch.bincount(flat, minlength=num_experts).view(ep, per_rank)
    received = C.exchange_counts(counts, group)  # [source, local expert]
    send_splits = counts.sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    rows = _AllToAll.apply(x[token], send_splits, recv_splits, group)

    # rows arrive grouped by source, then by local expert; each expert wants its rows from all
    # sources together: a permutation to expert-major order and back
    starts = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)
    starts = starts.view(ep, per_rank)
    by_expert = [
        torch.arange(int(starts[s, j]), int(starts[s, j] + received[s, j])) for j in range(per_rank) for s in range(ep)
    ]
    perm = torch.cat(by_expert) if by_expert else torch.zeros(0, dtype=torch.long)
    grouped = rows[perm]
    sizes = received.sum(0).tolist()
    outputs = [run_expert(ep_rank * per_rank + j, part) for j, part in enumerate(grouped.split(sizes))]
    done = torch.cat(outputs) if outputs else grouped
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel())
    returned = _AllToAll.apply(done[back], recv_splits, send_splits, group)
    return Dispatched(returned, token, slot, received)

"""``rank0_decides``: one answer (or one error) for every rank, from rank 0."""

from __future__ import annotations

import os

import torch.distributed as dist

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

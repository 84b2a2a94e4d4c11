"""The ranks agreeing on a failure: every rank raises the same error or none does, so that no
rank goes on alone into a collective (and waits there forever) or changes its state while
another gives up. Built on :func:`mfsdp_core.collectives.gather_objects`; ``rank0_decides``
(same module) is the other way to agree, for a decision only rank 0 should make."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_core.collectives import gather_objects

__all__ = ["run_and_gather", "agreed", "dcp_failure"]

T = TypeVar("T")


def run_and_gather(check: Callable[[], T], share: Any = None) -> tuple[T | None, CheckpointError | None, list[Any]]:
    """``check()`` on this rank, then one gather of every rank's ``share`` and outcome: returns this
    rank's result, the first :class:`CheckpointError` in rank order (None when no rank failed; the
    same on every rank) and the shares in rank order. The caller decides what to raise first."""
    failure: CheckpointError | None = None
    views: list[Any] = []
    result = None
    try:
        result = check()
    except CheckpointError as e:
        failure = e
    try:
        views = gather_objects((share, failure))
        return result, next((f for _, f in views if f is not None), None), [v for v, _ in views]
    finally:
        # an exception's traceback holds this frame: break the cycle (see rank0_decides)
        failure, views = None, []


def agreed(check: Callable[[], T]) -> T:
    """``check()`` on every rank; when it raises a :class:`CheckpointError` on any rank, every rank
    raises the first one (in rank order)."""
    result, failure, _ = run_and_gather(check)
    if failure is not None:
        raise failure
    return result


def dcp_failure(e: CheckpointException, rank: int | None = None) -> BaseException:
    """The error to raise for DCP's wrapper of every rank's failure: ours (the first
    :class:`CheckpointError`) as is, else the first one in one line. ``rank``: the rank to name
    when DCP ran without a process group (it numbers that one rank 0)."""
    failures = sorted(e.failures.items())
    for _rank, (exc, _tb) in failures:
        if isinstance(exc, CheckpointError):
            return exc
    failed, (exc, _tb) = failures[0]
    return CheckpointError(f"rank {failed if rank is None else rank}: {type(exc).__name__}: {exc}")

"""Where the ranks of a job agree, with the failure rule stated once.

Every collective writer and reader agrees on failures here, one of two ways:

* **own error** (the offline tools' :class:`Job`, default): the process that failed raises its
  own error; every other process raises :class:`JobFailedElsewhere` naming it, so that a job
  reports a failure once, in the failing process's words;
* **same error** (``Job(same_error=True)``, the live ``save``; :func:`agreed`, the live ``load``
  and the asynchronous save's staging): every rank raises the same
  :class:`~mfsdp_ckpt.errors.CheckpointError`, the first failing rank's, so that whichever rank a
  trainer reports from, it reports the same line.

Either way no rank goes on alone into a collective (and waits there forever) or changes its state
while another gives up. A decision only rank 0 should make (``latest`` may move meanwhile) is
``mfsdp_core.collectives.rank0_decides``: rank 0 runs it and every rank gets its result or raises
its error. A process that dies makes the collective the others wait in fail: :class:`JobLostError`.
"""

from __future__ import annotations

import datetime
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mfsdp_ckpt.errors import CheckpointError, JobFailedElsewhere, JobLostError, one_line
from mfsdp_core.collectives import gather_objects

__all__ = [
    "JOB_TIMEOUT",
    "Job",
    "JobFailedElsewhere",
    "JobLostError",
    "shared_error",
    "run_and_gather",
    "agreed",
    "dcp_failure",
]

T = TypeVar("T")


#: how long a collective of an offline job waits (the gather waits for the slowest process's
#: share of a whole checkpoint, so far longer than the 30 minutes a training step may take)
JOB_TIMEOUT = datetime.timedelta(hours=12)


def shared_error(failure: BaseException, rank: int) -> CheckpointError:
    """``failure`` as the error every rank raises under ``same_error``: ours as it is, any other
    in one line naming the rank (a CheckpointError pickles; another exception may not)."""
    if isinstance(failure, CheckpointError):
        return failure
    return CheckpointError(f"rank {rank}: {type(failure).__name__}: {one_line(failure, first_line=True)}")


@dataclass(frozen=True)
class Job:
    """This process's place in the job: ``rank`` of ``world`` processes (``(0, 1)``: alone), the
    process ``group`` its collectives run over (None: the default group), and the failure rule:
    by default the failing process raises its own error and the others
    :class:`JobFailedElsewhere`; with ``same_error`` every process raises the first failure
    (:func:`shared_error`)."""

    rank: int = 0
    world: int = 1
    group: Any = None
    same_error: bool = False

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None, *, same_error: bool = False) -> "Job":
        """The job of ``group`` (default: the default process group), or a job of one outside any."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(group), group, same_error)
        return cls(same_error=same_error)

    def outcome(self, failure: BaseException | None) -> tuple[Any, ...] | None:
        """What this process tells the others of its failure: ``(kind, message, error)``, plain
        strings (an exception object may not pickle) and ``error``, the exception every process
        raises under ``same_error`` (else None)."""
        if failure is None:
            return None
        error = shared_error(failure, self.rank) if self.same_error else None
        return type(failure).__name__, one_line(failure, 500), error

    @property
    def main(self) -> bool:
        """Whether this is process 0: the one that commits and reports."""
        return self.rank == 0

    def owners(self, sizes: Sequence[int]) -> list[int]:
        """The process that writes each output file, from the files' sizes alone (the same on
        every process): largest first, each onto the least-loaded process (ties: the lower
        file, the lower rank), so every process gets about the same bytes."""
        loads = [(0, p) for p in range(self.world)]  # a heap of (bytes so far, rank)
        owner = [0] * len(sizes)
        for f in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            load, p = heapq.heappop(loads)
            owner[f] = p
            heapq.heappush(loads, (load + sizes[f], p))
        return owner

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """The output files (indices into ``sizes``) this process writes, in order."""
        return [f for f, p in enumerate(self.owners(sizes)) if p == self.rank]

    def _collective(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a collective); a backend failure (a dead peer, a timeout) becomes
        :class:`JobLostError`."""
        try:
            return fn()
        except (RuntimeError, ConnectionError) as e:
            raise JobLostError(
                f"process {self.rank} of {self.world}: another process of the job stopped (it failed or was "
                f"killed; torchrun's report names it): {one_line(e, 200)}"
            ) from None

    def gather_to_main(self, value: Any) -> list[Any] | None:
        """``value`` of every process, in rank order, on process 0 (None elsewhere)."""
        if self.world == 1:
            return [value]
        out: list[Any] | None = [None] * self.world if self.main else None
        self._collective(lambda: dist.gather_object(value, out, dst=0, group=self.group))
        return out

    def broadcast(self, value: Any) -> Any:
        """Process 0's ``value`` on every process."""
        if self.world == 1:
            return value
        box = [value if self.main else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def raise_outcome(self, failure: BaseException | None, failed: tuple[Any, ...] | None, what: str) -> None:
        """Raise the agreed failure ``failed`` (``(rank, kind, message, error)``; None: none):
        under ``same_error`` its ``error`` on every process; else the process that hit it raises
        ``failure``, its own, and the others :class:`JobFailedElsewhere`."""
        if failed is None:
            return
        rank, kind, message, error = failed
        if error is not None:
            raise error
        if rank == self.rank and failure is not None:
            raise failure
        raise JobFailedElsewhere(f"{what}: rank {rank} failed ({kind}: {message})", rank)

    def agree(self, failure: BaseException | None, what: str) -> None:
        """Collective: every process says whether it failed; if any did, every process raises
        (:meth:`raise_outcome`, the lowest failing rank's error)."""
        if self.world == 1:
            if failure is not None:
                raise shared_error(failure, self.rank) if self.same_error else failure
            return
        outcomes = self.gather_to_main(self.outcome(failure))
        first = None
        if outcomes is not None:
            first = next(((r, *o) for r, o in enumerate(outcomes) if o is not None), None)
        self.raise_outcome(failure, self.broadcast(first), what)

    def run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on every process, then :meth:`agree` on its failure (a refusal that every
        process reaches is then reported once, by process 0)."""
        failure: Exception | None = None
        value: Any = None
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - agreed on, then raised on every process
            failure = e
        self.agree(failure, what)
        return value

    def on_main(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on process 0; its result (which must pickle) on every process, or its
        failure: process 0 raises its own, the others :class:`JobFailedElsewhere`."""
        if self.world == 1:
            return fn(*args)
        failure: Exception | None = None
        value: Any = None
        if self.main:
            try:
                value = fn(*args)
            except Exception as e:  # noqa: BLE001 - raised below, on every process
                failure = e
        ok, value = self.broadcast((failure is None, value if failure is None else (0, *self.outcome(failure))))
        if not ok:
            self.raise_outcome(failure, value, what)
        return value


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
    return shared_error(exc, failed if rank is None else rank)

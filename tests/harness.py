"""Run a function on N real ``torch.distributed`` processes (gloo backend) from a test.

Usage::

    def _sum_ranks(n):                      # module level: the child imports it by name
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        return t

    def test_sum(ranks):                    # ``ranks`` fixture == run_ranks
        out = ranks(_sum_ranks, 3, 4)       # one return value per rank, in rank order
        assert all(torch.equal(t, torch.full((4,), 3.0)) for t in out)

Design notes (the why):

* Processes come from a ``forkserver`` context whose server pre-imports torch, dynamo, DCP and
  our packages (:data:`PRELOAD`): each rank is a fork of a process that has imported them but
  never run an op, so start-up is cheap and OpenMP (not fork-safe once used) is never forked
  mid-flight. Plain ``fork`` from a test process that already ran torch ops can deadlock;
  ``spawn`` re-imports torch per rank. Preloading more than torch cut a sample of 33 multi-rank
  tests from 105-112 s to 38 s; of the imports added, ``torch._dynamo`` (which every rank's
  first optimizer imports) took 1.27 s in a fresh process, DCP 0.04 s, our packages 0.11 s.
* ``fn``, its args and kwargs are pickled by plain :mod:`pickle` in the parent and unpickled
  inside the child's error handling, so a function the child cannot import (wrong
  ``sys.path``, a lambda, a nested function) becomes a readable rank failure rather than a
  silent child crash. Functions pickle *by reference*: ``fn`` must be a module-level
  function of an importable module (e.g. ``tests.mfsdp_core.test_x._my_rank_fn``). The
  child gets the parent's ``sys.path`` and cwd (multiprocessing sends them along).
* Each rank reports through its own pipe: ``("ok", pickle.dumps(result))`` or an error
  record with the formatted traceback. Plain pickle keeps tensors inline (not in shared
  memory that disappears with the child). A pipe that hits EOF, or a process sentinel
  that fires, without a report means the rank died (``os._exit``, segfault, OOM kill).
* The ``timeout`` keyword is the process-group timeout and the run's time budget; it is
  consumed by :func:`run_ranks`, so ``fn`` cannot take a keyword argument named ``timeout``.
* Run from a script, the script needs the ``if __name__ == "__main__":`` guard: like any
  non-fork start method, each child re-imports the parent's ``__main__`` module.
* Children are daemonic (never leaked if the parent exits), so ``fn`` cannot start
  multiprocessing children of its own (e.g. a DataLoader with workers).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable

__all__ = ["RankFailure", "run_ranks"]

#: Seconds added to ``timeout`` for the child-side start-up (importing fn's module,
#: rendezvous). The forkserver's own torch import happens before the clock starts.
STARTUP_SLACK_S: float = 10.0
#: After the first rank fails, how long the others get to report before being killed.
GRACE_S: float = 5.0
#: How long finished ranks get to exit on their own before being terminated.
EXIT_PATIENCE_S: float = 5.0


class RankFailure(AssertionError):
    """A rank raised, died without reporting, or the run timed out.

    The message's first line is a summary (``rank 1 of 3 failed: ValueError: boom``), followed
    by the full traceback of every failing rank. ``ranks`` lists the ranks that failed or never
    reported.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass
class _Failure:
    """One rank's failure as seen by the parent."""

    rank: int
    at: float  # time.monotonic() of the failure (system-wide clock), to order root cause first
    headline: str  # e.g. "rank 1 of 3 failed: ValueError: boom"
    detail: str  # full traceback, or "" for a death without report
    exitcode: int | None = None  # for a death without report


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes joined in a gloo process group.

    Returns the per-rank return values in rank order. Raises :class:`RankFailure` if any rank
    raises or dies, or if not every rank reports within ``timeout`` (+ start-up slack).
    ``fn`` must be a module-level function; args, kwargs and the return value must pickle.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_ranks: cannot pickle {fn!r} and its arguments; fn must be a module-level "
            "function (pickled by reference) and args/kwargs must be picklable"
        ) from exc

    ctx = _context()
    port = _free_port()
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    patience = 0.0  # on any failure or interrupt, stop leftovers at once
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            proc = ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                daemon=True,
                args=(rank, world_size, port, timeout, payload, writer),
            )
            procs.append(proc)
            try:
                proc.start()  # blocks until the forkserver (torch imported) has forked
            finally:
                writer.close()  # the child now holds the only write end: EOF == child gone
        deadline = time.monotonic() + timeout + STARTUP_SLACK_S
        results, failures, missing = _collect(procs, readers, deadline)
        if not failures and not missing:
            patience = EXIT_PATIENCE_S
            return [results[rank] for rank in range(world_size)]
    finally:
        _reap(procs, patience)
        for reader in readers:
            reader.close()
    raise _failure(world_size, timeout, failures, missing)


#: Modules the forkserver imports once, so that no rank pays for them again. ``torch._dynamo``
#: is imported by the first optimizer a process builds (1.3 s of CPU here, per rank).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "mfsdp_core", "mfsdp_ckpt"]


def _context() -> BaseContext:
    """The forkserver context, with :data:`PRELOAD` imported (takes effect when the server starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (small race until rank 0 binds it; acceptable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, timeout: float, payload: bytes, conn: Connection) -> None:
    """Child entry point: join the group, run fn, send one report through ``conn``."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)  # several ranks share few cores
        fn, args, kwargs = pickle.loads(payload)  # trusted: our own parent
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout),
        )
        # every rank connected before any runs fn: a rank whose fn ends at once (an expected
        # refusal) would otherwise close its connections while a slower peer still makes its own
        # (gloo's connectFullMesh then fails with "Connection closed by peer")
        dist.barrier()
        result = pickle.dumps(fn(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure of a rank goes to the parent
        # Report before tearing the group down: once this rank disconnects, its peers start
        # failing too, and the parent should see the root cause first.
        conn.send(("error", time.monotonic(), _one_line(exc), traceback.format_exc()))
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
    finally:
        conn.close()


def _one_line(exc: BaseException) -> str:
    """``ValueError: boom`` (first line only, so the summary stays one line)."""
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text.splitlines()[0]}" if text else name


def _collect(
    procs: list[BaseProcess], readers: list[Connection], deadline: float
) -> tuple[dict[int, Any], list[_Failure], list[int]]:
    """Gather reports until all ranks are in, or the deadline (shortened to ``GRACE_S`` after
    the first failure) passes. Returns (results by rank, failures, ranks that never reported)."""
    world_size = len(procs)
    pending = set(range(world_size))
    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        handles: dict[Any, int] = {}
        for rank in pending:
            handles[readers[rank]] = rank
            handles[procs[rank].sentinel] = rank
        # Short slices, so a KeyboardInterrupt delivered to another thread still lands soon.
        for handle in wait(list(handles), timeout=min(remaining, 1.0)):
            rank = handles[handle]
            if rank not in pending:
                continue  # its pipe and sentinel were both ready
            pending.discard(rank)
            report = _receive(readers[rank])
            if report is not None and report[0] == "ok":
                results[rank] = pickle.loads(report[1])  # trusted: our own child
                continue
            if report is not None:
                _, at, summary, detail = report
                headline = f"rank {rank} of {world_size} failed: {summary}"
                failure = _Failure(rank, at, headline, detail)
            else:
                procs[rank].join(2.0)  # pipe closed: the process is exiting; get its code
                code = _describe_exitcode(procs[rank].exitcode)
                headline = f"rank {rank} of {world_size} exited with code {code} without reporting"
                failure = _Failure(rank, time.monotonic(), headline, "", procs[rank].exitcode)
            if not failures:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            failures.append(failure)
    return results, failures, sorted(pending)


def _receive(reader: Connection) -> tuple | None:
    """The rank's report, or None if its pipe is closed without one (the rank died).

    Called when the pipe or the process sentinel is ready. A report is written in full before
    the child can exit, so an exited child's report is always readable here.
    """
    if reader.poll():  # a report (recv waits for all of it), or EOF
        with contextlib.suppress(EOFError, OSError):
            return reader.recv()
    return None


def _describe_exitcode(code: int | None) -> str:
    """``3``, or ``-11 (SIGSEGV)`` for a signal death."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def _failure(world_size: int, timeout: float, failures: list[_Failure], missing: list[int]) -> RankFailure:
    """Build the RankFailure: one summary line, then the details of every failing rank."""
    failed_ranks = sorted({f.rank for f in failures} | set(missing))
    if not failures:
        return RankFailure(
            f"timed out after {timeout:g}s (+{STARTUP_SLACK_S:g}s start-up slack): "
            f"rank(s) {_ranks(missing)} of {world_size} never reported; all ranks killed",
            failed_ranks,
        )
    # Root cause first: a rank that died without reporting (crash, os._exit) ranks ahead of the
    # connection errors it causes in its peers (the parent only sees a death after the fact,
    # so its timestamp cannot order it); otherwise the earliest failure comes first.
    failures = sorted(failures, key=lambda f: (bool(f.detail), f.at))
    lines = [failures[0].headline]
    lines += [f"also: {f.headline}" for f in failures[1:]]
    if missing:
        lines.append(
            f"rank(s) {_ranks(missing)} did not report within the {GRACE_S:g}s "
            "grace period after the first failure and were killed"
        )
    if any(f.exitcode == 1 and not f.detail for f in failures):
        lines.append(
            "hint: a rank that exits with code 1 before running fn usually could not "
            "import tests.harness or fn's module (check sys.path / the __main__ guard); "
            "its traceback went to stderr"
        )
    for f in failures:
        if f.detail:
            lines += ["", f"----- rank {f.rank} -----", f.detail.rstrip()]
    return RankFailure("\n".join(lines), failed_ranks)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _reap(procs: list[BaseProcess], patience: float) -> None:
    """Make sure no child outlives the call: wait up to ``patience`` s, then SIGTERM, then
    SIGKILL; join and close all. Safe to call with unstarted processes."""
    started = [p for p in procs if p.pid is not None]
    end = time.monotonic() + patience
    for p in started:
        p.join(max(0.0, end - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 2.0
    for p in started:
        p.join(max(0.0, end - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
        p.join()
        p.close()

"""The offline commands (``reshard``, ``export-hf``, ``import-hf``, ``export-mcore``, ``convert``)
as one process of a ``torchrun`` job.

When torchrun's environment names a job of several processes (``WORLD_SIZE`` > 1, with ``RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``), :func:`run_offline` joins a gloo process group (CPU only)
and runs the command, whose Python API is then collective (:mod:`mfsdp_ckpt.write.job`: each
process writes its share of the output files, process 0 commits once). What the job says, it
says once:

* Progress bars and the result (the ``wrote ...`` line, ``--json``) only from process 0; the
  other processes exit 0 once the job has committed.
* A failure is one line on stderr, from the process that hit it: the processes agree on every
  failure (inside the API, and once more here, for refusals every process reaches on its own),
  and the others exit 1 without a word.
* A process that dies (SIGKILL) or loses its peers: torchrun stops the others with SIGTERM;
  process 0 then removes the staging directory and says so in one line, the others stop
  silently, and nothing is committed. torchrun's own report follows (it names the process that
  died); nothing of ours is buried in it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Callable, Iterator, TypeVar

from .common import _Progress, _run, _run_with_progress, guard_output, import_torch

__all__ = ["job_world_size", "one_process", "run_offline", "begin"]

T = TypeVar("T")


def job_world_size() -> int:
    """The number of processes torchrun's environment names (1 outside a torchrun job)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
    needed = ("RANK", "MASTER_ADDR", "MASTER_PORT")
    return world if world > 1 and all(os.environ.get(k) for k in needed) else 1


def begin(check: Callable[[], None] | None = None, output: str | None = None, torch: bool = True) -> None:
    """A command's start: ``check()``, the refusals it makes from its arguments and local paths
    alone (one line, exit 1, as the library would say them later), answered before torch is
    imported; the destination ``output`` it writes noted (:func:`~cli.common.guard_output`: an
    interrupt after its commit is no failure); then, with ``torch``, torch, with SIGINT held back
    (:func:`~cli.common.import_torch`). In a torchrun job the library refuses instead: every
    process would say a refusal here, process 0 alone says it there."""
    if check is not None and job_world_size() == 1:
        _run(check)
    if output is not None:
        guard_output(output)
    if torch:
        import_torch()


class _Terminated(BaseException):
    """SIGTERM (torchrun stopping the job): a BaseException, so that nothing on the way up takes
    it for an error of its own; the workers stop and process 0 removes the staging directory."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Inside: the first SIGTERM raises :class:`_Terminated` in the main thread (later ones are
    ignored: the job is already on its way out)."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """The job's gloo process group, from torchrun's environment, for the duration."""
    import torch.distributed as dist

    from mfsdp_ckpt.write.agreement import JOB_TIMEOUT

    dist.init_process_group("gloo", timeout=JOB_TIMEOUT)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def one_process(command: str) -> None:
    """Refuse ``command`` (one line, inside :func:`run_offline`, so said once) when it runs as a
    job of several processes: ``upcycle`` and ``import-mcore`` are not collective."""
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.write.agreement import Job

    if Job.current().world > 1:
        raise CheckpointError(f"{command} runs in one process: start it without torchrun")


def run_offline(desc: str, fn: Callable[[_Progress], T], unit: str = "B") -> T:
    """``_run_with_progress(desc, fn, unit)`` (the one-line error boundary and progress bar), as
    one process of a torchrun job when the environment names one (:func:`job_world_size`): the
    result is returned on process 0 only; the other processes exit here (0 once the job
    committed, 1 after a failure, which the process that hit it reports)."""
    if job_world_size() == 1:
        return _run_with_progress(desc, fn, unit)
    rank = int(os.environ["RANK"])

    def in_job(bar: _Progress) -> T:
        if rank != 0:
            bar.enabled = False  # one progress bar: process 0's share
        with _process_group(), _sigterm_raises():
            result = _agreed(lambda: fn(bar), rank)
        if rank != 0:
            sys.exit(0)
        return result

    return _run_with_progress(desc, in_job, unit)


def _agreed(call: Callable[[], T], rank: int) -> T:
    """``call()``; on failure, the processes agree which one reports (see the module docstring):
    that one prints its error, and every process exits 1 once it has (a barrier: torchrun stops
    the job when the first process exits, and must not stop the reporter before it has said
    why). From the verdict on, SIGTERM is ignored: the job is already on its way out."""
    from mfsdp_ckpt.errors import JobFailedElsewhere, JobLostError
    from mfsdp_ckpt.write.agreement import Job

    job = Job.current()
    stopped = False
    try:
        result, failure = call(), None
    except _Terminated:
        result, failure, stopped = None, _terminated(), True
    except KeyboardInterrupt:  # Ctrl-C reaches every process: process 0 says "interrupted"
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank != 0:
            sys.exit(130)
        raise
    except Exception as e:  # noqa: BLE001 - agreed on below; the reporting process prints it
        result, failure = None, e
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kinds: list[int] = []
    if not stopped and not isinstance(failure, JobLostError):
        kind = 0 if failure is None else 1 if isinstance(failure, JobFailedElsewhere) else 2
        try:
            kinds = job.broadcast(job.gather_to_main(kind))
        except JobLostError as e:
            failure = e
    if not kinds:  # a process is gone: process 0 says so, the others stop
        sys.exit(_report(failure) if rank == 0 else 1)
    if max(kinds) == 0:
        return result  # type: ignore[return-value]
    reporter = kinds.index(2) if 2 in kinds else kinds.index(1)
    code = _report(failure) if rank == reporter else 1
    with contextlib.suppress(JobLostError):
        job.broadcast(None)  # the barrier: nobody exits before the reporter has printed
    sys.exit(code)


def _terminated() -> Exception:
    """The error process 0 reports when torchrun stopped it (SIGTERM), naming the command."""
    import click

    from mfsdp_ckpt.errors import CheckpointError

    ctx = click.get_current_context(silent=True)
    return CheckpointError(
        f"{ctx.info_name if ctx is not None else 'mfsdp-ckpt'} stopped by SIGTERM: another process of the job failed or was killed, and torchrun stopped the others; "
        "nothing was committed"
    )


def _report(failure: BaseException | None) -> int:
    """Print ``failure`` as the error boundary does (one line, or ``--debug``'s traceback); the
    exit code it chose."""

    def fail() -> None:
        assert failure is not None
        raise failure

    try:
        _run(fail)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 1

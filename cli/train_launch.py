"""``mfsdp-train --nproc-per-node N ...``: the trainer starts its own ranks, through the elastic
launcher torchrun uses, and reports a failed run in its ranks' own words.

Under plain ``torchrun`` a refused run prints its one-line reason and then torchrun's report of
the failed child (a traceback of some thirty lines), and Ctrl-C adds the launcher's own
traceback. Here the launcher's log is quiet below errors it does not already show, a child that
stopped with the trainer's own exit codes (1 refused, 2 usage, 130 interrupted, 143 preempted) on
rank 0 has said why, and any other failure gets one line naming the rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from .train_restarts import RestartReport, failure_cause
from .train_signals import (
    LAUNCHED_ENV,
    STOP_SAID_ENV,
    exit_interrupted,
    note_sigint,
    raise_if_sigint_noted,
    says_for_the_job,
    sigint_noted,
    with_sigint_held,
)

if TYPE_CHECKING:
    from .settings import LaunchSettings, Settings

__all__ = ["LAUNCH_DESTS", "add_launch_arguments", "launch", "unblock_sigint"]

_LAUNCH_FLAGS = {  # dest -> (torchrun's flag, help)
    "nnodes": ("--nnodes", "machines (or MIN:MAX), as torchrun's --nnodes"),
    "node_rank": ("--node-rank", "this machine's rank, as torchrun's --node-rank"),
    "rdzv_backend": ("--rdzv-backend", "rendezvous backend, as torchrun's (default: a local one)"),
    "rdzv_endpoint": ("--rdzv-endpoint", "HOST:PORT of the rendezvous, as torchrun's"),
    "rdzv_id": ("--rdzv-id", "the job's rendezvous id, as torchrun's"),
    "rdzv_conf": ("--rdzv-conf", "KEY=VALUE,... rendezvous options, as torchrun's"),
    "master_addr": ("--master-addr", "as torchrun's --master-addr (static rendezvous)"),
    "master_port": ("--master-port", "as torchrun's --master-port (static rendezvous)"),
    "max_restarts": ("--max-restarts", "restarts of the ranks after a failure, as torchrun's"),
}
LAUNCH_DESTS = frozenset({"nproc_per_node", "shutdown_timeout", *_LAUNCH_FLAGS})


def add_launch_arguments(p: argparse._ActionsContainer) -> None:
    """``--nproc-per-node`` and the flags passed on to the launcher for jobs of several machines."""
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine (the elastic launcher torchrun uses); without it the trainer "
        "runs as the one process it is, or as one rank of a torchrun job",
    )
    for dest, (flag, text) in _LAUNCH_FLAGS.items():
        p.add_argument(flag, dest=dest, default=None, help=text)
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=120,
        metavar="S",
        help="seconds the ranks have, once the launcher is signalled (SIGTERM, Ctrl-C), to save and stop "
        "before they are killed",
    )


def _torchrun_argv(launch: LaunchSettings, module: str, argv: list[str]) -> list[str]:
    words = [f"--nproc-per-node={launch.nproc_per_node}", f"--shutdown-timeout={launch.shutdown_timeout}"]
    for dest, (flag, _) in _LAUNCH_FLAGS.items():
        value = getattr(launch, dest)
        if value is not None:
            words.append(f"{flag}={value}")
    if launch.rdzv_endpoint is None and launch.master_addr is None and launch.nnodes in (None, "1"):
        words.append("--standalone")  # one machine: a free local port, a fresh rendezvous id
    return [*words, "-m", module, *argv]


def _quiet_launcher_logs() -> None:
    """The launcher's loggers (each has its own level, set when its module was imported) at
    CRITICAL: the ranks speak for themselves."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    for name in [*logging.root.manager.loggerDict, *prefixes]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(settings: Settings, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` as ``--nproc-per-node`` ranks; the run's exit code (a
    Ctrl-C ends the launcher here, through :func:`cli.train_signals.exit_interrupted`)."""
    try:
        torchrun, SignalException, ChildFailedError = with_sigint_held(_load_elastic_launcher)
        raise_if_sigint_noted()  # a Ctrl-C that torch's import swallowed
    except KeyboardInterrupt:
        exit_interrupted(say=True)
    _quiet_launcher_logs()
    _ranks_start_with_sigint_blocked()
    os.environ[LAUNCHED_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its warning
    with tempfile.TemporaryDirectory(prefix="mfsdp-train-") as tmp:
        said = os.environ[STOP_SAID_ENV] = os.path.join(tmp, "stop-said")
        restarts = RestartReport(tmp)
        restarts.install()  # --max-restarts: one line per restart
        try:
            torchrun.run(torchrun.get_args_parser().parse_args(_torchrun_argv(settings.launch, module, argv)))
            restarts.finish()
            return 0
        except ChildFailedError as e:
            restarts.finish()
            return _report_failure(settings.checkpoint.ckpt_dir, e.failures)
        except SignalException as e:  # the ranks were sent the same signal
            if e.sigval != signal.SIGINT:
                return 128 + int(e.sigval)
            say = not os.path.exists(said)  # no rank stopped in the loop to say where
        except KeyboardInterrupt:  # before the ranks started
            say = True
    exit_interrupted(say)


def _load_elastic_launcher() -> tuple[Any, type[BaseException], type[BaseException]]:
    """torchrun's entry module and the two errors a run of it ends with (imports torch)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return torchrun, SignalException, ChildFailedError


def _ranks_start_with_sigint_blocked() -> None:
    """Start each rank with SIGINT blocked (a signal mask survives exec), so that a Ctrl-C in
    its first moments, before its Python code can take it (the interpreter starting, the trainer
    module loading), waits instead of printing a traceback of the import machinery; the rank
    unblocks it first thing (:func:`unblock_sigint`), and takes it then. The launcher itself
    blocks it only while it starts a process: a Ctrl-C then is delivered to it right after.
    Wraps the elastic launcher's process start (a private method: left alone if it is gone)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    popen = getattr(handler, "_popen", None)
    if popen is None or getattr(popen, "_sigint_blocked", False):
        return

    def blocked_popen(self: Any, *a: Any, **kw: Any) -> Any:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return popen(self, *a, **kw)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    blocked_popen._sigint_blocked = True  # type: ignore[attr-defined]
    handler._popen = blocked_popen  # type: ignore[method-assign]


def unblock_sigint() -> None:
    """First thing in every process of the trainer: take SIGINT from now on, noted
    (:func:`cli.train_signals.note_sigint`) so that one swallowed by an import still stops the
    process; in a rank, one that came while it was blocked (see
    :func:`_ranks_start_with_sigint_blocked`) is raised here, as ``KeyboardInterrupt``."""
    note_sigint()
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        """An error that escapes after a Ctrl-C is the interrupt's doing (a ``KeyboardInterrupt``
        inside a class body's ``__set_name__`` comes out as ``RuntimeError``, say): the
        interrupt's one line (none from a rank of our launcher, which says it) and exit 130."""
        if not sigint_noted():
            previous(kind, value, tb)
            return
        exit_interrupted(say=says_for_the_job())

    sys.excepthook = excepthook
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _report_failure(ckpt_dir: str | None, failures: dict[int, Any]) -> int:
    """The job's exit code, with one line naming the rank that failed first
    (:func:`cli.train_restarts.failure_cause`) unless rank 0 stopped with a code of the trainer's
    own and nothing else went wrong (it has printed why, and the other ranks stopped with it)."""
    codes = {rank: f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for rank, f in failures.items()}
    cause = failure_cause(failures)
    if cause is None:
        refused = sorted(c for c in codes.values() if c in (1, 2))  # ranks refusing alike; rank 0 said why
        return refused[0] if refused else codes[0]
    rank, how = cause
    print(f"error: {how}; {resume_hint(ckpt_dir)}", file=sys.stderr, flush=True)
    return codes[rank]


def resume_hint(ckpt_dir: str | None) -> str:
    """Where the run can go on from: its latest committed checkpoint in ``ckpt_dir`` (``--ckpt-dir``;
    read with the checkpoint library, imported here: the launcher stays light until a run fails)."""
    if not ckpt_dir:
        return "no --ckpt-dir, so there is no checkpoint to resume from"
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.tools import list_checkpoints

    try:
        committed = [e for e in list_checkpoints(ckpt_dir) if e.committed]
    except (CheckpointError, OSError):
        committed = []
    if not committed:
        return f"no committed checkpoint in {ckpt_dir} yet"
    latest = next((e for e in committed if e.latest), committed[-1])
    path = os.path.join(ckpt_dir, latest.name)
    return f"resume from {path} (the same command with --resume)"

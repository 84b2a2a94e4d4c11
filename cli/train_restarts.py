"""``mfsdp-train --nproc-per-node N --max-restarts K``: one line per restart, from the launcher.

The elastic launcher restarts every rank of a machine when one fails, and says nothing of it
below its (quieted) log. Here the launcher notes each failure it restarts from (which rank, and
how it ended: the signal that killed it or its exit code) and when it saw it; the first rank of
the machine (``LOCAL_RANK`` 0) of the restarted attempt writes, once its first step is done, where
the run went on from into the file :data:`RESTART_FILE_ENV` names; the launcher then prints::

    restart 1 of 3: rank 1 was killed by SIGKILL; resumed from the memory tier at step 31, 4.2 s from the failure to the first step

A restarted attempt that fails again before its first step is said in the same line, at the
next failure; one still under way when the job ends is said then. The launcher's hooks are
wrappers of two private methods of torch's elastic agent (its monitor and its restart), left
alone when they are gone: the restarts then happen as before, without the line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from .train_signals import PEER_LOST_EXIT

__all__ = ["RESTART_FILE_ENV", "RestartReport", "failure_cause", "note_first_step"]

#: the file the first rank of each machine writes after the first step of a restarted attempt
RESTART_FILE_ENV = "MFSDP_TRAIN_RESTART_FILE"
_EXPLAINED = {1, 2, 130, 143}  # the trainer's own exit codes, which rank 0 explains itself


def failure_cause(failures: dict[int, Any]) -> tuple[int, str] | None:
    """``(rank, how)`` of the rank that caused a failed attempt (``failures``: torch's
    ``ProcessFailure`` by global rank), or None when rank 0 stopped with an exit code of the
    trainer's own and no rank failed otherwise (it has said why). A rank killed by a signal other
    than SIGTERM, or exiting with a code of no meaning to the trainer, is a cause; one killed by
    SIGTERM is one the launcher stopped once another had failed, and one that exited with the
    peer-lost code stopped because another rank died under a collective: a cause only when no rank
    of this machine is one (the one that died was elsewhere)."""
    codes = {rank: f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for rank, f in failures.items()}
    # first seen first: torch records the failed rank, stops the others (SIGTERM, then SIGKILL for
    # one still alive after its grace period) and records them too, later; a rank killed by that
    # SIGKILL is not the cause, though its exit code is the same as the victim's
    seen = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    causes = [r for r, f in seen if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    causes += [r for r, f in seen if f.exitcode > 0 and f.exitcode not in (*_EXPLAINED, PEER_LOST_EXIT)]
    if not causes and codes.get(0) in _EXPLAINED:
        return None
    rank = causes[0] if causes else min(failures)
    first = failures[rank]
    if first.exitcode < 0:
        return rank, f"rank {rank} was killed by {first.signal_name()}"
    if first.exitcode == PEER_LOST_EXIT:  # its peer was on another machine: that launcher names it
        return rank, f"rank {rank} stopped: a rank on another machine failed under a collective"
    return rank, f"rank {rank} exited with code {codes[rank]}"


def note_first_step(resumed_from: str) -> None:
    """In a rank: after the first step of an attempt the launcher restarted, the machine's first
    rank tells it where the run went on from (and when the step ended)."""
    path = os.environ.get(RESTART_FILE_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        with open(path + ".partial", "w") as f:
            json.dump({"resumed_from": resumed_from, "at": time.time()}, f)
        os.replace(path + ".partial", path)
    except OSError:
        pass  # the restart is then said without where it resumed from


class RestartReport:
    """The launcher's side: the failure each restart follows, and the one line per restart."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "restarted")
        self.failure: tuple[str, float] | None = None  # the attempt that failed last: cause, when seen
        self.pending: tuple[int, int, str, float] | None = None  # restart k of n, cause, failed at

    def install(self) -> None:
        """Wrap the elastic agent's monitor and restart (a private API: left alone if gone)."""
        try:
            from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState
            from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        except ImportError:
            return
        monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
        restart = getattr(SimpleElasticAgent, "_restart_workers", None)
        if monitor is None or restart is None or getattr(monitor, "_mfsdp_report", False):
            return
        os.environ[RESTART_FILE_ENV] = self.path
        report = self

        def monitored(agent: Any, worker_group: Any) -> Any:
            result = monitor(agent, worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and report.failure is None:
                cause = failure_cause(dict(result.failures or {}))
                report.failure = (cause[1] if cause else "rank 0 stopped", time.time())
            elif result.state == WorkerState.HEALTHY:
                report.poll()
            return result

        def restarted(agent: Any, worker_group: Any) -> Any:
            failed = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if failed and report.failure is not None:
                spec = worker_group.spec
                report.begin(spec.max_restarts - agent._remaining_restarts, spec.max_restarts)
            return restart(agent, worker_group)

        monitored._mfsdp_report = True  # type: ignore[attr-defined]
        LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
        SimpleElasticAgent._restart_workers = restarted  # type: ignore[method-assign]

    def begin(self, k: int, n: int) -> None:
        """Restart ``k`` of ``n`` is starting, after :attr:`failure`."""
        if self.pending is not None:  # the previous restart never reached a step
            self._say(f"{self._head()}; it failed again before its first step")
        assert self.failure is not None
        cause, at = self.failure
        self.pending, self.failure = (k, n, cause, at), None
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def poll(self) -> None:
        """Say the pending restart once its first rank has written where it resumed from."""
        if self.pending is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path) as f:
                said = json.load(f)
            where, at = str(said["resumed_from"]), float(said["at"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # being written: the next poll reads it
        seconds = max(at - self.pending[3], 0.0)
        self._say(f"{self._head()}; resumed from {where}, {seconds:.1f} s from the failure to the first step")

    def finish(self) -> None:
        """The job ended: a restart not yet said is said now."""
        self.poll()
        if self.pending is not None:
            self._say(f"{self._head()}; the job ended before the restarted ranks finished a step")

    def _head(self) -> str:
        assert self.pending is not None
        k, n, cause, _ = self.pending
        return f"restart {k} of {n}: {cause}"

    def _say(self, line: str) -> None:
        self.pending = None
        print(line, file=sys.stdout, flush=True)

"""Run the trainer's own code (``cli.train``'s flags parsed, then ``cli.trainer.run_rank``, what a
rank of ``mfsdp-train`` or of a torchrun job runs) on the test harness's warm ranks instead of a
torchrun job: the same functions, in processes forked from a server that has already imported
torch, DCP and our packages, inside a process group the harness joined. What only the launcher
does (its pre-flight, restarts, signals to a job, joining the group) is not exercised here; those
tests keep a real ``torchrun`` (:data:`tests.torchrun.LAUNCHER_TESTS`).

Each rank returns its exit code and what it printed, as its process would have: a usage error is
argparse's message and exit code 2, an exception escaping the trainer its traceback on stderr and
exit code 1. :func:`warm_train` gives rank 0's, as the ``subprocess.CompletedProcess`` the torchrun
helpers' callers already read.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from tests.harness import RankFailure, run_ranks

__all__ = ["read_metrics", "warm_train", "warm_train_killed"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_train(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """One rank of the trainer on ``argv`` (``env`` over its environment, the repository its
    working directory, as :func:`tests.torchrun.run_train` starts one): exit code, stdout, stderr."""
    import torch.distributed as dist

    from cli.quiet import quiet_third_party
    from cli.train_args import parse_args
    from cli.trainer import run_rank

    os.environ.update({k: v for k, v in env.items() if k not in _HARNESS_KEYS})
    os.chdir(ROOT)
    rank, world = dist.get_rank(), dist.get_world_size()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = parse_args(argv)
            quiet_third_party(args.verbose)
            # no launcher stops the other ranks once rank 0 refused: they need not wait for it
            code = run_rank(args, rank, world, refusal_grace=0.0)
        except SystemExit as e:  # argparse's usage error (2), --help (0)
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - what would end the process with a traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    return code, out.getvalue(), err.getvalue()


#: the harness's own rendezvous variables: a caller's environment (often a copy of the test
#: process's) must not replace them
_HARNESS_KEYS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})


def warm_train(world: int, *argv: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """The trainer on ``world`` warm ranks with the flags ``argv``: rank 0's exit code and output
    (``returncode``, ``stdout``, ``stderr``); a rank whose code differs from rank 0's fails the run."""
    results = run_ranks(_rank_train, world, list(argv), dict(env or {}), timeout=timeout)
    codes = {code for code, _, _ in results}
    assert len(codes) == 1, f"the ranks ended differently: {[r[0] for r in results]}\n{results}"
    code, out, err = results[0]
    return subprocess.CompletedProcess(["warm_train", str(world), *argv], code, out, err)


def read_metrics(path: str | os.PathLike) -> dict[int, dict]:
    """Step -> record of a trainer's ``--metrics`` file; a resumed run re-logs the steps after its
    checkpoint: the last record wins."""
    out: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    out[record["step"]] = record
    return out


def _die_past_step(metrics: str, step: int) -> None:
    """SIGKILL this process once ``metrics`` holds ``step`` (polled every 10 ms)."""
    while max(read_metrics(metrics), default=0) < step:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_train_killed(argv: list[str], env: dict[str, str], metrics: str, step: int) -> tuple[int, str, str]:
    """:func:`_rank_train`, with a watcher that SIGKILLs the rank once ``step`` is logged."""
    threading.Thread(target=_die_past_step, args=(metrics, step), daemon=True).start()
    return _rank_train(argv, env)


def warm_train_killed(
    world: int,
    metrics: str | os.PathLike,
    step: int,
    *argv: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> int:
    """The trainer on ``world`` warm ranks, every rank SIGKILLed once ``metrics`` (the run's
    ``--metrics`` file) holds ``step``, as a node crash would take a job; the last step logged.
    A run that ends without being killed fails the test."""
    try:
        results = run_ranks(_rank_train_killed, world, list(argv), dict(env or {}), str(metrics), step, timeout=timeout)
    except RankFailure as e:
        assert "(SIGKILL)" in str(e), e
        return max(read_metrics(metrics), default=0)
    raise AssertionError(f"the run ended before step {step} was logged: {results[0]}")

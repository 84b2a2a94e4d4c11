"""Run the trainer's own code (flags parsed and checked, then ``cli.trainer.train``) on the test
harness's warm ranks instead of a torchrun job: the same functions a rank of ``mfsdp-train`` runs
after it joined its process group, in processes forked from a server that has already imported
torch, DCP and our packages. What only the launcher does (its pre-flight, restarts, signals to a
job) is not exercised here; those tests keep a real ``torchrun``.

Each rank returns its exit code and what it printed; :func:`warm_train` gives rank 0's, as a
``subprocess.CompletedProcess`` the torchrun helpers' callers already read.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from typing import Any

from tests.harness import run_ranks

__all__ = ["warm_train"]


def _rank_train(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """One rank of the trainer on ``argv`` (``env`` added to its environment): exit code, stdout, stderr."""
    import torch.distributed as dist

    from cli.quiet import quiet_third_party
    from cli.train_args import UsageError, parse_args
    from cli.train_signals import StopRequests
    from cli.trainer import check_args, train

    os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        args = parse_args(argv)
        quiet_third_party(args.verbose)
        stops = StopRequests()
        stops.install()
        try:
            settings, source = check_args(args, world)
            code = train(settings, source, rank, world, stops)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            code = 1
        finally:
            stops.uninstall()
    return code, out.getvalue(), err.getvalue()


def warm_train(world: int, *argv: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """The trainer on ``world`` warm ranks with the flags ``argv``: rank 0's exit code and output
    (``returncode``, ``stdout``, ``stderr``); a rank whose code differs from rank 0's fails the run."""
    results = run_ranks(_rank_train, world, list(argv), dict(env or {}), timeout=timeout)
    codes = {code for code, _, _ in results}
    assert len(codes) == 1, f"the ranks ended differently: {[r[0] for r in results]}\n{results}"
    code, out, err = results[0]
    return subprocess.CompletedProcess(["warm_train", str(world), *argv], code, out, err)

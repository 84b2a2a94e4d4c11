"""Run the trainer from tests: on the harness's warm ranks (:func:`run_train`, the default), or
as users start it, ``python -m cli.train`` under ``torchrun`` or our own launcher, from the
launcher tests alone (:data:`LAUNCHER_TESTS`).

Starting a torchrun job costs a launcher and a fresh interpreter per rank, each importing torch
(2-4 s before any model); warm ranks are forks of a server that imported it once. What needs a
real launcher: its pre-flight refusals and quiet output, signals to a job, a rank that dies,
restarts (``--max-restarts``), the installed entry points and the commands the docs paste.

Two things about torchrun that tests must not get wrong:

* It starts each worker in a session of its own. Killing torchrun (even its whole process
  group) leaves the workers running as orphans that go on training and checkpointing; a test
  that "kills the job" and then resumes into the same directory races them. :func:`kill_job`
  kills the whole process tree and waits until every process is gone, as a node crash would.
* When a worker fails, torchrun appends its own long report to stderr; the worker's traceback
  comes before it. :func:`failure` keeps the workers' words and drops torchrun's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.warm_train import read_metrics, warm_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


__all__ = ["read_metrics", "run_train", "train_cmd", "warm_train"]

#: the test files that may start the trainer as a process of its own (what they test is the
#: launcher, a signal to the job, or a command as users paste it); every other trainer test runs
#: on warm ranks. tests/test_launcher_allowlist.py holds this list to the files that do.
LAUNCHER_TESTS = frozenset(
    {
        "tests/cli/test_offline_torchrun.py",
        "tests/cli/test_train_ctrl_c.py",
        "tests/cli/test_train_flows.py",
        "tests/cli/test_train_launch.py",
        "tests/cli/test_train_mem_tier.py",
        "tests/cli/test_train_mem_tier_resume.py",
        "tests/cli/test_train_quiet.py",
        "tests/cli/test_train_rank_dies.py",
        "tests/cli/test_train_restarts.py",
        "tests/cli/test_train_transformers_inputs.py",
        "tests/reliability/test_outputs_inside_inputs.py",
        "tests/reliability/test_writers.py",
        "tests/test_launcher_allowlist.py",
    }
)


def current_test_file() -> str | None:
    """The file of the test running now (pytest's ``PYTEST_CURRENT_TEST``), or None outside one."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.split("::", 1)[0] if current else None


def _check_launcher_test() -> None:
    where = current_test_file()
    if where is not None and where not in LAUNCHER_TESTS:
        raise AssertionError(
            f"{where} starts the trainer as a process of its own: run it on warm ranks (run_train), "
            "or, where the launcher is what it tests, add the file to tests/torchrun.py's LAUNCHER_TESTS"
        )


def train_cmd(nproc: int | None, *args: str) -> list[str]:
    """The command line: ``nproc`` ranks under torchrun, or one plain process for ``None`` (from a
    launcher test only: :data:`LAUNCHER_TESTS`)."""
    _check_launcher_test()
    if nproc is None:
        return [sys.executable, "-m", "cli.train", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "cli.train",
        *args,
    ]


def run_train(
    nproc: int | None, *args: str, timeout: int = 600, env: dict[str, str] | None = None, launcher: bool = False
) -> subprocess.CompletedProcess:
    """Run the trainer to its end on ``nproc`` warm ranks (one for ``None``: :func:`warm_train`),
    ``env`` over the ranks' environment; or, with ``launcher`` or ``--nproc-per-node`` among the
    flags, as a process of its own (:func:`train_cmd`) whose environment ``env`` replaces (:data:`ENV`)."""
    if not launcher and "--nproc-per-node" not in args:
        return warm_train(nproc or 1, *args, env=env, timeout=timeout)
    return subprocess.run(
        train_cmd(nproc, *args),
        cwd=ROOT,
        env=ENV if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_TORCHRUN_NOISE = ("torch/distributed/elastic/", "torch/distributed/run.py", "torch/distributed/launcher/")


def failure(run: subprocess.CompletedProcess, limit: int = 4000) -> str:
    """What a failed run said, for an assertion message: stderr without torchrun's report."""
    text = run.stderr
    cut = text.find("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    if cut >= 0:
        start = text.rfind("Traceback (most recent call last):", 0, cut)
        summary = [line for line in text[cut:].splitlines() if "exitcode" in line or "rank" in line]
        text = text[: start if start >= 0 else cut] + "\n[torchrun] " + " | ".join(s.strip() for s in summary)
    lines = [line for line in text.splitlines() if not any(n in line for n in _TORCHRUN_NOISE)]
    text = "\n".join(lines)
    if len(text) > limit:
        text = text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]
    return f"exit {run.returncode}\n{text}"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_job(proc: subprocess.Popen, patience: float = 60.0) -> None:
    """SIGKILL torchrun and every process under it, then wait until all of them are gone."""
    tree, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(_children(pid))
    for pid in reversed(tree):  # workers first, torchrun last: nothing is left to respawn them
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + patience
    while any(_alive(pid) for pid in tree[1:]):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {[p for p in tree[1:] if _alive(p)]} outlived SIGKILL")
        time.sleep(0.05)


def kill_past_step(proc: subprocess.Popen, metrics: str | os.PathLike, step: int, timeout: float = 300.0) -> int:
    """Once the job ``proc`` (started with ``start_new_session``) has logged ``step``, SIGKILL it
    and every worker (:func:`kill_job`), as a node crash would; the last step it logged."""
    deadline = time.time() + timeout
    while max(read_metrics(metrics), default=0) < step and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    kill_job(proc)
    return max(read_metrics(metrics), default=0)


def as_from_a_terminal() -> None:
    """In the child before it execs: SIGINT at its default and unblocked, as in a process a shell
    starts (a test process may have inherited, or left, it ignored or blocked; a child inherits both)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_in_own_session(cmd: list[str], cwd: str | os.PathLike, env: dict[str, str] | None) -> subprocess.Popen:
    """``cmd`` in a session of its own, as a shell starts a job (SIGINT at its default), with its
    output captured: a signal to its process group reaches it (and its workers) and nothing else."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
    )

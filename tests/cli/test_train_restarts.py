"""``mfsdp-train --nproc-per-node N --max-restarts K`` says each restart in one line of the
launcher's: which rank died and how, restart k of K, where the run went on from and how long it
took from the failure to the first step; no surviving rank prints a traceback (a rank killed
while a snapshot or its promotion to a durable save was in flight used to make the others print
a 35-line ``JobLostError`` traceback), and the run ends as the uninterrupted one does, bitwise.

The kill test is a real launcher job (the launcher is what is tested); the uninterrupted run it
is compared with runs on the harness's warm ranks. The line's parts are also checked on their own
(:class:`cli.train_restarts.RestartReport`, with the failures torch's agent reports)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from cli.train_restarts import RESTART_FILE_ENV, RestartReport, failure_cause, note_first_step
from tests.cli.test_train_rank_dies import _rank_pids
from tests.torchrun import ENV, read_metrics, start_in_own_session
from tests.warm_train import warm_train

KILLS = 20
RUN = ("--model", "tiny", "--batch-size", "6", "--seq-len", "16", "--steps", "300", "--log-every", "100000")
TIER = ("--node-size", "1", "--mem-every", "1", "--save-every", "7", "--keep", "2")


def _failure(exitcode: int, timestamp: int = 0) -> SimpleNamespace:
    name = signal.Signals(-exitcode).name if exitcode < 0 else ""
    return SimpleNamespace(exitcode=exitcode, signal_name=lambda: name, timestamp=timestamp)


def test_the_cause_of_a_failed_attempt():
    assert failure_cause({0: _failure(-15), 1: _failure(-9)}) == (1, "rank 1 was killed by SIGKILL")
    assert failure_cause({0: _failure(3), 1: _failure(7)}) == (1, "rank 1 exited with code 7")
    assert failure_cause({0: _failure(3), 1: _failure(3)}) == (
        0,
        "rank 0 stopped: a rank on another machine failed under a collective",
    )
    assert failure_cause({0: _failure(1), 1: _failure(-15)}) is None  # rank 0 refused and said why
    # rank 0 outlived the SIGTERM that stopped the attempt and was SIGKILLed 30 s after rank 1 died
    assert failure_cause({0: _failure(-9, 1030), 1: _failure(-9, 1000)}) == (1, "rank 1 was killed by SIGKILL")
    assert failure_cause({0: _failure(-9, 1000), 1: _failure(-9, 1000)}) == (0, "rank 0 was killed by SIGKILL")


def test_one_line_per_restart_with_where_it_resumed_from(tmp_path, capsys, monkeypatch):
    report = RestartReport(str(tmp_path))
    monkeypatch.setenv(RESTART_FILE_ENV, report.path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    report.failure = ("rank 1 was killed by SIGKILL", time.time() - 3.0)
    report.begin(1, 3)
    report.poll()
    assert capsys.readouterr().out == ""  # the restarted ranks have not finished a step yet
    note_first_step("the memory tier at step 31")
    report.poll()
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"restart 1 of 3: rank 1 was killed by SIGKILL; resumed from the memory tier at step 31, "
        r"(\d+\.\d) s from the failure to the first step",
        line,
    ), line
    assert 3.0 <= float(line.split(", ")[-1].split()[0]) < 60
    report.poll()
    assert capsys.readouterr().out == ""  # said once
    report.failure = ("rank 0 exited with code 7", time.time())  # restart 2 never reaches a step ...
    report.begin(2, 3)
    report.failure = ("rank 1 was killed by SIGKILL", time.time())
    report.begin(3, 3)  # ... and the job goes on with restart 3, which ends before its first step
    report.finish()
    assert capsys.readouterr().out.splitlines() == [
        "restart 2 of 3: rank 0 exited with code 7; it failed again before its first step",
        "restart 3 of 3: rank 1 was killed by SIGKILL; the job ended before the restarted ranks finished a step",
    ]


def test_only_the_first_rank_of_a_machine_tells_the_launcher(tmp_path, monkeypatch):
    path = tmp_path / "restarted"
    monkeypatch.setenv(RESTART_FILE_ENV, str(path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    note_first_step("x")
    assert not path.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    note_first_step("x")
    assert json.loads(path.read_text())["resumed_from"] == "x"


@pytest.mark.heavy
def test_twenty_kills_are_twenty_lines_no_traceback_and_the_uninterrupted_run(tmp_path):
    """A 2-rank run (2 nodes of one rank, a snapshot every step, promoted to a durable save every
    7th) whose random rank is SIGKILLed 20 times, each at a random moment once the restarted ranks
    have made progress: 20 restart lines in order, each naming the rank and SIGKILL; every
    recovery line; nothing on stderr; the losses of every step as the uninterrupted run's."""
    whole = warm_train(
        2,
        *RUN,
        *TIER,
        "--ckpt-dir",
        str(tmp_path / "W"),
        "--mem-tier",
        str(tmp_path / "WT"),
        "--metrics",
        str(tmp_path / "whole.jsonl"),
    )
    assert whole.returncode == 0, whole.stderr
    metrics = tmp_path / "m.jsonl"
    args = [
        *RUN,
        *TIER,
        "--ckpt-dir",
        str(tmp_path / "D"),
        "--mem-tier",
        str(tmp_path / "T"),
        "--metrics",
        str(metrics),
    ]
    trainer = [sys.executable, "-m", "mfsdp_cli.train", "--nproc-per-node", "2", "--max-restarts", str(KILLS)]
    proc = start_in_own_session([*trainer, *args], tmp_path, ENV)
    rng = random.Random()
    killed: list[int] = []
    deadline = time.time() + 600
    seen, gone = 0, set()
    for _ in range(KILLS):
        # this attempt's two ranks are up (none of the last one's), and have gone past every step
        # logged before they started (a survivor of the last attempt may log one more step)
        while len(ranks := _rank_pids(proc.pid)) < 2 or set(ranks.values()) & gone:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        seen = max(seen, *read_metrics(metrics), 0)
        while max(read_metrics(metrics), default=0) <= seen:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))
        victim = rng.randrange(2)
        os.kill(ranks[victim], signal.SIGKILL)
        killed.append(victim)
        gone = set(ranks.values())
        while set(_rank_pids(proc.pid).values()) & gone:  # the launcher stopped that attempt
            assert time.time() < deadline
            time.sleep(0.01)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out, err)
    assert err == "", err
    restarts = [line for line in out.splitlines() if line.startswith("restart ")]
    assert len(restarts) == KILLS, out
    for k, (line, victim) in enumerate(zip(restarts, killed), start=1):
        head = f"restart {k} of {KILLS}: rank {victim} was killed by SIGKILL; resumed from "
        assert line.startswith(head) and line.endswith(" s from the failure to the first step"), (line, head)
        # from the second on there is a snapshot to recover (the one the last recovery loaded, at least)
        assert k == 1 or line.startswith(f"{head}the memory tier at step "), line
    from_memory = [line for line in restarts if "resumed from the memory tier at step " in line]
    recovered = [line for line in out.splitlines() if line.startswith("recovered from the memory tier at step ")]
    assert len(recovered) == len(from_memory), out
    losses = {s: r["loss"] for s, r in read_metrics(metrics).items()}
    assert losses == {s: r["loss"] for s, r in read_metrics(tmp_path / "whole.jsonl").items()}

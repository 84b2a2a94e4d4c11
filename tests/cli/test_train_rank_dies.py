"""A rank of ``mfsdp-train --nproc-per-node 2`` that dies (``kill -9``), whichever it is, ends the
run with one line naming the rank and the signal, and the latest committed checkpoint to resume
from; exit 137. (Rank 1 dying used to end the run silently with exit 143: the launcher stopped
rank 0 with SIGTERM, and rank 0's 143 masked rank 1's death.) Real processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.torchrun import ENV, _children, read_metrics, start_in_own_session

TRAINER = [sys.executable, "-m", "mfsdp_cli.train"]
RUN = ("--model", "tiny", "--batch-size", "6", "--seq-len", "32", "--steps", "400", "--save-every", "5")


def _rank_pids(launcher: int) -> dict[int, int]:
    """Rank -> pid of the launcher's workers (their ``RANK`` in /proc/PID/environ)."""
    ranks = {}
    for pid in _children(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


@pytest.mark.heavy
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_is_one_line_naming_it_and_the_checkpoint_to_resume_from(tmp_path, victim):
    ckpt, metrics = tmp_path / "D", tmp_path / "m.jsonl"
    args = [*RUN, "--log-every", "1000", "--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
    proc = start_in_own_session([*TRAINER, "--nproc-per-node", "2", *args], tmp_path, ENV)
    deadline = time.time() + 240
    while max(read_metrics(metrics), default=0) < 7:  # step_000005 committed, training on
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.02)
    ranks = _rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    latest = (ckpt / "latest").read_text().strip()
    assert int(latest.rsplit("_", 1)[1]) >= 5
    assert err.splitlines() == [
        f"error: rank {victim} was killed by SIGKILL; resume from {ckpt / latest} (the same command with --resume)"
    ], err
    assert proc.returncode == 137

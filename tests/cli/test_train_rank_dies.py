"""A rank of ``mfsdp-train --nproc-per-node 2`` that dies (``kill -9``), whichever it is, ends the
run with one line naming the rank and the signal, and the latest committed checkpoint to resume
from; exit 137. (Rank 1 dying used to end the run silently with exit 143: the launcher stopped
rank 0 with SIGTERM, and rank 0's 143 masked rank 1's death.) Real processes. The rank that
survives says nothing whichever meets the death first, the launcher's SIGTERM or the collective
that fails under it (exit 3, no traceback); the launcher's verdict on every mix of exits."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from cli import trainer
from cli.train_launch import _report_failure
from cli.train_signals import LAUNCHED_ENV, PEER_LOST_EXIT, peer_lost
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


GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:8834. This is typically caused by a remote worker crashing."
)


def test_peer_lost_is_a_collective_whose_peer_process_is_gone():
    assert peer_lost(RuntimeError(GLOO_PEER_GONE))
    assert peer_lost(RuntimeError("[pair.cc:598] Read error [127.0.0.1]:6543: Connection reset by peer"))
    assert peer_lost(RuntimeError("[pair.cc:446] Write error [127.0.0.1]:6543: Broken pipe"))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)"))
    assert not peer_lost(ValueError(GLOO_PEER_GONE))  # only a collective's RuntimeError


def _rank_meeting(error: Exception, monkeypatch, launched: bool) -> int:
    """``trainer.run`` of a rank whose training raises ``error``; its exit code."""

    def train(*_: object) -> int:
        raise error

    monkeypatch.setattr(trainer, "check_args", lambda args, world: (None, None))
    monkeypatch.setattr(trainer, "train", train)
    monkeypatch.delenv("RANK", raising=False)
    if launched:
        monkeypatch.setenv(LAUNCHED_ENV, "1")
    else:
        monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    return trainer.run(None)


def test_a_rank_of_our_launcher_whose_peer_died_exits_3_without_a_word(monkeypatch, capsys):
    assert _rank_meeting(RuntimeError(GLOO_PEER_GONE), monkeypatch, launched=True) == PEER_LOST_EXIT
    assert capsys.readouterr() == ("", "")
    # its own fault, or a rank of plain torchrun (whose report is torchrun's): the error as it is
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _rank_meeting(RuntimeError("shapes cannot be multiplied"), monkeypatch, launched=True)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _rank_meeting(RuntimeError(GLOO_PEER_GONE), monkeypatch, launched=False)


class _Exit:
    """What the launcher knows of a rank that ended (torch elastic's ``ProcessFailure``)."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode
        self.timestamp = 0  # seconds since the epoch when torch recorded it: all at once here

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


@pytest.mark.parametrize(
    "exits,line,code",
    [
        # the dead rank is named, whichever exit its peer met first
        ({0: PEER_LOST_EXIT, 1: -signal.SIGKILL}, "rank 1 was killed by SIGKILL", 137),
        ({0: -signal.SIGKILL, 1: PEER_LOST_EXIT}, "rank 0 was killed by SIGKILL", 137),
        ({0: -signal.SIGTERM, 1: -signal.SIGKILL}, "rank 1 was killed by SIGKILL", 137),
        ({0: PEER_LOST_EXIT, 1: 7}, "rank 1 exited with code 7", 7),
        # the rank that died ran on another machine: this one's ranks only lost it
        ({0: PEER_LOST_EXIT, 1: PEER_LOST_EXIT}, "rank 0 stopped: a rank on another machine failed", PEER_LOST_EXIT),
        # rank 0 refused and said why: nothing more
        ({0: 1, 1: -signal.SIGTERM}, None, 1),
    ],
)
def test_the_launcher_names_the_rank_that_failed(exits, line, code, capsys, tmp_path):
    got = _report_failure(str(tmp_path), {rank: _Exit(e) for rank, e in exits.items()})
    err = capsys.readouterr().err
    assert got == code
    if line is None:
        assert err == ""
    else:
        assert err.startswith(f"error: {line}") and err.count("\n") == 1, err
        assert f"no committed checkpoint in {tmp_path} yet" in err

"""Ctrl-C (SIGINT to the process group, as a terminal sends it) of ``mfsdp-train --nproc-per-node 2``
at any moment is exit 130 and exactly one line beyond the run's header: while the launcher imports
torch, while the ranks start and import it, and in the training loop. (In the first seconds it
printed 17-120 lines of tracebacks of the ranks' interpreter start-up, or nothing at all.)
Real processes; the moments are times after the start on this machine, so each lands where it
lands: what is asserted holds at every moment."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.torchrun import ENV, read_metrics, start_in_own_session

TRAINER = [sys.executable, "-m", "mfsdp_cli.train"]
RUN = ("--model", "tiny", "--batch-size", "6", "--seq-len", "32", "--steps", "400", "--log-every", "1000")
HEADER = ("model ", "precision ", "data ", "checkpoints", "tensorboard")  # what a run prints before its steps


@pytest.mark.parametrize("moment", ["0.3", "1", "2", "3", "5", "step"])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path, moment):
    metrics = tmp_path / "m.jsonl"
    proc = start_in_own_session([*TRAINER, "--nproc-per-node", "2", *RUN, "--metrics", str(metrics)], tmp_path, ENV)
    if moment == "step":
        deadline = time.time() + 240
        while max(read_metrics(metrics), default=0) < 1:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the run did not get going"
            time.sleep(0.02)
    else:
        time.sleep(float(moment))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    said = err.splitlines() + [line for line in out.splitlines() if line.strip() and not line.startswith(HEADER)]
    assert len(said) == 1, (moment, out, err)
    assert said[0] == "error: interrupted" or said[0].startswith("interrupted at step "), said
    assert proc.returncode == 130, (moment, out, err)
    if moment == "step":
        assert said[0].startswith("interrupted at step "), said

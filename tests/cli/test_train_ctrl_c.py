"""Ctrl-C (SIGINT to the process group, as a terminal sends it) of ``mfsdp-train --nproc-per-node 2``
at any moment is exit 130 and exactly one line beyond the run's header: while the launcher imports
torch, while the ranks start and import it, and in the training loop. (In the first seconds it
printed 17-120 lines of tracebacks of the ranks' interpreter start-up, or nothing at all.)
Real processes; the moments are times after the trainer's first module is imported (the
interpreter's own start-up, before any code of ours runs, is the one moment no Python program
owns: ``-X importtime`` tells the test when it is over), so each lands where it lands on this
machine: what is asserted holds at every moment. A rank waiting to join the process group for a
peer that will never come (the same Ctrl-C stopped it first) stops at once too: it used to wait
there, in C++, for the launcher's two-minute shutdown timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.torchrun import ENV, read_metrics, start_in_own_session

TRAINER = [sys.executable, "-X", "importtime", "-m", "mfsdp_cli.train"]
FIRST_MODULE = "mfsdp_cli.train_signals"  # what the trainer's entry module imports before anything else
RUN = ("--model", "tiny", "--batch-size", "6", "--seq-len", "32", "--steps", "400", "--log-every", "1000")
HEADER = ("model ", "precision ", "data ", "checkpoints", "tensorboard")  # what a run prints before its steps


@pytest.mark.heavy  # 7 real 2-rank runs (about 40 s); the joining case below stays in the inner loop
@pytest.mark.parametrize("moment", ["0", "0.3", "1", "2", "3", "5", "step"])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path, moment):
    metrics = tmp_path / "m.jsonl"
    proc = start_in_own_session([*TRAINER, "--nproc-per-node", "2", *RUN, "--metrics", str(metrics)], tmp_path, ENV)
    stderr = _StderrReader(proc, FIRST_MODULE)
    if moment == "step":
        deadline = time.time() + 240
        while max(read_metrics(metrics), default=0) < 1:
            assert proc.poll() is None, (proc.stdout.read(), stderr.all())
            assert time.time() < deadline, "the run did not get going"
            time.sleep(0.02)
    else:
        time.sleep(float(moment))
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.stdout.read()
    proc.wait(timeout=240)
    err = stderr.all()
    said = [line for line in err.splitlines() if not line.startswith("import time:")]
    said += [line for line in out.splitlines() if line.strip() and not line.startswith(HEADER)]
    assert len(said) == 1, (moment, out, err)
    assert said[0] == "error: interrupted" or said[0].startswith("interrupted at step "), said
    assert proc.returncode == 130, (moment, out, err)
    if moment == "step":
        assert said[0].startswith("interrupted at step "), said


def test_ctrl_c_while_joining_the_group_for_a_peer_that_never_comes(tmp_path):
    """Rank 0 of a 2-rank job started alone: it hosts the rendezvous store and waits in
    ``init_process_group`` for rank 1; a Ctrl-C there is one line and 130 within seconds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(ENV, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = start_in_own_session([sys.executable, "-m", "mfsdp_cli.train", *RUN], tmp_path, env)
    deadline = time.time() + 240
    while True:  # the store listens once the rank is inside init_process_group
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "rank 0 never started its store"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.time()
    out, err = proc.communicate(timeout=240)
    waited = time.time() - interrupted
    assert proc.returncode == 130, (out, err)
    assert err.splitlines() == ["error: interrupted"], err
    assert waited < 30, f"stopped {waited:.0f} s after the Ctrl-C"


class _StderrReader:
    """The process's stderr, read as it comes (``-X importtime`` writes more than a pipe holds);
    the constructor returns once ``module``'s import is done."""

    def __init__(self, proc: subprocess.Popen, module: str) -> None:
        self._lines: list[str] = []
        self.seen = False
        self._imported = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(proc, f"| {module}"), daemon=True)
        self._thread.start()
        self._imported.wait(240)
        assert self.seen, ("the trainer did not import", module, "".join(self._lines)[-3000:])

    def _read(self, proc: subprocess.Popen, marker: str) -> None:
        for line in proc.stderr:
            self._lines.append(line)
            if line.rstrip().endswith(marker):
                self.seen = True
                self._imported.set()
        self._imported.set()  # ended: the assertion after the wait says how

    def all(self) -> str:
        """Everything the process wrote to stderr (once it has ended)."""
        self._thread.join(60)
        return "".join(self._lines)

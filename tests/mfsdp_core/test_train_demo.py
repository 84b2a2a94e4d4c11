"""The README's main job: a sharded training run on real gloo ranks launched by torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mfsdp_core.train", *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("strategy,policy", [("optim_grads_params", "block(32)"), ("optim", "tensor")])
def test_demo_trains_and_loss_falls(strategy, policy):
    run = _torchrun("--steps", "15", "--strategy", strategy, "--policy", policy)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step\s+\d+\s+loss (\S+)", run.stdout, re.M)]
    assert len(losses) == 15
    assert losses[-1] < losses[0] - 0.5, losses


def test_demo_rejects_unknown_strategy():
    run = subprocess.run([sys.executable, "-m", "mfsdp_core.train", "--strategy", "zero9"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "unknown sharding strategy 'zero9'" in run.stderr

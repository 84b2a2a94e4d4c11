"""A normal run prints nothing on stderr: importing the trainer and the command line, and a
single-process save and load of a tiny model, each in a fresh interpreter (so no warning filter
or module cache of the test process hides a warning that a user would see)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SAVE_AND_LOAD = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import mfsdp_ckpt
    from mfsdp_core import fully_shard, fully_shard_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()
    mfsdp_ckpt.save(sys.argv[1] + "/step-1", model, optim, step=1)
    mfsdp_ckpt.load(sys.argv[1] + "/step-1", model, optim)
    """
)


def _stderr_of(args: list[str]) -> str:
    """Run ``python args...`` from the checkout with the default warning filters; its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONSTARTUP")}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_importing_the_trainer_and_the_cli_prints_nothing() -> None:
    assert _stderr_of(["-c", "import cli.train, cli.trainer, cli.main, cli.hf, mfsdp_ckpt"]) == ""


def test_a_single_process_save_and_load_prints_nothing(tmp_path: Path) -> None:
    assert _stderr_of(["-c", SAVE_AND_LOAD, str(tmp_path)]) == ""

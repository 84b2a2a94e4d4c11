"""``mfsdp-ckpt ls DIR`` over a directory of run directories: every checkpoint under it, each run's
grouped under it with its latest, newest run first, JSON rows naming their ``run`` (loose
checkpoints in DIR itself are one run among the others); a run directory itself lists as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mfsdp_ckpt.write.builder import CheckpointBuilder

pytestmark = pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it


def _run_dir(root: str, steps: list[int], when: float = 1e9) -> str:
    """A run directory of committed checkpoints at ``steps`` and its ``latest``; the checkpoints'
    modification times from ``when`` on (one second apart), so that the newest is known."""
    os.makedirs(root, exist_ok=True)
    for i, step in enumerate(steps):
        path = os.path.join(root, f"step_{step:06d}")
        with CheckpointBuilder(path, {"step": step}) as builder:
            builder.add_tensor("model.w", torch.ones(4))
            builder.commit()
        os.utime(path, (when + i, when + i))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(f"step_{steps[-1]:06d}\n")
    return root


def _ls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "ls", *args], capture_output=True, text=True, timeout=300)


def test_ls_groups_the_runs_below_a_directory(tmp_path):
    out = str(tmp_path / "out")
    run1 = _run_dir(os.path.join(out, "run1"), [10], when=1e9)
    run2 = _run_dir(os.path.join(out, "group", "run2"), [10, 20], when=2e9)  # the newer run: listed first
    _run_dir(os.path.join(out, "a", "b", "c", "too_deep"), [5])  # 4 levels down: not searched
    result = _ls(out)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{run2}: 2 checkpoint(s), latest step_000020"
    assert lines[1].startswith("  step_000010") and "latest" not in lines[1]
    assert lines[2].startswith("  step_000020") and lines[2].endswith("<- latest")
    assert lines[3] == f"{run1}: 1 checkpoint(s), latest step_000010"
    assert lines[4].startswith("  step_000010") and lines[4].endswith("<- latest")
    assert len(lines) == 5 and "too_deep" not in result.stdout
    rows = json.loads(_ls("--json", out).stdout)
    assert [(r["run"], r["name"], r["step"], r["latest"]) for r in rows] == [
        (run2, "step_000010", 10, False),
        (run2, "step_000020", 20, True),
        (run1, "step_000010", 10, True),
    ]


def test_ls_of_a_run_directory_itself_is_unchanged(tmp_path):
    run = _run_dir(str(tmp_path / "run"), [1, 2])
    result = _ls(run)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("step_000001") and lines[1].startswith("step_000002") and len(lines) == 2
    rows = json.loads(_ls("--json", run).stdout)
    assert [r["name"] for r in rows] == ["step_000001", "step_000002"] and all("run" not in r for r in rows)


def test_ls_of_runs_lists_loose_checkpoints_and_every_run_below_newest_first(tmp_path):
    """``runs/`` holding checkpoints of its own and run directories (one of them inside a run
    directory): all of them, grouped by run, the run written last first."""
    runs = str(tmp_path / "runs")
    _run_dir(runs, [1, 2], when=2e9)  # loose checkpoints: runs/ is a run too
    old = _run_dir(os.path.join(runs, "old"), [5], when=1e9)
    new = _run_dir(os.path.join(runs, "new"), [7], when=3e9)
    nested = _run_dir(os.path.join(runs, "old", "branch"), [9], when=2.5e9)
    result = _ls(runs)
    assert result.returncode == 0, result.stderr
    heads = [line for line in result.stdout.splitlines() if not line.startswith("  ")]
    assert heads == [
        f"{new}: 1 checkpoint(s), latest step_000007",
        f"{nested}: 1 checkpoint(s), latest step_000009",
        f"{runs}: 2 checkpoint(s), latest step_000002",
        f"{old}: 1 checkpoint(s), latest step_000005",
    ], result.stdout
    assert len(result.stdout.splitlines()) == 4 + 5
    rows = json.loads(_ls("--json", runs).stdout)
    assert [(r["run"], r["name"], r["latest"]) for r in rows] == [
        (new, "step_000007", True),
        (nested, "step_000009", True),
        (runs, "step_000001", False),
        (runs, "step_000002", True),
        (old, "step_000005", True),
    ]

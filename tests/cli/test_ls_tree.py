"""``mfsdp-ckpt ls DIR`` over a directory of run directories: each run's checkpoints grouped under
it with its latest, JSON rows naming their ``run``; a run directory itself lists as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from mfsdp_ckpt.write.builder import CheckpointBuilder


def _run_dir(root: str, steps: list[int]) -> str:
    os.makedirs(root)
    for step in steps:
        with CheckpointBuilder(os.path.join(root, f"step_{step:06d}"), {"step": step}) as builder:
            builder.add_tensor("model.w", torch.ones(4))
            builder.commit()
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(f"step_{steps[-1]:06d}\n")
    return root


def _ls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "ls", *args], capture_output=True, text=True, timeout=300)


def test_ls_groups_the_runs_below_a_directory(tmp_path):
    out = str(tmp_path / "out")
    run1 = _run_dir(os.path.join(out, "run1"), [10])
    run2 = _run_dir(os.path.join(out, "group", "run2"), [10, 20])
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

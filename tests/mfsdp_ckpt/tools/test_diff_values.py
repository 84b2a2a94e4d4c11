"""``diff`` reports the two differing values in full: a tensor's worst mismatch with its index and
both elements, an object's first differing element with its path and both values."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.write.builder import CheckpointBuilder


def _build(path: str, w: torch.Tensor, groups: list) -> None:
    with CheckpointBuilder(path, {}) as builder:
        builder.add_tensor("model.w", w)
        builder.add_object("optim.param_groups", groups)
        builder.commit()


def test_diff_names_where_and_both_values_without_cutting_them(tmp_path):
    w = torch.zeros(5, 7)
    long_name = "x" * 300
    groups = [{"lr": 1e-3, "params": [f"model.{long_name}.{i}" for i in range(50)]}]
    _build(str(tmp_path / "a"), w, groups)
    w2 = w.clone()
    w2[3, 6] = 0.125
    w2[1, 1] = float("nan")
    groups2 = [{"lr": 1e-3, "params": [f"model.{long_name}.{i}" for i in range(49)] + [f"model.{long_name}.changed"]}]
    _build(str(tmp_path / "b"), w2, groups2)
    out = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    by_key = {d.key: d.detail for d in out.different}
    assert by_key["model.w"] == "max |a - b| = 0.125 at [1, 1]: a = 0.0, b = nan"  # a NaN mismatch is the worst
    assert by_key["optim.param_groups"] == (f"[0]['params'][49]: 'model.{long_name}.49' vs 'model.{long_name}.changed'")
    # the command line prints the same detail whole, as a real subprocess (no terminal-width cut)
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "diff", str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert run.returncode == 1, run.stderr
    assert f"'model.{long_name}.49' vs 'model.{long_name}.changed'" in run.stdout
    assert "max |a - b| = 0.125 at [1, 1]: a = 0.0, b = nan" in run.stdout

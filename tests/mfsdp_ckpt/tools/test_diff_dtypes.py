"""``diff`` compares values across dtypes: a bf16 copy against its fp32 source is equal within a
tolerance that covers bf16 rounding, a dtype change alone is still reported with atol = rtol = 0,
and the summary counts equal / different / only-in-A / only-in-B entries."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from mfsdp_ckpt.errors import shown_list
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.write.builder import CheckpointBuilder


def _build(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with CheckpointBuilder(path, {}) as builder:
        for key, value in tensors.items():
            builder.add_tensor(key, value)
        builder.commit()


def _pair(tmp_path) -> tuple[str, str]:
    torch.manual_seed(0)
    w, v = torch.randn(8, 8), torch.randn(16)
    far = w.clone()
    far[2, 3] += 1.0
    a, b = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    _build(a, {"model.w": w, "model.v": v, "model.far": w, "model.only_a": v})
    _build(b, {"model.w": w.bfloat16(), "model.v": v.bfloat16(), "model.far": far.bfloat16(), "model.only_b": v})
    return a, b


def test_values_are_compared_across_dtypes_within_the_tolerance(tmp_path):
    a, b = _pair(tmp_path)
    out = diff_checkpoints(a, b, atol=1e-2, rtol=1e-2)
    by_key = {d.key: d for d in out.different}
    assert sorted(by_key) == ["model.far"]  # the bf16 rounding of w and v is within the tolerance
    far = by_key["model.far"]
    assert far.problem == "values" and far.detail.startswith("torch.float32 vs torch.bfloat16; max |a - b| = ")
    assert far.max_abs is not None and 0.9 < far.max_abs < 1.1 and " at [2, 3]" in far.detail
    assert out.counts == {"equal": 2, "different": 1, "only_in_a": 1, "only_in_b": 1}


def test_without_a_tolerance_a_dtype_change_alone_is_different_and_says_how_values_compare(tmp_path):
    a, b = _pair(tmp_path)
    out = diff_checkpoints(a, b)
    by_key = {d.key: d for d in out.different}
    assert sorted(by_key) == ["model.far", "model.v", "model.w"]
    assert all(d.problem == "dtype" for d in out.different)
    assert by_key["model.w"].detail.startswith("torch.float32 vs torch.bfloat16; max |a - b| = ")
    assert out.counts == {"equal": 0, "different": 3, "only_in_a": 1, "only_in_b": 1}
    same_values = str(tmp_path / "ints")
    _build(same_values, {"model.w": torch.ones(3).bfloat16()})
    _build(str(tmp_path / "ints32"), {"model.w": torch.ones(3)})
    d = diff_checkpoints(same_values, str(tmp_path / "ints32")).different
    assert [x.detail for x in d] == ["torch.bfloat16 vs torch.float32; values equal after casting"]


def test_the_command_prints_and_emits_the_counts(tmp_path):
    a, b = _pair(tmp_path)
    cmd = [sys.executable, "-m", "cli.main", "diff", a, b, "--atol", "1e-2", "--rtol", "1e-2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stdout.rstrip().endswith(
        "\ndifferent: 2 equal, 1 different, 1 only in A, 1 only in B; 3 common entries compared"
    )
    assert "values     model.far: torch.float32 vs torch.bfloat16; max |a - b| = " in run.stdout
    run = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert json.loads(run.stdout)["counts"] == {"equal": 2, "different": 1, "only_in_a": 1, "only_in_b": 1}


def test_shown_list_says_how_many_it_left_out():
    assert shown_list(["a", "b"], 4) == "a, b"
    assert shown_list(["a", "b", "c", "d"], 4) == "a, b, c, d"
    assert shown_list([1, 2, 3, 4, 5, 6], 4) == "1, 2, 3, 4 and 2 more"

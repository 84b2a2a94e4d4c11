"""Retention never removes a base that a kept checkpoint may reference (issue 65, cause 4): a
checkpoint whose manifest cannot be read (a format version from the future, one damaged byte)
is kept by ``keep=``, and so is every base, since it may reference any of them; nothing else in
the run directory, nor around it, changes."""

from __future__ import annotations

import json
import os

import pytest

import mfsdp_ckpt
from mfsdp_ckpt.read.manifest import read_manifest
from tests.harness import run_ranks
from tests.mfsdp_ckpt.sharded.test_frozen_base import _build
from tests.mfsdp_core.models import train_steps
from tests.reliability.surroundings import digest


def _save_steps(root: str, first: int, last: int, keep: int | None) -> None:
    """Steps ``first..last`` of a model with frozen weights, each saved into ``root`` (a new
    process writes a new base with its first save)."""
    model, optim = _build()
    for s in range(first, last + 1):
        train_steps(model, optim, s - 1, s)
        mfsdp_ckpt.save(f"{root}/step_{s:06d}", model, optim, step=s, keep=keep)


def _future_version(path: str) -> None:
    with open(path) as f:
        manifest = json.load(f)
    manifest["format_version"] = 99
    with open(path, "w") as f:
        json.dump(manifest, f)


def _damaged_byte(path: str) -> None:
    with open(path, "r+b") as f:
        raw = f.read()
        at = raw.index(b'"step"') + 1
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x20]))  # "step" -> "Step": still JSON, the checksum no longer matches


@pytest.mark.parametrize("damage", [_future_version, _damaged_byte], ids=["format-version-99", "one-byte"])
def test_a_kept_checkpoint_whose_manifest_cannot_be_read_keeps_every_base(tmp_path, damage):
    root = str(tmp_path / "run")
    run_ranks(_save_steps, 2, root, 1, 1, None, timeout=300)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "base_step_000001",
        "latest",
        "latest-checkpoint",
        "step_000001",
    ]
    damage(os.path.join(root, "step_000001", "mfsdp.json"))
    with pytest.raises(mfsdp_ckpt.CheckpointError):
        read_manifest(os.path.join(root, "step_000001"))
    kept = digest(tmp_path, skip=(os.path.join(root, "step_000002"), os.path.join(root, "base_step_000002")))
    kept = {k: v for k, v in kept.items() if not k.startswith("run/latest") and not k.startswith("run/.")}
    run_ranks(_save_steps, 2, root, 2, 2, 1, timeout=300)  # a new base, keep=1
    names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert names == [
        "base_step_000001",
        "base_step_000002",
        "latest",
        "latest-checkpoint",
        "step_000001",
        "step_000002",
    ]
    after = digest(tmp_path, skip=(os.path.join(root, "step_000002"), os.path.join(root, "base_step_000002")))
    assert {k: v for k, v in after.items() if not k.startswith("run/latest") and not k.startswith("run/.")} == kept

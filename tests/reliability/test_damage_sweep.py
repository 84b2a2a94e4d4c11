"""Damage at every region of every file of a checkpoint: a flipped byte at evenly spread offsets
of each file (data records' headers, tensor bytes and trailers, ``.metadata``, the manifest),
each file truncated at several lengths, each file deleted. For every case: ``verify`` finds a
fault and ``load`` refuses with our error, or ``verify`` passes and ``load`` gives back exactly
what was saved; never another exception, and a failed load changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import mfsdp_ckpt
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps

FLIPS_PER_FILE = 40
TRUNCATIONS_PER_FILE = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process checkpoint of the test transformer (ZeRO-3, row), and what it holds."""
    root = tmp_path_factory.mktemp("sweep")
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    path = mfsdp_ckpt.save(str(root / "ckpt"), model, optim, extra={"step": 2}, step=2)
    return path, owned_pieces(model, optim)


def _cases(path: str) -> list[tuple[str, str, int]]:
    out = []
    for name in sorted(os.listdir(path)):
        size = os.path.getsize(os.path.join(path, name))
        offsets = sorted({min(size - 1, i * size // FLIPS_PER_FILE) for i in range(FLIPS_PER_FILE)} | {0, size - 1})
        out += [(name, "flip", o) for o in offsets]
        out += [(name, "truncate", size * i // TRUNCATIONS_PER_FILE) for i in range(TRUNCATIONS_PER_FILE)]
        out.append((name, "delete", 0))
    return out


def _damage(path: str, name: str, how: str, at: int) -> None:
    file = os.path.join(path, name)
    if how == "delete":
        os.remove(file)
    elif how == "truncate":
        os.truncate(file, at)
    else:
        with open(file, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.heavy
def test_damage_anywhere_is_found_or_harmless(saved, tmp_path):
    path, original = saved
    cases = _cases(path)
    assert len(cases) > 100
    outcomes = {"refused": 0, "harmless": 0}
    for i, (name, how, at) in enumerate(cases):
        case = str(tmp_path / f"c{i}")
        shutil.copytree(path, case)
        _damage(case, name, how, at)
        try:
            faults = verify_checkpoint(case)
        except mfsdp_ckpt.CheckpointError:
            faults = ["refused before any chunk was read"]
        model, optim = build("optim_grads_params", "row", seed=7)  # other weights: a load must replace them all
        before = owned_pieces(model, optim)
        try:
            mfsdp_ckpt.load(case, model, optim)
        except mfsdp_ckpt.CheckpointError as e:
            assert "\n" not in str(e), (name, how, at, str(e))
            assert faults, f"{name} {how}@{at}: verify passed what load refused: {e}"
            after = owned_pieces(model, optim)
            assert all(torch.equal(before[k][2], after[k][2]) for k in before), (
                name,
                how,
                at,
                "a failed load changed the model",
            )
            outcomes["refused"] += 1
            continue
        loaded = owned_pieces(model, optim)
        same = all(torch.equal(original[k][2], loaded[k][2]) for k in original)
        assert same, f"{name} {how}@{at}: load returned other values (verify: {faults[:2]})"
        outcomes["harmless"] += 1
        shutil.rmtree(case)
    print(f"damage sweep: {len(cases)} cases, {outcomes}")
    assert outcomes["refused"] > len(cases) // 2, outcomes  # most damage is caught, not lucky

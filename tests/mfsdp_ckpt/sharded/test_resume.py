"""Exact resume: 6 steps in one go == 3 steps, save, fresh processes, load, 3 steps; bitwise
(parameters, optimizer state, losses) for every strategy and policy at world sizes 1-4."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import mfsdp_ckpt
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
POLICIES = ["even", "row", "block(32)", "tensor"]
CONFIGS = list(itertools.product(STRATEGIES, POLICIES))


def _first_half_and_reference(root: str) -> dict:
    out = {}
    for strategy, policy in CONFIGS:
        model, optim = build(strategy, policy)
        train_steps(model, optim, 0, 3)
        mfsdp_ckpt.save(os.path.join(root, f"{strategy}-{policy}", "step_3"), model, optim, extra={"step": 3}, step=3)
        ref_model, ref_optim = build(strategy, policy)
        losses = train_steps(ref_model, ref_optim, 0, 6)
        out[(strategy, policy)] = {"losses": losses[3:], "pieces": owned_pieces(ref_model, ref_optim)}
    return out


def _second_half(root: str) -> dict:
    out = {}
    for strategy, policy in CONFIGS:
        model, optim = build(strategy, policy, seed=123)  # different weights: the load must replace them
        extra = mfsdp_ckpt.load(os.path.join(root, f"{strategy}-{policy}", "latest"), model, optim)
        losses = train_steps(model, optim, extra["step"], 6)
        out[(strategy, policy)] = {"losses": losses, "pieces": owned_pieces(model, optim)}
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exact_resume(ranks, tmp_path, world_size):
    reference = ranks(_first_half_and_reference, world_size, str(tmp_path), timeout=600)
    resumed = ranks(_second_half, world_size, str(tmp_path), timeout=600)  # fresh processes
    failures = []
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        for cfg in CONFIGS:
            if ref[cfg]["losses"] != res[cfg]["losses"]:
                failures.append(f"rank {rank} {cfg}: losses {res[cfg]['losses']} != {ref[cfg]['losses']}")
            for key, (lo, hi, values) in ref[cfg]["pieces"].items():
                got = res[cfg]["pieces"][key]
                if got[:2] != (lo, hi) or not torch.equal(got[2], values):
                    failures.append(f"rank {rank} {cfg}: {key} differs")
    assert not failures, "\n".join(failures[:20])

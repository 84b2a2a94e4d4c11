"""Resharding: a checkpoint saved at world size A with (strategy, policy) X loads at world size B
with Y, for A, B in 1-4 and all X, Y; every loaded tensor is bitwise equal to the saved logical
tensor (assembled from the writer's owned pieces, each element exactly once). Grads
(``include_grads=True``) are saved and compared for the ``row`` writers."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import mfsdp_ckpt
from tests.mfsdp_ckpt.util import assemble, build, owned_pieces, shapes_of, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
POLICIES = ["even", "row", "block(32)", "tensor"]
CONFIGS = list(itertools.product(STRATEGIES, POLICIES))
WORLD_SIZES = [1, 2, 3, 4]


def _save_all(root: str, world: int) -> dict:
    out = {}
    for strategy, policy in CONFIGS:
        model, optim = build(strategy, policy)
        grads = policy == "row"
        # two steps, then a backward without zero_grad: grads are mid-accumulation at save time
        train_steps(model, optim, 0, 2, zero_grad_last=False)
        mfsdp_ckpt.save(os.path.join(root, f"w{world}-{strategy}-{policy}"), model, optim, include_grads=grads)
        out[(strategy, policy)] = owned_pieces(model, optim, grads=grads)
    return out


def _load_all(root: str, truth: dict) -> list[str]:
    failures = []
    for (world, x_strategy, x_policy), expected in truth.items():
        path = os.path.join(root, f"w{world}-{x_strategy}-{x_policy}")
        for strategy, policy in CONFIGS:
            model, optim = build(strategy, policy, seed=99)
            mfsdp_ckpt.load(path, model, optim)
            got = owned_pieces(model, optim, grads=any(k.startswith("grad.") for k in expected))
            for key, (lo, hi, values) in got.items():
                want = expected[key].reshape(-1)[lo:hi]
                if not torch.equal(values, want):
                    failures.append(
                        f"A={world} {x_strategy}/{x_policy} -> {strategy}/{policy}: {key}[{lo}:{hi}] differs"
                    )
    return failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints for every (A, X) and their logical tensors."""
    from tests.harness import run_ranks

    root = str(tmp_path_factory.mktemp("reshard"))
    shapes = shapes_of()
    truth = {}
    for world in WORLD_SIZES:
        per_rank = run_ranks(_save_all, world, root, world, timeout=600)
        for cfg in CONFIGS:
            truth[(world, *cfg)] = assemble([r[cfg] for r in per_rank], shapes)
    return root, truth


@pytest.mark.heavy
@pytest.mark.parametrize("target_world", WORLD_SIZES)
def test_reshard_matrix(ranks, saved, target_world):
    root, truth = saved
    per_rank = ranks(_load_all, target_world, root, truth, timeout=1200)
    failures = [f for r in per_rank for f in r]
    assert not failures, f"{len(failures)} mismatches, e.g.\n" + "\n".join(failures[:20])

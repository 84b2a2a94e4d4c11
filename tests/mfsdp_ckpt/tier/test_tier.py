"""The memory tier: snapshots written per node with peer replicas, and recovered bitwise from
whatever copies survive, at the same or another world size (odd ones, ranks holding nothing of
a small tensor), or refused with the reason when no whole copy of a step is left."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from mfsdp_ckpt.tier import MemoryTier, async_snapshot, recover, snapshot
from mfsdp_ckpt.tier.layout import TIER_INDEX_NAME, read_tier_index, tier_steps
from tests.harness import run_ranks
from tests.mfsdp_ckpt.util import assemble, build, owned_pieces, shapes_of, train_steps

RUN = "run-test"


def _tier(root: str, keep: int = 2) -> MemoryTier:
    return MemoryTier(root, RUN, node_size=2, keep=keep, replicas=1)


def _train_and_snapshot(root: str, steps: int) -> dict:
    """Train ``steps`` steps on this job, a snapshot after each; this rank's pieces at the end."""
    model, optim = build("optim_grads_params", "even")
    tier = _tier(root)
    for step in range(1, steps + 1):
        train_steps(model, optim, step - 1, step)
        snapshot(tier, step, model, optim, extra={"step": step})
        if step == steps - 1:
            before_last = owned_pieces(model, optim)
    return {"last": owned_pieces(model, optim), "before_last": before_last}


def _recover(root: str) -> tuple:
    model, optim = build("optim", "row", seed=99)
    got = recover(_tier(root), model, optim)
    return got.step, got.extra, got.why, owned_pieces(model, optim)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """A 4-rank job (2 nodes of 2 ranks) that took snapshots of steps 1-3; the logical state at
    steps 2 and 3, and a pristine copy of the tier to damage in each test."""
    root = str(tmp_path_factory.mktemp("tier") / "pristine")
    per_rank = run_ranks(_train_and_snapshot, 4, root, 3, timeout=300)
    shapes = shapes_of()
    return root, {
        3: assemble([r["last"] for r in per_rank], shapes),
        2: assemble([r["before_last"] for r in per_rank], shapes),
    }


@pytest.fixture
def tier_copy(snapshots, tmp_path):
    root = str(tmp_path / "tier")
    shutil.copytree(snapshots[0], root, symlinks=True)
    return root, snapshots[1]


def _assert_recovered(per_rank: list, truth: dict, step: int) -> None:
    assert {r[0] for r in per_rank} == {step}, [r[:3] for r in per_rank]
    assert per_rank[0][1]["step"] == step
    got = assemble([r[3] for r in per_rank], shapes_of())
    for key, want in truth[step].items():
        assert got[key].equal(want), key


def _flip_byte(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_each_node_keeps_its_files_and_a_peers_replica_committed_whole(snapshots):
    root, _ = snapshots
    tier = _tier(root)
    for node in (0, 1):
        assert tier_steps(tier.node_dir(node)) == [2, 3]  # keep=2
        step, nodes, files = read_tier_index(tier.step_dir(node, 3))
        assert (step, nodes) == (3, 2)
        data = sorted(n for n, f in files.items() if f.node is not None)
        assert {files[n].node for n in data} == {0, 1}
        held = sorted(n for n in os.listdir(tier.step_dir(node, 3)) if n.endswith(".distcp"))
        assert held == data  # two nodes, one replica each: every node holds every data file
        assert not [n for n in os.listdir(tier.node_dir(node)) if n.endswith(".partial")]


@pytest.mark.parametrize("world", [4, 3, 5])
def test_recovers_the_newest_step_bitwise_at_any_world_size(tier_copy, world):
    root, truth = tier_copy
    _assert_recovered(run_ranks(_recover, world, root, timeout=300), truth, 3)


def test_a_flipped_byte_is_caught_and_the_peer_replica_used(tier_copy):
    root, truth = tier_copy
    tier = _tier(root)
    damaged = os.path.join(tier.step_dir(0, 3), "__0_0.distcp")
    _flip_byte(damaged)
    per_rank = run_ranks(_recover, 4, root, timeout=300)
    _assert_recovered(per_rank, truth, 3)
    assert per_rank[0][2] == ""  # step 3 itself was whole (on node 1)
    with open(damaged, "rb") as a, open(os.path.join(tier.step_dir(1, 3), "__0_0.distcp"), "rb") as b:
        assert a.read() == b.read()  # node 0's copy was replaced by the replica


def test_a_lost_node_is_recovered_from_its_peers_replica(tier_copy):
    root, truth = tier_copy
    shutil.rmtree(_tier(root).node_dir(1))
    _assert_recovered(run_ranks(_recover, 4, root, timeout=300), truth, 3)


def test_both_copies_damaged_falls_back_to_the_older_step_saying_why(tier_copy):
    root, truth = tier_copy
    tier = _tier(root)
    for node in (0, 1):
        _flip_byte(os.path.join(tier.step_dir(node, 3), "__2_0.distcp"))
    per_rank = run_ranks(_recover, 4, root, timeout=300)
    _assert_recovered(per_rank, truth, 2)
    why = per_rank[0][2]
    assert why == "step 3: no whole copy of __2_0.distcp (node0 crc32c mismatch, node1 crc32c mismatch)", why


def _snapshot_once(root: str, step: int) -> None:
    model, optim = build("optim_grads_params", "even")
    snapshot(_tier(root), step, model, optim, extra={"step": step})


def test_a_killed_snapshots_leftover_is_removed_by_the_next_commit(tier_copy):
    root, _ = tier_copy
    tier = _tier(root)
    os.makedirs(tier.step_dir(1, 4) + ".partial")  # a snapshot of step 4 killed midway
    run_ranks(_snapshot_once, 4, root, 5, timeout=300)
    for node in (0, 1):
        assert sorted(os.listdir(tier.node_dir(node))) == ["step_000003", "step_000005"]


def test_nothing_whole_recovers_nothing_and_a_partial_snapshot_is_never_taken(tier_copy):
    root, _ = tier_copy
    tier = _tier(root)
    os.makedirs(tier.step_dir(0, 4) + ".partial")  # a snapshot killed midway
    for node in (0, 1):
        for step in (2, 3):
            os.remove(os.path.join(tier.step_dir(node, step), TIER_INDEX_NAME))
    per_rank = run_ranks(_recover, 4, root, timeout=300)
    assert {r[0] for r in per_rank} == {None}
    assert per_rank[0][2].startswith("step 3: ") and "; step 2: " in per_rank[0][2], per_rank[0][2]
    assert "cannot read" in per_rank[0][2]


def test_an_empty_tier_recovers_nothing(tmp_path):
    per_rank = run_ranks(_recover, 2, str(tmp_path), timeout=300)
    assert per_rank[0][0] is None and per_rank[0][2] == f"no snapshot in {tmp_path}/{RUN}"


def _train_and_snapshot_async(root: str, steps: int) -> dict:
    """As :func:`_train_and_snapshot`, the snapshots taken in the background (the next step's
    optimizer update waits for each copy); every handle's result checked."""
    model, optim = build("optim_grads_params", "even")
    tier = _tier(root)
    handles = []
    for step in range(1, steps + 1):
        train_steps(model, optim, step - 1, step)
        handles.append(async_snapshot(tier, step, model, optim, extra={"step": step}))
    paths = [h.result() for h in handles]
    assert paths[-1] == tier.step_dir(tier.node_of(torch.distributed.get_rank()), steps)
    return owned_pieces(model, optim)


def test_background_snapshots_recover_the_same_state(tmp_path, snapshots):
    root = str(tmp_path / "tier")
    per_rank = run_ranks(_train_and_snapshot_async, 4, root, 3, timeout=300)
    trained = assemble(per_rank, shapes_of())
    assert trained.keys() == snapshots[1][3].keys()
    for key, want in trained.items():
        assert want.equal(snapshots[1][3][key]), key  # the same training, snapshots or not
    _assert_recovered(run_ranks(_recover, 3, root, timeout=300), snapshots[1], 3)

"""A hostile memory tier (issue 65): links planted where the tier expects its own files and
directories, records nested or sized to exhaust a reader, snapshots relabelled with another step,
stray entries. Each case is refused or passed over in one line, recovery falls back to the next
whole step, and nothing outside the tier changes (the surroundings are hashed before and after).

The tier is the 4-rank job's of ``test_tier`` (2 nodes of 2 ranks, one replica each, steps 2
and 3 kept); each test damages a fresh copy of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.tier import newest_snapshot
from mfsdp_ckpt.tier.files import check_file
from mfsdp_ckpt.tier.layout import TIER_INDEX_NAME, list_snapshots, read_tier_index, run_id_of, tier_steps
from tests.harness import run_ranks
from tests.mfsdp_ckpt.tier.test_tier import (  # noqa: F401 (fixtures)
    RUN,
    _assert_recovered,
    _recover,
    _tier,
    snapshots,
    tier_copy,
)
from tests.mfsdp_ckpt.util import build
from tests.reliability.surroundings import digest

TIB = 1 << 40


@pytest.fixture
def hostile(tier_copy, tmp_path):  # noqa: F811
    """The tier copy, the pristine states, and a digest of everything around the tier."""
    root, truth = tier_copy
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_bytes(b"user data\n" * 100)
    (victim / "step_000001").mkdir()
    (victim / "step_000001" / "notes.txt").write_text("not a snapshot")
    (victim / "step_000002").mkdir()
    return root, truth, victim, lambda: digest(tmp_path, skip=(root,))


def _data_file(tier, node: int, step: int, name: str = "__2_0.distcp") -> str:
    return os.path.join(tier.step_dir(node, step), name)


def test_a_partial_name_linked_out_of_the_tier_is_never_written_through(hostile):
    """Cause 1: the receiving node's ``<file>.partial`` is a link to a user's file; the file is
    received into a new ``.partial`` (the link unlinked, never followed) and step 3 recovers."""
    root, truth, victim, around = hostile
    tier = _tier(root)
    os.remove(_data_file(tier, 1, 3))  # node 1 must receive it from node 0
    os.symlink(victim / "precious.txt", _data_file(tier, 1, 3) + ".partial")
    before = around()
    _assert_recovered(run_ranks(_recover, 4, root, timeout=300), truth, 3)
    assert around() == before
    assert not os.path.islink(_data_file(tier, 1, 3)) and os.path.isfile(_data_file(tier, 1, 3))


def _snapshot_or_error(root: str, step: int) -> str | None:
    from mfsdp_ckpt.tier import snapshot

    model, optim = build("optim_grads_params", "even")
    try:
        snapshot(_tier(root), step, model, optim, extra={"step": step})
    except CheckpointError as e:
        return str(e)
    return None


def test_a_node_directory_replaced_by_a_link_is_never_read_written_or_pruned_through(hostile):
    """Cause 1: ``<run>/node1`` is a link to a user's directory holding ``step_000001/`` and
    ``step_000002/``. Recovery recovers nothing (one line naming the link: node 1 has nowhere of
    its own to load from); a snapshot fails in one line on every rank. Nothing of the user's
    directory is read as a snapshot, written or pruned."""
    root, _, victim, around = hostile
    tier = _tier(root)
    shutil.rmtree(tier.node_dir(1))
    os.symlink(victim, tier.node_dir(1))
    before = around()
    got = run_ranks(_recover, 4, root, timeout=300)
    assert {r[0] for r in got} == {None}, [r[:3] for r in got]
    why = got[0][2]
    assert "\n" not in why and why.startswith(f"{tier.node_dir(1)}: a symbolic link, not a directory of the memory"), (
        why
    )
    errors = run_ranks(_snapshot_or_error, 4, root, 5, timeout=300)
    assert len(set(errors)) == 1 and errors[0] is not None and "\n" not in errors[0], errors
    assert f"{tier.node_dir(1)}: a symbolic link" in errors[0], errors
    assert around() == before
    assert tier_steps(tier.node_dir(0)) == [2, 3]  # node 0 committed nothing: the snapshot failed everywhere


def test_a_step_directory_replaced_by_a_link_is_not_recovered_through(hostile, tmp_path):
    """Cause 1: node 0's ``step_000003`` is a link to a copy of it outside the tier. It is no
    snapshot of node 0 (never read), node 0 cannot be given a directory of step 3 (never written
    through): step 3 is passed over, in one line, and step 2 recovered."""
    root, truth, _, around = hostile
    tier = _tier(root)
    outside = tmp_path / "outside_step"
    shutil.copytree(tier.step_dir(0, 3), outside)
    shutil.rmtree(tier.step_dir(0, 3))
    os.symlink(outside, tier.step_dir(0, 3))
    before = around()
    got = run_ranks(_recover, 4, root, timeout=300)
    _assert_recovered(got, truth, 2)
    assert got[0][2].startswith(f"step 3: {tier.step_dir(0, 3)}: a symbolic link, not a directory"), got[0][2]
    assert around() == before


def test_a_deeply_nested_tier_index_is_one_line_and_recovery_goes_on(hostile):
    """Cause 3: ``tier.json`` nested 100,000 deep (on both nodes) is one line naming it (no
    RecursionError on any rank), step 3 is passed over and step 2 recovered; the listing shows it."""
    root, truth, _, around = hostile
    tier = _tier(root)
    deep = b"[" * 100_000 + b"]" * 100_000
    for node in (0, 1):
        with open(os.path.join(tier.step_dir(node, 3), TIER_INDEX_NAME), "wb") as f:
            f.write(deep)
    with pytest.raises(CheckpointError, match=r"tier.json: nested deeper than 4 levels: not a memory-tier index$"):
        read_tier_index(tier.step_dir(0, 3))
    before = around()
    got = run_ranks(_recover, 4, root, timeout=300)
    _assert_recovered(got, truth, 2)
    assert "nested deeper than 4 levels" in got[0][2] and "\n" not in got[0][2], got[0][2]
    assert around() == before


def _check_huge(directory: str, name: str, size: int, crc: int) -> None:
    """In a subprocess: check_file of a file grown to a terabyte, printing the seconds and the answer."""
    from mfsdp_ckpt.tier.layout import TierFile

    started = time.perf_counter()
    problem = check_file(directory, name, TierFile(size, crc, 0), checksum=True)
    print(json.dumps([time.perf_counter() - started, problem]))


def test_a_data_file_grown_to_a_terabyte_is_refused_by_its_size_before_any_byte_is_hashed(hostile):
    """Cause 3: a data file extended (sparse) to 1 TiB is refused by its size with one ``fstat``:
    the check of its crc32c never reads it (it took minutes); recovery takes the peer's copy."""
    root, truth, _, around = hostile
    tier = _tier(root)
    path = _data_file(tier, 0, 3)
    recorded = read_tier_index(tier.step_dir(0, 3))[2]["__2_0.distcp"]
    with open(path, "r+b") as f:
        f.truncate(TIB)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tests.mfsdp_ckpt.tier.test_tier_hostile import "
        "_check_huge; _check_huge(sys.argv[2], '__2_0.distcp', int(sys.argv[3]), int(sys.argv[4]))"
    )
    root_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = [sys.executable, "-c", code, root_dir, os.path.dirname(path), str(recorded.size), str(recorded.crc32c)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    seconds, problem = json.loads(done.stdout)
    assert problem == f"{TIB} bytes, not {recorded.size}" and seconds < 1.0, (seconds, problem)
    before = around()
    started = time.perf_counter()
    _assert_recovered(run_ranks(_recover, 4, root, timeout=60), truth, 3)
    assert time.perf_counter() - started < 60
    assert os.path.getsize(path) == recorded.size  # node 0's copy replaced by node 1's
    assert around() == before


def _edit_tier_step(step_dir: str, step: int) -> None:
    path = os.path.join(step_dir, TIER_INDEX_NAME)
    with open(path) as f:
        doc = json.load(f)
    doc["step"] = step
    with open(path, "w") as f:
        json.dump(doc, f)


def _snapshot_and_list(root: str, step: int) -> list[int]:
    from mfsdp_ckpt.tier import snapshot

    model, optim = build("optim_grads_params", "even")
    tier = _tier(root)
    snapshot(tier, step, model, optim, extra={"step": step})
    return tier_steps(tier.node_dir(tier.node_of(torch.distributed.get_rank())))


def test_a_snapshot_relabelled_with_a_higher_step_is_never_used_and_goes_at_the_next_commit(hostile, tmp_path):
    """Cause 6: step 3's directories renamed ``step_99999999999`` (their ``tier.json`` edited to
    match; the manifest, sealed by its checksum, still says 3). It is not the newest snapshot,
    recovery passes it over in one line (its manifest records step 3) and takes step 2, and the
    next snapshot's pruning removes it instead of keeping it forever."""
    root, truth, _, around = hostile
    tier = _tier(root)
    for node in (0, 1):
        os.rename(tier.step_dir(node, 3), tier.step_dir(node, 99999999999))
        _edit_tier_step(tier.step_dir(node, 99999999999), 99999999999)
    ckpt = str(tmp_path / "D")
    relabelled = os.path.join(os.path.dirname(root), "tier2")
    shutil.copytree(root, relabelled, symlinks=True)
    os.rename(os.path.join(relabelled, RUN), os.path.join(relabelled, run_id_of(ckpt)))
    found = newest_snapshot(relabelled, ckpt)
    assert found is not None and found[0] == 2, found
    before = around()
    got = run_ranks(_recover, 4, root, timeout=300)
    _assert_recovered(got, truth, 2)
    assert got[0][2].startswith(f"step 99999999999: {tier.step_dir(0, 99999999999)}: its mfsdp.json records step 3")
    assert run_ranks(_snapshot_and_list, 4, root, 4, timeout=300) == [[2, 4]] * 4
    assert around() == before


def test_stray_entries_in_a_tier_are_listed_with_what_they_are_never_followed(hostile, tmp_path):
    """Cause 6 (``ls --mem-tier``): a stray file named like a snapshot, a dangling link named like
    one, a link to a directory outside, a link in place of a node directory: the listing names each
    (or skips it) instead of failing; nothing is followed."""
    root, _, victim, around = hostile
    ckpt = str(tmp_path / "D")
    run_dir = os.path.join(os.path.dirname(root), "listed", run_id_of(ckpt))
    shutil.copytree(os.path.join(root, RUN), run_dir, symlinks=True)
    node0 = os.path.join(run_dir, "node0")
    with open(os.path.join(node0, "step_000007"), "w") as f:
        f.write("stray")
    os.symlink(os.path.join(tmp_path, "nowhere"), os.path.join(node0, "step_000008"))
    os.symlink(victim / "step_000001", os.path.join(node0, "step_000009"))
    os.symlink(victim, os.path.join(run_dir, "node2"))
    with open(os.path.join(node0, "stray.txt"), "w") as f:
        f.write("x")
    before = around()
    rows = list_snapshots(os.path.dirname(run_dir), ckpt)
    shown = {(s.node, s.step): s.problem for s in rows}
    assert shown[(0, 2)] is None and shown[(0, 3)] is None and shown[(1, 3)] is None
    assert shown[(0, 7)] == "a regular file, not a snapshot (never followed)"
    assert shown[(0, 8)] == shown[(0, 9)] == "a symbolic link, not a snapshot (never followed)"
    assert not [s for s in rows if s.node == 2]  # a link in place of a node directory is not followed
    assert around() == before

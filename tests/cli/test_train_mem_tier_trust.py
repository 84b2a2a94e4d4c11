"""The trainer's recovery trusts only this run's whole snapshots (issue 65), and falls back in one
line otherwise, with the losses of the uninterrupted run:

- another run's snapshots (another run identity than the durable ``latest``) are passed over;
- a snapshot whose load fails is passed over for the next whole one, then the durable checkpoint
  (the model rebuilt in between: it held part of the failed load);
- a snapshot relabelled with a higher step does not win over a newer durable ``latest``, and the
  next snapshot's pruning removes it;
- a node directory replaced by a link is never read, written or pruned through: nothing is
  recovered, and snapshots are skipped with one warning;
- ``mfsdp-ckpt ls --mem-tier`` lists stray entries and hostile records instead of failing.

Every resumed run is checked against the surroundings: nothing outside ``--ckpt-dir`` and the
tier changes. The runs are the trainer's own code on the harness's warm ranks (2 ranks, nodes of
one rank: two nodes, each with the other's replica)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.tier import run_id_of
from mfsdp_ckpt.tier.layout import TIER_INDEX_NAME
from tests.reliability.surroundings import digest
from tests.torchrun import ENV, failure, read_metrics
from tests.warm_train import warm_train

STEPS = 6
RUN = (
    "--model", "tiny", "--batch-size", "4", "--seq-len", "16", "--steps", str(STEPS), "--log-every", "1000",
    "--node-size", "1", "--mem-every", "1", "--save-every", "3", "--mem-keep", "2",
)  # fmt: skip


def _losses(path) -> dict[int, float]:
    return {step: record["loss"] for step, record in read_metrics(path).items()}


def _run(tmp, name: str, *args: str):
    ckpt, tier = tmp / f"{name}-D", tmp / f"{name}-T"
    done = warm_train(2, *RUN, "--ckpt-dir", str(ckpt), "--mem-tier", str(tier), *args)
    assert done.returncode == 0, failure(done)
    return ckpt, tier


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run's losses; run A stopped after step 4 with its tier kept (durable
    step_000003 made its ``latest``, snapshots 3 and 4 in memory); run B, another run (seed 2)
    stopped likewise."""
    tmp = tmp_path_factory.mktemp("trust")
    _run(tmp, "whole", "--metrics", str(tmp / "whole.jsonl"))
    whole = _losses(tmp / "whole.jsonl")
    assert sorted(whole) == list(range(1, STEPS + 1))
    a = _run(tmp, "A", "--stop-at", "4", "--mem-keep-on-exit")
    b = _run(tmp, "B", "--stop-at", "4", "--mem-keep-on-exit", "--seed", "2")
    for ckpt, _ in (a, b):
        os.rename(ckpt / "step_000004", tmp / f"{ckpt.name}-step_000004")  # kept aside for the relabelling test
        (ckpt / "latest").write_text("step_000003\n")
        (ckpt / "latest-checkpoint").unlink()
        os.symlink("step_000003", ckpt / "latest-checkpoint")
    return whole, a, b


def _nodes(tier, ckpt) -> list:
    return sorted((tier / run_id_of(str(ckpt))).iterdir())


def _setup(tmp_path, durable, snapshots):
    """``durable``'s run directory and ``snapshots``' tier copied under new names (the tier keeps
    a run by its --ckpt-dir): the copies, and a digest of what lies around them."""
    ckpt, tier = tmp_path / "D", tmp_path / "T"
    shutil.copytree(durable[0], ckpt, symlinks=True)
    shutil.copytree(snapshots[1] / run_id_of(str(snapshots[0])), tier / run_id_of(str(ckpt)), symlinks=True)
    return ckpt, tier


def _resume(tmp_path, ckpt, tier, *args: str):
    metrics = tmp_path / "m.jsonl"
    args = ("--ckpt-dir", str(ckpt), "--mem-tier", str(tier), "--resume", "auto", "--metrics", str(metrics), *args)
    before = digest(tmp_path, skip=(ckpt, tier, metrics))
    done = warm_train(2, *RUN, *args)
    assert digest(tmp_path, skip=(ckpt, tier, metrics)) == before  # nothing around the run or the tier changed
    return done, _losses(metrics)


def _line(out: str, start: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(start)]
    assert len(lines) == 1, out
    return lines[0]


def test_another_runs_snapshots_are_passed_over_for_the_durable_latest(runs, tmp_path):
    """Run B's snapshots (steps 3 and 4, newer than A's durable step 3) in A's tier: another run
    identity than ``latest``'s, so they are passed over in one line and A resumes from its durable
    checkpoint with A's losses (they used to win: the run was refused for B's seed, or, with
    ``--allow-change seed``, continued B's state)."""
    whole, a, b = runs
    ckpt, tier = _setup(tmp_path, a, b)
    done, losses = _resume(tmp_path, ckpt, tier)
    assert done.returncode == 0, failure(done)
    line = _line(done.stdout, "memory tier: nothing recovered (")
    assert "step 4: another run's snapshot (run identity " in line and "; step 3: another run's snapshot" in line
    assert line.endswith(f"); resuming from {ckpt}/step_000003"), line
    assert losses == {s: loss for s, loss in whole.items() if s > 3}


def _break_load(tier, ckpt, step: int) -> None:
    """Flip a byte inside ``step``'s data file on every node and record the damaged file's crc32c
    in ``tier.json`` (which has no checksum of its own): the survey finds every copy whole, the
    load's per-chunk crc32c fails."""
    for node in _nodes(tier, ckpt):
        step_dir = node / f"step_{step:06d}"
        data = step_dir / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        index = json.loads((step_dir / TIER_INDEX_NAME).read_text())
        index["files"]["__0_0.distcp"][1] = crc32c(bytes(raw))
        (step_dir / TIER_INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize("broken", [(4,), (4, 3)], ids=["newest", "both"])
def test_a_snapshot_whose_load_fails_falls_back_to_the_next_whole_state(runs, tmp_path, broken):
    """A's snapshot 4 (and 3) fails its load: the next whole snapshot is recovered (or the durable
    step 3), in one line naming why; the losses equal the uninterrupted run (the model partly
    loaded by the failed load is rebuilt first). The run used to stop with the load's error."""
    whole, a, _ = runs
    ckpt, tier = _setup(tmp_path, a, a)
    for step in broken:
        _break_load(tier, ckpt, step)
    done, losses = _resume(tmp_path, ckpt, tier)
    assert done.returncode == 0, failure(done)
    if broken == (4,):
        line = _line(done.stdout, "recovered from the memory tier at step 3 in ")
        assert "; passed over step 4: its load failed: " in line and "checksum mismatch" in line, line
    else:
        line = _line(done.stdout, "memory tier: nothing recovered (step 4: its load failed: ")
        assert "; step 3: its load failed: " in line and line.endswith(f"resuming from {ckpt}/step_000003"), line
    assert "partly loaded" not in done.stdout
    assert losses == {s: loss for s, loss in whole.items() if s > 3}


def test_a_relabelled_snapshot_does_not_win_over_the_newer_latest_and_is_pruned(runs, tmp_path):
    """A's snapshot 3 renamed ``step_99999999999`` (its ``tier.json`` edited to match; its sealed
    manifest says 3) and the durable ``latest`` at step 4: the newest state is snapshot 4, the
    relabelled one is passed over in one line, and the run's first snapshot prunes it."""
    whole, a, _ = runs
    ckpt, tier = _setup(tmp_path, a, a)
    shutil.copytree(a[0].parent / "A-D-step_000004", ckpt / "step_000004")
    (ckpt / "latest").write_text("step_000004\n")
    for node in _nodes(tier, ckpt):
        os.rename(node / "step_000003", node / "step_99999999999")
        index = json.loads((node / "step_99999999999" / TIER_INDEX_NAME).read_text())
        index["step"] = 99999999999
        (node / "step_99999999999" / TIER_INDEX_NAME).write_text(json.dumps(index))
    done, losses = _resume(tmp_path, ckpt, tier, "--mem-keep-on-exit")
    assert done.returncode == 0, failure(done)
    line = _line(done.stdout, "recovered from the memory tier at step 4 in ")
    assert "passed over step 99999999999: " in line and "its mfsdp.json records step 3" in line, line
    assert losses == {s: loss for s, loss in whole.items() if s > 4}
    for node in _nodes(tier, ckpt):
        assert sorted(p.name for p in node.iterdir()) == ["step_000005", "step_000006"]


def test_a_node_directory_linked_out_of_the_tier_is_passed_over_and_never_written(runs, tmp_path):
    """``<run>/node1`` replaced by a link to a user's directory holding ``step_000001/`` and
    ``step_000002/``: nothing is recovered (one line naming the link), the run resumes from its
    durable checkpoint with the uninterrupted losses, snapshots are skipped with one warning, and
    the user's directory is untouched (it used to receive snapshots, and lose step_000001 to
    the pruning)."""
    whole, a, _ = runs
    ckpt, tier = _setup(tmp_path, a, a)
    user = tmp_path / "user"
    for name in ("step_000001", "step_000002"):
        (user / name).mkdir(parents=True)
        (user / name / "notes.txt").write_text(name)
    node1 = tier / run_id_of(str(ckpt)) / "node1"
    shutil.rmtree(node1)
    os.symlink(user, node1)
    done, losses = _resume(tmp_path, ckpt, tier)
    assert done.returncode == 0, failure(done)
    line = _line(done.stdout, "memory tier: nothing recovered (")
    assert f"{node1}: a symbolic link, not a directory of the memory tier" in line, line
    warning = _line(done.stdout, "warning: memory tier: ")
    assert f"{node1}: a symbolic link" in warning and warning.endswith("; skipping snapshots"), warning
    assert losses == {s: loss for s, loss in whole.items() if s > 3}
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_000003", "step_000006"]


def test_ls_mem_tier_lists_stray_entries_and_hostile_records_instead_of_failing(runs, tmp_path):
    """``mfsdp-ckpt ls D --mem-tier T`` with a stray file and a dangling link named like snapshots
    and a ``tier.json`` nested 100,000 deep: exit 0, each named on its row (it exited 1, "internal
    error" for the nested record)."""
    _, a, _ = runs
    ckpt, tier = _setup(tmp_path, a, a)
    node0, node1 = _nodes(tier, ckpt)
    (node0 / "step_000007").write_text("stray")
    os.symlink(tmp_path / "nowhere", node0 / "step_000008")
    (node1 / "step_000004" / TIER_INDEX_NAME).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    before = digest(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "ls", str(ckpt), "--mem-tier", str(tier)],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stderr == "", (done.stdout, done.stderr)
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("  node")}
    assert "a regular file, not a snapshot (never followed)" in rows["step_000007"]
    assert "a symbolic link, not a snapshot (never followed)" in rows["step_000008"]
    assert "nested deeper than 4 levels" in [r for r in done.stdout.splitlines() if "node1 step_000004" in r][0]
    assert digest(tmp_path) == before

"""``mfsdp-train --mem-tier``: a run that loses a rank, or a whole node and its tier directory,
at a random step is restarted by the launcher (``--max-restarts 1``), recovers from the memory
tier (its own node's copy or the peer replica) and finishes with losses bitwise equal to the
uninterrupted run; a tier with no whole copy of the newest step falls back to the durable
checkpoint in one line; a 4-rank tier recovers onto 3 ranks exactly as a resume from the
offline reshard of the same step. Real processes (4 ranks, 2 nodes of 2 on one machine)."""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.cli.test_train_rank_dies import _rank_pids
from tests.torchrun import ENV, read_metrics, start_in_own_session
from tests.warm_train import warm_train

TRAINER = [sys.executable, "-m", "mfsdp_cli.train"]
CKPT = [sys.executable, "-m", "mfsdp_cli.main"]
STEPS = 16
RUN = ("--model", "tiny", "--batch-size", "12", "--seq-len", "32", "--steps", str(STEPS), "--log-every", "1000")
TIER = ("--node-size", "2", "--mem-every", "1")


def _train(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """A run to its end on ``nproc`` warm ranks (the kills need the launcher: ``_kill_and_finish``)."""
    done = warm_train(nproc, *RUN, *args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done


def _losses(metrics) -> dict[int, float]:
    return {step: record["loss"] for step, record in read_metrics(metrics).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    _train(4, "--metrics", str(tmp / "m.jsonl"))
    losses = _losses(tmp / "m.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _kill_and_finish(tmp_path, lose_node: bool) -> tuple[str, dict[int, float], int]:
    """A 4-rank run killed (one rank, or node 1's two ranks and its tier directory) at a random
    step; its output, its losses and the step."""
    at = random.Random().randint(3, STEPS - 8)  # room for the kill to land before the run ends, under load
    metrics, tier = tmp_path / "m.jsonl", tmp_path / "tier"
    args = [*RUN, *TIER, "--ckpt-dir", str(tmp_path / "D"), "--mem-tier", str(tier), "--metrics", str(metrics)]
    proc = start_in_own_session([*TRAINER, "--nproc-per-node", "4", "--max-restarts", "1", *args], tmp_path, ENV)
    deadline = time.time() + 240
    while max(read_metrics(metrics), default=0) < at:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.01)
    ranks = _rank_pids(proc.pid)
    victims = [2, 3] if lose_node else [random.Random().randrange(4)]
    for rank in victims:
        os.kill(ranks[rank], signal.SIGKILL)
    if lose_node:
        for node_dir in glob.glob(str(tier / "run-*" / "node1")):
            shutil.rmtree(node_dir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (at, victims, out, err)
    return out, _losses(metrics), at


@pytest.mark.heavy
@pytest.mark.parametrize("lose_node", [False, True], ids=["a-rank", "a-node"])
def test_a_killed_rank_or_node_recovers_from_memory_bitwise(tmp_path, uninterrupted, lose_node):
    out, losses, at = _kill_and_finish(tmp_path, lose_node)
    assert losses == uninterrupted, (at, out)
    recovered = [line for line in out.splitlines() if line.startswith("recovered from the memory tier at step ")]
    assert len(recovered) == 1, out
    step = int(recovered[0].split()[7])
    # the snapshot of a step commits in the background during the next: when the kill comes
    # right after step `at` was logged, the one of `at - 1` may still be in flight
    assert at - 2 <= step < STEPS, (at, recovered)
    assert glob.glob(str(tmp_path / "tier" / "*")) == []  # removed at the normal end


@pytest.mark.heavy
def test_no_whole_copy_falls_back_to_the_durable_checkpoint_in_one_line(tmp_path, uninterrupted):
    D, tier, metrics = tmp_path / "D", tmp_path / "tier", tmp_path / "m.jsonl"
    base = [*TIER, "--ckpt-dir", str(D), "--mem-tier", str(tier), "--metrics", str(metrics), "--mem-keep-on-exit"]
    _train(4, *base, "--save-every", "4", "--stop-at", "10")  # durable 4, 8, 10; tier 9, 10
    listed = subprocess.run([*CKPT, "ls", str(D), "--mem-tier", str(tier)], env=ENV, capture_output=True, text=True)
    lines = listed.stdout.splitlines()
    assert lines[3] == f"memory tier {tier}: 4 snapshot(s) of this run on this machine", listed.stdout
    assert [line.split()[:2] for line in lines[4:]] == [
        [f"node{n}", f"step_0000{s:02d}"] for n in (0, 1) for s in (9, 10)
    ]
    assert all(line.endswith("4 of 4 data files") for line in lines[4:]), listed.stdout
    for copy in glob.glob(str(tier / "run-*" / "node*" / "step_000010" / "__2_0.distcp")):
        with open(copy, "r+b") as f:
            f.seek(64)
            f.write(b"\xff\xfe")
    done = _train(4, *base, "--resume", "auto")
    said = [line for line in done.stdout.splitlines() if line.startswith("memory tier: ")]
    assert said == [
        "memory tier: nothing recovered (step 10: no whole copy of __2_0.distcp (node0 crc32c mismatch, "
        "node1 crc32c mismatch); its newest whole snapshot, step 9, is older than step 10); "
        f"resuming from {D / 'step_000010'}"
    ], done.stdout
    assert _losses(metrics) == uninterrupted


@pytest.mark.heavy
def test_recovery_onto_three_ranks_equals_a_resume_from_the_offline_reshard(tmp_path, uninterrupted):
    D, tier = tmp_path / "D", tmp_path / "tier"
    base = [*TIER, "--ckpt-dir", str(D), "--mem-tier", str(tier), "--mem-keep-on-exit"]
    _train(4, *base, "--stop-at", "8", "--metrics", str(tmp_path / "first.jsonl"))
    subprocess.run(
        [*CKPT, "reshard", str(D / "step_000008"), str(tmp_path / "w3"), "--world-size", "3"], check=True, env=ENV
    )
    from_tier = _train(3, *base, "--resume", "auto", "--metrics", str(tmp_path / "tier.jsonl"))
    assert "recovered from the memory tier at step 8 " in from_tier.stdout, from_tier.stdout
    _train(3, "--resume", str(tmp_path / "w3"), "--metrics", str(tmp_path / "reshard.jsonl"))
    from_reshard = _losses(tmp_path / "reshard.jsonl")
    assert sorted(from_reshard) == list(range(9, STEPS + 1))
    assert _losses(tmp_path / "tier.jsonl") == from_reshard


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--mem-tier", "T"], "error: --mem-tier T needs --ckpt-dir (without one the run saves nothing)"),
        (["--ckpt-dir", "D", "--mem-tier", "T", "--mem-every", "0"], "error: --mem-every 0: must be at least 1"),
        (["--ckpt-dir", "D", "--mem-tier", "T", "--node-size", "0"], "error: --node-size 0: must be at least 1"),
        (
            ["--ckpt-dir", "D", "--mem-tier", "s3://b/t"],
            "error: --mem-tier s3://b/t: must be a local directory (a tmpfs such as /dev/shm/...)",
        ),
        # flags that could not take effect, which used to run silently
        (
            ["--ckpt-dir", "D", "--mem-tier", "T", "--node-size", "1", "--mem-replicas", "2"],
            "error: --mem-replicas 2: the job has 2 node(s) of 1 ranks, so 1 peer node can keep a copy of a node's "
            "files (--node-size makes one machine play several nodes)",
        ),
        (
            ["--ckpt-dir", "D", "--mem-tier", "T", "--mem-replicas", "2"],
            "error: --mem-replicas 2: the job has 1 node(s) of 2 ranks, so no peer can keep a copy of a node's "
            "files (--node-size makes one machine play several nodes)",
        ),
        (
            ["--ckpt-dir", "D", "--mem-tier", "T", "--node-size", "5"],
            "error: --node-size 5: more than the 2 ranks of a machine (a node's ranks share its tier "
            "directory, so a node cannot span machines)",
        ),
        (
            ["--nnodes", "2", "--ckpt-dir", "D", "--mem-tier", "T", "--node-size", "2", "--nproc-per-node", "3"],
            "error: --node-size 2: must divide the 3 ranks of each machine (a node's ranks share its tier "
            "directory, so a node cannot span machines)",
        ),
        (
            ["--ckpt-dir", "D", "--mem-every", "5"],
            "error: --mem-every 5 needs --mem-tier (without one the run keeps no snapshots in memory)",
        ),
        (
            ["--node-size", "1"],
            "error: --node-size 1 needs --mem-tier (without one the run keeps no snapshots in memory)",
        ),
        (
            ["--ckpt-dir", "D", "--mem-keep", "3"],
            "error: --mem-keep 3 needs --mem-tier (without one the run keeps no snapshots in memory)",
        ),
        (
            ["--ckpt-dir", "D", "--mem-keep-on-exit"],
            "error: --mem-keep-on-exit needs --mem-tier (without one the run keeps no snapshots in memory)",
        ),
    ],
)
def test_memory_tier_flags_are_refused_in_one_line_before_any_rank_starts(tmp_path, flags, said):
    done = subprocess.run(
        [*TRAINER, "--nproc-per-node", "2", *RUN, *flags], cwd=tmp_path, env=ENV, capture_output=True, text=True
    )
    assert (done.returncode, done.stderr.splitlines()) == (1, [said])
    assert os.listdir(tmp_path) == []  # a refusal creates nothing


def test_a_snapshot_that_would_fill_the_tier_is_skipped_with_one_warning(tmp_path, capsys):
    """``TierSnapshots``: when a snapshot would take more than half of the tier's free space,
    it is skipped (nothing written) with one warning line, however many steps come; a smaller
    one is then taken."""
    from cli.train_tier import TierSnapshots
    from mfsdp_ckpt.tier import MemoryTier
    from tests.mfsdp_ckpt.util import build

    model, optim = build("no_shard", "even")
    snaps = TierSnapshots(MemoryTier(str(tmp_path / "T"), "run", node_size=1), every=1, rank=0)
    snaps.last_bytes = shutil.disk_usage(tmp_path).free  # the last one was as large as all the free space
    for step in (1, 2, 3):
        snaps.take(step, model, optim, extra={"step": step})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"warning: memory tier {tmp_path / 'T'}: a snapshot ("), out
    assert not (tmp_path / "T").exists()
    snaps.last_bytes = 0
    snaps.take(4, model, optim, extra={"step": 4})
    snaps.finish()  # taken in the background
    assert snaps.last_bytes > 0
    assert os.listdir(tmp_path / "T" / "run" / "node0") == ["step_000004"]


@pytest.mark.heavy
def test_durable_saves_are_promoted_snapshots_that_verify_and_resume_bitwise(tmp_path, uninterrupted):
    """With ``--mem-tier``, a ``--save-every`` save of a step that is snapshotted is that
    snapshot copied to ``--ckpt-dir`` in the background: it verifies, ``latest`` and ``--keep``
    follow it, and a resume from it continues the uninterrupted run bitwise."""
    D, tier = tmp_path / "D", tmp_path / "tier"
    base = [*TIER, "--ckpt-dir", str(D), "--mem-tier", str(tier), "--save-every", "4", "--keep", "2"]
    run = _train(4, *base, "--stop-at", "12", "--metrics", str(tmp_path / "first.jsonl"))
    promoted = [line.split()[1] for line in run.stdout.splitlines() if "(promoted from the memory tier)" in line]
    assert promoted == ["step_000004", "step_000008", "step_000012"], run.stdout
    assert not [line for line in run.stdout.splitlines() if line.startswith("saved ") and "promoted" not in line]
    assert sorted(p.name for p in D.iterdir() if p.name.startswith("step_")) == ["step_000008", "step_000012"]
    assert (D / "latest").read_text().strip() == "step_000012"
    for step in ("step_000008", "step_000012"):
        verified = subprocess.run([*CKPT, "verify", str(D / step)], env=ENV, capture_output=True, text=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    _train(4, "--resume", str(D / "step_000008"), "--metrics", str(tmp_path / "resumed.jsonl"))
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(9, STEPS + 1))
    assert resumed == {s: loss for s, loss in uninterrupted.items() if s > 8}

"""SIGKILL at every phase of a 2-rank save (planning, data, metadata, manifest, commit, ``latest``,
pruning), on either rank: afterwards ``latest`` names a committed checkpoint that verifies and
loads, every committed checkpoint verifies, nothing half-written looks committed, and the next
save succeeds and removes what the killed one left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import mfsdp_ckpt
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.tools.listing import list_checkpoints
from mfsdp_core import fully_shard_optimizer
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps
from tests.torchrun import ENV, ROOT

SCRIPT = os.path.join(ROOT, "tests", "reliability", "kill_during_save.py")

# (function, before/after its call, which call, which rank dies)
POINTS = [
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.create_local_plan", "before", 1, 0),
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.create_local_plan", "before", 1, 1),
    ("mfsdp_ckpt.sharded.save.agree_on_layout", "before", 1, 0),
    ("mfsdp_ckpt.sharded.save.agree_on_layout", "after", 1, 1),
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.resolve_data", "before", 1, 0),
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.resolve_data", "before", 1, 1),
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.resolve_data", "after", 5, 0),
    ("mfsdp_ckpt.sharded.planner.MfsdpSavePlanner.resolve_data", "after", 5, 1),
    ("torch.save", "after", 3, 0),
    ("mfsdp_ckpt.write.dcp_writer.CommittingWriter.write_data", "after", 1, 0),
    ("mfsdp_ckpt.write.dcp_writer.CommittingWriter.write_data", "after", 1, 1),
    ("mfsdp_ckpt.sharded.save.build_index", "before", 1, 0),
    ("torch.distributed.checkpoint.filesystem.FileSystemWriter.finish", "before", 1, 0),
    ("torch.distributed.checkpoint.filesystem.FileSystemWriter.finish", "after", 1, 0),
    ("mfsdp_ckpt.write.dcp_writer.write_manifest", "before", 1, 0),
    ("mfsdp_ckpt.write.dcp_writer.write_manifest", "after", 1, 0),
    ("mfsdp_ckpt.write.destination.commit_directory", "before", 1, 0),
    ("mfsdp_ckpt.write.destination.commit_directory", "after", 1, 0),
    ("mfsdp_ckpt.sharded.save.after_commit", "before", 1, 0),
    ("mfsdp_ckpt.sharded.save.rank0_decides", "before", 2, 1),
    ("mfsdp_ckpt.write.destination.LocalDestination.point_latest", "before", 1, 0),
    ("mfsdp_ckpt.storage.staging.os.replace", "before", 2, 0),
    ("mfsdp_ckpt.write.destination.LocalDestination.point_latest", "after", 1, 0),
    ("mfsdp_ckpt.write.run_dir.prune", "before", 1, 0),
    ("mfsdp_ckpt.storage.fs.shutil.rmtree", "after", 1, 0),
    ("mfsdp_ckpt.write.run_dir.prune", "after", 1, 0),
]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> str:
    """A run directory holding one committed checkpoint, step 1, named by ``latest``."""
    run = str(tmp_path_factory.mktemp("kill") / "base")
    out = _torchrun(run, "1")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _load_step(path: str) -> int:
    model = shard_model(make_model("transformer"), strategy="optim_grads", policy="even")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    return int(mfsdp_ckpt.load(path, model, optim)["step"])


@pytest.mark.heavy
@pytest.mark.parametrize(
    "target,when,nth,rank",
    POINTS,
    ids=[f"{t.rsplit('.', 2)[-2]}.{t.rsplit('.', 1)[-1]}-{w}{n}-rank{r}" for t, w, n, r in POINTS],
)
def test_a_kill_at_any_point_leaves_a_loadable_latest(base_run, tmp_path, target, when, nth, rank):
    run = str(tmp_path / "run")
    shutil.copytree(base_run, run, symlinks=True)  # latest-checkpoint stays a link
    out = _torchrun(run, "2", target, when, str(nth), str(rank))
    assert out.returncode != 0, "the kill point was never reached:\n" + out.stderr[-2000:]
    assert f"failed (exitcode: -9) local_rank: {rank}" in out.stderr, out.stderr[-2000:]  # killed where asked

    latest = open(os.path.join(run, "latest")).read().strip()
    assert latest in ("step_1", "step_2")
    for entry in list_checkpoints(run):
        if entry.committed:
            assert verify_checkpoint(os.path.join(run, entry.name)) == [], entry.name
    assert _load_step(os.path.join(run, "latest")) == int(latest.split("_")[1])
    assert os.path.isdir(os.path.join(run, latest))

    # the next save (a resumed job) succeeds: the dead job's lock is gone, its leftovers removed
    model = shard_model(make_model("transformer"), strategy="optim", policy="even")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.save(os.path.join(run, "step_3"), model, optim, extra={"step": 3}, step=3, keep=1, overwrite=True)
    assert sorted(n for n in os.listdir(run) if not n.startswith("latest")) == ["step_3"], os.listdir(run)
    assert _load_step(os.path.join(run, "latest")) == 3

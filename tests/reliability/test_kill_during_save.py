"""SIGKILL at every phase of a 2-rank save (planning, data, metadata, manifest, commit, ``latest``,
pruning), on either rank: afterwards ``latest`` names a committed checkpoint that verifies and
loads, every committed checkpoint verifies, nothing half-written looks committed, and the next
save succeeds and removes what the killed one left.

The ranks are real processes in a gloo group (``tests.harness``): the armed rank wraps a function
(a dotted path) so that its NTH call kills the process with SIGKILL before or after the call, as a
node dying there would. The other rank meets the dead peer at its next collective (a connection
error, its own error path) or is killed by the harness, as a launcher kills a job's other ranks."""

from __future__ import annotations

import importlib
import os
import shutil
import signal

import pytest
import torch.distributed as dist

import mfsdp_ckpt
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.tools.listing import list_checkpoints
from mfsdp_core import fully_shard_optimizer
from tests.harness import RankFailure, run_ranks
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps

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


def _resolve(dotted: str):
    """(owner, attribute) for ``package.module.Class.attr`` or ``package.module.attr``."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(dotted)


def _arm(target: str, when: str, nth: int) -> None:
    """Make the ``nth`` call of ``target`` kill this process with SIGKILL ``when`` (before/after) it runs."""
    owner, attr = _resolve(target)
    original = getattr(owner, attr)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(*args, **kwargs)
        if calls[0] == nth and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, attr, wrapper)


def _train_and_save(run: str, step: int, kill: tuple[str, str, int, int] | None = None) -> None:
    """One rank: train the test transformer ``step`` steps and save ``run/step_<step>`` with
    ``keep=1``; with ``kill = (target, when, nth, rank)``, rank ``rank`` dies there."""
    if kill is not None and dist.get_rank() == kill[3]:
        _arm(*kill[:3])
    model = shard_model(make_model("transformer"), strategy="optim_grads_params", policy="row")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    train_steps(model, optim, 0, step)
    mfsdp_ckpt.save(os.path.join(run, f"step_{step}"), model, optim, extra={"step": step}, step=step, keep=1)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> str:
    """A run directory holding one committed checkpoint, step 1, named by ``latest``."""
    run = str(tmp_path_factory.mktemp("kill") / "base")
    run_ranks(_train_and_save, 2, run, 1)
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
    with pytest.raises(RankFailure) as failed:  # no failure: the kill point was never reached
        run_ranks(_train_and_save, 2, run, 2, (target, when, nth, rank), timeout=120)
    # killed where asked: the armed rank died of SIGKILL (its peer failed after it, or was stopped)
    assert f"rank {rank} of 2 exited with code -9 (SIGKILL) without reporting" in str(failed.value), failed.value

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

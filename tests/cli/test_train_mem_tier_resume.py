"""A run stopped (Ctrl-C) before its first durable save leaves only memory-tier snapshots; they
record the run's settings as a durable save does, and ``--resume auto`` and plain ``--resume``
take them from there: the model, the learning rate, the steps and the save cadence are the
recorded ones (the run used to start from the defaults: the ``tiny`` model, lr 3e-3, 100 steps,
no cadence), the losses equal the uninterrupted run's bitwise, and settings that differ are
refused in one line as for a durable resume.

The stopped run is a real ``mfsdp-train`` job interrupted by SIGINT to its process group (a
terminal's Ctrl-C); the resumed runs and the uninterrupted one run on the harness's warm ranks
(:mod:`tests.warm_train`)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.tier import run_id_of
from tests.torchrun import ENV, failure, read_metrics, start_in_own_session
from tests.warm_train import warm_train

STEPS = 16
#: none of these is a default: the resumed run must find each in the snapshot
RECORDED = ("--model", "tiny-moe", "--lr", "0.001", "--steps", str(STEPS), "--save-every", "12")
RUN = ("--batch-size", "6", "--seq-len", "32", "--log-every", "1000", "--node-size", "1", "--mem-keep", "2")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The uninterrupted run's losses, and a run Ctrl-C'd after step 3 (before its first save, at
    step 12): its --ckpt-dir (no checkpoint), its tier, and its losses."""
    tmp = tmp_path_factory.mktemp("tier-resume")
    same = ("--ckpt-dir", str(tmp / "whole"), "--mem-tier", str(tmp / "whole-tier"))
    whole = warm_train(2, *RECORDED, *RUN, *same, "--metrics", str(tmp / "whole.jsonl"))
    assert whole.returncode == 0, failure(whole)
    ckpt, tier, metrics = tmp / "D", tmp / "T", tmp / "first.jsonl"
    args = [*RECORDED, *RUN, "--ckpt-dir", str(ckpt), "--mem-tier", str(tier), "--metrics", str(metrics)]
    proc = start_in_own_session([sys.executable, "-m", "mfsdp_cli.train", "--nproc-per-node", "2", *args], tmp, ENV)
    deadline = time.time() + 240
    while max(read_metrics(metrics), default=0) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130 and "no committed checkpoint in" in out, (out, err)
    assert not [p for p in ckpt.iterdir() if p.name.startswith("step_")]
    return tmp, ckpt, tier, _losses(tmp / "whole.jsonl")


def _losses(path) -> dict[int, float]:
    return {step: record["loss"] for step, record in read_metrics(path).items()}


def _copy(tmp_path, ckpt, tier):
    """A copy of the run and its tier under new names (the tier keeps a run by its --ckpt-dir)."""
    new_ckpt, new_tier = tmp_path / "D", tmp_path / "T"
    shutil.copytree(ckpt, new_ckpt)
    shutil.copytree(tier / run_id_of(str(ckpt)), new_tier / run_id_of(str(new_ckpt)))
    return new_ckpt, new_tier


@pytest.mark.parametrize("resume", [("--resume", "auto"), ("--resume",)], ids=["auto", "plain"])
def test_a_resume_from_memory_alone_takes_the_recorded_settings_and_continues_bitwise(stopped, tmp_path, resume):
    _, ckpt, tier, whole = _copy_of(stopped, tmp_path)
    metrics = tmp_path / "then.jsonl"
    run = warm_train(2, "--ckpt-dir", str(ckpt), "--mem-tier", str(tier), *resume, "--metrics", str(metrics))
    assert run.returncode == 0, failure(run)
    out = run.stdout
    assert "starting fresh" not in out and "no checkpoint" not in out, out
    recovered = [line for line in out.splitlines() if line.startswith("recovered from the memory tier at step ")]
    assert len(recovered) == 1, out
    step = int(recovered[0].split()[7])
    assert "model tiny-moe, " in out and "optimizer adamw (lr 0.001)" in out, out
    assert f", {STEPS} steps, seed 0" in out and "every 12 steps and at the end" in out, out
    then = _losses(metrics)
    assert sorted(then) == list(range(step + 1, STEPS + 1))
    assert then == {s: loss for s, loss in whole.items() if s > step}
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert saved == ["step_000012", f"step_{STEPS:06d}"]
    recorded = read_manifest(str(ckpt / "step_000012"))["run_config"]
    assert (recorded["lr"], recorded["steps"], recorded["settings"]["model_name"]) == (0.001, STEPS, "tiny-moe")


def test_a_snapshot_written_with_other_settings_is_refused_as_a_durable_one_is(stopped, tmp_path):
    _, ckpt, tier, _ = _copy_of(stopped, tmp_path)
    run = warm_train(2, "--ckpt-dir", str(ckpt), "--mem-tier", str(tier), "--resume", "auto", "--seed", "7")
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "was written with other settings: --seed 0 (this run: 7)" in lines[0], run.stderr
    assert str(tier) in lines[0] and "--allow-change seed" in lines[0], lines


def _copy_of(stopped, tmp_path):
    tmp, ckpt, tier, whole = stopped
    new_ckpt, new_tier = _copy(tmp_path, ckpt, tier)
    return tmp, new_ckpt, new_tier, whole

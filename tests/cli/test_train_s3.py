"""The trainer with ``--ckpt-dir s3://…`` (moto on 127.0.0.1 through s3fs): start-up validation
in one line, and a run killed mid-way that resumes from S3 bitwise as from a local directory and
at another world size; the S3 and local checkpoints of the same state ``diff`` equal."""

from __future__ import annotations

import json
import os
import re
import subprocess

import fsspec
import pytest
from click.testing import CliRunner

from cli.main import main
from tests.s3 import S3_ENV
from tests.torchrun import ENV, failure, read_metrics
from tests.warm_train import warm_train, warm_train_killed

COMMON = ("--model", "tiny-moe", "--steps", "40", "--save-every", "10", "--batch-size", "12")


def _env(endpoint: str) -> dict[str, str]:
    """The training subprocesses' environment: the endpoint and credentials as a user sets them."""
    return dict(ENV, **S3_ENV, FSSPEC_S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint)


def _run(endpoint: str, nproc: int | None, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """A run to its end on warm ranks, the endpoint and credentials in their environment (the
    killed run keeps a process of its own: the kill takes its whole process tree)."""
    return warm_train(nproc or 1, *args, env=_env(endpoint), timeout=timeout)


def test_missing_bucket_fails_at_start_up_in_one_line(s3_endpoint, tmp_path):
    run = _run(
        s3_endpoint,
        None,
        "--model",
        "tiny",
        "--steps",
        "2",
        "--ckpt-dir",
        "s3://missing-bucket/x",
        "--metrics",
        str(tmp_path / "m.jsonl"),
    )
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0, run.stderr
    assert run.stderr.startswith("error: --ckpt-dir s3://missing-bucket/x: s3://missing-bucket does not exist"), (
        run.stderr
    )
    assert not os.path.exists(tmp_path / "m.jsonl")  # before the first step
    assert "testing" not in run.stderr + run.stdout  # no credentials in what the user sees


@pytest.mark.heavy
def test_ckpt_dir_on_s3_saves_resumes_and_refuses_a_second_start(s3_endpoint, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    args = (
        "--model",
        "tiny",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--keep",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    )
    run = _run(s3_endpoint, None, *args, "--stop-at", "2", "--ckpt-dir", url)
    assert run.returncode == 0, failure(run)
    run = _run(s3_endpoint, None, *args, "--ckpt-dir", url)  # a fresh start over a run: refused
    assert run.returncode == 1 and "already holds checkpoints (step_000002)" in run.stderr, run.stderr
    run = _run(s3_endpoint, None, *args, "--ckpt-dir", url, "--resume")
    assert run.returncode == 0, failure(run)
    assert f"resumed from {url}/step_000002 at step 2" in run.stdout
    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(url, detail=False)) == ["latest", "step_000004"]  # --keep 1
    res = CliRunner().invoke(main, ["verify", f"{url}/latest"])
    assert res.exit_code == 0, res.output


@pytest.mark.heavy
def test_kill_and_resume_from_s3_bitwise_and_at_another_world_size(s3_endpoint, s3_bucket, tmp_path):
    local, url = tmp_path / "a", f"{s3_bucket}/b"
    # A: uninterrupted, local
    run = _run(s3_endpoint, 2, *COMMON, "--ckpt-dir", str(local), "--metrics", str(tmp_path / "a.jsonl"))
    assert run.returncode == 0, failure(run)
    # B: on S3, killed (SIGKILL to every rank, as a node crash would) once past the checkpoint at step 10
    b_metrics = tmp_path / "b.jsonl"
    killed_at = warm_train_killed(
        2, b_metrics, 13, *COMMON, "--ckpt-dir", url, "--keep", "2", "--metrics", str(b_metrics), env=_env(s3_endpoint)
    )
    assert 13 <= killed_at < 40, f"the run was not interrupted mid-way (last step {killed_at})"
    # C: B's latest checkpoint on S3, resumed on 3 ranks into another prefix
    run = _run(
        s3_endpoint,
        3,
        *COMMON,
        "--ckpt-dir",
        f"{s3_bucket}/c",
        "--resume",
        f"{url}/latest",
        "--metrics",
        str(tmp_path / "c.jsonl"),
    )
    assert run.returncode == 0, failure(run)
    start = int(re.search(r"resumed from \S+ at step (\d+) \(world size 3\)", run.stdout).group(1))
    assert start >= 10
    # B resumed on 2 ranks from S3: bitwise the uninterrupted local run
    run = _run(
        s3_endpoint, 2, *COMMON, "--ckpt-dir", url, "--keep", "2", "--metrics", str(tmp_path / "b.jsonl"), "--resume"
    )
    assert run.returncode == 0, failure(run)
    assert f"resumed from {url}/step_" in run.stdout
    ma, mb, mc = (
        read_metrics(tmp_path / "a.jsonl"),
        read_metrics(tmp_path / "b.jsonl"),
        read_metrics(tmp_path / "c.jsonl"),
    )
    assert [ma[s] for s in range(1, 41)] == [mb[s] for s in range(1, 41)]  # exact floats: bitwise
    # the S3 checkpoint and the local one of the same state: equal
    res = CliRunner().invoke(main, ["diff", str(local / "step_000040"), f"{url}/step_000040"])
    assert res.exit_code == 0 and "equal" in res.output, res.output
    res = CliRunner().invoke(main, ["ls", url, "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.output)
    assert [e["name"] for e in listed if e["committed"]] == ["step_000030", "step_000040"], listed  # --keep 2
    assert [e["name"] for e in listed if e["latest"]] == ["step_000040"]
    # 3 ranks: same samples, another reduction order (bound as in tests/cli/test_train.py)
    diffs = [abs(mc[s]["loss"] - ma[s]["loss"]) / ma[s]["loss"] for s in range(start + 1, 41)]
    assert diffs[0] < 1e-6, diffs
    assert max(diffs) < 1e-3, diffs

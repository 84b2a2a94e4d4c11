"""The trainer under HSDP and HFSDP (``--dp-replicate 2 [--hfsdp]`` on 4 ranks): losses as flat
FSDP's, a stopped run resumes bitwise, its checkpoints hold each byte once, written by both
replicas, load into the flat layout (and a flat one into HSDP), and reshard offline to 3 ranks
bitwise."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from tests.torchrun import failure, read_metrics
from tests.torchrun import run_train as _run

COMMON = ("--model", "tiny", "--steps", "6", "--save-every", "3", "--batch-size", "8", "--seed", "0")
FLAGS = {"hsdp": ("--dp-replicate", "2"), "hfsdp": ("--dp-replicate", "2", "--hfsdp")}


def _train(ckpt, metrics, *extra: str, nproc: int = 4):
    run = _run(nproc, *COMMON, "--ckpt-dir", str(ckpt), "--metrics", str(metrics), *extra)
    assert run.returncode == 0, failure(run)
    return run


def _data_files(step_dir) -> dict[str, int]:
    return {os.path.basename(f): os.path.getsize(f) for f in glob.glob(os.path.join(step_dir, "*.distcp"))}


def _close(a: dict, b: dict, steps, rtol: float) -> list:
    return [s for s in steps if abs(a[s]["loss"] - b[s]["loss"]) > rtol * abs(b[s]["loss"])]


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat")
    _train(root / "ckpt", root / "m.jsonl")
    return root


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["hsdp", "hfsdp"])
def test_replicated_runs_match_flat_resume_bitwise_and_reshard(mode, flat_run, tmp_path):
    flags = FLAGS[mode]
    flat = read_metrics(flat_run / "m.jsonl")
    # uninterrupted, and stopped at step 3 then resumed: bitwise the same
    run = _train(tmp_path / "a", tmp_path / "a.jsonl", *flags)
    assert ("HFSDP" if mode == "hfsdp" else "HSDP") + " 2 replicas x 2" in run.stdout
    _train(tmp_path / "b", tmp_path / "b.jsonl", *flags, "--stop-at", "3")
    _train(tmp_path / "b", tmp_path / "b.jsonl", *flags, "--resume")
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    assert _close(a, flat, range(1, 7), 1e-5) == [], (a, flat)

    runner = CliRunner()
    last = str(tmp_path / "a" / "step_000006")
    same = runner.invoke(main, ["diff", last, str(tmp_path / "b" / "step_000006")])
    assert same.exit_code == 0, same.output
    assert runner.invoke(main, ["verify", last]).exit_code == 0

    # each byte once: the data files of the 2 x 2 run weigh what the flat run's do, and every
    # rank (both replicas) wrote a share of them
    ours, theirs = _data_files(last), _data_files(flat_run / "ckpt" / "step_000006")
    assert sum(ours.values()) <= 1.05 * sum(theirs.values()), (ours, theirs)
    assert len(ours) == 4 and min(ours.values()) > 0.1 * max(ours.values()), ours

    # offline reshard to 3 ranks: bitwise the same checkpoint, and it verifies
    out = str(tmp_path / "r3")
    result = runner.invoke(main, ["reshard", last, out, "--world-size", "3"])
    assert result.exit_code == 0, result.output
    assert runner.invoke(main, ["diff", last, out]).exit_code == 0
    assert runner.invoke(main, ["verify", out]).exit_code == 0

    # layout changes on resume (model, optimizer, step and data position): this run's step 3 on
    # flat 4 ranks, the flat run's step 3 under this mode; steps 4-6 as the flat run's
    for src, name, extra in ((tmp_path / "a", "to_flat", ()), (flat_run / "ckpt", "from_flat", flags)):
        _train(tmp_path / name, tmp_path / f"{name}.jsonl", *extra, "--resume", str(src / "step_000003"))
        resumed = read_metrics(tmp_path / f"{name}.jsonl")
        assert sorted(resumed) == [4, 5, 6], name
        assert _close(resumed, flat, range(4, 7), 1e-5) == [], (name, resumed, flat)


@pytest.mark.heavy
def test_dp_replicate_must_divide_world_size(tmp_path):
    run = _run(2, "--model", "tiny", "--steps", "1", "--dp-replicate", "3")
    assert run.returncode == 1, failure(run)
    assert "error: --dp-replicate 3: 3 replicas do not divide the world size 2" in run.stderr, failure(run)
    run = _run(2, "--model", "tiny", "--steps", "1", "--hfsdp")
    assert run.returncode == 1, failure(run)
    assert "error: --hfsdp needs --dp-replicate" in run.stderr, failure(run)


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_comm_stream_without_a_gpu_is_refused_in_one_line(tmp_path):
    run = _run(2, "--model", "tiny", "--steps", "1", "--comm-stream")
    assert run.returncode == 1, failure(run)
    error = "error: --comm-stream needs a GPU (CUDA is not available here); leave it out on CPU"
    assert run.stderr.splitlines()[0] == error and run.stderr.count(error) == 1, failure(run)  # rank 0 speaks

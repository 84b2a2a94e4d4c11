"""Asynchronous save on real gloo ranks: training with a save every step is bitwise the training
without, every checkpoint verifies and loads back the state of its step, is indistinguishable
from a synchronous one, a failure in the background surfaces once as one line and leaves nothing
behind, at most one save is in flight, refusals come before returning, and the trainer's
``--async-save`` resumes bitwise."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

import mfsdp_ckpt
from mfsdp_ckpt import CheckpointError
from mfsdp_ckpt.read.locate import chunk_table
from mfsdp_ckpt.sharded.in_flight import in_flight
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from tests.faults import FullDisk
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps
from tests.torchrun import failure, read_metrics, run_train

ASYNC = importlib.import_module(
    "mfsdp_ckpt.sharded.async_save"
)  # the module (``mfsdp_ckpt.async_save`` is the function)
STEPS = 20


def _latest(run: str) -> str:
    with open(os.path.join(run, "latest")) as f:
        return f.read().strip()


def _manifest(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "mfsdp.json")) as f:
        return json.load(f)


def _partials(run: str) -> list[str]:
    return [n for n in os.listdir(run) if ".partial-" in n]


# ---- a save every step --------------------------------------------------------------------------

SLOW_COPY_S = 0.1  # the background copy is made slower than the next forward and backward: the step must wait


def _train_with_async_saves(run: str) -> dict:
    ref_model, ref_optim = build("optim_grads_params", "row")
    reference = train_steps(ref_model, ref_optim, 0, STEPS)
    model, optim = build("optim_grads_params", "row")
    losses, states, buffers, fenced = [], {}, set(), []
    handle = None
    real_fill = ASYNC.HostStaging.fill

    def slow_fill(self, staged):
        time.sleep(SLOW_COPY_S)
        return real_fill(self, staged)

    ASYNC.HostStaging.fill = slow_fill
    try:
        for step in range(1, STEPS + 1):
            losses += train_steps(model, optim, step - 1, step)
            if handle is not None:
                fenced.append(handle.fence_s)
            states[step] = owned_pieces(model, optim)  # the state at save time
            handle = mfsdp_ckpt.async_save(
                os.path.join(run, f"step_{step:02d}"), model, optim, extra={"step": step}, step=step
            )
            buffers.add(ASYNC._state.staging._buffer.data_ptr())
        handle.result()
    finally:
        ASYNC.HostStaging.fill = real_fill
    # every checkpoint loads back the state of its step (into a model that trained elsewhere)
    mismatches = []
    for step in range(1, STEPS + 1):
        fresh, fresh_optim = build("optim_grads_params", "row", seed=7)
        extra = mfsdp_ckpt.load(os.path.join(run, f"step_{step:02d}"), fresh, fresh_optim)
        got = owned_pieces(fresh, fresh_optim)
        mismatches += [f"step {step}: {k}" for k, (lo, hi, v) in states[step].items() if not torch.equal(got[k][2], v)]
        mismatches += [f"step {step}: extra {extra}"] if extra["step"] != step else []
    state_bytes = sum(
        v.numel() * v.element_size() for k, (_, _, v) in states[STEPS].items() if not k.startswith("main.")
    )
    return {
        "losses": losses,
        "reference": reference,
        "mismatches": mismatches,
        "buffers": len(buffers),
        "staging": ASYNC.staging_bytes(),
        "state_bytes": state_bytes,
        "fenced": sum(s > 0 for s in fenced),
    }


def test_a_save_every_step_changes_no_loss_and_every_checkpoint_is_its_step(ranks, tmp_path):
    run = str(tmp_path / "run")
    out = ranks(_train_with_async_saves, 2, run, timeout=300)
    for rank, r in enumerate(out):
        assert r["losses"] == r["reference"], f"rank {rank}: saving changed the losses"  # exact floats
        assert not r["mismatches"], r["mismatches"][:5]  # without the fence: the next step's values
        assert r["fenced"] >= STEPS // 2, r["fenced"]  # the steps did wait for the copy (the case tests the fence)
        assert r["buffers"] == 1, "the staging buffer was reallocated"
        assert r["state_bytes"] <= r["staging"] <= 1.1 * r["state_bytes"] + 64 * 1024, (r["staging"], r["state_bytes"])
    assert _latest(run) == f"step_{STEPS:02d}" and not _partials(run)
    for step in range(1, STEPS + 1):
        assert verify_checkpoint(os.path.join(run, f"step_{step:02d}")) == [], step


def _sync_and_async(root: str) -> None:
    model, optim = build("optim_grads", "even")
    train_steps(model, optim, 0, 3, zero_grad_last=False)  # with gradients, mid accumulation
    rng = torch.get_rng_state()
    extra = {"step": 3, "tensor": torch.arange(4.0), "nested": {"lr": [1e-3, 2e-3]}}
    mfsdp_ckpt.save(os.path.join(root, "sync", "step_3"), model, optim, extra=extra, step=3, include_grads=True)
    torch.set_rng_state(rng)
    handle = mfsdp_ckpt.async_save(
        os.path.join(root, "async", "step_3"), model, optim, extra=extra, step=3, include_grads=True
    )
    extra["tensor"].add_(1)  # changed after the call: the checkpoint holds the values at the call
    extra["nested"]["lr"][0] = 0.0
    handle.result()


def test_an_async_checkpoint_is_indistinguishable_from_a_sync_one(ranks, tmp_path):
    ranks(_sync_and_async, 2, str(tmp_path), timeout=120)
    a, b = str(tmp_path / "sync" / "step_3"), str(tmp_path / "async" / "step_3")
    assert verify_checkpoint(b) == [] and diff_checkpoints(a, b).equal
    assert any(k.startswith("grad.") for k in chunk_table(b))
    ma, mb = (_manifest(d) for d in (a, b))
    assert sorted(k for k in ma if ma[k] != mb[k]) == ["created_unix", "manifest_crc32c", "metadata_crc32c", "save_id"]
    from torch.distributed.checkpoint import FileSystemReader

    da, db = FileSystemReader(a).read_metadata(), FileSystemReader(b).read_metadata()
    assert da.state_dict_metadata == db.state_dict_metadata and da.storage_data == db.storage_data


# ---- failures in the background -----------------------------------------------------------------


@contextlib.contextmanager
def _full_disk_on_rank(rank: int):
    """The data files this rank writes run out of space mid-write."""
    real = pathlib.Path.open

    def full_open(self, mode="r", *args, **kwargs):
        f = real(self, mode, *args, **kwargs)
        return FullDisk(f, 1000) if "w" in mode and self.name.endswith(".distcp") and dist.get_rank() == rank else f

    pathlib.Path.open = full_open
    try:
        yield
    finally:
        pathlib.Path.open = real


def _failures(run: str) -> dict:
    model, optim = build("optim_grads_params", "row")

    def path(step: int) -> str:
        return os.path.join(run, f"step_{step}")

    out = {}
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.async_save(path(1), model, optim, step=1).result()
    # a failure reported by the next async_save
    with _full_disk_on_rank(1):
        failed = mfsdp_ckpt.async_save(path(2), model, optim, step=2)
        failed.wait()
    out["after_first"] = (_latest(run), _partials(run), os.path.exists(path(2)))
    try:
        mfsdp_ckpt.async_save(path(3), model, optim, step=3)
        out["next"] = None
    except CheckpointError as e:
        out["next"] = str(e)
    out["not_started"] = os.path.exists(path(3)) or _partials(run) != []
    with pytest.raises(CheckpointError, match="No space left"):
        failed.result()  # the handle still tells, as often as asked
    mfsdp_ckpt.async_save(path(3), model, optim, step=3).result()  # called again: saved
    out["after_retry"] = _latest(run)
    # a failure reported by result(): the next async_save does not raise it again
    with _full_disk_on_rank(0):
        failed = mfsdp_ckpt.async_save(path(4), model, optim, step=4)
        try:
            failed.result()
            out["result"] = None
        except CheckpointError as e:
            out["result"] = str(e)
    out["after_second"] = (_latest(run), _partials(run), os.path.exists(path(4)))
    mfsdp_ckpt.async_save(path(5), model, optim, step=5).result()
    out["last"] = _latest(run)
    return out


def test_a_background_failure_surfaces_once_as_one_line_and_leaves_nothing(ranks, tmp_path):
    run = str(tmp_path / "run")
    out = ranks(_failures, 2, run, timeout=180)
    assert out[0] == out[1]  # every rank alike
    r = out[0]
    assert r["after_first"] == ("step_1", [], False)
    msg = r["next"]
    assert msg is not None and "\n" not in msg, msg
    assert msg.startswith(
        f"the previous asynchronous save ({run}/step_2) failed: No space left on device while writing "
    ), msg
    assert msg.endswith(f"{run}/step_3 was not started (call async_save again)"), msg
    assert not r["not_started"]
    assert r["after_retry"] == "step_3"
    assert r["result"] is not None and "\n" not in r["result"]
    assert r["result"].startswith("No space left on device while writing ") and ".step_4.partial-" in r["result"]
    assert r["after_second"] == ("step_3", [], False)
    assert r["last"] == "step_5"
    for step in (1, 3, 5):
        assert verify_checkpoint(os.path.join(run, f"step_{step}")) == []


# ---- at most one in flight ----------------------------------------------------------------------

SLOW_S = 1.5


def _one_in_flight(run: str) -> dict:
    model, optim = build("optim_grads", "row")
    train_steps(model, optim, 0, 1)
    real = CommittingWriter.write_data

    def slow(self, plan, planner):
        time.sleep(SLOW_S)
        return real(self, plan, planner)

    CommittingWriter.write_data = slow
    try:
        first = mfsdp_ckpt.async_save(os.path.join(run, "step_1"), model, optim, step=1)
        first_blocked = first.blocked_s
        train_steps(model, optim, 1, 2)  # training goes on while step 1 is written
        second = mfsdp_ckpt.async_save(os.path.join(run, "step_2"), model, optim, step=2)
        seen = {
            "first_done": first.done(),
            "latest": _latest(run),
            "step_2": os.path.exists(os.path.join(run, "step_2")),
        }
        second.result()
        seen["latest_after"] = _latest(run)
        # a synchronous save waits for the save in flight too
        third = mfsdp_ckpt.async_save(os.path.join(run, "step_3"), model, optim, step=3)
        mfsdp_ckpt.save(os.path.join(run, "step_4"), model, optim, step=4)
        seen["third_done_before_sync"] = third.done()
        seen["third"] = third.result()
    finally:
        CommittingWriter.write_data = real
    created = [_manifest(os.path.join(run, f"step_{s}"))["created_unix"] for s in (1, 2, 3, 4)]
    return {
        **seen,
        "first_blocked": first_blocked,
        "second_waited": second.waited_s,
        "first_total": first.total_s,
        "ordered": created == sorted(created),
        "latest_end": _latest(run),
    }


@pytest.mark.heavy
def test_at_most_one_save_in_flight_and_latest_in_call_order(ranks, tmp_path):
    run = str(tmp_path / "run")
    out = ranks(_one_in_flight, 2, run, timeout=180)
    for r in out:
        assert r["first_blocked"] < SLOW_S, r  # the write is not what the caller waits for
        assert r["first_done"] and r["latest"] == "step_1" and not r["step_2"], r
        assert r["second_waited"] >= SLOW_S / 2 and r["first_total"] >= SLOW_S, r
        assert r["latest_after"] == "step_2" and r["third_done_before_sync"] and r["ordered"], r
        assert r["latest_end"] == "step_4", r


# ---- refusals before returning ------------------------------------------------------------------


def _refusals(run: str) -> list:
    model, optim = build("optim_grads", "even")
    mfsdp_ckpt.save(os.path.join(run, "step_1"), model, optim, step=1)
    out = []
    cases = [
        (os.path.join(run, "step_1"), {}),  # exists
        (run, {"overwrite": True}),  # a run directory
        ("s3://bucket/step_2", {}),  # not local
        (os.path.join(run, "step_2"), {"keep": 0}),
    ]
    for path, kwargs in cases:
        said = []
        for fn in (mfsdp_ckpt.save, mfsdp_ckpt.async_save):
            try:
                fn(path, model, optim, **kwargs)
                said.append(None)
            except (CheckpointError, ValueError) as e:
                said.append((type(e).__name__, str(e)))
        out.append(said)
    out.append(in_flight() is None and sorted(os.listdir(run)))
    return out


def test_refusals_are_those_of_save_before_returning_on_every_rank(ranks, tmp_path):
    run = str(tmp_path / "run")
    out = ranks(_refusals, 2, run, timeout=120)
    assert out[0] == out[1]
    *cases, left = out[0]
    for sync, async_ in cases:
        assert sync is not None and sync == async_, (sync, async_)
    assert "already exists" in cases[0][0][1] and "a run directory" in cases[1][0][1]
    assert left == ["latest", "latest-checkpoint", "step_1"]


# ---- the trainer ----------------------------------------------------------------------------------

TRAIN = ("--model", "tiny", "--steps", "12", "--save-every", "4", "--batch-size", "4", "--seq-len", "32")


@pytest.mark.heavy
def test_the_trainer_saves_asynchronously_and_resumes_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run = run_train(2, *TRAIN, "--ckpt-dir", str(a), "--metrics", str(tmp_path / "a.jsonl"), "--async-save")
    assert run.returncode == 0, failure(run)
    for step in (4, 8, 12):
        assert f"saved step_{step:06d} (async): blocked " in run.stdout, run.stdout
    assert _latest(str(a)) == "step_000012"
    run = run_train(
        2, *TRAIN, "--ckpt-dir", str(b), "--metrics", str(tmp_path / "b.jsonl"), "--async-save", "--stop-at", "6"
    )
    assert run.returncode == 0, failure(run)
    assert "saved step_000006 (async)" in run.stdout and _latest(str(b)) == "step_000006"
    run = run_train(2, *TRAIN, "--ckpt-dir", str(b), "--metrics", str(tmp_path / "b.jsonl"), "--async-save", "--resume")
    assert run.returncode == 0, failure(run)
    ma, mb = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [ma[s] for s in range(1, 13)] == [mb[s] for s in range(1, 13)]  # exact floats: bitwise
    assert diff_checkpoints(str(a / "step_000012"), str(b / "step_000012")).equal
    for d in (a, b):
        for name in os.listdir(d):
            if name.startswith("step_"):
                assert verify_checkpoint(str(d / name)) == [], name


def test_async_save_without_a_checkpoint_directory_is_one_line():
    run = run_train(None, "--model", "tiny", "--steps", "1", "--async-save")
    assert (
        run.returncode == 1
        and run.stderr.strip() == "error: --async-save needs --ckpt-dir (without one the run saves nothing)"
    ), failure(run)


@pytest.mark.heavy
def test_an_mxfp8_bf16_run_saves_the_same_checkpoint_asynchronously(tmp_path):
    """fp8 / e8m0 planes and bf16 weights with fp32 main params, staged and written as ``save`` writes them."""
    args = (
        "--model",
        "tiny",
        "--steps",
        "2",
        "--mxfp8",
        "--param-dtype",
        "bfloat16",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
    )
    for name, flags in (("sync", ()), ("async", ("--async-save",))):
        run = run_train(2, *args, "--ckpt-dir", str(tmp_path / name), *flags)
        assert run.returncode == 0, failure(run)
    a, b = str(tmp_path / "sync" / "step_000002"), str(tmp_path / "async" / "step_000002")
    assert verify_checkpoint(b) == [] and diff_checkpoints(a, b).equal
    from torch.distributed.checkpoint import FileSystemReader

    assert (
        FileSystemReader(a).read_metadata().state_dict_metadata
        == FileSystemReader(b).read_metadata().state_dict_metadata
    )

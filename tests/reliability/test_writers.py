"""What writers refuse and what they leave behind: no destination that would lose data, one
writer per run directory, no leftovers after a kill, a full disk in one line with the previous
state untouched, bounded open files and world sizes, a missing bucket, and one line for any error
in the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt import CheckpointError, RunLockedError
from mfsdp_ckpt.format.names import LOCK_NAME
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.faults import FullDisk
from tests.mfsdp_ckpt.util import build, train_steps
from tests.torchrun import ENV, ROOT, failure, run_train

CLI = [sys.executable, "-m", "cli.main"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _save_run(root, steps=(1, 2)) -> list[str]:
    """A run directory with committed checkpoints (one process, no process group)."""
    model, optim = build("optim_grads_params", "row")
    out = []
    for step in steps:
        train_steps(model, optim, step - 1, step)
        out.append(mfsdp_ckpt.save(os.path.join(root, f"step_{step}"), model, optim, extra={"step": step}, step=step))
    return out


def _tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


# ---- destinations that would lose data ------------------------------------------------------


@pytest.fixture
def run(tmp_path) -> str:
    root = str(tmp_path / "run")
    _save_run(root)
    return root


@pytest.mark.heavy
def test_overwrite_never_deletes_a_source_or_a_run(run, tmp_path):
    src = os.path.join(run, "step_1")
    before = _tree(run)
    # the run directory holding SRC, and SRC itself, as DST of every writer
    for args, needle in [
        (["reshard", src, run, "--world-size", "2", "--overwrite"], "contains the source"),
        (["reshard", src, src, "--world-size", "2", "--overwrite"], "contains the source"),
        (["export-hf", src, run, "--overwrite"], "contains the source"),
        (["reshard", src, os.path.join(src, "sub"), "--world-size", "2"], "lies inside the source"),
        (["convert", src, os.path.join(src, "x.pt"), "--to", "torch"], "lies inside the source"),
    ]:
        _one_line_error(_cli(*args), needle)
    # a run directory that holds other checkpoints (not the source) is not replaced either
    other = str(tmp_path / "other")
    _save_run(other, steps=(1,))
    _one_line_error(_cli("reshard", src, other, "--world-size", "2", "--overwrite"), "holds other checkpoints")
    assert _tree(run) == before and verify_checkpoint(src) == [] and os.path.isdir(os.path.join(other, "step_1"))


@pytest.mark.heavy
def test_overwrite_refuses_what_is_not_a_checkpoint_and_symlinks(run, tmp_path):
    src = os.path.join(run, "step_1")
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    _one_line_error(
        _cli("reshard", src, str(home), "--world-size", "2", "--overwrite"), "is not a checkpoint directory"
    )
    _one_line_error(_cli("export-hf", src, str(home), "--overwrite"), "is not a Hugging Face model directory")
    assert (home / "thesis.tex").read_text() == "years of work"
    # a symbolic link to a checkpoint: refused, and nothing (no .replaced-*) left beside it
    target = str(tmp_path / "w2")
    assert _cli("reshard", src, target, "--world-size", "2").returncode == 0
    link = tmp_path / "link"
    link.symlink_to(target)
    _one_line_error(_cli("reshard", src, str(link), "--world-size", "3", "--overwrite"), "is a symbolic link")
    assert sorted(os.listdir(tmp_path)) == ["home", "link", "run", "w2"]
    # an empty directory or a checkpoint of its own may be replaced
    (tmp_path / "empty").mkdir()
    assert _cli("reshard", src, str(tmp_path / "empty"), "--world-size", "2", "--overwrite").returncode == 0
    assert _cli("reshard", src, target, "--world-size", "3", "--overwrite").returncode == 0
    assert verify_checkpoint(target) == []


@pytest.mark.heavy
def test_trainer_refuses_a_directory_holding_a_run_unless_resumed(tmp_path):
    args = (
        "--model",
        "tiny",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--ckpt-dir",
        str(tmp_path / "r"),
    )
    first = run_train(None, *args)
    assert first.returncode == 0, failure(first)
    latest = (tmp_path / "r" / "latest").read_text()
    again = run_train(None, *args)
    assert again.returncode == 1 and "already holds checkpoints (step_000002); pass --resume" in again.stderr, failure(
        again
    )
    assert (tmp_path / "r" / "latest").read_text() == latest
    resumed = run_train(None, *args, "--resume")
    assert resumed.returncode == 0, failure(resumed)


# ---- one writer per run directory -------------------------------------------------------------

_HOLD = "import sys, time, mfsdp_ckpt\nwith mfsdp_ckpt.run_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n"


def _hold_lock(path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_until_the_first_is_gone(run, tmp_path):
    holder = _hold_lock(run)
    try:
        model, optim = build("optim", "even")
        with pytest.raises(RunLockedError, match=rf"another job is writing checkpoints here \(host .*pid {holder.pid}"):
            mfsdp_ckpt.save(os.path.join(run, "step_9"), model, optim)
        assert not os.path.exists(os.path.join(run, "step_9"))
        res = _cli("ls", run, "--clean")
        _one_line_error(res, "another job is writing checkpoints here")
        trainer = run_train(None, "--model", "tiny", "--steps", "2", "--ckpt-dir", run, "--resume")
        assert trainer.returncode == 1 and "another job is writing checkpoints here" in trainer.stderr, failure(trainer)
    finally:
        holder.kill()  # SIGKILL: nothing cleans up; the kernel releases the lock
        holder.wait()
    mfsdp_ckpt.save(os.path.join(run, "step_9"), model, optim)
    assert verify_checkpoint(os.path.join(run, "step_9")) == [] and not os.path.exists(os.path.join(run, LOCK_NAME))


@pytest.mark.heavy
def test_two_trainers_on_one_directory(tmp_path):
    ckpt = tmp_path / "r"
    args = ("--model", "tiny", "--batch-size", "4", "--seq-len", "16", "--ckpt-dir", str(ckpt), "--save-every", "1")
    from tests.torchrun import train_cmd

    first = subprocess.Popen(
        train_cmd(None, *args, "--steps", "100000"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (ckpt / "latest").exists() and time.time() < deadline:
            time.sleep(0.1)
        second = run_train(None, *args, "--steps", "3", "--resume")
        assert second.returncode == 1 and "another job is writing checkpoints here" in second.stderr, failure(second)
        assert f"pid {first.pid}" in second.stderr
    finally:
        first.kill()
        first.wait()


# ---- leftovers of killed writers -------------------------------------------------------------


def test_leftovers_are_removed_by_the_next_save_and_by_ls_clean(run):
    for name in (".step_3.partial-0123456789ab", ".step_1.replaced-42-42"):
        os.makedirs(os.path.join(run, name, "sub"))
        with open(os.path.join(run, name, "__0_0.distcp"), "wb") as f:
            f.write(b"x" * 100)
    assert "UNCOMMITTED" in _cli("ls", run).stdout
    _save_run(run, steps=(3,))
    assert not [n for n in os.listdir(run) if ".partial-" in n or ".replaced-" in n]
    os.makedirs(os.path.join(run, ".step_4.partial-0123456789ab"))
    res = _cli("ls", run, "--clean")
    assert res.returncode == 0 and "removed" in res.stderr and ".step_4.partial-" in res.stderr
    assert not [n for n in os.listdir(run) if ".partial-" in n] and "UNCOMMITTED" not in res.stdout


# ---- a full disk ------------------------------------------------------------------------------


def _fill_disk_after(monkeypatch, module, room: int, match: str) -> None:
    """``open`` in ``module`` gives files that run out of space, for paths containing ``match``."""
    import builtins

    real = builtins.open

    def fake_open(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        return FullDisk(f, room) if "w" in mode and match in os.fspath(path) else f

    monkeypatch.setattr(module, "open", fake_open, raising=False)


def test_a_full_disk_during_a_save_is_one_line_and_changes_nothing(run, monkeypatch):
    import pathlib

    before = _tree(run)
    latest = open(os.path.join(run, "latest")).read()
    real_open = pathlib.Path.open

    def full_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return FullDisk(f, 1000) if "w" in mode and self.name.endswith(".distcp") else f

    monkeypatch.setattr(pathlib.Path, "open", full_open)
    model, optim = build("optim_grads_params", "row")
    with pytest.raises(
        CheckpointError, match=r"^No space left on device while writing .*/\.step_3\.partial-\w+/__0_0\.distcp$"
    ):
        mfsdp_ckpt.save(os.path.join(run, "step_3"), model, optim)
    monkeypatch.undo()
    assert _tree(run) == before and open(os.path.join(run, "latest")).read() == latest


def test_a_full_disk_when_moving_latest_keeps_the_previous_latest(run, monkeypatch):
    import mfsdp_ckpt.storage.staging as staging

    latest = open(os.path.join(run, "latest")).read()
    _fill_disk_after(monkeypatch, staging, 0, ".latest.partial-")
    model, optim = build("optim_grads_params", "row")
    with pytest.raises(CheckpointError, match=r"^No space left on device while writing .*/latest$"):
        mfsdp_ckpt.save(os.path.join(run, "step_3"), model, optim)
    monkeypatch.undo()
    assert open(os.path.join(run, "latest")).read() == latest  # the new checkpoint is complete, not yet latest
    assert verify_checkpoint(os.path.join(run, "step_3")) == []
    assert not [n for n in os.listdir(run) if ".partial-" in n]


def test_a_full_disk_in_offline_writers_is_one_line_and_leaves_nothing(run, tmp_path, monkeypatch):
    import mfsdp_ckpt.storage.fs as fsmod

    src = os.path.join(run, "step_2")
    real = fsmod.open_file

    def full(path, mode="rb"):
        f = real(path, mode)
        return FullDisk(f, 5000) if "w" in mode else f

    monkeypatch.setattr(fsmod, "open_file", full)
    from mfsdp_ckpt.sharded.reshard import reshard

    with pytest.raises(CheckpointError, match=r"^No space left on device while writing .*__\d+_0\.distcp$"):
        reshard(src, tmp_path / "w3", world_size=3)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB file system (tmpfs), where the machine permits mounting one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({res.stderr.strip()}); the injected-ENOSPC tests above cover the same paths"
        )
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: str, leave: int) -> None:
    with open(os.path.join(path, f"ballast{time.time_ns()}"), "wb") as f:
        f.write(b"\0" * max(_free_bytes(path) - leave, 0))


@pytest.mark.heavy
def test_a_really_full_disk(run, small_disk):
    """A training run whose disk fills up between two saves, then the offline writers on that
    disk: one line each, nothing half-written, the previous checkpoint and ``latest`` kept."""
    ckpt = os.path.join(small_disk, "r")
    args = ("--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--ckpt-dir", ckpt)
    first = run_train(None, *args, "--stop-at", "1")
    assert first.returncode == 0, failure(first)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    _fill(small_disk, leave=size // 2)
    second = run_train(None, *args, "--resume")
    assert second.returncode == 1, failure(second)
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "No space left on device while writing" in errors[0], second.stderr[-2000:]
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step_000001"
    assert verify_checkpoint(os.path.join(ckpt, "latest")) == []
    assert not [n for n in os.listdir(ckpt) if ".partial-" in n or n == "step_000002"]
    _fill(small_disk, leave=4096)
    src = os.path.join(run, "step_2")
    for cmd in (
        ["reshard", src, os.path.join(small_disk, "w2"), "--world-size", "2"],
        ["convert", src, os.path.join(small_disk, "x.pt"), "--to", "torch"],
        ["export-hf", os.path.join(ckpt, "latest"), os.path.join(small_disk, "hf")],
    ):
        _one_line_error(_cli(*cmd), "No space left on device while writing")
    assert sorted(n for n in os.listdir(small_disk) if not n.startswith("ballast")) == ["r"]


# ---- bounds -----------------------------------------------------------------------------------


def test_reshard_to_more_ranks_than_open_files(run, tmp_path):
    """Each target file is closed once written: 300 ranks under a limit of 64 open files."""
    code = (
        "import resource, sys\nresource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from mfsdp_ckpt.sharded.reshard import reshard\nprint(reshard(sys.argv[1], sys.argv[2], world_size=300).files)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, os.path.join(run, "step_2"), str(tmp_path / "w300")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert verify_checkpoint(tmp_path / "w300") == []
    assert len([n for n in os.listdir(tmp_path / "w300") if n.endswith(".distcp")]) == int(res.stdout.strip())


def test_world_size_is_bounded(run, tmp_path):
    res = _cli("reshard", os.path.join(run, "step_2"), str(tmp_path / "w"), "--world-size", str(10**9))
    _one_line_error(res, "--world-size must be <= 65536, got 1000000000")


def test_a_bucket_that_does_not_exist(run, s3_endpoint):
    start = time.time()
    res = subprocess.run(
        [*CLI, "reshard", os.path.join(run, "step_2"), "s3://no-such-bucket/x", "--world-size", "2"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ENV["PYTHONPATH"]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line_error(res, "s3://no-such-bucket does not exist")
    assert time.time() - start < 120


# ---- the CLI's error boundary ------------------------------------------------------------------


def test_any_error_is_one_line_and_debug_shows_the_traceback(run, monkeypatch):
    import mfsdp_ckpt.tools.inspect as inspect_mod

    def broken(path):
        raise KeyError("a bug somewhere")

    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", broken)
    res = CliRunner().invoke(main, ["inspect", run])
    assert res.exit_code == 1 and res.output.strip().splitlines() == [
        "error: KeyError: 'a bug somewhere' (an internal error: run with --debug for the traceback)"
    ]
    res = CliRunner().invoke(main, ["--debug", "inspect", run])
    assert isinstance(res.exception, KeyError)
    monkeypatch.setattr(
        inspect_mod,
        "inspect_checkpoint",
        lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied", path)),
    )
    res = CliRunner().invoke(main, ["inspect", run])
    assert res.exit_code == 1 and res.output.strip() == f"error: {run}: Permission denied"


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_resume_from_a_checkpoint_without_trainer_state_is_one_line(tmp_path):
    from mfsdp_ckpt.read.reader import CheckpointReader
    from mfsdp_ckpt.write.builder import CheckpointBuilder

    args = ("--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "16")
    first = run_train(None, *args, "--stop-at", "1", "--ckpt-dir", str(tmp_path / "a"))
    assert first.returncode == 0, failure(first)
    with CheckpointReader(str(tmp_path / "a" / "latest")) as src:
        manifest = {k: v for k, v in src.manifest.items() if k in ("writer", "model_config", "step", "versions")}
        with CheckpointBuilder(str(tmp_path / "b"), manifest) as b:
            for key in src.keys():
                if not key.startswith("extra."):
                    value = src.read(key)
                    (b.add_tensor if hasattr(value, "dtype") else b.add_object)(key, value)
            b.commit()
    res = run_train(None, *args, "--ckpt-dir", str(tmp_path / "c"), "--resume", str(tmp_path / "b"))
    assert res.returncode == 1 and "holds no trainer state (extra.step, extra.data_position)" in res.stderr, failure(
        res
    )


def test_reshard_never_plans_from_a_declared_model_config(run, tmp_path):
    """A manifest saying num_layers = 10**7 and recording no plan: refused at once (offline
    layouts come only from recorded plans, never from a model built from a config)."""
    from mfsdp_ckpt.read.reader import CheckpointReader
    from mfsdp_ckpt.write.builder import CheckpointBuilder
    from mfsdp_core.models.gpt import PRESETS

    config = dict(PRESETS["tiny"].to_dict(), num_layers=10**7)
    with CheckpointReader(os.path.join(run, "step_2")) as src:
        with CheckpointBuilder(str(tmp_path / "huge"), {"writer": {"world_size": 1}, "model_config": config}) as b:
            b.add_tensor("model.inp.weight", src.read("model.inp.weight"))
            b.commit()
    start = time.time()
    res = _cli("reshard", str(tmp_path / "huge"), str(tmp_path / "out"), "--world-size", "4")
    _one_line_error(res, "records no placement plan")
    assert time.time() - start < 60 and not os.path.exists(tmp_path / "out")

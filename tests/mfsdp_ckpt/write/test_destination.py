"""The one destination seam (``mfsdp_ckpt.write.destination``): which kind of place a path is,
decided once, and the verbs of the commit protocol on a local file system."""

from __future__ import annotations

import os

import pytest

from mfsdp_ckpt.errors import CheckpointExistsError, ConversionError, RunLockedError
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME, MANIFEST_NAME
from mfsdp_ckpt.storage.lock import run_lock
from mfsdp_ckpt.write.destination import (
    FileDestination,
    LocalDestination,
    ObjectStoreDestination,
    destination_for,
)


def test_a_path_is_classified_once():
    assert type(destination_for("/tmp/x")) is LocalDestination
    assert type(destination_for("s3://bucket/run/step_1")) is ObjectStoreDestination
    assert type(destination_for("s3://bucket/model.pt", kind="file")) is FileDestination
    with pytest.raises(ConversionError, match="the HF directory must be a local path"):
        destination_for("s3://bucket/hf", kind="hf")
    with pytest.raises(ValueError, match="destination kind 'zip'"):
        destination_for("/tmp/x", kind="zip")


def test_nothing_is_visible_before_the_commit(tmp_path):
    final = tmp_path / "run" / "step_1"
    with destination_for(final) as d:
        staging = d.open()
        assert os.path.dirname(staging) == str(tmp_path / "run") and ".partial-" in staging
        assert not final.exists()
        with pytest.raises(RunLockedError):  # the parent is locked while it is written
            _lock_elsewhere(tmp_path / "run")
        (tmp_path / "run" / os.path.basename(staging) / MANIFEST_NAME).write_text("{}")
        d.commit()
    assert (final / MANIFEST_NAME).exists()
    assert os.listdir(tmp_path / "run") == ["step_1"]


def test_an_abort_leaves_nothing_and_releases_the_lock(tmp_path):
    final = tmp_path / "step_1"
    d = destination_for(final)
    staging = d.open()
    open(os.path.join(staging, "__0_0.distcp"), "wb").close()
    d.abort()
    assert os.listdir(tmp_path) == []
    with destination_for(final) as again:  # the lock was released
        again.open()


def test_an_existing_checkpoint_needs_overwrite_and_uncommit_removes_its_manifest_first(tmp_path):
    final = tmp_path / "step_1"
    final.mkdir()
    (final / MANIFEST_NAME).write_text("{}")
    with pytest.raises(CheckpointExistsError):
        destination_for(final).check()
    destination_for(final).check(overwrite=True)
    destination_for(final).uncommit()
    assert not final.exists()


def test_leftovers_of_killed_writers_are_removed_when_opened(tmp_path):
    (tmp_path / ".step_1.partial-dead").mkdir()
    (tmp_path / ".step_2.partial-dead").mkdir()
    with destination_for(tmp_path / "step_1") as d:  # an offline tool: its own leftovers only
        d.open()
    assert sorted(os.listdir(tmp_path)) == [".step_2.partial-dead"]
    with destination_for(tmp_path / "step_3") as d:  # a save: the run directory's
        d.open(clean_parent=True)
    assert os.listdir(tmp_path) == []


def test_point_latest_writes_the_pointer_and_the_link(tmp_path):
    (tmp_path / "step_1").mkdir()
    destination_for(tmp_path / "step_1").point_latest()
    assert (tmp_path / LATEST_NAME).read_text() == "step_1\n"
    assert os.readlink(tmp_path / LATEST_LINK_NAME) == "step_1"


def _lock_elsewhere(path) -> None:
    """Take ``path``'s writer lock in another process (this one's is re-entrant)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        error = pool.apply(_try_lock, (str(path),))
    if error:
        raise RunLockedError(error)


def _try_lock(path: str) -> str | None:
    try:
        with run_lock(path):
            return None
    except RunLockedError as e:
        return str(e)

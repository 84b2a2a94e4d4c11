"""``mfsdp_ckpt.storage.staging``: the one spelling of a partial sibling, the directory commit and the
atomic single-file write that every writer uses."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mfsdp_ckpt import CheckpointExistsError
from mfsdp_ckpt.errors import WriteFailedError
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.staging import (
    commit_directory,
    is_partial_name,
    make_partial_dir,
    new_token,
    partial_path,
    write_file_atomic,
)
from mfsdp_ckpt.tools.convert import convert, write_dcp
from mfsdp_ckpt.tools.listing import list_checkpoints


def test_partial_path_is_a_hidden_sibling_named_by_the_token(tmp_path):
    final = str(tmp_path / "step_100")
    assert partial_path(final, "abc") == str(tmp_path / ".step_100.partial-abc")
    assert partial_path(final + "/", "abc") == str(tmp_path / ".step_100.partial-abc")
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100 and all(re.fullmatch(r"[0-9a-f]{12}", t) for t in tokens)
    assert is_partial_name(os.path.basename(partial_path(final, new_token())))
    assert not is_partial_name("step_100")


def test_make_partial_dir_then_commit(tmp_path):
    final = str(tmp_path / "ckpt")
    tmp = make_partial_dir(final)
    assert os.path.isdir(tmp) and os.listdir(tmp) == [] and is_partial_name(os.path.basename(tmp))
    assert os.path.dirname(tmp) == str(tmp_path)
    with open(os.path.join(tmp, "a"), "w") as f:
        f.write("new")
    commit_directory(tmp, final, overwrite=False)
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(final) == ["a"]

    again = make_partial_dir(final)
    with pytest.raises(CheckpointExistsError, match="already exists"):
        commit_directory(again, final, overwrite=False)
    with open(os.path.join(again, "b"), "w") as f:
        f.write("newer")
    commit_directory(again, final, overwrite=True)
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(final) == ["b"]  # the old one is gone, nothing left aside
    deep = make_partial_dir(str(tmp_path / "new" / "parent" / "ckpt"))  # missing parents are made
    assert os.path.isdir(deep) and os.path.dirname(deep) == str(tmp_path / "new" / "parent")


def test_write_file_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = str(tmp_path / "f.bin")
    write_file_atomic(path, b"one")
    write_file_atomic(path, memoryview(b"two, longer"), sync=False)
    with open(path, "rb") as f:
        assert f.read() == b"two, longer"
    assert os.listdir(tmp_path) == ["f.bin"]

    with pytest.raises(TypeError):
        write_file_atomic(path, object())  # type: ignore[arg-type]  # fails while writing
    os.mkdir(tmp_path / "d")
    with pytest.raises(WriteFailedError, match=f"^Is a directory while writing {tmp_path / 'd'}$"):
        write_file_atomic(str(tmp_path / "d"), b"x")  # fails at the rename (a directory is there): one line naming it
    with open(path, "rb") as f:
        assert f.read() == b"two, longer"
    assert sorted(os.listdir(tmp_path)) == ["d", "f.bin"]  # no partial sibling left behind


def test_fs_write_bytes_is_atomic_locally_and_one_upload_on_a_url(tmp_path):
    fs.write_bytes(str(tmp_path / "x"), b"local")
    assert (tmp_path / "x").read_bytes() == b"local" and os.listdir(tmp_path) == ["x"]
    url = f"memory://staging-test-{os.getpid()}/x"
    fs.write_bytes(url, b"remote")
    assert fs.read_bytes(url) == b"remote"


def test_writers_leave_only_committed_entries(tmp_path):
    src = write_dcp({"model.w": torch.randn(3, 4), "extra.step": 3}, tmp_path / "dcp")
    convert(src, str(tmp_path / "full.safetensors"), "safetensors")
    convert(src, str(tmp_path / "full.pt"), "torch")
    convert(str(tmp_path / "full.pt"), str(tmp_path / "back"), "dcp")
    assert sorted(os.listdir(tmp_path)) == ["back", "dcp", "full.pt", "full.safetensors"]
    os.makedirs(partial_path(str(tmp_path / "step_9"), new_token()))  # a writer that died
    entries = {e.name: e.committed for e in list_checkpoints(tmp_path)}
    assert entries.pop(next(n for n in entries if is_partial_name(n))) is False
    assert entries == {"back": True, "dcp": True}

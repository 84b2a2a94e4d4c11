"""Hostile and damaged checkpoints in the form ``save`` writes: an index in ``mfsdp.json`` and a
record table at the end of each data file, ``.metadata`` for stock tools only. Every reader
(inspect, verify, the streaming reader, diff, ls, reshard, load, the trainer's ``--resume``
check) answers with one line of the ``CheckpointError`` family naming the file and the field,
never a traceback, a hang or a file outside the checkpoint; ``verify`` passes only what ``load``
reads, and finds a ``.metadata`` that says something else than the index."""

from __future__ import annotations

import os
import pickle
import struct

import google_crc32c
import pytest

from mfsdp_ckpt import CheckpointError
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.reliability.test_hostile_checkpoints import _errors, _faults, _outcomes, _readers
from tests.reliability.test_hostile_support import (
    edit_manifest,
    fresh_copy,
    read_json,
    read_metadata,
    save_small,
    trained_mlp,
    write_metadata,
)

pytestmark = pytest.mark.timeout(300, method="thread")  # deadline() owns SIGALRM

ROW, TRAILER = 28, 20  # the record table: rows of hash, offset, length, crc32c; magic, count, crc32c


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> str:
    run = str(tmp_path_factory.mktemp("hostile_index") / "run")
    model, optim = trained_mlp()
    save_small(os.path.join(run, "step_1"), 1, model, optim, listed=False)
    save_small(os.path.join(run, "step_2"), 2, model, optim, listed=False)
    return run


@pytest.fixture
def run(clean_run, tmp_path) -> str:
    return fresh_copy(clean_run, str(tmp_path / "run"))


def _all(run: str, tmp_path) -> dict:
    ckpt = os.path.join(run, "step_2")
    return _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path)), (str(tmp_path),))


def test_a_save_writes_an_index_and_every_reader_reads_it(run, tmp_path):
    manifest = read_json(os.path.join(run, "step_2"))
    assert "index" in manifest and "chunks" not in manifest
    out = _all(run, tmp_path)
    assert not _errors(out), _errors(out)
    assert out["verify"] == []


INDEX_EDITS = {
    # name: (edit, the field the error names)
    "files a dict": (lambda m: m["index"].update(files={}), "index.files"),
    "file name outside": (
        lambda m: m["index"]["files"][0].__setitem__(0, "../outside/secret.distcp"),
        "index.files[0][0]",
    ),
    "file size negative": (lambda m: m["index"]["files"][0].__setitem__(2, -1), "index.files[0][2]"),
    "table crc a string": (lambda m: m["index"]["files"][0].__setitem__(4, "x"), "index.files[0][4]"),
    "key where unknown": (lambda m: next(iter(m["index"]["keys"].values())).__setitem__(2, "q"), "index.keys["),
    "key dtype unknown": (lambda m: next(iter(m["index"]["keys"].values())).__setitem__(0, "float99"), "index.keys["),
    "mesh world zero": (lambda m: m["index"]["mesh"].update(world=0), "index.mesh.world"),
    "version 2": (lambda m: m["index"].update(version=2), "index.version"),
    "plan missing": (lambda m: m["writer"].pop("plan"), "writer.plan"),
}


@pytest.mark.parametrize("edit", sorted(INDEX_EDITS))
def test_wrong_typed_index_is_one_line_from_every_reader(run, tmp_path, edit):
    """Wrong types in the index, sealed with a correct checksum (a writer that knows the format):
    every reader names the file and the field."""
    change, field = INDEX_EDITS[edit]
    edit_manifest(os.path.join(run, "step_2"), change)
    out = _all(run, tmp_path)
    listed = {e.name: e for e in out.pop("ls")}
    assert listed["step_2"].committed is False and listed["step_1"].committed is True
    errors = _errors(out)
    assert set(errors) == set(out), {k: v for k, v in out.items() if k not in errors}
    for name, message in errors.items():
        assert "mfsdp.json" in message and field in message, (name, message)


def _shape_of(m: dict, key: str, shape: list) -> None:
    m["index"]["keys"][key][1] = shape


INCONSISTENT = {
    # sound types, a layout that does not add up: (edit, what the error says)
    "key shape does not fit its parameter": (
        lambda m: _shape_of(m, "model.fc1.weight", [3, 3]),
        "does not fit its layout",
    ),
    "a huge key": (lambda m: _shape_of(m, "model.fc1.weight", [2**40, 2**40]), "out of bounds"),
    "object written by no rank": (
        lambda m: m["index"]["keys"]["optim.param_groups"].__setitem__(2, 7),
        "not a rank of the job",
    ),
    "ep_ranks too short": (lambda m: m["index"].update(ep_ranks=[]), "ep_ranks"),
    # a world of 2 for 1 rank's data files is refused by the schema (test_hostile_bounds.py)
    "mesh misses a rank": (lambda m: m["index"]["mesh"]["groups"].update(tp=[[]]), "do not split the 1 ranks"),
}


@pytest.mark.parametrize("edit", sorted(INCONSISTENT))
def test_an_index_that_does_not_add_up_is_refused_by_every_reader(run, tmp_path, edit):
    change, words = INCONSISTENT[edit]
    edit_manifest(os.path.join(run, "step_2"), change)
    out = _all(run, tmp_path)
    out.pop("ls")
    errors = _errors(out)
    faults = _faults(out.pop("verify", None))
    assert "load" in errors and "read" in errors, out
    assert all(words in m and "mfsdp.json" in m for m in errors.values()), errors
    assert not faults or any(words in f for f in faults)


def _table(path: str) -> tuple[bytes, int]:
    data = open(path, "rb").read()
    rows = struct.unpack_from("<8sQI", data, len(data) - TRAILER)[1]
    return data, len(data) - TRAILER - rows * ROW


def test_a_flipped_byte_in_a_record_table_is_refused(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    path = os.path.join(ckpt, "__0_0.distcp")
    data, start = _table(path)
    flipped = bytearray(data)
    flipped[start + 10] ^= 0x01
    os.remove(path)
    open(path, "wb").write(bytes(flipped))
    errors = _errors(_all(run, tmp_path))
    for name in ("load", "read", "diff", "reshard", "verify"):
        assert "__0_0.distcp" in errors[name] and "record table checksum mismatch" in errors[name], (name, errors)


def test_a_resealed_record_table_pointing_outside_its_file_is_refused(run, tmp_path):
    """A writer that knows the format rewrites a table row to an offset past the data and seals
    the table and the index again: refused before anything is read there."""
    ckpt = os.path.join(run, "step_2")
    path = os.path.join(ckpt, "__0_0.distcp")
    data, start = _table(path)
    rows = bytearray(data[start : len(data) - TRAILER])
    h, offset, length, crc = struct.unpack_from("<QQQI", rows, 0)
    struct.pack_into("<QQQI", rows, 0, h, len(data) * 4, length, crc)
    crc_rows = google_crc32c.value(bytes(rows))
    trailer = struct.pack("<8sQI", b"MFSDPRT1", len(rows) // ROW, crc_rows)
    os.remove(path)
    open(path, "wb").write(data[:start] + bytes(rows) + trailer)
    edit_manifest(ckpt, lambda m: m["index"]["files"][0].__setitem__(4, crc_rows))
    errors = _errors(_all(run, tmp_path))
    assert "load" in errors and "out-of-file records" in errors["load"], errors


def test_a_truncated_data_file_names_the_file(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    path = os.path.join(ckpt, "__0_0.distcp")
    data = open(path, "rb").read()
    os.remove(path)
    open(path, "wb").write(data[: len(data) // 2])
    out = _all(run, tmp_path)
    errors = _errors(out)
    assert "truncated" in errors["load"] and "__0_0.distcp" in errors["load"], errors
    assert "verify" in errors or any("truncated" in f for f in _faults(out["verify"]))


def test_a_metadata_that_disagrees_with_the_index_fails_verify_only(run, tmp_path):
    """``.metadata`` is for stock tools: a changed one (resealed by a writer that knows the format)
    does not reach our readers, and ``verify`` names what differs."""
    ckpt = os.path.join(run, "step_2")
    metadata = read_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn == "model.fc1.weight")
    metadata.storage_data[index].offset += 1
    write_metadata(ckpt, metadata)
    out = _all(run, tmp_path)
    errors = _errors(out)
    assert not {k: v for k, v in errors.items() if k != "verify"}, errors
    # the moved chunk now overlaps its neighbour: .metadata's own checks refuse it, naming it
    assert "model.fc1.weight" in errors["verify"] and ".metadata" in errors["verify"], errors
    # moved where nothing overlaps (past the records): verify compares it with the record table
    metadata = read_metadata(ckpt)
    metadata.storage_data[index].offset += 10**6
    write_metadata(ckpt, metadata)
    faults = [str(f) for f in verify_checkpoint(ckpt)]
    assert any("model.fc1.weight" in f and "the record table places it at" in f for f in faults), faults


def test_a_hostile_pickle_as_metadata_is_never_loaded(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    victim = tmp_path / "pwned"

    class _Opens:
        def __reduce__(self):
            return (open, (str(victim), "w"))

    payload = pickle.dumps(_Opens())
    os.remove(os.path.join(ckpt, ".metadata"))
    open(os.path.join(ckpt, ".metadata"), "wb").write(payload)
    edit_manifest(ckpt, lambda m: m.update(metadata_crc32c=google_crc32c.value(payload)))
    out = _all(run, tmp_path)
    errors = _errors(out)
    assert set(errors) == {"verify"}, errors
    assert "refusing to load" in errors["verify"], errors
    assert not victim.exists()


def test_a_fifo_as_data_file_blocks_no_reader(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    os.remove(os.path.join(ckpt, "__0_0.distcp"))
    os.mkfifo(os.path.join(ckpt, "__0_0.distcp"))
    errors = _errors(_all(run, tmp_path))
    assert "load" in errors and "__0_0.distcp" in errors["load"], errors


def test_every_reader_refuses_a_checkpoint_whose_index_needs_a_missing_file(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    os.remove(os.path.join(ckpt, "__0_0.distcp"))
    errors = _errors(_all(run, tmp_path))
    for name in ("load", "read", "diff"):
        assert "__0_0.distcp" in errors[name], (name, errors)
    with pytest.raises(CheckpointError):
        verify_checkpoint(ckpt)

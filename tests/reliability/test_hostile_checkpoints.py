"""Hostile and damaged checkpoints, one reproduced problem per test: every reader (inspect,
verify, the streaming reader, diff, ls, reshard, load, the trainer's ``--resume`` check) answers
with one line of the ``CheckpointError`` family, never a traceback, never a hang, never a file
outside the checkpoint; ``verify`` passes only what ``load`` reads. See "What readers refuse" in
docs/checkpoint.md."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from typing import Any, Callable

import google_crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import mfsdp_ckpt
from mfsdp_ckpt import CheckpointError, CorruptCheckpointError
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import inspect_checkpoint, verify_checkpoint
from mfsdp_ckpt.tools.listing import list_checkpoints
from mfsdp_core.models.gpt import GPTConfig
from tests.reliability.test_hostile_support import (
    AUDIT,
    MODEL_CONFIG,
    Replace,
    deadline,
    edit_manifest,
    fresh_copy,
    read_metadata,
    save_small,
    trained_mlp,
    write_metadata,
)

pytestmark = pytest.mark.timeout(300, method="thread")  # deadline() owns SIGALRM


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> str:
    """A run directory with two committed checkpoints (step_1, step_2) and ``latest``."""
    run = str(tmp_path_factory.mktemp("hostile") / "run")
    model, optim = trained_mlp()
    save_small(os.path.join(run, "step_1"), 1, model, optim)
    save_small(os.path.join(run, "step_2"), 2, model, optim)
    return run


@pytest.fixture
def run(clean_run, tmp_path) -> str:
    """A fresh copy of the run directory to damage (``<run>/step_2`` is the one to attack)."""
    return fresh_copy(clean_run, str(tmp_path / "run"))


def _outside(tmp_path, data: bytes = b"secret") -> str:
    os.makedirs(tmp_path / "outside", exist_ok=True)
    path = str(tmp_path / "outside" / "secret.distcp")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _readers(ckpt: str, clean: str, tmp: str) -> dict[str, Callable[[], Any]]:
    """Every reader of a checkpoint, each a call on ``ckpt`` (``clean``: an intact one for diff)."""

    def read_all() -> None:
        with CheckpointReader(ckpt) as r:
            for key in r.keys():
                r.read(key)

    model, optim = trained_mlp()  # built here: the audit watches only the readers

    def load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mfsdp_ckpt.load(ckpt, model, optim)

    def resume() -> None:
        from cli.model_source import GPTSource
        from cli.train_start import UsageError, checked_checkpoint

        try:
            checked_checkpoint(ckpt, GPTSource(GPTConfig.from_dict(MODEL_CONFIG), "custom"), "--resume")
        except UsageError as e:  # how the trainer reports a CheckpointError: one line, exit 1
            raise CheckpointError(str(e)) from None

    return {
        "inspect": lambda: inspect_checkpoint(ckpt),
        "verify": lambda: verify_checkpoint(ckpt),
        "read": read_all,
        "diff": lambda: diff_checkpoints(ckpt, clean),
        "ls": lambda: list_checkpoints(os.path.dirname(ckpt)),
        "reshard": lambda: reshard(ckpt, os.path.join(tmp, "reshard_out", "resharded"), world_size=2),
        "load": load,
        "resume": resume,
    }


def _outcomes(readers: dict[str, Callable[[], Any]], roots: tuple[str, ...], seconds: float = 20) -> dict[str, Any]:
    """Each reader's result, or its error message (asserting one line of our family); no reader
    may hang, read outside ``roots`` or write anywhere."""
    out = {}
    for name, call in readers.items():
        writable = tuple(os.path.join(r, "reshard_out") for r in roots) if name == "reshard" else ()
        with AUDIT.watching(*roots, writable=writable) as violations:
            try:
                with deadline(seconds):
                    out[name] = call()
            except CheckpointError as e:
                assert "\n" not in str(e), (name, str(e))
                out[name] = e
        assert not violations, (name, violations)
    return out


def _errors(outcomes: dict[str, Any]) -> dict[str, str]:
    return {name: str(v) for name, v in outcomes.items() if isinstance(v, CheckpointError)}


def _faults(outcome: Any) -> list[str]:
    return [str(f) for f in outcome] if isinstance(outcome, list) else []


# ---- 1. a FIFO blocks nothing --------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "mfsdp.json"])
def test_hostile_fifo_in_a_checkpoint_blocks_no_reader(run, tmp_path, victim):
    ckpt = os.path.join(run, "step_2")
    os.remove(os.path.join(ckpt, victim))
    os.mkfifo(os.path.join(ckpt, victim))
    out = _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path)), (str(tmp_path),))
    errors = _errors(out)
    for name in ("inspect", "verify", "read", "diff", "reshard", "load", "resume"):
        if name == "verify" and name not in errors:
            assert any(victim in f and "not a regular file" in f for f in _faults(out[name])), out[name]
            continue
        if (name == "inspect" and victim == "__0_0.distcp") or (name == "resume" and victim != "mfsdp.json"):
            continue  # metadata only, or the manifest only: nothing to refuse
        assert name in errors, (name, out[name])
    if victim == "__0_0.distcp":
        assert "not a regular file: a FIFO" in errors["load"] and "__0_0.distcp" in errors["load"]


# ---- 2. files outside the checkpoint are never opened ---------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "manifest"])
def test_hostile_names_outside_the_checkpoint_are_refused(run, tmp_path, how):
    """``.metadata`` or the manifest names a file outside the checkpoint (here a byte-exact copy
    of its data file, so a reader that followed the name would read valid, checksummed data):
    refused, and nothing outside is opened."""
    ckpt = os.path.join(run, "step_2")
    with open(os.path.join(ckpt, "__0_0.distcp"), "rb") as f:
        secret = _outside(tmp_path, f.read())
    if how == "symlink":
        os.remove(os.path.join(ckpt, "__0_0.distcp"))
        os.symlink(secret, os.path.join(ckpt, "__0_0.distcp"))
    elif how == "manifest":
        edit_manifest(ckpt, lambda m: m["chunks"][sorted(m["chunks"])[0]].update(file="../../outside/secret.distcp"))
    else:
        name = os.path.relpath(secret, ckpt) if how == "dotdot" else secret
        metadata = read_metadata(ckpt)
        for index in list(metadata.storage_data):
            if index.fqn == "model.fc1.weight":
                metadata.storage_data[index].relative_path = name
        write_metadata(ckpt, metadata)  # a writer that knows the format: the checksums agree
    out = _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path / "run")), (str(tmp_path / "run"),))
    errors = _errors(out)
    assert "load" in errors and "read" in errors and "diff" in errors, out
    assert "verify" in errors or _faults(out["verify"]), out["verify"]
    expected = {
        "dotdot": "leads out of the checkpoint directory",
        "absolute": "is absolute",
        "symlink": "a symlink leads outside the checkpoint directory",
        "manifest": "field 'chunks[",
    }[how]
    assert expected in errors["load"], errors["load"]


# ---- 3. declared sizes are checked against the bytes present before allocating ---------------------


class _Allocation(BaseException):
    pass


def test_hostile_huge_tensor_is_refused_before_any_allocation(run, tmp_path, monkeypatch):
    """``.metadata`` declares a 1 TiB tensor whose one chunk is a 10-element record: every reader
    refuses it from the sizes alone; none asks for the memory first."""
    ckpt = os.path.join(run, "step_2")
    import io

    buf = io.BytesIO()
    torch.save(torch.arange(10.0), buf)
    record = buf.getvalue()
    data_file = os.path.join(ckpt, "__0_0.distcp")
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(record)
    huge = torch.Size([2**38])  # 2^38 float32 elements: 1 TiB
    metadata = read_metadata(ckpt)
    metadata.state_dict_metadata["extra.huge"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), huge, [ChunkStorageMetadata(torch.Size([0]), huge)]
    )
    metadata.storage_data[MetadataIndex("extra.huge", torch.Size([0]))] = _StorageInfo(
        "__0_0.distcp", offset, len(record)
    )
    write_metadata(ckpt, metadata)
    edit_manifest(
        ckpt,
        lambda m: m["chunks"].update(
            {
                "extra.huge@0": {
                    "file": "__0_0.distcp",
                    "offset": offset,
                    "length": len(record),
                    "crc32c": google_crc32c.value(torch.arange(10.0).numpy().tobytes()),
                }
            }
        ),
    )

    real_empty = torch.empty

    def guarded_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*size, device="meta", **{k: v for k, v in kwargs.items() if k != "device"})
        if t.numel() * t.element_size() > 2**30:
            raise _Allocation(f"asked for {t.numel() * t.element_size()} bytes before checking the file")
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", guarded_empty)
    readers = _readers(ckpt, os.path.join(run, "step_1"), str(tmp_path))
    out = _outcomes({k: readers[k] for k in ("verify", "read", "load")}, (str(tmp_path),))
    errors = _errors(out)
    assert "extra.huge" in errors["read"] and "do not fit in its" in errors["read"], errors
    assert "extra.huge" in errors["load"] and "do not fit in its" in errors["load"], errors
    assert any("extra.huge" in f and "do not fit in its" in f for f in _faults(out["verify"])), out["verify"]
    with CheckpointReader(ckpt) as reader:
        with pytest.raises(CorruptCheckpointError, match="do not fit in its"):
            reader.read_flat("extra.huge", 0, 2**38)
        with CheckpointReader(os.path.join(run, "step_1")) as clean:
            assert torch.equal(reader.read("model.fc1.bias"), clean.read("model.fc1.bias"))


# ---- 4. wrong-typed JSON in the manifest --------------------------------------------------------


def _first_chunk(m: dict) -> str:
    return sorted(m["chunks"])[0]


def _deep(n: int) -> Any:
    value: Any = 0
    for _ in range(n):
        value = [value]
    return value


MANIFEST_EDITS: dict[str, tuple[Callable[[dict], Any], str]] = {
    # name: (edit, the field the error names)
    "step a string": (lambda m: m.update(step="ten"), "step"),
    "chunks a list": (lambda m: m.update(chunks=[]), "chunks"),
    "chunk entry null": (lambda m: m["chunks"].update({_first_chunk(m): None}), "chunks["),
    "chunk offset negative": (lambda m: m["chunks"][_first_chunk(m)].update(offset=-1), ".offset"),
    "chunk crc a string": (lambda m: m["chunks"][_first_chunk(m)].update(crc32c="x"), ".crc32c"),
    "writer null": (lambda m: m.update(writer=None), "writer"),
    "plan shapes a string": (
        lambda m: m["writer"]["plan"]["buffers"][0].update(shapes="abc"),
        "writer.plan.buffers[0].shapes",
    ),
    "plan unknown strategy": (lambda m: m["writer"]["plan"]["buffers"][0].update(strategy="zero9"), "strategy"),
    "model_config a list": (lambda m: m.update(model_config=[1, 2]), "model_config"),
    "created_unix a string": (lambda m: m.update(created_unix="yesterday"), "created_unix"),
    "format_version a string": (lambda m: m.update(format_version="2"), "format_version"),
    "model_config nested 100000 deep": (
        lambda m: Replace(json.dumps(m)[:-1] + ', "model_config": {"a": ' + "[" * 100000 + "0" + "]" * 100000 + "}}"),
        "mfsdp.json",
    ),
    "model_config nested 40 deep": (lambda m: m.update(model_config={"a": _deep(40)}), "nested deeper than"),
    "top level a list": (lambda m: Replace([m]), "mfsdp.json"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_hostile_wrong_typed_manifest_is_one_line_from_every_reader(run, tmp_path, edit):
    """Valid JSON with wrong types, sealed with a correct checksum (a writer that knows the
    format): every reader names the file and the field; ``ls`` lists the checkpoint as not
    committed and goes on."""
    change, field = MANIFEST_EDITS[edit]
    ckpt = os.path.join(run, "step_2")
    edit_manifest(ckpt, change)
    out = _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path)), (str(tmp_path),))
    listed = {e.name: e for e in out.pop("ls")}
    assert listed["step_2"].committed is False and listed["step_1"].committed is True
    errors = _errors(out)
    assert set(errors) == set(out), {k: v for k, v in out.items() if k not in errors}
    for name, message in errors.items():
        assert "mfsdp.json" in message and field in message, (name, message)


def test_hostile_damaged_manifest_in_the_run_directory_does_not_stop_saves(run, tmp_path):
    """``save(keep=…)`` reads every manifest in the run directory to prune; one damaged manifest
    there is skipped (that checkpoint is kept), and ``ls`` goes on listing."""
    edit_manifest(os.path.join(run, "step_1"), lambda m: m.update(created_unix="yesterday"))
    model, optim = trained_mlp()
    with AUDIT.watching(str(tmp_path)):
        for step in (3, 4):
            save_small(os.path.join(run, f"step_{step}"), step, model, optim, keep=1)
    assert sorted(os.listdir(run)) == ["latest", "latest-checkpoint", "step_1", "step_4"]
    assert os.readlink(os.path.join(run, "latest-checkpoint")) == "step_4"
    entries = list_checkpoints(run)
    assert [(e.name, e.committed, e.latest) for e in entries] == [("step_4", True, True), ("step_1", False, False)]


# ---- 5. hostile values in .metadata -----------------------------------------------------------------


def _storage(md: Any, fqn: str = "model.fc1.weight") -> Any:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


METADATA_EDITS: dict[str, Callable[[Any], Any]] = {
    "relative_path missing": lambda md: _storage(md).__dict__.pop("relative_path"),
    "relative_path an int": lambda md: setattr(_storage(md), "relative_path", 5),
    "offset negative": lambda md: setattr(_storage(md), "offset", -5),
    "length a string": lambda md: setattr(_storage(md), "length", "abc"),
    "length 2**70": lambda md: setattr(_storage(md), "length", 2**70),
    "chunk sizes negative": lambda md: setattr(
        md.state_dict_metadata["model.fc1.weight"].chunks[0], "sizes", torch.Size([-64, -13])
    ),
    "chunk of another rank": lambda md: setattr(
        md.state_dict_metadata["model.fc1.weight"].chunks[0], "offsets", torch.Size([0])
    ),
    "dtype a string": lambda md: setattr(md.state_dict_metadata["model.fc1.weight"].properties, "dtype", "float32"),
    "size a list of strings": lambda md: setattr(md.state_dict_metadata["model.fc1.weight"], "size", ["64", "13"]),
    "chunks None": lambda md: setattr(md.state_dict_metadata["model.fc1.weight"], "chunks", None),
    "storage_data None": lambda md: setattr(md, "storage_data", None),
    "entry of another class": lambda md: md.state_dict_metadata.update(
        {"model.fc1.weight": ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))}
    ),
    "two chunks share bytes": lambda md: setattr(_storage(md, "model.fc1.bias"), "offset", _storage(md).offset),
}


@pytest.mark.parametrize("edit", sorted(METADATA_EDITS))
def test_hostile_metadata_values_are_one_line_from_every_reader(run, tmp_path, edit):
    """``.metadata`` made only of admitted DCP classes, with hostile values, its checksum in the
    manifest updated (a writer that knows the format): refused in one line naming ``.metadata``
    by everything that reads it."""
    ckpt = os.path.join(run, "step_2")
    metadata = read_metadata(ckpt)
    METADATA_EDITS[edit](metadata)
    write_metadata(ckpt, metadata)
    out = _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path)), (str(tmp_path),))
    errors = _errors(out)
    for name in ("inspect", "verify", "read", "diff", "reshard", "load"):
        assert name in errors, (name, out[name])
        assert ".metadata" in errors[name], (name, errors[name])


# ---- 6. verify is an integrity gate ------------------------------------------------------------------


def _rename_key(ckpt: str, seal: str) -> None:
    """``layers.1`` -> ``layers.N`` in one place: the entry's key in the tensor list, not its
    stored chunks' index (a one-byte flip where a multi-rank save pickled the name twice)."""
    metadata = read_metadata(ckpt)
    md = metadata.state_dict_metadata.pop("model.fc2.weight")
    metadata.state_dict_metadata["model.fc2.weighN"] = md
    write_metadata(ckpt, metadata, seal)


def test_hostile_renamed_key_fails_verify_as_it_fails_load(run, tmp_path):
    ckpt = os.path.join(run, "step_2")
    _rename_key(ckpt, "stale")  # the file changed under an intact manifest
    readers = _readers(ckpt, os.path.join(run, "step_1"), str(tmp_path))
    out = _outcomes({k: readers[k] for k in ("verify", "load")}, (str(tmp_path),))
    assert "load" in _errors(out)
    assert "verify" in _errors(out) or _faults(out["verify"]), "verify passed a checkpoint load refuses"
    assert "metadata_crc32c" in str(out["verify"])


def test_hostile_verify_cross_checks_metadata_and_manifest_both_ways(run, tmp_path):
    """With a manifest older than its checksums (nothing protects ``.metadata``), verify still
    finds the renamed key from both sides, and names the checks it could not make."""
    ckpt = os.path.join(run, "step_2")
    _rename_key(ckpt, "unprotected")
    faults = [str(f) for f in verify_checkpoint(ckpt)]
    assert any("model.fc2.weighN" in f and "not in the manifest" in f for f in faults), faults
    assert any("model.fc2.weight@" in f and "listed in the manifest but not in .metadata" in f for f in faults), faults
    with pytest.raises(CheckpointError, match="model.fc2.weigh"):
        _readers(ckpt, ckpt, str(tmp_path))["load"]()


def test_hostile_verify_checks_the_save_id_and_says_what_is_unprotected(run):
    ckpt = os.path.join(run, "step_2")
    edit_manifest(ckpt, lambda m: m.pop("save_id"))
    assert any("records no save_id" in str(f) for f in verify_checkpoint(ckpt))
    edit_manifest(ckpt, lambda m: m.update(save_id="another-save"))
    assert any("save_id differs" in str(f) for f in verify_checkpoint(ckpt))
    old = os.path.join(run, "step_1")
    edit_manifest(old, lambda m: None, seal="unprotected")  # as written before manifests carried a checksum
    result = verify_checkpoint(old)
    assert result == [] and any("unprotected" in n for n in result.notes), result.notes
    assert any("manifest checksum" in u for u in inspect_checkpoint(old).unknown)


# ---- 7. the manifest is protected ----------------------------------------------------------------------


PROTECTED_EDITS: dict[str, Callable[[dict], Any]] = {
    "step": lambda m: m.update(step=7),
    "model_config": lambda m: m["model_config"].update(hidden_size=128),
    "a chunk's offset": lambda m: m["chunks"][_first_chunk(m)].update(
        offset=m["chunks"][_first_chunk(m)]["offset"] + 1
    ),
    "the plan's world size": lambda m: m["writer"].update(world_size=8),
}


@pytest.mark.parametrize("edit", sorted(PROTECTED_EDITS))
def test_hostile_edits_to_the_manifest_are_noticed(run, tmp_path, edit):
    ckpt = os.path.join(run, "step_2")
    edit_manifest(ckpt, PROTECTED_EDITS[edit], seal="stale")
    out = _outcomes(_readers(ckpt, os.path.join(run, "step_1"), str(tmp_path)), (str(tmp_path),))
    assert not {e.name: e for e in out.pop("ls")}["step_2"].committed
    errors = _errors(out)
    assert set(errors) == set(out), {k: v for k, v in out.items() if k not in errors}
    assert all("manifest_crc32c" in m and "mfsdp.json" in m for m in errors.values()), errors


def test_hostile_flipped_byte_in_metadata_is_refused_by_every_reader(run, tmp_path):
    """Any one-byte change to ``.metadata`` under an intact manifest is refused (its checksum is in
    the manifest), whatever the unpickler makes of the bytes."""
    ckpt = os.path.join(run, "step_2")
    path = os.path.join(ckpt, ".metadata")
    data = bytearray(open(path, "rb").read())
    for pos in (len(data) // 3, len(data) // 2, 2 * len(data) // 3):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        with open(path, "wb") as f:
            f.write(flipped)
        out = _outcomes(
            {k: v for k, v in _readers(ckpt, ckpt, str(tmp_path)).items() if k in ("verify", "load", "read")},
            (str(tmp_path),),
        )
        assert set(_errors(out)) == {"verify", "load", "read"}, out


def test_hostile_stock_checkpoint_with_chunk_listed_but_not_stored(tmp_path):
    """A stock DCP checkpoint (no manifest) whose metadata lists a chunk with no stored data:
    load names the key before reading (before: a KeyError inside DCP)."""
    ckpt = save_small(str(tmp_path / "run" / "step_1"))
    os.remove(os.path.join(ckpt, "mfsdp.json"))
    metadata = read_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn == "model.fc1.bias")
    del metadata.storage_data[index]
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    model, optim = trained_mlp()
    with pytest.raises(
        CorruptCheckpointError, match=r"model.fc1.bias at \[0\]: listed in the metadata, but not stored"
    ):
        mfsdp_ckpt.load(ckpt, model, optim, require_manifest=False)
    shutil.rmtree(ckpt)

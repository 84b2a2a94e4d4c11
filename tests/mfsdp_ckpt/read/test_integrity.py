"""Integrity and bad input: corrupt / truncated data, uncommitted directories, malicious
metadata, key and shape mismatches. Each fails with one clear error naming the file / key, and
nothing in the model changes when a load fails."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from torch import nn

import mfsdp_ckpt
from mfsdp_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    StateMismatchError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from mfsdp_ckpt.read.locate import chunk_table
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_core import fully_shard_optimizer
from tests.mfsdp_ckpt.util import as_listed, build, owned_pieces, train_steps
from tests.mfsdp_core.models import OPTIMIZERS, make_model, shard_model


def _save(path: str) -> None:
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(path, model, optim, extra={"step": 2})


@pytest.fixture
def ckpt(ranks, tmp_path):
    path = str(tmp_path / "step_2")
    ranks(_save, 2, path, timeout=300)
    return path


def _load_expecting(path: str, error: type, **build_kwargs) -> dict:
    """Try a load that must fail; report the error and whether the model changed."""
    model, optim = build("optim_grads", "even", seed=5)
    train_steps(model, optim, 0, 1)
    before = owned_pieces(model, optim)
    try:
        mfsdp_ckpt.load(path, model, optim)
    except error as e:
        after = owned_pieces(model, optim)
        unchanged = all(torch.equal(before[k][2], after[k][2]) for k in before)
        return {"message": str(e), "unchanged": unchanged}
    return {"message": None}


def _chunk(path: str, key_prefix: str) -> tuple[str, dict]:
    chunks = chunk_table(path)
    key = max((k for k in chunks if k.startswith(key_prefix)), key=lambda k: chunks[k]["length"])
    return key, chunks[key]


def _check_failure(ranks, path, error, *fragments):
    for r in ranks(_load_expecting, 2, path, error, timeout=300):
        assert r["message"] is not None, f"load did not raise {error.__name__}"
        assert "\n" not in r["message"]
        for fragment in fragments:
            assert fragment in r["message"], r["message"]
        assert r["unchanged"], "the model changed although the load failed"


def test_flipped_byte_names_file_and_key(ranks, ckpt):
    key, entry = _chunk(ckpt, "optim.block.qkv.weight.exp_avg")
    data_file = os.path.join(ckpt, entry["file"])
    with open(data_file, "r+b") as f:
        pos = entry["offset"] + entry["length"] // 2
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x40]))
    _check_failure(ranks, ckpt, CorruptCheckpointError, entry["file"], "optim.block.qkv.weight.exp_avg")


def test_truncated_data_file_names_file_and_key(ranks, ckpt):
    key, entry = _chunk(ckpt, "model.")
    data_file = os.path.join(ckpt, entry["file"])
    os.truncate(data_file, entry["offset"] + entry["length"] // 2)
    _check_failure(ranks, ckpt, CorruptCheckpointError, entry["file"], "truncated", "key '")


def _load_while_files_change(path: str) -> dict:
    """:func:`_load_expecting`, with every data file this rank reads given a new modification time
    between the load's two passes (after every chunk was verified, before the first copy)."""
    import mfsdp_ckpt.read.dcp_reader as storage

    original = storage.read_verified

    def touch_then_read(files, items, **kwargs):
        for name in {verified.relative_path for verified, *_ in items}:
            stat = os.stat(os.path.join(path, name))
            os.utime(os.path.join(path, name), ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        return original(files, items, **kwargs)

    storage.read_verified = touch_then_read
    try:
        return _load_expecting(path, CorruptCheckpointError)
    finally:
        storage.read_verified = original


def test_a_data_file_changed_between_verifying_and_copying_changes_nothing(ranks, ckpt):
    for r in ranks(_load_while_files_change, 2, ckpt, timeout=300):
        assert r["message"] is not None and "\n" not in r["message"]
        assert "changed while it was being loaded" in r["message"] and ".distcp" in r["message"], r["message"]
        assert r["unchanged"], "the model changed although the load failed"


def test_directory_without_manifest_is_refused(ranks, ckpt):
    os.remove(os.path.join(ckpt, "mfsdp.json"))
    _check_failure(ranks, ckpt, UncommittedCheckpointError, "no committed manifest")


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile_metadata(ckpt: str, victim) -> None:
    payload = pickle.dumps(_CreatesFile(str(victim)))
    pickle.loads(payload).close()  # the payload is real: a plain unpickler creates the file
    assert victim.exists()
    victim.unlink()
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(payload)


def test_metadata_that_would_run_code_is_refused(ranks, ckpt, tmp_path):
    """A checkpoint whose readers take ``.metadata`` (the listed form) refuses it in ``load``."""
    victim = tmp_path / "pwned"
    _hostile_metadata(as_listed(ckpt), victim)
    _check_failure(ranks, ckpt, UnsafeCheckpointError, ".metadata", "refusing to load 'io.open'")
    assert not victim.exists()


def test_metadata_that_would_run_code_is_never_unpickled_and_verify_refuses_it(ranks, ckpt, tmp_path):
    """A save's checkpoint: ``load`` reads the index and never opens ``.metadata``; ``verify``,
    which checks that ``.metadata`` agrees with the index, refuses it without running it."""
    victim = tmp_path / "pwned"
    _hostile_metadata(ckpt, victim)
    assert all(r["message"] is None for r in ranks(_load_expecting, 2, ckpt, UnsafeCheckpointError, timeout=300))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load 'io.open'"):
        verify_checkpoint(ckpt)
    assert not victim.exists()


def _load_mismatched(path: str, kind: str) -> dict:
    if kind == "model":
        model = shard_model(make_model("mlp"))  # other parameter names
        optim = fully_shard_optimizer(OPTIMIZERS["adamw"](model.parameters()))
    elif kind == "shape":
        raw = make_model("transformer")
        raw.out = nn.Linear(32, 64)  # same name, other shape
        model = shard_model(raw)
        optim = fully_shard_optimizer(OPTIMIZERS["adamw"](model.parameters()))
    else:  # an optimizer with other state
        model = shard_model(make_model("transformer"))
        optim = fully_shard_optimizer(OPTIMIZERS["sgd"](model.parameters()))
    try:
        mfsdp_ckpt.load(path, model, optim)
    except StateMismatchError as e:
        return {"message": str(e)}
    return {"message": None}


def test_missing_and_unexpected_keys_are_all_named(ranks, ckpt):
    for r in ranks(_load_mismatched, 2, ckpt, "model", timeout=300):
        msg = r["message"]
        assert msg is not None and "\n" not in msg
        assert "missing from the checkpoint: model.fc1.bias, model.fc1.weight" in msg
        assert "model.scale" in msg and "optim.scale.exp_avg" in msg
        assert "not in the model/optimizer: model.block.attn_norm.bias" in msg and "model.gate" in msg


def test_shape_mismatch_is_named(ranks, ckpt):
    for r in ranks(_load_mismatched, 2, ckpt, "shape", timeout=300):
        assert "shape mismatch: model.out.bias (checkpoint (32,), model (64,))" in r["message"]
        assert "model.out.weight (checkpoint (32, 32), model (64, 32))" in r["message"]


def test_other_optimizer_state_is_named(ranks, ckpt):
    for r in ranks(_load_mismatched, 2, ckpt, "optim", timeout=300):
        assert "missing from the checkpoint: optim.block.attn_norm.bias.momentum_buffer" in r["message"]
        assert "optim.gate.exp_avg_sq" in r["message"]


def _save_error(path: str) -> tuple[str, str]:
    """Save to ``path``; the error's type and message (empty when the save succeeds)."""
    model, optim = build("optim", "even")
    try:
        mfsdp_ckpt.save(path, model, optim)
    except CheckpointError as e:
        return type(e).__name__, str(e)
    return "", ""


def test_save_over_existing_checkpoint_is_refused(ranks, ckpt):
    before = sorted(os.listdir(ckpt))
    for kind, msg in ranks(_save_error, 2, ckpt, timeout=300):
        assert kind == CheckpointExistsError.__name__ and "already exists" in msg and ckpt in msg
    assert sorted(os.listdir(ckpt)) == before
    assert not [n for n in os.listdir(os.path.dirname(ckpt)) if ".partial-" in n]


def test_unusable_destination_fails_on_every_rank_alike(ranks, tmp_path):
    # rank 0 creates the parent directory; when it cannot, every rank must hear why (rather than
    # the others waiting in dcp.save's first collective for a rank that has left)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    errors = ranks(_save_error, 3, str(blocker / "run" / "step_1"), timeout=120)
    assert len(set(errors)) == 1, errors
    kind, message = errors[0]
    assert kind == "CheckpointError" and "\n" not in message
    assert message.startswith(f"{blocker / 'run'}: cannot create the checkpoint's parent directory (")
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def _save_series(root: str, steps: list[int], keep: int) -> None:
    model, optim = build("optim_grads_params", "even")
    for step in steps:
        train_steps(model, optim, step - 1, step)
        mfsdp_ckpt.save(os.path.join(root, f"step_{step}"), model, optim, extra={"step": step}, step=step, keep=keep)


def _load_latest_step(root: str) -> int:
    model, optim = build("optim", "tensor")
    return mfsdp_ckpt.load(os.path.join(root, "latest"), model, optim)["step"]


@pytest.mark.heavy
def test_latest_and_keep_last_k(ranks, tmp_path):
    root = str(tmp_path / "run")
    ranks(_save_series, 2, root, [1, 2, 3, 4], 2, timeout=300)
    assert sorted(os.listdir(root)) == ["latest", "latest-checkpoint", "step_3", "step_4"]
    assert os.readlink(os.path.join(root, "latest-checkpoint")) == "step_4"  # the link counts as no checkpoint for keep
    # a save that died half-way leaves a hidden partial directory: not a checkpoint, latest unmoved
    partial = os.path.join(root, ".step_5.partial-deadbeef")
    shutil.copytree(os.path.join(root, "step_4"), partial)
    os.remove(os.path.join(partial, "mfsdp.json"))
    assert ranks(_load_latest_step, 3, root, timeout=300) == [4, 4, 4]
    _check_failure(ranks, partial, UncommittedCheckpointError, partial)


def _load_stock(path: str) -> str | None:
    model = shard_model(make_model("transformer", seed=3), strategy="optim_grads_params", policy="row")
    try:
        mfsdp_ckpt.load(path, model, require_manifest=False)
    except mfsdp_ckpt.StateMismatchError as e:
        return str(e)
    return None


def test_load_refuses_overlapping_chunks_whose_sizes_add_up(ranks, tmp_path):
    """A stock checkpoint whose chunks of one tensor overlap and leave a row uncovered, their sizes
    still summing to the tensor's: refused by the coverage check, naming the key, before any read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    state = {f"model.{n}": p.detach() for n, p in make_model("transformer", seed=11).named_parameters()}
    key = next(k for k, v in state.items() if v.dim() == 2 and v.shape[0] >= 4)
    path = str(tmp_path / "stock")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # the test's own file, just written
    md = metadata.state_dict_metadata[key]
    rows, cols = md.size
    md.chunks[:] = [
        ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2, cols))),
        ChunkStorageMetadata(torch.Size((1, 0)), torch.Size((rows - 2, cols))),
    ]
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    out = ranks(_load_stock, 2, path, timeout=300)
    assert all(r is not None and "chunks do not cover the tensor exactly" in r and key in r for r in out), out


def test_stock_dcp_reads_the_latest_checkpoint_link(tmp_path):
    """``<run>/latest-checkpoint``: a symlink next to the ``latest`` pointer, so that a tool that
    takes only a directory (stock DCP here) reads the latest checkpoint; ``ls`` lists each
    checkpoint once, and our readers accept the link too."""
    import torch.distributed.checkpoint as dcp

    from mfsdp_ckpt.tools.listing import list_checkpoints
    from tests.mfsdp_core.models import make_model, shard_model

    root = tmp_path / "run"
    model = shard_model(make_model("transformer", seed=5), strategy="optim_grads_params", policy="row")
    for step in (1, 2):
        mfsdp_ckpt.save(str(root / f"step_{step}"), model, extra={"step": step}, step=step)
    link = root / "latest-checkpoint"
    assert link.is_symlink() and os.readlink(link) == "step_2"
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no partial link left behind
    state = {
        k: torch.empty_like(p.detach())
        for k, p in ((f"model.{n}", p) for n, p in make_model("transformer", seed=5).named_parameters())
    }
    dcp.load(state, checkpoint_id=str(link), no_dist=True)
    assert all(
        torch.equal(state[f"model.{n}"], p.detach()) for n, p in make_model("transformer", seed=5).named_parameters()
    )
    assert [e.name for e in list_checkpoints(str(root))] == ["step_1", "step_2"]
    assert mfsdp_ckpt.load(str(link), model)["step"] == 2

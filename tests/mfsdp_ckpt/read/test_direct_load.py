"""``load(atomic=False)``: the chunks read straight into place and checked as they arrive.

A clean non-atomic load is bitwise the all-or-nothing one, at the writer's layout and at others
(3 and 5 ranks: chunks split between ranks, read partly into scratch memory; shards of 0
elements); most of its bytes really take the direct path; a corrupted chunk raises the same one
line on every rank, saying the model is partly loaded; and the trainer's ``--resume`` stops with
it (exit 1), in its own words (the run stops before training the model it built)."""

from __future__ import annotations

import os

import pytest
import torch

import mfsdp_ckpt
import mfsdp_ckpt.read.dcp_reader as dcp_reader
import mfsdp_ckpt.read.direct_read as direct_read
from mfsdp_ckpt import CorruptCheckpointError
from mfsdp_ckpt.read.direct_read import _contiguous_range
from mfsdp_ckpt.read.locate import chunk_table
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps
from tests.torchrun import failure
from tests.torchrun import run_train as _run


def _save(path: str) -> None:
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(path, model, optim, extra={"step": 2, "note": torch.arange(3)})


@pytest.fixture
def ckpt(ranks, tmp_path):
    path = str(tmp_path / "step_2")
    ranks(_save, 2, path, timeout=300)
    return path


def _both_loads(path: str, strategy: str, block: int | None = None) -> dict:
    """An atomic and a non-atomic load of ``path`` into two fresh models; what each loaded, and
    the bytes the non-atomic one read straight into place against the bytes of its targets.
    ``block``: the direct reader's block size (small: chunks of many blocks, joined checksums)."""
    if block is not None:
        direct_read.BLOCK_BYTES = block
    direct_bytes = []
    original = dcp_reader.read_into_place

    def counting(files, chunks, **kwargs):
        direct_bytes.append(sum(end - start for c in chunks for start, end, dst in c.segments if dst is not None))
        return original(files, chunks, **kwargs)

    out = {}
    for atomic in (True, False):
        model, optim = build(strategy, "even", seed=7)
        dcp_reader.read_into_place = counting
        try:
            extra = mfsdp_ckpt.load(path, model, optim, atomic=atomic)
        finally:
            dcp_reader.read_into_place = original
        out[atomic] = {
            "pieces": owned_pieces(model, optim),
            "extra": extra,
            "rng": torch.get_rng_state(),
            "step": [optim.state[p]["step"] for g in optim.param_groups for p in g["params"] if p in optim.state],
        }
    wanted = sum(v[2].numel() * v[2].element_size() for v in out[False]["pieces"].values())
    return {"atomic": out[True], "direct": out[False], "direct_bytes": sum(direct_bytes), "wanted": wanted}


@pytest.mark.parametrize(
    ("world", "strategy", "block"),
    [(2, "optim_grads_params", None), (3, "optim_grads", 100), (5, "optim_grads_params", None), (2, "optim", 64)],
)
def test_clean_non_atomic_load_is_bitwise_the_atomic_one(ranks, ckpt, world, strategy, block):
    for r in ranks(_both_loads, world, ckpt, strategy, block, timeout=300):
        a, d = r["atomic"], r["direct"]
        assert sorted(a["pieces"]) == sorted(d["pieces"])
        for key in a["pieces"]:
            assert a["pieces"][key][:2] == d["pieces"][key][:2], key
            assert torch.equal(a["pieces"][key][2], d["pieces"][key][2]), key
        assert sorted(a["extra"]) == sorted(d["extra"]) and torch.equal(a["extra"]["note"], d["extra"]["note"])
        assert torch.equal(a["rng"], d["rng"])
        assert all(torch.equal(x, y) for x, y in zip(a["step"], d["step"]))
        # most of the state went straight into place (what did not: the main params of
        # parameters whose model entry is read instead, small objects, 0-element boxes)
        assert r["direct_bytes"] >= 0.5 * r["wanted"], (r["direct_bytes"], r["wanted"])


def _load_non_atomic(path: str, block: int) -> dict:
    direct_read.BLOCK_BYTES = block
    model, optim = build("optim_grads", "even", seed=5)
    try:
        mfsdp_ckpt.load(path, model, optim, atomic=False)
    except CorruptCheckpointError as e:
        return {"message": str(e)}
    return {"message": None}


def test_corrupted_chunk_raises_on_every_rank_alike(ranks, ckpt):
    chunks = chunk_table(ckpt)
    key = max((k for k in chunks if k.startswith("optim.block.qkv.weight.exp_avg")), key=lambda k: chunks[k]["length"])
    entry = chunks[key]
    with open(os.path.join(ckpt, entry["file"]), "r+b") as f:
        pos = entry["offset"] + entry["length"] // 2
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x40]))
    messages = [r["message"] for r in ranks(_load_non_atomic, 3, ckpt, 64, timeout=300)]
    assert messages[0] is not None and len(set(messages)) == 1, messages
    message = messages[0]
    assert "\n" not in message
    for fragment in (entry["file"], "optim.block.qkv.weight.exp_avg", "checksum mismatch", "partly loaded"):
        assert fragment in message, message


@pytest.mark.heavy
def test_trainer_resume_stops_with_the_corrupt_chunk(tmp_path):
    run = _run(2, "--model", "tiny", "--steps", "4", "--save-every", "2", "--stop-at", "2", "--ckpt-dir", str(tmp_path))
    assert run.returncode == 0, failure(run)
    step = tmp_path / "step_000002"
    chunks = chunk_table(step)
    key = max((k for k in chunks if k.startswith("model.")), key=lambda k: chunks[k]["length"])
    entry = chunks[key]
    with open(step / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + entry["length"] // 2)  # in the tensor bytes of the largest chunk
        byte = f.read(1)
        f.seek(entry["offset"] + entry["length"] // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    run = _run(2, "--model", "tiny", "--steps", "4", "--save-every", "2", "--ckpt-dir", str(tmp_path), "--resume")
    assert run.returncode == 1, failure(run)
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, run.stderr
    assert "--resume:" in lines[0] and "checksum mismatch" in lines[0], lines[0]
    # the trainer's words, not the library's note to a caller of load(atomic=False)
    assert lines[0].endswith("; the run stopped before training (nothing was written)"), lines[0]
    assert "atomic" not in lines[0] and "partly loaded" not in lines[0], lines[0]


def test_contiguous_ranges_of_boxes():
    assert _contiguous_range((4, 6), (1, 0), (2, 6)) == (6, 18)  # whole rows
    assert _contiguous_range((4, 6), (2, 1), (1, 3)) == (13, 16)  # part of one row
    assert _contiguous_range((4, 6), (1, 1), (2, 3)) is None  # parts of two rows
    assert _contiguous_range((5,), (2,), (0,)) == (2, 2)  # empty
    assert _contiguous_range((2, 3, 4), (1, 2, 0), (1, 1, 4)) == (20, 24)
    assert _contiguous_range((2, 3, 4), (0, 1, 0), (2, 1, 4)) is None

"""``mfsdp_ckpt.read.chunks``: the one chunk-reading layer (open files once, read a chunk, check its
crc32c) and the one coverage check, which every reader and the checkpoint builder use."""

from __future__ import annotations

import io
import os
import pickle
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from mfsdp_ckpt import CheckpointError, CorruptCheckpointError
from mfsdp_ckpt.read.chunks import ChunkFiles, Fault, coverage_faults
from mfsdp_ckpt.read.locate import open_checkpoint
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.write.builder import CheckpointBuilder


def _md(shape, boxes) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes],
    )


def _reference_faults(key: str, md: TensorStorageMetadata) -> list[Fault]:
    """Every pair compared: what ``coverage_faults`` must say, in the same order."""
    import math

    faults = []
    size = tuple(md.size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    for off, sz in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            faults.append(Fault(None, key, off, f"chunk of size {list(sz)} lies outside the tensor {list(size)}"))
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if all(a0 < b0 + bs and b0 < a0 + as_ for a0, as_, b0, bs in zip(oa, sa, ob, sb)):
                faults.append(Fault(None, key, ob, f"chunk overlaps the chunk at {list(oa)}"))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size) and not faults:
        faults.append(Fault(None, key, None, f"chunks cover {covered} of {math.prod(size)} elements"))
    return faults


def test_coverage_faults_name_gaps_overlaps_and_strays():
    assert coverage_faults("k", _md((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))])) == []
    assert coverage_faults("k", _md((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))])) == []  # column shards
    assert [str(f) for f in coverage_faults("k", _md((4, 6), [((0, 0), (2, 6))]))] == [
        "k: chunks cover 12 of 24 elements"
    ]
    assert [str(f) for f in coverage_faults("k", _md((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))]))] == [
        "k at [2, 0]: chunk overlaps the chunk at [0, 0]"
    ]
    assert [str(f) for f in coverage_faults("k", _md((4, 6), [((0, 0), (2, 6)), ((3, 0), (2, 6))]))] == [
        "k at [3, 0]: chunk of size [2, 6] lies outside the tensor [4, 6]"
    ]
    assert coverage_faults("s", _md((), [((), ())])) == []  # a 0-d tensor (Adam's step)
    assert [str(f) for f in coverage_faults("s", _md((), [((), ()), ((), ())]))] == [
        "s at []: chunk overlaps the chunk at []"
    ]


_box = st.tuples(st.integers(-1, 6), st.integers(0, 4), st.integers(0, 6), st.integers(0, 4))


@settings(max_examples=300, deadline=None)
@given(st.lists(_box, max_size=8))
def test_coverage_faults_agree_with_comparing_every_pair(raw):
    md = _md((6, 5), [((r, c), (h, w)) for r, h, c, w in raw])
    assert coverage_faults("k", md) == _reference_faults("k", md)


def test_coverage_of_many_row_chunks_is_fast():
    rows = 20_000
    md = _md((rows, 8), [((r, 0), (1, 8)) for r in reversed(range(rows))])
    start = time.perf_counter()
    assert coverage_faults("k", md) == []
    assert time.perf_counter() - start < 2.0


def _build(path: str) -> torch.Tensor:
    t = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16)
    with CheckpointBuilder(path, {}) as builder:
        builder.add_chunk("model.w", t[:5], (0, 0), t.shape)
        builder.add_chunk("model.w", t[5:], (5, 0), t.shape, file=1)
        builder.add_object("extra.step", 7, file=1)
        builder.commit()
    return t


def test_chunk_files_read_verify_and_name_the_file_and_key(tmp_path):
    path = str(tmp_path / "ckpt")
    t = _build(path)
    directory, manifest, metadata, reader = open_checkpoint(path)
    storage = metadata.storage_data
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        pieces = {index: files.read(index, info) for index, info in storage.items()}
        assert all(files.fault(index, info) is None for index, info in storage.items())
        assert len(files._open) == 2
        files.release("__1_0.distcp")
        assert len(files._open) == 1
    assert files._open == {}
    for index, piece in pieces.items():
        if index.offset is None:
            assert torch.load(io.BytesIO(piece), weights_only=True) == 7
        else:
            assert torch.equal(piece, t[index.offset[0] : index.offset[0] + piece.shape[0]])

    index, info = next((i, v) for i, v in storage.items() if i.offset is not None and tuple(i.offset) == (5, 0))
    with open(os.path.join(directory, info.relative_path), "r+b") as f:  # flip one payload byte
        pos = locate_raw_tensor(f, info.offset, info.length, torch.float32, 11 * 16).offset + 10
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 1]))
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        assert files.fault(index, info) == "checksum mismatch"
        with pytest.raises(CorruptCheckpointError) as e:
            files.read(index, info)
    assert (
        str(e.value)
        == f"{os.path.join(directory, info.relative_path)}: key 'model.w' chunk at [5, 0]: checksum mismatch"
    )
    with ChunkFiles(directory, None, reader.chunk_shapes) as files:  # no manifest: nothing to check against
        assert files.read(index, info).shape == (11, 16)

    os.remove(os.path.join(directory, info.relative_path))
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        assert files.fault(index, info) == "cannot open (No such file or directory)"
        assert files.fault(index, info) == "cannot open (No such file or directory)"  # remembered
        with pytest.raises(
            CorruptCheckpointError,
            match=r"__1_0.distcp: cannot open \(No such file or directory\), needed for key 'model.w'",
        ):
            files.read(index, info)


def test_chunk_files_read_an_fsspec_url():
    url = f"memory://chunks-test-{os.getpid()}/ckpt"
    t = torch.randn(7, 3)
    with CheckpointBuilder(url, {}) as builder:
        builder.add_tensor("model.w", t)
        builder.commit()
    with CheckpointReader(url) as reader:
        assert torch.equal(reader.read("model.w"), t)
    assert verify_checkpoint(url) == []


def test_readers_refuse_chunks_that_do_not_cover_a_tensor_exactly_once(tmp_path):
    """Overlapping chunks whose sizes still add up to the tensor's leave a gap: every reader
    refuses them before reading (the builder never writes them). Without a manifest (a stock DCP
    checkpoint) nothing else would notice."""
    path = str(tmp_path / "ckpt")
    _build(path)
    os.remove(os.path.join(path, "mfsdp.json"))
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)
    md = metadata.state_dict_metadata["model.w"]
    md.chunks[1] = ChunkStorageMetadata(torch.Size((4, 0)), md.chunks[1].sizes)  # rows 4..14: row 4 twice, row 15 never
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    with CheckpointReader(path) as reader:
        with pytest.raises(CorruptCheckpointError) as e:
            reader.read("model.w")
        assert str(e.value) == f"{path}: model.w at [4, 0]: chunk overlaps the chunk at [0, 0]"
        with pytest.raises(CorruptCheckpointError, match="chunk overlaps"):
            reader.read_flat("model.w", 200, 256)
        assert reader.read("extra.step") == 7
    assert any("chunk overlaps the chunk at [0, 0]" in str(f) for f in verify_checkpoint(path))


def test_reader_refuses_a_stored_chunk_the_metadata_does_not_list(tmp_path):
    path = str(tmp_path / "ckpt")
    _build(path)
    os.remove(os.path.join(path, "mfsdp.json"))
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)
    index = next(i for i in metadata.storage_data if i.fqn == "model.w" and tuple(i.offset) == (5, 0))
    metadata.storage_data[MetadataIndex("model.w", torch.Size((6, 0)))] = metadata.storage_data.pop(index)
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    with CheckpointReader(path) as reader:
        with pytest.raises(CorruptCheckpointError) as e:
            reader.read("model.w")
    assert str(e.value) == f"{path}: key 'model.w' chunk at [6, 0]: stored, but not in the metadata's chunk list"


def test_builder_refuses_a_tensor_not_covered_exactly_once(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"not every tensor is covered exactly once: model.w \(80 of 256 elements"
    ):
        with CheckpointBuilder(str(tmp_path / "ckpt"), {}) as builder:
            builder.add_chunk("model.w", torch.zeros(5, 16), (0, 0), (16, 16))
            builder.commit()
    assert not os.path.exists(tmp_path / "ckpt") and os.listdir(tmp_path) == []

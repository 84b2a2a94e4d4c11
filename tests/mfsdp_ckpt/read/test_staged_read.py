"""``mfsdp_ckpt.read.staged_read``: a load's chunks read as a few large spans by several threads,
each chunk verified as it arrives, tensors handed out as views of the staging memory."""

from __future__ import annotations

import io
import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from mfsdp_ckpt import CorruptCheckpointError
from mfsdp_ckpt.read import staged_read
from mfsdp_ckpt.read.chunks import ChunkFiles
from mfsdp_ckpt.read.locate import open_checkpoint
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.read.staged_read import (
    VerifiedRange,
    plan_spans,
    read_chunks,
    read_verified,
    verify_chunks,
)
from mfsdp_ckpt.write.builder import CheckpointBuilder


def _info(path: str, offset: int, length: int):
    return SimpleNamespace(relative_path=path, offset=offset, length=length)


def test_plan_spans_joins_neighbours_within_the_gap_per_file():
    chunks = [
        (MetadataIndex("a", (0,)), _info("f0", 0, 100)),
        (MetadataIndex("a", (1,)), _info("f0", 100, 50)),  # adjacent
        (MetadataIndex("b", (0,)), _info("f1", 0, 10)),  # another file
        (MetadataIndex("c", (0,)), _info("f0", 150 + 64, 20)),  # a gap of 64 bytes
        (MetadataIndex("d", (0,)), _info("f0", 1000, 5)),  # a gap of 766 bytes
    ]
    spans = plan_spans(reversed(chunks), max_gap=64)
    assert [(s.relative_path, s.start, s.end, [i.fqn for i, _ in s.chunks]) for s in spans] == [
        ("f0", 0, 234, ["a", "a", "c"]),
        ("f0", 1000, 1005, ["d"]),
        ("f1", 0, 10, ["b"]),
    ]
    assert [len(s.chunks) for s in plan_spans(chunks, max_gap=10_000)] == [4, 1]


# odd sizes, several dtypes (so that views land at addresses that are not multiples of the element
# size), a 0-element tensor, an object, two files
TENSORS = {
    "model.w": torch.randn(37, 13),
    "model.h": torch.randn(5, 7).to(torch.bfloat16),
    "model.d": torch.randn(11, dtype=torch.float64),
    "model.i": torch.arange(9, dtype=torch.int64),
    "model.e": torch.empty(0, 4),
    "model.f8": torch.randn(6, 8).to(torch.float8_e4m3fn),
}


def _build(path: str) -> None:
    with CheckpointBuilder(path, {}) as builder:
        for n, (key, t) in enumerate(TENSORS.items()):
            if t.shape[0] > 2:
                cut = t.shape[0] // 3
                builder.add_chunk(key, t[:cut], (0,) * t.dim(), t.shape, file=n % 2)
                builder.add_chunk(key, t[cut:], (cut,) + (0,) * (t.dim() - 1), t.shape, file=(n + 1) % 2)
            else:
                builder.add_tensor(key, t, file=n % 2)
        builder.add_object("extra.step", 7, file=1)
        builder.commit()


def _read_all(path: str, threads: int):
    directory, manifest, metadata, reader = open_checkpoint(path)
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        return metadata, read_chunks(files, list(metadata.storage_data.items()), threads=threads)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block", [7, 100, 16 << 20])
def test_read_chunks_returns_every_chunk_bitwise(tmp_path, monkeypatch, threads, block):
    monkeypatch.setattr(staged_read, "BLOCK_BYTES", block)  # chunks spanning many blocks, blocks many chunks
    path = str(tmp_path / "ckpt")
    _build(path)
    metadata, payloads = _read_all(path, threads)
    assert set(payloads) == set(metadata.storage_data)
    assert any(isinstance(p, torch.Tensor) and p.numel() and p.data_ptr() % p.element_size() for p in payloads.values())
    for index, payload in payloads.items():
        if index.offset is None:
            assert torch.load(io.BytesIO(payload), weights_only=True) == 7
            continue
        whole = TENSORS[index.fqn]
        piece = whole[index.offset[0] : index.offset[0] + payload.shape[0]] if whole.dim() else whole
        assert payload.dtype == whole.dtype and payload.shape == piece.shape
        assert torch.equal(payload.contiguous().view(torch.uint8), piece.contiguous().view(torch.uint8))


def _flip_payload_byte(directory: str, info, dtype: torch.dtype, numel: int) -> None:
    with open(os.path.join(directory, info.relative_path), "r+b") as f:
        pos = locate_raw_tensor(f, info.offset, info.length, dtype, numel).offset + 3
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("threads", [1, 4])
def test_a_corrupt_chunk_is_named_and_the_first_in_file_order_wins(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(staged_read, "BLOCK_BYTES", 64)
    path = str(tmp_path / "ckpt")
    _build(path)
    directory, manifest, metadata, reader = open_checkpoint(path)
    tensors = sorted(
        ((i, v) for i, v in metadata.storage_data.items() if i.offset is not None and i.fqn == "model.w"),
        key=lambda item: (item[1].relative_path, item[1].offset),
    )
    for index, info in tensors:  # both chunks of model.w, in two files
        _flip_payload_byte(directory, info, torch.float32, int(torch.Size(reader.chunk_shapes[index][1]).numel()))
    first_index, first_info = tensors[0]
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        with pytest.raises(CorruptCheckpointError) as e:
            read_chunks(files, list(metadata.storage_data.items()), threads=threads)
    assert str(e.value) == (
        f"{os.path.join(directory, first_info.relative_path)}: key 'model.w' chunk at "
        f"{list(first_index.offset)}: checksum mismatch"
    )


def test_a_file_truncated_after_the_checks_is_a_clean_error(tmp_path):
    path = str(tmp_path / "ckpt")
    _build(path)
    directory, manifest, metadata, reader = open_checkpoint(path)
    name = "__0_0.distcp"
    size = os.path.getsize(os.path.join(directory, name))
    os.truncate(os.path.join(directory, name), size // 2)
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        with pytest.raises(CorruptCheckpointError, match=rf"{name}: key '[^']+'( chunk at \[[0-9, ]*\])?: truncated"):
            read_chunks(files, list(metadata.storage_data.items()))


def test_read_chunks_reads_an_fsspec_url_by_ranges():
    url = f"memory://staged-read-{os.getpid()}/ckpt"
    _build(url)
    metadata, payloads = _read_all(url, 2)
    index = next(i for i in payloads if i.fqn == "model.w" and i.offset is not None and i.offset[0] == 0)
    assert torch.equal(payloads[index], TENSORS["model.w"][: payloads[index].shape[0]])


def _verify_all(path: str, threads: int, stage_bytes: int):
    directory, manifest, metadata, reader = open_checkpoint(path)
    files = ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes)
    return (
        files,
        metadata,
        verify_chunks(files, list(metadata.storage_data.items()), threads=threads, stage_bytes=stage_bytes),
    )


def _expected_piece(index, shape):
    whole = TENSORS[index.fqn]
    return whole[index.offset[0] : index.offset[0] + shape[0]] if whole.dim() else whole


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("stage_bytes", [1, 900, 1 << 20])  # a batch per chunk, several chunks per batch, one batch
def test_verify_chunks_leaves_plain_records_in_their_files_and_reads_them_back_bitwise(
    tmp_path, monkeypatch, threads, stage_bytes
):
    """The first pass keeps only a verified file range for every plain record (fp8 records go
    through torch.load and come back in memory, as does the object); the second pass reads each
    range into its target -- whole into a contiguous target of its dtype, or a box of it through
    new memory -- bitwise."""
    monkeypatch.setattr(staged_read, "BLOCK_BYTES", 100)
    monkeypatch.setattr(staged_read, "THREADED_COPY_BYTES", 100)  # the second pass on threads too
    path = str(tmp_path / "ckpt")
    _build(path)
    files, metadata, out = _verify_all(path, threads, stage_bytes)
    with files:
        assert set(out) == set(metadata.storage_data)
        ranges = {i: v for i, v in out.items() if isinstance(v, VerifiedRange)}
        assert {i.fqn for i in ranges} == {"model.w", "model.h", "model.d", "model.i", "model.e"}
        assert torch.load(io.BytesIO(out[next(i for i in out if i.offset is None)]), weights_only=True) == 7
        fp8 = [v for i, v in out.items() if i.fqn == "model.f8"]
        assert fp8 and all(isinstance(v, torch.Tensor) for v in fp8)
        for v, index in zip(fp8, [i for i in out if i.fqn == "model.f8"]):
            assert torch.equal(v.view(torch.uint8), _expected_piece(index, v.shape).contiguous().view(torch.uint8))
        items, wants = [], []
        for index, verified in ranges.items():
            piece = _expected_piece(index, verified.shape)
            whole = torch.zeros(verified.shape, dtype=verified.dtype)
            items.append((verified, (0,) * len(verified.shape), verified.shape, whole))
            wants.append((whole, piece))
            if verified.shape and verified.shape[0] > 1:  # a box: rows 1.. into a target of another dtype
                lengths = (verified.shape[0] - 1, *verified.shape[1:])
                box = torch.zeros(lengths, dtype=torch.float64)
                items.append((verified, (1,) + (0,) * (len(lengths) - 1), lengths, box))
                wants.append((box, piece[1:].to(torch.float64)))
        read_verified(files, items, threads=threads)
        for got, want in wants:
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_verify_chunks_finds_a_corrupt_chunk_in_a_later_batch(tmp_path):
    path = str(tmp_path / "ckpt")
    _build(path)
    directory, manifest, metadata, reader = open_checkpoint(path)
    last_index, last_info = max(
        ((i, v) for i, v in metadata.storage_data.items() if i.fqn == "model.d"),
        key=lambda item: (item[1].relative_path, item[1].offset),
    )
    _flip_payload_byte(directory, last_info, torch.float64, int(torch.Size(reader.chunk_shapes[last_index][1]).numel()))
    with ChunkFiles(directory, reader.manifest_chunks, reader.chunk_shapes) as files:
        with pytest.raises(CorruptCheckpointError, match=r"key 'model.d' chunk at \[[0-9]+\]: checksum mismatch"):
            verify_chunks(files, list(metadata.storage_data.items()), stage_bytes=1)


@pytest.mark.parametrize("change", ["rewritten", "truncated", "replaced"])
def test_read_verified_refuses_a_file_changed_after_the_first_pass_before_copying_anything(tmp_path, change):
    """A data file rewritten in place (new modification time), truncated or replaced by another
    file between the passes: one line naming it, and no target touched. (A replaced file is not
    even read: the open descriptor still holds the old one.)"""
    path = str(tmp_path / "ckpt")
    _build(path)
    files, metadata, out = _verify_all(path, 2, 1 << 20)
    with files:
        ranges = [
            (v, (0,) * len(v.shape), v.shape, torch.full(v.shape, -1, dtype=v.dtype))
            for v in out.values()
            if isinstance(v, VerifiedRange)
        ]
        name = os.path.join(files.directory, "__1_0.distcp")
        data = open(name, "rb").read()
        time.sleep(0.01)  # a modification time the file system can tell apart
        if change == "rewritten":
            with open(name, "r+b") as f:
                f.write(data[:1])
        elif change == "truncated":
            os.truncate(name, len(data) - 1)
        else:
            with open(name + ".new", "wb") as f:
                f.write(data)
            os.replace(name + ".new", name)
        if change == "replaced":  # the descriptor is the verified file: reads go on, bitwise
            read_verified(files, ranges)
            assert all(not torch.equal(t, torch.full_like(t, -1)) for *_, t in ranges if t.numel())
            return
        with pytest.raises(
            CorruptCheckpointError, match=rf"^{name}: changed while it was being loaded .*nothing was loaded$"
        ):
            read_verified(files, ranges)
        assert all(torch.equal(t, torch.full_like(t, -1)) for *_, t in ranges)


@pytest.mark.parametrize("threshold, threaded", [(1, True), (1 << 40, False)])
def test_read_verified_copies_a_small_load_in_the_calling_thread(tmp_path, monkeypatch, threshold, threaded):
    """Below THREADED_COPY_BYTES every range is copied by the calling thread (handing small
    ranges to threads costs more than copying them); at or above it, by the pool's threads."""
    monkeypatch.setattr(staged_read, "THREADED_COPY_BYTES", threshold)
    copied_by = []
    original = staged_read._read_into

    def recording(files, verified, out):
        copied_by.append(threading.current_thread() is threading.main_thread())
        original(files, verified, out)

    monkeypatch.setattr(staged_read, "_read_into", recording)
    path = str(tmp_path / "ckpt")
    _build(path)
    files, metadata, out = _verify_all(path, 3, 1 << 20)
    with files:
        items = [
            (v, (0,) * len(v.shape), v.shape, torch.zeros(v.shape, dtype=v.dtype))
            for v in out.values()
            if isinstance(v, VerifiedRange)
        ]
        read_verified(files, items, threads=3)
    copies = sum(1 for verified, *_ in items if verified.nbytes)  # an empty range has nothing to read
    assert len(copied_by) == copies > 1
    assert copied_by == [not threaded] * copies
    for verified, _, _, target in items:
        assert torch.equal(
            target.view(-1).view(torch.uint8), staged_read.read_range(files, verified).view(-1).view(torch.uint8)
        )


def test_read_verified_bumps_the_version_of_a_target_it_reads_straight_into(tmp_path):
    """A read straight into a target's memory goes around torch, so read_verified bumps the
    version counter itself: caches keyed on it (the MXFP8 planes of a weight) must see the change."""
    path = str(tmp_path / "ckpt")
    _build(path)
    files, metadata, out = _verify_all(path, 1, 1 << 20)
    with files:
        verified = next(v for i, v in out.items() if isinstance(v, VerifiedRange) and i.fqn == "model.w")
        base = torch.zeros(2 * math.prod(verified.shape), dtype=verified.dtype)
        target = base[: math.prod(verified.shape)].view(verified.shape)  # a view, as the load's targets are
        before = base._version
        read_verified(files, [(verified, (0,) * len(verified.shape), verified.shape, target)])
        assert base._version > before and target.abs().sum() > 0

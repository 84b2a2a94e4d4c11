"""``workers=`` / ``--workers`` of the HF bridge: the output is the same bytes for any number of
worker threads (export: shards, index and config; import: the checkpoint's data file and
tensors), and a failure in one worker (a corrupt canonical chunk, a destination that refuses
writes) ends in one error line, a non-zero exit in the CLI, and nothing at the destination.
Also the pieces underneath: strided views written and read without a copy, coalesced reads of
small neighbouring chunks."""

from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import CheckpointError, ConversionError, CorruptCheckpointError
from mfsdp_ckpt.hf.strided_io import pread_tensor, pwrite_tensor, runs
from mfsdp_ckpt.hf.workers import Staging
from mfsdp_ckpt.read.reader import CheckpointReader, coalesce
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core.models.gpt import PRESETS, GPTModel

SHARD = "300KB"  # several shard files for the small presets


def _checkpoint(path, preset: str = "mixtral-like-small", row_chunks: int = 1) -> str:
    """A canonical checkpoint of ``preset``'s random weights; ``row_chunks > 1`` stores every
    matrix as that many row chunks, one after the other in the data file (as a sharded writer
    lays them out), so that reads have neighbouring small chunks to coalesce."""
    torch.manual_seed(0)
    config = PRESETS[preset]
    manifest = {
        "writer": {"world_size": 1, "buffers": [], "groups": []},
        "model_config": config.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    with CheckpointBuilder(path, manifest) as b:
        for k, v in GPTModel(config).named_parameters():
            v = v.detach()
            if v.dim() == 2 and row_chunks > 1 and v.shape[0] % row_chunks == 0:
                rows = v.shape[0] // row_chunks
                for r in range(row_chunks):
                    b.add_chunk(f"model.{k}", v[r * rows : (r + 1) * rows], (r * rows, 0), v.shape)
            else:
                b.add_tensor(f"model.{k}", v)
        b.commit()
    return str(path)


def _files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _nothing_at(path) -> bool:
    parent, name = os.path.split(os.path.abspath(path))
    return not os.path.exists(path) and not any(n.startswith(f".{name}.") for n in os.listdir(parent))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_is_byte_identical_for_any_number_of_workers(tmp_path, dtype):
    ckpt = _checkpoint(tmp_path / "ckpt", row_chunks=4)
    one = hf.export(ckpt, tmp_path / "w1", max_shard_size=SHARD, dtype=dtype, workers=1)
    three = hf.export(ckpt, tmp_path / "w3", max_shard_size=SHARD, dtype=dtype, workers=3)
    assert len(one.files) >= 3 and one.files == three.files
    a, b = _files(tmp_path / "w1"), _files(tmp_path / "w3")
    assert sorted(a) == sorted(one.files + ["config.json", "model.safetensors.index.json"])
    assert a == b  # every shard, the index json and config.json


def test_export_of_row_chunks_matches_the_export_of_whole_tensors(tmp_path):
    """The coalesced reads of neighbouring row chunks give the same tensors as one chunk each."""
    hf.export(_checkpoint(tmp_path / "whole"), tmp_path / "a", max_shard_size=SHARD, workers=2)
    hf.export(_checkpoint(tmp_path / "rows", row_chunks=8), tmp_path / "b", max_shard_size=SHARD, workers=2)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_import_is_byte_identical_for_any_number_of_workers(tmp_path):
    src = hf.export(_checkpoint(tmp_path / "ckpt"), tmp_path / "hf", max_shard_size=SHARD, workers=2).path
    hf.import_(src, tmp_path / "i1", workers=1)
    hf.import_(src, tmp_path / "i3", workers=3)
    a, b = _files(tmp_path / "i1"), _files(tmp_path / "i3")
    assert sorted(a) == sorted(b) == [".metadata", "__0_0.distcp", "mfsdp.json"]
    assert a["__0_0.distcp"] == b["__0_0.distcp"]  # the same records in the same order
    ma, mb = pickle.loads(a[".metadata"]), pickle.loads(b[".metadata"])  # differ only in the save id
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    with CheckpointReader(tmp_path / "i1") as ra, CheckpointReader(tmp_path / "i3") as rb:
        keys = ra.keys()
        assert keys == rb.keys()
        for k in keys:
            x, y = ra.read(k), rb.read(k)
            assert x.dtype == y.dtype and torch.equal(x, y), k
        assert ra.manifest["chunks"] == rb.manifest["chunks"]


def _corrupt_one_chunk(ckpt: str, key: str) -> None:
    """Flip one byte of ``key``'s data (its crc32c no longer matches)."""
    with CheckpointReader(ckpt) as r:
        info = r.manifest["chunks"]
        entry = next(v for k, v in info.items() if k.startswith(key))
    with open(os.path.join(ckpt, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + entry["length"] - 1024)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_chunk_in_one_worker_fails_the_export_in_one_line_and_leaves_nothing(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    _corrupt_one_chunk(ckpt, "model.decoder.layers.1.self_attention.linear_proj.weight")
    with pytest.raises(CorruptCheckpointError) as e:
        hf.export(ckpt, tmp_path / "out", max_shard_size=SHARD, workers=3)
    assert "\n" not in str(e.value) and "checksum mismatch" in str(e.value) and "linear_proj.weight" in str(e.value)
    assert _nothing_at(tmp_path / "out")
    result = CliRunner().invoke(
        main, ["export-hf", ckpt, str(tmp_path / "out"), "--max-shard-size", SHARD, "--workers", "3"]
    )
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert result.output.startswith("error: ") and "checksum mismatch" in result.output
    assert _nothing_at(tmp_path / "out")


def _failing_writes(monkeypatch, after: int) -> None:
    """``os.pwritev`` raises ENOSPC from its ``after``-th call on (a disk that fills up)."""
    real, calls = os.pwritev, []

    def pwritev(fd, buffers, offset):
        calls.append(1)
        if len(calls) > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


def test_a_failing_write_in_one_worker_fails_the_export_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "ckpt")
    _failing_writes(monkeypatch, after=20)
    with pytest.raises(
        CheckpointError, match=r"^No space left on device while writing .*/model-\d{5}-of-\d{5}\.safetensors$"
    ):
        hf.export(ckpt, tmp_path / "out", max_shard_size=SHARD, workers=3)
    assert _nothing_at(tmp_path / "out")
    result = CliRunner().invoke(
        main, ["export-hf", ckpt, str(tmp_path / "out"), "--max-shard-size", SHARD, "--workers", "3"]
    )
    assert (
        result.exit_code == 1
        and result.output.count("\n") == 1
        and "No space left on device while writing" in result.output
    )
    assert _nothing_at(tmp_path / "out")


def test_a_failing_write_in_one_worker_fails_the_import_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import mfsdp_ckpt.storage.fs as fsmod
    from tests.faults import FullDisk

    src = hf.export(_checkpoint(tmp_path / "ckpt"), tmp_path / "hf", max_shard_size=SHARD, workers=2).path
    real = fsmod.open_file

    def full(path, mode="rb"):
        f = real(path, mode)
        return FullDisk(f, 200_000) if "w" in mode and path.endswith(".distcp") else f

    monkeypatch.setattr(fsmod, "open_file", full)
    with pytest.raises(CheckpointError, match=r"^No space left on device while writing .*__0_0\.distcp$"):
        hf.import_(src, tmp_path / "back", workers=3)
    assert _nothing_at(tmp_path / "back")
    result = CliRunner().invoke(main, ["import-hf", src, str(tmp_path / "back"), "--workers", "3"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "No space left on device" in result.output
    assert _nothing_at(tmp_path / "back")


def test_a_failing_progress_callback_stops_every_worker(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")

    def progress(done, total):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        hf.export(ckpt, tmp_path / "out", max_shard_size=SHARD, workers=3, progress=progress)
    assert _nothing_at(tmp_path / "out")
    src = hf.export(ckpt, tmp_path / "hf", workers=3).path
    with pytest.raises(RuntimeError, match="stop here"):
        hf.import_(src, tmp_path / "back", workers=3, progress=progress)
    assert _nothing_at(tmp_path / "back")


def test_workers_must_be_a_positive_integer(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt", preset="tiny")
    for bad in (0, -1, 1.5):
        with pytest.raises(ConversionError, match="workers must be a positive integer"):
            hf.export(ckpt, tmp_path / "out", workers=bad)
    result = CliRunner().invoke(main, ["export-hf", ckpt, str(tmp_path / "out"), "--workers", "0"])
    assert result.exit_code == 2 and "--workers" in result.output
    assert _nothing_at(tmp_path / "out")


def test_strided_views_are_written_and_read_as_their_runs(tmp_path):
    fused = torch.randn(4, 6, 8, 64)  # 4 query groups of (4 q heads, k, v), head dim 8
    q, k, v = fused[:, :4], fused[:, 4], fused[:, 5]
    assert len(runs(q)) == 4 and runs(fused) == [(0, fused.numel() * 4)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        at = 0
        for piece in (q, k, v):
            at += pwrite_tensor(fd, piece, at)
        expected = b"".join(t.contiguous().numpy().tobytes() for t in (q, k, v))
        assert (tmp_path / "f").read_bytes() == expected
        back = torch.empty_like(fused)
        at = 0
        for piece in (back[:, :4], back[:, 4], back[:, 5]):
            at += pread_tensor(fd, piece, at)
        assert torch.equal(back, fused)
        transposed = torch.randn(32, 16).t()  # short runs: copied, still exact
        assert runs(transposed) is None
        pwrite_tensor(fd, transposed, 0)
        out = torch.empty(16, 32)
        pread_tensor(fd, out, 0)
        assert torch.equal(out, transposed)
        with pytest.raises(EOFError):
            pread_tensor(fd, torch.empty(10**6), 0)
    finally:
        os.close(fd)


def test_staging_reuses_one_buffer():
    s = Staging()
    a = s.tensor(torch.float32, (4, 8))
    b = s.tensor(torch.bfloat16, (16,))
    assert a.data_ptr() == b.data_ptr() and b.shape == (16,) and b.dtype == torch.bfloat16


def test_coalesce_groups_small_neighbours_only():
    class Info:
        def __init__(self, path, offset, length):
            self.relative_path, self.offset, self.length = path, offset, length

    chunks = [
        (None, Info("a", 0, 100)),
        (None, Info("a", 100, 50)),
        (None, Info("a", 150, 5 << 20)),
        (None, Info("a", (5 << 20) + 150, 10)),
        (None, Info("b", 0, 10)),
        (None, Info("b", 10, 10)),
        (None, Info("b", 30, 10)),
    ]
    assert coalesce(chunks) == [[0, 1], [2], [3], [4, 5], [6]]
    assert coalesce(chunks[:2], limit=120) == [[0], [1]]

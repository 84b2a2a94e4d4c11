"""DCP's file-system writer in the stock on-disk format (so stock PyTorch tools read our
checkpoints), recording every chunk's place and crc32c in its data file's record table and
committing atomically.

Commit protocol: every rank writes its data files into a temporary sibling directory; the
coordinator writes ``.metadata`` (DCP), then ``mfsdp.json`` with the checkpoint's index, then
renames the directory to its final name in one ``rename``. A directory without ``mfsdp.json`` is never a checkpoint. On an
object store (no rename) the files go straight to the final prefix and ``mfsdp.json``, written
last, is the commit.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from io import UnsupportedOperation
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemBase,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.checksum import chunk_id
from mfsdp_ckpt.format.manifest import indexed
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, dcp_data_file
from mfsdp_ckpt.format.record_table import DataFile, Record, encode_table, table_crc
from mfsdp_ckpt.read.records import without_zip_crc
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.objstore import RemoteFileSystem
from mfsdp_ckpt.storage.write_errors import RecordingStream, reporting, write_failed
from mfsdp_ckpt.write.destination import Destination, LocalDestination, ObjectStoreDestination
from mfsdp_ckpt.write.manifest import write_manifest

__all__ = ["CommittingWriter"]


class _RecordingStreams:
    """Mixed into a DCP file system: its write streams remember their first ``OSError`` (torch's
    zip writer replaces it with ``unexpected pos``; an upload's failure would be lost the same
    way), so that the writer can report it in one line naming the file."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[RecordingStream] = []
        self.max_write: int | None = None  # see RecordingStream

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:  # type: ignore[misc]
            if "w" not in mode:
                yield f
                return
            stream = RecordingStream(f, path, self.max_write)
            self.streams.append(stream)
            yield stream


class _RecordingFileSystem(_RecordingStreams, FileSystem):
    """DCP's local file system, recording write errors."""


class _RecordingRemoteFileSystem(_RecordingStreams, RemoteFileSystem):
    """:class:`~mfsdp_ckpt.storage.objstore.RemoteFileSystem` (object stores), recording write errors."""


#: the DCP file system that writes into each kind of destination
_FILE_SYSTEMS: dict[type[Destination], type[FileSystemBase]] = {
    LocalDestination: _RecordingFileSystem,
    ObjectStoreDestination: _RecordingRemoteFileSystem,
}


class CommittingWriter(FileSystemWriter):
    """Writes into ``tmp_dir``, the staging place of ``destination``, and, on the coordinator
    (which opened it), commits it. A write the operating system refuses (a full disk) fails in
    one line naming the file.

    On an fsspec URL (``tmp_dir == final_dir``, an object store has no rename) each data file is
    uploaded straight to the final prefix (:mod:`mfsdp_ckpt.storage.objstore`: spooled, then one PUT or a
    parallel multipart upload, retried whole with backoff) and the coordinator commits by writing
    ``mfsdp.json`` after ``.metadata``: the last object of the checkpoint."""

    def __init__(
        self,
        destination: Destination,
        tmp_dir: str,
        manifest: dict[str, Any],
        *,
        thread_count: int = 1,
        sync_files: bool = True,
    ) -> None:
        file_system = _FILE_SYSTEMS[type(destination)]()
        durable = sync_files and isinstance(file_system, FileSystem)  # an upload has nothing to fsync
        super().__init__(tmp_dir, thread_count=thread_count, sync_files=durable, overwrite=False)
        self.fs = file_system
        self.path = self.fs.init_path(tmp_dir)
        self.destination = destination
        self.tmp_dir = tmp_dir
        self.manifest = manifest
        self.files: list[DataFile] = []  # what write_data wrote, for the index

    def bound_writes(self, max_bytes: int) -> None:
        """Hand the data files at most ``max_bytes`` per ``write`` call from now on (an
        asynchronous save's background write: each call holds its core until it returns)."""
        self.fs.max_write = max_bytes

    def set_rank(self, rank: int) -> None:
        """The rank whose files this writer writes (``__<rank>_<k>.distcp``)."""
        self.rank = rank

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into ``thread_count`` data files in DCP's format (a torch.save
        record per tensor chunk, raw bytes per object), each ending in its record table
        (:mod:`mfsdp_ckpt.format.record_table`); :attr:`files` then lists them for the index."""
        if not hasattr(planner, "checksums"):  # the crc32c of every payload, computed as it is resolved
            raise CheckpointError("CommittingWriter needs a planner that records checksums (MfsdpSavePlanner)")
        rank = self.rank or 0
        buckets = [b for b in _split_by_size_and_type(max(self.thread_count, 1), plan.items) if b] or [[]]
        jobs = [(dcp_data_file(rank, k), bucket) for k, bucket in enumerate(buckets)]
        with reporting(self.tmp_dir, self.fs.streams), without_zip_crc():
            try:
                if len(jobs) == 1:
                    written = [self._write_file(name, items, planner) for name, items in jobs]
                else:
                    with ThreadPoolExecutor(len(jobs), thread_name_prefix="mfsdp-write") as pool:
                        written = list(pool.map(lambda job: self._write_file(*job, planner), jobs))
            finally:
                streams = list(self.fs.streams)
            if any(st.error for st in streams):  # an error hidden behind torch's zip writer's
                failed = next(st for st in streams if st.error)
                raise write_failed(failed.error, failed.path)
        results = [wr for _, rs in written for wr in rs]
        self.files = [f for f, _ in written]
        if len(results) != len(plan.items):
            raise CheckpointError(
                f"{self.tmp_dir}: {len(plan.items) - len(results)} of {len(plan.items)} chunks were not written"
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> tuple[DataFile, list[WriteResult]]:
        """One data file: objects first, then tensor chunks, then the record table."""
        path = self.fs.concat_path(self.path, name)
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
            i for i in items if i.type != WriteItemType.BYTE_IO
        ]
        results, rows = [], []
        with self.fs.create_stream(path, "wb") as stream:
            for item in ordered:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    data = data.detach().cpu()
                    if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                        data = data.clone()  # torch.save writes a view's whole storage: keep the chunk's bytes only
                    torch.save(data, stream)
                length = stream.tell() - offset
                cid = chunk_id(item.index)
                rows.append((cid, Record(offset, length, planner.checksums[cid])))
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                )
            table = encode_table(rows)
            stream.write(table)
            size = stream.tell()
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, UnsupportedOperation):
                    os.sync()
        return DataFile(name, self.rank or 0, size, len(rows), table_crc(table)), results

    def commit(self, metadata: Metadata, results: list[WriteResult], index: dict[str, Any]) -> None:
        """The coordinator's commit of a save: ``.metadata`` (stock DCP, from every rank's write
        results), ``mfsdp.json`` with ``index`` (see :mod:`mfsdp_ckpt.format.catalog`), then the
        destination's commit (one rename; on an object store the manifest, written last, is it)."""
        with reporting(fs.join(self.tmp_dir, METADATA_NAME), self.fs.streams):
            self.finish(metadata, [results])
        total = sum(wr.storage_data.length for wr in results)
        manifest = indexed(self.manifest, self.save_id, index, total)

        def write_last() -> None:
            with reporting(fs.join(self.tmp_dir, MANIFEST_NAME)):
                write_manifest(self.tmp_dir, manifest, sync=self.sync_files)

        self.destination.commit(write_last)

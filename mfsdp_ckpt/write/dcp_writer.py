"""DCP's file-system writer in the stock on-disk format (so stock PyTorch tools read our
checkpoints), recording every chunk's crc32c and committing atomically.

Commit protocol: every rank writes into a temporary sibling directory; the coordinator writes
``.metadata`` (DCP), then ``mfsdp.json`` with every chunk's crc32c, then renames the directory to
its final name in one ``rename``. A directory without ``mfsdp.json`` is never a checkpoint. On an
object store (no rename) the files go straight to the final prefix and ``mfsdp.json``, written
last, is the commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.checksum import chunk_id
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME
from mfsdp_ckpt.read.manifest import completed, write_manifest
from mfsdp_ckpt.read.records import without_zip_crc
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.objstore import RemoteFileSystem
from mfsdp_ckpt.storage.staging import commit_directory, fsync_dir
from mfsdp_ckpt.storage.write_errors import RecordingStream, reporting, write_failed

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


class CommittingWriter(FileSystemWriter):
    """Writes into ``tmp_dir`` and, on the coordinator, commits it as ``final_dir``. A write the
    operating system refuses (a full disk) fails in one line naming the file.

    On an fsspec URL (``tmp_dir == final_dir``, an object store has no rename) each data file is
    uploaded straight to the final prefix (:mod:`mfsdp_ckpt.storage.objstore`: spooled, then one PUT or a
    parallel multipart upload, retried whole with backoff) and the coordinator commits by writing
    ``mfsdp.json`` after ``.metadata``: the last object of the checkpoint."""

    def __init__(
        self,
        tmp_dir: str,
        final_dir: str,
        manifest: dict[str, Any],
        *,
        overwrite: bool,
        thread_count: int = 1,
        sync_files: bool = True,
    ) -> None:
        self.remote = not fs.is_local(final_dir)
        super().__init__(tmp_dir, thread_count=thread_count, sync_files=sync_files and not self.remote, overwrite=False)
        self.fs = _RecordingRemoteFileSystem() if self.remote else _RecordingFileSystem()
        if self.remote:
            self.path = self.fs.init_path(tmp_dir)
        self.tmp_dir = tmp_dir
        self.final_dir = final_dir
        self.manifest = manifest
        self.allow_overwrite = overwrite

    def bound_writes(self, max_bytes: int) -> None:
        """Hand the data files at most ``max_bytes`` per ``write`` call from now on (an
        asynchronous save's background write: each call holds its core until it returns)."""
        self.fs.max_write = max_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with (
            reporting(self.tmp_dir, self.fs.streams),
            without_zip_crc(),
        ):  # the manifest's crc32c covers every chunk (see records.py)
            try:
                results = super().write_data(plan, planner).wait()
            finally:
                streams = list(self.fs.streams)
            if any(st.error for st in streams):  # a failure in a writer thread, which DCP only prints
                failed = next(st for st in streams if st.error)
                raise write_failed(failed.error, failed.path)
        if not hasattr(planner, "checksums"):  # the crc32c of every payload, computed while planning the writes
            raise CheckpointError("CommittingWriter needs a planner that records checksums (MfsdpSavePlanner)")
        if len(results) != len(plan.items):
            raise CheckpointError(
                f"{self.tmp_dir}: {len(plan.items) - len(results)} of {len(plan.items)} chunks were not written"
            )
        # the checksum travels with each result to the coordinator; finish() strips it again
        stamped = [
            dataclasses.replace(wr, storage_data=(wr.storage_data, planner.checksums[chunk_id(wr.index)]))
            for wr in results
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(stamped)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        chunks: dict[str, dict[str, Any]] = {}
        plain = []
        for rank_results in results:
            plain_rank = []
            for wr in rank_results:
                info, crc = wr.storage_data
                chunks[chunk_id(wr.index)] = {
                    "file": info.relative_path,
                    "offset": info.offset,
                    "length": info.length,
                    "crc32c": crc,
                }
                plain_rank.append(dataclasses.replace(wr, storage_data=info))
            plain.append(plain_rank)
        with reporting(fs.join(self.tmp_dir, METADATA_NAME), self.fs.streams):
            super().finish(metadata, plain)
        with reporting(fs.join(self.tmp_dir, MANIFEST_NAME)) if self.remote else contextlib.nullcontext():
            write_manifest(self.tmp_dir, completed(self.manifest, self.save_id, chunks), sync=self.sync_files)
        if self.remote:
            return  # the manifest, written last, was the commit
        if self.sync_files:
            fsync_dir(self.tmp_dir)
        commit_directory(self.tmp_dir, self.final_dir, overwrite=self.allow_overwrite)

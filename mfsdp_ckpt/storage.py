"""Storage: DCP's file-system writer / reader in the stock on-disk format (so stock PyTorch
tools read our checkpoints), plus checksums, atomic commit and safe metadata reading.

Commit protocol: every rank writes into a temporary sibling directory; the coordinator writes
``.metadata`` (DCP), then ``mfsdp.json`` with every chunk's crc32c, then renames the directory to
its final name in one ``rename``. A directory without ``mfsdp.json`` is never a checkpoint. On an
object store (no rename) the files go straight to the final prefix and ``mfsdp.json``, written
last, is the commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mfsdp_ckpt import fs
from mfsdp_ckpt.boxes import box_view, narrow
from mfsdp_ckpt.chunks import ChunkFiles, chunk_location, chunk_shapes
from mfsdp_ckpt.errors import CheckpointError, CorruptCheckpointError
from mfsdp_ckpt.manifest import completed, metadata_checksum_problem, write_manifest
from mfsdp_ckpt.metadata_check import checked_metadata, stored_by_key
from mfsdp_ckpt.names import MANIFEST_NAME, METADATA_NAME
from mfsdp_ckpt.objstore import RemoteFileSystem
from mfsdp_ckpt.planner import MfsdpSavePlanner, chunk_id
from mfsdp_ckpt.records import without_zip_crc
from mfsdp_ckpt.safety import safe_load_metadata
from mfsdp_ckpt.staged_read import (
    DEFAULT_READ_THREADS,
    VerifiedRange,
    read_range,
    read_verified,
    verify_chunks,
)
from mfsdp_ckpt.staging import commit_directory, fsync_dir
from mfsdp_ckpt.write_errors import RecordingStream, reporting, write_failed

__all__ = ["CommittingWriter", "VerifyingReader", "commit_directory", "fsync_dir"]


class _RecordingStreams:
    """Mixed into a DCP file system: its write streams remember their first ``OSError`` (torch's
    zip writer replaces it with ``unexpected pos``; an upload's failure would be lost the same
    way), so that the writer can report it in one line naming the file."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[RecordingStream] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:  # type: ignore[misc]
            if "w" not in mode:
                yield f
                return
            stream = RecordingStream(f, path)
            self.streams.append(stream)
            yield stream


class _RecordingFileSystem(_RecordingStreams, FileSystem):
    """DCP's local file system, recording write errors."""


class _RecordingRemoteFileSystem(_RecordingStreams, RemoteFileSystem):
    """:class:`~mfsdp_ckpt.objstore.RemoteFileSystem` (object stores), recording write errors."""


class CommittingWriter(FileSystemWriter):
    """Writes into ``tmp_dir`` and, on the coordinator, commits it as ``final_dir``. A write the
    operating system refuses (a full disk) fails in one line naming the file.

    On an fsspec URL (``tmp_dir == final_dir``, an object store has no rename) each data file is
    uploaded straight to the final prefix (:mod:`mfsdp_ckpt.objstore`: spooled, then one PUT or a
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
        self.remote = fs.is_url(final_dir)
        super().__init__(tmp_dir, thread_count=thread_count, sync_files=sync_files and not self.remote, overwrite=False)
        self.fs = _RecordingRemoteFileSystem() if self.remote else _RecordingFileSystem()
        if self.remote:
            self.path = self.fs.init_path(tmp_dir)
        self.tmp_dir = tmp_dir
        self.final_dir = final_dir
        self.manifest = manifest
        self.allow_overwrite = overwrite

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
        assert isinstance(planner, MfsdpSavePlanner)
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


@dataclass(frozen=True)
class _Deferred:
    """A piece of a verified chunk left in its file: box ``offsets``/``lengths`` of its tensor."""

    verified: VerifiedRange
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class VerifyingReader(FileSystemReader):
    """Reads ``.metadata`` through the restricted unpickler and the value checks of
    :mod:`mfsdp_ckpt.metadata_check`, and checks every chunk it reads against the manifest's crc32c
    (when there is a manifest: a stock DCP checkpoint has none).

    Verified chunks are held, not copied into their targets: :meth:`apply` does that once every
    rank has read everything, so a failed load changes nothing. A local checkpoint's plain tensor
    records are held as verified file ranges, read again into their targets by :meth:`apply`
    (:func:`~mfsdp_ckpt.staged_read.verify_chunks`); the data files stay open until :meth:`close`."""

    def __init__(self, path: str, manifest: dict[str, Any] | None, *, thread_count: int = DEFAULT_READ_THREADS) -> None:
        super().__init__(path)
        self.dir = str(path)
        self.thread_count = thread_count
        self.manifest = manifest
        self.manifest_chunks: dict[str, dict[str, Any]] | None = manifest["chunks"] if manifest else None
        self.pending: list[tuple[Any, torch.Tensor | _Deferred]] = []
        self.files: ChunkFiles | None = None
        self.chunk_shapes: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.stored: dict[str, list[tuple[MetadataIndex, Any]]] = {}
        self._metadata: Metadata | None = None

    def apply(self, planner: LoadPlanner) -> None:
        """Copy every verified chunk into its target (after a successful ``dcp.load``)."""
        deferred = [(req, piece) for req, piece in self.pending if isinstance(piece, _Deferred)]
        if deferred:
            assert self.files is not None
            # first: it refuses a file changed since it was verified before copying anything
            read_verified(
                self.files,
                [
                    (piece.verified, piece.offsets, piece.lengths, planner.resolve_tensor(req).detach())
                    for req, piece in deferred
                ],
                threads=self.thread_count,
            )
        for req, piece in self.pending:
            target = planner.resolve_tensor(req).detach()
            if not isinstance(piece, _Deferred):
                target.copy_(piece)
            planner.commit_tensor(req, target)
        self.pending = []
        self.close()

    def close(self) -> None:
        """Close the data files kept open for :meth:`apply`."""
        if self.files is not None:
            self.files.close()
            self.files = None

    def _piece(self, piece: torch.Tensor | _Deferred) -> torch.Tensor:
        """A held piece as a tensor (a verified range is read again)."""
        if not isinstance(piece, _Deferred):
            return piece
        assert self.files is not None
        return narrow(read_range(self.files, piece.verified), piece.offsets, piece.lengths)

    def preview(self, fqn: str, target: torch.Tensor) -> torch.Tensor:
        """A copy of ``target`` (a whole-tensor target of key ``fqn``) holding what :meth:`apply`
        would copy into it, to check a value before anything changes."""
        out = target.detach().clone()
        for req, piece in self.pending:
            if req.dest_index.fqn == fqn:
                narrow(out, req.dest_offsets, req.lengths).copy_(self._piece(piece))
        return out

    def preview_flat(self, key: str, entry: Any) -> torch.Tensor:
        """A copy of a :class:`~mfsdp_ckpt.state.FlatEntry` target's tensor holding what
        :meth:`apply` would copy into it (its boxes, in the load planner's order)."""
        out = entry.tensor.detach().clone()
        boxes = entry.boxes()
        for req, piece in self.pending:
            if req.dest_index.fqn == key:
                view = box_view(out, entry.start, boxes[req.dest_index.index])
                narrow(view, req.dest_offsets, req.lengths).copy_(self._piece(piece))
        return out

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata (read once: ``dcp.load`` asks again and gets the same object)."""
        if self._metadata is not None:
            return self._metadata
        path = fs.join(self.dir, METADATA_NAME)
        try:
            data = fs.read_member(self.dir, METADATA_NAME)
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot read DCP metadata ({e.strerror or e})") from None
        metadata = safe_load_metadata(data, path)
        problem = metadata_checksum_problem(self.manifest, data)
        if problem is not None:
            raise CorruptCheckpointError(f"{path}: {problem}")
        metadata = checked_metadata(metadata, path)
        self.chunk_shapes = chunk_shapes(metadata)
        self.stored = stored_by_key(metadata)
        self._metadata = metadata
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_chunk: dict[MetadataIndex, list] = {}
        for req in plan.items:
            if req.storage_index not in self.storage_data:
                raise CorruptCheckpointError(
                    f"{self.dir}: key '{req.storage_index.fqn}': a chunk the load needs has no stored data"
                )
            by_chunk.setdefault(req.storage_index, []).append(req)
        self.close()
        files = self.files = ChunkFiles(self.dir, self.manifest_chunks, self.chunk_shapes)
        payloads = verify_chunks(
            files, [(index, self.storage_data[index]) for index in by_chunk], threads=self.thread_count
        )
        for index, reqs in by_chunk.items():
            self._place(files, index, payloads.pop(index), reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _place(
        self,
        files: ChunkFiles,
        index: Any,
        payload: torch.Tensor | bytes | VerifiedRange,
        reqs: list,
        planner: LoadPlanner,
    ) -> None:
        """Hand a verified chunk to its read requests: objects to the planner now, tensor pieces
        to :meth:`apply` later."""
        info = self.storage_data[index]
        if isinstance(payload, bytes):
            for req in reqs:
                try:
                    planner.load_bytes(req, io.BytesIO(payload))
                except Exception as e:  # noqa: BLE001 - whatever torch.load makes of hostile bytes
                    raise CorruptCheckpointError(
                        f"{chunk_location(files.path(info.relative_path), index)}: object not "
                        f"loadable with weights_only ({type(e).__name__})"
                    ) from None
            return
        shape = tuple(payload.shape)
        for req in reqs:
            if (
                len(req.storage_offsets) != len(shape)
                or len(req.lengths) != len(shape)
                or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, shape))
            ):
                raise CorruptCheckpointError(
                    f"{chunk_location(files.path(info.relative_path), index)}: chunk has shape "
                    f"{shape}, which does not fit the read"
                )
            if isinstance(payload, VerifiedRange):
                self.pending.append((req, _Deferred(payload, tuple(req.storage_offsets), tuple(req.lengths))))
                continue
            piece = narrow(payload, req.storage_offsets, req.lengths)
            if tuple(piece.size()) != tuple(req.lengths):
                raise CorruptCheckpointError(
                    f"{chunk_location(files.path(info.relative_path), index)}: chunk has shape "
                    f"{shape}, which does not fit the read"
                )
            self.pending.append((req, piece))

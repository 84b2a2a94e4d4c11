"""DCP's file-system reader for our checkpoints and stock ones: the metadata read safely and
checked once, every chunk's crc32c verified against the manifest, chunks read in spans of
neighbours (:mod:`mfsdp_ckpt.read.staged_read`) straight into place."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
)
from torch.futures import Future

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.boxes import box_view, narrow
from mfsdp_ckpt.format.checksum import chunk_id
from mfsdp_ckpt.read.base import Either, OpenBase, open_base
from mfsdp_ckpt.read.chunks import ChunkFiles, chunk_location, chunk_shapes
from mfsdp_ckpt.read.direct_read import direct_chunk, read_into_place
from mfsdp_ckpt.read.index_check import read_stock_metadata
from mfsdp_ckpt.read.indexed import IndexedCheckpoint, has_index
from mfsdp_ckpt.read.metadata_check import stored_by_key
from mfsdp_ckpt.read.staged_read import (
    DEFAULT_READ_THREADS,
    VerifiedRange,
    file_descriptor,
    read_range,
    read_verified,
    verify_chunks,
)
from mfsdp_ckpt.read.stock import KeyRule, canonical_names, is_stock

__all__ = ["VerifyingReader"]


@dataclass(frozen=True)
class _Deferred:
    """A piece of a verified chunk left in its file: box ``offsets``/``lengths`` of its tensor."""

    verified: VerifiedRange
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class VerifyingReader(FileSystemReader):
    """Reads ``.metadata`` through the restricted unpickler and the value checks of
    :mod:`mfsdp_ckpt.read.metadata_check`, and checks every chunk it reads against the manifest's crc32c
    (when there is a manifest: a stock DCP checkpoint has none).

    With ``direct`` (``load(atomic=False)``), the chunks of local files that can be are read
    straight into their targets and checked as they arrive (:mod:`mfsdp_ckpt.read.direct_read`):
    a bad chunk is still reported, but the targets read so far have changed. The others are held
    as below.

    Verified chunks are held, not copied into their targets: :meth:`apply` does that once every
    rank has read everything, so a failed load changes nothing. A local checkpoint's plain tensor
    records are held as verified file ranges, read again into their targets by :meth:`apply`
    (:func:`~mfsdp_ckpt.read.staged_read.verify_chunks`); the data files stay open until :meth:`close`.

    With ``canonical`` (what ``load`` asks for), entries are shown under canonical keys: a stock
    checkpoint's through its key layout, any one through ``key_map``'s rules (:mod:`mfsdp_ckpt.read.stock`), so that everything after
    :meth:`read_metadata` (key checks, DCP's planner, the chunk reads) sees canonical names; the
    stored bytes are found by their file and offset, which do not change. ``group_parts`` lists a
    stock checkpoint's ``optim.param_groups.<…>`` entries, kept under their stored names, which
    together make ``optim.param_groups`` (:func:`~mfsdp_ckpt.read.stock.stock_param_groups`)."""

    def __init__(
        self,
        path: str,
        manifest: dict[str, Any] | None,
        *,
        thread_count: int = DEFAULT_READ_THREADS,
        canonical: bool = False,
        key_map: Sequence[KeyRule] = (),
        direct: bool = False,
    ) -> None:
        super().__init__(path)
        self.direct = direct
        self.dir = str(path)
        self.thread_count = thread_count
        self.manifest = manifest
        self.canonical = canonical
        self.key_map = tuple(key_map)
        self.group_parts: list[str] = []
        self.manifest_chunks: Mapping[str, dict[str, Any]] | None = (
            manifest["chunks"] if manifest and "chunks" in manifest else None
        )
        self.pending: list[tuple[Any, torch.Tensor | _Deferred]] = []
        self.files: ChunkFiles | None = None
        self.chunk_shapes: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.stored: dict[str, list[tuple[MetadataIndex, Any]]] = {}
        self._metadata: Metadata | None = None
        self.indexed: IndexedCheckpoint | None = None  # a save's checkpoint read through its index
        self.base: OpenBase | None = None  # the base it references (frozen weights), opened and checked

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
        """A copy of a :class:`~mfsdp_ckpt.sharded.state.FlatEntry` target's tensor holding what
        :meth:`apply` would copy into it (its boxes, in the load planner's order)."""
        out = entry.tensor.detach().clone()
        boxes = entry.boxes()
        for req, piece in self.pending:
            if req.dest_index.fqn == key:
                view = box_view(out, entry.start, boxes[req.dest_index.index])
                narrow(view, req.dest_offsets, req.lengths).copy_(self._piece(piece))
        return out

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata, under canonical keys when asked (read once: ``dcp.load`` asks
        again and gets the same object)."""
        if self._metadata is not None:
            return self._metadata
        if has_index(self.manifest):  # a save's checkpoint: everything from its index, not .metadata
            assert self.manifest is not None
            self.indexed = IndexedCheckpoint(self.dir, self.manifest)
            self.base = open_base(self.dir, self.manifest)
            self.manifest_chunks, lazy, shapes, stored = self._tables()
            metadata = self._canonical(lazy) if self.canonical else lazy
            if metadata is lazy:
                self.chunk_shapes, self.stored = shapes, stored
            else:  # renamed keys: the tables follow the new names (every chunk looked up once)
                self.chunk_shapes, self.stored = chunk_shapes(metadata), stored_by_key(metadata)
            self._metadata = metadata
            return metadata
        metadata = read_stock_metadata(self.dir, self.manifest)
        if self.canonical:
            metadata = self._canonical(metadata)
        self.chunk_shapes = chunk_shapes(metadata)
        self.stored = stored_by_key(metadata)
        self._metadata = metadata
        return metadata

    def _tables(self) -> tuple[Mapping, Metadata, Mapping, Mapping]:
        """(checksums, metadata, chunk shapes, stored chunks) of a save's checkpoint, its base's
        entries included when it references one (:mod:`mfsdp_ckpt.read.base`)."""
        own = self.indexed
        assert own is not None
        md = own.metadata()
        if self.base is None:
            return own.checksums, md, own.chunk_shapes, own.stored
        base = self.base.indexed
        both = sorted(set(own.catalog.keys) & set(base.catalog.keys))
        if both:
            raise CorruptCheckpointError(
                f"{self.dir}: key '{both[0]}' is stored both here and in its base {base.directory}"
            )
        base_md = base.metadata()
        metadata = Metadata(
            state_dict_metadata=Either(md.state_dict_metadata, base_md.state_dict_metadata),
            storage_data=Either(md.storage_data, base_md.storage_data),
            storage_meta=md.storage_meta,
        )
        return (
            Either(own.checksums, base.checksums),
            metadata,
            Either(own.chunk_shapes, base.chunk_shapes),
            Either(own.stored, base.stored),
        )

    def _canonical(self, metadata: Metadata) -> Metadata:
        """``metadata`` with its entries renamed to canonical keys (the same object when nothing
        is renamed: a canonical checkpoint and no rules); the manifest's checksums follow their
        chunks to the new names."""
        names = canonical_names(metadata.state_dict_metadata, self.key_map, stock_layout=is_stock(self.manifest))
        self.group_parts = names.group_parts
        renamed = {src: dst for dst, src in names.sources.items() if src != dst}
        if not renamed:
            return metadata
        if self.manifest_chunks is not None:
            moved = {
                chunk_id(old): chunk_id(MetadataIndex(renamed[old.fqn], old.offset, old.index))
                for old in metadata.storage_data
                if old.fqn in renamed
            }
            self.manifest_chunks = {moved.get(cid, cid): entry for cid, entry in self.manifest_chunks.items()}
        return Metadata(
            state_dict_metadata={renamed.get(k, k): v for k, v in metadata.state_dict_metadata.items()},
            planner_data=metadata.planner_data,
            storage_data={
                MetadataIndex(renamed.get(i.fqn, i.fqn), i.offset, i.index): info
                for i, info in metadata.storage_data.items()
            },
            storage_meta=metadata.storage_meta,
            version=metadata.version,
        )

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
        if self.direct:
            self._read_directly(files, by_chunk, planner)
        payloads = verify_chunks(
            files, [(index, self.storage_data[index]) for index in by_chunk], threads=self.thread_count
        )
        for index, reqs in by_chunk.items():
            self._place(files, index, payloads.pop(index), reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_directly(self, files: ChunkFiles, by_chunk: dict[MetadataIndex, list], planner: LoadPlanner) -> None:
        """Read the chunks that can be straight into their targets (removed from ``by_chunk``;
        a local checkpoint's only)."""
        items = [(index, reqs, self.storage_data[index]) for index, reqs in by_chunk.items()]
        if any(file_descriptor(files.open(info.relative_path, index.fqn)) is None for index, _, info in items):
            return  # an object store: read through staging memory
        chunks = []
        for index, reqs, info in items:
            chunk = direct_chunk(files, index, info, reqs, planner.resolve_tensor)
            if chunk is not None:
                chunks.append(chunk)
                del by_chunk[index]
        chunks.sort(key=lambda c: (c.info.relative_path, c.data_offset))
        read_into_place(files, chunks, threads=self.thread_count)

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

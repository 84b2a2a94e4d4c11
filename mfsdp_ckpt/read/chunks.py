"""Reading stored chunks, in one place for every reader (``load``'s DCP reader, the streaming
reader of the offline tools, ``verify``).

A chunk is one ``torch.save`` record (or one serialized object) at a byte range of a data file.
:class:`ChunkFiles` opens a checkpoint's data files once each (local or fsspec) and reads chunks
through :func:`read_chunk`, which checks that a chunk is complete, readable and matches the
manifest's crc32c. :func:`coverage_faults` checks from metadata alone that a tensor's chunks
cover it exactly once.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Sequence

import numpy
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import (
    ChunkFault,
    CorruptCheckpointError,
    OutsideCheckpointError,
    UnsafeCheckpointError,
    one_line,
)
from mfsdp_ckpt.format.base_ref import name_problem, split_base_file
from mfsdp_ckpt.format.checksum import chunk_id, payload_crc32c
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.fs import FileSlice

__all__ = [
    "FileSlice",
    "ChunkFiles",
    "Fault",
    "chunk_shapes",
    "chunk_location",
    "missing_bytes",
    "read_chunk",
    "expected_crc",
    "decode_record_at",
    "tensor_view",
    "MemoryFile",
    "coverage_faults",
]


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a checkpoint: in ``file`` (None: the metadata), at ``key``'s chunk at
    ``offset`` (None: the key as a whole)."""

    file: str | None
    key: str
    offset: tuple[int, ...] | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        at = f" at {list(self.offset)}" if self.offset is not None else ""
        return f"{where}{self.key}{at}: {self.message}"


def chunk_shapes(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor chunk's dtype and sizes, by its storage index (what :func:`read_chunk` expects)."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                out[MetadataIndex(key, torch.Size(chunk.offsets))] = (md.properties.dtype, tuple(chunk.sizes))
    return out


def chunk_location(path: str, index: MetadataIndex) -> str:
    """``<file>: key '<fqn>' chunk at [o0, o1]``, how every error about one chunk starts."""
    return f"{path}: key '{index.fqn}'" + (f" chunk at {list(index.offset)}" if index.offset is not None else "")


def missing_bytes(f: IO[bytes], info: Any) -> str | None:
    """Why the open file ``f`` does not hold the chunk's byte range (None: it does)."""
    size = fs.file_size(f)
    if size < info.offset + info.length:
        return f"truncated (needs bytes {info.offset}..{info.offset + info.length}, the file has {size})"
    return None


def expected_crc(info: Any, index: MetadataIndex, manifest_chunks: dict[str, Any] | None) -> int | None:
    """The chunk's crc32c from the manifest (None without a manifest), after checking that the
    manifest lists it at the same place as ``.metadata``; raises :class:`ChunkFault` otherwise."""
    if getattr(info, "transform_descriptors", None):
        raise ChunkFault(f"stream transforms {info.transform_descriptors} are not supported")
    if manifest_chunks is None:
        return None
    entry = manifest_chunks.get(chunk_id(index))
    if entry is None:
        raise ChunkFault("not listed in the manifest")
    if (entry["file"], entry["offset"], entry["length"]) != (info.relative_path, info.offset, info.length):
        raise ChunkFault(
            f"the manifest places it at {entry['file']} bytes {entry['offset']}+{entry['length']}, "
            f".metadata at {info.relative_path} bytes {info.offset}+{info.length}"
        )
    return entry["crc32c"]


def _check_fits(index: MetadataIndex, info: Any, expect: tuple[torch.dtype, Sequence[int]] | None) -> None:
    """Before allocating anything: the expected elements fit in the chunk's stored bytes."""
    if index.offset is not None and expect is not None and math.prod(expect[1]) * expect[0].itemsize > info.length:
        raise ChunkFault(
            f"{math.prod(expect[1])} {str(expect[0]).replace('torch.', '')} elements do not fit in "
            f"its {info.length} stored bytes"
        )


def _loaded_tensor(stream: IO[bytes], expect: tuple[torch.dtype, Sequence[int]] | None) -> torch.Tensor:
    """A record that is not plain, through ``torch.load(weights_only=True)``, checked against ``expect``."""
    try:
        payload = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of hostile bytes
        raise ChunkFault(f"unreadable chunk ({type(e).__name__}: {one_line(e, first_line=True)})") from None
    if not isinstance(payload, torch.Tensor):
        raise ChunkFault("chunk does not hold a tensor")
    if expect is not None and (payload.dtype != expect[0] or tuple(payload.shape) != tuple(expect[1])):
        raise ChunkFault(
            f"holds {payload.dtype} {tuple(payload.shape)}, which does not fit its metadata "
            f"({expect[0]} {tuple(expect[1])})"
        )
    return payload


def _check_crc(payload: torch.Tensor | bytes | numpy.ndarray, expected: int | None) -> None:
    if expected is not None and payload_crc32c(payload) != expected:
        raise ChunkFault("checksum mismatch")


def read_chunk(
    f: IO[bytes],
    info: Any,
    index: MetadataIndex,
    manifest_chunks: dict[str, Any] | None,
    expect: tuple[torch.dtype, Sequence[int]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | bytes:
    """One chunk's payload: a tensor, or the bytes of a serialized object (``index.offset`` is
    None). Checks that it is complete, readable, listed in the manifest at the same place and
    matches its crc32c (when there is a manifest), and, before allocating anything, that its
    elements fit in its stored bytes; raises :class:`ChunkFault` otherwise.

    With ``expect`` (the chunk's dtype and sizes from the metadata) a plain record's bytes are read
    straight into a new tensor instead of going through ``torch.load``; with ``out`` (a contiguous
    tensor of the chunk's dtype and element count) straight into ``out``, which is returned."""
    expected = expected_crc(info, index, manifest_chunks)
    truncated = missing_bytes(f, info)
    if truncated:
        raise ChunkFault(truncated)
    if out is not None:
        expect = (out.dtype, out.shape)
    _check_fits(index, info, expect)
    raw = None
    if index.offset is not None and expect is not None:
        raw = locate_raw_tensor(f, info.offset, info.length, expect[0], math.prod(expect[1]))
    if index.offset is None:
        f.seek(info.offset)
        payload: torch.Tensor | bytes = f.read(info.length)
    elif raw is not None:
        assert expect is not None
        payload = out if out is not None else torch.empty(tuple(expect[1]), dtype=expect[0])
        f.seek(raw.offset)
        if payload.numel() and f.readinto(payload.view(-1).view(torch.uint8).numpy()) != raw.nbytes:
            raise ChunkFault("truncated tensor data")
    else:
        payload = _loaded_tensor(FileSlice(f, info.offset, info.length), None if out is not None else expect)
        if out is not None:
            if payload.dtype != out.dtype or payload.numel() != out.numel():
                raise ChunkFault(f"holds {payload.dtype} {tuple(payload.shape)}, which does not fit its metadata")
            payload = out.copy_(payload.reshape(out.shape))
    _check_crc(payload, expected)
    return payload


def decode_record_at(
    record: numpy.ndarray,
    info: Any,
    index: MetadataIndex,
    manifest_chunks: dict[str, Any] | None,
    expect: tuple[torch.dtype, Sequence[int]] | None,
    crc_of: Callable[[int, int], int] | None = None,
) -> tuple[torch.Tensor | bytes, int | None]:
    """:func:`read_chunk` for a chunk whose ``info.length`` stored bytes are already in memory
    (``record``, a uint8 array): the same checks, and a plain record's tensor is a view of
    ``record`` (no copy; possibly not aligned to its element size, which torch's copies accept).
    Returned with where a plain record's tensor bytes start within ``record`` (None for an object or a record read through ``torch.load``): the verified bytes can then be
    read again straight from the file into their destination. ``crc_of(lo, hi)``, when given, is
    the crc32c of ``record[lo:hi]`` from checksums the caller already has (a plain record's
    tensor bytes are checked with it)."""
    expected = expected_crc(info, index, manifest_chunks)
    if len(record) < info.length:
        raise ChunkFault(
            f"truncated (needs bytes {info.offset}..{info.offset + info.length}, "
            f"the file has {info.offset + len(record)})"
        )
    _check_fits(index, info, expect)
    if index.offset is None:
        payload = bytes(record)
        _check_crc(payload, expected)
        return payload, None
    raw = None
    if expect is not None:
        raw = locate_raw_tensor(MemoryFile(record), 0, info.length, expect[0], math.prod(expect[1]))
    if raw is None:
        tensor = _loaded_tensor(MemoryFile(record), expect)  # read in place: no copy of the record
        _check_crc(tensor, expected)
        return tensor, None
    assert expect is not None
    data = record[raw.offset : raw.offset + raw.nbytes]
    if crc_of is None:
        _check_crc(data, expected)
    elif expected is not None and crc_of(raw.offset, raw.offset + raw.nbytes) != expected:
        raise ChunkFault("checksum mismatch")
    return tensor_view(data, expect[0], expect[1]), raw.offset


def tensor_view(data: numpy.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The bytes ``data`` (uint8, row-major, little-endian) as a tensor of ``dtype`` and ``shape``,
    sharing their memory. numpy accepts an address that is not a multiple of the element size
    (torch's byte-to-dtype ``view`` does not), so the bytes are reinterpreted as unsigned integers
    of the element's size first."""
    size = dtype.itemsize
    if size == 1 or data.ctypes.data % size == 0:
        flat = torch.from_numpy(data).view(dtype)
    else:
        flat = torch.from_numpy(data.view(numpy.dtype(f"<u{size}"))).view(dtype)
    return flat.view(tuple(shape))


class MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes already in memory: ``data`` holds bytes
    ``[base, base + len(data))`` of the file they were read from, read at that file's offsets
    (for :func:`read_chunk` and the zip parsing of :func:`~mfsdp_ckpt.read.records.locate_raw_tensor`).
    ``size`` is where the bytes end, so a chunk reaching past them reads as truncated."""

    def __init__(self, data: Any, base: int = 0) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self.base, self.pos, self.size = base, base, base + len(self._view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max({io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + pos, 0)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos < self.base:
            raise OSError(f"read at {self.pos}, before the bytes held, which start at {self.base}")
        lo = self.pos - self.base
        n = max(min(len(buffer), len(self._view) - lo), 0)
        with memoryview(buffer) as view:
            view.cast("B")[:n] = self._view[lo : lo + n]
        self.pos += n
        return n


class ChunkFiles:
    """The data files of one checkpoint directory (a local path or an fsspec URL), each opened
    once and kept open until :meth:`close`, and the verified reading of chunks from them.

    ``manifest_chunks``: the manifest's chunk table (None for a stock DCP checkpoint: nothing to
    check the payloads against). ``shapes``: :func:`chunk_shapes` of the metadata, so that plain
    records are read without ``torch.load``. Use as a context manager."""

    def __init__(
        self,
        directory: str,
        manifest_chunks: dict[str, Any] | None,
        shapes: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] | None = None,
    ) -> None:
        self.directory = directory
        self.manifest_chunks = manifest_chunks
        self.shapes = shapes or {}
        self._open: dict[str, IO[bytes] | OSError | OutsideCheckpointError] = {}

    def __enter__(self) -> "ChunkFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def handle(self, relative_path: str) -> IO[bytes]:
        """The open file (only a regular file inside the directory: :func:`fs.open_member`);
        raises the ``OSError`` or :class:`OutsideCheckpointError` of opening it (remembered: no
        second attempt)."""
        f = self._open.get(relative_path)
        if f is None:
            try:
                f = fs.open_member(*self._member(relative_path))
            except (OSError, OutsideCheckpointError) as e:
                f = e
            self._open[relative_path] = f
        if isinstance(f, BaseException):
            raise f
        return f

    def _unopenable(self, relative_path: str) -> str | None:
        """Why the file cannot be opened, as a fault (None: it is open)."""
        try:
            self.handle(relative_path)
        except OSError as e:
            return f"cannot open ({e.strerror or e})"
        except OutsideCheckpointError as e:
            return f"cannot open ({e.reason})"
        return None

    def open(self, relative_path: str, key: str) -> IO[bytes]:
        """The open file; a :class:`CorruptCheckpointError` (:class:`UnsafeCheckpointError` for a
        file outside the checkpoint) naming the file and ``key`` (a key it is needed for) when it
        cannot be opened."""
        problem = self._unopenable(relative_path)
        if problem is not None:
            error = (
                UnsafeCheckpointError
                if isinstance(self._open[relative_path], OutsideCheckpointError)
                else CorruptCheckpointError
            )
            raise error(f"{self.path(relative_path)}: {problem}, needed for key '{key}'")
        return self.handle(relative_path)

    def _member(self, relative_path: Any) -> tuple[str, Any]:
        """(directory, name) of a data file: the checkpoint's own, or its base's
        (:func:`~mfsdp_ckpt.format.base_ref.base_file`: a sibling directory, one path component,
        never a link)."""
        split = split_base_file(relative_path) if isinstance(relative_path, str) else None
        if split is None:
            return self.directory, relative_path
        name, file = split
        base = fs.join(fs.dirname(self.directory), name)
        problem = name_problem(name)
        if problem is None and fs.islink(base):
            problem = "the base directory is a link"
        if problem is not None:
            raise OutsideCheckpointError(base, problem)
        return base, file

    def path(self, relative_path: str) -> str:
        if not isinstance(relative_path, str):
            return f"{self.directory}/?"
        try:
            return fs.join(*self._member(relative_path))
        except OutsideCheckpointError:
            return fs.join(self.directory, relative_path)

    def require_present(self, chunks: Iterable[tuple[MetadataIndex, Any]]) -> None:
        """Raise :class:`CorruptCheckpointError` naming the first chunk whose file cannot be opened
        or does not hold its byte range: checked before a reader allocates room for the chunks."""
        for index, info in chunks:
            f = self.open(info.relative_path, index.fqn)
            truncated = missing_bytes(f, info)
            if truncated:
                raise CorruptCheckpointError(f"{chunk_location(self.path(info.relative_path), index)}: {truncated}")

    def read(self, index: MetadataIndex, info: Any, out: torch.Tensor | None = None) -> torch.Tensor | bytes:
        """The chunk's verified payload (see :func:`read_chunk`; into ``out`` when given); a
        one-line :class:`CorruptCheckpointError` naming the file and key otherwise."""
        f = self.open(info.relative_path, index.fqn)
        try:
            return read_chunk(f, info, index, self.manifest_chunks, self.shapes.get(index), out)
        except ChunkFault as e:
            raise CorruptCheckpointError(f"{chunk_location(self.path(info.relative_path), index)}: {e}") from None

    def fault(self, index: MetadataIndex, info: Any) -> str | None:
        """What is wrong with the chunk (it is read and checked, then dropped); None if nothing."""
        problem = self._unopenable(info.relative_path)
        if problem is not None:
            return problem
        try:
            read_chunk(self.handle(info.relative_path), info, index, self.manifest_chunks, self.shapes.get(index))
        except ChunkFault as e:
            return str(e)
        return None

    def release(self, relative_path: str) -> None:
        """Close one file (once its chunks are read; it is opened again if needed)."""
        f = self._open.pop(relative_path, None)
        if f is not None and not isinstance(f, BaseException):
            f.close()

    def close(self) -> None:
        for f in self._open.values():
            if not isinstance(f, BaseException):
                f.close()
        self._open = {}


def coverage_faults(key: str, md: TensorStorageMetadata) -> list[Fault]:
    """Whether the chunks of tensor ``key`` cover it exactly once, from metadata alone: every
    chunk in bounds, no two overlapping, and their volumes summing to the tensor's. Returns the
    faults (empty: covered exactly once), in chunk order.

    Chunks are compared pairwise only where their ranges along one dimension meet (a sweep along
    the dimension whose offsets differ most), so row-wise or column-wise boxes cost about n log n,
    not n²; at most :data:`MAX_OVERLAPS` overlaps are reported."""
    faults = []
    size = tuple(md.size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    for off, sz in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            faults.append(Fault(None, key, off, f"chunk of size {list(sz)} lies outside the tensor {list(size)}"))
    for i, j in _overlapping_pairs(boxes):
        faults.append(Fault(None, key, boxes[j][0], f"chunk overlaps the chunk at {list(boxes[i][0])}"))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size) and not faults:
        faults.append(Fault(None, key, None, f"chunks cover {covered} of {math.prod(size)} elements"))
    return faults


def _overlaps(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    (oa, sa), (ob, sb) = a, b
    return all(a0 < b0 + bs and b0 < a0 + as_ for a0, as_, b0, bs in zip(oa, sa, ob, sb))


MAX_OVERLAPS = 1000  # past this many overlapping pairs a tensor's chunks are reported as they are


def _overlapping_pairs(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of overlapping boxes, sorted: all of them, or the first
    :data:`MAX_OVERLAPS` found when there are more.

    A sweep along the dimension whose offsets differ most (for row boxes the first, for column
    boxes the second): only boxes whose ranges along it meet are compared."""
    if not boxes:
        return []
    ndim = min(len(off) for off, _ in boxes)
    if ndim == 0 or any(len(off) != len(sz) for off, sz in boxes):  # 0-d (or malformed): nothing to sweep along
        pairs = []
        for i in range(len(boxes)):
            pairs += [(i, j) for j in range(i + 1, len(boxes)) if _overlaps(boxes[i], boxes[j])][
                : MAX_OVERLAPS - len(pairs)
            ]
            if len(pairs) >= MAX_OVERLAPS:
                break
        return pairs
    dim = max(range(ndim), key=lambda d: len({off[d] for off, _ in boxes}))
    pairs = []
    active: list[int] = []  # earlier boxes whose range along ``dim`` reaches past the current start
    for j in sorted(range(len(boxes)), key=lambda k: boxes[k][0][dim]):
        start = boxes[j][0][dim]
        active = [i for i in active if boxes[i][0][dim] + boxes[i][1][dim] > start]
        pairs += [(min(i, j), max(i, j)) for i in active if _overlaps(boxes[i], boxes[j])]
        if len(pairs) >= MAX_OVERLAPS:
            break
        active.append(j)
    return sorted(pairs)[:MAX_OVERLAPS]

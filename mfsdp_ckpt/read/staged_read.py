"""Reading many chunks of a checkpoint at the storage's speed, for ``load``.

A rank's chunks usually sit next to each other in a few data files. Reading them one record at a
time (a seek, a small zip parse, a read per chunk) leaves the disk idle between requests, so the
chunks are planned as a few large *spans* instead: neighbouring chunks of one file, with gaps of at
most :data:`MAX_GAP` bytes read and dropped. Each span is read into one staging buffer by several
threads at once, in blocks of :data:`BLOCK_BYTES` (local files with ``os.preadv``, object stores
with ranged GETs), and each chunk is checked -- manifest placement, crc32c, record structure -- as
soon as its last block has arrived, while the other threads keep reading. Each block's crc32c is
taken by the thread that read it, while the block is still in the CPU's cache; a chunk's checksum
is then joined from those of the whole blocks it spans and of its two partial ends, instead of a
second pass over its bytes. A plain record's tensor
is then a view of the staging buffer: the bytes are copied once more only into their targets,
after every rank has verified everything (see :func:`mfsdp_ckpt.load`).

The staging memory is the bytes of the spans: what the rank needs, plus the dropped gaps.

For a local checkpoint, :func:`verify_chunks` reads in two passes instead, so that no staging
area as large as the rank's share is ever allocated (fresh memory costs page faults and zeroing
on every page: on the development VM 0.1-0.4 s per GB, more when the kernel compacts memory for
huge pages, as much as the disk read itself). The first pass reads the chunks in batches of at
most :data:`STAGE_BYTES` through one reused staging area and verifies each; a plain record is then
dropped and kept only as a :class:`VerifiedRange` of its file. The second pass,
:func:`read_verified`, after every rank has verified everything, reads those ranges again -- from
the page cache the first pass just filled -- straight into their destinations: one copy by the
kernel instead of a copy into staging and another into place. The files stay open between the
passes, and the second refuses, before it copies anything, a file whose size, inode or
modification time changed in between.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy
import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.metadata import MetadataIndex

from mfsdp_ckpt.errors import ChunkFault, CorruptCheckpointError
from mfsdp_ckpt.format.boxes import narrow
from mfsdp_ckpt.format.checksum import crc32c, crc32c_combine
from mfsdp_ckpt.read.chunks import (
    ChunkFiles,
    chunk_location,
    decode_record_at,
    tensor_view,
)
from mfsdp_ckpt.storage.positioned import pread_into

__all__ = [
    "BLOCK_BYTES",
    "MAX_GAP",
    "STAGE_BYTES",
    "THREADED_COPY_BYTES",
    "DEFAULT_READ_THREADS",
    "Span",
    "VerifiedRange",
    "plan_spans",
    "read_chunks",
    "verify_chunks",
    "read_verified",
    "read_range",
    "file_descriptor",
    "ThreadRunner",
]

BLOCK_BYTES = 8 << 20  # one read request; large enough for the disk, small enough to spread over threads
MAX_GAP = 1 << 20  # unneeded bytes read (and dropped) rather than splitting a span
STAGE_BYTES = 128 << 20  # verify_chunks' reused staging area (a larger chunk gets one of its size)
THREADED_COPY_BYTES = 64 << 20  # read_verified copies less than this in the calling thread
DEFAULT_READ_THREADS = 4


@dataclass
class Span:
    """Bytes ``[start, end)`` of one data file, holding ``chunks`` (storage index, storage info)."""

    relative_path: str
    start: int
    end: int
    chunks: list[tuple[MetadataIndex, Any]] = field(default_factory=list)


def plan_spans(chunks: Iterable[tuple[MetadataIndex, Any]], max_gap: int = MAX_GAP) -> list[Span]:
    """The chunks grouped into spans: per file, in offset order, a chunk joins the previous span
    when it starts at most ``max_gap`` bytes after that span's end."""
    by_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in chunks:
        by_file.setdefault(info.relative_path, []).append((index, info))
    spans: list[Span] = []
    for relative_path, items in by_file.items():
        items.sort(key=lambda item: item[1].offset)
        current: Span | None = None
        for index, info in items:
            end = info.offset + info.length
            if current is None or info.offset > current.end + max_gap or info.offset < current.start:
                current = Span(relative_path, info.offset, end)
                spans.append(current)
            current.end = max(current.end, end)
            current.chunks.append((index, info))
    return spans


def _range_reader(f: Any) -> Callable[[int, numpy.ndarray], int]:
    """``read(offset, out) -> bytes read`` for an open data file: ``os.preadv`` on a local file
    (no shared file position, so threads read at once; the GIL is released while the kernel
    copies), a ranged GET through the fsspec file's filesystem otherwise."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        fd = None
    if fd is not None:
        return lambda offset, out: pread_into(fd, out, offset)

    store, path = f.fs, f.path

    def read_remote(offset: int, out: numpy.ndarray) -> int:
        data = store.cat_file(path, start=offset, end=offset + len(out))
        out[: len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)
        return len(data)

    return read_remote


@dataclass(frozen=True)
class VerifiedRange:
    """A plain record's tensor bytes, verified against their crc32c and left in their file: bytes
    ``[offset, offset + nbytes)`` of ``relative_path`` hold a row-major ``dtype`` tensor of
    ``shape``. ``stamp`` is the file's (size, inode, modification time) when they were verified."""

    relative_path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stamp: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_chunks(
    files: ChunkFiles, chunks: Iterable[tuple[MetadataIndex, Any]], *, threads: int = DEFAULT_READ_THREADS
) -> dict[MetadataIndex, torch.Tensor | bytes]:
    """Every chunk's verified payload (see :func:`~mfsdp_ckpt.read.chunks.decode_record`), read as
    spans by ``threads`` threads (by the calling thread when there is at most one block to read)
    into staging memory of the spans' size. Raises one :class:`CorruptCheckpointError` (the first
    bad chunk in file order among those found) after all reads have stopped; ``files`` opens each
    file and reports a file that cannot be opened."""
    spans = plan_spans(chunks)
    readers = _readers(files, spans)
    staging = [numpy.empty(span.end - span.start, dtype=numpy.uint8) for span in spans]
    with ThreadRunner(threads) as run:
        payloads, _ = _read_spans(files, spans, readers, staging, run)
    return payloads


def verify_chunks(
    files: ChunkFiles,
    chunks: Iterable[tuple[MetadataIndex, Any]],
    *,
    threads: int = DEFAULT_READ_THREADS,
    stage_bytes: int = STAGE_BYTES,
) -> dict[MetadataIndex, torch.Tensor | bytes | VerifiedRange]:
    """Every chunk read and verified as :func:`read_chunks` does, in batches of at most
    ``stage_bytes`` through one reused staging area; a plain record of a local file comes back as
    a :class:`VerifiedRange` (for :func:`read_verified`), any other payload in memory of its own.
    Checkpoints on object stores are read by :func:`read_chunks` (a second pass would download
    everything again)."""
    chunks = sorted(chunks, key=lambda item: (item[1].relative_path, item[1].offset))
    readers = _readers(files, plan_spans(chunks))
    if any(file_descriptor(files.handle(path)) is None for path in readers):
        return read_chunks(files, chunks, threads=threads)
    batches: list[list[Span]] = []
    batch: list[tuple[MetadataIndex, Any]] = []
    size = 0
    for item in chunks:  # in file order, cut into batches of whole chunks
        if batch and size + item[1].length > stage_bytes:
            batches.append(plan_spans(batch))
            batch, size = [], 0
        batch.append(item)
        size += item[1].length
    if batch:
        batches.append(plan_spans(batch))
    # taken before the first read: a file changed at any time after this is refused by read_verified
    stamps = {path: _stamp(file_descriptor(files.handle(path))) for path in readers}
    arena = _arena(max((sum(span.end - span.start for span in batch_spans) for batch_spans in batches), default=0))
    out: dict[MetadataIndex, torch.Tensor | bytes | VerifiedRange] = {}
    with ThreadRunner(threads) as run:
        for batch_spans in batches:
            staging, at = [], 0
            for span in batch_spans:
                staging.append(arena[at : at + span.end - span.start])
                at += span.end - span.start
            payloads, locations = _read_spans(files, batch_spans, readers, staging, run)
            for span in batch_spans:
                for index, _ in span.chunks:
                    payload = payloads[index]
                    if index in locations:
                        out[index] = VerifiedRange(
                            span.relative_path,
                            locations[index],
                            payload.dtype,
                            tuple(payload.shape),
                            stamps[span.relative_path],
                        )
                    else:  # its memory is the staging area, which the next batch reuses
                        out[index] = payload.clone() if isinstance(payload, torch.Tensor) else payload
    return out


def read_verified(
    files: ChunkFiles,
    items: Sequence[tuple[VerifiedRange, Sequence[int], Sequence[int], torch.Tensor]],
    *,
    threads: int = DEFAULT_READ_THREADS,
) -> None:
    """The second pass: for each (range, offsets, lengths, target), the box ``offsets``/``lengths``
    of the range's tensor copied into ``target``, read from the range's file -- straight into
    ``target``'s memory when the box is the whole tensor and ``target`` a contiguous host tensor of
    its dtype (through new memory and ``copy_`` otherwise, e.g. into GPU memory). Raises :class:`CorruptCheckpointError` before copying anything when a file changed since
    its ranges were verified; a read error after that (the disk failing in between) is raised
    too, but leaves the targets copied so far changed."""
    verified_stamps = {verified.relative_path: verified.stamp for verified, *_ in items}
    for relative_path, verified_stamp in sorted(verified_stamps.items()):
        if _stamp(file_descriptor(files.handle(relative_path))) != verified_stamp:
            raise CorruptCheckpointError(
                f"{files.path(relative_path)}: changed while it was being loaded "
                f"(size, inode or modification time differ from when it was verified); nothing was loaded"
            )
    by_range: dict[VerifiedRange, list[tuple[Sequence[int], Sequence[int], torch.Tensor]]] = {}
    for verified, offsets, lengths, target in items:
        by_range.setdefault(verified, []).append((offsets, lengths, target))

    def copy(verified: VerifiedRange) -> None:
        pieces = by_range[verified]
        if len(pieces) == 1 and _is_whole(verified, *pieces[0]):
            target = pieces[0][2]
            _read_into(files, verified, target.reshape(-1).view(torch.uint8).numpy())
            # a write through numpy is invisible to torch's version counter, which caches keyed
            # on it (the MXFP8 planes of a weight) rely on to see that the tensor changed
            increment_version(target)
            return
        source = read_range(files, verified)
        for offsets, lengths, target in pieces:
            target.copy_(narrow(source, offsets, lengths))

    ranges = list(by_range)
    # a copy from the page cache runs at several GB/s: below THREADED_COPY_BYTES, handing hundreds of
    # small ranges to threads (and their contention for the GIL) costs more than the copy itself
    with ThreadRunner(threads if sum(r.nbytes for r in ranges) >= THREADED_COPY_BYTES else 1) as run:
        run(lambda n: copy(ranges[n]), len(ranges))


def read_range(files: ChunkFiles, verified: VerifiedRange) -> torch.Tensor:
    """The verified tensor, read again from its file into new memory."""
    if verified.nbytes == 0:
        return torch.empty(verified.shape, dtype=verified.dtype)
    data = numpy.empty(verified.nbytes, dtype=numpy.uint8)
    _read_into(files, verified, data)
    return tensor_view(data, verified.dtype, verified.shape)


def _is_whole(verified: VerifiedRange, offsets: Sequence[int], lengths: Sequence[int], target: torch.Tensor) -> bool:
    """The read can land straight in ``target``: the whole tensor, into host memory of its dtype."""
    return (
        all(o == 0 for o in offsets)
        and tuple(lengths) == verified.shape
        and target.dtype == verified.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.numel() == math.prod(verified.shape)
        and target.numel() > 0
    )


def _read_into(files: ChunkFiles, verified: VerifiedRange, out: numpy.ndarray) -> None:
    fd = file_descriptor(files.handle(verified.relative_path))
    try:
        done = pread_into(fd, out, verified.offset)
    except OSError as e:
        raise CorruptCheckpointError(
            f"{files.path(verified.relative_path)}: cannot read bytes "
            f"{verified.offset}..{verified.offset + len(out)} again ({e.strerror or e})"
        ) from None
    if done < len(out):
        raise CorruptCheckpointError(
            f"{files.path(verified.relative_path)}: bytes {verified.offset}.."
            f"{verified.offset + len(out)} are gone (the file shrank while it was being loaded)"
        )


def file_descriptor(f: Any) -> int | None:
    """The OS file descriptor of an open data file; None for an object store's file."""
    try:
        return f.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return None


def _stamp(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return (st.st_size, st.st_ino, st.st_mtime_ns)


def _arena(size: int) -> numpy.ndarray:
    """Staging memory for verify_chunks, its pages populated in one call (page by page faults,
    or huge pages the kernel may first compact memory for, cost more)."""
    if size == 0:
        return numpy.empty(0, dtype=numpy.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return numpy.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=numpy.uint8)


def _readers(files: ChunkFiles, spans: list[Span]) -> dict[str, Callable[[int, numpy.ndarray], int]]:
    readers = {}
    for span in spans:
        if span.relative_path not in readers:
            readers[span.relative_path] = _range_reader(files.open(span.relative_path, span.chunks[0][0].fqn))
    return readers


class ThreadRunner:
    """``run(fn, n)``: ``fn(0) … fn(n - 1)``, on a pool of ``threads`` threads started on first
    use (by the calling thread when ``threads`` <= 1 or ``n`` is 1)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> "ThreadRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def __call__(self, fn: Callable[[int], None], n: int) -> None:
        if self.threads <= 1 or n <= 1:
            for i in range(n):
                fn(i)
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="mfsdp-ckpt-read")
        for future in [self.pool.submit(fn, i) for i in range(n)]:
            future.result()


def _read_spans(
    files: ChunkFiles,
    spans: list[Span],
    readers: dict[str, Callable[[int, numpy.ndarray], int]],
    staging: list[numpy.ndarray],
    run: ThreadRunner,
) -> tuple[dict[MetadataIndex, torch.Tensor | bytes], dict[MetadataIndex, int]]:
    """Read ``spans`` into ``staging`` (one buffer per span) and verify every chunk as its last
    block arrives: the payloads, and the absolute file offset of each plain record's tensor
    bytes; raises the first fault in file order."""
    plan = _plan_blocks(spans)
    reads = _SpanReads(files, spans, readers, staging, plan)
    if sum(end - start for _, start, end in plan.blocks) <= BLOCK_BYTES:
        for b in range(len(plan.blocks)):  # one block's worth: starting threads would cost more than they save
            reads.read_block(b)
    else:
        run(reads.read_block, len(plan.blocks))
    for s, c in plan.unblocked:
        reads.check(s, c)
    if reads.faults:
        raise min(reads.faults, key=lambda fault: fault[0])[1]
    return reads.payloads, reads.locations


@dataclass
class _BlockPlan:
    """The blocks to read for a list of spans, and which chunk waits for which: ``blocks`` (span
    number, start, end within the span's buffer); ``waiting`` (span number, chunk number) -> blocks
    still to arrive; ``overlapping`` per block, the chunk numbers of its span it overlaps;
    ``unblocked`` the chunks no block covers (zero-length records), checked after the reads."""

    blocks: list[tuple[int, int, int]] = field(default_factory=list)
    first_block: list[int] = field(default_factory=list)  # per span, the number of its first block
    waiting: dict[tuple[int, int], int] = field(default_factory=dict)
    overlapping: list[list[int]] = field(default_factory=list)
    unblocked: list[tuple[int, int]] = field(default_factory=list)


def _plan_blocks(spans: list[Span]) -> _BlockPlan:
    """Cut every span into blocks of :data:`BLOCK_BYTES` and count, per chunk, the blocks it
    overlaps, so that each chunk is checked as soon as its last block has arrived."""
    plan = _BlockPlan()
    blocks, waiting, overlapping = plan.blocks, plan.waiting, plan.overlapping
    for s, span in enumerate(spans):
        size = span.end - span.start
        first_block = len(blocks)
        plan.first_block.append(first_block)
        for start in range(0, size, BLOCK_BYTES):
            blocks.append((s, start, min(start + BLOCK_BYTES, size)))
            overlapping.append([])
        for c, (_, info) in enumerate(span.chunks):
            lo, hi = info.offset - span.start, info.offset - span.start + info.length
            covering = range(first_block + lo // BLOCK_BYTES, first_block + max(hi - 1, lo) // BLOCK_BYTES + 1)
            waiting[(s, c)] = len(covering)
            for b in covering:
                overlapping[b].append(c)
            if not covering:  # an empty span (a zero-length record): nothing to wait for
                plan.unblocked.append((s, c))
    return plan


class _SpanReads:
    """The state one :func:`_read_spans` call shares between its reading threads: ``read_block``
    reads one block and checks the chunks it completes; results and faults are collected under
    one lock, and the first fault stops the blocks not yet started."""

    __slots__ = (
        "files",
        "spans",
        "readers",
        "staging",
        "blocks",
        "waiting",
        "overlapping",
        "first_block",
        "block_crcs",
        "payloads",
        "locations",
        "faults",
        "short",
        "lock",
        "failed",
    )

    def __init__(
        self,
        files: ChunkFiles,
        spans: list[Span],
        readers: dict[str, Callable[[int, numpy.ndarray], int]],
        staging: list[numpy.ndarray],
        plan: _BlockPlan,
    ) -> None:
        self.files, self.spans, self.readers, self.staging = files, spans, readers, staging
        self.blocks, self.waiting, self.overlapping = plan.blocks, plan.waiting, plan.overlapping
        self.first_block = plan.first_block
        self.block_crcs: list[int | None] = [None] * len(plan.blocks)  # of each block read whole
        self.payloads: dict[MetadataIndex, torch.Tensor | bytes] = {}
        self.locations: dict[MetadataIndex, int] = {}
        self.faults: list[tuple[tuple[str, int], CorruptCheckpointError]] = []
        self.short: dict[int, int] = {}  # span number -> first offset (within the span) that could not be read
        self.lock = threading.Lock()
        self.failed = threading.Event()

    def _fault(self, where: tuple[str, int], error: CorruptCheckpointError) -> None:
        """Record a fault at ``where`` (file, offset: the order faults are raised in) and stop reading."""
        with self.lock:
            self.faults.append((where, error))
        self.failed.set()

    def check(self, s: int, c: int) -> None:
        """Verify chunk ``c`` of span ``s`` from the bytes that arrived; keep its payload or its fault."""
        span = self.spans[s]
        index, info = span.chunks[c]
        lo = info.offset - span.start
        available = min(info.length, self.short.get(s, info.length + lo) - lo)
        files = self.files
        try:
            payload, raw_offset = decode_record_at(
                self.staging[s][lo : lo + max(available, 0)],
                info,
                index,
                files.manifest_chunks,
                files.shapes.get(index),
                lambda a, b: self._span_crc(s, lo + a, lo + b),
            )
        except ChunkFault as e:
            error = CorruptCheckpointError(f"{chunk_location(files.path(info.relative_path), index)}: {e}")
            self._fault((info.relative_path, info.offset), error)
            return
        with self.lock:
            self.payloads[index] = payload
            if raw_offset is not None:
                self.locations[index] = info.offset + raw_offset

    def _span_crc(self, s: int, lo: int, hi: int) -> int:
        """crc32c of bytes ``[lo, hi)`` of span ``s``'s buffer: the checksums of the whole blocks
        inside the range, taken as they arrived, joined with those of the two partial ends."""
        buf, first = self.staging[s], self.first_block[s]
        k0, k1 = -(-lo // BLOCK_BYTES), hi // BLOCK_BYTES  # the whole blocks: [k0, k1)
        if k0 >= k1:
            return crc32c(buf[lo:hi])
        crc = crc32c(buf[lo : k0 * BLOCK_BYTES])
        for k in range(k0, k1):
            block = self.block_crcs[first + k]
            if block is None:
                block = crc32c(buf[k * BLOCK_BYTES : (k + 1) * BLOCK_BYTES])
            crc = crc32c_combine(crc, block, BLOCK_BYTES)
        return crc32c_combine(crc, crc32c(buf[k1 * BLOCK_BYTES : hi]), hi - k1 * BLOCK_BYTES)

    def read_block(self, b: int) -> None:
        """Read block ``b`` (unless a fault stopped the reads), then check the chunks whose last block it was."""
        if self.failed.is_set():
            return
        s, start, end = self.blocks[b]
        span = self.spans[s]
        try:
            got = self.readers[span.relative_path](span.start + start, self.staging[s][start:end])
        except OSError as e:
            index = next((span.chunks[c][0] for c in self.overlapping[b]), span.chunks[0][0])
            error = CorruptCheckpointError(
                f"{chunk_location(self.files.path(span.relative_path), index)}: cannot read ({e.strerror or e})"
            )
            self._fault((span.relative_path, span.start + start), error)
            return
        if got == end - start:  # checksummed now, while the block is still in the CPU's cache
            self.block_crcs[b] = crc32c(self.staging[s][start:end])
        ready = []
        with self.lock:
            if got < end - start:
                self.short[s] = min(self.short.get(s, end), start + got)
            waiting = self.waiting
            for c in self.overlapping[b]:
                waiting[(s, c)] -= 1
                if waiting[(s, c)] == 0:
                    ready.append(c)
        for c in ready:
            self.check(s, c)

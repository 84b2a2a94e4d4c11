"""Reading many chunks of a checkpoint at the storage's speed, for ``load``.

A rank's chunks usually sit next to each other in a few data files. Reading them one record at a
time (a seek, a small zip parse, a read per chunk) leaves the disk idle between requests, so the
chunks are planned as a few large *spans* instead: neighbouring chunks of one file, with gaps of at
most :data:`MAX_GAP` bytes read and dropped. Each span is read into one staging buffer by several
threads at once, in blocks of :data:`BLOCK_BYTES` (local files with ``os.preadv``, object stores
with ranged GETs), and each chunk is checked -- manifest placement, crc32c, record structure -- as
soon as its last block has arrived, while the other threads keep reading. A plain record's tensor
is then a view of the staging buffer: the bytes are copied once more only into their targets,
after every rank has verified everything (see :func:`mfsdp_ckpt.load`).

The staging memory is the bytes of the spans: what the rank needs, plus the dropped gaps.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .chunks import ChunkFault, ChunkFiles, chunk_location, decode_record
from .errors import CorruptCheckpointError

__all__ = ["BLOCK_BYTES", "MAX_GAP", "DEFAULT_READ_THREADS", "Span", "plan_spans", "read_chunks"]

BLOCK_BYTES = 16 << 20  # one read request; large enough for the disk, small enough to spread over threads
MAX_GAP = 1 << 20  # unneeded bytes read (and dropped) rather than splitting a span
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
        def read_local(offset: int, out: numpy.ndarray) -> int:
            done = 0
            with memoryview(out) as view:
                while done < len(out):
                    n = os.preadv(fd, [view[done:]], offset + done)
                    if n == 0:
                        break
                    done += n
            return done
        return read_local

    store, path = f.fs, f.path

    def read_remote(offset: int, out: numpy.ndarray) -> int:
        data = store.cat_file(path, start=offset, end=offset + len(out))
        out[: len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)
        return len(data)
    return read_remote


def read_chunks(files: ChunkFiles, chunks: Iterable[tuple[MetadataIndex, Any]], *,
                threads: int = DEFAULT_READ_THREADS) -> dict[MetadataIndex, torch.Tensor | bytes]:
    """Every chunk's verified payload (see :func:`~mfsdp_ckpt.chunks.decode_record`), read as
    spans by ``threads`` threads (by the calling thread when there is at most one block to read). Raises one :class:`CorruptCheckpointError` (the first bad chunk
    in file order among those found) after all reads have stopped; ``files`` opens each file and
    reports a file that cannot be opened."""
    spans = plan_spans(chunks)
    readers = {}
    for span in spans:
        if span.relative_path not in readers:
            readers[span.relative_path] = _range_reader(files.open(span.relative_path, span.chunks[0][0].fqn))
    staging = [numpy.empty(span.end - span.start, dtype=numpy.uint8) for span in spans]

    # blocks to read; each chunk waits for the blocks it overlaps
    blocks: list[tuple[int, int, int]] = []  # (span number, start, end) within the span's buffer
    waiting: dict[tuple[int, int], int] = {}  # (span number, chunk number) -> blocks still to arrive
    overlapping: list[list[int]] = []  # per block: the chunk numbers of its span it overlaps
    unblocked: list[tuple[int, int]] = []
    for s, span in enumerate(spans):
        size = span.end - span.start
        first_block = len(blocks)
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
                unblocked.append((s, c))

    payloads: dict[MetadataIndex, torch.Tensor | bytes] = {}
    faults: list[tuple[tuple[str, int], CorruptCheckpointError]] = []
    short: dict[int, int] = {}  # span number -> first offset (within the span) that could not be read
    lock = threading.Lock()
    failed = threading.Event()

    def check(s: int, c: int) -> None:
        span = spans[s]
        index, info = span.chunks[c]
        lo = info.offset - span.start
        available = min(info.length, short.get(s, info.length + lo) - lo)
        try:
            payload = decode_record(staging[s][lo : lo + max(available, 0)], info, index, files.manifest_chunks,
                                    files.shapes.get(index))
        except ChunkFault as e:
            error = CorruptCheckpointError(f"{chunk_location(files.path(info.relative_path), index)}: {e}")
            with lock:
                faults.append(((info.relative_path, info.offset), error))
            failed.set()
            return
        with lock:
            payloads[index] = payload

    def read_block(b: int) -> None:
        if failed.is_set():
            return
        s, start, end = blocks[b]
        span = spans[s]
        try:
            got = readers[span.relative_path](span.start + start, staging[s][start:end])
        except OSError as e:
            index = next((span.chunks[c][0] for c in overlapping[b]), span.chunks[0][0])
            error = CorruptCheckpointError(f"{chunk_location(files.path(span.relative_path), index)}: cannot read "
                                           f"({e.strerror or e})")
            with lock:
                faults.append(((span.relative_path, span.start + start), error))
            failed.set()
            return
        ready = []
        with lock:
            if got < end - start:
                short[s] = min(short.get(s, end), start + got)
            for c in overlapping[b]:
                waiting[(s, c)] -= 1
                if waiting[(s, c)] == 0:
                    ready.append(c)
        for c in ready:
            check(s, c)

    if threads <= 1 or sum(end - start for _, start, end in blocks) <= BLOCK_BYTES:
        # at most one block's worth: starting threads would cost more than they save
        for b in range(len(blocks)):
            read_block(b)
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(blocks)), thread_name_prefix="mfsdp-ckpt-read") as pool:
            for future in [pool.submit(read_block, b) for b in range(len(blocks))]:
                future.result()
    for s, c in unblocked:
        check(s, c)
    if faults:
        raise min(faults, key=lambda fault: fault[0])[1]
    return payloads

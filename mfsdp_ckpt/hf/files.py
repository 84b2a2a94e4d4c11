"""The files of a Hugging Face model directory: safetensors shards written one tensor at a time,
``model.safetensors.index.json``, and reading a directory's tensors one at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, ``[begin, end)`` byte offsets into the data section), then the raw row-major bytes. Because
an export knows every shape and dtype before it reads a byte, :class:`SafetensorsWriter` writes
the header first and then each tensor as it is converted, so a shard never needs to be in memory
as a whole.

Reading goes the other way and trusts nothing: a directory to import may come from anywhere.
:class:`HFDirectory` reads ``config.json`` and the index only as regular files of bounded size,
keeps the index's file names inside the directory, checks every shard's header itself
(:func:`parse_safetensors_header`: lengths, types, dtypes, offsets against the file) before
believing any of it, and then reads each tensor's bytes at the offsets it checked, from the file
it checked. Every refusal is one :class:`~mfsdp_ckpt.errors.ConversionError` line naming the
file and the field or tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from mfsdp_ckpt.errors import ConversionError, one_line
from mfsdp_ckpt.hf.strided_io import pread_tensor, pwrite_tensor
from mfsdp_ckpt.storage.positioned import pread_into
from mfsdp_ckpt.storage.write_errors import reporting
from mfsdp_ckpt.storage.writeback import SLICE_BYTES, start_writeback
from mfsdp_core.dtypes import dtype_from_safetensors, safetensors_name

__all__ = [
    "hf_safetensors_name",
    "hf_dtype_from_safetensors",
    "parse_size",
    "shard_name",
    "INDEX_NAME",
    "SafetensorsWriter",
    "safetensors_layout",
    "HFTensor",
    "HFDirectory",
    "read_json_file",
    "read_regular_file",
    "check_shard_name",
    "parse_safetensors_header",
    "short_repr",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
]

INDEX_NAME = "model.safetensors.index.json"

#: dtypes the bridge reads and writes beyond ``mfsdp_core.dtypes``' table, which lists only what
#: ``safetensors.torch.load`` round-trips: F8_E8M0 (MX scales) is written by safetensors and read
#: by ``safe_open`` (what transformers uses), and our own writer and header parser handle it.
_EXTRA_SAFETENSORS = {"F8_E8M0": getattr(torch, "float8_e8m0fnu", None)}
_EXTRA_SAFETENSORS = {k: v for k, v in _EXTRA_SAFETENSORS.items() if isinstance(v, torch.dtype)}


def hf_safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors header name of ``dtype`` in an HF directory (``mfsdp_core.dtypes``' name,
    or F8_E8M0 for ``torch.float8_e8m0fnu``); None if there is none."""
    name = safetensors_name(dtype)
    if name is None:
        name = next((k for k, v in _EXTRA_SAFETENSORS.items() if v == dtype), None)
    return name


def hf_dtype_from_safetensors(name: str) -> torch.dtype | None:
    """Inverse of :func:`hf_safetensors_name`; None for a name the bridge does not read."""
    return dtype_from_safetensors(name) or _EXTRA_SAFETENSORS.get(name)


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``"5GB"`` (10⁹), ``"500MiB"`` (2²⁰), or a plain number, as transformers reads
    ``max_shard_size``."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not m:
        raise ConversionError(f"max shard size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    size = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if size <= 0:
        raise ConversionError(f"max shard size {text!r} must be positive")
    return size


def shard_name(k: int, n: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (k is 1-based), transformers' naming."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def safetensors_layout(
    path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int], int]:
    """The file a safetensors writer makes of ``entries`` (name, dtype, shape, in file order):
    its first bytes (the 8-byte header length and the JSON header, padded so that the data
    section starts 8-byte aligned), each tensor's absolute offset, and the file's total size.
    Writers that fill the tensors in any order, from several threads, put them there."""
    header: dict[str, Any] = {}
    offsets: list[int] = []
    offset = 0
    for name, dtype, shape in entries:
        st_name = hf_safetensors_name(dtype)
        if st_name is None:
            raise ConversionError(f"{path}: tensor '{name}': dtype {dtype} has no safetensors name")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(text)) + text
    return head, [len(head) + o for o in offsets], len(head) + offset


def _row_slices(tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``tensor`` as consecutive blocks of whole rows of about :data:`SLICE_BYTES` each, with
    each block's byte offset in the tensor's row-major bytes (the tensor itself when it is
    smaller, or not a matrix): written one after the other, each block's write-back can start
    while the next is being written."""
    if tensor.dim() == 0 or tensor.shape[0] <= 1 or tensor.numel() * tensor.element_size() <= SLICE_BYTES:
        return [(0, tensor)]
    row = tensor[0].numel() * tensor.element_size()
    step = max(1, SLICE_BYTES // row)
    return [(r * row, tensor[r : r + step]) for r in range(0, tensor.shape[0], step)]


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (name, dtype, shape, in file order) are known in
    advance: the header at once, then each tensor at its own offset as :meth:`write` receives it,
    in any order and from any number of threads (positional writes of the tensor's contiguous
    runs, so a piece of a fused tensor is written without a copy). The bytes do not depend on the
    order of the writes. :meth:`close` checks that every tensor was written exactly once, then
    fsyncs the file."""

    def __init__(
        self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ) -> None:
        self.path = path
        head, offsets, self.size = safetensors_layout(path, entries, metadata)
        self._where = {
            name: (dtype, torch.Size(shape), offset) for (name, dtype, shape), offset in zip(entries, offsets)
        }
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self._fd = -1
        with reporting(path):  # a full disk: one line naming the file
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _BINARY, 0o644)
            try:
                pwrite_tensor(self._fd, torch.frombuffer(bytearray(head), dtype=torch.uint8), 0)
            except BaseException:
                self.abort()
                raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the HF tensor ``name``: ``tensor`` holds its elements in row-major order (the
        tensor itself, or a view of a fused tensor with the same elements and, for a matrix, the
        same rows)."""
        spec = self._where.get(name)
        if spec is None:
            raise ConversionError(f"{self.path}: tensor '{name}' written but not planned for this file")
        dtype, shape, offset = spec
        rows_fit = len(shape) < 2 or (
            tensor.dim() >= 2 and tensor.shape[-1] == shape[-1]
        )  # a view keeps the row length
        if tensor.dtype != dtype or tensor.numel() != shape.numel() or not rows_fit:
            raise ConversionError(
                f"{self.path}: got '{name}' {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {tuple(shape)}"
            )
        with self._lock:
            if name in self._written:
                raise ConversionError(f"{self.path}: tensor '{name}' written twice")
            self._written.add(name)
        tensor = tensor.detach().cpu()
        for start, piece in _row_slices(tensor):
            with reporting(self.path):
                nbytes = pwrite_tensor(self._fd, piece, offset + start)
            start_writeback(self._fd, offset + start, nbytes)  # the disk starts now; close()'s fsync waits for less

    def close(self) -> None:
        """Check that every planned tensor was written, fsync and close (durable before the
        directory holding the file is renamed into place)."""
        missing = [name for name in self._where if name not in self._written]
        if missing:
            self.abort()
            raise ConversionError(f"{self.path}: tensors planned but never written: {', '.join(missing)}")
        with reporting(self.path):
            try:
                os.fsync(self._fd)
            finally:
                self.abort()

    def abort(self) -> None:
        """Close without caring whether the bytes reach the disk (the file is discarded)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor is: its file, dtype and shape (from the safetensors header)."""

    file: str
    dtype: torch.dtype
    shape: torch.Size


# --------------------------------------------------------------------------------------------------
# Reading a directory someone else wrote: nothing in it is trusted until checked.

#: the largest safetensors header we parse (the ``safetensors`` library's own limit)
MAX_HEADER_BYTES = 100_000_000
#: the largest ``config.json`` / index we parse (real ones are kilobytes to a few megabytes)
MAX_JSON_BYTES = 100_000_000
#: more dimensions than any weight has; bounds the work a hostile shape can ask for
MAX_NDIM = 64

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hostile value is named, not echoed whole
    (and, being a repr, never spans lines)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _open_regular(path: str, what: str) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading and return the descriptor and its ``fstat``; refuse anything
    but a regular file. ``O_NONBLOCK``: opening a FIFO for reading would otherwise wait for a
    writer forever; opened non-blocking, it is seen (and refused) at once. The check is on the
    descriptor, so what is read is what was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC | _BINARY)
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing ({what})") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot open {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise ConversionError(f"{path}: cannot stat {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConversionError(f"{path}: not a regular file ({what} must be one)")
    return fd, st


def _read_exact(fd: int, offset: int, n: int, path: str, what: str) -> bytearray:
    """``n`` bytes at ``offset`` of ``fd``; a short read (the file shrank) is an error."""
    buf = bytearray(n)
    try:
        got = pread_into(fd, buf, offset)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if got < n:
        raise ConversionError(f"{path}: {what} ends early (file truncated while reading?)")
    return buf


def read_json_file(path: str, what: str) -> Any:
    """The JSON value in the regular file ``path`` (at most :data:`MAX_JSON_BYTES`), or one
    :class:`ConversionError` line: missing, not a regular file, too large, not UTF-8 JSON (also
    nesting deeper than the parser recurses)."""
    fd, st = _open_regular(path, what)
    try:
        if st.st_size > MAX_JSON_BYTES:
            raise ConversionError(f"{path}: {st.st_size} bytes, more than the {MAX_JSON_BYTES} a {what} may have")
        blob = _read_exact(fd, 0, st.st_size, path, what)
    finally:
        os.close(fd)
    try:
        return json.loads(blob.decode("utf-8-sig"), parse_int=json_int)
    except (ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: not valid JSON ({one_line(e, 120, mark='...')})") from None


def read_regular_file(path: str, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit`` of them), or one
    :class:`ConversionError` line naming it: missing, not a regular file, too large."""
    fd, st = _open_regular(path, what)
    try:
        if st.st_size > limit:
            raise ConversionError(f"{path}: {st.st_size} bytes, more than the {limit} a {what} may have")
        return bytes(_read_exact(fd, 0, st.st_size, path, what))
    finally:
        os.close(fd)


def check_shard_name(name: Any, index_path: str, key: str) -> str:
    """``name``, if it is a plain file name (what an index may name: a file in the directory
    itself); one error line naming the index and the tensor otherwise. No separators, no ``.`` /
    ``..``, no absolute path, no control characters: the index cannot lead the reader out of the
    directory, into a subdirectory, or into a message that spans lines."""
    if not isinstance(name, str):
        raise ConversionError(
            f"{index_path}: 'weight_map' entry {key!r}: the file name must be a string, got {short_repr(name)}"
        )
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (
        name in ("", ".", "..")
        or any(sep in name for sep in seps)
        or os.path.isabs(name)
        or not name.isprintable()
        or os.path.basename(name) != name
    ):
        raise ConversionError(
            f"{index_path}: 'weight_map' entry {key!r} names {name!r}: a shard must be a plain file name "
            "inside the model directory"
        )
    return name


@dataclass(frozen=True)
class _Layout:
    """Where a tensor's bytes are in its file: absolute offset and length."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class _FileId:
    """What identifies the file whose header was checked, so that a later read of another file
    (replaced in between) is refused rather than trusted."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_FileId":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


#: the most digits a JSON integer may have: far beyond any real field, and a bound on the
#: (quadratic) cost of converting one, whatever the interpreter's own digit limit is set to
MAX_INT_DIGITS = 1000


def json_int(text: str) -> int:
    """``int(text)`` for the JSON parsers, refusing integers of more than
    :data:`MAX_INT_DIGITS` digits."""
    if len(text) > MAX_INT_DIGITS + 1:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


#: a checked header entry before it is placed in the file: dtype, shape, ``[begin, end)`` in the data section
_Entry = tuple[torch.dtype, torch.Size, int, int]


def _header_length(path: str, fd: int, size: int) -> int:
    """The header length in the first 8 bytes of a safetensors file of ``size`` bytes, checked:
    at most :data:`MAX_HEADER_BYTES`, inside the file, and room for at least ``{}``."""
    if size < 8:
        raise ConversionError(f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header length first)")
    (n,) = struct.unpack("<Q", bytes(_read_exact(fd, 0, 8, path, "safetensors header length")))
    if n > MAX_HEADER_BYTES:
        raise ConversionError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > size - 8:
        raise ConversionError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
    if n < 2:
        raise ConversionError(f"{path}: header length {n} is too small for a JSON object")
    return n


def _header_int(text: str) -> int:
    """An integer of a header, refused beyond what a double holds: the ``safetensors`` library
    (serde) refuses such a header as "number out of range", so we do too (a file two readers
    read differently is refused)."""
    value = json_int(text)
    if abs(value) > sys.float_info.max:
        raise ValueError("number out of range")
    return value


def _header_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def _header_json(path: str, raw: bytearray) -> dict[str, Any]:
    """The header bytes as a JSON object: UTF-8, starting with ``{``, no NaN / Infinity, no
    integer of absurd length, and no name given twice (JSON lets the last one win silently; a
    hostile file could then mean one tensor to us and another to a different reader)."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                repeated.append(k)
            out[k] = v
        return out

    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header does not start with '{'")
        header = json.loads(
            text,
            object_pairs_hook=pairs,
            parse_constant=_no_constants,
            parse_int=_header_int,
            parse_float=_header_float,
        )
    except (ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: header is not valid UTF-8 JSON ({one_line(e, 120, mark='...')})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: header is not a JSON object")
    if repeated:
        raise ConversionError(f"{path}: header names {short_repr(repeated[0])} twice")
    return header


def _pop_metadata(path: str, header: dict[str, Any]) -> dict[str, str]:
    """Take ``__metadata__`` out of ``header`` (what is left are the tensors); it must map
    strings to strings."""
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConversionError(f"{path}: '__metadata__' must map strings to strings, got {short_repr(metadata)}")
    return metadata


def _entry_dtype(where: str, st_dtype: Any) -> torch.dtype:
    """The dtype a tensor entry names: a string of our table (or F8_E8M0)."""
    if not isinstance(st_dtype, str):
        raise ConversionError(f"{where}: dtype must be a string, got {short_repr(st_dtype)}")
    dtype = hf_dtype_from_safetensors(st_dtype)
    if dtype is None:
        raise ConversionError(f"{where}: unsupported dtype {short_repr(st_dtype)}")
    return dtype


def _check_entry_shape(where: str, shape: Any) -> None:
    """A tensor entry's shape: a list of at most :data:`MAX_NDIM` non-negative integers (``bool``
    is not one)."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise ConversionError(
            f"{where}: shape must be a list of at most {MAX_NDIM} non-negative integers, got {short_repr(shape)}"
        )


def _check_entry_offsets(where: str, offsets: Any) -> None:
    """A tensor entry's ``data_offsets``: ``[begin, end]``, integers, ``0 <= begin <= end``."""
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ConversionError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {short_repr(offsets)}"
        )


def _bounded_nbytes(shape: list[int], itemsize: int, limit: int) -> int:
    """The bytes of a tensor of ``shape``, or, once the product passes ``limit``, some number
    above it: a hostile shape may multiply to a huge number, and is not multiplied out."""
    numel = 0 if 0 in shape else 1
    for d in shape:
        numel *= d
        if numel * itemsize > limit:
            break
    return numel * itemsize


def _check_entry_span(
    where: str, shape: list[int], st_dtype: str, dtype: torch.dtype, offsets: list[int], data_size: int
) -> None:
    """A tensor entry's offsets span exactly its shape's bytes, inside the data section."""
    begin, end = offsets
    nbytes = _bounded_nbytes(shape, dtype.itemsize, data_size)
    if nbytes != end - begin:
        size_text = f"{nbytes} bytes" if nbytes <= data_size else f"more than the {data_size} bytes of the data section"
        raise ConversionError(
            f"{where}: shape {short_repr(shape)} of {st_dtype} is {size_text}, "
            f"but data_offsets {short_repr(offsets)} span {end - begin} bytes"
        )
    if end > data_size:
        raise ConversionError(
            f"{where}: data_offsets {short_repr(offsets)} run past the data section ({data_size} bytes)"
        )


def _header_entry(path: str, name: str, entry: Any, data_size: int) -> _Entry:
    """One tensor of the header, checked (see :func:`parse_safetensors_header`): a printable
    name, an object with dtype, shape and data_offsets, each valid, spanning its bytes."""
    where = f"{path}: tensor {name!r}"
    if not name.isprintable():
        raise ConversionError(f"{path}: tensor name {short_repr(name)} has control characters")
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ConversionError(
            f"{where}: expected an object with dtype, shape and data_offsets, got {short_repr(entry)}"
        )
    st_dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    dtype = _entry_dtype(where, st_dtype)
    _check_entry_shape(where, shape)
    _check_entry_offsets(where, offsets)
    _check_entry_span(where, shape, st_dtype, dtype, offsets, data_size)
    begin, end = offsets
    return dtype, torch.Size(shape), begin, end


def _check_tiling(path: str, entries: dict[str, _Entry], data_size: int) -> None:
    """The tensors tile the data section, in offset order: no overlap, no gap, nothing after the
    last (so that every byte of the file is accounted for, as the ``safetensors`` library requires)."""
    covered, last = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin < covered:
            raise ConversionError(f"{path}: tensor {name!r} (bytes {begin}..{end}) overlaps tensor {last!r}")
        if begin > covered:
            raise ConversionError(
                f"{path}: {begin - covered} bytes of the data section before tensor {name!r} belong to no tensor"
            )
        covered, last = end, name
    if covered != data_size:
        raise ConversionError(f"{path}: {data_size - covered} bytes at the end of the data section belong to no tensor")


def parse_safetensors_header(
    path: str, fd: int, size: int
) -> tuple[dict[str, tuple[torch.dtype, torch.Size, _Layout]], dict[str, str]]:
    """Parse and check the header of the safetensors file open as ``fd`` (``size`` bytes):
    every tensor (dtype, shape, absolute data offset and length) and ``__metadata__``.

    Checked, each failure one :class:`ConversionError` line naming the file and the tensor: the
    8-byte length (at most :data:`MAX_HEADER_BYTES` and inside the file); the header is a UTF-8
    JSON object without repeated names or NaN; ``__metadata__`` maps strings to strings; every
    name is printable; every entry has a dtype of our table (:mod:`mfsdp_core.dtypes`, or F8_E8M0), a shape
    of non-negative integers, and ``data_offsets`` ``[begin, end]`` whose span is exactly the
    shape's bytes; and the tensors tile the data section: no overlap, no gap, nothing after the
    last (what the ``safetensors`` library requires too, so a file we accept it reads the same)."""
    n = _header_length(path, fd, size)
    header = _header_json(path, _read_exact(fd, 8, n, path, "safetensors header"))
    data_start, data_size = 8 + n, size - 8 - n
    metadata = _pop_metadata(path, header)
    entries = {name: _header_entry(path, name, entry, data_size) for name, entry in header.items()}
    _check_tiling(path, entries, data_size)
    tensors = {
        name: (dtype, shape, _Layout(data_start + begin, end - begin))
        for name, (dtype, shape, begin, end) in entries.items()
    }
    return tensors, metadata


class HFDirectory:
    """The config and tensors of an HF model directory, one tensor at a time.

    Nothing in the directory is trusted before it is checked: ``config.json`` and the index are
    read only if they are regular files (a FIFO never blocks the reader) of bounded size and are
    JSON objects; the index's ``weight_map`` must map tensor names to plain file names in the
    directory itself (:func:`check_shard_name`); every shard is a regular file whose header is
    checked by :func:`parse_safetensors_header` before anything is read from it; a tensor is read
    later only from the same file (device, inode, size, mtime). Every refusal is one
    :class:`ConversionError` line naming the file and the field or tensor.

    Files: those named by ``model.safetensors.index.json`` when present, else every
    ``*.safetensors``. A tensor stored twice, or an index entry naming a file that lacks it, is an
    error (naming the key). Symbolic links in the directory are followed (the Hugging Face cache
    is made of them): the directory's owner placed them; the index only names entries. Use as a
    context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise ConversionError(f"{self.path}: not a directory")
        config_path = os.path.join(self.path, "config.json")
        if not os.path.lexists(config_path):
            raise ConversionError(f"{config_path}: missing (an HF model directory has a config.json)")
        self.config = read_json_file(config_path, "config.json")
        if not isinstance(self.config, dict):
            raise ConversionError(f"{config_path}: not a JSON object ({type(self.config).__name__} at the top level)")
        index_path = os.path.join(self.path, INDEX_NAME)
        weight_map: dict[str, str] | None = None
        if os.path.lexists(index_path):
            weight_map = self._weight_map(index_path)
            files = sorted(set(weight_map.values()))
        else:
            try:
                files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
            except OSError as e:
                raise ConversionError(f"{self.path}: cannot list the directory ({e.strerror or e})") from None
        if not files:
            raise ConversionError(f"{self.path}: no safetensors files")
        self._ids: dict[str, _FileId] = {}
        self._layout: dict[str, _Layout] = {}
        self.tensors: dict[str, HFTensor] = {}
        for name in files:
            path = os.path.join(self.path, name)
            fd, st = _open_regular(path, "a safetensors shard")
            try:
                entries, _ = parse_safetensors_header(path, fd, st.st_size)
            finally:
                os.close(fd)
            self._ids[name] = _FileId.of(st)
            for key, (dtype, shape, layout) in entries.items():
                if key in self.tensors:
                    raise ConversionError(
                        f"{self.path}: tensor '{key}' is stored twice ({self.tensors[key].file}, {name})"
                    )
                self.tensors[key] = HFTensor(name, dtype, shape)
                self._layout[key] = layout
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items() if k not in self.tensors or self.tensors[k].file != f)
            if wrong:
                raise ConversionError(
                    f"{index_path}: these keys are not in the file the index names: {', '.join(wrong)}"
                )

    @staticmethod
    def _weight_map(index_path: str) -> dict[str, str]:
        """The index's ``weight_map`` (tensor name -> shard file name), checked."""
        index = read_json_file(index_path, "index")
        if not isinstance(index, dict):
            raise ConversionError(f"{index_path}: not a JSON object ({type(index).__name__} at the top level)")
        if "weight_map" not in index:
            raise ConversionError(f"{index_path}: no 'weight_map'")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise ConversionError(
                f"{index_path}: 'weight_map' must be an object (tensor name -> file name), got {short_repr(weight_map)}"
            )
        for key, name in weight_map.items():
            if not key.isprintable():
                raise ConversionError(
                    f"{index_path}: 'weight_map' has a tensor name with control characters: {short_repr(key)}"
                )
            check_shard_name(name, index_path, key)
        return weight_map

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``key``, read alone from its file (opened for this one read, so memory
        holds this tensor and nothing else of the file), after checking that the file is still
        the one whose header was checked. ``out``: where to read it (returned): a tensor of its
        dtype and element count, or a view holding its elements in row-major order (e.g. its
        rows in a fused tensor: read into place, no copy). Safe to call from several threads."""
        t = self.tensors[key]
        path = os.path.join(self.path, t.file)
        layout = self._layout[key]
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype)
        elif out.dtype != t.dtype or out.numel() != t.shape.numel():
            raise ConversionError(
                f"{path}: tensor {key!r} is {t.dtype} {tuple(t.shape)}; cannot read it into "
                f"{out.dtype} {tuple(out.shape)}"
            )
        fd, st = _open_regular(path, "a safetensors shard")
        try:
            if _FileId.of(st) != self._ids[t.file]:
                raise ConversionError(f"{path}: changed since its header was read (reading tensor {key!r})")
            if layout.nbytes:
                pread_tensor(fd, out, layout.offset)
        except EOFError:
            raise ConversionError(f"{path}: tensor {key!r} ends early (file truncated while reading?)") from None
        except OSError as e:
            raise ConversionError(f"{path}: cannot read tensor {key!r} ({e.strerror or e})") from None
        finally:
            os.close(fd)
        return out

    def close(self) -> None:
        """Nothing is held open between reads; kept for the context-manager protocol."""

    def __enter__(self) -> "HFDirectory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

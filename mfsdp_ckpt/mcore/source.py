"""Reading a Megatron-Core ``torch_dist`` checkpoint: recognising it, its common state, and the
slices of its layer-stacked tensors.

An MCore checkpoint directory holds ``metadata.json`` (``{"sharded_backend": "torch_dist", …}``),
a stock DCP checkpoint (``.metadata`` and ``__<rank>_<i>.distcp``), and the non-tensor state:
``common.pt`` (MCore ≤ 0.16 and what 0.17+ still reads; ``"common_backend": "torch"`` in
``metadata.json``) or a DCP object ``common_state…`` (0.17+). Everything is read through the
project's checked readers: ``.metadata`` by the restricted unpickler and the metadata checks,
chunks by :class:`~mfsdp_ckpt.read.reader.CheckpointReader` (files inside the directory, regular
files only, byte ranges inside their files), objects and ``common.pt`` with ``weights_only``.

:meth:`McoreSource.read_slice` reads one layer (or one layer's expert) of a stacked tensor: only
the chunks that overlap it; when a stored chunk is larger than the slice (a stack saved as one
chunk), only the slice's bytes of the chunk's raw record. So importing never holds a whole
stack, and :attr:`McoreSource.largest_read` records the largest single read (what the tests
measure).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mfsdp_ckpt.errors import ConversionError, CorruptCheckpointError, NotACheckpointError, one_line
from mfsdp_ckpt.format.names import MCORE_METADATA_NAME
from mfsdp_ckpt.mcore.layout import COMMON_STATE
from mfsdp_ckpt.read.locate import read_small_file, resolve_checkpoint
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.records import locate_raw_tensor
from mfsdp_ckpt.storage import fs

__all__ = ["McoreSource", "read_backend"]

COMMON_PT = "common.pt"


def _directory(path: str | os.PathLike) -> str:
    return resolve_checkpoint(path)


def read_backend(directory: str) -> dict[str, Any]:
    """``metadata.json``, checked: a JSON object whose ``sharded_backend`` is ``torch_dist``
    (the only backend this reader knows; ``zarr`` and others are refused, naming it)."""
    path = fs.join(directory, MCORE_METADATA_NAME)
    try:
        meta = json.loads(read_small_file(path, MCORE_METADATA_NAME))
    except (ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else one_line(e, 120)
        raise ConversionError(f"{path}: not JSON ({what})") from None
    if not isinstance(meta, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise ConversionError(
            f"{path}: sharded_backend {backend!r}: only Megatron-Core's 'torch_dist' backend is read "
            "(re-save with dist_checkpointing's default backend)"
        )
    common = meta.get("common_backend", "torch")
    if common not in ("torch", None):
        raise ConversionError(f"{path}: common_backend {common!r}: only 'torch' (common.pt) is read")
    return meta


@dataclass
class McoreSource:
    """An open MCore checkpoint: its DCP entries (through a :class:`CheckpointReader`), its
    ``metadata.json`` and its common state. A context manager."""

    directory: str
    backend: dict[str, Any]
    reader: CheckpointReader
    common: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    bytes_read: int = 0
    largest_read: int = 0  # the most bytes one read brought into memory (a chunk or a slice of one)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "McoreSource":
        directory = _directory(path)
        if not fs.isfile(fs.join(directory, MCORE_METADATA_NAME)):
            raise NotACheckpointError(f"{directory}: not a Megatron-Core checkpoint (no {MCORE_METADATA_NAME})")
        backend = read_backend(directory)
        reader = CheckpointReader(directory)
        source = cls(directory, backend, reader)
        try:
            source.common = source._read_common()
        except BaseException:
            reader.close()
            raise
        return source

    def __enter__(self) -> "McoreSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.reader.close()

    @property
    def entries(self) -> dict[str, Any]:
        return self.reader.metadata.state_dict_metadata

    def shape(self, key: str) -> tuple[int, ...] | None:
        md = self.entries[key]
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].properties.dtype

    def read_object(self, key: str) -> Any:
        """A stored object, loaded with ``weights_only=True`` (never arbitrary code)."""
        return self.reader.read(key)

    def _read_common(self) -> dict[str, Any]:
        """The common state: ``common.pt`` (loaded with ``weights_only``; an ``args`` namespace
        of Megatron-LM's trainer is admitted as plain data) or the ``common_state`` objects. A
        ``common.pt`` holding anything else (e.g. an enum among the ``args``) is not unpickled
        further: it is left out with a notice (the iteration is then unknown), the weights do
        not depend on it."""
        out: dict[str, Any] = {}
        path = fs.join(self.directory, COMMON_PT)
        if fs.lexists(path):
            data = read_small_file(path, COMMON_PT)
            try:
                with torch.serialization.safe_globals([argparse.Namespace]):
                    value = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:  # noqa: BLE001 - never unpickled further; the weights do not depend on it
                what = f"{type(e).__name__}: {one_line(e, 160)}"
                self.notices.append(f"{COMMON_PT} not carried: not loadable as plain data ({what})")
                value = {}
            if not isinstance(value, dict):
                raise ConversionError(f"{path}: expected a dict, got {type(value).__name__}")
            out.update(value)
        for key in sorted(k for k in self.entries if k.split("/", 1)[0] == COMMON_STATE):
            value = self.read_object(key)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if not isinstance(value, dict):
                raise ConversionError(
                    f"{self.directory}: key '{key}': expected the common state as a dict, got {type(value).__name__}"
                )
            out.update(value)
        return out

    def read_slice(self, key: str, index: tuple[int, ...], reuse: torch.Tensor | None = None) -> torch.Tensor:
        """``stored[index]`` of tensor ``key`` (``index`` fixes its leading axes), reading only
        the chunks that overlap it, and of a chunk larger than the slice only the slice's bytes
        (see the module docstring). ``reuse``: a tensor the caller is done with, filled and
        returned instead of a new one when its shape and dtype fit (a stack's layers read one
        after another then cost one buffer, not one allocation each)."""
        reader = self.reader
        md = self.entries[key]
        reader.check_entry(key)
        shape, dtype, k = tuple(md.size), md.properties.dtype, len(index)
        if any(not 0 <= i < d for i, d in zip(index, shape)):
            raise ConversionError(f"{self.directory}: key '{key}': index {list(index)} outside {list(shape)}")
        fits = reuse is not None and reuse.dtype == dtype and tuple(reuse.shape) == shape[k:] and reuse.is_contiguous()
        out = reuse if fits else torch.empty(shape[k:], dtype=dtype)
        sizes_at = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        covered = 0
        for idx, info in reader.stored_chunks(key):
            offsets = tuple(idx.offset)
            sizes = sizes_at[offsets]
            if any(not o <= i < o + s for i, o, s in zip(index, offsets, sizes)):
                continue
            region = out
            for dim, (o, s) in enumerate(zip(offsets[k:], sizes[k:])):
                region = region.narrow(dim, o, s)
            if all(s == 1 for s in sizes[:k]):  # the chunk lies inside the slice: read it whole
                piece = reader.read_chunk(idx, info)
                self._count(info.length)
                if not isinstance(piece, torch.Tensor) or piece.numel() != region.numel():
                    raise CorruptCheckpointError(
                        f"{self.directory}: key '{key}' chunk at {list(offsets)}: does not hold "
                        f"{list(sizes)} elements of {dtype}"
                    )
                region.copy_(piece.reshape(region.shape))
            else:
                self._read_inside(key, idx, info, offsets, sizes, index, region)
            covered += region.numel()
        if covered != out.numel():
            raise CorruptCheckpointError(
                f"{self.directory}: key '{key}': chunks cover {covered} of the {out.numel()} "
                f"elements of slice {list(index)}"
            )
        return out

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)

    def _read_inside(
        self,
        key: str,
        idx: Any,
        info: Any,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        index: tuple[int, ...],
        region: torch.Tensor,
    ) -> None:
        """The slice ``index`` of a chunk that holds more than it: the slice's bytes of the chunk's
        raw record when the record is plain and nothing checksums the chunk as a whole (a
        checkpoint without ``mfsdp.json``: MCore writes none); the whole chunk otherwise."""
        reader = self.reader
        dtype = region.dtype
        k = len(index)
        f = reader.open_data_file(info.relative_path, key)
        raw = None
        if reader.manifest is None:
            raw = locate_raw_tensor(f, info.offset, info.length, dtype, math.prod(sizes))
        if raw is None:
            piece = reader.read_chunk(idx, info)
            self._count(info.length)
            sub = piece.reshape(sizes)
            for i, o in zip(index, offsets):
                sub = sub[i - o]
            region.copy_(sub)
            return
        inner = math.prod(sizes[k:])
        start, stride = 0, inner
        for i, o, s in reversed(list(zip(index, offsets[:k], sizes[:k]))):
            start += (i - o) * stride
            stride *= s
        nbytes = inner * dtype.itemsize
        # straight into place where the region is one run of bytes (a slice that a chunk holds
        # whole along its trailing axes): no second buffer of the slice's size, no copy
        direct = region.is_contiguous()
        buf = memoryview(region.view(-1).view(torch.uint8).numpy()) if direct else bytearray(nbytes)
        f.seek(raw.offset + start * dtype.itemsize)
        got = f.readinto(buf) or 0
        if got != nbytes:
            raise CorruptCheckpointError(
                f"{self.directory}: key '{key}' chunk at {list(offsets)}: short read of slice "
                f"{list(index)} ({got} of {nbytes} bytes)"
            )
        self._count(nbytes)
        if not direct:
            region.copy_(torch.frombuffer(buf, dtype=dtype).reshape(region.shape))

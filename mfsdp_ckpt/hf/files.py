"""The files of a Hugging Face model directory: safetensors shards written one tensor at a time,
``model.safetensors.index.json``, and reading a directory's tensors one at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, ``[begin, end)`` byte offsets into the data section), then the raw row-major bytes. Because
an export knows every shape and dtype before it reads a byte, :class:`SafetensorsWriter` writes
the header first and then each tensor as it is converted, so a shard never needs to be in memory
as a whole.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from mfsdp_core.dtypes import dtype_from_safetensors, safetensors_name

from ..errors import ConversionError

__all__ = ["parse_size", "shard_name", "INDEX_NAME", "SafetensorsWriter", "HFTensor", "HFDirectory"]

INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (name, dtype, shape, in file order) are known in
    advance: the header at once, then each tensor's bytes as :meth:`write` receives them, in that
    order. :meth:`close` checks every tensor was written exactly once."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = path
        header: dict[str, Any] = {}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in entries:
            st_name = safetensors_name(dtype)
            if st_name is None:
                raise ConversionError(f"{path}: tensor '{name}': dtype {dtype} has no safetensors name")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(text)))
        self._f.write(text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise ConversionError(f"{self.path}: tensor '{name}' written but not planned for this file")
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ConversionError(f"{self.path}: got '{name}' {tensor.dtype} {tuple(tensor.shape)}, "
                                  f"expected '{want}' {dtype} {shape} next")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            self._f.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            missing = [name for name, *_ in self._order[self._next:]]
            self._f.close()
            raise ConversionError(f"{self.path}: tensors planned but never written: {', '.join(missing)}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


@dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor is: its file, dtype and shape (from the safetensors header)."""

    file: str
    dtype: torch.dtype
    shape: torch.Size


class HFDirectory:
    """The config and tensors of an HF model directory, one tensor at a time.

    Files: those named by ``model.safetensors.index.json`` when present, else every
    ``*.safetensors``. A tensor stored twice, or an index entry naming a file that lacks it, is an
    error (naming the key). Use as a context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise ConversionError(f"{self.path}: not a directory")
        config_path = os.path.join(self.path, "config.json")
        try:
            with open(config_path) as f:
                self.config = json.load(f)
        except FileNotFoundError:
            raise ConversionError(f"{config_path}: missing (an HF model directory has a config.json)") from None
        except (OSError, ValueError) as e:
            raise ConversionError(f"{config_path}: unreadable ({e})") from None
        index_path = os.path.join(self.path, INDEX_NAME)
        weight_map: dict[str, str] | None = None
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConversionError(f"{index_path}: unreadable index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not files:
            raise ConversionError(f"{self.path}: no safetensors files")
        self._handles: dict[str, Any] = {}
        self.tensors: dict[str, HFTensor] = {}
        for name in files:
            handle = self._open(name)
            for key in handle.keys():
                if key in self.tensors:
                    raise ConversionError(f"{self.path}: tensor '{key}' is stored twice ({self.tensors[key].file}, {name})")
                sl = handle.get_slice(key)
                dtype = dtype_from_safetensors(sl.get_dtype())
                if dtype is None:
                    raise ConversionError(f"{os.path.join(self.path, name)}: tensor '{key}' has unsupported dtype {sl.get_dtype()}")
                self.tensors[key] = HFTensor(name, dtype, torch.Size(sl.get_shape()))
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items() if k not in self.tensors or self.tensors[k].file != f)
            if wrong:
                raise ConversionError(f"{index_path}: these keys are not in the file the index names: {', '.join(wrong)}")

    def _open(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            path = os.path.join(self.path, name)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:
                raise ConversionError(f"{path}: unreadable safetensors file ({e})") from None
            self._handles[name] = handle
        return handle

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read alone from its file. The file is opened for this one read:
        ``safe_open`` maps the whole file, and the pages a read touches stay in this process's
        resident set until the handle is dropped, which over a whole import would add up to the
        model's size."""
        path = os.path.join(self.path, self.tensors[key].file)
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)

    def close(self) -> None:
        self._handles = {}

    def __enter__(self) -> "HFDirectory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

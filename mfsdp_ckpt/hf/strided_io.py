"""Positional reads and writes of tensor views, without copying them first.

A piece of a fused tensor (the q rows of every query group of ``linear_qkv``, the gate half of
``[gate; up]``) is a strided view of the fused tensor: a few long runs of contiguous bytes. These
functions move such a view to or from a file as those runs (``os.pwritev`` / ``os.preadv``, at
most ``IOV_MAX`` runs per call, partial transfers resumed), so that splitting a tensor for an
export or merging one in an import costs no copy in memory: the kernel copies each run between
the page cache and the tensor once. Views whose runs are short (e.g. a transpose) are copied to a
contiguous tensor first, which is still correct, just not free. The system calls release the GIL,
so several threads transfer at once.
"""

from __future__ import annotations

import math

import torch

from mfsdp_ckpt.storage.positioned import pread_into, pwrite_from

__all__ = ["MIN_RUN_BYTES", "pread_tensor", "pwrite_tensor", "runs"]

#: views whose contiguous runs are shorter than this are copied into one contiguous block first
MIN_RUN_BYTES = 4096


def runs(view: torch.Tensor) -> list[tuple[int, int]] | None:
    """The ``(byte offset in the view's storage, byte length)`` of the contiguous runs that hold
    the elements of ``view`` in row-major order (one for a contiguous tensor); None when there
    are several shorter than :data:`MIN_RUN_BYTES` (cheaper to copy) or the view has no
    elements."""
    if view.numel() == 0:
        return None
    shape, strides, size = list(view.shape), list(view.stride()), view.element_size()
    k = len(shape)  # dims k.. form one contiguous block; grow it from the last dim
    expected = 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    run = math.prod(shape[k:]) * size
    if run < MIN_RUN_BYTES and k > 0:  # many short runs (one run, however short, is fine)
        return None
    starts = torch.tensor([view.storage_offset()], dtype=torch.int64)
    for d in range(k):  # row-major over the leading dims
        starts = (starts[:, None] + torch.arange(shape[d], dtype=torch.int64)[None, :] * strides[d]).reshape(-1)
    return [(int(s) * size, run) for s in starts.tolist()]


def _buffers(view: torch.Tensor) -> list[memoryview]:
    """The runs of ``view`` as memoryviews of its storage (a contiguous copy's one buffer when the
    runs are too short)."""
    spans = runs(view)
    if spans is None:
        flat = view.contiguous().reshape(-1).view(torch.uint8)
        return [memoryview(flat.numpy())] if flat.numel() else []
    storage = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
    whole = memoryview(storage.numpy())
    return [whole[off : off + n] for off, n in spans]


def _transfer(move, fd: int, buffers: list[memoryview], offset: int, what: str) -> None:
    """Move every byte of ``buffers`` with ``move`` (:func:`~mfsdp_ckpt.storage.positioned.pwrite_from`
    or :func:`~mfsdp_ckpt.storage.positioned.pread_into`); a transfer that stops short is end of
    file."""
    done = move(fd, buffers, offset)
    if done < sum(len(b) for b in buffers):
        raise EOFError(f"{what}: end of file at byte {offset + done}")


def pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Write the elements of ``tensor`` (any view, CPU) in row-major order at ``offset`` of the
    open file ``fd``; returns the bytes written."""
    buffers = _buffers(tensor)
    _transfer(pwrite_from, fd, buffers, offset, "write")
    return sum(len(b) for b in buffers)


def pread_tensor(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Fill ``tensor`` (any view, CPU), in row-major order, with the bytes at ``offset`` of the
    open file ``fd``; returns the bytes read. A view whose runs are short is read into a
    contiguous temporary, then copied into place. Raises ``EOFError`` when the file ends first."""
    spans = runs(tensor)
    if spans is None:
        if tensor.numel() == 0:
            return 0
        tmp = torch.empty(tensor.shape, dtype=tensor.dtype)
        n = pread_tensor(fd, tmp, offset)
        tensor.copy_(tmp)
        return n
    buffers = _buffers(tensor)
    _transfer(pread_into, fd, buffers, offset, "read")
    return sum(len(b) for b in buffers)

"""Fences: the runtime's in-place writes of a model's state wait while a background reader copies it.

An asynchronous checkpoint (``mfsdp_ckpt.async_save``) copies the sharded state in a background
thread while training goes on with the next forward and backward, which only read that state. A
:class:`Fence` held on the model's flat buffers makes every write the runtime does to what is
being copied wait until the copy is complete, so that the copy is bitwise the state at the moment
it was started. The writes that wait (each calls :func:`await_fences`):

- the optimizer step (main params, optimizer state): a step pre-hook of ``fully_shard_optimizer``;
- refreshing the compute params and companion planes (``FlatParamBuffer.refresh_compute_params``);
- handing the storage's views to a writer (``describe_shards``, which ``mfsdp_ckpt.load`` uses
  before writing anything);
- when the copy includes the gradients (``grads=True``): the gradient reduction at the end of
  backward, ``clip_grad_norm_`` and ``optimizer.zero_grad(set_to_none=False)``.

Once released, a fence is gone from the buffers: a step that finds no fence pays one attribute
test per buffer. Writes of your own (``p.data.copy_``, ``optimizer.state[...]``) are not fenced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Fence", "await_fences"]


class Fence:
    """A background reader's hold on ``buffers``: the runtime's writes to them wait until
    :meth:`release`. ``grads``: the gradients are read too (their writes wait as well).
    ``waited_s`` adds up the seconds the writers waited (the training time the copy cost)."""

    def __init__(self, buffers: Iterable[Any], *, grads: bool) -> None:
        self.grads = grads
        self.waited_s = 0.0
        self._released = threading.Event()
        self._buffers = list(buffers)
        held = [buf for buf in self._buffers if getattr(buf, "fence", None) is not None]
        if held:
            raise RuntimeError(f"Fence: {len(held)} buffer(s) are already fenced by another reader")
        for buf in self._buffers:
            buf.fence = self

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        """The copy is complete (or abandoned): writers go on, and the buffers forget the fence.
        Idempotent; safe from any thread."""
        for buf in self._buffers:
            if buf.fence is self:
                buf.fence = None
        self._buffers = []
        self._released.set()

    def wait(self) -> None:
        """Block until released, counting the time waited in ``waited_s``."""
        if self._released.is_set():
            return
        start = time.perf_counter()
        self._released.wait()
        self.waited_s += time.perf_counter() - start


def await_fences(buffers: Iterable[Any], *, grads_only: bool = False) -> None:
    """Before writing into ``buffers``: wait for every fence held on them. ``grads_only``: the
    write touches only gradients, which only a fence with ``grads=True`` protects."""
    for buf in buffers:
        fence = buf.fence
        if fence is not None and (fence.grads or not grads_only):
            fence.wait()

"""One CUDA stream for all of a root's collectives (opt-in: :func:`~mfsdp_core.set_comm_stream`).

Without it, a unit's all-gather and reduce-scatter are issued from the compute stream. NCCL runs
an ``async_op`` collective on its own stream, but that stream first waits for everything already
queued on the issuing stream: a prefetch issued while the CPU runs ahead of the GPU starts only
when the compute queued before it is done, which is the overlap lost. With a communication
stream, collectives are issued from it, so they wait only for what they read:

* an all-gather reads the local shards, written by the last optimizer step or load: the root's
  forward pre-hook records an event on the compute stream (:meth:`CommStream.mark_inputs`), and
  prefetches wait for that event only; a gather that the compute stream needs at once waits for
  the whole compute stream (it costs nothing, compute waits for it next anyway);
* a reduction reads the gradients staged by backward: it waits for the whole compute stream.

One stream for both kinds keeps them in issue order (a reduce-scatter never contends with the
next all-gather for the link) and, as the runtime issues the same collectives in the same order
on every rank, the order is the same everywhere.

Memory the collectives write is allocated while the communication stream is current, and each
tensor read on the compute stream is recorded there (``record_stream``) when its collective is
waited for, so the caching allocator does not hand it to the next collective before the compute
that reads it is done. ``wait()`` of an NCCL work makes the current stream wait for it, so the
local step that completes a collective (the rank-order sum, the spills) runs on the compute
stream, after the data arrived.

Only CUDA parameters can use it; the CUDA calls go through a small backend object
(``torch.cuda`` by default), so that the order of waits and records can be checked on a machine
without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["CommStream", "CudaStreams"]


class CudaStreams:
    """The CUDA calls a :class:`CommStream` makes (the default backend)."""

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record_tensor(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class CommStream:
    """The stream one root issues its collectives from, and the waits that keep them correct."""

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        self.device = torch.device(device)
        self.backend = backend if backend is not None else CudaStreams()
        if backend is None and (self.device.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"a communication stream needs CUDA parameters; these are on {self.device}")
        self.stream = self.backend.new_stream(self.device)
        self._inputs_ready: Any = None  # event on the compute stream after the last shard writes

    def compute(self) -> Any:
        """The stream compute runs on now (the current stream)."""
        return self.backend.current_stream(self.device)

    def mark_inputs(self) -> None:
        """The local shards are final for this pass (the root's forward begins): record it."""
        self._inputs_ready = self.backend.record_event(self.compute())

    @contextlib.contextmanager
    def issue(self, *, prefetch: bool) -> Iterator[None]:
        """Make the communication stream current for issuing a collective (and allocating what
        it writes). ``prefetch``: an all-gather ahead of its unit, which waits only for the
        shards to be written; otherwise it waits for all compute issued so far."""
        if prefetch and self._inputs_ready is not None:
            self.backend.wait_event(self.stream, self._inputs_ready)
        else:
            self.backend.wait_stream(self.stream, self.compute())
        with self.backend.use(self.stream):
            yield

    def read_on_compute(self, *tensors: torch.Tensor) -> None:
        """``tensors``, written by a collective, are read by the compute stream from now on."""
        compute = self.compute()
        for t in tensors:
            if t.untyped_storage().size() > 0:
                self.backend.record_tensor(t, compute)

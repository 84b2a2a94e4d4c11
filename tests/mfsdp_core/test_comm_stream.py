"""The opt-in communication stream (``set_comm_stream``).

No GPU here: the CUDA calls go through a recording stand-in backend (streams are plain objects,
events are numbered), driven by a real 2-rank gloo ZeRO-3 run. What this checks is the wiring —
every all-gather and reduce-scatter is issued while the communication stream is current, a
prefetch waits only for the shards' event from the root's forward, every other collective waits
for the whole compute stream, and every gathered tensor is handed to the compute stream before
compute reads it — and that training is bitwise unchanged. It does not show that the CUDA
streams overlap (that needs a GPU). A CPU model is refused in one line without the stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mfsdp_core import count_comm, fully_shard, fully_shard_optimizer, set_comm_stream
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_units


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class RecordingStreams:
    """A stand-in for ``torch.cuda``'s stream calls that logs them, with times."""

    def __init__(self) -> None:
        self.compute = _Stream("compute")
        self.current = self.compute
        self.log: list[tuple] = []
        self.current_spans: list[list[int]] = []  # [start, end] while a non-compute stream is current
        self._events = 0

    def new_stream(self, device: torch.device) -> _Stream:
        return _Stream(f"comm:{device}")

    def current_stream(self, device: torch.device) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: _Stream):
        before, self.current = self.current, stream
        span = [time.perf_counter_ns(), 0]
        self.current_spans.append(span)
        try:
            yield
        finally:
            span[1] = time.perf_counter_ns()
            self.current = before

    def record_event(self, stream: _Stream) -> tuple:
        self._events += 1
        event = ("event", self._events, stream.name)
        self.log.append(("record_event", stream.name, event, time.perf_counter_ns()))
        return event

    def wait_event(self, stream: _Stream, event: tuple) -> None:
        self.log.append(("wait_event", stream.name, event, time.perf_counter_ns()))

    def wait_stream(self, stream: _Stream, other: _Stream) -> None:
        self.log.append(("wait_stream", stream.name, other.name, time.perf_counter_ns()))

    def record_tensor(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("record_tensor", stream.name, tensor.untyped_storage().data_ptr(), time.perf_counter_ns()))


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, 256, (2, 17), generator=g)


def _train(with_stream: bool) -> dict:
    config = dataclasses.replace(get_preset("tiny"), num_layers=3)
    torch.manual_seed(0)
    net = GPTModel(config)
    for unit in shard_units(net):
        fully_shard(unit, strategy="optim_grads_params")
    backend = RecordingStreams()
    if with_stream:
        set_comm_stream(net, True, backend=backend)
    optim = fully_shard_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))
    losses, steps = [], []
    for step in range(3):
        start = len(backend.log)
        with count_comm() as counter:
            logits = net(_tokens(step)[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _tokens(step)[:, 1:].reshape(-1))
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        records = [(r.op, r.issued_ns, r.label) for r in counter.records if r.op in ("all_gather", "reduce_scatter")]
        steps.append({"log": backend.log[start:], "records": records})
    gathered = {
        buf.plane.gathered.untyped_storage().data_ptr() for unit in shard_units(net) for buf in unit._mfsdp_unit.buffers
    }
    return {"losses": losses, "steps": steps, "spans": backend.current_spans, "gathered_ptrs": len(gathered)}


def _both() -> dict:
    return {"plain": _train(False), "stream": _train(True)}


def _inside(t: int, spans: list[list[int]]) -> bool:
    return any(a <= t <= b for a, b in spans)


def test_collectives_are_issued_from_the_comm_stream_and_training_is_unchanged(ranks):
    for rank, out in enumerate(ranks(_both, 2, timeout=240)):
        plain, stream = out["plain"], out["stream"]
        assert stream["losses"] == plain["losses"], rank  # bitwise
        assert plain["spans"] == [] and all(s["log"] == [] for s in plain["steps"])
        for k, step in enumerate(stream["steps"]):
            log, records = step["log"], step["records"]
            assert records, (rank, k)
            # every all-gather and reduce-scatter was issued with the communication stream current
            outside = [r for r in records if not _inside(r[1], stream["spans"])]
            assert outside == [], (rank, k, outside[:3])
            # the root's forward records the shards' event once per step, first
            marks = [e for e in log if e[0] == "record_event"]
            assert len(marks) == 1 and marks[0][1] == "compute" and log[0] == marks[0], (rank, k, log[:2])
            event = marks[0][2]
            waits = [e for e in log if e[0] in ("wait_event", "wait_stream")]
            assert all(e[1].startswith("comm:") for e in waits)
            # prefetches (from step 1 on, the order is learned) wait for that event only; the
            # others wait for the whole compute stream
            prefetches = [e for e in waits if e[0] == "wait_event"]
            assert all(e[2] == event for e in prefetches)
            assert (len(prefetches) > 0) == (k > 0), (rank, k, len(prefetches))
            assert any(e[0] == "wait_stream" and e[2] == "compute" for e in waits)
            # every gathered tensor is handed to the compute stream when its all-gather is waited
            # for: at least one record per all-gather, all on the compute stream
            handed = [e for e in log if e[0] == "record_tensor"]
            gathers = [r for r in records if r[0] == "all_gather"]
            assert len(handed) >= len(gathers) > 0 and all(e[1] == "compute" for e in handed), (rank, k)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_cpu_model_and_a_non_root_are_refused_in_one_line():
    net = _Net()
    fully_shard(net.a)
    fully_shard(net)
    with pytest.raises(ValueError) as e:
        set_comm_stream(net, True)
    assert str(e.value) == "set_comm_stream: a communication stream needs CUDA parameters; these are on cpu"
    with pytest.raises(ValueError, match=r"^set_comm_stream: Linear is not the root of a fully_shard-ed model$"):
        set_comm_stream(net.a, True)
    set_comm_stream(net, False)  # turning it off needs no GPU
    assert net(torch.ones(3, 4)).shape == (3, 2)

"""Resident memory under ZeRO-3 and the communication volume of each strategy."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from mfsdp_core import count_comm, describe_shards, fully_shard_optimizer
from mfsdp_core.fully_shard import buffers_of, units_of
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model, shard_model


def _resident_bytes(model, optim) -> int:
    """Bytes of every distinct storage holding parameters, gradients or optimizer state: the
    module's parameters (their gathered storage, freed between steps under ZeRO-3) and their
    ``.grad``, every runtime buffer (shards, main params, reduced grads, gathered buffer, spills,
    staging), the optimizer's parameters and their ``.grad``, and all optimizer state tensors
    except 0-d ones (Adam's per-parameter step counters: 4 bytes each, not parameter-sized)."""
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad]
    for buf in buffers_of(model):
        tensors += [buf.shard, buf.main, buf.gathered, buf._staging, getattr(buf, "grad", None), *buf.spills.values()]
    for group in optim.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad]
    for state in optim.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    storages = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _zero3_resident(policy: str) -> dict:
    model = shard_model(make_model("transformer"), strategy="optim_grads_params", policy=policy)
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        x, y = batch(step, world)
        loss = loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
    del x, y, loss
    live = _resident_bytes(model, optim)
    # param + grad + exp_avg + exp_avg_sq, fp32: 16 bytes per element of the unsharded model
    unsharded = sum(16 * ps.shape.numel() for ps in describe_shards(model, optim))
    padding = sum(16 * buf.layout.padding for buf in buffers_of(model))
    states = {k for ps in describe_shards(model, optim) for k in ps.optim}
    return {"live": live, "unsharded": unsharded, "padding": padding, "states": states}


@pytest.mark.parametrize("policy", ["even", "row", "block(32)", "tensor"])
def test_zero3_resident_bytes_are_a_quarter(ranks, policy):
    for rank, r in enumerate(ranks(_zero3_resident, 4, policy, timeout=300)):
        assert r["states"] == {"exp_avg", "exp_avg_sq"}
        bound = (r["unsharded"] + r["padding"]) / 4
        assert r["live"] <= bound, f"rank {rank}: {r['live']} live bytes > {bound} (1/4 of {r['unsharded']} + padding)"
        # the count does see the sharded state: at least the largest rank's share minus padding
        assert r["live"] >= r["unsharded"] / 4 - r["padding"], f"rank {rank}: only {r['live']} bytes found"


def _expected_ops(model, strategy: str) -> collections.Counter:
    expected: collections.Counter = collections.Counter()
    root_buffers = units_of(model)[0].buffers
    assert units_of(model)[0].is_root and root_buffers
    for buf in buffers_of(model):
        params = buf.layout.gathered_size * buf.compute_dtype.itemsize
        grads = buf.layout.gathered_size * buf.reduce_dtype.itemsize
        if strategy == "optim_grads_params":
            # forward and backward; the root keeps its parameters from forward to backward (as FSDP2)
            expected[("all_gather", params)] += 1 if buf in root_buffers else 2
            expected[("reduce_scatter", grads)] += 1
        elif strategy == "optim_grads":
            expected[("reduce_scatter", grads)] += 1
            expected[("all_gather", params)] += 1  # after the step
        elif strategy == "optim":
            expected[("all_reduce", grads)] += 1
            expected[("all_gather", params)] += 1
        else:
            expected[("all_reduce", grads)] += 1
    return expected


def _comm_per_step(strategy: str) -> dict:
    model = shard_model(make_model("transformer"), strategy=strategy, policy="row")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    world, rank = dist.get_world_size(), dist.get_rank()
    per_step = []
    for step in range(2):
        x, y = batch(step, world)
        with count_comm() as counter:
            loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            optim.step()
            optim.zero_grad()
        per_step.append(collections.Counter((r.op, r.bytes) for r in counter.records))
    return {"per_step": per_step, "expected": _expected_ops(model, strategy)}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_comm_volume_per_step(ranks, strategy):
    world = 4 if strategy == "optim_grads_params" else 3
    for r in ranks(_comm_per_step, world, strategy, timeout=300):
        for counted in r["per_step"]:
            assert counted == r["expected"]

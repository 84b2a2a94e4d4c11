"""Resident memory under ZeRO-3 and the communication volume of each strategy."""

from __future__ import annotations

import collections
import gc
import warnings

import pytest
import torch
import torch.distributed as dist

from mfsdp_core import count_comm, describe_shards, fully_shard_optimizer
from mfsdp_core.fully_shard import buffers_of
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model, shard_model


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python in this process, except 0-d
    tensors (Adam's per-parameter step counters: a few bytes each, not parameter-sized)."""
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.dim() > 0:
            st = obj.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
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
    live = _live_tensor_bytes()
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
    for buf in buffers_of(model):
        params = buf.layout.gathered_size * buf.compute_dtype.itemsize
        grads = buf.layout.gathered_size * buf.reduce_dtype.itemsize
        if strategy == "optim_grads_params":
            expected[("all_gather", params)] += 2  # forward and backward
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

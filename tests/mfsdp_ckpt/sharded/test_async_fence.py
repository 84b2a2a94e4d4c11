"""The fence of an asynchronous save: the state is copied in the background while training goes
on, and every write the runtime does to that state waits for the copy, so the checkpoint holds
the state of the call, bitwise.

The copy is made slow on purpose (``HostStaging.fill`` sleeps first), so that each write below
comes while it is still running: without the fence every one of them would land in the
checkpoint (checked by hand with ``await_fences`` made a no-op: every case fails)."""

from __future__ import annotations

import importlib
import os
import time

import pytest
import torch
import torch.distributed as dist

import mfsdp_ckpt
from mfsdp_ckpt import CheckpointError
from mfsdp_core import MixedPrecision, clip_grad_norm_, fully_shard_optimizer
from mfsdp_core.fully_shard import buffers_of
from tests.mfsdp_ckpt.util import owned_pieces, train_steps
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model, shard_model

ASYNC = importlib.import_module(
    "mfsdp_ckpt.sharded.async_save"
)  # the module (``mfsdp_ckpt.async_save`` is the function)
SLOW_COPY_S = 0.6


def _build(strategy: str, policy: str, bf16: bool, seed: int = 0):
    mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    model = shard_model(make_model("transformer", seed=seed), strategy=strategy, policy=policy, mixed_precision=mp)
    return model, fully_shard_optimizer(make_adamw(model.parameters()))


def _state(model, optim) -> dict[str, torch.Tensor]:
    """Everything of this rank that a checkpoint with gradients holds: weights, main params,
    optimizer tensors and scalars, gradients."""
    out = {k: v for k, (_, _, v) in owned_pieces(model, optim, grads=True).items()}
    for p, state in optim.state.items():
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or v.shape != p.shape:
                out[f"scalar.{id(p)}.{k}"] = torch.as_tensor(v).clone()
    return out


def _scalars_by_order(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [v for k, v in state.items() if k.startswith("scalar.")]


def _backward(model, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, world)
    loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()


def _mutations(root: str, strategy: str, policy: str, bf16: bool) -> dict:
    """For each kind of write: save (slowly copied), write at once, check the checkpoint holds
    the state before the write."""
    model, optim = _build(strategy, policy, bf16)
    train_steps(model, optim, 0, 2, zero_grad_last=False)  # with optimizer state and gradients
    other, other_optim = _build(strategy, policy, bf16, seed=3)
    train_steps(other, other_optim, 0, 1)
    mfsdp_ckpt.save(os.path.join(root, "other"), other, other_optim)  # another state to load
    real_fill = ASYNC.HostStaging.fill

    def slow_fill(self, staged):
        time.sleep(SLOW_COPY_S)
        return real_fill(self, staged)

    def step_after_forward_backward():
        _backward(model, 5)  # reads the state while it is copied; its gradients are not in this save
        optim.step()

    writes = {  # name -> (include_grads, the write)
        "optimizer step": (False, step_after_forward_backward),
        "gradient reduction": (True, lambda: _backward(model, 6)),
        "clip_grad_norm_": (True, lambda: clip_grad_norm_(optim, 1e-3)),
        "zero_grad(set_to_none=False)": (True, lambda: optim.zero_grad(set_to_none=False)),
        "load": (True, lambda: mfsdp_ckpt.load(os.path.join(root, "other"), model, optim)),
    }
    out = {}
    ASYNC.HostStaging.fill = slow_fill
    try:
        for i, (name, (grads, write)) in enumerate(writes.items()):
            before = _state(model, optim)
            handle = mfsdp_ckpt.async_save(os.path.join(root, f"ckpt_{i}"), model, optim, include_grads=grads)
            fenced = [buf.fence is not None for buf in buffers_of(model)]
            write()
            changed = [k for k, v in _state(model, optim).items() if not torch.equal(v, before[k])]
            handle.result()
            fresh, fresh_optim = _build(strategy, policy, bf16, seed=7)
            train_steps(fresh, fresh_optim, 0, 1, zero_grad_last=False)  # other values everywhere, grads included
            mfsdp_ckpt.load(os.path.join(root, f"ckpt_{i}"), fresh, fresh_optim)
            got = _state(fresh, fresh_optim)
            keys = [k for k in before if not k.startswith("scalar.") and (grads or not k.startswith("grad."))]
            wrong = [k for k in keys if not torch.equal(got[k], before[k])]
            wrong += [
                f"scalar {j}"
                for j, (a, b) in enumerate(zip(_scalars_by_order(got), _scalars_by_order(before)))
                if not torch.equal(a, b)
            ]
            out[name] = {
                "wrong": wrong,
                "changed": len(changed),
                "fenced": all(fenced),
                "fence_s": handle.fence_s,
                "call_s": handle.call_s,
                "blocked_s": handle.blocked_s,
                "staged_s": handle.staged_s,
                "released": all(buf.fence is None for buf in buffers_of(model)),
            }
            optim.zero_grad()
            _backward(model, 10 + i)  # gradients again for the next case
    finally:
        ASYNC.HostStaging.fill = real_fill
    return out


@pytest.mark.parametrize(
    "strategy,policy,bf16",
    [
        ("optim", "row", False),  # ZeRO-1: whole gradients, all-reduced; weights saved from the gathered buffer
        ("optim_grads_params", "even", True),  # ZeRO-3, bf16 compute: weights from the own shard, fp32 main params
    ],
)
def test_every_write_of_the_state_waits_for_the_background_copy(ranks, tmp_path, strategy, policy, bf16):
    out = ranks(_mutations, 2, str(tmp_path), strategy, policy, bf16, timeout=240)
    for rank, cases in enumerate(out):
        for name, r in cases.items():
            assert r["changed"], f"rank {rank}, {name}: the write changed nothing (the case tests nothing)"
            assert not r["wrong"], (
                f"rank {rank}, {name}: the checkpoint holds values written after the call: {r['wrong'][:4]}"
            )
            assert r["fenced"] and r["released"], (rank, name, r)
            # the write waited for the copy, and the handle counts that as blocking
            assert r["fence_s"] >= SLOW_COPY_S / 3, (rank, name, r)
            assert r["blocked_s"] == r["call_s"] + r["fence_s"] and r["call_s"] < SLOW_COPY_S, (rank, name, r)
            assert r["staged_s"] >= SLOW_COPY_S, (rank, name, r)


def _copy_fails_on(rank_failing: int, run: str) -> dict:
    model, optim = _build("optim_grads", "even", False)
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.async_save(os.path.join(run, "step_1"), model, optim, step=1).result()
    real_fill = ASYNC.HostStaging.fill

    def failing_fill(self, staged):
        if dist.get_rank() == rank_failing:
            raise RuntimeError("injected copy failure\nsecond line")
        return real_fill(self, staged)

    ASYNC.HostStaging.fill = failing_fill
    try:
        handle = mfsdp_ckpt.async_save(os.path.join(run, "step_2"), model, optim, step=2)
        train_steps(model, optim, 1, 2)  # the step does not wait forever on a failed copy
        try:
            handle.result()
            error = None
        except CheckpointError as e:
            error = str(e)
    finally:
        ASYNC.HostStaging.fill = real_fill
    with open(os.path.join(run, "latest")) as f:
        latest = f.read().strip()
    left = sorted(n for n in os.listdir(run) if n not in ("latest", "latest-checkpoint"))
    dist.barrier()  # every rank has looked before rank 0 locks the run directory for step_3
    handle = mfsdp_ckpt.async_save(os.path.join(run, "step_3"), model, optim, step=3)  # a new buffer, saved
    handle.result()
    return {"error": error, "latest": latest, "left": left, "released": all(b.fence is None for b in buffers_of(model))}


def test_a_failed_background_copy_fails_the_save_on_every_rank(ranks, tmp_path):
    run = str(tmp_path / "run")
    out = ranks(_copy_fails_on, 2, 1, run, timeout=120)
    assert out[0] == out[1], out
    r = out[0]
    assert r["error"] == (
        f"{run}/step_2: cannot copy the state to host memory (RuntimeError: injected copy failure)"
    ), r
    assert r["latest"] == "step_1" and r["left"] == ["step_1"] and r["released"], r
    assert os.path.isfile(os.path.join(run, "step_3", "mfsdp.json"))


def test_no_fence_is_left_and_steps_pay_nothing_without_a_save(tmp_path):
    """One process: after the copy, the buffers hold no fence; a step with none waits for nothing."""
    model, optim = _build("optim_grads_params", "even", False)
    train_steps(model, optim, 0, 1)
    handle = mfsdp_ckpt.async_save(str(tmp_path / "step_1"), model, optim)
    handle.wait_staged()
    assert all(buf.fence is None for buf in buffers_of(model))
    train_steps(model, optim, 1, 2)
    handle.result()
    assert handle.fence_s == 0.0 and handle.blocked_s == handle.call_s

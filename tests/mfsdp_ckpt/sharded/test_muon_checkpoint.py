"""Muon checkpoints: ``optim.<fqn>.momentum_buffer`` (and AdamW's state for the rest) stored
canonically, so a run under ``tensor`` placement reshards into ``even`` at another world size and
back, online and offline, bitwise; a resumed run continues bitwise (real gloo processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main as cli
from mfsdp_core import fully_shard, fully_shard_optimizer
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_units
from mfsdp_core.muon import Muon, muon_param_groups, uses_muon
from tests.mfsdp_ckpt.util import joined, owned_state

CONFIG = get_preset("tiny")


def _build(policy: str):
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    for unit in shard_units(model):
        fully_shard(unit, policy=policy)
    optim = Muon(muon_param_groups(model, lr=0.02, weight_decay=0.01, adamw_lr=3e-3), ns_dtype="bfloat16")
    return model, fully_shard_optimizer(optim)


def _steps(model, optim, first: int, last: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last):
        tokens = torch.randint(0, CONFIG.vocab_size, (12, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * 12 // world : (rank + 1) * 12 // world]
        logits = model(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _train_save(path: str, policy: str, steps: int) -> dict:
    model, optim = _build(policy)
    losses = _steps(model, optim, 0, steps)
    mfsdp_ckpt.save(path, model, optim)
    return {"state": owned_state(model, optim), "losses": losses}


def _load_save(src: str, dst: str | None, policy: str) -> dict:
    model, optim = _build(policy)
    mfsdp_ckpt.load(src, model, optim)
    state = owned_state(model, optim)
    if dst:
        mfsdp_ckpt.save(dst, model, optim)
    return {"state": state}


def _resume(src: str, policy: str, first: int, last: int) -> dict:
    model, optim = _build(policy)
    mfsdp_ckpt.load(src, model, optim)
    losses = _steps(model, optim, first, last)
    return {"state": owned_state(model, optim), "losses": losses}


def _equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.heavy
def test_tensor_to_even_to_tensor_is_bitwise_online_and_offline(ranks, tmp_path):
    """tensor@3 -> even@2 -> tensor@4: params, Muon momentum and AdamW state bitwise equal at each
    hop; the same through `mfsdp-ckpt reshard` (tensor@3 -> even@2, and even@2 -> tensor@4)."""
    a = joined([r["state"] for r in ranks(_train_save, 3, str(tmp_path / "a"), "tensor", 3, timeout=300)])
    assert sum(k.endswith(".momentum_buffer") for k in a) == sum(
        uses_muon(n, p) for n, p in GPTModel(CONFIG).named_parameters()
    )
    b = joined(
        [r["state"] for r in ranks(_load_save, 2, str(tmp_path / "a"), str(tmp_path / "b"), "even", timeout=300)]
    )
    _equal(a, b)
    c = joined([r["state"] for r in ranks(_load_save, 4, str(tmp_path / "b"), None, "tensor", timeout=300)])
    _equal(a, c)
    result = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "a"), str(tmp_path / "offline"), "--world-size", "2", "--policy", "even"]
    )
    assert result.exit_code == 0, result.output
    d = joined([r["state"] for r in ranks(_load_save, 2, str(tmp_path / "offline"), None, "even", timeout=300)])
    _equal(a, d)
    result = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "b"), str(tmp_path / "back"), "--world-size", "4", "--policy", "tensor"]
    )
    assert result.exit_code == 0, result.output
    e = joined([r["state"] for r in ranks(_load_save, 4, str(tmp_path / "back"), None, "tensor", timeout=300)])
    _equal(a, e)


@pytest.mark.heavy
def test_resumed_muon_run_continues_bitwise(ranks, tmp_path):
    """Under `even` (owner-compute) at 3 ranks: 3 steps, save, load into a fresh model, 2 more
    steps equals 5 straight steps, losses and state."""
    first = ranks(_train_save, 3, str(tmp_path / "ckpt"), "even", 3, timeout=300)
    resumed = ranks(_resume, 3, str(tmp_path / "ckpt"), "even", 3, 5, timeout=300)
    straight = ranks(_resume_none, 3, "even", 5, timeout=300)
    for r in range(3):
        assert first[r]["losses"] + resumed[r]["losses"] == straight[r]["losses"]
    _equal(joined([r["state"] for r in resumed]), joined([r["state"] for r in straight]))


def _resume_none(policy: str, steps: int) -> dict:
    model, optim = _build(policy)
    losses = _steps(model, optim, 0, steps)
    return {"state": owned_state(model, optim), "losses": losses}

"""Stock DCP checkpoints as inputs, and FSDP2's key layout as an output (issue 17, item 1).

Real FSDP2 (``torch.distributed.fsdp.fully_shard`` + AdamW, gloo, CPU) on 2 ranks; ours on 3
(odd, and the test transformer's sizes do not divide by 2 or 3). The fixed batch every rank
evaluates and steps on is the same whole batch, so each rank's gradient is the same and the
only difference a world size makes is the rounding of the gradient average."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import mfsdp_ckpt
from tests.mfsdp_ckpt.util import build, owned_pieces, shapes_of, train_steps
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model
from tests.torchrun import ENV, ROOT

CLI = [sys.executable, "-m", "cli.main"]
FIXED = 77  # the step number of the fixed batch (tests.mfsdp_core.models.batch)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(FIXED, 1)


def _fsdp2(seed: int):
    model = make_model("transformer", seed=seed)
    fsdp2_fully_shard(model.block)
    fsdp2_fully_shard(model)
    return model, make_adamw(model.parameters())


def _fsdp2_full(model, optim) -> dict[str, torch.Tensor]:
    """Full model parameters and AdamW state (``model.<fqn>``, ``optim.<fqn>.<state>``)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        out.update((f"optim.{fqn}.{k}", v.detach().clone()) for k, v in state.items())
    return out


def _fsdp2_step(model, optim) -> float:
    """One AdamW step on the fixed batch (every rank the whole of it); the loss before it."""
    x, y = _fixed_batch()
    loss = loss_fn(model, x, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _fsdp2_train_and_save(path: str) -> dict:
    """FSDP2 trains 2 steps (rank r on chunk r), saves with get_state_dict + dcp.save, then
    reports its state, the loss on the fixed batch, and the loss after one more step there."""
    model, optim = _fsdp2(seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        x, y = batch(step, world)
        loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    state = _fsdp2_full(model, optim)
    first = _fsdp2_step(model, optim)
    with torch.no_grad():
        second = loss_fn(model, *_fixed_batch()).item()
    return {"state": state, "first": first, "second": second}


def _ours_load_and_step(path: str, require_manifest: bool = True) -> dict:
    """Our runtime (a different initial seed) loads ``path``; the loss on the fixed batch, then
    after one step there (every rank the whole batch), and the loaded pieces."""
    model, optim = build("optim_grads_params", "even", seed=5)
    mfsdp_ckpt.load(path, model, optim, require_manifest=require_manifest)
    pieces = owned_pieces(model, optim)
    x, y = _fixed_batch()
    loss = loss_fn(model, x, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        second = loss_fn(model, x, y).item()
    return {"pieces": pieces, "first": loss.item(), "second": second}


def _assemble(per_rank: list[dict], key: str, shape: torch.Size) -> torch.Tensor:
    flat = torch.empty(shape.numel())
    for pieces in per_rank:
        lo, hi, values = pieces[key]
        flat[lo:hi] = values
    return flat.view(shape)


@pytest.mark.heavy
def test_fsdp2_checkpoint_verifies_reshards_and_resumes_in_ours(ranks, tmp_path):
    stock, ours = str(tmp_path / "fsdp2"), str(tmp_path / "ours_w3")
    fsdp2 = ranks(_fsdp2_train_and_save, 2, stock, timeout=300)[0]

    res = _cli("verify", stock)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "NOTE mfsdp.json: absent (a stock DCP checkpoint): checksums are not available" in res.stdout
    assert "stock DCP" in _cli("ls", str(tmp_path)).stdout.splitlines()[0]

    res = _cli("reshard", stock, ours, "--world-size", "3")
    assert res.returncode == 0, res.stderr
    assert sorted(n for n in os.listdir(ours) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    assert _cli("verify", ours).returncode == 0
    # diff matches entries by canonical name: the stock checkpoint and its reshard are equal
    res = _cli("diff", stock, ours)
    assert res.returncode == 0 and res.stdout.startswith("equal: "), res.stdout + res.stderr

    out = ranks(_ours_load_and_step, 3, ours, timeout=300)
    shapes = shapes_of()
    for fqn, shape in shapes.items():  # the loaded model and optimizer: bitwise FSDP2's
        assert torch.equal(
            _assemble([o["pieces"] for o in out], f"model.{fqn}", shape), fsdp2["state"][f"model.{fqn}"]
        ), fqn
        for s in ("exp_avg", "exp_avg_sq"):
            key = f"optim.{fqn}.{s}"
            assert torch.equal(_assemble([o["pieces"] for o in out], key, shape), fsdp2["state"][key]), key
    # the loss on the fixed batch from the loaded weights: bitwise (same weights, same ops)
    assert all(o["first"] == fsdp2["first"] for o in out)
    # after one AdamW step there (uses the loaded moments and step count): equal up to the
    # rounding of the gradient average, (g+g)/2 on 2 ranks against (g+g+g)/3 on 3
    assert all(o["second"] == pytest.approx(fsdp2["second"], rel=1e-6, abs=0) for o in out)

    # load reads the stock checkpoint directly too (its key layout mapped), with the same result
    direct = ranks(_ours_load_and_step, 3, stock, False, timeout=300)
    assert [(d["first"], d["second"]) for d in direct] == [(o["first"], o["second"]) for o in out]


def _ours_train_save_step(path: str) -> dict:
    model, optim = build("optim_grads_params", "even", seed=0)
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(path, model, optim, extra={"step": 2}, step=2)
    saved = owned_pieces(model, optim)
    x, y = _fixed_batch()
    loss_fn(model, x, y).backward()
    optim.step()
    optim.zero_grad()
    return {"saved": saved, "after": owned_pieces(model, optim)}


def _fsdp2_resume(path: str) -> dict:
    """A fresh FSDP2 model + AdamW (another seed) loads ``path`` with dcp.load + set_state_dict,
    then trains one step on the fixed batch."""
    model, optim = _fsdp2(seed=9)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _fsdp2_full(model, optim)
    _fsdp2_step(model, optim)
    return {"loaded": loaded, "after": _fsdp2_full(model, optim)}


@pytest.mark.heavy
def test_ours_converted_to_dcp_fsdp2_loads_into_stock_fsdp2_and_trains(ranks, tmp_path):
    ours, stock = str(tmp_path / "ours"), str(tmp_path / "fsdp2")
    per_rank = ranks(_ours_train_save_step, 3, ours, timeout=300)
    res = _cli("convert", ours, stock, "--to", "dcp-fsdp2")
    assert res.returncode == 0, res.stderr
    fsdp2 = ranks(_fsdp2_resume, 2, stock, timeout=300)[0]
    for fqn, shape in shapes_of().items():
        for key in (f"model.{fqn}", f"optim.{fqn}.exp_avg", f"optim.{fqn}.exp_avg_sq"):
            assert torch.equal(fsdp2["loaded"][key], _assemble([p["saved"] for p in per_rank], key, shape)), key
        # one more step in each: equal up to the gradient average's rounding (3 ranks against 2)
        after = _assemble([p["after"] for p in per_rank], f"model.{fqn}", shape)
        torch.testing.assert_close(fsdp2["after"][f"model.{fqn}"], after, rtol=1e-6, atol=1e-7)
        assert fsdp2["loaded"][f"optim.{fqn}.step"].item() == 2.0

    # our load reads the converted checkpoint back (keys mapped, checksums still checked)
    model, optim = build("optim_grads_params", "even", seed=5)
    mfsdp_ckpt.load(stock, model, optim)
    mine = owned_pieces(model, optim)
    for fqn, shape in shapes_of().items():
        for key in (f"model.{fqn}", f"optim.{fqn}.exp_avg"):
            assert torch.equal(mine[key][2].view(shape), _assemble([p["saved"] for p in per_rank], key, shape)), key
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["weight_decay"] == 0.1


def _ours_load_model(path: str) -> dict:
    model, _ = build("optim_grads_params", "even", seed=5)
    mfsdp_ckpt.load(path, model)
    return owned_pieces(model, None)


@pytest.mark.heavy
def test_torchtitan_bare_fqn_checkpoint_reshards_with_key_map(ranks, tmp_path):
    source = make_model("transformer", seed=11)
    stock, ours = str(tmp_path / "titan"), str(tmp_path / "ours")
    dcp.save({n: p.detach() for n, p in source.named_parameters()}, checkpoint_id=stock, no_dist=True)

    res = _cli("reshard", stock, ours, "--world-size", "3", "--key-map", "=model.")
    assert res.returncode == 0, res.stderr
    assert sorted(n for n in os.listdir(ours) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    out = ranks(_ours_load_model, 3, ours, timeout=300)
    for fqn, p in source.named_parameters():
        assert torch.equal(_assemble(out, f"model.{fqn}", p.shape), p.detach()), fqn
    # diff by stored name sees two key sets; with A's bare FQNs mapped, the same tensors
    res = _cli("diff", stock, ours)
    assert res.returncode == 1 and "only in A  " in res.stdout and "only in B  model." in res.stdout
    res = _cli("diff", stock, ours, "--key-map-a", "=model.", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["compared"] == len(list(source.parameters()))

    # load takes the same key map; with strict=False it says what it did not find
    model, optim = build("optim_grads_params", "even", seed=5)
    with pytest.warns(
        UserWarning, match=r"not in the checkpoint: optim\.\*\.exp_avg: 17 keys .*no optimizer state was loaded"
    ):
        mfsdp_ckpt.load(stock, model, optim, require_manifest=False, key_map=["=model."], strict=False)
    mine = owned_pieces(model, optim)
    for fqn, p in source.named_parameters():
        assert torch.equal(mine[f"model.{fqn}"][2].view(p.shape), p.detach()), fqn
    with pytest.raises(mfsdp_ckpt.CheckpointError, match="missing from the checkpoint"):
        mfsdp_ckpt.load(stock, model, optim, require_manifest=False, key_map=["=model."])


def test_bad_key_map_is_one_line_and_writes_nothing(tmp_path):
    stock, ours = str(tmp_path / "stock"), str(tmp_path / "ours")
    dcp.save({"w": torch.ones(5, 3)}, checkpoint_id=stock, no_dist=True)
    res = _cli("reshard", stock, ours, "--world-size", "3", "--key-map", "model.")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "--key-map 'model.'" in res.stderr
    assert not os.path.exists(ours)
    res = _cli("convert", stock, ours, "--to", "torch", "--key-map", "=model.")
    assert res.returncode == 1 and "--key-map" in res.stderr and res.stderr.count("\n") == 1
    assert not os.path.exists(ours)


def _titan_layout_state() -> dict:
    """A small checkpoint in torchtitan's layout (as its CheckpointManager saves one): bare model
    names, AdamW state and per-parameter hyper-parameters, the trainer's entries."""
    source = make_model("transformer", seed=3)
    g = torch.Generator().manual_seed(0)
    state: dict = {n: p.detach().clone() for n, p in source.named_parameters()}
    for n, p in source.named_parameters():
        state[f"optimizer.state.{n}.step"] = torch.tensor(2.0)
        state[f"optimizer.state.{n}.exp_avg"] = torch.randn(p.shape, generator=g)
        state[f"optimizer.param_groups.{n}.lr"] = 1e-2
        state[f"optimizer.param_groups.{n}.betas"] = (0.9, 0.95)
    state.update({"lr_scheduler.last_epoch": 2, "train_state.step": 2, "dataloader.dp_rank_0": b"\x80pos"})
    return state


def test_a_torchtitan_layout_is_read_with_no_flags_and_written_back(tmp_path):
    """torchtitan's layout without torchtitan (tests/titan runs the genuine one): recognised by
    its names, resharded to torchtitan's layout for 3 ranks (FSDP2's rows, one file per rank) and
    read back by stock DCP under the same names, every tensor and object equal."""
    from mfsdp_ckpt.read.mapped import MappedReader
    from mfsdp_ckpt.tools import inspect_checkpoint, reshard

    state, src, dst = _titan_layout_state(), str(tmp_path / "titan"), str(tmp_path / "titan_w3")
    dcp.save(state, checkpoint_id=src, no_dist=True)
    info = inspect_checkpoint(src)
    assert info.format == "torchtitan" and info.step == 2
    assert {t.group for t in info.tensors if t.key.startswith("optimizer.")} == {"optim"}
    with MappedReader(src) as reader:
        assert reader.titan and reader.read("optim.param_groups")[0]["betas"] == (0.9, 0.95)

    result = reshard(src, dst, world_size=3, to="torchtitan")
    assert result.files == 3 and inspect_checkpoint(dst).step == 2
    back = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    dcp.load(back, checkpoint_id=dst, no_dist=True)
    for key, value in state.items():
        assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value, key
    with pytest.raises(mfsdp_ckpt.CheckpointError, match="--policy: does not apply to --to torchtitan"):
        reshard(src, str(tmp_path / "x"), world_size=3, to="torchtitan", policy="row")

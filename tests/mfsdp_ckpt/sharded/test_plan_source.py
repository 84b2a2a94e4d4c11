"""The placement plan is the only source of a layout: change the placement function and the
runtime's buffers, ``describe_shards``, the manifest and offline ``reshard`` all follow it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import mfsdp_ckpt
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_core import (
    ModelPlan,
    Placement,
    compute_layout,
    describe_shards,
    fully_shard,
    fully_shard_optimizer,
    plan_of,
)
from mfsdp_core.fully_shard import buffers_of
from tests.mfsdp_ckpt.util import train_steps
from tests.mfsdp_core.models import make_adamw, make_model

# which parameter is kept whole on one rank; the rest are cut on rows
WHOLE = {"a": "fc1.weight", "b": "fc2.weight"}


def _shard(model, kind: str):
    """fc1, fc2, then the root; each unit's placement function sees names relative to its unit,
    so it is made for that unit's path."""
    for path, unit in (("fc1.", model.fc1), ("fc2.", model.fc2), ("", model)):
        fully_shard(
            unit,
            strategy="optim_grads",
            placement=lambda name, param, path=path: Placement("tensor" if path + name == WHOLE[kind] else "row"),
        )
    return model


def _expected_policy(kind: str, fqn: str) -> str:
    return "tensor" if fqn == WHOLE[kind] else "row"


def _save_with(kind: str, path: str) -> dict:
    model = _shard(make_model("mlp"), kind)
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.save(path, model, optim)
    runtime = {n: str(buf.spec.policy) for buf in buffers_of(model) for n in buf.names}
    layouts_ok = all(
        buf.layout == compute_layout(buf.layout.shapes, dist.get_world_size(), buf.spec.policy)
        for buf in buffers_of(model)
    )
    described = {
        ps.fqn: (
            str(ps.policy),
            ps.owned,
            (ps.layout.piece(ps.index, dist.get_rank()).start, ps.layout.piece(ps.index, dist.get_rank()).end),
        )
        for ps in describe_shards(model, optim)
    }
    return {"runtime": runtime, "layouts_ok": layouts_ok, "described": described, "plan": plan_of(model).to_dict()}


def _files_of(ckpt: str, key: str) -> set[str]:
    with CheckpointReader(ckpt) as reader:
        return {info.relative_path for index, info in reader.metadata.storage_data.items() if index.fqn == key}


@pytest.mark.parametrize("kind", ["a", "b"])
def test_runtime_description_manifest_and_reshard_follow_the_placement_function(ranks, tmp_path, kind):
    path = str(tmp_path / "ckpt")
    per_rank = ranks(_save_with, 3, kind, path, timeout=300)
    for r in per_rank:
        assert r["layouts_ok"]
        assert all(policy == _expected_policy(kind, n) for n, policy in r["runtime"].items()), r["runtime"]
        for fqn, (policy, owned, piece) in r["described"].items():
            assert policy == _expected_policy(kind, fqn) and owned == piece
    whole = WHOLE[kind]
    owners = [rank for rank, r in enumerate(per_rank) if r["described"][whole][1][0] != r["described"][whole][1][1]]
    assert len(owners) == 1  # the whole matrix on one rank
    with CheckpointReader(path) as reader:
        recorded = reader.manifest["writer"]["plan"]
    assert recorded == per_rank[0]["plan"]
    policies = {n: b["policy"] for b in recorded["buffers"] for n in b["params"]}
    assert policies == {n: _expected_policy(kind, n) for n in policies}

    # offline: the target files follow the recorded plan at the new world size
    for world in (2, 5):
        dst = str(tmp_path / f"w{world}")
        reshard(path, dst, world_size=world)
        assert diff_checkpoints(path, dst).equal
        with CheckpointReader(dst) as reader:
            plan = ModelPlan.from_dict(reader.manifest["writer"]["plan"])
        spec, i = plan.params()[whole]
        assert str(spec.policy) == "tensor" and spec.layout.group_size == world
        owner = next(r for r in range(world) if spec.layout.piece(i, r).numel)
        for key in (f"model.{whole}", f"optim.{whole}.exp_avg"):
            assert _files_of(dst, key) == {f"__{owner}_0.distcp"}, key
        cut = next(n for n in policies if policies[n] == "row" and n.endswith("weight") and n != whole and "fc" in n)
        spec, i = plan.params()[cut]
        used = {f"__{r}_0.distcp" for r in range(world) if spec.layout.piece(i, r).numel}
        assert _files_of(dst, f"model.{cut}") == used and len(used) > 1


def _save_pair_placement(path: str) -> str:
    from tests.mfsdp_core.test_placement import PairModel

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    place = lambda name, param: Placement(group="pair" if name.startswith("expert.") else "dp")  # noqa: E731
    model = fully_shard(PairModel(), mesh={"dp": dist.group.WORLD, "pair": pairs[rank // 2]}, placement=place)
    try:
        mfsdp_ckpt.save(path, model)
    except mfsdp_ckpt.CheckpointError as e:
        return str(e)
    return "saved"


def test_save_refuses_instances_that_share_names(ranks, tmp_path):
    """Buffers over a group smaller than the model's hold different values under the same names
    on each instance; a canonical checkpoint would keep one of them: refused on every rank."""
    out = ranks(_save_pair_placement, 4, str(tmp_path / "ckpt"), timeout=300)
    assert len(set(out)) == 1 and "'expert.weight' is placed over group 'pair' (2 of 4 ranks)" in out[0], out
    assert not list(tmp_path.iterdir())

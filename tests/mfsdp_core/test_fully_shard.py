"""fully_shard behaviours beyond parity: meshes, eval forwards, frozen parameters, keeping
parameters gathered between forward and backward; planning its buffers without building them."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_core import (
    count_comm,
    describe_shards,
    fully_shard,
    fully_shard_optimizer,
    plan_model,
    plan_of,
)
from mfsdp_core.fully_shard import buffers_of
from mfsdp_core.models.gpt import PRESETS, GPTModel, shard_units
from tests.mfsdp_core.models import batch, loss_fn, make_adamw, make_model, shard_model


def _train(model, steps: int = 2) -> list[torch.Tensor]:
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(steps):
        x, y = batch(step, world)
        loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        optim.step()
        optim.zero_grad()
    return [ps.main.tensor.clone() for ps in describe_shards(model, optim)]


def _mesh_equals_default_group() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with_mesh = _train(shard_model(make_model("transformer"), mesh=mesh, policy="row"))
    default = _train(shard_model(make_model("transformer"), policy="row"))
    return all(torch.equal(a, b) for a, b in zip(with_mesh, default))


def test_device_mesh_equals_default_group(ranks):
    assert all(ranks(_mesh_equals_default_group, 3, timeout=300))


def _eval_forward_reshards() -> dict:
    model = shard_model(make_model("transformer"), strategy="optim_grads_params")
    x, _ = batch(0, 1)
    with torch.no_grad():
        out = model(x)
    gathered_after_eval = [buf.is_unsharded for buf in buffers_of(model)]
    ref = make_model("transformer")(x)
    return {"equal": torch.equal(out, ref.detach()), "gathered": gathered_after_eval}


def test_eval_forward_under_zero3_frees_gathered_params(ranks):
    for r in ranks(_eval_forward_reshards, 2, timeout=300):
        assert r["equal"] and not any(r["gathered"])


def _frozen_parameters() -> dict:
    model = make_model("transformer")
    model.inp.requires_grad_(False)
    frozen_before = model.inp.weight.detach().clone()
    shard_model(model, strategy="optim_grads")
    optim = fully_shard_optimizer(make_adamw([p for p in model.parameters() if p.requires_grad]))
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = batch(0, world)
    loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    optim.step()
    shards = {ps.fqn: ps for ps in describe_shards(model, optim)}
    return {
        "frozen_grad": shards["inp.weight"].grad,
        "frozen_main_is_weights": shards["inp.weight"].main.tensor.data_ptr()
        == shards["inp.weight"].param.tensor[shards["inp.weight"].main.start :].data_ptr(),
        "frozen_unchanged": torch.equal(model.inp.weight.detach(), frozen_before),
        "trained_changed": not torch.equal(model.out.weight.detach(), make_model("transformer").out.weight),
    }


def test_frozen_parameters_are_not_trained(ranks):
    for r in ranks(_frozen_parameters, 2, timeout=300):
        assert r["frozen_grad"] is None and r["frozen_main_is_weights"]
        assert r["frozen_unchanged"] and r["trained_changed"]


def _keep_gathered_between_forward_and_backward() -> dict:
    model = shard_model(make_model("transformer"), reshard_after_forward=False)
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = batch(0, world)
    with count_comm() as counter:
        loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        optim.step()
    ops = collections.Counter(counter.ops())
    return {
        "ops": ops,
        "buffers": len(buffers_of(model)),
        "resharded": not any(b.is_unsharded for b in buffers_of(model)),
    }


def test_reshard_after_forward_false_gathers_once(ranks):
    for r in ranks(_keep_gathered_between_forward_and_backward, 2, timeout=300):
        assert r["ops"] == {"all_gather": r["buffers"], "reduce_scatter": r["buffers"]}
        assert r["resharded"]  # freed after backward all the same


def _tweak(model) -> None:
    """A frozen weight and a bf16 weight: each gets a flat buffer of its own."""
    model.decoder.layers[0].self_attention.linear_proj.weight.requires_grad_(False)
    model.output_layer.to(torch.bfloat16)


@pytest.mark.parametrize("preset", [*PRESETS, "tiny+frozen+bf16"])
def test_plan_model_on_meta_model_is_what_fully_shard_builds(preset):
    config = PRESETS[preset.split("+")[0]]
    with torch.device("meta"):
        meta = GPTModel(config)
    real = GPTModel(config)
    if "+" in preset:
        _tweak(meta)
        _tweak(real)
    plan = plan_model(meta, shard_units(meta))
    for unit in shard_units(real):
        fully_shard(unit)
    assert plan == plan_of(real)  # every field of every buffer: names, shapes, dtype, placement, ...
    assert [(spec.fqns, spec.is_expert) for spec in plan.buffers] == [
        (buf.names, buf.is_expert) for buf in buffers_of(real)
    ]
    assert [spec.layout for spec in plan.buffers] == [buf.layout for buf in buffers_of(real)]
    names = [n for spec in plan.buffers for n in spec.fqns]
    assert sorted(names) == sorted(n for n, _ in meta.named_parameters())
    if "+" in preset:
        assert any(
            spec.fqns == ["decoder.layers.0.self_attention.linear_proj.weight"] and not spec.is_expert
            for spec in plan.buffers
        )
    if config.num_experts:
        assert any(spec.is_expert for spec in plan.buffers)


def test_plan_model_refuses_a_unit_outside_the_root():
    with pytest.raises(ValueError, match="plan_model: Linear is not a submodule of GPTModel"):
        with torch.device("meta"):
            plan_model(GPTModel(PRESETS["tiny"]), [torch.nn.Linear(2, 2)])


def _seven_units():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8 * (1 + i % 2), bias=False) for i in range(7)])


def _tensor_owners_spread() -> dict:
    import gc

    from mfsdp_core.fully_shard import _WHOLE_TENSOR_BUFFERS

    meta = _seven_units()
    planned = plan_model(meta, [*meta, meta], policy="tensor", group_sizes={"dp": 3})
    built = []
    for _ in range(2):  # a second model, built once the first is gone, is planned the same way
        model = _seven_units()
        for layer in model:
            fully_shard(layer, policy="tensor")
        fully_shard(model, policy="tensor")
        optim = fully_shard_optimizer(make_adamw(model.parameters()))
        owned = sum(hi - lo for ps in describe_shards(model, optim) for lo, hi in [ps.owned])
        built.append((plan_of(model).to_dict(), owned))
        del model, optim, layer
        gc.collect()
    return {
        "same_plan": built[0][0] == built[1][0] == planned.to_dict(),
        "owned": built[0][1],
        "released": len(_WHOLE_TENSOR_BUFFERS) == 0,
    }


def test_tensor_policy_spreads_one_parameter_units_over_the_ranks(ranks):
    results = ranks(_tensor_owners_spread, 3, timeout=300)
    assert [(r["same_plan"], r["released"]) for r in results] == [(True, True)] * 3
    assert [r["owned"] for r in results] == [64 + 128, 128 + 128, 64 + 64 + 64]

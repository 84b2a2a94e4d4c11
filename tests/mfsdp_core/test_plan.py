"""The placement plan as pure data: placements to buffers, layouts, companion layouts, the
optimizer's shapes, and the manifest form. No process group."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mfsdp_core import Companion, ModelPlan, Placement, plan_model
from mfsdp_core.layout import Policy
from mfsdp_core.models.gpt import PRESETS, GPTModel, shard_units
from mfsdp_core.plan import BufferSpec, placement_fn
from tests.mfsdp_core.models import make_model


def _mlp_units(model):
    return [model.fc1, model.fc2, model]


def test_default_placement_reproduces_the_per_dtype_and_expert_split():
    with torch.device("meta"):
        model = GPTModel(PRESETS["tiny-moe"])
    plan = plan_model(model, shard_units(model), group_sizes={"dp": 3})
    assert {b.placement.group for b in plan.buffers} == {"dp"}
    assert {b.group_size for b in plan.buffers} == {3}
    experts = [b for b in plan.buffers if b.is_expert]
    assert experts and all("experts." in n for b in experts for n in b.fqns)
    assert all("experts." not in n for b in plan.buffers if not b.is_expert for n in b.fqns)
    assert all(b.grad_divisor == 3 for b in plan.buffers)


def test_a_placement_function_splits_buffers_and_sets_group_and_divisor():
    model = make_model("mlp")

    def fn(name, param):
        if name.endswith("weight") and param.ndim == 2:
            return Placement(Policy("block", 32), group="pairs", grad_divisor=4)
        return Placement("row")

    plan = plan_model(model, _mlp_units(model), placement=fn, group_sizes={"dp": 4, "pairs": 2})
    by_name = plan.params()
    spec, _ = by_name["fc1.weight"]
    assert spec.placement.group == "pairs" and spec.group_size == 2 and spec.grad_divisor == 4
    assert str(spec.policy) == "block(32)" and spec.layout.group_size == 2
    spec, _ = by_name["fc1.bias"]
    assert spec.placement.group == "dp" and spec.grad_divisor == 4 and str(spec.policy) == "row"
    # fc1's unit holds two buffers (weight over pairs, bias over dp); buffers in module order
    assert [b.fqns for b in plan.buffers] == [
        ["scale", "norm.weight", "norm.bias"],
        ["fc1.weight"],
        ["fc1.bias"],
        ["fc2.weight"],
        ["fc2.bias"],
    ]


def test_bad_placements_are_refused_naming_the_parameter():
    model = make_model("mlp")
    with pytest.raises(ValueError, match="parameter 'fc1.weight': placement names group 'ep'"):
        plan_model(model, _mlp_units(model), placement=lambda n, p: Placement(group="ep" if n == "weight" else "dp"))
    with pytest.raises(ValueError, match="returned str"):
        plan_model(model, _mlp_units(model), placement=lambda n, p: "even")
    with pytest.raises(ValueError, match="either policy or placement"):
        placement_fn(Placement(), "row")
    with pytest.raises(ValueError, match="grad_divisor must be >= 1"):
        Placement(grad_divisor=0)
    comp = Companion("scale", torch.float32, row_divisor=32)
    with pytest.raises(ValueError, match="parameter 'fc1.weight': policy even cuts it inside blocks of 32 rows"):
        plan_model(
            model,
            _mlp_units(model),
            placement=lambda n, p: Placement("even", companions=(comp,) if p.ndim == 2 else ()),
        )


@pytest.mark.parametrize("shape", [(64, 13), (96, 7), (33, 5), (32,)])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_companion_layout_follows_the_rows_each_rank_owns(shape, world):
    """A rank's companion rows are exactly the plane rows of the parameter rows it owns; the
    planes cover every companion element once; 0-element shards included."""
    rows_div = 32 if len(shape) == 2 and shape[0] % 32 == 0 else 1
    comp = Companion("c", torch.uint8, row_divisor=rows_div, col_divisor=4)
    policy = Policy("block", 32) if rows_div == 32 else Policy("row")
    shapes = [torch.Size(shape), torch.Size((3,)), torch.Size((32, 9))]
    spec = BufferSpec(
        names=("a", "b", "c"),
        shapes=tuple(shapes),
        dtype=torch.float32,
        requires_grad=True,
        strategy=_strategy(),
        placement=Placement(policy, companions=(comp,)),
        group_size=world,
    )
    layout, clayout = spec.layout, spec.companion_layouts["c"]
    for i, s in enumerate(shapes):
        cshape = comp.shape(s)
        rows = s[0] if len(s) else 1
        cols = math.prod(s[1:])
        assert tuple(cshape) == (-(-rows // rows_div), -(-cols // 4))
        covered = 0
        for r in range(world):
            pc, cpc = layout.piece(i, r), clayout.piece(i, r)
            if pc.numel == 0:
                assert cpc.numel == 0
                continue
            r0, r1 = pc.start // cols, pc.end // cols
            assert cpc.start == -(-r0 // rows_div) * cshape[1] and cpc.end == -(-r1 // rows_div) * cshape[1]
            covered += cpc.numel
        assert covered == math.prod(cshape)


def _strategy():
    from mfsdp_core import Strategy

    return Strategy.OPTIM_GRADS_PARAMS


def test_tensor_policy_shows_the_optimizer_whole_shapes():
    model = make_model("transformer")
    units = [model.block, model]
    flat = plan_model(model, units, policy="row", group_sizes={"dp": 3})
    whole = plan_model(model, units, policy="tensor", group_sizes={"dp": 3})
    for spec in flat.buffers:
        for i in range(len(spec.names)):
            assert all(len(spec.owned_shape(i, r)) == 1 for r in range(3))
    for spec in whole.buffers:
        for i, shape in enumerate(spec.shapes):
            shapes = [spec.owned_shape(i, r) for r in range(3)]
            assert shapes.count(shape) == 1  # one owner sees the whole matrix
            assert all(s == shape or (s[0] == 0 and s[1:] == shape[1:]) for s in shapes)


def test_plan_round_trips_through_the_manifest_form():
    with torch.device("meta"):
        model = GPTModel(PRESETS["tiny-moe"])
    comp = Companion("rowwise_scale", torch.float8_e8m0fnu, row_divisor=1, col_divisor=32)

    def fn(name, param):
        if param.ndim == 2 and param.shape[0] % 32 == 0:
            return Placement("block(32)", companions=(comp,), expert="experts." in name)
        return Placement("even", expert="experts." in name)

    plan = plan_model(model, shard_units(model), placement=fn, group_sizes={"dp": 4})
    text = plan.to_dict()
    assert ModelPlan.from_dict(text) == plan
    layer0 = [b for b in text["buffers"] if b["unit"] == "decoder.layers.0"]
    assert layer0 and all(n.startswith("decoder.layers.0.") for b in layer0 for n in b["params"])
    with_planes = [b for b in text["buffers"] if b["companions"]]
    assert with_planes and all(b["policy"] == "block(32)" for b in with_planes)
    assert with_planes[0]["companions"] == [
        {"name": "rowwise_scale", "dtype": "float8_e8m0fnu", "row_divisor": 1, "col_divisor": 32}
    ]
    # another layout of the same plan: only sizes (and asked strategy / policy) change
    resized = [b.resized(3) for b in plan.buffers]
    assert all(b.layout.group_size == 3 and b.fqns == a.fqns for a, b in zip(plan.buffers, resized))


def test_frozen_and_bf16_parameters_get_buffers_of_their_own():
    model = make_model("mlp")
    model.fc1.weight.requires_grad_(False)
    model.fc2.to(torch.bfloat16)
    plan = plan_model(model, _mlp_units(model))
    kinds = {(tuple(b.fqns), b.dtype, b.requires_grad) for b in plan.buffers}
    assert (("fc1.weight",), torch.float32, False) in kinds
    assert (("fc2.weight", "fc2.bias"), torch.bfloat16, True) in kinds


def test_a_module_outside_the_root_is_refused():
    with pytest.raises(ValueError, match="plan_model: Linear is not a submodule of MLP"):
        plan_model(make_model("mlp"), [nn.Linear(2, 2)])


def test_tensor_policy_spreads_one_parameter_units_over_the_ranks():
    model = nn.Sequential(*[nn.Linear(8, 8 * (1 + i % 2), bias=False) for i in range(7)])  # 7 units, 3 ranks
    plan = plan_model(model, [*model, model], policy="tensor", group_sizes={"dp": 3})
    specs = [spec for spec in plan.buffers if spec.names]
    owners = [next(r for r in range(3) if spec.layout.piece(0, r).numel) for spec in specs]
    assert owners == [0, 1, 2, 0, 2, 1, 2]  # each unit goes to the rank owning the fewest elements so far
    owned = [sum(spec.layout.piece(0, r).numel for spec in specs) for r in range(3)]
    assert owned == [64 + 128, 128 + 128, 64 + 64 + 64]
    assert ModelPlan.from_dict(plan.to_dict()) == plan
    old = plan.to_dict()  # a manifest written before ``first_rank`` existed: every buffer starts at rank 0
    for b in old["buffers"]:
        b.pop("first_rank", None)
    assert {b.first_rank for b in ModelPlan.from_dict(old).buffers} == {0}
    # flat policies and unsharded buffers are not affected
    assert {b.first_rank for b in plan_model(model, [*model, model], policy="row", group_sizes={"dp": 3}).buffers} == {
        0
    }
    assert {b.first_rank for b in plan_model(model, [*model, model], policy="tensor").buffers} == {0}

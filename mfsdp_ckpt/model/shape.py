"""The shape of the transformer a checkpoint holds, as the bridges (``hf``, ``mcore``) need it:
read from the manifest's ``model_config``, which every save of a model with canonical tensor
names writes next to its ``model_source`` (the reference GPT's config, or the one describing a
Megatron-Core model's tensors), and the transformer of that shape built on the meta device (its
parameter shapes, its sharding units).

Every checkpoint of canonical tensor names (ours, MCore's) describes its transformer with the
fields of the reference model's config, so the shape *is* that config: this is the one module
above the runtime that imports it; the rest of ``mfsdp_ckpt`` says :data:`ModelShape`."""

from __future__ import annotations

from typing import Any

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_core import ModelPlan, plan_model
from mfsdp_core.models.gpt import GPTConfig, GPTModel, shard_units

__all__ = [
    "ModelShape",
    "ShapeModel",
    "recorded_shape",
    "meta_model",
    "default_plan",
    "sharding_units",
]

ModelShape = GPTConfig  # the fields every canonical-named transformer is described by
ShapeModel = GPTModel  # the transformer of a shape, with our canonical parameter names


def recorded_shape(manifest: dict[str, Any] | None, source: str, purpose: str) -> ModelShape:
    """The model shape a checkpoint's manifest records (``model_config``), refused, naming
    ``source`` and ``purpose`` (e.g. ``export``), when it records none."""
    config = (manifest or {}).get("model_config")
    if not config:
        raise ConversionError(f"{source}: the manifest has no model_config ({purpose} needs the model's shape)")
    try:
        return ModelShape.from_dict(config)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}: model_config in the manifest is not ours: {e}") from None


class _NoMetaInit(torch.overrides.TorchFunctionMode):
    """Skips the random initialisation of meta tensors (they hold no values): the first such call
    imports ``torch._dynamo`` (torch's meta random ops are Python references behind a
    dynamo-disabling wrapper), which cost an HF export or import about 0.6 s of its start."""

    RANDOM_INITS = frozenset(
        (
            "normal_",
            "uniform_",
            "trunc_normal_",
            "kaiming_uniform_",
            "kaiming_normal_",
            "xavier_uniform_",
            "xavier_normal_",
        )
    )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.RANDOM_INITS:
            target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def meta_model(shape: ModelShape) -> ShapeModel:
    """The transformer of ``shape`` on the meta device (shapes, no memory; no initialisation is
    run: :class:`_NoMetaInit`). Building one costs milliseconds per layer, so a caller that needs
    it twice builds it once and passes it on."""
    with torch.device("meta"), _NoMetaInit():
        return ShapeModel(shape)


def default_plan(shape: ModelShape, model: ShapeModel | None = None) -> ModelPlan:
    """The placement plan of a checkpoint an import writes for ``shape``: the model's sharding
    units with ``fully_shard``'s default placement, on one rank, computed by the runtime's own
    planner on a meta-device model (``model``, if already built). Recorded in the manifest, it is
    what ``reshard`` lays the checkpoint out from."""
    model = model or meta_model(shape)
    return plan_model(model, shard_units(model))


def sharding_units(model: ShapeModel) -> list[torch.nn.Module]:
    """The modules a model of a shape is ``fully_shard``-ed by, in order (its layers, then the root)."""
    return shard_units(model)

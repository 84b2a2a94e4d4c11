"""The shape of the transformer a checkpoint holds, as the bridges (``hf``, ``mcore``) and the
tools need it: read from the manifest's recorded model source (``mfsdp-gpt``'s ``config``, or
the ``model_config`` that describes a Megatron-Core model's canonical tensors), and the
transformer of that shape built on the meta device (its parameter shapes, its sharding units).

Every checkpoint of canonical tensor names (ours, MCore's) describes its transformer with the
fields of the reference model's config, so the shape *is* that config: this is the one module
above the runtime that imports it; the rest of ``mfsdp_ckpt`` says :data:`ModelShape`."""

from __future__ import annotations

from typing import Any

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.model_source import MEGATRON_CORE, MFSDP_GPT, TRANSFORMERS, model_source_of
from mfsdp_core import ModelPlan, plan_model
from mfsdp_core.models.gpt import GPTConfig, GPTModel, shard_units

__all__ = [
    "ModelShape",
    "ShapeModel",
    "shape_from_dict",
    "recorded_shape",
    "meta_model",
    "default_plan",
    "sharding_units",
]

ModelShape = GPTConfig  # the fields every canonical-named transformer is described by
ShapeModel = GPTModel  # the transformer of a shape, with our canonical parameter names


def shape_from_dict(record: dict[str, Any], source: str) -> ModelShape:
    """The shape a manifest's ``model_config`` dict describes; ``source`` names it in the error."""
    try:
        return ModelShape.from_dict(record)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}: model_config in the manifest is not ours: {e}") from None


def recorded_shape(manifest: dict[str, Any] | None, source: str, purpose: str) -> ModelShape:
    """The shape of the model a checkpoint's manifest records (its model source, or an older
    manifest's ``model_config``). Refused, naming ``source`` and ``purpose`` (e.g. ``export``),
    for a ``transformers`` model (named as transformers names it, not canonically) and for a
    manifest that records no shape."""
    record = model_source_of(manifest)
    if record is not None and record.get("kind") == TRANSFORMERS:
        raise ConversionError(
            f"{source}: holds a transformers model ({record.get('class')}), named as transformers names "
            f"it; {purpose} needs a model of our canonical names"
        )
    config = (manifest or {}).get("model_config")
    if not config and record is not None and record.get("kind") in (MFSDP_GPT, MEGATRON_CORE):
        config = record.get("config")
    if not config:
        raise ConversionError(f"{source}: the manifest has no model_config ({purpose} needs the model's shape)")
    return shape_from_dict(config, source)


def meta_model(shape: ModelShape) -> ShapeModel:
    """The transformer of ``shape`` on the meta device (shapes, no memory). Building one costs
    milliseconds per layer, so a caller that needs it twice builds it once and passes it on."""
    with torch.device("meta"):
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

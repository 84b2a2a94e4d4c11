"""What a checkpoint's weights belong to: the manifest's ``model_source`` record.

Three kinds of model are first-class, each recorded with what rebuilds it:

- ``mfsdp-gpt``: the project's reference ``GPTModel``; ``config`` is its ``GPTConfig``.
- ``megatron-core``: a genuine Megatron-Core ``GPTModel``; ``args`` are the MCore arguments it
  was built from, ``layer_spec`` the spec (``local`` or ``transformer_engine``). Its tensors carry
  our canonical names (the ones MCore's own checkpoints use per layer), so the manifest's
  ``model_config`` describes them as well and every tool that reads a ``GPTConfig`` works.
- ``transformers``: a Hugging Face model; ``class`` is its class name, ``config`` its
  ``config.json``; tensors are named as the model's ``named_parameters()`` names them.

Manifests written before the record existed say only ``model_config`` (ours): they read as
``mfsdp-gpt``. Tools ask :func:`model_source_of` instead of reading fields themselves.
"""

from __future__ import annotations

import json
from typing import Any

from mfsdp_ckpt.format.lora import lora_of_record

__all__ = [
    "MFSDP_GPT",
    "MEGATRON_CORE",
    "TRANSFORMERS",
    "KINDS",
    "gpt_source",
    "transformers_source",
    "model_source_of",
    "describe_source",
]

MFSDP_GPT = "mfsdp-gpt"
MEGATRON_CORE = "megatron-core"
TRANSFORMERS = "transformers"
KINDS = (MFSDP_GPT, MEGATRON_CORE, TRANSFORMERS)


def gpt_source(config: dict[str, Any]) -> dict[str, Any]:
    """The record of a reference ``GPTModel`` with this ``GPTConfig.to_dict()``."""
    return {"kind": MFSDP_GPT, "config": config}


def transformers_source(model: Any) -> dict[str, Any] | None:
    """The record of a ``transformers`` model (a class of the ``transformers`` package with a
    ``config`` naming its ``model_type``), else None. Recognised without importing transformers,
    so that ``save`` records what it can of any model it is given."""
    config = getattr(model, "config", None)
    if not type(model).__module__.startswith("transformers.") or not isinstance(
        getattr(config, "model_type", None), str
    ):
        return None
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    record = json.loads(to_json(use_diff=False))
    record["architectures"] = [type(model).__name__]
    return {"kind": TRANSFORMERS, "class": type(model).__name__, "config": record}


def model_source_of(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model source a manifest records (an older one's ``model_config`` as ``mfsdp-gpt``), or
    None when it says nothing about the model."""
    if not manifest:
        return None
    record = manifest.get("model_source")
    if isinstance(record, dict):
        return record
    config = manifest.get("model_config")
    return gpt_source(config) if isinstance(config, dict) else None


def describe_source(record: dict[str, Any] | None) -> str:
    """One line for people: the kind, and the class or the shape."""
    if record is None:
        return "unknown"
    kind = record.get("kind")
    if kind == TRANSFORMERS:
        config = record.get("config") or {}
        shape = _shape(
            config.get("num_hidden_layers"),
            config.get("hidden_size"),
            config.get("num_local_experts") or config.get("num_experts"),
        )
        return f"transformers {record.get('class')} ({config.get('model_type')}{shape}){_adapters(record)}"
    if kind == MEGATRON_CORE:
        args = record.get("args") or {}
        shape = _shape(
            args.get("num_layers"), args.get("hidden_size"), args.get("num_experts") or args.get("num_moe_experts")
        )
        return f"megatron-core GPTModel ({record.get('layer_spec', 'local')} spec{shape})"
    config = record.get("config") or {}
    shape = _shape(config.get("num_layers"), config.get("hidden_size"), config.get("num_experts"))
    return f"{kind} GPTModel ({shape.lstrip(', ')})" if shape else str(kind)


def _adapters(record: dict[str, Any]) -> str:
    """``, LoRA r=...`` when the record names LoRA adapters (``--lora``), else nothing."""
    if record.get("lora") is None:
        return ""
    try:
        return f", LoRA {lora_of_record(record, 'model_source')}"
    except ValueError:
        return ", LoRA (model_source.lora does not parse)"


def _shape(layers: Any, hidden: Any, experts: Any) -> str:
    parts = [
        f"{layers} layers" if layers else "",
        f"hidden {hidden}" if hidden else "",
        f"{experts} experts" if experts else "",
    ]
    return "".join(f", {p}" for p in parts if p)

"""What ``mfsdp-ckpt inspect`` shows of a Megatron-Core checkpoint: its format, iteration and,
where the shapes and any recorded arguments tell it, its model shape."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.mcore.import_ import plan_import
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.read.locate import is_mcore

__all__ = ["describe_mcore"]


def describe_mcore(directory: str) -> dict[str, Any] | None:
    """``{"format", "step", "model_config", "unknown"}`` for an MCore checkpoint directory; None
    for anything else. A config that cannot be inferred (no head count anywhere) is reported
    as unknown with the reason, not raised: inspecting needs no config."""
    if not is_mcore(directory):
        return None
    with McoreSource.open(directory) as source:
        backend = f"megatron-core {source.backend.get('sharded_backend')}"
        step = source.common.get("iteration")
        out: dict[str, Any] = {
            "format": backend,
            "step": step if type(step) is int else None,
            "model_config": None,
            "unknown": [],
        }
        try:
            plan = plan_import(source)
            out["model_config"] = plan.config.to_dict()
            if plan.assumed:
                out["unknown"].append("assumed MCore defaults: " + ", ".join(plan.assumed))
        except CheckpointError as e:
            out["unknown"].append(f"model config ({e})")
    return out

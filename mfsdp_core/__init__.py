"""mfsdp_core: the sharding runtime (placement plans, layouts, flat buffers, ``fully_shard``,
optimizer adapter). It never imports the checkpoint layer.

The public names are imported on first use (PEP 562): each of them imports torch (~1.7 s), which
what only parses a name or a config (``mfsdp_core.strategy``, ``mfsdp_core.policy``,
``mfsdp_core.models.config``: the launcher's pre-flight, a manifest's schema) does not need."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: public name -> the module that defines it
_HOMES = {
    "count_comm": "collectives",
    "Companion": "companion",
    "fully_shard": "fully_shard",
    "plan_of": "fully_shard",
    "rename_params": "fully_shard",
    "set_comm_stream": "fully_shard",
    "set_overlap": "fully_shard",
    "Layout": "layout",
    "compute_layout": "layout",
    "Policy": "policy",
    "parse_policy": "policy",
    "MixedPrecision": "mixed_precision",
    "clip_grad_norm_": "optim",
    "fully_shard_optimizer": "optim",
    "BufferSpec": "plan",
    "ModelPlan": "plan",
    "Placement": "plan",
    "plan_model": "plan",
    "FlatShard": "shards",
    "ParamShard": "shards",
    "describe_shards": "shards",
    "refresh_compute_params": "shards",
    "Strategy": "strategy",
    "parse_strategy": "strategy",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept as a module attribute."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, whose ``fully_shard`` is the function (as ``__all__`` says), not the submodule of
    that name: importing a submodule sets it as the package's attribute, so the function of the
    submodule's name is kept instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "fully_shard" and isinstance(value, types.ModuleType):
            value = value.fully_shard
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

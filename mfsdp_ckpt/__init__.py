"""mfsdp_ckpt: canonical DCP checkpoints of ``fully_shard``-ed models (docs/checkpoint.md).

``save`` / ``async_save`` / ``load`` are collective over the model's ranks; a checkpoint written at any layout
(world size, strategy, policy) loads into any other. It reads the runtime only through
``mfsdp_core.describe_shards`` (docs/shard_description.md)."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    NotACheckpointError,
    RunLockedError,
    StateMismatchError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME
from mfsdp_ckpt.read.resolve import resolve_checkpoint
from mfsdp_ckpt.storage.lock import run_lock

__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "load",
    "load_with_state_dict_hooks",
    "resolve_checkpoint",
    "LATEST_NAME",
    "LATEST_LINK_NAME",
    "run_lock",
    "RunLockedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "StateMismatchError",
    "UncommittedCheckpointError",
    "UnsafeCheckpointError",
]

#: the public names imported on first use (PEP 562): they import ``torch.distributed.checkpoint``,
#: DTensor and sympy (~0.5 s), which what reads a manifest or resolves a path (the launcher's
#: pre-flight, the offline tools' start) does not need
_SHARDED = ("save", "async_save", "AsyncSaveHandle", "load", "load_with_state_dict_hooks")


def _sharded() -> dict[str, Any]:
    """The collective save and load entry points, imported now."""
    from mfsdp_ckpt.sharded.async_save import AsyncSaveHandle, async_save
    from mfsdp_ckpt.sharded.hooked import load_with_state_dict_hooks
    from mfsdp_ckpt.sharded.load import load
    from mfsdp_ckpt.sharded.save import save

    found = {"save": save, "async_save": async_save, "AsyncSaveHandle": AsyncSaveHandle, "load": load}
    return {**found, "load_with_state_dict_hooks": load_with_state_dict_hooks}


def __getattr__(name: str) -> Any:
    """``mfsdp_ckpt.save`` and the others of :data:`_SHARDED`, imported on first use and then kept
    as module attributes (so this runs once)."""
    if name not in _SHARDED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = _sharded()
    globals().update(found)
    return found[name]


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))

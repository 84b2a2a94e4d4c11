"""mfsdp_ckpt: canonical DCP checkpoints of ``fully_shard``-ed models (docs/checkpoint.md).

``save`` / ``async_save`` / ``load`` are collective over the model's ranks; a checkpoint written at any layout
(world size, strategy, policy) loads into any other. It reads the runtime only through
``mfsdp_core.describe_shards`` (docs/shard_description.md)."""

from mfsdp_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    NotACheckpointError,
    StateMismatchError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from mfsdp_ckpt.format.names import LATEST_LINK_NAME, LATEST_NAME
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.sharded.async_save import AsyncSaveHandle, async_save
from mfsdp_ckpt.sharded.load import load
from mfsdp_ckpt.sharded.save import save
from mfsdp_ckpt.storage.lock import RunLockedError, run_lock

__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "load",
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

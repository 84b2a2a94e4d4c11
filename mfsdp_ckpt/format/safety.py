"""Never run code from a checkpoint. Stock DCP's ``.metadata`` is a pickle; we read it with an
unpickler that admits only DCP's metadata classes (and the plain-data save-plan classes that
Megatron-Core's writer leaves in it), torch dtypes / sizes / layouts and plain containers.
Anything else is refused before it is called."""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

from mfsdp_ckpt.errors import UnsafeCheckpointError, one_line

__all__ = ["safe_load_metadata"]

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core's torch_dist writer caches its DCP save plans in .metadata (all_local_plans):
    # dataclasses and an Enum of plain values, nothing that runs code when rebuilt
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        import torch  # here, not at the top: importing the format imports no torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to load '{module}.{name}' (only DCP metadata classes are admitted)"
        )


def safe_load_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes read from ``source`` (named in errors) with the allow-list."""
    try:
        return _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle raises anything
        raise UnsafeCheckpointError(f"{source}: unreadable metadata ({type(e).__name__}: {one_line(e, 200)})") from None

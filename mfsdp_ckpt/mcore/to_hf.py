"""``export-hf`` of a Megatron-Core checkpoint: imported into a hidden temporary canonical
checkpoint next to the output (streaming, as ``import-mcore``), exported from it, and removed.
The disk holds the weights once more while it runs; memory stays that of the two steps."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.export import export
from mfsdp_ckpt.mcore.import_ import import_mcore
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.destination import destination_for

__all__ = ["export_hf_from_mcore"]


def export_hf_from_mcore(src: str | os.PathLike, out: str | os.PathLike, config: Any = None, **kwargs: Any) -> Any:
    """:func:`mfsdp_ckpt.hf.export` of the MCore checkpoint ``src`` (``config``: MCore's
    arguments, as for :func:`~mfsdp_ckpt.mcore.import_mcore`; ``kwargs``: the export's)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConversionError(
            f"{os.fspath(src)}: exporting a Megatron-Core checkpoint runs in one process "
            "(import-mcore it first for a collective export)"
        )
    tmp = destination_for(os.path.abspath(os.fspath(out))).scratch_path("mcore")
    try:
        import_mcore(src, tmp, config=config)
        return export(tmp, out, **kwargs)
    finally:
        fs.remove_tree(tmp)

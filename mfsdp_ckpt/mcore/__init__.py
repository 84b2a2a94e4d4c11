"""Megatron-Core ``torch_dist`` checkpoints ⇄ canonical checkpoints (docs/mcore.md).

- :func:`import_mcore`: an MCore checkpoint → a committed canonical checkpoint (streaming, one
  stacked slice at a time);
- :func:`export_mcore`: a canonical checkpoint → an MCore ``torch_dist`` checkpoint that
  ``megatron.core.dist_checkpointing.load`` reads (0.16 layout: ``common.pt``);
- :func:`export_hf_from_mcore`: an MCore checkpoint → a Hugging Face model directory (imported
  first, in one process);

Whether a directory is an MCore checkpoint: :func:`mfsdp_ckpt.read.locate.is_mcore`.

Modules: ``layout`` (key names, pure), ``config`` (our config from shapes and MCore arguments),
``source`` (reading: backend, common state, slices), ``import_``, ``export``.

The public names are imported on first use (PEP 562): they import ``torch.distributed.checkpoint``
(~0.5 s), which reading an MCore config (the launcher's pre-flight of ``--mcore-config``) does not need.
"""

from __future__ import annotations

from typing import Any

__all__ = ["import_mcore", "export_mcore", "export_hf_from_mcore", "McoreImportResult", "McoreExportResult"]


def _public() -> dict[str, Any]:
    """The public names, imported now."""
    from mfsdp_ckpt.mcore.export import McoreExportResult, export_mcore
    from mfsdp_ckpt.mcore.import_ import McoreImportResult, import_mcore
    from mfsdp_ckpt.mcore.to_hf import export_hf_from_mcore

    return {
        "import_mcore": import_mcore,
        "export_mcore": export_mcore,
        "export_hf_from_mcore": export_hf_from_mcore,
        "McoreImportResult": McoreImportResult,
        "McoreExportResult": McoreExportResult,
    }


def __getattr__(name: str) -> Any:
    """A public name of :data:`__all__`, imported on first use and then kept as an attribute."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = _public()
    globals().update(found)
    return found[name]


def __dir__() -> list[str]:
    """The package's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))

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
"""

from mfsdp_ckpt.mcore.export import McoreExportResult, export_mcore
from mfsdp_ckpt.mcore.import_ import McoreImportResult, import_mcore
from mfsdp_ckpt.mcore.to_hf import export_hf_from_mcore

__all__ = ["import_mcore", "export_mcore", "export_hf_from_mcore", "McoreImportResult", "McoreExportResult"]

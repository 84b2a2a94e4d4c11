"""The Hugging Face bridge: canonical checkpoints ⇄ HF model directories (safetensors shards,
index, ``config.json``), streaming one tensor at a time, for the architectures in
:mod:`mfsdp_ckpt.hf.archs` (one module each: ``llama``, ``qwen2``, ``qwen3``, ``mixtral``,
``qwen3_moe``). See docs/hf.md.

``export`` reads any canonical checkpoint (and may run on all ranks of a training job, each
writing its own shard files); ``import_`` writes a committed checkpoint that ``mfsdp_ckpt.load``
and ``python -m cli.train --init-from`` read at any world size. ``transformers`` is not
needed for either."""

from mfsdp_ckpt.hf.export import ExportResult, export
from mfsdp_ckpt.hf.import_ import ImportResult, import_
from mfsdp_ckpt.hf.mapping import Architecture, Direct, FusedQKV, GatedMLP, Rule
from mfsdp_ckpt.hf.registry import architectures, get_architecture, register

__all__ = [
    "export",
    "import_",
    "ExportResult",
    "ImportResult",
    "architectures",
    "get_architecture",
    "register",
    "Architecture",
    "Rule",
    "Direct",
    "FusedQKV",
    "GatedMLP",
]

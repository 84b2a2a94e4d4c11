"""The Hugging Face bridge: canonical checkpoints ⇄ HF model directories (safetensors shards,
index, ``config.json``), streaming one tensor at a time, for the architectures in
:mod:`mfsdp_ckpt.hf.archs` (one module each: ``llama``, ``qwen2``, ``qwen3``, ``mixtral``,
``qwen3_moe``). See docs/hf.md.

``export`` reads any canonical checkpoint (and may run on all ranks of a training job, each
writing its own shard files; a LoRA run's exports merged), ``export_adapter`` a LoRA run's
adapters in PEFT's format; ``import_`` writes a committed checkpoint that ``mfsdp_ckpt.load``
and ``python -m cli.train --init-from`` read at any world size. ``transformers`` is not
needed for either. Those two are imported on first use (PEP 562): they import
``torch.distributed.checkpoint`` (~0.5 s), which what only maps names or reads a ``config.json`` (the
launcher's pre-flight of a model) does not need."""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = [
    "export",
    "export_adapter",
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

_LAZY = ("export", "export_adapter", "import_", "ExportResult", "ImportResult")
#: the mapping's names, imported on first use too: they import torch, which checking a
#: ``config.json`` (:mod:`mfsdp_ckpt.hf.config_check`, the launcher's pre-flight) does not need
_MAPPING = {"Architecture", "Direct", "FusedQKV", "GatedMLP", "Rule"}
_REGISTRY = {"architectures", "get_architecture", "register"}


def _load(name: str) -> Any:
    """The lazily imported public name ``name`` of :data:`_LAZY`, :data:`_MAPPING` or :data:`_REGISTRY`."""
    if name in _MAPPING:
        from mfsdp_ckpt.hf import mapping

        return getattr(mapping, name)
    if name in _REGISTRY:
        from mfsdp_ckpt.hf import registry

        return getattr(registry, name)
    if name == "export_adapter":
        from mfsdp_ckpt.hf.adapter import export_adapter

        return export_adapter
    if name in ("export", "ExportResult"):
        from mfsdp_ckpt.hf.export import ExportResult, export

        return {"export": export, "ExportResult": ExportResult}[name]
    from mfsdp_ckpt.hf.import_ import ImportResult, import_

    return {"import_": import_, "ImportResult": ImportResult}[name]


def __getattr__(name: str) -> Any:
    """``export``, ``import_``, their result types and the mapping's names, imported on first use."""
    if name not in _LAZY and name not in _MAPPING and name not in _REGISTRY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The package's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, whose ``export`` and ``import_`` are the functions (as ``__all__`` says), not the
    submodules of those names: importing a submodule sets it as the package's attribute, so the
    function of the submodule's name is kept instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("export", "import_") and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

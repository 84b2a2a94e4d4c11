"""Which architectures the bridge knows, found by importing every module of
:mod:`mfsdp_ckpt.hf.archs` (so adding one is adding one file), and which one fits a given HF
config or model config."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf import archs
from mfsdp_ckpt.hf.config import hf_classes_of, model_type_of
from mfsdp_ckpt.hf.files import short_repr
from mfsdp_ckpt.hf.mapping import Architecture
from mfsdp_ckpt.model.shape import ModelShape

__all__ = ["architectures", "get_architecture", "architecture_of_hf_config", "infer_architecture", "register"]

_REGISTRY: dict[str, Architecture] = {}
_DISCOVERED = False


def register(arch: Architecture) -> Architecture:
    """Add ``arch`` (e.g. one defined outside this package); returns it."""
    _REGISTRY[arch.name] = arch
    return arch


def architectures() -> dict[str, Architecture]:
    """Every known architecture by name, in discovery order (module name order)."""
    global _DISCOVERED
    if not _DISCOVERED:
        for info in sorted(pkgutil.iter_modules(archs.__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{archs.__name__}.{info.name}")
            arch = getattr(module, "ARCH", None)
            if isinstance(arch, Architecture):
                _REGISTRY.setdefault(arch.name, arch)
        _DISCOVERED = True
    return _REGISTRY


def get_architecture(name: str) -> Architecture:
    known = architectures()
    if name not in known:
        raise ConversionError(f"unknown architecture {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


def architecture_of_hf_config(d: dict[str, Any], source: str) -> Architecture:
    """The architecture of an HF ``config.json`` dict, by its ``model_type`` (or, failing that,
    its ``architectures`` class name). Both must have their JSON types (a string, a list of
    strings), else one line names the field."""
    known = architectures()
    model_type = model_type_of(d, source)
    classes = hf_classes_of(d, source)
    for arch in known.values():
        if arch.model_type == model_type:
            return arch
    for cls in classes:
        for arch in known.values():
            if arch.hf_class == cls:
                return arch
    raise ConversionError(
        f"{source}: unknown architecture (model_type={model_type!r}, architectures={short_repr(d.get('architectures'))}); "
        f"known: {', '.join(sorted(known))}"
    )


def infer_architecture(c: ModelShape, manifest: dict[str, Any] | None, source: str) -> Architecture:
    """The architecture a checkpoint was imported from (recorded in its manifest), else the one
    architecture that can express ``c``."""
    recorded = ((manifest or {}).get("hf") or {}).get("architecture")
    if recorded in architectures():
        return architectures()[recorded]
    fits = [arch for arch in architectures().values() if not arch.unsupported(c)]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        why = "; ".join(f"{a.name}: {', '.join(a.unsupported(c))}" for a in architectures().values())
        raise ConversionError(f"{source}: no known architecture can express this model config ({why})")
    raise ConversionError(
        f"{source}: several architectures fit ({', '.join(a.name for a in fits)}); choose one with --arch"
    )

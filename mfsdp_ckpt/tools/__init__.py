"""The offline tools over every format: ``inspect`` and ``verify`` (``inspect``), ``diff``,
``convert`` (single-file formats), ``ls`` (``listing``) and ``upcycle`` (a dense checkpoint as an
MoE one whose experts copy its MLP). The top layer: above the bridges, whose formats they read too.

This package is their public face (what ``mfsdp-ckpt`` imports): the functions below, with
``reshard`` and what the commands check their paths with. Each is imported on first use (PEP 562)
and looked up anew each time (nothing cached here, so a test that replaces a function in its
module is seen): importing this package imports no torch, and ``mfsdp-ckpt --help`` stays fast.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = [
    "inspect_checkpoint",
    "verify_checkpoint",
    "compact_ranges",
    "GROUPS",
    "diff_checkpoints",
    "convert",
    "upcycle",
    "UpcycleSpec",
    "check_upcycle_spec",
    "reshard",
    "list_runs",
    "list_checkpoints",
    "clean_run_dir",
    "list_snapshots",
    "inspect_html",
    "diff_html",
    "check_report_out",
    "find_browser",
    "screenshot",
    "describe_source",
    "normalize",
    "overlap",
    "check_apart",
    "is_mcore",
]

#: the functions named like the submodule that holds them (see :class:`_Package`)
_SAME_NAME = ("convert", "upcycle")


def _module_of(name: str) -> types.ModuleType:
    """The module that defines the public name ``name``, imported now."""
    if name in ("inspect_checkpoint", "verify_checkpoint", "compact_ranges", "GROUPS"):
        from mfsdp_ckpt.tools import inspect as module
    elif name == "diff_checkpoints":
        from mfsdp_ckpt.tools import diff as module
    elif name in ("list_runs", "list_checkpoints", "clean_run_dir"):
        from mfsdp_ckpt.tools import listing as module
    elif name == "list_snapshots":  # a run's memory-tier snapshots
        from mfsdp_ckpt.tier import layout as module
    elif name in ("UpcycleSpec", "check_upcycle_spec"):
        from mfsdp_ckpt.tools import upcycle_spec as module
    elif name == "reshard":
        from mfsdp_ckpt.sharded import reshard as module
    elif name in ("inspect_html", "diff_html", "check_report_out", "find_browser", "screenshot"):
        module = _report_module(name)
    elif name == "describe_source":
        from mfsdp_ckpt.format import model_source as module
    elif name == "normalize":
        from mfsdp_ckpt.storage import fs as module
    elif name in ("overlap", "check_apart"):
        from mfsdp_ckpt.storage import overlap as module
    else:  # is_mcore
        from mfsdp_ckpt.read import resolve as module
    return module


def _report_module(name: str) -> types.ModuleType:
    """The module of ``report/`` that defines ``name``, imported now."""
    if name == "inspect_html":
        from mfsdp_ckpt.tools.report import inspect_page as module
    elif name == "diff_html":
        from mfsdp_ckpt.tools.report import diff_page as module
    elif name == "check_report_out":
        from mfsdp_ckpt.tools.report import output as module
    else:
        from mfsdp_ckpt.tools.report import browser as module
    return module


def __getattr__(name: str) -> Any:
    """A public name of :data:`__all__`, from its module now (not kept: see the module docstring)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _SAME_NAME:
        import mfsdp_ckpt.tools.convert  # each sets its function here (_Package)
        import mfsdp_ckpt.tools.upcycle  # noqa: F401 - as convert

        return sys.modules[__name__].__dict__[name]
    return getattr(_module_of(name), name)


def __dir__() -> list[str]:
    """The package's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package, whose ``convert`` and ``upcycle`` are the functions (as ``__all__`` says), not
    the submodules of those names: importing a submodule sets it as the package's attribute, so
    the function of the submodule's name is kept instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SAME_NAME and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

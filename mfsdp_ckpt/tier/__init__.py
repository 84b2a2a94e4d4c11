"""The memory tier: checkpoints of a run kept in each node's memory (a tmpfs directory),
replicated to peer nodes, and recovered from whichever copies survive a failure
(docs/checkpoint.md, "Memory tier").

The layout (:mod:`mfsdp_ckpt.tier.layout`: where a run's snapshots are, what each holds) imports no
torch: the launcher's pre-flight and ``mfsdp-ckpt ls --mem-tier`` read a tier without it. The
collective verbs (snapshot, recover, promote) are imported on first use (PEP 562)."""

from __future__ import annotations

from typing import Any

from mfsdp_ckpt.tier.layout import MemoryTier, newest_snapshot, run_id_of

__all__ = ["MemoryTier", "Recovery", "async_snapshot", "newest_snapshot", "promote", "recover", "run_id_of", "snapshot"]

_COLLECTIVE = ("Recovery", "async_snapshot", "promote", "recover", "snapshot")


def __getattr__(name: str) -> Any:
    """The collective verbs of :data:`_COLLECTIVE` (they import torch), imported on first use."""
    if name not in _COLLECTIVE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mfsdp_ckpt.tier.promote import promote
    from mfsdp_ckpt.tier.recover import Recovery, recover
    from mfsdp_ckpt.tier.snapshot import async_snapshot, snapshot

    found = {"Recovery": Recovery, "async_snapshot": async_snapshot, "promote": promote, "recover": recover}
    found["snapshot"] = snapshot
    globals().update(found)
    return found[name]


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))

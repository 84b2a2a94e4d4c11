"""The memory tier: checkpoints of a run kept in each node's memory (a tmpfs directory),
replicated to peer nodes, and recovered from whichever copies survive a failure
(docs/checkpoint.md, "Memory tier")."""

from mfsdp_ckpt.tier.layout import MemoryTier, run_id_of
from mfsdp_ckpt.tier.promote import promote
from mfsdp_ckpt.tier.recover import Recovery, recover
from mfsdp_ckpt.tier.snapshot import async_snapshot, snapshot

__all__ = ["MemoryTier", "Recovery", "async_snapshot", "promote", "recover", "run_id_of", "snapshot"]

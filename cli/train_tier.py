"""``--mem-tier``: the trainer's snapshots in node memory, and its recovery from them.

A run with ``--mem-tier DIR`` snapshots its state every ``--mem-every`` steps into each node's
tier directory, in the background (:func:`mfsdp_ckpt.tier.async_snapshot`: the next optimizer
step waits only for the copy to host memory), besides its durable ``--ckpt-dir`` saves. A
restart of the ranks (torchrun's ``--max-restarts``, which the trainer knows from
``TORCHELASTIC_RESTART_COUNT``) or ``--resume auto`` first recovers the newest whole snapshot
(:func:`mfsdp_ckpt.tier.recover`) and uses it when it is at least as new as the durable
``latest``; otherwise it loads the durable checkpoint as any resume does, saying why in one line.
A snapshot that would take the tier's file system past half of its free space is skipped with a
warning (once) and training goes on. At the run's normal end the tier is removed unless
``--mem-keep-on-exit``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from mfsdp_ckpt import AsyncSaveHandle, CheckpointError
from mfsdp_ckpt.errors import JobLostError
from mfsdp_ckpt.tier import MemoryTier, async_snapshot, run_id_of
from mfsdp_core.collectives import rank_and_world

from .settings import CheckpointSettings
from .train_args import UsageError

__all__ = ["TierSnapshots", "memory_tier", "restarted"]

#: a snapshot is skipped when it would take more than this share of its file system's free space
FREE_SHARE = 0.5


def restarted() -> bool:
    """Whether the launcher restarted these ranks after a failure (torchrun's restart count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def memory_tier(ckpt: CheckpointSettings, world: int) -> MemoryTier | None:
    """The run's place in ``--mem-tier`` (None without one): nodes of ``--node-size`` ranks, by
    default the launcher's ranks per machine."""
    if not ckpt.mem_tier or not ckpt.ckpt_dir:
        return None
    node_size = ckpt.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return MemoryTier(
        os.path.abspath(ckpt.mem_tier),
        run_id_of(ckpt.ckpt_dir),
        node_size=node_size,
        keep=ckpt.mem_keep,
        replicas=ckpt.mem_replicas,
    )


class TierSnapshots:
    """The loop's snapshots: every ``--mem-every`` steps, skipped (one warning) when the tier's
    file system is short of space."""

    def __init__(self, tier: MemoryTier, every: int, rank: int, log: Callable[[str], None] = print) -> None:
        self.tier, self.every, self.rank, self.log = tier, every, rank, log
        self.last_bytes = 0
        self.warned = False
        self.handle: AsyncSaveHandle | None = None
        self.promoting: str | None = None  # the durable checkpoint the snapshot in flight becomes too

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(
        self,
        step: int,
        model: torch.nn.Module,
        optim: Any,
        promote_to: str | None = None,
        keep: int | None = None,
        **save_kwargs: Any,
    ) -> bool:
        """Start snapshotting ``step`` in the background (collective), and with ``promote_to``
        copying it to that durable checkpoint once committed (the run's ``--save-every`` save of
        the step); False when the tier lacks the room (every rank decides alike: nothing is
        started, and the caller saves the step itself). The previous snapshot is finished
        first (its error raised here, on every rank alike)."""
        self.finish()
        if not self._room():
            return False
        self.handle = async_snapshot(self.tier, step, model, optim, promote_to=promote_to, keep=keep, **save_kwargs)
        self.promoting = promote_to
        return True

    def finish(self) -> None:
        """Wait for the snapshot in flight (raising its one-line error) and note its size; rank 0
        logs the durable checkpoint it was promoted to."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        try:
            self.last_bytes = _tree_bytes(handle.result())
        except JobLostError:
            raise  # another rank died: not this rank's to report (the trainer ends it quietly)
        except CheckpointError as e:
            raise UsageError(f"memory tier: {e}") from None
        if self.promoting is not None and self.rank == 0:
            self.log(
                f"saved {os.path.basename(self.promoting)} (promoted from the memory tier): total "
                f"{handle.total_s:.2f} s, blocked {handle.blocked_s:.3f} s; to {self.promoting}"
            )
        self.promoting = None

    def _room(self) -> bool:
        node = self.tier.node_of(rank_and_world()[0])
        where = self.tier.node_dir(node)
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        free = shutil.disk_usage(where).free
        fits = torch.tensor([float(self.last_bytes <= FREE_SHARE * free)])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN)
        if fits.item() < 1:
            if self.rank == 0 and not self.warned:
                print(
                    f"warning: memory tier {self.tier.root}: a snapshot ({self.last_bytes} bytes) would take more than "
                    f"{FREE_SHARE:.0%} of the free space on some node; skipping snapshots until there is room",
                    flush=True,
                )
            self.warned = True
            return False
        return True

    def remove(self) -> None:
        """The run's normal end: this node's leader removes the node's snapshots (and the run's
        directory in the tier once no node of it is left)."""
        self.finish()
        rank, _ = rank_and_world()
        node = self.tier.node_of(rank)
        if rank == self.tier.leader(node):
            shutil.rmtree(self.tier.node_dir(node), ignore_errors=True)
            try:
                os.rmdir(self.tier.run_dir)
            except OSError:
                pass  # another node's directory is still there (or already gone)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

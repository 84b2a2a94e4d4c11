"""``--mem-tier``: the trainer's snapshots in node memory, and its recovery from them.

A run with ``--mem-tier DIR`` snapshots its state every ``--mem-every`` steps into each node's
tier directory, in the background (:func:`mfsdp_ckpt.tier.async_snapshot`: the next optimizer
step waits only for the copy to host memory), besides its durable ``--ckpt-dir`` saves. A
restart of the ranks (torchrun's ``--max-restarts``, which the trainer knows from
``TORCHELASTIC_RESTART_COUNT``) or ``--resume auto`` first recovers the newest whole snapshot
(:func:`mfsdp_ckpt.tier.recover`) and uses it when it is at least as new as the durable
``latest``; otherwise it loads the durable checkpoint as any resume does, saying why in one line.
A snapshot that would take the tier's file system past half of its free space is skipped with a
warning (once) and training goes on, as is one whose node directory is no directory of the tier
(a link planted in its place: nothing is written through it). At the run's normal end the tier
is removed unless ``--mem-keep-on-exit``.

:func:`recover_run` is the recovery's part of a run's start: a whole snapshot is taken only when
it is this run's (the run identity of the durable ``latest`` it competes with, the model and
settings checked as a durable resume's), and one whose load fails is passed over for the next
whole state, then the durable checkpoint, with the model rebuilt in between.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from mfsdp_ckpt import AsyncSaveHandle, CheckpointError
from mfsdp_ckpt.errors import JobLostError
from mfsdp_ckpt.format.run_identity import identity_of
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.tier import MemoryTier, Recovery, async_snapshot, recover, run_id_of
from mfsdp_ckpt.tier.entries import remove_dir
from mfsdp_core.collectives import gather_objects, rank0_decides, rank_and_world

from .model_base import ModelSource
from .settings import CheckpointSettings, Settings
from .train_args import UsageError
from .train_start import checked_resume

__all__ = ["TierSnapshots", "memory_tier", "recover_run", "restarted"]

Built = tuple[torch.nn.Module, Any]  # a model and its optimizer

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
        self.warned_link = False
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
        """Whether every node can take the snapshot: its directory is the tier's own (not a link,
        checked before anything is written) and its file system has the room; else one warning
        (rank 0, once per reason) and the snapshot is skipped on every rank alike."""
        node = self.tier.node_of(rank_and_world()[0])
        problem = self.tier.node_problem(node)
        where = self.tier.node_dir(node)
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        free = shutil.disk_usage(where).free
        fits = torch.tensor([float(self.last_bytes <= FREE_SHARE * free), float(problem is None)])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN)
        room, usable = fits.tolist()
        if usable < 1:
            if not self.warned_link:  # every rank alike: the problems gathered, rank 0 says the first
                found = [p for p in gather_objects(problem) if p is not None]
                if self.rank == 0:
                    print(f"warning: memory tier: {found[0]}; skipping snapshots", flush=True)
            self.warned_link = True
            return False
        if room < 1:
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
        if rank == self.tier.leader(node) and self.tier.node_problem(node) is None:
            remove_dir(self.tier.node_dir(node))  # a real directory only: a link in its place stays
            try:
                os.rmdir(self.tier.run_dir)
            except OSError:
                pass  # another node's directory is still there (or already gone)


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (by ``lstat``: a link counts as itself)."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def recover_run(
    tier: MemoryTier,
    settings: Settings,
    source: ModelSource,
    durable: str | None,
    built: Built,
    rebuild: Callable[[], Built],
) -> tuple[Recovery, Built]:
    """The run's newest whole snapshot in ``tier`` loaded into ``built`` (collective): one at
    least as new as the durable checkpoint ``durable`` (None: none) by the step its manifest
    records, carrying the same run identity as ``durable`` (another run's is passed over), and
    written for this model with this run's settings (refused otherwise, as a durable resume is:
    :func:`cli.train_start.checked_resume`). A snapshot whose load fails is passed over, the
    model and optimizer rebuilt (``rebuild``: they hold part of it), and the next whole state
    tried. Returns the recovery (its ``step`` None: the caller loads ``durable`` or starts
    fresh, saying ``why``) and the model and optimizer to train."""
    manifest = rank0_decides(_manifest_or_none, durable) if durable is not None else None
    step = manifest.get("step") if manifest is not None else None
    not_before = step if isinstance(step, int) else None
    identity = identity_of(manifest)

    def check(path: str) -> str | None:
        return rank0_decides(_snapshot_problem, settings, source, path, durable, identity)

    passed: dict[int, str] = {}
    while True:
        model, optim = built
        try:
            recovery = recover(tier, model, optim, not_before=not_before, check=check, passed_over=passed)
        except JobLostError:
            raise
        except CheckpointError as e:
            raise UsageError(f"--mem-tier: {e}") from None
        if not recovery.touched:
            return recovery, built
        assert recovery.failed_step is not None
        passed[recovery.failed_step] = recovery.why
        del model, optim
        built = rebuild()


def _manifest_or_none(path: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint ``path`` names, or None when it cannot be read (its own
    load says why)."""
    import mfsdp_ckpt

    try:
        return read_manifest(mfsdp_ckpt.resolve_checkpoint(path))
    except CheckpointError:
        return None


def _snapshot_problem(
    settings: Settings, source: ModelSource, path: str, durable: str | None, identity: str | None
) -> str | None:
    """Rank 0: why the whole snapshot ``path`` is not this run's to load (None: it is). Another
    run identity than the durable checkpoint ``durable``'s (``identity``) passes it over; a manifest
    that cannot be read too; another model or other settings refuse the run (UsageError), as a
    durable resume's would."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    if durable is not None and identity_of(manifest) != identity:
        return (
            f"another run's snapshot (run identity {identity_of(manifest) or 'none'}, not {identity or 'none'} "
            f"as {durable})"
        )
    checked_resume(settings, path, source, "--resume (memory tier)")
    return None

"""``mfsdp-train --tensorboard DIR``: the run's curves as TensorBoard event files.

Rank 0 writes, at every step (whatever ``--log-every`` says): ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s`` and ``train/step_time_s``; at every committed save:
``checkpoint/save_time_s`` (the whole save; under ``--async-save`` also
``checkpoint/save_blocked_s``, what the training loop waited) and ``checkpoint/size_bytes``
(the data files), at the step saved.

A resumed run writes into the same DIR and its steps go on from the checkpoint's. The writer is
opened with ``purge_step`` = the first step this run trains: TensorBoard's readers then drop
whatever an earlier run wrote at that step or later (a run resumed from step 4 after its first
try reached step 5 shows step 5 once, this run's), so the curves stay one line, not two that
cross. A fresh run (step 1) into a used DIR replaces its curves the same way.

This module imports neither torch nor tensorboard until a writer is opened: the launcher's
check (:func:`tensorboard_missing`) runs before any rank starts.
"""

from __future__ import annotations

import os
from typing import Any

from .settings import Settings

__all__ = ["MISSING", "TensorBoard", "tensorboard_missing", "open_tensorboard"]

MISSING = (
    "--tensorboard needs the tensorboard package, which is not installed: "
    "pip install 'mfsdp-ckpt[tensorboard]' (or pip install tensorboard)"
)


def tensorboard_missing() -> str | None:
    """:data:`MISSING` when the tensorboard package cannot be imported, else None: the check
    ``--tensorboard`` gets before any rank starts (cheap: 3 ms, no torch)."""
    try:
        import tensorboard  # noqa: F401  (what torch.utils.tensorboard needs)
    except ImportError:
        return MISSING
    return None


class TensorBoard:
    """Rank 0's event writer (see the module's docstring for what it writes, and when)."""

    def __init__(self, directory: str, first_step: int, tokens_per_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the package was checked before the run started

        self.tokens_per_step = tokens_per_step
        self.writer = SummaryWriter(log_dir=directory, purge_step=first_step, flush_secs=10)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        """One step's scalars."""
        add = self.writer.add_scalar
        add("train/loss", loss, step)
        add("train/lr", lr, step)
        add("train/grad_norm", grad_norm, step)
        add("train/step_time_s", seconds, step)
        add("train/tokens_per_s", self.tokens_per_step / seconds if seconds > 0 else 0.0, step)

    def save(self, path: str, seconds: float, blocked: float | None = None) -> None:
        """A committed checkpoint: its save time and size, at the step its manifest records."""
        from mfsdp_ckpt.errors import CheckpointError
        from mfsdp_ckpt.read.manifest import read_manifest

        try:
            manifest: dict[str, Any] = read_manifest(path)
        except CheckpointError:
            return  # committed but unreadable now (removed by --keep meanwhile): no point to draw
        step = manifest.get("step")
        if not isinstance(step, int):
            return
        self.writer.add_scalar("checkpoint/save_time_s", seconds, step)
        if blocked is not None:
            self.writer.add_scalar("checkpoint/save_blocked_s", blocked, step)
        if isinstance(manifest.get("total_bytes"), int):
            self.writer.add_scalar("checkpoint/size_bytes", manifest["total_bytes"], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(settings: Settings, rank: int, start_step: int) -> TensorBoard | None:
    """The writer of a run that trains from ``start_step + 1``: rank 0's under ``--tensorboard``,
    else None."""
    directory = settings.logging.tensorboard
    if not directory or rank != 0:
        return None
    os.makedirs(directory, exist_ok=True)
    return TensorBoard(directory, start_step + 1, settings.training.batch_size * settings.training.seq_len)

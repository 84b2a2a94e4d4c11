"""The launcher's pre-flight beyond the flags, without torch until it is needed: where the run names
an ``--hf-model`` directory or a start checkpoint the launcher can read (a local path, or a local
``--ckpt-dir``'s latest), :func:`check_start` checks the model and that checkpoint before any rank
starts, with the rules the ranks apply (``cli.train_start``, which imports torch and the checkpoint
layer: only such a run pays for it). Anything else is left to the ranks, as before."""

from __future__ import annotations

import argparse

from .run_config import is_local
from .train_args import _AUTO, _LATEST

__all__ = ["check_start", "needs_start_check"]


def needs_start_check(args: argparse.Namespace) -> bool:
    """Whether the run names something the launcher can check beyond the flags: an ``--hf-model``
    directory, or a local start checkpoint (``--init-from``, ``--resume``, ``--ckpt-dir``'s latest)."""
    if args.hf_model is not None:
        return True
    if args.init_from:
        return is_local(args.init_from)
    if args.resume in (_LATEST, _AUTO):
        return is_local(args.ckpt_dir)
    return is_local(args.resume)


def check_start(args: argparse.Namespace, world: int | None) -> None:
    """Refuse (``UsageError``, one line) a model or start checkpoint the ranks would refuse, before
    they start: called by the launcher after ``check_flags``; a no-op (no torch) for other runs."""
    if not needs_start_check(args):
        return
    from .quiet import quiet_third_party

    quiet_third_party(args.verbose)  # building an --hf-model source imports transformers: our lines only
    from .train_start import preflight

    preflight(args, world)

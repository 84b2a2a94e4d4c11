"""``mfsdp-train``: resumable sharded training of the reference GPT, a Hugging Face ``transformers``
causal LM (``--hf-model``) or a Megatron-Core ``GPTModel`` (``--mcore-config``)::

    mfsdp-train --nproc-per-node 2 --model tiny-moe --steps 60 --stop-at 30 \\
        --ckpt-dir ckpts/run1 --save-every 10
    mfsdp-train --nproc-per-node 3 --ckpt-dir ckpts/run1 --resume
    torchrun --standalone --nproc-per-node 2 -m cli.train --model tiny --steps 60 \\
        --init-from ckpts/from_hf    # weights only (e.g. from ``mfsdp-ckpt import-hf``), fresh optimizer

This module is the light front end every process of a run starts in: it parses the flags
(:mod:`cli.train_args`, no torch: ``--help`` and ``--version`` answer at once), and then either
launches the ranks (``--nproc-per-node``), after refusing what the flags alone decide, or is one
of them and imports the trainer proper (:mod:`cli.trainer`). A Ctrl-C anywhere in a process, while
torch is being imported included, ends it with exit code 130 and at most one line (none from a
rank of our own launcher, which says it for the job).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# first: importing it makes a Ctrl-C during the imports below one line and exit 130
from .train_signals import (
    exit_interrupted,
    launched_by_us,
    says_for_the_job,
    with_sigint_held,
)

# isort: split
from .train_args import UsageError, build_parser, check_flags, parse_args, world_size_of
from .train_launch import launch, unblock_sigint

__all__ = ["main", "parse_args", "build_parser"]


def main(argv: list[str] | None = None) -> int:
    """The trainer: launches its ranks (``--nproc-per-node``) or is one of them; the exit code
    (1 a refused run, 2 a usage error, 130 interrupted, 143 stopped by SIGTERM after saving).
    A Ctrl-C that the training loop's handler did not take ends the process here: one line from
    a lone process or rank 0 of a plain torchrun job, none from a rank of ``--nproc-per-node``
    (the launcher says ``error: interrupted`` for the job)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        unblock_sigint()  # a rank of our launcher starts with SIGINT blocked (see train_launch)
        return _main(argv)
    except KeyboardInterrupt:  # one the training loop's handler did not take (torch's import, say)
        exit_interrupted(say=says_for_the_job())


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.nproc_per_node is not None and not launched_by_us():
        if "RANK" in os.environ:
            print("error: --nproc-per-node: this process is already a rank of a torchrun job", file=sys.stderr)
            return 2
        try:  # what the flags decide alone is refused here, before any rank starts (and imports torch)
            settings = check_flags(args, world_size_of(args))
            from .train_preflight import check_start  # the model, --data, a readable checkpoint

            check_start(settings, world_size_of(args))
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        return launch(settings, __spec__.name if __spec__ else "mfsdp_cli.train", argv)
    from .quiet import quiet_third_party

    quiet_third_party(args.verbose)  # a rank prints our lines only (--verbose: the libraries' too)
    run = with_sigint_held(_load_trainer)  # torch, the runtime and the checkpoint layer
    return run(args)


def _load_trainer() -> Callable[..., int]:
    """The trainer proper (torch and all of the runtime): only a rank needs it."""
    from .trainer import run

    return run


if __name__ == "__main__":
    sys.exit(main())

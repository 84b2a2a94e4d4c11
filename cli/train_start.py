"""What a run starts from, checked: the model (:func:`check_model`) and the checkpoint it resumes or
starts from (:func:`resume_point`, :func:`checked_checkpoint`: written for this model, and with this
run's settings unless ``--allow-change`` says otherwise).

One rule for both places that decide: each rank (``cli.trainer``: rank 0 picks the checkpoint for
all, since ``latest`` may move meanwhile and a plain torchrun job has no launcher), and the launcher
of ``--nproc-per-node`` before it starts any rank (:func:`preflight`, through ``cli.train_preflight``), for what it can read itself:
an ``--hf-model`` directory, a local checkpoint, or ``--ckpt-dir``'s latest. Importing this module
imports neither torch nor the training runtime: describing a reference GPT run and reading a
manifest are torch-free, so that the launcher refuses such a run in a fraction of a second; the
Hugging Face and Megatron-Core families, a ``--data`` file and ``--comm-stream`` import torch when
they are checked.
"""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING

import mfsdp_ckpt
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.config_check import check_hf_model_dir
from mfsdp_ckpt.hf.expert_families import launcher_ep_refusal
from mfsdp_ckpt.mcore.config_check import check_mcore_config_file
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs as mfsdp_fs
from mfsdp_ckpt.storage.lock import check_unlocked
from mfsdp_core.policy import parse_policy
from mfsdp_core.strategy import parse_strategy
from mfsdp_core.token_files import token_windows

from .model_base import ModelSource
from .model_source import source_of_run
from .run_config import allowed_changes, changed_settings, is_local, run_config, start_checkpoint
from .train_args import _AUTO, _LATEST, UsageError

if TYPE_CHECKING:
    from mfsdp_core.data import SyntheticText, TokenFile

__all__ = [
    "check_model",
    "open_data",
    "refuse_locked",
    "resume_point",
    "resolve_auto_resume",
    "checked_checkpoint",
    "preflight",
    "check_seq_len",
    "check_hf_dir",
    "check_mcore_file",
]


def check_model(args: argparse.Namespace, world: int | None) -> ModelSource:
    """The run's model source, after what needs the model: its layout over ``world`` ranks
    (skipped when None: an elastic launch), its sequence length, the ``--data`` file of its
    vocabulary (and CUDA for ``--comm-stream``). ``args.model`` becomes its name
    (the preset's, the config file's, the model class's, or the one the start checkpoint records)."""
    try:
        source = source_of_run(args, start_checkpoint(args))
        args.model = source.name
        parse_strategy(args.strategy)
        parse_policy(args.policy)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if world is not None:
        try:
            source.check_parallel(world, args.ep)
        except ValueError as e:
            raise UsageError(f"--ep {args.ep}: {e}") from None
    check_seq_len(args, source.seq_length)
    if args.comm_stream and not _cuda_available():
        raise UsageError("--comm-stream needs a GPU (CUDA is not available here); leave it out on CPU")
    if args.data:  # a missing, misshapen or too short file fails now
        try:
            token_windows(args.data, args.seq_len, args.data_dtype)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return source


def check_seq_len(args: argparse.Namespace, seq_length: int | None) -> None:
    """Refuse a ``--seq-len`` over the model's longest (``seq_length``; None: no limit)."""
    if seq_length is not None and args.seq_len > seq_length:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's seq_length {seq_length}")


def check_hf_dir(args: argparse.Namespace) -> None:
    """The torch-free first look at an ``--hf-model`` directory, before transformers builds its
    model (seconds): a ``config.json`` the bridge's check refuses, an ``--ep`` its family cannot
    take (fused experts, or none), a ``--seq-len`` over its ``max_position_embeddings``. What needs
    transformers is :func:`check_model`'s."""
    try:
        config = check_hf_model_dir(args.hf_model)
    except ConversionError as e:
        raise UsageError(str(e)) from None
    refusal = launcher_ep_refusal(config, args.ep)
    if refusal:
        raise UsageError(f"--ep {args.ep}: {refusal}")
    seq_length = config.get("max_position_embeddings")
    check_seq_len(args, seq_length if type(seq_length) is int else None)


def check_mcore_file(args: argparse.Namespace) -> None:
    """The torch-free look at ``--mcore-config`` before any rank starts: a file the Megatron-Core
    bridge's check refuses (types, bounds, finite numbers, choices, divisibility), or a fresh model
    the memory of this node's ``--nproc-per-node`` ranks cannot hold. What needs Megatron-Core (its
    ``TransformerConfig``'s own field types) the ranks check."""
    try:
        check_mcore_config_file(args.mcore_config, copies=max(1, args.nproc_per_node or 1))
    except ConversionError as e:
        raise UsageError(f"--mcore-config {e}") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def open_data(args: argparse.Namespace, source: ModelSource) -> SyntheticText | TokenFile:
    """The run's samples: ``--data``'s token file, or the synthetic stream."""
    from mfsdp_core.data import SyntheticText, TokenFile

    if not args.data:
        return SyntheticText(source.vocab_size, args.seq_len, seed=args.seed)
    try:
        return TokenFile(args.data, args.seq_len, source.vocab_size, dtype=args.data_dtype, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resume_point(args: argparse.Namespace, source: ModelSource) -> str:
    """The checkpoint to resume from, after checking it was written for this model and with the
    settings of this run (:mod:`cli.run_config`; ``--allow-change`` lifts the check per flag)."""
    if args.resume != _LATEST:
        path = checked_checkpoint(args.resume, source, "--resume")
    else:
        latest = mfsdp_fs.join(mfsdp_fs.normalize(args.ckpt_dir), mfsdp_ckpt.LATEST_NAME)
        if not mfsdp_fs.exists(latest):
            raise UsageError(f"--resume: no checkpoint to resume from ({latest} does not exist)")
        path = checked_checkpoint(latest, source, "--resume")
    saved = read_manifest(path).get("run_config")
    if saved is not None:  # a checkpoint from before settings were recorded has nothing to compare
        changed = changed_settings(saved, run_config(args), allowed_changes(args.allow_change))
        if changed:
            flags = " ".join(f"--allow-change {c.split()[0].lstrip('-')}" for c in changed)
            raise UsageError(
                f"--resume: {path} was written with other settings: {', '.join(changed)}; "
                f"pass {flags} to resume with this run's values"
            )
    return path


def resolve_auto_resume(args: argparse.Namespace) -> str | None:
    """``--resume auto``: resume from ``<ckpt-dir>/latest`` when it exists, else start fresh."""
    latest = mfsdp_fs.join(mfsdp_fs.normalize(args.ckpt_dir), mfsdp_ckpt.LATEST_NAME)
    return _LATEST if mfsdp_fs.exists(latest) else None


def checked_checkpoint(where: str, source: ModelSource, flag: str) -> str:
    """The checkpoint directory ``where`` names, after checking that its manifest records the
    model of ``source`` (for the reference GPT, fields an older manifest lacks count as their
    defaults)."""
    try:
        path = mfsdp_ckpt.resolve_checkpoint(where)
        manifest = read_manifest(path)
    except mfsdp_ckpt.CheckpointError as e:
        raise UsageError(f"{flag}: {e}") from None
    diffs = source.describe_differences(manifest)
    if diffs:
        raise UsageError(f"{flag}: {path} was written for another model config: {', '.join(diffs)}")
    return path


def refuse_locked(args: argparse.Namespace) -> None:
    """Refuse a local ``--ckpt-dir`` another job is writing into (its writer lock held) before the
    start checkpoint is even read: that is the reason the run cannot go on, whatever the checkpoint
    says. Creates nothing; the lock itself is taken once the run is accepted."""
    if args.ckpt_dir and mfsdp_fs.is_local(args.ckpt_dir):
        try:
            check_unlocked(args.ckpt_dir)
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--ckpt-dir: {e}") from None


def preflight(args: argparse.Namespace, world: int | None) -> None:
    """The launcher's check, before any rank starts, of the model and the start checkpoint it can read
    (``cli.train_preflight`` decides that it can), with the ranks' own functions: :func:`check_model`,
    then :func:`resume_point` / :func:`checked_checkpoint`. Works on a copy of ``args``; UsageError."""
    args = copy.copy(args)
    refuse_locked(args)
    if args.resume and not is_local(args.ckpt_dir if args.resume in (_LATEST, _AUTO) else args.resume):
        args.resume = None  # an object store's: read by the ranks (only the --hf-model is checked here)
    if args.resume == _AUTO:
        args.resume = resolve_auto_resume(args)
    if args.hf_model is not None:
        check_hf_dir(args)
    source = check_model(args, world)
    if args.resume:
        resume_point(args, source)
    if args.init_from and is_local(args.init_from):
        checked_checkpoint(args.init_from, source, "--init-from")

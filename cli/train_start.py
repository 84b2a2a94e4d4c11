"""What a run starts from, checked: the model (:func:`check_model`) and the checkpoint it resumes or
starts from (:func:`decide_start`, a :class:`cli.settings.StartPoint`: :func:`resume_point`,
:func:`checked_checkpoint`: written for this model, and with this run's settings unless
``--allow-change`` says otherwise).

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

from typing import TYPE_CHECKING

import mfsdp_ckpt
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.config_check import check_hf_model_dir
from mfsdp_ckpt.hf.expert_families import launcher_ep_refusal
from mfsdp_ckpt.mcore.config_check import check_mcore_config_file
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs as mfsdp_fs
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_core.policy import parse_policy
from mfsdp_core.strategy import parse_strategy
from mfsdp_core.token_files import token_windows

from .model_base import ModelSource
from .model_source import source_of_run
from .run_config import allowed_changes, changed_settings, is_local, newest_state, run_config, start_checkpoint
from .settings import FRESH, CheckpointSettings, Settings, StartPoint
from .train_args import _AUTO, _LATEST, UsageError

if TYPE_CHECKING:
    from mfsdp_core.data import SyntheticText, TokenFile

__all__ = [
    "check_model",
    "open_data",
    "refuse_locked",
    "resume_point",
    "checked_resume",
    "resolve_auto_resume",
    "checked_checkpoint",
    "decide_start",
    "preflight",
    "check_seq_len",
    "check_hf_dir",
    "check_mcore_file",
]


def check_model(settings: Settings, world: int | None, resume: str | None) -> ModelSource:
    """The run's model source, after what needs the model: its layout over ``world`` ranks
    (skipped when None: an elastic launch), its sequence length, the ``--data`` file of its
    vocabulary (and CUDA for ``--comm-stream``). ``resume``: what ``--resume`` asks for (a path,
    ``LATEST``, ``AUTO`` or None), whose checkpoint names the model when no flag does. The source's
    ``name`` is the run's model name (the preset's, the config file's, the model class's, or the
    one the start checkpoint records)."""
    ckpt, parallel = settings.checkpoint, settings.parallelism
    try:
        source = source_of_run(settings.model, start_checkpoint(resume, ckpt.init_from, ckpt.ckpt_dir, ckpt.mem_tier))
        parse_strategy(parallel.strategy)
        parse_policy(parallel.policy)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if world is not None:
        try:
            source.check_parallel(world, parallel.ep)
        except ValueError as e:
            raise UsageError(f"--ep {parallel.ep}: {e}") from None
    check_seq_len(settings.training.seq_len, source.seq_length)
    if parallel.comm_stream and not _cuda_available():
        raise UsageError("--comm-stream needs a GPU (CUDA is not available here); leave it out on CPU")
    if settings.data.data:  # a missing, misshapen or too short file fails now
        try:
            token_windows(settings.data.data, settings.training.seq_len, settings.data.data_dtype)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return source


def check_seq_len(seq_len: int, seq_length: int | None) -> None:
    """Refuse a ``--seq-len`` over the model's longest (``seq_length``; None: no limit)."""
    if seq_length is not None and seq_len > seq_length:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's seq_length {seq_length}")


def check_hf_dir(settings: Settings) -> None:
    """The torch-free first look at an ``--hf-model`` directory, before transformers builds its
    model (seconds): a ``config.json`` the bridge's check refuses, an ``--ep`` its family cannot
    take (fused experts, or none), a ``--seq-len`` over its ``max_position_embeddings``. What needs
    transformers is :func:`check_model`'s."""
    ep = settings.parallelism.ep
    try:
        config = check_hf_model_dir(settings.model.hf_model)
    except ConversionError as e:
        raise UsageError(str(e)) from None
    refusal = launcher_ep_refusal(config, ep)
    if refusal:
        raise UsageError(f"--ep {ep}: {refusal}")
    seq_length = config.get("max_position_embeddings")
    check_seq_len(settings.training.seq_len, seq_length if type(seq_length) is int else None)


def check_mcore_file(mcore_config: str, nproc_per_node: int | None) -> None:
    """The torch-free look at ``--mcore-config`` before any rank starts: a file the Megatron-Core
    bridge's check refuses (types, bounds, finite numbers, choices, divisibility), or a fresh model
    the memory of this node's ``--nproc-per-node`` ranks cannot hold. What needs Megatron-Core (its
    ``TransformerConfig``'s own field types) the ranks check."""
    try:
        check_mcore_config_file(mcore_config, copies=max(1, nproc_per_node or 1))
    except ConversionError as e:
        raise UsageError(f"--mcore-config {e}") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def open_data(settings: Settings, source: ModelSource) -> SyntheticText | TokenFile:
    """The run's samples: ``--data``'s token file, or the synthetic stream."""
    from mfsdp_core.data import SyntheticText, TokenFile

    data, training = settings.data, settings.training
    if not data.data:
        return SyntheticText(source.vocab_size, training.seq_len, seed=training.seed)
    try:
        return TokenFile(data.data, training.seq_len, source.vocab_size, dtype=data.data_dtype, seed=training.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resume_point(settings: Settings, resume: str, source: ModelSource) -> StartPoint:
    """What ``resume`` (a path, or ``LATEST``: the run's newest state) continues, checked: written
    for this model and with the settings of this run (:mod:`cli.run_config`; ``--allow-change``
    lifts the check per flag). For ``LATEST``: ``<ckpt-dir>/latest`` and, with ``--mem-tier``,
    the run's newest snapshot in memory when it is at least as new (both checked: the ranks
    recover the snapshot when it is whole, else load ``latest``)."""
    ckpt = settings.checkpoint
    if resume != _LATEST:
        return StartPoint("--resume", checked_resume(settings, resume, source))
    latest = mfsdp_fs.join(mfsdp_fs.normalize(ckpt.ckpt_dir), mfsdp_ckpt.LATEST_NAME)
    newest = newest_state(ckpt.ckpt_dir, ckpt.mem_tier)
    if newest is None:
        tier = f", nor a snapshot of this run in the memory tier {ckpt.mem_tier}" if ckpt.mem_tier else ""
        raise UsageError(f"--resume: no checkpoint to resume from ({latest} does not exist{tier})")
    durable = latest if mfsdp_fs.exists(latest) else None
    snapshot = newest[0] if newest[1] else None
    return StartPoint(
        "--resume",
        None if durable is None else checked_resume(settings, durable, source),
        None if snapshot is None else checked_resume(settings, snapshot, source, "--resume (memory tier)"),
    )


def checked_resume(settings: Settings, where: str, source: ModelSource, flag: str = "--resume") -> str:
    """The checkpoint directory ``where`` names, after checking it was written for this model
    (:func:`checked_checkpoint`) and with this run's recorded settings, unless ``--allow-change``
    names the flag (``flag``: how the refusal names what was resumed)."""
    path = checked_checkpoint(where, source, flag)
    saved = read_manifest(path).get("run_config")
    if saved is not None:  # a checkpoint from before settings were recorded has nothing to compare
        ours = run_config(settings, source.name)
        changed = changed_settings(saved, ours, allowed_changes(list(settings.checkpoint.allow_change)))
        if changed:
            flags = " ".join(f"--allow-change {c.split()[0].lstrip('-')}" for c in changed)
            raise UsageError(
                f"{flag}: {path} was written with other settings: {', '.join(changed)}; "
                f"pass {flags} to resume with this run's values"
            )
    return path


def resolve_auto_resume(ckpt: CheckpointSettings) -> str | None:
    """``--resume auto``: ``LATEST`` (resume from the run's newest state: ``<ckpt-dir>/latest``,
    or a snapshot in ``--mem-tier``) when there is one, else None (start fresh)."""
    return _LATEST if newest_state(ckpt.ckpt_dir, ckpt.mem_tier) is not None else None


def decide_start(settings: Settings, resume: str | None, source: ModelSource) -> StartPoint:
    """What the run starts from, checked: what ``resume`` names (``--resume`` with ``AUTO``
    already resolved: a path, ``LATEST`` or None), else ``--init-from``'s checkpoint, else
    nothing. Rank 0 decides it for every rank (``cli.trainer``)."""
    if resume:
        return resume_point(settings, resume, source)
    if settings.checkpoint.init_from:
        return StartPoint("--init-from", checked_checkpoint(settings.checkpoint.init_from, source, "--init-from"))
    return FRESH


def checked_checkpoint(where: str, source: ModelSource, flag: str) -> str:
    """The checkpoint directory ``where`` names, after checking that its manifest records the
    model of ``source`` (for the reference GPT, fields an older manifest lacks count as their
    defaults)."""
    try:
        path = mfsdp_ckpt.resolve_checkpoint(where)
        manifest = read_manifest(path)
    except mfsdp_ckpt.CheckpointError as e:
        raise UsageError(f"{flag}: {e}") from None
    diffs = (
        source.describe_init_differences(manifest) if flag == "--init-from" else source.describe_differences(manifest)
    )
    if diffs:
        raise UsageError(f"{flag}: {path} was written for another model config: {', '.join(diffs)}")
    _check_adapters(path, manifest, flag)
    return path


def _check_adapters(path: str, manifest: dict, flag: str) -> None:
    """A LoRA checkpoint's record against the adapters it holds, before any is built or loaded:
    each factor's shape composes with the weight it adapts (kept in the checkpoint's base) at the
    recorded rank (:func:`mfsdp_ckpt.format.lora.adapter_pairs`; the manifest schema already
    checked the targets and the factors' rank). Torch-free: from the indexes of the checkpoint and
    of its base (a checkpoint without an index is checked by its load)."""
    from mfsdp_ckpt.format.lora import adapter_pairs, lora_of_record
    from mfsdp_ckpt.format.model_source import model_source_of
    from mfsdp_ckpt.read.base_manifest import checked_base

    record = model_source_of(manifest) or {}
    if record.get("lora") is None or "index" not in manifest:
        return
    try:
        spec = lora_of_record(record, path)
        base = checked_base(path, manifest)
    except (ValueError, mfsdp_ckpt.CheckpointError) as e:
        raise UsageError(f"{flag}: {e}") from None
    shapes = {}
    for m in [manifest] + ([base[1]] if base is not None else []):
        shapes.update({k: tuple(v[1]) for k, v in m["index"]["keys"].items() if k.startswith("model.") and v[1]})
    try:
        adapter_pairs(shapes, spec, path)
    except ConversionError as e:
        raise UsageError(f"{flag}: {e}") from None


def refuse_locked(ckpt_dir: str | None) -> None:
    """Refuse a local ``--ckpt-dir`` another job is writing into (its writer lock held) before the
    start checkpoint is even read: that is the reason the run cannot go on, whatever the checkpoint
    says. Creates nothing; the lock itself is taken once the run is accepted."""
    if ckpt_dir:
        try:
            destination_for(ckpt_dir, kind="run").check_unlocked()  # an object store has no lock
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--ckpt-dir: {e}") from None


def preflight(settings: Settings, world: int | None) -> None:
    """The launcher's check, before any rank starts, of the model and the start checkpoint it can read
    (``cli.train_preflight`` decides that it can), with the ranks' own functions: :func:`check_model`,
    then :func:`resume_point` / :func:`checked_checkpoint`. UsageError."""
    ckpt = settings.checkpoint
    refuse_locked(ckpt.ckpt_dir)
    resume = ckpt.resume
    if resume and not is_local(ckpt.ckpt_dir if resume in (_LATEST, _AUTO) else resume):
        resume = None  # an object store's: read by the ranks (only the --hf-model is checked here)
    if resume == _AUTO:
        resume = resolve_auto_resume(ckpt)
    if settings.model.hf_model is not None:
        check_hf_dir(settings)
    source = check_model(settings, world, resume)
    if resume:
        resume_point(settings, resume, source)
    if ckpt.init_from and is_local(ckpt.init_from):
        checked_checkpoint(ckpt.init_from, source, "--init-from")

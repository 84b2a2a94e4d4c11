"""The settings of a training run that a resumed run must keep, and the comparison ``--resume``
makes: the sample sequence (seed, data source, batch size, sequence length) and the math (the
optimizer and its schedule, clipping, precision). Layout flags (world size, ``--strategy``,
``--policy``, ``--ep``) are not among them: a checkpoint loads into any layout.

Each checkpoint's manifest records them (``run_config``); ``--resume`` refuses a run whose flags
differ, naming each difference, unless the flag is named with ``--allow-change`` (a new learning
rate after a restart, say)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .settings import Settings
from .train_config import resolved_settings

__all__ = [
    "RECORDED_FLAGS",
    "LATEST",
    "AUTO",
    "run_config",
    "allowed_changes",
    "changed_settings",
    "start_checkpoint",
    "newest_state",
    "recorded_settings",
    "local_missing",
    "is_local",
]

LATEST = "<ckpt-dir>/latest"  # --resume without a path
AUTO = "auto"  # --resume auto: <ckpt-dir>/latest if there is one, else a fresh start

# flag -> argparse attribute; the Muon and MXFP8 details count only when those are on
RECORDED_FLAGS: dict[str, str] = {
    "seed": "seed",
    "batch-size": "batch_size",
    "seq-len": "seq_len",
    "micro-batches": "micro_batches",
    "steps": "steps",
    "lr": "lr",
    "min-lr": "min_lr",
    "warmup": "warmup",
    "weight-decay": "weight_decay",
    "clip": "clip",
    "optimizer": "optimizer",
    "dtype": "param_dtype",
    "mxfp8": "mxfp8",
    "muon-lr": "muon_lr",
    "ns-dtype": "ns_dtype",
    "mx-rule": "mx_rule",
    "data": "data",
}
# flags recorded under another name by earlier versions (or still accepted as aliases)
_RENAMED = {"param-dtype": "dtype"}
_ONLY_WITH = {"muon-lr": ("optimizer", "muon"), "ns-dtype": ("optimizer", "muon"), "mx-rule": ("mxfp8", None)}


SETTINGS_KEY = "settings"  # every resolved setting, the defaults of a resumed run (not compared)


def run_config(settings: Settings, model_name: str, identity: str | None = None) -> dict[str, Any]:
    """The recorded settings of this run, by flag name (``data``: where the samples come from),
    and under ``settings`` all of the run's resolved settings (``--resume`` takes them as defaults)
    with ``model_name``, what a run started from this checkpoint calls the model (the source's name);
    with ``identity``, the run's identity too (:mod:`mfsdp_ckpt.format.run_identity`: no setting,
    never compared as one)."""
    from mfsdp_ckpt.format.run_identity import RUN_IDENTITY_KEY
    from mfsdp_core.token_files import describe_token_file  # (numpy: this module is imported by the light parser)

    values = settings.values()
    # ``model_name``: not a flag (no default), so that no resumed run takes it as one
    out: dict[str, Any] = {SETTINGS_KEY: {**resolved_settings(values), "model_name": model_name}}
    if identity is not None:
        out[RUN_IDENTITY_KEY] = identity
    for flag, attr in RECORDED_FLAGS.items():
        if flag == "data":  # a token file, or the trainer's generated token stream (seeded by --seed)
            data = settings.data
            out[flag] = describe_token_file(data.data, data.data_dtype) if data.data else "synthetic"
            continue
        if flag in _ONLY_WITH:
            other, value = _ONLY_WITH[flag]
            on = values[other.replace("-", "_")]
            if (value is None and on is None) or (value is not None and on != value):
                continue
        out[flag] = values[attr]
    return out


def allowed_changes(names: list[str]) -> set[str]:
    """``--allow-change`` values as flag names (``lr`` or ``--lr``); ValueError naming an unknown one."""
    out = set()
    for name in names:
        flag = name.lstrip("-")
        flag = _RENAMED.get(flag, flag)
        if flag not in RECORDED_FLAGS:
            raise ValueError(f"--allow-change {name}: not a recorded setting (one of: {', '.join(RECORDED_FLAGS)})")
        out.add(flag)
    return out


def changed_settings(saved: dict[str, Any], current: dict[str, Any], allowed: set[str]) -> list[str]:
    """``--flag SAVED (this run: NOW)`` for each recorded setting that differs and is not allowed
    (the run's identity is no setting: left out)."""
    from mfsdp_ckpt.format.run_identity import RUN_IDENTITY_KEY

    out = []
    skipped = (SETTINGS_KEY, RUN_IDENTITY_KEY)
    saved = {_RENAMED.get(flag, flag): value for flag, value in saved.items() if flag not in skipped}
    current = {flag: value for flag, value in current.items() if flag not in skipped}
    for flag in sorted(set(saved) | set(current)):
        if flag in allowed or saved.get(flag) == current.get(flag):
            continue
        out.append(f"--{flag} {_shown(saved.get(flag))} (this run: {_shown(current.get(flag))})")
    return out


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def start_checkpoint(
    resume: str | None, init_from: str | None, ckpt_dir: str | None, mem_tier: str | None = None
) -> tuple[str, str] | None:
    """``(flag, checkpoint)`` the run starts from, as far as the flags tell before rank 0 picks it:
    ``--init-from``'s, or ``resume``'s (a path, or :data:`LATEST` / :data:`AUTO`: the newest state
    of the run, :func:`newest_state`)."""
    if init_from:
        return "--init-from", init_from
    if resume in (LATEST, AUTO):
        newest = newest_state(ckpt_dir, mem_tier)
        return ("--resume", newest[0]) if newest is not None else None
    return ("--resume", resume) if resume else None


def newest_state(ckpt_dir: str | None, mem_tier: str | None) -> tuple[str, bool] | None:
    """``(checkpoint, in memory)``: what ``--resume`` / ``--resume auto`` / a restart continues,
    the newer of ``<ckpt_dir>/latest`` and (with a local ``--mem-tier``) the run's newest
    snapshot this machine holds (:func:`mfsdp_ckpt.tier.newest_snapshot`, by the step its records
    say); None: neither exists. A snapshot competes with ``latest`` only when it carries the same
    run identity (:mod:`mfsdp_ckpt.format.run_identity`: another run that used this ``--ckpt-dir``
    left it otherwise), and wins when it is at least as new, by the step each manifest records, as
    the recovery decides. A ``latest`` whose manifest cannot be read counts as older than any
    snapshot (its own checks say why when it is the one resumed)."""
    import mfsdp_ckpt
    from mfsdp_ckpt.format.run_identity import identity_of
    from mfsdp_ckpt.read.manifest import read_manifest
    from mfsdp_ckpt.storage import fs as mfsdp_fs
    from mfsdp_ckpt.tier import newest_snapshot

    latest = mfsdp_fs.join(mfsdp_fs.normalize(ckpt_dir), mfsdp_ckpt.LATEST_NAME) if ckpt_dir else None
    durable = latest if latest is not None and mfsdp_fs.exists(latest) else None
    in_tier = bool(ckpt_dir and mem_tier and is_local(mem_tier))
    if durable is not None and in_tier:
        try:
            manifest: dict[str, Any] | None = read_manifest(mfsdp_ckpt.resolve_checkpoint(durable))
        except mfsdp_ckpt.CheckpointError:
            manifest = None
        step = manifest.get("step") if manifest is not None else None
        snapshot = newest_snapshot(mem_tier, ckpt_dir, identity=identity_of(manifest)) if manifest else None
        if snapshot is None and manifest is None:
            snapshot = newest_snapshot(mem_tier, ckpt_dir)
        if snapshot is not None and not (isinstance(step, int) and step > snapshot[0]):
            return snapshot[1], True
        return durable, False
    snapshot = newest_snapshot(mem_tier, ckpt_dir) if in_tier else None
    if snapshot is not None:
        return snapshot[1], True
    return (durable, False) if durable is not None else None


def is_local(path: str | None) -> bool:
    """Whether ``path`` is a local path (or a ``file://`` URL): one this process can read itself."""
    return bool(path) and ("://" not in path or path.startswith("file://"))


def local_missing(path: str) -> bool:
    """Whether ``path`` is a local path where nothing exists (known without the checkpoint layer)."""
    return is_local(path) and not os.path.lexists(path.removeprefix("file://"))


def recorded_settings(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """``(manifest path, settings)``: every setting the checkpoint that ``--resume`` names recorded;
    ``(None, {})`` for a fresh run, or when it cannot be read (the trainer's checks then say why).
    Imports the checkpoint layer, so only a resumed run pays for it (and not for a local path that
    does not exist)."""
    if not args.resume or (args.resume in (LATEST, AUTO) and not args.ckpt_dir):
        return None, {}
    in_tier = args.resume in (LATEST, AUTO) and args.mem_tier  # a snapshot needs no --ckpt-dir on disk yet
    if not in_tier and local_missing(args.ckpt_dir if args.resume in (LATEST, AUTO) else args.resume):
        return None, {}
    import mfsdp_ckpt
    from mfsdp_ckpt.read.manifest import MANIFEST_NAME, read_manifest
    from mfsdp_ckpt.storage import fs as mfsdp_fs

    try:
        start = start_checkpoint(args.resume, args.init_from, args.ckpt_dir, args.mem_tier)
        if start is None:
            return None, {}
        path = mfsdp_ckpt.resolve_checkpoint(start[1])
        saved = read_manifest(path).get("run_config") or {}
    except (mfsdp_ckpt.CheckpointError, OSError, ValueError):
        return None, {}
    settings = saved.get(SETTINGS_KEY) if isinstance(saved, dict) else None
    return mfsdp_fs.join(path, MANIFEST_NAME), dict(settings) if isinstance(settings, dict) else {}

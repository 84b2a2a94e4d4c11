"""Which model a training run builds: a preset (``--model``), a JSON file (``--model-config``), or,
with neither, the model config recorded in the checkpoint the run starts from (``--init-from`` or
``--resume``), so that a checkpoint of any shape (an ``import-hf`` output, say) trains without a
matching preset."""

from __future__ import annotations

import json
import os
from typing import Any

from mfsdp_core.models.gpt import PRESETS, GPTConfig, get_preset

__all__ = ["DEFAULT_PRESET", "model_of_run", "config_from_file", "config_of_checkpoint", "preset_name"]

DEFAULT_PRESET = "tiny"


def preset_name(config: GPTConfig) -> str | None:
    """The name of the preset equal to ``config``, if one is."""
    return next((name for name, preset in PRESETS.items() if preset == config), None)


def config_from_file(path: str) -> GPTConfig:
    """The model config in a JSON file: ours (the fields of :class:`GPTConfig`, as ``inspect --json``
    prints them under ``model_config``), a checkpoint manifest holding ``model_config``, or a Hugging
    Face ``config.json`` of an architecture the HF bridge knows. ValueError: one line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            d: Any = json.load(f)
    except OSError as e:
        raise ValueError(f"--model-config {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model-config {path}: not a JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--model-config {path}: expected a JSON object, got {type(d).__name__}")
    if "model_type" in d or "architectures" in d:  # a Hugging Face config.json
        from mfsdp_ckpt.errors import ConversionError
        from mfsdp_ckpt.hf.registry import architecture_of_hf_config

        try:
            return architecture_of_hf_config(d, path).from_hf_config(d, path)
        except ConversionError as e:
            raise ValueError(f"--model-config {e}") from None
    if isinstance(d.get("model_config"), dict):  # a checkpoint manifest
        d = d["model_config"]
    try:
        return GPTConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--model-config {path}: not a model config: {e}") from None


def config_of_checkpoint(path: str, flag: str) -> GPTConfig:
    """The model config recorded in the manifest of the checkpoint ``path`` names (a directory or a
    ``latest`` pointer). ValueError: one line naming the flag and the checkpoint."""
    import mfsdp_ckpt
    from mfsdp_ckpt.manifest import read_manifest

    try:
        resolved = mfsdp_ckpt.resolve_checkpoint(path)
        saved = read_manifest(resolved).get("model_config")
    except mfsdp_ckpt.CheckpointError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{flag}: {resolved} records no model config; name the model with --model or --model-config")
    try:
        return GPTConfig.from_dict(saved)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{flag}: {resolved}: its model config is not one this trainer builds: {e}") from None


def model_of_run(model: str | None, model_config: str | None, start_from: tuple[str, str] | None) -> tuple[GPTConfig, str]:
    """The run's model config and a name for it in logs and checkpoints.

    ``start_from`` is ``(flag, checkpoint)`` of the checkpoint the run starts from, if any; its
    recorded config is the model when neither ``--model`` nor ``--model-config`` is given (and is
    compared with theirs when one is, by the caller). Without any, the ``tiny`` preset."""
    if model is not None and model_config is not None:
        raise ValueError("--model and --model-config exclude each other (a preset, or a config file)")
    if model is not None:
        return get_preset(model), model
    if model_config is not None:
        config = config_from_file(model_config)
        return config, preset_name(config) or os.path.basename(model_config)
    if start_from is not None:
        flag, path = start_from
        config = config_of_checkpoint(path, flag)
        return config, preset_name(config) or "custom"
    return PRESETS[DEFAULT_PRESET], DEFAULT_PRESET

"""Which model a training run builds.

The families: the reference GPT (this module: a preset with ``--model``, a JSON file with
``--model-config``), Hugging Face ``transformers`` causal LMs (``--hf-model DIR``,
:mod:`cli.hf_source`) and Megatron-Core's ``GPTModel`` (``--mcore-config FILE.json``,
:mod:`cli.mcore_source`). With none of these flags the run builds the model the checkpoint it starts
from (``--init-from`` or ``--resume``) records in its manifest (``model_source``), so that a
checkpoint of any shape (an ``import-hf`` output, say) trains without naming its model again."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import mfsdp_ckpt
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.lora import lora_of_record
from mfsdp_ckpt.format.model_source import (
    MEGATRON_CORE,
    MFSDP_GPT,
    TRANSFORMERS,
    gpt_source,
    model_source_of,
)
from mfsdp_ckpt.mcore.config_check import check_fits_memory as fits_memory
from mfsdp_ckpt.mcore.config_check import estimate_parameters
from mfsdp_ckpt.read.base_manifest import stored_bytes
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_core.models.config import PRESETS, GPTConfig, get_preset

from .lora import parse_lora
from .model_base import ModelSource
from .settings import ModelSettings
from .train_args import DEFAULT_PRESET, MODEL_FLAGS

if TYPE_CHECKING:  # describing the run's model (the launcher's pre-flight) imports no torch; building it does
    import torch
    from torch import nn

    from mfsdp_core.expert_parallel import ExpertMesh

__all__ = [
    "DEFAULT_PRESET",
    "GPTSource",
    "source_of_run",
    "model_of_run",
    "config_from_file",
    "preset_name",
    "MODEL_FLAGS",
]


class GPTSource(ModelSource):
    """The reference ``GPTModel`` (``mfsdp_core.models.gpt``) of ``config``."""

    kind = MFSDP_GPT

    def __init__(self, config: GPTConfig, name: str) -> None:
        self.config, self.name = config, name
        self.vocab_size, self.seq_length, self.num_experts = config.vocab_size, config.seq_length, config.num_experts

    def record(self) -> dict[str, Any]:
        return gpt_source(self.config.to_dict())

    def model_config(self) -> dict[str, Any] | None:
        return self.config.to_dict()

    def min_params(self) -> int:
        return estimate_parameters(self.config.to_dict())

    def describe_differences(self, manifest: dict[str, Any]) -> list[str]:
        """The recorded config fields that differ from this run's; none when the checkpoint
        records no model at all (a converted file's): the model named on the command line is used."""
        record = model_source_of(manifest)
        if record is None:
            return []
        if record.get("kind", MFSDP_GPT) != MFSDP_GPT:
            return [f"kind={record.get('kind')!r} (this run: {MFSDP_GPT!r})"]
        saved = record.get("config") or {}
        try:
            saved = GPTConfig.from_dict(saved).to_dict()  # fields an older manifest lacks count as their defaults
        except (TypeError, ValueError):
            pass  # not a config of ours: every field is reported
        ours = self.config.to_dict()
        return [
            f"{k}={saved.get(k)!r} (this run: {ours.get(k)!r})"
            for k in sorted(set(saved) | set(ours))
            if saved.get(k) != ours.get(k)
        ]

    @classmethod
    def from_record(cls, record: dict[str, Any], where: str) -> "GPTSource":
        try:
            config = GPTConfig.from_dict(record.get("config") or {})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: its model config is not one this trainer builds: {e}") from None
        check_fits_memory(config, f"{where}: model_source.config")
        return cls(config, preset_name(config) or "custom")

    def build(self, seed: int, mesh: ExpertMesh | None, micro_batches: int = 1) -> nn.Module:
        import torch

        from mfsdp_core.models import gpt

        torch.manual_seed(seed)
        model = gpt.GPTModel(self.config)  # whole on every rank, so that each expert starts as in one process
        return gpt.shard_experts(model, mesh) if mesh is not None else model

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        from mfsdp_core.models import gpt

        return gpt.shard_units(model)

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(tokens, labels)
        return logits, model.aux_loss

    def after_step(self, model: nn.Module) -> None:
        import torch.distributed as dist

        from mfsdp_core.models.moe import update_expert_bias

        update_expert_bias(model, dist.group.WORLD if dist.is_initialized() else None)

    def use_global_aux_loss(self, model: nn.Module) -> None:
        import torch.distributed as dist

        from mfsdp_core.models.moe import set_aux_loss_group

        set_aux_loss_group(model, dist.group.WORLD if dist.is_initialized() else None)

    def linear_weights(self, model: nn.Module) -> list[nn.Parameter]:
        from mfsdp_core.models import gpt

        return gpt.linear_weights(model)

    def n_params(self) -> int:
        import torch

        from mfsdp_core.models.gpt import GPTModel

        with torch.device("meta"):
            return sum(p.numel() for p in GPTModel(self.config).parameters())


def family_of(kind: object) -> type[ModelSource] | None:
    """The source class that rebuilds a recorded model of ``kind``; None for a kind we do not build.
    The Hugging Face and Megatron-Core families are imported when named: they import torch and
    their libraries, which describing a reference GPT run (the launcher's pre-flight) does not need."""
    if kind == MFSDP_GPT:
        return GPTSource
    if kind == MEGATRON_CORE:
        from .mcore_source import McoreSource

        return McoreSource
    if kind == TRANSFORMERS:
        from .hf_source import HFSource

        return HFSource
    return None


def source_of_run(model: ModelSettings, start_from: tuple[str, str] | None) -> ModelSource:
    """The model of the run: the flag of :data:`MODEL_FLAGS` given in ``model`` (``check_flags``
    refused several), else the model the start
    checkpoint records (``start_from``: ``(flag, checkpoint)``), else the ``tiny`` preset.
    ValueError: one line naming the flag (and file) at fault."""
    source, record = _base_source_of_run(model, start_from)
    return with_lora(source, model.lora, record)


def with_lora(source: ModelSource, flag: str | None, record: tuple[dict[str, Any], str] | None) -> ModelSource:
    """``source`` with the LoRA adapters of ``--lora`` (``flag``) or of the start checkpoint's
    model record (``(model_source, where)``); ValueError when both name adapters and they differ
    (a checkpoint's adapters are its parameters), or for a family PEFT cannot adapt."""
    wanted = parse_lora(flag) if flag else None
    recorded = lora_of_record(*record) if record is not None else None
    if wanted and recorded and wanted != recorded:
        raise ValueError(
            f"--lora {wanted}: {record[1]} was trained with LoRA {recorded} (the adapters of a checkpoint "
            "cannot change when resuming or starting from it)"
        )
    spec = wanted or recorded
    if spec is None:
        return source
    if source.kind != TRANSFORMERS:
        raise ValueError(
            f"--lora: only for transformers models (--hf-model), not {source.kind} models: PEFT adapts "
            "nn.Linear modules, which the reference GPT's and Megatron-Core's layers are not"
        )
    from .lora_source import LoraSource

    return LoraSource(source, spec, "--lora" if wanted else f"{record[1]}: model_source.lora")


def _start_record(start_from: tuple[str, str] | None) -> tuple[dict[str, Any], str] | None:
    """The start checkpoint's model record and how to name it, or None (none, or unreadable: the
    checks of the start checkpoint say why later)."""
    if start_from is None:
        return None
    flag, path = start_from
    try:
        resolved = mfsdp_ckpt.resolve_checkpoint(path)
        record = model_source_of(read_manifest(resolved))
    except (mfsdp_ckpt.CheckpointError, OSError):
        return None
    return (record, f"{flag}: {resolved}") if record is not None else None


def _base_source_of_run(
    model: ModelSettings, start_from: tuple[str, str] | None
) -> tuple[ModelSource, tuple[dict[str, Any], str] | None]:
    """:func:`source_of_run` before the adapters, and the start checkpoint's model record."""
    given = [(flag, getattr(model, attr)) for attr, flag in MODEL_FLAGS.items() if getattr(model, attr) is not None]
    if given:
        flag, value = given[0]
        if flag == "--mcore-config":
            return family_of(MEGATRON_CORE).from_file(value), _start_record(start_from)
        if flag == "--hf-model":
            return family_of(TRANSFORMERS).from_dir(value), _start_record(start_from)
    if given or start_from is None:
        config, name = model_of_run(model.model, model.model_config)
        return GPTSource(config, name), _start_record(start_from)
    flag, path = start_from
    try:
        resolved = mfsdp_ckpt.resolve_checkpoint(path)
        manifest = read_manifest(resolved)
        record = model_source_of(manifest)
    except mfsdp_ckpt.CheckpointError as e:
        raise ValueError(f"{flag}: {e}") from None
    if record is None:
        raise ValueError(
            f"{flag}: {resolved} records no model config; name the model with {', '.join(MODEL_FLAGS.values())}"
        )
    family = family_of(record.get("kind"))
    if family is None:
        raise ValueError(f"{flag}: {resolved}: model_source.kind {record.get('kind')!r} is not one this trainer builds")
    source = family.from_record(record, f"{flag}: {resolved}")
    check_fits_checkpoint(source, manifest, resolved, f"{flag}: {resolved}")
    if source.name == "custom":
        source.name = recorded_name(manifest, resolved)
    return source, (record, f"{flag}: {resolved}")


def recorded_name(manifest: dict[str, Any], path: str) -> str:
    """The name of the model a checkpoint records, for a config that is no preset: the name the
    run that wrote it used (``run_config.settings.model_name``), else the architecture ``import-hf``
    converted, else the checkpoint's own."""
    run = manifest.get("run_config")
    settings = run.get("settings") if isinstance(run, dict) else None
    name = settings.get("model_name") if isinstance(settings, dict) else None
    if isinstance(name, str) and name:
        return name
    hf = manifest.get("hf")
    if isinstance(hf, dict) and isinstance(hf.get("architecture"), str):
        return f"{hf['architecture']} (imported from {manifest.get('converted_from') or 'Hugging Face'})"
    return f"the model of {path}"


def check_fits_memory(config: GPTConfig, where: str) -> None:
    """ValueError naming ``where`` when a lower bound of the model's fp32 parameters is more than this
    machine's memory (the check a Megatron-Core model gets, on the same config fields): every rank
    builds the whole model before sharding it, so such a config would allocate until the machine
    gives out."""
    try:
        fits_memory(config.to_dict(), where)
    except ConversionError as e:
        raise ValueError(str(e)) from None


def check_fits_checkpoint(source: ModelSource, manifest: dict[str, Any], directory: str, where: str) -> None:
    """ValueError naming ``where`` when the model the checkpoint in ``directory`` records has more
    parameters (a lower bound, :meth:`ModelSource.min_params`) than the checkpoint holds bytes of
    tensors (its manifest's ``total_bytes``, plus its base's when it references one: a LoRA save
    holds only the adapters, its frozen weights are in the base; every parameter is stored in at
    least one byte): a recorded config changed after the save would otherwise be built, at
    whatever size it asks, before the load refused it."""
    need = source.min_params()
    if need is None:
        return
    try:
        stored = stored_bytes(directory, manifest)
    except mfsdp_ckpt.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    if stored is not None and need > stored:
        held = "its base and it hold" if manifest.get("base") is not None else "the checkpoint holds"
        raise ValueError(
            f"{where}: model_source describes at least {need:,} parameters, more than the {stored:,} bytes "
            f"of tensors {held}"
        )


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
        from mfsdp_ckpt.hf.registry import architecture_of_hf_config

        try:
            config = architecture_of_hf_config(d, path).from_hf_config(d, path)
        except ConversionError as e:
            raise ValueError(f"--model-config {e}") from None
    else:
        if isinstance(d.get("model_config"), dict):  # a checkpoint manifest
            d = d["model_config"]
        try:
            config = GPTConfig.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--model-config {path}: not a model config: {e}") from None
    check_fits_memory(config, f"--model-config {path}")
    return config


def model_of_run(model: str | None, model_config: str | None) -> tuple[GPTConfig, str]:
    """The reference GPT's config of ``--model`` or ``--model-config`` and a name for it in logs
    and checkpoints; with neither, the ``tiny`` preset."""
    if model is not None and model_config is not None:
        raise ValueError("--model and --model-config exclude each other (a preset, or a config file)")
    if model is not None:
        return get_preset(model), model
    if model_config is not None:
        config = config_from_file(model_config)
        return config, preset_name(config) or os.path.basename(model_config)
    return PRESETS[DEFAULT_PRESET], DEFAULT_PRESET

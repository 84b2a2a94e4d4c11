"""Export a LoRA run's adapters in PEFT's own format: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base_model, OUT)`` loads on
top of the base model.

The factors are read as the checkpoint holds them (their fp32 master copies after bf16
training), checked (crc32c) as every read is, and named as PEFT names them
(``base_model.model.<module>.lora_A.weight``); the config says what the checkpoint's
``model_source.lora`` records (rank, alpha, targets, dropout). Nothing else of the model is
written: the base model is the one the run started from (``export-hf`` without ``--adapter``
writes the merged model instead). ``OUT`` appears whole or not at all, as an export does.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.keys import group_of
from mfsdp_ckpt.format.lora import LoraSpec, adapter_pairs, lora_of_record, peft_name
from mfsdp_ckpt.format.model_source import TRANSFORMERS, model_source_of
from mfsdp_ckpt.hf.export import ExportResult, weight_source
from mfsdp_ckpt.hf.files import SafetensorsWriter
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.staging import fsync_dir
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_ckpt.write.job import write_and_commit
from mfsdp_core.dtypes import CAST_CHOICES, dtype_by_name

__all__ = ["export_adapter", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def export_adapter(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the LoRA adapters of ``checkpoint`` (a ``--lora`` run's) to the PEFT adapter
    directory ``out`` (a local path), cast to ``dtype`` (default: as stored). ConversionError,
    one line naming the checkpoint, when it holds no adapters (or they disagree with its record);
    ``out`` is refused if it exists unless ``overwrite``. Collective under ``torch.distributed``
    (process 0 writes; the others agree on the outcome)."""
    start = time.perf_counter()
    if isinstance(dtype, str):
        if dtype not in CAST_CHOICES:
            raise ConversionError(f"dtype {dtype!r}: expected one of {', '.join(CAST_CHOICES)}")
        dtype = dtype_by_name(dtype)
    source = fs.normalize(checkpoint)
    destination = destination_for(out, kind="hf")
    job = Job.current()
    with contextlib.ExitStack() as stack:
        reader, spec, factors = job.run(
            f"{destination.final}: adapter not written", _open, stack, source, destination, overwrite
        )
        entries = [(peft_name(key), dtype or reader.dtype(key), tuple(reader.shape(key))) for key in factors]

        def write(tmp: str) -> None:
            if job.main:
                _write(reader, spec, factors, entries, tmp)

        with destination:
            write_and_commit(
                job,
                f"{destination.final}: adapter not written",
                lambda: destination.open(overwrite=overwrite, sources=(source,)),
                write,
                lambda parts: destination.commit(),
                destination.abort,
            )
    return ExportResult(
        path=destination.final,
        architecture="LoRA adapter",
        files=[ADAPTER_WEIGHTS],
        tensors=len(entries),
        bytes=sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in entries),
        seconds=time.perf_counter() - start,
    )


def _open(
    stack: contextlib.ExitStack, source: str, destination: Any, overwrite: bool
) -> tuple[CheckpointReader, LoraSpec, dict[str, str]]:
    """The destination checked, the checkpoint opened (closed with ``stack``), its adapters found:
    the spec and, in key order, each factor's key -> the key to read it from."""
    destination.check(overwrite=overwrite, sources=(source,))
    reader = stack.enter_context(CheckpointReader(source))
    record = model_source_of(reader.manifest) or {}
    try:
        spec = lora_of_record(record, source) if record.get("kind") == TRANSFORMERS else None
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if spec is None:
        raise ConversionError(
            f"{source}: no LoRA adapters to export (its model_source records none; export-hf without --adapter "
            "writes the model)"
        )
    shapes = {k: tuple(reader.shape(k)) for k in reader.keys() if group_of(k) == "model" and reader.is_tensor(k)}
    pairs = adapter_pairs(shapes, spec, source)
    keys = set(reader.keys())
    factors = {
        key: weight_source(reader, keys, key, reader.shape(key)) for pair in sorted(pairs.values()) for key in pair
    }
    return reader, spec, factors


def _write(
    reader: CheckpointReader,
    spec: LoraSpec,
    factors: dict[str, str],
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tmp: str,
) -> None:
    """Process 0: the safetensors file of the factors and PEFT's adapter config, into ``tmp``."""
    writer = SafetensorsWriter(os.path.join(tmp, ADAPTER_WEIGHTS), entries, {"format": "pt"})
    try:
        for (name, dtype, _), read_from in zip(entries, factors.values()):
            writer.write(name, reader.read(read_from).to(dtype).contiguous())
    except BaseException:
        writer.abort()
        raise
    writer.close()
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
        json.dump(_peft_config(spec), f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def _peft_config(spec: LoraSpec) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for these adapters (what its ``save_pretrained`` writes, for
    the fields that matter to a load; the rest take PEFT's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }

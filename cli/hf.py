"""``mfsdp-ckpt export-hf`` / ``import-hf``: the command-line front of :mod:`mfsdp_ckpt.hf`
(parse, call, print; registered by cli/main.py)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import click

from .common import (
    CAST_CHOICES,
    _human,
    _run,
    check_arch,
    check_size,
    is_local,
    refuse_existing_output,
    refuse_missing_checkpoint,
    refuse_missing_mcore_config,
)
from .job import begin, run_offline

if TYPE_CHECKING:
    from mfsdp_ckpt.hf import ExportResult, ImportResult

#: ``--workers``: threads converting at once (the bridge's default when not given: min(4, CPUs))
_WORKERS = click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="threads converting and writing at once (default: min(4, CPUs)); the output is the same bytes for any number",
)


#: ``--max-file-size``: where a checkpoint's data files are cut (import-hf, export-mcore, convert)
MAX_FILE_SIZE = click.option(
    "--max-file-size",
    default="5GB",
    show_default=True,
    help="largest data file of the checkpoint written (5GB, 500MB, 2GiB, bytes); the next tensor starts a new one, "
    "so that the processes of a torchrun job can share the files out",
)


@click.command(name="export-hf", short_help="Export a checkpoint's model weights as a Hugging Face model directory.")
@click.argument("ckpt")
@click.argument("out")
@click.option(
    "--arch",
    default=None,
    help="architecture (llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, qwen3_next); default: inferred from the manifest",
)
@click.option(
    "--dtype",
    type=click.Choice(CAST_CHOICES),
    default=None,
    help="dtype of the exported tensors; default: the checkpoint's",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="largest safetensors file (5GB, 500MB, 2GiB, bytes)"
)
@click.option(
    "--from-mx",
    "from_mx",
    is_flag=True,
    help="MXFP8 checkpoints: export the MX weights as their dequantized rowwise planes (what the model "
    "computed with) instead of the fp32 main params",
)
@click.option(
    "--mx",
    "mx",
    is_flag=True,
    help="MXFP8 checkpoints: export the MX weights raw (weight F8_E4M3/F8_E5M2 + weight_scale_inv F8_E8M0, "
    "transformers' mxfp8 quantization_config); other tensors as usual",
)
@_WORKERS
@click.option(
    "--mcore-config",
    default=None,
    metavar="FILE.json",
    help="CKPT is a Megatron-Core checkpoint: MCore's arguments as JSON (see import-mcore --config)",
)
@click.option(
    "--model-config",
    "model_config",
    default=None,
    metavar="FILE.json",
    help="the model's config, for a CKPT that records none: our model_config fields, a manifest, or an HF "
    "config.json (use with --arch)",
)
@click.option(
    "--adapter",
    is_flag=True,
    help="a LoRA run's checkpoint (--lora): write only its adapters, in PEFT's format (adapter_config.json, "
    "adapter_model.safetensors), for PeftModel.from_pretrained on the base model; without it such a "
    "checkpoint exports merged",
)
@click.option("--overwrite", is_flag=True, help="replace OUT if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def export_hf(
    ckpt: str,
    out: str,
    arch: str | None,
    dtype: str | None,
    max_shard_size: str,
    from_mx: bool,
    mx: bool,
    workers: int | None,
    mcore_config: str | None,
    model_config: str | None,
    adapter: bool,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Export the model weights of checkpoint CKPT as a Hugging Face model directory OUT
    (safetensors shards, index, config.json), loadable by transformers; a LoRA run's with its
    adapters merged, or (--adapter) the adapters alone for PEFT. CKPT may be a Megatron-Core
    torch_dist checkpoint (with --mcore-config)."""
    if adapter:
        given = {
            "--arch": arch is not None,
            "--from-mx": from_mx,
            "--mx": mx,
            "--workers": workers is not None,
            "--mcore-config": mcore_config is not None,
            "--model-config": model_config is not None,
            "--max-shard-size": click.get_current_context().get_parameter_source("max_shard_size")
            != click.core.ParameterSource.DEFAULT,
        }
        if clash := [flag for flag, on in given.items() if on]:
            raise click.UsageError(f"--adapter writes the adapters alone; {', '.join(clash)} is for a model export")
        begin(lambda: _check_adapter_export(ckpt, out, overwrite), output=out)
        from mfsdp_ckpt.hf import export_adapter

        result = run_offline("export-hf", lambda bar: export_adapter(ckpt, out, dtype=dtype, overwrite=overwrite))
        return _report_export(result, as_json)
    if from_mx and mx:
        raise click.UsageError("--from-mx and --mx exclude each other")
    from mfsdp_ckpt.tools import check_apart, is_mcore

    # the config files are read: never written over (every process of a job checks, the library does not)
    _run(lambda: check_apart(out, {"the --model-config file": model_config, "the --mcore-config file": mcore_config}))
    mcore = is_mcore(ckpt)
    if model_config is not None and mcore:
        raise click.UsageError("--model-config is for a canonical CKPT; a Megatron-Core one takes --mcore-config")
    begin(lambda: _check_export(ckpt, out, mcore, arch, max_shard_size, model_config, mcore_config, overwrite), out)
    from mfsdp_ckpt.hf import export
    from mfsdp_ckpt.mcore import export_hf_from_mcore

    mode = "mx" if mx else "from-mx" if from_mx else "weights"
    options = dict(
        arch=arch, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, mode=mode, workers=workers
    )
    if model_config is not None:
        options["model_config"] = _run(lambda: _model_config_file(model_config))
    if mcore:  # a Megatron-Core checkpoint: --mcore-config holds MCore's arguments (docs/mcore.md)
        result = run_offline(
            "export-hf", lambda bar: export_hf_from_mcore(ckpt, out, mcore_config, progress=bar, **options)
        )
    else:
        result = run_offline("export-hf", lambda bar: export(ckpt, out, progress=bar, **options))
    _report_export(result, as_json)


def _check_adapter_export(ckpt: str, out: str, overwrite: bool) -> None:
    """``export-hf --adapter``'s refusals before torch, in :func:`mfsdp_ckpt.hf.export_adapter`'s
    order: OUT, then CKPT."""
    refuse_existing_output(out, overwrite=overwrite, kind="hf")
    refuse_missing_checkpoint(ckpt)


def _check_export(
    ckpt: str,
    out: str,
    mcore: bool,
    arch: str | None,
    max_shard_size: str,
    model_config: str | None,
    mcore_config: str | None,
    overwrite: bool,
) -> None:
    """``export-hf``'s refusals before torch, in the order the export makes them: a
    ``--model-config`` file that cannot be read, then (:func:`mfsdp_ckpt.hf.export`) OUT,
    ``--max-shard-size``, CKPT and ``--arch``. A Megatron-Core CKPT is imported first: a missing
    ``--mcore-config`` file is refused before OUT is checked."""
    if model_config is not None:
        _check_model_config_file(model_config)
    if mcore:
        refuse_missing_mcore_config(mcore_config)
    refuse_existing_output(out, overwrite=overwrite, kind="hf")
    check_size(max_shard_size, "--max-shard-size")
    refuse_missing_checkpoint(ckpt)
    check_arch(arch)


def _report_export(result: ExportResult, as_json: bool) -> None:
    """What an export wrote: one line, or the JSON vocabulary's object."""
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
        return
    click.echo(
        f"wrote {result.path}: {result.architecture}, {result.tensors} tensors, {_human(result.bytes)} "
        f"of data files in {len(result.files)} file(s), {result.seconds:.1f} s"
    )


@click.command(name="import-hf", short_help="Make a checkpoint of a Hugging Face model directory.")
@click.argument("hf_dir")
@click.argument("ckpt")
@click.option(
    "--arch",
    default=None,
    help="architecture (llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, qwen3_next); default: config.json's model_type",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default=None,
    help="dtype every imported tensor is stored in; default: each keeps its HF dtype, and FP8 weights "
    "(quant_method fp8, block scales) are dequantized to the dtype of most of the unquantized tensors "
    "(bfloat16 for DeepSeek-V3) if bfloat16 or float32, else float32",
)
@_WORKERS
@MAX_FILE_SIZE
@click.option("--overwrite", is_flag=True, help="replace CKPT if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def import_hf(
    hf_dir: str,
    ckpt: str,
    arch: str | None,
    dtype: str | None,
    workers: int | None,
    max_file_size: str,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Convert the Hugging Face model directory HF_DIR (config.json + safetensors) into a committed
    checkpoint CKPT with the model weights and config (train from it with --init-from). Block-scaled
    FP8 weights (DeepSeek-V3's format) and MXFP8 exports are dequantized on the way."""
    begin(lambda: _check_import(hf_dir, ckpt, arch, max_file_size, overwrite), output=ckpt)
    from mfsdp_ckpt.hf import import_

    result = run_offline(
        "import-hf",
        lambda bar: import_(
            hf_dir,
            ckpt,
            arch=arch,
            dtype=dtype,
            overwrite=overwrite,
            progress=bar,
            workers=workers,
            max_file_size=max_file_size,
        ),
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
    else:
        for note in result.notes:
            click.echo(f"note: {note}", err=True)
        click.echo(
            f"wrote {result.path}: {result.architecture}, {result.tensors} tensors ({_import_dtypes(result)}), "
            f"{_human(result.bytes)} of data files, {result.seconds:.1f} s"
        )


def _check_import(hf_dir: str, ckpt: str, arch: str | None, max_file_size: str, overwrite: bool) -> None:
    """``import-hf``'s refusals before torch, in :func:`mfsdp_ckpt.hf.import_`'s order:
    ``--max-file-size``, HF_DIR (a directory, in :class:`~mfsdp_ckpt.hf.files.HFDirectory`'s
    words), ``--arch``, CKPT."""
    from mfsdp_ckpt.errors import ConversionError

    check_size(max_file_size, "--max-file-size")
    directory = os.path.abspath(hf_dir)
    if is_local(hf_dir) and not os.path.isdir(directory):
        raise ConversionError(f"{directory}: not a directory")
    check_arch(arch)
    refuse_existing_output(ckpt, overwrite=overwrite)


def _import_dtypes(result: ImportResult) -> str:
    """What ``import-hf`` wrote, in words: the dtypes (``bfloat16``, or ``bfloat16 x20, float32 x3``)
    and, for a quantized source, that its weights were dequantized from it."""
    counts = result.dtypes
    text = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{d} x{n}" for d, n in counts.items())
    if result.quantization != "none":
        text += f"; dequantized from {result.quantization}"
    return text


def _check_model_config_file(path: str) -> None:
    """Refuse a ``--model-config`` file that cannot be opened, as :func:`_model_config_file` does
    (its reader imports numpy and the model's modules)."""
    from mfsdp_ckpt.errors import CheckpointError

    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise CheckpointError(f"--model-config {path}: {e.strerror or e}") from None


def _model_config_file(path: str) -> dict:
    """``--model-config``'s file as the ``model_config`` a manifest records (the trainer's reader;
    its refusal, a ValueError naming the file, is one line, not an internal error)."""
    import dataclasses

    from mfsdp_ckpt.errors import CheckpointError

    from .model_source import config_from_file

    try:
        return dataclasses.asdict(config_from_file(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None

"""``mfsdp-ckpt import-mcore`` / ``export-mcore``: the command-line front of :mod:`mfsdp_ckpt.mcore`
(parse, call, print; registered by cli/main.py)."""

from __future__ import annotations

import json

import click

from .common import (
    _human,
    _run,
    check_size,
    refuse_existing_output,
    refuse_missing_checkpoint,
    refuse_missing_mcore_config,
)
from .hf import MAX_FILE_SIZE
from .job import begin, one_process, run_offline


@click.command(name="import-mcore", short_help="Make a checkpoint of a Megatron-Core torch_dist checkpoint.")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="lay the checkpoint out for this many ranks (one data file per rank)",
)
@click.option(
    "--config",
    "config",
    default=None,
    metavar="FILE.json",
    help="MCore's arguments as JSON (num_attention_heads / num_query_groups / kv_channels, rotary_base, "
    "norm_epsilon, moe_router_topk, ...): what the stored shapes do not tell; default: SRC/mcore_args.json "
    "if present",
)
@click.option("--overwrite", is_flag=True, help="replace DST if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def import_mcore(src: str, dst: str, world_size: int, config: str | None, overwrite: bool, as_json: bool) -> None:
    """Convert the Megatron-Core torch_dist checkpoint SRC into a committed canonical checkpoint
    DST (model weights, fully_reshardable optimizer state, common state as extra.*), streaming
    one layer slice at a time."""
    from mfsdp_ckpt.tools import check_apart

    _run(lambda: check_apart(dst, {"the --config file": config}))  # read first: never replaced with DST
    begin(lambda: _check_import(src, dst, config, overwrite), output=dst)
    from mfsdp_ckpt.mcore import import_mcore as run

    result = run_offline(
        "import-mcore",
        lambda bar: (
            one_process("import-mcore")
            or run(src, dst, world_size=world_size, config=config, overwrite=overwrite, progress=bar)
        ),
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
        return
    for notice in result.notices:
        click.echo(f"note: {notice}", err=True)
    click.echo(
        f"wrote {result.path}: {result.tensors} tensors, {_human(result.bytes)} of data files for world size {result.world_size}"
        + (f", iteration {result.step}" if result.step is not None else "")
        + f", {result.seconds:.1f} s"
    )


def _check_import(src: str, dst: str, config: str | None, overwrite: bool) -> None:
    """``import-mcore``'s refusals before torch, in the order the import makes them: SRC, a
    ``--config`` file that is not there (:func:`~mfsdp_ckpt.mcore.config_check.read_mcore_args`'
    words), DST."""
    refuse_missing_checkpoint(src)
    refuse_missing_mcore_config(config)
    refuse_existing_output(dst, overwrite=overwrite)


@click.command(name="export-mcore", short_help="Write a checkpoint as a Megatron-Core torch_dist checkpoint.")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--moe-norm",
    type=click.Choice(["te", "local"]),
    default="te",
    show_default=True,
    help="which layer spec's names: te = Transformer Engine's (the MoE pre-MLP norm pre_mlp_layernorm.weight; "
    "MLA's latent norms linear_q_up_proj / linear_kv_up_proj.layer_norm_weight), local = MCore's local spec's "
    "(mlp.linear_fc1.layer_norm_weight; MLA: q_layernorm / kv_layernorm, a dense layer's pre_mlp_layernorm)",
)
@MAX_FILE_SIZE
@click.option("--overwrite", is_flag=True, help="replace DST if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def export_mcore(src: str, dst: str, moe_norm: str, max_file_size: str, overwrite: bool, as_json: bool) -> None:
    """Write the canonical checkpoint SRC as the Megatron-Core torch_dist checkpoint DST
    (layer-stacked keys, metadata.json, common.pt), which megatron.core.dist_checkpointing.load reads."""
    begin(lambda: _check_export(src, dst, max_file_size, overwrite), output=dst)
    from mfsdp_ckpt.mcore import export_mcore as run

    result = run_offline(
        "export-mcore",
        lambda bar: run(src, dst, overwrite=overwrite, moe_norm=moe_norm, progress=bar, max_file_size=max_file_size),
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
    else:
        click.echo(
            f"wrote {result.path}: {result.tensors} tensors, {_human(result.bytes)} of data files, {result.seconds:.1f} s"
        )


def _check_export(src: str, dst: str, max_file_size: str, overwrite: bool) -> None:
    """``export-mcore``'s refusals before torch, in :func:`mfsdp_ckpt.mcore.export_mcore`'s order:
    SRC, ``--max-file-size``, DST."""
    refuse_missing_checkpoint(src)
    check_size(max_file_size, "--max-file-size")
    refuse_existing_output(dst, overwrite=overwrite)

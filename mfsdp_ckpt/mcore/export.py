"""``export-mcore``: a canonical checkpoint → a Megatron-Core ``torch_dist`` checkpoint.

Each canonical tensor becomes one chunk of its stack (``model.decoder.layers.3.X`` is the chunk
at layer 3 of ``decoder.layers.X``; expert ``e`` of layer ``l`` the chunk at ``(l, e)``), read
and written one at a time. A model whose layers differ (dense first layers, then MoE ones:
MCore's ``moe_layer_freq`` a list) is written as MCore then stores it, one entry per layer
(``decoder.layers.3.X``, experts ``decoder.layers.3.mlp.experts.experts.linear_fc1.weight``
with the expert axis); MTP layers always so (``mtp.layers.<k>.…``; see
:mod:`~mfsdp_ckpt.mcore.layout`). Next to the DCP files: ``metadata.json`` and ``common.pt`` in the
layout of megatron-core 0.16 (``"common_backend": "torch"``), which 0.16 and later both read,
holding the checkpoint's ``extra.*`` values (``iteration`` …; per-rank RNG states are left
out, and so is a ``model`` / ``optimizer`` value that is not a dict, e.g. our trainer's model
name: Megatron-LM loads its sharded state under those names); and the ``_extra_state`` objects
MCore's loader asks for, each ``[None]`` as MCore writes them without Transformer Engine.
Optimizer state goes out in the ``fully_reshardable`` layout (``optimizer.state.<state>.<key>``,
``main_param`` as ``param``). The output is built in a hidden
sibling and renamed into place when complete; it also carries our ``mfsdp.json`` (checksums of
every chunk: ``mfsdp-ckpt verify`` checks it), which MCore ignores.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.keys import MAIN_PARAM, PARAM_GROUPS, extra_name, is_rng
from mfsdp_ckpt.format.model_source import TRANSFORMERS, model_source_of
from mfsdp_ckpt.hf.workers import DEFAULT_MAX_FILE_SIZE, max_file_bytes
from mfsdp_ckpt.mcore.config import to_mcore_args
from mfsdp_ckpt.mcore.layout import OPTIM_STATE, Naming, extra_state_keys_of, naming_of, target_of
from mfsdp_ckpt.read.manifest import versions
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.sharded.model_shape import ModelShape, recorded_shape
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.builder import CheckpointBuilder, ChunkFileWriter, ChunkRecord
from mfsdp_ckpt.write.job import Job, split_by_size, write_checkpoint

__all__ = ["export_mcore", "McoreExportResult", "BACKEND"]

BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_STATE_NAMES = {MAIN_PARAM: "param"}
#: the top-level names under which Megatron-LM's trainer asks for the sharded state (``model``,
#: ``model<i>`` per virtual pipeline stage, ``optimizer``): ``dist_checkpointing.load`` merges
#: ``common.pt`` into the loaded state, and a value there that is not a dict (e.g. our trainer's
#: ``extra.model``, the model's name) makes that merge, hence the load, fail
_SHARDED_CONTAINERS = re.compile(r"^(?:model\d*|optimizer)$")


@dataclass
class McoreExportResult:
    path: str
    tensors: int
    bytes: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Layout:
    """How the export names and stacks: the model's naming, its layers one by one or stacked,
    MCore's local-spec names or Transformer Engine's (ours)."""

    naming: Naming
    per_layer: bool
    local: bool


def _target(key: str, layout: _Layout) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(stored key, leading index, leading dims) of canonical ``key``; None for what MCore has no
    place for."""
    if key.startswith("model."):
        return target_of(key[len("model.") :], layout.naming, layout.per_layer, layout.local)
    if key.startswith("optim.") and key != PARAM_GROUPS:
        fqn, state = key[len("optim.") :].rsplit(".", 1)
        stored, index, dims = target_of(fqn, layout.naming, layout.per_layer, layout.local)
        return f"{OPTIM_STATE}{_STATE_NAMES.get(state, state)}.{stored}", index, dims
    return None


def _layout(cfg: ModelShape, moe_norm: str) -> _Layout:
    """The export's :class:`_Layout` for ``moe_norm`` (``"te"`` or ``"local"``): per layer when
    the layers differ (dense first layers then MoE ones), as MCore stores such a model."""
    if moe_norm not in ("te", "local"):
        raise ConversionError(f"moe_norm {moe_norm!r}: expected 'te' or 'local'")
    per_layer = cfg.num_experts > 0 and cfg.first_k_dense_replace > 0
    return _Layout(naming_of(cfg), per_layer, moe_norm == "local")


def _exported_shape(reader: MappedReader) -> ModelShape:
    """The model shape the checkpoint's manifest records (``model_config``): export-mcore writes
    only models of our canonical names, so a transformers model, and a manifest with no shape,
    are refused."""
    source = model_source_of(reader.manifest) or {}
    if source.get("kind") == TRANSFORMERS:
        raise ConversionError(
            f"{reader.directory}: holds a transformers model ({source.get('class')}), named as "
            "transformers names it; export-mcore writes GPT models of our canonical names: run "
            "export-hf, import-hf, then export-mcore"
        )
    return recorded_shape(reader.manifest, reader.directory, "export-mcore")


_Stacks = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # stored key -> (dtype, global shape)
_Targets = dict[str, tuple[str, tuple[int, ...]]]  # canonical key -> (stored key, leading index)


def _stack_targets(reader: MappedReader, keys: list[str], layout: _Layout) -> tuple[_Targets, _Stacks]:
    """``(targets, stacks)``: where each exported tensor goes (its stored key and index in the
    stack) and each stack's dtype and shape, refusing tensors that do not stack with the others of
    their stored key, or whose index is outside the model's layers and experts."""
    targets: _Targets = {}
    stacks: _Stacks = {}
    for key in keys:
        if not reader.is_tensor(key):
            continue
        target = _target(key, layout)
        if target is None:
            continue
        stored, index, dims = target
        shape = tuple(dims) + tuple(reader.shape(key))
        dtype = reader.dtype(key)
        if stored in stacks and stacks[stored] != (dtype, shape):
            raise ConversionError(
                f"{reader.directory}: key '{key}': {dtype} {list(reader.shape(key))} does not stack "
                f"with the others of '{stored}' ({stacks[stored][0]} {list(stacks[stored][1][len(index) :])})"
            )
        if any(not 0 <= i < d for i, d in zip(index, dims)):
            raise ConversionError(
                f"{reader.directory}: key '{key}': index {list(index)} outside the model's {list(dims)} "
                "(layers, experts)"
            )
        stacks[stored] = (dtype, shape)
        targets[key] = (stored, index)
    return targets, stacks


def _common_state(reader: MappedReader, keys: list[str]) -> dict[str, Any]:
    """What ``common.pt`` holds: the checkpoint's ``extra.*`` objects (no RNG states, no value that
    would collide with the sharded state Megatron-LM loads), and the step as ``iteration``."""
    common: dict[str, Any] = {}
    for key in keys:
        name = extra_name(key)
        if name is not None and not is_rng(key) and not reader.is_tensor(key):
            value = reader.read(key)
            if _SHARDED_CONTAINERS.match(name) and not isinstance(value, dict):
                continue  # would collide with the sharded state Megatron-LM loads under that name
            common[name] = value
    if "iteration" not in common and isinstance((reader.manifest or {}).get("step"), int):
        common["iteration"] = reader.manifest["step"]
    return common


def _write_files(
    tmp: str,
    reader: MappedReader,
    tasks: list[tuple[str, str]],
    targets: _Targets,
    stacks: _Stacks,
    objects: tuple[str, list[str]] | None,
    progress: Callable[[int, int], None] | None,
) -> list[ChunkRecord]:
    """Write this process's ``tasks`` (canonical key, data file; in export order), each tensor as
    one chunk of its stack, one at a time (memory: one tensor), and ``objects`` (the last file's
    name and the ``_extra_state`` keys, as MCore writes them: ``[None]``) after the chunks of
    that file, when this process writes it. A file is closed once its last entry is in."""
    writer = ChunkFileWriter(tmp)
    records: list[ChunkRecord] = []
    last = {file: j for j, (_, file) in enumerate(tasks)}
    total = sum(reader.shape(k).numel() * reader.dtype(k).itemsize for k, _ in tasks)
    done = 0
    try:
        for j, (key, file) in enumerate(tasks):
            stored, index = targets[key]
            tensor = reader.read(key)
            chunk = tensor.reshape((1,) * len(index) + tuple(tensor.shape))
            records.append(
                writer.write_chunk(stored, chunk, tuple(index) + (0,) * tensor.dim(), stacks[stored][1], file)
            )
            writer.start_writeback(records[-1])
            done += tensor.numel() * tensor.element_size()
            del tensor, chunk
            if objects is not None and file == objects[0] and last[file] == j:
                records += [writer.write_object(k, [None], file) for k in objects[1]]
            if last[file] == j:
                writer.close_file(file)
            if progress is not None:
                progress(done, total)
        if objects is not None and objects[0] not in last:  # no tensor at all: the objects alone
            records += [writer.write_object(k, [None], objects[0]) for k in objects[1]]
    except BaseException:
        writer.discard()
        raise
    writer.close()
    return records


def _write_mcore_files(builder: CheckpointBuilder, args: dict[str, Any], common: dict[str, Any]) -> None:
    """Write what MCore reads besides the data files: ``common.pt``, ``metadata.json``; and
    ``mcore_args.json`` (``args``: import-mcore reads it back)."""
    buf = io.BytesIO()
    torch.save(common, buf)
    fs.write_bytes(fs.join(builder.tmp, "common.pt"), buf.getvalue(), sync=builder.sync)
    fs.write_bytes(fs.join(builder.tmp, "metadata.json"), json.dumps(BACKEND).encode(), sync=builder.sync)
    fs.write_bytes(
        fs.join(builder.tmp, "mcore_args.json"),
        (json.dumps(args, indent=1, sort_keys=True) + "\n").encode(),
        sync=builder.sync,
    )


@dataclass
class _Export:
    """An export planned from the source's metadata (the same on every process of a job): the
    layout, MCore's arguments, each tensor's place in its stack, the stacks, the ``_extra_state``
    keys, and the data file of each tensor. ``common`` (``common.pt``, read from the source's
    ``extra.*`` objects) only on process 0, which writes it."""

    layout: _Layout
    cfg: ModelShape
    args: dict[str, Any]
    targets: _Targets
    stacks: _Stacks
    extra_states: list[str]
    files: list[int]
    common: dict[str, Any] | None


def _plan_export(reader: MappedReader, moe_norm: str, max_bytes: int, main: bool) -> _Export:
    """Everything :func:`export_mcore` will write, refusing what it cannot before anything is."""
    cfg = _exported_shape(reader)
    layout = _layout(cfg, moe_norm)
    args = to_mcore_args(cfg, reader.directory)  # refuses a model it cannot describe, before writing
    keys = reader.keys()
    targets, stacks = _stack_targets(reader, keys, layout)
    files = split_by_size([reader.shape(k).numel() * reader.dtype(k).itemsize for k in targets], max_bytes)
    common = _common_state(reader, keys) if main else None
    return _Export(layout, cfg, args, targets, stacks, extra_state_keys_of(cfg, layout.per_layer), files, common)


def export_mcore(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    moe_norm: str = "te",
    progress: Callable[[int, int], None] | None = None,
    max_file_size: str | int = DEFAULT_MAX_FILE_SIZE,
) -> McoreExportResult:
    """Write the canonical checkpoint ``src`` as the MCore ``torch_dist`` checkpoint ``dst`` (see
    the module docstring). ``moe_norm``: ``"te"``: the names of Transformer Engine's layer spec
    (what GPU runs use; ours), e.g. the MoE pre-MLP norm ``pre_mlp_layernorm.weight``; ``"local"``:
    those of MCore's local spec (the MoE pre-MLP norm ``mlp.linear_fc1.layer_norm_weight``; with
    MLA the latent norms ``self_attention.q_layernorm`` / ``kv_layernorm`` and a dense layer's MLP
    norm ``pre_mlp_layernorm``: :mod:`~mfsdp_ckpt.mcore.layout`). Gradients and MX planes are not
    exported (MCore has no place for them).

    ``max_file_size``: the data files' size, past which the next tensor starts a new one
    (``__0_0.distcp``, ``__0_1.distcp``, ...; MCore's reader takes any number). Collective when
    ``torch.distributed`` is initialised (``torchrun -m mfsdp_cli.main export-mcore``): the
    processes share the data files out, each reading only its own tensors, and process 0 writes
    the rest and commits (:mod:`mfsdp_ckpt.write.job`); the files are the same bytes for any
    number of processes."""
    start = time.perf_counter()
    job = Job.current()
    with contextlib.ExitStack() as stack:
        reader = job.run(f"{os.fspath(dst)}: not written", lambda: stack.enter_context(MappedReader(src)))
        plan = job.run(
            f"{os.fspath(dst)}: not written",
            lambda: _plan_export(reader, moe_norm, max_file_bytes(max_file_size), job.main),
        )
        path = _write(job, reader, plan, os.fspath(dst), overwrite, progress)
        total = sum(reader.shape(k).numel() * reader.dtype(k).itemsize for k in plan.targets)
    return McoreExportResult(path=path, tensors=len(plan.targets), bytes=total, seconds=time.perf_counter() - start)


def _write(
    job: Job,
    reader: MappedReader,
    plan: _Export,
    dst: str,
    overwrite: bool,
    progress: Callable[[int, int], None] | None,
) -> str:
    """The planned export written by the processes of ``job``: each its share of the data files
    (whole files, by bytes), process 0 the manifest, ``common.pt``, ``metadata.json`` and
    ``mcore_args.json``, and the commit."""
    names = [f"__0_{k}.distcp" for k in plan.files]
    sizes = [0] * (max(plan.files, default=0) + 1)
    for k, key in zip(plan.files, plan.targets):
        sizes[k] += reader.shape(key).numel() * reader.dtype(key).itemsize
    mine = set(job.mine(sizes))
    tasks = [(key, name) for k, name, key in zip(plan.files, names, plan.targets) if k in mine]
    last = names[-1] if names else "__0_0.distcp"
    objects = (last, plan.extra_states) if (max(plan.files, default=0) in mine) else None
    common = plan.common or {}
    manifest = {
        "model_config": plan.cfg.to_dict(),
        "step": common.get("iteration") if type(common.get("iteration")) is int else None,
        "versions": versions(),
        "converted_from": reader.directory,
        "key_layout": "mcore-torch_dist",
    }
    path, _, _ = write_checkpoint(
        job,
        dst,
        manifest,
        lambda tmp: (_write_files(tmp, reader, tasks, plan.targets, plan.stacks, objects, progress), None),
        overwrite=overwrite,
        sources=(reader.directory,),
        finish=lambda builder, _: _write_mcore_files(builder, plan.args, common),
    )
    return path

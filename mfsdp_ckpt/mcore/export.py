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
Optimizer state goes out as MCore's distributed optimizer writes it with sharding type
``fully_reshardable``: tensors ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` in the
parameters' shapes (``param``: the fp32 main params, ``main_param``; for an fp32 model the weights
themselves, as MCore keeps them), and the step, one for all parameters, in ``common.pt``'s
``optimizer.optimizer.param_groups[i].step`` next to ``param_state_sharding_type``; no
``optimizer.state.step.*`` (see :func:`_optimizer_common`). The output is built in a hidden
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
from mfsdp_ckpt.format.manifest import versions
from mfsdp_ckpt.format.model_source import TRANSFORMERS, model_source_of
from mfsdp_ckpt.format.names import dcp_data_file
from mfsdp_ckpt.hf.workers import DEFAULT_MAX_FILE_SIZE, max_file_bytes
from mfsdp_ckpt.mcore.config import to_mcore_args
from mfsdp_ckpt.mcore.layout import OPTIM_STATE, Naming, extra_state_keys_of, naming_of, target_of
from mfsdp_ckpt.model.shape import ModelShape, recorded_shape
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import CheckpointBuilder, ChunkFileWriter, ChunkRecord
from mfsdp_ckpt.write.job import split_by_size, write_checkpoint

__all__ = ["export_mcore", "McoreExportResult", "BACKEND"]

BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_STATE_NAMES = {MAIN_PARAM: "param"}
_STEP = "step"
#: what MCore's distributed optimizer matches a saved param group to its own by
#: (``megatron.core.optimizer.param_group_identifier_keys``), with the values of a group of
#: MCore's defaults (no expert parallelism, no decoupled learning rate); ``wd_mult`` is set from
#: the group's weight decay (see :func:`_mcore_group`)
MCORE_GROUP_KEYS = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
SHARDING_TYPE = "fully_reshardable"
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
        if state == _STEP:
            return None  # one step for all parameters, in common.pt's param groups (_optimizer_common)
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


def _weights_as_main_params(reader: MappedReader, keys: list[str]) -> dict[str, str]:
    """``{optim.<fqn>.main_param: model.<fqn>}`` for each fp32 parameter with optimizer state but
    no main params: MCore's distributed optimizer keeps fp32 main params of every parameter (an
    fp32 model's are its weights) and its loader asks for them (``optimizer.state.param.*``), so
    the weights go out there too; import-mcore leaves out main params of the weights' own dtype,
    so the round trip gives the checkpoint back as it was. A parameter of another dtype without
    main params gets none (an upcast copy would come back as main params it never had)."""
    present = set(keys)
    out = {}
    for key in keys:
        if not (key.startswith("optim.") and key.endswith(".exp_avg")) or not reader.is_tensor(key):
            continue
        fqn = key[len("optim.") : -len(".exp_avg")]
        weights, main = f"model.{fqn}", f"optim.{fqn}.{MAIN_PARAM}"
        if main not in present and weights in present and reader.dtype(weights) == torch.float32:
            out[main] = weights
    return out


def _stack_targets(
    reader: MappedReader, keys: list[str], layout: _Layout, reads: dict[str, str]
) -> tuple[_Targets, _Stacks]:
    """``(targets, stacks)``: where each exported tensor goes (its stored key and index in the
    stack) and each stack's dtype and shape, refusing tensors that do not stack with the others of
    their stored key, or whose index is outside the model's layers and experts. ``reads``: entries
    exported from another key's data (:func:`_weights_as_main_params`)."""
    targets: _Targets = {}
    stacks: _Stacks = {}
    for key in [*keys, *reads]:
        if key not in reads and not reader.is_tensor(key):
            continue
        target = _target(key, layout)
        if target is None:
            continue
        stored, index, dims = target
        shape = tuple(dims) + tuple(reader.shape(reads.get(key, key)))
        dtype = reader.dtype(reads.get(key, key))
        if stored in stacks and stacks[stored] != (dtype, shape):
            raise ConversionError(
                f"{reader.directory}: key '{key}': {dtype} {list(shape[len(index) :])} does not stack "
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


def _optimizer_step(reader: MappedReader, keys: list[str]) -> int | float | None:
    """The optimizer step every parameter's state records (``optim.<fqn>.step``; None without
    one). MCore's optimizers keep one step for all parameters (the distributed optimizer in its
    param groups), so steps that differ are refused, naming two keys."""
    step: int | float | None = None
    first = ""
    for key in keys:
        if not (key.startswith("optim.") and key.endswith(f".{_STEP}")):
            continue
        value = reader.read(key)
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConversionError(
                f"{reader.directory}: key '{key}': an optimizer step that is not a number ({type(value).__name__})"
            )
        if step is None:
            step, first = number, key
        elif number != step:
            raise ConversionError(
                f"{reader.directory}: key '{key}': optimizer step {number:g}, but '{first}' {step:g}: MCore's "
                "optimizer keeps one step for all parameters; export the weights alone (reshard --model-only first)"
            )
    return int(step) if isinstance(step, float) and step.is_integer() else step


def _mcore_group(group: dict[str, Any], step: int | float | None) -> dict[str, Any]:
    """``group`` (our hyper-parameters and parameter names) as a param group of MCore's
    distributed optimizer: plus the keys MCore matches groups by (:data:`MCORE_GROUP_KEYS`;
    ``wd_mult`` 0 for a group without weight decay, as MCore groups norms) and the ``step``. The
    ``params`` names stay: MCore's loader replaces them by its own parameters; import-mcore reads
    them back into ``optim.param_groups``."""
    out = dict(group)
    for name, value in MCORE_GROUP_KEYS.items():
        out.setdefault(name, (1.0 if group.get("weight_decay") else 0.0) if name == "wd_mult" else value)
    if step is not None:
        out[_STEP] = step
    return out


def _optimizer_common(reader: MappedReader, keys: list[str], step: int | float | None) -> dict[str, Any] | None:
    """``common.pt``'s ``optimizer``: what MCore's distributed optimizer keeps out of the sharded
    tensors with sharding type ``fully_reshardable`` (``DistributedOptimizer.state_dict()``:
    ``{"optimizer": {"param_groups": [...]}, "param_state_sharding_type": ...}``), the step in
    every param group; from ``optim.param_groups`` (:func:`_mcore_group`), else one group. None
    when the checkpoint carries MCore's own (``extra.optimizer``, an import's): it goes on as it
    came."""
    if PARAM_GROUPS in keys:
        groups = [_mcore_group(g, step) for g in reader.read(PARAM_GROUPS)]
    elif "extra.optimizer" in keys and isinstance(reader.read("extra.optimizer"), dict):
        return None
    else:
        groups = [_mcore_group({}, step)]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING_TYPE}


def _common_state(reader: MappedReader, keys: list[str], optimizer: dict[str, Any] | None) -> dict[str, Any]:
    """What ``common.pt`` holds: the checkpoint's ``extra.*`` objects (no RNG states, no value that
    would collide with the sharded state Megatron-LM loads), the step as ``iteration``, and
    ``optimizer`` (:func:`_optimizer_common`) when given."""
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
    if optimizer is not None:
        common["optimizer"] = optimizer
    return common


def _nbytes(reader: MappedReader, reads: dict[str, str], key: str) -> int:
    """The bytes of exported tensor ``key`` (read from ``reads[key]`` when there)."""
    source = reads.get(key, key)
    return reader.shape(source).numel() * reader.dtype(source).itemsize


def _write_files(
    tmp: str,
    reader: MappedReader,
    tasks: list[tuple[str, str]],
    plan: _Export,
    objects: tuple[str, list[str]] | None,
    progress: Callable[[int, int], None] | None,
) -> list[ChunkRecord]:
    """Write this process's ``tasks`` (canonical key, data file; in export order), each tensor as
    one chunk of its stack (``plan``), one at a time (memory: one tensor), and ``objects`` (the
    last file's name and the ``_extra_state`` keys, as MCore writes them: ``[None]``) after the
    chunks of that file, when this process writes it. A file is closed once its last entry is in."""
    writer = ChunkFileWriter(tmp)
    records: list[ChunkRecord] = []
    last = {file: j for j, (_, file) in enumerate(tasks)}
    total = sum(_nbytes(reader, plan.reads, k) for k, _ in tasks)
    done = 0
    try:
        for j, (key, file) in enumerate(tasks):
            stored, index = plan.targets[key]
            tensor = reader.read(plan.reads.get(key, key))
            chunk = tensor.reshape((1,) * len(index) + tuple(tensor.shape))
            records.append(
                writer.write_chunk(stored, chunk, tuple(index) + (0,) * tensor.dim(), plan.stacks[stored][1], file)
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
    reads: dict[str, str]  # exported tensor -> the key its data is read from, where not itself


def _plan_export(reader: MappedReader, moe_norm: str, max_bytes: int, main: bool) -> _Export:
    """Everything :func:`export_mcore` will write, refusing what it cannot before anything is."""
    cfg = _exported_shape(reader)
    layout = _layout(cfg, moe_norm)
    args = to_mcore_args(cfg, reader.directory)  # refuses a model it cannot describe, before writing
    keys = reader.keys()
    reads = _weights_as_main_params(reader, keys)
    targets, stacks = _stack_targets(reader, keys, layout, reads)
    step = _optimizer_step(reader, keys)  # refuses steps that differ, on every process
    files = split_by_size([_nbytes(reader, reads, k) for k in targets], max_bytes)
    common = None
    if main:
        optimizer = step is not None or any(s.startswith(OPTIM_STATE) for s, _ in targets.values())
        common = _common_state(reader, keys, _optimizer_common(reader, keys, step) if optimizer else None)
    extra_states = extra_state_keys_of(cfg, layout.per_layer)
    return _Export(layout, cfg, args, targets, stacks, extra_states, files, common, reads)


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
        total = sum(_nbytes(reader, plan.reads, k) for k in plan.targets)
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
    names = [dcp_data_file(0, k) for k in plan.files]
    sizes = [0] * (max(plan.files, default=0) + 1)
    for k, key in zip(plan.files, plan.targets):
        sizes[k] += _nbytes(reader, plan.reads, key)
    mine = set(job.mine(sizes))
    tasks = [(key, name) for k, name, key in zip(plan.files, names, plan.targets) if k in mine]
    last = names[-1] if names else dcp_data_file(0)
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
        lambda tmp: (_write_files(tmp, reader, tasks, plan, objects, progress), None),
        overwrite=overwrite,
        sources=(reader.directory,),
        finish=lambda builder, _: _write_mcore_files(builder, plan.args, common),
    )
    return path

"""``import-mcore``: a Megatron-Core ``torch_dist`` checkpoint → a committed canonical checkpoint.

Everything is checked before a byte of tensor data is read: the backend (``metadata.json``), the
entries (each stored entry is model weights, ``fully_reshardable`` optimizer state, an
``_extra_state`` object, common state, or an object left out with a notice; the distributed
optimizer's ``dp_reshardable`` buckets and anything unknown are refused, naming the key), every
``_extra_state`` (``[None]`` or empty: dropped with a notice; anything else, e.g. Transformer
Engine's FP8 scaling state: refused, naming the key, never silently lost), the MCore arguments
(``--config``, ``common.pt``'s ``args``: :mod:`~mfsdp_ckpt.mcore.config_check`), the model config
(:mod:`~mfsdp_ckpt.mcore.config`, its size against the tensors present before the model is built)
and the keys and shapes against our model's. Then each
canonical tensor is read as one slice of its stack (:meth:`McoreSource.read_slice`) and appended
to the checkpoint being built, one at a time; it commits atomically (nothing is left at the
destination on error). The optimizer's step, which MCore's distributed optimizer keeps once for all
parameters in its param groups (``common.pt``'s ``optimizer.optimizer.param_groups[i].step``),
becomes each parameter's ``optim.<fqn>.step`` (a 0-dim fp32 tensor, as torch's Adam keeps it), and
param groups that name their parameters (export-mcore's) become ``optim.param_groups`` again
(:func:`_optimizer_from_common`). ``world_size`` > 1 lays the result out for that many ranks with the
offline reshard (one file per target rank), from a hidden temporary checkpoint next to it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mfsdp_ckpt.errors import ConversionError, one_line, raise_key_problems, shown_list
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.hf.mapping import canonical_shapes
from mfsdp_ckpt.mcore.config import infer_config, read_config_file
from mfsdp_ckpt.mcore.config_check import check_against_tensors, check_mcore_config
from mfsdp_ckpt.mcore.layout import (
    COMMON_STATE,
    OPTIM_DISTRIBUTED,
    OPTIM_STATE,
    Naming,
    Piece,
    is_extra_state,
    layer_view,
    model_pieces,
    naming_of,
    optimizer_pieces,
)
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.model.shape import ModelShape, default_plan, meta_model
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_ckpt.write.destination import destination_for

__all__ = ["import_mcore", "McoreImportResult", "plan_import", "ARGS_FILE"]

ARGS_FILE = "mcore_args.json"  # MCore's arguments, written by export-mcore; read when no config is given


@dataclass
class McoreImportResult:
    path: str
    tensors: int
    bytes: int
    model_config: dict[str, Any]
    world_size: int
    step: int | None
    assumed: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    largest_read: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """docs/cli.md's JSON vocabulary: ``step`` absent (not null) when the source records none."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class ImportPlan:
    """What an import will write: the model shape, the pieces in order, the common state, notices."""

    config: ModelShape
    assumed: list[str]
    pieces: list[Piece]
    common: dict[str, Any]
    notices: list[str]
    has_optimizer: bool
    model: Any
    made: dict[str, Any] = field(default_factory=dict)  # entries made from the common state, not read


def _plain(value: Any) -> Any:
    """A Megatron-LM ``args`` namespace (and any nested one) as a dict: plain data for ``extra.*``."""
    if isinstance(value, argparse.Namespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _empty_extra_state(value: Any) -> bool:
    """An ``_extra_state`` that holds nothing: ``None``, ``[None]`` (MCore without Transformer
    Engine), an empty tensor or empty bytes (TE without FP8)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    return isinstance(value, (bytes, bytearray)) and len(value) == 0


def _check_extra_state(source: McoreSource, key: str) -> None:
    """Refuse an ``_extra_state`` that holds something (Transformer Engine keeps its FP8 scaling
    factors and amax history there): dropping it would lose that state silently."""
    try:
        value = source.read_object(key)
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 - one line naming the key
        raise ConversionError(
            f"{source.directory}: key '{key}': extra state that is not plain data (Transformer Engine "
            f"FP8 metadata?), not carried: {one_line(e, 160)}"
        ) from None
    if not _empty_extra_state(value):
        what = f"a {value.numel()}-byte tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise ConversionError(
            f"{source.directory}: key '{key}': holds Transformer Engine extra state ({what}: FP8 scaling "
            "factors / amax history), which a canonical checkpoint cannot carry; save without FP8 "
            "(or convert its weights to high precision first) before importing"
        )


def _given_arguments(
    source: McoreSource, config: dict[str, Any] | str | os.PathLike | None
) -> tuple[dict[str, Any], str]:
    """``(given, where)``: the MCore arguments to infer the model shape with, and where they come
    from (named in errors): Megatron-LM's ``args`` in the common state, overridden by ``config``
    (a dict or a JSON file; by default the ``mcore_args.json`` export-mcore writes next to the
    checkpoint)."""
    where = "the checkpoint's arguments"
    given: dict[str, Any] = {}
    args = source.common.get("args")
    if isinstance(args, argparse.Namespace):
        where = f"{source.directory}/common.pt 'args'"
        check_mcore_config(vars(args), where)
        given.update(vars(args))
    if config is None and fs.isfile(fs.join(source.directory, ARGS_FILE)):
        config = fs.join(source.directory, ARGS_FILE)  # what export-mcore writes next to the checkpoint
    if config is not None:
        if isinstance(config, dict):
            check_mcore_config(config, "config")
            given.update(config)
            where = "config"
        else:
            given.update(read_config_file(config))  # checked as it is read
            where = os.fspath(config)
    return given, where


@dataclass
class _Entries:
    """The stored entries of an MCore checkpoint by what an import does with them."""

    model: list[str] = field(default_factory=list)  # model weights: imported
    optimizer: list[str] = field(default_factory=list)  # ``fully_reshardable`` optimizer state: imported
    extra_states: list[str] = field(default_factory=list)  # ``_extra_state`` objects: checked empty, dropped
    dropped: list[str] = field(default_factory=list)  # other objects: left out with a notice


def _classify_entries(source: McoreSource) -> _Entries:
    """Sort every stored entry (see :class:`_Entries`; the common state is read apart), refusing
    the distributed optimizer's ``dp_reshardable`` buckets and optimizer entries of unknown layout,
    naming the key."""
    out = _Entries()
    for key in sorted(source.entries):
        tensor = source.shape(key) is not None
        if key.startswith(OPTIM_DISTRIBUTED):
            raise ConversionError(
                f"{source.directory}: key '{key}': the distributed optimizer's 'dp_reshardable' layout "
                "(flat buckets that only its writer's bucket layout can cut) is not read; save the "
                "optimizer with sharding_type 'fully_reshardable' and import that"
            )
        if key.startswith(OPTIM_STATE) and tensor:
            out.optimizer.append(key)
        elif key.startswith("optimizer."):
            raise ConversionError(
                f"{source.directory}: key '{key}': an optimizer entry of a layout import-mcore does not "
                f"know (expected {OPTIM_STATE}<state>.<parameter>)"
            )
        elif is_extra_state(key):
            out.extra_states.append(key)
        elif key.split("/", 1)[0] == COMMON_STATE:
            continue  # read with the common state
        elif tensor:
            out.model.append(key)
        else:
            out.dropped.append(key)
    return out


def _entry_notices(entries: _Entries, assumed: list[str]) -> list[str]:
    """What an import reports of the entries it leaves out and the defaults it assumed."""
    notices = []
    if entries.extra_states:
        notices.append(
            f"dropped {len(entries.extra_states)} empty _extra_state entries (no Transformer Engine state in them)"
        )
    if entries.dropped:
        dropped = entries.dropped
        notices.append(f"left out {len(dropped)} stored objects that are not model state ({shown_list(dropped, 3)})")
    if assumed:
        notices.append(
            "assumed MCore's defaults for "
            + ", ".join(assumed)
            + " (import-mcore --config, export-hf --mcore-config set them)"
        )
    return notices


def _check_model_pieces(
    source: McoreSource,
    pieces: list[Piece],
    shape_of: dict[str, tuple[int, ...]],
    expected: dict[str, torch.Size],
) -> None:
    """Refuse, in one error listing every problem, model pieces that do not give our model's
    tensors exactly: two stored keys for one tensor, missing or unexpected tensors, wrong shapes."""
    produced: dict[str, Piece] = {}
    twice = []
    for p in pieces:
        if p.canonical in produced:
            twice.append(f"{p.stored} and {produced[p.canonical].stored} -> {p.canonical}")
        produced[p.canonical] = p
    stored_shape = {p.canonical: torch.Size(shape_of[p.stored][len(p.index) :]) for p in pieces}
    raise_key_problems(
        source.directory,
        [
            ("two stored keys give one tensor", twice),
            ("missing (our model has them)", sorted(set(expected) - set(produced))),
            (
                "unexpected stored keys (our model has no place for them)",
                sorted({produced[c].stored for c in set(produced) - set(expected)}),
            ),
            (
                "shape mismatch",
                sorted(
                    f"{produced[c].stored}{list(produced[c].index)} {list(stored_shape[c])}, model {list(expected[c])}"
                    for c in set(produced) & set(expected)
                    if stored_shape[c] != expected[c]
                ),
            ),
        ],
        ConversionError,
    )


def _check_optimizer_piece(source: McoreSource, key: str, piece: Piece, expected: dict[str, torch.Size]) -> None:
    """Refuse optimizer state (stored ``key``, one ``piece`` of it) of a parameter our model does
    not have, or of another shape than the parameter's."""
    model_of = "model." + piece.canonical[len("optim.") :].rsplit(".", 1)[0]
    if model_of not in expected:
        raise ConversionError(
            f"{source.directory}: key '{key}': optimizer state of '{model_of[len('model.') :]}', "
            "which our model does not have"
        )
    shape = torch.Size(source.shape(key)[len(piece.index) :])
    if shape != expected[model_of]:
        raise ConversionError(
            f"{source.directory}: key '{key}'{list(piece.index)}: shape {list(shape)}, the parameter's "
            f"{list(expected[model_of])}"
        )


def _optimizer_plan(
    source: McoreSource,
    keys: list[str],
    shape_of: dict[str, tuple[int, ...]],
    expected: dict[str, torch.Size],
    naming: Naming,
) -> tuple[list[Piece], list[str]]:
    """``(pieces, same_dtype)``: the checked pieces of the optimizer entries ``keys``, and the main
    params left out for being of the weights' own dtype (a canonical checkpoint stores the weights
    once)."""
    pieces: list[Piece] = []
    same_dtype = []
    for key in keys:
        state, ps = optimizer_pieces(key, source.shape(key), naming)
        weights = key[len(OPTIM_STATE) + len(state) + 1 :]
        if state == "param" and weights in shape_of and source.dtype(weights) == source.dtype(key):
            same_dtype.append(key)
            continue
        for p in ps:
            _check_optimizer_piece(source, key, p, expected)
        pieces += ps
    return pieces, same_dtype


#: the keys export-mcore adds to a param group of ours (MCore's group identifiers, the step)
_ADDED_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "step")


def _optimizer_from_common(directory: str, common: dict[str, Any], pieces: list[Piece]) -> dict[str, Any]:
    """The canonical entries the common state's ``optimizer`` (MCore's distributed optimizer's
    ``state_dict()``) gives for the optimizer state of ``pieces``: ``optim.<fqn>.step`` for every
    parameter with state, from the one step of the param groups; and ``optim.param_groups`` when
    every group names its parameters (export-mcore's), without the keys export-mcore added. Takes
    ``optimizer`` out of ``common`` when the groups went to ``optim.param_groups``. Refuses param
    groups of different steps (MCore's own loader asserts one)."""
    outer = common.get("optimizer")
    groups = outer.get("optimizer", {}).get("param_groups") if isinstance(outer, dict) else None
    if not pieces or not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return {}
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) > 1:
        raise ConversionError(
            f"{directory}/common.pt: 'optimizer' param groups of different steps {sorted(steps)}: MCore "
            "keeps one step for all parameters"
        )
    made: dict[str, Any] = {}
    for fqn in sorted({p.canonical[len("optim.") :].rsplit(".", 1)[0] for p in pieces}):
        for step in steps:
            made[f"optim.{fqn}.step"] = torch.tensor(float(step), dtype=torch.float32)
    if all(isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"]) for g in groups):
        made[PARAM_GROUPS] = [{k: v for k, v in g.items() if k not in _ADDED_GROUP_KEYS} for g in groups]
        del common["optimizer"]
    return made


def _check_model_size(source: McoreSource, cfg: ModelShape, shape_of: dict[str, tuple[int, ...]]) -> None:
    """Before the model is built: the model config the shapes and arguments gave passes the
    bounds of every MCore config, and the parameters it describes fit in the elements the
    checkpoint's model tensors hold (whose chunks the files already back)."""
    fields = cfg.to_dict()
    check_mcore_config(fields, f"{source.directory} (the model its tensors describe)")
    check_against_tensors(fields, sum(math.prod(s) for s in shape_of.values()), source.directory)


def plan_import(source: McoreSource, config: dict[str, Any] | str | os.PathLike | None = None) -> ImportPlan:
    """Classify every stored entry, infer and check the model shape, and map the keys (see the
    module docstring); reads only small objects (``_extra_state``, common state), no tensor data.
    Every tensor entry's chunks are checked to cover it exactly once inside the bytes its files
    hold before it is expanded per layer and expert, so a stored shape never costs more than the
    files back."""
    given, where = _given_arguments(source, config)
    entries = _classify_entries(source)
    for key in entries.model + entries.optimizer:  # before expanding per layer / expert: the chunks must back the shape
        source.reader.check_entry(key)
    shape_of = {k: source.shape(k) for k in entries.model}
    try:
        view = layer_view(shape_of)
    except ValueError as e:
        raise ConversionError(f"{source.directory}: {e}") from None
    cfg, assumed = infer_config(
        view.shapes.get, given, source.directory, where, layers=view.layers.get, mtp_layers=view.mtp
    )
    _check_model_size(source, cfg, shape_of)
    for key in entries.extra_states:
        _check_extra_state(source, key)
    notices = list(source.notices) + _entry_notices(entries, assumed)

    naming = naming_of(cfg)
    pieces = [p for k in entries.model for p in model_pieces(k, shape_of[k], naming)]
    model = meta_model(cfg)
    expected = canonical_shapes(cfg, model)
    _check_model_pieces(source, pieces, shape_of, expected)
    optim_pieces, same_dtype = _optimizer_plan(source, entries.optimizer, shape_of, expected, naming)
    if same_dtype:
        notices.append(
            f"left out {len(same_dtype)} '{OPTIM_STATE}param.*' entries ({same_dtype[0]}, ...): main params "
            "of the weights' own dtype (a canonical checkpoint stores the weights once)"
        )
    common = {k: _plain(v) for k, v in source.common.items()}
    made = _optimizer_from_common(source.directory, common, optim_pieces)
    return ImportPlan(cfg, assumed, pieces + optim_pieces, common, notices, bool(optim_pieces), model, made)


def _write(
    source: McoreSource, plan: ImportPlan, dst: str, overwrite: bool, progress: Callable[[int, int], None] | None
) -> tuple[str, int]:
    step = plan.common.get("iteration")
    manifest = {
        "writer": writer_layout(1, default_plan(plan.config, plan.model)),
        "model_config": plan.config.to_dict(),
        "step": step if type(step) is int and step >= 0 else None,
        "include_grads": False,
        "has_optimizer": plan.has_optimizer,
        "versions": versions(),
        "converted_from": source.directory,
        "mcore": {"backend": source.backend, "assumed": plan.assumed, "notices": plan.notices},
    }
    total = sum(
        source.entries[p.stored].size[len(p.index) :].numel() * source.dtype(p.stored).itemsize for p in plan.pieces
    )
    done = 0
    with CheckpointBuilder(dst, manifest, overwrite=overwrite, sources=(source.directory,)) as builder:
        spare = None  # the last piece's tensor, written already: the next one of its shape reuses it
        for p in plan.pieces:
            tensor = source.read_slice(p.stored, p.index, reuse=spare)
            record = builder.add_tensor(p.canonical, tensor)
            builder.start_writeback(record)
            done += tensor.numel() * tensor.element_size()
            spare = tensor
            if progress is not None:
                progress(done, total)
        for key, value in plan.made.items():
            if isinstance(value, torch.Tensor):
                builder.add_tensor(key, value)
            else:
                builder.add_object(key, value)
        for name, value in sorted(plan.common.items()):
            builder.add_object(f"extra.{name}", value)
        return builder.commit(), total


def import_mcore(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    world_size: int = 1,
    config: dict[str, Any] | str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> McoreImportResult:
    """Convert the MCore ``torch_dist`` checkpoint ``src`` into a committed canonical checkpoint
    ``dst`` (``model.*``, ``optim.*`` from ``fully_reshardable`` optimizer state, the common state
    as ``extra.*``), laid out for ``world_size`` ranks (one file per rank).

    ``config``: MCore's arguments (a dict or a JSON file) for what the shapes do not tell; at
    least one of ``num_attention_heads``, ``num_query_groups``, ``kv_channels`` unless the
    checkpoint's common state carries Megatron-LM's ``args``. Raises a one-line
    :class:`~mfsdp_ckpt.errors.ConversionError` naming the file and key for anything it cannot
    carry (see the module docstring); nothing is left at ``dst`` then."""
    start = time.perf_counter()
    if world_size < 1:
        raise ConversionError(f"--world-size {world_size}: must be at least 1")
    with McoreSource.open(src) as source:
        plan = plan_import(source, config)
        final = fs.normalize(dst)
        if world_size == 1:
            path, total = _write(source, plan, final, overwrite, progress)
        else:
            destination = destination_for(final)
            destination.check(overwrite=overwrite, sources=(source.directory,))
            tmp = destination.scratch_path("mcore")
            try:
                _, total = _write(source, plan, tmp, False, progress)
                path = reshard(tmp, final, world_size=world_size, overwrite=overwrite).path
            finally:
                fs.remove_tree(tmp)
        largest = source.largest_read
    step = plan.common.get("iteration")
    return McoreImportResult(
        path=path,
        tensors=len(plan.pieces),
        bytes=total,
        model_config=plan.config.to_dict(),
        world_size=world_size,
        step=step if type(step) is int else None,
        assumed=plan.assumed,
        notices=plan.notices,
        largest_read=largest,
        seconds=time.perf_counter() - start,
    )

"""Import a Hugging Face model directory as a committed canonical checkpoint, streaming.

The directory is input from anywhere and is checked before it is believed (see
:class:`~mfsdp_ckpt.hf.files.HFDirectory` for the files themselves). ``config.json`` becomes our
model config, every field type- and bound-checked (every field we cannot express is named in one
error); the layer and expert counts it declares are checked against the tensors the safetensors
headers list *before* anything is expanded per layer or expert, so a declared size never costs
more than the files can back; then the headers are checked against the mapping (missing,
unexpected and misshapen tensors, pieces in mixed dtypes, integer or bool dtypes where the model
has floating-point weights, all named) before a byte of data is read; then each conversion reads
its HF tensors straight into their places in the canonical tensor (a merge without a copy) and
appends the result to the checkpoint being built. Several worker threads (``workers=``) read and
merge at once; they append in conversion order, so the checkpoint is the same for any number.
Nothing is visible at the destination until the checkpoint commits.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mfsdp_ckpt.errors import ConversionError, raise_key_problems
from mfsdp_ckpt.format.checksum import payload_crc32c
from mfsdp_ckpt.hf.config import model_type_of
from mfsdp_ckpt.hf.files import HFDirectory, HFTensor, hf_safetensors_name, short_repr
from mfsdp_ckpt.hf.mapping import (
    Architecture,
    Conversion,
    check_against,
    count_their_keys,
    expand,
    indices_held,
)
from mfsdp_ckpt.hf.mx import (
    E8M0,
    EXTENSION,
    fqn_of,
    module_of,
    mx_key,
    mx_plan,
    parse_quantization_config,
    scale_name,
)
from mfsdp_ckpt.hf.registry import architecture_of_hf_config, architectures, get_architecture
from mfsdp_ckpt.hf.workers import Staging, Turns, check_workers, run_tasks
from mfsdp_ckpt.progress import progress_adder
from mfsdp_ckpt.read.manifest import versions, writer_layout
from mfsdp_ckpt.sharded.model_shape import ModelShape, ShapeModel, default_plan, meta_model
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core.mx import (
    BLOCK,
    MXFormat,
    MXNativeUnavailableWarning,
    dequantize,
    quantize,
)
from mfsdp_core.mx_planes import ORIENTATIONS
from mfsdp_core.plan import ModelPlan

__all__ = ["import_", "ImportResult"]


#: the ``config.json`` fields that may declare our layer / expert counts, in the order named
_COUNT_FIELDS = {"num_layers": ("num_hidden_layers",), "num_experts": ("num_local_experts", "num_experts")}


def _field_of(config: dict[str, Any], ours: str, value: int) -> str:
    """The ``config.json`` field that gave our ``ours`` its ``value`` (for messages)."""
    names = _COUNT_FIELDS[ours]
    return next((n for n in names if config.get(n) == value), f"{names[0]} (default)")


def check_counts_against_files(
    architecture: Architecture, cfg: ModelShape, config: dict[str, Any], present: dict[str, HFTensor], config_path: str
) -> None:
    """Refuse, before anything is expanded per layer or expert, a config that declares more
    layers or experts than the files hold tensors for, or implies more HF tensors than they
    hold: the expansion is then bounded by the size of the headers, never by a number in
    ``config.json``. (Fewer declared than held shows up later as unexpected tensors.)"""
    layers, experts = indices_held(architecture, cfg, present)
    if cfg.num_layers > len(layers):
        field = _field_of(config, "num_layers", cfg.num_layers)
        raise ConversionError(
            f"{config_path}: {field}={cfg.num_layers} declares more layers than the safetensors files "
            f"hold: {len(layers)} layers"
        )
    if cfg.num_experts > len(experts):
        field = _field_of(config, "num_experts", cfg.num_experts)
        raise ConversionError(
            f"{config_path}: {field}={cfg.num_experts} declares more experts than the safetensors files "
            f"hold: {len(experts)} experts"
        )
    planned = count_their_keys(architecture, cfg)
    if planned > len(present):
        raise ConversionError(
            f"{config_path}: this {architecture.name} config implies {planned} tensors; the safetensors "
            f"files hold {len(present)}"
        )


@dataclass
class _MXLayout:
    """What an MX directory's ``quantization_config`` makes of the mapping: the format, the
    conversions (canonical keys) whose HF weights are all quantized, and the shape each of their
    ``weight_scale_inv`` tensors must have."""

    fmt: MXFormat | None = None
    quantized: set[str] = field(default_factory=set)
    scale_shapes: dict[str, torch.Size] = field(default_factory=dict)


def _mx_layout(
    hf: HFDirectory, conversions: list[Conversion], shapes: dict[str, torch.Size], planned: dict[str, torch.Size]
) -> _MXLayout:
    """Read ``quantization_config`` (none: nothing is MX) and check the quantized weights against
    it and the files, before anything is read: every quantized module has an HF weight in the
    mapping; a canonical tensor's HF pieces are all quantized or none; its shape is MX-able
    ([M, K], both multiples of 32, as the runtime needs for both orientations); each quantized
    weight is in the recorded element dtype, with a ``weight_scale_inv`` in F8_E8M0 of shape
    [M, K/32]. Each refusal is one line naming the file and the tensor (or config field)."""
    config_path = os.path.join(hf.path, "config.json")
    if hf.config.get("quantization_config") is None:
        return _MXLayout()
    fmt, modules = parse_quantization_config(hf.config["quantization_config"], config_path)
    out = _MXLayout(fmt)
    field_name = f"{config_path}: quantization_config.{EXTENSION}.quantized_modules"
    unknown = sorted(m for m in modules if f"{m}.weight" not in planned)
    if unknown:
        raise ConversionError(f"{field_name} names {short_repr(unknown[0])}, which has no weight in this mapping")
    for conv in conversions:
        flags = [t.endswith(".weight") and module_of(t) in modules for t in conv.theirs]
        if not any(flags):
            continue
        if not all(flags):
            raise ConversionError(
                f"{field_name}: {', '.join(t for t, f in zip(conv.theirs, flags) if not f)} not quantized "
                f"but {', '.join(t for t, f in zip(conv.theirs, flags) if f)} are (one tensor, {conv.ours})"
            )
        shape = shapes[conv.ours]
        if len(shape) != 2 or shape[0] % BLOCK or shape[1] % BLOCK:
            raise ConversionError(
                f"{field_name}: {conv.theirs[0]} is quantized but {conv.ours} {tuple(shape)} cannot be MX "
                f"(both dimensions must be multiples of {BLOCK})"
            )
        out.quantized.add(conv.ours)
        for key in conv.theirs:
            _check_mx_pair(hf, key, planned[key], fmt)
            out.scale_shapes[scale_name(key)] = torch.Size((planned[key][0], planned[key][1] // BLOCK))
    return out


def _check_mx_pair(hf: HFDirectory, key: str, shape: torch.Size, fmt: MXFormat) -> None:
    """One quantized HF weight and its scale tensor, against the recorded format (see
    :func:`_mx_layout`); a missing weight is left to the general check, which names it."""
    weight = hf.tensors.get(key)
    if weight is None:
        return
    where = os.path.join(hf.path, weight.file)
    if weight.dtype != fmt.dtype:
        raise ConversionError(
            f"{where}: tensor {key!r} is {hf_safetensors_name(weight.dtype)}; quantization_config says "
            f"MX {fmt.element} ({hf_safetensors_name(fmt.dtype)})"
        )
    name = scale_name(key)
    scale = hf.tensors.get(name)
    if scale is None:
        raise ConversionError(f"{where}: quantized tensor {key!r} has no {name!r} (its MX scales)")
    where = os.path.join(hf.path, scale.file)
    if scale.dtype != E8M0:
        raise ConversionError(
            f"{where}: tensor {name!r} is {hf_safetensors_name(scale.dtype)}, expected F8_E8M0 (MX scales)"
        )
    want = torch.Size((shape[0], shape[1] // BLOCK))
    if scale.shape != want:
        raise ConversionError(
            f"{where}: tensor {name!r} has shape {tuple(scale.shape)}, expected {tuple(want)} "
            f"(one scale per 32 elements of each row of {key!r} {tuple(shape)})"
        )


def _planes(fqn: str, weight: torch.Tensor, fmt: MXFormat) -> list[tuple[str, torch.Tensor]]:
    """The four MX planes of ``weight`` (fp32 ``[M, K]``), as the runtime derives them, by key."""
    out = []
    with warnings.catch_warnings():  # the native cast and the reference give the same bytes
        warnings.simplefilter("ignore", MXNativeUnavailableWarning)
        for axis, (data_plane, scale_plane) in ORIENTATIONS.items():
            data, scale = quantize(weight, fmt, axis)
            out += [(mx_key(fqn, data_plane), data), (mx_key(fqn, scale_plane), scale)]
    return out


def _staged(
    hf: HFDirectory, conv: Conversion, shape: torch.Size, cfg: ModelShape, mx: _MXLayout, staging: Staging
) -> tuple[torch.Tensor, int]:
    """The canonical tensor of ``conv`` and the HF bytes read for it. Its HF tensors are read
    straight into their places in the worker's staging buffer (the rule's views: a merge without
    a copy); MX pieces are dequantized into theirs; a rule without views merges copies."""
    theirs = [hf.tensors[k] for k in conv.theirs]
    nbytes = sum(t.shape.numel() * t.dtype.itemsize for t in theirs)
    quantized = conv.ours in mx.quantized
    dtype = torch.float32 if quantized else theirs[0].dtype  # the pieces share one dtype (checked)
    out = staging.tensor(dtype, shape)
    views = conv.rule.views(out, cfg)
    if views is None:
        pieces = [_read_piece(hf, key, quantized) for key in conv.theirs]
        return out.copy_(conv.rule.merge(pieces, cfg)), nbytes + (_scale_bytes(hf, conv) if quantized else 0)
    for key, view in zip(conv.theirs, views):
        if quantized:
            view.copy_(_read_piece(hf, key, True).reshape(view.shape))
        else:
            hf.read(key, out=view)
    return out, nbytes + (_scale_bytes(hf, conv) if quantized else 0)


def _read_piece(hf: HFDirectory, key: str, quantized: bool) -> torch.Tensor:
    """HF tensor ``key``; an MX weight dequantized to fp32 with its ``weight_scale_inv``."""
    piece = hf.read(key)
    return dequantize(piece, hf.read(scale_name(key)), "row") if quantized else piece


def _scale_bytes(hf: HFDirectory, conv: Conversion) -> int:
    return sum(hf.tensors[scale_name(k)].shape.numel() for k in conv.theirs)


def _convert_all(
    hf: HFDirectory,
    builder: CheckpointBuilder,
    conversions: list[Conversion],
    shapes: dict[str, torch.Size],
    cfg: ModelShape,
    mx: _MXLayout,
    workers: int,
    progress: Callable[[int, int], None] | None,
    total: int,
) -> int:
    """Every conversion, on ``workers`` threads: each reads and merges one tensor (and computes
    its crc32c and, for MX, its planes) in parallel with the others, then appends it to the
    checkpoint in conversion order (:class:`~mfsdp_ckpt.hf.workers.Turns`), so the data file is
    the same bytes for any number of workers. Checks that every HF tensor was consumed and
    every canonical tensor written exactly once. Returns the tensor bytes written."""
    consumed: Counter[str] = Counter()
    written: Counter[str] = Counter()
    written_bytes = [0]  # what went into the data file (canonical tensors and MX planes), not what was read
    turns = Turns()

    def do(staging: Staging, task: tuple[int, Conversion]) -> int:
        i, conv = task
        tensor, nbytes = _staged(hf, conv, shapes[conv.ours], cfg, mx, staging)
        if tensor.shape != shapes[conv.ours]:
            raise ConversionError(
                f"{hf.path}: {conv.ours} came out {tuple(tensor.shape)}, expected {tuple(shapes[conv.ours])}"
            )
        crc = payload_crc32c(tensor)
        planes = _planes(fqn_of(conv.ours), tensor, mx.fmt) if conv.ours in mx.quantized else []
        with turns.of(i):  # appends in conversion order; the counters are touched only here
            records = [builder.add_tensor(conv.ours, tensor, crc32c=crc)]
            for key, plane in planes:
                records.append(builder.add_tensor(key, plane))
            written[conv.ours] += 1
            written_bytes[0] += sum(t.numel() * t.element_size() for t in [tensor, *(pl for _, pl in planes)])
            consumed.update(conv.theirs)
            if conv.ours in mx.quantized:
                consumed.update(scale_name(k) for k in conv.theirs)
        for record in records:  # off the turn: the next append goes on while the disk starts on this one
            builder.start_writeback(record)
        return nbytes

    report = progress_adder(progress, total)

    run_tasks(list(enumerate(conversions)), workers, Staging, do, progress=report, turns=turns)
    wrong = sorted([k for k in hf.tensors if consumed[k] != 1] + [k for k in shapes if written[k] != 1])
    if wrong:
        raise ConversionError(f"{hf.path}: not consumed / written exactly once: {', '.join(wrong)}")
    return written_bytes[0]


@dataclass
class ImportResult:
    path: str
    architecture: str
    tensors: int
    bytes: int  # tensor bytes written into the checkpoint's data file
    model_config: dict[str, Any]
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _architecture_for(hf: HFDirectory, arch: str | None) -> Architecture:
    """The architecture to import ``hf`` as: ``arch`` if given (refused when ``config.json``
    names another known ``model_type``: the two would disagree on every key), else the one
    ``config.json`` names."""
    source = hf.path
    if arch is None:
        return architecture_of_hf_config(hf.config, source)
    architecture = get_architecture(arch)
    model_type = model_type_of(hf.config, source)
    known = {a.model_type for a in architectures().values()}
    if model_type in known and model_type != architecture.model_type:
        raise ConversionError(f"{source}: config.json says model_type {model_type!r}, --arch says {arch!r}")
    return architecture


def _model_shape(hf: HFDirectory, architecture: Architecture) -> ModelShape:
    """The model shape ``config.json`` declares, as ``architecture`` reads it; refused when the
    architecture's own rules cannot map it (a ``from_hf_config`` that accepted it has a bug)."""
    cfg = architecture.from_hf_config(hf.config, hf.path)
    problems = architecture.unsupported(cfg)
    if problems:
        raise ConversionError(f"{hf.path}: {architecture.name}: {'; '.join(problems)}")
    return cfg


def _hf_shapes(conversions: list[Conversion], shapes: dict[str, torch.Size], cfg: ModelShape) -> dict[str, torch.Size]:
    """The shape each HF tensor of the mapping must have, by HF key, from the canonical shapes."""
    planned: dict[str, torch.Size] = {}
    for conv in conversions:
        planned.update(zip(conv.theirs, conv.rule.their_shapes(shapes[conv.ours], cfg)))
    return planned


def _check_headers(
    hf: HFDirectory,
    architecture: Architecture,
    conversions: list[Conversion],
    planned: dict[str, torch.Size],
    expected: dict[str, torch.Size],
) -> None:
    """Refuse, in one error naming every problem and before a byte of data is read, files whose
    headers do not match the mapping: missing, unexpected and misshapen tensors, the pieces of one
    canonical tensor in mixed dtypes, and non-floating dtypes over the model's weights."""
    present = hf.tensors
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    misshapen = sorted(
        f"{k} (file {tuple(present[k].shape)}, config {tuple(expected[k])})"
        for k in set(expected) & set(present)
        if present[k].shape != expected[k]
    )
    mixed = sorted(
        conv.ours for conv in conversions if len({present[k].dtype for k in conv.theirs if k in present}) > 1
    )
    # every parameter of our model is floating-point: an integer / bool dtype over one is a
    # relabelled header (the same bytes would be read as numbers of another kind), not weights;
    # nor is E8M0 (powers of two only: MX scales, which travel next to their weights)
    not_floating = sorted(
        f"{k} ({hf_safetensors_name(present[k].dtype)} in {present[k].file})"
        for k in set(planned) & set(present)
        if not present[k].dtype.is_floating_point or present[k].dtype == E8M0
    )
    raise_key_problems(
        hf.path,
        [
            ("missing tensors", missing),
            (f"unexpected tensors (no mapping in {architecture.name})", unexpected),
            ("shape mismatch", misshapen),
            ("pieces of one tensor in different dtypes", mixed),
            ("integer / bool / E8M0 dtype where the model has floating-point weights", not_floating),
        ],
        ConversionError,
    )


def _placement_plan(cfg: ModelShape, model: ShapeModel, mx: _MXLayout) -> ModelPlan:
    """The placement plan the manifest records (what ``reshard`` lays the checkpoint out from):
    the default one, with MX placements for the quantized parameters of an MX directory."""
    if mx.quantized:
        return mx_plan(cfg, model, {fqn_of(k): mx.fmt for k in mx.quantized})
    return default_plan(cfg, model)


@dataclass
class _ImportPlan:
    """An import, checked against the directory's config and headers before any data is read:
    the architecture, the model shape, the conversions with the canonical shapes they produce,
    the MX layout, every HF tensor expected (by key, with its shape) and the placement plan."""

    architecture: Architecture
    cfg: ModelShape
    conversions: list[Conversion]
    shapes: dict[str, torch.Size]
    mx: _MXLayout
    expected: dict[str, torch.Size]
    plan: ModelPlan


def _plan_import(hf: HFDirectory, arch: str | None) -> _ImportPlan:
    """Everything an import of ``hf`` will do, from its config and headers alone, every check in
    order: the architecture and model shape; the declared counts against the files (before anything
    is expanded per layer or expert); the mapping against the model; the MX layout; the headers."""
    architecture = _architecture_for(hf, arch)
    cfg = _model_shape(hf, architecture)
    check_counts_against_files(architecture, cfg, hf.config, hf.tensors, os.path.join(hf.path, "config.json"))
    conversions = expand(architecture, cfg)
    model = meta_model(cfg)  # built once: for the shapes now, for the plan once the files match
    shapes = check_against(conversions, cfg, architecture, model)
    planned = _hf_shapes(conversions, shapes, cfg)
    mx = _mx_layout(hf, conversions, shapes, planned)  # MX exports: the quantized conversions and their scales
    expected = {**planned, **mx.scale_shapes}
    _check_headers(hf, architecture, conversions, planned, expected)
    plan = _placement_plan(cfg, model, mx)
    return _ImportPlan(architecture, cfg, conversions, shapes, mx, expected, plan)


def _manifest(hf: HFDirectory, p: _ImportPlan) -> dict[str, Any]:
    """The manifest of the checkpoint an import writes: the layout for ``reshard``, the model
    shape, and where the checkpoint was converted from."""
    return {
        "writer": writer_layout(1, p.plan),  # so that reshard can place ranges
        "model_config": p.cfg.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": versions(),
        "converted_from": hf.path,
        "hf": {"architecture": p.architecture.name, "model_type": model_type_of(hf.config, hf.path)},
    }


def import_(
    hf_dir: str | os.PathLike,
    checkpoint: str | os.PathLike,
    *,
    arch: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
) -> ImportResult:
    """Convert the HF model directory ``hf_dir`` (``config.json`` plus safetensors, sharded or
    not) into a committed canonical checkpoint at ``checkpoint``: ``model.<fqn>`` weights in their
    HF dtype and the model config in the manifest (``model_config``), ready for
    ``python -m cli.train --init-from`` or :func:`mfsdp_ckpt.load` at any world size.

    An MXFP8 directory (``quantization_config`` of ``quant_method "mxfp8"`` with our ``mfsdp_mx``
    record, as ``export(..., mode="mx")`` writes it) becomes an MX checkpoint: each quantized
    weight + ``weight_scale_inv`` pair dequantized into an fp32 ``model.<fqn>``, its four
    ``mx.<fqn>.*`` planes derived again with the recorded format, and MX placements in the plan.

    ``arch``: an architecture name; default: from ``config.json``'s ``model_type``. Every HF
    tensor must be consumed exactly once and every parameter of the model written exactly once;
    otherwise a :class:`~mfsdp_ckpt.errors.ConversionError` names the keys and nothing is
    written. ``progress(done, total)`` gets bytes converted so far.

    ``workers``: threads reading and merging tensors at once (default ``min(4, CPUs)``); they
    append to the checkpoint's data file in conversion order, so the checkpoint holds the same
    bytes for any number. Each holds at most one canonical tensor (and, for MX, its planes).
    """
    start = time.perf_counter()
    workers = check_workers(workers)
    with HFDirectory(hf_dir) as hf:
        p = _plan_import(hf, arch)
        total = sum(hf.tensors[k].shape.numel() * hf.tensors[k].dtype.itemsize for k in p.expected)
        with CheckpointBuilder(checkpoint, _manifest(hf, p), overwrite=overwrite, sources=(hf.path,)) as builder:
            written = _convert_all(hf, builder, p.conversions, p.shapes, p.cfg, p.mx, workers, progress, total)
            path = builder.commit()
    return ImportResult(
        path=path,
        architecture=p.architecture.name,
        tensors=len(p.conversions),
        bytes=written,  # what the checkpoint holds, not the source's size (an MX export differs)
        model_config=p.cfg.to_dict(),
        seconds=time.perf_counter() - start,
    )

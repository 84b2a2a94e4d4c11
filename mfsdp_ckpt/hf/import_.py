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
appends the result to the checkpoint being built. Quantized weights (our MXFP8 exports, and
block-scaled FP8 as DeepSeek-V3 stores it: :mod:`mfsdp_ckpt.hf.fp8`) are dequantized one tensor at
a time on the way; ``dtype=`` casts everything to one dtype. Several worker threads (``workers=``) read and
merge at once; they append in conversion order, so the checkpoint is the same for any number.
Nothing is visible at the destination until the checkpoint commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mfsdp_ckpt.errors import ConversionError, raise_key_problems, shown_list
from mfsdp_ckpt.format.checksum import payload_crc32c
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.format.names import dcp_data_file
from mfsdp_ckpt.hf.config import model_type_of
from mfsdp_ckpt.hf.files import HFDirectory, HFTensor, hf_safetensors_name, short_repr
from mfsdp_ckpt.hf.fp8 import QUANT_METHOD as FP8_METHOD
from mfsdp_ckpt.hf.fp8 import (
    FP8Layout,
    default_dtype,
    dequantize_blocks,
    fp8_layout,
    is_fp8,
    is_fp8_config,
    parse_fp8_config,
)
from mfsdp_ckpt.hf.fp8 import scale_name as fp8_scale_name
from mfsdp_ckpt.hf.mapping import (
    Architecture,
    Conversion,
    check_against,
    count_their_keys,
    expand,
    indices_held,
    mtp_prefixes,
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
from mfsdp_ckpt.hf.mx import QUANT_METHOD as MX_METHOD
from mfsdp_ckpt.hf.registry import architecture_of_hf_config, architectures, get_architecture
from mfsdp_ckpt.hf.workers import DEFAULT_MAX_FILE_SIZE, Staging, Turns, check_workers, max_file_bytes, run_tasks
from mfsdp_ckpt.model.shape import ModelShape, ShapeModel, default_plan, meta_model
from mfsdp_ckpt.progress import progress_adder
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import ChunkFileWriter, ChunkRecord
from mfsdp_ckpt.write.job import split_by_size, write_checkpoint
from mfsdp_core.dtypes import dtype_by_name, dtype_name
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


class _Buffers:
    """A worker's reused buffers (each grown to the largest request, see
    :class:`~mfsdp_ckpt.hf.workers.Staging`): the canonical tensor being built; an HF tensor read
    in a dtype other than the canonical one (FP8 bytes, or a piece to cast); an FP8 piece
    dequantized apart from its place (a strided piece of a fused tensor); float32 bands."""

    def __init__(self) -> None:
        self.out, self.raw, self.piece, self.scratch = Staging(), Staging(), Staging(), Staging()


def _staged(hf: HFDirectory, conv: Conversion, p: _ImportPlan, bufs: _Buffers) -> tuple[torch.Tensor, int]:
    """The canonical tensor of ``conv``, in the dtype the plan writes it in, and the HF bytes read
    for it (scales included). Its HF tensors are read straight into their places in the worker's
    staging buffer (the rule's views: a merge without a copy) when they are in that dtype; other
    pieces are cast or dequantized into theirs; a rule without views merges copies."""
    keys = [*conv.theirs, *(p.scales[k] for k in conv.theirs if k in p.scales)]
    nbytes = sum(hf.tensors[k].shape.numel() * hf.tensors[k].dtype.itemsize for k in keys)
    out = bufs.out.tensor(p.dtypes[conv.ours], p.shapes[conv.ours])
    views = conv.rule.views(out, p.cfg)
    if views is None:
        pieces = [_read_piece(hf, key, p, out.dtype) for key in conv.theirs]
        return out.copy_(conv.rule.merge(pieces, p.cfg)), nbytes
    for key, view in zip(conv.theirs, views):
        _read_into(hf, key, view, p, bufs)
    return out, nbytes


def _read_into(hf: HFDirectory, key: str, view: torch.Tensor, p: _ImportPlan, bufs: _Buffers) -> None:
    """HF tensor ``key`` into ``view`` (its place in the canonical tensor, in the dtype written):
    read straight in when the dtypes agree; an FP8 weight dequantized band by band (into the view
    itself when it is contiguous); an MX weight dequantized; anything else read and cast."""
    t = hf.tensors[key]
    if key in p.fp8.scales:
        data = hf.read(key, out=bufs.raw.tensor(t.dtype, t.shape))
        target = view.view(t.shape) if view.is_contiguous() else bufs.piece.tensor(view.dtype, t.shape)
        dequantize_blocks(data, hf.read(p.fp8.scales[key]), p.fp8.fmt.block, target, bufs.scratch)
        if not view.is_contiguous():
            view.copy_(target.view(view.shape))
    elif key in p.scales:  # MX
        view.copy_(_read_piece(hf, key, p, view.dtype).reshape(view.shape))
    elif t.dtype == view.dtype:
        hf.read(key, out=view)
    else:
        view.copy_(hf.read(key, out=bufs.raw.tensor(t.dtype, t.shape)).view(view.shape))


def _read_piece(hf: HFDirectory, key: str, p: _ImportPlan, dtype: torch.dtype) -> torch.Tensor:
    """HF tensor ``key`` as a tensor of its own in ``dtype``: an FP8 weight dequantized with its
    block scales, an MX weight with its E8M0 ``weight_scale_inv`` (fp32), others cast."""
    piece = hf.read(key)
    if key in p.fp8.scales:
        out = torch.empty(piece.shape, dtype=dtype)
        return dequantize_blocks(piece, hf.read(p.fp8.scales[key]), p.fp8.fmt.block, out)
    if key in p.scales:
        return dequantize(piece, hf.read(p.scales[key]), "row")
    return piece.to(dtype)


def _planes_nbytes(shape: torch.Size) -> int:
    """Bytes of the four MX planes of an ``[M, K]`` weight: both data planes (one byte per
    element) and the rowwise ``[M, K/32]`` and columnwise ``[M/32, K]`` scales."""
    m, k = shape
    return 2 * m * k + m * (k // BLOCK) + (m // BLOCK) * k


def _output_nbytes(p: _ImportPlan, conv: Conversion) -> int:
    """Bytes of tensor data ``conv`` writes: its canonical tensor, and the MX planes of one."""
    n = p.shapes[conv.ours].numel() * p.dtypes[conv.ours].itemsize
    return n + (_planes_nbytes(p.shapes[conv.ours]) if conv.ours in p.mx.quantized else 0)


def _input_keys(p: _ImportPlan, conv: Conversion) -> list[str]:
    """The HF tensors ``conv`` reads: its pieces and the scales of the quantized ones."""
    return [*conv.theirs, *(p.scales[k] for k in conv.theirs if k in p.scales)]


def data_files(p: _ImportPlan, max_bytes: int) -> list[int]:
    """The data file of each conversion, ``__0_<k>.distcp`` for ``k`` returned: a new one wherever
    the next tensor would take the current one past ``max_bytes``
    (:func:`~mfsdp_ckpt.write.job.split_by_size`). A function of the plan alone, so one process
    and a job of any size write the same files; a checkpoint under ``max_bytes`` is one file,
    ``__0_0.distcp``."""
    return split_by_size([_output_nbytes(p, c) for c in p.conversions], max_bytes)


def _my_tasks(job: Job, p: _ImportPlan, max_bytes: int) -> list[tuple[str, Conversion]]:
    """This process's conversions, each with its data file's name, in conversion order: whole
    files, shared out by bytes (:meth:`~mfsdp_ckpt.write.agreement.Job.owners`)."""
    files = data_files(p, max_bytes)
    sizes = [0] * (max(files, default=-1) + 1)
    for k, conv in zip(files, p.conversions):
        sizes[k] += _output_nbytes(p, conv)
    mine = set(job.mine(sizes))
    return [(dcp_data_file(0, k), c) for k, c in zip(files, p.conversions) if k in mine]


_Counts = tuple[Counter, Counter, int]  # HF tensors consumed, canonical tensors written, bytes written


def _convert_mine(
    hf: HFDirectory,
    tmp: str,
    p: _ImportPlan,
    tasks: list[tuple[str, Conversion]],
    workers: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[list[ChunkRecord], _Counts]:
    """This process's conversions (``tasks``: each with its data file, in conversion order), on
    ``workers`` threads: each reads and merges one tensor (and computes its crc32c and, for MX,
    its planes) in parallel with the others, then appends it to its data file in conversion
    order (:class:`~mfsdp_ckpt.hf.workers.Turns`), so the files are the same bytes for any number
    of workers or processes; a file is closed (fsynced) once its last tensor is in. Returns the
    records and what was consumed and written (:func:`_check_counts` checks them)."""
    consumed: Counter[str] = Counter()
    written: Counter[str] = Counter()
    written_bytes = [0]  # what went into the data files (canonical tensors and MX planes), not what was read
    turns = Turns()
    shapes, mx = p.shapes, p.mx
    writer = ChunkFileWriter(tmp)
    records: list[ChunkRecord] = []
    last = {file: j for j, (file, _) in enumerate(tasks)}

    def do(bufs: _Buffers, task: tuple[int, tuple[str, Conversion]]) -> int:
        j, (file, conv) = task
        tensor, nbytes = _staged(hf, conv, p, bufs)
        if tensor.shape != shapes[conv.ours]:
            raise ConversionError(
                f"{hf.path}: {conv.ours} came out {tuple(tensor.shape)}, expected {tuple(shapes[conv.ours])}"
            )
        crc = payload_crc32c(tensor)
        planes = _planes(fqn_of(conv.ours), tensor, mx.fmt) if conv.ours in mx.quantized else []
        zeros = (0,) * tensor.dim()
        with turns.of(j):  # appends in conversion order; the counters are touched only here
            mine = [writer.write_chunk(conv.ours, tensor, zeros, tensor.shape, file, crc)]
            mine += [writer.write_chunk(key, pl, (0,) * pl.dim(), pl.shape, file) for key, pl in planes]
            records.extend(mine)
            written[conv.ours] += 1
            written_bytes[0] += sum(t.numel() * t.element_size() for t in [tensor, *(pl for _, pl in planes)])
            consumed.update(_input_keys(p, conv))
        if last[file] == j:
            writer.close_file(file)  # its last tensor is in: fsync it while the others go on
        else:
            for record in mine:  # off the turn: the next append goes on while the disk starts on this one
                writer.start_writeback(record)
        return nbytes

    report = progress_adder(progress, sum(_hf_nbytes(hf, _input_keys(p, c)) for _, c in tasks))
    try:
        run_tasks(list(enumerate(tasks)), workers, _Buffers, do, progress=report, turns=turns)
    except BaseException:
        writer.discard()
        raise
    writer.close()
    return records, (consumed, written, written_bytes[0])


def _hf_nbytes(hf: HFDirectory, keys: list[str]) -> int:
    return sum(hf.tensors[k].shape.numel() * hf.tensors[k].dtype.itemsize for k in keys)


def _check_counts(hf: HFDirectory, p: _ImportPlan, counts: list[_Counts]) -> int:
    """Over every process's counts: every HF tensor consumed and every canonical tensor written
    exactly once (else one ConversionError naming them). Returns the tensor bytes written."""
    consumed: Counter[str] = Counter()
    written: Counter[str] = Counter()
    for c, w, _ in counts:
        consumed.update(c)
        written.update(w)
    unread = [k for k in hf.tensors if k not in p.left_out and consumed[k] != 1]
    wrong = sorted(unread + [k for k in p.shapes if written[k] != 1])
    if wrong:
        raise ConversionError(f"{hf.path}: not consumed / written exactly once: {', '.join(wrong)}")
    return sum(n for _, _, n in counts)


@dataclass
class ImportResult:
    path: str
    architecture: str
    tensors: int
    bytes: int  # tensor bytes written into the checkpoint's data file
    model_config: dict[str, Any]
    seconds: float = 0.0
    #: the source's quantization (``quantization_config.quant_method``: ``fp8``, ``mxfp8``), or ``none``
    quantization: str = "none"
    #: canonical tensors written per dtype name
    dtypes: dict[str, int] = field(default_factory=dict)
    #: what the import did that the directory did not ask for, in words (tensors left out, MTP
    #: layers a config declares that the files do not hold)
    notes: list[str] = field(default_factory=list)

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
    left_out: set[str],
) -> None:
    """Refuse, in one error naming every problem and before a byte of data is read, files whose
    headers do not match the mapping: missing, unexpected (not ``left_out``) and misshapen
    tensors, the pieces of one canonical tensor in mixed dtypes, and non-floating dtypes over the
    model's weights."""
    present = hf.tensors
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected) - left_out)
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


#: what ``dtype=`` (``import-hf --dtype``) may store every imported tensor in
IMPORT_DTYPES = ("bfloat16", "float32")


def _requested_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype=`` as a torch dtype (a name or a dtype of :data:`IMPORT_DTYPES`); None: not given."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if name not in IMPORT_DTYPES:
        raise ConversionError(f"dtype {short_repr(dtype)}: expected one of {', '.join(IMPORT_DTYPES)}")
    return dtype_by_name(name)


def _quantized_layouts(
    hf: HFDirectory, conversions: list[Conversion], shapes: dict[str, torch.Size], planned: dict[str, torch.Size]
) -> tuple[_MXLayout, FP8Layout]:
    """What ``quantization_config`` makes of the directory, checked against the files before
    anything is read: block-scaled FP8 (``quant_method "fp8"``: :mod:`mfsdp_ckpt.hf.fp8`), our MX
    exports (``"mxfp8"``), or nothing quantized (no ``quantization_config``); any other method
    is refused, naming it (a malformed config by the MX reader)."""
    config_path = os.path.join(hf.path, "config.json")
    qc = hf.config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if isinstance(method, str) and method not in (FP8_METHOD, MX_METHOD):
        raise ConversionError(
            f"{config_path}: quantization_config.quant_method {short_repr(method)} is not supported "
            f"(import-hf reads {FP8_METHOD!r}, block-scaled FP8, and {MX_METHOD!r})"
        )
    if is_fp8_config(qc):
        fmt = parse_fp8_config(qc, config_path)
        return _MXLayout(), fp8_layout(hf.path, hf.tensors, planned, fmt, config_path)
    return _mx_layout(hf, conversions, shapes, planned), FP8Layout()


def _refuse_unscaled_fp8(
    hf: HFDirectory, planned: dict[str, torch.Size], scales: dict[str, str], *, scaled_only: bool = False
) -> None:
    """Refuse an FP8 tensor of the mapping that no quantization the config states accounts for
    (no ``quantization_config``, or an MX one that does not list it): without its scales its
    bytes are not the weights. One line naming the file and the tensor. ``scaled_only``: only
    those with a ``weight_scale_inv`` next to them (checked before the headers, which would call
    those scales unexpected tensors; lone FP8 tensors are checked after, so that a relabelled
    header is named as such first)."""
    qc = hf.config.get("quantization_config")
    for key in sorted(planned):
        t = hf.tensors.get(key)
        if t is None or key in scales or not is_fp8(t.dtype):
            continue
        if scaled_only and not (key.endswith(".weight") and fp8_scale_name(key) in hf.tensors):
            continue
        why = (
            "config.json has no quantization_config"
            if qc is None
            else f"quantization_config (quant_method {short_repr(qc.get('quant_method'))}) does not quantize it"
        )
        raise ConversionError(
            f"{os.path.join(hf.path, t.file)}: tensor {key!r} is {hf_safetensors_name(t.dtype)}, but {why} "
            "(FP8 weights are read with their scales: quant_method 'fp8' and its weight_block_size, or 'mxfp8')"
        )


def _written_dtypes(
    hf: HFDirectory, conversions: list[Conversion], mx: _MXLayout, fp8: FP8Layout, requested: torch.dtype | None
) -> dict[str, torch.dtype]:
    """The dtype each canonical tensor is written in: ``requested`` (``dtype=``) for all; without
    it, an FP8 weight in :func:`~mfsdp_ckpt.hf.fp8.default_dtype` (that of the unquantized
    tensors) and anything else in its HF dtype. MX weights are float32 (their planes are derived
    from them): ``dtype="bfloat16"`` is refused for an MX directory."""
    if mx.quantized and requested not in (None, torch.float32):
        raise ConversionError(
            f"{hf.path}: dtype {dtype_name(requested)}: the MX weights of an MX directory are imported in float32 "
            "(their MX planes are derived from them); give float32 or no dtype"
        )
    planned = {k for conv in conversions for k in conv.theirs}
    deq = requested or (default_dtype(hf.tensors, planned, fp8.scales) if fp8.scales else None)
    out: dict[str, torch.dtype] = {}
    for conv in conversions:
        if conv.ours in mx.quantized:
            out[conv.ours] = torch.float32
        elif conv.theirs[0] in fp8.scales:  # the pieces share one dtype (checked)
            out[conv.ours] = deq
        else:
            out[conv.ours] = requested or hf.tensors[conv.theirs[0]].dtype
    return out


@dataclass
class _ImportPlan:
    """An import, checked against the directory's config and headers before any data is read:
    the architecture, the model shape, the conversions with the canonical shapes they produce,
    the MX and FP8 layouts, the scale tensor of every quantized HF weight, every HF tensor
    expected (by key, with its shape), the placement plan, and the dtype each canonical tensor
    is written in."""

    architecture: Architecture
    cfg: ModelShape
    conversions: list[Conversion]
    shapes: dict[str, torch.Size]
    mx: _MXLayout
    fp8: FP8Layout
    scales: dict[str, str]
    expected: dict[str, torch.Size]
    plan: ModelPlan
    dtypes: dict[str, torch.dtype]
    notes: list[str]
    left_out: set[str]  # HF tensors the architecture leaves out

    @property
    def quantization(self) -> dict[str, Any] | None:
        """What the source's quantization was, for the manifest (None: not quantized)."""
        if self.fp8.fmt is not None and self.fp8.scales:
            deq = sorted({dtype_name(self.dtypes[c.ours]) for c in self.conversions if c.theirs[0] in self.fp8.scales})
            return {**self.fp8.fmt.to_dict(), "weights": len(self.fp8.scales), "dequantized_to": deq[0]}
        if self.mx.quantized:
            mx = {"element": self.mx.fmt.element, "rule": self.mx.fmt.rule}
            return {"quant_method": "mxfp8", **mx, "weights": len(self.scales), "dequantized_to": "float32"}
        return None

    def dtype_counts(self) -> dict[str, int]:
        """Canonical tensors written per dtype name."""
        return dict(sorted(Counter(dtype_name(d) for d in self.dtypes.values()).items()))


def _plan_import(hf: HFDirectory, arch: str | None, requested: torch.dtype | None) -> _ImportPlan:
    """Everything an import of ``hf`` will do, from its config and headers alone, every check in
    order: the architecture and model shape; the declared counts against the files (before anything
    is expanded per layer or expert); the mapping against the model; the quantized weights and
    their scales (MX or block-scaled FP8); the headers; FP8 tensors no quantization accounts for;
    the dtype each tensor is written in."""
    architecture = _architecture_for(hf, arch)
    cfg, notes = _without_absent_mtp(hf, architecture, _model_shape(hf, architecture))
    check_counts_against_files(architecture, cfg, hf.config, hf.tensors, os.path.join(hf.path, "config.json"))
    left_out, ignored_notes = _ignored(hf, architecture)
    conversions = expand(architecture, cfg)
    model = meta_model(cfg)  # built once: for the shapes now, for the plan once the files match
    shapes = check_against(conversions, cfg, architecture, model)
    planned = _hf_shapes(conversions, shapes, cfg)
    mx, fp8 = _quantized_layouts(hf, conversions, shapes, planned)
    scales = {k: scale_name(k) for conv in conversions if conv.ours in mx.quantized for k in conv.theirs}
    scales.update(fp8.scales)
    expected = {**planned, **mx.scale_shapes, **fp8.scale_shapes}
    _refuse_unscaled_fp8(hf, planned, scales, scaled_only=True)
    _check_headers(hf, architecture, conversions, planned, expected, left_out)
    _refuse_unscaled_fp8(hf, planned, scales)
    dtypes = _written_dtypes(hf, conversions, mx, fp8, requested)
    plan = _placement_plan(cfg, model, mx)
    notes += ignored_notes
    return _ImportPlan(architecture, cfg, conversions, shapes, mx, fp8, scales, expected, plan, dtypes, notes, left_out)


def _without_absent_mtp(hf: HFDirectory, architecture: Architecture, cfg: ModelShape) -> tuple[ModelShape, list[str]]:
    """``cfg`` without its MTP layers when the files hold none of their tensors (transformers
    saves a DeepSeek-V3 model without them, its config still declaring them), and the note
    saying so; ``cfg`` itself otherwise (some of them missing is the general check's)."""
    prefixes = mtp_prefixes(architecture, cfg) if cfg.mtp_num_layers else set()
    if not prefixes or any(key.startswith(p) for key in hf.tensors for p in prefixes):
        return cfg, []
    return dataclasses.replace(cfg, mtp_num_layers=0), [
        f"config.json declares {cfg.mtp_num_layers} multi-token-prediction layer(s), the files hold none of "
        "their tensors: imported without them"
    ]


def _ignored(hf: HFDirectory, architecture: Architecture) -> tuple[set[str], list[str]]:
    """The HF tensors ``architecture`` leaves out, and a note per pattern that matched."""
    left_out: set[str] = set()
    notes = []
    for pattern, why in architecture.ignored:
        regex = re.compile(pattern)
        matched = {k for k in hf.tensors if regex.fullmatch(k)}
        if matched:
            left_out |= matched
            notes.append(f"left out {len(matched)} tensor(s) matching {pattern} ({why}): {shown_list(sorted(matched))}")
    return left_out, notes


def _manifest(hf: HFDirectory, p: _ImportPlan) -> dict[str, Any]:
    """The manifest of the checkpoint an import writes: the layout for ``reshard``, the model
    shape, and where the checkpoint was converted from: the architecture, the dtypes written
    (canonical tensors per dtype) and, for a quantized source, its format and what its weights
    were dequantized to."""
    record = {"architecture": p.architecture.name, "model_type": model_type_of(hf.config, hf.path)}
    record["dtypes"] = p.dtype_counts()
    if p.quantization is not None:
        record["quantization"] = p.quantization
    return {
        "writer": writer_layout(1, p.plan),  # so that reshard can place ranges
        "model_config": p.cfg.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": versions(),
        "converted_from": hf.path,
        "hf": record,
    }


def _open_and_plan(
    stack: contextlib.ExitStack,
    hf_dir: str | os.PathLike,
    arch: str | None,
    dtype: str | torch.dtype | None,
    max_file_size: str | int,
    workers: int | None,
) -> tuple[HFDirectory, _ImportPlan, int, int]:
    """The arguments checked, the directory opened (closed with ``stack``) and the whole import
    planned from its config and headers (the same on every process); the data files' size and
    the worker threads."""
    workers = check_workers(workers)
    requested = _requested_dtype(dtype)
    max_bytes = max_file_bytes(max_file_size)
    hf = stack.enter_context(HFDirectory(hf_dir))
    return hf, _plan_import(hf, arch, requested), max_bytes, workers


def import_(
    hf_dir: str | os.PathLike,
    checkpoint: str | os.PathLike,
    *,
    arch: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    max_file_size: str | int = DEFAULT_MAX_FILE_SIZE,
) -> ImportResult:
    """Convert the HF model directory ``hf_dir`` (``config.json`` plus safetensors, sharded or
    not) into a committed canonical checkpoint at ``checkpoint``: ``model.<fqn>`` weights in their
    HF dtype (or ``dtype``) and the model config in the manifest (``model_config``), ready for
    ``python -m cli.train --init-from`` or :func:`mfsdp_ckpt.load` at any world size.

    A block-scaled FP8 directory (``quantization_config`` of ``quant_method "fp8"``, DeepSeek-V3's
    format: F8_E4M3 weights, each with a ``weight_scale_inv`` per ``weight_block_size`` block) has
    each FP8 weight dequantized in float32 and cast once, to ``dtype``, or without it to the
    dtype of most of the unquantized tensors' bytes (bfloat16 for DeepSeek-V3) if bfloat16 or
    float32, else float32.

    An MXFP8 directory (``quantization_config`` of ``quant_method "mxfp8"`` with our ``mfsdp_mx``
    record, as ``export(..., mode="mx")`` writes it) becomes an MX checkpoint: each quantized
    weight + ``weight_scale_inv`` pair dequantized into an fp32 ``model.<fqn>``, its four
    ``mx.<fqn>.*`` planes derived again with the recorded format, and MX placements in the plan.

    Every HF tensor must be consumed exactly once and every parameter of the model written
    exactly once; otherwise a :class:`~mfsdp_ckpt.errors.ConversionError` names the keys and
    nothing is written. Collective when ``torch.distributed`` is initialised (``torchrun -m
    mfsdp_cli.main import-hf``): the processes share out the data files (whole files, by bytes),
    each reading only the HF tensors of its own, and process 0 commits once all are written
    (:mod:`mfsdp_ckpt.write.job`); the files are the same bytes for any number of processes.

    Args:
        hf_dir: the HF model directory.
        checkpoint: where the checkpoint is written.
        arch: an architecture name; default: from ``config.json``'s ``model_type``.
        dtype: ``"bfloat16"`` or ``"float32"``, the dtype every tensor is stored in (default:
            each keeps its HF dtype; FP8 weights as above).
        overwrite: replace a checkpoint already at ``checkpoint`` (refused otherwise).
        progress: ``progress(done, total)`` gets the bytes converted so far.
        workers: threads reading and merging tensors (default ``min(4, CPUs)``), appending in
            conversion order (the same bytes for any number); each holds at most one canonical tensor
            (for MX, and its planes; for a cast or an FP8 weight, the piece read and a 16 MiB band).
        max_file_size: ``"5GB"``, ``"500MiB"`` or bytes: the data files' size, past which the
            next tensor starts a new one (:func:`data_files`: ``__0_0.distcp``, ``__0_1.distcp``, ...).

    Returns:
        An :class:`ImportResult` (path, architecture, tensors, bytes, model config, time, quantization).
    """
    start = time.perf_counter()
    job = Job.current()
    with contextlib.ExitStack() as stack:
        hf, p, max_bytes, workers = job.run(
            f"{os.fspath(checkpoint)}: not written", _open_and_plan, stack, hf_dir, arch, dtype, max_file_size, workers
        )
        tasks = _my_tasks(job, p, max_bytes)
        path, _, written = write_checkpoint(
            job,
            os.fspath(checkpoint),
            _manifest(hf, p),
            lambda tmp: _convert_mine(hf, tmp, p, tasks, workers, progress),
            overwrite=overwrite,
            sources=(hf.path,),
            finish=lambda builder, counts: _check_counts(hf, p, counts),
        )
    quantization = p.quantization
    return ImportResult(
        path=path,
        architecture=p.architecture.name,
        tensors=len(p.conversions),
        bytes=written,  # what the checkpoint holds, not the source's size (an MX export differs)
        model_config=p.cfg.to_dict(),
        seconds=time.perf_counter() - start,
        quantization=quantization["quant_method"] if quantization else "none",
        dtypes=p.dtype_counts(),
        notes=p.notes,
    )

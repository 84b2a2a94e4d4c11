"""Export a canonical checkpoint to a Hugging Face model directory, streaming.

The whole plan (which HF tensors, their shapes and dtypes, which shard file each goes to) comes
from metadata alone, so it is the same on every rank and every check runs before a byte is read.
Then each canonical tensor is read once (into a buffer the worker reuses), split into its HF
tensors as views of it, and written straight into its place in its shard file, whose header and
offsets were fixed first: memory holds one source tensor per worker, never a shard or the model.
Several worker threads (``workers=``) convert tensors at once, each into its planned offsets, so
the files are the same bytes for any number of workers; a file is fsynced by the worker that
writes its last tensor while the others go on. Under ``torch.distributed`` (``torchrun -m
mfsdp_cli.main export-hf ...``) the processes write disjoint shard files in parallel, each its
share by bytes (:meth:`~mfsdp_ckpt.write.agreement.Job.owners`); the files are the same bytes as one
process writes, since the shards are cut by ``max_shard_size`` alone. Process 0 writes the index
and ``config.json`` once every process has finished, and renames the temporary directory into
place (:func:`~mfsdp_ckpt.write.job.write_and_commit`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mfsdp_ckpt.errors import ConversionError, raise_key_problems
from mfsdp_ckpt.format.keys import MAIN_PARAM, extra_key, fqn_of_model_key, group_of, optim_key
from mfsdp_ckpt.format.lora import adapter_pairs, lora_of_record
from mfsdp_ckpt.format.model_source import TRANSFORMERS, model_source_of
from mfsdp_ckpt.hf.config_check import (
    REMOTE_CODE_KEYS,
    check_against_tensors,
    check_hf_config,
    without_remote_code,
)
from mfsdp_ckpt.hf.files import INDEX_NAME, SafetensorsWriter, parse_size, shard_name
from mfsdp_ckpt.hf.mapping import Architecture, Conversion, check_against, expand
from mfsdp_ckpt.hf.mx import (
    E8M0,
    SCALE_SUFFIX,
    MXParam,
    check_rows_only,
    module_of,
    mx_params,
    quantization_config,
    scale_name,
    single_format,
    split_rows,
)
from mfsdp_ckpt.hf.registry import get_architecture, infer_architecture
from mfsdp_ckpt.hf.transformers_layout import checked_carried_name, export_conversions
from mfsdp_ckpt.hf.workers import Staging, check_workers, run_tasks
from mfsdp_ckpt.model.shape import ModelShape, recorded_shape
from mfsdp_ckpt.progress import progress_adder
from mfsdp_ckpt.read.locate import is_mcore
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.staging import fsync_dir
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.destination import Destination, destination_for
from mfsdp_ckpt.write.job import write_and_commit
from mfsdp_core.dtypes import CAST_CHOICES, dtype_by_name, dtype_name
from mfsdp_core.mx import BLOCK, MXFormat, dequantize

__all__ = ["export", "ExportResult", "MODES", "weight_source"]

Progress = Callable[[int, int], None]


@dataclass
class ExportResult:
    """What an export wrote (the same on every rank)."""

    path: str
    architecture: str
    files: list[str]
    tensors: int
    bytes: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The vocabulary of docs/cli.md: ``files`` a count, ``file_names`` the list."""
        out = dict(self.__dict__)
        out["file_names"] = out.pop("files")
        out["files"] = len(self.files)
        return out


#: what an item reads and how it makes its HF tensors
PLAIN, DEQUANT, RAW, MERGED = "plain", "dequant", "raw", "merged"
#: export modes: the weights (fp32 main params when present), the dequantized rowwise MX planes,
#: or the MX planes themselves
MODES = ("weights", "from-mx", "mx")


@dataclass
class _Item:
    """One conversion in the plan: the checkpoint keys it reads (one weight, or an MX parameter's
    rowwise data and scale, or a weight and its LoRA factors), how (``PLAIN``: split and cast;
    ``DEQUANT``: dequantize the rowwise planes, split and cast; ``RAW``: split data and scale
    alike, write them as they are; ``MERGED``: ``W + scale * B A`` in fp32, split and cast) and
    the HF tensors it writes, in file order."""

    conv: Conversion
    sources: tuple[str, ...]
    outputs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    nbytes: int
    kind: str = PLAIN
    scale: float = 0.0  # MERGED: the adapter's alpha / r


@dataclass
class _Plan:
    """An export: the architecture and the model shape (canonical checkpoints), or, for a
    ``transformers`` checkpoint, its recorded ``config.json`` (``hf_config``) and the files it
    carries; the shard files' items; the dtype."""

    arch: Architecture | None
    config: ModelShape | None
    shards: list[list[_Item]] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    quantization: dict[str, Any] | None = None  # config.json's quantization_config (MX exports)
    hf_config: dict[str, Any] | None = None  # a transformers checkpoint's own config.json
    carried: dict[str, bytes] = field(default_factory=dict)  # its generation config and tokenizer files
    label: str = ""  # what the export is, for its result: the architecture's name, or the model's class

    @property
    def name(self) -> str:
        return self.label or (self.arch.name if self.arch is not None else "")


def _model_config(reader: CheckpointReader, source: str, given: dict[str, Any] | None = None) -> ModelShape:
    """The model shape the manifest's ``model_config`` records: what an export maps by. ``given``
    (``export-hf --model-config``) names the shape of a checkpoint that records none; one that
    records another is refused."""
    recorded = (reader.manifest or {}).get("model_config")
    if given is None or recorded == given:
        if not recorded:
            raise ConversionError(
                f"{source}: the manifest has no model_config (export needs the model's shape): "
                "name it with --model-config FILE.json"
            )
        return recorded_shape(reader.manifest, source, "export")
    if recorded:
        raise ConversionError(f"{source}: --model-config differs from the model_config the checkpoint records")
    try:
        return ModelShape.from_dict(given)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"--model-config: not a model config: {e}") from None


def _nbytes(outputs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in outputs)


def _mx_for_mode(reader: CheckpointReader, source: str, mode: str) -> dict[str, MXParam]:
    """The checkpoint's MX parameters (by model key) when ``mode`` reads MX planes; refuses a
    checkpoint without any. The plain export needs none (it reads the weights)."""
    if mode not in MODES:
        raise ConversionError(f"export mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "weights":
        return {}
    mx = mx_params(reader, source)
    if not mx:
        raise ConversionError(
            f"{source}: --{mode} needs MX planes (mx.<fqn>.rowwise_data / rowwise_scale); this checkpoint has none"
        )
    return mx


def _item(
    reader: CheckpointReader,
    keys: set[str],
    conv: Conversion,
    shape: torch.Size,
    cfg: ModelShape | None,
    dtype: torch.dtype | None,
    mx: MXParam | None,
    mode: str,
    checked: set,
) -> _Item:
    """The plan of one conversion. The weights: the fp32 main params where the checkpoint holds
    them (``optim.<fqn>.main_param``: a model computing in bf16, MX ones included), else the
    weights themselves. ``from-mx``: an MX parameter's rowwise planes, dequantized (what the model
    computed with). ``mx``: those planes as they are, data and scale split alike by the rule
    (refused, naming the tensor, unless the rule only moves whole rows; ``checked`` remembers the
    (rule, shape) pairs already proven)."""
    their_shapes = [tuple(s) for s in conv.rule.their_shapes(shape, cfg)]
    if mx is not None and mode == "mx":
        if (conv.rule, tuple(shape)) not in checked:
            check_rows_only(conv, shape, cfg)
            checked.add((conv.rule, tuple(shape)))
        outs = []
        for name, (m, k) in zip(conv.theirs, their_shapes):
            outs += [(name, MXFormat(mx.element).dtype, (m, k)), (scale_name(name), E8M0, (m, k // BLOCK))]
        return _Item(conv, (mx.key("rowwise_data"), mx.key("rowwise_scale")), outs, _nbytes(outs), RAW)
    out_dtype = dtype or reader.dtype(conv.ours)
    outs = [(name, out_dtype, s) for name, s in zip(conv.theirs, their_shapes)]
    if mx is not None and mode == "from-mx":
        return _Item(conv, (mx.key("rowwise_data"), mx.key("rowwise_scale")), outs, _nbytes(outs), DEQUANT)
    return _Item(conv, (weight_source(reader, keys, conv.ours, shape),), outs, _nbytes(outs))


def weight_source(reader: CheckpointReader, keys: set[str], key: str, shape: torch.Size) -> str:
    """Where to read the model weight ``key``: its fp32 master copy when the checkpoint holds one
    (bf16 training keeps it as ``optim.<fqn>.main_param``), else the weight itself."""
    main = optim_key(fqn_of_model_key(key), MAIN_PARAM)
    return main if main in keys and reader.is_tensor(main) and reader.shape(main) == shape else key


def _merged(reader: CheckpointReader, keys: set[str], item: _Item, factors: tuple[str, str], scale: float) -> _Item:
    """``item`` (a base weight) with its LoRA factors ``(A, B)`` merged in as it is written."""
    a, b = (weight_source(reader, keys, k, reader.shape(k)) for k in factors)
    return _Item(item.conv, (*item.sources, a, b), item.outputs, item.nbytes, MERGED, scale)


def _quantization(items: list[_Item], fmt: MXFormat) -> dict[str, Any]:
    """The ``quantization_config`` of an MX export: the HF modules whose weights are MX, and
    those of every other matrix (embedding, output layer, routers), which stay unquantized."""
    quantized, other = [], []
    for item in items:
        for name, _, shape in item.outputs:
            if item.kind == RAW and not name.endswith(SCALE_SUFFIX):
                quantized.append(module_of(name))
            elif item.kind != RAW and len(shape) == 2 and name.endswith(".weight"):
                other.append(module_of(name))
    return quantization_config(fmt, quantized, other)


def _plan(
    reader: CheckpointReader,
    source: str,
    arch_name: str | None,
    dtype: torch.dtype | None,
    max_bytes: int,
    mode: str = "weights",
    model_config: dict[str, Any] | None = None,
) -> _Plan:
    """Everything an export will do, from metadata; raises naming every missing, unexpected or
    misshapen key (and, for MX modes, every MX parameter that cannot be exported) before anything
    is written."""
    record = model_source_of(reader.manifest)
    if record is not None and record.get("kind") == TRANSFORMERS:
        return _transformers_plan(reader, source, record, arch_name, dtype, max_bytes, mode)
    cfg = _model_config(reader, source, model_config)
    arch = get_architecture(arch_name) if arch_name else infer_architecture(cfg, reader.manifest, source)
    problems = arch.unsupported(cfg)
    if problems:
        raise ConversionError(f"{source}: the model config cannot be expressed as {arch.name}: {'; '.join(problems)}")
    conversions = expand(arch, cfg)
    shapes = check_against(conversions, cfg, arch)
    stored = {k for k in reader.keys() if group_of(k) == "model" and reader.is_tensor(k)}
    missing = sorted(set(shapes) - stored)
    unexpected = sorted(stored - set(shapes))
    misshapen = sorted(
        f"{k} (checkpoint {tuple(reader.shape(k))}, model config {tuple(shapes[k])})"
        for k in set(shapes) & stored
        if reader.shape(k) != shapes[k]
    )
    raise_key_problems(
        source,
        [
            ("missing from the checkpoint", missing),
            ("not in the model config (no HF name)", unexpected),
            ("shape mismatch", misshapen),
        ],
        ConversionError,
    )

    mx = _mx_for_mode(reader, source, mode)
    fmt = single_format(mx, source) if mode == "mx" else None
    keys, checked = set(reader.keys()), set()
    items = [
        _item(reader, keys, conv, shapes[conv.ours], cfg, dtype, mx.get(conv.ours), mode, checked)
        for conv in conversions
    ]
    # config.json's torch_dtype: that of the unquantized tensors
    plain = [c.ours for c in conversions if not (mode == "mx" and c.ours in mx)] or [c.ours for c in conversions]
    plan = _Plan(arch, cfg, dtype=dtype or Counter(reader.dtype(k) for k in plain).most_common(1)[0][0])
    if fmt is not None:
        plan.quantization = _quantization(items, fmt)
    return _into_shards(plan, items, max_bytes, source, len(shapes))


def _transformers_plan(
    reader: CheckpointReader,
    source: str,
    record: dict[str, Any],
    arch_name: str | None,
    dtype: torch.dtype | None,
    max_bytes: int,
    mode: str,
) -> _Plan:
    """The export of a checkpoint of a ``transformers`` model (tensors under the model's own
    names): each parameter as ``save_pretrained`` writes it (fused experts per expert), the
    recorded ``config.json`` (checked, and against the tensors: a tampered record is refused,
    never written; ``auto_map`` / ``trust_remote_code`` dropped), and the files the checkpoint
    carries (``extra.hf_files``; code files left out)."""
    config = record.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConversionError(f"{source}: model_source.config is not a transformers config.json (no model_type)")
    config = without_remote_code(config)
    check_hf_config(config, f"{source}: model_source.config")
    model_type = config["model_type"]
    if arch_name is not None and arch_name != model_type:
        raise ConversionError(
            f"{source}: --arch {arch_name}: this checkpoint holds a transformers {record.get('class')} "
            f"({model_type}); it exports as that model"
        )
    if mode != "weights":
        raise ConversionError(
            f"{source}: --{mode} is for checkpoints in our canonical layout; a transformers "
            "checkpoint exports its weights (the fp32 main params where it holds them)"
        )
    shapes = {k: reader.shape(k) for k in reader.keys() if group_of(k) == "model" and reader.is_tensor(k)}
    try:
        spec = lora_of_record(record, source)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    adapters = adapter_pairs({k: tuple(v) for k, v in shapes.items()}, spec, source)
    factors = {k for pair in adapters.values() for k in pair}
    shapes = {k: v for k, v in shapes.items() if k not in factors}  # the base model's tensors
    if not shapes:
        raise ConversionError(f"{source}: no model tensors to export")
    named = {k[len("model.") :]: tuple(v) for k, v in shapes.items()}
    check_against_tensors(config, named, f"{source}: model_source.config")
    conversions = export_conversions(model_type, shapes, source)
    keys = set(reader.keys())
    items = [_item(reader, keys, conv, shapes[conv.ours], None, dtype, None, mode, set()) for conv in conversions]
    if adapters:  # LoRA: each adapted weight exported merged, W + (alpha / r) B A
        assert spec is not None
        items = [
            _merged(reader, keys, item, adapters[item.conv.ours], spec.scale) if item.conv.ours in adapters else item
            for item in items
        ]
    carried: dict[str, bytes] = {}
    files_key = extra_key("hf_files")
    if files_key in keys:
        files = reader.read(files_key)
        if not isinstance(files, dict):
            raise ConversionError(f"{source}: {files_key} is not a mapping of file names to bytes")
        for name, blob in files.items():
            if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.ndim != 1:
                raise ConversionError(f"{source}: {files_key}[{name!r}] is not a byte tensor")
            name = checked_carried_name(name, f"{source}: {files_key}")
            if not name.endswith(".py"):  # code is never exported (nothing we write names it)
                carried[name] = _without_remote_code_bytes(name, blob.numpy().tobytes())
    plan = _Plan(
        None,
        None,
        dtype=dtype or Counter(reader.dtype(k) for k in shapes).most_common(1)[0][0],
        hf_config=dict(config),
        carried=carried,
        label=str(record.get("class") or model_type),
    )
    return _into_shards(plan, items, max_bytes, source, len(shapes))


def _without_remote_code_bytes(name: str, blob: bytes) -> bytes:
    """A carried file as it is, but a JSON object (``tokenizer_config.json``) that names code to
    import (``auto_map``, ``trust_remote_code``) rewritten without those keys."""
    if not name.endswith(".json") or not any(k.encode() in blob for k in REMOTE_CODE_KEYS):
        return blob
    try:
        value = json.loads(blob.decode("utf-8-sig"))
    except (ValueError, RecursionError):
        return blob  # not JSON: nothing reads keys from it
    if not isinstance(value, dict):
        return blob
    return (json.dumps(without_remote_code(value), indent=2, ensure_ascii=False) + "\n").encode()


def _into_shards(plan: _Plan, items: list[_Item], max_bytes: int, source: str, expected: int) -> _Plan:
    """``plan`` with ``items`` cut into shard files of at most ``max_bytes`` (one conversion's
    tensors stay in one file), after checking that ``expected`` items read and write each key once."""
    current: list[_Item] = []
    size = 0
    for item in items:  # greedy, in HF key order; one conversion's tensors stay in one file
        if current and size + item.nbytes > max_bytes:
            plan.shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        plan.shards.append(current)
    sources = Counter(src for shard in plan.shards for item in shard for src in item.sources)
    targets = Counter(name for shard in plan.shards for item in shard for name, _, _ in item.outputs)
    twice = sorted([k for k, n in sources.items() if n != 1] + [k for k, n in targets.items() if n != 1])
    if twice or sum(1 for shard in plan.shards for _ in shard) != expected:
        raise ConversionError(
            f"{source}: the export plan reads or writes these keys more than once: {', '.join(twice)}"
        )
    return plan


def _pieces(reader: CheckpointReader, item: _Item, cfg: ModelShape | None) -> list[torch.Tensor]:
    """The HF tensors of one item, in the order of its outputs (each read is crc32c-checked)."""
    if item.kind == PLAIN:
        return item.conv.rule.split(reader.read(item.sources[0]), cfg)
    if item.kind == MERGED:
        weight, a, b = (reader.read(k).float() for k in item.sources)
        return item.conv.rule.split(weight + (b @ a) * item.scale, cfg)
    data, scale = (reader.read(k) for k in item.sources)
    if item.kind == DEQUANT:
        return item.conv.rule.split(dequantize(data, scale, "row"), cfg)
    pairs = zip(split_rows(item.conv, data, cfg), split_rows(item.conv, scale, cfg))
    return [t.contiguous() for pair in pairs for t in pair]


class _OpenShards:
    """This rank's shard files while workers fill them: each is created (header first) when the
    first of its tensors comes, and closed (checked complete, fsynced) by the worker that writes
    its last one, while the other workers go on with the next files; so only about as many
    files as workers are open at once, whatever their number."""

    def __init__(self, plan: _Plan, tmp: str, mine: list[int]) -> None:
        self.plan, self.tmp = plan, tmp
        self.left = {s: len(plan.shards[s]) for s in mine}
        self.open: dict[int, SafetensorsWriter] = {}
        self.lock = threading.Lock()

    def writer(self, s: int) -> SafetensorsWriter:
        with self.lock:
            w = self.open.get(s)
            if w is None:
                n = len(self.plan.shards)
                entries = [out for item in self.plan.shards[s] for out in item.outputs]
                w = self.open[s] = SafetensorsWriter(
                    os.path.join(self.tmp, shard_name(s + 1, n)), entries, {"format": "pt"}
                )
            return w

    def item_done(self, s: int) -> None:
        with self.lock:
            self.left[s] -= 1
            last = self.left[s] == 0
            w = self.open.pop(s) if last else None
        if w is not None:
            w.close()

    def abort(self) -> None:
        with self.lock:
            writers, self.open = list(self.open.values()), {}
        for w in writers:
            w.abort()


def _convert(
    reader: CheckpointReader,
    item: _Item,
    cfg: ModelShape | None,
    staging: Staging,
    casting: Staging,
    writer: SafetensorsWriter,
) -> None:
    """One item: read its source (crc32c-checked) into the worker's staging buffer, and write
    each HF tensor. Plain weights go out as views of the staged tensor (split without a copy);
    a cast goes through the worker's second buffer; MX items compute their pieces."""
    if item.kind == PLAIN:
        key = item.sources[0]
        staged = reader.read(key, out=staging.tensor(reader.dtype(key), reader.shape(key)))
        pieces = item.conv.rule.views(staged, cfg)
        if pieces is None:  # a rule without views: split copies
            pieces = item.conv.rule.split(staged, cfg)
    else:
        pieces = _pieces(reader, item, cfg)
    for (name, dtype, _), piece in zip(item.outputs, pieces):
        if piece.dtype != dtype:
            piece = casting.tensor(dtype, piece.shape).copy_(piece)
        writer.write(name, piece)


def _write_shards(
    reader: CheckpointReader,
    plan: _Plan,
    tmp: str,
    mine: list[int],
    rank: int,
    progress: Progress | None,
    workers: int = 1,
) -> None:
    """Write the shard files ``mine`` (this process's) with ``workers`` threads, each converting
    whole items (one canonical tensor each) in plan order into their planned offsets; check each
    source it was given was read exactly once."""
    tasks = [(s, item) for s in mine for item in plan.shards[s]]
    total = sum(item.nbytes for _, item in tasks)
    shards = _OpenShards(plan, tmp, mine)
    consumed: Counter[str] = Counter()
    lock = threading.Lock()

    def make_state() -> tuple[CheckpointReader, Staging, Staging]:
        return (reader if workers <= 1 else reader.fork()), Staging(), Staging()

    def close_state(state: tuple[CheckpointReader, Staging, Staging]) -> None:
        if state[0] is not reader:
            state[0].close()

    def do(state: tuple[CheckpointReader, Staging, Staging], task: tuple[int, _Item]) -> int:
        s, item = task
        _convert(state[0], item, plan.config, state[1], state[2], shards.writer(s))
        with lock:
            consumed.update(item.sources)
        shards.item_done(s)
        return item.nbytes

    report = progress_adder(progress, total)

    try:
        run_tasks(tasks, workers, make_state, do, close_state, report)
    except BaseException:
        shards.abort()
        raise
    expected = Counter(src for _, item in tasks for src in item.sources)
    if consumed != expected or shards.open:
        wrong = sorted(k for k in set(consumed) | set(expected) if consumed[k] != 1)
        raise ConversionError(f"rank {rank}: these checkpoint keys were not read exactly once: {', '.join(wrong)}")


def _hf_config(plan: _Plan) -> dict[str, Any]:
    """The export's ``config.json``; never with ``auto_map`` / ``trust_remote_code`` in it."""
    if plan.hf_config is not None:  # a transformers model's own config, with the exported dtype
        config = {**plan.hf_config, "dtype": dtype_name(plan.dtype)}
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype_name(plan.dtype)
        return without_remote_code(config)
    quantization = {"quantization_config": plan.quantization} if plan.quantization is not None else {}
    config = {**plan.arch.to_hf_config(plan.config), "torch_dtype": dtype_name(plan.dtype), **quantization}
    return without_remote_code(config)


def _finish(plan: _Plan, tmp: str) -> None:
    """Rank 0, after every shard is written: the index and ``config.json``."""
    n = len(plan.shards)
    files = [shard_name(s + 1, n) for s in range(n)]
    weight_map = {name: files[s] for s in range(n) for item in plan.shards[s] for name, _, _ in item.outputs}
    total = sum(item.nbytes for shard in plan.shards for item in shard)
    for s in range(n):  # every planned file exists (another rank may have written it)
        path = os.path.join(tmp, files[s])
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: shard file missing after every rank finished")
    for name, payload in (
        (INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}),
        ("config.json", _hf_config(plan)),
    ):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    for name, blob in plan.carried.items():  # generation config, tokenizer files
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(tmp)


def export(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    arch: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: Progress | None = None,
    mode: str = "weights",
    workers: int | None = None,
    model_config: dict[str, Any] | None = None,
) -> ExportResult:
    """Export the model weights of the canonical checkpoint ``checkpoint`` (any writer layout) to
    the HF model directory ``out``: ``model-0000k-of-0000n.safetensors``, the index, and a
    ``config.json`` made from the manifest's ``model_config``. A checkpoint of a ``transformers``
    model (``model_source`` kind ``transformers``: the trainer's ``--hf-model``) is written as
    that model's ``save_pretrained`` writes it, under its own names (fused experts per expert),
    with its recorded ``config.json`` and the generation config and tokenizer files it carries.
    Where the checkpoint holds fp32 master weights (``optim.<fqn>.main_param``) they are the source.
    Collective when ``torch.distributed`` is initialised: every rank calls it with the same
    arguments and writes its share of the shard files (by bytes, the same assignment on every
    rank); rank 0 writes the index and config after all are done. ``out`` appears only when
    complete (a temporary sibling is renamed); on any error, on any rank, nothing is left at
    ``out``: the rank that failed raises its error, the others
    :class:`~mfsdp_ckpt.errors.JobFailedElsewhere` naming it.

    Args:
        checkpoint: the canonical checkpoint (a directory, its run directory, a URL).
        out: the HF model directory to write (a local path).
        arch: an architecture name (``mfsdp_ckpt.hf.architectures()``); default: the one the
            checkpoint was imported from, else the only one that can express the model config.
        dtype: ``bfloat16`` / ``float16`` / ``float32`` (default: the checkpoint's).
        max_shard_size: the largest safetensors file (``"5GB"``, or bytes).
        overwrite: replace an existing HF directory at ``out``.
        progress: ``progress(done, total)`` gets this rank's bytes written so far.
        mode: MXFP8 checkpoints (docs/hf.md): ``"weights"`` (default) as above, MX ones included;
            ``"from-mx"`` each MX parameter's rowwise planes dequantized, cast to ``dtype``;
            ``"mx"`` them raw (F8 weights, E8M0 ``weight_scale_inv``, transformers' ``mxfp8``
            ``quantization_config``).
        workers: threads converting and writing at once on each rank (default ``min(4, CPUs)``);
            the files are the same bytes for any number; each holds at most its largest tensor.
        model_config: the model shape (as a manifest records it) of a checkpoint whose manifest
            records none (e.g. ``convert --to dcp`` of a bare file).

    Returns:
        What was written (path, architecture, files, tensors, bytes, seconds).
    """
    if is_mcore(checkpoint):
        raise ConversionError(
            f"{os.fspath(checkpoint)}: a Megatron-Core checkpoint: export it with "
            "mfsdp_ckpt.mcore.export_hf_from_mcore (export-hf --mcore-config)"
        )
    start = time.perf_counter()
    source = fs.normalize(checkpoint)  # a local path or an fsspec URL
    destination = destination_for(out, kind="hf")  # a local directory only
    final = destination.final
    job = Job.current()
    with contextlib.ExitStack() as stack:
        reader, plan, workers = job.run(
            f"{final}: export not written",
            _open_and_plan,
            stack,
            source,
            destination,
            dict(arch=arch, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, mode=mode),
            workers,
            model_config,
        )
        return _export(
            job,
            reader,
            plan=plan,
            destination=destination,
            overwrite=overwrite,
            sources=(source,),
            progress=progress,
            start=start,
            workers=workers,
        )


def _open_and_plan(
    stack: contextlib.ExitStack,
    source: str,
    destination: Destination,
    options: dict[str, Any],
    workers: int | None,
    model_config: dict[str, Any] | None,
) -> tuple[CheckpointReader, _Plan, int]:
    """The arguments checked, the ``destination`` checked (refused early, on every
    process), the source opened (closed with ``stack``) and the whole export planned from its
    metadata; and the worker threads."""
    dtype = options["dtype"]
    if isinstance(dtype, str):
        if dtype not in CAST_CHOICES:
            raise ConversionError(f"dtype {dtype!r}: expected one of {', '.join(CAST_CHOICES)}")
        dtype = dtype_by_name(dtype)
    destination.check(overwrite=options["overwrite"], sources=(source,))
    max_bytes = parse_size(options["max_shard_size"])
    workers = check_workers(workers)
    reader = stack.enter_context(CheckpointReader(source))
    plan = _plan(reader, source, options["arch"], dtype, max_bytes, options["mode"], model_config)
    return reader, plan, workers


def _export(
    job: Job,
    reader: CheckpointReader,
    *,
    plan: _Plan,
    destination: Destination,
    overwrite: bool,
    sources: tuple[str, ...],
    progress: Progress | None,
    start: float,
    workers: int,
) -> ExportResult:
    """Write the planned shard files over the processes of ``job`` (each its share, by bytes:
    :meth:`~mfsdp_ckpt.write.agreement.Job.owners`) into the staging directory process 0 opens at
    ``destination`` (holding the parent's writer lock until the export is committed); process 0
    writes the index and config once every process has finished, and commits."""
    mine = job.mine([sum(item.nbytes for item in shard) for shard in plan.shards])

    def write(tmp: str) -> None:
        _write_shards(reader, plan, tmp, mine, job.rank, progress, workers)

    def conclude(parts: list[None]) -> None:
        destination.commit(lambda: _finish(plan, destination.staging))

    with destination:
        write_and_commit(
            job,
            f"{destination.final}: export not written",
            lambda: destination.open(overwrite=overwrite, sources=sources),
            write,
            conclude,
            destination.abort,
        )
    n = len(plan.shards)
    return ExportResult(
        path=destination.final,
        architecture=plan.name,
        files=[shard_name(s + 1, n) for s in range(n)],
        tensors=sum(len(item.outputs) for shard in plan.shards for item in shard),
        bytes=sum(item.nbytes for shard in plan.shards for item in shard),
        seconds=time.perf_counter() - start,
    )

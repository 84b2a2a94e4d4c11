"""Conversions between a canonical DCP checkpoint and single-file formats other tools read:
one ``torch.save`` file, or one flat safetensors file. Keys stay canonical (``model.<fqn>``,
``optim.<fqn>.<state>``, …); tensors are full logical tensors. And one DCP-to-DCP conversion:
``dcp-fsdp2`` renames the keys to the layout ``get_state_dict`` gives a stock FSDP2 model and
optimizer, so that ``dcp.load`` + ``set_state_dict`` read it (:func:`write_fsdp2`); ``torchtitan``
writes torchtitan's layout at the source's world size (:func:`write_titan`).

A single file holds everything at once, so these conversions hold the whole checkpoint in memory
(the format requires it). Reading a DCP checkpoint goes one tensor at a time; writing one uses the
same committed, checksummed storage as :func:`mfsdp_ckpt.save`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from mfsdp_ckpt.errors import CheckpointError, CheckpointExistsError, NotACheckpointError
from mfsdp_ckpt.format.keys import MAIN_PARAM, PARAM_GROUPS, fqn_of_model_key, optim_key
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.format.manifest_schema import key_problem
from mfsdp_ckpt.format.names import dcp_data_file, dcp_data_file_rank, shown
from mfsdp_ckpt.format.titan import TITAN_LAYOUT
from mfsdp_ckpt.hf.workers import DEFAULT_MAX_FILE_SIZE, max_file_bytes
from mfsdp_ckpt.read.inputs import checkpoint_inputs
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.read.stock import (
    KeyRule,
    apply_key_map,
    fsdp2_param_group_entries,
    parse_key_map,
    to_fsdp2_key,
)
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import ChunkFileWriter, ChunkRecord
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_ckpt.write.job import split_by_size, write_and_commit, write_checkpoint
from mfsdp_core.plan import DEFAULT_GROUP, ModelPlan

__all__ = ["FORMATS", "read_full_state", "write_dcp", "write_fsdp2", "write_titan", "convert"]

FORMATS = ("torch", "safetensors", "dcp", "dcp-fsdp2", TITAN_LAYOUT)
# safetensors metadata entry holding the non-tensor entries: base64 of a torch.save archive
# (keeps tuples and other plain types exactly; read back with weights_only=True)
_OBJECTS_KEY = "mfsdp.objects"
# what a single file carries of the manifest, so that a round trip back to DCP keeps it: the
# safetensors metadata entry / the torch file's reserved key holding the JSON of these fields
_MANIFEST_KEY = "mfsdp.manifest"
_TORCH_MANIFEST_KEY = "__mfsdp_manifest__"
CARRIED_FIELDS = ("step", "model_config", "model_source", "run_config", "hf")


def carried_fields(manifest: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of ``manifest`` a conversion keeps (:data:`CARRIED_FIELDS`, those present)."""
    return {k: manifest[k] for k in CARRIED_FIELDS if manifest and manifest.get(k) is not None}


def _parse_carried(text: Any, source: str) -> dict[str, Any]:
    """The carried manifest fields stored in a single file (JSON text), or ``{}`` when none."""
    if text is None:
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError as e:
        raise CheckpointError(f"{source}: unreadable '{_MANIFEST_KEY}' entry ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: '{_MANIFEST_KEY}' entry is not a JSON object")
    return carried_fields(value)


def read_full_state(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as full tensors / objects (verified against the manifest
    when there is one)."""
    with CheckpointReader(os.fspath(path)) as reader:
        keys = reader.keys()
        out = {}
        for done, key in enumerate(keys, 1):
            out[key] = reader.read(key)
            if progress is not None:
                progress(done, len(keys))
        return out


def _dcp_manifest(source: str | None, carried: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest of a checkpoint made of a plain state dict (no placement plan: any layout
    loads it)."""
    return {
        "writer": writer_layout(1, ModelPlan({DEFAULT_GROUP: 1}, ())),
        "model_config": None,
        "step": None,
        "converted_from": source,
        "versions": versions(),
        **carried_fields(carried),
    }


def write_dcp(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    source: str | None = None,
    carried: dict[str, Any] | None = None,
) -> str:
    """Write a plain state dict as a committed, checksummed DCP checkpoint (one data file; the
    path may be an fsspec URL). ``carried``: manifest fields kept from the source (step, model
    config and source, run config; :data:`CARRIED_FIELDS`). Collective when
    ``torch.distributed`` is initialised: process 0's ``state`` is written, by process 0."""
    return _write_on_main(Job.current(), os.fspath(path), _dcp_manifest(source, carried), lambda: state, source)


def _write_on_main(
    job: Job, dst: str, manifest: dict[str, Any], produce: Callable[[], dict[str, Any]], source: str | None
) -> str:
    """A checkpoint of one data file, ``__0_0.distcp``: process 0 writes ``produce()``'s entries
    in order, the others nothing; committed once every process has reported
    (:func:`~mfsdp_ckpt.write.job.write_checkpoint`), so a job that loses a process commits
    nothing."""

    def write(tmp: str) -> tuple[list[ChunkRecord], None]:
        if not job.main:
            return [], None
        writer = ChunkFileWriter(tmp)
        try:
            records = [_write_entry(writer, key, value, 0) for key, value in produce().items()]
        except BaseException:
            writer.discard()
            raise
        writer.close()
        return records, None

    path, _, _ = write_checkpoint(job, dst, manifest, write, sources=(source,) if source else ())
    return path


def _write_entry(writer: ChunkFileWriter, key: str, value: Any, file: int | str) -> ChunkRecord:
    """One entry, whole: a tensor as one chunk, anything else as an object."""
    if isinstance(value, torch.Tensor):
        return writer.write_chunk(key, value, (0,) * value.dim(), value.shape, file)
    return writer.write_object(key, value, file)


def write_fsdp2(
    src: str,
    dst: str,
    *,
    key_map: Sequence[KeyRule] = (),
    progress: Callable[[int, int], None] | None = None,
    max_file_size: str | int = DEFAULT_MAX_FILE_SIZE,
) -> str:
    """Write the checkpoint ``src`` as ``dst`` in the key layout of ``get_state_dict`` saved as
    ``{"model": msd, "optim": osd}`` (:func:`~mfsdp_ckpt.read.stock.to_fsdp2_key`), one entry at a
    time, committed and checksummed like every checkpoint we write (stock DCP ignores
    ``mfsdp.json``; ours says ``key_layout: dcp-fsdp2``, so our readers map the keys back).
    Gradients, MX planes and RNG states are left out; the fp32 main params of a low-precision
    model become its ``model.<fqn>``. ``key_map`` renames prefixes of the output keys last (e.g.
    ``'model.='`` for torchtitan's bare FQNs).

    The data files (``__0_0.distcp``, ``__0_1.distcp``, ...) are cut at ``max_file_size``
    (:func:`~mfsdp_ckpt.write.job.split_by_size`, over the source's entries in key order).
    Collective when ``torch.distributed`` is initialised: the processes share the files out,
    each reading only its own entries, and process 0 commits (:mod:`mfsdp_ckpt.write.job`); the
    files are the same bytes for any number of processes."""
    job = Job.current()
    with contextlib.ExitStack() as stack:
        reader, tasks = job.run(f"{dst}: not written", _plan_fsdp2, stack, src, job, max_file_size)
        source = reader.manifest or {}
        manifest = {
            "writer": writer_layout(1, ModelPlan({DEFAULT_GROUP: 1}, ())),
            "model_config": source.get("model_config"),
            "model_source": source.get("model_source"),
            "step": source.get("step"),
            **carried_fields(source),
            "converted_from": src,
            "versions": versions(),
            "key_layout": "dcp-fsdp2",
        }
        path, _, _ = write_checkpoint(
            job,
            dst,
            manifest,
            lambda tmp: (_write_fsdp2_entries(reader, tmp, tasks, key_map, progress), None),
            sources=(src,),
        )
    return path


def _plan_fsdp2(
    stack: contextlib.ExitStack, src: str, job: Job, max_file_size: str | int
) -> tuple[MappedReader, list[tuple[str, str]]]:
    """The source opened (closed with ``stack``) and this process's entries, each with its data
    file: every source key in order, the files cut by size and shared out whole, by bytes."""
    reader = stack.enter_context(MappedReader(src))
    keys = reader.keys()
    sizes = [reader.shape(k).numel() * reader.dtype(k).itemsize if reader.is_tensor(k) else 0 for k in keys]
    files = split_by_size(sizes, max_file_bytes(max_file_size))
    per_file = [0] * (max(files, default=0) + 1)
    for k, n in zip(files, sizes):
        per_file[k] += n
    mine = set(job.mine(per_file))
    return reader, [(key, dcp_data_file(0, k)) for key, k in zip(keys, files) if k in mine]


def _write_fsdp2_entries(
    reader: MappedReader,
    tmp: str,
    tasks: list[tuple[str, str]],
    key_map: Sequence[KeyRule],
    progress: Callable[[int, int], None] | None,
) -> list[ChunkRecord]:
    """The entries of ``tasks`` (source key, data file) under their FSDP2 keys, into their files
    in ``tmp``; their records."""
    keys = reader.keys()
    mains = {k for k in keys if k.startswith("optim.") and k.endswith("." + MAIN_PARAM)}
    writer = ChunkFileWriter(tmp)
    records: list[ChunkRecord] = []
    last = {file: j for j, (_, file) in enumerate(tasks)}
    try:
        for done, (key, file) in enumerate(tasks, 1):
            name = fqn_of_model_key(key)
            if name is not None and optim_key(name, MAIN_PARAM) in mains:
                pass  # the fp32 main params stand in for the low-precision weights
            elif key == PARAM_GROUPS:
                for out_key, value in fsdp2_param_group_entries(reader.read(key), reader.directory).items():
                    records.append(writer.write_object(apply_key_map(out_key, key_map), value, file))
            elif (out_key := to_fsdp2_key(key)) is not None:
                records.append(_write_entry(writer, apply_key_map(out_key, key_map), reader.read(key), file))
            if last[file] == done - 1:
                writer.close_file(file)
            if progress is not None:
                progress(done, len(tasks))
    except BaseException:
        writer.discard()
        raise
    writer.close()
    return records


def write_titan(src: str, dst: str, *, progress: Callable[[int, int], None] | None = None) -> str:
    """Write the checkpoint ``src`` as ``dst`` in torchtitan's layout at the world size that wrote
    ``src`` (:func:`source_world_size`): ``reshard --to torchtitan`` at that size, one data file
    per rank, committed and checksummed; ``progress(done, total)`` gets bytes."""
    with MappedReader(src) as reader:
        world_size = source_world_size(reader)
    return reshard(src, dst, world_size=world_size, to=TITAN_LAYOUT, progress=progress).path


def source_world_size(reader: MappedReader) -> int:
    """The world size that wrote a checkpoint: its manifest's, else (a stock checkpoint, whose
    ranks each write their own ``__<rank>_<n>.distcp``) the number of writer ranks its data
    files name; 1 when none does."""
    recorded = ((reader.manifest or {}).get("writer") or {}).get("world_size")
    if isinstance(recorded, int) and recorded >= 1:
        return recorded
    ranks = {dcp_data_file_rank(info.relative_path) for info in reader.raw.metadata.storage_data.values()}
    return max((r for r in ranks if r is not None), default=0) + 1


def _pack_objects(objects: dict[str, Any]) -> str:
    buf = io.BytesIO()
    torch.save(objects, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unpack_objects(text: str | None, source: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever decoding hostile text raises
        raise CheckpointError(f"{source}: unreadable '{_OBJECTS_KEY}' metadata ({type(e).__name__})") from None


def _read_single_file(src: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state in a ``.safetensors`` or ``torch.save`` file (local or fsspec URL), and the
    manifest fields it carries (``{}`` for a file we did not write)."""
    try:
        with fs.open_regular(src) as f:  # a FIFO or a device is refused, never read from
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{src}: cannot read ({e.strerror or e})") from None
    if src.endswith(".safetensors"):
        try:
            state: dict[str, Any] = dict(safetensors_load(data))
            header_len = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        except Exception as e:  # noqa: BLE001 - whatever a garbled header raises
            raise CheckpointError(f"{src}: unreadable safetensors file ({type(e).__name__}: {e})") from None
        state.update(_unpack_objects(metadata.get(_OBJECTS_KEY), src))
        return state, _parse_carried(metadata.get(_MANIFEST_KEY), src)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load makes of hostile bytes
        raise CheckpointError(f"{src}: not a loadable torch file with plain contents ({type(e).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"{src}: expected a dict with string keys")
    return state, _parse_carried(state.pop(_TORCH_MANIFEST_KEY, None), src)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    progress: Callable[[int, int], None] | None = None,
    key_map: Sequence[str | KeyRule] = (),
    max_file_size: str | int = DEFAULT_MAX_FILE_SIZE,
) -> str:
    """Convert ``src`` to format ``to`` at ``dst`` (which must not exist). ``torch`` and
    ``safetensors`` read a DCP checkpoint; ``dcp`` reads a ``.pt`` / ``.safetensors`` file;
    ``dcp-fsdp2`` writes a DCP checkpoint in FSDP2's ``get_state_dict`` key layout
    (:func:`write_fsdp2`; ``key_map`` and ``max_file_size`` apply to it only), ``torchtitan`` one
    in torchtitan's layout at the source's world size (:func:`write_titan`). Either side may be
    an fsspec URL.

    Collective when ``torch.distributed`` is initialised: ``dcp-fsdp2`` shares its data files
    out over the processes; the others make or read one file, which process 0 alone reads and
    writes, committing once every process has reported (a job that loses a process writes
    nothing)."""
    src, dst = fs.normalize(src), fs.normalize(dst)
    job = Job.current()
    rules = job.run(f"{dst}: not written", _check_convert, src, dst, to, key_map)
    if to == "dcp-fsdp2":
        return write_fsdp2(src, dst, key_map=rules, progress=progress, max_file_size=max_file_size)
    if to == TITAN_LAYOUT:
        return write_titan(src, dst)
    if to == "dcp":
        return _file_to_dcp(job, src, dst)
    return _dcp_to_file(job, src, dst, to, progress)


def _check_convert(src: str, dst: str, to: str, key_map: Sequence[str | KeyRule]) -> list[KeyRule]:
    """Refuse a conversion that cannot be made (one line), before anything is read; the key map."""
    if to not in FORMATS:
        raise CheckpointError(f"--to {to!r}: expected one of {', '.join(FORMATS)}")
    rules = parse_key_map(key_map)
    if rules and to != "dcp-fsdp2":
        raise CheckpointError(f"--key-map: applies to --to dcp-fsdp2 only, not --to {to}")
    if fs.exists(dst):
        raise CheckpointExistsError(f"{dst}: already exists")
    sources = tuple(checkpoint_inputs(src))  # a `latest` pointer or run directory: what it leads to too
    destination_for(dst, kind="file" if to in ("torch", "safetensors") else "checkpoint").check(sources=sources)
    if to == "dcp" and not fs.isfile(src):
        raise NotACheckpointError(f"{src}: not a file (convert --to dcp reads a .pt or .safetensors file)")
    return rules


def _check_keys(src: str, state: dict[str, Any]) -> None:
    """Refuse, before anything is written, a key the checkpoint's readers would refuse (one with
    control characters: every message names keys on one line), naming the first such key."""
    for key in state:
        problem = key_problem(key)
        if problem is not None:
            raise CheckpointError(f"{src}: key {shown(key)}: {problem}; a checkpoint cannot hold it")


def _file_to_dcp(job: Job, src: str, dst: str) -> str:
    """``--to dcp``: the single file, read whole by process 0, as a checkpoint of one data file."""
    state: list[dict[str, Any]] = []

    def read() -> dict[str, Any]:
        loaded, carried = _read_single_file(src)
        _check_keys(src, loaded)
        state.append(loaded)
        return carried

    carried = job.on_main(f"{dst}: not written", read)
    return _write_on_main(job, dst, _dcp_manifest(src, carried), lambda: state.pop(), src)


def _dcp_to_file(job: Job, src: str, dst: str, to: str, progress: Callable[[int, int], None] | None) -> str:
    """``--to torch|safetensors``: process 0 reads the whole checkpoint into one file's bytes and,
    once every process has reported, writes them (all or nothing)."""
    data: list[bytes] = []
    destination = destination_for(dst, kind="file")

    def write(_: str) -> None:
        if job.main:
            data.append(_single_file_bytes(src, to, progress))

    def conclude(_: list[None]) -> str:
        return destination.commit(lambda: fs.write_bytes(dst, data.pop()))  # all or nothing

    return write_and_commit(job, f"{dst}: not written", destination.open, write, conclude, destination.abort)


def _single_file_bytes(src: str, to: str, progress: Callable[[int, int], None] | None) -> bytes:
    """The bytes of the ``torch.save`` or safetensors file holding the whole checkpoint ``src``."""
    with CheckpointReader(src) as reader:
        carried = json.dumps(carried_fields(reader.manifest))
    state = read_full_state(src, progress)
    if to == "torch":
        buf = io.BytesIO()
        torch.save({**state, _TORCH_MANIFEST_KEY: carried}, buf)
        return buf.getvalue()
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return safetensors_save(tensors, metadata={_OBJECTS_KEY: _pack_objects(objects), _MANIFEST_KEY: carried})

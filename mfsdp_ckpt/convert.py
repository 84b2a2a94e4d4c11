"""Conversions between a canonical DCP checkpoint and single-file formats other tools read:
one ``torch.save`` file, or one flat safetensors file. Keys stay canonical (``model.<fqn>``,
``optim.<fqn>.<state>``, …); tensors are full logical tensors.

A single file holds everything at once, so these conversions hold the whole checkpoint in memory
(the format requires it). Reading a DCP checkpoint goes one tensor at a time; writing one uses the
same committed, checksummed storage as :func:`mfsdp_ckpt.save`.
"""

from __future__ import annotations

import base64
import io
import os
import uuid
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

from .errors import CheckpointError, CheckpointExistsError, NotACheckpointError
from .inspect import open_checkpoint
from .planner import MfsdpSavePlanner
from .storage import CommittingWriter

__all__ = ["FORMATS", "read_full_state", "write_dcp", "convert"]

FORMATS = ("torch", "safetensors", "dcp")
# safetensors metadata entry holding the non-tensor entries: base64 of a torch.save archive
# (keeps tuples and other plain types exactly; read back with weights_only=True)
_OBJECTS_KEY = "mfsdp.objects"


def read_full_state(path: str | os.PathLike) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as full tensors / objects (verified against the manifest
    when there is one)."""
    from .diff import read_entry

    directory, manifest, metadata, _ = open_checkpoint(os.fspath(path))
    return {key: read_entry(directory, manifest, key, md) for key, md in sorted(metadata.state_dict_metadata.items())}


def write_dcp(state: dict[str, Any], path: str | os.PathLike, *, source: str | None = None) -> str:
    """Write a plain state dict as a committed, checksummed DCP checkpoint (one process)."""
    final = os.path.abspath(os.fspath(path))
    if os.path.exists(final):
        raise CheckpointExistsError(f"{final}: already exists")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.partial-{uuid.uuid4().hex[:12]}")
    manifest = {"writer": {"world_size": 1, "buffers": []}, "model_config": None, "step": None,
                "converted_from": source, "versions": {"torch": torch.__version__}}
    writer = CommittingWriter(tmp, final, manifest, overwrite=False)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, planner=MfsdpSavePlanner(), no_dist=True)
    return final


def _pack_objects(objects: dict[str, Any]) -> str:
    buf = io.BytesIO()
    torch.save(objects, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unpack_objects(text: str | None, source: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{source}: unreadable '{_OBJECTS_KEY}' metadata ({type(e).__name__})") from None


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str) -> str:
    """Convert ``src`` to format ``to`` at ``dst`` (which must not exist). ``torch`` and
    ``safetensors`` read a DCP checkpoint; ``dcp`` reads a ``.pt`` / ``.safetensors`` file."""
    src, dst = os.fspath(src), os.fspath(dst)
    if to not in FORMATS:
        raise CheckpointError(f"--to {to!r}: expected one of {', '.join(FORMATS)}")
    if os.path.exists(dst):
        raise CheckpointExistsError(f"{dst}: already exists")
    if to == "dcp":
        if not os.path.isfile(src):
            raise NotACheckpointError(f"{src}: not a file (convert --to dcp reads a .pt or .safetensors file)")
        if src.endswith(".safetensors"):
            try:
                state: dict[str, Any] = dict(load_safetensors(src))
            except Exception as e:
                raise CheckpointError(f"{src}: unreadable safetensors file ({e})") from None
            from safetensors import safe_open

            with safe_open(src, framework="pt") as f:
                state.update(_unpack_objects((f.metadata() or {}).get(_OBJECTS_KEY), src))
        else:
            try:
                state = torch.load(src, map_location="cpu", weights_only=True)
            except Exception as e:
                raise CheckpointError(f"{src}: not a loadable torch file with plain contents ({type(e).__name__})") from None
            if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                raise CheckpointError(f"{src}: expected a dict with string keys")
        return write_dcp(state, dst, source=os.path.abspath(src))
    state = read_full_state(src)
    tmp = f"{dst}.partial-{uuid.uuid4().hex[:12]}"
    try:
        if to == "torch":
            torch.save(state, tmp)
        else:
            tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
            objects = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            save_safetensors(tensors, tmp, metadata={_OBJECTS_KEY: _pack_objects(objects)})
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst

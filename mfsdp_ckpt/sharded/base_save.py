"""Frozen weights written once: a save of a model with frozen parameters writes them into a base
checkpoint of the run (the first save of a process, or when they changed), and every save
references that base instead of writing them again (:mod:`mfsdp_ckpt.format.base_ref` says what
the reference pins; :mod:`mfsdp_ckpt.read.base` how readers follow it).

A base is reused while every rank's frozen tensors are the very tensors it was written from,
unchanged since: the same storage, and torch's in-place version counter where it was (a load,
``copy_``, any in-place change moves it). Anything else writes a new base. A model without frozen
parameters writes exactly what it always did.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from mfsdp_ckpt.format.base_ref import BASE_ROLE, base_name, reference_problem, reference_to
from mfsdp_ckpt.format.catalog import Catalog, param_of_key
from mfsdp_ckpt.format.keys import group_of
from mfsdp_ckpt.read.manifest import is_committed, read_manifest
from mfsdp_ckpt.sharded.own_chunks import write_own_chunks
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.dcp_writer import CommittingWriter
from mfsdp_ckpt.write.destination import destination_for
from mfsdp_ckpt.write.job import write_and_commit
from mfsdp_ckpt.write.save_index import RankWrites, build_index
from mfsdp_core.collectives import gather_objects, rank0_decides

__all__ = ["frozen_keys", "has_frozen", "base_reference"]


def has_frozen(catalog: Catalog) -> bool:
    """Whether the plan holds a frozen parameter (a buffer without ``requires_grad``)."""
    return any(not pb.spec.requires_grad for pb in catalog.placed)


def frozen_keys(catalog: Catalog, keys: Any) -> set[str]:
    """Those of ``keys`` that hold a frozen parameter's weights (``model.<p>``): what a base holds.
    A function of the names and the plan, so every rank agrees. A frozen MXFP8 weight's planes
    (``mx.<p>.<plane>``) stay in every save: the base holds weights only."""
    out = set()
    for key in keys:
        if group_of(key) != "model":
            continue
        fqn = param_of_key(key)
        where = catalog.param(fqn) if fqn is not None else None
        if where is not None and not catalog.placed[where[0]].spec.requires_grad:
            out.add(key)
    return out


@dataclass
class _Written:
    """The base this process wrote or confirmed last for a run directory, and the state of its
    frozen tensors then (key -> (storage pointer, version counter))."""

    reference: dict[str, Any]
    tensors: dict[str, tuple[int, int]]


_BASES: dict[str, _Written] = {}


def _tensor_state(entries: dict[str, Any], keys: set[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for key in keys:
        t = getattr(entries[key], "tensor", entries[key])
        if isinstance(t, torch.Tensor):
            out[key] = (t.untyped_storage().data_ptr(), t._version)
    return out


def _still_committed(parent: str, reference: dict[str, Any]) -> bool:
    """Whether the base ``reference`` pins is still in ``parent``, as it was."""
    base = fs.join(parent, reference["name"])
    if fs.islink(base) or not is_committed(base):
        return False
    try:
        return reference_problem(reference, read_manifest(base)) is None
    except Exception:  # noqa: BLE001 - any reason it cannot be read: write a new one
        return False


def _free_name(parent: str, name: str) -> str:
    """``name``, or ``name_2``, ``name_3``, ...: the first no directory of ``parent`` has."""
    taken = set(fs.listdir(parent)) if fs.isdir(parent) else set()
    n, candidate = 1, name
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    return candidate


def base_reference(
    final: str,
    entries: dict[str, Any],
    manifest: dict[str, Any],
    catalog: Catalog,
    *,
    step: int | None,
    thread_count: int,
) -> dict[str, Any]:
    """The reference the save ``final`` records to the base holding the frozen weights of
    ``entries`` (this rank's): the base written last by this process for the run directory when
    every rank's frozen tensors are unchanged since and it is still there as written, else a new
    base written now (collective, the save's protocol: staged, checked, committed). The frozen
    entries are removed from ``entries``."""
    parent = fs.dirname(final)
    keys = frozen_keys(catalog, entries)
    state = _tensor_state(entries, keys)
    known = _BASES.get(parent)
    unchanged = all(gather_objects(known is not None and known.tensors == state))
    if unchanged and rank0_decides(_still_committed, parent, known.reference):
        reference = known.reference
    else:
        frozen = {k: entries[k] for k in keys}
        reference = _write_base(parent, base_name(step, fs.basename(final)), frozen, manifest, catalog, thread_count)
        _BASES[parent] = _Written(reference, state)
    for key in keys:
        del entries[key]
    return reference


def _write_base(
    parent: str, name: str, entries: dict[str, Any], manifest: dict[str, Any], catalog: Catalog, thread_count: int
) -> dict[str, Any]:
    """Write ``entries`` (frozen weights) as the base ``name`` of ``parent`` (or the first free
    name after it) and return the reference to it."""
    name = rank0_decides(_free_name, parent, name)
    final = fs.join(parent, name)
    ranks = Job.current(None, same_error=True)
    with contextlib.ExitStack() as lock:
        destination = destination_for(final)
        lock.callback(destination.close)
        tmp = rank0_decides(lambda: destination.open(clean_parent=True))
        writer = CommittingWriter(
            destination,
            tmp,
            {**manifest, "role": BASE_ROLE, "has_optimizer": False, "include_grads": False},
            thread_count=thread_count,
        )

        def conclude(parts: list[RankWrites]) -> None:
            writer.commit(*build_index(catalog, parts))

        write_and_commit(
            ranks,
            f"{final}: not saved (the base of the frozen weights)",
            tmp,
            lambda _: write_own_chunks(writer, entries, MfsdpSavePlanner(), ranks.rank),
            conclude,
            destination.abort,
        )
    return rank0_decides(lambda: reference_to(name, read_manifest(final)))
